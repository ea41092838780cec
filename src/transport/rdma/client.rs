//! The client end: registers destination buffers once (registration cache), sends each load's
//! per-layer targets over the control channel, and counts RDMA_WRITE_WITH_IMM completions per
//! layer to mark layers ready through [`LayerSink`].

use std::collections::HashMap;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::LayerError;
use crate::protocol::{RdmaRegion, RdmaSegments};
use crate::transport::LayerSink;

use super::context::{Context, DeviceSelector};
use super::control::{self, Msg};
#[cfg(feature = "rdma-standalone")]
use super::control::{LayerTarget, LoadSpec};
use super::cq::{backoff, Completion, CompletionQueue};
use super::imm::Imm;
use super::mr::{HostBuffer, MemoryRegion, RegistrationCache};
use super::pd::ProtectionDomain;
use super::qp::{QpCaps, QueuePair, Rts};
use super::{RdmaError, Result};

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Device, port and GID.
    pub device: DeviceSelector,
    /// RC QPs per connection (default 2); the server spreads units over them round-robin.
    pub qps: usize,
    /// QP queue sizes.
    pub caps: QpCaps,
    /// Deadline of one load from [`RdmaClient::load`] to its last layer (default 30 s). When
    /// it passes, pending layers become [`LayerError::Timeout`] and the connection breaks.
    pub load_timeout: Duration,
    /// TCP connect and handshake timeout (default 10 s).
    pub connect_timeout: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            device: DeviceSelector::default(),
            qps: 2,
            caps: QpCaps::default(),
            load_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Where one layer of a load lands: `units x slice_len` bytes from the start of the
/// destination memory. Build it with [`LayerDest::host`] or [`LayerDest::raw`].
#[derive(Debug, Clone)]
pub struct LayerDest {
    layer: u32,
    mem: DestMem,
}

#[derive(Debug, Clone)]
enum DestMem {
    Host {
        buf: Arc<HostBuffer>,
        offset: usize,
    },
    Raw {
        ptr: usize,
        len: usize,
    },
    /// Caller memory scattered over `ranges` (in order, one logical buffer), each inside one
    /// of the `memory` areas, which are what gets registered.
    Ranges {
        ranges: Vec<(usize, usize)>,
        memory: Vec<(usize, usize)>,
    },
}

impl LayerDest {
    /// Layer `layer` lands in `buf` from byte `offset` (the whole buffer is registered once
    /// through the client's cache and reused by later loads).
    pub fn host(layer: u32, buf: Arc<HostBuffer>, offset: usize) -> Self {
        LayerDest {
            layer,
            mem: DestMem::Host { buf, offset },
        }
    }
    /// Layer `layer` lands in caller memory `ptr..ptr+len` (for example one region of the
    /// connector's `LayerBuffers`), registered once through the client's cache.
    ///
    /// # Safety
    /// As [`RegistrationCache::get_or_register_raw`]: the memory stays mapped while cached
    /// (evict it with [`RdmaClient::evict_raw`] before freeing it), and nothing holds a Rust
    /// reference to it while a load into it runs.
    pub unsafe fn raw(layer: u32, ptr: *mut u8, len: usize) -> Self {
        LayerDest {
            layer,
            mem: DestMem::Raw {
                ptr: ptr as usize,
                len,
            },
        }
    }
    /// Layer `layer` lands in caller memory scattered over `ranges` `(ptr, len)`, taken in
    /// order as one buffer (paged KV: one range per engine block); every range lies inside
    /// one of the `memory` areas, each registered once through the client's cache (for
    /// example the engine's whole KV buffer), so a load names its ranges as segments of a few
    /// registrations. Adjacent ranges are sent as one segment. Only gather loads
    /// ([`RdmaClient::expect_gather`]) take scattered destinations.
    ///
    /// # Safety
    /// As [`LayerDest::raw`], for every `memory` area: it stays mapped while cached (evict it
    /// with [`RdmaClient::evict_raw`] before freeing it), and nothing holds a Rust reference
    /// to the ranges while a load into them runs.
    pub unsafe fn raw_ranges(
        layer: u32,
        ranges: &[(*mut u8, usize)],
        memory: &[(*mut u8, usize)],
    ) -> Self {
        LayerDest {
            layer,
            mem: DestMem::Ranges {
                ranges: ranges.iter().map(|&(p, n)| (p as usize, n)).collect(),
                memory: memory.iter().map(|&(p, n)| (p as usize, n)).collect(),
            },
        }
    }
    /// The layer index.
    pub fn layer(&self) -> u32 {
        self.layer
    }
}

/// Where one layer's writes land, for [`RdmaClient::expect_gather`].
#[derive(Debug, Clone)]
pub struct LayerPlan {
    /// The layer's destination.
    pub dest: LayerDest,
    /// `(offset, len)` in bytes, in `dest`, of each planned unit, by unit index (the
    /// immediate's `unit`; [`crate::protocol::plan_units`] and
    /// [`crate::protocol::unit_indices`] give them).
    pub units: Vec<(u64, u64)>,
    /// `(chunk, offset, len)` in bytes, in `dest`, of each chunk's slice that shares a unit
    /// with other slices: when another slice of that unit is bad, the server writes the
    /// good ones alone, each with a slice immediate ([`Imm::slice`]) naming its chunk.
    pub slices: Vec<(u32, u64, u64)>,
}

