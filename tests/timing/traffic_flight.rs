//! Issue 19, part 3: one fetch for many requests. Concurrent loads of one prefix in one engine
//! share one fetch (`single_flight`, on by default):
//! - 50 concurrent loads of one 40-chunk prefix move at most 1.1x the bytes of one load (the
//!   server's own `gather_out` counter) and 49 of them follow the first one's fetch, every
//!   byte of every load compared (the slowest one's time against one load alone, the goal
//!   being at most 1.3x, is printed, not asserted);
//! - a follower that needs fewer chunks has each layer no later than the leader (plus the
//!   copy);
//! - a leader that is cancelled does not fail its followers: they fetch the rest themselves;
//! - a gather server reads each slice once for concurrent loads of it (4 engines, a gateway
//!   server over a slow upstream).
//!
//! The server is capped (12.5 MB/s) so that a load's time is the link's: 50 loads' copies
//! (and checksums) then need 625 MB/s of the engine's threads, not more (on a busy 2-core
//! machine, 1.25 GB/s of copies already took 1.38x a load's time).
use crate::common;
use crate::fault_proxy;
use crate::gather_util;

use common::shared_rt as rt;
use common::{save_prefix, start_load, unique_ns};
use fault_proxy::{Fault, FaultProxy};
use gather_util::{config, start};
use objectcache::connector::{Engine, EngineConfig, LoadHandle};
use objectcache::server::ServerHandle;
use objectcache::store::MemoryStore;
use objectcache::{ChunkHash, Dtype, KvGeometry};
use std::sync::Arc;
use std::time::Instant;

const CAP: u64 = 12_500_000;

/// 16 layers x 32 KiB slices: 512 KiB per chunk, 20 MiB for 40 chunks.
fn geometry() -> KvGeometry {
    KvGeometry::new("traffic/flight", 16, 1, 32, Dtype::Fp16).unwrap()
}

struct Fixture {
    server: ServerHandle,
    engine: Engine,
    g: KvGeometry,
    hashes: Vec<ChunkHash>,
    data: Vec<Vec<u8>>,
}

/// A capped `fifo` server, an engine on it (settings `pairs`) and a prefix of `chunks` chunks
/// it saved; warmed up by a checked load of 2 chunks (which opens the engine's connections).
fn fixture(chunks: usize, pairs: &[(&str, &str)]) -> Fixture {
    let mut cfg = config();
    cfg.bandwidth_cap_bytes_per_s = CAP;
    cfg.scheduler = "fifo".into();
    let server = rt().block_on(start(Arc::new(MemoryStore::new()), cfg));
    let store = rt().block_on(gather_util::s3_store_on(&server.endpoint()));
    let engine = crate::common::engine_with(store, &unique_ns("flight"), pairs);
    let g = geometry();
    let (hashes, data) = save_prefix(&engine, &g, chunks, 41);
    let f = Fixture {
        server,
        engine,
        g,
        hashes,
        data,
    };
    f.check(&f.load(2), 2, "warm-up");
    f
}

impl Fixture {
    fn load(&self, chunks: usize) -> LoadHandle {
        let n = chunks * self.g.slice_bytes() as usize;
        start_load(&self.engine, &self.g, self.hashes[..chunks].to_vec(), n)
    }

    /// Waits for every layer of a load of the first `chunks` chunks and compares every byte;
    /// returns the load's time to its last layer (s).
    fn check(&self, h: &LoadHandle, chunks: usize, what: &str) -> f64 {
        let n = chunks * self.g.slice_bytes() as usize;
        crate::common::assert_layers_landed(h, &self.data, n, what);
        h.stats().ttll_s.unwrap()
    }

    fn sent(&self) -> u64 {
        self.server.metrics().bytes_total("gather_out")
    }

    fn stop(self) {
        let Fixture { server, engine, .. } = self;
        drop(engine);
        rt().block_on(server.shutdown());
    }
}

