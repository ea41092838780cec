//! The client engine: save, lookup and layer-ordered load of prefix KV cache.
//!
//! ```no_run
//! # extern crate objectcache_client as objectcache; // users name the façade crate
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
//!
//! By concern: the engine, its construction and counters here; [`Engine::save`] in
//! `save.rs`, [`Engine::lookup`] in `lookup.rs`, [`Engine::load`] and the load's parts in
//! `load/` (the gather path in `gather/`, RDMA in `rdma.rs`, following a load in flight in
//! `flight.rs`); destination buffers (`buffers/`), registered memory (`memory.rs`),
//! settings (`config.rs`).

mod affinity;
mod buffers;
mod config;
#[cfg(feature = "cuda")]
mod device;
mod fetch;
mod flight;
mod gather;
mod load;
mod lookup;
mod markers;
mod memory;
mod path;
#[cfg(feature = "rdma")]
mod rdma;
mod save;
mod self_check;
mod shared;
mod status;

use buffers::first_overlap;
pub use buffers::{LayerBuffers, LayerStatus};
pub use config::{
    default_cache_dir, EngineConfig, SaveFormat, StallTimeout, Transport, CONFIG_KEYS,
    LOAD_DEADLINE_FLOOR, MAX_SEGMENT_BYTES, STALL_FIRST_BYTE, STALL_FLOOR,
};
#[cfg(feature = "cuda")]
pub use device::DeviceLoad;
pub use gather::GatherStatus;
pub use load::{LayerTiming, LoadHandle, LoadHints, LoadRequest, LoadStats, MAX_ADVICE_TOKENS};
pub use memory::{MemoryKind, RegionId, RegisteredLoad};
pub use status::ChunkStatus;

use crate::error::Error;
use crate::layout::{ChunkHash, KeyBuilder, KvGeometry};
use crate::store::{Gateways, Store};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use crate::layout::MARKER_MAGIC;

/// Outcome of a save.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SaveReport {
    /// Chunks this call stored: format version 1, chunk objects written; version 2 (segment
    /// objects, `save_format`), chunks whose marker this call published.
    pub written: usize,
    /// Chunks already stored (another writer won; not an error): version 1, chunk objects
    /// present; version 2, chunks already published (the lookup cache said so, or their
    /// marker was present).
    pub already_present: usize,
    /// Bytes written (data or segment objects, and markers).
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
    /// Whether `lookup_deadline_ms` passed before every probe answered: `chunks` is then the
    /// prefix the answers received had shown published.
    pub cut_short: bool,
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
    /// Lookups that `lookup_deadline_ms` cut short (answered with the prefix confirmed so
    /// far; [`LookupReport::cut_short`]).
    pub lookups_cut_short: u64,
    /// Bytes written by saves.
    pub bytes_saved: u64,
    /// Loads that followed a load of the same chunks in flight instead of fetching
    /// (`single_flight`).
    pub loads_followed: u64,
    /// Payload bytes received from storage by this engine's fetches (followers' copies not
    /// counted): with `single_flight`, concurrent loads of one prefix move it about once.
    pub bytes_fetched: u64,
    /// What the store's self-check found (`self_check`): 0 not checked (a local store,
    /// `self_check` off, or the check still running), 1 safe, 2 safe with a shorter idle
    /// time for pooled connections, 3 refused (saves fail).
    pub store_mode: u64,
}

#[derive(Default)]
struct Counters {
    loads: AtomicU64,
    saves: AtomicU64,
    lookups: AtomicU64,
    lookup_hit_chunks: AtomicU64,
    lookup_probes: AtomicU64,
    lookups_cut_short: AtomicU64,
    bytes_saved: AtomicU64,
    loads_followed: AtomicU64,
}

