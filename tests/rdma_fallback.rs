//! Without a usable RDMA device the RDMA path says so clearly and the caller falls back to TCP.
//! Runs everywhere: on a host without RDMA (the usual CI lane) and inside the soft-RoCE VM.
//! Also the control channel's frames, which need no device.
#![cfg(feature = "rdma")]

mod rdma_util;

use std::sync::Arc;

use objectcache::store::MemoryStore;
use objectcache::transport::rdma::{
    self, control, select_transport, ClientConfig, DeviceSelector, RdmaClient, RdmaError,
    ServerConfig, SessionRegistry, TransportChoice,
};

#[test]
fn missing_device_falls_back_to_tcp_with_a_reason() {
    let sel = DeviceSelector {
        device: Some("no-such-rdma-dev9".into()),
        ..DeviceSelector::default()
    };
    match select_transport(&sel) {
        TransportChoice::Tcp { reason } => {
            assert!(reason.contains("no RDMA device"), "{reason}");
        }
        other => panic!("expected the TCP fallback, got {other:?}"),
    }
    // The client refuses before touching the network, and so does a server's session
    // registry (its gather port then serves TCP only).
    let err = RdmaClient::connect_gather(
        "127.0.0.1:9",
        ClientConfig {
            device: sel.clone(),
            ..ClientConfig::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, RdmaError::NoDevice(_)), "{err}");
    let err = SessionRegistry::open(
        ServerConfig {
            device: sel,
            ..ServerConfig::default()
        },
        1 << 20,
    )
    .unwrap_err();
    assert!(matches!(err, RdmaError::NoDevice(_)), "{err}");
}

#[test]
fn default_selection_matches_what_the_host_has() {
    let choice = select_transport(&DeviceSelector::default());
    match rdma::devices() {
        Ok(devs) => {
            eprintln!("RDMA devices: {devs:?}; choice: {choice:?}");
            assert!(
                matches!(&choice, TransportChoice::Rdma { device } if devs.contains(device)),
                "{choice:?}"
            );
        }
        Err(e) => {
            eprintln!("no RDMA here ({e}); choice: {choice:?}");
            assert!(matches!(e, RdmaError::NoDevice(_)));
            assert!(
                matches!(&choice, TransportChoice::Tcp { reason } if reason.contains("no RDMA device")),
                "{choice:?}"
            );
            if rdma_util::rdma_required() {
                panic!("OBJECTCACHE_REQUIRE_RDMA=1 but {e}");
            }
        }
    }
}

/// An Engine built with `rdma` against a server that offers no RDMA target (here switched off
/// with `OBJECTCACHE_RDMA=off`; on a host without a device it is off anyway) loads over TCP
/// gather, byte-exact, even with `transport = rdma`. Runs on the host and in the VM.
#[cfg(all(feature = "s3", feature = "server"))]
#[test]
fn engine_falls_back_to_tcp_gather_without_rdma() {
    use objectcache::connector::{Engine, EngineConfig, LayerBuffers, LoadRequest, Transport};
    use objectcache::store::{S3Config, S3Store, Store};
    // Only this test in this binary starts a server, so the variable affects nothing else.
    std::env::set_var("OBJECTCACHE_RDMA", "off");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cfg = objectcache::server::ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        allow_anonymous: false,
        access_keys: vec![objectcache::server::AccessKey {
            access_key: "fb-access".into(),
            secret_key: "fb-secret-key".into(),
        }],
        buckets: vec!["kv-fallback".into()],
        fsync: false,
        shutdown_grace_secs: 1,
        ..objectcache::server::ServerConfig::default()
    };
    let srv = rt
        .block_on(objectcache::server::start_with_store(
            cfg,
            Arc::new(MemoryStore::new()),
        ))
        .unwrap();
    assert_eq!(srv.rdma_writes(), None, "RDMA is off on this server");
    let s3 = S3Config::at_endpoint("kv-fallback", srv.endpoint(), "fb-access", "fb-secret-key");
    let store: Arc<dyn Store> = Arc::new(rt.block_on(S3Store::new(s3)).unwrap());
    let g = objectcache::layout::KvGeometry::new(
        "rdma-fallback",
        3,
        2,
        16,
        objectcache::layout::Dtype::Bf16,
    )
    .unwrap()
    .with_tokens_per_chunk(16)
    .unwrap();
    let e = Engine::with_store(
        store,
        EngineConfig {
            namespace: "rdmafallback".into(),
            transport: Transport::Rdma,
            ..Default::default()
        },
    )
    .unwrap();
    let chunks = 3usize;
    let hs: Vec<objectcache::layout::ChunkHash> = (0..chunks)
        .map(|c| objectcache::layout::ChunkHash::from_digest([c as u8 + 1; 32]))
        .collect();
    let slice = g.slice_bytes() as usize;
    let data: Vec<Vec<u8>> = (0..g.layers)
        .map(|l| {
            (0..chunks * slice)
                .map(|i| (i as u32 * 7 + l * 31) as u8)
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    e.save_blocking(&g, &hs, &refs).unwrap();
    let bufs = LayerBuffers::allocate(g.layers as usize, chunks * slice);
    let h = e.load(LoadRequest::new(g.clone(), hs), bufs).unwrap();
    for l in 0..g.layers as usize {
        h.wait_layer_blocking(l, None).unwrap();
        assert_eq!(h.layer(l).unwrap(), &data[l][..], "layer {l}");
    }
    assert_eq!(
        h.stats().requests,
        e.config().gather_streams.min(chunks) as u64,
        "one TCP gather request per stream"
    );
    drop(h);
    drop(e);
    rt.block_on(srv.shutdown());
}

/// The RDMA control channel's frames (length-prefixed JSON), without a device: every
/// message round-trips, and a cut, oversized or non-JSON frame is an error.
#[test]
fn control_frames_round_trip_and_reject_garbage() {
    let msgs = vec![
        control::Msg::Hello {
            version: control::VERSION,
            endpoints: vec![control::Endpoint {
                qpn: 17,
                psn: 0xabcdef,
                gid: [7; 16],
                lid: 0,
                mtu: 1024,
            }],
            gather: true,
        },
        control::Msg::Welcome {
            endpoints: vec![control::Endpoint {
                qpn: 99,
                psn: 5,
                gid: [1; 16],
                lid: 0,
                mtu: 4096,
            }],
            session: 0x0123_4567_89ab_cdef,
        },
        control::Msg::Refuse {
            reason: "no RDMA device".into(),
        },
        control::Msg::Bye,
    ];
    let mut wire = Vec::new();
    for m in &msgs {
        control::send(&mut wire, m).unwrap();
    }
    let mut r = &wire[..];
    for m in &msgs {
        assert_eq!(control::recv(&mut r).unwrap().as_ref(), Some(m));
    }
    assert_eq!(control::recv(&mut r).unwrap(), None);
    // cut inside a frame
    let mut cut = &wire[..wire.len() - 1 - 4 - 5];
    let mut last = Ok(None);
    for _ in 0..4 {
        last = control::recv(&mut cut);
        if last.is_err() {
            break;
        }
    }
    assert!(last.is_err());
    // oversized and non-JSON frames
    let mut big = &(control::MAX_FRAME + 1).to_be_bytes()[..];
    assert!(matches!(
        control::recv(&mut big),
        Err(RdmaError::Protocol(_))
    ));
    let mut bad = Vec::from(3u32.to_be_bytes());
    bad.extend_from_slice(b"xyz");
    assert!(matches!(
        control::recv(&mut &bad[..]),
        Err(RdmaError::Protocol(_))
    ));
}
