//! Segment objects (object format version 2): one object holds the chunks of one save,
//! layer-major *across* them, so one layer of the whole save is one byte range. The design and
//! the measurements behind it are in `docs/object-format.md` ("Format version 2: segment
//! objects"); this file implements its byte layout, its publish marker and the read ranges.
//!
//! ```text
//! segment object
//! offset  size  field
//! 0       8     magic  b"OCKVSEGM"
//! 8       2     format version (u16 LE) = 2
//! 10      2     fixed header length (u16 LE) = 64
//! 12      1     dtype code
//! 13      1     checksum algorithm (1 = CRC32C)
//! 14      2     flags (u16 LE) = 0
//! 16      8     geometry fingerprint (u64 LE)
//! 24      4     layers (u32 LE)
//! 28      4     chunks n (u32 LE), 1..=MAX_SEGMENT_CHUNKS
//! 32      4     bytes per token per layer on this rank (u32 LE)
//! 36      2     TP rank (u16 LE)
//! 38      2     TP world (u16 LE)
//! 40      8     slice length in bytes, checksum excluded (u64 LE) = tokens/chunk x bytes/token/layer
//! 48      4     tokens per chunk (u32 LE): every chunk of a segment is full
//! 52      4     header length H (u32 LE): 64 + the chunk list + 4
//! 56      4     reserved, zero
//! 60      4     CRC32C of bytes 0..60 (u32 LE)
//! 64      ...   chunk list: per chunk, its hash's length (u8, 1..=64) then the hash
//! H-4     4     CRC32C of the chunk list (u32 LE)
//! H       ...   layer l of chunk i at H + (l x n + i) x (slice length + 4): K, V, CRC32C
//!
//! segment publish marker (one per chunk, 64 bytes)
//! 0       8     magic  b"OCKVPUB2"
//! 8       8     segment object length (u64 LE)
//! 16      4     chunks n of the segment (u32 LE)
//! 20      4     this chunk's index in the segment (u32 LE), < n
//! 24      4     segment header length H (u32 LE)
//! 28      32    segment digest: SHA-256 of the chunk list (the key names it)
//! 60      4     CRC32C of bytes 0..60 (u32 LE)
//! ```
//! A marker alone gives every offset a load needs (H, n, the slice length from the geometry),
//! so the first layer's read need not wait for the segment's header; the header (fingerprint
//! and chunk list) is checked before any byte read with it is exposed.
#![forbid(unsafe_code)]

use super::format::{FormatError, LeFields, CHECKSUM_CRC32C, MARKER_MAGIC, SLICE_CRC_LEN};
use super::geometry::{Dtype, KvGeometry};
use super::key::ChunkHash;
use sha2::{Digest, Sha256};
use std::ops::Range;

/// The 8-byte magic at offset 0 of every segment object.
pub const SEGMENT_MAGIC: [u8; 8] = *b"OCKVSEGM";
/// Object format version of segment objects.
pub const SEGMENT_VERSION: u16 = 2;
/// Length of a segment header's fixed part in bytes (the chunk list follows it).
pub const SEGMENT_FIXED_LEN: u64 = 64;
/// Most chunks one segment may hold: 65,536 (a 1M-token save in 16-token chunks). A header
/// declaring more is refused before anything is sized from it.
pub const MAX_SEGMENT_CHUNKS: u32 = 65_536;
/// Magic of a segment publish marker.
pub const SEGMENT_MARKER_MAGIC: [u8; 8] = *b"OCKVPUB2";
/// Length of a segment publish marker in bytes.
pub const SEGMENT_MARKER_LEN: usize = 64;

/// The decoded fixed header of a segment object: its geometry, its chunk count and where its
/// data begins. Every offset of the object follows from it (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentHeader {
    /// Element type.
    pub dtype: Dtype,
    /// Geometry fingerprint ([`KvGeometry::fingerprint`]).
    pub fingerprint: u64,
    /// Layers.
    pub layers: u32,
    /// Chunks held, `n`.
    pub chunks: u32,
    /// Bytes per token per layer on this rank.
    pub bytes_per_token_per_layer: u32,
    /// TP rank.
    pub tp_rank: u16,
    /// TP world.
    pub tp_world: u16,
    /// Slice length in bytes (one chunk, one layer), CRC excluded.
    pub slice_len: u64,
    /// Tokens in each chunk (every chunk of a segment is full).
    pub tokens_per_chunk: u32,
    /// Header length in bytes, chunk list and its CRC included: where layer 0 begins.
    pub header_len: u32,
}

