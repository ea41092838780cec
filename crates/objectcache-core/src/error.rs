//! Error types shared by the whole crate.
//!
//! Errors are *semantic*: a caller matches on the variant, never on the message.
//! - [`StoreError`]: what a storage backend reports (missing object, precondition failed, ...).
//! - [`LayerError`]: why one layer of a load is a miss. A failed layer is never handed out as bytes.
//! - [`Error`]: the crate-level error for API calls (bad input, configuration, store failures).
//! - [`BadSetting`]: a setting's value that does not parse.
#![forbid(unsafe_code)]

use std::fmt;

/// A setting's value that does not parse: which setting, the value given and the forms
/// accepted (for example a tier admission policy, `TierConfig`'s `admission`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting} {value:?}: expected {expected}")]
pub struct BadSetting {
    /// The setting's name, as a user writes it.
    pub setting: &'static str,
    /// The value as given.
    pub value: String,
    /// The forms accepted.
    pub expected: &'static str,
}

/// What a storage backend (`objectcache::store::Store`) reports.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreError {
    /// No object under this key (HTTP 404 on S3).
    #[error("object not found: {key}")]
    NotFound {
        /// The key that was asked for.
        key: String,
    },
    /// A create-only put found an object already under this key (HTTP 412 on S3 with
    /// `If-None-Match: *`).
    #[error("object already exists: {key}")]
    AlreadyExists {
        /// The key that was written.
        key: String,
    },
    /// A conditional request's precondition did not hold (other than create-only).
    #[error("precondition failed for {key}")]
    Precondition {
        /// The key.
        key: String,
    },
    /// The requested byte range lies outside the object.
    #[error("range {start}..{end} is outside object {key} of {size} bytes")]
    InvalidRange {
        /// The key.
        key: String,
        /// First byte asked for.
        start: u64,
        /// One past the last byte asked for.
        end: u64,
        /// The object's size in bytes.
        size: u64,
    },
    /// The key is not acceptable (empty, `..` segment, absolute, control bytes, too long).
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey {
        /// The key as given.
        key: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// Credentials were refused (HTTP 403).
    #[error("permission denied by {backend}: {message}")]
    PermissionDenied {
        /// Backend name.
        backend: &'static str,
        /// Server's message.
        message: String,
    },
    /// The operation is not supported by this backend.
    #[error("{operation} is not implemented by {backend}")]
    NotImplemented {
        /// Operation name.
        operation: &'static str,
        /// Backend name.
        backend: &'static str,
    },
    /// The backend did not answer within its timeout (after bounded retries).
    #[error("{backend} timed out: {message}")]
    Timeout {
        /// Backend name.
        backend: &'static str,
        /// What timed out.
        message: String,
    },
    /// The endpoint does not behave as ObjectCache needs (e.g. it ignores `If-None-Match: *`
    /// on PUT, so first-writer-wins publication cannot be guaranteed); the message names the
    /// behaviour seen. Final for the endpoint: retrying does not help.
    #[error("{backend} is not usable for this operation: {message}")]
    Incompatible {
        /// Backend name.
        backend: &'static str,
        /// What the endpoint did, and what was expected.
        message: String,
    },
    /// Any other backend failure (I/O error, HTTP 5xx after retries, transport error).
    #[error("{backend}: {message}")]
    Other {
        /// Backend name.
        backend: &'static str,
        /// Human-readable description, including the HTTP status where there is one.
        message: String,
    },
}

impl StoreError {
    /// Builds [`StoreError::Other`] from any displayable error.
    pub fn other(backend: &'static str, e: impl fmt::Display) -> Self {
        StoreError::Other {
            backend,
            message: e.to_string(),
        }
    }
}

/// Why one layer of a load is a miss. The connector never marks such a layer ready.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayerError {
    /// A chunk object this layer needs is missing.
    #[error("chunk {chunk} is missing: {key}")]
    Missing {
        /// Chunk index in the request (0 = first chunk of the prefix).
        chunk: usize,
        /// Object key.
        key: String,
    },
    /// A slice's CRC32C did not match its bytes.
    #[error("checksum mismatch in chunk {chunk} layer {layer}: stored {stored:08x}, computed {computed:08x}")]
    ChecksumMismatch {
        /// Chunk index in the request.
        chunk: usize,
        /// Layer index.
        layer: usize,
        /// CRC32C stored in the object.
        stored: u32,
        /// CRC32C computed over the bytes received.
        computed: u32,
    },
    /// The object was written for another model, geometry, layout or format version.
    #[error("chunk {chunk} has the wrong geometry or format: {reason}")]
    GeometryMismatch {
        /// Chunk index in the request.
        chunk: usize,
        /// What differs.
        reason: String,
    },
    /// The storage or transport failed after bounded retries.
    #[error("chunk {chunk}: storage error: {message}")]
    Storage {
        /// Chunk index in the request.
        chunk: usize,
        /// The underlying error, as text.
        message: String,
    },
    /// The layer did not arrive before the load's deadline.
    #[error("layer {layer} timed out")]
    Timeout {
        /// Layer index.
        layer: usize,
    },
    /// Nothing arrived for the load for longer than its stall limit (the engine's
    /// `stall_timeout_ms`): the storage, the server or the network stopped sending, so the
    /// layers still missing were given up at once instead of at the load's deadline.
    #[error("stalled: nothing arrived for {idle_ms} ms (stall limit {limit_ms} ms) at {store}")]
    Stalled {
        /// How long nothing had arrived, milliseconds.
        idle_ms: u64,
        /// The stall limit in force then, milliseconds.
        limit_ms: u64,
        /// Where the load was reading from (the gather server or the store).
        store: String,
    },
    /// The load was cancelled before this layer was ready.
    #[error("load cancelled")]
    Cancelled,
    /// The layer arrived and was verified in host memory, but its copy to the device
    /// failed (feature `cuda`; see `crate::cuda`).
    #[error("layer {layer}: {message}")]
    Device {
        /// Layer index.
        layer: usize,
        /// The CUDA driver's error, as text.
        message: String,
    },
}

/// Crate-level error for API calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller passed something invalid; the message names what.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Configuration could not be parsed or is inconsistent.
    #[error("configuration error: {0}")]
    Config(String),
    /// An object's bytes are not a valid KV object of the expected geometry/format.
    #[error("invalid object: {0}")]
    Format(#[from] crate::layout::FormatError),
    /// A storage backend failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A load's layer failed (see [`LayerError`]).
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// An I/O error outside any store (e.g. binding a socket).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The object is in use and cannot be changed now (registered memory that a load still
    /// writes into); the message says by what.
    #[error("busy: {0}")]
    Busy(String),
    /// Not supported by this build or machine (device memory without the `cuda` feature or
    /// without a CUDA driver); the message says what is missing.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// Crate-level result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a storage backend's operations return: `T`, or the [`StoreError`] that says what
/// failed. One name for the return type every `Store` method and helper spells, so a
/// method's signature shows its arguments rather than the error type.
pub type StoreResult<T> = std::result::Result<T, StoreError>;

/// What a step of one layer's load returns (a sink's write, a transport's delivery): `T`, or
/// the [`LayerError`] that makes that layer a miss.
pub type LayerResult<T> = std::result::Result<T, LayerError>;
