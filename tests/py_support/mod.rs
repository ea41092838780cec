//! Shared by the Python tests (`python_package`, `vllm_connector`): the vLLM venv of
//! `scripts/vllm-setup.sh` (its Python has pytest), the `objectcache` package installed from
//! `ffi/python` with pip into a temporary directory (bundling this build's cdylib), and pytest
//! runs of `ffi/python/tests`. A test binary that includes it also includes `tests/common` as
//! `common`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `$OBJECTCACHE_VLLM_DIR`, else `target/vllm` under the repository root.
pub fn vllm_dir() -> PathBuf {
    std::env::var_os("OBJECTCACHE_VLLM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target").join("vllm"))
}

/// The venv's Python and the model folder, or `None` (after printing SKIP) when the venv is
/// absent. Panics when `OBJECTCACHE_REQUIRE_ALL` is set and it is absent.
pub fn venv(test: &str) -> Option<(PathBuf, PathBuf)> {
    let d = vllm_dir();
    let py = d.join("venv").join("bin").join("python");
    let model = d.join("models").join("smollm2-135m-hf");
    if py.is_file() && model.join("config.json").is_file() {
        return Some((py, model));
    }
    let why = format!(
        "no vLLM venv and model under {} (run scripts/vllm-setup.sh {})",
        d.display(),
        d.display()
    );
    if std::env::var_os("OBJECTCACHE_REQUIRE_ALL").is_some() {
        panic!("{test}: {why}, but OBJECTCACHE_REQUIRE_ALL is set");
    }
    println!("SKIP {test}: {why}");
    None
}

/// This build's `libobjectcache.so` (the test binary lives in `deps/`, next to the cdylib
/// built for this run), or the one in `$OBJECTCACHE_CDYLIB_DIR`.
pub fn cdylib() -> PathBuf {
    let name = "libobjectcache.so";
    if let Some(d) = std::env::var_os("OBJECTCACHE_CDYLIB_DIR") {
        return PathBuf::from(d).join(name);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps dir").to_path_buf();
    let profile = deps.parent().expect("profile dir").to_path_buf();
    for d in [&deps, &profile] {
        if d.join(name).exists() {
            return d.join(name);
        }
    }
    panic!("{name} not found next to {}", exe.display());
}

/// Installs the package with `pip install --target DIR ./ffi/python` (the build backend copies
/// this build's cdylib instead of running cargo, which the running `cargo test` holds locked),
/// and returns DIR (for `PYTHONPATH`).
pub fn install_package(py: &Path, tmp: &Path) -> PathBuf {
    let site = tmp.join("site");
    let out = Command::new(py)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
        ])
        .arg("--target")
        .arg(&site)
        .arg(root().join("ffi").join("python"))
        .env("OBJECTCACHE_CDYLIB", cdylib())
        .output()
        .expect("run pip");
    crate::common::assert_exited_ok(&out, "pip install ./ffi/python failed:\n");
    assert!(
        site.join("objectcache").join("libobjectcache.so").is_file(),
        "the installed package has no bundled libobjectcache.so"
    );
    site
}

/// The venv's Python and model folder with the package installed by [`install_package`] in
/// a temporary directory, which lives as long as this.
pub struct Installed {
    /// The venv's Python.
    pub py: PathBuf,
    /// The model folder.
    pub model: PathBuf,
    /// Where the package is installed (for `PYTHONPATH`).
    pub site: PathBuf,
    _tmp: tempfile::TempDir,
}

/// [`venv`] for `test`, then [`install_package`] into a new temporary directory; `None`
/// (after printing SKIP) when the venv is absent, as [`venv`].
pub fn installed(test: &str) -> Option<Installed> {
    let (py, model) = venv(test)?;
    let tmp = tempfile::tempdir().unwrap();
    let site = install_package(&py, tmp.path());
    Some(Installed {
        py,
        model,
        site,
        _tmp: tmp,
    })
}

