//! Planner: how much of a cached prefix to load and how much to recompute, and what to
//! recompute when storage stalls past a deadline.
//!
//! # Load-vs-recompute
//! A request has `C` cached prefix tokens and `N` new tokens. Loading the first `k` prefix
//! tokens (a whole number of chunks) and recomputing the other `C − k` together with the new
//! tokens makes every layer process `n = C − k + N` tokens after `k` cached ones, and needs
//! `k · kv_bytes_per_token` bytes per layer, loaded layer by layer at the request's bandwidth
//! share `r` while earlier layers compute:
//!
//! ```text
//! ready_l = (l + 1) · k · b / r,    compute_l = t_layer(n = C − k + N, cached = k)
//! TTFT(k) = layerwise finish(ready, compute) + t_fixed        (see timeline::finish_time)
//! ```
//!
//! When the KV lands in host memory and is copied to the GPU at `h2d` bytes/s
//! ([`PlanInput::h2d_rate`]), each layer passes three pipelined stages instead (link, copy,
//! compute: `TTFT(k) = flow_shop_makespan([k·b/r, k·b/h2d, compute_l]) + t_fixed`).
//!
//! [`plan`] evaluates every chunk multiple `k ∈ {0, chunk, …, C}` (k = 0 is full recompute,
//! `TTFT(0) = prefill(C + N)`) and keeps the smallest predicted TTFT, preferring fewer bytes on
//! ties. Because `k = 0` is a candidate, the plan is **never predicted slower than full
//! recompute**.
//!
//! # Deadline fallback
//! When a load stalls (layer `d` is missing at its deadline), [`fallback`] compares waiting for
//! the rest at the current rate with recomputing the loaded tokens: their hidden states are
//! rebuilt through layers `0..d` (their KV for those layers is already present, so only their
//! own causal attention is paid), and layers `d..L` are then computed for all `C + N` tokens
//! from scratch. It returns which choice finishes first, naming the layers and tokens.
#![forbid(unsafe_code)]

use super::model::ComputeModel;
use super::timeline;
use crate::error::Error;
use std::fmt;

/// Inputs of [`plan`].
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    /// Cached prefix tokens available in the store (`C`).
    pub prefix_tokens: u64,
    /// New tokens to prefill after the prefix (`N`).
    pub new_tokens: u64,
    /// Tokens per chunk object: the granularity of `k`.
    pub chunk_tokens: u64,
    /// KV bytes per token per layer for this rank (`KvGeometry::bytes_per_token_per_layer`).
    pub kv_bytes_per_token_per_layer: u64,
    /// Bandwidth share the load expects (bytes/s).
    pub rate: f64,
    /// Host-to-device copy rate (bytes/s) when loaded KV lands in host memory and is then
    /// copied to the GPU layer by layer (`GpuKind::h2d_bytes_per_s`); `None` when it lands in
    /// GPU memory directly. With it, each loaded layer passes three pipelined stages (link,
    /// host-to-device, compute; `timeline::flow_shop_makespan`).
    pub h2d_rate: Option<f64>,
}

/// What [`plan`] chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanChoice {
    /// Load the whole cached prefix.
    LoadAll,
    /// Load a leading part, recompute the rest with the new tokens.
    Split,
    /// Load nothing: recomputing is predicted fastest.
    RecomputeAll,
}

