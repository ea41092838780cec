//! Shared fixture of the S3 fault tests (tests/fault_s3*.rs): a prefix saved directly to the
//! test S3 endpoint, an engine reaching it through a [`FaultProxy`], and the checks every
//! fault case makes.
#![allow(dead_code)]

pub use super::common::current_thread_rt as rt;
use super::common::*;
use super::fault_proxy::{Fault, FaultProxy, Request};
use objectcache::connector::{ChunkStatus, Engine, EngineConfig, LayerStatus};
use objectcache::store::{S3Config, S3Credentials, S3Store, Store};
use objectcache::{ChunkHash, KvGeometry};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub const MAX_ATTEMPTS: u32 = 3;
pub const CHUNKS: usize = 4;

pub fn geometry() -> KvGeometry {
    small_geometry("test/fault", 6)
}

/// The test endpoint's address and a unique prefix, or `None` (SKIP) when it is down.
pub fn endpoint() -> Option<(SocketAddr, String)> {
    let ep = std::env::var("OBJECTCACHE_TEST_S3_ENDPOINT")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "http://127.0.0.1:7480".into());
    let hostport = ep
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let addr: SocketAddr = match std::net::ToSocketAddrs::to_socket_addrs(&hostport)
        .ok()
        .and_then(|mut a| a.next())
    {
        Some(a) if std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok() => a,
        _ => {
            skip(&format!(
                "S3 endpoint at {ep} (set OBJECTCACHE_TEST_S3_ENDPOINT)"
            ));
            return None;
        }
    };
    // The bucket, once, directly (not through a proxy).
    rt().block_on(async {
        let s = objectcache::store::S3Store::from_test_env("fault").await;
        s.expect("S3 endpoint refuses the test credentials or bucket")
    });
    Some((addr, unique_ns("fault")))
}

/// An S3 store reaching `url` (the test endpoint's bucket and credentials) with short
/// timeouts and `MAX_ATTEMPTS` attempts.
pub fn s3(url: &str) -> Arc<dyn Store> {
    let var = |k: &str, d: &str| {
        std::env::var(k)
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| d.to_string())
    };
    s3_as(
        url,
        &var("OBJECTCACHE_TEST_S3_BUCKET", "objectcache-test"),
        &var("OBJECTCACHE_TEST_S3_ACCESS_KEY", "cephtestak"),
        &var(
            "OBJECTCACHE_TEST_S3_SECRET_KEY",
            "cephtestsecretkey0123456789",
        ),
    )
}

/// An S3 store reaching `url` with this bucket and access key, short timeouts and
/// `MAX_ATTEMPTS` attempts.
pub fn s3_as(url: &str, bucket: &str, access_key: &str, secret_key: &str) -> Arc<dyn Store> {
    let mut c = S3Config::new(bucket);
    c.endpoint = Some(url.to_string());
    c.region = Some(
        std::env::var("OBJECTCACHE_TEST_S3_REGION")
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "us-east-1".into()),
    );
    c.addressing = Some(objectcache::store::Addressing::Path);
    c.credentials = S3Credentials::Static {
        access_key: access_key.to_string(),
        secret_key: secret_key.to_string(),
        session_token: None,
    };
    c.max_attempts = MAX_ATTEMPTS;
    c.initial_backoff = Duration::from_millis(10);
    c.max_backoff = Duration::from_millis(50);
    c.connect_timeout = Duration::from_secs(2);
    c.read_timeout = Duration::from_secs(1);
    c.attempt_timeout = Duration::from_secs(3);
    c.operation_timeout = Duration::from_secs(10);
    Arc::new(rt().block_on(S3Store::new(c)).unwrap())
}

pub fn engine_on(store: Arc<dyn Store>, ns: &str, timeout: Duration) -> Engine {
    let cfg = EngineConfig {
        namespace: ns.to_string(),
        load_timeout: Some(timeout),
        lookup_cache_ttl: Duration::ZERO,
        coalesce_bytes: 0,
        // The stock S3 path (ranged GETs) is under test: no gather probe.
        gather: false,
        ..EngineConfig::default()
    };
    Engine::with_store(store, cfg).unwrap()
}

/// One saved prefix, direct to the server (no proxy).
pub struct Fixture {
    pub g: KvGeometry,

    pub hashes: Vec<ChunkHash>,
    pub data: Vec<Vec<u8>>,
    pub proxy: FaultProxy,
    pub engine: Engine,
}

pub fn fixture(addr: SocketAddr, ns: &str, seed: u64, timeout: Duration) -> Fixture {
    fixture_on(addr, ns, seed, timeout, &s3)
}

/// [`fixture`] with the S3 store made by `mk(url)` (another server's bucket and keys).
pub fn fixture_on(
    addr: SocketAddr,
    ns: &str,
    seed: u64,
    timeout: Duration,
    mk: &dyn Fn(&str) -> Arc<dyn Store>,
) -> Fixture {
    let g = geometry();
    let direct = engine_on(mk(&format!("http://{addr}")), ns, timeout);
    let (hs, data) = save_prefix(&direct, &g, CHUNKS, seed);
    let proxy = FaultProxy::http(addr, |_| Fault::Pass);
    let engine = engine_on(mk(&proxy.url()), ns, timeout);
    Fixture {
        g,

        hashes: hs,
        data,
        proxy,
        engine,
    }
}

