//! The cluster simulation itself ([`simulate`]): fluid and event-driven over the gateways'
//! link schedulers, the storage nodes' shared bandwidth and the GPUs' layer compute.

use super::tier::{Found, Tiers};
use super::{ClusterConfig, ClusterRecord, ClusterWorkload, TierAdmission};
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
    /// Requests whose load from the remote store ended since the last arrival (their
    /// prefixes go to their nodes' tiers before the next lookup).
    filled: Vec<u32>,
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
    let mut sim = ClusterSim::new(w, cfg, blind, policy)?;
    while let Some(ev) = sim.next_event()? {
        sim.events += 1;
        let before = sim.busy();
        let (t, touched) = match ev {
            Event::Gateway(t, g) => {
                sim.advance(g, t)?;
                (t, g)
            }
            Event::Health => {
                sim.on_health();
                continue;
            }
            Event::Arrival => match sim.on_arrival()? {
                Some(at) => at,
                None => continue,
            },
        };
        sim.after_event(t, touched, before)?;
    }
    Ok(sim.record(gpu_name))
}

/// Request `q`'s TTFT and added TTFT (seconds) when its `layer_bytes` per layer load alone
/// at `rate` bytes/s from its arrival: a load from a node's tier, or the floor of a load
/// through a gateway (the same load on an idle cluster).
fn alone(
    m: &crate::sched::ComputeModel,
    q: &super::ClusterRequest,
    layer_bytes: u64,
    rate: f64,
) -> (f64, f64) {
    let ready: Vec<f64> = (1..=m.layers())
        .map(|l| q.arrival_s + (l as u64 * layer_bytes) as f64 / rate)
        .collect();
    let compute = m.layer_times(q.new_tokens, q.prefix_tokens);
    let ttft = timeline::finish_time(q.arrival_s, &ready, &compute) + m.fixed_s() - q.arrival_s;
    (ttft, ttft - m.prefill_time(q.new_tokens, q.prefix_tokens))
}

/// The next thing that happens in a [`ClusterSim`].
enum Event {
    /// Gateway `g` needs attention at time `t` (a layer boundary or a scheduler deadline).
    Gateway(f64, usize),
    /// The clients' health check: their view of each gateway's load is refreshed.
    Health,
    /// The next request arrives.
    Arrival,
}

/// A cluster simulation's state: the gateways (each a link scheduler and its loads), the
/// clients' view of them, the event heap and what the run accumulates. [`run`] takes the
/// next [`Event`] and calls its handler, then [`ClusterSim::after_event`].
struct ClusterSim<'a> {
    w: &'a ClusterWorkload,
    cfg: &'a ClusterConfig,
    blind: bool,
    /// The storage cluster's bandwidth, bytes/s.
    storage: f64,
    gws: Vec<Gw>,
    /// Placement candidates, one per gateway.
    cands: Vec<Candidate>,
    /// Each gateway's loads at the last health check.
    reported: Vec<u32>,
    /// Gateway events `(time, gateway, version)`; a stale version is skipped.
    heap: BinaryHeap<Reverse<(TotalF64, u32, u64)>>,
    /// The next request (index into `w.requests`).
    next: usize,
    /// The next health check, seconds.
    tick: f64,
    events: u64,
    end_t: f64,
    acc: Acc,
    /// The nodes' tiers (`cfg.tier`).
    tiers: Option<Tiers>,
}

