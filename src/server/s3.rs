//! The S3 API over a [`Store`], through the `s3s` crate (request parsing, SigV4 checks,
//! XML responses). Buckets are key prefixes of the store: object `k` of bucket `b` is store
//! key `b/k`; the bucket registry lives under `_buckets/` (`_` cannot start a bucket name, so
//! no bucket collides with it).

use super::budget::{Budget, Hold};
use super::conn::{PollFloor, RateFloor};
use crate::error::StoreError;
use crate::store::{validate_key, GetOptions, PutMode, PutOptions, Store, StoreExt};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use s3s::dto::*;
use s3s::{s3_error, S3Error, S3Request, S3Response, S3Result, S3};
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

/// Store key prefix of the bucket registry.
const BUCKETS_PREFIX: &str = "_buckets/";

/// The set of buckets, cached in memory and persisted in the store (so a gateway restarted
/// over the same upstream sees its buckets again).
#[derive(Debug)]
pub struct Buckets {
    store: Arc<dyn Store>,
    known: RwLock<HashMap<String, SystemTime>>,
}

impl Buckets {
    /// Loads the registry from `store`.
    ///
    /// # Errors
    /// The store's list error.
    pub async fn load(store: Arc<dyn Store>) -> Result<Self, StoreError> {
        let mut known = HashMap::new();
        for m in store.list(BUCKETS_PREFIX, usize::MAX).await? {
            let name = m.key[BUCKETS_PREFIX.len()..].to_string();
            known.insert(name, m.last_modified.unwrap_or(SystemTime::UNIX_EPOCH));
        }
        Ok(Buckets {
            store,
            known: RwLock::new(known),
        })
    }

