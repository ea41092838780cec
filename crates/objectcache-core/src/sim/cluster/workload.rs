//! Cluster workloads: the requests of many GPUs, synthetic ([`synthetic`]: Poisson arrivals,
//! Zipf document popularity) or a Mooncake-style trace replayed on every GPU ([`trace`]).

use crate::error::Error;
use crate::sched::placement;
use crate::sim::workload::{TraceRecord, MIX_NEW_TOKENS, MIX_PREFIXES, MOONCAKE_BLOCK_TOKENS};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashSet;

/// One request of a cluster workload.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterRequest {
    /// Arrival time (s).
    pub arrival_s: f64,
    /// The GPU (inference engine) it runs on.
    pub gpu: u32,
    /// The cached prefix's identity (a document): its route key is
    /// [`placement::route_key`] of these 8 bytes.
    pub prefix: u64,
    /// Cached prefix tokens to load (0: nothing cached, no load).
    pub prefix_tokens: u64,
    /// Tokens to prefill after the prefix.
    pub new_tokens: u64,
}

/// Requests of a cluster, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterWorkload {
    /// `synthetic` or `trace`.
    pub name: String,
    /// How prefixes are chosen, in words (for the record).
    pub popularity: String,
    /// GPUs the requests run on.
    pub gpus: usize,
    /// Length of the arrival window (s).
    pub duration_s: f64,
    /// The requests, by arrival time.
    pub requests: Vec<ClusterRequest>,
}

fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Synthetic workload: Poisson arrivals at `rate_per_gpu` requests/s on each of `gpus` GPUs
/// for `duration_s` seconds. Each request asks for one of `documents` shared documents with
/// Zipf popularity of exponent `zipf_s` (document `d`, counting from 1, has weight
/// `d^-zipf_s`; 0 is uniform), whose whole prefix is cached; each document's prefix length is
/// one of [`MIX_PREFIXES`] (4K to 128K tokens, equally likely), and each request adds one of
/// [`MIX_NEW_TOKENS`] new tokens.
///
/// # Errors
/// [`Error::InvalidArgument`] for no GPU, no document, or a rate, duration or exponent that
/// is negative or not finite.
pub fn synthetic(
    gpus: usize,
    rate_per_gpu: f64,
    duration_s: f64,
    documents: usize,
    zipf_s: f64,
    seed: u64,
) -> Result<ClusterWorkload, Error> {
    if gpus == 0 || documents == 0 {
        return Err(Error::InvalidArgument(
            "cluster workload: needs at least one GPU and one document".into(),
        ));
    }
    for (what, v) in [
        ("rate", rate_per_gpu),
        ("duration", duration_s),
        ("zipf exponent", zipf_s),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "cluster workload: {what} {v} must be finite and >= 0"
            )));
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xc105_7e20 ^ ((gpus as u64) << 40));
    // Zipf CDF over documents.
    let mut cdf = Vec::with_capacity(documents);
    let mut acc = 0.0;
    for d in 1..=documents {
        acc += (d as f64).powf(-zipf_s);
        cdf.push(acc);
    }
    let doc_len: Vec<u64> = (0..documents)
        .map(|_| MIX_PREFIXES[(rng.next_u64() % MIX_PREFIXES.len() as u64) as usize])
        .collect();
    let total_rate = rate_per_gpu * gpus as f64;
    let mut requests = Vec::new();
    let mut t = 0.0;
    if total_rate > 0.0 {
        loop {
            t += -(1.0 - uniform(&mut rng)).ln() / total_rate;
            if t >= duration_s {
                break;
            }
            let x = uniform(&mut rng) * acc;
            let d = cdf.partition_point(|&c| c < x).min(documents - 1);
            requests.push(ClusterRequest {
                arrival_s: t,
                gpu: (rng.next_u64() % gpus as u64) as u32,
                prefix: d as u64,
                prefix_tokens: doc_len[d],
                new_tokens: MIX_NEW_TOKENS[(rng.next_u64() % MIX_NEW_TOKENS.len() as u64) as usize],
            });
        }
    }
    Ok(ClusterWorkload {
        name: "synthetic".into(),
        popularity: format!("zipf s={zipf_s} over {documents} documents"),
        gpus,
        duration_s,
        requests,
    })
}

