//! The bandwidth policies on the real gather path: a server on loopback with a bandwidth cap
//! serves a small burst of concurrent loads (separate connections, different prefix lengths,
//! per-layer compute hints); the measured added TTFT (from the layer landing times at the
//! clients, consumed layer by layer with the hinted compute) is compared with the simulator's
//! prediction of the same mix under the same policy and cap.
//!
//! This is an accuracy test of the model, not a speed test: the cap (40 MB/s) makes every
//! transfer last hundreds of milliseconds, so loopback latency and per-unit overheads (a few
//! milliseconds) are small against it.

mod gather_util;
mod sched_mix;

use gather_util::*;
use objectcache::error::{LayerError, LayerResult};
use objectcache::layout::KvGeometry;
use objectcache::protocol::SchedHints;
use objectcache::sched::{timeline, PolicyKind};
use objectcache::store::{MemoryStore, Store};
use objectcache::transport::tcp::GatherClient;
use objectcache::transport::LayerSink;
use sched_mix::*;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Records when each layer became complete (every byte verified), relative to `t0`.
struct TimedSink {
    inner: VerifySink,
    layer_bytes: u64,
    t0: Instant,
    ready: Mutex<Vec<Option<f64>>>,
}

impl LayerSink for TimedSink {
    fn write(&self, layer: u32, offset: u64, data: &[u8]) -> LayerResult<()> {
        self.inner.write(layer, offset, data)
    }
    fn placed(&self, layer: u32, offset: u64, len: u64) -> LayerResult<()> {
        self.inner.placed(layer, offset, len)
    }
    fn complete(&self, layer: u32, bytes: u64) {
        self.inner.complete(layer, bytes);
        if self.inner.done[layer as usize].load(Ordering::Relaxed) == self.layer_bytes {
            self.ready.lock().unwrap()[layer as usize] = Some(self.t0.elapsed().as_secs_f64());
        }
    }
    fn fail(&self, layer: u32, err: LayerError) {
        self.inner.fail(layer, err)
    }
    fn is_cancelled(&self) -> bool {
        self.inner.is_cancelled()
    }
}

/// Runs the mix once under `policy` on a fresh server over `store`; returns the measured
/// added TTFT of each request (s).
async fn measure(store: Arc<dyn Store>, g: &KvGeometry, scheduler: &str) -> Vec<f64> {
    let mut cfg = config();
    cfg.scheduler = scheduler.into();
    cfg.bandwidth_cap_bytes_per_s = CAP as u64;
    let server = start(store, cfg).await;
    let m = model();
    let mut clients = Vec::new();
    for _ in MIX {
        clients.push(
            GatherClient::connect_with(server.local_addr(), creds())
                .await
                .unwrap(),
        );
    }
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (i, (mut c, &(prefix, new))) in clients.into_iter().zip(MIX.iter()).enumerate() {
        let g = g.clone();
        let (hint_us, compute) = compute_hint(&m, prefix, new);
        tasks.push(tokio::spawn(async move {
            let seed = 100 + i as u64;
            let tokens = vec![g.tokens_per_chunk; (prefix / g.tokens_per_chunk) as usize];
            let mut req = request(&g, seed, &tokens);
            req.hints = SchedHints::LayerComputeUs(hint_us);
            let sink = TimedSink {
                inner: VerifySink::new(&g, seed, &tokens),
                layer_bytes: prefix as u64 * g.bytes_per_token_per_layer(),
                t0,
                ready: Mutex::new(vec![None; g.layers as usize]),
            };
            let r = c.load(&req, &sink).await.unwrap();
            assert!(r.failed_layers.is_empty(), "{:?}", r.failed_layers);
            assert_eq!(sink.inner.mismatches.load(Ordering::Relaxed), 0);
            assert_eq!(sink.inner.complete_layers(), g.layers as usize);
            let ready: Vec<f64> = sink
                .ready
                .lock()
                .unwrap()
                .iter()
                .map(|r| r.unwrap())
                .collect();
            // Compute could start at t0 (the request's arrival); added TTFT = finish with
            // loading minus finish with all KV local (timeline module docs).
            timeline::added_ttft(0.0, &ready, &compute)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    server.shutdown().await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measured_added_ttft_matches_the_simulator_under_a_cap() {
    let g = KvGeometry::smollm2_135m();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    {
        let server = start(store.clone(), config()).await;
        let mut c = GatherClient::connect_with(server.local_addr(), creds())
            .await
            .unwrap();
        for (i, &(prefix, _)) in MIX.iter().enumerate() {
            let tokens = vec![g.tokens_per_chunk; (prefix / g.tokens_per_chunk) as usize];
            save_prefix(&mut c, &g, 100 + i as u64, &tokens).await;
        }
        server.shutdown().await;
    }
    for (scheduler, kind) in [
        ("stall-aware", PolicyKind::StallAware),
        ("equal", PolicyKind::EqualShare),
    ] {
        let measured = measure(store.clone(), &g, scheduler).await;
        compare(
            "gather (server link)",
            scheduler,
            &measured,
            &predict(&g, kind),
        );
    }
}
