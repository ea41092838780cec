//! The gather wire protocol (sans-IO): descriptors, frames, and the client and server state
//! machines. Specified byte by byte in `docs/protocol.md`.
//!
//! One gather request per load: the client names the chunk objects of a prefix (in prefix
//! order), their geometry and token counts, and the server streams every layer's slices back
//! as framed *units* in layer-major order, each carrying its layer index, destination offset,
//! length and CRC32C. A batched save sends all chunk objects of a prefix in one request; the
//! server publishes them only after every data object is durable.
//!
//! The code here performs no I/O and reads no clock: [`ClientConnection`] and
//! [`ServerConnection`] take bytes in (`handle_bytes`), hand bytes out (`poll_transmit`) and
//! report what happened (`poll_event`), in the vocabulary of `quinn-proto`. The tokio drivers
//! live in the crates above: `objectcache_client::transport::tcp` (client) and
//! `objectcache-server`'s `gather` (server). What one load sends and what it makes of it is decided here
//! too: [`ServerLoad`] (the server's per-load state: header results, units cut around misses
//! with their CRC32Cs combined, the RDMA unit rule, per-layer counts) and [`LoadTracker`] (the
//! client's: which layers are misses and why).
#![forbid(unsafe_code)]

pub mod auth;
mod client;
mod client_load;
mod descriptor;
mod frame;
mod server;
mod server_load;
mod wire;

pub use client::{ClientConnection, ClientEvent};
pub use client_load::{LoadOutcome, LoadTracker};
pub use descriptor::{
    check_bucket_name, plan_units, rdma_pieces, unit_indices, BadBucketName, ChunkKeys,
    DeliveryOrder, GatherRequest, HeaderMismatch, LoadGroup, RdmaRegion, RdmaSegments, RdmaTarget,
    SaveChunk, SaveRequest, SchedHints, SegmentPlacement, SegmentRef, SlicePiece, TransportTarget,
    UnitPlan, WireGeometry, MAX_SEGMENTS_PER_REQUEST, MAX_SEGMENT_HEADER_BYTES_PER_REQUEST,
    MAX_STRIPES, RDMA_MAX_LAYERS, RDMA_MAX_SEGMENTS, RDMA_MAX_UNITS_PER_LAYER, RDMA_SLOTS,
};
pub use frame::{
    decode_frame, decode_unit_prefix, encode_frame_header, ErrorCode, Frame, FrameHeader,
    FrameType, MissFrame, MissReason, SaveData, SaveDone, ServerInfo, UnitHeader, UnitTally,
    FRAME_HEADER_LEN, SAVE_DATA_HEADER_LEN, UNIT_HEADER_LEN, UNIT_PREFIX_LEN,
};
pub use server::{ServerConnection, ServerEvent, ServerLimits, MAX_HANDSHAKE_BODY_BYTES};
pub use server_load::{
    CutUnit, GoodPiece, LoadAction, PieceMiss, PieceRead, RdmaWrite, ServerLoad, UnitReady,
};

/// The 8 bytes a client sends first on a gather connection. They cannot begin an HTTP/1
/// request, so one listening port can serve both S3 (HTTP) and gather.
pub const PREFACE: [u8; 8] = *b"OCGATHER";
/// Protocol version spoken by this build (see the versioning rule in `docs/protocol.md`).
pub const PROTOCOL_VERSION: u16 = 2;
/// Largest delivery unit payload, in bytes (16 MiB): a unit never exceeds it.
pub const MAX_UNIT_BYTES: u32 = 16 << 20;
/// Smallest delivery unit a client may ask for, in bytes (4 KiB).
pub const MIN_UNIT_BYTES: u32 = 4 << 10;
/// Hard cap on any control frame body (descriptors, errors), in bytes (16 MiB); servers
/// announce a lower limit in their hello.
pub const MAX_CONTROL_FRAME_BYTES: u32 = 16 << 20;
/// Hard cap on chunks in one request (65,536 chunks = 16.7M tokens at 256 tokens per chunk);
/// servers announce a lower limit in their hello.
pub const MAX_CHUNKS_HARD: u32 = 1 << 16;
/// Largest bytes per token per layer a request may name (1 MiB; Llama-3.1-70B at TP 1 in bf16
/// is 4 KiB): with [`MAX_TOKENS_PER_CHUNK`] it bounds one slice at 64 GiB before any size is
/// multiplied.
pub const MAX_BYTES_PER_TOKEN_PER_LAYER: u32 = 1 << 20;
/// Largest tokens per chunk a request may name (65,536; engines use 16 to 512).
pub const MAX_TOKENS_PER_CHUNK: u32 = 1 << 16;
/// Most slices (requested layers x chunks) one request may name: 1,048,576, e.g. 4,096
/// chunks x 256 layers. Bounds the planner's memory and time before it runs.
pub const MAX_SLICES_PER_REQUEST: u64 = 1 << 20;
/// Longest a server holds a request on purpose without a `Held` frame to a client that asked
/// for them (descriptor flag bit 3): 250 ms. A client's stall watchdog waits at least four
/// times that before it calls a held load stalled.
pub const HELD_EVERY_MS: u64 = 250;
/// Most delivery units one request may plan (2,097,152): bounds [`plan_units`]'s output,
/// checked arithmetically in [`GatherRequest::validate`] before anything is planned.
pub const MAX_UNITS_PER_REQUEST: u64 = 1 << 21;

/// Why bytes could not be decoded, or a request is not acceptable.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The connection did not start with [`PREFACE`].
    #[error("bad preface: not an ObjectCache gather connection")]
    BadPreface,
    /// The peer speaks no version this build speaks.
    #[error(
        "unsupported protocol version range {min}..={max} (this build speaks {PROTOCOL_VERSION})"
    )]
    UnsupportedVersion {
        /// Lowest version offered.
        min: u16,
        /// Highest version offered.
        max: u16,
    },
    /// An unknown frame type byte.
    #[error("unknown frame type 0x{0:02x}")]
    UnknownFrame(u8),
    /// A frame arrived that the current state does not accept.
    #[error("unexpected {frame} frame while {state}")]
    UnexpectedFrame {
        /// Frame type name.
        frame: &'static str,
        /// State name.
        state: &'static str,
    },
    /// A frame body ended before a field.
    #[error("truncated {what}: needed {needed} more bytes")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// Bytes missing.
        needed: usize,
    },
    /// A length or count exceeds its limit.
    #[error("{what} is {got}, above the limit of {max}")]
    TooLarge {
        /// What is too large.
        what: &'static str,
        /// The value received.
        got: u64,
        /// The limit.
        max: u64,
    },
    /// A field holds a value that is not allowed; the message names it.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// Field name.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// The peer reported an error (server `Error` frame).
    #[error("server error {code:?}: {message}")]
    Remote {
        /// Error code.
        code: ErrorCode,
        /// Server's message.
        message: String,
    },
}

impl ProtocolError {
    /// A [`ProtocolError::Invalid`] naming `field` and why its value is refused.
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        ProtocolError::Invalid {
            field,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
