//! S3 store settings ([`S3Config`]: endpoint, region, addressing, credentials, timeouts,
//! retries) and the checks that need no network.

use super::BACKEND;
use crate::error::{StoreError, StoreResult};
use crate::store::validate_key;
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

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
    fn from_str(s: &str) -> StoreResult<Self> {
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

/// Settings of an [`S3Store`](super::S3Store). Start from [`S3Config::new`] and change fields.
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
    /// How long an idle connection is kept for reuse, in both pools (the SDK's and the
    /// direct path's). Keep it below the time after which the server closes idle
    /// connections, which `objectcache doctor` measures: a request sent on a connection the
    /// server is closing can fail. Store URL parameter `idle_timeout_s` (seconds, at least
    /// 0.01). Default 60 s.
    pub idle_timeout: Duration,
    /// Host names resolved to fixed addresses instead of by DNS, like curl's `--resolve`:
    /// `(name, ip)`, where `name` is a host name or `*.suffix` for every name below `suffix`.
    /// For virtual-hosted addressing against a test endpoint without wildcard DNS.
    pub resolve: Vec<(String, IpAddr)>,
    /// PEM file of the certificate authorities to trust for an `https://` endpoint instead
    /// of the system's (e.g. a self-signed server's CA). Store URL parameter `ca_file`.
    /// Default none (system roots).
    pub ca_file: Option<std::path::PathBuf>,
    /// At a plain-`http://` endpoint, read a load's ranged GETs straight into the engine's
    /// memory: the SDK presigns each GET and the store sends it on a connection of its own
    /// (`direct.rs`), one copy of every byte fewer than through the SDK's HTTP client. Any
    /// answer but a plain `206` is read again through the SDK; a server that refuses
    /// presigned requests turns it off by itself. Store URL parameter `read_into_place`
    /// (`true` or `false`). Default `true`; ignored for `https://` and AWS S3.
    pub read_into_place: bool,
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
            idle_timeout: Duration::from_secs(60),
            resolve: Vec::new(),
            ca_file: None,
            read_into_place: true,
        }
    }

    /// An S3-compatible server at `endpoint` (e.g. `http://127.0.0.1:9000`: MinIO, Ceph RGW,
    /// an ObjectCache server) with the static key pair `access_key` / `secret_key`: bucket
    /// `bucket`, path-style addressing, region `us-east-1` (which such servers take when they
    /// do not check it); every other setting as [`S3Config::new`].
    pub fn at_endpoint(
        bucket: impl Into<String>,
        endpoint: impl Into<String>,
        access_key: impl Into<String>,
        secret_key: impl Into<String>,
    ) -> Self {
        S3Config {
            endpoint: Some(endpoint.into()),
            region: Some("us-east-1".into()),
            addressing: Some(Addressing::Path),
            credentials: S3Credentials::Static {
                access_key: access_key.into(),
                secret_key: secret_key.into(),
                session_token: None,
            },
            ..S3Config::new(bucket)
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

pub(super) fn config_error(message: String) -> StoreError {
    StoreError::Other {
        backend: BACKEND,
        message: format!("invalid S3 configuration: {message}"),
    }
}

/// Checks the parts of a configuration that need no network; returns the endpoint's host.
pub(super) fn check_config(c: &S3Config) -> StoreResult<Option<String>> {
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
