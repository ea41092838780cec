//! The [`Store`] operations of [`S3Store`]: each one S3 request (or a few), its answer
//! checked and its errors mapped.

use super::body::{
    body_stream, parse_content_range, to_system_time, total_from_content_range, SyncBody,
};
use super::errors::{map_error, Op};
use super::{S3Store, BACKEND};
use crate::error::{StoreError, StoreResult};
use crate::store::{
    check_stream_len, resolve_range, validate_key, ByteStream, Gateways, GetOptions, GetResult,
    ObjectMeta, PutMode, PutOptions, PutResult, RangeBody, Store,
};
use async_trait::async_trait;
use aws_sdk_s3::error::SdkError;
use aws_smithy_types::error::display::DisplayErrorContext;
use bytes::Bytes;
use futures::StreamExt;
use std::ops::Range;

/// Connections [`S3Store::warm`] opens through the SDK when a load's ranged GETs have
/// connections of their own (`direct.rs`): the SDK's then carry lookups and saves.
const SDK_WARM_BESIDE_DIRECT: usize = 4;

impl S3Store {
    /// This store's endpoint as its [`Gateways`]: where loads may use gather (a plain
    /// `http://` endpoint) and the connection pool [`Gateways::warm`] opens.
    pub fn gateways(&self) -> Gateways {
        Gateways::one(self.clone())
    }

    /// The endpoint's `host:port` when an endpoint is configured (an ObjectCache server or
    /// any S3 server: the connector's probe tells them apart); `None` for AWS S3.
    pub(crate) fn gather_target(&self) -> Option<crate::store::GatherTarget> {
        let u = url::Url::parse(&self.endpoint).ok()?;
        // Gather is plaintext TCP: an `https://` endpoint is reached by ranged GETs only.
        if u.scheme() != "http" {
            return None;
        }
        let addr = format!("{}:{}", u.host_str()?, u.port_or_known_default()?);
        Some(crate::store::GatherTarget {
            addr,
            bucket: self.bucket.clone(),
            key_prefix: self.prefix.clone(),
            credentials: self.gather_credentials.clone(),
        })
    }

    /// `connections` concurrent `HeadBucket` requests (at most 1,024): each answer, whatever
    /// its status, leaves a connection idle in the pool (up to
    /// [`S3Config::max_idle_connections`](super::S3Config::max_idle_connections)). Transport
    /// failures are logged at debug level and not counted. At a plain-`http://` endpoint
    /// (the direct path on) it opens that many for the ranged GETs read into place
    /// (`direct.rs`) instead, and at most 4 through the SDK.
    pub async fn warm(&self, connections: usize) -> usize {
        // With the direct path on, a load's ranged GETs use its connections; the SDK's carry
        // lookups and saves, which a few warm connections serve (each idle connection also
        // counts against a server's per-client connection cap).
        let sdk = if self.direct.is_some() {
            connections.min(SDK_WARM_BESIDE_DIRECT)
        } else {
            connections
        };
        let n = sdk.min(1024);
        let answered = futures::future::join_all((0..n).map(|_| async {
            match self.client.head_bucket().bucket(&self.bucket).send().await {
                Ok(_) => true,
                // An HTTP answer (403, 404, 301, ...) still pooled its connection.
                Err(SdkError::ServiceError(_)) => true,
                Err(e) => {
                    tracing::debug!(endpoint = %self.endpoint, error = %DisplayErrorContext(&e), "warming the S3 connection pool");
                    false
                }
            }
        }))
        .await;
        // The direct path's own connections (`direct.rs`), which a load's ranged GETs use.
        self.warm_direct(connections).await;
        answered.into_iter().filter(|a| *a).count()
    }
}

#[async_trait]
impl Store for S3Store {
    fn name(&self) -> &'static str {
        BACKEND
    }

    /// A presigned ranged GET on a connection of the store's own, at plain-`http://`
    /// endpoints; `Ok(None)` otherwise, and for any answer but a plain `206` (`direct.rs`).
    async fn get_range_body(&self, key: &str, range: Range<u64>) -> StoreResult<Option<RangeBody>> {
        validate_key(key)?;
        self.direct_range_body(key, range).await
    }

    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
        self.get_attempts(key, opts, None).await
    }

    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult> {
        validate_key(key)?;
        if opts.mode == PutMode::Create {
            self.check_conditional_put().await?;
        }
        let full = self.full_key(key);
        let req = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(&full)
            .body(data.into());
        self.send_put(key, req, opts.mode).await
    }

    /// With `len` known, the body goes upstream as it arrives (one PUT with that
    /// `Content-Length`, signed `UNSIGNED-PAYLOAD`; not retried, since a stream cannot be
    /// replayed); without it, it is collected first (the default).
    async fn put_stream(
        &self,
        key: &str,
        body: ByteStream,
        len: Option<u64>,
        opts: PutOptions,
    ) -> StoreResult<PutResult> {
        let Some(n) = len else {
            return crate::store::put_collected(self, key, body, len, opts).await;
        };
        validate_key(key)?;
        let full = self.full_key(key);
        // The stream's length is checked as it passes: a body of another length fails the
        // upload instead of writing a different object.
        let k = key.to_string();
        let counted = futures::StreamExt::scan(body, 0u64, move |got, p| {
            let r = p.and_then(|p| {
                *got += p.len() as u64;
                if *got > n {
                    check_stream_len(&k, *got, Some(n))?;
                }
                Ok(p)
            });
            futures::future::ready(Some(r.map(http_body::Frame::data)))
        });
        let sdk_body = aws_smithy_types::body::SdkBody::from_body_1_x(
            http_body_util::StreamBody::new(SyncBody(std::sync::Mutex::new(Box::pin(counted)))),
        );
        let req = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(&full)
            .content_length(n as i64)
            .body(aws_sdk_s3::primitives::ByteStream::new(sdk_body));
        self.send_put(key, req, opts.mode).await
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        validate_key(key)?;
        let out = self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(self.full_key(key))
            .send()
            .await
            .map_err(|e| map_error(&self.err_cx(), Op::Head, key, e))?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size: out.content_length().unwrap_or(0).max(0) as u64,
            last_modified: to_system_time(out.last_modified()),
            etag: out.e_tag().map(str::to_string),
        })
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        validate_key(key)?;
        match self
            .client
            .delete_object()
            .bucket(&self.bucket)
            .key(self.full_key(key))
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => match map_error(&self.err_cx(), Op::Delete, key, e) {
                StoreError::NotFound { .. } => Ok(()),
                other => Err(other),
            },
        }
    }

    async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>> {
        let full_prefix = self.full_key(prefix);
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        while out.len() < limit {
            let page_size = (limit - out.len()).min(1000) as i32;
            let mut req = self
                .client
                .list_objects_v2()
                .bucket(&self.bucket)
                .prefix(&full_prefix)
                .max_keys(page_size);
            if let Some(t) = token.take() {
                req = req.continuation_token(t);
            }
            let page = req
                .send()
                .await
                .map_err(|e| map_error(&self.err_cx(), Op::List, prefix, e))?;
            for o in page.contents() {
                let Some(k) = o.key() else { continue };
                out.push(ObjectMeta {
                    key: self.strip_prefix(k).to_string(),
                    size: o.size().unwrap_or(0).max(0) as u64,
                    last_modified: to_system_time(o.last_modified()),
                    etag: o.e_tag().map(str::to_string),
                });
                if out.len() == limit {
                    break;
                }
            }
            match page.next_continuation_token() {
                Some(t) if page.is_truncated() == Some(true) => token = Some(t.to_string()),
                _ => break,
            }
        }
        Ok(out)
    }
}

