//! The simulator is deterministic: same inputs and seed, same output; and `objectcache sim`
//! writes the documented JSON records and an SVG.

use crate::common::run_ok;
use objectcache::sched::{ComputeModel, GpuKind, KernelClass};
use objectcache::sim::{run, workload, RunSpec, SimConfig, SimPolicy};
use std::process::Command;

/// Llama-3.1-8B with tuned kernels on `gpu`, 4 KiB per token per layer in 256-token chunks,
/// over a link of `capacity` bytes/s (no per-load rate limit).
fn llama_config(gpu: GpuKind, capacity: f64) -> SimConfig {
    SimConfig {
        model: ComputeModel::preset("llama-3.1-8b", gpu, KernelClass::Tuned).unwrap(),
        kv_bytes_per_token_per_layer: 4096,
        chunk_tokens: 256,
        capacity,
        max_rate_per_load: f64::INFINITY,
    }
}

fn records(seed: u64) -> String {
    let cfg = llama_config(GpuKind::H200, 0.5 * 12.5e9);
    let w = workload::staggered_mix(6, 2, 1.5, seed);
    let b = workload::burst_mix(3, 2, seed);
    let mut out = Vec::new();
    for w in [&w, &b] {
        out.extend(
            run(&RunSpec {
                workload: w,
                config: &cfg,
                cap_fraction: 0.5,
                policies: &SimPolicy::standard(),
                model: "llama-3.1-8b",
                gpu: "h200",
                seed,
                bound_max_states: 100_000,
            })
            .unwrap(),
        );
    }
    serde_json::to_string(&out).unwrap()
}

#[test]
fn same_seed_same_records() {
    let a = records(11);
    assert_eq!(a, records(11));
    assert_ne!(a, records(12));
    let v: serde_json::Value = serde_json::from_str(&a).unwrap();
    let with_bound = v
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            r["lower_bound_mean_added_ttft_s"]
                .as_f64()
                .is_some_and(|b| b > 0.0)
        })
        .count();
    assert_eq!(
        with_bound, 4,
        "bound computed for the small burst's four full-load policies"
    );
}

#[test]
fn trace_replay_is_deterministic_and_finds_prefix_hits() {
    let text = include_str!("../data/traces/mooncake_small.jsonl");
    let w = workload::mooncake_trace(text, 1.0).unwrap();
    assert_eq!(w.requests(), 48);
    let hits = w.instances[0]
        .requests
        .iter()
        .filter(|r| r.prefix_tokens > 0)
        .count();
    assert!(hits > 30, "{hits} hits");
    let cfg = llama_config(GpuKind::H100, 0.25 * 12.5e9);
    for p in SimPolicy::standard() {
        let a = objectcache::sim::simulate(&w, &cfg, p).unwrap();
        let b = objectcache::sim::simulate(&w, &cfg, p).unwrap();
        assert_eq!(a, b, "{}", p.name());
        assert!(a.iter().all(|o| o.ttft_s >= o.local_ttft_s - 1e-9));
    }
}

#[test]
fn cli_writes_json_records_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("sim.json");
    let svg = dir.path().join("sim.svg");
    let out = run_ok(
        Command::new(env!("CARGO_BIN_EXE_objectcache"))
            .args([
                "sim",
                "--concurrency",
                "2,4",
                "--cap",
                "0.5",
                "--instances",
                "2",
                "--seed",
                "3",
                "--json",
            ])
            .arg(&json)
            .arg("--svg")
            .arg(&svg),
    );
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("stall-aware+planner") && table.contains("meanAdd"),
        "{table}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let recs = v.as_array().unwrap();
    assert_eq!(recs.len(), 2 * SimPolicy::standard().len());
    for r in recs {
        for key in [
            "workload",
            "policy",
            "cap_fraction",
            "requests",
            "mean_added_ttft_s",
            "p99_added_ttft_s",
            "mean_ttft_s",
            "lower_bound_mean_added_ttft_s",
        ] {
            assert!(r.get(key).is_some(), "missing {key} in {r}");
        }
    }
    let lb = recs
        .iter()
        .find(|r| r["concurrency"] == 2 && r["policy"] == "stall-aware")
        .unwrap();
    assert!(lb["lower_bound_mean_added_ttft_s"].as_f64().unwrap() > 0.0);
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(
        s.contains("<svg") && s.contains("stall-aware"),
        "not an SVG plot"
    );
    // A bad flag is a clear error, not a panic.
    let bad = Command::new(env!("CARGO_BIN_EXE_objectcache"))
        .args(["sim", "--gpu", "v100"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("v100"));
}
