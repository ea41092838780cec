//! `objectcache-bench vllm`: time to first token in a real vLLM (0.32, CPU) serving
//! SmolLM2-135M through its OpenAI-compatible server, measured at the client with streaming,
//! for shared prefixes of 1K to 7K tokens, per method:
//!
//! - `recompute`: no connector (every prompt token is computed);
//! - `apc`: vLLM's own prefix cache in the same process (the local bound);
//! - `objectcache-file`, `objectcache-server`, `objectcache-s3`: `ObjectCacheConnector` on the
//!   embedded file store, our server (gather) and an S3 endpoint (Ceph RGW, ranged GETs);
//!   `objectcache-file-async`: the file store with `load_mode: async` (vLLM waits for the whole
//!   load between steps instead of computing layer l while later layers arrive);
//! - `vllm-cpu-offload`, `vllm-example`: vLLM's own connectors that run on the CPU, as peers
//!   (`OffloadingConnector` with its CPU tier, `ExampleConnector` on a shared directory);
//! - `lmcache`: LMCache (`LMCacheConnectorV1`) with its local disk level, where it is
//!   installed; its records say why where it has no figure.
//!
//! Every connector method saves in one vLLM process (request A: the prefix and a question)
//! and times request B (the same prefix, another question of `new_tokens` tokens) in a fresh
//! process: cross-replica. Timed replicas run with vLLM's prefix cache off, so every hit is an
//! external one and each run loads the prefix again. Figures are medians of `runs` requests.

//!
//! By concern: the run and its records here; what a run needs besides vLLM (`setup.rs`), the
//! prompts (`prompts.rs`), one vLLM process (`process.rs`), the timed runs of each method
//! (`methods.rs`), the HTTP client (`http.rs`), the final table (`report.rs`) and the plot
//! (`plot.rs`).

pub(crate) mod http;
pub(crate) mod methods;
pub(crate) mod plot;
pub(crate) mod process;
mod prompts;
mod report;
pub(crate) mod setup;

use anyhow::{bail, Result};
use clap::Args;
use indicatif::MultiProgress;
use methods::Bench;
use process::Env;
use prompts::Prompts;
use report::{finish, print_table};
use serde::Serialize;
use setup::{aws_env, install_package, locate, python_out, s3_store, ObjectCacheServer};
use std::collections::HashMap;
use std::path::PathBuf;

/// Every method, in report order.
pub const METHODS: &[&str] = &[
    "recompute",
    "apc",
    "objectcache-file",
    "objectcache-server",
    "objectcache-s3",
    "objectcache-file-async",
    "vllm-cpu-offload",
    "vllm-example",
    "lmcache",
];

/// vLLM's block size on the CPU (tokens); prefixes are whole blocks.
const BLOCK: u32 = 128;
/// Namespace of the benchmark's ObjectCache keys.
const NAMESPACE: &str = "bench-vllm";
/// Credentials of the benchmark's ObjectCache server (the test S3 ones when set, so one AWS
/// environment serves both S3 stores in a process).
const SERVER_BUCKET: &str = "kv-bench";

/// A model the benchmark knows by name (`--model NAME`, `--list-models`): its folder under
/// `--venv`'s `models/` (`scripts/vllm-setup.sh` makes them all), its family, the context it
/// is run at, a dtype it needs, and its KV cache groups with vLLM's hybrid manager on.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ModelSpec {
    /// Name on the command line and in the JSON.
    pub name: &'static str,
    /// Folder under `models/`.
    pub folder: &'static str,
    /// Architecture family.
    pub family: &'static str,
    /// `--max-model-len` (tokens).
    pub max_len: u32,
    /// A dtype the model needs on the CPU (`None`: `--dtype` decides).
    pub dtype: Option<&'static str>,
    /// KV cache groups with the hybrid KV cache manager on (1 with it off).
    pub groups: usize,
}