#[test]
fn fifty_loads_of_one_prefix_share_one_fetch() {
    let _alone = crate::alone();
    // One load alone (after the fixture's warm-up, which opened the engine's connections).
    let f = fixture(40, &[]);
    let one = 40 * f.g.slice_bytes() * f.g.layers as u64;
    let b0 = f.sent();
    let alone = f.check(&f.load(40), 40, "alone");
    assert_eq!(f.sent() - b0, one);
    let b0 = f.sent();
    let followed0 = f.engine.metrics().loads_followed;
    let t0 = Instant::now();
    let hs: Vec<LoadHandle> = (0..50).map(|_| f.load(40)).collect();
    let mut slowest: f64 = 0.0;
    for (i, h) in hs.iter().enumerate() {
        f.check(h, 40, &format!("load {i} of 50"));
        slowest = slowest.max(h.stats().ttll_s.unwrap());
    }
    let wall = t0.elapsed().as_secs_f64();
    let moved = f.sent() - b0;
    let followed = f.engine.metrics().loads_followed - followed0;
    println!(
        "FLIGHT|50 loads of one 40-chunk prefix ({:.1} MB each)|{:.2}x the bytes of one load, {followed} followed|slowest {slowest:.3} s = {:.2}x one load alone ({alone:.3} s); all 50 done in {wall:.3} s",
        one as f64 / 1e6,
        moved as f64 / one as f64,
        slowest / alone
    );
    assert!(
        moved as f64 <= 1.1 * one as f64,
        "moved {moved} bytes for loads of {one}"
    );
    // The goal (the slowest of the 50 within 1.3x one load alone) is a time: it is
    // printed above, not asserted (a loaded machine stretches times, not counts). What makes
    // it hold is asserted: 49 loads followed the first one's fetch.
    assert_eq!(followed, 49, "loads that followed the first one's fetch");
    // Off: every load fetches (the comparison the goal is about).
    drop(hs);
    f.stop();
}

#[test]
fn a_follower_of_fewer_chunks_waits_for_nothing_more() {
    let _alone = crate::alone();
    let f = fixture(40, &[]);
    let leader = f.load(40);
    let follower = f.load(20);
    f.check(&follower, 20, "follower of 20 chunks");
    f.check(&leader, 40, "leader");
    assert_eq!(f.engine.metrics().loads_followed, 1);
    assert_eq!(follower.stats().requests, 0, "the follower fetched nothing");
    let (lr, fr) = (leader.layer_ready_s(), follower.layer_ready_s());
    for l in 0..f.g.layers as usize {
        let (a, b) = (lr[l].unwrap(), fr[l].unwrap());
        assert!(
            b <= a + 0.05,
            "layer {l}: the follower had it at {b:.3} s, the leader at {a:.3} s"
        );
    }
    println!(
        "FLIGHT|a follower of 20 of the leader's 40 chunks|last layer at {:.3} s, the leader's at {:.3} s",
        fr.last().unwrap().unwrap(),
        lr.last().unwrap().unwrap()
    );
    drop((leader, follower));
    f.stop();
}

#[test]
fn a_cancelled_leader_does_not_fail_its_followers() {
    let _alone = crate::alone();
    let f = fixture(40, &[]);
    let leader = f.load(40);
    let followers: Vec<LoadHandle> = (0..3).map(|_| f.load(40)).collect();
    leader.wait_layer_blocking(2, None).unwrap();
    leader.cancel();
    assert!(
        leader.wait_layer_blocking(15, None).is_err(),
        "the leader was cancelled"
    );
    for (i, h) in followers.iter().enumerate() {
        f.check(h, 40, &format!("follower {i} of a cancelled leader"));
        assert!(
            h.stats().requests >= 1,
            "follower {i} fetched the rest itself"
        );
    }
    // And a dropped leader, the same.
    let leader = f.load(40);
    let follower = f.load(40);
    leader.wait_layer_blocking(1, None).unwrap();
    drop(leader);
    f.check(&follower, 40, "follower of a dropped leader");
    println!("FLIGHT|cancelled and dropped leaders|every follower completed byte-exact");
    drop(followers);
    f.stop();
}

#[test]
fn single_flight_off_fetches_every_load() {
    let _alone = crate::alone();
    let f = fixture(8, &[("single_flight", "off")]);
    let one = 8 * f.g.slice_bytes() * f.g.layers as u64;
    let b0 = f.sent();
    let hs: Vec<LoadHandle> = (0..4).map(|_| f.load(8)).collect();
    for (i, h) in hs.iter().enumerate() {
        f.check(h, 8, &format!("load {i}"));
    }
    assert_eq!(f.sent() - b0, 4 * one, "four fetches");
    assert_eq!(f.engine.metrics().loads_followed, 0);
    drop(hs);
    f.stop();
}

