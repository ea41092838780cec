//! The gather path of a load: one request to an ObjectCache server, which streams every
//! layer's slices layer-major into the load's destination. Used when the store's endpoint
//! offers gather ([`crate::store::Store::gather_target`] plus one capabilities probe per
//! engine, [`offered`]); otherwise, or
//! when the server cannot be reached, the load falls back to ranged GETs.

use super::load::{LoadRequest, Shared};
use super::status::ChunkStatus;
use crate::error::LayerError;
use crate::layout::KeyBuilder;
use crate::protocol::{ChunkKeys, GatherRequest, LoadGroup, ServerInfo};
use crate::store::{EndpointEvent, GatherTarget, Store};
use crate::transport::discovery::{probe_capabilities, Capabilities};
use crate::transport::tcp::{GatherClient, GatherError};
use crate::transport::LayerSink;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What the engine knows about its store's endpoint.
#[derive(Debug, Default)]
pub(crate) enum Probe {
    /// Not probed yet.
    #[default]
    Unknown,
    /// A capabilities probe is running; the sender half is dropped when it ends.
    Probing(watch::Receiver<()>),
    /// Gather is offered; idle connections kept for reuse; `warming` while the engine opens
    /// the first one in the background.
    Offered {
        /// Idle connections.
        pool: Vec<GatherClient>,
        /// The pool is being warmed.
        warming: bool,
    },
    /// The endpoint does not speak gather (a stock S3 server): use ranged GETs. Final.
    NotOffered,
    /// The probe could not reach the endpoint at this time; the first load after
    /// [`PROBE_RETRY`] probes again (in the background).
    Unreachable(Instant),
}

/// Longest a load waits for a capabilities probe in flight before it goes on with ranged
/// GETs. The probe starts with the engine and any reachable S3 server answers it in about a
/// millisecond (it is one HTTP request), so loads normally find the answer waiting; only the
/// loads that arrive while an endpoint is silent wait, and never longer than this.
const PROBE_WAIT: Duration = Duration::from_millis(500);
/// Longest the probe itself may take (it runs in the background).
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How soon an unreachable endpoint is probed again.
const PROBE_RETRY: Duration = Duration::from_secs(5);

/// Starts the one capabilities probe of this engine's endpoint (a plain HTTP request every
/// S3 server answers at once, [`crate::transport::discovery`]) unless one ran or runs, and
/// returns a receiver that closes when it ends. Once gather is known to be offered, one
/// connection is opened and pooled (the engine's pool is warm before its first load).
pub(crate) fn start_probe(
    probe: &Arc<Mutex<Probe>>,
    target: &GatherTarget,
) -> Option<watch::Receiver<()>> {
    let mut p = probe.lock().expect("lock");
    match &*p {
        Probe::Probing(rx) => return Some(rx.clone()),
        Probe::Offered { .. } | Probe::NotOffered => return None,
        Probe::Unreachable(at) if at.elapsed() < PROBE_RETRY => return None,
        Probe::Unknown | Probe::Unreachable(_) => {}
    }
    let (tx, rx) = watch::channel(());
    *p = Probe::Probing(rx.clone());
    drop(p);
    let (probe, target) = (probe.clone(), target.clone());
    tokio::spawn(async move {
        let offered = match probe_capabilities(&target.addr, PROBE_TIMEOUT).await {
            Ok(Capabilities::Gather { .. }) => {
                tracing::info!(addr = %target.addr, "the endpoint offers gather");
                Probe::Offered {
                    pool: Vec::new(),
                    warming: true,
                }
            }
            Ok(Capabilities::NotOffered { status, why }) => {
                tracing::info!(addr = %target.addr, status, %why, "gather not offered; using ranged GETs");
                Probe::NotOffered
            }
            Err(e) => {
                tracing::warn!(addr = %target.addr, error = %e, "gather probe failed; ranged GETs until it succeeds");
                Probe::Unreachable(Instant::now())
            }
        };
        let warm = matches!(offered, Probe::Offered { .. });
        *probe.lock().expect("lock") = offered;
        // The verdict is out: loads no longer wait for this task.
        drop(tx);
        if warm {
            // Warm the pool with one connection; a failure here only leaves it cold.
            let c =
                GatherClient::connect_with(target.addr.as_str(), target.credentials.clone()).await;
            let mut p = probe.lock().expect("lock");
            match (c, &mut *p) {
                (Ok(c), Probe::Offered { pool, warming }) => {
                    pool.push(c);
                    *warming = false;
                }
                (Err(GatherError::NotOffered(why)), _) => {
                    tracing::info!(addr = %target.addr, %why, "gather not offered; using ranged GETs");
                    *p = Probe::NotOffered;
                }
                (Err(e), Probe::Offered { warming, .. }) => {
                    tracing::debug!(addr = %target.addr, error = %e, "warming the gather pool failed");
                    *warming = false;
                }
                _ => {}
            }
        }
    });
    Some(rx)
}

