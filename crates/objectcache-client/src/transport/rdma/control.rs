//! The RDMA set-up channel on the gather port: QP numbers, GIDs and PSNs exchanged once per
//! session ([`Msg::Hello`], [`Msg::Welcome`]), then nothing but the goodbye. Loads travel as
//! gather descriptors whose RDMA target names the session (`protocol::RdmaTarget`).
//!
//! Framing: a 4-byte big-endian length, then that many bytes of JSON (one [`Msg`]). Frames
//! above [`MAX_FRAME`] bytes are refused.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use super::{RdmaError, Result};

/// The 8 bytes a client sends first when it opens the RDMA set-up channel on an ObjectCache
/// server's gather port (the server tells them apart from `OCGATHER` and from HTTP). The
/// JSON frames below follow.
pub const PREFACE: [u8; 8] = *b"OCRDMA01";

/// Control protocol version sent in [`Msg::Hello`].
pub const VERSION: u32 = 1;
/// Largest control frame in bytes (16 MiB).
pub const MAX_FRAME: u32 = 16 << 20;

/// One side of an RC connection, as exchanged before bring-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// QP number (24 bits).
    pub qpn: u32,
    /// Starting packet sequence number (24 bits).
    pub psn: u32,
    /// 16-byte GID (RoCE: the IPv6 or IPv4-mapped address of the port).
    pub gid: [u8; 16],
    /// LID (InfiniBand only; 0 on RoCE).
    pub lid: u16,
    /// Active MTU of the port in bytes.
    pub mtu: u32,
}

/// A control-channel message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Client → server: version and the client's QPs (in INIT, receives posted).
    Hello {
        /// [`VERSION`].
        version: u32,
        /// One endpoint per QP.
        endpoints: Vec<Endpoint>,
        /// A session for gather requests (loads arrive as gather descriptors with an RDMA
        /// target on the gather port; this channel then only keeps the session alive). Always
        /// `true`: the server refuses a `Hello` without it.
        #[serde(default)]
        gather: bool,
    },
    /// Server → client: the server's QPs (already RTS), paired by position.
    Welcome {
        /// One endpoint per client QP.
        endpoints: Vec<Endpoint>,
        /// Session token a gather descriptor names (never 0).
        #[serde(default)]
        session: u64,
    },
    /// Server → client: set-up refused (no device, version mismatch); the text says why.
    Refuse {
        /// Reason.
        reason: String,
    },
    /// Client → server: orderly close.
    Bye,
}

/// Writes one frame.
///
/// # Errors
/// [`RdmaError::Io`] on socket errors; [`RdmaError::Protocol`] if the frame is too large.
pub fn send(w: &mut impl Write, msg: &Msg) -> Result<()> {
    let body = serde_json::to_vec(msg).map_err(|e| RdmaError::Protocol(format!("encode: {e}")))?;
    if body.len() > MAX_FRAME as usize {
        return Err(RdmaError::Protocol(format!(
            "frame of {} bytes exceeds {MAX_FRAME}",
            body.len()
        )));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame; `Ok(None)` on a clean end of stream before a frame starts.
///
/// # Errors
/// [`RdmaError::Io`] on socket errors or a stream cut inside a frame; [`RdmaError::Protocol`]
/// for an oversized frame or JSON that is not a [`Msg`].
pub fn recv(r: &mut impl Read) -> Result<Option<Msg>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..])?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(RdmaError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        got += n;
    }
    let len = u32::from_be_bytes(len);
    if len > MAX_FRAME {
        return Err(RdmaError::Protocol(format!(
            "frame of {len} bytes exceeds {MAX_FRAME}"
        )));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|e| RdmaError::Protocol(format!("bad frame: {e}")))
}
