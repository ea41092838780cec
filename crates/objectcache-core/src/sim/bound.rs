//! Offline lower bound on the mean added TTFT of a small burst: exact search over layer orders.
//!
//! # What is computed
//! For an instance whose requests all arrive together and load their whole prefix over one
//! link of capacity `R`, [`burst_lower_bound`] returns the minimum, over **every** way of
//! sharing the link (any rates, any preemption, any order), of the mean added TTFT.
//!
//! # Why it is exact at layer granularity, hence a valid bound
//! Layer `l` of request `i` becomes usable only when its last byte arrives. Take any feasible
//! schedule (fluid or not) and list the (request, layer) units by the time their last byte
//! arrives. Sending the units one after another at the full rate `R` in that order completes
//! unit number `j` at `(bytes of units 1..j) / R`, which is no later than in the original
//! schedule, because by then the original had delivered at least those bytes through a link of
//! rate `R`. Earlier (or equal) layer arrivals never delay layerwise compute, so this
//! sequential schedule is at least as good. Hence the optimum is attained by a sequence of
//! whole layer units, and a search over such sequences finds the optimum of all schedules.
//! Per-load rate limits and the token bucket's burst only restrict schedules further, so the
//! result is a lower bound for every policy the simulator runs with full loads.
//!
//! # How
//! Dynamic programming over the progress vector `(p_1..p_n)` (layers delivered per request):
//! with simultaneous arrivals the time at a state is `Σ bytes delivered / R`, whatever the
//! path. The remaining cost depends on the state and on each request's compute frontier
//! `F_i` (end of compute of its delivered layers), so each state keeps the Pareto set of
//! frontier vectors (smaller is better in every coordinate, and exactly those can lead to the
//! optimum). Labels whose optimistic completion already exceeds a known upper bound are pruned.
//! The state space is `Π (L_i + 1)`; [`burst_lower_bound`] refuses instances above a limit.
#![forbid(unsafe_code)]

use super::engine::SimConfig;
use super::workload::Instance;
use std::collections::HashMap;

/// Largest state space (`Π (layers + 1)` over loading requests) searched by default.
pub const DEFAULT_MAX_STATES: u64 = 100_000;

struct Req {
    layer_time: f64,
    compute: Vec<f64>,
    t0: f64,
}

/// Minimum possible mean added TTFT (s) of a burst instance with full loads (module docs), or
/// `None` when the instance is not a burst or its state space exceeds `max_states`.
/// `upper_bound_mean` (e.g. a policy's simulated mean) prunes the search; pass `f64::INFINITY`
/// if none is known. Requests with no prefix add 0 and count in the mean.
pub fn burst_lower_bound(
    inst: &Instance,
    cfg: &SimConfig,
    upper_bound_mean: f64,
    max_states: u64,
) -> Option<f64> {
    if !inst.is_burst() || inst.requests.is_empty() {
        return None;
    }
    let m = &cfg.model;
    let reqs: Vec<Req> = inst
        .requests
        .iter()
        .filter(|r| r.prefix_tokens > 0 && cfg.kv_bytes_per_token_per_layer > 0)
        .map(|r| Req {
            layer_time: (r.prefix_tokens * cfg.kv_bytes_per_token_per_layer) as f64 / cfg.capacity,
            compute: m.layer_times(r.new_tokens, r.prefix_tokens),
            t0: 0.0,
        })
        .collect();
    let total_reqs = inst.requests.len() as f64;
    if reqs.is_empty() {
        return Some(0.0);
    }
    let layers = m.layers();
    let mut states: u64 = 1;
    for _ in &reqs {
        states = states.saturating_mul(layers as u64 + 1);
    }
    if states > max_states {
        return None;
    }
    let n = reqs.len();
    let local: Vec<f64> = reqs.iter().map(|r| r.compute.iter().sum()).collect();
    // Suffix sums of compute per request, to bound labels from below.
    let suffix: Vec<Vec<f64>> = reqs
        .iter()
        .map(|r| {
            let mut s = vec![0.0; layers + 1];
            for l in (0..layers).rev() {
                s[l] = s[l + 1] + r.compute[l];
            }
            s
        })
        .collect();
    let ub_sum = if upper_bound_mean.is_finite() {
        upper_bound_mean * total_reqs * (1.0 + 1e-9) + 1e-12
    } else {
        f64::INFINITY
    };
    let encode = |p: &[usize]| {
        p.iter()
            .fold(0u64, |acc, &x| acc * (layers as u64 + 1) + x as u64)
    };
    // Level-by-level: all states of a level have the same number of delivered layers.
    let mut level: HashMap<u64, (Vec<usize>, Vec<Vec<f64>>)> = HashMap::new();
    level.insert(
        encode(&vec![0; n]),
        (vec![0; n], vec![reqs.iter().map(|r| r.t0).collect()]),
    );
    let mut best = f64::INFINITY;
    for _ in 0..(n * layers) {
        let mut nextl: HashMap<u64, (Vec<usize>, Vec<Vec<f64>>)> = HashMap::new();
        // Deterministic iteration order is not needed for the result (a minimum), but keep it.
        let mut keys: Vec<u64> = level.keys().copied().collect();
        keys.sort_unstable();
        for key in keys {
            let (p, labels) = &level[&key];
            let time: f64 = p
                .iter()
                .zip(&reqs)
                .map(|(&pi, r)| pi as f64 * r.layer_time)
                .sum();
            for j in 0..n {
                if p[j] >= layers {
                    continue;
                }
                let t_arr = time + reqs[j].layer_time;
                let mut q = p.clone();
                q[j] += 1;
                let qk = encode(&q);
                for lab in labels {
                    let mut f = lab.clone();
                    f[j] = f[j].max(t_arr) + reqs[j].compute[p[j]];
                    // Optimistic total added TTFT from this label.
                    let mut lb = 0.0;
                    for i in 0..n {
                        let start = if q[i] < layers { f[i].max(t_arr) } else { f[i] };
                        lb += start + suffix[i][q[i]] - reqs[i].t0 - local[i];
                    }
                    if lb > ub_sum {
                        continue;
                    }
                    let entry = nextl.entry(qk).or_insert_with(|| (q.clone(), Vec::new()));
                    insert_pareto(&mut entry.1, f);
                }
            }
        }
        level = nextl;
        if level.is_empty() {
            break;
        }
    }
    for (_, labels) in level.values() {
        for f in labels {
            let total: f64 = (0..n)
                .map(|i| (f[i] - reqs[i].t0 - local[i]).max(0.0))
                .sum();
            best = best.min(total);
        }
    }
    if best.is_finite() {
        Some(best / total_reqs)
    } else {
        // Everything was pruned: the upper bound is itself optimal within rounding.
        Some(upper_bound_mean)
    }
}