/// What the engine knows of its endpoint's gather offer, for [`super::Engine::gather_status`].
pub(crate) fn status(probe: &Mutex<Probe>) -> GatherStatus {
    match &*probe.lock().expect("lock") {
        Probe::Unknown => GatherStatus::Unknown,
        Probe::Probing(_) => GatherStatus::Probing,
        Probe::Offered { pool, warming } => GatherStatus::Offered {
            idle_connections: pool.len(),
            warming: *warming,
        },
        Probe::NotOffered => GatherStatus::NotOffered,
        Probe::Unreachable(_) => GatherStatus::Unreachable,
    }
}

/// Whether an engine's loads use gather ([`super::Engine::gather_status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatherStatus {
    /// Gather is switched off, or the store has no endpoint that could offer it (a local
    /// store, AWS S3, an `https://` endpoint).
    Off,
    /// Not asked yet.
    Unknown,
    /// The one capabilities request is in flight.
    Probing,
    /// The endpoint is an ObjectCache server: loads use gather.
    Offered {
        /// Idle gather connections kept for the next loads.
        idle_connections: usize,
        /// The engine is opening its first connection in the background.
        warming: bool,
    },
    /// A stock S3 server: loads use ranged GETs (final for this engine).
    NotOffered,
    /// The endpoint could not be reached when asked; loads use ranged GETs and a later load
    /// asks again.
    Unreachable,
}

/// Whether loads should try gather at `target`: starts the engine's probe if none ran yet and
/// waits for a probe in flight at most [`PROBE_WAIT`]. `false` (ranged GETs) while the answer
/// is unknown, so a slow or silent endpoint never holds a load up for longer.
pub(crate) async fn offered(probe: &Arc<Mutex<Probe>>, target: &GatherTarget) -> bool {
    if let Some(mut rx) = start_probe(probe, target) {
        let _ = tokio::time::timeout(PROBE_WAIT, rx.changed()).await;
    }
    matches!(*probe.lock().expect("lock"), Probe::Offered { .. })
}

/// A load id for the stripes of one load: unique within this process (a counter) and, with
/// a random base drawn once per process, across the clients of one server.
fn next_load_id() -> u64 {
    static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let base = *BASE.get_or_init(|| {
        let mut b = [0u8; 8];
        // Without OS randomness the ids are still unique within this process.
        let _ = getrandom::fill(&mut b);
        u64::from_le_bytes(b)
    });
    base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Result of trying gather for one load.
pub(crate) enum Outcome {
    /// The load ran over gather (its layers are ready or failed).
    Done,
    /// Gather is not available: run the ranged-GET path instead. No byte was delivered.
    Fallback,
}

/// The gather descriptor of `req`: its chunks' keys under the store's bucket and key prefix,
/// every chunk full (`tokens_per_chunk` tokens). Used by the TCP and RDMA gather paths alike.
pub(crate) fn gather_request(
    request_id: u64,
    target: &GatherTarget,
    keys: &KeyBuilder,
    req: &LoadRequest,
) -> GatherRequest {
    let g = &req.geometry;
    let mut greq = GatherRequest::for_prefix(
        request_id,
        &target.bucket,
        keys,
        g,
        req.hashes.clone(),
        vec![g.tokens_per_chunk; req.hashes.len()],
    );
    greq.priority = req.hints.priority;
    greq.hints = req.hints.sched_hints();
    if !target.key_prefix.is_empty() {
        greq.chunks = ChunkKeys::Hashed {
            prefix: format!("{}/{}", target.key_prefix, keys.prefix()),
            hashes: req.hashes.clone(),
        };
    }
    greq
}

/// Unit size of the connector's TCP gather loads: one full chunk's slice, within the
/// protocol's `MIN_UNIT_BYTES..=MAX_UNIT_BYTES`.
pub(crate) fn unit_bytes_for(g: &crate::layout::KvGeometry) -> u32 {
    g.slice_bytes().clamp(
        crate::protocol::MIN_UNIT_BYTES as u64,
        crate::protocol::MAX_UNIT_BYTES as u64,
    ) as u32
}

/// Why [`connection`] gave no connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NoConnection {
    /// The endpoint does not offer gather (or is not known to): use ranged GETs.
    NotOffered,
    /// It offers gather but could not be reached now (refused, reset, silent).
    Unreachable,
}

