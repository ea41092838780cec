//! Prometheus metrics of the server (text exposition at `GET /_objectcache/metrics`).
//!
//! Names: `objectcache_server_requests_total{op}`, `objectcache_server_bytes_total{direction}`,
//! `objectcache_server_errors_total{kind}`, `objectcache_server_active_loads`,
//! `objectcache_server_queued_loads`, `objectcache_server_open_connections`,
//! `objectcache_server_inflight_bytes` (bytes held under the memory budget),
//! `objectcache_server_ttfl_seconds` (request received to first unit written) and
//! `objectcache_server_layer_seconds` (request received to each layer's last unit written).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: String,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirLabel {
    direction: String,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// The server's metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<OpLabel, Counter>,
    bytes: Family<DirLabel, Counter>,
    errors: Family<KindLabel, Counter>,
    /// Loads being served.
    pub active_loads: Gauge,
    /// Loads waiting for admission.
    pub queued_loads: Gauge,
    /// Connections open (S3 and gather).
    pub open_connections: Gauge,
    /// Bytes held under the memory budget: read from the backend and not yet written to a
    /// client, or received from a client and not yet written to the backend.
    pub inflight_bytes: Gauge,
    /// Highest `inflight_bytes` since start.
    pub inflight_peak_bytes: Gauge,
    ttfl: Histogram,
    layer: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("objectcache_server");
        let requests = Family::<OpLabel, Counter>::default();
        let bytes = Family::<DirLabel, Counter>::default();
        let errors = Family::<KindLabel, Counter>::default();
        let active_loads = Gauge::default();
        let queued_loads = Gauge::default();
        let open_connections = Gauge::default();
        let inflight_bytes = Gauge::default();
        let inflight_peak_bytes = Gauge::default();
        // 100 us .. ~100 s.
        let ttfl = Histogram::new(exponential_buckets(1e-4, 2.0, 21));
        let layer = Histogram::new(exponential_buckets(1e-4, 2.0, 21));
        registry.register(
            "requests",
            "Requests by operation (S3 ops, gather, save)",
            requests.clone(),
        );
        registry.register("bytes", "Payload bytes by direction", bytes.clone());
        registry.register("errors", "Errors by kind", errors.clone());
        registry.register(
            "active_loads",
            "Gather loads being served",
            active_loads.clone(),
        );
        registry.register(
            "queued_loads",
            "Gather loads waiting for admission",
            queued_loads.clone(),
        );
        registry.register(
            "open_connections",
            "Connections open (S3 and gather)",
            open_connections.clone(),
        );
        registry.register(
            "inflight_bytes",
            "Bytes held under the memory budget (read and not yet sent, or received and not yet stored)",
            inflight_bytes.clone(),
        );
        registry.register(
            "inflight_peak_bytes",
            "Highest inflight_bytes since start",
            inflight_peak_bytes.clone(),
        );
        registry.register(
            "ttfl_seconds",
            "Time from gather request to its first unit written",
            ttfl.clone(),
        );
        registry.register(
            "layer_seconds",
            "Time from gather request to each layer's last unit written",
            layer.clone(),
        );
        Metrics {
            registry,
            requests,
            bytes,
            errors,
            active_loads,
            queued_loads,
            open_connections,
            inflight_bytes,
            inflight_peak_bytes,
            ttfl,
            layer,
        }
    }
    /// Counts one request of operation `op`.
    pub fn request(&self, op: &str) {
        self.requests
            .get_or_create(&OpLabel { op: op.into() })
            .inc();
    }
    /// Requests of operation `op` counted since start (as exported in
    /// `objectcache_server_requests_total`): `gather`, `backend_read`, `backend_read_joined`,
    /// an S3 operation's name, ...
    pub fn requests_total(&self, op: &str) -> u64 {
        self.requests
            .get_or_create(&OpLabel { op: op.into() })
            .get()
    }
    /// Counts `n` payload bytes in `direction` (`gather_out`, `save_in`, `s3_in`, `s3_out`).
    pub fn bytes(&self, direction: &str, n: u64) {
        self.bytes
            .get_or_create(&DirLabel {
                direction: direction.into(),
            })
            .inc_by(n);
    }
    /// Payload bytes counted in `direction` since start (as exported in
    /// `objectcache_server_bytes_total`). `gather_out` grows as each unit is written to the
    /// client's socket (or each RDMA write completes), so its rate over time is the server's
    /// gather send rate.
    pub fn bytes_total(&self, direction: &str) -> u64 {
        self.bytes
            .get_or_create(&DirLabel {
                direction: direction.into(),
            })
            .get()
    }
    /// Counts one error of `kind`.
    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&KindLabel { kind: kind.into() })
            .inc();
    }
    /// Adds `n` bytes in flight, updating the peak.
    pub fn add_inflight(&self, n: i64) {
        let now = self.inflight_bytes.inc_by(n) + n;
        self.inflight_peak_bytes
            .inner()
            .fetch_max(now, std::sync::atomic::Ordering::Relaxed);
    }
    /// Records a time to first layer, seconds.
    pub fn observe_ttfl(&self, s: f64) {
        self.ttfl.observe(s);
    }
    /// Records a layer completion time, seconds.
    pub fn observe_layer(&self, s: f64) {
        self.layer.observe(s);
    }
    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}

