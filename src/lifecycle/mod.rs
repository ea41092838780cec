//! Lifecycle of stored KV: inventory, capacity limit with LRU eviction, TTLs, garbage
//! collection of unreferenced objects, and leases that keep an object alive under its reader.
//!
//! ## What an entry is
//! A published chunk is a pair of objects (see [`crate::layout::KeyBuilder`]):
//! `…/kv/{hash}` (the data object) and `…/pub/{hash}` (its publish marker, written after the
//! data is durable). Lookup reads only markers, so deleting an entry deletes the **marker
//! first**, then the data: a reader never finds a marker whose data is already gone (except a
//! reader that passed lookup earlier, which leases protect).
//!
//! ## Rules of [`collect`] (in this order)
//! 0. **Incomplete writes** ([`Store::list_partial`]: temporary files a killed writer left)
//!    are deleted when their writer is known to be gone, or once older than `grace` (a write
//!    in progress keeps its file's modification time fresh).
//! 1. **Unreferenced data** (a data object with no marker: a save interrupted between its two
//!    phases, or a crashed writer) is deleted once older than `grace`, the longest a save may
//!    take between writing a data object and its marker.
//! 2. **Orphan markers** (a marker whose data object is missing) are deleted at once: they
//!    would make lookup report a chunk that cannot load.
//!
//! A listing is not a snapshot (a save may write a data object, then its marker, while the
//! listing walks past): before deleting half an entry (rules 1 and 2), collection checks again
//! that the other half is still absent.
//! 3. **TTL**: a published entry not used for `ttl` (last use = the latest of its last access
//!    seen by an [`AccessLog`] and its write time) is deleted, unless pinned or leased.
//! 4. **Capacity**: while the bytes held exceed `capacity_bytes`, the least recently used
//!    published entry that is neither pinned nor leased is deleted.
//!
//! A chunk's tensor-parallel ranks (keys equal but for their `tp{rank}-{world}` component)
//! are one unit for rules 3 and 4: kept, expired and evicted together (leased or pinned if
//! any rank is). A chunk published for some ranks only (another rank's entry missing: a
//! failed save, a lost object) is deleted for every rank once its newest object is older than
//! `grace` (reason `IncompleteTp`), so ranks never disagree about a chunk. Lookups check
//! every rank's marker (`Engine::lookup`), so ranks agree on every hit meanwhile.
//!
//! Objects whose keys are not data objects or markers are never touched.
//!
//! ## Leases, and the trade-off
//! Lookups never pin: a lookup's probes (marker `HEAD`s) take no lease and do not count as
//! use, so entries that were probed but not loaded can be evicted (case C13). What is held at
//! any moment is what loads in flight read: `Engine::load` and the server's gather loads hold
//! explicit leases on their chunks' entries from start to end (released on completion,
//! cancel, failure, and with the process); ranged GETs through the server's S3 API renew soft
//! leases.
//!
//! A load reads one object with several ranged GETs spread over its duration (layer by
//! layer), so deleting the object between two of them turns the rest of the load into a miss.
//! A [`LeaseTable`] keeps keys alive while held:
//! - explicit leases ([`LeaseTable::acquire`]), released when the guard drops;
//! - soft leases: a [`TrackedStore`] renews a key's lease for `soft_lease` on every read, so
//!   an object read within the last `soft_lease` (set it to the load deadline) is kept.
//!
//! The table lives **in the process** that collects (the embedded store, or the server that
//! fronts a store): no extra request per load and no stale lease left behind by a crashed
//! reader, but a reader in *another* process is not seen. For a store shared by several
//! processes, run collection where the reads happen (the server), or rely on `grace`/`ttl`
//! being far longer than a load; the alternative, lease objects in the store, costs one PUT and
//! one DELETE per load and leaves stale leases behind crashed readers until they expire. A
//! reader that loses the race still gets a per-chunk miss, never wrong bytes (every slice is
//! checked by its CRC32C).
//!
//! ## Access times
//! Object stores do not record reads (S3 has no access time), so LRU needs an [`AccessLog`]
//! fed by a [`TrackedStore`] in the reading process; without one, last use is the write time
//! (first-in, first-out by age), which is what `objectcache gc` run from a shell gets.

