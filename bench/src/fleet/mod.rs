//! `objectcache-bench fleet`: N vLLM replicas (OpenAI-compatible servers, CPU) behind a
//! router, replaying a generated trace with streaming clients, per method and routing:
//!
//! - `none`: vLLM's own prefix cache in each replica, no connector;
//! - `objectcache-file`: `ObjectCacheConnector` on a directory every replica shares;
//! - `objectcache-server`: the connector on an ObjectCache server without a node tier, a
//!   gateway in front of an S3 endpoint (Ceph RGW);
//! - `objectcache-tier`: the same server with its node tier (DRAM, and disk if asked).
//!
//! Every replica keeps vLLM's prefix cache on (the connector supplies what the replica does
//! not hold). Each method starts its replicas (and its server) fresh; its routings run one
//! after another on them, each on the trace with other tokens (same arrivals, lengths and
//! think times: [`trace::generate`]'s salt), so that no pass hits what an earlier one left.
//!
//! By concern: the traces and the ideal cache (`trace.rs`), the routers (`router.rs`), the
//! replay (`play.rs`), the plot (`plot.rs`); the vLLM processes, HTTP client and package set-up
//! are the `vllm` benchmark's.

mod play;
mod plot;
mod router;
mod trace;

use crate::cost::{Cost, S3_STANDARD};
use crate::vllm::http;
use crate::vllm::process::{Env, Vllm};
use crate::vllm::setup::{
    aws_env, install_package, locate, python_out, s3_store, spinner, ObjectCacheServer,
};
use crate::vllm::{native_dtype, MODELS};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use play::Outcome;
use router::{Router, ROUTINGS};
use serde::Serialize;
use std::collections::HashMap;
use std::path::PathBuf;
use trace::{generate, TraceParams, KINDS};

/// Every method, in run order (`none` first: its outputs are the reference).
pub const METHODS: &[&str] = &[
    "none",
    "objectcache-file",
    "objectcache-server",
    "objectcache-tier",
];

/// vLLM's block size on the CPU (tokens): prefix caches hit whole blocks.
const BLOCK: usize = 128;

/// Arguments of `objectcache-bench fleet`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct FleetArgs {
    /// The directory `scripts/vllm-setup.sh DIR` made (`venv/`, `models/`).
    #[arg(
        long,
        value_name = "DIR",
        env = "OBJECTCACHE_VLLM_DIR",
        default_value = "target/vllm"
    )]
    pub venv: PathBuf,
    /// The model: a name of `objectcache-bench vllm --list-models` (default `smollm2`), or a
    /// model folder.
    #[arg(long, value_name = "NAME|DIR")]
    pub model: Option<String>,
    /// vLLM replicas of every method (each its own process, its compute threads bound to one
    /// core, replica i to core i modulo the cores).
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Traces to replay (`chat`, `agent`, `docs`), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "chat")]
    pub trace: Vec<String>,
    /// Requests per trace.
    #[arg(long, default_value_t = 40)]
    pub requests: usize,
    /// Sessions (docs: requests) started per second (default: the trace's own, in the JSON).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Seed of the traces.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Methods to run (default: all), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub methods: Option<Vec<String>>,
    /// Routings (`round-robin`, `prefix`), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "round-robin,prefix")]
    pub routing: Vec<String>,
    /// Greedy tokens generated per request (all compared with `none`'s).
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u32,
    /// KV cache of each replica, GiB (`VLLM_CPU_KVCACHE_SPACE`).
    #[arg(long, default_value_t = 1)]
    pub kv_cache_gib: u32,
    /// KV cache blocks of each replica (`--num-gpu-blocks-override`; 0: what the GiB hold),
    /// to make replicas evict as a busy GPU does.
    #[arg(long, default_value_t = 0)]
    pub kv_blocks: u32,
    /// Model dtype (`--dtype`; `auto` as `objectcache-bench vllm`'s). `float32` by default:
    /// in bfloat16 a request whose prefix came from a cache (vLLM's own, or the connector)
    /// rounds differently from one that computed it, and greedy outputs of the small model
    /// on random tokens then differ between methods (seen: 4 of 16 requests of `chat` with 2
    /// replicas, `objectcache-tier` against `none`; none in float32), which would hide a
    /// connector that loads wrong bytes.
    #[arg(long, default_value = "float32", value_parser = ["auto", "bfloat16", "float16", "float32"])]
    pub dtype: String,
    /// The S3 endpoint behind the ObjectCache server of `objectcache-server` and
    /// `objectcache-tier` (`s3://BUCKET/PREFIX?endpoint=URL`; default: the test endpoint of
    /// `OBJECTCACHE_TEST_S3_*`, Ceph RGW at 127.0.0.1:7480, when it answers).
    #[arg(long, value_name = "URL")]
    pub s3: Option<String>,
    /// `objectcache-tier`: DRAM level of the node tier, bytes.
    #[arg(long, default_value_t = 2_000_000_000)]
    pub tier_dram_bytes: u64,
    /// `objectcache-tier`: disk level of the node tier, bytes (0: none; a temporary
    /// directory otherwise).
    #[arg(long, default_value_t = 0)]
    pub tier_disk_bytes: u64,
    /// `objectcache-tier`: admission (`all`, `second`, `second:SECONDS`).
    #[arg(long, default_value = "all")]
    pub tier_admission: String,
    /// Write every record and the configuration as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Write the plots (`fleet-ttft-TRACE.svg`: TTFT over time per method) into this
    /// directory.
    #[arg(long, value_name = "DIR")]
    pub svg: Option<PathBuf>,
    /// `ffi/python` of this repository (installed with pip into a temporary directory).
    #[arg(long, value_name = "DIR")]
    pub package_src: Option<PathBuf>,
    /// Keep the logs in this directory (default: a temporary one, removed).
    #[arg(long, value_name = "DIR")]
    pub logs: Option<PathBuf>,
}

