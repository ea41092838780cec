//! [`DelayProxy`]: a TCP proxy on loopback that adds a fixed one-way delay, so that tests and
//! `objectcache-bench transfer --delay-ms` see the round trips of a distant store (a region
//! away, or AWS S3's first-byte latency) on one machine.
//!
//! Each direction of each connection is a pipe: bytes read from one side are held for the
//! one-way delay, counted from when they were read, then written to the other side. Reads
//! go on while earlier bytes wait, so the delay adds latency without capping the rate: a
//! connection carries as many bytes per round trip as its sender keeps in flight, as on a
//! long link (up to [`DelayProxy::MAX_HELD_BYTES`] held per direction and connection). A new
//! connection's first bytes towards the server wait two more one-way delays: the round trip
//! of TCP's handshake, which the proxy, accepting at once on loopback, does not otherwise
//! add. Delays are served by tokio's timer (millisecond resolution, so each is rounded up to
//! the next millisecond).
//!
//! Not a network emulator: no loss, no jitter, no bandwidth limit, no window of its own.

use bytes::{Bytes, BytesMut};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// A running delaying proxy; dropping it stops it and closes every connection it carries.
#[derive(Debug)]
pub struct DelayProxy {
    addr: SocketAddr,
    one_way: Duration,
    accepted: Arc<AtomicU64>,
    tasks: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl DelayProxy {
    /// Bytes held (read, not yet written) per direction of one connection at most: 256 MiB,
    /// above the bandwidth-delay product of a 40 Gbit/s link at 50 ms one way.
    pub const MAX_HELD_BYTES: usize = 256 << 20;

    /// Listens on an ephemeral loopback port and forwards every connection to `upstream`,
    /// delaying each direction by `one_way`. Must be called within a tokio runtime, whose
    /// tasks carry the connections.
    ///
    /// # Errors
    /// The listener's bind error.
    pub async fn start(upstream: SocketAddr, one_way: Duration) -> std::io::Result<DelayProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let accepted = Arc::new(AtomicU64::new(0));
        let tasks: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (acc, t2) = (accepted.clone(), tasks.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                acc.fetch_add(1, Ordering::Relaxed);
                let conn = tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = pipe(cr, sw, one_way, one_way * 2);
                    let down = pipe(sr, cw, one_way, Duration::ZERO);
                    let _ = tokio::join!(up, down);
                });
                let mut t = t2.lock().expect("lock");
                t.retain(|h| !h.is_finished());
                t.push(conn.abort_handle());
            }
        });
        tasks.lock().expect("lock").push(accept.abort_handle());
        Ok(DelayProxy {
            addr,
            one_way,
            accepted,
            tasks,
        })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The one-way delay.
    pub fn one_way(&self) -> Duration {
        self.one_way
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
        {
            t.abort();
        }
    }
}

/// Forwards `from` to `to`, each piece `delay` after it was read (the first piece `first`
/// later still); at the end of `from`, shuts `to`'s write side down once the last piece is
/// written.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration, first: Duration) {
    let held = Arc::new(tokio::sync::Semaphore::new(DelayProxy::MAX_HELD_BYTES));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(
        Instant,
        Bytes,
        tokio::sync::OwnedSemaphorePermit,
    )>();
    let h2 = held.clone();
    let reader = async move {
        let mut extra = first;
        let mut buf = BytesMut::new();
        loop {
            buf.reserve(256 << 10);
            match from.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let piece = buf.split().freeze();
            let due = Instant::now() + delay + extra;
            extra = Duration::ZERO;
            let Ok(permit) = h2
                .clone()
                .acquire_many_owned(piece.len().min(DelayProxy::MAX_HELD_BYTES) as u32)
                .await
            else {
                break;
            };
            if tx.send((due, piece, permit)).is_err() {
                break;
            }
        }
        // Dropping `tx` ends the writer once every held piece is written.
    };
    let writer = async move {
        while let Some((due, piece, _permit)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&piece).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server behind a 20 ms proxy: the bytes come back unchanged, a round trip on an
    /// open connection takes at least 40 ms, and a new connection's first one at least 80 ms
    /// (the handshake's round trip on top).
    #[tokio::test]
    async fn delays_each_direction_and_keeps_bytes() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut b = vec![0u8; 1 << 16];
            loop {
                let n = s.read(&mut b).await.unwrap();
                if n == 0 {
                    return;
                }
                s.write_all(&b[..n]).await.unwrap();
            }
        });
        let p = DelayProxy::start(up, Duration::from_millis(20))
            .await
            .unwrap();
        let mut c = TcpStream::connect(p.local_addr()).await.unwrap();
        let msg: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        for round in 0..2 {
            let t0 = std::time::Instant::now();
            c.write_all(&msg).await.unwrap();
            let mut got = vec![0u8; msg.len()];
            c.read_exact(&mut got).await.unwrap();
            let rt = t0.elapsed();
            assert_eq!(got, msg);
            let least = if round == 0 { 80 } else { 40 };
            assert!(rt >= Duration::from_millis(least), "round {round}: {rt:?}");
        }
        assert_eq!(p.connections(), 1);
        assert_eq!(p.one_way(), Duration::from_millis(20));
    }
}