use crate::error::StoreError;
use crate::store::{
    ByteStream, EndpointEvent, GatherTarget, GetOptions, GetResult, LocalObject, ObjectMeta,
    PartialWrite, PutOptions, PutResult, Store, StoreExt,
};
use async_trait::async_trait;
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Kind of object a key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectKind {
    /// A chunk data object (`…/kv/{hash}`).
    Data,
    /// A publish marker (`…/pub/{hash}`).
    Marker,
    /// Anything else (never touched by collection).
    Other,
}

/// Splits a key into its kind and its entry id (the key with `kv`/`pub` replaced by `*`, the
/// same for a data object and its marker).
pub fn classify_key(key: &str) -> (ObjectKind, String) {
    let mut parts = key.rsplitn(3, '/');
    let (Some(hash), Some(kind), Some(dir)) = (parts.next(), parts.next(), parts.next()) else {
        return (ObjectKind::Other, key.to_string());
    };
    let k = match kind {
        "kv" => ObjectKind::Data,
        "pub" => ObjectKind::Marker,
        _ => return (ObjectKind::Other, key.to_string()),
    };
    if hash.is_empty() || !hash.bytes().all(|c| c.is_ascii_hexdigit()) {
        return (ObjectKind::Other, key.to_string());
    }
    (k, format!("{dir}/*/{hash}"))
}

/// The data-object key of an entry id from [`classify_key`].
fn data_key(id: &str) -> String {
    id.replacen("/*/", "/kv/", 1)
}
/// The marker key of an entry id from [`classify_key`].
fn marker_key(id: &str) -> String {
    id.replacen("/*/", "/pub/", 1)
}

/// One chunk entry found in a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Entry id (key with `*` in place of `kv`/`pub`).
    pub id: String,
    /// The data object, if present.
    pub data: Option<ObjectMeta>,
    /// The marker, if present.
    pub marker: Option<ObjectMeta>,
}

impl Entry {
    /// Bytes held by this entry (data plus marker).
    pub fn bytes(&self) -> u64 {
        self.data.as_ref().map_or(0, |m| m.size) + self.marker.as_ref().map_or(0, |m| m.size)
    }
    /// Published: marker and data both present.
    pub fn published(&self) -> bool {
        self.data.is_some() && self.marker.is_some()
    }
    /// Latest write time of its objects.
    pub fn written(&self) -> Option<SystemTime> {
        [&self.data, &self.marker]
            .into_iter()
            .flatten()
            .filter_map(|m| m.last_modified)
            .max()
    }
    /// The key group (namespace, format, geometry, TP rank, hash algorithm): the id up to
    /// `/*/`.
    pub fn group(&self) -> &str {
        self.id.split("/*/").next().unwrap_or("")
    }
}

/// What a store holds, by entry.
#[derive(Debug, Clone, Default)]
pub struct Inventory {
    /// Chunk entries by id.
    pub entries: BTreeMap<String, Entry>,
    /// Objects that are neither data objects nor markers.
    pub other: Vec<ObjectMeta>,
    /// Incomplete writes the store holds besides its objects ([`Store::list_partial`]).
    pub partial: Vec<PartialWrite>,
}

/// Counters of an inventory (what `objectcache stat` prints).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    /// Published chunks (marker and data).
    pub published: u64,
    /// Data objects without a marker.
    pub unreferenced_data: u64,
    /// Markers without a data object.
    pub orphan_markers: u64,
    /// Other objects.
    pub other_objects: u64,
    /// Incomplete writes (temporary files of interrupted or ongoing writes).
    pub partial_writes: u64,
    /// Bytes of incomplete writes.
    pub partial_bytes: u64,
    /// Bytes of every object and incomplete write.
    pub bytes: u64,
    /// Bytes of published entries.
    pub published_bytes: u64,
}

