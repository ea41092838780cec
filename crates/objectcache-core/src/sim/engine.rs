//! The discrete-event engine: replays an [`Instance`] under a policy on a virtual clock.
//!
//! Model: each request computes on its own engine (GPU); the shared resource is the storage
//! link of `capacity` bytes/s (the cap). Transfers are fluid: between two events every load
//! receives its allocated rate. Events are arrivals, layer completions (a load's bytes reach a
//! layer boundary), layer deadlines ([`Scheduler::poll_timeout`]) and departures; the scheduler
//! re-plans at each. A load's layer `l` is ready when its last byte arrives; compute consumes
//! layers in order ([`timeline::finish_time`]).
//!
//! With the planner on, each arriving request is planned ([`planner::plan`]) at the fair share
//! `capacity / active loads` and, while stalled, checked against the deadline fallback
//! ([`planner::fallback`]) at `max(its rate, the fair share)`; a fallback cancels the rest of
//! the load and recomputes.
#![forbid(unsafe_code)]

use super::workload::{Instance, Request, Workload};
use crate::error::Error;
use crate::sched::planner::{self, Fallback, PlanInput, StallState};
use crate::sched::{timeline, Allocation, ComputeModel, LoadId, LoadSpec, PolicyKind, Scheduler};

/// Simulation parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Per-layer compute model.
    pub model: ComputeModel,
    /// KV bytes per token per layer (from the geometry).
    pub kv_bytes_per_token_per_layer: u64,
    /// Tokens per chunk (planner granularity).
    pub chunk_tokens: u64,
    /// Link capacity or cap shared by all loads (bytes/s).
    pub capacity: f64,
    /// Per-load rate limit (bytes/s), `f64::INFINITY` for none.
    pub max_rate_per_load: f64,
}

/// A policy as simulated: a scheduling policy, with or without the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimPolicy {
    /// Bandwidth-sharing policy.
    pub kind: PolicyKind,
    /// Plan load-vs-recompute per request and apply the deadline fallback.
    pub planner: bool,
}

impl SimPolicy {
    /// Report name: the policy's name, with `+planner` when the planner is on.
    pub fn name(&self) -> String {
        if self.planner {
            format!("{}+planner", self.kind.name())
        } else {
            self.kind.name().to_string()
        }
    }

    /// Parses a report name.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown policy.
    pub fn parse(name: &str) -> Result<Self, Error> {
        let (base, planner) = match name.strip_suffix("+planner") {
            Some(b) => (b, true),
            None => (name, false),
        };
        Ok(SimPolicy {
            kind: PolicyKind::parse(base)?,
            planner,
        })
    }

    /// The policies of the standard report: the four policies loading everything, then equal
    /// share and stall-aware with the planner.
    pub fn standard() -> Vec<SimPolicy> {
        let mut v: Vec<SimPolicy> = PolicyKind::ALL
            .iter()
            .map(|&kind| SimPolicy {
                kind,
                planner: false,
            })
            .collect();
        v.push(SimPolicy {
            kind: PolicyKind::EqualShare,
            planner: true,
        });
        v.push(SimPolicy {
            kind: PolicyKind::StallAware,
            planner: true,
        });
        v
    }
}

/// What happened to one request (seconds).
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Arrival time.
    pub arrival_s: f64,
    /// Cached prefix tokens.
    pub prefix_tokens: u64,
    /// New tokens.
    pub new_tokens: u64,
    /// Prefix tokens loaded (the rest recomputed).
    pub load_tokens: u64,
    /// TTFT.
    pub ttft_s: f64,
    /// TTFT with the whole prefix's KV already local.
    pub local_ttft_s: f64,
    /// TTFT of full recompute.
    pub recompute_ttft_s: f64,
    /// `ttft_s − local_ttft_s`.
    pub added_ttft_s: f64,
    /// True if the deadline fallback cancelled the load and recomputed.
    pub fell_back: bool,
    /// When the load's last byte arrived (= arrival if nothing was loaded).
    pub load_end_s: f64,
    /// When each layer's last byte arrived (absolute, s); empty if nothing was loaded or the
    /// load fell back.
    pub layer_ready_s: Vec<f64>,
}

