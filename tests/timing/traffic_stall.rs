//! Issue 19, part 2 and case C19: a load whose store stops sending fails fast; a load paused
//! on purpose, or read slowly, does not.
//!
//! - A proxy between the engine and the gather server stops forwarding in the middle of a
//!   load: with an explicit 1 s stall limit the load gives up within the limit plus 10% of
//!   the silence, its missing layers fail with `Stalled` naming the store, and the stall
//!   advice says to recompute from the first missing layer.
//! - With default settings (and no overall deadline, `load_timeout_ms=0`), on loopback, a
//!   load whose store goes silent gives up within 2 s of the silence, on the gather path and
//!   on the ranged-GET path.
//! - C19: a ranged-GET load the engine's own scheduler pauses for over 3 s, a gather load a
//!   capped `fifo` server pauses for over 3 s (it sends `Held` frames meanwhile), and a load
//!   whose body arrives in 1 MiB pieces 120 ms apart all finish without error, one request
//!   per read (no retries); a server that sends response headers and nothing else fails the
//!   load within 5 s, naming the store, and the caller is told what to recompute.
#![cfg(feature = "s3")]

use crate::common;
use crate::fault_proxy;
use crate::gather_util;

use common::shared_rt as rt;
use common::{save_prefix, start_load, unique_ns};
use fault_proxy::{Fault, FaultProxy, RawFault};
use gather_util::{config, start};
use objectcache::connector::{Engine, LoadHandle};
use objectcache::sched::{AnalyticModel, ComputeModel, Fallback, GpuKind, KernelClass, ModelShape};
use objectcache::server::ServerHandle;
use objectcache::store::MemoryStore;
use objectcache::{ChunkHash, Dtype, KvGeometry, LayerError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 16 layers x 256 KiB slices: 4 MiB per chunk.
fn geometry() -> KvGeometry {
    KvGeometry::new("traffic/stall", 16, 4, 64, Dtype::Fp16).unwrap()
}

fn server(cap: u64, scheduler: &str) -> ServerHandle {
    let mut cfg = config();
    cfg.bandwidth_cap_bytes_per_s = cap;
    cfg.scheduler = scheduler.into();
    rt().block_on(start(Arc::new(MemoryStore::new()), cfg))
}

/// An engine over the S3 store at `endpoint` with the settings `pairs`, in `namespace`.
fn engine_in(endpoint: &str, namespace: String, pairs: &[(&str, &str)]) -> Engine {
    let store = rt().block_on(gather_util::s3_store_on(endpoint));
    crate::common::engine_with(store, &namespace, pairs)
}

/// An engine over the S3 store at `endpoint` with the settings `pairs`, in a namespace of its
/// own named after `ns`.
fn engine_on(endpoint: &str, ns: &str, pairs: &[(&str, &str)]) -> Engine {
    engine_in(endpoint, unique_ns(ns), pairs)
}

struct Prefix {
    hashes: Vec<ChunkHash>,
    data: Vec<Vec<u8>>,
}

fn save(e: &Engine, g: &KvGeometry, chunks: usize, seed: u64) -> Prefix {
    let (hashes, data) = save_prefix(e, g, chunks, seed);
    Prefix { hashes, data }
}

/// A prefix saved on a server, and a fault proxy before the server.
struct Proxied {
    srv: ServerHandle,
    /// The engine on the server itself that saved `p`.
    direct: Engine,
    p: Prefix,
    proxy: FaultProxy,
}

/// A `fifo` server with no cap, an engine on it in a namespace named after `ns` (settings
/// `pairs`), a prefix of `chunks` chunks (seed `seed`) it saved there, then the proxy that
/// `proxy` starts before the server (given the server's address).
fn saved_behind_a_proxy(
    g: &KvGeometry,
    ns: &str,
    pairs: &[(&str, &str)],
    chunks: usize,
    seed: u64,
    proxy: impl FnOnce(std::net::SocketAddr) -> FaultProxy,
) -> Proxied {
    let srv = server(0, "fifo");
    let direct = engine_on(&srv.endpoint(), ns, pairs);
    let p = save(&direct, g, chunks, seed);
    let proxy = proxy(srv.local_addr());
    Proxied {
        srv,
        direct,
        p,
        proxy,
    }
}

impl Proxied {
    /// An engine through the proxy with the settings `pairs` that reads what `direct` saved
    /// (its namespace).
    fn engine(&self, pairs: &[(&str, &str)]) -> Engine {
        engine_in(
            &self.proxy.url(),
            self.direct.config().namespace.clone(),
            pairs,
        )
    }

    /// The proxy's address, as a stalled layer's error names the store.
    fn store(&self) -> String {
        self.proxy.addr().to_string()
    }

    /// Stops the proxy, then the server.
    fn stop(self) {
        let Proxied { srv, proxy, .. } = self;
        drop(proxy);
        rt().block_on(srv.shutdown());
    }
}

fn load(e: &Engine, g: &KvGeometry, p: &Prefix) -> LoadHandle {
    start_load(e, g, p.hashes.clone(), p.data[0].len())
}

/// Every layer ready and byte-exact.
fn check_all(h: &LoadHandle, p: &Prefix, what: &str) {
    crate::common::assert_layers_landed(h, &p.data, p.data[0].len(), what);
}

/// How many GETs passed through `proxy`.
fn gets(proxy: &FaultProxy) -> usize {
    proxy
        .requests()
        .iter()
        .filter(|r| r.method == "GET")
        .count()
}

/// Waits for the first layer that is not ready; returns it, its error and when it came.
fn first_failure(h: &LoadHandle) -> (usize, LayerError, Instant) {
    for l in 0..h.layers() {
        if let Err(e) = h.wait_layer_blocking(l, None) {
            return (l, e, Instant::now());
        }
    }
    panic!("every layer arrived: no stall happened");
}

/// The compute model of the stall advice: a Llama-style shape with the test geometry's 16
/// layers (4 KV heads of 64), on one H100.
fn model() -> ComputeModel {
    let shape = ModelShape::llama_style("traffic/stall", 16, 2048, 4, 64, 8192);
    ComputeModel::Analytic(AnalyticModel::new(shape, GpuKind::H100, KernelClass::Tuned, 1).unwrap())
}

/// A stalled load: its first missing layer `l` failed with `Stalled` naming `store`; every
/// layer is ready or failed (the watchdog fails all that were still missing; layers whose
/// bytes had all arrived are ready); the stall advice recomputes from layer `l`.
fn assert_stalled(h: &LoadHandle, l: usize, e: &LayerError, store: &str, what: &str) {
    match e {
        LayerError::Stalled { store: s, .. } => assert!(s.contains(store), "{what}: {e}"),
        other => panic!("{what}: layer {l} failed with {other}, not a stall"),
    }
    for k in l..h.layers() {
        match h.wait_layer_blocking(k, None) {
            Ok(()) => {}
            Err(LayerError::Stalled { .. }) => {}
            Err(other) => panic!("{what}: layer {k} failed with {other}"),
        }
    }
    let tokens = h.chunk_status().len() as u64 * geometry().tokens_per_chunk as u64;
    match h.stall_advice(&model(), tokens, 128).unwrap() {
        Fallback::Recompute { from_layer, .. } => assert_eq!(from_layer, l, "{what}"),
        other => panic!("{what}: advice {other:?} after a stall"),
    }
}

#[test]
fn gather_stream_stopped_mid_load_gives_up_within_the_stall_limit() {
    let _alone = crate::alone();
    let g = geometry();
    // The capabilities probe and the pooled connections pass; every gather connection stops
    // forwarding after 6 MiB of its stream (of 16 MiB: two stripes of an 8-chunk load).
    let s = saved_behind_a_proxy(&g, "stall-gather", &[], 8, 11, |srv| {
        FaultProxy::raw(srv, |_| RawFault::StallAfter(6 << 20))
    });
    for (pairs, limit) in [
        (
            vec![("stall_timeout_ms", "1000"), ("load_timeout_ms", "0")],
            1.0,
        ),
        // Default settings: the automatic limit, 1 s once bytes flow on loopback.
        (vec![("load_timeout_ms", "0")], 1.0),
    ] {
        let e = s.engine(&pairs);
        let before = s.proxy.stalls().len();
        let h = load(&e, &g, &s.p);
        let (l, err, failed_at) = first_failure(&h);
        let stalled = s.proxy.stalls()[before..]
            .iter()
            .copied()
            .min()
            .expect("the proxy stalled");
        let after = failed_at.duration_since(stalled).as_secs_f64();
        println!("STALL|gather, {pairs:?}|layer {l}: {err}|given up {after:.3} s after the silence began");
        assert_stalled(&h, l, &err, &s.store(), "gather");
        assert!(l > 0, "some layers arrived before the stall");
        assert!(
            after >= limit * 0.99 && after <= limit * 1.1,
            "{pairs:?}: gave up {after:.3} s after the silence, limit {limit} s"
        );
        assert!(after <= 2.0, "default settings give up within 2 s");
    }
    s.stop();
}

#[test]
fn ranged_get_body_stalled_gives_up_within_the_stall_limit() {
    let _alone = crate::alone();
    let g = geometry();
    // Ranged GETs through an HTTP proxy: the 5th GET (the first of the coalesced reads of
    // layers 1..16, after the four layer-0 reads) sends its headers and half its body, then
    // nothing.
    let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let n2 = n.clone();
    let s = saved_behind_a_proxy(&g, "stall-ranged", &[("gather", "off")], 4, 12, |srv| {
        FaultProxy::http(srv, move |r| {
            if r.method == "GET" && n2.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 4 {
                Fault::Stall(0.5)
            } else {
                Fault::Pass
            }
        })
    });
    let e = s.engine(&[("gather", "off"), ("load_timeout_ms", "0")]);
    let h = load(&e, &g, &s.p);
    let (l, err, failed_at) = first_failure(&h);
    let stalled = s
        .proxy
        .stalls()
        .first()
        .copied()
        .expect("the proxy stalled");
    let after = failed_at.duration_since(stalled).as_secs_f64();
    println!("STALL|ranged GETs, default limit|layer {l}: {err}|given up {after:.3} s after the silence began");
    assert_stalled(&h, l, &err, &s.store(), "ranged");
    assert!(
        after <= 2.0,
        "default settings give up within 2 s of the silence: {after:.3} s"
    );
    s.stop();
}

/// C19: a server that sends response headers and nothing else for 30 s.
#[test]
fn c19_a_silent_server_fails_the_load_within_5_s_naming_it() {
    let _alone = crate::alone();
    let g = geometry();
    let off = [("gather", "off")];
    let s = saved_behind_a_proxy(&g, "c19-silent", &off, 2, 13, |srv| {
        FaultProxy::http(srv, Fault::on_gets(Fault::Stall(0.0)))
    });
    let e = s.engine(&off);
    let t0 = Instant::now();
    let h = load(&e, &g, &s.p);
    let (l, err, failed_at) = first_failure(&h);
    let secs = failed_at.duration_since(t0).as_secs_f64();
    println!(
        "C19|silent server (headers only)|layer {l}: {err}|failed {secs:.3} s after the load began"
    );
    assert_eq!(l, 0);
    assert_stalled(&h, l, &err, &s.store(), "C19 silent");
    assert!(
        secs <= 5.0,
        "the silent server failed the load after {secs:.3} s"
    );
    let gets = gets(&s.proxy);
    assert!(gets <= 2 * g.layers as usize, "no retry storm: {gets} GETs");
    s.stop();
}

/// C19: a consumer that reads 1 MiB pieces 120 ms apart is slow, not stalled.
#[test]
fn c19_a_slow_reader_is_not_a_stall() {
    let _alone = crate::alone();
    let g = geometry();
    let s = saved_behind_a_proxy(&g, "c19-slow", &[("gather", "off")], 2, 14, |srv| {
        FaultProxy::http(
            srv,
            Fault::on_gets(Fault::Drip {
                bytes: 1 << 20,
                every: Duration::from_millis(120),
            }),
        )
    });
    // One GET per 2 MiB (coalesced slices): each takes two pieces, 240 ms.
    let e = s.engine(&[
        ("gather", "off"),
        ("coalesce_bytes", "2097152"),
        ("max_requests", "1"),
    ]);
    let t0 = Instant::now();
    let h = load(&e, &g, &s.p);
    check_all(&h, &s.p, "C19 slow reader");
    let gets = gets(&s.proxy) as u64;
    println!(
        "C19|slow reader (1 MiB / 120 ms)|{:.3} s, {gets} GETs for {} requests|no error",
        t0.elapsed().as_secs_f64(),
        h.stats().requests
    );
    assert_eq!(gets, h.stats().requests, "one GET per read: no retries");
    s.stop();
}

/// C19's pause: saves two prefixes through `e` (`[(chunks, seed); 2]`: a long first, a short
/// second), loads the first and, once its layer 0 is in, the second, which `e`'s link or its
/// server must hold back behind the first. Checks both loads byte-exact (the second's as
/// `what`), prints how long the second waited for its first layer (`path` says which load,
/// `unit` what its requests are) and asserts it waited over 3 s. Returns the second load.
fn held_behind_a_first_load(
    e: &Engine,
    g: &KvGeometry,
    prefixes: [(usize, u64); 2],
    what: &str,
    path: &str,
    unit: &str,
) -> LoadHandle {
    let [(first_chunks, first_seed), (second_chunks, second_seed)] = prefixes;
    let first = save(e, g, first_chunks, first_seed);
    let second = save(e, g, second_chunks, second_seed);
    let a = load(e, g, &first);
    a.wait_layer_blocking(0, None).unwrap();
    let t0 = Instant::now();
    let b = load(e, g, &second);
    check_all(&b, &second, what);
    let waited = b.stats().ttfl_s.unwrap();
    check_all(&a, &first, "C19 first load");
    println!(
        "C19|{path}|first layer after {waited:.3} s, done in {:.3} s, {} {unit}|no error",
        t0.elapsed().as_secs_f64(),
        b.stats().requests
    );
    assert!(
        waited > 3.0,
        "the load was held back for {waited:.3} s only"
    );
    b
}

/// C19: a ranged-GET load the engine's own bandwidth scheduler holds back for over 3 s.
#[test]
fn c19_a_load_paused_by_the_engine_scheduler_is_not_a_stall() {
    let _alone = crate::alone();
    let g = geometry();
    let srv = server(0, "fifo");
    // 10 MB/s, fifo: the second load waits for the first (40 MiB, about 4 s).
    let e = engine_on(
        &srv.endpoint(),
        "c19-paused",
        &[
            ("gather", "off"),
            ("scheduler", "fifo"),
            ("bandwidth_cap_bytes_per_s", "10000000"),
        ],
    );
    let b = held_behind_a_first_load(
        &e,
        &g,
        [(10, 15), (1, 16)],
        "C19 paused (engine)",
        "ranged GETs paused by the engine's fifo link",
        "GETs",
    );
    assert_eq!(
        b.stats().requests,
        g.layers as u64,
        "one GET per slice, no retries"
    );
    rt().block_on(srv.shutdown());
}

/// C19 on the gather path: a capped `fifo` server holds the second load back for over 3 s
/// and says so (`Held` frames).
#[test]
fn c19_a_gather_load_paused_by_the_server_is_not_a_stall() {
    let _alone = crate::alone();
    let g = geometry();
    let srv = server(10_000_000, "fifo");
    let e = engine_on(&srv.endpoint(), "c19-held", &[]);
    let b = held_behind_a_first_load(
        &e,
        &g,
        [(10, 17), (2, 18)],
        "C19 paused (server)",
        "gather load held by a capped fifo server",
        "requests",
    );
    assert_eq!(
        b.stats().requests,
        2,
        "one gather request per stripe, no retries"
    );
    rt().block_on(srv.shutdown());
}