/// Trace workload: every GPU replays a Mooncake-style trace (JSON lines: `timestamp` ms,
/// `input_length`, `output_length`, `hash_ids` of 512-token blocks) from its own random
/// starting point, over and over, for `duration_s` seconds, its timestamps multiplied by
/// `time_scale`. GPUs form groups of `share` (0: one group of all GPUs); each group has its
/// own copy of the trace's documents (block ids), so a small trace stands for as many
/// tenants as there are groups. A request's cached prefix is the run of its leading blocks
/// that an earlier request of its group had (the store keeps everything), capped so that one
/// token is new; its route key is its first block (in its group), so popularity within a
/// group is the trace's own.
///
/// # Errors
/// [`Error::InvalidArgument`] for a malformed or empty trace (naming the line), no GPU, or a
/// duration or time scale that is not positive and finite.
pub fn trace(
    text: &str,
    gpus: usize,
    share: usize,
    duration_s: f64,
    time_scale: f64,
    seed: u64,
) -> Result<ClusterWorkload, Error> {
    if gpus == 0
        || !(duration_s.is_finite() && duration_s > 0.0)
        || !(time_scale.is_finite() && time_scale > 0.0)
    {
        return Err(Error::InvalidArgument(format!(
            "cluster trace: needs at least one GPU, a duration ({duration_s}) and a time scale ({time_scale}) above 0"
        )));
    }
    let mut recs: Vec<TraceRecord> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRecord = serde_json::from_str(line)
            .map_err(|e| Error::InvalidArgument(format!("trace line {}: {e}", i + 1)))?;
        if r.input_length == 0 || !r.timestamp.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "trace line {}: input_length 0 or a timestamp that is not finite",
                i + 1
            )));
        }
        recs.push(r);
    }
    if recs.is_empty() {
        return Err(Error::InvalidArgument("trace has no requests".into()));
    }
    let t0 = recs
        .iter()
        .map(|r| r.timestamp)
        .fold(f64::INFINITY, f64::min);
    let offs: Vec<f64> = recs
        .iter()
        .map(|r| (r.timestamp - t0) / 1000.0 * time_scale)
        .collect();
    // One pass of the trace lasts its span plus one mean gap, so passes do not overlap.
    let span = offs.iter().copied().fold(0.0, f64::max);
    let period = span + span / recs.len() as f64 + 1e-3;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7ace);
    let mut raw: Vec<(f64, u32, usize)> = Vec::new();
    for gpu in 0..gpus as u32 {
        let start = uniform(&mut rng) * period;
        let mut pass = 0u64;
        loop {
            let base = start + pass as f64 * period - period;
            if base >= duration_s {
                break;
            }
            for (i, &o) in offs.iter().enumerate() {
                let t = base + o;
                if (0.0..duration_s).contains(&t) {
                    raw.push((t, gpu, i));
                }
            }
            pass += 1;
        }
    }
    raw.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let group = |gpu: u32| {
        if share == 0 {
            0
        } else {
            gpu as u64 / share as u64
        }
    };
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let requests = raw
        .into_iter()
        .map(|(t, gpu, i)| {
            let r = &recs[i];
            let gr = group(gpu);
            let hit = r
                .hash_ids
                .iter()
                .take_while(|h| seen.contains(&(gr, **h)))
                .count() as u64;
            seen.extend(r.hash_ids.iter().map(|&h| (gr, h)));
            let prefix = (hit * MOONCAKE_BLOCK_TOKENS).min(r.input_length - 1);
            let first = r.hash_ids.first().copied().unwrap_or(i as u64);
            ClusterRequest {
                arrival_s: t,
                gpu,
                prefix: placement::route_key(&[first.to_le_bytes(), gr.to_le_bytes()].concat()),
                prefix_tokens: prefix,
                new_tokens: r.input_length - prefix,
            }
        })
        .collect();
    let groups = if share == 0 { 1 } else { gpus.div_ceil(share) };
    Ok(ClusterWorkload {
        name: "trace".into(),
        popularity: format!(
            "trace: {} requests per pass, {groups} copies of its documents (one per {} GPUs)",
            recs.len(),
            if share == 0 { gpus } else { share.min(gpus) }
        ),
        gpus,
        duration_s,
        requests,
    })
}
