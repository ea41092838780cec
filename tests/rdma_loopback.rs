//! RDMA data path over a real verbs device (soft-RoCE `rxe0` in CI's VM: scripts/rxe-vm/run.sh).
//!
//! Every test needs an RDMA device. Without one it prints SKIP, unless
//! `OBJECTCACHE_REQUIRE_RDMA=1` (set inside the VM) makes it fail.
#![cfg(feature = "rdma-standalone")]

mod common;
mod rdma_util;

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use objectcache::error::{LayerError, LayerResult};
use objectcache::layout::{encode_chunk, slice_range, Dtype, KvGeometry};
use objectcache::store::{MemoryStore, StoreExt};
use objectcache::transport::rdma::{
    ClientConfig, HostBuffer, LayerDest, LoadHandle, LoadSpec, RdmaClient, RdmaError, RdmaServer,
    ServerConfig, ServerHandle, SliceSource, StoreSliceSource,
};
use objectcache::transport::LayerSink;

fn geometry() -> KvGeometry {
    // 16 tokens x 2 heads x 16 dims x 2 bytes x K,V = 2 KiB per slice: small, emulation is slow.
    KvGeometry::new("rdma-test", 6, 2, 16, Dtype::Bf16)
        .unwrap()
        .with_tokens_per_chunk(16)
        .unwrap()
}

/// Deterministic K+V bytes of (seed, chunk, layer).
fn slice_bytes(seed: u8, chunk: u32, layer: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(31)
                .wrapping_add(chunk * 7 + layer * 13 + u32::from(seed) * 101) as u8
        })
        .collect()
}

/// A destination the test inspects: bytes completed per layer, failures, placed ranges
/// (overlaps and ranges past the layer are refused, as the connector's sink does).
struct TestSink {
    size: u64,
    state: Mutex<(HashMap<u32, u64>, HashMap<u32, LayerError>)>,
    placed: Mutex<HashMap<u32, Vec<(u64, u64)>>>,
    cancelled: std::sync::atomic::AtomicBool,
    cv: Condvar,
}

