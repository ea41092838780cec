//! Layer-ordered load over a plain object store (stock S3 path): ranged GETs issued in layer
//! order within a bounded look-ahead window, each body streamed straight into the caller's
//! destination and verified slice by slice.

use super::buffers::{LayerBuffers, LayerStatus, LoadState};
use super::status::{chunk_status_of, ChunkStatus};
use crate::error::{LayerError, StoreError};
use crate::layout::{
    object_len, plan_layer_major, ChunkHash, ChunkHeader, KeyBuilder, KvGeometry, RangeRead,
    HEADER_LEN, SLICE_CRC_LEN,
};
use crate::link::Link;
use crate::protocol::SchedHints;
use crate::store::{GetOptions, Store};
use futures::StreamExt;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What to load.
///
/// `LoadRequest::new(geometry, hashes)` (or a literal with `hints: Default::default()`) asks
/// for a load without scheduling inputs; [`LoadRequest::with_layer_compute_s`],
/// [`LoadRequest::with_layer_deadlines_s`] and [`LoadRequest::with_priority`] add them.
#[derive(Debug, Clone)]
pub struct LoadRequest {
    /// Geometry (incl. TP rank) the objects must have been written with.
    pub geometry: KvGeometry,
    /// The chunk hashes of the prefix, in order; every chunk holds `tokens_per_chunk` tokens.
    pub hashes: Vec<ChunkHash>,
    /// When the layers are needed and how urgent the load is: the inputs of the bandwidth
    /// schedulers (the engine's own link on the ranged-GET path, the server's on the gather
    /// path). Default: no timing, priority 128.
    pub hints: LoadHints,
}

impl LoadRequest {
    /// A request for `hashes` written with `geometry`, without scheduling hints.
    pub fn new(geometry: KvGeometry, hashes: Vec<ChunkHash>) -> Self {
        LoadRequest {
            geometry,
            hashes,
            hints: LoadHints::default(),
        }
    }

    /// Sets the per-layer compute time (seconds, one value per layer of the geometry;
    /// compute starts when `load` is called). Checked by `Engine::load`.
    pub fn with_layer_compute_s(mut self, compute_s: Vec<f64>) -> Self {
        self.hints.timing = LayerTiming::ComputeS(compute_s);
        self
    }

    /// Sets the per-layer deadlines (seconds after `load` is called, one value per layer of
    /// the geometry, non-decreasing). Checked by `Engine::load`.
    pub fn with_layer_deadlines_s(mut self, deadlines_s: Vec<f64>) -> Self {
        self.hints.timing = LayerTiming::DeadlinesS(deadlines_s);
        self
    }

    /// Sets the priority (higher first; default 128).
    pub fn with_priority(mut self, priority: u8) -> Self {
        self.hints.priority = priority;
        self
    }
}

/// When a load's layers are needed (the timeline of `docs/scheduling.md`, section 2: layer
/// `l`'s KV is needed when layer `l`'s compute starts).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum LayerTiming {
    /// Unknown: every layer is needed at once.
    #[default]
    None,
    /// The engine's compute time of each layer in seconds (one per layer of the geometry),
    /// compute of layer 0 starting when `load` is called.
    ComputeS(Vec<f64>),
    /// The time each layer is needed, in seconds after `load` is called (one per layer,
    /// non-decreasing).
    DeadlinesS(Vec<f64>),
}

/// Scheduling inputs of a load (see [`LoadRequest::hints`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadHints {
    /// When the layers are needed.
    pub timing: LayerTiming,
    /// Priority, higher first (0..=255; default 128). Sent to a gather server, whose
    /// `priority` scheduler admits loads in this order; the bandwidth policies of the links
    /// use the timing only.
    pub priority: u8,
}

impl Default for LoadHints {
    fn default() -> Self {
        LoadHints {
            timing: LayerTiming::None,
            priority: 128,
        }
    }
}

/// Largest time a hint can carry: the wire's `u32` microseconds (about 71.6 minutes).
const MAX_HINT_S: f64 = u32::MAX as f64 * 1e-6;

/// Largest token count [`LoadHandle::stall_advice`] accepts for the prefix or the new tokens:
/// 2^26 = 67,108,864 tokens, far beyond any context window, so the compute model's sums stay
/// exact and nonsense inputs are refused rather than answered.
pub const MAX_ADVICE_TOKENS: u64 = 1 << 26;

impl LoadHints {
    /// Checks the timing against a geometry of `layers` layers.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] naming the problem: a vector whose length is not
    /// `layers`, a value that is negative, not finite or above `u32::MAX` microseconds, or
    /// deadlines that decrease.
    pub fn validate(&self, layers: u32) -> Result<(), crate::Error> {
        let (what, v) = match &self.timing {
            LayerTiming::None => return Ok(()),
            LayerTiming::ComputeS(v) => ("layer compute times", v),
            LayerTiming::DeadlinesS(v) => ("layer deadlines", v),
        };
        let bad = |m: String| Err(crate::Error::InvalidArgument(format!("load hints: {m}")));
        if v.len() != layers as usize {
            return bad(format!(
                "{} {what} given, the geometry has {layers} layers",
                v.len()
            ));
        }
        if let Some((l, x)) = v
            .iter()
            .enumerate()
            .find(|(_, x)| !x.is_finite() || **x < 0.0 || **x > MAX_HINT_S)
        {
            return bad(format!(
                "{what}: layer {l} has {x} s (need a finite value in 0..={MAX_HINT_S:.0} s)"
            ));
        }
        if matches!(self.timing, LayerTiming::DeadlinesS(_)) {
            if let Some(l) = (1..v.len()).find(|&l| v[l] < v[l - 1]) {
                return bad(format!(
                    "layer deadlines decrease at layer {l} ({} s after {} s)",
                    v[l],
                    v[l - 1]
                ));
            }
        }
        Ok(())
    }

