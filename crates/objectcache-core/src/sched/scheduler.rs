//! The sans-IO scheduler: loads sharing one link (or one bandwidth cap), driven by events.
//!
//! A [`Scheduler`] owns the state of every active load and a [`Policy`] that
//! splits the link among them. It never reads a clock or touches a socket: the caller passes
//! `now` (seconds on any monotonic clock of its choice, the same for every call) and asks what
//! to do next, in the style of quinn-proto.
//!
//! # Driving it
//! Inputs (each re-plans at the next poll):
//! - [`Scheduler::handle_arrival`] — a load starts ([`LoadSpec`]: bytes and compute time per
//!   layer, when compute can start, a per-load rate limit);
//! - [`Scheduler::handle_progress`] — bytes of a load were delivered (landed at the consumer);
//! - [`Scheduler::handle_layer_computed`] — the engine finished computing a layer (optional:
//!   without it the scheduler predicts compute from the spec);
//! - [`Scheduler::handle_departure`] — a load finished or was cancelled;
//! - [`Scheduler::handle_timeout`] — the time given by [`Scheduler::poll_timeout`] was reached.
//!
//! Outputs:
//! - [`Scheduler::poll_allocation`] — the rate (bytes/s) each load should get now. A fluid
//!   driver (the simulator, or a client pacing its streams) uses these rates directly.
//! - [`Scheduler::poll_next_unit`] — "which load's next unit goes now?": a **server** that sends
//!   delivery units (layer slices) over a NIC calls it whenever the NIC can take more, sends the
//!   unit it names and reports it with `handle_progress` once written; a **client** issuing
//!   ranged GETs calls it whenever it may start another GET and issues the GET for the named
//!   byte range of that load, reporting `handle_progress` when the body has landed. Units follow
//!   the allocation (deficit counters fed by the rates) and are gated by the shared
//!   [`TokenBucket`] that enforces the bandwidth cap; `None` means "nothing may go now, ask
//!   again at `poll_timeout`".
//! - [`Scheduler::poll_timeout`] — when to call `handle_timeout` (a layer deadline passes, or the
//!   token bucket has refilled enough).
//!
//! Errors: unknown load ids and malformed specs are [`Error::InvalidArgument`]; nothing panics.
#![forbid(unsafe_code)]

use super::load::LoadState;
pub use super::load::{LoadId, LoadSpec};
use super::policy::Policy;
use crate::error::Error;

/// A token bucket: `rate` bytes/s, at most `burst` bytes saved up. Shared by all loads of one
/// [`Scheduler`], it enforces the bandwidth cap on units handed out by `poll_next_unit`.
/// A unit larger than `burst` may go once the bucket is full (the bucket then runs into debt).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: f64,
}

impl TokenBucket {
    /// A full bucket at time `now`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `rate` and `burst` are finite and > 0.
    pub fn new(rate: f64, burst: f64, now: f64) -> Result<Self, Error> {
        if !(rate.is_finite() && rate > 0.0 && burst.is_finite() && burst > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "token bucket: rate ({rate}) and burst ({burst}) must be finite and > 0"
            )));
        }
        Ok(TokenBucket {
            rate,
            burst,
            tokens: burst,
            last: now,
        })
    }

    /// Refill rate (bytes/s).
    pub fn rate(&self) -> f64 {
        self.rate
    }

    fn refill(&mut self, now: f64) {
        if now > self.last {
            self.tokens = (self.tokens + self.rate * (now - self.last)).min(self.burst);
            self.last = now;
        }
    }

    /// Takes `bytes` if available at `now` (or if the bucket is full for units above `burst`).
    pub fn try_take(&mut self, now: f64, bytes: u64) -> bool {
        self.refill(now);
        let need = (bytes as f64).min(self.burst);
        if self.tokens + 1e-9 >= need {
            self.tokens -= bytes as f64;
            true
        } else {
            false
        }
    }

    /// Earliest time at which `bytes` can be taken.
    pub fn ready_at(&self, bytes: u64) -> f64 {
        let need = (bytes as f64).min(self.burst);
        if self.tokens >= need {
            self.last
        } else {
            self.last + (need - self.tokens) / self.rate
        }
    }
}

/// One load's rate in the current allocation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Allocation {
    /// The load.
    pub id: LoadId,
    /// Its share of the link, bytes/s.
    pub rate: f64,
}

/// A unit of delivery chosen by [`Scheduler::poll_next_unit`]: bytes `offset..offset+bytes` of
/// the load's layer-major byte stream (within one layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    /// The load.
    pub id: LoadId,
    /// The layer this unit belongs to.
    pub layer: usize,
    /// Byte offset of the unit within the load's concatenated layers.
    pub offset: u64,
    /// Unit size in bytes.
    pub bytes: u64,
}

