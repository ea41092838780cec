//! [`S3Store`]: any S3-compatible object store (AWS S3, Ceph RGW, MinIO, ...) through
//! `aws-sdk-s3`.
//!
//! - **Addressing** ([`Addressing`]): path-style (`http://host/bucket/key`) or virtual-hosted
//!   (`http://bucket.host/key`). A choice that cannot work is refused up front or, when only the
//!   network can tell (DNS, a redirect), reported with the setting to use instead.
//! - **Credentials** ([`S3Credentials`]): given in the configuration, or found by the AWS
//!   default chain (environment variables, shared config/credentials profile, web identity,
//!   container and instance metadata; set `AWS_EC2_METADATA_DISABLED=true` where no instance
//!   metadata service exists).
//! - **Reads** are ranged GETs whose body is streamed, chunk by chunk, with an idle timeout
//!   per chunk and a length check at the end: a short or stalled body is an error, never data.
//! - **Create-only writes** send `If-None-Match: *`; HTTP 412 becomes
//!   [`StoreError::AlreadyExists`].
//! - **Retries**: the SDK's standard mode, bounded by [`S3Config::max_attempts`], exponential
//!   backoff with jitter from [`S3Config::initial_backoff`] up to [`S3Config::max_backoff`], on
//!   5xx, throttling (`SlowDown`) and transport errors.
//! - **Timeouts**: connect, read (time to response headers, and between body chunks), one
//!   attempt, and the whole operation.
//! - **Connections**: one pooled HTTP client per store, keeping up to
//!   [`S3Config::max_idle_connections`] idle connections to the endpoint.
//!
//! Every HTTP failure is turned into a [`StoreError`] by one function (`map_error`).

#![forbid(unsafe_code)]

mod config;
mod errors;
mod resolver;
#[cfg(feature = "test-env")]
mod test_env;

pub use config::{Addressing, S3Config, S3Credentials};

use crate::error::StoreError;
use crate::store::{
    check_stream_len, resolve_range, validate_key, ByteStream, GetOptions, GetResult, ObjectMeta,
    PutMode, PutOptions, PutResult, Store,
};
use async_trait::async_trait;
use aws_config::meta::region::RegionProviderChain;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::BehaviorVersion;
use aws_sdk_s3::config::retry::RetryPartition;
use aws_sdk_s3::config::{
    Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
    StalledStreamProtectionConfig,
};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_smithy_http_client::tls;
use aws_smithy_types::error::display::DisplayErrorContext;
use bytes::Bytes;
use config::check_config;
use errors::{map_error, ErrCtx, Op};
use futures::StreamExt;
use resolver::Resolver;
use std::fmt;
use std::ops::Range;
use std::time::{Duration, SystemTime};

const BACKEND: &str = "s3";

/// An object store on an S3 bucket (optionally under a key prefix).
#[derive(Clone)]
pub struct S3Store {
    client: aws_sdk_s3::Client,
    bucket: String,
    prefix: String,
    addressing: Addressing,
    endpoint: String,
    host: Option<String>,
    read_timeout: Duration,
    /// Access key pair a gather connection authenticates with (static credentials, or the
    /// `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` environment of the default chain).
    gather_credentials: Option<(String, String)>,
    /// The verdict of the one conditional-PUT check (case C17), once it was reached.
    conditional_put: tokio::sync::OnceCell<Result<(), String>>,
}

impl fmt::Debug for S3Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Store")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("addressing", &self.addressing)
            .finish_non_exhaustive()
    }
}

