//! The bandwidth policies on the client's stock-S3 path: one `Engine` with ranged GETs
//! (`gather = off`) and a bandwidth cap runs a small burst of concurrent loads (different
//! prefix lengths, per-layer compute hints in the `LoadRequest`) against an in-process server
//! on loopback; the measured added TTFT (from the layer landing times the `LoadHandle`
//! reports, consumed layer by layer with the hinted compute) is compared with the simulator's
//! prediction of the same mix under the same policy and cap (the mix of `sched_loopback.rs`).
//!
//! An accuracy test of the model, not a speed test: at 40 MB/s every transfer lasts hundreds
//! of milliseconds, so loopback latency and per-request overheads (about a millisecond per
//! ranged GET) are small against it.
#![cfg(feature = "s3")]

mod common;
mod gather_util;
mod sched_mix;

use common::{hashes, kv, unique_ns};
use gather_util::{config, s3_store_on, start};
use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadRequest};
use objectcache::sched::{timeline, PolicyKind};
use objectcache::store::{MemoryStore, Store};
use objectcache::{ChunkHash, KvGeometry};
use sched_mix::*;
use std::sync::Arc;

/// One saved prefix of the mix: its chunk hashes and every layer's bytes.
struct Prefix {
    hashes: Vec<ChunkHash>,
    kv: Vec<Vec<u8>>,
}

/// Runs the mix once on a fresh engine capped at [`CAP`] under `scheduler`; returns the
/// measured added TTFT of each request (s), after checking every byte loaded.
async fn measure(
    store: Arc<dyn Store>,
    ns: &str,
    g: &KvGeometry,
    prefixes: &[Prefix],
    scheduler: &str,
) -> Vec<f64> {
    let e = Engine::with_store(
        store,
        EngineConfig {
            namespace: ns.into(),
            gather: false,
            scheduler: scheduler.into(),
            bandwidth_cap_bytes_per_s: CAP as u64,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    // Warm-up (not measured): the engine's first ranged GETs open its connections; a
    // long-lived engine has them already, and the model leaves connection set-up out. A
    // burst as wide as the measured one, so the connection pool holds one connection per
    // concurrent load before the measurement starts.
    let slice = g.slice_bytes() as usize;
    let warm: Vec<_> = prefixes
        .iter()
        .map(|p| {
            let req = LoadRequest::new(g.clone(), p.hashes[..1].to_vec());
            e.load(req, LayerBuffers::allocate(g.layers as usize, slice))
                .unwrap()
        })
        .collect();
    for h in &warm {
        h.wait_all().await.unwrap();
    }
    drop(warm);
    let m = model();
    // Requests and destinations first (allocating 70 MB takes tens of milliseconds), so the
    // loads start within microseconds of each other, as the simulated burst does.
    let mut ready_to_go = Vec::new();
    for (p, &(prefix, new)) in prefixes.iter().zip(MIX.iter()) {
        let (_, compute) = compute_hint(&m, prefix, new);
        let req =
            LoadRequest::new(g.clone(), p.hashes.clone()).with_layer_compute_s(compute.clone());
        let dest = LayerBuffers::allocate(g.layers as usize, p.kv[0].len());
        ready_to_go.push((req, dest, compute));
    }
    let loads: Vec<_> = ready_to_go
        .into_iter()
        .map(|(req, dest, compute)| (e.load(req, dest).unwrap(), compute))
        .collect();
    let mut out = Vec::new();
    for ((h, compute), p) in loads.iter().zip(prefixes) {
        h.wait_all().await.unwrap();
        for l in 0..g.layers as usize {
            assert!(
                h.layer(l).unwrap() == &p.kv[l][..],
                "layer {l} bytes differ"
            );
        }
        let ready: Vec<f64> = h.layer_ready_s().into_iter().map(|r| r.unwrap()).collect();
        // Compute could start when `load` was called (the request's arrival; the loads are
        // issued within microseconds of each other): added TTFT = finish with loading minus
        // finish with all KV local (timeline module docs).
        out.push(timeline::added_ttft(0.0, &ready, compute));
    }
    out
}

/// Saves the mix through `store` under a fresh namespace, runs it under stall-aware and
/// equal share and compares each with the simulator, then deletes what it saved.
async fn run_mix(store: Arc<dyn Store>, path: &str) {
    // One measurement at a time: the tests of this file share the machine's cores.
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _serial = SERIAL.lock().await;
    let g = KvGeometry::smollm2_135m();
    let ns = unique_ns("sched-client");
    let prefixes: Vec<Prefix> = MIX
        .iter()
        .enumerate()
        .map(|(i, &(prefix, _))| {
            let chunks = (prefix / g.tokens_per_chunk) as usize;
            Prefix {
                hashes: hashes(&g, prefix as usize, 100 + i as u32),
                kv: kv(&g, chunks, 100 + i as u64),
            }
        })
        .collect();
    let e = Engine::with_store(
        store.clone(),
        EngineConfig {
            namespace: ns.clone(),
            gather: false,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    for p in &prefixes {
        let refs: Vec<&[u8]> = p.kv.iter().map(|v| v.as_slice()).collect();
        e.save(&g, &p.hashes, &refs).await.unwrap();
    }
    for (scheduler, kind) in [
        ("stall-aware", PolicyKind::StallAware),
        ("equal", PolicyKind::EqualShare),
    ] {
        let measured = measure(store.clone(), &ns, &g, &prefixes, scheduler).await;
        compare(path, scheduler, &measured, &predict(&g, kind));
    }
    let keys = e.keys(&g).unwrap();
    for h in prefixes.iter().flat_map(|p| &p.hashes) {
        store.delete(&keys.marker(h)).await.unwrap();
        store.delete(&keys.data(h)).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranged_gets_to_our_server_under_a_cap_match_the_simulator() {
    let server = start(Arc::new(MemoryStore::new()), config()).await;
    let store = s3_store_on(&server.endpoint()).await;
    run_mix(store, "ranged GETs to our server (engine link)").await;
    server.shutdown().await;
}

/// The same against a stock S3 server (Ceph RGW on loopback, `OBJECTCACHE_TEST_S3_*`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranged_gets_to_stock_s3_under_a_cap_match_the_simulator() {
    let Some((s, _)) = common::test_s3_store("sched-client").await else {
        return;
    };
    run_mix(Arc::new(s), "ranged GETs to stock S3 (engine link)").await;
}
