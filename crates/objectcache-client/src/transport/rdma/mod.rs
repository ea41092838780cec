//! RDMA data path (feature `rdma`): the server places each delivery unit straight into the
//! client's registered memory with one-sided `RDMA_WRITE_WITH_IMM` over RC queue pairs.
//!
//! Layout of this module (one file per verbs object; every `unsafe` block lives here and
//! carries a `// SAFETY:` comment):
//! - [`context`]: device list, opened device context, port and GID selection;
//! - [`pd`]: protection domain;
//! - [`mr`]: page-aligned host buffers, memory regions and the [`RegistrationCache`]
//!   (a destination buffer is registered once and reused by later loads);
//! - [`cq`]: completion queues and work completions;
//! - [`qp`]: RC queue pairs with a typestate bring-up (`Reset → Init → Rtr → Rts`);
//! - [`imm`]: the 32-bit immediate that names (load slot, layer, unit): pure code, in
//!   `objectcache_core::rdma` with the client's per-layer completion tally, re-exported here;
//! - [`control`]: the set-up channel (QP numbers, GIDs, PSNs);
//! - [`session`] / [`gather`]: the data path under the gather protocol (server and client
//!   end): set-up on the gather port, loads as gather descriptors with an RDMA target;
//!   [`client`]: the client's queue pairs, registrations and completions;
//!
//! Failure model: a QP error, a remote disconnect or a load deadline turns every layer that
//! is not complete into a miss through [`crate::transport::LayerSink::fail`]; no call waits
//! without a deadline. Because a late one-sided write could still land in a buffer the caller
//! has reused, a timed-out or failed connection is *broken*: its QPs are moved to the error
//! state and drained before any layer is reported failed, and the client must reconnect.
//! Moving a QP to the error state makes it drop every packet that arrives afterwards; the
//! drain (a marker receive posted after the transition, whose flush completion comes after
//! every packet the QP took before it) waits out a write the responder was still placing.
//! Only then do the sinks hear the misses, so memory handed back to the engine after a
//! give-up (deadline, stall limit, cancel by drop, QP error, shutdown) is never written by
//! the server again. A per-load memory window would allow the same without breaking the
//! session, but not every device offers type-2 windows (rxe does; many RoCE NICs' user
//! drivers do not), and a give-up is rare enough that a new session (a few milliseconds)
//! costs nothing that matters.
#![allow(unsafe_code)]

pub mod client;
pub mod context;
pub mod control;
pub mod cq;
pub mod gather;
pub use objectcache_core::rdma::imm;
pub mod mr;
pub mod pd;
pub mod qp;
pub mod session;

pub use client::{ClientConfig, LayerDest, LayerPlan, LoadHandle, LoadOutcome, RdmaClient};
pub use context::{devices, select_transport, Context, DeviceSelector, TransportChoice};
pub use control::Endpoint;
pub use cq::{Completion, CompletionQueue};
pub use gather::{GatherConn, RdmaGatherError};
pub use imm::Imm;
pub use mr::{HostBuffer, MemoryRegion, RegistrationCache};
pub use pd::ProtectionDomain;
pub use qp::{Init, QueuePair, Reset, Rtr, Rts};
pub use session::{GatherSession, ServerConfig, SessionRegistry};

/// What the RDMA layer reports.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// No usable RDMA device: none present, the named one is missing, or the kernel has no
    /// RDMA support (`ibv_get_device_list` fails with `ENOSYS`). Callers fall back to TCP.
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// A verbs call failed; `errno` is the OS error it reported.
    #[error("{op} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    Verbs {
        /// The verbs function that failed.
        op: &'static str,
        /// The errno it returned or set.
        errno: i32,
    },
    /// The argument is not acceptable (size, layer or unit out of range); the message names it.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The peer sent something that does not follow the control protocol.
    #[error("control protocol error: {0}")]
    Protocol(String),
    /// The connection is broken (QP error, remote disconnect, earlier timeout); reconnect.
    #[error("RDMA connection broken: {0}")]
    Broken(String),
    /// Socket I/O on the control channel failed.
    #[error("control channel I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl RdmaError {
    /// Builds [`RdmaError::Verbs`] from the calling thread's `errno` (or `ret` when the call
    /// returned a positive errno, as `ibv_modify_qp` and `ibv_post_send` do).
    pub(crate) fn verbs(op: &'static str, ret: i32) -> Self {
        let errno = if ret > 0 {
            ret
        } else {
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        };
        RdmaError::Verbs { op, errno }
    }
}

/// Result alias for this module.
pub type Result<T, E = RdmaError> = std::result::Result<T, E>;
