//! The C ABI (`ffi/objectcache.h`): a thin layer over [`crate::connector`].
//!
//! Every exported function is `extern "C"` with `#[no_mangle]`, named and typed exactly as in
//! the header (checked at build time by `build.rs`, which generates the header's Rust view
//! with bindgen and asserts that every signature, struct layout and constant here matches).
//!
//! Rules kept by every export (see `docs/c-abi.md`):
//! - no panic crosses the boundary: the body runs under [`std::panic::catch_unwind`] and a
//!   panic becomes [`OBJECTCACHE_ERR_INTERNAL`];
//! - every pointer is checked (NULL, alignment, `struct_size`) before it is dereferenced;
//! - handles are opaque tokens looked up in a registry, never addresses: a released or
//!   destroyed handle is refused with [`OBJECTCACHE_ERR_INVALID_HANDLE`] instead of being
//!   dereferenced, and tokens are never reused;
//! - errors set a thread-local message read by `objectcache_last_error`.
#![allow(unsafe_code)]
#![allow(non_camel_case_types)]

mod types;

pub use types::*;

use crate::connector::{
    ChunkStatus, Engine, EngineConfig, LayerStatus, LayerTiming, LoadHints, LoadRequest,
    MemoryKind, RegionId, RegisteredLoad,
};
use crate::error::{Error, LayerError, StoreError};
use crate::hash::{chunk_hashes, HashParams};
use crate::layout::{ChunkHash, Dtype, KvGeometry};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[cfg(objectcache_abi_check)]
#[allow(
    dead_code,
    non_upper_case_globals,
    non_snake_case,
    clippy::all,
    missing_docs,
    unused_imports
)]
mod abi_check {
    include!(concat!(env!("OUT_DIR"), "/objectcache_abi_check.rs"));
}

// ---- Errors -------------------------------------------------------------------------------

/// An error on its way to C: a status code and a message.
#[derive(Debug)]
struct CErr {
    code: objectcache_status,
    msg: String,
}

fn err(code: objectcache_status, msg: impl Into<String>) -> CErr {
    CErr {
        code,
        msg: msg.into(),
    }
}

fn invalid(msg: impl Into<String>) -> CErr {
    err(OBJECTCACHE_ERR_INVALID_ARGUMENT, msg)
}

/// The stable status code of a layer miss.
fn layer_code(e: &LayerError) -> objectcache_status {
    match e {
        LayerError::Missing { .. } => OBJECTCACHE_ERR_LAYER_MISSING,
        LayerError::ChecksumMismatch { .. } => OBJECTCACHE_ERR_LAYER_CHECKSUM,
        LayerError::GeometryMismatch { .. } => OBJECTCACHE_ERR_LAYER_GEOMETRY,
        LayerError::Storage { .. } => OBJECTCACHE_ERR_LAYER_STORAGE,
        // A stall is a timeout of progress; the message says which.
        LayerError::Timeout { .. } | LayerError::Stalled { .. } => OBJECTCACHE_ERR_LAYER_TIMEOUT,
        LayerError::Cancelled => OBJECTCACHE_ERR_CANCELLED,
        LayerError::Device { .. } => OBJECTCACHE_ERR_LAYER_DEVICE,
        // `LayerError` is `#[non_exhaustive]` (objectcache-core): a kind added there reads as
        // a storage miss until it gets a code of its own; the message names it.
        _ => OBJECTCACHE_ERR_LAYER_STORAGE,
    }
}

/// The stable status code of a crate error.
fn error_code(e: &Error) -> objectcache_status {
    match e {
        Error::InvalidArgument(_) => OBJECTCACHE_ERR_INVALID_ARGUMENT,
        Error::Config(_) => OBJECTCACHE_ERR_CONFIG,
        Error::Format(_) => OBJECTCACHE_ERR_FORMAT,
        Error::Store(StoreError::NotFound { .. }) => OBJECTCACHE_ERR_NOT_FOUND,
        Error::Store(_) => OBJECTCACHE_ERR_STORE,
        Error::Layer(l) => layer_code(l),
        Error::Io(_) => OBJECTCACHE_ERR_IO,
        Error::Busy(_) => OBJECTCACHE_ERR_BUSY,
        Error::Unsupported(_) => OBJECTCACHE_ERR_UNSUPPORTED,
        // `Error` is `#[non_exhaustive]` (objectcache-core): a kind added there reads as
        // internal until it gets a code of its own; the message names it.
        _ => OBJECTCACHE_ERR_INTERNAL,
    }
}

impl From<Error> for CErr {
    fn from(e: Error) -> Self {
        err(error_code(&e), e.to_string())
    }
}

