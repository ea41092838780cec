//! The ObjectCache server: S3-compatible storage plus the one-request layer-ordered gather.
//!
//! One listening port serves both: a connection that opens with the gather preface
//! ([`crate::protocol::PREFACE`]) is a gather connection (`gather.rs`); anything else is
//! HTTP/1.1, where `/_objectcache/health`, `/_objectcache/metrics` and
//! `/_objectcache/capabilities` are answered here and every other request goes to the S3 API
//! ([`s3::S3Frontend`] through `s3s`, SigV4 with the configured keys, path-style addressing).
//! Bucket names cannot start with `_`, so these paths never shadow a bucket.
//!
//! Start one with [`start`] (opening the configured store) or [`start_with_store`]; stop it
//! with [`ServerHandle::shutdown`], which stops accepting, lets loads in flight finish for
//! `shutdown_grace_secs`, then aborts them with a `ShuttingDown` error frame.
//!
//! Built with feature `server` (on by default).
#![cfg(feature = "server")]

mod budget;
pub mod config;
mod conn;
mod gather;
#[cfg(feature = "rdma")]
mod gather_rdma;
mod group;
pub mod metrics;
mod reads;
pub mod s3;
pub mod sched;
pub mod tenant;
pub mod tls;

pub use config::{AccessKey, ServerConfig};

use crate::protocol::{ServerInfo, ServerLimits, PROTOCOL_VERSION};
use crate::store::{FsStore, FsyncPolicy, MemoryStore, Store};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use metrics::Metrics;
use s3::{Buckets, S3Frontend};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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
pub(crate) struct Shared {
    pub(crate) cfg: ServerConfig,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) buckets: Arc<Buckets>,
    pub(crate) metrics: Arc<Metrics>,
    /// Memory budget in [`gather::PERMIT_BYTES`] permits.
    pub(crate) memory: Arc<Semaphore>,
    /// The same budget, for holders other than a load's read-ahead ([`budget`]).
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
    pub(crate) leases: Arc<crate::lifecycle::LeaseTable>,
    /// Last use of each entry (gather loads and S3 reads; not lookups), for LRU eviction.
    pub(crate) access: Arc<crate::lifecycle::AccessLog>,
    /// RDMA gather sessions (feature `rdma`, when a device exists).
    #[cfg(feature = "rdma")]
    pub(crate) rdma: Option<Arc<crate::transport::rdma::SessionRegistry>>,
    /// The link scheduler pacing gather loads under `bandwidth_cap_bytes_per_s` (none when
    /// uncapped).
    pub(crate) link: Option<Arc<crate::link::Link>>,
}

