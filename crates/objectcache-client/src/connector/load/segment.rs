//! Segment objects on the stock-S3 path (object format version 2, `docs/object-format.md`):
//! which reads a load makes when the lookup's markers place some of its chunks in segments
//! ([`plan`]), and one read of a segment run, cut into its slices as it arrives and checked
//! against the segment's header and chunk list ([`fetch_segment`]; from the filesystem store,
//! each slice is read with `pread(2)` straight into place, as `local.rs` does for chunk
//! objects).
//!
//! Engines write format version 2 only with `save_format = v2` (`connector/save.rs`); this
//! reading side is in every engine (a fleet must read a format before any of it writes it).

use super::body::{BodyError, BodyReader, Event, Source};
use super::window::{classify, FlightPermit};
use super::{LoadRequest, LoadShared};
use crate::connector::status::ChunkStatus;
use crate::error::{LayerError, StoreError};
use crate::layout::{
    place, plan_layer_major, plan_segment_reads, ChunkHash, KvGeometry, Marker, RangeRead, Run,
    SegmentHeader, SegmentRead, SegmentRun, SliceDemux,
};
use crate::store::{GetOptions, Store};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

/// Parallel reads a segment load's layer is cut into on average (`segment_pieces`): a
/// one-save 32K-token 8B load then takes 4 x 32 = 128 GETs, the goal of issue 18, whether
/// the save made one segment or several.
const SEGMENT_PIECES: u32 = 4;
/// Parallel reads of layer 0, taken from the last layers' share where they have reads to
/// spare (`segment_pieces`). Prefill waits for all of layer 0; over 4 connections it came
/// 2.8-3.0x gather's TTFL, over 16 1.7-2.6x (32K at 8B, `objectcache-bench transfer
/// --paths gather-tcp,s3-segment`, loopback; docs/object-format.md). A load stays at 128
/// GETs: in four segments, the last layers' reads each span two layers of one segment.
const SEGMENT_FIRST_PIECES: u32 = 16;
/// Smallest such read, bytes: below it a layer's range is read whole.
const SEGMENT_MIN_PIECE: u64 = 1 << 20;

/// One read of a load on the stock-S3 path.
pub(super) enum Planned {
    /// Layers of one chunk object (format version 1).
    Chunk(RangeRead),
    /// Layers of a run of chunks in a segment object (format version 2), or its header.
    Segment(SegmentRead),
}

impl Planned {
    /// The first layer the read carries (0 for a segment's header).
    pub(super) fn first_layer(&self) -> u32 {
        match self {
            Planned::Chunk(r) => r.layers.start,
            Planned::Segment(r) => r.layers.start,
        }
    }

    /// Bytes the read moves (a chunk's layer-0 read also fetches its header).
    pub(super) fn len(&self) -> u64 {
        match self {
            Planned::Chunk(r) if r.layers.start == 0 => r.bytes.end,
            Planned::Chunk(r) => r.bytes.end - r.bytes.start,
            Planned::Segment(r) => r.bytes.end - r.bytes.start,
        }
    }

    fn header_only(&self) -> bool {
        matches!(self, Planned::Segment(r) if r.positions.is_empty())
    }

    /// Whether every chunk this read carries is already known unusable (no object, or
    /// another geometry), so the read is not worth making.
    pub(super) fn unusable(&self, sh: &LoadShared) -> bool {
        let gone = |c: usize| {
            matches!(
                sh.chunk(c),
                ChunkStatus::Missing | ChunkStatus::WrongGeometry
            )
        };
        match self {
            Planned::Chunk(r) => gone(r.chunk),
            Planned::Segment(r) => !r.positions.is_empty() && r.positions.clone().all(gone),
        }
    }
}