impl<'a> ClusterSim<'a> {
    /// Checks the configuration and the arrivals, and sets up the gateways.
    fn new(
        w: &'a ClusterWorkload,
        cfg: &'a ClusterConfig,
        blind: bool,
        policy: &dyn Fn() -> Box<dyn Policy + Send>,
    ) -> Result<Self, Error> {
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
        let nic = cfg.gateway_bytes_per_s;
        let g_n = cfg.gateways;
        let gws: Vec<Gw> = (0..g_n)
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
        let cands: Vec<Candidate> = (0..g_n)
            .map(|i| Candidate {
                seed: placement::endpoint_seed(&format!("gateway-{i}")),
                up: true,
                load: 0.0,
            })
            .collect();
        if let Some(t) = &cfg.tier {
            for (what, v) in [
                ("tier DRAM read rate", t.dram_bytes_per_s),
                ("tier disk read rate", t.disk_bytes_per_s),
            ] {
                if !(v.is_finite() && v > 0.0) {
                    return Err(Error::InvalidArgument(format!(
                        "cluster: {what} {v} must be finite and > 0"
                    )));
                }
            }
            if t.nodes == 0 {
                return Err(Error::InvalidArgument(
                    "cluster: a node tier needs at least one node".into(),
                ));
            }
        }
        if let Some(r) = w
            .requests
            .iter()
            .find(|r| !(r.arrival_s.is_finite() && r.arrival_s >= 0.0))
        {
            return Err(Error::InvalidArgument(format!(
                "cluster: arrival time {} s is not valid",
                r.arrival_s
            )));
        }
        Ok(ClusterSim {
            w,
            cfg,
            blind,
            storage: cfg.storage_node_bytes_per_s * cfg.storage_nodes as f64,
            gws,
            cands,
            reported: vec![0u32; g_n],
            heap: BinaryHeap::new(),
            next: 0,
            tick: cfg.health_interval_s,
            events: 0,
            end_t: 0.0,
            acc: Acc {
                rates: Vec::new(),
                added: Vec::new(),
                floor: Vec::new(),
                ttft_sum: 0.0,
                own: vec![Vec::new(); w.gpus.max(1)],
                filled: Vec::new(),
            },
            tiers: cfg.tier.as_ref().map(Tiers::new),
        })
    }

    /// Gateways with loads in flight.
    fn busy(&self) -> usize {
        self.gws.iter().filter(|g| !g.acts.is_empty()).count()
    }

    /// A gateway's capacity while `busy` gateways share the storage cluster.
    fn cap_for(&self, busy: usize) -> f64 {
        let nic = self.cfg.gateway_bytes_per_s;
        if busy == 0 {
            nic
        } else {
            nic.min(self.storage / busy as f64)
        }
    }

    /// The next event (the earliest of a gateway's, the health check's and the next
    /// arrival's; a gateway's first on a tie), `None` once nothing is left.
    ///
    /// # Errors
    /// When loads remain but none can progress (no bandwidth).
    fn next_event(&mut self) -> Result<Option<Event>, Error> {
        while let Some(&Reverse((_, g, v))) = self.heap.peek() {
            if self.gws[g as usize].version == v {
                break;
            }
            self.heap.pop();
        }
        let reqs = &self.w.requests;
        let te = self
            .heap
            .peek()
            .map_or(f64::INFINITY, |Reverse((t, _, _))| t.0);
        let ta = reqs.get(self.next).map_or(f64::INFINITY, |r| r.arrival_s);
        let tt = if self.next < reqs.len() {
            self.tick
        } else {
            f64::INFINITY
        };
        if !te.is_finite() && !ta.is_finite() {
            if self.gws.iter().any(|g| !g.acts.is_empty()) {
                return Err(Error::InvalidArgument(
                    "cluster: no progress possible (loads without bandwidth)".into(),
                ));
            }
            return Ok(None);
        }
        if te <= ta && te <= tt {
            let Some(Reverse((time, g, _))) = self.heap.pop() else {
                return Ok(None);
            };
            Ok(Some(Event::Gateway(time.0, g as usize)))
        } else if tt < ta {
            Ok(Some(Event::Health))
        } else {
            Ok(Some(Event::Arrival))
        }
    }

    /// The health check: the clients now see each gateway's loads in flight.
    fn on_health(&mut self) {
        for (r, gw) in self.reported.iter_mut().zip(&self.gws) {
            *r = gw.acts.len() as u32;
        }
        self.tick += self.cfg.health_interval_s;
    }

