//! The node tier (`TieredStore`): a DRAM and a disk level of chunk objects in front of a
//! remote store. Checked on real stores (the remote: the in-memory store, counted; the disk
//! level: real files) and through a real server in gateway mode:
//!
//! - the storage conformance suite passes through the tier;
//! - 32 concurrent reads of one chunk fetch it from the remote store once (single-flight), and
//!   the next reads are DRAM hits; byte for byte;
//! - each level stays within its bytes, evicting the least recently used; a DRAM miss is a
//!   disk hit;
//! - admission `second` keeps an object only on its second request;
//! - a restarted tier finds its disk level, serves it without the remote, and drops a torn
//!   and a corrupt file (served from the remote instead, never the bad bytes);
//! - saves write through: the remote store has the object before the put returns, and the
//!   tier serves it with no fill; a corrupt object from the remote is served (the reader's
//!   checks catch it) but never kept;
//! - a server with the tier in front of its store: 5 loads of one prefix through gather fetch
//!   each chunk from the backend once, and the server's metrics and `objectcache stat
//!   --server` show the tier;
//! - publish markers seen present are remembered (reads and HEADs without the remote store),
//!   absent ones never are, and a delete through the tier forgets at once;
//! - the lookup endpoint for routers answers the longest published prefix and where each
//!   chunk is (DRAM, disk, remote), across key groups, and refuses bad requests by name.

use crate::common::{self, engine, save_prefix, small_geometry};
use crate::gather_util;
use async_trait::async_trait;
use bytes::Bytes;
use objectcache::layout::encode_chunk;
use objectcache::store::{
    Admission, GetOptions, GetResult, MemoryStore, MeteredStore, ObjectMeta, PutOptions, PutResult,
    Store, StoreExt, TierConfig, TieredStore,
};
use objectcache::StoreResult;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The in-memory store, counting the reads that reach it.
#[derive(Debug, Default)]
struct Counted {
    inner: MemoryStore,
    gets: AtomicU64,
}

#[async_trait]
impl Store for Counted {
    fn name(&self) -> &'static str {
        "counted"
    }
    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        // A fetch that takes a moment, so that concurrent misses overlap.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        self.inner.get_opts(key, opts).await
    }
    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult> {
        self.inner.put_opts(key, data, opts).await
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
}

/// A chunk object of 4 layers (8 KiB of slices) whose bytes depend on `seed`, and its key.
fn chunk(seed: u8) -> (String, Bytes) {
    let g = small_geometry("test/tier", 4);
    let layers: Vec<Vec<u8>> = (0..4u8)
        .map(|l| {
            (0..2048u32)
                .map(|i| (i as u8) ^ seed ^ l.wrapping_mul(37))
                .collect()
        })
        .collect();
    let obj = encode_chunk(&g, 16, |l| &layers[l as usize]).unwrap();
    (
        format!("ns/v1/0123/tp0-1/sha256cbor/kv/{seed:02x}"),
        Bytes::from(obj),
    )
}

fn tier(
    remote: Arc<dyn Store>,
    dram: u64,
    disk: Option<(&std::path::Path, u64)>,
    admission: Admission,
) -> TieredStore {
    TieredStore::new(
        remote,
        TierConfig {
            dram_bytes: dram,
            disk_dir: disk.map(|(d, _)| d.to_path_buf()),
            disk_bytes: disk.map_or(0, |(_, b)| b),
            admission,
        },
    )
    .unwrap()
}