impl S3Store {
    /// Sends a PUT built by `put_opts` or `put_stream`: create-only (`If-None-Match: *`)
    /// for [`PutMode::Create`].
    async fn send_put(
        &self,
        key: &str,
        mut req: aws_sdk_s3::operation::put_object::builders::PutObjectFluentBuilder,
        mode: PutMode,
    ) -> StoreResult<PutResult> {
        let op = match mode {
            PutMode::Overwrite => Op::Put,
            PutMode::Create => {
                req = req.if_none_match("*");
                Op::PutCreate
            }
        };
        let out = req
            .send()
            .await
            .map_err(|e| map_error(&self.err_cx(), op, key, e))?;
        Ok(PutResult {
            etag: out.e_tag().map(str::to_string),
        })
    }
}

impl S3Store {
    /// [`Store::get_opts`] with `attempts` in place of the store's
    /// [`S3Config::max_attempts`](super::S3Config::max_attempts) when given (a ranged GET the
    /// direct path already tried once: `direct.rs`).
    pub(super) async fn get_attempts(
        &self,
        key: &str,
        opts: GetOptions,
        attempts: Option<u32>,
    ) -> StoreResult<GetResult> {
        validate_key(key)?;
        let full = self.full_key(key);
        if let Some(r) = &opts.range {
            if r.start >= r.end {
                // HTTP cannot ask for zero bytes: check the range against the size instead.
                let meta = self.head(key).await?;
                let range = resolve_range(key, Some(r.clone()), meta.size)?;
                return Ok(GetResult {
                    meta,
                    range,
                    body: futures::stream::empty().boxed(),
                });
            }
        }
        let mut req = self.client.get_object().bucket(&self.bucket).key(&full);
        if let Some(r) = &opts.range {
            req = req.range(format!("bytes={}-{}", r.start, r.end - 1));
        }
        let sent = match attempts {
            None => req.send().await,
            Some(n) => {
                let retry = self.retry.clone().with_max_attempts(n);
                let fewer = aws_sdk_s3::config::Builder::new().retry_config(retry);
                req.customize().config_override(fewer).send().await
            }
        };
        let out = match sent {
            Ok(o) => o,
            Err(e) => {
                return Err(match map_error(&self.err_cx(), Op::Get, key, e) {
                    StoreError::InvalidRange { .. } => {
                        let size = self.head(key).await?.size;
                        let r = opts.range.clone().unwrap_or(0..0);
                        StoreError::InvalidRange {
                            key: key.to_string(),
                            start: r.start,
                            end: r.end,
                            size,
                        }
                    }
                    other => other,
                })
            }
        };
        let len = out.content_length().unwrap_or(0).max(0) as u64;
        let size = match (
            &opts.range,
            out.content_range().and_then(total_from_content_range),
        ) {
            (_, Some(total)) => total,
            (None, None) => len,
            (Some(_), None) => {
                // A server that ignored the Range header sent the whole object.
                len
            }
        };
        let meta = ObjectMeta {
            key: key.to_string(),
            size,
            last_modified: to_system_time(out.last_modified()),
            etag: out.e_tag().map(str::to_string),
        };
        let range: Range<u64> = resolve_range(key, opts.range.clone(), size)?;
        let served = match out.content_range() {
            Some(cr) => parse_content_range(cr).map(|(a, b, _)| (a, b)),
            None => Some((0, len)),
        };
        if served != Some((range.start, range.end)) || len != range.end - range.start {
            return Err(StoreError::Other {
                backend: BACKEND,
                message: format!(
                    "GET {key}: asked for bytes {}..{}, server sent {:?} ({len} bytes)",
                    range.start,
                    range.end,
                    out.content_range()
                ),
            });
        }
        let body = body_stream(key.to_string(), out.body, len, self.read_timeout);
        Ok(GetResult { meta, range, body })
    }
}
