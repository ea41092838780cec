//! The storage conformance suite: every backend must pass every case.
//!
//! Each case is a `pub async fn(&dyn Store, prefix)` that panics on failure; `prefix` isolates
//! runs sharing one bucket. [`conformance_tests!`](crate::conformance_tests) expands to one
//! `#[tokio::test]` per case for a backend, so a failure names its case and hides no other.
//! Not a stable API: it exists for this crate's tests and for out-of-tree backends.

use super::{GetOptions, PutIfAbsent, PutMode, PutOptions, Store, StoreExt};
use crate::error::{StoreError, StoreResult};
use bytes::Bytes;
use futures::StreamExt;

/// The case list, written once: expands to `CALLBACK! { ARGS case, case, ... }` with every
/// case's name in the order `run_all` runs them. `CASES`, `run_all` and `conformance_tests!`
/// are all expanded from it, so a new case is added here and nowhere else.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ([$($callback:tt)*] $($args:tt)*) => {
        $($callback)* ! { $($args)*
            put_get_round_trip, ranged_get, range_body, invalid_range, missing_key, overwrite,
            put_if_absent, head_meta, delete_idempotent, list_prefix, list_pagination, bad_keys,
            large_object, local_file, put_stream
        }
    };
}

macro_rules! case_names {
    ($($case:ident),* $(,)?) => {
        /// Names of every case, in the order [`run_all`] runs them.
        pub const CASES: &[&str] = &[$(stringify!($case)),*];
    };
}
crate::__conformance_cases!([case_names]);

macro_rules! run_cases {
    ($s:ident, $p:ident; $($case:ident),* $(,)?) => {
        $($case($s, $p).await;)*
    };
}

fn pattern(n: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}

/// Put then get returns the same bytes.
pub async fn put_get_round_trip(s: &dyn Store, p: &str) {
    let k = format!("{p}/rt/obj");
    let d = pattern(1000, 1);
    s.put(&k, d.clone()).await.unwrap();
    assert_eq!(s.get_bytes(&k).await.unwrap(), d);
}

/// A ranged get returns exactly the bytes of the range.
pub async fn ranged_get(s: &dyn Store, p: &str) {
    let k = format!("{p}/range/obj");
    let d = pattern(10_000, 2);
    s.put(&k, d.clone()).await.unwrap();
    for r in [0..1, 0..10_000, 5..6, 4096..8192, 9_999..10_000, 123..4567] {
        let got = s.get_range(&k, r.clone()).await.unwrap();
        assert_eq!(
            got,
            d.slice(r.start as usize..r.end as usize),
            "range {r:?}"
        );
    }
    let g = s
        .get_opts(
            &k,
            GetOptions {
                range: Some(10..20),
            },
        )
        .await
        .unwrap();
    assert_eq!(g.meta.size, 10_000);
    assert_eq!(g.range, 10..20);
}

/// A ranged read into the caller's buffers ([`Store::get_range_body`]), where the backend
/// offers one, holds exactly the range's bytes, through reads of any size, then ends (0);
/// a body dropped before its end leaves nothing for the next read to trip on (its
/// connection is not reused half-read), and one read to its end lets the next reads reuse
/// what it leaves. A missing object is never a body: the caller's get names the error.
pub async fn range_body(s: &dyn Store, p: &str) {
    let k = format!("{p}/rangebody/obj");
    let n = 300_000u64;
    let d = pattern(n as usize, 5);
    s.put(&k, d.clone()).await.unwrap();
    // Small and large reads in turn (a CRC trailer, then slice bytes).
    async fn read_all(b: &mut super::RangeBody) -> Vec<u8> {
        let (mut got, mut buf) = (Vec::new(), vec![0u8; 100 << 10]);
        for turn in 0.. {
            let want = if turn % 2 == 0 { 7 } else { buf.len() };
            match b.read(&mut buf[..want]).await.unwrap() {
                0 => break,
                m => got.extend_from_slice(&buf[..m]),
            }
        }
        got
    }
    let ranges = [0..1, 0..n, 5..6, 70_000..200_001, n - 3..n];
    for (i, r) in ranges.iter().cycle().take(15).enumerate() {
        let Some(mut b) = s.get_range_body(&k, r.clone()).await.unwrap() else {
            return;
        };
        assert_eq!((b.meta.size, b.range.clone()), (n, r.clone()), "read {i}");
        if i == 3 {
            // Dropped part way.
            let mut two = [0u8; 2];
            assert_eq!(b.read(&mut two).await.unwrap(), 2);
            assert_eq!(two[..], d[r.start as usize..r.start as usize + 2]);
            continue;
        }
        let got = read_all(&mut b).await;
        assert!(
            got == d[r.start as usize..r.end as usize],
            "read {i}: range {r:?}"
        );
        assert_eq!(b.remaining(), 0);
    }
    let missing = format!("{p}/rangebody/missing");
    let r = s.get_range_body(&missing, 0..10).await;
    assert!(!matches!(r, Ok(Some(_))), "a missing object gave a body");
}

