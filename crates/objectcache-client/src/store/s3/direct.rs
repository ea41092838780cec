//! Ranged GETs whose body goes straight into the caller's memory
//! ([`Store::get_range_body`](crate::store::Store::get_range_body)), for plain-`http://`
//! endpoints.
//!
//! The SDK's HTTP client hands a body over in buffers of its own, which a load then copies
//! into the engine's KV destination: one more pass over every byte than a socket read into
//! place (the gather path's way). Here the SDK still builds each request, with no network:
//! it presigns the ranged GET ([`aws_sdk_s3::presigning`]), so credentials, region,
//! addressing and SigV4 stay the SDK's. The request line and headers go out on a keep-alive
//! TCP connection of our own; `httparse` reads the response head; the body is then read from
//! the socket into whatever buffer the caller passes ([`RangeBody::read`]).
//!
//! Only a plain answer takes this path: `206 Partial Content` with a `Content-Length` and a
//! `Content-Range` for exactly the range asked, and no transfer coding. Anything else (an
//! error status, a whole-object `200`, a chunked body, a failure before the head arrived)
//! closes the connection and the GET is sent again through the SDK with one attempt fewer
//! than `max_attempts` (the direct try was the first), which retries and maps errors in one
//! place (`errors.rs`); its body is then the SDK's stream. A server that refuses presigned
//! requests (400, 403, 405 or 501) turns the path off for the store.

use super::{S3Store, BACKEND};
use crate::error::StoreResult;
use crate::store::{GetOptions, ObjectMeta, RangeBody, RangeRead};
use async_trait::async_trait;
use aws_sdk_s3::presigning::PresigningConfig;
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bytes of a connection's read buffer: reads of at least this many go straight into the
/// caller's buffer; smaller ones (a CRC trailer, a header) are served from one read of up to
/// this many.
const BUF_BYTES: usize = 64 << 10;
/// Longest response head accepted.
const MAX_HEAD_BYTES: usize = 16 << 10;
/// How long a presigned request stays valid: it is sent at once, so this only needs to cover
/// the clock skew between client and server.
const PRESIGN_VALID: Duration = Duration::from_secs(900);

/// The direct path of one [`S3Store`]: where to connect, and the idle connections.
#[derive(Debug)]
pub(super) struct Direct {
    /// Fixed DNS answers ([`super::S3Config::resolve`]).
    resolve: Vec<(String, IpAddr)>,
    connect_timeout: Duration,
    read_timeout: Duration,
    max_idle: usize,
    /// How long a connection stays reusable once idle ([`super::S3Config::idle_timeout`]).
    idle_timeout: Duration,
    /// Idle connections, each with the time it became idle.
    idle: Mutex<Vec<(TcpStream, std::time::Instant)>>,
    /// Cleared when the server refused a presigned request: the store reads through the SDK.
    on: AtomicBool,
}

impl Direct {
    /// The direct path for a store at `endpoint`: `None` unless it is plain `http://`,
    /// [`super::S3Config::read_into_place`] is on, and a GET may be tried at least twice
    /// (`max_attempts`; the direct try is the first).
    pub(super) fn new(endpoint: Option<&str>, config: &super::S3Config) -> Option<Arc<Direct>> {
        let u = url::Url::parse(endpoint?).ok()?;
        if !config.read_into_place || config.max_attempts < 2 {
            return None;
        }
        (u.scheme() == "http").then(|| {
            Arc::new(Direct {
                resolve: config.resolve.clone(),
                connect_timeout: config.connect_timeout,
                read_timeout: config.read_timeout,
                max_idle: config.max_idle_connections,
                idle_timeout: config.idle_timeout,
                idle: Mutex::new(Vec::new()),
                on: AtomicBool::new(true),
            })
        })
    }

    async fn connect(&self, host: &str, port: u16) -> std::io::Result<TcpStream> {
        let fixed = super::resolver::fixed_answer(&self.resolve, host);
        let connect = async {
            let s = match fixed {
                Some(ip) => TcpStream::connect(SocketAddr::new(ip, port)).await?,
                None => TcpStream::connect((host, port)).await?,
            };
            s.set_nodelay(true)?;
            Ok(s)
        };
        tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))?
    }

    fn put_back(&self, s: TcpStream) {
        let mut idle = self.idle.lock().expect("lock");
        if idle.len() < self.max_idle {
            idle.push((s, std::time::Instant::now()));
        }
    }

    /// The most recently idled connection that has been idle less than the idle timeout;
    /// older ones are closed.
    fn take_idle(&self) -> Option<TcpStream> {
        let mut idle = self.idle.lock().expect("lock");
        idle.retain(|(_, since)| since.elapsed() < self.idle_timeout);
        idle.pop().map(|(s, _)| s)
    }
}

