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
//!   (`OffloadingConnector` with its CPU tier, `ExampleConnector` on a shared directory).
//!
//! Every connector method saves in one vLLM process (request A: the prefix and a question)
//! and times request B (the same prefix, another question of `new_tokens` tokens) in a fresh
//! process: cross-replica. Timed replicas run with vLLM's prefix cache off, so every hit is an
//! external one and each run loads the prefix again. Figures are medians of `runs` requests.

mod http;
mod plot;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use objectcache::store::{open_store, S3Config, S3Store};
use serde::Serialize;
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
];

/// vLLM's block size on the CPU (tokens); prefixes are whole blocks.
const BLOCK: u32 = 128;
/// Namespace of the benchmark's ObjectCache keys.
const NAMESPACE: &str = "bench-vllm";
/// Credentials of the benchmark's ObjectCache server (the test S3 ones when set, so one AWS
/// environment serves both S3 stores in a process).
const SERVER_BUCKET: &str = "kv-bench";

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
    /// The model folder (default: `models/smollm2-135m-hf` under `--venv`).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
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
    cpus: usize,
    args: &'a VllmArgs,
    replicas: Vec<Replica>,
    records: Vec<Record>,
}

/// Runs `objectcache-bench vllm`.
///
/// # Errors
/// A missing venv or model, a package that does not install, a vLLM process that does not
/// start, a failed request. A peer connector that cannot run is a record with a note, not an
/// error.
pub fn run(a: VllmArgs) -> Result<()> {
    // The benchmark's own server takes these credentials (`s3_credentials`), and its checks
    // that saves were published read them from the AWS environment: without them the AWS SDK
    // would look for an instance metadata service. Set only where unset, here, before this
    // process starts any thread.
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
        let (ak, sk) = s3_credentials();
        std::env::set_var("AWS_ACCESS_KEY_ID", ak);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", sk);
        std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
    }
    if std::env::var_os("AWS_REGION").is_none() {
        std::env::set_var("AWS_REGION", "us-east-1");
    }
    let (py, model) = locate(&a)?;
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
        if p == 0 || p % BLOCK != 0 || p + a.new_tokens + a.max_tokens > 8192 {
            bail!("prefix {p}: must be a positive multiple of {BLOCK} that leaves room for the question and output in 8,192 tokens");
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
    let site = install_package(&py, &a, tmp.path(), &mp)?;
    let vllm_version = python_out(&py, "import vllm; print(vllm.__version__)", &site)?;
    let prompts = Prompts::new(&model, &a)?;
    let mut env = Env::new(&py, &model, &site, &logs, &a, mp.clone());
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
                server = Some(s);
            }
            "objectcache-s3" => match s3_store(&a, &rt)? {
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
                    b.objectcache(&stores, async_file)?;
                    objectcache_done = true;
                }
            "vllm-cpu-offload" => b.cpu_offload()?,
            "vllm-example" => b.example()?,
            _ => {}
        }
    }
    for (m, why) in not_run {
        for &p in &a.prefixes {
            b.records.push(empty(&m, p, a.new_tokens, &why));
        }
    }
    drop(server);
    let mut records = b.records;
    let replicas = b.replicas;
    finish(&mut records);
    print_table(&records, a.runs);
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

fn empty(method: &str, p: u32, new: u32, why: &str) -> Record {
    Record {
        method: method.into(),
        prefix_tokens: p,
        new_tokens: new,
        ttft_s: None,
        ttft_runs_s: vec![],
        external_hit_tokens: None,
        local_hit_tokens: None,
        bytes_loaded: None,
        output_identical: None,
        output_matches_apc: None,
        runs: 0,
        ttft_miss_s: None,
        paired_ratio: None,
        vs_recompute: None,
        vs_recompute_process: None,
        vs_apc: None,
        note: Some(why.into()),
    }
}

