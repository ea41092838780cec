//! Server configuration: one struct, read from a TOML file and overridden by environment
//! variables and flags (see `objectcache serve --help` and `docs/deployment.md`).

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

pub use super::tenant::REDACTED;

/// One S3 access key pair accepted by SigV4 authentication (`Debug` shows no secret).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessKey {
    /// Access key id.
    pub access_key: String,
    /// Secret access key.
    pub secret_key: String,
}

impl std::fmt::Debug for AccessKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessKey")
            .field("access_key", &self.access_key)
            .field("secret_key", &REDACTED)
            .finish()
    }
}

/// An access key not written `ACCESS_KEY:SECRET_KEY` ([`AccessKey::parse`]). It does not
/// echo what was given: that may hold a secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("an access key is written ACCESS_KEY:SECRET_KEY")]
pub struct BadAccessKey;

impl AccessKey {
    /// Parses `ACCESS:SECRET`.
    ///
    /// # Errors
    /// [`BadAccessKey`] if there is no `:` or either side is empty.
    pub fn parse(s: &str) -> Result<Self, BadAccessKey> {
        match s.split_once(':') {
            Some((a, k)) if !a.is_empty() && !k.is_empty() => Ok(AccessKey {
                access_key: a.to_string(),
                secret_key: k.to_string(),
            }),
            _ => Err(BadAccessKey),
        }
    }
}

