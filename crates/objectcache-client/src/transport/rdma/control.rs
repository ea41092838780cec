//! The TCP control channel: connection set-up (QP numbers, GIDs, PSNs) and per-load requests
//! carrying the client's registered destination (address, rkey, length per layer).
//!
//! Framing: a 4-byte big-endian length, then that many bytes of JSON (one [`Msg`]). Frames
//! above [`MAX_FRAME`] bytes are refused. This is the minimal exchange the RDMA path needs
//! on its own; the gather protocol's descriptor can carry the same [`LayerTarget`]s.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use super::{RdmaError, Result};

/// The 8 bytes a client sends first when it opens the RDMA set-up channel on an ObjectCache
/// server's gather port (the server tells them apart from `OCGATHER` and from HTTP). The
/// JSON frames below follow.
pub const PREFACE: [u8; 8] = *b"OCRDMA01";

/// Reason a server gives in [`Msg::Done`] for layers it stopped on a client's
/// [`Msg::Cancel`].
pub const CANCELLED: &str = "cancelled by the client";

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

/// Where one layer of a load lands in the client's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerTarget {
    /// Layer index in the model.
    pub layer: u32,
    /// Remote virtual address of the layer's first byte.
    pub addr: u64,
    /// Remote key of the memory region holding it.
    pub rkey: u32,
    /// Bytes: `units x unit_len` (chunks x slice bytes, CRC excluded).
    pub len: u64,
}

/// What to load: chunk objects in prefix order (unit `u` = chunk `keys[u]`), the slice length
/// of one layer of one chunk (K+V bytes, CRC excluded) and the layers in the order the
/// scheduler wants them delivered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// Object keys of the chunks, first chunk of the prefix first.
    pub keys: Vec<String>,
    /// One layer's K+V bytes of one chunk (`KvGeometry::slice_bytes`).
    pub slice_len: u64,
    /// Layers to deliver, in delivery order.
    pub layers: Vec<u32>,
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
        /// `true`: a session for gather requests (loads arrive as gather descriptors with an
        /// RDMA target on the gather port; this channel then only keeps the session alive).
        #[serde(default)]
        gather: bool,
    },
    /// Server → client: the server's QPs (already RTS), paired by position.
    Welcome {
        /// One endpoint per client QP.
        endpoints: Vec<Endpoint>,
        /// Session token a gather descriptor names (0 for a plain session).
        #[serde(default)]
        session: u64,
    },
    /// Server → client: set-up refused (no device, version mismatch); the text says why.
    Refuse {
        /// Reason.
        reason: String,
    },
    /// Client → server: deliver `spec` into `targets` under load slot `slot`.
    Load {
        /// Load slot (see [`super::Imm`]).
        slot: u32,
        /// What to load.
        spec: LoadSpec,
        /// Destination of each layer in `spec.layers`, same order.
        targets: Vec<LayerTarget>,
    },
    /// Server → client: every write of load `slot` has completed, except the listed layers,
    /// which are misses (with the reason).
    Done {
        /// Load slot.
        slot: u32,
        /// `(layer, reason)` of each layer the server could not deliver.
        failed: Vec<(u32, String)>,
        /// RDMA_WRITE_WITH_IMM operations of this load that completed successfully; the client
        /// reuses the slot only after it has seen as many receive completions (its receive
        /// completions may trail this message).
        writes: u64,
    },
    /// Client → server: stop load `slot` (units not yet posted are skipped; the server still
    /// answers with [`Msg::Done`], after which no write of that load can land).
    Cancel {
        /// Load slot.
        slot: u32,
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