    /// The next request arrives: placed on a gateway by the clients' view (the last health
    /// check plus the GPU's own loads), and its load started there. Returns its time and
    /// gateway, or `None` for a request with nothing to load.
    fn on_arrival(&mut self) -> Result<Option<(f64, usize)>, Error> {
        let (cfg, w) = (self.cfg, self.w);
        let reqs = &w.requests;
        let m = &cfg.model;
        let bpt = cfg.kv_bytes_per_token_per_layer;
        let q = &reqs[self.next];
        let r = self.next as u32;
        self.next += 1;
        let t = q.arrival_s;
        if q.prefix_tokens == 0 || bpt == 0 {
            return Ok(None);
        }
        if self.tier_hit(self.next - 1)? {
            return Ok(None);
        }
        let gpu = q.gpu as usize % self.acc.own.len();
        for (i, c) in self.cands.iter_mut().enumerate() {
            let mine = self.acc.own[gpu]
                .iter()
                .find(|&&(x, _)| x as usize == i)
                .map_or(0, |&(_, n)| n);
            c.load = (self.reported[i] + mine) as f64;
        }
        let key = placement::route_key(&q.prefix.to_le_bytes());
        let g = placement::first(cfg.placement, key, &self.cands).expect("gateways");
        self.advance(g, t)?;
        if self.gws[g].acts.is_empty() {
            let c = self.cap_for(self.busy() + 1);
            if self.gws[g].cap != c {
                self.gws[g].sched.set_capacity(t, c)?;
                self.gws[g].cap = c;
            }
        }
        let k = q.prefix_tokens;
        let lb = k * bpt;
        let layers = m.layers();
        let spec = LoadSpec {
            layer_bytes: vec![lb; layers],
            layer_compute_s: m.layer_times(q.new_tokens, k),
            compute_ready_s: q.arrival_s,
            max_rate: cfg.gpu_bytes_per_s,
        };
        let id = self.gws[g].sched.handle_arrival(t, spec)?;
        self.gws[g].acts.push(Act {
            req: r,
            id,
            layer_bytes: lb,
            total: lb * layers as u64,
            pos: 0.0,
            reported: 0,
        });
        match self.acc.own[gpu].iter_mut().find(|(x, _)| *x as usize == g) {
            Some(e) => e.1 += 1,
            None => self.acc.own[gpu].push((g as u32, 1)),
        }
        Ok(Some((t, g)))
    }

    /// With a node tier: first the prefixes whose remote loads ended go to their nodes'
    /// tiers; then request `r` looks its prefix up on its node. On a hit it loads from there
    /// alone (at the GPU link or the level's read rate), its outcome is recorded, and this
    /// returns `true`; on a miss (or without a tier) `false`, and it loads through a gateway.
    fn tier_hit(&mut self, r: usize) -> Result<bool, Error> {
        let (cfg, w) = (self.cfg, self.w);
        let reqs = &w.requests;
        let Some(tiers) = self.tiers.as_mut() else {
            self.acc.filled.clear();
            return Ok(false);
        };
        let m = &cfg.model;
        let bpt = cfg.kv_bytes_per_token_per_layer;
        let layers = m.layers();
        for f in self.acc.filled.drain(..) {
            let q = &reqs[f as usize];
            let bytes = q.prefix_tokens * bpt * layers as u64;
            tiers.fill(q.gpu, q.prefix, bytes, q.arrival_s);
        }
        let q = &reqs[r];
        let layer_bytes = q.prefix_tokens * bpt;
        let (found, rate) = tiers.lookup(q.gpu, q.prefix, layer_bytes * layers as u64);
        let Some(rate) = rate.filter(|_| found != Found::Miss) else {
            return Ok(false);
        };
        let rate = rate.min(cfg.gpu_bytes_per_s);
        let (ttft, added) = alone(m, q, layer_bytes, rate);
        self.acc.ttft_sum += ttft;
        self.acc.added.push(added);
        // Alone is how it ran.
        self.acc.floor.push(added);
        let loaded = q.arrival_s + (layers as u64 * layer_bytes) as f64 / rate;
        self.end_t = self.end_t.max(loaded);
        Ok(true)
    }

    /// After an event at `t` on gateway `touched` (`before`: busy gateways before it): when
    /// the number of busy gateways changed and storage is the bottleneck, every busy
    /// gateway's capacity is re-set to its share; then the touched gateway's next event is
    /// queued.
    fn after_event(&mut self, t: f64, touched: usize, before: usize) -> Result<(), Error> {
        let nic = self.cfg.gateway_bytes_per_s;
        let busy = self.busy();
        if busy != before && self.storage < nic * before.max(busy) as f64 {
            let c = self.cap_for(busy);
            for i in 0..self.gws.len() {
                if self.gws[i].acts.is_empty() || self.gws[i].cap == c {
                    continue;
                }
                if i != touched {
                    self.advance(i, t)?;
                }
                self.gws[i].sched.set_capacity(t, c)?;
                self.gws[i].cap = c;
                self.queue_next(i);
            }
        }
        self.end_t = self.end_t.max(t);
        self.queue_next(touched);
        Ok(())
    }

