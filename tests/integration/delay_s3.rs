//! The ranged-GET path through a delaying proxy (`objectcache::transport::delay::DelayProxy`)
//! in front of our server's S3 API, at 0, 5, 20 and 50 ms one way: loads stay byte-exact,
//! the engine opens its S3 connections when it starts (before any load), and on a long round
//! trip a load keeps more requests in flight than `max_requests` (the bandwidth-delay
//! product, within `window_bytes`) while on a short one it does not. Times are in
//! `objectcache-bench transfer --delay-ms` (docs/benchmarks.md), not asserted here. Gather
//! through the same proxy: a finished load's connections go back to the engine's pool.

use crate::common;

use common::*;
use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadRequest};
use objectcache::store::{MemoryStore, S3Config, S3Store, Store};
use objectcache::transport::delay::DelayProxy;
use objectcache::{Dtype, KvGeometry};
use std::sync::Arc;
use std::time::Duration;

const AK: &str = "delay-access";
const SK: &str = "delay-secret-key";
const BUCKET: &str = "kv-delay";

/// 8 layers, 64 KiB slices: 4 chunks make 32 single-slice reads per load.
fn geometry() -> KvGeometry {
    KvGeometry::new("test/delay", 8, 8, 128, Dtype::Bf16)
        .unwrap()
        .with_tokens_per_chunk(16)
        .unwrap()
}

/// A prefix of `chunks` chunks of [`geometry`] from `seed`: its hashes and per-layer KV.
fn prefix(chunks: usize, seed: u32) -> (KvGeometry, Vec<objectcache::ChunkHash>, Vec<Vec<u8>>) {
    let g = geometry();
    let (hs, data) = seeded_prefix(&g, chunks, seed as u64);
    (g, hs, data)
}

fn s3_at(rt: &tokio::runtime::Runtime, addr: std::net::SocketAddr) -> Arc<dyn Store> {
    let s3 = S3Config::at_endpoint(BUCKET, format!("http://{addr}"), AK, SK);
    Arc::new(rt.block_on(S3Store::new(s3)).unwrap())
}

/// Saves the prefix `hs`, `data` straight to the server at `addr` (no delay) through an
/// engine with `cfg`; how many chunks it wrote.
fn save_direct(
    rt: &tokio::runtime::Runtime,
    addr: std::net::SocketAddr,
    cfg: EngineConfig,
    g: &KvGeometry,
    hs: &[objectcache::ChunkHash],
    data: &[Vec<u8>],
) -> usize {
    let direct = Engine::with_store(s3_at(rt, addr), cfg).unwrap();
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    direct.save_blocking(g, hs, &refs).unwrap().written
}

/// A proxy in front of the server at `addr` that delays each direction by `ms` milliseconds.
fn delay_proxy(rt: &tokio::runtime::Runtime, addr: std::net::SocketAddr, ms: u64) -> DelayProxy {
    rt.block_on(DelayProxy::start(addr, Duration::from_millis(ms)))
        .unwrap()
}

/// Loads the prefix `hs` through `e`, waits for every layer and checks each byte against
/// `data` (`what` names the load in failures); returns the finished handle.
fn load_exact(
    e: &Engine,
    g: &KvGeometry,
    hs: &[objectcache::ChunkHash],
    data: &[Vec<u8>],
    what: &str,
) -> objectcache::connector::LoadHandle {
    let h = e
        .load(
            LoadRequest::new(g.clone(), hs.to_vec()),
            LayerBuffers::allocate(g.layers as usize, data[0].len()),
        )
        .unwrap();
    h.wait_all_blocking()
        .unwrap_or_else(|err| panic!("{what}: load failed: {err:?}; {:?}", h.stats()));
    for l in 0..g.layers as usize {
        assert!(
            h.layer(l).unwrap() == &data[l][..],
            "{what}: layer {l} differs"
        );
    }
    h
}

/// Our server on loopback over memory, serving `BUCKET` to the key pair `AK`/`SK`, with
/// `base`'s other settings (connection caps, ...).
fn server(
    rt: &tokio::runtime::Runtime,
    base: objectcache::server::ServerConfig,
) -> objectcache::server::ServerHandle {
    let cfg = objectcache::server::ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        allow_anonymous: false,
        access_keys: vec![objectcache::server::AccessKey {
            access_key: AK.into(),
            secret_key: SK.into(),
        }],
        buckets: vec![BUCKET.into()],
        fsync: false,
        shutdown_grace_secs: 1,
        ..base
    };
    rt.block_on(objectcache::server::start_with_store(
        cfg,
        Arc::new(MemoryStore::new()),
    ))
    .unwrap()
}

