//! Segment objects (format v2) in a collection: which chunk entries a segment serves, read
//! from their markers ([`resolve`]), and how many name each segment ([`SegmentRefs::kept`]).
//! A segment lives while any published chunk names it; its bytes are freed only with the
//! last one.

use super::inventory::segment_key;
use super::Inventory;
use crate::error::{StoreError, StoreResult};
use crate::layout::{decode_marker, Marker, SegmentMarker};
use crate::store::{ObjectMeta, Store, StoreExt};
use futures::StreamExt;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// What the format v2 markers read by earlier collection passes said, by marker key, so
/// that a pass reads again only the markers written since.
///
/// A publish marker is written once (first writer wins); its key is written again only after
/// a delete, by a new save. A pass takes what a marker said from here, where it would
/// otherwise read it (one GET of 64 bytes per chunk saved in format v2, every pass: on AWS
/// S3, $0.40 per million chunks per pass at the list price), when the listing shows it as it
/// was read: the same entity tag, and a write time at least [`MEMO_MARGIN`] before the pass
/// that read it. The second rule keeps a rewrite that an entity tag alone might not show
/// (the file store's tag is the length and write time, and 64-byte markers written within
/// one tick of a coarse clock would share it) from being taken for the marker read before:
/// a marker written after that read has a later write time. It also covers clocks of the
/// store and of this host apart by less than the margin. A marker listed without a tag or a
/// write time is read every pass; a new marker is read once more after the margin. The memo
/// keeps the markers the last pass listed, no others.
///
/// One memo serves one store and prefix: [`collect_with`](super::collect_with) in a process
/// that collects again and again (`ServerHandle::gc`, `Engine::gc` keep one each).
#[derive(Debug, Default)]
pub struct MarkerMemo {
    /// Marker key → what the read found ([`Memo`]).
    seen: std::sync::Mutex<HashMap<String, Memo>>,
}

/// One marker as a collection pass read it.
#[derive(Debug)]
struct Memo {
    /// The entity tag the pass listed.
    etag: String,
    /// The write time the pass listed.
    written: SystemTime,
    /// The pass's time (`now` of [`collect_with`](super::collect_with)), at or before the read.
    read: SystemTime,
    /// The segment marker it held, or `None` for a marker that is not one.
    marker: Option<SegmentMarker>,
}

/// How long before the pass that read a marker its write time must lie for the memo to
/// stand for it ([`MarkerMemo`]): more than any clock difference between a store and its
/// collector.
pub const MEMO_MARGIN: Duration = Duration::from_secs(300);

impl MarkerMemo {
    /// What the marker `m` (as listed now) said when it was read, if the listing shows it as
    /// it was then ([`MarkerMemo`]'s rules).
    fn get(&self, m: &ObjectMeta) -> Option<Option<SegmentMarker>> {
        let (etag, written) = (m.etag.as_deref()?, m.last_modified?);
        let seen = self.seen.lock().expect("marker memo lock");
        seen.get(&m.key)
            .filter(|r| r.etag == etag && r.written == written)
            .filter(|r| written + MEMO_MARGIN <= r.read)
            .map(|r| r.marker.clone())
    }

    /// Remembers what the marker listed as `m` held when the pass of time `read` read it;
    /// nothing for a marker listed without a tag or a write time.
    fn put(&self, m: &ObjectMeta, read: SystemTime, marker: Option<SegmentMarker>) {
        if let (Some(etag), Some(written)) = (&m.etag, m.last_modified) {
            let mut seen = self.seen.lock().expect("marker memo lock");
            let memo = Memo {
                etag: etag.clone(),
                written,
                read,
                marker,
            };
            seen.insert(m.key.clone(), memo);
        }
    }

    /// Forgets every marker not in `listed`.
    fn keep_only(&self, listed: &HashSet<&str>) {
        let mut seen = self.seen.lock().expect("marker memo lock");
        seen.retain(|k, _| listed.contains(k.as_str()));
    }
}

/// Marker reads [`resolve`] keeps in flight.
const MARKER_READS_IN_FLIGHT: usize = 32;

/// Reads the marker of every entry with a v2 marker and no data object (one GET of 64 bytes
/// each, [`MARKER_READS_IN_FLIGHT`] at a time, but none for a marker `memo` stands for: see
/// [`MarkerMemo`]; `now` is the pass's time, kept as the time of its reads) and records which
/// segment it names and whether that segment is present with the length the marker gives.
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
    memo: &MarkerMemo,
    now: SystemTime,
) -> SegmentRefs {
    let mut r = SegmentRefs::default();
    let markers: Vec<(&str, &ObjectMeta)> = inv
        .entries
        .values()
        .filter(|e| e.in_segment())
        .filter_map(|e| Some((e.id.as_str(), e.marker.as_ref()?)))
        .collect();
    memo.keep_only(&markers.iter().map(|(_, m)| m.key.as_str()).collect());
    // What each marker says: from the memo, else read. Owned (entry id, listed marker)
    // pairs for the reads: futures that borrow the inventory would not be `Send` for every
    // lifetime, which a collection spawned on a runtime needs.
    let mut said: Vec<(String, Option<SegmentMarker>)> = Vec::new();
    let mut wanted: Vec<(String, ObjectMeta)> = Vec::new();
    for (id, m) in markers {
        match memo.get(m) {
            Some(sm) => said.push((id.to_string(), sm)),
            None => wanted.push((id.to_string(), m.clone())),
        }
    }
    let mut reads = futures::stream::iter(wanted)
        .map(|(id, m)| async move {
            let got = store.get_bytes(&m.key).await;
            (id, m, got)
        })
        .buffer_unordered(MARKER_READS_IN_FLIGHT);
    while let Some((id, m, got)) = reads.next().await {
        let bytes = match got {
            Ok(b) => b,
            Err(StoreError::NotFound { .. }) => continue,
            Err(err) => {
                errors.push((m.key, err.to_string()));
                r.unreadable.insert(id);
                continue;
            }
        };
        let sm = match decode_marker(&bytes) {
            Ok(Marker::Segment(sm)) => Some(sm),
            _ => None,
        };
        memo.put(&m, now, sm.clone());
        said.push((id, sm));
    }
    for (id, sm) in said {
        let Some(sm) = sm else { continue };
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
) -> StoreResult<bool> {
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
pub(super) async fn rewritten(store: &dyn Store, listed: Option<&ObjectMeta>) -> StoreResult<bool> {
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