/// The venv's Python and the model folder.
fn locate(a: &VllmArgs) -> Result<(PathBuf, PathBuf)> {
    let d = &a.venv;
    let (py, model) = if d.join("venv/bin/python").is_file() {
        (d.join("venv/bin/python"), d.join("models/smollm2-135m-hf"))
    } else if d.join("bin/python").is_file() {
        let m = a.model.clone().ok_or_else(|| {
            anyhow!(
                "--venv {} is a virtual environment: give --model",
                d.display()
            )
        })?;
        (d.join("bin/python"), m)
    } else {
        bail!(
            "no vLLM venv at {} (make one with scripts/vllm-setup.sh {})",
            d.display(),
            d.display()
        );
    };
    let model = a.model.clone().unwrap_or(model);
    if !model.join("config.json").is_file() {
        bail!(
            "no model folder at {} (scripts/vllm-setup.sh makes it)",
            model.display()
        );
    }
    Ok((
        std::fs::canonicalize(py.parent().unwrap())?.join("python"),
        std::fs::canonicalize(model)?,
    ))
}

fn spinner(mp: &MultiProgress, msg: String) -> ProgressBar {
    let s = mp.add(ProgressBar::new_spinner());
    s.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    s.set_message(msg);
    s.enable_steady_tick(Duration::from_millis(200));
    s
}

/// `pip install --target` of `ffi/python` into `tmp/site`; returns the directory.
fn install_package(py: &Path, a: &VllmArgs, tmp: &Path, mp: &MultiProgress) -> Result<PathBuf> {
    let src = a
        .package_src
        .clone()
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../ffi/python"));
    let site = tmp.join("site");
    let s = spinner(
        mp,
        format!("installing the objectcache package from {}", src.display()),
    );
    let mut cmd = Command::new(py);
    cmd.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--target",
    ])
    .arg(&site)
    .arg(&src);
    let exe = std::env::current_exe()?;
    if let Some(lib) = exe
        .parent()
        .map(|d| d.join("libobjectcache.so"))
        .filter(|l| l.is_file())
    {
        cmd.env("OBJECTCACHE_CDYLIB", lib);
    }
    let out = cmd.output().context("run pip")?;
    s.finish_and_clear();
    if !out.status.success() {
        bail!(
            "pip install {} failed:\n{}{}",
            src.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(site)
}

fn python_out(py: &Path, code: &str, site: &Path) -> Result<String> {
    let out = Command::new(py)
        .args(["-c", code])
        .env("PYTHONPATH", site)
        .output()?;
    if !out.status.success() {
        bail!("{}: {}", py.display(), String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The S3 store of `objectcache-s3`: `--s3`, or the test endpoint (bucket created) when it
/// answers; `Ok(Err(why))` when there is none.
fn s3_store(
    a: &VllmArgs,
    rt: &tokio::runtime::Runtime,
) -> Result<std::result::Result<String, String>> {
    if let Some(u) = &a.s3 {
        return Ok(Ok(u.clone()));
    }
    let c = S3Config::from_test_env();
    match rt.block_on(S3Store::from_test_env("bench-vllm")) {
        Ok(Some((_, prefix))) => Ok(Ok(format!(
            "s3://{}/{prefix}?endpoint={}&region={}&addressing=path",
            c.bucket,
            c.endpoint.clone().unwrap_or_default(),
            c.region.clone().unwrap_or_else(|| "us-east-1".into())
        ))),
        Ok(None) => Ok(Err(format!(
            "not run: no S3 endpoint at {} (give --s3 URL, or start scripts/ceph-rgw/start.sh)",
            c.endpoint.unwrap_or_default()
        ))),
        Err(e) => Err(anyhow!("the test S3 endpoint refused its bucket: {e}")),
    }
}

/// `(access key, secret key)` for the S3 stores: the test S3 credentials.
fn s3_credentials() -> (String, String) {
    let var = |k: &str, d: &str| {
        std::env::var(k)
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| d.into())
    };
    (
        var("OBJECTCACHE_TEST_S3_ACCESS_KEY", "cephtestak"),
        var(
            "OBJECTCACHE_TEST_S3_SECRET_KEY",
            "cephtestsecretkey0123456789",
        ),
    )
}

/// Our server (`objectcache serve`, next to this executable) over a directory store.
struct ObjectCacheServer {
    child: Child,
    addr: String,
}

impl ObjectCacheServer {
    fn start(dir: &Path, logs: &Path) -> Result<Self> {
        let exe = std::env::current_exe()?;
        let bin = exe.with_file_name("objectcache");
        if !bin.is_file() {
            bail!(
                "no server binary at {} (cargo build --release)",
                bin.display()
            );
        }
        let (ak, sk) = s3_credentials();
        let mut child = Command::new(&bin)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--bucket",
                SERVER_BUCKET,
                "--store",
            ])
            .arg(dir)
            .args(["--access-key", &format!("{ak}:{sk}")])
            .stdout(Stdio::piped())
            .stderr(File::create(logs.join("storage-server.log"))?)
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line)?;
        let addr = line
            .trim()
            .rsplit(' ')
            .next()
            .unwrap_or_default()
            .to_string();
        if addr.is_empty() {
            bail!(
                "objectcache serve did not start (see {})",
                logs.join("storage-server.log").display()
            );
        }
        Ok(ObjectCacheServer { child, addr })
    }

    fn url(&self) -> String {
        format!(
            "s3://{SERVER_BUCKET}/vllm?endpoint=http://{}&region=us-east-1&addressing=path",
            self.addr
        )
    }
}

