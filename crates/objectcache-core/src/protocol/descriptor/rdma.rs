//! RDMA destinations of a gather request: [`RdmaTarget`] (session, load slot and each
//! layer's segments), the cutting of a unit into per-segment pieces ([`RdmaSegments`],
//! [`rdma_pieces`]) and the limits of the RDMA immediate's fields.

use crate::layout::Spans;

/// One segment of a layer's RDMA destination: remote memory the server writes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaRegion {
    /// Remote virtual address.
    pub addr: u64,
    /// Remote key of the memory region it lies in.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

/// An RDMA destination: the RDMA session whose queue pairs carry the writes, the load slot
/// that tells concurrent loads on that session apart, and each requested layer's
/// destination as a list of segments.
///
/// The session is set up once per client and server (QP numbers, GIDs and PSNs exchanged on
/// the server's gather port behind the `OCRDMA01` preface, see `docs/rdma.md`); the server
/// names it with a 64-bit token the client echoes here. Each unit is written with
/// `RDMA_WRITE_WITH_IMM` whose 32-bit immediate is `slot:6 | layer:10 | unit:16`, `unit`
/// being the unit's index within its layer in [`plan_units`] order.
///
/// A layer's segments, taken in order, are one logical buffer (unit offsets are offsets in
/// it): one segment for a contiguous destination; several for paged KV (an engine's blocks
/// scattered through its registered KV buffer). A unit that spans segments is written as one
/// `RDMA_WRITE` per segment piece but the last, then `RDMA_WRITE_WITH_IMM` of the last piece,
/// all on one RC queue pair from one staging slot, so the immediate's completion at the
/// client comes after every piece has landed (RC executes a QP's requests in order)
/// ([`RdmaTarget::pieces`]). With one segment per layer the target is encoded as kind 2
/// (every RDMA server reads it); otherwise as kind 3, which only a server announcing
/// [`super::ServerInfo::FEATURE_RDMA_SCATTER`] accepts.
///
/// [`plan_units`]: super::plan_units
/// [`super::ServerInfo::FEATURE_RDMA_SCATTER`]: crate::protocol::ServerInfo::FEATURE_RDMA_SCATTER
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaTarget {
    /// Session token from the RDMA set-up exchange.
    pub session: u64,
    /// Load slot on that session, `0..64`.
    pub slot: u8,
    /// Destination of each requested layer, in layer order (`layers.start` first): its
    /// segments, in order.
    pub layers: Vec<Vec<RdmaRegion>>,
}

/// Most segments an RDMA target may name over all its layers (a descriptor is at most
/// 1 MiB anyway: 20 bytes per segment).
pub const RDMA_MAX_SEGMENTS: u32 = 1 << 16;

impl RdmaTarget {
    /// A target with one segment per layer (a contiguous destination per layer).
    pub fn contiguous(session: u64, slot: u8, regions: Vec<RdmaRegion>) -> Self {
        RdmaTarget {
            session,
            slot,
            layers: regions.into_iter().map(|r| vec![r]).collect(),
        }
    }

    /// Whether every layer is one segment (wire kind 2).
    pub fn is_contiguous(&self) -> bool {
        self.layers.iter().all(|l| l.len() == 1)
    }

    /// The remote pieces that hold logical bytes `offset..offset+len` of the `i`-th requested
    /// layer, in order; `None` if they run past its segments. Both ends use this to cut a
    /// unit: the server writes one piece per `RDMA_WRITE`, the client expects the immediate
    /// with the last piece's length.
    pub fn pieces(&self, i: usize, offset: u64, len: u64) -> Option<Vec<RdmaRegion>> {
        rdma_pieces(self.layers.get(i)?, offset, len)
    }
}

/// The pieces of `segments` (taken in order as one buffer) that hold bytes
/// `offset..offset+len`; `None` if they run past the segments' end. Empty for `len == 0`.
/// Linear in the segments; [`RdmaSegments`] cuts many units in logarithmic time each.
pub fn rdma_pieces(segments: &[RdmaRegion], offset: u64, len: u64) -> Option<Vec<RdmaRegion>> {
    RdmaSegments::new(segments.to_vec())?.pieces(offset, len)
}

/// One layer's RDMA segments with their logical start offsets, for cutting units into
/// pieces by binary search (a server cuts every unit of a request: units x log(segments)).
#[derive(Debug, Clone)]
pub struct RdmaSegments {
    segs: Vec<RdmaRegion>,
    /// Where each segment lies in the logical buffer.
    spans: Spans,
}

impl RdmaSegments {
    /// Indexes `segs`; `None` if their lengths overflow `u64`.
    pub fn new(segs: Vec<RdmaRegion>) -> Option<Self> {
        let spans = Spans::new(segs.iter().map(|s| s.len))?;
        Some(RdmaSegments { segs, spans })
    }

    /// As [`rdma_pieces`].
    pub fn pieces(&self, offset: u64, len: u64) -> Option<Vec<RdmaRegion>> {
        self.spans
            .pieces(offset, len)?
            .map(|(i, at, len)| {
                let s = &self.segs[i];
                Some(RdmaRegion {
                    addr: s.addr.checked_add(at)?,
                    rkey: s.rkey,
                    len,
                })
            })
            .collect()
    }
}

/// Largest RDMA load slot plus one (the immediate's 6-bit slot field).
pub const RDMA_SLOTS: u8 = 64;
/// Most units per layer an RDMA target can name (the immediate's 16-bit unit field).
pub const RDMA_MAX_UNITS_PER_LAYER: u64 = 1 << 16;
/// Most layers an RDMA target can name (the immediate's 10-bit layer field).
pub const RDMA_MAX_LAYERS: u32 = 1 << 10;