/// What one load ended as.
#[derive(Debug, Default)]
pub struct Outcome {
    pub ready: usize,
    pub failed: usize,
    /// The layers that failed, in order.
    pub failed_layers: Vec<usize>,
    pub bad_chunks: Vec<usize>,
    /// Storage requests of the load (1 for a gather load).
    pub requests: u64,
}

/// Loads the whole prefix and checks: each wait returns, every ready layer is byte-exact.
pub fn load_and_check(f: &Fixture, case: &str) -> Outcome {
    load_checked(&f.engine, &f.g, &f.hashes, &f.data, case)
}

/// Loads `hashes` through `engine` and checks: each wait returns (a hang fails), every ready
/// layer equals `data[layer]` byte for byte, every failed layer exposes no bytes.
pub fn load_checked(
    engine: &Engine,
    g: &KvGeometry,
    hashes: &[ChunkHash],
    data: &[Vec<u8>],
    case: &str,
) -> Outcome {
    let per_layer = hashes.len() * g.slice_bytes() as usize;
    let h = start_load(engine, g, hashes.to_vec(), per_layer);
    let mut o = Outcome::default();
    for l in 0..g.layers as usize {
        // Liveness bound far above the load deadline: a hang fails here.
        match h.wait_layer_blocking(l, Some(Duration::from_secs(120))) {
            Ok(()) => {
                assert!(
                    h.layer(l).unwrap() == &data[l][..],
                    "{case}: layer {l} is ready but its bytes differ"
                );
                o.ready += 1;
            }
            Err(e) => {
                assert!(
                    h.layer(l).is_none(),
                    "{case}: failed layer {l} exposes bytes"
                );
                assert!(
                    matches!(h.poll_layer(l), LayerStatus::Failed(_)),
                    "{case}: layer {l} wait ended with {e} but the layer is not failed (hang)"
                );
                o.failed += 1;
                o.failed_layers.push(l);
            }
        }
    }
    o.bad_chunks = h
        .chunk_status()
        .iter()
        .enumerate()
        .filter(|(_, s)| **s != ChunkStatus::Ok)
        .map(|(i, _)| i)
        .collect();
    o.requests = h.stats().requests;
    o
}

/// Attempts per (key, range) of GETs matching `pred`.
pub fn attempts(p: &FaultProxy, pred: impl Fn(&Request) -> bool) -> HashMap<(String, String), u32> {
    let mut m = HashMap::new();
    for r in p.requests().iter().filter(|r| r.method == "GET" && pred(r)) {
        *m.entry((r.path().to_string(), r.range.clone().unwrap_or_default()))
            .or_insert(0) += 1;
    }
    m
}

pub fn report(case: &str, runs: usize, outcome: &str) {
    println!("FAULT|s3|{case}|{runs}|{outcome}");
}

pub fn data_path_of(f: &Fixture, c: usize) -> String {
    let keys = f.engine.keys(&f.g).unwrap();
    keys.data(&f.hashes[c])
}

/// Runs `fault` on every GET of chunk `victim`'s data object; checks the invariants and that
/// the victim's layers are misses; returns the outcome.
pub fn victim_case(addr: SocketAddr, ns: &str, case: &str, fault: Fault, timeout: Duration) {
    victim_case_on(addr, ns, case, fault, timeout, &s3, "s3")
}

/// [`victim_case`] with the S3 store made by `mk(url)`; `server` names the server in the
/// printed `FAULT|` line.
pub fn victim_case_on(
    addr: SocketAddr,
    ns: &str,
    case: &str,
    fault: Fault,
    timeout: Duration,
    mk: &dyn Fn(&str) -> Arc<dyn Store>,
    server: &str,
) {
    let f = fixture_on(addr, ns, 7, timeout, mk);
    let victim = 2usize;
    let vkey = data_path_of(&f, victim);
    let fk = fault.clone();
    let vk = vkey.clone();
    f.proxy.set_rule(move |r| {
        if r.method == "GET" && r.path().ends_with(&vk) {
            fk.clone()
        } else {
            Fault::Pass
        }
    });
    let o = load_and_check(&f, case);
    // Every layer needs the victim's slice: none may be ready.
    assert_eq!(
        o.ready, 0,
        "{case}: a layer holding a faulty slice became ready: {o:?}"
    );
    assert!(o.bad_chunks.contains(&victim), "{case}: {o:?}");
    let att = attempts(&f.proxy, |r| r.path().ends_with(&vkey));
    assert!(
        !att.is_empty(),
        "{case}: the proxy saw no GET of the victim"
    );
    let worst = att.values().copied().max().unwrap();
    assert!(
        worst <= MAX_ATTEMPTS,
        "{case}: a ranged GET was tried {worst} times, more than {MAX_ATTEMPTS}: {att:?}"
    );
    // Nothing was lost: the same engine loads everything once the fault is gone.
    f.proxy.set_rule(|_| Fault::Pass);
    let clean = load_and_check(&f, &format!("{case}/after"));
    assert_eq!(
        clean.ready, f.g.layers as usize,
        "{case}: not recovered: {clean:?}"
    );
    let gets: u32 = att.values().sum();
    println!(
        "FAULT|{server}|{case}|1|{}",
        format_args!(
            "{} of {} layers missed, {} ranged GETs of the victim, at most {worst} attempts each; clean reload byte-exact",
            o.failed, f.g.layers, gets
        )
    );
}
