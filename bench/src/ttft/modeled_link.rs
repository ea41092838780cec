//! The measured half of `ttft --mode modeled`: an ObjectCache server started in this process
//! on loopback, behind a TCP proxy that caps the server-to-client direction at a fixed rate
//! (the "link"), and real loads of real chunk objects through it over each path.
//!
//! Every path (gather, ranged GETs, whole-object GETs, NIXL's OBJ plugin) connects to the
//! proxy, so all of them share one capped link, exactly as loads share a NIC. The pacer is
//! store-and-forward: a block of `n` bytes read from the server is written to the client no
//! earlier than `max(link free, now - BURST_S) + n / rate`, and the link is then busy until
//! that time, so the bytes delivered by time `t` never exceed `rate x (t + BURST_S)` (a token
//! bucket holding [`BURST_S`] seconds of bytes).

use anyhow::{anyhow, bail, Context, Result};
use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadRequest};
use objectcache::layout::{decode_chunk, ChunkHash, KeyBuilder, KvGeometry};
use objectcache::store::{MemoryStore, S3Config, S3Store, Store, StoreExt};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Key namespace of the benchmark's objects.
pub const NAMESPACE: &str = "bench-modeled";
/// Bucket of the benchmark's objects (NIXL needs at least 3 characters).
pub const BUCKET: &str = "kv-modeled";
/// Access key of the in-process server.
pub const ACCESS_KEY: &str = "bench";
/// Secret key of the in-process server.
pub const SECRET_KEY: &str = "bench-secret";

/// Burst allowance of the capped link, seconds at the cap rate (4 ms): timers sleep at
/// millisecond granularity, so a strict pacer would lose up to 1 ms per block.
pub const BURST_S: f64 = 0.004;

/// Blocks (of at most 1 MiB) the link may have delivered ahead of the client's reads.
const DELIVERY_QUEUE: usize = 32;

/// Shared pacer of the capped link: when the link is next free.
struct Pacer {
    rate: f64,
    t0: Instant,
    free_s: Mutex<f64>,
}

impl Pacer {
    /// Reserves the link for `n` bytes; returns when their last byte has crossed it.
    fn reserve(&self, n: usize) -> Instant {
        let now = self.t0.elapsed().as_secs_f64();
        let mut f = self.free_s.lock().expect("pacer lock");
        // A token bucket of BURST_S seconds' worth of bytes: time the timer overshoots a
        // sleep is not lost to the link, and idle time beyond BURST_S is.
        let start = f.max(now - BURST_S);
        *f = start + n as f64 / self.rate;
        self.t0 + Duration::from_secs_f64(*f)
    }
}

/// Server plus capped proxy, both on the caller's runtime.
pub struct Link {
    /// The proxy's address (capped; every load and save goes through it).
    pub proxy_addr: SocketAddr,
    _server: objectcache::server::ServerHandle,
}

impl Link {
    /// `http://` endpoint of the capped proxy.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.proxy_addr)
    }
}

async fn pipe_up(mut r: tokio::net::tcp::OwnedReadHalf, mut w: tokio::net::tcp::OwnedWriteHalf) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if w.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = w.shutdown().await;
}

