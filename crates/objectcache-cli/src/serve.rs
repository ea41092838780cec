//! `objectcache serve`: settings come from defaults, then a TOML file (`--config`), then
//! environment variables, then flags (later wins). `docs/deployment.md` has the reference.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Arguments of `objectcache serve`.
#[derive(Debug, Default, clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file; its keys are the long flag names with `_` for `-`.
    #[arg(long, env = "OBJECTCACHE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address for S3 (HTTP) and gather (TCP) on one port [default: 127.0.0.1:9000].
    #[arg(long, env = "OBJECTCACHE_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Backend: `memory:`, `file://PATH` or a directory path (default `./objectcache-data`),
    /// or `s3://BUCKET/PREFIX?endpoint=URL` for gateway mode over an upstream S3 endpoint.
    #[arg(long, env = "OBJECTCACHE_STORE")]
    pub store: Option<String>,
    /// Skip fsync on the directory backend (atomic, but recent puts may be lost on power loss).
    #[arg(long, env = "OBJECTCACHE_NO_FSYNC")]
    pub no_fsync: bool,
    /// An S3 access key `ACCESS_KEY:SECRET_KEY` accepted by SigV4 (repeat, or comma-separate
    /// in the environment variable).
    #[arg(
        long = "access-key",
        env = "OBJECTCACHE_ACCESS_KEYS",
        value_delimiter = ','
    )]
    pub access_keys: Vec<String>,
    /// Accept unauthenticated S3 requests when no access key is configured.
    #[arg(long, env = "OBJECTCACHE_ALLOW_ANONYMOUS")]
    pub allow_anonymous: bool,
    /// Bucket to create at start if absent (repeat, or comma-separate).
    #[arg(long = "bucket", env = "OBJECTCACHE_BUCKETS", value_delimiter = ',')]
    pub buckets: Vec<String>,
    /// Largest object a PUT may write, bytes [default: 5 GiB].
    #[arg(long, env = "OBJECTCACHE_MAX_OBJECT_BYTES")]
    pub max_object_bytes: Option<u64>,
    /// Largest gather/save descriptor, bytes [default: 1 MiB].
    #[arg(long, env = "OBJECTCACHE_MAX_DESCRIPTOR_BYTES")]
    pub max_descriptor_bytes: Option<u32>,
    /// Most chunks per gather or save request [default: 4096].
    #[arg(long, env = "OBJECTCACHE_MAX_CHUNKS")]
    pub max_chunks: Option<u32>,
    /// Loads served at once; more wait in the scheduler's queue [default: 64].
    #[arg(long, env = "OBJECTCACHE_MAX_CONCURRENT_LOADS")]
    pub max_concurrent_loads: Option<usize>,
    /// Loads allowed to wait before new ones are refused as busy [default: 1024].
    #[arg(long, env = "OBJECTCACHE_MAX_QUEUED_LOADS")]
    pub max_queued_loads: Option<usize>,
    /// Bytes one request may hold in server memory [default: 256 MiB].
    #[arg(long, env = "OBJECTCACHE_MAX_REQUEST_BYTES")]
    pub max_request_bytes: Option<u64>,
    /// Bytes all requests together may hold in memory [default: 2 GiB].
    #[arg(long, env = "OBJECTCACHE_MEMORY_BUDGET_BYTES")]
    pub memory_budget_bytes: Option<u64>,
    /// Backend reads in flight per load [default: 32].
    #[arg(long, env = "OBJECTCACHE_READ_CONCURRENCY")]
    pub read_concurrency: Option<usize>,
    /// Verify every stored slice CRC32C before sending, whatever the client asks.
    #[arg(long, env = "OBJECTCACHE_ALWAYS_VERIFY")]
    pub always_verify: bool,
    /// Do not read format version 2 segment objects for gather loads (connectors then load
    /// version 2 prefixes by ranged GETs, as from an older release).
    #[arg(long, env = "OBJECTCACHE_NO_READ_SEGMENTS")]
    pub no_read_segments: bool,
    /// Load scheduling policy: `fifo`, `priority`, `equal`, `byte-prop` or `stall-aware`
    /// (the last three share `--bandwidth-cap-bytes-per-s` among loads) [default: fifo].
    #[arg(long, env = "OBJECTCACHE_SCHEDULER")]
    pub scheduler: Option<String>,
    /// Total gather send rate in bytes/s, shared under `--scheduler`; 0 = uncapped [default: 0].
    #[arg(long, env = "OBJECTCACHE_BANDWIDTH_CAP_BYTES_PER_S")]
    pub bandwidth_cap_bytes_per_s: Option<u64>,
    /// Disconnect a client that keeps the server waiting this many seconds without moving
    /// bytes (or fewer than --min-client-bytes-per-s); idle HTTP connections close after it
    /// [default: 30].
    #[arg(long, env = "OBJECTCACHE_CLIENT_TIMEOUT_SECS")]
    pub client_timeout_secs: Option<u64>,
    /// Least rate in bytes/s a client the server waits on must move [default: 16384].
    #[arg(long, env = "OBJECTCACHE_MIN_CLIENT_BYTES_PER_S")]
    pub min_client_bytes_per_s: Option<u64>,
    /// Seconds a new connection has to send its first request or gather hello and
    /// authentication [default: 10].
    #[arg(long, env = "OBJECTCACHE_HANDSHAKE_TIMEOUT_SECS")]
    pub handshake_timeout_secs: Option<u64>,
    /// Close a gather connection idle between requests for this many seconds [default: 120].
    #[arg(long, env = "OBJECTCACHE_IDLE_TIMEOUT_SECS")]
    pub idle_timeout_secs: Option<u64>,
    /// Open connections at most [default: 4096, below the open-file limit].
    #[arg(long, env = "OBJECTCACHE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Open connections at most from one client address [default: 512].
    #[arg(long, env = "OBJECTCACHE_MAX_CONNECTIONS_PER_IP")]
    pub max_connections_per_ip: Option<usize>,
    /// Seconds loads in flight get to finish on shutdown before they are aborted [default: 10].
    #[arg(long, env = "OBJECTCACHE_SHUTDOWN_GRACE_SECS")]
    pub shutdown_grace_secs: Option<u64>,
    /// Log format: `text` or `json` [default: text].
    #[arg(long, env = "OBJECTCACHE_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Log filter in tracing `EnvFilter` syntax, e.g. `info,objectcache=debug` [default: info].
    #[arg(long, env = "OBJECTCACHE_LOG")]
    pub log: Option<String>,
    /// Node tier: bytes of chunk objects kept in memory in front of the store (gateway mode:
    /// the node-level cache every engine of the node shares) [default: 0, none].
    #[arg(long, env = "OBJECTCACHE_TIER_DRAM_BYTES")]
    pub tier_dram_bytes: Option<u64>,
    /// Node tier: directory of the local-disk level (verified and reused at start-up).
    #[arg(long, env = "OBJECTCACHE_TIER_DISK_DIR")]
    pub tier_disk_dir: Option<PathBuf>,
    /// Node tier: bytes the disk level may hold (with --tier-disk-dir).
    #[arg(long, env = "OBJECTCACHE_TIER_DISK_BYTES")]
    pub tier_disk_bytes: Option<u64>,
    /// Node tier: which filled objects are kept: `all`, or `second` (asked again within 600
    /// s; `second:SECONDS`) [default: all].
    #[arg(long, env = "OBJECTCACHE_TIER_ADMISSION")]
    pub tier_admission: Option<String>,
    /// Answer `POST /_objectcache/lookup` (which leading chunks of a prefix the store holds,
    /// and in which tier) for routers; anyone who reaches the port may ask, without
    /// credentials (docs/deployment.md).
    #[arg(long, env = "OBJECTCACHE_LOOKUP_HTTP")]
    pub lookup_http: bool,
    /// Print the effective configuration as TOML and exit (secret keys shown as
    /// `<redacted>`).
    #[arg(long)]
    pub print_config: bool,
}