/// Why a direct read was not used: logged at debug level, then the SDK reads.
struct Decline(String);

impl S3Store {
    /// [`crate::store::Store::get_range_body`] for this store: see the module's doc. A GET
    /// the direct path sent but could not use is sent again through the SDK with as many
    /// attempts fewer as the direct path sent it (once, or twice when a pooled connection
    /// failed before any answer; at least one attempt is left), so that
    /// [`super::S3Config::max_attempts`] bounds the tries of a GET as on every other request,
    /// and its stream is the body; `Ok(None)` when the direct path
    /// is off or sent nothing (the caller reads through the SDK).
    ///
    /// # Errors
    /// The SDK's error for the GET sent again (`errors.rs`'s mapping).
    pub(super) async fn direct_range_body(
        &self,
        key: &str,
        range: Range<u64>,
    ) -> StoreResult<Option<RangeBody>> {
        let Some(direct) = self.direct.as_ref() else {
            return Ok(None);
        };
        if range.start >= range.end || !direct.on.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let (host, port, head) = match self.presign_get(key, &range).await {
            Ok(p) => p,
            Err(Decline(why)) => {
                tracing::debug!(endpoint = %self.endpoint, key, why, "ranged GET through the SDK");
                return Ok(None);
            }
        };
        let mut sent = 0;
        match self
            .direct_get(direct, key, range.clone(), (&host, port, &head), &mut sent)
            .await
        {
            Ok(b) => Ok(Some(b)),
            Err(Decline(why)) => {
                tracing::debug!(endpoint = %self.endpoint, key, why, sent, "ranged GET again through the SDK");
                // The sends the direct path made count against the GET's attempts (a pooled
                // connection reset before any answer is sent again once: two sends).
                let attempts = self.retry.max_attempts().saturating_sub(sent).max(1);
                let opts = GetOptions { range: Some(range) };
                let res = self.get_attempts(key, opts, Some(attempts)).await?;
                Ok(Some(RangeBody::from_stream(
                    res,
                    BACKEND,
                    direct.read_timeout,
                )))
            }
        }
    }

    /// Sends the presigned request (host, port, request head) and, for a plain `206` answer,
    /// returns its body; `sent` is set to the times the request was written (1, or 2 when a
    /// pooled connection failed before any answer).
    async fn direct_get(
        &self,
        direct: &Arc<Direct>,
        key: &str,
        range: Range<u64>,
        (host, port, head): (&str, u16, &str),
        sent: &mut u32,
    ) -> Result<RangeBody, Decline> {
        // A pooled connection the server has since closed fails before any answer: once, the
        // request is sent again on a new connection (a GET is idempotent).
        let pooled = direct.take_idle();
        *sent = 1;
        let (conn, answer) = match pooled {
            Some(mut s) => match exchange(&mut s, head.as_bytes(), direct.read_timeout).await {
                Ok(Some(a)) => (s, a),
                Ok(None) => {
                    *sent = 2;
                    fresh(direct, host, port, head).await?
                }
                Err(e) => return Err(Decline(e)),
            },
            None => fresh(direct, host, port, head).await?,
        };
        let Answer {
            status,
            content_length,
            content_range,
            etag,
            chunked,
            close,
            buf,
            filled,
        } = answer;
        if matches!(status, 400 | 403 | 405 | 501) {
            // Refused (signature, method or range not accepted this way): the SDK reads, for
            // good, so every read does not cost a refused request first.
            if direct.on.swap(false, Ordering::Relaxed) {
                tracing::warn!(endpoint = %self.endpoint, status, "the S3 server refused a presigned ranged GET; reading through the SDK from now on");
            }
            return Err(Decline(format!("status {status}")));
        }
        let want = range.end - range.start;
        let size = content_range
            .and_then(|(a, b, size)| (a == range.start && b == range.end).then_some(size));
        let (206, Some(size), Some(len), false) = (status, size, content_length, chunked) else {
            return Err(Decline(format!(
                "status {status}, content-range {content_range:?}, content-length {content_length:?}, chunked {chunked}"
            )));
        };
        if len != want {
            return Err(Decline(format!(
                "content-length {len} for a range of {want}"
            )));
        }
        let meta = ObjectMeta {
            key: key.to_string(),
            size,
            last_modified: None,
            etag,
        };
        let body = DirectBody {
            conn: Some(conn),
            buf,
            pos: 0,
            filled,
            left: len,
            keep: !close,
            direct: direct.clone(),
        };
        Ok(RangeBody::new(
            meta,
            range,
            Box::new(body),
            BACKEND,
            direct.read_timeout,
        ))
    }
}

