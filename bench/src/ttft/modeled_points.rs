//! `ttft --mode modeled`, the records of each point: the modeled TTFT of every method at one
//! (model, GPU, context, new tokens) from its measured loads scaled to the link, its
//! per-layer timeline for the plot, and the concurrency records from the simulator.

use super::modeled_plan::{compute_model, Plan, PointLoads};
use super::modeled_record::{Modeled, Record};
use anyhow::{anyhow, Result};
use objectcache::layout::KvGeometry;
use objectcache::sched::model::GpuKind;
use objectcache::sched::planner::{self, PlanInput};
use objectcache::sched::{timeline, ComputeModel};
use objectcache::sim::{self, Instance, Request, SimConfig, Workload};

/// Per-layer GPU arrival with a pipelined host-to-device copy.
fn to_gpu(host_ready: &[f64], h2d_layer_s: f64) -> Vec<f64> {
    let mut prev = 0.0f64;
    host_ready
        .iter()
        .map(|a| {
            prev = prev.max(*a) + h2d_layer_s;
            prev
        })
        .collect()
}

fn model_request(host_ready: &[f64], h2d_layer_s: f64, compute: &[f64], fixed: f64) -> Modeled {
    let gpu_ready = to_gpu(host_ready, h2d_layer_s);
    let tl = timeline::consume(0.0, &gpu_ready, compute);
    Modeled {
        ttft_s: tl.finish(0.0) + fixed,
        timeline: tl,
    }
}

struct Ctx<'a> {
    plan: &'a Plan,
    g: &'a KvGeometry,
    gpu: GpuKind,
    ctx_tokens: u64,
    pl: &'a PointLoads,
}

impl Ctx<'_> {
    fn bpt(&self) -> u64 {
        self.g.bytes_per_token_per_layer()
    }
    fn layer_bytes(&self) -> u64 {
        self.ctx_tokens * self.bpt()
    }
    fn prefix_bytes(&self) -> u64 {
        self.layer_bytes() * self.g.layers as u64
    }
    fn h2d_layer_s(&self, tokens: u64) -> f64 {
        (tokens * self.bpt()) as f64 / self.gpu.h2d_bytes_per_s()
    }
    fn measured_bytes(&self) -> u64 {
        self.pl.chunks_measured as u64 * self.g.slice_bytes() * self.g.layers as u64
    }
    fn time_scale(&self) -> f64 {
        self.prefix_bytes() as f64 / self.measured_bytes() as f64 * self.plan.cap / self.plan.link
    }
}

fn ctx_tokens(g: &KvGeometry, pl: &PointLoads) -> u64 {
    pl.chunks_full as u64 * g.tokens_per_chunk as u64
}

/// One point of the modeled grid: a model geometry on one GPU kind, a cached prefix (its
/// measured loads, `pl`) and `new` tokens prefilled after it, under `plan`.
pub(super) struct Point<'a> {
    pub plan: &'a Plan,
    /// The model's name (`llama-3.1-8b`, ...).
    pub model: &'a str,
    pub g: &'a KvGeometry,
    pub gpu: GpuKind,
    /// The compute model of `model` on `gpu`.
    pub cm: &'a ComputeModel,
    /// New tokens, after the cached prefix.
    pub new: u64,
    pub pl: &'a PointLoads,
}

impl<'a> Point<'a> {
    /// The point's link and token figures.
    fn ctx(&self) -> Ctx<'a> {
        Ctx {
            plan: self.plan,
            g: self.g,
            gpu: self.gpu,
            ctx_tokens: ctx_tokens(self.g, self.pl),
            pl: self.pl,
        }
    }
}

/// The per-layer timeline of the point's local and loaded methods, for the plot.
pub(super) fn timeline_plot(p: &Point<'_>) -> Option<super::modeled_plot::TimelinePlot> {
    let (c, cm, layers) = (p.ctx(), p.cm, p.g.layers as usize);
    let compute = cm.layer_times(p.new, c.ctx_tokens);
    let s = c.time_scale();
    let h2d = c.h2d_layer_s(c.ctx_tokens);
    let mut series = Vec::new();
    let local = model_request(&vec![0.0; layers], h2d, &compute, cm.fixed_s());
    series.push(("local-layerwise".to_string(), vec![0.0; layers], local));
    for (name, m, _) in &p.pl.loads {
        if name == "gather-tcp" || name == "s3-layerwise" {
            let host: Vec<f64> = m.ready_s.iter().map(|r| r * s).collect();
            let md = model_request(&host, h2d, &compute, cm.fixed_s());
            series.push((name.clone(), host, md));
        }
    }
    Some(super::modeled_plot::TimelinePlot {
        title: format!(
            "{}, {} cached + {} new tokens, {}, link {:.0} Gb/s",
            p.model,
            c.ctx_tokens,
            p.new,
            p.gpu.name(),
            p.plan.link * 8.0 / 1e9
        ),
        bound_ready: timeline::ready_at_rate(0.0, &vec![c.layer_bytes(); layers], p.plan.link),
        series,
    })
}

