//! The fleet benchmark's records (one per method, routing and trace) and its table.

use super::play::Outcome;
use crate::cost::Cost;
use serde::Serialize;

/// The node tier's counters over one pass (server metrics, differences).
#[derive(Debug, Clone, Default, Serialize)]
pub struct TierCounters {
    /// Reads served from a level (DRAM and disk).
    pub hits: u64,
    /// Reads no level held.
    pub misses: u64,
    /// Objects fetched from the remote store for misses, and their bytes.
    pub fills: u64,
    pub fill_bytes: u64,
    /// Reads that waited for another read's fetch.
    pub fills_shared: u64,
    /// Objects evicted from a level.
    pub evictions: u64,
    /// Objects admission kept out.
    pub refused: u64,
    /// Publish-marker reads (lookups) answered by the tier without the remote store.
    pub marker_hits: u64,
}

/// Where the requests' time to first token went, from vLLM's own request histograms (all
/// replicas, differences over the pass; means per request, seconds). vLLM's frontend stamps
/// a request's arrival and its first token, its engine the request's entry to the waiting
/// queue and its first scheduling: `ttft_s` is at least `queue_s + prefill_s`, the rest being
/// the hand-over between the two processes, and the client's TTFT adds HTTP on top.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Phases {
    /// Waiting to be scheduled (`vllm:request_queue_time_seconds`): behind other requests,
    /// and, with a connector, the scheduler's lookup of the external prefix.
    pub queue_s: f64,
    /// From scheduled to the first token (`vllm:request_prefill_time_seconds`): the prompt's
    /// forward passes, shared with the other requests of each step, and a layerwise load.
    pub prefill_s: f64,
    /// vLLM's TTFT (`vllm:time_to_first_token_seconds`).
    pub ttft_s: f64,
    /// Prompt tokens computed per request, not taken from a cache
    /// (`vllm:request_prefill_kv_computed_tokens`).
    pub computed_tokens: f64,
}