/// How a load ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOutcome {
    /// Layers delivered completely, in the order their last unit arrived.
    pub ready: Vec<u32>,
    /// Layers that are misses, with why.
    pub failed: Vec<(u32, LayerError)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LayerState {
    Pending,
    Ready,
    Failed,
}

struct LayerProg {
    /// `(offset, len)` of each unit in the layer's destination, by unit index.
    units: Vec<(u64, u64)>,
    /// Bytes the immediate's write of each unit carries: the unit's last destination piece
    /// (the whole unit for a contiguous destination).
    imm_len: Vec<u64>,
    seen: Vec<bool>,
    /// Chunk index -> `(offset, len, last write's len)` of each slice a server may write alone
    /// (a slice immediate), and whether it has arrived.
    slices: HashMap<u16, (u64, u64, u64, bool)>,
    got: u32,
    state: LayerState,
}

struct LoadState {
    sink: Arc<dyn LayerSink>,
    layers: HashMap<u32, LayerProg>,
    deadline: Instant,
    server_done: bool,
    /// Set when the connection broke: the load ends once its sink calls have run.
    aborted: bool,
    /// Sink calls decided under the lock but not yet run.
    sink_pending: u32,
    /// Writes the server reported complete (from Done) and receive completions seen so far.
    writes_expected: u64,
    writes_seen: u64,
    cancel_sent: bool,
    outcome: LoadOutcome,
    finished: bool,
    _mrs: Vec<Arc<MemoryRegion>>,
}

impl LoadState {
    fn all_resolved(&self) -> bool {
        self.layers.values().all(|l| l.state != LayerState::Pending)
    }
}

/// A sink call made after the state lock is released.
enum Action {
    /// `placed(layer, offset, len)` then `complete(layer, len)`: the bytes were written by
    /// the NIC and verified by the server's CRC32C check before they were sent (RoCE's ICRC
    /// protects them on the wire). The sink also hears [`LayerSink::landed`] for them.
    Placed(Arc<dyn LayerSink>, u32, u64, u64),
    Fail(Arc<dyn LayerSink>, u32, LayerError),
}

fn run(actions: Vec<Action>) {
    for a in actions {
        match a {
            Action::Placed(s, l, off, len) => match s.placed(l, off, len) {
                Ok(()) => {
                    s.landed(l, off, len);
                    s.complete(l, len)
                }
                Err(e) => s.fail(l, e),
            },
            Action::Fail(s, l, e) => s.fail(l, e),
        }
    }
}

struct ConnState {
    broken: Option<String>,
    loads: HashMap<u32, LoadState>,
    free_slots: Vec<u32>,
}

struct Shared {
    cache: RegistrationCache,
    cq: Arc<CompletionQueue>,
    qps: Vec<QueuePair<Rts>>,
    writer: Mutex<TcpStream>,
    state: Mutex<ConnState>,
    cv: Condvar,
    stop: AtomicBool,
    cfg: ClientConfig,
    /// A gather session: cancels go through the gather protocol, not this channel.
    gather: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Breaks the connection: every pending layer of every load becomes a miss, QPs go to
    /// ERROR (no late write can land) and the control channel is shut. `timed_out` names the
    /// load whose deadline passed. The first caller's reason wins (the socket shutdown below
    /// wakes the control reader, which then calls this again with "closed").
    fn break_conn(&self, why: String, timed_out: Option<u32>) {
        let mut actions = Vec::new();
        let mut ran = Vec::new();
        {
            let mut st = self.lock();
            tracing::debug!(reason = %why, "rdma client connection breaks");
            let why = st.broken.get_or_insert(why).clone();
            for (slot, ld) in st.loads.iter_mut() {
                for (&layer, lp) in ld.layers.iter_mut() {
                    if lp.state == LayerState::Pending {
                        lp.state = LayerState::Failed;
                        let err = if timed_out == Some(*slot) {
                            LayerError::Timeout {
                                layer: layer as usize,
                            }
                        } else {
                            let chunk = lp.seen.iter().position(|s| !s).unwrap_or(0);
                            LayerError::Storage {
                                chunk,
                                message: format!("RDMA: {why}"),
                            }
                        };
                        ld.outcome.failed.push((layer, err.clone()));
                        actions.push(Action::Fail(ld.sink.clone(), layer, err));
                        ld.sink_pending += 1;
                        ran.push(*slot);
                    }
                }
            }
        }
        for qp in &self.qps {
            let _ = qp.set_error();
        }
        // Tell the server at once (it stops writing and flushes what it has in flight).
        let _ = self
            .writer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .shutdown(std::net::Shutdown::Both);
        // Sink calls first, then wake waiters: a waiter that returns sees every layer resolved
        // and no write can land any more (the QPs are in ERROR).
        run(actions);
        let slots: Vec<u32> = {
            let mut st = self.lock();
            for ld in st.loads.values_mut() {
                ld.aborted = true;
            }
            st.loads.keys().copied().collect()
        };
        self.settle(&ran, &slots);
    }

    /// Tells the server about loads whose sink reports cancellation (once per load).
    fn send_cancels(&self) {
        let slots: Vec<u32> = {
            let mut st = self.lock();
            if st.broken.is_some() || self.gather {
                return;
            }
            st.loads
                .iter_mut()
                .filter(|(_, l)| {
                    !l.finished && !l.cancel_sent && !l.server_done && l.sink.is_cancelled()
                })
                .map(|(s, l)| {
                    l.cancel_sent = true;
                    *s
                })
                .collect()
        };
        for slot in slots {
            let r = control::send(
                &mut *self.writer.lock().unwrap_or_else(|p| p.into_inner()),
                &Msg::Cancel { slot },
            );
            if let Err(e) = r {
                self.break_conn(format!("sending Cancel failed: {e}"), None);
                return;
            }
        }
    }

