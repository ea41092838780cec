//! Save, lookup and layer-ordered load, byte-exact, on every local backend (memory, fs);
//! the S3 (Ceph RGW) runs of the same cases live in tests/s3_layerwise.rs.

use crate::common;

use common::*;
use objectcache::connector::{ChunkStatus, Engine, LayerBuffers, LayerStatus, LoadRequest};
use objectcache::layout::{slice_range, KeyBuilder};
use objectcache::store::{FsStore, FsyncPolicy, MemoryStore, Store, StoreExt};
use objectcache::{KvGeometry, LayerError};
use std::sync::Arc;

fn small() -> KvGeometry {
    small_geometry("test/small", 6)
}

/// The S3 endpoint of the test environment (Ceph RGW in CI), when one answers.
fn s3_store() -> Option<Arc<dyn Store>> {
    // The S3 client's connection pool runs on the runtime that built it: keep that runtime
    // alive for the whole test process.
    let (s, _prefix) = common::shared_rt().block_on(common::test_s3_store("layerwise"))?;
    Some(Arc::new(s))
}

/// Every backend: memory, fs, and S3 (Ceph RGW) when available. Each test uses a unique
/// namespace, so runs sharing a bucket never see each other's objects.
pub(crate) fn stores() -> Vec<(&'static str, Arc<dyn Store>)> {
    let dir = tempfile::tempdir().unwrap().keep();
    let mut v: Vec<(&'static str, Arc<dyn Store>)> = vec![
        ("memory", Arc::new(MemoryStore::new())),
        (
            "fs",
            Arc::new(FsStore::new(dir, FsyncPolicy::Never).unwrap()),
        ),
    ];
    if let Some(s) = s3_store() {
        v.push(("s3", s));
    }
    v
}

/// Saves `chunks` chunks and loads `load_chunks` of them back; returns the handle's buffers.
fn round_trip(e: &Engine, g: &KvGeometry, chunks: usize, seed: u64) {
    let (hs, data) = seeded_prefix(g, chunks, seed);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    let rep = e.save_blocking(g, &hs, &refs).unwrap();
    assert_eq!(rep.written, chunks);
    assert_eq!(e.lookup_blocking(g, &hs).unwrap(), chunks);
    let h = start_load(e, g, hs.clone(), data[0].len());
    assert_layers_exact(&h, &data);
    assert!(
        h.chunk_status().iter().all(|s| *s == ChunkStatus::Ok),
        "{:?} on {}: {:?}",
        h.chunk_status(),
        e.store().name(),
        (0..g.layers as usize)
            .map(|l| h.poll_layer(l))
            .collect::<Vec<_>>()
    );
    let st = h.stats();
    assert_eq!(
        st.bytes,
        (chunks as u64) * g.slice_bytes() * g.layers as u64
    );
    assert!(st.ttfl_s.is_some() && st.ttll_s.is_some());
}

#[test]
fn round_trip_small_geometry_every_backend() {
    for (name, s) in stores() {
        let e = engine(s, &unique_ns(name));
        round_trip(&e, &small(), 7, 1);
    }
}

#[test]
fn round_trip_llama8b_4k_tokens_fs() {
    // 4K tokens at Llama-3.1-8B geometry: 16 chunks x 32 layers x 1 MiB = 512 MiB.
    let (_dir, s) = temp_fs_store();
    let e = engine(s, "rt8b");
    round_trip(&e, &KvGeometry::llama31_8b(), 16, 42);
}

#[test]
fn partial_hit_and_missing_middle_chunk() {
    for (name, s) in stores() {
        let g = small();
        let e = engine(s.clone(), &unique_ns(name));
        let (hs, data) = seeded_prefix(&g, 8, 3);
        let refs: Vec<&[u8]> = data
            .iter()
            .map(|v| &v[..5 * g.slice_bytes() as usize])
            .collect();
        e.save_blocking(&g, &hs[..5], &refs).unwrap();
        // Partial hit: 5 of 8 chunks.
        assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 5, "{name}");
        // Delete chunk 2's data object: a load of 5 chunks must report chunk 2 missing and
        // never mark any layer ready.
        let keys = e.keys(&g).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(s.delete(&keys.data(&hs[2]))).unwrap();
        let h = start_load(&e, &g, hs[..5].to_vec(), refs[0].len());
        assert_every_layer_misses(&h, name, |err| {
            matches!(err, LayerError::Missing { chunk: 2, .. })
        });
        assert_eq!(h.chunk_status()[2], ChunkStatus::Missing);
    }
}

