//! [`Frame`], a decoded frame of any type, and its encoding.

use super::FRAME_HEADER_LEN;
use super::{encode_frame_header, ErrorCode, FrameType, ServerInfo, UnitHeader};
use super::{MissFrame, SaveData, SaveDone, UnitTally};
use crate::protocol::descriptor::{GatherRequest, SaveRequest};
use crate::protocol::wire::put_str16;
use bytes::{BufMut, Bytes, BytesMut};

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
    SaveData(SaveData),
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
    /// Request accepted: the units and bytes that will be sent if nothing misses.
    Accepted(UnitTally),
    /// A delivery unit.
    Unit {
        /// Its header.
        header: UnitHeader,
        /// Its payload (`header.len` bytes).
        data: Bytes,
    },
    /// Chunk `chunk`'s layers `layers` will not be delivered; the server sends no further
    /// unit of those layers.
    Miss(MissFrame),
    /// Request finished: the units and bytes sent.
    End(UnitTally),
    /// Request failed; the message says why.
    Error {
        /// Code.
        code: ErrorCode,
        /// Message.
        message: String,
    },
    /// Save published.
    SaveDone(SaveDone),
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
            Frame::SaveData(_) => FrameType::SaveData,
            Frame::SaveEnd => FrameType::SaveEnd,
            Frame::Cancel { .. } => FrameType::Cancel,
            Frame::HelloAck(_) => FrameType::HelloAck,
            Frame::Accepted(_) => FrameType::Accepted,
            Frame::Unit { .. } => FrameType::Unit,
            Frame::Miss(_) => FrameType::Miss,
            Frame::End(_) => FrameType::End,
            Frame::Error { .. } => FrameType::Error,
            Frame::SaveDone(_) => FrameType::SaveDone,
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
            Frame::SaveData(d) => {
                out.put_u32_le(d.chunk);
                out.put_u32_le(0);
                out.put_u64_le(d.offset);
                out.put_slice(&d.data);
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
            Frame::Accepted(t) | Frame::End(t) => {
                out.put_u64_le(t.request_id);
                out.put_u64_le(t.units);
                out.put_u64_le(t.bytes);
            }
            Frame::Unit { header, data } => {
                out.put_slice(&header.encode_prefix()[FRAME_HEADER_LEN..]);
                out.put_slice(data);
            }
            Frame::Miss(m) => {
                out.put_u32_le(m.chunk);
                out.put_u32_le(m.layers.start);
                out.put_u32_le(m.layers.end);
                out.put_u8(m.reason as u8);
                out.put_u8(0);
                put_str16(out, truncate(&m.message, 4096));
            }
            Frame::Error { code, message } => {
                out.put_u16_le(*code as u16);
                put_str16(out, truncate(message, 4096));
            }
            Frame::SaveDone(d) => {
                out.put_u64_le(d.request_id);
                out.put_u32_le(d.written);
                out.put_u32_le(d.already_present);
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