impl From<LayerError> for CErr {
    fn from(e: LayerError) -> Self {
        err(layer_code(&e), e.to_string())
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Runs an export's body: catches panics, maps errors to codes and records the message.
fn guard(func: &str, f: impl FnOnce() -> Result<objectcache_status, CErr>) -> objectcache_status {
    let r = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let what = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(err(
            OBJECTCACHE_ERR_INTERNAL,
            format!("internal error (panic): {what}"),
        ))
    });
    match r {
        Ok(code) => code,
        Err(e) => {
            set_last_error(&format!("{func}: {}", e.msg));
            e.code
        }
    }
}

// ---- Pointer checks (every dereference goes through one of these) -------------------------

/// A borrowed NUL-terminated UTF-8 string.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
unsafe fn cstr<'a>(p: *const c_char, what: &str) -> Result<&'a str, CErr> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string valid for the call.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|_| invalid(format!("{what} is not valid UTF-8")))
}

/// A borrowed array of `n` elements (`p` may be NULL only when `n` is 0).
///
/// # Safety
/// When `n > 0`, `p` points to `n` initialised elements valid for the call.
unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], CErr> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL but its count is {n}")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    if n.checked_mul(std::mem::size_of::<T>().max(1))
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(invalid(format!("{what}: count {n} is too large")));
    }
    // SAFETY: non-NULL, aligned, size in range; the caller promises n valid elements.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Checks the `struct_size` that starts every ABI struct before touching the rest.
///
/// # Safety
/// `p` is NULL or points to at least 4 readable bytes (the caller's `struct_size`), and to a
/// whole `T` if those hold `size_of::<T>()`.
unsafe fn checked_struct<T: AbiStruct>(p: *const T, what: &str) -> Result<(), CErr> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    // SAFETY: non-NULL and aligned; every version of every ABI struct starts with a u32.
    let size = unsafe { std::ptr::read(p as *const u32) } as usize;
    let want = std::mem::size_of::<T>();
    if size != want {
        return Err(err(
            OBJECTCACHE_ERR_ABI_MISMATCH,
            format!(
                "{what}->struct_size is {size}, this library (ABI version {}) expects \
                 sizeof({}) = {want}; rebuild against the installed objectcache.h",
                OBJECTCACHE_ABI_VERSION,
                T::NAME
            ),
        ));
    }
    Ok(())
}

/// A borrowed input struct after its size check.
///
/// # Safety
/// As [`checked_struct`], and the struct is initialised and valid for the call.
unsafe fn in_struct<'a, T: AbiStruct>(p: *const T, what: &str) -> Result<&'a T, CErr> {
    // SAFETY: forwarded contract.
    unsafe { checked_struct(p, what)? };
    // SAFETY: checked non-NULL, aligned and of the right size.
    Ok(unsafe { &*p })
}

/// Writes an output struct after its size check (`v.struct_size` is set here).
///
/// # Safety
/// As [`checked_struct`], and the struct is writable.
unsafe fn out_struct<T: AbiStruct>(p: *mut T, mut v: T, what: &str) -> Result<(), CErr> {
    // SAFETY: forwarded contract.
    unsafe { checked_struct(p as *const T, what)? };
    v.set_size();
    // SAFETY: checked non-NULL, aligned and of the right size; the caller owns it writable.
    unsafe { std::ptr::write(p, v) };
    Ok(())
}

/// Writes one output value.
///
/// # Safety
/// `p` is NULL or valid for a write of `T`.
unsafe fn out_val<T>(p: *mut T, v: T, what: &str) -> Result<(), CErr> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    // SAFETY: non-NULL, aligned, writable by the caller's contract.
    unsafe { std::ptr::write(p, v) };
    Ok(())
}

/// Checks that an output pointer is usable before doing the work it reports.
fn need_out<T>(p: *mut T, what: &str) -> Result<(), CErr> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    Ok(())
}

// ---- Handle registry ----------------------------------------------------------------------

struct EngineObj {
    engine: Engine,
    live_transfers: AtomicUsize,
    /// Tokens of the regions registered with this engine.
    regions: Mutex<Vec<usize>>,
}

/// A region handle: the engine it was registered with (its token) and the engine's id of it.
struct RegionObj {
    engine: usize,
    id: RegionId,
}

/// One transfer's hold on its engine: while it lives, destroying the engine is refused.
/// (The regions a transfer writes into are held by its [`RegisteredLoad`].)
struct Busy {
    engine: Arc<EngineObj>,
}

