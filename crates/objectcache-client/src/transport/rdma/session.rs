//! Gather sessions, server end: the RDMA queue pairs a client set up on the server's gather
//! port (behind [`super::control::PREFACE`]), shared by every gather request that names the
//! session's token in its RDMA target.
//!
//! A session owns its RC QPs, one completion queue polled by one thread, and a registered
//! staging arena cut into fixed slots (one delivery unit each, at most 16 MiB). A gather
//! request stages a unit in a free slot, posts one `RDMA_WRITE_WITH_IMM` on the next QP
//! (round-robin) and gets the write's completion through a oneshot channel; the slot is free
//! again as soon as the write completes. Any error completion, a vanished control channel or
//! a timeout breaks the session: its QPs go to the error state (every write in flight flushes
//! and no later write can land) and every request still using it turns its undelivered
//! layers into misses.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{oneshot, Semaphore};

use super::context::{Context, DeviceSelector};
use super::control::{self, Msg};
use super::cq::{backoff, Completion, CompletionQueue};
use super::mr::{Access, HostBuffer, MemoryRegion};
use super::pd::ProtectionDomain;
use super::qp::{QpCaps, QueuePair, Rts};
use super::{RdmaError, Result};

/// RDMA settings of a server (its gather sessions).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Device, port and GID.
    pub device: DeviceSelector,
    /// Bytes of the registered staging arena per connection (default 64 MiB). One slot holds
    /// one unit (one slice); slots are reused when their write completes, so this bounds the
    /// server's memory per connection whatever the load size.
    pub arena_bytes: usize,
    /// QP queue sizes.
    pub caps: QpCaps,
    /// Most QPs a client may ask for (default 16).
    pub max_qps: usize,
    /// How long one load may wait for a free slot or its last completions (default 30 s).
    pub op_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            device: DeviceSelector::default(),
            arena_bytes: 64 << 20,
            caps: QpCaps::default(),
            max_qps: 16,
            op_timeout: Duration::from_secs(30),
        }
    }
}

/// Result of one posted write, delivered when its completion is polled.
pub type WriteResult = std::result::Result<(), String>;

/// Every gather session of one server, by token.
pub struct SessionRegistry {
    pd: Arc<ProtectionDomain>,
    cfg: ServerConfig,
    slot_bytes: usize,
    sessions: Mutex<HashMap<u64, (Arc<GatherSession>, TcpStream)>>,
    seed: std::collections::hash_map::RandomState,
    counter: AtomicU64,
    writes: Arc<AtomicU64>,
}

impl std::fmt::Debug for SessionRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionRegistry")
            .field("device", &self.pd.context().name())
            .field("sessions", &self.len())
            .finish()
    }
}

impl SessionRegistry {
    /// Opens the device named by `cfg.device`. Each session gets an arena of
    /// `cfg.arena_bytes` cut into slots of `slot_bytes` (the largest unit it will carry,
    /// 16 MiB for the gather protocol's largest unit).
    ///
    /// # Errors
    /// [`RdmaError::NoDevice`] when this host has no RDMA device (serve gather over TCP only);
    /// [`RdmaError::InvalidArgument`] when the arena cannot hold one slot.
    pub fn open(cfg: ServerConfig, slot_bytes: usize) -> Result<Arc<Self>> {
        if slot_bytes == 0 || cfg.arena_bytes < slot_bytes || cfg.max_qps == 0 {
            return Err(RdmaError::InvalidArgument(format!(
                "arena of {} bytes cannot hold a slot of {slot_bytes} bytes (or max_qps is 0)",
                cfg.arena_bytes
            )));
        }
        let ctx = Context::open(&cfg.device)?;
        let pd = ProtectionDomain::new(&ctx)?;
        Ok(Arc::new(SessionRegistry {
            pd,
            cfg,
            slot_bytes,
            sessions: Mutex::new(HashMap::new()),
            seed: std::collections::hash_map::RandomState::new(),
            counter: AtomicU64::new(1),
            writes: Arc::default(),
        }))
    }

    /// The device's name (`rxe0`, `mlx5_0`).
    pub fn device(&self) -> &str {
        self.pd.context().name()
    }

