//! Shared by the benchmark's end-to-end tests (`modeled_ttft`, `traffic`): runs
//! `objectcache-bench` with `--json` and `--svg` into a temporary folder and hands back what
//! it printed and wrote.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

/// One finished run of the benchmark.
pub struct BenchRun {
    /// Holds the JSON file and the SVG folder until the run is dropped.
    dir: tempfile::TempDir,
    /// What the benchmark printed on standard output.
    pub stdout: String,
    /// The JSON records (`--json`): the benchmark writes a list of objects.
    pub records: Vec<Value>,
}

impl BenchRun {
    /// The `--svg` folder.
    pub fn svg(&self) -> PathBuf {
        self.dir.path().join("svg")
    }
}

/// Runs `objectcache-bench ARGS --json DIR/records.json --svg DIR/svg`. Panics, with the
/// benchmark's output, if it exits with a failure or its JSON is not a list of records.
pub fn run_bench(args: &[&str]) -> BenchRun {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("records.json");
    let out = Command::new(env!("CARGO_BIN_EXE_objectcache-bench"))
        .args(args)
        .arg("--json")
        .arg(&json)
        .arg("--svg")
        .arg(dir.path().join("svg"))
        .output()
        .expect("run objectcache-bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed:\n{stdout}\n{stderr}");
    let records = serde_json::from_str(&std::fs::read_to_string(&json).unwrap())
        .expect("JSON is a list of records");
    BenchRun {
        dir,
        stdout,
        records,
    }
}
