//! [`GatewayStore`]: one store over several S3 endpoints that serve the same objects:
//! ObjectCache gateways in front of one object store, or the RGWs of one Ceph cluster.
//!
//! - **Endpoints**: a list (`endpoint=http://a:9000,http://b:9000`), or one host name whose
//!   every address is an endpoint (`resolve=all`: each address keeps the name for the `Host`
//!   header and TLS, like curl's `--resolve`). Every endpoint is one [`S3Store`].
//! - **Placement**: each request, and each gather load (through [`Gateways::route`]),
//!   tries the endpoints in the order of a [`Placement`] policy for its route key (the
//!   object key; a load's first chunk hash), see [`crate::sched::placement`].
//! - **Failover**: an endpoint that cannot be reached (connection refused or reset, a
//!   timeout, HTTP 5xx such as a gateway shutting down) is marked down and the request goes
//!   to the next endpoint; answers that would be the same everywhere (not found, already
//!   exists, access denied, a bad range) are returned at once. Each endpoint gets one attempt
//!   per round; at most `max_attempts` rounds, with backoff between rounds.
//! - **Health checks**: every `health_interval`, `GET /_objectcache/health` on every endpoint
//!   (any HTTP answer below 500 counts as up: a stock S3 server answers with an S3 error).
//!   A down endpoint that answers is used again from then on. The same round reads
//!   `/_objectcache/metrics` (loads active and queued) for load-aware placement.
#![forbid(unsafe_code)]

use super::{
    EndpointEvent, Gateways, GatherTarget, GetOptions, GetResult, ObjectMeta, PutOptions,
    PutResult, RangeBody, S3Config, S3Store, Store,
};
use crate::error::{StoreError, StoreResult};
use crate::sched::placement::{self, Candidate, Placement};
use async_trait::async_trait;
use bytes::Bytes;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

const BACKEND: &str = "gateways";

/// Settings of a [`GatewayStore`] beyond those of each endpoint's [`S3Config`].
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayOptions {
    /// How requests and loads are spread (store URL `placement`). Default `two-choice`.
    pub placement: Placement,
    /// Time between health checks of every endpoint (store URL `health_interval_ms`).
    /// Default 1 s.
    pub health_interval: Duration,
}

impl Default for GatewayOptions {
    fn default() -> Self {
        GatewayOptions {
            placement: Placement::default(),
            health_interval: Duration::from_secs(1),
        }
    }
}

/// Counters of one endpoint ([`GatewayStore::endpoints`]).
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointStatus {
    /// The endpoint URL.
    pub endpoint: String,
    /// `host:port` connections go to.
    pub addr: String,
    /// Whether it is believed to answer.
    pub up: bool,
    /// Requests and gather loads of this client in flight on it.
    pub in_flight: u32,
    /// Loads active plus queued at its last health check (0 for servers without metrics).
    pub reported_loads: u32,
    /// Times it was marked down (a failed request, connection or health check).
    pub marked_down: u64,
    /// Times a health check found it up again after it was down.
    pub recovered: u64,
    /// Requests sent to it by this store (each attempt counts).
    pub requests: u64,
}

#[derive(Debug)]
struct Member {
    endpoint: String,
    addr: String,
    seed: u64,
    store: S3Store,
    up: AtomicBool,
    in_flight: AtomicU32,
    reported: AtomicU32,
    marked_down: AtomicU64,
    recovered: AtomicU64,
    requests: AtomicU64,
}

impl Member {
    fn mark_down(&self, why: &dyn std::fmt::Display) {
        if self.up.swap(false, Ordering::AcqRel) {
            self.marked_down.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(endpoint = %self.endpoint, %why, "endpoint marked down");
        }
    }
    fn mark_up(&self) {
        if !self.up.swap(true, Ordering::AcqRel) {
            self.recovered.fetch_add(1, Ordering::Relaxed);
            tracing::info!(endpoint = %self.endpoint, "endpoint answers again");
        }
    }
}

#[derive(Debug)]
struct Inner {
    members: Vec<Member>,
    opts: GatewayOptions,
    rounds: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    health: std::sync::Mutex<Option<tokio::task::AbortHandle>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(h) = self.health.lock().map(|mut g| g.take()).ok().flatten() {
            h.abort();
        }
    }
}

/// A store over several endpoints serving the same bucket (module documentation).
#[derive(Debug, Clone)]
pub struct GatewayStore {
    inner: Arc<Inner>,
}