async fn pipe_down(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    pacer: Arc<Pacer>,
) {
    // The link delivers into a receive queue of up to DELIVERY_QUEUE blocks (a NIC ring and
    // socket buffer); a writer drains it into the client's socket as fast as the client
    // reads, so a client that is briefly descheduled lags on its own without idling the link.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(DELIVERY_QUEUE);
    let writer = tokio::spawn(async move {
        while let Some(b) = rx.recv().await {
            if w.write_all(&b).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    });
    loop {
        let mut buf = vec![0u8; 1 << 20];
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                buf.truncate(n);
                let at = pacer.reserve(n);
                tokio::time::sleep_until(at.into()).await;
                if tx.send(buf).await.is_err() {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.await;
}

/// Starts the server over an in-memory store and the capped proxy in front of it.
///
/// # Errors
/// If the server cannot start or a port cannot be bound.
pub async fn start(rate: f64) -> Result<Link> {
    if !(rate > 0.0 && rate.is_finite()) {
        bail!("loopback cap must be a positive number of bytes/s, got {rate}");
    }
    let cfg = objectcache::server::ServerConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        store: "memory:".into(),
        fsync: false,
        access_keys: vec![objectcache::server::AccessKey {
            access_key: ACCESS_KEY.into(),
            secret_key: SECRET_KEY.into(),
        }],
        buckets: vec![BUCKET.into()],
        log_filter: "warn".into(),
        ..Default::default()
    };
    let server = objectcache::server::start_with_store(cfg, Arc::new(MemoryStore::new()))
        .await
        .map_err(|e| anyhow!("starting the in-process ObjectCache server: {e}"))?;
    let server_addr = server.local_addr();
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let proxy_addr = listener.local_addr()?;
    let pacer = Arc::new(Pacer {
        rate,
        t0: Instant::now(),
        free_s: Mutex::new(0.0),
    });
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let pacer = pacer.clone();
            tokio::spawn(async move {
                let Ok(up) = TcpStream::connect(server_addr).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = up.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (ur, uw) = up.into_split();
                tokio::spawn(pipe_up(cr, uw));
                pipe_down(ur, cw, pacer).await;
            });
        }
    });
    Ok(Link {
        proxy_addr,
        _server: server,
    })
}

/// An S3 store client of the capped endpoint.
///
/// # Errors
/// If the client cannot be built.
pub async fn s3_store(link: &Link) -> Result<Arc<dyn Store>> {
    let cfg = S3Config::at_endpoint(BUCKET.to_string(), link.endpoint(), ACCESS_KEY, SECRET_KEY);
    Ok(Arc::new(S3Store::new(cfg).await.map_err(|e| {
        anyhow!("S3 client of the in-process server: {e}")
    })?))
}

