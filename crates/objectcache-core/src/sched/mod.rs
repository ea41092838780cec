//! Bandwidth scheduling across concurrent loads (sans-IO): compute model, policies, planner.
//!
//! Concurrent loads compete for one storage link (a server NIC, or a host NIC shared by the
//! GPUs of a client). This module decides who gets which share so that the **added TTFT** —
//! TTFT with loading minus TTFT with all KV already local, consumed layer by layer — is small,
//! and how much of each cached prefix is worth loading at all.
//!
//! - [`model`]: per-layer prefill time from FLOPs and memory traffic (cited fits), and
//!   host-to-device bandwidth per GPU;
//! - [`timeline`]: layerwise consumption, added TTFT, the pipeline bound;
//! - [`policy`]: FIFO, equal share, byte-proportional and stall-aware policies behind
//!   [`Policy`];
//! - [`scheduler`]: the event-driven [`Scheduler`] (arrival / progress / layer computed /
//!   departure / timeout in; allocation, next unit, timeout out) with a shared [`TokenBucket`];
//! - [`planner`]: load-vs-recompute per request and the deadline fallback;
//! - [`placement`]: which of several gateways serves a load (rendezvous hashing, least
//!   loaded, two choices).
//!
//! Everything here is pure: no I/O, no clock reads (callers pass `now` in seconds), no unsafe.
//! See `docs/scheduling.md` for the design and the sources of every figure.
#![forbid(unsafe_code)]

pub mod load;
pub mod model;
pub mod placement;
pub mod planner;
pub mod policy;
pub mod scheduler;
pub mod timeline;

pub use load::{LoadId, LoadSpec, LoadState};
pub use model::{
    AnalyticModel, ComputeModel, Efficiency, GpuKind, KernelClass, MeasuredModel, ModelShape,
};
pub use placement::Placement;
pub use planner::{fallback, plan, Fallback, Plan, PlanChoice, PlanInput, StallState};
pub use policy::{
    arrival_order, ByteProportional, EqualShare, Fifo, Policy, PolicyKind, SchedulerSetting,
    StallAware,
};
pub use scheduler::{Allocation, Scheduler, TokenBucket, Unit};

/// A time, rate or stall (f64) ordered by [`f64::total_cmp`], for the keys of the stall-aware
/// policy's ranking heap and the cluster simulator's event heap: a total order in which
/// `-0.0 < 0.0` and NaN sorts outside every number, so a heap of keys never panics or
/// misorders.
#[derive(Debug, Clone, Copy)]
pub struct TotalF64(pub f64);
/// Equal exactly when [`Ord`] says so (bit patterns alike: `-0.0 != 0.0`, a NaN equals
/// itself), as the heaps' order needs.
impl PartialEq for TotalF64 {
    fn eq(&self, o: &Self) -> bool {
        self.0.total_cmp(&o.0).is_eq()
    }
}
impl Eq for TotalF64 {}
impl PartialOrd for TotalF64 {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for TotalF64 {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}