    /// Records that the sink calls counted in `ran` (one entry per call, by slot) have run,
    /// then finishes the loads in `ran` and `check` that are complete. A load finishes only
    /// after every sink call for it has run, so a waiter never sees a layer "ready" before
    /// the sink does.
    fn settle(&self, ran: &[u32], check: &[u32]) {
        let mut st = self.lock();
        for slot in ran {
            if let Some(ld) = st.loads.get_mut(slot) {
                ld.sink_pending = ld.sink_pending.saturating_sub(1);
            }
        }
        let mut any = false;
        for &slot in ran.iter().chain(check) {
            any |= Self::maybe_finish(&mut st, slot);
        }
        drop(st);
        if any {
            self.cv.notify_all();
        }
    }

    /// Marks a load finished when its sink calls have all run and it is either aborted or
    /// fully delivered (every layer resolved, the server's Done seen, and as many receive
    /// completions seen as the server reported writes).
    fn maybe_finish(st: &mut ConnState, slot: u32) -> bool {
        if let Some(ld) = st.loads.get_mut(&slot) {
            let delivered =
                ld.server_done && ld.writes_seen >= ld.writes_expected && ld.all_resolved();
            if !ld.finished && ld.sink_pending == 0 && (ld.aborted || delivered) {
                ld.finished = true;
                return true;
            }
        }
        false
    }

    /// Handles one receive completion.
    /// `touched` gets the slot once per sink call queued, `check` once per completion (the
    /// load may be finishable even when no sink call is due: a late unit of a failed layer).
    fn on_recv(
        &self,
        wc: &Completion,
        actions: &mut Vec<Action>,
        touched: &mut Vec<u32>,
        check: &mut Vec<u32>,
    ) -> std::result::Result<(), String> {
        let Some(v) = wc.imm else {
            return Err(format!(
                "receive completion without immediate (opcode {})",
                wc.opcode
            ));
        };
        let imm = Imm::decode(v);
        let mut st = self.lock();
        let slot = u32::from(imm.slot);
        let Some(ld) = st.loads.get_mut(&slot) else {
            return Err(format!("write for unknown load slot {slot}"));
        };
        let layer = u32::from(imm.layer);
        ld.writes_seen += 1;
        check.push(slot);
        let Some(lp) = ld.layers.get_mut(&layer) else {
            return Err(format!(
                "write for layer {layer}, which load slot {slot} did not ask for"
            ));
        };
        if imm.slice {
            // One chunk's whole slice, written alone because another slice of its unit was
            // bad: it lands even though the layer is (or will be) a miss, so the chunk's
            // other layers still count (`LayerSink::landed`).
            let chunk = imm.unit;
            let Some(sl) = lp.slices.get_mut(&chunk) else {
                return Err(format!(
                    "slice write for chunk {chunk} of layer {layer}, which no unit of several slices holds"
                ));
            };
            if sl.3 {
                return Err(format!(
                    "repeated slice write for chunk {chunk} of layer {layer}"
                ));
            }
            if u64::from(wc.byte_len) != sl.2 {
                return Err(format!(
                    "the slice of chunk {chunk} of layer {layer} carried {} bytes in its last write, want {}",
                    wc.byte_len, sl.2
                ));
            }
            sl.3 = true;
            actions.push(Action::Placed(ld.sink.clone(), layer, sl.0, sl.1));
            ld.sink_pending += 1;
            touched.push(slot);
            return Ok(());
        }
        let unit = usize::from(imm.unit);
        if unit >= lp.seen.len() || lp.seen[unit] {
            return Err(format!(
                "unexpected or repeated unit {unit} of layer {layer}"
            ));
        }
        let (off, len) = lp.units[unit];
        if u64::from(wc.byte_len) != lp.imm_len[unit] {
            return Err(format!(
                "unit {unit} of layer {layer} carried {} bytes in its last write, want {}",
                wc.byte_len, lp.imm_len[unit]
            ));
        }
        lp.seen[unit] = true;
        lp.got += 1;
        if lp.state == LayerState::Pending {
            actions.push(Action::Placed(ld.sink.clone(), layer, off, len));
            if lp.got as usize == lp.seen.len() {
                lp.state = LayerState::Ready;
                ld.outcome.ready.push(layer);
            }
            // the sink call runs after the lock is released; the load cannot finish before
            ld.sink_pending += 1;
            touched.push(slot);
        }
        Ok(())
    }

    fn on_done(&self, slot: u32, failed: Vec<(u32, String)>, writes: u64) {
        let mut actions = Vec::new();
        {
            let mut st = self.lock();
            let Some(ld) = st.loads.get_mut(&slot) else {
                return;
            };
            for (layer, why) in failed {
                if let Some(lp) = ld.layers.get_mut(&layer) {
                    if lp.state == LayerState::Pending {
                        lp.state = LayerState::Failed;
                        let chunk = lp.seen.iter().position(|s| !s).unwrap_or(0);
                        let err = if ld.cancel_sent && why == control::CANCELLED {
                            LayerError::Cancelled
                        } else {
                            LayerError::Storage {
                                chunk,
                                message: format!("server: {why}"),
                            }
                        };
                        ld.outcome.failed.push((layer, err.clone()));
                        actions.push(Action::Fail(ld.sink.clone(), layer, err));
                        ld.sink_pending += 1;
                    }
                }
            }
            ld.server_done = true;
            ld.writes_expected = writes;
        }
        let ran = vec![slot; actions.len()];
        run(actions);
        self.settle(&ran, &[slot]);
    }
}