/// The node tier's counters added to an OpenMetrics text (before its `# EOF`):
/// `objectcache_tier_{hits,misses,served_bytes,evictions,refused,admitted}_total{level}`,
/// `objectcache_tier_{bytes,objects,capacity_bytes}{level}` (`level` = `dram`, `disk`),
/// `objectcache_tier_fills_total`, `objectcache_tier_fill_bytes_total`,
/// `objectcache_tier_fill_seconds_total`, `objectcache_tier_fills_shared_total`,
/// `objectcache_tier_fills_corrupt_total`, `objectcache_tier_marker_hits_total`, the gauge
/// `objectcache_tier_markers`, and the disk level's start-up
/// `objectcache_tier_disk_recovered` and `objectcache_tier_disk_dropped`.
pub fn with_tier(text: String, t: &objectcache_client::store::TierStats) -> String {
    use std::fmt::Write;
    let body = text.strip_suffix("# EOF\n").unwrap_or(&text).to_string();
    let mut s = body;
    let levels = [("dram", &t.dram), ("disk", &t.disk)];
    let counters: [(
        &str,
        &str,
        fn(&objectcache_client::store::LevelStats) -> u64,
    ); 6] = [
        ("hits", "Reads served from the level.", |l| l.hits),
        ("misses", "Reads the level did not hold.", |l| l.misses),
        ("served_bytes", "Bytes served from the level.", |l| {
            l.bytes_served
        }),
        ("evictions", "Objects evicted to make room.", |l| {
            l.evictions
        }),
        (
            "refused",
            "Objects the admission policy or the size kept out.",
            |l| l.refused,
        ),
        ("admitted", "Objects that entered the level.", |l| {
            l.admitted
        }),
    ];
    for (name, help, f) in counters {
        let _ = writeln!(s, "# TYPE objectcache_tier_{name} counter");
        let _ = writeln!(s, "# HELP objectcache_tier_{name} {help}");
        for (lv, l) in levels {
            let _ = writeln!(
                s,
                "objectcache_tier_{name}_total{{level=\"{lv}\"}} {}",
                f(l)
            );
        }
    }
    let gauges: [(
        &str,
        &str,
        fn(&objectcache_client::store::LevelStats) -> u64,
    ); 3] = [
        ("bytes", "Bytes the level holds.", |l| l.bytes),
        ("objects", "Objects the level holds.", |l| l.objects),
        ("capacity_bytes", "Bytes the level may hold.", |l| {
            l.capacity
        }),
    ];
    for (name, help, f) in gauges {
        let _ = writeln!(s, "# TYPE objectcache_tier_{name} gauge");
        let _ = writeln!(s, "# HELP objectcache_tier_{name} {help}");
        for (lv, l) in levels {
            let _ = writeln!(s, "objectcache_tier_{name}{{level=\"{lv}\"}} {}", f(l));
        }
    }
    for (name, help, v) in [
        (
            "fills",
            "Objects fetched from the backend for a miss.",
            t.fills as f64,
        ),
        (
            "fill_bytes",
            "Bytes those fetches moved.",
            t.fill_bytes as f64,
        ),
        (
            "fill_seconds",
            "Seconds those fetches took.",
            t.fill_seconds,
        ),
        (
            "fills_shared",
            "Reads that waited for another read's fetch.",
            t.fills_shared as f64,
        ),
        (
            "fills_corrupt",
            "Fetched objects that failed verification.",
            t.fills_corrupt as f64,
        ),
        (
            "marker_hits",
            "Publish-marker reads answered from the markers the tier remembers.",
            t.marker_hits as f64,
        ),
    ] {
        let _ = writeln!(s, "# TYPE objectcache_tier_{name} counter");
        let _ = writeln!(s, "# HELP objectcache_tier_{name} {help}");
        let _ = writeln!(s, "objectcache_tier_{name}_total {v}");
    }
    for (name, help, v) in [
        (
            "disk_recovered",
            "Disk files found and verified at start-up.",
            t.disk_recovered,
        ),
        (
            "disk_dropped",
            "Disk files found torn or corrupt at start-up.",
            t.disk_dropped,
        ),
        ("markers", "Publish markers remembered.", t.markers),
    ] {
        let _ = writeln!(s, "# TYPE objectcache_tier_{name} gauge");
        let _ = writeln!(s, "# HELP objectcache_tier_{name} {help}");
        let _ = writeln!(s, "objectcache_tier_{name} {v}");
    }
    s.push_str("# EOF\n");
    s
}

