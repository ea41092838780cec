//! Segment placement of a gather request (object format version 2, `docs/protocol.md`,
//! "Segment objects"): which of the request's chunks lie in segment objects, and where.
//!
//! Sent only to a server announcing [`crate::protocol::ServerInfo::FEATURE_SEGMENTS`], with
//! descriptor flag bit 4, after the load group:
//!
//! ```text
//! u16  segments s (1..=MAX_SEGMENTS_PER_REQUEST)
//! s x  [32 digest][u32 chunks n][u32 header length H][u64 object length]
//! u32  chunks (the request's chunk count)
//! per chunk  [u16 segment, 0xFFFF: its own chunk object][u32 index in the segment]
//! ```
//! The segments' keys follow from the request's key prefix ([`super::ChunkKeys::Hashed`]):
//! `{prefix}seg/{hex(digest)}`, exactly [`crate::layout::KeyBuilder::segment`]. The values
//! are the chunks' publish markers' ([`crate::layout::SegmentMarker`]); the server checks
//! each segment's header and chunk list against them and the request's hashes before it
//! sends any of its bytes.

use super::WireGeometry;
use crate::layout::{Run, SegmentLayout, MAX_SEGMENT_CHUNKS};
use crate::protocol::wire::Reader;
use crate::protocol::ProtocolError;
use bytes::BufMut;
use std::ops::Range;

/// Most segment objects one request may name: one per chunk of the largest request
/// ([`crate::protocol::MAX_CHUNKS_HARD`]) but one, as the wire's u16 keeps 0xFFFF for a chunk
/// in its own object. The 64 MiB of headers a request may make a server check
/// ([`MAX_SEGMENT_HEADER_BYTES_PER_REQUEST`]) bounds the work first.
pub const MAX_SEGMENTS_PER_REQUEST: u16 = u16::MAX - 1;

/// Most bytes of segment headers one request may make a server read and check: 64 MiB (a
/// request of 4,096 chunks spread over segments of 65,536 32-byte hashes, the largest, reads
/// 4.3 MiB per segment).
pub const MAX_SEGMENT_HEADER_BYTES_PER_REQUEST: u64 = 64 << 20;

/// Per-chunk entry for a chunk held in its own chunk object (format version 1).
const OWN_OBJECT: u16 = u16::MAX;

/// One segment object a request reads, as its chunks' publish markers describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentRef {
    /// SHA-256 of the segment's chunk list; its key names it.
    pub digest: [u8; 32],
    /// Chunks the segment holds, `1..=`[`MAX_SEGMENT_CHUNKS`].
    pub chunks: u32,
    /// The segment's header length in bytes (where layer 0 begins).
    pub header_len: u32,
    /// The segment object's length in bytes.
    pub object_len: u64,
}

/// Where a request's chunks lie: per chunk, in a segment (and at which index) or in its own
/// chunk object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentPlacement {
    /// The segment objects named, each once.
    pub segments: Vec<SegmentRef>,
    /// Per chunk of the request, in prefix order: `Some((s, i))` for chunk `i` of
    /// `segments[s]`, `None` for a chunk in its own chunk object.
    pub chunks: Vec<Option<(u16, u32)>>,
}