/// A persistent RDMA connection to one server: several RC QPs, one completion queue, one
/// control channel. Loads may run concurrently (up to 64 per connection).
pub struct RdmaClient {
    shared: Arc<Shared>,
    session: u64,
    poller: Option<JoinHandle<()>>,
    reader: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RdmaClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaClient")
            .field("qps", &self.shared.qps.len())
            .field("cfg", &self.shared.cfg)
            .finish()
    }
}

impl RdmaClient {
    /// Opens the device, connects the control channel to `addr`, and brings up `cfg.qps` RC
    /// QPs against the server's.
    ///
    /// # Errors
    /// [`RdmaError::NoDevice`] when this host has no usable RDMA device (use the TCP gather
    /// path), [`RdmaError::Io`] when the server cannot be reached, [`RdmaError::Protocol`]
    /// when it refuses, [`RdmaError::Verbs`] when bring-up fails.
    #[cfg(feature = "rdma-standalone")]
    pub fn connect(addr: impl ToSocketAddrs, cfg: ClientConfig) -> Result<Self> {
        Self::connect_inner(addr, cfg, false)
    }

    /// Like [`RdmaClient::connect`], but to an ObjectCache server's gather port: sends the
    /// [`control::PREFACE`] and asks for a *gather session*, whose token
    /// ([`RdmaClient::session`]) gather descriptors name in their RDMA target. Loads then go
    /// through [`RdmaClient::expect_gather`] and the gather protocol, not [`RdmaClient::load`].
    ///
    /// # Errors
    /// As [`RdmaClient::connect`]; [`RdmaError::Protocol`] when the server offers no RDMA.
    pub fn connect_gather(addr: impl ToSocketAddrs, cfg: ClientConfig) -> Result<Self> {
        Self::connect_inner(addr, cfg, true)
    }

    /// The gather session token (0 for a plain session).
    pub fn session(&self) -> u64 {
        self.session
    }

