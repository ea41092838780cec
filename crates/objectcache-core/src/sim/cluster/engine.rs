//! The cluster simulation itself ([`simulate`]): fluid and event-driven over the gateways'
//! link schedulers, the storage nodes' shared bandwidth and the GPUs' layer compute.

use super::{ClusterConfig, ClusterRecord, ClusterWorkload};
use crate::error::Error;
use crate::sched::placement::{self, Candidate};
use crate::sched::{timeline, LoadId, LoadSpec, Policy, Scheduler, TotalF64};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A load on a gateway (same order as the scheduler's loads: ascending id).
struct Act {
    req: u32,
    id: LoadId,
    layer_bytes: u64,
    total: u64,
    pos: f64,
    reported: u64,
}

/// What the run accumulates across gateways: the rates scratch buffer, each finished load's
/// added TTFT and its floor (the same load alone on an idle cluster), the sum of TTFTs, and
/// per GPU its loads in flight per gateway (a GPU has few at once).
struct Acc {
    rates: Vec<f64>,
    added: Vec<f64>,
    floor: Vec<f64>,
    ttft_sum: f64,
    own: Vec<Vec<(u32, u32)>>,
}

struct Gw {
    sched: Scheduler,
    /// Time the loads' positions are at.
    t: f64,
    acts: Vec<Act>,
    version: u64,
    bytes: f64,
    cap: f64,
}

/// Simulates `w` on the cluster `cfg`.
///
/// # Errors
/// [`Error::InvalidArgument`] for a configuration without gateways or storage, a rate that
/// is not positive and finite, or a simulation that cannot progress.
pub fn simulate(
    w: &ClusterWorkload,
    cfg: &ClusterConfig,
    gpu_name: &str,
) -> Result<ClusterRecord, Error> {
    run(w, cfg, gpu_name, cfg.policy.progress_blind(), &|| {
        cfg.policy.build()
    })
}

/// [`simulate`], with `blind` choosing how layer boundaries are found: `false`, a gateway
/// event at every layer boundary and scheduler deadline (the policy re-plans at each);
/// `true`, for a [`PolicyKind::progress_blind`] policy, events only at arrivals, departures
/// and capacity changes, each layer's arrival time computed from the constant rates in
/// between. A gateway holding `n` loads costs `O(n)` per event either way, so on a hot
/// gateway the per-boundary events cost `O(n^2 x layers)` over its loads and the shortcut
/// `O(n^2)`. `policy` builds each gateway's instance of `cfg.policy` (the tests pass the
/// reference form of a policy, e.g.
/// [`StallAware::exhaustive`](crate::sched::StallAware::exhaustive)).
///
/// [`PolicyKind::progress_blind`]: crate::sched::PolicyKind::progress_blind
pub(super) fn run(
    w: &ClusterWorkload,
    cfg: &ClusterConfig,
    gpu_name: &str,
    blind: bool,
    policy: &dyn Fn() -> Box<dyn Policy + Send>,
) -> Result<ClusterRecord, Error> {
    if cfg.gateways == 0 || cfg.storage_nodes == 0 {
        return Err(Error::InvalidArgument(
            "cluster: needs gateways and storage nodes".into(),
        ));
    }
    for (what, v) in [
        ("gateway bandwidth", cfg.gateway_bytes_per_s),
        ("GPU link", cfg.gpu_bytes_per_s),
        ("storage node bandwidth", cfg.storage_node_bytes_per_s),
        ("health interval", cfg.health_interval_s),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "cluster: {what} {v} must be finite and > 0"
            )));
        }
    }
    let m = &cfg.model;
    let layers = m.layers();
    let bpt = cfg.kv_bytes_per_token_per_layer;
    let storage = cfg.storage_node_bytes_per_s * cfg.storage_nodes as f64;
    let nic = cfg.gateway_bytes_per_s;
    let g_n = cfg.gateways;
    let mut gws: Vec<Gw> = (0..g_n)
        .map(|_| -> Result<Gw, Error> {
            Ok(Gw {
                sched: Scheduler::new(policy(), nic, nic * 1e-3, 0.0)?,
                t: 0.0,
                acts: Vec::new(),
                version: 0,
                bytes: 0.0,
                cap: nic,
            })
        })
        .collect::<Result<_, _>>()?;
    let mut cands: Vec<Candidate> = (0..g_n)
        .map(|i| Candidate {
            seed: placement::endpoint_seed(&format!("gateway-{i}")),
            up: true,
            load: 0.0,
        })
        .collect();
    let mut reported = vec![0u32; g_n];
    let mut heap: BinaryHeap<Reverse<(TotalF64, u32, u64)>> = BinaryHeap::new();
    let cap_for = |busy: usize| -> f64 {
        if busy == 0 {
            nic
        } else {
            nic.min(storage / busy as f64)
        }
    };
    let gpu_rate = cfg.gpu_bytes_per_s;
    let mut next = 0usize;
    let mut tick = cfg.health_interval_s;
    let mut events = 0u64;
    let mut end_t = 0.0f64;
    let mut acc = Acc {
        rates: Vec::new(),
        added: Vec::new(),
        floor: Vec::new(),
        ttft_sum: 0.0,
        own: vec![Vec::new(); w.gpus.max(1)],
    };
    let reqs = &w.requests;
    if let Some(r) = reqs
        .iter()
        .find(|r| !(r.arrival_s.is_finite() && r.arrival_s >= 0.0))
    {
        return Err(Error::InvalidArgument(format!(
            "cluster: arrival time {} s is not valid",
            r.arrival_s
        )));
    }

    // Moves gateway `g`'s loads to time `t` at their current rates, reports progress, and
    // retires finished loads (their outcome recorded).
    let advance = |gw: &mut Gw, t: f64, acc: &mut Acc, g: usize| -> Result<(), Error> {
        let Acc {
            rates,
            added,
            floor,
            ttft_sum,
            own,
        } = acc;
        let dt = (t - gw.t).max(0.0);
        rates.clear();
        rates.extend(gw.sched.poll_allocation(gw.t).iter().map(|a| a.rate));
        for (a, &rate) in gw.acts.iter_mut().zip(rates.iter()) {
            if rate <= 0.0 {
                continue;
            }
            let start = a.pos;
            a.pos += rate * dt;
            if blind {
                // Every boundary within rounding of the new position was crossed.
                let reach = a.pos + 1.0 + 1e-9 * a.pos;
                let b = ((reach as u64 / a.layer_bytes) * a.layer_bytes).min(a.total);
                a.pos = a.pos.max(b as f64);
            } else {
                let next_b = ((a.reported / a.layer_bytes) + 1) * a.layer_bytes;
                let b = next_b.min(a.total) as f64;
                if b - a.pos <= 1.0 + 1e-9 * b {
                    a.pos = a.pos.max(b);
                }
            }
            let now_rep = (a.pos.floor() as u64).min(a.total);
            // Each layer boundary crossed is reported at the time the constant rate reached it
            // (with per-boundary events that is `t` itself), so its layer's ready time is exact.
            while now_rep > a.reported {
                let next_b = (((a.reported / a.layer_bytes) + 1) * a.layer_bytes).min(a.total);
                let upto = next_b.min(now_rep);
                let at = if upto == next_b {
                    (gw.t + (next_b as f64 - start) / rate).clamp(gw.t, t)
                } else {
                    t
                };
                gw.sched.handle_progress(at, a.id, upto - a.reported)?;
                gw.bytes += (upto - a.reported) as f64;
                a.reported = upto;
            }
        }
        gw.t = t;
        gw.sched.handle_timeout(t);
        let mut i = 0;
        while i < gw.acts.len() {
            if gw.acts[i].reported < gw.acts[i].total {
                i += 1;
                continue;
            }
            let a = gw.acts.remove(i);
            let q = &reqs[a.req as usize];
            let st = gw
                .sched
                .load(a.id)
                .expect("active load is known to its scheduler");
            let k = q.prefix_tokens;
            let compute = m.layer_times(q.new_tokens, k);
            let finish = timeline::finish_time(q.arrival_s, st.layer_ready_s(), &compute);
            let ttft = finish + m.fixed_s() - q.arrival_s;
            *ttft_sum += ttft;
            let local = m.prefill_time(q.new_tokens, k);
            added.push(ttft - local);
            // The same load alone on an idle cluster: at the GPU link (or a gateway's NIC).
            let alone_rate = gpu_rate.min(nic).min(storage);
            let alone: Vec<f64> = (1..=layers)
                .map(|l| q.arrival_s + (l as u64 * a.layer_bytes) as f64 / alone_rate)
                .collect();
            let alone_finish = timeline::finish_time(q.arrival_s, &alone, &compute);
            floor.push(alone_finish + m.fixed_s() - q.arrival_s - local);
            gw.sched.handle_departure(t, a.id)?;
            let mine = &mut own[q.gpu as usize];
            if let Some(p) = mine.iter().position(|&(x, _)| x as usize == g) {
                mine[p].1 -= 1;
                if mine[p].1 == 0 {
                    mine.swap_remove(p);
                }
            }
        }
        Ok(())
    };

    // When gateway `g` next needs attention (a layer boundary or a scheduler deadline).
    let next_time = |gw: &mut Gw, rates: &mut Vec<f64>| -> f64 {
        let t = gw.t;
        rates.clear();
        rates.extend(gw.sched.poll_allocation(t).iter().map(|a| a.rate));
        let mut nt = f64::INFINITY;
        for (a, &rate) in gw.acts.iter().zip(rates.iter()) {
            if rate > 0.0 {
                let b = if blind {
                    a.total
                } else {
                    (((a.reported / a.layer_bytes) + 1) * a.layer_bytes).min(a.total)
                };
                nt = nt.min(t + (b as f64 - a.pos).max(0.0) / rate);
            }
        }
        // A progress-blind policy's deadlines change no rate (and the simulation never
        // holds units back on the token bucket).
        if !blind {
            if let Some(to) = gw.sched.poll_timeout(t) {
                nt = nt.min(to);
            }
        }
        nt
    };

    loop {
        while let Some(&Reverse((_, g, v))) = heap.peek() {
            if gws[g as usize].version == v {
                break;
            }
            heap.pop();
        }
        let te = heap.peek().map_or(f64::INFINITY, |Reverse((t, _, _))| t.0);
        let ta = reqs.get(next).map_or(f64::INFINITY, |r| r.arrival_s);
        let tt = if next < reqs.len() {
            tick
        } else {
            f64::INFINITY
        };
        if !te.is_finite() && !ta.is_finite() {
            if gws.iter().any(|g| !g.acts.is_empty()) {
                return Err(Error::InvalidArgument(
                    "cluster: no progress possible (loads without bandwidth)".into(),
                ));
            }
            break;
        }
        events += 1;
        let before = gws.iter().filter(|g| !g.acts.is_empty()).count();
        let t;
        let touched: usize;
        if te <= ta && te <= tt {
            let Some(Reverse((time, g, _))) = heap.pop() else {
                break;
            };
            t = time.0;
            touched = g as usize;
            advance(&mut gws[touched], t, &mut acc, touched)?;
        } else if tt < ta {
            for (r, gw) in reported.iter_mut().zip(&gws) {
                *r = gw.acts.len() as u32;
            }
            tick += cfg.health_interval_s;
            continue;
        } else {
            let q = &reqs[next];
            let r = next as u32;
            next += 1;
            t = q.arrival_s;
            if q.prefix_tokens == 0 || bpt == 0 {
                continue;
            }
            let gpu = q.gpu as usize % acc.own.len();
            for (i, c) in cands.iter_mut().enumerate() {
                let mine = acc.own[gpu]
                    .iter()
                    .find(|&&(x, _)| x as usize == i)
                    .map_or(0, |&(_, n)| n);
                c.load = (reported[i] + mine) as f64;
            }
            let key = placement::route_key(&q.prefix.to_le_bytes());
            let g = placement::first(cfg.placement, key, &cands).expect("gateways");
            touched = g;
            advance(&mut gws[g], t, &mut acc, g)?;
            if gws[g].acts.is_empty() {
                let c = cap_for(gws.iter().filter(|g| !g.acts.is_empty()).count() + 1);
                if gws[g].cap != c {
                    gws[g].sched.set_capacity(t, c)?;
                    gws[g].cap = c;
                }
            }
            let k = q.prefix_tokens;
            let lb = k * bpt;
            let spec = LoadSpec {
                layer_bytes: vec![lb; layers],
                layer_compute_s: m.layer_times(q.new_tokens, k),
                compute_ready_s: q.arrival_s,
                max_rate: cfg.gpu_bytes_per_s,
            };
            let id = gws[g].sched.handle_arrival(t, spec)?;
            gws[g].acts.push(Act {
                req: r,
                id,
                layer_bytes: lb,
                total: lb * layers as u64,
                pos: 0.0,
                reported: 0,
            });
            match acc.own[gpu].iter_mut().find(|(x, _)| *x as usize == g) {
                Some(e) => e.1 += 1,
                None => acc.own[gpu].push((g as u32, 1)),
            }
        }
        // The storage cluster's share per busy gateway changed: re-cap every busy gateway.
        let busy = gws.iter().filter(|g| !g.acts.is_empty()).count();
        if busy != before && storage < nic * before.max(busy) as f64 {
            let c = cap_for(busy);
            for (i, gw) in gws.iter_mut().enumerate() {
                if gw.acts.is_empty() || gw.cap == c {
                    continue;
                }
                if i != touched {
                    advance(gw, t, &mut acc, i)?;
                }
                gw.sched.set_capacity(t, c)?;
                gw.cap = c;
                gw.version += 1;
                let nt = next_time(gw, &mut acc.rates);
                if nt.is_finite() {
                    heap.push(Reverse((TotalF64(nt), i as u32, gw.version)));
                }
            }
        }
        end_t = end_t.max(t);
        let gw = &mut gws[touched];
        gw.version += 1;
        let nt = next_time(gw, &mut acc.rates);
        if nt.is_finite() {
            heap.push(Reverse((TotalF64(nt), touched as u32, gw.version)));
        }
    }

    let Acc {
        added,
        mut floor,
        ttft_sum,
        ..
    } = acc;
    let n = added.len();
    let mut sorted = added.clone();
    sorted.sort_by(f64::total_cmp);
    let pct = |v: &[f64], p: f64| -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
    };
    floor.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    // Utilisation over the arrival window, or until the last load ended if later.
    let span = w.duration_s.max(end_t).max(1e-9);
    let total_bytes: f64 = gws.iter().map(|g| g.bytes).sum();
    let utils: Vec<f64> = gws.iter().map(|g| g.bytes / (nic * span)).collect();
    let gbps = |b: f64| b * 8.0 / 1e9;
    Ok(ClusterRecord {
        workload: w.name.clone(),
        popularity: w.popularity.clone(),
        gpus: w.gpus,
        gateways: g_n,
        placement: cfg.placement.name().into(),
        policy: cfg.policy.name().into(),
        model: m.shape().name.clone(),
        gpu: gpu_name.into(),
        gateway_gbps: gbps(nic),
        gpu_gbps: gbps(cfg.gpu_bytes_per_s),
        storage_nodes: cfg.storage_nodes,
        storage_node_gbps: gbps(cfg.storage_node_bytes_per_s),
        duration_s: w.duration_s,
        requests: reqs.len(),
        loads: n,
        mean_ttft_s: if n > 0 { ttft_sum / n as f64 } else { 0.0 },
        mean_added_ttft_s: mean(&added),
        p99_added_ttft_s: pct(&sorted, 0.99),
        mean_alone_added_ttft_s: mean(&floor),
        p99_alone_added_ttft_s: pct(&floor, 0.99),
        max_added_ttft_s: sorted.last().copied().unwrap_or(0.0),
        gateway_utilisation: utils.iter().sum::<f64>() / g_n as f64,
        max_gateway_utilisation: utils.iter().copied().fold(0.0, f64::max),
        storage_utilisation: total_bytes / (storage * span),
        bytes_per_gpu: total_bytes / w.gpus.max(1) as f64,
        events,
    })
}