/// Whether an error says "this endpoint did not serve the request" (try another), rather
/// than an answer about the object that every endpoint would give.
fn is_unreachable(e: &StoreError) -> bool {
    matches!(e, StoreError::Timeout { .. } | StoreError::Other { .. })
}

/// `host:port` of an endpoint URL.
fn host_port(endpoint: &str) -> StoreResult<(String, u16)> {
    let u = url::Url::parse(endpoint).map_err(|e| {
        StoreError::other(BACKEND, format!("endpoint {endpoint:?} is not a URL: {e}"))
    })?;
    let host = u
        .host_str()
        .ok_or_else(|| StoreError::other(BACKEND, format!("endpoint {endpoint:?} has no host")))?;
    let port = u
        .port_or_known_default()
        .ok_or_else(|| StoreError::other(BACKEND, format!("endpoint {endpoint:?} has no port")))?;
    Ok((
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
        port,
    ))
}

impl GatewayStore {
    /// Opens one [`S3Store`] per endpoint (each `base` with its own `endpoint`) and starts the
    /// health checks on the current tokio runtime. Sends no request.
    ///
    /// # Errors
    /// `StoreError::Other` for no endpoint, a repeated endpoint, or an endpoint's own
    /// configuration error (as [`S3Store::new`]).
    pub async fn new(
        base: S3Config,
        endpoints: Vec<String>,
        opts: GatewayOptions,
    ) -> StoreResult<Self> {
        let mut members = Vec::with_capacity(endpoints.len());
        for e in &endpoints {
            let mut c = base.clone();
            c.endpoint = Some(e.clone());
            members.push((e.clone(), c, None));
        }
        Self::build(base, members, opts).await
    }