/// Every setting of `objectcache serve`. Field docs are the reference; defaults in
/// [`ServerConfig::default`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to listen on; S3 (HTTP/1.1) and gather (TCP, recognised by its preface) share
    /// it. Default `127.0.0.1:9000`.
    pub listen: SocketAddr,
    /// Backend: `memory:`, a directory (`file:///var/lib/objectcache` or a plain path), or an
    /// upstream S3 endpoint for gateway mode (`s3://bucket/prefix?endpoint=http://...`).
    /// Default `file://./objectcache-data`.
    pub store: String,
    /// `fsync` each put on the directory backend (durable on return). Default true.
    pub fsync: bool,
    /// Access keys accepted by SigV4. Empty requires `allow_anonymous`.
    pub access_keys: Vec<AccessKey>,
    /// Serve S3 requests without authentication when no access key is set. Default false.
    pub allow_anonymous: bool,
    /// Buckets created at start if absent; each an S3 bucket name
    /// ([`objectcache_client::protocol::check_bucket_name`]).
    pub buckets: Vec<String>,
    /// Largest object a PUT may write, bytes. Default 5 GiB.
    pub max_object_bytes: u64,
    /// Largest gather/save descriptor, bytes. Default 1 MiB.
    pub max_descriptor_bytes: u32,
    /// Most chunks per gather or save request. Default 4,096 (1M tokens at 256 per chunk).
    pub max_chunks: u32,
    /// Loads served at once; more wait in the scheduler's queue. Default 64.
    pub max_concurrent_loads: usize,
    /// Loads allowed to wait; beyond it a load is refused with `Busy`. Default 1,024.
    pub max_queued_loads: usize,
    /// Bytes one request may hold in server memory (read-ahead of a load, one object of a
    /// save). Default 256 MiB.
    pub max_request_bytes: u64,
    /// Bytes all requests together may hold in memory (read from the backend, not yet sent).
    /// Default 2 GiB.
    pub memory_budget_bytes: u64,
    /// Backend reads in flight per load. Default 32.
    pub read_concurrency: usize,
    /// Always verify stored slice CRC32Cs before sending, whatever the client asks. Default
    /// false (the client checks each unit's CRC, which covers storage corruption too).
    pub always_verify: bool,
    /// Gather loads may read object format version 2 segment objects (feature bit
    /// `Segments`, `docs/protocol.md`). Off, the server does not announce it and connectors
    /// load version 2 prefixes by ranged GETs from its S3 API, or from another gateway that
    /// does: a server of an older release behaves so, and a mixed fleet during a rolling
    /// upgrade can be tested with it. Default true.
    pub read_segments: bool,
    /// Load scheduling policy. Admission order: `fifo` (arrival order) or `priority`
    /// (descriptor priority, then earliest first-layer deadline, then arrival). Bandwidth
    /// sharing among the admitted loads under `bandwidth_cap_bytes_per_s`: `equal` (equal
    /// share), `byte-prop` (proportional to bytes left) or `stall-aware` (earliest layer
    /// deadline first, no extra bandwidth for loads hidden behind compute; see
    /// `docs/scheduling.md`), each admitting in arrival order; `fifo` and `priority` give the
    /// whole cap to the earliest admitted load. Default `fifo`.
    pub scheduler: String,
    /// Total send rate of all gather loads, bytes/s, shared under `scheduler`; 0 = uncapped
    /// (units go out as fast as the socket takes them, no pacing). Default 0.
    pub bandwidth_cap_bytes_per_s: u64,
    /// A client the server waits on (a response it does not read, a body or save data it does
    /// not send, request headers it has not finished) must move some bytes, and at least
    /// `min_client_bytes_per_s`, in every this many seconds of waiting, or it is
    /// disconnected; idle HTTP keep-alive connections are closed after it. Default 30.
    pub client_timeout_secs: u64,
    /// The least rate, bytes/s, at which a client the server waits on must move bytes,
    /// judged over each `client_timeout_secs` of waiting (a dripping client is dropped).
    /// Default 16,384.
    pub min_client_bytes_per_s: u64,
    /// A new connection must tell its protocol (the gather preface, an HTTP request) and, for
    /// gather, complete its hello and authentication within this many seconds. Default 10.
    pub handshake_timeout_secs: u64,
    /// A gather connection with no request for this many seconds is closed (connectors keep
    /// idle connections for reuse and reconnect when one was closed). Default 120.
    pub idle_timeout_secs: u64,
    /// Open connections at most (S3 and gather together); more are closed on accept. Capped
    /// below the process's open-file limit. Default 4,096.
    pub max_connections: usize,
    /// Open connections at most from one client address. Default 512.
    pub max_connections_per_ip: usize,
    /// On shutdown, loads in flight get this long to finish before they are aborted, seconds.
    /// Default 10.
    pub shutdown_grace_secs: u64,
    /// Log format: `text` or `json`. Default `text`.
    pub log_format: String,
    /// Log filter (tracing `EnvFilter` syntax). Default `info`.
    pub log_filter: String,
    /// Tenants: access keys confined to a namespace of every bucket (TOML `[[tenants]]`
    /// tables; see [`super::tenant`]). With tenants, gather connections are refused (gather
    /// loads are not confined to a namespace yet). Default none.
    pub tenants: Vec<super::tenant::TenantConfig>,
    /// PEM certificate chain: with `tls_key`, the listener speaks TLS (S3 API over
    /// `https://`; see [`super::tls`]). Default none (plaintext).
    pub tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of `tls_cert`. Default none.
    pub tls_key: Option<std::path::PathBuf>,
    /// Node tier: bytes of chunk objects kept in memory in front of the backend (gateway
    /// mode: one such server per node is the node-level cache every engine of the node
    /// shares; see [`objectcache_client::store::TieredStore`]). 0 = no DRAM level. Default 0.
    pub tier_dram_bytes: u64,
    /// Node tier: directory of the local-disk level (found again and verified at start-up).
    /// Default none (no disk level).
    pub tier_disk_dir: Option<std::path::PathBuf>,
    /// Node tier: bytes the disk level may hold. Default 0.
    pub tier_disk_bytes: u64,
    /// Node tier: when a chunk object filled from the backend is kept: `all`, or `second`
    /// (asked for the second time within 600 s; `second:SECONDS` sets the window). Default
    /// `all`.
    pub tier_admission: String,
    /// Answer `POST /_objectcache/lookup` (what the store holds of a prefix, and in which tier:
    /// for routers; `crate::lookup`). Off by default: anyone who reaches the port can then
    /// ask whether a prefix is stored, across tenants, without credentials.
    pub lookup_http: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:9000".parse().expect("valid address"),
            store: "file://./objectcache-data".into(),
            fsync: true,
            access_keys: Vec::new(),
            allow_anonymous: false,
            buckets: Vec::new(),
            max_object_bytes: 5 << 30,
            max_descriptor_bytes: 1 << 20,
            max_chunks: 4096,
            max_concurrent_loads: 64,
            max_queued_loads: 1024,
            max_request_bytes: 256 << 20,
            memory_budget_bytes: 2 << 30,
            read_concurrency: 32,
            always_verify: false,
            read_segments: true,
            scheduler: "fifo".into(),
            bandwidth_cap_bytes_per_s: 0,
            client_timeout_secs: 30,
            min_client_bytes_per_s: 16 << 10,
            handshake_timeout_secs: 10,
            idle_timeout_secs: 120,
            max_connections: 4096,
            max_connections_per_ip: 512,
            shutdown_grace_secs: 10,
            log_format: "text".into(),
            log_filter: "info".into(),
            tenants: Vec::new(),
            tls_cert: None,
            tls_key: None,
            tier_dram_bytes: 0,
            tier_disk_dir: None,
            tier_disk_bytes: 0,
            tier_admission: "all".into(),
            lookup_http: false,
        }
    }
}