impl Inventory {
    /// Lists everything under `prefix` (at most `limit` objects) and groups it by entry.
    ///
    /// # Errors
    /// The store's listing error.
    pub async fn scan(store: &dyn Store, prefix: &str, limit: usize) -> Result<Self, StoreError> {
        let mut inv = Inventory {
            partial: store.list_partial(prefix).await?,
            ..Inventory::default()
        };
        for m in store.list(prefix, limit).await? {
            let (kind, id) = classify_key(&m.key);
            match kind {
                ObjectKind::Other => inv.other.push(m),
                _ => {
                    let e = inv.entries.entry(id.clone()).or_insert(Entry {
                        id,
                        data: None,
                        marker: None,
                    });
                    if kind == ObjectKind::Data {
                        e.data = Some(m);
                    } else {
                        e.marker = Some(m);
                    }
                }
            }
        }
        Ok(inv)
    }

    /// Counters over the whole inventory.
    pub fn stats(&self) -> Stats {
        let mut s = Stats::default();
        for e in self.entries.values() {
            s.bytes += e.bytes();
            match (&e.data, &e.marker) {
                (Some(_), Some(_)) => {
                    s.published += 1;
                    s.published_bytes += e.bytes();
                }
                (Some(_), None) => s.unreferenced_data += 1,
                (None, Some(_)) => s.orphan_markers += 1,
                (None, None) => {}
            }
        }
        s.other_objects = self.other.len() as u64;
        s.bytes += self.other.iter().map(|m| m.size).sum::<u64>();
        s.partial_writes = self.partial.len() as u64;
        s.partial_bytes = self.partial.iter().map(|p| p.size).sum();
        s.bytes += s.partial_bytes;
        s
    }

    /// Counters per key group (namespace, geometry, TP rank, algorithm).
    pub fn stats_by_group(&self) -> BTreeMap<String, Stats> {
        let mut by: BTreeMap<String, Inventory> = BTreeMap::new();
        for e in self.entries.values() {
            by.entry(e.group().to_string())
                .or_default()
                .entries
                .insert(e.id.clone(), e.clone());
        }
        by.into_iter().map(|(k, v)| (k, v.stats())).collect()
    }
}

/// Last access time per entry, fed by a [`TrackedStore`].
#[derive(Debug, Default)]
pub struct AccessLog {
    last: Mutex<HashMap<String, SystemTime>>,
}

impl AccessLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }
    /// Records a use of the entry that `key` belongs to, at `t`.
    pub fn record(&self, key: &str, t: SystemTime) {
        let (kind, id) = classify_key(key);
        if kind == ObjectKind::Other {
            return;
        }
        let mut m = self.last.lock().expect("lock");
        let v = m.entry(id).or_insert(t);
        if *v < t {
            *v = t;
        }
    }
    /// Last recorded use of an entry id.
    pub fn last_use(&self, id: &str) -> Option<SystemTime> {
        self.last.lock().expect("lock").get(id).copied()
    }
    fn forget(&self, id: &str) {
        self.last.lock().expect("lock").remove(id);
    }
}

/// In-process leases on keys: a leased key is never deleted by [`collect`].
#[derive(Debug, Default)]
pub struct LeaseTable {
    /// key -> (explicit holders, soft lease end)
    leases: Mutex<HashMap<String, (u32, Option<Instant>)>>,
}

/// An explicit lease on some keys; dropping it releases them.
#[derive(Debug)]
pub struct Lease {
    table: Arc<LeaseTable>,
    keys: Vec<String>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut m = self.table.leases.lock().expect("lock");
        for k in &self.keys {
            if let Some(v) = m.get_mut(k) {
                v.0 = v.0.saturating_sub(1);
                if v.0 == 0 && v.1.is_none_or(|t| t <= Instant::now()) {
                    m.remove(k);
                }
            }
        }
    }
}

impl LeaseTable {
    /// An empty table.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    /// Leases `keys` (data objects or markers: the whole entry is kept) until the guard drops.
    pub fn acquire(self: &Arc<Self>, keys: impl IntoIterator<Item = String>) -> Lease {
        let keys: Vec<String> = keys.into_iter().map(|k| classify_key(&k).1).collect();
        let mut m = self.leases.lock().expect("lock");
        for k in &keys {
            m.entry(k.clone()).or_insert((0, None)).0 += 1;
        }
        Lease {
            table: self.clone(),
            keys,
        }
    }
    /// Extends `key`'s entry's soft lease to at least `now + d`.
    pub fn touch(&self, key: &str, d: Duration) {
        let id = classify_key(key).1;
        let until = Instant::now() + d;
        let mut m = self.leases.lock().expect("lock");
        let v = m.entry(id).or_insert((0, None));
        if v.1.is_none_or(|t| t < until) {
            v.1 = Some(until);
        }
    }
    /// Whether an entry id (or key) is leased now.
    pub fn is_leased(&self, key_or_id: &str) -> bool {
        let id = classify_key(key_or_id).1;
        let mut m = self.leases.lock().expect("lock");
        let now = Instant::now();
        match m.get(&id) {
            Some((n, soft)) if *n > 0 || soft.is_some_and(|t| t > now) => true,
            Some(_) => {
                m.remove(&id);
                false
            }
            None => false,
        }
    }
}