struct Active {
    req: usize,
    id: LoadId,
    cum: Vec<u64>,
    pos: f64,
    reported: u64,
    compute: Vec<f64>,
    k: u64,
    n: u64,
    deadline: f64,
}

const MAX_EVENTS: u64 = 50_000_000;

/// Simulates every instance of a workload; outcomes of all requests, instance by instance.
///
/// # Errors
/// As [`simulate_instance`].
pub fn simulate(
    workload: &Workload,
    cfg: &SimConfig,
    policy: SimPolicy,
) -> Result<Vec<Outcome>, Error> {
    let mut out = Vec::with_capacity(workload.requests());
    for inst in &workload.instances {
        out.extend(simulate_instance(inst, cfg, policy)?);
    }
    Ok(out)
}

/// Simulates one instance; outcomes in the instance's request order.
///
/// # Errors
/// [`Error::InvalidArgument`] for a bad configuration (capacity not > 0, a request arriving at
/// a negative or non-finite time) or if the simulation makes no progress.
pub fn simulate_instance(
    inst: &Instance,
    cfg: &SimConfig,
    policy: SimPolicy,
) -> Result<Vec<Outcome>, Error> {
    run_instance(inst, cfg, policy, None)
}

/// Rounds of plan → what-if simulation → re-plan per starting point (planner on).
const PLAN_ROUNDS: usize = 4;

/// Slack before a load that is behind its planned completion is checked for fallback:
/// `planned end + 10% of the planned duration + 1 ms`.
fn plan_deadline(now: f64, planned_load_s: f64) -> f64 {
    now + planned_load_s * 1.1 + 1e-3
}

/// Plans a batch of arrivals against the shares the policy will actually give them; returns
/// the load tokens per request and the predicted load duration (s from now) of each.
///
/// Candidates: every request recomputing (always admissible), then two chains of rounds
/// starting from "each request planned at the fair share" and from "every prefix loaded in
/// full". Each round simulates, from now, the batch with the current plans together with the
/// loads already in flight (as requests whose prefix is their remaining bytes), reads off each
/// new load's achieved average rate and re-plans at that rate; a request predicted slower than
/// its own full recompute is set to recompute in the next round. Among the candidates in which
/// no new request is predicted slower than its recompute, the smallest predicted total TTFT
/// wins. For a burst with no later arrivals the prediction is exact.
fn plan_batch(
    batch: &[&Request],
    active: &[(u64, u64)],
    cfg: &SimConfig,
    kind: PolicyKind,
    share: f64,
) -> Result<(Vec<u64>, Vec<f64>), Error> {
    let m = &cfg.model;
    let bpt = cfg.kv_bytes_per_token_per_layer;
    let layers = m.layers() as u64;
    let plan_at = |q: &Request, rate: f64| -> Result<u64, Error> {
        Ok(planner::plan(
            m,
            &PlanInput {
                prefix_tokens: q.prefix_tokens,
                new_tokens: q.new_tokens,
                chunk_tokens: cfg.chunk_tokens,
                kv_bytes_per_token_per_layer: bpt,
                rate,
                h2d_rate: None,
            },
        )?
        .load_tokens)
    };
    let mut what_if = Instance::default();
    for q in batch {
        what_if.requests.push(Request {
            arrival_s: 0.0,
            prefix_tokens: q.prefix_tokens,
            new_tokens: q.new_tokens,
        });
    }
    for &(tokens, new) in active {
        what_if.requests.push(Request {
            arrival_s: 0.0,
            prefix_tokens: tokens,
            new_tokens: new,
        });
    }
    let recompute: Vec<f64> = batch
        .iter()
        .map(|q| m.recompute_time(q.prefix_tokens, q.new_tokens))
        .collect();
    let mut best: Option<(f64, Vec<u64>, Vec<f64>)> = None;
    let mut consider = |ks: &Vec<u64>| -> Result<Vec<Outcome>, Error> {
        let forced: Vec<u64> = ks
            .iter()
            .copied()
            .chain(active.iter().map(|a| a.0))
            .collect();
        let o = run_instance(
            &what_if,
            cfg,
            SimPolicy {
                kind,
                planner: false,
            },
            Some(&forced),
        )?;
        let total: f64 = o.iter().map(|x| x.ttft_s).sum();
        let admissible = (0..batch.len()).all(|i| o[i].ttft_s <= recompute[i] * (1.0 + 1e-9));
        if admissible && best.as_ref().is_none_or(|b| total < b.0) {
            best = Some((
                total,
                ks.clone(),
                o[..batch.len()].iter().map(|x| x.load_end_s).collect(),
            ));
        }
        Ok(o)
    };
    consider(&vec![0; batch.len()])?;
    let starts = [
        batch
            .iter()
            .map(|q| plan_at(q, share))
            .collect::<Result<Vec<u64>, _>>()?,
        batch.iter().map(|q| q.prefix_tokens).collect(),
    ];
    for start in starts {
        let mut ks = start;
        for _ in 0..PLAN_ROUNDS {
            let o = consider(&ks)?;
            let mut next = Vec::with_capacity(ks.len());
            for (i, q) in batch.iter().enumerate() {
                let x = &o[i];
                let k = if x.ttft_s > recompute[i] {
                    0
                } else if ks[i] > 0 && x.load_end_s > 0.0 {
                    plan_at(q, (ks[i] * bpt * layers) as f64 / x.load_end_s)?
                } else {
                    ks[i]
                };
                next.push(k);
            }
            if next == ks {
                break;
            }
            ks = next;
        }
    }
    let (_, ks, ends) = best.expect("all-recompute is always admissible");
    Ok((ks, ends))
}

