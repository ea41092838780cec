//! Store URLs: one string that names a backend and its settings, for command lines and
//! configuration files.
//!
//! | URL | store |
//! |---|---|
//! | `file:///var/cache/kv`, `/var/cache/kv`, `./kv` | [`FsStore`] rooted there (created if missing) |
//! | `memory://` | a new, empty [`MemoryStore`] |
//! | `s3://bucket[/prefix]?endpoint=URL&region=R&addressing=path\|virtual&profile=P` | `S3Store` (feature `s3`) |
//!
//! `s3://` query parameters, all optional: `endpoint` (e.g. `http://127.0.0.1:7480`; default
//! AWS S3), `region` (default from `AWS_REGION`, the profile, else `us-east-1`), `addressing`
//! (default `path` with an endpoint, `virtual` without), `profile` (AWS profile name), `ca_file` (PEM CAs to trust for an `https://` endpoint),
//! `max_attempts` (attempts per request, default 4), `idle_timeout_s` (how long pooled
//! connections idle before they are closed, default 60; below the server's own limit, which
//! `objectcache doctor` measures). Credentials are never part of a URL: they
//! come from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`) or a profile.
//!
//! Several endpoints serving the same bucket (ObjectCache gateways, the RGWs of one Ceph
//! cluster) make a `GatewayStore`: `endpoint=URL1,URL2,...`, or `resolve=all` to take every
//! address the endpoint's host name resolves to; `placement` (`two-choice`, `hash`,
//! `least-loaded`) and `health_interval_ms` (default 1000) set how it spreads and checks them.
#![forbid(unsafe_code)]

use super::{FsStore, FsyncPolicy, MemoryStore, Store};
use crate::error::{StoreError, StoreResult};
use std::sync::Arc;

fn bad(url: &str, why: impl std::fmt::Display) -> StoreError {
    StoreError::Other {
        backend: "url",
        message: format!("bad store URL {url:?}: {why}"),
    }
}

/// Opens the store a URL names (see the module documentation for the grammar).
///
/// # Errors
/// `StoreError::Other` naming the URL and what is wrong with it: an unknown scheme, an unknown
/// or repeated query parameter, a missing bucket, an `s3://` URL in a build without feature
/// `s3`, or the backend's own error (an unusable directory, an S3 setting that cannot work).
pub async fn open_store(url: &str) -> StoreResult<Arc<dyn Store>> {
    open(url, true).await
}

/// Opens the store a URL names, as [`open_store`] does, except that a directory store must
/// exist already: for tools that inspect or collect a store (`objectcache stat`, `gc`), a
/// mistyped path is refused rather than created empty.
///
/// # Errors
/// Those of [`open_store`], and `StoreError::Other` naming the URL when its directory does
/// not exist or is not a directory.
pub async fn open_existing_store(url: &str) -> StoreResult<Arc<dyn Store>> {
    open(url, false).await
}

/// What identifies the objects a store URL names, for state that engines opened on it in one
/// process share (their lookup cache and loads in flight): `fs:` and the directory's
/// canonical path for a file store (after it was opened, so the directory exists), `s3:` and
/// the URL for an S3 store (its bucket, prefix and endpoints); `None` for `memory://` (each
/// such URL opens a new store) and for a URL that does not parse.
pub fn shared_identity(url: &str) -> Option<String> {
    let url = url.trim();
    let path = match url.split_once("://") {
        None => std::path::PathBuf::from(url),
        Some(("file", _)) => url::Url::parse(url).ok()?.to_file_path().ok()?,
        Some(("s3", _)) => return Some(format!("s3:{url}")),
        Some(_) => return None,
    };
    let path = std::fs::canonicalize(path).ok()?;
    Some(format!("fs:{}", path.display()))
}

async fn open(url: &str, create: bool) -> StoreResult<Arc<dyn Store>> {
    let url = url.trim();
    if url.is_empty() {
        return Err(bad(
            url,
            "empty; expected file:///PATH, a path, memory:// or s3://BUCKET[/PREFIX]",
        ));
    }
    let Some((scheme, _)) = url.split_once("://") else {
        // A plain path.
        return open_fs(url, url, create);
    };
    match scheme {
        "file" => {
            let u = url::Url::parse(url).map_err(|e| bad(url, e))?;
            if u.host_str()
                .is_some_and(|h| !h.is_empty() && h != "localhost")
            {
                return Err(bad(
                    url,
                    "file URLs take no host: write file:///absolute/path",
                ));
            }
            if u.query().is_some() {
                return Err(bad(url, "file URLs take no query parameters"));
            }
            let path = u
                .to_file_path()
                .map_err(|()| bad(url, "not a local absolute path"))?;
            open_fs(url, &path.to_string_lossy(), create)
        }
        "memory" => {
            if url != "memory://" && url != "memory:///" {
                return Err(bad(url, "memory:// takes no path or parameters"));
            }
            Ok(Arc::new(MemoryStore::new()))
        }
        "s3" => open_s3(url).await,
        other => Err(bad(
            url,
            format!("unknown scheme {other:?}; expected file, memory or s3"),
        )),
    }
}

