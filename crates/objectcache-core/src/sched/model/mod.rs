//! Compute model: per-layer prefill time of `N_new` new tokens appended to a cached prefix of
//! `C` tokens, per model shape and GPU kind; host-to-device copy bandwidth per GPU.
//!
//! # Formula
//! Per layer, per GPU (FLOP accounting of Kaplan et al., arXiv 2001.08361, Table 1, with the
//! attention term of Chinchilla, arXiv 2203.15556, Appendix F, halved for the causal mask as
//! FlashAttention's benchmark does):
//!
//! ```text
//! F_lin  = 2 · P_layer · N_new                      (2 FLOPs per weight per token)
//! F_att  = 4 · d_model · N_new · (C + N_new / 2)     (QKᵀ and PV, causal)
//! t_layer = max( (F_lin / (peak · η_lin) + F_att / (peak · η_att)) / TP ,
//!                2 · P_layer bytes / (TP · HBM bandwidth) )          (weight-read floor)
//! TTFT    = Σ_layers t_layer + t_fixed
//! ```
//!
//! Peaks are dense BF16: A100 312 TF/s, H100/H200 989.5 TF/s (NVIDIA data sheets; tritonbench
//! issue 78). HBM: A100 2.0 TB/s, H100 3.35 TB/s, H200 4.8 TB/s, GH200 4.0 TB/s.
//!
//! Efficiencies ([`KernelClass`]) are the fitted values of the project's compute reference:
//! A100 HF + FlashAttention-2 η_lin 0.545 / η_att 0.51 (least-squares fit to the seven
//! MInference Llama-3-8B points, 10K–1M tokens, github.com/microsoft/MInference
//! experiments/README.md, rms error 2.3%); A100 TensorRT-LLM/vLLM class 0.60 / 0.51 (TRT-LLM v0.5
//! performance doc, 2K rows); H100/H200 FA2-class 0.65 / 0.34 (FA2 causal 319–335 TF/s, FA3 paper
//! arXiv 2407.08608); H100/H200 FA3/cuDNN class 0.65 / 0.60 (FA3 causal 579–616 TF/s, same paper).
//! GH200 uses the H100 figures (same Hopper GPU). `t_fixed` (launch and all-reduce latency, not
//! overlappable) is 6 ms on one GPU and 22 ms with TP > 1, read off the 128-token TRT-LLM rows.
//!
//! With these, Llama-3.1-8B from scratch on one H100 with FA3-class kernels takes 0.096 s at 4K
//! and 3.3 s at 64K; with FA2-class kernels 20K tokens take about 0.75 s (the figure quoted in
//! issue 4). Unit tests below check these points.
//!
//! # Measured mode
//! [`ComputeModel::Measured`] takes per-layer times measured by the caller at one reference
//! point `(new, cached)` and scales them to other points by the analytic model's ratio, so a
//! single calibration run carries over to other prefix lengths.
#![forbid(unsafe_code)]

use crate::error::Error;

/// A GPU kind with the hardware constants the model needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuKind {
    /// A100 80GB SXM: 312 TF/s BF16 dense, ~2.0 TB/s HBM, PCIe Gen4 x16 host link.
    A100,
    /// H100 SXM: 989.5 TF/s BF16 dense, 3.35 TB/s HBM, PCIe Gen5 x16 host link.
    H100,
    /// H200 SXM: 989.5 TF/s BF16 dense, 4.8 TB/s HBM, PCIe Gen5 x16 host link.
    H200,
    /// GH200 (H100-class GPU): compute as H100, 4.0 TB/s HBM, NVLink-C2C to the Grace host.
    Gh200,
}

/// Names accepted by [`GpuKind::parse`].
pub const GPU_NAMES: &[&str] = &["a100", "h100", "h200", "gh200"];

impl GpuKind {
    /// Parses `a100`, `h100`, `h200` or `gh200` (case-insensitive).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the unknown GPU and the known ones.
    pub fn parse(name: &str) -> Result<Self, Error> {
        match name.to_ascii_lowercase().as_str() {
            "a100" => Ok(GpuKind::A100),
            "h100" => Ok(GpuKind::H100),
            "h200" => Ok(GpuKind::H200),
            "gh200" => Ok(GpuKind::Gh200),
            other => Err(Error::InvalidArgument(format!(
                "unknown GPU kind {other:?}: known kinds are {}",
                GPU_NAMES.join(", ")
            ))),
        }
    }