impl ServeArgs {
    /// The effective configuration: defaults, then the file, then environment and flags.
    ///
    /// # Errors
    /// [`objectcache_core::Error::Config`] if the file cannot be read or parsed.
    pub fn resolve(&self) -> objectcache_core::Result<objectcache_server::ServerConfig> {
        let mut c = match &self.config {
            Some(p) => {
                let s = std::fs::read_to_string(p).map_err(|e| {
                    objectcache_core::Error::Config(format!("{}: {e}", p.display()))
                })?;
                objectcache_server::ServerConfig::from_toml(&s)?
            }
            None => objectcache_server::ServerConfig::default(),
        };
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = self.$f.clone() { c.$f = v; } )* };
        }
        set!(
            listen,
            store,
            max_object_bytes,
            max_descriptor_bytes,
            max_chunks,
            max_concurrent_loads,
            max_queued_loads,
            max_request_bytes,
            memory_budget_bytes,
            read_concurrency,
            scheduler,
            bandwidth_cap_bytes_per_s,
            client_timeout_secs,
            min_client_bytes_per_s,
            handshake_timeout_secs,
            idle_timeout_secs,
            max_connections,
            max_connections_per_ip,
            shutdown_grace_secs,
            log_format,
            tier_dram_bytes,
            tier_disk_bytes,
            tier_admission
        );
        if let Some(d) = &self.tier_disk_dir {
            c.tier_disk_dir = Some(d.clone());
        }
        if let Some(l) = &self.log {
            c.log_filter = l.clone();
        }
        if self.no_fsync {
            c.fsync = false;
        }
        if !self.access_keys.is_empty() {
            c.access_keys = self
                .access_keys
                .iter()
                .map(|k| {
                    objectcache_server::AccessKey::parse(k)
                        .map_err(|e| objectcache_core::Error::Config(format!("--access-key: {e}")))
                })
                .collect::<objectcache_core::Result<_>>()?;
        }
        if self.allow_anonymous {
            c.allow_anonymous = true;
        }
        if !self.buckets.is_empty() {
            c.buckets = self.buckets.clone();
        }
        if self.always_verify {
            c.always_verify = true;
        }
        if self.no_read_segments {
            c.read_segments = false;
        }
        if self.lookup_http {
            c.lookup_http = true;
        }
        Ok(c)
    }
}