/// The reads of `req`, layer-major, and the segment runs they name: positions that
/// `markers` place in a segment are read from it (`layout::place`, `plan_segment_reads`),
/// every other position from its chunk object (`plan_layer_major`, coalescing later layers
/// up to `coalesce` bytes). A segment's header-only reads go first.
pub(super) fn plan(
    req: &LoadRequest,
    markers: &BTreeMap<usize, Marker>,
    coalesce: u64,
) -> (Vec<Planned>, Vec<SegmentRun>) {
    let g = &req.geometry;
    let n = req.hashes.len();
    let runs: Vec<SegmentRun> = if markers.values().any(|m| matches!(m, Marker::Segment(_))) {
        place(n, markers)
            .runs
            .into_iter()
            .filter_map(|r| match r {
                Run::Segment(s) => Some(s),
                Run::Chunks(_) => None,
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut in_segment = vec![false; n];
    for r in &runs {
        in_segment[r.positions.clone()].fill(true);
    }
    let mut plan: Vec<Planned> = plan_layer_major(n, g.layers, g.slice_bytes(), coalesce)
        .into_iter()
        .filter(|r| !in_segment[r.chunk])
        .map(Planned::Chunk)
        .collect();
    if !runs.is_empty() {
        plan.extend(
            plan_segment_reads(
                &runs,
                g.layers,
                g.slice_bytes(),
                SEGMENT_PIECES,
                SEGMENT_FIRST_PIECES,
                SEGMENT_MIN_PIECE,
            )
            .into_iter()
            .map(Planned::Segment),
        );
        // Stable: within a layer, chunk reads keep their order, then the segments'.
        plan.sort_by_key(|r| (r.first_layer(), !r.header_only()));
    }
    (plan, runs)
}

/// Marks chunks `chunks` with `status` and fails `layers` with `err` (a miss naming the
/// first of them; their other layers and the other chunks are unaffected).
fn fail(
    sh: &LoadShared,
    chunks: Range<usize>,
    layers: Range<u32>,
    status: ChunkStatus,
    err: LayerError,
) {
    for c in chunks {
        sh.set_chunk(c, status);
    }
    for l in layers {
        sh.state.fail_impl(l, err.clone());
    }
}

/// The segment cannot serve run `run` at all (`reason`): every chunk of it is
/// `WrongGeometry` and every layer a miss naming the run's first chunk.
fn fail_run(sh: &LoadShared, run: &SegmentRun, g: &KvGeometry, reason: String) {
    let err = LayerError::GeometryMismatch {
        chunk: run.positions.start,
        reason,
    };
    let status = ChunkStatus::WrongGeometry;
    fail(sh, run.positions.clone(), 0..g.layers, status, err);
}

/// Marks every chunk `read` carries with `status` and fails its layers with `err` (a read
/// that failed as a whole: the run's other layers are unaffected).
fn fail_read(sh: &LoadShared, read: &SegmentRead, status: ChunkStatus, err: LayerError) {
    fail(sh, read.positions.clone(), read.layers.clone(), status, err);
}

/// Fails what `read` had not delivered from its `slice`-th slice on (slices in body order:
/// layer by layer, each layer's positions in order): in the layer of that slice its
/// position and the later ones, in its later layers every position.
fn fail_rest(
    sh: &LoadShared,
    read: &SegmentRead,
    slice: usize,
    status: ChunkStatus,
    err: LayerError,
) {
    let (end, (layer, c)) = (read.positions.end, read.slice(slice));
    let (chunks, layer) = if layer >= read.layers.end {
        // Every slice arrived, then more than was asked for: the last layer.
        (end..end, read.layers.end - 1)
    } else if layer + 1 < read.layers.end {
        (read.positions.clone(), layer)
    } else {
        (c..end, layer)
    };
    fail(sh, chunks, layer..read.layers.end, status, err);
}

/// One read of a segment run and what it needs: the store and the segment's key, the run
/// and the read planned for it, the load's chunk hashes, geometry and shared state.
#[derive(Clone, Copy)]
pub(super) struct SegmentFetch<'a> {
    pub(super) store: &'a dyn Store,
    pub(super) key: &'a str,
    pub(super) run: &'a SegmentRun,
    pub(super) read: &'a SegmentRead,
    pub(super) hashes: &'a [ChunkHash],
    pub(super) g: &'a KvGeometry,
    pub(super) sh: &'a Arc<LoadShared>,
}

/// Reads `read` of segment `key` (run `run` of the load whose chunk hashes are `hashes`)
/// straight into the destination, verifying each slice's CRC32C. Nothing of the run is
/// exposed before its header matched the request: the geometry, the layout the marker gave,
/// and the chunk list at the run's indexes; a chunk the list does not hold there is a miss
/// for all its layers (the segment never lends bytes to a chunk it does not hold). Failures
/// become misses of exactly the layers and chunks they touch.
pub(super) async fn fetch_segment(f: SegmentFetch<'_>, permit: &mut FlightPermit) {
    fetch_inner(f, permit).await;
    if f.read.with_header {
        // Known by now unless the read failed before it arrived: then none of the run's
        // chunks can be trusted (a later read of them fails them).
        for c in f.run.positions.clone() {
            f.sh.set_header(c, false);
        }
    }
}

async fn fetch_inner(f: SegmentFetch<'_>, permit: &mut FlightPermit) {
    let SegmentFetch {
        store,
        key,
        run,
        read,
        hashes,
        g,
        sh,
    } = f;
    let all = 0..g.layers;
    let slice = g.slice_bytes();
    let c0 = run.positions.start;
    // The segment cannot serve this run at all: every chunk of it, every layer.
    let unusable = |reason: String| fail_run(sh, run, g, reason);
    let sent = std::time::Instant::now();
    // A segment in a local file (the filesystem store) is read straight into place; any
    // other answer (no local file, an error) takes the stream path, which names the error.
    if let Ok(Some(obj)) = store.open_local(key).await {
        permit.flight.headers(sent.elapsed().as_secs_f64());
        if obj.meta().size != run.object_len {
            let why = format!(
                "segment {key} has {} bytes, its marker says {}",
                obj.meta().size,
                run.object_len
            );
            unusable(why);
            return;
        }
        let (file, _) = obj.into_parts();
        // The chunk hashes are needed only to check the header's chunk list.
        let hashes2 = if read.with_header {
            hashes.to_vec()
        } else {
            Vec::new()
        };
        let (sh2, run2, read2, g2, k2) = (
            sh.clone(),
            run.clone(),
            read.clone(),
            g.clone(),
            key.to_string(),
        );
        let local = tokio::task::spawn_blocking(move || {
            read_local(&file, &run2, &read2, &hashes2, &g2, &k2, &sh2)
        })
        .await;
        let local = match local {
            Ok(l) => l,
            Err(e) => {
                let message = format!("local read of {key} failed: {e}");
                let err = LayerError::Storage { chunk: c0, message };
                fail_read(sh, read, ChunkStatus::Error, err);
                return;
            }
        };
        permit.received(local.bytes);
        for (c, layer, crc) in local.awaiting_header {
            if sh.header_ok(c).await {
                sh.record_slice_crc(c, layer as usize, crc);
                sh.state.complete_impl(layer, slice);
            } else {
                fail(
                    sh,
                    c..c + 1,
                    0..g.layers,
                    ChunkStatus::WrongGeometry,
                    header_bad(key, c),
                );
            }
        }
        return;
    }
    // A body read straight into place where the store offers one; else the store's stream.
    let storage = |e: &StoreError| {
        let (status, err) = classify(c0, key, e);
        match status {
            // No segment, or too short: every chunk it was to serve, every layer.
            ChunkStatus::Missing | ChunkStatus::WrongGeometry => {
                fail(sh, run.positions.clone(), all.clone(), status, err)
            }
            // A storage error (after the store's retries): this read's slices.
            _ => fail_read(sh, read, status, err),
        }
    };
    let got = match store.get_range_body(key, read.bytes.clone()).await {
        Ok(Some(b)) => Ok((b.meta.size, Source::Direct(b))),
        Ok(None) => {
            let opts = GetOptions {
                range: Some(read.bytes.clone()),
            };
            store
                .get_opts(key, opts)
                .await
                .map(|res| (res.meta.size, Source::Stream(res.body)))
        }
        Err(e) => Err(e),
    };
    let (size, src) = match got {
        Ok(r) => r,
        Err(e) => return storage(&e),
    };
    permit.flight.headers(sent.elapsed().as_secs_f64());
    if size != run.object_len {
        let why = format!(
            "segment {key} has {size} bytes, its marker says {}",
            run.object_len
        );
        unusable(why);
        return;
    }
    let header_len = if read.with_header {
        run.header_len as usize
    } else {
        0
    };
    let demux = SliceDemux::new(header_len, read.slices(), slice);
    let dest = |i: usize| {
        let (layer, c) = read.slice(i);
        (layer, c as u64 * slice)
    };
    let mut body = BodyReader::new(src, demux, sh, dest);
    // This read's slices from the current one on did not arrive.
    let rest = |d: &SliceDemux, status, err| fail_rest(sh, read, d.current_slice(), status, err);
    loop {
        let event = match body.next(permit).await {
            Ok(ev) => ev,
            Err(e) => {
                let d = body.demux();
                return match e {
                    BodyError::Cancelled => rest(d, ChunkStatus::Error, LayerError::Cancelled),
                    BodyError::Body(e) => rest(d, ChunkStatus::Error, classify(c0, key, &e).1),
                    BodyError::Dest(e) => rest(d, ChunkStatus::Error, e),
                    BodyError::Excess => {
                        let message = format!("body of {key} is longer than the range asked for");
                        let err = LayerError::Storage { chunk: c0, message };
                        rest(d, ChunkStatus::Corrupt, err)
                    }
                };
            }
        };
        match event {
            Event::End => break,
            Event::Header => {
                if let Err(why) = check_header(body.demux().header(), run, hashes, g, key, sh) {
                    // Failed before the header is marked bad, so that reads waiting on it
                    // find the layers failed with this reason.
                    unusable(why);
                    for c in run.positions.clone() {
                        sh.set_header(c, false);
                    }
                    return;
                }
            }
            Event::SliceEnd(end) => {
                let (layer, c) = read.slice(end.slice);
                if !sh.settle_slice(c, layer, slice, &end, false).await {
                    let err = header_bad(key, c);
                    fail(sh, c..c + 1, 0..g.layers, ChunkStatus::WrongGeometry, err);
                }
            }
        }
    }
    let demux = body.demux();
    let want = read.bytes.end - read.bytes.start;
    if demux.received() != want || !demux.complete() {
        let message = format!(
            "body of {key} was truncated: {} of {want} bytes",
            demux.received()
        );
        rest(
            demux,
            ChunkStatus::Corrupt,
            LayerError::Storage { chunk: c0, message },
        );
    }
}

/// The miss of chunk `c`, whose slice of segment `key` arrived intact but whose header did
/// not match (or was never read, or the segment's chunk list does not hold it).
fn header_bad(key: &str, c: usize) -> LayerError {
    LayerError::GeometryMismatch {
        chunk: c,
        reason: format!(
            "the header of {key} did not match, could not be read, or does not hold chunk {c}"
        ),
    }
}

/// What a local read of a segment run did ([`read_local`]), for the async side to finish.
#[derive(Debug, Default)]
struct LocalSegmentRead {
    /// Bytes read from the file (header, slices and their CRC trailers).
    bytes: u64,
    /// Slices in place with a matching CRC32C (position, layer, CRC), not yet completed
    /// because the chunk's header was not known good yet (another read carries it).
    awaiting_header: Vec<(usize, u32, u32)>,
}

/// [`fetch_segment`] for a segment in a local file (the filesystem store, whose size was
/// checked against the marker): the same outcomes as the stream path, with each slice read
/// by `pread(2)` straight into the destination and its CRC32C checked there
/// (`local::read_slice`). Blocking: call it on the blocking pool.
fn read_local(
    file: &std::fs::File,
    run: &SegmentRun,
    read: &SegmentRead,
    hashes: &[ChunkHash],
    g: &KvGeometry,
    key: &str,
    sh: &LoadShared,
) -> LocalSegmentRead {
    use std::os::unix::fs::FileExt;
    let mut out = LocalSegmentRead::default();
    let (slice, c0) = (g.slice_bytes(), run.positions.start);
    let mut at = read.bytes.start;
    if read.with_header {
        let mut b = vec![0u8; run.header_len as usize];
        if let Err(e) = file.read_exact_at(&mut b, 0) {
            let err = LayerError::Storage {
                chunk: c0,
                message: format!("header read of {key}: {e}"),
            };
            fail_read(sh, read, ChunkStatus::Error, err);
            return out;
        }
        out.bytes += b.len() as u64;
        at += b.len() as u64;
        if let Err(why) = check_header(&b, run, hashes, g, key, sh) {
            // As the stream path: failed before the header is marked bad.
            fail_run(sh, run, g, why);
            for c in run.positions.clone() {
                sh.set_header(c, false);
            }
            return out;
        }
    }
    for i in 0..read.slices() {
        let (layer, c) = read.slice(i);
        if sh.state.is_cancelled() {
            fail_rest(sh, read, i, ChunkStatus::Error, LayerError::Cancelled);
            return out;
        }
        match super::local::read_slice(file, sh, c, layer, slice, at, key) {
            // Its layer already failed (another chunk's slice): not needed.
            Ok(None) => {}
            Ok(Some((stored, computed))) => {
                out.bytes += slice + 4;
                if stored != computed {
                    sh.slice_corrupt(c, layer, stored, computed);
                } else if sh.header_is_ok(c) {
                    sh.record_slice_crc(c, layer as usize, stored);
                    sh.state.complete_impl(layer, slice);
                } else {
                    out.awaiting_header.push((c, layer, stored));
                }
            }
            Err(e) => {
                fail_rest(sh, read, i, ChunkStatus::Error, e);
                return out;
            }
        }
        at += slice + 4;
    }
    out
}

/// Checks a segment's header (`b`: its whole header and chunk list) against the run the
/// marker promised: the geometry, the chunk count and header length, and the chunk list at
/// the run's indexes. Chunks of the run the list does not hold are misses (all layers) and
/// the others' headers are marked good.
///
/// # Errors
/// Why the header does not fit: the whole run is then unusable.
fn check_header(
    b: &[u8],
    run: &SegmentRun,
    hashes: &[ChunkHash],
    g: &KvGeometry,
    key: &str,
    sh: &LoadShared,
) -> Result<(), String> {
    let h = SegmentHeader::decode(b).map_err(|e| format!("segment {key}: {e}"))?;
    h.check(g).map_err(|e| format!("segment {key}: {e}"))?;
    if h.chunks != run.chunks || h.header_len != run.header_len {
        return Err(format!(
            "segment {key} holds {} chunks in a {}-byte header, its marker says {} in {}",
            h.chunks, h.header_len, run.chunks, run.header_len
        ));
    }
    let list = h
        .decode_chunk_list(b)
        .map_err(|e| format!("segment {key}: {e}"))?;
    let matched = run.matched(&list, hashes);
    for (i, c) in run.positions.clone().enumerate() {
        if i < matched {
            sh.set_header(c, true);
        } else {
            // Failed first, then marked: a read waiting on this header finds the layers
            // failed with this reason.
            let err = LayerError::Missing {
                chunk: c,
                key: format!("{key} (its chunk list does not hold chunk {c})"),
            };
            fail(sh, c..c + 1, 0..g.layers, ChunkStatus::Missing, err);
            sh.set_header(c, false);
        }
    }
    Ok(())
}
