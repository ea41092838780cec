//! Cluster-scale simulation: hundreds of GPUs loading cached prefixes through tens of
//! gateways in front of a storage cluster (`objectcache sim --cluster`).
//!
//! Model (every figure a parameter of [`ClusterConfig`]):
//! - **Requests** arrive for GPUs (inference engines), each with a cached prefix (a
//!   document, its route key for placement) and new tokens ([`ClusterWorkload`]: synthetic
//!   with Zipf document popularity, or a Mooncake-style trace replayed on every GPU).
//!   Compute starts on arrival; layer `l` computes once its KV is loaded and layer `l-1` is
//!   computed (as in the single-link simulator). GPU queueing is not modelled: the figures
//!   are what loading adds to TTFT.
//! - **Placement**: the GPU's client chooses a gateway with a [`Placement`] policy from the
//!   route key, the gateways' loads as their last health check reported them (every
//!   `health_interval_s`) and its own loads in flight, as the real client
//!   (`store::GatewayStore`) does.
//! - **Gateways**: each sends at most `gateway_bytes_per_s` (its NIC), shared among its loads
//!   by a link-scheduler policy (the real [`Scheduler`] and [`PolicyKind`] policies); a load
//!   also never exceeds `gpu_bytes_per_s` (the GPU host's link).
//! - **Storage**: `storage_nodes` nodes of `storage_node_bytes_per_s` each. Chunk objects are
//!   spread over every node (CRUSH places each chunk object by its hash; a prefix has tens of
//!   chunks), so every node carries its share of every load and the cluster's bandwidth is
//!   the nodes' sum. The gateways with loads share it equally (each at most its NIC): when
//!   the storage cluster is the bottleneck, a gateway's capacity is
//!   `min(NIC, nodes x node bandwidth / busy gateways)`.
//!
//! Fluid and event-driven (arrivals, layer boundaries, scheduler deadlines, health-check
//! ticks), deterministic for a seed. Pure: no I/O, no clock.
#![forbid(unsafe_code)]

use super::workload::{TraceRecord, MIX_NEW_TOKENS, MIX_PREFIXES, MOONCAKE_BLOCK_TOKENS};
use crate::error::Error;
use crate::sched::placement::{self, Candidate, Placement};
use crate::sched::{timeline, ComputeModel, LoadId, LoadSpec, Policy, PolicyKind, Scheduler};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};

/// One request of a cluster workload.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterRequest {
    /// Arrival time (s).
    pub arrival_s: f64,
    /// The GPU (inference engine) it runs on.
    pub gpu: u32,
    /// The cached prefix's identity (a document): its route key is
    /// [`placement::route_key`] of these 8 bytes.
    pub prefix: u64,
    /// Cached prefix tokens to load (0: nothing cached, no load).
    pub prefix_tokens: u64,
    /// Tokens to prefill after the prefix.
    pub new_tokens: u64,
}

/// Requests of a cluster, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterWorkload {
    /// `synthetic` or `trace`.
    pub name: String,
    /// How prefixes are chosen, in words (for the record).
    pub popularity: String,
    /// GPUs the requests run on.
    pub gpus: usize,
    /// Length of the arrival window (s).
    pub duration_s: f64,
    /// The requests, by arrival time.
    pub requests: Vec<ClusterRequest>,
}

fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Synthetic workload: Poisson arrivals at `rate_per_gpu` requests/s on each of `gpus` GPUs
/// for `duration_s` seconds. Each request asks for one of `documents` shared documents with
/// Zipf popularity of exponent `zipf_s` (document `d`, counting from 1, has weight
/// `d^-zipf_s`; 0 is uniform), whose whole prefix is cached; each document's prefix length is
/// one of [`MIX_PREFIXES`] (4K to 128K tokens, equally likely), and each request adds one of
/// [`MIX_NEW_TOKENS`] new tokens.
///
/// # Errors
/// [`Error::InvalidArgument`] for no GPU, no document, or a rate, duration or exponent that
/// is negative or not finite.
pub fn synthetic(
    gpus: usize,
    rate_per_gpu: f64,
    duration_s: f64,
    documents: usize,
    zipf_s: f64,
    seed: u64,
) -> Result<ClusterWorkload, Error> {
    if gpus == 0 || documents == 0 {
        return Err(Error::InvalidArgument(
            "cluster workload: needs at least one GPU and one document".into(),
        ));
    }
    for (what, v) in [
        ("rate", rate_per_gpu),
        ("duration", duration_s),
        ("zipf exponent", zipf_s),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "cluster workload: {what} {v} must be finite and >= 0"
            )));
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xc105_7e20 ^ ((gpus as u64) << 40));
    // Zipf CDF over documents.
    let mut cdf = Vec::with_capacity(documents);
    let mut acc = 0.0;
    for d in 1..=documents {
        acc += (d as f64).powf(-zipf_s);
        cdf.push(acc);
    }
    let doc_len: Vec<u64> = (0..documents)
        .map(|_| MIX_PREFIXES[(rng.next_u64() % MIX_PREFIXES.len() as u64) as usize])
        .collect();
    let total_rate = rate_per_gpu * gpus as f64;
    let mut requests = Vec::new();
    let mut t = 0.0;
    if total_rate > 0.0 {
        loop {
            t += -(1.0 - uniform(&mut rng)).ln() / total_rate;
            if t >= duration_s {
                break;
            }
            let x = uniform(&mut rng) * acc;
            let d = cdf.partition_point(|&c| c < x).min(documents - 1);
            requests.push(ClusterRequest {
                arrival_s: t,
                gpu: (rng.next_u64() % gpus as u64) as u32,
                prefix: d as u64,
                prefix_tokens: doc_len[d],
                new_tokens: MIX_NEW_TOKENS[(rng.next_u64() % MIX_NEW_TOKENS.len() as u64) as usize],
            });
        }
    }
    Ok(ClusterWorkload {
        name: "synthetic".into(),
        popularity: format!("zipf s={zipf_s} over {documents} documents"),
        gpus,
        duration_s,
        requests,
    })
}

/// Trace workload: every GPU replays a Mooncake-style trace (JSON lines: `timestamp` ms,
/// `input_length`, `output_length`, `hash_ids` of 512-token blocks) from its own random
/// starting point, over and over, for `duration_s` seconds, its timestamps multiplied by
/// `time_scale`. GPUs form groups of `share` (0: one group of all GPUs); each group has its
/// own copy of the trace's documents (block ids), so a small trace stands for as many
/// tenants as there are groups. A request's cached prefix is the run of its leading blocks
/// that an earlier request of its group had (the store keeps everything), capped so that one
/// token is new; its route key is its first block (in its group), so popularity within a
/// group is the trace's own.
///
/// # Errors
/// [`Error::InvalidArgument`] for a malformed or empty trace (naming the line), no GPU, or a
/// duration or time scale that is not positive and finite.
pub fn trace(
    text: &str,
    gpus: usize,
    share: usize,
    duration_s: f64,
    time_scale: f64,
    seed: u64,
) -> Result<ClusterWorkload, Error> {
    if gpus == 0
        || !(duration_s.is_finite() && duration_s > 0.0)
        || !(time_scale.is_finite() && time_scale > 0.0)
    {
        return Err(Error::InvalidArgument(format!(
            "cluster trace: needs at least one GPU, a duration ({duration_s}) and a time scale ({time_scale}) above 0"
        )));
    }
    let mut recs: Vec<TraceRecord> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRecord = serde_json::from_str(line)
            .map_err(|e| Error::InvalidArgument(format!("trace line {}: {e}", i + 1)))?;
        if r.input_length == 0 || !r.timestamp.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "trace line {}: input_length 0 or a timestamp that is not finite",
                i + 1
            )));
        }
        recs.push(r);
    }
    if recs.is_empty() {
        return Err(Error::InvalidArgument("trace has no requests".into()));
    }
    let t0 = recs
        .iter()
        .map(|r| r.timestamp)
        .fold(f64::INFINITY, f64::min);
    let offs: Vec<f64> = recs
        .iter()
        .map(|r| (r.timestamp - t0) / 1000.0 * time_scale)
        .collect();
    // One pass of the trace lasts its span plus one mean gap, so passes do not overlap.
    let span = offs.iter().copied().fold(0.0, f64::max);
    let period = span + span / recs.len() as f64 + 1e-3;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7ace);
    let mut raw: Vec<(f64, u32, usize)> = Vec::new();
    for gpu in 0..gpus as u32 {
        let start = uniform(&mut rng) * period;
        let mut pass = 0u64;
        loop {
            let base = start + pass as f64 * period - period;
            if base >= duration_s {
                break;
            }
            for (i, &o) in offs.iter().enumerate() {
                let t = base + o;
                if (0.0..duration_s).contains(&t) {
                    raw.push((t, gpu, i));
                }
            }
            pass += 1;
        }
    }
    raw.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let group = |gpu: u32| {
        if share == 0 {
            0
        } else {
            gpu as u64 / share as u64
        }
    };
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let requests = raw
        .into_iter()
        .map(|(t, gpu, i)| {
            let r = &recs[i];
            let gr = group(gpu);
            let hit = r
                .hash_ids
                .iter()
                .take_while(|h| seen.contains(&(gr, **h)))
                .count() as u64;
            seen.extend(r.hash_ids.iter().map(|&h| (gr, h)));
            let prefix = (hit * MOONCAKE_BLOCK_TOKENS).min(r.input_length - 1);
            let first = r.hash_ids.first().copied().unwrap_or(i as u64);
            ClusterRequest {
                arrival_s: t,
                gpu,
                prefix: placement::route_key(&[first.to_le_bytes(), gr.to_le_bytes()].concat()),
                prefix_tokens: prefix,
                new_tokens: r.input_length - prefix,
            }
        })
        .collect();
    let groups = if share == 0 { 1 } else { gpus.div_ceil(share) };
    Ok(ClusterWorkload {
        name: "trace".into(),
        popularity: format!(
            "trace: {} requests per pass, {groups} copies of its documents (one per {} GPUs)",
            recs.len(),
            if share == 0 { gpus } else { share.min(gpus) }
        ),
        gpus,
        duration_s,
        requests,
    })
}