    /// The wire form (microseconds, rounded), as the link schedulers and gather servers take
    /// it. Values are clamped to `0..=u32::MAX` microseconds ([`LoadHints::validate`]
    /// rejects anything outside).
    pub fn sched_hints(&self) -> SchedHints {
        let us = |v: &[f64]| {
            v.iter()
                .map(|s| (s * 1e6).round().clamp(0.0, u32::MAX as f64) as u32)
                .collect()
        };
        match &self.timing {
            LayerTiming::None => SchedHints::None,
            LayerTiming::ComputeS(v) => SchedHints::LayerComputeUs(us(v)),
            LayerTiming::DeadlinesS(v) => SchedHints::LayerDeadlinesUs(us(v)),
        }
    }
}

/// Counters of one load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadStats {
    /// Storage requests issued: ranged GETs, or one gather request per stream of a gather
    /// load (`EngineConfig::gather_streams`, at most one per chunk).
    pub requests: u64,
    /// Payload bytes received.
    pub bytes: u64,
    /// Seconds from `load` to layer 0 ready (time to first layer), if it became ready.
    pub ttfl_s: Option<f64>,
    /// Seconds from `load` to the last layer ready, if every layer became ready.
    pub ttll_s: Option<f64>,
    /// Times a gather stream continued on another gateway after its gateway failed in the
    /// middle of the load (a store over several gateways; see `docs/deployment.md`).
    pub failovers: u64,
    /// Most storage requests this load had in flight at once (ranged-GET path; 0 on the
    /// gather path).
    pub peak_requests_in_flight: u64,
    /// Most bytes this load's requests had asked for and not yet received at once
    /// (ranged-GET path; 0 on the gather path). At most `window_bytes`, except that one read
    /// larger than the window goes alone.
    pub peak_bytes_in_flight: u64,
}

pub(crate) struct Shared {
    pub(crate) state: LoadState,
    pub(crate) chunk_status: Vec<AtomicU8>,
    pub(crate) requests: AtomicU64,
    /// Gather streams that failed over to another gateway.
    pub(crate) failovers: AtomicU64,
    pub(crate) tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Peaks of the ranged-GET path's requests and bytes in flight.
    pub(crate) peak_requests: AtomicU64,
    pub(crate) peak_bytes: AtomicU64,
    /// Ranged-GET path: per chunk, whether its header was checked (`HEADER_UNKNOWN`,
    /// `HEADER_OK`, `HEADER_BAD`); a read of later layers completes none of them before the
    /// chunk's header is known good.
    headers: Vec<AtomicU8>,
    header_known: tokio::sync::Notify,
    /// What arrived when, for the stall watchdog.
    pub(crate) progress: Progress,
    /// Per (chunk, layer), `chunk * layers + layer`: the CRC32C the slice was verified with
    /// (`1 << 32 | crc`), `2 << 32` when the slice is in place and was checked by the server
    /// but no CRC is known here (an RDMA write), or 0 while not in place. Followers of this
    /// load check their copies against the CRC (`flight.rs`).
    slice_crcs: Vec<AtomicU64>,
    layers: usize,
    /// Bytes of one chunk's slice of one layer (a layer's destination is `chunks x
    /// slice_bytes`).
    #[cfg(feature = "rdma")]
    pub(crate) slice_bytes: u64,
    /// Set by [`LoadHandle::into_buffers`]: where the last reference's drop hands the
    /// buffers back.
    give_back: Mutex<Option<std::sync::mpsc::SyncSender<LayerBuffers>>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(tx) = self.give_back.get_mut().expect("lock").take() {
            let bufs = std::mem::replace(&mut self.state.bufs, LayerBuffers::from_vecs(Vec::new()));
            // The receiver waits in `into_buffers` until this send.
            let _ = tx.send(bufs);
        }
    }
}

/// A load's progress, for its stall watchdog ([`watchdog`]): when something last arrived,
/// payload bytes so far and since when, and how many deliberate holds are in force (a load
/// the engine's own link holds back, or a transport whose progress is not observed).
pub(crate) struct Progress {
    t0: std::time::Instant,
    /// Microseconds since `t0` of the last arrival (or hold's end).
    last_us: AtomicU64,
    /// Microseconds since `t0` of the first payload byte; `u64::MAX` before it.
    first_us: AtomicU64,
    /// Microseconds since `t0` of the last payload byte.
    last_byte_us: AtomicU64,
    bytes: AtomicU64,
    holds: std::sync::atomic::AtomicUsize,
}

