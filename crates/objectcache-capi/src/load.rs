//! Load and transfer exports: posting a load (contiguous or paged), per-layer poll and wait,
//! chunk status, stats, stall advice, cancel and release.

use super::*;

/// Posts a layer-ordered load. See the header.
///
/// # Safety
/// Pointers as the header states; destinations lie in registered memory (checked).
#[no_mangle]
pub unsafe extern "C" fn objectcache_load(
    engine: *mut objectcache_engine,
    params: *const objectcache_load_params,
    out: *mut *mut objectcache_transfer,
) -> objectcache_status {
    let dests = |p: &objectcache_load_params, g: &KvGeometry, need: u64, ctx: &Ctx| {
        if p.n_layers != g.layers as usize {
            return Err(ctx(format!(
                "params->n_layers is {}, geometry has {} layers",
                p.n_layers, g.layers
            )));
        }
        // SAFETY: the header's contract: n_layers destinations.
        let dests = unsafe { slice(p.layers, p.n_layers, "params->layers")? };
        // Only the first `need` bytes are ever written.
        let len = usize::try_from(need).map_err(|_| ctx("load too large".into()))?;
        let mut ranges = Vec::with_capacity(dests.len());
        for (l, d) in dests.iter().enumerate() {
            if d.addr.is_null() {
                return Err(ctx(format!("params->layers[{l}].addr is NULL")));
            }
            if d.len < need {
                let (n, slice) = (p.n_chunks, g.slice_bytes());
                return Err(ctx(format!(
                    "params->layers[{l}].len is {} bytes, needs {n} chunks x {slice} bytes = {need}",
                    d.len
                )));
            }
            ranges.push(vec![(d.addr.cast::<u8>(), len)]);
        }
        Ok(ranges)
    };
    // SAFETY: the header's contract on the arguments, forwarded.
    unsafe { post("objectcache_load", engine, params, out, dests) }
}

/// Posts a layer-ordered load into paged destinations. See the header.
///
/// # Safety
/// Pointers as the header states; destinations lie in registered memory (checked).
#[no_mangle]
pub unsafe extern "C" fn objectcache_load_paged(
    engine: *mut objectcache_engine,
    params: *const objectcache_paged_load_params,
    out: *mut *mut objectcache_transfer,
) -> objectcache_status {
    let dests = |p: &objectcache_paged_load_params, g: &KvGeometry, need: u64, ctx: &Ctx| {
        let (per_layer, n_layers) = (p.ranges_per_layer, p.n_layers);
        // SAFETY: the header's contract: n_layers x ranges_per_layer ranges.
        unsafe { paged_ranges(p.ranges, per_layer, n_layers, g.layers, need, false) }.map_err(ctx)
    };
    // SAFETY: the header's contract on the arguments, forwarded.
    unsafe { post("objectcache_load_paged", engine, params, out, dests) }
}

/// The fields both load parameter structs begin with (the header's
/// `objectcache_load_params` and `objectcache_paged_load_params`).
trait LoadParams: AbiStruct {
    /// `(request_id, geometry, hashes, hash_len, n_chunks)`.
    fn what(&self) -> (u64, *const objectcache_geometry, *const u8, usize, usize);
    /// `(priority, deadline_ms, compute_us_per_layer)`.
    fn hints(&self) -> (u32, u64, u64);
}

macro_rules! load_params {
    ($($t:ty),*) => {$(
        impl LoadParams for $t {
            fn what(&self) -> (u64, *const objectcache_geometry, *const u8, usize, usize) {
                (self.request_id, self.geometry, self.hashes, self.hash_len, self.n_chunks)
            }
            fn hints(&self) -> (u32, u64, u64) {
                (self.priority, self.deadline_ms, self.compute_us_per_layer)
            }
        }
    )*};
}
load_params!(objectcache_load_params, objectcache_paged_load_params);

