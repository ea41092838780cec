//! Frames: an 8-byte header (type, flags, reserved, body length) and a typed body.

use super::descriptor::{GatherRequest, SaveRequest};
use super::wire::{put_str16, Reader};
use super::{ProtocolError, MAX_CONTROL_FRAME_BYTES, MAX_UNIT_BYTES};
use crate::error::LayerError;
use bytes::{BufMut, Bytes, BytesMut};
use std::ops::Range;

/// Bytes of every frame header.
pub const FRAME_HEADER_LEN: usize = 8;
/// Bytes of a unit header, after the frame header and before the payload.
pub const UNIT_HEADER_LEN: usize = 24;
/// Bytes of a save-data header, after the frame header and before the payload.
pub const SAVE_DATA_HEADER_LEN: usize = 16;
/// Largest body of a small control frame (hello, miss, end, error, ...), bytes.
const MAX_SMALL_BODY: u32 = 64 << 10;

/// Frame type codes (byte 0 of the header). Client-to-server types are below 0x80.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameType {
    /// Client hello: versions offered.
    Hello = 0x01,
    /// Client gather descriptor.
    Gather = 0x02,
    /// Client save descriptor.
    SaveBegin = 0x03,
    /// Client save data (part of one chunk object).
    SaveData = 0x04,
    /// Client: all save data sent.
    SaveEnd = 0x05,
    /// Client: cancel the request in flight.
    Cancel = 0x06,
    /// Client (version 2): access key id and HMAC answering the server's nonce.
    Auth = 0x07,
    /// Server hello: version chosen, limits.
    HelloAck = 0x81,
    /// Server: request accepted.
    Accepted = 0x82,
    /// Server: a delivery unit.
    Unit = 0x83,
    /// Server: some (chunk, layers) will not be delivered.
    Miss = 0x84,
    /// Server: request finished.
    End = 0x85,
    /// Server: request (or connection) failed.
    Error = 0x86,
    /// Server: save published.
    SaveDone = 0x87,
    /// Server (version 2): authenticate first; carries the nonce to answer.
    AuthChallenge = 0x88,
    /// Server (feature bit 5): the request is held on purpose (admission queue, bandwidth
    /// pacing); only to clients that asked for it (descriptor flag bit 3).
    Held = 0x89,
}

