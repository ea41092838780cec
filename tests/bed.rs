//! Tests on the multi-host bed of `scripts/bed/bed.sh`: a Ceph cluster (one monitor, three
//! memstore OSDs on hosts of their own keeping three replicas, two RGWs), three ObjectCache
//! gateways over it, and a client host, each a network namespace.
//!
//! The bed is found through `OBJECTCACHE_TEST_BED` (its state directory; default
//! `/tmp/objectcache-bed`), whose `bed.env` names the hosts. Without a bed every test prints
//! SKIP, and fails instead when `OBJECTCACHE_REQUIRE_ALL` is set (as in `.ci/run`, which
//! starts the bed). Each test runs its body on the client host: the test re-runs itself
//! there (`ip netns exec CLIENT ...`), so every socket it opens is the client's. Tests that
//! stop a gateway or an OSD start it again before they end, and hold a lock so that they
//! run one at a time.
#![cfg(all(feature = "s3", feature = "server"))]

mod common;

use common::{hashes, kv, save_prefix, seeded_prefix, shared_rt as rt, unique_ns};
use objectcache::connector::{
    ChunkStatus, Engine, EngineConfig, LayerBuffers, LoadHandle, LoadRequest,
};
use objectcache::sched::placement::{route_key, Placement};
use objectcache::store::{GatewayOptions, GatewayStore, S3Config, S3Credentials, S3Store};
use objectcache::{ChunkHash, KvGeometry, LayerError};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Set in the re-run on the client host.
const INSIDE: &str = "OBJECTCACHE_BED_CLIENT";

/// The bed's `bed.env`.
struct Bed {
    env: HashMap<String, String>,
}

impl Bed {
    fn get(&self, k: &str) -> &str {
        self.env
            .get(k)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("bed.env has no {k}"))
    }

    fn gateways(&self) -> Vec<String> {
        self.get("GATEWAYS")
            .split(',')
            .map(str::to_string)
            .collect()
    }

    /// Runs `bed.sh ARGS` (stop or start a gateway or an OSD); it returns once the change
    /// took effect (a started gateway answers its health check, a stopped OSD is marked down).
    fn control(&self, args: &[&str]) {
        let out = Command::new("bash")
            .arg(self.get("BED_SCRIPT"))
            .args(args)
            .env("BED_DIR", self.get("BED_DIR"))
            .env("BED_NAME", self.get("BED_NAME"))
            .env("OBJECTCACHE_BIN", self.get("OBJECTCACHE_BIN"))
            .env("BED_GW_CAP", self.get("GATEWAY_CAP"))
            .output()
            .expect("bed.sh runs");
        common::assert_exited_ok(&out, &format!("bed.sh {args:?}: "));
    }

    /// Kills gateway `n` (1..3) with SIGKILL (no grace, sockets reset) and returns once the
    /// process is gone, so that a `gw-start` right after it finds the gateway stopped.
    fn kill_gateway(&self, n: usize) {
        self.control(&["gw-stop", &n.to_string()]);
    }
}

fn bed_dir() -> PathBuf {
    std::env::var_os("OBJECTCACHE_TEST_BED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/objectcache-bed"))
}

fn read_bed() -> Option<Bed> {
    let text = std::fs::read_to_string(bed_dir().join("bed.env")).ok()?;
    let env = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect::<HashMap<_, _>>();
    // A bed.env left behind by a bed that is gone: its client namespace no longer exists.
    let ns = env.get("CLIENT_NS")?;
    std::path::Path::new("/run/netns")
        .join(ns)
        .exists()
        .then_some(Bed { env })
}

/// Serialises the tests of this file (they share one bed and stop parts of it).
static BED_LOCK: Mutex<()> = Mutex::new(());

