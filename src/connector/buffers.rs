//! Destination buffers of a load and the per-layer progress that guards them.
//!
//! This is the one place of the connector with `unsafe`: transports copy bytes into the
//! caller's memory from many tasks while the caller reads layers that are already ready.
//! Soundness rests on one invariant, enforced under a per-layer lock:
//!
//! *every accepted write covers a byte range of its layer that no other accepted write
//! covers, and a layer is ready only once accepted writes cover all of it and every copy has
//! finished.*
//!
//! So no two copies touch the same byte, no copy runs into a ready layer (any new range would
//! overlap the full coverage and be refused), and a reader of a ready layer sees only finished
//! writes (the ready flag is published with release ordering and read with acquire).
#![allow(unsafe_code)]

use crate::error::LayerError;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

/// One layer's destination memory.
struct Region {
    ptr: *mut u8,
    len: usize,
}

/// Per-layer destination buffers for a load: layer `l` receives `chunks x slice_len` bytes,
/// chunk `c`'s slice (K then V, CRC excluded) at offset `c x slice_len`.
///
/// Either owned (allocated here or moved in from `Vec`s) or borrowed from the caller through
/// [`LayerBuffers::from_raw`] (the C ABI's registered memory).
pub struct LayerBuffers {
    regions: Vec<Region>,
    owned: Option<Vec<Vec<u8>>>,
}

// SAFETY: the raw pointers refer either to `owned` (moved with the struct) or to memory the
// caller of `from_raw` promised stays valid and unaliased; access is coordinated by `LoadState`.
unsafe impl Send for LayerBuffers {}
// SAFETY: as above; shared access only reads ready layers or writes disjoint ranges.
unsafe impl Sync for LayerBuffers {}

impl std::fmt::Debug for LayerBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerBuffers")
            .field("layers", &self.regions.len())
            .field("bytes_per_layer", &self.regions.first().map(|r| r.len))
            .field("owned", &self.owned.is_some())
            .finish()
    }
}

impl LayerBuffers {
    /// Allocates `layers` zeroed buffers of `bytes_per_layer` bytes each.
    pub fn allocate(layers: usize, bytes_per_layer: usize) -> Self {
        Self::from_vecs((0..layers).map(|_| vec![0u8; bytes_per_layer]).collect())
    }

    /// Takes ownership of one `Vec` per layer.
    pub fn from_vecs(mut v: Vec<Vec<u8>>) -> Self {
        let regions = v
            .iter_mut()
            .map(|b| Region {
                ptr: b.as_mut_ptr(),
                len: b.len(),
            })
            .collect();
        LayerBuffers {
            regions,
            owned: Some(v),
        }
    }

    /// Borrows caller memory: one `(pointer, length in bytes)` per layer.
    ///
    /// # Safety
    /// Each region must be valid for writes of `len` bytes, must not overlap another region,
    /// and must not be read or written by anyone else until the [`super::LoadHandle`] that
    /// uses these buffers has been released (which waits for every in-flight copy).
    pub unsafe fn from_raw(regions: &[(*mut u8, usize)]) -> Self {
        LayerBuffers {
            regions: regions
                .iter()
                .map(|&(ptr, len)| Region { ptr, len })
                .collect(),
            owned: None,
        }
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.regions.len()
    }

    /// Length in bytes of layer `l`'s buffer.
    pub fn layer_len(&self, l: usize) -> usize {
        self.regions[l].len
    }

    /// Base address and length of layer `l`'s buffer, for memory registration (RDMA, CUDA).
    pub fn region(&self, l: usize) -> (*mut u8, usize) {
        (self.regions[l].ptr, self.regions[l].len)
    }

    /// `true` for caller memory given through [`LayerBuffers::from_raw`] (it outlives the load,
    /// so an RDMA registration of it may be cached); `false` for owned buffers.
    pub fn is_borrowed(&self) -> bool {
        self.owned.is_none()
    }