fn insert_pareto(set: &mut Vec<Vec<f64>>, f: Vec<f64>) {
    if set.iter().any(|g| g.iter().zip(&f).all(|(a, b)| a <= b)) {
        return;
    }
    set.retain(|g| !g.iter().zip(&f).all(|(a, b)| b <= a));
    set.push(f);
}

#[cfg(test)]
mod tests {
    use super::super::engine::{simulate_instance, SimConfig, SimPolicy, Summary};
    use super::super::workload::{burst_mix, Instance, Request};
    use super::*;
    use crate::sched::{ComputeModel, GpuKind, KernelClass, PolicyKind};

    fn cfg(cap: f64) -> SimConfig {
        SimConfig {
            model: ComputeModel::preset("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned).unwrap(),
            kv_bytes_per_token_per_layer: 4096,
            chunk_tokens: 256,
            capacity: cap,
            max_rate_per_load: f64::INFINITY,
        }
    }

    #[test]
    fn single_request_bound_is_the_pipeline_bound() {
        let c = cfg(6.25e9);
        let inst = Instance {
            requests: vec![Request {
                arrival_s: 0.0,
                prefix_tokens: 16384,
                new_tokens: 512,
            }],
        };
        let lb = burst_lower_bound(&inst, &c, f64::INFINITY, DEFAULT_MAX_STATES).unwrap();
        let compute = c.model.layer_times(512, 16384);
        let bytes = vec![16384 * 4096; 32];
        let bound = crate::sched::timeline::pipeline_ttft(&compute, &bytes, 6.25e9, 0.0)
            - compute.iter().sum::<f64>();
        assert!((lb - bound).abs() < 1e-9, "{lb} vs {bound}");
    }

    #[test]
    fn bound_is_below_every_policy_on_small_bursts() {
        for cap in [3.125e9, 9.375e9] {
            let c = cfg(cap);
            let w = burst_mix(3, 6, 11);
            for inst in &w.instances {
                let lb = burst_lower_bound(inst, &c, f64::INFINITY, DEFAULT_MAX_STATES).unwrap();
                for kind in PolicyKind::ALL {
                    let o = simulate_instance(
                        inst,
                        &c,
                        SimPolicy {
                            kind,
                            planner: false,
                        },
                    )
                    .unwrap();
                    let s = Summary::of(&o);
                    assert!(
                        lb <= s.mean_added_ttft_s + 1e-9,
                        "{kind:?}: lb {lb} > {}",
                        s.mean_added_ttft_s
                    );
                }
                // Pruning with an upper bound does not change the answer.
                let ub = Summary::of(
                    &simulate_instance(
                        inst,
                        &c,
                        SimPolicy {
                            kind: PolicyKind::StallAware,
                            planner: false,
                        },
                    )
                    .unwrap(),
                )
                .mean_added_ttft_s;
                let lb2 = burst_lower_bound(inst, &c, ub, DEFAULT_MAX_STATES).unwrap();
                assert!((lb - lb2).abs() <= 1e-9 * lb.max(1.0), "{lb} vs {lb2}");
            }
        }
    }

    #[test]
    fn refuses_non_bursts_and_large_instances() {
        let c = cfg(1e9);
        let mut inst = Instance {
            requests: vec![
                Request {
                    arrival_s: 0.0,
                    prefix_tokens: 4096,
                    new_tokens: 1
                };
                2
            ],
        };
        inst.requests[1].arrival_s = 1.0;
        assert!(burst_lower_bound(&inst, &c, f64::INFINITY, DEFAULT_MAX_STATES).is_none());
        let big = Instance {
            requests: vec![
                Request {
                    arrival_s: 0.0,
                    prefix_tokens: 4096,
                    new_tokens: 1
                };
                8
            ],
        };
        assert!(burst_lower_bound(&big, &c, f64::INFINITY, DEFAULT_MAX_STATES).is_none());
    }
}
