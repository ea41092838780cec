//! Decoding frames: one whole frame from the front of a buffer ([`decode_frame`]), or a unit
//! frame's prefix alone for a receiver that reads the payload itself
//! ([`decode_unit_prefix`]).

use super::{ErrorCode, Frame, FrameType, MissReason, ServerInfo, UnitHeader};
use super::{MissFrame, SaveData, SaveDone, UnitTally};
use super::{FRAME_HEADER_LEN, SAVE_DATA_HEADER_LEN, UNIT_HEADER_LEN};
use crate::protocol::descriptor::{GatherRequest, SaveRequest};
use crate::protocol::wire::Reader;
use crate::protocol::ProtocolError;
use bytes::{Bytes, BytesMut};

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
            return Ok(Frame::SaveData(SaveData {
                chunk,
                offset,
                data: body.slice(SAVE_DATA_HEADER_LEN..),
            }));
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
        FrameType::Accepted | FrameType::End => {
            let t = UnitTally {
                request_id: r.u64()?,
                units: r.u64()?,
                bytes: r.u64()?,
            };
            match ty {
                FrameType::Accepted => Frame::Accepted(t),
                _ => Frame::End(t),
            }
        }
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
            Frame::Miss(MissFrame {
                chunk,
                layers,
                reason,
                message,
            })
        }
        FrameType::Error => {
            let code = ErrorCode::from_u16(r.u16()?);
            Frame::Error {
                code,
                message: r.str16("error message", 4096)?,
            }
        }
        FrameType::SaveDone => Frame::SaveDone(SaveDone {
            request_id: r.u64()?,
            written: r.u32()?,
            already_present: r.u32()?,
        }),
        FrameType::Auth => Frame::Auth {
            access_key: r.str16("access key id", crate::protocol::auth::MAX_ACCESS_KEY_LEN)?,
            mac: r
                .take(crate::protocol::auth::MAC_LEN)?
                .try_into()
                .expect("MAC_LEN bytes"),
        },
        FrameType::AuthChallenge => Frame::AuthChallenge {
            nonce: r
                .take(crate::protocol::auth::NONCE_LEN)?
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
