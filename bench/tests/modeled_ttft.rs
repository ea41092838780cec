//! `objectcache-bench ttft --mode modeled` end to end on one small grid point: a real
//! in-process ObjectCache server on loopback behind the capped proxy, real chunk objects saved
//! and loaded over gather, ranged GETs and whole-object GETs (every byte compared by the
//! benchmark), then the modeled timeline. Checks structural truths of the records, never
//! timings against fixed numbers.
//!
//! When `OBJECTCACHE_NIXL_VENV` names a virtual environment with nixl-cu12, the `nixl-obj`
//! method must be present too (the benchmark reads the variable itself).

mod support;

use serde_json::Value;
use std::process::Command;

const REQUIRED: &[&str] = &[
    "method",
    "model",
    "context_tokens",
    "new_tokens",
    "concurrency",
    "policy",
    "ttft_s",
    "added_ttft_s",
    "added_ttft_pct",
    "transfer_time_s",
    "bound_ttft_s",
    "link_bytes_per_s",
    "loopback_cap_bytes_per_s",
    "time_scale",
    "gpu",
    "h2d_bytes_per_s",
];

fn find<'a>(recs: &'a [Value], method: &str, conc: u64) -> Vec<&'a Value> {
    recs.iter()
        .filter(|r| r["method"] == method && r["concurrency"].as_u64() == Some(conc))
        .collect()
}

fn f(r: &Value, k: &str) -> f64 {
    r[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number in {r}"))
}

#[test]
fn modeled_grid_point_end_to_end() {
    let run = support::run_bench(&[
        "ttft",
        "--mode",
        "modeled",
        "--models",
        "llama-3.1-8b",
        "--contexts",
        "4096",
        "--new-tokens",
        "1024",
        "--gpu",
        "h100",
        "--runs",
        "1",
        "--max-load-mib",
        "64",
        "--concurrency",
        "4",
        "--policies",
        "fifo,stall-aware",
    ]);
    let (stdout, recs, svg) = (&run.stdout, &run.records[..], run.svg());
    assert!(
        stdout.contains("goal gather-tcp within 5% of the pipeline bound"),
        "{stdout}"
    );

    for r in recs {
        for k in REQUIRED {
            assert!(r.get(*k).is_some(), "record lacks {k}: {r}");
        }
    }
    let nixl = std::env::var_os("OBJECTCACHE_NIXL_VENV").is_some();
    let mut methods = vec![
        "local-layerwise",
        "gather-tcp",
        "gather-tcp+planner",
        "s3-layerwise",
        "chunkwise",
        "recompute",
    ];
    if nixl {
        methods.push("nixl-obj");
    } else {
        assert!(
            find(recs, "nixl-obj", 1).is_empty(),
            "nixl-obj without a venv"
        );
    }
    let one = |m: &str| {
        let v = find(recs, m, 1);
        assert_eq!(v.len(), 1, "one single-request record of {m}: {v:?}");
        v[0]
    };
    for m in &methods {
        let r = one(m);
        assert_eq!(r["model"], "llama-3.1-8b");
        assert_eq!(r["context_tokens"], 4096);
        assert_eq!(r["new_tokens"], 1024);
        assert_eq!(r["policy"], "single");
        assert!(f(r, "ttft_s") > 0.0, "{r}");
        assert!(f(r, "bound_ttft_s") > 0.0, "{r}");
    }
    let local = one("local-layerwise");
    let gather = one("gather-tcp");
    let chunk = one("chunkwise");
    let planner = one("gather-tcp+planner");
    let recompute = one("recompute");
    // The capped link lets at most BURST_S (4 ms) of bytes run ahead, in real time.
    let eps = 0.004 * f(gather, "time_scale") + 1e-9;
    assert!(
        f(gather, "ttft_s") >= f(gather, "bound_ttft_s") - eps,
        "gather beats the pipeline bound: {gather}"
    );
    assert!(f(gather, "transfer_time_s") > 0.0);
    assert!(
        f(gather, "transfer_time_s") >= f(gather, "pure_transfer_s") - eps,
        "gather moved the prefix faster than the link: {gather}"
    );
    assert!(
        f(local, "ttft_s") <= f(chunk, "ttft_s"),
        "local {local} chunkwise {chunk}"
    );
    assert!(f(local, "ttft_s") <= f(gather, "ttft_s"));
    assert_eq!(f(local, "added_ttft_s"), 0.0);
    assert!(
        f(planner, "ttft_s") <= f(recompute, "ttft_s"),
        "planner {planner} recompute {recompute}"
    );
    assert!(planner["loaded_tokens"].as_u64().unwrap() <= 4096);
    // The 4K prefix was measured with fewer real bytes than it has: the scale says so.
    assert!(f(gather, "measured_bytes") < f(gather, "prefix_bytes"));
    assert!(f(gather, "time_scale") > 0.0);

    for p in ["fifo", "stall-aware"] {
        let v: Vec<_> = find(recs, "gather-tcp", 4)
            .into_iter()
            .filter(|r| r["policy"] == p)
            .collect();
        assert_eq!(v.len(), 1, "concurrency-4 record of {p}");
        assert!(v[0]["bound_ttft_s"].is_null());
        assert!(f(v[0], "ttft_s") > 0.0);
    }

    let svgs: Vec<_> = std::fs::read_dir(&svg).unwrap().flatten().collect();
    assert!(
        svgs.len() >= 2,
        "expected TTFT and timeline plots: {svgs:?}"
    );
    for e in svgs {
        let t = std::fs::read_to_string(e.path()).unwrap();
        assert!(
            t.starts_with("<svg") && t.ends_with("</svg>"),
            "{:?}",
            e.path()
        );
    }
}

#[test]
fn modeled_bad_arguments_are_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_objectcache-bench"))
        .args(["ttft", "--mode", "modeled", "--gpu", "v100", "--quick"])
        .output()
        .expect("run objectcache-bench");
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("v100"), "{e}");
    let out = Command::new(env!("CARGO_BIN_EXE_objectcache-bench"))
        .args([
            "ttft",
            "--mode",
            "modeled",
            "--contexts",
            "100",
            "--models",
            "llama-3.1-8b",
        ])
        .output()
        .expect("run objectcache-bench");
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--contexts 100"), "{e}");
}