impl FrameType {
    /// From the header byte.
    ///
    /// # Errors
    /// [`ProtocolError::UnknownFrame`].
    pub fn from_u8(b: u8) -> Result<Self, ProtocolError> {
        use FrameType::*;
        Ok(match b {
            0x01 => Hello,
            0x02 => Gather,
            0x03 => SaveBegin,
            0x04 => SaveData,
            0x05 => SaveEnd,
            0x06 => Cancel,
            0x07 => Auth,
            0x81 => HelloAck,
            0x82 => Accepted,
            0x83 => Unit,
            0x84 => Miss,
            0x85 => End,
            0x86 => Error,
            0x87 => SaveDone,
            0x88 => AuthChallenge,
            0x89 => Held,
            _ => return Err(ProtocolError::UnknownFrame(b)),
        })
    }
    /// Name for errors and logs.
    pub fn name(self) -> &'static str {
        use FrameType::*;
        match self {
            Hello => "Hello",
            Gather => "Gather",
            SaveBegin => "SaveBegin",
            SaveData => "SaveData",
            SaveEnd => "SaveEnd",
            Cancel => "Cancel",
            HelloAck => "HelloAck",
            Accepted => "Accepted",
            Unit => "Unit",
            Miss => "Miss",
            End => "End",
            Error => "Error",
            SaveDone => "SaveDone",
            Auth => "Auth",
            AuthChallenge => "AuthChallenge",
            Held => "Held",
        }
    }
    /// Largest body this frame type may have, given the descriptor limit.
    fn max_body(self, max_descriptor: u32) -> u32 {
        match self {
            FrameType::Gather | FrameType::SaveBegin => max_descriptor.min(MAX_CONTROL_FRAME_BYTES),
            FrameType::Unit => MAX_UNIT_BYTES + UNIT_HEADER_LEN as u32,
            FrameType::SaveData => MAX_UNIT_BYTES + SAVE_DATA_HEADER_LEN as u32,
            _ => MAX_SMALL_BODY,
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Type.
    pub ty: FrameType,
    /// Body length in bytes.
    pub len: u32,
}

/// Writes an 8-byte frame header: type, flags (0), reserved (0), body length (u32 LE).
pub fn encode_frame_header(ty: FrameType, body_len: u32, out: &mut impl BufMut) {
    out.put_u8(ty as u8);
    out.put_u8(0);
    out.put_u16_le(0);
    out.put_u32_le(body_len);
}

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

    fn from_u8(b: u8) -> Result<Self, ProtocolError> {
        Ok(match b {
            1 => MissReason::NotFound,
            2 => MissReason::ChecksumMismatch,
            3 => MissReason::GeometryMismatch,
            4 => MissReason::Storage,
            _ => return Err(ProtocolError::invalid("miss reason", format!("code {b}"))),
        })
    }
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
    fn from_u16(v: u16) -> Self {
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
    /// authenticated, 16 = load groups, 32 = `Held` frames.
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
    /// 3, paged destinations) are accepted; see [`super::RdmaTarget`].
    pub const FEATURE_RDMA_SCATTER: u32 = 32;
    /// Feature bit (version 2): the server sends `Held` frames while it holds a request on
    /// purpose, to a client that asks for them (descriptor flag bit 3,
    /// [`crate::protocol::GatherRequest::held`]), so the client tells a paused load from a
    /// stalled one.
    pub const FEATURE_HELD: u32 = 64;
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

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Frame {
    /// Client hello.
    Hello {
        /// Lowest version offered.
        version_min: u16,
        /// Highest version offered.
        version_max: u16,
    },
    /// Gather request.
    Gather(Box<GatherRequest>),
    /// Save request.
    SaveBegin(Box<SaveRequest>),
    /// Save data: `data` goes at `offset` of chunk `chunk`'s object.
    SaveData {
        /// Chunk index.
        chunk: u32,
        /// Byte offset in the object.
        offset: u64,
        /// Bytes.
        data: Bytes,
    },
    /// End of save data.
    SaveEnd,
    /// Cancel the request in flight.
    Cancel {
        /// Request id.
        request_id: u64,
    },
    /// Server hello.
    HelloAck(ServerInfo),
    /// Client's answer to an [`Frame::AuthChallenge`] (version 2).
    Auth {
        /// Access key id (at most [`super::auth::MAX_ACCESS_KEY_LEN`] bytes).
        access_key: String,
        /// [`super::auth::auth_mac`] of the challenge's nonce.
        mac: [u8; super::auth::MAC_LEN],
    },
    /// Server: authenticate before anything else (version 2).
    AuthChallenge {
        /// Random bytes, fresh per connection.
        nonce: [u8; super::auth::NONCE_LEN],
    },
    /// Request accepted.
    Accepted {
        /// Request id.
        request_id: u64,
        /// Units that will be sent (if nothing misses).
        units: u64,
        /// Payload bytes that will be sent (if nothing misses).
        bytes: u64,
    },
    /// A delivery unit.
    Unit {
        /// Its header.
        header: UnitHeader,
        /// Its payload (`header.len` bytes).
        data: Bytes,
    },
    /// Chunk `chunk`'s layers `layers` will not be delivered; the server sends no further
    /// unit of those layers.
    Miss {
        /// Chunk index.
        chunk: u32,
        /// Affected layers.
        layers: Range<u32>,
        /// Why.
        reason: MissReason,
        /// Details.
        message: String,
    },
    /// Request finished.
    End {
        /// Request id.
        request_id: u64,
        /// Units sent.
        units: u64,
        /// Payload bytes sent.
        bytes: u64,
    },
    /// Request failed; the message says why.
    Error {
        /// Code.
        code: ErrorCode,
        /// Message.
        message: String,
    },
    /// Save published.
    SaveDone {
        /// Request id.
        request_id: u64,
        /// Data objects written by this save.
        written: u32,
        /// Data objects that were already present (first writer wins).
        already_present: u32,
    },
    /// The request is held on purpose and still alive (feature bit 5, to clients that set
    /// descriptor flag bit 3): it waits for admission or for its share of the bandwidth cap.
    Held {
        /// Request id.
        request_id: u64,
    },
}

impl Frame {
    /// The frame's type.
    pub fn ty(&self) -> FrameType {
        match self {
            Frame::Hello { .. } => FrameType::Hello,
            Frame::Gather(_) => FrameType::Gather,
            Frame::SaveBegin(_) => FrameType::SaveBegin,
            Frame::SaveData { .. } => FrameType::SaveData,
            Frame::SaveEnd => FrameType::SaveEnd,
            Frame::Cancel { .. } => FrameType::Cancel,
            Frame::HelloAck(_) => FrameType::HelloAck,
            Frame::Accepted { .. } => FrameType::Accepted,
            Frame::Unit { .. } => FrameType::Unit,
            Frame::Miss { .. } => FrameType::Miss,
            Frame::End { .. } => FrameType::End,
            Frame::Error { .. } => FrameType::Error,
            Frame::SaveDone { .. } => FrameType::SaveDone,
            Frame::Auth { .. } => FrameType::Auth,
            Frame::AuthChallenge { .. } => FrameType::AuthChallenge,
            Frame::Held { .. } => FrameType::Held,
        }
    }

    /// Appends the whole frame (header and body) to `out`. Unit and save-data payloads are
    /// copied here; drivers that avoid the copy send [`UnitHeader::encode_prefix`] and the
    /// payload separately.
    pub fn encode(&self, out: &mut BytesMut) {
        let start = out.len();
        encode_frame_header(self.ty(), 0, out);
        match self {
            Frame::Hello {
                version_min,
                version_max,
            } => {
                out.put_u16_le(*version_min);
                out.put_u16_le(*version_max);
            }
            Frame::Gather(g) => g.encode(out),
            Frame::SaveBegin(s) => s.encode(out),
            Frame::SaveData {
                chunk,
                offset,
                data,
            } => {
                out.put_u32_le(*chunk);
                out.put_u32_le(0);
                out.put_u64_le(*offset);
                out.put_slice(data);
            }
            Frame::SaveEnd => {}
            Frame::Cancel { request_id } => out.put_u64_le(*request_id),
            Frame::HelloAck(i) => {
                out.put_u16_le(i.version);
                out.put_u16_le(0);
                out.put_u32_le(i.features);
                out.put_u32_le(i.max_descriptor_bytes);
                out.put_u32_le(i.max_chunks);
                out.put_u64_le(i.max_request_bytes);
            }
            Frame::Accepted {
                request_id,
                units,
                bytes,
            }
            | Frame::End {
                request_id,
                units,
                bytes,
            } => {
                out.put_u64_le(*request_id);
                out.put_u64_le(*units);
                out.put_u64_le(*bytes);
            }
            Frame::Unit { header, data } => {
                out.put_slice(&header.encode_prefix()[FRAME_HEADER_LEN..]);
                out.put_slice(data);
            }
            Frame::Miss {
                chunk,
                layers,
                reason,
                message,
            } => {
                out.put_u32_le(*chunk);
                out.put_u32_le(layers.start);
                out.put_u32_le(layers.end);
                out.put_u8(*reason as u8);
                out.put_u8(0);
                put_str16(out, truncate(message, 4096));
            }
            Frame::Error { code, message } => {
                out.put_u16_le(*code as u16);
                put_str16(out, truncate(message, 4096));
            }
            Frame::SaveDone {
                request_id,
                written,
                already_present,
            } => {
                out.put_u64_le(*request_id);
                out.put_u32_le(*written);
                out.put_u32_le(*already_present);
            }
            Frame::Auth { access_key, mac } => {
                put_str16(out, truncate(access_key, super::auth::MAX_ACCESS_KEY_LEN));
                out.put_slice(mac);
            }
            Frame::AuthChallenge { nonce } => out.put_slice(nonce),
            Frame::Held { request_id } => out.put_u64_le(*request_id),
        }
        let body = (out.len() - start - FRAME_HEADER_LEN) as u32;
        out[start + 4..start + 8].copy_from_slice(&body.to_le_bytes());
    }
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut i = max;
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    &s[..i]
}

/// Bytes of a unit frame before its payload: the frame header and the unit header.
pub const UNIT_PREFIX_LEN: usize = FRAME_HEADER_LEN + UNIT_HEADER_LEN;

/// Decodes the 32-byte prefix of a `Unit` frame (frame header, then unit header) without its
/// payload, for a receiver that reads the payload itself, straight into its destination
/// ([`crate::protocol::ClientConnection::set_direct_units`]). The checks are
/// [`decode_frame`]'s for a unit frame.
///
/// # Errors
/// [`ProtocolError`] if the prefix is not a unit frame's, has nonzero flags or reserved
/// bytes, announces a body above 16 MiB plus the unit header, or its unit length disagrees
/// with the frame length.
pub fn decode_unit_prefix(prefix: &[u8; UNIT_PREFIX_LEN]) -> Result<UnitHeader, ProtocolError> {
    let ty = FrameType::from_u8(prefix[0])?;
    if ty != FrameType::Unit {
        return Err(ProtocolError::invalid(
            "unit",
            format!("expected a unit frame, got {}", ty.name()),
        ));
    }
    if prefix[1..4] != [0, 0, 0] {
        return Err(ProtocolError::invalid(
            "frame header",
            "flags and reserved bytes must be zero",
        ));
    }
    let body = u32::from_le_bytes(prefix[4..8].try_into().expect("4 bytes"));
    let max = ty.max_body(0);
    if body > max {
        return Err(ProtocolError::TooLarge {
            what: "frame body",
            got: body as u64,
            max: max as u64,
        });
    }
    let mut r = Reader::new(&prefix[FRAME_HEADER_LEN..], ty.name());
    let layer = r.u32()?;
    let crc32c = r.u32()?;
    let offset = r.u64()?;
    let len = r.u32()?;
    r.zero(4, "unit reserved")?;
    if body.checked_sub(UNIT_HEADER_LEN as u32) != Some(len) {
        return Err(ProtocolError::invalid(
            "unit length",
            format!(
                "header says {len} bytes, frame carries {}",
                body as i64 - UNIT_HEADER_LEN as i64
            ),
        ));
    }
    Ok(UnitHeader {
        layer,
        crc32c,
        offset,
        len,
    })
}

/// Decodes one frame from the front of `buf` if it holds a whole one, removing it. Payloads
/// are split off `buf` without copying. When only a header is present, reserves room for the
/// rest of the frame so the next read fills it.
///
/// `max_descriptor` bounds `Gather` and `SaveBegin` bodies; `max_chunks` bounds their counts.
///
/// # Errors
/// [`ProtocolError`]: unknown type, nonzero reserved header bytes, a body above its type's
/// limit (checked from the header, before the body is received), or a bad body.
pub fn decode_frame(
    buf: &mut BytesMut,
    max_descriptor: u32,
    max_chunks: u32,
) -> Result<Option<Frame>, ProtocolError> {
    if buf.len() < FRAME_HEADER_LEN {
        return Ok(None);
    }
    let ty = FrameType::from_u8(buf[0])?;
    if buf[1] != 0 || buf[2] != 0 || buf[3] != 0 {
        return Err(ProtocolError::invalid(
            "frame header",
            "flags and reserved bytes must be zero",
        ));
    }
    let len = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
    let max = ty.max_body(max_descriptor);
    if len > max {
        let what = match ty {
            FrameType::Gather | FrameType::SaveBegin => "descriptor size",
            _ => "frame body",
        };
        return Err(ProtocolError::TooLarge {
            what,
            got: len as u64,
            max: max as u64,
        });
    }
    let total = FRAME_HEADER_LEN + len as usize;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let mut frame = buf.split_to(total);
    let _ = frame.split_to(FRAME_HEADER_LEN);
    let body = frame.freeze();
    decode_body(ty, body, max_descriptor, max_chunks).map(Some)
}

fn decode_body(
    ty: FrameType,
    body: Bytes,
    _max_descriptor: u32,
    max_chunks: u32,
) -> Result<Frame, ProtocolError> {
    let mut r = Reader::new(&body, ty.name());
    let f = match ty {
        FrameType::Hello => Frame::Hello {
            version_min: r.u16()?,
            version_max: r.u16()?,
        },
        FrameType::Gather => {
            return Ok(Frame::Gather(Box::new(GatherRequest::decode(
                &body, max_chunks,
            )?)))
        }
        FrameType::SaveBegin => {
            return Ok(Frame::SaveBegin(Box::new(SaveRequest::decode(
                &body, max_chunks,
            )?)))
        }
        FrameType::SaveData => {
            let chunk = r.u32()?;
            r.zero(4, "save data reserved")?;
            let offset = r.u64()?;
            return Ok(Frame::SaveData {
                chunk,
                offset,
                data: body.slice(SAVE_DATA_HEADER_LEN..),
            });
        }
        FrameType::SaveEnd => Frame::SaveEnd,
        FrameType::Cancel => Frame::Cancel {
            request_id: r.u64()?,
        },
        FrameType::HelloAck => {
            let version = r.u16()?;
            r.zero(2, "hello reserved")?;
            Frame::HelloAck(ServerInfo {
                version,
                features: r.u32()?,
                max_descriptor_bytes: r.u32()?,
                max_chunks: r.u32()?,
                max_request_bytes: r.u64()?,
            })
        }
        FrameType::Accepted => Frame::Accepted {
            request_id: r.u64()?,
            units: r.u64()?,
            bytes: r.u64()?,
        },
        FrameType::End => Frame::End {
            request_id: r.u64()?,
            units: r.u64()?,
            bytes: r.u64()?,
        },
        FrameType::Unit => {
            let layer = r.u32()?;
            let crc32c = r.u32()?;
            let offset = r.u64()?;
            let len = r.u32()?;
            r.zero(4, "unit reserved")?;
            if len as usize != body.len() - UNIT_HEADER_LEN {
                return Err(ProtocolError::invalid(
                    "unit length",
                    format!(
                        "header says {len} bytes, frame carries {}",
                        body.len() - UNIT_HEADER_LEN
                    ),
                ));
            }
            return Ok(Frame::Unit {
                header: UnitHeader {
                    layer,
                    crc32c,
                    offset,
                    len,
                },
                data: body.slice(UNIT_HEADER_LEN..),
            });
        }
        FrameType::Miss => {
            let chunk = r.u32()?;
            let layers = r.u32()?..r.u32()?;
            let reason = MissReason::from_u8(r.u8()?)?;
            r.zero(1, "miss reserved")?;
            let message = r.str16("miss message", 4096)?;
            Frame::Miss {
                chunk,
                layers,
                reason,
                message,
            }
        }
        FrameType::Error => {
            let code = ErrorCode::from_u16(r.u16()?);
            Frame::Error {
                code,
                message: r.str16("error message", 4096)?,
            }
        }
        FrameType::SaveDone => Frame::SaveDone {
            request_id: r.u64()?,
            written: r.u32()?,
            already_present: r.u32()?,
        },
        FrameType::Auth => Frame::Auth {
            access_key: r.str16("access key id", super::auth::MAX_ACCESS_KEY_LEN)?,
            mac: r
                .take(super::auth::MAC_LEN)?
                .try_into()
                .expect("MAC_LEN bytes"),
        },
        FrameType::AuthChallenge => Frame::AuthChallenge {
            nonce: r
                .take(super::auth::NONCE_LEN)?
                .try_into()
                .expect("NONCE_LEN bytes"),
        },
        FrameType::Held => Frame::Held {
            request_id: r.u64()?,
        },
    };
    r.finish()?;
    Ok(f)
}
