//! Gather and save request descriptors, their codecs, and the pure delivery-unit planner.

use super::wire::{put_str16, Reader};
use super::{
    ProtocolError, MAX_BYTES_PER_TOKEN_PER_LAYER, MAX_CHUNKS_HARD, MAX_SLICES_PER_REQUEST,
    MAX_TOKENS_PER_CHUNK, MAX_UNITS_PER_REQUEST, MAX_UNIT_BYTES, MIN_UNIT_BYTES,
};
use crate::layout::{ChunkHash, ChunkHeader, KeyBuilder, KvGeometry};
use bytes::BufMut;
use std::ops::Range;

/// Longest bucket name (S3's limit).
const MAX_BUCKET_LEN: usize = 63;
/// Longest object key (S3's limit).
const MAX_KEY_LEN: usize = 1024;

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
        if h.dtype.code() != self.dtype {
            return Err(format!(
                "dtype code {}, expected {}",
                h.dtype.code(),
                self.dtype
            ));
        }
        if h.tp_rank != self.tp_rank || h.tp_world != self.tp_world {
            return Err(format!(
                "TP {}/{}, expected {}/{}",
                h.tp_rank, h.tp_world, self.tp_rank, self.tp_world
            ));
        }
        if h.tokens != tokens {
            return Err(format!("{} tokens, expected {}", h.tokens, tokens));
        }
        Ok(())
    }
    fn validate(&self) -> Result<(), ProtocolError> {
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
    fn encode(&self, out: &mut impl BufMut) {
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
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtocolError> {
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

/// How a request names its chunk objects, in prefix order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkKeys {
    /// Full object keys, one per chunk.
    Explicit(Vec<String>),
    /// A [`KeyBuilder::prefix`] and chunk hashes: chunk `i`'s key is
    /// `{prefix}kv/{hex(hash_i)}`, exactly [`KeyBuilder::data`]. All hashes have one length.
    Hashed {
        /// The key builder's prefix (ends with `/`).
        prefix: String,
        /// Chunk hashes in prefix order.
        hashes: Vec<ChunkHash>,
    },
}

impl ChunkKeys {
    /// Number of chunks named.
    pub fn len(&self) -> usize {
        match self {
            ChunkKeys::Explicit(k) => k.len(),
            ChunkKeys::Hashed { hashes, .. } => hashes.len(),
        }
    }
    /// `true` if no chunk is named.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Object key of chunk `i` (`None` past the end).
    pub fn key(&self, i: usize) -> Option<String> {
        match self {
            ChunkKeys::Explicit(k) => k.get(i).cloned(),
            ChunkKeys::Hashed { prefix, hashes } => {
                hashes.get(i).map(|h| format!("{prefix}kv/{}", h.to_hex()))
            }
        }
    }
    /// From a key builder and hashes (the connector's layout).
    pub fn from_builder(kb: &KeyBuilder, hashes: Vec<ChunkHash>) -> Self {
        ChunkKeys::Hashed {
            prefix: kb.prefix().to_string(),
            hashes,
        }
    }
}

/// The order in which units are delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeliveryOrder {
    /// Layer 0 of every chunk, then layer 1, ...; within a layer, chunks in prefix order.
    #[default]
    LayerMajor,
}

/// Scheduling hints for the server's scheduler (all times in microseconds).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SchedHints {
    /// No hint: FIFO within a priority.
    #[default]
    None,
    /// Deadline of each requested layer, in microseconds after the server receives the
    /// request (one value per layer of the requested range).
    LayerDeadlinesUs(Vec<u32>),
    /// The engine's compute time per layer in microseconds (one value per layer of the range);
    /// the server derives deadlines from it.
    LayerComputeUs(Vec<u32>),
}

/// One segment of a layer's RDMA destination: remote memory the server writes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaRegion {
    /// Remote virtual address.
    pub addr: u64,
    /// Remote key of the memory region it lies in.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