    /// The session with token `token`, if it is open and not broken.
    pub fn get(&self, token: u64) -> Option<Arc<GatherSession>> {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&token)
            .map(|(s, _)| s.clone())
    }

    /// RDMA writes completed successfully over all sessions since the server started.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Number of open sessions.
    pub fn len(&self) -> usize {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// `true` when no session is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes every session's control channel (server shutdown); their threads then end.
    pub fn shutdown(&self) {
        for (s, sock) in self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            s.break_session("the server is shutting down");
            let _ = sock.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Tears `session` down: out of the registry (no gather request finds it any more),
    /// broken for `why` (its QPs to the error state), and its completion `poller` stopped
    /// and joined (it fails whatever still waits for a completion).
    fn close(&self, session: &GatherSession, poller: JoinHandle<()>, why: &str) {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&session.token);
        session.break_session(why);
        session.stop.store(true, Ordering::Release);
        let _ = poller.join();
    }

    fn token(&self) -> u64 {
        let mut h = self.seed.build_hasher();
        h.write_u64(self.counter.fetch_add(1, Ordering::Relaxed));
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish() | 1
    }

    /// Serves one set-up channel whose 8-byte preface was already read: `Hello` (with
    /// `gather: true`), QP bring-up, `Welcome` with the session token; then blocks until the
    /// client says `Bye` or the channel closes, and tears the session down (QPs to the error
    /// state, requests still using it see their writes fail). Run it on its own thread.
    ///
    /// # Errors
    /// [`RdmaError::Protocol`] for a bad or refused `Hello`; verbs errors during bring-up;
    /// [`RdmaError::Io`] on the channel.
    pub fn serve_control(self: &Arc<Self>, mut s: TcpStream) -> Result<()> {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let endpoints = match control::recv(&mut s)? {
            Some(Msg::Hello {
                version,
                endpoints,
                gather: true,
            }) if version == control::VERSION
                && !endpoints.is_empty()
                && endpoints.len() <= self.cfg.max_qps =>
            {
                endpoints
            }
            other => {
                let reason = format!(
                    "expected a gather Hello of version {} with 1..={} QPs, got {other:?}",
                    control::VERSION,
                    self.cfg.max_qps
                );
                let _ = control::send(
                    &mut s,
                    &Msg::Refuse {
                        reason: reason.clone(),
                    },
                );
                return Err(RdmaError::Protocol(reason));
            }
        };
        s.set_read_timeout(None)?;
        let ctx = self.pd.context().clone();
        let n = endpoints.len() as u32;
        let cq = CompletionQueue::new(
            &ctx,
            n * (self.cfg.caps.max_send_wr + self.cfg.caps.max_recv_wr),
        )?;
        let mut qps = Vec::with_capacity(endpoints.len());
        for ep in &endpoints {
            qps.push(
                QueuePair::create(&self.pd, &cq, &cq, self.cfg.caps)?
                    .to_init()?
                    .to_rtr(ep)?
                    .to_rts()?,
            );
        }
        let slots = (self.cfg.arena_bytes / self.slot_bytes)
            .min(self.cfg.caps.max_send_wr as usize)
            .max(1);
        let arena_buf = HostBuffer::new(slots * self.slot_bytes)?;
        let arena = MemoryRegion::register(&self.pd, &arena_buf, Access::Local)?;
        let token = self.token();
        let session = Arc::new(GatherSession {
            token,
            qps,
            cq,
            arena,
            arena_buf,
            slot_bytes: self.slot_bytes,
            // Every in-flight unit holds one slot: with at most this many writes per unit, one
            // queue pair's send queue holds all of them even if every unit went to it.
            max_pieces: (self.cfg.caps.max_send_wr as usize / slots).max(1),
            free: Mutex::new((0..slots).rev().collect()),
            permits: Semaphore::new(slots),
            next_qp: AtomicUsize::new(0),
            waiters: Mutex::new(HashMap::new()),
            broken: Mutex::new(None),
            stop: AtomicBool::new(false),
            op_timeout: self.cfg.op_timeout,
            writes: AtomicU64::new(0),
            total: self.writes.clone(),
        });
        let sess = session.clone();
        let poller: JoinHandle<()> = std::thread::Builder::new()
            .name("rdma-sess-poll".into())
            .spawn(move || sess.poll_loop())?;
        // Registered before the client learns the token: its first gather request may follow
        // the Welcome at once.
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, (session.clone(), s.try_clone()?));
        if let Err(e) = control::send(
            &mut s,
            &Msg::Welcome {
                endpoints: session.qps.iter().map(|q| q.endpoint()).collect(),
                session: token,
            },
        ) {
            self.close(&session, poller, "sending Welcome failed");
            return Err(e);
        }
        tracing::info!(
            token = format!("{token:016x}"),
            qps = session.qps.len(),
            slots,
            "rdma gather session open"
        );
        // The control connection carries nothing more than the goodbye: the session lasts
        // until it comes, or the connection ends.
        let end = match control::recv(&mut s) {
            Ok(Some(Msg::Bye)) | Ok(None) => Ok(()),
            Ok(Some(other)) => Err(RdmaError::Protocol(format!(
                "unexpected {other:?} on a gather session"
            ))),
            Err(e) => Err(e),
        };
        self.close(&session, poller, "the client closed the RDMA session");
        let _ = s.shutdown(std::net::Shutdown::Both);
        tracing::info!(token = format!("{token:016x}"), writes = session.writes.load(Ordering::Relaxed), end = ?end, "rdma gather session closed");
        end
    }
}