/// An engine over `store`, loading through gather (`gather = true`) or ranged GETs.
///
/// # Errors
/// If the engine cannot start.
pub fn engine(store: Arc<dyn Store>, gather: bool) -> Result<Engine> {
    let mut cfg = EngineConfig::default();
    cfg.set("namespace", NAMESPACE)
        .map_err(|e| anyhow!("engine config: {e}"))?;
    cfg.gather = gather;
    Engine::with_store(store, cfg).map_err(|e| anyhow!("engine: {e}"))
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Chunk hashes of a synthetic prefix (distinct per `salt`).
pub fn hashes(n: usize, salt: u64) -> Vec<ChunkHash> {
    (0..n)
        .map(|c| {
            let mut d = [0u8; 32];
            for (k, w) in d.chunks_mut(8).enumerate() {
                w.copy_from_slice(&splitmix(salt ^ (c as u64 * 4 + k as u64) << 8).to_le_bytes());
            }
            ChunkHash::from_digest(d)
        })
        .collect()
}

/// Pseudo-random per-layer KV of `chunks` chunks: layer `l` is `chunks x slice_bytes` bytes.
pub fn layer_data(g: &KvGeometry, chunks: usize, salt: u64) -> Vec<Vec<u8>> {
    let n = chunks * g.slice_bytes() as usize;
    (0..g.layers)
        .map(|l| {
            let mut v = vec![0u8; n];
            let s = splitmix(salt << 16 | l as u64);
            for (i, w) in v.chunks_mut(8).enumerate() {
                let x = splitmix(s ^ i as u64).to_le_bytes();
                w.copy_from_slice(&x[..w.len()]);
            }
            v
        })
        .collect()
}

fn touched(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    v.iter_mut().step_by(4096).for_each(|b| *b = 1);
    v
}

/// One measured load: when each layer landed in host memory (s since the load started).
#[derive(Debug, Clone)]
pub struct Measured {
    /// Per-layer landing times, seconds (real, unscaled).
    pub ready_s: Vec<f64>,
    /// Storage requests (gather: 1; ranged GETs: as counted by the engine).
    pub requests: u64,
}

impl Measured {
    /// When the last layer landed.
    pub fn last(&self) -> f64 {
        self.ready_s.iter().copied().fold(0.0, f64::max)
    }
}

/// Loads `hashes` through `engine` into fresh host buffers, checks every byte against
/// `expect`, and returns the per-layer landing times.
///
/// # Errors
/// If the load fails or a byte differs.
pub fn engine_load(
    engine: &Engine,
    g: &KvGeometry,
    hashes: &[ChunkHash],
    expect: &[Vec<u8>],
) -> Result<Measured> {
    let layer_bytes = hashes.len() * g.slice_bytes() as usize;
    let dest = LayerBuffers::from_vecs((0..g.layers).map(|_| touched(layer_bytes)).collect());
    let h = engine
        .load(
            LoadRequest {
                geometry: g.clone(),
                hashes: hashes.to_vec(),
                hints: Default::default(),
            },
            dest,
        )
        .map_err(|e| anyhow!("load: {e}"))?;
    h.wait_all_blocking().map_err(|e| anyhow!("load: {e}"))?;
    let ready: Vec<f64> = h
        .layer_ready_s()
        .into_iter()
        .enumerate()
        .map(|(l, r)| r.ok_or_else(|| anyhow!("layer {l} never became ready")))
        .collect::<Result<_>>()?;
    let st = h.stats();
    for (l, e) in expect.iter().enumerate() {
        let got = h
            .layer(l)
            .ok_or_else(|| anyhow!("layer {l} not readable"))?;
        if got[..layer_bytes] != e[..layer_bytes] {
            bail!("layer {l}: loaded bytes differ from the saved ones");
        }
    }
    Ok(Measured {
        ready_s: ready,
        requests: st.requests,
    })
}

/// Chunkwise load: every chunk's whole object by one GET (`concurrency` in flight), decoded
/// and copied into per-layer host buffers; every layer is ready when the last object is.
///
/// # Errors
/// If a GET fails, an object does not decode, or a byte differs from `expect`.
pub async fn chunkwise_load(
    store: &Arc<dyn Store>,
    kb: &KeyBuilder,
    g: &KvGeometry,
    hashes: &[ChunkHash],
    expect: &[Vec<u8>],
    concurrency: usize,
) -> Result<Measured> {
    let sl = g.slice_bytes() as usize;
    let mut dest: Vec<Vec<u8>> = (0..g.layers).map(|_| touched(hashes.len() * sl)).collect();
    let t0 = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    let mut next = 0usize;
    let mut got = 0usize;
    let mut requests = 0u64;
    while got < hashes.len() {
        while next < hashes.len() && set.len() < concurrency {
            let (s, k, i) = (store.clone(), kb.data(&hashes[next]), next);
            set.spawn(async move { (i, s.get_bytes(&k).await) });
            next += 1;
            requests += 1;
        }
        let (i, obj) = set
            .join_next()
            .await
            .ok_or_else(|| anyhow!("no GET in flight"))?
            .context("GET task")?;
        let obj = obj.map_err(|e| anyhow!("GET of chunk {i}: {e}"))?;
        let (_, slices) =
            decode_chunk(g, g.tokens_per_chunk, &obj).map_err(|e| anyhow!("chunk {i}: {e}"))?;
        for (l, s) in slices.iter().enumerate() {
            dest[l][i * sl..(i + 1) * sl].copy_from_slice(s);
        }
        got += 1;
    }
    let t = t0.elapsed().as_secs_f64();
    for (l, e) in expect.iter().enumerate() {
        if dest[l][..] != e[..hashes.len() * sl] {
            bail!("chunkwise: layer {l} differs from the saved bytes");
        }
    }
    Ok(Measured {
        ready_s: vec![t; g.layers as usize],
        requests,
    })
}
