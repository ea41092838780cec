//! Lifecycle on a real store (FsStore on a temporary directory): garbage collection of
//! interrupted saves and orphan markers, TTL, capacity with LRU eviction, pinning, leases, and
//! the `objectcache stat` / `objectcache gc` commands. After every collection, whatever lookup
//! reports loads byte-exact.

use crate::common;

use crate::segment_load::write_segment;
use common::current_thread_rt as rt;
use common::*;
use objectcache::connector::Engine;
use objectcache::lifecycle::{
    collect, collect_with, AccessLog, GcReport, Inventory, LeaseTable, MarkerMemo, Policy, Reason,
    Stats, TrackedStore, MEMO_MARGIN,
};
use objectcache::store::{FsStore, FsyncPolicy, Store, StoreExt};
use objectcache::{ChunkHash, KvGeometry};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

fn g() -> KvGeometry {
    small_geometry("test/lifecycle", 4)
}

fn fs() -> (tempfile::TempDir, Arc<dyn Store>) {
    let d = tempfile::tempdir().unwrap();
    let s: Arc<dyn Store> = Arc::new(FsStore::new(d.path(), FsyncPolicy::Never).unwrap());
    (d, s)
}

fn eng(store: Arc<dyn Store>, ns: &str) -> Engine {
    uncached_engine(store, ns)
}

struct Prefix {
    hs: Vec<ChunkHash>,
    data: Vec<Vec<u8>>,
}

fn save(e: &Engine, n: usize, seed: u64) -> Prefix {
    let (hs, data) = save_prefix(e, &g(), n, seed);
    Prefix { hs, data }
}

/// Lookup, then load what lookup reports; every reported chunk must load byte-exact.
fn check(e: &Engine, p: &Prefix) -> usize {
    let g = g();
    let hit = e.lookup_blocking(&g, &p.hs).unwrap();
    if hit > 0 {
        let n = hit * g.slice_bytes() as usize;
        let h = load_first(e, &g, &p.hs, hit);
        for l in 0..g.layers as usize {
            assert_eq!(h.layer(l).unwrap(), &p.data[l][..n], "layer {l}");
        }
    }
    hit
}

fn later(d: Duration) -> SystemTime {
    SystemTime::now() + d
}

/// The inventory counts of everything in `s`.
fn scan_stats(r: &tokio::runtime::Runtime, s: &dyn Store) -> Stats {
    r.block_on(Inventory::scan(s, "", 1000)).unwrap().stats()
}

/// One collection pass over `s` under `pol` as of `now`, with no access log and no leases.
fn collect_at(
    r: &tokio::runtime::Runtime,
    s: &dyn Store,
    pol: &Policy,
    now: SystemTime,
) -> GcReport {
    r.block_on(collect(s, pol, now, None, None)).unwrap()
}

/// An FS store and the tracked store over it that logs its uses and leases what a load reads
/// for `lease_for`.
struct Tracked {
    _dir: tempfile::TempDir,
    raw: Arc<dyn Store>,
    access: Arc<AccessLog>,
    leases: Arc<LeaseTable>,
    store: Arc<dyn Store>,
}

impl Tracked {
    fn new(lease_for: Duration) -> Tracked {
        let (_dir, raw) = fs();
        let access = Arc::new(AccessLog::new());
        let leases = LeaseTable::new();
        let store: Arc<dyn Store> = Arc::new(TrackedStore::new(
            raw.clone(),
            access.clone(),
            leases.clone(),
            lease_for,
        ));
        Tracked {
            _dir,
            raw,
            access,
            leases,
            store,
        }
    }

    /// One collection pass over the FS store under `pol` now, with the tracked store's access
    /// log and leases.
    fn collect(&self, r: &tokio::runtime::Runtime, pol: &Policy) -> GcReport {
        r.block_on(collect(
            self.raw.as_ref(),
            pol,
            SystemTime::now(),
            Some(&self.access),
            Some(&self.leases),
        ))
        .unwrap()
    }
}

