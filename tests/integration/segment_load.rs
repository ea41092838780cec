//! Loads of segment objects (object format version 2, `docs/object-format.md`) on the
//! stock-S3 path, on every backend (memory, fs, and S3 when the test environment has one):
//! the objects are written here as a version 2 writer would (the segment, then a 64-byte
//! marker per chunk), looked up and loaded through the `Engine`, and compared byte for byte.
//! A segment that is corrupt, missing, or does not hold a chunk is a miss for exactly what it
//! touches, never bytes.

use crate::common;
use crate::common::shared_rt as rt;
use crate::layerwise_load::stores;

use bytes::Bytes;
use common::*;
use objectcache::connector::{ChunkStatus, Engine, EngineConfig, LayerBuffers, LoadRequest};
use objectcache::layout::{encode_segment_parts, segment_digest, SegmentMarker};
use objectcache::store::{Store, StoreExt};
use objectcache::{ChunkHash, KvGeometry, LayerError};
use std::ops::Range;
use std::sync::Arc;

fn small() -> KvGeometry {
    small_geometry("test/segments", 6)
}

/// Writes chunks `chunks` of a prefix (`hs`, per-layer bytes `data`) as one segment of the
/// chunk hashes `listed` (normally `hs[chunks]`), then a marker per chunk of `chunks`. With
/// `flip`, the byte at that offset of the segment is flipped before it is written; with
/// `segment` false only the markers are written.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_segment(
    store: &Arc<dyn Store>,
    e: &Engine,
    g: &KvGeometry,
    hs: &[ChunkHash],
    data: &[Vec<u8>],
    chunks: Range<usize>,
    listed: &[ChunkHash],
    flip: Option<(u32, usize)>,
    segment: bool,
) {
    let keys = e.keys(g).unwrap();
    let slice = g.slice_bytes() as usize;
    let (h, mut obj) = encode_segment_parts(g, listed, |l, i| {
        let c = chunks.start + i as usize;
        vec![&data[l as usize][c * slice..(c + 1) * slice]]
    })
    .unwrap();
    if let Some((layer, index)) = flip {
        let at = h.layout().slice_range(layer, index as u32).start as usize + 5;
        obj[at] ^= 1;
    }
    let digest = segment_digest(listed);
    rt().block_on(async {
        if segment {
            store
                .put(&keys.segment(&digest), Bytes::from(obj))
                .await
                .unwrap();
        }
        for (i, c) in chunks.enumerate() {
            let m = SegmentMarker::new(&h, i as u32, digest).encode();
            store
                .put(&keys.marker(&hs[c]), Bytes::copy_from_slice(&m))
                .await
                .unwrap();
        }
    });
}

/// An engine over `store` in namespace `ns` whose saves write format version 2, segments of
/// at most `max_bytes`; `cached` false: it keeps no lookup answers (as a worker process that
/// never looked up).
fn v2_engine(store: Arc<dyn Store>, ns: &str, max_bytes: u64, cached: bool) -> Engine {
    let mut cfg = EngineConfig::from_pairs([
        ("namespace", ns),
        ("save_format", "v2"),
        ("segment_max_bytes", &max_bytes.to_string()),
    ])
    .unwrap();
    if !cached {
        cfg.lookup_cache_ttl = std::time::Duration::ZERO;
    }
    Engine::with_store(store, cfg).unwrap()
}

