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

use crate::error::Error;
use crate::layout::Spans;

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
    /// Where each part lies in the layer's logical buffer (`spans.len()`: the layer's bytes).
    spans: Spans,
}

impl Layer {
    fn new(parts: Vec<Region>) -> Self {
        let parts: Vec<Region> = parts.into_iter().filter(|r| r.len > 0).collect();
        let spans = Spans::new(parts.iter().map(|r| r.len as u64))
            .expect("the lengths of memory regions add up within u64");
        Layer { parts, spans }
    }

    /// The memory pieces of logical bytes `offset..offset+len`, in order; `None` if the range
    /// runs past the layer. Pure address arithmetic: nothing is dereferenced.
    fn pieces(&self, offset: u64, len: u64) -> Option<Vec<(*mut u8, usize)>> {
        let pieces = self.spans.pieces(offset, len)?;
        let at = |(i, from, n): (usize, u64, u64)| {
            (self.parts[i].ptr.wrapping_add(from as usize), n as usize)
        };
        Some(pieces.map(at).collect())
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
            .field(
                "bytes_per_layer",
                &self.layers.first().map(|r| r.spans.len()),
            )
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
        self.layers[l].spans.len() as usize
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

mod state;
pub use state::LayerStatus;
pub(crate) use state::LoadState;

#[cfg(test)]
mod tests;
