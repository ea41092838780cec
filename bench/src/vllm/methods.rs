//! The timed runs of each method ([`Bench`]): request A served (and saved) in one vLLM
//! process, request B and its paired miss timed in a fresh one, for `recompute`, `apc`, the
//! ObjectCache stores and the peer connectors; one record per method and prefix.

use super::process::{Env, Vllm};
use super::prompts::Prompts;
use super::setup::spinner;
use super::{http, ModelSpec, Record, Replica, VllmArgs, BLOCK, NAMESPACE};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use objectcache::store::open_store;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub(super) struct Bench<'a> {
    pub(super) a: &'a VllmArgs,
    pub(super) env: &'a mut Env,
    pub(super) rt: &'a tokio::runtime::Runtime,
    pub(super) prompts: &'a Prompts,
    /// recompute's output text per (prefix, run).
    pub(super) reference: HashMap<(u32, usize), String>,
    /// `apc`'s outputs, by (prefix, run).
    pub(super) apc_reference: HashMap<(u32, usize), String>,
    pub(super) records: Vec<Record>,
    pub(super) replicas: Vec<Replica>,
    pub(super) tmp: PathBuf,
    pub(super) methods: Vec<String>,
    /// The model run.
    pub(super) spec: ModelSpec,
    /// The hybrid KV cache manager setting of the connector methods running now.
    pub(super) hma: Option<String>,
    /// Bytes the last saver stored per store and prefix token (ObjectCache methods).
    pub(super) stored_per_token: Option<f64>,
    /// Port of our server (`objectcache-server`), whose metrics count each load's requests.
    pub(super) server_port: Option<u16>,
}

/// The server's requests a load sends (`objectcache_server_requests_total` by `op`): the
/// gather request, and the GETs and HEADs of the lookup and of ranged reads. Each is one
/// GET-class request at object storage's prices ([`crate::cost`]); saves (`save`,
/// `put_object`) are not part of a load.
const LOAD_REQUESTS: &[&str] = &["gather", "get_object", "head_object"];

/// GET-class requests counted by the server's metrics `after` over `before` (see
/// [`LOAD_REQUESTS`]).
fn load_requests(before: &HashMap<String, f64>, after: &HashMap<String, f64>) -> u64 {
    LOAD_REQUESTS
        .iter()
        .map(|op| {
            let key = format!("objectcache_server_requests_total{{op=\"{op}\"}}");
            http::delta(before, after, &key)
        })
        .sum()
}

/// Prometheus counters that count a connector's loaded bytes.
const LOADED_BYTES: &[&str] = &[
    "vllm:objectcache_loaded_bytes_total",
    "vllm:kv_offload_load_bytes_total",
];

