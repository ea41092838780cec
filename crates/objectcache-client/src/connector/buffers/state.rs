//! The per-layer progress of one load ([`LoadState`]) over its [`LayerBuffers`]: which
//! writes are accepted, when a layer is ready or failed, and the wake-ups of its readers.
//! The invariant that makes its copies sound is stated in the parent module.

#![allow(unsafe_code)]

use super::LayerBuffers;
use crate::error::{LayerError, LayerResult};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

/// Status of one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerStatus {
    /// Bytes are still arriving.
    Pending,
    /// Every byte arrived and was verified; the layer may be read.
    Ready,
    /// The layer is a miss and will never be ready.
    Failed(LayerError),
}

#[derive(Default)]
struct Progress {
    /// Accepted write ranges, start -> end (disjoint).
    ranges: BTreeMap<u64, u64>,
    /// Bytes whose copy finished.
    written: u64,
    /// Bytes verified by checksum.
    verified: u64,
    failed: Option<LayerError>,
    ready: bool,
    /// When the layer became ready, since the load started.
    ready_at: Option<std::time::Duration>,
}

/// Shared state of one load: buffers, per-layer progress, and wake-ups.
pub(crate) struct LoadState {
    pub(crate) bufs: LayerBuffers,
    /// Bytes each layer must receive (`chunks x slice_len`), at most the buffer length.
    expected: u64,
    layers: Vec<Mutex<Progress>>,
    ready_flags: Vec<AtomicBool>,
    cancelled: AtomicBool,
    /// Signalled (with `wake_lock`) whenever a layer becomes ready or fails.
    wake_lock: Mutex<u64>,
    wake: Condvar,
    notify: tokio::sync::Notify,
    started: std::time::Instant,
}

impl LoadState {
    pub(crate) fn new(bufs: LayerBuffers, expected: u64) -> Self {
        let n = bufs.layers();
        LoadState {
            bufs,
            expected,
            layers: (0..n).map(|_| Mutex::new(Progress::default())).collect(),
            ready_flags: (0..n).map(|_| AtomicBool::new(false)).collect(),
            cancelled: AtomicBool::new(false),
            wake_lock: Mutex::new(0),
            wake: Condvar::new(),
            notify: tokio::sync::Notify::new(),
            started: std::time::Instant::now(),
        }
    }

    pub(crate) fn layers(&self) -> usize {
        self.layers.len()
    }

    fn signal(&self) {
        *self.wake_lock.lock().expect("lock") += 1;
        self.wake.notify_all();
        self.notify.notify_waiters();
    }

    pub(crate) fn status(&self, l: usize) -> LayerStatus {
        if self.ready_flags[l].load(Ordering::Acquire) {
            return LayerStatus::Ready;
        }
        let p = self.layers[l].lock().expect("lock");
        match &p.failed {
            Some(e) => LayerStatus::Failed(e.clone()),
            None if p.ready => LayerStatus::Ready,
            None => LayerStatus::Pending,
        }
    }

    /// When layer `l` became ready (landed and verified), measured from the load's start.
    pub(crate) fn ready_at(&self, l: usize) -> Option<std::time::Duration> {
        self.layers[l].lock().expect("lock").ready_at
    }

    /// Bytes verified so far of layer `l`.
    pub(crate) fn layer_verified(&self, l: usize) -> u64 {
        self.layers[l].lock().expect("lock").verified
    }

    /// Bytes each layer must receive.
    pub(crate) fn expected(&self) -> u64 {
        self.expected
    }

    /// Time since the load started.
    pub(crate) fn elapsed(&self) -> std::time::Duration {
        self.started.elapsed()
    }