/// The scheduler: active loads, a policy and the shared bandwidth cap (module docs).
#[derive(Debug)]
pub struct Scheduler {
    policy: Box<dyn Policy + Send>,
    capacity: f64,
    bucket: TokenBucket,
    loads: Vec<LoadState>,
    alloc: Vec<Allocation>,
    credits: Vec<f64>,
    credit_at: f64,
    dirty: bool,
    next_id: LoadId,
    replans: u64,
    blocked_bytes: Option<u64>,
    /// Where `handle_progress` looks first (the last load it found, then the next one): a
    /// driver reporting many loads in id order finds each in O(1).
    progress_hint: usize,
}

impl Scheduler {
    /// A scheduler for a link (or cap) of `capacity` bytes/s whose token bucket holds at most
    /// `burst` bytes, created at time `now`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless both are finite and > 0.
    pub fn new(
        policy: Box<dyn Policy + Send>,
        capacity: f64,
        burst: f64,
        now: f64,
    ) -> Result<Self, Error> {
        let bucket = TokenBucket::new(capacity, burst, now)?;
        Ok(Scheduler {
            policy,
            capacity,
            bucket,
            loads: Vec::new(),
            alloc: Vec::new(),
            credits: Vec::new(),
            credit_at: now,
            dirty: true,
            next_id: 0,
            replans: 0,
            blocked_bytes: None,
            progress_hint: 0,
        })
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Link capacity (bytes/s).
    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    /// Active loads, in ascending id order.
    pub fn loads(&self) -> &[LoadState] {
        &self.loads
    }

    /// The active load with this id.
    pub fn load(&self, id: LoadId) -> Option<&LoadState> {
        self.index(id).ok().map(|i| &self.loads[i])
    }

    /// How many times the policy has been run.
    pub fn replans(&self) -> u64 {
        self.replans
    }

    fn index(&self, id: LoadId) -> Result<usize, Error> {
        self.loads
            .binary_search_by_key(&id, |l| l.id)
            .map_err(|_| Error::InvalidArgument(format!("scheduler: no active load with id {id}")))
    }

    /// A load arrives at `now`; returns its id.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the spec is malformed ([`LoadSpec::validate`]).
    pub fn handle_arrival(&mut self, now: f64, spec: LoadSpec) -> Result<LoadId, Error> {
        spec.validate()?;
        self.accrue(now);
        let id = self.next_id;
        self.next_id += 1;
        self.loads.push(LoadState::new(id, now, spec));
        self.credits.push(0.0);
        self.dirty = true;
        Ok(id)
    }

    /// `bytes` more bytes of load `id` were delivered by `now` (delivery is in layer order).
    /// Completing a layer re-plans.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown id or more bytes than the load has left.
    pub fn handle_progress(&mut self, now: f64, id: LoadId, bytes: u64) -> Result<(), Error> {
        let h = self.progress_hint;
        let at = |i: usize| self.loads.get(i).is_some_and(|l| l.id == id);
        let i = if at(h) {
            h
        } else if at(h + 1) {
            h + 1
        } else {
            self.index(id)?
        };
        self.progress_hint = i;
        let l = &mut self.loads[i];
        if bytes > l.remaining_bytes() {
            return Err(Error::InvalidArgument(format!(
                "scheduler: load {id} reported {bytes} bytes delivered but has only {} left",
                l.remaining_bytes()
            )));
        }
        let before = l.layers_done;
        l.delivered += bytes;
        l.issued = l.issued.max(l.delivered);
        l.advance_layers(now);
        if l.layers_done != before {
            self.dirty = true;
        }
        Ok(())
    }

    /// The engine finished computing layer `layer` of load `id` at `now` (replaces the
    /// prediction, and re-plans).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown id or a layer whose KV was not delivered.
    pub fn handle_layer_computed(
        &mut self,
        now: f64,
        id: LoadId,
        layer: usize,
    ) -> Result<(), Error> {
        let i = self.index(id)?;
        let l = &mut self.loads[i];
        if layer >= l.layers_done {
            return Err(Error::InvalidArgument(format!(
                "scheduler: load {id} layer {layer} reported computed but only {} layers were delivered",
                l.layers_done
            )));
        }
        let mut f = now;
        for k in layer + 1..l.layers_done {
            f = f.max(l.layer_ready_s[k]) + l.spec.layer_compute_s[k];
        }
        l.frontier_s = f;
        self.dirty = true;
        Ok(())
    }

    /// The link's capacity changes to `capacity` bytes/s from `now` on (a link whose share of
    /// a resource behind it varies, e.g. a gateway's share of the storage cluster); the token
    /// bucket refills at the new rate.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `capacity` is finite and > 0.
    pub fn set_capacity(&mut self, now: f64, capacity: f64) -> Result<(), Error> {
        if !(capacity.is_finite() && capacity > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "scheduler: capacity {capacity} bytes/s must be finite and > 0"
            )));
        }
        if capacity != self.capacity {
            self.accrue(now);
            self.bucket.refill(now);
            self.bucket.rate = capacity;
            self.capacity = capacity;
            self.dirty = true;
        }
        Ok(())
    }

    /// Load `id` finished or was cancelled at `now`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown id.
    pub fn handle_departure(&mut self, now: f64, id: LoadId) -> Result<(), Error> {
        let i = self.index(id)?;
        self.accrue(now);
        self.loads.remove(i);
        self.credits.remove(i);
        self.dirty = true;
        Ok(())
    }

    /// The time returned by [`Scheduler::poll_timeout`] was reached: re-plan.
    pub fn handle_timeout(&mut self, now: f64) {
        self.accrue(now);
        self.dirty = true;
    }

    /// When the driver should call [`Scheduler::handle_timeout`] next: the earliest future
    /// layer deadline of a load whose next layer is missing, or when the token bucket can pay
    /// for a unit that `poll_next_unit` had to hold back. `None` if nothing is pending.
    pub fn poll_timeout(&self, now: f64) -> Option<f64> {
        let mut t = f64::INFINITY;
        for l in &self.loads {
            if l.layers_done < l.layers() && l.frontier_s > now {
                t = t.min(l.frontier_s);
            }
        }
        if let Some(b) = self.blocked_bytes {
            t = t.min(self.bucket.ready_at(b).max(now));
        }
        t.is_finite().then_some(t)
    }

    /// The current allocation (one entry per active load, ascending id), re-planned first if an
    /// event happened since the last plan. Rates sum to at most the capacity.
    pub fn poll_allocation(&mut self, now: f64) -> &[Allocation] {
        if self.dirty {
            self.replan(now);
        }
        &self.alloc
    }

    /// Re-plans unconditionally at `now`.
    pub fn replan(&mut self, now: f64) {
        self.accrue(now);
        let mut rates = vec![0.0; self.loads.len()];
        self.policy
            .allocate(now, self.capacity, &self.loads, &mut rates);
        // Enforce the contract whatever the policy did.
        let mut total = 0.0;
        for (r, l) in rates.iter_mut().zip(&self.loads) {
            if !r.is_finite() || *r < 0.0 || l.remaining_bytes() == 0 {
                *r = 0.0;
            }
            *r = r.min(l.spec.max_rate);
            total += *r;
        }
        if total > self.capacity {
            let k = self.capacity / total;
            rates.iter_mut().for_each(|r| *r *= k);
        }
        self.alloc = self
            .loads
            .iter()
            .zip(rates)
            .map(|(l, rate)| Allocation { id: l.id, rate })
            .collect();
        self.dirty = false;
        self.replans += 1;
    }

    fn accrue(&mut self, now: f64) {
        let dt = now - self.credit_at;
        if dt > 0.0 && self.alloc.len() == self.loads.len() {
            for (c, a) in self.credits.iter_mut().zip(&self.alloc) {
                *c += a.rate * dt;
            }
        }
        if now > self.credit_at {
            self.credit_at = now;
        }
    }

    /// Which load's next unit goes now (module docs): at most `max_unit` bytes, never crossing a
    /// layer boundary, chosen by largest deficit among loads with a positive rate (any load with
    /// bytes left if none has one), and paid from the token bucket. `None` if no load has
    /// un-issued bytes or the bucket cannot pay yet (see [`Scheduler::poll_timeout`]).
    pub fn poll_next_unit(&mut self, now: f64, max_unit: u64) -> Option<Unit> {
        if self.dirty {
            self.replan(now);
        }
        self.accrue(now);
        let max_unit = max_unit.max(1);
        let cap = 4.0 * max_unit as f64;
        for c in &mut self.credits {
            *c = c.min(cap);
        }
        let pick = |positive: bool| {
            let mut best: Option<usize> = None;
            for (i, l) in self.loads.iter().enumerate() {
                if l.issued >= l.total_bytes() || (positive && self.alloc[i].rate <= 0.0) {
                    continue;
                }
                if best.is_none_or(|b| self.credits[i] > self.credits[b]) {
                    best = Some(i);
                }
            }
            best
        };
        let i = pick(true).or_else(|| pick(false))?;
        let l = &self.loads[i];
        let layer = l.cum_bytes.partition_point(|&c| c <= l.issued);
        let bytes = (l.cum_bytes[layer] - l.issued).min(max_unit);
        if !self.bucket.try_take(now, bytes) {
            self.blocked_bytes = Some(bytes);
            return None;
        }
        self.blocked_bytes = None;
        let l = &mut self.loads[i];
        let unit = Unit {
            id: l.id,
            layer,
            offset: l.issued,
            bytes,
        };
        l.issued += bytes;
        self.credits[i] -= bytes as f64;
        Some(unit)
    }
}

