//! A connection's shared state: its loads (per layer, a [`LayerTally`]), the completion
//! thread that counts RDMA_WRITE_WITH_IMM receive completions, the control-channel reader,
//! and how a connection breaks. Sink calls are decided under the state lock and run after it
//! is released.

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::error::LayerError;
use crate::transport::LayerSink;

use super::ClientConfig;
use crate::transport::rdma::control;
use crate::transport::rdma::cq::{backoff, Completion, CompletionQueue};
use crate::transport::rdma::imm::Imm;
use crate::transport::rdma::mr::{MemoryRegion, RegistrationCache};
use crate::transport::rdma::qp::{QueuePair, Rts};
use objectcache_core::rdma::tally::{LayerState, LayerTally};

/// How a load ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOutcome {
    /// Layers delivered completely, in the order their last unit arrived.
    pub ready: Vec<u32>,
    /// Layers that are misses, with why.
    pub failed: Vec<(u32, LayerError)>,
}

pub(super) struct LoadState {
    pub(super) sink: Arc<dyn LayerSink>,
    pub(super) layers: HashMap<u32, LayerTally>,
    pub(super) deadline: Instant,
    pub(super) server_done: bool,
    /// Set when the connection broke: the load ends once its sink calls have run.
    pub(super) aborted: bool,
    /// Sink calls decided under the lock but not yet run.
    pub(super) sink_pending: u32,
    /// Writes the server reported complete (its `End`) and receive completions seen so far.
    pub(super) writes_expected: u64,
    pub(super) writes_seen: u64,
    pub(super) outcome: LoadOutcome,
    pub(super) finished: bool,
    pub(super) _mrs: Vec<Arc<MemoryRegion>>,
}

impl LoadState {
    fn all_resolved(&self) -> bool {
        self.layers
            .values()
            .all(|l| l.state() != LayerState::Pending)
    }
}

/// A sink call made after the state lock is released.
pub(super) enum Action {
    /// `placed(layer, offset, len)` then `complete(layer, len)`: the bytes were written by
    /// the NIC and verified by the server's CRC32C check before they were sent (RoCE's ICRC
    /// protects them on the wire). The sink also hears [`LayerSink::landed`] for them.
    Placed(Arc<dyn LayerSink>, u32, u64, u64),
    Fail(Arc<dyn LayerSink>, u32, LayerError),
}