#[test]
fn gc_removes_interrupted_saves_after_grace_and_orphan_markers_at_once() {
    let (_d, s) = fs();
    let e = eng(s.clone(), "gc");
    let p = save(&e, 6, 1);
    let keys = e.keys(&g()).unwrap();
    let r = rt();
    // An interrupted save: data of chunks 4, 5 without markers; an orphan marker: chunk 3's
    // data gone.
    r.block_on(s.delete(&keys.marker(&p.hs[4]))).unwrap();
    r.block_on(s.delete(&keys.marker(&p.hs[5]))).unwrap();
    r.block_on(s.delete(&keys.data(&p.hs[3]))).unwrap();
    let st = scan_stats(&r, s.as_ref());
    assert_eq!(
        (st.published, st.unreferenced_data, st.orphan_markers),
        (3, 2, 1)
    );

    let pol = Policy::default();
    let rep = collect_at(&r, s.as_ref(), &pol, SystemTime::now());
    assert_eq!(rep.count(Reason::OrphanMarker), 1);
    assert_eq!(
        rep.count(Reason::Unreferenced),
        0,
        "young unreferenced data was deleted"
    );
    assert_eq!(rep.kept_young, 2);
    assert_eq!(check(&e, &p), 3);

    let rep = collect_at(&r, s.as_ref(), &pol, later(Duration::from_secs(7200)));
    assert_eq!(rep.count(Reason::Unreferenced), 2);
    assert_eq!(rep.deleted.len(), 2);
    let st = scan_stats(&r, s.as_ref());
    assert_eq!(
        (st.published, st.unreferenced_data, st.orphan_markers),
        (3, 0, 0)
    );
    assert_eq!(check(&e, &p), 3);
    println!("LIFECYCLE|gc: interrupted save + orphan marker|1|2 unreferenced kept within grace, deleted after; orphan marker deleted at once; 3 published chunks load byte-exact");
}

#[test]
fn ttl_expires_unpinned_entries_only() {
    let (_d, s) = fs();
    let a = eng(s.clone(), "tenant-a");
    let b = eng(s.clone(), "tenant-b");
    let pa = save(&a, 3, 2);
    let pb = save(&b, 3, 3);
    let r = rt();
    let pol = Policy {
        ttl: Some(Duration::from_secs(60)),
        pinned: vec!["tenant-a/".into()],
        ..Policy::default()
    };
    let rep = collect_at(&r, s.as_ref(), &pol, SystemTime::now());
    assert!(rep.deleted.is_empty());
    let rep = collect_at(&r, s.as_ref(), &pol, later(Duration::from_secs(120)));
    assert_eq!(
        rep.count(Reason::Expired),
        6,
        "3 markers and 3 data objects of tenant-b"
    );
    assert_eq!(rep.kept_pinned, 3);
    assert!(rep.deleted.iter().all(|(k, _)| k.starts_with("tenant-b/")));
    // Marker before data, per entry.
    let first_marker = rep
        .deleted
        .iter()
        .position(|(k, _)| k.contains("/pub/"))
        .unwrap();
    assert_eq!(first_marker, 0);
    assert_eq!(check(&a, &pa), 3);
    assert_eq!(check(&b, &pb), 0);
}