    /// Resolves the host name of `endpoint` and opens one [`S3Store`] per address it
    /// resolves to (each keeps the name for `Host` and TLS, connecting to its own address).
    ///
    /// # Errors
    /// `StoreError::Other` if the name does not resolve; as [`GatewayStore::new`].
    pub async fn resolve_all(
        base: S3Config,
        endpoint: String,
        opts: GatewayOptions,
    ) -> StoreResult<Self> {
        let (host, port) = host_port(&endpoint)?;
        let mut ips: Vec<IpAddr> = tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|e| {
                StoreError::other(
                    BACKEND,
                    format!("endpoint {endpoint:?}: cannot resolve {host:?}: {e}"),
                )
            })?
            .map(|a| a.ip())
            .collect();
        ips.sort_unstable();
        ips.dedup();
        if ips.is_empty() {
            return Err(StoreError::other(
                BACKEND,
                format!("endpoint {endpoint:?}: {host:?} resolves to no address"),
            ));
        }
        let members = ips
            .into_iter()
            .map(|ip| {
                let mut c = base.clone();
                c.endpoint = Some(endpoint.clone());
                c.resolve.push((host.clone(), ip));
                let name = match ip {
                    IpAddr::V4(v) => format!("{v}:{port}"),
                    IpAddr::V6(v) => format!("[{v}]:{port}"),
                };
                (format!("{endpoint} ({name})"), c, Some(name))
            })
            .collect();
        Self::build(base, members, opts).await
    }

    async fn build(
        base: S3Config,
        specs: Vec<(String, S3Config, Option<String>)>,
        opts: GatewayOptions,
    ) -> StoreResult<Self> {
        if specs.is_empty() {
            return Err(StoreError::other(BACKEND, "no endpoint given"));
        }
        if opts.health_interval.is_zero() {
            return Err(StoreError::other(
                BACKEND,
                "health_interval must be above 0",
            ));
        }
        let mut members: Vec<Member> = Vec::with_capacity(specs.len());
        for (name, mut c, addr) in specs {
            if members.iter().any(|m| m.endpoint == name) {
                return Err(StoreError::other(
                    BACKEND,
                    format!("endpoint {name} given twice"),
                ));
            }
            let addr = match addr {
                Some(a) => a,
                None => {
                    let (h, p) = host_port(c.endpoint.as_deref().unwrap_or_default())?;
                    if h.contains(':') {
                        format!("[{h}]:{p}")
                    } else {
                        format!("{h}:{p}")
                    }
                }
            };
            // One attempt per endpoint per round: a refused connection moves on at once.
            c.max_attempts = 1;
            members.push(Member {
                seed: placement::endpoint_seed(&name),
                endpoint: name,
                addr,
                store: S3Store::new(c).await?,
                up: AtomicBool::new(true),
                in_flight: AtomicU32::new(0),
                reported: AtomicU32::new(0),
                marked_down: AtomicU64::new(0),
                recovered: AtomicU64::new(0),
                requests: AtomicU64::new(0),
            });
        }
        let inner = Arc::new(Inner {
            members,
            opts,
            rounds: base.max_attempts.max(1),
            initial_backoff: base.initial_backoff,
            max_backoff: base.max_backoff,
            health: std::sync::Mutex::new(None),
        });
        let task = tokio::spawn(health_loop(Arc::downgrade(&inner)));
        *inner.health.lock().expect("lock") = Some(task.abort_handle());
        Ok(GatewayStore { inner })
    }

    /// The placement policy.
    pub fn placement(&self) -> Placement {
        self.inner.opts.placement
    }

    /// Every endpoint's state and counters, in the order given.
    pub fn endpoints(&self) -> Vec<EndpointStatus> {
        self.inner
            .members
            .iter()
            .map(|m| EndpointStatus {
                endpoint: m.endpoint.clone(),
                addr: m.addr.clone(),
                up: m.up.load(Ordering::Acquire),
                in_flight: m.in_flight.load(Ordering::Relaxed),
                reported_loads: m.reported.load(Ordering::Relaxed),
                marked_down: m.marked_down.load(Ordering::Relaxed),
                recovered: m.recovered.load(Ordering::Relaxed),
                requests: m.requests.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Member indices in the order to try them for `route`.
    fn order(&self, route: u64) -> Vec<usize> {
        let c: Vec<Candidate> = self
            .inner
            .members
            .iter()
            .map(|m| Candidate {
                seed: m.seed,
                up: m.up.load(Ordering::Acquire),
                load: (m.reported.load(Ordering::Relaxed) + m.in_flight.load(Ordering::Relaxed))
                    as f64,
            })
            .collect();
        placement::order(self.inner.opts.placement, route, &c)
    }

    /// Runs `op` on the endpoints in placement order for `key` until one serves it.
    async fn run<T, F, Fut>(&self, key: &str, op: F) -> StoreResult<T>
    where
        F: Fn(S3Store) -> Fut,
        Fut: std::future::Future<Output = StoreResult<T>>,
    {
        let route = placement::route_key(key.as_bytes());
        let mut last = None;
        let mut backoff = self.inner.initial_backoff;
        for round in 0..self.inner.rounds {
            if round > 0 {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(self.inner.max_backoff);
            }
            for i in self.order(route) {
                let m = &self.inner.members[i];
                m.requests.fetch_add(1, Ordering::Relaxed);
                m.in_flight.fetch_add(1, Ordering::Relaxed);
                let r = op(m.store.clone()).await;
                m.in_flight.fetch_sub(1, Ordering::Relaxed);
                match r {
                    Err(e) if is_unreachable(&e) => {
                        m.mark_down(&e);
                        last = Some(e);
                    }
                    r => return r,
                }
            }
        }
        Err(last.unwrap_or_else(|| StoreError::other(BACKEND, "no endpoint")))
    }

    /// These endpoints as the engine's [`Gateways`]: each load's route over them, in
    /// placement order, and what its loads report marking them down or counting them.
    pub fn gateways(&self) -> Gateways {
        Gateways::many(self.clone())
    }

    /// The first endpoint's gather target; loads use [`GatewayStore::gather_route`].
    pub(super) fn first_target(&self) -> Option<GatherTarget> {
        self.inner.members.first()?.store.gather_target()
    }

    /// The gather targets of the endpoints, in placement order for route key `route`.
    pub(super) fn gather_route(&self, route: u64) -> Vec<GatherTarget> {
        self.order(route)
            .into_iter()
            .filter_map(|i| {
                let m = &self.inner.members[i];
                let mut t = m.store.gather_target()?;
                // With `resolve=all` every member names the same host: connect by address.
                t.addr = m.addr.clone();
                Some(t)
            })
            .collect()
    }

    /// What a load saw of the endpoint at `addr`: unreachable (marked down), a load started
    /// or ended on it (counted for load-aware placement).
    pub(super) fn endpoint_event(&self, addr: &str, event: EndpointEvent) {
        let Some(m) = self.member(addr) else { return };
        match event {
            EndpointEvent::Unreachable => m.mark_down(&"a gather connection failed"),
            EndpointEvent::LoadStarted => {
                m.in_flight.fetch_add(1, Ordering::Relaxed);
            }
            EndpointEvent::LoadEnded => {
                let _ = m
                    .in_flight
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            }
        }
    }

    fn member(&self, addr: &str) -> Option<&Member> {
        self.inner.members.iter().find(|m| m.addr == addr)
    }
}

/// Health checks every interval while the store lives.
async fn health_loop(inner: Weak<Inner>) {
    let mut tick = {
        let Some(i) = inner.upgrade() else { return };
        tokio::time::interval(i.opts.health_interval)
    };
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(i) = inner.upgrade() else { return };
        let timeout = i.opts.health_interval.min(Duration::from_secs(2));
        let checks = i.members.iter().map(|m| check(m, timeout));
        futures::future::join_all(checks).await;
    }
}

/// One health check of one endpoint: health, then (if up) the load figures.
async fn check(m: &Member, timeout: Duration) {
    match http_get(&m.addr, "/_objectcache/health", timeout).await {
        Ok((status, _)) if status < 500 => m.mark_up(),
        Ok((status, _)) => m.mark_down(&format!("health check: HTTP {status}")),
        Err(e) => m.mark_down(&format!("health check: {e}")),
    }
    if m.up.load(Ordering::Acquire) {
        if let Ok((200, body)) = http_get(&m.addr, "/_objectcache/metrics", timeout).await {
            m.reported.store(reported_loads(&body), Ordering::Relaxed);
        }
    }
}

/// Loads active plus queued, from a server's Prometheus metrics.
fn reported_loads(body: &[u8]) -> u32 {
    let text = String::from_utf8_lossy(body);
    let mut n = 0.0;
    for line in text.lines() {
        for name in [
            "objectcache_server_active_loads",
            "objectcache_server_queued_loads",
        ] {
            if let Some(v) = line.strip_prefix(name).and_then(|r| r.strip_prefix(' ')) {
                n += v.trim().parse::<f64>().unwrap_or(0.0);
            }
        }
    }
    n.clamp(0.0, u32::MAX as f64) as u32
}

/// A plain-HTTP GET of `path` at `addr` within `timeout`: status and body (at most 1 MiB).
async fn http_get(addr: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, Bytes)> {
    use http_body_util::{BodyExt, Empty, Limited};
    let io = |e: &dyn std::fmt::Display| std::io::Error::other(e.to_string());
    let fetch = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| io(&e))?;
        let driver = tokio::spawn(conn);
        let req = hyper::Request::get(path)
            .header(hyper::header::HOST, addr)
            .header(hyper::header::CONNECTION, "close")
            .body(Empty::<Bytes>::new())
            .map_err(|e| io(&e))?;
        let out = async {
            let resp = sender.send_request(req).await.map_err(|e| io(&e))?;
            let status = resp.status().as_u16();
            let body = Limited::new(resp.into_body(), 1 << 20)
                .collect()
                .await
                .map_err(|e| io(&e))?
                .to_bytes();
            Ok((status, body))
        }
        .await;
        driver.abort();
        out
    };
    tokio::time::timeout(timeout, fetch).await.map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer within {timeout:?}"),
        )
    })?
}

