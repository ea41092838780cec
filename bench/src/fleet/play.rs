//! Plays a trace against the replicas: one task per session, each sending its turns one after
//! another (streamed completions, timed at the client) to the replica its router picks, and
//! waiting its think time after each response.

use super::router::Router;
use super::trace::{block_hashes, Trace};
use crate::vllm::http;
use anyhow::{Context, Result};
use indicatif::ProgressBar;
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One request as the client saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The turn's id in the trace.
    pub id: usize,
    /// The replica that served it (index).
    pub replica: usize,
    /// Seconds from the pass's start to sending it.
    pub sent_s: f64,
    /// Seconds from sending it to its first streamed token.
    pub ttft_s: f64,
    /// Seconds from sending it to the end of its response.
    pub done_s: f64,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`: the tokens vLLM's prefix cache and the
    /// connector supplied together.
    pub cached_tokens: u64,
    /// The greedy output.
    pub text: String,
}

/// Sends every request of `trace` to the replicas listening on `ports` (the model `model`,
/// greedy, `max_tokens` each), routed by `router` with the requests in flight per replica
/// that this client counts; returns the outcomes by id.
///
/// # Errors
/// A request that fails (the first one, with its id and replica).
pub async fn play(
    trace: &Trace,
    ports: &[u16],
    model: &str,
    max_tokens: u32,
    block: usize,
    router: Router,
    pb: &ProgressBar,
) -> Result<Vec<Outcome>> {
    struct State {
        router: Router,
        loads: Vec<usize>,
    }
    let st = Arc::new(Mutex::new(State {
        router,
        loads: vec![0; ports.len()],
    }));
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for s in trace.sessions.clone() {
        let (st, ports, model, pb) = (st.clone(), ports.to_vec(), model.to_string(), pb.clone());
        tasks.spawn(async move {
            tokio::time::sleep_until((t0 + Duration::from_secs_f64(s.start_s)).into()).await;
            let mut out = Vec::new();
            for t in &s.turns {
                tokio::time::sleep(Duration::from_secs_f64(t.think_s)).await;
                let blocks = block_hashes(&t.prompt, block);
                let r = {
                    let mut g = st.lock().expect("router lock");
                    let g = &mut *g;
                    let r = g.router.pick(&blocks, &g.loads);
                    g.loads[r] += 1;
                    r
                };
                let sent = t0.elapsed().as_secs_f64();
                let c = http::complete(ports[r], &model, &t.prompt, max_tokens).await;
                st.lock().expect("router lock").loads[r] -= 1;
                let c = c.with_context(|| format!("request {} to replica {r}", t.id))?;
                pb.inc(1);
                out.push(Outcome {
                    id: t.id,
                    replica: r,
                    sent_s: sent,
                    ttft_s: c.ttft_s,
                    done_s: t0.elapsed().as_secs_f64() - sent,
                    prompt_tokens: c.prompt_tokens.unwrap_or(t.prompt.len() as u64),
                    cached_tokens: c.cached_tokens.unwrap_or(0),
                    text: c.text,
                });
            }
            anyhow::Ok(out)
        });
    }
    let mut all = Vec::new();
    while let Some(r) = tasks.join_next().await {
        all.extend(r.context("a session's task")??);
    }
    all.sort_by_key(|o| o.id);
    Ok(all)
}
