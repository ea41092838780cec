//! The batched save request ([`SaveRequest`]: every chunk object of a prefix in one
//! request), its checks and its codec.

use super::{validate_bucket, WireGeometry, MAX_BUCKET_LEN, MAX_KEY_LEN};
use crate::layout::ChunkHash;
use crate::protocol::wire::{put_str16, Reader};
use crate::protocol::{ProtocolError, MAX_CHUNKS_HARD};
use bytes::BufMut;

/// One chunk of a batched save.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveChunk {
    /// The chunk's hash (its keys are [`KeyBuilder::data`] and [`KeyBuilder::marker`]).
    ///
    /// [`KeyBuilder::data`]: crate::layout::KeyBuilder::data
    /// [`KeyBuilder::marker`]: crate::layout::KeyBuilder::marker
    pub hash: ChunkHash,
    /// Tokens it holds.
    pub tokens: u32,
}

/// A batched save: all chunk objects of a prefix in one request. The objects follow in
/// `SaveData` frames, in chunk order; see `docs/protocol.md`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveRequest {
    /// Client-chosen id echoed in replies.
    pub request_id: u64,
    /// Bucket to write into.
    pub bucket: String,
    /// [`KeyBuilder::prefix`]: data at `{prefix}kv/{hex}`, markers at `{prefix}pub/{hex}`.
    ///
    /// [`KeyBuilder::prefix`]: crate::layout::KeyBuilder::prefix
    pub prefix: String,
    /// Geometry every object must have.
    pub geometry: WireGeometry,
    /// Chunks in prefix order.
    pub chunks: Vec<SaveChunk>,
}

impl SaveRequest {
    /// Size in bytes of chunk `i`'s object (header plus every slice with its CRC).
    pub fn object_len(&self, i: usize) -> u64 {
        crate::layout::object_len(
            self.geometry.layers,
            self.geometry.slice_len(self.chunks[i].tokens),
        )
    }
    /// Checks bucket, geometry, counts and token counts.
    ///
    /// # Errors
    /// [`ProtocolError`] naming the field.
    pub fn validate(&self, max_chunks: u32) -> Result<(), ProtocolError> {
        validate_bucket(&self.bucket)?;
        self.geometry.validate()?;
        let max = max_chunks.min(MAX_CHUNKS_HARD);
        if self.chunks.is_empty() {
            return Err(ProtocolError::invalid(
                "chunks",
                "a save names at least one chunk",
            ));
        }
        if self.chunks.len() as u64 > max as u64 {
            return Err(ProtocolError::TooLarge {
                what: "chunks per request",
                got: self.chunks.len() as u64,
                max: max as u64,
            });
        }
        if self.prefix.is_empty()
            || !self.prefix.ends_with('/')
            || self.prefix.len() + 4 + 128 > MAX_KEY_LEN
        {
            return Err(ProtocolError::invalid(
                "key prefix",
                format!(
                    "{:?} must be non-empty, short and end with '/'",
                    self.prefix
                ),
            ));
        }
        for (i, c) in self.chunks.iter().enumerate() {
            if c.tokens == 0 || c.tokens > self.geometry.tokens_per_chunk {
                return Err(ProtocolError::invalid(
                    "chunk tokens",
                    format!("chunk {i} holds {} tokens", c.tokens),
                ));
            }
        }
        Ok(())
    }
    /// Encodes the body of a `SaveBegin` frame.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_u64_le(self.request_id);
        self.geometry.encode(out);
        put_str16(out, &self.bucket);
        put_str16(out, &self.prefix);
        out.put_u32_le(self.chunks.len() as u32);
        for c in &self.chunks {
            out.put_u32_le(c.tokens);
            out.put_u8(c.hash.as_bytes().len() as u8);
            out.put_slice(c.hash.as_bytes());
        }
    }
    /// Decodes and validates a `SaveBegin` body.
    ///
    /// # Errors
    /// [`ProtocolError`] naming the first bad field.
    pub fn decode(body: &[u8], max_chunks: u32) -> Result<Self, ProtocolError> {
        let mut r = Reader::new(body, "save descriptor");
        let request_id = r.u64()?;
        let geometry = WireGeometry::decode(&mut r)?;
        let bucket = r.str16("bucket", MAX_BUCKET_LEN)?;
        let prefix = r.str16("key prefix", MAX_KEY_LEN)?;
        let n = r.count("chunks per request", max_chunks.min(MAX_CHUNKS_HARD), 6)?;
        let mut chunks = Vec::with_capacity(n);
        for _ in 0..n {
            let tokens = r.u32()?;
            let hl = r.u8()? as usize;
            let hash = ChunkHash::new(r.take(hl)?)
                .map_err(|e| ProtocolError::invalid("hash", e.to_string()))?;
            chunks.push(SaveChunk { hash, tokens });
        }
        r.finish()?;
        let s = SaveRequest {
            request_id,
            bucket,
            prefix,
            geometry,
            chunks,
        };
        s.validate(max_chunks)?;
        Ok(s)
    }
}
