//! `objectcache sim`: replay a workload in the discrete-event simulator under each scheduling
//! policy; print a table, optionally write JSON records and an SVG plot.

use super::plot::Panels;
use objectcache_core::layout::KvGeometry;
use objectcache_core::sched::{AnalyticModel, ComputeModel, GpuKind, KernelClass, ModelShape};
use objectcache_core::sim::{self, workload, Record, RunSpec, SimConfig, SimPolicy};
use objectcache_core::Error;
use std::path::PathBuf;

/// Arguments of `objectcache sim` (boxed, so the CLI's command enum stays small).
#[derive(Debug, clap::Args)]
pub struct SimArgs {
    /// The options.
    #[command(flatten)]
    pub opts: Box<SimOptions>,
}

/// Options of `objectcache sim`.
#[derive(Debug, clap::Args)]
pub struct SimOptions {
    /// Workload: `mix` (bursts of N requests with 4K-128K prefixes), `staggered` (the same with
    /// arrivals spread over the time the link needs for all of them), `c1` (case C1: N
    /// concurrent 10K-token prefixes, cap set so loading all takes 3x recompute), `trace`
    /// (Mooncake-style JSON lines, see --trace).
    #[arg(long, default_value = "mix")]
    pub workload: String,
    /// Trace file for `--workload trace` (JSON lines: timestamp ms, input_length,
    /// output_length, hash_ids of 512-token blocks).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Multiply trace timestamps by this factor (below 1 compresses time, raising concurrency).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Model preset (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, smollm2-135m).
    #[arg(long, default_value = "llama-3.1-8b")]
    pub model: String,
    /// Tensor-parallel degree (per-rank KV bytes and compute divided by it).
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// GPU kind (a100, h100, h200, gh200).
    #[arg(long, default_value = "h100")]
    pub gpu: String,
    /// Kernel class: tuned (FA3 / TensorRT-LLM class) or fa2.
    #[arg(long, default_value = "tuned")]
    pub kernels: String,
    /// Link speed in Gb/s that the caps are fractions of.
    #[arg(long, default_value_t = 100.0)]
    pub link_gbps: f64,
    /// Caps as fractions of the link, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.75")]
    pub cap: Vec<f64>,
    /// Concurrency levels (requests per burst), comma-separated; default 2,3,8,16,32,64 for the
    /// mixes and 32 for c1.
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Vec<usize>,
    /// Instances per concurrency level (0: about 64 requests per level).
    #[arg(long, default_value_t = 0)]
    pub instances: usize,
    /// Policies, comma-separated (fifo, equal-share, byte-proportional, stall-aware, each
    /// optionally with +planner); default: the four policies and the two with +planner.
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Per-load rate limit in GB/s (default: none).
    #[arg(long)]
    pub max_rate_gbytes: Option<f64>,
    /// Seed of the workload generator.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Compute the exact lower bound when the search has at most this many states (0: never).
    #[arg(long, default_value_t = sim::bound::DEFAULT_MAX_STATES)]
    pub bound_max_states: u64,
    /// Write the records as a JSON array here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an SVG plot of mean added TTFT per policy and concurrency here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Simulate a cluster instead of one link: GPUs loading through gateways in front of a
    /// storage cluster (`--gpus`, `--gateways`, `--placements`, `--policies`, storage and
    /// workload flags below); `--workload trace` replays `--trace` on every GPU, anything
    /// else is the synthetic workload. See `docs/deployment.md`, "Sizing".
    #[arg(long)]
    pub cluster: bool,
    /// Cluster: GPU counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "512")]
    pub gpus: Vec<usize>,
    /// Cluster, trace workload: GPUs that share one copy of the trace's documents (0: all
    /// GPUs share one); each group of this many GPUs gets its own copy, as a tenant of its own.
    #[arg(long, default_value_t = 8)]
    pub trace_share: usize,
    /// Cluster: gateway counts, comma-separated. The default pair carries the default 512
    /// GPUs without an overloaded gateway (docs/deployment.md, "Sizing": about 60% and 30%
    /// utilisation). With 16 or fewer every gateway is overloaded, its queue grows all run,
    /// and the simulation takes many minutes to say so.
    #[arg(long, value_delimiter = ',', default_value = "32,64")]
    pub gateways: Vec<usize>,
    /// Cluster: placement policies (two-choice, hash, least-loaded), comma-separated
    /// [default: all three].
    #[arg(long, value_delimiter = ',')]
    pub placements: Vec<String>,
    /// Cluster: seconds of arrivals.
    #[arg(long, default_value_t = 3600.0)]
    pub duration: f64,
    /// Cluster, synthetic workload: requests per second per GPU (Poisson). At the default
    /// prefix mix (Llama-3.1-8B: 43,008 tokens of 128 KiB, 5.64 GB per prefix on average) 0.1
    /// is 0.56 GB/s per GPU.
    #[arg(long, default_value_t = 0.1)]
    pub rate_per_gpu: f64,
    /// Cluster, synthetic workload: shared documents (cached prefixes).
    #[arg(long, default_value_t = 10_000)]
    pub documents: usize,
    /// Cluster, synthetic workload: Zipf exponent of document popularity (0: uniform).
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Cluster: each gateway's NIC, Gb/s.
    #[arg(long, default_value_t = 100.0)]
    pub gateway_gbps: f64,
    /// Cluster: a GPU host's link for one load, Gb/s.
    #[arg(long, default_value_t = 100.0)]
    pub gpu_gbps: f64,
    /// Cluster: storage nodes.
    #[arg(long, default_value_t = 32)]
    pub storage_nodes: usize,
    /// Cluster: bandwidth of each storage node, Gb/s.
    #[arg(long, default_value_t = 100.0)]
    pub storage_node_gbps: f64,
    /// Cluster: the clients' health-check interval in ms (how stale their load figures are).
    #[arg(long, default_value_t = 1000)]
    pub health_interval_ms: u64,
    /// Cluster: each node's tier DRAM level, GiB (0: no tier). With a tier (DRAM or disk
    /// above 0), every configuration runs twice, without and with the node tier.
    #[arg(long, default_value_t = 0.0)]
    pub tier_dram_gib: f64,
    /// Cluster: each node's tier disk level, GiB.
    #[arg(long, default_value_t = 0.0)]
    pub tier_disk_gib: f64,
    /// Cluster: nodes the GPUs are on, one tier each (GPUs dealt round-robin).
    #[arg(long, default_value_t = 64)]
    pub tier_nodes: usize,
    /// Cluster: the tier's admission, `all`, `second` (window 600 s) or `second:SECONDS`
    /// (the server's `tier_admission`, parsed by the same code).
    #[arg(long, default_value = "all")]
    pub tier_admission: String,
    /// Cluster: a load's read rate from a node's DRAM level, GB/s.
    #[arg(long, default_value_t = 20.0)]
    pub tier_dram_gbytes: f64,
    /// Cluster: a load's read rate from a node's disk level (NVMe), GB/s.
    #[arg(long, default_value_t = 5.0)]
    pub tier_disk_gbytes: f64,
}

