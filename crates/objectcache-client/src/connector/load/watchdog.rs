//! A load's stall watchdog: what arrived when ([`Progress`], held off on purpose by a
//! [`Hold`]), the stall limit under the `stall_timeout_ms` setting, and the [`watchdog`] task
//! that fails a silent load's missing layers.

use super::LoadShared;
use crate::connector::{StallTimeout, STALL_FIRST_BYTE, STALL_FLOOR};
use crate::error::LayerError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
    pub(super) fn new() -> Self {
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
    setting: StallTimeout,
    p: &Progress,
    now_us: u64,
    unit_bytes: u64,
) -> Option<Duration> {
    match setting {
        StallTimeout::Off => None,
        StallTimeout::After(d) => Some(d),
        StallTimeout::Auto => {
            let first = p.first_us.load(Ordering::Acquire);
            if first == u64::MAX {
                return Some(STALL_FIRST_BYTE);
            }
            // The rate while bytes arrived: up to the last byte, not up to now (silence must
            // not lower the rate, or the limit would grow with the silence).
            let last = p.last_byte_us.load(Ordering::Acquire).min(now_us);
            let secs = (last.saturating_sub(first) as f64 * 1e-6).max(1e-3);
            let rate = p.bytes.load(Ordering::Relaxed) as f64 / secs;
            let next = 4.0 * unit_bytes as f64 / rate.max(1.0);
            Some(STALL_FLOOR.max(Duration::from_secs_f64(next.min(3600.0))))
        }
    }
}

/// The per-load progress watchdog: once nothing has arrived for longer than the stall limit
/// ([`StallTimeout`]) while the load is not held on purpose, every layer not ready yet
/// fails at once with [`LayerError::Stalled`] naming `store`, and the load's reads stop
/// (the layers' status and [`LoadHandle::stall_advice`] then say what to recompute). Ends
/// when every layer is ready or failed. Spawned with the load, as one of its tasks.
///
/// [`LoadHandle::stall_advice`]: super::LoadHandle::stall_advice
pub(crate) async fn watchdog(
    sh: Arc<LoadShared>,
    setting: StallTimeout,
    unit_bytes: u64,
    store: String,
) {
    let p = &sh.progress;
    loop {
        if sh.state.settled() {
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
            if setting == StallTimeout::Auto {
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
