//! `objectcache-bench traffic`: many requests, most of them sharing a few prefixes, against
//! the in-process ObjectCache server under a bandwidth cap, once per scheduling policy.
//!
//! Workloads (each run against every policy):
//! - `burst`: `--requests` requests posted at once;
//! - `poisson`: the same number as a Poisson stream whose offered load (every request's bytes,
//!   before any sharing) is `--load` times the cap;
//! - `trace`: the Mooncake-style trace in `tests/data/traces/mooncake_small.jsonl` (synthetic,
//!   in the format of the FAST'25 Mooncake traces; the repository holds no public trace), its
//!   timestamps scaled by `--trace-time-scale`; each request loads its cached prefix (the run of
//!   leading 512-token blocks seen in earlier requests), at most `--max-chunks` chunks.
//!
//! In `burst` and `poisson` the prefixes are drawn by popularity: Zipf (`--zipf`) over
//! `--prefixes` prefixes whose lengths cycle through `--prefix-chunks`. Every request loads its
//! whole prefix through one engine with default settings (gather, two streams per load, one
//! fetch for concurrent loads of the same chunks).
//!
//! Per workload and policy it reports mean, p50 and p99 TTFL and TTLL (seconds from the load
//! call to layer 0 / the last layer landed and verified), the bytes the server sent divided by
//! the unique bytes requested, fetches per chunk (loads that fetched, weighted by their chunks,
//! per distinct chunk), and the simulator's prediction for the same arrivals
//! (`objectcache::sim` under the same policy and cap, with the engine's rule for which loads
//! share a fetch applied to the simulated progress) beside the measured figures. After the
//! timing, every load's bytes are compared with the saved ones, byte for byte; a difference
//! or a miss fails the run.
//!
//! Here: the arguments, records, the server and the runs; the workloads in `workload.rs`, the
//! simulator's prediction in `predict.rs`, the SVG in `plot.rs`.

mod plot;
mod predict;
mod workload;

use plot::svg;
use predict::predict;
use workload::{chunk_layers, synthetic, trace, Req};

use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadHandle, LoadRequest};
use objectcache::sim::engine::percentile;
use objectcache::store::{MemoryStore, S3Config, S3Store, Store};
use objectcache::{ChunkHash, KvGeometry};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BUCKET: &str = "kv-traffic";
const ACCESS: &str = "traffic";
const SECRET: &str = "traffic-secret-key";

/// Arguments of `objectcache-bench traffic`.
#[derive(Debug, clap::Args)]
pub struct TrafficArgs {
    /// Model geometry preset.
    #[arg(long, default_value = "smollm2-135m")]
    model: String,
    /// The server's bandwidth cap, bytes/s.
    #[arg(long, default_value_t = 200_000_000)]
    cap: u64,
    /// Policies of the server's scheduler, one run each (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fifo,priority,equal,byte-prop,stall-aware"
    )]
    policies: Vec<String>,
    /// Workloads (comma-separated): `burst`, `poisson`, `trace`.
    #[arg(long, value_delimiter = ',', default_value = "burst,poisson,trace")]
    workloads: Vec<String>,
    /// Requests of the `burst` and `poisson` workloads.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Distinct prefixes the requests draw from.
    #[arg(long, default_value_t = 8)]
    prefixes: usize,
    /// Prefix lengths in chunks, cycled over the prefixes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16")]
    prefix_chunks: Vec<usize>,
    /// Zipf exponent of the prefixes' popularity (rank r drawn with weight r^-s).
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Offered load of the `poisson` workload, as a fraction of the cap (every request's
    /// bytes, before sharing).
    #[arg(long, default_value_t = 0.7)]
    load: f64,
    /// Time scale of the `trace` workload (0.1 replays it 10 times faster).
    #[arg(long, default_value_t = 0.1)]
    trace_time_scale: f64,
    /// Largest prefix a `trace` request loads, chunks.
    #[arg(long, default_value_t = 16)]
    max_chunks: usize,
    /// Seed of the workloads.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the records as a JSON array here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write one SVG per workload here (measured against predicted TTLL per policy).
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
    /// A node tier in the server, in front of the store the chunks were saved to (the remote
    /// store): this many bytes of DRAM (0: no tier). Each run starts with an empty tier.
    #[arg(long, default_value_t = 0)]
    tier_dram_bytes: u64,
}

/// Mean, p50 and p99 of a set of times, seconds.
#[derive(Debug, Clone, Copy, Serialize)]
struct Stats {
    mean: f64,
    p50: f64,
    p99: f64,
}