/// Takes an idle pooled connection to the gather server, or opens one. Call after
/// [`offered`].
async fn connection(
    probe: &Mutex<Probe>,
    target: &GatherTarget,
) -> Result<GatherClient, NoConnection> {
    let pooled = {
        let mut p = probe.lock().expect("lock");
        match &mut *p {
            // Skip connections the server closed while they sat idle (e.g. it restarted).
            Probe::Offered { pool, .. } => {
                std::iter::from_fn(|| pool.pop()).find(|c| !c.is_stale())
            }
            _ => return Err(NoConnection::NotOffered),
        }
    };
    if let Some(c) = pooled {
        return Ok(c);
    }
    match GatherClient::connect_with(target.addr.as_str(), target.credentials.clone()).await {
        Ok(c) => Ok(c),
        Err(GatherError::NotOffered(why)) => {
            tracing::info!(addr = %target.addr, %why, "gather not offered; using ranged GETs");
            *probe.lock().expect("lock") = Probe::NotOffered;
            Err(NoConnection::NotOffered)
        }
        Err(e) => {
            tracing::warn!(addr = %target.addr, error = %e, "gather connection failed");
            Err(NoConnection::Unreachable)
        }
    }
}

/// The engine's gather probes, one per endpoint (`GatherTarget::addr`): a store over several
/// gateways has one per gateway.
#[derive(Debug, Default)]
pub(crate) struct Probes(Mutex<HashMap<String, Arc<Mutex<Probe>>>>);

impl Probes {
    /// The probe of the endpoint at `addr` (created unknown on first use).
    pub(crate) fn get(&self, addr: &str) -> Arc<Mutex<Probe>> {
        self.0
            .lock()
            .expect("lock")
            .entry(addr.to_string())
            .or_default()
            .clone()
    }
}

/// What a load's stripes share for failing over: where to find other gateways.
struct Failover {
    probes: Arc<Probes>,
    store: Arc<dyn Store>,
    /// The load's route key (placement).
    route: u64,
}

impl Failover {
    /// The first gateway of the load's route, not in `tried`, that offers gather and gives
    /// a connection; a gateway that cannot be reached is reported to the store (which marks
    /// it down until a health check finds it up again).
    async fn pick(&self, tried: &[String]) -> Option<(GatherTarget, GatherClient)> {
        for t in self.store.gather_route(self.route) {
            if tried.contains(&t.addr) {
                continue;
            }
            let probe = self.probes.get(&t.addr);
            if !offered(&probe, &t).await {
                continue;
            }
            match connection(&probe, &t).await {
                Ok(c) => return Some((t, c)),
                Err(NoConnection::Unreachable) => self
                    .store
                    .endpoint_event(&t.addr, EndpointEvent::Unreachable),
                Err(NoConnection::NotOffered) => {}
            }
        }
        None
    }
}

/// Where one stripe of a striped load lands: the stripe's request covers the load's chunks
/// `base..`, so its byte offsets move by `shift` = `base x slice_bytes` within every layer
/// and the chunk indices its errors name move by `base`. Layers become ready in the load's
/// state once every stripe's bytes of them are written and verified.
///
/// A stripe also keeps what it delivered, so that when its gateway fails in the middle of
/// the load the rest can come from another one ([`Stripe::rewind`], [`Stripe::resume_from`]):
/// a unit that was being received is given back to the load state, and units already
/// delivered that the next gateway sends again are dropped, not written twice.
struct Stripe {
    sh: Arc<Shared>,
    base: usize,
    shift: u64,
    /// Bytes of one full slice.
    slice: u64,
    /// The stripes' progress, and this stripe's place in it.
    step: Arc<Lockstep>,
    index: usize,
    /// Failover bookkeeping (a stripe's units arrive one after another, on one task).
    track: Mutex<Track>,
}

/// What a stripe delivered, and the unit it is receiving.
#[derive(Default)]
struct Track {
    /// Per layer: byte ranges of the load (offsets in the whole layer) this stripe wrote and
    /// verified; disjoint (the load state refuses overlaps).
    done: Vec<Vec<(u64, u64)>>,
    /// The unit being received.
    cur: Option<Cur>,
    /// Layers the transport reported broken (the connection failed before they were
    /// complete), with the error to fail them with if no other gateway can serve them.
    held: Vec<(u32, LayerError)>,
}

/// A unit being received: the byte ranges of the load state it reserved.
struct Cur {
    layer: u32,
    /// Lent in place: `(offset, len)`, and whether it was filled (counted as written).
    lent: Option<(u64, u64, bool)>,
    /// Written piece by piece (`write`): the ranges written, skipping bytes already
    /// delivered by an earlier gateway.
    pieces: Vec<(u64, u64)>,
}

impl Track {
    fn done(&mut self, layer: u32) -> &mut Vec<(u64, u64)> {
        let l = layer as usize;
        if self.done.len() <= l {
            self.done.resize_with(l + 1, Vec::new);
        }
        &mut self.done[l]
    }

