//! A gather connection's socket I/O: reads under the server's memory budget and the
//! client's progress floor, vectored writes of buffers (frames, and slices lent from the
//! backend's memory or from mapped object files).

use crate::budget::Hold;
use crate::conn::RateFloor;
use crate::{Abort, ServerState};

use bytes::{Bytes, BytesMut};
use objectcache_client::protocol::{ErrorCode, ServerConnection, ServerEvent};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

/// Buffers per vectored write (well under the kernel's IOV_MAX of 1024).
pub(super) const MAX_IOV: usize = 64;

pub(super) struct Io {
    pub(super) rd: OwnedReadHalf,
    pub(super) wr: OwnedWriteHalf,
    pub(super) buf: BytesMut,
    pub(super) conn: ServerConnection,
    /// Memory budget held for the large frame being received (see [`Io::read_more`]).
    pub(super) frame_hold: Option<(usize, Hold)>,
    /// Holds of large save-data frames received and not yet handed to their save, in order.
    pub(super) save_holds: std::collections::VecDeque<Hold>,
    /// The progress the client owes while the server waits to write to it.
    pub(super) write_floor: RateFloor,
}

/// Bytes of a gather connection's read buffer: before authentication it never holds more
/// (handshake frames are a few hundred bytes, [`objectcache_client::protocol::MAX_HANDSHAKE_BODY_BYTES`]);
/// a larger frame afterwards (a descriptor, save data) is read into memory held under the
/// budget.
pub(super) const CONN_BUF_BYTES: usize = 8 << 10;
/// Bytes of a large frame read per budget step: memory is held for what arrived plus one
/// step, never for a size the frame header merely declares.
const FRAME_STEP_BYTES: usize = 1 << 20;

/// How long a read of the client may wait.
pub(super) enum ReadWait<'a> {
    /// Until this instant (the handshake deadline).
    Until(Instant),
    /// This long with no request (an idle connection).
    Idle(Duration),
    /// Under the client's progress floor (data the server is waiting for).
    Floor(&'a mut RateFloor),
}

/// Bytes a write to the client moved (for its progress floor).
trait Moved {
    fn moved(&self) -> u64;
}
impl Moved for usize {
    fn moved(&self) -> u64 {
        *self as u64
    }
}

/// A write to the client under its progress floor ([`RateFloor`]: some bytes, and at least
/// `min_client_bytes_per_s`, over each `client_timeout_secs` the server waits on it): an
/// I/O error, or a client that takes too little (counted as a `client_timeout` error), ends
/// the connection.
async fn within_client_timeout<T: Moved>(
    sh: &ServerState,
    floor: &mut RateFloor,
    write: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, Abort> {
    let moved = |r: &std::io::Result<T>| r.as_ref().map_or(0, Moved::moved);
    match floor.guard(write, moved).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(Abort::Gone),
        Err(_) => {
            sh.metrics.error("client_timeout");
            Err(Abort::Gone)
        }
    }
}

impl Io {
    /// Writes everything queued with vectored writes (no copy: the queued `Bytes` are the
    /// backend's buffers); a client that accepts nothing for `client_timeout` is gone.
    pub(super) async fn flush(&mut self, sh: &ServerState) -> Result<(), Abort> {
        let mut q: std::collections::VecDeque<Bytes> = std::collections::VecDeque::new();
        while let Some(b) = self.conn.poll_transmit() {
            if !b.is_empty() {
                q.push_back(b);
            }
        }
        while !q.is_empty() {
            let slices: Vec<std::io::IoSlice<'_>> = q
                .iter()
                .take(MAX_IOV)
                .map(|b| std::io::IoSlice::new(b))
                .collect();
            let mut n =
                within_client_timeout(sh, &mut self.write_floor, self.wr.write_vectored(&slices))
                    .await?;
            if n == 0 {
                return Err(Abort::Gone);
            }
            drop(slices);
            while n > 0 {
                let front = q.front_mut().expect("written bytes were queued");
                if n >= front.len() {
                    n -= front.len();
                    q.pop_front();
                } else {
                    bytes::Buf::advance(front, n);
                    n = 0;
                }
            }
        }
        Ok(())
    }