/// On the client host (inside the re-run): the bed. Outside: re-runs `test` on the client
/// host, prints its output, fails if it failed, and returns `None`; or prints SKIP (fails
/// under `OBJECTCACHE_REQUIRE_ALL`) when there is no bed.
fn on_client_host(test: &str) -> Option<Bed> {
    if std::env::var_os(INSIDE).is_some() {
        return Some(read_bed().expect("bed.env inside the client host"));
    }
    let Some(bed) = read_bed() else {
        assert!(
            std::env::var_os("OBJECTCACHE_REQUIRE_ALL").is_none(),
            "{test}: no test bed at {} (scripts/bed/bed.sh start) and OBJECTCACHE_REQUIRE_ALL is set",
            bed_dir().display()
        );
        println!(
            "SKIP {test}: no test bed at {} (start one with scripts/bed/bed.sh start)",
            bed_dir().display()
        );
        return None;
    };
    let _one_at_a_time = BED_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // A test that failed between stopping a gateway or an OSD and starting it again must not
    // fail the tests after it: each starts on a whole bed.
    bed.control(&["heal"]);
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("ip")
        .args(["netns", "exec", bed.get("CLIENT_NS")])
        .arg(exe)
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(INSIDE, "1")
        .env("OBJECTCACHE_TEST_BED", bed_dir())
        .output()
        .expect("ip netns exec runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "--- {test} on the client host ({}):\n{text}",
        bed.get("CLIENT_NS")
    );
    assert!(out.status.success(), "{test} failed on the client host");
    assert!(
        text.contains("1 passed"),
        "{test} did not run on the client host"
    );
    None
}

impl Bed {
    /// Settings of the gateways' bucket with the bed's keys.
    fn base(&self) -> S3Config {
        let mut c = S3Config::new(self.get("GATEWAY_BUCKET"));
        c.region = Some("us-east-1".into());
        c.credentials = S3Credentials::Static {
            access_key: self.get("ACCESS_KEY").into(),
            secret_key: self.get("SECRET_KEY").into(),
            session_token: None,
        };
        c
    }

    /// An engine over one gateway.
    fn engine_on(&self, endpoint: &str, ns: &str) -> Engine {
        let mut c = self.base();
        c.endpoint = Some(endpoint.to_string());
        let store = rt().block_on(S3Store::new(c)).unwrap();
        Engine::with_store(Arc::new(store), config(ns)).unwrap()
    }

    /// An engine over the three gateways, and its gateway set.
    fn engine_on_set(&self, ns: &str, placement: Placement) -> (Engine, Arc<GatewayStore>) {
        let opts = GatewayOptions {
            placement,
            health_interval: Duration::from_millis(200),
        };
        let store = Arc::new(
            rt().block_on(GatewayStore::new(self.base(), self.gateways(), opts))
                .unwrap(),
        );
        (
            Engine::with_store(store.clone(), config(ns)).unwrap(),
            store,
        )
    }
}

fn config(ns: &str) -> EngineConfig {
    EngineConfig {
        namespace: ns.to_string(),
        ..EngineConfig::default()
    }
}

fn start_load(e: &Engine, g: &KvGeometry, hs: &[ChunkHash], per_layer: usize) -> LoadHandle {
    e.load(
        LoadRequest::new(g.clone(), hs.to_vec()),
        LayerBuffers::allocate(g.layers as usize, per_layer),
    )
    .unwrap()
}

/// Waits for every layer and checks every byte against `data`.
fn check(h: &LoadHandle, data: &[Vec<u8>], what: &str) {
    h.wait_all_blocking()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    for (l, d) in data.iter().enumerate() {
        assert_eq!(h.layer(l).unwrap(), &d[..], "{what}: layer {l}");
    }
    assert!(
        h.chunk_status().iter().all(|s| *s == ChunkStatus::Ok),
        "{what}"
    );
}

