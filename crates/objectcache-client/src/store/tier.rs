//! [`TieredStore`]: a bounded node-level cache of chunk objects in front of a remote store —
//! a DRAM level and a local-disk level, each bounded in bytes — for an ObjectCache server
//! that every engine of a node shares (gateway mode over S3 or Ceph).
//!
//! - **What is cached:** whole chunk objects (format version 1 data objects, keys with a
//!   `/kv/` segment), verified before they enter a level (header, length and every layer's
//!   CRC32C). Publish markers it has seen present (read, or written through it) are
//!   remembered for [`MARKER_TTL`], within [`MARKER_BYTES`]: a lookup of a prefix the node
//!   already holds then needs no remote round trip, however slow the remote store is at that
//!   moment (seen on Ceph RGW under a fleet's saves: marker reads of 2-3 s, lookups given up).
//!   An absent marker is never remembered, so a lookup always sees what is newly published.
//!   Everything else (segment objects, listings) passes through to the remote store
//!   untouched.
//! - **Reads** (`get_opts`, whole or ranged) are served from DRAM, else from disk (and the
//!   object moves up to DRAM), else filled from the remote store once: concurrent misses of
//!   one key share one fetch (single-flight).
//! - **Admission** is a setting ([`Admission`]): every filled object, or only one asked for a
//!   second time within a window (a first request is served from the fetch without being
//!   kept).
//! - **Eviction** by size and recency (least recently used first), per level. A read in
//!   progress holds its own reference to the bytes (DRAM) or its open file (disk), so
//!   evicting an object never takes bytes from under a load.
//! - **Saves write through:** a put goes to the remote store first and is acknowledged only
//!   once the remote store has it (first writer wins there, as without the tier); then the
//!   object enters the tier. There is no write-back.
//! - **Restarts:** the disk level is found again at start-up and every file is verified
//!   before it is indexed; a torn or corrupt file is deleted, never served.
//!
//! Counters per level ([`TierStats`]): hits, misses, bytes served, evictions, admission
//! refusals, fills and their time.

use super::{
    resolve_range, validate_key, GetOptions, GetResult, ObjectMeta, PartialWrite, PutMode,
    PutOptions, PutResult, Store, StoreExt,
};
use crate::error::{StoreError, StoreResult};
use crate::layout::{slice_range, verify_slice, ChunkHeader};
use async_trait::async_trait;
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A level of the node tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TierLevel {
    /// The DRAM level.
    Dram,
    /// The local-disk level.
    Disk,
}

impl TierLevel {
    /// `"dram"` or `"disk"`.
    pub fn name(self) -> &'static str {
        match self {
            TierLevel::Dram => "dram",
            TierLevel::Disk => "disk",
        }
    }
}

/// When a filled object enters the tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Every object filled from the remote store.
    All,
    /// An object asked for the second time within `window` (KVBM admits to disk at frequency
    /// 2): one-off prefixes do not push out the ones that are reused.
    Second {
        /// How long the first request is remembered.
        window: Duration,
    },
}

impl Admission {
    /// Parses `all`, `second` (window 600 s) or `second:SECS`.
    ///
    /// # Errors
    /// [`BadSetting`](crate::error::BadSetting) naming the accepted forms.
    pub fn parse(s: &str) -> Result<Self, crate::error::BadSetting> {
        match s.trim() {
            "all" => Ok(Admission::All),
            "second" => Ok(Admission::Second {
                window: Duration::from_secs(600),
            }),
            x => match x
                .strip_prefix("second:")
                .and_then(|n| n.parse::<u64>().ok())
            {
                Some(secs) if secs > 0 => Ok(Admission::Second {
                    window: Duration::from_secs(secs),
                }),
                _ => Err(crate::error::BadSetting {
                    setting: "tier admission",
                    value: x.to_string(),
                    expected: "all, second or second:SECONDS",
                }),
            },
        }
    }
}

