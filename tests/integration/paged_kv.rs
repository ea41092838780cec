//! Paged KV: loads whose destination is, per layer, a list of ranges (one per engine block,
//! scattered through one KV pool as vLLM keeps them) and saves from such ranges, on every
//! host path: ranged GETs from the embedded stores, gather over TCP from the ObjectCache
//! server (striped over several connections), ranged GETs from the server and from a stock
//! S3 server (Ceph RGW, when configured). Bytes are compared byte for byte, and bytes outside
//! the loaded blocks must stay untouched. Also: per-chunk misses on a paged load, and the
//! engine's layout named in the key (two layouts of equal byte size miss each other).
#![cfg(feature = "s3")]

use crate::common;
use crate::common::shared_rt as rt;
use crate::gather_util;

use common::{hashes, unique_ns};
use objectcache::connector::{
    ChunkStatus, Engine, EngineConfig, LayerBuffers, LayerStatus, LoadRequest,
};
use objectcache::store::{FsStore, FsyncPolicy, MemoryStore, Store};
use objectcache::{KvGeometry, LayerError};
use std::sync::Arc;

/// A vLLM-like KV pool: `layers` layer views back to back, each `blocks` blocks of
/// `block_bytes` (one (layer, block) is one contiguous run, as in vLLM's CPU attention
/// backend).
#[derive(Clone, Copy)]
struct Pool {
    layers: usize,
    blocks: usize,
    block_bytes: usize,
}

impl Pool {
    fn of(g: &KvGeometry, blocks: usize) -> Self {
        let bs = g
            .layout
            .as_ref()
            .expect("a paged geometry names its layout")
            .block_size;
        Pool {
            layers: g.layers as usize,
            blocks,
            block_bytes: bs as usize * g.bytes_per_token_per_layer() as usize,
        }
    }
    fn len(&self) -> usize {
        self.layers * self.blocks * self.block_bytes
    }
    /// Offset of (layer, block) in the pool.
    fn at(&self, l: usize, b: usize) -> usize {
        (l * self.blocks + b) * self.block_bytes
    }
    /// Per layer, one `(offset, len)` range per block of `ids`, in order.
    fn ranges(&self, ids: &[usize]) -> Vec<Vec<(usize, usize)>> {
        (0..self.layers)
            .map(|l| {
                ids.iter()
                    .map(|&b| (self.at(l, b), self.block_bytes))
                    .collect()
            })
            .collect()
    }
}

/// Pool bytes that differ per (layer, block, byte).
fn filled(p: &Pool, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; p.len()];
    for (i, w) in v.chunks_mut(8).enumerate() {
        let mut x = (i as u64 ^ seed.rotate_left(17)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^= x >> 29;
        w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
    }
    v
}

/// A small model whose slices are 2 engine blocks of 16 tokens (2,048 bytes each).
fn geometry() -> KvGeometry {
    let mut g = KvGeometry::new("test/paged-kv", 4, 2, 16, objectcache::Dtype::Bf16).unwrap();
    g.tokens_per_chunk = 32;
    g.with_layout("test/blocks-lbhnc", 16).unwrap()
}

const SENTINEL: u8 = 0xAB;

/// Saves `chunks` chunks (hashes from `hash_seed`) from blocks `src` of a pool filled from
/// `pool_seed`, checking that every one was written; returns the hashes and the pool.
fn save_blocks(
    e: &Engine,
    g: &KvGeometry,
    p: &Pool,
    chunks: usize,
    src: &[usize],
    hash_seed: u32,
    pool_seed: u64,
) -> (Vec<objectcache::ChunkHash>, Vec<u8>) {
    let hs = hashes(g, chunks * g.tokens_per_chunk as usize, hash_seed);
    let pool = filled(p, pool_seed);
    let parts: Vec<Vec<&[u8]>> = p
        .ranges(src)
        .iter()
        .map(|rs| rs.iter().map(|&(o, n)| &pool[o..o + n]).collect())
        .collect();
    let rep = e.save_paged_blocking(g, &hs, &parts).unwrap();
    assert_eq!(rep.written, chunks);
    (hs, pool)
}