    fn connect_inner(addr: impl ToSocketAddrs, cfg: ClientConfig, gather: bool) -> Result<Self> {
        if cfg.qps == 0 || cfg.qps > 64 {
            return Err(RdmaError::InvalidArgument(format!(
                "qps = {} is outside 1..=64",
                cfg.qps
            )));
        }
        let ctx = Context::open(&cfg.device)?;
        let pd = ProtectionDomain::new(&ctx)?;
        let addr = addr.to_socket_addrs()?.next().ok_or_else(|| {
            RdmaError::InvalidArgument("server address resolves to nothing".into())
        })?;
        let mut s = TcpStream::connect_timeout(&addr, cfg.connect_timeout)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(cfg.connect_timeout))?;
        if gather {
            std::io::Write::write_all(&mut s, &control::PREFACE)?;
        }
        let n = cfg.qps as u32;
        let cq = CompletionQueue::new(&ctx, n * (cfg.caps.max_send_wr + cfg.caps.max_recv_wr))?;
        let mut inits = Vec::new();
        for i in 0..cfg.qps {
            let qp = QueuePair::create(&pd, &cq, &cq, cfg.caps)?.to_init()?;
            for _ in 0..cfg.caps.max_recv_wr {
                qp.post_recv(i as u64)?;
            }
            inits.push(qp);
        }
        control::send(
            &mut s,
            &Msg::Hello {
                version: control::VERSION,
                endpoints: inits.iter().map(|q| q.endpoint()).collect(),
                gather,
            },
        )?;
        let (remote, session) = match control::recv(&mut s)? {
            Some(Msg::Welcome { endpoints, session })
                if endpoints.len() == inits.len() && (session != 0) == gather =>
            {
                (endpoints, session)
            }
            Some(Msg::Refuse { reason }) => {
                return Err(RdmaError::Protocol(format!("server refused: {reason}")))
            }
            other => {
                return Err(RdmaError::Protocol(format!(
                    "expected Welcome with {} QPs, got {other:?}",
                    inits.len()
                )))
            }
        };
        let mut qps = Vec::new();
        for (qp, ep) in inits.into_iter().zip(&remote) {
            qps.push(qp.to_rtr(ep)?.to_rts()?);
        }
        s.set_read_timeout(None)?;
        let reader_stream = s.try_clone()?;
        let shared = Arc::new(Shared {
            cache: RegistrationCache::new(&pd),
            cq,
            qps,
            writer: Mutex::new(s),
            state: Mutex::new(ConnState {
                broken: None,
                loads: HashMap::new(),
                free_slots: (0..Imm::SLOTS).rev().collect(),
            }),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            cfg,
            gather,
        });
        let sh = shared.clone();
        let poller = std::thread::Builder::new()
            .name("rdma-poll".into())
            .spawn(move || poll_loop(&sh))?;
        let sh = shared.clone();
        let reader = std::thread::Builder::new()
            .name("rdma-ctrl".into())
            .spawn(move || read_loop(&sh, reader_stream))?;
        Ok(RdmaClient {
            shared,
            session,
            poller: Some(poller),
            reader: Some(reader),
        })
    }

    /// Starts a load: layer `spec.layers[i]` lands in `dests[i]` (`units x slice_len` bytes,
    /// unit `u` at `offset + u x slice_len`), and `sink.complete(layer, slice_len)` is called
    /// once per unit as its write completes; pending layers become misses through
    /// `sink.fail` on any failure. Destination buffers are registered once (cached).
    ///
    /// # Errors
    /// [`RdmaError::InvalidArgument`] when the destinations do not match the spec (naming the
    /// layer) or 64 loads are already running; [`RdmaError::Broken`] when the connection has
    /// failed (reconnect); registration or control-channel errors.
    #[cfg(feature = "rdma-standalone")]
    pub fn load(
        &self,
        spec: LoadSpec,
        dests: &[LayerDest],
        sink: Arc<dyn LayerSink>,
    ) -> Result<LoadHandle> {
        let units = spec.keys.len();
        if units == 0 || units as u64 > u64::from(Imm::MAX_UNITS) {
            return Err(RdmaError::InvalidArgument(format!(
                "{units} chunks is outside 1..={}",
                Imm::MAX_UNITS
            )));
        }
        if spec.slice_len == 0 || spec.slice_len > (1 << 31) {
            return Err(RdmaError::InvalidArgument(format!(
                "slice_len {} is outside 1..=2^31",
                spec.slice_len
            )));
        }
        if dests.len() != spec.layers.len() {
            return Err(RdmaError::InvalidArgument(format!(
                "{} destinations for {} layers",
                dests.len(),
                spec.layers.len()
            )));
        }
        let table: Vec<(u64, u64)> = (0..units as u64)
            .map(|u| (u * spec.slice_len, spec.slice_len))
            .collect();
        for (d, &l) in dests.iter().zip(&spec.layers) {
            if d.layer != l {
                return Err(RdmaError::InvalidArgument(format!(
                    "destination for layer {} given where layer {l} is loaded",
                    d.layer
                )));
            }
        }
        let plan: Vec<LayerPlan> = dests
            .iter()
            .map(|d| LayerPlan {
                dest: d.clone(),
                units: table.clone(),
                slices: Vec::new(),
            })
            .collect();
        if plan
            .iter()
            .any(|p| matches!(p.dest.mem, DestMem::Ranges { .. }))
        {
            return Err(RdmaError::InvalidArgument(
                "scattered destinations go through gather loads (expect_gather)".into(),
            ));
        }
        let (slot, segments) = self.register_load(&plan, sink)?;
        let targets: Vec<LayerTarget> = spec
            .layers
            .iter()
            .zip(segments)
            .map(|(&layer, s)| LayerTarget {
                layer,
                addr: s[0].addr,
                rkey: s[0].rkey,
                len: s[0].len,
            })
            .collect();
        let sent = {
            let mut w = self.shared.writer.lock().unwrap_or_else(|p| p.into_inner());
            control::send(
                &mut *w,
                &Msg::Load {
                    slot,
                    spec,
                    targets,
                },
            )
        };
        if let Err(e) = sent {
            self.shared
                .break_conn(format!("sending the load request failed: {e}"), None);
        }
        Ok(LoadHandle {
            shared: self.shared.clone(),
            slot: Some(slot),
        })
    }

    /// Registers a gather load on this session: layer `p.dest.layer()` of each [`LayerPlan`]
    /// `p` lands in `p.dest`, unit `i` (the `unit` of the immediate) at `p.units[i] = (offset,
    /// len)` of it, and a slice written alone (a slice immediate naming its chunk) at its
    /// entry of `p.slices`.
    /// Returns the handle, the load slot and each layer's destination segments (in the given
    /// order) for the gather descriptor's RDMA target: one segment for a contiguous
    /// destination, the coalesced ranges of a scattered one. Completions are counted per
    /// layer as they arrive; end the load with [`LoadHandle::server_end`] when the server's
    /// `End` frame says how many writes it made, or [`LoadHandle::forget`] when it refused.
    ///
    /// # Errors
    /// As [`RdmaClient::load`]; [`RdmaError::InvalidArgument`] when a range of a scattered
    /// destination lies in none of its memory areas.
    pub fn expect_gather(
        &self,
        layers: &[LayerPlan],
        sink: Arc<dyn LayerSink>,
    ) -> Result<(LoadHandle, u32, Vec<Vec<RdmaRegion>>)> {
        let (slot, segments) = self.register_load(layers, sink)?;
        Ok((
            LoadHandle {
                shared: self.shared.clone(),
                slot: Some(slot),
            },
            slot,
            segments,
        ))
    }

    /// The remote segments of `d` covering its first `len` bytes (registering its memory
    /// through the cache), and the registrations they use.
    fn segments(
        &self,
        d: &LayerDest,
        len: u64,
    ) -> Result<(Vec<RdmaRegion>, Vec<Arc<MemoryRegion>>)> {
        let l = d.layer;
        let (offset, cap) = match &d.mem {
            DestMem::Host { buf, offset } => (*offset, buf.len() as u64),
            DestMem::Raw { len, .. } => (0, *len as u64),
            DestMem::Ranges { ranges, .. } => (0, ranges.iter().map(|r| r.1 as u64).sum()),
        };
        if (offset as u64).checked_add(len).is_none_or(|e| e > cap) {
            return Err(RdmaError::InvalidArgument(format!(
                "layer {l}: {len} bytes at offset {offset} do not fit a destination of {cap} bytes"
            )));
        }
        Ok(match &d.mem {
            DestMem::Host { buf, .. } => {
                let mr = self.shared.cache.get_or_register(buf)?;
                (
                    vec![RdmaRegion {
                        addr: mr.addr() + offset as u64,
                        rkey: mr.rkey(),
                        len,
                    }],
                    vec![mr],
                )
            }
            DestMem::Raw { ptr, len: n } => {
                // SAFETY: the contract of `LayerDest::raw`, which the caller accepted.
                let mr = unsafe { self.shared.cache.get_or_register_raw(*ptr as *mut u8, *n)? };
                (
                    vec![RdmaRegion {
                        addr: mr.addr(),
                        rkey: mr.rkey(),
                        len,
                    }],
                    vec![mr],
                )
            }
            DestMem::Ranges { ranges, memory } => {
                let mut mrs: Vec<(usize, Arc<MemoryRegion>)> = Vec::new();
                let mut segs: Vec<RdmaRegion> = Vec::new();
                let mut left = len;
                for (i, &(p, n)) in ranges.iter().enumerate() {
                    if left == 0 {
                        break;
                    }
                    if n == 0 {
                        continue;
                    }
                    let Some(m) = memory.iter().position(|&(a, al)| {
                        p >= a && p.checked_add(n).is_some_and(|e| e <= a + al)
                    }) else {
                        return Err(RdmaError::InvalidArgument(format!("layer {l}: range {i} ({p:#x}, {n} bytes) lies in none of the destination's memory areas")));
                    };
                    let mr = match mrs.iter().find(|(k, _)| *k == m) {
                        Some((_, mr)) => mr.clone(),
                        None => {
                            let (a, al) = memory[m];
                            // SAFETY: the contract of `LayerDest::raw_ranges`, which the caller
                            // accepted, for this memory area.
                            let mr =
                                unsafe { self.shared.cache.get_or_register_raw(a as *mut u8, al)? };
                            mrs.push((m, mr.clone()));
                            mr
                        }
                    };
                    let take = (n as u64).min(left);
                    let addr = mr.addr() + (p - memory[m].0) as u64;
                    match segs.last_mut() {
                        // Adjacent in memory and in the same registration: one segment.
                        Some(s) if s.rkey == mr.rkey() && s.addr + s.len == addr => s.len += take,
                        _ => segs.push(RdmaRegion {
                            addr,
                            rkey: mr.rkey(),
                            len: take,
                        }),
                    }
                    left -= take;
                }
                (segs, mrs.into_iter().map(|(_, mr)| mr).collect())
            }
        })
    }

    fn register_load(
        &self,
        plan: &[LayerPlan],
        sink: Arc<dyn LayerSink>,
    ) -> Result<(u32, Vec<Vec<RdmaRegion>>)> {
        let mut targets = Vec::with_capacity(plan.len());
        let mut mrs = Vec::new();
        let mut layers = HashMap::new();
        for p in plan {
            let (d, table) = (&p.dest, &p.units);
            let l = d.layer;
            if l >= Imm::MAX_LAYERS
                || table.is_empty()
                || table.len() as u64 > u64::from(Imm::MAX_UNITS)
            {
                return Err(RdmaError::InvalidArgument(format!(
                    "layer {l} with {} units (layers < {}, 1..={} units)",
                    table.len(),
                    Imm::MAX_LAYERS,
                    Imm::MAX_UNITS
                )));
            }
            let len = table.iter().map(|&(o, n)| o + n).max().unwrap_or(0);
            let (segs, used) = self.segments(d, len)?;
            // The server writes a unit's last piece with the immediate: expect that length.
            let index = RdmaSegments::new(segs.clone()).ok_or_else(|| {
                RdmaError::InvalidArgument(format!("layer {l}: segment lengths overflow"))
            })?;
            let last_len = |o: u64, n: u64| {
                index
                    .pieces(o, n)
                    .and_then(|p| p.last().map(|x| x.len))
                    .ok_or_else(|| {
                        RdmaError::InvalidArgument(format!(
                            "layer {l}: unit at {o}+{n} is past the destination"
                        ))
                    })
            };
            let imm_len = table
                .iter()
                .map(|&(o, n)| last_len(o, n))
                .collect::<Result<Vec<u64>>>()?;
            let mut slices = HashMap::with_capacity(p.slices.len());
            for &(c, o, n) in &p.slices {
                let chunk = u16::try_from(c)
                    .ok()
                    .filter(|&c| u32::from(c) < Imm::MAX_UNITS);
                // A chunk past the immediate's range is never written alone (the server
                // cannot name it): its layer's unit is then all or nothing, as before.
                if let Some(chunk) = chunk {
                    slices.insert(chunk, (o, n, last_len(o, n)?, false));
                }
            }
            if layers
                .insert(
                    l,
                    LayerProg {
                        units: table.clone(),
                        imm_len,
                        seen: vec![false; table.len()],
                        slices,
                        got: 0,
                        state: LayerState::Pending,
                    },
                )
                .is_some()
            {
                return Err(RdmaError::InvalidArgument(format!(
                    "layer {l} is named twice"
                )));
            }
            targets.push(segs);
            mrs.extend(used);
        }
        let slot = {
            let mut st = self.shared.lock();
            if let Some(why) = &st.broken {
                return Err(RdmaError::Broken(why.clone()));
            }
            let Some(slot) = st.free_slots.pop() else {
                return Err(RdmaError::InvalidArgument(format!(
                    "{} loads already running on this connection",
                    Imm::SLOTS
                )));
            };
            st.loads.insert(
                slot,
                LoadState {
                    sink,
                    layers,
                    deadline: Instant::now() + self.shared.cfg.load_timeout,
                    server_done: false,
                    aborted: false,
                    sink_pending: 0,
                    writes_expected: 0,
                    writes_seen: 0,
                    cancel_sent: false,
                    outcome: LoadOutcome {
                        ready: Vec::new(),
                        failed: Vec::new(),
                    },
                    finished: false,
                    _mrs: mrs,
                },
            );
            slot
        };
        Ok((slot, targets))
    }

    /// How many destination buffers have been registered (`ibv_reg_mr` calls); repeated loads
    /// into the same buffers do not add to it.
    pub fn registrations(&self) -> u64 {
        self.shared.cache.registrations()
    }

    /// Forgets the cached registration of caller memory `ptr..ptr+len` (see
    /// [`LayerDest::raw`]); `true` if it was cached.
    pub fn evict_raw(&self, ptr: *mut u8, len: usize) -> bool {
        self.shared.cache.evict_raw(ptr, len)
    }

    /// `Some(reason)` once the connection is broken.
    pub fn broken(&self) -> Option<String> {
        self.shared.lock().broken.clone()
    }

    /// Moves QP `index` to the error state, as a NIC or link failure would: its posted
    /// receives flush, the connection breaks and pending layers become misses. For failure
    /// drills and tests.
    ///
    /// # Errors
    /// [`RdmaError::InvalidArgument`] for an index out of range; verbs errors.
    pub fn inject_qp_error(&self, index: usize) -> Result<()> {
        let qp = self.shared.qps.get(index).ok_or_else(|| {
            RdmaError::InvalidArgument(format!("QP index {index} of {}", self.shared.qps.len()))
        })?;
        qp.set_error()
    }

    /// Orderly close: pending loads become misses, the server is told Bye, QPs are torn down.
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if self.poller.is_none() {
            return;
        }
        {
            let mut w = self.shared.writer.lock().unwrap_or_else(|p| p.into_inner());
            let _ = control::send(&mut *w, &Msg::Bye);
        }
        let pending = self.shared.lock().loads.values().any(|l| !l.finished);
        self.shared.stop.store(true, Ordering::Release);
        if pending {
            self.shared.break_conn("client closed".into(), None);
        } else {
            for qp in &self.shared.qps {
                let _ = qp.set_error();
            }
        }
        let _ = self
            .shared
            .writer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .shutdown(std::net::Shutdown::Both);
        if let Some(p) = self.poller.take() {
            let _ = p.join();
        }
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

