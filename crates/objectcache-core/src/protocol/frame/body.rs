//! The typed parts of frame bodies: why a range is not delivered ([`MissReason`], and the
//! whole notice, [`MissFrame`]), the request-level error codes ([`ErrorCode`]), the server's
//! hello ([`ServerInfo`]), the unit header ([`UnitHeader`]), a gather's counts
//! ([`UnitTally`]) and a save's data and result ([`SaveData`], [`SaveDone`]). Each is both a
//! frame's body ([`super::Frame`]) and what the receiving side's event carries
//! (`ClientEvent`, `ServerEvent`): one definition for both.

use super::{encode_frame_header, FrameType, FRAME_HEADER_LEN, UNIT_HEADER_LEN};
use crate::error::LayerError;
use crate::protocol::ProtocolError;
use bytes::{BufMut, Bytes};
use std::ops::Range;

/// Why a (chunk, layers) range is not delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MissReason {
    /// The object does not exist.
    NotFound = 1,
    /// A stored slice CRC did not match (server-side verification).
    ChecksumMismatch = 2,
    /// The object has another geometry, token count or format.
    GeometryMismatch = 3,
    /// The backend failed.
    Storage = 4,
}

impl MissReason {
    /// The layer miss an engine reports for one layer of chunk `chunk` (index in the load)
    /// that the server named with this reason: `key` is the chunk's object key (named by a
    /// [`LayerError::Missing`]), `message` the server's words. A checksum mismatch found by
    /// the server reads as a storage miss, as it does over ranged GETs.
    pub fn layer_error(self, chunk: usize, key: String, message: &str) -> LayerError {
        match self {
            MissReason::NotFound => LayerError::Missing { chunk, key },
            MissReason::GeometryMismatch => LayerError::GeometryMismatch {
                chunk,
                reason: message.to_string(),
            },
            MissReason::ChecksumMismatch | MissReason::Storage => LayerError::Storage {
                chunk,
                message: message.to_string(),
            },
        }
    }

    pub(super) fn from_u8(b: u8) -> Result<Self, ProtocolError> {
        Ok(match b {
            1 => MissReason::NotFound,
            2 => MissReason::ChecksumMismatch,
            3 => MissReason::GeometryMismatch,
            4 => MissReason::Storage,
            _ => return Err(ProtocolError::invalid("miss reason", format!("code {b}"))),
        })
    }
}

/// The body of a `Miss` frame: chunk `chunk` is not delivered for `layers`, and why. The
/// server's load state builds it (`ServerLoad`), the server connection sends it, and the
/// client connection hands it on as `ClientEvent::Miss`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissFrame {
    /// Chunk index in the request.
    pub chunk: u32,
    /// The layers it is not delivered for.
    pub layers: Range<u32>,
    /// Why.
    pub reason: MissReason,
    /// The server's words (at most 4,096 bytes on the wire).
    pub message: String,
}

/// A gather's counts: in `Accepted`, the units and payload bytes the server will send if
/// nothing misses; in `End`, those it sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitTally {
    /// Request id.
    pub request_id: u64,
    /// Unit frames.
    pub units: u64,
    /// Payload bytes of those units.
    pub bytes: u64,
}

/// The body of a `SaveData` frame: `data` goes at byte `offset` of chunk `chunk`'s object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveData {
    /// Chunk index in the save.
    pub chunk: u32,
    /// Byte offset in the chunk's object.
    pub offset: u64,
    /// The bytes.
    pub data: Bytes,
}

/// The body of a `SaveDone` frame: the save was published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaveDone {
    /// Request id.
    pub request_id: u64,
    /// Data objects written by this save.
    pub written: u32,
    /// Data objects that were already present (first writer wins).
    pub already_present: u32,
}

/// Request-level error codes of an `Error` frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// A frame could not be decoded, or came in the wrong state.
    Malformed = 1,
    /// No common protocol version.
    UnsupportedVersion = 2,
    /// The descriptor is larger than the server's limit.
    DescriptorTooLarge = 3,
    /// More chunks than the server's limit.
    TooManyChunks = 4,
    /// Too many concurrent loads; retry later or fall back.
    Busy = 5,
    /// The request would need more memory than one request may hold.
    MemoryLimit = 6,
    /// The bucket does not exist.
    NoSuchBucket = 7,
    /// A feature this server does not offer (e.g. an RDMA target).
    Unsupported = 8,
    /// The server is shutting down.
    ShuttingDown = 9,
    /// A save's object was refused (bad header, wrong size, checksum).
    BadObject = 10,
    /// The backend failed.
    Storage = 11,
    /// Anything else.
    Internal = 12,
    /// Authentication required, or the access key / MAC was refused (version 2).
    Unauthorized = 13,
}