/// An invalid-argument error saying `m`.
pub(super) fn bad(m: String) -> Error {
    Error::InvalidArgument(m)
}

/// Runs `objectcache sim`.
///
/// # Errors
/// [`Error::InvalidArgument`] for a bad flag value (unknown model, GPU, policy or workload, a
/// cap outside (0, 1], a missing or malformed trace), [`Error::Io`] if an output file cannot
/// be written.
pub fn run(args: SimArgs) -> objectcache_core::Result<()> {
    let args = *args.opts;
    if args.cluster {
        return run_cluster(&args);
    }
    let records = records(&args)?;
    print!("{}", table(&records));
    write_outputs(
        &args,
        || serde_json::to_string_pretty(&records),
        |p| plot(&records, p),
    )
}

/// Writes the records' JSON (`json()`, a pretty-printed array) to `--json` and draws them
/// with `plot` to `--svg`, where given, saying on stderr what it wrote.
///
/// # Errors
/// [`Error::InvalidArgument`] if the JSON encoding fails or the plot cannot be drawn,
/// [`Error::Io`] if the JSON file cannot be written.
fn write_outputs(
    args: &SimOptions,
    json: impl FnOnce() -> serde_json::Result<String>,
    plot: impl FnOnce(&std::path::Path) -> objectcache_core::Result<()>,
) -> objectcache_core::Result<()> {
    if let Some(p) = &args.json {
        let s = json().map_err(|e| bad(format!("JSON encoding failed: {e}")))?;
        std::fs::write(p, s + "\n")?;
        eprintln!("wrote {}", p.display());
    }
    if let Some(p) = &args.svg {
        plot(p)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// What `--gpu`, `--kernels`, `--model` and `--tp` name: the model's compute on one rank.
struct Compute {
    /// The GPU kind.
    gpu: GpuKind,
    /// The model's shape (all ranks).
    shape: ModelShape,
    /// The analytic compute model of one rank.
    model: ComputeModel,
    /// KV bytes per token per layer of one rank.
    kv_bytes: u64,
}

impl Compute {
    /// Parses the compute flags of `args`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown GPU, kernel class or model, or `--tp 0`.
    fn of(args: &SimOptions) -> objectcache_core::Result<Compute> {
        let gpu = GpuKind::parse(&args.gpu)?;
        let kernels = KernelClass::parse(&args.kernels)?;
        if args.tp == 0 {
            return Err(bad("--tp must be at least 1".into()));
        }
        let shape = ModelShape::preset(&args.model)?;
        let model =
            ComputeModel::Analytic(AnalyticModel::new(shape.clone(), gpu, kernels, args.tp)?);
        let kv_bytes = shape.kv_bytes_per_token_per_layer / args.tp as u64;
        Ok(Compute {
            gpu,
            shape,
            model,
            kv_bytes,
        })
    }
}

/// The text of the trace file `--workload trace` replays.
///
/// # Errors
/// [`Error::InvalidArgument`] if `--trace` is missing or the file cannot be read.
fn read_trace(args: &SimOptions) -> objectcache_core::Result<String> {
    let path = args
        .trace
        .as_ref()
        .ok_or_else(|| bad("--workload trace needs --trace PATH".into()))?;
    std::fs::read_to_string(path)
        .map_err(|e| bad(format!("cannot read trace {}: {e}", path.display())))
}

/// Builds and runs everything `args` asks for; returns the records.
///
/// # Errors
/// As [`run`].
pub fn records(args: &SimOptions) -> objectcache_core::Result<Vec<Record>> {
    let Compute {
        gpu,
        shape,
        model,
        kv_bytes,
    } = Compute::of(args)?;
    let geometry = KvGeometry::preset(&args.model)?;
    if !(args.link_gbps.is_finite() && args.link_gbps > 0.0) {
        return Err(bad(format!("--link-gbps {} must be > 0", args.link_gbps)));
    }
    let link = args.link_gbps * 1e9 / 8.0;
    if let Some(c) = args.cap.iter().find(|c| !(**c > 0.0 && **c <= 1.0)) {
        return Err(bad(format!("--cap {c} is not a fraction in (0, 1]")));
    }
    let concurrency: Vec<usize> = if !args.concurrency.is_empty() {
        args.concurrency.clone()
    } else if args.workload == "c1" {
        vec![32]
    } else {
        vec![2, 3, 8, 16, 32, 64]
    };
    if concurrency.contains(&0) {
        return Err(bad("--concurrency values must be at least 1".into()));
    }
    let policies: Vec<SimPolicy> = if args.policies.is_empty() {
        SimPolicy::standard()
    } else {
        args.policies
            .iter()
            .map(|p| SimPolicy::parse(p))
            .collect::<Result<_, _>>()?
    };
    let max_rate = args.max_rate_gbytes.map_or(f64::INFINITY, |g| g * 1e9);
    let base = SimConfig {
        model: model.clone(),
        kv_bytes_per_token_per_layer: kv_bytes,
        chunk_tokens: geometry.tokens_per_chunk as u64,
        capacity: link,
        max_rate_per_load: max_rate,
    };
    let mut workloads: Vec<(workload::Workload, Vec<f64>)> = Vec::new();
    match args.workload.as_str() {
        "mix" | "staggered" => {
            for &c in &concurrency {
                let inst = if args.instances > 0 {
                    args.instances
                } else {
                    (64 / c).max(1)
                };
                for &cap in &args.cap {
                    let w = if args.workload == "mix" {
                        workload::burst_mix(c, inst, args.seed)
                    } else {
                        // Window: the time the cap needs to move every request's prefix.
                        let probe = workload::burst_mix(c, 1, args.seed);
                        let bytes: u64 = probe.instances[0]
                            .requests
                            .iter()
                            .map(|r| r.prefix_tokens * kv_bytes * shape.layers as u64)
                            .sum();
                        workload::staggered_mix(c, inst, bytes as f64 / (cap * link), args.seed)
                    };
                    workloads.push((w, vec![cap]));
                }
            }
        }
        "c1" => {
            let n = concurrency[0];
            let w = workload::c1(n, 10_000, 256);
            let cap = c1_cap(&model, kv_bytes, n, 10_000, 256) / link;
            workloads.push((w, vec![cap]));
        }
        "trace" => {
            let text = read_trace(args)?;
            workloads.push((
                workload::mooncake_trace(&text, args.time_scale)?,
                args.cap.clone(),
            ));
        }
        other => {
            return Err(bad(format!(
                "unknown workload {other:?}: use mix, staggered, c1 or trace"
            )))
        }
    }
    let mut out = Vec::new();
    for (w, caps) in &workloads {
        for &cap in caps {
            let cfg = SimConfig {
                capacity: cap * link,
                ..base.clone()
            };
            out.extend(sim::run(&RunSpec {
                workload: w,
                config: &cfg,
                cap_fraction: cap,
                policies: &policies,
                model: &shape.name,
                gpu: gpu.name(),
                seed: args.seed,
                bound_max_states: args.bound_max_states,
            })?);
        }
    }
    Ok(out)
}

/// Case C1's cap (bytes/s): loading all `n` prefixes takes 3x one request's recompute time.
pub fn c1_cap(model: &ComputeModel, kv_bytes: u64, n: usize, prefix: u64, new: u64) -> f64 {
    let total = (n as u64 * prefix * kv_bytes * model.layers() as u64) as f64;
    total / (3.0 * model.recompute_time(prefix, new))
}

/// The readable table of `objectcache sim` (one line per record, times in seconds).
pub fn table(records: &[Record]) -> String {
    let mut s = format!(
        "{:<10} {:>4} {:>5} {:<22} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>6}\n",
        "workload",
        "conc",
        "cap",
        "policy",
        "reqs",
        "meanTTFT",
        "p99TTFT",
        "meanAdd",
        "p99Add",
        "LB",
        "eq/this",
        "loaded"
    );
    for r in records {
        let eq = records
            .iter()
            .find(|e| {
                e.policy == "equal-share"
                    && e.workload == r.workload
                    && e.concurrency == r.concurrency
                    && e.cap_fraction == r.cap_fraction
            })
            .map(|e| e.summary.mean_added_ttft_s);
        let ratio = match eq {
            Some(e) if r.summary.mean_added_ttft_s > 0.0 => {
                format!("{:.2}", e / r.summary.mean_added_ttft_s)
            }
            _ => "-".into(),
        };
        s += &format!(
            "{:<10} {:>4} {:>4.0}% {:<22} {:>5} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9} {:>7} {:>5.0}%\n",
            r.workload,
            r.concurrency,
            r.cap_fraction * 100.0,
            r.policy,
            r.summary.requests,
            r.summary.mean_ttft_s,
            r.summary.p99_ttft_s,
            r.summary.mean_added_ttft_s,
            r.summary.p99_added_ttft_s,
            r.lower_bound_mean_added_ttft_s.map_or("-".into(), |b| format!("{b:.3}")),
            ratio,
            r.summary.loaded_fraction * 100.0
        );
    }
    s
}

fn plot(records: &[Record], path: &std::path::Path) -> objectcache_core::Result<()> {
    let mut caps: Vec<f64> = records.iter().map(|r| r.cap_fraction).collect();
    caps.sort_by(f64::total_cmp);
    caps.dedup();
    let mut concs: Vec<usize> = records.iter().map(|r| r.concurrency).collect();
    concs.sort_unstable();
    concs.dedup();
    let mut policies: Vec<String> = Vec::new();
    for r in records {
        if !policies.contains(&r.policy) {
            policies.push(r.policy.clone());
        }
    }
    let titles: Vec<String> = caps
        .iter()
        .map(|cap| format!("{} cap {:.0}%", records[0].workload, cap * 100.0))
        .collect();
    let ys: Vec<f64> = records
        .iter()
        .map(|r| r.summary.mean_added_ttft_s)
        .collect();
    let panels = Panels {
        size: (420, 420),
        titles: &titles,
        xs: &concs,
        x_desc: "concurrency",
        y_desc: "mean added TTFT (s)",
        ys: &ys,
    };
    panels.draw(path, |p| {
        policies
            .iter()
            .map(|pol| {
                let pts = records
                    .iter()
                    .filter(|r| &r.policy == pol && r.cap_fraction == caps[p])
                    .filter_map(|r| {
                        let i = concs.iter().position(|&c| c == r.concurrency)?;
                        Some((i as f64, r.summary.mean_added_ttft_s))
                    })
                    .collect();
                (pol.clone(), pts)
            })
            .collect()
    })
}

/// Runs `objectcache sim --cluster`: one simulation per (GPUs, gateways, placement, policy),
/// a table, optional JSON records and SVG plot.
fn run_cluster(args: &SimOptions) -> objectcache_core::Result<()> {
    let t0 = std::time::Instant::now();
    let records = cluster_records(args, |r, wall| {
        eprintln!(
            "simulated {} GPUs x {} gateways, {} + {}: {} requests in {:.1} s",
            r.gpus, r.gateways, r.placement, r.policy, r.requests, wall
        )
    })?;
    print!("{}", cluster_table(&records));
    eprintln!(
        "{} simulations in {:.1} s",
        records.len(),
        t0.elapsed().as_secs_f64()
    );
    write_outputs(
        args,
        || serde_json::to_string_pretty(&records),
        |p| cluster_plot(&records, p),
    )
}

/// Builds and runs the cluster simulations `args` asks for (in order: GPUs, gateways,
/// placement, policy); `progress` is told of each with its wall time in seconds.
///
/// # Errors
/// [`Error::InvalidArgument`] for a bad flag value (unknown model, GPU, placement or
/// policy, a count of 0, a bandwidth that is not positive, a missing or malformed trace).
pub fn cluster_records(
    args: &SimOptions,
    mut progress: impl FnMut(&sim::cluster::ClusterRecord, f64),
) -> objectcache_core::Result<Vec<sim::cluster::ClusterRecord>> {
    use objectcache_core::sched::{Placement, PolicyKind};
    use sim::cluster::{self, ClusterConfig};
    let Compute {
        gpu,
        model,
        kv_bytes,
        ..
    } = Compute::of(args)?;
    if args.gpus.is_empty()
        || args.gpus.contains(&0)
        || args.gateways.is_empty()
        || args.gateways.contains(&0)
    {
        return Err(bad("--gpus and --gateways need counts of at least 1".into()));
    }
    let placements: Vec<Placement> = if args.placements.is_empty() {
        Placement::ALL.to_vec()
    } else {
        args.placements
            .iter()
            .map(|p| Placement::parse(p))
            .collect::<Result<_, _>>()?
    };
    let policies: Vec<PolicyKind> = if args.policies.is_empty() {
        vec![PolicyKind::EqualShare, PolicyKind::StallAware]
    } else {
        args.policies
            .iter()
            .map(|p| {
                let sp = SimPolicy::parse(p)?;
                if sp.planner {
                    return Err(bad(format!(
                        "--cluster simulates the link policies without the planner, not {p:?}"
                    )));
                }
                Ok(sp.kind)
            })
            .collect::<Result<_, _>>()?
    };
    let gbps = |what: &str, v: f64| -> objectcache_core::Result<f64> {
        if v.is_finite() && v > 0.0 {
            Ok(v * 1e9 / 8.0)
        } else {
            Err(bad(format!("--{what} {v} must be > 0")))
        }
    };
    let base = ClusterConfig {
        model,
        kv_bytes_per_token_per_layer: kv_bytes,
        gateways: 1,
        gateway_bytes_per_s: gbps("gateway-gbps", args.gateway_gbps)?,
        gpu_bytes_per_s: gbps("gpu-gbps", args.gpu_gbps)?,
        storage_nodes: args.storage_nodes,
        storage_node_bytes_per_s: gbps("storage-node-gbps", args.storage_node_gbps)?,
        placement: Placement::default(),
        policy: PolicyKind::EqualShare,
        health_interval_s: args.health_interval_ms.max(1) as f64 / 1000.0,
        tier: None,
    };
    let tier = node_tier(args)?;
    // Without the tier, then (where one is set) with it: the comparison the tier is for.
    let tiers: Vec<Option<cluster::NodeTier>> = match tier {
        Some(t) => vec![None, Some(t)],
        None => vec![None],
    };
    let trace = match args.workload.as_str() {
        "trace" => Some(read_trace(args)?),
        _ => None,
    };
    let mut out = Vec::new();
    for &gpus in &args.gpus {
        let w = match &trace {
            Some(text) => cluster::trace(
                text,
                gpus,
                args.trace_share,
                args.duration,
                args.time_scale,
                args.seed,
            )?,
            None => cluster::synthetic(
                gpus,
                args.rate_per_gpu,
                args.duration,
                args.documents,
                args.zipf,
                args.seed,
            )?,
        };
        for &gateways in &args.gateways {
            for &placement in &placements {
                for &policy in &policies {
                    for tier in &tiers {
                        let cfg = ClusterConfig {
                            gateways,
                            placement,
                            policy,
                            tier: tier.clone(),
                            ..base.clone()
                        };
                        let t = std::time::Instant::now();
                        let r = cluster::simulate(&w, &cfg, gpu.name())?;
                        progress(&r, t.elapsed().as_secs_f64());
                        out.push(r);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The node tier `--tier-*` ask for, `None` without DRAM or disk.
///
/// # Errors
/// [`Error::InvalidArgument`] for a negative or non-finite size or rate, no node, or an
/// unknown admission.
fn node_tier(args: &SimOptions) -> objectcache_core::Result<Option<sim::cluster::NodeTier>> {
    use sim::cluster::{NodeTier, TierAdmission};
    for (what, v) in [
        ("tier-dram-gib", args.tier_dram_gib),
        ("tier-disk-gib", args.tier_disk_gib),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(bad(format!("--{what} {v} must be >= 0")));
        }
    }
    if args.tier_dram_gib == 0.0 && args.tier_disk_gib == 0.0 {
        return Ok(None);
    }
    if args.tier_nodes == 0 {
        return Err(bad("--tier-nodes needs at least 1".into()));
    }
    let rate = |what: &str, v: f64| -> objectcache_core::Result<f64> {
        if v.is_finite() && v > 0.0 {
            Ok(v * 1e9)
        } else {
            Err(bad(format!("--{what} {v} must be > 0")))
        }
    };
    // The server tier's own grammar (`tier_admission`), so a setting tried here is one the
    // server takes.
    let admission = match objectcache_client::store::Admission::parse(&args.tier_admission)
        .map_err(|e| bad(format!("--tier-admission: {e}")))?
    {
        objectcache_client::store::Admission::All => TierAdmission::All,
        objectcache_client::store::Admission::Second { window } => TierAdmission::Second {
            window_s: window.as_secs_f64(),
        },
    };
    let gib = |v: f64| (v * (1u64 << 30) as f64) as u64;
    Ok(Some(NodeTier {
        nodes: args.tier_nodes,
        dram_bytes: gib(args.tier_dram_gib),
        disk_bytes: gib(args.tier_disk_gib),
        dram_bytes_per_s: rate("tier-dram-gbytes", args.tier_dram_gbytes)?,
        disk_bytes_per_s: rate("tier-disk-gbytes", args.tier_disk_gbytes)?,
        admission,
    }))
}

/// The readable table of `objectcache sim --cluster`.
pub fn cluster_table(records: &[sim::cluster::ClusterRecord]) -> String {
    let mut s = format!(
        "{:>5} {:>4} {:<13} {:<18} {:<14} {:>8} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>9} {:>7} {:>7} {:>10}\n",
        "gpus",
        "gws",
        "placement",
        "policy",
        "tier",
        "loads",
        "meanAdd",
        "p99Add",
        "p99Alone",
        "maxAdd",
        "gwUtil",
        "gwMax",
        "stUtil",
        "GB/GPU",
        "tierHit",
        "ideal",
        "remoteTB"
    );
    for r in records {
        s += &format!(
            "{:>5} {:>4} {:<13} {:<18} {:<14} {:>8} {:>9.4} {:>9.4} {:>9.4} {:>9.3} {:>6.1}% {:>6.1}% {:>6.1}% {:>9.1} {:>6.1}% {:>6.1}% {:>10.2}\n",
            r.gpus,
            r.gateways,
            r.placement,
            r.policy,
            match r.tier_nodes {
                0 => "no tier".to_string(),
                n => format!("{n}x{:.0}G+{:.0}G", r.tier_dram_gib, r.tier_disk_gib),
            },
            r.loads,
            r.mean_added_ttft_s,
            r.p99_added_ttft_s,
            r.p99_alone_added_ttft_s,
            r.max_added_ttft_s,
            r.gateway_utilisation * 100.0,
            r.max_gateway_utilisation * 100.0,
            r.storage_utilisation * 100.0,
            r.bytes_per_gpu / 1e9,
            r.tier_hit_rate * 100.0,
            r.tier_ideal_hit_rate * 100.0,
            r.remote_bytes / 1e12
        );
    }
    s
}

/// SVG: one panel per GPU count, p99 added TTFT against the number of gateways, one line per
/// placement and policy.
fn cluster_plot(
    records: &[sim::cluster::ClusterRecord],
    path: &std::path::Path,
) -> objectcache_core::Result<()> {
    let mut gpus: Vec<usize> = records.iter().map(|r| r.gpus).collect();
    gpus.sort_unstable();
    gpus.dedup();
    let mut gws: Vec<usize> = records.iter().map(|r| r.gateways).collect();
    gws.sort_unstable();
    gws.dedup();
    let mut lines: Vec<(String, String)> = Vec::new();
    for r in records {
        let k = (r.placement.clone(), r.policy.clone());
        if !lines.contains(&k) {
            lines.push(k);
        }
    }
    let titles: Vec<String> = gpus
        .iter()
        .map(|n| format!("{n} GPUs: p99 added TTFT"))
        .collect();
    let ys: Vec<f64> = records.iter().map(|r| r.p99_added_ttft_s).collect();
    let panels = Panels {
        size: (460, 440),
        titles: &titles,
        xs: &gws,
        x_desc: "gateways",
        y_desc: "p99 added TTFT (s)",
        ys: &ys,
    };
    panels.draw(path, |p| {
        lines
            .iter()
            .map(|(pl, po)| {
                let pts = records
                    .iter()
                    .filter(|r| r.gpus == gpus[p] && &r.placement == pl && &r.policy == po)
                    .filter_map(|r| {
                        let i = gws.iter().position(|&g| g == r.gateways)?;
                        Some((i as f64, r.p99_added_ttft_s))
                    })
                    .collect();
                (format!("{pl} + {po}"), pts)
            })
            .collect()
    })
}
