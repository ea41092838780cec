//! Destination buffers of a load and the per-layer progress that guards them.
//!
//! This is the one place of the connector with `unsafe`: transports copy bytes into the
//! caller's memory from many tasks while the caller reads layers that are already ready.
//!
//! Each layer's destination is a list of byte ranges (one for a contiguous buffer; one per
//! engine block for paged KV) taken in order as one *logical* buffer: logical offset `o` of
//! layer `l` is byte `o - start(i)` of the layer's range `i` that covers it. Soundness rests
//! on one invariant, enforced under a per-layer lock:
//!
//! *every accepted write covers a logical byte range of its layer that no other accepted
//! write covers, and a layer is ready only once accepted writes cover all of it and every
//! copy has finished;*
//!
//! together with a property of the buffers, checked or promised when they are made: *no two
//! ranges of a [`LayerBuffers`], of the same layer or of two layers, share a byte*, so the
//! logical-to-memory mapping is one-to-one over the whole load.
//!
//! So no two copies touch the same byte, no copy runs into a ready layer (any new range would
//! overlap the full coverage and be refused), and a reader of a ready layer sees only finished
//! writes (the ready flag is published with release ordering and read with acquire).
#![allow(unsafe_code)]

use crate::error::{Error, LayerError};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

/// One range of destination memory.
#[derive(Clone, Copy)]
struct Region {
    ptr: *mut u8,
    len: usize,
}

/// One layer's destination: its ranges in order and where each starts in the layer's
/// logical buffer.
struct Layer {
    parts: Vec<Region>,
    /// `starts[i]` = logical offset of `parts[i]` (ascending; `starts[0] == 0`).
    starts: Vec<u64>,
    /// Sum of the parts' lengths.
    len: u64,
}

impl Layer {
    fn new(parts: Vec<Region>) -> Self {
        let parts: Vec<Region> = parts.into_iter().filter(|r| r.len > 0).collect();
        let mut starts = Vec::with_capacity(parts.len());
        let mut at = 0u64;
        for r in &parts {
            starts.push(at);
            at += r.len as u64;
        }
        Layer {
            parts,
            starts,
            len: at,
        }
    }

    /// The memory pieces of logical bytes `offset..offset+len`, in order; `None` if the range
    /// runs past the layer. Pure address arithmetic: nothing is dereferenced.
    fn pieces(&self, offset: u64, len: u64) -> Option<Vec<(*mut u8, usize)>> {
        let end = offset.checked_add(len).filter(|&e| e <= self.len)?;
        let mut out = Vec::new();
        if len == 0 {
            return Some(out);
        }
        let mut i = self.starts.partition_point(|&s| s <= offset) - 1;
        let mut at = offset;
        while at < end {
            let (r, s) = (self.parts[i], self.starts[i]);
            let from = (at - s) as usize;
            let n = ((r.len - from) as u64).min(end - at) as usize;
            out.push((r.ptr.wrapping_add(from), n));
            at += n as u64;
            i += 1;
        }
        Some(out)
    }
}

/// What owned buffers hold.
enum Owned {
    /// One `Vec` per layer.
    Layers(Vec<Vec<u8>>),
    /// One pool that every layer's ranges lie in ([`LayerBuffers::paged`]).
    Pool(Vec<u8>),
}

/// Per-layer destination buffers for a load: layer `l` receives `chunks x slice_len` bytes,
/// chunk `c`'s slice (K then V, CRC excluded) at logical offset `c x slice_len`.
///
/// A layer's destination is one contiguous buffer or, for paged KV (an engine that keeps KV
/// in fixed-size blocks spread through one large buffer), a list of ranges that are taken in
/// order as one logical buffer: for example one range per engine block of the loaded
/// chunks' tokens. Either owned (allocated here, moved in from `Vec`s, or one pool with
/// ranges in it) or borrowed from the caller through [`LayerBuffers::from_raw`] /
/// [`LayerBuffers::from_raw_ranges`] (the C ABI's registered memory).
pub struct LayerBuffers {
    layers: Vec<Layer>,
    owned: Option<Owned>,
    /// The memory areas that hold every range (what an RDMA load registers): each owned
    /// buffer, the pool, each borrowed region, or the areas given to `from_raw_ranges`.
    memory: Vec<Region>,
    /// Whether `memory` outlives the load (caller memory named by `from_raw_ranges`), so an
    /// RDMA registration of it may be kept for later loads until `Engine::forget_memory`.
    memory_long_lived: bool,
}

