//! One storage trait, many backends (the `object_store` shape).
//!
//! [`Store`] has the required operations; [`StoreExt`] adds sugar on top for every store.
//! Backends: [`MemoryStore`], [`FsStore`] (the embedded default), and `S3Store` (feature `s3`).
//! Every backend passes the same conformance suite ([`conformance`]).
//!
//! Keys are `/`-separated UTF-8 strings checked by [`validate_key`], so that no key can escape
//! a filesystem root or confuse an S3 gateway.

pub mod conformance;
pub mod doctor;
mod fs;
#[cfg(feature = "s3")]
mod gateways;
mod memory;
mod metered;
mod range_body;
mod route;
#[cfg(feature = "s3")]
mod s3;
mod tier;
mod url;

pub use fs::{FsStore, FsyncPolicy};
#[cfg(feature = "s3")]
pub use gateways::{EndpointStatus, GatewayOptions, GatewayStore};
pub use memory::MemoryStore;
pub use metered::{MeteredStats, MeteredStore};
pub use range_body::{RangeBody, RangeRead};
pub use route::{EndpointEvent, Gateways, GatherTarget};
#[cfg(feature = "s3")]
pub use s3::{Addressing, S3Config, S3Credentials, S3Store};
pub use tier::{
    tiered_key, Admission, LevelCounters, LevelStats, TierConfig, TierLevel, TierStats, TieredStore,
};
#[cfg(feature = "s3")]
pub use url::parse_s3_url;
pub use url::{open_existing_store, open_store, shared_identity};

use crate::error::{StoreError, StoreResult};
use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use std::ops::Range;
use std::time::SystemTime;

/// Longest key accepted, in bytes (S3's limit is 1,024).
pub const MAX_KEY_LEN: usize = 1024;

/// Checks a key: 1 to 1,024 bytes, no leading `/`, no empty, `.` or `..` segment, no control
/// bytes or backslash.
///
/// # Errors
/// [`StoreError::InvalidKey`] naming the rule broken.
pub fn validate_key(key: &str) -> StoreResult<()> {
    let bad = |reason| {
        Err(StoreError::InvalidKey {
            key: key.to_string(),
            reason,
        })
    };
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return bad("must be 1 to 1024 bytes");
    }
    if key.bytes().any(|c| c < 0x20 || c == 0x7f || c == b'\\') {
        return bad("control characters and backslashes are not allowed");
    }
    for seg in key.split('/') {
        if seg.is_empty() || seg == "." || seg == ".." {
            return bad("empty, '.' or '..' path segments are not allowed");
        }
    }
    Ok(())
}

/// Metadata of a stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// Full key.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// Last modification (write) time, where the backend knows it.
    pub last_modified: Option<SystemTime>,
    /// Entity tag, where the backend has one.
    pub etag: Option<String>,
}

/// Options of [`Store::get_opts`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GetOptions {
    /// Byte range to read (`start..end`, end exclusive); `None` reads the whole object.
    /// A range reaching past the end is an [`StoreError::InvalidRange`], not a short read.
    pub range: Option<Range<u64>>,
}

/// Body of a get: a stream of byte chunks, in order.
pub type ByteStream = BoxStream<'static, StoreResult<Bytes>>;

/// Result of [`Store::get_opts`].
pub struct GetResult {
    /// The object's metadata (size is the whole object's size).
    pub meta: ObjectMeta,
    /// The byte range being returned.
    pub range: Range<u64>,
    /// The bytes of `range`, as a stream.
    pub body: ByteStream,
}

impl std::fmt::Debug for GetResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GetResult")
            .field("meta", &self.meta)
            .field("range", &self.range)
            .finish_non_exhaustive()
    }
}

impl GetResult {
    /// The result of reading `range` of an object held in memory as `data` (its whole
    /// bytes): the range checked against its size, the slice as a one-part body.
    ///
    /// # Errors
    /// [`StoreError::InvalidRange`] when `range` does not lie within `data`.
    pub fn in_memory(
        meta: ObjectMeta,
        data: &Bytes,
        range: Option<Range<u64>>,
    ) -> StoreResult<GetResult> {
        let range = resolve_range(&meta.key, range, data.len() as u64)?;
        let part = data.slice(range.start as usize..range.end as usize);
        Ok(GetResult {
            meta,
            range,
            body: Box::pin(futures::stream::once(async move { Ok(part) })),
        })
    }

