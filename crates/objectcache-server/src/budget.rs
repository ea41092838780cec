//! The server's memory budget: one pool of `memory_budget_bytes` over every buffer a request
//! holds in memory, whatever the protocol.
//!
//! | holder | what is counted | released |
//! |---|---|---|
//! | gather load | each unit read ahead of the socket (`gather/fetch.rs`, `fetch_unit`) | once the unit is written |
//! | batched save | one whole object plus one save-data frame | when the save ends |
//! | gather connection | a frame larger than the connection buffer (descriptor, save data) while it arrives | once the frame is decoded |
//! | S3 PUT | each body piece, from the socket until it is written to the store | when the store has written it (the piece's buffer is dropped) |
//! | S3 GET | each body piece, from the store read until it is written to the socket | when the socket has taken it |
//!
//! The pool is a semaphore of [`PERMIT_BYTES`]-byte permits. A holder that cannot get its
//! bytes waits (the server stops reading that client, so TCP slows it) for at most the
//! client timeout, then the request is refused: `503 SlowDown` on the S3 API, `Busy` on
//! gather. A declared size (`Content-Length`, an object length) is never reserved up front:
//! only bytes that exist are counted. Besides the budget, each open connection holds a
//! small fixed buffer (`docs/reliability.md`, "Hostile clients", gives the figures).

use super::metrics::Metrics;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes per permit of the budget's semaphore.
pub(crate) const PERMIT_BYTES: u64 = 4096;

/// Permits covering `bytes`.
pub(crate) fn permits_for(bytes: u64) -> u32 {
    bytes.div_ceil(PERMIT_BYTES).min(u32::MAX as u64) as u32
}

/// The memory budget shared by every request of a server.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    sem: Arc<Semaphore>,
    metrics: Arc<Metrics>,
}

/// Bytes held under the budget; dropping it gives them back.
#[derive(Debug)]
pub(crate) struct Hold {
    permit: Option<OwnedSemaphorePermit>,
    bytes: u64,
    metrics: Arc<Metrics>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.metrics.inflight_bytes.dec_by(self.bytes as i64);
    }
}

impl Budget {
    /// A budget of `bytes` (rounded up to whole [`PERMIT_BYTES`] permits), reporting held
    /// bytes in `metrics`.
    pub(crate) fn new(bytes: u64, metrics: Arc<Metrics>) -> Self {
        let sem = Arc::new(Semaphore::new(permits_for(bytes) as usize));
        Budget { sem, metrics }
    }

    fn hold(&self, permit: OwnedSemaphorePermit, bytes: u64) -> Hold {
        self.metrics.add_inflight(bytes as i64);
        Hold {
            permit: Some(permit),
            bytes,
            metrics: self.metrics.clone(),
        }
    }

    /// `bytes` now, or `None` if the budget has not that much free.
    pub(crate) fn try_acquire(&self, bytes: u64) -> Option<Hold> {
        let p = self
            .sem
            .clone()
            .try_acquire_many_owned(permits_for(bytes))
            .ok()?;
        Some(self.hold(p, bytes))
    }

    /// `bytes`, waiting as long as it takes (a gather load's read-ahead: its reader waits for
    /// the socket to take earlier units, which gives them back).
    pub(crate) async fn acquire(&self, bytes: u64) -> Hold {
        let p = self
            .sem
            .clone()
            .acquire_many_owned(permits_for(bytes))
            .await
            .expect("the budget's semaphore is never closed");
        self.hold(p, bytes)
    }

    /// `bytes`, waiting up to `wait` for them; `None` if they did not come free in time
    /// (the caller refuses the request: `SlowDown` or `Busy`).
    pub(crate) async fn acquire_within(&self, bytes: u64, wait: Duration) -> Option<Hold> {
        if let Some(h) = self.try_acquire(bytes) {
            return Some(h);
        }
        let p = tokio::time::timeout(
            wait,
            self.sem.clone().acquire_many_owned(permits_for(bytes)),
        )
        .await
        .ok()?
        .ok()?;
        Some(self.hold(p, bytes))
    }
}

impl Hold {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Splits `bytes` off into a hold of their own (whole permits only: the remainder keeps
    /// any partial permit). `None` if this hold has not that many whole permits.
    pub(crate) fn split(&mut self, bytes: u64) -> Option<Hold> {
        let n = (bytes / PERMIT_BYTES) as usize;
        let p = self.permit.as_mut()?.split(n)?;
        let moved = n as u64 * PERMIT_BYTES;
        self.bytes = self.bytes.saturating_sub(moved);
        Some(Hold {
            permit: Some(p),
            bytes: moved,
            metrics: self.metrics.clone(),
        })
    }

    /// Adds `other`'s bytes to this hold (both from the same budget).
    pub(crate) fn merge(&mut self, mut other: Hold) {
        match (self.permit.as_mut(), other.permit.take()) {
            (Some(a), Some(b)) => a.merge(b),
            (None, b) => self.permit = b,
            (Some(_), None) => {}
        }
        self.bytes += std::mem::take(&mut other.bytes);
    }

    /// Ties this hold to `data`'s buffer: it is given back when the last handle to the buffer
    /// drops (the store wrote it, or the socket took it).
    pub(crate) fn attach(self, data: Bytes) -> Bytes {
        Bytes::from_owner(Held { data, _hold: self })
    }
}

/// A buffer and the budget it holds.
struct Held {
    data: Bytes,
    _hold: Hold,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn holds_come_back_when_their_buffers_drop() {
        let b = Budget::new(4 * PERMIT_BYTES, Arc::new(Metrics::new()));
        let h = b.try_acquire(3 * PERMIT_BYTES).unwrap();
        assert!(
            b.try_acquire(2 * PERMIT_BYTES).is_none(),
            "only one permit left"
        );
        let data = h.attach(Bytes::from(vec![7u8; 100]));
        let part = data.slice(10..20);
        drop(data);
        assert!(
            b.try_acquire(2 * PERMIT_BYTES).is_none(),
            "a slice keeps the hold"
        );
        drop(part);
        assert!(b.try_acquire(4 * PERMIT_BYTES).is_some(), "all back");
        // A request larger than the budget waits, then is refused.
        assert!(b
            .acquire_within(5 * PERMIT_BYTES, Duration::from_millis(10))
            .await
            .is_none());
        // Splitting gives whole permits back separately.
        let mut h = b.try_acquire(4 * PERMIT_BYTES).unwrap();
        let back = h.split(3 * PERMIT_BYTES).unwrap();
        assert_eq!((h.bytes(), back.bytes()), (PERMIT_BYTES, 3 * PERMIT_BYTES));
        drop(back);
        assert!(b.try_acquire(3 * PERMIT_BYTES).is_some());
        drop(h);
        // Merged holds come back together.
        let mut a = b.try_acquire(PERMIT_BYTES).unwrap();
        a.merge(b.try_acquire(2 * PERMIT_BYTES).unwrap());
        assert_eq!(a.bytes(), 3 * PERMIT_BYTES);
        assert!(b.try_acquire(2 * PERMIT_BYTES).is_none());
        drop(a);
        assert!(b.try_acquire(4 * PERMIT_BYTES).is_some());
    }
}
