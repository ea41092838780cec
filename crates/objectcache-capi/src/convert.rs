//! Conversions of the caller's structs to the Rust API's types: geometry, chunk hashes,
//! hash parameters, timeouts.

use super::*;

/// A caller's geometry. Its `struct_size` is `sizeof(objectcache_geometry)`, or
/// [`GEOMETRY_SIZE_NO_LAYOUT`] for a caller built before the layout fields existed (then only
/// that many bytes are read, and there is no layout).
///
/// # Safety
/// `g` is NULL or points to at least 4 readable bytes, and to a whole struct of the size they
/// hold if that is one of the two accepted sizes; `g.model` (and `g.layout`) NULL or a
/// NUL-terminated string.
pub(super) unsafe fn geometry(g: *const objectcache_geometry) -> Result<KvGeometry, CErr> {
    if g.is_null() {
        return Err(invalid("geometry is NULL"));
    }
    if !g.is_aligned() {
        return Err(invalid("geometry is not aligned"));
    }
    // SAFETY: non-NULL and aligned; every version of the struct starts with a u32.
    let size = unsafe { std::ptr::read(g as *const u32) } as usize;
    let full = std::mem::size_of::<objectcache_geometry>();
    if size != full && size != GEOMETRY_SIZE_NO_LAYOUT {
        return Err(err(
            OBJECTCACHE_ERR_ABI_MISMATCH,
            format!(
                "geometry->struct_size is {size}, this library (ABI version {}) expects \
                 sizeof(objectcache_geometry) = {full} (or {GEOMETRY_SIZE_NO_LAYOUT}, the size \
                 before the layout fields); rebuild against the installed objectcache.h",
                OBJECTCACHE_ABI_VERSION
            ),
        ));
    }
    // The caller's struct_size bytes over a zeroed struct: a caller built before the layout
    // fields existed reads as one with no layout (NULL `layout`, `block_size` and
    // `_reserved` 0).
    // SAFETY: every field is an integer or a raw pointer, for which all-zero bytes are valid.
    let mut v = unsafe { std::mem::zeroed::<objectcache_geometry>() };
    // SAFETY: `g` is non-NULL and the caller's struct_size (one of the two accepted sizes, at
    // most the full struct's) says it holds this many readable bytes; `v` is a local of the
    // full size.
    unsafe {
        std::ptr::copy_nonoverlapping(g.cast::<u8>(), (&raw mut v).cast::<u8>(), size);
    }
    let g = &v;
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
        Some(objectcache_client::layout::KvLayout {
            name: name.to_string(),
            block_size: g.block_size,
        })
    };
    // SAFETY: forwarded contract.
    let model = unsafe { cstr(g.model, "geometry->model")? };
    let dtype = u8::try_from(g.dtype)
        .ok()
        .and_then(Dtype::from_code)
        .ok_or_else(|| {
            invalid(format!(
                "geometry->dtype {} is not an OBJECTCACHE_DTYPE_* value (1..4)",
                g.dtype
            ))
        })?;
    let kv = KvGeometry {
        model: model.to_string(),
        layers: g.layers,
        kv_heads: g.kv_heads,
        head_dim: g.head_dim,
        dtype,
        tokens_per_chunk: g.tokens_per_chunk,
        tp_rank: g.tp_rank,
        tp_world: g.tp_world,
        layout,
    };
    kv.validate()?;
    Ok(kv)
}

/// The geometry and the `n` chunk hashes (`hash_len` bytes each) that most exports name,
/// checked by [`geometry`], then by [`hashes`].
///
/// # Safety
/// As [`geometry`] for `g` and [`hashes`] for `p`.
pub(super) unsafe fn geometry_and_hashes(
    g: *const objectcache_geometry,
    p: *const u8,
    hash_len: usize,
    n: usize,
) -> Result<(KvGeometry, Vec<ChunkHash>), CErr> {
    // SAFETY: forwarded contracts.
    unsafe { Ok((geometry(g)?, hashes(p, hash_len, n)?)) }
}

