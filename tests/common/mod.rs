//! Shared test fixtures: deterministic KV bytes, stores under test, environment gates.
#![allow(dead_code)]

use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadHandle, LoadRequest};
use objectcache::hash::{chunk_hashes, HashParams};
use objectcache::store::{FsStore, FsyncPolicy, Store};
use objectcache::{ChunkHash, Dtype, KvGeometry};
use std::sync::Arc;

/// A small fp16 geometry of model `model`: `layers` layers of 2 KV heads of 16 dimensions,
/// 16 tokens a chunk (2 KiB a chunk-layer slice).
pub fn small_geometry(model: &str, layers: u32) -> KvGeometry {
    let mut g = KvGeometry::new(model, layers, 2, 16, Dtype::Fp16).unwrap();
    g.tokens_per_chunk = 16;
    g
}

/// A single-threaded tokio runtime with I/O and timers, for blocking on a store's futures.
pub fn current_thread_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The multi-thread runtime that this test binary's synchronous tests start servers and S3
/// clients on: built on first use and alive for the whole process, so what runs on it (a
/// server, a client's connection pool) outlives the call that started it.
pub fn shared_rt() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Runtime::new().unwrap())
}

/// Runs `cmd` to its end and returns its output, asserting it exited 0 (its stdout and stderr
/// are the failure message).
pub fn run_ok(cmd: &mut std::process::Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert_exited_ok(&out, "");
    out
}

/// Asserts that the process whose output is `out` exited 0; otherwise panics with `what`
/// followed by its stdout and its stderr.
pub fn assert_exited_ok(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Deterministic KV bytes of layer `l` for `chunks` chunks: every chunk's slice differs and
/// depends on (seed, chunk, layer), so a misplaced slice is detected.
pub fn layer_bytes(g: &KvGeometry, chunks: usize, l: u32, seed: u64) -> Vec<u8> {
    let slice = g.slice_bytes() as usize;
    let mut out = vec![0u8; chunks * slice];
    for c in 0..chunks {
        let mut x = seed ^ ((c as u64) << 32) ^ ((l as u64) << 16) ^ 0x9e37_79b9_7f4a_7c15;
        for w in out[c * slice..(c + 1) * slice].chunks_mut(8) {
            // xorshift64*
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
            w.copy_from_slice(&v[..w.len()]);
        }
    }
    out
}

/// All layers' bytes for `chunks` chunks.
pub fn kv(g: &KvGeometry, chunks: usize, seed: u64) -> Vec<Vec<u8>> {
    (0..g.layers)
        .map(|l| layer_bytes(g, chunks, l, seed))
        .collect()
}

/// Chunk hashes of a synthetic prompt of `tokens` tokens (seeded).
pub fn hashes(g: &KvGeometry, tokens: usize, seed: u32) -> Vec<ChunkHash> {
    let t: Vec<u32> = (0..tokens as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 128_000)
        .collect();
    chunk_hashes(&t, &HashParams::new(g.tokens_per_chunk as usize)).unwrap()
}

/// A prefix of `chunks` chunks from one seed: its hashes ([`hashes`] of `chunks` whole chunks
/// of tokens) and each layer's KV bytes ([`kv`]).
pub fn seeded_prefix(g: &KvGeometry, chunks: usize, seed: u64) -> (Vec<ChunkHash>, Vec<Vec<u8>>) {
    let hs = hashes(g, chunks * g.tokens_per_chunk as usize, seed as u32);
    (hs, kv(g, chunks, seed))
}

/// Saves the [`seeded_prefix`] of `chunks` chunks and `seed` through `e`; returns its hashes
/// and each layer's bytes.
pub fn save_prefix(
    e: &Engine,
    g: &KvGeometry,
    chunks: usize,
    seed: u64,
) -> (Vec<ChunkHash>, Vec<Vec<u8>>) {
    let (hs, data) = seeded_prefix(g, chunks, seed);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    e.save_blocking(g, &hs, &refs).unwrap();
    (hs, data)
}

/// Starts a load through `e` of the chunks `hs` (geometry `g`, no hints) into fresh buffers of
/// `layer_bytes` bytes per layer.
pub fn start_load(
    e: &Engine,
    g: &KvGeometry,
    hs: Vec<ChunkHash>,
    layer_bytes: usize,
) -> LoadHandle {
    e.load(
        LoadRequest::new(g.clone(), hs),
        LayerBuffers::allocate(g.layers as usize, layer_bytes),
    )
    .unwrap()
}

/// Loads the first `hit` chunks of the prefix `hs` through `e` (buffers of `hit` slices per
/// layer) and waits until the whole load has ended, every layer ready.
pub fn load_first(e: &Engine, g: &KvGeometry, hs: &[ChunkHash], hit: usize) -> LoadHandle {
    let h = start_load(e, g, hs[..hit].to_vec(), hit * g.slice_bytes() as usize);
    h.wait_all_blocking().unwrap();
    h
}

/// Waits for every layer of `h` in order and asserts each is ready and holds `data`'s bytes
/// for that layer (every layer of `data` as long).
pub fn assert_layers_exact(h: &LoadHandle, data: &[Vec<u8>]) {
    assert_layers_landed(h, data, data.first().map_or(0, Vec::len), "load");
}

/// Waits for each layer of `h` in turn and asserts it is ready and that its first `n` bytes
/// are `data[l][..n]` (`what` begins each failure message).
pub fn assert_layers_landed(h: &LoadHandle, data: &[Vec<u8>], n: usize, what: &str) {
    for (l, want) in data.iter().enumerate() {
        h.wait_layer_blocking(l, None)
            .unwrap_or_else(|e| panic!("{what}: layer {l} missed: {e}"));
        assert!(
            h.layer(l).unwrap() == &want[..n],
            "{what}: layer {l} differs"
        );
    }
}

/// Waits for every layer of `h` and asserts that each failed with an error `expected` accepts
/// and exposes no bytes; `what` (may be empty) begins the failure messages, before
/// "layer L".
pub fn assert_every_layer_misses(
    h: &LoadHandle,
    what: &str,
    expected: impl Fn(&objectcache::LayerError) -> bool,
) {
    for l in 0..h.layers() {
        let at = if what.is_empty() {
            format!("layer {l}")
        } else {
            format!("{what} layer {l}")
        };
        let err = h.wait_layer_blocking(l, None).unwrap_err();
        assert!(expected(&err), "{at}: {err:?}");
        assert!(h.layer(l).is_none(), "{at} exposes bytes");
    }
}

/// An FS store (no fsync) in a new temporary directory; the store is usable while the
/// directory is kept.
pub fn temp_fs_store() -> (tempfile::TempDir, Arc<dyn Store>) {
    let dir = tempfile::tempdir().unwrap();
    let s: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    (dir, s)
}

/// An engine over `store` with a unique namespace.
pub fn engine(store: Arc<dyn Store>, ns: &str) -> Engine {
    let cfg = EngineConfig {
        namespace: ns.to_string(),
        ..EngineConfig::default()
    };
    Engine::with_store(store, cfg).unwrap()
}

/// An engine over `store` in namespace `ns` with the settings `pairs` (names and values as
/// `EngineConfig::from_pairs` reads them; panics on a bad one).
pub fn engine_with(store: Arc<dyn Store>, ns: &str, pairs: &[(&str, &str)]) -> Engine {
    let mut cfg = EngineConfig::from_pairs(pairs.iter().copied()).unwrap();
    cfg.namespace = ns.to_string();
    Engine::with_store(store, cfg).unwrap()
}

/// An engine over `store` in namespace `ns` that caches no lookup (every lookup asks the
/// store).
pub fn uncached_engine(store: Arc<dyn Store>, ns: &str) -> Engine {
    let cfg = EngineConfig {
        namespace: ns.to_string(),
        lookup_cache_ttl: std::time::Duration::ZERO,
        ..EngineConfig::default()
    };
    Engine::with_store(store, cfg).unwrap()
}

/// A unique namespace for one test run.
pub fn unique_ns(test: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("t-{test}-{}-{t}", std::process::id())
}

/// Waits until `f` holds, checking every 5 ms; panics naming `what` after `limit` (a liveness
/// bound, not a speed goal).
pub fn eventually(what: &str, limit: std::time::Duration, f: impl Fn() -> bool) {
    let t0 = std::time::Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "never: {what}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The name libtest knows test `name` by, for re-running it alone with `--exact`: `module` is
/// the test's `module_path!()`, whose first segment (the crate) libtest leaves out; so
/// `bed::name` in the `integration` binary, plain `name` in a binary of its own.
pub fn exact_test_name(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, m)) => format!("{m}::{name}"),
        None => name.to_string(),
    }
}

