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

/// The first field in which a stored object's header differs from the geometry a load
/// expects ([`WireGeometry::check_header`], [`WireGeometry::check_segment_header`]): the
/// object was written for another model, dtype, TP rank or chunk size, and is a miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderMismatch {
    /// Another model or KV layout (`KvGeometry::fingerprint`).
    #[error("fingerprint {found:016x}, expected {expected:016x}")]
    Fingerprint {
        /// The header's.
        found: u64,
        /// The load's.
        expected: u64,
    },
    /// Another number of layers.
    #[error("{found} layers, expected {expected}")]
    Layers {
        /// The header's.
        found: u32,
        /// The load's.
        expected: u32,
    },
    /// Another slice size per token (bytes per token per layer).
    #[error("{found} bytes per token per layer, expected {expected}")]
    BytesPerTokenPerLayer {
        /// The header's.
        found: u32,
        /// The load's.
        expected: u32,
    },
    /// Another dtype (its code, `Dtype::code`).
    #[error("dtype code {found}, expected {expected}")]
    Dtype {
        /// The header's.
        found: u8,
        /// The load's.
        expected: u8,
    },
    /// Another TP rank or TP world size, as `(rank, world)`.
    #[error("TP {}/{}, expected {}/{}", found.0, found.1, expected.0, expected.1)]
    TpRank {
        /// The header's.
        found: (u16, u16),
        /// The load's.
        expected: (u16, u16),
    },
    /// A chunk object holding another number of tokens than the load's chunk.
    #[error("{found} tokens, expected {expected}")]
    Tokens {
        /// The header's.
        found: u32,
        /// The load's.
        expected: u32,
    },
    /// A segment object of chunks of another size (tokens per chunk).
    #[error("{found} tokens per chunk, expected {expected}")]
    TokensPerChunk {
        /// The header's.
        found: u32,
        /// The load's.
        expected: u32,
    },
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
    /// [`HeaderMismatch`] naming the first field that differs.
    pub fn check_header(&self, h: &ChunkHeader, tokens: u32) -> Result<(), HeaderMismatch> {
        self.check_fields(&WireGeometry {
            fingerprint: h.fingerprint,
            layers: h.layers,
            bytes_per_token_per_layer: h.bytes_per_token_per_layer,
            tokens_per_chunk: h.tokens,
            dtype: h.dtype.code(),
            tp_rank: h.tp_rank,
            tp_world: h.tp_world,
        })?;
        match h.tokens == tokens {
            true => Ok(()),
            false => Err(HeaderMismatch::Tokens {
                found: h.tokens,
                expected: tokens,
            }),
        }
    }

    /// Checks a segment object's header (object format version 2) against this geometry: its
    /// chunks are full chunks of `tokens_per_chunk` tokens.
    ///
    /// # Errors
    /// [`HeaderMismatch`] naming the first field that differs.
    pub fn check_segment_header(&self, h: &SegmentHeader) -> Result<(), HeaderMismatch> {
        self.check_fields(&WireGeometry {
            fingerprint: h.fingerprint,
            layers: h.layers,
            bytes_per_token_per_layer: h.bytes_per_token_per_layer,
            tokens_per_chunk: h.tokens_per_chunk,
            dtype: h.dtype.code(),
            tp_rank: h.tp_rank,
            tp_world: h.tp_world,
        })?;
        match h.tokens_per_chunk == self.tokens_per_chunk {
            true => Ok(()),
            false => Err(HeaderMismatch::TokensPerChunk {
                found: h.tokens_per_chunk,
                expected: self.tokens_per_chunk,
            }),
        }
    }

    /// The fields an object's header names, other than its tokens, against this geometry's.
    fn check_fields(&self, h: &WireGeometry) -> Result<(), HeaderMismatch> {
        use HeaderMismatch as M;
        if h.fingerprint != self.fingerprint {
            return Err(M::Fingerprint {
                found: h.fingerprint,
                expected: self.fingerprint,
            });
        }
        if h.layers != self.layers {
            return Err(M::Layers {
                found: h.layers,
                expected: self.layers,
            });
        }
        if h.bytes_per_token_per_layer != self.bytes_per_token_per_layer {
            return Err(M::BytesPerTokenPerLayer {
                found: h.bytes_per_token_per_layer,
                expected: self.bytes_per_token_per_layer,
            });
        }
        if h.dtype != self.dtype {
            return Err(M::Dtype {
                found: h.dtype,
                expected: self.dtype,
            });
        }
        if h.tp_rank != self.tp_rank || h.tp_world != self.tp_world {
            return Err(M::TpRank {
                found: (h.tp_rank, h.tp_world),
                expected: (self.tp_rank, self.tp_world),
            });
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
