//! The records of `ttft --mode modeled` and the method names, shared by the run
//! (`super::modeled`) and its plots (`super::modeled_plot`), so neither imports the other's
//! internals.

use objectcache::sched::timeline;
use serde::Serialize;

/// Method names, in report order.
pub const METHODS: &[&str] = &[
    "local-layerwise",
    "gather-tcp",
    "gather-tcp+planner",
    "s3-layerwise",
    "chunkwise",
    "nixl-obj",
    "recompute",
];

/// One modeled TTFT (seconds, bytes, tokens). Field names are stable (docs/benchmarks.md).
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// `local-layerwise`, `gather-tcp`, `gather-tcp+planner`, `s3-layerwise`, `chunkwise`,
    /// `nixl-obj`, `recompute`.
    pub method: String,
    /// Geometry preset.
    pub model: String,
    /// GPU kind of the compute model.
    pub gpu: String,
    /// Cached prefix tokens (mean over the requests when `concurrency > 1`).
    pub context_tokens: u64,
    /// New tokens.
    pub new_tokens: u64,
    /// Requests sharing the link.
    pub concurrency: usize,
    /// Scheduling policy (`single` for one request).
    pub policy: String,
    /// Modeled TTFT (mean when `concurrency > 1`).
    pub ttft_s: f64,
    /// `ttft_s` minus local-layerwise TTFT (for concurrent records: the simulator's mean
    /// added TTFT over all KV on the GPU).
    pub added_ttft_s: f64,
    /// `added_ttft_s` as a percentage of local-layerwise TTFT.
    pub added_ttft_pct: f64,
    /// Modeled time until the last layer landed in host memory (0 for local and recompute;
    /// for concurrent records the mean load duration in the simulator).
    pub transfer_time_s: f64,
    /// Two-stage pipeline bound (transfer at the link rate, then compute); single requests.
    pub bound_ttft_s: Option<f64>,
    /// Three-stage bound (link, host-to-device, compute); single requests.
    pub bound_h2d_ttft_s: Option<f64>,
    /// `ttft_s / bound_ttft_s`.
    pub ttft_over_bound: Option<f64>,
    /// TTFT with the prefix in host memory, copied per layer (the baseline).
    pub local_ttft_s: f64,
    /// TTFT of recomputing prefix and new tokens.
    pub recompute_ttft_s: f64,
    /// Prefix bytes over the link at its full rate (`B_full / link`; for concurrent records
    /// all the burst's prefixes).
    pub pure_transfer_s: f64,
    /// `added_ttft_s / pure_transfer_s`.
    pub added_over_pure_transfer: f64,
    /// Prefix tokens loaded (the planner may load fewer; the rest is recomputed).
    pub loaded_tokens: u64,
    /// Prefix bytes of this rank (`B_full`; for concurrent records the burst's total).
    pub prefix_bytes: u64,
    /// Real bytes moved per measured load (`B_measured`).
    pub measured_bytes: u64,
    /// Real seconds of the measured load until its last layer landed (median run).
    pub measured_load_s: f64,
    /// Time scale applied to measured times (`(B_full/B_measured) x cap/link`); null for
    /// simulated (concurrent) records.
    pub time_scale: f64,
    /// Modeled link, bytes/s.
    pub link_bytes_per_s: f64,
    /// Real loopback cap, bytes/s.
    pub loopback_cap_bytes_per_s: f64,
    /// Host-to-device copy bandwidth used, bytes/s.
    pub h2d_bytes_per_s: f64,
    /// Kernel class of the compute model.
    pub kernels: String,
    /// Tensor-parallel degree of the compute model.
    pub tp: u32,
    /// 99th-percentile TTFT (concurrent records).
    pub p99_ttft_s: Option<f64>,
    /// Notes (how this figure was obtained, or why a method was skipped).
    pub note: String,
}

/// Timeline of one modeled request: (TTFT, per-layer GPU arrival, compute start, compute end).
pub struct Modeled {
    /// TTFT (s).
    pub ttft_s: f64,
    /// Compute schedule.
    pub timeline: timeline::Timeline,
}