/// An RDMA destination: the RDMA session whose queue pairs carry the writes, the load slot
/// that tells concurrent loads on that session apart, and each requested layer's
/// destination as a list of segments.
///
/// The session is set up once per client and server (QP numbers, GIDs and PSNs exchanged on
/// the server's gather port behind the `OCRDMA01` preface, see `docs/rdma.md`); the server
/// names it with a 64-bit token the client echoes here. Each unit is written with
/// `RDMA_WRITE_WITH_IMM` whose 32-bit immediate is `slot:6 | layer:10 | unit:16`, `unit`
/// being the unit's index within its layer in [`plan_units`] order.
///
/// A layer's segments, taken in order, are one logical buffer (unit offsets are offsets in
/// it): one segment for a contiguous destination; several for paged KV (an engine's blocks
/// scattered through its registered KV buffer). A unit that spans segments is written as one
/// `RDMA_WRITE` per segment piece but the last, then `RDMA_WRITE_WITH_IMM` of the last piece,
/// all on one RC queue pair from one staging slot, so the immediate's completion at the
/// client comes after every piece has landed (RC executes a QP's requests in order)
/// ([`RdmaTarget::pieces`]). With one segment per layer the target is encoded as kind 2
/// (every RDMA server reads it); otherwise as kind 3, which only a server announcing
/// [`super::ServerInfo::FEATURE_RDMA_SCATTER`] accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaTarget {
    /// Session token from the RDMA set-up exchange.
    pub session: u64,
    /// Load slot on that session, `0..64`.
    pub slot: u8,
    /// Destination of each requested layer, in layer order (`layers.start` first): its
    /// segments, in order.
    pub layers: Vec<Vec<RdmaRegion>>,
}

/// Most segments an RDMA target may name over all its layers (a descriptor is at most
/// 1 MiB anyway: 20 bytes per segment).
pub const RDMA_MAX_SEGMENTS: u32 = 1 << 16;

impl RdmaTarget {
    /// A target with one segment per layer (a contiguous destination per layer).
    pub fn contiguous(session: u64, slot: u8, regions: Vec<RdmaRegion>) -> Self {
        RdmaTarget {
            session,
            slot,
            layers: regions.into_iter().map(|r| vec![r]).collect(),
        }
    }

    /// Whether every layer is one segment (wire kind 2).
    pub fn is_contiguous(&self) -> bool {
        self.layers.iter().all(|l| l.len() == 1)
    }

    /// The remote pieces that hold logical bytes `offset..offset+len` of the `i`-th requested
    /// layer, in order; `None` if they run past its segments. Both ends use this to cut a
    /// unit: the server writes one piece per `RDMA_WRITE`, the client expects the immediate
    /// with the last piece's length.
    pub fn pieces(&self, i: usize, offset: u64, len: u64) -> Option<Vec<RdmaRegion>> {
        rdma_pieces(self.layers.get(i)?, offset, len)
    }
}

/// The pieces of `segments` (taken in order as one buffer) that hold bytes
/// `offset..offset+len`; `None` if they run past the segments' end. Empty for `len == 0`.
/// Linear in the segments; [`RdmaSegments`] cuts many units in logarithmic time each.
pub fn rdma_pieces(segments: &[RdmaRegion], offset: u64, len: u64) -> Option<Vec<RdmaRegion>> {
    RdmaSegments::new(segments.to_vec())?.pieces(offset, len)
}

/// One layer's RDMA segments with their logical start offsets, for cutting units into
/// pieces by binary search (a server cuts every unit of a request: units x log(segments)).
#[derive(Debug, Clone)]
pub struct RdmaSegments {
    segs: Vec<RdmaRegion>,
    /// `starts[i]` = logical offset of `segs[i]`; one more entry: the total length.
    starts: Vec<u64>,
}

impl RdmaSegments {
    /// Indexes `segs`; `None` if their lengths overflow `u64`.
    pub fn new(segs: Vec<RdmaRegion>) -> Option<Self> {
        let mut starts = Vec::with_capacity(segs.len() + 1);
        let mut at = 0u64;
        starts.push(0);
        for s in &segs {
            at = at.checked_add(s.len)?;
            starts.push(at);
        }
        Some(RdmaSegments { segs, starts })
    }

    /// As [`rdma_pieces`].
    pub fn pieces(&self, offset: u64, len: u64) -> Option<Vec<RdmaRegion>> {
        let end = offset.checked_add(len)?;
        if end > *self.starts.last().expect("starts has a total") {
            return None;
        }
        let mut out = Vec::new();
        if len == 0 {
            return Some(out);
        }
        // The segment holding `offset`: the last whose start is at or before it (skipping
        // empty segments, which start where the next one does).
        let mut i = self.starts.partition_point(|&s| s <= offset) - 1;
        let mut at = offset;
        while at < end {
            let s = self.segs.get(i)?;
            let (a, b) = (self.starts[i], self.starts[i + 1]);
            let to = end.min(b);
            if to > at {
                out.push(RdmaRegion {
                    addr: s.addr.checked_add(at - a)?,
                    rkey: s.rkey,
                    len: to - at,
                });
                at = to;
            }
            i += 1;
        }
        Some(out)
    }
}

