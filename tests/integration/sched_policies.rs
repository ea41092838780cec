//! Properties of the scheduling policies, the planner and the lower bound, on seeded random
//! instances run through the real scheduler and simulator.

use objectcache::sched::{ComputeModel, GpuKind, KernelClass, LoadSpec, PolicyKind, Scheduler};
use objectcache::sim::bound::{burst_lower_bound, DEFAULT_MAX_STATES};
use objectcache::sim::{simulate, simulate_instance, workload, SimConfig, SimPolicy, Summary};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn cfg(cap_fraction: f64) -> SimConfig {
    SimConfig {
        model: ComputeModel::preset("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned).unwrap(),
        kv_bytes_per_token_per_layer: 4096,
        chunk_tokens: 256,
        capacity: cap_fraction * 12.5e9,
        max_rate_per_load: f64::INFINITY,
    }
}

fn random_spec(rng: &mut ChaCha8Rng) -> LoadSpec {
    let layers = 1 + (rng.next_u64() % 40) as usize;
    LoadSpec {
        layer_bytes: (0..layers).map(|_| rng.next_u64() % 5_000_000).collect(),
        layer_compute_s: (0..layers)
            .map(|_| (rng.next_u64() % 1000) as f64 * 1e-5)
            .collect(),
        compute_ready_s: (rng.next_u64() % 100) as f64 * 1e-3,
        max_rate: if rng.next_u64().is_multiple_of(3) {
            1e8 + (rng.next_u64() % 1_000_000_000) as f64
        } else {
            f64::INFINITY
        },
    }
}

#[test]
fn every_policy_respects_the_cap_and_limits_and_wastes_nothing() {
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    for kind in PolicyKind::ALL {
        for round in 0..200 {
            let cap = 1e8 + (rng.next_u64() % 10_000_000_000) as f64;
            let mut s = Scheduler::new(kind.build(), cap, 1e6, 0.0).unwrap();
            let n = 1 + (rng.next_u64() % 20) as usize;
            for _ in 0..n {
                let id = s.handle_arrival(0.0, random_spec(&mut rng)).unwrap();
                // Deliver part of some loads.
                let rem = s.load(id).unwrap().remaining_bytes();
                if rem > 0 && rng.next_u64() % 2 == 0 {
                    s.handle_progress(0.01, id, rng.next_u64() % rem).unwrap();
                }
            }
            let now = 0.02;
            s.handle_timeout(now);
            let alloc = s.poll_allocation(now).to_vec();
            let total: f64 = alloc.iter().map(|a| a.rate).sum();
            assert!(
                total <= cap * (1.0 + 1e-9),
                "{kind:?} round {round}: {total} > {cap}"
            );
            let mut absorbable = 0.0;
            for (a, l) in alloc.iter().zip(s.loads()) {
                assert_eq!(a.id, l.id());
                assert!(a.rate >= 0.0 && a.rate <= l.spec().max_rate * (1.0 + 1e-9));
                if l.remaining_bytes() == 0 {
                    assert_eq!(a.rate, 0.0, "{kind:?}: finished load gets bandwidth");
                } else {
                    absorbable += l.spec().max_rate;
                }
            }
            let want = cap.min(absorbable);
            assert!(
                total >= want * (1.0 - 1e-9),
                "{kind:?} round {round}: link idle ({total} < {want})"
            );
        }
    }
}

#[test]
fn stall_aware_is_never_worse_than_equal_share_on_bursts_and_keeps_p99() {
    for cap in [0.25, 0.5, 0.75] {
        for c in [2usize, 4, 8, 16] {
            let w = workload::burst_mix(c, 4, 7);
            let cfg = cfg(cap);
            let sa = Summary::of(
                &simulate(
                    &w,
                    &cfg,
                    SimPolicy {
                        kind: PolicyKind::StallAware,
                        planner: false,
                    },
                )
                .unwrap(),
            );
            let eq = Summary::of(
                &simulate(
                    &w,
                    &cfg,
                    SimPolicy {
                        kind: PolicyKind::EqualShare,
                        planner: false,
                    },
                )
                .unwrap(),
            );
            println!(
                "cap {cap} c {c}: stall-aware mean added {:.3} s p99 {:.3} s; equal share {:.3} s p99 {:.3} s ({:.2}x)",
                sa.mean_added_ttft_s,
                sa.p99_added_ttft_s,
                eq.mean_added_ttft_s,
                eq.p99_added_ttft_s,
                eq.mean_added_ttft_s / sa.mean_added_ttft_s
            );
            assert!(sa.mean_added_ttft_s <= eq.mean_added_ttft_s * (1.0 + 1e-9));
            assert!(sa.p99_added_ttft_s <= eq.p99_added_ttft_s * (1.0 + 1e-6));
        }
    }
}

#[test]
fn stall_aware_is_within_10_percent_of_the_lower_bound_on_small_bursts() {
    let mut worst_gap = 0.0f64;
    for cap in [0.25, 0.5, 0.75] {
        let cfg = cfg(cap);
        for c in [2usize, 3] {
            let w = workload::burst_mix(c, 8, 99);
            for inst in &w.instances {
                let sa = Summary::of(
                    &simulate_instance(
                        inst,
                        &cfg,
                        SimPolicy {
                            kind: PolicyKind::StallAware,
                            planner: false,
                        },
                    )
                    .unwrap(),
                );
                let lb = burst_lower_bound(inst, &cfg, f64::INFINITY, DEFAULT_MAX_STATES).unwrap();
                assert!(
                    lb <= sa.mean_added_ttft_s + 1e-9,
                    "bound above a feasible schedule"
                );
                let gap = sa.mean_added_ttft_s / lb.max(1e-12) - 1.0;
                worst_gap = worst_gap.max(gap);
                assert!(
                    sa.mean_added_ttft_s <= 1.10 * lb + 1e-6,
                    "cap {cap} c {c}: {} vs bound {lb}",
                    sa.mean_added_ttft_s
                );
            }
        }
    }
    println!(
        "worst stall-aware gap to the exact lower bound on small bursts: {:.2}%",
        worst_gap * 100.0
    );
}

#[test]
fn planner_never_above_recompute_on_bursts() {
    for cap in [0.25, 0.75] {
        for c in [2usize, 8, 32] {
            let w = workload::burst_mix(c, 2, 5);
            let cfg = cfg(cap);
            for kind in [PolicyKind::StallAware, PolicyKind::EqualShare] {
                let o = simulate(
                    &w,
                    &cfg,
                    SimPolicy {
                        kind,
                        planner: true,
                    },
                )
                .unwrap();
                for x in &o {
                    assert!(
                        x.ttft_s <= x.recompute_ttft_s * (1.0 + 1e-9),
                        "{kind:?} cap {cap} c {c}: {x:?}"
                    );
                    assert!(x.ttft_s >= x.local_ttft_s - 1e-9);
                }
            }
        }
    }
}

#[test]
fn unit_mode_follows_the_cap() {
    // A server loop: ask for units whenever allowed; bytes handed out by time t never exceed
    // cap * t + burst.
    let cap = 1e9;
    let burst = 4e6;
    let mut s = Scheduler::new(PolicyKind::StallAware.build(), cap, burst, 0.0).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for _ in 0..8 {
        s.handle_arrival(0.0, random_spec(&mut rng)).unwrap();
    }
    let mut now = 0.0;
    let mut sent = 0u64;
    for _ in 0..20_000 {
        match s.poll_next_unit(now, 1 << 20) {
            Some(u) => {
                sent += u.bytes;
                assert!(
                    sent as f64 <= cap * now + burst + (1u64 << 20) as f64,
                    "{sent} bytes by {now}"
                );
                s.handle_progress(now, u.id, u.bytes).unwrap();
                if s.load(u.id).unwrap().remaining_bytes() == 0 {
                    s.handle_departure(now, u.id).unwrap();
                }
            }
            None => match s.poll_timeout(now) {
                Some(t) => now = t.max(now + 1e-9),
                None => break,
            },
        }
    }
    assert!(s.loads().is_empty(), "all loads delivered");
}