/// One method under one routing on one trace (field names are stable; docs/benchmarks.md).
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub method: String,
    pub routing: String,
    pub trace: String,
    pub replicas: usize,
    pub requests: usize,
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`, local and
    /// external) over prompt tokens.
    pub hit_rate: f64,
    /// What an infinite cache shared by every replica would supply, over prompt tokens
    /// ([`trace::ideal`]).
    pub ideal_hit_rate: f64,
    /// `hit_rate / ideal_hit_rate`.
    pub hit_over_ideal: f64,
    /// Tokens vLLM's own prefix caches supplied (`vllm:prefix_cache_hits`, all replicas).
    pub local_hit_tokens: u64,
    /// Tokens the connector supplied (`vllm:external_prefix_cache_hits`).
    pub external_hit_tokens: u64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub ttft_mean_s: f64,
    /// Where the TTFT went, inside vLLM.
    pub phases: Phases,
    /// Requests over the seconds from the first request sent to the last response's end.
    pub requests_per_s: f64,
    pub span_s: f64,
    /// Bytes read from the remote store: the server's backend reads
    /// (`objectcache_server_backend_bytes_total{dir="read"}`) for the server methods, the
    /// connectors' loaded bytes for the shared directory, 0 for `none`.
    pub remote_bytes: u64,
    /// GET-class requests to the remote store (server methods).
    pub remote_requests: Option<u64>,
    /// Mean seconds a GET-class request (GET, ranged GET, HEAD: loads and lookups) took the
    /// remote store to answer (server methods; `objectcache_server_backend_seconds_total`).
    pub remote_get_s: Option<f64>,
    /// Mean seconds a PUT-class request took the remote store to acknowledge: the saves that
    /// the server writes through (server methods).
    pub remote_put_s: Option<f64>,
    /// Bytes of the distinct chunks the ideal cache reuses (each loaded once by a perfect
    /// fleet): distinct blocks hit x KV bytes per block.
    pub unique_bytes: u64,
    /// `remote_bytes / unique_bytes`.
    pub remote_over_unique: f64,
    /// KV bytes the connectors loaded (`vllm:objectcache_loaded_bytes`).
    pub loaded_bytes: u64,
    /// Loads the connectors posted (`vllm:objectcache_loads`).
    pub loads: u64,
    /// What the remote store bills per load, at S3 Standard list prices (server methods).
    #[serde(flatten)]
    pub cost: Cost,
    /// The node tier's counters (`objectcache-tier`).
    pub tier: Option<TierCounters>,
    /// Requests each replica served.
    pub per_replica: Vec<usize>,
    /// Whether every output equals `none`'s for the same request (`None` without `none`).
    pub outputs_equal_none: Option<bool>,
    /// Requests whose output differs from `none`'s.
    pub outputs_differing: usize,
    /// Every request.
    pub outcomes: Vec<Outcome>,
    /// Why the method did not run.
    pub note: Option<String>,
}

pub(super) fn empty_record(method: &str, routing: &str, trace: &str, replicas: usize) -> Record {
    Record {
        method: method.into(),
        routing: routing.into(),
        trace: trace.into(),
        replicas,
        requests: 0,
        prompt_tokens: 0,
        hit_rate: 0.0,
        ideal_hit_rate: 0.0,
        hit_over_ideal: 0.0,
        local_hit_tokens: 0,
        external_hit_tokens: 0,
        ttft_p50_s: 0.0,
        ttft_p99_s: 0.0,
        ttft_mean_s: 0.0,
        phases: Phases::default(),
        requests_per_s: 0.0,
        span_s: 0.0,
        remote_bytes: 0,
        remote_requests: None,
        remote_get_s: None,
        remote_put_s: None,
        unique_bytes: 0,
        remote_over_unique: 0.0,
        loaded_bytes: 0,
        loads: 0,
        cost: Cost::default(),
        tier: None,
        per_replica: Vec::new(),
        outputs_equal_none: None,
        outputs_differing: 0,
        outcomes: Vec::new(),
        note: None,
    }
}

/// Nearest-rank percentile of sorted `v`.
pub(super) fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[i.clamp(1, v.len()) - 1]
}

pub(super) fn print_table(records: &[Record]) {
    println!(
        "{:<6} {:<19} {:<11} {:>6} {:>6} {:>6} {:>8} {:>8} {:>6} {:>9} {:>9} {:>6} {:>7}",
        "trace",
        "method",
        "routing",
        "hit%",
        "ideal%",
        "/ideal",
        "TTFT p50",
        "p99",
        "req/s",
        "remote MB",
        "unique MB",
        "/uniq",
        "= none"
    );
    for r in records {
        if let Some(n) = &r.note {
            println!("{:<6} {:<19} {:<11} {n}", r.trace, r.method, r.routing);
            continue;
        }
        println!(
            "{:<6} {:<19} {:<11} {:>6.1} {:>6.1} {:>6.2} {:>8.3} {:>8.3} {:>6.2} {:>9.1} {:>9.1} {:>6.2} {:>7}",
            r.trace,
            r.method,
            r.routing,
            r.hit_rate * 100.0,
            r.ideal_hit_rate * 100.0,
            r.hit_over_ideal,
            r.ttft_p50_s,
            r.ttft_p99_s,
            r.requests_per_s,
            r.remote_bytes as f64 / 1e6,
            r.unique_bytes as f64 / 1e6,
            r.remote_over_unique,
            match r.outputs_equal_none {
                Some(true) => "yes".to_string(),
                Some(false) => format!("{} diff", r.outputs_differing),
                None => "-".into(),
            }
        );
    }
}

/// The second table: where each pass's TTFT went inside vLLM ([`Phases`]).
pub(super) fn print_phases(records: &[Record]) {
    println!(
        "{:<6} {:<19} {:<11} {:>9} {:>8} {:>8} {:>10} {:>10} {:>12} {:>12}",
        "trace",
        "method",
        "routing",
        "TTFT mean",
        "queue",
        "prefill",
        "vLLM TTFT",
        "computed",
        "remote GET s",
        "remote PUT s"
    );
    let secs = |v: Option<f64>| v.map_or("-".to_string(), |s| format!("{s:.3}"));
    for r in records.iter().filter(|r| r.note.is_none()) {
        let p = &r.phases;
        println!(
            "{:<6} {:<19} {:<11} {:>9.3} {:>8.3} {:>8.3} {:>10.3} {:>10.0} {:>12} {:>12}",
            r.trace,
            r.method,
            r.routing,
            r.ttft_mean_s,
            p.queue_s,
            p.prefill_s,
            p.ttft_s,
            p.computed_tokens,
            secs(r.remote_get_s),
            secs(r.remote_put_s)
        );
    }
}
