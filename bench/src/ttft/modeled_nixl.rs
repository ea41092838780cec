//! The NIXL OBJ peer of `ttft --mode modeled`: NIXL's own OBJ backend plugin (from the
//! `nixl-cu12` wheel, in a Python virtual environment the user names) reads the same chunk
//! objects from the same server through its S3 API, driven by `bench/nixl/nixl_obj_load.py`
//! (carried inside this binary and written to a temporary file when used).

use anyhow::{anyhow, bail, Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The driver script (see its docstring for the stdin/stdout protocol).
pub const DRIVER: &str = include_str!("../../nixl/nixl_obj_load.py");

/// What the driver reported.
#[derive(Debug, Clone)]
pub enum NixlOutcome {
    /// Loads completed: seconds per run, bytes per run, SHA-256 of the first object read.
    Loaded {
        /// Wall-clock seconds of each READ transfer (post to DONE).
        load_s: Vec<f64>,
        /// Bytes per run (whole objects).
        bytes: u64,
        /// Hex SHA-256 of the first object as NIXL placed it in host memory.
        sha256_first: String,
        /// NIXL package and version as the driver found it.
        version: String,
    },
    /// NIXL or its OBJ plugin cannot run here; the reason.
    Unavailable(String),
}

/// The driver's input.
#[derive(Debug, serde::Serialize)]
pub struct NixlJob<'a> {
    /// `http://HOST:PORT` of the S3 endpoint.
    pub endpoint: String,
    /// Bucket.
    pub bucket: &'a str,
    /// Access key.
    pub access_key: &'a str,
    /// Secret key.
    pub secret_key: &'a str,
    /// Region (SigV4).
    pub region: &'a str,
    /// Object keys, in chunk order.
    pub keys: Vec<String>,
    /// Bytes of each object.
    pub object_bytes: u64,
    /// Timed READ transfers.
    pub runs: usize,
    /// Give up on one transfer after this long, seconds.
    pub timeout_s: f64,
}

/// The interpreter of a virtual environment directory (`bin/python`, or `bin/python3`).
///
/// # Errors
/// If neither exists.
pub fn python_of(venv: &Path) -> Result<PathBuf> {
    for n in ["bin/python", "bin/python3"] {
        let p = venv.join(n);
        if p.exists() {
            return Ok(p);
        }
    }
    bail!(
        "--nixl-venv {}: no bin/python in it (create it with: python3 -m venv DIR && DIR/bin/pip install --no-deps nixl-cu12 && DIR/bin/pip install numpy)",
        venv.display()
    )
}

/// Runs the driver with `python` on `job`.
///
/// # Errors
/// If the interpreter cannot be started, or the driver fails on its input (exit 2) or prints
/// no result. NIXL being unusable here is not an error: [`NixlOutcome::Unavailable`].
pub fn run(python: &Path, job: &NixlJob<'_>) -> Result<NixlOutcome> {
    let dir = tempfile::tempdir().context("temporary directory for the NIXL driver")?;
    let script = dir.path().join("nixl_obj_load.py");
    std::fs::write(&script, DRIVER).context("writing the NIXL driver")?;
    let mut child = Command::new(python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", python.display()))?;
    let input = serde_json::to_vec(job)?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow!("driver stdin"))?
        .write_all(&input)
        .context("writing the driver's input")?;
    let out = child
        .wait_with_output()
        .context("waiting for the NIXL driver")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let Some(line) = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
    else {
        if out.status.code() == Some(2) {
            bail!("NIXL driver rejected its input: {}", stderr.trim());
        }
        let tail: String = stderr.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        return Ok(NixlOutcome::Unavailable(format!(
            "the NIXL driver exited with {} and no result ({tail})",
            out.status
        )));
    };
    let v: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("NIXL driver output {line:?}"))?;
    if v["ok"].as_bool() != Some(true) {
        return Ok(NixlOutcome::Unavailable(
            v["why"].as_str().unwrap_or("no reason given").to_string(),
        ));
    }
    let load_s: Vec<f64> = v["load_s"]
        .as_array()
        .ok_or_else(|| anyhow!("NIXL driver: no load_s"))?
        .iter()
        .filter_map(|x| x.as_f64())
        .collect();
    if load_s.is_empty() {
        bail!("NIXL driver: empty load_s");
    }
    Ok(NixlOutcome::Loaded {
        load_s,
        bytes: v["bytes"].as_u64().unwrap_or(0),
        sha256_first: v["sha256_first"].as_str().unwrap_or("").to_string(),
        version: v["nixl_version"].as_str().unwrap_or("unknown").to_string(),
    })
}
