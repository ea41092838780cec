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

use super::{
    check_stream_len, resolve_range, validate_key, ByteStream, GetOptions, GetResult, ObjectMeta,
    PutMode, PutOptions, PutResult, Store,
};
use crate::error::StoreError;
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
use futures::StreamExt;
use std::fmt;
use std::net::IpAddr;
use std::ops::Range;
use std::time::{Duration, SystemTime};

const BACKEND: &str = "s3";

/// How the bucket appears in request URLs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addressing {
    /// `http://host:port/bucket/key`: works with any endpoint, including IP addresses,
    /// `localhost` and bucket names containing dots. The usual choice for Ceph RGW and MinIO.
    Path,
    /// `http://bucket.host:port/key`: the bucket is part of the host name, so the endpoint
    /// needs wildcard DNS (and, over https, a wildcard certificate, which excludes bucket names
    /// with dots). AWS S3's default.
    Virtual,
}

impl Addressing {
    /// The setting's name in store URLs (`addressing=path` or `addressing=virtual`).
    pub fn as_str(self) -> &'static str {
        match self {
            Addressing::Path => "path",
            Addressing::Virtual => "virtual",
        }
    }
}

impl fmt::Display for Addressing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Addressing {
    type Err = StoreError;
    /// Parses `path` or `virtual` (also `path-style`, `virtual-hosted`).
    fn from_str(s: &str) -> Result<Self, StoreError> {
        match s {
            "path" | "path-style" => Ok(Addressing::Path),
            "virtual" | "virtual-hosted" => Ok(Addressing::Virtual),
            other => Err(config_error(format!(
                "addressing must be 'path' or 'virtual', not {other:?}"
            ))),
        }
    }
}

/// Where the store's credentials come from.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum S3Credentials {
    /// The AWS default chain: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`(/`AWS_SESSION_TOKEN`),
    /// then the profile (`AWS_PROFILE` or [`S3Config::profile`]) in `~/.aws/credentials` and
    /// `~/.aws/config`, then web identity, container and instance metadata.
    #[default]
    Chain,
    /// Fixed keys, e.g. from the application's own configuration.
    Static {
        /// Access key id.
        access_key: String,
        /// Secret access key.
        secret_key: String,
        /// Session token of temporary credentials.
        session_token: Option<String>,
    },
}

impl fmt::Debug for S3Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            S3Credentials::Chain => f.write_str("Chain"),
            // Never print secrets.
            S3Credentials::Static { access_key, .. } => {
                write!(f, "Static {{ access_key: {access_key:?}, .. }}")
            }
        }
    }
}

/// Settings of an [`S3Store`]. Start from [`S3Config::new`] and change fields.
#[derive(Debug, Clone)]
pub struct S3Config {
    /// Bucket name (must exist).
    pub bucket: String,
    /// Key prefix inside the bucket, without leading or trailing `/` (empty: none). Store keys
    /// become `prefix/key`; listings return keys without it.
    pub prefix: String,
    /// Endpoint URL (`http://127.0.0.1:7480`); `None` uses AWS S3 for the region.
    pub endpoint: Option<String>,
    /// Region for SigV4 signing; `None` takes `AWS_REGION`/`AWS_DEFAULT_REGION`, then the
    /// profile's, then `us-east-1`.
    pub region: Option<String>,
    /// Addressing; `None` picks path-style when `endpoint` is set and virtual-hosted otherwise.
    pub addressing: Option<Addressing>,
    /// Credentials.
    pub credentials: S3Credentials,
    /// Profile name for the default chain (instead of `AWS_PROFILE`/`default`).
    pub profile: Option<String>,
    /// Attempts per request, first one included (at least 1). Default 4.
    pub max_attempts: u32,
    /// First retry's backoff bound; doubles per retry, with full jitter. Default 50 ms.
    pub initial_backoff: Duration,
    /// Largest backoff between two attempts. Default 2 s.
    pub max_backoff: Duration,
    /// TCP (and TLS) connect timeout. Default 5 s.
    pub connect_timeout: Duration,
    /// Longest wait for response headers, and for each chunk of a response body. Default 30 s.
    pub read_timeout: Duration,
    /// Longest time for one attempt until its response headers. Default 60 s.
    pub attempt_timeout: Duration,
    /// Longest time for a whole request, retries included, until its response headers.
    /// Default 120 s.
    pub operation_timeout: Duration,
    /// Idle connections kept open to the endpoint for reuse. Default 256, so that a load with
    /// hundreds of ranged GETs in flight does not reconnect for each.
    pub max_idle_connections: usize,
    /// Host names resolved to fixed addresses instead of by DNS, like curl's `--resolve`:
    /// `(name, ip)`, where `name` is a host name or `*.suffix` for every name below `suffix`.
    /// For virtual-hosted addressing against a test endpoint without wildcard DNS.
    pub resolve: Vec<(String, IpAddr)>,
    /// PEM file of the certificate authorities to trust for an `https://` endpoint instead
    /// of the system's (e.g. a self-signed server's CA). Store URL parameter `ca_file`.
    /// Default none (system roots).
    pub ca_file: Option<std::path::PathBuf>,
}

