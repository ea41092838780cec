//! # ObjectCache core
//!
//! The pure core of ObjectCache: every rule about bytes, wire frames and bandwidth, with no
//! I/O, no clock and no async runtime (this crate does not depend on tokio, and forbids
//! unsafe code). The shells live in the crates above it: `objectcache-client` (stores,
//! transports, the connector engine), `objectcache-server` (the storage server and gather),
//! `objectcache-capi` (the C ABI) and `objectcache-cli` (the command line); the `objectcache`
//! crate re-exports them all, these modules at the same paths (`objectcache::layout`,
//! `objectcache::protocol`, ...).
//!
//! - [`layout`]: KV geometry, the chunk object format (layer-major slices, each with its own
//!   CRC32C), object keys, read planning;
//! - [`hash`]: vLLM-compatible block hashes;
//! - [`protocol`]: the gather wire format and the sans-IO connection state machines (client
//!   and server) that the TCP and RDMA drivers pump;
//! - [`sched`]: bandwidth scheduling across concurrent loads, the compute model, the planner;
//! - [`rdma`]: the RDMA write immediate and the client's per-layer completion tally (the
//!   verbs objects and drivers are in `objectcache-client`'s `transport::rdma` and
//!   `objectcache-server`'s gather over RDMA);
//! - [`sim`]: the deterministic discrete-event simulator of loads and clusters;
//! - [`error`]: the error types shared by every level.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod error;
pub mod hash;
pub mod layout;
pub mod protocol;
pub mod rdma;
pub mod sched;
pub mod sim;

pub use error::{BadSetting, Error, LayerError, Result, StoreError};
pub use layout::{
    ChunkHash, Dtype, EngineLayout, GroupKind, HashAlgo, KvGeometry, KvLayout, LayoutFamily,
    LayoutGroup,
};
