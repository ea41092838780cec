//! One measured load ([`Record`], the JSON fields of `docs/benchmarks.md`) and the merge of
//! a path's runs into one record ([`median_of`]).

use serde::Serialize;

/// One measured load (field names are stable; see docs/benchmarks.md).
#[derive(Debug, Serialize)]
pub(super) struct Record {
    pub(super) path: String,
    /// How the prefix is laid out in objects: `per-chunk` (format version 1, one object per
    /// chunk) or `segment` (one object per save's chunks, layer-major across them).
    pub(super) layout: String,
    pub(super) model: String,
    pub(super) context_tokens: u64,
    /// Tokens per chunk of the geometry (`--tokens-per-chunk`, else the preset's).
    pub(super) tokens_per_chunk: u32,
    pub(super) bytes: u64,
    /// One-way delay added by the proxy, milliseconds (`None`: no proxy).
    pub(super) delay_ms: Option<u64>,
    pub(super) requests: u64,
    /// Request waves at the least: gather 1; ranged GETs `requests / peak in flight` rounded
    /// up; chunkwise `requests / 16`.
    pub(super) round_trips: u64,
    /// PUTs one save of the prefix takes in this layout: per chunk a data object and a
    /// publish marker (`per-chunk`), or per segment one object plus a marker per chunk.
    pub(super) puts_per_save: u64,
    /// What a load, 1,000 loads, a load from another region and 1,000 saves cost, and what
    /// keeping the prefix costs a month, at [`crate::cost::S3_STANDARD`]'s list prices (a
    /// gather load's one request is priced as a GET); all 0 for the `file-` paths (local
    /// reads and writes are not billed).
    #[serde(flatten)]
    pub(super) cost: crate::cost::Cost,
    /// Most requests in flight at once (the connector's ranged-GET path; else 0).
    pub(super) peak_requests_in_flight: u64,
    /// Most bytes asked for and not yet received at once (ranged-GET path; else 0).
    pub(super) peak_bytes_in_flight: u64,
    /// Time to first layer, seconds: the median over `runs` loads.
    pub(super) ttfl_s: f64,
    /// Time to last layer, seconds: the median over `runs` loads.
    pub(super) ttll_s: f64,
    /// Fastest and slowest TTFL of the runs, seconds.
    pub(super) ttfl_s_range: [f64; 2],
    /// Fastest and slowest TTLL of the runs, seconds.
    pub(super) ttll_s_range: [f64; 2],
    /// Measured loads behind the medians (`--runs`).
    pub(super) runs: u32,
    /// `bytes / ttll_s` (the median load's throughput).
    pub(super) throughput_bytes_per_s: f64,
    pub(super) raw_tcp_bytes_per_s: f64,
    /// CPU seconds this process spent per GiB moved during the load (all threads: the client
    /// and, without `--store`, the in-process server); `None` where not measurable. Unlike
    /// the throughput, it barely moves when other work competes for the cores.
    pub(super) cpu_s_per_gib: Option<f64>,
    /// The same for a raw loopback TCP stream (sender and receiver) of the load's bytes (at
    /// most 2 GiB) run just before each load: the median over `runs`.
    pub(super) raw_tcp_cpu_s_per_gib: Option<f64>,
    /// Per run, `cpu_s_per_gib` over the raw stream's just before it; the median over `runs`.
    /// A ratio taken within one run holds still where either figure alone moves with the
    /// machine's load (issue 18's goals: gather at most 1.2x, ranged GETs at most 1.6x).
    pub(super) cpu_x_raw_tcp: Option<f64>,
    /// Lowest and highest of the runs' ratios.
    pub(super) cpu_x_raw_tcp_range: [f64; 2],
    /// CPU seconds per GiB of a raw stream of the load's own bytes (its chunk files sent with
    /// `sendfile(2)` into a destination of the load's size, at most 2 GiB; `measure.rs`,
    /// `raw_same_bytes`) run just before each load: the median over `runs`. `None` where
    /// the chunk files are not this process's to read (`--store`, `--server-backend`).
    pub(super) raw_same_bytes_cpu_s_per_gib: Option<f64>,
    /// Per run, `cpu_s_per_gib` over that stream's; the median over `runs` (issue 43's goal:
    /// at most 1.2x for gather and segments).
    pub(super) cpu_x_raw_same_bytes: Option<f64>,
    /// Lowest and highest of the runs' same-bytes ratios.
    pub(super) cpu_x_raw_same_bytes_range: [f64; 2],
}

/// Merges the runs of one path and size into one record: the median TTFL, TTLL and CPU per
/// byte (each taken on its own; the upper median for an even count), their ranges, and the
/// throughput of the median TTLL.
pub(super) fn median_of(mut runs: Vec<Record>) -> Record {
    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
    fn range(v: &[f64]) -> [f64; 2] {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        [lo, hi]
    }
    let ttfl: Vec<f64> = runs.iter().map(|r| r.ttfl_s).collect();
    let ttll: Vec<f64> = runs.iter().map(|r| r.ttll_s).collect();
    let cpu: Option<Vec<f64>> = runs.iter().map(|r| r.cpu_s_per_gib).collect();
    let raw_cpu: Option<Vec<f64>> = runs.iter().map(|r| r.raw_tcp_cpu_s_per_gib).collect();
    let ratio: Option<Vec<f64>> = runs.iter().map(|r| r.cpu_x_raw_tcp).collect();
    let same: Option<Vec<f64>> = runs
        .iter()
        .map(|r| r.raw_same_bytes_cpu_s_per_gib)
        .collect();
    let same_ratio: Option<Vec<f64>> = runs.iter().map(|r| r.cpu_x_raw_same_bytes).collect();
    let n = runs.len() as u32;
    let mut r = runs.swap_remove(0);
    r.ttfl_s = median(ttfl.clone());
    r.ttll_s = median(ttll.clone());
    r.ttfl_s_range = range(&ttfl);
    r.ttll_s_range = range(&ttll);
    r.runs = n;
    r.throughput_bytes_per_s = r.bytes as f64 / r.ttll_s;
    r.cpu_s_per_gib = cpu.map(median);
    r.raw_tcp_cpu_s_per_gib = raw_cpu.map(median);
    r.cpu_x_raw_tcp_range = ratio.as_deref().map_or([f64::NAN; 2], range);
    r.cpu_x_raw_tcp = ratio.map(median);
    r.raw_same_bytes_cpu_s_per_gib = same.map(median);
    r.cpu_x_raw_same_bytes_range = same_ratio.as_deref().map_or([f64::NAN; 2], range);
    r.cpu_x_raw_same_bytes = same_ratio.map(median);
    r
}