/// The ObjectCache client: one per process (or per TP rank), shared by threads.
///
/// Owns a small async runtime for its background reads; its async methods may be awaited
/// from any runtime, and every method has a blocking form for threads without one.
pub struct Engine {
    store: Arc<dyn Store>,
    /// Where loads may use gather, in which order, and the store's connection pool to warm
    /// (held beside the store: [`Gateways`]).
    gateways: Gateways,
    cfg: EngineConfig,
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    /// This engine's number in the process (which engine registered a load in flight).
    id: u64,
    /// The lookup cache and the loads in flight, shared with the process's other engines on
    /// the same store when opened by URL (`shared.rs`).
    shared: Arc<shared::Shared>,
    counters: Counters,
    /// Whether each of the store's endpoints offers gather, and idle gather connections.
    gather: Arc<gather::Probes>,
    next_request_id: AtomicU64,
    /// The link scheduler shared by this engine's ranged-GET loads under
    /// `bandwidth_cap_bytes_per_s` (none when uncapped).
    link: Option<Arc<crate::link::Link>>,
    /// RDMA session with the store's server and idle gather connections for it.
    #[cfg(feature = "rdma")]
    rdma: Arc<std::sync::Mutex<rdma::Probe>>,
    /// Payload bytes received by this engine's fetches.
    fetched: Arc<AtomicU64>,
    /// The entries loads in flight read (held from `load` until the load ends); collection
    /// through [`Engine::gc`] never deletes them.
    leases: Arc<crate::lifecycle::LeaseTable>,
    /// Last load of each entry, for [`Engine::gc`]'s least-recently-used eviction.
    access: Arc<crate::lifecycle::AccessLog>,
    /// What the format v2 markers said at the last [`Engine::gc`] pass.
    gc_memo: Arc<crate::lifecycle::MarkerMemo>,
    /// Memory registered for loads ([`Engine::register_memory`]).
    memory: memory::Registry,
    /// The store's self-check, for a remote store opened by URL ([`Engine::new`]).
    self_check: Option<self_check::Verdict>,
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
    /// Stops the engine's runtime. Outside an async context the drop waits (up to
    /// `RUNTIME_STOP_WAIT`, 2 s) until the runtime's tasks are gone, so that a store shared with
    /// a later engine ([`Engine::with_store`]) holds no pooled connection whose task is still
    /// being torn down: such a connection takes a request and then fails it ("dispatch task
    /// is gone", seen in CI with engines over one S3 store in turn). Inside an async context,
    /// where blocking is not allowed, the runtime stops in the background.
    fn drop(&mut self) {
        // Loads of this engine that another engine's loads follow cannot go on once its
        // runtime stops: they end now, and their followers fetch the rest themselves.
        self.shared.flights.cancel_owned(self.id);
        if let Some(rt) = self.rt.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                rt.shutdown_background();
            } else {
                rt.shutdown_timeout(RUNTIME_STOP_WAIT);
            }
        }
    }
}