#[cfg(test)]
mod tests {
    use super::super::policy::PolicyKind;
    use super::*;

    fn spec(layers: usize, bytes: u64, c: f64) -> LoadSpec {
        LoadSpec {
            layer_bytes: vec![bytes; layers],
            layer_compute_s: vec![c; layers],
            compute_ready_s: 0.0,
            max_rate: f64::INFINITY,
        }
    }

    #[test]
    fn progress_tracks_layers_and_deadlines() {
        let mut s = Scheduler::new(PolicyKind::EqualShare.build(), 100.0, 100.0, 0.0).unwrap();
        let id = s.handle_arrival(0.0, spec(3, 10, 1.0)).unwrap();
        assert!(s.load(id).unwrap().stalled(0.0));
        assert_eq!(s.load(id).unwrap().need_rate(0.0), f64::INFINITY);
        s.handle_progress(0.5, id, 10).unwrap();
        let l = s.load(id).unwrap();
        assert_eq!(l.layers_delivered(), 1);
        assert_eq!(l.next_deadline_s(), 1.5);
        // 10 bytes by 1.5 and 20 by 2.5, from 0.5: need max(10/1, 20/2) = 10 B/s.
        assert!((l.need_rate(0.5) - 10.0).abs() < 1e-12);
        assert!(s.handle_progress(0.6, id, 21).is_err());
        assert!(s.handle_progress(0.6, 99, 1).is_err());
        assert!(s.handle_layer_computed(0.6, id, 2).is_err());
        s.handle_layer_computed(1.2, id, 0).unwrap();
        assert_eq!(s.load(id).unwrap().next_deadline_s(), 1.2);
        s.handle_departure(2.0, id).unwrap();
        assert!(s.loads().is_empty());
    }

