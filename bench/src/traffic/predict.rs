//! The simulator's prediction for a workload's arrivals under one policy and cap, with the
//! engine's rule for which loads share a fetch applied to the simulated progress.

use super::workload::Req;
use objectcache::sched::{ComputeModel, GpuKind, KernelClass, PolicyKind};
use objectcache::sim::{simulate_instance, Instance, Request, SimConfig, SimPolicy};
use objectcache::KvGeometry;
use std::collections::HashMap;

/// The simulator's prediction for `reqs` (arrival order) under `kind` at `cap`: per request
/// (TTFL, TTLL) in seconds after its arrival. Loads share fetches by the engine's rule
/// (`connector/flight.rs`): a load follows a fetching load in flight whose chunks begin with
/// its own and which has at most twice its bytes still to come; followers land each layer
/// when their leader does. Which loads fetch depends on the simulated progress, so the
/// prediction iterates (simulate the fetching loads, re-decide who follows) until the set of
/// fetching loads is stable.
pub(super) fn predict(
    reqs: &[Req],
    g: &KvGeometry,
    kind: PolicyKind,
    cap: f64,
) -> anyhow::Result<Vec<(f64, f64)>> {
    let model = ComputeModel::preset(&g.model, GpuKind::H100, KernelClass::Tuned)
        .or_else(|_| ComputeModel::preset("smollm2-135m", GpuKind::H100, KernelClass::Tuned))?;
    let cfg = SimConfig {
        model,
        kv_bytes_per_token_per_layer: g.bytes_per_token_per_layer(),
        chunk_tokens: g.tokens_per_chunk as u64,
        capacity: cap,
        max_rate_per_load: f64::INFINITY,
    };
    let layers = g.layers as usize;
    let bytes = |r: &Req| r.hashes.len() as u64 * g.slice_bytes() * layers as u64;
    // Start with every load fetching.
    let mut leader: Vec<Option<usize>> = vec![None; reqs.len()];
    let mut sim_out: HashMap<usize, (Vec<f64>, f64)> = HashMap::new();
    for _round in 0..20 {
        let fetching: Vec<usize> = (0..reqs.len()).filter(|&i| leader[i].is_none()).collect();
        let inst = Instance {
            requests: fetching
                .iter()
                .map(|&i| Request {
                    arrival_s: reqs[i].arrival_s,
                    prefix_tokens: reqs[i].hashes.len() as u64 * g.tokens_per_chunk as u64,
                    new_tokens: 0,
                })
                .collect(),
        };
        let out = simulate_instance(
            &inst,
            &cfg,
            SimPolicy {
                kind,
                planner: false,
            },
        )?;
        sim_out = fetching
            .iter()
            .zip(out)
            .map(|(&i, o)| (i, (o.layer_ready_s, o.load_end_s)))
            .collect();
        // Re-decide, in arrival order, with the simulated progress.
        let order = objectcache::sched::arrival_order(reqs.len(), |i| reqs[i].arrival_s);
        let mut next: Vec<Option<usize>> = vec![None; reqs.len()];
        let mut leaders: Vec<usize> = Vec::new();
        for &i in &order {
            let t = reqs[i].arrival_s;
            let n = reqs[i].hashes.len();
            let pick = leaders
                .iter()
                .copied()
                .filter(|&j| reqs[j].hashes.len() >= n && reqs[j].hashes[..n] == reqs[i].hashes[..])
                .filter_map(|j| {
                    let (ready, end) = sim_out.get(&j)?;
                    if t >= *end {
                        return None;
                    }
                    // Bytes still to come at t, from the layer landing times.
                    let per_layer = bytes(&reqs[j]) as f64 / layers as f64;
                    let mut done = 0.0;
                    let mut prev = reqs[j].arrival_s;
                    for &r in ready {
                        if t >= r {
                            done += per_layer;
                        } else {
                            if r > prev && t > prev {
                                done += per_layer * (t - prev) / (r - prev);
                            }
                            break;
                        }
                        prev = r;
                    }
                    let left = bytes(&reqs[j]) as f64 - done;
                    (left <= 2.0 * bytes(&reqs[i]) as f64).then_some(j)
                })
                .min_by_key(|&j| reqs[j].hashes.len());
            match pick {
                Some(j) => next[i] = Some(j),
                None => leaders.push(i),
            }
        }
        if next == leader {
            break;
        }
        leader = next;
    }
    Ok((0..reqs.len())
        .map(|i| {
            let a = reqs[i].arrival_s;
            let src = leader[i].unwrap_or(i);
            match sim_out.get(&src) {
                Some((ready, end)) => {
                    let first = ready.first().copied().unwrap_or(*end);
                    ((first.max(a) - a).max(0.0), (end.max(a) - a).max(0.0))
                }
                None => (0.0, 0.0),
            }
        })
        .collect())
}
