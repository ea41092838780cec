//! Where the loads go ([`Target`]): the server named by `--store`, or one started in this
//! process on loopback over a temporary directory; and the S3 store of the ranged-GET paths,
//! direct or through a proxy.

use super::TransferArgs;
use objectcache::store::{Addressing, S3Config, S3Credentials, S3Store, Store};
use std::sync::Arc;

pub(super) struct Target {
    pub(super) addr: std::net::SocketAddr,
    endpoint: String,
    pub(super) bucket: String,
    /// Access key pair: S3 SigV4 and gather authentication.
    creds: (String, String),
    _server: Option<objectcache::server::ServerHandle>,
    _dir: Option<tempfile::TempDir>,
    /// Whether `_dir` is the server's store (no `--server-backend`).
    dir_is_store: bool,
}

impl Target {
    pub(super) fn credentials(&self) -> Option<(String, String)> {
        Some(self.creds.clone())
    }

    /// The directory the in-process server keeps its objects in (`None` with `--store` or
    /// another `--server-backend`).
    pub(super) fn local_dir(&self) -> Option<&std::path::Path> {
        self._dir
            .as_ref()
            .filter(|_| self.dir_is_store)
            .map(|d| d.path())
    }
}

pub(super) async fn target(args: &TransferArgs) -> Result<Target, String> {
    if let Some(url) = &args.store {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("--store {url:?}: expected http://HOST:PORT/BUCKET"))?;
        let (hostport, bucket) = rest
            .split_once('/')
            .ok_or_else(|| format!("--store {url:?}: no bucket"))?;
        let addr = tokio::net::lookup_host(hostport)
            .await
            .map_err(|e| format!("{hostport}: {e}"))?
            .next()
            .ok_or("no address")?;
        return Ok(Target {
            addr,
            endpoint: format!("http://{hostport}"),
            bucket: bucket.trim_end_matches('/').into(),
            creds: (args.access_key.clone(), args.secret_key.clone()),
            _server: None,
            _dir: None,
            dir_is_store: false,
        });
    }
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let cfg = objectcache::server::ServerConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        store: args
            .server_backend
            .clone()
            .unwrap_or_else(|| dir.path().display().to_string()),
        fsync: false,
        access_keys: vec![objectcache::server::AccessKey {
            access_key: args.access_key.clone(),
            secret_key: args.secret_key.clone(),
        }],
        buckets: vec!["kv-bench".into()],
        log_filter: "warn".into(),
        ..Default::default()
    };
    let server = objectcache::server::start(cfg)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Target {
        addr: server.local_addr(),
        endpoint: server.endpoint(),
        bucket: "kv-bench".into(),
        creds: (args.access_key.clone(), args.secret_key.clone()),
        _server: Some(server),
        _dir: Some(dir),
        dir_is_store: args.server_backend.is_none(),
    })
}

pub(super) async fn s3_store(
    t: &Target,
    args: &TransferArgs,
    via: Option<std::net::SocketAddr>,
) -> Result<Arc<dyn Store>, String> {
    let mut cfg = S3Config::new(t.bucket.clone());
    cfg.endpoint = Some(match via {
        Some(a) => format!("http://{a}"),
        None => t.endpoint.clone(),
    });
    cfg.region = Some("us-east-1".into());
    cfg.addressing = Some(Addressing::Path);
    // Populating writes objects of up to 1 GiB in one PUT (`s3-segment` at 32K tokens); a
    // Ceph RGW on one disk takes longer than the store's default 60 s per attempt for that.
    // Loads are measured, not saves: the limits only keep a dead server from hanging the run.
    cfg.attempt_timeout = std::time::Duration::from_secs(600);
    cfg.read_into_place = args.s3_bodies == "place";
    cfg.operation_timeout = std::time::Duration::from_secs(1200);
    cfg.credentials = S3Credentials::Static {
        access_key: args.access_key.clone(),
        secret_key: args.secret_key.clone(),
        session_token: None,
    };
    Ok(Arc::new(
        S3Store::new(cfg).await.map_err(|e| e.to_string())?,
    ))
}