impl Shared {
    pub(crate) fn limits(&self) -> ServerLimits {
        ServerLimits {
            max_descriptor_bytes: self.cfg.max_descriptor_bytes,
            max_chunks: self.cfg.max_chunks,
            max_request_bytes: self.cfg.max_request_bytes,
            features: ServerInfo::FEATURE_GATHER_TCP
                | ServerInfo::FEATURE_SAVE
                | ServerInfo::FEATURE_LOAD_GROUPS
                | ServerInfo::FEATURE_HELD
                | self.rdma_feature(),
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
    sh: Arc<Shared>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let sh = self.sh.clone();
        let mut a = sh.admission.lock().expect("admission lock");
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
    sh: &Arc<Shared>,
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
    shared: Arc<Shared>,
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
    /// Runs one collection pass over the server's store (`crate::lifecycle::collect`: GC of
    /// interrupted saves and orphan markers, TTL, capacity eviction by least recent use),
    /// with the server's leases: an entry a gather load in flight reads, or one read through
    /// the S3 API within the last [`S3_READ_LEASE`], is never deleted. Lookups (marker
    /// `HEAD`s) neither pin nor count as use. Entries of one chunk's tensor-parallel ranks go
    /// together.
    ///
    /// # Errors
    /// As `crate::lifecycle::collect`.
    pub async fn gc(
        &self,
        policy: &crate::lifecycle::Policy,
    ) -> Result<crate::lifecycle::GcReport, crate::StoreError> {
        crate::lifecycle::collect(
            &*self.shared.store,
            policy,
            std::time::SystemTime::now(),
            Some(&self.shared.access),
            Some(&self.shared.leases),
        )
        .await
    }
    /// Entries leased now (held by gather loads in flight, or read recently through the S3
    /// API), by entry id (`crate::lifecycle::classify_key`).
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

/// Opens the store named by `cfg.store`: `memory:`/`memory://`, `file://PATH` or a path
/// (with `cfg.fsync`), or any URL [`crate::store::open_store`] accepts, e.g.
/// `s3://BUCKET/PREFIX?endpoint=URL` for gateway mode (credentials from `AWS_ACCESS_KEY_ID`
/// and `AWS_SECRET_ACCESS_KEY` or a profile).
///
/// # Errors
/// The store's error, naming the URL.
pub async fn open_backend(cfg: &ServerConfig) -> crate::Result<Arc<dyn Store>> {
    let url = cfg.store.trim();
    if url == "memory:" {
        return Ok(Arc::new(MemoryStore::new()));
    }
    let fsync = if cfg.fsync {
        FsyncPolicy::Always
    } else {
        FsyncPolicy::Never
    };
    if let Some(p) = url.strip_prefix("file://") {
        return Ok(Arc::new(FsStore::new(p, fsync)?));
    }
    if !url.contains("://") && !url.is_empty() {
        return Ok(Arc::new(FsStore::new(url, fsync)?));
    }
    Ok(crate::store::open_store(url).await?)
}

/// Opens the configured store and starts the server.
///
/// # Errors
/// As [`open_backend`] and [`start_with_store`].
pub async fn start(cfg: ServerConfig) -> crate::Result<ServerHandle> {
    let store = open_backend(&cfg).await?;
    start_with_store(cfg, store).await
}

/// Starts a server over `store`: validates `cfg`, creates `cfg.buckets`, binds `cfg.listen`
/// (port 0 picks a free port; see [`ServerHandle::local_addr`]) and serves until shut down.
///
/// # Errors
/// [`crate::Error::Config`] for inconsistent settings; [`crate::Error::Io`] if the address
/// cannot be bound; a store error while loading buckets.
pub async fn start_with_store(
    cfg: ServerConfig,
    store: Arc<dyn Store>,
) -> crate::Result<ServerHandle> {
    cfg.validate()?;
    reclaim_orphaned_writes(store.as_ref()).await;
    let buckets = Arc::new(Buckets::load(store.clone()).await?);
    for b in &cfg.buckets {
        buckets.create(b).await?;
    }
    let metrics = Arc::new(Metrics::new());
    let listener = TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    let queue = sched::admission(crate::sched::SchedulerSetting::parse(&cfg.scheduler)?);
    let link = shared_link(&cfg)?;
    let memory = Arc::new(Semaphore::new(
        gather::permits_for(cfg.memory_budget_bytes) as usize
    ));
    // Each connection is a descriptor: stay well below the open-file limit.
    let nofile = conn::raise_nofile_limit().unwrap_or(u64::MAX);
    let max_conns = cfg
        .max_connections
        .min((nofile / 2).min(usize::MAX as u64) as usize)
        .max(1);
    if max_conns < cfg.max_connections {
        tracing::warn!(
            max_connections = cfg.max_connections,
            open_file_limit = nofile,
            capped = max_conns,
            "max_connections capped at half the open-file limit"
        );
    }
    let leases = crate::lifecycle::LeaseTable::new();
    let access = Arc::new(crate::lifecycle::AccessLog::new());
    let shared = Arc::new(Shared {
        link,
        budget: budget::Budget::new(memory.clone(), metrics.clone()),
        conns: conn::ConnLimits::new(max_conns, cfg.max_connections_per_ip, metrics.clone()),
        memory,
        admission: Mutex::new(Admission {
            active: 0,
            queue,
            waiting: HashMap::new(),
        }),
        next_id: AtomicU64::new(1),
        loads: group::Loads::default(),
        reads: reads::Reads::default(),
        leases: leases.clone(),
        access: access.clone(),
        shutdown: CancellationToken::new(),
        buckets: buckets.clone(),
        metrics: metrics.clone(),
        store: store.clone(),
        cfg,
        #[cfg(feature = "rdma")]
        rdma: gather_rdma::open(),
    });
    let tenants = tenant::Tenants::new(&shared.cfg.tenants).map_err(crate::Error::Config)?;
    let tls = match (&shared.cfg.tls_cert, &shared.cfg.tls_key) {
        (Some(c), Some(k)) => Some(tls::acceptor(c, k)?),
        _ => None,
    };
    let mut builder = s3s::service::S3ServiceBuilder::new(
        S3Frontend::new(
            // Reads of the S3 API record their entry's use and renew its soft lease; a
            // lookup's HEAD does neither (lookups never pin).
            Arc::new(crate::lifecycle::TrackedStore::new(
                store.clone(),
                access,
                leases,
                S3_READ_LEASE,
            )),
            buckets,
            shared.cfg.max_object_bytes,
            metrics,
        )
        .with_tenants(Arc::new(tenants))
        .with_budget(
            shared.budget.clone(),
            Duration::from_secs(shared.cfg.client_timeout_secs),
        ),
    );
    // XML request bodies (DeleteObjects, tagging, ...) are read whole by s3s: keep them
    // small (each is also counted in the memory budget as it arrives).
    let mut s3cfg = s3s::config::S3Config::default();
    s3cfg.xml_max_body_size = 1 << 20;
    s3cfg.form_max_fields_size = 1 << 20;
    s3cfg.post_object_max_file_size = shared.cfg.max_object_bytes;
    builder.set_config(Arc::new(s3s::config::StaticConfigProvider::new(Arc::new(
        s3cfg,
    ))));
    if !shared.cfg.access_keys.is_empty() || !shared.cfg.tenants.is_empty() {
        let mut auth = s3s::auth::SimpleAuth::new();
        for k in &shared.cfg.access_keys {
            auth.register(k.access_key.clone(), k.secret_key.clone().into());
        }
        for t in &shared.cfg.tenants {
            auth.register(t.access_key.clone(), t.secret_key.clone().into());
        }
        builder.set_auth(auth);
    }
    let s3 = builder.build();
    tracing::info!(%addr, store = store.name(), scheduler = %shared.cfg.scheduler, "objectcache server listening");
    let sh = shared.clone();
    let join = tokio::spawn(async move { accept_loop(listener, sh, s3, tls).await });
    Ok(ServerHandle { addr, shared, join })
}

/// Deletes the incomplete writes whose writer is gone ([`Store::list_partial`]: temporary
/// files of a killed process), so a restart gives their space back; younger ones of live
/// writers are left to them, and `objectcache gc` reclaims whatever outlives its grace.
async fn reclaim_orphaned_writes(store: &dyn Store) {
    let found = match store.list_partial("").await {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "could not list incomplete writes");
            return;
        }
    };
    let (mut n, mut bytes) = (0u64, 0u64);
    for p in found.iter().filter(|p| p.orphaned) {
        match store.delete_partial(p).await {
            Ok(()) => {
                n += 1;
                bytes += p.size;
            }
            Err(e) => {
                tracing::warn!(partial = %p.id, error = %e, "could not reclaim an incomplete write")
            }
        }
    }
    if n > 0 {
        tracing::info!(
            files = n,
            bytes,
            "reclaimed incomplete writes of processes that are gone"
        );
    }
}

/// The link scheduler of `cfg`: `None` when uncapped.
fn shared_link(cfg: &ServerConfig) -> crate::Result<Option<Arc<crate::link::Link>>> {
    if cfg.bandwidth_cap_bytes_per_s == 0 {
        return Ok(None);
    }
    let kind = crate::sched::SchedulerSetting::parse(&cfg.scheduler)?.policy;
    Ok(Some(crate::link::Link::new(
        kind,
        cfg.bandwidth_cap_bytes_per_s as f64,
    )?))
}

async fn accept_loop(
    listener: TcpListener,
    sh: Arc<Shared>,
    s3: s3s::service::S3Service,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let tracker = TaskTracker::new();
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = sh.shutdown.cancelled() => break,
        };
        // Past a cap the connection is closed before anything is read from it.
        let guard = match sh.conns.admit(peer.ip()) {
            Ok(g) => g,
            Err(cap) => {
                tracing::debug!(%peer, cap, "connection refused: too many open");
                drop(stream);
                continue;
            }
        };
        let sh2 = sh.clone();
        let s3 = s3.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        // Sniffing happens in the connection's own task: an idle connection (a client's
        // pooled spare) never holds up the accept loop.
        tracker.spawn(async move {
            let _guard = guard;
            let deadline =
                tokio::time::Instant::now() + Duration::from_secs(sh2.cfg.handshake_timeout_secs);
            if let Some(acc) = tls {
                // TLS: the S3 API only (gather is not offered over TLS yet, see tls.rs).
                let stream = tokio::select! {
                    s = tls::accept(&acc, stream) => s,
                    _ = sh2.shutdown.cancelled() => None,
                };
                if let Some(stream) = stream {
                    let _ = stream.get_ref().0.set_nodelay(true);
                    let io = conn::Prefixed::new(&[], stream, client_floor(&sh2.cfg));
                    serve_http(io, sh2, s3, watcher, peer).await;
                }
                return;
            }
            let mut stream = stream;
            let sniffed = tokio::select! {
                s = conn::sniff(&mut stream, deadline, rdma_offered(&sh2)) => s,
                _ = sh2.shutdown.cancelled() => None,
            };
            let Some(first) = sniffed else {
                // Closed, or no protocol told in time: nothing was held but 8 bytes.
                sh2.metrics.error("handshake");
                return;
            };
            match first.protocol {
                // Gather loads are not confined to a tenant's namespace: with tenants it
                // is refused (connectors fall back to ranged GETs).
                conn::Protocol::Gather if !sh2.cfg.tenants.is_empty() => {
                    tenant::refuse_gather(stream).await
                }
                conn::Protocol::Gather => gather::serve(stream, sh2, first.head(), deadline).await,
                #[cfg(feature = "rdma")]
                conn::Protocol::Rdma if sh2.rdma.is_some() => {
                    let reg = sh2.rdma.clone().expect("checked");
                    gather_rdma::serve_control(stream, reg).await;
                }
                conn::Protocol::Rdma | conn::Protocol::Http => {
                    let _ = stream.set_nodelay(true);
                    let io = conn::Prefixed::new(first.head(), stream, client_floor(&sh2.cfg));
                    serve_http(io, sh2, s3, watcher, peer).await;
                }
            }
        });
    }
    drop(listener);
    #[cfg(feature = "rdma")]
    if let Some(r) = &sh.rdma {
        r.shutdown();
    }
    tracker.close();
    let grace = Duration::from_secs(sh.cfg.shutdown_grace_secs + 1);
    let _ = tokio::time::timeout(grace, graceful.shutdown()).await;
    let _ = tokio::time::timeout(grace, tracker.wait()).await;
    tracing::info!("objectcache server stopped");
}

