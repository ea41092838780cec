//! The server's S3 API: the storage conformance suite through `S3Store` against an
//! in-process server (on the memory backend, and on the filesystem backend, whose GET bodies
//! are mapped from the object files); a GET body keeps the bytes of the object it started on
//! while the object is replaced and deleted; SigV4 with wrong keys; gateway mode (a server
//! whose backend is another server's S3 API) serving gather byte-exact.
#![cfg(feature = "s3")]

use crate::common;
use crate::gather_util;

use gather_util::*;
use objectcache::layout::KvGeometry;
use objectcache::store::{
    FsStore, FsyncPolicy, GetOptions, MemoryStore, S3Config, S3Store, Store, StoreExt,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

async fn s3_client(endpoint: &str, bucket: &str, secret: &str) -> S3Store {
    s3_client_tries(endpoint, bucket, secret, 1).await
}

/// [`s3_client`] trying each request up to `max_attempts` times.
async fn s3_client_tries(endpoint: &str, bucket: &str, secret: &str, max_attempts: u32) -> S3Store {
    let mut cfg = S3Config::at_endpoint(bucket, endpoint.to_string(), ACCESS, secret);
    cfg.max_attempts = max_attempts;
    S3Store::new(cfg).await.expect("S3 client")
}

/// A server on the filesystem backend in a new temporary directory (kept while the returned
/// directory is), and an S3 client of it with the test bucket and keys.
async fn server_on_files() -> (
    tempfile::TempDir,
    objectcache::server::ServerHandle,
    S3Store,
) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = FsStore::new(dir.path(), FsyncPolicy::Never).expect("store");
    let server = start(Arc::new(store), config()).await;
    let s = s3_client(&server.endpoint(), BUCKET, SECRET).await;
    (dir, server, s)
}

/// A server in-process (kept running for the rest of the test) and an S3 client on it.
async fn served() -> Option<(S3Store, String)> {
    let server = start(Arc::new(MemoryStore::new()), config()).await;
    // Two attempts, so that ranged reads into place (`range_body`) are offered.
    let s = s3_client_tries(&server.endpoint(), BUCKET, SECRET, 2).await;
    std::mem::forget(server);
    Some((s, "conf".to_string()))
}

mod conformance_through_server {
    objectcache::conformance_tests!(super::served());
}

/// Our server's S3 API answers presigned ranged GETs, so a load's bodies are read into place
/// (`Store::get_range_body`), on both of its backends' GET bodies (pieces of the object in
/// memory, and a file's mapped pages).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presigned_ranged_gets_are_read_into_place() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fs = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).expect("store"));
    for backend in [Arc::new(MemoryStore::new()) as Arc<dyn Store>, fs] {
        let server = start(backend, config()).await;
        // The direct path needs a second attempt to fall back on (`S3Config::max_attempts`).
        let s = s3_client_tries(&server.endpoint(), BUCKET, SECRET, 2).await;
        let d: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        s.put("direct/obj", d.clone().into()).await.unwrap();
        for r in [0..200_000u64, 3..70_003] {
            let mut b = s
                .get_range_body("direct/obj", r.clone())
                .await
                .unwrap()
                .expect("the server declined a presigned ranged GET");
            let mut got = vec![0u8; (r.end - r.start) as usize];
            let mut at = 0;
            while at < got.len() {
                at += b.read(&mut got[at..]).await.unwrap();
            }
            assert!(got == d[r.start as usize..r.end as usize], "range {r:?}");
        }
        server.shutdown().await;
    }
}

/// The conformance suite through a server on the filesystem backend: its GET bodies are the
/// object files' pages, mapped (pieces of 64 KiB and more), or read (smaller ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_through_a_server_on_files() {
    let (_dir, server, s) = server_on_files().await;
    objectcache::store::conformance::run_all(&s, "conf").await;
    server.shutdown().await;
}

