//! `ttft --mode modeled`: the paper's GPU experiments, with real bytes over loopback and the
//! GPU's compute from the project's compute model.
//!
//! # What is measured and what is modeled
//! - **Measured**: real chunk objects (pseudo-random KV, the model's rank-0 geometry) are saved
//!   to an ObjectCache server started in this process, then loaded through a loopback proxy
//!   capped at `--loopback-cap-mb-s` ([`super::modeled_link`]) over each path: `gather-tcp`
//!   (the connector's engine, gather on), `s3-layerwise` (the engine's ranged GETs, gather off),
//!   `chunkwise` (one whole-object GET per chunk, 16 in flight), `nixl-obj` (NIXL's OBJ plugin,
//!   whole objects). Every loaded byte is compared with the saved bytes.
//! - **Scaling**: a load moves at most `--max-load-mib` of real bytes (the prefix's first
//!   chunks); its per-layer landing times are multiplied by the time scale
//!   `s = (B_full / B_measured) x (cap_loopback / link)`, so the modeled transfer moves the
//!   full prefix's bytes `B_full` over a `--link-gbps` link at exactly the rate the capped
//!   loopback gave to the measured bytes (a path at 90% of the loopback cap runs at 90% of the
//!   link).
//! - **Modeled**: per-layer prefill time from `objectcache::sched::model` (Llama-3.1-8B on
//!   one GPU, 70B at TP 8 with rank-0 KV), the host-to-device copy at
//!   `GpuKind::h2d_bytes_per_s` (H100 56.7 GB/s, H200 55 GB/s), pipelined per layer: layer
//!   `l` reaches the GPU at `g_l = max(a_l, g_{l-1}) + bytes_l / h2d`, and its compute starts at
//!   `max(g_l, end_{l-1})` (`sched::timeline::finish_time`), plus the fixed per-prefill time.
//!   `local-layerwise` has every `a_l = 0`; `recompute` prefills prefix + new tokens.
//! - **Bound**: `bound_ttft_s` is the two-stage pipeline bound
//!   (`timeline::pipeline_ttft` at the link rate); `bound_h2d_ttft_s` adds the host-to-device
//!   stage (`timeline::flow_shop_makespan`).
//! - **Planner**: `gather-tcp+planner` asks `sched::planner::plan` how many prefix tokens to
//!   load at the measured gather rate and recomputes the rest; its load is the gather load's
//!   landing times scaled by the loaded fraction.
//! - **Concurrency**: records with `concurrency > 1` come from the simulator
//!   (`objectcache::sim`), bursts of 8B loads sharing the link at the measured gather rate,
//!   one record per scheduling policy (server-side policies are not driven here).

use super::modeled_link as link;
use super::modeled_nixl as nixl;
use super::modeled_record::{Modeled, Record};
use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use objectcache::layout::KvGeometry;
use objectcache::sched::model::{AnalyticModel, GpuKind, KernelClass, ModelShape};
use objectcache::sched::planner::{self, PlanInput};
use objectcache::sched::{timeline, ComputeModel};
use objectcache::sim::{self, Instance, Request, SimConfig, SimPolicy, Workload};
use objectcache::store::StoreExt;
use serde::Serialize;
use std::path::PathBuf;

