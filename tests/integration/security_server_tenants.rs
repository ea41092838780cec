//! Tenants on the server, through real SigV4 clients (the AWS SDK, through our `S3Store` and
//! directly): each tenant's access key is confined to its namespace; another tenant's keys
//! cannot be read, listed or probed (a probe is exactly a miss); keys cannot escape the
//! storage root (`..`, absolute, NUL, over-long); tenants cannot change buckets; unsigned
//! requests are refused; gather is refused and loads fall back to ranged GETs.
#![cfg(feature = "s3")]

use crate::common;
use crate::common::shared_rt as rt;
use crate::gather_util;

use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_s3::primitives::ByteStream;
use common::{save_prefix, start_load, unique_ns};
use gather_util::{config, start, ACCESS, BUCKET};
use objectcache::connector::{Engine, EngineConfig};
use objectcache::server::tenant::TenantConfig;
use objectcache::server::{ServerConfig, ServerHandle};
use objectcache::store::{FsStore, FsyncPolicy, S3Config, S3Store, Store, StoreExt};
use objectcache::KvGeometry;
use std::path::Path;
use std::sync::Arc;

const A: (&str, &str, &str) = ("tenant-a-key", "tenant-a-secret", "alpha");
const B: (&str, &str, &str) = ("tenant-b-key", "tenant-b-secret", "beta");

fn tenant(t: (&str, &str, &str), salt: Option<&str>) -> TenantConfig {
    TenantConfig {
        access_key: t.0.into(),
        secret_key: t.1.into(),
        namespace: t.2.into(),
        salt: salt.map(Into::into),
    }
}

fn tenants_config() -> ServerConfig {
    let mut c = config();
    c.tenants = vec![tenant(A, Some("salt-a")), tenant(B, None)];
    c
}

/// A server over a file store at `dir/root`.
fn server(dir: &Path) -> ServerHandle {
    let store: Arc<dyn Store> =
        Arc::new(FsStore::new(dir.join("root"), FsyncPolicy::Never).unwrap());
    rt().block_on(start(store, tenants_config()))
}

/// Our `S3Store` (AWS SDK, SigV4) with these credentials.
fn store_as(endpoint: &str, ak: &str, sk: &str) -> Arc<dyn Store> {
    let mut cfg = S3Config::at_endpoint(BUCKET, endpoint.to_string(), ak, sk);
    cfg.max_attempts = 1;
    Arc::new(rt().block_on(S3Store::new(cfg)).unwrap())
}

/// A bare AWS SDK client: it sends any key, where `S3Store` refuses bad keys itself.
fn raw_client(endpoint: &str, ak: &str, sk: &str) -> aws_sdk_s3::Client {
    use aws_smithy_http_client::tls;
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let conf = aws_sdk_s3::config::Builder::new()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .force_path_style(true)
        .credentials_provider(Credentials::new(ak, sk, None, None, "test"))
        .http_client(http)
        .build();
    aws_sdk_s3::Client::from_conf(conf)
}

/// The error a GET of `key` ends with, as (HTTP status, S3 code).
fn get_err(c: &aws_sdk_s3::Client, key: &str) -> (u16, String) {
    rt().block_on(async {
        match c.get_object().bucket(BUCKET).key(key).send().await {
            Ok(o) => {
                let b = o.body.collect().await.unwrap().into_bytes();
                panic!("GET {key:?} returned {} bytes", b.len())
            }
            Err(e) => {
                let status = e.raw_response().map(|r| r.status().as_u16()).unwrap_or(0);
                let code = aws_sdk_s3::error::ProvideErrorMetadata::code(&e)
                    .unwrap_or("")
                    .to_string();
                (status, code)
            }
        }
    })
}

fn keys_listed(s: &Arc<dyn Store>, prefix: &str) -> Vec<String> {
    let mut v: Vec<String> = rt()
        .block_on(s.list(prefix, 10_000))
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    v.sort();
    v
}