/// The gather server reads each slice once for concurrent loads of it: a gateway server over
/// an upstream S3 store (through a proxy that makes each read take a few ms) serves 4
/// engines loading the same 8-chunk prefix at once; the upstream sees about one load's slice
/// reads, not four (reads in flight are joined, `server/reads.rs`).
#[test]
fn the_gateway_server_reads_each_slice_once_for_concurrent_loads() {
    let _alone = crate::alone();
    let g = geometry();
    let upstream = rt().block_on(start(Arc::new(MemoryStore::new()), config()));
    let proxy = FaultProxy::http(upstream.local_addr(), |r| {
        if r.method == "GET" && r.range.is_some() {
            Fault::Drip {
                bytes: 8 << 10,
                every: std::time::Duration::from_millis(2),
            }
        } else {
            Fault::Pass
        }
    });
    let backend = rt().block_on(gather_util::s3_store_on(&proxy.url()));
    let gateway = rt().block_on(start(backend, config()));
    let ns = unique_ns("gateway");
    let engine = || {
        let store = rt().block_on(gather_util::s3_store_on(&gateway.endpoint()));
        Engine::with_store(
            store,
            EngineConfig {
                namespace: ns.clone(),
                ..Default::default()
            },
        )
        .unwrap()
    };
    let engines: Vec<Engine> = (0..4).map(|_| engine()).collect();
    let (hs, data) = save_prefix(&engines[0], &g, 8, 43);
    // Warm every engine's connections on another prefix.
    let (warm, _) = save_prefix(&engines[0], &g, 1, 44);
    for e in &engines {
        let h = start_load(e, &g, warm.clone(), g.slice_bytes() as usize);
        h.wait_all_blocking().unwrap();
    }
    proxy.clear_log();
    // The upstream reads wait at the proxy until all four loads have asked for every read in
    // flight: then the loads move in step whatever the machine's timing (on a busy 2-core
    // machine, two loads once ran to the end before the other two reached the gateway).
    let m = gateway.metrics();
    let (r0, j0) = (
        m.requests_total("backend_read"),
        m.requests_total("backend_read_joined"),
    );
    proxy.hold();
    let handles: Vec<LoadHandle> = engines
        .iter()
        .map(|e| start_load(e, &g, hs.clone(), 8 * g.slice_bytes() as usize))
        .collect();
    common::eventually(
        "all four loads ask for every upstream read in flight",
        std::time::Duration::from_secs(30),
        || {
            let reads = m.requests_total("backend_read") - r0;
            reads > 0 && m.requests_total("backend_read_joined") - j0 >= 3 * reads
        },
    );
    proxy.release();
    for (i, h) in handles.iter().enumerate() {
        crate::common::assert_layers_landed(h, &data, data[0].len(), &format!("engine {i}"));
    }
    // Slice reads (ranges past the 64-byte header) seen upstream.
    let slice_gets = proxy
        .requests()
        .iter()
        .filter(|r| {
            r.method == "GET"
                && r.range
                    .as_deref()
                    .is_some_and(|x| !x.starts_with("bytes=0-"))
        })
        .count();
    let one_load = 8 * g.layers as usize;
    let text = m.encode();
    println!(
        "FLIGHT|4 engines load one 8-chunk prefix through a gateway server at once|{slice_gets} upstream slice reads for {} slices asked ({one_load} per load)",
        4 * one_load
    );
    assert!(text.contains("backend_read_joined"), "no read was joined");
    assert!(
        slice_gets <= one_load * 3 / 2,
        "{slice_gets} upstream slice reads for one load's {one_load}"
    );
    drop(handles);
    drop(engines);
    rt().block_on(gateway.shutdown());
    drop(proxy);
    rt().block_on(upstream.shutdown());
}