/// Saves chunks from blocks `src` of a filled pool, loads them into blocks `dst` of a
/// sentinel-filled pool, and checks every loaded block byte for byte, that nothing else was
/// written, that the contiguous view of the saved objects is the blocks' concatenation, and
/// that per-chunk status is whole. Returns the load's storage requests.
fn round_trip(e: &Engine, g: &KvGeometry, chunks: usize, src: &[usize], dst: &[usize]) -> u64 {
    let p = Pool::of(g, 40);
    assert_eq!(src.len(), dst.len());
    assert_eq!(src.len() * p.block_bytes, chunks * g.slice_bytes() as usize);
    let (hs, pool) = save_blocks(e, g, &p, chunks, src, src[0] as u32 + 7, src[0] as u64);
    assert_eq!(e.lookup_blocking(g, &hs).unwrap(), chunks);

    // Paged load into other, scattered blocks of a second pool.
    let bufs = LayerBuffers::paged(vec![SENTINEL; p.len()], p.ranges(dst)).unwrap();
    let h = e
        .load(LoadRequest::new(g.clone(), hs.clone()), bufs)
        .unwrap();
    for l in 0..p.layers {
        h.wait_layer_blocking(l, None).unwrap();
        let got = h.layer_parts(l).unwrap();
        assert_eq!(got.len(), dst.len(), "one part per block of layer {l}");
        for (i, part) in got.iter().enumerate() {
            let want = &pool[p.at(l, src[i])..][..p.block_bytes];
            assert!(*part == want, "layer {l} block {i}: bytes differ");
        }
        assert!(
            h.layer(l).is_none(),
            "a scattered layer has no one-slice view"
        );
    }
    assert!(h.chunk_status().iter().all(|s| *s == ChunkStatus::Ok));
    let st = h.stats();
    assert_eq!(
        st.bytes,
        (chunks as u64) * g.slice_bytes() * g.layers as u64
    );
    let requests = st.requests;
    let out = h.into_buffers().into_pool().expect("the pool comes back");
    for l in 0..p.layers {
        for b in 0..p.blocks {
            let blk = &out[p.at(l, b)..][..p.block_bytes];
            match dst.iter().position(|&d| d == b) {
                Some(i) => assert_eq!(blk, &pool[p.at(l, src[i])..][..p.block_bytes]),
                None => assert!(
                    blk.iter().all(|&x| x == SENTINEL),
                    "block {b} of layer {l} was written"
                ),
            }
        }
    }

    // The same objects loaded contiguously: each layer is the blocks' concatenation.
    let h = e
        .load(
            LoadRequest::new(g.clone(), hs),
            LayerBuffers::allocate(p.layers, chunks * g.slice_bytes() as usize),
        )
        .unwrap();
    for l in 0..p.layers {
        h.wait_layer_blocking(l, None).unwrap();
        let want: Vec<u8> = p.ranges(src)[l]
            .iter()
            .flat_map(|&(o, n)| pool[o..o + n].iter().copied())
            .collect();
        assert!(
            h.layer(l).unwrap() == want.as_slice(),
            "layer {l}: contiguous view differs"
        );
    }
    requests
}

/// Block ids of a request: not adjacent, not in order.
const SRC: [usize; 10] = [17, 3, 9, 0, 22, 5, 30, 11, 2, 25];
const DST: [usize; 10] = [4, 39, 12, 1, 33, 8, 20, 6, 27, 15];

fn engine_on(store: Arc<dyn Store>, ns: &str, pairs: &[(&str, &str)]) -> Engine {
    common::engine_with(store, &unique_ns(ns), pairs)
}

#[test]
fn paged_round_trip_over_ranged_gets_from_embedded_stores() {
    let g = geometry();
    let mem = engine_on(Arc::new(MemoryStore::new()), "paged-mem", &[]);
    round_trip(&mem, &g, 5, &SRC, &DST);
    let dir = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    // Coalesced later layers: one GET carries several layers into several blocks each.
    let e = engine_on(fs, "paged-fs", &[("coalesce_bytes", "65536")]);
    round_trip(&e, &g, 5, &SRC, &DST);
}

#[test]
fn paged_round_trip_over_gather_and_ranged_gets_from_the_server() {
    let g = geometry();
    let dir = tempfile::tempdir().unwrap();
    let backend: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let server = rt().block_on(gather_util::start(backend, gather_util::config()));
    let s3 = || rt().block_on(gather_util::s3_store_on(&server.endpoint()));
    // Gather, striped over 1, 2 and 3 connections (each unit is one slice = 2 blocks, so
    // every unit lands in two separate ranges; stripes start mid-request).
    for streams in ["1", "2", "3"] {
        let e = engine_on(s3(), "paged-gather", &[("gather_streams", streams)]);
        let n = round_trip(&e, &g, 5, &SRC, &DST);
        let want = streams.parse::<u64>().unwrap();
        assert_eq!(n, want, "gather: one request per stream");
    }
    // Ranged GETs from the same server.
    let e = engine_on(s3(), "paged-get", &[("gather", "off")]);
    let n = round_trip(&e, &g, 5, &SRC, &DST);
    assert!(n >= 5, "ranged GETs: at least one per chunk, got {n}");
    drop(e);
    rt().block_on(server.shutdown());
}