/// Bytes the chunk list of `hashes` takes, its CRC included.
fn chunk_list_len(hashes: &[ChunkHash]) -> u64 {
    hashes
        .iter()
        .map(|h| 1 + h.as_bytes().len() as u64)
        .sum::<u64>()
        + 4
}

/// The chunk list's bytes, CRC excluded: per chunk, its hash's length then the hash.
fn encode_chunk_list(hashes: &[ChunkHash]) -> Vec<u8> {
    let mut b = Vec::with_capacity(chunk_list_len(hashes) as usize);
    for h in hashes {
        b.push(h.as_bytes().len() as u8);
        b.extend_from_slice(h.as_bytes());
    }
    b
}

/// The segment digest of `hashes`: SHA-256 of their chunk list (each hash's length byte, then
/// the hash). The segment's key names it, so equal keys hold the same chunks in the same order.
pub fn segment_digest(hashes: &[ChunkHash]) -> [u8; 32] {
    Sha256::digest(encode_chunk_list(hashes)).into()
}

impl SegmentHeader {
    /// The header of a segment of geometry `g` holding the full chunks `hashes`, in order.
    ///
    /// # Errors
    /// [`FormatError::InvalidField`] if `hashes` is empty, longer than
    /// [`MAX_SEGMENT_CHUNKS`], or the header would exceed 4 GiB.
    pub fn for_geometry(g: &KvGeometry, hashes: &[ChunkHash]) -> Result<Self, FormatError> {
        if hashes.is_empty() || hashes.len() > MAX_SEGMENT_CHUNKS as usize {
            return Err(FormatError::InvalidField(format!(
                "a segment holds 1..={MAX_SEGMENT_CHUNKS} chunks, got {}",
                hashes.len()
            )));
        }
        let header_len = SEGMENT_FIXED_LEN + chunk_list_len(hashes);
        Ok(SegmentHeader {
            dtype: g.dtype,
            fingerprint: g.fingerprint(),
            layers: g.layers,
            chunks: hashes.len() as u32,
            bytes_per_token_per_layer: g.bytes_per_token_per_layer() as u32,
            tp_rank: g.tp_rank as u16,
            tp_world: g.tp_world as u16,
            slice_len: g.slice_bytes(),
            tokens_per_chunk: g.tokens_per_chunk,
            header_len: u32::try_from(header_len)
                .map_err(|_| FormatError::InvalidField(format!("header of {header_len} bytes")))?,
        })
    }

    /// Encodes the whole header: the 64 fixed bytes, the chunk list of `hashes` and its CRC.
    ///
    /// # Errors
    /// [`FormatError::WrongSize`] if `hashes` is not the list this header was made for (count
    /// or length).
    pub fn encode(&self, hashes: &[ChunkHash]) -> Result<Vec<u8>, FormatError> {
        if hashes.len() as u64 != self.chunks as u64
            || SEGMENT_FIXED_LEN + chunk_list_len(hashes) != self.header_len as u64
        {
            return Err(FormatError::WrongSize(format!(
                "{} chunk hashes for a segment header of {} chunks and {} bytes",
                hashes.len(),
                self.chunks,
                self.header_len
            )));
        }
        let mut b = vec![0u8; SEGMENT_FIXED_LEN as usize];
        b[0..8].copy_from_slice(&SEGMENT_MAGIC);
        b[8..10].copy_from_slice(&SEGMENT_VERSION.to_le_bytes());
        b[10..12].copy_from_slice(&(SEGMENT_FIXED_LEN as u16).to_le_bytes());
        b[12] = self.dtype.code();
        b[13] = CHECKSUM_CRC32C;
        b[16..24].copy_from_slice(&self.fingerprint.to_le_bytes());
        b[24..28].copy_from_slice(&self.layers.to_le_bytes());
        b[28..32].copy_from_slice(&self.chunks.to_le_bytes());
        b[32..36].copy_from_slice(&self.bytes_per_token_per_layer.to_le_bytes());
        b[36..38].copy_from_slice(&self.tp_rank.to_le_bytes());
        b[38..40].copy_from_slice(&self.tp_world.to_le_bytes());
        b[40..48].copy_from_slice(&self.slice_len.to_le_bytes());
        b[48..52].copy_from_slice(&self.tokens_per_chunk.to_le_bytes());
        b[52..56].copy_from_slice(&self.header_len.to_le_bytes());
        let crc = super::crc::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        let list = encode_chunk_list(hashes);
        let list_crc = super::crc::crc32c(&list);
        b.extend_from_slice(&list);
        b.extend_from_slice(&list_crc.to_le_bytes());
        Ok(b)
    }

