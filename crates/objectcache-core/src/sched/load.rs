//! One load as the scheduler sees it: its identity, what it needs ([`LoadSpec`]) and how far
//! it has come ([`LoadState`]). Shared by the scheduler (which advances it) and the policies
//! (which read it to allocate rates), so neither depends on the other for it.
#![forbid(unsafe_code)]

use crate::error::Error;

/// Identifier of a load within one [`Scheduler`](super::Scheduler) (assigned in arrival order from 0).
pub type LoadId = u64;

/// What the scheduler needs to know about one load.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSpec {
    /// Bytes to load per layer, in the order prefill consumes them (layer-major); layers whose
    /// KV is recomputed rather than loaded may have 0 bytes.
    pub layer_bytes: Vec<u64>,
    /// Compute time of each layer once its KV is present (s), same length as `layer_bytes`,
    /// e.g. from [`ComputeModel::layer_times`](super::ComputeModel::layer_times).
    pub layer_compute_s: Vec<f64>,
    /// When the engine could start computing layer 0 (s, same clock as `now`), usually the
    /// arrival time; later if the GPU is busy.
    pub compute_ready_s: f64,
    /// Largest rate this load can use (bytes/s), e.g. the consumer's host-to-device or NIC
    /// rate; `f64::INFINITY` for no limit.
    pub max_rate: f64,
}

impl LoadSpec {
    /// Checks lengths and values.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field that is wrong.
    pub fn validate(&self) -> Result<(), Error> {
        if self.layer_bytes.is_empty() {
            return Err(Error::InvalidArgument("load spec: no layers".into()));
        }
        if self.layer_bytes.len() != self.layer_compute_s.len() {
            return Err(Error::InvalidArgument(format!(
                "load spec: {} layer byte counts but {} layer compute times",
                self.layer_bytes.len(),
                self.layer_compute_s.len()
            )));
        }
        if self
            .layer_compute_s
            .iter()
            .any(|c| !c.is_finite() || *c < 0.0)
        {
            return Err(Error::InvalidArgument(
                "load spec: compute times must be finite and >= 0 s".into(),
            ));
        }
        if !self.compute_ready_s.is_finite() {
            return Err(Error::InvalidArgument(
                "load spec: compute_ready_s must be finite".into(),
            ));
        }
        if self.max_rate.is_nan() || self.max_rate <= 0.0 {
            return Err(Error::InvalidArgument(
                "load spec: max_rate must be > 0 bytes/s".into(),
            ));
        }
        Ok(())
    }
}

/// The scheduler's view of one active load (read-only for policies).
#[derive(Debug, Clone)]
pub struct LoadState {
    pub(super) id: LoadId,
    pub(super) arrival_s: f64,
    pub(super) spec: LoadSpec,
    pub(super) cum_bytes: Vec<u64>,
    pub(super) delivered: u64,
    pub(super) issued: u64,
    pub(super) layers_done: usize,
    pub(super) layer_ready_s: Vec<f64>,
    pub(super) frontier_s: f64,
}

impl LoadState {
    pub(super) fn new(id: LoadId, now: f64, spec: LoadSpec) -> Self {
        let mut acc = 0;
        let cum_bytes = spec
            .layer_bytes
            .iter()
            .map(|b| {
                acc += b;
                acc
            })
            .collect();
        let mut s = LoadState {
            id,
            arrival_s: now,
            frontier_s: spec.compute_ready_s,
            layer_ready_s: Vec::with_capacity(spec.layer_bytes.len()),
            spec,
            cum_bytes,
            delivered: 0,
            issued: 0,
            layers_done: 0,
        };
        s.advance_layers(now);
        s
    }