#[test]
fn loads_through_every_gateway_are_byte_exact() {
    let Some(bed) = on_client_host("loads_through_every_gateway_are_byte_exact") else {
        return;
    };
    let g = KvGeometry::smollm2_135m();
    let ns = unique_ns("bed-every");
    let gws = bed.gateways();
    // Saved through each gateway, loaded through every gateway (gather) and through the
    // gateway set: the same bytes everywhere.
    for (i, via) in gws.iter().enumerate() {
        let (hs, data) = save_prefix(&bed.engine_on(via, &ns), &g, 4, 300 + i as u64);
        for from in &gws {
            let e = bed.engine_on(from, &ns);
            assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), hs.len());
            let what = format!("saved via {via}, loaded via {from}");
            check(&start_load(&e, &g, &hs, data[0].len()), &data, &what);
        }
    }
    let (set, _) = bed.engine_on_set(&ns, Placement::default());
    let (hs, data) = save_prefix(&set, &g, 4, 400);
    check(
        &start_load(&set, &g, &hs, data[0].len()),
        &data,
        "the gateway set",
    );
    // A DNS name with the three gateways' addresses (the client host's hosts file).
    let mut base = bed.base();
    let name = bed.get("GATEWAYS_DNS").to_string();
    base.endpoint = Some(name.clone());
    let dns = rt()
        .block_on(GatewayStore::resolve_all(
            base,
            name,
            GatewayOptions::default(),
        ))
        .unwrap();
    assert_eq!(dns.endpoints().len(), 3, "{:?}", dns.endpoints());
    let e = Engine::with_store(Arc::new(dns), config(&ns)).unwrap();
    check(
        &start_load(&e, &g, &hs, data[0].len()),
        &data,
        "gateways.bed, every address",
    );
}

