//! The client end: registers destination buffers once (registration cache), sends each load's
//! per-layer targets over the control channel, and counts RDMA_WRITE_WITH_IMM completions per
//! layer to mark layers ready through [`LayerSink`].

mod dest;
mod handle;
mod state;

pub use dest::{LayerDest, LayerPlan};
pub use handle::LoadHandle;
pub use state::LoadOutcome;

use dest::DestMem;
use objectcache_core::rdma::tally::LayerTally;
use state::{poll_loop, read_loop, ConnShared, ConnState, LoadState};

use std::collections::HashMap;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::protocol::{RdmaRegion, RdmaSegments};
use crate::transport::LayerSink;

use crate::transport::rdma::context::{Context, DeviceSelector};
use crate::transport::rdma::control::{self, Msg};
use crate::transport::rdma::cq::CompletionQueue;
use crate::transport::rdma::imm::Imm;
use crate::transport::rdma::mr::{MemoryRegion, RegistrationCache};
use crate::transport::rdma::pd::ProtectionDomain;
use crate::transport::rdma::qp::{QpCaps, QueuePair};
use crate::transport::rdma::{RdmaError, Result};

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

/// A persistent RDMA connection to one server: several RC QPs, one completion queue, one
/// control channel. Loads may run concurrently (up to 64 per connection).
pub struct RdmaClient {
    shared: Arc<ConnShared>,
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
    /// Opens the device, connects to an ObjectCache server's gather port at `addr` (the
    /// [`control::PREFACE`], then the set-up channel) and brings up `cfg.qps` RC QPs against
    /// the server's: a *gather session*, whose token ([`RdmaClient::session`]) gather
    /// descriptors name in their RDMA target. Loads go through [`RdmaClient::expect_gather`]
    /// and the gather protocol.
    ///
    /// # Errors
    /// [`RdmaError::NoDevice`] when this host has no usable RDMA device (use the TCP gather
    /// path), [`RdmaError::Io`] when the server cannot be reached, [`RdmaError::Protocol`]
    /// when it refuses (or offers no RDMA), [`RdmaError::Verbs`] when bring-up fails.
    pub fn connect_gather(addr: impl ToSocketAddrs, cfg: ClientConfig) -> Result<Self> {
        if cfg.qps == 0 || cfg.qps > 64 {
            return Err(RdmaError::InvalidArgument(format!(
                "qps = {} is outside 1..=64",
                cfg.qps
            )));
        }
        if cfg.caps.max_recv_wr < 2 {
            return Err(RdmaError::InvalidArgument(format!(
                "caps.max_recv_wr = {} leaves no receive for the server's writes besides the \
                 drain marker (at least 2)",
                cfg.caps.max_recv_wr
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
        std::io::Write::write_all(&mut s, &control::PREFACE)?;
        let n = cfg.qps as u32;
        let cq = CompletionQueue::new(&ctx, n * (cfg.caps.max_send_wr + cfg.caps.max_recv_wr))?;
        let mut inits = Vec::new();
        for i in 0..cfg.qps {
            let qp = QueuePair::create(&pd, &cq, &cq, cfg.caps)?.to_init()?;
            // One receive slot stays free for the drain marker (`state::DRAIN_MARK`).
            for _ in 1..cfg.caps.max_recv_wr {
                qp.post_recv(i as u64)?;
            }
            inits.push(qp);
        }
        control::send(
            &mut s,
            &Msg::Hello {
                version: control::VERSION,
                endpoints: inits.iter().map(|q| q.endpoint()).collect(),
                gather: true,
            },
        )?;
        let (remote, session) = match control::recv(&mut s)? {
            Some(Msg::Welcome { endpoints, session })
                if endpoints.len() == inits.len() && session != 0 =>
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
        let shared = Arc::new(ConnShared {
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
            finished: tokio::sync::Notify::new(),
            stop: AtomicBool::new(false),
            drained: (0..cfg.qps).map(|_| AtomicBool::new(false)).collect(),
            drain_posted: AtomicBool::new(false),
            drain_late: AtomicBool::new(false),
            cfg,
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

    /// The gather session token that gather descriptors name in their RDMA target.
    pub fn session(&self) -> u64 {
        self.session
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
    /// [`RdmaError::InvalidArgument`] when a destination does not match its plan (naming the
    /// layer), 64 loads already run, or a range of a scattered
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
                    slices.insert(chunk, (o, n, last_len(o, n)?));
                }
            }
            if layers
                .insert(l, LayerTally::new(table.clone(), imm_len, slices))
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

    /// Whether the break drained the queue pairs in time: `None` while the connection is not
    /// broken, `Some(true)` when every QP's drain marker completed before the misses were
    /// reported (no late write can land), `Some(false)` when the bounded wait ran out or a
    /// marker could not be posted (logged as an error: the device did not flush its receive
    /// queue).
    pub fn drained(&self) -> Option<bool> {
        self.shared.lock().broken.as_ref()?;
        if !self.shared.drain_posted.load(Ordering::Acquire) {
            return None;
        }
        Some(!self.shared.drain_late.load(Ordering::Acquire))
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
