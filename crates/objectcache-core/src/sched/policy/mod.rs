//! Bandwidth-sharing policies behind one trait.
//!
//! A [`Policy`] turns the state of the active loads into rates (bytes/s). The
//! [`Scheduler`](super::Scheduler) calls it at every re-plan (arrival, departure, layer
//! completion, deadline timeout) and enforces the contract (rates ≥ 0, each ≤ the load's
//! `max_rate`, sum ≤ capacity, 0 for finished loads) whatever the policy returns.
//!
//! Policies:
//! - [`Fifo`]: the earliest arrival gets all it can take, then the next.
//! - [`EqualShare`]: max-min fair (water-filling with per-load limits).
//! - [`ByteProportional`]: rates proportional to the bytes each load has left (water-filled).
//! - [`StallAware`]: ours, described on the type.
#![forbid(unsafe_code)]

use super::load::LoadState;
use super::TotalF64;
use crate::error::Error;

/// A bandwidth-sharing policy.
///
/// `allocate` receives the active loads (ascending id) and a zeroed `rates` slice of the same
/// length, and writes each load's rate in bytes/s. It must be deterministic (same inputs, same
/// output) and must not read a clock: `now` is the caller's time in seconds.
pub trait Policy: std::fmt::Debug {
    /// Short name used in reports (`fifo`, `equal-share`, `byte-proportional`, `stall-aware`).
    fn name(&self) -> &'static str;
    /// Writes the rates (bytes/s) of `loads` at `now` for a link of `capacity` bytes/s.
    fn allocate(&mut self, now: f64, capacity: f64, loads: &[LoadState], rates: &mut [f64]);
}

/// The built-in policies, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// [`Fifo`].
    Fifo,
    /// [`EqualShare`].
    EqualShare,
    /// [`ByteProportional`].
    ByteProportional,
    /// [`StallAware`].
    StallAware,
}

impl PolicyKind {
    /// All built-in policies in report order.
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Fifo,
        PolicyKind::EqualShare,
        PolicyKind::ByteProportional,
        PolicyKind::StallAware,
    ];

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Fifo => "fifo",
            PolicyKind::EqualShare => "equal-share",
            PolicyKind::ByteProportional => "byte-proportional",
            PolicyKind::StallAware => "stall-aware",
        }
    }

    /// Parses a policy name (as [`PolicyKind::name`] prints it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the unknown policy and the known ones.
    pub fn parse(name: &str) -> Result<Self, Error> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == name.to_ascii_lowercase())
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|p| p.name()).collect();
                Error::InvalidArgument(format!(
                    "unknown policy {name:?}: known policies are {}",
                    known.join(", ")
                ))
            })
    }

    /// True when the policy's rates depend only on which loads have bytes left, their
    /// arrival order and their rate limits, never on layer progress, deadlines or bytes left
    /// (`fifo`, `equal-share`). Re-planning such a policy at a layer boundary or a deadline
    /// gives the rates it already had, so a fluid simulation may re-plan on arrivals,
    /// departures and capacity changes only, and take each layer's arrival time from the
    /// constant rates in between (`sim::cluster` does; its test
    /// `progress_blind_shortcut_matches_per_layer_events` compares the two).
    pub fn progress_blind(self) -> bool {
        matches!(self, PolicyKind::Fifo | PolicyKind::EqualShare)
    }

    /// A fresh boxed instance for [`Scheduler::new`](super::Scheduler::new).
    pub fn build(self) -> Box<dyn Policy + Send> {
        match self {
            PolicyKind::Fifo => Box::new(Fifo),
            PolicyKind::EqualShare => Box::new(EqualShare),
            PolicyKind::ByteProportional => Box::new(ByteProportional),
            PolicyKind::StallAware => Box::new(StallAware::default()),
        }
    }
}

