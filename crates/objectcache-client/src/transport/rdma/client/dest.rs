//! Where a load's layers land: destinations in host or caller memory, and the per-layer
//! plan of units and lone slices a gather load expects.

use std::sync::Arc;

use crate::transport::rdma::mr::HostBuffer;

/// Where one layer of a load lands: `units x slice_len` bytes from the start of the
/// destination memory. Build it with [`LayerDest::host`] or [`LayerDest::raw`].
#[derive(Debug, Clone)]
pub struct LayerDest {
    pub(super) layer: u32,
    pub(super) mem: DestMem,
}

#[derive(Debug, Clone)]
pub(super) enum DestMem {
    Host {
        buf: Arc<HostBuffer>,
        offset: usize,
    },
    Raw {
        ptr: usize,
        len: usize,
    },
    /// Caller memory scattered over `ranges` (in order, one logical buffer), each inside one
    /// of the `memory` areas, which are what gets registered.
    Ranges {
        ranges: Vec<(usize, usize)>,
        memory: Vec<(usize, usize)>,
    },
}

impl LayerDest {
    /// Layer `layer` lands in `buf` from byte `offset` (the whole buffer is registered once
    /// through the client's cache and reused by later loads).
    pub fn host(layer: u32, buf: Arc<HostBuffer>, offset: usize) -> Self {
        LayerDest {
            layer,
            mem: DestMem::Host { buf, offset },
        }
    }
    /// Layer `layer` lands in caller memory `ptr..ptr+len` (for example one region of the
    /// connector's `LayerBuffers`), registered once through the client's cache.
    ///
    /// # Safety
    /// As [`RegistrationCache::get_or_register_raw`]: the memory stays mapped while cached
    /// (evict it with [`RdmaClient::evict_raw`] before freeing it), and nothing holds a Rust
    /// reference to it while a load into it runs.
    pub unsafe fn raw(layer: u32, ptr: *mut u8, len: usize) -> Self {
        LayerDest {
            layer,
            mem: DestMem::Raw {
                ptr: ptr as usize,
                len,
            },
        }
    }
    /// Layer `layer` lands in caller memory scattered over `ranges` `(ptr, len)`, taken in
    /// order as one buffer (paged KV: one range per engine block); every range lies inside
    /// one of the `memory` areas, each registered once through the client's cache (for
    /// example the engine's whole KV buffer), so a load names its ranges as segments of a few
    /// registrations. Adjacent ranges are sent as one segment. Only gather loads
    /// ([`RdmaClient::expect_gather`]) take scattered destinations.
    ///
    /// # Safety
    /// As [`LayerDest::raw`], for every `memory` area: it stays mapped while cached (evict it
    /// with [`RdmaClient::evict_raw`] before freeing it), and nothing holds a Rust reference
    /// to the ranges while a load into them runs.
    pub unsafe fn raw_ranges(
        layer: u32,
        ranges: &[(*mut u8, usize)],
        memory: &[(*mut u8, usize)],
    ) -> Self {
        LayerDest {
            layer,
            mem: DestMem::Ranges {
                ranges: ranges.iter().map(|&(p, n)| (p as usize, n)).collect(),
                memory: memory.iter().map(|&(p, n)| (p as usize, n)).collect(),
            },
        }
    }
    /// The layer index.
    pub fn layer(&self) -> u32 {
        self.layer
    }
}

/// Where one layer's writes land, for [`RdmaClient::expect_gather`].
#[derive(Debug, Clone)]
pub struct LayerPlan {
    /// The layer's destination.
    pub dest: LayerDest,
    /// `(offset, len)` in bytes, in `dest`, of each planned unit, by unit index (the
    /// immediate's `unit`; [`crate::protocol::plan_units`] and
    /// [`crate::protocol::unit_indices`] give them).
    pub units: Vec<(u64, u64)>,
    /// `(chunk, offset, len)` in bytes, in `dest`, of each chunk's slice that shares a unit
    /// with other slices: when another slice of that unit is bad, the server writes the
    /// good ones alone, each with a slice immediate ([`Imm::slice`]) naming its chunk.
    pub slices: Vec<(u32, u64, u64)>,
}
