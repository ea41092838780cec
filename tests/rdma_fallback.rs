//! Without a usable RDMA device the RDMA path says so clearly and the caller falls back to TCP.
//! Runs everywhere: on a host without RDMA (the usual CI lane) and inside the soft-RoCE VM.
#![cfg(feature = "rdma")]

use std::sync::Arc;

use objectcache::store::MemoryStore;
use objectcache::transport::rdma::{
    self, select_transport, ClientConfig, DeviceSelector, RdmaClient, RdmaError, RdmaServer, ServerConfig, StoreSliceSource,
    TransportChoice,
};

#[test]
fn missing_device_falls_back_to_tcp_with_a_reason() {
    let sel = DeviceSelector { device: Some("no-such-rdma-dev9".into()), ..DeviceSelector::default() };
    match select_transport(&sel) {
        TransportChoice::Tcp { reason } => {
            assert!(reason.contains("no RDMA device"), "{reason}");
        }
        other => panic!("expected the TCP fallback, got {other:?}"),
    }
    // the client refuses before touching the network
    let err = RdmaClient::connect("127.0.0.1:9", ClientConfig { device: sel.clone(), ..ClientConfig::default() }).unwrap_err();
    assert!(matches!(err, RdmaError::NoDevice(_)), "{err}");
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let src = Arc::new(StoreSliceSource::new(Arc::new(MemoryStore::new()), rt.handle().clone()));
    let err = RdmaServer::bind("127.0.0.1:0", src, ServerConfig { device: sel, ..ServerConfig::default() }).unwrap_err();
    assert!(matches!(err, RdmaError::NoDevice(_)), "{err}");
}

#[test]
fn default_selection_matches_what_the_host_has() {
    let choice = select_transport(&DeviceSelector::default());
    match rdma::devices() {
        Ok(devs) => {
            eprintln!("RDMA devices: {devs:?}; choice: {choice:?}");
            assert!(matches!(&choice, TransportChoice::Rdma { device } if devs.contains(device)), "{choice:?}");
        }
        Err(e) => {
            eprintln!("no RDMA here ({e}); choice: {choice:?}");
            assert!(matches!(e, RdmaError::NoDevice(_)));
            assert!(matches!(&choice, TransportChoice::Tcp { reason } if reason.contains("no RDMA device")), "{choice:?}");
            if std::env::var("OBJECTCACHE_REQUIRE_RDMA").is_ok_and(|v| v == "1") {
                panic!("OBJECTCACHE_REQUIRE_RDMA=1 but {e}");
            }
        }
    }
}