/// Settings of a [`TieredStore`].
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Bytes the DRAM level may hold (0: no DRAM level).
    pub dram_bytes: u64,
    /// Directory of the disk level (`None`: no disk level).
    pub disk_dir: Option<PathBuf>,
    /// Bytes the disk level may hold.
    pub disk_bytes: u64,
    /// When a filled object enters the tier.
    pub admission: Admission,
}

/// Counters of one level of the tier.
#[derive(Debug, Default)]
pub struct LevelCounters {
    /// Reads served from this level.
    pub hits: AtomicU64,
    /// Reads this level did not hold.
    pub misses: AtomicU64,
    /// Bytes served from this level.
    pub bytes_served: AtomicU64,
    /// Objects evicted to make room.
    pub evictions: AtomicU64,
    /// Objects the admission policy kept out.
    pub refused: AtomicU64,
    /// Objects that entered this level.
    pub admitted: AtomicU64,
}

/// A snapshot of one level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LevelStats {
    /// Bytes held now.
    pub bytes: u64,
    /// Objects held now.
    pub objects: u64,
    /// Bytes the level may hold.
    pub capacity: u64,
    /// Reads served from this level.
    pub hits: u64,
    /// Reads this level did not hold.
    pub misses: u64,
    /// Bytes served from this level.
    pub bytes_served: u64,
    /// Objects evicted to make room.
    pub evictions: u64,
    /// Objects the admission policy kept out.
    pub refused: u64,
    /// Objects that entered this level.
    pub admitted: u64,
}

/// A snapshot of the tier: each level, and the fills from the remote store.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TierStats {
    /// The DRAM level.
    pub dram: LevelStats,
    /// The disk level.
    pub disk: LevelStats,
    /// Objects fetched from the remote store to serve a miss (one per key and miss, however
    /// many reads waited for it).
    pub fills: u64,
    /// Bytes those fetches moved.
    pub fill_bytes: u64,
    /// Seconds those fetches took, in total.
    pub fill_seconds: f64,
    /// Reads that waited for another read's fill of the same key instead of fetching.
    pub fills_shared: u64,
    /// Filled objects that failed verification (served to the reader, who checks each
    /// slice and gets a miss; never kept).
    pub fills_corrupt: u64,
    /// Disk files found at start-up and verified.
    pub disk_recovered: u64,
    /// Disk files found at start-up torn or corrupt, and deleted.
    pub disk_dropped: u64,
    /// Publish-marker reads (GETs and HEADs) answered from the markers the tier remembers,
    /// without the remote store.
    pub marker_hits: u64,
    /// Publish markers remembered now.
    pub markers: u64,
}

/// Least-recently-used index of one level: key -> (bytes, stamp), stamp -> key.
#[derive(Debug)]
struct Lru<V> {
    entries: HashMap<String, (V, u64, u64)>,
    order: BTreeMap<u64, String>,
    bytes: u64,
    clock: u64,
}

impl<V> Default for Lru<V> {
    fn default() -> Self {
        Lru {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            bytes: 0,
            clock: 0,
        }
    }
}

impl<V: Clone> Lru<V> {
    fn get(&mut self, key: &str) -> Option<V> {
        let (v, _, stamp) = self.entries.get_mut(key)?;
        self.order.remove(stamp);
        self.clock += 1;
        *stamp = self.clock;
        self.order.insert(self.clock, key.to_string());
        Some(v.clone())
    }

    /// Inserts, evicting least recently used entries until `size` fits in `cap`; returns the
    /// evicted keys (with their values), or `None` when `size` alone exceeds `cap`.
    fn insert(&mut self, key: &str, v: V, size: u64, cap: u64) -> Option<Vec<(String, V)>> {
        if size > cap {
            return None;
        }
        let mut out = Vec::new();
        if let Some(old) = self.remove(key) {
            out.push((key.to_string(), old));
        }
        while self.bytes + size > cap {
            let Some((_, k)) = self.order.pop_first() else {
                break;
            };
            if let Some((v, s, _)) = self.entries.remove(&k) {
                self.bytes -= s;
                out.push((k, v));
            }
        }
        self.clock += 1;
        self.entries.insert(key.to_string(), (v, size, self.clock));
        self.order.insert(self.clock, key.to_string());
        self.bytes += size;
        Some(out)
    }

