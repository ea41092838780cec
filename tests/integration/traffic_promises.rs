//! Issue 19, part 5: what lookup promises, load keeps (cases C11, C12, C13, C14, C16).
//! - Loads in flight hold their entries (engine: `Engine::load` to its end; server: a gather
//!   load to its end, S3 reads by soft lease); collection (`Engine::gc`, `ServerHandle::gc`)
//!   never deletes a held entry; holds end with the load.
//! - Lookups never pin: probed entries stay evictable.
//! - Tensor-parallel ranks agree on every hit, and collection never leaves a chunk present for
//!   some ranks only.
//! - The hit a load reports (`LoadHandle::loaded_chunks`) is exactly what arrived verified.
#![cfg(feature = "s3")]

use crate::common;
use crate::common::shared_rt as rt;
use crate::gather_util;

use common::{hashes, kv, uncached_engine, unique_ns};
use gather_util::{config, start};
use objectcache::connector::{
    ChunkStatus, Engine, EngineConfig, LayerBuffers, LoadHandle, LoadRequest,
};
use objectcache::lifecycle::{Inventory, Policy, Reason};
use objectcache::store::{MemoryStore, Store};
use objectcache::{ChunkHash, Dtype, KvGeometry};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 4 layers x 4 KiB slices (16 tokens per chunk): 16 KiB per chunk.
fn geometry() -> KvGeometry {
    let mut g = KvGeometry::new("traffic/promises", 4, 2, 32, Dtype::Fp16).unwrap();
    g.tokens_per_chunk = 16;
    g
}

struct Prefix {
    hs: Vec<ChunkHash>,
    data: Vec<Vec<u8>>,
}

fn save(e: &Engine, g: &KvGeometry, n: usize, seed: u64) -> Prefix {
    let (hs, data) = common::save_prefix(e, g, n, seed);
    Prefix { hs, data }
}

fn load(e: &Engine, g: &KvGeometry, hs: &[ChunkHash]) -> LoadHandle {
    e.load(
        LoadRequest::new(g.clone(), hs.to_vec()),
        LayerBuffers::allocate(g.layers as usize, hs.len() * g.slice_bytes() as usize),
    )
    .unwrap()
}

