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

use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadHandle, LoadRequest};
use objectcache::sched::{ComputeModel, GpuKind, KernelClass, PolicyKind};
use objectcache::sim::engine::percentile;
use objectcache::sim::{simulate_instance, Instance, Request, SimConfig, SimPolicy};
use objectcache::store::{Addressing, MemoryStore, S3Config, S3Credentials, S3Store, Store};
use objectcache::{ChunkHash, KvGeometry};
use serde::Serialize;
use sha2::{Digest, Sha256};
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
}

/// One request of a workload: when, and which chunks (the leading chunks of a chain).
#[derive(Debug, Clone)]
struct Req {
    arrival_s: f64,
    hashes: Vec<ChunkHash>,
}

fn chain(seed: &[u8], chunks: usize) -> Vec<ChunkHash> {
    let mut h = Sha256::digest(seed).into();
    (0..chunks)
        .map(|i| {
            let mut d = Sha256::new();
            d.update(h);
            d.update((i as u64).to_le_bytes());
            h = d.finalize().into();
            ChunkHash::from_digest(h)
        })
        .collect()
}

/// A small seeded generator (SplitMix64): the same seed gives the same workload everywhere.
struct SplitMix(u64);

impl SplitMix {
    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf-popular prefixes, `n` requests: at once (`burst`) or as a Poisson stream.
fn synthetic(args: &TrafficArgs, g: &KvGeometry, poisson: bool) -> Vec<Req> {
    let mut rng = SplitMix(args.seed);
    let prefixes: Vec<Vec<ChunkHash>> = (0..args.prefixes)
        .map(|p| {
            let c = args.prefix_chunks[p % args.prefix_chunks.len()];
            chain(format!("traffic-prefix-{p}").as_bytes(), c)
        })
        .collect();
    let w: Vec<f64> = (1..=args.prefixes)
        .map(|r| (r as f64).powf(-args.zipf))
        .collect();
    let total: f64 = w.iter().sum();
    let pick = |rng: &mut SplitMix| {
        let mut x = rng.next_f64() * total;
        for (i, wi) in w.iter().enumerate() {
            if x < *wi {
                return i;
            }
            x -= wi;
        }
        w.len() - 1
    };
    let picks: Vec<usize> = (0..args.requests).map(|_| pick(&mut rng)).collect();
    let bytes_per_chunk = (g.slice_bytes() * g.layers as u64) as f64;
    let mean_bytes = picks
        .iter()
        .map(|&p| prefixes[p].len() as f64 * bytes_per_chunk)
        .sum::<f64>()
        / picks.len().max(1) as f64;
    let rate = args.load * args.cap as f64 / mean_bytes.max(1.0);
    let mut t = 0.0;
    picks
        .into_iter()
        .map(|p| {
            if poisson {
                t += -(1.0 - rng.next_f64()).ln() / rate;
            }
            Req {
                arrival_s: t,
                hashes: prefixes[p].clone(),
            }
        })
        .collect()
}

/// The repository's Mooncake-style trace: each request loads its cached prefix.
fn trace(args: &TrafficArgs, g: &KvGeometry) -> anyhow::Result<Vec<Req>> {
    #[derive(serde::Deserialize)]
    struct Line {
        timestamp: f64,
        hash_ids: Vec<u64>,
        input_length: u64,
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/data/traces/mooncake_small.jsonl"
    );
    let text = std::fs::read_to_string(path)?;
    let per_block = (512 / g.tokens_per_chunk).max(1) as usize;
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Vec::new();
    let mut t0 = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let r: Line = serde_json::from_str(line)?;
        let start = *t0.get_or_insert(r.timestamp);
        let hit = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count();
        seen.extend(r.hash_ids.iter().copied());
        let chunks = (hit * per_block)
            .min(((r.input_length - 1) / g.tokens_per_chunk as u64) as usize)
            .min(args.max_chunks);
        if chunks == 0 {
            continue;
        }
        // Chunk i's hash depends on every block before it (equal ids, equal prefix).
        let mut hashes = Vec::with_capacity(chunks);
        let mut h: [u8; 32] = Sha256::digest(b"traffic-trace").into();
        for i in 0..chunks {
            let mut d = Sha256::new();
            d.update(h);
            d.update(r.hash_ids[i / per_block].to_le_bytes());
            d.update(((i % per_block) as u64).to_le_bytes());
            h = d.finalize().into();
            hashes.push(ChunkHash::from_digest(h));
        }
        out.push(Req {
            arrival_s: (r.timestamp - start) / 1000.0 * args.trace_time_scale,
            hashes,
        });
    }
    Ok(out)
}

