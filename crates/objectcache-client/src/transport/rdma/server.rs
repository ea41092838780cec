//! The standalone server end (feature `rdma-standalone`, for tests/rdma_loopback.rs): accepts
//! RDMA clients on a TCP control port of its own, brings up one RC QP per client QP, and
//! serves each load (`Msg::Load`) by reading slices into a bounded, registered staging arena
//! and posting one RDMA_WRITE_WITH_IMM per delivery unit into the client's memory. The
//! ObjectCache server does not use it: its loads arrive as gather descriptors
//! ([`super::session`]).

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{LayerError, LayerResult};
use crate::layout::{slice_range, verify_slice};
use crate::store::{Store, StoreExt};

use super::context::Context;
use super::control::{self, LayerTarget, LoadSpec, Msg, CANCELLED};
use super::cq::{backoff, Completion, CompletionQueue};
use super::imm::Imm;
use super::mr::{Access, HostBuffer, MemoryRegion};
use super::pd::ProtectionDomain;
use super::qp::{QueuePair, Rts};
use super::session::ServerConfig;
use super::{RdmaError, Result};

/// Where the server reads delivery units from.
pub trait SliceSource: Send + Sync {
    /// Fills `dst` (exactly `spec.slice_len` bytes) with layer `layer` of chunk `unit`
    /// (`spec.keys[unit]`): K+V bytes, CRC already verified and excluded.
    ///
    /// # Errors
    /// The [`LayerError`] that makes this layer a miss (missing object, checksum mismatch,
    /// storage failure).
    fn read_slice(&self, spec: &LoadSpec, layer: u32, unit: u32, dst: &mut [u8])
        -> LayerResult<()>;
}

/// A [`SliceSource`] over any [`Store`]: one ranged read per slice (`slice_range`), CRC32C
/// verified before the bytes reach the staging arena.
#[derive(Debug, Clone)]
pub struct StoreSliceSource {
    store: Arc<dyn Store>,
    rt: tokio::runtime::Handle,
}

impl StoreSliceSource {
    /// Reads from `store`, driving its futures on `rt` (server threads are not runtime threads).
    pub fn new(store: Arc<dyn Store>, rt: tokio::runtime::Handle) -> Self {
        StoreSliceSource { store, rt }
    }
}

impl SliceSource for StoreSliceSource {
    fn read_slice(
        &self,
        spec: &LoadSpec,
        layer: u32,
        unit: u32,
        dst: &mut [u8],
    ) -> LayerResult<()> {
        let chunk = unit as usize;
        let key = spec.keys.get(chunk).ok_or_else(|| LayerError::Missing {
            chunk,
            key: String::new(),
        })?;
        let range = slice_range(layer, spec.slice_len);
        let store = self.store.clone();
        let k = key.clone();
        let bytes = self
            .rt
            .block_on(async move { store.get_range(&k, range).await })
            .map_err(|e| match e {
                crate::error::StoreError::NotFound { key } => LayerError::Missing { chunk, key },
                other => LayerError::Storage {
                    chunk,
                    message: other.to_string(),
                },
            })?;
        verify_slice(layer as usize, &bytes, spec.slice_len).map_err(|e| match e {
            crate::layout::FormatError::SliceChecksum {
                stored, computed, ..
            } => LayerError::ChecksumMismatch {
                chunk,
                layer: layer as usize,
                stored,
                computed,
            },
            other => LayerError::GeometryMismatch {
                chunk,
                reason: other.to_string(),
            },
        })?;
        if dst.len() as u64 != spec.slice_len {
            return Err(LayerError::GeometryMismatch {
                chunk,
                reason: format!("staging slot of {} bytes", dst.len()),
            });
        }
        dst.copy_from_slice(&bytes[..dst.len()]);
        Ok(())
    }
}

/// A bound, not yet running server.
pub struct RdmaServer {
    listener: TcpListener,
    pd: Arc<ProtectionDomain>,
    source: Arc<dyn SliceSource>,
    cfg: ServerConfig,
}