/// What a load export does around its destinations: checks the engine, `params` (its geometry
/// and chunk hashes) and `out`; asks `dests` for the per-layer `(pointer, length)` ranges,
/// given the params, the geometry, the bytes each layer needs (`n_chunks x slice_bytes`) and a
/// function prefixing a message with the request id; starts the load with the params' hints
/// and writes its transfer handle to `out`. Errors and panics become statuses (`guard`).
///
/// # Safety
/// The header's contract on `params` (a valid struct of its kind, its geometry and hashes)
/// and `out`.
unsafe fn post<P: LoadParams>(
    func: &str,
    engine: *mut objectcache_engine,
    params: *const P,
    out: *mut *mut objectcache_transfer,
    dests: impl FnOnce(&P, &KvGeometry, u64, &Ctx) -> Result<Ranges, CErr>,
) -> objectcache_status {
    guard(func, || {
        let e = get_engine(engine)?;
        need_out(out, "out")?;
        // SAFETY: the header's contract on `params`.
        let p = unsafe { in_struct(params, "params")? };
        let (rid, geometry, hashes, hash_len, n_chunks) = p.what();
        let ctx = move |m: String| invalid(format!("request {rid}: {m}"));
        // SAFETY: the header's contract on the geometry and hashes.
        let (g, hs) = unsafe { load_what(rid, geometry, hashes, hash_len, n_chunks)? };
        let need = n_chunks as u64 * g.slice_bytes();
        let ranges = dests(p, &g, need, &ctx)?;
        let (priority, deadline_ms, compute_us) = p.hints();
        let hints = load_hints(priority, deadline_ms, compute_us, g.layers);
        let id = post_load(e, rid, g, hs, hints, ranges)?;
        // SAFETY: checked by need_out above.
        unsafe { out_val(out, token(id), "out")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// Per layer, the `(pointer, length)` ranges taken in order as its logical buffer.
type Ranges = Vec<Vec<(*mut u8, usize)>>;

/// Prefixes a message with the load's request id (an invalid-argument error).
type Ctx = dyn Fn(String) -> CErr;

/// The geometry and chunk hashes of a load, errors prefixed with the request id.
///
/// # Safety
/// As [`geometry`] and [`hashes`].
unsafe fn load_what(
    rid: u64,
    geometry: *const objectcache_geometry,
    hashes: *const u8,
    hash_len: usize,
    n_chunks: usize,
) -> Result<(KvGeometry, Vec<ChunkHash>), CErr> {
    // SAFETY: forwarded contract (no hash is read for 0 chunks, refused next).
    let (g, hs) = unsafe { geometry_and_hashes(geometry, hashes, hash_len, n_chunks) }
        .map_err(|x| err(x.code, format!("request {rid}: params->{}", x.msg)))?;
    if n_chunks == 0 {
        return Err(invalid(format!("request {rid}: params->n_chunks is 0")));
    }
    Ok((g, hs))
}

/// Reads `n_layers x per_layer` ranges (layer-major) and checks them: `n_layers` is the
/// geometry's `layers`, every range is non-empty (and non-NULL), and each layer's ranges add
/// up to exactly `need` bytes. Returns `(pointer, length)` per range, per layer. `source`
/// names the ranges in messages as a save's sources rather than a load's destinations.
///
/// # Safety
/// `p` is valid for `n_layers x per_layer` ranges when that is nonzero.
pub(super) unsafe fn paged_ranges(
    p: *const objectcache_range,
    per_layer: usize,
    n_layers: usize,
    layers: u32,
    need: u64,
    source: bool,
) -> Result<Vec<Vec<(*mut u8, usize)>>, String> {
    if n_layers != layers as usize {
        return Err(format!(
            "n_layers is {n_layers}, geometry has {layers} layers"
        ));
    }
    if per_layer == 0 {
        return Err("ranges_per_layer is 0".into());
    }
    let n = per_layer
        .checked_mul(n_layers)
        .ok_or_else(|| format!("{n_layers} layers x {per_layer} ranges overflow"))?;
    // SAFETY: forwarded contract.
    let all = unsafe { slice(p, n, "ranges") }.map_err(|e| e.msg)?;
    let what = if source { "source" } else { "destination" };
    let mut out = Vec::with_capacity(n_layers);
    for (l, rs) in all.chunks_exact(per_layer).enumerate() {
        let mut layer = Vec::with_capacity(per_layer);
        let mut total: u64 = 0;
        for (i, r) in rs.iter().enumerate() {
            let at = format!("ranges[{}] (layer {l} range {i})", l * per_layer + i);
            if r.addr.is_null() {
                return Err(format!("{at}: addr is NULL"));
            }
            if r.len == 0 {
                return Err(format!("{at}: len is 0"));
            }
            let len = usize::try_from(r.len)
                .ok()
                .filter(|&n| n <= isize::MAX as usize && r.addr.addr().checked_add(n).is_some())
                .ok_or_else(|| format!("{at}: {:p} + {} bytes overflows", r.addr, r.len))?;
            total = total.saturating_add(r.len);
            layer.push((r.addr.cast::<u8>(), len));
        }
        if total != need {
            return Err(format!(
                "the {what} ranges of layer {l} add up to {total} bytes; the load's chunks \
                 need exactly {need} per layer (n_chunks x slice bytes)"
            ));
        }
        out.push(layer);
    }
    Ok(out)
}

/// Starts a load into registered memory (`ranges`: per layer, `(pointer, length)` ranges
/// taken in order as the layer's logical buffer; [`Engine::load_registered`] checks them) and
/// registers its transfer.
fn post_load(
    e: Arc<EngineObj>,
    rid: u64,
    geometry: KvGeometry,
    hashes: Vec<ChunkHash>,
    hints: LoadHints,
    ranges: Ranges,
) -> Result<usize, CErr> {
    let busy = Busy::new(e.clone());
    let req = LoadRequest {
        hints,
        geometry,
        hashes,
    };
    let load = e
        .engine
        .load_registered(req, ranges)
        .map_err(|x| err(error_code(&x), format!("request {rid}: {x}")))?;
    Ok(insert(Obj::Transfer(Arc::new(TransferObj {
        load,
        _busy: busy,
        request_id: rid,
        released: Released(Arc::new((Mutex::new(false), Condvar::new()))),
    }))))
}

/// The scheduling hints of `objectcache_load_params` as the Rust API's [`LoadHints`]:
///
/// - `priority` (C: larger is more urgent, 0 = normal) becomes `128 + priority`, at most 255
///   (Rust: 0..=255, default 128, higher first);
/// - `compute_us_per_layer` > 0 gives every one of `layers` layers that compute time;
///   with `deadline_ms` > 0 as well, layer `l` is needed at `deadline_ms / 1e3 + l x
///   compute_us_per_layer / 1e6` seconds; `deadline_ms` alone means every layer is needed by
///   then (the later layers' times are unknown, so the conservative reading).
///
/// Out-of-range values (above `u32::MAX` microseconds, the wire's limit) are refused by
/// `Engine::load` with an error naming the hint.
pub(super) fn load_hints(
    priority: u32,
    deadline_ms: u64,
    compute_us_per_layer: u64,
    layers: u32,
) -> LoadHints {
    let priority = u8::try_from(128u64 + u64::from(priority)).unwrap_or(u8::MAX);
    let n = layers as usize;
    let compute_s = compute_us_per_layer as f64 * 1e-6;
    let deadline_s = deadline_ms as f64 * 1e-3;
    let timing = match (deadline_ms, compute_us_per_layer) {
        (0, 0) => LayerTiming::None,
        (0, _) => LayerTiming::ComputeS(vec![compute_s; n]),
        (_, 0) => LayerTiming::DeadlinesS(vec![deadline_s; n]),
        (_, _) => {
            LayerTiming::DeadlinesS((0..n).map(|l| deadline_s + l as f64 * compute_s).collect())
        }
    };
    LoadHints {
        timing,
        priority,
        ..LoadHints::default()
    }
}

fn check_layer(t: &TransferObj, layer: u32) -> Result<usize, CErr> {
    let n = t.load.handle().layers();
    let l = layer as usize;
    if l >= n {
        return Err(invalid(format!(
            "layer {layer} is out of range: the transfer has {n} layers"
        )));
    }
    Ok(l)
}

impl TransferObj {
    /// Layer `l`'s status as the caller sees it: on the device for device destinations.
    pub(super) fn poll(&self, l: usize) -> LayerStatus {
        self.load.poll_layer(l)
    }

    /// Blocking wait for layer `l` (see [`RegisteredLoad::wait_layer_blocking`]).
    pub(super) fn wait(&self, l: usize, to: Option<Duration>) -> LayerResult<()> {
        self.load.wait_layer_blocking(l, to)
    }
}

fn layer_result(t: &TransferObj, l: usize, s: LayerStatus) -> Result<objectcache_status, CErr> {
    match s {
        LayerStatus::Ready => Ok(OBJECTCACHE_OK),
        LayerStatus::Pending => Ok(OBJECTCACHE_PENDING),
        LayerStatus::Failed(e) => Err(err(
            layer_code(&e),
            format!("request {} layer {l}: {e}", t.request_id),
        )),
    }
}

/// Waits for layer `l` until `deadline`; `PENDING` if it passes first.
fn wait_one(
    t: &TransferObj,
    l: usize,
    deadline: Option<Instant>,
) -> Result<objectcache_status, CErr> {
    let to = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    match t.wait(l, to) {
        Ok(()) => Ok(OBJECTCACHE_OK),
        // A wait that timed out leaves the layer pending; the load's own deadline fails it.
        Err(LayerError::Timeout { .. }) => layer_result(t, l, t.poll(l)),
        Err(e) => layer_result(t, l, LayerStatus::Failed(e)),
    }
}

/// Non-blocking layer status. See the header.
///
/// # Safety
/// None beyond the header's: the handle is a token, checked before use.
#[no_mangle]
pub unsafe extern "C" fn objectcache_transfer_poll_layer(
    transfer: *mut objectcache_transfer,
    layer: u32,
) -> objectcache_status {
    guard("objectcache_transfer_poll_layer", || {
        let t = get_transfer(transfer)?;
        let l = check_layer(&t, layer)?;
        layer_result(&t, l, t.poll(l))
    })
}

/// Blocking wait for one layer. See the header.
///
/// # Safety
/// None beyond the header's: the handle is a token, checked before use.
#[no_mangle]
pub unsafe extern "C" fn objectcache_transfer_wait_layer(
    transfer: *mut objectcache_transfer,
    layer: u32,
    timeout_ms: i64,
) -> objectcache_status {
    guard("objectcache_transfer_wait_layer", || {
        let t = get_transfer(transfer)?;
        let l = check_layer(&t, layer)?;
        let deadline = timeout(timeout_ms)?.map(|d| Instant::now() + d);
        wait_one(&t, l, deadline)
    })
}

/// Blocking wait for every layer. See the header.
///
/// # Safety
/// None beyond the header's: the handle is a token, checked before use.
#[no_mangle]
pub unsafe extern "C" fn objectcache_transfer_wait_all(
    transfer: *mut objectcache_transfer,
    timeout_ms: i64,
) -> objectcache_status {
    guard("objectcache_transfer_wait_all", || {
        let t = get_transfer(transfer)?;
        let deadline = timeout(timeout_ms)?.map(|d| Instant::now() + d);
        for l in 0..t.load.handle().layers() {
            let s = wait_one(&t, l, deadline)?;
            if s != OBJECTCACHE_OK {
                return Ok(s);
            }
        }
        Ok(OBJECTCACHE_OK)
    })
}

/// Per-chunk status. See the header.
///
/// # Safety
/// `out` valid for `cap` bytes; `n` writable.
#[no_mangle]
pub unsafe extern "C" fn objectcache_transfer_chunk_status(
    transfer: *mut objectcache_transfer,
    out: *mut u8,
    cap: usize,
    n: *mut usize,
) -> objectcache_status {
    guard("objectcache_transfer_chunk_status", || {
        let t = get_transfer(transfer)?;
        need_out(n, "n")?;
        let st = t.load.handle().chunk_status();
        // SAFETY: checked by need_out above.
        unsafe { out_val(n, st.len(), "n")? };
        if cap < st.len() {
            return Err(err(
                OBJECTCACHE_ERR_BUFFER_TOO_SMALL,
                format!("out has {cap} bytes, the transfer has {} chunks", st.len()),
            ));
        }
        if !st.is_empty() {
            if out.is_null() {
                return Err(invalid("out is NULL"));
            }
            // SAFETY: non-NULL, and the caller promises cap >= st.len() writable bytes.
            let dst = unsafe { std::slice::from_raw_parts_mut(out, st.len()) };
            for (d, s) in dst.iter_mut().zip(&st) {
                *d = chunk_code(*s);
            }
        }
        Ok(OBJECTCACHE_OK)
    })
}

fn chunk_code(s: ChunkStatus) -> u8 {
    (match s {
        ChunkStatus::Pending => OBJECTCACHE_CHUNK_PENDING,
        ChunkStatus::Ok => OBJECTCACHE_CHUNK_OK,
        ChunkStatus::Missing => OBJECTCACHE_CHUNK_MISSING,
        ChunkStatus::Corrupt => OBJECTCACHE_CHUNK_CORRUPT,
        ChunkStatus::WrongGeometry => OBJECTCACHE_CHUNK_WRONG_GEOMETRY,
        ChunkStatus::Error => OBJECTCACHE_CHUNK_ERROR,
    }) as u8
}

/// Transfer counters. See the header.
///
/// # Safety
/// `out` as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_transfer_stats_get(
    transfer: *mut objectcache_transfer,
    out: *mut objectcache_transfer_stats,
) -> objectcache_status {
    guard("objectcache_transfer_stats_get", || {
        let t = get_transfer(transfer)?;
        let ready = (0..t.load.handle().layers())
            .filter(|&l| t.poll(l) == LayerStatus::Ready)
            .count();
        let s = t.load.handle().stats();
        let v = objectcache_transfer_stats {
            struct_size: 0,
            layers_ready: ready as u32,
            request_id: t.request_id,
            requests: s.requests,
            bytes: s.bytes,
            ttfl_s: s.ttfl_s.unwrap_or(-1.0),
            ttll_s: s.ttll_s.unwrap_or(-1.0),
        };
        // SAFETY: the header's contract on `out`.
        unsafe { out_struct(out, v, "out")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// The planner's deadline fallback for a transfer, now. See the header.
///
/// # Safety
/// `params` and `out` as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_transfer_stall_advice(
    transfer: *mut objectcache_transfer,
    params: *const objectcache_stall_params,
    out: *mut objectcache_stall_advice,
) -> objectcache_status {
    guard("objectcache_transfer_stall_advice", || {
        let t = get_transfer(transfer)?;
        // SAFETY: the header's contract on `params`.
        let p = unsafe { in_struct(params, "params")? };
        need_out(out, "out")?;
        // SAFETY: the header's contract on the strings (borrowed for the call).
        let (model, gpu) =
            unsafe { (cstr(p.model, "params->model")?, cstr(p.gpu, "params->gpu")?) };
        let kernels = if p.kernels.is_null() {
            "tuned"
        } else {
            // SAFETY: as above.
            unsafe { cstr(p.kernels, "params->kernels")? }
        };
        let m = objectcache_client::sched::ComputeModel::from_settings(
            model,
            gpu,
            kernels,
            p.tp.max(1),
            p.compute_us_per_layer,
            p.load_tokens,
            p.new_tokens,
        )
        .map_err(|e| match e {
            Error::InvalidArgument(m) => invalid(format!("params: {m}")),
            other => CErr::from(other),
        })?;
        let advice = t
            .load
            .handle()
            .stall_advice(&m, p.load_tokens, p.new_tokens)
            .map_err(|e| invalid(e.to_string()))?;
        let v = match advice {
            objectcache_client::sched::Fallback::Wait { finish_s } => objectcache_stall_advice {
                struct_size: 0,
                recompute: 0,
                from_layer: t.load.handle().layers() as u32,
                _reserved: 0,
                recompute_tokens: 0,
                finish_s,
                wait_finish_s: finish_s,
            },
            objectcache_client::sched::Fallback::Recompute {
                from_layer,
                tokens,
                finish_s,
                wait_finish_s,
            } => objectcache_stall_advice {
                struct_size: 0,
                recompute: 1,
                from_layer: from_layer as u32,
                _reserved: 0,
                recompute_tokens: tokens,
                finish_s,
                wait_finish_s,
            },
        };
        // SAFETY: the header's contract on `out`.
        unsafe { out_struct(out, v, "out")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// Cancels a transfer. See the header.
///
/// # Safety
/// None beyond the header's: the handle is a token, checked before use.
#[no_mangle]
pub unsafe extern "C" fn objectcache_transfer_cancel(
    transfer: *mut objectcache_transfer,
) -> objectcache_status {
    guard("objectcache_transfer_cancel", || {
        get_transfer(transfer)?.load.handle().cancel();
        Ok(OBJECTCACHE_OK)
    })
}

/// Releases a transfer, waiting for in-flight copies. See the header.
///
/// # Safety
/// None beyond the header's: the handle is a token, checked before use.
#[no_mangle]
pub unsafe extern "C" fn objectcache_transfer_release(
    transfer: *mut objectcache_transfer,
) -> objectcache_status {
    guard("objectcache_transfer_release", || {
        let id = transfer.addr();
        // Take it out of the registry first: from now on the token is refused everywhere.
        let t = {
            let mut reg = registry();
            match reg.get(&id) {
                Some(Obj::Transfer(_)) => match reg.remove(&id) {
                    Some(Obj::Transfer(t)) => t,
                    _ => unreachable!("checked above under the same lock"),
                },
                _ => {
                    drop(reg);
                    // Same error text as any other call with this handle.
                    get_transfer(transfer)?;
                    unreachable!("get_transfer fails for a token not in the registry");
                }
            }
        };
        // Wake waiters on other threads (their layers fail with Cancelled), let go of the
        // transfer, and wait until it is dropped whole (by whichever thread holds it last:
        // `TransferObj`'s fields drop in the order that makes the memory free).
        t.load.handle().cancel();
        let released = t.released.0.clone();
        drop(t);
        let (done, cv) = &*released;
        let mut d = lock(done);
        while !*d {
            d = cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
        Ok(OBJECTCACHE_OK)
    })
}