fn open_fs(url: &str, path: &str, create: bool) -> StoreResult<Arc<dyn Store>> {
    if !create && !std::path::Path::new(path).is_dir() {
        return Err(bad(
            url,
            "no such directory (this command does not create a store)",
        ));
    }
    let store = FsStore::new(path, FsyncPolicy::default()).map_err(|e| bad(url, e))?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "s3"))]
async fn open_s3(url: &str) -> StoreResult<Arc<dyn Store>> {
    Err(bad(
        url,
        "this build has no S3 support (enable the cargo feature `s3`)",
    ))
}

#[cfg(feature = "s3")]
async fn open_s3(url: &str) -> StoreResult<Arc<dyn Store>> {
    let p = parse_s3(url)?;
    if p.endpoints.len() <= 1 && !p.resolve_all && p.gateway_opts.is_none() {
        return Ok(Arc::new(super::S3Store::new(p.config).await?));
    }
    let opts = p.gateway_opts.unwrap_or_default();
    let store = if p.resolve_all {
        if p.endpoints.len() != 1 {
            return Err(bad(url, "resolve=all takes exactly one endpoint"));
        }
        let e = p.endpoints[0].clone();
        super::GatewayStore::resolve_all(p.config, e, opts).await
    } else if p.endpoints.is_empty() {
        return Err(bad(
            url,
            "placement and health_interval_ms need endpoint=URL1,URL2,...",
        ));
    } else {
        super::GatewayStore::new(p.config, p.endpoints, opts).await
    };
    Ok(Arc::new(store.map_err(|e| bad(url, e))?))
}

/// An `s3://` URL taken apart.
#[cfg(feature = "s3")]
struct S3Url {
    /// Settings; `endpoint` is the first endpoint.
    config: super::S3Config,
    /// Every endpoint given (`endpoint=A,B,...`), in order.
    endpoints: Vec<String>,
    /// `resolve=all`.
    resolve_all: bool,
    /// `placement` / `health_interval_ms`, when given.
    gateway_opts: Option<super::GatewayOptions>,
}

/// Parses an `s3://` URL into an [`S3Config`](super::S3Config) (credentials from the default
/// chain).
///
/// # Errors
/// `StoreError::Other` naming what is wrong: no bucket, an unknown or repeated parameter, a
/// bad value.
#[cfg(feature = "s3")]
pub fn parse_s3_url(url: &str) -> StoreResult<super::S3Config> {
    let p = parse_s3(url)?;
    if p.endpoints.len() > 1 || p.resolve_all || p.gateway_opts.is_some() {
        return Err(bad(
            url,
            "names several endpoints (a gateway set): open it with open_store",
        ));
    }
    Ok(p.config)
}

