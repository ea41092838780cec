//! GET bodies: a store's body stream as `s3s` takes it, metered under the server's memory
//! budget.

use super::super::budget::{Budget, Hold};
use bytes::Bytes;
use futures::StreamExt;
use objectcache_client::error::{StoreError, StoreResult};
use s3s::{s3_error, S3Error};
use std::time::Duration;

/// Makes a store body `Sync` (as `s3s` requires) without locking: it is only ever polled
/// through `&mut`.
pub(super) struct SyncStream(pub(super) std::sync::Mutex<objectcache_client::store::ByteStream>);

impl futures::Stream for SyncStream {
    type Item = StoreResult<Bytes>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.0.get_mut() {
            Ok(s) => s.poll_next_unpin(cx),
            Err(_) => std::task::Poll::Ready(Some(Err(StoreError::other(
                "server",
                "body stream poisoned",
            )))),
        }
    }
}

/// Bytes of a GET body held under the memory budget at a time: one store read (the
/// filesystem store reads 4 MiB pieces), or one piece of a local file's body.
pub(super) const GET_PIECE_BYTES: u64 = 4 << 20;

/// `503 SlowDown`: the server's memory budget is spent; the client retries after a backoff.
pub(super) fn slow_down() -> S3Error {
    s3_error!(
        SlowDown,
        "the server's memory budget is in use by other requests; retry"
    )
}

/// A GET body under the memory budget: each piece's bytes are held before the store reads
/// it (`first` for the first piece) and given back when the socket has taken the piece.
/// A piece that cannot get its memory within `wait` ends the body with an error (the client
/// sees a short body and retries).
pub(super) fn metered_stream(
    inner: objectcache_client::store::ByteStream,
    budget: Budget,
    wait: Duration,
    len: u64,
    first: Option<Hold>,
) -> objectcache_client::store::ByteStream {
    futures::stream::unfold(
        (inner, budget, first, len, false),
        move |(mut inner, budget, next, left, done)| async move {
            if done {
                return None;
            }
            let want = left.clamp(1, GET_PIECE_BYTES);
            let mut hold = match next {
                Some(h) => h,
                None => match budget.acquire_within(want, wait).await {
                    Some(h) => h,
                    None => {
                        let e = StoreError::other("server", "memory budget exhausted");
                        return Some((Err(e), (inner, budget, None, left, true)));
                    }
                },
            };
            match inner.next().await {
                None => None,
                Some(Err(e)) => Some((Err(e), (inner, budget, None, left, true))),
                Some(Ok(b)) => {
                    let n = b.len() as u64;
                    if n < hold.bytes() {
                        drop(hold.split(hold.bytes() - n));
                    } else if n > hold.bytes() {
                        match budget.acquire_within(n - hold.bytes(), wait).await {
                            Some(more) => hold.merge(more),
                            None => {
                                let e = StoreError::other("server", "memory budget exhausted");
                                return Some((Err(e), (inner, budget, None, left, true)));
                            }
                        }
                    }
                    let left = left.saturating_sub(n);
                    Some((Ok(hold.attach(b)), (inner, budget, None, left, false)))
                }
            }
        },
    )
    .boxed()
}
