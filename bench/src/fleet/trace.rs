//! The fleet benchmark's traces, generated from a seed: sessions of turns whose prompts are
//! token ids, and what an ideal cache would hit of them.
//!
//! - `chat`: sessions arrive as a Poisson stream; every session starts with one system
//!   prompt shared by all, then each turn resends the whole conversation with an assistant
//!   reply and a new user message appended, after a think time (exponential).
//! - `agent`: tool-use loops: a long shared tool-specification prompt, then each turn appends
//!   a short tool call and a long tool result and resends everything at once (think times of
//!   a tool's latency, exponential, short).
//! - `docs`: single requests, a Poisson stream, each a question on one of a few long
//!   documents picked by Zipf popularity.
//!
//! The structure (arrivals, lengths, think times) comes from `seed` alone; the token ids from
//! `seed` and a salt, so that two passes of one trace on the same replicas share no prefix
//! ([`generate`]). Prompts never depend on what the model answered: the appended assistant
//! replies are tokens of the trace, so every method sends the same requests.

use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, Uniform, Zipf};
use serde::Serialize;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};

/// The trace kinds.
pub const KINDS: &[&str] = &["chat", "agent", "docs"];

/// A trace's parameters (all in the JSON report). Lengths in tokens, times in seconds.
#[derive(Debug, Clone, Serialize)]
pub struct TraceParams {
    /// `chat`, `agent` or `docs`.
    pub kind: String,
    /// Sessions (`docs`: requests) started per second, a Poisson stream.
    pub rate_per_s: f64,
    /// The prompt every session starts with (`docs`: none), tokens.
    pub system_tokens: u32,
    /// Turns per session, uniform in this range (inclusive).
    pub turns: (u32, u32),
    /// The first turn's own message, uniform (inclusive), tokens.
    pub first_tokens: (u32, u32),
    /// What each later turn appends (an assistant reply, or a tool call), uniform, tokens.
    pub reply_tokens: (u32, u32),
    /// What each later turn appends after it (a user message, or a tool's result), tokens.
    pub message_tokens: (u32, u32),
    /// Mean think time between a response and the session's next request (exponential), s.
    pub think_mean_s: f64,
    /// `docs`: documents, their length (uniform, tokens) and the Zipf exponent of their
    /// popularity.
    pub documents: u32,
    pub document_tokens: (u32, u32),
    pub zipf: f64,
    /// Requests in the trace (sessions are cut at this many turns in all).
    pub requests: usize,
    pub seed: u64,
}

impl TraceParams {
    /// The defaults of `kind` with `requests` requests: sized for a small model of an 8K
    /// context on a few CPU cores.
    pub fn of(kind: &str, requests: usize, seed: u64) -> TraceParams {
        let base = TraceParams {
            kind: kind.into(),
            rate_per_s: 0.5,
            system_tokens: 0,
            turns: (1, 1),
            first_tokens: (0, 0),
            reply_tokens: (0, 0),
            message_tokens: (0, 0),
            think_mean_s: 0.0,
            documents: 0,
            document_tokens: (0, 0),
            zipf: 0.0,
            requests,
            seed,
        };
        match kind {
            "chat" => TraceParams {
                rate_per_s: 0.5,
                system_tokens: 256,
                turns: (3, 6),
                first_tokens: (64, 256),
                reply_tokens: (64, 192),
                message_tokens: (32, 128),
                think_mean_s: 2.0,
                ..base
            },
            "agent" => TraceParams {
                rate_per_s: 0.25,
                system_tokens: 1024,
                turns: (4, 8),
                first_tokens: (128, 256),
                reply_tokens: (32, 64),
                message_tokens: (128, 512),
                think_mean_s: 0.3,
                ..base
            },
            _ => TraceParams {
                rate_per_s: 1.0,
                first_tokens: (32, 96),
                documents: 6,
                document_tokens: (1536, 3072),
                zipf: 1.1,
                ..base
            },
        }
    }
}

/// One request of a session.
#[derive(Debug, Clone)]
pub struct Turn {
    /// Index in the trace (the order in which an ideal fleet would see it).
    pub id: usize,
    /// The prompt, token ids.
    pub prompt: Vec<u32>,
    /// Seconds between the previous turn's response and this request (0 for the first).
    pub think_s: f64,
}

/// A session: its first request's arrival and its turns, sent one after another.
#[derive(Debug, Clone)]
pub struct Session {
    /// Seconds from the trace's start.
    pub start_s: f64,
    pub turns: Vec<Turn>,
}

/// A generated trace.
#[derive(Debug, Clone)]
pub struct Trace {
    pub params: TraceParams,
    pub sessions: Vec<Session>,
}

impl Trace {
    /// Requests in the trace.
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    /// Every turn, by id.
    pub fn turns(&self) -> Vec<&Turn> {
        let mut v: Vec<&Turn> = self.sessions.iter().flat_map(|s| s.turns.iter()).collect();
        v.sort_by_key(|t| t.id);
        v
    }
}

/// Token ids a trace draws from: ids from 1,000 on (past a tokenizer's special and byte
/// tokens), below `vocab` and 40,000.
fn token_range(vocab: u32) -> Uniform<u32> {
    Uniform::new(1000, vocab.clamp(1001, 40_000)).expect("a non-empty token range")
}

fn between(rng: &mut ChaCha8Rng, (lo, hi): (u32, u32)) -> u32 {
    Uniform::new_inclusive(lo, hi.max(lo))
        .expect("lo <= hi")
        .sample(rng)
}