#[test]
fn capacity_evicts_least_recently_used_and_spares_leased() {
    let t = Tracked::new(Duration::ZERO);
    let e = eng(t.store.clone(), "lru");
    // Each save finishes before the next starts, so the uses are ordered without sleeping
    // between them: an entry's last use is the later of its logged use (the system clock,
    // nanoseconds) and its files' mtime (the kernel's coarse clock, never ahead of the system
    // clock), and both of B's come before C's logged use.
    let pa = save(&e, 2, 10);
    let pb = save(&e, 2, 11);
    let pc = save(&e, 2, 12);
    // A is used again: now B is the least recently used.
    assert_eq!(check(&e, &pa), 2);
    let r = rt();
    let total = scan_stats(&r, t.raw.as_ref()).bytes;
    let per_prefix = total / 3;
    let pol = Policy {
        capacity_bytes: Some(2 * per_prefix),
        ..Policy::default()
    };
    let rep = t.collect(&r, &pol);
    assert_eq!(rep.count(Reason::Evicted), 4, "{:?}", rep.deleted);
    assert!(rep.bytes_after <= 2 * per_prefix);
    assert_eq!(check(&e, &pb), 0, "B was the least recently used");
    assert_eq!(check(&e, &pa), 2);
    assert_eq!(check(&e, &pc), 2);

    // Capacity 0 with C leased (a reader holds it): only A goes.
    let keys = e.keys(&g()).unwrap();
    let lease = t.leases.acquire(pc.hs.iter().map(|h| keys.data(h)));
    let pol0 = Policy {
        capacity_bytes: Some(0),
        ..Policy::default()
    };
    let rep = t.collect(&r, &pol0);
    assert_eq!(rep.kept_leased, 2);
    assert_eq!(check(&e, &pc), 2, "a leased entry was evicted");
    assert_eq!(check(&e, &pa), 0);
    drop(lease);
    t.collect(&r, &pol0);
    assert_eq!(check(&e, &pc), 0);
    println!("LIFECYCLE|capacity LRU + lease|1|least recently used prefix evicted first; leased prefix kept until released; survivors byte-exact");
}

#[test]
fn soft_lease_keeps_an_object_under_its_reader() {
    let t = Tracked::new(Duration::from_secs(30));
    let e = eng(t.store.clone(), "soft");
    let p = save(&e, 3, 20);
    let other = eng(t.raw.clone(), "other");
    let q = save(&other, 3, 21);
    // A load through the tracked store leases what it reads for 30 s.
    assert_eq!(check(&e, &p), 3);
    let pol = Policy {
        capacity_bytes: Some(0),
        ttl: Some(Duration::ZERO),
        ..Policy::default()
    };
    let r = rt();
    let rep = t.collect(&r, &pol);
    assert!(rep.kept_leased >= 3, "{rep:?}");
    assert_eq!(check(&e, &p), 3);
    assert_eq!(check(&other, &q), 0);
}

