//! Tests of the cluster simulation: workloads, gateway counts, the progress-blind shortcut,
//! stall-aware bounds and storage-bound clusters.

use super::engine::run;
use super::*;
use crate::sched::{GpuKind, KernelClass};

fn cfg(gateways: usize, placement: Placement, policy: PolicyKind) -> ClusterConfig {
    let model = ComputeModel::preset("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned).unwrap();
    let kv = model.shape().kv_bytes_per_token_per_layer;
    ClusterConfig {
        model,
        kv_bytes_per_token_per_layer: kv,
        gateways,
        gateway_bytes_per_s: 100e9 / 8.0,
        gpu_bytes_per_s: 100e9 / 8.0,
        storage_nodes: 16,
        storage_node_bytes_per_s: 100e9 / 8.0,
        placement,
        policy,
        health_interval_s: 1.0,
        tier: None,
    }
}

#[test]
fn synthetic_workloads_are_seeded_and_follow_the_rate() {
    let a = synthetic(64, 0.5, 100.0, 1000, 1.0, 7).unwrap();
    assert_eq!(a, synthetic(64, 0.5, 100.0, 1000, 1.0, 7).unwrap());
    assert_ne!(a, synthetic(64, 0.5, 100.0, 1000, 1.0, 8).unwrap());
    // 64 x 0.5 x 100 = 3200 expected arrivals; Poisson: within 5 standard deviations.
    assert!(
        (a.requests.len() as f64 - 3200.0).abs() < 5.0 * 3200f64.sqrt(),
        "{}",
        a.requests.len()
    );
    assert!(a
        .requests
        .windows(2)
        .all(|w| w[0].arrival_s <= w[1].arrival_s));
    // Zipf: document 0 is the most asked for.
    let n0 = a.requests.iter().filter(|r| r.prefix == 0).count();
    let n9 = a.requests.iter().filter(|r| r.prefix == 9).count();
    assert!(n0 > 3 * n9, "{n0} vs {n9}");
}

#[test]
fn trace_replays_on_every_gpu() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/traces/mooncake_small.jsonl"
    ))
    .unwrap();
    let w = trace(&text, 8, 0, 120.0, 1.0, 1).unwrap();
    assert!(w.requests.len() > 8 * 48, "{}", w.requests.len());
    assert!(w.requests.iter().all(|r| r.gpu < 8 && r.arrival_s < 120.0));
    // After the first pass nearly everything is cached.
    let hits = w.requests.iter().filter(|r| r.prefix_tokens > 0).count();
    assert!(hits * 10 > w.requests.len() * 8);
}

#[test]
fn more_gateways_lower_the_added_ttft_of_a_busy_cluster() {
    // 64 GPUs asking for 0.56 GB/s each on average: 36 GB/s, 72% of 4 gateways' NICs.
    let w = synthetic(64, 0.1, 60.0, 2000, 1.0, 3).unwrap();
    let few = simulate(
        &w,
        &cfg(4, Placement::LeastLoaded, PolicyKind::EqualShare),
        "h100",
    )
    .unwrap();
    let many = simulate(
        &w,
        &cfg(16, Placement::LeastLoaded, PolicyKind::EqualShare),
        "h100",
    )
    .unwrap();
    assert_eq!(few.loads, many.loads);
    assert!(
        few.mean_added_ttft_s > many.mean_added_ttft_s,
        "{} vs {}",
        few.mean_added_ttft_s,
        many.mean_added_ttft_s
    );
    assert!(few.gateway_utilisation > many.gateway_utilisation);
    // Every byte loaded was sent by some gateway.
    let kv = crate::sched::ModelShape::preset("llama-3.1-8b")
        .unwrap()
        .kv_bytes_per_token_per_layer;
    let bytes: f64 = w
        .requests
        .iter()
        .map(|r| (r.prefix_tokens * kv) as f64 * 32.0)
        .sum();
    assert!((few.bytes_per_gpu * 64.0 - bytes).abs() / bytes < 1e-6);
    assert!(
        few.gateway_utilisation > 0.5 && few.gateway_utilisation < 0.9,
        "{}",
        few.gateway_utilisation
    );
    // Deterministic.
    assert_eq!(
        few,
        simulate(
            &w,
            &cfg(4, Placement::LeastLoaded, PolicyKind::EqualShare),
            "h100"
        )
        .unwrap()
    );
}

#[test]
fn progress_blind_shortcut_matches_per_layer_events() {
    // A hot gateway (hash placement, few documents) and a storage-bound cluster, so that
    // rates change often: the shortcut must find the same layer times as the events.
    let w = synthetic(32, 0.2, 60.0, 20, 1.2, 5).unwrap();
    for policy in [PolicyKind::EqualShare, PolicyKind::Fifo] {
        for nodes in [16, 1] {
            let mut c = cfg(4, Placement::Hash, policy);
            c.storage_nodes = nodes;
            let fast = run(&w, &c, "h100", true, &|| policy.build()).unwrap();
            let slow = run(&w, &c, "h100", false, &|| policy.build()).unwrap();
            assert_eq!(fast.loads, slow.loads);
            assert!(fast.loads > 300, "{}", fast.loads);
            for (what, a, b) in [
                ("mean", fast.mean_added_ttft_s, slow.mean_added_ttft_s),
                ("p99", fast.p99_added_ttft_s, slow.p99_added_ttft_s),
                ("max", fast.max_added_ttft_s, slow.max_added_ttft_s),
                (
                    "utilisation",
                    fast.gateway_utilisation,
                    slow.gateway_utilisation,
                ),
                ("ttft", fast.mean_ttft_s, slow.mean_ttft_s),
            ] {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                    "{policy:?} {nodes} nodes {what}: {a} vs {b}"
                );
            }
            assert!(
                fast.max_added_ttft_s > 1.0,
                "the gateway is hot: {}",
                fast.max_added_ttft_s
            );
            assert!(
                fast.events * 4 < slow.events,
                "{} vs {} events",
                fast.events,
                slow.events
            );
        }
    }
}

