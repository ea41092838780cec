//! # objectcache-client
//!
//! The client side of ObjectCache over the pure core (`objectcache-core`): the stores, the
//! transports, the link scheduler's tokio shell, the connector engine (save, lookup, layer-
//! ordered load) and the lifecycle passes. It contains neither the server nor the C ABI; the
//! compiler keeps it that way (they are the crates `objectcache-server` and
//! `objectcache-capi`, above this one).
//! Users depend on the façade crate `objectcache`, which re-exports this crate at the same paths
//! (`objectcache::connector::Engine`, `objectcache::KvGeometry`, ...); see
//! `docs/architecture.md`.
//!
//! - **pure core**, re-exported: [`layout`], [`hash`], [`protocol`], [`sched`], [`sim`],
//!   [`error`];
//! - **shells** (I/O): [`store`] (one trait, many backends), [`transport`] (TCP, RDMA drivers),
//!   `link` (pacing by credit), `cuda` (feature `cuda`);
//! - **composition**: [`connector`] (the client engine), [`lifecycle`] (GC, TTL, eviction).
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod connector;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod lifecycle;
#[doc(hidden)]
pub mod link;
pub mod store;
pub mod transport;

pub use objectcache_core::{error, hash, layout, protocol, sched, sim};

pub use error::{Error, LayerError, LayerResult, Result, StoreError, StoreResult};
pub use layout::{ChunkHash, Dtype, HashAlgo, KvGeometry, KvLayout};
