//! The chunk object format, version 1: a 64-byte header followed by one slice per layer,
//! layer-major. The normative spec is `docs/object-format.md`; this file implements it.
//!
//! ```text
//! offset  size  field
//! 0       8     magic  b"OCKVCHNK"
//! 8       2     format version (u16 LE) = 1
//! 10      2     header length in bytes (u16 LE) = 64
//! 12      1     dtype code (1 bf16, 2 fp16, 3 fp8-e4m3, 4 fp32)
//! 13      1     checksum algorithm (1 = CRC32C, Castagnoli)
//! 14      2     flags (u16 LE) = 0
//! 16      8     geometry fingerprint (u64 LE), see KvGeometry::fingerprint
//! 24      4     layers (u32 LE)
//! 28      4     token count in this chunk (u32 LE), 1..=tokens_per_chunk
//! 32      4     bytes per token per layer on this rank (u32 LE)
//! 36      2     TP rank (u16 LE)
//! 38      2     TP world (u16 LE)
//! 40      8     slice length in bytes, checksum excluded (u64 LE) = tokens x bytes/token/layer
//! 48      12    reserved, zero
//! 60      4     CRC32C of bytes 0..60 (u32 LE)
//! 64      ...   layer l's slice at 64 + l x (slice length + 4): K bytes, V bytes, CRC32C (u32 LE)
//! ```
//! Each slice's CRC covers that slice's K and V bytes only, so a ranged read of one slice
//! verifies itself with no other read.
#![forbid(unsafe_code)]

use super::geometry::{Dtype, KvGeometry};
use std::ops::Range;

/// The 8-byte magic at offset 0 of every chunk object.
pub const MAGIC: [u8; 8] = *b"OCKVCHNK";
/// Current object format version.
pub const FORMAT_VERSION: u16 = 1;
/// Header length in bytes for format version 1.
pub const HEADER_LEN: u64 = 64;
/// Bytes of the CRC32C trailer after each layer slice.
pub const SLICE_CRC_LEN: u64 = 4;
/// Checksum algorithm code for CRC32C.
pub const CHECKSUM_CRC32C: u8 = 1;

/// Why bytes are not a valid chunk object for the expected geometry.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormatError {
    /// Fewer bytes than the header or the declared body.
    #[error("object is truncated: {got} bytes, expected {expected}")]
    Truncated {
        /// Bytes present.
        got: u64,
        /// Bytes required.
        expected: u64,
    },
    /// Not an ObjectCache chunk object.
    #[error("bad magic: not an ObjectCache chunk object")]
    BadMagic,
    /// A format version this build does not read.
    #[error("unsupported object format version {0} (this build reads version 1)")]
    UnsupportedVersion(u16),
    /// The header's own CRC does not match.
    #[error("header checksum mismatch")]
    HeaderChecksum,
    /// The header is well formed but describes another model or layout.
    #[error("geometry mismatch: {0}")]
    GeometryMismatch(String),
    /// A field holds a value no writer produces (unknown dtype, zero tokens, ...).
    #[error("invalid header field: {0}")]
    InvalidField(String),
    /// Data passed to the encoder has the wrong size.
    #[error("wrong data size: {0}")]
    WrongSize(String),
    /// A slice's CRC32C does not match.
    #[error(
        "slice checksum mismatch in layer {layer}: stored {stored:08x}, computed {computed:08x}"
    )]
    SliceChecksum {
        /// Layer index.
        layer: usize,
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
}

/// The decoded header of a chunk object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Format version (1).
    pub version: u16,
    /// Element type.
    pub dtype: Dtype,
    /// Geometry fingerprint ([`KvGeometry::fingerprint`]).
    pub fingerprint: u64,
    /// Layers in the object.
    pub layers: u32,
    /// Tokens held (a full chunk holds `tokens_per_chunk`).
    pub tokens: u32,
    /// Bytes per token per layer on this rank.
    pub bytes_per_token_per_layer: u32,
    /// TP rank.
    pub tp_rank: u16,
    /// TP world.
    pub tp_world: u16,
    /// Slice length in bytes, CRC excluded.
    pub slice_len: u64,
}