#[test]
fn a_tenant_cannot_read_list_or_probe_another() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path());
    let ep = srv.endpoint();
    let (a, b) = (store_as(&ep, A.0, A.1), store_as(&ep, B.0, B.1));
    let op = store_as(&ep, ACCESS, gather_util::SECRET);
    rt().block_on(a.put("kv/x", bytes::Bytes::from_static(b"A's bytes")))
        .unwrap();
    rt().block_on(a.put("pub/x", bytes::Bytes::from_static(b"A's marker")))
        .unwrap();
    // B asking for A's key asks for its own: a miss, exactly like a key nobody wrote.
    let rb = raw_client(&ep, B.0, B.1);
    let probe = get_err(&rb, "kv/x");
    let never = get_err(&rb, "kv/never-written");
    assert_eq!(probe, never, "a probe of A's key differs from a plain miss");
    assert_eq!(probe, (404, "NoSuchKey".to_string()));
    assert!(!rt().block_on(b.exists("kv/x")).unwrap());
    assert!(!rt().block_on(b.exists("pub/x")).unwrap());
    // Nor through another tenant's namespace name, an absolute path or `..`.
    for k in [
        "alpha/kv/x",
        "/alpha/kv/x",
        "../alpha/kv/x",
        "kv/../../alpha/kv/x",
    ] {
        let (st, code) = get_err(&rb, k);
        assert!(
            st == 404 || st == 400,
            "GET {k:?} by B: {st} {code} (must be a miss or a refusal)"
        );
    }
    // B writes the same key: both keep their own bytes.
    rt().block_on(b.put("kv/x", bytes::Bytes::from_static(b"B's bytes")))
        .unwrap();
    assert_eq!(
        &rt().block_on(a.get_bytes("kv/x")).unwrap()[..],
        b"A's bytes"
    );
    assert_eq!(
        &rt().block_on(b.get_bytes("kv/x")).unwrap()[..],
        b"B's bytes"
    );
    // Listings: each tenant sees its own keys, relative to its namespace.
    assert_eq!(keys_listed(&a, ""), vec!["kv/x", "pub/x"]);
    assert_eq!(keys_listed(&b, ""), vec!["kv/x"]);
    assert_eq!(keys_listed(&b, "alpha/"), Vec::<String>::new());
    // A list prefix climbing out of the namespace is refused, never served.
    let r = rt().block_on(
        rb.list_objects_v2()
            .bucket(BUCKET)
            .prefix("../alpha/")
            .send(),
    );
    match r {
        Err(_) => {}
        Ok(o) => assert!(o.contents().is_empty(), "B listed {:?}", o.contents()),
    }
    // The operator key sees both namespaces.
    assert_eq!(
        keys_listed(&op, ""),
        vec!["alpha/kv/x", "alpha/pub/x", "beta/kv/x"]
    );
    // Tenants cannot create or delete buckets.
    let ra = raw_client(&ep, A.0, A.1);
    let e = rt()
        .block_on(ra.create_bucket().bucket("tenant-made").send())
        .unwrap_err();
    assert_eq!(
        aws_sdk_s3::error::ProvideErrorMetadata::code(&e),
        Some("AccessDenied")
    );
    let e = rt()
        .block_on(ra.delete_bucket().bucket(BUCKET).send())
        .unwrap_err();
    assert_eq!(
        aws_sdk_s3::error::ProvideErrorMetadata::code(&e),
        Some("AccessDenied")
    );
    // Unsigned requests are refused.
    let (st, _) = rt().block_on(gather_util::http_get(
        srv.local_addr(),
        &format!("/{BUCKET}/alpha/kv/x"),
    ));
    assert_eq!(st, 403, "an unsigned GET on a server with tenants");
    println!(
        "SECURITY|tenants|cross-tenant GET, HEAD, list, absolute and .. probes, bucket changes, unsigned GET|{}|all misses or refusals; probe = plain miss (404 NoSuchKey)",
        4 + 2 + 3 + 2 + 1
    );
    rt().block_on(srv.shutdown());
}

#[test]
fn keys_cannot_escape_the_storage_root() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path());
    let ep = srv.endpoint();
    let long = "k".repeat(1100);
    let near = format!("n/{}", "k".repeat(1019)); // 1,021 bytes: fits alone, not with a root
    let hostile: Vec<&str> = vec![
        "../escape",
        "../../escape",
        "a/../../escape",
        "a/./b",
        "/absolute",
        "//double",
        "a//b",
        "nul\0byte",
        "back\\slash",
        "ctl\x01byte",
        long.as_str(),
        near.as_str(),
        "..",
        ".",
    ];
    let mut tried = 0;
    for (who, ak, sk) in [
        ("operator", ACCESS, gather_util::SECRET),
        ("tenant", A.0, A.1),
    ] {
        let c = raw_client(&ep, ak, sk);
        for k in &hostile {
            if *k == near.as_str() && who == "operator" {
                continue; // a legal key for the operator
            }
            tried += 1;
            let put = rt().block_on(
                c.put_object()
                    .bucket(BUCKET)
                    .key(*k)
                    .body(ByteStream::from_static(b"escape"))
                    .send(),
            );
            assert!(put.is_err(), "{who}: PUT {k:?} was accepted");
            let (st, code) = get_err(&c, k);
            assert!((400..500).contains(&st), "{who}: GET {k:?}: {st} {code}");
        }
    }
    // Nothing was written anywhere: not outside the root, not inside it.
    let mut files = Vec::new();
    let mut stack = vec![dir.path().to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                files.push(e.path());
            }
        }
    }
    for f in &files {
        assert!(
            f.starts_with(dir.path().join("root")),
            "a file outside the storage root: {}",
            f.display()
        );
        assert_ne!(
            std::fs::read(f).unwrap(),
            b"escape",
            "{} was written",
            f.display()
        );
    }
    println!(
        "SECURITY|keys|.., ./, absolute, //, NUL, backslash, control byte, over-long keys via PUT and GET (operator and tenant)|{tried}|all refused with 4xx; no file written"
    );
    rt().block_on(srv.shutdown());
}

