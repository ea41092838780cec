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
//!
//! Here: the arguments, the measured loads and the run; the records of each point are made in
//! [`super::modeled_points`], the table is printed by [`super::modeled_table`].

use super::modeled_link as link;
use super::modeled_nixl as nixl;
use super::modeled_plan::{compute_model, Plan, PointLoads};
use super::modeled_points::{concurrent_records, point_records, timeline_plot, Point};
use super::modeled_table::{print_goals, print_table};
use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use objectcache::layout::KvGeometry;
use objectcache::sched::model::{GpuKind, KernelClass};
use objectcache::sim::SimPolicy;
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

fn median_run(mut runs: Vec<link::Measured>) -> link::Measured {
    runs.sort_by(|a, b| a.last().total_cmp(&b.last()));
    runs.swap_remove(runs.len() / 2)
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
                    let point = Point {
                        plan: &plan,
                        model,
                        g: &g,
                        gpu,
                        cm: &cm,
                        new,
                        pl,
                    };
                    let recs = point_records(&point)?;
                    if timeline_svg.is_none()
                        || (model.contains("8b")
                            && *ctx == 65536
                            && new == 1024
                            && gpu == plan.gpus[0])
                    {
                        if let Some(t) = timeline_plot(&point) {
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