impl Drop for ObjectCacheServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Token-exact prompts: per prefix length a document of exactly that many tokens (each its
/// own text, so prefixes never share blocks), per run a question of exactly `new_tokens`.
struct Prompts {
    docs: HashMap<u32, Vec<u32>>,
    save_q: Vec<u32>,
    questions: Vec<Vec<u32>>,
    warmup: Vec<u32>,
}

impl Prompts {
    fn new(model: &Path, a: &VllmArgs) -> Result<Self> {
        let tok = tokenizers::Tokenizer::from_file(model.join("tokenizer.json"))
            .map_err(|e| anyhow!("tokenizer of {}: {e}", model.display()))?;
        let enc = |s: &str| -> Result<Vec<u32>> {
            Ok(tok
                .encode(s, false)
                .map_err(|e| anyhow!("tokenize: {e}"))?
                .get_ids()
                .to_vec())
        };
        let mut docs = HashMap::new();
        for &p in &a.prefixes {
            let mut t = Vec::new();
            let mut i = 0;
            while t.len() < p as usize {
                t.extend(enc(&paragraph(p, i))?);
                i += 1;
            }
            t.truncate(p as usize);
            docs.insert(p, t);
        }
        let question = |i: usize| -> Result<Vec<u32>> {
            let mut t = enc(&format!(
                "\n\nQuestion {i}: in the log above, which vessel reported the calmest water \
                 on the {} leg, and what did its crew repair there? Answer briefly:",
                ["first", "second", "third", "fourth", "fifth", "sixth", "seventh"][i % 7]
            ))?;
            while t.len() < a.new_tokens as usize {
                let more = t.clone();
                t.extend(more);
            }
            t.truncate(a.new_tokens as usize);
            Ok(t)
        };
        let questions = (0..a.runs)
            .map(|r| question(r + 1))
            .collect::<Result<Vec<_>>>()?;
        let save_q = question(0)?;
        let mut warmup = enc("Write one short sentence about the sea.")?;
        warmup.truncate(BLOCK as usize - 8);
        Ok(Prompts {
            docs,
            save_q,
            questions,
            warmup,
        })
    }

    fn a(&self, p: u32) -> Vec<u32> {
        [self.docs[&p].as_slice(), &self.save_q].concat()
    }

    fn b(&self, p: u32, r: usize) -> Vec<u32> {
        [self.docs[&p].as_slice(), &self.questions[r]].concat()
    }

    /// Request B with its first token replaced by one unique to (run, method): the same
    /// length, and a prefix no cache holds (vLLM's, ObjectCache's, the peers').
    fn miss(&self, p: u32, r: usize, method: &str) -> Vec<u32> {
        let mut t = self.b(p, r);
        let m = METHODS.iter().position(|x| *x == method).unwrap_or(0) as u32;
        let first = 1000 + 97 * m + r as u32;
        t[0] = if t[0] == first { first + 50 } else { first };
        t
    }
}

/// A paragraph of the synthetic ship's log of prefix `p` (seeded by `p`).
fn paragraph(p: u32, i: usize) -> String {
    let ships = [
        "Aster", "Boreal", "Cygnet", "Dunlin", "Egret", "Fulmar", "Gannet", "Heron",
    ];
    let ports = [
        "Tromso",
        "Valparaiso",
        "Hobart",
        "Reykjavik",
        "Cork",
        "Halifax",
        "Nome",
    ];
    let cargo = [
        "sensor buoys",
        "rope",
        "diesel",
        "core samples",
        "spare radios",
        "tinned fish",
    ];
    let k = i + p as usize / BLOCK as usize * 7;
    format!(
        "Log {p}-{i}. The vessel {} left {} on day {} with {} crates of {}; winds {} knots, \
         water at {} degrees; the crew repaired the {} and reached {} after {} days.\n",
        ships[k % 8],
        ports[(3 * k) % 7],
        7 + 3 * k,
        12 + 5 * k,
        cargo[k % 6],
        9 + (7 * k) % 30,
        2 + (5 * k) % 11,
        ["winch", "radar", "hull", "galley", "mast"][k % 5],
        ports[(3 * k + 2) % 7],
        1 + k % 4
    )
}

/// What every vLLM process is started with.
struct Env {
    py: PathBuf,
    model: PathBuf,
    site: PathBuf,
    logs: PathBuf,
    kv_gib: u32,
    reserved_cpus: u32,
    mp: MultiProgress,
}

impl Env {
    fn new(
        py: &Path,
        model: &Path,
        site: &Path,
        logs: &Path,
        a: &VllmArgs,
        mp: MultiProgress,
    ) -> Self {
        Env {
            py: py.into(),
            model: model.into(),
            site: site.into(),
            logs: logs.into(),
            kv_gib: a.kv_cache_gib,
            reserved_cpus: a.reserved_cpus,
            mp,
        }
    }
}

/// One vLLM OpenAI-compatible server process.
struct Vllm {
    child: Child,
    port: u16,
    label: String,
    startup_s: f64,
}

impl Vllm {
    fn start(
        env: &Env,
        rt: &tokio::runtime::Runtime,
        label: &str,
        apc: bool,
        kv: Option<&serde_json::Value>,
    ) -> Result<Vllm> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = env.logs.join(format!("{label}.log"));
        let (ak, sk) = s3_credentials();
        let mut cmd = Command::new(&env.py);
        cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&env.model)
            .args([
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                "--max-model-len",
                "8192",
            ])
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--seed",
                "0",
            ])
            .args([
                "--enable-prompt-tokens-details",
                "--prefix-caching-hash-algo",
                "sha256_cbor",
            ])
            .arg(if apc {
                "--enable-prefix-caching"
            } else {
                "--no-enable-prefix-caching"
            });
        if let Some(kv) = kv {
            cmd.args(["--kv-transfer-config", &kv.to_string()]);
        }
        cmd.env("PYTHONPATH", &env.site)
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("VLLM_TARGET_DEVICE", "cpu")
            .env("VLLM_CPU_KVCACHE_SPACE", env.kv_gib.to_string())
            .env(
                "VLLM_CPU_NUM_OF_RESERVED_CPU",
                env.reserved_cpus.to_string(),
            )
            .env("AWS_ACCESS_KEY_ID", ak)
            .env("AWS_SECRET_ACCESS_KEY", sk)
            .env("AWS_REGION", "us-east-1")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            // Emptied once, then both streams in append mode: a stdout opened without
            // append wrote over stderr's lines.
            .stdout(Stdio::from({
                File::create(&log)?;
                File::options().append(true).open(&log)?
            }))
            .stderr(Stdio::from(File::options().append(true).open(&log)?));
        // Its own process group: vLLM's engine core and workers are processes of their own,
        // which outlive a killed API server; the group is stopped whole (`Drop for Vllm`).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let t0 = Instant::now();
        // Dropped on every early return below: the whole group stops.
        let mut v = Vllm {
            child: cmd.spawn().context("start vLLM")?,
            port,
            label: label.into(),
            startup_s: 0.0,
        };
        let s = spinner(&env.mp, format!("starting vLLM ({label})"));
        loop {
            if let Some(st) = v.child.try_wait()? {
                s.finish_and_clear();
                bail!(
                    "vLLM ({label}) exited with {st} while starting:\n{}",
                    tail(&log, 30)
                );
            }
            if rt.block_on(http::healthy(port)) {
                break;
            }
            if t0.elapsed() > Duration::from_secs(900) {
                s.finish_and_clear();
                bail!("vLLM ({label}) not ready after 900 s:\n{}", tail(&log, 30));
            }
            s.set_message(format!("starting vLLM ({label}): {}", last_line(&log)));
            std::thread::sleep(Duration::from_millis(500));
        }
        s.finish_and_clear();
        v.startup_s = t0.elapsed().as_secs_f64();
        env.mp
            .println(format!("vLLM ({label}) ready in {:.1} s", v.startup_s))?;
        Ok(v)
    }

    /// SIGTERM, then waits (vLLM shuts its engine and workers down; connectors flush).
    fn stop(mut self) -> Result<()> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let t0 = Instant::now();
        while self.child.try_wait()?.is_none() {
            if t0.elapsed() > Duration::from_secs(120) {
                let _ = self.child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = self.child.wait();
        Ok(())
    }
}

