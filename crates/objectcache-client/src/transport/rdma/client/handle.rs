//! A running load's handle: wait for it, end it as the gather server says, or abort it.

use std::sync::Arc;
use std::time::Duration;

use crate::error::LayerError;

use super::state::{run, Action, ConnShared, LoadOutcome};

/// A running load. [`LoadHandle::wait`] returns when every layer is ready or a miss.
pub struct LoadHandle {
    pub(super) shared: Arc<ConnShared>,
    pub(super) slot: Option<u32>,
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
            self.shared.on_end(slot, writes);
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
                    if lp.fail().is_some() {
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
                .is_none_or(|l| l.layers.values().all(|lp| lp.all_in()))
        })
    }

    /// `true` once the load has ended (every layer ready or a miss, and every write counted).
    pub fn is_finished(&self) -> bool {
        self.slot
            .is_none_or(|s| self.shared.lock().loads.get(&s).is_none_or(|l| l.finished))
    }

    /// Returns once [`LoadHandle::is_finished`] is true, without blocking a thread: woken when
    /// a load of the session finishes (the session's poller finishes loads that pass its load
    /// deadline, so this is bounded by it).
    pub async fn finished(&self) {
        loop {
            let woken = self.shared.finished.notified();
            tokio::pin!(woken);
            // Registered before the check, so a load finishing in between still wakes it.
            woken.as_mut().enable();
            if self.is_finished() {
                return;
            }
            woken.await;
        }
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
