//! [`WireGeometry`]: the geometry fields a server needs to locate and check slices, their
//! checks and their 28-byte wire form.

use crate::layout::{ChunkHeader, KvGeometry, SegmentHeader};
use crate::protocol::wire::Reader;
use crate::protocol::{ProtocolError, MAX_BYTES_PER_TOKEN_PER_LAYER, MAX_TOKENS_PER_CHUNK};
use bytes::BufMut;

/// The geometry fields a server needs to locate and check slices (a subset of
/// [`KvGeometry`], 28 bytes on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireGeometry {
    /// [`KvGeometry::fingerprint`]; must equal the fingerprint in each object's header.
    pub fingerprint: u64,
    /// Layers per object.
    pub layers: u32,
    /// Bytes per token per layer on this TP rank (K and V).
    pub bytes_per_token_per_layer: u32,
    /// Tokens of a full chunk.
    pub tokens_per_chunk: u32,
    /// Dtype code (see `docs/object-format.md`).
    pub dtype: u8,
    /// TP rank.
    pub tp_rank: u16,
    /// TP world size.
    pub tp_world: u16,
}

impl WireGeometry {
    /// The wire form of `g`.
    pub fn from_geometry(g: &KvGeometry) -> Self {
        WireGeometry {
            fingerprint: g.fingerprint(),
            layers: g.layers,
            bytes_per_token_per_layer: g.bytes_per_token_per_layer() as u32,
            tokens_per_chunk: g.tokens_per_chunk,
            dtype: g.dtype.code(),
            tp_rank: g.tp_rank as u16,
            tp_world: g.tp_world as u16,
        }
    }
    /// Slice length in bytes (CRC excluded) of a chunk holding `tokens` tokens.
    pub fn slice_len(&self, tokens: u32) -> u64 {
        tokens as u64 * self.bytes_per_token_per_layer as u64
    }
    /// Checks an object header against this geometry and the expected token count.
    ///
    /// # Errors
    /// A message naming the first field that differs.
    pub fn check_header(&self, h: &ChunkHeader, tokens: u32) -> Result<(), String> {
        self.check_fields(&WireGeometry {
            fingerprint: h.fingerprint,
            layers: h.layers,
            bytes_per_token_per_layer: h.bytes_per_token_per_layer,
            tokens_per_chunk: h.tokens,
            dtype: h.dtype.code(),
            tp_rank: h.tp_rank,
            tp_world: h.tp_world,
        })
        .and_then(|()| match h.tokens == tokens {
            true => Ok(()),
            false => Err(format!("{} tokens, expected {tokens}", h.tokens)),
        })
    }

    /// Checks a segment object's header (object format version 2) against this geometry: its
    /// chunks are full chunks of `tokens_per_chunk` tokens.
    ///
    /// # Errors
    /// A message naming the first field that differs.
    pub fn check_segment_header(&self, h: &SegmentHeader) -> Result<(), String> {
        self.check_fields(&WireGeometry {
            fingerprint: h.fingerprint,
            layers: h.layers,
            bytes_per_token_per_layer: h.bytes_per_token_per_layer,
            tokens_per_chunk: h.tokens_per_chunk,
            dtype: h.dtype.code(),
            tp_rank: h.tp_rank,
            tp_world: h.tp_world,
        })
        .and_then(|()| match h.tokens_per_chunk == self.tokens_per_chunk {
            true => Ok(()),
            false => Err(format!(
                "{} tokens per chunk, expected {}",
                h.tokens_per_chunk, self.tokens_per_chunk
            )),
        })
    }

    /// The fields an object's header names, other than its tokens, against this geometry's.
    fn check_fields(&self, h: &WireGeometry) -> Result<(), String> {
        if h.fingerprint != self.fingerprint {
            return Err(format!(
                "fingerprint {:016x}, expected {:016x}",
                h.fingerprint, self.fingerprint
            ));
        }
        if h.layers != self.layers {
            return Err(format!("{} layers, expected {}", h.layers, self.layers));
        }
        if h.bytes_per_token_per_layer != self.bytes_per_token_per_layer {
            return Err(format!(
                "{} bytes per token per layer, expected {}",
                h.bytes_per_token_per_layer, self.bytes_per_token_per_layer
            ));
        }
        if h.dtype != self.dtype {
            return Err(format!("dtype code {}, expected {}", h.dtype, self.dtype));
        }
        if h.tp_rank != self.tp_rank || h.tp_world != self.tp_world {
            return Err(format!(
                "TP {}/{}, expected {}/{}",
                h.tp_rank, h.tp_world, self.tp_rank, self.tp_world
            ));
        }
        Ok(())
    }
    pub(super) fn validate(&self) -> Result<(), ProtocolError> {
        if self.layers == 0 || self.layers > 4096 {
            return Err(ProtocolError::invalid(
                "geometry.layers",
                format!("{} (allowed 1..=4096)", self.layers),
            ));
        }
        if !(1..=MAX_BYTES_PER_TOKEN_PER_LAYER).contains(&self.bytes_per_token_per_layer) {
            return Err(ProtocolError::invalid(
                "geometry.bytes_per_token_per_layer",
                format!(
                    "{} (allowed 1..={MAX_BYTES_PER_TOKEN_PER_LAYER})",
                    self.bytes_per_token_per_layer
                ),
            ));
        }
        if !(1..=MAX_TOKENS_PER_CHUNK).contains(&self.tokens_per_chunk) {
            return Err(ProtocolError::invalid(
                "geometry.tokens_per_chunk",
                format!(
                    "{} (allowed 1..={MAX_TOKENS_PER_CHUNK})",
                    self.tokens_per_chunk
                ),
            ));
        }
        if self.tp_world == 0 || self.tp_rank >= self.tp_world {
            return Err(ProtocolError::invalid(
                "geometry.tp",
                format!("rank {} of world {}", self.tp_rank, self.tp_world),
            ));
        }
        Ok(())
    }
    pub(super) fn encode(&self, out: &mut impl BufMut) {
        out.put_u64_le(self.fingerprint);
        out.put_u32_le(self.layers);
        out.put_u32_le(self.bytes_per_token_per_layer);
        out.put_u32_le(self.tokens_per_chunk);
        out.put_u8(self.dtype);
        out.put_u8(0);
        out.put_u16_le(self.tp_rank);
        out.put_u16_le(self.tp_world);
        out.put_u16_le(0);
    }
    pub(super) fn decode(r: &mut Reader<'_>) -> Result<Self, ProtocolError> {
        let g = WireGeometry {
            fingerprint: r.u64()?,
            layers: r.u32()?,
            bytes_per_token_per_layer: r.u32()?,
            tokens_per_chunk: r.u32()?,
            dtype: r.u8()?,
            tp_rank: {
                r.zero(1, "geometry.reserved")?;
                r.u16()?
            },
            tp_world: r.u16()?,
        };
        r.zero(2, "geometry.reserved")?;
        Ok(g)
    }
}