/// A load-vs-recompute decision with the predictions behind it (seconds).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Prefix tokens to load (`k`, a multiple of the chunk size, ≤ `C`).
    pub load_tokens: u64,
    /// Prefix tokens to recompute (`C − k`).
    pub recompute_tokens: u64,
    /// Predicted TTFT of the chosen plan.
    pub predicted_ttft_s: f64,
    /// Predicted TTFT of full recompute.
    pub recompute_ttft_s: f64,
    /// Predicted TTFT of loading the whole prefix at the given rate.
    pub load_all_ttft_s: f64,
    /// Predicted TTFT with all prefix KV already local (the floor).
    pub local_ttft_s: f64,
    /// Rate the prediction assumed (bytes/s).
    pub rate: f64,
    /// The kind of choice.
    pub choice: PlanChoice,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gbps = self.rate / 1e9;
        match self.choice {
            PlanChoice::LoadAll => write!(
                f,
                "load all {} prefix tokens: predicted TTFT {:.3} s at {gbps:.2} GB/s, below recompute {:.3} s \
                 (all-local floor {:.3} s)",
                self.load_tokens, self.predicted_ttft_s, self.recompute_ttft_s, self.local_ttft_s
            ),
            PlanChoice::Split => write!(
                f,
                "load {} prefix tokens and recompute {}: predicted TTFT {:.3} s at {gbps:.2} GB/s, below both \
                 recompute {:.3} s and loading everything {:.3} s (transfer of the loaded part overlaps the \
                 larger compute)",
                self.load_tokens,
                self.recompute_tokens,
                self.predicted_ttft_s,
                self.recompute_ttft_s,
                self.load_all_ttft_s
            ),
            PlanChoice::RecomputeAll => write!(
                f,
                "recompute all {} prefix tokens: {:.3} s, no split pays off at {gbps:.2} GB/s (loading everything \
                 would take {:.3} s)",
                self.recompute_tokens, self.recompute_ttft_s, self.load_all_ttft_s
            ),
        }
    }
}

/// Predicted TTFT (s) of loading `k` prefix tokens and recomputing the rest (module docs).
pub fn predicted_ttft(model: &ComputeModel, input: &PlanInput, k: u64) -> f64 {
    let k = k.min(input.prefix_tokens);
    let n = input.prefix_tokens - k + input.new_tokens;
    let compute = model.layer_times(n, k);
    if k == 0 {
        return compute.iter().sum::<f64>() + model.fixed_s();
    }
    let layer_bytes = k * input.kv_bytes_per_token_per_layer;
    match input.h2d_rate {
        Some(h2d) if h2d > 0.0 && h2d.is_finite() => {
            let stage = |rate: f64| vec![layer_bytes as f64 / rate; model.layers()];
            timeline::flow_shop_makespan(&[stage(input.rate), stage(h2d), compute])
                + model.fixed_s()
        }
        _ => {
            let bytes = vec![layer_bytes; model.layers()];
            timeline::pipeline_ttft(&compute, &bytes, input.rate, model.fixed_s())
        }
    }
}

/// Chooses how many prefix tokens to load (module docs).
///
/// # Errors
/// [`Error::InvalidArgument`] if `chunk_tokens` is 0, the rate is NaN or negative, or there
/// are no tokens at all.
pub fn plan(model: &ComputeModel, input: &PlanInput) -> Result<Plan, Error> {
    if input.chunk_tokens == 0 {
        return Err(Error::InvalidArgument(
            "planner: chunk_tokens must be at least 1".into(),
        ));
    }
    if input.rate.is_nan() || input.rate < 0.0 {
        return Err(Error::InvalidArgument(format!(
            "planner: rate {} bytes/s is not a valid share",
            input.rate
        )));
    }
    if input.prefix_tokens + input.new_tokens == 0 {
        return Err(Error::InvalidArgument(
            "planner: no tokens to prefill".into(),
        ));
    }
    let recompute = predicted_ttft(model, input, 0);
    let full_k = input.prefix_tokens / input.chunk_tokens * input.chunk_tokens;
    let load_all = predicted_ttft(model, input, full_k);
    let (mut best_k, mut best_t) = (0u64, recompute);
    let mut k = input.chunk_tokens;
    while k <= full_k {
        let t = predicted_ttft(model, input, k);
        if t < best_t {
            best_k = k;
            best_t = t;
        }
        k += input.chunk_tokens;
    }
    let choice = if best_k == 0 {
        PlanChoice::RecomputeAll
    } else if best_k == full_k {
        PlanChoice::LoadAll
    } else {
        PlanChoice::Split
    };
    Ok(Plan {
        load_tokens: best_k,
        recompute_tokens: input.prefix_tokens - best_k,
        predicted_ttft_s: best_t,
        recompute_ttft_s: recompute,
        load_all_ttft_s: load_all,
        local_ttft_s: model.prefill_time(input.new_tokens, input.prefix_tokens),
        rate: input.rate,
        choice,
    })
}