/// Largest RDMA load slot plus one (the immediate's 6-bit slot field).
pub const RDMA_SLOTS: u8 = 64;
/// Most units per layer an RDMA target can name (the immediate's 16-bit unit field).
pub const RDMA_MAX_UNITS_PER_LAYER: u64 = 1 << 16;
/// Most layers an RDMA target can name (the immediate's 10-bit layer field).
pub const RDMA_MAX_LAYERS: u32 = 1 << 10;

/// Where units go.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TransportTarget {
    /// Units follow inline on the same TCP stream.
    #[default]
    InlineTcp,
    /// RDMA WRITEs into per-layer destinations (one or more segments per layer of the
    /// range); the TCP stream then carries only control frames (accept, misses, end). A
    /// server without RDMA refuses it.
    Rdma(RdmaTarget),
}

/// A gather request: one per load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherRequest {
    /// Client-chosen id echoed in replies.
    pub request_id: u64,
    /// Bucket holding the chunk objects.
    pub bucket: String,
    /// Chunk objects in prefix order.
    pub chunks: ChunkKeys,
    /// Tokens in each chunk (same length as `chunks`; each `1..=tokens_per_chunk`).
    pub chunk_tokens: Vec<u32>,
    /// Geometry of every object.
    pub geometry: WireGeometry,
    /// Layers to deliver (`start..end`), in order.
    pub layers: Range<u32>,
    /// Delivery order.
    pub order: DeliveryOrder,
    /// Largest unit payload in bytes, `MIN_UNIT_BYTES..=MAX_UNIT_BYTES` (16 MiB).
    pub max_unit_bytes: u32,
    /// Ask the server to verify each slice's stored CRC32C before sending it (otherwise it
    /// passes the stored CRCs through, combined into the unit CRC, and the client's check of
    /// the unit CRC still catches storage corruption).
    pub verify: bool,
    /// Priority, higher first (0..=255; default 128).
    pub priority: u8,
    /// Scheduling hints.
    pub hints: SchedHints,
    /// Transport target.
    pub target: TransportTarget,
    /// The load this request is one stripe of, when the client stripes a load over several
    /// connections (descriptor flag bit 2; only sent to a server announcing
    /// [`crate::protocol::ServerInfo::FEATURE_LOAD_GROUPS`]). `None`: the request is a load
    /// of its own.
    pub group: Option<LoadGroup>,
    /// Ask the server for `Held` frames while it holds this request on purpose (admission
    /// queue, bandwidth pacing), at least every [`crate::protocol::HELD_EVERY_MS`] ms of
    /// holding, so a client's stall watchdog tells a paused load from a stalled one
    /// (descriptor flag bit 3; only to a server announcing
    /// [`crate::protocol::ServerInfo::FEATURE_HELD`]).
    pub held: bool,
}

/// Names the load a request is one stripe of (`docs/protocol.md`, "Striped loads"): every
/// stripe of one load carries the same load id, stripe count and whole-load layer size, so
/// the server admits the load once, registers it once with its link scheduler, and sends
/// the stripes' units in the whole load's layer-major order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadGroup {
    /// Client-chosen id shared by the stripes of one load (unique per client and load; the
    /// connector draws a random base per engine and adds its request counter).
    pub load_id: u64,
    /// This request's stripe, `0..stripes`.
    pub stripe: u16,
    /// Stripes of the load, `1..=`[`MAX_STRIPES`].
    pub stripes: u16,
    /// Payload bytes of each requested layer of the whole load (every stripe's part of the
    /// layer together), at least this request's own [`GatherRequest::layer_bytes`].
    pub load_layer_bytes: u64,
}

/// Most stripes one load may be split into.
pub const MAX_STRIPES: u16 = 64;

const FLAG_VERIFY: u16 = 1;
const FLAG_HASHED: u16 = 2;
const FLAG_GROUP: u16 = 4;
const FLAG_HELD: u16 = 8;

