//! Starting a server: the configured store opened ([`open_backend`]), incomplete writes of
//! dead processes reclaimed, buckets created, the listener bound, the shared state and the S3
//! service built, and the accept loop spawned ([`start_with_store`]).

use super::accept::accept_loop;
use super::metrics::Metrics;
use super::s3::{Buckets, S3Frontend};
use super::{budget, conn, group, reads, sched, tenant, tls};
use super::{Admission, ServerConfig, ServerHandle, ServerState, S3_READ_LEASE};
use objectcache_client::sched::SchedulerSetting;
use objectcache_client::store::{FsStore, FsyncPolicy, MemoryStore, Store};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Opens the store named by `cfg.store`: `memory:`/`memory://`, `file://PATH` or a path
/// (with `cfg.fsync`), or any URL [`objectcache_client::store::open_store`] accepts, e.g.
/// `s3://BUCKET/PREFIX?endpoint=URL` for gateway mode (credentials from `AWS_ACCESS_KEY_ID`
/// and `AWS_SECRET_ACCESS_KEY` or a profile).
///
/// # Errors
/// The store's error, naming the URL.
pub async fn open_backend(cfg: &ServerConfig) -> objectcache_client::Result<Arc<dyn Store>> {
    let url = cfg.store.trim();
    if url == "memory:" {
        return Ok(Arc::new(MemoryStore::new()));
    }
    let fsync = if cfg.fsync {
        FsyncPolicy::Always
    } else {
        FsyncPolicy::Never
    };
    if let Some(p) = url.strip_prefix("file://") {
        return Ok(Arc::new(FsStore::new(p, fsync)?));
    }
    if !url.contains("://") && !url.is_empty() {
        return Ok(Arc::new(FsStore::new(url, fsync)?));
    }
    Ok(objectcache_client::store::open_store(url).await?)
}

/// Opens the configured store and starts the server, with the node tier in front of the
/// store when one is configured ([`ServerConfig::tier`]).
///
/// # Errors
/// As [`open_backend`] and [`start_with_store`]; the tier's disk directory cannot be made.
pub async fn start(cfg: ServerConfig) -> objectcache_client::Result<ServerHandle> {
    let store = open_backend(&cfg).await?;
    // A remote backend (gateway mode) is metered: its requests and bytes are what it bills
    // and what the node tier saves (`objectcache_server_backend_*` in the metrics).
    let backend = (!store_is_local(&cfg.store))
        .then(|| Arc::new(objectcache_client::store::MeteredStore::new(store.clone())));
    let store: Arc<dyn Store> = match &backend {
        Some(m) => m.clone(),
        None => store,
    };
    match cfg.tier()? {
        Some(t) => {
            let tier = Arc::new(objectcache_client::store::TieredStore::new(store, t)?);
            let st = tier.stats();
            tracing::info!(
                dram_bytes = st.dram.capacity,
                disk_bytes = st.disk.capacity,
                disk_recovered = st.disk_recovered,
                disk_dropped = st.disk_dropped,
                "node tier in front of the store"
            );
            start_inner(cfg, tier.clone(), Some(tier), backend).await
        }
        None => start_inner(cfg, store, None, backend).await,
    }
}

/// Whether [`open_backend`] opens `url` as a store in this process's memory or directories
/// (`memory:`, `file://`, a path) rather than a remote one.
fn store_is_local(url: &str) -> bool {
    let url = url.trim();
    url == "memory:" || url.starts_with("file://") || !url.contains("://")
}

/// Starts a server over a node tier ([`objectcache_client::store::TieredStore`]): as
/// [`start_with_store`], and its metrics show the tier's levels.
///
/// # Errors
/// As [`start_with_store`].
pub async fn start_with_tier(
    cfg: ServerConfig,
    tier: Arc<objectcache_client::store::TieredStore>,
) -> objectcache_client::Result<ServerHandle> {
    start_inner(cfg, tier.clone(), Some(tier), None).await
}

/// Starts a server over `store`: validates `cfg`, creates `cfg.buckets`, binds `cfg.listen`
/// (port 0 picks a free port; see [`ServerHandle::local_addr`]) and serves until shut down.
///
/// # Errors
/// [`objectcache_client::Error::Config`] for inconsistent settings; [`objectcache_client::Error::Io`] if the address
/// cannot be bound; a store error while loading buckets.
pub async fn start_with_store(
    cfg: ServerConfig,
    store: Arc<dyn Store>,
) -> objectcache_client::Result<ServerHandle> {
    start_inner(cfg, store, None, None).await
}