/// Runs one instance to its end: a loop over [`InstanceSim`]'s handlers, one per event kind.
fn run_instance(
    inst: &Instance,
    cfg: &SimConfig,
    policy: SimPolicy,
    forced: Option<&[u64]>,
) -> Result<Vec<Outcome>, Error> {
    let mut sim = InstanceSim::new(inst, cfg, policy, forced)?;
    for _ in 0..MAX_EVENTS {
        sim.on_arrivals()?;
        if sim.acts.is_empty() && sim.next >= sim.order.len() {
            return Ok(sim.into_outcomes());
        }
        let alloc = sim.sched.poll_allocation(sim.t).to_vec();
        let nt = sim.next_event(&alloc)?;
        sim.on_progress(nt, &alloc)?;
        sim.on_departures(&alloc)?;
    }
    Err(Error::InvalidArgument(format!(
        "sim: more than {MAX_EVENTS} events; giving up"
    )))
}

/// One instance's simulation: its requests in arrival order, the link scheduler, the loads
/// in flight and the outcomes so far. [`run_instance`] calls its handlers in turn: arrivals
/// due now ([`Self::on_arrivals`]), the next event's time ([`Self::next_event`]), the loads'
/// progress up to it ([`Self::on_progress`]), then departures and fallbacks
/// ([`Self::on_departures`]).
struct InstanceSim<'a> {
    reqs: &'a [Request],
    cfg: &'a SimConfig,
    policy: SimPolicy,
    /// Tokens to load per request, fixed by the caller (the exact bound's search).
    forced: Option<&'a [u64]>,
    /// Request indices by arrival.
    order: Vec<usize>,
    sched: Scheduler,
    acts: Vec<Active>,
    /// The next arrival in `order`.
    next: usize,
    /// Simulated time, seconds.
    t: f64,
    out: Vec<Option<Outcome>>,
}