    /// Decodes and checks the fixed header from the first 64 bytes of a segment object.
    ///
    /// # Errors
    /// [`FormatError::Truncated`], [`FormatError::BadMagic`],
    /// [`FormatError::UnsupportedVersion`], [`FormatError::HeaderChecksum`] or
    /// [`FormatError::InvalidField`] (naming the field: no writer produces it, e.g. 0 chunks,
    /// more than [`MAX_SEGMENT_CHUNKS`], a header length the chunk list cannot have, or an
    /// object length beyond 2^64).
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let f = LeFields::open(b, SEGMENT_FIXED_LEN, &SEGMENT_MAGIC)?;
        if f.u16(8) != SEGMENT_VERSION {
            return Err(FormatError::UnsupportedVersion(f.u16(8)));
        }
        if super::crc::crc32c(&b[0..60]) != f.u32(60) {
            return Err(FormatError::HeaderChecksum);
        }
        let bad = |m: String| Err(FormatError::InvalidField(m));
        if f.u16(10) as u64 != SEGMENT_FIXED_LEN {
            return bad(format!("segment fixed header length {}", f.u16(10)));
        }
        let dtype = Dtype::from_code(b[12])
            .ok_or_else(|| FormatError::InvalidField(format!("dtype code {}", b[12])))?;
        if b[13] != CHECKSUM_CRC32C {
            return bad(format!("checksum algorithm {}", b[13]));
        }
        if f.u16(14) != 0 || f.u32(56) != 0 {
            return bad("segment flags or reserved bytes are not zero".into());
        }
        let h = SegmentHeader {
            dtype,
            fingerprint: f.u64(16),
            layers: f.u32(24),
            chunks: f.u32(28),
            bytes_per_token_per_layer: f.u32(32),
            tp_rank: f.u16(36),
            tp_world: f.u16(38),
            slice_len: f.u64(40),
            tokens_per_chunk: f.u32(48),
            header_len: f.u32(52),
        };
        if h.layers == 0 || h.tokens_per_chunk == 0 || h.tp_world == 0 || h.tp_rank >= h.tp_world {
            return bad(format!(
                "layers {} tokens/chunk {} tp {}/{}",
                h.layers, h.tokens_per_chunk, h.tp_rank, h.tp_world
            ));
        }
        if h.chunks == 0 || h.chunks > MAX_SEGMENT_CHUNKS {
            return bad(format!(
                "a segment holds 1..={MAX_SEGMENT_CHUNKS} chunks, header says {}",
                h.chunks
            ));
        }
        if h.slice_len != h.tokens_per_chunk as u64 * h.bytes_per_token_per_layer as u64 {
            return bad(format!(
                "slice length {} is not tokens/chunk {} x bytes/token/layer {}",
                h.slice_len, h.tokens_per_chunk, h.bytes_per_token_per_layer
            ));
        }
        let (lo, hi) = SegmentLayout::header_len_bounds(h.chunks);
        if !(lo..=hi).contains(&(h.header_len as u64)) {
            return bad(format!(
                "header length {} for {} chunks (must be {lo}..={hi})",
                h.header_len, h.chunks
            ));
        }
        if h.checked_object_len().is_none() {
            return bad(format!(
                "{} layers x {} chunks x {}-byte slices overflow",
                h.layers, h.chunks, h.slice_len
            ));
        }
        Ok(h)
    }

    /// Decodes and checks the chunk list from the header's bytes (`b` holds at least
    /// [`SegmentHeader::header_len`] bytes from offset 0).
    ///
    /// # Errors
    /// [`FormatError::Truncated`] if `b` is shorter than the header;
    /// [`FormatError::HeaderChecksum`] if the list's CRC does not match;
    /// [`FormatError::InvalidField`] if an entry's length is 0 or the entries do not fill the
    /// list exactly.
    pub fn decode_chunk_list(&self, b: &[u8]) -> Result<Vec<ChunkHash>, FormatError> {
        let end = self.header_len as usize;
        if b.len() < end {
            return Err(FormatError::Truncated {
                got: b.len() as u64,
                expected: end as u64,
            });
        }
        let list = &b[SEGMENT_FIXED_LEN as usize..end - 4];
        let stored = u32::from_le_bytes(b[end - 4..end].try_into().expect("4"));
        if super::crc::crc32c(list) != stored {
            return Err(FormatError::HeaderChecksum);
        }
        let mut out = Vec::with_capacity(self.chunks as usize);
        let mut at = 0usize;
        while at < list.len() {
            let n = list[at] as usize;
            let Some(h) = list.get(at + 1..at + 1 + n) else {
                break;
            };
            out.push(ChunkHash::new(h).map_err(|e| FormatError::InvalidField(e.to_string()))?);
            at += 1 + n;
        }
        if at != list.len() || out.len() != self.chunks as usize {
            return Err(FormatError::InvalidField(format!(
                "the chunk list does not hold exactly {} hashes",
                self.chunks
            )));
        }
        Ok(out)
    }

    /// Checks that this segment holds chunks of geometry `g` (full chunks of
    /// `g.tokens_per_chunk` tokens).
    ///
    /// # Errors
    /// [`FormatError::GeometryMismatch`] naming the first differing field.
    pub fn check(&self, g: &KvGeometry) -> Result<(), FormatError> {
        let mism = |m: String| Err(FormatError::GeometryMismatch(m));
        if self.fingerprint != g.fingerprint() {
            return mism(format!(
                "segment fingerprint {:016x} is not {:016x} ({})",
                self.fingerprint,
                g.fingerprint(),
                g.model
            ));
        }
        if self.layers != g.layers
            || self.dtype != g.dtype
            || self.bytes_per_token_per_layer as u64 != g.bytes_per_token_per_layer()
            || self.tokens_per_chunk != g.tokens_per_chunk
        {
            return mism(format!(
                "segment is {} layers of {} x {} tokens x {} bytes/token/layer, expected {} of {} x {} x {}",
                self.layers,
                self.dtype,
                self.tokens_per_chunk,
                self.bytes_per_token_per_layer,
                g.layers,
                g.dtype,
                g.tokens_per_chunk,
                g.bytes_per_token_per_layer()
            ));
        }
        if self.tp_rank as u32 != g.tp_rank || self.tp_world as u32 != g.tp_world {
            return mism(format!(
                "segment is TP rank {}/{}, expected {}/{}",
                self.tp_rank, self.tp_world, g.tp_rank, g.tp_world
            ));
        }
        Ok(())
    }

    fn checked_object_len(&self) -> Option<u64> {
        self.layout().object_len(self.layers)
    }

    /// Total object size in bytes: the header, then `layers x chunks` slices with their CRCs.
    pub fn object_len(&self) -> u64 {
        self.checked_object_len()
            .expect("checked when the header was made or decoded")
    }

    /// Layout of this segment's data (what a marker also gives).
    pub fn layout(&self) -> SegmentLayout {
        SegmentLayout {
            header_len: self.header_len as u64,
            chunks: self.chunks,
            slice_len: self.slice_len,
        }
    }
}

