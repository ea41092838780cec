//! # ObjectCache
//!
//! Layerwise object-storage retrieval of prefix KV cache for LLM serving.
//!
//! ObjectCache keeps the KV cache of prompt prefixes in S3-compatible object storage (or on a
//! local disk) and loads it back **layer by layer, in the order prefill consumes it**, so that
//! most of the fetch hides behind compute. One object per (chunk, TP rank) holds all layers
//! layer-major; one layer's slice of a chunk is one byte range carrying its own CRC32C.
//!
//! What it does *not* do: run the model, manage GPU memory pools, or decide eviction inside the
//! engine. It stores, finds and delivers KV bytes; the engine owns compute.
//!
//! ## Crates by level (see `docs/architecture.md`)
//! This crate is the façade over the workspace's crates, re-exporting them at these paths:
//! `objectcache-core` (the pure core), `objectcache-client` (shells and connector),
//! `objectcache-capi` (the C ABI), `objectcache-server` (feature `server`) and
//! `objectcache-cli` (feature `cli`). It builds the C library (`libobjectcache`, cdylib and
//! staticlib) from the C ABI crate's exports, and the `objectcache` binary over the CLI crate.
//!
//! - **pure core** (no I/O, no clock): [`layout`] (geometry, object format, keys, read planning),
//!   [`hash`] (vLLM-compatible block hashes), [`protocol`] (gather wire format),
//!   [`sched`] (bandwidth scheduling, compute model, planner), [`sim`] (discrete-event simulator);
//! - **shells** (I/O): [`store`] (one trait, many backends), [`transport`] (TCP, RDMA drivers),
//!   `cuda` (feature `cuda`: per-layer copies from pinned staging into device memory);
//! - **composition**: [`connector`] (the client engine: save, lookup, load), [`server`];
//! - **edges**: [`capi`] (C ABI), `cli` (feature `cli`: the `objectcache` binary).
#![warn(missing_docs)]
#![deny(unsafe_code)]

#[cfg(feature = "cli")]
pub use objectcache_cli as cli;
#[cfg(feature = "server")]
pub use objectcache_server as server;

pub use objectcache_capi as capi;
#[cfg(feature = "cuda")]
pub use objectcache_client::cuda;
pub use objectcache_client::{conformance_tests, connector, lifecycle, store, transport};

pub use objectcache_core::{error, hash, layout, protocol, sched, sim};

pub use error::{Error, LayerError, LayerResult, Result, StoreError, StoreResult};
pub use layout::{ChunkHash, Dtype, HashAlgo, KvGeometry, KvLayout};