impl Drop for RdmaClient {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Completion loop: one per connection.
fn poll_loop(sh: &Shared) {
    let mut wcs = Vec::new();
    let mut idle = 0u32;
    while !sh.stop.load(Ordering::Acquire) {
        wcs.clear();
        if let Err(e) = sh.cq.poll(&mut wcs) {
            sh.break_conn(format!("polling the completion queue failed: {e}"), None);
            return;
        }
        if wcs.is_empty() {
            // deadlines
            let now = Instant::now();
            let expired = {
                let st = sh.lock();
                st.loads
                    .iter()
                    .find(|(_, l)| !l.finished && now >= l.deadline)
                    .map(|(s, _)| *s)
            };
            if let Some(slot) = expired {
                sh.break_conn(
                    format!(
                        "load slot {slot} passed its deadline of {:?}",
                        sh.cfg.load_timeout
                    ),
                    Some(slot),
                );
            }
            sh.send_cancels();
            backoff(&mut idle);
            continue;
        }
        idle = 0;
        let mut actions = Vec::new();
        let mut touched = Vec::new();
        let mut check = Vec::new();
        for wc in &wcs {
            let broken = sh.lock().broken.is_some();
            if !wc.is_ok() {
                if !broken {
                    sh.break_conn(
                        format!("completion error on QP {}: {}", wc.qp_num, wc.status_str()),
                        None,
                    );
                }
                continue;
            }
            if broken {
                continue;
            }
            if wc.is_recv_write_imm() {
                if let Err(why) = sh.on_recv(wc, &mut actions, &mut touched, &mut check) {
                    run(std::mem::take(&mut actions));
                    sh.settle(&std::mem::take(&mut touched), &std::mem::take(&mut check));
                    sh.break_conn(why, None);
                    continue;
                }
                if let Some(qp) = sh.qps.get(wc.wr_id as usize) {
                    if let Err(e) = qp.post_recv(wc.wr_id) {
                        run(std::mem::take(&mut actions));
                        sh.settle(&std::mem::take(&mut touched), &std::mem::take(&mut check));
                        sh.break_conn(format!("re-posting a receive failed: {e}"), None);
                    }
                }
            }
        }
        run(actions);
        sh.settle(&touched, &check);
    }
}

/// Control-channel reader: Done messages, and disconnect detection.
fn read_loop(sh: &Shared, mut s: TcpStream) {
    loop {
        match control::recv(&mut s) {
            Ok(Some(Msg::Done {
                slot,
                failed,
                writes,
            })) => sh.on_done(slot, failed, writes),
            Ok(Some(other)) => {
                sh.break_conn(format!("unexpected control message {other:?}"), None);
                return;
            }
            Ok(None) => {
                if !sh.stop.load(Ordering::Acquire) {
                    sh.break_conn("the server closed the control channel".into(), None);
                }
                return;
            }
            Err(e) => {
                if !sh.stop.load(Ordering::Acquire) {
                    sh.break_conn(format!("control channel failed: {e}"), None);
                }
                return;
            }
        }
    }
}

/// A running load. [`LoadHandle::wait`] returns when every layer is ready or a miss.
pub struct LoadHandle {
    shared: Arc<Shared>,
    slot: Option<u32>,
}

impl std::fmt::Debug for LoadHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadHandle")
            .field("slot", &self.slot)
            .finish()
    }
}