#[cfg(feature = "s3")]
fn parse_s3(url: &str) -> StoreResult<S3Url> {
    let u = url::Url::parse(url).map_err(|e| bad(url, e))?;
    if u.scheme() != "s3" {
        return Err(bad(url, "expected s3://BUCKET[/PREFIX]"));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(bad(url, "credentials do not belong in the URL; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or use a profile"));
    }
    if u.port().is_some() {
        return Err(bad(
            url,
            "s3://BUCKET takes no port; give the server as ?endpoint=http://HOST:PORT",
        ));
    }
    let bucket = u.host_str().unwrap_or("");
    if bucket.is_empty() {
        return Err(bad(url, "no bucket; expected s3://BUCKET[/PREFIX]"));
    }
    let mut c = super::S3Config::new(bucket);
    c.prefix = u.path().trim_matches('/').to_string();
    let mut seen = std::collections::HashSet::new();
    let mut endpoints = Vec::new();
    let mut resolve_all = false;
    let mut gateway_opts: Option<super::GatewayOptions> = None;
    for (k, v) in u.query_pairs() {
        if !seen.insert(k.to_string()) {
            return Err(bad(url, format!("parameter {k:?} given twice")));
        }
        match &*k {
            "endpoint" => {
                endpoints = v.split(',').map(|e| e.trim().to_string()).collect();
                if endpoints.iter().any(|e| e.is_empty()) {
                    return Err(bad(url, "an empty endpoint in the endpoint list"));
                }
                c.endpoint = endpoints.first().cloned();
            }
            "resolve" => {
                if v != "all" {
                    return Err(bad(url, format!("resolve must be \"all\", not {v:?}")));
                }
                resolve_all = true;
            }
            "placement" => {
                gateway_opts.get_or_insert_with(Default::default).placement =
                    crate::sched::Placement::parse(&v).map_err(|e| bad(url, e))?;
            }
            "health_interval_ms" => {
                let ms: u64 = v.parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
                    bad(url, format!("health_interval_ms must be a whole number of at least 1, not {v:?}"))
                })?;
                gateway_opts.get_or_insert_with(Default::default).health_interval =
                    std::time::Duration::from_millis(ms);
            }
            "region" => c.region = Some(v.to_string()),
            "addressing" => c.addressing = Some(v.parse().map_err(|e| bad(url, e))?),
            "profile" => c.profile = Some(v.to_string()),
            "ca_file" => c.ca_file = Some(v.to_string().into()),
            "read_into_place" => {
                c.read_into_place = v.parse().map_err(|_| {
                    bad(url, format!("read_into_place must be true or false, not {v:?}"))
                })?
            }
            "idle_timeout_s" => {
                c.idle_timeout = v
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s >= 0.01)
                    .map(std::time::Duration::from_secs_f64)
                    .ok_or_else(|| bad(url, format!("idle_timeout_s must be a number of seconds of at least 0.01, not {v:?}")))?
            }
            "max_attempts" => {
                c.max_attempts = v
                    .parse()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| bad(url, format!("max_attempts must be a whole number of at least 1, not {v:?}")))?
            }
            other => {
                return Err(bad(
                    url,
                    format!("unknown parameter {other:?}; known: endpoint, region, addressing, profile, max_attempts, idle_timeout_s, ca_file, read_into_place, resolve, placement, health_interval_ms"),
                ))
            }
        }
    }
    if resolve_all && endpoints.is_empty() {
        return Err(bad(url, "resolve=all needs an endpoint"));
    }
    Ok(S3Url {
        config: c,
        endpoints,
        resolve_all,
        gateway_opts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreExt;

    #[tokio::test]
    async fn memory_and_paths_open() {
        let m = open_store("memory://").await.unwrap();
        assert_eq!(m.name(), "memory");
        m.put("a/b", bytes::Bytes::from_static(b"xyz"))
            .await
            .unwrap();
        assert_eq!(
            m.get_bytes("a/b").await.unwrap(),
            bytes::Bytes::from_static(b"xyz")
        );

        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        let s = open_store(plain.to_str().unwrap()).await.unwrap();
        assert_eq!(s.name(), "fs");
        s.put("k/1", bytes::Bytes::from_static(b"one"))
            .await
            .unwrap();
        let via_url = open_store(&format!("file://{}", plain.display()))
            .await
            .unwrap();
        assert_eq!(
            via_url.get_bytes("k/1").await.unwrap(),
            bytes::Bytes::from_static(b"one")
        );
    }

    #[test]
    fn a_directory_has_one_identity_however_it_is_named_and_memory_none() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("kv");
        std::fs::create_dir(&d).unwrap();
        let plain = shared_identity(d.to_str().unwrap()).unwrap();
        assert!(plain.starts_with("fs:"), "{plain}");
        let dotted = format!("{}/../kv", d.display());
        assert_eq!(shared_identity(&dotted).as_deref(), Some(&*plain));
        let url = format!("file://{}", d.display());
        assert_eq!(shared_identity(&url).as_deref(), Some(&*plain));
        assert_eq!(shared_identity("memory://"), None);
        assert_eq!(
            shared_identity("s3://b/p?endpoint=http://h:1").as_deref(),
            Some("s3:s3://b/p?endpoint=http://h:1")
        );
        assert_ne!(shared_identity("s3://b/p"), shared_identity("s3://b/q"));
    }

    #[tokio::test]
    async fn tools_refuse_a_missing_directory_and_create_none() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-such-store");
        for u in [
            missing.display().to_string(),
            format!("file://{}", missing.display()),
        ] {
            let e = open_existing_store(&u).await.unwrap_err().to_string();
            assert!(e.contains("no such directory") && e.contains(&u), "{e}");
            assert!(!missing.exists(), "{u} created the directory");
        }
        let existing = open_existing_store(dir.path().to_str().unwrap()).await;
        assert_eq!(existing.unwrap().name(), "fs");
    }

    #[tokio::test]
    async fn bad_urls_say_what_is_wrong() {
        for (u, want) in [
            ("", "empty"),
            ("ftp://x/y", "unknown scheme"),
            ("memory://x", "no path"),
            ("file://host/p", "no host"),
            ("file:///tmp/x?y=1", "no query"),
        ] {
            let e = open_store(u).await.unwrap_err().to_string();
            assert!(e.contains(want), "{u}: {e}");
        }
    }

    #[cfg(feature = "s3")]
    #[test]
    fn s3_urls_parse() {
        let c = parse_s3_url(
            "s3://kv.cache-test/team/a?endpoint=http://127.0.0.1:7480&region=eu-1&addressing=path",
        )
        .unwrap();
        assert_eq!(c.bucket, "kv.cache-test");
        assert_eq!(c.prefix, "team/a");
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:7480"));
        assert_eq!(c.region.as_deref(), Some("eu-1"));
        assert_eq!(c.addressing, Some(crate::store::Addressing::Path));
        let c = parse_s3_url("s3://bucket").unwrap();
        assert_eq!(c.prefix, "");
        assert_eq!(c.effective_addressing(), crate::store::Addressing::Virtual);
        for (u, want) in [
            ("s3://", "no bucket"),
            ("s3://b/p?colour=red", "unknown parameter \"colour\""),
            ("s3://b?region=a&region=b", "twice"),
            ("s3://b?addressing=sideways", "'path' or 'virtual'"),
            ("s3://ak:sk@b", "credentials"),
            ("s3://b:9000", "endpoint"),
            ("s3://b?max_attempts=0", "max_attempts"),
            ("s3://b?read_into_place=maybe", "read_into_place must be"),
            (
                "s3://bucket?endpoint=http://a:1,,http://b:2",
                "empty endpoint",
            ),
            (
                "s3://bucket?endpoint=http://a:1&resolve=some",
                "resolve must be",
            ),
            (
                "s3://bucket?endpoint=http://a:1,http://b:2&placement=random",
                "two-choice",
            ),
            (
                "s3://bucket?endpoint=http://a:1,http://b:2&health_interval_ms=0",
                "health_interval_ms",
            ),
            ("s3://bucket?endpoint=http://a:1,http://b:2", "open_store"),
        ] {
            let e = parse_s3_url(u).unwrap_err().to_string();
            assert!(e.contains(want), "{u}: {e}");
        }
        let p = parse_s3(
            "s3://bucket/p?endpoint=http://a:1,%20http://b:2&placement=hash&health_interval_ms=250",
        )
        .unwrap();
        assert_eq!(p.endpoints, ["http://a:1", "http://b:2"]);
        let o = p.gateway_opts.unwrap();
        assert_eq!(o.placement, crate::sched::Placement::Hash);
        assert_eq!(o.health_interval, std::time::Duration::from_millis(250));
        assert!(p.config.read_into_place, "on by default");
        let p = parse_s3("s3://bucket?endpoint=http://a:1&read_into_place=false").unwrap();
        assert!(!p.config.read_into_place);
    }

    #[cfg(feature = "s3")]
    #[tokio::test]
    async fn several_endpoints_open_a_gateway_store() {
        let s = open_store("s3://bucket?endpoint=http://127.0.0.1:1,http://127.0.0.1:2")
            .await
            .unwrap();
        assert_eq!(s.name(), "gateways");
        let r = super::super::Gateways::of(&*s).route(7);
        assert_eq!(r.len(), 2);
        assert_ne!(r[0].addr, r[1].addr);
        let s = open_store("s3://bucket?endpoint=http://localhost:1&resolve=all")
            .await
            .unwrap();
        assert_eq!(s.name(), "gateways");
        assert!(super::super::Gateways::of(&*s)
            .route(7)
            .iter()
            .all(|t| t.addr.ends_with(":1")));
        let e = open_store("s3://bucket?placement=hash")
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("endpoint=URL1,URL2"), "{e}");
    }
}