/// A `scheduler` setting, of a server or an engine alike: the order in which waiting loads are
/// admitted, and how a capped link's bandwidth is shared among the loads on it.
///
/// | name | admission | bandwidth policy |
/// |---|---|---|
/// | `fifo` | arrival order | [`Fifo`] |
/// | `priority` | highest priority first | [`Fifo`] |
/// | `equal` or `equal-share` | arrival order | [`EqualShare`] |
/// | `byte-prop` or `byte-proportional` | arrival order | [`ByteProportional`] |
/// | `stall-aware` | arrival order | [`StallAware`] |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerSetting {
    /// Waiting loads are admitted highest priority first (`priority`), else in arrival order.
    pub priority_admission: bool,
    /// How a capped link's bandwidth is shared.
    pub policy: PolicyKind,
}

impl SchedulerSetting {
    /// The accepted names, as error messages list them.
    pub const NAMES: &'static str = "fifo, priority, equal, byte-prop or stall-aware";

    /// Parses a `scheduler` setting (the table above; case matters, as in config files).
    ///
    /// # Errors
    /// [`Error::Config`] naming `name` and the accepted names.
    pub fn parse(name: &str) -> Result<Self, Error> {
        let (priority_admission, policy) = match name {
            "fifo" => (false, PolicyKind::Fifo),
            "priority" => (true, PolicyKind::Fifo),
            "equal" | "equal-share" => (false, PolicyKind::EqualShare),
            "byte-prop" | "byte-proportional" => (false, PolicyKind::ByteProportional),
            "stall-aware" => (false, PolicyKind::StallAware),
            _ => {
                return Err(Error::Config(format!(
                    "scheduler {name:?} is not {}",
                    Self::NAMES
                )))
            }
        };
        Ok(SchedulerSetting {
            priority_admission,
            policy,
        })
    }
}

/// Weighted water-filling: rates proportional to `weights`, each capped at `caps[i]`, summing
/// to at most `capacity`; entries with weight 0 get 0. Deterministic, O(n log n).
pub fn water_fill(capacity: f64, weights: &[f64], caps: &[f64], rates: &mut [f64]) {
    let mut idx: Vec<usize> = (0..weights.len())
        .filter(|&i| weights[i] > 0.0 && caps[i] > 0.0)
        .collect();
    // Loads whose cap binds first (smallest cap per unit weight) are settled first.
    idx.sort_by(|&a, &b| {
        (caps[a] / weights[a])
            .total_cmp(&(caps[b] / weights[b]))
            .then(a.cmp(&b))
    });
    let mut left = capacity;
    let mut wsum: f64 = idx.iter().map(|&i| weights[i]).sum();
    for (k, &i) in idx.iter().enumerate() {
        let fair = if wsum > 0.0 {
            left * weights[i] / wsum
        } else {
            0.0
        };
        if caps[i] <= fair {
            rates[i] = caps[i];
            left -= caps[i];
            wsum -= weights[i];
        } else {
            // Every remaining load has a larger cap per weight: all get their fair share.
            let per_weight = left / wsum;
            for &j in &idx[k..] {
                rates[j] = per_weight * weights[j];
            }
            return;
        }
    }
}

/// Indices `0..n` in arrival order (request `i` arrives at `arrival_s(i)` seconds), ties by
/// index: the order first-come-first-served serves loads in ([`Fifo`]) and the simulator takes
/// requests in (`crate::sim::simulate_instance`; the traffic benchmark's prediction
/// re-decides its requests in the same order).
pub fn arrival_order(n: usize, arrival_s: impl Fn(usize) -> f64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| arrival_s(a).total_cmp(&arrival_s(b)).then(a.cmp(&b)));
    order
}

/// [`water_fill`] over `loads`, each weighted by `weight` and capped at its spec's
/// `max_rate` (bytes/s): the equal-share and byte-proportional policies.
fn water_fill_loads(
    capacity: f64,
    loads: &[LoadState],
    rates: &mut [f64],
    weight: impl Fn(&LoadState) -> f64,
) {
    let w: Vec<f64> = loads.iter().map(weight).collect();
    let caps: Vec<f64> = loads.iter().map(|l| l.spec().max_rate).collect();
    water_fill(capacity, &w, &caps, rates);
}