/// Options of `--mode modeled`.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct ModeledArgs {
    /// [modeled] Model geometries (comma-separated): llama-3.1-8b, llama-3.1-70b-tp8 (rank 0
    /// of TP 8). The default grid (both models, 4 contexts, 3 new-token counts, 2 GPUs, 3
    /// runs per path) takes about 3 minutes on 2 cores; `--quick` about 15 s.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "llama-3.1-8b,llama-3.1-70b-tp8"
    )]
    pub models: Vec<String>,
    /// [modeled] Cached prefix lengths in tokens (rounded down to whole 256-token chunks).
    #[arg(long, value_delimiter = ',', default_value = "4096,16384,65536,131072")]
    pub contexts: Vec<u64>,
    /// [modeled] New tokens prefilled after the prefix.
    #[arg(long, value_delimiter = ',', default_value = "128,1024,8192")]
    pub new_tokens: Vec<u64>,
    /// [modeled] GPU kinds of the compute model (h100, h200, a100, gh200).
    #[arg(long, value_delimiter = ',', default_value = "h100,h200")]
    pub gpu: Vec<String>,
    /// [modeled] Kernel class of the compute model: tuned (FA3/cuDNN class) or fa2.
    #[arg(long, default_value = "tuned")]
    pub kernels: String,
    /// [modeled] One small point: llama-3.1-8b, 4K and 64K, 1K and 8K new tokens, H100, one
    /// run per path, concurrency 4 only (about 20 s on 2 cores).
    #[arg(long)]
    pub quick: bool,
    /// [modeled] Modeled storage link, Gb/s (the paper's 100 Gb/s NIC).
    #[arg(long, value_name = "GBPS", default_value_t = 100.0)]
    pub link_gbps: f64,
    /// [modeled] Real cap of the loopback proxy every load crosses, MB/s (10^6 bytes/s).
    #[arg(long, value_name = "MB_S", default_value_t = 250.0)]
    pub loopback_cap_mb_s: f64,
    /// [modeled] Real bytes moved per load at most, MiB (the prefix's first chunks; the time
    /// scale covers the rest).
    #[arg(long, value_name = "MIB", default_value_t = 256)]
    pub max_load_mib: u64,
    /// [modeled] Concurrency levels of the simulated multi-load records (8B prefixes).
    #[arg(long, value_delimiter = ',', default_value = "4,16")]
    pub concurrency: Vec<usize>,
    /// [modeled] Scheduling policies of the concurrent records.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fifo,equal-share,byte-proportional,stall-aware,stall-aware+planner"
    )]
    pub policies: Vec<String>,
    /// [modeled] A Python virtual environment with nixl-cu12 and numpy: adds the `nixl-obj`
    /// method (NIXL's own OBJ plugin reading the same objects over S3).
    #[arg(long, value_name = "DIR", env = "OBJECTCACHE_NIXL_VENV")]
    pub nixl_venv: Option<PathBuf>,
    /// [modeled] Write SVG plots (TTFT per method and context; per-layer timeline) here.
    #[arg(long, value_name = "DIR")]
    pub svg: Option<PathBuf>,
}

/// The measured loads of one (model, context): median runs per method.
#[derive(Debug, Clone)]
struct PointLoads {
    chunks_full: usize,
    chunks_measured: usize,
    loads: Vec<(String, link::Measured, usize)>,
    nixl_note: Option<String>,
}

fn median_run(mut runs: Vec<link::Measured>) -> link::Measured {
    runs.sort_by(|a, b| a.last().total_cmp(&b.last()));
    runs.swap_remove(runs.len() / 2)
}

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

/// Resolved configuration after `--quick` and parsing.
struct Plan {
    models: Vec<String>,
    contexts: Vec<u64>,
    new_tokens: Vec<u64>,
    gpus: Vec<GpuKind>,
    kernels: KernelClass,
    concurrency: Vec<usize>,
    policies: Vec<SimPolicy>,
    runs: usize,
    link: f64,
    cap: f64,
    max_load: u64,
}

