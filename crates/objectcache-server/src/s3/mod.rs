//! The S3 API over a [`Store`], through the `s3s` crate (request parsing, SigV4 checks,
//! XML responses). Buckets are key prefixes of the store: object `k` of bucket `b` is store
//! key `b/k`; the bucket registry lives under `_buckets/` (`_` cannot start a bucket name, so
//! no bucket collides with it).

mod buckets;
mod errors;
mod get_body;
mod request_body;

pub use buckets::Buckets;
pub use errors::{map_err, map_err_as};
pub(crate) use request_body::{BodyLimits, MeteredBody};

use super::budget::Budget;
use crate::mapped::local_file_body;
use futures::{StreamExt, TryStreamExt};
use get_body::{metered_stream, slow_down, SyncStream, GET_PIECE_BYTES};
use objectcache_client::error::StoreError;
use objectcache_client::store::{validate_key, GetOptions, GetResult, PutMode, PutOptions, Store};
use request_body::BodyFault;
use s3s::dto::*;
use s3s::{s3_error, S3Request, S3Response, S3Result, S3};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

    /// An object request's store key: the request is counted under `op`, key `k` is scoped
    /// to the caller's namespace ([`Self::scoped_key`]) and bucket `b` must exist.
    ///
    /// # Errors
    /// As [`Self::scoped_key`]; `NoSuchBucket`; the bucket lookup's storage error.
    async fn object_key(
        &self,
        op: &str,
        creds: Option<&s3s::auth::Credentials>,
        b: &str,
        k: &str,
    ) -> S3Result<String> {
        self.count(op);
        let key = self.scoped_key(creds, b, k)?;
        self.bucket(b).await?;
        Ok(key)
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
        if let Err(m) = objectcache_client::protocol::check_bucket_name(&b) {
            return Err(s3_error!(InvalidBucketName, "{m}"));
        }
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
        let (b, k) = (&req.input.bucket, &req.input.key);
        let key = self
            .object_key("put_object", req.credentials.as_ref(), b, k)
            .await?;
        let input = req.input;
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
        let body: objectcache_client::store::ByteStream = match input.body {
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
        let (b, k) = (&req.input.bucket, &req.input.key);
        let key = self
            .object_key("get_object", req.credentials.as_ref(), b, k)
            .await?;
        let input = req.input;
        let shown = input.key.as_str();
        // An object in a local file (the filesystem backend) is sent from the page cache
        // (`local_file_body`); the open file also gives the size a range is checked against.
        let local = self
            .store
            .open_local(&key)
            .await
            .map_err(|e| map_err_as(e, shown))?;
        let range = match input.range {
            None => None,
            Some(r) => {
                let size = match &local {
                    Some(o) => o.meta().size,
                    None => {
                        self.store
                            .head(&key)
                            .await
                            .map_err(|e| map_err_as(e, shown))?
                            .size
                    }
                };
                Some(r.check(size).map_err(|_| {
                    s3_error!(InvalidRange, "range is outside the object of {size} bytes")
                })?)
            }
        };
        let partial = range.is_some();
        // The first piece's memory is had before the object is read: past the budget the
        // answer is 503 SlowDown, before any byte is read.
        let first = match &self.budget {
            Some((b, wait)) => Some(
                b.acquire_within(GET_PIECE_BYTES, *wait)
                    .await
                    .ok_or_else(slow_down)?,
            ),
            None => None,
        };
        let mut g = match local {
            Some(o) => {
                let range = range.unwrap_or(0..o.meta().size);
                GetResult {
                    meta: o.meta().clone(),
                    body: local_file_body(o, range.clone(), key, GET_PIECE_BYTES),
                    range,
                }
            }
            None => self
                .store
                .get_opts(&key, GetOptions { range })
                .await
                .map_err(|e| map_err_as(e, shown))?,
        };
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
        let (b, k) = (&req.input.bucket, &req.input.key);
        let key = self
            .object_key("head_object", req.credentials.as_ref(), b, k)
            .await?;
        let input = req.input;
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
        let (b, k) = (&req.input.bucket, &req.input.key);
        let key = self
            .object_key("delete_object", req.credentials.as_ref(), b, k)
            .await?;
        let input = req.input;
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