#[test]
fn ranged_get_loads_through_delays_keep_bytes_warm_the_pool_and_widen_the_window() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let srv = server(&rt, objectcache::server::ServerConfig::default());
    let chunks = 4;
    let (g, hs, data) = prefix(chunks, 7);
    let ns = unique_ns("delay");
    let engine_cfg = |max_requests: usize| {
        let mut c = EngineConfig {
            namespace: ns.clone(),
            gather: false,
            ..EngineConfig::default()
        };
        c.set("max_requests", &max_requests.to_string()).unwrap();
        // One layer slice per ranged GET: many reads, so the window's growth shows.
        c.set("coalesce_bytes", "0").unwrap();
        c
    };
    // Saved straight to the server.
    let written = save_direct(&rt, srv.local_addr(), engine_cfg(4), &g, &hs, &data);
    assert_eq!(written, chunks);

    for delay_ms in [0u64, 5, 20, 50] {
        let proxy = delay_proxy(&rt, srv.local_addr(), delay_ms);
        let max_requests = 2;
        let e =
            Engine::with_store(s3_at(&rt, proxy.local_addr()), engine_cfg(max_requests)).unwrap();
        // The engine opens `max_requests` connections when it starts, before any load, in
        // each of the store's pools: the SDK's (lookups, saves) and the one its ranged GETs
        // read bodies into place from (`store/s3/direct.rs`).
        let warm = 2 * max_requests as u64;
        common::eventually("the engine's pool warm-up", Duration::from_secs(30), || {
            proxy.connections() >= warm
        });
        assert_eq!(proxy.connections(), warm, "{delay_ms} ms");
        let h = load_exact(&e, &g, &hs, &data, &format!("{delay_ms} ms"));
        let s = h.stats();
        assert_eq!(
            s.requests,
            (chunks * g.layers as usize) as u64,
            "{delay_ms} ms"
        );
        // First-layer reads all go at once (one per chunk), later ones within the cap.
        assert!(
            s.peak_requests_in_flight >= chunks as u64,
            "{delay_ms} ms: {s:?}"
        );
        if delay_ms >= 20 {
            // A round trip of 40 ms or more holds more than 4 slices' bytes at this rate:
            // the cap grew past both `max_requests` and the first layer's reads.
            assert!(
                s.peak_requests_in_flight > chunks as u64,
                "{delay_ms} ms: the window did not widen: {s:?}"
            );
        }
        assert!(
            s.peak_bytes_in_flight <= EngineConfig::default().window_bytes,
            "{s:?}"
        );
        drop(h);
        drop(e);
    }
}

/// A load of many small chunks (vLLM's 16-token blocks make 2,048 chunks of a 32K-token
/// prefix) through a 20 ms delay, from a server that closes connections past 300 per client
/// address: every first-layer read would go out at once (400 connections), and on this
/// round trip the window's request cap would grow past that too. The load keeps at most 256
/// requests in flight, so every connection is served and the bytes arrive exact.
#[test]
fn many_small_chunks_stay_under_a_servers_connection_cap() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let srv = server(
        &rt,
        objectcache::server::ServerConfig {
            max_connections_per_ip: 300,
            ..objectcache::server::ServerConfig::default()
        },
    );
    // 2 layers of 512-byte slices: 400 chunks are 800 KiB of KV, 400 first-layer reads.
    let g = KvGeometry::new("test/many-chunks", 2, 1, 8, Dtype::Fp16)
        .unwrap()
        .with_tokens_per_chunk(16)
        .unwrap();
    let chunks = 400;
    let (hs, data) = seeded_prefix(&g, chunks, 11);
    let cfg = EngineConfig {
        namespace: unique_ns("many-chunks"),
        gather: false,
        ..EngineConfig::default()
    };
    let written = save_direct(&rt, srv.local_addr(), cfg.clone(), &g, &hs, &data);
    assert_eq!(written, chunks);
    let proxy = delay_proxy(&rt, srv.local_addr(), 20);
    let e = Engine::with_store(s3_at(&rt, proxy.local_addr()), cfg).unwrap();
    let h = load_exact(&e, &g, &hs, &data, "400 chunks");
    let s = h.stats();
    // The first layer's burst was cut at the ceiling, not below it.
    assert_eq!(s.peak_requests_in_flight, 256, "{s:?}");
    assert!(
        proxy.connections() <= 300,
        "{} connections",
        proxy.connections()
    );
}

/// Gather through a 20 ms one-way delay, two stripes, eight loads of 16 MiB: once the first
/// load has opened its second connection, every later load reuses the pooled two and opens
/// none, though the handle is dropped the moment its last layer is ready. (Before, dropping
/// it cancelled the stripes before they had read the server's `End` behind their last unit,
/// so both connections were closed and each load paid new handshakes: at 50 ms one way its
/// first layer took 465-787 ms instead of 158-210 ms.)
#[test]
fn gather_loads_through_a_delay_give_their_connections_back() {
    use objectcache::connector::GatherStatus;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let srv = server(&rt, objectcache::server::ServerConfig::default());
    // 16 MiB a load: the stripes' last units and `End` arrive in separate reads.
    let (g, hs, data) = prefix(32, 9);
    let ns = unique_ns("delay-gather");
    let cfg = EngineConfig {
        namespace: ns.clone(),
        gather_streams: 2,
        ..EngineConfig::default()
    };
    save_direct(&rt, srv.local_addr(), cfg.clone(), &g, &hs, &data);
    let proxy = delay_proxy(&rt, srv.local_addr(), 20);
    let e = Engine::with_store(s3_at(&rt, proxy.local_addr()), cfg).unwrap();
    let idle = |e: &Engine| match e.gather_status() {
        GatherStatus::Offered {
            idle_connections,
            warming: false,
        } => Some(idle_connections),
        _ => None,
    };
    common::eventually("gather offered, pool warm", Duration::from_secs(30), || {
        idle(&e).is_some()
    });
    let mut opened = Vec::new();
    for i in 0..8 {
        let h = load_exact(&e, &g, &hs, &data, &format!("load {i}"));
        assert_eq!(
            h.stats().requests,
            2,
            "load {i}: not gathered over two stripes"
        );
        drop(h);
        assert_eq!(idle(&e), Some(2), "load {i}: connections not given back");
        opened.push(proxy.connections());
    }
    // The pool's connections, and nothing opened after the first load.
    assert!(opened.windows(2).all(|w| w[0] == w[1]), "{opened:?}");
}