/// The remote backend's counters (gateway mode, [`objectcache_client::store::MeteredStore`]) added to an
/// OpenMetrics text (before its `# EOF`): `objectcache_server_backend_requests_total{class}`
/// (`class` = `get`: GETs, ranged GETs and HEADs; `put`: PUTs and LISTs; `delete`), and
/// `objectcache_server_backend_bytes_total{dir}` (`dir` = `read`, `written`; bytes), and
/// `objectcache_server_backend_seconds_total{class}` (`get`, `put`: seconds from each request
/// to the remote store's answer, summed; divide by the requests of the class for a mean).
pub fn with_backend(text: String, b: &objectcache_client::store::MeteredStats) -> String {
    use std::fmt::Write;
    let mut s = text.strip_suffix("# EOF\n").unwrap_or(&text).to_string();
    let _ = writeln!(s, "# TYPE objectcache_server_backend_requests counter");
    let _ = writeln!(
        s,
        "# HELP objectcache_server_backend_requests Requests sent to the remote store, by billing class."
    );
    for (class, v) in [("get", b.gets), ("put", b.puts), ("delete", b.deletes)] {
        let _ = writeln!(
            s,
            "objectcache_server_backend_requests_total{{class=\"{class}\"}} {v}"
        );
    }
    let _ = writeln!(s, "# TYPE objectcache_server_backend_bytes counter");
    let _ = writeln!(
        s,
        "# HELP objectcache_server_backend_bytes Bytes read from and written to the remote store."
    );
    for (dir, v) in [("read", b.read_bytes), ("written", b.written_bytes)] {
        let _ = writeln!(
            s,
            "objectcache_server_backend_bytes_total{{dir=\"{dir}\"}} {v}"
        );
    }
    let _ = writeln!(s, "# TYPE objectcache_server_backend_seconds counter");
    let _ = writeln!(
        s,
        "# HELP objectcache_server_backend_seconds Seconds spent waiting on the remote store, by billing class."
    );
    for (class, v) in [("get", b.get_time), ("put", b.put_time)] {
        let _ = writeln!(
            s,
            "objectcache_server_backend_seconds_total{{class=\"{class}\"}} {}",
            v.as_secs_f64()
        );
    }
    s.push_str("# EOF\n");
    s
}