#[test]
fn saves_write_segments_that_loads_read_with_or_without_the_lookups_markers() {
    for (name, s) in stores() {
        let g = small();
        let (hs, data) = seeded_prefix(&g, 8, 31);
        let (slice, layers) = (g.slice_bytes() as usize, g.layers as u64);
        let ns = unique_ns(name);
        // Two chunks of KV per segment (the limit counts slices, not headers and CRCs).
        let two = 2 * layers * slice as u64;
        let writer = v2_engine(s.clone(), &ns, two + 1, true);
        let part = |n: usize| -> Vec<&[u8]> { data.iter().map(|v| &v[..n * slice]).collect() };

        // Chunks 0..6 in one save: three segments of two chunks and six 64-byte markers, no
        // chunk object.
        let r = writer.save_blocking(&g, &hs[..6], &part(6)).unwrap();
        assert_eq!((r.written, r.already_present), (6, 0), "{name}");
        let keys = writer.keys(&g).unwrap();
        let listed = rt().block_on(s.list(&format!("{}/", ns), 1000)).unwrap();
        let segs: Vec<u64> = listed
            .iter()
            .filter(|m| m.key.starts_with(&keys.segment_prefix()))
            .map(|m| m.size)
            .collect();
        let seg_len = objectcache::layout::SegmentHeader::for_geometry(&g, &hs[..2])
            .unwrap()
            .object_len();
        assert_eq!(segs, vec![seg_len; 3], "{name}: {listed:?}");
        assert!(
            hs.iter()
                .all(|h| !listed.iter().any(|m| m.key == keys.data(h))),
            "{name}: a chunk object was written"
        );
        assert_eq!(r.bytes, 3 * seg_len + 6 * 64, "{name}");

        // The writer loads from what its save learnt: one read per (segment, layer) (the
        // pieces of a layer are shared among its segments), no marker read.
        assert_eq!(writer.lookup_blocking(&g, &hs).unwrap(), 6, "{name}");
        let h = start_load(&writer, &g, hs[..6].to_vec(), 6 * slice);
        assert_layers_exact(&h, &part(6).iter().map(|b| b.to_vec()).collect::<Vec<_>>());
        assert_eq!(h.stats().requests, 3 * layers, "{name}");

        // Another engine writing version 2 that knows no marker reads one per segment first
        // (three rounds), then the same reads.
        let worker = v2_engine(s.clone(), &ns, 1 << 30, false);
        let h = start_load(&worker, &g, hs[..6].to_vec(), 6 * slice);
        assert_layers_exact(&h, &part(6).iter().map(|b| b.to_vec()).collect::<Vec<_>>());
        assert!(h.chunk_status().iter().all(|c| *c == ChunkStatus::Ok));
        assert_eq!(h.stats().requests, 3 + 3 * layers, "{name}");

        // A version 1 engine that knows no marker reads chunk objects: misses, never bytes.
        let v1 = uncached_engine(s.clone(), &ns);
        let h = start_load(&v1, &g, hs[..6].to_vec(), 6 * slice);
        for l in 0..g.layers as usize {
            assert!(h.wait_layer_blocking(l, None).is_err(), "{name} layer {l}");
            assert!(h.layer(l).is_none(), "{name} layer {l} exposes bytes");
        }

        // The writer extends the prefix: the six chunks it knows are published are not
        // written again; chunks 6..8 make one more segment.
        let r = writer.save_blocking(&g, &hs, &part(8)).unwrap();
        assert_eq!((r.written, r.already_present), (2, 6), "{name}");
        assert_eq!(r.bytes, seg_len + 2 * 64, "{name}");
        let h = start_load(&worker, &g, hs.clone(), 8 * slice);
        assert_layers_exact(&h, &data);
        assert_eq!(h.stats().requests, 4 + 4 * layers, "{name}");

        // The same chunks saved by an engine that knows nothing, with the same segment size:
        // the same segment keys and markers, already there; nothing is written.
        let other = v2_engine(s.clone(), &ns, two, false);
        let r = other.save_blocking(&g, &hs[..6], &part(6)).unwrap();
        assert_eq!((r.written, r.already_present, r.bytes), (0, 6, 0), "{name}");
    }
}

#[test]
fn segments_load_byte_for_byte_alone_and_beside_chunk_objects() {
    for (name, s) in stores() {
        let g = small();
        let (hs, data) = seeded_prefix(&g, 6, 21);
        let slice = g.slice_bytes() as usize;
        let layers = g.layers as u64;
        // (what is written, GETs the load takes: a segment run reads one range per layer; a
        // chunk object its layer 0 with the header, then its other layers coalesced)
        let cases: [(&str, u64); 3] = [
            ("one segment", layers),
            ("two segments", 2 * layers),
            ("chunk objects then a segment", 2 * 2 + layers),
        ];
        for (case, gets) in cases {
            let e = engine(s.clone(), &unique_ns(name));
            match case {
                "one segment" => write_segment(&s, &e, &g, &hs, &data, 0..6, &hs, None, true),
                "two segments" => {
                    write_segment(&s, &e, &g, &hs, &data, 0..3, &hs[0..3], None, true);
                    write_segment(&s, &e, &g, &hs, &data, 3..6, &hs[3..6], None, true);
                }
                _ => {
                    let first: Vec<&[u8]> = data.iter().map(|v| &v[..2 * slice]).collect();
                    e.save_blocking(&g, &hs[..2], &first).unwrap();
                    write_segment(&s, &e, &g, &hs, &data, 2..6, &hs[2..6], None, true);
                }
            }
            assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 6, "{name}: {case}");
            let h = start_load(&e, &g, hs.clone(), 6 * slice);
            assert_layers_exact(&h, &data);
            assert!(
                h.chunk_status().iter().all(|c| *c == ChunkStatus::Ok),
                "{name}: {case}: {:?}",
                h.chunk_status()
            );
            assert_eq!(h.stats().requests, gets, "{name}: {case}");
            // A partial hit reads the first chunks of the segment alone.
            let h = start_load(&e, &g, hs[..4].to_vec(), 4 * slice);
            let part: Vec<Vec<u8>> = data.iter().map(|v| v[..4 * slice].to_vec()).collect();
            assert_layers_exact(&h, &part);
        }
    }
}