    /// Queues gateway `g`'s next event (its version bumped, so older ones are skipped).
    fn queue_next(&mut self, g: usize) {
        self.gws[g].version += 1;
        let nt = self.next_time(g);
        if nt.is_finite() {
            let v = self.gws[g].version;
            self.heap.push(Reverse((TotalF64(nt), g as u32, v)));
        }
    }

    /// Moves gateway `g`'s loads to time `t` at their current rates, reports progress, and
    /// retires finished loads (their outcome recorded).
    fn advance(&mut self, g: usize, t: f64) -> Result<(), Error> {
        let (cfg, reqs, blind) = (self.cfg, &self.w.requests, self.blind);
        let m = &cfg.model;
        let (nic, storage, gpu_rate) = (cfg.gateway_bytes_per_s, self.storage, cfg.gpu_bytes_per_s);
        let gw = &mut self.gws[g];
        let Acc {
            rates,
            added,
            floor,
            ttft_sum,
            own,
            filled,
        } = &mut self.acc;
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
            floor.push(alone(m, q, a.layer_bytes, gpu_rate.min(nic).min(storage)).1);
            gw.sched.handle_departure(t, a.id)?;
            filled.push(a.req);
            let mine = &mut own[q.gpu as usize];
            if let Some(p) = mine.iter().position(|&(x, _)| x as usize == g) {
                mine[p].1 -= 1;
                if mine[p].1 == 0 {
                    mine.swap_remove(p);
                }
            }
        }
        Ok(())
    }

    /// When gateway `g` next needs attention (a layer boundary or a scheduler deadline).
    fn next_time(&mut self, g: usize) -> f64 {
        let blind = self.blind;
        let gw = &mut self.gws[g];
        let rates = &mut self.acc.rates;
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
    }

    /// The run's record: TTFT figures, utilisations, bytes per GPU.
    fn record(self, gpu_name: &str) -> ClusterRecord {
        let (w, cfg) = (self.w, self.cfg);
        let m = &cfg.model;
        let nic = cfg.gateway_bytes_per_s;
        let storage = self.storage;
        let g_n = cfg.gateways;
        let gws = self.gws;
        let Acc {
            added,
            mut floor,
            ttft_sum,
            ..
        } = self.acc;
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
        let span = w.duration_s.max(self.end_t).max(1e-9);
        let total_bytes: f64 = gws.iter().map(|g| g.bytes).sum();
        let utils: Vec<f64> = gws.iter().map(|g| g.bytes / (nic * span)).collect();
        let gbps = |b: f64| b * 8.0 / 1e9;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let tier = self.tiers.as_ref();
        ClusterRecord {
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
            requests: w.requests.len(),
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
            remote_bytes: total_bytes,
            tier_nodes: tier.map_or(0, |t| t.config().nodes),
            tier_dram_gib: tier.map_or(0.0, |t| gib(t.config().dram_bytes)),
            tier_disk_gib: tier.map_or(0.0, |t| gib(t.config().disk_bytes)),
            tier_admission: tier.map_or(String::new(), |t| match t.config().admission {
                TierAdmission::All => "all".into(),
                TierAdmission::Second { window_s } => format!("second:{window_s}"),
            }),
            tier_dram_hits: tier.map_or(0, |t| t.dram_hits),
            tier_disk_hits: tier.map_or(0, |t| t.disk_hits),
            tier_misses: tier.map_or(n as u64, |t| t.misses),
            tier_hit_rate: match tier {
                Some(t) if n > 0 => (t.dram_hits + t.disk_hits) as f64 / n as f64,
                _ => 0.0,
            },
            tier_ideal_hit_rate: match tier {
                Some(t) if n > 0 => {
                    let nodes = t.config().nodes.max(1) as u32;
                    let mut seen = std::collections::HashSet::new();
                    let repeats = w
                        .requests
                        .iter()
                        .filter(|q| q.prefix_tokens > 0 && cfg.kv_bytes_per_token_per_layer > 0)
                        .filter(|q| !seen.insert((q.gpu % nodes, q.prefix)))
                        .count();
                    repeats as f64 / n as f64
                }
                _ => 0.0,
            },
            events: self.events,
        }
    }
}
