//! The connection front: what every accepted connection goes through before a protocol
//! serves it, and the rules that end connections which hold the server without using it.
//!
//! - **Caps** ([`ConnLimits`]): at most `max_connections` open connections, and at most
//!   `max_connections_per_ip` from one client address; a connection past either is closed at
//!   once, before any byte is read.
//! - **One preface sniffer** ([`sniff`]): the first bytes are *read* (never peeked in a loop)
//!   into an 8-byte buffer until they tell the protocol apart (gather, RDMA set-up, HTTP);
//!   they must arrive within `handshake_timeout_secs`. A client that closes, or sends part
//!   of a preface and stops, is dropped: nothing is polled with sleeps and no socket is left
//!   in `CLOSE-WAIT`. The bytes read are handed to the protocol ([`Prefixed`] for HTTP).
//! - **Progress** ([`RateFloor`]): whenever the server waits on a client (a write the client
//!   does not take, a request body or save data it does not send), that client must move at
//!   least `min_client_bytes_per_s` over each `client_timeout_secs` of waiting, and some
//!   bytes in each: a stalled or dripping client is dropped, its memory given back.

use objectcache_client::protocol::PREFACE;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// Open-connection caps, overall and per client address.
#[derive(Debug)]
pub(crate) struct ConnLimits {
    total: usize,
    per_ip: usize,
    open: Mutex<(usize, HashMap<IpAddr, usize>)>,
    metrics: Arc<super::metrics::Metrics>,
}

/// One admitted connection; dropping it frees its place.
#[derive(Debug)]
pub(crate) struct ConnGuard {
    limits: Arc<ConnLimits>,
    ip: IpAddr,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        let mut o = self
            .limits
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        o.0 -= 1;
        if let Some(n) = o.1.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                o.1.remove(&self.ip);
            }
        }
        self.limits.metrics.open_connections.dec();
    }
}

impl ConnLimits {
    /// Caps of `total` connections, `per_ip` from one address.
    pub(crate) fn new(
        total: usize,
        per_ip: usize,
        metrics: Arc<super::metrics::Metrics>,
    ) -> Arc<Self> {
        Arc::new(ConnLimits {
            total,
            per_ip,
            open: Mutex::new((0, HashMap::new())),
            metrics,
        })
    }

    /// Admits a connection from `ip`, or says which cap it is past (counted in
    /// `objectcache_server_errors_total{kind}` as `connections_total` or `connections_per_ip`).
    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnGuard, &'static str> {
        let mut o = self.open.lock().expect("connection table");
        let kind = if o.0 >= self.total {
            "connections_total"
        } else if o.1.get(&ip).copied().unwrap_or(0) >= self.per_ip {
            "connections_per_ip"
        } else {
            o.0 += 1;
            *o.1.entry(ip).or_default() += 1;
            self.metrics.open_connections.inc();
            return Ok(ConnGuard {
                limits: self.clone(),
                ip,
            });
        };
        self.metrics.error(kind);
        Err(kind)
    }
}

/// The soft limit on open files, raised to the hard limit where allowed; connections are
/// capped below it (each is a descriptor, and loads open chunk files besides).
pub(crate) fn raise_nofile_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    if let (Some(cur), Some(max)) = (l.current, l.maximum) {
        if cur < max {
            l.current = Some(max);
            if setrlimit(Resource::Nofile, l).is_err() {
                l.current = Some(cur);
            }
        }
    }
    l.current
}

/// What a connection speaks, from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// The gather preface ([`PREFACE`]).
    Gather,
    /// The RDMA set-up preface (feature `rdma`).
    Rdma,
    /// Anything else: HTTP/1.1.
    Http,
}

/// The first bytes of a connection, read by [`sniff`] (at most 8).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sniffed {
    pub(crate) protocol: Protocol,
    head: [u8; 8],
    len: usize,
}

impl Sniffed {
    /// The bytes read, to be handed to the protocol.
    pub(crate) fn head(&self) -> &[u8] {
        &self.head[..self.len]
    }
}