fn resolve(a: &ModeledArgs, runs: usize) -> Result<Plan> {
    let mut p = Plan {
        models: a.models.clone(),
        contexts: a.contexts.clone(),
        new_tokens: a.new_tokens.clone(),
        gpus: a
            .gpu
            .iter()
            .map(|g| GpuKind::parse(g).map_err(|e| anyhow!("--gpu: {e}")))
            .collect::<Result<_>>()?,
        kernels: KernelClass::parse(&a.kernels).map_err(|e| anyhow!("--kernels: {e}"))?,
        concurrency: a.concurrency.clone(),
        policies: a
            .policies
            .iter()
            .map(|p| SimPolicy::parse(p).map_err(|e| anyhow!("--policies: {e}")))
            .collect::<Result<_>>()?,
        runs: runs.max(1),
        link: a.link_gbps * 1e9 / 8.0,
        cap: a.loopback_cap_mb_s * 1e6,
        max_load: a.max_load_mib << 20,
    };
    if a.quick {
        p.models = vec!["llama-3.1-8b".into()];
        p.contexts = vec![4096, 65536];
        p.new_tokens = vec![1024, 8192];
        p.gpus = vec![GpuKind::H100];
        p.concurrency = vec![4];
        p.runs = 1;
    }
    if p.models.is_empty() || p.contexts.is_empty() || p.new_tokens.is_empty() || p.gpus.is_empty()
    {
        bail!("--models, --contexts, --new-tokens and --gpu each need at least one value");
    }
    if !(p.link > 0.0 && p.link.is_finite()) {
        bail!("--link-gbps must be a positive number, got {}", a.link_gbps);
    }
    if !(p.cap > 0.0 && p.cap.is_finite()) {
        bail!(
            "--loopback-cap-mb-s must be a positive number, got {}",
            a.loopback_cap_mb_s
        );
    }
    if p.max_load == 0 {
        bail!("--max-load-mib must be at least 1");
    }
    if p.concurrency.iter().any(|&c| c < 2) {
        bail!("--concurrency values must be at least 2 (single requests are always reported)");
    }
    Ok(p)
}

