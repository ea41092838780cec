//! The server's S3 API with gather off (ranged GETs) through the HTTP fault proxy.

use super::*;

/// The server's S3 API with gather off (ranged GETs) through the HTTP fault proxy.
#[test]
fn s3_api_of_the_server_under_http_faults() {
    let _alone = crate::alone();
    let dir = tempfile::tempdir().unwrap();
    let backend: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let server = rt().block_on(start(backend, config()));
    let addr = server.local_addr();
    let mk = |url: &str| ours(url);
    let t = Duration::from_secs(20);
    for (i, (name, fault, timeout)) in [
        ("500 InternalError on every try", Fault::e500(), t),
        ("503 SlowDown on every try", Fault::slowdown(), t),
        ("reset before answering", Fault::ResetNow, t),
        ("truncated body at 0.5", Fault::Truncate(0.5), t),
        ("flipped byte at 0.0", Fault::Flip(0.0), t),
        ("flipped byte at 0.5", Fault::Flip(0.5), t),
        ("flipped byte at 1.0", Fault::Flip(1.0), t),
        (
            "reset halfway through the body",
            Fault::ResetMidBody(0.5),
            t,
        ),
        (
            "stall with the connection open",
            Fault::Stall(0.5),
            Duration::from_secs(4),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        victim_case_on(
            addr,
            &unique_ns(&format!("s3api{i}")),
            &format!("ranged GET: {name}"),
            fault,
            timeout,
            &mk,
            "server-s3",
        );
    }
    rt().block_on(server.shutdown());
}