/// The RDMA set-up preface, where this build offers RDMA.
fn rdma_preface(rdma: bool) -> Option<&'static [u8; 8]> {
    #[cfg(feature = "rdma")]
    if rdma {
        return Some(&objectcache_client::transport::rdma::control::PREFACE);
    }
    let _ = rdma;
    None
}

/// Reads a connection's first bytes (at most 8, into a fixed buffer) until they tell the
/// protocol apart: a byte that no preface has there means HTTP at once; a whole gather (or,
/// with `rdma`, RDMA set-up) preface means that protocol. `None` if the client closes, or
/// has not told within `deadline`.
pub(crate) async fn sniff(
    stream: &mut TcpStream,
    deadline: Instant,
    rdma: bool,
) -> Option<Sniffed> {
    let mut s = Sniffed {
        protocol: Protocol::Http,
        head: [0; 8],
        len: 0,
    };
    let r = rdma_preface(rdma);
    loop {
        let n = tokio::time::timeout_at(deadline, stream.read(&mut s.head[s.len..]))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
        s.len += n;
        let h = &s.head[..s.len];
        let gather = *h == PREFACE[..s.len];
        let rdma = r.is_some_and(|p| *h == p[..s.len]);
        if !gather && !rdma {
            return Some(s);
        }
        if s.len == s.head.len() {
            s.protocol = if gather {
                Protocol::Gather
            } else {
                Protocol::Rdma
            };
            return Some(s);
        }
    }
}

/// Why a client was dropped for making no progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooSlow;

impl std::fmt::Display for TooSlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("client too slow: too few bytes moved while the server waited on it")
    }
}
impl std::error::Error for TooSlow {}

/// The progress a client owes the server while the server waits on it: over every `window`
/// of waiting, some bytes and at least `min_bytes` (see the module documentation). Time
/// the server is not waiting on the client (reading its store, pacing) does not count.
#[derive(Debug, Clone)]
pub(crate) struct RateFloor {
    window: Duration,
    min_bytes: u64,
    waited: Duration,
    moved: u64,
}

impl RateFloor {
    /// A floor of `min_bytes_per_s` over windows of `window`.
    pub(crate) fn new(window: Duration, min_bytes_per_s: u64) -> Self {
        RateFloor {
            window,
            min_bytes: (min_bytes_per_s as f64 * window.as_secs_f64()) as u64,
            waited: Duration::ZERO,
            moved: 0,
        }
    }

    /// Waiting time left in the current window.
    pub(crate) fn left(&self) -> Duration {
        self.window.saturating_sub(self.waited)
    }

    /// Records `n` bytes moved after the server waited `waited` for them.
    ///
    /// # Errors
    /// [`TooSlow`] when a full window of waiting moved no bytes or fewer than the floor.
    pub(crate) fn record(&mut self, waited: Duration, n: u64) -> Result<(), TooSlow> {
        self.waited += waited;
        self.moved += n;
        if self.waited >= self.window {
            let ok = self.moved > 0 && self.moved >= self.min_bytes;
            self.waited = Duration::ZERO;
            self.moved = 0;
            if !ok {
                return Err(TooSlow);
            }
        }
        Ok(())
    }

    /// Waits for `fut`, an operation on the client that moves `moved(&output)` bytes.
    ///
    /// # Errors
    /// [`TooSlow`] as [`RateFloor::record`]; `fut` is dropped then.
    pub(crate) async fn guard<T>(
        &mut self,
        fut: impl Future<Output = T>,
        moved: impl Fn(&T) -> u64,
    ) -> Result<T, TooSlow> {
        tokio::pin!(fut);
        loop {
            let t0 = Instant::now();
            match tokio::time::timeout(self.left(), &mut fut).await {
                Ok(v) => {
                    self.record(t0.elapsed(), moved(&v))?;
                    return Ok(v);
                }
                Err(_) => self.record(t0.elapsed().max(self.left()), 0)?,
            }
        }
    }
}

/// A [`RateFloor`] for poll-based I/O: [`PollFloor::poll`] is called with each poll's
/// outcome and turns a client that keeps the server waiting into an error.
#[derive(Debug)]
pub(crate) struct PollFloor {
    floor: RateFloor,
    since: Option<Instant>,
    timer: Pin<Box<Sleep>>,
}