/// One client's RDMA session on the server (see the module doc).
pub struct GatherSession {
    token: u64,
    qps: Vec<QueuePair<Rts>>,
    cq: Arc<CompletionQueue>,
    arena: MemoryRegion,
    arena_buf: Arc<HostBuffer>,
    slot_bytes: usize,
    max_pieces: usize,
    free: Mutex<Vec<usize>>,
    permits: Semaphore,
    next_qp: AtomicUsize,
    waiters: Mutex<HashMap<u64, oneshot::Sender<WriteResult>>>,
    broken: Mutex<Option<String>>,
    stop: AtomicBool,
    op_timeout: Duration,
    writes: AtomicU64,
    total: Arc<AtomicU64>,
}

impl std::fmt::Debug for GatherSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatherSession")
            .field("token", &format_args!("{:016x}", self.token))
            .field("qps", &self.qps.len())
            .finish()
    }
}

impl GatherSession {
    /// Largest unit one write can carry, bytes.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// How long a request waits for a free slot or a completion before the session breaks.
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// `Some(reason)` once the session is broken.
    pub fn broken(&self) -> Option<String> {
        self.broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Breaks the session: QPs to the error state (writes in flight flush with errors, no
    /// later write can land). The first reason is kept.
    pub fn break_session(&self, why: &str) {
        {
            let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
            if b.is_none() {
                *b = Some(why.to_string());
            }
        }
        for qp in &self.qps {
            let _ = qp.set_error();
        }
        // Wake requests waiting for a slot: they see the session broken.
        self.permits.close();
    }

    /// Most destination pieces one unit may be written to ([`GatherSession::write_pieces`]):
    /// every in-flight unit holds one staging slot and at most this many send-queue entries,
    /// so the send queue never overflows (`max_send_wr / slots`).
    pub fn max_pieces(&self) -> usize {
        self.max_pieces
    }

    /// Stages `parts` (one unit, concatenated) in a free arena slot and posts one
    /// `RDMA_WRITE_WITH_IMM` of it to `remote_addr` (rkey `rkey`) with immediate `imm`. Waits
    /// (at most the session's op timeout) for a free slot. The returned receiver yields the
    /// write's completion; the slot is reused once it has completed.
    ///
    /// # Errors
    /// A message when the session is broken, the unit exceeds a slot, no slot freed in time,
    /// or posting failed (which breaks the session).
    pub async fn write(
        &self,
        imm: u32,
        parts: &[Bytes],
        remote_addr: u64,
        rkey: u32,
    ) -> std::result::Result<oneshot::Receiver<WriteResult>, String> {
        let len: usize = parts.iter().map(|b| b.len()).sum();
        self.write_pieces(imm, parts, &[(remote_addr, rkey, len as u64)])
            .await
    }

    /// As [`GatherSession::write`], to a destination in `remote` pieces `(address, rkey,
    /// length)` whose lengths add up to the unit's: the staged unit is posted as one
    /// unsignaled `RDMA_WRITE` per piece but the last, then a signaled `RDMA_WRITE_WITH_IMM`
    /// of the last piece, all on one RC queue pair, which executes them in order, so the
    /// client's completion of the immediate comes after every piece has landed. At most
    /// [`GatherSession::max_pieces`] pieces.
    ///
    /// # Errors
    /// As [`GatherSession::write`]; also a message when the pieces do not add up to the
    /// unit or are too many.
    pub async fn write_pieces(
        &self,
        imm: u32,
        parts: &[Bytes],
        remote: &[(u64, u32, u64)],
    ) -> std::result::Result<oneshot::Receiver<WriteResult>, String> {
        let len: usize = parts.iter().map(|b| b.len()).sum();
        if len == 0 || len > self.slot_bytes {
            return Err(format!(
                "unit of {len} bytes does not fit a staging slot of {} bytes",
                self.slot_bytes
            ));
        }
        let pieces_len: u64 = remote.iter().map(|p| p.2).sum();
        if remote.is_empty()
            || remote.len() > self.max_pieces
            || pieces_len != len as u64
            || remote.iter().any(|p| p.2 == 0)
        {
            return Err(format!(
                "a unit of {len} bytes cannot be written as {} pieces of {pieces_len} bytes (at most {} non-empty pieces)",
                remote.len(),
                self.max_pieces
            ));
        }
        if let Some(why) = self.broken() {
            return Err(why);
        }
        let permit = match tokio::time::timeout(self.op_timeout, self.permits.acquire()).await {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => {
                return Err(self
                    .broken()
                    .unwrap_or_else(|| "RDMA session closed".into()))
            }
            Err(_) => {
                let why = format!("no staging slot freed within {:?}", self.op_timeout);
                self.break_session(&why);
                return Err(why);
            }
        };
        permit.forget();
        let ix = self
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .expect("a permit guarantees a free slot");
        let off = ix * self.slot_bytes;
        // SAFETY: slot `ix` came off the free list under a permit, so no posted write reads it
        // and no other reference to it exists until it is pushed back by the poller; the arena
        // is registered for local access only (no peer writes into it); the range lies inside
        // the arena (`slots * slot_bytes` bytes, `len <= slot_bytes`).
        let dst = unsafe { self.arena_buf.slice_mut(off, len) };
        let mut at = 0;
        for p in parts {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ix as u64, tx);
        let qp = &self.qps[self.next_qp.fetch_add(1, Ordering::Relaxed) % self.qps.len()];
        let mut local = off;
        for (k, &(remote_addr, rkey, n)) in remote.iter().enumerate() {
            let last = k + 1 == remote.len();
            // SAFETY: the range is slot `ix`, which stays off the free list (so nothing
            // writes it) until the poller sees this write's signalled completion, or until the
            // session is broken and its QPs flushed; `self.arena` outlives
            // the QPs (declared after them, so dropped after them).
            let r = unsafe {
                qp.post_write(
                    ix as u64,
                    &self.arena,
                    local,
                    n as usize,
                    remote_addr,
                    rkey,
                    last.then_some(imm),
                    last,
                )
            };
            if let Err(e) = r {
                let why = format!("posting an RDMA write failed: {e}");
                // Pieces already posted may still complete (unsignaled) or flush: breaking the
                // session moves the QPs to the error state first; the slot goes back only when
                // nothing posted can read it any more.
                self.break_session(&why);
                if k == 0 {
                    self.waiters
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&(ix as u64));
                    self.release(ix);
                }
                return Err(why);
            }
            local += n as usize;
        }
        // The poller may have stopped (session torn down) before this waiter was registered:
        // then nobody would ever complete it. `stop` is set before the poller drains the
        // waiters, so a waiter registered after the drain sees it here.
        if self.stop.load(Ordering::Acquire) {
            self.waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(ix as u64));
            return Err(self
                .broken()
                .unwrap_or_else(|| "RDMA session closed".into()));
        }
        Ok(rx)
    }

