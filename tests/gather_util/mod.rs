//! Shared fixtures of the gather and server tests: deterministic KV bytes, a sink that checks
//! every byte it receives, and an in-process server.
#![allow(dead_code)]

use bytes::Bytes;
use objectcache::error::{LayerError, LayerResult};
use objectcache::layout::{encode_chunk, ChunkHash, HashAlgo, KeyBuilder, KvGeometry};
use objectcache::protocol::{GatherRequest, SaveChunk, SaveRequest, WireGeometry};
use objectcache::server::{AccessKey, ServerConfig, ServerHandle};
use objectcache::store::Store;
use objectcache::transport::tcp::GatherClient;
use objectcache::transport::LayerSink;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub const BUCKET: &str = "kv-test";
pub const ACCESS: &str = "test-access";
pub const SECRET: &str = "test-secret-key";

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seed of chunk `c`, layer `l` of prefix `prefix_seed`.
pub fn seed(prefix_seed: u64, c: usize, l: u32) -> u64 {
    splitmix(prefix_seed ^ splitmix((c as u64) << 32 | l as u64))
}

/// Deterministic bytes `pos..pos+out.len()` of the slice with seed `s`.
pub fn fill(s: u64, pos: u64, out: &mut [u8]) {
    let mut p = pos;
    let mut i = 0;
    while i < out.len() {
        let w = splitmix(s ^ (p / 8)).to_le_bytes();
        let o = (p % 8) as usize;
        let n = (8 - o).min(out.len() - i);
        out[i..i + n].copy_from_slice(&w[o..o + n]);
        i += n;
        p += n as u64;
    }
}

/// The hashes of a synthetic prefix (distinct per seed).
pub fn hashes(prefix_seed: u64, n: usize) -> Vec<ChunkHash> {
    (0..n)
        .map(|c| {
            let mut d = [0u8; 32];
            for (k, w) in d.chunks_mut(8).enumerate() {
                w.copy_from_slice(&splitmix(prefix_seed ^ (c as u64 * 4 + k as u64)).to_le_bytes());
            }
            ChunkHash::from_digest(d)
        })
        .collect()
}

/// Chunk `c`'s encoded object.
pub fn object(g: &KvGeometry, prefix_seed: u64, c: usize, tokens: u32) -> Bytes {
    let sl = tokens as usize * g.bytes_per_token_per_layer() as usize;
    let layers: Vec<Vec<u8>> = (0..g.layers)
        .map(|l| {
            let mut v = vec![0u8; sl];
            fill(seed(prefix_seed, c, l), 0, &mut v);
            v
        })
        .collect();
    Bytes::from(encode_chunk(g, tokens, |l| &layers[l as usize]).expect("encode"))
}

pub fn key_builder(g: &KvGeometry) -> KeyBuilder {
    KeyBuilder::new("test", g, HashAlgo::Sha256Cbor).expect("namespace")
}

/// Saves a prefix of `tokens.len()` chunks through one batched-save request.
pub async fn save_prefix(
    client: &mut GatherClient,
    g: &KvGeometry,
    prefix_seed: u64,
    tokens: &[u32],
) -> objectcache::transport::tcp::SaveReport {
    let hs = hashes(prefix_seed, tokens.len());
    let req = SaveRequest {
        request_id: prefix_seed,
        bucket: BUCKET.into(),
        prefix: key_builder(g).prefix().to_string(),
        geometry: WireGeometry::from_geometry(g),
        chunks: hs
            .iter()
            .zip(tokens)
            .map(|(h, &t)| SaveChunk {
                hash: h.clone(),
                tokens: t,
            })
            .collect(),
    };
    // One request; objects are made as they are sent, so memory holds one at a time.
    client
        .save(
            &req,
            (0..tokens.len()).map(|c| object(g, prefix_seed, c, tokens[c])),
        )
        .await
        .expect("save")
}