    fn remove(&mut self, key: &str) -> Option<V> {
        let (v, size, stamp) = self.entries.remove(key)?;
        self.order.remove(&stamp);
        self.bytes -= size;
        Some(v)
    }
}

/// The fill of one key in flight, shared by every read that misses it meanwhile.
type Fill = Arc<tokio::sync::OnceCell<StoreResult<Bytes>>>;

/// A node-level cache of chunk objects over a remote store (see the module documentation).
pub struct TieredStore {
    remote: Arc<dyn Store>,
    cfg: TierConfig,
    dram: Mutex<Lru<Bytes>>,
    disk: Mutex<Lru<PathBuf>>,
    fills: Mutex<HashMap<String, Fill>>,
    seen: Mutex<HashMap<String, Instant>>,
    /// Publish markers seen present: body and when it was seen.
    markers: Mutex<Lru<(Bytes, Instant)>>,
    marker_hits: AtomicU64,
    dram_c: LevelCounters,
    disk_c: LevelCounters,
    fill_count: AtomicU64,
    fill_bytes: AtomicU64,
    fill_micros: AtomicU64,
    fills_shared: AtomicU64,
    fills_corrupt: AtomicU64,
    disk_recovered: AtomicU64,
    disk_dropped: AtomicU64,
    tmp_seq: AtomicU64,
}

impl std::fmt::Debug for TieredStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredStore")
            .field("remote", &self.remote)
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// Bytes of publish markers (keys and bodies, and 64 bytes each besides) a tier remembers at
/// most: about 100,000 markers.
pub const MARKER_BYTES: u64 = 16 << 20;

/// How long a tier serves a publish marker it remembers without asking the remote store
/// again: a marker deleted behind the server (`objectcache gc` run against the remote store
/// from elsewhere) is seen as gone after this at the latest, and a load of its chunk that
/// the tier does not hold meanwhile misses, as a deleted chunk does.
pub const MARKER_TTL: Duration = Duration::from_secs(300);

/// Whether `key` is a publish marker (`.../pub/HASH`), which the tier remembers when present.
pub fn marker_key(key: &str) -> bool {
    key.split('/').rev().nth(1) == Some("pub")
}

/// Whether `key` is a chunk data object (format version 1), the only kind the tier keeps.
pub fn tiered_key(key: &str) -> bool {
    key.split('/').rev().nth(1) == Some("kv")
}