impl Drop for Vllm {
    /// Stops the whole process group (the API server, its engine core and workers): SIGTERM,
    /// up to 30 s, then SIGKILL. A benchmark that fails half-way leaves no vLLM behind.
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let signal = |sig: &str| {
            let _ = Command::new("kill")
                .args([sig, "--", &group])
                .stderr(Stdio::null())
                .status();
        };
        if let Ok(None) = self.child.try_wait() {
            signal("-TERM");
            let t0 = Instant::now();
            while matches!(self.child.try_wait(), Ok(None))
                && t0.elapsed() < Duration::from_secs(30)
            {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        // Whatever of the group is left (also after `stop`: a worker that outlived its server).
        signal("-KILL");
        let _ = self.child.wait();
    }
}

fn last_line(log: &Path) -> String {
    let s = std::fs::read_to_string(log).unwrap_or_default();
    let l = s.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    let l: String = l.chars().take(90).collect();
    l
}

fn tail(log: &Path, n: usize) -> String {
    let s = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

struct Bench<'a> {
    a: &'a VllmArgs,
    env: &'a mut Env,
    rt: &'a tokio::runtime::Runtime,
    prompts: &'a Prompts,
    /// recompute's output text per (prefix, run).
    reference: HashMap<(u32, usize), String>,
    /// `apc`'s outputs, by (prefix, run).
    apc_reference: HashMap<(u32, usize), String>,
    records: Vec<Record>,
    replicas: Vec<Replica>,
    tmp: PathBuf,
    methods: Vec<String>,
}

/// Prometheus counters that count a connector's loaded bytes.
const LOADED_BYTES: &[&str] = &[
    "vllm:objectcache_loaded_bytes_total",
    "vllm:kv_offload_load_bytes_total",
];

impl Bench<'_> {
    fn start(&mut self, label: &str, apc: bool, kv: Option<&serde_json::Value>) -> Result<Vllm> {
        let v = Vllm::start(self.env, self.rt, label, apc, kv)?;
        self.replicas.push(Replica {
            label: label.into(),
            startup_s: v.startup_s,
        });
        // The first request of a fresh process pays one-time costs: not timed.
        self.rt
            .block_on(http::complete(
                v.port,
                &self.model(),
                &self.prompts.warmup,
                2,
            ))
            .with_context(|| format!("warm-up request to vLLM ({label})"))?;
        Ok(v)
    }