    /// The load's id.
    pub fn id(&self) -> LoadId {
        self.id
    }
    /// When it arrived (s).
    pub fn arrival_s(&self) -> f64 {
        self.arrival_s
    }
    /// The spec it arrived with.
    pub fn spec(&self) -> &LoadSpec {
        &self.spec
    }
    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.spec.layer_bytes.len()
    }
    /// Total bytes of the load.
    pub fn total_bytes(&self) -> u64 {
        self.cum_bytes.last().copied().unwrap_or(0)
    }
    /// Bytes delivered so far.
    pub fn delivered_bytes(&self) -> u64 {
        self.delivered
    }
    /// Bytes handed out by [`Scheduler::poll_next_unit`](super::Scheduler::poll_next_unit) so far (≥ delivered).
    pub fn issued_bytes(&self) -> u64 {
        self.issued
    }
    /// Bytes not yet delivered.
    pub fn remaining_bytes(&self) -> u64 {
        self.total_bytes() - self.delivered
    }
    /// Layers whose KV is complete.
    pub fn layers_delivered(&self) -> usize {
        self.layers_done
    }
    /// When each delivered layer completed (s), length [`LoadState::layers_delivered`].
    pub fn layer_ready_s(&self) -> &[f64] {
        &self.layer_ready_s
    }
    /// Predicted end of compute of the last delivered layer (s), or `compute_ready_s` if none:
    /// the deadline of the next undelivered layer.
    pub fn next_deadline_s(&self) -> f64 {
        self.frontier_s
    }
    /// True when the next layer is needed (its deadline has passed) and not delivered.
    pub fn stalled(&self, now: f64) -> bool {
        self.layers_done < self.layers() && self.frontier_s <= now
    }

    /// Bytes still missing for layers `0..=l`.
    pub(super) fn missing_through(&self, l: usize) -> u64 {
        self.cum_bytes[l].saturating_sub(self.delivered)
    }

    /// Smallest constant rate (bytes/s) from `now` on that delivers every remaining layer by its
    /// deadline (the predicted start of its compute, assuming no further stall); `+∞` if a
    /// missing layer's deadline has passed, 0 if nothing is missing.
    pub fn need_rate(&self, now: f64) -> f64 {
        let mut deadline = self.frontier_s;
        let mut need = 0.0f64;
        for l in self.layers_done..self.layers() {
            let miss = self.missing_through(l);
            if miss > 0 {
                let slack = deadline - now;
                if slack <= 0.0 {
                    return f64::INFINITY;
                }
                need = need.max(miss as f64 / slack);
            }
            deadline += self.spec.layer_compute_s[l];
        }
        need
    }

    /// Predicted end of compute (s) if the load gets `rate` bytes/s from `now` on.
    pub fn finish_at_rate(&self, now: f64, rate: f64) -> f64 {
        let mut f = self.frontier_s;
        for l in self.layers_done..self.layers() {
            let miss = self.missing_through(l);
            let ready = if miss == 0 {
                now
            } else if rate > 0.0 {
                now + miss as f64 / rate
            } else {
                f64::INFINITY
            };
            f = f.max(ready) + self.spec.layer_compute_s[l];
        }
        f
    }

    /// Stall (s) still to come if the load gets `rate` bytes/s from `now` on: predicted finish
    /// minus the finish with all remaining KV present now.
    pub fn stall_at_rate(&self, now: f64, rate: f64) -> f64 {
        let mut f = self.frontier_s;
        let mut rest = 0.0;
        let inv = if rate > 0.0 {
            1.0 / rate
        } else {
            f64::INFINITY
        };
        for l in self.layers_done..self.layers() {
            let miss = self.missing_through(l);
            let ready = if miss == 0 {
                now
            } else {
                now + miss as f64 * inv
            };
            let c = self.spec.layer_compute_s[l];
            f = f.max(ready) + c;
            rest += c;
        }
        if self.layers_done >= self.layers() {
            return 0.0;
        }
        (f - (self.frontier_s.max(now) + rest)).max(0.0)
    }

    pub(super) fn advance_layers(&mut self, now: f64) {
        while self.layers_done < self.layers() && self.delivered >= self.cum_bytes[self.layers_done]
        {
            self.layer_ready_s.push(now);
            self.frontier_s =
                self.frontier_s.max(now) + self.spec.layer_compute_s[self.layers_done];
            self.layers_done += 1;
        }
    }
}