impl S3Config {
    /// Defaults for a bucket: default credential chain, AWS endpoint, figures as documented on
    /// each field.
    pub fn new(bucket: impl Into<String>) -> Self {
        S3Config {
            bucket: bucket.into(),
            prefix: String::new(),
            endpoint: None,
            region: None,
            addressing: None,
            credentials: S3Credentials::Chain,
            profile: None,
            max_attempts: 4,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(60),
            operation_timeout: Duration::from_secs(120),
            max_idle_connections: 256,
            resolve: Vec::new(),
            ca_file: None,
        }
    }

    /// The addressing in force (the explicit setting, else the default described on
    /// [`S3Config::addressing`]).
    pub fn effective_addressing(&self) -> Addressing {
        self.addressing.unwrap_or(if self.endpoint.is_some() {
            Addressing::Path
        } else {
            Addressing::Virtual
        })
    }
}

fn config_error(message: String) -> StoreError {
    StoreError::Other {
        backend: BACKEND,
        message: format!("invalid S3 configuration: {message}"),
    }
}

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

/// Checks the parts of a configuration that need no network; returns the endpoint's host.
fn check_config(c: &S3Config) -> Result<Option<String>, StoreError> {
    let b = &c.bucket;
    if b.len() < 3 || b.len() > 63 {
        return Err(config_error(format!(
            "bucket name {b:?} must be 3 to 63 characters"
        )));
    }
    if !b
        .bytes()
        .all(|x| x.is_ascii_alphanumeric() || matches!(x, b'.' | b'-' | b'_'))
    {
        return Err(config_error(format!(
            "bucket name {b:?} may hold only letters, digits, '.', '-' and '_'"
        )));
    }
    if c.prefix.starts_with('/') || c.prefix.ends_with('/') {
        return Err(config_error(format!(
            "key prefix {:?} must not start or end with '/'",
            c.prefix
        )));
    }
    if !c.prefix.is_empty() {
        validate_key(&c.prefix).map_err(|e| config_error(format!("key prefix: {e}")))?;
    }
    if c.max_attempts == 0 {
        return Err(config_error("max_attempts must be at least 1".into()));
    }
    let host = match &c.endpoint {
        None => None,
        Some(e) => {
            let u = url::Url::parse(e)
                .map_err(|err| config_error(format!("endpoint {e:?} is not a URL: {err}")))?;
            if u.scheme() != "http" && u.scheme() != "https" {
                return Err(config_error(format!(
                    "endpoint {e:?} must start with http:// or https://"
                )));
            }
            Some(
                u.host_str()
                    .ok_or_else(|| config_error(format!("endpoint {e:?} has no host")))?
                    .to_string(),
            )
        }
    };
    if c.effective_addressing() == Addressing::Virtual {
        let https = c
            .endpoint
            .as_deref()
            .is_none_or(|e| e.starts_with("https:"));
        if let Some(h) = &host {
            let h = h.trim_start_matches('[').trim_end_matches(']');
            if h.parse::<IpAddr>().is_ok() {
                return Err(config_error(format!(
                    "virtual-hosted addressing puts the bucket in the host name, which an IP address endpoint ({h}) cannot have: use addressing=path"
                )));
            }
        }
        if !b
            .bytes()
            .all(|x| x.is_ascii_lowercase() || x.is_ascii_digit() || matches!(x, b'.' | b'-'))
        {
            return Err(config_error(format!(
                "bucket name {b:?} is not a valid DNS label, as virtual-hosted addressing needs: use addressing=path"
            )));
        }
        if https && b.contains('.') {
            return Err(config_error(format!(
                "bucket name {b:?} has dots, which no wildcard TLS certificate matches under virtual-hosted addressing over https: use addressing=path"
            )));
        }
    }
    Ok(host)
}