/// The models `--model` takes by name.
pub const MODELS: &[ModelSpec] = &[
    ModelSpec {
        name: "smollm2",
        folder: "smollm2-135m-hf",
        family: "dense (SmolLM2-135M, Llama style)",
        max_len: 8192,
        dtype: None,
        groups: 1,
    },
    ModelSpec {
        name: "gemma3-tiny",
        folder: "gemma3-tiny",
        family: "sliding window 5:1 (Gemma 3 style, window 512)",
        max_len: 16384,
        dtype: None,
        groups: 6,
    },
    ModelSpec {
        name: "gptoss-tiny",
        folder: "gptoss-tiny",
        family: "sliding window 1:1 (gpt-oss style, window 128, attention sinks)",
        max_len: 16384,
        dtype: None,
        groups: 2,
    },
    ModelSpec {
        name: "mla-tiny",
        folder: "mla-tiny",
        family: "MLA (DeepSeek-V2 style, latent 576)",
        max_len: 16384,
        // vLLM's CPU MLA kernels take bfloat16 only.
        dtype: Some("bfloat16"),
        groups: 1,
    },
    ModelSpec {
        name: "llama-tiny",
        folder: "llama-tiny",
        family: "dense (Llama style, for TP 2)",
        max_len: 16384,
        dtype: None,
        groups: 1,
    },
];

/// Arguments of `objectcache-bench vllm`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct VllmArgs {
    /// The directory `scripts/vllm-setup.sh DIR` made (`venv/`, `models/smollm2-135m-hf`), or
    /// a virtual environment with vLLM 0.32 (then give `--model`).
    #[arg(
        long,
        value_name = "DIR",
        env = "OBJECTCACHE_VLLM_DIR",
        default_value = "target/vllm"
    )]
    pub venv: PathBuf,
    /// The model: a name of `--list-models` (its folder under `--venv`'s `models/`), or a
    /// model folder (default: `smollm2`).
    #[arg(long, value_name = "NAME|DIR")]
    pub model: Option<String>,
    /// Lists the models `--model` takes by name, with their family, and exits.
    #[arg(long)]
    pub list_models: bool,
    /// vLLM's hybrid KV cache manager for the connector methods: `on` (the connector declares
    /// `SupportsHMA`; each KV cache group has its chunks, a sliding window loads only the
    /// window), `off` (`--disable-hybrid-kv-cache-manager`: one group, every layer at full
    /// length, as before), or both, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "on", value_parser = ["on", "off"])]
    pub hma: Vec<String>,
    /// Tensor-parallel size of every vLLM process (`--tensor-parallel-size`; each rank's
    /// threads bound to its share of the cores).
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// Write every record and the configuration as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Write the SVG plot (`vllm-ttft.svg`) into this directory.
    #[arg(long, value_name = "DIR")]
    pub svg: Option<PathBuf>,
    /// Shared prefix lengths in tokens (whole 128-token blocks; SmolLM2's context is 8K).
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,7168")]
    pub prefixes: Vec<u32>,
    /// Prompt tokens of request B after the shared prefix (its question).
    #[arg(long, default_value_t = 32)]
    pub new_tokens: u32,
    /// Timed requests per method and prefix (each with another question); medians reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Greedy tokens generated per request (the first one ends the TTFT; all are compared
    /// with `recompute` for `output_identical`).
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u32,
    /// Methods to run (default: all), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub methods: Option<Vec<String>>,
    /// Store URL of `objectcache-s3` (default: the test S3 endpoint of
    /// `OBJECTCACHE_TEST_S3_*`, Ceph RGW at 127.0.0.1:7480, when it answers; its bucket is
    /// created).
    #[arg(long, value_name = "URL")]
    pub s3: Option<String>,
    /// `ffi/python` of this repository (the package is installed from it with pip into a
    /// temporary directory, bundling the `libobjectcache.so` next to this executable when
    /// present).
    #[arg(long, value_name = "DIR")]
    pub package_src: Option<PathBuf>,
    /// Keep the logs in this directory (default: a temporary one, removed): one per vLLM
    /// (`METHOD.log`), and the storage server's (`storage-server.log`).
    #[arg(long, value_name = "DIR")]
    pub logs: Option<PathBuf>,
    /// KV cache of each vLLM process, GiB (`VLLM_CPU_KVCACHE_SPACE`).
    #[arg(long, default_value_t = 1)]
    pub kv_cache_gib: u32,
    /// CPU cores each vLLM process keeps off its model's compute threads
    /// (`VLLM_CPU_NUM_OF_RESERVED_CPU`), the same for every method. Left to itself, vLLM on
    /// the CPU reserves one core for its scheduler and one more when a KV connector is
    /// configured, and on a machine of two cores it then reserves none: a connector's
    /// process would compute on twice the cores of `recompute`'s and `apc`'s.
    #[arg(long, default_value_t = 1)]
    pub reserved_cpus: u32,
    /// Model dtype of every vLLM process (`--dtype`): `auto` picks `bfloat16` where the CPU
    /// computes it natively (the `amx_bf16` or `avx512_bf16` flag in /proc/cpuinfo) and
    /// `float32` elsewhere, as the vLLM tests do: without those instructions vLLM's CPU
    /// matrix products in bfloat16 run on one core, several times slower than in float32.
    /// The report and the JSON name the dtype used.
    #[arg(long, default_value = "auto", value_parser = ["auto", "bfloat16", "float16", "float32"])]
    pub dtype: String,
    /// `KEY=VALUE` added to every ObjectCache connector's `kv_connector_extra_config`
    /// (connector or engine settings, docs/vllm.md), e.g. `cpus=inherit` or
    /// `gather_streams=1`; repeatable.
    #[arg(long = "connector-setting", value_name = "KEY=VALUE")]
    pub connector_settings: Vec<String>,
}