impl PollFloor {
    pub(crate) fn new(floor: RateFloor) -> Self {
        PollFloor {
            floor,
            since: None,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
        }
    }

    /// `moved`: `Some(n)` when the operation completed with `n` bytes, `None` when it is
    /// pending (the waker is registered with the window's timer too).
    ///
    /// # Errors
    /// [`TooSlow`] when the window ended without enough bytes.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>, moved: Option<u64>) -> Result<(), TooSlow> {
        let now = Instant::now();
        match moved {
            Some(n) => {
                let waited = self.since.take().map_or(Duration::ZERO, |s| now - s);
                self.floor.record(waited, n)
            }
            None => loop {
                let since = *self.since.get_or_insert(now);
                let end = since + self.floor.left();
                if self.timer.deadline() != end {
                    self.timer.as_mut().reset(end);
                }
                if self.timer.as_mut().poll(cx).is_pending() {
                    return Ok(());
                }
                // The window ended while waiting: judge it, then wait in a new one.
                self.floor.record(
                    now.saturating_duration_since(since).max(self.floor.left()),
                    0,
                )?;
                self.since = Some(now);
            },
        }
    }
}

/// A stream whose first bytes were already read (by [`sniff`]): reads replay them, then go
/// to the stream. Writes go to the stream under a [`PollFloor`]: a client that does not take
/// the server's bytes fast enough gets `TimedOut`.
#[derive(Debug)]
pub(crate) struct Prefixed<S> {
    head: [u8; 8],
    at: usize,
    len: usize,
    inner: S,
    write_floor: PollFloor,
}

impl<S> Prefixed<S> {
    /// `inner` after `head` was read from it (at most 8 bytes), writes under `floor`.
    pub(crate) fn new(head: &[u8], inner: S, floor: RateFloor) -> Self {
        let mut h = [0u8; 8];
        h[..head.len()].copy_from_slice(head);
        Prefixed {
            head: h,
            at: 0,
            len: head.len(),
            inner,
            write_floor: PollFloor::new(floor),
        }
    }

    fn guard_write(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        let moved = match &r {
            Poll::Ready(Ok(n)) => Some(*n as u64),
            Poll::Ready(Err(_)) => return r,
            Poll::Pending => None,
        };
        match self.write_floor.poll(cx, moved) {
            Ok(()) => r,
            Err(e) => Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, e))),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.at < this.len {
            let n = (this.len - this.at).min(buf.remaining());
            buf.put_slice(&this.head[this.at..this.at + n]);
            this.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.guard_write(cx, r)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.guard_write(cx, r)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_judges_each_window_of_waiting() {
        let w = Duration::from_secs(10);
        let mut f = RateFloor::new(w, 100);
        // Fast operations never fill a window.
        for _ in 0..1000 {
            f.record(Duration::from_millis(1), 1).unwrap();
        }
        // A window of waiting that moved enough passes, and a new window starts.
        let mut f = RateFloor::new(w, 100);
        f.record(Duration::from_secs(6), 600).unwrap();
        f.record(Duration::from_secs(5), 500).unwrap();
        assert_eq!(f.left(), w);
        // A drip: one byte per 9 s of waiting.
        f.record(Duration::from_secs(9), 1).unwrap();
        assert_eq!(f.record(Duration::from_secs(9), 1), Err(TooSlow));
        // A stall: nothing in a window, even with a zero floor.
        let mut f = RateFloor::new(w, 0);
        assert_eq!(f.record(w, 0), Err(TooSlow));
        f.record(w, 1).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn guard_ends_a_stalled_wait_after_one_window() {
        let mut f = RateFloor::new(Duration::from_secs(30), 0);
        let t0 = Instant::now();
        let r = f.guard(std::future::pending::<u64>(), |&n| n).await;
        assert_eq!(r, Err(TooSlow));
        assert_eq!(t0.elapsed(), Duration::from_secs(30));
        let r = f.guard(async { 5u64 }, |&n| n).await;
        assert_eq!(r, Ok(5));
    }
}
