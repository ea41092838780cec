//! Per-request timeline: layer `l`'s KV is needed when layer `l`'s compute starts.
//!
//! With per-layer compute times `c_l` and the times `a_l` at which layer `l`'s KV is complete
//! in local memory, layerwise prefill runs
//!
//! ```text
//! start_l = max(end_{l-1}, a_l),   end_l = start_l + c_l,   end_{-1} = t0 (compute ready)
//! ```
//!
//! and the **added TTFT** of a load is `end_{L-1} − (t0 + Σ c_l)`: TTFT with loading minus TTFT
//! with all KV already local and consumed layer by layer (the fixed per-prefill time cancels).
//! Equivalently it is the largest lateness `max_l (a_l − D_l)⁺` of a layer against its nominal
//! deadline `D_l = t0 + Σ_{k<l} c_k`.
//!
//! The **pipeline bound** of a single request is the makespan of the two-stage pipeline where
//! layer `l`'s transfer, at a given rate, must finish before layer `l`'s compute starts
//! ([`pipeline_ttft`]); [`flow_shop_makespan`] generalises it to more stages (for example
//! remote → host memory → GPU → compute).
//!
//! All times are seconds, all sizes bytes, rates bytes per second.
#![forbid(unsafe_code)]

/// Compute schedule of one request: when each layer starts and ends.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// `start[l]`: when layer `l`'s compute starts (s).
    pub start: Vec<f64>,
    /// `end[l]`: when layer `l`'s compute ends (s).
    pub end: Vec<f64>,
}

impl Timeline {
    /// End of the last layer (or `t0` if there are no layers).
    pub fn finish(&self, t0: f64) -> f64 {
        self.end.last().copied().unwrap_or(t0)
    }

    /// Total time the compute waited for KV (s).
    pub fn stall(&self, t0: f64) -> f64 {
        let mut prev = t0;
        let mut s = 0.0;
        for (st, en) in self.start.iter().zip(&self.end) {
            s += (st - prev).max(0.0);
            prev = *en;
        }
        s
    }
}

/// Layerwise consumption: compute of layer `l` starts at `max(end of l−1, ready[l])`.
/// `t0` is when compute could start; `ready` and `compute` are per layer (the shorter length
/// wins if they differ).
pub fn consume(t0: f64, ready: &[f64], compute: &[f64]) -> Timeline {
    let n = ready.len().min(compute.len());
    let mut start = Vec::with_capacity(n);
    let mut end = Vec::with_capacity(n);
    let mut prev = t0;
    for l in 0..n {
        let s = prev.max(ready[l]);
        start.push(s);
        prev = s + compute[l];
        end.push(prev);
    }
    Timeline { start, end }
}

/// End of the last layer's compute under layerwise consumption (no allocation).
pub fn finish_time(t0: f64, ready: &[f64], compute: &[f64]) -> f64 {
    let mut prev = t0;
    for (r, c) in ready.iter().zip(compute) {
        prev = prev.max(*r) + c;
    }
    prev
}

/// Added TTFT (s): layerwise finish with the given KV ready times minus `t0 + Σ compute`.
/// Never negative.
pub fn added_ttft(t0: f64, ready: &[f64], compute: &[f64]) -> f64 {
    let n = ready.len().min(compute.len());
    let local: f64 = compute[..n].iter().sum();
    (finish_time(t0, &ready[..n], &compute[..n]) - t0 - local).max(0.0)
}

/// Ready times of layers sent back to back in layer order at a constant `rate` (bytes/s),
/// starting at `start`: `ready[l] = start + Σ_{k≤l} bytes[k] / rate`. A non-positive or
/// non-finite rate gives `+∞` for every layer with bytes (and `start` for empty layers).
pub fn ready_at_rate(start: f64, layer_bytes: &[u64], rate: f64) -> Vec<f64> {
    let mut acc = 0u64;
    layer_bytes
        .iter()
        .map(|b| {
            acc += b;
            if acc == 0 {
                start
            } else if rate > 0.0 && rate.is_finite() {
                start + acc as f64 / rate
            } else if rate == f64::INFINITY {
                start
            } else {
                f64::INFINITY
            }
        })
        .collect()
}