impl ChunkHeader {
    /// The header for a chunk of `tokens` tokens of geometry `g`.
    pub fn for_geometry(g: &KvGeometry, tokens: u32) -> Self {
        ChunkHeader {
            version: FORMAT_VERSION,
            dtype: g.dtype,
            fingerprint: g.fingerprint(),
            layers: g.layers,
            tokens,
            bytes_per_token_per_layer: g.bytes_per_token_per_layer() as u32,
            tp_rank: g.tp_rank as u16,
            tp_world: g.tp_world as u16,
            slice_len: tokens as u64 * g.bytes_per_token_per_layer(),
        }
    }

    /// Encodes the 64-byte header.
    pub fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut b = [0u8; HEADER_LEN as usize];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10..12].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        b[12] = self.dtype.code();
        b[13] = CHECKSUM_CRC32C;
        b[16..24].copy_from_slice(&self.fingerprint.to_le_bytes());
        b[24..28].copy_from_slice(&self.layers.to_le_bytes());
        b[28..32].copy_from_slice(&self.tokens.to_le_bytes());
        b[32..36].copy_from_slice(&self.bytes_per_token_per_layer.to_le_bytes());
        b[36..38].copy_from_slice(&self.tp_rank.to_le_bytes());
        b[38..40].copy_from_slice(&self.tp_world.to_le_bytes());
        b[40..48].copy_from_slice(&self.slice_len.to_le_bytes());
        let crc = super::crc::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a header from the first 64 bytes of an object.
    ///
    /// # Errors
    /// [`FormatError::Truncated`], [`FormatError::BadMagic`], [`FormatError::UnsupportedVersion`],
    /// [`FormatError::HeaderChecksum`] or [`FormatError::InvalidField`].
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let f = LeFields::open(b, HEADER_LEN, &MAGIC)?;
        let version = f.u16(8);
        if version != FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        if super::crc::crc32c(&b[0..60]) != f.u32(60) {
            return Err(FormatError::HeaderChecksum);
        }
        if f.u16(10) as u64 != HEADER_LEN {
            return Err(FormatError::InvalidField(format!(
                "header length {}",
                f.u16(10)
            )));
        }
        let dtype = Dtype::from_code(b[12])
            .ok_or_else(|| FormatError::InvalidField(format!("dtype code {}", b[12])))?;
        if b[13] != CHECKSUM_CRC32C {
            return Err(FormatError::InvalidField(format!(
                "checksum algorithm {}",
                b[13]
            )));
        }
        let h = ChunkHeader {
            version,
            dtype,
            fingerprint: f.u64(16),
            layers: f.u32(24),
            tokens: f.u32(28),
            bytes_per_token_per_layer: f.u32(32),
            tp_rank: f.u16(36),
            tp_world: f.u16(38),
            slice_len: f.u64(40),
        };
        if h.layers == 0 || h.tokens == 0 || h.tp_world == 0 || h.tp_rank >= h.tp_world {
            return Err(FormatError::InvalidField(format!(
                "layers {} tokens {} tp {}/{}",
                h.layers, h.tokens, h.tp_rank, h.tp_world
            )));
        }
        if h.slice_len != h.tokens as u64 * h.bytes_per_token_per_layer as u64 {
            return Err(FormatError::InvalidField(format!(
                "slice length {} is not tokens {} x bytes/token/layer {}",
                h.slice_len, h.tokens, h.bytes_per_token_per_layer
            )));
        }
        Ok(h)
    }

    /// Checks that this header describes a chunk of geometry `g` holding `tokens` tokens.
    ///
    /// # Errors
    /// [`FormatError::GeometryMismatch`] naming the first differing field.
    pub fn check(&self, g: &KvGeometry, tokens: u32) -> Result<(), FormatError> {
        let mism = |m: String| Err(FormatError::GeometryMismatch(m));
        if self.fingerprint != g.fingerprint() {
            return mism(format!(
                "fingerprint {:016x} is not {:016x} ({} {} layers, {}, {} tokens/chunk, TP {})",
                self.fingerprint,
                g.fingerprint(),
                g.model,
                g.layers,
                g.dtype,
                g.tokens_per_chunk,
                g.tp_world
            ));
        }
        if self.layers != g.layers {
            return mism(format!(
                "object has {} layers, expected {}",
                self.layers, g.layers
            ));
        }
        if self.dtype != g.dtype {
            return mism(format!("object dtype {}, expected {}", self.dtype, g.dtype));
        }
        if self.bytes_per_token_per_layer as u64 != g.bytes_per_token_per_layer() {
            return mism(format!(
                "object has {} bytes per token per layer, expected {}",
                self.bytes_per_token_per_layer,
                g.bytes_per_token_per_layer()
            ));
        }
        if self.tp_rank as u32 != g.tp_rank || self.tp_world as u32 != g.tp_world {
            return mism(format!(
                "object is TP rank {}/{}, expected {}/{}",
                self.tp_rank, self.tp_world, g.tp_rank, g.tp_world
            ));
        }
        if self.tokens != tokens {
            return mism(format!(
                "object holds {} tokens, expected {}",
                self.tokens, tokens
            ));
        }
        Ok(())
    }

    /// Total object size in bytes: header plus `layers x (slice_len + 4)`.
    pub fn object_len(&self) -> u64 {
        object_len(self.layers, self.slice_len)
    }
}