/// The gather request for a saved prefix.
pub fn request(g: &KvGeometry, prefix_seed: u64, tokens: &[u32]) -> GatherRequest {
    GatherRequest::for_prefix(
        prefix_seed,
        BUCKET,
        &key_builder(g),
        g,
        hashes(prefix_seed, tokens.len()),
        tokens.to_vec(),
    )
}

/// A sink that compares every byte written with the expected KV bytes, and records
/// completion and failures per layer.
pub struct VerifySink {
    prefix_seed: u64,
    offsets: Vec<u64>,
    lens: Vec<u64>,
    layer_bytes: u64,
    pub done: Vec<AtomicU64>,
    pub mismatches: AtomicU64,
    pub failed: Mutex<Vec<(u32, LayerError)>>,
    pub cancel: AtomicBool,
    pub writes: AtomicU64,
    /// Cancel after this many writes (0: never).
    pub cancel_after: u64,
}

impl VerifySink {
    pub fn new(g: &KvGeometry, prefix_seed: u64, tokens: &[u32]) -> Self {
        let lens: Vec<u64> = tokens
            .iter()
            .map(|&t| t as u64 * g.bytes_per_token_per_layer())
            .collect();
        let mut offsets = Vec::new();
        let mut a = 0;
        for &l in &lens {
            offsets.push(a);
            a += l;
        }
        VerifySink {
            prefix_seed,
            offsets,
            lens,
            layer_bytes: a,
            done: (0..g.layers).map(|_| AtomicU64::new(0)).collect(),
            mismatches: AtomicU64::new(0),
            failed: Mutex::new(Vec::new()),
            cancel: AtomicBool::new(false),
            writes: AtomicU64::new(0),
            cancel_after: 0,
        }
    }
    /// Layers whose every byte arrived and matched.
    pub fn complete_layers(&self) -> usize {
        self.done
            .iter()
            .filter(|d| d.load(Ordering::Relaxed) == self.layer_bytes)
            .count()
    }
    pub fn failed_layers(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .failed
            .lock()
            .unwrap()
            .iter()
            .map(|(l, _)| *l)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

impl LayerSink for VerifySink {
    fn write(&self, layer: u32, offset: u64, data: &[u8]) -> LayerResult<()> {
        if offset + data.len() as u64 > self.layer_bytes {
            return Err(LayerError::GeometryMismatch {
                chunk: 0,
                reason: "past the end".into(),
            });
        }
        let n = self.writes.fetch_add(1, Ordering::Relaxed) + 1;
        if self.cancel_after > 0 && n >= self.cancel_after {
            self.cancel.store(true, Ordering::Relaxed);
        }
        let mut expect = vec![0u8; data.len()];
        let mut filled = 0usize;
        while filled < data.len() {
            let pos = offset + filled as u64;
            let c = self.offsets.partition_point(|&o| o <= pos) - 1;
            let within = pos - self.offsets[c];
            let n = ((self.lens[c] - within) as usize).min(data.len() - filled);
            fill(
                seed(self.prefix_seed, c, layer),
                within,
                &mut expect[filled..filled + n],
            );
            filled += n;
        }
        if expect != data {
            self.mismatches.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
    fn placed(&self, _layer: u32, _offset: u64, _len: u64) -> LayerResult<()> {
        // TCP delivers bytes through `write` only.
        Err(LayerError::GeometryMismatch {
            chunk: 0,
            reason: "placed() is not used over TCP".into(),
        })
    }
    fn complete(&self, layer: u32, bytes: u64) {
        self.done[layer as usize].fetch_add(bytes, Ordering::Relaxed);
    }
    fn fail(&self, layer: u32, err: LayerError) {
        self.failed.lock().unwrap().push((layer, err));
    }
    fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// Settings of a test server: loopback, port 0, one access key, the test bucket.
pub fn config() -> ServerConfig {
    ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        access_keys: vec![AccessKey {
            access_key: ACCESS.into(),
            secret_key: SECRET.into(),
        }],
        buckets: vec![BUCKET.into()],
        fsync: false,
        shutdown_grace_secs: 2,
        ..ServerConfig::default()
    }
}

pub async fn start(store: Arc<dyn Store>, cfg: ServerConfig) -> ServerHandle {
    objectcache::server::start_with_store(cfg, store)
        .await
        .expect("server starts")
}

/// `GET path` over plain HTTP/1.1; returns (status, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    http_exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"),
    )
    .await
}

/// `HEAD path` over plain HTTP/1.1; returns (status, body), the body empty where the server
/// keeps to HTTP's rule for HEAD.
pub async fn http_head(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    http_exchange(
        addr,
        format!("HEAD {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"),
    )
    .await
}

/// Sends one HTTP/1.1 request (`Connection: close`) and reads the whole answer; returns
/// (status, body).
async fn http_exchange(addr: std::net::SocketAddr, request: String) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let status = http_status(&text);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// `POST path` with a JSON `body` over plain HTTP/1.1; returns (status, body).
pub async fn http_post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
    http_exchange(
        addr,
        format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .await
}

/// The status code of an HTTP/1.1 response that begins `text` (`HTTP/1.1 200 OK...`); 0 if
/// there is none.
pub fn http_status(text: &str) -> u16 {
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A metric's value from the text exposition (first sample whose line starts with `name`).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The test server's access key pair, as a gather client presents it.
pub fn creds() -> Option<(String, String)> {
    Some((ACCESS.into(), SECRET.into()))
}

/// A gather client of the server at `addr`, authenticated with the test access key.
pub async fn gather_client(addr: std::net::SocketAddr) -> GatherClient {
    GatherClient::connect_with(addr, creds()).await.unwrap()
}

/// Starts `loads` gather loads at once, each on a client of its own to the server at `addr`:
/// load `i` reads the saved prefix of seed `seeds[i % seeds.len()]` and chunk sizes `tokens`
/// into a [`VerifySink`]. Each task returns the load's mismatched writes, complete layers and
/// bytes delivered.
pub fn spawn_verified_loads(
    addr: std::net::SocketAddr,
    g: &KvGeometry,
    tokens: &[u32],
    seeds: &[u64],
    loads: u64,
) -> Vec<tokio::task::JoinHandle<(u64, usize, u64)>> {
    (0..loads)
        .map(|i| {
            let (g, tokens) = (g.clone(), tokens.to_vec());
            let s = seeds[(i % seeds.len() as u64) as usize];
            tokio::spawn(async move {
                let mut c = gather_client(addr).await;
                let sink = VerifySink::new(&g, s, &tokens);
                let r = c.load(&request(&g, s, &tokens), &sink).await.unwrap();
                (
                    sink.mismatches.load(Ordering::Relaxed),
                    sink.complete_layers(),
                    r.bytes,
                )
            })
        })
        .collect()
}

/// `objectcache serve` running as a child process; killed and reaped when dropped.
pub struct ServeProcess(pub std::process::Child);

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `objectcache serve --listen LISTEN --store STORE --bucket BUCKET --access-key
/// ACCESS:SECRET EXTRA...`, waits for its readiness line on stdout and returns the process
/// and the address it listens on. `stderr`: where the server's log goes.
pub fn spawn_serve(
    listen: &str,
    store: &std::ffi::OsStr,
    extra: &[&str],
    stderr: std::process::Stdio,
) -> (ServeProcess, std::net::SocketAddr) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_objectcache"))
        .args(["serve", "--listen", listen, "--bucket", BUCKET])
        .arg("--store")
        .arg(store)
        .args(["--access-key", &format!("{ACCESS}:{SECRET}")])
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("spawn objectcache serve");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("readiness line {line:?}"));
    (ServeProcess(child), addr)
}

/// An S3 store (path-style, the test keys) on the server at `endpoint` (its
/// `ServerHandle::endpoint`), bucket [`BUCKET`].
#[cfg(feature = "s3")]
pub async fn s3_store_on(endpoint: &str) -> Arc<dyn Store> {
    use objectcache::store::{S3Config, S3Store};
    let cfg = S3Config::at_endpoint(BUCKET, endpoint.to_string(), ACCESS, SECRET);
    Arc::new(S3Store::new(cfg).await.expect("S3 client"))
}
