//! Engine exports: create and destroy, memory registration, metrics.

use super::*;

/// Creates an engine from key/value settings. See the header.
///
/// # Safety
/// Pointers as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_engine_create(
    abi_version: u32,
    keys: *const *const c_char,
    values: *const *const c_char,
    n: usize,
    out: *mut *mut objectcache_engine,
) -> objectcache_status {
    guard("objectcache_engine_create", || {
        need_out(out, "out")?;
        if abi_version != OBJECTCACHE_ABI_VERSION {
            return Err(err(
                OBJECTCACHE_ERR_ABI_MISMATCH,
                format!(
                    "caller was built for ABI version {abi_version}, this library has ABI \
                     version {OBJECTCACHE_ABI_VERSION}"
                ),
            ));
        }
        // SAFETY: the header's contract: n string pointers each.
        let ks = unsafe { slice(keys, n, "keys")? };
        // SAFETY: as above.
        let vs = unsafe { slice(values, n, "values")? };
        let mut pairs = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: each entry is a NUL-terminated string by contract (NULL refused).
            let k = unsafe { cstr(ks[i], &format!("keys[{i}]"))? };
            // SAFETY: as above.
            let v = unsafe { cstr(vs[i], &format!("values[{i}] (key {k:?})"))? };
            pairs.push((k, v));
        }
        let cfg = EngineConfig::from_pairs(pairs)?;
        let engine = Engine::new(cfg)?;
        let id = insert(Obj::Engine(Arc::new(EngineObj {
            engine,
            live_transfers: AtomicUsize::new(0),
            regions: Mutex::new(Vec::new()),
        })));
        // SAFETY: checked by need_out above.
        unsafe { out_val(out, token(id), "out")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// Destroys an engine. See the header.
///
/// # Safety
/// None beyond the header's: the handle is a token, checked before use.
#[no_mangle]
pub unsafe extern "C" fn objectcache_engine_destroy(
    engine: *mut objectcache_engine,
) -> objectcache_status {
    guard("objectcache_engine_destroy", || {
        let e = get_engine(engine)?;
        {
            let mut reg = registry();
            let live = e.live_transfers.load(Ordering::Acquire);
            if live > 0 {
                return Err(err(
                    OBJECTCACHE_ERR_BUSY,
                    format!("{live} transfer(s) of this engine are not released"),
                ));
            }
            // Only one of two racing destroys finds the token.
            if reg.remove(&engine.addr()).is_none() {
                return Err(err(
                    OBJECTCACHE_ERR_INVALID_HANDLE,
                    "engine handle is not live (already destroyed)",
                ));
            }
        }
        // Lock order everywhere: an engine's region list before the registry, never both
        // the other way round.
        let regions: Vec<usize> = lock(&e.regions).drain(..).collect();
        let mut reg = registry();
        for r in regions {
            reg.remove(&r);
        }
        drop(reg);
        // The engine itself drops with the last reference (here, or in a call still running
        // on another thread).
        drop(e);
        Ok(OBJECTCACHE_OK)
    })
}

/// Registers memory that loads may write into. See the header.
///
/// # Safety
/// `addr..addr+len` stays valid and writable until deregistered (the caller's promise).
#[no_mangle]
pub unsafe extern "C" fn objectcache_register_memory(
    engine: *mut objectcache_engine,
    addr: *mut c_void,
    len: usize,
    kind: i32,
    device: i32,
    out: *mut *mut objectcache_region,
) -> objectcache_status {
    guard("objectcache_register_memory", || {
        let e = get_engine(engine)?;
        need_out(out, "out")?;
        let kind = match kind {
            OBJECTCACHE_MEM_HOST => MemoryKind::Host,
            OBJECTCACHE_MEM_DEVICE => MemoryKind::Device { ordinal: device },
            k => {
                return Err(invalid(format!(
                    "kind {k} is not OBJECTCACHE_MEM_HOST (0) or OBJECTCACHE_MEM_DEVICE (1)"
                )))
            }
        };
        // Lock order everywhere: an engine's region list before the registry.
        let mut regions = lock(&e.regions);
        // SAFETY: the header's contract: the memory stays valid and writable until
        // deregistered, and the caller does not touch a transfer's destinations until it is
        // released (which is `register_memory`'s contract).
        let rid = unsafe { e.engine.register_memory(addr.cast::<u8>(), len, kind)? };
        let id = insert(Obj::Region(Arc::new(RegionObj {
            engine: engine.addr(),
            id: rid,
        })));
        regions.push(id);
        drop(regions);
        // SAFETY: checked by need_out above.
        unsafe { out_val(out, token(id), "out")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// Deregisters a region. See the header.
///
/// # Safety
/// None beyond the header's: handles are tokens, checked before use.
#[no_mangle]
pub unsafe extern "C" fn objectcache_deregister_memory(
    engine: *mut objectcache_engine,
    region: *mut objectcache_region,
) -> objectcache_status {
    guard("objectcache_deregister_memory", || {
        let e = get_engine(engine)?;
        let r = match lookup_obj(region, "region")? {
            (_, Obj::Region(r)) => r,
            (id, o) => return Err(wrong_kind(id, &o, "a memory region")),
        };
        if r.engine != engine.addr() {
            return Err(err(
                OBJECTCACHE_ERR_INVALID_HANDLE,
                format!("region {:#x} belongs to another engine", region.addr()),
            ));
        }
        let mut regions = lock(&e.regions);
        e.engine.deregister_memory(r.id)?;
        regions.retain(|&t| t != region.addr());
        registry().remove(&region.addr());
        drop(regions);
        Ok(OBJECTCACHE_OK)
    })
}

/// The store self-check's mode (`EngineMetrics::store_mode`). See the header.
///
/// # Safety
/// `out` as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_store_mode(
    engine: *mut objectcache_engine,
    out: *mut u32,
) -> objectcache_status {
    guard("objectcache_store_mode", || {
        let e = get_engine(engine)?;
        let mode = e.engine.metrics().store_mode as u32;
        // SAFETY: the header's contract on `out`.
        unsafe { out_val(out, mode, "out")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// Engine counters. See the header.
///
/// # Safety
/// `out` as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_metrics_get(
    engine: *mut objectcache_engine,
    out: *mut objectcache_metrics,
) -> objectcache_status {
    guard("objectcache_metrics_get", || {
        let e = get_engine(engine)?;
        let m = e.engine.metrics();
        let v = objectcache_metrics {
            struct_size: 0,
            _reserved: 0,
            loads: m.loads,
            saves: m.saves,
            lookups: m.lookups,
            lookup_hit_chunks: m.lookup_hit_chunks,
            lookup_probes: m.lookup_probes,
            bytes_saved: m.bytes_saved,
            live_transfers: e.live_transfers.load(Ordering::Acquire) as u64,
            registered_regions: e.engine.registered_regions() as u64,
        };
        // SAFETY: the header's contract on `out`.
        unsafe { out_struct(out, v, "out")? };
        Ok(OBJECTCACHE_OK)
    })
}