impl GatherRequest {
    /// A layer-major request for all layers of `g`, keys from `kb` and `hashes`, 16 MiB units,
    /// no hints, inline TCP, server-side verification on.
    pub fn for_prefix(
        request_id: u64,
        bucket: &str,
        kb: &KeyBuilder,
        g: &KvGeometry,
        hashes: Vec<ChunkHash>,
        chunk_tokens: Vec<u32>,
    ) -> Self {
        GatherRequest {
            request_id,
            bucket: bucket.to_string(),
            chunks: ChunkKeys::from_builder(kb, hashes),
            chunk_tokens,
            geometry: WireGeometry::from_geometry(g),
            layers: 0..g.layers,
            order: DeliveryOrder::LayerMajor,
            max_unit_bytes: MAX_UNIT_BYTES,
            verify: true,
            priority: 128,
            hints: SchedHints::None,
            target: TransportTarget::InlineTcp,
            group: None,
            held: false,
        }
    }

    /// Bytes of layer `layer`'s destination: the sum of every chunk's slice length.
    pub fn layer_bytes(&self) -> u64 {
        self.chunk_tokens
            .iter()
            .map(|&t| self.geometry.slice_len(t))
            .sum()
    }

    /// An upper bound on the units [`plan_units`] makes per layer: one per `max_unit_bytes`
    /// of the layer plus one per chunk (a unit boundary per slice at most).
    pub fn max_units_per_layer(&self) -> u64 {
        self.layer_bytes()
            .div_ceil(self.max_unit_bytes.max(1) as u64)
            + self.chunk_tokens.len() as u64
    }