    #[test]
    fn bad_specs_are_rejected() {
        let mut s = Scheduler::new(PolicyKind::Fifo.build(), 1.0, 1.0, 0.0).unwrap();
        let mut bad = spec(2, 1, 0.1);
        bad.layer_compute_s.pop();
        assert!(s
            .handle_arrival(0.0, bad)
            .unwrap_err()
            .to_string()
            .contains("compute times"));
        assert!(Scheduler::new(PolicyKind::Fifo.build(), 0.0, 1.0, 0.0).is_err());
    }

    #[test]
    fn units_respect_layers_and_the_token_bucket() {
        let mut s = Scheduler::new(PolicyKind::EqualShare.build(), 100.0, 20.0, 0.0).unwrap();
        let a = s.handle_arrival(0.0, spec(2, 15, 1.0)).unwrap();
        let u = s.poll_next_unit(0.0, 10).unwrap();
        assert_eq!((u.id, u.layer, u.offset, u.bytes), (a, 0, 0, 10));
        let u = s.poll_next_unit(0.0, 10).unwrap();
        assert_eq!(
            (u.layer, u.offset, u.bytes),
            (0, 10, 5),
            "units stop at the layer boundary"
        );
        // 20-byte bucket spent (15 taken, 5 left): a 10-byte unit must wait 0.05 s.
        assert!(s.poll_next_unit(0.0, 10).is_none());
        let t = s.poll_timeout(0.0).unwrap();
        assert!((t - 0.05).abs() < 1e-9, "{t}");
        let u = s.poll_next_unit(t, 10).unwrap();
        assert_eq!((u.layer, u.offset), (1, 15));
    }

    #[test]
    fn units_follow_the_allocation_over_time() {
        // Equal share between two loads: over many units each gets about half.
        let mut s = Scheduler::new(PolicyKind::EqualShare.build(), 1000.0, 10.0, 0.0).unwrap();
        let a = s.handle_arrival(0.0, spec(4, 1000, 1.0)).unwrap();
        let b = s.handle_arrival(0.0, spec(4, 1000, 1.0)).unwrap();
        let (mut na, mut nb) = (0u64, 0u64);
        let mut now = 0.0;
        for _ in 0..200 {
            match s.poll_next_unit(now, 10) {
                Some(u) if u.id == a => na += u.bytes,
                Some(u) if u.id == b => nb += u.bytes,
                Some(_) => unreachable!(),
                None => now = s.poll_timeout(now).unwrap(),
            }
        }
        assert!(na.abs_diff(nb) <= 20, "{na} vs {nb}");
    }
}