/// A store wrapper that records reads in an [`AccessLog`] and renews soft leases in a
/// [`LeaseTable`] on every read of an object's bytes (not on a lookup's `HEAD`: probes never
/// pin); everything else passes through.
#[derive(Debug)]
pub struct TrackedStore {
    inner: Arc<dyn Store>,
    access: Arc<AccessLog>,
    leases: Arc<LeaseTable>,
    soft_lease: Duration,
}

impl TrackedStore {
    /// Wraps `inner`; every get of a data object or marker records an access and renews its
    /// entry's lease for `soft_lease` (use the load deadline, e.g. 30 s).
    pub fn new(
        inner: Arc<dyn Store>,
        access: Arc<AccessLog>,
        leases: Arc<LeaseTable>,
        soft_lease: Duration,
    ) -> Self {
        TrackedStore {
            inner,
            access,
            leases,
            soft_lease,
        }
    }
    fn note(&self, key: &str) {
        self.access.record(key, SystemTime::now());
        self.leases.touch(key, self.soft_lease);
    }
}

#[async_trait]
impl Store for TrackedStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    // The data paths of the wrapped store pass through: without these, a wrapped `fs` store
    // loses sendfile and a wrapped S3 store loses gather (the trait's defaults say "none").
    fn gather_target(&self) -> Option<GatherTarget> {
        self.inner.gather_target()
    }
    fn gather_route(&self, route: u64) -> Vec<GatherTarget> {
        self.inner.gather_route(route)
    }
    fn endpoint_event(&self, addr: &str, event: EndpointEvent) {
        self.inner.endpoint_event(addr, event)
    }
    async fn open_local(&self, key: &str) -> Result<Option<LocalObject>, StoreError> {
        let r = self.inner.open_local(key).await;
        if matches!(r, Ok(Some(_))) {
            self.note(key);
        }
        r
    }
    fn open_local_blocking(&self, key: &str) -> Result<Option<LocalObject>, StoreError> {
        let r = self.inner.open_local_blocking(key);
        if matches!(r, Ok(Some(_))) {
            self.note(key);
        }
        r
    }
    async fn get_opts(&self, key: &str, opts: GetOptions) -> Result<GetResult, StoreError> {
        self.note(key);
        self.inner.get_opts(key, opts).await
    }
    async fn put_opts(
        &self,
        key: &str,
        data: Bytes,
        opts: PutOptions,
    ) -> Result<PutResult, StoreError> {
        let r = self.inner.put_opts(key, data, opts).await;
        if r.is_ok() {
            self.access.record(key, SystemTime::now());
        }
        r
    }
    /// A lookup's probe: passed through, neither an access nor a lease. Lookups never pin:
    /// what a probe found may be evicted until a load reads it (a lookup that loaded nothing
    /// must not keep entries from eviction, case C13).
    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        self.inner.head(key).await
    }
    async fn put_stream(
        &self,
        key: &str,
        body: ByteStream,
        len: Option<u64>,
        opts: PutOptions,
    ) -> Result<PutResult, StoreError> {
        let r = self.inner.put_stream(key, body, len, opts).await;
        if r.is_ok() {
            self.access.record(key, SystemTime::now());
        }
        r
    }
    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<ObjectMeta>, StoreError> {
        self.inner.list(prefix, limit).await
    }
    async fn warm(&self, connections: usize) -> usize {
        self.inner.warm(connections).await
    }
    async fn list_partial(&self, prefix: &str) -> Result<Vec<PartialWrite>, StoreError> {
        self.inner.list_partial(prefix).await
    }
    async fn delete_partial(&self, partial: &PartialWrite) -> Result<(), StoreError> {
        self.inner.delete_partial(partial).await
    }
}

