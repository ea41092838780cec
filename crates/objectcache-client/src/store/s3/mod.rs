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
//!   At a plain-`http://` endpoint a load's ranged GETs are presigned by the SDK and sent on
//!   connections of our own, so that their bodies are read straight into the engine's
//!   memory (`direct.rs`, [`Store::get_range_body`]).
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

mod body;
mod config;
mod direct;
mod errors;
mod ops;
mod resolver;
#[cfg(feature = "test-env")]
mod test_env;

pub use config::{Addressing, S3Config, S3Credentials};

use crate::error::{StoreError, StoreResult};
use crate::store::Store;
use aws_config::meta::region::RegionProviderChain;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::BehaviorVersion;
use aws_sdk_s3::config::retry::RetryPartition;
use aws_sdk_s3::config::{
    Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
    StalledStreamProtectionConfig,
};
use aws_sdk_s3::error::ProvideErrorMetadata;
use aws_smithy_http_client::tls;
use bytes::Bytes;
use config::check_config;
use errors::{map_error, ErrCtx, Op};
use resolver::Resolver;
use std::fmt;
use std::time::Duration;

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
    /// Ranged GETs read into the caller's memory (plain-`http://` endpoints; `direct.rs`).
    direct: Option<std::sync::Arc<direct::Direct>>,
    /// The retry policy every request has ([`S3Config::max_attempts`] and its backoff); a
    /// GET that the direct path already tried once gets one attempt fewer.
    retry: RetryConfig,
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
    pub async fn new(config: S3Config) -> StoreResult<Self> {
        let host = check_config(&config)?;
        let addressing = config.effective_addressing();

        let http = aws_smithy_http_client::Builder::new()
            .pool_max_idle_per_host(config.max_idle_connections)
            .pool_idle_timeout(config.idle_timeout)
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

        let retry = RetryConfig::standard()
            .with_max_attempts(config.max_attempts)
            .with_initial_backoff(config.initial_backoff)
            .with_max_backoff(config.max_backoff);
        let mut b = aws_sdk_s3::config::Builder::from(&shared)
            .http_client(http)
            .force_path_style(addressing == Addressing::Path)
            .retry_config(retry.clone())
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
        let direct = direct::Direct::new(config.endpoint.as_deref(), &config);
        Ok(S3Store {
            direct,
            retry,
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
    pub async fn check(&self) -> StoreResult<()> {
        self.client
            .head_bucket()
            .bucket(&self.bucket)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| map_error(&self.err_cx(), Op::Bucket, &self.bucket, e))
    }

    /// Creates the bucket if it does not exist (for tests and first-time set-up).
    ///
    /// # Errors
    /// A backend failure other than "already exists / owned by you".
    pub async fn create_bucket(&self) -> StoreResult<()> {
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
            Err(e) => Err(map_error(&self.err_cx(), Op::Bucket, &self.bucket, e)),
        }
    }

    /// What an error message names besides the key: the bucket, endpoint and addressing
    /// ([`errors::map_error`] maps an SDK error with it).
    fn err_cx(&self) -> ErrCtx<'_> {
        ErrCtx {
            bucket: &self.bucket,
            host: self.host.as_deref(),
            endpoint: &self.endpoint,
            addressing: self.addressing,
        }
    }

    /// Checks once per store that the endpoint honours `If-None-Match: *` on PUT, which
    /// first-writer-wins publication relies on (case C17): a create-only PUT of a new key
    /// must succeed and a second one must be refused with 412 (a 412 for the first is checked
    /// against the object: a retried PUT whose first try landed meets its own object). The
    /// probe object lives under `_objectcache/conditional-put-check/` and is deleted
    /// afterwards. Three or four requests, once.
    ///
    /// # Errors
    /// [`StoreError::Incompatible`] naming the behaviour seen (cached: every later
    /// create-only PUT gets it too); a transient failure of a probe request (not cached: the
    /// next create-only PUT checks again).
    async fn check_conditional_put(&self) -> StoreResult<()> {
        let verdict = self
            .conditional_put
            .get_or_try_init(|| async {
                // Unique per check: two stores of one process never probe the same key.
                let key = format!(
                    "_objectcache/conditional-put-check/{}",
                    crate::store::probe_id()
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
                        .map_err(|e| map_error(&self.err_cx(), Op::PutCreate, &key, e))
                };
                let refused = |e: &StoreError| {
                    matches!(
                        e,
                        StoreError::AlreadyExists { .. } | StoreError::Precondition { .. }
                    )
                };
                let verdict = match put().await {
                    // 412 for a key nobody else writes: either the endpoint refuses every
                    // create-only PUT, or the client's retry of our own PUT (its first try's
                    // answer lost or late, its write done) met the object it made. The object
                    // tells them apart: there only in the second case, which also shows the
                    // endpoint honouring If-None-Match.
                    Err(e) if refused(&e) => match self.head(&key).await {
                        Ok(_) => Ok(()),
                        Err(StoreError::NotFound { .. }) => Err(format!(
                            "it refused a create-only PUT (If-None-Match: *) of a new key with \
                             412 Precondition Failed; conditional PUTs are broken at {}, so \
                             ObjectCache cannot publish entries there safely",
                            self.endpoint
                        )),
                        Err(e) => return Err(e),
                    },
                    Err(e) => return Err(e),
                    Ok(_) => match put().await {
                        Ok(_) => Err(format!(
                            "it accepted a second create-only PUT (If-None-Match: *) of an \
                             existing key: {} ignores If-None-Match, so two writers of one chunk \
                             could not be told apart (first-writer-wins publication needs it)",
                            self.endpoint
                        )),
                        Err(e) if refused(&e) => Ok(()),
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

#[cfg(test)]
mod tests {
    use super::body::total_from_content_range;
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