impl Bench<'_> {
    /// A record of `method` at prefix `p` with no figures yet: `note` says why, when it is
    /// one that did not run.
    pub(super) fn record(&self, method: &str, p: u32, note: impl Into<Option<String>>) -> Record {
        let conn = method.starts_with("objectcache");
        Record {
            method: method.into(),
            model: self
                .a
                .model
                .clone()
                .unwrap_or_else(|| self.spec.name.into()),
            family: self.spec.family.into(),
            hma: if conn { self.hma.clone() } else { None },
            tp: self.a.tp,
            prefix_tokens: p,
            new_tokens: self.a.new_tokens,
            ttft_s: None,
            ttft_runs_s: vec![],
            external_hit_tokens: None,
            local_hit_tokens: None,
            bytes_loaded: None,
            bytes_stored: None,
            store_requests: None,
            cost: None,
            output_identical: None,
            output_matches_apc: None,
            runs: 0,
            ttft_miss_s: None,
            paired_ratio: None,
            vs_recompute: None,
            vs_recompute_process: None,
            vs_apc: None,
            note: note.into(),
        }
    }

    fn start(&mut self, label: &str, apc: bool, kv: Option<&serde_json::Value>) -> Result<Vllm> {
        let v = Vllm::start(self.env, self.rt, label, apc, kv)?;
        self.replicas.push(Replica {
            label: label.into(),
            startup_s: v.startup_s,
        });
        // The first request of a fresh process pays one-time costs: not timed.
        self.rt
            .block_on(http::complete(
                v.port,
                &self.model(),
                &self.prompts.warmup,
                2,
            ))
            .with_context(|| format!("warm-up request to vLLM ({label})"))?;
        Ok(v)
    }

    fn model(&self) -> String {
        self.env.model.display().to_string()
    }

    /// Serves request A of every prefix (computed, and saved by a connector if any).
    fn serve_a(&mut self, v: &Vllm) -> Result<()> {
        let pb = self.bar(self.a.prefixes.len(), &format!("{}: request A", v.label));
        for &p in &self.a.prefixes.clone() {
            self.rt
                .block_on(http::complete(
                    v.port,
                    &self.model(),
                    &self.prompts.a(p),
                    self.a.max_tokens,
                ))
                .with_context(|| format!("request A ({p} tokens) to vLLM ({})", v.label))?;
            pb.inc(1);
        }
        pb.finish_and_clear();
        Ok(())
    }

    fn bar(&self, n: usize, msg: &str) -> ProgressBar {
        let pb = self.env.mp.add(ProgressBar::new(n as u64));
        pb.set_style(
            ProgressStyle::with_template("{msg:<40} [{bar:30}] {pos}/{len} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        pb.set_message(msg.to_string());
        pb
    }

    /// Times request B of every prefix and run on `v`; one record per prefix.
    fn time_b(&mut self, v: &Vllm, method: &str, note: Option<String>) -> Result<()> {
        let runs = self.a.runs;
        let pb = self.bar(
            self.a.prefixes.len() * runs,
            &format!("{method}: request B (and a miss)"),
        );
        for &p in &self.a.prefixes.clone() {
            let (mut ttfts, mut ext, mut local, mut bytes) = (vec![], vec![], vec![], vec![]);
            let (mut misses, mut ratios, mut requests) = (vec![], vec![], vec![]);
            // Our server counts the requests of B's lookup and load.
            let server = self.server_port.filter(|_| method == "objectcache-server");
            let mut identical = Some(true);
            let mut matches_apc = (method != "recompute" && method != "apc").then_some(true);
            for r in 0..runs {
                let server_before = match server {
                    Some(port) => Some(
                        self.rt
                            .block_on(http::metrics_at(port, "/_objectcache/metrics"))?,
                    ),
                    None => None,
                };
                let before = self.rt.block_on(http::metrics(v.port))?;
                let c = self
                    .rt
                    .block_on(http::complete(
                        v.port,
                        &self.model(),
                        &self.prompts.b(p, r),
                        self.a.max_tokens,
                    ))
                    .with_context(|| format!("request B ({p} tokens) to vLLM ({})", v.label))?;
                let after = self.rt.block_on(http::metrics(v.port))?;
                if let (Some(port), Some(b)) = (server, &server_before) {
                    let a = self
                        .rt
                        .block_on(http::metrics_at(port, "/_objectcache/metrics"))?;
                    requests.push(load_requests(b, &a));
                }
                let sent = self.prompts.b(p, r).len() as u64;
                if c.prompt_tokens != Some(sent) {
                    bail!(
                        "vLLM ({}) counted {:?} prompt tokens for a prompt of {sent}",
                        v.label,
                        c.prompt_tokens
                    );
                }
                ttfts.push(c.ttft_s);
                let cached = c.cached_tokens.unwrap_or(0);
                if method == "apc" {
                    local.push(cached);
                    ext.push(0);
                } else {
                    ext.push(cached);
                }
                if let Some(b) = LOADED_BYTES.iter().find(|n| after.contains_key(**n)) {
                    bytes.push(http::delta(&before, &after, b));
                }
                if method == "apc" {
                    self.apc_reference.insert((p, r), c.text.clone());
                }
                if method == "recompute" {
                    self.reference.insert((p, r), c.text.clone());
                } else {
                    // The paired full computation in the same process, right after: a prompt
                    // of the same length whose first token differs (a miss for every cache).
                    let m = self
                        .rt
                        .block_on(http::complete(
                            v.port,
                            &self.model(),
                            &self.prompts.miss(p, r, method),
                            self.a.max_tokens,
                        ))
                        .with_context(|| {
                            format!("paired miss ({p} tokens) to vLLM ({})", v.label)
                        })?;
                    if m.cached_tokens.unwrap_or(0) != 0 {
                        bail!(
                            "vLLM ({}): the paired miss hit {:?} cached tokens",
                            v.label,
                            m.cached_tokens
                        );
                    }
                    misses.push(m.ttft_s);
                    ratios.push(c.ttft_s / m.ttft_s);
                }
                identical = match (identical, self.reference.get(&(p, r))) {
                    (Some(i), Some(want)) => Some(i && *want == c.text),
                    _ => None,
                };
                matches_apc = match (matches_apc, self.apc_reference.get(&(p, r))) {
                    (Some(i), Some(want)) => Some(i && *want == c.text),
                    _ => None,
                };
                pb.inc(1);
            }
            let stored = self
                .stored_per_token
                .filter(|_| method.starts_with("objectcache"))
                .map(|b| (b * f64::from(p)).round() as u64);
            let bytes_loaded = (!bytes.is_empty()).then(|| median_u(&bytes));
            let store_requests = (!requests.is_empty()).then(|| median_u(&requests));
            // Billed where a store counted the requests (our server): in the store's region,
            // so the bytes are free and the requests are the bill.
            let cost = store_requests.map(|n| {
                crate::cost::S3_STANDARD.cost(
                    true,
                    n,
                    bytes_loaded.unwrap_or(0),
                    0,
                    stored.unwrap_or(0),
                )
            });
            self.records.push(Record {
                ttft_s: Some(median_f(&ttfts)),
                ttft_runs_s: ttfts,
                ttft_miss_s: (!misses.is_empty()).then(|| median_f(&misses)),
                paired_ratio: (!ratios.is_empty()).then(|| median_f(&ratios)),
                external_hit_tokens: Some(median_u(&ext)),
                local_hit_tokens: (!local.is_empty()).then(|| median_u(&local)),
                bytes_loaded,
                bytes_stored: stored,
                store_requests,
                cost,
                output_identical: identical,
                output_matches_apc: matches_apc,
                runs,
                ..self.record(method, p, note.clone())
            });
        }
        pb.finish_and_clear();
        Ok(())
    }

    /// `recompute` (no connector, no prefix cache) or `apc` (vLLM's prefix cache, A first).
    pub(super) fn plain(&mut self, method: &str, apc: bool) -> Result<()> {
        let v = self.start(method, apc, None)?;
        if apc {
            self.serve_a(&v)?;
        }
        self.time_b(&v, method, None)?;
        v.stop()
    }

    /// The ObjectCache methods: one saver replica writes every store (MultiConnector), then a
    /// fresh replica per store times B.
    pub(super) fn objectcache(
        &mut self,
        stores: &[(String, String)],
        async_file: bool,
    ) -> Result<()> {
        // `--connector-setting KEY=VALUE`, added to every ObjectCache connector's settings.
        let extra = connector_settings(&self.a.connector_settings)?;
        // One namespace per hybrid manager setting: each run starts from an empty store.
        let namespace = match self.hma.as_deref() {
            Some("off") => format!("{NAMESPACE}-hma-off"),
            _ => NAMESPACE.to_string(),
        };
        let settings = |mut base: serde_json::Value| {
            if let Some(m) = base.as_object_mut() {
                m.extend(extra.clone());
            }
            base
        };
        let subs: Vec<serde_json::Value> = stores
            .iter()
            .map(|(_, url)| {
                serde_json::json!({
                    "kv_connector": "ObjectCacheConnector",
                    "kv_connector_module_path": "objectcache.vllm",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": settings(serde_json::json!({"store": url, "namespace": namespace})),
                })
            })
            .collect();
        let saver_cfg = serde_json::json!({
            "kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": subs},
        });
        let suffix = if self.env.hma_off { "-hma-off" } else { "" };
        let saver = self.start(
            &format!("objectcache-saver{suffix}"),
            false,
            Some(&saver_cfg),
        )?;
        self.serve_a(&saver)?;
        // Saves run in the background after each forward pass: wait until every store
        // publishes every chunk of every prefix, in every KV cache group.
        let groups = if self.env.hma_off {
            1
        } else {
            self.spec.groups
        };
        let want: usize = groups
            * self
                .a
                .prefixes
                .iter()
                .map(|p| (p / BLOCK) as usize)
                .sum::<usize>();
        for (m, url) in stores {
            let s = spinner(
                &self.env.mp,
                format!("{m}: waiting for {want} chunks to be published"),
            );
            let r = self.rt.block_on(wait_published(url, &namespace, want));
            s.finish_and_clear();
            r.with_context(|| format!("{m}: saves"))?;
        }
        let saved = self.rt.block_on(http::metrics(saver.port))?;
        let tokens: u32 = self.a.prefixes.iter().sum();
        self.stored_per_token = saved
            .get("vllm:objectcache_saved_bytes_total")
            .map(|b| b / stores.len() as f64 / f64::from(tokens));
        saver.stop()?;
        let mut timed: Vec<(String, String, &str)> = Vec::new();
        for (m, url) in stores {
            if m == "objectcache-file" && !self.methods.iter().any(|x| x == m) {
                continue; // saved only for objectcache-file-async
            }
            timed.push((m.clone(), url.clone(), "layerwise"));
        }
        if async_file {
            if let Some((_, url)) = stores.iter().find(|(m, _)| m == "objectcache-file") {
                timed.push(("objectcache-file-async".into(), url.clone(), "async"));
            }
        }
        for (m, url, mode) in timed {
            let cfg = serde_json::json!({
                "kv_connector": "ObjectCacheConnector",
                "kv_connector_module_path": "objectcache.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": settings(serde_json::json!({"store": url, "namespace": namespace,
                                              "load_mode": mode, "save": false})),
            });
            let v = self.start(&format!("{m}{suffix}"), false, Some(&cfg))?;
            self.time_b(&v, &m, None)?;
            v.stop()?;
        }
        Ok(())
    }

    /// A peer connector: saver and timed replica with the same configuration. A peer that
    /// does not start, or fails a request (vLLM's ExampleConnector fails prefixes longer than
    /// one prefill step on the CPU), becomes a record saying why for every prefix it has no
    /// figure for; the run goes on with the other methods.
    fn peer(&mut self, method: &str, cfg: serde_json::Value, note: Option<String>) -> Result<()> {
        let before = self.records.len();
        if let Err(e) = self.peer_run(method, cfg, note) {
            let why = format!("fails on this CPU vLLM: {}", one_line(&e));
            eprintln!("objectcache-bench: {method}: {why}");
            let done: Vec<u32> = self.records[before..]
                .iter()
                .filter(|r| r.method == method)
                .map(|r| r.prefix_tokens)
                .collect();
            for &p in &self.a.prefixes.clone() {
                if !done.contains(&p) {
                    let r = self.record(method, p, why.clone());
                    self.records.push(r);
                }
            }
        }
        Ok(())
    }

    fn peer_run(
        &mut self,
        method: &str,
        cfg: serde_json::Value,
        note: Option<String>,
    ) -> Result<()> {
        let saver = self.start(&format!("{method}-saver"), false, Some(&cfg))?;
        self.serve_a(&saver)?;
        saver.stop()?;
        let v = self.start(method, false, Some(&cfg))?;
        self.time_b(&v, method, note)?;
        v.stop()
    }

    pub(super) fn cpu_offload(&mut self) -> Result<()> {
        let cfg = serde_json::json!({
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1u64 << 30},
        });
        self.peer(
            "vllm-cpu-offload",
            cfg,
            Some("vLLM's CPU offloading keeps KV in its own process's memory: a fresh replica has none of it".into()),
        )
    }

    /// vLLM's ExampleConnector, with chunked prefill's step raised to the context length
    /// (`--max-num-batched-tokens`): the connector saves and loads a prompt's KV in one piece
    /// per forward pass, and a prompt prefilled in several steps (vLLM's CPU default is 2,048
    /// tokens per step) failed its load ("value tensor of shape [2048, 3, 128] cannot be
    /// broadcast to indexing result of shape [4096, 3, 128]"). Its records say so.
    pub(super) fn example(&mut self) -> Result<()> {
        let dir = self.tmp.join("example-connector");
        std::fs::create_dir_all(&dir)?;
        let cfg = serde_json::json!({
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": dir},
        });
        let step = self.env.max_len().to_string();
        let kept = self.env.extra_args.clone();
        self.env
            .extra_args
            .extend(["--max-num-batched-tokens".to_string(), step.clone()]);
        let r = self.peer(
            "vllm-example",
            cfg,
            Some(format!(
                "vLLM's ExampleConnector: one safetensors file per layer and prompt prefix, \
                 loaded whole before the forward pass; run with --max-num-batched-tokens \
                 {step} (one prefill step per prompt: it fails prompts prefilled in steps)"
            )),
        );
        self.env.extra_args = kept;
        r
    }

    /// LMCache (PyPI `lmcache`, through vLLM's `LMCacheConnectorV1`) with its local disk
    /// level, when the venv (or the caller's `PYTHONPATH`) has it: saver and timed replica
    /// share the disk folder. A record per prefix says why where it has no figure: not
    /// installed, or the errors LMCache logged. (LMCache 0.5.6 in vLLM 0.32's CPU build:
    /// "No supported cpu connector found": its KV connectors are for CUDA, XPU, MUSA and HPU
    /// devices; vLLM then serves every request without it.)
    pub(super) fn lmcache(&mut self) -> Result<()> {
        let version = std::process::Command::new(self.env.python())
            .args([
                "-c",
                "import lmcache, importlib.metadata as m; print(m.version('lmcache'))",
            ])
            .env("PYTHONPATH", self.env.python_path())
            .output()?;
        if !version.status.success() {
            let why = "LMCache is not installed: `pip install lmcache` into the vLLM venv (or \
                       name its folder in PYTHONPATH)"
                .to_string();
            for &p in &self.a.prefixes.clone() {
                let r = self.record("lmcache", p, why.clone());
                self.records.push(r);
            }
            return Ok(());
        }
        let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
        let dir = self.tmp.join("lmcache-disk");
        std::fs::create_dir_all(&dir)?;
        let cfg = serde_json::json!({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"});
        let kept = std::mem::replace(&mut self.env.extra_env, lmcache_env(&dir));
        let before = self.records.len();
        let r = self.peer(
            "lmcache",
            cfg,
            Some(format!(
                "LMCache {version}, local disk level, 256-token chunks"
            )),
        );
        self.env.extra_env = kept;
        r?;
        let mut errors = lmcache_errors(&self.env.logs().join("lmcache-saver.log"));
        for e in lmcache_errors(&self.env.logs().join("lmcache.log")) {
            if !errors.contains(&e) {
                errors.push(e);
            }
        }
        if !errors.is_empty() {
            let why = format!(
                "LMCache {version} did not start in this vLLM (every request computed in \
                 full): {}",
                errors.join("; ")
            );
            eprintln!("objectcache-bench: lmcache: {why}");
            for rec in &mut self.records[before..] {
                rec.note = Some(why.clone());
            }
        }
        Ok(())
    }
}

/// LMCache's settings for the `lmcache` method (environment, as LMCache reads them without a
/// configuration file): its default 256-token chunks, no CPU level (a fresh process would find
/// it empty), a local disk level of 5 GB under `dir`, shared by the saver and the timed
/// replica as ObjectCache's file store is.
fn lmcache_env(dir: &std::path::Path) -> Vec<(String, String)> {
    [
        ("LMCACHE_CHUNK_SIZE", "256".to_string()),
        ("LMCACHE_LOCAL_CPU", "False".to_string()),
        ("LMCACHE_LOCAL_DISK", format!("file://{}/", dir.display())),
        ("LMCACHE_MAX_LOCAL_DISK_SIZE", "5".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The errors LMCache logged in a process's log: for each `LMCache ERROR` line, the exception
/// its traceback names (`RuntimeError: ...`), else the line's message; terminal colour codes
/// and LMCache's `(file:line:module)` suffix dropped, duplicates once, at most three, each cut
/// to 200 characters.
fn lmcache_errors(log: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    // Colour codes: ESC [ ... m.
    let plain = |l: &str| -> String {
        let mut out = String::new();
        let mut it = l.chars();
        while let Some(c) = it.next() {
            if c == '\u{1b}' {
                for d in it.by_ref() {
                    if d == 'm' {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    };
    let lines: Vec<String> = text.lines().map(plain).collect();
    let mut out: Vec<String> = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some((_, msg)) = l.split_once("LMCache ERROR:") else {
            continue;
        };
        let exc = lines[i + 1..]
            .iter()
            .take(40)
            .take_while(|x| !x.contains("LMCache "))
            .find(|x| {
                let t = x.trim_start();
                !t.starts_with("File ")
                    && t.split_once(": ")
                        .is_some_and(|(k, _)| k.ends_with("Error"))
            });
        let e = match exc {
            Some(x) => x.trim().to_string(),
            None => msg
                .rsplit_once(" (")
                .map_or(msg, |(m, _)| m)
                .trim()
                .to_string(),
        };
        let e: String = e.chars().take(200).collect();
        if !out.contains(&e) {
            out.push(e);
        }
    }
    out.truncate(3);
    out
}

fn one_line(e: &anyhow::Error) -> String {
    let s = format!("{e:#}");
    let err = s
        .lines()
        .rev()
        .find(|l| l.contains("Error") || l.contains("error"))
        .unwrap_or_else(|| s.lines().next().unwrap_or(""));
    err.chars().take(300).collect()
}

/// Waits until at least `want` chunks are published under `namespace`.
async fn wait_published(url: &str, namespace: &str, want: usize) -> Result<()> {
    let store = open_store(url).await?;
    let t0 = Instant::now();
    loop {
        let n = store
            .list(&format!("{namespace}/"), usize::MAX)
            .await?
            .iter()
            .filter(|m| m.key.contains("/pub/"))
            .count();
        if n >= want {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("{n} of {want} chunks published after 600 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn median_f(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

fn median_u(v: &[u64]) -> u64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    s[s.len() / 2]
}

/// `--connector-setting KEY=VALUE` arguments (of `vllm` and `fleet`) as the JSON object added
/// to every ObjectCache connector's `kv_connector_extra_config` (values as strings: the
/// connector parses its settings, docs/vllm.md).
///
/// # Errors
/// An argument without `=`, named.
pub(crate) fn connector_settings(
    args: &[String],
) -> Result<serde_json::Map<String, serde_json::Value>> {
    let mut extra = serde_json::Map::new();
    for kv in args {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--connector-setting {kv:?} is not KEY=VALUE"))?;
        extra.insert(k.trim().to_string(), serde_json::Value::from(v.trim()));
    }
    Ok(extra)
}

#[cfg(test)]
mod tests {
    #[test]
    fn connector_settings_are_key_value_strings_and_a_bad_one_is_named() {
        let m = super::connector_settings(&[" lookup_timeout_ms = 500".into(), "a=b=c".into()])
            .unwrap();
        assert_eq!(m["lookup_timeout_ms"], "500");
        assert_eq!(m["a"], "b=c");
        let e = super::connector_settings(&["cpus".into()]).unwrap_err();
        assert!(e.to_string().contains("\"cpus\" is not KEY=VALUE"), "{e}");
    }

    /// Lines as LMCache 0.5.6 logged them in vLLM 0.32's CPU build (2026-12-07; the install
    /// folder shortened): the exception of the first error's traceback, and the second
    /// error's own message.
    #[test]
    fn lmcache_errors_name_the_exception_or_the_message() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("lmcache-saver.log");
        std::fs::write(
            &log,
            "\u{1b}[31;20m[2026-12-07 08:17:11,142] LMCache ERROR:\u{1b}[0m Failed to initialize \
             LMCacheManager components: Traceback (most recent call last):\n\
             \x20 File \"/site/lmcache/v1/gpu_connector/__init__.py\", line 247, in CreateGPUConnector\n\
             \x20   raise RuntimeError(f\"No supported {torch_device_type} connector found.\")\n\
             RuntimeError: No supported cpu connector found.\n\
             . System will operate in degraded mode (recompute). \u{1b}[3m(manager.py:107:lmcache.v1.manager)\u{1b}[0m\n\
             \u{1b}[32;20m[2026-12-07 08:17:11,144] LMCache INFO:\u{1b}[0m LMCache initialized\n\
             \u{1b}[31;20m[2026-12-07 08:17:17,530] LMCache ERROR:\u{1b}[0m Timeout occurred for rank 0, \
             recreating all sockets. Error: Resource temporarily unavailable \
             \u{1b}[3m(zmq_transport.py:121:lmcache.v1.rpc.zmq_transport)\u{1b}[0m\n\
             \u{1b}[32;20m[2026-12-07 08:17:17,531] LMCache INFO:\u{1b}[0m Recreating socket\n\
             \u{1b}[31;20m[2026-12-07 08:18:01,072] LMCache ERROR:\u{1b}[0m Timeout occurred for rank 0, \
             recreating all sockets. Error: Resource temporarily unavailable \
             \u{1b}[3m(zmq_transport.py:121:lmcache.v1.rpc.zmq_transport)\u{1b}[0m\n",
        )
        .unwrap();
        assert_eq!(
            super::lmcache_errors(&log),
            [
                "RuntimeError: No supported cpu connector found.",
                "Timeout occurred for rank 0, recreating all sockets. Error: Resource temporarily unavailable",
            ]
        );
        assert!(super::lmcache_errors(&dir.path().join("none.log")).is_empty());
    }
}