/// Generates the trace `p` describes, with tokens below `vocab`; `salt` changes the tokens
/// and nothing else.
pub fn generate(p: &TraceParams, vocab: u32, salt: u64) -> Trace {
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let mut tok_rng = ChaCha8Rng::seed_from_u64(p.seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let toks = token_range(vocab);
    let mut words = |n: u32| -> Vec<u32> { (0..n).map(|_| toks.sample(&mut tok_rng)).collect() };
    let arrivals = Exp::new(p.rate_per_s.max(1e-6)).expect("a positive rate");
    let think = Exp::new(1.0 / p.think_mean_s.max(1e-6)).expect("a positive mean");
    let system = words(p.system_tokens);
    let docs: Vec<Vec<u32>> = (0..p.documents)
        .map(|_| {
            let n = between(&mut rng, p.document_tokens);
            words(n)
        })
        .collect();
    let popularity = (p.documents > 0)
        .then(|| Zipf::new(p.documents as f64, p.zipf).expect("a valid Zipf distribution"));
    let mut sessions = Vec::new();
    let (mut t, mut n) = (0.0, 0usize);
    // Turns are numbered in the order an ideal fleet would see them: by each turn's arrival
    // when every response is instant (the session's start plus its think times).
    let mut order: Vec<(f64, usize, usize)> = Vec::new();
    while n < p.requests {
        t += arrivals.sample(&mut rng);
        let turns = between(&mut rng, p.turns).min((p.requests - n) as u32);
        let mut prompt = match &popularity {
            Some(z) => docs[z.sample(&mut rng) as usize - 1].clone(),
            None => system.clone(),
        };
        let mut s = Session {
            start_s: t,
            turns: Vec::new(),
        };
        let mut at = t;
        for k in 0..turns {
            let think_s = if k == 0 {
                prompt.extend(words(between(&mut rng, p.first_tokens)));
                0.0
            } else {
                prompt.extend(words(between(&mut rng, p.reply_tokens)));
                prompt.extend(words(between(&mut rng, p.message_tokens)));
                think.sample(&mut rng)
            };
            at += think_s;
            order.push((at, sessions.len(), k as usize));
            s.turns.push(Turn {
                id: 0,
                prompt: prompt.clone(),
                think_s,
            });
        }
        n += turns as usize;
        sessions.push(s);
    }
    order.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (id, &(_, s, k)) in order.iter().enumerate() {
        sessions[s].turns[k].id = id;
    }
    Trace {
        params: p.clone(),
        sessions,
    }
}

/// The chained hashes of a prompt's full blocks of `block` tokens: entry `i` names tokens
/// `0..(i + 1) * block` (the way vLLM's block hashes name a prefix), for matching prefixes.
pub fn block_hashes(prompt: &[u32], block: usize) -> Vec<u64> {
    let mut prev = 0u64;
    prompt
        .chunks_exact(block)
        .map(|b| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (prev, b).hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

/// Tokens a prefix cache can supply of a prompt of `len` tokens whose first `blocks` blocks
/// it holds: whole blocks, and never the prompt's last token (vLLM computes at least one).
pub fn cacheable(len: usize, blocks: usize, block: usize) -> usize {
    (blocks * block).min(len.saturating_sub(1) / block * block)
}

/// What an ideal cache (infinite, shared by every replica, filled the moment a request
/// arrives) supplies of the trace: `(hit tokens per request by id, the distinct blocks hit)`.
pub fn ideal(trace: &Trace, block: usize) -> (Vec<usize>, usize) {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut used: HashSet<u64> = HashSet::new();
    let mut hits = Vec::new();
    for t in trace.turns() {
        let hs = block_hashes(&t.prompt, block);
        let held = hs.iter().take_while(|h| seen.contains(h)).count();
        let tokens = cacheable(t.prompt.len(), held, block);
        used.extend(hs.iter().take(tokens / block));
        hits.push(tokens);
        seen.extend(hs);
    }
    (hits, used.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structure_is_the_seeds_and_tokens_the_salts() {
        for kind in KINDS {
            let p = TraceParams::of(kind, 30, 7);
            let a = generate(&p, 49152, 0);
            let b = generate(&p, 49152, 1);
            assert_eq!(a.requests(), 30, "{kind}");
            let (ta, tb) = (a.turns(), b.turns());
            assert!(ta
                .iter()
                .zip(&tb)
                .all(|(x, y)| x.prompt.len() == y.prompt.len()));
            assert!(ta.iter().zip(&tb).all(|(x, y)| x.prompt != y.prompt));
            assert_eq!(
                ta.iter().map(|t| t.prompt.clone()).collect::<Vec<_>>(),
                generate(&p, 49152, 0)
                    .turns()
                    .iter()
                    .map(|t| t.prompt.clone())
                    .collect::<Vec<_>>()
            );
            assert!(ta.iter().all(|t| t.prompt.len() + 64 < 8192), "{kind}");
        }
    }

    #[test]
    fn sessions_grow_and_the_ideal_counts_what_earlier_requests_hold() {
        let p = TraceParams::of("chat", 20, 3);
        let tr = generate(&p, 49152, 0);
        for s in &tr.sessions {
            for w in s.turns.windows(2) {
                assert!(w[1].prompt.starts_with(&w[0].prompt));
                assert!(w[1].id > w[0].id);
            }
        }
        let (hits, blocks) = ideal(&tr, 128);
        let turns = tr.turns();
        // The first request hits nothing; a session's later turn holds at least its
        // previous turn's whole blocks.
        assert_eq!(hits[0], 0);
        for s in &tr.sessions {
            for w in s.turns.windows(2) {
                assert!(hits[w[1].id] >= w[0].prompt.len() / 128 * 128);
            }
        }
        assert!(blocks > 0);
        assert!(hits.iter().zip(&turns).all(|(h, t)| *h < t.prompt.len()));
        assert_eq!(cacheable(256, 2, 128), 128, "the last token is computed");
        assert_eq!(cacheable(257, 2, 128), 256);
    }
}