#[test]
fn paged_round_trip_against_stock_s3() {
    let Some((s, _)) = rt().block_on(common::test_s3_store("paged")) else {
        return;
    };
    let e = engine_on(Arc::new(s), "paged-s3", &[]);
    round_trip(&e, &geometry(), 5, &SRC, &DST);
}

/// Ranges that follow no block or slice boundary (uneven lengths, crossing slices and
/// units): the logical layer is still their concatenation, on the gather path and on ranged
/// GETs.
#[test]
fn irregular_ranges_land_as_their_concatenation() {
    let g = geometry();
    let chunks = 3;
    let per_layer = chunks * g.slice_bytes() as usize; // 12,288
    let cuts = [1000usize, 1, 4095, 2, 3000, 4190]; // sums to per_layer
    assert_eq!(cuts.iter().sum::<usize>(), per_layer);
    let layers = g.layers as usize;
    // Ranges laid out in the pool in reverse order with 3-byte gaps, layers interleaved.
    let mut ranges = vec![Vec::new(); layers];
    let mut at = 0;
    for &n in cuts.iter().rev() {
        for r in ranges.iter_mut() {
            r.push((at, n));
            at += n + 3;
        }
    }
    for r in &mut ranges {
        r.reverse();
    }
    let pool_len = at;
    let data = common::kv(&g, chunks, 99);
    let dir = tempfile::tempdir().unwrap();
    let backend: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let server = rt().block_on(gather_util::start(backend, gather_util::config()));
    for gather in ["on", "off"] {
        let store = rt().block_on(gather_util::s3_store_on(&server.endpoint()));
        let e = engine_on(
            store,
            "paged-irregular",
            &[("gather", gather), ("gather_streams", "2")],
        );
        let hs = hashes(&g, chunks * g.tokens_per_chunk as usize, 5);
        let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
        e.save_blocking(&g, &hs, &refs).unwrap();
        let bufs = LayerBuffers::paged(vec![SENTINEL; pool_len], ranges.clone()).unwrap();
        let h = e.load(LoadRequest::new(g.clone(), hs), bufs).unwrap();
        h.wait_all_blocking().unwrap();
        for l in 0..layers {
            let got = h.layer_parts(l).unwrap();
            assert_eq!(got.iter().map(|p| p.len()).collect::<Vec<_>>(), cuts);
            assert!(
                got.concat() == data[l],
                "gather {gather}: layer {l} differs"
            );
        }
        let pool = h.into_buffers().into_pool().unwrap();
        let mut covered = vec![false; pool_len];
        for &(o, n) in ranges.iter().flatten() {
            covered[o..o + n].fill(true);
        }
        assert!(
            pool.iter().zip(&covered).all(|(&b, &c)| c || b == SENTINEL),
            "gather {gather}: a byte between the ranges was written"
        );
    }
    rt().block_on(server.shutdown());
}