impl S3Store {
    /// Builds a store: checks the configuration, resolves region and credentials (the default
    /// chain reads environment and profile files; network providers are asked lazily, on the
    /// first request) and sets up the pooled HTTP client. Sends no request.
    ///
    /// # Errors
    /// `StoreError::Other` starting "invalid S3 configuration" naming the bad setting: bucket
    /// name, prefix, endpoint URL, or an addressing that cannot work with this endpoint and
    /// bucket (the message says to use `addressing=path`).
    pub async fn new(config: S3Config) -> Result<Self, StoreError> {
        let host = check_config(&config)?;
        let addressing = config.effective_addressing();

        let http = aws_smithy_http_client::Builder::new()
            .pool_max_idle_per_host(config.max_idle_connections)
            .pool_idle_timeout(Duration::from_secs(60))
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ));
        let http = match &config.ca_file {
            None => http,
            Some(p) => {
                let pem = std::fs::read(p).map_err(|e| {
                    StoreError::other(
                        "s3",
                        format!("invalid S3 configuration: ca_file {}: {e}", p.display()),
                    )
                })?;
                let ctx = tls::TlsContext::builder()
                    .with_trust_store(tls::TrustStore::empty().with_pem_certificate(pem))
                    .build()
                    .map_err(|e| {
                        StoreError::other(
                            "s3",
                            format!("invalid S3 configuration: ca_file {}: {e}", p.display()),
                        )
                    })?;
                http.tls_context(ctx)
            }
        };
        let http = if config.resolve.is_empty() {
            http.build_https()
        } else {
            http.build_with_resolver(Resolver {
                fixed: config.resolve.clone(),
            })
        };

        let region = match &config.region {
            Some(r) => Region::new(r.clone()),
            None => {
                // Environment, then profile, then a default; never the instance metadata service.
                let mut profile_region = aws_config::profile::ProfileFileRegionProvider::builder();
                if let Some(p) = &config.profile {
                    profile_region = profile_region.profile_name(p);
                }
                RegionProviderChain::first_try(
                    aws_config::environment::EnvironmentVariableRegionProvider::new(),
                )
                .or_else(profile_region.build())
                .or_else(Region::new("us-east-1"))
                .region()
                .await
                .unwrap_or_else(|| Region::new("us-east-1"))
            }
        };

        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .region(region)
            .http_client(http.clone());
        if let Some(p) = &config.profile {
            loader = loader.profile_name(p);
        }
        if let S3Credentials::Static {
            access_key,
            secret_key,
            session_token,
        } = &config.credentials
        {
            loader = loader.credentials_provider(Credentials::new(
                access_key.clone(),
                secret_key.clone(),
                session_token.clone(),
                None,
                "objectcache-config",
            ));
        }
        let shared = loader.load().await;

        let mut b = aws_sdk_s3::config::Builder::from(&shared)
            .http_client(http)
            .force_path_style(addressing == Addressing::Path)
            .retry_config(
                RetryConfig::standard()
                    .with_max_attempts(config.max_attempts)
                    .with_initial_backoff(config.initial_backoff)
                    .with_max_backoff(config.max_backoff),
            )
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(config.connect_timeout)
                    .read_timeout(config.read_timeout)
                    .operation_attempt_timeout(config.attempt_timeout)
                    .operation_timeout(config.operation_timeout)
                    .build(),
            )
            // Our objects carry their own CRC32C per layer slice; S3 checksum headers and
            // aws-chunked trailers are not understood by every S3-compatible server.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            // Body stalls are caught by our own per-chunk idle timeout (read_timeout).
            .stalled_stream_protection(StalledStreamProtectionConfig::disabled());
        if let Some(e) = &config.endpoint {
            b = b.endpoint_url(e.trim_end_matches('/'));
        }
        let endpoint = config
            .endpoint
            .clone()
            .unwrap_or_else(|| "AWS S3".to_string());
        // The SDK's retry budget (a token bucket that a burst of 5xx/timeouts drains, after
        // which it stops retrying) is shared by every client of one partition in the process.
        // One partition per endpoint: a storm from one server or gateway must not cost the
        // others their retries (a gateway set, or several stores in one engine).
        b = b.retry_partition(RetryPartition::new(format!(
            "objectcache-s3 {endpoint} {}",
            config.region.as_deref().unwrap_or("")
        )));
        let gather_credentials = match &config.credentials {
            S3Credentials::Static {
                access_key,
                secret_key,
                ..
            } => Some((access_key.clone(), secret_key.clone())),
            S3Credentials::Chain => std::env::var("AWS_ACCESS_KEY_ID")
                .ok()
                .zip(std::env::var("AWS_SECRET_ACCESS_KEY").ok()),
        };
        Ok(S3Store {
            gather_credentials,
            conditional_put: tokio::sync::OnceCell::new(),
            client: aws_sdk_s3::Client::from_conf(b.build()),
            bucket: config.bucket,
            prefix: config.prefix,
            addressing,
            endpoint,
            host,
            read_timeout: config.read_timeout,
        })
    }

    /// The bucket.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The addressing in use.
    pub fn addressing(&self) -> Addressing {
        self.addressing
    }

    /// Checks that the bucket is reachable with these settings (one HEAD of the bucket).
    ///
    /// # Errors
    /// As the store's operations: a missing bucket, refused credentials, or an addressing that
    /// does not work with this endpoint (the message names the setting to use).
    pub async fn check(&self) -> Result<(), StoreError> {
        self.client
            .head_bucket()
            .bucket(&self.bucket)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| self.map_err(Op::Bucket, &self.bucket, e))
    }

    /// Creates the bucket if it does not exist (for tests and first-time set-up).
    ///
    /// # Errors
    /// A backend failure other than "already exists / owned by you".
    pub async fn create_bucket(&self) -> Result<(), StoreError> {
        match self
            .client
            .create_bucket()
            .bucket(&self.bucket)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.code(),
                    Some("BucketAlreadyOwnedByYou") | Some("BucketAlreadyExists")
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(self.map_err(Op::Bucket, &self.bucket, e)),
        }
    }

    fn map_err<E>(
        &self,
        op: Op,
        key: &str,
        err: SdkError<E, aws_smithy_runtime_api::http::Response>,
    ) -> StoreError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let cx = ErrCtx {
            bucket: &self.bucket,
            host: self.host.as_deref(),
            endpoint: &self.endpoint,
            addressing: self.addressing,
        };
        map_error(&cx, op, key, err)
    }

    /// Checks once per store that the endpoint honours `If-None-Match: *` on PUT, which
    /// first-writer-wins publication relies on (case C17): a create-only PUT of a new key
    /// must succeed and a second one must be refused with 412. The probe object lives under
    /// `_objectcache/conditional-put-check/` and is deleted afterwards. Three requests, once.
    ///
    /// # Errors
    /// [`StoreError::Incompatible`] naming the behaviour seen (cached: every later
    /// create-only PUT gets it too); a transient failure of a probe request (not cached: the
    /// next create-only PUT checks again).
    async fn check_conditional_put(&self) -> Result<(), StoreError> {
        let verdict = self
            .conditional_put
            .get_or_try_init(|| async {
                let nanos = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                let key = format!(
                    "_objectcache/conditional-put-check/{}-{nanos}",
                    std::process::id()
                );
                let put = || async {
                    self.client
                        .put_object()
                        .bucket(&self.bucket)
                        .key(self.full_key(&key))
                        .if_none_match("*")
                        .body(Bytes::from_static(b"c").into())
                        .send()
                        .await
                        .map_err(|e| self.map_err(Op::PutCreate, &key, e))
                };
                let first = put().await;
                let verdict = match first {
                    Err(StoreError::AlreadyExists { .. }) | Err(StoreError::Precondition { .. }) => {
                        Err(format!(
                            "it refused a create-only PUT (If-None-Match: *) of a new key with                              412 Precondition Failed; conditional PUTs are broken at {}, so                              ObjectCache cannot publish entries there safely",
                            self.endpoint
                        ))
                    }
                    Err(e) => return Err(e),
                    Ok(_) => match put().await {
                        Ok(_) => Err(format!(
                            "it accepted a second create-only PUT (If-None-Match: *) of an                              existing key: {} ignores If-None-Match, so two writers of one chunk                              could not be told apart (first-writer-wins publication needs it)",
                            self.endpoint
                        )),
                        Err(StoreError::AlreadyExists { .. }) => Ok(()),
                        Err(e) => {
                            let _ = self.delete(&key).await;
                            return Err(e);
                        }
                    },
                };
                let _ = self.delete(&key).await;
                Ok::<_, StoreError>(verdict)
            })
            .await?;
        verdict.clone().map_err(|message| StoreError::Incompatible {
            backend: "s3",
            message,
        })
    }

    fn full_key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.prefix)
        }
    }

    fn strip_prefix<'k>(&self, full: &'k str) -> &'k str {
        if self.prefix.is_empty() {
            full
        } else {
            full.strip_prefix(self.prefix.as_str())
                .and_then(|r| r.strip_prefix('/'))
                .unwrap_or(full)
        }
    }
}