// SAFETY: the raw pointers refer either to `owned` (moved with the struct) or to memory the
// caller of `from_raw`/`from_raw_ranges` promised stays valid and unaliased; access is
// coordinated by `LoadState`.
unsafe impl Send for LayerBuffers {}
// SAFETY: as above; shared access only reads ready layers or writes disjoint ranges.
unsafe impl Sync for LayerBuffers {}

impl std::fmt::Debug for LayerBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerBuffers")
            .field("layers", &self.layers.len())
            .field("bytes_per_layer", &self.layers.first().map(|r| r.len))
            .field(
                "ranges_per_layer",
                &self.layers.first().map(|r| r.parts.len()),
            )
            .field("owned", &self.owned.is_some())
            .finish()
    }
}

/// The first pair of byte ranges that share a byte, among `items` = `(start, len, tag)`;
/// empty ranges share nothing. Sorts `items` by start.
pub(crate) fn first_overlap<T: Copy>(items: &mut [(usize, usize, T)]) -> Option<(T, T)> {
    items.sort_unstable_by_key(|x| (x.0, x.1));
    let mut reach: Option<(usize, T)> = None; // furthest end so far, and whose
    for &(start, len, tag) in items.iter() {
        if len == 0 {
            continue;
        }
        if let Some((end, t)) = reach {
            if start < end {
                return Some((t, tag));
            }
        }
        let end = start.saturating_add(len);
        if reach.is_none_or(|(e, _)| end > e) {
            reach = Some((end, tag));
        }
    }
    None
}

impl LayerBuffers {
    /// Allocates `layers` zeroed buffers of `bytes_per_layer` bytes each.
    pub fn allocate(layers: usize, bytes_per_layer: usize) -> Self {
        Self::from_vecs((0..layers).map(|_| vec![0u8; bytes_per_layer]).collect())
    }

    /// Takes ownership of one `Vec` per layer.
    pub fn from_vecs(mut v: Vec<Vec<u8>>) -> Self {
        let memory: Vec<Region> = v
            .iter_mut()
            .map(|b| Region {
                ptr: b.as_mut_ptr(),
                len: b.len(),
            })
            .collect();
        LayerBuffers {
            layers: memory.iter().map(|&r| Layer::new(vec![r])).collect(),
            owned: Some(Owned::Layers(v)),
            memory,
            memory_long_lived: false,
        }
    }

    /// Paged destinations in an owned pool: layer `l`'s logical buffer is the concatenation
    /// of `pool[o..o+n]` for its `(o, n)` in `ranges[l]`, in order (empty ranges are
    /// skipped). [`LayerBuffers::into_pool`] gives the pool back.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the range: one that runs past the pool, or two
    /// (of any layers) that share a byte.
    pub fn paged(mut pool: Vec<u8>, ranges: Vec<Vec<(usize, usize)>>) -> Result<Self, Error> {
        let mut all = Vec::new();
        for (l, rs) in ranges.iter().enumerate() {
            for (i, &(o, n)) in rs.iter().enumerate() {
                if o.checked_add(n).is_none_or(|e| e > pool.len()) {
                    return Err(Error::InvalidArgument(format!(
                        "paged buffers: layer {l} range {i} ({o}, {n} bytes) runs past the \
                         pool of {} bytes",
                        pool.len()
                    )));
                }
                all.push((o, n, (l, i)));
            }
        }
        if let Some(((l1, i1), (l2, i2))) = first_overlap(&mut all) {
            return Err(Error::InvalidArgument(format!(
                "paged buffers: layer {l1} range {i1} and layer {l2} range {i2} overlap"
            )));
        }
        let base = pool.as_mut_ptr();
        let layers = ranges
            .iter()
            .map(|rs| {
                Layer::new(
                    rs.iter()
                        .map(|&(o, n)| Region {
                            // In bounds: checked above.
                            ptr: base.wrapping_add(o),
                            len: n,
                        })
                        .collect(),
                )
            })
            .collect();
        let memory = vec![Region {
            ptr: base,
            len: pool.len(),
        }];
        Ok(LayerBuffers {
            layers,
            owned: Some(Owned::Pool(pool)),
            memory,
            memory_long_lived: false,
        })
    }

    /// Borrows caller memory: one `(pointer, length in bytes)` per layer.
    ///
    /// # Safety
    /// Each region must be valid for writes of `len` bytes, must not overlap another region,
    /// and must not be read or written by anyone else until the [`super::LoadHandle`] that
    /// uses these buffers has been released (which waits for every in-flight copy).
    pub unsafe fn from_raw(regions: &[(*mut u8, usize)]) -> Self {
        let memory: Vec<Region> = regions
            .iter()
            .map(|&(ptr, len)| Region { ptr, len })
            .collect();
        LayerBuffers {
            layers: memory.iter().map(|&r| Layer::new(vec![r])).collect(),
            owned: None,
            memory,
            memory_long_lived: false,
        }
    }