/// Deterministic KV bytes of one chunk's layers.
fn chunk_layers(g: &KvGeometry, h: &ChunkHash) -> Vec<Vec<u8>> {
    let slice = g.slice_bytes() as usize;
    (0..g.layers)
        .map(|l| {
            let mut v = vec![0u8; slice];
            let mut x =
                u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes")) ^ l as u64;
            for w in v.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
            }
            v
        })
        .collect()
}

/// The simulator's prediction for `reqs` (arrival order) under `kind` at `cap`: per request
/// (TTFL, TTLL) in seconds after its arrival. Loads share fetches by the engine's rule
/// (`connector/flight.rs`): a load follows a fetching load in flight whose chunks begin with
/// its own and which has at most twice its bytes still to come; followers land each layer
/// when their leader does. Which loads fetch depends on the simulated progress, so the
/// prediction iterates (simulate the fetching loads, re-decide who follows) until the set of
/// fetching loads is stable.
fn predict(
    reqs: &[Req],
    g: &KvGeometry,
    kind: PolicyKind,
    cap: f64,
) -> anyhow::Result<Vec<(f64, f64)>> {
    let model = ComputeModel::preset(&g.model, GpuKind::H100, KernelClass::Tuned)
        .or_else(|_| ComputeModel::preset("smollm2-135m", GpuKind::H100, KernelClass::Tuned))?;
    let cfg = SimConfig {
        model,
        kv_bytes_per_token_per_layer: g.bytes_per_token_per_layer(),
        chunk_tokens: g.tokens_per_chunk as u64,
        capacity: cap,
        max_rate_per_load: f64::INFINITY,
    };
    let layers = g.layers as usize;
    let bytes = |r: &Req| r.hashes.len() as u64 * g.slice_bytes() * layers as u64;
    // Start with every load fetching.
    let mut leader: Vec<Option<usize>> = vec![None; reqs.len()];
    let mut sim_out: HashMap<usize, (Vec<f64>, f64)> = HashMap::new();
    for _round in 0..20 {
        let fetching: Vec<usize> = (0..reqs.len()).filter(|&i| leader[i].is_none()).collect();
        let inst = Instance {
            requests: fetching
                .iter()
                .map(|&i| Request {
                    arrival_s: reqs[i].arrival_s,
                    prefix_tokens: reqs[i].hashes.len() as u64 * g.tokens_per_chunk as u64,
                    new_tokens: 0,
                })
                .collect(),
        };
        let out = simulate_instance(
            &inst,
            &cfg,
            SimPolicy {
                kind,
                planner: false,
            },
        )?;
        sim_out = fetching
            .iter()
            .zip(out)
            .map(|(&i, o)| (i, (o.layer_ready_s, o.load_end_s)))
            .collect();
        // Re-decide, in arrival order, with the simulated progress.
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by(|&a, &b| {
            reqs[a]
                .arrival_s
                .total_cmp(&reqs[b].arrival_s)
                .then(a.cmp(&b))
        });
        let mut next: Vec<Option<usize>> = vec![None; reqs.len()];
        let mut leaders: Vec<usize> = Vec::new();
        for &i in &order {
            let t = reqs[i].arrival_s;
            let n = reqs[i].hashes.len();
            let pick = leaders
                .iter()
                .copied()
                .filter(|&j| reqs[j].hashes.len() >= n && reqs[j].hashes[..n] == reqs[i].hashes[..])
                .filter_map(|j| {
                    let (ready, end) = sim_out.get(&j)?;
                    if t >= *end {
                        return None;
                    }
                    // Bytes still to come at t, from the layer landing times.
                    let per_layer = bytes(&reqs[j]) as f64 / layers as f64;
                    let mut done = 0.0;
                    let mut prev = reqs[j].arrival_s;
                    for &r in ready {
                        if t >= r {
                            done += per_layer;
                        } else {
                            if r > prev && t > prev {
                                done += per_layer * (t - prev) / (r - prev);
                            }
                            break;
                        }
                        prev = r;
                    }
                    let left = bytes(&reqs[j]) as f64 - done;
                    (left <= 2.0 * bytes(&reqs[i]) as f64).then_some(j)
                })
                .min_by_key(|&j| reqs[j].hashes.len());
            match pick {
                Some(j) => next[i] = Some(j),
                None => leaders.push(i),
            }
        }
        if next == leader {
            break;
        }
        leader = next;
    }
    Ok((0..reqs.len())
        .map(|i| {
            let a = reqs[i].arrival_s;
            let src = leader[i].unwrap_or(i);
            match sim_out.get(&src) {
                Some((ready, end)) => {
                    let first = ready.first().copied().unwrap_or(*end);
                    ((first.max(a) - a).max(0.0), (end.max(a) - a).max(0.0))
                }
                None => (0.0, 0.0),
            }
        })
        .collect())
}