#[test]
fn flipped_byte_is_a_miss_not_data() {
    for (name, s) in stores() {
        let g = small();
        let e = engine(s.clone(), &unique_ns(name));
        let (hs, data) = save_prefix(&e, &g, 3, 4);
        let keys = e.keys(&g).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let k = keys.data(&hs[1]);
        let mut obj = rt.block_on(s.get_bytes(&k)).unwrap().to_vec();
        let r = slice_range(4, g.slice_bytes());
        obj[r.start as usize + 17] ^= 0x40;
        rt.block_on(s.put(&k, obj.into())).unwrap();
        let h = start_load(&e, &g, hs.clone(), data[0].len());
        // Layer 4 of chunk 1 is corrupt: layer 4 is a miss naming chunk 1, and only layer 4
        // (issue 19: a bad slice fails only the layers it belongs to).
        let _ = h.wait_layer_blocking(4, None);
        assert!(
            matches!(
                h.poll_layer(4),
                LayerStatus::Failed(LayerError::ChecksumMismatch {
                    chunk: 1,
                    layer: 4,
                    ..
                })
            ),
            "{name}: {:?}",
            h.poll_layer(4)
        );
        for l in [0, 1, 2, 3, 5] {
            h.wait_layer_blocking(l, None)
                .unwrap_or_else(|e| panic!("{name}: layer {l} missed: {e}"));
            assert_eq!(h.layer(l).unwrap(), &data[l][..], "{name}: layer {l}");
        }
        assert!(
            h.layer(4).is_none(),
            "{name}: the corrupt layer exposes no bytes"
        );
        assert_eq!(h.chunk_status()[1], ChunkStatus::Corrupt);
    }
}

/// Case C3: an object bigger than the slot (another geometry) or truncated is rejected with
/// an error naming the mismatch; no byte lands past the caller's buffer; other keys still work.
#[test]
fn c3_object_bigger_than_slot_or_truncated() {
    for (name, s) in stores() {
        let g = small();
        let big = KvGeometry {
            head_dim: 32,
            ..g.clone()
        }; // twice the bytes per layer
        let e = engine(s.clone(), &unique_ns(name));
        let hs = hashes(&g, 2 * 16, 5);
        // Write a `big` object under the key a `g` chunk would use.
        let keys = e.keys(&g).unwrap();
        let bigdata = kv(&big, 1, 5);
        let obj =
            objectcache::layout::encode_chunk(&big, 16, |l| &bigdata[l as usize][..]).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(s.put(&keys.data(&hs[0]), obj.into())).unwrap();
        // Truncated object for chunk 1.
        let good = kv(&g, 1, 6);
        let obj = objectcache::layout::encode_chunk(&g, 16, |l| &good[l as usize][..]).unwrap();
        rt.block_on(s.put(&keys.data(&hs[1]), obj[..obj.len() / 2].to_vec().into()))
            .unwrap();
        for (i, what) in [(0usize, "bytes"), (1, "bytes")] {
            let slot = g.slice_bytes() as usize;
            // Buffers with a canary tail after the slot.
            let bufs: Vec<Vec<u8>> = (0..6).map(|_| vec![0xAB; slot + 64]).collect();
            let h = e
                .load(
                    LoadRequest::new(g.clone(), vec![hs[i].clone()]),
                    LayerBuffers::from_vecs(bufs),
                )
                .unwrap();
            let err = h.wait_layer_blocking(0, None).unwrap_err();
            assert!(
                matches!(err, LayerError::GeometryMismatch { .. }),
                "{name} chunk {i}: {err:?}"
            );
            assert!(err.to_string().contains(what), "{err}");
            assert_eq!(h.chunk_status()[0], ChunkStatus::WrongGeometry);
            let bufs = h.into_buffers().into_vecs().unwrap();
            for b in &bufs {
                assert!(
                    b[slot..].iter().all(|&x| x == 0xAB),
                    "{name}: canary overwritten"
                );
            }
        }
        // The store keeps serving other keys.
        round_trip(&e, &g, 2, 77);
    }
}