mod conformance {
    objectcache::conformance_tests!(async {
        let t = super::tier(
            Arc::new(objectcache::store::MemoryStore::new()),
            1 << 20,
            None,
            objectcache::store::Admission::All,
        );
        Some((t, "tier".to_string()))
    });
    use std::sync::Arc;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_share_one_fill_then_hit_dram() {
    let remote = Arc::new(Counted::default());
    let (k, obj) = chunk(1);
    remote.inner.put(&k, obj.clone()).await.unwrap();
    let t = Arc::new(tier(remote.clone(), 1 << 20, None, Admission::All));
    let reads: Vec<_> = (0..32)
        .map(|i| {
            let (t, k) = (t.clone(), k.clone());
            tokio::spawn(async move {
                // Half whole, half one layer's slice with its CRC.
                if i % 2 == 0 {
                    t.get_bytes(&k).await.unwrap()
                } else {
                    t.get_range(&k, 64..64 + 2052).await.unwrap()
                }
            })
        })
        .collect();
    for (i, r) in reads.into_iter().enumerate() {
        let got = r.await.unwrap();
        let want = if i % 2 == 0 {
            obj.clone()
        } else {
            obj.slice(64..64 + 2052)
        };
        assert_eq!(got, want, "read {i}");
    }
    let st = t.stats();
    println!(
        "TIER|32 concurrent reads of one chunk|remote reads {}|fills {}, shared {}, DRAM hits {}",
        remote.gets.load(Ordering::SeqCst),
        st.fills,
        st.fills_shared,
        st.dram.hits
    );
    assert_eq!(
        remote.gets.load(Ordering::SeqCst),
        1,
        "one fill for every miss"
    );
    assert_eq!(st.fills, 1);
    t.get_bytes(&k).await.unwrap();
    assert_eq!(
        remote.gets.load(Ordering::SeqCst),
        1,
        "then served from DRAM"
    );
    assert_eq!(t.stats().dram.objects, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn levels_stay_within_their_bytes_lru_first_out_and_a_dram_miss_is_a_disk_hit() {
    let remote = Arc::new(Counted::default());
    let objs: Vec<_> = (0..6).map(chunk).collect();
    for (k, o) in &objs {
        remote.inner.put(k, o.clone()).await.unwrap();
    }
    let size = objs[0].1.len() as u64;
    let dir = tempfile::tempdir().unwrap();
    // DRAM holds 2 objects, disk 4.
    let t = tier(
        remote.clone(),
        2 * size,
        Some((dir.path(), 4 * size)),
        Admission::All,
    );
    for (k, o) in &objs {
        assert_eq!(&t.get_bytes(k).await.unwrap(), o);
    }
    let st = t.stats();
    assert!(
        st.dram.bytes <= 2 * size && st.disk.bytes <= 4 * size,
        "{st:?}"
    );
    assert_eq!((st.dram.objects, st.disk.objects), (2, 4));
    assert_eq!(st.dram.evictions, 4);
    assert_eq!(st.disk.evictions, 2);
    let fills = remote.gets.load(Ordering::SeqCst);
    // Object 3: out of DRAM, on disk: a disk hit, no fill, and it moves up to DRAM.
    assert_eq!(t.get_bytes(&objs[3].0).await.unwrap(), objs[3].1);
    assert_eq!(remote.gets.load(Ordering::SeqCst), fills);
    assert_eq!(t.stats().disk.hits, 1);
    // Object 0: evicted from both: filled again.
    assert_eq!(t.get_bytes(&objs[0].0).await.unwrap(), objs[0].1);
    assert_eq!(remote.gets.load(Ordering::SeqCst), fills + 1);
    // An object bigger than a level is refused by it, and still served.
    let small = tier(remote.clone(), size - 1, None, Admission::All);
    assert_eq!(small.get_bytes(&objs[1].0).await.unwrap(), objs[1].1);
    assert_eq!(small.stats().dram.refused, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_markers_are_remembered_and_absent_ones_never_are() {
    let mem = Arc::new(MemoryStore::new());
    let remote = Arc::new(MeteredStore::new(mem.clone()));
    let t = tier(remote.clone(), 1 << 20, None, Admission::All);
    let m = "ns/v1/0123/tp0-1/sha256cbor/pub/01";
    // Absent: asked of the remote store each time, never remembered.
    assert!(t.get_bytes(m).await.is_err());
    assert!(t.head(m).await.is_err());
    assert_eq!(remote.stats().gets, 2);
    // Published behind the tier (another gateway's save): seen at once.
    mem.put(m, Bytes::from_static(b"marker-1")).await.unwrap();
    assert_eq!(t.get_bytes(m).await.unwrap(), &b"marker-1"[..]);
    assert_eq!(remote.stats().gets, 3);
    // Remembered: whole and ranged reads and HEADs without the remote store.
    for _ in 0..5 {
        assert_eq!(t.get_bytes(m).await.unwrap(), &b"marker-1"[..]);
    }
    assert_eq!(t.get_range(m, 2..6).await.unwrap(), &b"rker"[..]);
    assert_eq!(t.head(m).await.unwrap().size, 8);
    assert_eq!(remote.stats().gets, 3, "a remembered marker went remote");
    assert_eq!(t.stats().marker_hits, 7);
    // Written through the tier: remembered from the write, and durable remotely.
    let m2 = "ns/v1/0123/tp0-1/sha256cbor/pub/02";
    t.put(m2, Bytes::from_static(b"marker-2")).await.unwrap();
    assert_eq!(mem.get_bytes(m2).await.unwrap(), &b"marker-2"[..]);
    assert_eq!(t.get_bytes(m2).await.unwrap(), &b"marker-2"[..]);
    assert_eq!(remote.stats().gets, 3);
    assert_eq!(t.stats().markers, 2);
    // Deleted through the tier: gone at once, here and remotely.
    t.delete(m).await.unwrap();
    assert!(t.get_bytes(m).await.is_err());
    assert!(mem.get_bytes(m).await.is_err());
    assert_eq!(t.stats().markers, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_second_keeps_an_object_only_on_its_second_request() {
    let remote = Arc::new(Counted::default());
    let (k, obj) = chunk(7);
    remote.inner.put(&k, obj.clone()).await.unwrap();
    let second = Admission::parse("second:60").unwrap();
    let t = tier(remote.clone(), 1 << 20, None, second);
    assert_eq!(t.get_bytes(&k).await.unwrap(), obj);
    assert_eq!(t.stats().dram.objects, 0, "a first request is not kept");
    assert_eq!(t.get_bytes(&k).await.unwrap(), obj);
    assert_eq!(t.stats().dram.objects, 1, "the second is");
    t.get_bytes(&k).await.unwrap();
    assert_eq!(remote.gets.load(Ordering::SeqCst), 2);
    let e = Admission::parse("often").unwrap_err();
    assert_eq!((e.setting, e.value.as_str()), ("tier admission", "often"));
    assert!(e.to_string().contains("second:SECONDS"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_tier_finds_its_disk_level_and_drops_torn_and_corrupt_files() {
    let remote = Arc::new(Counted::default());
    let objs: Vec<_> = (10..14).map(chunk).collect();
    for (k, o) in &objs {
        remote.inner.put(k, o.clone()).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    {
        let t = tier(
            remote.clone(),
            0,
            Some((dir.path(), 1 << 20)),
            Admission::All,
        );
        for (k, _) in &objs {
            t.get_bytes(k).await.unwrap();
        }
        assert_eq!(t.stats().disk.objects, 4);
    }
    // Object 0 torn (cut short), object 1 corrupt (one byte flipped), and a leftover
    // temporary file of a write that never finished.
    let p0 = dir.path().join(&objs[0].0);
    let len = std::fs::metadata(&p0).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p0)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let p1 = dir.path().join(&objs[1].0);
    let mut b = std::fs::read(&p1).unwrap();
    b[1000] ^= 0x5a;
    std::fs::write(&p1, b).unwrap();
    std::fs::write(p0.with_file_name(".tier-tmp-1-1"), b"partial").unwrap();
    let before = remote.gets.load(Ordering::SeqCst);
    let t = tier(
        remote.clone(),
        0,
        Some((dir.path(), 1 << 20)),
        Admission::All,
    );
    let st = t.stats();
    println!(
        "TIER|restart with 4 files, 1 torn, 1 corrupt|recovered {}, dropped {}|",
        st.disk_recovered, st.disk_dropped
    );
    assert_eq!((st.disk_recovered, st.disk_dropped), (2, 2));
    assert!(!p0.with_file_name(".tier-tmp-1-1").exists());
    // The two good files are served from disk; the two bad ones from the remote (good bytes).
    for (k, o) in &objs {
        assert_eq!(&t.get_bytes(k).await.unwrap(), o, "{k}");
    }
    assert_eq!(remote.gets.load(Ordering::SeqCst) - before, 2);
    assert_eq!(t.stats().disk.hits, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saves_write_through_and_a_corrupt_remote_object_is_served_never_kept() {
    let remote = Arc::new(Counted::default());
    let t = tier(remote.clone(), 1 << 20, None, Admission::All);
    let (k, obj) = chunk(20);
    t.put(&k, obj.clone()).await.unwrap();
    assert_eq!(
        remote.inner.get_bytes(&k).await.unwrap(),
        obj,
        "durable remotely on return"
    );
    assert_eq!(t.get_bytes(&k).await.unwrap(), obj);
    assert_eq!(
        remote.gets.load(Ordering::SeqCst),
        0,
        "served by the tier, no fill"
    );
    // First writer wins remotely: a second create-only put of other bytes is refused and
    // the tier keeps the first.
    let (_, other) = chunk(21);
    assert!(t.put_if_absent(&k, other).await.is_ok());
    assert_eq!(t.get_bytes(&k).await.unwrap(), obj);
    // A corrupt object in the remote store: served (the reader checks every slice and sees
    // a miss), not kept.
    let (k2, good) = chunk(22);
    let mut bad = good.to_vec();
    bad[500] ^= 1;
    remote
        .inner
        .put(&k2, Bytes::from(bad.clone()))
        .await
        .unwrap();
    assert_eq!(t.get_bytes(&k2).await.unwrap(), Bytes::from(bad));
    let st = t.stats();
    assert_eq!((st.fills_corrupt, st.dram.objects), (1, 1));
    // Keys that are not chunk objects (markers) pass through and are never kept.
    let marker = "ns/v1/0123/tp0-1/sha256cbor/pub/16";
    t.put(marker, Bytes::from_static(b"m")).await.unwrap();
    t.get_bytes(marker).await.unwrap();
    t.get_bytes(marker).await.unwrap();
    assert_eq!(t.stats().dram.objects, 1);
}

#[test]
fn a_server_with_the_tier_fetches_each_chunk_from_its_backend_once() {
    let rt = common::shared_rt();
    let backend = Arc::new(Counted::default());
    let dir = tempfile::tempdir().unwrap();
    let t = Arc::new(tier(
        backend.clone(),
        64 << 20,
        Some((dir.path(), 64 << 20)),
        Admission::All,
    ));
    let server = rt
        .block_on(objectcache::server::start_with_tier(
            gather_util::config(),
            t.clone(),
        ))
        .unwrap();
    let store = rt.block_on(gather_util::s3_store_on(&server.endpoint()));
    let g = small_geometry("test/tier-server", 6);
    let e = engine(store, &common::unique_ns("tier-server"));
    let chunks = 12;
    let (hs, data) = save_prefix(&e, &g, chunks, 5);
    let gets_after_save = backend.gets.load(Ordering::SeqCst);
    for round in 0..5 {
        let h = common::start_load(&e, &g, hs.clone(), data[0].len());
        common::assert_layers_exact(&h, &data);
        assert!(h.stats().requests >= 1, "round {round}");
    }
    let chunk_reads = backend.gets.load(Ordering::SeqCst) - gets_after_save;
    let st = t.stats();
    println!(
        "TIER|server, 5 gather loads of 12 chunks saved through it|backend chunk reads {chunk_reads}|fills {}, DRAM hits {}",
        st.fills, st.dram.hits
    );
    // Saved through the tier: every chunk is in it already; no load reads the backend.
    assert_eq!(st.fills, 0, "{st:?}");
    assert!(st.dram.hits >= 5 * chunks as u64, "{st:?}");
    let (code, text) = rt.block_on(gather_util::http_get(
        server.local_addr(),
        "/_objectcache/metrics",
    ));
    assert_eq!(code, 200);
    assert!(
        text.contains("objectcache_tier_hits_total{level=\"dram\"}"),
        "{text}"
    );
    assert!(text.trim_end().ends_with("# EOF"));
    // `objectcache stat --server` shows the same counters.
    let bin = env!("CARGO_BIN_EXE_objectcache");
    let addr = server.local_addr().to_string();
    let out =
        common::run_ok(std::process::Command::new(bin).args(["stat", "--server", &addr, "--json"]));
    let shown: objectcache::store::TierStats = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown, t.stats());
    let out = common::run_ok(std::process::Command::new(bin).args(["stat", "--server", &addr]));
    let table = String::from_utf8_lossy(&out.stdout);
    let dram_row = table
        .lines()
        .find(|l| l.starts_with("dram"))
        .expect("a DRAM row");
    assert!(dram_row.contains(&st.dram.hits.to_string()), "{table}");
    rt.block_on(server.shutdown());
    // A server without a tier, or one gone, is an error that names it.
    let plain = rt.block_on(gather_util::start(
        Arc::new(MemoryStore::new()),
        gather_util::config(),
    ));
    let plain_addr = plain.local_addr().to_string();
    for (a, why) in [(&plain_addr, "no node tier"), (&addr, "")] {
        let out = std::process::Command::new(bin)
            .args(["stat", "--server", a])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{a}");
        assert!(err.contains(a.as_str()) && err.contains(why), "{err}");
    }
    rt.block_on(plain.shutdown());
}

/// The body of a lookup response, parsed.
fn answer(code_body: (u16, String)) -> serde_json::Value {
    assert_eq!(code_body.0, 200, "{}", code_body.1);
    serde_json::from_str(&code_body.1).unwrap()
}

#[test]
fn a_router_asks_which_leading_chunks_are_stored_and_in_which_tier() {
    let rt = common::shared_rt();
    let backend = Arc::new(Counted::default());
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = gather_util::config();
    cfg.lookup_http = true;
    let start = |dram: u64| {
        let t = Arc::new(tier(
            backend.clone(),
            dram,
            Some((dir.path(), 64 << 20)),
            Admission::All,
        ));
        let s = rt
            .block_on(objectcache::server::start_with_tier(cfg.clone(), t.clone()))
            .unwrap();
        (t, s)
    };
    let (t, server) = start(64 << 20);
    let store = rt.block_on(gather_util::s3_store_on(&server.endpoint()));
    let g = small_geometry("test/tier-lookup", 4);
    let e = engine(store, &common::unique_ns("tier-lookup"));
    let (hs, data) = save_prefix(&e, &g, 6, 9);
    // The key group as `objectcache stat` names it against the server's store.
    let keys = rt.block_on(backend.list("", 1000)).unwrap();
    let marker = keys
        .iter()
        .map(|m| m.key.clone())
        .find(|k| k.contains("/pub/"))
        .expect("a publish marker");
    let group = marker.split("/pub/").next().unwrap().to_string();
    let hex: Vec<String> = hs.iter().map(|h| h.to_hex()).collect();
    let ask = |addr, groups: &[&str], hashes: &[String]| {
        let body = serde_json::json!({ "groups": groups, "hashes": hashes }).to_string();
        rt.block_on(gather_util::http_post(addr, "/_objectcache/lookup", &body))
    };
    // Saved through the tier: all six in DRAM; two unknown hashes after them are not counted.
    let mut longer = hex.clone();
    longer.extend(["ab".repeat(32), "cd".repeat(32)]);
    let a = answer(ask(server.local_addr(), &[&group], &longer));
    assert_eq!(a["chunks"], 6, "{a}");
    assert_eq!(a["asked"], 8, "{a}");
    assert_eq!(a["tiers"], serde_json::json!(vec!["dram"; 6]), "{a}");
    // A chunk counts only when every group has it (a second TP rank that saved nothing).
    let other = format!("{group}-rank1");
    assert_eq!(
        answer(ask(server.local_addr(), &[&group, &other], &hex))["chunks"],
        0
    );
    // A marker deleted behind the tier (in the remote store itself) is remembered for
    // MARKER_TTL (docs/deployment.md); one deleted through the tier ends the prefix there at
    // once.
    let m3 = format!("{group}/pub/{}", hex[3]);
    let kept = rt.block_on(backend.get_bytes(&m3)).unwrap();
    rt.block_on(backend.delete(&m3)).unwrap();
    assert_eq!(
        answer(ask(server.local_addr(), &[&group], &hex))["chunks"],
        6
    );
    rt.block_on(t.delete(&m3)).unwrap();
    assert_eq!(
        answer(ask(server.local_addr(), &[&group], &hex))["chunks"],
        3
    );
    rt.block_on(backend.put(&m3, kept)).unwrap();
    // A restarted server with no DRAM: the disk level answers for every chunk.
    drop(server);
    let (_t, server) = start(0);
    let a = answer(ask(server.local_addr(), &[&group], &hex));
    assert_eq!(a["tiers"], serde_json::json!(vec!["disk"; 6]), "{a}");
    // The disk level emptied: every chunk is read from the remote store.
    drop(server);
    std::fs::remove_dir_all(dir.path()).unwrap();
    let (_t, server) = start(64 << 20);
    let post = |body: &str| {
        rt.block_on(gather_util::http_post(
            server.local_addr(),
            "/_objectcache/lookup",
            body,
        ))
    };
    let body = serde_json::json!({ "groups": [&group], "hashes": &hex }).to_string();
    let a = answer(post(&body));
    assert_eq!(a["tiers"], serde_json::json!(vec!["remote"; 6]), "{a}");
    // After one load through the server, DRAM again; the bytes are the saved ones.
    let store = rt.block_on(gather_util::s3_store_on(&server.endpoint()));
    let e = engine(store, e.config().namespace.as_str());
    let h = common::start_load(&e, &g, hs.clone(), data[0].len());
    common::assert_layers_exact(&h, &data);
    let a = answer(post(&body));
    assert_eq!(a["tiers"], serde_json::json!(vec!["dram"; 6]), "{a}");
    // Bad requests are refused, naming what was wrong.
    let (code, msg) = post(r#"{"groups": ["a/b"], "hashes": ["00", "xyz"]}"#);
    assert_eq!(code, 400, "{msg}");
    assert!(msg.contains("hashes[1]"), "{msg}");
    let (code, msg) = post(r#"{"groups": [], "hashes": []}"#);
    assert_eq!(code, 400, "{msg}");
    assert!(msg.contains("groups"), "{msg}");
    let (code, msg) = post(r#"{"groups": ["a/../b"], "hashes": ["00"]}"#);
    assert_eq!(code, 400, "{msg}");
    let many = serde_json::json!({ "groups": vec![&group; 8], "hashes": vec!["ab"; 4096] });
    let (code, msg) = post(&many.to_string());
    assert_eq!(code, 400, "{msg}");
    assert!(msg.contains("publish markers"), "{msg}");
    let (code, msg) = post(r#"{"group": "a", "hashes": []}"#);
    assert_eq!(code, 400, "{msg}");
    assert!(msg.contains("unknown field"), "{msg}");
    drop(server);
    // Off unless the setting is on.
    let t = Arc::new(tier(backend.clone(), 1 << 20, None, Admission::All));
    let off = rt
        .block_on(objectcache::server::start_with_tier(
            gather_util::config(),
            t,
        ))
        .unwrap();
    let (code, msg) = rt.block_on(gather_util::http_post(
        off.local_addr(),
        "/_objectcache/lookup",
        &body,
    ));
    assert_eq!(code, 404, "{msg}");
    assert!(msg.contains("lookup_http"), "{msg}");
}