impl S3Store {
    /// A ranged GET of `key` presigned by the SDK: the host and port to send it to, and its
    /// request line and headers, ready to write.
    async fn presign_get(
        &self,
        key: &str,
        range: &Range<u64>,
    ) -> Result<(String, u16, String), Decline> {
        let presign = PresigningConfig::expires_in(PRESIGN_VALID)
            .map_err(|e| Decline(format!("presigning config: {e}")))?;
        let req = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(self.full_key(key))
            .range(format!("bytes={}-{}", range.start, range.end - 1))
            .presigned(presign)
            .await
            .map_err(|e| Decline(format!("presigning: {}", super::errors::causes(&e))))?;
        request_head(&req)
    }

    /// Opens up to `connections` connections for the direct path ahead of its first reads
    /// ([`crate::store::S3Store::warm`]), idle in its pool; returns how many. Each carries one
    /// presigned `HEAD` of a key that need not exist (any answer will do, and a `HEAD` answer
    /// has no body), so that the server counts it as a client's connection, kept alive.
    pub(super) async fn warm_direct(&self, connections: usize) -> usize {
        let Some(direct) = &self.direct else {
            return 0;
        };
        let want = connections
            .min(direct.max_idle)
            .saturating_sub(direct.idle.lock().expect("lock").len());
        if want == 0 {
            return 0;
        }
        let head = async {
            let presign = PresigningConfig::expires_in(PRESIGN_VALID).ok()?;
            let key = self.full_key("_objectcache/warm");
            let head_object = self.client.head_object().bucket(&self.bucket).key(key);
            request_head(&head_object.presigned(presign).await.ok()?).ok()
        };
        let Some((host, port, head)) = head.await else {
            return 0;
        };
        let one = |_| async {
            let mut s = direct.connect(&host, port).await.ok()?;
            match exchange(&mut s, head.as_bytes(), direct.read_timeout).await {
                Ok(Some(a)) if !a.close => Some(s),
                _ => None,
            }
        };
        let opened = futures::future::join_all((0..want).map(one)).await;
        let mut n = 0;
        for s in opened.into_iter().flatten() {
            direct.put_back(s);
            n += 1;
        }
        n
    }
}

/// A presigned request's host and port, and its request line and headers, ready to write.
fn request_head(
    req: &aws_sdk_s3::presigning::PresignedRequest,
) -> Result<(String, u16, String), Decline> {
    let uri = url::Url::parse(req.uri()).map_err(|e| Decline(format!("presigned URI: {e}")))?;
    let (Some(host), Some(port)) = (uri.host_str(), uri.port_or_known_default()) else {
        return Err(Decline(format!("presigned URI {uri} names no host")));
    };
    let mut head = format!("{} {}", req.method(), &uri[url::Position::BeforePath..]);
    head.push_str(" HTTP/1.1\r\n");
    if !req.headers().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        let authority = &uri[url::Position::BeforeHost..url::Position::AfterPort];
        head.push_str(&format!("host: {authority}\r\n"));
    }
    for (k, v) in req.headers() {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    Ok((host.to_string(), port, head))
}

/// Sends `head` on a new connection and reads the answer's head.
async fn fresh(
    direct: &Direct,
    host: &str,
    port: u16,
    head: &str,
) -> Result<(TcpStream, Answer), Decline> {
    let mut s = direct
        .connect(host, port)
        .await
        .map_err(|e| Decline(format!("connect to {host}:{port}: {e}")))?;
    match exchange(&mut s, head.as_bytes(), direct.read_timeout).await {
        Ok(Some(a)) => Ok((s, a)),
        Ok(None) => Err(Decline("connection closed before the answer".into())),
        Err(e) => Err(Decline(e)),
    }
}

/// The head of an answer, and the body bytes that came with it.
struct Answer {
    status: u16,
    content_length: Option<u64>,
    /// `Content-Range: bytes a-b/size` as (`a`, `b + 1`, `size`).
    content_range: Option<(u64, u64, u64)>,
    etag: Option<String>,
    chunked: bool,
    close: bool,
    /// A buffer of [`BUF_BYTES`] whose first `filled` bytes are the body's first.
    buf: Vec<u8>,
    filled: usize,
}

