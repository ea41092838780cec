//! The client engine: save, lookup and layer-ordered load of prefix KV cache.
//!
//! ```no_run
//! use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadRequest};
//! use objectcache::hash::{chunk_hashes, HashParams};
//! use objectcache::KvGeometry;
//!
//! let engine = Engine::new(EngineConfig::default())?;
//! let g = KvGeometry::llama31_8b();
//! let tokens: Vec<u32> = (0..4096).collect();
//! let hashes = chunk_hashes(&tokens, &HashParams::new(g.tokens_per_chunk as usize))?;
//! let hit = engine.lookup_blocking(&g, &hashes)?;          // leading chunks cached
//! let per_layer = hit * g.slice_bytes() as usize;
//! let h = engine.load(LoadRequest::new(g.clone(), hashes[..hit].to_vec()),
//!                     LayerBuffers::allocate(g.layers as usize, per_layer))?;
//! for l in 0..g.layers as usize {
//!     h.wait_layer_blocking(l, None)?;                      // layer l is verified KV
//!     let _kv = h.layer(l).unwrap();                        // compute layer l here
//! }
//! # Ok::<(), objectcache::Error>(())
//! ```
//!
//! Save is two-phase: chunk data objects are written create-only (first writer wins), then,
//! once all are durable, one small publish marker per chunk; lookup reads only markers, so a
//! reader never sees a prefix half written and a crash between the phases leaves unreferenced
//! data objects that garbage collection can find.

mod affinity;
mod buffers;
mod config;
#[cfg(feature = "cuda")]
mod device;
mod flight;
mod gather;
mod load;
mod memory;
#[cfg(feature = "rdma")]
mod rdma;
mod status;

use buffers::first_overlap;
pub use buffers::{LayerBuffers, LayerStatus};
pub use config::{
    default_cache_dir, EngineConfig, StallTimeout, Transport, CONFIG_KEYS, LOAD_DEADLINE_FLOOR,
    STALL_FIRST_BYTE, STALL_FLOOR,
};
#[cfg(feature = "cuda")]
pub use device::DeviceLoad;
pub use gather::GatherStatus;
pub use load::{LayerTiming, LoadHandle, LoadHints, LoadRequest, LoadStats, MAX_ADVICE_TOKENS};
pub use memory::{MemoryKind, RegionId, RegisteredLoad};
pub use status::ChunkStatus;

use crate::error::{Error, StoreError};
use crate::layout::{object_len, ChunkHash, KeyBuilder, KvGeometry};
use crate::store::{PutIfAbsent, Store, StoreExt};
use bytes::Bytes;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use crate::layout::MARKER_MAGIC;

/// Outcome of a save.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SaveReport {
    /// Chunk objects this call wrote.
    pub written: usize,
    /// Chunk objects already present (another writer won; not an error).
    pub already_present: usize,
    /// Bytes written (data objects and markers).
    pub bytes: u64,
}

/// Outcome of a lookup.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LookupReport {
    /// Leading chunks of the prefix that are published (hits).
    pub chunks: usize,
    /// Sequential storage round trips spent (0 when answered from the local cache).
    pub round_trips: usize,
    /// Marker probes (HEAD requests) issued.
    pub probes: usize,
}

/// Counters of an engine since creation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineMetrics {
    /// Loads started.
    pub loads: u64,
    /// Saves completed.
    pub saves: u64,
    /// Lookups answered.
    pub lookups: u64,
    /// Chunks reported as hits by lookups.
    pub lookup_hit_chunks: u64,
    /// Marker probes issued by lookups.
    pub lookup_probes: u64,
    /// Bytes written by saves.
    pub bytes_saved: u64,
    /// Loads that followed a load of the same chunks in flight instead of fetching
    /// (`single_flight`).
    pub loads_followed: u64,
    /// Payload bytes received from storage by this engine's fetches (followers' copies not
    /// counted): with `single_flight`, concurrent loads of one prefix move it about once.
    pub bytes_fetched: u64,
}

#[derive(Default)]
struct Counters {
    loads: AtomicU64,
    saves: AtomicU64,
    lookups: AtomicU64,
    lookup_hit_chunks: AtomicU64,
    lookup_probes: AtomicU64,
    bytes_saved: AtomicU64,
    loads_followed: AtomicU64,
}

