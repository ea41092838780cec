//! Case C6, path-style addressing: an S3 endpoint at http://127.0.0.1:PORT with bucket
//! `kv.cache-test` (dots, no DNS). Path-style works; virtual-hosted is a setting; a wrong
//! choice gives an error that says which to use.
//!
//! Against the real S3 server of the test environment (Ceph RGW, started by
//! scripts/ceph-rgw/start.sh with `rgw dns name = localhost`), except the redirect case, which
//! a scripted server on a loopback socket plays (RGW never asks for virtual-hosted requests).
#![cfg(feature = "s3")]

mod s3_support;

use bytes::Bytes;
use objectcache::store::{open_store, Addressing, S3Config, S3Store, Store, StoreExt};
use s3_support::{rgw_config, Reply, ScriptedServer};
use std::net::IpAddr;

const BUCKET: &str = "kv.cache-test";

fn port_of(c: &S3Config) -> u16 {
    url::Url::parse(c.endpoint.as_deref().unwrap())
        .unwrap()
        .port_or_known_default()
        .unwrap()
}

fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("c6-{tag}-{}-{nanos}", std::process::id())
}

fn payload(n: usize) -> Bytes {
    Bytes::from((0..n).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>())
}

fn loopback() -> IpAddr {
    "127.0.0.1".parse().unwrap()
}

#[tokio::test]
async fn c6_path_style_works_with_a_dotted_bucket_on_an_ip_endpoint() {
    let Some(mut c) = rgw_config("c6_path_style").await else {
        return;
    };
    c.bucket = BUCKET.into();
    c.addressing = Some(Addressing::Path);
    let store = S3Store::new(c.clone()).await.unwrap();
    store.create_bucket().await.unwrap();
    store.check().await.unwrap();
    let key = format!("{}/obj", unique("path"));
    let data = payload(100_000);
    store.put(&key, data.clone()).await.unwrap();
    assert_eq!(store.get_bytes(&key).await.unwrap(), data);
    assert_eq!(
        store.get_range(&key, 4096..8192).await.unwrap(),
        data.slice(4096..8192)
    );

    // The same through a store URL; path-style is the default when an endpoint is given.
    let url = format!(
        "s3://{BUCKET}?endpoint={}&region=us-east-1",
        c.endpoint.as_deref().unwrap()
    );
    std::env::set_var("AWS_ACCESS_KEY_ID", access_key(&c));
    std::env::set_var("AWS_SECRET_ACCESS_KEY", secret_key(&c));
    let via_url = open_store(&url).await.unwrap();
    assert_eq!(via_url.get_bytes(&key).await.unwrap(), data);
    store.delete(&key).await.unwrap();
}

fn access_key(c: &S3Config) -> String {
    match &c.credentials {
        objectcache::store::S3Credentials::Static { access_key, .. } => access_key.clone(),
        _ => unreachable!("test settings carry fixed keys"),
    }
}

fn secret_key(c: &S3Config) -> String {
    match &c.credentials {
        objectcache::store::S3Credentials::Static { secret_key, .. } => secret_key.clone(),
        _ => unreachable!("test settings carry fixed keys"),
    }
}

#[tokio::test]
async fn c6_virtual_hosted_is_a_setting() {
    let Some(mut c) = rgw_config("c6_virtual_hosted").await else {
        return;
    };
    c.bucket = BUCKET.into();
    let path_store = S3Store::new(c.clone()).await.unwrap();
    path_store.create_bucket().await.unwrap();

    // Virtual-hosted: requests go to kv.cache-test.localhost:PORT, which RGW maps to the bucket
    // (its `rgw dns name` is localhost). No DNS serves *.localhost here, so the test pins it.
    let mut v = c.clone();
    v.endpoint = Some(format!("http://localhost:{}", port_of(&c)));
    v.addressing = Some(Addressing::Virtual);
    v.resolve = vec![("*.localhost".into(), loopback())];
    let vstore = S3Store::new(v).await.unwrap();
    assert_eq!(vstore.addressing(), Addressing::Virtual);
    vstore.check().await.unwrap();
    let key = format!("{}/obj", unique("virtual"));
    let data = payload(50_000);
    vstore.put(&key, data.clone()).await.unwrap();
    assert_eq!(
        vstore.get_range(&key, 1..49_999).await.unwrap(),
        data.slice(1..49_999)
    );
    // Same bucket, same object, whichever addressing wrote it.
    assert_eq!(path_store.get_bytes(&key).await.unwrap(), data);
    assert_eq!(vstore.list(&key, 10).await.unwrap().len(), 1);
    vstore.delete(&key).await.unwrap();
}