/// State of a stalled load, for [`fallback`].
#[derive(Debug, Clone, PartialEq)]
pub struct StallState {
    /// Prefix tokens being loaded (`k`).
    pub load_tokens: u64,
    /// Tokens computed by the engine in this prefill (recomputed prefix part plus new tokens).
    pub compute_tokens: u64,
    /// Layers whose loaded KV is complete (`d`): layers `0..d` are present.
    pub layers_delivered: usize,
    /// Bytes still missing, per remaining layer `d..L`.
    pub missing_layer_bytes: Vec<u64>,
    /// When the engine finishes computing layer `d − 1` (or can start layer 0), seconds.
    pub frontier_s: f64,
    /// Rate expected for the rest of the load (bytes/s); 0 when nothing more will arrive (a
    /// remaining layer failed): a missing layer is then never ready
    /// ([`timeline::ready_at_rate`]) and waiting never finishes.
    pub rate: f64,
}

/// The fallback decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Fallback {
    /// Keep waiting: predicted to finish first (predicted end of compute, s).
    Wait {
        /// Predicted end of the last layer's compute if waiting.
        finish_s: f64,
    },
    /// Cancel the rest of the load and recompute.
    Recompute {
        /// First layer whose loaded KV is abandoned (`d`).
        from_layer: usize,
        /// Prefix tokens `0..tokens` to recompute: through layers `0..from_layer` only to rebuild
        /// their hidden states, and fully from `from_layer` on.
        tokens: u64,
        /// Predicted end of the last layer's compute when recomputing.
        finish_s: f64,
        /// Predicted end if waiting instead.
        wait_finish_s: f64,
    },
}