#[test]
fn tenants_connectors_are_apart_and_fall_back_from_gather() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path());
    let ep = srv.endpoint();
    let g = KvGeometry::smollm2_135m();
    let ns = unique_ns("tenants");
    let eng = |ak: &str, sk: &str| {
        Engine::with_store(
            store_as(&ep, ak, sk),
            EngineConfig {
                // One stream: a gather load is then exactly one request, so more than one
                // means the ranged-GET fallback.
                gather_streams: 1,
                namespace: ns.clone(),
                lookup_cache_ttl: std::time::Duration::ZERO,
                ..EngineConfig::default()
            },
        )
        .unwrap()
    };
    let (ea, eb) = (eng(A.0, A.1), eng(B.0, B.1));
    let (hs, data) = save_prefix(&ea, &g, 4, 3);
    // Same namespace setting, same tokens, same hashes: B sees nothing of A's.
    assert_eq!(ea.lookup_blocking(&g, &hs).unwrap(), 4);
    assert_eq!(eb.lookup_blocking(&g, &hs).unwrap(), 0);
    let load = |e: &Engine| {
        let h = start_load(e, &g, hs.clone(), data[0].len());
        let mut ready = 0;
        for l in 0..g.layers as usize {
            if h.wait_layer_blocking(l, None).is_ok() {
                assert!(h.layer(l).unwrap() == &data[l][..], "layer {l}");
                ready += 1;
            }
        }
        (ready, h.stats().requests)
    };
    let (ready_b, _) = load(&eb);
    assert_eq!(ready_b, 0, "B loaded A's KV");
    let (ready_a, requests) = load(&ea);
    assert_eq!(ready_a, g.layers as usize);
    assert!(
        requests > 1,
        "gather must be refused on a server with tenants (got {requests} request)"
    );
    println!(
        "SECURITY|tenants|connector of tenant B looks up and loads tenant A's saved prefix|1|lookup 0 of 4, {} of {} layers missed; A loads byte-exact over ranged GETs ({requests} requests; gather refused)",
        g.layers, g.layers
    );
    rt().block_on(srv.shutdown());
}

#[test]
fn bad_tenant_settings_are_refused() {
    let store: Arc<dyn Store> = Arc::new(objectcache::store::MemoryStore::new());
    for (cfg, needle) in [
        (
            {
                let mut c = tenants_config();
                c.tenants[1].namespace = "alpha".into();
                c
            },
            "appears twice",
        ),
        (
            {
                let mut c = tenants_config();
                c.tenants[0].namespace = "../up".into();
                c
            },
            "may hold only",
        ),
        (
            {
                let mut c = tenants_config();
                c.tenants[0].access_key = ACCESS.into();
                c
            },
            "both an operator key and a tenant's",
        ),
    ] {
        let e = rt()
            .block_on(start_err(store.clone(), cfg))
            .expect("the server must refuse these settings");
        assert!(e.contains(needle), "{e}");
    }
    // And the TOML form parses.
    let c = ServerConfig::from_toml(
        "[[tenants]]\naccess_key = \"k\"\nsecret_key = \"s\"\nnamespace = \"team-1\"\nsalt = \"x\"\n",
    )
    .unwrap();
    assert_eq!(c.tenants[0].namespace, "team-1");
    assert!(c.validate().is_ok());
}

async fn start_err(store: Arc<dyn Store>, cfg: ServerConfig) -> Option<String> {
    match objectcache::server::start_with_store(cfg, store).await {
        Ok(h) => {
            h.shutdown().await;
            None
        }
        Err(e) => Some(e.to_string()),
    }
}