    /// Lower-case name as accepted by [`GpuKind::parse`].
    pub fn name(self) -> &'static str {
        match self {
            GpuKind::A100 => "a100",
            GpuKind::H100 => "h100",
            GpuKind::H200 => "h200",
            GpuKind::Gh200 => "gh200",
        }
    }

    /// Dense BF16 peak in FLOP/s. Sources: nvidia.com A100 and H100/H200 data sheets;
    /// 989.5 TF/s for Hopper per github.com/meta-pytorch/tritonbench issue 78.
    pub fn bf16_peak_flops(self) -> f64 {
        match self {
            GpuKind::A100 => 312e12,
            GpuKind::H100 | GpuKind::H200 | GpuKind::Gh200 => 989.5e12,
        }
    }

    /// HBM bandwidth in bytes/s (data sheets: A100 80GB ~2.0 TB/s, H100 SXM 3.35 TB/s,
    /// H200 4.8 TB/s, GH200 96 GB HBM3 up to 4.0 TB/s).
    pub fn hbm_bytes_per_s(self) -> f64 {
        match self {
            GpuKind::A100 => 2.0e12,
            GpuKind::H100 => 3.35e12,
            GpuKind::H200 => 4.8e12,
            GpuKind::Gh200 => 4.0e12,
        }
    }

    /// Host-to-device link bandwidth per direction by specification, bytes/s:
    /// PCIe Gen4 x16 32 GB/s (A100), PCIe Gen5 x16 64 GB/s (H100, H200), NVLink-C2C 450 GB/s
    /// (GH200; datacrunch.io GH200 data-movement article).
    pub fn h2d_spec_bytes_per_s(self) -> f64 {
        match self {
            GpuKind::A100 => 32e9,
            GpuKind::H100 | GpuKind::H200 => 64e9,
            GpuKind::Gh200 => 450e9,
        }
    }

    /// Measured pinned host-to-device copy bandwidth, bytes/s, the figure to use when modelling
    /// the host-to-device step of a load:
    /// - A100, PCIe Gen4: 25.1 GB/s (nvbandwidth, github.com/NVIDIA/nvbandwidth issue 42);
    /// - H100, PCIe Gen5: 56.7 GB/s (nvbandwidth issue 6, 3 of 4 GPUs of an H100 VM);
    /// - H200, PCIe Gen5: no published figure found; 55 GB/s assumed (same link as H100);
    /// - GH200, NVLink-C2C: 346 GB/s copy-engine (nvbandwidth issue 23).
    pub fn h2d_bytes_per_s(self) -> f64 {
        match self {
            GpuKind::A100 => 25.1e9,
            GpuKind::H100 => 56.7e9,
            GpuKind::H200 => 55e9,
            GpuKind::Gh200 => 346e9,
        }
    }
}

/// Attention/GEMM kernel class, which selects the fitted efficiencies (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KernelClass {
    /// FlashAttention-2 class attention: A100 HF + FA2 (η 0.545 / 0.51), Hopper FA2 (0.65 / 0.34).
    Fa2,
    /// Engine-class kernels (the default): A100 TensorRT-LLM/vLLM (0.60 / 0.51), Hopper
    /// FA3/cuDNN (0.65 / 0.60).
    #[default]
    Tuned,
}

impl KernelClass {
    /// Parses `fa2` or `tuned` (also `fa3`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for any other name.
    pub fn parse(name: &str) -> Result<Self, Error> {
        match name.to_ascii_lowercase().as_str() {
            "fa2" => Ok(KernelClass::Fa2),
            "tuned" | "fa3" => Ok(KernelClass::Tuned),
            other => Err(Error::InvalidArgument(format!(
                "unknown kernel class {other:?}: use fa2 or tuned (fa3)"
            ))),
        }
    }
}

/// Efficiencies (fractions of the BF16 peak) of the linear layers and of attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Efficiency {
    /// η_lin: achieved fraction of peak in the linear layers (GEMMs), 0 < η ≤ 1.
    pub linear: f64,
    /// η_att: achieved fraction of peak in causal attention, 0 < η ≤ 1.
    pub attention: f64,
}