/// The ObjectCache client: one per process (or per TP rank), shared by threads.
///
/// Owns a small async runtime for its background reads; its async methods may be awaited
/// from any runtime, and every method has a blocking form for threads without one.
pub struct Engine {
    store: Arc<dyn Store>,
    cfg: EngineConfig,
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    /// marker key -> (published?, time of the answer)
    lookup_cache: Mutex<HashMap<String, (bool, Instant)>>,
    counters: Counters,
    /// Whether each of the store's endpoints offers gather, and idle gather connections.
    gather: Arc<gather::Probes>,
    next_request_id: AtomicU64,
    /// The link scheduler shared by this engine's ranged-GET loads under
    /// `bandwidth_cap_bytes_per_s` (none when uncapped).
    link: Option<Arc<crate::link::Link>>,
    /// RDMA session with the store's server and idle gather connections for it.
    #[cfg(feature = "rdma")]
    rdma: Arc<Mutex<rdma::Probe>>,
    /// Loads in flight that later loads of the same chunks may follow.
    flights: flight::Flights,
    /// Payload bytes received by this engine's fetches.
    fetched: Arc<AtomicU64>,
    /// The entries loads in flight read (held from `load` until the load ends); collection
    /// through [`Engine::gc`] never deletes them.
    leases: Arc<crate::lifecycle::LeaseTable>,
    /// Last load of each entry, for [`Engine::gc`]'s least-recently-used eviction.
    access: Arc<crate::lifecycle::AccessLog>,
    /// Memory registered for loads ([`Engine::register_memory`]).
    memory: memory::Registry,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("store", &self.store)
            .field("namespace", &self.cfg.namespace)
            .finish_non_exhaustive()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Engine {
    /// Opens the store named by `cfg.store` and starts the engine.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad store URL or settings; the store's error if it cannot be
    /// opened.
    pub fn new(cfg: EngineConfig) -> Result<Self, Error> {
        let mut e = Self::with_store(Arc::new(crate::store::MemoryStore::new()), cfg)?;
        let url = e.cfg.store.clone();
        let h = e.handle.clone();
        e.store = std::thread::scope(|s| {
            s.spawn(|| h.block_on(crate::store::open_store(&url)))
                .join()
        })
        .map_err(|_| Error::Config(format!("opening store {url:?} panicked")))??;
        e.start_gather_probe();
        e.start_store_warm();
        Ok(e)
    }

    /// Opens `max_requests` pooled connections to the store's endpoint in the background
    /// ([`Store::warm`]; nothing for local stores), so that the first ranged-GET load does
    /// not pay a connection set-up round trip per request. Where the endpoint may offer
    /// gather, only once its capabilities answer says it does not (gather loads need no S3
    /// connections, and the gather pool is warmed by the probe).
    fn start_store_warm(&self) {
        let store = self.store.clone();
        let n = self.cfg.max_requests;
        let gather = match self.cfg.gather {
            true => self
                .store
                .gather_target()
                .map(|t| (self.gather.get(&t.addr), t)),
            false => None,
        };
        self.handle.spawn(async move {
            if let Some((probe, t)) = gather {
                // The probe started with the engine; its sender closes with the verdict.
                if let Some(mut rx) = gather::start_probe(&probe, &t) {
                    let _ = rx.changed().await;
                }
                if gather::status(&probe) != GatherStatus::NotOffered {
                    return;
                }
            }
            let answered = store.warm(n).await;
            tracing::debug!(store = store.name(), answered, "connection pool warmed");
        });
    }

    /// Whether this engine's loads use gather, as far as it knows now: the answer of its one
    /// capabilities request to the store's endpoint (started with the engine), and the idle
    /// connections it keeps. For diagnostics and tests.
    ///
    /// Over several gateways (a store URL with several endpoints), the status of one: the
    /// first in placement order for route key 0.
    pub fn gather_status(&self) -> GatherStatus {
        if !self.cfg.gather {
            return GatherStatus::Off;
        }
        match self.store.gather_route(0).first() {
            None => GatherStatus::Off,
            Some(t) => gather::status(&self.gather.get(&t.addr)),
        }
    }

    /// Starts learning, in the background, whether the store's endpoint offers gather (one
    /// capabilities request per engine; see [`gather::offered`]), so that the first load
    /// finds the answer and a warm connection.
    fn start_gather_probe(&self) {
        if !self.cfg.gather {
            return;
        }
        let _rt = self.handle.enter();
        for t in self.store.gather_route(0) {
            gather::start_probe(&self.gather.get(&t.addr), &t);
        }
    }

    /// Starts an engine over an already opened store (`cfg.store` is ignored).
    ///
    /// # Errors
    /// [`Error::Io`] if the runtime cannot start; [`Error::Config`] for a bad namespace or an
    /// unknown `scheduler`.
    pub fn with_store(store: Arc<dyn Store>, cfg: EngineConfig) -> Result<Self, Error> {
        crate::layout::validate_namespace(&cfg.namespace)?;
        let policy = crate::sched::SchedulerSetting::parse(&cfg.scheduler)?.policy;
        let link = match cfg.bandwidth_cap_bytes_per_s {
            0 => None,
            cap => Some(crate::link::Link::new(policy, cap as f64)?),
        };
        let mut rt = tokio::runtime::Builder::new_multi_thread();
        rt.worker_threads(cfg.worker_threads.max(1))
            .thread_name("objectcache")
            .enable_all();
        if !cfg.cpus.is_empty() {
            // Every thread of the runtime (workers and blocking threads) is pinned as it
            // starts; the threads they start (RDMA pollers) inherit the mask.
            let cpus = cfg.cpus.clone();
            let warned = Arc::new(std::sync::atomic::AtomicBool::new(false));
            rt.on_thread_start(move || {
                if let Err(e) = affinity::pin_current_thread(&cpus) {
                    if !warned.swap(true, Ordering::Relaxed) {
                        tracing::warn!(?cpus, error = %e, "cpus: the engine's threads keep the CPUs of the thread that created the engine");
                    }
                }
            });
        }
        let rt = rt.build()?;
        let handle = rt.handle().clone();
        let e = Engine {
            store,
            cfg,
            rt: Some(rt),
            handle,
            lookup_cache: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            gather: Arc::new(gather::Probes::default()),
            next_request_id: AtomicU64::new(1),
            link,
            #[cfg(feature = "rdma")]
            rdma: Arc::new(Mutex::new(rdma::Probe::default())),
            flights: flight::Flights::default(),
            fetched: Arc::new(AtomicU64::new(0)),
            leases: crate::lifecycle::LeaseTable::new(),
            access: Arc::new(crate::lifecycle::AccessLog::new()),
            memory: memory::Registry::default(),
        };
        e.start_gather_probe();
        e.start_store_warm();
        Ok(e)
    }

    /// What a fetch of this engine needs (store, gather endpoint and connections, link,
    /// runtime, settings).
    fn fetcher(&self) -> flight::Fetcher {
        flight::Fetcher {
            store: self.store.clone(),
            probes: self.gather.clone(),
            link: self.link.clone(),
            handle: self.handle.clone(),
            cfg: self.cfg.clone(),
            #[cfg(feature = "rdma")]
            rdma: self.rdma.clone(),
            fetched: self.fetched.clone(),
        }
    }

    /// Runs one collection pass over this engine's store (`crate::lifecycle::collect`: GC of
    /// interrupted saves and orphan markers, TTL, capacity eviction by least recent load)
    /// with this engine's leases: an entry one of its loads in flight reads is never deleted
    /// (a load holds its chunks from [`Engine::load`] until it ends). Lookups neither pin nor
    /// count as use. For the embedded store the engine manages; a shared store is collected
    /// where its reads happen (the server: `ServerHandle::gc`).
    ///
    /// # Errors
    /// As `crate::lifecycle::collect`.
    pub async fn gc(
        &self,
        policy: &crate::lifecycle::Policy,
    ) -> Result<crate::lifecycle::GcReport, Error> {
        let (store, leases, access, policy) = (
            self.store.clone(),
            self.leases.clone(),
            self.access.clone(),
            policy.clone(),
        );
        Ok(self
            .spawn(async move {
                crate::lifecycle::collect(
                    &*store,
                    &policy,
                    std::time::SystemTime::now(),
                    Some(&access),
                    Some(&leases),
                )
                .await
            })
            .await??)
    }

    /// Blocking form of [`Engine::gc`].
    ///
    /// # Errors
    /// As [`Engine::gc`].
    pub fn gc_blocking(
        &self,
        policy: &crate::lifecycle::Policy,
    ) -> Result<crate::lifecycle::GcReport, Error> {
        std::thread::scope(|s| {
            s.spawn(|| self.handle.block_on(self.gc(policy)))
                .join()
                .expect("gc panicked")
        })
    }

    /// Whether an entry (a data or marker key, or an entry id) is held by a load in flight.
    pub fn is_leased(&self, key_or_id: &str) -> bool {
        self.leases.is_leased(key_or_id)
    }

    /// The store this engine uses.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Key builder for a geometry under this engine's namespace and hash algorithm.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an invalid geometry.
    pub fn keys(&self, g: &KvGeometry) -> Result<KeyBuilder, Error> {
        g.validate()?;
        KeyBuilder::new(&self.cfg.namespace, g, self.cfg.hash_algo)
    }

    /// Counters since creation.
    pub fn metrics(&self) -> EngineMetrics {
        let c = &self.counters;
        EngineMetrics {
            loads: c.loads.load(Ordering::Relaxed),
            saves: c.saves.load(Ordering::Relaxed),
            lookups: c.lookups.load(Ordering::Relaxed),
            lookup_hit_chunks: c.lookup_hit_chunks.load(Ordering::Relaxed),
            lookup_probes: c.lookup_probes.load(Ordering::Relaxed),
            bytes_saved: c.bytes_saved.load(Ordering::Relaxed),
            loads_followed: c.loads_followed.load(Ordering::Relaxed),
            bytes_fetched: self.fetched.load(Ordering::Relaxed),
        }
    }

    /// Saves a prefix's KV: `layers[l]` holds layer `l` of every chunk, chunk `c`'s slice
    /// (K of its `tokens_per_chunk` tokens, then V) at `c x slice_bytes`. Writes every chunk
    /// object create-only, then the publish markers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `layers.len() != geometry.layers` or a buffer is not
    /// `hashes.len() x slice_bytes` bytes; the store's error if a write fails (then no marker
    /// of this call is written past the failure, and nothing stored before is touched).
    pub async fn save(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
        layers: &[&[u8]],
    ) -> Result<SaveReport, Error> {
        let paged: Vec<Vec<&[u8]>> = layers.iter().map(|b| vec![*b]).collect();
        self.save_paged(g, hashes, &paged).await
    }

    /// Saves a prefix's KV from paged memory: `layers[l]` lists layer `l`'s source ranges in
    /// order, and their concatenation holds chunk `c`'s slice at `c x slice_bytes` (for an
    /// engine that keeps KV in blocks: one range per engine block of the chunks' tokens, in
    /// token order; with a [`crate::layout::KvLayout`] in the geometry the blocks are stored
    /// as they are). The ranges are only read, and may lie anywhere. As [`Engine::save`]
    /// otherwise.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `layers.len() != geometry.layers` or a layer's ranges do
    /// not add up to `hashes.len() x slice_bytes` bytes (naming the layer); as
    /// [`Engine::save`] otherwise.
    pub async fn save_paged(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
        layers: &[Vec<&[u8]>],
    ) -> Result<SaveReport, Error> {
        let keys = self.keys(g)?;
        let slice = g.slice_bytes() as usize;
        if layers.len() != g.layers as usize {
            return Err(Error::InvalidArgument(format!(
                "save: {} layer buffers given, geometry {} has {} layers",
                layers.len(),
                g.model,
                g.layers
            )));
        }
        for (l, parts) in layers.iter().enumerate() {
            let n: usize = parts.iter().map(|p| p.len()).sum();
            if n != hashes.len() * slice {
                return Err(Error::InvalidArgument(format!(
                    "save: layer {l} {} {n} bytes, expected {} chunks x {slice} bytes = {}",
                    if parts.len() == 1 {
                        "buffer has"
                    } else {
                        "ranges add up to"
                    },
                    hashes.len(),
                    hashes.len() * slice
                )));
            }
        }
        // Phase 1: data objects, create-only.
        let mut objects = Vec::with_capacity(hashes.len());
        for (c, h) in hashes.iter().enumerate() {
            let obj = crate::layout::encode_chunk_parts(g, g.tokens_per_chunk, |l| {
                sub_parts(&layers[l as usize], c * slice, slice)
            })?;
            objects.push((keys.data(h), Bytes::from(obj)));
        }
        let store = self.store.clone();
        let conc = self.cfg.save_concurrency;
        let data = self.spawn(async move {
            let results: Vec<Result<(PutIfAbsent, u64), StoreError>> =
                futures::stream::iter(objects)
                    .map(|(k, b)| {
                        let store = store.clone();
                        async move {
                            let n = b.len() as u64;
                            store.put_if_absent(&k, b).await.map(|r| (r, n))
                        }
                    })
                    .buffered(conc.max(1))
                    .collect()
                    .await;
            results
        });
        let mut report = SaveReport::default();
        for r in data.await? {
            match r? {
                (PutIfAbsent::Written, n) => {
                    report.written += 1;
                    report.bytes += n;
                }
                (PutIfAbsent::AlreadyPresent, _) => report.already_present += 1,
            }
        }
        // Phase 2: publish markers, after every data object is durable.
        let len = object_len(g.layers, g.slice_bytes());
        let marker = Bytes::copy_from_slice(&crate::layout::encode_marker(len));
        let mkeys: Vec<String> = hashes.iter().map(|h| keys.marker(h)).collect();
        let store = self.store.clone();
        let mk2 = mkeys.clone();
        let published = self.spawn(async move {
            futures::stream::iter(mk2)
                .map(|k| {
                    let store = store.clone();
                    let m = marker.clone();
                    async move { store.put_if_absent(&k, m).await }
                })
                .buffered(conc.max(1))
                .collect::<Vec<_>>()
                .await
        });
        for r in published.await? {
            if r? == PutIfAbsent::Written {
                report.bytes += 16;
            }
        }
        let now = Instant::now();
        let mut cache = self.lookup_cache.lock().expect("lock");
        for k in mkeys {
            cache.insert(k, (true, now));
        }
        drop(cache);
        self.counters.saves.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes_saved
            .fetch_add(report.bytes, Ordering::Relaxed);
        Ok(report)
    }

    /// Blocking form of [`Engine::save`].
    ///
    /// # Errors
    /// As [`Engine::save`].
    pub fn save_blocking(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
        layers: &[&[u8]],
    ) -> Result<SaveReport, Error> {
        std::thread::scope(|s| {
            s.spawn(|| {
                let h = self.handle.clone();
                h.block_on(self.save(g, hashes, layers))
            })
            .join()
            .expect("save panicked")
        })
    }

    /// Blocking form of [`Engine::save_paged`].
    ///
    /// # Errors
    /// As [`Engine::save_paged`].
    pub fn save_paged_blocking(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
        layers: &[Vec<&[u8]>],
    ) -> Result<SaveReport, Error> {
        std::thread::scope(|s| {
            s.spawn(|| {
                let h = self.handle.clone();
                h.block_on(self.save_paged(g, hashes, layers))
            })
            .join()
            .expect("save panicked")
        })
    }

    fn spawn<T: Send + 'static>(
        &self,
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<T, Error>> {
        let h = self.handle.spawn(f);
        async move {
            h.await
                .map_err(|e| Error::Io(std::io::Error::other(format!("engine task failed: {e}"))))
        }
    }

    /// How many leading chunks of `hashes` are published. Costs at most
    /// ceil(log_{fanout+1}(n+1)) sequential round trips (a k-ary search over publish markers,
    /// which are published in prefix order), stops at the first missing chunk, and reuses
    /// answers younger than `lookup_cache_ttl` (hits and misses; a save by this engine marks
    /// its chunks present at once).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad geometry; a store error other than not-found.
    pub async fn lookup_report(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
    ) -> Result<LookupReport, Error> {
        self.keys(g)?;
        // Every tensor-parallel rank's marker: a chunk is a hit only when every rank has it,
        // so the ranks of one engine group agree on every hit (case C16).
        let ranks: Vec<KeyBuilder> = (0..g.tp_world.max(1))
            .map(|r| {
                let mut gr = g.clone();
                gr.tp_rank = r;
                KeyBuilder::new(&self.cfg.namespace, &gr, self.cfg.hash_algo)
            })
            .collect::<Result<_, _>>()?;
        let mkeys: Vec<Vec<String>> = hashes
            .iter()
            .map(|h| ranks.iter().map(|k| k.marker(h)).collect())
            .collect();
        let ttl = self.cfg.lookup_cache_ttl;
        // A position's state from per-key answers: present if every rank's marker is, absent
        // if one is absent, else unknown.
        let state = |answers: &dyn Fn(&str) -> Option<bool>, keys: &[String]| -> Option<bool> {
            let mut all = true;
            for k in keys {
                match answers(k) {
                    Some(false) => return Some(false),
                    Some(true) => {}
                    None => all = false,
                }
            }
            all.then_some(true)
        };
        // Known state per position from the cache: Some(true/false) or None.
        let mut known: Vec<Option<bool>> = {
            let mut cache = self.lookup_cache.lock().expect("lock");
            cache.retain(|_, (_, t)| t.elapsed() < ttl);
            let cached = |k: &str| cache.get(k).map(|(p, _)| *p);
            mkeys.iter().map(|ks| state(&cached, ks)).collect()
        };
        // Answers of this lookup's probes, per marker key.
        let mut probed: HashMap<String, bool> = HashMap::new();
        // Markers are monotone along the prefix (published in order): find the boundary.
        let mut lo = 0usize; // every position < lo is present
        let mut hi = hashes.len(); // every position >= hi is absent (or beyond)
        let tighten = |known: &[Option<bool>], lo: &mut usize, hi: &mut usize| {
            while *lo < *hi && known[*lo] == Some(true) {
                *lo += 1;
            }
            if let Some(p) = known[*lo..*hi].iter().position(|k| *k == Some(false)) {
                *hi = *lo + p;
            }
        };
        tighten(&known, &mut lo, &mut hi);
        let mut report = LookupReport::default();
        let fanout = self.cfg.lookup_fanout.max(1);
        while lo < hi {
            // Probe up to `fanout` positions spread over [lo, hi), always including lo (every
            // rank's marker of each, in the same round trip).
            let span = hi - lo;
            let n = fanout.min(span);
            let mut probes: Vec<usize> = (0..n).map(|i| lo + i * span / n).collect();
            probes.dedup();
            let store = self.store.clone();
            let pk: Vec<String> = probes
                .iter()
                .flat_map(|&i| mkeys[i].iter().cloned())
                .filter(|k| !probed.contains_key(k))
                .collect();
            let asked = pk.clone();
            let answers = self
                .spawn(async move {
                    futures::future::join_all(pk.into_iter().map(|k| {
                        let store = store.clone();
                        async move { store.exists(&k).await }
                    }))
                    .await
                })
                .await?;
            report.round_trips += 1;
            report.probes += asked.len();
            for (k, a) in asked.into_iter().zip(answers) {
                probed.insert(k, a?);
            }
            for &i in &probes {
                let p = |k: &str| probed.get(k).copied();
                known[i] = state(&p, &mkeys[i]);
            }
            // Monotonicity: a present marker implies all before it are present; an absent one
            // that all after it are absent.
            // An absent marker bounds the answer even if a later one is present (markers that
            // are not a prefix: a marker phase that failed part way, a chunk evicted).
            if let Some(&first_absent) = probes.iter().filter(|&&i| known[i] == Some(false)).min() {
                hi = hi.min(first_absent);
            }
            if let Some(&last_present) = probes
                .iter()
                .filter(|&&i| i < hi && known[i] == Some(true))
                .max()
            {
                lo = lo.max(last_present + 1);
            }
            tighten(&known, &mut lo, &mut hi);
        }
        report.chunks = lo;
        {
            let now = Instant::now();
            let mut cache = self.lookup_cache.lock().expect("lock");
            for (k, &p) in &probed {
                cache.entry(k.clone()).or_insert((p, now));
            }
            for (i, ks) in mkeys.iter().enumerate() {
                if i < lo {
                    for k in ks {
                        cache.insert(k.clone(), (true, now));
                    }
                }
            }
        }
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        self.counters
            .lookup_hit_chunks
            .fetch_add(lo as u64, Ordering::Relaxed);
        self.counters
            .lookup_probes
            .fetch_add(report.probes as u64, Ordering::Relaxed);
        Ok(report)
    }

    /// Leading published chunks of `hashes` (see [`Engine::lookup_report`]).
    ///
    /// # Errors
    /// As [`Engine::lookup_report`].
    pub async fn lookup(&self, g: &KvGeometry, hashes: &[ChunkHash]) -> Result<usize, Error> {
        Ok(self.lookup_report(g, hashes).await?.chunks)
    }

    /// Blocking form of [`Engine::lookup`].
    ///
    /// # Errors
    /// As [`Engine::lookup_report`].
    pub fn lookup_blocking(&self, g: &KvGeometry, hashes: &[ChunkHash]) -> Result<usize, Error> {
        std::thread::scope(|s| {
            s.spawn(|| self.handle.block_on(self.lookup(g, hashes)))
                .join()
                .expect("lookup panicked")
        })
    }

    /// Forgets whatever this engine keeps about caller memory `ptr..ptr+len`: the RDMA
    /// registration of a memory area given to [`LayerBuffers::from_raw_ranges`] (kept for
    /// later loads until now). Call it before that memory is freed or remapped (the C ABI
    /// calls it when a region is deregistered). A load still writing into the memory keeps
    /// its registration until it ends. No-op for memory the engine never saw, and in builds
    /// without RDMA.
    pub fn forget_memory(&self, ptr: *mut u8, len: usize) {
        #[cfg(feature = "rdma")]
        rdma::forget(&self.rdma, ptr, len);
        #[cfg(not(feature = "rdma"))]
        let _ = (ptr, len);
    }

    /// Starts a layer-ordered load of `req.hashes` into `dest` and returns at once.
    ///
    /// `dest` must have `geometry.layers` buffers of at least `hashes.len() x slice_bytes`
    /// bytes; only that many bytes of each are written, never more. A layer's buffer may be
    /// a list of ranges (paged KV, [`LayerBuffers::paged`], [`LayerBuffers::from_raw_ranges`]):
    /// the bytes land straight in the ranges on every path, chunk `c`'s slice at logical
    /// offset `c x slice_bytes` of their concatenation. Reads are issued in layer
    /// order (layer 0 of every chunk first), at most `window_bytes` and `max_requests` in
    /// flight, each verified by its slice CRC32C before its layer can become ready.
    ///
    /// `req.hints` (per-layer compute times or deadlines, priority) go to the gather server
    /// with the request, and under `bandwidth_cap_bytes_per_s` to this engine's link, which
    /// paces the ranged GETs of all its loads under `scheduler`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty request, a wrong number of layer buffers or a
    /// buffer too small (the message names the layer and the sizes), or hints that do not fit
    /// the geometry ([`LoadHints::validate`]).
    pub fn load(&self, req: LoadRequest, dest: LayerBuffers) -> Result<LoadHandle, Error> {
        let g = &req.geometry;
        let keys = self.keys(g)?;
        if req.hashes.is_empty() {
            return Err(Error::InvalidArgument("load: no chunks requested".into()));
        }
        req.hints.validate(g.layers)?;
        if dest.layers() != g.layers as usize {
            return Err(Error::InvalidArgument(format!(
                "load: {} destination buffers given, geometry {} has {} layers",
                dest.layers(),
                g.model,
                g.layers
            )));
        }
        let need = req.hashes.len() as u64 * g.slice_bytes();
        for l in 0..dest.layers() {
            if (dest.layer_len(l) as u64) < need {
                return Err(Error::InvalidArgument(format!(
                    "load: layer {l} buffer has {} bytes, needs {} chunks x {} bytes = {need}",
                    dest.layer_len(l),
                    req.hashes.len(),
                    g.slice_bytes()
                )));
            }
        }
        let sh = Arc::new(load::Shared::new(dest, need, req.hashes.len()));
        // The load holds its entries until it ends (completed, failed, cancelled, dropped, or
        // with the process): this engine's collection never deletes them under it. A lookup
        // holds nothing.
        let data_keys: Vec<String> = req.hashes.iter().map(|h| keys.data(h)).collect();
        let now = std::time::SystemTime::now();
        for k in &data_keys {
            self.access.record(k, now);
        }
        let lease = self.leases.acquire(data_keys);
        let request_id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let fetcher = Arc::new(self.fetcher());
        let prefix = keys.prefix().to_string();
        let total_bytes = need * g.layers as u64;
        // One fetch for many requests: follow a load of the same chunks in flight (flight.rs).
        let leader = if self.cfg.single_flight {
            self.flights.leader_for(&prefix, &req.hashes, total_bytes)
        } else {
            None
        };
        match leader {
            Some(leader) => {
                let timeout = self.cfg.load_deadline(total_bytes);
                let sh2 = sh.clone();
                let follow = flight::follow(leader, sh.clone(), fetcher, req, keys, request_id);
                let task = self.handle.spawn(async move {
                    let _lease = lease;
                    match timeout {
                        None => follow.await,
                        Some(t) => {
                            if tokio::time::timeout(t, follow).await.is_err() {
                                for l in 0..sh2.state.layers() {
                                    sh2.state.fail_impl(
                                        l as u32,
                                        crate::error::LayerError::Timeout { layer: l },
                                    );
                                }
                                sh2.state.cancel();
                            }
                        }
                    }
                });
                sh.tasks.lock().expect("lock").push(task);
                self.counters.loads_followed.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                if self.cfg.single_flight {
                    self.flights.register(&prefix, &req.hashes, &sh);
                }
                fetcher.start(req, keys, sh.clone(), request_id, Some(lease));
            }
        }
        self.counters.loads.fetch_add(1, Ordering::Relaxed);
        Ok(LoadHandle {
            sh,
            rt: self.handle.clone(),
        })
    }
}

/// The pieces of `parts` (taken in order as one buffer) that hold bytes `start..start+len`;
/// the caller has checked that the parts hold at least `start + len` bytes.
fn sub_parts<'a>(parts: &[&'a [u8]], start: usize, len: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let (mut at, end) = (0usize, start + len);
    for p in parts {
        let (a, b) = (at, at + p.len());
        at = b;
        if b <= start || p.is_empty() {
            continue;
        }
        if a >= end {
            break;
        }
        out.push(&p[start.max(a) - a..end.min(b) - a]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn sub_parts_cut_a_range_out_of_scattered_parts() {
        let (a, b, c) = ([1u8, 2, 3], [4u8], [5u8, 6, 7, 8]);
        let parts: Vec<&[u8]> = vec![&a, &[], &b, &c];
        let flat = |v: Vec<&[u8]>| v.concat();
        assert_eq!(flat(sub_parts(&parts, 0, 8)), vec![1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(flat(sub_parts(&parts, 2, 3)), vec![3, 4, 5]);
        assert_eq!(sub_parts(&parts, 3, 1), vec![&[4u8][..]]);
        assert_eq!(flat(sub_parts(&parts, 5, 3)), vec![6, 7, 8]);
        assert!(sub_parts(&parts, 4, 0).is_empty());
    }

    /// Waits (up to 10 s, a liveness bound, not a speed goal) until `f` holds.
    fn eventually(what: &str, f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn ranged_get_loads_join_and_leave_the_engine_link() {
        let g = KvGeometry::smollm2_135m();
        let store: Arc<dyn Store> = Arc::new(crate::store::MemoryStore::new());
        let cfg = EngineConfig::from_pairs([
            ("gather", "off"),
            ("scheduler", "equal"),
            ("bandwidth_cap_bytes_per_s", "20000000"),
            // Two loads of one prefix: each on the link (not one following the other).
            ("single_flight", "off"),
        ])
        .unwrap();
        let e = Engine::with_store(store, cfg).unwrap();
        let link = e.link.clone().expect("a capped engine has a link");
        let slice = g.slice_bytes() as usize;
        let hashes: Vec<ChunkHash> = (0..4u8).map(|i| ChunkHash::from_digest([i; 32])).collect();
        let data: Vec<Vec<u8>> = (0..g.layers)
            .map(|l| (0..4 * slice).map(|i| (i as u32 ^ l) as u8).collect())
            .collect();
        let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
        e.save_blocking(&g, &hashes, &refs).unwrap();
        let load = |n: usize| {
            e.load(
                LoadRequest::new(g.clone(), hashes[..n].to_vec())
                    .with_layer_compute_s(vec![0.001; g.layers as usize]),
                LayerBuffers::allocate(g.layers as usize, n * slice),
            )
            .unwrap()
        };
        // 1 chunk (5.9 MB, 0.3 s at 20 MB/s): completes, verified, and leaves.
        let h = load(1);
        h.wait_all_blocking().unwrap();
        for l in 0..g.layers as usize {
            assert_eq!(h.layer(l).unwrap(), &data[l][..slice]);
        }
        eventually("the completed load leaves", || link.loads() == 0);
        // 4 chunks each (47 MB, 2.4 s at the cap together): cancel one, drop the other.
        let (a, b) = (load(4), load(4));
        eventually("both loads join", || link.loads() == 2);
        a.cancel();
        eventually("the cancelled load leaves", || link.loads() == 1);
        assert!(matches!(
            a.wait_layer_blocking(g.layers as usize - 1, None),
            Err(crate::LayerError::Cancelled)
        ));
        drop(b);
        assert_eq!(link.loads(), 0, "a dropped load has left");
        // Uncapped engines have no link.
        let e2 = Engine::with_store(
            Arc::new(crate::store::MemoryStore::new()),
            EngineConfig::default(),
        )
        .unwrap();
        assert!(e2.link.is_none());
        let bad = EngineConfig {
            scheduler: "lottery".into(),
            ..EngineConfig::default()
        };
        let err = Engine::with_store(Arc::new(crate::store::MemoryStore::new()), bad).unwrap_err();
        assert!(err.to_string().contains("lottery"), "{err}");
    }
}