#[test]
fn stall_aware_bounds_give_the_exhaustive_ranking() {
    // The stall-aware policy ranks lazily from remembered stall bounds; ranking every
    // load afresh at every re-plan (its definition) must give the same simulation to
    // the bit. A hot gateway (hash placement, few documents) holds tens of loads, most of
    // them stalling, and a storage-bound cluster changes the gateways' capacities.
    let w = synthetic(32, 0.2, 60.0, 20, 1.2, 5).unwrap();
    for (placement, nodes) in [
        (Placement::Hash, 16),
        (Placement::Hash, 1),
        (Placement::TwoChoice, 16),
    ] {
        let mut c = cfg(4, placement, PolicyKind::StallAware);
        c.storage_nodes = nodes;
        let fast = run(&w, &c, "h100", false, &|| PolicyKind::StallAware.build()).unwrap();
        let reference = run(&w, &c, "h100", false, &|| {
            Box::new(crate::sched::StallAware::exhaustive())
        })
        .unwrap();
        assert_eq!(fast, reference, "{placement:?}, {nodes} storage nodes");
        assert!(fast.loads > 300, "{}", fast.loads);
        if placement == Placement::Hash {
            assert!(
                fast.max_added_ttft_s > 1.0,
                "the gateway is hot: {}",
                fast.max_added_ttft_s
            );
        }
    }
}

#[test]
fn storage_bound_clusters_are_limited_by_the_nodes() {
    let w = synthetic(64, 0.1, 30.0, 2000, 1.0, 3).unwrap();
    let mut c = cfg(16, Placement::TwoChoice, PolicyKind::EqualShare);
    let wide = simulate(&w, &c, "h100").unwrap();
    // Two nodes of 100 Gb/s: 25 GB/s for a demand of 35 GB/s.
    c.storage_nodes = 2;
    let narrow = simulate(&w, &c, "h100").unwrap();
    assert!(narrow.mean_added_ttft_s > wide.mean_added_ttft_s);
    assert!(
        narrow.storage_utilisation <= 1.0 + 1e-9
            && narrow.storage_utilisation > wide.storage_utilisation
    );
}

#[test]
fn a_node_tier_serves_repeats_locally_and_cuts_remote_bytes() {
    // 64 GPUs on 8 nodes, 200 documents with Zipf popularity: repeats on a node are common.
    let w = synthetic(64, 0.1, 60.0, 200, 1.0, 5).unwrap();
    let base = cfg(8, Placement::TwoChoice, PolicyKind::EqualShare);
    let without = simulate(&w, &base, "h100").unwrap();
    let tier = NodeTier {
        nodes: 8,
        dram_bytes: 256 << 30,
        disk_bytes: 2 << 40,
        dram_bytes_per_s: 20e9,
        disk_bytes_per_s: 5e9,
        admission: TierAdmission::All,
    };
    let with = simulate(
        &w,
        &ClusterConfig {
            tier: Some(tier.clone()),
            ..base.clone()
        },
        "h100",
    )
    .unwrap();
    assert_eq!(without.loads, with.loads);
    assert_eq!((without.tier_nodes, without.tier_hit_rate), (0, 0.0));
    assert_eq!(without.tier_misses, without.loads as u64);
    assert_eq!(
        with.tier_dram_hits + with.tier_disk_hits + with.tier_misses,
        with.loads as u64
    );
    // At most the ideal (every request whose prefix its node was asked for before), and near
    // it with levels that hold everything: a repeat misses only while the first load of its
    // prefix on the node is still running.
    let mut seen = std::collections::HashSet::new();
    let loads: Vec<_> = w.requests.iter().filter(|r| r.prefix_tokens > 0).collect();
    let repeats = loads
        .iter()
        .filter(|r| !seen.insert((r.gpu % 8, r.prefix)))
        .count();
    let ideal = repeats as f64 / loads.len() as f64;
    assert!((with.tier_ideal_hit_rate - ideal).abs() < 1e-12);
    assert!(
        with.tier_hit_rate <= ideal && with.tier_hit_rate > 0.8 * ideal,
        "hit rate {} against the ideal {ideal}",
        with.tier_hit_rate
    );
    // Only the misses read the remote store: every hit's bytes are gone from it.
    assert!(
        with.remote_bytes < without.remote_bytes * (1.0 - with.tier_hit_rate * 0.5),
        "{} vs {}",
        with.remote_bytes,
        without.remote_bytes
    );
    assert!(with.mean_added_ttft_s < without.mean_added_ttft_s);
    // A tier too small for any prefix holds nothing: the run is the one without it.
    let tiny = simulate(
        &w,
        &ClusterConfig {
            tier: Some(NodeTier {
                dram_bytes: 1 << 20,
                disk_bytes: 0,
                ..tier
            }),
            ..base
        },
        "h100",
    )
    .unwrap();
    assert_eq!(tiny.tier_hit_rate, 0.0);
    assert_eq!(tiny.remote_bytes, without.remote_bytes);
    assert_eq!(tiny.mean_added_ttft_s, without.mean_added_ttft_s);
}