impl Efficiency {
    /// The fitted efficiencies for a GPU and kernel class (module docs give the fits).
    pub fn fitted(gpu: GpuKind, kernels: KernelClass) -> Self {
        match (gpu, kernels) {
            (GpuKind::A100, KernelClass::Fa2) => Efficiency {
                linear: 0.545,
                attention: 0.51,
            },
            (GpuKind::A100, KernelClass::Tuned) => Efficiency {
                linear: 0.60,
                attention: 0.51,
            },
            (_, KernelClass::Fa2) => Efficiency {
                linear: 0.65,
                attention: 0.34,
            },
            (_, KernelClass::Tuned) => Efficiency {
                linear: 0.65,
                attention: 0.60,
            },
        }
    }
}

/// The shape of a model as the compute model needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    /// Preset name (as [`crate::layout::KvGeometry::preset`] accepts).
    pub name: String,
    /// Transformer layers.
    pub layers: u32,
    /// Hidden size d_model (= query heads × head_dim).
    pub d_model: u64,
    /// Parameters of one layer's linear maps (Q, K, V, O projections and the SwiGLU FFN),
    /// `P_layer`; weights are read at 2 bytes each (BF16).
    pub linear_params_per_layer: u64,
    /// KV bytes per token per layer at TP 1 in BF16 (`2 · kv_heads · head_dim · 2`).
    pub kv_bytes_per_token_per_layer: u64,
}

impl ModelShape {
    /// Builds a shape from a Llama-style configuration (GQA attention, SwiGLU FFN):
    /// `P_layer = 2·d² + 2·d·kv_heads·head_dim + 3·d·ffn`.
    pub fn llama_style(
        name: &str,
        layers: u32,
        d_model: u64,
        kv_heads: u64,
        head_dim: u64,
        ffn: u64,
    ) -> Self {
        let p = 2 * d_model * d_model + 2 * d_model * kv_heads * head_dim + 3 * d_model * ffn;
        ModelShape {
            name: name.to_string(),
            layers,
            d_model,
            linear_params_per_layer: p,
            kv_bytes_per_token_per_layer: 2 * kv_heads * head_dim * 2,
        }
    }

    /// Looks up a preset: `llama-3.1-8b` (32 layers, d 4096, FFN 14336, P_layer 218.1 M),
    /// `llama-3.1-70b` (80, 8192, 28672, 855.6 M) — both from the Llama 3 paper, arXiv
    /// 2407.21783, Table 3 — `qwen2.5-7b` (28, 3584, 4 KV heads, FFN 18944; its config.json)
    /// and `smollm2-135m` (30, 576, 3 KV heads, head dim 64, FFN 1536; its config.json).
    /// The names match [`crate::layout::KvGeometry::preset`] (`-tp8` suffixes are accepted;
    /// tensor parallelism is a separate argument of [`AnalyticModel`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the unknown preset.
    pub fn preset(name: &str) -> Result<Self, Error> {
        let n = name.to_ascii_lowercase();
        Ok(match n.as_str() {
            "llama-3.1-8b" | "llama3.1-8b" | "8b" => Self::llama_style("llama-3.1-8b", 32, 4096, 8, 128, 14336),
            "llama-3.1-70b" | "llama3.1-70b" | "70b" | "llama-3.1-70b-tp8" | "70b-tp8" => {
                Self::llama_style("llama-3.1-70b", 80, 8192, 8, 128, 28672)
            }
            "qwen2.5-7b" | "qwen2.5-7b-instruct" => Self::llama_style("qwen2.5-7b", 28, 3584, 4, 128, 18944),
            "smollm2-135m" | "smollm2-135m-instruct" => Self::llama_style("smollm2-135m", 30, 576, 3, 64, 1536),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown model {other:?}: known models are llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, smollm2-135m"
                )))
            }
        })
    }
}

/// The analytic compute model of one model on one GPU kind (module docs give the formula).
#[derive(Debug, Clone, PartialEq)]
pub struct AnalyticModel {
    /// Model shape.
    pub shape: ModelShape,
    /// GPU kind.
    pub gpu: GpuKind,
    /// Efficiencies used.
    pub efficiency: Efficiency,
    /// Tensor-parallel degree (work and weight reads divided evenly, communication not modelled).
    pub tp: u32,
    /// Per-prefill fixed time in seconds (launch, all-reduce latency), not overlappable.
    pub fixed_s: f64,
}

