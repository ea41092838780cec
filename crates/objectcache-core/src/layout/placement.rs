//! Where each chunk of a load is stored, from the publish markers the load has read: format
//! version 1 chunk objects, or runs of chunks in version 2 segment objects (`segment/`).
//! Pure planning for the load paths (ranged GETs and the gather server), no I/O; the design
//! is in `docs/object-format.md`, "Format version 2: segment objects", section "Loads".
//!
//! A load knows the markers its lookup read (the lookup's probes, always including the
//! first chunk) and those it reads later. [`place`] turns them into runs:
//! - a version 2 marker of position `q` at index `k` of an `n`-chunk segment places
//!   positions `q - k .. q - k + n` in that segment, as far as they are not placed yet:
//!   block hashes are prefix-chained, so a chunk's position is fixed by its hash, and the
//!   chunks around it in the segment can only be the prefix's neighbours (the segment's chunk
//!   list confirms it before a byte is used, see [`SegmentRun::matched`]);
//! - a run of a segment ends where a known marker says otherwise (another object, or another
//!   index), or earlier, where that marker's own segment begins (its index says where): a
//!   prompt that shares the start of another's segment and saved the rest itself is placed in
//!   its own segment from where the prompts part; markers that agree (the lookup's probes
//!   inside one segment) extend it, so one save is one run however many of its markers are
//!   known;
//! - a version 1 marker starts a run of chunk objects that goes on to the next known version
//!   2 marker (a prefix saved in version 1 is read with no further marker reads; a chunk
//!   object that is not there sends the load back to that chunk's marker);
//! - a position nothing places is [`Placement::unknown`]: the load reads its marker and
//!   places again. Each unknown position starts a stretch, so a prefix saved by `s` requests
//!   costs at most `s` marker reads beyond the lookup's.
#![forbid(unsafe_code)]

use super::key::ChunkHash;
use super::segment::{Marker, SegmentLayout};
use std::collections::BTreeMap;
use std::ops::Range;

/// A run of a load's chunks (prefix positions `positions`) stored in one segment object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentRun {
    /// Prefix positions the run serves, consecutive.
    pub positions: Range<usize>,
    /// The segment's digest (its key: [`crate::layout::KeyBuilder::segment`]).
    pub digest: [u8; 32],
    /// Index in the segment of `positions.start`'s chunk.
    pub first_index: u32,
    /// Chunks in the segment and its header length (the slice length is the geometry's).
    pub chunks: u32,
    /// The segment's header length in bytes.
    pub header_len: u32,
    /// The segment's length in bytes.
    pub object_len: u64,
}

impl SegmentRun {
    /// Indexes in the segment of the run's chunks.
    pub fn indexes(&self) -> Range<u32> {
        self.first_index..self.first_index + self.positions.len() as u32
    }

    /// The segment's layout for slices of `slice_len` bytes.
    pub fn layout(&self, slice_len: u64) -> SegmentLayout {
        SegmentLayout {
            header_len: self.header_len as u64,
            chunks: self.chunks,
            slice_len,
        }
    }

    /// How many of the run's leading chunks the segment really holds: the longest prefix of
    /// the run whose hashes (`hashes[positions]`) equal the segment's chunk list (`list`,
    /// from its header) at the run's indexes. Only those may be served from the segment; the
    /// rest go back to their own markers.
    pub fn matched(&self, list: &[ChunkHash], hashes: &[ChunkHash]) -> usize {
        self.positions
            .clone()
            .zip(self.indexes())
            .take_while(|&(p, i)| {
                matches!((hashes.get(p), list.get(i as usize)), (Some(a), Some(b)) if a == b)
            })
            .count()
    }
}

/// Where a stretch of a load's chunks is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Run {
    /// Format version 1: each chunk in its own object (`kv/{hash}`).
    Chunks(Range<usize>),
    /// Format version 2: a run of chunks in one segment object.
    Segment(SegmentRun),
}

impl Run {
    /// Prefix positions the run serves.
    pub fn positions(&self) -> Range<usize> {
        match self {
            Run::Chunks(r) => r.clone(),
            Run::Segment(s) => s.positions.clone(),
        }
    }
}

/// What the known markers say of a load's `n` chunks: runs in prefix order, and the positions
/// whose markers must be read before the chunks from there on can be placed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Placement {
    /// Runs in prefix order; they do not overlap.
    pub runs: Vec<Run>,
    /// Positions no run covers whose marker the load reads next: each starts a stretch of
    /// positions that no known marker covers.
    pub unknown: Vec<usize>,
}