/// Waits for every layer (bounded: a hang fails), then checks the reported hit: the
/// `loaded_chunks` leading chunks hold exactly the saved bytes, and every chunk after them is
/// reported not loaded. Returns the hit.
fn settle_and_check(h: LoadHandle, g: &KvGeometry, p: &Prefix, what: &str) -> usize {
    for l in 0..g.layers as usize {
        let _ = h.wait_layer_blocking(l, Some(Duration::from_secs(60)));
        assert!(
            !matches!(
                h.poll_layer(l),
                objectcache::connector::LayerStatus::Pending
            ),
            "{what}: layer {l} hangs"
        );
    }
    // A layer fails as soon as one chunk's slice of it does, while the other chunks' reads
    // still land: the hit is final once every chunk is settled (the load's reads ended).
    common::eventually(
        &format!("{what}: chunks settle"),
        Duration::from_secs(60),
        || !h.chunk_status().contains(&ChunkStatus::Pending),
    );
    let hit = h.loaded_chunks();
    let status = h.chunk_status();
    let n = status.len();
    let slice = g.slice_bytes() as usize;
    let bufs = h.into_buffers().into_vecs().unwrap();
    for c in 0..hit {
        for (l, b) in bufs.iter().enumerate() {
            assert!(
                b[c * slice..(c + 1) * slice] == p.data[l][c * slice..(c + 1) * slice],
                "{what}: chunk {c} reported loaded, layer {l} differs"
            );
        }
    }
    if hit < n {
        assert_ne!(
            status[hit],
            ChunkStatus::Ok,
            "{what}: chunk {hit} not loaded but reported Ok"
        );
    }
    hit
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// C11: a store limited to 8 chunks; R looks up a 4-chunk prefix, other saves push 8 new
/// chunks and eviction runs, at random points before and during R's load; 1,000 rounds.
#[test]
fn c11_lookup_then_eviction_then_load() {
    let g = geometry();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    // Ranged GETs under a small cap: a load lasts a few ms, so eviction can strike during it.
    let e = Engine::with_store(
        store,
        EngineConfig {
            namespace: unique_ns("c11"),
            lookup_cache_ttl: Duration::ZERO,
            bandwidth_cap_bytes_per_s: 32_000_000,
            ..Default::default()
        },
    )
    .unwrap();
    let chunk_bytes = g.slice_bytes() * g.layers as u64 + 64 + 4 * g.layers as u64 + 16;
    let policy = Policy {
        capacity_bytes: Some(8 * chunk_bytes),
        grace: Duration::ZERO,
        ..Policy::default()
    };
    let mut seed = 7u64;
    let (mut full, mut partial, mut evicted_before) = (0, 0, 0);
    for round in 0..1000u64 {
        let r = save(&e, &g, 4, 1_000_000 + round);
        let hit = e.lookup_blocking(&g, &r.hs).unwrap();
        assert_eq!(hit, 4, "round {round}");
        let others = |k: u64| {
            save(&e, &g, 4, 2_000_000 + 2 * round + k);
        };
        let when = splitmix(&mut seed) % 3;
        if when == 0 {
            // Eviction between lookup and load: R's entries are not held yet.
            others(0);
            others(1);
            e.gc_blocking(&policy).unwrap();
        }
        let h = load(&e, &g, &r.hs[..hit]);
        if when == 1 {
            // Eviction while R's load is in flight: R's entries are held.
            others(0);
            others(1);
            e.gc_blocking(&policy).unwrap();
        }
        let got = settle_and_check(h, &g, &r, &format!("C11 round {round}"));
        if when == 1 {
            assert_eq!(
                got, 4,
                "round {round}: eviction took entries a load in flight held"
            );
        }
        match got {
            4 => full += 1,
            0 => evicted_before += 1,
            _ => partial += 1,
        }
        if when == 2 {
            others(0);
            others(1);
            e.gc_blocking(&policy).unwrap();
        }
    }
    // Nothing is held once the loads ended: everything is evictable.
    let rep = e
        .gc_blocking(&Policy {
            capacity_bytes: Some(0),
            grace: Duration::ZERO,
            ..Policy::default()
        })
        .unwrap();
    assert_eq!(rep.kept_leased, 0, "a finished load still holds entries");
    println!(
        "C11|1,000 rounds of lookup, eviction and load at random points|{full} full hits, {partial} partial, {evicted_before} evicted before the load; every reported hit byte-exact, every other chunk reported"
    );
}

/// C14: a 64-chunk hit with room for 10 chunks at a time: the too-small destination is
/// refused naming the sizes, and the chunks stream through in batches; a chunk deleted in the
/// middle makes its batch report exactly the chunks before it.
#[test]
fn c14_a_full_hit_is_never_shortened_silently() {
    let g = geometry();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let e = Engine::with_store(
        store.clone(),
        EngineConfig {
            namespace: unique_ns("c14"),
            ..Default::default()
        },
    )
    .unwrap();
    let p = save(&e, &g, 64, 14);
    assert_eq!(e.lookup_blocking(&g, &p.hs).unwrap(), 64);
    let small = LayerBuffers::allocate(g.layers as usize, 10 * g.slice_bytes() as usize);
    let err = e
        .load(LoadRequest::new(g.clone(), p.hs.clone()), small)
        .unwrap_err()
        .to_string();
    assert!(err.contains("64 chunks"), "{err}");
    // Chunk 37 goes missing: the batch 30..40 reports 7 chunks.
    rt().block_on(store.delete(&e.keys(&g).unwrap().data(&p.hs[37])))
        .unwrap();
    let mut loaded = Vec::new();
    for b in (0..64).step_by(10) {
        let end = (b + 10).min(64);
        let sub = Prefix {
            hs: p.hs[b..end].to_vec(),
            data: p
                .data
                .iter()
                .map(|l| l[b * g.slice_bytes() as usize..end * g.slice_bytes() as usize].to_vec())
                .collect(),
        };
        let h = load(&e, &g, &sub.hs);
        loaded.push(settle_and_check(h, &g, &sub, &format!("C14 batch {b}")));
    }
    assert_eq!(loaded, vec![10, 10, 10, 7, 10, 10, 4]);
    println!("C14|64-chunk hit, room for 10|refused naming 64 chunks; batches reported {loaded:?} (chunk 37 missing)");
}

/// C16: TP 4, an 8-chunk prefix saved by every rank; rank 2's chunks 5-8 deleted. Every rank
/// is told 4 chunks and loads them; collection removes chunks 5-8 for every rank.
#[test]
fn c16_tensor_parallel_ranks_agree() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let ns = unique_ns("c16");
    let rank = |r: u32| {
        let mut g = geometry();
        g.kv_heads = 4;
        g.tp_world = 4;
        g.tp_rank = r;
        g
    };
    let engines: Vec<Engine> = (0..4)
        .map(|_| uncached_engine(store.clone(), &ns))
        .collect();
    let prefixes: Vec<Prefix> = (0..4)
        .map(|r| {
            let g = rank(r);
            // The same tokens on every rank: the same chunk hashes.
            let hs = hashes(&g, 8 * g.tokens_per_chunk as usize, 16);
            let data = kv(&g, 8, 160 + r as u64);
            let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            engines[r as usize].save_blocking(&g, &hs, &refs).unwrap();
            Prefix { hs, data }
        })
        .collect();
    for r in 0..4 {
        assert_eq!(
            engines[r]
                .lookup_blocking(&rank(r as u32), &prefixes[r].hs)
                .unwrap(),
            8
        );
    }
    let k2 = engines[2].keys(&rank(2)).unwrap();
    for h in &prefixes[2].hs[4..] {
        rt().block_on(store.delete(&k2.marker(h))).unwrap();
        rt().block_on(store.delete(&k2.data(h))).unwrap();
    }
    for r in 0..4 {
        let g = rank(r as u32);
        let hit = engines[r].lookup_blocking(&g, &prefixes[r].hs).unwrap();
        assert_eq!(hit, 4, "rank {r} was told {hit} chunks");
        let h = load(&engines[r], &g, &prefixes[r].hs[..hit]);
        let sub = Prefix {
            hs: prefixes[r].hs[..4].to_vec(),
            data: prefixes[r]
                .data
                .iter()
                .map(|l| l[..4 * g.slice_bytes() as usize].to_vec())
                .collect(),
        };
        assert_eq!(settle_and_check(h, &g, &sub, &format!("C16 rank {r}")), 4);
    }
    // Collection: chunks 5-8 of ranks 0, 1 and 3 go too; chunks 1-4 stay for every rank.
    let rep = engines[0]
        .gc_blocking(&Policy {
            grace: Duration::ZERO,
            ..Policy::default()
        })
        .unwrap();
    assert_eq!(
        rep.count(Reason::IncompleteTp),
        3 * 4 * 2,
        "{:?}",
        rep.deleted
    );
    let inv = rt()
        .block_on(Inventory::scan(store.as_ref(), "", 10_000))
        .unwrap();
    assert_eq!(
        inv.stats().published,
        4 * 4,
        "16 entries: chunks 1-4 of 4 ranks"
    );
    // Capacity eviction takes a chunk's ranks together.
    let chunk = inv.stats().bytes / 16;
    let rep = engines[0]
        .gc_blocking(&Policy {
            capacity_bytes: Some(14 * chunk),
            ..Policy::default()
        })
        .unwrap();
    assert_eq!(
        rep.count(Reason::Evicted),
        4 * 2,
        "one chunk, 4 ranks, marker and data"
    );
    for r in 0..4 {
        assert_eq!(
            engines[r]
                .lookup_blocking(&rank(r as u32), &prefixes[r].hs)
                .unwrap(),
            engines[0]
                .lookup_blocking(&rank(0), &prefixes[0].hs)
                .unwrap(),
            "ranks disagree after eviction"
        );
    }
    println!("C16|TP 4, rank 2 lost chunks 5-8|every rank told 4 and loaded 4 byte-exact; GC removed chunks 5-8 of the other ranks ({} objects); eviction takes a chunk's 4 ranks together", 3 * 4 * 2);
}