/// Gather loads a gateway has served, from its metrics (`GET /_objectcache/metrics`).
fn gather_loads(endpoint: &str) -> u64 {
    let addr = endpoint.trim_start_matches("http://");
    let text = rt().block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "GET /_objectcache/metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        String::from_utf8_lossy(&out).to_string()
    });
    text.lines()
        .find(|l| l.starts_with("objectcache_server_requests_total{op=\"gather\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

/// The gateway (1-based, as bed.sh numbers them) that a load of `hs` goes to first.
fn first_gateway(bed: &Bed, set: &GatewayStore, hs: &[ChunkHash]) -> usize {
    let addr = set.gateways().route(route_key(hs[0].as_bytes()))[0]
        .addr
        .clone();
    1 + bed
        .gateways()
        .iter()
        .position(|e| e.ends_with(&addr))
        .expect("a gateway of the bed")
}

/// When the engine finishes a prefill that computes each layer for `c` seconds once its KV
/// is ready (layer `l` starts when layer `l` is ready and layer `l-1` is computed).
fn finish(ready: &[Option<f64>], c: f64) -> f64 {
    ready
        .iter()
        .fold(0.0, |t, r| t.max(r.expect("every layer ready")) + c)
}

#[test]
fn a_load_fails_over_when_its_gateway_is_killed_mid_load() {
    let Some(bed) = on_client_host("a_load_fails_over_when_its_gateway_is_killed_mid_load") else {
        return;
    };
    let g = KvGeometry::smollm2_135m();
    let ns = unique_ns("bed-failover");
    let (e, set) = bed.engine_on_set(&ns, Placement::Hash);
    // 16 chunks, 94 MB: about a second at a gateway's 100 MB/s share.
    let chunks = 16;
    let (hs, data) = save_prefix(&e, &g, chunks, 500);
    let victim = first_gateway(&bed, &set, &hs);
    let per_layer = data[0].len();
    // The same load without a failure (the second of two, on warm connections).
    let mut base = Vec::new();
    for _ in 0..2 {
        let h = start_load(&e, &g, &hs, per_layer);
        check(&h, &data, "baseline");
        base = h.layer_ready_s();
    }
    let h = start_load(&e, &g, &hs, per_layer);
    let t0 = Instant::now();
    h.wait_layer_blocking(3, None).unwrap();
    assert!(
        h.stats().ttll_s.is_none(),
        "the load still runs when its gateway dies"
    );
    bed.kill_gateway(victim);
    let killed_at = t0.elapsed().as_secs_f64();
    check(&h, &data, "the load whose gateway was killed");
    let st = h.stats();
    assert!(st.failovers >= 1, "{st:?}");
    let ready = h.layer_ready_s();
    let after_kill = ready
        .iter()
        .flatten()
        .copied()
        .filter(|&t| t > killed_at)
        .fold(f64::INFINITY, f64::min);
    let ttll = |r: &[Option<f64>]| r.iter().flatten().copied().fold(0.0, f64::max);
    // TTFT as an engine that computes each layer in the time the baseline needed to load
    // one (loading exactly hidden behind compute) would see it.
    let c = ttll(&base) / g.layers as f64;
    println!(
        "FIGURE bed-failover: gateway {victim} killed {:.3} s into a {} MB load ({} layers): next layer ready {:.3} s after the kill; load {:.3} s (baseline {:.3} s, +{:.3} s); TTFT with {:.1} ms/layer compute {:.3} s (baseline {:.3} s, +{:.3} s); failovers {}",
        killed_at,
        chunks as u64 * g.slice_bytes() * g.layers as u64 / 1_000_000,
        g.layers,
        after_kill - killed_at,
        ttll(&ready),
        ttll(&base),
        ttll(&ready) - ttll(&base),
        c * 1e3,
        finish(&ready, c),
        finish(&base, c),
        finish(&ready, c) - finish(&base, c),
        st.failovers
    );
    drop(h);
    // While it is down its loads go elsewhere; started again, it serves them again.
    assert!(!set.endpoints()[victim - 1].up);
    check(
        &start_load(&e, &g, &hs, per_layer),
        &data,
        "with the gateway down",
    );
    bed.control(&["gw-start", &victim.to_string()]);
    common::eventually(
        "the gateway is seen up again",
        Duration::from_secs(30),
        || set.endpoints()[victim - 1].up,
    );
    let h = start_load(&e, &g, &hs, per_layer);
    check(&h, &data, "after the gateway came back");
    assert_eq!(h.stats().failovers, 0);
    assert!(
        gather_loads(&bed.gateways()[victim - 1]) >= 1,
        "the restarted gateway serves its prefix"
    );
}

#[test]
fn a_gateway_restart_drains_its_loads_and_serves_again() {
    let Some(bed) = on_client_host("a_gateway_restart_drains_its_loads_and_serves_again") else {
        return;
    };
    let g = KvGeometry::smollm2_135m();
    let ns = unique_ns("bed-restart");
    let (e, set) = bed.engine_on_set(&ns, Placement::Hash);
    // A prefix whose first gateway is gateway 2.
    let (hs, data) = (0..64)
        .map(|s| {
            let hs = hashes(&g, 8 * g.tokens_per_chunk as usize, 700 + s);
            (hs, 700 + s as u64)
        })
        .find(|(hs, _)| first_gateway(&bed, &set, hs) == 2)
        .map(|(hs, seed)| {
            let data = kv(&g, 8, seed);
            let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            e.save_blocking(&g, &hs, &refs).unwrap();
            (hs, data)
        })
        .expect("some prefix goes to gateway 2 first");
    let per_layer = data[0].len();
    // A graceful stop in the middle of a load: the load finishes (within the grace) or
    // continues elsewhere; byte-exact either way.
    let h = start_load(&e, &g, &hs, per_layer);
    h.wait_layer_blocking(1, None).unwrap();
    bed.control(&["gw-stop", "2", "--term"]);
    check(&h, &data, "the load in flight at the stop");
    drop(h);
    check(
        &start_load(&e, &g, &hs, per_layer),
        &data,
        "while gateway 2 is stopped",
    );
    bed.control(&["gw-start", "2"]);
    common::eventually(
        "gateway 2 is seen up again",
        Duration::from_secs(30),
        || set.endpoints()[1].up,
    );
    check(
        &start_load(&e, &g, &hs, per_layer),
        &data,
        "after the restart",
    );
    assert!(
        gather_loads(&bed.gateways()[1]) >= 1,
        "the restarted gateway serves its prefix"
    );
}

#[test]
fn losing_an_osd_while_loads_run_loses_nothing() {
    let Some(bed) = on_client_host("losing_an_osd_while_loads_run_loses_nothing") else {
        return;
    };
    // Ceph's replication is what keeps the data: three copies, one per OSD host.
    let out = Command::new("bash")
        .arg(bed.get("BED_SCRIPT"))
        .args([
            "exec",
            "mon1",
            "ceph",
            "osd",
            "pool",
            "get",
            "default.rgw.buckets.data",
            "size",
        ])
        .env("BED_DIR", bed.get("BED_DIR"))
        .env("BED_NAME", bed.get("BED_NAME"))
        .env("CEPH_CONF", format!("{}/ceph.conf", bed.get("BED_DIR")))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "size: 3");
    let g = KvGeometry::smollm2_135m();
    let ns = unique_ns("bed-osd");
    let (e, _) = bed.engine_on_set(&ns, Placement::TwoChoice);
    let prefixes: Vec<_> = (0..4).map(|s| save_prefix(&e, &g, 4, 800 + s)).collect();
    let done = std::sync::atomic::AtomicU64::new(0);
    let missed = std::sync::atomic::AtomicU64::new(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    use std::sync::atomic::Ordering::SeqCst;
    std::thread::scope(|s| {
        let loads = s.spawn(|| {
            let mut i = 0;
            while !stop.load(SeqCst) {
                let (hs, data) = &prefixes[i % prefixes.len()];
                let h = start_load(&e, &g, hs, data[0].len());
                match h.wait_all_blocking() {
                    Ok(()) => {
                        check(&h, data, "a load around the OSD loss");
                        done.fetch_add(1, SeqCst);
                    }
                    // A read in flight on a placement group whose primary OSD was killed
                    // waits until the monitor marks the OSD down and the group peers again:
                    // on a busy machine that can pass the engine's stall limit (1 s). The
                    // load is then a clean miss, never bytes: what did land is exact.
                    Err(err @ (LayerError::Stalled { .. } | LayerError::Timeout { .. })) => {
                        for (l, d) in data.iter().enumerate() {
                            if let Some(b) = h.layer(l) {
                                assert_eq!(b, &d[..], "a missed load's ready layer {l}");
                            }
                        }
                        eprintln!("a load around the OSD loss missed: {err}");
                        missed.fetch_add(1, SeqCst);
                    }
                    Err(err) => panic!("a load around the OSD loss: {err}"),
                }
                i += 1;
            }
        });
        common::eventually("loads run", Duration::from_secs(30), || {
            done.load(SeqCst) >= 4
        });
        bed.control(&["osd-stop", "2"]);
        let at_loss = done.load(SeqCst);
        // Loads go on with one OSD down, and a new prefix is saved and read back.
        let (hs, data) = save_prefix(&e, &g, 4, 900);
        check(
            &start_load(&e, &g, &hs, data[0].len()),
            &data,
            "saved with an OSD down",
        );
        common::eventually(
            "loads complete with the OSD down",
            Duration::from_secs(30),
            || done.load(SeqCst) >= at_loss + 8,
        );
        // Nothing was lost: with the OSD still down, every prefix loads byte-exact.
        for (n, (hs, data)) in prefixes.iter().enumerate() {
            check(
                &start_load(&e, &g, hs, data[0].len()),
                data,
                &format!("prefix {n} with the OSD down"),
            );
        }
        bed.control(&["osd-start", "2"]);
        stop.store(true, SeqCst);
        loads.join().expect("no load failed");
    });
    println!(
        "FIGURE bed-osd-loss: {} loads byte-exact, {} missed (stalled past the limit while the OSD was lost)",
        done.load(SeqCst),
        missed.load(SeqCst)
    );
}

#[test]
fn two_clients_saving_one_prefix_through_two_gateways_first_writer_wins() {
    let Some(bed) =
        on_client_host("two_clients_saving_one_prefix_through_two_gateways_first_writer_wins")
    else {
        return;
    };
    let g = KvGeometry::smollm2_135m();
    let ns = unique_ns("bed-race");
    let gws = bed.gateways();
    let chunks = 8;
    let hs = hashes(&g, chunks * g.tokens_per_chunk as usize, 1000);
    // Different bytes under the same keys: which writer won each chunk is visible.
    let (a, b) = (kv(&g, chunks, 1), kv(&g, chunks, 2));
    let (ea, eb) = (bed.engine_on(&gws[0], &ns), bed.engine_on(&gws[1], &ns));
    let barrier = std::sync::Barrier::new(2);
    let save = |e: &Engine, d: &Vec<Vec<u8>>| {
        let refs: Vec<&[u8]> = d.iter().map(|v| v.as_slice()).collect();
        barrier.wait();
        e.save_blocking(&g, &hs, &refs).unwrap()
    };
    let (ra, rb) = std::thread::scope(|s| {
        let ta = s.spawn(|| save(&ea, &a));
        let tb = s.spawn(|| save(&eb, &b));
        (ta.join().unwrap(), tb.join().unwrap())
    });
    assert_eq!(ra.written + ra.already_present, chunks);
    assert_eq!(rb.written + rb.already_present, chunks);
    assert_eq!(
        ra.written + rb.written,
        chunks,
        "each chunk written once: {ra:?} {rb:?}"
    );
    // Read through the third gateway: every chunk whole, all of one writer's bytes.
    let e = bed.engine_on(&gws[2], &ns);
    assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), chunks);
    let h = start_load(&e, &g, &hs, a[0].len());
    h.wait_all_blocking().unwrap();
    let slice = g.slice_bytes() as usize;
    let mut by = [0usize; 2];
    for c in 0..chunks {
        let part = |d: &Vec<Vec<u8>>| {
            (0..g.layers as usize).all(|l| {
                h.layer(l).unwrap()[c * slice..(c + 1) * slice] == d[l][c * slice..(c + 1) * slice]
            })
        };
        match (part(&a), part(&b)) {
            (true, false) => by[0] += 1,
            (false, true) => by[1] += 1,
            other => panic!("chunk {c} is torn or mixed: {other:?}"),
        }
    }
    assert_eq!(
        (by[0], by[1]),
        (ra.written, rb.written),
        "the bytes are those of the writer that wrote each chunk"
    );
}

