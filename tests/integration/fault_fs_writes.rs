//! Case C10: a failed write must never become a visible entry (embedded filesystem store).
//!
//! Runs: (1) two processes save the same prefix at once, one of them under a 4 MiB file-size
//! limit, so each of its writes fails with an I/O error (`EFBIG`) after 4 MiB; (2) a
//! directory already sits at one chunk's final path; (3) a 4-chunk save whose third chunk's
//! write fails after 4 MiB; (4) a writer process killed in the middle of a write. Each time:
//! every object a reader can see has its full length and passes every layer CRC32C; lookup
//! stops before the first chunk that failed; the same holds in a fresh process over the same
//! directory; nothing is left behind that `stat` does not count or `gc` cannot reach.

use crate::common;

use async_trait::async_trait;
use bytes::Bytes;
use common::*;
use futures::StreamExt;
use objectcache::error::{StoreError, StoreResult};
use objectcache::layout::{decode_chunk, ChunkHash};
use objectcache::lifecycle::{collect, Inventory, Policy, Reason};
use objectcache::store::{
    ByteStream, FsStore, FsyncPolicy, GetOptions, GetResult, ObjectMeta, PartialWrite, PutOptions,
    PutResult, Store,
};
use objectcache::{Dtype, KvGeometry};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

const NS: &str = "c10";
const CHUNKS: usize = 4;

/// 8 layers of 1 MiB slices: 8 MiB objects, twice the failing writer's file-size limit.
fn geometry() -> KvGeometry {
    KvGeometry::new("test/c10", 8, 8, 128, Dtype::Fp16).unwrap()
}

fn fs(dir: &Path) -> Arc<dyn Store> {
    Arc::new(FsStore::new(dir, FsyncPolicy::Never).unwrap())
}

fn prefix(g: &KvGeometry) -> (Vec<ChunkHash>, Vec<Vec<u8>>) {
    (hashes(g, CHUNKS * 256, 10), kv(g, CHUNKS, 10))
}