/// The point's records: the modeled TTFT of every method, and the concurrency records.
pub(super) fn point_records(p: &Point<'_>) -> Result<Vec<Record>> {
    let Point {
        plan,
        model,
        g,
        gpu,
        cm,
        new,
        pl,
    } = *p;
    let c = p.ctx();
    let layers = g.layers as usize;
    let compute = cm.layer_times(new, c.ctx_tokens);
    let fixed = cm.fixed_s();
    let h2d = c.h2d_layer_s(c.ctx_tokens);
    let s = c.time_scale();
    let link_bytes = vec![c.layer_bytes(); layers];
    let bound = timeline::pipeline_ttft(&compute, &link_bytes, plan.link, fixed);
    let xfer_stage = vec![c.layer_bytes() as f64 / plan.link; layers];
    let bound_h2d =
        timeline::flow_shop_makespan(&[xfer_stage, vec![h2d; layers], compute.clone()]) + fixed;
    let local = model_request(&vec![0.0; layers], h2d, &compute, fixed).ttft_s;
    let recompute = cm.recompute_time(c.ctx_tokens, new);
    let pure = c.prefix_bytes() as f64 / plan.link;
    let base =
        |method: &str, ttft: f64, transfer: f64, loaded: u64, measured_s: f64, note: String| {
            let added = ttft - local;
            Record {
                method: method.into(),
                model: model.into(),
                gpu: gpu.name().into(),
                context_tokens: c.ctx_tokens,
                new_tokens: new,
                concurrency: 1,
                policy: "single".into(),
                ttft_s: ttft,
                added_ttft_s: added,
                added_ttft_pct: added / local * 100.0,
                transfer_time_s: transfer,
                bound_ttft_s: Some(bound),
                bound_h2d_ttft_s: Some(bound_h2d),
                ttft_over_bound: Some(ttft / bound),
                local_ttft_s: local,
                recompute_ttft_s: recompute,
                pure_transfer_s: pure,
                added_over_pure_transfer: added / pure,
                loaded_tokens: loaded,
                prefix_bytes: c.prefix_bytes(),
                measured_bytes: c.measured_bytes(),
                measured_load_s: measured_s,
                time_scale: s,
                link_bytes_per_s: plan.link,
                loopback_cap_bytes_per_s: plan.cap,
                h2d_bytes_per_s: gpu.h2d_bytes_per_s(),
                kernels: format!("{:?}", plan.kernels).to_lowercase(),
                tp: g.tp_world,
                p99_ttft_s: None,
                note,
            }
        };
    let mut out = vec![base(
        "local-layerwise",
        local,
        0.0,
        c.ctx_tokens,
        0.0,
        "prefix KV in host memory, copied per layer at the h2d rate".into(),
    )];
    let mut gather_host: Option<Vec<f64>> = None;
    for (name, m, _) in &pl.loads {
        let host: Vec<f64> = m.ready_s.iter().map(|r| r * s).collect();
        let md = model_request(&host, h2d, &compute, fixed);
        let transfer = host.iter().copied().fold(0.0, f64::max);
        let note = match name.as_str() {
            "gather-tcp" => format!(
                "connector engine, gather over TCP, {} request(s)",
                m.requests
            ),
            "s3-layerwise" => format!(
                "connector engine, ranged GETs in layer order, {} requests",
                m.requests
            ),
            "chunkwise" => format!(
                "{} whole-object GETs, 16 in flight; compute after the last",
                m.requests
            ),
            "nixl-obj" => pl.nixl_note.clone().unwrap_or_default(),
            _ => String::new(),
        };
        out.push(base(
            name,
            md.ttft_s,
            transfer,
            c.ctx_tokens,
            m.last(),
            note,
        ));
        if name == "gather-tcp" {
            gather_host = Some(host);
        }
    }
    if let Some(gh) = gather_host {
        let transfer = gh.iter().copied().fold(0.0, f64::max);
        let rate = c.prefix_bytes() as f64 / transfer;
        let p = planner::plan(
            cm,
            &PlanInput {
                prefix_tokens: c.ctx_tokens,
                new_tokens: new,
                chunk_tokens: g.tokens_per_chunk as u64,
                kv_bytes_per_token_per_layer: c.bpt(),
                rate,
                h2d_rate: Some(c.gpu.h2d_bytes_per_s()),
            },
        )
        .map_err(|e| anyhow!("planner: {e}"))?;
        let k = p.load_tokens;
        let (ttft, tr) = if k == 0 {
            (recompute, 0.0)
        } else {
            let f = k as f64 / c.ctx_tokens as f64;
            let host: Vec<f64> = gh.iter().map(|t| t * f).collect();
            let comp = cm.layer_times(c.ctx_tokens - k + new, k);
            (
                model_request(&host, c.h2d_layer_s(k), &comp, fixed).ttft_s,
                transfer * f,
            )
        };
        out.push(base(
            "gather-tcp+planner",
            ttft,
            tr,
            k,
            0.0,
            format!(
                "planner at the measured gather rate {:.2} GB/s: {p}",
                rate / 1e9
            ),
        ));
    }
    out.push(base(
        "recompute",
        recompute,
        0.0,
        0,
        0.0,
        "full prefill of prefix + new tokens (compute model)".into(),
    ));
    Ok(out)
}

