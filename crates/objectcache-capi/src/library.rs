//! Exports that need no engine: versions, struct sizes and fields, the last error, status names, slice
//! sizes, chunk hashes.

use super::*;

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

/// Field `index` of the ABI struct named `name`, in declaration order: its name (static),
/// its offset in bytes written to `*offset`; NULL past the last field or for an unknown
/// struct. See the header.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `offset` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn objectcache_struct_field(
    name: *const c_char,
    index: usize,
    offset: *mut usize,
) -> *const c_char {
    catch_unwind(|| {
        if name.is_null() {
            return std::ptr::null();
        }
        // SAFETY: non-NULL and NUL-terminated by the caller's contract.
        let n = unsafe { CStr::from_ptr(name) };
        match struct_field(n.to_bytes(), index) {
            Some((field, off)) => {
                if !offset.is_null() {
                    // SAFETY: non-NULL and valid for one write by the caller's contract.
                    unsafe { offset.write(off) };
                }
                field.as_ptr()
            }
            None => std::ptr::null(),
        }
    })
    .unwrap_or(std::ptr::null())
}

/// The settings `objectcache_engine_create` accepts ([`objectcache_client::connector::CONFIG_KEYS`]),
/// comma-separated without spaces, as a static NUL-terminated string. See the header.
#[no_mangle]
pub extern "C" fn objectcache_config_keys() -> *const c_char {
    static KEYS: LazyLock<CString> = LazyLock::new(|| {
        CString::new(objectcache_client::connector::CONFIG_KEYS.join(","))
            .expect("setting names hold no NUL byte")
    });
    catch_unwind(|| KEYS.as_ptr()).unwrap_or(c"".as_ptr())
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

/// Resolves an engine layout. See the header.
///
/// # Safety
/// Pointers as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_engine_layout_resolve(
    layout: *const objectcache_engine_layout,
    tp_world: u32,
    name: *mut c_char,
    cap: usize,
    block_bytes: *mut u64,
    kv_heads: *mut u32,
    head_dim: *mut u32,
    stored_once: *mut u32,
) -> objectcache_status {
    guard("objectcache_engine_layout_resolve", || {
        // SAFETY: the header's contract on `layout` (its strings included).
        let l = unsafe { engine_layout(layout)? };
        let r = l.resolve(tp_world)?;
        if name.is_null() || cap <= r.name.len() {
            return Err(err(
                OBJECTCACHE_ERR_BUFFER_TOO_SMALL,
                format!("name: {} bytes needed, cap is {cap}", r.name.len() + 1),
            ));
        }
        // SAFETY: checked inside each.
        unsafe {
            out_val(block_bytes, r.block_bytes, "block_bytes")?;
            out_val(kv_heads, r.kv_heads, "kv_heads")?;
            out_val(head_dim, r.head_dim, "head_dim")?;
            out_val(stored_once, u32::from(r.stored_once), "stored_once")?;
        }
        // SAFETY: `name` is non-NULL and the caller's buffer of `cap` bytes, more than the
        // name's length plus its NUL.
        unsafe {
            std::ptr::copy_nonoverlapping(r.name.as_ptr(), name.cast::<u8>(), r.name.len());
            *name.add(r.name.len()) = 0;
        }
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
