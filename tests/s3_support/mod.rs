//! Shared by the `s3_*` tests: the real S3 endpoint of the test environment, and a scripted
//! HTTP/1.1 server on a real loopback socket that answers the way a failing S3 server does.
#![allow(dead_code)]

use objectcache::store::S3Config;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Settings of the test S3 endpoint (Ceph RGW in CI), or `None` (after printing SKIP) when it
/// is not running. Panics when `OBJECTCACHE_REQUIRE_ALL` is set and it is not running.
pub async fn rgw_config(test: &str) -> Option<S3Config> {
    let c = S3Config::from_test_env();
    if c.endpoint_accepts_connections().await {
        return Some(c);
    }
    if std::env::var_os("OBJECTCACHE_REQUIRE_ALL").is_some() {
        panic!("{test}: no S3 server at {:?} but OBJECTCACHE_REQUIRE_ALL is set (start scripts/ceph-rgw/start.sh)", c.endpoint);
    }
    eprintln!("SKIP {test}: no S3 server at {:?}", c.endpoint);
    None
}

/// A request as the scripted server saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// `METHOD /path?query HTTP/1.1`
    pub line: String,
    /// Header lines, lower-cased names.
    pub headers: Vec<(String, String)>,
    /// Body length in bytes.
    pub body_len: usize,
}

/// What the scripted server does with one request.
pub enum Reply {
    /// A complete response.
    Full {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: Vec<u8>,
    },
    /// Headers announcing `declared` body bytes, then only `body`, then the connection closes.
    Cut {
        headers: Vec<(&'static str, String)>,
        declared: usize,
        body: Vec<u8>,
    },
    /// Headers announcing `declared` body bytes, then `body`, then silence for `stall`.
    Stall {
        headers: Vec<(&'static str, String)>,
        declared: usize,
        body: Vec<u8>,
        stall: Duration,
    },
}

impl Reply {
    /// An S3 XML error response.
    pub fn s3_error(status: u16, code: &str, message: &str) -> Reply {
        Reply::Full {
            status,
            headers: vec![("content-type", "application/xml".into())],
            body: format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{message}</Message><RequestId>r1</RequestId></Error>"
            )
            .into_bytes(),
        }
    }
}

type Script = dyn Fn(usize, &Seen) -> Reply + Send + Sync;

/// The scripted server: answers request number `n` (from 0) with `script(n, request)`.
pub struct ScriptedServer {
    /// `http://127.0.0.1:PORT`
    pub endpoint: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    count: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedServer {
    /// Binds 127.0.0.1 on a free port and serves in the background until dropped.
    pub async fn start(
        script: impl Fn(usize, &Seen) -> Reply + Send + Sync + 'static,
    ) -> ScriptedServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let count = Arc::new(AtomicUsize::new(0));
        let script: Arc<Script> = Arc::new(script);
        let (seen2, count2) = (seen.clone(), count.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    return;
                };
                let (seen, count, script) = (seen2.clone(), count2.clone(), script.clone());
                tokio::spawn(async move {
                    let _ = serve_one(sock, &seen, &count, &*script).await;
                });
            }
        });
        ScriptedServer {
            endpoint,
            seen,
            count,
            task,
        }
    }

    /// Requests received so far.
    pub fn requests(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// The requests received so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Store settings pointing at this server: path-style, fixed keys, `attempts` attempts
    /// with 10 to 40 ms backoff, 2 s read timeout (long enough that a test thread starved on a
    /// busy machine does not turn an immediate answer into a timeout and an extra attempt,
    /// which the tests count; short enough that the stalled-body test ends in seconds).
    pub fn config(&self, attempts: u32) -> S3Config {
        let mut c = S3Config::at_endpoint("bucket", self.endpoint.clone(), "ak", "sk");
        c.max_attempts = attempts;
        c.initial_backoff = Duration::from_millis(10);
        c.max_backoff = Duration::from_millis(40);
        c.read_timeout = Duration::from_secs(2);
        c
    }
}

async fn serve_one(
    mut sock: TcpStream,
    seen: &Mutex<Vec<Seen>>,
    count: &AtomicUsize,
    script: &Script,
) -> std::io::Result<()> {
    // One request per connection (we answer with `connection: close`).
    let mut buf = Vec::new();
    let head_end = loop {
        let mut chunk = [0u8; 4096];
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let line = lines.next().unwrap_or("").to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let want: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body_len = buf.len() - head_end;
    while body_len < want {
        let mut chunk = [0u8; 65536];
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body_len += n;
    }
    let req = Seen {
        line,
        headers,
        body_len,
    };
    let n = count.fetch_add(1, Ordering::SeqCst);
    seen.lock().unwrap().push(req.clone());
    let reply = script(n, &req);
    let write_head = |status: u16, headers: &[(&'static str, String)], len: usize| {
        let mut h = format!("HTTP/1.1 {status} X\r\ncontent-length: {len}\r\nconnection: close\r\nx-amz-request-id: r{n}\r\n");
        for (k, v) in headers {
            h.push_str(&format!("{k}: {v}\r\n"));
        }
        h.push_str("\r\n");
        h
    };
    // Every reply is a head announcing a length, then its body; a stall then holds the
    // connection open, silent.
    let (status, headers, declared, body, stall) = match reply {
        Reply::Full {
            status,
            headers,
            body,
        } => (status, headers, body.len(), body, None),
        Reply::Cut {
            headers,
            declared,
            body,
        } => (200, headers, declared, body, None),
        Reply::Stall {
            headers,
            declared,
            body,
            stall,
        } => (200, headers, declared, body, Some(stall)),
    };
    sock.write_all(write_head(status, &headers, declared).as_bytes())
        .await?;
    sock.write_all(&body).await?;
    if let Some(stall) = stall {
        sock.flush().await?;
        tokio::time::sleep(stall).await;
    }
    sock.flush().await?;
    sock.shutdown().await
}