/// One method at one prefix length.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Method name (see [`METHODS`]).
    pub method: String,
    /// The model (`--model`'s name, or its folder).
    pub model: String,
    /// The model's family ([`ModelSpec::family`]).
    pub family: String,
    /// vLLM's hybrid KV cache manager for this record (`on`, `off`; `None` for methods
    /// without a connector).
    pub hma: Option<String>,
    /// Tensor-parallel size.
    pub tp: u32,
    /// Shared prefix tokens.
    pub prefix_tokens: u32,
    /// Prompt tokens after the prefix.
    pub new_tokens: u32,
    /// Median TTFT at the client, seconds (`None` when the method did not run).
    pub ttft_s: Option<f64>,
    /// Every run's TTFT, seconds.
    pub ttft_runs_s: Vec<f64>,
    /// Median TTFT of the paired misses: after each timed request, the same process computes
    /// a prompt of the same length whose first token differs (no cache has it), seconds.
    pub ttft_miss_s: Option<f64>,
    /// Median over runs of TTFT / the paired miss's TTFT (same process, back to back): the
    /// ratio to a full recompute that the machine's load drift does not move.
    pub paired_ratio: Option<f64>,
    /// Prompt tokens the connector supplied (median over runs; vLLM's
    /// `usage.prompt_tokens_details.cached_tokens` in a replica without a prefix cache).
    pub external_hit_tokens: Option<u64>,
    /// Prompt tokens vLLM's own prefix cache supplied (`apc`).
    pub local_hit_tokens: Option<u64>,
    /// KV bytes the connector loaded for one request (median; from its Prometheus counter:
    /// `vllm:objectcache_loaded_bytes`, `vllm:kv_offload_load_bytes`), when it has one.
    pub bytes_loaded: Option<u64>,
    /// KV bytes the connector stored for request A's prefix (ObjectCache methods: the saver's
    /// `vllm:objectcache_saved_bytes` over all prefixes, per store, apportioned by prefix
    /// length: every chunk of a model's geometry has the same size).
    pub bytes_stored: Option<u64>,
    /// Requests one load of request B sent to the store (median over runs): what the server
    /// counted for B's lookup and load, `gather`, `get_object` and `head_object`
    /// (`objectcache-server` only; the other stores count none).
    pub store_requests: Option<u64>,
    /// What one load costs at S3 Standard's list prices (`cost_usd_per_load`,
    /// `cost_usd_per_1k_loads`, ... beside the other fields; see [`crate::cost::Cost`]):
    /// `store_requests` GET-class requests, the bytes moved in the store's region; saves per
    /// 1,000 are not counted here (0), storage is `bytes_stored` for a month.
    #[serde(flatten)]
    pub cost: Option<crate::cost::Cost>,
    /// Whether every run's greedy output equals `recompute`'s for the same prompt.
    pub output_identical: Option<bool>,
    /// Whether every run's greedy output equals `apc`'s for the same request (`None` for
    /// `recompute` and `apc`, or when `apc` did not run): a request served from a cached
    /// prefix can differ from a full computation by numerics alone, as vLLM's own prefix
    /// cache does at long prefixes; a connector whose output equals `apc`'s adds nothing.
    pub output_matches_apc: Option<bool>,
    /// Timed runs.
    pub runs: usize,
    /// TTFT over a full recompute: the paired ratio where there is one, else TTFT over
    /// `recompute`'s at the same prefix (another process).
    pub vs_recompute: Option<f64>,
    /// TTFT over `recompute`'s at the same prefix, measured in another process.
    pub vs_recompute_process: Option<f64>,
    /// TTFT over `apc`'s, both as paired ratios (this method's over `apc`'s).
    pub vs_apc: Option<f64>,
    /// Why the method did not run, or what limits it.
    pub note: Option<String>,
}