    fn model(&self) -> String {
        self.env.model.display().to_string()
    }

    /// Serves request A of every prefix (computed, and saved by a connector if any).
    fn serve_a(&mut self, v: &Vllm) -> Result<()> {
        let pb = self.bar(self.a.prefixes.len(), &format!("{}: request A", v.label));
        for &p in &self.a.prefixes.clone() {
            self.rt
                .block_on(http::complete(
                    v.port,
                    &self.model(),
                    &self.prompts.a(p),
                    self.a.max_tokens,
                ))
                .with_context(|| format!("request A ({p} tokens) to vLLM ({})", v.label))?;
            pb.inc(1);
        }
        pb.finish_and_clear();
        Ok(())
    }

    fn bar(&self, n: usize, msg: &str) -> ProgressBar {
        let pb = self.env.mp.add(ProgressBar::new(n as u64));
        pb.set_style(
            ProgressStyle::with_template("{msg:<40} [{bar:30}] {pos}/{len} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        pb.set_message(msg.to_string());
        pb
    }

    /// Times request B of every prefix and run on `v`; one record per prefix.
    fn time_b(&mut self, v: &Vllm, method: &str, note: Option<String>) -> Result<()> {
        let runs = self.a.runs;
        let pb = self.bar(
            self.a.prefixes.len() * runs,
            &format!("{method}: request B (and a miss)"),
        );
        for &p in &self.a.prefixes.clone() {
            let (mut ttfts, mut ext, mut local, mut bytes) = (vec![], vec![], vec![], vec![]);
            let (mut misses, mut ratios) = (vec![], vec![]);
            let mut identical = Some(true);
            let mut matches_apc = (method != "recompute" && method != "apc").then_some(true);
            for r in 0..runs {
                let before = self.rt.block_on(http::metrics(v.port))?;
                let c = self
                    .rt
                    .block_on(http::complete(
                        v.port,
                        &self.model(),
                        &self.prompts.b(p, r),
                        self.a.max_tokens,
                    ))
                    .with_context(|| format!("request B ({p} tokens) to vLLM ({})", v.label))?;
                let after = self.rt.block_on(http::metrics(v.port))?;
                let sent = self.prompts.b(p, r).len() as u64;
                if c.prompt_tokens != Some(sent) {
                    bail!(
                        "vLLM ({}) counted {:?} prompt tokens for a prompt of {sent}",
                        v.label,
                        c.prompt_tokens
                    );
                }
                ttfts.push(c.ttft_s);
                let cached = c.cached_tokens.unwrap_or(0);
                if method == "apc" {
                    local.push(cached);
                    ext.push(0);
                } else {
                    ext.push(cached);
                }
                if let Some(b) = LOADED_BYTES.iter().find(|n| after.contains_key(**n)) {
                    bytes.push((after[*b] - before.get(*b).copied().unwrap_or(0.0)) as u64);
                }
                if method == "apc" {
                    self.apc_reference.insert((p, r), c.text.clone());
                }
                if method == "recompute" {
                    self.reference.insert((p, r), c.text.clone());
                } else {
                    // The paired full computation in the same process, right after: a prompt
                    // of the same length whose first token differs (a miss for every cache).
                    let m = self
                        .rt
                        .block_on(http::complete(
                            v.port,
                            &self.model(),
                            &self.prompts.miss(p, r, method),
                            self.a.max_tokens,
                        ))
                        .with_context(|| {
                            format!("paired miss ({p} tokens) to vLLM ({})", v.label)
                        })?;
                    if m.cached_tokens.unwrap_or(0) != 0 {
                        bail!(
                            "vLLM ({}): the paired miss hit {:?} cached tokens",
                            v.label,
                            m.cached_tokens
                        );
                    }
                    misses.push(m.ttft_s);
                    ratios.push(c.ttft_s / m.ttft_s);
                }
                identical = match (identical, self.reference.get(&(p, r))) {
                    (Some(i), Some(want)) => Some(i && *want == c.text),
                    _ => None,
                };
                matches_apc = match (matches_apc, self.apc_reference.get(&(p, r))) {
                    (Some(i), Some(want)) => Some(i && *want == c.text),
                    _ => None,
                };
                pb.inc(1);
            }
            self.records.push(Record {
                method: method.into(),
                prefix_tokens: p,
                new_tokens: self.a.new_tokens,
                ttft_s: Some(median_f(&ttfts)),
                ttft_runs_s: ttfts,
                ttft_miss_s: (!misses.is_empty()).then(|| median_f(&misses)),
                paired_ratio: (!ratios.is_empty()).then(|| median_f(&ratios)),
                external_hit_tokens: Some(median_u(&ext)),
                local_hit_tokens: (!local.is_empty()).then(|| median_u(&local)),
                bytes_loaded: (!bytes.is_empty()).then(|| median_u(&bytes)),
                output_identical: identical,
                output_matches_apc: matches_apc,
                runs,
                vs_recompute: None,
                vs_recompute_process: None,
                vs_apc: None,
                note: note.clone(),
            });
        }
        pb.finish_and_clear();
        Ok(())
    }

    /// `recompute` (no connector, no prefix cache) or `apc` (vLLM's prefix cache, A first).
    fn plain(&mut self, method: &str, apc: bool) -> Result<()> {
        let v = self.start(method, apc, None)?;
        if apc {
            self.serve_a(&v)?;
        }
        self.time_b(&v, method, None)?;
        v.stop()
    }

    /// The ObjectCache methods: one saver replica writes every store (MultiConnector), then a
    /// fresh replica per store times B.
    fn objectcache(&mut self, stores: &[(String, String)], async_file: bool) -> Result<()> {
        // `--connector-setting KEY=VALUE`, added to every ObjectCache connector's settings.
        let mut extra = serde_json::Map::new();
        for kv in &self.a.connector_settings {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("--connector-setting {kv:?} is not KEY=VALUE"))?;
            extra.insert(k.trim().to_string(), serde_json::Value::from(v.trim()));
        }
        let settings = |mut base: serde_json::Value| {
            if let Some(m) = base.as_object_mut() {
                m.extend(extra.clone());
            }
            base
        };
        let subs: Vec<serde_json::Value> = stores
            .iter()
            .map(|(_, url)| {
                serde_json::json!({
                    "kv_connector": "ObjectCacheConnector",
                    "kv_connector_module_path": "objectcache.vllm",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": settings(serde_json::json!({"store": url, "namespace": NAMESPACE})),
                })
            })
            .collect();
        let saver_cfg = serde_json::json!({
            "kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": subs},
        });
        let saver = self.start("objectcache-saver", false, Some(&saver_cfg))?;
        self.serve_a(&saver)?;
        // Saves run in the background after each forward pass: wait until every store
        // publishes every chunk of every prefix.
        let want: usize = self.a.prefixes.iter().map(|p| (p / BLOCK) as usize).sum();
        for (m, url) in stores {
            let s = spinner(
                &self.env.mp,
                format!("{m}: waiting for {want} chunks to be published"),
            );
            let r = self.rt.block_on(wait_published(url, want));
            s.finish_and_clear();
            r.with_context(|| format!("{m}: saves"))?;
        }
        saver.stop()?;
        let mut timed: Vec<(String, String, &str)> = Vec::new();
        for (m, url) in stores {
            if m == "objectcache-file" && !self.methods.iter().any(|x| x == m) {
                continue; // saved only for objectcache-file-async
            }
            timed.push((m.clone(), url.clone(), "layerwise"));
        }
        if async_file {
            if let Some((_, url)) = stores.iter().find(|(m, _)| m == "objectcache-file") {
                timed.push(("objectcache-file-async".into(), url.clone(), "async"));
            }
        }
        for (m, url, mode) in timed {
            let cfg = serde_json::json!({
                "kv_connector": "ObjectCacheConnector",
                "kv_connector_module_path": "objectcache.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": settings(serde_json::json!({"store": url, "namespace": NAMESPACE,
                                              "load_mode": mode, "save": false})),
            });
            let v = self.start(&m, false, Some(&cfg))?;
            self.time_b(&v, &m, None)?;
            v.stop()?;
        }
        Ok(())
    }

