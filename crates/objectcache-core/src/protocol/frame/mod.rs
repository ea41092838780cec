//! Frames: an 8-byte header (type, flags, reserved, body length) and a typed body.
//!
//! The header and frame types are here; the typed parts of bodies in `body.rs`, [`Frame`] and
//! its encoding in `encode.rs`, decoding in `decode.rs`.

mod body;
mod decode;
mod encode;

pub use body::{
    ErrorCode, MissFrame, MissReason, SaveData, SaveDone, ServerInfo, UnitHeader, UnitTally,
};
pub use decode::{decode_frame, decode_unit_prefix, UNIT_PREFIX_LEN};
pub use encode::Frame;

use crate::protocol::{ProtocolError, MAX_CONTROL_FRAME_BYTES, MAX_UNIT_BYTES};
use bytes::BufMut;

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
