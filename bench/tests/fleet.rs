//! `objectcache-bench fleet` end to end on a short run (issue 42, part 3): 2 real vLLM
//! replicas (CPU, SmolLM2-135M) under round-robin routing, a `chat` trace of 12 requests, vLLM
//! alone (`none`) against ObjectCacheConnector on a server with its node tier in front of the
//! test S3 endpoint (Ceph RGW in CI). Checks hits, outputs and the tier's counters, never
//! speed.
//!
//! Needs the venv and model of `scripts/vllm-setup.sh` (`$OBJECTCACHE_VLLM_DIR`, default
//! `target/vllm`) and the test S3 endpoint (`OBJECTCACHE_TEST_S3_*`); without them it prints
//! SKIP, or fails when `OBJECTCACHE_REQUIRE_ALL` is set.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn skip(why: &str) {
    if std::env::var_os("OBJECTCACHE_REQUIRE_ALL").is_some() {
        panic!("fleet test: {why}, but OBJECTCACHE_REQUIRE_ALL is set");
    }
    println!("SKIP fleet test: {why}");
}

fn f(r: &Value, k: &str) -> f64 {
    r[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number in {}", r["method"]))
}

#[test]
fn a_fleet_shares_a_tiered_store_with_every_output_as_vllm_alone() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let vllm = std::env::var_os("OBJECTCACHE_VLLM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/vllm"));
    if !vllm.join("venv/bin/python").is_file()
        || !vllm.join("models/smollm2-135m-hf/config.json").is_file()
    {
        return skip(&format!(
            "no vLLM venv and model under {} (scripts/vllm-setup.sh)",
            vllm.display()
        ));
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    if !matches!(
        rt.block_on(objectcache::store::S3Store::from_test_env("bench-fleet")),
        Ok(Some(_))
    ) {
        return skip("no test S3 endpoint (scripts/ceph-rgw/start.sh)");
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("fleet.json");
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_objectcache-bench"))
        .args(["fleet", "--venv"])
        .arg(&vllm)
        .args([
            "--replicas",
            "2",
            "--trace",
            "chat",
            "--requests",
            "12",
            "--methods",
            "none,objectcache-tier",
            "--routing",
            "round-robin",
            "--json",
        ])
        .arg(&json)
        .arg("--svg")
        .arg(dir.path())
        .arg("--logs")
        .arg(dir.path().join("logs"))
        .output()
        .expect("run objectcache-bench fleet");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Straight to the process's stdout, not println! (which the harness holds back when the
    // test passes): CI's log keeps the table and the run's length for its time budget.
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stdout().lock(),
            "{stdout}fleet: the benchmark ran {:.0} s",
            started.elapsed().as_secs_f64()
        );
    }
    assert!(
        out.status.success(),
        "fleet failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rep: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let recs = rep["records"].as_array().expect("records");
    assert_eq!(recs.len(), 2, "{recs:?}");
    let (none, tier) = (&recs[0], &recs[1]);
    assert_eq!(none["method"], "none");
    assert_eq!(tier["method"], "objectcache-tier");
    assert!(dir.path().join("fleet-ttft-chat.svg").is_file(), "the plot");
    for r in recs {
        assert_eq!(r["requests"], 12, "{}", r["method"]);
        assert_eq!(r["outcomes"].as_array().unwrap().len(), 12);
        // Round-robin over 2 replicas: 6 requests each.
        assert_eq!(r["per_replica"], serde_json::json!([6, 6]));
        // The trace shares a system prompt and grows sessions: an ideal cache hits.
        assert!(f(r, "ideal_hit_rate") > 0.3, "{}", r["ideal_hit_rate"]);
        assert!(f(r, "hit_rate") <= f(r, "ideal_hit_rate") + 1e-9);
        // Where the TTFT went, from vLLM's own histograms: the tokens vLLM says it computed
        // are the prompt tokens the client was not told were cached, request for request.
        let p = &r["phases"];
        let computed = p["computed_tokens"].as_f64().unwrap() * 12.0;
        let uncached = f(r, "prompt_tokens") * (1.0 - f(r, "hit_rate"));
        assert!((computed - uncached).abs() < 0.5, "{p} against {uncached}");
        assert!(p["prefill_s"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["queue_s"].as_f64().unwrap() >= 0.0, "{p}");
        let inside = p["queue_s"].as_f64().unwrap() + p["prefill_s"].as_f64().unwrap();
        assert!(p["ttft_s"].as_f64().unwrap() >= inside - 1e-3, "{p}");
    }
    // vLLM alone never loads; its hits are its replicas' own.
    assert_eq!(none["external_hit_tokens"], 0);
    assert_eq!(none["loaded_bytes"], 0);
    // Round-robin sends a session's turns to the other replica: the shared store supplies
    // what that replica never computed, and the fleet hits what an ideal cache would.
    assert!(f(tier, "external_hit_tokens") > 0.0, "no external hits");
    assert!(f(tier, "loaded_bytes") > 0.0);
    assert!(
        f(tier, "hit_rate") > f(none, "hit_rate"),
        "the store added no hits: {} against {}",
        tier["hit_rate"],
        none["hit_rate"]
    );
    assert!(
        f(tier, "hit_over_ideal") >= 0.8,
        "hit rate {} of the ideal",
        tier["hit_over_ideal"]
    );
    // Every output equals vLLM's alone, request by request.
    assert_eq!(
        tier["outputs_equal_none"], true,
        "{}",
        tier["outputs_differing"]
    );
    // The node tier served the loads; the remote store saw at most the distinct bytes.
    let t = &tier["tier"];
    assert!(t["hits"].as_u64().unwrap() > 0, "tier: {t}");
    assert!(
        f(tier, "remote_bytes") <= 1.1 * f(tier, "unique_bytes"),
        "remote {} against unique {}",
        tier["remote_bytes"],
        tier["unique_bytes"]
    );
    assert!(tier["remote_requests"].as_u64().is_some());
    // Saves write through the tier to the remote store: their PUTs took time there.
    assert!(f(tier, "remote_put_s") > 0.0, "{}", tier["remote_put_s"]);
}
