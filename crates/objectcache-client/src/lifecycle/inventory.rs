//! What a store holds, by entry: the kind of object a key names ([`classify_key`]), chunk
//! entries (a data object and its publish marker, [`Entry`]), segment objects (format v2),
//! the [`Inventory`] of a prefix and its [`Stats`].

use crate::error::StoreResult;
use crate::layout::SEGMENT_MARKER_LEN;
use crate::store::{ObjectMeta, PartialWrite, Store, StoreExt};
use std::collections::BTreeMap;
use std::time::SystemTime;

/// Kind of object a key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectKind {
    /// A chunk data object (`…/kv/{hash}`).
    Data,
    /// A publish marker (`…/pub/{hash}`): 16 bytes naming the chunk's data object (format
    /// v1), or 64 naming the chunk's place in a segment object (format v2).
    Marker,
    /// A segment object (`…/seg/{digest}`, format v2): the chunks of one save, layer-major.
    /// Its id is its key; it lives while any published chunk's marker names it.
    Segment,
    /// Anything else (never touched by collection).
    Other,
}

/// Splits a key into its kind and its entry id (the key with `kv`/`pub` replaced by `*`, the
/// same for a data object and its marker; a segment's id is its key).
pub fn classify_key(key: &str) -> (ObjectKind, String) {
    let mut parts = key.rsplitn(3, '/');
    let (Some(hash), Some(kind), Some(dir)) = (parts.next(), parts.next(), parts.next()) else {
        return (ObjectKind::Other, key.to_string());
    };
    let k = match kind {
        "kv" => ObjectKind::Data,
        "pub" => ObjectKind::Marker,
        "seg" => ObjectKind::Segment,
        _ => return (ObjectKind::Other, key.to_string()),
    };
    if hash.is_empty() || !hash.bytes().all(|c| c.is_ascii_hexdigit()) {
        return (ObjectKind::Other, key.to_string());
    }
    if k == ObjectKind::Segment {
        return (k, key.to_string());
    }
    (k, format!("{dir}/*/{hash}"))
}

/// The data-object key of an entry id from [`classify_key`].
pub(super) fn data_key(id: &str) -> String {
    id.replacen("/*/", "/kv/", 1)
}
/// The marker key of an entry id from [`classify_key`].
pub(super) fn marker_key(id: &str) -> String {
    id.replacen("/*/", "/pub/", 1)
}
/// The key of the segment with hex digest `digest` in the key group of entry id `id` (what
/// `KeyBuilder::segment` gives for the entry's namespace, geometry and rank).
pub(super) fn segment_key(id: &str, digest: &str) -> String {
    format!("{}/seg/{digest}", id.split("/*/").next().unwrap_or(""))
}
/// The key group of a segment key (what [`Entry::group`] gives for its chunks).
fn segment_group(key: &str) -> &str {
    key.rsplitn(3, '/').nth(2).unwrap_or("")
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
    /// A marker of format v2 (its length says so) and no data object: the chunk's bytes are
    /// in the segment the marker names, published while that segment is present.
    pub fn in_segment(&self) -> bool {
        self.data.is_none()
            && self
                .marker
                .as_ref()
                .is_some_and(|m| m.size == SEGMENT_MARKER_LEN as u64)
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
    /// Segment objects (format v2) by key.
    pub segments: BTreeMap<String, ObjectMeta>,
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
    /// Markers of format v1 without a data object.
    pub orphan_markers: u64,
    /// Markers of format v2 (whether the segment each names is present takes a read of the
    /// marker: `objectcache gc` does it).
    pub segment_markers: u64,
    /// Segment objects (format v2).
    pub segments: u64,
    /// Bytes of segment objects.
    pub segment_bytes: u64,
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
    pub async fn scan(store: &dyn Store, prefix: &str, limit: usize) -> StoreResult<Self> {
        let mut inv = Inventory {
            partial: store.list_partial(prefix).await?,
            ..Inventory::default()
        };
        for m in store.list(prefix, limit).await? {
            let (kind, id) = classify_key(&m.key);
            match kind {
                ObjectKind::Other => inv.other.push(m),
                ObjectKind::Segment => {
                    inv.segments.insert(m.key.clone(), m);
                }
                ObjectKind::Data | ObjectKind::Marker => {
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
                (None, Some(_)) if e.in_segment() => s.segment_markers += 1,
                (None, Some(_)) => s.orphan_markers += 1,
                (None, None) => {}
            }
        }
        s.segments = self.segments.len() as u64;
        s.segment_bytes = self.segments.values().map(|m| m.size).sum();
        s.bytes += s.segment_bytes;
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
        for (k, m) in &self.segments {
            by.entry(segment_group(k).to_string())
                .or_default()
                .segments
                .insert(k.clone(), m.clone());
        }
        by.into_iter().map(|(k, v)| (k, v.stats())).collect()
    }
}

/// `true` if the store holds both objects of the entry that `key` belongs to.
///
/// # Errors
/// A store error other than not-found.
pub async fn entry_published(store: &dyn Store, key: &str) -> StoreResult<bool> {
    let id = classify_key(key).1;
    Ok(store.exists(&marker_key(&id)).await? && store.exists(&data_key(&id)).await?)
}