/// First come, first served: loads in arrival order each take all they can.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fifo;

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn allocate(&mut self, _now: f64, capacity: f64, loads: &[LoadState], rates: &mut [f64]) {
        let mut left = capacity;
        for i in arrival_order(loads.len(), |i| loads[i].arrival_s()) {
            if loads[i].remaining_bytes() == 0 {
                continue;
            }
            let r = loads[i].spec().max_rate.min(left);
            rates[i] = r;
            left -= r;
        }
    }
}

/// Equal sharing: max-min fair rates over loads with bytes left.
#[derive(Debug, Clone, Copy, Default)]
pub struct EqualShare;

impl Policy for EqualShare {
    fn name(&self) -> &'static str {
        "equal-share"
    }
    fn allocate(&mut self, _now: f64, capacity: f64, loads: &[LoadState], rates: &mut [f64]) {
        water_fill_loads(capacity, loads, rates, |l| {
            if l.remaining_bytes() > 0 {
                1.0
            } else {
                0.0
            }
        });
    }
}

/// Byte-proportional sharing: weights are the bytes each load has left, so loads started
/// together finish together.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteProportional;

impl Policy for ByteProportional {
    fn name(&self) -> &'static str {
        "byte-proportional"
    }
    fn allocate(&mut self, _now: f64, capacity: f64, loads: &[LoadState], rates: &mut [f64]) {
        water_fill_loads(capacity, loads, rates, |l| l.remaining_bytes() as f64);
    }
}

/// Stall-aware sharing (ours): bandwidth goes where it shortens stalls.
///
/// At each re-plan, for every load with bytes left:
/// - `need` = the smallest constant rate that delivers every remaining layer before its
///   deadline (the predicted start of that layer's compute, [`LoadState::need_rate`]); infinite
///   when a missing layer is already needed, in particular a request's **first layer, which is
///   pure stall**;
/// - `s` = the stall the load would still suffer if it had the whole link from now on
///   ([`LoadState::stall_at_rate`]). `s = 0` means the load can be **hidden behind compute**.
///
/// Loads are ranked by `(s, next deadline, id)`: hideable loads first, earliest deadline first
/// among them; then stalling loads by shortest unavoidable stall (the shortest-processing-time
/// rule that minimises the sum of waiting). Water-filling in that order gives each hideable load
/// exactly `need` (**no extra bandwidth for a request already hidden**) and each stalling load
/// all it can take of what is left. Capacity still unused after that (every load satisfied or
/// at its limit) is handed out in the same order so that no byte of the link is wasted.
///
/// # Cost
/// Computing `s` costs `O(layers)` per load. A load's `s` never decreases while its state
/// (bytes delivered, deadline, full rate) stays the same: with `now` past its deadline it is
/// constant, before it it grows with `now`. So the policy keeps each load's last `s`, less a
/// margin far above the rounding of [`LoadState::stall_at_rate`] (`1e-9` of the times
/// involved), as a lower bound, and computes `s` afresh only for loads whose state changed,
/// loads that may be hideable, and stalling loads in ranking order until the link is spent
/// (a lazy selection over the bounds). The rates are bit for bit those of ranking every load
/// afresh ([`StallAware::exhaustive`], which the tests compare against); a re-plan of `n`
/// loads of which `k` changed or are served costs `O(n + k x layers + k log n)` instead of
/// `O(n x layers + n log n)` (a heap of all `n` bounds is built only when one could rank
/// before the best load ranked afresh). On a link whose loads' needs leave capacity unused
/// every load is ranked, as the second pass needs the whole order.
#[derive(Debug, Clone, Default)]
pub struct StallAware {
    exhaustive: bool,
    order: Vec<(f64, f64, usize)>,
    need: Vec<f64>,
    cache: Vec<StallBound>,
    spare: Vec<StallBound>,
    lazy: Vec<(f64, usize, usize)>,
    exact: std::collections::BinaryHeap<std::cmp::Reverse<Ranked>>,
}

/// A load's stall `s` as last computed, with the state it was computed for.
#[derive(Debug, Clone, Copy)]
struct StallBound {
    id: super::load::LoadId,
    arrival_s: f64,
    delivered: u64,
    total: u64,
    frontier_s: f64,
    full: f64,
    at: f64,
    stall: f64,
    /// Sum of the load's layer compute times (s): bounds the magnitude of the terms of `s`.
    compute_s: f64,
}

