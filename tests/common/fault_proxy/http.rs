//! HTTP mode of the fault proxy: HTTP/1.1 requests and responses parsed (Content-Length and
//! chunked bodies, HEAD, `Expect: 100-continue`), each request's fault applied.

use super::{At, Fault, Inner, Request, MAX_HEAD, STALL_FOR};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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

pub(super) async fn http_conn(inn: Arc<Inner>, sock: TcpStream, conn: u64) -> std::io::Result<()> {
    let mut cl = Conn::new(sock);
    let mut up: Option<Conn> = None;
    loop {
        let idle = *inn.idle_close.lock().unwrap();
        let head = match idle {
            Some(after) => match tokio::time::timeout(after, cl.head()).await {
                Ok(h) => h?,
                Err(_) => return Ok(()), // idle too long: the connection closes
            },
            None => cl.head().await?,
        };
        let Some(hb) = head else {
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