/// The node tier's counters over one pass (server metrics, differences).
#[derive(Debug, Clone, Default, Serialize)]
pub struct TierCounters {
    /// Reads served from a level (DRAM and disk).
    pub hits: u64,
    /// Reads no level held.
    pub misses: u64,
    /// Objects fetched from the remote store for misses, and their bytes.
    pub fills: u64,
    pub fill_bytes: u64,
    /// Reads that waited for another read's fetch.
    pub fills_shared: u64,
    /// Objects evicted from a level.
    pub evictions: u64,
    /// Objects admission kept out.
    pub refused: u64,
    /// Publish-marker reads (lookups) answered by the tier without the remote store.
    pub marker_hits: u64,
}

/// One method under one routing on one trace (field names are stable; docs/benchmarks.md).
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub method: String,
    pub routing: String,
    pub trace: String,
    pub replicas: usize,
    pub requests: usize,
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`, local and
    /// external) over prompt tokens.
    pub hit_rate: f64,
    /// What an infinite cache shared by every replica would supply, over prompt tokens
    /// ([`trace::ideal`]).
    pub ideal_hit_rate: f64,
    /// `hit_rate / ideal_hit_rate`.
    pub hit_over_ideal: f64,
    /// Tokens vLLM's own prefix caches supplied (`vllm:prefix_cache_hits`, all replicas).
    pub local_hit_tokens: u64,
    /// Tokens the connector supplied (`vllm:external_prefix_cache_hits`).
    pub external_hit_tokens: u64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub ttft_mean_s: f64,
    /// Requests over the seconds from the first request sent to the last response's end.
    pub requests_per_s: f64,
    pub span_s: f64,
    /// Bytes read from the remote store: the server's backend reads
    /// (`objectcache_server_backend_bytes_total{dir="read"}`) for the server methods, the
    /// connectors' loaded bytes for the shared directory, 0 for `none`.
    pub remote_bytes: u64,
    /// GET-class requests to the remote store (server methods).
    pub remote_requests: Option<u64>,
    /// Bytes of the distinct chunks the ideal cache reuses (each loaded once by a perfect
    /// fleet): distinct blocks hit x KV bytes per block.
    pub unique_bytes: u64,
    /// `remote_bytes / unique_bytes`.
    pub remote_over_unique: f64,
    /// KV bytes the connectors loaded (`vllm:objectcache_loaded_bytes`).
    pub loaded_bytes: u64,
    /// Loads the connectors posted (`vllm:objectcache_loads`).
    pub loads: u64,
    /// What the remote store bills per load, at S3 Standard list prices (server methods).
    #[serde(flatten)]
    pub cost: Cost,
    /// The node tier's counters (`objectcache-tier`).
    pub tier: Option<TierCounters>,
    /// Requests each replica served.
    pub per_replica: Vec<usize>,
    /// Whether every output equals `none`'s for the same request (`None` without `none`).
    pub outputs_equal_none: Option<bool>,
    /// Requests whose output differs from `none`'s.
    pub outputs_differing: usize,
    /// Every request.
    pub outcomes: Vec<Outcome>,
    /// Why the method did not run.
    pub note: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    vllm: String,
    model: String,
    dtype: String,
    cpus: usize,
    kv_bytes_per_block: u64,
    args: &'a FleetArgs,
    traces: Vec<TraceParams>,
    replica_startup_s: HashMap<String, Vec<f64>>,
    records: Vec<Record>,
}

/// Runs `objectcache-bench fleet`.
///
/// # Errors
/// Bad arguments (named), a missing venv or model, a vLLM replica or server that does not
/// start, a request that fails.
pub fn run(mut a: FleetArgs) -> Result<()> {
    for t in &a.trace {
        if !KINDS.contains(&t.as_str()) {
            bail!("unknown trace {t:?}; traces: {}", KINDS.join(", "));
        }
    }
    for r in &a.routing {
        if !ROUTINGS.contains(&r.as_str()) {
            bail!("unknown routing {r:?}; routings: {}", ROUTINGS.join(", "));
        }
    }
    let chosen = a
        .methods
        .clone()
        .unwrap_or_else(|| METHODS.iter().map(|s| s.to_string()).collect());
    for m in &chosen {
        if !METHODS.contains(&m.as_str()) {
            bail!("unknown method {m:?}; methods: {}", METHODS.join(", "));
        }
    }
    let methods: Vec<&str> = METHODS
        .iter()
        .copied()
        .filter(|m| chosen.iter().any(|c| c == m))
        .collect();
    if a.replicas == 0 || a.requests == 0 {
        bail!("--replicas and --requests must be at least 1");
    }
    if a.rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        bail!("--rate must be a positive number of sessions per second");
    }
    aws_env();
    let spec = MODELS
        .iter()
        .find(|m| Some(m.name) == a.model.as_deref().or(Some("smollm2")))
        .copied()
        .unwrap_or(MODELS[0]);
    let (py, model) = locate(&a.venv, a.model.as_deref(), &spec)?;
    if a.dtype == "auto" {
        a.dtype =
            native_dtype(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default()).to_string();
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json"))?)
            .context("the model's config.json")?;
    let vocab = cfg["vocab_size"].as_u64().unwrap_or(32_000) as u32;
    let block_bytes = kv_bytes_per_token(&cfg, &a.dtype)? * BLOCK as u64;
    let traces: Vec<TraceParams> = a
        .trace
        .iter()
        .map(|k| {
            let mut p = TraceParams::of(k, a.requests, a.seed);
            if let Some(r) = a.rate {
                p.rate_per_s = r;
            }
            p
        })
        .collect();
    for p in &traces {
        let longest = generate(p, vocab, 0)
            .turns()
            .iter()
            .map(|t| t.prompt.len())
            .max()
            .unwrap_or(0);
        if longest as u32 + a.max_tokens > spec.max_len {
            bail!(
                "trace {}: a prompt of {longest} tokens and {} generated do not fit the \
                 model's context of {}",
                p.kind,
                a.max_tokens,
                spec.max_len
            );
        }
    }

    let tmp = tempfile::tempdir()?;
    let logs = match &a.logs {
        Some(d) => d.clone(),
        None => tmp.path().join("logs"),
    };
    std::fs::create_dir_all(&logs)?;
    let mp = MultiProgress::new();
    let site = install_package(&py, a.package_src.as_deref(), tmp.path(), &mp)?;
    let vllm_version = python_out(&py, "import vllm; print(vllm.__version__)", &site)?;
    let mut env = Env::fleet(
        &py,
        &model,
        &site,
        &logs,
        a.kv_cache_gib,
        &a.dtype,
        spec.max_len,
        mp.clone(),
    );
    // The store and its server stand in for machines of their own: on a machine this small,
    // replicas whose compute threads spin on every core starve them (Ceph RGW answered marker
    // reads in 2-3 s, and lookups were given up). The replicas yield to them.
    env.nice = 10;
    if a.kv_blocks > 0 {
        env.extra_args = vec!["--num-gpu-blocks-override".into(), a.kv_blocks.to_string()];
    }
    let rt = tokio::runtime::Runtime::new()?;
    let needs_s3 = methods
        .iter()
        .any(|m| *m == "objectcache-server" || *m == "objectcache-tier");
    let backend = if needs_s3 {
        s3_store(a.s3.as_deref(), &rt)?
    } else {
        Err(String::new())
    };

    let mut f = Fleet {
        a: &a,
        env: &env,
        rt: &rt,
        traces: &traces,
        vocab,
        block_bytes,
        tmp: tmp.path().to_path_buf(),
        logs: logs.clone(),
        mp: mp.clone(),
        records: Vec::new(),
        startup: HashMap::new(),
        reference: HashMap::new(),
    };
    for m in methods {
        let (is_server, is_tier) = (m == "objectcache-server", m == "objectcache-tier");
        if is_server || is_tier {
            if let Err(why) = &backend {
                f.not_run(m, why);
                continue;
            }
        }
        f.method(m, backend.as_ref().ok().map(String::as_str))?;
    }
    let (records, startup) = (f.records, f.startup);
    print_table(&records);
    if let Some(dir) = &a.svg {
        std::fs::create_dir_all(dir)?;
        for t in &a.trace {
            let path = dir.join(format!("fleet-ttft-{t}.svg"));
            plot::ttft_over_time(&path, t, &records)?;
            println!("plot: {}", path.display());
        }
    }
    if let Some(path) = &a.json {
        let rep = Report {
            benchmark: "fleet",
            vllm: vllm_version,
            model: model.display().to_string(),
            dtype: a.dtype.clone(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kv_bytes_per_block: block_bytes,
            args: &a,
            traces: traces.clone(),
            replica_startup_s: startup,
            records,
        };
        std::fs::write(path, serde_json::to_string_pretty(&rep)? + "\n")?;
        println!("json: {}", path.display());
    }
    Ok(())
}

/// KV bytes per token of a dense model's `config.json` at `dtype`: layers x 2 (K and V) x
/// KV heads x head size x bytes per element.
fn kv_bytes_per_token(cfg: &serde_json::Value, dtype: &str) -> Result<u64> {
    let u = |k: &str| cfg[k].as_u64();
    let (Some(layers), Some(heads)) = (u("num_hidden_layers"), u("num_attention_heads")) else {
        bail!("config.json: no num_hidden_layers or num_attention_heads");
    };
    let kv_heads = u("num_key_value_heads").unwrap_or(heads);
    let head = match u("head_dim") {
        Some(h) => h,
        None => u("hidden_size").context("config.json: no hidden_size")? / heads,
    };
    let elem = if dtype == "float32" { 4 } else { 2 };
    Ok(layers * 2 * kv_heads * head * elem)
}

/// The run's state across methods.
struct Fleet<'a> {
    a: &'a FleetArgs,
    env: &'a Env,
    rt: &'a tokio::runtime::Runtime,
    traces: &'a [TraceParams],
    vocab: u32,
    block_bytes: u64,
    tmp: PathBuf,
    logs: PathBuf,
    mp: MultiProgress,
    records: Vec<Record>,
    /// Start-up seconds of each method's replicas.
    startup: HashMap<String, Vec<f64>>,
    /// `none`'s outputs by (trace, routing), by request id.
    reference: HashMap<(String, String), Vec<String>>,
}

/// Metric samples before and after a pass, summed over processes.
type Samples = HashMap<String, f64>;

fn delta(before: &Samples, after: &Samples, key: &str) -> u64 {
    let g = |m: &Samples| m.get(key).copied().unwrap_or(0.0);
    (g(after) - g(before)).max(0.0).round() as u64
}

impl Fleet<'_> {
    fn not_run(&mut self, method: &str, why: &str) {
        for p in self.traces {
            for routing in &self.a.routing {
                let mut r = empty_record(method, routing, &p.kind, self.a.replicas);
                r.note = Some(why.to_string());
                self.records.push(r);
            }
        }
    }

    /// Starts `method`'s server (if any) and replicas, and runs every trace and routing.
    fn method(&mut self, method: &str, backend: Option<&str>) -> Result<()> {
        let server = match method {
            "objectcache-server" | "objectcache-tier" => {
                let backend = backend.expect("the server methods run with a backend");
                // Each server its own prefix of the bucket: no method reads another's chunks.
                let store = with_prefix(backend, method);
                let mut extra = Vec::new();
                if method == "objectcache-tier" {
                    extra.extend([
                        "--tier-dram-bytes".to_string(),
                        self.a.tier_dram_bytes.to_string(),
                        "--tier-admission".into(),
                        self.a.tier_admission.clone(),
                    ]);
                    if self.a.tier_disk_bytes > 0 {
                        let d = self.tmp.join("tier-disk");
                        std::fs::create_dir_all(&d)?;
                        extra.extend([
                            "--tier-disk-dir".to_string(),
                            d.display().to_string(),
                            "--tier-disk-bytes".into(),
                            self.a.tier_disk_bytes.to_string(),
                        ]);
                    }
                }
                Some(ObjectCacheServer::start_with(
                    &store,
                    &extra,
                    &self.logs,
                    &format!("{method}-server.log"),
                )?)
            }
            _ => None,
        };
        let url = match (method, &server) {
            ("none", _) => None,
            ("objectcache-file", _) => Some(format!(
                "file://{}",
                self.tmp.join("fleet-file-store").display()
            )),
            (_, Some(s)) => Some(s.url()),
            _ => unreachable!("a server method has its server"),
        };
        let kv = url.map(|u| {
            serde_json::json!({
                "kv_connector": "ObjectCacheConnector",
                "kv_connector_module_path": "objectcache.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"store": u, "namespace": "bench-fleet"},
            })
        });
        let replicas = self.start_replicas(method, kv.as_ref())?;
        let ports: Vec<u16> = replicas.iter().map(|v| v.port).collect();
        let server_port = server.as_ref().map(|s| port_of(s.addr())).transpose()?;
        for p in self.traces {
            for routing in self.a.routing.clone() {
                let salt = ROUTINGS.iter().position(|r| *r == routing).unwrap_or(0) as u64;
                let tr = generate(p, self.vocab, salt);
                let rec = self.pass(method, &routing, &tr, &ports, server_port)?;
                self.records.push(rec);
            }
        }
        for v in replicas {
            v.stop()?;
        }
        drop(server);
        if let (Some(b), true) = (backend, method != "objectcache-file") {
            // What the method saved in the remote store, removed: a test endpoint of bounded
            // capacity (Ceph RGW on memstore in CI) fills up over a few runs otherwise.
            // Best effort: a store too slow to list now keeps them, and the run its figures.
            let url = with_prefix(b, method);
            let msg = match self.rt.block_on(remove_all(&url)) {
                Ok(n) => format!("{method}: removed its {n} objects from the S3 store"),
                Err(e) => format!("{method}: could not remove what it saved under {url}: {e:#}"),
            };
            self.mp.println(msg)?;
        }
        Ok(())
    }

    /// The replicas of `method`, started as many at once as there are cores (a start-up is
    /// CPU-bound: more at once only starve the store's processes), each bound to its core,
    /// and warmed (the first request of a process pays one-time costs).
    fn start_replicas(
        &mut self,
        method: &str,
        kv: Option<&serde_json::Value>,
    ) -> Result<Vec<Vllm>> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let ids: Vec<usize> = (0..self.a.replicas).collect();
        let mut started: Vec<Result<Vllm>> = Vec::new();
        for wave in ids.chunks(cpus.max(1)) {
            started.extend(std::thread::scope(|s| {
                let hs: Vec<_> = wave
                    .iter()
                    .map(|&i| {
                        let (env, rt) = (self.env, self.rt);
                        s.spawn(move || {
                            Vllm::start_bound(
                                env,
                                rt,
                                &format!("{method}-{i}"),
                                true,
                                kv,
                                Some(&(i % cpus).to_string()),
                            )
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("a replica's start thread"))
                    .collect::<Vec<_>>()
            }));
        }
        let replicas: Vec<Vllm> = started.into_iter().collect::<Result<_>>()?;
        self.startup.insert(
            method.to_string(),
            replicas.iter().map(|v| v.startup_s).collect(),
        );
        let warm: Vec<u32> = (0..64).map(|i| 1000 + i).collect();
        for v in &replicas {
            self.rt
                .block_on(http::complete(v.port, &self.model(), &warm, 2))
                .with_context(|| format!("warm-up request to vLLM ({})", v.label))?;
        }
        Ok(replicas)
    }

    fn model(&self) -> String {
        self.env.model.display().to_string()
    }

    fn samples(&self, ports: &[u16]) -> Result<Samples> {
        let mut all = Samples::new();
        for &p in ports {
            for (k, v) in self.rt.block_on(http::metrics(p))? {
                *all.entry(k).or_insert(0.0) += v;
            }
        }
        Ok(all)
    }

    /// One trace under one routing on running replicas.
    fn pass(
        &mut self,
        method: &str,
        routing: &str,
        tr: &trace::Trace,
        ports: &[u16],
        server: Option<u16>,
    ) -> Result<Record> {
        let server_samples = |rt: &tokio::runtime::Runtime| -> Result<Samples> {
            match server {
                Some(p) => rt.block_on(http::metrics_at(p, "/_objectcache/metrics")),
                None => Ok(Samples::new()),
            }
        };
        let (v0, s0) = (self.samples(ports)?, server_samples(self.rt)?);
        let pb = self.mp.add(ProgressBar::new(tr.requests() as u64));
        pb.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:30}] {pos}/{len} requests {elapsed} (eta {eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        pb.set_message(format!("{} {method} {routing}", tr.params.kind));
        let out = self.rt.block_on(play::play(
            tr,
            ports,
            &self.model(),
            self.a.max_tokens,
            BLOCK,
            Router::new(routing, ports.len()),
            &pb,
        ));
        pb.finish_and_clear();
        let out = out.with_context(|| format!("{} {method} {routing}", tr.params.kind))?;
        // Saves finish after responses: wait for the connectors' counters to settle, so that
        // the next pass starts with nothing in flight.
        let s = spinner(&self.mp, format!("{method}: waiting for saves"));
        let mut v1 = self.samples(ports)?;
        for _ in 0..20 {
            std::thread::sleep(std::time::Duration::from_millis(500));
            let v = self.samples(ports)?;
            let same = v.get("vllm:objectcache_saved_bytes_total")
                == v1.get("vllm:objectcache_saved_bytes_total");
            v1 = v;
            if same {
                break;
            }
        }
        s.finish_and_clear();
        let s1 = server_samples(self.rt)?;
        self.mp.println(format!(
            "{} {method} {routing}: {} requests done",
            tr.params.kind,
            out.len()
        ))?;

        let (ideal_hits, ideal_blocks) = trace::ideal(tr, BLOCK);
        let mut rec = empty_record(method, routing, &tr.params.kind, ports.len());
        let prompt: u64 = out.iter().map(|o| o.prompt_tokens).sum();
        let cached: u64 = out.iter().map(|o| o.cached_tokens).sum();
        rec.requests = out.len();
        rec.prompt_tokens = prompt;
        rec.hit_rate = cached as f64 / prompt.max(1) as f64;
        rec.ideal_hit_rate = ideal_hits.iter().sum::<usize>() as f64 / prompt.max(1) as f64;
        rec.hit_over_ideal = rec.hit_rate / rec.ideal_hit_rate.max(1e-12);
        rec.local_hit_tokens = delta(&v0, &v1, "vllm:prefix_cache_hits_total");
        rec.external_hit_tokens = delta(&v0, &v1, "vllm:external_prefix_cache_hits_total");
        let mut ttft: Vec<f64> = out.iter().map(|o| o.ttft_s).collect();
        ttft.sort_by(f64::total_cmp);
        rec.ttft_p50_s = percentile(&ttft, 50.0);
        rec.ttft_p99_s = percentile(&ttft, 99.0);
        rec.ttft_mean_s = ttft.iter().sum::<f64>() / ttft.len().max(1) as f64;
        let first = out.iter().map(|o| o.sent_s).fold(f64::INFINITY, f64::min);
        let last = out.iter().map(|o| o.sent_s + o.done_s).fold(0.0, f64::max);
        rec.span_s = (last - first).max(0.0);
        rec.requests_per_s = out.len() as f64 / rec.span_s.max(1e-9);
        rec.loaded_bytes = delta(&v0, &v1, "vllm:objectcache_loaded_bytes_total");
        rec.loads = delta(&v0, &v1, "vllm:objectcache_loads_total");
        rec.unique_bytes = ideal_blocks as u64 * self.block_bytes;
        rec.remote_bytes = match method {
            "none" => 0,
            "objectcache-file" => rec.loaded_bytes,
            _ => delta(
                &s0,
                &s1,
                "objectcache_server_backend_bytes_total{dir=\"read\"}",
            ),
        };
        rec.remote_over_unique = rec.remote_bytes as f64 / rec.unique_bytes.max(1) as f64;
        if server.is_some() {
            let gets = delta(
                &s0,
                &s1,
                "objectcache_server_backend_requests_total{class=\"get\"}",
            );
            rec.remote_requests = Some(gets);
            rec.cost = S3_STANDARD
                .cost(true, gets, rec.remote_bytes, 0, 0)
                .averaged_over(rec.loads);
        }
        if method == "objectcache-tier" {
            rec.tier = Some(TierCounters {
                hits: delta(&s0, &s1, "objectcache_tier_hits_total"),
                misses: delta(&s0, &s1, "objectcache_tier_misses_total"),
                fills: delta(&s0, &s1, "objectcache_tier_fills_total"),
                fill_bytes: delta(&s0, &s1, "objectcache_tier_fill_bytes_total"),
                fills_shared: delta(&s0, &s1, "objectcache_tier_fills_shared_total"),
                evictions: delta(&s0, &s1, "objectcache_tier_evictions_total"),
                refused: delta(&s0, &s1, "objectcache_tier_refused_total"),
                marker_hits: delta(&s0, &s1, "objectcache_tier_marker_hits_total"),
            });
        }
        rec.per_replica = (0..ports.len())
            .map(|r| out.iter().filter(|o| o.replica == r).count())
            .collect();
        let key = (tr.params.kind.clone(), routing.to_string());
        if method == "none" {
            self.reference
                .insert(key, out.iter().map(|o| o.text.clone()).collect());
        }
        if let Some(want) = self
            .reference
            .get(&(tr.params.kind.clone(), routing.to_string()))
        {
            rec.outputs_differing = out.iter().zip(want).filter(|(o, w)| o.text != **w).count();
            rec.outputs_equal_none = Some(rec.outputs_differing == 0 && want.len() == out.len());
        }
        rec.outcomes = out;
        Ok(rec)
    }
}

fn empty_record(method: &str, routing: &str, trace: &str, replicas: usize) -> Record {
    Record {
        method: method.into(),
        routing: routing.into(),
        trace: trace.into(),
        replicas,
        requests: 0,
        prompt_tokens: 0,
        hit_rate: 0.0,
        ideal_hit_rate: 0.0,
        hit_over_ideal: 0.0,
        local_hit_tokens: 0,
        external_hit_tokens: 0,
        ttft_p50_s: 0.0,
        ttft_p99_s: 0.0,
        ttft_mean_s: 0.0,
        requests_per_s: 0.0,
        span_s: 0.0,
        remote_bytes: 0,
        remote_requests: None,
        unique_bytes: 0,
        remote_over_unique: 0.0,
        loaded_bytes: 0,
        loads: 0,
        cost: Cost::default(),
        tier: None,
        per_replica: Vec::new(),
        outputs_equal_none: None,
        outputs_differing: 0,
        outcomes: Vec::new(),
        note: None,
    }
}

/// Deletes every object of the store at `url` (16 at a time); returns how many.
async fn remove_all(url: &str) -> Result<usize> {
    use futures::{StreamExt, TryStreamExt};
    let store = objectcache::store::open_store(url).await?;
    let objects = store.list("", usize::MAX).await?;
    let n = objects.len();
    futures::stream::iter(objects)
        .map(|o| {
            let store = store.clone();
            async move { store.delete(&o.key).await }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(n)
}

/// `s3://BUCKET/PREFIX?QUERY` with `/NAME` appended to its prefix.
fn with_prefix(url: &str, name: &str) -> String {
    match url.split_once('?') {
        Some((base, q)) => format!("{}/{name}?{q}", base.trim_end_matches('/')),
        None => format!("{}/{name}", url.trim_end_matches('/')),
    }
}