/// The little-endian fields of a fixed-layout header (a chunk object's or a segment object's),
/// read at byte offsets below the length [`LeFields::open`] checked.
pub(crate) struct LeFields<'a>(&'a [u8]);

impl<'a> LeFields<'a> {
    /// `b` as a header at least `fixed_len` bytes long that starts with `magic`.
    ///
    /// # Errors
    /// [`FormatError::Truncated`] when `b` is shorter than `fixed_len`; [`FormatError::BadMagic`]
    /// when its first 8 bytes are not `magic`.
    pub(crate) fn open(b: &'a [u8], fixed_len: u64, magic: &[u8; 8]) -> Result<Self, FormatError> {
        if (b.len() as u64) < fixed_len {
            return Err(FormatError::Truncated {
                got: b.len() as u64,
                expected: fixed_len,
            });
        }
        if b[0..8] != *magic {
            return Err(FormatError::BadMagic);
        }
        Ok(LeFields(b))
    }

    /// `b` as a header whose length the caller checks before each read (a read past the end
    /// panics).
    pub(crate) fn of(b: &'a [u8]) -> Self {
        LeFields(b)
    }

    /// The u16 at byte `o`.
    pub(crate) fn u16(&self, o: usize) -> u16 {
        u16::from_le_bytes([self.0[o], self.0[o + 1]])
    }

    /// The u32 at byte `o`.
    pub(crate) fn u32(&self, o: usize) -> u32 {
        u32::from_le_bytes(self.0[o..o + 4].try_into().expect("4 bytes"))
    }

    /// The u64 at byte `o`.
    pub(crate) fn u64(&self, o: usize) -> u64 {
        u64::from_le_bytes(self.0[o..o + 8].try_into().expect("8 bytes"))
    }
}

/// Magic of a publish marker object (see docs/object-format.md, "Publish markers").
pub const MARKER_MAGIC: [u8; 8] = *b"OCKVPUB1";

/// A publish marker's 16 bytes: [`MARKER_MAGIC`], then the data object's length (u64 LE).
pub fn encode_marker(object_len: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&MARKER_MAGIC);
    b[8..].copy_from_slice(&object_len.to_le_bytes());
    b
}