impl std::fmt::Debug for RdmaServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaServer")
            .field("listener", &self.listener)
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl RdmaServer {
    /// Opens the device and binds the control port.
    ///
    /// # Errors
    /// [`RdmaError::NoDevice`] (no RDMA here: serve gather over TCP instead),
    /// [`RdmaError::Io`] when the address cannot be bound, [`RdmaError::InvalidArgument`] for
    /// a zero arena or QP count.
    pub fn bind(
        addr: impl ToSocketAddrs,
        source: Arc<dyn SliceSource>,
        cfg: ServerConfig,
    ) -> Result<Self> {
        if cfg.arena_bytes == 0 || cfg.max_qps == 0 {
            return Err(RdmaError::InvalidArgument(
                "arena_bytes and max_qps must be positive".into(),
            ));
        }
        let ctx = Context::open(&cfg.device)?;
        let pd = ProtectionDomain::new(&ctx)?;
        let listener = TcpListener::bind(addr)?;
        Ok(RdmaServer {
            listener,
            pd,
            source,
            cfg,
        })
    }
    /// The bound control address.
    ///
    /// # Errors
    /// [`RdmaError::Io`] if the socket has no local address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }
    /// Starts accepting on a background thread; each client gets its own thread.
    ///
    /// # Errors
    /// [`RdmaError::Io`] when the listener cannot be made non-blocking.
    pub fn spawn(self) -> Result<ServerHandle> {
        let addr = self.listener.local_addr()?;
        self.listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<(TcpStream, JoinHandle<()>)>>> = Arc::default();
        let counters = Arc::new(Counters::default());
        let (stop2, conns2, counters2) = (stop.clone(), conns.clone(), counters.clone());
        let accept = std::thread::Builder::new()
            .name("rdma-accept".into())
            .spawn(move || {
                while !stop2.load(Ordering::Acquire) {
                    match self.listener.accept() {
                        Ok((s, peer)) => {
                            let _ = s.set_nonblocking(false);
                            let _ = s.set_nodelay(true);
                            let Ok(watch) = s.try_clone() else { continue };
                            let (pd, src, cfg, counters) = (
                                self.pd.clone(),
                                self.source.clone(),
                                self.cfg.clone(),
                                counters2.clone(),
                            );
                            let h = std::thread::Builder::new().name("rdma-conn".into()).spawn(
                                move || {
                                    if let Err(e) =
                                        serve_conn(s, &pd, src.as_ref(), &cfg, &counters)
                                    {
                                        tracing::debug!(%peer, error = %e, "rdma connection ended");
                                    }
                                },
                            );
                            if let Ok(h) = h {
                                let mut c = conns2.lock().unwrap_or_else(|p| p.into_inner());
                                c.retain(|(_, h)| !h.is_finished());
                                c.push((watch, h));
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(10))
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            })?;
        Ok(ServerHandle {
            addr,
            stop,
            accept: Some(accept),
            conns,
            counters,
        })
    }
}

/// A running server; [`ServerHandle::shutdown`] (or drop) stops it.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<(TcpStream, JoinHandle<()>)>>>,
    counters: Arc<Counters>,
}

/// What a standalone server counts over all its connections.
#[derive(Debug, Default)]
struct Counters {
    /// Cancel requests received.
    cancels: AtomicU64,
    /// RDMA writes posted (whether they then completed, failed or were flushed).
    writes_posted: AtomicU64,
}

impl ServerHandle {
    /// The control address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    /// How many Cancel requests clients have sent to this server (all connections).
    pub fn cancels_received(&self) -> u64 {
        self.counters.cancels.load(Ordering::Relaxed)
    }
    /// How many RDMA writes this server has posted (all connections), whether they then
    /// completed, failed or were flushed: a test that expects writes to be refused by the
    /// client's queue pairs sees here that they were attempted.
    pub fn writes_posted(&self) -> u64 {
        self.counters.writes_posted.load(Ordering::Relaxed)
    }
    /// Stops accepting, closes every client's control channel (their QPs are torn down, so
    /// clients see a remote disconnect) and waits for the connection threads.
    pub fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|p| p.into_inner()));
        for (s, _) in &conns {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for (_, h) in conns {
            let _ = h.join();
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One client connection: handshake, then loads in arrival order until Bye or EOF.
fn serve_conn(
    mut s: TcpStream,
    pd: &Arc<ProtectionDomain>,
    src: &dyn SliceSource,
    cfg: &ServerConfig,
    counters: &Arc<Counters>,
) -> Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let endpoints = match control::recv(&mut s)? {
        Some(Msg::Hello {
            version, endpoints, ..
        }) => {
            if version != control::VERSION || endpoints.is_empty() || endpoints.len() > cfg.max_qps
            {
                let reason = format!(
                    "version {version} with {} QPs not accepted (want version {}, 1..={} QPs)",
                    endpoints.len(),
                    control::VERSION,
                    cfg.max_qps
                );
                control::send(
                    &mut s,
                    &Msg::Refuse {
                        reason: reason.clone(),
                    },
                )?;
                return Err(RdmaError::Protocol(reason));
            }
            endpoints
        }
        other => {
            return Err(RdmaError::Protocol(format!(
                "expected Hello, got {other:?}"
            )))
        }
    };
    s.set_read_timeout(None)?;
    let ctx = pd.context().clone();
    let n = endpoints.len() as u32;
    let cq = CompletionQueue::new(&ctx, n * (cfg.caps.max_send_wr + cfg.caps.max_recv_wr))?;
    let mut qps = Vec::with_capacity(endpoints.len());
    for ep in &endpoints {
        let qp = QueuePair::create(pd, &cq, &cq, cfg.caps)?
            .to_init()?
            .to_rtr(ep)?
            .to_rts()?;
        qps.push(qp);
    }
    let arena = HostBuffer::new(cfg.arena_bytes)?;
    let arena_mr = MemoryRegion::register(pd, &arena, Access::Local)?;
    control::send(
        &mut s,
        &Msg::Welcome {
            endpoints: qps.iter().map(|q| q.endpoint()).collect(),
            session: 0,
        },
    )?;

    // A reader thread forwards control messages and flags a disconnect, so a load that is
    // waiting for completions notices a vanished client at once.
    let gone = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel::<Result<Option<Msg>>>();
    let mut rs = s.try_clone()?;
    let gone2 = gone.clone();
    let cancel: Arc<Mutex<HashSet<u32>>> = Arc::default();
    let cancel2 = cancel.clone();
    let counters2 = counters.clone();
    let reader = std::thread::Builder::new()
        .name("rdma-conn-ctrl".into())
        .spawn(move || loop {
            let m = control::recv(&mut rs);
            if let Ok(Some(Msg::Cancel { slot })) = m {
                cancel2
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(slot);
                counters2.cancels.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if let Ok(Some(Msg::Load { slot, .. })) = &m {
                cancel2
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(slot);
            }
            let end = !matches!(m, Ok(Some(Msg::Load { .. })));
            if end {
                gone2.store(true, Ordering::Release);
            }
            if tx.send(m).is_err() || end {
                return;
            }
        })?;
    let mut conn = Conn {
        qps,
        cq,
        arena: arena_mr,
        arena_buf: arena,
        cfg: cfg.clone(),
        broken: None,
        next_qp: 0,
        gone,
        cancel,
        counters: counters.clone(),
    };
    let result = loop {
        let m = rx.recv().unwrap_or(Ok(None));
        match m {
            Ok(Some(Msg::Load {
                slot,
                spec,
                targets,
            })) => {
                let (failed, writes) = conn.serve_load(src, slot, &spec, &targets);
                if let Err(e) = control::send(
                    &mut s,
                    &Msg::Done {
                        slot,
                        failed,
                        writes,
                    },
                ) {
                    break Err(e);
                }
                if let Some(why) = &conn.broken {
                    break Err(RdmaError::Broken(why.clone()));
                }
            }
            Ok(Some(Msg::Bye)) | Ok(None) => break Ok(()),
            Ok(Some(other)) => break Err(RdmaError::Protocol(format!("unexpected {other:?}"))),
            Err(e) => break Err(e),
        }
    };
    for qp in &conn.qps {
        let _ = qp.set_error();
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
    let _ = reader.join();
    result
}

struct Conn {
    qps: Vec<QueuePair<Rts>>,
    cq: Arc<CompletionQueue>,
    arena: MemoryRegion,
    arena_buf: Arc<HostBuffer>,
    cfg: ServerConfig,
    broken: Option<String>,
    next_qp: usize,
    gone: Arc<AtomicBool>,
    cancel: Arc<Mutex<HashSet<u32>>>,
    counters: Arc<Counters>,
}

/// Per-load bookkeeping of in-flight writes: arena slot → index into `spec.layers`.
struct Flight {
    free: Vec<usize>,
    inflight: HashMap<usize, usize>,
    failed: Vec<Option<String>>,
    ok_writes: u64,
}

impl Conn {
    /// Serves one load; returns the `(layer, reason)` of each layer not delivered and the
    /// number of writes that completed successfully.
    fn serve_load(
        &mut self,
        src: &dyn SliceSource,
        slot: u32,
        spec: &LoadSpec,
        targets: &[LayerTarget],
    ) -> (Vec<(u32, String)>, u64) {
        let fail_all = |why: String| {
            (
                spec.layers
                    .iter()
                    .map(|&l| (l, why.clone()))
                    .collect::<Vec<_>>(),
                0,
            )
        };
        if let Some(why) = &self.broken {
            return fail_all(why.clone());
        }
        let units = spec.keys.len() as u64;
        let slice = spec.slice_len;
        if let Err(why) = validate(slot, spec, targets) {
            return fail_all(why);
        }
        let slots = (self.arena.len() as u64 / slice)
            .min(self.qps.len() as u64 * u64::from(self.cfg.caps.max_send_wr))
            as usize;
        if slots == 0 {
            return fail_all(format!(
                "slice of {slice} bytes exceeds the staging arena of {} bytes",
                self.arena.len()
            ));
        }
        let deadline = Instant::now() + self.cfg.op_timeout;
        let mut f = Flight {
            free: (0..slots).rev().collect(),
            inflight: HashMap::new(),
            failed: vec![None; spec.layers.len()],
            ok_writes: 0,
        };
        'layers: for (li, t) in targets.iter().enumerate() {
            for unit in 0..units as u32 {
                if f.failed[li].is_some() {
                    break;
                }
                if self.broken.is_some() {
                    break 'layers;
                }
                if self
                    .cancel
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .contains(&slot)
                {
                    for fl in f.failed.iter_mut().skip(li) {
                        fl.get_or_insert_with(|| CANCELLED.to_string());
                    }
                    break 'layers;
                }
                let Some(slot_ix) = self.acquire(&mut f, deadline) else {
                    break 'layers;
                };
                let off = slot_ix * slice as usize;
                // Read straight into the registered slot.
                // SAFETY: `slot_ix` came off the free list, so no posted write reads this slot
                // and no other `&mut` to it exists until it is pushed back; the arena has
                // local access only, so no peer writes into it; the range is inside the arena
                // because `slots * slice <= arena.len()`.
                let dst = unsafe { self.arena_buf.slice_mut(off, slice as usize) };
                if let Err(e) = src.read_slice(spec, t.layer, unit, dst) {
                    f.failed[li] = Some(e.to_string());
                    f.free.push(slot_ix);
                    break;
                }
                let imm = Imm::new(slot, t.layer, unit).map(Imm::encode);
                let qp = &self.qps[self.next_qp % self.qps.len()];
                self.next_qp = self.next_qp.wrapping_add(1);
                let remote = t.addr + u64::from(unit) * slice;
                // SAFETY: the range is slot `slot_ix`, off the free list (nothing writes it)
                // until this signalled write's completion is polled or the QP is flushed in
                // the error state; `self.arena` outlives the QPs (declared after them, so dropped after them).
                match unsafe {
                    qp.post_write(
                        slot_ix as u64,
                        &self.arena,
                        off,
                        slice as usize,
                        remote,
                        t.rkey,
                        imm,
                        true,
                    )
                } {
                    Ok(()) => {
                        self.counters.writes_posted.fetch_add(1, Ordering::Relaxed);
                        f.inflight.insert(slot_ix, li);
                    }
                    Err(e) => {
                        f.free.push(slot_ix);
                        self.broken = Some(format!("posting an RDMA write failed: {e}"));
                    }
                }
            }
        }
        // Drain: every posted write completes (or is flushed) before Done is sent.
        while !f.inflight.is_empty() {
            if !self.reap(&mut f, deadline) {
                break;
            }
        }
        let why_broken = self.broken.clone();
        let mut out = Vec::new();
        for (li, &l) in spec.layers.iter().enumerate() {
            let done_all = f.failed[li].is_none() && why_broken.is_none();
            if !done_all {
                out.push((
                    l,
                    f.failed[li]
                        .clone()
                        .or_else(|| why_broken.clone())
                        .unwrap_or_default(),
                ));
            }
        }
        (out, f.ok_writes)
    }

    /// A free arena slot, reaping completions until one frees; `None` on timeout or breakage.
    fn acquire(&mut self, f: &mut Flight, deadline: Instant) -> Option<usize> {
        loop {
            if let Some(s) = f.free.pop() {
                return Some(s);
            }
            if !self.reap(f, deadline) {
                return None;
            }
        }
    }

    /// Polls the CQ until at least one completion arrives (with back-off); `false` when the
    /// deadline passed or the connection broke.
    fn reap(&mut self, f: &mut Flight, deadline: Instant) -> bool {
        let mut wcs: Vec<Completion> = Vec::new();
        let mut idle = 0u32;
        loop {
            wcs.clear();
            if let Err(e) = self.cq.poll(&mut wcs) {
                self.broken = Some(e.to_string());
                return false;
            }
            if !wcs.is_empty() {
                break;
            }
            if self.gone.load(Ordering::Acquire) && self.broken.is_none() {
                // The client closed its control channel: flush what is in flight (its QPs may
                // be gone, so the writes would otherwise wait for transport retries).
                self.broken = Some("the client disconnected".into());
                for qp in &self.qps {
                    let _ = qp.set_error();
                }
            }
            if Instant::now() >= deadline {
                self.broken = Some(format!("no completion within {:?}", self.cfg.op_timeout));
                for qp in &self.qps {
                    let _ = qp.set_error();
                }
                return false;
            }
            backoff(&mut idle);
        }
        for wc in &wcs {
            let slot_ix = wc.wr_id as usize;
            let li = f.inflight.remove(&slot_ix);
            if li.is_some() {
                f.free.push(slot_ix);
            }
            if wc.is_ok() && li.is_some() {
                f.ok_writes += 1;
            }
            if !wc.is_ok() {
                let why = format!("RDMA write failed on QP {}: {}", wc.qp_num, wc.status_str());
                if let Some(li) = li {
                    f.failed[li].get_or_insert(why.clone());
                }
                if self.broken.is_none() {
                    self.broken = Some(why);
                }
            }
        }
        // On breakage keep draining flushed completions, but do not post more.
        self.broken.is_none() || !f.inflight.is_empty()
    }
}

/// Checks a load request against the immediate's ranges and the targets' lengths.
fn validate(
    slot: u32,
    spec: &LoadSpec,
    targets: &[LayerTarget],
) -> std::result::Result<(), String> {
    let units = spec.keys.len() as u64;
    if spec.slice_len == 0 || spec.slice_len > (1 << 31) {
        return Err(format!("slice_len {} is outside 1..=2^31", spec.slice_len));
    }
    if units == 0 || units > u64::from(Imm::MAX_UNITS) {
        return Err(format!("{units} chunks is outside 1..={}", Imm::MAX_UNITS));
    }
    if slot >= Imm::SLOTS {
        return Err(format!("slot {slot} is outside 0..{}", Imm::SLOTS));
    }
    if targets.len() != spec.layers.len() {
        return Err(format!(
            "{} targets for {} layers",
            targets.len(),
            spec.layers.len()
        ));
    }
    for (t, &l) in targets.iter().zip(&spec.layers) {
        if t.layer != l || l >= Imm::MAX_LAYERS {
            return Err(format!(
                "target for layer {} where layer {l} was expected (max {})",
                t.layer,
                Imm::MAX_LAYERS
            ));
        }
        if t.len != units * spec.slice_len {
            return Err(format!(
                "layer {l}: target of {} bytes, want {} x {}",
                t.len, units, spec.slice_len
            ));
        }
    }
    Ok(())
}
