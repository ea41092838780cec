//! Engine configuration: one set of key/value names shared by the Rust API, the C ABI and
//! the command line.

use crate::error::Error;
use crate::layout::HashAlgo;
use std::time::Duration;

/// Configuration of an [`super::Engine`]. Every field has a key of the same name for
/// [`EngineConfig::from_pairs`] (the C ABI's `objectcache_engine_create` takes the same keys).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// `store`: where objects live, as a URL (see `store::open_store`): a directory path or
    /// `file:///path` (the embedded default), `memory://`, `s3://bucket/prefix?endpoint=...`.
    /// Default: `file://` + `$XDG_CACHE_HOME/objectcache/store` (or `~/.cache/...`).
    pub store: String,
    /// `namespace`: first key component; separates tenants and deployments. Default `default`.
    pub namespace: String,
    /// `hash_algo`: `sha256cbor` (default, vLLM-compatible) or `ext` (caller's own hashes).
    pub hash_algo: HashAlgo,
    /// `window_bytes`: look-ahead window of a load, bytes in flight at most. Default 1 GiB.
    /// A ranged-GET load starts with 256 MiB in flight at most (less where this is less) and
    /// grows to about twice the measured bandwidth-delay product where that is more, up to
    /// this bound: 1 GiB covers a 100 ms round trip at 5 GB/s. Ranged-GET bodies land in the
    /// destination as they arrive, so bytes in flight are not buffered in memory.
    pub window_bytes: u64,
    /// `max_requests`: concurrent storage requests of one load on a short round trip (the
    /// cap grows past it, within `window_bytes`, when the measured bandwidth-delay product
    /// needs more; a load's first-layer reads, one per chunk, go out together within the
    /// window; never more than 256 in flight). Also the connections the engine opens to an
    /// S3 endpoint when it starts. Default 32.
    pub max_requests: usize,
    /// `coalesce_bytes`: a ranged GET after layer 0 spans following layers of the same chunk
    /// up to this size (0 = one slice per request). Default 4 MiB (the paper's amortising
    /// unit).
    pub coalesce_bytes: u64,
    /// `lookup_fanout`: markers probed in parallel per lookup round trip. Default 16, so a
    /// lookup of n chunks costs at most ceil(log17(n+1)) round trips.
    pub lookup_fanout: usize,
    /// `lookup_cache_ttl_ms`: how long lookup answers (hits and misses) are reused. Default
    /// 2,000 ms; 0 disables the cache.
    pub lookup_cache_ttl: Duration,
    /// `lookup_deadline_ms`: how long a lookup waits for the store. A lookup still waiting
    /// then answers with the prefix its answers so far have shown published (a probe answered
    /// present shows every chunk before it published; an unanswered position counts as
    /// absent), instead of nothing: a store that answers some probes late (a node tier that
    /// holds the prefix in front of a slow remote store, which alone can say that the next
    /// chunk is absent) still gives the hits it confirmed. Probes answered later still enter
    /// the lookup cache. Default 0: no deadline, a lookup waits for every answer (the vLLM
    /// connector sets it from its own `lookup_timeout_ms`).
    pub lookup_deadline: Duration,
    /// `load_timeout_ms`: a fixed deadline for a whole load; layers not ready by then fail
    /// with `Timeout`. Default: none fixed, the deadline comes from the load's size
    /// (`load_min_rate_bytes_per_s`, [`EngineConfig::load_deadline`]). `0` removes every
    /// overall deadline (the stall watchdog, `stall_timeout_ms`, still runs); `auto` restores
    /// the size-derived default.
    pub load_timeout: Option<Duration>,
    /// `load_min_rate_bytes_per_s`: without a fixed `load_timeout`, a load's deadline is
    /// [`LOAD_DEADLINE_FLOOR`] plus its bytes at this rate. Default 10,000,000 (10 MB/s: a
    /// 4 MiB load gets 10.4 s, a 512 MiB one about 64 s); 0 = no size-derived deadline.
    pub load_min_rate_bytes_per_s: u64,
    /// `stall_timeout_ms`: the per-load progress watchdog. When nothing arrives for a load
    /// for longer than the stall limit (no payload byte and no sign of life from a server
    /// that holds the load on purpose), its remaining layers fail at once with
    /// [`crate::LayerError::Stalled`] naming the store, whatever the overall deadline.
    /// `auto` (default, [`StallTimeout::Auto`]): four times the expected time of the next
    /// unit at the rate observed so far, at least [`STALL_FLOOR`] (1 s), and
    /// [`STALL_FIRST_BYTE`] (3 s) before the first byte; a number: that many milliseconds;
    /// `0` switches the watchdog off.
    pub stall_timeout: StallTimeout,
    /// `save_concurrency`: concurrent object writes of one save. Default 16.
    pub save_concurrency: usize,
    /// `worker_threads`: threads of the engine's own async runtime. Default 2.
    pub worker_threads: usize,
    /// `cpus`: the CPUs the engine's own threads (its runtime's workers and blocking
    /// threads, and the threads they start) may run on, as a list such as `1` or `0,2-3`;
    /// empty (default, or `inherit`): those of the thread that creates the engine. An engine
    /// created inside an inference engine's compute thread, which is pinned to its compute
    /// cores (vLLM on the CPU binds its OpenMP threads), otherwise copies and checks KV on
    /// those same cores while the forward pass needs them. CPUs the process may not use are
    /// left out by the kernel; a list with none it may use is logged and ignored.
    pub cpus: Vec<usize>,
    /// `gather`: `auto` (default) loads through the gather protocol when the store's S3
    /// endpoint is an ObjectCache server (probed once), ranged GETs otherwise; `off` always
    /// uses ranged GETs.
    pub gather: bool,
    /// `gather_streams`: TCP connections one gather load is striped over (1..=16; default
    /// 2). The load's chunks are split into that many contiguous runs, each a gather request
    /// on its own connection and task, so receiving (socket copy and CRC32C check) runs on as
    /// many engine threads (`worker_threads`) at once; every layer is ready when all runs
    /// delivered their part. One TCP stream is bound by one receiving core (about 4 GB/s
    /// here, 3-5 GB/s on servers), below a 100 Gb/s link. Loads of fewer chunks use fewer
    /// streams. See `docs/protocol.md` ("Striped loads").
    pub gather_streams: usize,
    /// `single_flight`: `on` (default): a load whose chunks are the leading chunks of a load
    /// in flight in this engine copies that load's layers as they land instead of fetching
    /// them again (one fetch for many requests; it follows only a load with at most twice its
    /// own bytes still to come, and fetches the rest itself if that load ends early); `off`:
    /// every load fetches.
    pub single_flight: bool,
    /// `self_check`: `on` (default): an engine opened on a remote store (S3, gateways)
    /// checks it once per store URL and process, in the background, and refuses saves to a
    /// store that fails (`objectcache doctor` runs the same checks; `connector/self_check.rs`
    /// says what follows from each mode); `off`: no check.
    pub self_check: bool,
    /// `transport`: how gather loads move bytes. `auto` (default): RDMA when this build has
    /// feature `rdma`, the server announces the RDMA target and this host has an RDMA device
    /// (else TCP gather); `tcp`: always TCP gather; `rdma`: RDMA wanted (refused as a setting
    /// by a build without feature `rdma`; still falls back to TCP gather, with a warning, when
    /// the server or host has no RDMA). See `docs/rdma.md`.
    pub transport: Transport,
    /// `scheduler`: how this engine's loads share `bandwidth_cap_bytes_per_s` on the
    /// ranged-GET path: `stall-aware` (default; earliest layer deadline first with
    /// water-filling), `equal` (equal share), `byte-prop` (share proportional to bytes left),
    /// `fifo` or `priority` (the earliest load takes all it can). The long names
    /// `equal-share` and `byte-proportional` are accepted too. No effect while uncapped. See
    /// `docs/scheduling.md`, section 7.
    pub scheduler: String,
    /// `bandwidth_cap_bytes_per_s`: the host NIC share this engine's ranged-GET loads may use
    /// together, bytes/s, shared under `scheduler` by one link per engine; 0 (default) =
    /// uncapped, reads go out as fast as `window_bytes`/`max_requests` allow. Under a cap each
    /// read is one layer slice (`coalesce_bytes` is not used) and is issued when the load's
    /// credit at its allocated rate covers it. Gather loads are paced by the server's own cap.
    pub bandwidth_cap_bytes_per_s: u64,
    /// `save_format`: the object format saves write. `v1` (default): one object per chunk
    /// (`kv/{hash}`) and a 16-byte marker. `v2`: one segment object per save holding its
    /// chunks layer-major (split at `segment_max_bytes`), and a 64-byte marker per chunk naming
    /// it, so a load reads one byte range per segment and layer (a few ranged GETs) whatever
    /// the chunk size (`docs/object-format.md`, "Format version 2"). Loads read both formats
    /// whatever this says. Version 2 is for the ranged-GET path: the gather server does not
    /// resolve version 2 markers yet, so a load that knows of a segment skips gather.
    pub save_format: SaveFormat,
    /// `segment_max_bytes`: the most KV bytes (chunk-layer slices) one segment object of a
    /// `v2` save holds; a larger save is cut into segments of whole chunks, at least one
    /// each. The object adds its header (64 bytes and one entry of up to 65 bytes per chunk)
    /// and a 4-byte CRC32C per slice. At most 4 GiB, so that every segment is one PUT within
    /// AWS S3's 5 GiB limit. Default 1 GiB: a 32K-token save at 8B geometry (4 GiB of KV) is
    /// four segments, and a load of it 4 ranged GETs per layer.
    pub segment_max_bytes: u64,
}