/// Saves the prefix `hs`, `data` through `store`, which must fail with an error whose text
/// contains `needle`; returns the error.
fn save_fails(
    store: &Arc<dyn Store>,
    g: &KvGeometry,
    hs: &[ChunkHash],
    data: &[Vec<u8>],
    needle: &str,
) -> objectcache::Error {
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    let e = engine(store.clone(), NS)
        .save_blocking(g, hs, &refs)
        .unwrap_err();
    assert!(e.to_string().contains(needle), "{e}");
    e
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Every object a reader can see under the namespace is whole and verifies; returns how
/// many data objects there are.
fn visible_objects_verify(store: &Arc<dyn Store>, g: &KvGeometry) -> usize {
    let rt = rt();
    let mut n = 0;
    for m in rt.block_on(store.list(&format!("{NS}/"), 10_000)).unwrap() {
        if m.key.contains("/kv/") {
            let b = rt
                .block_on(objectcache::store::StoreExt::get_bytes(
                    store.as_ref(),
                    &m.key,
                ))
                .unwrap();
            decode_chunk(g, 256, &b)
                .unwrap_or_else(|e| panic!("{} is visible but bad: {e}", m.key));
            n += 1;
        }
    }
    n
}

/// Lookup in a fresh engine (a fresh process's view) and, where it hits, a byte-exact load.
fn lookup_and_load(store: &Arc<dyn Store>, g: &KvGeometry) -> usize {
    let (hs, data) = prefix(g);
    let e = engine(store.clone(), NS);
    let hit = e.lookup_blocking(g, &hs).unwrap();
    if hit > 0 {
        let h = load_first(&e, g, &hs, hit);
        for l in 0..g.layers as usize {
            assert!(
                h.layer(l).unwrap() == &data[l][..hit * g.slice_bytes() as usize],
                "layer {l}"
            );
        }
    }
    hit
}

/// What stat sees, then gc with a zero grace period: afterwards nothing but the published
/// entries remains.
fn stat_then_gc(dir: &Path) -> (objectcache::lifecycle::Stats, usize) {
    let store = fs(dir);
    let rt = rt();
    let st = rt
        .block_on(Inventory::scan(store.as_ref(), "", 1_000_000))
        .unwrap()
        .stats();
    let policy = Policy {
        grace: Duration::ZERO,
        ..Policy::default()
    };
    let rep = rt
        .block_on(collect(
            store.as_ref(),
            &policy,
            SystemTime::now(),
            None,
            None,
        ))
        .unwrap();
    assert!(rep.errors.is_empty(), "{:?}", rep.errors);
    let after = rt
        .block_on(Inventory::scan(store.as_ref(), "", 1_000_000))
        .unwrap()
        .stats();
    assert_eq!(
        (
            after.unreferenced_data,
            after.orphan_markers,
            after.partial_writes
        ),
        (0, 0, 0),
        "{after:?}"
    );
    (st, rep.deleted.len())
}

/// Spawns this test binary as a writer process (`role`), its SIGXFSZ ignored so that a
/// write past its file-size limit fails with `EFBIG` instead of killing it.
fn writer_process(dir: &Path, role: &str) -> std::process::Child {
    Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; exec \"$0\" \"$1\" --exact --nocapture --test-threads 1")
        .arg(std::env::current_exe().unwrap())
        .arg(common::exact_test_name(
            module_path!(),
            "c10_writer_process",
        ))
        .env("C10_WRITER_DIR", dir)
        .env("C10_WRITER_ROLE", role)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// The writer processes' entry point (see [`writer_process`]); in a plain test run (no
/// `C10_WRITER_DIR`) it has nothing to do. Role `limited`: saves the prefix under a 4 MiB
/// file-size limit and prints the outcome. Role `hang`: starts a streamed write, sends
/// 4 MiB, then waits to be killed.
#[test]
fn c10_writer_process() {
    let Some(dir) = std::env::var_os("C10_WRITER_DIR") else {
        return;
    };
    let g = geometry();
    let store = fs(Path::new(&dir));
    match std::env::var("C10_WRITER_ROLE").as_deref() {
        Ok("limited") => {
            use rustix::process::{setrlimit, Resource, Rlimit};
            setrlimit(
                Resource::Fsize,
                Rlimit {
                    current: Some(4 << 20),
                    maximum: Some(4 << 20),
                },
            )
            .unwrap();
            let (hs, data) = prefix(&g);
            let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            match engine(store, NS).save_blocking(&g, &hs, &refs) {
                Ok(r) => println!("C10-WRITER|ok|{r:?}"),
                Err(e) => println!("C10-WRITER|err|{e}"),
            }
        }
        Ok("hang") => rt().block_on(async {
            let body = futures::stream::iter([Ok(Bytes::from(vec![1u8; 4 << 20]))])
                .chain(futures::stream::pending())
                .boxed();
            println!("C10-WRITER|writing");
            let _ = store
                .put_stream(&format!("{NS}/hang/obj"), body, None, PutOptions::default())
                .await;
        }),
        other => panic!("unknown role {other:?}"),
    }
}

#[test]
fn run1_two_writers_one_failing_mid_write() {
    let g = geometry();
    let dir = tempfile::tempdir().unwrap();
    let store = fs(dir.path());
    let child = writer_process(dir.path(), "limited");
    let (hs, data) = prefix(&g);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    engine(store.clone(), NS)
        .save_blocking(&g, &hs, &refs)
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("C10-WRITER|err|"),
        "the limited writer did not fail: {said}"
    );
    assert!(
        said.contains("File too large") || said.contains("os error 27"),
        "{said}"
    );
    assert_eq!(visible_objects_verify(&store, &g), CHUNKS);
    assert_eq!(lookup_and_load(&fs(dir.path()), &g), CHUNKS);
    let (st, deleted) = stat_then_gc(dir.path());
    assert_eq!(
        (st.published, st.partial_writes, deleted),
        (CHUNKS as u64, 0, 0),
        "{st:?}"
    );
    println!("C10|run 1: two writers, one failing with EFBIG after 4 MiB of each 8 MiB object|the failing writer got 'File too large'; {CHUNKS} of {CHUNKS} objects whole and verified; lookup {CHUNKS} and byte-exact in a fresh process; nothing left behind");
}

#[test]
fn run2_a_directory_at_a_chunks_path() {
    let g = geometry();
    let dir = tempfile::tempdir().unwrap();
    let store = fs(dir.path());
    let (hs, data) = prefix(&g);
    let keys = engine(store.clone(), NS).keys(&g).unwrap();
    let blocked = dir.path().join(keys.data(&hs[1]));
    std::fs::create_dir_all(blocked.join("x")).unwrap();
    let e = save_fails(&store, &g, &hs, &data, "a prefix of other keys");
    let visible = visible_objects_verify(&store, &g);
    let hit = lookup_and_load(&fs(dir.path()), &g);
    assert!(
        hit <= 1,
        "lookup reports {hit} chunks across the failed one"
    );
    let (st, deleted) = stat_then_gc(dir.path());
    assert_eq!(st.partial_writes, 0, "{st:?}");
    assert_eq!(st.unreferenced_data as usize, visible, "{st:?}");
    println!("C10|run 2: a directory at chunk 1's path|save fails naming it ({e}); {visible} other objects whole, counted unreferenced by stat, deleted by gc ({deleted}); lookup {hit}");
}