/// Writes `head` and reads the answer's head (within `timeout`): `Ok(None)` when the
/// connection closed before any byte of an answer (a stale pooled connection).
async fn exchange(
    s: &mut TcpStream,
    head: &[u8],
    timeout: Duration,
) -> Result<Option<Answer>, String> {
    let io = async {
        if s.write_all(head).await.is_err() {
            return Ok(None);
        }
        let mut buf = vec![0u8; BUF_BYTES];
        let mut filled = 0;
        loop {
            let n = match s.read(&mut buf[filled..MAX_HEAD_BYTES]).await {
                Ok(n) => n,
                Err(_) if filled == 0 => return Ok(None),
                Err(e) => return Err(format!("reading the answer: {e}")),
            };
            if n == 0 {
                return if filled == 0 {
                    Ok(None)
                } else {
                    Err("connection closed inside the answer's head".to_string())
                };
            }
            filled += n;
            let mut headers = [httparse::EMPTY_HEADER; 48];
            let mut resp = httparse::Response::new(&mut headers);
            match resp.parse(&buf[..filled]) {
                Ok(httparse::Status::Complete(at)) => {
                    let mut a = answer(&resp)?;
                    buf.copy_within(at..filled, 0);
                    a.filled = filled - at;
                    a.buf = buf;
                    return Ok(Some(a));
                }
                Ok(httparse::Status::Partial) if filled < MAX_HEAD_BYTES => {}
                Ok(httparse::Status::Partial) => {
                    return Err(format!("answer head longer than {MAX_HEAD_BYTES} bytes"))
                }
                Err(e) => return Err(format!("answer head: {e}")),
            }
        }
    };
    tokio::time::timeout(timeout, io)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}

fn answer(resp: &httparse::Response<'_, '_>) -> Result<Answer, String> {
    let status = resp.code.ok_or("answer without a status")?;
    let mut a = Answer {
        status,
        content_length: None,
        content_range: None,
        etag: None,
        chunked: false,
        close: resp.version == Some(0),
        buf: Vec::new(),
        filled: 0,
    };
    for h in resp.headers.iter() {
        let v =
            std::str::from_utf8(h.value).map_err(|_| format!("header {} is not text", h.name))?;
        let v = v.trim();
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            let n = v.parse().map_err(|_| format!("content-length {v:?}"))?;
            if a.content_length.replace(n).is_some_and(|m| m != n) {
                return Err("two content-length values".into());
            }
        } else if name.eq_ignore_ascii_case("content-range") {
            a.content_range = parse_content_range(v);
        } else if name.eq_ignore_ascii_case("etag") {
            a.etag = Some(v.to_string());
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            a.chunked = true;
        } else if name.eq_ignore_ascii_case("connection") {
            a.close |= v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close"));
        }
    }
    Ok(a)
}

/// `bytes a-b/size` as (`a`, `b + 1`, `size`): a body read into place needs the size.
fn parse_content_range(v: &str) -> Option<(u64, u64, u64)> {
    let (a, b, size) = super::body::parse_content_range(v)?;
    Some((a, b, size?))
}

/// The body of a direct ranged GET: the bytes read with the head, then the connection's,
/// never past the body's `Content-Length`. A body read to its end returns its connection to
/// the pool (unless the server said `Connection: close`); one dropped earlier closes it.
struct DirectBody {
    conn: Option<TcpStream>,
    /// [`BUF_BYTES`] of buffer: bytes `pos..filled` are body bytes read but not handed out.
    buf: Vec<u8>,
    pos: usize,
    filled: usize,
    /// Body bytes not yet handed out (in `buf` or still in the connection).
    left: u64,
    keep: bool,
    direct: Arc<Direct>,
}

#[async_trait]
impl RangeRead for DirectBody {
    async fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let want = (out.len() as u64).min(self.left) as usize;
        if want == 0 {
            return Ok(0);
        }
        let n = if self.pos < self.filled {
            let n = want.min(self.filled - self.pos);
            out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
            self.pos += n;
            n
        } else {
            let Some(conn) = self.conn.as_mut() else {
                return Ok(0);
            };
            if want >= BUF_BYTES {
                conn.read(&mut out[..want]).await?
            } else {
                // A small read (a CRC trailer): one read of up to the buffer, never past the
                // body, so the next answer on this connection stays in the socket.
                let cap = self.left.min(self.buf.len() as u64) as usize;
                let got = conn.read(&mut self.buf[..cap]).await?;
                let n = want.min(got);
                out[..n].copy_from_slice(&self.buf[..n]);
                (self.pos, self.filled) = (n, got);
                n
            }
        };
        self.left -= n as u64;
        if self.left == 0 && self.keep {
            if let Some(c) = self.conn.take() {
                self.direct.put_back(c);
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::parse_content_range;

    #[test]
    fn content_range_is_read_or_refused() {
        assert_eq!(parse_content_range("bytes 0-99/1000"), Some((0, 100, 1000)));
        assert_eq!(parse_content_range("bytes 5-5/6"), Some((5, 6, 6)));
        for bad in [
            "bytes 9-3/10",
            "bytes */10",
            "items 0-1/2",
            "bytes 0-1/*",
            "bytes 0-1",
        ] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
    }
}
