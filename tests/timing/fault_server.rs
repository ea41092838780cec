//! Fault injection against the ObjectCache server itself, through the fault-injecting TCP
//! proxy on loopback (tests/common/fault_proxy/):
//!
//! - the **gather path**: the connector's one-request load streams layer-major units over the
//!   proxy in raw mode; the server-to-client stream is truncated, has a byte flipped (in the
//!   hello, in a unit header, in a payload), is reset mid-stream, stalls with the connection
//!   open, or drips slowly; and a real `objectcache serve` process is killed (SIGKILL)
//!   mid-load, then restarted on the same data;
//! - the **S3 API** of the server with gather off (ranged GETs through the proxy in HTTP
//!   mode): 500 and 503 SlowDown storms, truncated and corrupt bodies, resets, stalls.
//!
//! Every case checks the invariants of tests/integration/fault_s3.rs: every layer that becomes ready
//! holds the saved bytes (compared byte for byte), every other layer is a miss; every wait
//! returns within the load deadline (never a hang); retries are bounded; once the fault is
//! gone the same engine loads everything again (over gather where it was offered).
//!
//! Each case prints a `FAULT|server|...` line for docs/reliability.md
//! (`cargo test --release --test timing fault_server:: -- --nocapture --test-threads 1 | grep '^FAULT|'`).
#![cfg(feature = "s3")]

use crate::common;
use crate::fault_proxy;
use crate::gather_util;
use crate::s3_faults;

use bytes::BytesMut;
use common::*;
use fault_proxy::{Fault, FaultProxy, RawFault};
use gather_util::{config, spawn_serve, start, ServeProcess, ACCESS, BUCKET, SECRET};
use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadRequest};
use objectcache::protocol::{plan_units, Frame, GatherRequest, FRAME_HEADER_LEN, UNIT_HEADER_LEN};
use objectcache::server::ServerHandle;
use objectcache::store::{FsStore, FsyncPolicy, MemoryStore, Store};
use objectcache::transport::tcp::GatherClient;
use objectcache::{ChunkHash, Dtype, KvGeometry};
use s3_faults::{load_checked, s3_as, victim_case_on, Outcome};
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Runtime owning in-process servers and S3 clients for the whole test process.
fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Runtime::new().unwrap())
}

/// Two layers of 18 MiB each (18 chunks of 256 tokens, 1 MiB per slice): every layer is sent
/// as two units (16 MiB + 2 MiB), so a unit moved to a wrong offset can still land inside its
/// layer.
const CHUNKS: usize = 18;

fn geometry() -> KvGeometry {
    let mut g = KvGeometry::new("test/fault-server", 2, 8, 128, Dtype::Fp16).unwrap();
    g.tokens_per_chunk = 256;
    g
}

/// An S3 store on our server's bucket and key, with short timeouts and bounded attempts.
fn ours(url: &str) -> Arc<dyn Store> {
    s3_as(url, BUCKET, ACCESS, SECRET)
}

/// An engine with one gather stream: the fault positions below are computed for the single
/// stream of a whole load (`Rig::stream_layout`); `gather_striped_reset_is_a_miss` covers a
/// load striped over two connections.
fn engine(store: Arc<dyn Store>, ns: &str, timeout: Duration) -> Engine {
    engine_with(store, ns, timeout, 1)
}