pub(super) fn run(actions: Vec<Action>) {
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

pub(super) struct ConnState {
    pub(super) broken: Option<String>,
    pub(super) loads: HashMap<u32, LoadState>,
    pub(super) free_slots: Vec<u32>,
}

pub(super) struct ConnShared {
    pub(super) cache: RegistrationCache,
    pub(super) cq: Arc<CompletionQueue>,
    pub(super) qps: Vec<QueuePair<Rts>>,
    pub(super) writer: Mutex<TcpStream>,
    pub(super) state: Mutex<ConnState>,
    pub(super) cv: Condvar,
    /// Woken (with `cv`) whenever a load finishes: async waiters ([`super::LoadHandle::finished`]).
    pub(super) finished: tokio::sync::Notify,
    pub(super) stop: AtomicBool,
    pub(super) cfg: ClientConfig,
    /// Per QP: its drain marker (see [`DRAIN_MARK`]) has completed.
    pub(super) drained: Vec<AtomicBool>,
    /// The drain markers were posted (once, by the first [`ConnShared::break_conn`]).
    pub(super) drain_posted: AtomicBool,
    /// A drain gave up waiting for its markers ([`DRAIN_WAIT`]), or could not post one.
    pub(super) drain_late: AtomicBool,
}

/// `wr_id` bit of a drain marker: the receive posted on a QP after it was moved to the error
/// state, whose flush completion proves that the QP's responder has finished with every
/// packet that arrived before (a QP completes its receives in order, and flushes them only
/// once in the error state), so that no write of the server can still be placed in memory.
/// The low bits name the QP. Each QP keeps one receive slot free for it
/// (`QpCaps::max_recv_wr - 1` receives posted).
pub(super) const DRAIN_MARK: u64 = 1 << 63;

/// How long [`ConnShared::break_conn`] waits for the drain markers' completions (they flush in
/// microseconds on rxe and on NICs; the bound only keeps a broken driver from hanging the
/// caller, which then logs an error).
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl ConnShared {
    pub(super) fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Breaks the connection: every pending layer of every load becomes a miss, QPs go to
    /// ERROR and are drained ([`ConnShared::drain`]: no late write can land once it returns),
    /// then the sinks hear the misses and the control channel is shut. `timed_out` names the
    /// load whose deadline passed. The first caller's reason wins (the socket shutdown below
    /// wakes the control reader, which then calls this again with "closed").
    pub(super) fn break_conn(&self, why: String, timed_out: Option<u32>) {
        let mut actions = Vec::new();
        let mut ran = Vec::new();
        {
            let mut st = self.lock();
            tracing::debug!(reason = %why, "rdma client connection breaks");
            let why = st.broken.get_or_insert(why).clone();
            for (slot, ld) in st.loads.iter_mut() {
                for (&layer, lp) in ld.layers.iter_mut() {
                    if let Some(chunk) = lp.fail() {
                        let err = if timed_out == Some(*slot) {
                            LayerError::Timeout {
                                layer: layer as usize,
                            }
                        } else {
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
        self.drain();
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

    /// Waits until no write of the server can land any more: the QPs are in the error
    /// state (set by the caller), so each one's receives flush; a marker receive posted
    /// after the transition completes after every packet the QP took before it (see
    /// [`DRAIN_MARK`]). Polls the completion queue itself, so it works from the completion
    /// thread too; completions other than the markers are dropped (the connection is broken,
    /// the layers they belong to are already misses). Bounded by [`DRAIN_WAIT`].
    fn drain(&self) {
        if !self.drain_posted.swap(true, Ordering::AcqRel) {
            for (i, qp) in self.qps.iter().enumerate() {
                if let Err(e) = qp.post_recv(DRAIN_MARK | i as u64) {
                    // No marker: nothing to wait for on this QP but its state (logged, and
                    // reported by `RdmaClient::drained` as not drained).
                    tracing::error!(qp = i, error = %e, "posting the drain marker failed");
                    self.drain_late.store(true, Ordering::Release);
                    self.drained[i].store(true, Ordering::Release);
                }
                // Once more to the error state (a legal transition from it): a provider that
                // posts receives without entering the kernel (rxe's) has the responder flush
                // its queue only when the kernel schedules it, which the transition does; a
                // marker posted after the first transition's flush would otherwise wait.
                let _ = qp.set_error();
            }
        }
        let until = Instant::now() + DRAIN_WAIT;
        let mut wcs = Vec::new();
        let mut idle = 0;
        while !self.drained.iter().all(|d| d.load(Ordering::Acquire)) {
            if Instant::now() >= until {
                self.drain_late.store(true, Ordering::Release);
                tracing::error!(
                    "the RDMA queue pairs did not flush within {DRAIN_WAIT:?} of moving to \
                     the error state"
                );
                return;
            }
            wcs.clear();
            if self.cq.poll(&mut wcs).is_err() {
                backoff(&mut idle);
                continue;
            }
            if wcs.is_empty() {
                backoff(&mut idle);
            }
            for wc in &wcs {
                self.note_drained(wc);
            }
        }
    }

    /// Records a drain marker's completion; `false` for any other completion.
    pub(super) fn note_drained(&self, wc: &Completion) -> bool {
        if wc.wr_id & DRAIN_MARK == 0 {
            return false;
        }
        if let Some(d) = self.drained.get((wc.wr_id & !DRAIN_MARK) as usize) {
            d.store(true, Ordering::Release);
        }
        true
    }

    /// Records that the sink calls counted in `ran` (one entry per call, by slot) have run,
    /// then finishes the loads in `ran` and `check` that are complete. A load finishes only
    /// after every sink call for it has run, so a waiter never sees a layer "ready" before
    /// the sink does.
    pub(super) fn settle(&self, ran: &[u32], check: &[u32]) {
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
            self.finished.notify_waiters();
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
            let (off, len) = lp
                .slice(layer, imm.unit, u64::from(wc.byte_len))
                .map_err(|e| e.to_string())?;
            actions.push(Action::Placed(ld.sink.clone(), layer, off, len));
            ld.sink_pending += 1;
            touched.push(slot);
            return Ok(());
        }
        let landed = lp
            .unit(layer, usize::from(imm.unit), u64::from(wc.byte_len))
            .map_err(|e| e.to_string())?;
        if let Some(l) = landed {
            actions.push(Action::Placed(ld.sink.clone(), layer, l.offset, l.len));
            if l.ready {
                ld.outcome.ready.push(layer);
            }
            // the sink call runs after the lock is released; the load cannot finish before
            ld.sink_pending += 1;
            touched.push(slot);
        }
        Ok(())
    }

    /// The server's `End` of load `slot`: it made `writes` successful writes (its misses came
    /// before, as `Miss` frames). The load finishes once that many completions have arrived.
    pub(super) fn on_end(&self, slot: u32, writes: u64) {
        {
            let mut st = self.lock();
            let Some(ld) = st.loads.get_mut(&slot) else {
                return;
            };
            ld.server_done = true;
            ld.writes_expected = writes;
        }
        self.settle(&[], &[slot]);
    }
}

/// Completion loop: one per connection.
pub(super) fn poll_loop(sh: &ConnShared) {
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
            backoff(&mut idle);
            continue;
        }
        idle = 0;
        let mut actions = Vec::new();
        let mut touched = Vec::new();
        let mut check = Vec::new();
        for wc in &wcs {
            if sh.note_drained(wc) {
                continue;
            }
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

/// Set-up channel reader: after the Welcome nothing more comes on it, so it only notices
/// the server going away (end of stream, an error, or a message it never sends).
pub(super) fn read_loop(sh: &ConnShared, mut s: TcpStream) {
    let why = match control::recv(&mut s) {
        Ok(Some(other)) => format!("unexpected control message {other:?}"),
        Ok(None) => "the server closed the control channel".into(),
        Err(e) => format!("control channel failed: {e}"),
    };
    if !sh.stop.load(Ordering::Acquire) {
        sh.break_conn(why, None);
    }
}