/// More whole segments than a layer's share of reads (six one-chunk segments, 4 reads a
/// layer on average, layer 0 taking one per segment): after layer 0, some segments' reads of
/// the layer before are extended over the next layer (contiguous: a segment is layer-major),
/// so the load keeps the budget of 4 GETs a layer instead of one per (segment, layer), and
/// lands byte for byte. A flipped byte in segment 0's layer 1, which rides on its layer-0
/// read, fails layer 1 alone.
#[test]
fn reads_spanning_layers_of_whole_segments_keep_the_budget_byte_for_byte() {
    for (name, s) in stores() {
        let g = small();
        let (hs, data) = seeded_prefix(&g, 6, 23);
        let (slice, layers) = (g.slice_bytes() as usize, g.layers as usize);
        for flip in [None, Some((1u32, 0usize))] {
            let e = engine(s.clone(), &unique_ns(name));
            for c in 0..6 {
                let f = if c == 0 { flip } else { None };
                write_segment(&s, &e, &g, &hs, &data, c..c + 1, &hs[c..c + 1], f, true);
            }
            assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 6, "{name}");
            let h = start_load(&e, &g, hs.clone(), 6 * slice);
            for l in 0..layers {
                match (h.wait_layer_blocking(l, None), flip) {
                    (Ok(()), _) => {
                        assert!(flip.is_none() || l != 1, "{name}: layer 1 ready");
                        assert!(h.layer(l).unwrap() == &data[l][..], "{name} layer {l}");
                    }
                    (Err(err), Some(_)) => {
                        assert!(
                            l == 1
                                && matches!(
                                    err,
                                    LayerError::ChecksumMismatch {
                                        chunk: 0,
                                        layer: 1,
                                        ..
                                    }
                                ),
                            "{name} layer {l}: {err:?}"
                        );
                        assert!(h.layer(l).is_none());
                    }
                    (Err(err), None) => panic!("{name} layer {l}: {err:?}"),
                }
            }
            assert_eq!(h.stats().requests, 4 * layers as u64, "{name}");
        }
    }
}

#[test]
fn a_segment_is_a_miss_for_exactly_what_it_touches() {
    for (name, s) in stores() {
        let g = small();
        let (hs, data) = seeded_prefix(&g, 4, 22);
        let slice = g.slice_bytes() as usize;
        let layers = g.layers as usize;

        // A flipped byte in chunk 1's slice of layer 2: layer 2 is a miss naming chunk 1,
        // every other layer arrives exact.
        let e = engine(s.clone(), &unique_ns(name));
        write_segment(&s, &e, &g, &hs, &data, 0..4, &hs, Some((2, 1)), true);
        assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 4);
        let h = start_load(&e, &g, hs.clone(), 4 * slice);
        for l in 0..layers {
            match h.wait_layer_blocking(l, None) {
                Ok(()) => assert!(l != 2 && h.layer(l).unwrap() == &data[l][..], "{name} {l}"),
                Err(err) => {
                    assert_eq!(l, 2, "{name}: {err:?}");
                    assert!(
                        matches!(
                            err,
                            LayerError::ChecksumMismatch {
                                chunk: 1,
                                layer: 2,
                                ..
                            }
                        ),
                        "{name}: {err:?}"
                    );
                    assert!(h.layer(l).is_none());
                }
            }
        }
        assert_eq!(h.chunk_status()[1], ChunkStatus::Corrupt, "{name}");

        // A segment whose chunk list holds another prompt's chunk at index 3 (a lying or
        // mistaken marker names it for chunk 3): chunk 3 is a miss on every layer, and the
        // first three chunks still load from it.
        let e = engine(s.clone(), &unique_ns(name));
        let mut listed = hs.clone();
        listed[3] = ChunkHash::new(&[0xee; 32]).unwrap();
        write_segment(&s, &e, &g, &hs, &data, 0..4, &listed, None, true);
        assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 4);
        let h = start_load(&e, &g, hs.clone(), 4 * slice);
        assert_every_layer_misses(&h, name, |err| {
            matches!(err, LayerError::Missing { chunk: 3, .. })
        });
        assert_eq!(h.chunk_status()[3], ChunkStatus::Missing, "{name}");
        drop(h);
        let h = load_first(&e, &g, &hs, 3);
        for l in 0..layers {
            assert!(h.layer(l).unwrap() == &data[l][..3 * slice], "{name} {l}");
        }

        // Markers without their segment: every chunk a miss, no bytes.
        let e = engine(s.clone(), &unique_ns(name));
        write_segment(&s, &e, &g, &hs, &data, 0..4, &hs, None, false);
        assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 4);
        let h = start_load(&e, &g, hs.clone(), 4 * slice);
        assert_every_layer_misses(&h, name, |err| matches!(err, LayerError::Missing { .. }));
        assert!(
            h.chunk_status().iter().all(|c| *c == ChunkStatus::Missing),
            "{name}: {:?}",
            h.chunk_status()
        );

        // A segment of another length than its markers say (a byte appended after the save):
        // every chunk a miss naming the lengths, no bytes (the file store's reads into place
        // check this before reading, as the stream path does).
        let e = engine(s.clone(), &unique_ns(name));
        write_segment(&s, &e, &g, &hs, &data, 0..4, &hs, None, true);
        let key = e.keys(&g).unwrap().segment(&segment_digest(&hs));
        rt().block_on(async {
            let mut obj = s.get_bytes(&key).await.unwrap().to_vec();
            obj.push(0);
            s.put(&key, Bytes::from(obj)).await.unwrap();
        });
        assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 4);
        let h = start_load(&e, &g, hs.clone(), 4 * slice);
        assert_every_layer_misses(
            &h,
            name,
            |err| matches!(err, LayerError::GeometryMismatch { reason, .. } if reason.contains("its marker says")),
        );
        assert!(
            h.chunk_status()
                .iter()
                .all(|c| *c == ChunkStatus::WrongGeometry),
            "{name}: {:?}",
            h.chunk_status()
        );
    }
}