impl AnalyticModel {
    /// Model with the fitted efficiencies and fixed time (6 ms at TP 1, 22 ms at TP > 1).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `tp` is 0.
    pub fn new(
        shape: ModelShape,
        gpu: GpuKind,
        kernels: KernelClass,
        tp: u32,
    ) -> Result<Self, Error> {
        if tp == 0 {
            return Err(Error::InvalidArgument(
                "compute model: tp must be at least 1".into(),
            ));
        }
        Ok(AnalyticModel {
            shape,
            gpu,
            efficiency: Efficiency::fitted(gpu, kernels),
            tp,
            fixed_s: if tp == 1 { 0.006 } else { 0.022 },
        })
    }

    /// Seconds for one layer to process `new_tokens` tokens after `cached` tokens whose KV is
    /// present (formula in the module docs). Zero new tokens take zero time.
    pub fn layer_time(&self, new_tokens: u64, cached: u64) -> f64 {
        if new_tokens == 0 {
            return 0.0;
        }
        let peak = self.gpu.bf16_peak_flops();
        let n = new_tokens as f64;
        let c = cached as f64;
        let p = self.shape.linear_params_per_layer as f64;
        let d = self.shape.d_model as f64;
        let tp = self.tp as f64;
        let f_lin = 2.0 * p * n;
        let f_att = 4.0 * d * n * (c + n / 2.0);
        let compute = (f_lin / (peak * self.efficiency.linear)
            + f_att / (peak * self.efficiency.attention))
            / tp;
        let weight_read = 2.0 * p / (tp * self.gpu.hbm_bytes_per_s());
        compute.max(weight_read)
    }
}

/// A per-layer measured model: times measured at one reference point, scaled by an analytic
/// model to other points.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredModel {
    per_layer_s: Vec<f64>,
    fixed_s: f64,
    reference_new: u64,
    reference_cached: u64,
    scale: AnalyticModel,
}

impl MeasuredModel {
    /// `per_layer_s[l]`: measured seconds of layer `l` for `reference_new` new tokens after
    /// `reference_cached` cached ones; `fixed_s`: measured non-overlappable time per prefill;
    /// `scale`: analytic model whose ratio `t(n, c) / t(reference)` scales to other points.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the list is empty, its length differs from the model's
    /// layer count, a time is negative or not finite, or `reference_new` is 0.
    pub fn new(
        per_layer_s: Vec<f64>,
        fixed_s: f64,
        reference_new: u64,
        reference_cached: u64,
        scale: AnalyticModel,
    ) -> Result<Self, Error> {
        if per_layer_s.is_empty() || per_layer_s.len() != scale.shape.layers as usize {
            return Err(Error::InvalidArgument(format!(
                "measured compute model: {} per-layer times given, the model has {} layers",
                per_layer_s.len(),
                scale.shape.layers
            )));
        }
        if per_layer_s
            .iter()
            .chain(std::iter::once(&fixed_s))
            .any(|t| !t.is_finite() || *t < 0.0)
        {
            return Err(Error::InvalidArgument(
                "measured compute model: times must be finite and non-negative seconds".into(),
            ));
        }
        if reference_new == 0 {
            return Err(Error::InvalidArgument(
                "measured compute model: reference_new must be at least 1".into(),
            ));
        }
        Ok(MeasuredModel {
            per_layer_s,
            fixed_s,
            reference_new,
            reference_cached,
            scale,
        })
    }
}

/// Per-layer prefill time, analytic or measured. All times in seconds.
#[derive(Debug, Clone, PartialEq)]
pub enum ComputeModel {
    /// From FLOPs and memory traffic (module docs).
    Analytic(AnalyticModel),
    /// Caller-supplied per-layer times, scaled by an analytic model.
    Measured(MeasuredModel),
}

impl ComputeModel {
    /// Analytic model for a preset name, GPU and kernel class at TP 1.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown model.
    pub fn preset(model: &str, gpu: GpuKind, kernels: KernelClass) -> Result<Self, Error> {
        Ok(ComputeModel::Analytic(AnalyticModel::new(
            ModelShape::preset(model)?,
            gpu,
            kernels,
            1,
        )?))
    }

