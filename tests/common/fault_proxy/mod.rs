//! A fault-injecting TCP proxy on loopback, for reliability tests.
//!
//! It sits between a real client and a real server and forwards bytes, except where a rule
//! says to break them. Two modes:
//!
//! - **HTTP** ([`FaultProxy::http`]): parses HTTP/1.1 requests and responses (Content-Length
//!   and chunked bodies, HEAD, `Expect: 100-continue`) and asks a rule, per request, what to
//!   do: pass, answer with an error status itself (500, 503 SlowDown) without forwarding, reset
//!   the connection, or forward and then break the response body (truncate, flip a byte, reset
//!   mid-body, stall with the connection open, drip slowly).
//! - **Raw** ([`FaultProxy::raw`]): a byte pipe (for the gather protocol); a rule per
//!   connection breaks the server-to-client stream after a byte offset.
//!
//! Every request (HTTP) or connection (raw) is logged with the fault applied, so tests can
//! count attempts (bounded retries) at the wire. The proxy runs on its own runtime thread;
//! dropping it stops everything, including stalled connections.
//!
//! The proxy and its rules are here; HTTP mode in `http.rs`, raw mode in `raw.rs`.
#![allow(dead_code)]

mod http;
mod raw;

use http::http_conn;
use raw::raw_conn;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

/// Where in a body a fault strikes: a fraction of its length (0.0 ..= 1.0).
pub type At = f64;

/// What to do with one HTTP request.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Forward unchanged.
    Pass,
    /// Answer with this status and S3 error code without forwarding (e.g. 500
    /// `InternalError`, 503 `SlowDown`).
    Status(u16, &'static str),
    /// Reset the connection (RST) instead of answering; nothing is forwarded.
    ResetNow,
    /// Forward, then send the headers and only the first part of the body, then close (FIN).
    Truncate(At),
    /// Forward, then flip every bit of one body byte.
    Flip(At),
    /// Forward, then send part of the body and reset the connection (RST).
    ResetMidBody(At),
    /// Forward, then send part of the body and stop sending, keeping the connection open.
    Stall(At),
    /// Forward, then send the body `bytes` at a time, one piece every `every`.
    Drip {
        /// Bytes per piece.
        bytes: usize,
        /// Pause between pieces.
        every: Duration,
    },
    /// Forward, and where the upstream answers with status `.0`, answer with status `.1`
    /// and an empty body instead (a server that ignores `If-None-Match: *` answers a
    /// create-only PUT of an existing key 200, not 412).
    ReplaceStatus(u16, u16),
    /// Forward without the request headers whose lower-case names start with any of these
    /// prefixes (only unsigned headers: SigV4 signs most), and answer without the response
    /// headers matching `response` the same way (a server that never returns them, e.g.
    /// `x-amz-checksum-`).
    Strip {
        /// Request header name prefixes, lower case.
        request: &'static [&'static str],
        /// Response header name prefixes, lower case.
        response: &'static [&'static str],
    },
}

impl Fault {
    /// A rule that answers every GET with `fault` and passes every other request.
    pub fn on_gets(fault: Fault) -> impl Fn(&Request) -> Fault + Send + Sync + 'static {
        move |r| {
            if r.method == "GET" {
                fault.clone()
            } else {
                Fault::Pass
            }
        }
    }

    /// A 500 InternalError.
    pub fn e500() -> Fault {
        Fault::Status(500, "InternalError")
    }
    /// A 503 SlowDown.
    pub fn slowdown() -> Fault {
        Fault::Status(503, "SlowDown")
    }
    fn name(&self) -> String {
        match self {
            Fault::Pass => "pass".into(),
            Fault::Status(s, c) => format!("{s} {c}"),
            Fault::ResetNow => "reset".into(),
            Fault::Truncate(a) => format!("truncate@{a}"),
            Fault::Flip(a) => format!("flip@{a}"),
            Fault::ResetMidBody(a) => format!("reset@{a}"),
            Fault::Stall(a) => format!("stall@{a}"),
            Fault::Drip { bytes, every } => format!("drip {bytes}B/{every:?}"),
            Fault::Strip { request, response } => format!("strip {request:?} {response:?}"),
            Fault::ReplaceStatus(a, b) => format!("status {a}->{b}"),
        }
    }
}

/// One HTTP request as seen by the proxy.
#[derive(Debug, Clone)]
pub struct Request {
    /// Client connection number (0-based, in accept order).
    pub conn: u64,
    /// Request number over the proxy's life (0-based).
    pub seq: u64,
    /// `GET`, `PUT`, `HEAD`, ...
    pub method: String,
    /// Request target (path and query).
    pub target: String,
    /// The `Range` header, if any.
    pub range: Option<String>,
    /// Every request header: lower-case name, value.
    pub headers: Vec<(String, String)>,
    /// The fault applied (`pass`, `503 SlowDown`, `truncate@0.5`, ...).
    pub fault: String,
    /// Response status forwarded or synthesised (0 if none was sent).
    pub status: u16,
}

impl Request {
    /// The path without the query string.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }
    /// The value of header `name` (lower case), if sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
    /// Whether any header's lower-case name starts with `prefix`.
    pub fn has_header_prefix(&self, prefix: &str) -> bool {
        self.headers.iter().any(|(n, _)| n.starts_with(prefix))
    }
}