/// DNS resolution with fixed answers for some names ([`S3Config::resolve`]).
#[derive(Debug, Clone)]
struct Resolver {
    fixed: Vec<(String, IpAddr)>,
}

impl aws_smithy_runtime_api::client::dns::ResolveDns for Resolver {
    fn resolve_dns<'a>(
        &'a self,
        name: &'a str,
    ) -> aws_smithy_runtime_api::client::dns::DnsFuture<'a> {
        use aws_smithy_runtime_api::client::dns::{DnsFuture, ResolveDnsError};
        let hit = self
            .fixed
            .iter()
            .find(|(pat, _)| match pat.strip_prefix("*.") {
                Some(suffix) => {
                    name.len() > suffix.len() + 1
                        && name.ends_with(suffix)
                        && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
                }
                None => pat.eq_ignore_ascii_case(name),
            });
        if let Some((_, ip)) = hit {
            return DnsFuture::ready(Ok(vec![*ip]));
        }
        DnsFuture::new(async move {
            let addrs = tokio::net::lookup_host((name, 0))
                .await
                .map_err(ResolveDnsError::new)?;
            Ok(addrs.map(|a| a.ip()).collect())
        })
    }
}

/// What a request was doing, for [`map_error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Get,
    Put,
    PutCreate,
    Head,
    Delete,
    List,
    /// A request on the bucket itself (HEAD or create bucket).
    Bucket,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Get => "GET",
            Op::Put | Op::PutCreate => "PUT",
            Op::Head => "HEAD",
            Op::Delete => "DELETE",
            Op::List => "LIST",
            Op::Bucket => "bucket request",
        }
    }
}

/// Context that [`map_error`] needs about the store.
struct ErrCtx<'a> {
    bucket: &'a str,
    /// The endpoint's host name, where known.
    host: Option<&'a str>,
    endpoint: &'a str,
    addressing: Addressing,
}

