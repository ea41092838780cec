//! The gather request ([`GatherRequest`], one per load): how it names its chunks
//! ([`ChunkKeys`]), its order, hints, transport target and load group, its checks, and its
//! codec.

use super::rdma::{
    RdmaRegion, RdmaTarget, RDMA_MAX_LAYERS, RDMA_MAX_SEGMENTS, RDMA_MAX_UNITS_PER_LAYER,
    RDMA_SLOTS,
};
use super::segments::SegmentPlacement;
use super::{validate_bucket, WireGeometry, MAX_BUCKET_LEN, MAX_KEY_LEN};
use crate::layout::{ChunkHash, KeyBuilder, KvGeometry};
use crate::protocol::wire::{put_str16, Reader};
use crate::protocol::{
    ProtocolError, MAX_CHUNKS_HARD, MAX_SLICES_PER_REQUEST, MAX_UNITS_PER_REQUEST, MAX_UNIT_BYTES,
    MIN_UNIT_BYTES,
};
use bytes::BufMut;
use std::ops::Range;

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
    /// Which chunks lie in segment objects (format version 2), and where (descriptor flag
    /// bit 4; only to a server announcing [`crate::protocol::ServerInfo::FEATURE_SEGMENTS`],
    /// and only with [`ChunkKeys::Hashed`], whose prefix gives the segments' keys). `None`:
    /// every chunk is in its own chunk object.
    pub segments: Option<SegmentPlacement>,
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
const FLAG_SEGMENTS: u16 = 16;

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
            segments: None,
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
    ///
    /// [`plan_units`]: super::plan_units
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
        self.check_chunks(max_chunks)?;
        self.check_keys()?;
        self.check_layers_and_plan()?;
        self.check_hints()?;
        self.check_group()?;
        self.check_segments()?;
        self.check_rdma_target()
    }

    /// Chunks: 1..=`max_chunks` (at most [`MAX_CHUNKS_HARD`]), one token count each, each
    /// 1..=`tokens_per_chunk`.
    fn check_chunks(&self, max_chunks: u32) -> Result<(), ProtocolError> {
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
        Ok(())
    }

    /// Keys: explicit keys of 1..=[`MAX_KEY_LEN`] bytes; a hashed form's prefix leaves room for
    /// any hash within [`MAX_KEY_LEN`], and its hashes share one length.
    fn check_keys(&self) -> Result<(), ProtocolError> {
        match &self.chunks {
            ChunkKeys::Explicit(keys) => {
                for k in keys {
                    if k.is_empty() || k.len() > MAX_KEY_LEN {
                        return Err(ProtocolError::invalid(
                            "key",
                            format!("{} bytes (allowed 1..={MAX_KEY_LEN})", k.len()),
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
        Ok(())
    }

    /// Layers and units: a non-empty layer range within the model, `max_unit_bytes` within
    /// [`MIN_UNIT_BYTES`]..=[`MAX_UNIT_BYTES`], and the planner's cost: at most
    /// [`MAX_SLICES_PER_REQUEST`] slices and [`MAX_UNITS_PER_REQUEST`] units.
    fn check_layers_and_plan(&self) -> Result<(), ProtocolError> {
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
        let nl = self.layers.len();
        let n = self.chunks.len();
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
        Ok(())
    }

    /// Scheduling hints: one value per requested layer.
    fn check_hints(&self) -> Result<(), ProtocolError> {
        match &self.hints {
            SchedHints::None => {}
            SchedHints::LayerDeadlinesUs(v) | SchedHints::LayerComputeUs(v) => {
                let nl = self.layers.len();
                if v.len() != nl {
                    return Err(ProtocolError::invalid(
                        "hints",
                        format!("{} values for {nl} layers", v.len()),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Load group: stripe < stripes <= [`MAX_STRIPES`], and the load's layer bytes at least
    /// this stripe's and at most what its stripes can hold.
    fn check_group(&self) -> Result<(), ProtocolError> {
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
        Ok(())
    }

    /// Segment placement: only with the hashed key form, and valid for the geometry and the
    /// chunks' token counts.
    fn check_segments(&self) -> Result<(), ProtocolError> {
        if let Some(p) = &self.segments {
            if !matches!(self.chunks, ChunkKeys::Hashed { .. }) {
                return Err(ProtocolError::invalid(
                    "segment placement",
                    "segments are named by the hashed key form's prefix",
                ));
            }
            p.validate(&self.geometry, &self.chunk_tokens)?;
        }
        Ok(())
    }

    /// RDMA target: a slot and layers the write immediate can name ([`RDMA_SLOTS`],
    /// [`RDMA_MAX_LAYERS`], [`RDMA_MAX_UNITS_PER_LAYER`]), one destination per layer, at most
    /// [`RDMA_MAX_SEGMENTS`] segments, none empty, each layer's covering its bytes.
    fn check_rdma_target(&self) -> Result<(), ProtocolError> {
        let TransportTarget::Rdma(t) = &self.target else {
            return Ok(());
        };
        let nl = self.layers.len();
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
        if self.segments.is_some() {
            flags |= FLAG_SEGMENTS;
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
        if let Some(p) = &self.segments {
            p.encode(out);
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
        if flags & !(FLAG_VERIFY | FLAG_HASHED | FLAG_GROUP | FLAG_HELD | FLAG_SEGMENTS) != 0 {
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
        let segments = if flags & FLAG_SEGMENTS != 0 {
            Some(SegmentPlacement::decode(&mut r, max_chunks)?)
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
            segments,
        };
        req.validate(max_chunks)?;
        Ok(req)
    }
}