impl Busy {
    fn new(engine: Arc<EngineObj>) -> Busy {
        engine.live_transfers.fetch_add(1, Ordering::AcqRel);
        Busy { engine }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.engine.live_transfers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Raised when a transfer has been dropped whole: its last field, so it drops after the
/// others (Rust drops fields in declaration order). `objectcache_transfer_release` waits for
/// it, whichever thread lets go of the transfer last.
struct Released(Arc<(Mutex<bool>, Condvar)>);

impl Drop for Released {
    fn drop(&mut self) {
        let (done, cv) = &*self.0;
        *lock(done) = true;
        cv.notify_all();
    }
}

/// A load started through the C ABI. Its fields drop in this order, which is the order
/// release needs: the load (dropping it waits for its device copies, stops every task of
/// the load and waits until none can touch the destinations, then lets the regions go),
/// then the hold on the engine, and last the signal that the transfer is gone.
struct TransferObj {
    load: RegisteredLoad,
    /// Held for its drop.
    _busy: Busy,
    request_id: u64,
    released: Released,
}

enum Obj {
    Engine(Arc<EngineObj>),
    Region(Arc<RegionObj>),
    Transfer(Arc<TransferObj>),
}

impl Obj {
    fn kind(&self) -> &'static str {
        match self {
            Obj::Engine(_) => "an engine",
            Obj::Region(_) => "a memory region",
            Obj::Transfer(_) => "a transfer",
        }
    }
}

static REGISTRY: LazyLock<Mutex<HashMap<usize, Obj>>> = LazyLock::new(Default::default);
/// Next handle token; tokens are never reused, so a stale handle is always detected.
static NEXT_TOKEN: AtomicUsize = AtomicUsize::new(0x10);

fn registry() -> MutexGuard<'static, HashMap<usize, Obj>> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn insert(o: Obj) -> usize {
    let id = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
    registry().insert(id, o);
    id
}

fn token<T>(id: usize) -> *mut T {
    std::ptr::without_provenance_mut(id)
}

fn lookup_obj<T>(p: *mut T, want: &'static str) -> Result<(usize, Obj), CErr> {
    let id = p.addr();
    if id == 0 {
        return Err(err(
            OBJECTCACHE_ERR_INVALID_HANDLE,
            format!("{want} handle is NULL"),
        ));
    }
    let reg = registry();
    let o = reg.get(&id).ok_or_else(|| {
        err(
            OBJECTCACHE_ERR_INVALID_HANDLE,
            format!(
                "{want} handle {id:#x} is not live (already released or destroyed, or never \
                 created)"
            ),
        )
    })?;
    let o = match o {
        Obj::Engine(e) => Obj::Engine(e.clone()),
        Obj::Region(r) => Obj::Region(r.clone()),
        Obj::Transfer(t) => Obj::Transfer(t.clone()),
    };
    Ok((id, o))
}

fn wrong_kind(id: usize, o: &Obj, want: &str) -> CErr {
    err(
        OBJECTCACHE_ERR_INVALID_HANDLE,
        format!("handle {id:#x} is {}, not {want}", o.kind()),
    )
}

fn get_engine(p: *mut objectcache_engine) -> Result<Arc<EngineObj>, CErr> {
    match lookup_obj(p, "engine")? {
        (_, Obj::Engine(e)) => Ok(e),
        (id, o) => Err(wrong_kind(id, &o, "an engine")),
    }
}

fn get_transfer(p: *mut objectcache_transfer) -> Result<Arc<TransferObj>, CErr> {
    match lookup_obj(p, "transfer")? {
        (_, Obj::Transfer(t)) => Ok(t),
        (id, o) => Err(wrong_kind(id, &o, "a transfer")),
    }
}

// ---- Conversions --------------------------------------------------------------------------

