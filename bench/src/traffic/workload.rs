//! The workloads: seeded chains of chunk hashes, Zipf-popular prefixes at once or as a
//! Poisson stream ([`synthetic`]), the repository's Mooncake-style trace ([`trace`]), and the
//! KV bytes of each chunk.

use super::TrafficArgs;
use objectcache::{ChunkHash, KvGeometry};
use sha2::{Digest, Sha256};
use std::collections::HashSet;

/// One request of a workload: when, and which chunks (the leading chunks of a chain).
#[derive(Debug, Clone)]
pub(super) struct Req {
    pub(super) arrival_s: f64,
    pub(super) hashes: Vec<ChunkHash>,
}

fn chain(seed: &[u8], chunks: usize) -> Vec<ChunkHash> {
    let mut h = Sha256::digest(seed).into();
    (0..chunks)
        .map(|i| {
            let mut d = Sha256::new();
            d.update(h);
            d.update((i as u64).to_le_bytes());
            h = d.finalize().into();
            ChunkHash::from_digest(h)
        })
        .collect()
}

/// A small seeded generator (SplitMix64): the same seed gives the same workload everywhere.
struct SplitMix(u64);

impl SplitMix {
    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf-popular prefixes, `n` requests: at once (`burst`) or as a Poisson stream.
pub(super) fn synthetic(args: &TrafficArgs, g: &KvGeometry, poisson: bool) -> Vec<Req> {
    let mut rng = SplitMix(args.seed);
    let prefixes: Vec<Vec<ChunkHash>> = (0..args.prefixes)
        .map(|p| {
            let c = args.prefix_chunks[p % args.prefix_chunks.len()];
            chain(format!("traffic-prefix-{p}").as_bytes(), c)
        })
        .collect();
    let w: Vec<f64> = (1..=args.prefixes)
        .map(|r| (r as f64).powf(-args.zipf))
        .collect();
    let total: f64 = w.iter().sum();
    let pick = |rng: &mut SplitMix| {
        let mut x = rng.next_f64() * total;
        for (i, wi) in w.iter().enumerate() {
            if x < *wi {
                return i;
            }
            x -= wi;
        }
        w.len() - 1
    };
    let picks: Vec<usize> = (0..args.requests).map(|_| pick(&mut rng)).collect();
    let bytes_per_chunk = (g.slice_bytes() * g.layers as u64) as f64;
    let mean_bytes = picks
        .iter()
        .map(|&p| prefixes[p].len() as f64 * bytes_per_chunk)
        .sum::<f64>()
        / picks.len().max(1) as f64;
    let rate = args.load * args.cap as f64 / mean_bytes.max(1.0);
    let mut t = 0.0;
    picks
        .into_iter()
        .map(|p| {
            if poisson {
                t += -(1.0 - rng.next_f64()).ln() / rate;
            }
            Req {
                arrival_s: t,
                hashes: prefixes[p].clone(),
            }
        })
        .collect()
}

/// The repository's Mooncake-style trace: each request loads its cached prefix.
pub(super) fn trace(args: &TrafficArgs, g: &KvGeometry) -> anyhow::Result<Vec<Req>> {
    #[derive(serde::Deserialize)]
    struct Line {
        timestamp: f64,
        hash_ids: Vec<u64>,
        input_length: u64,
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/data/traces/mooncake_small.jsonl"
    );
    let text = std::fs::read_to_string(path)?;
    let per_block = (512 / g.tokens_per_chunk).max(1) as usize;
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Vec::new();
    let mut t0 = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let r: Line = serde_json::from_str(line)?;
        let start = *t0.get_or_insert(r.timestamp);
        let hit = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count();
        seen.extend(r.hash_ids.iter().copied());
        let chunks = (hit * per_block)
            .min(((r.input_length - 1) / g.tokens_per_chunk as u64) as usize)
            .min(args.max_chunks);
        if chunks == 0 {
            continue;
        }
        // Chunk i's hash depends on every block before it (equal ids, equal prefix).
        let mut hashes = Vec::with_capacity(chunks);
        let mut h: [u8; 32] = Sha256::digest(b"traffic-trace").into();
        for i in 0..chunks {
            let mut d = Sha256::new();
            d.update(h);
            d.update(r.hash_ids[i / per_block].to_le_bytes());
            d.update(((i % per_block) as u64).to_le_bytes());
            h = d.finalize().into();
            hashes.push(ChunkHash::from_digest(h));
        }
        out.push(Req {
            arrival_s: (r.timestamp - start) / 1000.0 * args.trace_time_scale,
            hashes,
        });
    }
    Ok(out)
}

/// Deterministic KV bytes of one chunk's layers.
pub(super) fn chunk_layers(g: &KvGeometry, h: &ChunkHash) -> Vec<Vec<u8>> {
    let slice = g.slice_bytes() as usize;
    (0..g.layers)
        .map(|l| {
            let mut v = vec![0u8; slice];
            let mut x =
                u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes")) ^ l as u64;
            for w in v.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
            }
            v
        })
        .collect()
}