    /// The compute model an engine's caller names: the analytic model of the preset `model`
    /// on `gpu` (`GpuKind::parse`) with `kernels` (`KernelClass::parse`) at TP `tp`; or, when
    /// `compute_us_per_layer` > 0, that measured time (microseconds, the same for every
    /// layer) for a prefill of `new_tokens` new tokens after `cached_tokens` cached, scaled by
    /// the analytic model to other token counts ([`MeasuredModel`]). The C ABI's stall advice
    /// (`objectcache_stall_params`) is built this way.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown model, GPU or kernel class, TP 0, a measured
    /// time with `new_tokens` 0, or a measured time above `u32::MAX` microseconds (the load
    /// hints' bound).
    pub fn from_settings(
        model: &str,
        gpu: &str,
        kernels: &str,
        tp: u32,
        compute_us_per_layer: u64,
        cached_tokens: u64,
        new_tokens: u64,
    ) -> Result<Self, Error> {
        let a = AnalyticModel::new(
            ModelShape::preset(model)?,
            GpuKind::parse(gpu)?,
            KernelClass::parse(kernels)?,
            tp,
        )?;
        if compute_us_per_layer == 0 {
            return Ok(ComputeModel::Analytic(a));
        }
        if new_tokens == 0 {
            return Err(Error::InvalidArgument(
                "compute_us_per_layer is the time for new_tokens, which is 0".into(),
            ));
        }
        if compute_us_per_layer > u64::from(u32::MAX) {
            return Err(Error::InvalidArgument(format!(
                "compute_us_per_layer {compute_us_per_layer} is above {} us",
                u32::MAX
            )));
        }
        let per_layer = vec![compute_us_per_layer as f64 * 1e-6; a.shape.layers as usize];
        let fixed = a.fixed_s;
        Ok(ComputeModel::Measured(MeasuredModel::new(
            per_layer,
            fixed,
            new_tokens,
            cached_tokens,
            a,
        )?))
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        match self {
            ComputeModel::Analytic(a) => a.shape.layers as usize,
            ComputeModel::Measured(m) => m.per_layer_s.len(),
        }
    }

    /// The model shape.
    pub fn shape(&self) -> &ModelShape {
        match self {
            ComputeModel::Analytic(a) => &a.shape,
            ComputeModel::Measured(m) => &m.scale.shape,
        }
    }

    /// Non-overlappable time per prefill, seconds.
    pub fn fixed_s(&self) -> f64 {
        match self {
            ComputeModel::Analytic(a) => a.fixed_s,
            ComputeModel::Measured(m) => m.fixed_s,
        }
    }

    /// Seconds for layer `layer` to process `new_tokens` after `cached` present tokens.
    /// A layer index past the last one takes 0 s.
    pub fn layer_time(&self, layer: usize, new_tokens: u64, cached: u64) -> f64 {
        match self {
            ComputeModel::Analytic(a) => {
                if layer < a.shape.layers as usize {
                    a.layer_time(new_tokens, cached)
                } else {
                    0.0
                }
            }
            ComputeModel::Measured(m) => {
                let Some(t) = m.per_layer_s.get(layer) else {
                    return 0.0;
                };
                let r = m.scale.layer_time(m.reference_new, m.reference_cached);
                if r <= 0.0 {
                    return *t;
                }
                t * m.scale.layer_time(new_tokens, cached) / r
            }
        }
    }

    /// Per-layer times for all layers (length [`ComputeModel::layers`]).
    pub fn layer_times(&self, new_tokens: u64, cached: u64) -> Vec<f64> {
        (0..self.layers())
            .map(|l| self.layer_time(l, new_tokens, cached))
            .collect()
    }

    /// Sum of the per-layer times, without the fixed time.
    pub fn compute_time(&self, new_tokens: u64, cached: u64) -> f64 {
        (0..self.layers())
            .map(|l| self.layer_time(l, new_tokens, cached))
            .sum()
    }

    /// TTFT with all `cached` tokens' KV already local: compute time plus fixed time.
    pub fn prefill_time(&self, new_tokens: u64, cached: u64) -> f64 {
        self.compute_time(new_tokens, cached) + self.fixed_s()
    }

    /// TTFT of recomputing everything: `prefix + new` tokens from scratch.
    pub fn recompute_time(&self, prefix: u64, new_tokens: u64) -> f64 {
        self.prefill_time(prefix + new_tokens, 0)
    }
}

#[cfg(test)]
mod tests;