#[tokio::test]
async fn c6_virtual_hosted_on_an_ip_endpoint_is_refused_naming_path_style() {
    // Needs no server: the settings alone cannot work.
    let mut c = S3Config::from_test_env();
    c.bucket = BUCKET.into();
    c.endpoint = Some("http://127.0.0.1:7480".into());
    c.addressing = Some(Addressing::Virtual);
    let e = S3Store::new(c).await.unwrap_err().to_string();
    assert!(e.contains("use addressing=path"), "{e}");
    let e = open_store(&format!(
        "s3://{BUCKET}?endpoint=http://127.0.0.1:7480&addressing=virtual"
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("use addressing=path"), "{e}");
}

#[tokio::test]
async fn c6_virtual_hosted_where_the_server_wants_path_style_says_use_path() {
    let Some(c) = rgw_config("c6_virtual_wrong").await else {
        return;
    };
    let port = port_of(&c);
    // 1. The server does not know the endpoint's name as its own domain, so it reads the
    //    bucket from the path: the bucket "does not exist".
    let mut v = c.clone();
    v.bucket = BUCKET.into();
    v.endpoint = Some(format!("http://s3.test:{port}"));
    v.addressing = Some(Addressing::Virtual);
    v.resolve = vec![
        ("s3.test".into(), loopback()),
        ("*.s3.test".into(), loopback()),
    ];
    let store = S3Store::new(v).await.unwrap();
    let key = format!("{}/obj", unique("wrongv"));
    let e = store.put(&key, payload(10)).await.unwrap_err().to_string();
    eprintln!("wrong virtual-hosted addressing: {e}");
    assert!(e.contains("use addressing=path"), "{e}");
    let e = store.check().await.unwrap_err().to_string();
    assert!(e.contains("use addressing=path"), "{e}");

    // 2. The bucket's host name leads nowhere (no wildcard DNS: here it points at a closed port).
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut v = c.clone();
    v.bucket = BUCKET.into();
    v.endpoint = Some(format!("http://localhost:{closed_port}"));
    v.addressing = Some(Addressing::Virtual);
    v.max_attempts = 1;
    v.resolve = vec![("*.localhost".into(), loopback())];
    let store = S3Store::new(v).await.unwrap();
    let e = store.get_bytes(&key).await.unwrap_err().to_string();
    eprintln!("bucket host name leads nowhere: {e}");
    assert!(
        e.contains("use addressing=path") && e.contains("kv.cache-test.localhost"),
        "{e}"
    );
}

#[tokio::test]
async fn c6_path_style_where_the_server_wants_virtual_hosted_says_use_virtual() {
    // What AWS S3 answers a path-style request for a bucket it serves only virtual-hosted.
    let srv = ScriptedServer::start(|_, _| {
        Reply::s3_error(
            301,
            "PermanentRedirect",
            "The bucket you are attempting to access must be addressed using the specified endpoint.",
        )
    })
    .await;
    let mut c = srv.config(2);
    c.bucket = "kv-cache-test".into();
    let store = S3Store::new(c).await.unwrap();
    let e = store.get_bytes("a/b").await.unwrap_err().to_string();
    eprintln!("wrong path-style addressing: {e}");
    assert!(e.contains("addressing=virtual"), "{e}");
    assert_eq!(srv.requests(), 1, "a redirect is not retried");
    assert!(
        srv.seen()[0].line.starts_with("GET /kv-cache-test/a/b?"),
        "{:?}",
        srv.seen()
    );
}

/// A refused connection (nothing listens at the endpoint) is one readable line: the request,
/// the endpoint and the cause, without the SDK's debug dump of its error types.
#[tokio::test]
async fn a_refused_connection_names_the_request_and_the_endpoint() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut c = S3Config::new("kv-cache-test");
    c.endpoint = Some(endpoint.clone());
    c.region = Some("us-east-1".into());
    c.credentials = objectcache::store::S3Credentials::Static {
        access_key: "ak".into(),
        secret_key: "sk".into(),
        session_token: None,
    };
    c.max_attempts = 1;
    let store = S3Store::new(c).await.unwrap();
    let e = store.list("", 10).await.unwrap_err().to_string();
    eprintln!("refused: {e}");
    assert!(
        e.contains("LIST under \"\"") && e.contains(&endpoint) && e.contains("Connection refused"),
        "{e}"
    );
    assert!(
        !e.contains("DispatchFailure") && !e.contains("ConnectorError"),
        "{e}"
    );
}