/// A GET body from the filesystem backend is the object as it was when the GET opened it:
/// replacing the object and then deleting it while the body is being read changes none of
/// the bytes that arrive (the server maps its pieces from the file it opened, whose inode
/// outlives both the rename over its name and the unlink).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_body_from_files_survives_replacement_and_deletion() {
    use futures::StreamExt;
    let (_dir, server, s) = server_on_files().await;
    let n = 40 << 20;
    let old: Vec<u8> = (0..n).map(|i: usize| (i * 31 + i / 8191) as u8).collect();
    s.put("swap/obj", bytes::Bytes::from(old.clone()))
        .await
        .unwrap();
    for range in [None, Some(3..(n as u64 - 5))] {
        let g = s
            .get_opts(
                "swap/obj",
                GetOptions {
                    range: range.clone(),
                },
            )
            .await
            .unwrap();
        let want = match &range {
            Some(r) => &old[r.start as usize..r.end as usize],
            None => &old[..],
        };
        let mut body = g.body;
        let mut got = Vec::with_capacity(want.len());
        got.extend_from_slice(&body.next().await.unwrap().unwrap());
        // Replaced (a rename over its name), then deleted, with most of the body unread.
        s.put("swap/obj", bytes::Bytes::from(vec![0xA5u8; n]))
            .await
            .unwrap();
        s.delete("swap/obj").await.unwrap();
        while let Some(piece) = body.next().await {
            got.extend_from_slice(&piece.unwrap());
        }
        assert!(
            got == want,
            "range {range:?}: the body changed under the reader"
        );
        s.put("swap/obj", bytes::Bytes::from(old.clone()))
            .await
            .unwrap();
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigv4_rejects_bad_credentials() {
    let server = start(Arc::new(MemoryStore::new()), config()).await;
    let good = s3_client(&server.endpoint(), BUCKET, SECRET).await;
    good.put("k", bytes::Bytes::from_static(b"v"))
        .await
        .unwrap();
    let bad = s3_client(&server.endpoint(), BUCKET, "wrong-secret").await;
    let e = bad.get_bytes("k").await.unwrap_err();
    assert!(
        matches!(e, objectcache::StoreError::PermissionDenied { .. }),
        "{e:?}"
    );
    let e = bad
        .put("k2", bytes::Bytes::from_static(b"v"))
        .await
        .unwrap_err();
    assert!(
        matches!(e, objectcache::StoreError::PermissionDenied { .. }),
        "{e:?}"
    );
    assert!(!good.exists("k2").await.unwrap());
    // Unauthenticated HTTP is refused too.
    let (st, _) = http_get(server.local_addr(), &format!("/{BUCKET}/k")).await;
    assert_eq!(st, 403);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_mode_over_an_upstream_s3_endpoint() {
    // Upstream: a server holding the bytes. Gateway: a stateless server whose backend is the
    // upstream's S3 API; gather through the gateway is byte-exact.
    let upstream_store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mut ucfg = config();
    ucfg.buckets = vec!["upstream".into()];
    let upstream = start(upstream_store.clone(), ucfg).await;
    let backend: Arc<dyn Store> =
        Arc::new(s3_client(&upstream.endpoint(), "upstream", SECRET).await);
    let gateway = start(backend, config()).await;
    let g = KvGeometry::llama31_8b();
    let tokens = vec![256u32; 16];
    let mut c = gather_client(gateway.local_addr()).await;
    save_prefix(&mut c, &g, 21, &tokens).await;
    // The bytes live upstream.
    let kb = key_builder(&g);
    let k = format!("{BUCKET}/{}", kb.data(&hashes(21, 16)[0]));
    assert_eq!(
        upstream_store
            .get_bytes(&format!("upstream/{k}"))
            .await
            .unwrap(),
        object(&g, 21, 0, 256)
    );
    let sink = VerifySink::new(&g, 21, &tokens);
    let r = c.load(&request(&g, 21, &tokens), &sink).await.unwrap();
    assert_eq!(sink.mismatches.load(Ordering::Relaxed), 0);
    assert_eq!(sink.complete_layers(), 32);
    println!(
        "gather 4K tokens through the gateway: {} bytes, ttfl {:?}, total {:?}",
        r.bytes,
        r.ttfl.unwrap(),
        r.elapsed
    );
    gateway.shutdown().await;
    upstream.shutdown().await;
}

/// Gateway mode in front of Ceph RGW (the S3 test endpoint, `OBJECTCACHE_TEST_S3_ENDPOINT`):
/// a batched save through the gateway lands in Ceph as the chunk objects, and a gather load
/// through the gateway is byte-exact. Fails (not skips) under `OBJECTCACHE_REQUIRE_ALL=1`
/// when Ceph is not there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_mode_in_front_of_ceph_rgw() {
    let Some((ceph, prefix)) = common::test_s3_store("gw").await else {
        return;
    };
    let backend: Arc<dyn Store> = Arc::new(ceph);
    // The gateway's bucket is a unique key prefix inside the Ceph bucket.
    let bucket = prefix.to_lowercase();
    let mut cfg = config();
    cfg.buckets = vec![bucket.clone()];
    let gateway = start(backend.clone(), cfg).await;
    let g = KvGeometry::smollm2_135m();
    let tokens = vec![256u32, 256, 256, 100];
    let mut c = gather_client(gateway.local_addr()).await;
    let save = objectcache::protocol::SaveRequest {
        request_id: 31,
        bucket: bucket.clone(),
        prefix: key_builder(&g).prefix().to_string(),
        geometry: objectcache::protocol::WireGeometry::from_geometry(&g),
        chunks: hashes(31, tokens.len())
            .into_iter()
            .zip(&tokens)
            .map(|(hash, &tokens)| objectcache::protocol::SaveChunk { hash, tokens })
            .collect(),
    };
    c.save(
        &save,
        tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| object(&g, 31, i, t)),
    )
    .await
    .unwrap();
    // The bytes live in Ceph, under the gateway's bucket.
    let kb = key_builder(&g);
    let hs = hashes(31, tokens.len());
    for (i, &t) in tokens.iter().enumerate() {
        let k = format!("{bucket}/{}", kb.data(&hs[i]));
        assert_eq!(backend.get_bytes(&k).await.unwrap(), object(&g, 31, i, t));
    }
    let mut req = request(&g, 31, &tokens);
    req.bucket = bucket.clone();
    let sink = VerifySink::new(&g, 31, &tokens);
    let r = c.load(&req, &sink).await.unwrap();
    assert!(r.failed_layers.is_empty(), "{:?}", r.failed_layers);
    assert_eq!(sink.mismatches.load(Ordering::Relaxed), 0);
    assert_eq!(sink.complete_layers(), g.layers as usize);
    gateway.shutdown().await;
    for k in backend.list(&format!("{bucket}/"), 10_000).await.unwrap() {
        let _ = backend.delete(&k.key).await;
    }
}