    /// Checks every field against the protocol's hard limits and `max_chunks`, including the
    /// planner's cost ([`crate::protocol::MAX_SLICES_PER_REQUEST`],
    /// [`crate::protocol::MAX_UNITS_PER_REQUEST`]), so that a validated request plans in
    /// bounded memory and time.
    ///
    /// # Errors
    /// [`ProtocolError::Invalid`] or [`ProtocolError::TooLarge`] naming the field.
    pub fn validate(&self, max_chunks: u32) -> Result<(), ProtocolError> {
        validate_bucket(&self.bucket)?;
        self.geometry.validate()?;
        let n = self.chunks.len();
        if n == 0 {
            return Err(ProtocolError::invalid(
                "chunks",
                "a request names at least one chunk",
            ));
        }
        let max = max_chunks.min(MAX_CHUNKS_HARD);
        if n as u64 > max as u64 {
            return Err(ProtocolError::TooLarge {
                what: "chunks per request",
                got: n as u64,
                max: max as u64,
            });
        }
        if self.chunk_tokens.len() != n {
            return Err(ProtocolError::invalid(
                "chunk_tokens",
                format!("{} token counts for {} chunks", self.chunk_tokens.len(), n),
            ));
        }
        for (i, &t) in self.chunk_tokens.iter().enumerate() {
            if t == 0 || t > self.geometry.tokens_per_chunk {
                return Err(ProtocolError::invalid(
                    "chunk_tokens",
                    format!(
                        "chunk {i} holds {t} tokens (allowed 1..={})",
                        self.geometry.tokens_per_chunk
                    ),
                ));
            }
        }
        match &self.chunks {
            ChunkKeys::Explicit(keys) => {
                for k in keys {
                    if k.is_empty() || k.len() > MAX_KEY_LEN {
                        return Err(ProtocolError::invalid(
                            "key",
                            format!("{} bytes (allowed 1..=1024)", k.len()),
                        ));
                    }
                }
            }
            ChunkKeys::Hashed { prefix, hashes } => {
                if prefix.len() + 3 + 128 > MAX_KEY_LEN {
                    return Err(ProtocolError::invalid(
                        "key prefix",
                        format!("{} bytes is too long", prefix.len()),
                    ));
                }
                let hl = hashes[0].as_bytes().len();
                if hashes.iter().any(|h| h.as_bytes().len() != hl) {
                    return Err(ProtocolError::invalid(
                        "hashes",
                        "all chunk hashes of a request have one length",
                    ));
                }
            }
        }
        if self.layers.start >= self.layers.end || self.layers.end > self.geometry.layers {
            return Err(ProtocolError::invalid(
                "layers",
                format!(
                    "{}..{} is not a non-empty range within 0..{}",
                    self.layers.start, self.layers.end, self.geometry.layers
                ),
            ));
        }
        if !(MIN_UNIT_BYTES..=MAX_UNIT_BYTES).contains(&self.max_unit_bytes) {
            return Err(ProtocolError::invalid(
                "max_unit_bytes",
                format!(
                    "{} (allowed {MIN_UNIT_BYTES}..={MAX_UNIT_BYTES})",
                    self.max_unit_bytes
                ),
            ));
        }
        let nl = (self.layers.end - self.layers.start) as usize;
        // Planning cost, bounded before anything is planned or allocated.
        let slices = nl as u64 * n as u64;
        if slices > MAX_SLICES_PER_REQUEST {
            return Err(ProtocolError::TooLarge {
                what: "slices per request (layers x chunks)",
                got: slices,
                max: MAX_SLICES_PER_REQUEST,
            });
        }
        let units = nl as u64 * self.max_units_per_layer();
        if units > MAX_UNITS_PER_REQUEST {
            return Err(ProtocolError::TooLarge {
                what: "delivery units per request",
                got: units,
                max: MAX_UNITS_PER_REQUEST,
            });
        }
        match &self.hints {
            SchedHints::None => {}
            SchedHints::LayerDeadlinesUs(v) | SchedHints::LayerComputeUs(v) => {
                if v.len() != nl {
                    return Err(ProtocolError::invalid(
                        "hints",
                        format!("{} values for {nl} layers", v.len()),
                    ));
                }
            }
        }
        if let Some(gr) = &self.group {
            if gr.stripes == 0 || gr.stripes > MAX_STRIPES || gr.stripe >= gr.stripes {
                return Err(ProtocolError::invalid(
                    "load group",
                    format!(
                        "stripe {} of {} (allowed: stripe < stripes, 1..={MAX_STRIPES} stripes)",
                        gr.stripe, gr.stripes
                    ),
                ));
            }
            let own = self.layer_bytes();
            // No stripe of the load is larger than the largest request the server accepts.
            let most = gr.stripes as u64
                * MAX_CHUNKS_HARD as u64
                * self.geometry.slice_len(self.geometry.tokens_per_chunk);
            if gr.load_layer_bytes < own || gr.load_layer_bytes > most {
                return Err(ProtocolError::invalid(
                    "load group",
                    format!(
                        "the load's layer is {} bytes; this stripe's is {own} and {} stripes hold at most {most}",
                        gr.load_layer_bytes, gr.stripes
                    ),
                ));
            }
        }
        if let TransportTarget::Rdma(t) = &self.target {
            if t.slot >= RDMA_SLOTS {
                return Err(ProtocolError::invalid(
                    "rdma target",
                    format!("slot {} (allowed 0..{RDMA_SLOTS})", t.slot),
                ));
            }
            if self.layers.end > RDMA_MAX_LAYERS {
                return Err(ProtocolError::invalid(
                    "rdma target",
                    format!(
                        "layer {} is past the immediate's {RDMA_MAX_LAYERS} layers",
                        self.layers.end - 1
                    ),
                ));
            }
            let per_layer = self.max_units_per_layer();
            if per_layer > RDMA_MAX_UNITS_PER_LAYER {
                return Err(ProtocolError::invalid(
                    "rdma target",
                    format!("up to {per_layer} units per layer, the immediate names {RDMA_MAX_UNITS_PER_LAYER}"),
                ));
            }
            if t.layers.len() != nl {
                return Err(ProtocolError::invalid(
                    "rdma target",
                    format!("{} destinations for {nl} layers", t.layers.len()),
                ));
            }
            let total: usize = t.layers.iter().map(|l| l.len()).sum();
            if total > RDMA_MAX_SEGMENTS as usize {
                return Err(ProtocolError::TooLarge {
                    what: "rdma segments",
                    got: total as u64,
                    max: RDMA_MAX_SEGMENTS as u64,
                });
            }
            let need = self.layer_bytes();
            for (i, segs) in t.layers.iter().enumerate() {
                if segs.is_empty() || segs.iter().any(|s| s.len == 0) {
                    return Err(ProtocolError::invalid(
                        "rdma target",
                        format!("layer {i} has no segments or an empty one"),
                    ));
                }
                let have = segs
                    .iter()
                    .try_fold(0u64, |a, s| a.checked_add(s.len))
                    .unwrap_or(u64::MAX);
                if have < need {
                    return Err(ProtocolError::invalid(
                        "rdma target",
                        format!("region {i} has {have} bytes, layer needs {need}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Encodes the descriptor body (without the frame header); see `docs/protocol.md`.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_u64_le(self.request_id);
        out.put_u8(self.priority);
        out.put_u8(match self.order {
            DeliveryOrder::LayerMajor => 1,
        });
        let mut flags = 0;
        if self.verify {
            flags |= FLAG_VERIFY;
        }
        if matches!(self.chunks, ChunkKeys::Hashed { .. }) {
            flags |= FLAG_HASHED;
        }
        if self.group.is_some() {
            flags |= FLAG_GROUP;
        }
        if self.held {
            flags |= FLAG_HELD;
        }
        out.put_u16_le(flags);
        out.put_u32_le(self.max_unit_bytes);
        self.geometry.encode(out);
        out.put_u32_le(self.layers.start);
        out.put_u32_le(self.layers.end);
        put_str16(out, &self.bucket);
        out.put_u32_le(self.chunk_tokens.len() as u32);
        for &t in &self.chunk_tokens {
            out.put_u32_le(t);
        }
        match &self.chunks {
            ChunkKeys::Explicit(keys) => {
                out.put_u32_le(keys.len() as u32);
                for k in keys {
                    put_str16(out, k);
                }
            }
            ChunkKeys::Hashed { prefix, hashes } => {
                put_str16(out, prefix);
                out.put_u8(hashes.first().map_or(0, |h| h.as_bytes().len() as u8));
                out.put_u32_le(hashes.len() as u32);
                for h in hashes {
                    out.put_slice(h.as_bytes());
                }
            }
        }
        let (kind, vals): (u8, &[u32]) = match &self.hints {
            SchedHints::None => (0, &[]),
            SchedHints::LayerDeadlinesUs(v) => (1, v),
            SchedHints::LayerComputeUs(v) => (2, v),
        };
        out.put_u8(kind);
        out.put_u32_le(vals.len() as u32);
        vals.iter().for_each(|&v| out.put_u32_le(v));
        match &self.target {
            TransportTarget::InlineTcp => {
                out.put_u8(1);
                out.put_u32_le(0);
            }
            TransportTarget::Rdma(t) => {
                fn put(out: &mut impl BufMut, r: &RdmaRegion) {
                    out.put_u64_le(r.addr);
                    out.put_u32_le(r.rkey);
                    out.put_u64_le(r.len);
                }
                if t.is_contiguous() {
                    out.put_u8(2);
                    out.put_u32_le(t.layers.len() as u32);
                    for l in &t.layers {
                        put(out, &l[0]);
                    }
                } else {
                    out.put_u8(3);
                    out.put_u32_le(t.layers.len() as u32);
                    for l in &t.layers {
                        out.put_u32_le(l.len() as u32);
                        for r in l {
                            put(out, r);
                        }
                    }
                }
                out.put_u64_le(t.session);
                out.put_u8(t.slot);
            }
        }
        if let Some(gr) = &self.group {
            out.put_u64_le(gr.load_id);
            out.put_u16_le(gr.stripe);
            out.put_u16_le(gr.stripes);
            out.put_u64_le(gr.load_layer_bytes);
        }
    }

    /// Decodes a descriptor body and validates it against `max_chunks`.
    ///
    /// # Errors
    /// [`ProtocolError`] naming the first bad field; counts are bounded before allocating.
    pub fn decode(body: &[u8], max_chunks: u32) -> Result<Self, ProtocolError> {
        let max_chunks = max_chunks.min(MAX_CHUNKS_HARD);
        let mut r = Reader::new(body, "gather descriptor");
        let request_id = r.u64()?;
        let priority = r.u8()?;
        let order = match r.u8()? {
            1 => DeliveryOrder::LayerMajor,
            o => {
                return Err(ProtocolError::invalid(
                    "order",
                    format!("unknown delivery order {o}"),
                ))
            }
        };
        let flags = r.u16()?;
        if flags & !(FLAG_VERIFY | FLAG_HASHED | FLAG_GROUP | FLAG_HELD) != 0 {
            return Err(ProtocolError::invalid(
                "flags",
                format!("unknown flag bits 0x{flags:04x}"),
            ));
        }
        let max_unit_bytes = r.u32()?;
        let geometry = WireGeometry::decode(&mut r)?;
        let layers = r.u32()?..r.u32()?;
        let bucket = r.str16("bucket", MAX_BUCKET_LEN)?;
        let n = r.count("chunks per request", max_chunks, 4)?;
        let chunk_tokens = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
        let chunks = if flags & FLAG_HASHED != 0 {
            let prefix = r.str16("key prefix", MAX_KEY_LEN)?;
            let hl = r.u8()? as usize;
            if hl == 0 || hl > 64 {
                return Err(ProtocolError::invalid(
                    "hash length",
                    format!("{hl} (allowed 1..=64)"),
                ));
            }
            let m = r.count("chunks per request", max_chunks, hl)?;
            let hashes = (0..m)
                .map(|_| Ok(ChunkHash::new(r.take(hl)?).expect("length checked")))
                .collect::<Result<Vec<_>, ProtocolError>>()?;
            ChunkKeys::Hashed { prefix, hashes }
        } else {
            let m = r.count("chunks per request", max_chunks, 2)?;
            ChunkKeys::Explicit(
                (0..m)
                    .map(|_| r.str16("key", MAX_KEY_LEN))
                    .collect::<Result<_, _>>()?,
            )
        };
        let kind = r.u8()?;
        let nv = r.count("hint values", 4096, 4)?;
        let vals = (0..nv).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
        let hints = match kind {
            0 if nv == 0 => SchedHints::None,
            1 => SchedHints::LayerDeadlinesUs(vals),
            2 => SchedHints::LayerComputeUs(vals),
            k => {
                return Err(ProtocolError::invalid(
                    "hints",
                    format!("kind {k} with {nv} values"),
                ))
            }
        };
        let tkind = r.u8()?;
        let region = |r: &mut Reader<'_>| -> Result<RdmaRegion, ProtocolError> {
            Ok(RdmaRegion {
                addr: r.u64()?,
                rkey: r.u32()?,
                len: r.u64()?,
            })
        };
        let target = match tkind {
            1 => match r.count("rdma regions", 4096, 20)? {
                0 => TransportTarget::InlineTcp,
                nr => {
                    return Err(ProtocolError::invalid(
                        "transport target",
                        format!("kind 1 with {nr} regions"),
                    ))
                }
            },
            2 => {
                let nr = r.count("rdma regions", 4096, 20)?;
                let regions = (0..nr)
                    .map(|_| region(&mut r))
                    .collect::<Result<_, ProtocolError>>()?;
                let session = r.u64()?;
                TransportTarget::Rdma(RdmaTarget::contiguous(session, r.u8()?, regions))
            }
            3 => {
                let nl = r.count("rdma layers", RDMA_MAX_LAYERS, 4)?;
                let mut left = RDMA_MAX_SEGMENTS;
                let mut layers = Vec::with_capacity(nl);
                for _ in 0..nl {
                    let n = r.count("rdma segments", left, 20)?;
                    left -= n as u32;
                    layers.push(
                        (0..n)
                            .map(|_| region(&mut r))
                            .collect::<Result<Vec<_>, ProtocolError>>()?,
                    );
                }
                let session = r.u64()?;
                TransportTarget::Rdma(RdmaTarget {
                    session,
                    slot: r.u8()?,
                    layers,
                })
            }
            k => {
                return Err(ProtocolError::invalid(
                    "transport target",
                    format!("unknown kind {k}"),
                ))
            }
        };
        let group = if flags & FLAG_GROUP != 0 {
            Some(LoadGroup {
                load_id: r.u64()?,
                stripe: r.u16()?,
                stripes: r.u16()?,
                load_layer_bytes: r.u64()?,
            })
        } else {
            None
        };
        r.finish()?;
        let req = GatherRequest {
            request_id,
            bucket,
            chunks,
            chunk_tokens,
            geometry,
            layers,
            order,
            max_unit_bytes,
            verify: flags & FLAG_VERIFY != 0,
            priority,
            hints,
            target,
            group,
            held: flags & FLAG_HELD != 0,
        };
        req.validate(max_chunks)?;
        Ok(req)
    }
}

fn validate_bucket(b: &str) -> Result<(), ProtocolError> {
    let ok = (3..=MAX_BUCKET_LEN).contains(&b.len())
        && b.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'.' || c == b'-')
        && b.as_bytes()[0].is_ascii_alphanumeric();
    if !ok {
        return Err(ProtocolError::invalid(
            "bucket",
            format!("{b:?} is not an S3 bucket name (3..=63 of a-z 0-9 . -, starting with a letter or digit)"),
        ));
    }
    Ok(())
}

/// One chunk of a batched save.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveChunk {
    /// The chunk's hash (its keys are [`KeyBuilder::data`] and [`KeyBuilder::marker`]).
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
