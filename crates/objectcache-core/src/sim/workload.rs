//! Workloads: synthetic mixes, case C1, and Mooncake-style trace replay.
//!
//! A [`Workload`] is a list of independent [`Instance`]s (each simulated on its own, results
//! pooled), each a list of [`Request`]s with an arrival time, a cached prefix and new tokens.
//! All randomness comes from a ChaCha8 generator seeded explicitly: the same seed gives the
//! same workload on every platform.
#![forbid(unsafe_code)]

use crate::error::Error;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Arrival time (s from the start of the instance).
    pub arrival_s: f64,
    /// Tokens of the prompt whose KV is cached in the store (the hit).
    pub prefix_tokens: u64,
    /// Tokens to prefill after the prefix.
    pub new_tokens: u64,
}

/// Requests simulated together (they share the link).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Instance {
    /// The requests, in any order.
    pub requests: Vec<Request>,
}

impl Instance {
    /// True if every request arrives at the same time (a burst).
    pub fn is_burst(&self) -> bool {
        self.requests
            .windows(2)
            .all(|w| w[0].arrival_s == w[1].arrival_s)
    }
}

/// A named set of instances.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Name used in reports (`mix`, `staggered`, `c1`, `trace`).
    pub name: String,
    /// Concurrency the workload was built for (requests per instance for bursts).
    pub concurrency: usize,
    /// Independent instances.
    pub instances: Vec<Instance>,
}

impl Workload {
    /// Total number of requests.
    pub fn requests(&self) -> usize {
        self.instances.iter().map(|i| i.requests.len()).sum()
    }
}

/// Prefix lengths of the mixes (tokens): 4K to 128K, log-uniform.
pub const MIX_PREFIXES: [u64; 6] = [4096, 8192, 16384, 32768, 65536, 131072];
/// New-token counts of the mixes.
pub const MIX_NEW_TOKENS: [u64; 3] = [128, 512, 1024];

fn pick<T: Copy>(rng: &mut ChaCha8Rng, xs: &[T]) -> T {
    xs[(rng.next_u64() % xs.len() as u64) as usize]
}

fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Paper-like burst mix: `instances` instances of `concurrency` requests arriving together,
/// prefixes drawn from [`MIX_PREFIXES`], new tokens from [`MIX_NEW_TOKENS`].
pub fn burst_mix(concurrency: usize, instances: usize, seed: u64) -> Workload {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((concurrency as u64) << 32));
    let instances = (0..instances)
        .map(|_| Instance {
            requests: (0..concurrency)
                .map(|_| Request {
                    arrival_s: 0.0,
                    prefix_tokens: pick(&mut rng, &MIX_PREFIXES),
                    new_tokens: pick(&mut rng, &MIX_NEW_TOKENS),
                })
                .collect(),
        })
        .collect();
    Workload {
        name: "mix".into(),
        concurrency,
        instances,
    }
}

/// Staggered mix: as [`burst_mix`] but arrivals uniform over `window_s` seconds.
pub fn staggered_mix(concurrency: usize, instances: usize, window_s: f64, seed: u64) -> Workload {
    let mut w = burst_mix(concurrency, instances, seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(0x5eed));
    for inst in &mut w.instances {
        for r in &mut inst.requests {
            r.arrival_s = uniform(&mut rng) * window_s;
        }
    }
    w.name = "staggered".into();
    w
}

/// Case C1: `n` concurrent requests hitting a `prefix`-token cached prefix, `new` new tokens.
pub fn c1(n: usize, prefix: u64, new: u64) -> Workload {
    Workload {
        name: "c1".into(),
        concurrency: n,
        instances: vec![Instance {
            requests: (0..n)
                .map(|_| Request {
                    arrival_s: 0.0,
                    prefix_tokens: prefix,
                    new_tokens: new,
                })
                .collect(),
        }],
    }
}

/// One line of a Mooncake-style trace.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct TraceRecord {
    /// Arrival time in milliseconds.
    pub timestamp: f64,
    /// Prompt length in tokens.
    pub input_length: u64,
    /// Generated tokens (unused by the prefill simulation).
    pub output_length: u64,
    /// Ids of the prompt's blocks of [`MOONCAKE_BLOCK_TOKENS`] tokens (equal ids = equal
    /// content and equal prefix).
    pub hash_ids: Vec<u64>,
}