/// Total size of a chunk object of `layers` layers and `slice_len`-byte slices.
pub fn object_len(layers: u32, slice_len: u64) -> u64 {
    HEADER_LEN + layers as u64 * (slice_len + SLICE_CRC_LEN)
}

/// Byte range of layer `layer`'s slice **including** its 4-byte CRC trailer, in an object whose
/// slices are `slice_len` bytes. Reading this range verifies itself.
pub fn slice_range(layer: u32, slice_len: u64) -> Range<u64> {
    let start = HEADER_LEN + layer as u64 * (slice_len + SLICE_CRC_LEN);
    start..start + slice_len + SLICE_CRC_LEN
}

/// Byte range covering layers `layers` (consecutive) with their CRC trailers.
pub fn slices_range(layers: Range<u32>, slice_len: u64) -> Range<u64> {
    let a = slice_range(layers.start, slice_len).start;
    let b = slice_range(layers.end - 1, slice_len).end;
    a..b
}

/// CRC32C (Castagnoli) of `data`, as stored after each slice.
pub fn slice_crc(data: &[u8]) -> u32 {
    super::crc::crc32c(data)
}

/// Verifies a slice read with its trailer (`slice_len + 4` bytes) against its stored CRC.
///
/// # Errors
/// [`FormatError::Truncated`] if `with_crc` is not `slice_len + 4` bytes;
/// [`FormatError::SliceChecksum`] on mismatch.
pub fn verify_slice(layer: usize, with_crc: &[u8], slice_len: u64) -> Result<(), FormatError> {
    if with_crc.len() as u64 != slice_len + SLICE_CRC_LEN {
        return Err(FormatError::Truncated {
            got: with_crc.len() as u64,
            expected: slice_len + SLICE_CRC_LEN,
        });
    }
    let (data, crc) = with_crc.split_at(slice_len as usize);
    let stored = u32::from_le_bytes(crc.try_into().expect("4"));
    let computed = slice_crc(data);
    if stored != computed {
        return Err(FormatError::SliceChecksum {
            layer,
            stored,
            computed,
        });
    }
    Ok(())
}

/// Encodes a whole chunk object from per-layer K+V bytes.
///
/// `layer_data(l)` must return exactly `tokens x bytes_per_token_per_layer` bytes for layer `l`
/// (K of all tokens, then V of all tokens; or the engine's blocks when the geometry names a
/// [`crate::layout::KvLayout`]).
///
/// # Errors
/// [`FormatError::WrongSize`] naming the layer whose data has the wrong length, or
/// [`FormatError::InvalidField`] if `tokens` is 0 or above `tokens_per_chunk`.
pub fn encode_chunk<'a>(
    g: &KvGeometry,
    tokens: u32,
    mut layer_data: impl FnMut(u32) -> &'a [u8],
) -> Result<Vec<u8>, FormatError> {
    encode_chunk_parts(g, tokens, |l| vec![layer_data(l)])
}

/// As [`encode_chunk`], with each layer's slice given as parts whose concatenation is the
/// slice (paged KV: one part per engine block, or per piece of one).
///
/// # Errors
/// As [`encode_chunk`]; the parts' total length is what must match.
pub fn encode_chunk_parts<'a>(
    g: &KvGeometry,
    tokens: u32,
    mut layer_parts: impl FnMut(u32) -> Vec<&'a [u8]>,
) -> Result<Vec<u8>, FormatError> {
    if tokens == 0 || tokens > g.tokens_per_chunk {
        return Err(FormatError::InvalidField(format!(
            "a chunk holds 1..={} tokens, got {tokens}",
            g.tokens_per_chunk
        )));
    }
    let h = ChunkHeader::for_geometry(g, tokens);
    let mut out = Vec::with_capacity(h.object_len() as usize);
    out.extend_from_slice(&h.encode());
    for l in 0..g.layers {
        let parts = layer_parts(l);
        let n: usize = parts.iter().map(|p| p.len()).sum();
        if n as u64 != h.slice_len {
            return Err(FormatError::WrongSize(format!(
                "layer {l} has {n} bytes, expected {} ({} tokens x {} bytes/token/layer)",
                h.slice_len, tokens, h.bytes_per_token_per_layer
            )));
        }
        let mut crc = 0u32;
        for p in parts {
            out.extend_from_slice(p);
            crc = super::crc::crc32c_append(crc, p);
        }
        out.extend_from_slice(&crc.to_le_bytes());
    }
    Ok(out)
}