/// A chunk missing from storage: on a paged load every layer is a miss naming it (the layer
/// holds that chunk's blocks), per-chunk status names only it, and no layer is ever ready.
#[test]
fn a_missing_chunk_is_a_per_chunk_miss_on_a_paged_load() {
    let g = geometry();
    let p = Pool::of(&g, 40);
    let dir = tempfile::tempdir().unwrap();
    let backend: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let server = rt().block_on(gather_util::start(backend.clone(), gather_util::config()));
    for gather in ["on", "off"] {
        let store = rt().block_on(gather_util::s3_store_on(&server.endpoint()));
        let e = engine_on(store.clone(), "paged-miss", &[("gather", gather)]);
        let hs = hashes(&g, 5 * g.tokens_per_chunk as usize, 3);
        let pool = filled(&p, 1);
        let parts: Vec<Vec<&[u8]>> = p
            .ranges(&SRC)
            .iter()
            .map(|rs| rs.iter().map(|&(o, n)| &pool[o..o + n]).collect())
            .collect();
        e.save_paged_blocking(&g, &hs, &parts).unwrap();
        let key = e.keys(&g).unwrap().data(&hs[2]);
        rt().block_on(store.delete(&key)).unwrap();
        let bufs = LayerBuffers::paged(vec![SENTINEL; p.len()], p.ranges(&DST)).unwrap();
        let h = e.load(LoadRequest::new(g.clone(), hs), bufs).unwrap();
        for l in 0..p.layers {
            match h.wait_layer_blocking(l, None) {
                Err(LayerError::Missing { chunk: 2, .. }) => {}
                other => panic!("gather {gather}: layer {l}: {other:?}"),
            }
            assert!(h.layer_parts(l).is_none());
            assert!(matches!(h.poll_layer(l), LayerStatus::Failed(_)));
        }
        let st = (0..1000)
            .map(|_| {
                let s = h.chunk_status();
                if s.contains(&ChunkStatus::Pending) {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                s
            })
            .find(|s| !s.contains(&ChunkStatus::Pending))
            .expect("chunk status settles");
        assert_eq!(st[2], ChunkStatus::Missing, "gather {gather}: {st:?}");
        assert!(
            st.iter()
                .enumerate()
                .all(|(c, s)| c == 2 || *s != ChunkStatus::Missing),
            "{st:?}"
        );
    }
    rt().block_on(server.shutdown());
}

/// Two engines whose layouts differ, at the same byte size (same model, shape, dtype, chunk
/// size): each misses the other's objects, on lookup and on load, and so does an engine that
/// names no layout. Never bytes of another meaning.
#[test]
fn layouts_of_equal_byte_size_miss_each_other() {
    let g = geometry();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let ns = unique_ns("paged-layout");
    let e = Engine::with_store(
        store,
        EngineConfig {
            namespace: ns,
            ..Default::default()
        },
    )
    .unwrap();
    let other_family = g.with_layout("test/blocks-flash", 16).unwrap();
    let other_block = g.with_layout("test/blocks-lbhnc", 8).unwrap();
    let mut canonical = g.clone();
    canonical.layout = None;
    for x in [&other_family, &other_block, &canonical] {
        assert_eq!(x.slice_bytes(), g.slice_bytes(), "equal byte size");
    }
    let hs = hashes(&g, 2 * g.tokens_per_chunk as usize, 11);
    let data = common::kv(&g, 2, 4);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    e.save_blocking(&g, &hs, &refs).unwrap();
    assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 2);
    for x in [&other_family, &other_block, &canonical] {
        assert_eq!(e.lookup_blocking(x, &hs).unwrap(), 0, "{:?}", x.layout);
        let h = e
            .load(
                LoadRequest::new(x.clone(), hs.clone()),
                LayerBuffers::allocate(x.layers as usize, 2 * x.slice_bytes() as usize),
            )
            .unwrap();
        for l in 0..x.layers as usize {
            assert!(
                matches!(
                    h.wait_layer_blocking(l, None),
                    Err(LayerError::Missing { .. })
                ),
                "{:?} layer {l}",
                x.layout
            );
            assert!(h.layer(l).is_none());
        }
    }
    // The saving engine's own layout still hits, byte for byte.
    let h = e
        .load(
            LoadRequest::new(g.clone(), hs),
            LayerBuffers::allocate(g.layers as usize, 2 * g.slice_bytes() as usize),
        )
        .unwrap();
    h.wait_all_blocking().unwrap();
    for l in 0..g.layers as usize {
        assert!(h.layer(l).unwrap() == data[l].as_slice());
    }
}

#[test]
fn bad_paged_buffers_are_refused_by_name() {
    let e = LayerBuffers::paged(vec![0; 100], vec![vec![(0, 10), (50, 20)], vec![(60, 5)]])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layer 0 range 1") && e.contains("layer 1 range 0") && e.contains("overlap"),
        "{e}"
    );
    let e = LayerBuffers::paged(vec![0; 100], vec![vec![(95, 10)]])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layer 0 range 0") && e.contains("past the pool of 100 bytes"),
        "{e}"
    );
    // A layer whose ranges hold too few bytes for the load is refused when the load starts.
    let g = geometry();
    let e = Engine::with_store(Arc::new(MemoryStore::new()), EngineConfig::default()).unwrap();
    let hs = hashes(&g, 2 * g.tokens_per_chunk as usize, 1);
    let short = vec![vec![(0usize, g.slice_bytes() as usize)]; g.layers as usize];
    let short: Vec<Vec<(usize, usize)>> = short
        .into_iter()
        .enumerate()
        .map(|(l, v)| v.into_iter().map(|(o, n)| (o + l * n, n)).collect())
        .collect();
    let bufs = LayerBuffers::paged(vec![0; 1 << 20], short).unwrap();
    let err = e
        .load(LoadRequest::new(g.clone(), hs.clone()), bufs)
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer 0 buffer has 4096 bytes"), "{err}");
    // Save sources that do not add up are refused naming the layer.
    let buf = vec![0u8; 3 * g.slice_bytes() as usize];
    let mut parts: Vec<Vec<&[u8]>> = vec![vec![&buf[..4096], &buf[4096..8192]]; g.layers as usize];
    parts[2] = vec![&buf[..4096], &buf[4096..8000]];
    let err = e
        .save_paged_blocking(&g, &hs, &parts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer 2 ranges add up to 8000 bytes"), "{err}");
}