/// An object of another geometry at the same byte size (4 KV heads of 8 dimensions where the
/// request has 2 of 16) is refused by its header, whichever way it is read (the file store's
/// reads into place, the stream path of the others): every layer is a miss naming the
/// geometry, none exposes bytes, and the chunk is `WrongGeometry`; the good chunk beside it
/// lands byte for byte in a load of it alone.
#[test]
fn header_of_another_geometry_at_equal_size_is_a_miss() {
    for (name, s) in stores() {
        let g = small();
        let other = KvGeometry {
            kv_heads: 4,
            head_dim: 8,
            ..g.clone()
        };
        assert_eq!(other.slice_bytes(), g.slice_bytes(), "equal byte size");
        let e = engine(s.clone(), &unique_ns(name));
        let hs = hashes(&g, 2 * 16, 9);
        let keys = e.keys(&g).unwrap();
        let rt = current_thread_rt();
        let good = kv(&g, 1, 9);
        let obj = objectcache::layout::encode_chunk(&g, 16, |l| &good[l as usize][..]).unwrap();
        rt.block_on(s.put(&keys.data(&hs[0]), obj.into())).unwrap();
        let bad = kv(&other, 1, 10);
        let obj = objectcache::layout::encode_chunk(&other, 16, |l| &bad[l as usize][..]).unwrap();
        rt.block_on(s.put(&keys.data(&hs[1]), obj.into())).unwrap();
        let h = start_load(&e, &g, hs.clone(), 2 * g.slice_bytes() as usize);
        assert_every_layer_misses(&h, name, |err| {
            matches!(err, LayerError::GeometryMismatch { chunk: 1, .. })
        });
        assert_eq!(h.chunk_status()[1], ChunkStatus::WrongGeometry, "{name}");
        let h = start_load(&e, &g, hs[..1].to_vec(), g.slice_bytes() as usize);
        h.wait_all_blocking()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for l in 0..g.layers as usize {
            assert!(h.layer(l).unwrap() == &good[l][..], "{name} layer {l}");
        }
    }
}

#[test]
fn concurrent_writers_first_wins() {
    for (name, s) in stores() {
        let g = small();
        let ns = unique_ns(name);
        let hs = hashes(&g, 4 * 16, 8);
        let a = kv(&g, 4, 100);
        let b = kv(&g, 4, 200);
        // Two engines (two clients), alive for the whole test: an S3 client's pooled
        // connections run on the runtime of the engine that opened them.
        let engines = [engine(s.clone(), &ns), engine(s.clone(), &ns)];
        let reports: Vec<_> = std::thread::scope(|sc| {
            [(&a, &engines[0]), (&b, &engines[1])]
                .map(|(d, e)| {
                    let hs = hs.clone();
                    let g = g.clone();
                    sc.spawn(move || {
                        let refs: Vec<&[u8]> = d.iter().map(|v| v.as_slice()).collect();
                        e.save_blocking(&g, &hs, &refs).unwrap()
                    })
                })
                .map(|h| h.join().unwrap())
                .to_vec()
        });
        assert_eq!(
            reports
                .iter()
                .map(|r| r.written + r.already_present)
                .sum::<usize>(),
            8
        );
        assert_eq!(
            reports.iter().map(|r| r.written).sum::<usize>(),
            4,
            "{name}: each chunk written once"
        );
        // Every chunk loads intact (from whichever writer won it) and verifies.
        let e = &engines[0];
        let h = start_load(e, &g, hs.clone(), a[0].len());
        h.wait_all_blocking().unwrap();
        let slice = g.slice_bytes() as usize;
        for l in 0..6 {
            let got = h.layer(l).unwrap();
            for c in 0..4 {
                let r = c * slice..(c + 1) * slice;
                assert!(got[r.clone()] == a[l][r.clone()] || got[r.clone()] == b[l][r.clone()]);
            }
        }
    }
}