    /// `true` if the bucket exists (consulting the store on a cache miss).
    pub async fn exists(&self, name: &str) -> Result<bool, StoreError> {
        if self.known.read().expect("lock").contains_key(name) {
            return Ok(true);
        }
        match self.store.head(&format!("{BUCKETS_PREFIX}{name}")).await {
            Ok(m) => {
                self.known.write().expect("lock").insert(
                    name.into(),
                    m.last_modified.unwrap_or(SystemTime::UNIX_EPOCH),
                );
                Ok(true)
            }
            Err(StoreError::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Creates a bucket; `Ok(false)` if it already existed.
    ///
    /// # Errors
    /// A store failure.
    pub async fn create(&self, name: &str) -> Result<bool, StoreError> {
        let r = self
            .store
            .put_if_absent(&format!("{BUCKETS_PREFIX}{name}"), Bytes::new())
            .await?;
        self.known
            .write()
            .expect("lock")
            .entry(name.into())
            .or_insert_with(SystemTime::now);
        Ok(r == crate::store::PutIfAbsent::Written)
    }

    async fn remove(&self, name: &str) -> Result<(), StoreError> {
        self.store
            .delete(&format!("{BUCKETS_PREFIX}{name}"))
            .await?;
        self.known.write().expect("lock").remove(name);
        Ok(())
    }

    fn list(&self) -> Vec<(String, SystemTime)> {
        let mut v: Vec<_> = self
            .known
            .read()
            .expect("lock")
            .iter()
            .map(|(k, t)| (k.clone(), *t))
            .collect();
        v.sort();
        v
    }
}

/// The S3 frontend: implements [`s3s::S3`] over a store.
#[derive(Debug, Clone)]
pub struct S3Frontend {
    store: Arc<dyn Store>,
    buckets: Arc<Buckets>,
    max_object_bytes: u64,
    metrics: Arc<super::metrics::Metrics>,
    tenants: Arc<super::tenant::Tenants>,
    /// The server's memory budget over GET bodies, and how long a request waits for it
    /// before `503 SlowDown` (none: unmetered, for a frontend outside a server).
    budget: Option<(Budget, Duration)>,
}

impl S3Frontend {
    /// A frontend; objects above `max_object_bytes` are refused with `EntityTooLarge`.
    pub fn new(
        store: Arc<dyn Store>,
        buckets: Arc<Buckets>,
        max_object_bytes: u64,
        metrics: Arc<super::metrics::Metrics>,
    ) -> Self {
        S3Frontend {
            store,
            buckets,
            max_object_bytes,
            metrics,
            tenants: Arc::default(),
            budget: None,
        }
    }

    /// Meters GET bodies against the server's memory budget, waiting up to `wait` for it.
    pub(crate) fn with_budget(mut self, budget: Budget, wait: Duration) -> Self {
        self.budget = Some((budget, wait));
        self
    }

    /// Confines requests signed with a tenant's access key to its namespace
    /// ([`super::tenant`]).
    pub fn with_tenants(mut self, tenants: Arc<super::tenant::Tenants>) -> Self {
        self.tenants = tenants;
        self
    }

    /// The namespace requests with `creds` are confined to (`""`: the whole bucket).
    ///
    /// # Errors
    /// `AccessDenied` for an unsigned request on a server with tenants.
    fn root(&self, creds: Option<&s3s::auth::Credentials>) -> S3Result<String> {
        if creds.is_none() && !self.tenants.is_empty() {
            return Err(s3_error!(
                AccessDenied,
                "a server with tenants needs signed requests"
            ));
        }
        Ok(self
            .tenants
            .root(creds.map(|c| c.access_key.as_str()))
            .to_string())
    }

    /// Store key of object `k` of bucket `b` for requests with `creds`.
    fn scoped_key(
        &self,
        creds: Option<&s3s::auth::Credentials>,
        b: &str,
        k: &str,
    ) -> S3Result<String> {
        let root = self.root(creds)?;
        // The key is checked on its own first: `..` must not climb out of the namespace.
        validate_key(k).map_err(|e| map_err_as(e, k))?;
        if root.is_empty() {
            return Self::key(b, k);
        }
        let key = format!("{b}/{root}/{k}");
        // Errors name the key as the caller sent it, never the namespace it is stored under.
        validate_key(&key).map_err(|e| map_err_as(e, k))?;
        Ok(key)
    }

    /// Refuses bucket changes by tenants.
    fn operator_only(&self, creds: Option<&s3s::auth::Credentials>, op: &str) -> S3Result<()> {
        if !self.root(creds)?.is_empty() {
            return Err(s3_error!(AccessDenied, "a tenant cannot {op}"));
        }
        Ok(())
    }

    async fn bucket(&self, b: &str) -> S3Result<()> {
        match self.buckets.exists(b).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(s3_error!(NoSuchBucket, "bucket {b} does not exist")),
            Err(e) => Err(map_err_as(e, b)),
        }
    }

    fn key(b: &str, k: &str) -> S3Result<String> {
        let key = format!("{b}/{k}");
        validate_key(&key).map_err(|e| map_err_as(e, k))?;
        Ok(key)
    }

    fn count(&self, op: &str) {
        self.metrics.request(op);
    }
}

/// Maps a store error to the S3 error a client sees, naming the key the error carries.
/// Prefer [`map_err_as`], which names the key as the client sent it.
pub fn map_err(e: StoreError) -> S3Error {
    let key = match &e {
        StoreError::NotFound { key }
        | StoreError::AlreadyExists { key }
        | StoreError::Precondition { key }
        | StoreError::InvalidRange { key, .. }
        | StoreError::InvalidKey { key, .. } => key.clone(),
        _ => String::new(),
    };
    map_err_as(e, &key)
}

/// Maps a store error to the S3 error a client sees: a 4xx with its S3 code for what the
/// client can change (a missing key, a key this store cannot hold, a bad range), naming the
/// key as `shown` (the client's own spelling, never the store key with its bucket or tenant
/// namespace). Backend failures are `500 InternalError` or `503 SlowDown` with no backend
/// text, OS error or path: those go to the server's log only.
pub fn map_err_as(e: StoreError, shown: &str) -> S3Error {
    match e {
        StoreError::NotFound { .. } => s3_error!(NoSuchKey, "no such key: {shown}"),
        StoreError::AlreadyExists { .. } => {
            s3_error!(PreconditionFailed, "object already exists: {shown}")
        }
        StoreError::Precondition { .. } => {
            s3_error!(PreconditionFailed, "precondition failed: {shown}")
        }
        StoreError::InvalidRange {
            start, end, size, ..
        } => {
            s3_error!(
                InvalidRange,
                "range {start}..{end} outside {shown} of {size} bytes"
            )
        }
        StoreError::InvalidKey { reason, .. }
            if (reason.contains("1024 bytes") && !shown.is_empty())
                || reason.contains("255 bytes") =>
        {
            s3_error!(KeyTooLongError, "invalid key {shown:?}: {reason}")
        }
        StoreError::InvalidKey { reason, .. } => {
            s3_error!(InvalidArgument, "invalid key {shown:?}: {reason}")
        }
        StoreError::PermissionDenied { .. } => {
            tracing::warn!(error = %e, "backend refused the server's credentials");
            s3_error!(InternalError, "the storage backend refused the request")
        }
        StoreError::NotImplemented { operation, backend } => {
            s3_error!(
                NotImplemented,
                "{operation} is not implemented by {backend}"
            )
        }
        // Gateway mode over an upstream that cannot do what is asked (e.g. conditional PUT).
        StoreError::Incompatible { message, .. } => {
            s3_error!(NotImplemented, "the upstream store: {message}")
        }
        StoreError::Timeout { .. } => {
            tracing::warn!(error = %e, "backend timed out");
            s3_error!(SlowDown, "the storage backend is slow; retry")
        }
        other => {
            tracing::warn!(error = %other, key = shown, "backend failure");
            s3_error!(InternalError, "internal error (logged by the server)")
        }
    }
}

fn etag(s: Option<String>) -> Option<ETag> {
    s.map(ETag::Strong)
}

#[async_trait::async_trait]
impl S3 for S3Frontend {
    async fn create_bucket(
        &self,
        req: S3Request<CreateBucketInput>,
    ) -> S3Result<S3Response<CreateBucketOutput>> {
        self.count("create_bucket");
        self.operator_only(req.credentials.as_ref(), "create a bucket")?;
        let b = req.input.bucket;
        if !self
            .buckets
            .create(&b)
            .await
            .map_err(|e| map_err_as(e, &b))?
        {
            return Err(s3_error!(BucketAlreadyOwnedByYou, "bucket {b} exists"));
        }
        tracing::info!(bucket = %b, "bucket created");
        Ok(S3Response::new(CreateBucketOutput {
            location: Some(format!("/{b}")),
        }))
    }

    async fn delete_bucket(
        &self,
        req: S3Request<DeleteBucketInput>,
    ) -> S3Result<S3Response<DeleteBucketOutput>> {
        self.count("delete_bucket");
        self.operator_only(req.credentials.as_ref(), "delete a bucket")?;
        let b = req.input.bucket;
        self.bucket(&b).await?;
        if !self
            .store
            .list(&format!("{b}/"), 1)
            .await
            .map_err(|e| map_err_as(e, &b))?
            .is_empty()
        {
            return Err(s3_error!(BucketNotEmpty, "bucket {b} is not empty"));
        }
        self.buckets
            .remove(&b)
            .await
            .map_err(|e| map_err_as(e, &b))?;
        Ok(S3Response::new(DeleteBucketOutput {}))
    }

    async fn head_bucket(
        &self,
        req: S3Request<HeadBucketInput>,
    ) -> S3Result<S3Response<HeadBucketOutput>> {
        self.count("head_bucket");
        self.bucket(&req.input.bucket).await?;
        Ok(S3Response::new(HeadBucketOutput::default()))
    }

    async fn list_buckets(
        &self,
        _req: S3Request<ListBucketsInput>,
    ) -> S3Result<S3Response<ListBucketsOutput>> {
        self.count("list_buckets");
        let buckets = self
            .buckets
            .list()
            .into_iter()
            .map(|(name, t)| Bucket {
                name: Some(name),
                creation_date: Some(t.into()),
                bucket_region: None,
            })
            .collect();
        Ok(S3Response::new(ListBucketsOutput {
            buckets: Some(buckets),
            ..Default::default()
        }))
    }

    async fn put_object(
        &self,
        req: S3Request<PutObjectInput>,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        self.count("put_object");
        let key = self.scoped_key(req.credentials.as_ref(), &req.input.bucket, &req.input.key)?;
        let input = req.input;
        self.bucket(&input.bucket).await?;
        let mode = match input.if_none_match {
            None => PutMode::Overwrite,
            Some(ETagCondition::Any) => PutMode::Create,
            Some(_) => return Err(s3_error!(NotImplemented, "If-None-Match supports only *")),
        };
        if input.if_match.is_some() {
            return Err(s3_error!(
                NotImplemented,
                "If-Match on PUT is not supported"
            ));
        }
        // A declared length is checked, never reserved: the body is streamed to the store,
        // each piece held under the memory budget only until the store has written it.
        if let Some(n) = input.content_length {
            if n as u64 > self.max_object_bytes {
                return Err(s3_error!(
                    EntityTooLarge,
                    "{n} bytes is above the limit of {}",
                    self.max_object_bytes
                ));
            }
        }
        let fault = req.extensions.get::<Arc<BodyFault>>().cloned();
        let over = Arc::new(AtomicBool::new(false));
        let body_failed = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicU64::new(0));
        let body: crate::store::ByteStream = match input.body {
            None => futures::stream::empty().boxed(),
            Some(body) => {
                let (max, over, failed, received) = (
                    self.max_object_bytes,
                    over.clone(),
                    body_failed.clone(),
                    received.clone(),
                );
                body.map(move |part| {
                    let part = part.map_err(|e| {
                        failed.store(true, Ordering::Relaxed);
                        StoreError::other("request body", e)
                    })?;
                    let n = received.fetch_add(part.len() as u64, Ordering::Relaxed)
                        + part.len() as u64;
                    if n > max {
                        over.store(true, Ordering::Relaxed);
                        return Err(StoreError::other("request body", "above max_object_bytes"));
                    }
                    Ok(part)
                })
                .boxed()
            }
        };
        let len = input.content_length.map(|n| n.max(0) as u64);
        let r = self
            .store
            .put_stream(&key, body, len, PutOptions { mode })
            .await;
        let r = match r {
            Ok(r) => r,
            Err(_) if over.load(Ordering::Relaxed) => {
                return Err(s3_error!(
                    EntityTooLarge,
                    "body is above the limit of {} bytes",
                    self.max_object_bytes
                ))
            }
            Err(e) if body_failed.load(Ordering::Relaxed) => {
                return Err(match fault.as_deref().and_then(BodyFault::get) {
                    Some(f) => f.s3_error(),
                    None => s3_error!(IncompleteBody, "the request body ended early: {e}"),
                })
            }
            Err(e) => return Err(map_err_as(e, &input.key)),
        };
        let len = received.load(Ordering::Relaxed);
        self.metrics.bytes("s3_in", len);
        Ok(S3Response::new(PutObjectOutput {
            e_tag: etag(r.etag),
            size: Some(len as i64),
            ..Default::default()
        }))
    }

    async fn get_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        self.count("get_object");
        let key = self.scoped_key(req.credentials.as_ref(), &req.input.bucket, &req.input.key)?;
        let input = req.input;
        self.bucket(&input.bucket).await?;
        let shown = input.key.as_str();
        let range = match input.range {
            None => None,
            Some(r) => {
                let size = self
                    .store
                    .head(&key)
                    .await
                    .map_err(|e| map_err_as(e, shown))?
                    .size;
                Some(r.check(size).map_err(|_| {
                    s3_error!(InvalidRange, "range is outside the object of {size} bytes")
                })?)
            }
        };
        let partial = range.is_some();
        // The first piece's memory is had before the object is opened: past the budget the
        // answer is 503 SlowDown, before any byte is read.
        let first = match &self.budget {
            Some((b, wait)) => Some(
                b.acquire_within(GET_PIECE_BYTES, *wait)
                    .await
                    .ok_or_else(slow_down)?,
            ),
            None => None,
        };
        let mut g = self
            .store
            .get_opts(&key, GetOptions { range })
            .await
            .map_err(|e| map_err_as(e, shown))?;
        let len = g.range.end - g.range.start;
        if let Some((b, wait)) = &self.budget {
            g.body = metered_stream(g.body, b.clone(), *wait, len, first);
        }
        self.metrics.bytes("s3_out", len);
        let content_range = partial.then(|| {
            format!(
                "bytes {}-{}/{}",
                g.range.start,
                g.range.end.saturating_sub(1),
                g.meta.size
            )
        });
        let body = StreamingBlob::wrap(
            SyncStream(std::sync::Mutex::new(g.body)).map_err(std::io::Error::other),
        );
        Ok(S3Response::new(GetObjectOutput {
            body: Some(body),
            content_length: Some(len as i64),
            content_range,
            accept_ranges: Some("bytes".into()),
            e_tag: etag(g.meta.etag),
            last_modified: g.meta.last_modified.map(Into::into),
            ..Default::default()
        }))
    }