/// # Safety
/// `p` valid for `n x hash_len` bytes when `n > 0`.
pub(super) unsafe fn hashes(
    p: *const u8,
    hash_len: usize,
    n: usize,
) -> Result<Vec<ChunkHash>, CErr> {
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
pub(super) unsafe fn hash_params(
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

pub(super) fn timeout(ms: i64) -> Result<Option<Duration>, CErr> {
    match ms {
        OBJECTCACHE_WAIT_FOREVER_I64 => Ok(None),
        m if m < 0 => Err(invalid(format!(
            "timeout_ms {m} is negative (use OBJECTCACHE_WAIT_FOREVER = -1 to wait without limit)"
        ))),
        m => Ok(Some(Duration::from_millis(m as u64))),
    }
}

pub(super) const OBJECTCACHE_WAIT_FOREVER_I64: i64 = OBJECTCACHE_WAIT_FOREVER as i64;

/// A caller's engine layout.
///
/// # Safety
/// `l` is NULL or a whole struct of the size its `struct_size` holds; its strings NULL or
/// NUL-terminated.
pub(super) unsafe fn engine_layout(
    l: *const objectcache_engine_layout,
) -> Result<objectcache_client::layout::EngineLayout, CErr> {
    use objectcache_client::layout::{EngineLayout, GroupKind, LayoutFamily, LayoutGroup};
    // SAFETY: forwarded contract.
    unsafe { checked_struct(l, "layout")? };
    // SAFETY: checked: non-NULL, aligned, the full struct.
    let l = unsafe { &*l };
    if l._reserved != 0 {
        return Err(invalid(format!(
            "layout->_reserved is {}, must be 0",
            l._reserved
        )));
    }
    // SAFETY: NUL-terminated by contract.
    let engine = unsafe { cstr(l.engine, "layout->engine")? }.to_string();
    // SAFETY: as above.
    let order = unsafe { cstr(l.order, "layout->order")? }.to_string();
    let family = match l.family as i32 {
        OBJECTCACHE_FAMILY_PAGED_KV => LayoutFamily::PagedKv {
            order,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
        },
        OBJECTCACHE_FAMILY_MLA => LayoutFamily::MlaLatent {
            order,
            latent_dim: l.latent_dim,
        },
        OBJECTCACHE_FAMILY_RECURRENT => LayoutFamily::Recurrent,
        OBJECTCACHE_FAMILY_OPAQUE => LayoutFamily::Opaque {
            name: order,
            bytes_per_token: l.bytes_per_token,
        },
        f => {
            return Err(invalid(format!(
                "layout->family {f} is not an OBJECTCACHE_FAMILY_* value (0..3)"
            )))
        }
    };
    let dtype = u8::try_from(l.dtype)
        .ok()
        .and_then(Dtype::from_code)
        .ok_or_else(|| {
            invalid(format!(
                "layout->dtype {} is not an OBJECTCACHE_DTYPE_* value (1..4)",
                l.dtype
            ))
        })?;
    let group = if l.group_count <= 1 {
        None
    } else {
        let kind = match l.group_kind as i32 {
            OBJECTCACHE_GROUP_FULL => GroupKind::Full,
            OBJECTCACHE_GROUP_SLIDING_WINDOW => GroupKind::SlidingWindow { window: l.window },
            k => {
                return Err(invalid(format!(
                    "layout->group_kind {k} is not an OBJECTCACHE_GROUP_* value (0..1)"
                )))
            }
        };
        // SAFETY: NUL-terminated by contract.
        let structure = unsafe { cstr(l.structure, "layout->structure")? }.to_string();
        Some(LayoutGroup {
            index: l.group_index,
            count: l.group_count,
            kind,
            structure,
        })
    };
    Ok(EngineLayout {
        engine,
        family,
        block_size: l.block_size,
        dtype,
        group,
    })
}