/// Pipeline bound on TTFT (s) of one request, measured from the request's arrival: layer `l`
/// is transferred at `rate` bytes/s right after layer `l−1`, and its compute starts once it has
/// arrived and layer `l−1`'s compute has ended; plus the fixed per-prefill time `fixed_s`.
pub fn pipeline_ttft(compute: &[f64], layer_bytes: &[u64], rate: f64, fixed_s: f64) -> f64 {
    finish_time(0.0, &ready_at_rate(0.0, layer_bytes, rate), compute) + fixed_s
}

/// Makespan (s) of a permutation flow shop whose jobs are the layers, processed in order by
/// every stage: `stages[s][l]` is stage `s`'s time for layer `l`; layer `l` enters stage `s`
/// when it left stage `s−1` and stage `s` finished layer `l−1`. Use it for multi-hop loads,
/// e.g. `[remote transfer, host-to-device copy, compute]`. Stages of unequal length are cut to
/// the shortest; no stages gives 0.
pub fn flow_shop_makespan(stages: &[Vec<f64>]) -> f64 {
    let Some(n) = stages.iter().map(Vec::len).min() else {
        return 0.0;
    };
    let mut done = vec![0.0f64; stages.len()];
    for l in 0..n {
        let mut prev_stage_end = 0.0f64;
        for (s, stage) in stages.iter().enumerate() {
            let start = prev_stage_end.max(done[s]);
            done[s] = start + stage[l];
            prev_stage_end = done[s];
        }
    }
    done.last().copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_kv_adds_nothing_and_late_layer_shifts_the_rest() {
        let c = [1.0, 1.0, 1.0];
        assert_eq!(added_ttft(0.0, &[0.0, 0.0, 0.0], &c), 0.0);
        // Layer 1 arrives at 3.0 instead of 1.0: compute shifts by 2.
        assert!((added_ttft(0.0, &[0.0, 3.0, 0.0], &c) - 2.0).abs() < 1e-12);
        // Two late layers: the larger lateness counts (not the sum).
        assert!((added_ttft(0.0, &[0.5, 2.0, 3.5], &c) - 1.5).abs() < 1e-12);
        let t = consume(0.0, &[0.5, 2.0, 3.5], &c);
        assert!((t.stall(0.0) - 1.5).abs() < 1e-12);
        assert_eq!(t.finish(0.0), 4.5);
    }

    #[test]
    fn pipeline_bound_transfer_and_compute_bound() {
        // Compute bound: 1 s per layer compute, 0.1 s per layer transfer.
        let t = pipeline_ttft(&[1.0; 4], &[10; 4], 100.0, 0.0);
        assert!((t - 4.1).abs() < 1e-12);
        // Transfer bound: 1 s per layer transfer, 0.1 s compute.
        let t = pipeline_ttft(&[0.1; 4], &[100; 4], 100.0, 0.5);
        assert!((t - 4.6).abs() < 1e-12);
        // Three-stage flow shop reduces to the two-stage pipeline when the middle stage is 0.
        let fs = flow_shop_makespan(&[vec![1.0; 4], vec![0.0; 4], vec![0.1; 4]]);
        assert!((fs - 4.1).abs() < 1e-12);
        let fs = flow_shop_makespan(&[vec![0.1; 4], vec![0.5; 4], vec![0.2; 4]]);
        assert!((fs - (0.1 + 4.0 * 0.5 + 0.2)).abs() < 1e-12);
    }

    #[test]
    fn zero_rate_never_arrives() {
        let r = ready_at_rate(0.0, &[0, 5], 0.0);
        assert_eq!(r[0], 0.0);
        assert!(r[1].is_infinite());
    }
}