/// The `save_format` setting of [`EngineConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SaveFormat {
    /// Format version 1: one chunk object per chunk.
    #[default]
    V1,
    /// Format version 2: segment objects of whole saves.
    V2,
}

/// The largest `segment_max_bytes`: 4 GiB of KV, so that a segment object (KV, CRCs and
/// header) stays within 5 GiB, the single PUT limit of AWS S3, for any slice of at least 64
/// bytes.
pub const MAX_SEGMENT_BYTES: u64 = 4 << 30;

/// The `stall_timeout_ms` setting of [`EngineConfig`]: when a load that receives nothing is
/// given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StallTimeout {
    /// From the load's own progress: four times the expected time of the next unit (the
    /// largest single read or gather unit of the load) at the rate observed so far, at least
    /// [`STALL_FLOOR`]; [`STALL_FIRST_BYTE`] before the first byte.
    #[default]
    Auto,
    /// A fixed limit (also before the first byte).
    After(Duration),
    /// No watchdog: only the overall deadline (if any) ends a load that receives nothing.
    Off,
}

/// The least stall limit of [`StallTimeout::Auto`] once bytes arrive: 1 s. A server that
/// holds a load on purpose says so at least every 250 ms (`Held` frames), so a paused load
/// is never taken for a stalled one; on loopback, a silent store is given up about 1 s after
/// its last byte.
pub const STALL_FLOOR: Duration = Duration::from_secs(1);
/// The stall limit of [`StallTimeout::Auto`] before the first byte of a load (connection,
/// the server's first backend read, an S3 first byte): 3 s.
pub const STALL_FIRST_BYTE: Duration = Duration::from_secs(3);
/// The fixed part of the size-derived load deadline ([`EngineConfig::load_deadline`]): 10 s.
pub const LOAD_DEADLINE_FLOOR: Duration = Duration::from_secs(10);