    /// Reads what the client sends next into the connection buffer and hands it to the
    /// state machine. A frame larger than [`CONN_BUF_BYTES`] is read [`FRAME_STEP_BYTES`] at
    /// a time, each step's memory taken from the budget before it is read (waiting up to the
    /// client timeout, then `Busy`); once decoded, a save-data frame's hold goes with its
    /// payload, any other's is given back, and the buffer shrinks back to its fixed size.
    ///
    /// # Errors
    /// [`Abort::Gone`] when the client closed, failed, sent a bad frame, or broke `wait`.
    pub(super) async fn read_more(
        &mut self,
        sh: &ServerState,
        wait: ReadWait<'_>,
    ) -> Result<(), Abort> {
        let mut limit = CONN_BUF_BYTES.saturating_sub(self.buf.len()).max(1);
        if let Some(total) = self.conn.partial_frame_len(&self.buf) {
            if total > CONN_BUF_BYTES {
                let want = total.min(self.buf.len() + FRAME_STEP_BYTES);
                let held = self
                    .frame_hold
                    .as_ref()
                    .map_or(0, |(_, h)| h.bytes() as usize);
                if want > held {
                    let wait = Duration::from_secs(sh.cfg.client_timeout_secs);
                    let Some(more) = sh.budget.acquire_within((want - held) as u64, wait).await
                    else {
                        sh.metrics.error("memory_budget");
                        self.conn.close_with(
                            ErrorCode::Busy,
                            "the server's memory budget is in use by other requests; retry",
                        );
                        let _ = self.flush(sh).await;
                        return Err(Abort::Gone);
                    };
                    match &mut self.frame_hold {
                        Some((_, h)) => h.merge(more),
                        None => self.frame_hold = Some((total, more)),
                    }
                }
                limit = want - self.buf.len();
            }
        }
        let mut room = bytes::BufMut::limit(&mut self.buf, limit);
        let read = self.rd.read_buf(&mut room);
        let r = match wait {
            ReadWait::Until(t) => match tokio::time::timeout_at(t, read).await {
                Ok(r) => r,
                Err(_) => {
                    sh.metrics.error("handshake");
                    return Err(Abort::Gone);
                }
            },
            ReadWait::Idle(d) => match tokio::time::timeout(d, read).await {
                Ok(r) => r,
                Err(_) => return Err(Abort::Gone),
            },
            ReadWait::Floor(f) => match f.guard(read, |r| *r.as_ref().unwrap_or(&0) as u64).await {
                Ok(r) => r,
                Err(_) => {
                    sh.metrics.error("client_too_slow");
                    return Err(Abort::Gone);
                }
            },
        };
        match r {
            Ok(0) | Err(_) => return Err(Abort::Gone),
            Ok(_) => {}
        }
        let whole = self
            .frame_hold
            .as_ref()
            .is_some_and(|(total, _)| self.buf.len() >= *total);
        let ty = self.buf.first().copied();
        let _ = self.conn.handle_bytes(&mut self.buf);
        if whole {
            let (_, h) = self.frame_hold.take().expect("held");
            if ty == Some(objectcache_client::protocol::FrameType::SaveData as u8) {
                self.save_holds.push_back(h);
            }
            // The frame's bytes now belong to its payload alone: a fresh small buffer.
            let rest = self.buf.split();
            self.buf = BytesMut::with_capacity(CONN_BUF_BYTES.max(rest.len()));
            self.buf.extend_from_slice(&rest);
        }
        Ok(())
    }

    /// The budget hold of a save-data frame with `len` payload bytes, if it was received as a
    /// large frame (see [`Io::read_more`]).
    pub(super) fn save_hold(&mut self, len: usize) -> Option<Hold> {
        let frame = objectcache_client::protocol::FRAME_HEADER_LEN
            + objectcache_client::protocol::SAVE_DATA_HEADER_LEN
            + len;
        (frame > CONN_BUF_BYTES)
            .then(|| self.save_holds.pop_front())
            .flatten()
    }

    /// Reads until the client cancels or goes away (cancel-safe).
    pub(super) async fn next_signal(&mut self) -> Abort {
        loop {
            match self.rd.read_buf(&mut self.buf).await {
                Ok(0) | Err(_) => return Abort::Gone,
                Ok(_) => {
                    if self.conn.handle_bytes(&mut self.buf).is_err() {
                        return Abort::Gone;
                    }
                    while let Some(ev) = self.conn.poll_event() {
                        if let ServerEvent::Cancel { .. } = ev {
                            return Abort::Cancelled;
                        }
                    }
                }
            }
        }
    }
}