/// Decides, at `now`, whether a stalled load should keep waiting or recompute (module docs).
/// Times exclude the fixed per-prefill time (equal for both choices).
pub fn fallback(model: &ComputeModel, now: f64, s: &StallState) -> Fallback {
    let l_total = model.layers();
    let d = s.layers_delivered.min(l_total);
    let k = s.load_tokens;
    // Waiting: the remaining layers arrive back to back at `rate`.
    let ready = timeline::ready_at_rate(now, &s.missing_layer_bytes, s.rate);
    let compute_wait: Vec<f64> = (d..l_total)
        .map(|l| model.layer_time(l, s.compute_tokens, k))
        .collect();
    let wait_finish = timeline::finish_time(s.frontier_s, &ready, &compute_wait);
    // Recomputing: rebuild the k tokens' hidden states through layers 0..d, then all tokens.
    let start = s.frontier_s.max(now);
    let rebuild: f64 = (0..d).map(|l| model.layer_time(l, k, 0)).sum();
    let rest: f64 = (d..l_total)
        .map(|l| model.layer_time(l, s.compute_tokens + k, 0))
        .sum();
    let rec_finish = start + rebuild + rest;
    if rec_finish < wait_finish {
        Fallback::Recompute {
            from_layer: d,
            tokens: k,
            finish_s: rec_finish,
            wait_finish_s: wait_finish,
        }
    } else {
        Fallback::Wait {
            finish_s: wait_finish,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::model::{GpuKind, KernelClass};
    use super::*;

    fn h100() -> ComputeModel {
        ComputeModel::preset("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned).unwrap()
    }

    fn input(prefix: u64, new: u64, rate: f64) -> PlanInput {
        PlanInput {
            prefix_tokens: prefix,
            new_tokens: new,
            chunk_tokens: 256,
            kv_bytes_per_token_per_layer: 4096,
            rate,
            h2d_rate: None,
        }
    }

    #[test]
    fn host_to_device_stage_only_adds_and_keeps_the_recompute_guarantee() {
        let m = h100();
        for (prefix, new, rate) in [
            (4096u64, 128u64, 12.5e9),
            (65_536, 8192, 12.5e9),
            (16384, 512, 345e9),
        ] {
            let plain = input(prefix, new, rate);
            let staged = PlanInput {
                h2d_rate: Some(GpuKind::H100.h2d_bytes_per_s()),
                ..plain.clone()
            };
            for k in [256u64, prefix / 2 / 256 * 256, prefix] {
                let a = predicted_ttft(&m, &plain, k);
                let b = predicted_ttft(&m, &staged, k);
                assert!(b >= a - 1e-12, "{prefix} {new} k={k}: {b} < {a}");
            }
            // With an h2d far faster than the link, the copy hides behind the link.
            let instant = PlanInput {
                h2d_rate: Some(1e18),
                ..plain.clone()
            };
            let (a, b) = (
                predicted_ttft(&m, &plain, prefix),
                predicted_ttft(&m, &instant, prefix),
            );
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
            let p = plan(&m, &staged).unwrap();
            assert!(p.predicted_ttft_s <= p.recompute_ttft_s, "{p}");
        }
        // A link faster than the h2d copy: the copy is the bottleneck and loading costs more.
        let fast = input(65_536, 128, 345e9);
        let staged = PlanInput {
            h2d_rate: Some(GpuKind::H100.h2d_bytes_per_s()),
            ..fast.clone()
        };
        assert!(predicted_ttft(&m, &staged, 65_536) > predicted_ttft(&m, &fast, 65_536) * 1.5);
    }

    #[test]
    fn fast_link_loads_everything_slow_link_splits_dead_link_recomputes() {
        let m = h100();
        let fast = plan(&m, &input(16384, 512, 345e9)).unwrap();
        assert_eq!(fast.choice, PlanChoice::LoadAll, "{fast}");
        assert!(fast.predicted_ttft_s < 0.2 * fast.recompute_ttft_s);
        let slow = plan(&m, &input(16384, 512, 3.125e9)).unwrap();
        assert_eq!(slow.choice, PlanChoice::Split, "{slow}");
        assert!(
            slow.predicted_ttft_s < slow.recompute_ttft_s
                && slow.predicted_ttft_s < slow.load_all_ttft_s
        );
        let dead = plan(&m, &input(16384, 512, 1e3)).unwrap();
        assert_eq!(dead.choice, PlanChoice::RecomputeAll, "{dead}");
        assert_eq!(dead.predicted_ttft_s, dead.recompute_ttft_s);
        assert!(dead.to_string().contains("recompute all 16384"));
    }

    #[test]
    fn plan_never_above_recompute_and_never_below_local() {
        let m = h100();
        for prefix in [0u64, 300, 4096, 10_000, 65_536, 131_072] {
            for new in [1u64, 128, 1024, 8192] {
                for rate in [0.0, 1e8, 3.125e9, 12.5e9, 55e9, 1e12] {
                    let p = plan(&m, &input(prefix, new, rate)).unwrap();
                    assert!(
                        p.predicted_ttft_s <= p.recompute_ttft_s,
                        "{prefix} {new} {rate}: {p}"
                    );
                    assert!(
                        p.predicted_ttft_s >= p.local_ttft_s - 1e-12,
                        "{prefix} {new} {rate}: {p}"
                    );
                    assert_eq!(p.load_tokens % 256, 0);
                    assert_eq!(p.load_tokens + p.recompute_tokens, prefix);
                }
            }
        }
        assert!(plan(
            &m,
            &PlanInput {
                chunk_tokens: 0,
                ..input(10, 10, 1.0)
            }
        )
        .is_err());
        assert!(plan(&m, &input(0, 0, 1.0)).is_err());
    }

    #[test]
    fn fallback_recomputes_when_storage_is_stuck_and_waits_when_nearly_done() {
        let m = h100();
        let st = StallState {
            load_tokens: 8192,
            compute_tokens: 512,
            layers_delivered: 1,
            missing_layer_bytes: vec![8192 * 4096; 31],
            frontier_s: 0.01,
            rate: 1e6,
        };
        match fallback(&m, 0.01, &st) {
            Fallback::Recompute {
                from_layer,
                tokens,
                finish_s,
                wait_finish_s,
            } => {
                assert_eq!((from_layer, tokens), (1, 8192));
                assert!(finish_s < wait_finish_s);
            }
            w => panic!("expected recompute, got {w:?}"),
        }
        let nearly = StallState {
            layers_delivered: 31,
            missing_layer_bytes: vec![1000],
            rate: 12.5e9,
            ..st
        };
        assert!(matches!(fallback(&m, 0.01, &nearly), Fallback::Wait { .. }));
    }
}
