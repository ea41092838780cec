//! User cases C4 (a burst of cache hits under a memory budget) and C5 (many layers, many
//! ranks) from the project's case list, through the gather server on loopback.

use crate::gather_util;

use gather_util::*;
use objectcache::layout::{plan_layer_major, KvGeometry};
use objectcache::store::{MemoryStore, Store};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Peak resident memory of this process (VmHWM), bytes; `None` off Linux.
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(l.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// C4: 100 loads of 4K-token prefixes at Llama-3.1-8B geometry posted at once, with a 2 GiB
/// budget for data in flight. Bytes in flight never exceed the budget; every load completes
/// byte-exact; peak memory is reported and bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_burst_of_100_cache_hits_under_a_2gib_budget() {
    let g = KvGeometry::llama31_8b();
    let budget: u64 = 2 << 30;
    let mut cfg = config();
    cfg.memory_budget_bytes = budget;
    let server = start(Arc::new(MemoryStore::new()), cfg).await;
    let addr = server.local_addr();
    let tokens = vec![256u32; 16];
    // Two hot prefixes (the burst hits them over and over).
    let mut c = gather_client(addr).await;
    for s in [41, 42] {
        save_prefix(&mut c, &g, s, &tokens).await;
    }
    let loads = 100u64;
    let t0 = std::time::Instant::now();
    let tasks = spawn_verified_loads(addr, &g, &tokens, &[41, 42], loads);
    let mut total = 0;
    for t in tasks {
        let (mismatches, complete, bytes) = t.await.unwrap();
        assert_eq!((mismatches, complete), (0, 32));
        total += bytes;
    }
    let peak_inflight = server.metrics().inflight_peak_bytes.get() as u64;
    let rss = peak_rss();
    println!(
        "C4: {loads} loads, {} GiB delivered in {:.1} s; peak bytes in flight {} MiB (budget {} MiB); peak RSS {:?} MiB",
        total >> 30,
        t0.elapsed().as_secs_f64(),
        peak_inflight >> 20,
        budget >> 20,
        rss.map(|r| r >> 20)
    );
    assert_eq!(total, loads * 16 * g.slice_bytes() * 32);
    assert!(
        peak_inflight > 0 && peak_inflight <= budget,
        "peak in flight {peak_inflight} > budget {budget}"
    );
    if let Some(r) = rss {
        // Store (1 GiB) + in-flight budget (2 GiB) + one 16 MiB frame per active client
        // (64 admitted) + runtime slack.
        let bound = (1u64 << 30) + budget + 64 * (32 << 20) + (1 << 30);
        assert!(r < bound, "peak RSS {r} above {bound}");
    }
    server.shutdown().await;
}

/// C5: Llama-3.1-70B at TP 8 (80 layers, 512 bytes per token per layer per rank), a 32K-token
/// prefix: one object per (chunk, rank), one gather request per load per rank. Ranks run one
/// after another so memory holds one rank's objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c5_many_layers_many_ranks_one_request_per_rank() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let server = start(store.clone(), config()).await;
    let mut c = gather_client(server.local_addr()).await;
    let tokens = vec![256u32; 128];
    let mut objects_written = 0;
    for rank in 0..8 {
        let g = KvGeometry::llama31_70b(8, rank).unwrap();
        assert_eq!((g.layers, g.bytes_per_token_per_layer()), (80, 512));
        let saved = save_prefix(&mut c, &g, 500, &tokens).await;
        assert_eq!(saved.written, 128, "one object per chunk on rank {rank}");
        objects_written += saved.written;
        let before =
            objectcache_metric(&server, "objectcache_server_requests_total{op=\"gather\"}");
        let sink = VerifySink::new(&g, 500, &tokens);
        c.load(&request(&g, 500, &tokens), &sink).await.unwrap();
        assert_eq!(sink.mismatches.load(Ordering::Relaxed), 0);
        assert_eq!(sink.complete_layers(), 80);
        let after = objectcache_metric(&server, "objectcache_server_requests_total{op=\"gather\"}");
        assert_eq!(
            after - before,
            1.0,
            "one gather request for rank {rank}'s load"
        );
        let kb = key_builder(&g);
        assert!(kb.prefix().contains(&format!("/tp{rank}-8/")));
        for h in hashes(500, 128) {
            store
                .delete(&format!("{BUCKET}/{}", kb.data(&h)))
                .await
                .unwrap();
        }
    }
    let g = KvGeometry::llama31_70b(8, 0).unwrap();
    let ranged = plan_layer_major(128, 80, g.slice_bytes(), 0).len();
    let coalesced = plan_layer_major(128, 80, g.slice_bytes(), 4 << 20).len();
    println!(
        "C5: objects written {objects_written} (128 chunks x 8 ranks); requests per load per rank: gather 1, \
         s3-layerwise {ranged} ranged GETs ({coalesced} with 4 MiB coalescing), s3-chunkwise 128 GETs"
    );
    assert_eq!(objects_written, 1024);
    assert_eq!(ranged, 128 * 80);
    server.shutdown().await;
}

fn objectcache_metric(server: &objectcache::server::ServerHandle, name: &str) -> f64 {
    metric(&server.metrics().encode(), name).unwrap_or(0.0)
}