    /// Bytes verified so far over all layers (counted before a layer can become ready).
    pub(crate) fn verified_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|p| p.lock().expect("lock").verified)
            .sum()
    }

    /// A ready layer's bytes, if they lie in one range of memory.
    pub(crate) fn ready_bytes(&self, l: usize) -> Option<&[u8]> {
        match self.ready_parts(l)?.as_slice() {
            [] => Some(&[]),
            [one] => Some(one),
            _ => None,
        }
    }

    /// A ready layer's bytes, one slice per range they lie in, in order.
    pub(crate) fn ready_parts(&self, l: usize) -> Option<Vec<&[u8]>> {
        if !self.ready_flags[l].load(Ordering::Acquire) {
            return None;
        }
        let pieces = self.bufs.layers[l].pieces(0, self.expected)?;
        Some(
            pieces
                .into_iter()
                // SAFETY: the layer is ready (acquire pairs with the release in
                // `finish_write`/`complete`), so every copy into its first `expected` logical
                // bytes has finished and no further write can be accepted (see the module
                // invariant); each piece lies inside one of the layer's ranges.
                .map(|(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) })
                .collect(),
        )
    }

    /// Marks layer `l` ready if it is complete; returns whether it just became ready. The
    /// caller must call `signal` after releasing the layer's lock (`wait_blocking` takes the
    /// wake lock, then a layer lock: signalling under a layer lock would invert that order).
    #[must_use]
    fn try_ready(&self, l: usize, p: &mut Progress) -> bool {
        if p.failed.is_none()
            && !p.ready
            && p.written == self.expected
            && p.verified == self.expected
        {
            p.ready = true;
            p.ready_at = Some(self.started.elapsed());
            self.ready_flags[l].store(true, Ordering::Release);
            return true;
        }
        false
    }

    /// Reserves `offset..offset+len` of layer `l`.
    fn reserve(&self, layer: u32, offset: u64, len: u64) -> LayerResult<()> {
        let l = layer as usize;
        if self.is_cancelled() {
            return Err(LayerError::Cancelled);
        }
        let Some(lock) = self.layers.get(l) else {
            return Err(LayerError::GeometryMismatch {
                chunk: 0,
                reason: format!("layer {layer} out of range"),
            });
        };
        let end =
            offset.checked_add(len).filter(|&e| e <= self.expected).ok_or_else(|| LayerError::GeometryMismatch {
                chunk: (offset / self.expected.max(1)) as usize,
                reason: format!(
                    "write of {len} bytes at offset {offset} would pass the end of layer {layer}'s {} bytes",
                    self.expected
                ),
            })?;
        let mut p = lock.lock().expect("lock");
        // A layer failed by another chunk's miss still takes this chunk's bytes (they land
        // and are verified, so the load can report the chunks before the bad one as loaded,
        // `LoadHandle::loaded_chunks`); the layer never becomes ready. A layer failed for the
        // whole load (timeout, stall, device) takes nothing more.
        if let Some(e) = &p.failed {
            if crate::connector::status::chunk_status_of(e).is_none() {
                return Err(e.clone());
            }
        }
        let before = p.ranges.range(..end).next_back();
        if matches!(before, Some((_, &e)) if e > offset) {
            return Err(LayerError::GeometryMismatch {
                chunk: 0,
                reason: format!("overlapping write at offset {offset} of layer {layer}"),
            });
        }
        if len > 0 {
            p.ranges.insert(offset, end);
        }
        Ok(())
    }

    /// Gives back the reservation of `offset..offset+len` of layer `layer`, a range accepted
    /// by `reserve` whose bytes were never verified (a gather stream broke in the middle of
    /// it), so that another transport can write it again; with `filled`, its bytes had been
    /// counted as written and are uncounted. Returns whether such a range was reserved.
    ///
    /// The caller must know that the writer of the range has ended: its transport's call
    /// returned, so no slice lent for the range is still in use (the connector's failover
    /// calls this only after the stripe's `GatherClient::load` future has completed, which
    /// ends every borrow of the sink that lent the slices). A ready layer is never touched:
    /// every byte of a ready layer is verified.
    pub(crate) fn release(&self, layer: u32, offset: u64, len: u64, filled: bool) -> bool {
        let Some(lock) = self.layers.get(layer as usize) else {
            return false;
        };
        let mut p = lock.lock().expect("lock");
        if p.ready || len == 0 || p.ranges.get(&offset) != Some(&(offset + len)) {
            return false;
        }
        p.ranges.remove(&offset);
        if filled {
            p.written = p.written.saturating_sub(len);
        }
        true
    }

    fn finish_write(&self, l: usize, len: u64) {
        let mut p = self.layers[l].lock().expect("lock");
        p.written += len;
        let ready = self.try_ready(l, &mut p);
        drop(p);
        if ready {
            self.signal();
        }
    }

    pub(crate) fn write_impl(&self, layer: u32, offset: u64, data: &[u8]) -> LayerResult<()> {
        self.reserve(layer, offset, data.len() as u64)?;
        let pieces = self.pieces(layer, offset, data.len() as u64);
        let mut at = 0;
        for (p, n) in pieces {
            // SAFETY: `reserve` checked `offset + len <= expected <= layer length` and recorded
            // the logical range as disjoint from every other accepted range of this layer; its
            // pieces lie in the layer's ranges, which share no byte with any other range of the
            // load (module invariant), so this copy is the only access to these bytes until the
            // layer is ready, which needs this copy's `finish_write` first.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(at), p, n) };
            at += n;
        }
        self.finish_write(layer as usize, data.len() as u64);
        Ok(())
    }

    /// The memory pieces of an already reserved logical range (inside `expected`).
    fn pieces(&self, layer: u32, offset: u64, len: u64) -> Vec<(*mut u8, usize)> {
        self.bufs.layers[layer as usize]
            .pieces(offset, len)
            .expect("a reserved range lies inside the layer's buffer")
    }

    /// Reserves `offset..offset+len` of layer `layer` and lends it for an in-place fill, as
    /// one slice per destination range it spans; [`LoadState::finish_write`] (through
    /// `dest_filled`) once filled.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn dest_parts_impl(
        &self,
        layer: u32,
        offset: u64,
        len: u64,
    ) -> LayerResult<Vec<&mut [u8]>> {
        self.reserve(layer, offset, len)?;
        Ok(self
            .pieces(layer, offset, len)
            .into_iter()
            // SAFETY: as in `write_impl`: `reserve` checked the logical range lies inside the
            // layer and recorded it as disjoint from every other accepted range of this layer,
            // and the pieces are disjoint parts of ranges no other range of the load shares a
            // byte with, so the returned slices are the only access to these bytes; the layer
            // cannot become ready (and be read) before `finish_write` counts them, which the
            // borrower calls after its last write through the slices.
            .map(|(p, n)| unsafe { std::slice::from_raw_parts_mut(p, n) })
            .collect())
    }

    /// As [`LoadState::dest_parts_impl`] when the range lies in one destination range;
    /// `Ok(None)` (nothing reserved) when it spans several.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn dest_mut_impl(
        &self,
        layer: u32,
        offset: u64,
        len: u64,
    ) -> LayerResult<Option<&mut [u8]>> {
        let one = self
            .bufs
            .layers
            .get(layer as usize)
            .and_then(|l| l.pieces(offset, len))
            .is_some_and(|p| p.len() <= 1);
        if !one {
            // Spans ranges (the caller copies through `write`), or is out of bounds (refused
            // there, by name).
            return Ok(None);
        }
        let mut parts = self.dest_parts_impl(layer, offset, len)?;
        Ok(Some(parts.pop().unwrap_or_default()))
    }

    pub(crate) fn placed_impl(&self, layer: u32, offset: u64, len: u64) -> LayerResult<()> {
        self.reserve(layer, offset, len)?;
        self.finish_write(layer as usize, len);
        Ok(())
    }

    pub(crate) fn complete_impl(&self, layer: u32, bytes: u64) {
        if let Some(lock) = self.layers.get(layer as usize) {
            let mut p = lock.lock().expect("lock");
            p.verified += bytes;
            let ready = self.try_ready(layer as usize, &mut p);
            drop(p);
            if ready {
                self.signal();
            }
        }
    }

    pub(crate) fn fail_impl(&self, layer: u32, err: LayerError) {
        if let Some(lock) = self.layers.get(layer as usize) {
            let mut p = lock.lock().expect("lock");
            if p.failed.is_none() && !p.ready {
                p.failed = Some(err);
                drop(p);
                self.signal();
            }
        }
    }

    /// Fails every layer that is not ready yet.
    pub(crate) fn fail_pending(&self, err: LayerError) {
        for l in 0..self.layers.len() {
            self.fail_impl(l as u32, err.clone());
        }
    }

    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        self.fail_pending(LayerError::Cancelled);
    }

    /// Whether every layer is ready or failed (none still pending).
    pub(crate) fn settled(&self) -> bool {
        (0..self.layers()).all(|l| self.status(l) != LayerStatus::Pending)
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Blocks until layer `l` is ready or failed, or `timeout` passes (then `None`).
    pub(crate) fn wait_blocking(
        &self,
        l: usize,
        timeout: Option<std::time::Duration>,
    ) -> Option<LayerStatus> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let mut g = self.wake_lock.lock().expect("lock");
        loop {
            match self.status(l) {
                LayerStatus::Pending => {}
                s => return Some(s),
            }
            g = match deadline {
                None => self.wake.wait(g).expect("lock"),
                Some(d) => {
                    let now = std::time::Instant::now();
                    if now >= d {
                        return None;
                    }
                    self.wake.wait_timeout(g, d - now).expect("lock").0
                }
            };
        }
    }

    /// Waits asynchronously until layer `l` is ready or failed.
    pub(crate) async fn wait(&self, l: usize) -> LayerStatus {
        loop {
            let n = self.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            match self.status(l) {
                LayerStatus::Pending => n.await,
                s => return s,
            }
        }
    }
}

impl crate::transport::LayerSink for LoadState {
    fn write(&self, layer: u32, offset: u64, data: &[u8]) -> LayerResult<()> {
        self.write_impl(layer, offset, data)
    }
    fn placed(&self, layer: u32, offset: u64, len: u64) -> LayerResult<()> {
        self.placed_impl(layer, offset, len)
    }
    fn dest_mut(&self, layer: u32, offset: u64, len: u64) -> LayerResult<Option<&mut [u8]>> {
        self.dest_mut_impl(layer, offset, len)
    }
    fn dest_parts(&self, layer: u32, offset: u64, len: u64) -> LayerResult<Option<Vec<&mut [u8]>>> {
        self.dest_parts_impl(layer, offset, len).map(Some)
    }
    fn dest_filled(&self, layer: u32, len: u64) {
        self.finish_write(layer as usize, len)
    }
    fn complete(&self, layer: u32, bytes: u64) {
        self.complete_impl(layer, bytes)
    }
    fn fail(&self, layer: u32, err: LayerError) {
        self.fail_impl(layer, err)
    }
    fn is_cancelled(&self) -> bool {
        self.is_cancelled()
    }
}