fn to_system_time(t: Option<&aws_smithy_types::DateTime>) -> Option<SystemTime> {
    t.and_then(|d| SystemTime::try_from(*d).ok())
}

/// Total size from a `Content-Range: bytes a-b/size` header.
fn total_from_content_range(cr: &str) -> Option<u64> {
    cr.rsplit_once('/').and_then(|(_, t)| t.trim().parse().ok())
}

/// Streams an SDK body as our [`ByteStream`]: each chunk must arrive within `idle`, and the
/// body must hold exactly `want` bytes (an early end or an overrun is an error).
fn body_stream(
    key: String,
    body: aws_sdk_s3::primitives::ByteStream,
    want: u64,
    idle: Duration,
) -> ByteStream {
    struct St {
        key: String,
        body: aws_sdk_s3::primitives::ByteStream,
        got: u64,
        want: u64,
        idle: Duration,
        done: bool,
    }
    let st = St {
        key,
        body,
        got: 0,
        want,
        idle,
        done: false,
    };
    futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let next = match tokio::time::timeout(st.idle, st.body.next()).await {
            Err(_) => Some(Err(StoreError::Timeout {
                backend: BACKEND,
                message: format!(
                    "GET {}: no body bytes for {:?} after {} of {} bytes",
                    st.key, st.idle, st.got, st.want
                ),
            })),
            Ok(None) if st.got == st.want => None,
            Ok(None) => Some(Err(StoreError::Other {
                backend: BACKEND,
                message: format!(
                    "GET {}: body ended after {} of {} bytes",
                    st.key, st.got, st.want
                ),
            })),
            Ok(Some(Err(e))) => Some(Err(StoreError::Other {
                backend: BACKEND,
                message: format!(
                    "GET {}: body failed after {} of {} bytes: {}",
                    st.key,
                    st.got,
                    st.want,
                    DisplayErrorContext(&e)
                ),
            })),
            Ok(Some(Ok(b))) => {
                st.got += b.len() as u64;
                if st.got > st.want {
                    Some(Err(StoreError::Other {
                        backend: BACKEND,
                        message: format!(
                            "GET {}: body longer than the {} bytes expected",
                            st.key, st.want
                        ),
                    }))
                } else {
                    Some(Ok(b))
                }
            }
        };
        match next {
            None => None,
            Some(Err(e)) => {
                st.done = true;
                Some((Err(e), st))
            }
            Some(Ok(b)) => Some((Ok(b), st)),
        }
    })
    .boxed()
}

