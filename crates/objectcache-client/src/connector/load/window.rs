//! The look-ahead window that the ranged-GET load paths share (chunk objects, `ranged.rs`;
//! segment objects, `segment.rs`): how many reads and bytes one load has in flight
//! ([`Flight`], [`FlightPermit`]), and how a store error on a read becomes its chunk's status
//! and layer error ([`classify`]).

use super::LoadShared;
use crate::connector::status::ChunkStatus;
use crate::error::{LayerError, StoreError};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Maps a store error on chunk `c` to its chunk status and layer error.
pub(super) fn classify(c: usize, key: &str, e: &StoreError) -> (ChunkStatus, LayerError) {
    match e {
        StoreError::NotFound { .. } => (
            ChunkStatus::Missing,
            LayerError::Missing {
                chunk: c,
                key: key.to_string(),
            },
        ),
        StoreError::InvalidRange { size, .. } => (
            ChunkStatus::WrongGeometry,
            LayerError::GeometryMismatch {
                chunk: c,
                reason: format!("object {key} has {size} bytes, too short for this geometry"),
            },
        ),
        other => (
            ChunkStatus::Error,
            LayerError::Storage {
                chunk: c,
                message: other.to_string(),
            },
        ),
    }
}

/// Most requests one ranged-GET load has in flight at once, first-layer reads included.
///
/// Without it a load of many small chunks (a 32K-token prefix in vLLM's 16-token blocks is
/// 2,048 chunks) sends every first-layer read at once, and on a long round trip the request
/// cap grows with the bandwidth-delay product over reads of a few KiB: thousands of
/// connections to one server, past its per-client limit (ours closes connections beyond
/// `max_connections_per_ip`, default 512), so reads fail. Measured: a 32K-token load in
/// 16-token chunks from our server failed with "connection closed before message completed"
/// (`objectcache-bench transfer --context 32768 --tokens-per-chunk 16`). 256 reads of the
/// default 4 MiB coalesced size still fill a 1 GiB window.
pub(crate) const MAX_REQUESTS_IN_FLIGHT: usize = 256;

/// Bytes one ranged-GET load may have in flight before it has measured its path, and
/// whenever twice the measured bandwidth-delay product is smaller: 256 MiB, or `window_bytes`
/// where that is smaller.
///
/// The bytes in flight grow past it only as the measured product needs, up to `window_bytes`.
/// Why not all of `window_bytes` at once: on a short round trip more bytes in flight only
/// split the link among more layers, so the first layer comes later. Measured with a fixed
/// 1 GiB window against 256 MiB (`objectcache-bench transfer --context 32768 --paths
/// s3-segment`, no delay): first layer 124 ms against 67 ms (docs/benchmarks.md, "Delay
/// sweep"). 256 MiB covers twice the product of a 2.7 GB/s link up to a 100 ms round trip.
pub(crate) const BASE_WINDOW_BYTES: u64 = 256 << 20;

/// Requests and bytes in flight of one ranged-GET load, and what it has measured of the
/// path: the shortest time to response headers (the round trip, plus the server's time) and
/// the bytes received since the first one arrived (the delivery rate).
///
/// A read may go out when the bytes in flight stay within the byte limit (one read larger
/// than it goes alone) and, except for first-layer reads, the requests in flight stay below
/// the request cap: `max(max_requests, ceil(target / mean read))`. The target is twice the
/// measured bandwidth-delay product (rate x shortest round trip; the rate is the bytes
/// received since the first one over at least one round trip), bounded by `window_bytes`;
/// the byte limit is the larger of the target and [`BASE_WINDOW_BYTES`], bounded by
/// `window_bytes`. On a short round trip the cap is `max_requests` and the limit the base;
/// on a long one both grow with each round trip's deliveries until the bytes in flight
/// cover the product (or fill `window_bytes`). First-layer reads (one per chunk) all go out
/// at once within the byte limit: layer 0 is needed first, so its reads gain nothing from
/// waiting, and a long round trip is paid once for all of them. Whatever the caps, at most
/// [`MAX_REQUESTS_IN_FLIGHT`] reads are in flight.
pub(super) struct Flight {
    st: Mutex<FlightState>,
    changed: tokio::sync::Notify,
    window: u64,
    max_requests: usize,
    mean_read: f64,
    start: std::time::Instant,
}

#[derive(Default)]
struct FlightState {
    requests: usize,
    bytes: u64,
    /// Shortest time from sending a request to its response headers, seconds.
    min_rtt_s: Option<f64>,
    /// When the first body byte arrived, seconds since `start`.
    first_byte_s: Option<f64>,
    received: u64,
}

impl Flight {
    /// An empty window of `window_bytes` (at least 1) with a request cap of at least
    /// `max_requests` (at least 1), for reads of `mean_read` bytes on average.
    pub(super) fn new(window_bytes: u64, max_requests: usize, mean_read: f64) -> Self {
        Flight {
            st: Mutex::new(FlightState::default()),
            changed: tokio::sync::Notify::new(),
            window: window_bytes.max(1),
            max_requests: max_requests.max(1),
            mean_read,
            start: std::time::Instant::now(),
        }
    }