/// The `transport` setting of [`EngineConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// RDMA where available, else TCP gather.
    #[default]
    Auto,
    /// TCP gather only.
    Tcp,
    /// RDMA wanted (warns when it falls back).
    Rdma,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            store: default_store_url(),
            namespace: "default".into(),
            hash_algo: HashAlgo::Sha256Cbor,
            window_bytes: 1 << 30,
            max_requests: 32,
            coalesce_bytes: 4 << 20,
            lookup_fanout: 16,
            lookup_cache_ttl: Duration::from_millis(2000),
            lookup_deadline: Duration::ZERO,
            load_timeout: None,
            load_min_rate_bytes_per_s: 10_000_000,
            stall_timeout: StallTimeout::Auto,
            save_concurrency: 16,
            worker_threads: 2,
            cpus: Vec::new(),
            gather: true,
            gather_streams: 2,
            single_flight: true,
            self_check: true,
            transport: Transport::Auto,
            scheduler: "stall-aware".into(),
            bandwidth_cap_bytes_per_s: 0,
            save_format: SaveFormat::V1,
            segment_max_bytes: 1 << 30,
        }
    }
}

/// The default cache directory: `$OBJECTCACHE_HOME`, else `$XDG_CACHE_HOME/objectcache`, else
/// `$HOME/.cache/objectcache`, else `./.cache/objectcache`.
pub fn default_cache_dir() -> std::path::PathBuf {
    if let Some(d) = std::env::var_os("OBJECTCACHE_HOME") {
        return d.into();
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return std::path::PathBuf::from(d).join("objectcache");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return std::path::PathBuf::from(h)
            .join(".cache")
            .join("objectcache");
    }
    std::path::PathBuf::from(".cache/objectcache")
}