/// A lookup in one engine (vLLM's scheduler process) and the load in another (its worker):
/// the worker's load finds the prefix's chunks in its segments from the markers the lookup
/// read, passed as `LoadHints::segment_markers` (one per segment), and reads them byte for
/// byte in one GET per segment and layer. Without them it reads chunk objects, which a
/// version 2 save does not write: every chunk a miss, never bytes.
#[test]
fn a_load_elsewhere_places_chunks_from_the_lookups_markers() {
    for (name, s) in stores() {
        let g = small();
        let (hs, data) = seeded_prefix(&g, 6, 23);
        let slice = g.slice_bytes() as usize;
        let ns = unique_ns(name);
        let scheduler = engine(s.clone(), &ns);
        write_segment(&s, &scheduler, &g, &hs, &data, 0..2, &hs[0..2], None, true);
        write_segment(&s, &scheduler, &g, &hs, &data, 2..6, &hs[2..6], None, true);
        assert_eq!(scheduler.lookup_blocking(&g, &hs).unwrap(), 6, "{name}");
        let markers = scheduler.segment_markers(&g, &hs).unwrap();
        assert_eq!(
            markers.len(),
            2,
            "{name}: one marker per segment: {markers:?}"
        );

        let worker = uncached_engine(s.clone(), &ns);
        let req = LoadRequest::new(g.clone(), hs.clone()).with_segment_markers(markers.clone());
        let h = worker
            .load(req, LayerBuffers::allocate(g.layers as usize, 6 * slice))
            .unwrap();
        assert_layers_exact(&h, &data);
        assert_eq!(h.stats().requests, 2 * g.layers as u64, "{name}");

        let h = start_load(&worker, &g, hs.clone(), 6 * slice);
        assert_every_layer_misses(&h, name, |err| matches!(err, LayerError::Missing { .. }));

        // The same markers taken by an engine (as the C ABI's objectcache_segment_markers_add
        // does) place a plain load: the same 12 GETs.
        let taker = engine(s.clone(), &ns);
        taker.add_segment_markers(&g, &hs, &markers).unwrap();
        let h = start_load(&taker, &g, hs.clone(), 6 * slice);
        assert_layers_exact(&h, &data);
        assert_eq!(h.stats().requests, 2 * g.layers as u64, "{name}");
        let err = taker
            .add_segment_markers(&g, &hs[..1], &markers)
            .unwrap_err()
            .to_string();
        assert!(err.contains("prefix position 2"), "{name}: {err}");

        // A marker past the request is refused, naming it.
        let far: std::collections::BTreeMap<usize, _> =
            [(6, markers.values().next().unwrap().clone())].into();
        let req = LoadRequest::new(g.clone(), hs.clone()).with_segment_markers(far);
        let err = worker
            .load(req, LayerBuffers::allocate(g.layers as usize, 6 * slice))
            .unwrap_err()
            .to_string();
        assert!(err.contains("prefix position 6"), "{name}: {err}");
    }
}