/// What to do with one raw connection's server-to-client stream.
#[derive(Debug, Clone, PartialEq)]
pub enum RawFault {
    /// Forward unchanged.
    Pass,
    /// Reset (RST) after this many bytes.
    ResetAfter(u64),
    /// Close (FIN) after this many bytes.
    CloseAfter(u64),
    /// Flip every bit of the byte at this offset.
    FlipAt(u64),
    /// XOR the byte at this offset with a mask (e.g. `1`: flip its lowest bit only).
    XorAt(u64, u8),
    /// Stop forwarding after this many bytes, keeping both connections open.
    StallAfter(u64),
    /// Forward `bytes` at a time, one piece every `every`.
    Drip {
        /// Bytes per piece.
        bytes: usize,
        /// Pause between pieces.
        every: Duration,
    },
}

type HttpRule = Arc<dyn Fn(&Request) -> Fault + Send + Sync>;
type RawRule = Arc<dyn Fn(u64) -> RawFault + Send + Sync>;

struct Inner {
    upstream: SocketAddr,
    http_rule: Mutex<Option<HttpRule>>,
    /// HTTP mode: a client connection idle this long between requests is closed (a server
    /// with a short keep-alive limit); `None`: kept open.
    idle_close: Mutex<Option<Duration>>,
    raw_rule: Mutex<Option<RawRule>>,
    log: Mutex<Vec<Request>>,
    raw_log: Mutex<Vec<(u64, RawFault, u64)>>,
    conns: AtomicU64,
    seq: AtomicU64,
    /// When each stall began (HTTP `Stall`, raw `StallAfter`): the last byte was forwarded.
    stalls: Mutex<Vec<std::time::Instant>>,
    /// Whether HTTP requests are forwarded (true) or held until [`FaultProxy::release`].
    open: tokio::sync::watch::Sender<bool>,
}

/// A running proxy; dropping it closes the listener and every connection.
pub struct FaultProxy {
    addr: SocketAddr,
    inner: Arc<Inner>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// How long a stalled connection stays open at most (the proxy's drop ends it sooner).
const STALL_FOR: Duration = Duration::from_secs(3600);
/// Largest request or response head accepted.
const MAX_HEAD: usize = 64 << 10;

impl FaultProxy {
    /// Starts an HTTP-aware proxy to `upstream` with `rule` deciding each request's fault.
    pub fn http(
        upstream: SocketAddr,
        rule: impl Fn(&Request) -> Fault + Send + Sync + 'static,
    ) -> FaultProxy {
        Self::start(upstream, Some(Arc::new(rule)), None)
    }

    /// Starts a raw byte proxy to `upstream` with `rule` deciding each connection's fault
    /// (by connection number).
    pub fn raw(
        upstream: SocketAddr,
        rule: impl Fn(u64) -> RawFault + Send + Sync + 'static,
    ) -> FaultProxy {
        Self::start(upstream, None, Some(Arc::new(rule)))
    }

    fn start(upstream: SocketAddr, http: Option<HttpRule>, raw: Option<RawRule>) -> FaultProxy {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .expect("proxy runtime");
        let is_http = http.is_some();
        let inner = Arc::new(Inner {
            upstream,
            http_rule: Mutex::new(http),
            idle_close: Mutex::new(None),
            raw_rule: Mutex::new(raw),
            log: Mutex::new(Vec::new()),
            raw_log: Mutex::new(Vec::new()),
            conns: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            stalls: Mutex::new(Vec::new()),
            open: tokio::sync::watch::Sender::new(true),
        });
        let listener = rt
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let inn = inner.clone();
        rt.spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let _ = sock.set_nodelay(true);
                let conn = inn.conns.fetch_add(1, Ordering::SeqCst);
                let inn = inn.clone();
                tokio::spawn(async move {
                    if is_http {
                        let _ = http_conn(inn, sock, conn).await;
                    } else {
                        let _ = raw_conn(inn, sock, conn).await;
                    }
                });
            }
        });
        FaultProxy {
            addr,
            inner,
            rt: Some(rt),
        }
    }

    /// The proxy's listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// HTTP mode: closes client connections that stay idle `after` between requests (the
    /// keep-alive limit of a server), or never (`None`, the default).
    pub fn set_idle_close(&self, after: Option<Duration>) {
        *self.inner.idle_close.lock().unwrap() = after;
    }

    /// Holds every HTTP request from now on (after its fault is decided, before
    /// it is forwarded) until [`FaultProxy::release`]: a test lines up concurrent clients'
    /// requests behind it.
    pub fn hold(&self) {
        self.inner.open.send_replace(false);
    }

    /// Forwards the requests held by [`FaultProxy::hold`], and every later one.
    pub fn release(&self) {
        self.inner.open.send_replace(true);
    }

    /// Replaces the HTTP rule.
    pub fn set_rule(&self, rule: impl Fn(&Request) -> Fault + Send + Sync + 'static) {
        *self.inner.http_rule.lock().unwrap() = Some(Arc::new(rule));
    }

    /// Replaces the raw rule.
    pub fn set_raw_rule(&self, rule: impl Fn(u64) -> RawFault + Send + Sync + 'static) {
        *self.inner.raw_rule.lock().unwrap() = Some(Arc::new(rule));
    }

    /// Every HTTP request seen so far.
    pub fn requests(&self) -> Vec<Request> {
        self.inner.log.lock().unwrap().clone()
    }

    /// Forgets the request log.
    pub fn clear_log(&self) {
        self.inner.log.lock().unwrap().clear();
        self.inner.raw_log.lock().unwrap().clear();
    }

    /// Raw connections seen: (connection, fault, bytes forwarded server-to-client).
    pub fn raw_connections(&self) -> Vec<(u64, RawFault, u64)> {
        self.inner.raw_log.lock().unwrap().clone()
    }

    /// When each stall so far began (its last byte forwarded), in order.
    pub fn stalls(&self) -> Vec<std::time::Instant> {
        self.inner.stalls.lock().unwrap().clone()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.inner.conns.load(Ordering::SeqCst)
    }
}