    /// A peer connector: saver and timed replica with the same configuration. A peer that
    /// does not start, or fails a request (vLLM's ExampleConnector fails prefixes longer than
    /// one prefill step on the CPU), becomes a record saying why for every prefix it has no
    /// figure for; the run goes on with the other methods.
    fn peer(&mut self, method: &str, cfg: serde_json::Value, note: Option<String>) -> Result<()> {
        let before = self.records.len();
        if let Err(e) = self.peer_run(method, cfg, note) {
            let why = format!("fails on this CPU vLLM: {}", one_line(&e));
            eprintln!("objectcache-bench: {method}: {why}");
            let done: Vec<u32> = self.records[before..]
                .iter()
                .filter(|r| r.method == method)
                .map(|r| r.prefix_tokens)
                .collect();
            for &p in &self.a.prefixes.clone() {
                if !done.contains(&p) {
                    self.records.push(empty(method, p, self.a.new_tokens, &why));
                }
            }
        }
        Ok(())
    }

    fn peer_run(
        &mut self,
        method: &str,
        cfg: serde_json::Value,
        note: Option<String>,
    ) -> Result<()> {
        let saver = self.start(&format!("{method}-saver"), false, Some(&cfg))?;
        self.serve_a(&saver)?;
        saver.stop()?;
        let v = self.start(method, false, Some(&cfg))?;
        self.time_b(&v, method, note)?;
        v.stop()
    }

