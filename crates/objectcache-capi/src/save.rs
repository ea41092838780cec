//! Lookup and save exports.

use super::*;

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
        // SAFETY: the header's contract on `geometry` and `hashes`.
        let (g, hs) = unsafe { geometry_and_hashes(geometry, hashes, hash_len, n_chunks)? };
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

/// Bytes of one segment marker record.
const RECORD_LEN: usize = OBJECTCACHE_SEGMENT_MARKER_RECORD_LEN as usize;

/// The lookup's segment markers as records. See the header.
///
/// # Safety
/// Pointers as the header states.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn objectcache_segment_markers(
    engine: *mut objectcache_engine,
    geometry: *const objectcache_geometry,
    hashes: *const u8,
    hash_len: usize,
    n_chunks: usize,
    records: *mut u8,
    cap_records: usize,
    n_records: *mut usize,
) -> objectcache_status {
    guard("objectcache_segment_markers", || {
        let e = get_engine(engine)?;
        need_out(n_records, "n_records")?;
        // SAFETY: the header's contract on `geometry` and `hashes`.
        let (g, hs) = unsafe { geometry_and_hashes(geometry, hashes, hash_len, n_chunks)? };
        let markers = e.engine.segment_markers(&g, &hs)?;
        let n = markers.len();
        if n > 0 && cap_records > 0 {
            if cap_records < n {
                return Err(invalid(format!(
                    "records: room for {cap_records} records, {n} needed"
                )));
            }
            if records.is_null() {
                return Err(invalid(format!(
                    "records is NULL but cap_records is {cap_records}"
                )));
            }
            // SAFETY: the header's contract: `records` holds `cap_records` records.
            let out = unsafe { std::slice::from_raw_parts_mut(records, n * RECORD_LEN) };
            for (r, (p, m)) in out.chunks_exact_mut(RECORD_LEN).zip(&markers) {
                r[..8].copy_from_slice(&(*p as u64).to_le_bytes());
                r[8..].copy_from_slice(&m.encode());
            }
        }
        // SAFETY: checked by need_out above.
        unsafe { out_val(n_records, n, "n_records")? };
        Ok(OBJECTCACHE_OK)
    })
}

/// Takes segment marker records from a lookup elsewhere. See the header.
///
/// # Safety
/// Pointers as the header states.
#[no_mangle]
pub unsafe extern "C" fn objectcache_segment_markers_add(
    engine: *mut objectcache_engine,
    geometry: *const objectcache_geometry,
    hashes: *const u8,
    hash_len: usize,
    n_chunks: usize,
    records: *const u8,
    n_records: usize,
) -> objectcache_status {
    guard("objectcache_segment_markers_add", || {
        let e = get_engine(engine)?;
        // SAFETY: the header's contract on `geometry` and `hashes`.
        let (g, hs) = unsafe { geometry_and_hashes(geometry, hashes, hash_len, n_chunks)? };
        let total = n_records
            .checked_mul(RECORD_LEN)
            .ok_or_else(|| invalid(format!("{n_records} records overflow")))?;
        // SAFETY: the header's contract on `records`.
        let b = unsafe { slice(records, total, "records")? };
        let mut markers = std::collections::BTreeMap::new();
        for (i, r) in b.chunks_exact(RECORD_LEN).enumerate() {
            let p = u64::from_le_bytes(r[..8].try_into().expect("8 bytes"));
            let p = usize::try_from(p)
                .ok()
                .filter(|&p| p < hs.len())
                .ok_or_else(|| {
                    invalid(format!(
                        "record {i}: prefix position {p}, the prefix has {} chunks",
                        hs.len()
                    ))
                })?;
            match objectcache_client::layout::decode_marker(&r[8..]) {
                Ok(objectcache_client::layout::Marker::Segment(m)) => {
                    markers.insert(p, m);
                }
                Ok(_) => {
                    return Err(invalid(format!(
                        "record {i}: a format version 1 marker, not a segment marker"
                    )))
                }
                Err(err) => return Err(invalid(format!("record {i}: {err}"))),
            }
        }
        e.engine.add_segment_markers(&g, &hs, &markers)?;
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
        // SAFETY: the header's contract on `report`, `geometry` and `hashes`.
        let (e, g, hs) =
            unsafe { save_inputs(engine, report, geometry, hashes, hash_len, n_chunks)? };
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
        // SAFETY: checked above; the caller owns it writable.
        unsafe { write_report(report, &r) }
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
        // SAFETY: the header's contract on `report`, `geometry` and `hashes`.
        let (e, g, hs) =
            unsafe { save_inputs(engine, report, geometry, hashes, hash_len, n_chunks)? };
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
        // SAFETY: checked above; the caller owns it writable.
        unsafe { write_report(report, &r) }
    })
}

/// What both save exports take first, checked: the engine, the `report` (before the work),
/// the geometry and at least one chunk hash.
///
/// # Safety
/// `report` as for [`check_report`]; `geometry` and `hashes` as for [`geometry_and_hashes`].
unsafe fn save_inputs(
    engine: *mut objectcache_engine,
    report: *mut objectcache_save_report,
    geometry: *const objectcache_geometry,
    hashes: *const u8,
    hash_len: usize,
    n_chunks: usize,
) -> Result<(Arc<EngineObj>, KvGeometry, Vec<ChunkHash>), CErr> {
    let e = get_engine(engine)?;
    // SAFETY: forwarded contract on `report`.
    unsafe { check_report(report)? };
    // SAFETY: forwarded contract on `geometry` and `hashes` (no hash is read for 0 chunks,
    // refused next).
    let (g, hs) = unsafe { geometry_and_hashes(geometry, hashes, hash_len, n_chunks)? };
    if n_chunks == 0 {
        return Err(invalid("n_chunks is 0"));
    }
    Ok((e, g, hs))
}

/// Checks a save's `report` before the work: NULL (no report wanted) or an
/// `objectcache_save_report` the caller owns.
///
/// # Safety
/// `report` NULL or as for [`checked_struct`].
unsafe fn check_report(report: *mut objectcache_save_report) -> Result<(), CErr> {
    if report.is_null() {
        return Ok(());
    }
    // SAFETY: forwarded contract.
    unsafe { checked_struct(report as *const objectcache_save_report, "report") }
}

/// Writes a save's report `r` to `report`, when given; the status of a save that worked.
///
/// # Safety
/// `report` NULL, or checked by [`check_report`] and writable.
unsafe fn write_report(
    report: *mut objectcache_save_report,
    r: &objectcache_client::connector::SaveReport,
) -> Result<objectcache_status, CErr> {
    if !report.is_null() {
        let v = objectcache_save_report {
            struct_size: 0,
            _reserved: 0,
            written: r.written as u64,
            already_present: r.already_present as u64,
            bytes: r.bytes,
        };
        // SAFETY: forwarded contract.
        unsafe { out_struct(report, v, "report")? };
    }
    Ok(OBJECTCACHE_OK)
}