#[test]
fn a_gateway_killed_mid_save_leaves_no_torn_prefix() {
    let Some(bed) = on_client_host("a_gateway_killed_mid_save_leaves_no_torn_prefix") else {
        return;
    };
    let g = KvGeometry::smollm2_135m();
    let ns = unique_ns("bed-save-kill");
    let (e, set) = bed.engine_on_set(&ns, Placement::Hash);
    let chunks = 24;
    let (hs, data) = seeded_prefix(&g, chunks, 1100);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    let saved = std::thread::scope(|s| {
        let t = s.spawn(|| e.save_blocking(&g, &hs, &refs));
        // Gateway 1 dies once it has taken part of the save.
        common::eventually(
            "gateway 1 takes part in the save",
            Duration::from_secs(30),
            || set.endpoints()[0].requests >= 3,
        );
        bed.kill_gateway(1);
        t.join().unwrap()
    });
    bed.control(&["gw-start", "1"]);
    // Read back through another client: published chunks are whole, and a failed save
    // publishes nothing past what is whole.
    let reader = bed.engine_on(&bed.gateways()[2], &ns);
    let n = reader.lookup_blocking(&g, &hs).unwrap();
    match &saved {
        Ok(r) => {
            assert_eq!(
                n, chunks,
                "a save that succeeded published every chunk: {r:?}"
            );
        }
        Err(err) => println!("the save failed ({err}); {n} chunks published"),
    }
    if n > 0 {
        let slice = g.slice_bytes() as usize;
        let h = start_load(&reader, &g, &hs[..n], n * slice);
        let want: Vec<Vec<u8>> = data.iter().map(|d| d[..n * slice].to_vec()).collect();
        check(&h, &want, "the published chunks");
    }
    println!(
        "FIGURE bed-save-kill: save {}, {n} of {chunks} chunks published, gateway 1 marked down {} times",
        if saved.is_ok() { "completed" } else { "failed" },
        set.endpoints()[0].marked_down
    );
}