impl Stats {
    fn of(v: &[f64]) -> Self {
        Stats {
            mean: v.iter().sum::<f64>() / v.len().max(1) as f64,
            p50: percentile(v, 50.0),
            p99: percentile(v, 99.0),
        }
    }
}

/// One (workload, policy) run (field names are stable; see docs/benchmarks.md).
#[derive(Debug, Serialize)]
struct Record {
    workload: String,
    policy: String,
    model: String,
    cap_bytes_per_s: u64,
    requests: usize,
    /// Seconds from the first arrival to the last layer of the last load.
    span_s: f64,
    ttfl_s: Stats,
    ttll_s: Stats,
    /// The simulator's prediction for the same arrivals.
    predicted_ttfl_s: Stats,
    predicted_ttll_s: Stats,
    /// `ttll_s.mean / predicted_ttll_s.mean`.
    ttll_measured_over_predicted: f64,
    /// Bytes the server sent (its `gather_out` counter) / bytes of the distinct chunks asked.
    bytes_moved_over_unique: f64,
    /// Chunks fetched (by loads that fetched) per distinct chunk asked.
    fetches_per_chunk: f64,
    /// Loads that followed another load's fetch.
    loads_followed: u64,
    unique_bytes: u64,
    bytes_moved: u64,
    /// Bytes the server read from the remote store since it started, the warm-up load's one
    /// chunk included (through the node tier when `--tier-dram-bytes` is set; otherwise
    /// every backend read), and over the unique bytes.
    remote_bytes: u64,
    remote_bytes_over_unique: f64,
    /// GET-class requests (GETs, ranged GETs, HEADs) the server sent to the remote store
    /// since it started, as `remote_bytes`.
    remote_requests: u64,
    /// The node tier's DRAM bytes (0: none).
    tier_dram_bytes: u64,
    /// What the remote store bills, per load on average over the run's loads (its requests
    /// and bytes at [`crate::cost::S3_STANDARD`]'s list prices, the server in the store's
    /// region), and what keeping the unique chunks costs a month; no saves are timed here.
    #[serde(flatten)]
    cost: crate::cost::Cost,
}

struct Server {
    handle: objectcache::server::ServerHandle,
}

async fn server(backend: Arc<dyn Store>, policy: &str, cap: u64) -> anyhow::Result<Server> {
    server_over(None, backend, policy, cap).await
}

/// A server over `backend`, or over the node tier `tier` (in front of `backend`) when given.
async fn server_over(
    tier: Option<Arc<objectcache::store::TieredStore>>,
    backend: Arc<dyn Store>,
    policy: &str,
    cap: u64,
) -> anyhow::Result<Server> {
    let cfg = objectcache::server::ServerConfig {
        listen: "127.0.0.1:0".parse()?,
        access_keys: vec![objectcache::server::AccessKey {
            access_key: ACCESS.into(),
            secret_key: SECRET.into(),
        }],
        buckets: vec![BUCKET.into()],
        scheduler: policy.into(),
        bandwidth_cap_bytes_per_s: cap,
        fsync: false,
        log_filter: "warn".into(),
        ..Default::default()
    };
    let handle = match tier {
        Some(t) => objectcache::server::start_with_tier(cfg, t).await,
        None => objectcache::server::start_with_store(cfg, backend).await,
    };
    Ok(Server {
        handle: handle.map_err(|e| anyhow::anyhow!("{e}"))?,
    })
}

async fn s3_on(endpoint: &str) -> anyhow::Result<Arc<dyn Store>> {
    let cfg = S3Config::at_endpoint(BUCKET, endpoint.to_string(), ACCESS, SECRET);
    Ok(Arc::new(
        S3Store::new(cfg)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    ))
}

fn engine(store: Arc<dyn Store>) -> anyhow::Result<Engine> {
    let mut cfg = EngineConfig::from_pairs([("load_timeout_ms", "0")])?;
    cfg.namespace = "traffic".into();
    Ok(Engine::with_store(store, cfg)?)
}