    /// Whether any byte of `a..b` of `layer` was delivered already.
    fn overlaps(&self, layer: u32, a: u64, b: u64) -> bool {
        self.done
            .get(layer as usize)
            .is_some_and(|d| d.iter().any(|&(o, n)| o < b && a < o + n))
    }

    /// Bytes of `a..b` of `layer` delivered already.
    fn covered(&self, layer: u32, a: u64, b: u64) -> u64 {
        self.done.get(layer as usize).map_or(0, |d| {
            d.iter()
                .map(|&(o, n)| (o + n).min(b).saturating_sub(o.max(a)))
                .sum()
        })
    }

    /// The parts of `a..b` of `layer` not delivered yet, in order.
    fn gaps(&self, layer: u32, a: u64, b: u64) -> Vec<(u64, u64)> {
        let mut have: Vec<(u64, u64)> = self
            .done
            .get(layer as usize)
            .map(|d| {
                d.iter()
                    .copied()
                    .filter(|&(o, n)| o < b && a < o + n)
                    .collect()
            })
            .unwrap_or_default();
        have.sort_unstable();
        let mut out = Vec::new();
        let mut at = a;
        for (o, n) in have {
            if o > at {
                out.push((at, o - at));
            }
            at = at.max(o + n);
        }
        if at < b {
            out.push((at, b - at));
        }
        out
    }
}

impl Stripe {
    fn new(
        sh: Arc<Shared>,
        base: usize,
        shift: u64,
        slice: u64,
        step: Arc<Lockstep>,
        index: usize,
    ) -> Self {
        Stripe {
            sh,
            base,
            shift,
            slice,
            step,
            index,
            track: Mutex::new(Track::default()),
        }
    }

    /// Gives the unit that was being received back to the load state (its bytes were not
    /// verified) and forgets the layers reported broken, before the rest of the stripe is
    /// asked of another gateway. Takes `&mut self`: the transport that borrowed the stripe
    /// (and any slice it lent) has returned.
    fn rewind(&mut self) {
        let t = self.track.get_mut().expect("lock");
        t.held.clear();
        if let Some(c) = t.cur.take() {
            if let Some((o, n, filled)) = c.lent {
                self.sh.state.release(c.layer, o, n, filled);
            }
            for (o, n) in c.pieces {
                self.sh.state.release(c.layer, o, n, true);
            }
        }
    }

    /// The first layer of `layers` that this stripe (bytes `lo..hi` of every layer) has not
    /// delivered in full and that is not a miss already; `None` when there is none.
    fn resume_from(&self, layers: std::ops::Range<u32>, lo: u64, hi: u64) -> Option<u32> {
        let t = self.track.lock().expect("lock");
        layers.into_iter().find(|&l| {
            t.covered(l, lo, hi) < hi - lo
                && !matches!(
                    self.sh.state.status(l as usize),
                    super::buffers::LayerStatus::Failed(_)
                )
        })
    }

    /// Fails the layers the transport reported broken (no other gateway could serve them).
    fn fail_held(&mut self) {
        let held = std::mem::take(&mut self.track.get_mut().expect("lock").held);
        for (l, e) in held {
            self.sh.state.fail(l, e);
        }
    }

    /// The unit starting at `abs` of `layer` overlaps bytes delivered already (a gateway
    /// after a failover resends part of a layer): receive it piece by piece, keeping only
    /// the new bytes.
    fn begin_filtered(&self, t: &mut Track, layer: u32) {
        t.cur = Some(Cur {
            layer,
            lent: None,
            pieces: Vec::new(),
        });
    }
}

/// Where each stripe of a striped load is: `at[s]` = the layer stripe `s` receives (every
/// layer before it complete), `u32::MAX` once it ended. Independent TCP streams would drift
/// apart (one racing through later layers on the cores the others need for layer 0, which
/// gates the first layer ready); a stripe may begin layer `first + r` only when every stripe
/// has reached `first + need(r)`: `need(0) = 0`, `need(1) = 1` (nobody starts the second
/// layer before all finished the first: time to first layer), `need(r) = r - 1` after
/// (at most one layer ahead of the slowest). The slowest stripe never waits, so the
/// stripes cannot deadlock; an ended or aborted stripe counts as infinitely far.
struct Lockstep {
    first: u32,
    at: Vec<std::sync::atomic::AtomicU32>,
    moved: tokio::sync::Notify,
}

impl Lockstep {
    fn new(stripes: usize, first: u32) -> Self {
        Lockstep {
            first,
            at: (0..stripes)
                .map(|_| std::sync::atomic::AtomicU32::new(first))
                .collect(),
            moved: tokio::sync::Notify::new(),
        }
    }

    fn set(&self, s: usize, layer: u32) {
        self.at[s].store(layer, Ordering::Release);
        self.moved.notify_waiters();
    }

