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
//!
//! The rig and the checks shared by every case are here; the gather-path cases in
//! `gather.rs`, the killed and restarted server in `restart.rs`, the S3 API in `s3_api.rs`.
#![cfg(feature = "s3")]

mod gather;
mod restart;
mod s3_api;

use crate::common;
use crate::fault_proxy;
use crate::gather_util;
use crate::s3_faults;

use bytes::BytesMut;
use common::shared_rt as rt;
use common::*;
use fault_proxy::{Fault, FaultProxy, RawFault};
use gather_util::{config, spawn_serve, start, ServeProcess, ACCESS, BUCKET, SECRET};
use objectcache::connector::{Engine, EngineConfig, SaveFormat};
use objectcache::protocol::{plan_units, Frame, GatherRequest, FRAME_HEADER_LEN, UNIT_HEADER_LEN};
use objectcache::server::ServerHandle;
use objectcache::store::{FsStore, FsyncPolicy, MemoryStore, Store};
use objectcache::transport::tcp::GatherClient;
use objectcache::{ChunkHash, Dtype, KvGeometry};
use s3_faults::{load_checked, s3_as, victim_case_on, Outcome};
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

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
    engine_as(store, ns, timeout, streams, SaveFormat::V1)
}

/// [`engine_with`], writing `format`. An engine writing version 2 reads the markers of a
/// load's chunks before it loads (it keeps none: `lookup_cache_ttl` 0), and gathers the
/// segments they name.
fn engine_as(
    store: Arc<dyn Store>,
    ns: &str,
    timeout: Duration,
    streams: usize,
    format: SaveFormat,
) -> Engine {
    Engine::with_store(
        store,
        EngineConfig {
            namespace: ns.to_string(),
            load_timeout: Some(timeout),
            lookup_cache_ttl: Duration::ZERO,
            gather: true,
            gather_streams: streams,
            save_format: format,
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
    /// The format the prefix was saved in.
    format: SaveFormat,
    /// The server behind the proxy.
    server: SocketAddr,
}

fn rig(server: SocketAddr, test: &str, seed: u64, timeout: Duration) -> Rig {
    rig_with(server, test, seed, timeout, 1)
}

fn rig_with(server: SocketAddr, test: &str, seed: u64, timeout: Duration, streams: usize) -> Rig {
    rig_as(server, test, seed, timeout, streams, SaveFormat::V1)
}

/// Both object formats: the gather cases run on a prefix saved as chunk objects (version 1)
/// and on one saved as a segment object (version 2, which the server reads through the
/// load's segment placement).
const FORMATS: [SaveFormat; 2] = [SaveFormat::V1, SaveFormat::V2];

/// Runs `cases` on a rig of each format in turn ([`FORMATS`], [`rig_as`]: test `test`, seed
/// `seed`, a 20 s load deadline, `streams` gather streams) with the layout of its gather
/// stream ([`Rig::stream_layout`]), every prefix saved on one new in-memory server
/// ([`mem_server`], shut down at the end).
fn each_format(test: &str, seed: u64, streams: usize, cases: impl Fn(&Rig, &Layout)) {
    let server = mem_server();
    let timeout = Duration::from_secs(20);
    for format in FORMATS {
        let r = rig_as(server.local_addr(), test, seed, timeout, streams, format);
        cases(&r, &r.stream_layout(server_info(r.server)));
    }
    rt().block_on(server.shutdown());
}

/// [`rig_with`], the prefix saved in `format`.
fn rig_as(
    server: SocketAddr,
    test: &str,
    seed: u64,
    timeout: Duration,
    streams: usize,
    format: SaveFormat,
) -> Rig {
    let g = geometry();
    let ns = unique_ns(test);
    let direct = engine_as(ours(&format!("http://{server}")), &ns, timeout, 1, format);
    let (hs, data) = save_prefix(&direct, &g, CHUNKS, seed);
    let proxy = FaultProxy::raw(server, |_| RawFault::Pass);
    let engine = engine_as(ours(&proxy.url()), &ns, timeout, streams, format);
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
        format,
        server,
    }
}

impl Rig {
    /// `case`, naming the format when the prefix is a segment object.
    fn name(&self, case: &str) -> String {
        match self.format {
            SaveFormat::V1 => case.to_string(),
            SaveFormat::V2 => format!("{case} [format v2, one segment]"),
        }
    }

    fn load_on(&self, e: &Engine, case: &str) -> Outcome {
        load_checked(e, &self.g, &self.hashes, &self.data, case)
    }

    /// A new engine through the proxy (no pooled gather connection yet).
    fn fresh_engine(&self) -> Engine {
        engine_as(
            ours(&self.proxy.url()),
            &self.ns,
            self.timeout,
            self.streams,
            self.format,
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
        let accepted = len(Frame::Accepted(objectcache::protocol::UnitTally {
            request_id: 0,
            units: 0,
            bytes: 0,
        }));
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
            // than this prefix's 18 chunks); ranged GETs would be one per slice. A version 2
            // load first reads one marker, which places all 18 chunks in the one segment.
            let markers = match self.format {
                SaveFormat::V1 => 0,
                SaveFormat::V2 => 1,
            };
            assert_eq!(
                o.requests,
                e.config().gather_streams as u64 + markers,
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
    let case = &r.name(case);
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
