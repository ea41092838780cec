//! One vLLM OpenAI-compatible server process: what every process is started with ([`Env`]),
//! its start (until healthy), stop, and the stop of its whole process group on drop.

use super::setup::{s3_credentials, spinner};
use super::{http, VllmArgs};
use anyhow::{bail, Context, Result};
use indicatif::MultiProgress;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What every vLLM process is started with.
pub(crate) struct Env {
    py: PathBuf,
    pub(crate) model: PathBuf,
    site: PathBuf,
    logs: PathBuf,
    kv_gib: u32,
    reserved_cpus: u32,
    dtype: String,
    max_len: u32,
    tp: u32,
    /// Start vLLM with its hybrid KV cache manager off (`--disable-hybrid-kv-cache-manager`).
    pub(crate) hma_off: bool,
    /// More arguments for every process (e.g. `--num-gpu-blocks-override N`).
    pub(crate) extra_args: Vec<String>,
    /// More environment variables for every process (e.g. a peer's `LMCACHE_*` settings).
    pub(crate) extra_env: Vec<(String, String)>,
    /// Start every process under Linux's `SCHED_IDLE` policy (`chrt --idle 0`): it runs only
    /// on a core that no process of the normal policy wants, whatever their nice values.
    pub(crate) idle: bool,
    pub(crate) mp: MultiProgress,
}

impl Env {
    /// The context length every process is started with (`--max-model-len`), tokens.
    pub(crate) fn max_len(&self) -> u32 {
        self.max_len
    }

    /// The folder of the processes' logs (`LABEL.log` each).
    pub(crate) fn logs(&self) -> &Path {
        &self.logs
    }

    /// The vLLM venv's Python.
    pub(crate) fn python(&self) -> &Path {
        &self.py
    }

    /// The processes' `PYTHONPATH`: the folder the ObjectCache package is installed in, then
    /// the caller's own `PYTHONPATH` (where a peer such as LMCache may be installed outside
    /// the venv).
    pub(crate) fn python_path(&self) -> std::ffi::OsString {
        let mut path = std::ffi::OsString::from(&self.site);
        if let Some(more) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
            path.push(":");
            path.push(more);
        }
        path
    }

    pub(crate) fn new(
        py: &Path,
        model: &Path,
        site: &Path,
        logs: &Path,
        a: &VllmArgs,
        max_len: u32,
        mp: MultiProgress,
    ) -> Self {
        Env {
            reserved_cpus: a.reserved_cpus,
            tp: a.tp,
            ..Env::fleet(py, model, site, logs, a.kv_cache_gib, &a.dtype, max_len, mp)
        }
    }

    /// What every process of a fleet is started with: as [`Env::new`] from the settings
    /// themselves (KV cache GiB, reserved cores, dtype, context), tensor-parallel size 1.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fleet(
        py: &Path,
        model: &Path,
        site: &Path,
        logs: &Path,
        kv_gib: u32,
        dtype: &str,
        max_len: u32,
        mp: MultiProgress,
    ) -> Self {
        Env {
            py: py.into(),
            model: model.into(),
            site: site.into(),
            logs: logs.into(),
            kv_gib,
            reserved_cpus: 0,
            dtype: dtype.into(),
            max_len,
            tp: 1,
            hma_off: false,
            extra_args: Vec::new(),
            extra_env: Vec::new(),
            idle: false,
            mp,
        }
    }
}

/// One vLLM OpenAI-compatible server process.
pub(crate) struct Vllm {
    child: Child,
    pub(crate) port: u16,
    pub(crate) label: String,
    pub(crate) startup_s: f64,
}

impl Vllm {
    pub(crate) fn start(
        env: &Env,
        rt: &tokio::runtime::Runtime,
        label: &str,
        apc: bool,
        kv: Option<&serde_json::Value>,
    ) -> Result<Vllm> {
        Vllm::start_bound(env, rt, label, apc, kv, None)
    }

    /// As [`Vllm::start`], with the model's compute threads bound to `cpus`
    /// (`VLLM_CPU_OMP_THREADS_BIND`, e.g. `1` or `0-3`) when given: replicas sharing a
    /// machine each take their own cores.
    pub(crate) fn start_bound(
        env: &Env,
        rt: &tokio::runtime::Runtime,
        label: &str,
        apc: bool,
        kv: Option<&serde_json::Value>,
        cpus: Option<&str>,
    ) -> Result<Vllm> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = env.logs.join(format!("{label}.log"));
        let (ak, sk) = s3_credentials();
        let mut cmd = if env.idle {
            let mut c = Command::new("chrt");
            c.args(["--idle", "0"]).arg(&env.py);
            c
        } else {
            Command::new(&env.py)
        };
        cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&env.model)
            .args(["--dtype", &env.dtype])
            .args([
                "--enforce-eager",
                "--max-model-len",
                &env.max_len.to_string(),
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
            if env.hma_off {
                cmd.arg("--disable-hybrid-kv-cache-manager");
            }
        }
        cmd.args(&env.extra_args);
        if let Some(c) = cpus {
            cmd.env("VLLM_CPU_OMP_THREADS_BIND", c);
        } else if env.tp > 1 {
            cmd.args(["--tensor-parallel-size", &env.tp.to_string()]);
            // vLLM on the CPU binds each rank to a NUMA node of its own unless told which
            // cores to take; a machine of one node gets the cores split between the ranks.
            if std::env::var_os("VLLM_CPU_OMP_THREADS_BIND").is_none() {
                cmd.env("VLLM_CPU_OMP_THREADS_BIND", cpu_split(env.tp));
            }
        }
        cmd.envs(env.extra_env.iter().map(|(k, v)| (k, v)));
        cmd.env("PYTHONPATH", env.python_path())
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
    pub(crate) fn stop(mut self) -> Result<()> {
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

/// This process's CPUs split into `parts` contiguous shares, as vLLM's
/// `VLLM_CPU_OMP_THREADS_BIND` takes them (`0-3|4-7`; one core a rank at least).
fn cpu_split(parts: u32) -> String {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let per = (n / parts).max(1);
    (0..parts)
        .map(|i| {
            let lo = (i * per).min(n - 1);
            let hi = if i + 1 == parts {
                (n - 1).max(lo)
            } else {
                lo + per - 1
            };
            if hi > lo {
                format!("{lo}-{hi}")
            } else {
                lo.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("|")
}