/// Where a segment's slices are, from its header length, its chunk count and the slice length
/// (a [`SegmentHeader`] or a [`SegmentMarker`] and the geometry give all three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentLayout {
    /// Header length in bytes: where layer 0 begins.
    pub header_len: u64,
    /// Chunks in the segment, `n`.
    pub chunks: u32,
    /// Slice length in bytes, CRC excluded.
    pub slice_len: u64,
}

impl SegmentLayout {
    /// The least and the most bytes the header of a segment of `chunks` chunks can take:
    /// the fixed part, each chunk list entry 2..=65 bytes (a length byte and a 1- to 64-byte
    /// hash), and the list's CRC.
    pub fn header_len_bounds(chunks: u32) -> (u64, u64) {
        (
            SEGMENT_FIXED_LEN + 2 * chunks as u64 + 4,
            SEGMENT_FIXED_LEN + 65 * chunks as u64 + 4,
        )
    }

    /// The object's length in bytes for `layers` layers: the header, then `layers x chunks`
    /// slices with their CRCs; `None` if that overflows a u64.
    pub fn object_len(&self, layers: u32) -> Option<u64> {
        (self.slice_len + SLICE_CRC_LEN)
            .checked_mul(self.chunks as u64)?
            .checked_mul(layers as u64)?
            .checked_add(self.header_len)
    }