/// A ranking key `(s, next deadline, index)`, ordered by `s`, then the deadline (both by
/// [`f64::total_cmp`]), then the index.
type Ranked = (TotalF64, TotalF64, usize);

/// Load `i`'s entry in the min-heap of ranking keys: stall `s` (s), next deadline `d` (s).
fn ranked(s: f64, d: f64, i: usize) -> std::cmp::Reverse<Ranked> {
    std::cmp::Reverse((TotalF64(s), TotalF64(d), i))
}

impl StallAware {
    /// The same policy ranking every load afresh at every re-plan (`O(n x layers)` per
    /// re-plan): the definition the default instance's rates are checked against.
    pub fn exhaustive() -> Self {
        StallAware {
            exhaustive: true,
            ..StallAware::default()
        }
    }

    /// The stall below which a load counts as hideable (rounding noise).
    const HIDDEN_S: f64 = 1e-9;

    fn stall(l: &LoadState, now: f64, full: f64) -> f64 {
        let s = l.stall_at_rate(now, full);
        if s < Self::HIDDEN_S {
            0.0
        } else {
            s
        }
    }

    fn allocate_exhaustive(
        &mut self,
        now: f64,
        capacity: f64,
        loads: &[LoadState],
        rates: &mut [f64],
    ) {
        self.order.clear();
        self.need.clear();
        self.need.resize(loads.len(), 0.0);
        let need = &mut self.need;
        for (i, l) in loads.iter().enumerate() {
            if l.remaining_bytes() == 0 {
                continue;
            }
            let full = capacity.min(l.spec().max_rate);
            let s = Self::stall(l, now, full);
            need[i] = if s == 0.0 {
                l.need_rate(now).min(full)
            } else {
                full
            };
            self.order.push((s, l.next_deadline_s(), i));
        }
        self.order.sort_by(|a, b| {
            a.0.total_cmp(&b.0)
                .then(a.1.total_cmp(&b.1))
                .then(a.2.cmp(&b.2))
        });
        let mut left = capacity;
        for &(_, _, i) in &self.order {
            let r = need[i].min(left);
            rates[i] = r;
            left -= r;
            if left <= 0.0 {
                return;
            }
        }
        self.hand_out_rest(left, loads, rates);
    }

    /// The second pass: capacity `left` over after every load got its need, in rank order.
    fn hand_out_rest(&self, mut left: f64, loads: &[LoadState], rates: &mut [f64]) {
        for &(_, _, i) in &self.order {
            let r = (loads[i].spec().max_rate - rates[i]).max(0.0).min(left);
            rates[i] += r;
            left -= r;
            if left <= 0.0 {
                return;
            }
        }
    }

    /// `s` of load `l` at `now`, computed afresh and remembered in `cache[k]`.
    fn refresh(cache: &mut [StallBound], k: usize, l: &LoadState, now: f64) -> f64 {
        let e = &mut cache[k];
        let s = Self::stall(l, now, e.full);
        e.at = now;
        e.stall = s;
        s
    }
}