/// The cluster simulated.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    /// Per-layer compute model of the GPUs.
    pub model: ComputeModel,
    /// KV bytes per token per layer.
    pub kv_bytes_per_token_per_layer: u64,
    /// Number of gateways.
    pub gateways: usize,
    /// Each gateway's send rate (its NIC), bytes/s.
    pub gateway_bytes_per_s: f64,
    /// Each GPU host's receive rate for one load, bytes/s.
    pub gpu_bytes_per_s: f64,
    /// Storage nodes.
    pub storage_nodes: usize,
    /// Each storage node's bandwidth, bytes/s.
    pub storage_node_bytes_per_s: f64,
    /// Placement policy of the clients.
    pub placement: Placement,
    /// Link-scheduler policy of the gateways.
    pub policy: PolicyKind,
    /// Seconds between the clients' health checks (how stale load figures are).
    pub health_interval_s: f64,
}

/// The results of one cluster simulation (seconds, fractions, bytes).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ClusterRecord {
    /// Workload name (`synthetic`, `trace`).
    pub workload: String,
    /// Prefix popularity, in words.
    pub popularity: String,
    /// GPUs.
    pub gpus: usize,
    /// Gateways.
    pub gateways: usize,
    /// Placement policy.
    pub placement: String,
    /// Link-scheduler policy of the gateways.
    pub policy: String,
    /// Model preset.
    pub model: String,
    /// GPU kind.
    pub gpu: String,
    /// Gateway NIC, Gb/s.
    pub gateway_gbps: f64,
    /// GPU host link per load, Gb/s.
    pub gpu_gbps: f64,
    /// Storage nodes.
    pub storage_nodes: usize,
    /// Bandwidth per storage node, Gb/s.
    pub storage_node_gbps: f64,
    /// Length of the arrival window, s.
    pub duration_s: f64,
    /// Requests.
    pub requests: usize,
    /// Requests that loaded a prefix.
    pub loads: usize,
    /// Mean TTFT over the loads.
    pub mean_ttft_s: f64,
    /// Mean added TTFT over the loads (TTFT minus TTFT with the KV already local).
    pub mean_added_ttft_s: f64,
    /// 99th percentile (nearest rank) of the added TTFT.
    pub p99_added_ttft_s: f64,
    /// Largest added TTFT.
    pub max_added_ttft_s: f64,
    /// Mean added TTFT of the same loads each alone on an idle cluster (at the GPU link or
    /// a gateway's NIC or the storage cluster, whichever is slowest): the part no number of
    /// gateways removes.
    pub mean_alone_added_ttft_s: f64,
    /// 99th percentile of the added TTFT alone.
    pub p99_alone_added_ttft_s: f64,
    /// Bytes the gateways sent over their capacity times the run (the arrival window, or
    /// until the last load ended if later), mean over gateways.
    pub gateway_utilisation: f64,
    /// The busiest gateway's utilisation.
    pub max_gateway_utilisation: f64,
    /// Bytes read over the storage cluster's bandwidth times the run.
    pub storage_utilisation: f64,
    /// Bytes loaded per GPU over the run.
    pub bytes_per_gpu: f64,
    /// Simulated events (arrivals, gateway events, health ticks).
    pub events: u64,
}