/// C13 and C12 on the server: lookups never pin (probed entries are evicted, held ones are
/// not), and a load outlives a short TTL with collection running under it, through gather and
/// through ranged GETs.
#[test]
fn c13_probes_never_pin_and_c12_loads_outlive_their_ttl() {
    let g = geometry();
    let backend: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mut cfg = config();
    // 500 kB/s: a 32-chunk load (512 KiB) lasts about 1 s.
    cfg.bandwidth_cap_bytes_per_s = 500_000;
    let server = rt().block_on(start(backend.clone(), cfg));
    let store = rt().block_on(gather_util::s3_store_on(&server.endpoint()));
    let ns = unique_ns("c13");
    let e = Engine::with_store(
        store.clone(),
        EngineConfig {
            namespace: ns.clone(),
            lookup_cache_ttl: Duration::ZERO,
            ..Default::default()
        },
    )
    .unwrap();
    // C13: 100 chunks (25 prefixes of 4), all probed three times, 10 loaded.
    let ps: Vec<Prefix> = (0..25).map(|i| save(&e, &g, 4, 300 + i)).collect();
    for _ in 0..3 {
        for p in &ps {
            assert_eq!(e.lookup_blocking(&g, &p.hs).unwrap(), 4);
        }
    }
    for p in &ps[..2] {
        let h = load(&e, &g, &p.hs);
        settle_and_check(h, &g, p, "C13 load");
    }
    let keys = e.keys(&g).unwrap();
    let bk = |h: &ChunkHash| format!("{}/{}", gather_util::BUCKET, keys.data(h));
    let probed_only: Vec<String> = ps[2..].iter().flat_map(|p| p.hs.iter().map(bk)).collect();
    assert!(
        probed_only.iter().all(|k| !server.leased(k)),
        "a probe pinned an entry"
    );
    let inv = rt()
        .block_on(Inventory::scan(backend.as_ref(), "", 10_000))
        .unwrap();
    let per_chunk = inv.stats().bytes / 100;
    let news: Vec<Prefix> = (0..13).map(|i| save(&e, &g, 4, 400 + i)).collect();
    let rep = rt()
        .block_on(server.gc(&Policy {
            capacity_bytes: Some(100 * per_chunk),
            ..Policy::default()
        }))
        .unwrap();
    let evicted: Vec<&String> = rep
        .deleted
        .iter()
        .filter(|(k, r)| *r == Reason::Evicted && k.contains("/kv/"))
        .map(|(k, _)| k)
        .collect();
    assert!(evicted.len() >= 52, "evicted {}", evicted.len());
    assert!(
        evicted.iter().all(|k| probed_only.contains(k)),
        "only probed, never loaded entries are evicted"
    );
    for p in &news {
        assert_eq!(
            e.lookup_blocking(&g, &p.hs).unwrap(),
            4,
            "a new save was lost"
        );
    }
    println!(
        "C13|100 chunks probed 3 times, 8 loaded, 52 saved|{} data objects evicted, every one probed and never loaded; nothing pinned by probes",
        evicted.len()
    );

    // C12: a 500 ms TTL and eviction down to nothing, a load slowed to about 1 s, collection
    // every 100 ms under it. (Ranged GETs renew their object's last use as they read it, so
    // the TTL alone would not test their lease; capacity 0 takes everything not held.)
    let ttl = Policy {
        ttl: Some(Duration::from_millis(500)),
        capacity_bytes: Some(0),
        ..Policy::default()
    };
    for (path, pairs) in [
        ("gather", vec![]),
        (
            "ranged GETs",
            vec![("gather", "off"), ("bandwidth_cap_bytes_per_s", "500000")],
        ),
    ] {
        let e2 = common::engine_with(store.clone(), &ns, &pairs);
        let p = save(&e2, &g, 32, 500 + pairs.len() as u64);
        std::thread::sleep(Duration::from_millis(600)); // the entries' TTL has passed
        let t0 = Instant::now();
        let h = load(&e2, &g, &p.hs);
        // The server holds what a load reads from when the load reaches it (a gather request
        // admitted; a ranged GET of the object): once layer 0 is in, every entry of the load
        // is held. (Before that, collection may take an entry, and the load reports a miss.)
        h.wait_layer_blocking(0, Some(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("C12 {path}: layer 0: {e}"));
        let mut kept = 0;
        while (0..g.layers as usize).any(|l| {
            matches!(
                h.poll_layer(l),
                objectcache::connector::LayerStatus::Pending
            )
        }) {
            let rep = rt().block_on(server.gc(&ttl)).unwrap();
            kept += rep.kept_leased;
            std::thread::sleep(Duration::from_millis(100));
        }
        let secs = t0.elapsed().as_secs_f64();
        let hit = settle_and_check(h, &g, &p, &format!("C12 {path}"));
        assert_eq!(
            hit, 32,
            "C12 {path}: collection took entries under the load"
        );
        assert!(
            kept > 0,
            "C12 {path}: collection never ran during the load ({secs:.2} s)"
        );
        println!("C12|TTL 500 ms and capacity 0, load of {secs:.2} s, GC every 100 ms ({path})|all 32 chunks loaded verified; collection kept the held entries ({kept} times)");
    }
    rt().block_on(server.shutdown());
}