    /// Byte range of chunk `index`'s slice of layer `layer`, its 4-byte CRC included.
    pub fn slice_range(&self, layer: u32, index: u32) -> Range<u64> {
        self.run_range(layer, index..index + 1)
    }

    /// Byte range of layer `layer`'s slices of the consecutive chunks `indexes` (CRCs
    /// included): one ranged read serves a run of chunks in one layer. A partial hit of the
    /// first `k` chunks reads `0..k`.
    pub fn run_range(&self, layer: u32, indexes: Range<u32>) -> Range<u64> {
        let stride = self.slice_len + SLICE_CRC_LEN;
        let at = |i: u32| self.header_len + (layer as u64 * self.chunks as u64 + i as u64) * stride;
        at(indexes.start)..at(indexes.end)
    }
}

/// Encodes a whole segment of geometry `g` holding the full chunks `hashes`.
///
/// `parts(l, i)` returns layer `l`'s slice of chunk `i` (K of its tokens then V, or the
/// engine's blocks when the geometry names a [`crate::layout::KvLayout`]) as parts whose
/// concatenation is the slice.
///
/// # Errors
/// [`FormatError::WrongSize`] naming the layer and chunk whose parts are not one slice long;
/// as [`SegmentHeader::for_geometry`].
pub fn encode_segment_parts<'a>(
    g: &KvGeometry,
    hashes: &[ChunkHash],
    mut parts: impl FnMut(u32, u32) -> Vec<&'a [u8]>,
) -> Result<(SegmentHeader, Vec<u8>), FormatError> {
    let h = SegmentHeader::for_geometry(g, hashes)?;
    let len = usize::try_from(h.object_len())
        .map_err(|_| FormatError::WrongSize(format!("a {}-byte segment", h.object_len())))?;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&h.encode(hashes)?);
    for l in 0..h.layers {
        for i in 0..h.chunks {
            let ps = parts(l, i);
            let n: u64 = ps.iter().map(|p| p.len() as u64).sum();
            if n != h.slice_len {
                return Err(FormatError::WrongSize(format!(
                    "layer {l} of chunk {i} has {n} bytes, expected {}",
                    h.slice_len
                )));
            }
            let mut crc = 0u32;
            for p in ps {
                out.extend_from_slice(p);
                crc = super::crc::crc32c_append(crc, p);
            }
            out.extend_from_slice(&crc.to_le_bytes());
        }
    }
    Ok((h, out))
}

/// A chunk's publish marker in format version 2: which segment holds the chunk, at which
/// index, and the segment's layout (64 bytes on the store, see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentMarker {
    /// The segment object's length in bytes.
    pub object_len: u64,
    /// Chunks in the segment.
    pub chunks: u32,
    /// This chunk's index in the segment, `< chunks`.
    pub index: u32,
    /// The segment's header length: where its layer 0 begins.
    pub header_len: u32,
    /// The segment's digest ([`segment_digest`] of its chunk list); its key names it.
    pub digest: [u8; 32],
}

