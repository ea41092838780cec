//! The stock-S3 path of a load: ranged GETs issued in layer order within a bounded
//! look-ahead window ([`Flight`]), paced by the engine's link under a bandwidth cap, each body
//! streamed straight into the caller's destination and verified slice by slice.

use super::body::{BodyError, BodyReader, Event, Source};
use super::segment::Planned;
use super::window::{classify, Flight, FlightPermit};
use super::{LoadRequest, LoadShared};
use crate::connector::status::ChunkStatus;
use crate::error::LayerError;
use crate::layout::{
    object_len, ChunkHeader, KeyBuilder, KvGeometry, Marker, SliceDemux, HEADER_LEN,
};
use crate::link::Link;
use crate::store::{GetOptions, Store};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Runs the stock-S3 layer-ordered load to completion (or failure of every pending layer).
///
/// Under the engine's `link` (a bandwidth cap) the load registers its bytes per layer and
/// hints, reads one layer slice per request in layer-major order, and issues each read once
/// its credit covers the read's bytes; it leaves the link when every read is issued, or when
/// the load is cancelled, times out or is dropped (the future, and its `LinkLoad`, dropped).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_store_load(
    store: Arc<dyn Store>,
    keys: KeyBuilder,
    req: LoadRequest,
    sh: Arc<LoadShared>,
    window_bytes: u64,
    max_requests: usize,
    coalesce_bytes: u64,
    link: Option<Arc<Link>>,
    markers: BTreeMap<usize, Marker>,
) {
    let g = &req.geometry;
    let slice = g.slice_bytes();
    let tokens = g.tokens_per_chunk;
    let full_len = object_len(g.layers, slice);
    // Paced reads are single layer slices so that layers land in the order the link plans.
    let coalesce = if link.is_some() { 0 } else { coalesce_bytes };
    // Chunk objects (format version 1) and runs of segment objects (version 2) as the
    // lookup's markers place them; every position no segment holds is read as a chunk
    // object, so a version 1 prefix is planned exactly as before.
    let (plan, runs) = super::segment::plan(&req, &markers, coalesce);
    let paced = link.and_then(|link| {
        let mut per_layer = vec![0u64; g.layers as usize];
        for r in &plan {
            per_layer[r.first_layer() as usize] += r.len();
        }
        link.register(per_layer, &req.hints.sched_hints())
            .map_err(|e| tracing::warn!(error = %e, "load not paced by the engine's link"))
            .ok()
    });
    let mean_read = if plan.is_empty() {
        1.0
    } else {
        plan.iter().map(Planned::len).sum::<u64>() as f64 / plan.len() as f64
    };
    let flight = Arc::new(Flight::new(window_bytes, max_requests, mean_read));
    for read in plan {
        if sh.state.is_cancelled() {
            break;
        }
        if read.unusable(&sh) {
            // Every chunk of this read is unusable (no object, or another geometry): all its
            // layers are failed; don't read more of it (the link counts the bytes as done,
            // so the load's later layers can complete). A corrupt or unreadable slice fails
            // only its own layers: the chunk's other layers are still read.
            if let Some(p) = &paced {
                p.sent(read.len());
            }
            continue;
        }
        if let Some(p) = &paced {
            // Issued when a fluid transfer at the allocated rate would have finished it. The
            // link holds the load on purpose meanwhile: not a stall.
            let n = read.len();
            let _held = sh.progress.hold();
            p.pace(n).await;
            p.sent(n);
        }
        let permit = flight.admit(read.len(), read.first_layer() == 0, &sh).await;
        let store = store.clone();
        let sh2 = sh.clone();
        let g = g.clone();
        let task = match read {
            Planned::Segment(read) => {
                let run = runs[read.run].clone();
                let key = keys.segment(&run.digest);
                let hashes = req.hashes.clone();
                tokio::spawn(async move {
                    let mut permit = permit;
                    sh2.requests.fetch_add(1, Ordering::Relaxed);
                    let f = super::segment::SegmentFetch {
                        store: &*store,
                        key: &key,
                        run: &run,
                        read: &read,
                        hashes: &hashes,
                        g: &g,
                        sh: &sh2,
                    };
                    super::segment::fetch_segment(f, &mut permit).await;
                })
            }
            Planned::Chunk(read) => {
                let c = read.chunk;
                // Layer 0's read also fetches the header, so geometry is checked before any
                // byte lands.
                let with_header = read.layers.start == 0;
                let range = if with_header {
                    0..read.bytes.end
                } else {
                    read.bytes.clone()
                };
                let key = keys.data(&req.hashes[c]);
                tokio::spawn(async move {
                    let mut permit = permit;
                    sh2.requests.fetch_add(1, Ordering::Relaxed);
                    let r = fetch_range(
                        &*store,
                        &key,
                        range,
                        c,
                        read.layers.clone(),
                        with_header,
                        &g,
                        tokens,
                        full_len,
                        &sh2,
                        &mut permit,
                    )
                    .await;
                    if let Err(f) = r {
                        sh2.set_chunk(c, f.status);
                        // The layers this failure touches are misses (every layer when the
                        // chunk is unusable); the chunk's other layers and the other chunks
                        // are unaffected.
                        for l in f.layers {
                            sh2.state.fail_impl(l, f.err.clone());
                        }
                    }
                })
            }
        };
        sh.tasks.lock().expect("lock").push(task);
    }
    // Every read is issued: the load leaves the link.
    drop(paced);
    // Every read holds its permit until it ends.
    flight.drained().await;
    for c in 0..req.hashes.len() {
        sh.set_chunk(c, ChunkStatus::Ok);
    }
}