impl TestSink {
    fn new(layer_size: u64) -> Arc<Self> {
        Arc::new(TestSink {
            size: layer_size,
            state: Mutex::new((HashMap::new(), HashMap::new())),
            placed: Mutex::new(HashMap::new()),
            cancelled: std::sync::atomic::AtomicBool::new(false),
            cv: Condvar::new(),
        })
    }
    fn ready(&self, layer: u32) -> bool {
        self.state.lock().unwrap().0.get(&layer) == Some(&self.size)
    }
    /// Waits (bounded, so a bug cannot hang CI) until `layer` is ready or failed.
    fn wait_resolved(&self, layer: u32) -> bool {
        let mut st = self.state.lock().unwrap();
        for _ in 0..1200 {
            if st.0.get(&layer) == Some(&self.size) {
                return true;
            }
            if st.1.contains_key(&layer) {
                return false;
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap()
                .0;
        }
        panic!("layer {layer} neither ready nor failed after 120 s");
    }
}

impl LayerSink for TestSink {
    fn write(&self, _layer: u32, _offset: u64, _data: &[u8]) -> LayerResult<()> {
        panic!("the RDMA path must not copy through LayerSink::write");
    }
    fn placed(&self, layer: u32, offset: u64, len: u64) -> LayerResult<()> {
        let mut p = self.placed.lock().unwrap();
        let ranges = p.entry(layer).or_default();
        if offset + len > self.size || ranges.iter().any(|&(a, b)| offset < b && a < offset + len) {
            return Err(LayerError::GeometryMismatch {
                chunk: 0,
                reason: format!("range {offset}+{len} refused"),
            });
        }
        ranges.push((offset, offset + len));
        Ok(())
    }
    fn complete(&self, layer: u32, bytes: u64) {
        *self.state.lock().unwrap().0.entry(layer).or_default() += bytes;
        self.cv.notify_all();
    }
    fn fail(&self, layer: u32, err: LayerError) {
        self.state.lock().unwrap().1.insert(layer, err);
        self.cv.notify_all();
    }
    fn is_cancelled(&self) -> bool {
        self.cancelled.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Prints a test's wall time (a figure for the log, never asserted).
struct Timer(std::time::Instant, String);
impl Timer {
    fn start() -> Self {
        Timer(
            std::time::Instant::now(),
            std::thread::current().name().unwrap_or("?").to_string(),
        )
    }
}
impl Drop for Timer {
    fn drop(&mut self) {
        eprintln!("TIME {}: {:.2} s", self.1, self.0.elapsed().as_secs_f64());
    }
}

/// A test's runtime, store and geometry; the test's wall time is printed when it drops.
struct Fixture {
    rt: tokio::runtime::Runtime,
    store: Arc<MemoryStore>,
    g: KvGeometry,
    _timer: Timer,
}

/// The fixture of test `test`, or `None` (after its SKIP) without an RDMA device.
fn fixture(test: &str) -> Option<Fixture> {
    if !rdma_util::rdma_present(test) {
        return None;
    }
    let timer = Timer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    Some(Fixture {
        rt,
        store: Arc::new(MemoryStore::new()),
        g: geometry(),
        _timer: timer,
    })
}

impl Fixture {
    /// Writes `chunks` encoded chunk objects under `prefix`; returns their keys.
    fn put_chunks(&self, prefix: &str, seed: u8, chunks: u32) -> Vec<String> {
        let g = &self.g;
        let slice = g.slice_bytes() as usize;
        let mut keys = Vec::new();
        for c in 0..chunks {
            let layers: Vec<Vec<u8>> = (0..g.layers)
                .map(|l| slice_bytes(seed, c, l, slice))
                .collect();
            let obj = encode_chunk(g, g.tokens_per_chunk, |l| &layers[l as usize]).unwrap();
            let key = format!("{prefix}/chunk-{c}");
            self.rt.block_on(self.store.put(&key, obj.into())).unwrap();
            keys.push(key);
        }
        keys
    }

    /// The store's slices, as the server reads them.
    fn source(&self) -> StoreSliceSource {
        StoreSliceSource::new(self.store.clone(), self.rt.handle().clone())
    }

    /// A server reading the store's slices behind a gate on `layer` (closed until the test
    /// opens it), the gate, and its [`OpenOnDrop`]: bind all three in this order (`let (gate,
    /// server, _open) = ...`), so that the gate opens before the server drops (locals, and
    /// the bindings of one pattern, drop in reverse order).
    fn gated_server(&self, layer: u32) -> (Arc<Gate>, ServerHandle, OpenOnDrop) {
        let gate = Arc::new(Gate {
            inner: self.source(),
            layer,
            open: Mutex::new(None),
            cv: Condvar::new(),
        });
        let server = start_server(gate.clone());
        let open = OpenOnDrop(gate.clone());
        (gate, server, open)
    }

    /// Every layer, in order.
    fn all_layers(&self) -> Vec<u32> {
        (0..self.g.layers).collect()
    }

    /// A load of `layers` of the chunk objects `keys`.
    fn spec(&self, keys: &[String], layers: &[u32]) -> LoadSpec {
        LoadSpec {
            keys: keys.to_vec(),
            slice_len: self.g.slice_bytes(),
            layers: layers.to_vec(),
        }
    }

    /// A destination buffer for every layer of `chunks` chunks (see [`Fixture::load`]).
    fn buffer(&self, chunks: u32) -> Arc<HostBuffer> {
        HostBuffer::new((self.g.layers * chunks) as usize * self.g.slice_bytes() as usize).unwrap()
    }

    /// A sink of layers of `chunks` slices.
    fn sink(&self, chunks: u32) -> Arc<TestSink> {
        TestSink::new(u64::from(chunks) * self.g.slice_bytes())
    }

    /// Starts `spec` on `client` into layer-major destinations in `buf`: layer `l` at
    /// `l x chunks x slice`, one chunk per key of the spec.
    fn load(
        &self,
        client: &RdmaClient,
        spec: LoadSpec,
        buf: &Arc<HostBuffer>,
        sink: Arc<TestSink>,
    ) -> Result<LoadHandle, RdmaError> {
        let layer_len = spec.keys.len() * self.g.slice_bytes() as usize;
        let dests: Vec<LayerDest> = spec
            .layers
            .iter()
            .map(|&l| LayerDest::host(l, buf.clone(), l as usize * layer_len))
            .collect();
        client.load(spec, &dests, sink)
    }

    /// Asserts layer `l`'s destination holds exactly the expected bytes of every chunk.
    fn assert_layer_exact(&self, buf: &HostBuffer, seed: u8, l: u32, chunks: u32) {
        let slice = self.g.slice_bytes() as usize;
        for c in 0..chunks {
            let off = (l as usize * chunks as usize + c as usize) * slice;
            assert_eq!(
                common::settled(buf, off, slice),
                slice_bytes(seed, c, l, slice),
                "layer {l} chunk {c}"
            );
        }
    }
}

fn start_server(src: Arc<dyn SliceSource>) -> ServerHandle {
    let cfg = ServerConfig {
        arena_bytes: 64 << 10,
        ..ServerConfig::default()
    };
    RdmaServer::bind("127.0.0.1:0", src, cfg)
        .unwrap()
        .spawn()
        .unwrap()
}

fn connect(server: &ServerHandle, cfg: ClientConfig) -> RdmaClient {
    RdmaClient::connect(server.addr(), cfg).unwrap()
}

/// The default client configuration with `qps` QPs per connection.
fn qps(qps: usize) -> ClientConfig {
    ClientConfig {
        qps,
        ..ClientConfig::default()
    }
}

/// `layers` in order (a load reports them as they end).
fn sorted(mut layers: Vec<u32>) -> Vec<u32> {
    layers.sort();
    layers
}

#[test]
fn round_trip_is_byte_exact_and_registers_once() {
    let Some(f) = fixture("round_trip_is_byte_exact_and_registers_once") else {
        return;
    };
    let chunks = 5;
    let keys = f.put_chunks("rt", 1, chunks);
    let server = start_server(Arc::new(f.source()));
    let client = connect(&server, qps(2));
    let buf = f.buffer(chunks);
    let order = vec![2, 0, 1, 5, 4, 3]; // the scheduler's order, not 0..n
    for round in 0..2 {
        common::clear(&buf, 0xEE);
        let sink = f.sink(chunks);
        let out = f
            .load(&client, f.spec(&keys, &order), &buf, sink.clone())
            .unwrap()
            .wait();
        assert!(out.failed.is_empty(), "round {round}: {:?}", out.failed);
        assert_eq!(sorted(out.ready), vec![0, 1, 2, 3, 4, 5]);
        for l in 0..f.g.layers {
            assert!(
                sink.ready(l),
                "round {round}: sink saw layer {l} incomplete"
            );
            f.assert_layer_exact(&buf, 1, l, chunks);
        }
    }
    assert_eq!(
        client.registrations(),
        1,
        "the destination buffer is registered once for both loads"
    );
    assert!(client.broken().is_none());
    client.close();
}

#[test]
fn several_concurrent_loads_on_shared_and_separate_connections() {
    let Some(f) = fixture("several_concurrent_loads_on_shared_and_separate_connections") else {
        return;
    };
    let chunks = 4;
    let key_sets: Vec<Vec<String>> = (0..4)
        .map(|i| f.put_chunks(&format!("cc{i}"), 10 + i as u8, chunks))
        .collect();
    let server = start_server(Arc::new(f.source()));
    let a = connect(&server, qps(3));
    let b = connect(&server, qps(1));
    let layers = f.all_layers();
    let mut running = Vec::new();
    for (i, keys) in key_sets.iter().enumerate() {
        let buf = f.buffer(chunks);
        let client = if i < 3 { &a } else { &b }; // three loads share connection a
        let h = f
            .load(client, f.spec(keys, &layers), &buf, f.sink(chunks))
            .unwrap();
        running.push((i, buf, h));
    }
    for (i, buf, h) in running {
        let out = h.wait();
        assert!(out.failed.is_empty(), "load {i}: {:?}", out.failed);
        assert_eq!(out.ready.len(), f.g.layers as usize);
        for l in 0..f.g.layers {
            f.assert_layer_exact(&buf, 10 + i as u8, l, chunks);
        }
    }
    assert_eq!(a.registrations(), 3);
    assert_eq!(b.registrations(), 1);
}

/// Blocks the server's read of one layer until the test opens the gate.
struct Gate {
    inner: StoreSliceSource,
    layer: u32,
    open: Mutex<Option<bool>>, // None = closed; Some(pass)
    cv: Condvar,
}

impl Gate {
    fn release(&self, pass: bool) {
        *self.open.lock().unwrap() = Some(pass);
        self.cv.notify_all();
    }
}

impl SliceSource for Gate {
    fn read_slice(
        &self,
        spec: &LoadSpec,
        layer: u32,
        unit: u32,
        dst: &mut [u8],
    ) -> LayerResult<()> {
        if layer == self.layer {
            let mut o = self.open.lock().unwrap();
            while o.is_none() {
                o = self.cv.wait(o).unwrap();
            }
            if *o == Some(false) {
                return Err(LayerError::Storage {
                    chunk: unit as usize,
                    message: "gate closed by the test".into(),
                });
            }
        }
        self.inner.read_slice(spec, layer, unit, dst)
    }
}

/// Opens the gate (failing the gated reads) when dropped, so that a failing assertion ends
/// the test instead of leaving the server's connection thread blocked in the gate. Bound
/// after the server ([`Fixture::gated_server`]): locals drop in reverse order.
struct OpenOnDrop(Arc<Gate>);
impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        if self.0.open.lock().map(|o| o.is_none()).unwrap_or(true) {
            self.0.release(false);
        }
    }
}

/// Polls `cond` every 10 ms for at most 120 s; panics with `what` if it never holds.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..12_000 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("waited 120 s for {what}");
}