#[derive(Debug, Serialize)]
struct Replica {
    label: String,
    startup_s: f64,
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    vllm: String,
    model: String,
    model_spec: ModelSpec,
    cpus: usize,
    args: &'a VllmArgs,
    replicas: Vec<Replica>,
    records: Vec<Record>,
}

/// The dtype `--dtype auto` picks from /proc/cpuinfo's text: `bfloat16` where the CPU has
/// native bfloat16 arithmetic (`amx_bf16` or `avx512_bf16`), else `float32`.
pub(crate) fn native_dtype(cpuinfo: &str) -> &'static str {
    let native = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .flat_map(|l| l.split_whitespace())
        .any(|f| f == "amx_bf16" || f == "avx512_bf16");
    if native {
        "bfloat16"
    } else {
        "float32"
    }
}

/// Runs `objectcache-bench vllm`.
///
/// # Errors
/// A missing venv or model, a package that does not install, a vLLM process that does not
/// start, a failed request. A peer connector that cannot run is a record with a note, not an
/// error.
pub fn run(mut a: VllmArgs) -> Result<()> {
    if a.list_models {
        for m in MODELS {
            println!(
                "{:<12} {} (models/{}, context {}{})",
                m.name,
                m.family,
                m.folder,
                m.max_len,
                m.dtype.map(|d| format!(", {d} only")).unwrap_or_default()
            );
        }
        return Ok(());
    }
    let spec = model_spec(a.model.as_deref());
    if let Some(d) = spec.dtype {
        a.dtype = d.to_string();
    }
    if a.tp == 0 {
        bail!("--tp must be at least 1");
    }
    if a.dtype == "auto" {
        a.dtype =
            native_dtype(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default()).to_string();
    }
    // Before this process starts any thread.
    aws_env();
    let (py, model) = locate(&a.venv, a.model.as_deref(), &spec)?;
    let chosen: Vec<String> = a
        .methods
        .clone()
        .unwrap_or_else(|| METHODS.iter().map(|s| s.to_string()).collect());
    for m in &chosen {
        if !METHODS.contains(&m.as_str()) {
            bail!("unknown method {m:?}; methods: {}", METHODS.join(", "));
        }
    }
    // In report order: recompute first, its outputs are the reference.
    let methods: Vec<String> = METHODS
        .iter()
        .filter(|m| chosen.iter().any(|c| c == *m))
        .map(|m| m.to_string())
        .collect();
    for &p in &a.prefixes {
        if p == 0 || p % BLOCK != 0 || p + a.new_tokens + a.max_tokens > spec.max_len {
            bail!(
                "prefix {p}: must be a positive multiple of {BLOCK} that leaves room for the \
                 question and output in {} tokens ({}'s context)",
                spec.max_len,
                spec.name
            );
        }
    }
    if a.runs == 0 || a.new_tokens == 0 {
        bail!("--runs and --new-tokens must be at least 1");
    }
    let tmp = tempfile::tempdir()?;
    let logs = match &a.logs {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => tmp.path().join("logs"),
    };
    std::fs::create_dir_all(&logs)?;
    let mp = MultiProgress::new();
    let site = install_package(&py, a.package_src.as_deref(), tmp.path(), &mp)?;
    let vllm_version = python_out(&py, "import vllm; print(vllm.__version__)", &site)?;
    let prompts = Prompts::new(&model, &a)?;
    let mut env = Env::new(&py, &model, &site, &logs, &a, spec.max_len, mp.clone());
    let rt = tokio::runtime::Runtime::new()?;

    let mut b = Bench {
        a: &a,
        env: &mut env,
        rt: &rt,
        prompts: &prompts,
        reference: HashMap::new(),
        apc_reference: HashMap::new(),
        records: Vec::new(),
        replicas: Vec::new(),
        tmp: tmp.path().to_path_buf(),
        methods: methods.clone(),
        spec,
        hma: None,
        stored_per_token: None,
        server_port: None,
    };
    // Stores of the ObjectCache methods.
    let mut stores: Vec<(String, String)> = Vec::new();
    let mut not_run: Vec<(String, String)> = Vec::new();
    let mut server = None;
    for m in &methods {
        match m.as_str() {
            "objectcache-file" | "objectcache-file-async"
                if !stores.iter().any(|(s, _)| s == "objectcache-file") =>
            {
                stores.push((
                    "objectcache-file".into(),
                    format!("file://{}", tmp.path().join("file-store").display()),
                ))
            }
            "objectcache-server" => {
                let s = ObjectCacheServer::start(&tmp.path().join("server-store"), &logs)?;
                stores.push((m.clone(), s.url()));
                b.server_port = s.port();
                server = Some(s);
            }
            "objectcache-s3" => match s3_store(a.s3.as_deref(), &rt)? {
                Ok(url) => stores.push((m.clone(), url)),
                Err(why) => not_run.push((m.clone(), why)),
            },
            _ => {}
        }
    }
    let mut objectcache_done = false;
    for m in &methods {
        match m.as_str() {
            "recompute" => b.plain("recompute", false)?,
            "apc" => b.plain("apc", true)?,
            "objectcache-file"
            | "objectcache-server"
            | "objectcache-s3"
            | "objectcache-file-async"
                // Every ObjectCache store at once: one saver (vLLM's MultiConnector).
                if !objectcache_done && !stores.is_empty() => {
                    let async_file = methods.iter().any(|m| m == "objectcache-file-async");
                    // Once per hybrid manager setting, each in stores of its own
                    // namespace (the keys differ anyway: one group or several).
                    for h in &a.hma {
                        b.hma = Some(h.clone());
                        b.env.hma_off = h == "off";
                        b.objectcache(&stores, async_file)?;
                    }
                    b.env.hma_off = false;
                    b.hma = None;
                    objectcache_done = true;
                }
            "vllm-cpu-offload" => b.cpu_offload()?,
            "vllm-example" => b.example()?,
            "lmcache" => b.lmcache()?,
            _ => {}
        }
    }
    for (m, why) in not_run {
        for &p in &a.prefixes {
            let r = b.record(&m, p, why.clone());
            b.records.push(r);
        }
    }
    drop(server);
    let mut records = b.records;
    let replicas = b.replicas;
    finish(&mut records);
    print_table(&records, a.runs, &a.dtype);
    if let Some(dir) = &a.svg {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("vllm-ttft.svg");
        plot::ttft(&path, &records)?;
        println!("plot: {}", path.display());
    }
    if let Some(path) = &a.json {
        let rep = Report {
            benchmark: "vllm",
            vllm: vllm_version,
            model: model.display().to_string(),
            model_spec: spec,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            args: &a,
            replicas,
            records,
        };
        std::fs::write(path, serde_json::to_string_pretty(&rep)? + "\n")?;
        println!("json: {}", path.display());
    }
    Ok(())
}

/// The model `--model` names: one of [`MODELS`] by name (default `smollm2`), or a folder of
/// a model the benchmark does not know (family unknown, 8K context).
fn model_spec(arg: Option<&str>) -> ModelSpec {
    let name = arg.unwrap_or("smollm2");
    MODELS
        .iter()
        .find(|m| m.name == name)
        .copied()
        .unwrap_or(ModelSpec {
            name: "custom",
            folder: "",
            family: "unknown (a model folder)",
            max_len: 8192,
            dtype: None,
            groups: 1,
        })
}

#[cfg(test)]
mod tests {
    use super::native_dtype;

    #[test]
    fn auto_dtype_is_bfloat16_only_with_native_bf16() {
        let avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n";
        assert_eq!(native_dtype(avx2), "float32");
        let amx = "flags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16\n";
        assert_eq!(native_dtype(amx), "bfloat16");
        // A flag's name inside another's is not the flag.
        assert_eq!(native_dtype("flags\t: avx512_bf16x\n"), "float32");
        assert_eq!(native_dtype(""), "float32");
    }
}