    async fn head_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        self.count("head_object");
        let key = self.scoped_key(req.credentials.as_ref(), &req.input.bucket, &req.input.key)?;
        let input = req.input;
        self.bucket(&input.bucket).await?;
        let m = self
            .store
            .head(&key)
            .await
            .map_err(|e| map_err_as(e, &input.key))?;
        Ok(S3Response::new(HeadObjectOutput {
            content_length: Some(m.size as i64),
            accept_ranges: Some("bytes".into()),
            e_tag: etag(m.etag),
            last_modified: m.last_modified.map(Into::into),
            ..Default::default()
        }))
    }

    async fn delete_object(
        &self,
        req: S3Request<DeleteObjectInput>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        self.count("delete_object");
        let key = self.scoped_key(req.credentials.as_ref(), &req.input.bucket, &req.input.key)?;
        let input = req.input;
        self.bucket(&input.bucket).await?;
        self.store
            .delete(&key)
            .await
            .map_err(|e| map_err_as(e, &input.key))?;
        Ok(S3Response::new(DeleteObjectOutput::default()))
    }

    async fn list_objects_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<S3Response<ListObjectsV2Output>> {
        self.count("list_objects_v2");
        let root = self.root(req.credentials.as_ref())?;
        let input = req.input;
        let b = input.bucket.clone();
        self.bucket(&b).await?;
        let prefix = input.prefix.clone().unwrap_or_default();
        let max_keys = input.max_keys.unwrap_or(1000).clamp(0, 1000) as usize;
        let after = input
            .continuation_token
            .clone()
            .or(input.start_after.clone())
            .unwrap_or_default();
        // A tenant lists its namespace only, with keys relative to it.
        let base = if root.is_empty() {
            format!("{b}/")
        } else {
            format!("{b}/{root}/")
        };
        let all = self
            .store
            .list(&format!("{base}{prefix}"), usize::MAX)
            .await
            .map_err(|e| map_err_as(e, &prefix))?;
        let mut contents = Vec::new();
        let mut prefixes = BTreeSet::new();
        let mut truncated = false;
        let mut last = None;
        for m in all {
            let key = &m.key[base.len()..];
            if key <= after.as_str() {
                continue;
            }
            if let Some(d) = input.delimiter.as_deref().filter(|d| !d.is_empty()) {
                if let Some(i) = key[prefix.len()..].find(d) {
                    let cp = key[..prefix.len() + i + d.len()].to_string();
                    if cp.as_str() <= after.as_str() || prefixes.contains(&cp) {
                        continue;
                    }
                    if contents.len() + prefixes.len() >= max_keys {
                        truncated = true;
                        break;
                    }
                    last = Some(cp.clone());
                    prefixes.insert(cp);
                    continue;
                }
            }
            if contents.len() + prefixes.len() >= max_keys {
                truncated = true;
                break;
            }
            last = Some(key.to_string());
            contents.push(Object {
                key: Some(key.to_string()),
                size: Some(m.size as i64),
                e_tag: etag(m.etag),
                last_modified: m.last_modified.map(Into::into),
                ..Default::default()
            });
        }
        let key_count = (contents.len() + prefixes.len()) as i32;
        Ok(S3Response::new(ListObjectsV2Output {
            name: Some(b),
            prefix: input.prefix,
            delimiter: input.delimiter,
            max_keys: Some(max_keys as i32),
            key_count: Some(key_count),
            continuation_token: input.continuation_token,
            start_after: input.start_after,
            is_truncated: Some(truncated),
            next_continuation_token: if truncated { last } else { None },
            contents: Some(contents),
            common_prefixes: Some(
                prefixes
                    .into_iter()
                    .map(|p| CommonPrefix { prefix: Some(p) })
                    .collect(),
            ),
            ..Default::default()
        }))
    }
}

