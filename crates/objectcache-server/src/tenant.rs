//! Tenants: per-tenant S3 credentials, each confined to its own namespace of every bucket.
//!
//! A tenant's access key sees a bucket as rooted at `{namespace}/`: object `k` of bucket `b`
//! is store key `b/{namespace}/k`, listings start there and show keys relative to it. A tenant
//! therefore cannot name, read, list or probe another tenant's objects: any key it sends lands
//! inside its own root (keys with `..`, empty or `.` segments, control bytes, a leading `/` or
//! over 1,024 bytes are refused before the store is touched, [`objectcache_client::store::validate_key`]),
//! and asking for another tenant's key asks for a key of its own, which is a plain miss.
//! Tenants cannot create or delete buckets. Keys of `access_keys` (operators) see the whole
//! bucket, tenants' namespaces included.
//!
//! Gather loads are not confined to a tenant's namespace yet, so a server with tenants
//! refuses gather connections (the connector then uses ranged GETs, which SigV4 covers).

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// What [`super::config::ServerConfig::redacted`] shows in place of a secret.
pub const REDACTED: &str = "<redacted>";

/// Longest tenant namespace, bytes.
pub const MAX_NAMESPACE_LEN: usize = 64;

/// One tenant: its S3 credentials, its namespace and, optionally, its chunk-hash salt
/// (`Debug` shows no secret).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Access key id (unique among tenants and `access_keys`).
    pub access_key: String,
    /// Secret access key.
    pub secret_key: String,
    /// The tenant's root in every bucket: 1 to 64 bytes of `a-z`, `0-9`, `-`, `_`, `.`, not
    /// starting with `.`, `_` or `-`; unique among tenants.
    pub namespace: String,
    /// The cache salt this tenant's serving engine puts into its chunk hashes (vLLM's
    /// `cache_salt`; [`objectcache_client::hash::HashParams::with_salt`]), so equal prompts
    /// of two tenants never share a key, and one tenant cannot learn from timing whether
    /// another cached a prompt. The server never sees tokens; it records the salt so that one
    /// file holds a tenant's whole setup.
    #[serde(default)]
    pub salt: Option<String>,
}

impl std::fmt::Debug for TenantConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantConfig")
            .field("access_key", &self.access_key)
            .field("secret_key", &REDACTED)
            .field("namespace", &self.namespace)
            .field("salt", &self.salt.as_ref().map(|_| REDACTED))
            .finish()
    }
}

/// A tenant list a server cannot take ([`validate_namespace`], [`Tenants::new`]); each names
/// the tenant's namespace or access key and the rule broken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantError {
    /// A namespace of no bytes or of more than `MAX_NAMESPACE_LEN` (64).
    #[error("tenant namespace {0:?} must be 1 to {MAX_NAMESPACE_LEN} bytes")]
    NamespaceLength(String),
    /// A namespace with a byte other than `a-z`, `0-9`, `-`, `_` and `.`.
    #[error("tenant namespace {0:?} may hold only a-z, 0-9, '-', '_' and '.'")]
    NamespaceCharacters(String),
    /// A namespace that starts with `.`, `_` or `-`.
    #[error("tenant namespace {0:?} must not start with '.', '_' or '-'")]
    NamespaceStart(String),
    /// A tenant (its namespace) without an access key or a secret key.
    #[error("tenant {0:?} needs an access key and a secret key")]
    MissingKey(String),
    /// Two tenants with one namespace.
    #[error("tenant namespace {0:?} appears twice")]
    DuplicateNamespace(String),
    /// Two tenants with one access key.
    #[error("tenant access key {0:?} appears twice")]
    DuplicateAccessKey(String),
}

/// Checks a tenant namespace.
///
/// # Errors
/// [`TenantError`] naming the rule broken.
pub fn validate_namespace(ns: &str) -> Result<(), TenantError> {
    if ns.is_empty() || ns.len() > MAX_NAMESPACE_LEN {
        return Err(TenantError::NamespaceLength(ns.to_string()));
    }
    if !ns
        .bytes()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"-_.".contains(&c))
    {
        return Err(TenantError::NamespaceCharacters(ns.to_string()));
    }
    if ns.starts_with(['.', '_', '-']) {
        return Err(TenantError::NamespaceStart(ns.to_string()));
    }
    Ok(())
}