fn default_store_url() -> String {
    format!("file://{}", default_cache_dir().join("store").display())
}

/// All keys accepted by [`EngineConfig::from_pairs`].
pub const CONFIG_KEYS: &[&str] = &[
    "store",
    "namespace",
    "hash_algo",
    "window_bytes",
    "max_requests",
    "coalesce_bytes",
    "lookup_fanout",
    "lookup_cache_ttl_ms",
    "lookup_deadline_ms",
    "load_timeout_ms",
    "load_min_rate_bytes_per_s",
    "stall_timeout_ms",
    "save_concurrency",
    "worker_threads",
    "cpus",
    "gather",
    "gather_streams",
    "single_flight",
    "self_check",
    "transport",
    "scheduler",
    "bandwidth_cap_bytes_per_s",
    "save_format",
    "segment_max_bytes",
];

/// Largest CPU index the `cpus` setting accepts, plus one (`CPU_SETSIZE` of Linux's
/// `cpu_set_t`).
pub const MAX_CPUS: usize = 1024;

/// Parses a CPU list (`cpus`): comma-separated indices and inclusive ranges (`0,2-3`), as in
/// Linux's `cpuset` and `taskset -c`; empty or `inherit` is the empty list.
///
/// # Errors
/// [`Error::Config`] naming the part that is not an index or range below [`MAX_CPUS`].
pub fn parse_cpu_list(value: &str) -> Result<Vec<usize>, Error> {
    let v = value.trim();
    if v.is_empty() || v == "inherit" {
        return Ok(Vec::new());
    }
    let bad = |part: &str| {
        Error::Config(format!(
            "cpus: {part:?} in {value:?} is not a CPU index or range below {MAX_CPUS} (e.g. 1 or 0,2-3)"
        ))
    };
    let mut out = Vec::new();
    for part in v.split(',') {
        let part = part.trim();
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b) = match (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
            (Ok(a), Ok(b)) if a <= b && b < MAX_CPUS => (a, b),
            _ => return Err(bad(part)),
        };
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

impl EngineConfig {
    /// Applies one `key = value` setting.
    ///
    /// # Errors
    /// [`Error::Config`] naming an unknown key (and listing the known ones) or a value that
    /// does not parse or is out of range.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), Error> {
        let num = |v: &str| -> Result<u64, Error> {
            v.trim()
                .parse::<u64>()
                .map_err(|_| Error::Config(format!("{key}: {v:?} is not a non-negative integer")))
        };
        let pos = |v: &str| -> Result<u64, Error> {
            let n = num(v)?;
            if n == 0 {
                return Err(Error::Config(format!("{key} must be at least 1")));
            }
            Ok(n)
        };
        match key {
            "store" => self.store = value.to_string(),
            "namespace" => {
                crate::layout::validate_namespace(value)
                    .map_err(|e| Error::Config(e.to_string()))?;
                self.namespace = value.to_string()
            }
            "hash_algo" => {
                self.hash_algo = match value {
                    "sha256cbor" | "sha256_cbor" => HashAlgo::Sha256Cbor,
                    "ext" | "external" => HashAlgo::External,
                    v => {
                        return Err(Error::Config(format!(
                            "hash_algo: {v:?} is not sha256cbor or ext"
                        )))
                    }
                }
            }
            "window_bytes" => self.window_bytes = pos(value)?,
            "max_requests" => self.max_requests = pos(value)? as usize,
            "coalesce_bytes" => self.coalesce_bytes = num(value)?,
            "lookup_fanout" => self.lookup_fanout = pos(value)? as usize,
            "lookup_cache_ttl_ms" => self.lookup_cache_ttl = Duration::from_millis(num(value)?),
            "lookup_deadline_ms" => self.lookup_deadline = Duration::from_millis(num(value)?),
            "load_timeout_ms" if value.trim() == "auto" => {
                self.load_timeout = None;
                self.load_min_rate_bytes_per_s = EngineConfig::default().load_min_rate_bytes_per_s;
            }
            "load_timeout_ms" => {
                let n = num(value)?;
                self.load_timeout = (n > 0).then(|| Duration::from_millis(n));
                if n == 0 {
                    self.load_min_rate_bytes_per_s = 0;
                }
            }
            "load_min_rate_bytes_per_s" => self.load_min_rate_bytes_per_s = num(value)?,
            "stall_timeout_ms" => {
                self.stall_timeout = match value.trim() {
                    "auto" => StallTimeout::Auto,
                    "off" => StallTimeout::Off,
                    v => match num(v)? {
                        0 => StallTimeout::Off,
                        n => StallTimeout::After(Duration::from_millis(n)),
                    },
                }
            }
            "save_concurrency" => self.save_concurrency = pos(value)? as usize,
            "worker_threads" => self.worker_threads = pos(value)? as usize,
            "cpus" => self.cpus = parse_cpu_list(value)?,
            "gather" => {
                self.gather = match value {
                    "auto" | "on" | "true" | "1" => true,
                    "off" | "false" | "0" => false,
                    v => return Err(Error::Config(format!("gather: {v:?} is not auto or off"))),
                }
            }
            "gather_streams" => {
                let n = pos(value)?;
                if n > 16 {
                    return Err(Error::Config(format!(
                        "gather_streams: {n} is more than 16 connections per load"
                    )));
                }
                self.gather_streams = n as usize
            }
            "single_flight" => {
                self.single_flight = match value {
                    "on" | "true" | "1" => true,
                    "off" | "false" | "0" => false,
                    v => {
                        return Err(Error::Config(format!(
                            "single_flight: {v:?} is not on or off"
                        )))
                    }
                }
            }
            "self_check" => {
                self.self_check = match value {
                    "on" | "true" | "1" => true,
                    "off" | "false" | "0" => false,
                    v => return Err(Error::Config(format!("self_check: {v:?} is not on or off"))),
                }
            }
            "transport" => {
                self.transport = match value {
                    "auto" => Transport::Auto,
                    "tcp" => Transport::Tcp,
                    "rdma" if cfg!(feature = "rdma") => Transport::Rdma,
                    "rdma" => {
                        return Err(Error::Config(
                            "transport: rdma needs a build with feature `rdma`".into(),
                        ))
                    }
                    v => {
                        return Err(Error::Config(format!(
                            "transport: {v:?} is not auto, tcp or rdma"
                        )))
                    }
                }
            }
            "scheduler" => {
                crate::sched::SchedulerSetting::parse(value)?;
                self.scheduler = value.to_string()
            }
            "bandwidth_cap_bytes_per_s" => self.bandwidth_cap_bytes_per_s = num(value)?,
            "save_format" => {
                self.save_format = match value.trim() {
                    "v1" | "1" => SaveFormat::V1,
                    "v2" | "2" => SaveFormat::V2,
                    v => return Err(Error::Config(format!("save_format: {v:?} is not v1 or v2"))),
                }
            }
            "segment_max_bytes" => {
                let n = pos(value)?;
                if n > MAX_SEGMENT_BYTES {
                    return Err(Error::Config(format!(
                        "segment_max_bytes: {n} is more than {MAX_SEGMENT_BYTES} (4 GiB of KV in one S3 PUT)"
                    )));
                }
                self.segment_max_bytes = n
            }
            k => {
                return Err(Error::Config(format!(
                    "unknown setting {k:?}; known settings: {}",
                    CONFIG_KEYS.join(", ")
                )))
            }
        }
        Ok(())
    }

    /// The overall deadline of a load of `bytes` payload bytes: `load_timeout` when set,
    /// else [`LOAD_DEADLINE_FLOOR`] plus `bytes` at `load_min_rate_bytes_per_s`, else (rate
    /// 0) none.
    pub fn load_deadline(&self, bytes: u64) -> Option<Duration> {
        match (self.load_timeout, self.load_min_rate_bytes_per_s) {
            (Some(t), _) => Some(t),
            (None, 0) => None,
            (None, r) => {
                Some(LOAD_DEADLINE_FLOOR + Duration::from_secs_f64(bytes as f64 / r as f64))
            }
        }
    }

    /// Defaults overridden by `pairs`.
    ///
    /// # Errors
    /// As [`EngineConfig::set`].
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, Error> {
        let mut c = EngineConfig::default();
        for (k, v) in pairs {
            c.set(k, v)?;
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_parse_and_errors_name_the_key() {
        let c = EngineConfig::from_pairs([
            ("namespace", "t1"),
            ("window_bytes", "1024"),
            ("load_timeout_ms", "0"),
        ])
        .unwrap();
        assert_eq!(c.namespace, "t1");
        assert_eq!(c.window_bytes, 1024);
        assert_eq!(c.load_timeout, None);
        let e = EngineConfig::from_pairs([("windw_bytes", "1")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("windw_bytes") && e.contains("window_bytes"),
            "{e}"
        );
        let e = EngineConfig::from_pairs([("max_requests", "-3")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_requests"), "{e}");
        assert_eq!(EngineConfig::default().gather_streams, 2);
        assert_eq!(
            EngineConfig::from_pairs([("gather_streams", "4")])
                .unwrap()
                .gather_streams,
            4
        );
        for bad in ["0", "17", "two"] {
            let e = EngineConfig::from_pairs([("gather_streams", bad)])
                .unwrap_err()
                .to_string();
            assert!(e.contains("gather_streams"), "{bad}: {e}");
        }
    }

    #[test]
    fn cpu_lists_parse_and_errors_name_the_part() {
        let c = |v: &str| EngineConfig::from_pairs([("cpus", v)]).map(|c| c.cpus);
        assert_eq!(EngineConfig::default().cpus, Vec::<usize>::new());
        assert_eq!(c("1").unwrap(), vec![1]);
        assert_eq!(c(" 3-5, 0,4 ").unwrap(), vec![0, 3, 4, 5]);
        assert_eq!(c("inherit").unwrap(), Vec::<usize>::new());
        assert_eq!(c("").unwrap(), Vec::<usize>::new());
        for (bad, part) in [("1,x", "x"), ("5-2", "5-2"), ("1024", "1024"), ("-1", "-1")] {
            let e = c(bad).unwrap_err().to_string();
            assert!(
                e.contains("cpus") && e.contains(&format!("{part:?}")),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn deadline_and_stall_keys() {
        let d = EngineConfig::default();
        assert_eq!(
            (d.load_timeout, d.stall_timeout),
            (None, StallTimeout::Auto)
        );
        // The default deadline grows with the load: 10 s + bytes at 10 MB/s.
        assert_eq!(d.load_deadline(0), Some(Duration::from_secs(10)));
        assert_eq!(d.load_deadline(500_000_000), Some(Duration::from_secs(60)));
        let c = EngineConfig::from_pairs([("load_timeout_ms", "2500")]).unwrap();
        assert_eq!(c.load_deadline(1 << 40), Some(Duration::from_millis(2500)));
        // 0 removes every overall deadline, but not the watchdog.
        let c = EngineConfig::from_pairs([("load_timeout_ms", "0")]).unwrap();
        assert_eq!(
            (c.load_deadline(1 << 30), c.stall_timeout),
            (None, StallTimeout::Auto)
        );
        let c = EngineConfig::from_pairs([("load_timeout_ms", "0"), ("load_timeout_ms", "auto")])
            .unwrap();
        assert_eq!(c.load_deadline(0), Some(Duration::from_secs(10)));
        let c = EngineConfig::from_pairs([("load_min_rate_bytes_per_s", "1000000")]).unwrap();
        assert_eq!(c.load_deadline(5_000_000), Some(Duration::from_secs(15)));
        for (v, want) in [
            ("auto", StallTimeout::Auto),
            ("0", StallTimeout::Off),
            ("off", StallTimeout::Off),
            ("750", StallTimeout::After(Duration::from_millis(750))),
        ] {
            assert_eq!(
                EngineConfig::from_pairs([("stall_timeout_ms", v)])
                    .unwrap()
                    .stall_timeout,
                want
            );
        }
        let e = EngineConfig::from_pairs([("stall_timeout_ms", "soon")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("stall_timeout_ms"), "{e}");
    }

    #[test]
    fn scheduler_and_cap_keys() {
        let d = EngineConfig::default();
        assert_eq!(
            (d.scheduler.as_str(), d.bandwidth_cap_bytes_per_s),
            ("stall-aware", 0)
        );
        let c = EngineConfig::from_pairs([
            ("scheduler", "equal"),
            ("bandwidth_cap_bytes_per_s", "40000000"),
        ])
        .unwrap();
        assert_eq!(c.scheduler, "equal");
        assert_eq!(c.bandwidth_cap_bytes_per_s, 40_000_000);
        let e = EngineConfig::from_pairs([("scheduler", "lottery")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("scheduler") && e.contains("lottery"), "{e}");
        let e = EngineConfig::from_pairs([("bandwidth_cap_bytes_per_s", "1.5e9")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("bandwidth_cap_bytes_per_s"), "{e}");
    }
}