/// Issue 42, part 1: the engines of one process opened on the same store URL share their
/// loads in flight and their lookup cache (`connector/shared.rs`).
/// - 48 loads of one 40-chunk prefix, spread over 4 such engines, move at most 1.1x one
///   load's bytes (the server's own `gather_out`), 47 of them following the first; before,
///   each engine fetched for itself.
/// - A lookup's cached miss in one engine is cleared by another engine's save (vLLM's
///   scheduler and worker in one process: the request after a save hit at once).
/// - Dropping the engine that leads a load does not fail its follower in another engine.
///
/// The engines read their credentials from the environment, as a user's do
/// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, set in CI for Ceph RGW); the test server
/// takes the same key.
#[test]
fn engines_on_one_store_url_share_fetches_and_lookups() {
    let _alone = crate::alone();
    let (Ok(ak), Ok(sk)) = (
        std::env::var("AWS_ACCESS_KEY_ID"),
        std::env::var("AWS_SECRET_ACCESS_KEY"),
    ) else {
        assert!(
            std::env::var_os("OBJECTCACHE_REQUIRE_ALL").is_none(),
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY unset but OBJECTCACHE_REQUIRE_ALL is set"
        );
        eprintln!("skipped: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY unset");
        return;
    };
    let mut cfg = config();
    cfg.access_keys = vec![objectcache::server::AccessKey {
        access_key: ak,
        secret_key: sk,
    }];
    cfg.bandwidth_cap_bytes_per_s = CAP;
    cfg.scheduler = "fifo".into();
    let server = rt().block_on(start(Arc::new(MemoryStore::new()), cfg));
    let url = format!(
        "s3://{}?endpoint={}&region=us-east-1",
        gather_util::BUCKET,
        server.endpoint()
    );
    let ns = unique_ns("shared-engines");
    let engine = || {
        Engine::new(
            EngineConfig::from_pairs([
                ("store", url.as_str()),
                ("namespace", ns.as_str()),
                ("self_check", "off"),
            ])
            .unwrap(),
        )
        .unwrap()
    };
    let engines: Vec<Engine> = (0..4).map(|_| engine()).collect();
    let g = geometry();
    let (hs, data) = save_prefix(&engines[0], &g, 40, 45);
    let n = |chunks: usize| chunks * g.slice_bytes() as usize;
    for (i, e) in engines.iter().enumerate() {
        let h = start_load(e, &g, hs[..2].to_vec(), n(2));
        crate::common::assert_layers_landed(&h, &data, n(2), &format!("warm-up {i}"));
    }
    let sent = || server.metrics().bytes_total("gather_out");
    let followed = |es: &[Engine]| -> u64 { es.iter().map(|e| e.metrics().loads_followed).sum() };

    // Fetches: 48 loads over 4 engines.
    let one = (n(40) * g.layers as usize) as u64;
    let (b0, f0) = (sent(), followed(&engines));
    let loads: Vec<LoadHandle> = (0..48)
        .map(|i| start_load(&engines[i % 4], &g, hs.clone(), n(40)))
        .collect();
    for (i, h) in loads.iter().enumerate() {
        crate::common::assert_layers_landed(h, &data, n(40), &format!("load {i} of 48"));
    }
    let moved = sent() - b0;
    let fol = followed(&engines) - f0;
    println!(
        "FLIGHT|48 loads of one 40-chunk prefix over 4 engines on one store URL|{:.2}x the bytes of one load, {fol} followed",
        moved as f64 / one as f64
    );
    assert!(
        moved as f64 <= 1.1 * one as f64,
        "moved {moved} bytes for loads of {one}"
    );
    assert_eq!(fol, 47, "loads that followed the first one's fetch");
    drop(loads);

    // Lookups: engine 1's cached miss, then engine 0's save of the same chunks.
    let (hs2, data2) = crate::common::seeded_prefix(&g, 2, 46);
    assert_eq!(engines[1].lookup_blocking(&g, &hs2).unwrap(), 0);
    let refs: Vec<&[u8]> = data2.iter().map(|v| v.as_slice()).collect();
    engines[0].save_blocking(&g, &hs2, &refs).unwrap();
    let probes = engines[1].metrics().lookup_probes;
    assert_eq!(engines[1].lookup_blocking(&g, &hs2).unwrap(), 2);
    assert_eq!(
        engines[1].metrics().lookup_probes,
        probes,
        "the save's markers were known without asking the store"
    );

    // A leader's engine dropped mid-load: its follower in another engine completes.
    let mut engines = engines;
    let leader = start_load(&engines[3], &g, hs.clone(), n(40));
    let follower = start_load(&engines[2], &g, hs.clone(), n(40));
    leader.wait_layer_blocking(1, None).unwrap();
    let leader_engine = engines.pop().unwrap();
    drop(leader_engine);
    crate::common::assert_layers_landed(&follower, &data, n(40), "follower of a dropped engine");
    assert!(
        follower.stats().requests >= 1,
        "the follower fetched the rest itself"
    );
    println!("FLIGHT|a leader's engine dropped mid-load|its follower in another engine completed byte-exact");
    drop((leader, follower));
    drop(engines);
    rt().block_on(server.shutdown());
}