/// The tenants of a server, by access key.
#[derive(Debug, Clone, Default)]
pub struct Tenants {
    by_key: HashMap<String, TenantConfig>,
}

impl Tenants {
    /// Indexes `list` by access key.
    ///
    /// # Errors
    /// [`TenantError`] if a namespace is invalid, a key is missing, or an access key or
    /// namespace appears twice.
    pub fn new(list: &[TenantConfig]) -> Result<Self, TenantError> {
        let mut by_key = HashMap::new();
        let mut namespaces = std::collections::HashSet::new();
        for t in list {
            validate_namespace(&t.namespace)?;
            if t.access_key.is_empty() || t.secret_key.is_empty() {
                return Err(TenantError::MissingKey(t.namespace.clone()));
            }
            if !namespaces.insert(t.namespace.clone()) {
                return Err(TenantError::DuplicateNamespace(t.namespace.clone()));
            }
            if by_key.insert(t.access_key.clone(), t.clone()).is_some() {
                return Err(TenantError::DuplicateAccessKey(t.access_key.clone()));
            }
        }
        Ok(Tenants { by_key })
    }

    /// `true` if no tenant is configured.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// The tenant of `access_key`, if it is a tenant's.
    pub fn get(&self, access_key: &str) -> Option<&TenantConfig> {
        self.by_key.get(access_key)
    }

    /// The namespace inside every bucket that requests signed with `access_key` are
    /// confined to (keys go under `"{namespace}/"`), or `""` (the whole bucket) for a key that
    /// is not a tenant's.
    pub fn root(&self, access_key: Option<&str>) -> &str {
        access_key
            .and_then(|k| self.by_key.get(k))
            .map_or("", |t| t.namespace.as_str())
    }
}

/// Answers a gather connection with an `Unsupported` error frame and closes it: the
/// client's hello probe reads it as "gather not offered" and uses ranged GETs.
pub(crate) async fn refuse_gather(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let mut b = bytes::BytesMut::new();
    objectcache_client::protocol::Frame::Error {
        code: objectcache_client::protocol::ErrorCode::Unsupported,
        message: "gather is not offered on a server with tenants (loads are not confined to a namespace yet); use the S3 API".into(),
    }
    .encode(&mut b);
    let _ = stream.write_all(&b).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ak: &str, ns: &str) -> TenantConfig {
        TenantConfig {
            access_key: ak.into(),
            secret_key: "s".into(),
            namespace: ns.into(),
            salt: None,
        }
    }

    #[test]
    fn namespaces_are_checked() {
        for bad in [
            "",
            "..",
            ".a",
            "_a",
            "-a",
            "a/b",
            "A",
            "a b",
            "a\0",
            &"x".repeat(65),
        ] {
            assert!(validate_namespace(bad).is_err(), "{bad:?}");
        }
        for good in ["a", "acme", "team-1.prod_x", &"x".repeat(64)] {
            assert!(validate_namespace(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn duplicates_are_refused_and_roots_found() {
        assert_eq!(
            Tenants::new(&[t("k", "a"), t("k", "b")]).unwrap_err(),
            TenantError::DuplicateAccessKey("k".into())
        );
        assert_eq!(
            Tenants::new(&[t("k1", "a"), t("k2", "a")]).unwrap_err(),
            TenantError::DuplicateNamespace("a".into())
        );
        let ts = Tenants::new(&[t("k1", "a"), t("k2", "b")]).unwrap();
        assert_eq!(ts.root(Some("k1")), "a");
        assert_eq!(ts.root(Some("k2")), "b");
        assert_eq!(ts.root(Some("operator")), "");
        assert_eq!(ts.root(None), "");
    }
}