/// Runs one workload under one policy; returns its record.
fn run_one(
    rt: &tokio::runtime::Runtime,
    backend: &Arc<dyn Store>,
    args: &TrafficArgs,
    g: &KvGeometry,
    name: &str,
    policy: &str,
    reqs: &[Req],
) -> anyhow::Result<Record> {
    // The remote store of the run: the saved chunks, counting what is read from it.
    let remote = Arc::new(objectcache::store::MeteredStore::new(backend.clone()));
    let srv = if args.tier_dram_bytes > 0 {
        let tier = objectcache::store::TieredStore::new(
            remote.clone(),
            objectcache::store::TierConfig {
                dram_bytes: args.tier_dram_bytes,
                disk_dir: None,
                disk_bytes: 0,
                admission: objectcache::store::Admission::All,
            },
        )?;
        rt.block_on(server_over(
            Some(Arc::new(tier)),
            remote.clone(),
            policy,
            args.cap,
        ))?
    } else {
        rt.block_on(server(remote.clone(), policy, args.cap))?
    };
    let store = rt.block_on(s3_on(&srv.handle.endpoint()))?;
    let e = engine(store)?;
    // Warm: the engine learns that gather is offered and opens its connections.
    let warm = &reqs[0].hashes[..1];
    let h = e.load(
        LoadRequest::new(g.clone(), warm.to_vec()),
        LayerBuffers::allocate(g.layers as usize, g.slice_bytes() as usize),
    )?;
    h.wait_all_blocking()?;
    drop(h);
    let m = srv.handle.metrics();
    let b0 = m.bytes_total("gather_out");
    let followed0 = e.metrics().loads_followed;
    let t0 = Instant::now();
    let mut handles: Vec<LoadHandle> = Vec::with_capacity(reqs.len());
    for r in reqs {
        let at = t0 + Duration::from_secs_f64(r.arrival_s);
        if let Some(d) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        let n = r.hashes.len() * g.slice_bytes() as usize;
        handles.push(e.load(
            LoadRequest::new(g.clone(), r.hashes.clone()),
            LayerBuffers::allocate(g.layers as usize, n),
        )?);
    }
    let mut ttfl = Vec::new();
    let mut ttll = Vec::new();
    let mut fetched_chunks = 0usize;
    for (h, r) in handles.iter().zip(reqs) {
        h.wait_all_blocking()
            .map_err(|e| anyhow::anyhow!("{name}/{policy}: a load missed: {e}"))?;
        let s = h.stats();
        ttfl.push(s.ttfl_s.unwrap_or(0.0));
        ttll.push(s.ttll_s.unwrap_or(0.0));
        if s.requests > 0 {
            fetched_chunks += r.hashes.len();
        }
    }
    let span = t0.elapsed().as_secs_f64();
    // Every load's bytes against the saved ones, byte for byte (after the timing).
    let mut want: HashMap<&ChunkHash, Vec<Vec<u8>>> = HashMap::new();
    for (i, (h, r)) in handles.into_iter().zip(reqs).enumerate() {
        let got = h
            .into_buffers()
            .into_vecs()
            .ok_or_else(|| anyhow::anyhow!("{name}/{policy}: load {i} has no owned buffers"))?;
        let slice = g.slice_bytes() as usize;
        for (l, layer) in got.iter().enumerate() {
            for (c, hash) in r.hashes.iter().enumerate() {
                let w = want.entry(hash).or_insert_with(|| chunk_layers(g, hash));
                anyhow::ensure!(
                    layer[c * slice..(c + 1) * slice] == w[l][..],
                    "{name}/{policy}: load {i}, layer {l}, chunk {c}: the loaded bytes differ from the saved ones"
                );
            }
        }
    }
    let moved = m.bytes_total("gather_out") - b0;
    // From the server's start: the warm-up's chunk included (it fills the tier).
    let remote_bytes = remote.stats().read_bytes;
    let remote_requests = remote.stats().gets;
    let followed = e.metrics().loads_followed - followed0;
    drop(e);
    rt.block_on(srv.handle.shutdown());
    let unique: HashSet<&ChunkHash> = reqs.iter().flat_map(|r| r.hashes.iter()).collect();
    let unique_bytes = unique.len() as u64 * g.slice_bytes() * g.layers as u64;
    let kind = objectcache::server::sched::link_policy(policy)
        .ok_or_else(|| anyhow::anyhow!("unknown policy {policy}"))?;
    let pred = predict(reqs, g, kind, args.cap as f64)?;
    let pf: Vec<f64> = pred.iter().map(|p| p.0).collect();
    let pl: Vec<f64> = pred.iter().map(|p| p.1).collect();
    let (ttll_s, predicted_ttll_s) = (Stats::of(&ttll), Stats::of(&pl));
    Ok(Record {
        workload: name.into(),
        policy: policy.into(),
        model: g.model.clone(),
        cap_bytes_per_s: args.cap,
        requests: reqs.len(),
        span_s: span,
        ttfl_s: Stats::of(&ttfl),
        ttll_s,
        predicted_ttfl_s: Stats::of(&pf),
        predicted_ttll_s,
        ttll_measured_over_predicted: ttll_s.mean / predicted_ttll_s.mean.max(1e-9),
        bytes_moved_over_unique: moved as f64 / unique_bytes.max(1) as f64,
        fetches_per_chunk: fetched_chunks as f64 / unique.len().max(1) as f64,
        loads_followed: followed,
        unique_bytes,
        bytes_moved: moved,
        remote_bytes,
        remote_bytes_over_unique: remote_bytes as f64 / unique_bytes.max(1) as f64,
        remote_requests,
        tier_dram_bytes: args.tier_dram_bytes,
        cost: crate::cost::S3_STANDARD
            .cost(true, remote_requests, remote_bytes, 0, unique_bytes)
            .averaged_over(reqs.len() as u64),
    })
}