/// Places a load's `n` chunks from the markers `known` (by prefix position; positions at or
/// past `n` are ignored). See the module docs for the rules.
pub fn place(n: usize, known: &BTreeMap<usize, Marker>) -> Placement {
    let mut out = Placement::default();
    let mut p = 0usize;
    while p < n {
        // The first marker known at or after p, inside the load.
        let next = known.range(p..).next().filter(|(&q, _)| q < n);
        match next {
            Some((&q, Marker::Segment(m))) if q - p <= m.index as usize => {
                // Its segment reaches back to p: p is at index `first` of it.
                let first = m.index - (q - p) as u32;
                // At least this position (a marker built by hand may claim nothing; a decoded
                // one has `index < chunks`): the segment's chunk list decides what it serves.
                let span = (m.chunks.saturating_sub(first) as usize).max(1);
                let mut end = p.saturating_add(span).min(n);
                // The first known marker after q that says otherwise ends the run: where its
                // own segment reaches back to (a chunk's index there fixes where that segment
                // begins; without it, the positions between would be placed in this segment,
                // which holds other chunks there), else at it.
                let agrees = |r: usize, mr: &Marker| {
                    matches!(mr, Marker::Segment(t)
                        if t.digest == m.digest && t.index as usize == first as usize + (r - p))
                };
                if let Some((&r, mr)) = known.range(q + 1..n).find(|(&r, mr)| !agrees(r, mr)) {
                    let cut = match mr {
                        Marker::Segment(t) if r - (t.index as usize).min(r) > q => {
                            r - t.index as usize
                        }
                        _ => r,
                    };
                    end = end.min(cut);
                }
                out.runs.push(Run::Segment(SegmentRun {
                    positions: p..end,
                    digest: m.digest,
                    first_index: first,
                    chunks: m.chunks,
                    header_len: m.header_len,
                    object_len: m.object_len,
                }));
                p = end;
            }
            Some((&q, Marker::Chunk { .. })) if q == p => {
                // Chunk objects up to the next known segment marker.
                let end = known
                    .range(p + 1..)
                    .find(|(_, m)| matches!(m, Marker::Segment(_)))
                    .map_or(n, |(&r, _)| r.min(n));
                out.runs.push(Run::Chunks(p..end));
                p = end;
            }
            // Nothing known places p: its marker is read; what follows up to the next known
            // marker (or as far back as that marker's segment reaches) waits for the answer.
            other => {
                out.unknown.push(p);
                p = match other {
                    Some((&q, Marker::Segment(m))) => q - (m.index as usize).min(q - p - 1),
                    Some((&q, _)) => q,
                    None => n,
                };
            }
        }
    }
    out
}

/// One planned ranged read of a segment run (see [`plan_segment_reads`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentRead {
    /// Index of the run in the slice of runs planned.
    pub run: usize,
    /// The layers whose slices this read carries, consecutive: one layer, or several of a run
    /// that is its whole segment (layer-major, so one layer's slices end where the next
    /// one's begin), each with the slices of every one of `positions`.
    pub layers: Range<u32>,
    /// Prefix positions whose slices of each of `layers` it carries, consecutive (empty for
    /// a read of the header alone).
    pub positions: Range<usize>,
    /// Byte range in the segment object: from 0 when `with_header`, then for each of
    /// `layers` in order the slices of `positions` with their CRCs.
    pub bytes: Range<u64>,
    /// The read starts with the segment's header and chunk list (`header_len` bytes), which
    /// must be checked before any slice of the run is used.
    pub with_header: bool,
}

impl SegmentRead {
    /// Slices the read carries after its header: `positions` x `layers`.
    pub fn slices(&self) -> usize {
        self.positions.len() * self.layers.len()
    }

    /// Layer and prefix position of the read's `i`-th slice, in body order (layer by layer,
    /// each layer's positions in order).
    pub fn slice(&self, i: usize) -> (u32, usize) {
        let m = self.positions.len().max(1);
        (
            self.layers.start + (i / m) as u32,
            self.positions.start + i % m,
        )
    }
}