/// Registered memory through the Rust API (`Engine::register_memory`, `load_registered`;
/// the C ABI's register and load calls are these): a paged load lands byte-exact in
/// scattered blocks of the registered pool and nowhere else; ranges outside registered
/// memory and overlapping ranges are refused by name; an area is busy while a load into it
/// lives and deregisters once it is dropped; device memory needs the `cuda` feature.
#[test]
fn loads_into_registered_memory_are_checked_held_and_byte_exact() {
    use objectcache::connector::MemoryKind;
    use objectcache::Error;
    let g = geometry();
    let e = engine_on(Arc::new(MemoryStore::new()), "regmem", &[]);
    let p = Pool::of(&g, 40);
    let chunks = 3;
    let (src, dst) = ([3usize, 9, 1, 20, 5, 6], [30usize, 2, 17, 8, 11, 39]);
    let (hs, pool) = save_blocks(&e, &g, &p, chunks, &src, 77, 77);

    let mut kv = vec![SENTINEL; p.len()];
    let base = kv.as_mut_ptr();
    // SAFETY: `kv` outlives every load into it (each is dropped or finished below, before
    // `kv` is read) and is only read once those loads are gone.
    let id = unsafe { e.register_memory(base, kv.len(), MemoryKind::Host) }.unwrap();
    assert_eq!(e.registered_regions(), 1);
    let at = |ranges: Vec<Vec<(usize, usize)>>| -> Vec<Vec<(*mut u8, usize)>> {
        ranges
            .into_iter()
            .map(|rs| {
                rs.into_iter()
                    .map(|(o, n)| (base.wrapping_add(o), n))
                    .collect()
            })
            .collect()
    };
    let req = || LoadRequest::new(g.clone(), hs.clone());

    // Refused by name: a range outside registered memory, and two that overlap.
    let mut outside = vec![0u8; p.block_bytes];
    let mut bad = at(p.ranges(&dst));
    bad[1][2] = (outside.as_mut_ptr(), p.block_bytes);
    let err = e.load_registered(req(), bad).unwrap_err().to_string();
    assert!(
        err.contains("layer 1 range 2") && err.contains("not inside"),
        "{err}"
    );
    let mut bad = at(p.ranges(&dst));
    bad[3][0] = bad[0][4];
    let err = e.load_registered(req(), bad).unwrap_err().to_string();
    assert!(
        err.contains("layer 0 range 4")
            && err.contains("layer 3 range 0")
            && err.contains("overlap"),
        "{err}"
    );

    // A load holds its area: deregistering is refused until the load is dropped.
    let load = e.load_registered(req(), at(p.ranges(&dst))).unwrap();
    for l in 0..p.layers {
        load.wait_layer_blocking(l, None).unwrap();
        assert_eq!(load.poll_layer(l), LayerStatus::Ready);
    }
    assert!(load
        .handle()
        .chunk_status()
        .iter()
        .all(|s| *s == ChunkStatus::Ok));
    assert!(matches!(e.deregister_memory(id), Err(Error::Busy(_))));
    drop(load);
    e.deregister_memory(id).unwrap();
    assert_eq!(e.registered_regions(), 0);
    assert!(matches!(
        e.deregister_memory(id),
        Err(Error::InvalidArgument(_))
    ));
    // Deregistered memory takes no load.
    let err = e
        .load_registered(req(), at(p.ranges(&dst)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not inside memory registered"), "{err}");

    for l in 0..p.layers {
        for b in 0..p.blocks {
            let blk = &kv[p.at(l, b)..][..p.block_bytes];
            match dst.iter().position(|&d| d == b) {
                Some(i) => assert!(
                    blk == &pool[p.at(l, src[i])..][..p.block_bytes],
                    "layer {l} block {b}"
                ),
                None => assert!(
                    blk.iter().all(|&x| x == SENTINEL),
                    "layer {l} block {b} written"
                ),
            }
        }
    }
    assert!(outside.iter().all(|&x| x == 0));

    // Device memory: refused as unsupported without the cuda feature (and, with it, where
    // no CUDA driver is present or the range is host memory).
    // SAFETY: refused before anything would be written.
    let r = unsafe { e.register_memory(base, kv.len(), MemoryKind::Device { ordinal: 0 }) };
    match r {
        Err(Error::Unsupported(m)) | Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("device"), "{m}")
        }
        other => panic!("host memory registered as device memory: {other:?}"),
    }
}
