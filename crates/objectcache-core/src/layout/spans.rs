//! Byte ranges taken in order as one logical buffer ([`Spans`]): where a logical range of it
//! lies in the ranges. A paged KV destination (an engine's blocks spread through a pool) and
//! an RDMA target's registered segments are both such lists; the client's buffers and the
//! RDMA descriptor each index theirs with it.

/// The offsets of consecutive spans (byte ranges of lengths given at construction) laid end
/// to end as one logical buffer. Pure arithmetic: it holds lengths, never addresses; a
/// lookup is a binary search over the spans, so cutting many ranges of a long list stays
/// cheap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spans {
    /// `starts[i]`: logical offset of span `i`; one more entry: the total length.
    starts: Vec<u64>,
}

impl Spans {
    /// Indexes spans of `lens` bytes each, in order (empty spans allowed: they hold no byte);
    /// `None` if the total overflows `u64`.
    pub fn new(lens: impl IntoIterator<Item = u64>) -> Option<Self> {
        let mut starts = vec![0u64];
        let mut at = 0u64;
        for len in lens {
            at = at.checked_add(len)?;
            starts.push(at);
        }
        Some(Spans { starts })
    }

    /// Total bytes of all spans.
    pub fn len(&self) -> u64 {
        *self.starts.last().expect("starts holds the total")
    }

    /// True if the spans hold no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pieces of logical bytes `offset..offset + len`, in order: `(span index, offset in
    /// that span, bytes)`, empty spans skipped. An empty range has no pieces. `None` if the
    /// range runs past the end. The pieces are computed as they are taken (nothing is
    /// allocated): callers map them straight to their own addresses.
    pub fn pieces(
        &self,
        offset: u64,
        len: u64,
    ) -> Option<impl Iterator<Item = (usize, u64, u64)> + '_> {
        let end = offset.checked_add(len).filter(|&e| e <= self.len())?;
        // The span holding `offset`: the last whose start is at or before it (an empty span
        // starts where the next one does and yields nothing below).
        let first = self
            .starts
            .partition_point(|&s| s <= offset)
            .saturating_sub(1);
        let spans = self.starts[first..].windows(2).zip(first..);
        Some(
            spans
                .map_while(move |(w, i)| {
                    let (a, b) = (w[0], w[1]);
                    let from = offset.max(a);
                    (from < end).then(|| (i, from - a, end.min(b) - from))
                })
                .filter(|&(_, _, n)| n > 0),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::Spans;

    fn pieces(s: &Spans, offset: u64, len: u64) -> Option<Vec<(usize, u64, u64)>> {
        s.pieces(offset, len).map(Iterator::collect)
    }

    #[test]
    fn pieces_cross_spans_and_skip_empty_ones() {
        let s = Spans::new([4, 0, 0, 6, 5]).unwrap();
        assert_eq!(s.len(), 15);
        assert_eq!(pieces(&s, 0, 4), Some(vec![(0, 0, 4)]));
        // From inside the first span across two empty ones into the fourth.
        assert_eq!(pieces(&s, 2, 5), Some(vec![(0, 2, 2), (3, 0, 3)]));
        // Starting exactly where the empty spans start: the non-empty span holds the byte.
        assert_eq!(pieces(&s, 4, 11), Some(vec![(3, 0, 6), (4, 0, 5)]));
        assert_eq!(pieces(&s, 14, 1), Some(vec![(4, 4, 1)]));
        assert_eq!(pieces(&s, 15, 0), Some(vec![]));
        assert_eq!(pieces(&s, 14, 2), None, "past the end");
        assert_eq!(pieces(&s, u64::MAX, 2), None, "offset + len overflows");
        assert_eq!(Spans::new([u64::MAX, 1]), None, "total overflows");
        let e = Spans::new([0, 0]).unwrap();
        assert!(e.is_empty());
        assert_eq!(pieces(&e, 0, 0), Some(vec![]));
        assert_eq!(pieces(&e, 0, 1), None);
    }
}
