//! Deterministic discrete-event simulator of loads sharing a storage link.
//!
//! - [`workload`]: seeded synthetic mixes, case C1, Mooncake-style trace replay;
//! - [`engine`]: the event loop (virtual clock, fluid link, layerwise compute per request)
//!   driving the real [`crate::sched::Scheduler`] and planner;
//! - [`bound`]: an exact offline lower bound for small bursts;
//! - [`cluster`]: many GPUs, tens of gateways and a storage cluster (`objectcache sim
//!   --cluster`);
//! - [`records`](Record): one summary record per (workload, policy, cap), as printed and written
//!   by `objectcache sim`.
//!
//! Pure: no I/O, no clock, no unsafe. The same inputs and seed give the same records.
#![forbid(unsafe_code)]

pub mod bound;
pub mod cluster;
pub mod engine;
pub mod workload;

pub use engine::{simulate, simulate_instance, Outcome, SimConfig, SimPolicy, Summary};
pub use workload::{Instance, Request, Workload};

use crate::error::Error;

/// One row of the simulator's report (seconds, fractions).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Record {
    /// Workload name (`mix`, `staggered`, `c1`, `trace`).
    pub workload: String,
    /// Requests per instance the workload was built for (0 for traces).
    pub concurrency: usize,
    /// Policy name (`stall-aware`, `equal-share+planner`, ...).
    pub policy: String,
    /// Cap as a fraction of the link.
    pub cap_fraction: f64,
    /// Cap in bytes/s.
    pub cap_bytes_per_s: f64,
    /// Model preset.
    pub model: String,
    /// GPU kind.
    pub gpu: String,
    /// Seed of the workload generator.
    pub seed: u64,
    /// TTFT figures over the requests (their fields appear at this level of the JSON).
    #[serde(flatten)]
    pub summary: Summary,
    /// Exact lower bound on the mean added TTFT over all schedules with full loads
    /// ([`bound::burst_lower_bound`]); present for small bursts and policies without planner.
    pub lower_bound_mean_added_ttft_s: Option<f64>,
}

/// What to simulate: one workload under several policies at one cap.
#[derive(Debug, Clone)]
pub struct RunSpec<'a> {
    /// The workload.
    pub workload: &'a Workload,
    /// Simulation parameters (capacity = the cap).
    pub config: &'a SimConfig,
    /// Cap as a fraction of the link (for the record).
    pub cap_fraction: f64,
    /// Policies.
    pub policies: &'a [SimPolicy],
    /// Model name (for the record).
    pub model: &'a str,
    /// GPU name (for the record).
    pub gpu: &'a str,
    /// Seed (for the record).
    pub seed: u64,
    /// Compute the lower bound when the state space is at most this (0: never).
    pub bound_max_states: u64,
}

/// Runs every policy of `spec` and returns one record each. The lower bound, when computed,
/// is the mean over all requests of the per-instance optimum, and is attached to every
/// record that loads whole prefixes.
///
/// # Errors
/// As [`simulate`].
pub fn run(spec: &RunSpec<'_>) -> Result<Vec<Record>, Error> {
    let mut outs = Vec::new();
    for p in spec.policies {
        outs.push((p, simulate(spec.workload, spec.config, *p)?));
    }
    let mut lb = None;
    if spec.bound_max_states > 0 && spec.workload.instances.iter().all(Instance::is_burst) {
        let mut sum = 0.0;
        let mut ok = true;
        let mut off = 0;
        for inst in &spec.workload.instances {
            // The best simulated full-load policy on this instance prunes the search.
            let n = inst.requests.len();
            let ub = outs
                .iter()
                .filter(|(p, _)| !p.planner)
                .map(|(_, o)| Summary::of(&o[off..off + n]).mean_added_ttft_s)
                .fold(f64::INFINITY, f64::min);
            off += n;
            match bound::burst_lower_bound(inst, spec.config, ub, spec.bound_max_states) {
                Some(b) => sum += b * inst.requests.len() as f64,
                None => {
                    ok = false;
                    break;
                }
            }
        }
        if ok {
            lb = Some(sum / spec.workload.requests().max(1) as f64);
        }
    }
    Ok(outs
        .into_iter()
        .map(|(p, o)| {
            let s = Summary::of(&o);
            Record {
                workload: spec.workload.name.clone(),
                concurrency: spec.workload.concurrency,
                policy: p.name(),
                cap_fraction: spec.cap_fraction,
                cap_bytes_per_s: spec.config.capacity,
                model: spec.model.to_string(),
                gpu: spec.gpu.to_string(),
                seed: spec.seed,
                summary: s,
                lower_bound_mean_added_ttft_s: if p.planner { None } else { lb },
            }
        })
        .collect())
}