/// A float with a total order, for the event heap.
#[derive(Debug, Clone, Copy, PartialEq)]
struct T(f64);
impl Eq for T {}
impl PartialOrd for T {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for T {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// A load on a gateway (same order as the scheduler's loads: ascending id).
struct Act {
    req: u32,
    id: LoadId,
    layer_bytes: u64,
    total: u64,
    pos: f64,
    reported: u64,
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
fn run(
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
    // Per GPU: its loads in flight per gateway (a GPU has few at once).
    let mut own: Vec<Vec<(u32, u32)>> = vec![Vec::new(); w.gpus.max(1)];
    let mut heap: BinaryHeap<Reverse<(T, u32, u64)>> = BinaryHeap::new();
    let cap_for = |busy: usize| -> f64 {
        if busy == 0 {
            nic
        } else {
            nic.min(storage / busy as f64)
        }
    };
    let mut added: Vec<f64> = Vec::new();
    let mut floor: Vec<f64> = Vec::new();
    let gpu_rate = cfg.gpu_bytes_per_s;
    let mut ttft_sum = 0.0;
    let mut next = 0usize;
    let mut tick = cfg.health_interval_s;
    let mut events = 0u64;
    let mut end_t = 0.0f64;
    let mut rates: Vec<f64> = Vec::new();
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
    let advance = |gw: &mut Gw,
                   t: f64,
                   rates: &mut Vec<f64>,
                   added: &mut Vec<f64>,
                   floor: &mut Vec<f64>,
                   ttft_sum: &mut f64,
                   own: &mut Vec<Vec<(u32, u32)>>,
                   g: usize|
     -> Result<(), Error> {
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
            advance(
                &mut gws[touched],
                t,
                &mut rates,
                &mut added,
                &mut floor,
                &mut ttft_sum,
                &mut own,
                touched,
            )?;
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
            let gpu = q.gpu as usize % own.len();
            for (i, c) in cands.iter_mut().enumerate() {
                let mine = own[gpu]
                    .iter()
                    .find(|&&(x, _)| x as usize == i)
                    .map_or(0, |&(_, n)| n);
                c.load = (reported[i] + mine) as f64;
            }
            let key = placement::route_key(&q.prefix.to_le_bytes());
            let g = placement::first(cfg.placement, key, &cands).expect("gateways");
            touched = g;
            advance(
                &mut gws[g],
                t,
                &mut rates,
                &mut added,
                &mut floor,
                &mut ttft_sum,
                &mut own,
                g,
            )?;
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
            match own[gpu].iter_mut().find(|(x, _)| *x as usize == g) {
                Some(e) => e.1 += 1,
                None => own[gpu].push((g as u32, 1)),
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
                    advance(
                        gw,
                        t,
                        &mut rates,
                        &mut added,
                        &mut floor,
                        &mut ttft_sum,
                        &mut own,
                        i,
                    )?;
                }
                gw.sched.set_capacity(t, c)?;
                gw.cap = c;
                gw.version += 1;
                let nt = next_time(gw, &mut rates);
                if nt.is_finite() {
                    heap.push(Reverse((T(nt), i as u32, gw.version)));
                }
            }
        }
        end_t = end_t.max(t);
        let gw = &mut gws[touched];
        gw.version += 1;
        let nt = next_time(gw, &mut rates);
        if nt.is_finite() {
            heap.push(Reverse((T(nt), touched as u32, gw.version)));
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{GpuKind, KernelClass};

    fn cfg(gateways: usize, placement: Placement, policy: PolicyKind) -> ClusterConfig {
        let model =
            ComputeModel::preset("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned).unwrap();
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
}
