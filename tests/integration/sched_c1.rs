//! Case C1 (cases README): a store slower than recomputing.
//!
//! Llama-3.1-8B geometry, 32 concurrent requests each hitting a 10K-token cached prefix, the
//! storage cap set so that loading all of them takes about 3x longer than recomputing one
//! (modeled H100 compute). Need: every TTFT at most its recompute TTFT (within 5%); the planner
//! loads only what pays, or nothing; the report says which it chose and why.

use objectcache::layout::KvGeometry;
use objectcache::sched::{
    plan, ComputeModel, GpuKind, KernelClass, PlanChoice, PlanInput, PolicyKind,
};
use objectcache::sim::{simulate, workload, Outcome, SimConfig, SimPolicy, Summary};

const N: usize = 32;
const PREFIX: u64 = 10_000;
const NEW: u64 = 256;

fn setup() -> (SimConfig, workload::Workload) {
    let g = KvGeometry::llama31_8b();
    let model = ComputeModel::preset("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned).unwrap();
    let kv = g.bytes_per_token_per_layer();
    let cap = objectcache::cli::sim::c1_cap(&model, kv, N, PREFIX, NEW);
    let cfg = SimConfig {
        model,
        kv_bytes_per_token_per_layer: kv,
        chunk_tokens: g.tokens_per_chunk as u64,
        capacity: cap,
        max_rate_per_load: f64::INFINITY,
    };
    (cfg, workload::c1(N, PREFIX, NEW))
}

/// C1 simulated under `kind` with every prefix loaded in full (no planner): each request's
/// outcome, and the recompute TTFT.
fn full_loads(kind: PolicyKind) -> (Vec<Outcome>, f64) {
    let (cfg, w) = setup();
    let o = simulate(
        &w,
        &cfg,
        SimPolicy {
            kind,
            planner: false,
        },
    )
    .unwrap();
    (o, cfg.model.recompute_time(PREFIX, NEW))
}

/// The slowest TTFT of `o`, seconds.
fn worst_ttft(o: &[Outcome]) -> f64 {
    o.iter().map(|x| x.ttft_s).fold(0.0, f64::max)
}

#[test]
fn c1_setup_loading_everything_takes_about_3x_recompute() {
    // Equal sharing with full loads: every request waits for the whole link's worth.
    let (o, recompute) = full_loads(PolicyKind::EqualShare);
    let worst = worst_ttft(&o);
    let ratio = worst / recompute;
    println!("C1: recompute TTFT {recompute:.3} s, equal share loading everything: worst TTFT {worst:.3} s ({ratio:.2}x)");
    assert!(
        (2.7..3.3).contains(&ratio),
        "setup should make full loading ~3x recompute, got {ratio:.2}x"
    );
}

#[test]
fn c1_every_ttft_within_5_percent_of_recompute_with_the_planner() {
    let (cfg, w) = setup();
    let recompute = cfg.model.recompute_time(PREFIX, NEW);
    // What the planner chooses for one request at its fair share, and why.
    let p = plan(
        &cfg.model,
        &PlanInput {
            prefix_tokens: PREFIX,
            new_tokens: NEW,
            chunk_tokens: cfg.chunk_tokens,
            kv_bytes_per_token_per_layer: cfg.kv_bytes_per_token_per_layer,
            rate: cfg.capacity / N as f64,
            h2d_rate: None,
        },
    )
    .unwrap();
    println!("C1 planner at the fair share: {p}");
    assert!(p.predicted_ttft_s <= p.recompute_ttft_s);
    assert_ne!(
        p.choice,
        PlanChoice::LoadAll,
        "loading everything does not pay here: {p}"
    );
    for kind in [PolicyKind::StallAware, PolicyKind::EqualShare] {
        let pol = SimPolicy {
            kind,
            planner: true,
        };
        let o = simulate(&w, &cfg, pol).unwrap();
        let s = Summary::of(&o);
        println!(
            "C1 {}: mean TTFT {:.3} s, worst {:.3} s, recompute {recompute:.3} s, loaded {:.0}% of the prefix tokens, {} fallbacks",
            pol.name(),
            s.mean_ttft_s,
            worst_ttft(&o),
            s.loaded_fraction * 100.0,
            s.fallbacks
        );
        for (i, x) in o.iter().enumerate() {
            assert!(
                x.ttft_s <= 1.05 * recompute,
                "{}: request {i} TTFT {:.3} s > 1.05 x recompute {recompute:.3} s",
                pol.name(),
                x.ttft_s
            );
            assert!(x.load_tokens <= PREFIX && x.load_tokens % cfg.chunk_tokens == 0);
        }
    }
}

#[test]
fn c1_without_the_planner_the_fault_shows() {
    // The same setup with every prefix loaded in full is the reported fault: a hit slower than
    // recomputing. The scheduler alone cannot fix it (the bytes must move).
    let (o, recompute) = full_loads(PolicyKind::StallAware);
    assert!(o.iter().any(|x| x.ttft_s > 2.0 * recompute));
}
