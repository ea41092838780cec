//! One collection pass ([`collect`]) under a [`Policy`]: incomplete writes, unreferenced
//! data, orphan markers, TTL and capacity eviction (the rules of the module documentation),
//! with the [`GcReport`] of what was deleted and why ([`Reason`]).

use super::inventory::{data_key, marker_key};
use super::segments::{self, MarkerMemo};
use super::{AccessLog, Entry, Inventory, LeaseTable};
use crate::error::{StoreError, StoreResult};
use crate::store::Store;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, SystemTime};

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
    /// Data object without a marker, or segment object no marker names, older than the
    /// grace period.
    Unreferenced,
    /// Marker without a data object, or naming a segment that is missing or of another length.
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
) -> StoreResult<GcReport> {
    collect_with(store, policy, now, access, leases, &MarkerMemo::default()).await
}

/// [`collect`], taking what the format v2 markers said from `memo` where they are unchanged
/// since an earlier pass read them, and remembering what this pass reads ([`MarkerMemo`]):
/// a process that collects the same store again and again keeps one memo for it, and a pass
/// over unchanged markers reads none of them.
///
/// # Errors
/// As [`collect`].
pub async fn collect_with(
    store: &dyn Store,
    policy: &Policy,
    now: SystemTime,
    access: Option<&AccessLog>,
    leases: Option<&LeaseTable>,
    memo: &MarkerMemo,
) -> StoreResult<GcReport> {
    let limit = policy.max_objects.saturating_add(1);
    let inv = Inventory::scan(store, &policy.prefix, limit).await?;
    let scanned = inv
        .entries
        .values()
        .map(|e| e.data.is_some() as u64 + e.marker.is_some() as u64)
        .sum::<u64>()
        + inv.segments.len() as u64
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
    let refs = segments::resolve(store, &inv, &mut rep.errors, memo, now).await;
    let mut kept = refs.kept();
    for e in inv.entries.values() {
        if refs.live_segment(&e.id).is_some() {
            live.push(e);
            continue;
        }
        if refs.unreadable.contains(&e.id) {
            continue;
        }
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
    // Segments no published chunk names: a save writes its segment before the markers, so
    // one younger than `grace` may be a save in progress.
    for (key, m) in &inv.segments {
        if kept.contains_key(key) {
            continue;
        }
        if age(m.last_modified) < policy.grace {
            rep.kept_young += 1;
        } else if leased(key) {
            rep.kept_leased += 1;
        } else {
            plan.push((key.clone(), m.size, Reason::Unreferenced, key.clone()));
        }
    }
    // A read of a segment is a use of every chunk in it.
    let last_use = |e: &Entry| -> Option<SystemTime> {
        let seg = refs.live_segment(&e.id);
        let a = access.and_then(|a| a.last_use(&e.id).max(seg.and_then(|s| a.last_use(s))));
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
                held -= plan_unit(&mut plan, &refs, &mut kept, &inv, &es, Reason::IncompleteTp);
            }
            continue;
        }
        units.push(es);
    }
    let unit_use = |u: &[&Entry]| u.iter().map(|e| last_use(e)).max().flatten();
    // Oldest use first; ties broken by id for a deterministic order. Each unit's last use is
    // read once: loads record uses while a collection runs, and a key that moved during the
    // sort would not be a total order (the standard sort panics on that).
    units.sort_by_cached_key(|u| (unit_use(u), u[0].id.clone()));
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
            held -= plan_unit(&mut plan, &refs, &mut kept, &inv, &u, Reason::Expired);
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
            held -= plan_unit(&mut plan, &refs, &mut kept, &inv, &u, Reason::Evicted);
        }
    }
    rep.bytes_after = held;
    // Segments named by an entry whose marker was not deleted after all (a reader leased it
    // meanwhile, or the delete failed): they stay.
    let mut spared: HashSet<String> = HashSet::new();
    for (key, _, reason, id) in plan {
        if !policy.dry_run {
            let segment = inv.segments.contains_key(&key);
            let spare = |spared: &mut HashSet<String>| {
                if let Some(s) = refs.live_segment(&id) {
                    spared.insert(s.to_string());
                }
            };
            // Re-check the lease right before deleting: a reader may have arrived.
            if reason != Reason::OrphanMarker && leased(&id) || segment && spared.contains(&key) {
                rep.kept_leased += 1;
                spare(&mut spared);
                continue;
            }
            // A listing is not a snapshot: a save may have written the other half of the
            // entry since (data before its marker, a segment before the markers naming it),
            // or rewritten a segment. Re-check before deleting a half entry or a segment.
            let recheck = if segment {
                segments::rewritten(store, inv.segments.get(&key)).await
            } else {
                let others = match reason {
                    Reason::OrphanMarker => [
                        Some(data_key(&id)),
                        refs.named_segment(&id).map(str::to_string),
                    ],
                    Reason::Unreferenced => [Some(marker_key(&id)), None],
                    _ => [None, None],
                };
                segments::any_exists(store, others.into_iter().flatten()).await
            };
            match recheck {
                Ok(false) => {}
                Ok(true) => {
                    spare(&mut spared);
                    continue;
                }
                Err(e) => {
                    rep.errors.push((key, e.to_string()));
                    spare(&mut spared);
                    continue;
                }
            }
            if let Err(e) = store.delete(&key).await {
                rep.errors.push((key, e.to_string()));
                spare(&mut spared);
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

/// Entry `e` is planned for deletion: plans its segment too (after its marker) if no kept
/// entry names the segment any more. Returns the bytes that frees.
fn release(
    plan: &mut Vec<(String, u64, Reason, String)>,
    refs: &segments::SegmentRefs,
    kept: &mut HashMap<String, u32>,
    inv: &Inventory,
    e: &Entry,
    r: Reason,
) -> u64 {
    let Some(seg) = refs.live_segment(&e.id) else {
        return 0;
    };
    let Some(n) = kept.get_mut(seg) else {
        return 0;
    };
    *n = n.saturating_sub(1);
    if *n > 0 {
        return 0;
    }
    let size = inv.segments.get(seg).map_or(0, |m| m.size);
    plan.push((seg.to_string(), size, r, seg.to_string()));
    size
}

/// Plans every entry of `unit` for deletion with reason `r`, each with its segment where no
/// kept entry names that any more ([`release`]). Returns the bytes that frees.
fn plan_unit(
    plan: &mut Vec<(String, u64, Reason, String)>,
    refs: &segments::SegmentRefs,
    kept: &mut HashMap<String, u32>,
    inv: &Inventory,
    unit: &[&Entry],
    r: Reason,
) -> u64 {
    let mut freed = 0;
    for e in unit {
        push_entry(plan, e, r);
        freed += e.bytes() + release(plan, refs, kept, inv, e, r);
    }
    freed
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