impl SegmentPlacement {
    /// The placement of a load's chunks `positions` (a stripe of it, or all of it) from the
    /// load's runs ([`crate::layout::place`] of its markers), indexed from `positions.start`.
    /// `Ok(None)` when none of those chunks lies in a segment (the request then names chunk
    /// objects only).
    ///
    /// # Errors
    /// [`ProtocolError::TooLarge`] when the chunks lie in more than
    /// [`MAX_SEGMENTS_PER_REQUEST`] segments (such a load cannot gather).
    pub fn from_runs(runs: &[Run], positions: Range<usize>) -> Result<Option<Self>, ProtocolError> {
        let mut segments: Vec<SegmentRef> = Vec::new();
        let mut chunks = vec![None; positions.len()];
        for run in runs {
            let Run::Segment(r) = run else { continue };
            let (a, b) = (
                r.positions.start.max(positions.start),
                r.positions.end.min(positions.end),
            );
            if a >= b {
                continue;
            }
            let seg = SegmentRef {
                digest: r.digest,
                chunks: r.chunks,
                header_len: r.header_len,
                object_len: r.object_len,
            };
            let s = match segments.iter().position(|x| *x == seg) {
                Some(s) => s,
                None => {
                    segments.push(seg);
                    segments.len() - 1
                }
            };
            let s = u16::try_from(s)
                .ok()
                .filter(|&s| s < MAX_SEGMENTS_PER_REQUEST)
                .ok_or(ProtocolError::TooLarge {
                    what: "segments per request",
                    got: segments.len() as u64,
                    max: MAX_SEGMENTS_PER_REQUEST as u64,
                })?;
            for p in a..b {
                let index = r.first_index + (p - r.positions.start) as u32;
                chunks[p - positions.start] = Some((s, index));
            }
        }
        Ok((!segments.is_empty()).then_some(SegmentPlacement { segments, chunks }))
    }

    /// Layout of segment `s`'s data for slices of `slice_len` bytes.
    pub fn layout(&self, s: u16, slice_len: u64) -> SegmentLayout {
        let r = &self.segments[s as usize];
        SegmentLayout {
            header_len: r.header_len as u64,
            chunks: r.chunks,
            slice_len,
        }
    }

    /// Checks the placement against the request's chunk count, geometry and chunk tokens:
    /// every segment's object length is the one its chunk count, header length and the
    /// geometry give; every index lies in its segment; a chunk in a segment is full.
    ///
    /// # Errors
    /// [`ProtocolError::Invalid`] naming the segment or chunk.
    pub fn validate(&self, g: &WireGeometry, chunk_tokens: &[u32]) -> Result<(), ProtocolError> {
        let bad = |m: String| Err(ProtocolError::invalid("segment placement", m));
        if self.segments.is_empty() || self.segments.len() > MAX_SEGMENTS_PER_REQUEST as usize {
            return bad(format!(
                "{} segments (allowed 1..={MAX_SEGMENTS_PER_REQUEST})",
                self.segments.len()
            ));
        }
        if self.chunks.len() != chunk_tokens.len() {
            return bad(format!(
                "{} entries for {} chunks",
                self.chunks.len(),
                chunk_tokens.len()
            ));
        }
        let slice = g.slice_len(g.tokens_per_chunk);
        let headers: u64 = self.segments.iter().map(|r| r.header_len as u64).sum();
        if headers > MAX_SEGMENT_HEADER_BYTES_PER_REQUEST {
            return bad(format!(
                "segment headers of {headers} bytes in all (allowed \
                 {MAX_SEGMENT_HEADER_BYTES_PER_REQUEST})"
            ));
        }
        for (s, r) in self.segments.iter().enumerate() {
            let (lo, hi) = SegmentLayout::header_len_bounds(r.chunks);
            if r.chunks == 0 || r.chunks > MAX_SEGMENT_CHUNKS {
                return bad(format!("segment {s} holds {} chunks", r.chunks));
            }
            if !(lo..=hi).contains(&(r.header_len as u64)) {
                return bad(format!(
                    "segment {s}: header length {} for {} chunks",
                    r.header_len, r.chunks
                ));
            }
            if self.layout(s as u16, slice).object_len(g.layers) != Some(r.object_len) {
                return bad(format!(
                    "segment {s}: object length {} is not its header's {} bytes and {} x {} \
                     slices of {slice} bytes",
                    r.object_len, r.header_len, g.layers, r.chunks
                ));
            }
        }
        for (c, e) in self.chunks.iter().enumerate() {
            let Some((s, i)) = *e else { continue };
            let Some(r) = self.segments.get(s as usize) else {
                return bad(format!(
                    "chunk {c} names segment {s} of {}",
                    self.segments.len()
                ));
            };
            if i >= r.chunks {
                return bad(format!(
                    "chunk {c}: index {i} in segment {s} of {} chunks",
                    r.chunks
                ));
            }
            if chunk_tokens[c] != g.tokens_per_chunk {
                return bad(format!(
                    "chunk {c} holds {} tokens; a segment holds full chunks of {}",
                    chunk_tokens[c], g.tokens_per_chunk
                ));
            }
        }
        Ok(())
    }