/// Case C7: 1,000 missing chunk hashes cost a bounded number of round trips, stop at the first
/// missing chunk, and the repeat is answered from the local miss cache.
#[test]
fn c7_lookups_that_miss() {
    let g = KvGeometry::llama31_8b();
    let e = engine(Arc::new(MemoryStore::new()), "c7");
    let hs = hashes(&g, 1000 * 256, 9);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let r1 = rt.block_on(e.lookup_report(&g, &hs)).unwrap();
    assert_eq!(r1.chunks, 0);
    assert!(
        r1.round_trips <= 1,
        "stops at the first missing chunk: {r1:?}"
    );
    let r2 = rt.block_on(e.lookup_report(&g, &hs)).unwrap();
    assert_eq!(
        (r2.chunks, r2.round_trips, r2.probes),
        (0, 0, 0),
        "second lookup from the miss cache"
    );
    // A save makes them present at once.
    let data = kv(&g.with_tokens_per_chunk(256).unwrap(), 2, 9);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    rt.block_on(e.save(&g, &hs[..2], &refs)).unwrap();
    assert_eq!(rt.block_on(e.lookup_report(&g, &hs)).unwrap().chunks, 2);
}

/// A long published prefix is found in few round trips (k-ary search), not one per chunk.
#[test]
fn lookup_of_long_prefix_is_logarithmic() {
    let g = small();
    let e = engine(Arc::new(MemoryStore::new()), "logl");
    let n = 300;
    let hs = hashes(&g, n * 16, 10);
    let data = kv(&g, 250, 10);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    e.save_blocking(&g, &hs[..250], &refs).unwrap();
    let fresh = engine(e.store().clone(), "logl");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let r = rt.block_on(fresh.lookup_report(&g, &hs)).unwrap();
    assert_eq!(r.chunks, 250);
    assert!(r.round_trips <= 3, "{r:?}");
}

/// Case C8: 1,000 tokens with 256-token chunks: three chunks saved and hit, the 232-token tail
/// neither saved nor reported.
#[test]
fn c8_partial_last_chunk() {
    let g = KvGeometry::smollm2_135m();
    let e = engine(Arc::new(MemoryStore::new()), "c8");
    let hs = hashes(&g, 1000, 11);
    assert_eq!(hs.len(), 3, "only full chunks get a hash");
    let data = kv(&g, 3, 11);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    let rep = e.save_blocking(&g, &hs, &refs).unwrap();
    assert_eq!(rep.written, 3);
    assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 3);
    assert_eq!(e.store().name(), "memory");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let keys = e.keys(&g).unwrap();
    assert_eq!(
        rt.block_on(e.store().list(&keys.data_prefix(), 100))
            .unwrap()
            .len(),
        3
    );
}

/// Case C9: the same token ids cached under two models in one store: neither sees the other's
/// entries, and a load verifies the geometry recorded in the object.
#[test]
fn c9_two_models_one_bucket() {
    let s: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let a = KvGeometry::llama31_8b().with_tokens_per_chunk(16).unwrap();
    let b = KvGeometry::smollm2_135m()
        .with_tokens_per_chunk(16)
        .unwrap();
    let e = engine(s.clone(), "c9");
    let ha = hashes(&a, 64, 12);
    let hb = hashes(&b, 64, 12);
    assert_eq!(ha, hb, "same token ids, same block hashes");
    let da = kv(&a, 4, 1);
    let refs: Vec<&[u8]> = da.iter().map(|v| v.as_slice()).collect();
    e.save_blocking(&a, &ha, &refs).unwrap();
    assert_eq!(e.lookup_blocking(&a, &ha).unwrap(), 4);
    assert_eq!(
        e.lookup_blocking(&b, &hb).unwrap(),
        0,
        "other model sees no hit"
    );
    // Even a deliberately mis-keyed object (model A's bytes under model B's key) is rejected.
    let kb = KeyBuilder::new("c9", &b, objectcache::HashAlgo::Sha256Cbor).unwrap();
    let ka = e.keys(&a).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let obj = rt.block_on(s.get_bytes(&ka.data(&ha[0]))).unwrap();
    rt.block_on(s.put(&kb.data(&hb[0]), obj)).unwrap();
    let h = start_load(&e, &b, vec![hb[0].clone()], b.slice_bytes() as usize);
    assert!(matches!(
        h.wait_layer_blocking(0, None),
        Err(LayerError::GeometryMismatch { .. })
    ));
}