    /// Twice the bandwidth-delay product measured by `now` (seconds since `start`), bytes,
    /// at most `window_bytes`.
    fn target(&self, st: &FlightState, now: f64) -> f64 {
        let bdp = match (st.min_rtt_s, st.first_byte_s) {
            // The rate over at least one round trip: a burst that was in flight together
            // does not read as a fast link (so the target at most doubles per round trip).
            (Some(rtt), Some(t0)) => st.received as f64 / (now - t0).max(rtt).max(1e-6) * rtt,
            _ => 0.0,
        };
        (2.0 * bdp).min(self.window as f64)
    }

    /// Requests in flight at most, first-layer reads aside.
    fn cap(&self, target: f64) -> usize {
        self.max_requests
            .max((target / self.mean_read.max(1.0)).ceil() as usize)
    }

    /// Bytes in flight at most (one larger read goes alone).
    fn limit(&self, target: f64) -> u64 {
        (target as u64).max(BASE_WINDOW_BYTES).min(self.window)
    }

    /// Waits until a read of `n` bytes may go out, and counts it in flight.
    pub(super) async fn admit(
        self: &Arc<Self>,
        n: u64,
        first_layer: bool,
        sh: &LoadShared,
    ) -> FlightPermit {
        loop {
            let notified = self.changed.notified();
            {
                let mut st = self.st.lock().expect("lock");
                let target = self.target(&st, self.start.elapsed().as_secs_f64());
                let fits = st.bytes == 0 || st.bytes + n <= self.limit(target);
                if fits
                    && st.requests < MAX_REQUESTS_IN_FLIGHT
                    && (first_layer || st.requests < self.cap(target))
                {
                    st.requests += 1;
                    st.bytes += n;
                    sh.peak_requests
                        .fetch_max(st.requests as u64, Ordering::Relaxed);
                    sh.peak_bytes.fetch_max(st.bytes, Ordering::Relaxed);
                    return FlightPermit {
                        flight: self.clone(),
                        left: n,
                    };
                }
            }
            notified.await;
        }
    }

    pub(super) fn headers(&self, rtt_s: f64) {
        let mut st = self.st.lock().expect("lock");
        st.min_rtt_s = Some(st.min_rtt_s.map_or(rtt_s, |m| m.min(rtt_s)));
    }

    /// Waits until no read is in flight.
    pub(super) async fn drained(&self) {
        loop {
            let notified = self.changed.notified();
            if self.st.lock().expect("lock").requests == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// One read in flight; received bytes leave the window as they arrive, the rest when it
/// ends (or is dropped: failed, cancelled, aborted).
pub(super) struct FlightPermit {
    pub(super) flight: Arc<Flight>,
    left: u64,
}

impl FlightPermit {
    pub(super) fn received(&mut self, n: u64) {
        let n = n.min(self.left);
        self.left -= n;
        let f = &self.flight;
        let mut st = f.st.lock().expect("lock");
        if st.first_byte_s.is_none() {
            st.first_byte_s = Some(f.start.elapsed().as_secs_f64());
        }
        st.received += n;
        st.bytes -= n;
        drop(st);
        f.changed.notify_one();
    }
}

impl Drop for FlightPermit {
    fn drop(&mut self) {
        let f = &self.flight;
        let mut st =
            f.st.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.requests -= 1;
        st.bytes -= self.left;
        drop(st);
        f.changed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte limit starts at the base, follows twice the measured bandwidth-delay product
    /// above it, and stops at `window_bytes`; the request cap follows the same target.
    #[test]
    fn limit_follows_measured_product_within_window() {
        let mib = 1u64 << 20;
        let f = Flight::new(1 << 30, 32, (4 * mib) as f64);
        let mut st = FlightState::default();
        // Nothing measured yet: the base, and `max_requests`.
        assert_eq!(f.limit(f.target(&st, 0.0)), BASE_WINDOW_BYTES);
        assert_eq!(f.cap(f.target(&st, 0.0)), 32);
        // A 1 ms round trip at 2.5 GB/s: the product (2.5 MB) is far below the base.
        st.min_rtt_s = Some(0.001);
        st.first_byte_s = Some(0.0);
        st.received = 250_000_000;
        assert_eq!(f.limit(f.target(&st, 0.1)), BASE_WINDOW_BYTES);
        assert_eq!(f.cap(f.target(&st, 0.1)), 32);
        // A 100 ms round trip at 2.5 GB/s: twice the product is 500 MB.
        st.min_rtt_s = Some(0.1);
        assert_eq!(f.limit(f.target(&st, 0.1)), 500_000_000);
        // ceil(500 MB / 4 MiB) requests.
        assert_eq!(f.cap(f.target(&st, 0.1)), 120);
        // A 500 ms round trip at 2.5 GB/s: the window bounds both.
        st.min_rtt_s = Some(0.5);
        st.received = 1_250_000_000;
        assert_eq!(f.limit(f.target(&st, 0.5)), 1 << 30);
        assert_eq!(f.cap(f.target(&st, 0.5)), 256);
        // A window below the base is the limit from the start.
        let small = Flight::new(8 * mib, 32, mib as f64);
        assert_eq!(
            small.limit(small.target(&FlightState::default(), 0.0)),
            8 * mib
        );
    }
}
