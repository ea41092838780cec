//! The small accuracy mix of the link-scheduler tests (server gather path in
//! `sched_loopback.rs`, client ranged-GET path in `sched_client_loopback.rs`): four requests
//! under a 40 MB/s cap, their compute model and hints, and the simulator's prediction.
#![allow(dead_code)]

use objectcache::layout::KvGeometry;
use objectcache::sched::{
    AnalyticModel, ComputeModel, GpuKind, KernelClass, MeasuredModel, ModelShape, PolicyKind,
};
use objectcache::sim::{simulate_instance, Instance, Request, SimConfig, SimPolicy};

/// Link cap shared by the loads, bytes/s.
pub const CAP: f64 = 40e6;

/// The mix: (prefix tokens, new tokens) per request, all arriving together.
pub const MIX: [(u32, u64); 4] = [(512, 256), (1024, 128), (2048, 512), (3072, 256)];

/// The compute model of the mix: SmolLM2-135M's 30 layers at 30 ms per layer for 256 new
/// tokens after 1,024 cached ones, scaled to other points by the analytic model (so compute
/// and transfer are of the same order under the cap, and the policies differ).
pub fn model() -> ComputeModel {
    let scale = AnalyticModel::new(
        ModelShape::preset("smollm2-135m").unwrap(),
        GpuKind::H100,
        KernelClass::Tuned,
        1,
    )
    .unwrap();
    ComputeModel::Measured(MeasuredModel::new(vec![0.030; 30], 0.0, 256, 1024, scale).unwrap())
}

/// Hinted per-layer compute of a request (µs, as sent) and the same in seconds.
pub fn compute_hint(m: &ComputeModel, prefix: u32, new: u64) -> (Vec<u32>, Vec<f64>) {
    let us: Vec<u32> = m
        .layer_times(new, prefix as u64)
        .iter()
        .map(|s| (s * 1e6).round() as u32)
        .collect();
    let s = us.iter().map(|&u| u as f64 * 1e-6).collect();
    (us, s)
}

/// The simulator's added TTFT (s) of each request of [`MIX`] under `kind` and [`CAP`].
pub fn predict(g: &KvGeometry, kind: PolicyKind) -> Vec<f64> {
    let inst = Instance {
        requests: MIX
            .iter()
            .map(|&(prefix, new)| Request {
                arrival_s: 0.0,
                prefix_tokens: prefix as u64,
                new_tokens: new,
            })
            .collect(),
    };
    let cfg = SimConfig {
        model: model(),
        kv_bytes_per_token_per_layer: g.bytes_per_token_per_layer(),
        chunk_tokens: g.tokens_per_chunk as u64,
        capacity: CAP,
        max_rate_per_load: f64::INFINITY,
    };
    simulate_instance(
        &inst,
        &cfg,
        SimPolicy {
            kind,
            planner: false,
        },
    )
    .unwrap()
    .iter()
    .map(|o| o.added_ttft_s)
    .collect()
}

pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Prints the measured and predicted added TTFT of `path` under `scheduler` and checks that
/// their means agree within 15% (the accuracy goal of issue 4).
///
/// # Panics
/// If the prediction has no stall (the mix would not test the policy) or the means differ
/// by more than 15% of the prediction.
pub fn compare(path: &str, scheduler: &str, measured: &[f64], predicted: &[f64]) {
    let (mm, mp) = (mean(measured), mean(predicted));
    println!(
        "{path}, {scheduler} at {:.0} MB/s: mean added TTFT measured {mm:.3} s, simulator \
         {mp:.3} s ({:+.1}%); per request measured {measured:.3?} predicted {predicted:.3?}",
        CAP / 1e6,
        (mm / mp - 1.0) * 100.0
    );
    assert!(mp > 0.0, "the mix must stall under the cap");
    assert!(
        (mm - mp).abs() <= 0.15 * mp,
        "{path}, {scheduler}: measured mean added TTFT {mm:.3} s vs predicted {mp:.3} s"
    );
}