/// Makes a store body `Sync` (as `s3s` requires) without locking: it is only ever polled
/// through `&mut`.
struct SyncStream(std::sync::Mutex<crate::store::ByteStream>);

impl futures::Stream for SyncStream {
    type Item = Result<Bytes, StoreError>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.0.get_mut() {
            Ok(s) => s.poll_next_unpin(cx),
            Err(_) => std::task::Poll::Ready(Some(Err(StoreError::other(
                "server",
                "body stream poisoned",
            )))),
        }
    }
}

/// Bytes of a GET body held under the memory budget at a time: one store read (the
/// filesystem store reads 4 MiB pieces).
const GET_PIECE_BYTES: u64 = 4 << 20;

/// `503 SlowDown`: the server's memory budget is spent; the client retries after a backoff.
fn slow_down() -> S3Error {
    s3_error!(
        SlowDown,
        "the server's memory budget is in use by other requests; retry"
    )
}

/// A GET body under the memory budget: each piece's bytes are held before the store reads
/// it (`first` for the first piece) and given back when the socket has taken the piece.
/// A piece that cannot get its memory within `wait` ends the body with an error (the client
/// sees a short body and retries).
fn metered_stream(
    inner: crate::store::ByteStream,
    budget: Budget,
    wait: Duration,
    len: u64,
    first: Option<Hold>,
) -> crate::store::ByteStream {
    futures::stream::unfold(
        (inner, budget, first, len, false),
        move |(mut inner, budget, next, left, done)| async move {
            if done {
                return None;
            }
            let want = left.clamp(1, GET_PIECE_BYTES);
            let mut hold = match next {
                Some(h) => h,
                None => match budget.acquire_within(want, wait).await {
                    Some(h) => h,
                    None => {
                        let e = StoreError::other("server", "memory budget exhausted");
                        return Some((Err(e), (inner, budget, None, left, true)));
                    }
                },
            };
            match inner.next().await {
                None => None,
                Some(Err(e)) => Some((Err(e), (inner, budget, None, left, true))),
                Some(Ok(b)) => {
                    let n = b.len() as u64;
                    if n < hold.bytes() {
                        drop(hold.split(hold.bytes() - n));
                    } else if n > hold.bytes() {
                        match budget.acquire_within(n - hold.bytes(), wait).await {
                            Some(more) => hold.merge(more),
                            None => {
                                let e = StoreError::other("server", "memory budget exhausted");
                                return Some((Err(e), (inner, budget, None, left, true)));
                            }
                        }
                    }
                    let left = left.saturating_sub(n);
                    Some((Ok(hold.attach(b)), (inner, budget, None, left, false)))
                }
            }
        },
    )
    .boxed()
}