#[test]
fn qp_failure_mid_load_becomes_a_miss_not_a_hang() {
    let Some(f) = fixture("qp_failure_mid_load_becomes_a_miss_not_a_hang") else {
        return;
    };
    let chunks = 3;
    let keys = f.put_chunks("qpf", 3, chunks);
    let (gate, server, _open) = f.gated_server(2);
    let client = connect(&server, qps(2));
    let buf = f.buffer(chunks);
    let sink = f.sink(chunks);
    let h = f
        .load(&client, f.spec(&keys, &f.all_layers()), &buf, sink.clone())
        .unwrap();
    assert!(
        sink.wait_resolved(0) && sink.wait_resolved(1),
        "layers before the gate arrive"
    );
    client.inject_qp_error(0).unwrap();
    gate.release(true);
    let out = h.wait();
    assert_eq!(sorted(out.ready), vec![0, 1]);
    let failed = sorted(out.failed.iter().map(|(l, _)| *l).collect());
    assert_eq!(failed, vec![2, 3, 4, 5]);
    for l in 2..6 {
        assert!(
            !sink.ready(l) && !sink.wait_resolved(l),
            "layer {l} must be a miss"
        );
    }
    f.assert_layer_exact(&buf, 3, 0, chunks);
    f.assert_layer_exact(&buf, 3, 1, chunks);
    assert!(client.broken().is_some());
    let again = f.load(&client, f.spec(&keys[..1], &[0]), &buf, f.sink(1));
    assert!(
        matches!(again, Err(RdmaError::Broken(_))),
        "a broken connection refuses new loads"
    );
}