/// Runs the benchmark.
///
/// # Errors
/// A message if the server, the store or a load fails.
pub fn run(args: TrafficArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let g = KvGeometry::preset(&args.model)?;
    let mut workloads: Vec<(String, Vec<Req>)> = Vec::new();
    for w in &args.workloads {
        let reqs = match w.as_str() {
            "burst" => synthetic(&args, &g, false),
            "poisson" => synthetic(&args, &g, true),
            "trace" => trace(&args, &g)?,
            other => anyhow::bail!("unknown workload {other:?} (burst, poisson, trace)"),
        };
        anyhow::ensure!(!reqs.is_empty(), "workload {w} has no requests");
        workloads.push((w.clone(), reqs));
    }
    // Save every distinct chunk once, into one backend every server of the run shares.
    let backend: Arc<dyn Store> = Arc::new(MemoryStore::new());
    {
        let srv = rt.block_on(server(backend.clone(), "fifo", 0))?;
        let e = engine(rt.block_on(s3_on(&srv.handle.endpoint()))?)?;
        let mut saved: HashSet<ChunkHash> = HashSet::new();
        for (_, reqs) in &workloads {
            for r in reqs {
                for h in &r.hashes {
                    if saved.insert(h.clone()) {
                        let data = chunk_layers(&g, h);
                        let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
                        e.save_blocking(&g, std::slice::from_ref(h), &refs)?;
                    }
                }
            }
        }
        drop(e);
        rt.block_on(srv.handle.shutdown());
        eprintln!("traffic: {} distinct chunks saved", saved.len());
    }
    let mut records = Vec::new();
    println!(
        "{:<8} {:<12} {:>4} | {:>8} {:>8} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8} {:>6} | {:>6} {:>6} {:>6} | {:>7} {:>8}",
        "workload", "policy", "reqs", "TTFL", "p50", "p99", "TTLL", "p50", "p99", "sim TTLL", "sim p99", "m/sim", "bytes", "fetch", "remote", "GETs/ld", "$/1k ld"
    );
    for (name, reqs) in &workloads {
        for policy in &args.policies {
            let r = run_one(&rt, &backend, &args, &g, name, policy, reqs)?;
            println!(
                "{:<8} {:<12} {:>4} | {:>8.3} {:>8.3} {:>8.3} | {:>8.3} {:>8.3} {:>8.3} | {:>8.3} {:>8.3} {:>6.3} | {:>6.2} {:>6.2} {:>6.2} | {:>7.2} {:>8.5}",
                r.workload,
                r.policy,
                r.requests,
                r.ttfl_s.mean,
                r.ttfl_s.p50,
                r.ttfl_s.p99,
                r.ttll_s.mean,
                r.ttll_s.p50,
                r.ttll_s.p99,
                r.predicted_ttll_s.mean,
                r.predicted_ttll_s.p99,
                r.ttll_measured_over_predicted,
                r.bytes_moved_over_unique,
                r.fetches_per_chunk,
                r.remote_bytes_over_unique,
                r.remote_requests as f64 / r.requests.max(1) as f64,
                r.cost.cost_usd_per_1k_loads
            );
            records.push(r);
        }
    }
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&records)?)?;
    }
    if let Some(dir) = &args.svg {
        std::fs::create_dir_all(dir)?;
        for (name, _) in &workloads {
            let rs: Vec<&Record> = records.iter().filter(|r| &r.workload == name).collect();
            std::fs::write(dir.join(format!("traffic-{name}.svg")), svg(name, &rs))?;
        }
    }
    Ok(())
}
