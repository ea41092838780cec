//! The storage conformance suite on every backend (one test per case per backend).

mod memory {
    objectcache::conformance_tests!(async {
        Some((objectcache::store::MemoryStore::new(), "conf".to_string()))
    });
}

mod fs {
    objectcache::conformance_tests!(async {
        let dir = tempfile::tempdir().unwrap().keep();
        Some((
            objectcache::store::FsStore::new(dir, objectcache::store::FsyncPolicy::Never).unwrap(),
            "conf".to_string(),
        ))
    });
}

#[cfg(feature = "s3")]
mod s3 {
    // Against the S3 endpoint of the test environment (Ceph RGW in CI): see
    // `S3Store::from_test_env` for the variables; each test gets its own key prefix.
    objectcache::conformance_tests!(async {
        objectcache::store::S3Store::from_test_env("conformance")
            .await
            .expect("S3 test endpoint answers but refuses us")
    });
}

/// moto's S3 server (PyPI `moto[server]`; `scripts/moto-setup.sh`, `scripts/moto-start.sh`),
/// a second S3 implementation beside Ceph RGW, at `OBJECTCACHE_TEST_MOTO_ENDPOINT` (default
/// `http://127.0.0.1:5000`). moto accepts any credentials. `None` (SKIP) when it is not
/// running; each call gets its own key prefix.
#[cfg(feature = "s3")]
pub async fn moto_store(tag: &str) -> Option<(objectcache::store::S3Store, String)> {
    use objectcache::store::{S3Config, S3Store};
    let endpoint = std::env::var("OBJECTCACHE_TEST_MOTO_ENDPOINT")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "http://127.0.0.1:5000".into());
    let c = S3Config::at_endpoint(
        "objectcache-moto",
        endpoint,
        "moto-test",
        "moto-test-secret",
    );
    if !c.endpoint_accepts_connections().await {
        return None;
    }
    let store = S3Store::new(c).await.expect("S3 client for moto");
    store
        .create_bucket()
        .await
        .expect("moto refuses the bucket");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Some((store, format!("{tag}-{}-{nanos}", std::process::id())))
}

#[cfg(feature = "s3")]
mod moto {
    objectcache::conformance_tests!(super::moto_store("conformance"));
}

/// The connector end to end on moto: save, lookup and a layer-by-layer load over ranged GETs,
/// byte-exact. Also the fault moto exposed (issue 18): moto stays silent on the gather preface,
/// which once cost every load a 10 s timeout; the engine learns from one HTTP request that
/// gather is not offered.
#[cfg(feature = "s3")]
#[test]
fn connector_round_trip_on_moto() {
    use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadRequest};
    use objectcache::hash::{chunk_hashes, HashParams};
    use std::sync::Arc;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((store, prefix)) = rt.block_on(moto_store("connector")) else {
        crate::common::skip("moto server (OBJECTCACHE_TEST_MOTO_ENDPOINT; scripts/moto-start.sh)");
        return;
    };
    // moto answers presigned ranged GETs: the load below reads its bodies into place.
    rt.block_on(async {
        use objectcache::store::{Store, StoreExt};
        let k = format!("{prefix}/presigned");
        store.put(&k, vec![7u8; 64].into()).await.unwrap();
        let b = store.get_range_body(&k, 8..24).await.unwrap();
        assert!(b.is_some(), "moto declined a presigned ranged GET");
    });
    let e = Engine::with_store(
        Arc::new(store),
        EngineConfig {
            namespace: prefix.replace('_', "-"),
            ..Default::default()
        },
    )
    .unwrap();
    let mut g = objectcache::KvGeometry::smollm2_135m();
    g.tokens_per_chunk = 16;
    let tokens: Vec<u32> = (0..64).map(|i| i * 7 + 1).collect();
    let hs = chunk_hashes(&tokens, &HashParams::new(16)).unwrap();
    let slice = g.slice_bytes() as usize;
    let data: Vec<Vec<u8>> = (0..g.layers)
        .map(|l| {
            (0..4 * slice)
                .map(|i| (i as u32 ^ (l * 131)) as u8)
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    e.save_blocking(&g, &hs, &refs).unwrap();
    assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), 4);
    for _ in 0..2 {
        let h = e
            .load(
                LoadRequest::new(g.clone(), hs.clone()),
                LayerBuffers::allocate(g.layers as usize, 4 * slice),
            )
            .unwrap();
        for l in 0..g.layers as usize {
            h.wait_layer_blocking(l, None).unwrap();
            assert_eq!(h.layer(l).unwrap(), &data[l][..], "layer {l}");
        }
        assert!(h.stats().requests > 1, "ranged GETs, not gather");
    }
}

/// Wrapper stores keep the wrapped store's data paths (issue 14: `TrackedStore` once dropped
/// `open_local`, so a wrapped `fs` store lost sendfile). Over the file store (local files) and
/// over S3 (bodies read into place). Gather is not the store's since issue 44: the S3 store's
/// `Gateways` name its endpoint, a wrapper's name none (an engine over a wrapper takes the
/// wrapped store's gateways beside it, `Engine::with_gateways`).
mod wrappers {
    use objectcache::lifecycle::{AccessLog, LeaseTable, TrackedStore};
    use objectcache::store::conformance::wrapper_forwards;
    use objectcache::store::{FsStore, FsyncPolicy, Gateways, Store};
    use std::sync::Arc;
    use std::time::Duration;

    fn tracked(inner: Arc<dyn Store>) -> TrackedStore {
        TrackedStore::new(
            inner,
            Arc::new(AccessLog::new()),
            LeaseTable::new(),
            Duration::from_secs(30),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tracked_store_over_fs_keeps_local_files() {
        let dir = tempfile::tempdir().unwrap();
        let inner: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
        let w = tracked(inner.clone());
        wrapper_forwards(inner.as_ref(), &w, "wrap").await;
        assert!(
            inner
                .open_local("wrap/wrapped/obj")
                .await
                .unwrap()
                .is_some(),
            "fs has local files"
        );
    }

    #[cfg(feature = "s3")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tracked_store_over_s3_keeps_its_data_paths() {
        let Some((s3, prefix)) = crate::common::test_s3_store("wrappers").await else {
            return;
        };
        let inner: Arc<dyn Store> = Arc::new(s3);
        assert!(
            Gateways::of(&*inner).first().is_some(),
            "an http:// endpoint names a gather target"
        );
        let w = tracked(inner.clone());
        assert!(
            Gateways::of(&w).first().is_none(),
            "a wrapper's gateways are given beside it, not found through it"
        );
        wrapper_forwards(inner.as_ref(), &w, &prefix).await;
        assert!(
            inner
                .get_range_body(&format!("{prefix}/wrapped/obj"), 0..16)
                .await
                .unwrap()
                .is_some(),
            "an http:// endpoint's ranged GETs are read into place"
        );
    }
}
