//! The pure delivery-unit planner: the units of a validated gather request, layer-major
//! ([`plan_units`]), each unit's pieces of chunk slices, and each unit's index within its
//! layer ([`unit_indices`]).

use super::GatherRequest;
use std::ops::Range;

/// A piece of one chunk's slice inside a unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePiece {
    /// Chunk index in the request.
    pub chunk: u32,
    /// Bytes of the slice (CRC excluded) this piece covers.
    pub range: Range<u64>,
    /// The slice's full length (a piece is whole when `range == 0..slice_len`).
    pub slice_len: u64,
}

/// Index of each unit within its layer, in plan order (the `unit` field of the RDMA
/// immediate): the `i`-th unit of layer `l` in `plan` gets index `i`.
pub fn unit_indices(plan: &[UnitPlan]) -> Vec<u32> {
    let mut next: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    plan.iter()
        .map(|u| {
            let n = next.entry(u.layer).or_default();
            *n += 1;
            *n - 1
        })
        .collect()
}

/// One delivery unit: a contiguous byte range of one layer's destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitPlan {
    /// Layer index.
    pub layer: u32,
    /// Destination offset in the layer's buffer, bytes.
    pub offset: u64,
    /// Payload length, bytes (`<= max_unit_bytes`).
    pub len: u64,
    /// The slices, in destination order.
    pub pieces: Vec<SlicePiece>,
}

/// Plans the delivery units of a (validated) request: layer-major; within a layer, consecutive
/// whole slices are packed into units of at most `max_unit_bytes`; a slice larger than that
/// is split into pieces; a unit never spans two layers.
pub fn plan_units(req: &GatherRequest) -> Vec<UnitPlan> {
    let max = req.max_unit_bytes as u64;
    let mut out = Vec::new();
    for layer in req.layers.clone() {
        let mut offset = 0u64;
        let mut cur: Option<UnitPlan> = None;
        for (c, &t) in req.chunk_tokens.iter().enumerate() {
            let sl = req.geometry.slice_len(t);
            if sl > max {
                if let Some(u) = cur.take() {
                    out.push(u);
                }
                let mut a = 0;
                while a < sl {
                    let b = (a + max).min(sl);
                    out.push(UnitPlan {
                        layer,
                        offset: offset + a,
                        len: b - a,
                        pieces: vec![SlicePiece {
                            chunk: c as u32,
                            range: a..b,
                            slice_len: sl,
                        }],
                    });
                    a = b;
                }
            } else {
                if cur.as_ref().is_some_and(|u| u.len + sl > max) {
                    out.push(cur.take().expect("some"));
                }
                let u = cur.get_or_insert_with(|| UnitPlan {
                    layer,
                    offset,
                    len: 0,
                    pieces: Vec::new(),
                });
                u.len += sl;
                u.pieces.push(SlicePiece {
                    chunk: c as u32,
                    range: 0..sl,
                    slice_len: sl,
                });
            }
            offset += sl;
        }
        if let Some(u) = cur.take() {
            out.push(u);
        }
    }
    out
}