/// Why a request body was cut off by the server (read by `put_object` to answer with the
/// right S3 error).
#[derive(Debug, Default)]
pub(crate) struct BodyFault(Mutex<Option<BodyFaultKind>>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFaultKind {
    /// The memory budget stayed spent for the whole wait.
    SlowDown,
    /// The client sent too little while the server waited (stall or drip).
    TooSlow,
    /// One request would hold more than `max_request_bytes` of body at once.
    TooLarge,
}

impl BodyFault {
    fn set(&self, k: BodyFaultKind) {
        *self.0.lock().expect("body fault") = Some(k);
    }
    fn get(&self) -> Option<BodyFaultKind> {
        *self.0.lock().expect("body fault")
    }
}

impl BodyFaultKind {
    fn s3_error(self) -> S3Error {
        match self {
            BodyFaultKind::SlowDown => slow_down(),
            BodyFaultKind::TooSlow => s3_error!(
                RequestTimeout,
                "your socket connection to the server was not read from or written to within the timeout period"
            ),
            BodyFaultKind::TooLarge => s3_error!(
                InvalidRequest,
                "the request body arrives in pieces larger than this server buffers for one request"
            ),
        }
    }
    fn message(self) -> &'static str {
        match self {
            BodyFaultKind::SlowDown => "memory budget exhausted",
            BodyFaultKind::TooSlow => "client too slow",
            BodyFaultKind::TooLarge => "request body buffered above max_request_bytes",
        }
    }
}