    /// Collects the body into one buffer, checking it has exactly `range.len()` bytes.
    ///
    /// # Errors
    /// The stream's error, or [`StoreError::Other`] if the body is shorter or longer than
    /// the range (a truncated body is never returned as data).
    pub async fn bytes(mut self) -> StoreResult<Bytes> {
        let want = self.range.end - self.range.start;
        let mut parts = Vec::new();
        while let Some(chunk) = self.body.next().await {
            parts.push(chunk?);
        }
        let out = if parts.len() == 1 {
            parts.pop().expect("one part")
        } else {
            let mut v = Vec::with_capacity(want as usize);
            parts.iter().for_each(|p| v.extend_from_slice(p));
            Bytes::from(v)
        };
        if out.len() as u64 != want {
            return Err(StoreError::Other {
                backend: "store",
                message: format!(
                    "body of {} has {} bytes, expected {}",
                    self.meta.key,
                    out.len(),
                    want
                ),
            });
        }
        Ok(out)
    }
}

/// How [`Store::put_opts`] treats an existing object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PutMode {
    /// Replace any existing object.
    #[default]
    Overwrite,
    /// Write only if absent (S3 `If-None-Match: *`); otherwise [`StoreError::AlreadyExists`].
    Create,
}

/// A name no other probe of any process uses: `<pid>-<nanos since the epoch>-<seq>`, with a
/// process-wide sequence number beside the time, for the keys of the store probes (the S3
/// store's conditional-PUT check, the self-check of [`doctor`]).
pub(crate) fn probe_id() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{}-{nanos}-{}",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// Options of [`Store::put_opts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Overwrite or create-only.
    pub mode: PutMode,
}

/// Outcome of a successful put.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutResult {
    /// Entity tag, where the backend returns one.
    pub etag: Option<String>,
}

/// An object opened as a local file ([`Store::open_local`]): a server can send its bytes to a
/// socket with `sendfile(2)`, with no copy through user space, or map them into memory (its
/// S3 GET bodies). Objects are immutable once written (puts replace them by rename), so the
/// open file keeps the bytes it had.
///
/// Made only by [`LocalObject::new`], whose contract (the file never changes or shrinks) is
/// what memory-mapping it relies on for soundness.
#[derive(Debug)]
pub struct LocalObject {
    file: std::fs::File,
    meta: ObjectMeta,
}

impl LocalObject {
    /// An object's open file and its metadata.
    ///
    /// # Safety
    /// `file` (opened read-only) is never written to, truncated or otherwise shortened while
    /// this value or anything taken from it lives: a server maps its pages into memory and
    /// lends them out as immutable bytes. `meta.size` is the file's length in bytes. A store
    /// keeps this by never opening an object's file for writing once it is committed
    /// (replacing an object renames a new file over its name, deleting unlinks the name; the
    /// open inode keeps its bytes), and owns its directory: no other program rewrites it.
    #[allow(unsafe_code)] // the contract above; nothing unsafe is done here
    pub unsafe fn new(file: std::fs::File, meta: ObjectMeta) -> Self {
        LocalObject { file, meta }
    }

    /// The open file (read-only).
    pub fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// The object's metadata; `size` is the file's length in bytes.
    pub fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    /// The file and the metadata. The file is still under [`LocalObject::new`]'s contract:
    /// code that maps it takes the `LocalObject`, never a bare file.
    pub fn into_parts(self) -> (std::fs::File, ObjectMeta) {
        (self.file, self.meta)
    }
}

/// An object store. Every method is cancel-safe: dropping its future leaves either the old or
/// the new object, never a partial one.
#[async_trait]
pub trait Store: std::any::Any + Send + Sync + std::fmt::Debug {
    /// Short backend name for errors and metrics (`memory`, `fs`, `s3`, ...).
    fn name(&self) -> &'static str;

    /// Opens an object as a local file, for backends that keep objects in files (the `fs`
    /// backend); `Ok(None)` for the others (the default), which are read with
    /// [`Store::get_opts`].
    ///
    /// # Errors
    /// [`StoreError::NotFound`], [`StoreError::InvalidKey`], or a backend failure.
    async fn open_local(&self, key: &str) -> StoreResult<Option<LocalObject>> {
        let _ = key;
        Ok(None)
    }

    /// [`Store::open_local`] on the calling thread, for callers already on a blocking thread
    /// (the server's gather opens a load's chunk files one after another in one blocking
    /// task, rather than one trip to the blocking pool per chunk). Same results as
    /// [`Store::open_local`]; `Ok(None)` for backends without local files (the default).
    ///
    /// # Errors
    /// As [`Store::open_local`].
    fn open_local_blocking(&self, key: &str) -> StoreResult<Option<LocalObject>> {
        let _ = key;
        Ok(None)
    }