fn compute_model(
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

/// Runs `--mode modeled`.
///
/// # Errors
/// Bad arguments, the in-process server, a failed or corrupt load.
pub fn run(a: &ModeledArgs, runs: usize, json: Option<&std::path::Path>) -> Result<()> {
    let plan = resolve(a, runs)?;
    let python = match &a.nixl_venv {
        Some(v) => Some(nixl::python_of(v)?),
        None => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let lk = rt.block_on(link::start(plan.cap))?;
    let store = rt.block_on(link::s3_store(&lk))?;
    let eng_gather = link::engine(store.clone(), true)?;
    let eng_ranged = link::engine(store.clone(), false)?;
    eprintln!(
        "modeled TTFT: link {:.0} Gb/s = {:.2} GB/s; real loopback cap {:.0} MB/s through a proxy; at most {} MiB real bytes per load; {} run(s) per path",
        a.link_gbps,
        plan.link / 1e9,
        plan.cap / 1e6,
        plan.max_load >> 20,
        plan.runs
    );
    let mut records = Vec::new();
    let mut nixl_notes: Vec<String> = Vec::new();
    let mut timeline_svg: Option<super::modeled_plot::TimelinePlot> = None;
    for (mi, model) in plan.models.iter().enumerate() {
        let g = KvGeometry::preset(model).map_err(|e| anyhow!("--models: {e}"))?;
        let object_bytes = g.slice_bytes() * g.layers as u64;
        let per_load_chunks = ((plan.max_load / object_bytes) as usize).max(1);
        let chunk_counts: Vec<usize> = plan
            .contexts
            .iter()
            .map(|&c| (c / g.tokens_per_chunk as u64) as usize)
            .collect();
        if let Some(i) = chunk_counts.iter().position(|&n| n == 0) {
            bail!(
                "--contexts {}: less than one {}-token chunk",
                plan.contexts[i],
                g.tokens_per_chunk
            );
        }
        let save_chunks = chunk_counts
            .iter()
            .map(|&n| n.min(per_load_chunks))
            .max()
            .unwrap_or(1);
        let hs = link::hashes(save_chunks, 0x6d6f_6465_6c00 + mi as u64);
        let data = link::layer_data(&g, save_chunks, mi as u64 + 1);
        let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
        eprintln!(
            "{model}: saving {save_chunks} chunk objects of {:.1} MiB ({} MiB) to the in-process server",
            object_bytes as f64 / (1 << 20) as f64,
            (save_chunks as u64 * object_bytes) >> 20
        );
        eng_gather
            .save_blocking(&g, &hs, &refs)
            .map_err(|e| anyhow!("saving {model}'s chunks: {e}"))?;
        let kb = eng_gather.keys(&g).map_err(|e| anyhow!("{e}"))?;
        // One untimed load per engine: connection set-up and the gather probe are not part
        // of a steady-state load.
        for eng in [&eng_gather, &eng_ranged] {
            link::engine_load(eng, &g, &hs[..1], &data).context("warm-up load")?;
        }
        let methods = 3 + usize::from(python.is_some());
        let pb = ProgressBar::new((plan.contexts.len() * methods * plan.runs) as u64);
        pb.set_style(
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} loads {msg}")
                .expect("template")
                .progress_chars("=> "),
        );
        pb.set_prefix(model.clone());
        let mut points = Vec::new();
        for (&ctx, &chunks_full) in plan.contexts.iter().zip(&chunk_counts) {
            let n = chunks_full.min(per_load_chunks);
            let h = &hs[..n];
            let mut loads = Vec::new();
            for (name, eng) in [("gather-tcp", &eng_gather), ("s3-layerwise", &eng_ranged)] {
                let mut rs = Vec::new();
                for _ in 0..plan.runs {
                    pb.set_message(format!("{ctx} tokens, {name}"));
                    rs.push(
                        link::engine_load(eng, &g, h, &data)
                            .with_context(|| format!("{model} {ctx} {name}"))?,
                    );
                    pb.inc(1);
                }
                loads.push((name.to_string(), median_run(rs), n));
            }
            let mut rs = Vec::new();
            for _ in 0..plan.runs {
                pb.set_message(format!("{ctx} tokens, chunkwise"));
                rs.push(rt.block_on(link::chunkwise_load(&store, &kb, &g, h, &data, 16))?);
                pb.inc(1);
            }
            loads.push(("chunkwise".to_string(), median_run(rs), n));
            let mut nixl_note = None;
            if let Some(py) = &python {
                pb.set_message(format!("{ctx} tokens, nixl-obj"));
                let job = nixl::NixlJob {
                    endpoint: lk.endpoint(),
                    bucket: link::BUCKET,
                    access_key: link::ACCESS_KEY,
                    secret_key: link::SECRET_KEY,
                    region: "us-east-1",
                    keys: h.iter().map(|x| kb.data(x)).collect(),
                    object_bytes: objectcache::layout::object_len(g.layers, g.slice_bytes()),
                    runs: plan.runs,
                    timeout_s: 300.0,
                };
                match nixl::run(py, &job)? {
                    nixl::NixlOutcome::Loaded {
                        load_s,
                        bytes,
                        sha256_first,
                        version,
                    } => {
                        let obj = rt
                            .block_on(store.get_bytes(&kb.data(&h[0])))
                            .map_err(|e| anyhow!("re-reading chunk 0: {e}"))?;
                        use sha2::Digest;
                        let want = hex::encode(sha2::Sha256::digest(&obj));
                        if want != sha256_first {
                            bail!(
                                "nixl-obj: the first object NIXL read differs from the stored one"
                            );
                        }
                        let mut ls = load_s.clone();
                        ls.sort_by(f64::total_cmp);
                        let t = ls[ls.len() / 2];
                        let _ = bytes;
                        loads.push((
                            "nixl-obj".into(),
                            link::Measured {
                                ready_s: vec![t; g.layers as usize],
                                requests: n as u64,
                            },
                            n,
                        ));
                        nixl_note = Some(format!(
                            "{version}, OBJ plugin, whole-object READ of {n} objects"
                        ));
                    }
                    nixl::NixlOutcome::Unavailable(why) => {
                        let msg = format!("nixl-obj skipped: {why}");
                        if !nixl_notes.contains(&msg) {
                            pb.println(&msg);
                            nixl_notes.push(msg);
                        }
                    }
                }
                pb.inc(plan.runs as u64);
            }
            points.push((
                ctx,
                PointLoads {
                    chunks_full,
                    chunks_measured: n,
                    loads,
                    nixl_note,
                },
            ));
        }
        pb.finish_and_clear();
        // Free this model's objects in the server before the next model.
        rt.block_on(async {
            for h in &hs {
                let _ = store.delete(&kb.data(h)).await;
                let _ = store.delete(&kb.marker(h)).await;
            }
        });
        drop(data);
        for (ctx, pl) in &points {
            for &gpu in &plan.gpus {
                let cm = compute_model(model, &g, gpu, plan.kernels)?;
                for &new in &plan.new_tokens {
                    let recs = point_records(&plan, model, &g, gpu, &cm, *ctx, new, pl)?;
                    if timeline_svg.is_none()
                        || (model.contains("8b")
                            && *ctx == 65536
                            && new == 1024
                            && gpu == plan.gpus[0])
                    {
                        if let Some(t) = timeline_plot(&plan, model, &g, gpu, &cm, *ctx, new, pl) {
                            timeline_svg = Some(t);
                        }
                    }
                    records.extend(recs);
                }
            }
        }
        if model.contains("8b") {
            records.extend(concurrent_records(&plan, model, &g, &points)?);
        }
    }
    print_table(&records);
    print_goals(&records);
    for n in &nixl_notes {
        println!("{n}");
    }
    if a.nixl_venv.is_none() {
        println!(
            "nixl-obj not run: give --nixl-venv DIR (a venv with nixl-cu12 and numpy) to add it"
        );
    }
    if let Some(p) = json {
        let s = serde_json::to_string_pretty(&records)?;
        std::fs::write(p, s).with_context(|| format!("writing {}", p.display()))?;
        eprintln!("wrote {} records to {}", records.len(), p.display());
    }
    if let Some(dir) = &a.svg {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, body) in super::modeled_plot::ttft_plots(&records) {
            let p = dir.join(name);
            std::fs::write(&p, body).with_context(|| format!("writing {}", p.display()))?;
            eprintln!("wrote {}", p.display());
        }
        if let Some(t) = &timeline_svg {
            let p = dir.join("modeled-timeline.svg");
            std::fs::write(&p, super::modeled_plot::timeline_svg(t))
                .with_context(|| format!("writing {}", p.display()))?;
            eprintln!("wrote {}", p.display());
        }
    }
    drop(eng_gather);
    drop(eng_ranged);
    Ok(())
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

#[allow(clippy::too_many_arguments)]
fn timeline_plot(
    plan: &Plan,
    model: &str,
    g: &KvGeometry,
    gpu: GpuKind,
    cm: &ComputeModel,
    _ctx: u64,
    new: u64,
    pl: &PointLoads,
) -> Option<super::modeled_plot::TimelinePlot> {
    let c = Ctx {
        plan,
        g,
        gpu,
        ctx_tokens: ctx_tokens(g, pl),
        pl,
    };
    let compute = cm.layer_times(new, c.ctx_tokens);
    let s = c.time_scale();
    let h2d = c.h2d_layer_s(c.ctx_tokens);
    let mut series = Vec::new();
    let local = model_request(&vec![0.0; g.layers as usize], h2d, &compute, cm.fixed_s());
    series.push((
        "local-layerwise".to_string(),
        vec![0.0; g.layers as usize],
        local,
    ));
    for (name, m, _) in &pl.loads {
        if name == "gather-tcp" || name == "s3-layerwise" {
            let host: Vec<f64> = m.ready_s.iter().map(|r| r * s).collect();
            let md = model_request(&host, h2d, &compute, cm.fixed_s());
            series.push((name.clone(), host, md));
        }
    }
    Some(super::modeled_plot::TimelinePlot {
        title: format!(
            "{model}, {} cached + {new} new tokens, {}, link {:.0} Gb/s",
            c.ctx_tokens,
            gpu.name(),
            plan.link * 8.0 / 1e9
        ),
        bound_ready: timeline::ready_at_rate(
            0.0,
            &vec![c.layer_bytes(); g.layers as usize],
            plan.link,
        ),
        series,
    })
}

#[allow(clippy::too_many_arguments)]
fn point_records(
    plan: &Plan,
    model: &str,
    g: &KvGeometry,
    gpu: GpuKind,
    cm: &ComputeModel,
    _ctx: u64,
    new: u64,
    pl: &PointLoads,
) -> Result<Vec<Record>> {
    let c = Ctx {
        plan,
        g,
        gpu,
        ctx_tokens: ctx_tokens(g, pl),
        pl,
    };
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

fn concurrent_records(
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

fn ms(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1}", x * 1e3)
    } else {
        "-".into()
    }
}

fn print_table(records: &[Record]) {
    println!(
        "{:<18} {:<20} {:>5} {:>7} {:>6} {:>4} {:<20} {:>10} {:>10} {:>8} {:>10} {:>10} {:>8}",
        "method",
        "model",
        "gpu",
        "context",
        "new",
        "conc",
        "policy",
        "TTFT ms",
        "added ms",
        "added %",
        "xfer ms",
        "bound ms",
        "/bound"
    );
    for r in records {
        println!(
            "{:<18} {:<20} {:>5} {:>7} {:>6} {:>4} {:<20} {:>10} {:>10} {:>8.1} {:>10} {:>10} {:>8}",
            r.method,
            r.model,
            r.gpu,
            r.context_tokens,
            r.new_tokens,
            r.concurrency,
            r.policy,
            ms(r.ttft_s),
            ms(r.added_ttft_s),
            r.added_ttft_pct,
            ms(r.transfer_time_s),
            r.bound_ttft_s.map(ms).unwrap_or_else(|| "-".into()),
            r.ttft_over_bound.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into()),
        );
    }
}

