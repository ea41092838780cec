//! [`LoadHandle`], the caller's view of a load in progress: per-layer waits and status,
//! the verified bytes, per-chunk status, counters, the stall advice, cancel and the
//! buffers handed back.

use super::{LoadShared, LoadStats, MAX_ADVICE_TOKENS};
use crate::connector::buffers::{LayerBuffers, LayerStatus};
use crate::connector::status::{chunk_status_of, ChunkStatus};
use crate::error::{LayerError, LayerResult};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A load in progress: per-layer readiness over the caller's destination buffers.
///
/// Dropping the handle cancels the load and waits for in-flight copies to stop.
pub struct LoadHandle {
    pub(crate) sh: Arc<LoadShared>,
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
    pub async fn wait_layer(&self, l: usize) -> LayerResult<()> {
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
    pub fn wait_layer_blocking(&self, l: usize, timeout: Option<Duration>) -> LayerResult<()> {
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
    pub async fn wait_all(&self) -> LayerResult<()> {
        for l in 0..self.layers() {
            self.wait_layer(l).await?;
        }
        Ok(())
    }

    /// Blocking form of [`LoadHandle::wait_all`].
    ///
    /// # Errors
    /// The first failed layer's error.
    pub fn wait_all_blocking(&self) -> LayerResult<()> {
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
        let st = &self.sh.state;
        let settled = st.settled();
        if !settled {
            st.cancel();
        }
        let sh = self.sh.clone();
        let wait = async move {
            if settled {
                // Every layer is ready or failed: the tasks get a moment to end on their own
                // (a gather stripe reads the server's `End` behind its last unit, then pools
                // its connection), then the rest are cancelled as below.
                let mut tasks = std::mem::take(&mut *sh.tasks.lock().expect("lock"));
                let all = futures::future::join_all(tasks.iter_mut());
                let _ = tokio::time::timeout(SETTLED_GRACE, all).await;
                tasks.retain(|t| !t.is_finished());
                sh.state.cancel();
                sh.tasks.lock().expect("lock").extend(tasks);
            }
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

/// How long a load whose every layer is ready or failed lets its tasks end on their own when
/// its handle ends, before they are cancelled. A gather stripe whose last unit completed the
/// load still reads the server's `End` frame right behind it, then its connection goes back
/// to the engine's pool; cancelled first, the connection is closed and the next load opens a
/// new one, paying a handshake and the hello. Measured through a 50 ms one-way delay
/// (`objectcache-bench transfer --context 32768 --paths gather-tcp --delay-ms 50`): every
/// load opened one or two new connections and its first layer took 465-787 ms; with the
/// connections reused, 156-187 ms. The wait ends as soon as the tasks do
/// (microseconds when `End` is on its way); 50 ms leaves room for a busy machine to schedule
/// them, and is what a dropped handle costs when a server never sends `End`.
const SETTLED_GRACE: Duration = Duration::from_millis(50);

impl Drop for LoadHandle {
    fn drop(&mut self) {
        self.finish();
    }
}