    /// Gives the owned buffers back (`None` for borrowed memory).
    pub fn into_vecs(self) -> Option<Vec<Vec<u8>>> {
        self.owned
    }
}

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
        self.layers.iter().map(|p| p.lock().expect("lock").verified).sum()
    }

    /// A ready layer's bytes.
    pub(crate) fn ready_bytes(&self, l: usize) -> Option<&[u8]> {
        if !self.ready_flags[l].load(Ordering::Acquire) {
            return None;
        }
        let r = &self.bufs.regions[l];
        // SAFETY: the layer is ready (acquire pairs with the release in `finish_write`/`complete`),
        // so every copy into its first `expected` bytes has finished and no further write can be
        // accepted (see the module invariant); the region is valid for `len >= expected` bytes.
        Some(unsafe { std::slice::from_raw_parts(r.ptr, self.expected as usize) })
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
    fn reserve(&self, layer: u32, offset: u64, len: u64) -> Result<(), LayerError> {
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
        if let Some(e) = &p.failed {
            return Err(e.clone());
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

    fn finish_write(&self, l: usize, len: u64) {
        let mut p = self.layers[l].lock().expect("lock");
        p.written += len;
        let ready = self.try_ready(l, &mut p);
        drop(p);
        if ready {
            self.signal();
        }
    }

    pub(crate) fn write_impl(
        &self,
        layer: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), LayerError> {
        self.reserve(layer, offset, data.len() as u64)?;
        let r = &self.bufs.regions[layer as usize];
        // SAFETY: `reserve` checked `offset + len <= expected <= r.len` and recorded the range
        // as disjoint from every other accepted range of this layer, so this copy is the only
        // access to these bytes until the layer is ready, which needs this copy's
        // `finish_write` first.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), r.ptr.add(offset as usize), data.len())
        };
        self.finish_write(layer as usize, data.len() as u64);
        Ok(())
    }

    /// Reserves `offset..offset+len` of layer `layer` and lends it for an in-place fill;
    /// [`LoadState::finish_write`] (through `dest_filled`) once filled.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn dest_mut_impl(
        &self,
        layer: u32,
        offset: u64,
        len: u64,
    ) -> Result<&mut [u8], LayerError> {
        self.reserve(layer, offset, len)?;
        let r = &self.bufs.regions[layer as usize];
        // SAFETY: as in `write_impl`: `reserve` checked the range lies inside the region and
        // recorded it as disjoint from every other accepted range of this layer, so the
        // returned slice is the only access to these bytes; the layer cannot become ready
        // (and be read) before `finish_write` counts them, which the borrower calls after
        // its last write through the slice.
        Ok(unsafe { std::slice::from_raw_parts_mut(r.ptr.add(offset as usize), len as usize) })
    }

    pub(crate) fn placed_impl(&self, layer: u32, offset: u64, len: u64) -> Result<(), LayerError> {
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
    fn write(&self, layer: u32, offset: u64, data: &[u8]) -> Result<(), LayerError> {
        self.write_impl(layer, offset, data)
    }
    fn placed(&self, layer: u32, offset: u64, len: u64) -> Result<(), LayerError> {
        self.placed_impl(layer, offset, len)
    }
    fn dest_mut(&self, layer: u32, offset: u64, len: u64) -> Result<Option<&mut [u8]>, LayerError> {
        self.dest_mut_impl(layer, offset, len).map(Some)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::LayerSink;

    #[test]
    fn ready_only_when_fully_written_and_verified() {
        let s = LoadState::new(LayerBuffers::allocate(2, 16), 12);
        s.write(0, 0, &[1; 6]).unwrap();
        assert_eq!(s.status(0), LayerStatus::Pending);
        assert!(s.write(0, 4, &[2; 4]).is_err(), "overlap refused");
        assert!(s.write(0, 10, &[2; 4]).is_err(), "past expected refused");
        s.write(0, 6, &[2; 6]).unwrap();
        assert_eq!(s.status(0), LayerStatus::Pending, "not verified yet");
        s.complete(0, 12);
        assert_eq!(s.status(0), LayerStatus::Ready);
        assert_eq!(
            s.ready_bytes(0).unwrap(),
            &[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
        );
        assert!(s.write(0, 0, &[9]).is_err(), "no write into a ready layer");
        s.fail(1, LayerError::Cancelled);
        assert!(matches!(s.status(1), LayerStatus::Failed(_)));
        assert!(s.ready_bytes(1).is_none());
    }
}
