//! Bodies between our streams and the SDK's: a GET body checked as it streams
//! ([`body_stream`]), a PUT body the SDK can take ([`SyncBody`]).

use super::BACKEND;
use crate::error::StoreError;
use crate::store::ByteStream;
use futures::StreamExt;
use std::time::{Duration, SystemTime};

pub(super) fn to_system_time(t: Option<&aws_smithy_types::DateTime>) -> Option<SystemTime> {
    t.and_then(|d| SystemTime::try_from(*d).ok())
}

/// Total size from a `Content-Range: bytes a-b/size` header.
pub(super) fn total_from_content_range(cr: &str) -> Option<u64> {
    cr.rsplit_once('/').and_then(|(_, t)| t.trim().parse().ok())
}

/// `Content-Range: bytes a-b/size` as (`a`, `b + 1`, the size if given rather than `*`);
/// `None` for any other form, or `b < a`. The SDK's GETs (`ops.rs`) and the direct ones
/// (`direct.rs`) read the header with it.
pub(super) fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let (range, size) = v.trim().strip_prefix("bytes ")?.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let (a, b): (u64, u64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (a <= b).then_some((a, b + 1, size.trim().parse().ok()))
}

/// Streams an SDK body as our [`ByteStream`]: each chunk must arrive within `idle`, and the
/// body must hold exactly `want` bytes (an early end or an overrun is an error).
pub(super) fn body_stream(
    key: String,
    body: aws_sdk_s3::primitives::ByteStream,
    want: u64,
    idle: Duration,
) -> ByteStream {
    struct St {
        key: String,
        body: aws_sdk_s3::primitives::ByteStream,
        got: u64,
        want: u64,
        idle: Duration,
        done: bool,
    }
    let st = St {
        key,
        body,
        got: 0,
        want,
        idle,
        done: false,
    };
    futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let next = match tokio::time::timeout(st.idle, st.body.next()).await {
            Err(_) => Some(Err(StoreError::Timeout {
                backend: BACKEND,
                message: format!(
                    "GET {}: no body bytes for {:?} after {} of {} bytes",
                    st.key, st.idle, st.got, st.want
                ),
            })),
            Ok(None) if st.got == st.want => None,
            Ok(None) => Some(Err(StoreError::Other {
                backend: BACKEND,
                message: format!(
                    "GET {}: body ended after {} of {} bytes",
                    st.key, st.got, st.want
                ),
            })),
            Ok(Some(Err(e))) => Some(Err(StoreError::Other {
                backend: BACKEND,
                message: format!(
                    "GET {}: body failed after {} of {} bytes: {}",
                    st.key,
                    st.got,
                    st.want,
                    super::errors::causes(&e)
                ),
            })),
            Ok(Some(Ok(b))) => {
                st.got += b.len() as u64;
                if st.got > st.want {
                    Some(Err(StoreError::Other {
                        backend: BACKEND,
                        message: format!(
                            "GET {}: body longer than the {} bytes expected",
                            st.key, st.want
                        ),
                    }))
                } else {
                    Some(Ok(b))
                }
            }
        };
        match next {
            None => None,
            Some(Err(e)) => {
                st.done = true;
                Some((Err(e), st))
            }
            Some(Ok(b)) => Some((Ok(b), st)),
        }
    })
    .boxed()
}

/// A body stream made `Sync` (as the SDK's body requires) without locking: it is only ever
/// polled through `&mut`.
pub(super) struct SyncBody<S>(pub(super) std::sync::Mutex<S>);

impl<S: futures::Stream + Unpin> futures::Stream for SyncBody<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.0.get_mut() {
            Ok(s) => std::pin::Pin::new(s).poll_next(cx),
            Err(_) => std::task::Poll::Ready(None),
        }
    }
}