/// A failed ranged read: the chunk status it implies, the layer error, and the layers it
/// fails (all of the chunk's when the object is missing or of another geometry; otherwise
/// only the layers of this read that did not arrive verified).
struct ReadFailure {
    status: ChunkStatus,
    err: LayerError,
    layers: std::ops::Range<u32>,
}

/// Reads `range` of chunk `chunk`'s object (layers `layers`, with the header when
/// `with_header`) straight into the destination, verifying each slice's CRC32C. A slice whose
/// CRC does not match fails its layer only (named in the chunk status) and the read goes on
/// with the next slice; a later layer's slice completes only once the chunk's header (read
/// with layer 0) matched the request.
#[allow(clippy::too_many_arguments)]
async fn fetch_range(
    store: &dyn Store,
    key: &str,
    range: std::ops::Range<u64>,
    chunk: usize,
    layers: std::ops::Range<u32>,
    with_header: bool,
    g: &KvGeometry,
    tokens: u32,
    full_len: u64,
    sh: &Arc<LoadShared>,
    permit: &mut FlightPermit,
) -> Result<(), ReadFailure> {
    // The header is known once this read ends, unless it failed before the header arrived:
    // then the chunk's geometry cannot be checked, and its other layers are not trusted.
    let _header = with_header.then(|| sh.header_bad_unless_set(chunk));
    let all = 0..g.layers;
    let fail = |status, err, layers| ReadFailure {
        status,
        err,
        layers,
    };
    let geometry = |reason: String| {
        fail(
            ChunkStatus::WrongGeometry,
            LayerError::GeometryMismatch { chunk, reason },
            all.clone(),
        )
    };
    let slice = g.slice_bytes();
    let sent = std::time::Instant::now();
    // An object in a local file (the filesystem store) is read straight into place; any
    // other answer (no local file, an error) takes the stream path, which names the error.
    if let Ok(Some(obj)) = store.open_local(key).await {
        permit.flight.headers(sent.elapsed().as_secs_f64());
        if obj.meta().size != full_len {
            return Err(geometry(format!(
                "object {key} has {} bytes, expected {full_len} for this geometry",
                obj.meta().size
            )));
        }
        let (file, _) = obj.into_parts();
        let (sh2, g2, k2, ls) = (sh.clone(), g.clone(), key.to_string(), layers.clone());
        let read = tokio::task::spawn_blocking(move || {
            super::local::read_slices(&file, &sh2, chunk, ls, with_header, &g2, tokens, &k2)
        })
        .await
        .map_err(|e| {
            fail(
                ChunkStatus::Error,
                LayerError::Storage {
                    chunk,
                    message: format!("local read of {key} failed: {e}"),
                },
                layers.clone(),
            )
        })?;
        permit.received(read.bytes);
        for (layer, crc) in read.awaiting_header {
            if !sh.header_ok(chunk).await {
                return Err(geometry(format!(
                    "the header of {key} (read with layer 0) did not match or could not be read"
                )));
            }
            sh.record_slice_crc(chunk, layer as usize, crc);
            sh.state.complete_impl(layer, slice);
        }
        return match read.failed {
            Some((status, err, touched)) => Err(fail(status, err, touched)),
            None => Ok(()),
        };
    }
    // A body read straight into place where the store offers one; else the store's stream.
    let storage = |e: &crate::error::StoreError| {
        let (status, err) = classify(chunk, key, e);
        // No object, or too short for this geometry: the whole chunk; a storage error
        // (after the store's retries): this read's layers.
        let touched = match status {
            ChunkStatus::Missing | ChunkStatus::WrongGeometry => all.clone(),
            _ => layers.clone(),
        };
        fail(status, err, touched)
    };
    let (size, src) = match store.get_range_body(key, range.clone()).await {
        Ok(Some(b)) => (b.meta.size, Source::Direct(b)),
        Ok(None) => {
            let opts = GetOptions {
                range: Some(range.clone()),
            };
            let res = store.get_opts(key, opts).await.map_err(|e| storage(&e))?;
            (res.meta.size, Source::Stream(res.body))
        }
        Err(e) => return Err(storage(&e)),
    };
    permit.flight.headers(sent.elapsed().as_secs_f64());
    if size != full_len {
        return Err(geometry(format!(
            "object {key} has {size} bytes, expected {full_len} for this geometry"
        )));
    }
    // Demultiplex the body: [header] then per layer [slice bytes][crc32c].
    let header_len = if with_header { HEADER_LEN as usize } else { 0 };
    let demux = SliceDemux::new(header_len, layers.len(), slice);
    let place = |i: usize| (layers.start + i as u32, chunk as u64 * slice);
    let mut body = BodyReader::new(src, demux, sh, place);
    let layer_of = |b: &BodyReader<'_, _>| layers.start + b.demux().current_slice() as u32;
    // This read's layers from `l` on did not arrive.
    let rest = |l: u32, status, err| fail(status, err, l..layers.end);
    loop {
        let event = match body.next(permit).await {
            Ok(ev) => ev,
            Err(e) => {
                let l = layer_of(&body);
                return Err(match e {
                    BodyError::Cancelled => rest(l, ChunkStatus::Error, LayerError::Cancelled),
                    BodyError::Body(e) => rest(l, ChunkStatus::Error, classify(chunk, key, &e).1),
                    BodyError::Dest(e) => rest(l, ChunkStatus::Error, e),
                    BodyError::Excess => {
                        let message = format!("body of {key} is longer than the range asked for");
                        let err = LayerError::Storage { chunk, message };
                        rest(layers.end, ChunkStatus::Corrupt, err)
                    }
                });
            }
        };
        match event {
            Event::End => break,
            Event::Header => {
                let h = ChunkHeader::decode(body.demux().header())
                    .map_err(|e| geometry(e.to_string()))?;
                h.check(g, tokens).map_err(|e| geometry(e.to_string()))?;
                sh.set_header(chunk, true);
            }
            Event::SliceEnd(end) => {
                let layer = layers.start + end.slice as u32;
                if !sh
                    .settle_slice(chunk, layer, slice, &end, with_header)
                    .await
                {
                    return Err(geometry(format!(
                        "the header of {key} (read with layer 0) did not match or could not be read"
                    )));
                }
            }
        }
    }
    let demux = body.demux();
    let want = range.end - range.start;
    if demux.received() != want || !demux.complete() {
        return Err(rest(
            layers.start + demux.current_slice() as u32,
            ChunkStatus::Corrupt,
            LayerError::Storage {
                chunk,
                message: format!(
                    "body of {key} was truncated: {} of {want} bytes",
                    demux.received()
                ),
            },
        ));
    }
    Ok(())
}