    fn release(&self, ix: usize) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).push(ix);
        self.permits.add_permits(1);
    }

    fn poll_loop(&self) {
        let mut wcs: Vec<Completion> = Vec::new();
        let mut idle = 0u32;
        loop {
            wcs.clear();
            if let Err(e) = self.cq.poll(&mut wcs) {
                self.break_session(&format!("polling the completion queue failed: {e}"));
            }
            if wcs.is_empty() {
                if self.stop.load(Ordering::Acquire) {
                    // Tear-down: fail whatever still waits (its QP is in the error state).
                    let why = self
                        .broken()
                        .unwrap_or_else(|| "RDMA session closed".into());
                    for (_, tx) in self
                        .waiters
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .drain()
                    {
                        let _ = tx.send(Err(why.clone()));
                    }
                    return;
                }
                backoff(&mut idle);
                continue;
            }
            idle = 0;
            for wc in &wcs {
                let tx = self
                    .waiters
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&wc.wr_id);
                let r = if wc.is_ok() {
                    self.writes.fetch_add(1, Ordering::Relaxed);
                    self.total.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                } else {
                    let why = format!("RDMA write failed on QP {}: {}", wc.qp_num, wc.status_str());
                    self.break_session(&why);
                    Err(why)
                };
                if let Some(tx) = tx {
                    self.release(wc.wr_id as usize);
                    let _ = tx.send(r);
                }
            }
        }
    }
}
