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
//! By concern: the arguments and the run here; the traces and the ideal cache (`trace.rs`),
//! the routers (`router.rs`), one method's replicas and passes (`runner.rs`), the replay
//! (`play.rs`), the records and table (`record.rs`), the plot (`plot.rs`); the vLLM
//! processes, HTTP client and package set-up are the `vllm` benchmark's.

mod play;
mod plot;
mod record;
mod router;
mod runner;
mod trace;

use crate::vllm::process::Env;
use crate::vllm::setup::{aws_env, install_package, locate, python_out, s3_store};
use crate::vllm::{native_dtype, MODELS};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::MultiProgress;
use record::{print_phases, print_table, Record};
use router::ROUTINGS;
use runner::Fleet;
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
    /// A setting of every replica's ObjectCacheConnector (connector or engine settings,
    /// docs/vllm.md), e.g. `lookup_timeout_ms=500`; repeatable.
    #[arg(long = "connector-setting", value_name = "KEY=VALUE")]
    pub connector_settings: Vec<String>,
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
    // replicas whose compute threads spin on every core starve them. At nice 10 Ceph RGW still
    // answered marker reads in 0.5-3.4 s, its threads waiting for a core about 200 times as
    // long as they ran (schedstat; docs/benchmarks.md, "Fleet"). Under `SCHED_IDLE` the
    // replicas take only what the store, its server and the clients leave.
    env.idle = true;
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
    println!();
    print_phases(&records);
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

#[cfg(test)]
mod tests {
    use super::record::percentile;
    use super::runner::with_prefix;
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
