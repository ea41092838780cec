//! Security: tenants apart (namespace and salted chunk hashes, including lookup cost), keys
//! that cannot escape the storage root through any entry point, bounded sizes and counts.
//! Each check prints one `SECURITY|...` line for docs/reliability.md.

use crate::common;

use async_trait::async_trait;
use bytes::Bytes;
use common::current_thread_rt as rt;
use common::*;
use objectcache::connector::{Engine, EngineConfig};
use objectcache::hash::{chunk_hashes, HashParams};
use objectcache::store::{
    FsStore, FsyncPolicy, GetOptions, GetResult, ObjectMeta, PutOptions, PutResult, Store, StoreExt,
};
use objectcache::{ChunkHash, KvGeometry, StoreError, StoreResult};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn g() -> KvGeometry {
    small_geometry("test/security", 4)
}

/// Counts the requests reaching a real store (every call is forwarded): reads of publish
/// markers (`.../pub/...`, GET or HEAD: what a lookup does), GETs of them alone, and GETs of
/// anything else (data).
#[derive(Debug)]
pub(crate) struct Counting {
    inner: Arc<dyn Store>,
    pub(crate) marker_reads: AtomicU64,
    pub(crate) marker_gets: AtomicU64,
    pub(crate) data_gets: AtomicU64,
}

impl Counting {
    pub(crate) fn new(inner: Arc<dyn Store>) -> Counting {
        Counting {
            inner,
            marker_reads: AtomicU64::new(0),
            marker_gets: AtomicU64::new(0),
            data_gets: AtomicU64::new(0),
        }
    }

    fn count(&self, key: &str, head: bool) {
        if key.contains("/pub/") {
            self.marker_reads.fetch_add(1, Ordering::SeqCst);
            if !head {
                self.marker_gets.fetch_add(1, Ordering::SeqCst);
            }
        } else if !head {
            self.data_gets.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[async_trait]
impl Store for Counting {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    async fn get_opts(&self, key: &str, o: GetOptions) -> StoreResult<GetResult> {
        self.count(key, false);
        self.inner.get_opts(key, o).await
    }
    async fn put_opts(&self, key: &str, d: Bytes, o: PutOptions) -> StoreResult<PutResult> {
        self.inner.put_opts(key, d, o).await
    }
    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        self.count(key, true);
        self.inner.head(key).await
    }
    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.inner.delete(key).await
    }
    async fn list(&self, p: &str, l: usize) -> StoreResult<Vec<ObjectMeta>> {
        self.inner.list(p, l).await
    }
}

fn tenant(store: Arc<dyn Store>, ns: &str) -> Engine {
    uncached_engine(store, ns)
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 128_000)
        .collect()
}

#[test]
fn tenant_b_gets_no_hit_on_tenant_a_prefix_and_pays_a_plain_miss() {
    let dir = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let counting = Arc::new(Counting::new(fs.clone()));
    let g = g();
    let toks = prompt(40 * 16);
    let params = |salt: &str| HashParams::new(16).with_salt(salt);
    let ha = chunk_hashes(&toks, &params("salt-of-a")).unwrap();
    let hb = chunk_hashes(&toks, &params("salt-of-b")).unwrap();
    assert!(
        ha.iter().zip(&hb).all(|(a, b)| a != b),
        "the salt must change every chunk hash"
    );
    let a = tenant(counting.clone(), "tenant-a");
    let data = kv(&g, ha.len(), 1);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    a.save_blocking(&g, &ha, &refs).unwrap();
    assert_eq!(a.lookup_blocking(&g, &ha).unwrap(), ha.len());

    let r = rt();
    let cases: Vec<(&str, Engine, Vec<ChunkHash>)> = vec![
        // Same prompt, B's own namespace and salt.
        (
            "B's namespace, B's salt",
            tenant(counting.clone(), "tenant-b"),
            hb.clone(),
        ),
        // A's hashes leaked to B: B's namespace keeps them apart.
        (
            "B's namespace, A's hashes",
            tenant(counting.clone(), "tenant-b"),
            ha.clone(),
        ),
        // A shared namespace: the salt alone keeps them apart.
        (
            "A's namespace, B's salt",
            tenant(counting.clone(), "tenant-a"),
            hb.clone(),
        ),
    ];
    // A plain miss: hashes of a prompt nobody saved.
    let never = chunk_hashes(
        &prompt(40 * 16).iter().map(|t| t + 1).collect::<Vec<_>>(),
        &params("x"),
    )
    .unwrap();
    let miss = tenant(counting.clone(), "tenant-b");
    let before = counting.marker_reads.load(Ordering::SeqCst);
    let m = r.block_on(miss.lookup_report(&g, &never)).unwrap();
    let miss_reads = counting.marker_reads.load(Ordering::SeqCst) - before;
    assert_eq!(m.chunks, 0);
    for (name, e, hs) in cases {
        let gets0 = counting.data_gets.load(Ordering::SeqCst);
        let reads0 = counting.marker_reads.load(Ordering::SeqCst);
        let rep = r.block_on(e.lookup_report(&g, &hs)).unwrap();
        let reads = counting.marker_reads.load(Ordering::SeqCst) - reads0;
        assert_eq!(rep.chunks, 0, "{name}: tenant B got a hit on A's prefix");
        assert_eq!(
            (rep.probes, rep.round_trips, reads),
            (m.probes, m.round_trips, miss_reads),
            "{name}: lookup cost differs from a plain miss (a timing side channel)"
        );
        assert_eq!(
            counting.data_gets.load(Ordering::SeqCst),
            gets0,
            "{name}: lookup read data"
        );
        println!(
            "SECURITY|tenant isolation: {name}|1|0 hits; {} probes in {} round trip(s), same as a miss of unsaved hashes",
            rep.probes, rep.round_trips
        );
    }
}