/// Settings of [`collect`].
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Only keys under this prefix are considered (empty: all).
    pub prefix: String,
    /// Most objects listed (a bound on memory; collection stops with an error above it).
    pub max_objects: usize,
    /// Unreferenced data younger than this is kept (a save in progress). Default 1 hour.
    pub grace: Duration,
    /// Published entries unused for this long are deleted. Default none.
    pub ttl: Option<Duration>,
    /// Bytes the collected prefix may hold; LRU entries are evicted above it. Default none.
    pub capacity_bytes: Option<u64>,
    /// Key prefixes exempt from TTL and capacity eviction.
    pub pinned: Vec<String>,
    /// Report what would be deleted, delete nothing.
    pub dry_run: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            prefix: String::new(),
            max_objects: 10_000_000,
            grace: Duration::from_secs(3600),
            ttl: None,
            capacity_bytes: None,
            pinned: Vec::new(),
            dry_run: false,
        }
    }
}

/// Why an object was deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Reason {
    /// Data object without a marker, older than the grace period.
    Unreferenced,
    /// Marker without a data object.
    OrphanMarker,
    /// Unused for longer than the TTL.
    Expired,
    /// Evicted to get under the capacity limit.
    Evicted,
    /// An incomplete write (a temporary file) whose writer is gone or that is older than
    /// the grace period.
    PartialWrite,
    /// A tensor-parallel chunk published for some ranks only (another rank's entry missing),
    /// older than the grace period: every rank's entry goes, so ranks never disagree on it.
    IncompleteTp,
}

/// Outcome of [`collect`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GcReport {
    /// Objects listed.
    pub scanned: u64,
    /// Bytes held before.
    pub bytes_before: u64,
    /// Bytes held after (as planned, in a dry run).
    pub bytes_after: u64,
    /// Deleted (or, in a dry run, to delete) keys with the reason.
    pub deleted: Vec<(String, Reason)>,
    /// Entries kept because leased.
    pub kept_leased: u64,
    /// Entries exempt from TTL and capacity because pinned.
    pub kept_pinned: u64,
    /// Unreferenced data and incomplete writes kept because younger than the grace period.
    pub kept_young: u64,
    /// Deletes that failed (key, error); collection goes on past them.
    pub errors: Vec<(String, String)>,
}

impl GcReport {
    /// Deleted objects with this reason.
    pub fn count(&self, r: Reason) -> usize {
        self.deleted.iter().filter(|(_, x)| *x == r).count()
    }
}