/// A caller's geometry. Its `struct_size` is `sizeof(objectcache_geometry)`, or
/// [`GEOMETRY_SIZE_NO_LAYOUT`] for a caller built before the layout fields existed (then only
/// that many bytes are read, and there is no layout).
///
/// # Safety
/// `g` is NULL or points to at least 4 readable bytes, and to a whole struct of the size they
/// hold if that is one of the two accepted sizes; `g.model` (and `g.layout`) NULL or a
/// NUL-terminated string.
unsafe fn geometry(g: *const objectcache_geometry) -> Result<KvGeometry, CErr> {
    if g.is_null() {
        return Err(invalid("geometry is NULL"));
    }
    if !g.is_aligned() {
        return Err(invalid("geometry is not aligned"));
    }
    // SAFETY: non-NULL and aligned; every version of the struct starts with a u32.
    let size = unsafe { std::ptr::read(g as *const u32) } as usize;
    let full = std::mem::size_of::<objectcache_geometry>();
    let (v1, layout) = if size == full {
        // SAFETY: checked non-NULL, aligned and of the full size.
        let g = unsafe { &*g };
        let v1 = objectcache_geometry_no_layout {
            struct_size: g.struct_size,
            layers: g.layers,
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
            dtype: g.dtype,
            tokens_per_chunk: g.tokens_per_chunk,
            tp_rank: g.tp_rank,
            tp_world: g.tp_world,
            model: g.model,
        };
        if g._reserved != 0 {
            return Err(invalid(format!(
                "geometry->_reserved is {}, must be 0",
                g._reserved
            )));
        }
        let layout = if g.layout.is_null() {
            if g.block_size != 0 {
                return Err(invalid(format!(
                    "geometry->block_size is {} but geometry->layout is NULL (a block size \
                     belongs to a named layout)",
                    g.block_size
                )));
            }
            None
        } else {
            // SAFETY: non-NULL, NUL-terminated by contract.
            let name = unsafe { cstr(g.layout, "geometry->layout")? };
            Some(crate::layout::KvLayout {
                name: name.to_string(),
                block_size: g.block_size,
            })
        };
        (v1, layout)
    } else if size == GEOMETRY_SIZE_NO_LAYOUT {
        // SAFETY: non-NULL, aligned (the prefix struct's alignment is at most the full
        // struct's), and the caller's struct_size says it holds this many bytes.
        (
            unsafe { std::ptr::read(g as *const objectcache_geometry_no_layout) },
            None,
        )
    } else {
        return Err(err(
            OBJECTCACHE_ERR_ABI_MISMATCH,
            format!(
                "geometry->struct_size is {size}, this library (ABI version {}) expects \
                 sizeof(objectcache_geometry) = {full} (or {GEOMETRY_SIZE_NO_LAYOUT}, the size \
                 before the layout fields); rebuild against the installed objectcache.h",
                OBJECTCACHE_ABI_VERSION
            ),
        ));
    };
    // SAFETY: forwarded contract.
    let model = unsafe { cstr(v1.model, "geometry->model")? };
    let dtype = u8::try_from(v1.dtype)
        .ok()
        .and_then(Dtype::from_code)
        .ok_or_else(|| {
            invalid(format!(
                "geometry->dtype {} is not an OBJECTCACHE_DTYPE_* value (1..4)",
                v1.dtype
            ))
        })?;
    let kv = KvGeometry {
        model: model.to_string(),
        layers: v1.layers,
        kv_heads: v1.kv_heads,
        head_dim: v1.head_dim,
        dtype,
        tokens_per_chunk: v1.tokens_per_chunk,
        tp_rank: v1.tp_rank,
        tp_world: v1.tp_world,
        layout,
    };
    kv.validate()?;
    Ok(kv)
}

/// # Safety
/// `p` valid for `n x hash_len` bytes when `n > 0`.
unsafe fn hashes(p: *const u8, hash_len: usize, n: usize) -> Result<Vec<ChunkHash>, CErr> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if hash_len == 0 || hash_len > 64 {
        return Err(invalid(format!("hash_len {hash_len} is not 1..64 bytes")));
    }
    let total = n
        .checked_mul(hash_len)
        .ok_or_else(|| invalid(format!("{n} hashes of {hash_len} bytes overflow")))?;
    // SAFETY: forwarded contract.
    let b = unsafe { slice(p, total, "hashes")? };
    b.chunks_exact(hash_len)
        .map(|h| ChunkHash::new(h).map_err(CErr::from))
        .collect()
}

/// # Safety
/// `p` as for [`in_struct`]; its strings NULL or NUL-terminated.
unsafe fn hash_params(
    p: *const objectcache_hash_params,
    tokens_per_chunk: Option<u32>,
) -> Result<HashParams, CErr> {
    // SAFETY: forwarded contract.
    let p = unsafe { in_struct(p, "params")? };
    let bs = match (p.block_size, tokens_per_chunk) {
        (0, Some(t)) => t,
        (0, None) => return Err(invalid("params->block_size is 0")),
        (b, Some(t)) if b != t => {
            return Err(invalid(format!(
                "params->block_size {b} differs from geometry->tokens_per_chunk {t}: one chunk \
                 object holds one hashed block"
            )))
        }
        (b, _) => b,
    };
    let mut hp = HashParams::new(bs as usize);
    if !p.seed.is_null() {
        // SAFETY: non-NULL, NUL-terminated by contract.
        hp.seed = unsafe { cstr(p.seed, "params->seed")? }.to_string();
    }
    if !p.salt.is_null() {
        // SAFETY: non-NULL, NUL-terminated by contract.
        hp = hp.with_salt(unsafe { cstr(p.salt, "params->salt")? });
    }
    Ok(hp)
}

fn timeout(ms: i64) -> Result<Option<Duration>, CErr> {
    match ms {
        OBJECTCACHE_WAIT_FOREVER_I64 => Ok(None),
        m if m < 0 => Err(invalid(format!(
            "timeout_ms {m} is negative (use OBJECTCACHE_WAIT_FOREVER = -1 to wait without limit)"
        ))),
        m => Ok(Some(Duration::from_millis(m as u64))),
    }
}

const OBJECTCACHE_WAIT_FOREVER_I64: i64 = OBJECTCACHE_WAIT_FOREVER as i64;