/// Bad keys through the store API: rejected, and nothing appears outside the root.
#[test]
fn keys_cannot_escape_the_root_through_the_store() {
    let outer = tempfile::tempdir().unwrap();
    let root = outer.path().join("root");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(outer.path().join("secret"), b"outside").unwrap();
    let s = FsStore::new(&root, FsyncPolicy::Never).unwrap();
    let r = rt();
    let long = "a/".repeat(600);
    let bad: Vec<&str> = vec![
        "../secret",
        "a/../../secret",
        "/etc/passwd",
        "a//b",
        "./a",
        "a/./b",
        "a\\..\\b",
        "a/\0b",
        "a/\nb",
        "",
        "..",
        "a/..",
        &long,
    ];
    let mut n = 0;
    for k in &bad {
        for op in ["put", "get", "head", "delete"] {
            let res = match op {
                "put" => r.block_on(s.put(k, Bytes::from_static(b"x"))).map(|_| ()),
                "get" => r.block_on(s.get_bytes(k)).map(|_| ()),
                "head" => r.block_on(s.head(k)).map(|_| ()),
                _ => r.block_on(s.delete(k)),
            };
            assert!(
                matches!(res, Err(StoreError::InvalidKey { .. })),
                "{op} {k:?}: {res:?}"
            );
            n += 1;
        }
    }
    // Listing with a prefix that climbs out of the root reveals nothing outside it.
    for p in ["../", "../se", "a/../../", "/"] {
        match r.block_on(s.list(p, 100)) {
            Ok(v) => assert!(v.is_empty(), "list {p:?} escaped the root: {v:?}"),
            Err(e) => assert!(
                matches!(e, StoreError::InvalidKey { .. }),
                "list {p:?}: {e}"
            ),
        }
        n += 1;
    }
    assert_eq!(
        std::fs::read(outer.path().join("secret")).unwrap(),
        b"outside"
    );
    let names: Vec<_> = std::fs::read_dir(outer.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names.len(),
        2,
        "something was written outside the root: {names:?}"
    );
    println!("SECURITY|bad keys through the fs store (put, get, head, delete, list)|{n}|all rejected as InvalidKey or empty; nothing outside the root read or written");
}

/// Bad namespaces and hashes through the engine, its configuration and the command line.
#[test]
fn namespaces_and_hashes_cannot_inject_path_segments() {
    let dir = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let mut n = 0;
    for ns in [
        "..",
        "../x",
        "a/../b",
        "/abs",
        "a//b",
        "a\\b",
        "a b",
        "ns/./x",
        "",
        &"n".repeat(200),
    ] {
        let cfg = EngineConfig {
            namespace: ns.to_string(),
            ..EngineConfig::default()
        };
        assert!(
            Engine::with_store(fs.clone(), cfg).is_err(),
            "namespace {ns:?} accepted"
        );
        assert!(
            EngineConfig::from_pairs([("namespace", ns)]).is_err(),
            "namespace {ns:?} accepted by config"
        );
        n += 2;
    }
    for h in ["", "../", "zz", &"ab".repeat(65)] {
        assert!(ChunkHash::from_hex(h).is_err(), "hash {h:?} accepted");
        n += 1;
    }
    assert!(ChunkHash::new(&[0u8; 65]).is_err());
    assert!(ChunkHash::new(&[]).is_err());
    n += 2;
    // The command line: a prefix that climbs out of the store.
    let bin = env!("CARGO_BIN_EXE_objectcache");
    let root = dir.path().join("r");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(dir.path().join("ns-kv-ab"), b"x").unwrap();
    for args in [
        vec!["stat", "--prefix", "../", "--json"],
        vec!["gc", "--prefix", "../", "--grace-s", "0", "--json"],
    ] {
        let mut c = std::process::Command::new(bin);
        c.args(&args).args(["--store", root.to_str().unwrap()]);
        let out = c.output().unwrap();
        let txt = String::from_utf8_lossy(&out.stdout);
        assert!(
            !txt.contains("ns-kv-ab"),
            "{args:?} saw outside the root: {txt}"
        );
        n += 1;
    }
    assert!(dir.path().join("ns-kv-ab").exists());
    println!("SECURITY|bad namespaces, hashes and CLI prefixes|{n}|all rejected; nothing outside the root listed or deleted");
}

/// Counts and sizes are bounded: a listing larger than the bound is refused, not collected.
#[test]
fn collection_refuses_unbounded_listings() {
    let dir = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let r = rt();
    for i in 0..20 {
        r.block_on(fs.put(
            &format!("n/v1/f/tp0-1/a/kv/{i:02x}"),
            Bytes::from_static(b"x"),
        ))
        .unwrap();
    }
    let pol = objectcache::lifecycle::Policy {
        max_objects: 10,
        grace: Duration::ZERO,
        ..Default::default()
    };
    let e = r
        .block_on(objectcache::lifecycle::collect(
            fs.as_ref(),
            &pol,
            std::time::SystemTime::now(),
            None,
            None,
        ))
        .unwrap_err();
    assert!(e.to_string().contains("more than 10 objects"), "{e}");
    assert_eq!(
        r.block_on(fs.list("", 100)).unwrap().len(),
        20,
        "nothing deleted"
    );
    println!("SECURITY|listing above max_objects|1|refused with an error naming the bound; nothing deleted");
}
