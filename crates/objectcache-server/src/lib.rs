//! The ObjectCache server: S3-compatible storage plus the one-request layer-ordered gather.
//!
//! One listening port serves both: a connection that opens with the gather preface
//! ([`objectcache_client::protocol::PREFACE`]) is a gather connection (`gather.rs`); anything else is
//! HTTP/1.1, where `/_objectcache/health`, `/_objectcache/metrics` and
//! `/_objectcache/capabilities` are answered here and every other request goes to the S3 API
//! ([`s3::S3Frontend`] through `s3s`, SigV4 with the configured keys, path-style addressing).
//! Bucket names cannot start with `_`, so these paths never shadow a bucket.
//!
//! Start one with [`start`] (opening the configured store) or [`start_with_store`]; stop it
//! with [`ServerHandle::shutdown`], which stops accepting, lets loads in flight finish for
//! `shutdown_grace_secs`, then aborts them with a `ShuttingDown` error frame.
//!
//! This crate (`objectcache-server`) sits above the client crate (`objectcache-client`) and
//! uses its stores, lifecycle and transports; nothing below it can use the server. The façade
//! crate `objectcache` re-exports it as `objectcache::server` (feature `server`, on by
//! default).
//!
//! Here: the state every connection shares, load admission and the [`ServerHandle`]; starting
//! in `start.rs`, the accept loop in `accept.rs`, the HTTP side in `http.rs`.
#![warn(missing_docs)]
#![deny(unsafe_code)]

// The client's modules are named by their full path (`objectcache_client::protocol`, ...):
// `crate::` is this crate's own. Its `sched` is the server's load admission; the core's
// scheduler is `objectcache_client::sched`.
use objectcache_client::Result;

mod accept;
mod budget;
pub mod config;
mod conn;
mod gather;
mod group;
mod http;
pub mod lookup;
mod mapped;
pub mod metrics;
mod reads;
pub mod s3;
pub mod sched;
mod start;
pub mod tenant;
pub mod tls;

pub use config::{AccessKey, BadAccessKey, ServerConfig};
pub use http::MAX_PRESIGNED_EXPIRES_SECS;
pub use start::{open_backend, start, start_with_store, start_with_tier};

use metrics::Metrics;
use objectcache_client::protocol::{ServerInfo, ServerLimits};
use objectcache_client::store::Store;
use s3::Buckets;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// Why a request stopped early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Abort {
    /// The client closed the connection, failed, or stopped reading.
    Gone,
    /// The client cancelled.
    Cancelled,
    /// The server is shutting down.
    Shutdown,
}

struct Admission {
    active: usize,
    queue: Box<dyn sched::LoadScheduler>,
    waiting: HashMap<u64, oneshot::Sender<Slot>>,
}

/// State shared by every connection.
pub(crate) struct ServerState {
    pub(crate) cfg: ServerConfig,
    pub(crate) store: Arc<dyn Store>,
    /// The node tier in front of the store, when one is configured (its counters go to the
    /// metrics).
    pub(crate) tier: Option<Arc<objectcache_client::store::TieredStore>>,
    /// The remote store behind the server, metered (gateway mode only): its requests and
    /// bytes go to the metrics.
    pub(crate) backend: Option<Arc<objectcache_client::store::MeteredStore>>,
    pub(crate) buckets: Arc<Buckets>,
    pub(crate) metrics: Arc<Metrics>,
    /// The memory budget over every buffer a request holds ([`budget`]).
    pub(crate) budget: budget::Budget,
    /// Open-connection caps.
    conns: Arc<conn::ConnLimits>,
    pub(crate) shutdown: CancellationToken,
    admission: Mutex<Admission>,
    next_id: AtomicU64,
    /// Striped loads being served (their stripes share admission and pacing).
    pub(crate) loads: group::Loads,
    /// Backend reads in flight, joined by concurrent loads of the same slices.
    pub(crate) reads: reads::Reads,
    /// Leases of the entries loads in flight read: a gather load holds its chunks' entries
    /// until it ends; a ranged GET of the S3 API renews its entry's soft lease for
    /// [`S3_READ_LEASE`]. Collection ([`ServerHandle::gc`]) never deletes a leased entry.
    pub(crate) leases: Arc<objectcache_client::lifecycle::LeaseTable>,
    /// Last use of each entry (gather loads and S3 reads; not lookups), for LRU eviction.
    pub(crate) access: Arc<objectcache_client::lifecycle::AccessLog>,
    /// What the format v2 markers said at the last [`ServerHandle::gc`] pass.
    pub(crate) gc_memo: objectcache_client::lifecycle::MarkerMemo,
    /// RDMA gather sessions (feature `rdma`, when a device exists).
    #[cfg(feature = "rdma")]
    pub(crate) rdma: Option<Arc<objectcache_client::transport::rdma::SessionRegistry>>,
    /// The link scheduler pacing gather loads under `bandwidth_cap_bytes_per_s` (none when
    /// uncapped).
    pub(crate) link: Option<Arc<objectcache_client::link::Link>>,
}