impl SegmentMarker {
    /// The marker of chunk `index` of the segment with header `h` and digest `digest`.
    pub fn new(h: &SegmentHeader, index: u32, digest: [u8; 32]) -> Self {
        SegmentMarker {
            object_len: h.object_len(),
            chunks: h.chunks,
            index,
            header_len: h.header_len,
            digest,
        }
    }

    /// Encodes the 64-byte marker.
    pub fn encode(&self) -> [u8; SEGMENT_MARKER_LEN] {
        let mut b = [0u8; SEGMENT_MARKER_LEN];
        b[0..8].copy_from_slice(&SEGMENT_MARKER_MAGIC);
        b[8..16].copy_from_slice(&self.object_len.to_le_bytes());
        b[16..20].copy_from_slice(&self.chunks.to_le_bytes());
        b[20..24].copy_from_slice(&self.index.to_le_bytes());
        b[24..28].copy_from_slice(&self.header_len.to_le_bytes());
        b[28..60].copy_from_slice(&self.digest);
        let crc = super::crc::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// The segment's layout, for slices of `slice_len` bytes (the geometry's).
    pub fn layout(&self, slice_len: u64) -> SegmentLayout {
        SegmentLayout {
            header_len: self.header_len as u64,
            chunks: self.chunks,
            slice_len,
        }
    }
}

/// A decoded publish marker of either format version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Marker {
    /// Format version 1: the chunk's own object (`kv/{hash}`) of this length.
    Chunk {
        /// The chunk object's length in bytes.
        object_len: u64,
    },
    /// Format version 2: the chunk is in a segment object (`seg/{digest}`).
    Segment(SegmentMarker),
}

/// Decodes a publish marker of format version 1 (16 bytes, `OCKVPUB1`) or 2 (64 bytes,
/// `OCKVPUB2`).
///
/// # Errors
/// [`FormatError::BadMagic`] for neither magic; [`FormatError::Truncated`] for a length that
/// is not the magic's; [`FormatError::HeaderChecksum`] if a version 2 marker's CRC does not
/// match; [`FormatError::InvalidField`] if its index is not below its chunk count, or its
/// counts are ones no writer produces.
pub fn decode_marker(b: &[u8]) -> Result<Marker, FormatError> {
    let magic = b.get(..8).ok_or(FormatError::Truncated {
        got: b.len() as u64,
        expected: 8,
    })?;
    let exact = |n: usize| {
        if b.len() == n {
            Ok(())
        } else {
            Err(FormatError::Truncated {
                got: b.len() as u64,
                expected: n as u64,
            })
        }
    };
    let f = LeFields::of(b);
    if magic == MARKER_MAGIC {
        exact(16)?;
        return Ok(Marker::Chunk {
            object_len: f.u64(8),
        });
    }
    if magic != SEGMENT_MARKER_MAGIC {
        return Err(FormatError::BadMagic);
    }
    exact(SEGMENT_MARKER_LEN)?;
    if super::crc::crc32c(&b[0..60]) != f.u32(60) {
        return Err(FormatError::HeaderChecksum);
    }
    let m = SegmentMarker {
        object_len: f.u64(8),
        chunks: f.u32(16),
        index: f.u32(20),
        header_len: f.u32(24),
        digest: b[28..60].try_into().expect("32"),
    };
    if m.chunks == 0 || m.chunks > MAX_SEGMENT_CHUNKS || m.index >= m.chunks {
        return Err(FormatError::InvalidField(format!(
            "marker names chunk {} of a {}-chunk segment",
            m.index, m.chunks
        )));
    }
    if (m.header_len as u64) < SegmentLayout::header_len_bounds(m.chunks).0 {
        return Err(FormatError::InvalidField(format!(
            "marker's segment header length {} for {} chunks",
            m.header_len, m.chunks
        )));
    }
    Ok(Marker::Segment(m))
}

#[cfg(test)]
mod tests;