#[async_trait]
impl Store for S3Store {
    fn name(&self) -> &'static str {
        BACKEND
    }

    /// The endpoint's `host:port` when an endpoint is configured (an ObjectCache server or
    /// any S3 server: the connector's probe tells them apart); `None` for AWS S3.
    fn gather_target(&self) -> Option<super::GatherTarget> {
        let u = url::Url::parse(&self.endpoint).ok()?;
        // Gather is plaintext TCP: an `https://` endpoint is reached by ranged GETs only.
        if u.scheme() != "http" {
            return None;
        }
        let addr = format!("{}:{}", u.host_str()?, u.port_or_known_default()?);
        Some(super::GatherTarget {
            addr,
            bucket: self.bucket.clone(),
            key_prefix: self.prefix.clone(),
            credentials: self.gather_credentials.clone(),
        })
    }

    /// `connections` concurrent `HeadBucket` requests (at most 1,024): each answer, whatever
    /// its status, leaves a connection idle in the pool (up to
    /// [`S3Config::max_idle_connections`]). Transport failures are logged at debug level
    /// and not counted.
    async fn warm(&self, connections: usize) -> usize {
        let n = connections.min(1024);
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
        answered.into_iter().filter(|a| *a).count()
    }

    async fn get_opts(&self, key: &str, opts: GetOptions) -> Result<GetResult, StoreError> {
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
        let out = match req.send().await {
            Ok(o) => o,
            Err(e) => {
                return Err(match self.map_err(Op::Get, key, e) {
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
            Some(cr) => cr
                .trim_start_matches("bytes ")
                .split_once('/')
                .and_then(|(r, _)| r.split_once('-'))
                .and_then(|(a, b)| {
                    Some((
                        a.trim().parse::<u64>().ok()?,
                        b.trim().parse::<u64>().ok()? + 1,
                    ))
                }),
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

    async fn put_opts(
        &self,
        key: &str,
        data: Bytes,
        opts: PutOptions,
    ) -> Result<PutResult, StoreError> {
        validate_key(key)?;
        if opts.mode == PutMode::Create {
            self.check_conditional_put().await?;
        }
        let full = self.full_key(key);
        let mut req = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(&full)
            .body(data.into());
        let op = match opts.mode {
            PutMode::Overwrite => Op::Put,
            PutMode::Create => {
                req = req.if_none_match("*");
                Op::PutCreate
            }
        };
        let out = req.send().await.map_err(|e| self.map_err(op, key, e))?;
        Ok(PutResult {
            etag: out.e_tag().map(str::to_string),
        })
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
    ) -> Result<PutResult, StoreError> {
        let Some(n) = len else {
            let mut parts = Vec::new();
            let mut body = body;
            let mut got = 0u64;
            while let Some(p) = futures::StreamExt::next(&mut body).await {
                let p = p?;
                got += p.len() as u64;
                parts.push(p);
            }
            check_stream_len(key, got, len)?;
            let mut v = Vec::with_capacity(got as usize);
            parts.iter().for_each(|p| v.extend_from_slice(p));
            return self.put_opts(key, Bytes::from(v), opts).await;
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
        let mut req = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(&full)
            .content_length(n as i64)
            .body(aws_sdk_s3::primitives::ByteStream::new(sdk_body));
        let op = match opts.mode {
            PutMode::Overwrite => Op::Put,
            PutMode::Create => {
                req = req.if_none_match("*");
                Op::PutCreate
            }
        };
        let out = req.send().await.map_err(|e| self.map_err(op, key, e))?;
        Ok(PutResult {
            etag: out.e_tag().map(str::to_string),
        })
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        validate_key(key)?;
        let out = self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(self.full_key(key))
            .send()
            .await
            .map_err(|e| self.map_err(Op::Head, key, e))?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size: out.content_length().unwrap_or(0).max(0) as u64,
            last_modified: to_system_time(out.last_modified()),
            etag: out.e_tag().map(str::to_string),
        })
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
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
            Err(e) => match self.map_err(Op::Delete, key, e) {
                StoreError::NotFound { .. } => Ok(()),
                other => Err(other),
            },
        }
    }

    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<ObjectMeta>, StoreError> {
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
                .map_err(|e| self.map_err(Op::List, prefix, e))?;
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

/// A body stream made `Sync` (as the SDK's body requires) without locking: it is only ever
/// polled through `&mut`.
struct SyncBody<S>(std::sync::Mutex<S>);

impl<S: futures::Stream + Unpin> futures::Stream for SyncBody<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.0.get_mut() {
            Ok(s) => std::pin::Pin::new(s).poll_next(cx),
            Err(_) => std::task::Poll::Ready(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addressing_checks_name_the_setting_to_use() {
        let mut c = S3Config::new("kv.cache-test");
        c.endpoint = Some("http://127.0.0.1:7480".into());
        assert!(check_config(&c).is_ok());
        c.addressing = Some(Addressing::Virtual);
        let e = check_config(&c).unwrap_err().to_string();
        assert!(e.contains("use addressing=path"), "{e}");
        c.endpoint = Some("https://s3.example.com".into());
        let e = check_config(&c).unwrap_err().to_string();
        assert!(
            e.contains("dots") && e.contains("use addressing=path"),
            "{e}"
        );
        c.endpoint = Some("http://s3.example.com".into());
        assert!(check_config(&c).is_ok());
        c.bucket = "Upper_Case".into();
        let e = check_config(&c).unwrap_err().to_string();
        assert!(e.contains("use addressing=path"), "{e}");
    }

    #[test]
    fn bad_settings_are_named() {
        let mut c = S3Config::new("b");
        assert!(check_config(&c)
            .unwrap_err()
            .to_string()
            .contains("3 to 63"));
        c.bucket = "bucket".into();
        c.prefix = "/x".into();
        assert!(check_config(&c).unwrap_err().to_string().contains("prefix"));
        c.prefix = "x".into();
        c.endpoint = Some("ftp://h".into());
        assert!(check_config(&c)
            .unwrap_err()
            .to_string()
            .contains("http://"));
        c.endpoint = Some("not a url".into());
        assert!(check_config(&c)
            .unwrap_err()
            .to_string()
            .contains("not a URL"));
        assert!("sideways"
            .parse::<Addressing>()
            .unwrap_err()
            .to_string()
            .contains("'path' or 'virtual'"));
    }

    #[test]
    fn content_range_total() {
        assert_eq!(total_from_content_range("bytes 10-19/10000"), Some(10_000));
        assert_eq!(total_from_content_range("bytes */77"), Some(77));
        assert_eq!(total_from_content_range("garbage"), None);
    }

    #[tokio::test]
    async fn fixed_resolver_matches_wildcards_only_below_the_suffix() {
        use aws_smithy_runtime_api::client::dns::ResolveDns;
        let r = Resolver {
            fixed: vec![("*.localhost".into(), "127.0.0.9".parse().unwrap())],
        };
        assert_eq!(
            r.resolve_dns("kv.cache-test.localhost").await.unwrap(),
            vec!["127.0.0.9".parse::<std::net::IpAddr>().unwrap()]
        );
        assert!(r
            .resolve_dns("evillocalhost")
            .await
            .map(|v| !v.contains(&"127.0.0.9".parse().unwrap()))
            .unwrap_or(true));
    }
}