    /// Starts a ranged read whose bytes the caller reads into its own memory
    /// ([`RangeBody::read`]), for backends that can (the S3 backend at a plain-`http://`
    /// endpoint reads the response body straight from its connection); `Ok(None)` where the
    /// backend cannot, or declines this one read (the default), and the caller reads with
    /// [`Store::get_opts`] instead, which names any error. `range` is not empty.
    ///
    /// # Errors
    /// [`StoreError::InvalidKey`]; a backend may also return its errors here, as
    /// [`Store::get_opts`] would.
    async fn get_range_body(&self, key: &str, range: Range<u64>) -> StoreResult<Option<RangeBody>> {
        let _ = (key, range);
        Ok(None)
    }

    /// Reads an object or a byte range of it.
    ///
    /// # Errors
    /// [`StoreError::NotFound`], [`StoreError::InvalidRange`], [`StoreError::InvalidKey`], or a
    /// backend failure.
    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult>;

    /// Writes a whole object atomically: readers see the old object or the new one.
    ///
    /// # Errors
    /// [`StoreError::AlreadyExists`] with [`PutMode::Create`] when the key exists;
    /// [`StoreError::InvalidKey`]; a backend failure.
    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult>;

    /// Writes a whole object from a stream of its bytes, atomically like
    /// [`Store::put_opts`]: readers see the old object or the whole new one, never part of
    /// it. If `body` yields an error, or this future is dropped, nothing is written and the
    /// error is returned. `len` is the object's length when known in advance (a body of
    /// another length fails); backends that must declare it up front need it to stream.
    ///
    /// The default collects the body in memory, then calls [`Store::put_opts`] with a copy,
    /// keeping the pieces until it returns (the memory store and the gateway store use it);
    /// the filesystem backend writes each piece to its temporary file as it arrives, and the
    /// S3 backend streams the body upstream when `len` is known, so a large object is never
    /// held whole.
    ///
    /// # Errors
    /// As [`Store::put_opts`]; the body's own error; a length other than `len`.
    async fn put_stream(
        &self,
        key: &str,
        body: ByteStream,
        len: Option<u64>,
        opts: PutOptions,
    ) -> StoreResult<PutResult> {
        put_collected(self, key, body, len, opts).await
    }

    /// Incomplete writes under `prefix` this store keeps outside its objects (temporary
    /// files of a writer that was killed, or is still writing): never listed as objects,
    /// but they hold space, so `objectcache stat` counts them and `gc` reclaims them
    /// ([`Store::delete_partial`]). Default: none.
    ///
    /// # Errors
    /// A backend failure.
    async fn list_partial(&self, prefix: &str) -> StoreResult<Vec<PartialWrite>> {
        let _ = prefix;
        Ok(Vec::new())
    }

    /// Deletes one incomplete write found by [`Store::list_partial`] (a write still in
    /// progress then fails, and writes nothing). Deleting one that is gone succeeds.
    ///
    /// # Errors
    /// A backend failure.
    async fn delete_partial(&self, partial: &PartialWrite) -> StoreResult<()> {
        let _ = partial;
        Ok(())
    }

    /// Metadata of an object.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] or a backend failure.
    async fn head(&self, key: &str) -> StoreResult<ObjectMeta>;

    /// Deletes an object; deleting a missing key succeeds (S3 semantics).
    ///
    /// # Errors
    /// A backend failure.
    async fn delete(&self, key: &str) -> StoreResult<()>;

    /// Lists objects whose key starts with `prefix`, in lexicographic key order, following
    /// pagination to the end (at most `limit` objects).
    ///
    /// # Errors
    /// A backend failure.
    async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>>;
}

/// An incomplete write a store holds outside its objects ([`Store::list_partial`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialWrite {
    /// Where it lies, in the store's own terms (for the filesystem store, the temporary
    /// file's path relative to the root); not an object key.
    pub id: String,
    /// Bytes it holds.
    pub size: u64,
    /// When it was last written to.
    pub last_modified: Option<SystemTime>,
    /// `true` when its writer is known to be gone (a process of this host that no longer
    /// runs): it can never complete, whatever its age.
    pub orphaned: bool,
}