// ---- Library ------------------------------------------------------------------------------

/// The library's ABI version. See `objectcache_abi_version` in the header.
#[no_mangle]
pub extern "C" fn objectcache_abi_version() -> u32 {
    OBJECTCACHE_ABI_VERSION
}

/// The library's version string (static). See the header.
#[no_mangle]
pub extern "C" fn objectcache_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// `sizeof` of an ABI struct by name, 0 for an unknown name. See the header.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn objectcache_struct_size(name: *const c_char) -> usize {
    catch_unwind(|| {
        if name.is_null() {
            return 0;
        }
        // SAFETY: non-NULL and NUL-terminated by the caller's contract.
        let n = unsafe { CStr::from_ptr(name) };
        struct_size_by_name(n.to_bytes())
    })
    .unwrap_or(0)
}

/// Message of the calling thread's last error ("" if none). See the header.
#[no_mangle]
pub extern "C" fn objectcache_last_error() -> *const c_char {
    catch_unwind(|| LAST_ERROR.with(|l| l.borrow().as_ptr())).unwrap_or(c"".as_ptr())
}

/// Static name of a status code. See the header.
#[no_mangle]
pub extern "C" fn objectcache_status_name(status: objectcache_status) -> *const c_char {
    status_name(status).as_ptr()
}

