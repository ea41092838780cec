//! The S3 endpoint that tests and benchmarks use, from the environment (feature `test-env`,
//! which the project's own tests and benchmarks turn on; not part of the library's API
//! otherwise, since its defaults carry the local test server's credentials).

use super::{Addressing, S3Config, S3Credentials, S3Store};
use crate::error::StoreResult;
use std::time::{Duration, SystemTime};

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
    pub async fn from_test_env(tag: &str) -> StoreResult<Option<(S3Store, String)>> {
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