#[async_trait]
impl Store for GatewayStore {
    fn name(&self) -> &'static str {
        BACKEND
    }

    async fn get_range_body(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
    ) -> StoreResult<Option<RangeBody>> {
        self.run(key, |s| {
            let range = range.clone();
            async move { s.get_range_body(key, range).await }
        })
        .await
    }

    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
        self.run(key, |s| {
            let opts = opts.clone();
            async move { s.get_opts(key, opts).await }
        })
        .await
    }

    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult> {
        // A create-only put that reached an endpoint which then failed may have been written:
        // its retry elsewhere finds the object (AlreadyExists), which the caller reads as
        // "present" (first writer wins), never as a torn object: S3 puts are atomic.
        self.run(key, |s| {
            let data = data.clone();
            async move { s.put_opts(key, data, opts).await }
        })
        .await
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        self.run(key, |s| async move { s.head(key).await }).await
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.run(key, |s| async move { s.delete(key).await }).await
    }

    async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>> {
        self.run(prefix, |s| async move { s.list(prefix, limit).await })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_give_active_plus_queued_loads() {
        let body = b"# HELP objectcache_server_active_loads Loads being served.\n\
# TYPE objectcache_server_active_loads gauge\n\
objectcache_server_active_loads 3\n\
objectcache_server_queued_loads 2\n\
objectcache_server_active_loads_other 100\n";
        assert_eq!(reported_loads(body), 5);
        assert_eq!(reported_loads(b"<Error/>"), 0);
    }
}