/// The next [`Engine`]'s number in this process.
static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// How long dropping an [`Engine`] outside an async context waits for its runtime to stop
/// (seconds): its tasks are dropped at once; only a blocking read still in progress (a file
/// read, a copy into device memory) can hold it this long.
const RUNTIME_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl Engine {
    /// Opens the store named by `cfg.store` and starts the engine.
    ///
    /// Engines of one process opened on the same store (the same directory, or S3 URL) share
    /// their lookup cache and their loads in flight (`connector/shared.rs`): a save by one
    /// is known to the lookups of all, and a load follows a load of the same chunks in flight
    /// in any of them.
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
        e.gateways = Gateways::of(&*e.store);
        e.shared = shared::for_store(crate::store::shared_identity(&url).as_deref());
        if e.cfg.self_check && self_check::wanted(&*e.store) {
            e.self_check = Some(self_check::start(&url, e.store.clone(), &e.handle));
        }
        e.start_gather_probe();
        e.start_store_warm();
        Ok(e)
    }

    /// Opens `max_requests` pooled connections to the store's endpoint in the background
    /// ([`Gateways::warm`]; nothing for local stores), so that the first ranged-GET load does
    /// not pay a connection set-up round trip per request. Where the endpoint may offer
    /// gather, only once its capabilities answer says it does not (gather loads need no S3
    /// connections, and the gather pool is warmed by the probe).
    fn start_store_warm(&self) {
        let (store, gateways) = (self.store.clone(), self.gateways.clone());
        let n = self.cfg.max_requests;
        let gather = match self.cfg.gather {
            true => self.gateways.first().map(|t| (self.gather.get(&t.addr), t)),
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
            let answered = gateways.warm(n).await;
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
        match self.gateways.route(0).first() {
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
        for t in self.gateways.route(0) {
            gather::start_probe(&self.gather.get(&t.addr), &t);
        }
    }

    /// Starts an engine over an already opened store (`cfg.store` is ignored), with the
    /// store's own gather endpoints ([`Gateways::of`]: an `S3Store`'s endpoint, a
    /// `GatewayStore`'s; none for other stores).
    ///
    /// Such an engine keeps its lookup cache and loads in flight to itself (unlike engines
    /// opened on one store URL by [`Engine::new`]).
    ///
    /// Engines may share one store, in turn or at once. An S3 store's pooled connections are
    /// driven by the runtime of the engine that opened them: dropping an engine fails a
    /// request that another engine is sending on such a connection at that moment (a miss
    /// for a load's layers, an error for a save); engines used in turn are safe (see the
    /// drop).
    ///
    /// # Errors
    /// [`Error::Io`] if the runtime cannot start; [`Error::Config`] for a bad namespace or an
    /// unknown `scheduler`.
    pub fn with_store(store: Arc<dyn Store>, cfg: EngineConfig) -> Result<Self, Error> {
        let gateways = Gateways::of(&*store);
        Self::with_gateways(store, gateways, cfg)
    }

    /// Starts an engine over an already opened store and the gather endpoints in front of it
    /// (`cfg.store` is ignored): [`Engine::with_store`] for a store that wraps another (a
    /// `MeteredStore`, a `TrackedStore`), with the wrapped store's [`Gateways`], or with
    /// gateways of the caller's choosing ([`Gateways::none`]: ranged GETs only).
    ///
    /// # Errors
    /// As [`Engine::with_store`].
    pub fn with_gateways(
        store: Arc<dyn Store>,
        gateways: Gateways,
        cfg: EngineConfig,
    ) -> Result<Self, Error> {
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
            gateways,
            cfg,
            rt: Some(rt),
            handle,
            id: NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed),
            shared: shared::for_store(None),
            counters: Counters::default(),
            gather: Arc::new(gather::Probes::default()),
            next_request_id: AtomicU64::new(1),
            link,
            #[cfg(feature = "rdma")]
            rdma: Arc::new(std::sync::Mutex::new(rdma::Probe::default())),
            fetched: Arc::new(AtomicU64::new(0)),
            leases: crate::lifecycle::LeaseTable::new(),
            access: Arc::new(crate::lifecycle::AccessLog::new()),
            gc_memo: Arc::default(),
            memory: memory::Registry::default(),
            self_check: None,
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
            gateways: self.gateways.clone(),
            probes: self.gather.clone(),
            link: self.link.clone(),
            handle: self.handle.clone(),
            cfg: self.cfg.clone(),
            #[cfg(feature = "rdma")]
            rdma: self.rdma.clone(),
            fetched: self.fetched.clone(),
            markers: Default::default(),
        }
    }

    /// Runs one collection pass over this engine's store (`crate::lifecycle::collect`: GC of
    /// interrupted saves and orphan markers, TTL, capacity eviction by least recent load;
    /// format v2 markers unchanged since this engine's last pass are not read again,
    /// `crate::lifecycle::MarkerMemo`) with this engine's leases: an entry one of its loads
    /// in flight reads is never deleted (a load holds its chunks from [`Engine::load`] until
    /// it ends). Lookups neither pin nor count as use. For the embedded store the engine
    /// manages; a shared store is collected where its reads happen (the server:
    /// `ServerHandle::gc`).
    ///
    /// # Errors
    /// As `crate::lifecycle::collect`.
    pub async fn gc(
        &self,
        policy: &crate::lifecycle::Policy,
    ) -> Result<crate::lifecycle::GcReport, Error> {
        let (store, leases, access, memo, policy) = (
            self.store.clone(),
            self.leases.clone(),
            self.access.clone(),
            self.gc_memo.clone(),
            policy.clone(),
        );
        Ok(self
            .spawn(async move {
                crate::lifecycle::collect_with(
                    &*store,
                    &policy,
                    std::time::SystemTime::now(),
                    Some(&access),
                    Some(&leases),
                    &memo,
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
        self.run_blocking("gc", || self.gc(policy))
    }

    /// Whether an entry (a data or marker key, or an entry id) is held by a load in flight.
    pub fn is_leased(&self, key_or_id: &str) -> bool {
        self.leases.is_leased(key_or_id)
    }

    /// The store this engine uses.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The gather endpoints this engine's loads may use, beside its store.
    pub fn gateways(&self) -> &Gateways {
        &self.gateways
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

    /// [`Engine::keys`] for a request of `hashes`, which must be hashes of this engine's
    /// `hash_algo` ([`crate::HashAlgo::check_hashes`]: 32 bytes each under `sha256cbor`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an invalid geometry or a hash of the wrong length
    /// (naming its position).
    pub(crate) fn keys_for(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
    ) -> Result<KeyBuilder, Error> {
        let keys = self.keys(g)?;
        self.cfg.hash_algo.check_hashes(hashes)?;
        Ok(keys)
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
            lookups_cut_short: c.lookups_cut_short.load(Ordering::Relaxed),
            bytes_saved: c.bytes_saved.load(Ordering::Relaxed),
            loads_followed: c.loads_followed.load(Ordering::Relaxed),
            bytes_fetched: self.fetched.load(Ordering::Relaxed),
            store_mode: self_check::mode_code(self.self_check.as_ref()),
        }
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

    /// Runs the future `make` returns to its end on the engine's runtime, from a thread of
    /// its own (so that the blocking forms may be called from async code too).
    ///
    /// # Panics
    /// With "`what` panicked" where the future panicked.
    fn run_blocking<F: std::future::Future>(
        &self,
        what: &str,
        make: impl FnOnce() -> F + Send,
    ) -> F::Output
    where
        F::Output: Send,
    {
        std::thread::scope(|s| {
            s.spawn(|| self.handle.block_on(make()))
                .join()
                .unwrap_or_else(|e| panic!("{what} panicked: {e:?}"))
        })
    }
}

/// Checks that a call was given one buffer per layer of `g`: `given` buffers (`what`, e.g.
/// "destination buffers") for operation `op` ("load", "save").
///
/// # Errors
/// [`Error::InvalidArgument`] naming both counts and the model.
pub(crate) fn check_layer_count(
    op: &str,
    given: usize,
    what: &str,
    g: &KvGeometry,
) -> Result<(), Error> {
    if given == g.layers as usize {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{op}: {given} {what} given, geometry {} has {} layers",
        g.model, g.layers
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

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