struct Server {
    handle: objectcache::server::ServerHandle,
}

async fn server(backend: Arc<dyn Store>, policy: &str, cap: u64) -> anyhow::Result<Server> {
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
    Ok(Server {
        handle: objectcache::server::start_with_store(cfg, backend)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    })
}

async fn s3_on(endpoint: &str) -> anyhow::Result<Arc<dyn Store>> {
    let mut cfg = S3Config::new(BUCKET);
    cfg.endpoint = Some(endpoint.to_string());
    cfg.region = Some("us-east-1".into());
    cfg.addressing = Some(Addressing::Path);
    cfg.credentials = S3Credentials::Static {
        access_key: ACCESS.into(),
        secret_key: SECRET.into(),
        session_token: None,
    };
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
    let srv = rt.block_on(server(backend.clone(), policy, args.cap))?;
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
        "{:<8} {:<12} {:>4} | {:>8} {:>8} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8} {:>6} | {:>6} {:>6}",
        "workload", "policy", "reqs", "TTFL", "p50", "p99", "TTLL", "p50", "p99", "sim TTLL", "sim p99", "m/sim", "bytes", "fetch"
    );
    for (name, reqs) in &workloads {
        for policy in &args.policies {
            let r = run_one(&rt, &backend, &args, &g, name, policy, reqs)?;
            println!(
                "{:<8} {:<12} {:>4} | {:>8.3} {:>8.3} {:>8.3} | {:>8.3} {:>8.3} {:>8.3} | {:>8.3} {:>8.3} {:>6.3} | {:>6.2} {:>6.2}",
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
                r.fetches_per_chunk
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

/// Grouped bars: measured mean TTLL and the simulator's, per policy, with p99 ticks.
fn svg(name: &str, rs: &[&Record]) -> String {
    use std::fmt::Write;
    let (w, h, left, top, bottom) = (760.0, 380.0, 70.0, 40.0, 60.0);
    let ph = h - top - bottom;
    let hi = rs
        .iter()
        .flat_map(|r| [r.ttll_s.p99, r.predicted_ttll_s.p99])
        .fold(1e-3, f64::max)
        * 1.1;
    let y = |v: f64| top + ph * (1.0 - v / hi);
    let group = (w - left - 20.0) / rs.len().max(1) as f64;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        s,
        r#"<text x="{left}" y="20" font-size="14">traffic, {name}: mean TTLL measured (blue) and simulated (orange), p99 ticks</text>"#
    );
    let _ = write!(
        s,
        r##"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#000"/>"##,
        top + ph,
        w - 20.0,
        top + ph
    );
    for k in 0..=4 {
        let v = hi * k as f64 / 4.0;
        let _ = write!(
            s,
            r##"<text x="{}" y="{}" text-anchor="end">{v:.2} s</text><line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#ddd"/>"##,
            left - 6.0,
            y(v) + 4.0,
            y(v),
            w - 20.0,
            y(v)
        );
    }
    for (i, r) in rs.iter().enumerate() {
        let x0 = left + group * i as f64 + group * 0.15;
        let bw = group * 0.35;
        for (j, (st, c)) in [(r.ttll_s, "#4c72b0"), (r.predicted_ttll_s, "#dd8452")]
            .iter()
            .enumerate()
        {
            let x = x0 + bw * j as f64;
            let _ = write!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="{bw:.1}" height="{:.1}" fill="{c}"/>"#,
                y(st.mean),
                top + ph - y(st.mean)
            );
            let _ = write!(
                s,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#000" stroke-width="2"/>"##,
                y(st.p99),
                x + bw,
                y(st.p99)
            );
        }
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            x0 + bw,
            top + ph + 18.0,
            r.policy
        );
    }
    s.push_str("</svg>");
    s
}