    /// Whether a stripe may begin `layer`.
    fn may_begin(&self, layer: u32) -> bool {
        let r = layer.saturating_sub(self.first);
        let need = self.first + if r <= 1 { r } else { r - 1 };
        self.at.iter().all(|a| a.load(Ordering::Acquire) >= need)
    }
}

impl Drop for Stripe {
    fn drop(&mut self) {
        // Ended, failed or aborted: hold nobody back.
        self.step.set(self.index, u32::MAX);
    }
}

/// `e` with its chunk index (relative to a stripe starting at chunk `base`) made relative
/// to the whole load.
fn shift_chunk(e: LayerError, base: usize) -> LayerError {
    match e {
        LayerError::Missing { chunk, key } => LayerError::Missing {
            chunk: chunk + base,
            key,
        },
        LayerError::ChecksumMismatch {
            chunk,
            layer,
            stored,
            computed,
        } => LayerError::ChecksumMismatch {
            chunk: chunk + base,
            layer,
            stored,
            computed,
        },
        LayerError::GeometryMismatch { chunk, reason } => LayerError::GeometryMismatch {
            chunk: chunk + base,
            reason,
        },
        LayerError::Storage { chunk, message } => LayerError::Storage {
            chunk: chunk + base,
            message,
        },
        other => other,
    }
}