/// Runs `objectcache serve` until SIGINT or SIGTERM, then shuts down gracefully.
///
/// # Errors
/// Configuration errors, a store that cannot be opened, or an address that cannot be bound.
pub fn run(args: ServeArgs) -> objectcache_core::Result<()> {
    let cfg = args.resolve()?;
    if args.print_config {
        print!(
            "{}",
            toml::to_string_pretty(&cfg.redacted())
                .map_err(|e| objectcache_core::Error::Config(e.to_string()))?
        );
        return Ok(());
    }
    cfg.validate()?;
    init_logging(&cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let handle = objectcache_server::start(cfg).await?;
        // Readiness line for scripts and tests that start the server as a process.
        println!("objectcache listening on {}", handle.local_addr());
        wait_for_signal().await;
        tracing::info!("shutdown requested");
        handle.shutdown().await;
        Ok(())
    })
}

fn init_logging(cfg: &objectcache_server::ServerConfig) -> objectcache_core::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log_filter).map_err(|e| {
        objectcache_core::Error::Config(format!("log filter {:?}: {e}", cfg.log_filter))
    })?;
    use std::io::IsTerminal;
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colour codes only on a terminal, never in a log file.
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let r = if cfg.log_format == "json" {
        b.json().try_init()
    } else {
        b.try_init()
    };
    // Already initialised (e.g. in tests): keep the existing subscriber.
    let _ = r;
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
