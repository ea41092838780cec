//! PUT bodies under the server's rules ([`MeteredBody`]) and why one was cut off
//! ([`BodyFault`]).

use super::super::budget::{Budget, Hold};
use super::super::conn::{PollFloor, RateFloor};
use super::get_body::slow_down;
use bytes::Bytes;
use s3s::{s3_error, S3Error};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// Why a request body was cut off by the server (read by `put_object` to answer with the
/// right S3 error).
#[derive(Debug, Default)]
pub(crate) struct BodyFault(Mutex<Option<BodyFaultKind>>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFaultKind {
    /// The memory budget stayed spent for the whole wait.
    SlowDown,
    /// The client sent too little while the server waited (stall or drip).
    TooSlow,
    /// One request would hold more than `max_request_bytes` of body at once.
    TooLarge,
}

impl BodyFault {
    fn set(&self, k: BodyFaultKind) {
        *self.0.lock().expect("body fault") = Some(k);
    }
    pub(super) fn get(&self) -> Option<BodyFaultKind> {
        *self.0.lock().expect("body fault")
    }
}

impl BodyFaultKind {
    pub(super) fn s3_error(self) -> S3Error {
        match self {
            BodyFaultKind::SlowDown => slow_down(),
            BodyFaultKind::TooSlow => s3_error!(
                RequestTimeout,
                "your socket connection to the server was not read from or written to within the timeout period"
            ),
            BodyFaultKind::TooLarge => s3_error!(
                InvalidRequest,
                "the request body arrives in pieces larger than this server buffers for one request"
            ),
        }
    }
    fn message(self) -> &'static str {
        match self {
            BodyFaultKind::SlowDown => "memory budget exhausted",
            BodyFaultKind::TooSlow => "client too slow",
            BodyFaultKind::TooLarge => "request body buffered above max_request_bytes",
        }
    }
}

/// Limits of [`MeteredBody`].
#[derive(Debug, Clone)]
pub(crate) struct BodyLimits {
    /// The server's memory budget.
    pub(crate) budget: Budget,
    /// How long a body piece waits for memory before the request gets `503 SlowDown`.
    pub(crate) wait: Duration,
    /// Progress the client owes while the server waits for its body.
    pub(crate) floor: RateFloor,
    /// Body bytes one request may hold at once (pieces received, not yet stored).
    pub(crate) max_request_bytes: u64,
}

/// A request body under the server's rules: each piece is held under the memory budget from
/// the socket until its consumer (the store) drops it; the client must keep sending
/// ([`RateFloor`]); one request never holds more than `max_request_bytes` at once. A broken
/// rule ends the body with an error and records why in the request's [`BodyFault`].
pub(crate) struct MeteredBody {
    inner: hyper::body::Incoming,
    lim: BodyLimits,
    floor: PollFloor,
    fault: Arc<BodyFault>,
    held: Arc<AtomicU64>,
    waiting: Option<(Bytes, Pin<Box<dyn Future<Output = Option<Hold>> + Send>>)>,
}

impl MeteredBody {
    /// Meters `inner`; the request's [`BodyFault`] is returned for its extensions.
    pub(crate) fn new(inner: hyper::body::Incoming, lim: BodyLimits) -> (Self, Arc<BodyFault>) {
        let fault = Arc::new(BodyFault::default());
        let floor = PollFloor::new(lim.floor.clone());
        (
            MeteredBody {
                inner,
                lim,
                floor,
                fault: fault.clone(),
                held: Arc::new(AtomicU64::new(0)),
                waiting: None,
            },
            fault,
        )
    }

    fn fail(
        &mut self,
        k: BodyFaultKind,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        self.fault.set(k);
        self.waiting = None;
        Poll::Ready(Some(Err(std::io::Error::other(k.message()))))
    }

    /// `data` with its hold attached, counted in this request's held bytes until dropped.
    fn release(&self, data: Bytes, hold: Hold) -> Bytes {
        let n = data.len() as u64;
        self.held.fetch_add(n, Ordering::Relaxed);
        let held = self.held.clone();
        hold.attach(Bytes::from_owner(Tally { data, held, n }))
    }
}

/// Bytes counted in a request's held total until dropped.
struct Tally {
    data: Bytes,
    held: Arc<AtomicU64>,
    n: u64,
}
impl AsRef<[u8]> for Tally {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}
impl Drop for Tally {
    fn drop(&mut self) {
        self.held.fetch_sub(self.n, Ordering::Relaxed);
    }
}

impl http_body::Body for MeteredBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        loop {
            if let Some((_, fut)) = this.waiting.as_mut() {
                let Poll::Ready(h) = fut.as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                let (data, _) = this.waiting.take().expect("waiting");
                return match h {
                    Some(hold) => {
                        Poll::Ready(Some(Ok(hyper::body::Frame::data(this.release(data, hold)))))
                    }
                    None => this.fail(BodyFaultKind::SlowDown),
                };
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    if this.floor.poll(cx, None).is_err() {
                        return this.fail(BodyFaultKind::TooSlow);
                    }
                    return Poll::Pending;
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(Err(e))) => {
                    return Poll::Ready(Some(Err(std::io::Error::other(e))))
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let data = match frame.into_data() {
                        Ok(d) => d,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    let n = data.len() as u64;
                    if this.floor.poll(cx, Some(n)).is_err() {
                        return this.fail(BodyFaultKind::TooSlow);
                    }
                    if this.held.load(Ordering::Relaxed) + n > this.lim.max_request_bytes {
                        return this.fail(BodyFaultKind::TooLarge);
                    }
                    if let Some(hold) = this.lim.budget.try_acquire(n) {
                        return Poll::Ready(Some(Ok(hyper::body::Frame::data(
                            this.release(data, hold),
                        ))));
                    }
                    // Past the budget: stop reading this client until memory comes free.
                    let (b, wait) = (this.lim.budget.clone(), this.lim.wait);
                    this.waiting = Some((
                        data,
                        Box::pin(async move { b.acquire_within(n, wait).await }),
                    ));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.waiting.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut h = self.inner.size_hint();
        if let Some((d, _)) = &self.waiting {
            let n = d.len() as u64;
            h.set_lower(h.lower() + n);
            if let Some(u) = h.upper() {
                h.set_upper(u + n);
            }
        }
        h
    }
}