/// [`Store::put_stream`] by collecting the body in memory, then one [`Store::put_opts`] of a
/// copy: the trait's default, and what a backend that streams only with a known length does
/// without one (the S3 backend).
///
/// # Errors
/// As [`Store::put_opts`]; the body's own error; a length other than `len`.
pub async fn put_collected<S: Store + ?Sized>(
    store: &S,
    key: &str,
    mut body: ByteStream,
    len: Option<u64>,
    opts: PutOptions,
) -> StoreResult<PutResult> {
    let mut parts = Vec::new();
    let mut got = 0u64;
    while let Some(p) = body.next().await {
        let p = p?;
        got += p.len() as u64;
        parts.push(p);
    }
    check_stream_len(key, got, len)?;
    // Always a fresh buffer: the pieces may belong to someone else (a server's request body
    // holds its memory budget until its pieces are dropped), and a store that keeps the
    // buffer (the memory store) must not keep them. The pieces are dropped only once the put
    // has returned, so a budget they hold also covers the copy while it is sent (at most
    // twice the budgeted bytes, never outside it).
    let mut v = Vec::with_capacity(got as usize);
    parts.iter().for_each(|p| v.extend_from_slice(p));
    let r = store.put_opts(key, Bytes::from(v), opts).await;
    drop(parts);
    r
}

/// Checks a streamed body's length against the length declared for it.
///
/// # Errors
/// [`StoreError::Other`] naming both lengths.
pub fn check_stream_len(key: &str, got: u64, len: Option<u64>) -> StoreResult<()> {
    match len {
        Some(n) if n != got => Err(StoreError::Other {
            backend: "store",
            message: format!("body of {key} has {got} bytes, {n} were declared"),
        }),
        _ => Ok(()),
    }
}

/// Whether a create-only put wrote the object or found one already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutIfAbsent {
    /// This call wrote the object.
    Written,
    /// An object was already present under the key (first writer wins); not an error.
    AlreadyPresent,
}

/// Sugar over [`Store`], implemented for every store.
#[async_trait]
pub trait StoreExt: Store {
    /// Reads a whole object into memory.
    ///
    /// # Errors
    /// As [`Store::get_opts`].
    async fn get_bytes(&self, key: &str) -> StoreResult<Bytes> {
        self.get_opts(key, GetOptions::default())
            .await?
            .bytes()
            .await
    }
    /// Reads `range` of an object into memory.
    ///
    /// # Errors
    /// As [`Store::get_opts`].
    async fn get_range(&self, key: &str, range: Range<u64>) -> StoreResult<Bytes> {
        self.get_opts(key, GetOptions { range: Some(range) })
            .await?
            .bytes()
            .await
    }
    /// Overwriting put.
    ///
    /// # Errors
    /// As [`Store::put_opts`].
    async fn put(&self, key: &str, data: Bytes) -> StoreResult<PutResult> {
        self.put_opts(key, data, PutOptions::default()).await
    }
    /// Create-only put that reports an existing object as [`PutIfAbsent::AlreadyPresent`].
    ///
    /// # Errors
    /// As [`Store::put_opts`], except `AlreadyExists`.
    async fn put_if_absent(&self, key: &str, data: Bytes) -> StoreResult<PutIfAbsent> {
        match self
            .put_opts(
                key,
                data,
                PutOptions {
                    mode: PutMode::Create,
                },
            )
            .await
        {
            Ok(_) => Ok(PutIfAbsent::Written),
            Err(StoreError::AlreadyExists { .. }) => Ok(PutIfAbsent::AlreadyPresent),
            Err(e) => Err(e),
        }
    }
    /// `true` if the object exists.
    ///
    /// # Errors
    /// A backend failure other than not-found.
    async fn exists(&self, key: &str) -> StoreResult<bool> {
        match self.head(key).await {
            Ok(_) => Ok(true),
            Err(StoreError::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl<T: Store + ?Sized> StoreExt for T {}

/// Checks a requested range against an object size; returns the effective range.
///
/// # Errors
/// [`StoreError::InvalidRange`] if `r` is empty-inverted or reaches past `size`.
pub fn resolve_range(key: &str, r: Option<Range<u64>>, size: u64) -> StoreResult<Range<u64>> {
    match r {
        None => Ok(0..size),
        Some(r) if r.start <= r.end && r.end <= size => Ok(r),
        Some(r) => Err(StoreError::InvalidRange {
            key: key.to_string(),
            start: r.start,
            end: r.end,
            size,
        }),
    }
}