/// Limits of [`MeteredBody`].
#[derive(Debug, Clone)]
pub(crate) struct BodyLimits {
    /// The server's memory budget.
    pub(crate) budget: Budget,
    /// How long a body piece waits for memory before the request gets `503 SlowDown`.
    pub(crate) wait: Duration,
    /// Progress the client owes while the server waits for its body.
    pub(crate) floor: RateFloor,
    /// Body bytes one request may hold at once (pieces received, not yet stored).
    pub(crate) max_request_bytes: u64,
}

/// A request body under the server's rules: each piece is held under the memory budget from
/// the socket until its consumer (the store) drops it; the client must keep sending
/// ([`RateFloor`]); one request never holds more than `max_request_bytes` at once. A broken
/// rule ends the body with an error and records why in the request's [`BodyFault`].
pub(crate) struct MeteredBody {
    inner: hyper::body::Incoming,
    lim: BodyLimits,
    floor: PollFloor,
    fault: Arc<BodyFault>,
    held: Arc<AtomicU64>,
    waiting: Option<(Bytes, Pin<Box<dyn Future<Output = Option<Hold>> + Send>>)>,
}

impl MeteredBody {
    /// Meters `inner`; the request's [`BodyFault`] is returned for its extensions.
    pub(crate) fn new(inner: hyper::body::Incoming, lim: BodyLimits) -> (Self, Arc<BodyFault>) {
        let fault = Arc::new(BodyFault::default());
        let floor = PollFloor::new(lim.floor.clone());
        (
            MeteredBody {
                inner,
                lim,
                floor,
                fault: fault.clone(),
                held: Arc::new(AtomicU64::new(0)),
                waiting: None,
            },
            fault,
        )
    }