/// The pytest command on `args` (files or node ids under ffi/python/tests) with the package at
/// `site` and extra environment.
fn pytest_command(py: &Path, site: &Path, args: &[&str], env: &[(&str, String)]) -> Command {
    let tests = root().join("ffi").join("python").join("tests");
    let mut cmd = Command::new(py);
    // `--durations`: the slowest tests' times in CI's log, for its time budget.
    cmd.args([
        "-m",
        "pytest",
        "-v",
        "-s",
        // The short summary names each failed test and its error (`FAILED file::test -
        // ...`); the lanes' panic repeats those lines, so CI's summary shows them.
        "-rfEs",
        "-p",
        "no:cacheprovider",
        "--durations=25",
    ])
    // Files and node ids are under the tests folder; options (`--deselect=...`) go as they
    // are.
    .args(args.iter().map(|a| {
        if a.starts_with('-') {
            std::ffi::OsString::from(a)
        } else {
            tests.join(a).into_os_string()
        }
    }))
    .current_dir(&tests)
    .env("PYTHONPATH", site)
    .env("PYTHONDONTWRITEBYTECODE", "1")
    .env("OBJECTCACHE_BIN", env!("CARGO_BIN_EXE_objectcache"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs pytest on `files` (under ffi/python/tests) with the package at `site` and extra
/// environment; prints its output and panics if it fails.
pub fn pytest(py: &Path, site: &Path, files: &[&str], env: &[(&str, String)]) {
    let status = pytest_command(py, site, files, env)
        .status()
        .expect("run pytest");
    assert!(status.success(), "pytest {files:?} failed: {status}");
}

/// Runs the vLLM suites in `lanes` (each a list of pytest files, node ids or options such as
/// `--deselect=tests/FILE::TEST`, a node id as pytest names it from `ffi/python`) side by
/// side, one pytest process per lane, each with its own half of the CPUs for vLLM's worker
/// threads (`VLLM_CPU_OMP_THREADS_BIND`); every output line is printed with its lane's name.
/// With fewer CPUs than lanes, one pytest runs them all, as [`pytest`].
///
/// Why: vLLM's CPU worker binds its compute threads to all CPUs but one, which it leaves to
/// the engine's other processes. On a 2-core machine a replica computes on one core, and two
/// replicas bound to one core each ran three prompts in the time one took alone (43 s
/// against 44 s). A test that starts a replica with its own binding (tensor parallel 2: a
/// core per rank) keeps it and shares the cores for its duration. Each lane has its own
/// session fixtures (its own `objectcache serve`) and `--basetemp`.
///
/// Panics, after every lane has finished, if any failed.
pub fn pytest_lanes(py: &Path, site: &Path, lanes: &[&[&str]], env: &[(&str, String)]) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if lanes.len() < 2 || cpus < lanes.len() {
        let all: Vec<&str> = lanes.iter().flat_map(|l| l.iter().copied()).collect();
        return pytest(py, site, &all, env);
    }
    let base = tempfile::tempdir().expect("pytest base directory");
    let per = cpus / lanes.len();
    let runs: Vec<_> = lanes
        .iter()
        .enumerate()
        .map(|(i, files)| {
            let (first, last) = (i * per, i * per + per - 1);
            let cores = if first == last {
                first.to_string()
            } else {
                format!("{first}-{last}")
            };
            let name = format!("vllm-{}", (b'a' + i as u8) as char);
            let temp = base.path().join(&name);
            let mut cmd = pytest_command(py, site, files, env);
            cmd.arg("--basetemp")
                .arg(&temp)
                .env("VLLM_CPU_OMP_THREADS_BIND", &cores)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            let mut child = cmd.spawn().expect("run pytest");
            println!("{name}: pytest {files:?}, vLLM workers on CPUs {cores}");
            // Echoes a stream with the lane's name; returns pytest's short-summary lines of
            // failures (`FAILED ...`, `ERROR ...`).
            let echo = |r: Box<dyn std::io::Read + Send>, name: String| {
                std::thread::spawn(move || {
                    use std::io::{BufRead, Write};
                    let mut failures = Vec::new();
                    for line in std::io::BufReader::new(r).lines().map_while(Result::ok) {
                        // Not println!: the test harness would hold it back until the end.
                        let _ = writeln!(std::io::stdout().lock(), "[{name}] {line}");
                        if line.starts_with("FAILED ") || line.starts_with("ERROR ") {
                            failures.push(line);
                        }
                    }
                    failures
                })
            };
            let out = echo(Box::new(child.stdout.take().unwrap()), name.clone());
            let err = echo(Box::new(child.stderr.take().unwrap()), name.clone());
            (name, files, child, [out, err])
        })
        .collect();
    let mut failed = Vec::new();
    for (name, files, mut child, echoes) in runs {
        let status = child.wait().expect("wait for pytest");
        let mut failures = Vec::new();
        for e in echoes {
            failures.extend(e.join().unwrap_or_default());
        }
        if !status.success() {
            failed.push(format!(
                "{name} ({files:?}): {status}{}",
                failures
                    .iter()
                    .map(|l| format!("\n  {l}"))
                    .collect::<String>()
            ));
        }
    }
    assert!(failed.is_empty(), "pytest failed: {}", failed.join("; "));
}
