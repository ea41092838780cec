//! Publish markers that are not a prefix (a save whose marker phase failed part way with
//! concurrent writes, or an eviction that took a middle chunk): lookup must stop at the first
//! missing marker it sees and never report a chunk whose marker (or data) is gone. (A gap that
//! no probe of the k-ary search touches stays invisible to lookup; the load then reports that
//! chunk missing, never its bytes.)

use crate::common;

use common::*;
use objectcache::connector::EngineConfig;
use objectcache::store::{FsStore, FsyncPolicy, Store, StoreExt};
use objectcache::KvGeometry;
use std::sync::Arc;
use std::time::Duration;

fn small() -> KvGeometry {
    small_geometry("test/markers", 4)
}

#[test]
fn lookup_stops_at_a_missing_middle_marker() {
    let g = small();
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let rt = tokio::runtime::Runtime::new().unwrap();
    for n in [4usize, 10, 16] {
        for gap in [1usize, n / 2, n - 2] {
            let ns = format!("gap-{n}-{gap}");
            let e = engine(store.clone(), &ns);
            let hs = hashes(&g, n * 16, (n * 100 + gap) as u32);
            let data = kv(&g, n, 5);
            let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            e.save_blocking(&g, &hs, &refs).unwrap();
            let keys = e.keys(&g).unwrap();
            rt.block_on(store.delete(&keys.marker(&hs[gap]))).unwrap();
            rt.block_on(store.delete(&keys.data(&hs[gap]))).unwrap();
            for fanout in [16usize, 32] {
                let cfg = EngineConfig {
                    namespace: ns.clone(),
                    lookup_fanout: fanout,
                    lookup_cache_ttl: Duration::ZERO,
                    ..EngineConfig::default()
                };
                let fresh = objectcache::connector::Engine::with_store(store.clone(), cfg).unwrap();
                let hit = fresh.lookup_blocking(&g, &hs).unwrap();
                assert!(
                    hit <= gap,
                    "n={n} gap={gap} fanout={fanout}: lookup reports {hit} chunks across a missing one"
                );
                if hit > 0 {
                    let h = load_first(&fresh, &g, &hs, hit);
                    for l in 0..g.layers as usize {
                        assert_eq!(
                            h.layer(l).unwrap(),
                            &data[l][..hit * g.slice_bytes() as usize]
                        );
                    }
                }
                assert!(rt.block_on(store.exists(&keys.marker(&hs[0]))).unwrap());
            }
        }
    }
}