/// Runs one collection pass over `store` (rules in the module documentation) at time `now`.
///
/// `access` gives last-access times (LRU); without it last use is the write time. `leases`
/// protects entries being read.
///
/// # Errors
/// The listing's error, or [`StoreError::Other`] if more than `policy.max_objects` objects are
/// listed (nothing is deleted then). A failed delete is recorded in the report, not returned.
pub async fn collect(
    store: &dyn Store,
    policy: &Policy,
    now: SystemTime,
    access: Option<&AccessLog>,
    leases: Option<&LeaseTable>,
) -> Result<GcReport, StoreError> {
    let limit = policy.max_objects.saturating_add(1);
    let inv = Inventory::scan(store, &policy.prefix, limit).await?;
    let scanned = inv
        .entries
        .values()
        .map(|e| e.data.is_some() as u64 + e.marker.is_some() as u64)
        .sum::<u64>()
        + inv.other.len() as u64;
    if scanned > policy.max_objects as u64 {
        return Err(StoreError::Other {
            backend: "gc",
            message: format!(
                "more than {} objects under {:?}: raise max_objects or collect a narrower prefix",
                policy.max_objects, policy.prefix
            ),
        });
    }
    let mut rep = GcReport {
        scanned,
        bytes_before: inv.stats().bytes,
        ..GcReport::default()
    };
    let mut held = rep.bytes_before;

    let leased = |id: &str| leases.is_some_and(|l| l.is_leased(id));
    let pinned = |id: &str| policy.pinned.iter().any(|p| id.starts_with(p.as_str()));
    let age = |t: Option<SystemTime>| {
        t.and_then(|t| now.duration_since(t).ok())
            .unwrap_or_default()
    };
    for p in &inv.partial {
        let reclaim = p.orphaned || age(p.last_modified) >= policy.grace;
        if !reclaim {
            rep.kept_young += 1;
            continue;
        }
        if !policy.dry_run {
            if let Err(e) = store.delete_partial(p).await {
                rep.errors.push((p.id.clone(), e.to_string()));
                continue;
            }
        }
        held -= p.size;
        rep.deleted.push((p.id.clone(), Reason::PartialWrite));
    }
    let mut plan: Vec<(String, u64, Reason, String)> = Vec::new(); // key, bytes, reason, id
    let mut live: Vec<&Entry> = Vec::new();
    for e in inv.entries.values() {
        match (&e.data, &e.marker) {
            (Some(d), None) => {
                if age(d.last_modified) < policy.grace {
                    rep.kept_young += 1;
                } else if leased(&e.id) {
                    rep.kept_leased += 1;
                } else {
                    plan.push((d.key.clone(), d.size, Reason::Unreferenced, e.id.clone()));
                }
            }
            (None, Some(m)) => {
                plan.push((m.key.clone(), m.size, Reason::OrphanMarker, e.id.clone()))
            }
            (Some(_), Some(_)) => live.push(e),
            (None, None) => {}
        }
    }
    let last_use = |e: &Entry| -> Option<SystemTime> {
        let a = access.and_then(|a| a.last_use(&e.id));
        match (a, e.written()) {
            (Some(a), Some(w)) => Some(a.max(w)),
            (a, w) => a.or(w),
        }
    };
    for (_, bytes, _, _) in &plan {
        held -= bytes;
    }
    // A chunk's tensor-parallel ranks are one unit: evicted, expired and kept together, and
    // a chunk published for some ranks only is removed whole once older than `grace`.
    let mut groups: BTreeMap<String, (u32, Vec<&Entry>)> = BTreeMap::new();
    for e in live {
        let (gid, world) = tp_group(&e.id);
        groups.entry(gid).or_insert((world, Vec::new())).1.push(e);
    }
    // The newest write of any object of a group (a rank still saving keeps it young).
    let mut group_written: HashMap<String, SystemTime> = HashMap::new();
    for e in inv.entries.values() {
        if let Some(w) = e.written() {
            let g = group_written.entry(tp_group(&e.id).0).or_insert(w);
            *g = (*g).max(w);
        }
    }
    let mut units: Vec<Vec<&Entry>> = Vec::new();
    for (gid, (world, es)) in groups {
        if (es.len() as u32) < world {
            let young = age(group_written.get(&gid).copied()) < policy.grace;
            if young {
                rep.kept_young += es.len() as u64;
            } else if es.iter().any(|e| leased(&e.id)) {
                rep.kept_leased += es.len() as u64;
            } else {
                for e in es {
                    held -= e.bytes();
                    push_entry(&mut plan, e, Reason::IncompleteTp);
                }
            }
            continue;
        }
        units.push(es);
    }
    let unit_use = |u: &[&Entry]| u.iter().map(|e| last_use(e)).max().flatten();
    // Oldest use first; ties broken by id for a deterministic order.
    units.sort_by(|a, b| {
        unit_use(a)
            .cmp(&unit_use(b))
            .then_with(|| a[0].id.cmp(&b[0].id))
    });
    let unit_leased = |u: &[&Entry]| u.iter().any(|e| leased(&e.id));
    let mut remaining: Vec<Vec<&Entry>> = Vec::new();
    for u in units {
        if u.iter().any(|e| pinned(&e.id)) {
            rep.kept_pinned += u.len() as u64;
            continue;
        }
        let expired = policy.ttl.is_some_and(|ttl| age(unit_use(&u)) >= ttl);
        if expired {
            if unit_leased(&u) {
                rep.kept_leased += u.len() as u64;
                continue;
            }
            for e in u {
                held -= e.bytes();
                push_entry(&mut plan, e, Reason::Expired);
            }
        } else {
            remaining.push(u);
        }
    }
    if let Some(cap) = policy.capacity_bytes {
        for u in remaining {
            if held <= cap {
                break;
            }
            if unit_leased(&u) {
                rep.kept_leased += u.len() as u64;
                continue;
            }
            for e in u {
                held -= e.bytes();
                push_entry(&mut plan, e, Reason::Evicted);
            }
        }
    }
    rep.bytes_after = held;
    for (key, _, reason, id) in plan {
        if !policy.dry_run {
            // Re-check the lease right before deleting: a reader may have arrived.
            if reason != Reason::OrphanMarker && leased(&id) {
                rep.kept_leased += 1;
                continue;
            }
            // A listing is not a snapshot: a save may have written the other half of the
            // entry since (data before its marker). Re-check before deleting a half entry.
            let other_half = match reason {
                Reason::OrphanMarker => Some(data_key(&id)),
                Reason::Unreferenced => Some(marker_key(&id)),
                _ => None,
            };
            if let Some(k) = other_half {
                match store.exists(&k).await {
                    Ok(false) => {}
                    Ok(true) => continue,
                    Err(e) => {
                        rep.errors.push((key, e.to_string()));
                        continue;
                    }
                }
            }
            if let Err(e) = store.delete(&key).await {
                rep.errors.push((key, e.to_string()));
                continue;
            }
            if let Some(a) = access {
                if reason != Reason::Unreferenced {
                    a.forget(&id);
                }
            }
        }
        rep.deleted.push((key, reason));
    }
    Ok(rep)
}

