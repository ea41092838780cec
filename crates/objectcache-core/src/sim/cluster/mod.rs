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
//! - **Node tier** (optional, [`NodeTier`]): one ObjectCache server per node of GPUs with a
//!   DRAM and a disk level; a request whose prefix its node holds loads from there, through
//!   no gateway (`tier.rs` has the model).
//!
//! Fluid and event-driven (arrivals, layer boundaries, scheduler deadlines, health-check
//! ticks), deterministic for a seed. Pure: no I/O, no clock.
//!
//! By concern: the workloads (`workload.rs`), the configuration and results here, the
//! simulation (`engine.rs`), the node tier (`tier.rs`) and the tests (`tests.rs`).
//!
//! [`Scheduler`]: crate::sched::Scheduler
#![forbid(unsafe_code)]

mod engine;
#[cfg(test)]
mod tests;
mod tier;
mod workload;

pub use engine::simulate;
pub use tier::{NodeTier, TierAdmission};
pub use workload::{synthetic, trace, ClusterRequest, ClusterWorkload};

use crate::sched::placement::Placement;
use crate::sched::{ComputeModel, PolicyKind};

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
    /// The node tier, if any.
    pub tier: Option<NodeTier>,
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
    /// Bytes loaded through the gateways per GPU over the run (from the remote store: with
    /// the node tier, its hits are not counted).
    pub bytes_per_gpu: f64,
    /// Bytes read from the remote store (through the gateways) over the run.
    pub remote_bytes: f64,
    /// Nodes with a tier (0: no tier).
    pub tier_nodes: usize,
    /// Each node's DRAM level, GiB (0 without a tier).
    pub tier_dram_gib: f64,
    /// Each node's disk level, GiB.
    pub tier_disk_gib: f64,
    /// The tier's admission (`all`, `second:SECONDS`; empty without a tier).
    pub tier_admission: String,
    /// Loads whose prefix their node's DRAM level held.
    pub tier_dram_hits: u64,
    /// Loads whose prefix their node's disk level held.
    pub tier_disk_hits: u64,
    /// Loads from the remote store (every load without a tier).
    pub tier_misses: u64,
    /// `(tier_dram_hits + tier_disk_hits) / loads` (0 without a tier).
    pub tier_hit_rate: f64,
    /// The hit rate of a tier that held everything and filled at once: the loads whose
    /// prefix their node was asked for before (0 without a tier).
    pub tier_ideal_hit_rate: f64,
    /// Simulated events (arrivals, gateway events, health ticks).
    pub events: u64,
}