/// Turns an SDK failure into a [`StoreError`]: the one place where HTTP statuses and S3 error
/// codes get their meaning.
///
/// | status / failure | error |
/// |---|---|
/// | 404 (`NoSuchKey`, `NotFound`) | [`StoreError::NotFound`] |
/// | 404 `NoSuchBucket` | `Other`, naming the bucket and, for virtual-hosted, suggesting path-style |
/// | 412 on a create-only PUT (also 409 `ConditionalRequestConflict`) | [`StoreError::AlreadyExists`] |
/// | 412 otherwise | [`StoreError::Precondition`] |
/// | 416 | [`StoreError::InvalidRange`] (size 0 here; the caller fills it in) |
/// | 401, 403 | [`StoreError::PermissionDenied`] |
/// | 301, 307, `PermanentRedirect`, `AuthorizationHeaderMalformed` | `Other`, suggesting the other addressing or region |
/// | timeouts | [`StoreError::Timeout`] |
/// | DNS or connect failure | `Other`; for virtual-hosted, suggesting path-style |
/// | anything else (5xx after retries, ...) | `Other` with status, code and message |
fn map_error<E>(
    cx: &ErrCtx<'_>,
    op: Op,
    key: &str,
    err: SdkError<E, aws_smithy_runtime_api::http::Response>,
) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let status = err.raw_response().map(|r| r.status().as_u16());
    let code = err.code().unwrap_or("").to_string();
    let server_msg = err.message().unwrap_or("").to_string();
    let other_way = match cx.addressing {
        Addressing::Path => Addressing::Virtual,
        Addressing::Virtual => Addressing::Path,
    };
    let detail = || {
        let mut s = format!("{} {key}", op.name());
        if let Some(st) = status {
            s.push_str(&format!(": HTTP {st}"));
        }
        if !code.is_empty() {
            s.push_str(&format!(" {code}"));
        }
        if !server_msg.is_empty() {
            s.push_str(&format!(": {server_msg}"));
        }
        if status.is_none() {
            s.push_str(&format!(": {}", DisplayErrorContext(&err)));
        }
        s
    };
    match &err {
        SdkError::TimeoutError(_) => {
            return StoreError::Timeout {
                backend: BACKEND,
                message: format!("{} {key} to {}", op.name(), cx.endpoint),
            }
        }
        SdkError::DispatchFailure(d) if d.is_timeout() => {
            return StoreError::Timeout {
                backend: BACKEND,
                message: detail(),
            }
        }
        SdkError::DispatchFailure(d) if d.is_io() && cx.addressing == Addressing::Virtual => {
            return StoreError::Other {
                backend: BACKEND,
                message: format!(
                    "{}; with virtual-hosted addressing the request goes to host {}.{}, which did not resolve or connect: if {} serves buckets as path segments or has no wildcard DNS, use addressing=path",
                    detail(),
                    cx.bucket,
                    cx.host.unwrap_or("<endpoint host>"),
                    cx.endpoint
                ),
            };
        }
        SdkError::DispatchFailure(_) | SdkError::ConstructionFailure(_) => {
            return StoreError::Other {
                backend: BACKEND,
                message: detail(),
            }
        }
        _ => {}
    }
    match (status, code.as_str()) {
        (_, "NoSuchBucket") | (Some(404), _) if code == "NoSuchBucket" || op == Op::Bucket => {
            let hint = match cx.addressing {
                Addressing::Virtual => format!(
                    "; with virtual-hosted addressing the endpoint must take the bucket from the Host header: if {} expects it in the path, use addressing=path",
                    cx.endpoint
                ),
                Addressing::Path => String::new(),
            };
            StoreError::Other { backend: BACKEND, message: format!("bucket {:?} does not exist at {} ({}){hint}", cx.bucket, cx.endpoint, detail()) }
        }
        (Some(404), _) | (_, "NoSuchKey") | (_, "NotFound") => StoreError::NotFound { key: key.to_string() },
        (Some(412), _) | (Some(409), "ConditionalRequestConflict") if op == Op::PutCreate => {
            StoreError::AlreadyExists { key: key.to_string() }
        }
        (Some(412), _) => StoreError::Precondition { key: key.to_string() },
        (Some(416), _) | (_, "InvalidRange") => StoreError::InvalidRange { key: key.to_string(), start: 0, end: 0, size: 0 },
        (Some(301) | Some(307), _) | (_, "PermanentRedirect") | (_, "AuthorizationHeaderMalformed") => StoreError::Other {
            backend: BACKEND,
            message: format!(
                "{}; the endpoint redirects requests for bucket {:?}: it wants {other_way} addressing (addressing={other_way}) or another region",
                detail(),
                cx.bucket
            ),
        },
        (Some(401) | Some(403), _) => StoreError::PermissionDenied { backend: BACKEND, message: detail() },
        _ => StoreError::Other { backend: BACKEND, message: detail() },
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

/// Environment variables naming the S3 endpoint that tests use (see [`S3Store::from_test_env`]).
pub const TEST_ENV_ENDPOINT: &str = "OBJECTCACHE_TEST_S3_ENDPOINT";

impl S3Config {
    /// The settings of the S3 endpoint that tests and benchmarks use, from the environment
    /// (defaults match `scripts/ceph-rgw/start.sh`): `OBJECTCACHE_TEST_S3_ENDPOINT`
    /// (`http://127.0.0.1:7480`), `OBJECTCACHE_TEST_S3_ACCESS_KEY` (`cephtestak`),
    /// `OBJECTCACHE_TEST_S3_SECRET_KEY` (`cephtestsecretkey0123456789`),
    /// `OBJECTCACHE_TEST_S3_BUCKET` (`objectcache-test`), `OBJECTCACHE_TEST_S3_REGION`
    /// (`us-east-1`); path-style addressing.
    pub fn from_test_env() -> S3Config {
        let var = |k: &str, d: &str| {
            std::env::var(k)
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| d.to_string())
        };
        let mut c = S3Config::new(var("OBJECTCACHE_TEST_S3_BUCKET", "objectcache-test"));
        c.endpoint = Some(var(TEST_ENV_ENDPOINT, "http://127.0.0.1:7480"));
        c.region = Some(var("OBJECTCACHE_TEST_S3_REGION", "us-east-1"));
        c.addressing = Some(Addressing::Path);
        c.credentials = S3Credentials::Static {
            access_key: var("OBJECTCACHE_TEST_S3_ACCESS_KEY", "cephtestak"),
            secret_key: var(
                "OBJECTCACHE_TEST_S3_SECRET_KEY",
                "cephtestsecretkey0123456789",
            ),
            session_token: None,
        };
        c
    }

    /// `true` if something accepts TCP connections at the endpoint's host and port within
    /// 2 s (no request is sent). Tests use it to tell "no server" from "server fails".
    pub async fn endpoint_accepts_connections(&self) -> bool {
        let Some(hostport) = self
            .endpoint
            .as_deref()
            .and_then(|e| url::Url::parse(e).ok())
            .and_then(|u| Some(format!("{}:{}", u.host_str()?, u.port_or_known_default()?)))
        else {
            return false;
        };
        matches!(
            tokio::time::timeout(
                Duration::from_secs(2),
                tokio::net::TcpStream::connect(&hostport)
            )
            .await,
            Ok(Ok(_))
        )
    }
}

impl S3Store {
    /// Connects to the S3 endpoint of [`S3Config::from_test_env`] and makes sure its bucket
    /// exists; returns the store (no key prefix) and a key prefix unique to this call
    /// (`{tag}-{pid}-{nanoseconds since 1970}`), or `None` when nothing listens at the
    /// endpoint. For tests and benchmarks.
    ///
    /// # Errors
    /// An endpoint that accepts connections but refuses the bucket or the credentials.
    pub async fn from_test_env(tag: &str) -> Result<Option<(S3Store, String)>, StoreError> {
        let c = S3Config::from_test_env();
        if !c.endpoint_accepts_connections().await {
            return Ok(None);
        }
        let store = S3Store::new(c).await?;
        store.create_bucket().await?;
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        Ok(Some((
            store,
            format!("{tag}-{}-{nanos}", std::process::id()),
        )))
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
            vec!["127.0.0.9".parse::<IpAddr>().unwrap()]
        );
        assert!(r
            .resolve_dns("evillocalhost")
            .await
            .map(|v| !v.contains(&"127.0.0.9".parse().unwrap()))
            .unwrap_or(true));
    }
}
