//! What a modeled run works from: the resolved configuration ([`Plan`]), the measured loads
//! of one (model, context) ([`PointLoads`]), and the GPU compute model of a model preset
//! ([`compute_model`]). Shared by the run (`modeled.rs`) and its records (`modeled_points.rs`).

use super::modeled_link as link;
use anyhow::{anyhow, bail, Result};
use objectcache::layout::KvGeometry;
use objectcache::sched::model::{AnalyticModel, GpuKind, KernelClass, ModelShape};
use objectcache::sched::ComputeModel;
use objectcache::sim::SimPolicy;

/// The measured loads of one (model, context): median runs per method.
#[derive(Debug, Clone)]
pub(super) struct PointLoads {
    pub(super) chunks_full: usize,
    pub(super) chunks_measured: usize,
    pub(super) loads: Vec<(String, link::Measured, usize)>,
    pub(super) nixl_note: Option<String>,
}

/// Resolved configuration after `--quick` and parsing.
pub(super) struct Plan {
    pub(super) models: Vec<String>,
    pub(super) contexts: Vec<u64>,
    pub(super) new_tokens: Vec<u64>,
    pub(super) gpus: Vec<GpuKind>,
    pub(super) kernels: KernelClass,
    pub(super) concurrency: Vec<usize>,
    pub(super) policies: Vec<SimPolicy>,
    pub(super) runs: usize,
    pub(super) link: f64,
    pub(super) cap: f64,
    pub(super) max_load: u64,
}

/// The analytic compute model of `model` (a preset name) on `gpu` with kernels `k`, at the
/// geometry's TP size; an error when the preset is unknown or its layers differ from `g`'s.
pub(super) fn compute_model(
    model: &str,
    g: &KvGeometry,
    gpu: GpuKind,
    k: KernelClass,
) -> Result<ComputeModel> {
    let shape = ModelShape::preset(model).map_err(|e| anyhow!("--models: {e}"))?;
    if shape.layers != g.layers {
        bail!(
            "{model}: compute model has {} layers, geometry {}",
            shape.layers,
            g.layers
        );
    }
    Ok(ComputeModel::Analytic(
        AnalyticModel::new(shape, gpu, k, g.tp_world).map_err(|e| anyhow!("{e}"))?,
    ))
}