fn engine_with(store: Arc<dyn Store>, ns: &str, timeout: Duration, streams: usize) -> Engine {
    Engine::with_store(
        store,
        EngineConfig {
            namespace: ns.to_string(),
            load_timeout: Some(timeout),
            lookup_cache_ttl: Duration::ZERO,
            gather: true,
            gather_streams: streams,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

/// A prefix saved through the server directly, and an engine reaching the server through a
/// raw fault proxy.
struct Rig {
    g: KvGeometry,
    hashes: Vec<ChunkHash>,
    data: Vec<Vec<u8>>,
    proxy: FaultProxy,
    engine: Engine,
    ns: String,
    timeout: Duration,
    /// The engines' `gather_streams`.
    streams: usize,
}

fn rig(server: SocketAddr, test: &str, seed: u64, timeout: Duration) -> Rig {
    rig_with(server, test, seed, timeout, 1)
}

fn rig_with(server: SocketAddr, test: &str, seed: u64, timeout: Duration, streams: usize) -> Rig {
    let g = geometry();
    let ns = unique_ns(test);
    let hs = hashes(&g, CHUNKS * g.tokens_per_chunk as usize, seed as u32);
    let data = kv(&g, CHUNKS, seed);
    let direct = engine(ours(&format!("http://{server}")), &ns, timeout);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    direct.save_blocking(&g, &hs, &refs).unwrap();
    let proxy = FaultProxy::raw(server, |_| RawFault::Pass);
    let engine = engine_with(ours(&proxy.url()), &ns, timeout, streams);
    // Its capabilities request and warm connection are made before any fault is armed.
    wait_until_warm(&engine);
    Rig {
        g,
        hashes: hs,
        data,
        proxy,
        engine,
        ns,
        timeout,
        streams,
    }
}

impl Rig {
    fn load_on(&self, e: &Engine, case: &str) -> Outcome {
        load_checked(e, &self.g, &self.hashes, &self.data, case)
    }

    /// A new engine through the proxy (no pooled gather connection yet).
    fn fresh_engine(&self) -> Engine {
        engine_with(
            ours(&self.proxy.url()),
            &self.ns,
            self.timeout,
            self.streams,
        )
    }

    /// Where the gather stream's frames start, as the server sends them: the authentication
    /// challenge (protocol version 2, the server has access keys), the hello, the accepted
    /// frame, then each unit's 32-byte prefix (frame and unit header) in plan order.
    fn stream_layout(&self, info: objectcache::protocol::ServerInfo) -> Layout {
        let len = |f: Frame| {
            let mut b = BytesMut::new();
            f.encode(&mut b);
            b.len() as u64
        };
        let challenge = len(Frame::AuthChallenge {
            nonce: [0; objectcache::protocol::auth::NONCE_LEN],
        });
        let hello = challenge + len(Frame::HelloAck(info));
        let accepted = len(Frame::Accepted {
            request_id: 0,
            units: 0,
            bytes: 0,
        });
        let keys = self.engine.keys(&self.g).unwrap();
        let req = GatherRequest::for_prefix(
            0,
            BUCKET,
            &keys,
            &self.g,
            self.hashes.clone(),
            vec![self.g.tokens_per_chunk; self.hashes.len()],
        );
        let mut at = hello + accepted;
        let mut units = Vec::new();
        for u in plan_units(&req) {
            units.push((at, u.offset, u.len));
            at += (FRAME_HEADER_LEN + UNIT_HEADER_LEN) as u64 + u.len;
        }
        Layout {
            challenge,
            hello,
            units,
            total: at,
        }
    }

    /// After the fault: with the proxy passing everything, the same engine loads every layer
    /// byte-exact, over gather (one request) when `gather` is set.
    fn recovers(&self, case: &str, gather: bool) {
        self.recovers_on(&self.engine, case, gather)
    }

    fn recovers_on(&self, e: &Engine, case: &str, gather: bool) {
        self.proxy.set_raw_rule(|_| RawFault::Pass);
        let o = self.load_on(e, &format!("{case}/after"));
        assert_eq!(
            o.ready, self.g.layers as usize,
            "{case}: not recovered: {o:?}"
        );
        if gather {
            // One gather request per stream (the engine's default `gather_streams`, fewer
            // than this prefix's 18 chunks); ranged GETs would be one per slice.
            assert_eq!(
                o.requests,
                e.config().gather_streams as u64,
                "{case}: the engine no longer uses gather: {o:?}"
            );
        }
    }
}

/// Positions in the server-to-client byte stream of one gather load.
#[derive(Debug)]
struct Layout {
    /// End of the authentication challenge (the hello starts here).
    challenge: u64,
    /// End of the hello.
    hello: u64,
    /// (stream position of the unit frame, destination offset, payload length)
    units: Vec<(u64, u64, u64)>,
    total: u64,
}

fn server_info(server: SocketAddr) -> objectcache::protocol::ServerInfo {
    rt().block_on(async {
        GatherClient::connect_with(server, Some((ACCESS.to_string(), SECRET.to_string())))
            .await
            .unwrap()
            .server_info()
    })
}

/// Waits until `e` knows whether gather is offered and has finished warming its pool (a
/// liveness bound of 60 s, not a speed goal), so that the next load runs on the connection
/// the engine warmed, if that one came up.
fn wait_until_warm(e: &Engine) {
    use objectcache::connector::GatherStatus;
    let t = std::time::Instant::now();
    while matches!(
        e.gather_status(),
        GatherStatus::Unknown | GatherStatus::Probing | GatherStatus::Offered { warming: true, .. }
    ) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{:?}",
            e.gather_status()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn mem_server() -> ServerHandle {
    rt().block_on(start(Arc::new(MemoryStore::new()), config()))
}

fn summary(o: &Outcome, layers: u32) -> String {
    format!(
        "{} of {layers} layers ready (byte-exact), {} missed, {} bad chunks",
        o.ready,
        o.failed,
        o.bad_chunks.len()
    )
}

/// Runs one raw fault on the gather connection of a fresh engine (the one it warms its pool
/// with, which carries its first load; later connections, such as a fallback's, pass),
/// checks the invariants, then
/// that the same engine recovers, and prints the line.
fn raw_case(r: &Rig, case: &str, fault: RawFault, expect_all_ready: bool, gather_after: bool) {
    r.proxy.clear_log();
    // A fresh engine's first connection is its capabilities request (plain HTTP); its second
    // is the gather connection it warms its pool with, which then carries the load.
    let first = r.proxy.connections() + 1;
    let f = fault.clone();
    r.proxy.set_raw_rule(move |c| {
        if c == first {
            f.clone()
        } else {
            RawFault::Pass
        }
    });
    let e = r.fresh_engine();
    wait_until_warm(&e);
    let o = r.load_on(&e, case);
    let conns = r.proxy.raw_connections();
    assert!(
        conns.iter().any(|(_, rf, _)| *rf == fault),
        "{case}: the fault was not applied: {conns:?}"
    );
    if expect_all_ready {
        assert_eq!(o.ready, r.g.layers as usize, "{case}: {o:?}");
    }
    r.recovers_on(&e, case, gather_after);
    println!(
        "FAULT|server-gather|{case}|1|{}; {} connection(s); clean reload byte-exact{}",
        summary(&o, r.g.layers),
        conns.len(),
        if gather_after { " over gather" } else { "" }
    );
}

#[test]
fn gather_truncated_stream_is_a_miss_or_fallback() {
    let _alone = crate::alone();
    let server = mem_server();
    let r = rig(server.local_addr(), "trunc", 1, Duration::from_secs(20));
    let lay = r.stream_layout(server_info(server.local_addr()));
    let u1 = lay.units[1];
    for (name, at) in [
        ("before the challenge", 0),
        ("inside the challenge", lay.challenge / 2),
        ("inside the hello", (lay.challenge + lay.hello) / 2),
        ("inside a unit header", u1.0 + 10),
        ("mid-payload", u1.0 + 40 + u1.2 / 2),
        ("one byte before the end", lay.total - 1),
    ] {
        raw_case(
            &r,
            &format!("gather stream closed {name} (byte {at} of {})", lay.total),
            RawFault::CloseAfter(at),
            false,
            true,
        );
    }
    drop(r);
    rt().block_on(server.shutdown());
}

#[test]
fn gather_flipped_bytes_never_become_kv() {
    let _alone = crate::alone();
    let server = mem_server();
    let r = rig(server.local_addr(), "flip", 2, Duration::from_secs(20));
    let lay = r.stream_layout(server_info(server.local_addr()));
    // Unit prefix: frame header (8), layer (4), crc (4), offset (8), len (4), reserved (4).
    let off = FRAME_HEADER_LEN as u64 + 8;
    let (u0, u1) = (lay.units[0], lay.units[1]);
    for (name, at, gather_after) in [
        // A garbled nonce makes the client's MAC wrong: the server refuses this connection;
        // the next load authenticates afresh.
        ("in the challenge's nonce", lay.challenge - 5, true),
        // A garbled hello may read as "not a gather server": the engine then uses ranged GETs.
        ("in the hello", (lay.challenge + lay.hello) / 2, false),
        ("in the accepted frame", lay.hello + 4, true),
        ("in a unit's frame type", u1.0, true),
        ("in a unit's layer", u1.0 + FRAME_HEADER_LEN as u64, true),
        ("in a unit's CRC", u1.0 + FRAME_HEADER_LEN as u64 + 4, true),
        // Offset 0 becomes 0xff00: the unit still fits its layer, at the wrong place.
        (
            "in a unit's destination offset (byte 1)",
            u0.0 + off + 1,
            true,
        ),
        (
            "in a unit's destination offset (byte 2)",
            u1.0 + off + 2,
            true,
        ),
        ("in a unit's length", u1.0 + off + 8, true),
        ("in the first payload byte", u0.0 + 32, true),
        ("mid-payload", u1.0 + 32 + u1.2 / 2, true),
        ("in the end frame", lay.total + 3, true),
    ] {
        raw_case(
            &r,
            &format!("gather byte flipped {name} (byte {at})"),
            RawFault::FlipAt(at),
            false,
            gather_after,
        );
    }
    // One bit of a unit's layer field: layer 0's last unit (16 MiB..18 MiB) is addressed to
    // layer 1 instead, with its CRC intact. Layer 1 would then count 18 MiB before its own
    // unit at 16 MiB arrives; units of a layer must come in offset order, so it is refused.
    let u = lay.units[1];
    raw_case(
        &r,
        &format!(
            "gather unit of layer 0 re-addressed to layer 1 (bit 0 of byte {})",
            u.0 + 8
        ),
        RawFault::XorAt(u.0 + FRAME_HEADER_LEN as u64, 1),
        false,
        true,
    );
    drop(r);
    rt().block_on(server.shutdown());
}

#[test]
fn gather_reset_mid_stream_is_a_miss() {
    let _alone = crate::alone();
    let server = mem_server();
    let r = rig(server.local_addr(), "reset", 3, Duration::from_secs(20));
    let lay = r.stream_layout(server_info(server.local_addr()));
    reset_cases(
        &r,
        "gather connection reset",
        &[
            ("before the hello", 0),
            ("after the first unit", lay.units[1].0),
            ("mid-payload", lay.total / 2),
            ("before the end frame", lay.total - 1),
        ],
    );
    drop(r);
    rt().block_on(server.shutdown());
}

/// Resets the engine's first new gather connection at each `(name, byte)` point in turn:
/// misses, never bytes, then a clean reload over gather ([`raw_case`]).
fn reset_cases(r: &Rig, what: &str, points: &[(&str, u64)]) {
    for &(name, at) in points {
        raw_case(
            r,
            &format!("{what} {name} (byte {at})"),
            RawFault::ResetAfter(at),
            false,
            true,
        );
    }
}

/// A load striped over two connections (chunks 0-8 and 9-17), the first reset partway
/// through its own stream: the layers that stripe had not completed are misses (never
/// bytes), the other stripe's connection goes back to the pool, and the next load is
/// byte-exact over gather again.
#[test]
fn gather_striped_reset_is_a_miss() {
    let _alone = crate::alone();
    let server = mem_server();
    let r = rig_with(
        server.local_addr(),
        "stripe-reset",
        13,
        Duration::from_secs(20),
        2,
    );
    let lay = r.stream_layout(server_info(server.local_addr()));
    // One stripe's stream is about half the whole load's.
    reset_cases(
        &r,
        "striped gather: first connection reset",
        &[
            ("after its first unit", lay.units[1].0),
            ("mid-payload", lay.total / 4),
        ],
    );
    drop(r);
    rt().block_on(server.shutdown());
}

/// A gather stream that stalls after layer 0 (of 32, Llama-3.1-8B geometry, 2 chunks of 256
/// tokens): once layer 1 is late, `LoadHandle::stall_advice` (the planner's deadline
/// fallback on the load's measured progress) says to recompute from layer 1 the 512 loaded
/// tokens, predicted to finish before waiting would; on the same prefix loaded without a
/// fault it says to wait (nothing is missing).
#[test]
fn stalled_gather_load_advises_recompute() {
    let _alone = crate::alone();
    use objectcache::sched::{ComputeModel, Fallback, GpuKind, KernelClass};
    let server = mem_server();
    let g = KvGeometry::llama31_8b();
    let ns = unique_ns("stall-advice");
    let chunks = 2;
    let tokens = chunks * g.tokens_per_chunk as usize;
    let hs = hashes(&g, tokens, 21);
    let data = kv(&g, chunks, 21);
    let timeout = Duration::from_secs(20);
    let direct = engine(
        ours(&format!("http://{}", server.local_addr())),
        &ns,
        timeout,
    );
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    direct.save_blocking(&g, &hs, &refs).unwrap();
    let model = ComputeModel::preset("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned).unwrap();
    let load = |e: &Engine| {
        e.load(
            LoadRequest::new(g.clone(), hs.clone()),
            LayerBuffers::allocate(g.layers as usize, data[0].len()),
        )
        .unwrap()
    };
    // Without a fault: every layer lands, nothing to recompute.
    let h = load(&direct);
    h.wait_all_blocking().unwrap();
    let advice = h.stall_advice(&model, tokens as u64, 16).unwrap();
    assert!(matches!(advice, Fallback::Wait { .. }), "{advice:?}");
    // One stream through a proxy that stalls after 3 MiB: layer 0 (2 MiB) and half of
    // layer 1 arrive, then nothing.
    let proxy = FaultProxy::raw(server.local_addr(), |_| RawFault::StallAfter(3 << 20));
    let e = engine(ours(&proxy.url()), &ns, timeout);
    let h = load(&e);
    h.wait_layer_blocking(0, None).unwrap();
    assert_eq!(h.layer(0).unwrap(), &data[0][..], "layer 0 byte-exact");
    // Layer 1 is late: still pending after half a second (the event, with a bound).
    assert!(
        h.wait_layer_blocking(1, Some(Duration::from_millis(500)))
            .is_err(),
        "layer 1 arrived through a stalled stream"
    );
    let advice = h.stall_advice(&model, tokens as u64, 16).unwrap();
    match advice {
        Fallback::Recompute {
            from_layer,
            tokens: t,
            finish_s,
            wait_finish_s,
        } => {
            assert_eq!((from_layer, t), (1, tokens as u64), "{advice:?}");
            assert!(finish_s < wait_finish_s, "{advice:?}");
        }
        other => panic!("a stalled load should be recomputed: {other:?}"),
    }
    println!("FAULT|server-gather|stream stalled after layer 0 of 32|1|stall_advice: {advice:?}");
    h.cancel();
    drop((h, e, direct, proxy));
    rt().block_on(server.shutdown());
}

#[test]
fn gather_stall_with_connection_open_ends_by_deadline() {
    let _alone = crate::alone();
    let server = mem_server();
    let deadline = Duration::from_secs(3);
    let r = rig(server.local_addr(), "stall", 4, deadline);
    let lay = r.stream_layout(server_info(server.local_addr()));
    for (name, at) in [
        ("before the hello", 0),
        ("after the first unit", lay.units[1].0 + 100),
    ] {
        let t0 = std::time::Instant::now();
        raw_case(
            &r,
            &format!("gather stream stalls {name}, deadline {deadline:?}"),
            RawFault::StallAfter(at),
            false,
            true,
        );
        println!(
            "  stall case took {:?} including the clean reload",
            t0.elapsed()
        );
    }
    drop(r);
    rt().block_on(server.shutdown());
}

#[test]
fn gather_slow_drip_completes_or_misses_by_deadline() {
    let _alone = crate::alone();
    let server = mem_server();
    // 36 MiB at 64 KiB per 2 ms (about 32 MB/s): completes inside a 30 s deadline.
    let r = rig(server.local_addr(), "drip", 5, Duration::from_secs(30));
    raw_case(
        &r,
        "gather slow drip 64 KiB/2 ms, deadline 30 s",
        RawFault::Drip {
            bytes: 64 << 10,
            every: Duration::from_millis(2),
        },
        true,
        true,
    );
    drop(r);
    // The same drip against a 1 s deadline: layers not complete by then are misses.
    let r = rig(server.local_addr(), "drip-late", 6, Duration::from_secs(1));
    raw_case(
        &r,
        "gather slow drip 64 KiB/20 ms, deadline 1 s",
        RawFault::Drip {
            bytes: 64 << 10,
            every: Duration::from_millis(20),
        },
        false,
        true,
    );
    drop(r);
    rt().block_on(server.shutdown());
}

/// `objectcache serve` as a child process on a file store; killed on drop.
fn spawn_server(dir: &std::path::Path, listen: &str) -> (ServeProcess, SocketAddr) {
    spawn_serve(listen, dir.as_os_str(), &[], Stdio::null())
}

#[test]
fn server_killed_mid_load_then_restarted() {
    let _alone = crate::alone();
    let dir = tempfile::tempdir().unwrap();
    let (mut p, addr) = spawn_server(dir.path(), "127.0.0.1:0");
    let deadline = Duration::from_secs(10);
    let r = rig(addr, "kill", 8, deadline);
    // Warm the engine's gather connection pool: it keeps one idle connection.
    r.recovers("kill: before", true);
    // A second engine, whose fresh gather connection drips (64 KiB per 5 ms, about 3 s for
    // 36 MiB), so that the kill lands mid-load.
    r.proxy.set_raw_rule(|_| RawFault::Drip {
        bytes: 64 << 10,
        every: Duration::from_millis(5),
    });
    r.proxy.clear_log();
    let e2 = r.fresh_engine();
    let per_layer = CHUNKS * r.g.slice_bytes() as usize;
    let h = e2
        .load(
            LoadRequest {
                geometry: r.g.clone(),
                hashes: r.hashes.clone(),
                hints: Default::default(),
            },
            LayerBuffers::allocate(r.g.layers as usize, per_layer),
        )
        .unwrap();
    // Kill the server once its gather answer is flowing: 1 MiB through the dripping proxy.
    common::eventually(
        "1 MiB of the gather answer",
        Duration::from_secs(60),
        || r.proxy.raw_connections().iter().any(|c| c.2 >= 1 << 20),
    );
    let pid = p.0.id();
    p.0.kill().unwrap(); // SIGKILL
    p.0.wait().unwrap();
    let t0 = std::time::Instant::now();
    let mut ready = 0;
    for l in 0..r.g.layers as usize {
        match h.wait_layer_blocking(l, Some(Duration::from_secs(120))) {
            Ok(()) => {
                assert!(
                    h.layer(l).unwrap() == &r.data[l][..],
                    "kill: layer {l} differs"
                );
                ready += 1;
            }
            Err(_) => assert!(h.layer(l).is_none()),
        }
    }
    let waited = t0.elapsed();
    assert!(
        ready < r.g.layers as usize,
        "kill: the load ended before the kill"
    );
    assert!(
        waited < deadline + Duration::from_secs(5),
        "kill: waits took {waited:?}"
    );
    drop(h);
    // While the server is down: a load is a miss (connection refused), no hang.
    r.proxy.set_raw_rule(|_| RawFault::Pass);
    let down = load_checked(&e2, &r.g, &r.hashes, &r.data, "kill: server down");
    assert_eq!(down.ready, 0, "{down:?}");
    // Restart on the same directory and port. The first engine's pooled connection went
    // stale with the old process: its next load must still be served, over gather.
    let (_p2, addr2) = spawn_server(dir.path(), &addr.to_string());
    assert_eq!(addr2, addr);
    r.recovers("kill: restarted", true);
    println!(
        "FAULT|server-process|objectcache serve (pid {pid}) SIGKILLed 1 MiB into a 36 MiB gather load|1|\
         {ready} of {} layers ready (byte-exact), the rest missed {waited:?} after the kill; \
         a load while down: {} of {} missed, no hang; after a restart on the same data, an engine \
         with a stale pooled connection: byte-exact over gather",
        r.g.layers,
        down.failed,
        r.g.layers
    );
}

/// The server's S3 API with gather off (ranged GETs) through the HTTP fault proxy.
#[test]
fn s3_api_of_the_server_under_http_faults() {
    let _alone = crate::alone();
    let dir = tempfile::tempdir().unwrap();
    let backend: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let server = rt().block_on(start(backend, config()));
    let addr = server.local_addr();
    let mk = |url: &str| ours(url);
    let t = Duration::from_secs(20);
    for (i, (name, fault, timeout)) in [
        ("500 InternalError on every try", Fault::e500(), t),
        ("503 SlowDown on every try", Fault::slowdown(), t),
        ("reset before answering", Fault::ResetNow, t),
        ("truncated body at 0.5", Fault::Truncate(0.5), t),
        ("flipped byte at 0.0", Fault::Flip(0.0), t),
        ("flipped byte at 0.5", Fault::Flip(0.5), t),
        ("flipped byte at 1.0", Fault::Flip(1.0), t),
        (
            "reset halfway through the body",
            Fault::ResetMidBody(0.5),
            t,
        ),
        (
            "stall with the connection open",
            Fault::Stall(0.5),
            Duration::from_secs(4),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        victim_case_on(
            addr,
            &unique_ns(&format!("s3api{i}")),
            &format!("ranged GET: {name}"),
            fault,
            timeout,
            &mk,
            "server-s3",
        );
    }
    rt().block_on(server.shutdown());
}
