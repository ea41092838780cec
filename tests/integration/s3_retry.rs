//! Retries, timeouts and failure mapping of the S3 backend against a scripted HTTP server on a
//! real loopback socket (the SDK and its HTTP client run unchanged): failures are bounded and
//! reported as errors, never as data (case C2's storage side).
#![cfg(feature = "s3")]

use crate::s3_support;

use bytes::Bytes;
use futures::StreamExt;
use objectcache::store::{GetOptions, PutIfAbsent, S3Store, Store, StoreExt};
use objectcache::{StoreError, StoreResult};
use s3_support::{Reply, ScriptedServer};
use std::time::Duration;

fn ok_body(body: &[u8]) -> Reply {
    Reply::Full {
        status: 200,
        headers: vec![("etag", "\"e1\"".into())],
        body: body.to_vec(),
    }
}

/// A scripted server answering every request with `reply()`, and a store on it that makes
/// `attempts` attempts of each request.
async fn always(
    reply: impl Fn() -> Reply + Send + Sync + 'static,
    attempts: u32,
) -> (ScriptedServer, S3Store) {
    let srv = ScriptedServer::start(move |_, _| reply()).await;
    let store = S3Store::new(srv.config(attempts)).await.unwrap();
    (srv, store)
}

#[tokio::test]
async fn slowdown_is_retried_a_bounded_number_of_times_then_reported() {
    let (srv, store) = always(
        || Reply::s3_error(503, "SlowDown", "Please reduce your request rate."),
        3,
    )
    .await;
    let e = store.get_bytes("k/obj").await.unwrap_err();
    assert_eq!(srv.requests(), 3, "3 attempts allowed");
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Other { .. }), "{e:?}");
    assert!(msg.contains("503") && msg.contains("SlowDown"), "{msg}");

    let e = store
        .put("k/obj", Bytes::from_static(b"data"))
        .await
        .unwrap_err();
    assert_eq!(srv.requests(), 6, "3 more attempts for the put");
    assert!(e.to_string().contains("SlowDown"), "{e}");
}

#[tokio::test]
async fn server_errors_are_retried_and_a_later_success_returns_the_bytes() {
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let d2 = data.clone();
    let srv = ScriptedServer::start(move |n, _| match n {
        0 => Reply::s3_error(500, "InternalError", "We encountered an internal error."),
        1 => Reply::s3_error(503, "SlowDown", "Please reduce your request rate."),
        _ => ok_body(&d2),
    })
    .await;
    let store = S3Store::new(srv.config(4)).await.unwrap();
    assert_eq!(store.get_bytes("k/obj").await.unwrap(), Bytes::from(data));
    assert_eq!(srv.requests(), 3);
}

#[tokio::test]
async fn a_chunk_answering_500_on_every_try_is_an_error_after_max_attempts() {
    // C2: the store answers this GET with HTTP 500 on every try.
    let (srv, store) = always(
        || Reply::s3_error(500, "InternalError", "We encountered an internal error."),
        4,
    )
    .await;
    let e = store.get_range("chunk/7", 0..4096).await.unwrap_err();
    assert_eq!(srv.requests(), 4);
    assert!(e.to_string().contains("500"), "{e}");
    assert!(
        srv.seen()
            .iter()
            .all(|r| r.line.starts_with("GET /bucket/chunk/7?")),
        "{:?}",
        srv.seen()
    );
    assert!(srv.seen().iter().all(|r| r
        .headers
        .iter()
        .any(|(k, v)| k == "range" && v == "bytes=0-4095")));
}

#[tokio::test]
async fn a_body_cut_halfway_is_an_error_not_data() {
    // C2, second run: the connection closes halfway through the body.
    let (_srv, store) = always(
        || Reply::Cut {
            headers: vec![],
            declared: 1000,
            body: vec![7u8; 400],
        },
        3,
    )
    .await;
    let e = store.get_bytes("k/obj").await.unwrap_err();
    assert!(e.to_string().contains("1000"), "{e}");

    // A streaming reader sees at most the bytes that arrived, then an error, never a clean end.
    let g = store
        .get_opts("k/obj", GetOptions::default())
        .await
        .unwrap();
    let items: Vec<StoreResult<Bytes>> = g.body.collect().await;
    let got: usize = items
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .map(|b| b.len())
        .sum();
    assert!(got <= 400, "{got}");
    assert!(
        items.last().is_some_and(|r| r.is_err()),
        "stream must end in an error"
    );
}

#[tokio::test]
async fn a_stalled_body_times_out_instead_of_hanging() {
    let (_srv, store) = always(
        || Reply::Stall {
            headers: vec![],
            declared: 1000,
            body: vec![1u8; 100],
            stall: Duration::from_secs(5),
        },
        2,
    )
    .await;
    let e = store.get_bytes("k/obj").await.unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
}

#[tokio::test]
async fn client_errors_are_not_retried_and_map_to_their_meaning() {
    // The store's one conditional-PUT check (case C17) meets a server that honours it.
    let checks = std::sync::atomic::AtomicUsize::new(0);
    let srv = ScriptedServer::start(move |_, req| {
        let path = req.line.split(' ').nth(1).unwrap_or("").to_string();
        if path.starts_with("/bucket/_objectcache/conditional-put-check/") {
            let ok = |status| Reply::Full {
                status,
                headers: vec![],
                body: vec![],
            };
            if req.line.starts_with("DELETE") {
                ok(204)
            } else if checks.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                ok(200)
            } else {
                Reply::s3_error(
                    412,
                    "PreconditionFailed",
                    "At least one of the pre-conditions you specified did not hold",
                )
            }
        } else if path.starts_with("/bucket/missing") {
            if req.line.starts_with("HEAD") {
                Reply::Full {
                    status: 404,
                    headers: vec![],
                    body: vec![],
                }
            } else {
                Reply::s3_error(404, "NoSuchKey", "The specified key does not exist.")
            }
        } else if path.starts_with("/bucket/taken") {
            Reply::s3_error(
                412,
                "PreconditionFailed",
                "At least one of the pre-conditions you specified did not hold",
            )
        } else if path.starts_with("/bucket/secret") {
            Reply::s3_error(403, "AccessDenied", "Access Denied")
        } else {
            Reply::s3_error(400, "InvalidArgument", "nope")
        }
    })
    .await;
    let store = S3Store::new(srv.config(4)).await.unwrap();
    assert!(matches!(
        store.head("missing/a").await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(
        store.get_bytes("missing/a").await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(!store.exists("missing/a").await.unwrap());
    assert_eq!(
        store
            .put_if_absent("taken/a", Bytes::from_static(b"x"))
            .await
            .unwrap(),
        PutIfAbsent::AlreadyPresent
    );
    let create = srv.seen().last().unwrap().clone();
    assert!(
        create
            .headers
            .iter()
            .any(|(k, v)| k == "if-none-match" && v == "*"),
        "{create:?}"
    );
    assert!(matches!(
        store.get_bytes("secret/a").await,
        Err(StoreError::PermissionDenied { .. })
    ));
    let ours = srv
        .seen()
        .iter()
        .filter(|r| !r.line.contains("/_objectcache/"))
        .count();
    assert_eq!(ours, 5, "one request each, no retries on 4xx");
    assert_eq!(
        srv.requests(),
        5 + 3,
        "and the conditional-PUT check: PUT, PUT, DELETE"
    );
}