/// Tokens per `hash_ids` block in Mooncake traces (FAST'25 trace format).
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

/// Replays a Mooncake-style trace (JSON lines: `timestamp` in ms, `input_length`,
/// `output_length`, `hash_ids`) as one instance. A request's cached prefix is its longest run
/// of leading blocks all seen in earlier requests (the store is assumed to keep everything),
/// capped at `input_length − 1` so at least one token is new. Arrival times are multiplied by
/// `time_scale` (1.0 replays in real time). Blank lines are skipped.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first bad line (not JSON, missing field, an empty
/// prompt, timestamps going backwards) or an empty trace.
pub fn mooncake_trace(text: &str, time_scale: f64) -> Result<Workload, Error> {
    let mut seen = std::collections::HashSet::new();
    let mut requests = Vec::new();
    let mut last = f64::NEG_INFINITY;
    let mut t0 = None;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRecord = serde_json::from_str(line)
            .map_err(|e| Error::InvalidArgument(format!("trace line {}: {e}", i + 1)))?;
        if r.input_length == 0 {
            return Err(Error::InvalidArgument(format!(
                "trace line {}: input_length is 0",
                i + 1
            )));
        }
        if !r.timestamp.is_finite() || r.timestamp < last {
            return Err(Error::InvalidArgument(format!(
                "trace line {}: timestamp {} is not finite or goes backwards",
                i + 1,
                r.timestamp
            )));
        }
        last = r.timestamp;
        let start = *t0.get_or_insert(r.timestamp);
        let hit_blocks = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count() as u64;
        let prefix = (hit_blocks * MOONCAKE_BLOCK_TOKENS).min(r.input_length - 1);
        seen.extend(r.hash_ids.iter().copied());
        requests.push(Request {
            arrival_s: (r.timestamp - start) / 1000.0 * time_scale,
            prefix_tokens: prefix,
            new_tokens: r.input_length - prefix,
        });
    }
    if requests.is_empty() {
        return Err(Error::InvalidArgument("trace has no requests".into()));
    }
    Ok(Workload {
        name: "trace".into(),
        concurrency: 0,
        instances: vec![Instance { requests }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_are_seeded() {
        assert_eq!(burst_mix(8, 2, 7), burst_mix(8, 2, 7));
        assert_ne!(burst_mix(8, 2, 7), burst_mix(8, 2, 8));
        let w = burst_mix(8, 3, 1);
        assert_eq!(w.requests(), 24);
        assert!(w.instances.iter().all(Instance::is_burst));
        assert!(w.instances[0]
            .requests
            .iter()
            .all(|r| MIX_PREFIXES.contains(&r.prefix_tokens)));
        let s = staggered_mix(8, 1, 2.0, 1);
        assert!(s.instances[0]
            .requests
            .iter()
            .all(|r| (0.0..2.0).contains(&r.arrival_s)));
    }

    #[test]
    fn trace_prefix_is_the_run_of_seen_leading_blocks() {
        let t = "{\"timestamp\": 1000, \"input_length\": 1200, \"output_length\": 5, \"hash_ids\": [1, 2, 3]}\n\
                 \n\
                 {\"timestamp\": 1500, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [1, 2, 9]}\n\
                 {\"timestamp\": 2000, \"input_length\": 1024, \"output_length\": 5, \"hash_ids\": [1, 2]}\n";
        let w = mooncake_trace(t, 1.0).unwrap();
        let r = &w.instances[0].requests;
        assert_eq!(
            (r[0].prefix_tokens, r[0].new_tokens, r[0].arrival_s),
            (0, 1200, 0.0)
        );
        assert_eq!(
            (r[1].prefix_tokens, r[1].new_tokens, r[1].arrival_s),
            (1024, 76, 0.5)
        );
        assert_eq!((r[2].prefix_tokens, r[2].new_tokens), (1023, 1));
        let e = mooncake_trace("{\"timestamp\": 1}", 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1"), "{e}");
        assert!(mooncake_trace("", 1.0).is_err());
    }
}