impl Policy for StallAware {
    fn name(&self) -> &'static str {
        "stall-aware"
    }
    fn allocate(&mut self, now: f64, capacity: f64, loads: &[LoadState], rates: &mut [f64]) {
        if self.exhaustive {
            return self.allocate_exhaustive(now, capacity, loads, rates);
        }
        self.order.clear();
        self.need.clear();
        self.need.resize(loads.len(), 0.0);
        self.lazy.clear();
        self.exact.clear();
        // The bounds of the loads still active (both lists ascend by id), refreshed or kept.
        let mut old = std::mem::take(&mut self.cache);
        let mut cache = std::mem::take(&mut self.spare);
        cache.clear();
        let mut j = 0;
        // The smallest bound not computed afresh.
        let mut least = f64::INFINITY;
        for (i, l) in loads.iter().enumerate() {
            while j < old.len() && old[j].id < l.id() {
                j += 1;
            }
            let full = capacity.min(l.spec().max_rate);
            let known = old.get(j).filter(|e| {
                e.id == l.id()
                    && e.arrival_s == l.arrival_s()
                    && e.delivered == l.delivered_bytes()
                    && e.frontier_s == l.next_deadline_s()
                    && e.full == full
                    && e.at <= now
            });
            let k = cache.len();
            match known {
                Some(e) => {
                    if e.delivered == e.total {
                        continue;
                    }
                    cache.push(*e);
                    // `s` at `now` is at least the one computed at `e.at`, less rounding (a
                    // few ulps of the times involved per layer; the margin is far above it).
                    let margin =
                        1e-9 * (1.0 + now.abs() + e.frontier_s.abs() + e.stall + e.compute_s);
                    let bound = e.stall - margin;
                    if bound > Self::HIDDEN_S {
                        least = least.min(bound);
                        self.lazy.push((bound, i, k));
                        continue;
                    }
                }
                None => {
                    if l.remaining_bytes() == 0 {
                        continue;
                    }
                    cache.push(StallBound {
                        id: l.id(),
                        arrival_s: l.arrival_s(),
                        delivered: l.delivered_bytes(),
                        total: l.total_bytes(),
                        frontier_s: l.next_deadline_s(),
                        full,
                        at: now,
                        stall: 0.0,
                        compute_s: l.spec().layer_compute_s.iter().sum(),
                    })
                }
            }
            let s = Self::refresh(&mut cache, k, l, now);
            if s == 0.0 {
                self.need[i] = l.need_rate(now).min(full);
                self.order.push((0.0, l.next_deadline_s(), i));
            } else {
                self.need[i] = full;
                self.exact.push(ranked(s, l.next_deadline_s(), i));
            }
        }
        old.clear();
        self.spare = old;
        // Hideable loads first, by deadline.
        self.order
            .sort_by(|a, b| a.1.total_cmp(&b.1).then(a.2.cmp(&b.2)));
        let mut left = capacity;
        for &(_, _, i) in &self.order {
            let r = self.need[i].min(left);
            rates[i] = r;
            left -= r;
            if left <= 0.0 {
                self.cache = cache;
                return;
            }
        }
        // Then stalling loads by (s, deadline, id): the best exactly ranked load goes next
        // once no bound left could rank before it. The bounds are put in a heap only when
        // one could (usually the load being served keeps the lead and none is needed).
        let mut lazy: Option<std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize, usize)>>> =
            None;
        loop {
            let best = self
                .exact
                .peek()
                .map(|std::cmp::Reverse((TotalF64(s), _, _))| *s);
            if lazy.is_none() && best.is_none_or(|s| least <= s) && !self.lazy.is_empty() {
                // Bounds are above 0, so their bit patterns order as the numbers do.
                lazy = Some(
                    self.lazy
                        .iter()
                        .map(|&(b, i, k)| std::cmp::Reverse((b.to_bits(), i, k)))
                        .collect(),
                );
            }
            if let Some(h) = &mut lazy {
                while let Some(&std::cmp::Reverse((b, i, k))) = h.peek() {
                    let b = f64::from_bits(b);
                    if self
                        .exact
                        .peek()
                        .is_some_and(|std::cmp::Reverse((TotalF64(s), _, _))| b > *s)
                    {
                        break;
                    }
                    h.pop();
                    let l = &loads[i];
                    let s = Self::refresh(&mut cache, k, l, now);
                    debug_assert!(s >= b && s > 0.0, "stall bound {b} above {s}");
                    self.need[i] = cache[k].full;
                    self.exact.push(ranked(s, l.next_deadline_s(), i));
                }
            }
            let Some(std::cmp::Reverse((TotalF64(s), TotalF64(d), i))) = self.exact.pop() else {
                break;
            };
            self.order.push((s, d, i));
            let r = self.need[i].min(left);
            rates[i] = r;
            left -= r;
            if left <= 0.0 {
                self.cache = cache;
                return;
            }
        }
        self.cache = cache;
        self.hand_out_rest(left, loads, rates);
    }
}

#[cfg(test)]
mod tests;