    /// Borrows paged caller memory: `layers[l]` lists layer `l`'s `(pointer, length in
    /// bytes)` ranges in order, taken as one logical buffer (empty ranges are skipped).
    /// `memory` names the caller's long-lived memory areas that hold every range (for
    /// example the engine's whole KV buffer, registered once): an RDMA load registers each
    /// area once and keeps the registration for later loads, until
    /// [`super::Engine::forget_memory`].
    ///
    /// # Safety
    /// Each range must be valid for writes of its length, no two ranges (of the same layer
    /// or of two layers) may share a byte, and none may be read or written by anyone else
    /// until the [`super::LoadHandle`] that uses these buffers has been released (which
    /// waits for every in-flight copy). Each range lies inside one `memory` area, and every
    /// area stays mapped (not freed or remapped) until [`super::Engine::forget_memory`] was
    /// called for it, or the engine dropped.
    pub unsafe fn from_raw_ranges(
        layers: &[Vec<(*mut u8, usize)>],
        memory: &[(*mut u8, usize)],
    ) -> Self {
        LayerBuffers {
            layers: layers
                .iter()
                .map(|rs| Layer::new(rs.iter().map(|&(ptr, len)| Region { ptr, len }).collect()))
                .collect(),
            owned: None,
            memory: memory
                .iter()
                .map(|&(ptr, len)| Region { ptr, len })
                .collect(),
            memory_long_lived: true,
        }
    }

    /// The memory areas that hold every range, as `(address, length)`: each owned buffer or
    /// the pool, each borrowed region, or the areas given to
    /// [`LayerBuffers::from_raw_ranges`]. What an RDMA load registers.
    pub fn memory(&self) -> Vec<(*mut u8, usize)> {
        self.memory.iter().map(|r| (r.ptr, r.len)).collect()
    }

    /// Whether [`LayerBuffers::memory`] outlives the load (given to
    /// [`LayerBuffers::from_raw_ranges`]), so its RDMA registration may be kept.
    pub fn memory_is_long_lived(&self) -> bool {
        self.memory_long_lived
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Length in bytes of layer `l`'s buffer (the sum of its ranges).
    pub fn layer_len(&self, l: usize) -> usize {
        self.layers[l].len as usize
    }

    /// Layer `l`'s ranges, in order, as `(address, length)`: one for a contiguous buffer. For
    /// memory registration (RDMA) and diagnostics; nothing may be written through them while
    /// a load uses the buffers.
    pub fn ranges(&self, l: usize) -> Vec<(*mut u8, usize)> {
        self.layers[l]
            .parts
            .iter()
            .map(|r| (r.ptr, r.len))
            .collect()
    }

    /// `true` for caller memory given through [`LayerBuffers::from_raw`] or
    /// [`LayerBuffers::from_raw_ranges`]; `false` for owned buffers.
    pub fn is_borrowed(&self) -> bool {
        self.owned.is_none()
    }

    /// Gives the owned per-layer buffers back (`None` for borrowed memory or a pool).
    pub fn into_vecs(self) -> Option<Vec<Vec<u8>>> {
        match self.owned {
            Some(Owned::Layers(v)) => Some(v),
            _ => None,
        }
    }

    /// Gives the pool of [`LayerBuffers::paged`] back (`None` for other buffers).
    pub fn into_pool(self) -> Option<Vec<u8>> {
        match self.owned {
            Some(Owned::Pool(p)) => Some(p),
            _ => None,
        }
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
        // A layer failed by another chunk's miss still takes this chunk's bytes (they land
        // and are verified, so the load can report the chunks before the bad one as loaded,
        // `LoadHandle::loaded_chunks`); the layer never becomes ready. A layer failed for the
        // whole load (timeout, stall, device) takes nothing more.
        if let Some(e) = &p.failed {
            if super::status::chunk_status_of(e).is_none() {
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

    pub(crate) fn write_impl(
        &self,
        layer: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), LayerError> {
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
    ) -> Result<Vec<&mut [u8]>, LayerError> {
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
    ) -> Result<Option<&mut [u8]>, LayerError> {
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
        self.dest_mut_impl(layer, offset, len)
    }
    fn dest_parts(
        &self,
        layer: u32,
        offset: u64,
        len: u64,
    ) -> Result<Option<Vec<&mut [u8]>>, LayerError> {
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

#[cfg(test)]
mod tests;