    /// Encodes the placement (see the module docs).
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_u16_le(self.segments.len() as u16);
        for r in &self.segments {
            out.put_slice(&r.digest);
            out.put_u32_le(r.chunks);
            out.put_u32_le(r.header_len);
            out.put_u64_le(r.object_len);
        }
        out.put_u32_le(self.chunks.len() as u32);
        for e in &self.chunks {
            let (s, i) = e.unwrap_or((OWN_OBJECT, 0));
            out.put_u16_le(s);
            out.put_u32_le(i);
        }
    }

    /// Decodes a placement of at most `max_chunks` chunk entries; counts are bounded before
    /// anything is allocated. [`SegmentPlacement::validate`] checks it against the request.
    ///
    /// # Errors
    /// [`ProtocolError`] naming the first bad field.
    pub(super) fn decode(r: &mut Reader<'_>, max_chunks: u32) -> Result<Self, ProtocolError> {
        let s = r.u16()?;
        if s == 0 || s > MAX_SEGMENTS_PER_REQUEST {
            return Err(ProtocolError::TooLarge {
                what: "segments per request",
                got: s as u64,
                max: MAX_SEGMENTS_PER_REQUEST as u64,
            });
        }
        // Not sized from `s` ahead: each entry is read (48 bytes) before it is kept.
        let mut segments = Vec::new();
        for _ in 0..s {
            let digest: [u8; 32] = r.take(32)?.try_into().expect("32 bytes");
            segments.push(SegmentRef {
                digest,
                chunks: r.u32()?,
                header_len: r.u32()?,
                object_len: r.u64()?,
            });
        }
        let n = r.count("segment placement entries", max_chunks, 6)?;
        let chunks = (0..n)
            .map(|_| {
                let (s, i) = (r.u16()?, r.u32()?);
                Ok((s != OWN_OBJECT).then_some((s, i)))
            })
            .collect::<Result<_, ProtocolError>>()?;
        Ok(SegmentPlacement { segments, chunks })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{ChunkHash, HashAlgo, KeyBuilder, KvGeometry, SegmentRun};
    use crate::protocol::{GatherRequest, ServerInfo};
    use bytes::BytesMut;

    /// A request for 6 chunks of `g`: chunks 0-1 in their own objects, 2-5 at indexes 1-4 of
    /// a 5-chunk segment.
    fn request() -> (GatherRequest, KeyBuilder) {
        let g = KvGeometry::smollm2_135m();
        let kb = KeyBuilder::new("ns", &g, HashAlgo::Sha256Cbor).unwrap();
        let hashes: Vec<ChunkHash> = (0..6).map(|i| ChunkHash::from_digest([i; 32])).collect();
        let mut r =
            GatherRequest::for_prefix(3, "kv-test", &kb, &g, hashes, vec![g.tokens_per_chunk; 6]);
        let slice = g.slice_bytes() + 4;
        let header_len = 64 + 5 * 33 + 4;
        let runs = vec![
            Run::Chunks(0..2),
            Run::Segment(SegmentRun {
                positions: 2..6,
                digest: [9; 32],
                first_index: 1,
                chunks: 5,
                header_len,
                object_len: header_len as u64 + g.layers as u64 * 5 * slice,
            }),
        ];
        r.segments = SegmentPlacement::from_runs(&runs, 0..6).unwrap();
        (r, kb)
    }

    #[test]
    fn placement_round_trips_and_places_each_chunk() {
        let (r, _) = request();
        let p = r.segments.as_ref().unwrap();
        assert_eq!(p.segments.len(), 1);
        assert_eq!(
            p.chunks,
            vec![
                None,
                None,
                Some((0, 1)),
                Some((0, 2)),
                Some((0, 3)),
                Some((0, 4))
            ]
        );
        let mut b = BytesMut::new();
        r.encode(&mut b);
        assert_eq!(GatherRequest::decode(&b, 4096).unwrap(), r);
        for n in 0..b.len() {
            assert!(GatherRequest::decode(&b[..n], 4096).is_err(), "prefix {n}");
        }
        // A stripe of chunks 3..6 is indexed from its own start.
        let runs_of = |r: &GatherRequest| r.segments.clone().unwrap();
        let whole = runs_of(&r);
        let stripe = SegmentPlacement::from_runs(
            &[Run::Segment(SegmentRun {
                positions: 2..6,
                digest: whole.segments[0].digest,
                first_index: 1,
                chunks: 5,
                header_len: whole.segments[0].header_len,
                object_len: whole.segments[0].object_len,
            })],
            3..6,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            stripe.chunks,
            vec![Some((0, 2)), Some((0, 3)), Some((0, 4))]
        );
        // Chunk objects only: no placement.
        assert_eq!(
            SegmentPlacement::from_runs(&[Run::Chunks(0..6)], 0..6),
            Ok(None)
        );
    }

    #[test]
    fn placements_that_cannot_be_are_refused_by_name() {
        let (r, _) = request();
        let refused = |f: &dyn Fn(&mut GatherRequest), what: &str| {
            let mut bad = r.clone();
            f(&mut bad);
            let e = bad.validate(4096).unwrap_err().to_string();
            assert!(e.contains("segment placement") && e.contains(what), "{e}");
            // The same from the wire: the server decodes and validates.
            let mut b = BytesMut::new();
            bad.encode(&mut b);
            assert!(GatherRequest::decode(&b, 4096).is_err());
        };
        fn seg(r: &mut GatherRequest) -> &mut SegmentPlacement {
            r.segments.as_mut().unwrap()
        }
        refused(
            &|r| {
                let p = seg(r);
                p.chunks[5] = Some((0, 5));
            },
            "index 5 in segment 0 of 5",
        );
        refused(
            &|r| {
                let p = seg(r);
                p.chunks[5] = Some((1, 0));
            },
            "names segment 1",
        );
        refused(
            &|r| {
                let p = seg(r);
                p.segments[0].object_len += 1;
            },
            "object length",
        );
        refused(
            &|r| {
                let p = seg(r);
                p.segments[0].header_len = 10;
            },
            "header length 10",
        );
        refused(&|r| r.chunk_tokens[4] = 7, "chunk 4 holds 7 tokens");
        refused(
            &|r| {
                let p = seg(r);
                p.chunks.pop();
            },
            "5 entries for 6 chunks",
        );
        refused(
            &|r| r.chunks = super::super::ChunkKeys::Explicit(vec!["k".into(); 6]),
            "hashed key form",
        );
    }

    #[test]
    fn a_placement_goes_only_to_a_server_that_reads_segments() {
        use crate::protocol::tests::connected;
        use crate::protocol::ServerLimits;
        let (r, _) = request();
        // Announced (the default): the placement goes through and the server has it.
        let (mut c, mut s, _) = connected(ServerLimits::default().features);
        c.start_gather(&r).unwrap();
        let mut b = BytesMut::new();
        while let Some(x) = c.poll_transmit() {
            b.extend_from_slice(&x);
        }
        s.handle_bytes(&mut b).unwrap();
        match s.poll_event() {
            Some(crate::protocol::ServerEvent::Gather(g)) => assert_eq!(g.segments, r.segments),
            e => panic!("{e:?}"),
        }
        // Not announced: the client refuses to send it, the server to take it.
        let old = ServerLimits::default().features & !ServerInfo::FEATURE_SEGMENTS;
        let (mut c, mut s, _) = connected(old);
        let e = c.start_gather(&r).unwrap_err().to_string();
        assert!(e.contains("Segments feature"), "{e}");
        let mut b = BytesMut::new();
        crate::protocol::Frame::Gather(Box::new(r.clone())).encode(&mut b);
        let e = s.handle_bytes(&mut b).unwrap_err().to_string();
        assert!(e.contains("bit 4"), "{e}");
    }
}