#[test]
fn bad_input_is_named() {
    let g = small();
    let e = engine(Arc::new(MemoryStore::new()), "bad");
    let hs = hashes(&g, 32, 1);
    // The error of a load of `hashes` at geometry `geometry` into `layers` buffers of 10 bytes.
    let refused = |geometry: &KvGeometry, hashes: Vec<objectcache::ChunkHash>, layers: usize| {
        e.load(
            LoadRequest::new(geometry.clone(), hashes),
            LayerBuffers::allocate(layers, 10),
        )
        .unwrap_err()
    };
    let err = refused(&g, hs.clone(), 5);
    assert!(err.to_string().contains("5 destination buffers"), "{err}");
    let err = refused(&g, hs.clone(), 6);
    assert!(
        err.to_string().contains("layer 0 buffer has 10 bytes"),
        "{err}"
    );
    let err = refused(&g, vec![], 6);
    assert!(err.to_string().contains("no chunks"), "{err}");
    let mut zero = g.clone();
    zero.layers = 0;
    let err = refused(&zero, hs.clone(), 0);
    assert!(err.to_string().contains("layers"), "{err}");
    let err = e.save_blocking(&g, &hs, &[&[0u8; 3]]).unwrap_err();
    assert!(err.to_string().contains("1 layer buffers"), "{err}");
}

/// A real store whose reads wait while its gate is shut (writes and everything else pass):
/// a load started with the gate shut has read nothing when it is cancelled, whatever the
/// machine's speed. With `absent_only`, only the answers for absent objects wait (present
/// ones come at once): a node tier in front of a slow remote store, which alone can say that
/// a chunk is absent.
#[derive(Debug)]
struct Gated {
    inner: Arc<dyn Store>,
    open: tokio::sync::watch::Sender<bool>,
    absent_only: bool,
}

#[async_trait::async_trait]
impl Store for Gated {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    async fn get_opts(
        &self,
        key: &str,
        o: objectcache::store::GetOptions,
    ) -> Result<objectcache::store::GetResult, objectcache::StoreError> {
        if !self.absent_only {
            let _ = self.open.subscribe().wait_for(|open| *open).await;
        }
        let r = self.inner.get_opts(key, o).await;
        if self.absent_only && matches!(r, Err(objectcache::StoreError::NotFound { .. })) {
            let _ = self.open.subscribe().wait_for(|open| *open).await;
        }
        r
    }
    async fn put_opts(
        &self,
        key: &str,
        d: bytes::Bytes,
        o: objectcache::store::PutOptions,
    ) -> Result<objectcache::store::PutResult, objectcache::StoreError> {
        self.inner.put_opts(key, d, o).await
    }
    async fn head(
        &self,
        key: &str,
    ) -> Result<objectcache::store::ObjectMeta, objectcache::StoreError> {
        self.inner.head(key).await
    }
    async fn delete(&self, key: &str) -> Result<(), objectcache::StoreError> {
        self.inner.delete(key).await
    }
    async fn list(
        &self,
        p: &str,
        l: usize,
    ) -> Result<Vec<objectcache::store::ObjectMeta>, objectcache::StoreError> {
        self.inner.list(p, l).await
    }
}

#[test]
fn cancel_stops_and_fails_pending_layers() {
    let g = KvGeometry::llama31_8b();
    let (_dir, s) = temp_fs_store();
    let gated = Arc::new(Gated {
        inner: s,
        open: tokio::sync::watch::Sender::new(true),
        absent_only: false,
    });
    let e = engine(gated.clone(), "cancel");
    let (hs, data) = save_prefix(&e, &g, 8, 13);
    gated.open.send_replace(false);
    let h = start_load(&e, &g, hs.clone(), data[0].len());
    h.cancel();
    gated.open.send_replace(true);
    for l in 0..32 {
        match h.wait_layer_blocking(l, None) {
            Err(LayerError::Cancelled) => {}
            other => panic!(
                "layer {l}: {other:?}, expected Cancelled: nothing was read before the cancel"
            ),
        }
    }
    let _ = h.into_buffers();
    // The same store, gate open: the prefix loads whole, byte for byte.
    let h = start_load(&e, &g, hs, data[0].len());
    for l in 0..32 {
        h.wait_layer_blocking(l, None).unwrap();
        assert_eq!(h.layer(l).unwrap(), &data[l][..]);
    }
}

