//! The benchmark's HTTP client for vLLM's OpenAI-compatible server: health, Prometheus
//! metrics, and streamed completions timed at the client (hyper over one TCP connection per
//! request).

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// One response: status and body.
async fn send(
    port: u16,
    req: Request<Full<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>> {
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .with_context(|| format!("connect to 127.0.0.1:{port}"))?;
    tcp.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender.send_request(req).await?)
}

fn get(port: u16, path: &str) -> Result<Request<Full<Bytes>>> {
    Ok(Request::get(path)
        .header("host", format!("127.0.0.1:{port}"))
        .body(Full::new(Bytes::new()))?)
}

/// `GET /health` answers 200.
pub async fn healthy(port: u16) -> bool {
    let Ok(req) = get(port, "/health") else {
        return false;
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), send(port, req)).await,
        Ok(Ok(r)) if r.status() == 200
    )
}

/// `GET /metrics`: as [`metrics_at`].
pub async fn metrics(port: u16) -> Result<HashMap<String, f64>> {
    metrics_at(port, "/metrics").await
}

/// `GET path` of a Prometheus text exposition (vLLM's `/metrics`, the ObjectCache server's
/// `/_objectcache/metrics`): every sample summed by metric name (labels dropped), and each
/// labelled sample under its whole series name too (`name{label="value"}`, as written).
pub async fn metrics_at(port: u16, path: &str) -> Result<HashMap<String, f64>> {
    let r = send(port, get(port, path)?).await?;
    let body = r.into_body().collect().await?.to_bytes();
    let mut out = HashMap::new();
    for line in String::from_utf8_lossy(&body).lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series);
        if let Ok(v) = value.parse::<f64>() {
            *out.entry(name.to_string()).or_insert(0.0) += v;
            if name != series {
                out.insert(series.to_string(), v);
            }
        }
    }
    Ok(out)
}

/// How much counter `key` grew from `before` to `after` (two [`metrics_at`] reads; a counter
/// absent counts as 0, one that went down as no growth).
pub(crate) fn delta(before: &HashMap<String, f64>, after: &HashMap<String, f64>, key: &str) -> u64 {
    delta_f64(before, after, key).round() as u64
}

/// [`delta`] unrounded: how much a counter of seconds (or a histogram's `_sum`) grew.
pub(crate) fn delta_f64(
    before: &HashMap<String, f64>,
    after: &HashMap<String, f64>,
    key: &str,
) -> f64 {
    let g = |m: &HashMap<String, f64>| m.get(key).copied().unwrap_or(0.0);
    (g(after) - g(before)).max(0.0)
}

/// A streamed completion as the client saw it.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Seconds from sending the request to the first streamed token.
    pub ttft_s: f64,
    /// The generated text.
    pub text: String,
    /// `usage.prompt_tokens_details.cached_tokens` (prefix-cache and connector hits).
    pub cached_tokens: Option<u64>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
}

/// `POST /v1/completions` with `stream: true` (greedy, `max_tokens`), the prompt given as
/// token ids; times the first streamed token at the client.
pub async fn complete(
    port: u16,
    model: &str,
    prompt: &[u32],
    max_tokens: u32,
) -> Result<Completion> {
    let body = serde_json::json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let req = Request::post("/v1/completions")
        .header("host", format!("127.0.0.1:{port}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let t0 = Instant::now();
    let r = send(port, req).await?;
    let status = r.status();
    let mut body = r.into_body();
    if status != 200 {
        let b = body.collect().await?.to_bytes();
        bail!("completion: HTTP {status}: {}", String::from_utf8_lossy(&b));
    }
    let mut buf = Vec::new();
    let mut ttft = None;
    let mut text = String::new();
    let (mut cached, mut prompt_tokens) = (None, None);
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        // Server-sent events: `data: {json}\n\n` ... `data: [DONE]\n\n`.
        while let Some(end) = find(&buf, b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let line = String::from_utf8_lossy(&event);
            let Some(payload) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            if payload == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(payload).with_context(|| format!("event {payload:?}"))?;
            if let Some(ch) = v["choices"].as_array().and_then(|c| c.first()) {
                if ttft.is_none() {
                    ttft = Some(t0.elapsed().as_secs_f64());
                }
                text.push_str(ch["text"].as_str().unwrap_or(""));
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                prompt_tokens = u["prompt_tokens"].as_u64();
                cached = u["prompt_tokens_details"]["cached_tokens"].as_u64();
            }
        }
    }
    if !done {
        bail!("completion stream ended without [DONE]");
    }
    Ok(Completion {
        ttft_s: ttft.ok_or_else(|| anyhow!("completion streamed no token"))?,
        text,
        cached_tokens: cached,
        prompt_tokens,
    })
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}