#[test]
fn corrupt_slice_is_a_layer_miss_and_the_connection_survives() {
    let Some(f) = fixture("corrupt_slice_is_a_layer_miss_and_the_connection_survives") else {
        return;
    };
    let chunks = 4;
    let keys = f.put_chunks("crc", 4, chunks);
    // flip one byte of chunk 2, layer 1
    let mut obj = f.rt.block_on(f.store.get_bytes(&keys[2])).unwrap().to_vec();
    obj[slice_range(1, f.g.slice_bytes()).start as usize + 5] ^= 0x40;
    f.rt.block_on(f.store.put(&keys[2], obj.into())).unwrap();
    let server = start_server(Arc::new(f.source()));
    let client = connect(&server, ClientConfig::default());
    let buf = f.buffer(chunks);
    let sink = f.sink(chunks);
    let out = f
        .load(&client, f.spec(&keys, &f.all_layers()), &buf, sink.clone())
        .unwrap()
        .wait();
    assert_eq!(out.failed.len(), 1, "{:?}", out.failed);
    assert_eq!(out.failed[0].0, 1);
    assert!(
        format!("{}", out.failed[0].1).contains("checksum"),
        "{}",
        out.failed[0].1
    );
    assert!(!sink.ready(1));
    for l in [0, 2, 3, 4, 5] {
        f.assert_layer_exact(&buf, 4, l, chunks);
    }
    // the connection is still good: load the intact layers again
    assert!(client.broken().is_none());
    let out = f
        .load(&client, f.spec(&keys, &[0, 2]), &buf, f.sink(chunks))
        .unwrap()
        .wait();
    assert!(out.failed.is_empty());
}