impl ServerConfig {
    /// The node tier's settings, when one is configured (a DRAM or a disk level).
    ///
    /// # Errors
    /// [`objectcache_client::Error::Config`] for a bad `tier_admission`.
    pub fn tier(
        &self,
    ) -> objectcache_client::Result<Option<objectcache_client::store::TierConfig>> {
        if self.tier_dram_bytes == 0 && self.tier_disk_dir.is_none() {
            return Ok(None);
        }
        Ok(Some(objectcache_client::store::TierConfig {
            dram_bytes: self.tier_dram_bytes,
            disk_dir: self.tier_disk_dir.clone(),
            disk_bytes: self.tier_disk_bytes,
            admission: objectcache_client::store::Admission::parse(&self.tier_admission)
                .map_err(|e| objectcache_client::Error::Config(e.to_string()))?,
        }))
    }

    /// Parses a TOML document (unknown keys are errors).
    ///
    /// # Errors
    /// [`objectcache_client::Error::Config`] with the parser's message (line and column).
    pub fn from_toml(s: &str) -> objectcache_client::Result<Self> {
        toml::from_str(s)
            .map_err(|e| objectcache_client::Error::Config(format!("config file: {e}")))
    }

    /// These settings with every secret (access keys' and tenants' secret keys, tenants'
    /// salts) replaced by
    /// [`REDACTED`], for printing (`objectcache serve --print-config`) and logs.
    pub fn redacted(&self) -> Self {
        let mut c = self.clone();
        for k in &mut c.access_keys {
            k.secret_key = REDACTED.into();
        }
        for t in &mut c.tenants {
            t.secret_key = REDACTED.into();
            if t.salt.is_some() {
                t.salt = Some(REDACTED.into());
            }
        }
        c
    }

