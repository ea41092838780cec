//! One method's run: its server (if any) and replicas started, every trace and routing
//! played on them, each pass's record computed from the client's outcomes and the metrics of
//! the replicas and the server; what a server method saved removed after it.

use super::record::{empty_record, percentile, Phases, Record, TierCounters};
use super::router::{Router, ROUTINGS};
use super::trace::{self, generate, TraceParams};
use super::{play, FleetArgs, BLOCK};
use crate::cost::S3_STANDARD;
use crate::vllm::http::{self, delta, delta_f64};
use crate::vllm::methods::connector_settings;
use crate::vllm::process::{Env, Vllm};
use crate::vllm::setup::{spinner, ObjectCacheServer};
use anyhow::{Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::collections::HashMap;
use std::path::PathBuf;

/// The run's state across methods.
pub(super) struct Fleet<'a> {
    pub(super) a: &'a FleetArgs,
    pub(super) env: &'a Env,
    pub(super) rt: &'a tokio::runtime::Runtime,
    pub(super) traces: &'a [TraceParams],
    pub(super) vocab: u32,
    pub(super) block_bytes: u64,
    pub(super) tmp: PathBuf,
    pub(super) logs: PathBuf,
    pub(super) mp: MultiProgress,
    pub(super) records: Vec<Record>,
    /// Start-up seconds of each method's replicas.
    pub(super) startup: HashMap<String, Vec<f64>>,
    /// `none`'s outputs by (trace, routing), by request id.
    pub(super) reference: HashMap<(String, String), Vec<String>>,
}

/// Metric samples before and after a pass, summed over processes.
type Samples = HashMap<String, f64>;

