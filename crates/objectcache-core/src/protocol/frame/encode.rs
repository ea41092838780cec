//! [`Frame`], a decoded frame of any type, and its encoding.

use super::FRAME_HEADER_LEN;
use super::{encode_frame_header, ErrorCode, FrameType, MissReason, ServerInfo, UnitHeader};
use crate::protocol::descriptor::{GatherRequest, SaveRequest};
use crate::protocol::wire::put_str16;
use bytes::{BufMut, Bytes, BytesMut};
use std::ops::Range;

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
        /// Access key id (at most [`crate::protocol::auth::MAX_ACCESS_KEY_LEN`] bytes).
        access_key: String,
        /// [`crate::protocol::auth::auth_mac`] of the challenge's nonce.
        mac: [u8; crate::protocol::auth::MAC_LEN],
    },
    /// Server: authenticate before anything else (version 2).
    AuthChallenge {
        /// Random bytes, fresh per connection.
        nonce: [u8; crate::protocol::auth::NONCE_LEN],
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
                put_str16(
                    out,
                    truncate(access_key, crate::protocol::auth::MAX_ACCESS_KEY_LEN),
                );
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