impl ServerState {
    pub(crate) fn limits(&self) -> ServerLimits {
        ServerLimits {
            max_descriptor_bytes: self.cfg.max_descriptor_bytes,
            max_chunks: self.cfg.max_chunks,
            max_request_bytes: self.cfg.max_request_bytes,
            features: ServerInfo::FEATURE_GATHER_TCP
                | ServerInfo::FEATURE_SAVE
                | ServerInfo::FEATURE_LOAD_GROUPS
                | ServerInfo::FEATURE_HELD
                | self.segments_feature()
                | self.rdma_feature(),
        }
    }

    /// [`ServerInfo::FEATURE_SEGMENTS`] unless `read_segments` is off, else 0.
    fn segments_feature(&self) -> u32 {
        if self.cfg.read_segments {
            ServerInfo::FEATURE_SEGMENTS
        } else {
            0
        }
    }

    /// [`ServerInfo::FEATURE_RDMA`] and [`ServerInfo::FEATURE_RDMA_SCATTER`] when RDMA
    /// gather sessions are offered, else 0.
    fn rdma_feature(&self) -> u32 {
        #[cfg(feature = "rdma")]
        if self.rdma.is_some() {
            return ServerInfo::FEATURE_RDMA | ServerInfo::FEATURE_RDMA_SCATTER;
        }
        0
    }
}

/// A load's admission slot; dropping it admits the next waiting load.
pub(crate) struct Slot {
    sh: Arc<ServerState>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let sh = self.sh.clone();
        let mut a = sh
            .admission
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        a.active -= 1;
        sh.metrics.active_loads.dec();
        while let Some(t) = a.queue.pop() {
            sh.metrics.queued_loads.dec();
            if let Some(tx) = a.waiting.remove(&t.id) {
                a.active += 1;
                sh.metrics.active_loads.inc();
                // If the waiter is gone the slot comes back here through its own drop.
                let slot = Slot { sh: sh.clone() };
                drop(a);
                let _ = tx.send(slot);
                return;
            }
        }
    }
}

/// Waits for an admission slot under the configured scheduler.
///
/// # Errors
/// A message when the queue is full.
pub(crate) async fn admit(
    sh: &Arc<ServerState>,
    priority: u8,
    first_deadline_us: Option<u64>,
    bytes: u64,
) -> Result<Slot, String> {
    let rx = {
        let mut a = sh.admission.lock().expect("admission lock");
        if a.active < sh.cfg.max_concurrent_loads && a.queue.is_empty() {
            a.active += 1;
            sh.metrics.active_loads.inc();
            return Ok(Slot { sh: sh.clone() });
        }
        if a.queue.len() >= sh.cfg.max_queued_loads {
            return Err(format!(
                "{} loads active and {} waiting (max_concurrent_loads {}, max_queued_loads {}); retry or fall back to S3",
                a.active,
                a.queue.len(),
                sh.cfg.max_concurrent_loads,
                sh.cfg.max_queued_loads
            ));
        }
        let id = sh.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        a.queue.push(sched::Ticket {
            id,
            seq: id,
            priority,
            first_deadline_us,
            bytes,
        });
        a.waiting.insert(id, tx);
        sh.metrics.queued_loads.inc();
        rx
    };
    rx.await.map_err(|_| "server is shutting down".to_string())
}