/// Verifies a whole chunk object: its header, its length and every layer's CRC32C.
fn verify_chunk(obj: &[u8]) -> Result<(), String> {
    let h = ChunkHeader::decode(obj).map_err(|e| e.to_string())?;
    if obj.len() as u64 != h.object_len() {
        return Err(format!(
            "{} bytes, the header says {}",
            obj.len(),
            h.object_len()
        ));
    }
    for l in 0..h.layers {
        let r = slice_range(l, h.slice_len);
        verify_slice(
            l as usize,
            &obj[r.start as usize..r.end as usize],
            h.slice_len,
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

impl TieredStore {
    /// A tier over `remote`. With a disk level, finds the files a previous run left in
    /// `disk_dir`, verifies each (header, length, every CRC32C: a read of the whole level),
    /// deletes the torn or corrupt ones and any leftover temporary file, and indexes the
    /// others by their modification time (oldest first out); files beyond `disk_bytes` are
    /// evicted.
    ///
    /// # Errors
    /// The disk directory cannot be created or read.
    pub fn new(remote: Arc<dyn Store>, cfg: TierConfig) -> StoreResult<Self> {
        let t = TieredStore {
            remote,
            cfg,
            dram: Mutex::new(Lru::default()),
            disk: Mutex::new(Lru::default()),
            fills: Mutex::new(HashMap::new()),
            seen: Mutex::new(HashMap::new()),
            markers: Mutex::new(Lru::default()),
            marker_hits: AtomicU64::new(0),
            dram_c: LevelCounters::default(),
            disk_c: LevelCounters::default(),
            fill_count: AtomicU64::new(0),
            fill_bytes: AtomicU64::new(0),
            fill_micros: AtomicU64::new(0),
            fills_shared: AtomicU64::new(0),
            fills_corrupt: AtomicU64::new(0),
            disk_recovered: AtomicU64::new(0),
            disk_dropped: AtomicU64::new(0),
            tmp_seq: AtomicU64::new(0),
        };
        if let Some(dir) = t.cfg.disk_dir.clone() {
            std::fs::create_dir_all(&dir).map_err(|e| StoreError::other("tier", e))?;
            t.recover(&dir)?;
        }
        Ok(t)
    }

    /// The counters now.
    pub fn stats(&self) -> TierStats {
        let level = |c: &LevelCounters, bytes: u64, objects: usize, capacity: u64| LevelStats {
            bytes,
            objects: objects as u64,
            capacity,
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            bytes_served: c.bytes_served.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            admitted: c.admitted.load(Ordering::Relaxed),
        };
        let (db, dn) = {
            let d = self.dram.lock().expect("lock");
            (d.bytes, d.entries.len())
        };
        let (kb, kn) = {
            let d = self.disk.lock().expect("lock");
            (d.bytes, d.entries.len())
        };
        TierStats {
            dram: level(&self.dram_c, db, dn, self.cfg.dram_bytes),
            disk: level(
                &self.disk_c,
                kb,
                kn,
                if self.cfg.disk_dir.is_some() {
                    self.cfg.disk_bytes
                } else {
                    0
                },
            ),
            fills: self.fill_count.load(Ordering::Relaxed),
            fill_bytes: self.fill_bytes.load(Ordering::Relaxed),
            fill_seconds: self.fill_micros.load(Ordering::Relaxed) as f64 / 1e6,
            fills_shared: self.fills_shared.load(Ordering::Relaxed),
            fills_corrupt: self.fills_corrupt.load(Ordering::Relaxed),
            disk_recovered: self.disk_recovered.load(Ordering::Relaxed),
            disk_dropped: self.disk_dropped.load(Ordering::Relaxed),
            marker_hits: self.marker_hits.load(Ordering::Relaxed),
            markers: self.markers.lock().expect("lock").entries.len() as u64,
        }
    }

    /// A remembered marker's body, if seen within [`MARKER_TTL`] (counted as a marker hit).
    fn marker(&self, key: &str) -> Option<Bytes> {
        let mut m = self.markers.lock().expect("lock");
        let (b, seen) = m.get(key)?;
        if seen.elapsed() >= MARKER_TTL {
            m.remove(key);
            return None;
        }
        self.marker_hits.fetch_add(1, Ordering::Relaxed);
        Some(b)
    }

    fn remember_marker(&self, key: &str, body: &Bytes) {
        let size = (key.len() + body.len() + 64) as u64;
        self.markers.lock().expect("lock").insert(
            key,
            (body.clone(), Instant::now()),
            size,
            MARKER_BYTES,
        );
    }

    /// The level that holds `key` now (DRAM first), or `None`; asking does not count as a
    /// read (no hit, no change in recency).
    pub fn level_of(&self, key: &str) -> Option<TierLevel> {
        if self.dram.lock().expect("lock").entries.contains_key(key) {
            return Some(TierLevel::Dram);
        }
        if self.disk.lock().expect("lock").entries.contains_key(key) {
            return Some(TierLevel::Disk);
        }
        None
    }

    fn disk_path(&self, key: &str) -> Option<PathBuf> {
        self.cfg.disk_dir.as_ref().map(|d| d.join(key))
    }

    fn recover(&self, dir: &Path) -> StoreResult<()> {
        let mut found: Vec<(std::time::SystemTime, String, PathBuf, u64)> = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            let rd = std::fs::read_dir(&d).map_err(|e| StoreError::other("tier", e))?;
            for e in rd.flatten() {
                let p = e.path();
                let Ok(meta) = e.metadata() else { continue };
                if meta.is_dir() {
                    stack.push(p);
                    continue;
                }
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                let key = p
                    .strip_prefix(dir)
                    .ok()
                    .and_then(|k| k.to_str())
                    .unwrap_or("")
                    .to_string();
                let good = !name.starts_with(".tier-tmp-")
                    && validate_key(&key).is_ok()
                    && tiered_key(&key)
                    && std::fs::read(&p).is_ok_and(|b| verify_chunk(&b).is_ok());
                if good {
                    let t = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                    found.push((t, key, p, meta.len()));
                } else {
                    let _ = std::fs::remove_file(&p);
                    if !name.starts_with(".tier-tmp-") {
                        self.disk_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        found.sort();
        let mut disk = self.disk.lock().expect("lock");
        for (_, key, p, size) in found {
            self.disk_recovered.fetch_add(1, Ordering::Relaxed);
            match disk.insert(&key, p.clone(), size, self.cfg.disk_bytes) {
                Some(evicted) => {
                    for (_, old) in evicted {
                        let _ = std::fs::remove_file(old);
                    }
                }
                None => {
                    let _ = std::fs::remove_file(p);
                }
            }
        }
        Ok(())
    }

    /// Whether the admission policy lets `key` in now (and remembers this request).
    fn admit(&self, key: &str) -> bool {
        match self.cfg.admission {
            Admission::All => true,
            Admission::Second { window } => {
                let now = Instant::now();
                let mut seen = self.seen.lock().expect("lock");
                if seen.len() > 1 << 20 {
                    seen.retain(|_, t| now.duration_since(*t) < window);
                }
                match seen.insert(key.to_string(), now) {
                    Some(t) if now.duration_since(t) < window => {
                        seen.remove(key);
                        true
                    }
                    _ => false,
                }
            }
        }
    }

    fn put_dram(&self, key: &str, data: &Bytes) {
        if self.cfg.dram_bytes == 0 {
            return;
        }
        let r = self.dram.lock().expect("lock").insert(
            key,
            data.clone(),
            data.len() as u64,
            self.cfg.dram_bytes,
        );
        match r {
            Some(evicted) => {
                self.dram_c.admitted.fetch_add(1, Ordering::Relaxed);
                let n = evicted.iter().filter(|(k, _)| k != key).count() as u64;
                self.dram_c.evictions.fetch_add(n, Ordering::Relaxed);
            }
            None => {
                self.dram_c.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Writes a verified object into the disk level (a temporary file, then a rename: a
    /// crash leaves a temporary file, deleted at the next start, never a torn object).
    async fn put_disk(&self, key: &str, data: Bytes) {
        let Some(path) = self.disk_path(key) else {
            return;
        };
        if data.len() as u64 > self.cfg.disk_bytes {
            self.disk_c.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let dir = path.parent().map(Path::to_path_buf);
        let tmp = path.with_file_name(format!(
            ".tier-tmp-{}-{}",
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let written = tokio::task::spawn_blocking({
            let (tmp, path) = (tmp.clone(), path.clone());
            move || -> std::io::Result<()> {
                if let Some(d) = dir {
                    std::fs::create_dir_all(d)?;
                }
                std::fs::write(&tmp, &data)?;
                std::fs::rename(&tmp, &path)
            }
        })
        .await;
        if !matches!(written, Ok(Ok(()))) {
            let _ = std::fs::remove_file(&tmp);
            return;
        }
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let r = self
            .disk
            .lock()
            .expect("lock")
            .insert(key, path, size, self.cfg.disk_bytes);
        if let Some(evicted) = r {
            self.disk_c.admitted.fetch_add(1, Ordering::Relaxed);
            for (k, old) in evicted {
                if k != key {
                    self.disk_c.evictions.fetch_add(1, Ordering::Relaxed);
                    // A reader that opened it keeps its bytes (the open file).
                    let _ = std::fs::remove_file(old);
                }
            }
        }
    }

    /// Puts a verified object into every level (admission already decided).
    async fn keep(&self, key: &str, data: &Bytes) {
        self.put_dram(key, data);
        self.put_disk(key, data.clone()).await;
    }

    /// The whole object and the level's counters that served it (`None`: a fill from the
    /// remote store): DRAM, else disk (moving it up to DRAM), else one fill shared by every
    /// concurrent miss of the key.
    async fn object(&self, key: &str) -> StoreResult<(Bytes, Option<&LevelCounters>)> {
        if let Some(b) = self.dram.lock().expect("lock").get(key) {
            self.dram_c.hits.fetch_add(1, Ordering::Relaxed);
            return Ok((b, Some(&self.dram_c)));
        }
        if self.cfg.dram_bytes > 0 {
            self.dram_c.misses.fetch_add(1, Ordering::Relaxed);
        }
        let on_disk = self.disk.lock().expect("lock").get(key);
        if let Some(path) = on_disk {
            let read = tokio::task::spawn_blocking(move || std::fs::read(path)).await;
            if let Ok(Ok(v)) = read {
                self.disk_c.hits.fetch_add(1, Ordering::Relaxed);
                let b = Bytes::from(v);
                self.put_dram(key, &b);
                return Ok((b, Some(&self.disk_c)));
            }
            // Gone from under us (evicted meanwhile): a miss.
            self.disk.lock().expect("lock").remove(key);
        }
        if self.cfg.disk_dir.is_some() {
            self.disk_c.misses.fetch_add(1, Ordering::Relaxed);
        }
        let (cell, leader) = {
            let mut fills = self.fills.lock().expect("lock");
            match fills.get(key) {
                Some(c) => (c.clone(), false),
                None => {
                    let c: Fill = Arc::new(tokio::sync::OnceCell::new());
                    fills.insert(key.to_string(), c.clone());
                    (c, true)
                }
            }
        };
        if !leader {
            self.fills_shared.fetch_add(1, Ordering::Relaxed);
        }
        let r = cell
            .get_or_init(|| async {
                let t0 = Instant::now();
                let r = self.remote.get_bytes(key).await;
                self.fill_count.fetch_add(1, Ordering::Relaxed);
                self.fill_micros
                    .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                if let Ok(b) = &r {
                    self.fill_bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
                    if verify_chunk(b).is_err() {
                        self.fills_corrupt.fetch_add(1, Ordering::Relaxed);
                    } else if self.admit(key) {
                        self.keep(key, b).await;
                    } else {
                        self.dram_c.refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
                r
            })
            .await
            .clone();
        if leader {
            self.fills.lock().expect("lock").remove(key);
        }
        Ok((r?, None))
    }

    /// A disk hit served by reading only `range` from the file; `Ok(None)` when the disk
    /// level does not hold the key (or lost it meanwhile).
    async fn disk_range(
        &self,
        key: &str,
        range: Option<std::ops::Range<u64>>,
    ) -> StoreResult<Option<GetResult>> {
        let Some(path) = self.disk.lock().expect("lock").get(key) else {
            return Ok(None);
        };
        let k = key.to_string();
        let read = tokio::task::spawn_blocking(
            move || -> StoreResult<Option<(u64, std::ops::Range<u64>, Vec<u8>)>> {
                use std::os::unix::fs::FileExt;
                let Ok(f) = std::fs::File::open(&path) else {
                    return Ok(None);
                };
                let size = f
                    .metadata()
                    .map_err(|e| StoreError::other("tier", e))?
                    .len();
                let r = resolve_range(&k, range, size)?;
                let mut buf = vec![0u8; (r.end - r.start) as usize];
                f.read_exact_at(&mut buf, r.start)
                    .map_err(|e| StoreError::other("tier", e))?;
                Ok(Some((size, r, buf)))
            },
        )
        .await
        .map_err(|e| StoreError::other("tier", e))??;
        let Some((size, range, buf)) = read else {
            self.disk.lock().expect("lock").remove(key);
            return Ok(None);
        };
        self.disk_c.hits.fetch_add(1, Ordering::Relaxed);
        self.disk_c
            .bytes_served
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        let part = Bytes::from(buf);
        Ok(Some(GetResult {
            meta: ObjectMeta {
                key: key.into(),
                size,
                last_modified: None,
                etag: None,
            },
            range,
            body: Box::pin(futures::stream::once(async move { Ok(part) })),
        }))
    }

    fn drop_key(&self, key: &str) {
        self.dram.lock().expect("lock").remove(key);
        if let Some(p) = self.disk.lock().expect("lock").remove(key) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The metadata of an object the tier holds in memory as `data` (no time or entity tag).
fn held_meta(key: &str, data: &Bytes) -> ObjectMeta {
    ObjectMeta {
        key: key.into(),
        size: data.len() as u64,
        last_modified: None,
        etag: None,
    }
}

#[async_trait]
impl Store for TieredStore {
    fn name(&self) -> &'static str {
        "tier"
    }

    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
        if marker_key(key) {
            validate_key(key)?;
            let data = match self.marker(key) {
                Some(b) => b,
                None => {
                    let b = self.remote.get_bytes(key).await?;
                    self.remember_marker(key, &b);
                    b
                }
            };
            return GetResult::in_memory(held_meta(key, &data), &data, opts.range);
        }
        if !tiered_key(key) {
            return self.remote.get_opts(key, opts).await;
        }
        validate_key(key)?;
        if self.cfg.dram_bytes == 0 {
            // No DRAM level to move a disk hit up to: read just the range from the file.
            if let Some(r) = self.disk_range(key, opts.range.clone()).await? {
                return Ok(r);
            }
        }
        let (data, level) = self.object(key).await?;
        let r = GetResult::in_memory(held_meta(key, &data), &data, opts.range)?;
        if let Some(c) = level {
            c.bytes_served
                .fetch_add(r.range.end - r.range.start, Ordering::Relaxed);
        }
        Ok(r)
    }

    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult> {
        // Durable remotely first: the tier never acknowledges what the remote store lacks.
        let mode = opts.mode;
        let r = self.remote.put_opts(key, data.clone(), opts).await?;
        if marker_key(key) {
            self.remember_marker(key, &data);
        }
        if tiered_key(key) {
            if mode == PutMode::Overwrite {
                self.drop_key(key);
            }
            if verify_chunk(&data).is_ok() && self.cfg.admission == Admission::All {
                self.keep(key, &data).await;
            }
        }
        Ok(r)
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        if marker_key(key) {
            if let Some(b) = self.marker(key) {
                return Ok(ObjectMeta {
                    key: key.into(),
                    size: b.len() as u64,
                    last_modified: None,
                    etag: None,
                });
            }
        }
        if tiered_key(key) {
            if let Some(b) = self.dram.lock().expect("lock").get(key) {
                return Ok(ObjectMeta {
                    key: key.into(),
                    size: b.len() as u64,
                    last_modified: None,
                    etag: None,
                });
            }
        }
        self.remote.head(key).await
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        // Forgotten before and after: a read racing the delete asks the remote store.
        self.markers.lock().expect("lock").remove(key);
        self.remote.delete(key).await?;
        self.markers.lock().expect("lock").remove(key);
        if tiered_key(key) {
            self.drop_key(key);
        }
        Ok(())
    }

    async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>> {
        self.remote.list(prefix, limit).await
    }

    async fn list_partial(&self, prefix: &str) -> StoreResult<Vec<PartialWrite>> {
        self.remote.list_partial(prefix).await
    }

    async fn delete_partial(&self, partial: &PartialWrite) -> StoreResult<()> {
        self.remote.delete_partial(partial).await
    }
}