pub(super) fn concurrent_records(
    plan: &Plan,
    model: &str,
    g: &KvGeometry,
    points: &[(u64, PointLoads)],
) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    if plan.concurrency.is_empty() || plan.policies.is_empty() {
        return Ok(out);
    }
    // The gather path's efficiency against the loopback cap, at the largest measured point.
    let Some((_, pl)) = points.iter().max_by_key(|(_, p)| p.chunks_measured) else {
        return Ok(out);
    };
    let Some((_, m, n)) = pl.loads.iter().find(|(name, _, _)| name == "gather-tcp") else {
        return Ok(out);
    };
    let real_bytes = *n as u64 * g.slice_bytes() * g.layers as u64;
    let eff = (real_bytes as f64 / m.last() / plan.cap).min(1.0);
    let capacity = plan.link * eff;
    let gpu = plan.gpus[0];
    let cm = compute_model(model, g, gpu, plan.kernels)?;
    let new = if plan.new_tokens.contains(&1024) {
        1024
    } else {
        plan.new_tokens[0]
    };
    for &conc in &plan.concurrency {
        let reqs: Vec<Request> = (0..conc)
            .map(|i| Request {
                arrival_s: 0.0,
                prefix_tokens: points[i % points.len()].1.chunks_full as u64
                    * g.tokens_per_chunk as u64,
                new_tokens: new,
            })
            .collect();
        let mean_ctx = reqs.iter().map(|r| r.prefix_tokens).sum::<u64>() / conc as u64;
        let wl = Workload {
            name: format!("burst-{conc}"),
            concurrency: conc,
            instances: vec![Instance {
                requests: reqs.clone(),
            }],
        };
        let cfg = SimConfig {
            model: cm.clone(),
            kv_bytes_per_token_per_layer: g.bytes_per_token_per_layer(),
            chunk_tokens: g.tokens_per_chunk as u64,
            capacity,
            max_rate_per_load: f64::INFINITY,
        };
        let spec = sim::RunSpec {
            workload: &wl,
            config: &cfg,
            cap_fraction: eff,
            policies: &plan.policies,
            model,
            gpu: gpu.name(),
            seed: 0,
            bound_max_states: 0,
        };
        let local: f64 = reqs
            .iter()
            .map(|r| cm.prefill_time(r.new_tokens, r.prefix_tokens))
            .sum::<f64>()
            / conc as f64;
        let pure: f64 = reqs
            .iter()
            .map(|r| (r.prefix_tokens * g.bytes_per_token_per_layer() * g.layers as u64) as f64)
            .sum::<f64>()
            / plan.link;
        let recs = sim::run(&spec).map_err(|e| anyhow!("simulator: {e}"))?;
        for (r, pol) in recs.into_iter().zip(&plan.policies) {
            let outs = sim::simulate(&wl, &cfg, *pol).map_err(|e| anyhow!("simulator: {e}"))?;
            let transfer = outs.iter().map(|o| o.load_end_s - o.arrival_s).sum::<f64>()
                / outs.len().max(1) as f64;
            out.push(Record {
                method: "gather-tcp".into(),
                model: model.into(),
                gpu: gpu.name().into(),
                context_tokens: mean_ctx,
                new_tokens: new,
                concurrency: conc,
                policy: r.policy.clone(),
                ttft_s: r.summary.mean_ttft_s,
                added_ttft_s: r.summary.mean_added_ttft_s,
                added_ttft_pct: r.summary.mean_added_ttft_s / local * 100.0,
                transfer_time_s: transfer,
                bound_ttft_s: None,
                bound_h2d_ttft_s: None,
                ttft_over_bound: None,
                local_ttft_s: local,
                recompute_ttft_s: r.summary.mean_recompute_ttft_s,
                pure_transfer_s: pure,
                added_over_pure_transfer: r.summary.mean_added_ttft_s / pure,
                loaded_tokens: (r.summary.loaded_fraction * reqs.iter().map(|x| x.prefix_tokens).sum::<u64>() as f64) as u64,
                prefix_bytes: (pure * plan.link) as u64,
                measured_bytes: real_bytes,
                measured_load_s: m.last(),
                time_scale: f64::NAN,
                link_bytes_per_s: plan.link,
                loopback_cap_bytes_per_s: plan.cap,
                h2d_bytes_per_s: gpu.h2d_bytes_per_s(),
                kernels: format!("{:?}", plan.kernels).to_lowercase(),
                tp: g.tp_world,
                p99_ttft_s: Some(r.summary.p99_ttft_s),
                note: format!(
                    "simulator: burst of {conc} loads (prefixes cycling over the grid's contexts), link at the measured gather efficiency {:.1}% of the cap; no h2d stage; added TTFT over all KV on the GPU",
                    eff * 100.0
                ),
            });
        }
    }
    Ok(out)
}
