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
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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

// ---------------------------------------------------------------- HTTP mode

struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    fn new(s: TcpStream) -> Self {
        Conn { s, buf: Vec::new() }
    }
    async fn fill(&mut self) -> std::io::Result<usize> {
        let mut tmp = [0u8; 64 << 10];
        let n = self.s.read(&mut tmp).await?;
        self.buf.extend_from_slice(&tmp[..n]);
        Ok(n)
    }
    /// Reads up to and including the blank line; `None` on clean EOF before any byte.
    async fn head(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        loop {
            if let Some(p) = find(&self.buf, b"\r\n\r\n") {
                let h: Vec<u8> = self.buf.drain(..p + 4).collect();
                return Ok(Some(h));
            }
            if self.buf.len() > MAX_HEAD {
                return Err(std::io::Error::other("head too large"));
            }
            if self.fill().await? == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }
    async fn exact(&mut self, n: usize) -> std::io::Result<Vec<u8>> {
        while self.buf.len() < n {
            if self.fill().await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(self.buf.drain(..n).collect())
    }
    async fn line(&mut self) -> std::io::Result<Vec<u8>> {
        loop {
            if let Some(p) = find(&self.buf, b"\r\n") {
                return Ok(self.buf.drain(..p + 2).collect());
            }
            if self.buf.len() > MAX_HEAD || self.fill().await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }
    /// Reads a chunked body; returns (raw encoded bytes, decoded body).
    async fn chunked(&mut self) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
        let mut raw = Vec::new();
        let mut body = Vec::new();
        loop {
            let l = self.line().await?;
            raw.extend_from_slice(&l);
            let s = String::from_utf8_lossy(&l);
            let hexlen = s.trim().split(';').next().unwrap_or("").trim().to_string();
            let n = usize::from_str_radix(&hexlen, 16)
                .map_err(|_| std::io::Error::other(format!("bad chunk size {hexlen:?}")))?;
            if n == 0 {
                // Trailers until the blank line.
                loop {
                    let t = self.line().await?;
                    raw.extend_from_slice(&t);
                    if t == b"\r\n" {
                        return Ok((raw, body));
                    }
                }
            }
            let d = self.exact(n + 2).await?;
            raw.extend_from_slice(&d);
            body.extend_from_slice(&d[..n]);
        }
    }
    async fn read_to_eof(&mut self) -> std::io::Result<Vec<u8>> {
        while self.fill().await? > 0 {}
        Ok(std::mem::take(&mut self.buf))
    }
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

struct Head {
    first: String,
    headers: Vec<(String, String)>,
}

impl Head {
    fn parse(b: &[u8]) -> std::io::Result<Head> {
        let s = std::str::from_utf8(b).map_err(|_| std::io::Error::other("non-UTF-8 head"))?;
        let mut lines = s.split("\r\n");
        let first = lines.next().unwrap_or("").to_string();
        let headers = lines
            .filter(|l| !l.is_empty())
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                Some((k.trim().to_string(), v.trim().to_string()))
            })
            .collect();
        Ok(Head { first, headers })
    }
    fn get(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map(|(_, v)| v.as_str())
    }
    fn without(&self, drop: &[&str]) -> Vec<u8> {
        self.without_prefixes(drop, &[])
    }
    /// The head without the headers named in `drop` or starting with a lower-case prefix
    /// in `prefixes`.
    fn without_prefixes(&self, drop: &[&str], prefixes: &[&str]) -> Vec<u8> {
        let mut out = format!("{}\r\n", self.first);
        for (k, v) in &self.headers {
            let lk = k.to_ascii_lowercase();
            if !drop.iter().any(|d| k.eq_ignore_ascii_case(d))
                && !prefixes.iter().any(|p| lk.starts_with(p))
            {
                out.push_str(&format!("{k}: {v}\r\n"));
            }
        }
        out.into_bytes()
    }
}

fn at(frac: At, len: usize) -> usize {
    ((len as f64 * frac.clamp(0.0, 1.0)) as usize).min(len)
}

async fn reset(s: TcpStream) {
    let _ = s.set_zero_linger();
    drop(s);
}

