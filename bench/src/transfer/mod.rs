//! `objectcache-bench transfer`: one load of a cached prefix over each path, on loopback.
//!
//! Paths: `gather-tcp` (one gather request, units streamed layer-major), `s3-layerwise` (the
//! connector's stock-S3 load: ranged GETs in layer order), `s3-chunkwise` (one whole-object
//! GET per chunk), `s3-segment` (the connector's stock-S3 load of a prefix saved in object
//! format version 2: segment objects, ranged GETs), `gather-segment` (those segment objects
//! through one gather request: the server reads them), `file-layerwise` (the
//! same load from the embedded file store on local disk, no network: the connector's default
//! store, read straight into place), `file-segment` (`s3-segment`'s objects in such a file
//! store). Each record carries `raw_tcp_bytes_per_s`, a plain loopback TCP stream
//! measured in the same run, so throughput reads as a fraction of what the machine moves.
//! Goals (issue 3): gather throughput >= 0.8 x raw; TTFL <= 1.5 x (one layer's bytes / raw).
//!
//! Here: the arguments and the run; the record of a load and the median of runs in
//! `record.rs`, the CPU and raw-TCP baselines in `measure.rs`, the chunk data in `data.rs`,
//! the server and stores in `target.rs`.

mod data;
mod file;
mod measure;
mod record;
mod target;

use data::{hashes, object, touched};
use file::file_copy;
use measure::{files_of_len, per_gib, process_cpu_s, raw_same_bytes, raw_tcp};
use record::{median_of, Record};
use target::{s3_store, target};

use bytes::Bytes;
use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadRequest};
use objectcache::layout::{decode_chunk, HashAlgo, KeyBuilder, KvGeometry};
use objectcache::protocol::{SaveChunk, SaveRequest, WireGeometry};
use objectcache::store::StoreExt;
use objectcache::transport::tcp::GatherClient;
use std::time::Instant;

const NAMESPACE: &str = "bench";
/// The `s3-segment` path's namespace: its prefix beside the per-chunk objects of the others.
const NAMESPACE_V2: &str = "bench-v2";

/// Arguments of `objectcache-bench transfer`.
#[derive(Debug, clap::Args)]
pub struct TransferArgs {
    /// ObjectCache server as `http://HOST:PORT/BUCKET` (S3 and gather on one port); without
    /// it a server is started in this process on loopback over a temporary directory.
    #[arg(long)]
    store: Option<String>,
    /// Backend of the server started in this process (without `--store`): `memory:` keeps
    /// objects in RAM (isolates the transfer path from file reads); default a temporary
    /// directory (the server's default backend).
    #[arg(long, conflicts_with = "store")]
    server_backend: Option<String>,
    /// How the ranged-GET paths read bodies: `place` (the default: at a plain-`http://`
    /// endpoint each GET is presigned and its body read from the socket straight into the
    /// destination) or `sdk` (through the AWS SDK's HTTP client, then copied into place;
    /// the store URL's `read_into_place=false`), to compare the two on one machine.
    #[arg(long, default_value = "place", value_parser = ["place", "sdk"])]
    s3_bodies: String,
    /// Access key for `--store` (default `$AWS_ACCESS_KEY_ID`).
    #[arg(long, env = "AWS_ACCESS_KEY_ID", default_value = "bench")]
    access_key: String,
    /// Secret key for `--store` (default `$AWS_SECRET_ACCESS_KEY`).
    #[arg(
        long,
        env = "AWS_SECRET_ACCESS_KEY",
        default_value = "bench-secret",
        hide_env_values = true
    )]
    secret_key: String,
    /// TCP connections a gather load is striped over (the engine's `gather_streams`;
    /// default: the engine's default).
    #[arg(long)]
    gather_streams: Option<usize>,
    /// An engine setting for the engine paths' loads, `KEY=VALUE` as in the engine's config
    /// (`EngineConfig::set`; repeatable, applied after the benchmark's own), e.g.
    /// `--engine window_bytes=268435456` to bound a load's bytes in flight at 256 MiB under
    /// `--delay-ms`. A bad key or value is an error naming it.
    #[arg(long = "engine", value_name = "KEY=VALUE")]
    engine_settings: Vec<String>,
    /// Model geometry preset (`llama-3.1-8b`, `qwen2.5-7b`, `llama-3.1-70b-tp8`, ...).
    #[arg(long, default_value = "llama-3.1-8b")]
    model: String,
    /// Tokens per chunk instead of the preset's (e.g. 16 or 64, vLLM's GPU block sizes).
    #[arg(long)]
    tokens_per_chunk: Option<u32>,
    /// Chunks per segment object of the `s3-segment` path (a save's chunks in one object,
    /// layer-major across them); default as many as the engine's `segment_max_bytes` holds
    /// (1 GiB: a 32K-token prefix at 8B is four segments).
    #[arg(long)]
    segment_chunks: Option<usize>,
    /// Prefix lengths in tokens (comma-separated); rounded down to whole chunks.
    #[arg(long, value_delimiter = ',', default_value = "4096,32768")]
    context: Vec<u32>,
    /// Paths to run (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "gather-tcp,s3-layerwise,s3-chunkwise"
    )]
    paths: Vec<String>,
    /// Measured loads per path and size (after one warm-up load on the engine paths); each
    /// record reports the median TTFL, TTLL and CPU of these runs, and their range. On a
    /// shared machine single loads vary by tens of percent, so a median of several is the
    /// figure to compare.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// One-way delays to sweep, milliseconds (comma-separated, e.g. `0,5,20,50`): each path
    /// then loads through a loopback proxy that holds every byte this long in each direction
    /// (`objectcache::transport::delay::DelayProxy`; a new connection's first request waits
    /// one more round trip, its handshake). Without it loads go straight to the server. Each
    /// engine loads once before the measured runs (its connections are open, as in a serving
    /// process). CPU figures under a proxy include the proxy's copies.
    #[arg(long, value_delimiter = ',')]
    delay_ms: Vec<u64>,
    /// Write the records as a JSON array here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// Runs the benchmark.
