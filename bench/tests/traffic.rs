//! `objectcache-bench traffic` end to end on a small run (issue 19, part 7): the in-process
//! server capped at 200 MB/s under two policies, every workload (a burst, a Poisson stream,
//! the repository's trace), 8 synthetic requests. The benchmark itself fails if a load misses
//! or a loaded byte differs from the saved one; this test checks the records' structure and
//! the truths that hold whatever the timing, never timings against fixed numbers.

mod support;

use serde_json::Value;
use std::collections::HashSet;

fn f(r: &Value, path: &[&str]) -> f64 {
    let mut v = r;
    for k in path {
        v = &v[*k];
    }
    v.as_f64()
        .unwrap_or_else(|| panic!("{} is not a number in {r}", path.join(".")))
}

#[test]
fn traffic_runs_every_workload_and_policy_byte_exact_with_a_prediction() {
    let run = support::run_bench(&[
        "traffic",
        "--policies",
        "fifo,stall-aware",
        "--workloads",
        "burst,poisson,trace",
        "--requests",
        "8",
    ]);
    let (recs, svg) = (&run.records, run.svg());
    println!("{}", run.stdout);
    assert!(run.stdout.contains("m/sim"), "the table: {}", run.stdout);

    let runs: HashSet<(String, String)> = recs
        .iter()
        .map(|r| {
            (
                r["workload"].as_str().unwrap().to_string(),
                r["policy"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(recs.len(), 6, "{recs:?}");
    for w in ["burst", "poisson", "trace"] {
        for p in ["fifo", "stall-aware"] {
            assert!(runs.contains(&(w.into(), p.into())), "no {w}/{p} record");
        }
        assert!(svg.join(format!("traffic-{w}.svg")).is_file(), "{w}'s plot");
    }
    for r in recs {
        let n = r["requests"].as_u64().unwrap();
        if r["workload"] != "trace" {
            assert_eq!(n, 8, "{r}");
        }
        assert!(n > 0, "{r}");
        assert_eq!(r["cap_bytes_per_s"], 200_000_000u64, "{r}");
        assert_eq!(r["model"], "HuggingFaceTB/SmolLM2-135M-Instruct", "{r}");
        for k in ["ttfl_s", "ttll_s", "predicted_ttfl_s", "predicted_ttll_s"] {
            let (mean, p50, p99) = (f(r, &[k, "mean"]), f(r, &[k, "p50"]), f(r, &[k, "p99"]));
            assert!(mean >= 0.0 && p50 >= 0.0 && p50 <= p99, "{k} of {r}");
        }
        // Layer 0 lands before the last layer, measured and predicted.
        assert!(f(r, &["ttll_s", "mean"]) > 0.0, "{r}");
        assert!(
            f(r, &["ttfl_s", "mean"]) <= f(r, &["ttll_s", "mean"]),
            "{r}"
        );
        assert!(f(r, &["predicted_ttll_s", "mean"]) > 0.0, "{r}");
        assert!(
            f(r, &["predicted_ttfl_s", "mean"]) <= f(r, &["predicted_ttll_s", "mean"]),
            "{r}"
        );
        let ratio = f(r, &["ttll_measured_over_predicted"]);
        let want = f(r, &["ttll_s", "mean"]) / f(r, &["predicted_ttll_s", "mean"]);
        assert!((ratio - want).abs() <= 1e-9 * want, "{r}");
        // No DRAM copy between loads: every distinct chunk crosses the link at least once.
        let (moved, unique) = (f(r, &["bytes_moved"]), f(r, &["unique_bytes"]));
        assert!(unique > 0.0 && moved >= unique, "{r}");
        assert!(
            (f(r, &["bytes_moved_over_unique"]) - moved / unique).abs() < 1e-9,
            "{r}"
        );
        assert!(f(r, &["fetches_per_chunk"]) >= 1.0, "{r}");
        assert!(f(r, &["span_s"]) >= f(r, &["ttll_s", "p99"]) * 0.999, "{r}");
        assert!(r["loads_followed"].as_u64().unwrap() < n, "{r}");
    }
}