impl ErrorCode {
    pub(super) fn from_u16(v: u16) -> Self {
        use ErrorCode::*;
        match v {
            1 => Malformed,
            2 => UnsupportedVersion,
            3 => DescriptorTooLarge,
            4 => TooManyChunks,
            5 => Busy,
            6 => MemoryLimit,
            7 => NoSuchBucket,
            8 => Unsupported,
            9 => ShuttingDown,
            10 => BadObject,
            11 => Storage,
            13 => Unauthorized,
            _ => Internal,
        }
    }
    /// Short label for metrics.
    pub fn label(self) -> &'static str {
        use ErrorCode::*;
        match self {
            Malformed => "malformed",
            UnsupportedVersion => "unsupported_version",
            DescriptorTooLarge => "descriptor_too_large",
            TooManyChunks => "too_many_chunks",
            Busy => "busy",
            MemoryLimit => "memory_limit",
            NoSuchBucket => "no_such_bucket",
            Unsupported => "unsupported",
            ShuttingDown => "shutting_down",
            BadObject => "bad_object",
            Storage => "storage",
            Internal => "internal",
            Unauthorized => "unauthorized",
        }
    }
}

/// The server's hello: version chosen and its limits (capability discovery).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerInfo {
    /// Version chosen.
    pub version: u16,
    /// Feature bits: 1 = gather over TCP, 2 = batched save, 4 = RDMA target, 8 =
    /// authenticated, 16 = load groups, 32 = RDMA scatter, 64 = `Held` frames, 128 = segment
    /// objects.
    pub features: u32,
    /// Largest descriptor body accepted, bytes.
    pub max_descriptor_bytes: u32,
    /// Most chunks per request.
    pub max_chunks: u32,
    /// Largest object accepted by a batched save (memory per request), bytes.
    pub max_request_bytes: u64,
}

impl ServerInfo {
    /// Feature bit: gather with an inline TCP target.
    pub const FEATURE_GATHER_TCP: u32 = 1;
    /// Feature bit: batched save.
    pub const FEATURE_SAVE: u32 = 2;
    /// Feature bit: RDMA target.
    pub const FEATURE_RDMA: u32 = 4;
    /// Feature bit (version 2): this connection was authenticated with an access key.
    pub const FEATURE_AUTH: u32 = 8;
    /// Feature bit (version 2): the server schedules striped loads as one load: it accepts
    /// the descriptor's load-group block (flag bit 2, [`crate::protocol::LoadGroup`]).
    /// Clients send the block only to servers announcing this bit.
    pub const FEATURE_LOAD_GROUPS: u32 = 16;
    /// Feature bit (version 2): RDMA targets whose layers are lists of segments (wire kind
    /// 3, paged destinations) are accepted; see [`crate::protocol::RdmaTarget`].
    pub const FEATURE_RDMA_SCATTER: u32 = 32;
    /// Feature bit (version 2): the server sends `Held` frames while it holds a request on
    /// purpose, to a client that asks for them (descriptor flag bit 3,
    /// [`crate::protocol::GatherRequest::held`]), so the client tells a paused load from a
    /// stalled one.
    pub const FEATURE_HELD: u32 = 64;
    /// Feature bit (version 2): the server reads chunks held in segment objects (object
    /// format version 2): it accepts the descriptor's segment placement (flag bit 4,
    /// [`crate::protocol::SegmentPlacement`]). Clients send it only to servers announcing
    /// this bit; others get those loads as ranged GETs.
    pub const FEATURE_SEGMENTS: u32 = 128;
}

/// The 24-byte header of a `Unit` frame body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitHeader {
    /// Layer index.
    pub layer: u32,
    /// CRC32C (Castagnoli) of the payload.
    pub crc32c: u32,
    /// Destination offset in the layer's buffer, bytes.
    pub offset: u64,
    /// Payload length, bytes.
    pub len: u32,
}

impl UnitHeader {
    /// The frame header and unit header of a unit frame (32 bytes); the payload follows.
    pub fn encode_prefix(&self) -> [u8; FRAME_HEADER_LEN + UNIT_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN + UNIT_HEADER_LEN];
        let mut w = &mut b[..];
        encode_frame_header(FrameType::Unit, UNIT_HEADER_LEN as u32 + self.len, &mut w);
        w.put_u32_le(self.layer);
        w.put_u32_le(self.crc32c);
        w.put_u64_le(self.offset);
        w.put_u32_le(self.len);
        w.put_u32_le(0);
        b
    }
}