impl<'a> InstanceSim<'a> {
    /// Checks the instance and the capacity, and starts the scheduler at the first arrival.
    fn new(
        inst: &'a Instance,
        cfg: &'a SimConfig,
        policy: SimPolicy,
        forced: Option<&'a [u64]>,
    ) -> Result<Self, Error> {
        if !(cfg.capacity.is_finite() && cfg.capacity > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "sim: capacity {} bytes/s must be finite and > 0",
                cfg.capacity
            )));
        }
        let reqs = &inst.requests;
        if let Some(r) = reqs
            .iter()
            .find(|r| !r.arrival_s.is_finite() || r.arrival_s < 0.0)
        {
            return Err(Error::InvalidArgument(format!(
                "sim: arrival time {} s is not valid",
                r.arrival_s
            )));
        }
        let order = crate::sched::arrival_order(reqs.len(), |i| reqs[i].arrival_s);
        let t_start = order.first().map(|&i| reqs[i].arrival_s).unwrap_or(0.0);
        let sched = Scheduler::new(
            policy.kind.build(),
            cfg.capacity,
            cfg.capacity * 1e-3,
            t_start,
        )?;
        Ok(InstanceSim {
            reqs,
            cfg,
            policy,
            forced,
            order,
            sched,
            acts: Vec::new(),
            next: 0,
            t: t_start,
            out: vec![None; reqs.len()],
        })
    }

    /// Request `r`'s outcome: `load_tokens` loaded, first token after `ttft` seconds.
    fn outcome(
        &self,
        r: usize,
        load_tokens: u64,
        ttft: f64,
        fell_back: bool,
        load_end: f64,
        ready: Vec<f64>,
    ) -> Outcome {
        let (q, m) = (&self.reqs[r], &self.cfg.model);
        let local = m.prefill_time(q.new_tokens, q.prefix_tokens);
        Outcome {
            arrival_s: q.arrival_s,
            prefix_tokens: q.prefix_tokens,
            new_tokens: q.new_tokens,
            load_tokens,
            ttft_s: ttft,
            local_ttft_s: local,
            recompute_ttft_s: m.recompute_time(q.prefix_tokens, q.new_tokens),
            added_ttft_s: ttft - local,
            fell_back,
            load_end_s: load_end,
            layer_ready_s: ready,
        }
    }

    /// Arrivals due now, planned together at the fair share they will see: each loads its
    /// planned tokens (all of its prefix without the planner) or, at 0, recomputes.
    fn on_arrivals(&mut self) -> Result<(), Error> {
        let (reqs, cfg, t) = (self.reqs, self.cfg, self.t);
        let m = &cfg.model;
        let bpt = cfg.kv_bytes_per_token_per_layer;
        let first = self.next;
        while self.next < self.order.len() && reqs[self.order[self.next]].arrival_s <= t {
            self.next += 1;
        }
        if self.next == first {
            return Ok(());
        }
        let batch: Vec<usize> = self.order[first..self.next].to_vec();
        let loading = batch.iter().filter(|&&r| reqs[r].prefix_tokens > 0).count();
        let share =
            cfg.capacity.min(cfg.max_rate_per_load) / (self.acts.len() + loading).max(1) as f64;
        let mut planned_end: Vec<f64> = vec![f64::INFINITY; batch.len()];
        let ks: Vec<u64> = if let Some(f) = self.forced {
            batch
                .iter()
                .map(|&r| f[r].min(reqs[r].prefix_tokens))
                .collect()
        } else if self.policy.planner {
            let qs: Vec<&Request> = batch.iter().map(|&r| &reqs[r]).collect();
            let layers = m.layers() as u64;
            let active: Vec<(u64, u64)> = self
                .acts
                .iter()
                .map(|a| {
                    let rem = a.cum.last().copied().unwrap_or(0) - a.reported;
                    (rem.div_ceil((bpt * layers).max(1)), a.n)
                })
                .collect();
            let (mut ks, ends) = plan_batch(&qs, &active, cfg, self.policy.kind, share)?;
            ks.iter_mut()
                .zip(&qs)
                .for_each(|(k, q)| *k = (*k).min(q.prefix_tokens));
            planned_end = ends;
            ks
        } else {
            batch.iter().map(|&r| reqs[r].prefix_tokens).collect()
        };
        for ((&r, &k), &end) in batch.iter().zip(&ks).zip(&planned_end) {
            let q = &reqs[r];
            let deadline = if end.is_finite() {
                plan_deadline(t, end)
            } else {
                f64::INFINITY
            };
            if k == 0 || bpt == 0 {
                let ttft = m.prefill_time(q.prefix_tokens + q.new_tokens, 0);
                self.out[r] = Some(self.outcome(r, 0, ttft, false, q.arrival_s, Vec::new()));
                continue;
            }
            let n = q.prefix_tokens - k + q.new_tokens;
            let compute = m.layer_times(n, k);
            let layer_bytes = vec![k * bpt; m.layers()];
            let cum = (1..=m.layers() as u64).map(|l| l * k * bpt).collect();
            let spec = LoadSpec {
                layer_bytes,
                layer_compute_s: compute.clone(),
                compute_ready_s: q.arrival_s,
                max_rate: cfg.max_rate_per_load,
            };
            let id = self.sched.handle_arrival(t, spec)?;
            self.acts.push(Active {
                req: r,
                id,
                cum,
                pos: 0.0,
                reported: 0,
                compute,
                k,
                n,
                deadline,
            });
        }
        Ok(())
    }

    /// The next event's time under allocation `alloc`: an arrival, the scheduler's timeout,
    /// a planned deadline, or a load finishing its current layer.
    ///
    /// # Errors
    /// When there is none (every active load has rate 0).
    fn next_event(&self, alloc: &[Allocation]) -> Result<f64, Error> {
        let t = self.t;
        let mut nt = f64::INFINITY;
        if self.next < self.order.len() {
            nt = self.reqs[self.order[self.next]].arrival_s;
        }
        if let Some(to) = self.sched.poll_timeout(t) {
            nt = nt.min(to);
        }
        for a in &self.acts {
            if a.deadline > t {
                nt = nt.min(a.deadline);
            }
        }
        for (a, al) in self.acts.iter().zip(alloc) {
            if al.rate > 0.0 {
                let layer = a.cum.partition_point(|&c| c <= a.reported);
                if let Some(&b) = a.cum.get(layer) {
                    nt = nt.min(t + (b as f64 - a.pos).max(0.0) / al.rate);
                }
            }
        }
        if !nt.is_finite() {
            return Err(Error::InvalidArgument(
                "sim: no progress possible (every active load has rate 0)".into(),
            ));
        }
        Ok(nt)
    }

    /// Moves the clock to `nt`: each load moves its bytes at its rate in `alloc` (snapping to
    /// a layer boundary within a byte), and the scheduler hears the progress and the time.
    fn on_progress(&mut self, nt: f64, alloc: &[Allocation]) -> Result<(), Error> {
        let dt = (nt - self.t).max(0.0);
        self.t = self.t.max(nt);
        let t = self.t;
        for (a, al) in self.acts.iter_mut().zip(alloc) {
            if al.rate <= 0.0 {
                continue;
            }
            a.pos += al.rate * dt;
            let layer = a.cum.partition_point(|&c| c <= a.reported);
            if let Some(&b) = a.cum.get(layer) {
                if b as f64 - a.pos <= 1.0 + 1e-9 * b as f64 {
                    a.pos = b as f64;
                }
            }
            let total = *a.cum.last().unwrap_or(&0);
            let now_rep = (a.pos.floor() as u64).min(total);
            if now_rep > a.reported {
                self.sched.handle_progress(t, a.id, now_rep - a.reported)?;
                a.reported = now_rep;
            }
        }
        self.sched.handle_timeout(t);
        Ok(())
    }

    /// Departures (a load with every byte in) and, with the planner, fallbacks: a load past
    /// its planned deadline and stalled recomputes when that finishes sooner.
    fn on_departures(&mut self, alloc: &[Allocation]) -> Result<(), Error> {
        let (t, cfg) = (self.t, self.cfg);
        let m = &cfg.model;
        let fixed = m.fixed_s();
        let n_active = self.acts.len();
        let mut i = 0;
        while i < self.acts.len() {
            let a = &self.acts[i];
            let st = self
                .sched
                .load(a.id)
                .expect("active load is known to the scheduler");
            let q = &self.reqs[a.req];
            if st.remaining_bytes() == 0 {
                let finish = timeline::finish_time(q.arrival_s, st.layer_ready_s(), &a.compute);
                let o = self.outcome(
                    a.req,
                    a.k,
                    finish + fixed - q.arrival_s,
                    false,
                    t,
                    st.layer_ready_s().to_vec(),
                );
                let (req, id) = (a.req, a.id);
                self.out[req] = Some(o);
                self.sched.handle_departure(t, id)?;
                self.acts.remove(i);
                continue;
            }
            if self.policy.planner && t >= a.deadline && st.stalled(t) {
                let d = st.layers_delivered();
                let missing: Vec<u64> = (d..a.cum.len())
                    .map(|l| a.cum[l] - a.reported.max(if l == 0 { 0 } else { a.cum[l - 1] }))
                    .collect();
                let rate = alloc
                    .iter()
                    .find(|x| x.id == a.id)
                    .map_or(0.0, |x| x.rate)
                    .max(cfg.capacity.min(cfg.max_rate_per_load) / n_active as f64);
                let s = StallState {
                    load_tokens: a.k,
                    compute_tokens: a.n,
                    layers_delivered: d,
                    missing_layer_bytes: missing,
                    frontier_s: st.next_deadline_s(),
                    rate,
                };
                if let Fallback::Recompute { finish_s, .. } = planner::fallback(m, t, &s) {
                    let o = self.outcome(
                        a.req,
                        0,
                        finish_s + fixed - q.arrival_s,
                        true,
                        t,
                        Vec::new(),
                    );
                    let (req, id) = (a.req, a.id);
                    self.out[req] = Some(o);
                    self.sched.handle_departure(t, id)?;
                    self.acts.remove(i);
                    continue;
                }
            }
            i += 1;
        }
        Ok(())
    }

    /// Every request's outcome, in request order.
    fn into_outcomes(self) -> Vec<Outcome> {
        self.out
            .into_iter()
            .map(|o| o.expect("every request has an outcome"))
            .collect()
    }
}

