//! Soak: many concurrent saves, lookups and layer-ordered loads for a bounded time against one
//! store, checking no errors, byte-exact loads, stable memory (RSS samples) and no leaked file
//! descriptors (/proc/self/fd). Ignored by default; run with `scripts/soak.sh` (or
//! `cargo test --release --test integration fault_soak:: -- --ignored --nocapture`).
//!
//! Settings (environment): `OBJECTCACHE_SOAK_SECS` (default 60), `OBJECTCACHE_SOAK_WORKERS`
//! (default 8), `OBJECTCACHE_SOAK_STORE` (a store URL: `s3://bucket?endpoint=...`, the
//! server's URL, a directory; default a fresh temporary directory). Prints one `SOAK|...` line.

use crate::common;

use common::*;
use objectcache::connector::{LayerBuffers, LoadRequest};
use objectcache::store::Store;
use objectcache::{Dtype, KvGeometry};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn env_or(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn fds() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as u64)
        .unwrap_or(0)
}

#[test]
#[ignore = "soak: run with scripts/soak.sh"]
fn soak_concurrent_saves_and_loads() {
    let secs = env_or("OBJECTCACHE_SOAK_SECS", 60);
    let workers = env_or("OBJECTCACHE_SOAK_WORKERS", 8) as usize;
    let _tmp;
    let url = match std::env::var("OBJECTCACHE_SOAK_STORE")
        .ok()
        .filter(|v| !v.is_empty())
    {
        Some(u) => u,
        None => {
            _tmp = tempfile::tempdir().unwrap();
            _tmp.path().display().to_string()
        }
    };
    let fd0 = fds();
    let rss0 = rss_kib();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store: Arc<dyn Store> = rt.block_on(objectcache::store::open_store(&url)).unwrap();
    let mut g = KvGeometry::new("soak/small", 8, 2, 64, Dtype::Fp16).unwrap();
    g.tokens_per_chunk = 32;
    let ns = unique_ns("soak");
    let engine = Arc::new(uncached_engine(store, &ns));
    // A pool of prompts shared by the workers (so saves race on the same chunks).
    let prompts = 32usize;
    let stop = Arc::new(AtomicBool::new(false));
    let (saves, loads, bytes, errors) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let first_error: Arc<Mutex<Option<String>>> = Arc::default();
    let samples: Arc<Mutex<Vec<(f64, u64, u64)>>> = Arc::default();
    let t0 = Instant::now();
    let sampler = {
        let (stop, samples) = (stop.clone(), samples.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                samples
                    .lock()
                    .unwrap()
                    .push((t0.elapsed().as_secs_f64(), rss_kib(), fds()));
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let mut hs = Vec::new();
    for w in 0..workers {
        let (engine, g, stop) = (engine.clone(), g.clone(), stop.clone());
        let (saves, loads, bytes, errors, first_error) = (
            saves.clone(),
            loads.clone(),
            bytes.clone(),
            errors.clone(),
            first_error.clone(),
        );
        hs.push(std::thread::spawn(move || {
            let mut x = 0x9e37_79b9u64 ^ w as u64;
            let fail = |m: String| {
                errors.fetch_add(1, Ordering::Relaxed);
                first_error.lock().unwrap().get_or_insert(m);
            };
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let p = (x % prompts as u64) as usize;
                let chunks = 1 + p % 6;
                let hs = hashes(&g, chunks * g.tokens_per_chunk as usize, p as u32);
                let data = kv(&g, chunks, p as u64);
                let hit = match engine.lookup_blocking(&g, &hs) {
                    Ok(h) => h,
                    Err(e) => {
                        fail(format!("lookup: {e}"));
                        continue;
                    }
                };
                if hit < chunks {
                    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
                    match engine.save_blocking(&g, &hs, &refs) {
                        Ok(_) => {
                            saves.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => fail(format!("save: {e}")),
                    }
                    continue;
                }
                let n = chunks * g.slice_bytes() as usize;
                let h = match engine.load(
                    LoadRequest::new(g.clone(), hs.clone()),
                    LayerBuffers::allocate(g.layers as usize, n),
                ) {
                    Ok(h) => h,
                    Err(e) => {
                        fail(format!("load: {e}"));
                        continue;
                    }
                };
                match h.wait_all_blocking() {
                    Ok(()) => {
                        for l in 0..g.layers as usize {
                            if h.layer(l).unwrap() != &data[l][..] {
                                fail(format!("prompt {p} layer {l}: bytes differ"));
                            }
                        }
                        loads.fetch_add(1, Ordering::Relaxed);
                        bytes.fetch_add((n * g.layers as usize) as u64, Ordering::Relaxed);
                    }
                    Err(e) => fail(format!("load wait: {e}")),
                }
            }
        }));
    }
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
    sampler.join().unwrap();
    let elapsed = t0.elapsed().as_secs_f64();
    drop(engine);
    drop(rt);
    std::thread::sleep(Duration::from_millis(200));
    let fd_end = fds();
    let s = samples.lock().unwrap().clone();
    let warm = s[s.len() / 4].1;
    let rss_end = s.last().unwrap().1;
    let rss_peak = s.iter().map(|x| x.1).max().unwrap();
    let fd_peak = s.iter().map(|x| x.2).max().unwrap();
    let (sv, ld, by, er) = (
        saves.load(Ordering::Relaxed),
        loads.load(Ordering::Relaxed),
        bytes.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
    );
    println!(
        "SOAK|{url}|{elapsed:.0} s|{workers} workers|{sv} saves|{ld} loads ({:.1}/s, {:.1} MiB/s)|RSS MiB start {:.1}, after warm-up {:.1}, peak {:.1}, end {:.1}|fds start {fd0}, peak {fd_peak}, end {fd_end}|{er} errors",
        ld as f64 / elapsed,
        by as f64 / elapsed / 1048576.0,
        rss0 as f64 / 1024.0,
        warm as f64 / 1024.0,
        rss_peak as f64 / 1024.0,
        rss_end as f64 / 1024.0,
    );
    assert_eq!(er, 0, "first error: {:?}", first_error.lock().unwrap());
    assert!(ld > 0 && sv > 0);
    assert!(
        fd_end <= fd0 + 2,
        "file descriptors leaked: {fd0} before, {fd_end} after"
    );
    // Stable memory: no growth past warm-up beyond allocator slack.
    assert!(
        rss_end <= warm * 2 + 65536,
        "RSS grew from {warm} KiB after warm-up to {rss_end} KiB"
    );
}