    /// Checks the settings against each other.
    ///
    /// # Errors
    /// [`objectcache_client::Error::Config`] naming the setting.
    pub fn validate(&self) -> objectcache_client::Result<()> {
        let bad = |m: String| Err(objectcache_client::Error::Config(m));
        objectcache_client::store::Admission::parse(&self.tier_admission)
            .map_err(|e| objectcache_client::Error::Config(e.to_string()))?;
        if self.tier_disk_dir.is_some() != (self.tier_disk_bytes > 0) {
            return bad(format!(
                "tier_disk_dir and tier_disk_bytes go together (dir {:?}, {} bytes)",
                self.tier_disk_dir, self.tier_disk_bytes
            ));
        }
        super::tenant::Tenants::new(&self.tenants)
            .map_err(|e| objectcache_client::Error::Config(e.to_string()))?;
        if let Some(m) = self
            .buckets
            .iter()
            .find_map(|b| objectcache_client::protocol::check_bucket_name(b).err())
        {
            return bad(format!("buckets: {m}"));
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return bad("tls_cert and tls_key go together: set both or neither".into());
        }
        if let Some(k) = self
            .access_keys
            .iter()
            .find(|k| self.tenants.iter().any(|t| t.access_key == k.access_key))
        {
            return bad(format!(
                "access key {:?} is both an operator key and a tenant's",
                k.access_key
            ));
        }
        if self.access_keys.is_empty() && self.tenants.is_empty() && !self.allow_anonymous {
            return bad("no access key is configured: set access_keys (--access-key ACCESS:SECRET) or allow_anonymous".into());
        }
        if self.max_request_bytes < objectcache_client::protocol::MAX_UNIT_BYTES as u64 {
            return bad(format!(
                "max_request_bytes {} must be at least one 16 MiB unit",
                self.max_request_bytes
            ));
        }
        if self.memory_budget_bytes < self.max_request_bytes {
            return bad(format!(
                "memory_budget_bytes {} must be at least max_request_bytes {}",
                self.memory_budget_bytes, self.max_request_bytes
            ));
        }
        if self.client_timeout_secs == 0
            || self.handshake_timeout_secs == 0
            || self.idle_timeout_secs == 0
        {
            return bad(
                "client_timeout_secs, handshake_timeout_secs and idle_timeout_secs must be at least 1"
                    .into(),
            );
        }
        if self.max_connections == 0 || self.max_connections_per_ip == 0 {
            return bad("max_connections and max_connections_per_ip must be at least 1".into());
        }
        if self.max_concurrent_loads == 0 || self.read_concurrency == 0 {
            return bad("max_concurrent_loads and read_concurrency must be at least 1".into());
        }
        if self.max_descriptor_bytes < 1024
            || self.max_descriptor_bytes > objectcache_client::protocol::MAX_CONTROL_FRAME_BYTES
        {
            return bad(format!(
                "max_descriptor_bytes {} must be 1 KiB ..= 16 MiB",
                self.max_descriptor_bytes
            ));
        }
        if self.max_chunks == 0 || self.max_chunks > objectcache_client::protocol::MAX_CHUNKS_HARD {
            return bad(format!(
                "max_chunks {} must be 1 ..= 65536",
                self.max_chunks
            ));
        }
        objectcache_client::sched::SchedulerSetting::parse(&self.scheduler)?;
        if !["text", "json"].contains(&self.log_format.as_str()) {
            return bad(format!(
                "log_format {:?}: use text or json",
                self.log_format
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let mut c = ServerConfig::default();
        c.access_keys
            .push(AccessKey::parse("AKOPERATOR:opsecret-123456").unwrap());
        c.tenants.push(crate::tenant::TenantConfig {
            access_key: "AKTENANT".into(),
            secret_key: "tenantsecret-654321".into(),
            namespace: "team-a".into(),
            salt: Some("saltsecret-999".into()),
        });
        let shown = [
            toml::to_string_pretty(&c.redacted()).unwrap(),
            format!("{c:?}"),
            format!("{:?}", c.redacted()),
        ];
        for s in &shown {
            for secret in ["opsecret-123456", "tenantsecret-654321", "saltsecret-999"] {
                assert!(!s.contains(secret), "{secret} shown in {s}");
            }
            assert!(
                s.contains("AKOPERATOR") && s.contains("AKTENANT") && s.contains(REDACTED),
                "{s}"
            );
        }
        // The redacted form is for printing only; the settings keep their secrets.
        assert_eq!(c.access_keys[0].secret_key, "opsecret-123456");
    }
}