/// A test whose external server or tool (`what`, with how to get it) is missing: fails when
/// `OBJECTCACHE_REQUIRE_ALL` is set (CI starts every one of them, so a missing one is a broken
/// set-up, not a pass), else prints `SKIP` for the caller to return on.
pub fn skip(what: &str) {
    assert!(
        std::env::var_os("OBJECTCACHE_REQUIRE_ALL").is_none(),
        "no {what}, but OBJECTCACHE_REQUIRE_ALL is set"
    );
    eprintln!("SKIP: no {what}");
}

/// The S3 store of the test endpoint (Ceph RGW in CI; see
/// `objectcache::store::S3Store::from_test_env`) and this call's key prefix under `tag`, or
/// `None` after [`skip`] when no endpoint answers. Panics when the endpoint answers but
/// refuses the test credentials or bucket.
#[cfg(feature = "s3")]
pub async fn test_s3_store(tag: &str) -> Option<(objectcache::store::S3Store, String)> {
    let found = objectcache::store::S3Store::from_test_env(tag)
        .await
        .expect("the S3 test endpoint answers but refuses us");
    if found.is_none() {
        skip("S3 test endpoint (OBJECTCACHE_TEST_S3_ENDPOINT; scripts/ceph-rgw/start.sh)");
    }
    found
}

/// The bytes of the RDMA host buffer `buf` at `off..off + len`, read once no load writes
/// into it.
#[cfg(feature = "rdma")]
pub fn settled(buf: &objectcache::transport::rdma::HostBuffer, off: usize, len: usize) -> Vec<u8> {
    // SAFETY: called only after the load that wrote `buf` returned (each of its completions
    // polled, or its session broken with the QPs in the error state) and before the next one
    // starts: nothing writes the range.
    unsafe { buf.to_vec(off, len) }.unwrap()
}

/// Sets every byte of the RDMA host buffer `buf` to `b` between loads.
#[cfg(feature = "rdma")]
pub fn clear(buf: &objectcache::transport::rdma::HostBuffer, b: u8) {
    // SAFETY: as `settled`: no load is running, so nothing else reads or writes `buf`.
    unsafe { buf.fill(b) }
}