async fn http_conn(inn: Arc<Inner>, sock: TcpStream, conn: u64) -> std::io::Result<()> {
    let mut cl = Conn::new(sock);
    let mut up: Option<Conn> = None;
    loop {
        let Some(hb) = cl.head().await? else {
            return Ok(());
        };
        let h = Head::parse(&hb)?;
        let mut parts = h.first.split(' ');
        let method = parts.next().unwrap_or("").to_string();
        let target = parts.next().unwrap_or("").to_string();
        let expect = h
            .get("expect")
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        if expect {
            cl.s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await?;
        }
        // Request body, raw (forwarded as it came).
        let body_raw = if h
            .get("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
        {
            cl.chunked().await?.0
        } else {
            let n: usize = h
                .get("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            cl.exact(n).await?
        };
        let seq = inn.seq.fetch_add(1, Ordering::SeqCst);
        let mut rec = Request {
            conn,
            seq,
            method: method.clone(),
            target: target.clone(),
            range: h.get("range").map(str::to_string),
            headers: h
                .headers
                .iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
                .collect(),
            fault: String::new(),
            status: 0,
        };
        let rule = inn.http_rule.lock().unwrap().clone();
        let fault = rule.map(|r| r(&rec)).unwrap_or(Fault::Pass);
        rec.fault = fault.name();
        match fault {
            Fault::Status(code, s3code) => {
                rec.status = code;
                inn.log.lock().unwrap().push(rec);
                let xml = format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{s3code}</Code>\
                     <Message>injected by fault proxy</Message><RequestId>fault-{seq}</RequestId></Error>"
                );
                let body = if method == "HEAD" { "" } else { xml.as_str() };
                let resp = format!(
                    "HTTP/1.1 {code} {s3code}\r\nContent-Type: application/xml\r\n\
                     Content-Length: {}\r\nx-amz-request-id: fault-{seq}\r\n\r\n{body}",
                    body.len()
                );
                cl.s.write_all(resp.as_bytes()).await?;
                continue;
            }
            Fault::ResetNow => {
                inn.log.lock().unwrap().push(rec);
                reset(cl.s).await;
                return Ok(());
            }
            _ => {}
        }
        // Held while the proxy is on hold.
        let _ = inn.open.subscribe().wait_for(|open| *open).await;
        // Forward the request.
        if up.is_none() {
            let s = TcpStream::connect(inn.upstream).await?;
            let _ = s.set_nodelay(true);
            up = Some(Conn::new(s));
        }
        let u = up.as_mut().unwrap();
        let (strip_req, strip_resp): (&[&str], &[&str]) = match &fault {
            Fault::Strip { request, response } => (request, response),
            _ => (&[], &[]),
        };
        let mut req = h.without_prefixes(&["expect"], strip_req);
        req.extend_from_slice(b"\r\n");
        req.extend_from_slice(&body_raw);
        u.s.write_all(&req).await?;
        // Response (skipping any interim 1xx from upstream).
        let (rh, rhb) = loop {
            let Some(rhb) = u.head().await? else {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            };
            let rh = Head::parse(&rhb)?;
            if !rh
                .first
                .split(' ')
                .nth(1)
                .is_some_and(|c| c.starts_with('1'))
            {
                break (rh, rhb);
            }
        };
        let status: u16 = rh
            .first
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        rec.status = status;
        let no_body = method == "HEAD" || status == 204 || status == 304;
        let chunked = rh
            .get("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let mut upstream_closed = false;
        let body = if no_body {
            Vec::new()
        } else if chunked {
            u.chunked().await?.1
        } else if let Some(n) = rh.get("content-length").and_then(|v| v.parse().ok()) {
            u.exact(n).await?
        } else {
            upstream_closed = true;
            u.read_to_eof().await?
        };
        if upstream_closed
            || rh
                .get("connection")
                .is_some_and(|v| v.eq_ignore_ascii_case("close"))
        {
            up = None;
        }
        inn.log.lock().unwrap().push(rec);
        // Re-frame the response with a Content-Length (bodies are buffered).
        let mut head = if no_body {
            rh.without_prefixes(&[], strip_resp)
        } else {
            let mut x = rh.without_prefixes(&["transfer-encoding", "content-length"], strip_resp);
            x.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
            x
        };
        let _ = rhb;
        head.extend_from_slice(b"\r\n");
        let (head, body) = match fault {
            Fault::ReplaceStatus(from, to) if status == from => (
                format!(
                    "HTTP/1.1 {to} Replaced\r\nContent-Length: 0\r\nx-amz-request-id: fault-{}\r\n\r\n",
                    inn.seq.load(Ordering::SeqCst)
                )
                .into_bytes(),
                Vec::new(),
            ),
            _ => (head, body),
        };
        let n = body.len();
        match fault {
            Fault::Pass
            | Fault::Status(..)
            | Fault::ResetNow
            | Fault::Strip { .. }
            | Fault::ReplaceStatus(..) => {
                cl.s.write_all(&head).await?;
                cl.s.write_all(&body).await?;
            }
            Fault::Flip(a) => {
                let mut b = body;
                if n > 0 {
                    let i = at(a, n).min(n - 1);
                    b[i] ^= 0xff;
                }
                cl.s.write_all(&head).await?;
                cl.s.write_all(&b).await?;
            }
            Fault::Truncate(a) => {
                cl.s.write_all(&head).await?;
                cl.s.write_all(&body[..at(a, n)]).await?;
                cl.s.flush().await?;
                let _ = cl.s.shutdown().await;
                return Ok(());
            }
            Fault::ResetMidBody(a) => {
                cl.s.write_all(&head).await?;
                cl.s.write_all(&body[..at(a, n)]).await?;
                cl.s.flush().await?;
                // Let the bytes leave before the RST (an RST discards unsent data).
                tokio::time::sleep(Duration::from_millis(20)).await;
                reset(cl.s).await;
                return Ok(());
            }
            Fault::Stall(a) => {
                cl.s.write_all(&head).await?;
                cl.s.write_all(&body[..at(a, n)]).await?;
                cl.s.flush().await?;
                inn.stalls.lock().unwrap().push(std::time::Instant::now());
                tokio::time::sleep(STALL_FOR).await;
                return Ok(());
            }
            Fault::Drip { bytes, every } => {
                cl.s.write_all(&head).await?;
                for piece in body.chunks(bytes.max(1)) {
                    cl.s.write_all(piece).await?;
                    cl.s.flush().await?;
                    tokio::time::sleep(every).await;
                }
            }
        }
    }
}

// ---------------------------------------------------------------- raw mode

/// Records bytes forwarded on raw connection `conn` (found by number: the log may have been
/// cleared while the connection lives on, e.g. a pooled or stalled one).
fn raw_sent(inn: &Inner, conn: u64, sent: u64) {
    if let Some(e) = inn.raw_log.lock().unwrap().iter_mut().find(|e| e.0 == conn) {
        e.2 = sent;
    }
}

async fn raw_conn(inn: Arc<Inner>, client: TcpStream, conn: u64) -> std::io::Result<()> {
    let upstream = TcpStream::connect(inn.upstream).await?;
    let _ = upstream.set_nodelay(true);
    let rule = inn.raw_rule.lock().unwrap().clone();
    let fault = rule.map(|r| r(conn)).unwrap_or(RawFault::Pass);
    inn.raw_log.lock().unwrap().push((conn, fault.clone(), 0));
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    // Client to server: plain copy.
    let c2s = tokio::spawn(async move {
        // Owns the client's read half: aborting this task drops it.
        let _ = tokio::io::copy(&mut cr, &mut uw).await;
        let _ = uw.shutdown().await;
    });
    let mut sent: u64 = 0;
    let mut buf = vec![0u8; 64 << 10];
    let result: std::io::Result<()> = async {
        loop {
            let n = ur.read(&mut buf).await?;
            if n == 0 {
                let _ = cw.shutdown().await;
                return Ok(());
            }
            let mut piece = buf[..n].to_vec();
            let end = sent + n as u64;
            match &fault {
                RawFault::Pass => cw.write_all(&piece).await?,
                RawFault::FlipAt(o) | RawFault::XorAt(o, _) => {
                    let mask = match &fault {
                        RawFault::XorAt(_, m) => *m,
                        _ => 0xff,
                    };
                    if (sent..end).contains(o) {
                        piece[(o - sent) as usize] ^= mask;
                    }
                    cw.write_all(&piece).await?;
                }
                RawFault::ResetAfter(o) | RawFault::CloseAfter(o) | RawFault::StallAfter(o) => {
                    if end > *o {
                        let k = (o - sent.min(*o)) as usize;
                        cw.write_all(&piece[..k]).await?;
                        cw.flush().await?;
                        sent += k as u64;
                        raw_sent(&inn, conn, sent);
                        match fault {
                            RawFault::ResetAfter(_) => {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                // Zero linger, no FIN: closing the socket sends an RST.
                                let _ = cw.as_ref().set_zero_linger();
                                cw.forget();
                                c2s.abort();
                                return Ok(());
                            }
                            RawFault::CloseAfter(_) => {
                                let _ = cw.shutdown().await;
                                return Ok(());
                            }
                            _ => {
                                inn.stalls.lock().unwrap().push(std::time::Instant::now());
                                tokio::time::sleep(STALL_FOR).await;
                                return Ok(());
                            }
                        }
                    }
                    cw.write_all(&piece).await?;
                }
                RawFault::Drip { bytes, every } => {
                    for p in piece.chunks((*bytes).max(1)) {
                        cw.write_all(p).await?;
                        cw.flush().await?;
                        tokio::time::sleep(*every).await;
                    }
                }
            }
            sent = end;
            raw_sent(&inn, conn, sent);
        }
    }
    .await;
    c2s.abort();
    result
}
