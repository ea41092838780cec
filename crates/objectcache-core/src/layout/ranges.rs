//! Pure planning of ranged reads: which byte ranges of which chunk objects to fetch, in the
//! order the GPU consumes layers, and how adjacent ranges coalesce.
#![forbid(unsafe_code)]

use super::format::slices_range;
use std::ops::Range;

/// One planned ranged read: layers `layers` of chunk `chunk`, object bytes `bytes`
/// (slices with their CRC trailers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeRead {
    /// Chunk index in the request (position in the prefix).
    pub chunk: usize,
    /// Consecutive layers covered.
    pub layers: Range<u32>,
    /// Byte range in the chunk object.
    pub bytes: Range<u64>,
}

/// Plans the reads of `chunks` chunk objects with `layers` layers of `slice_len`-byte slices,
/// **layer-major**: all chunks' reads that start at layer 0 first, then those starting at the
/// next layer, and so on.
///
/// Coalescing: layer 0 is always read alone (merging would delay the first layer, which is
/// pure stall). From layer 1 on, a read of one chunk extends over following layers of the same
/// chunk while its size stays at most `coalesce_bytes`; with `coalesce_bytes` below one slice
/// every read is one slice. The result covers every (chunk, layer) exactly once.
pub fn plan_layer_major(
    chunks: usize,
    layers: u32,
    slice_len: u64,
    coalesce_bytes: u64,
) -> Vec<RangeRead> {
    let stride = slice_len + super::format::SLICE_CRC_LEN;
    let per_read = if layers <= 1 {
        1
    } else {
        (coalesce_bytes / stride).clamp(1, (layers - 1) as u64) as u32
    };
    let mut out = Vec::new();
    let mut push = |start: u32, end: u32| {
        for c in 0..chunks {
            out.push(RangeRead {
                chunk: c,
                layers: start..end,
                bytes: slices_range(start..end, slice_len),
            });
        }
    };
    if layers == 0 || chunks == 0 {
        return out;
    }
    push(0, 1);
    let mut l = 1;
    while l < layers {
        let e = (l + per_read).min(layers);
        push(l, e);
        l = e;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_major_covers_each_slice_once() {
        let plan = plan_layer_major(3, 5, 100, 0);
        assert_eq!(plan.len(), 15);
        assert_eq!(plan[0].layers, 0..1);
        assert_eq!(plan[3].layers, 1..2);
        assert!(plan
            .windows(2)
            .all(|w| w[0].layers.start <= w[1].layers.start));
    }

    #[test]
    fn coalescing_never_merges_layer_zero() {
        let plan = plan_layer_major(2, 9, 100, 416); // 4 slices of 104 bytes
        let per_chunk: Vec<_> = plan
            .iter()
            .filter(|r| r.chunk == 0)
            .map(|r| r.layers.clone())
            .collect();
        assert_eq!(per_chunk, vec![0..1, 1..5, 5..9]);
        assert_eq!(plan[2].bytes, 64 + 104..64 + 5 * 104);
        let mut seen = vec![vec![0; 9]; 2];
        for r in &plan {
            for l in r.layers.clone() {
                seen[r.chunk][l as usize] += 1;
            }
        }
        assert!(seen.iter().flatten().all(|&n| n == 1));
    }
}