/// Decodes and fully verifies a whole chunk object, returning its header and per-layer slices
/// (borrowed, CRC excluded).
///
/// # Errors
/// Any [`FormatError`]: truncation, bad header, geometry mismatch, slice checksum.
pub fn decode_chunk<'a>(
    g: &KvGeometry,
    tokens: u32,
    obj: &'a [u8],
) -> Result<(ChunkHeader, Vec<&'a [u8]>), FormatError> {
    let h = ChunkHeader::decode(obj)?;
    h.check(g, tokens)?;
    let need = h.object_len();
    if obj.len() as u64 != need {
        return Err(FormatError::Truncated {
            got: obj.len() as u64,
            expected: need,
        });
    }
    let mut slices = Vec::with_capacity(h.layers as usize);
    for l in 0..h.layers {
        let r = slice_range(l, h.slice_len);
        let s = &obj[r.start as usize..r.end as usize];
        verify_slice(l as usize, s, h.slice_len)?;
        slices.push(&s[..h.slice_len as usize]);
    }
    Ok((h, slices))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> KvGeometry {
        let mut g = KvGeometry::new("test/tiny", 3, 2, 2, Dtype::Fp16).unwrap();
        g.tokens_per_chunk = 4;
        g
    }

    #[test]
    fn round_trip_and_offsets() {
        let g = tiny();
        let slice = g.slice_bytes() as usize; // 4 tokens x (2 x 2 heads x 2 dims x 2 bytes) = 64
        assert_eq!(slice, 64);
        let data: Vec<Vec<u8>> = (0..3).map(|l| vec![l as u8 + 1; slice]).collect();
        let obj = encode_chunk(&g, 4, |l| &data[l as usize]).unwrap();
        assert_eq!(obj.len() as u64, 64 + 3 * (64 + 4));
        assert_eq!(slice_range(1, 64), 132..200);
        let (h, s) = decode_chunk(&g, 4, &obj).unwrap();
        assert_eq!(h.tokens, 4);
        assert_eq!(s[2], &data[2][..]);
    }

    #[test]
    fn corruption_and_mismatch_are_detected() {
        let g = tiny();
        let data = vec![7u8; 64];
        let mut obj = encode_chunk(&g, 4, |_| &data).unwrap();
        obj[64 + 68 + 5] ^= 1;
        assert!(matches!(
            decode_chunk(&g, 4, &obj),
            Err(FormatError::SliceChecksum { layer: 1, .. })
        ));
        let other = g.with_dtype(Dtype::Bf16);
        let obj = encode_chunk(&g, 4, |_| &data).unwrap();
        assert!(matches!(
            decode_chunk(&other, 4, &obj),
            Err(FormatError::GeometryMismatch(_))
        ));
        let mut bad = obj.clone();
        bad[20] ^= 1;
        assert_eq!(ChunkHeader::decode(&bad), Err(FormatError::HeaderChecksum));
        assert!(matches!(
            decode_chunk(&g, 4, &obj[..100]),
            Err(FormatError::Truncated { .. })
        ));
        assert!(matches!(
            encode_chunk(&g, 4, |_| &data[..10]),
            Err(FormatError::WrongSize(_))
        ));
    }
}
