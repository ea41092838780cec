//! Gather over RDMA through the product path: the ObjectCache server offers the RDMA target on
//! its gather port, the connector's Engine sets up one RDMA session and loads with one gather
//! request whose target is its own destination buffers; the server writes every unit with
//! RDMA_WRITE_WITH_IMM. Needs an RDMA device (soft-RoCE `rxe0` in CI's VM,
//! scripts/rxe-vm/run.sh); without one every test prints SKIP, unless
//! `OBJECTCACHE_REQUIRE_RDMA=1` (set inside the VM) makes it fail. Small geometry: emulation
//! is slow.
#![cfg(all(feature = "rdma", feature = "s3", feature = "server"))]

mod common;
mod gather_util;
mod rdma_util;

use common::shared_rt as rt;
use common::{engine, hashes, save_prefix, start_load, unique_ns};
use gather_util::{config, start, ACCESS, BUCKET, SECRET};
use objectcache::connector::{
    ChunkStatus, Engine, EngineConfig, LayerBuffers, LayerStatus, LoadRequest, Transport,
};
use objectcache::error::{LayerError, LayerResult};
use objectcache::layout::{slice_range, Dtype, HashAlgo, KeyBuilder};
use objectcache::protocol::GatherRequest;
use objectcache::server::ServerHandle;
use objectcache::store::{MemoryStore, S3Config, S3Store, Store, StoreExt};
use objectcache::transport::rdma::{
    ClientConfig, GatherConn, HostBuffer, LayerDest, RdmaClient, RdmaGatherError,
};
use objectcache::transport::LayerSink;
use objectcache::KvGeometry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// `true` when an RDMA device exists; otherwise SKIP, or panic under OBJECTCACHE_REQUIRE_RDMA=1.
fn rdma_present(test: &str) -> bool {
    // Why a load did not use RDMA shows up in the connector's log (stderr).
    let _ = tracing_subscriber::fmt()
        .with_env_filter("objectcache=info")
        .with_writer(std::io::stderr)
        .try_init();
    rdma_util::rdma_present(test)
}

/// 48 tokens x 2 heads x 16 dims x bf16 x K,V = 6 KiB per slice, 4 layers.
fn geometry() -> KvGeometry {
    KvGeometry::new("rdma-gather", 4, 2, 16, Dtype::Bf16)
        .unwrap()
        .with_tokens_per_chunk(48)
        .unwrap()
}

