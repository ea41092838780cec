//! Tools of the hostile-client tests: SigV4 presigned URLs signed here (any expiry, so a URL
//! AWS would refuse can be made), raw sockets from chosen loopback addresses, and a sampler
//! of a server process's resident memory and open descriptors.
#![allow(dead_code)]

use hmac::{KeyInit, Mac};
use sha2::Digest;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

fn hmac(key: &[u8], msg: &str) -> Vec<u8> {
    let mut m = HmacSha256::new_from_slice(key).expect("any key length");
    m.update(msg.as_bytes());
    m.finalize().into_bytes().to_vec()
}

/// `(YYYYMMDD, YYYYMMDDTHHMMSSZ)` of `secs` after the Unix epoch, UTC.
fn utc(secs: u64) -> (String, String) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let date = format!("{y:04}{m:02}{d:02}");
    let time = format!(
        "{date}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    (date, time)
}

fn uri_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A SigV4 presigned path and query for `METHOD path` on `host` (`/bucket/key`, key of
/// URL-safe characters), valid for `expires` seconds from now, signed `UNSIGNED-PAYLOAD`
/// with the `host` header only, region `us-east-1`.
pub fn presign(
    method: &str,
    host: SocketAddr,
    path: &str,
    expires: u64,
    ak: &str,
    sk: &str,
) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (date, amz) = utc(now);
    let region = "us-east-1";
    let scope = format!("{date}/{region}/s3/aws4_request");
    let q = format!(
        "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={}&X-Amz-Date={amz}&X-Amz-Expires={expires}&X-Amz-SignedHeaders=host",
        uri_encode(&format!("{ak}/{scope}"))
    );
    let creq = format!("{method}\n{path}\n{q}\nhost:{host}\n\nhost\nUNSIGNED-PAYLOAD");
    let sts = format!(
        "AWS4-HMAC-SHA256\n{amz}\n{scope}\n{}",
        hex::encode(sha2::Sha256::digest(creq.as_bytes()))
    );
    let k = hmac(format!("AWS4{sk}").as_bytes(), &date);
    let k = hmac(&k, region);
    let k = hmac(&k, "s3");
    let k = hmac(&k, "aws4_request");
    let sig = hex::encode(hmac(&k, &sts));
    format!("{path}?{q}&X-Amz-Signature={sig}")
}

/// A connection to `addr` from `127.0.0.{src}` (every 127/8 address is local on Linux, so
/// one test plays several client addresses).
pub async fn connect_from(src: u8, addr: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(format!("127.0.0.{src}:0").parse().unwrap()).unwrap();
    s.connect(addr).await.unwrap()
}

/// The response head of an HTTP request written raw: `(status, head and whatever body
/// arrived with it)`; `(0, ..)` if the server closed first.
pub async fn read_status(s: &mut TcpStream) -> (u16, String) {
    let mut out = Vec::new();
    let mut b = [0u8; 4096];
    while !out.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut b).await {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&b[..n]),
        }
    }
    let text = String::from_utf8_lossy(&out).to_string();
    (crate::gather_util::http_status(&text), text)
}

/// Reads (and discards) until the server closes the connection; how long that took, or
/// `None` if it was still open after `limit`.
pub async fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let t0 = tokio::time::Instant::now();
    let mut b = vec![0u8; 64 << 10];
    loop {
        match tokio::time::timeout_at(t0 + limit, s.read(&mut b)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(t0.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// Sends a raw HTTP/1.1 request head.
pub async fn send_head(
    s: &mut TcpStream,
    method: &str,
    target: &str,
    host: SocketAddr,
    extra: &str,
) {
    let h = format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n");
    s.write_all(h.as_bytes()).await.unwrap();
}

/// A connection from `127.0.0.{src}` to the server at `addr` that has sent the head of a
/// presigned `method` request for `key` in the test bucket (`gather_util::BUCKET`, signed with
/// the test key pair, valid 10 minutes), with the header lines `extra`.
pub async fn presigned_head(
    src: u8,
    addr: SocketAddr,
    method: &str,
    key: &str,
    extra: &str,
) -> TcpStream {
    use crate::gather_util::{ACCESS, BUCKET, SECRET};
    let mut s = connect_from(src, addr).await;
    let target = presign(
        method,
        addr,
        &format!("/{BUCKET}/{key}"),
        600,
        ACCESS,
        SECRET,
    );
    send_head(&mut s, method, &target, addr, extra).await;
    s
}

/// Resident memory of process `pid`, KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Open descriptors of process `pid`.
pub fn fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0)
}

/// Samples a process's RSS and descriptors every 10 ms on a thread, keeping the peaks.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    peak_rss: Arc<AtomicU64>,
    peak_fds: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    pub fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak_rss = Arc::new(AtomicU64::new(0));
        let peak_fds = Arc::new(AtomicU64::new(0));
        let (s, r, f) = (stop.clone(), peak_rss.clone(), peak_fds.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                r.fetch_max(rss_kib(pid), Ordering::Relaxed);
                f.fetch_max(fds(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Sampler {
            stop,
            peak_rss,
            peak_fds,
            thread: Some(thread),
        }
    }

    /// Stops sampling: `(peak RSS KiB, peak descriptors)`.
    pub fn stop(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        (
            self.peak_rss.load(Ordering::Relaxed),
            self.peak_fds.load(Ordering::Relaxed),
        )
    }
}

/// Raises this process's open-file limit to its hard limit (attacks open many sockets).
pub fn raise_nofile() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    if l.maximum.is_some() {
        l.current = l.maximum;
        let _ = setrlimit(Resource::Nofile, l);
    }
}

/// The median and 90th percentile of `v`, milliseconds.
pub fn median_p90(v: &mut [Duration]) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (
        ms(v[v.len() / 2]),
        ms(v[(v.len() * 9 / 10).min(v.len() - 1)]),
    )
}

/// The filesystem store's temporary files (`.tmp-*`) under `dir`, at any depth, with their
/// sizes in bytes (0 where a file vanished before its size was read).
pub fn tmp_files(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if e.file_name().to_string_lossy().starts_with(".tmp-") {
                out.push((p, e.metadata().map(|m| m.len()).unwrap_or(0)));
            }
        }
    }
    out
}