#[test]
fn remote_disconnect_and_timeout_become_misses() {
    let Some(f) = fixture("remote_disconnect_and_timeout_become_misses") else {
        return;
    };
    let chunks = 2;
    let keys = f.put_chunks("disc", 5, chunks);
    let spec = f.spec(&keys, &f.all_layers());

    // 1. the server goes away mid-load
    let (gate, server, _open) = f.gated_server(1);
    let client = connect(&server, ClientConfig::default());
    let buf = f.buffer(chunks);
    let sink = f.sink(chunks);
    let h = f.load(&client, spec.clone(), &buf, sink.clone()).unwrap();
    assert!(sink.wait_resolved(0));
    eprintln!("disconnect: layer 0 in, stopping the server");
    let mut server = server;
    let stopper = std::thread::spawn(move || server.shutdown());
    wait_until("the client to notice the server's disconnect", || {
        client.broken().is_some()
    });
    eprintln!("disconnect: client saw it");
    gate.release(false);
    stopper.join().unwrap();
    eprintln!("disconnect: server stopped");
    let out = h.wait();
    assert_eq!(out.ready, vec![0]);
    assert_eq!(out.failed.len(), 5, "{:?}", out.failed);
    f.assert_layer_exact(&buf, 5, 0, chunks);

    eprintln!("disconnect: part 1 done");
    // 2. the server stalls past the client's deadline, then writes every unit anyway: none
    //    may land in the destination, which the engine has taken back once the load gave up
    let (gate, server, _open) = f.gated_server(0);
    let cfg = ClientConfig {
        load_timeout: Duration::from_secs(3),
        ..ClientConfig::default()
    };
    let client = connect(&server, cfg);
    const CANARY: u8 = 0xC3;
    common::clear(&buf, CANARY);
    let out = f.load(&client, spec, &buf, f.sink(chunks)).unwrap().wait();
    assert!(out.ready.is_empty());
    assert_eq!(out.failed.len(), 6);
    assert!(
        out.failed
            .iter()
            .all(|(l, e)| *e == LayerError::Timeout { layer: *l as usize }),
        "{:?}",
        out.failed
    );
    eprintln!("timeout: part 2 outcome checked");
    assert_eq!(
        client.drained(),
        Some(true),
        "the QPs drained before the misses were reported"
    );
    assert_eq!(server.writes_posted(), 0, "the gate held every read");
    gate.release(true);
    // the server now reads and posts a write for every unit (its client is still there:
    // queue pairs in the error state, the destination still registered)
    let units = u64::from(chunks * f.g.layers);
    wait_until("the server to post its late writes", || {
        server.writes_posted() == units
    });
    // grace: on loopback a write reaches its peer within microseconds
    std::thread::sleep(Duration::from_millis(500));
    let len = (f.g.layers * chunks) as usize * f.g.slice_bytes() as usize;
    let landed = common::settled(&buf, 0, len)
        .iter()
        .filter(|&&b| b != CANARY)
        .count();
    assert_eq!(
        landed, 0,
        "{landed} bytes of the destination changed after the load gave up ({units} late writes)"
    );
    eprintln!("timeout: {units} late writes posted, canary intact");
    drop(client);
    eprintln!("timeout: client dropped");
    drop(server);
    eprintln!("timeout: server dropped");
}

#[test]
fn cancel_stops_the_server_and_the_connection_stays_usable() {
    let Some(f) = fixture("cancel_stops_the_server_and_the_connection_stays_usable") else {
        return;
    };
    let chunks = 3;
    let keys = f.put_chunks("cancel", 6, chunks);
    let (gate, server, _open) = f.gated_server(2);
    let client = connect(&server, ClientConfig::default());
    let buf = f.buffer(chunks);
    let sink = f.sink(chunks);
    let spec = f.spec(&keys, &f.all_layers());
    let h = f.load(&client, spec.clone(), &buf, sink.clone()).unwrap();
    assert!(sink.wait_resolved(0) && sink.wait_resolved(1));
    // the engine cancels through its sink; the client forwards it to the server
    sink.cancelled
        .store(true, std::sync::atomic::Ordering::Release);
    wait_until("the Cancel to reach the server", || {
        server.cancels_received() > 0
    });
    assert_eq!(server.cancels_received(), 1);
    gate.release(true);
    let out = h.wait();
    assert_eq!(sorted(out.ready), vec![0, 1]);
    // layer 2's first unit may have been posted before the server saw the Cancel; after it,
    // every pending layer is a Cancelled miss
    assert_eq!(out.failed.len(), 4, "{:?}", out.failed);
    assert!(
        out.failed.iter().all(|(_, e)| *e == LayerError::Cancelled),
        "{:?}",
        out.failed
    );
    f.assert_layer_exact(&buf, 6, 0, chunks);
    f.assert_layer_exact(&buf, 6, 1, chunks);
    // same connection, same buffer (registered once), a full load
    assert!(client.broken().is_none());
    common::clear(&buf, 0);
    let out = f.load(&client, spec, &buf, f.sink(chunks)).unwrap().wait();
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    for l in 0..f.g.layers {
        f.assert_layer_exact(&buf, 6, l, chunks);
    }
    assert_eq!(client.registrations(), 1);
}