#[test]
fn collection_during_saves_never_breaks_a_published_prefix() {
    let (_d, s) = fs();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = s.clone();
    let st2 = stop.clone();
    let gc = std::thread::spawn(move || {
        let r = rt();
        let pol = Policy {
            grace: Duration::from_secs(60),
            ..Policy::default()
        };
        let mut passes = 0;
        while !st2.load(std::sync::atomic::Ordering::Relaxed) {
            let rep = collect_at(&r, s2.as_ref(), &pol, SystemTime::now());
            assert_eq!(rep.count(Reason::Unreferenced), 0, "{rep:?}");
            passes += 1;
        }
        passes
    });
    let e = eng(s.clone(), "race");
    let mut saved = Vec::new();
    for i in 0..20 {
        saved.push(save(&e, 4, 100 + i));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let passes = gc.join().unwrap();
    for p in &saved {
        assert_eq!(check(&e, p), 4);
    }
    println!("LIFECYCLE|gc concurrent with saves|20|{passes} gc passes during 20 saves; nothing published or in flight deleted");
}

#[test]
fn stat_and_gc_commands() {
    let (d, s) = fs();
    let e = eng(s.clone(), "cli");
    let p = save(&e, 3, 30);
    let keys = e.keys(&g()).unwrap();
    rt().block_on(s.delete(&keys.marker(&p.hs[2]))).unwrap();
    let bin = env!("CARGO_BIN_EXE_objectcache");
    let url = format!("file://{}", d.path().display());
    let out = run_ok(std::process::Command::new(bin).args(["stat", "--store", &url, "--json"]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["total"]["published"], 2);
    assert_eq!(v["total"]["unreferenced_data"], 1);
    let out = std::process::Command::new(bin)
        .args(["gc", "--store", &url, "--grace-s", "0", "--dry-run"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let txt = String::from_utf8_lossy(&out.stdout);
    assert!(
        txt.contains("would delete") && txt.contains("Unreferenced"),
        "{txt}"
    );
    assert_eq!(check(&e, &p), 2);
    let out = std::process::Command::new(bin)
        .args(["gc", "--store", &url, "--grace-s", "0", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["deleted"].as_array().unwrap().len(), 1);
    assert_eq!(check(&e, &p), 2);
    let out = std::process::Command::new(bin)
        .args(["gc", "--store", "bogus://x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bogus"));
    // A mistyped directory is refused, not created empty; a negative age says what it wants.
    let missing = d.path().join("no-such-store");
    for cmd in ["stat", "gc"] {
        let out = std::process::Command::new(bin)
            .args([cmd, "--store", missing.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("no such directory"),
            "{cmd}: {err}"
        );
        assert!(!missing.exists(), "{cmd} created the directory");
    }
    let out = std::process::Command::new(bin)
        .args(["gc", "--store", &url, "--ttl-s", "-5"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--ttl-s") && err.contains("whole number"),
        "{err}"
    );
}

/// Loads record uses while a collection sorts entries by last use (CI saw the standard sort
/// panic on a key that moved mid-sort): every pass completes, and a dry run deletes nothing.
#[test]
fn collection_while_loads_record_uses_completes() {
    let t = Tracked::new(Duration::ZERO);
    let e = eng(t.store.clone(), "uses");
    let p = save(&e, 96, 30);
    let keys = e.keys(&g()).unwrap();
    let data_keys: Vec<String> = p.hs.iter().map(|h| keys.data(h)).collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (access, st2) = (t.access.clone(), stop.clone());
    // Newest use goes to the entries in reverse order, round after round: every entry's key
    // keeps moving past its neighbours'.
    let user = std::thread::spawn(move || {
        let mut rounds = 0u64;
        while !st2.load(std::sync::atomic::Ordering::Relaxed) {
            for k in data_keys.iter().rev() {
                access.record(k, SystemTime::now());
            }
            rounds += 1;
        }
        rounds
    });
    let r = rt();
    let pol = Policy {
        capacity_bytes: Some(0),
        dry_run: true,
        ..Policy::default()
    };
    let passes = 300;
    for _ in 0..passes {
        let rep = t.collect(&r, &pol);
        // Data object and marker of each of the 96 entries.
        assert_eq!(
            rep.count(Reason::Evicted),
            192,
            "{} evicted",
            rep.deleted.len()
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = user.join().unwrap();
    assert_eq!(check(&e, &p), 96, "a dry run deleted something");
    println!("LIFECYCLE|gc while uses are recorded|{passes}|{passes} passes over 96 entries during {rounds} rounds of recorded uses; none panicked, nothing deleted");
}

/// Saves `n` chunks (seed `seed`) as one segment object (format v2) and a marker per chunk,
/// as a version 2 writer does.
fn save_segment(store: &Arc<dyn Store>, e: &Engine, n: usize, seed: u64) -> Prefix {
    let g = g();
    let hs = hashes(&g, n * g.tokens_per_chunk as usize, seed as u32);
    let data = kv(&g, n, seed);
    write_segment(store, e, &g, &hs, &data, 0..n, &hs, None, true);
    Prefix { hs, data }
}

/// [`check`] through a new engine over `t`'s tracked store: its lookup reads the markers and
/// its load places the chunks from what they say.
fn check_v2(t: &Tracked, p: &Prefix) -> usize {
    check(&engine(t.store.clone(), "seg"), p)
}

/// A collector that keeps a [`MarkerMemo`] reads each format v2 marker once while it stays as
/// it was listed and was written [`MEMO_MARGIN`] or more before the pass that read it: a pass
/// over such markers reads none, a marker written again is read again, markers written
/// within the margin are read on every pass, and every pass decides as a pass without the
/// memo (dry runs, compared).
#[test]
fn markers_unchanged_since_the_last_pass_are_not_read_again() {
    let (_d, raw) = fs();
    let counting = Arc::new(crate::security_tenants::Counting::new(raw.clone()));
    let store: &dyn Store = counting.as_ref();
    let e = eng(raw.clone(), "memo");
    let r = rt();
    let pa = save_segment(&raw, &e, 4, 50);
    let pb = save_segment(&raw, &e, 3, 51);
    let memo = MarkerMemo::default();
    let pol = Policy {
        dry_run: true,
        ..Policy::default()
    };
    let gets = || {
        counting
            .marker_gets
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    // One pass with the memo, one without, from the same store at time `now`: the same
    // decisions. Returns the markers the pass with the memo read.
    let passes = |case: &str, now: SystemTime| -> u64 {
        let before = gets();
        let with = r
            .block_on(collect_with(store, &pol, now, None, None, &memo))
            .unwrap();
        let read = gets() - before;
        let without = r.block_on(collect(store, &pol, now, None, None)).unwrap();
        assert_eq!(
            (
                &with.deleted,
                with.kept_young,
                with.scanned,
                with.bytes_after
            ),
            (
                &without.deleted,
                without.kept_young,
                without.scanned,
                without.bytes_after
            ),
            "{case}: the memo changed what the pass decides"
        );
        read
    };
    let soon = SystemTime::now();
    assert_eq!(passes("written within the margin", soon), 7);
    assert_eq!(passes("again within the margin", soon), 7);
    let later = soon + MEMO_MARGIN + Duration::from_secs(1);
    assert_eq!(passes("first pass past the margin", later), 7);
    assert_eq!(
        passes("unchanged", later),
        0,
        "nothing changed: no marker read"
    );
    // Chunk 0 of the first prefix is saved again: its marker is deleted, then written anew
    // (a new entity tag and write time), naming the second prefix's segment.
    let keys = e.keys(&g()).unwrap();
    let m0 = keys.marker(&pa.hs[0]);
    let other = r.block_on(raw.get_bytes(&keys.marker(&pb.hs[0]))).unwrap();
    r.block_on(raw.delete(&m0)).unwrap();
    std::thread::sleep(Duration::from_millis(5)); // a later write time for the FS store's tag
    r.block_on(raw.put(&m0, other)).unwrap();
    assert_eq!(passes("one marker written again", later), 1);
    // Both segments are lost: every marker is an orphan now (liveness comes from each pass's
    // listing, not from the memo), and no marker is read for it.
    let inv = r.block_on(Inventory::scan(raw.as_ref(), "", 1000)).unwrap();
    assert_eq!(inv.segments.len(), 2);
    for k in inv.segments.keys() {
        r.block_on(raw.delete(k)).unwrap();
    }
    assert_eq!(passes("segments lost", later), 0);
    let rep = r
        .block_on(collect_with(store, &pol, later, None, None, &memo))
        .unwrap();
    assert_eq!(rep.count(Reason::OrphanMarker), 7, "{:?}", rep.deleted);
    println!(
        "GC|marker memo|7 v2 markers: within the margin 7 marker GETs each pass, past it 7 then 0, one written again 1, segments lost 0 (7 orphans found)"
    );
}

/// Collection by reference (format v2): a segment object lives while any published chunk's
/// marker names it; a segment no marker names goes after `grace`, a marker naming a missing
/// segment at once; TTL and eviction delete a chunk's marker and the segment with the last one;
/// leases and pins keep chunks and so their segment. Every chunk lookup still reports loads
/// byte-exact.
#[test]
fn segments_live_while_any_chunk_in_them_is_published() {
    let t = Tracked::new(Duration::ZERO);
    let e = eng(t.store.clone(), "seg");
    let r = rt();
    let pa = save_segment(&t.raw, &e, 4, 40);
    let pb = save_segment(&t.raw, &e, 4, 41);
    let pc = save(&e, 4, 42); // format v1 beside them
                              // A segment whose save never wrote its markers, and markers whose segment was never
                              // written.
    let g = g();
    let lost = hashes(&g, 3 * g.tokens_per_chunk as usize, 43);
    let lost_kv = kv(&g, 3, 43);
    write_segment(&t.raw, &e, &g, &lost, &lost_kv, 0..0, &lost, None, true);
    let orphan = hashes(&g, 2 * g.tokens_per_chunk as usize, 44);
    write_segment(
        &t.raw,
        &e,
        &g,
        &orphan,
        &kv(&g, 2, 44),
        0..2,
        &orphan,
        None,
        false,
    );
    let st = scan_stats(&r, t.raw.as_ref());
    assert_eq!(
        (st.segments, st.segment_markers, st.published),
        (3, 10, 4),
        "{st:?}"
    );

    // Now: the orphan markers go at once, the unnamed segment is young and stays.
    let rep = collect_at(&r, t.raw.as_ref(), &Policy::default(), SystemTime::now());
    assert_eq!(rep.count(Reason::OrphanMarker), 2, "{:?}", rep.deleted);
    assert_eq!(rep.count(Reason::Unreferenced), 0, "{:?}", rep.deleted);
    assert_eq!(rep.kept_young, 1);
    // Past the grace period the unnamed segment goes too; everything published stays.
    let rep = collect_at(
        &r,
        t.raw.as_ref(),
        &Policy::default(),
        later(Duration::from_secs(7200)),
    );
    assert_eq!(rep.deleted.len(), 1, "{:?}", rep.deleted);
    assert_eq!(rep.count(Reason::Unreferenced), 1);
    assert!(rep.deleted[0].0.contains("/seg/"), "{:?}", rep.deleted);
    for p in [&pa, &pb, &pc] {
        assert_eq!(check_v2(&t, p), 4);
    }

    // A pinned chunk keeps its segment when the others in it expire.
    let keys = e.keys(&g).unwrap();
    // Entry ids: the key with `*` for `kv`/`pub`; a pin is a prefix of ids.
    let id = |h: &ChunkHash| format!("{}*/{}", keys.prefix(), h.to_hex());
    let mut pinned = vec![id(&pa.hs[0])];
    pinned.extend(pc.hs.iter().map(id));
    let ttl = Policy {
        ttl: Some(Duration::ZERO),
        pinned,
        ..Policy::default()
    };
    let lease = t.leases.acquire(pb.hs.iter().map(|h| keys.marker(h)));
    let rep = t.collect(&r, &ttl);
    // A's chunks 1-3 expired (their markers; the segment stays for chunk 0); B is leased,
    // C pinned.
    assert_eq!(rep.count(Reason::Expired), 3, "{:?}", rep.deleted);
    assert!(
        rep.deleted.iter().all(|(k, _)| k.contains("/pub/")),
        "{:?}",
        rep.deleted
    );
    assert_eq!(
        check_v2(&t, &pa),
        1,
        "chunk 0 of A, pinned, loads from its segment"
    );
    assert_eq!(check_v2(&t, &pb), 4);
    assert_eq!(check_v2(&t, &pc), 4);
    // Released, B expires whole: its four markers, then its segment.
    drop(lease);
    let rep = t.collect(&r, &ttl);
    assert_eq!(rep.count(Reason::Expired), 5, "{:?}", rep.deleted);
    let last = &rep.deleted.last().unwrap().0;
    assert!(
        last.contains("/seg/"),
        "the segment goes after its markers: {:?}",
        rep.deleted
    );
    assert_eq!(check_v2(&t, &pb), 0);
    assert_eq!(check_v2(&t, &pa), 1);
    let st = scan_stats(&r, t.raw.as_ref());
    assert_eq!((st.segments, st.segment_markers), (1, 1), "{st:?}");

    // Capacity 0, no pins: A's last chunk goes, and its segment with it; C (v1) too.
    let rep = t.collect(
        &r,
        &Policy {
            capacity_bytes: Some(0),
            ..Policy::default()
        },
    );
    assert_eq!(rep.count(Reason::Evicted), 2 + 4 * 2, "{:?}", rep.deleted);
    assert_eq!(rep.bytes_after, 0);
    let st = scan_stats(&r, t.raw.as_ref());
    assert_eq!(st.bytes, 0, "{st:?}");
    assert_eq!((check_v2(&t, &pa), check_v2(&t, &pc)), (0, 0));
    println!("LIFECYCLE|segments by reference|1|orphan v2 markers at once, unnamed segment after grace, pinned chunk keeps its segment, leased segment kept, last chunk takes its segment, capacity 0 empties the store");
}