/// Bytes of one chunk's one-layer slice. See the header.
///
/// # Safety
/// `geometry` and `out` as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_slice_bytes(
    geometry: *const objectcache_geometry,
    out: *mut u64,
) -> objectcache_status {
    guard("objectcache_slice_bytes", || {
        // SAFETY: the header's contract on `geometry`.
        let g = unsafe { self::geometry(geometry)? };
        // SAFETY: checked inside.
        unsafe { out_val(out, g.slice_bytes(), "out")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// vLLM-compatible chunk hashes of tokens. See the header.
///
/// # Safety
/// Pointers as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_chunk_hashes(
    params: *const objectcache_hash_params,
    tokens: *const u32,
    n_tokens: usize,
    out: *mut u8,
    out_cap_bytes: usize,
    n_chunks: *mut usize,
) -> objectcache_status {
    guard("objectcache_chunk_hashes", || {
        need_out(n_chunks, "n_chunks")?;
        // SAFETY: the header's contract on `params`.
        let hp = unsafe { hash_params(params, None)? };
        // SAFETY: the header's contract on `tokens`.
        let toks = unsafe { slice(tokens, n_tokens, "tokens")? };
        let hs = chunk_hashes(toks, &hp)?;
        // SAFETY: checked by need_out above.
        unsafe { out_val(n_chunks, hs.len(), "n_chunks")? };
        let need = hs.len() * 32;
        if out_cap_bytes < need {
            return Err(err(
                OBJECTCACHE_ERR_BUFFER_TOO_SMALL,
                format!(
                    "out has {out_cap_bytes} bytes, {} hashes need {need}",
                    hs.len()
                ),
            ));
        }
        if need > 0 {
            if out.is_null() {
                return Err(invalid("out is NULL"));
            }
            // SAFETY: out is non-NULL and the caller promises out_cap_bytes >= need writable
            // bytes; the hashes are our own memory, so the ranges do not overlap.
            let dst = unsafe { std::slice::from_raw_parts_mut(out, need) };
            for (d, h) in dst.chunks_exact_mut(32).zip(&hs) {
                d.copy_from_slice(h.as_bytes());
            }
        }
        Ok(OBJECTCACHE_OK)
    })
}

// ---- Engine -------------------------------------------------------------------------------

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

// ---- Lookup, save -------------------------------------------------------------------------

/// Longest cached prefix of chunk hashes. See the header.
///
/// # Safety
/// Pointers as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_lookup(
    engine: *mut objectcache_engine,
    geometry: *const objectcache_geometry,
    hashes: *const u8,
    hash_len: usize,
    n_chunks: usize,
    hit_chunks: *mut usize,
) -> objectcache_status {
    guard("objectcache_lookup", || {
        let e = get_engine(engine)?;
        need_out(hit_chunks, "hit_chunks")?;
        // SAFETY: the header's contract on `geometry`.
        let g = unsafe { self::geometry(geometry)? };
        // SAFETY: the header's contract on `hashes`.
        let hs = unsafe { self::hashes(hashes, hash_len, n_chunks)? };
        let hit = e.engine.lookup_blocking(&g, &hs)?;
        // SAFETY: checked by need_out above.
        unsafe { out_val(hit_chunks, hit, "hit_chunks")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// Longest cached prefix of token ids. See the header.
///
/// # Safety
/// Pointers as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_lookup_tokens(
    engine: *mut objectcache_engine,
    geometry: *const objectcache_geometry,
    params: *const objectcache_hash_params,
    tokens: *const u32,
    n_tokens: usize,
    hit_chunks: *mut usize,
) -> objectcache_status {
    guard("objectcache_lookup_tokens", || {
        let e = get_engine(engine)?;
        need_out(hit_chunks, "hit_chunks")?;
        // SAFETY: the header's contract on `geometry`.
        let g = unsafe { self::geometry(geometry)? };
        // SAFETY: the header's contract on `params`.
        let hp = unsafe { hash_params(params, Some(g.tokens_per_chunk))? };
        // SAFETY: the header's contract on `tokens`.
        let toks = unsafe { slice(tokens, n_tokens, "tokens")? };
        let hs = chunk_hashes(toks, &hp)?;
        let hit = e.engine.lookup_blocking(&g, &hs)?;
        // SAFETY: checked by need_out above.
        unsafe { out_val(hit_chunks, hit, "hit_chunks")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// Saves a prefix's KV (blocking). See the header.
///
/// # Safety
/// Pointers as the header states.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn objectcache_save(
    engine: *mut objectcache_engine,
    geometry: *const objectcache_geometry,
    hashes: *const u8,
    hash_len: usize,
    n_chunks: usize,
    layers: *const *const c_void,
    n_layers: usize,
    bytes_per_layer: u64,
    report: *mut objectcache_save_report,
) -> objectcache_status {
    guard("objectcache_save", || {
        let e = get_engine(engine)?;
        if !report.is_null() {
            // SAFETY: the header's contract on `report` (checked before the work).
            unsafe { checked_struct(report as *const objectcache_save_report, "report")? };
        }
        // SAFETY: the header's contract on `geometry`.
        let g = unsafe { self::geometry(geometry)? };
        if n_chunks == 0 {
            return Err(invalid("n_chunks is 0"));
        }
        // SAFETY: the header's contract on `hashes`.
        let hs = unsafe { self::hashes(hashes, hash_len, n_chunks)? };
        if n_layers != g.layers as usize {
            return Err(invalid(format!(
                "n_layers is {n_layers}, geometry has {} layers",
                g.layers
            )));
        }
        let need = n_chunks as u64 * g.slice_bytes();
        if bytes_per_layer != need {
            return Err(invalid(format!(
                "bytes_per_layer is {bytes_per_layer}, expected {n_chunks} chunks x {} bytes \
                 = {need}",
                g.slice_bytes()
            )));
        }
        let len = usize::try_from(bytes_per_layer)
            .map_err(|_| invalid("bytes_per_layer does not fit in memory"))?;
        // SAFETY: the header's contract: n_layers pointers.
        let ptrs = unsafe { slice(layers, n_layers, "layers")? };
        let mut bufs: Vec<&[u8]> = Vec::with_capacity(n_layers);
        for (l, &p) in ptrs.iter().enumerate() {
            // SAFETY: the header's contract: each layer pointer holds bytes_per_layer bytes,
            // borrowed for the call.
            bufs.push(unsafe { slice(p as *const u8, len, &format!("layers[{l}]"))? });
        }
        let r = e.engine.save_blocking(&g, &hs, &bufs)?;
        if !report.is_null() {
            let v = objectcache_save_report {
                struct_size: 0,
                _reserved: 0,
                written: r.written as u64,
                already_present: r.already_present as u64,
                bytes: r.bytes,
            };
            // SAFETY: checked above; the caller owns it writable.
            unsafe { out_struct(report, v, "report")? };
        }
        Ok(OBJECTCACHE_OK)
    })
}

/// Saves a prefix's KV from paged memory (blocking). See the header.
///
/// # Safety
/// Pointers as the header states.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn objectcache_save_paged(
    engine: *mut objectcache_engine,
    geometry: *const objectcache_geometry,
    hashes: *const u8,
    hash_len: usize,
    n_chunks: usize,
    ranges: *const objectcache_range,
    ranges_per_layer: usize,
    n_layers: usize,
    report: *mut objectcache_save_report,
) -> objectcache_status {
    guard("objectcache_save_paged", || {
        let e = get_engine(engine)?;
        if !report.is_null() {
            // SAFETY: the header's contract on `report` (checked before the work).
            unsafe { checked_struct(report as *const objectcache_save_report, "report")? };
        }
        // SAFETY: the header's contract on `geometry`.
        let g = unsafe { self::geometry(geometry)? };
        if n_chunks == 0 {
            return Err(invalid("n_chunks is 0"));
        }
        // SAFETY: the header's contract on `hashes`.
        let hs = unsafe { self::hashes(hashes, hash_len, n_chunks)? };
        let need = n_chunks as u64 * g.slice_bytes();
        // SAFETY: the header's contract: n_layers x ranges_per_layer ranges.
        let rs = unsafe { paged_ranges(ranges, ranges_per_layer, n_layers, g.layers, need, true) }
            .map_err(invalid)?;
        let mut bufs: Vec<Vec<&[u8]>> = Vec::with_capacity(rs.len());
        for layer in &rs {
            bufs.push(
                layer
                    .iter()
                    // SAFETY: the header's contract: each range is readable for its length and
                    // borrowed for the call (checked non-NULL, non-empty, not overflowing).
                    .map(|&(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) })
                    .collect(),
            );
        }
        let r = e.engine.save_paged_blocking(&g, &hs, &bufs)?;
        if !report.is_null() {
            let v = objectcache_save_report {
                struct_size: 0,
                _reserved: 0,
                written: r.written as u64,
                already_present: r.already_present as u64,
                bytes: r.bytes,
            };
            // SAFETY: checked above; the caller owns it writable.
            unsafe { out_struct(report, v, "report")? };
        }
        Ok(OBJECTCACHE_OK)
    })
}

// ---- Load ---------------------------------------------------------------------------------

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
    guard("objectcache_load", || {
        let e = get_engine(engine)?;
        need_out(out, "out")?;
        // SAFETY: the header's contract on `params`.
        let p = unsafe { in_struct(params, "params")? };
        let rid = p.request_id;
        let ctx = |m: String| invalid(format!("request {rid}: {m}"));
        // SAFETY: the header's contract on the geometry and hashes.
        let (g, hs) = unsafe { load_what(rid, p.geometry, p.hashes, p.hash_len, p.n_chunks)? };
        if p.n_layers != g.layers as usize {
            return Err(ctx(format!(
                "params->n_layers is {}, geometry has {} layers",
                p.n_layers, g.layers
            )));
        }
        // SAFETY: the header's contract: n_layers destinations.
        let dests = unsafe { slice(p.layers, p.n_layers, "params->layers")? };
        let need = p.n_chunks as u64 * g.slice_bytes();
        // Only the first `need` bytes are ever written.
        let len = usize::try_from(need).map_err(|_| ctx("load too large".into()))?;
        let mut ranges = Vec::with_capacity(dests.len());
        for (l, d) in dests.iter().enumerate() {
            if d.addr.is_null() {
                return Err(ctx(format!("params->layers[{l}].addr is NULL")));
            }
            if d.len < need {
                return Err(ctx(format!(
                    "params->layers[{l}].len is {} bytes, needs {} chunks x {} bytes = {need}",
                    d.len,
                    p.n_chunks,
                    g.slice_bytes()
                )));
            }
            ranges.push(vec![(d.addr.cast::<u8>(), len)]);
        }
        let hints = load_hints(p.priority, p.deadline_ms, p.compute_us_per_layer, g.layers);
        let id = post_load(e, rid, g, hs, hints, ranges)?;
        // SAFETY: checked by need_out above.
        unsafe { out_val(out, token(id), "out")? };
        Ok(OBJECTCACHE_OK)
    })
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
    guard("objectcache_load_paged", || {
        let e = get_engine(engine)?;
        need_out(out, "out")?;
        // SAFETY: the header's contract on `params`.
        let p = unsafe { in_struct(params, "params")? };
        let rid = p.request_id;
        let ctx = |m: String| invalid(format!("request {rid}: {m}"));
        // SAFETY: the header's contract on the geometry and hashes.
        let (g, hs) = unsafe { load_what(rid, p.geometry, p.hashes, p.hash_len, p.n_chunks)? };
        let need = p.n_chunks as u64 * g.slice_bytes();
        // SAFETY: the header's contract: n_layers x ranges_per_layer ranges.
        let ranges = unsafe {
            paged_ranges(
                p.ranges,
                p.ranges_per_layer,
                p.n_layers,
                g.layers,
                need,
                false,
            )
        }
        .map_err(ctx)?;
        let hints = load_hints(p.priority, p.deadline_ms, p.compute_us_per_layer, g.layers);
        let id = post_load(e, rid, g, hs, hints, ranges)?;
        // SAFETY: checked by need_out above.
        unsafe { out_val(out, token(id), "out")? };
        Ok(OBJECTCACHE_OK)
    })
}

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
    // SAFETY: forwarded contract.
    let g = unsafe { self::geometry(geometry) }
        .map_err(|x| err(x.code, format!("request {rid}: params->{}", x.msg)))?;
    if n_chunks == 0 {
        return Err(invalid(format!("request {rid}: params->n_chunks is 0")));
    }
    // SAFETY: forwarded contract.
    let hs = unsafe { self::hashes(hashes, hash_len, n_chunks) }
        .map_err(|x| err(x.code, format!("request {rid}: params->{}", x.msg)))?;
    Ok((g, hs))
}

/// Reads `n_layers x per_layer` ranges (layer-major) and checks them: `n_layers` is the
/// geometry's `layers`, every range is non-empty (and non-NULL), and each layer's ranges add
/// up to exactly `need` bytes. Returns `(pointer, length)` per range, per layer. `source`
/// names the ranges in messages as a save's sources rather than a load's destinations.
///
/// # Safety
/// `p` is valid for `n_layers x per_layer` ranges when that is nonzero.
unsafe fn paged_ranges(
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
    ranges: Vec<Vec<(*mut u8, usize)>>,
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
fn load_hints(
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
    LoadHints { timing, priority }
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
    fn poll(&self, l: usize) -> LayerStatus {
        self.load.poll_layer(l)
    }

    /// Blocking wait for layer `l` (see [`RegisteredLoad::wait_layer_blocking`]).
    fn wait(&self, l: usize, to: Option<Duration>) -> Result<(), LayerError> {
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
        let m = crate::sched::ComputeModel::from_settings(
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
            crate::sched::Fallback::Wait { finish_s } => objectcache_stall_advice {
                struct_size: 0,
                recompute: 0,
                from_layer: t.load.handle().layers() as u32,
                _reserved: 0,
                recompute_tokens: 0,
                finish_s,
                wait_finish_s: finish_s,
            },
            crate::sched::Fallback::Recompute {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: objectcache_last_error returns a NUL-terminated string owned by this thread.
        unsafe { CStr::from_ptr(objectcache_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn load_params_hints_map_to_load_hints() {
        let h = load_hints(0, 0, 0, 4);
        assert_eq!((h.timing, h.priority), (LayerTiming::None, 128));
        assert_eq!(load_hints(1, 0, 0, 4).priority, 129);
        assert_eq!(load_hints(u32::MAX, 0, 0, 4).priority, 255);
        assert_eq!(
            load_hints(0, 0, 2500, 3).timing,
            LayerTiming::ComputeS(vec![0.0025; 3])
        );
        assert_eq!(
            load_hints(0, 40, 0, 2).timing,
            LayerTiming::DeadlinesS(vec![0.04; 2])
        );
        let LayerTiming::DeadlinesS(d) = load_hints(0, 40, 2000, 3).timing else {
            panic!("deadline and compute give deadlines");
        };
        let want = [0.040, 0.042, 0.044];
        assert!(
            d.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12),
            "{d:?}"
        );
    }

    #[test]
    fn a_panic_becomes_internal_error_with_its_message() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let s = guard("objectcache_test", || panic!("boom {}", 7));
        std::panic::set_hook(prev);
        assert_eq!(s, OBJECTCACHE_ERR_INTERNAL);
        assert_eq!(last(), "objectcache_test: internal error (panic): boom 7");
    }

    #[test]
    fn every_error_variant_has_its_stable_code() {
        let nf = StoreError::NotFound { key: "k".into() };
        let cases: Vec<(Error, i32)> = vec![
            (Error::InvalidArgument("x".into()), 2),
            (Error::Config("x".into()), 8),
            (Error::Store(nf), 10),
            (Error::Store(StoreError::other("fs", "disk")), 11),
            (Error::Io(std::io::Error::other("x")), 12),
            (
                Error::Layer(LayerError::Missing {
                    chunk: 0,
                    key: "k".into(),
                }),
                20,
            ),
            (
                Error::Layer(LayerError::ChecksumMismatch {
                    chunk: 0,
                    layer: 0,
                    stored: 1,
                    computed: 2,
                }),
                21,
            ),
            (
                Error::Layer(LayerError::GeometryMismatch {
                    chunk: 0,
                    reason: "r".into(),
                }),
                22,
            ),
            (
                Error::Layer(LayerError::Storage {
                    chunk: 0,
                    message: "m".into(),
                }),
                23,
            ),
            (Error::Layer(LayerError::Timeout { layer: 3 }), 24),
            (Error::Layer(LayerError::Cancelled), 25),
        ];
        for (e, code) in cases {
            let name = status_name(code).to_str().unwrap().to_string();
            assert_eq!(error_code(&e), code, "{e} -> {name}");
            assert_ne!(name, "unknown status");
        }
    }

    #[test]
    fn stale_and_wrong_kind_handles_are_refused_without_dereference() {
        // A token that was never issued, and NULL.
        let bogus: *mut objectcache_transfer = token(usize::MAX - 1);
        // SAFETY: handles are tokens looked up in the registry, never dereferenced.
        assert_eq!(
            unsafe { objectcache_transfer_release(bogus) },
            OBJECTCACHE_ERR_INVALID_HANDLE
        );
        assert!(last().contains("not live"), "{}", last());
        // SAFETY: as above.
        assert_eq!(
            unsafe { objectcache_transfer_cancel(std::ptr::null_mut()) },
            OBJECTCACHE_ERR_INVALID_HANDLE
        );
        assert!(last().contains("NULL"), "{}", last());
    }
}