    fn cpu_offload(&mut self) -> Result<()> {
        let cfg = serde_json::json!({
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1u64 << 30},
        });
        self.peer(
            "vllm-cpu-offload",
            cfg,
            Some("vLLM's CPU offloading keeps KV in its own process's memory: a fresh replica has none of it".into()),
        )
    }

    fn example(&mut self) -> Result<()> {
        let dir = self.tmp.join("example-connector");
        std::fs::create_dir_all(&dir)?;
        let cfg = serde_json::json!({
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": dir},
        });
        self.peer(
            "vllm-example",
            cfg,
            Some("vLLM's ExampleConnector: one safetensors file per layer and prompt prefix, loaded whole before the forward pass".into()),
        )
    }
}

fn one_line(e: &anyhow::Error) -> String {
    let s = format!("{e:#}");
    let err = s
        .lines()
        .rev()
        .find(|l| l.contains("Error") || l.contains("error"))
        .unwrap_or_else(|| s.lines().next().unwrap_or(""));
    err.chars().take(300).collect()
}

/// Waits until at least `want` chunks are published under the benchmark's namespace.
async fn wait_published(url: &str, want: usize) -> Result<()> {
    let store = open_store(url).await?;
    let t0 = Instant::now();
    loop {
        let n = store
            .list(&format!("{NAMESPACE}/"), usize::MAX)
            .await?
            .iter()
            .filter(|m| m.key.contains("/pub/"))
            .count();
        if n >= want {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("{n} of {want} chunks published after 600 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn median_f(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

fn median_u(v: &[u64]) -> u64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    s[s.len() / 2]
}

/// Fills the ratios and orders the records by method, then prefix.
fn finish(records: &mut [Record]) {
    let find = |m: &str, p: u32, rs: &[Record]| {
        rs.iter()
            .find(|r| r.method == m && r.prefix_tokens == p)
            .cloned()
    };
    let copy = records.to_vec();
    for r in records.iter_mut() {
        let Some(t) = r.ttft_s else { continue };
        let rec = find("recompute", r.prefix_tokens, &copy).and_then(|x| x.ttft_s);
        r.vs_recompute_process = rec.map(|x| t / x);
        r.vs_recompute = if r.method == "recompute" {
            Some(1.0)
        } else {
            r.paired_ratio.or(r.vs_recompute_process)
        };
        r.vs_apc = match (
            r.vs_recompute,
            find("apc", r.prefix_tokens, &copy).and_then(|x| x.paired_ratio),
        ) {
            (Some(a), Some(b)) => Some(a / b),
            _ => None,
        };
    }
    records.sort_by_key(|r| {
        (
            METHODS
                .iter()
                .position(|m| *m == r.method)
                .unwrap_or(usize::MAX),
            r.prefix_tokens,
        )
    });
}

fn print_table(records: &[Record], runs: usize) {
    println!();
    println!("TTFT in vLLM at the client, median of {runs} (cross-replica for connectors);");
    println!("x recomp: over the paired full computation in the same process (recompute: 1)");
    println!("identical: greedy output equals recompute's; =apc: equals apc's (same request)");
    println!(
        "{:<22} {:>6} {:>9} {:>9} {:>8} {:>6} {:>8} {:>11} {:>9} {:>5}",
        "method",
        "prefix",
        "TTFT ms",
        "miss ms",
        "x recomp",
        "x apc",
        "ext hits",
        "bytes",
        "identical",
        "=apc"
    );
    for r in records {
        let f = |x: Option<f64>, d: usize| x.map_or("-".to_string(), |v| format!("{v:.d$}"));
        let yes_no = |v: Option<bool>| v.map_or("-", |v| if v { "yes" } else { "NO" });
        println!(
            "{:<22} {:>6} {:>9} {:>9} {:>8} {:>6} {:>8} {:>11} {:>9} {:>5}",
            r.method,
            r.prefix_tokens,
            f(r.ttft_s.map(|t| t * 1000.0), 1),
            f(r.ttft_miss_s.map(|t| t * 1000.0), 1),
            f(r.vs_recompute, 2),
            f(r.vs_apc, 2),
            r.external_hit_tokens.map_or("-".into(), |v| v.to_string()),
            r.bytes_loaded.map_or("-".into(), |v| v.to_string()),
            yes_no(r.output_identical),
            yes_no(r.output_matches_apc),
        );
    }
    let mut notes: Vec<(&str, &str)> = Vec::new();
    for r in records {
        if let Some(n) = &r.note {
            if !notes.iter().any(|(m, _)| *m == r.method) {
                notes.push((&r.method, n));
            }
        }
    }
    for (m, n) in notes {
        println!("  {m}: {n}");
    }
}