impl Progress {
    fn new() -> Self {
        Progress {
            t0: std::time::Instant::now(),
            last_us: AtomicU64::new(0),
            first_us: AtomicU64::new(u64::MAX),
            last_byte_us: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            holds: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn now_us(&self) -> u64 {
        self.t0.elapsed().as_micros() as u64
    }

    /// `bytes` arrived now (0: a sign of life without data).
    pub(crate) fn arrived(&self, bytes: u64) {
        let now = self.now_us();
        self.last_us.fetch_max(now, Ordering::AcqRel);
        if bytes > 0 {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
            self.last_byte_us.fetch_max(now, Ordering::AcqRel);
            let _ =
                self.first_us
                    .compare_exchange(u64::MAX, now, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Payload bytes arrived so far.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Holds the watchdog off until the guard drops (the load waits on purpose); the
    /// silence then counts from the hold's end.
    pub(crate) fn hold(&self) -> Hold<'_> {
        self.holds.fetch_add(1, Ordering::AcqRel);
        Hold(self)
    }
}

/// A deliberate hold of a load's watchdog ([`Progress::hold`]).
pub(crate) struct Hold<'a>(&'a Progress);

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.0.arrived(0);
        self.0.holds.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The stall limit now, under `setting`, for a load whose largest single read or unit is
/// `unit_bytes` (`None`: no watchdog).
fn stall_limit(
    setting: super::StallTimeout,
    p: &Progress,
    now_us: u64,
    unit_bytes: u64,
) -> Option<Duration> {
    match setting {
        super::StallTimeout::Off => None,
        super::StallTimeout::After(d) => Some(d),
        super::StallTimeout::Auto => {
            let first = p.first_us.load(Ordering::Acquire);
            if first == u64::MAX {
                return Some(super::STALL_FIRST_BYTE);
            }
            // The rate while bytes arrived: up to the last byte, not up to now (silence must
            // not lower the rate, or the limit would grow with the silence).
            let last = p.last_byte_us.load(Ordering::Acquire).min(now_us);
            let secs = (last.saturating_sub(first) as f64 * 1e-6).max(1e-3);
            let rate = p.bytes.load(Ordering::Relaxed) as f64 / secs;
            let next = 4.0 * unit_bytes as f64 / rate.max(1.0);
            Some(super::STALL_FLOOR.max(Duration::from_secs_f64(next.min(3600.0))))
        }
    }
}

/// The per-load progress watchdog: once nothing has arrived for longer than the stall limit
/// ([`super::StallTimeout`]) while the load is not held on purpose, every layer not ready yet
/// fails at once with [`LayerError::Stalled`] naming `store`, and the load's reads stop
/// (the layers' status and [`LoadHandle::stall_advice`] then say what to recompute). Ends
/// when every layer is ready or failed. Spawned with the load, as one of its tasks.
pub(crate) async fn watchdog(
    sh: Arc<Shared>,
    setting: super::StallTimeout,
    unit_bytes: u64,
    store: String,
) {
    let p = &sh.progress;
    loop {
        if (0..sh.state.layers()).all(|l| sh.state.status(l) != LayerStatus::Pending) {
            return;
        }
        let now = p.now_us();
        let Some(limit) = stall_limit(setting, p, now, unit_bytes) else {
            return;
        };
        let idle = Duration::from_micros(now.saturating_sub(p.last_us.load(Ordering::Acquire)));
        if p.holds.load(Ordering::Acquire) > 0 {
            tokio::time::sleep(limit).await;
            continue;
        }
        if idle < limit {
            // An automatic limit changes as bytes arrive (3 s before the first, then from the
            // rate): look again at least every 100 ms so the new limit is kept to.
            let mut wait = limit - idle;
            if setting == super::StallTimeout::Auto {
                wait = wait.min(Duration::from_millis(100));
            }
            tokio::time::sleep(wait).await;
            continue;
        }
        tracing::warn!(%store, idle_ms = idle.as_millis() as u64, limit_ms = limit.as_millis() as u64, "load stalled: its missing layers fail now");
        sh.state.fail_pending(LayerError::Stalled {
            idle_ms: idle.as_millis() as u64,
            limit_ms: limit.as_millis() as u64,
            store,
        });
        sh.state.cancel();
        let me = tokio::task::try_id();
        for t in sh.tasks.lock().expect("lock").iter() {
            if Some(t.id()) != me {
                t.abort();
            }
        }
        return;
    }
}

const HEADER_UNKNOWN: u8 = 0;
const HEADER_OK: u8 = 1;
const HEADER_BAD: u8 = 2;

impl Shared {
    pub(crate) fn new(bufs: LayerBuffers, expected: u64, chunks: usize) -> Self {
        let layers = bufs.layers();
        Shared {
            slice_crcs: (0..chunks * layers).map(|_| AtomicU64::new(0)).collect(),
            layers,
            #[cfg(feature = "rdma")]
            slice_bytes: expected / chunks.max(1) as u64,
            state: LoadState::new(bufs, expected),
            chunk_status: (0..chunks).map(|_| AtomicU8::new(0)).collect(),
            requests: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            tasks: Mutex::new(Vec::new()),
            peak_requests: AtomicU64::new(0),
            peak_bytes: AtomicU64::new(0),
            headers: (0..chunks).map(|_| AtomicU8::new(HEADER_UNKNOWN)).collect(),
            header_known: tokio::sync::Notify::new(),
            progress: Progress::new(),
            give_back: Mutex::new(None),
        }
    }

    /// Records that chunk `c`'s slice of layer `l` was verified with CRC32C `crc`.
    pub(crate) fn record_slice_crc(&self, c: usize, l: usize, crc: u32) {
        if let Some(a) = self.slice_crcs.get(c * self.layers + l) {
            a.store(1 << 32 | crc as u64, Ordering::Release);
        }
    }

    /// Records that chunk `c`'s slice of layer `l` is in place and was checked before it was
    /// sent, with no CRC known here (an RDMA write); a recorded CRC is kept.
    #[cfg(feature = "rdma")]
    pub(crate) fn record_slice_landed(&self, c: usize, l: usize) {
        if let Some(a) = self.slice_crcs.get(c * self.layers + l) {
            let _ = a.compare_exchange(0, 2 << 32, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Whether chunk `c`'s slice of layer `l` is in place and verified (its CRC known or not).
    pub(crate) fn slice_in_place(&self, c: usize, l: usize) -> bool {
        self.slice_crcs
            .get(c * self.layers + l)
            .is_some_and(|a| a.load(Ordering::Acquire) != 0)
    }

    /// The CRC32C chunk `c`'s slice of layer `l` was verified with, if known.
    pub(crate) fn slice_crc(&self, c: usize, l: usize) -> Option<u32> {
        let v = self
            .slice_crcs
            .get(c * self.layers + l)?
            .load(Ordering::Acquire);
        (v >> 32 == 1).then_some(v as u32)
    }

    /// Records whether chunk `c`'s header was read and matched (once; later calls are ignored).
    fn set_header(&self, c: usize, ok: bool) {
        let v = if ok { HEADER_OK } else { HEADER_BAD };
        let _ = self.headers[c].compare_exchange(
            HEADER_UNKNOWN,
            v,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        self.header_known.notify_waiters();
    }

    /// Waits until chunk `c`'s header is known; `true` if it matched the request.
    async fn header_ok(&self, c: usize) -> bool {
        loop {
            let known = self.header_known.notified();
            tokio::pin!(known);
            known.as_mut().enable();
            match self.headers[c].load(Ordering::Acquire) {
                HEADER_OK => return true,
                HEADER_BAD => return false,
                _ => known.await,
            }
        }
    }

    /// Sets a chunk's status unless it already holds a failure.
    pub(crate) fn set_chunk(&self, c: usize, s: ChunkStatus) {
        if let Some(a) = self.chunk_status.get(c) {
            let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
                (old == ChunkStatus::Pending as u8
                    || (old == ChunkStatus::Ok as u8 && s != ChunkStatus::Ok))
                    .then_some(s as u8)
            });
        }
    }

    pub(crate) fn chunk(&self, c: usize) -> ChunkStatus {
        ChunkStatus::from_u8(self.chunk_status[c].load(Ordering::Acquire))
    }
}

/// Maps a store error on chunk `c` to its chunk status and layer error.
fn classify(c: usize, key: &str, e: &StoreError) -> (ChunkStatus, LayerError) {
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

/// Bytes a ranged read moves: its range, with the header for a layer-0 read.
fn read_len(r: &RangeRead) -> u64 {
    if r.layers.start == 0 {
        r.bytes.end
    } else {
        r.bytes.end - r.bytes.start
    }
}

/// Requests and bytes in flight of one ranged-GET load, and what it has measured of the
/// path: the shortest time to response headers (the round trip, plus the server's time) and
/// the bytes received since the first one arrived (the delivery rate).
///
/// A read may go out when the bytes in flight stay within `window_bytes` (one read larger
/// than the window goes alone) and, except for first-layer reads, the requests in flight
/// stay below the request cap: `max(max_requests, ceil(target / mean read))`, where the
/// target is twice the measured bandwidth-delay product (rate x shortest round trip; the
/// rate is the bytes received since the first one over at least one round trip), bounded
/// by `window_bytes`. On a short round trip the cap is `max_requests`; on a long one
/// it grows with each round trip's deliveries until the bytes in flight cover the product
/// (or fill the window). First-layer reads (one per chunk) all go out at once within the
/// window: layer 0 is needed first, so its reads gain nothing from waiting, and a long
/// round trip is paid once for all of them.
struct Flight {
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
    fn cap(&self, st: &FlightState) -> usize {
        let now = self.start.elapsed().as_secs_f64();
        let bdp = match (st.min_rtt_s, st.first_byte_s) {
            // The rate over at least one round trip: a burst that was in flight together
            // does not read as a fast link (so the target at most doubles per round trip).
            (Some(rtt), Some(t0)) => st.received as f64 / (now - t0).max(rtt).max(1e-6) * rtt,
            _ => 0.0,
        };
        let target = (2.0 * bdp).min(self.window as f64);
        self.max_requests
            .max((target / self.mean_read.max(1.0)).ceil() as usize)
    }

    /// Waits until a read of `n` bytes may go out, and counts it in flight.
    async fn admit(self: &Arc<Self>, n: u64, first_layer: bool, sh: &Shared) -> FlightPermit {
        loop {
            let notified = self.changed.notified();
            {
                let mut st = self.st.lock().expect("lock");
                let fits = st.bytes == 0 || st.bytes + n <= self.window;
                if fits && (first_layer || st.requests < self.cap(&st)) {
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

    fn headers(&self, rtt_s: f64) {
        let mut st = self.st.lock().expect("lock");
        st.min_rtt_s = Some(st.min_rtt_s.map_or(rtt_s, |m| m.min(rtt_s)));
    }

    /// Waits until no read is in flight.
    async fn drained(&self) {
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
struct FlightPermit {
    flight: Arc<Flight>,
    left: u64,
}

impl FlightPermit {
    fn received(&mut self, n: u64) {
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
        let mut st = f.st.lock().expect("lock");
        st.requests -= 1;
        st.bytes -= self.left;
        drop(st);
        f.changed.notify_one();
    }
}

/// Runs the stock-S3 layer-ordered load to completion (or failure of every pending layer).
///
/// Under the engine's `link` (a bandwidth cap) the load registers its bytes per layer and
/// hints, reads one layer slice per request in layer-major order, and issues each read once
/// its credit covers the read's bytes; it leaves the link when every read is issued, or when
/// the load is cancelled, times out or is dropped (the future, and its `LinkLoad`, dropped).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_store_load(
    store: Arc<dyn Store>,
    keys: KeyBuilder,
    req: LoadRequest,
    sh: Arc<Shared>,
    window_bytes: u64,
    max_requests: usize,
    coalesce_bytes: u64,
    link: Option<Arc<Link>>,
) {
    let g = &req.geometry;
    let slice = g.slice_bytes();
    let tokens = g.tokens_per_chunk;
    let full_len = object_len(g.layers, slice);
    // Paced reads are single layer slices so that layers land in the order the link plans.
    let coalesce = if link.is_some() { 0 } else { coalesce_bytes };
    let plan = plan_layer_major(req.hashes.len(), g.layers, slice, coalesce);
    let paced = link.and_then(|link| {
        let mut per_layer = vec![0u64; g.layers as usize];
        for r in &plan {
            per_layer[r.layers.start as usize] += read_len(r);
        }
        link.register(per_layer, &req.hints.sched_hints())
            .map_err(|e| tracing::warn!(error = %e, "load not paced by the engine's link"))
            .ok()
    });
    let mean_read = if plan.is_empty() {
        1.0
    } else {
        plan.iter().map(read_len).sum::<u64>() as f64 / plan.len() as f64
    };
    let flight = Arc::new(Flight {
        st: Mutex::new(FlightState::default()),
        changed: tokio::sync::Notify::new(),
        window: window_bytes.max(1),
        max_requests: max_requests.max(1),
        mean_read,
        start: std::time::Instant::now(),
    });
    for read in plan {
        if sh.state.is_cancelled() {
            break;
        }
        let c = read.chunk;
        if matches!(
            sh.chunk(c),
            ChunkStatus::Missing | ChunkStatus::WrongGeometry
        ) {
            // This chunk is unusable (no object, or another geometry): all its layers are
            // failed; don't read more of it (the link counts the bytes as done, so the load's
            // later layers can complete). A corrupt or unreadable slice fails only its own
            // layers: the chunk's other layers are still read.
            if let Some(p) = &paced {
                p.sent(read_len(&read));
            }
            continue;
        }
        if let Some(p) = &paced {
            // Issued when a fluid transfer at the allocated rate would have finished it. The
            // link holds the load on purpose meanwhile: not a stall.
            let n = read_len(&read);
            let _held = sh.progress.hold();
            p.pace(n).await;
            p.sent(n);
        }
        // Layer 0's read also fetches the header, so geometry is checked before any byte lands.
        let with_header = read.layers.start == 0;
        let range = if with_header {
            0..read.bytes.end
        } else {
            read.bytes.clone()
        };
        let permit = flight
            .admit(range.end - range.start, with_header, &sh)
            .await;
        let store = store.clone();
        let key = keys.data(&req.hashes[c]);
        let sh2 = sh.clone();
        let g = g.clone();
        let task = tokio::spawn(async move {
            let mut permit = permit;
            sh2.requests.fetch_add(1, Ordering::Relaxed);
            let r = fetch_range(
                &*store,
                &key,
                range,
                c,
                read.layers.clone(),
                with_header,
                &g,
                tokens,
                full_len,
                &sh2,
                &mut permit,
            )
            .await;
            if let Err(f) = r {
                sh2.set_chunk(c, f.status);
                // The layers this failure touches are misses (every layer when the chunk is
                // unusable); the chunk's other layers and the other chunks are unaffected.
                for l in f.layers {
                    sh2.state.fail_impl(l, f.err.clone());
                }
            }
        });
        sh.tasks.lock().expect("lock").push(task);
    }
    // Every read is issued: the load leaves the link.
    drop(paced);
    // Every read holds its permit until it ends.
    flight.drained().await;
    for c in 0..req.hashes.len() {
        sh.set_chunk(c, ChunkStatus::Ok);
    }
}

/// A failed ranged read: the chunk status it implies, the layer error, and the layers it
/// fails (all of the chunk's when the object is missing or of another geometry; otherwise
/// only the layers of this read that did not arrive verified).
struct ReadFailure {
    status: ChunkStatus,
    err: LayerError,
    layers: std::ops::Range<u32>,
}

/// Reads `range` of chunk `chunk`'s object (layers `layers`, with the header when
/// `with_header`) straight into the destination, verifying each slice's CRC32C. A slice whose
/// CRC does not match fails its layer only (named in the chunk status) and the read goes on
/// with the next slice; a later layer's slice completes only once the chunk's header (read
/// with layer 0) matched the request.
#[allow(clippy::too_many_arguments)]
async fn fetch_range(
    store: &dyn Store,
    key: &str,
    range: std::ops::Range<u64>,
    chunk: usize,
    layers: std::ops::Range<u32>,
    with_header: bool,
    g: &KvGeometry,
    tokens: u32,
    full_len: u64,
    sh: &Shared,
    permit: &mut FlightPermit,
) -> Result<(), ReadFailure> {
    let r = fetch_range_inner(
        store,
        key,
        range,
        chunk,
        layers,
        with_header,
        g,
        tokens,
        full_len,
        sh,
        permit,
    )
    .await;
    if with_header {
        // The header is known by now unless the read failed before it arrived: then the
        // chunk's geometry cannot be checked, and its other layers are not trusted.
        sh.set_header(chunk, false);
    }
    r
}

#[allow(clippy::too_many_arguments)]
async fn fetch_range_inner(
    store: &dyn Store,
    key: &str,
    range: std::ops::Range<u64>,
    chunk: usize,
    layers: std::ops::Range<u32>,
    with_header: bool,
    g: &KvGeometry,
    tokens: u32,
    full_len: u64,
    sh: &Shared,
    permit: &mut FlightPermit,
) -> Result<(), ReadFailure> {
    let all = 0..g.layers;
    let fail = |status, err, layers| ReadFailure {
        status,
        err,
        layers,
    };
    let geometry = |reason: String| {
        fail(
            ChunkStatus::WrongGeometry,
            LayerError::GeometryMismatch { chunk, reason },
            all.clone(),
        )
    };
    let slice = g.slice_bytes();
    let sent = std::time::Instant::now();
    let res = store
        .get_opts(
            key,
            GetOptions {
                range: Some(range.clone()),
            },
        )
        .await
        .map_err(|e| {
            let (status, err) = classify(chunk, key, &e);
            // No object, or too short for this geometry: the whole chunk; a storage error
            // (after the store's retries): this read's layers.
            let touched = match status {
                ChunkStatus::Missing | ChunkStatus::WrongGeometry => all.clone(),
                _ => layers.clone(),
            };
            fail(status, err, touched)
        })?;
    permit.flight.headers(sent.elapsed().as_secs_f64());
    if res.meta.size != full_len {
        return Err(geometry(format!(
            "object {key} has {} bytes, expected {full_len} for this geometry",
            res.meta.size
        )));
    }
    let mut body = res.body;
    // Demultiplex the body: [header] then per layer [slice bytes][crc32c].
    let mut header = Vec::with_capacity(if with_header { HEADER_LEN as usize } else { 0 });
    let mut layer = layers.start;
    let mut in_slice: u64 = 0; // bytes of the current slice consumed
    let mut crc: u32 = 0;
    let mut trailer = [0u8; 4];
    let mut tn = 0usize;
    let dest_off = chunk as u64 * slice;
    let mut received: u64 = 0;
    // The current slice's layer was already failed by another chunk: its bytes are dropped.
    let mut unneeded = false;
    // This read's layers from `l` on did not arrive.
    let rest = |l: u32, status, err| fail(status, err, l..layers.end);
    while let Some(piece) = body.next().await {
        if sh.state.is_cancelled() {
            return Err(rest(layer, ChunkStatus::Error, LayerError::Cancelled));
        }
        let piece = piece.map_err(|e| {
            let (_, err) = classify(chunk, key, &e);
            rest(layer, ChunkStatus::Error, err)
        })?;
        sh.progress.arrived(piece.len() as u64);
        received += piece.len() as u64;
        permit.received(piece.len() as u64);
        let mut p: &[u8] = &piece;
        while !p.is_empty() {
            if with_header && header.len() < HEADER_LEN as usize {
                let n = p.len().min(HEADER_LEN as usize - header.len());
                header.extend_from_slice(&p[..n]);
                p = &p[n..];
                if header.len() == HEADER_LEN as usize {
                    let h = ChunkHeader::decode(&header).map_err(|e| geometry(e.to_string()))?;
                    h.check(g, tokens).map_err(|e| geometry(e.to_string()))?;
                    sh.set_header(chunk, true);
                }
                continue;
            }
            if layer >= layers.end {
                return Err(rest(
                    layer,
                    ChunkStatus::Corrupt,
                    LayerError::Storage {
                        chunk,
                        message: format!("body of {key} is longer than the range asked for"),
                    },
                ));
            }
            if in_slice < slice {
                let n = (p.len() as u64).min(slice - in_slice) as usize;
                crc = crate::layout::crc::crc32c_append(crc, &p[..n]);
                if !unneeded {
                    if let Err(e) = sh.state.write_impl(layer, dest_off + in_slice, &p[..n]) {
                        if e == LayerError::Cancelled
                            || !matches!(sh.state.status(layer as usize), LayerStatus::Failed(_))
                        {
                            return Err(rest(layer, ChunkStatus::Error, e));
                        }
                        // Another chunk's slice already failed this layer: this chunk's
                        // slice of it is not needed (and not this chunk's failure); the
                        // read goes on with the next layer.
                        unneeded = true;
                    }
                }
                in_slice += n as u64;
                p = &p[n..];
            } else {
                let n = p.len().min(4 - tn);
                trailer[tn..tn + n].copy_from_slice(&p[..n]);
                tn += n;
                p = &p[n..];
                if tn == 4 {
                    let stored = u32::from_le_bytes(trailer);
                    if unneeded {
                        // Dropped: see above.
                    } else if stored != crc {
                        // This slice is bad: its layer is a miss naming the chunk. The
                        // chunk's next slices in this body are framed alike and still used.
                        sh.set_chunk(chunk, ChunkStatus::Corrupt);
                        sh.state.fail_impl(
                            layer,
                            LayerError::ChecksumMismatch {
                                chunk,
                                layer: layer as usize,
                                stored,
                                computed: crc,
                            },
                        );
                    } else if with_header || sh.header_ok(chunk).await {
                        sh.record_slice_crc(chunk, layer as usize, stored);
                        sh.state.complete_impl(layer, slice);
                    } else {
                        return Err(geometry(format!(
                            "the header of {key} (read with layer 0) did not match or could not be read"
                        )));
                    }
                    layer += 1;
                    in_slice = 0;
                    crc = 0;
                    tn = 0;
                    unneeded = false;
                }
            }
        }
    }
    let want = range.end - range.start;
    if received != want || layer != layers.end {
        return Err(rest(
            layer,
            ChunkStatus::Corrupt,
            LayerError::Storage {
                chunk,
                message: format!("body of {key} was truncated: {received} of {want} bytes"),
            },
        ));
    }
    let _ = SLICE_CRC_LEN;
    Ok(())
}

/// A load in progress: per-layer readiness over the caller's destination buffers.
///
/// Dropping the handle cancels the load and waits for in-flight copies to stop.
pub struct LoadHandle {
    pub(crate) sh: Arc<Shared>,
    pub(crate) rt: tokio::runtime::Handle,
}

impl std::fmt::Debug for LoadHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadHandle")
            .field("layers", &self.layers())
            .finish_non_exhaustive()
    }
}

impl LoadHandle {
    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.sh.state.layers()
    }

    /// Non-blocking status of layer `l`.
    ///
    /// # Panics
    /// If `l >= layers()`.
    pub fn poll_layer(&self, l: usize) -> LayerStatus {
        self.sh.state.status(l)
    }

    /// Waits until layer `l` is ready.
    ///
    /// # Errors
    /// The layer's [`LayerError`] if it is a miss (never bytes).
    pub async fn wait_layer(&self, l: usize) -> Result<(), LayerError> {
        match self.sh.state.wait(l).await {
            LayerStatus::Ready => Ok(()),
            LayerStatus::Failed(e) => Err(e),
            LayerStatus::Pending => unreachable!("wait returns a final status"),
        }
    }

    /// Blocking form of [`LoadHandle::wait_layer`], with an optional timeout.
    ///
    /// # Errors
    /// The layer's error, or [`LayerError::Timeout`] when `timeout` passes first (the load
    /// goes on).
    pub fn wait_layer_blocking(
        &self,
        l: usize,
        timeout: Option<Duration>,
    ) -> Result<(), LayerError> {
        match self.sh.state.wait_blocking(l, timeout) {
            Some(LayerStatus::Ready) => Ok(()),
            Some(LayerStatus::Failed(e)) => Err(e),
            _ => Err(LayerError::Timeout { layer: l }),
        }
    }

    /// Waits for every layer; returns the first error.
    ///
    /// # Errors
    /// The first failed layer's error.
    pub async fn wait_all(&self) -> Result<(), LayerError> {
        for l in 0..self.layers() {
            self.wait_layer(l).await?;
        }
        Ok(())
    }

    /// Blocking form of [`LoadHandle::wait_all`].
    ///
    /// # Errors
    /// The first failed layer's error.
    pub fn wait_all_blocking(&self) -> Result<(), LayerError> {
        for l in 0..self.layers() {
            self.wait_layer_blocking(l, None)?;
        }
        Ok(())
    }

    /// Layer `l`'s bytes (`chunks x slice_len`), only once it is ready, and only when they lie
    /// in one range of memory (always for contiguous buffers; see [`LoadHandle::layer_parts`]
    /// for paged ones).
    pub fn layer(&self, l: usize) -> Option<&[u8]> {
        self.sh.state.ready_bytes(l)
    }

    /// Layer `l`'s bytes (`chunks x slice_len`) once it is ready, as one slice per destination
    /// range they lie in, in order (one slice for a contiguous buffer; for paged buffers, one
    /// per range, the last one cut at the layer's end).
    pub fn layer_parts(&self, l: usize) -> Option<Vec<&[u8]>> {
        self.sh.state.ready_parts(l)
    }

    /// Per-chunk status. Once every layer is ready, every chunk is [`ChunkStatus::Ok`] (each
    /// of its slices arrived and was verified), even if the load's last task has not ended.
    pub fn chunk_status(&self) -> Vec<ChunkStatus> {
        let statuses: Vec<LayerStatus> = (0..self.layers())
            .map(|l| self.sh.state.status(l))
            .collect();
        let all_ready = statuses.iter().all(|s| *s == LayerStatus::Ready);
        // A failed layer's error names the chunk at fault (also on the gather path, where the
        // server reports misses per layer while the stream goes on).
        let mut named: Vec<Option<ChunkStatus>> = vec![None; self.sh.chunk_status.len()];
        for s in &statuses {
            if let LayerStatus::Failed(e) = s {
                if let Some((c, st)) = chunk_status_of(e) {
                    if let Some(slot) = named.get_mut(c) {
                        slot.get_or_insert(st);
                    }
                }
            }
        }
        (0..self.sh.chunk_status.len())
            .map(|c| match self.sh.chunk(c) {
                ChunkStatus::Pending if all_ready => ChunkStatus::Ok,
                ChunkStatus::Pending => named[c].unwrap_or(ChunkStatus::Pending),
                s => s,
            })
            .collect()
    }

    /// The leading chunks of the request whose every slice (each layer's) arrived and was
    /// verified: the hit to use. All of them once every layer is ready; after a miss, the
    /// chunks before the first chunk with a slice missing, bad or not yet arrived. So
    /// `loaded_chunks() x tokens_per_chunk` is exactly the prefix tokens whose KV is in the
    /// destination, verified (never more); the rest is to recompute. (On the TCP gather path
    /// a chunk whose slices came in units of several slices, which happens only for slices
    /// under 4 KiB, counts only once every layer is ready; on the RDMA path every unit's
    /// slices count as they land.)
    pub fn loaded_chunks(&self) -> usize {
        let layers = self.layers();
        if (0..layers).all(|l| self.sh.state.status(l) == LayerStatus::Ready) {
            return self.sh.chunk_status.len();
        }
        (0..self.sh.chunk_status.len())
            .take_while(|&c| (0..layers).all(|l| self.sh.slice_in_place(c, l)))
            .count()
    }

    /// When each layer became ready (landed and verified), in seconds since `load` was
    /// called; `None` for layers not ready (yet).
    pub fn layer_ready_s(&self) -> Vec<Option<f64>> {
        (0..self.layers())
            .map(|l| self.sh.state.ready_at(l).map(|d| d.as_secs_f64()))
            .collect()
    }

    /// Counters so far. `ttfl_s`/`ttll_s` are when layer 0 / the last layer landed and
    /// verified, whether or not anyone waited for them.
    pub fn stats(&self) -> LoadStats {
        let r: Vec<Option<Duration>> = (0..self.layers())
            .map(|l| self.sh.state.ready_at(l))
            .collect();
        LoadStats {
            requests: self.sh.requests.load(Ordering::Relaxed),
            bytes: self.sh.state.verified_bytes(),
            ttfl_s: r.first().copied().flatten().map(|d| d.as_secs_f64()),
            ttll_s: if r.iter().all(|x| x.is_some()) {
                r.iter().flatten().max().map(|d| d.as_secs_f64())
            } else {
                None
            },
            failovers: self.sh.failovers.load(Ordering::Relaxed),
            peak_requests_in_flight: self.sh.peak_requests.load(Ordering::Relaxed),
            peak_bytes_in_flight: self.sh.peak_bytes.load(Ordering::Relaxed),
        }
    }

    /// The planner's deadline fallback for this load, now: keep waiting for the layers still
    /// missing, or cancel the load and recompute from the first missing layer
    /// ([`crate::sched::fallback`]; `docs/scheduling.md`, section 4). Call it when a layer
    /// the engine needs is late (past its deadline): a
    /// [`crate::sched::planner::Fallback::Recompute`] names the first abandoned layer `d` and
    /// the prefix tokens to recompute (through layers `0..d` only to rebuild their hidden
    /// states, whose KV is present, then fully).
    ///
    /// Inputs, all measured on this load: `d` = the first layer not ready; the bytes each
    /// layer `d..` still lacks; the rate so far (verified bytes / seconds since `load`; a load
    /// that moved nothing yet counts as 1 byte/s, so a call before any byte arrived advises
    /// recomputing: call it once a layer is late); when the engine finishes layers `0..d`
    /// given their ready times and `model`'s per-layer times. A layer `d..` that failed (a
    /// miss, or the load was cancelled) never arrives: waiting never finishes
    /// (`wait_finish_s` infinite), so the advice is to recompute. `load_tokens` = the prefix
    /// tokens this load carries (chunks x tokens per chunk), `new_tokens` = the tokens the
    /// prefill computes after them, each at most [`MAX_ADVICE_TOKENS`]. Times in the result
    /// are seconds since `load` (excluding the fixed per-prefill time, equal for both
    /// choices); on a tie the advice is to wait.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] if `model` has another number of layers than the load,
    /// or a token count is above [`MAX_ADVICE_TOKENS`].
    pub fn stall_advice(
        &self,
        model: &crate::sched::ComputeModel,
        load_tokens: u64,
        new_tokens: u64,
    ) -> Result<crate::sched::Fallback, crate::Error> {
        let st = &self.sh.state;
        let n = st.layers();
        if model.layers() != n {
            return Err(crate::Error::InvalidArgument(format!(
                "stall advice: the compute model has {} layers, the load {n}",
                model.layers()
            )));
        }
        if load_tokens > MAX_ADVICE_TOKENS || new_tokens > MAX_ADVICE_TOKENS {
            return Err(crate::Error::InvalidArgument(format!(
                "stall advice: load_tokens {load_tokens} and new_tokens {new_tokens} must each be at most {MAX_ADVICE_TOKENS}"
            )));
        }
        let ready: Vec<f64> = (0..n)
            .map_while(|l| st.ready_at(l).map(|d| d.as_secs_f64()))
            .collect();
        let d = ready.len();
        // A failed layer never arrives: nothing more is expected (rate 0, waiting never ends).
        let failed: Vec<bool> = (d..n)
            .map(|l| matches!(st.status(l), LayerStatus::Failed(_)))
            .collect();
        let stuck = failed.contains(&true);
        let compute: Vec<f64> = (0..d)
            .map(|l| model.layer_time(l, new_tokens, load_tokens))
            .collect();
        let now = st.elapsed().as_secs_f64();
        let s = crate::sched::StallState {
            load_tokens,
            compute_tokens: new_tokens,
            layers_delivered: d,
            // (A failed layer counts as missing at least a byte, even if every byte landed:
            // it will never be ready.)
            missing_layer_bytes: (d..n)
                .zip(&failed)
                .map(|(l, &f)| {
                    let m = st.expected().saturating_sub(st.layer_verified(l));
                    if f {
                        m.max(1)
                    } else {
                        m
                    }
                })
                .collect(),
            frontier_s: crate::sched::timeline::finish_time(0.0, &ready, &compute),
            rate: if stuck {
                0.0
            } else {
                (st.verified_bytes() as f64 / now.max(1e-9)).max(1.0)
            },
        };
        Ok(crate::sched::fallback(model, now, &s))
    }

    /// Cancels outstanding reads; layers not yet ready fail with [`LayerError::Cancelled`].
    pub fn cancel(&self) {
        self.sh.state.cancel();
        for t in self.sh.tasks.lock().expect("lock").iter() {
            t.abort();
        }
    }

    /// Cancels what is outstanding, waits until no task can touch the buffers, and returns
    /// them (ready layers hold verified bytes; others hold unspecified bytes).
    pub fn into_buffers(self) -> LayerBuffers {
        self.finish();
        // Every task of the load has ended; what may still hold the state for a moment is an
        // RDMA completion thread finishing its last report (it called `complete` on the
        // layer, and drops its reference right after), never anything that writes, or a
        // load following this one (`flight.rs`) finishing the copy in progress (it lets go
        // as soon as it sees the cancel). Whichever reference goes last hands the buffers
        // back from its drop (`Drop for Shared`).
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        *self.sh.give_back.lock().expect("lock") = Some(tx);
        drop(self);
        rx.recv()
            .expect("the load's state hands its buffers back when its last reference drops")
    }

    /// Stops every task of this load and waits for them (also run on drop).
    fn finish(&self) {
        if self
            .sh
            .tasks
            .lock()
            .expect("lock")
            .iter()
            .all(|t| t.is_finished())
        {
            self.sh.tasks.lock().expect("lock").clear();
            return;
        }
        self.sh.state.cancel();
        let sh = self.sh.clone();
        let wait = async move {
            // The first batch holds the driver task; once it has ended no read is added.
            loop {
                let tasks: Vec<_> = std::mem::take(&mut *sh.tasks.lock().expect("lock"));
                if tasks.is_empty() {
                    break;
                }
                for t in &tasks {
                    t.abort();
                }
                for t in tasks {
                    let _ = t.await;
                }
            }
        };
        let rt = self.rt.clone();
        // Wait without blocking a runtime worker when called from async code.
        match tokio::runtime::Handle::try_current() {
            Ok(_) => std::thread::scope(|s| {
                s.spawn(|| rt.block_on(wait));
            }),
            Err(_) => rt.block_on(wait),
        }
    }
}

impl Drop for LoadHandle {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_are_checked_and_become_microseconds() {
        let g = KvGeometry::smollm2_135m();
        let n = g.layers as usize;
        let r = LoadRequest::new(g.clone(), vec![]);
        assert_eq!(r.hints, LoadHints::default());
        assert_eq!(r.hints.priority, 128);
        assert_eq!(r.hints.sched_hints(), SchedHints::None);
        let r = r.with_layer_compute_s(vec![0.0015; n]).with_priority(7);
        r.hints.validate(g.layers).unwrap();
        assert_eq!(r.hints.priority, 7);
        assert_eq!(
            r.hints.sched_hints(),
            SchedHints::LayerComputeUs(vec![1500; n])
        );
        let d: Vec<f64> = (0..n).map(|l| l as f64 * 0.01).collect();
        let r = r.with_layer_deadlines_s(d);
        r.hints.validate(g.layers).unwrap();
        let SchedHints::LayerDeadlinesUs(us) = r.hints.sched_hints() else {
            panic!("deadlines expected")
        };
        assert_eq!(
            (us[0], us[1], us[n - 1]),
            (0, 10_000, (n as u32 - 1) * 10_000)
        );
        for (timing, needle) in [
            (
                LayerTiming::ComputeS(vec![0.001; n - 1]),
                "the geometry has 30 layers",
            ),
            (LayerTiming::ComputeS(vec![f64::NAN; n]), "layer 0"),
            (LayerTiming::ComputeS(vec![-1.0; n]), "layer 0"),
            (LayerTiming::DeadlinesS(vec![1e9; n]), "layer 0"),
            (
                LayerTiming::DeadlinesS((0..n).map(|l| if l == 3 { 0.0 } else { 1.0 }).collect()),
                "decrease at layer 3",
            ),
        ] {
            let h = LoadHints {
                timing,
                priority: 128,
            };
            let e = h.validate(g.layers).unwrap_err().to_string();
            assert!(e.contains("load hints") && e.contains(needle), "{e}");
        }
    }
}