/// `lookup_deadline_ms`: a lookup whose probes of absent markers do not answer in time
/// answers with the prefix the present ones showed (6 of 10 chunks), not nothing; without a
/// deadline it waits for every answer; the late answers enter the lookup cache, so the next
/// lookup asks the store nothing. With a lookup fanout of 2 the answer comes over several
/// rounds, the last one cut short.
#[test]
fn a_lookup_out_of_time_answers_the_prefix_it_confirmed() {
    let g = small();
    let gated = Arc::new(Gated {
        inner: Arc::new(MemoryStore::new()),
        open: tokio::sync::watch::Sender::new(true),
        absent_only: true,
    });
    let ns = unique_ns("lookup-deadline");
    let (hs, data) = seeded_prefix(&g, 10, 17);
    let saver = engine(gated.clone(), &ns);
    let refs: Vec<&[u8]> = data
        .iter()
        .map(|v| &v[..6 * g.slice_bytes() as usize])
        .collect();
    saver.save_blocking(&g, &hs[..6], &refs).unwrap();
    gated.open.send_replace(false);
    let rt = tokio::runtime::Runtime::new().unwrap();
    for fanout in ["16", "2"] {
        let e = engine_with(
            gated.clone(),
            &ns,
            &[("lookup_deadline_ms", "300"), ("lookup_fanout", fanout)],
        );
        let r = rt.block_on(e.lookup_report(&g, &hs)).unwrap();
        assert_eq!((r.chunks, r.cut_short), (6, true), "fanout {fanout}: {r:?}");
        assert_eq!(e.metrics().lookups_cut_short, 1);
        if fanout == "2" {
            assert!(r.round_trips >= 2, "{r:?}");
        }
    }
    // No deadline: the lookup waits until the store answers every probe.
    let patient = engine(gated.clone(), &ns);
    let opener = {
        let gated = gated.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(500));
            gated.open.send_replace(true);
        })
    };
    let r = rt.block_on(patient.lookup_report(&g, &hs)).unwrap();
    opener.join().unwrap();
    assert_eq!((r.chunks, r.cut_short), (6, false), "{r:?}");
    // A cut-short lookup's late answers are kept: once they have come, the same lookup asks
    // the store nothing (the gate shut again would hold any probe past the deadline).
    let e = engine_with(gated.clone(), &ns, &[("lookup_deadline_ms", "300")]);
    gated.open.send_replace(false);
    let r = rt.block_on(e.lookup_report(&g, &hs)).unwrap();
    assert_eq!((r.chunks, r.cut_short), (6, true), "{r:?}");
    gated.open.send_replace(true);
    std::thread::sleep(std::time::Duration::from_millis(100));
    gated.open.send_replace(false);
    let t = std::time::Instant::now();
    let mut again = rt.block_on(e.lookup_report(&g, &hs)).unwrap();
    while again.probes > 0 && t.elapsed() < std::time::Duration::from_secs(10) {
        again = rt.block_on(e.lookup_report(&g, &hs)).unwrap();
    }
    assert_eq!(
        (again.chunks, again.probes, again.cut_short),
        (6, 0, false),
        "{again:?}"
    );
}

#[test]
fn round_trip_llama8b_4k_tokens_s3() {
    // The same 512 MiB round trip against a real S3 server (Ceph RGW), then deleted again.
    let Some(s) = s3_store() else { return };
    let ns = unique_ns("rt8b");
    let e = engine(s.clone(), &ns);
    round_trip(&e, &KvGeometry::llama31_8b(), 16, 43);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for m in s.list(&format!("{ns}/"), 10_000).await.unwrap() {
            s.delete(&m.key).await.unwrap();
        }
    });
}
