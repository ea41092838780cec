//! TLS on the server's listener (rustls): the S3 API round trip over `https://` with a
//! self-signed CA given to the client (`ca_file`), byte-exact, and a connector save and load
//! through it; a client that does not trust the CA, a plaintext client and a plaintext gather
//! probe all fail clearly; inconsistent TLS settings are refused at start.
#![cfg(feature = "s3")]

use crate::common;
use crate::common::shared_rt as rt;
use crate::gather_util;

use common::{assert_layers_exact, engine, save_prefix, start_load, unique_ns};
use gather_util::{config, start, ACCESS, BUCKET, SECRET};
use objectcache::server::ServerHandle;
use objectcache::store::{MemoryStore, S3Config, S3Store, Store, StoreExt};
use objectcache::transport::tcp::{GatherClient, GatherError};
use objectcache::KvGeometry;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A test CA and a server certificate it signed for `localhost` and 127.0.0.1, written to
/// `dir` as PEM: (ca.pem, server.pem, server.key).
fn certs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "objectcache test CA");
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    leaf.subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    let leaf = leaf.signed_by(&key, &ca, &ca_key).unwrap();
    let p = |n: &str| dir.join(n);
    std::fs::write(p("ca.pem"), ca.pem()).unwrap();
    std::fs::write(p("server.pem"), leaf.pem()).unwrap();
    std::fs::write(p("server.key"), key.serialize_pem()).unwrap();
    (p("ca.pem"), p("server.pem"), p("server.key"))
}

fn tls_server(cert: &Path, key: &Path) -> ServerHandle {
    let mut c = config();
    c.tls_cert = Some(cert.to_path_buf());
    c.tls_key = Some(key.to_path_buf());
    rt().block_on(start(Arc::new(MemoryStore::new()), c))
}

fn s3(endpoint: &str, ca: Option<&Path>) -> S3Store {
    let mut cfg = S3Config::at_endpoint(BUCKET, endpoint.to_string(), ACCESS, SECRET);
    cfg.max_attempts = 1;
    cfg.ca_file = ca.map(Path::to_path_buf);
    rt().block_on(S3Store::new(cfg)).unwrap()
}

/// The whole error chain as one string.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[test]
fn s3_api_round_trip_over_tls_and_connector_load() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = certs(dir.path());
    let srv = tls_server(&cert, &key);
    let ep = srv.endpoint();
    assert!(ep.starts_with("https://"), "{ep}");
    let st = s3(&ep, Some(&ca));
    let body: Vec<u8> = (0..(3 << 20) + 17).map(|i| (i * 7 % 251) as u8).collect();
    rt().block_on(st.put("a/obj", body.clone().into())).unwrap();
    assert_eq!(rt().block_on(st.get_bytes("a/obj")).unwrap(), body);
    assert_eq!(
        rt().block_on(st.get_range("a/obj", 1000..5000)).unwrap(),
        body[1000..5000]
    );
    assert_eq!(rt().block_on(st.list("a/", 10)).unwrap().len(), 1);
    // The connector over https: ranged GETs (gather is not probed on https endpoints).
    let store: Arc<dyn Store> = Arc::new(st);
    assert!(objectcache::store::Gateways::of(&*store).first().is_none());
    let e = engine(store, &unique_ns("tls"));
    let g = KvGeometry::smollm2_135m();
    let (hs, data) = save_prefix(&e, &g, 3, 9);
    let h = start_load(&e, &g, hs, data[0].len());
    assert_layers_exact(&h, &data);
    println!(
        "SECURITY|tls|S3 PUT/GET/ranged GET/LIST over https with a self-signed CA; connector save + load of 3 chunks x {} layers|1|byte-exact ({} requests)",
        g.layers,
        h.stats().requests
    );
    drop(h);
    drop(e);
    rt().block_on(srv.shutdown());
}

#[test]
fn untrusted_and_plaintext_clients_fail_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let (_ca, cert, key) = certs(dir.path());
    let srv = tls_server(&cert, &key);
    // A client that does not trust the CA (system roots only).
    let e = rt()
        .block_on(s3(&srv.endpoint(), None).get_bytes("x"))
        .unwrap_err();
    let m = chain(&e).to_lowercase();
    assert!(m.contains("certificate") || m.contains("issuer"), "{m}");
    println!("untrusted client: {m}");
    // A plaintext S3 client.
    let plain = format!("http://{}", srv.local_addr());
    let e = rt()
        .block_on(s3(&plain, None).put("x", bytes::Bytes::from_static(b"v")))
        .unwrap_err();
    let m = chain(&e);
    assert!(m.contains("https://") || m.contains("TLS"), "{m}");
    println!("plaintext client: {m}");
    let (st, body) = rt().block_on(gather_util::http_get(
        srv.local_addr(),
        "/_objectcache/health",
    ));
    assert_eq!(st, 400);
    assert!(body.contains("requires TLS"), "{body}");
    // A plaintext gather probe: "not offered", so a connector would use ranged GETs.
    match rt().block_on(GatherClient::connect(srv.local_addr())) {
        Err(GatherError::NotOffered(m)) => println!("plaintext gather probe: {m}"),
        other => panic!("{:?}", other.map(|c| c.server_info())),
    }
    println!(
        "SECURITY|tls|untrusted CA, plaintext S3 client, plaintext HTTP, plaintext gather probe against the TLS listener|4|all refused with a clear error (certificate / 400 \"use https://\" / gather not offered)"
    );
    rt().block_on(srv.shutdown());
}

#[test]
fn bad_tls_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = certs(dir.path());
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let try_start = |c: Option<&Path>, k: Option<&Path>| {
        let mut cfg = config();
        cfg.tls_cert = c.map(Path::to_path_buf);
        cfg.tls_key = k.map(Path::to_path_buf);
        rt().block_on(async {
            match objectcache::server::start_with_store(cfg, store.clone()).await {
                Ok(h) => {
                    h.shutdown().await;
                    None
                }
                Err(e) => Some(e.to_string()),
            }
        })
    };
    let e = try_start(Some(&cert), None).unwrap();
    assert!(e.contains("tls_cert and tls_key"), "{e}");
    let e = try_start(Some(&dir.path().join("missing.pem")), Some(&key)).unwrap();
    assert!(e.contains("tls_cert") && e.contains("missing.pem"), "{e}");
    // The CA's certificate with the server's key: they do not match.
    let e = try_start(Some(&ca), Some(&key)).unwrap();
    assert!(e.contains("tls_key"), "{e}");
    assert!(try_start(Some(&cert), Some(&key)).is_none());
}