    fn fail(
        &mut self,
        k: BodyFaultKind,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        self.fault.set(k);
        self.waiting = None;
        Poll::Ready(Some(Err(std::io::Error::other(k.message()))))
    }

    /// `data` with its hold attached, counted in this request's held bytes until dropped.
    fn release(&self, data: Bytes, hold: Hold) -> Bytes {
        let n = data.len() as u64;
        self.held.fetch_add(n, Ordering::Relaxed);
        let held = self.held.clone();
        hold.attach(Bytes::from_owner(Tally { data, held, n }))
    }
}

/// Bytes counted in a request's held total until dropped.
struct Tally {
    data: Bytes,
    held: Arc<AtomicU64>,
    n: u64,
}
impl AsRef<[u8]> for Tally {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}
impl Drop for Tally {
    fn drop(&mut self) {
        self.held.fetch_sub(self.n, Ordering::Relaxed);
    }
}

impl http_body::Body for MeteredBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        loop {
            if let Some((_, fut)) = this.waiting.as_mut() {
                let Poll::Ready(h) = fut.as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                let (data, _) = this.waiting.take().expect("waiting");
                return match h {
                    Some(hold) => {
                        Poll::Ready(Some(Ok(hyper::body::Frame::data(this.release(data, hold)))))
                    }
                    None => this.fail(BodyFaultKind::SlowDown),
                };
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    if this.floor.poll(cx, None).is_err() {
                        return this.fail(BodyFaultKind::TooSlow);
                    }
                    return Poll::Pending;
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(Err(e))) => {
                    return Poll::Ready(Some(Err(std::io::Error::other(e))))
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let data = match frame.into_data() {
                        Ok(d) => d,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    let n = data.len() as u64;
                    if this.floor.poll(cx, Some(n)).is_err() {
                        return this.fail(BodyFaultKind::TooSlow);
                    }
                    if this.held.load(Ordering::Relaxed) + n > this.lim.max_request_bytes {
                        return this.fail(BodyFaultKind::TooLarge);
                    }
                    if let Some(hold) = this.lim.budget.try_acquire(n) {
                        return Poll::Ready(Some(Ok(hyper::body::Frame::data(
                            this.release(data, hold),
                        ))));
                    }
                    // Past the budget: stop reading this client until memory comes free.
                    let (b, wait) = (this.lim.budget.clone(), this.lim.wait);
                    this.waiting = Some((
                        data,
                        Box::pin(async move { b.acquire_within(n, wait).await }),
                    ));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.waiting.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut h = self.inner.size_hint();
        if let Some((d, _)) = &self.waiting {
            let n = d.len() as u64;
            h.set_lower(h.lower() + n);
            if let Some(u) = h.upper() {
                h.set_upper(u + n);
            }
        }
        h
    }
}