impl LayerSink for Stripe {
    fn write(&self, layer: u32, offset: u64, data: &[u8]) -> Result<(), LayerError> {
        let abs = offset + self.shift;
        let mut t = self.track.lock().expect("lock");
        if t.cur
            .as_ref()
            .is_none_or(|c| c.layer != layer || c.lent.is_some())
        {
            self.begin_filtered(&mut t, layer);
        }
        let end = abs + data.len() as u64;
        for (o, n) in t.gaps(layer, abs, end) {
            let from = (o - abs) as usize;
            self.sh
                .state
                .write(layer, o, &data[from..from + n as usize])?;
            t.cur.as_mut().expect("a unit").pieces.push((o, n));
        }
        Ok(())
    }
    fn placed(&self, layer: u32, offset: u64, len: u64) -> Result<(), LayerError> {
        self.sh.state.placed(layer, offset + self.shift, len)
    }
    fn dest_mut(&self, layer: u32, offset: u64, len: u64) -> Result<Option<&mut [u8]>, LayerError> {
        let abs = offset + self.shift;
        let mut t = self.track.lock().expect("lock");
        if t.overlaps(layer, abs, abs + len) {
            self.begin_filtered(&mut t, layer);
            return Ok(None);
        }
        let d = self.sh.state.dest_mut(layer, abs, len)?;
        if d.is_some() {
            t.cur = Some(Cur {
                layer,
                lent: Some((abs, len, false)),
                pieces: Vec::new(),
            });
        }
        Ok(d)
    }
    fn dest_parts(
        &self,
        layer: u32,
        offset: u64,
        len: u64,
    ) -> Result<Option<Vec<&mut [u8]>>, LayerError> {
        let abs = offset + self.shift;
        let mut t = self.track.lock().expect("lock");
        if t.overlaps(layer, abs, abs + len) {
            self.begin_filtered(&mut t, layer);
            return Ok(None);
        }
        let d = self.sh.state.dest_parts(layer, abs, len)?;
        if d.is_some() {
            t.cur = Some(Cur {
                layer,
                lent: Some((abs, len, false)),
                pieces: Vec::new(),
            });
        }
        Ok(d)
    }
    fn dest_filled(&self, layer: u32, len: u64) {
        if let Some(Cur {
            lent: Some((_, _, filled)),
            ..
        }) = self.track.lock().expect("lock").cur.as_mut()
        {
            *filled = true;
        }
        self.sh.state.dest_filled(layer, len)
    }
    fn complete(&self, layer: u32, bytes: u64) {
        let mut t = self.track.lock().expect("lock");
        match t.cur.take() {
            Some(Cur {
                lent: Some((o, n, _)),
                ..
            }) => {
                t.done(layer).push((o, n));
                drop(t);
                self.sh.state.complete(layer, bytes);
            }
            Some(c) => {
                let new: u64 = c.pieces.iter().map(|p| p.1).sum();
                t.done(layer).extend(c.pieces);
                drop(t);
                if new > 0 {
                    self.sh.state.complete(layer, new);
                }
            }
            None => {
                drop(t);
                self.sh.state.complete(layer, bytes)
            }
        }
    }
    fn fail(&self, layer: u32, err: LayerError) {
        {
            let mut t = self.track.lock().expect("lock");
            if t.cur.as_ref().is_some_and(|c| c.layer == layer) {
                // The unit's bytes stay reserved: the layer is a miss, never ready.
                t.cur = None;
            }
        }
        self.sh.state.fail(layer, shift_chunk(err, self.base))
    }
    fn broken(&self, layer: u32, err: LayerError) {
        self.track
            .lock()
            .expect("lock")
            .held
            .push((layer, shift_chunk(err, self.base)));
    }
    fn is_cancelled(&self) -> bool {
        self.sh.state.is_cancelled()
    }
    fn progress(&self, bytes: u64) {
        self.sh.progress.arrived(bytes)
    }
    fn verified(&self, layer: u32, offset: u64, len: u64, crc: u32) {
        // A unit that is exactly one slice (the connector asks for slice-sized units): its
        // CRC is the slice's, which followers check their copies against.
        if len == self.slice && (offset + self.shift).is_multiple_of(self.slice) {
            self.sh.record_slice_crc(
                ((offset + self.shift) / self.slice) as usize,
                layer as usize,
                crc,
            );
        }
    }
    fn begin_layer(&self, layer: u32) -> Option<futures::future::BoxFuture<'_, ()>> {
        self.step.set(self.index, layer);
        if self.step.may_begin(layer) {
            return None;
        }
        Some(Box::pin(async move {
            loop {
                let moved = self.step.moved.notified();
                tokio::pin!(moved);
                moved.as_mut().enable();
                if self.step.may_begin(layer) || self.sh.state.is_cancelled() {
                    return;
                }
                moved.await;
            }
        }))
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How a stripe ended ([`run_stripe`]).
struct StripeEnd {
    /// The stripe's sink, with what it still holds back.
    sink: Stripe,
    /// The last gateway's answer.
    result: Result<crate::transport::tcp::LoadReport, GatherError>,
    /// The connection, to pool with its gateway's probe, when it ended cleanly.
    client: Option<(String, GatherClient)>,
}

/// Runs one stripe (`part` = the load's chunks `a..b`) on `client` to `target`, and when
/// that gateway fails before the stripe is complete (the connection breaks, the server stops
/// or refuses the request), asks the next gateway of the load's route for the layers not
/// delivered yet, until one serves them or none is left. Byte-exact: a unit cut short is
/// given back ([`Stripe::rewind`]) and units already delivered are not written again.
#[allow(clippy::too_many_arguments)]
async fn run_stripe(
    fo: Arc<Failover>,
    mut target: GatherTarget,
    mut client: GatherClient,
    mut sink: Stripe,
    keys: KeyBuilder,
    part: LoadRequest,
    request_id: u64,
    group: Option<LoadGroup>,
    bytes: std::ops::Range<u64>,
) -> StripeEnd {
    let layers = part.geometry.layers;
    let mut from = 0u32;
    let mut tried = vec![target.addr.clone()];
    loop {
        let mut greq = gather_request(request_id, &target, &keys, &part);
        greq.layers = from..layers;
        // One unit per slice, checked by this client against the slice's stored CRC32C (end
        // to end: storage, server and network): the server reads no payload byte itself (from
        // local files it sends them with sendfile), a bad unit names exactly one (chunk,
        // layer), and the first layer's slices are sent as each is read.
        greq.verify = false;
        greq.max_unit_bytes = unit_bytes_for(&part.geometry);
        // A server that holds the load on purpose (admission, its bandwidth cap) says so, so
        // the load's stall watchdog does not take the pause for a stall.
        greq.held = client.server_info().features & ServerInfo::FEATURE_HELD != 0;
        // The first gateway schedules the stripes as one load; a stripe that failed over is
        // a load of its own on its new gateway (which never sees the others).
        if tried.len() == 1 {
            greq.group = group;
        }
        sink.sh.requests.fetch_add(1, Ordering::Relaxed);
        let r = client.load(&greq, &sink).await;
        let e = match r {
            Ok(report) => {
                return StripeEnd {
                    sink,
                    result: Ok(report),
                    client: Some((target.addr, client)),
                }
            }
            Err(GatherError::Cancelled) => {
                return StripeEnd {
                    sink,
                    result: Err(GatherError::Cancelled),
                    client: Some((target.addr, client)),
                }
            }
            Err(e) => e,
        };
        if matches!(e, GatherError::Io(_)) {
            fo.store
                .endpoint_event(&target.addr, EndpointEvent::Unreachable);
        }
        if sink.sh.state.is_cancelled() {
            return StripeEnd {
                sink,
                result: Err(e),
                client: None,
            };
        }
        // Where the rest starts: the first layer this stripe has not delivered in full.
        let held = std::mem::take(&mut sink.track.get_mut().expect("lock").held);
        let Some(next) = sink.resume_from(from..layers, bytes.start, bytes.end) else {
            // Everything arrived before the gateway failed.
            return StripeEnd {
                sink,
                result: Ok(empty_report()),
                client: None,
            };
        };
        let Some((t, c)) = fo.pick(&tried).await else {
            sink.track.get_mut().expect("lock").held = held;
            return StripeEnd {
                sink,
                result: Err(e),
                client: None,
            };
        };
        tracing::warn!(from = %target.addr, to = %t.addr, layer = next, error = %e,
            "gather stripe failed over to another gateway");
        sink.rewind();
        sink.sh.failovers.fetch_add(1, Ordering::Relaxed);
        from = next;
        tried.push(t.addr.clone());
        (target, client) = (t, c);
    }
}

/// The report of a stripe whose every layer had arrived when its gateway failed.
fn empty_report() -> crate::transport::tcp::LoadReport {
    crate::transport::tcp::LoadReport {
        units: 0,
        bytes: 0,
        failed_layers: Vec::new(),
        missed_chunks: Vec::new(),
        ttfl: None,
        elapsed: Duration::ZERO,
    }
}

/// Runs `req` over gather on the gateways of `route` (the store's gather targets in
/// placement order, [`Store::gather_route`]): on the first that offers gather and accepts a
/// connection, striped over up to `streams` connections (contiguous runs of chunks, one
/// request and one task each; see `EngineConfig::gather_streams`). A stripe whose gateway
/// fails mid-load continues on the next gateway of the route ([`run_stripe`]).
///
/// `Outcome::Fallback` (nothing delivered) when no gateway offers gather, no connection
/// could be opened, or every stripe was refused before any byte arrived (busy, limits).
/// Otherwise `Outcome::Done`: layers are ready or failed; a stripe that no gateway could
/// finish fails the layers still pending (misses, never bytes), and the per-chunk status
/// names the chunks each stripe's server reported.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn try_gather(
    probes: &Arc<Probes>,
    store: &Arc<dyn Store>,
    route: u64,
    keys: &KeyBuilder,
    req: &LoadRequest,
    request_id: u64,
    sh: &Arc<Shared>,
    streams: usize,
) -> Outcome {
    let fo = Arc::new(Failover {
        probes: probes.clone(),
        store: store.clone(),
        route,
    });
    let Some((target, first)) = fo.pick(&[]).await else {
        return Outcome::Fallback;
    };
    let probe = probes.get(&target.addr);
    let chunks = req.hashes.len();
    let want = streams.clamp(1, chunks.max(1));
    let mut clients = vec![first];
    while clients.len() < want {
        match connection(&probe, &target).await {
            Ok(c) => clients.push(c),
            // Fewer streams: the load still runs on the connections it has.
            Err(_) => break,
        }
    }
    // Counted against the gateway for load-aware placement while the load runs.
    store.endpoint_event(&target.addr, EndpointEvent::LoadStarted);
    struct Ended<'a>(&'a Arc<dyn Store>, &'a str);
    impl Drop for Ended<'_> {
        fn drop(&mut self) {
            self.0.endpoint_event(self.1, EndpointEvent::LoadEnded);
        }
    }
    let _ended = Ended(store, &target.addr);
    let n = clients.len();
    let slice = req.geometry.slice_bytes();
    let step = Arc::new(Lockstep::new(n, 0));
    // A server that schedules loads (not connections) is told which requests are stripes of
    // this load, so it admits and paces them as one and sends them in the load's layer-major
    // order (`docs/protocol.md`, "Striped loads"). Without it each stripe is a load of its own.
    let group = (n > 1
        && clients
            .iter()
            .all(|c| c.server_info().features & ServerInfo::FEATURE_LOAD_GROUPS != 0))
    .then(|| (next_load_id(), chunks as u64 * slice));
    // The stripe tasks stop when this future is dropped (the load's deadline passed), as
    // well as when the load is cancelled or its handle dropped (`Shared::tasks`).
    let mut guards = Vec::with_capacity(n);
    let mut stripes = Vec::with_capacity(n);
    for (i, client) in clients.into_iter().enumerate() {
        let (a, b) = (i * chunks / n, (i + 1) * chunks / n);
        let part = LoadRequest {
            geometry: req.geometry.clone(),
            hashes: req.hashes[a..b].to_vec(),
            hints: req.hints.clone(),
        };
        let sink = Stripe::new(sh.clone(), a, a as u64 * slice, slice, step.clone(), i);
        let group = group.map(|(load_id, load_layer_bytes)| LoadGroup {
            load_id,
            stripe: i as u16,
            stripes: n as u16,
            load_layer_bytes,
        });
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Its own task, so the stripes' receiving (socket copy, CRC) runs on several threads.
        // Registered with the load, whose end aborts and awaits it before the buffers go.
        let stripe = run_stripe(
            fo.clone(),
            target.clone(),
            client,
            sink,
            keys.clone(),
            part,
            request_id,
            group,
            a as u64 * slice..b as u64 * slice,
        );
        let task = tokio::spawn(async move {
            let _ = tx.send(stripe.await);
        });
        guards.push(AbortOnDrop(task.abort_handle()));
        sh.tasks.lock().expect("lock").push(task);
        stripes.push((a..b, rx));
    }
    let (mut delivered, mut refused, mut broken) = (Vec::new(), None, None);
    let mut ended = Vec::new();
    for (range, rx) in stripes {
        match rx.await {
            Ok(StripeEnd {
                sink,
                result,
                client,
            }) => {
                match result {
                    Ok(report) => {
                        // The server names each bad chunk once and delivers the others.
                        for &(c, reason) in &report.missed_chunks {
                            sh.set_chunk(
                                range.start + c as usize,
                                super::status::chunk_status_of_miss(reason),
                            );
                        }
                        delivered.push(range);
                    }
                    // Refused before any byte (busy, limits) by every gateway tried.
                    Err(GatherError::Remote { code, message }) => {
                        refused = Some((range.start, format!("{code:?}: {message}")))
                    }
                    Err(e) => broken = Some((range.start, e.to_string())),
                }
                if let Some((addr, client)) = client {
                    if let Probe::Offered { pool, .. } =
                        &mut *probes.get(&addr).lock().expect("lock")
                    {
                        pool.push(client);
                    }
                }
                ended.push(sink);
            }
            // The task was aborted: the load was cancelled or dropped.
            Err(_) => broken = Some((range.start, "gather stream stopped".to_string())),
        }
    }
    if delivered.is_empty() && broken.is_none() {
        if let Some((_, why)) = refused {
            // Nothing was delivered: the ranged-GET path can still serve the whole load.
            tracing::warn!(%why, "gather request refused; using ranged GETs");
            return Outcome::Fallback;
        }
    }
    // Layers no gateway could finish are misses.
    for mut sink in ended {
        sink.fail_held();
    }
    // Per-chunk status from the layers' miss reasons (the server names the chunk).
    for l in 0..sh.state.layers() {
        if let super::buffers::LayerStatus::Failed(e) = sh.state.status(l) {
            if let Some((c, s)) = super::status::chunk_status_of(&e) {
                sh.set_chunk(c, s);
            }
        }
    }
    if let Some((chunk, why)) = broken.or(refused) {
        // Mid-stream failures already failed the incomplete layers they knew of; a stripe
        // that never ran leaves its layers incomplete: misses, never bytes.
        sh.state.fail_pending(LayerError::Storage {
            chunk,
            message: format!("gather: {why}"),
        });
    }
    // Every chunk of a stripe that finished and was not named is whole (its slices arrived
    // verified), as on the ranged-GET path.
    for c in delivered.into_iter().flatten() {
        sh.set_chunk(c, ChunkStatus::Ok);
    }
    Outcome::Done
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{HashAlgo, KvGeometry};
    use crate::protocol::SchedHints;

    #[test]
    fn stripes_move_in_lockstep() {
        let s = Lockstep::new(2, 0);
        assert!(s.may_begin(0));
        // Stripe 0 finished layer 0; stripe 1 is still in it: nobody starts layer 1.
        s.set(0, 1);
        assert!(!s.may_begin(1));
        s.set(1, 1);
        assert!(
            s.may_begin(1) && s.may_begin(2),
            "one layer ahead of the slowest"
        );
        assert!(!s.may_begin(3), "two layers ahead");
        // An ended stripe holds nobody back.
        s.set(1, u32::MAX);
        s.set(0, 31);
        assert!(s.may_begin(31));
    }

    #[test]
    fn gather_requests_carry_the_load_hints() {
        let g = KvGeometry::smollm2_135m();
        let keys = KeyBuilder::new("ns", &g, HashAlgo::Sha256Cbor).unwrap();
        let target = GatherTarget {
            addr: "127.0.0.1:1".into(),
            bucket: "b".into(),
            key_prefix: String::new(),
            credentials: None,
        };
        let hashes = vec![crate::ChunkHash::from_digest([7; 32])];
        let plain = LoadRequest::new(g.clone(), hashes.clone());
        let r = gather_request(1, &target, &keys, &plain);
        assert_eq!((r.priority, r.hints), (128, SchedHints::None));
        let hinted = plain
            .with_layer_compute_s(vec![0.002; g.layers as usize])
            .with_priority(200);
        let r = gather_request(2, &target, &keys, &hinted);
        assert_eq!(r.priority, 200);
        assert_eq!(
            r.hints,
            SchedHints::LayerComputeUs(vec![2000; g.layers as usize])
        );
        assert_eq!(r.layers, 0..g.layers);
    }
}