///
/// # Errors
/// A message if the server, the store or a load fails.
pub fn run(args: TransferArgs) -> anyhow::Result<()> {
    run_inner(args).map_err(anyhow::Error::msg)
}

fn run_inner(args: TransferArgs) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut g = KvGeometry::preset(&args.model).map_err(|e| e.to_string())?;
    if let Some(t) = args.tokens_per_chunk {
        g = g.with_tokens_per_chunk(t).map_err(|e| e.to_string())?;
    }
    let t = rt.block_on(target(&args))?;
    let store = rt.block_on(s3_store(&t, &args, None))?;
    let delays: Vec<Option<u64>> = if args.delay_ms.is_empty() {
        vec![None]
    } else {
        args.delay_ms.iter().map(|d| Some(*d)).collect()
    };
    let kb = KeyBuilder::new(NAMESPACE, &g, HashAlgo::Sha256Cbor).map_err(|e| e.to_string())?;
    let mut records = Vec::new();
    for &ctx in &args.context {
        let chunks = (ctx / g.tokens_per_chunk) as usize;
        if chunks == 0 {
            return Err(format!(
                "--context {ctx} is less than one {}-token chunk",
                g.tokens_per_chunk
            ));
        }
        let tokens = chunks as u64 * g.tokens_per_chunk as u64;
        let hs = hashes(chunks, ctx as u64);
        // Chunks per segment object of the `s3-segment` path: as many as the engine's
        // `segment_max_bytes` of KV holds (1 GiB by default), or `--segment-chunks`.
        let chunk_kv = g.layers as u64 * g.slice_bytes();
        let seg_chunks = args
            .segment_chunks
            .unwrap_or((EngineConfig::default().segment_max_bytes / chunk_kv) as usize)
            .clamp(1, chunks);
        let segment_max_bytes = seg_chunks as u64 * chunk_kv;
        let layer_bytes = chunks as u64 * g.slice_bytes();
        let total = layer_bytes * g.layers as u64;
        eprintln!(
            "{}: {tokens} tokens, {chunks} chunks, {} MiB per layer, {} MiB per load",
            args.model,
            layer_bytes >> 20,
            total >> 20
        );
        // Populate through one batched save (objects made as they are sent); a stock S3
        // server (no gather) gets plain PUTs of the same objects and publish markers. The
        // `s3-segment` path writes its own objects: alone, it needs none of these (a Ceph
        // RGW in memory then holds one copy of the prefix, not two).
        let per_chunk_paths = args.paths.iter().any(|p| !p.ends_with("-segment"));
        rt.block_on(async {
            if !per_chunk_paths {
                return Ok(objectcache::transport::tcp::SaveReport {
                    written: 0,
                    already_present: 0,
                });
            }
            let mut c = match GatherClient::connect_with(t.addr, t.credentials()).await {
                Ok(c) => c,
                Err(objectcache::transport::tcp::GatherError::NotOffered(why)) => {
                    eprintln!("no gather at this endpoint ({why}): populating with S3 PUTs");
                    for (i, h) in hs.iter().enumerate() {
                        store
                            .put(&kb.data(h), object(&g, i))
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    let len = objectcache::layout::object_len(g.layers, g.slice_bytes());
                    let m = objectcache::layout::encode_marker(len);
                    for h in &hs {
                        store
                            .put(&kb.marker(h), Bytes::copy_from_slice(&m))
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    return Ok(objectcache::transport::tcp::SaveReport {
                        written: hs.len() as u32,
                        already_present: 0,
                    });
                }
                Err(e) => return Err(e.to_string()),
            };
            let req = SaveRequest {
                request_id: 1,
                bucket: t.bucket.clone(),
                prefix: kb.prefix().to_string(),
                geometry: WireGeometry::from_geometry(&g),
                chunks: hs
                    .iter()
                    .map(|h| SaveChunk {
                        hash: h.clone(),
                        tokens: g.tokens_per_chunk,
                    })
                    .collect(),
            };
            c.save(&req, (0..chunks).map(|i| object(&g, i)))
                .await
                .map_err(|e| e.to_string())
        })?;
        // The `s3-segment` path's objects: saved through an engine writing format version 2,
        // one save per segment (the same segments as one save of the prefix, cut at
        // `segment_max_bytes`, without holding a second copy of the whole prefix in memory).
        if args.paths.iter().any(|p| p.ends_with("-segment")) {
            let cfg = EngineConfig::from_pairs([
                ("namespace", NAMESPACE_V2),
                ("save_format", "v2"),
                ("segment_max_bytes", &segment_max_bytes.to_string()),
            ])
            .map_err(|e| e.to_string())?;
            let writer = Engine::with_store(store.clone(), cfg).map_err(|e| e.to_string())?;
            for a in (0..chunks).step_by(seg_chunks) {
                let r = a..(a + seg_chunks).min(chunks);
                let objs: Vec<Bytes> = r.clone().map(|c| object(&g, c)).collect();
                let slices: Vec<Vec<&[u8]>> = objs
                    .iter()
                    .map(|o| decode_chunk(&g, g.tokens_per_chunk, o).map(|d| d.1))
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())?;
                let layers: Vec<Vec<&[u8]>> = (0..g.layers as usize)
                    .map(|l| slices.iter().map(|s| s[l]).collect())
                    .collect();
                let rep = writer
                    .save_paged_blocking(&g, &hs[r.clone()], &layers)
                    .map_err(|e| format!("s3-segment save: {e}"))?;
                if rep.written != r.len() {
                    return Err(format!("s3-segment save: {rep:?} for chunks {r:?}"));
                }
            }
        }
        // The best of three runs: the ceiling this machine's loopback reaches (a single run
        // varies by tens of percent on a shared machine), so the fractions are conservative.
        let (mut raw, mut raw_cpu) = (0f64, None);
        for _ in 0..3 {
            let (r, c) = rt
                .block_on(raw_tcp(total.min(2 << 30)))
                .map_err(|e| e.to_string())?;
            if r > raw {
                (raw, raw_cpu) = (r, c);
            }
        }
        eprintln!("  raw loopback TCP: {:.2} GB/s", raw / 1e9);
        // A raw stream of the load's bytes (at most 2 GiB) just before each measured load:
        // its CPU per byte is the one the load's is divided by, so the ratio is taken under
        // the same load on the machine (the raw figure alone moved 0.19-0.47 s/GiB within one
        // session on this 2-core VM).
        // The fair baseline (issue 43 part 5): the load's own chunk files, sent with
        // sendfile(2) into a destination of the load's size (at most 2 GiB), where the raw
        // stream above sends one 16 MiB buffer that stays in cache. Only where this process's
        // server keeps its objects in a directory (no `--store`, no `--server-backend`).
        let same_bytes = match t.local_dir() {
            Some(dir) => {
                let keys: Vec<String> = hs.iter().map(|h| kb.data(h)).collect();
                let len = object(&g, 0).len() as u64;
                let all = files_of_len(dir, len).map_err(|e| e.to_string())?;
                let files: Vec<std::path::PathBuf> = keys
                    .iter()
                    .filter_map(|k| all.iter().find(|f| f.ends_with(k)).cloned())
                    .collect();
                if files.len() == chunks {
                    Some(std::cell::RefCell::new((
                        files,
                        touched(total.min(2 << 30) as usize),
                    )))
                } else {
                    eprintln!(
                        "  raw same-bytes baseline skipped: {} of the {chunks} chunk files found under {}",
                        files.len(),
                        dir.display()
                    );
                    None
                }
            }
            None => None,
        };
        // Both raw streams just before a measured load: CPU seconds per GiB of the raw TCP
        // stream, and of the same-bytes stream where it runs.
        let raw_cpu_next_to_run = || -> Result<(Option<f64>, Option<f64>), String> {
            let tcp = rt
                .block_on(raw_tcp(total.min(2 << 30)))
                .map(|(_, c)| c)
                .map_err(|e| e.to_string())?;
            let same = match &same_bytes {
                Some(cell) => {
                    let (files, dest) = &mut *cell.borrow_mut();
                    raw_same_bytes(files, dest).map_err(|e| e.to_string())?.1
                }
                None => None,
            };
            Ok((tcp, same))
        };
        // The file stores of `file-layerwise`, removed at the end of this context.
        let mut fs_dirs: Vec<tempfile::TempDir> = Vec::new();
        for &delay in &delays {
            // Through a delaying proxy: a store (and, for gather, a target) at the proxy.
            let (proxy, store) = match delay {
                None => (None, store.clone()),
                Some(d) => {
                    let p = rt
                        .block_on(objectcache::transport::delay::DelayProxy::start(
                            t.addr,
                            std::time::Duration::from_millis(d),
                        ))
                        .map_err(|e| e.to_string())?;
                    let s = rt.block_on(s3_store(&t, &args, Some(p.local_addr())))?;
                    eprintln!("  one-way delay {d} ms (proxy {})", p.local_addr());
                    (Some(p), s)
                }
            };
            let rec =
                |path: &str,
                 requests: u64,
                 round_trips: u64,
                 peaks: (u64, u64),
                 ttfl: f64,
                 ttll: f64,
                 cpu: Option<f64>,
                 (raw_cpu_run, raw_same_run): (Option<f64>, Option<f64>)| {
                    let segment = path.ends_with("-segment");
                    let puts = if segment {
                        (chunks.div_ceil(seg_chunks) + chunks) as u64
                    } else {
                        2 * chunks as u64
                    };

                    Record {
                        path: path.into(),
                        layout: if segment { "segment" } else { "per-chunk" }.into(),
                        model: args.model.clone(),
                        context_tokens: tokens,
                        tokens_per_chunk: g.tokens_per_chunk,
                        puts_per_save: puts,
                        cost: crate::cost::S3_STANDARD.cost(
                            billed(path),
                            requests,
                            total,
                            puts,
                            total,
                        ),
                        bytes: total,
                        delay_ms: delay,
                        requests,
                        round_trips,
                        peak_requests_in_flight: peaks.0,
                        peak_bytes_in_flight: peaks.1,
                        ttfl_s: ttfl,
                        ttll_s: ttll,
                        ttfl_s_range: [ttfl, ttfl],
                        ttll_s_range: [ttll, ttll],
                        runs: 1,
                        throughput_bytes_per_s: total as f64 / ttll,
                        raw_tcp_bytes_per_s: raw,
                        cpu_s_per_gib: cpu,
                        raw_tcp_cpu_s_per_gib: raw_cpu_run.or(raw_cpu),
                        cpu_x_raw_tcp: cpu.zip(raw_cpu_run).map(|(c, r)| c / r),
                        cpu_x_raw_tcp_range: [f64::NAN; 2],
                        raw_same_bytes_cpu_s_per_gib: raw_same_run,
                        cpu_x_raw_same_bytes: cpu.zip(raw_same_run).map(|(c, r)| c / r),
                        cpu_x_raw_same_bytes_range: [f64::NAN; 2],
                    }
                };
            for path in &args.paths {
                let samples: Vec<Record> = match path.as_str() {
                    // Both go through the connector's Engine, as an inference server would: with
                    // gather on it sends one request to our server; with gather off it issues
                    // layer-major ranged GETs (the stock-S3 path), even against our server.
                    // `s3-segment`: the same engine saving format version 2 (segment
                    // objects); its loads read one range per (segment, layer) in ranged GETs.
                    // `gather-segment`: those objects through gather (the server reads the
                    // segments). `file-segment`: those objects copied into a file store on
                    // local disk.
                    "gather-tcp" | "s3-layerwise" | "file-layerwise" | "s3-segment"
                    | "gather-segment" | "file-segment" => {
                        let segment = path.ends_with("-segment");
                        let store = if path == "file-layerwise" {
                            let keys = hs.iter().flat_map(|h| [kb.data(h), kb.marker(h)]);
                            let (d, fs) = file_copy(&rt, &store, keys.collect())?;
                            fs_dirs.push(d);
                            fs
                        } else if path == "file-segment" {
                            let listed = rt
                                .block_on(store.list(&format!("{NAMESPACE_V2}/"), usize::MAX))
                                .map_err(|e| e.to_string())?;
                            let keys = listed.into_iter().map(|m| m.key).collect();
                            let (d, fs) = file_copy(&rt, &store, keys)?;
                            fs_dirs.push(d);
                            fs
                        } else {
                            store.clone()
                        };
                        let mut cfg = EngineConfig::default();
                        let ns = if segment {
                            NAMESPACE_V2
                        } else {
                            NAMESPACE
                        };
                        cfg.set("namespace", ns).map_err(|e| e.to_string())?;
                        cfg.gather = path.starts_with("gather-");
                        if segment {
                            // The markers the lookup reads are kept for the whole run: every
                            // load is placed without marker reads, as right after a lookup.
                            cfg.set("save_format", "v2").map_err(|e| e.to_string())?;
                            cfg.set("lookup_cache_ttl_ms", "3600000")
                                .map_err(|e| e.to_string())?;
                        }
                        if let Some(n) = args.gather_streams {
                            cfg.set("gather_streams", &n.to_string())
                                .map_err(|e| e.to_string())?;
                        }
                        for kv in &args.engine_settings {
                            let (k, v) = kv.split_once('=').ok_or_else(|| {
                                format!("--engine {kv:?}: expected KEY=VALUE")
                            })?;
                            cfg.set(k, v).map_err(|e| format!("--engine {kv:?}: {e}"))?;
                        }
                        let engine = Engine::with_store(store.clone(), cfg.clone())
                            .map_err(|e| e.to_string())?;
                        if segment {
                            let n = engine.lookup_blocking(&g, &hs).map_err(|e| e.to_string())?;
                            if n != chunks {
                                return Err(format!("{path}: lookup found {n} of {chunks} chunks"));
                            }
                        }
                        // The destination is allocated (and touched) once and reused by every load,
                        // as an inference server reuses its KV buffers: no load pays for page
                        // faults or for freeing the last load's buffers.
                        let pool = std::cell::RefCell::new(Some(
                            (0..g.layers)
                                .map(|_| touched(layer_bytes as usize))
                                .collect::<Vec<_>>(),
                        ));
                        let load =
                        || -> Result<(objectcache::connector::LoadStats, Option<f64>), String> {
                            let dest = LayerBuffers::from_vecs(
                                pool.borrow_mut().take().expect("returned by the last load"),
                            );
                            let cpu0 = process_cpu_s();
                            let h = engine
                                .load(
                                    LoadRequest {
                                        geometry: g.clone(),
                                        hashes: hs.clone(),
                                        hints: Default::default(),
                                    },
                                    dest,
                                )
                                .map_err(|e| e.to_string())?;
                            let done = h.wait_all_blocking().map_err(|e| format!("{path}: {e}"));
                            let r = (h.stats(), per_gib(cpu0, process_cpu_s(), total));
                            *pool.borrow_mut() = h.into_buffers().into_vecs();
                            done?;
                            Ok(r)
                        };
                        // Warm-up: the first load finds the gather verdict and connections already
                        // open (the engine opens them at start), or opens more; later loads reuse
                        // them from the engine's pools.
                        load()?;
                        let mut samples = Vec::new();
                        for _ in 0..args.runs {
                            let raw_cpu_run = raw_cpu_next_to_run()?;
                            let (s, cpu) = load()?;
                            // One gather request per stream (fewer streams than chunks never).
                            let streams = (cfg.gather_streams as u64).min(hs.len() as u64);
                            if cfg.gather && s.requests != streams {
                                return Err(format!(
                                "{path}: the load fell back to {} ranged GETs (is gather offered at this endpoint? see the log)",
                                s.requests
                            ));
                            }
                            let rt_count = if cfg.gather {
                                1
                            } else {
                                s.requests.div_ceil(s.peak_requests_in_flight.max(1))
                            };
                            samples.push(rec(
                                path,
                                s.requests,
                                rt_count,
                                (s.peak_requests_in_flight, s.peak_bytes_in_flight),
                                s.ttfl_s.unwrap_or(f64::NAN),
                                s.ttll_s.unwrap_or(f64::NAN),
                                cpu,
                                raw_cpu_run,
                            ));
                        }
                        samples
                    }
                    "s3-chunkwise" => {
                        let conc = 16usize;
                        let mut samples = Vec::new();
                        for _ in 0..args.runs {
                            let raw_cpu_run = raw_cpu_next_to_run()?;
                            let (ttll, n, cpu) = rt.block_on(async {
                                let mut dest: Vec<Vec<u8>> = (0..g.layers)
                                    .map(|_| touched(layer_bytes as usize))
                                    .collect();
                                let cpu0 = process_cpu_s();
                                let t0 = Instant::now();
                                let keys: Vec<String> = hs.iter().map(|h| kb.data(h)).collect();
                                let mut got = 0u64;
                                let mut i = 0;
                                while i < keys.len() {
                                    let batch: Vec<_> = keys[i..(i + conc).min(keys.len())]
                                        .iter()
                                        .map(|k| store.get_bytes(k))
                                        .collect();
                                    let objs = futures::future::join_all(batch).await;
                                    for (j, o) in objs.into_iter().enumerate() {
                                        let o = o.map_err(|e| e.to_string())?;
                                        let (_, slices) = decode_chunk(&g, g.tokens_per_chunk, &o)
                                            .map_err(|e| e.to_string())?;
                                        let off = (i + j) * g.slice_bytes() as usize;
                                        for (l, s) in slices.iter().enumerate() {
                                            dest[l][off..off + s.len()].copy_from_slice(s);
                                        }
                                        got += 1;
                                    }
                                    i += conc;
                                }
                                let secs = t0.elapsed().as_secs_f64();
                                Ok::<_, String>((secs, got, per_gib(cpu0, process_cpu_s(), total)))
                            })?;
                            // Layer 0 needs every chunk's object: first layer and last layer coincide.
                            samples.push(rec(
                                path,
                                n,
                                n.div_ceil(conc as u64),
                                (0, 0),
                                ttll,
                                ttll,
                                cpu,
                                raw_cpu_run,
                            ));
                        }
                        samples
                    }
                    other => {
                        return Err(format!(
                            "unknown path {other:?}: use gather-tcp, s3-layerwise, s3-chunkwise, s3-segment, gather-segment, file-layerwise, file-segment"
                        ))
                    }
                };
                let r = median_of(samples);
                let one_layer = layer_bytes as f64 / r.raw_tcp_bytes_per_s;
                println!(
                "{:<13} {:>6} tokens  {:>6} MiB  delay {:>4}  requests {:>6}  round trips {:>5}  TTFL {:>8.2} ms ({:.2}x one layer at raw)  TTLL {:>8.2} ms  {:>6.2} GB/s = {:.2} of raw TCP {:.2} GB/s",
                r.path,
                r.context_tokens,
                r.bytes >> 20,
                r.delay_ms.map_or("-".to_string(), |d| format!("{d}ms")),
                r.requests,
                r.round_trips,
                r.ttfl_s * 1e3,
                r.ttfl_s / one_layer,
                r.ttll_s * 1e3,
                r.throughput_bytes_per_s / 1e9,
                r.throughput_bytes_per_s / r.raw_tcp_bytes_per_s,
                r.raw_tcp_bytes_per_s / 1e9
            );
                if r.runs > 1 {
                    println!(
                        "{:<13} TTFL and TTLL above: medians of {} loads; their ranges: TTFL {:.2}-{:.2} ms, TTLL {:.2}-{:.2} ms",
                        "",
                        r.runs,
                        r.ttfl_s_range[0] * 1e3,
                        r.ttfl_s_range[1] * 1e3,
                        r.ttll_s_range[0] * 1e3,
                        r.ttll_s_range[1] * 1e3
                    );
                }
                if !billed(&r.path) {
                    println!(
                        "{:<13} layout {}, {}-token chunks: {} file reads per load; {} objects written per save",
                        "", r.layout, r.tokens_per_chunk, r.requests, r.puts_per_save
                    );
                } else {
                    println!(
                        "{:<13} layout {}, {}-token chunks: {} GETs = ${:.4} per 1,000 loads (${:.4} per load from another region); {} PUTs per save = ${:.2} per 1,000 saves; ${:.4} a month stored ({})",
                        "",
                        r.layout,
                        r.tokens_per_chunk,
                        r.requests,
                        r.cost.cost_usd_per_1k_loads,
                        r.cost.cost_usd_per_load_cross_region,
                        r.puts_per_save,
                        r.cost.cost_usd_per_1k_saves,
                        r.cost.storage_usd_per_month,
                        crate::cost::S3_STANDARD.name
                    );
                }
                if let (Some(c), Some(rc), Some(x)) =
                    (r.cpu_s_per_gib, r.raw_tcp_cpu_s_per_gib, r.cpu_x_raw_tcp)
                {
                    let [lo, hi] = r.cpu_x_raw_tcp_range;
                    println!(
                        "{:<13} CPU {c:.3} s/GiB, raw TCP {rc:.3} s/GiB (medians): {x:.2}x raw's CPU per byte \
                         (median of each run's ratio to a raw stream just before it; range {lo:.2}-{hi:.2}x)",
                        ""
                    );
                }
                if let (Some(rs), Some(x)) =
                    (r.raw_same_bytes_cpu_s_per_gib, r.cpu_x_raw_same_bytes)
                {
                    let [lo, hi] = r.cpu_x_raw_same_bytes_range;
                    println!(
                        "{:<13} raw same bytes (the chunk files by sendfile) {rs:.3} s/GiB: {x:.2}x its CPU per byte (range {lo:.2}-{hi:.2}x)",
                        ""
                    );
                }
                if r.peak_requests_in_flight > 0 {
                    println!(
                        "{:<13} in flight at most: {} requests, {:.1} MiB",
                        "",
                        r.peak_requests_in_flight,
                        r.peak_bytes_in_flight as f64 / (1u64 << 20) as f64
                    );
                }
                // Growth over the same path's load without delay, in round trips (2 x one way).
                if let Some(d) = r.delay_ms.filter(|d| *d > 0) {
                    if let Some(z) = records.iter().find(|z: &&Record| {
                        z.path == r.path
                            && z.context_tokens == r.context_tokens
                            && z.delay_ms == Some(0)
                    }) {
                        let rtt = 2.0 * d as f64 / 1e3;
                        println!(
                        "{:<13} {d} ms one way: TTLL grew {:.2} round trips over 0 ms, TTFL {:.2} round trips",
                        "",
                        (r.ttll_s - z.ttll_s) / rtt,
                        r.ttfl_s / rtt
                    );
                    }
                }
                records.push(r);
            }
            drop(proxy);
        }
        // Free the prefix's objects before the next size.
        rt.block_on(async {
            for h in &hs {
                let _ = store.delete(&kb.data(h)).await;
                let _ = store.delete(&kb.marker(h)).await;
            }
            // The `s3-segment` path's markers and segments.
            if let Ok(objs) = store.list(&format!("{NAMESPACE_V2}/"), usize::MAX).await {
                for m in objs {
                    let _ = store.delete(&m.key).await;
                }
            }
        });
    }
    if let Some(p) = &args.json {
        let s = serde_json::to_string_pretty(&records).map_err(|e| e.to_string())?;
        std::fs::write(p, s).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(())
}

/// Whether `path`'s requests are billed as S3 requests: not the `file-` paths, which read and
/// write local files.
fn billed(path: &str) -> bool {
    !path.starts_with("file-")
}