/// The server's completed RDMA writes once they reach `want` (the server counts a write when
/// it polls its completion, which may trail the client's; bounded wait), else what it has.
fn writes_at_least(srv: &ServerHandle, want: u64) -> u64 {
    for _ in 0..2000 {
        let n = srv.rdma_writes().expect("the server offers RDMA");
        if n >= want {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    srv.rdma_writes().unwrap()
}

fn s3_on(endpoint: &str) -> Arc<dyn Store> {
    let cfg = S3Config::at_endpoint(BUCKET, endpoint.to_string(), ACCESS, SECRET);
    Arc::new(rt().block_on(S3Store::new(cfg)).unwrap())
}

fn server() -> ServerHandle {
    rt().block_on(start(Arc::new(MemoryStore::new()), config()))
}

/// An engine in namespace `ns` over the server's S3 API.
fn s3_engine(srv: &ServerHandle, ns: &str) -> Engine {
    engine(s3_on(&srv.endpoint()), ns)
}

/// As [`s3_engine`], with `transport = rdma` (RDMA wanted: a fallback to TCP gather is
/// logged as a warning).
fn rdma_engine(srv: &ServerHandle, ns: &str) -> Engine {
    let cfg = EngineConfig {
        namespace: ns.into(),
        transport: Transport::Rdma,
        ..Default::default()
    };
    Engine::with_store(s3_on(&srv.endpoint()), cfg).unwrap()
}

/// Saves `chunks` chunks through `e`, loads them back, checks every byte.
fn save_and_load(e: &Engine, g: &KvGeometry, chunks: usize, seed: u64) {
    let (hs, data) = save_prefix(e, g, chunks, seed);
    let h = start_load(e, g, hs, data[0].len());
    for l in 0..g.layers as usize {
        h.wait_layer_blocking(l, None)
            .unwrap_or_else(|err| panic!("seed {seed} layer {l}: {err}"));
        assert_eq!(h.layer(l).unwrap(), &data[l][..], "seed {seed} layer {l}");
    }
    assert!(h.chunk_status().iter().all(|s| *s == ChunkStatus::Ok));
    assert_eq!(h.stats().requests, 1, "one gather request per load");
}

#[test]
fn engine_save_and_load_over_rdma_byte_exact() {
    if !rdma_present("engine_save_and_load_over_rdma_byte_exact") {
        return;
    }
    let srv = server();
    assert_eq!(
        srv.rdma_writes(),
        Some(0),
        "the server offers the RDMA target"
    );
    let g = geometry();
    let e = s3_engine(&srv, &unique_ns("rdma"));
    save_and_load(&e, &g, 5, 1);
    let w1 = writes_at_least(&srv, g.layers as u64);
    // 5 chunks x 6 KiB = 30 KiB per layer: one unit per layer (units of up to 16 MiB).
    assert_eq!(w1, g.layers as u64, "one RDMA write per layer");
    // The session persists: a second load reuses it (and the registration cache).
    save_and_load(&e, &g, 3, 2);
    let w2 = w1 + g.layers as u64;
    assert_eq!(writes_at_least(&srv, w2), w2);
    // Format version 2: the chunks of a save in one segment object, which the server reads
    // for the RDMA target as it does chunk objects (one write per layer, one request).
    let v2 = Engine::with_store(
        s3_on(&srv.endpoint()),
        EngineConfig {
            namespace: unique_ns("rdma-v2"),
            save_format: objectcache::connector::SaveFormat::V2,
            ..Default::default()
        },
    )
    .unwrap();
    save_and_load(&v2, &g, 4, 3);
    let w3 = w2 + g.layers as u64;
    assert_eq!(writes_at_least(&srv, w3), w3, "one RDMA write per layer");
    drop((e, v2));
    rt().block_on(srv.shutdown());
}

#[test]
fn concurrent_engine_loads_over_rdma() {
    if !rdma_present("concurrent_engine_loads_over_rdma") {
        return;
    }
    let srv = server();
    let g = geometry();
    let e = Arc::new(rdma_engine(&srv, &unique_ns("rdma-conc")));
    std::thread::scope(|s| {
        for i in 0..4u64 {
            let (e, g) = (e.clone(), g.clone());
            s.spawn(move || save_and_load(&e, &g, 2 + i as usize, 10 + i));
        }
    });
    assert_eq!(
        writes_at_least(&srv, 4 * g.layers as u64),
        4 * g.layers as u64,
        "every load went over RDMA"
    );
    drop(e);
    rt().block_on(srv.shutdown());
}

/// Records what the RDMA session reports; on the first placed unit it can run a hook.
#[derive(Default)]
struct Sink {
    placed: Mutex<HashMap<u32, u64>>,
    failed: Mutex<HashMap<u32, LayerError>>,
    hook: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// What `is_cancelled` answers (the engine's cancel, as the session sees it).
    cancel: std::sync::atomic::AtomicBool,
}

impl LayerSink for Sink {
    fn write(&self, _: u32, _: u64, _: &[u8]) -> LayerResult<()> {
        panic!("an RDMA load never copies bytes through the sink");
    }
    fn placed(&self, layer: u32, _offset: u64, len: u64) -> LayerResult<()> {
        *self.placed.lock().unwrap().entry(layer).or_default() += len;
        if let Some(h) = self.hook.lock().unwrap().take() {
            h();
        }
        Ok(())
    }
    fn complete(&self, _: u32, _: u64) {}
    fn fail(&self, layer: u32, err: LayerError) {
        self.failed.lock().unwrap().insert(layer, err);
    }
    fn is_cancelled(&self) -> bool {
        self.cancel.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// An RDMA gather session with the server: the RDMA connection and the gather connection
/// whose loads it serves.
fn gather_session(srv: &ServerHandle) -> (RdmaClient, GatherConn) {
    gather_session_at(&srv.local_addr().to_string(), ClientConfig::default())
}

/// As [`gather_session`], with the server at `addr` and client settings `cfg`.
fn gather_session_at(addr: &str, cfg: ClientConfig) -> (RdmaClient, GatherConn) {
    let client = RdmaClient::connect_gather(addr, cfg).unwrap();
    let conn = rt()
        .block_on(GatherConn::connect(
            addr,
            Some((ACCESS.into(), SECRET.into())),
        ))
        .unwrap();
    (client, conn)
}

/// One host buffer of `len` bytes per layer of `g`, and the destinations that name them.
fn host_dests(g: &KvGeometry, len: usize) -> (Vec<Arc<HostBuffer>>, Vec<LayerDest>) {
    let bufs: Vec<Arc<HostBuffer>> = (0..g.layers)
        .map(|_| HostBuffer::new(len).unwrap())
        .collect();
    let dests = bufs
        .iter()
        .enumerate()
        .map(|(l, b)| LayerDest::host(l as u32, b.clone(), 0))
        .collect();
    (bufs, dests)
}

/// Asserts layer `l`'s buffer holds `data[l]` exactly (`what` begins the failure message).
fn assert_landed(bufs: &[Arc<HostBuffer>], data: &[Vec<u8>], l: u32, what: &str) {
    let l = l as usize;
    assert_eq!(
        common::settled(&bufs[l], 0, data[l].len()),
        data[l],
        "{what}layer {l}"
    );
}

/// Saves a prefix through the server's S3 API; returns the gather request for it and its
/// layer bytes.
fn saved_prefix(
    srv: &ServerHandle,
    g: &KvGeometry,
    chunks: usize,
    seed: u64,
    ns: &str,
) -> (GatherRequest, Vec<Vec<u8>>) {
    let (hs, data) = save_prefix(&s3_engine(srv, ns), g, chunks, seed);
    (prefix_request(g, ns, hs), data)
}

/// The gather request for the chunks `hs` of namespace `ns`.
fn prefix_request(
    g: &KvGeometry,
    ns: &str,
    hs: Vec<objectcache::layout::ChunkHash>,
) -> GatherRequest {
    let kb = KeyBuilder::new(ns, g, HashAlgo::Sha256Cbor).unwrap();
    let n = hs.len();
    GatherRequest::for_prefix(1, BUCKET, &kb, g, hs, vec![g.tokens_per_chunk; n])
}

/// A server that sends `bytes_per_s` at most (gather loads paced by its link scheduler), so
/// that a load of a few units lasts seconds.
fn paced_server(bytes_per_s: u64) -> ServerHandle {
    let mut cfg = config();
    cfg.bandwidth_cap_bytes_per_s = bytes_per_s;
    rt().block_on(start(Arc::new(MemoryStore::new()), cfg))
}

#[test]
fn units_split_layers_and_land_byte_exact() {
    if !rdma_present("units_split_layers_and_land_byte_exact") {
        return;
    }
    let srv = server();
    let g = geometry();
    let ns = unique_ns("rdma-units");
    let (mut req, data) = saved_prefix(&srv, &g, 3, 5, &ns);
    // 4 KiB units: each 6 KiB slice is cut into 4 + 2 KiB pieces, 6 units per layer.
    req.max_unit_bytes = 4096;
    let (client, mut conn) = gather_session(&srv);
    let len = data[0].len();
    let (bufs, dests) = host_dests(&g, len);
    for round in 0..2 {
        bufs.iter().for_each(|b| common::clear(b, 0));
        let sink = Arc::new(Sink::default());
        rt().block_on(conn.load(&client, req.clone(), &dests, sink.clone()))
            .unwrap();
        assert!(
            sink.failed.lock().unwrap().is_empty(),
            "{:?}",
            sink.failed.lock().unwrap()
        );
        for l in 0..g.layers {
            assert_eq!(sink.placed.lock().unwrap()[&l], len as u64);
            assert_landed(&bufs, &data, l, &format!("round {round} "));
        }
    }
    assert_eq!(
        writes_at_least(&srv, 2 * 6 * g.layers as u64),
        2 * 6 * g.layers as u64,
        "6 units per layer"
    );
    assert_eq!(
        client.registrations(),
        g.layers as u64,
        "each destination registered once"
    );
    client.close();
    rt().block_on(srv.shutdown());
}

#[test]
fn qp_failure_mid_load_is_a_miss() {
    if !rdma_present("qp_failure_mid_load_is_a_miss") {
        return;
    }
    // Paced at 256 KiB/s, the server posts the 32 units of 4 KiB over half a second, so the
    // QP fails (on the first unit's completion) before most are posted, however fast the
    // machine: unpaced, a fast one sometimes posted and completed every unit first.
    let srv = paced_server(256 << 10);
    let g = geometry();
    let ns = unique_ns("rdma-qpfail");
    let (mut req, data) = saved_prefix(&srv, &g, 4, 7, &ns);
    req.max_unit_bytes = 4096; // 8 units per layer, 32 in all: most are not posted yet
    let (client, mut conn) = gather_session(&srv);
    let client = Arc::new(client);
    let len = data[0].len();
    let (bufs, dests) = host_dests(&g, len);
    let sink = Arc::new(Sink::default());
    let c2 = client.clone();
    // The first unit's completion moves a QP to the error state, as a NIC failure would.
    *sink.hook.lock().unwrap() = Some(Box::new(move || c2.inject_qp_error(0).unwrap()));
    let r = rt().block_on(conn.load(&client, req.clone(), &dests, sink.clone()));
    assert!(matches!(r, Err(RdmaGatherError::Failed(_))), "{r:?}");
    let failed = sink.failed.lock().unwrap().clone();
    assert!(
        !failed.is_empty(),
        "a QP failure must make the undelivered layers misses"
    );
    for l in 0..g.layers {
        let placed = sink.placed.lock().unwrap().get(&l).copied().unwrap_or(0);
        if !failed.contains_key(&l) {
            assert_eq!(
                placed, len as u64,
                "layer {l} is neither complete nor a miss"
            );
            assert_landed(&bufs, &data, l, "");
        }
    }
    assert!(
        client.broken().is_some(),
        "the session is broken after a QP error"
    );
    assert_eq!(client.drained(), Some(true), "drained before the misses");
    // A new session works again.
    let (client2, mut conn2) = gather_session(&srv);
    let sink2 = Arc::new(Sink::default());
    rt().block_on(conn2.load(&client2, req, &dests, sink2.clone()))
        .unwrap();
    for l in 0..g.layers {
        assert_landed(&bufs, &data, l, "after reconnect, ");
    }
    drop(client);
    client2.close();
    rt().block_on(srv.shutdown());
}

/// A paced server (32 KiB/s; 4 chunks x 4 layers of 6 KiB in 4 KiB units: 24 units over
/// 3 s) with no shutdown grace, its saved prefix and the request for it in 4 KiB units.
fn slow_load(ns: &str, seed: u64) -> (ServerHandle, GatherRequest, Vec<Vec<u8>>) {
    let mut cfg = config();
    cfg.bandwidth_cap_bytes_per_s = 32 << 10;
    cfg.shutdown_grace_secs = 0;
    let srv = rt().block_on(start(Arc::new(MemoryStore::new()), cfg));
    let (mut req, data) = saved_prefix(&srv, &geometry(), 4, seed, &unique_ns(ns));
    req.max_unit_bytes = 4096;
    (srv, req, data)
}

/// The server stops mid-load (its shutdown aborts the load at once): the layers delivered
/// before are byte-exact, every other layer is a miss, the load returns (no hang), and the
/// session is broken (drained first) so that nothing the server might still write lands.
#[test]
fn a_server_that_stops_mid_load_is_a_miss_not_a_hang() {
    if !rdma_present("a_server_that_stops_mid_load_is_a_miss_not_a_hang") {
        return;
    }
    let (srv, req, data) = slow_load("rdma-stop", 13);
    let g = geometry();
    let (client, mut conn) = gather_session(&srv);
    let len = data[0].len();
    let (bufs, dests) = host_dests(&g, len);
    let sink = Arc::new(Sink::default());
    let r = std::thread::scope(|s| {
        let load = s.spawn(|| rt().block_on(conn.load(&client, req, &dests, sink.clone())));
        common::eventually(
            "layer 0 to land",
            std::time::Duration::from_secs(30),
            || sink.placed.lock().unwrap().get(&0) == Some(&(len as u64)),
        );
        rt().block_on(srv.shutdown());
        load.join().unwrap()
    });
    assert!(matches!(r, Err(RdmaGatherError::Failed(_))), "{r:?}");
    let failed = sink.failed.lock().unwrap().clone();
    assert!(!failed.contains_key(&0), "layer 0 landed before the stop");
    assert!(
        (1..g.layers).any(|l| failed.contains_key(&l)),
        "the stop cut the load short: {failed:?}"
    );
    for l in 0..g.layers {
        if !failed.contains_key(&l) {
            assert_eq!(sink.placed.lock().unwrap()[&l], len as u64, "layer {l}");
            assert_landed(&bufs, &data, l, "before the stop, ");
        }
    }
    assert!(client.broken().is_some(), "the session is broken");
    assert_eq!(client.drained(), Some(true), "drained before the misses");
}

/// The engine cancels mid-load (its sink says so): the client tells the server, which stops
/// writing; the load ends with every layer that was not complete a `Cancelled` miss; the
/// session stays usable, and the next load on it (same registrations) is byte-exact.
#[test]
fn a_cancelled_load_stops_the_server_and_the_session_stays_usable() {
    if !rdma_present("a_cancelled_load_stops_the_server_and_the_session_stays_usable") {
        return;
    }
    let (srv, req, data) = slow_load("rdma-cancel", 17);
    let g = geometry();
    let (client, mut conn) = gather_session(&srv);
    let len = data[0].len();
    let (bufs, dests) = host_dests(&g, len);
    let sink = Arc::new(Sink::default());
    let s2 = sink.clone();
    // Cancel on the first unit's completion.
    *sink.hook.lock().unwrap() = Some(Box::new(move || {
        s2.cancel.store(true, std::sync::atomic::Ordering::Release)
    }));
    let r = rt().block_on(conn.load(&client, req.clone(), &dests, sink.clone()));
    assert!(r.is_ok(), "a cancelled load ends cleanly: {r:?}");
    // 4 chunks x 6 KiB = 24 KiB per layer in 4 KiB units: 6 per layer.
    let units = 6 * g.layers as u64;
    let written = srv.rdma_writes().unwrap();
    assert!(
        written < units,
        "the server stopped writing: {written} of {units} units written"
    );
    let failed = sink.failed.lock().unwrap().clone();
    let placed = sink.placed.lock().unwrap().clone();
    for l in 0..g.layers {
        if placed.get(&l) != Some(&(len as u64)) {
            assert_eq!(failed.get(&l), Some(&LayerError::Cancelled), "layer {l}");
        }
    }
    assert!(
        client.broken().is_none(),
        "a cancel does not break the session"
    );
    let regs = client.registrations();
    bufs.iter().for_each(|b| common::clear(b, 0));
    let again = Arc::new(Sink::default());
    rt().block_on(conn.load(&client, req, &dests, again.clone()))
        .unwrap();
    assert!(again.failed.lock().unwrap().is_empty());
    for l in 0..g.layers {
        assert_landed(&bufs, &data, l, "after the cancel, ");
    }
    assert_eq!(
        client.registrations(),
        regs,
        "the destinations stay registered"
    );
    client.close();
    rt().block_on(srv.shutdown());
}

#[test]
fn engine_load_of_missing_chunks_is_a_miss_over_rdma() {
    if !rdma_present("engine_load_of_missing_chunks_is_a_miss_over_rdma") {
        return;
    }
    // A missing chunk over RDMA: its layers are misses, reported by the server's Miss frames.
    let srv = server();
    let g = geometry();
    let e = s3_engine(&srv, &unique_ns("rdma-miss"));
    let hs = hashes(&g, 2 * g.tokens_per_chunk as usize, 77);
    let h = start_load(&e, &g, hs, 2 * g.slice_bytes() as usize);
    for l in 0..g.layers as usize {
        assert!(
            h.wait_layer_blocking(l, None).is_err(),
            "layer {l} of an absent prefix is a miss"
        );
        assert!(matches!(h.poll_layer(l), LayerStatus::Failed(_)));
    }
    drop(h);
    save_and_load(&e, &g, 2, 78);
    assert_eq!(writes_at_least(&srv, g.layers as u64), g.layers as u64);
    drop(e);
    rt().block_on(srv.shutdown());
}

/// Issue 19, part 4, on the RDMA path: one corrupt slice (chunk 2 of 4, layer 2) fails only
/// layer 2, naming chunk 2; every other layer lands byte-exact in the destination through the
/// server's RDMA writes (the server checks each slice's CRC32C before it writes it). The other
/// chunks' layer-2 slices, which shared chunk 2's unit (one unit per layer here), are written
/// one by one and land too: once the load has ended chunk 2 is corrupt and every other chunk
/// `Ok`, and the chunks before chunk 2 are the loaded prefix, as on the TCP paths.
#[test]
fn a_corrupt_slice_fails_only_its_layer_over_rdma() {
    if !rdma_present("a_corrupt_slice_fails_only_its_layer_over_rdma") {
        return;
    }
    const BAD_CHUNK: usize = 2;
    const BAD_LAYER: usize = 2;
    let backend: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let srv = rt().block_on(start(backend.clone(), config()));
    let g = geometry();
    let e = s3_engine(&srv, &unique_ns("rdma-corrupt"));
    let (hs, data) = save_prefix(&e, &g, 4, 91);
    // Flip one byte of chunk 2's layer-2 slice in the server's backend.
    let key = format!("{BUCKET}/{}", e.keys(&g).unwrap().data(&hs[BAD_CHUNK]));
    let mut obj = rt().block_on(backend.get_bytes(&key)).unwrap().to_vec();
    obj[(slice_range(BAD_LAYER as u32, g.slice_bytes()).start + 100) as usize] ^= 0x40;
    rt().block_on(backend.put(&key, obj.into())).unwrap();

    let h = start_load(&e, &g, hs, data[0].len());
    let failed: Vec<(usize, LayerError)> = (0..g.layers as usize)
        .filter_map(|l| h.wait_layer_blocking(l, None).err().map(|e| (l, e)))
        .collect();
    let layers: Vec<usize> = failed.iter().map(|(l, _)| *l).collect();
    assert_eq!(layers, vec![BAD_LAYER], "failed layers {failed:?}");
    match &failed[0].1 {
        LayerError::ChecksumMismatch { chunk, .. } | LayerError::Storage { chunk, .. } => {
            assert_eq!(*chunk, BAD_CHUNK, "{}", failed[0].1)
        }
        other => panic!("layer {BAD_LAYER}: {other}"),
    }
    for (l, want) in data.iter().enumerate() {
        if l != BAD_LAYER {
            assert!(h.layer(l).unwrap() == &want[..], "layer {l} differs");
        }
    }
    common::eventually(
        "every chunk settles",
        std::time::Duration::from_secs(30),
        || !h.chunk_status().contains(&ChunkStatus::Pending),
    );
    for (c, s) in h.chunk_status().iter().enumerate() {
        let want = if c == BAD_CHUNK {
            ChunkStatus::Corrupt
        } else {
            ChunkStatus::Ok
        };
        assert_eq!(*s, want, "chunk {c}");
    }
    assert_eq!(
        h.loaded_chunks(),
        BAD_CHUNK,
        "the chunks before the bad one have every slice in place"
    );
    assert_eq!(h.stats().requests, 1, "one gather request");
    assert!(
        srv.rdma_writes().unwrap() > 0,
        "the good layers came by RDMA writes"
    );
    let msg = failed[0].1.to_string();
    // The bad layer's other slices are the saved bytes too (the layer is a miss, so they are
    // read from the buffers handed back).
    let got = h.into_buffers().into_vecs().expect("owned buffers");
    let sl = g.slice_bytes() as usize;
    for c in (0..4).filter(|&c| c != BAD_CHUNK) {
        assert!(
            got[BAD_LAYER][c * sl..(c + 1) * sl] == data[BAD_LAYER][c * sl..(c + 1) * sl],
            "chunk {c}'s slice of layer {BAD_LAYER} differs"
        );
    }
    println!(
        "MISS|RDMA gather|layer {BAD_LAYER} failed naming chunk {BAD_CHUNK} ({msg}); the other {} layers delivered; the other chunks Ok, their layer-{BAD_LAYER} slices written one by one and byte-exact",
        g.layers - 1
    );
    drop(e);
    rt().block_on(srv.shutdown());
}

/// Paged destinations over RDMA: per layer one range per engine block, scattered through one
/// pool. Saves from blocks `src`, loads into blocks `dst` (each `block_size`-token block a
/// separate range, none adjacent), and checks every block byte for byte and that nothing
/// else in the pool was written. Returns the server's RDMA writes for the load.
fn paged_round_trip(
    srv: &ServerHandle,
    e: &Engine,
    block_size: u32,
    chunks: usize,
    seed: u64,
) -> u64 {
    let g = geometry()
        .with_layout("test/rdma-blocks", block_size)
        .unwrap();
    let layers = g.layers as usize;
    let block = block_size as usize * g.bytes_per_token_per_layer() as usize;
    let n = chunks * (g.tokens_per_chunk / block_size) as usize;
    let blocks = 2 * n + 1; // per layer in the pool
    let at = |l: usize, b: usize| (l * blocks + b) * block;
    // Request blocks: every other block, in reverse order (never adjacent, never in order).
    let ids: Vec<usize> = (0..n).map(|i| 2 * (n - 1 - i) + 1).collect();
    let ranges: Vec<Vec<(usize, usize)>> = (0..layers)
        .map(|l| ids.iter().map(|&b| (at(l, b), block)).collect())
        .collect();
    let (hs, data) = save_prefix(e, &g, chunks, seed);
    let before = srv.rdma_writes().unwrap();
    let bufs = LayerBuffers::paged(vec![0xA5; layers * blocks * block], ranges.clone()).unwrap();
    let h = e.load(LoadRequest::new(g.clone(), hs), bufs).unwrap();
    for l in 0..layers {
        h.wait_layer_blocking(l, None)
            .unwrap_or_else(|err| panic!("block size {block_size}: layer {l}: {err}"));
        assert_eq!(
            h.layer_parts(l).unwrap().concat(),
            data[l],
            "block size {block_size}: layer {l}"
        );
    }
    assert!(h.chunk_status().iter().all(|s| *s == ChunkStatus::Ok));
    let pool = h.into_buffers().into_pool().unwrap();
    for l in 0..layers {
        for b in 0..blocks {
            let blk = &pool[at(l, b)..at(l, b) + block];
            match ids.iter().position(|&x| x == b) {
                Some(i) => assert_eq!(
                    blk,
                    &data[l][i * block..(i + 1) * block],
                    "layer {l} block {b}"
                ),
                None => assert!(
                    blk.iter().all(|&x| x == 0xA5),
                    "block {b} of layer {l} was written"
                ),
            }
        }
    }
    srv.rdma_writes().unwrap() - before
}

#[test]
fn paged_engine_load_over_rdma_writes_into_scattered_blocks() {
    if !rdma_present("paged_engine_load_over_rdma_writes_into_scattered_blocks") {
        return;
    }
    let srv = server();
    let e = rdma_engine(&srv, &unique_ns("rdma-paged"));
    // 16-token blocks: 3 per 48-token chunk. A scattered load asks for one unit per slice, so
    // each unit is 3 pieces (3 RDMA writes, the last with the immediate): one completed write
    // per unit, 5 per layer.
    let g = geometry();
    let w = paged_round_trip(&srv, &e, 16, 5, 21);
    let w = if w < 5 * g.layers as u64 {
        writes_at_least(&srv, 5 * g.layers as u64)
    } else {
        w
    };
    assert_eq!(w, 5 * g.layers as u64, "every unit went over RDMA");
    // Again: the session and the pool's registration are reused.
    let before = srv.rdma_writes().unwrap();
    paged_round_trip(&srv, &e, 48, 2, 22);
    assert_eq!(
        writes_at_least(&srv, before + 2 * g.layers as u64),
        before + 2 * g.layers as u64
    );
    // 1-token blocks: 48 pieces per unit, more than a session writes per unit (its send
    // queues): the server refuses the RDMA target before reading, and the load runs over
    // TCP gather instead, landing the same bytes.
    let before = srv.rdma_writes().unwrap();
    let w = paged_round_trip(&srv, &e, 1, 2, 23);
    assert_eq!(w, 0, "refused over RDMA");
    assert_eq!(srv.rdma_writes().unwrap(), before);
    drop(e);
    rt().block_on(srv.shutdown());
}

/// Bytes of the destination at a give-up, and a second before: the load gave up (here its
/// deadline) while the paced server still had most units to write. Once the load has
/// returned, the engine owns the destination again: nothing may change in it, while the
/// server goes on with the request until it sees the session closed.
#[test]
fn a_load_past_its_deadline_is_never_written_afterwards() {
    if !rdma_present("a_load_past_its_deadline_is_never_written_afterwards") {
        return;
    }
    // 4 chunks x 4 layers x 6 KiB = 96 KiB at 32 KiB/s: 3 s, past the client's 1 s deadline.
    let srv = paced_server(32 << 10);
    let g = geometry();
    let ns = unique_ns("rdma-late");
    let (mut req, data) = saved_prefix(&srv, &g, 4, 9, &ns);
    req.max_unit_bytes = 4096;
    let cfg = ClientConfig {
        load_timeout: std::time::Duration::from_secs(1),
        ..ClientConfig::default()
    };
    let (client, mut conn) = gather_session_at(&srv.local_addr().to_string(), cfg);
    let len = data[0].len();
    let (bufs, dests) = host_dests(&g, len);
    const CANARY: u8 = 0x5A;
    bufs.iter().for_each(|b| common::clear(b, CANARY));
    let sink = Arc::new(Sink::default());
    let r = rt().block_on(conn.load(&client, req, &dests, sink.clone()));
    assert!(matches!(r, Err(RdmaGatherError::Failed(_))), "{r:?}");
    assert_eq!(
        client.drained(),
        Some(true),
        "the QPs drained before the misses were reported"
    );
    let at_give_up: Vec<Vec<u8>> = bufs.iter().map(|b| common::settled(b, 0, len)).collect();
    let failed = sink.failed.lock().unwrap().clone();
    assert!(
        failed.len() >= 2,
        "the deadline cut the load short: {failed:?}"
    );
    for l in 0..g.layers {
        let got = &at_give_up[l as usize];
        let want = &data[l as usize];
        if failed.contains_key(&l) {
            // a layer the load gave up on: units that landed before, canary elsewhere
            assert!(
                got.iter().zip(want).all(|(&b, &w)| b == w || b == CANARY),
                "layer {l} holds bytes of neither the chunk nor the canary"
            );
        } else {
            assert_eq!(got, want, "layer {l} is reported ready");
        }
    }
    let gave_up = srv.rdma_writes().unwrap();
    std::thread::sleep(std::time::Duration::from_secs(1));
    for (l, b) in bufs.iter().enumerate() {
        assert!(
            common::settled(b, 0, len) == at_give_up[l],
            "layer {l} changed after the load gave up"
        );
    }
    common::eventually(
        "the server to close the broken session",
        std::time::Duration::from_secs(30),
        || srv.rdma_sessions() == Some(0),
    );
    eprintln!(
        "late writes: {} layers failed at the deadline, {} writes completed before it, {} \
         after; the destination unchanged",
        failed.len(),
        gave_up,
        srv.rdma_writes().unwrap() - gave_up
    );
    drop(client);
    rt().block_on(srv.shutdown());
}

/// The child process of [`a_client_process_that_exits_mid_load_leaves_no_session`]: loads
/// the prefix the parent saved (at `OBJECTCACHE_TEST_CHILD_ADDR`, namespace
/// `OBJECTCACHE_TEST_CHILD_NS`) over RDMA until the parent kills it. Does nothing when run
/// on its own.
#[test]
#[ignore = "a child process of a_client_process_that_exits_mid_load_leaves_no_session"]
fn rdma_child_loads_until_killed() {
    let (Ok(addr), Ok(ns)) = (
        std::env::var("OBJECTCACHE_TEST_CHILD_ADDR"),
        std::env::var("OBJECTCACHE_TEST_CHILD_NS"),
    ) else {
        return;
    };
    let g = geometry();
    let (hs, data) = common::seeded_prefix(&g, 4, 11);
    let mut req = prefix_request(&g, &ns, hs);
    req.max_unit_bytes = 4096;
    let (client, mut conn) = gather_session_at(&addr, ClientConfig::default());
    let (_bufs, dests) = host_dests(&g, data[0].len());
    loop {
        let _ = rt().block_on(conn.load(&client, req.clone(), &dests, Arc::new(Sink::default())));
    }
}

/// A client process that dies mid-load (SIGKILL: no goodbye, its queue pairs destroyed by
/// the kernel): the server's writes to it stop, its session closes, and the server serves
/// the next client.
#[test]
fn a_client_process_that_exits_mid_load_leaves_no_session() {
    if !rdma_present("a_client_process_that_exits_mid_load_leaves_no_session") {
        return;
    }
    let srv = paced_server(32 << 10);
    let g = geometry();
    let ns = unique_ns("rdma-child");
    let (mut req, data) = saved_prefix(&srv, &g, 4, 11, &ns);
    req.max_unit_bytes = 4096;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "rdma_child_loads_until_killed", "--ignored"])
        .env("OBJECTCACHE_TEST_CHILD_ADDR", srv.local_addr().to_string())
        .env("OBJECTCACHE_TEST_CHILD_NS", &ns)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let limit = std::time::Duration::from_secs(60);
    common::eventually("the child's load to be written", limit, || {
        srv.rdma_writes().unwrap() >= 3
    });
    assert_eq!(srv.rdma_sessions(), Some(1), "the child's session");
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the child ran until killed: {status}");
    common::eventually(
        "the server to close the dead client's session",
        limit,
        || srv.rdma_sessions() == Some(0),
    );
    let after = srv.rdma_writes().unwrap();
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert_eq!(
        srv.rdma_writes().unwrap(),
        after,
        "no write completes once the client is gone"
    );
    // the next client loads the same prefix, every byte
    let (client, mut conn) = gather_session(&srv);
    let len = data[0].len();
    let (bufs, dests) = host_dests(&g, len);
    let sink = Arc::new(Sink::default());
    rt().block_on(conn.load(&client, req, &dests, sink.clone()))
        .unwrap();
    for l in 0..g.layers {
        assert_landed(&bufs, &data, l, "after the dead client, ");
    }
    eprintln!("dead client: {after} writes before its session closed, none after");
    client.close();
    rt().block_on(srv.shutdown());
}