/// Whether RDMA set-up channels are offered on this server's port.
fn rdma_offered(_sh: &Shared) -> bool {
    #[cfg(feature = "rdma")]
    if _sh.rdma.is_some() {
        return true;
    }
    false
}

/// The progress a client owes while the server waits on it ([`conn::RateFloor`]).
pub(crate) fn client_floor(cfg: &ServerConfig) -> conn::RateFloor {
    conn::RateFloor::new(
        Duration::from_secs(cfg.client_timeout_secs),
        cfg.min_client_bytes_per_s,
    )
}

/// Bytes of a connection's HTTP read buffer at most (request heads, body pieces): part of
/// the fixed per-connection memory outside the budget.
const HTTP_BUF_BYTES: usize = 64 << 10;

/// Serves HTTP/1.1 on one connection: request heads must arrive within
/// `client_timeout_secs` (idle keep-alive connections close after it too), responses the
/// client does not read fast enough end the connection ([`conn::Prefixed`]), request bodies
/// are metered ([`s3::metered_body`]).
async fn serve_http<I>(
    io: I,
    sh: Arc<Shared>,
    s3: s3s::service::S3Service,
    watcher: hyper_util::server::graceful::Watcher,
    peer: SocketAddr,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let sh3 = sh.clone();
    let svc = service_fn(move |req| http_route(req, sh3.clone(), s3.clone()));
    let mut b = hyper::server::conn::http1::Builder::new();
    b.keep_alive(true)
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(sh.cfg.client_timeout_secs))
        .max_buf_size(HTTP_BUF_BYTES);
    let conn = b.serve_connection(TokioIo::new(io), svc);
    if let Err(e) = watcher.watch(conn).await {
        tracing::debug!(%peer, error = %e, "http connection ended");
    }
}

