//! What a run needs besides vLLM: the venv's Python and the model, the `objectcache` package
//! installed from `ffi/python`, the S3 credentials and stores, and our own server
//! (`objectcache serve`) over a directory store; a progress spinner.

use super::{ModelSpec, SERVER_BUCKET};
use anyhow::{anyhow, bail, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use objectcache::store::{S3Config, S3Store};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The venv's Python and the model folder.
/// `venv` is `--venv`, `model` `--model` (a name of [`super::MODELS`], whose spec is
/// `spec`, or a folder).
pub(crate) fn locate(
    venv: &Path,
    model: Option<&str>,
    spec: &ModelSpec,
) -> Result<(PathBuf, PathBuf)> {
    let d = venv;
    // `--model` is a name of MODELS (its folder under the venv's models/) or a folder.
    let named = (spec.name != "custom").then(|| d.join("models").join(spec.folder));
    let given = model.filter(|_| named.is_none()).map(PathBuf::from);
    let py = if d.join("venv/bin/python").is_file() {
        d.join("venv/bin/python")
    } else if d.join("bin/python").is_file() {
        if given.is_none() {
            bail!(
                "--venv {} is a virtual environment: give --model a model folder",
                d.display()
            );
        }
        d.join("bin/python")
    } else {
        bail!(
            "no vLLM venv at {} (make one with scripts/vllm-setup.sh {})",
            d.display(),
            d.display()
        );
    };
    let model = given.or(named).expect("a named model or a folder");
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

pub(crate) fn spinner(mp: &MultiProgress, msg: String) -> ProgressBar {
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
/// `package_src`: `--package-src` (default: this repository's `ffi/python`).
pub(crate) fn install_package(
    py: &Path,
    package_src: Option<&Path>,
    tmp: &Path,
    mp: &MultiProgress,
) -> Result<PathBuf> {
    let src = package_src
        .map(Path::to_path_buf)
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
    // This build's library, so that pip does not run cargo (a second build of the library
    // in its own feature set: minutes on a cold machine). `cargo build` puts it beside the
    // binary; `cargo test`, which builds the binary for its tests, leaves it in `deps/`. The
    // newer of the two is this build's.
    let exe = std::env::current_exe()?;
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    let newest = [
        dir.join("libobjectcache.so"),
        dir.join("deps/libobjectcache.so"),
    ]
    .into_iter()
    .filter_map(|l| Some((std::fs::metadata(&l).ok()?.modified().ok()?, l)))
    .max_by_key(|(t, _)| *t);
    if let Some((_, lib)) = newest {
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

pub(crate) fn python_out(py: &Path, code: &str, site: &Path) -> Result<String> {
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
pub(crate) fn s3_store(
    given: Option<&str>,
    rt: &tokio::runtime::Runtime,
) -> Result<std::result::Result<String, String>> {
    if let Some(u) = given {
        return Ok(Ok(u.to_string()));
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

/// Sets the AWS environment where unset: the test S3 credentials ([`s3_credentials`]), no
/// instance metadata service, region `us-east-1`. The benchmark's own servers take these
/// credentials, and its checks that saves were published read them from the AWS
/// environment: without them the AWS SDK would look for an instance metadata service. Call
/// it before the process starts any thread.
pub(crate) fn aws_env() {
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
        let (ak, sk) = s3_credentials();
        std::env::set_var("AWS_ACCESS_KEY_ID", ak);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", sk);
        std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
    }
    if std::env::var_os("AWS_REGION").is_none() {
        std::env::set_var("AWS_REGION", "us-east-1");
    }
}

/// `(access key, secret key)` for the S3 stores: the test S3 credentials.
pub(crate) fn s3_credentials() -> (String, String) {
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
pub(crate) struct ObjectCacheServer {
    child: Child,
    addr: String,
}

impl ObjectCacheServer {
    pub(crate) fn start(dir: &Path, logs: &Path) -> Result<Self> {
        let store = dir.display().to_string();
        ObjectCacheServer::start_with(&store, &[], logs, "storage-server.log")
    }

    /// `objectcache serve --store STORE EXTRA...` (a directory, or `s3://...` for gateway
    /// mode), logging to `logs/LOG`.
    pub(crate) fn start_with(
        store: &str,
        extra: &[String],
        logs: &Path,
        log: &str,
    ) -> Result<Self> {
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
            .arg(store)
            .args(["--access-key", &format!("{ak}:{sk}")])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(File::create(logs.join(log))?)
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
                logs.join(log).display()
            );
        }
        Ok(ObjectCacheServer { child, addr })
    }

    /// The server's address (`127.0.0.1:PORT`).
    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    /// The server's port, from its address.
    pub(crate) fn port(&self) -> Option<u16> {
        self.addr.rsplit(':').next()?.parse().ok()
    }

    pub(crate) fn url(&self) -> String {
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
