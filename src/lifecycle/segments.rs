//! Segment objects (format v2) in a collection: which chunk entries a segment serves, read
//! from their markers ([`resolve`]), and how many name each segment ([`SegmentRefs::kept`]).
//! A segment lives while any published chunk names it; its bytes are freed only with the
//! last one.

use super::inventory::segment_key;
use super::Inventory;
use crate::error::StoreError;
use crate::layout::{decode_marker, Marker};
use crate::store::{ObjectMeta, Store, StoreExt};
use futures::StreamExt;
use std::collections::{HashMap, HashSet};
use std::time::{SystemTime, UNIX_EPOCH};

/// What the v2 markers of an inventory say.
#[derive(Debug, Default)]
pub(super) struct SegmentRefs {
    /// Entry id → key of the segment its marker names (present or not).
    named: HashMap<String, String>,
    /// Entry ids whose marker names a present segment of the length the marker gives: the
    /// entry is published.
    live: HashMap<String, String>,
    /// Entry ids whose marker could not be read (a store error other than not-found): left
    /// alone this pass.
    pub unreadable: HashSet<String>,
}

impl SegmentRefs {
    /// The segment a published entry's chunk lives in, if it lives in one.
    pub fn live_segment(&self, id: &str) -> Option<&str> {
        self.live.get(id).map(String::as_str)
    }
    /// The segment an entry's marker names (present or not).
    pub fn named_segment(&self, id: &str) -> Option<&str> {
        self.named.get(id).map(String::as_str)
    }
    /// Entries naming each present segment, by segment key: what a collection counts down
    /// as it plans their deletion.
    pub fn kept(&self) -> HashMap<String, u32> {
        let mut n: HashMap<String, u32> = HashMap::new();
        for seg in self.live.values() {
            *n.entry(seg.clone()).or_insert(0) += 1;
        }
        n
    }
}

/// Marker reads [`resolve`] keeps in flight.
const MARKER_READS_IN_FLIGHT: usize = 32;

/// Reads the marker of every entry with a v2 marker and no data object (one GET of 64 bytes
/// each, [`MARKER_READS_IN_FLIGHT`] at a time) and records which segment it names and whether that segment is present with the
/// length the marker gives.
///
/// A marker that is gone by now, or that does not decode as a v2 marker, names nothing (the
/// entry is an orphan marker: lookup would report a chunk no load can read).
///
/// # Errors
/// None: a marker read that fails otherwise puts its entry in `unreadable`, with the error
/// pushed to `errors`.
pub(super) async fn resolve(
    store: &dyn Store,
    inv: &Inventory,
    errors: &mut Vec<(String, String)>,
) -> SegmentRefs {
    let mut r = SegmentRefs::default();
    // Owned (entry id, marker key) pairs: futures that borrow the inventory would not be
    // `Send` for every lifetime, which a collection spawned on a runtime needs.
    let wanted: Vec<(String, String)> = inv
        .entries
        .values()
        .filter(|e| e.in_segment())
        .filter_map(|e| Some((e.id.clone(), e.marker.as_ref()?.key.clone())))
        .collect();
    let mut reads = futures::stream::iter(wanted)
        .map(|(id, key)| async move {
            let got = store.get_bytes(&key).await;
            (id, key, got)
        })
        .buffer_unordered(MARKER_READS_IN_FLIGHT);
    while let Some((id, key, got)) = reads.next().await {
        let bytes = match got {
            Ok(b) => b,
            Err(StoreError::NotFound { .. }) => continue,
            Err(err) => {
                errors.push((key, err.to_string()));
                r.unreadable.insert(id);
                continue;
            }
        };
        let Ok(Marker::Segment(sm)) = decode_marker(&bytes) else {
            continue;
        };
        let seg = segment_key(&id, &hex::encode(sm.digest));
        r.named.insert(id.clone(), seg.clone());
        if inv
            .segments
            .get(&seg)
            .is_some_and(|s| s.size == sm.object_len)
        {
            r.live.insert(id, seg);
        }
    }
    r
}

/// Whether any of `keys` exists now.
///
/// # Errors
/// The first store error other than not-found.
pub(super) async fn any_exists(
    store: &dyn Store,
    keys: impl Iterator<Item = String>,
) -> Result<bool, StoreError> {
    for k in keys {
        if store.exists(&k).await? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether the segment listed as `listed` was written again since (a save of the same chunks
/// rewrites it, then its markers): its length, write time (to the second: S3 listings give
/// milliseconds, HEAD whole seconds) or entity tag differ now. A segment gone since counts as
/// not rewritten.
///
/// # Errors
/// The store's error other than not-found.
pub(super) async fn rewritten(
    store: &dyn Store,
    listed: Option<&ObjectMeta>,
) -> Result<bool, StoreError> {
    let Some(listed) = listed else {
        return Ok(false);
    };
    match store.head(&listed.key).await {
        Ok(now) => {
            let secs = |t: Option<SystemTime>| {
                t.and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map(|d| d.as_secs())
            };
            let etags_differ =
                now.etag.is_some() && listed.etag.is_some() && now.etag != listed.etag;
            Ok(now.size != listed.size
                || secs(now.last_modified) != secs(listed.last_modified)
                || etags_differ)
        }
        Err(StoreError::NotFound { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}
