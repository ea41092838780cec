//! What the server's S3 API tells a client that sends what it cannot serve (issue 16): a 4xx
//! with the S3 error code, no OS error text or server path, naming only the key as the
//! client sent it (never another namespace's); presigned URLs valid for more than 7 days
//! refused as AWS S3 refuses them; `serve --print-config` without secrets.

use crate::common::run_ok;
use crate::gather_util;
use crate::hostile_util;

use gather_util::*;
use hostile_util::*;
use objectcache::server::tenant::TenantConfig;
use objectcache::store::{FsStore, FsyncPolicy, Store};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// A raw presigned request with an optional body: `(status, head and body)`.
async fn presigned(
    addr: SocketAddr,
    method: &str,
    key: &str,
    expires: u64,
    ak: &str,
    sk: &str,
    body: &[u8],
) -> (u16, String) {
    let mut s = connect_from(1, addr).await;
    let t = presign(method, addr, &format!("/{BUCKET}/{key}"), expires, ak, sk);
    let extra = format!("Content-Length: {}\r\nConnection: close\r\n", body.len());
    send_head(&mut s, method, &t, addr, &extra).await;
    s.write_all(body).await.unwrap();
    let (st, head) = read_status(&mut s).await;
    // The rest of the error document.
    let mut rest = Vec::new();
    let _ = tokio::io::AsyncReadExt::read_to_end(&mut s, &mut rest).await;
    (st, head + &String::from_utf8_lossy(&rest))
}

fn no_internals(text: &str, root: &std::path::Path) {
    for bad in [
        "os error",
        "Is a directory",
        "Not a directory",
        "File name too long",
        ".tmp-",
    ] {
        assert!(!text.contains(bad), "{bad:?} in {text}");
    }
    assert!(
        !text.contains(root.to_str().unwrap()),
        "server path in {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_the_store_cannot_hold_and_long_lived_urls_get_s3_4xx() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let store: Arc<dyn Store> = Arc::new(FsStore::new(&root, FsyncPolicy::Never).unwrap());
    let server = start(store, config()).await;
    let addr = server.local_addr();
    let put =
        |key: String| async move { presigned(addr, "PUT", &key, 600, ACCESS, SECRET, b"v").await };

    // A path segment longer than the filesystem holds.
    let (st, text) = put(format!("{}/x", "s".repeat(300))).await;
    assert_eq!(st, 400, "{text}");
    assert!(text.contains("<Code>KeyTooLongError</Code>"), "{text}");
    no_internals(&text, &root);
    // A key equal to an existing prefix, and a key below an existing object.
    assert_eq!(put("a/b/c".into()).await.0, 200);
    let (st, text) = put("a/b".into()).await;
    assert_eq!(st, 400, "{text}");
    assert!(
        text.contains("<Code>InvalidArgument</Code>") && text.contains("a prefix of other keys"),
        "{text}"
    );
    no_internals(&text, &root);
    let (st, text) = put("a/b/c/d".into()).await;
    assert_eq!(st, 400, "{text}");
    assert!(text.contains("a prefix of this key is an object"), "{text}");
    no_internals(&text, &root);
    // Reading below an object is a plain miss.
    let (st, text) = presigned(addr, "GET", "a/b/c/d", 600, ACCESS, SECRET, b"").await;
    assert_eq!(st, 404, "{text}");
    assert!(
        text.contains("<Code>NoSuchKey</Code>") && text.contains("no such key: a/b/c/d"),
        "{text}"
    );
    no_internals(&text, &root);

    // Presigned URLs: up to 7 days is served (the signature is good), one second more is not.
    for (expires, want) in [
        (3600u64, 200u16),
        (604_800, 200),
        (604_801, 400),
        (30 * 86_400, 400),
    ] {
        let (st, text) = presigned(addr, "GET", "a/b/c", expires, ACCESS, SECRET, b"").await;
        assert_eq!(st, want, "X-Amz-Expires={expires}: {text}");
        if want == 400 {
            assert!(
                text.contains("<Code>AuthorizationQueryParametersError</Code>"),
                "{text}"
            );
        }
    }
    println!("ERRORS|fs keys it cannot hold (300-byte segment, key over a prefix, key below an object), presigned expiry|400 KeyTooLongError / InvalidArgument, 404 NoSuchKey, no OS text or path; 7 days served, 7 days + 1 s and 30 days 400 AuthorizationQueryParametersError");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_errors_name_only_the_tenants_own_keys() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let store: Arc<dyn Store> = Arc::new(FsStore::new(&root, FsyncPolicy::Never).unwrap());
    let mut cfg = config();
    let t = |ak: &str, sk: &str, ns: &str| TenantConfig {
        access_key: ak.into(),
        secret_key: sk.into(),
        namespace: ns.into(),
        salt: None,
    };
    cfg.tenants = vec![
        t("ak-alpha", "sk-alpha", "alpha"),
        t("ak-beta", "sk-beta", "beta"),
    ];
    let server = start(store, cfg).await;
    let addr = server.local_addr();
    assert_eq!(
        presigned(
            addr,
            "PUT",
            "doc/1",
            600,
            "ak-alpha",
            "sk-alpha",
            b"secret-a"
        )
        .await
        .0,
        200
    );
    for key in [
        "doc/1",
        "alpha/doc/1",
        "../alpha/doc/1",
        "x/../../alpha/doc/1",
        &format!("{}/y", "z".repeat(300)),
    ] {
        for method in ["GET", "PUT"] {
            let (st, text) = presigned(addr, method, key, 600, "ak-beta", "sk-beta", b"v").await;
            if method == "PUT" && st == 200 {
                continue; // a key of beta's own
            }
            assert!((400..500).contains(&st), "{method} {key}: {st} {text}");
            for other in ["alpha/", "beta/", BUCKET] {
                // The tenant's own key may itself contain "alpha/": only what the server
                // adds (a namespace, the bucket prefix) is checked.
                if key.contains(other) {
                    continue;
                }
                assert!(!text.contains(other), "{method} {key}: {other:?} in {text}");
            }
            no_internals(&text, &root);
        }
    }
    println!("ERRORS|tenant beta probes alpha's key by name, through alpha/, ../, x/../../, and a 300-byte segment (GET and PUT)|every answer 4xx naming only the key as beta sent it; no namespace, bucket prefix, OS text or path");
    server.shutdown().await;
}

#[test]
fn print_config_shows_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("c.toml");
    std::fs::write(
        &f,
        "[[tenants]]\naccess_key = \"ak-t\"\nsecret_key = \"tenant-secret-xyz\"\nnamespace = \"team\"\nsalt = \"salt-xyz\"\n",
    )
    .unwrap();
    let out = run_ok(
        std::process::Command::new(env!("CARGO_BIN_EXE_objectcache"))
            .args([
                "serve",
                "--print-config",
                "--access-key",
                "AKOPS:operator-secret-xyz",
                "--config",
            ])
            .arg(&f),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for secret in ["operator-secret-xyz", "tenant-secret-xyz", "salt-xyz"] {
        assert!(!text.contains(secret), "{secret} printed: {text}");
    }
    assert!(
        text.contains("AKOPS") && text.contains("ak-t") && text.contains("<redacted>"),
        "{text}"
    );
}