/// A range past the end is an error, not a short read.
pub async fn invalid_range(s: &dyn Store, p: &str) {
    let k = format!("{p}/badrange/obj");
    s.put(&k, pattern(100, 3)).await.unwrap();
    let e = s.get_range(&k, 50..101).await.unwrap_err();
    assert!(matches!(e, StoreError::InvalidRange { .. }), "{e:?}");
}

/// Reads of a missing key are `NotFound`.
pub async fn missing_key(s: &dyn Store, p: &str) {
    let k = format!("{p}/missing/nothing-here");
    assert!(matches!(
        s.get_bytes(&k).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(s.head(&k).await, Err(StoreError::NotFound { .. })));
    assert!(!s.exists(&k).await.unwrap());
}

/// An overwriting put replaces the object whole.
pub async fn overwrite(s: &dyn Store, p: &str) {
    let k = format!("{p}/ow/obj");
    s.put(&k, pattern(500, 4)).await.unwrap();
    s.put(&k, pattern(20, 5)).await.unwrap();
    assert_eq!(s.get_bytes(&k).await.unwrap(), pattern(20, 5));
}

/// Create-only: the first writer wins, the second is told `AlreadyPresent`, bytes unchanged.
pub async fn put_if_absent(s: &dyn Store, p: &str) {
    let k = format!("{p}/pia/obj");
    assert_eq!(
        s.put_if_absent(&k, pattern(64, 6)).await.unwrap(),
        PutIfAbsent::Written
    );
    assert_eq!(
        s.put_if_absent(&k, pattern(64, 7)).await.unwrap(),
        PutIfAbsent::AlreadyPresent
    );
    assert_eq!(s.get_bytes(&k).await.unwrap(), pattern(64, 6));
}

/// Head reports the size.
pub async fn head_meta(s: &dyn Store, p: &str) {
    let k = format!("{p}/head/obj");
    s.put(&k, pattern(777, 8)).await.unwrap();
    let m = s.head(&k).await.unwrap();
    assert_eq!(m.size, 777);
    assert_eq!(m.key, k);
}

/// Delete removes; deleting again succeeds.
pub async fn delete_idempotent(s: &dyn Store, p: &str) {
    let k = format!("{p}/del/obj");
    s.put(&k, pattern(10, 9)).await.unwrap();
    s.delete(&k).await.unwrap();
    assert!(!s.exists(&k).await.unwrap());
    s.delete(&k).await.unwrap();
}

/// List returns exactly the keys under a prefix, sorted.
pub async fn list_prefix(s: &dyn Store, p: &str) {
    for k in ["a/1", "a/2", "a/sub/3", "b/1"] {
        s.put(&format!("{p}/list/{k}"), pattern(3, 1))
            .await
            .unwrap();
    }
    let got: Vec<String> = s
        .list(&format!("{p}/list/a/"), 1000)
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(
        got,
        vec![
            format!("{p}/list/a/1"),
            format!("{p}/list/a/2"),
            format!("{p}/list/a/sub/3")
        ]
    );
    let got = s.list(&format!("{p}/list/"), 1000).await.unwrap();
    assert_eq!(got.len(), 4);
    assert!(got.iter().all(|m| m.size == 3));
    assert!(s
        .list(&format!("{p}/list/zzz"), 1000)
        .await
        .unwrap()
        .is_empty());
}

/// List follows pagination past 1,000 keys (S3's page size) and honours the limit.
pub async fn list_pagination(s: &dyn Store, p: &str) {
    let n = 1050;
    let keys: Vec<String> = (0..n).map(|i| format!("{p}/page/k{i:05}")).collect();
    let futs = keys.iter().map(|k| s.put(k, Bytes::from_static(b"x")));
    for chunk in futs.collect::<Vec<_>>().chunks_mut(64) {
        futures::future::join_all(chunk.iter_mut())
            .await
            .into_iter()
            .for_each(|r| {
                r.unwrap();
            });
    }
    let got = s.list(&format!("{p}/page/"), usize::MAX).await.unwrap();
    assert_eq!(got.len(), n);
    assert_eq!(got.iter().map(|m| m.key.clone()).collect::<Vec<_>>(), keys);
    assert_eq!(s.list(&format!("{p}/page/"), 10).await.unwrap().len(), 10);
}

/// Keys that could escape a root or confuse a gateway are refused.
pub async fn bad_keys(s: &dyn Store, p: &str) {
    for k in [
        String::new(),
        "/abs".into(),
        format!("{p}/../escape"),
        format!("{p}//x"),
        format!("{p}/a\0b"),
        format!("{p}/."),
    ] {
        let e = s.put(&k, Bytes::from_static(b"x")).await.unwrap_err();
        assert!(matches!(e, StoreError::InvalidKey { .. }), "{k:?}: {e:?}");
    }
}

/// A 24 MiB object round-trips byte-exact through ranged reads (bodies arrive in pieces).
pub async fn large_object(s: &dyn Store, p: &str) {
    let k = format!("{p}/large/obj");
    let d = pattern(24 << 20, 11);
    s.put(&k, d.clone()).await.unwrap();
    assert_eq!(s.get_bytes(&k).await.unwrap(), d);
    let r = (5 << 20) + 3..(17 << 20) + 5;
    assert_eq!(
        s.get_range(&k, r.clone()).await.unwrap(),
        d.slice(r.start as usize..r.end as usize)
    );
}

/// A backend that opens objects as local files ([`Store::open_local`], and
/// [`Store::open_local_blocking`] alike) opens exactly the object's bytes, and reports a
/// missing key as not found; the others return `None` from both.
pub async fn local_file(s: &dyn Store, p: &str) {
    use std::io::Read;
    let k = format!("{p}/local/obj");
    let missing = format!("{p}/local/missing");
    let d = pattern(3 << 20, 5);
    s.put(&k, d.clone()).await.unwrap();
    // (A file open on the test's thread: the blocking variant is for blocking threads.)
    let opened = [
        s.open_local(&k).await.unwrap(),
        s.open_local_blocking(&k).unwrap(),
    ];
    let local = opened[0].is_some();
    for o in opened {
        match o {
            None => assert!(!local, "open_local and open_local_blocking disagree"),
            Some(o) => {
                assert!(local, "open_local and open_local_blocking disagree");
                assert_eq!(o.meta().size, d.len() as u64);
                let mut got = Vec::new();
                o.file().read_to_end(&mut got).unwrap();
                assert!(got == d[..], "local file differs from the object");
            }
        }
    }
    for r in [
        s.open_local(&missing).await,
        s.open_local_blocking(&missing),
    ] {
        if local {
            assert!(matches!(r, Err(StoreError::NotFound { .. })), "{r:?}");
        } else {
            assert!(matches!(r, Ok(None)), "{r:?}");
        }
    }
}

/// A wrapper store (one that holds another, such as [`crate::lifecycle::TrackedStore`]) keeps
/// the wrapped store's data paths: local files where the wrapped store has them, and bodies
/// read into place ([`Store::get_range_body`]) where it offers them. The trait's defaults
/// answer "none" for these, so a wrapper that does not forward them silently turns sendfile
/// off. (Gather is not the store's: an engine holds the wrapped store's
/// [`super::Gateways`] beside the wrapper.) Not in [`CASES`]: it takes the wrapped store and
/// its wrapper.
pub async fn wrapper_forwards(inner: &dyn Store, wrapper: &dyn Store, p: &str) {
    let k = format!("{p}/wrapped/obj");
    let d = pattern(4096, 9);
    wrapper.put(&k, d.clone()).await.unwrap();
    let direct = inner.open_local(&k).await.unwrap().is_some();
    assert_eq!(
        wrapper.open_local(&k).await.unwrap().is_some(),
        direct,
        "{}: open_local through the wrapper",
        inner.name()
    );
    assert_eq!(
        wrapper.open_local_blocking(&k).unwrap().is_some(),
        direct,
        "{}: open_local_blocking through the wrapper",
        inner.name()
    );
    assert_eq!(
        wrapper.get_range_body(&k, 0..16).await.unwrap().is_some(),
        inner.get_range_body(&k, 0..16).await.unwrap().is_some(),
        "{}: get_range_body through the wrapper",
        inner.name()
    );
}

/// A streamed put ([`Store::put_stream`]) writes exactly the bytes of its pieces; a body
/// that fails part way, or whose length differs from the one declared, writes nothing (the
/// old object stays, or the key stays absent); create-only streamed puts find an existing
/// object.
pub async fn put_stream(s: &dyn Store, p: &str) {
    let k = format!("{p}/stream/obj");
    let d = pattern(9 << 20, 13);
    let pieces = |d: &Bytes| -> Vec<StoreResult<Bytes>> {
        (0..d.len())
            .step_by(1 << 20)
            .map(|a| Ok(d.slice(a..(a + (1 << 20)).min(d.len()))))
            .collect()
    };
    for len in [Some(d.len() as u64), None] {
        s.delete(&k).await.unwrap();
        let body = futures::stream::iter(pieces(&d)).boxed();
        s.put_stream(&k, body, len, PutOptions::default())
            .await
            .unwrap();
        assert!(
            s.get_bytes(&k).await.unwrap() == d,
            "streamed object differs ({len:?})"
        );
    }
    // A body that fails part way: the old object stays.
    let mut bad = pieces(&pattern(9 << 20, 14));
    bad[5] = Err(StoreError::other("test", "client went away"));
    let r = s
        .put_stream(
            &k,
            futures::stream::iter(bad).boxed(),
            Some(d.len() as u64),
            PutOptions::default(),
        )
        .await;
    assert!(r.is_err(), "a failed body must fail the put");
    assert!(
        s.get_bytes(&k).await.unwrap() == d,
        "a failed streamed put changed the object"
    );
    // A body shorter than declared: nothing written.
    let k2 = format!("{p}/stream/short");
    let short = futures::stream::iter(pieces(&d).into_iter().take(3)).boxed();
    let r = s
        .put_stream(&k2, short, Some(d.len() as u64), PutOptions::default())
        .await;
    assert!(r.is_err(), "a short body must fail the put");
    assert!(matches!(
        s.head(&k2).await,
        Err(StoreError::NotFound { .. })
    ));
    // Create-only.
    let r = s
        .put_stream(
            &k,
            futures::stream::iter(pieces(&d)).boxed(),
            Some(d.len() as u64),
            PutOptions {
                mode: PutMode::Create,
            },
        )
        .await;
    assert!(matches!(r, Err(StoreError::AlreadyExists { .. })), "{r:?}");
    // Nothing of the failed writes is left behind.
    let partial = s.list_partial(&format!("{p}/stream/")).await.unwrap();
    assert!(partial.is_empty(), "{partial:?}");
}

/// Runs every case in order (for ad-hoc use; tests use the macro).
pub async fn run_all(s: &dyn Store, p: &str) {
    crate::__conformance_cases!([run_cases] s, p;);
}

/// Expands to one `#[tokio::test]` per conformance case.
///
/// `$make` is an async expression returning `Option<(S, String)>`: the store and a unique key
/// prefix, or `None` when the backend is unavailable (the test then fails if the environment
/// variable `OBJECTCACHE_REQUIRE_ALL` is set, as in CI, and otherwise prints a skip).
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::__conformance_cases!([$crate::conformance_tests] @cases $make;);
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                match $make.await {
                    Some((store, prefix)) => {
                        $crate::store::conformance::$case(&store, &prefix).await;
                    }
                    None => {
                        if std::env::var_os("OBJECTCACHE_REQUIRE_ALL").is_some() {
                            panic!("backend unavailable but OBJECTCACHE_REQUIRE_ALL is set");
                        }
                        eprintln!("SKIP {}: backend unavailable", stringify!($case));
                    }
                }
            }
        )*
    };
}