async fn start_inner(
    cfg: ServerConfig,
    store: Arc<dyn Store>,
    tier: Option<Arc<objectcache_client::store::TieredStore>>,
    backend: Option<Arc<objectcache_client::store::MeteredStore>>,
) -> objectcache_client::Result<ServerHandle> {
    cfg.validate()?;
    reclaim_orphaned_writes(store.as_ref()).await;
    let buckets = Arc::new(Buckets::load(store.clone()).await?);
    for b in &cfg.buckets {
        buckets.create(b).await?;
    }
    let metrics = Arc::new(Metrics::new());
    let listener = TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    let queue = sched::admission(SchedulerSetting::parse(&cfg.scheduler)?);
    let link = shared_link(&cfg)?;
    // Each connection is a descriptor: stay well below the open-file limit.
    let nofile = conn::raise_nofile_limit().unwrap_or(u64::MAX);
    let max_conns = cfg
        .max_connections
        .min((nofile / 2).min(usize::MAX as u64) as usize)
        .max(1);
    if max_conns < cfg.max_connections {
        tracing::warn!(
            max_connections = cfg.max_connections,
            open_file_limit = nofile,
            capped = max_conns,
            "max_connections capped at half the open-file limit"
        );
    }
    let leases = objectcache_client::lifecycle::LeaseTable::new();
    let access = Arc::new(objectcache_client::lifecycle::AccessLog::new());
    let shared = Arc::new(ServerState {
        link,
        budget: budget::Budget::new(cfg.memory_budget_bytes, metrics.clone()),
        conns: conn::ConnLimits::new(max_conns, cfg.max_connections_per_ip, metrics.clone()),
        admission: Mutex::new(Admission {
            active: 0,
            queue,
            waiting: HashMap::new(),
        }),
        next_id: AtomicU64::new(1),
        loads: group::Loads::default(),
        reads: reads::Reads::default(),
        leases: leases.clone(),
        access: access.clone(),
        gc_memo: Default::default(),
        shutdown: CancellationToken::new(),
        buckets: buckets.clone(),
        metrics: metrics.clone(),
        store: store.clone(),
        tier,
        backend,
        cfg,
        #[cfg(feature = "rdma")]
        rdma: super::gather::rdma::open(),
    });
    let tenants = tenant::Tenants::new(&shared.cfg.tenants)
        .map_err(|e| objectcache_client::Error::Config(e.to_string()))?;
    let tls = match (&shared.cfg.tls_cert, &shared.cfg.tls_key) {
        (Some(c), Some(k)) => Some(tls::acceptor(c, k)?),
        _ => None,
    };
    let mut builder = s3s::service::S3ServiceBuilder::new(
        S3Frontend::new(
            // Reads of the S3 API record their entry's use and renew its soft lease; a
            // lookup's HEAD does neither (lookups never pin).
            Arc::new(objectcache_client::lifecycle::TrackedStore::new(
                store.clone(),
                access,
                leases,
                S3_READ_LEASE,
            )),
            buckets,
            shared.cfg.max_object_bytes,
            metrics,
        )
        .with_tenants(Arc::new(tenants))
        .with_budget(
            shared.budget.clone(),
            Duration::from_secs(shared.cfg.client_timeout_secs),
        ),
    );
    // XML request bodies (DeleteObjects, tagging, ...) are read whole by s3s: keep them
    // small (each is also counted in the memory budget as it arrives).
    let mut s3cfg = s3s::config::S3Config::default();
    s3cfg.xml_max_body_size = 1 << 20;
    s3cfg.form_max_fields_size = 1 << 20;
    s3cfg.post_object_max_file_size = shared.cfg.max_object_bytes;
    builder.set_config(Arc::new(s3s::config::StaticConfigProvider::new(Arc::new(
        s3cfg,
    ))));
    if !shared.cfg.access_keys.is_empty() || !shared.cfg.tenants.is_empty() {
        let mut auth = s3s::auth::SimpleAuth::new();
        for k in &shared.cfg.access_keys {
            auth.register(k.access_key.clone(), k.secret_key.clone().into());
        }
        for t in &shared.cfg.tenants {
            auth.register(t.access_key.clone(), t.secret_key.clone().into());
        }
        builder.set_auth(auth);
    }
    let s3 = builder.build();
    tracing::info!(%addr, store = store.name(), scheduler = %shared.cfg.scheduler, "objectcache server listening");
    let sh = shared.clone();
    let join = tokio::spawn(async move { accept_loop(listener, sh, s3, tls).await });
    Ok(ServerHandle { addr, shared, join })
}

/// Deletes the incomplete writes whose writer is gone ([`Store::list_partial`]: temporary
/// files of a killed process), so a restart gives their space back; younger ones of live
/// writers are left to them, and `objectcache gc` reclaims whatever outlives its grace.
async fn reclaim_orphaned_writes(store: &dyn Store) {
    let found = match store.list_partial("").await {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "could not list incomplete writes");
            return;
        }
    };
    let (mut n, mut bytes) = (0u64, 0u64);
    for p in found.iter().filter(|p| p.orphaned) {
        match store.delete_partial(p).await {
            Ok(()) => {
                n += 1;
                bytes += p.size;
            }
            Err(e) => {
                tracing::warn!(partial = %p.id, error = %e, "could not reclaim an incomplete write")
            }
        }
    }
    if n > 0 {
        tracing::info!(
            files = n,
            bytes,
            "reclaimed incomplete writes of processes that are gone"
        );
    }
}

/// The link scheduler of `cfg`: `None` when uncapped.
fn shared_link(
    cfg: &ServerConfig,
) -> objectcache_client::Result<Option<Arc<objectcache_client::link::Link>>> {
    if cfg.bandwidth_cap_bytes_per_s == 0 {
        return Ok(None);
    }
    let kind = SchedulerSetting::parse(&cfg.scheduler)?.policy;
    Ok(Some(objectcache_client::link::Link::new(
        kind,
        cfg.bandwidth_cap_bytes_per_s as f64,
    )?))
}