/// How long a read of an object through the server's S3 API keeps its entry from collection
/// (a soft lease, renewed by every read): a ranged-GET load reads an object layer by layer, so
/// its reads are spread over the load; 30 s is the longest a load is expected to take.
pub const S3_READ_LEASE: Duration = Duration::from_secs(30);

/// A running server.
pub struct ServerHandle {
    addr: SocketAddr,
    shared: Arc<ServerState>,
    join: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ServerHandle {
    /// The bound address (S3 and gather).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
    /// `http://ADDR`, the S3 endpoint URL.
    pub fn endpoint(&self) -> String {
        let scheme = if self.shared.cfg.tls_cert.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }
    /// The store behind the server.
    pub fn store(&self) -> Arc<dyn Store> {
        self.shared.store.clone()
    }
    /// RDMA writes completed for gather requests with an RDMA target since start, or `None`
    /// when this server offers no RDMA target (feature `rdma` without a device, or
    /// `OBJECTCACHE_RDMA=off`).
    #[cfg(feature = "rdma")]
    pub fn rdma_writes(&self) -> Option<u64> {
        self.shared.rdma.as_ref().map(|r| r.writes())
    }
    /// RDMA gather sessions open now (each one client's queue pairs and staging arena), or
    /// `None` when this server offers no RDMA target. A session closes when its client says
    /// goodbye or its control connection ends (a client process that exits closes it).
    #[cfg(feature = "rdma")]
    pub fn rdma_sessions(&self) -> Option<usize> {
        self.shared.rdma.as_ref().map(|r| r.len())
    }
    /// Runs one collection pass over the server's store (`objectcache_client::lifecycle::collect`: GC of
    /// interrupted saves and orphan markers, TTL, capacity eviction by least recent use),
    /// with the server's leases: an entry a gather load in flight reads, or one read through
    /// the S3 API within the last [`S3_READ_LEASE`], is never deleted. Lookups (marker
    /// `HEAD`s) neither pin nor count as use. Format v2 markers unchanged since the server's
    /// last pass are not read again (`objectcache_client::lifecycle::MarkerMemo`). Entries of one chunk's tensor-parallel ranks go
    /// together.
    ///
    /// # Errors
    /// As `objectcache_client::lifecycle::collect`.
    pub async fn gc(
        &self,
        policy: &objectcache_client::lifecycle::Policy,
    ) -> Result<objectcache_client::lifecycle::GcReport, objectcache_client::StoreError> {
        objectcache_client::lifecycle::collect_with(
            &*self.shared.store,
            policy,
            std::time::SystemTime::now(),
            Some(&self.shared.access),
            Some(&self.shared.leases),
            &self.shared.gc_memo,
        )
        .await
    }
    /// Entries leased now (held by gather loads in flight, or read recently through the S3
    /// API), by entry id (`objectcache_client::lifecycle::classify_key`).
    pub fn leased(&self, key_or_id: &str) -> bool {
        self.shared.leases.is_leased(key_or_id)
    }
    /// The metrics registry.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.shared.metrics.clone()
    }
    /// Starts a graceful shutdown without waiting for it.
    pub fn trigger_shutdown(&self) {
        self.shared.shutdown.cancel();
    }
    /// Stops accepting, lets loads in flight finish (up to `shutdown_grace_secs`, then aborts
    /// them), and waits for every connection to close.
    pub async fn shutdown(self) {
        self.shared.shutdown.cancel();
        let _ = self.join.await;
    }
    /// Waits until the server stops (after a shutdown was triggered, e.g. by a signal).
    pub async fn wait(self) {
        let _ = self.join.await;
    }
}

/// The progress a client owes while the server waits on it ([`conn::RateFloor`]).
pub(crate) fn client_floor(cfg: &ServerConfig) -> conn::RateFloor {
    conn::RateFloor::new(
        Duration::from_secs(cfg.client_timeout_secs),
        cfg.min_client_bytes_per_s,
    )
}