type HttpResp = hyper::Response<s3s::Body>;

async fn http_route(
    req: hyper::Request<hyper::body::Incoming>,
    sh: Arc<Shared>,
    s3: s3s::service::S3Service,
) -> Result<HttpResp, std::convert::Infallible> {
    let path = req.uri().path();
    let text = |status: u16, ct: &str, body: String| {
        hyper::Response::builder()
            .status(status)
            .header("content-type", ct)
            .body(s3s::Body::from(body))
            .expect("valid response")
    };
    if req.method() == hyper::Method::GET && path.starts_with("/_objectcache/") {
        return Ok(match path {
            "/_objectcache/health" => {
                if sh.shutdown.is_cancelled() {
                    text(503, "text/plain", "shutting down\n".into())
                } else {
                    text(200, "text/plain", "ok\n".into())
                }
            }
            "/_objectcache/metrics" => text(
                200,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                sh.metrics.encode(),
            ),
            "/_objectcache/capabilities" => {
                let l = sh.limits();
                let body = serde_json::json!({
                    "service": "objectcache",
                    "version": env!("CARGO_PKG_VERSION"),
                    "gather": {
                        "protocol_versions": [PROTOCOL_VERSION],
                        "transports": if l.features & ServerInfo::FEATURE_RDMA != 0 { vec!["tcp", "rdma"] } else { vec!["tcp"] },
                        "same_port": true,
                        "batched_save": true,
                        // Striped loads are admitted and paced as one (descriptor flag bit 2).
                        "load_groups": true,
                        // Held frames while a load waits on purpose (descriptor flag bit 3).
                        "held_frames": true,
                        "max_descriptor_bytes": l.max_descriptor_bytes,
                        "max_chunks": l.max_chunks,
                        "max_request_bytes": l.max_request_bytes,
                        "max_unit_bytes": crate::protocol::MAX_UNIT_BYTES,
                        // Access keys configured: connections answer an HMAC-SHA256 challenge.
                        "authentication": if sh.cfg.access_keys.is_empty() { "none" } else { "hmac-sha256" },
                    }
                });
                text(200, "application/json", body.to_string())
            }
            _ => text(404, "text/plain", "unknown objectcache endpoint\n".into()),
        });
    }
    if let Some(r) = presigned_expiry_refusal(req.uri()) {
        return Ok(r);
    }
    // Request bodies are metered (memory budget, progress, per-request bound); why one was
    // cut off travels in the request's extensions to the handler.
    let (mut parts, body) = req.into_parts();
    let (body, fault) = s3::MeteredBody::new(
        body,
        s3::BodyLimits {
            budget: sh.budget.clone(),
            wait: Duration::from_secs(sh.cfg.client_timeout_secs),
            floor: client_floor(&sh.cfg),
            max_request_bytes: sh.cfg.max_request_bytes,
        },
    );
    parts.extensions.insert(fault);
    let req = hyper::Request::from_parts(parts, s3s::Body::http_body_unsync(body));
    match s3.call(req).await {
        Ok(r) => Ok(r),
        Err(e) => {
            sh.metrics.error("http");
            tracing::warn!(error = ?e, "S3 request failed inside the HTTP layer");
            Ok(s3_error_response(
                500,
                "InternalError",
                "internal error (logged by the server)",
            ))
        }
    }
}

/// Longest validity of a presigned URL, seconds: 7 days, as AWS S3 allows.
pub const MAX_PRESIGNED_EXPIRES_SECS: u64 = 7 * 24 * 3600;

/// AWS S3's answer to a presigned URL whose `X-Amz-Expires` is above 7 days (or not a
/// number): `400 AuthorizationQueryParametersError`, before the signature is looked at.
fn presigned_expiry_refusal(uri: &hyper::Uri) -> Option<HttpResp> {
    let q = uri.query()?;
    let v = q.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        k.eq_ignore_ascii_case("X-Amz-Expires").then_some(v)
    })?;
    match v.parse::<u64>() {
        Ok(s) if s <= MAX_PRESIGNED_EXPIRES_SECS => None,
        _ => Some(s3_error_response(
            400,
            "AuthorizationQueryParametersError",
            "X-Amz-Expires must be less than a week (in seconds) that is 604800",
        )),
    }
}

/// An S3 error document (`<Error><Code>..</Code><Message>..</Message></Error>`).
fn s3_error_response(status: u16, code: &str, message: &str) -> HttpResp {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    );
    hyper::Response::builder()
        .status(status)
        .header("content-type", "application/xml")
        .body(s3s::Body::from(body))
        .expect("valid response")
}
