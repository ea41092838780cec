//! A client over several gateways (`GatewayStore`): ObjectCache servers in front of one store,
//! each on its own runtime so that it can be killed abruptly (the runtime is dropped: every
//! socket closes at once, as when the process dies) and started again on the same address.
//! S3 requests and gather loads fail over to another gateway, byte-exact; a gateway that comes
//! back is used again. The same behaviour on a multi-host Ceph bed: `tests/bed.rs`.
#![cfg(all(feature = "s3", feature = "server"))]

use crate::common;

use bytes::Bytes;
use common::{assert_layers_exact, engine, engine_with, save_prefix, start_load, unique_ns};
use objectcache::connector::ChunkStatus;
use objectcache::sched::placement::{route_key, Placement};
use objectcache::server::{AccessKey, ServerConfig};
use objectcache::store::{
    GatewayOptions, GatewayStore, MemoryStore, S3Config, S3Credentials, Store, StoreExt,
};
use objectcache::{ChunkHash, KvGeometry};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const BUCKET: &str = "kv-gateways";
const ACCESS: &str = "gw-access";
const SECRET: &str = "gw-secret-key";

/// One gateway: a server on a runtime of its own.
struct Gateway {
    addr: SocketAddr,
    rt: Option<tokio::runtime::Runtime>,
    server: Option<objectcache::server::ServerHandle>,
}

impl Gateway {
    /// Starts a gateway over `store` on `addr` (port 0: any), sending at most `cap` bytes/s
    /// (0: uncapped) so that a load lasts long enough to be cut in the middle.
    fn start(store: Arc<dyn Store>, addr: SocketAddr, cap: u64) -> Gateway {
        Gateway::start_as(store, addr, cap, true)
    }

    /// [`Gateway::start`], reading format version 2 segment objects for gather loads or not
    /// (`read_segments = false`: as a gateway of an older release).
    fn start_as(store: Arc<dyn Store>, addr: SocketAddr, cap: u64, read_segments: bool) -> Gateway {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let cfg = ServerConfig {
            listen: addr,
            access_keys: vec![AccessKey {
                access_key: ACCESS.into(),
                secret_key: SECRET.into(),
            }],
            buckets: vec![BUCKET.into()],
            scheduler: if cap > 0 {
                "equal".into()
            } else {
                "fifo".into()
            },
            bandwidth_cap_bytes_per_s: cap,
            shutdown_grace_secs: 1,
            read_segments,
            ..ServerConfig::default()
        };
        let server = rt
            .block_on(objectcache::server::start_with_store(cfg, store))
            .expect("gateway starts");
        Gateway {
            addr: server.local_addr(),
            rt: Some(rt),
            server: Some(server),
        }
    }

    /// Kills the gateway at once: its runtime is dropped with every task and socket.
    fn kill(&mut self) {
        self.server.take();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }

    /// Gather loads this gateway has served (its metrics).
    fn gather_loads(&self) -> u64 {
        let text = self.server.as_ref().expect("running").metrics().encode();
        text.lines()
            .find(|l| l.starts_with("objectcache_server_requests_total{op=\"gather\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0) as u64
    }
}

fn client_store(
    rt: &tokio::runtime::Runtime,
    gws: &[&Gateway],
    placement: Placement,
) -> Arc<GatewayStore> {
    let mut base = S3Config::new(BUCKET);
    base.region = Some("us-east-1".into());
    base.credentials = S3Credentials::Static {
        access_key: ACCESS.into(),
        secret_key: SECRET.into(),
        session_token: None,
    };
    let endpoints = gws.iter().map(|g| format!("http://{}", g.addr)).collect();
    let opts = GatewayOptions {
        placement,
        health_interval: Duration::from_millis(100),
    };
    Arc::new(
        rt.block_on(GatewayStore::new(base, endpoints, opts))
            .unwrap(),
    )
}

/// The index in `gws` of the first gateway of `store`'s gather route for the prefix whose
/// first chunk is `first` (the one its loads go to while it is up).
fn first_on_route(store: &GatewayStore, gws: &[Gateway], first: &ChunkHash) -> usize {
    let addr = store.gateways().route(route_key(first.as_bytes()))[0]
        .addr
        .clone();
    gws.iter()
        .position(|gw| gw.addr.to_string() == addr)
        .unwrap()
}

#[test]
fn s3_requests_fail_over_and_a_gateway_that_comes_back_is_used_again() {
    let _alone = crate::alone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let backing: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mut a = Gateway::start(backing.clone(), "127.0.0.1:0".parse().unwrap(), 0);
    let b = Gateway::start(backing.clone(), "127.0.0.1:0".parse().unwrap(), 0);
    let store = client_store(&rt, &[&a, &b], Placement::Hash);
    let put_get = |from: usize, to: usize| {
        rt.block_on(async {
            for i in from..to {
                let k = format!("obj/{i}");
                store
                    .put(&k, Bytes::from(vec![i as u8; 100 + i]))
                    .await
                    .unwrap();
                assert_eq!(store.get_bytes(&k).await.unwrap(), vec![i as u8; 100 + i]);
            }
        })
    };
    put_get(0, 40);
    let before = store.endpoints();
    assert!(
        before.iter().all(|e| e.up && e.requests > 0),
        "both used: {before:?}"
    );

    a.kill();
    put_get(40, 80);
    let during = store.endpoints();
    assert!(!during[0].up && during[0].marked_down >= 1, "{during:?}");
    // Every object is still there, read through the gateway that is left.
    rt.block_on(async {
        for i in 0..80 {
            assert_eq!(
                store.get_bytes(&format!("obj/{i}")).await.unwrap().len(),
                100 + i
            );
        }
    });

    let a2 = Gateway::start(backing.clone(), a.addr, 0);
    common::eventually(
        "the gateway is seen up again",
        Duration::from_secs(20),
        || store.endpoints()[0].up,
    );
    let used = store.endpoints()[0].requests;
    put_get(80, 120);
    let after = store.endpoints();
    assert!(after[0].recovered >= 1, "{after:?}");
    assert!(
        after[0].requests > used + 5,
        "the returning gateway serves its keys again: {after:?}"
    );
    drop(a2);
}

#[test]
fn a_gather_load_fails_over_mid_load_byte_exact_and_the_gateway_is_used_again() {
    let _alone = crate::alone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let backing: Arc<dyn Store> = Arc::new(MemoryStore::new());
    // 40 MB/s per gateway: an 8-chunk SmolLM2 prefix (47 MB) takes about a second.
    let cap = 40_000_000;
    let mut gws: Vec<Gateway> = (0..3)
        .map(|_| Gateway::start(backing.clone(), "127.0.0.1:0".parse().unwrap(), cap))
        .collect();
    let store = client_store(&rt, &gws.iter().collect::<Vec<_>>(), Placement::Hash);
    let g = KvGeometry::smollm2_135m();
    let e = engine(store.clone(), &unique_ns("gw-failover"));
    let chunks = 8;
    let (hs, data) = save_prefix(&e, &g, chunks, 11);
    let victim = first_on_route(&store, &gws, &hs[0]);

    let load = || start_load(&e, &g, hs.clone(), data[0].len());
    let h = load();
    h.wait_layer_blocking(4, None).unwrap();
    assert!(
        h.stats().ttll_s.is_none(),
        "the load is still running when its gateway dies"
    );
    gws[victim].kill();
    h.wait_all_blocking().unwrap();
    for l in 0..g.layers as usize {
        assert_eq!(h.layer(l).unwrap(), &data[l][..], "layer {l}");
    }
    assert!(h.chunk_status().iter().all(|s| *s == ChunkStatus::Ok));
    let st = h.stats();
    assert!(st.failovers >= 1, "{st:?}");
    assert_eq!(st.bytes, chunks as u64 * g.slice_bytes() * g.layers as u64);
    drop(h);
    assert!(!store.endpoints()[victim].up);

    // While it is down, loads go elsewhere, whole.
    let h = load();
    h.wait_all_blocking().unwrap();
    assert_eq!(h.stats().failovers, 0);
    drop(h);

    // It comes back on its address: its prefixes are served by it again.
    let addr = gws[victim].addr;
    gws[victim] = Gateway::start(backing.clone(), addr, cap);
    common::eventually(
        "the gateway is seen up again",
        Duration::from_secs(20),
        || store.endpoints()[victim].up,
    );
    let h = load();
    h.wait_all_blocking().unwrap();
    for l in 0..g.layers as usize {
        assert_eq!(h.layer(l).unwrap(), &data[l][..], "layer {l}");
    }
    assert!(
        gws[victim].gather_loads() >= 1,
        "the returning gateway served the load"
    );
}

/// A fleet mid-upgrade: the first gateway of a version 2 prefix's route reads no segment
/// objects (`read_segments = false`, as an older release). The load passes it over and
/// gathers from the gateway that does, byte for byte, one request per stream, where it
/// used to fall back to ranged GETs (at least one per layer).
#[test]
fn a_version_2_load_passes_over_a_gateway_that_reads_no_segments() {
    let _alone = crate::alone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let backing: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mut gws: Vec<Gateway> = (0..2)
        .map(|_| Gateway::start(backing.clone(), "127.0.0.1:0".parse().unwrap(), 0))
        .collect();
    let store = client_store(&rt, &[&gws[0], &gws[1]], Placement::Hash);
    let g = KvGeometry::smollm2_135m();
    let e = engine_with(
        store.clone(),
        &unique_ns("gw-upgrade"),
        &[("save_format", "v2")],
    );
    let (hs, data) = save_prefix(&e, &g, 4, 21);
    let old = first_on_route(&store, &gws, &hs[0]);
    // The route's first gateway comes back on its address as an older release.
    let addr = gws[old].addr;
    gws[old].kill();
    // The killed runtime closes its listener in the background.
    common::eventually("the address is free", Duration::from_secs(20), || {
        std::net::TcpListener::bind(addr).is_ok()
    });
    gws[old] = Gateway::start_as(backing.clone(), addr, 0, false);
    common::eventually(
        "the restarted gateway is seen up",
        Duration::from_secs(20),
        || store.endpoints()[old].up,
    );
    let h = start_load(&e, &g, hs, data[0].len());
    assert_layers_exact(&h, &data);
    assert!(h.chunk_status().iter().all(|s| *s == ChunkStatus::Ok));
    let st = h.stats();
    assert!(
        st.requests <= 2,
        "one gather request per stream, not ranged GETs: {st:?}"
    );
    assert_eq!(gws[old].gather_loads(), 0, "the older gateway gathered");
    assert!(gws[1 - old].gather_loads() >= 1);
}

#[test]
fn loads_spread_over_the_gateways_by_prefix() {
    let _alone = crate::alone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let backing: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let a = Gateway::start(backing.clone(), "127.0.0.1:0".parse().unwrap(), 0);
    let b = Gateway::start(backing.clone(), "127.0.0.1:0".parse().unwrap(), 0);
    let store = client_store(&rt, &[&a, &b], Placement::Hash);
    let g = KvGeometry::smollm2_135m();
    let e = engine(store.clone(), &unique_ns("gw-spread"));
    // Many prefixes: each lands on its rendezvous gateway; both serve some.
    for seed in 0..12u64 {
        let (hs, data) = save_prefix(&e, &g, 1, 100 + seed);
        let h = start_load(&e, &g, hs, data[0].len());
        h.wait_all_blocking().unwrap();
        assert_eq!(h.layer(0).unwrap(), &data[0][..]);
    }
    assert!(
        a.gather_loads() > 0 && b.gather_loads() > 0,
        "{} / {}",
        a.gather_loads(),
        b.gather_loads()
    );
    assert_eq!(a.gather_loads() + b.gather_loads(), 12);
}