/// How many parallel reads each layer of a segment load is cut into (the `pieces` of
/// [`plan_segment_reads`]): `per_layer` on average, so a load costs `layers x per_layer`
/// reads, with layer 0 given `first` of them (at least `per_layer`), since prefill waits for
/// the whole of layer 0 before it computes anything while later layers arrive behind
/// compute. The reads layer 0 takes beyond `per_layer` come off the later layers, one at a
/// time from the last, round after round, each keeping at least `floor` (at least 1; pass
/// the number of segment runs, since each run of a layer is one read at least); what they
/// cannot give is added. At 32 layers, `per_layer` 4 and `first` 16: with `floor` 1 or 2,
/// layer 0 gets 16 reads, layers 1-19 4 and layers 20-31 3, 128 in all; with `floor` 4 (a
/// prefix in four segments) layer 0 gets 16 and the others 4, 140 in all.
pub fn segment_pieces(layers: u32, per_layer: u32, first: u32, floor: u32) -> Vec<u32> {
    let layers = layers as usize;
    if layers == 0 {
        return Vec::new();
    }
    let per_layer = per_layer.max(1);
    let floor = floor.max(1);
    let first = first.max(per_layer);
    let mut out = vec![per_layer; layers];
    out[0] = first;
    let mut extra = first - per_layer;
    // One read at a time off each later layer, the last first, round after round.
    let mut gave = true;
    while extra > 0 && gave {
        gave = false;
        for p in out[1..].iter_mut().rev() {
            if extra > 0 && *p > floor {
                *p -= 1;
                extra -= 1;
                gave = true;
            }
        }
    }
    out
}