fn port_of(addr: &str) -> Result<u16> {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in the server's address {addr:?}"))
}

/// Nearest-rank percentile of sorted `v`.
fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[i.clamp(1, v.len()) - 1]
}

fn print_table(records: &[Record]) {
    println!(
        "{:<6} {:<19} {:<11} {:>6} {:>6} {:>6} {:>8} {:>8} {:>6} {:>9} {:>9} {:>6} {:>7}",
        "trace",
        "method",
        "routing",
        "hit%",
        "ideal%",
        "/ideal",
        "TTFT p50",
        "p99",
        "req/s",
        "remote MB",
        "unique MB",
        "/uniq",
        "= none"
    );
    for r in records {
        if let Some(n) = &r.note {
            println!("{:<6} {:<19} {:<11} {n}", r.trace, r.method, r.routing);
            continue;
        }
        println!(
            "{:<6} {:<19} {:<11} {:>6.1} {:>6.1} {:>6.2} {:>8.3} {:>8.3} {:>6.2} {:>9.1} {:>9.1} {:>6.2} {:>7}",
            r.trace,
            r.method,
            r.routing,
            r.hit_rate * 100.0,
            r.ideal_hit_rate * 100.0,
            r.hit_over_ideal,
            r.ttft_p50_s,
            r.ttft_p99_s,
            r.requests_per_s,
            r.remote_bytes as f64 / 1e6,
            r.unique_bytes as f64 / 1e6,
            r.remote_over_unique,
            match r.outputs_equal_none {
                Some(true) => "yes".to_string(),
                Some(false) => format!("{} diff", r.outputs_differing),
                None => "-".into(),
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_bytes_per_token_of_smollm2s_geometry() {
        let cfg = serde_json::json!({"num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "hidden_size": 576});
        assert_eq!(
            kv_bytes_per_token(&cfg, "float32").unwrap(),
            30 * 2 * 3 * 64 * 4
        );
        assert_eq!(
            kv_bytes_per_token(&cfg, "bfloat16").unwrap(),
            30 * 2 * 3 * 64 * 2
        );
        assert!(kv_bytes_per_token(&serde_json::json!({}), "float32").is_err());
    }

    #[test]
    fn prefixes_and_percentiles() {
        assert_eq!(
            with_prefix("s3://b/p?endpoint=http://h:1", "m"),
            "s3://b/p/m?endpoint=http://h:1"
        );
        assert_eq!(with_prefix("s3://b/", "m"), "s3://b/m");
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.0);
        assert_eq!(percentile(&v, 99.0), 4.0);
    }
}