/// Mean and 99th percentile of a set of outcomes (seconds).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Number of requests.
    pub requests: usize,
    /// Mean TTFT.
    pub mean_ttft_s: f64,
    /// 99th percentile TTFT (nearest rank).
    pub p99_ttft_s: f64,
    /// Mean added TTFT.
    pub mean_added_ttft_s: f64,
    /// 99th percentile added TTFT (nearest rank).
    pub p99_added_ttft_s: f64,
    /// Mean full-recompute TTFT.
    pub mean_recompute_ttft_s: f64,
    /// Largest `ttft / recompute_ttft` over the requests.
    pub max_ttft_over_recompute: f64,
    /// Fraction of cached prefix tokens that were loaded (not recomputed).
    pub loaded_fraction: f64,
    /// Requests whose load fell back to recompute.
    pub fallbacks: usize,
}

/// Nearest-rank percentile `p` (0–100) of `xs` (0 for an empty slice).
pub fn percentile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}

impl Summary {
    /// Summarises outcomes.
    pub fn of(o: &[Outcome]) -> Summary {
        let n = o.len().max(1) as f64;
        let ttft: Vec<f64> = o.iter().map(|x| x.ttft_s).collect();
        let added: Vec<f64> = o.iter().map(|x| x.added_ttft_s).collect();
        let prefix: u64 = o.iter().map(|x| x.prefix_tokens).sum();
        let loaded: u64 = o.iter().map(|x| x.load_tokens).sum();
        Summary {
            requests: o.len(),
            mean_ttft_s: ttft.iter().sum::<f64>() / n,
            p99_ttft_s: percentile(&ttft, 99.0),
            mean_added_ttft_s: added.iter().sum::<f64>() / n,
            p99_added_ttft_s: percentile(&added, 99.0),
            mean_recompute_ttft_s: o.iter().map(|x| x.recompute_ttft_s).sum::<f64>() / n,
            max_ttft_over_recompute: o
                .iter()
                .map(|x| x.ttft_s / x.recompute_ttft_s)
                .fold(0.0, f64::max),
            loaded_fraction: if prefix == 0 {
                0.0
            } else {
                loaded as f64 / prefix as f64
            },
            fallbacks: o.iter().filter(|x| x.fell_back).count(),
        }
    }
}