impl LoadHandle {
    /// The server's `End` for a gather load: it made `writes` successful writes, and every
    /// layer it could not deliver was reported before (see [`LoadHandle::fail_layers`]). The
    /// load finishes once that many completions have arrived.
    pub fn server_end(&self, writes: u64) {
        if let Some(slot) = self.slot {
            self.shared.on_done(slot, Vec::new(), writes);
        }
    }

    /// Makes `layers` misses (the server's `Miss` frames of a gather load): units of them
    /// that still arrive are counted but not reported to the sink.
    pub fn fail_layers(&self, layers: &[(u32, LayerError)]) {
        let Some(slot) = self.slot else { return };
        let mut actions = Vec::new();
        {
            let mut st = self.shared.lock();
            let Some(ld) = st.loads.get_mut(&slot) else {
                return;
            };
            for (layer, err) in layers {
                if let Some(lp) = ld.layers.get_mut(layer) {
                    if lp.state == LayerState::Pending {
                        lp.state = LayerState::Failed;
                        ld.outcome.failed.push((*layer, err.clone()));
                        actions.push(Action::Fail(ld.sink.clone(), *layer, err.clone()));
                        ld.sink_pending += 1;
                    }
                }
            }
        }
        let ran = vec![slot; actions.len()];
        run(actions);
        self.shared.settle(&ran, &[slot]);
    }