/// A store whose write of one key fails after 4 MiB (the filesystem store's own writer, cut
/// by an I/O error).
#[derive(Debug)]
struct FailOne {
    inner: Arc<dyn Store>,
    key: String,
}

#[async_trait]
impl Store for FailOne {
    fn name(&self) -> &'static str {
        "fail-one"
    }
    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
        self.inner.get_opts(key, opts).await
    }
    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult> {
        if key != self.key {
            return self.inner.put_opts(key, data, opts).await;
        }
        let len = data.len() as u64;
        let body: ByteStream = futures::stream::iter([
            Ok(data.slice(..4 << 20)),
            Err(StoreError::other(
                "fs",
                "No space left on device (os error 28)",
            )),
        ])
        .boxed();
        self.inner.put_stream(key, body, Some(len), opts).await
    }
    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        self.inner.head(key).await
    }
    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>> {
        self.inner.list(prefix, limit).await
    }
    async fn list_partial(&self, prefix: &str) -> StoreResult<Vec<PartialWrite>> {
        self.inner.list_partial(prefix).await
    }
}

#[test]
fn run3_the_third_chunk_fails_mid_write() {
    let g = geometry();
    let dir = tempfile::tempdir().unwrap();
    let (hs, data) = prefix(&g);
    let keys = engine(fs(dir.path()), NS).keys(&g).unwrap();
    let store: Arc<dyn Store> = Arc::new(FailOne {
        inner: fs(dir.path()),
        key: keys.data(&hs[2]),
    });
    let e = save_fails(&store, &g, &hs, &data, "No space left");
    let visible = visible_objects_verify(&store, &g);
    assert!(visible < CHUNKS, "the failed chunk is visible");
    let hit = lookup_and_load(&fs(dir.path()), &g);
    assert!(
        hit <= 2,
        "lookup reports {hit} chunks across the failed third"
    );
    let (st, deleted) = stat_then_gc(dir.path());
    assert_eq!(
        st.partial_writes, 0,
        "the failed write left its temporary file: {st:?}"
    );
    println!("C10|run 3: a 4-chunk save whose third chunk fails after 4 MiB|save fails ({e}); {visible} objects whole and verified, the third absent, no temporary file; lookup {hit}; gc deleted {deleted} unreferenced");
}

#[test]
fn run4_a_writer_killed_mid_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = fs(dir.path());
    let mut child = writer_process(dir.path(), "hang");
    let rt = rt();
    let t0 = Instant::now();
    let p = loop {
        let found = rt.block_on(store.list_partial("")).unwrap();
        if let Some(p) = found.into_iter().find(|p| p.size == 4 << 20) {
            break p;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the writer never wrote 4 MiB"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(!p.orphaned, "its writer still runs");
    child.kill().unwrap();
    child.wait().unwrap();
    // A fresh process's view: the object is absent; its temporary file is counted by stat
    // and orphaned; gc reclaims it whatever the grace period.
    let store = fs(dir.path());
    assert!(!rt
        .block_on(objectcache::store::StoreExt::exists(
            store.as_ref(),
            &format!("{NS}/hang/obj")
        ))
        .unwrap());
    let inv = rt
        .block_on(Inventory::scan(store.as_ref(), "", 1000))
        .unwrap();
    let st = inv.stats();
    assert_eq!(
        (st.partial_writes, st.partial_bytes),
        (1, 4 << 20),
        "{st:?}"
    );
    assert!(inv.partial[0].orphaned, "{:?}", inv.partial);
    let rep = rt
        .block_on(collect(
            store.as_ref(),
            &Policy::default(),
            SystemTime::now(),
            None,
            None,
        ))
        .unwrap();
    assert_eq!(rep.count(Reason::PartialWrite), 1, "{rep:?}");
    assert!(rt.block_on(store.list_partial("")).unwrap().is_empty());
    println!("C10|run 4: a writer process killed after 4 MiB of a streamed write|object absent; stat counts 1 incomplete write of 4 MiB (orphaned); gc with the default 1 h grace reclaims it at once");
}