fn print_goals(records: &[Record]) {
    let single = |m: &'static str| {
        records
            .iter()
            .filter(move |r| r.method == m && r.concurrency == 1)
    };
    if let Some(w) = single("gather-tcp").max_by(|a, b| {
        a.ttft_over_bound
            .unwrap_or(0.0)
            .total_cmp(&b.ttft_over_bound.unwrap_or(0.0))
    }) {
        println!(
            "goal gather-tcp within 5% of the pipeline bound: worst {:.3}x ({} {} ctx {} new {}) -> {}",
            w.ttft_over_bound.unwrap_or(f64::NAN),
            w.model,
            w.gpu,
            w.context_tokens,
            w.new_tokens,
            if w.ttft_over_bound.unwrap_or(f64::INFINITY) <= 1.05 { "met" } else { "not met" }
        );
    }
    for r in single("gather-tcp").filter(|r| r.context_tokens == 65536 && r.model.contains("8b")) {
        let ideal = r
            .bound_h2d_ttft_s
            .map_or(f64::NAN, |b| (b - r.local_ttft_s) / r.local_ttft_s * 100.0);
        println!(
            "goal 64K added TTFT <= 3% over local layerwise: {} {} new {}: {:.1}% ({:.1} ms; the link+h2d pipeline bound itself: {ideal:.1}%) -> {}",
            r.model,
            r.gpu,
            r.new_tokens,
            r.added_ttft_pct,
            r.added_ttft_s * 1e3,
            if r.added_ttft_pct <= 3.0 { "met" } else { "not met" }
        );
    }
    for r in single("gather-tcp+planner").filter(|r| r.context_tokens == 4096) {
        println!(
            "goal 4K added TTFT <= 0.8x pure transfer ({:.1} ms) through the planner: {} {} new {}: {:.1} ms = {:.2}x (loads {} tokens) -> {}",
            r.pure_transfer_s * 1e3,
            r.model,
            r.gpu,
            r.new_tokens,
            r.added_ttft_s * 1e3,
            r.added_over_pure_transfer,
            r.loaded_tokens,
            if r.added_over_pure_transfer <= 0.8 { "met" } else { "not met" }
        );
    }
}