/// Plans the reads of segment runs **layer-major**: every run's layer 0 first, then every
/// run's layer 1, and so on, as the GPU consumes them.
///
/// Each layer gets `pieces` reads, layer 0 `first_pieces` (as many as its ranges can be cut
/// into), taken from the later layers' share ([`segment_pieces`]). Layer `l`'s reads are
/// shared among the runs (at least one each): each (run, layer) range is cut at slice
/// boundaries into at most `max(1, pieces_l / runs)` reads of at least `min_piece_bytes` each
/// (one read when the range is smaller), so a layer arrives over several connections at once
/// (the layout sweep in `docs/object-format.md`: a segment's layer 0 in one GET waits on one
/// connection) while the request count stays `layers x pieces`: a prefix saved as several
/// segments costs no more GETs than one saved as one. Where a later layer's share is smaller
/// than the runs, a run that is its whole segment and whose previous layer is one read has
/// that read extended over this layer (contiguous: the segment is layer-major) instead of a
/// read of its own, the runs taking turns; a run that is part of its segment always gets one
/// read per layer, at the cost of a read more. A run that starts at index 0 reads its header
/// with its first layer-0 piece (bytes from 0, nothing skipped); any other run gets a read of
/// the header alone, first, so it is not made to read the slices before its own.
pub fn plan_segment_reads(
    runs: &[SegmentRun],
    layers: u32,
    slice_len: u64,
    pieces: u32,
    first_pieces: u32,
    min_piece_bytes: u64,
) -> Vec<SegmentRead> {
    let stride = slice_len + super::format::SLICE_CRC_LEN;
    let active = runs
        .iter()
        .filter(|r| !r.positions.is_empty())
        .count()
        .max(1) as u32;
    // Runs whose later layers may share a read: the whole segment, from index 0.
    let whole = |r: &SegmentRun| r.first_index == 0 && r.positions.len() as u64 == r.chunks as u64;
    let parts = runs
        .iter()
        .filter(|r| !r.positions.is_empty() && !whole(r))
        .count() as u32;
    // The reads each run's layer range can be cut into at most.
    let most = |m: u64| (m * stride / min_piece_bytes.max(1)).clamp(1, m.max(1));
    let usable: u64 = runs.iter().map(|r| most(r.positions.len() as u64)).sum();
    let pieces = segment_pieces(
        layers,
        pieces,
        (first_pieces as u64).min(usable) as u32,
        parts,
    );
    let mut out: Vec<SegmentRead> = Vec::new();
    for (r, run) in runs.iter().enumerate() {
        if run.first_index > 0 && !run.positions.is_empty() {
            out.push(SegmentRead {
                run: r,
                layers: 0..1,
                positions: run.positions.start..run.positions.start,
                bytes: 0..run.header_len as u64,
                with_header: true,
            });
        }
    }
    // Per run: its latest read when that is one read of its whole segment's layer (it may be
    // extended over the next layer), and how many layers it has shared a read so far.
    let mut last: Vec<Option<usize>> = vec![None; runs.len()];
    let mut shared = vec![0u32; runs.len()];
    for layer in 0..layers {
        let share = pieces[layer as usize];
        let mut extend = vec![false; runs.len()];
        if share < active {
            let mut turns: Vec<usize> = (0..runs.len()).filter(|&r| last[r].is_some()).collect();
            turns.sort_by_key(|&r| (shared[r], r));
            for &r in turns.iter().take((active - share) as usize) {
                extend[r] = true;
            }
        }
        let per_run = (share / active).max(1);
        for (r, run) in runs.iter().enumerate() {
            let m = run.positions.len() as u64;
            if m == 0 {
                continue;
            }
            let lay = run.layout(slice_len);
            let indexes = run.first_index..run.first_index + m as u32;
            if let (true, Some(i)) = (extend[r], last[r]) {
                out[i].layers.end = layer + 1;
                out[i].bytes.end = lay.run_range(layer, indexes).end;
                shared[r] += 1;
                continue;
            }
            let n = most(m).min(per_run as u64);
            let mut at = 0u64;
            for i in 0..n {
                // Pieces of floor(m / n) or one more slices, the larger ones first.
                let len = m / n + u64::from(i < m % n);
                let first = run.first_index + at as u32;
                let range = lay.run_range(layer, first..first + len as u32);
                let with_header = layer == 0 && i == 0 && run.first_index == 0;
                out.push(SegmentRead {
                    run: r,
                    layers: layer..layer + 1,
                    positions: run.positions.start + at as usize
                        ..run.positions.start + (at + len) as usize,
                    bytes: if with_header { 0 } else { range.start }..range.end,
                    with_header,
                });
                at += len;
            }
            last[r] = (n == 1 && whole(run)).then(|| out.len() - 1);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::segment::SegmentMarker;

    fn seg(tag: u8, chunks: u32, index: u32) -> Marker {
        Marker::Segment(SegmentMarker {
            object_len: 1000,
            chunks,
            index,
            header_len: 64 + 33 * chunks + 4,
            digest: [tag; 32],
        })
    }

    fn v1() -> Marker {
        Marker::Chunk { object_len: 500 }
    }

    fn spans(p: &Placement) -> Vec<(char, Range<usize>)> {
        p.runs
            .iter()
            .map(|r| match r {
                Run::Chunks(x) => ('c', x.clone()),
                Run::Segment(s) => (s.digest[0] as char, s.positions.clone()),
            })
            .collect()
    }

    #[test]
    fn one_save_is_one_run_however_many_of_its_markers_are_known() {
        // A 128-chunk prefix saved by one request: the lookup read markers 0, 32, 64, 96.
        let known: BTreeMap<usize, Marker> = [0, 32, 64, 96]
            .map(|p| (p, seg(b'a', 128, p as u32)))
            .into();
        let pl = place(128, &known);
        assert_eq!(spans(&pl), vec![('a', 0..128)]);
        assert!(pl.unknown.is_empty());
        // Knowing only one marker inside the segment places the whole prefix too.
        let pl = place(128, &[(40, seg(b'a', 128, 40))].into());
        assert_eq!(spans(&pl), vec![('a', 0..128)]);
        // A partial hit of 40 chunks reads the first 40 of the segment.
        let pl = place(40, &[(0, seg(b'a', 128, 0))].into());
        let Run::Segment(s) = &pl.runs[0] else {
            panic!("{pl:?}")
        };
        assert_eq!((s.positions.clone(), s.indexes()), (0..40, 0..40));
    }

    #[test]
    fn later_saves_are_placed_from_any_of_their_markers() {
        // Saved in two requests: chunks 0..8 (segment a), then 8..20 (segment b).
        let pl = place(20, &[(0, seg(b'a', 8, 0))].into());
        assert_eq!(spans(&pl), vec![('a', 0..8)]);
        assert_eq!(pl.unknown, vec![8]);
        // A marker anywhere in b (the lookup's probe at 13, index 5) places all of b.
        let pl = place(20, &[(0, seg(b'a', 8, 0)), (13, seg(b'b', 12, 5))].into());
        assert_eq!(spans(&pl), vec![('a', 0..8), ('b', 8..20)]);
        assert!(pl.unknown.is_empty());
        let Run::Segment(b) = &pl.runs[1] else {
            panic!("{pl:?}")
        };
        assert_eq!(b.indexes(), 0..12);
        // Two writers raced: chunk 4's marker names another segment, which ends a's run there.
        let pl = place(8, &[(0, seg(b'a', 8, 0)), (4, seg(b'c', 4, 0))].into());
        assert_eq!(spans(&pl), vec![('a', 0..4), ('c', 4..8)]);
        // The same segment at an index that does not fit is "another" too.
        let pl = place(8, &[(0, seg(b'a', 8, 0)), (4, seg(b'a', 8, 6))].into());
        assert_eq!(spans(&pl), vec![('a', 0..4), ('a', 4..6)]);
        assert_eq!(pl.unknown, vec![6]);
        // Another prompt shares chunks 0..3 of a, and saved its own 3..10 as segment b: b's
        // marker at 6 (index 3) ends a's run where b begins, not at 6 (a holds the other
        // prompt's chunks at 3..6).
        let pl = place(10, &[(0, seg(b'a', 8, 0)), (6, seg(b'b', 7, 3))].into());
        assert_eq!(spans(&pl), vec![('a', 0..3), ('b', 3..10)]);
        assert!(pl.unknown.is_empty());
        // The same when b's only known marker lies past a's end.
        let pl = place(10, &[(0, seg(b'a', 8, 0)), (9, seg(b'b', 7, 6))].into());
        assert_eq!(spans(&pl), vec![('a', 0..3), ('b', 3..10)]);
        // A segment that does not reach back to the start leaves the gap before it unknown.
        let pl = place(10, &[(6, seg(b'a', 4, 1))].into());
        assert_eq!((spans(&pl), pl.unknown), (vec![('a', 5..9)], vec![0, 9]));
    }

    #[test]
    fn version_1_runs_go_on_to_the_next_segment_marker_and_mix_with_segments() {
        // Chunks 0..10 saved in version 1, then 10..16 as a segment.
        let pl = place(16, &[(0, v1()), (4, v1()), (10, seg(b'a', 6, 0))].into());
        assert_eq!(spans(&pl), vec![('c', 0..10), ('a', 10..16)]);
        // Only version 1 markers known: one run, no marker reads at all.
        let pl = place(16, &[(0, v1()), (8, v1())].into());
        assert_eq!(spans(&pl), vec![('c', 0..16)]);
        assert!(pl.unknown.is_empty());
        // A segment marker after a version 1 run places from where it stands.
        let pl = place(16, &[(0, v1()), (12, seg(b'a', 6, 2))].into());
        assert_eq!(spans(&pl), vec![('c', 0..12), ('a', 12..16)]);
        // Nothing known: the first position is read first.
        let pl = place(16, &BTreeMap::new());
        assert!(pl.runs.is_empty());
        assert_eq!(pl.unknown, vec![0]);
        assert_eq!(place(0, &BTreeMap::new()), Placement::default());
        // A segment entered at index 3 of 5 covers what is left of it.
        let pl = place(10, &[(0, seg(b'a', 5, 3))].into());
        assert_eq!((spans(&pl), pl.unknown), (vec![('a', 0..2)], vec![2]));
        // Markers past the load's end are ignored.
        let pl = place(4, &[(0, seg(b'a', 9, 0)), (6, v1())].into());
        assert_eq!(spans(&pl), vec![('a', 0..4)]);
    }

    #[test]
    fn a_segment_serves_only_the_chunks_its_list_holds() {
        let h = |i: u8| ChunkHash::new(&[i; 32]).unwrap();
        let hashes: Vec<ChunkHash> = (0..6).map(h).collect();
        // Chunk 2 is at index 1: the segment reaches back to position 1 (index 0).
        let pl = place(6, &[(2, seg(b'a', 8, 1))].into());
        assert_eq!(pl.unknown, vec![0]);
        let Run::Segment(s) = &pl.runs[0] else {
            panic!("{pl:?}")
        };
        assert_eq!((s.positions.clone(), s.indexes()), (1..6, 0..5));
        // The segment lists another prompt's chunks after index 1: only 2 of 5 match.
        let list = vec![h(1), h(2), h(7), h(8), h(5), h(6), h(6), h(6)];
        assert_eq!(s.matched(&list, &hashes), 2);
        let list = vec![h(1), h(2), h(3), h(4), h(5), h(0), h(0), h(0)];
        assert_eq!(s.matched(&list, &hashes), 5);
        // A list shorter than the run claims (a lying marker) matches only what it holds.
        assert_eq!(s.matched(&list[..3], &hashes), 3);
        assert_eq!(s.matched(&[], &hashes), 0);
    }

    fn run(positions: Range<usize>, first_index: u32, chunks: u32) -> SegmentRun {
        SegmentRun {
            positions,
            digest: [1; 32],
            first_index,
            chunks,
            header_len: 64 + 33 * chunks + 4,
            object_len: 0,
        }
    }

    #[test]
    fn segment_reads_are_layer_major_cut_in_pieces_and_cover_each_slice_once() {
        // One save of 128 chunks of 1 MiB, 32 layers, 4 pieces of at least 1 MiB per layer:
        // the 32K-token 8B load of issue 18 in 128 GETs.
        let (slice, layers) = (1u64 << 20, 32u32);
        let runs = [run(0..128, 0, 128)];
        let plan = plan_segment_reads(&runs, layers, slice, 4, 4, 1 << 20);
        assert_eq!(plan.len(), 128);
        assert!(plan
            .windows(2)
            .all(|w| w[0].layers.start <= w[1].layers.start));
        let lay = runs[0].layout(slice);
        for r in &plan {
            assert_eq!(r.positions.len(), 32);
            assert_eq!(r.layers.len(), 1);
            let first = lay
                .slice_range(r.layers.start, r.positions.start as u32)
                .start;
            let last = lay
                .slice_range(r.layers.start, r.positions.end as u32 - 1)
                .end;
            // Only the very first read carries the header, from byte 0.
            assert_eq!(r.with_header, r.layers.start == 0 && r.positions.start == 0);
            let start = if r.with_header { 0 } else { first };
            assert_eq!(r.bytes, start..last);
        }
        assert_covers_once(&runs, &plan, layers, slice);
        // The same prefix saved as four segments of 32 chunks: the pieces are shared, one
        // read per (segment, layer), still 128 GETs; two segments take two pieces each.
        let four: Vec<SegmentRun> = (0..4).map(|i| run(i * 32..(i + 1) * 32, 0, 32)).collect();
        let plan = plan_segment_reads(&four, layers, slice, 4, 4, 1 << 20);
        assert_eq!(plan.len(), 128);
        assert!(plan.iter().all(|r| r.positions.len() == 32));
        let plan = plan_segment_reads(&four[..2], layers, slice, 4, 4, 1 << 20);
        assert_eq!(plan.len(), 128);
        assert!(plan.iter().all(|r| r.positions.len() == 16));
        // Layer 0 in 16 reads, the budget kept: 128 GETs still, the last 12 layers in 3.
        // Four segments: layers 20-31 have 3 reads for 4 segments, so in each of them one
        // segment's read of the layer before is extended over it, the segments taking turns
        // (three times each): 128 GETs too, every byte once.
        for runs in [&runs[..], &four[..]] {
            let plan = plan_segment_reads(runs, layers, slice, 4, 16, 1 << 20);
            assert_eq!(plan.len(), 128);
            let count = |l: u32| plan.iter().filter(|r| r.layers.start == l).count();
            assert_eq!((count(0), count(19), count(31)), (16, 4, 3));
            assert_covers_once(runs, &plan, layers, slice);
        }
        let plan = plan_segment_reads(&four, layers, slice, 4, 16, 1 << 20);
        for r in 0..4 {
            let spans: Vec<usize> = plan
                .iter()
                .filter(|p| p.run == r)
                .map(|p| p.layers.len())
                .collect();
            assert_eq!(
                spans.iter().filter(|&&n| n == 2).count(),
                3,
                "segment {r}: {spans:?}"
            );
            assert!(spans.iter().all(|&n| n <= 2));
        }
        // A run that is part of its segment reads each layer apart: the four runs of 32
        // chunks in segments of 64 take layer 0's 12 more reads on top (140).
        let parts: Vec<SegmentRun> = (0..4).map(|i| run(i * 32..(i + 1) * 32, 0, 64)).collect();
        let plan = plan_segment_reads(&parts, layers, slice, 4, 16, 1 << 20);
        assert_eq!(plan.len(), 140);
        assert!(plan.iter().all(|r| r.layers.len() == 1));
        // Layer 0 of 4 chunks cuts into 4 reads at most: it takes no more, and the later
        // layers keep their 4 (the budget is not spent on reads layer 0 cannot use).
        let small = [run(0..4, 0, 4)];
        let plan = plan_segment_reads(&small, layers, slice, 4, 16, 1 << 20);
        assert_eq!(plan.len(), 128);
        assert!(plan.iter().all(|r| r.positions.len() == 1));
    }

    /// Every (layer, position) of `runs` is read exactly once, and each read's bytes are its
    /// layers' slices of its positions in order (after the header where it carries one).
    fn assert_covers_once(runs: &[SegmentRun], plan: &[SegmentRead], layers: u32, slice: u64) {
        let n = runs.iter().map(|r| r.positions.end).max().unwrap_or(0);
        let mut seen = vec![vec![0u8; n]; layers as usize];
        for r in plan {
            let run = &runs[r.run];
            let lay = run.layout(slice);
            let index = |p: usize| run.first_index + (p - run.positions.start) as u32;
            let first = lay
                .slice_range(r.layers.start, index(r.positions.start))
                .start;
            let last = lay
                .slice_range(r.layers.end - 1, index(r.positions.end - 1))
                .end;
            assert_eq!(r.bytes.end, last);
            assert_eq!(r.bytes.start, if r.with_header { 0 } else { first });
            let per_layer = (r.positions.len() as u64) * (slice + 4);
            let header = if r.with_header { first } else { 0 };
            assert_eq!(
                r.bytes.end - r.bytes.start,
                header + per_layer * r.layers.len() as u64
            );
            for l in r.layers.clone() {
                for p in r.positions.clone() {
                    seen[l as usize][p] += 1;
                }
            }
        }
        assert!(seen.iter().flatten().all(|&n| n == 1));
    }

    #[test]
    fn segment_pieces_keep_the_budget_and_a_read_per_layer() {
        assert_eq!(segment_pieces(4, 4, 4, 1), vec![4, 4, 4, 4]);
        assert_eq!(segment_pieces(4, 4, 8, 1), vec![8, 3, 3, 2]);
        assert_eq!(segment_pieces(4, 4, 8, 3), vec![8, 3, 3, 3]);
        // More than the later layers can give: they keep `floor` (at least one) each.
        assert_eq!(segment_pieces(3, 2, 100, 0), vec![100, 1, 1]);
        assert_eq!(segment_pieces(1, 4, 16, 1), vec![16]);
        // Fewer for layer 0 than the mean is the mean.
        assert_eq!(segment_pieces(2, 4, 1, 1), vec![4, 4]);
        assert!(segment_pieces(0, 4, 16, 1).is_empty());
    }

    #[test]
    fn small_ranges_stay_whole_and_runs_inside_a_segment_read_their_header_alone() {
        let slice = 1000u64;
        // 3 chunks of 1,004 bytes with their CRCs: under 4 KiB, one read per layer.
        let runs = [run(0..3, 0, 3), run(3..5, 2, 9)];
        let plan = plan_segment_reads(&runs, 2, slice, 4, 16, 4096);
        // The second run starts at index 2 of its segment: its header comes first, alone.
        assert_eq!(plan[0].run, 1);
        assert!(plan[0].with_header && plan[0].positions.is_empty());
        assert_eq!(plan[0].bytes, 0..runs[1].header_len as u64);
        let rest: Vec<(usize, u32, Range<usize>, bool)> = plan[1..]
            .iter()
            .map(|r| (r.run, r.layers.start, r.positions.clone(), r.with_header))
            .collect();
        assert_eq!(
            rest,
            vec![
                (0, 0, 0..3, true),
                (1, 0, 3..5, false),
                (0, 1, 0..3, false),
                (1, 1, 3..5, false),
            ]
        );
        // The second run's layer-1 range: indexes 2..4 of a 9-chunk segment.
        let lay = runs[1].layout(slice);
        assert_eq!(plan[4].bytes, lay.run_range(1, 2..4));
        // Uneven pieces: 5 slices in 2 pieces are 3 + 2, the larger first.
        let plan = plan_segment_reads(&[run(0..5, 0, 5)], 1, slice, 2, 2, 1);
        let sizes: Vec<usize> = plan.iter().map(|r| r.positions.len()).collect();
        assert_eq!(sizes, vec![3, 2]);
        assert!(plan_segment_reads(&[], 4, slice, 4, 16, 1).is_empty());
    }
}