impl Fleet<'_> {
    pub(super) fn not_run(&mut self, method: &str, why: &str) {
        for p in self.traces {
            for routing in &self.a.routing {
                let mut r = empty_record(method, routing, &p.kind, self.a.replicas);
                r.note = Some(why.to_string());
                self.records.push(r);
            }
        }
    }

    /// Starts `method`'s server (if any) and replicas, and runs every trace and routing.
    pub(super) fn method(&mut self, method: &str, backend: Option<&str>) -> Result<()> {
        let server = match method {
            "objectcache-server" | "objectcache-tier" => {
                let backend = backend.expect("the server methods run with a backend");
                // Each server its own prefix of the bucket: no method reads another's chunks.
                let store = with_prefix(backend, method);
                let mut extra = Vec::new();
                if method == "objectcache-tier" {
                    extra.extend([
                        "--tier-dram-bytes".to_string(),
                        self.a.tier_dram_bytes.to_string(),
                        "--tier-admission".into(),
                        self.a.tier_admission.clone(),
                    ]);
                    if self.a.tier_disk_bytes > 0 {
                        let d = self.tmp.join("tier-disk");
                        std::fs::create_dir_all(&d)?;
                        extra.extend([
                            "--tier-disk-dir".to_string(),
                            d.display().to_string(),
                            "--tier-disk-bytes".into(),
                            self.a.tier_disk_bytes.to_string(),
                        ]);
                    }
                }
                Some(ObjectCacheServer::start_with(
                    &store,
                    &extra,
                    &self.logs,
                    &format!("{method}-server.log"),
                )?)
            }
            _ => None,
        };
        let url = match (method, &server) {
            ("none", _) => None,
            ("objectcache-file", _) => Some(format!(
                "file://{}",
                self.tmp.join("fleet-file-store").display()
            )),
            (_, Some(s)) => Some(s.url()),
            _ => unreachable!("a server method has its server"),
        };
        let mut settings = connector_settings(&self.a.connector_settings)?;
        let kv = url.map(|u| {
            settings.insert("store".into(), u.into());
            settings.insert("namespace".into(), "bench-fleet".into());
            serde_json::json!({
                "kv_connector": "ObjectCacheConnector",
                "kv_connector_module_path": "objectcache.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": settings,
            })
        });
        let t_start = std::time::Instant::now();
        let replicas = self.start_replicas(method, kv.as_ref())?;
        let up_s = t_start.elapsed().as_secs_f64();
        let ports: Vec<u16> = replicas.iter().map(|v| v.port).collect();
        let server_port = server.as_ref().map(|s| port_of(s.addr())).transpose()?;
        for p in self.traces {
            for routing in self.a.routing.clone() {
                let salt = ROUTINGS.iter().position(|r| *r == routing).unwrap_or(0) as u64;
                let tr = generate(p, self.vocab, salt);
                let rec = self.pass(method, &routing, &tr, &ports, server_port)?;
                self.records.push(rec);
            }
        }
        let t_stop = std::time::Instant::now();
        let passes_s = (t_stop - t_start).as_secs_f64() - up_s;
        for v in replicas {
            v.stop()?;
        }
        drop(server);
        let stop_s = t_stop.elapsed().as_secs_f64();
        // Only the server methods save to the S3 store.
        let server_method = matches!(method, "objectcache-server" | "objectcache-tier");
        if let (Some(b), true) = (backend, server_method) {
            // What the method saved in the remote store, removed: a test endpoint of bounded
            // capacity (Ceph RGW on memstore in CI) fills up over a few runs otherwise.
            // Best effort: a store too slow to list now keeps them, and the run its figures.
            let url = with_prefix(b, method);
            let t = std::time::Instant::now();
            let msg = match self.rt.block_on(remove_all(&url)) {
                Ok(n) => format!(
                    "{method}: removed its {n} objects from the S3 store in {:.1} s",
                    t.elapsed().as_secs_f64()
                ),
                Err(e) => format!("{method}: could not remove what it saved under {url}: {e:#}"),
            };
            self.say(msg)?;
        }
        // Where a method's time goes (CI's log keeps it: the fleet test prints this output).
        self.say(format!(
            "{method}: replicas up and warm in {up_s:.1} s, passes {passes_s:.1} s, replicas \
             and server stopped in {stop_s:.1} s"
        ))?;
        Ok(())
    }

    /// Prints `msg` above the progress bars, or on stdout when they are hidden (no
    /// terminal), where the bars' own `println` would drop it.
    fn say(&self, msg: String) -> Result<()> {
        if self.mp.is_hidden() {
            println!("{msg}");
        } else {
            self.mp.println(msg)?;
        }
        Ok(())
    }

    /// The replicas of `method`, started as many at once as there are cores (a start-up is
    /// CPU-bound: more at once only starve the store's processes), each bound to its core,
    /// and warmed (the first request of a process pays one-time costs).
    fn start_replicas(
        &mut self,
        method: &str,
        kv: Option<&serde_json::Value>,
    ) -> Result<Vec<Vllm>> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let ids: Vec<usize> = (0..self.a.replicas).collect();
        let mut started: Vec<Result<Vllm>> = Vec::new();
        for wave in ids.chunks(cpus.max(1)) {
            started.extend(std::thread::scope(|s| {
                let hs: Vec<_> = wave
                    .iter()
                    .map(|&i| {
                        let (env, rt) = (self.env, self.rt);
                        s.spawn(move || {
                            Vllm::start_bound(
                                env,
                                rt,
                                &format!("{method}-{i}"),
                                true,
                                kv,
                                Some(&(i % cpus).to_string()),
                            )
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("a replica's start thread"))
                    .collect::<Vec<_>>()
            }));
        }
        let replicas: Vec<Vllm> = started.into_iter().collect::<Result<_>>()?;
        self.startup.insert(
            method.to_string(),
            replicas.iter().map(|v| v.startup_s).collect(),
        );
        let warm: Vec<u32> = (0..64).map(|i| 1000 + i).collect();
        for v in &replicas {
            self.rt
                .block_on(http::complete(v.port, &self.model(), &warm, 2))
                .with_context(|| format!("warm-up request to vLLM ({})", v.label))?;
        }
        Ok(replicas)
    }

    fn model(&self) -> String {
        self.env.model.display().to_string()
    }

    fn samples(&self, ports: &[u16]) -> Result<Samples> {
        let mut all = Samples::new();
        for &p in ports {
            for (k, v) in self.rt.block_on(http::metrics(p))? {
                *all.entry(k).or_insert(0.0) += v;
            }
        }
        Ok(all)
    }

    /// One trace under one routing on running replicas.
    fn pass(
        &mut self,
        method: &str,
        routing: &str,
        tr: &trace::Trace,
        ports: &[u16],
        server: Option<u16>,
    ) -> Result<Record> {
        let server_samples = |rt: &tokio::runtime::Runtime| -> Result<Samples> {
            match server {
                Some(p) => rt.block_on(http::metrics_at(p, "/_objectcache/metrics")),
                None => Ok(Samples::new()),
            }
        };
        let (v0, s0) = (self.samples(ports)?, server_samples(self.rt)?);
        let pb = self.mp.add(ProgressBar::new(tr.requests() as u64));
        pb.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:30}] {pos}/{len} requests {elapsed} (eta {eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        pb.set_message(format!("{} {method} {routing}", tr.params.kind));
        let out = self.rt.block_on(play::play(
            tr,
            ports,
            &self.model(),
            self.a.max_tokens,
            BLOCK,
            Router::new(routing, ports.len()),
            &pb,
        ));
        pb.finish_and_clear();
        let out = out.with_context(|| format!("{} {method} {routing}", tr.params.kind))?;
        // Saves finish after responses: wait for the connectors' counters to settle, so that
        // the next pass starts with nothing in flight.
        let s = spinner(&self.mp, format!("{method}: waiting for saves"));
        let mut v1 = self.samples(ports)?;
        for _ in 0..20 {
            std::thread::sleep(std::time::Duration::from_millis(500));
            let v = self.samples(ports)?;
            let same = v.get("vllm:objectcache_saved_bytes_total")
                == v1.get("vllm:objectcache_saved_bytes_total");
            v1 = v;
            if same {
                break;
            }
        }
        s.finish_and_clear();
        let s1 = server_samples(self.rt)?;
        self.say(format!(
            "{} {method} {routing}: {} requests done",
            tr.params.kind,
            out.len()
        ))?;

        let (ideal_hits, ideal_blocks) = trace::ideal(tr, BLOCK);
        let mut rec = empty_record(method, routing, &tr.params.kind, ports.len());
        let prompt: u64 = out.iter().map(|o| o.prompt_tokens).sum();
        let cached: u64 = out.iter().map(|o| o.cached_tokens).sum();
        rec.requests = out.len();
        rec.prompt_tokens = prompt;
        rec.hit_rate = cached as f64 / prompt.max(1) as f64;
        rec.ideal_hit_rate = ideal_hits.iter().sum::<usize>() as f64 / prompt.max(1) as f64;
        rec.hit_over_ideal = rec.hit_rate / rec.ideal_hit_rate.max(1e-12);
        rec.local_hit_tokens = delta(&v0, &v1, "vllm:prefix_cache_hits_total");
        rec.external_hit_tokens = delta(&v0, &v1, "vllm:external_prefix_cache_hits_total");
        let mut ttft: Vec<f64> = out.iter().map(|o| o.ttft_s).collect();
        ttft.sort_by(f64::total_cmp);
        rec.ttft_p50_s = percentile(&ttft, 50.0);
        rec.ttft_p99_s = percentile(&ttft, 99.0);
        rec.ttft_mean_s = ttft.iter().sum::<f64>() / ttft.len().max(1) as f64;
        let mean = |h: &str| {
            let d = |k: String| delta_f64(&v0, &v1, &k);
            d(format!("{h}_sum")) / d(format!("{h}_count")).max(1.0)
        };
        rec.phases = Phases {
            queue_s: mean("vllm:request_queue_time_seconds"),
            prefill_s: mean("vllm:request_prefill_time_seconds"),
            ttft_s: mean("vllm:time_to_first_token_seconds"),
            computed_tokens: mean("vllm:request_prefill_kv_computed_tokens"),
        };
        let first = out.iter().map(|o| o.sent_s).fold(f64::INFINITY, f64::min);
        let last = out.iter().map(|o| o.sent_s + o.done_s).fold(0.0, f64::max);
        rec.span_s = (last - first).max(0.0);
        rec.requests_per_s = out.len() as f64 / rec.span_s.max(1e-9);
        rec.loaded_bytes = delta(&v0, &v1, "vllm:objectcache_loaded_bytes_total");
        rec.loads = delta(&v0, &v1, "vllm:objectcache_loads_total");
        rec.unique_bytes = ideal_blocks as u64 * self.block_bytes;
        rec.remote_bytes = match method {
            "none" => 0,
            "objectcache-file" => rec.loaded_bytes,
            _ => delta(
                &s0,
                &s1,
                "objectcache_server_backend_bytes_total{dir=\"read\"}",
            ),
        };
        rec.remote_over_unique = rec.remote_bytes as f64 / rec.unique_bytes.max(1) as f64;
        if server.is_some() {
            let gets = delta(
                &s0,
                &s1,
                "objectcache_server_backend_requests_total{class=\"get\"}",
            );
            rec.remote_requests = Some(gets);
            let per = |class: &str, n: u64| {
                let t = delta_f64(
                    &s0,
                    &s1,
                    &format!("objectcache_server_backend_seconds_total{{class=\"{class}\"}}"),
                );
                (n > 0).then(|| t / n as f64)
            };
            let puts = delta(
                &s0,
                &s1,
                "objectcache_server_backend_requests_total{class=\"put\"}",
            );
            rec.remote_get_s = per("get", gets);
            rec.remote_put_s = per("put", puts);
            rec.cost = S3_STANDARD
                .cost(true, gets, rec.remote_bytes, 0, 0)
                .averaged_over(rec.loads);
        }
        if method == "objectcache-tier" {
            rec.tier = Some(TierCounters {
                hits: delta(&s0, &s1, "objectcache_tier_hits_total"),
                misses: delta(&s0, &s1, "objectcache_tier_misses_total"),
                fills: delta(&s0, &s1, "objectcache_tier_fills_total"),
                fill_bytes: delta(&s0, &s1, "objectcache_tier_fill_bytes_total"),
                fills_shared: delta(&s0, &s1, "objectcache_tier_fills_shared_total"),
                evictions: delta(&s0, &s1, "objectcache_tier_evictions_total"),
                refused: delta(&s0, &s1, "objectcache_tier_refused_total"),
                marker_hits: delta(&s0, &s1, "objectcache_tier_marker_hits_total"),
            });
        }
        rec.per_replica = (0..ports.len())
            .map(|r| out.iter().filter(|o| o.replica == r).count())
            .collect();
        let key = (tr.params.kind.clone(), routing.to_string());
        if method == "none" {
            self.reference
                .insert(key, out.iter().map(|o| o.text.clone()).collect());
        }
        if let Some(want) = self
            .reference
            .get(&(tr.params.kind.clone(), routing.to_string()))
        {
            rec.outputs_differing = out.iter().zip(want).filter(|(o, w)| o.text != **w).count();
            rec.outputs_equal_none = Some(rec.outputs_differing == 0 && want.len() == out.len());
        }
        rec.outcomes = out;
        Ok(rec)
    }
}

/// Deletes every object of the store at `url` (16 at a time); returns how many.
async fn remove_all(url: &str) -> Result<usize> {
    use futures::{StreamExt, TryStreamExt};
    let store = objectcache::store::open_store(url).await?;
    let objects = store.list("", usize::MAX).await?;
    let n = objects.len();
    futures::stream::iter(objects)
        .map(|o| {
            let store = store.clone();
            async move { store.delete(&o.key).await }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(n)
}

/// `s3://BUCKET/PREFIX?QUERY` with `/NAME` appended to its prefix.
pub(super) fn with_prefix(url: &str, name: &str) -> String {
    match url.split_once('?') {
        Some((base, q)) => format!("{}/{name}?{q}", base.trim_end_matches('/')),
        None => format!("{}/{name}", url.trim_end_matches('/')),
    }
}

fn port_of(addr: &str) -> Result<u16> {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in the server's address {addr:?}"))
}