    /// Breaks the session (QPs to the error state, so no write of this or any other load can
    /// land any more); every pending layer becomes a miss. For a gather load whose control
    /// stream failed.
    pub fn abort(&self, why: &str) {
        self.shared.break_conn(why.to_string(), None);
    }

    /// Withdraws a gather load the server refused before writing anything: the slot is freed
    /// and the sink is not touched (the caller falls back to another path).
    pub fn forget(mut self) {
        if let Some(slot) = self.slot.take() {
            let mut st = self.shared.lock();
            st.loads.remove(&slot);
            if st.broken.is_none() {
                st.free_slots.push(slot);
            }
        }
    }

    /// `true` when every unit of every layer has arrived: no further write of this load can
    /// land (each unit is written once), whatever the server still has to say.
    pub fn all_units_in(&self) -> bool {
        self.slot.is_none_or(|s| {
            self.shared
                .lock()
                .loads
                .get(&s)
                .is_none_or(|l| l.layers.values().all(|lp| lp.got as usize == lp.seen.len()))
        })
    }

    /// `true` once the load has ended (every layer ready or a miss, and every write counted).
    pub fn is_finished(&self) -> bool {
        self.slot
            .is_none_or(|s| self.shared.lock().loads.get(&s).is_none_or(|l| l.finished))
    }

    /// Asks the server to stop this load: units not yet posted are skipped and their layers
    /// become [`LayerError::Cancelled`] misses once the server confirms (the destination may
    /// still receive writes until then, so keep it until [`LoadHandle::wait`] returns). A
    /// sink whose `is_cancelled` turns true has the same effect.
    ///
    /// # Errors
    /// [`RdmaError::Broken`] when the connection is gone (the load then ends on its own).
    pub fn cancel(&self) -> Result<()> {
        let Some(slot) = self.slot else { return Ok(()) };
        if self.shared.gather {
            return Err(RdmaError::InvalidArgument(
                "a gather load is cancelled through the gather protocol".into(),
            ));
        }
        {
            let mut st = self.shared.lock();
            if let Some(why) = &st.broken {
                return Err(RdmaError::Broken(why.clone()));
            }
            match st.loads.get_mut(&slot) {
                Some(l) if !l.finished && !l.cancel_sent && !l.server_done => l.cancel_sent = true,
                _ => return Ok(()),
            }
        }
        let r = control::send(
            &mut *self.shared.writer.lock().unwrap_or_else(|p| p.into_inner()),
            &Msg::Cancel { slot },
        );
        if let Err(e) = r {
            self.shared
                .break_conn(format!("sending Cancel failed: {e}"), None);
            return Err(e);
        }
        Ok(())
    }

    /// Blocks until the load ends (bounded by the load deadline, after which pending layers
    /// are [`LayerError::Timeout`] misses) and returns its outcome.
    pub fn wait(mut self) -> LoadOutcome {
        let Some(slot) = self.slot.take() else {
            return LoadOutcome {
                ready: Vec::new(),
                failed: Vec::new(),
            };
        };
        let mut st = self.shared.lock();
        loop {
            let finished = st.loads.get(&slot).is_none_or(|l| l.finished);
            if finished {
                break;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, Duration::from_millis(100))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        let out = st
            .loads
            .remove(&slot)
            .map(|l| l.outcome)
            .unwrap_or(LoadOutcome {
                ready: Vec::new(),
                failed: Vec::new(),
            });
        // A slot is reused only when the server confirmed it wrote nothing more for it.
        if st.broken.is_none() {
            st.free_slots.push(slot);
        }
        out
    }
}

impl Drop for LoadHandle {
    fn drop(&mut self) {
        if self.slot.is_some() {
            let h = LoadHandle {
                shared: self.shared.clone(),
                slot: self.slot.take(),
            };
            let _ = h.wait();
        }
    }
}