/// The tensor-parallel group of an entry id (its `tp{rank}-{world}` key component with the
/// rank replaced by `*`: the same chunk on every rank) and the group's size (1 without one).
fn tp_group(id: &str) -> (String, u32) {
    let mut world = 1;
    let parts: Vec<String> = id
        .split('/')
        .map(|p| {
            if let Some((r, w)) = p.strip_prefix("tp").and_then(|x| x.split_once('-')) {
                if let (Ok(_), Ok(w)) = (r.parse::<u32>(), w.parse::<u32>()) {
                    world = w.max(1);
                    return format!("tp*-{w}");
                }
            }
            p.to_string()
        })
        .collect();
    (parts.join("/"), world)
}

/// Marker first, then data (see the module documentation).
fn push_entry(plan: &mut Vec<(String, u64, Reason, String)>, e: &Entry, r: Reason) {
    if let Some(m) = &e.marker {
        plan.push((m.key.clone(), m.size, r, e.id.clone()));
    }
    if let Some(d) = &e.data {
        plan.push((d.key.clone(), d.size, r, e.id.clone()));
    }
}

/// `true` if the store holds both objects of the entry that `key` belongs to.
///
/// # Errors
/// A store error other than not-found.
pub async fn entry_published(store: &dyn Store, key: &str) -> Result<bool, StoreError> {
    let id = classify_key(key).1;
    Ok(store.exists(&marker_key(&id)).await? && store.exists(&data_key(&id)).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_classify_to_one_entry() {
        let d = "ns/v1/00ff/tp0-1/sha256cbor/kv/abcd";
        let m = "ns/v1/00ff/tp0-1/sha256cbor/pub/abcd";
        assert_eq!(classify_key(d).0, ObjectKind::Data);
        assert_eq!(classify_key(m).0, ObjectKind::Marker);
        assert_eq!(classify_key(d).1, classify_key(m).1);
        assert_eq!(data_key(&classify_key(m).1), d);
        assert_eq!(marker_key(&classify_key(d).1), m);
        assert_eq!(classify_key("ns/kv/zz").0, ObjectKind::Other);
        assert_eq!(classify_key("kv/ab").0, ObjectKind::Other);
        assert_eq!(classify_key("a/b/lease/ab").0, ObjectKind::Other);
    }

    #[test]
    fn explicit_and_soft_leases() {
        let t = LeaseTable::new();
        let k = "n/v1/f/tp0-1/a/kv/01";
        assert!(!t.is_leased(k));
        let g = t.acquire([k.to_string()]);
        assert!(t.is_leased("n/v1/f/tp0-1/a/pub/01"));
        drop(g);
        assert!(!t.is_leased(k));
        t.touch(k, Duration::from_secs(60));
        assert!(t.is_leased(k));
        t.touch(k, Duration::ZERO);
        assert!(t.is_leased(k), "a shorter touch never shortens a lease");
    }
}
