//! Fault injection on the stock S3 path: the connector's `S3Store` talks to a real S3 server
//! (Ceph RGW in CI; `OBJECTCACHE_TEST_S3_ENDPOINT`) through a fault-injecting TCP proxy.
//!
//! Every case checks the same invariants:
//! - **never garbage KV**: every layer that becomes ready holds exactly the saved bytes
//!   (compared byte for byte); a failed layer is a miss;
//! - **never a hang**: every wait returns (the load deadline `load_timeout` ends stalls);
//! - **bounded retries**: the proxy counts the attempts of each ranged GET, at most
//!   `max_attempts`;
//! - an interrupted save never makes lookup report a chunk whose data is missing.
//!
//! Each case prints one `FAULT|...` line (case, runs, outcome) that `docs/reliability.md`
//! collects (`cargo test --release --test integration fault_s3:: -- --nocapture | grep '^FAULT|'`).
#![cfg(feature = "s3")]

use crate::common;
use crate::fault_proxy;
use crate::s3_faults;

use common::*;
use fault_proxy::{Fault, FaultProxy};
use objectcache::connector::{Engine, EngineConfig, LayerStatus};
use objectcache::layout::SegmentHeader;
use objectcache::store::StoreExt;
use s3_faults::*;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// [`victim_case`] on a prefix of its own at the test endpoint (nothing, after SKIP, when it
/// is down).
fn victim_at_endpoint(case: &str, fault: Fault, timeout: Duration) {
    let Some((addr, ns)) = endpoint() else { return };
    victim_case(addr, &ns, case, fault, timeout);
}

/// [`victim_case`] with `fault(at)` at each place `at` of the body (a fraction of it), each
/// on a prefix of its own at the test endpoint, named "`what` at `at`"; nothing, after SKIP,
/// when the endpoint is down.
fn victim_at_each_place(what: &str, places: [f64; 3], fault: fn(f64) -> Fault) {
    let Some((addr, ns)) = endpoint() else { return };
    for (i, at) in places.into_iter().enumerate() {
        victim_case(
            addr,
            &format!("{ns}-{i}"),
            &format!("{what} at {at}"),
            fault(at),
            Duration::from_secs(20),
        );
    }
}

#[test]
fn c2_http_500_on_every_try_is_a_miss() {
    victim_at_endpoint(
        "C2 500 on every try",
        Fault::e500(),
        Duration::from_secs(20),
    );
}

#[test]
fn c2_reset_halfway_through_body_is_a_miss() {
    victim_at_endpoint(
        "C2 reset halfway through the body",
        Fault::ResetMidBody(0.5),
        Duration::from_secs(20),
    );
}

#[test]
fn truncated_body_is_a_miss() {
    victim_at_each_place("truncated body", [0.0, 0.3, 0.99], Fault::Truncate);
}

#[test]
fn flipped_byte_is_a_miss() {
    victim_at_each_place("flipped byte", [0.0, 0.5, 1.0], Fault::Flip);
}

#[test]
fn stall_with_connection_open_ends_by_deadline() {
    victim_at_endpoint(
        "stall mid-body, connection open",
        Fault::Stall(0.5),
        Duration::from_secs(6),
    );
}

#[test]
fn reset_before_response_is_a_miss() {
    victim_at_endpoint(
        "reset before response",
        Fault::ResetNow,
        Duration::from_secs(20),
    );
}

#[test]
fn slow_drip_never_yields_garbage() {
    let Some((addr, ns)) = endpoint() else { return };
    // Every GET drips 64 bytes per 20 ms; the deadline cuts the load short.
    let f = fixture(addr, &ns, 11, Duration::from_secs(3));
    f.proxy.set_rule(Fault::on_gets(Fault::Drip {
        bytes: 64,
        every: Duration::from_millis(20),
    }));
    // Two requests in flight: the drip makes the load outlast its deadline part way.
    let slow = Engine::with_store(
        s3(&f.proxy.url()),
        EngineConfig {
            namespace: f.engine.config().namespace.clone(),
            load_timeout: Some(Duration::from_secs(3)),
            coalesce_bytes: 0,
            max_requests: 2,
            gather: false,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let f = Fixture { engine: slow, ..f };
    let o = load_and_check(&f, "slow drip");
    assert_eq!(o.ready + o.failed, f.g.layers as usize);
    report(
        "slow drip (64 B / 20 ms, 2 GETs in flight, 3 s deadline)",
        1,
        &format!(
            "{} layers ready (byte-exact), {} missed by the deadline",
            o.ready, o.failed
        ),
    );
}

#[test]
fn random_faults_never_yield_garbage() {
    let Some((addr, ns)) = endpoint() else { return };
    let f = fixture(addr, &ns, 17, Duration::from_secs(4));
    let faults = [
        Fault::Pass,
        Fault::e500(),
        Fault::slowdown(),
        Fault::ResetNow,
        Fault::Truncate(0.5),
        Fault::Flip(0.25),
        Fault::ResetMidBody(0.5),
        Fault::Stall(0.1),
    ];
    let mut x: u64 = 0x243f_6a88_85a3_08d3;
    let runs = 12;
    let (mut ready, mut missed) = (0, 0);
    for run in 0..runs {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let seed = x;
        let fl = faults.clone();
        f.proxy.set_rule(move |r| {
            if r.method != "GET" {
                return Fault::Pass;
            }
            // Deterministic per (run, request): a fault one time in three.
            let mut y = seed ^ r.seq.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            y ^= y >> 29;
            if y.is_multiple_of(3) {
                fl[(y / 3) as usize % fl.len()].clone()
            } else {
                Fault::Pass
            }
        });
        let o = load_and_check(&f, &format!("random faults run {run}"));
        ready += o.ready;
        missed += o.failed;
    }
    let att = attempts(&f.proxy, |_| true);
    let worst = att.values().copied().max().unwrap_or(0);
    // Retries can repeat a range across runs; per run each range is bounded.
    assert!(worst <= MAX_ATTEMPTS * runs as u32);
    let faulted = f
        .proxy
        .requests()
        .iter()
        .filter(|r| r.fault != "pass")
        .count();
    report(
        "random mix (500, 503, reset, truncate, flip, reset mid-body, stall) on 1 GET in 3",
        runs,
        &format!("{faulted} faults injected; {ready} layers ready byte-exact, {missed} missed"),
    );
}

#[test]
fn proxy_killed_mid_load_is_a_miss() {
    let Some((addr, ns)) = endpoint() else { return };
    let mut f = fixture(addr, &ns, 19, Duration::from_secs(10));
    // Slow the reads down, start the load, then kill the proxy (every connection drops,
    // further connects are refused).
    f.proxy.set_rule(Fault::on_gets(Fault::Drip {
        bytes: 64,
        every: Duration::from_millis(50),
    }));
    f.proxy.clear_log();
    let per_layer = CHUNKS * f.g.slice_bytes() as usize;
    let h = start_load(&f.engine, &f.g, f.hashes.clone(), per_layer);
    // Kill it once the load's first ranged GET is on its way (the drip holds it there).
    common::eventually(
        "a ranged GET of the load at the proxy",
        Duration::from_secs(60),
        || f.proxy.requests().iter().any(|r| r.method == "GET"),
    );
    let dead = FaultProxy::http(addr, |_| Fault::Pass);
    drop(std::mem::replace(&mut f.proxy, dead));
    let (mut ready, mut missed) = (0, 0);
    for l in 0..f.g.layers as usize {
        match h.wait_layer_blocking(l, Some(Duration::from_secs(120))) {
            Ok(()) => {
                assert_eq!(h.layer(l).unwrap(), &f.data[l][..], "layer {l}");
                ready += 1;
            }
            Err(_) => {
                assert!(h.layer(l).is_none());
                assert!(matches!(h.poll_layer(l), LayerStatus::Failed(_)));
                missed += 1;
            }
        }
    }
    assert!(
        missed > 0,
        "the load finished before the kill; slow it down"
    );
    report(
        "endpoint killed mid-load",
        1,
        &format!("{ready} layers ready byte-exact before the kill, {missed} missed"),
    );
}

/// Saves through the proxy with PUTs failing from the `k`-th on (every try), for every `k`;
/// after each, a fresh engine's lookup must only count chunks whose data loads byte-exact.
#[test]
fn interrupted_save_leaves_no_visible_partial_prefix() {
    let Some((addr, ns)) = endpoint() else { return };
    let g = geometry();
    let direct_store = s3(&format!("http://{addr}"));
    let mut cases = 0;
    // 2 x CHUNKS PUTs in a full save (data objects, then markers).
    // 500 and reset-before-forwarding never reach the server; "response lost" reaches it and
    // then resets, so the write happened but the client saw a failure.
    for (mode, fault) in [
        ("500", Fault::e500()),
        ("reset", Fault::ResetNow),
        ("response lost", Fault::ResetMidBody(0.0)),
    ] {
        for k in 0..=2 * CHUNKS as u64 {
            let nsk = format!("{ns}-{}-{k}", mode.replace(' ', "_"));
            let seed = 100 + k;
            let (hs, data) = seeded_prefix(&g, CHUNKS, seed);
            let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            let puts = Arc::new(Mutex::new(0u64));
            let p2 = puts.clone();
            let fk = fault.clone();
            let proxy = FaultProxy::http(addr, move |r| {
                // The store's one conditional-PUT check (case C17) is not a PUT of the save.
                if r.method != "PUT" || r.path().contains("/_objectcache/") {
                    return Fault::Pass;
                }
                let mut n = p2.lock().unwrap();
                *n += 1;
                if *n > k {
                    fk.clone()
                } else {
                    Fault::Pass
                }
            });
            let mut cfg = EngineConfig {
                namespace: nsk.clone(),
                save_concurrency: 1,
                gather: false,
                ..EngineConfig::default()
            };
            cfg.lookup_cache_ttl = Duration::ZERO;
            let e = Engine::with_store(s3(&proxy.url()), cfg).unwrap();
            let r = e.save_blocking(&g, &hs, &refs);
            if k >= 2 * CHUNKS as u64 {
                r.unwrap();
            } else if mode != "response lost" {
                assert!(r.is_err(), "{mode}: save with PUT {k} failing succeeded");
            }
            // With "response lost", the SDK's retry of a create-only PUT finds the object
            // (412) and the save may succeed: first writer wins, the bytes are ours.
            drop(proxy);
            // A fresh engine on a clean path.
            let fresh = engine_on(direct_store.clone(), &nsk, Duration::from_secs(20));
            let hit = fresh.lookup_blocking(&g, &hs).unwrap();
            // Markers are written only after every data object: a failed data phase
            // publishes nothing; the marker phase publishes a prefix.
            let published = (k as usize).saturating_sub(CHUNKS);
            if mode != "response lost" {
                assert_eq!(hit, published, "{mode} at PUT {k}: lookup says {hit}");
            }
            if hit > 0 {
                let h = load_first(&fresh, &g, &hs, hit);
                for l in 0..g.layers as usize {
                    let want = &data[l][..hit * g.slice_bytes() as usize];
                    assert_eq!(h.layer(l).unwrap(), want, "{mode} at PUT {k}: layer {l}");
                }
            }
            // Every published marker's data object exists.
            let keys = fresh.keys(&g).unwrap();
            let rt = rt();
            for h in &hs {
                let m = rt.block_on(direct_store.exists(&keys.marker(h))).unwrap();
                let d = rt.block_on(direct_store.exists(&keys.data(h))).unwrap();
                assert!(!m || d, "{mode} at PUT {k}: marker without data");
            }
            cases += 1;
        }
    }
    report(
        "save interrupted at each PUT (500 every try; reset; response lost after the write)",
        cases,
        "lookup = published prefix only; every hit byte-exact; no marker without data",
    );
}

/// Case C17: an S3 endpoint whose conditional PUT is broken, in two ways (it ignores
/// `If-None-Match: *`: the proxy turns the real server's 412 into 200; or it answers every
/// create-only PUT with 412). The
/// store checks once (a create-only PUT of a new key must succeed, a second must get 412)
/// and refuses every save with an error naming the problem, so two writers of one chunk can
/// never leave a torn or mixed entry; loads of what is stored still work.
#[test]
fn c17_broken_conditional_put_is_detected_and_saves_are_refused() {
    let Some((addr, ns)) = endpoint() else { return };
    let g = geometry();
    let (hs, data) = seeded_prefix(&g, CHUNKS, 17);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    // Saved directly (the real server honours If-None-Match): loads through the broken
    // endpoints below still work.
    engine_on(s3(&format!("http://{addr}")), &ns, Duration::from_secs(20))
        .save_blocking(&g, &hs, &refs)
        .unwrap();
    let ignores = |r: &fault_proxy::Request| {
        if r.method == "PUT" && r.header("if-none-match").is_some() {
            Fault::ReplaceStatus(412, 200)
        } else {
            Fault::Pass
        }
    };
    let refuses = |r: &fault_proxy::Request| {
        if r.method == "PUT" && r.header("if-none-match").is_some() {
            Fault::Status(412, "PreconditionFailed")
        } else {
            Fault::Pass
        }
    };
    let cases: [(
        &str,
        Box<dyn Fn(&fault_proxy::Request) -> Fault + Send + Sync>,
        &str,
    ); 2] = [
        (
            "ignores If-None-Match",
            Box::new(ignores),
            "ignores If-None-Match",
        ),
        (
            "refuses every create-only PUT",
            Box::new(refuses),
            "refused a create-only PUT",
        ),
    ];
    for (name, rule, want) in cases {
        let proxy = FaultProxy::http(addr, rule);
        let e = engine_on(s3(&proxy.url()), &ns, Duration::from_secs(20));
        let other = hashes(&g, CHUNKS * g.tokens_per_chunk as usize, 1700);
        let err = e.save_blocking(&g, &other, &refs).unwrap_err().to_string();
        assert!(
            err.contains(want) && err.contains("If-None-Match"),
            "{name}: {err}"
        );
        // Checked once per store: the second save is refused without a new probe.
        let probes = |p: &FaultProxy| {
            p.requests()
                .iter()
                .filter(|r| r.path().contains("_objectcache/conditional-put-check"))
                .filter(|r| r.method == "PUT")
                .count()
        };
        let before = probes(&proxy);
        assert!(e.save_blocking(&g, &other, &refs).is_err());
        assert_eq!(probes(&proxy), before, "{name}: the verdict is cached");
        // Nothing of the refused saves became visible.
        assert_eq!(e.lookup_blocking(&g, &other).unwrap(), 0, "{name}");
        // What is stored still loads, byte-exact.
        assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), CHUNKS, "{name}");
        let h = start_load(&e, &g, hs.clone(), CHUNKS * g.slice_bytes() as usize);
        h.wait_all_blocking().unwrap();
        for l in 0..g.layers as usize {
            assert_eq!(h.layer(l).unwrap(), &data[l][..], "{name}: layer {l}");
        }
    }
    report(
        "C17 conditional PUT ignored / always 412",
        2,
        "detected once per store; saves refused naming If-None-Match; loads byte-exact",
    );
}

/// Case C18: third-party S3 servers and the SDK's checksum defaults. One endpoint refuses
/// any request carrying `x-amz-checksum-*` or `x-amz-sdk-checksum-algorithm` with 501;
/// another never returns checksum headers. An 8 MiB chunk saves and loads on both (the
/// store sends and demands checksums only where S3 requires them), and each layer's own
/// CRC32C is still verified: a flipped body byte is a miss.
#[test]
fn c18_checksum_headers_refused_or_never_returned() {
    let Some((addr, ns)) = endpoint() else { return };
    // 8 MiB chunk: 8 layers of 1 MiB (256 tokens x 4 KiB per token per layer).
    let mut g =
        objectcache::KvGeometry::new("test/c18", 8, 8, 128, objectcache::Dtype::Bf16).unwrap();
    g.tokens_per_chunk = 256;
    assert_eq!(g.slice_bytes() * g.layers as u64, 8 << 20);
    let refuses = |r: &fault_proxy::Request| {
        if r.has_header_prefix("x-amz-checksum-")
            || r.has_header_prefix("x-amz-sdk-checksum-algorithm")
        {
            Fault::Status(501, "NotImplemented")
        } else {
            Fault::Pass
        }
    };
    let never_returns = |_: &fault_proxy::Request| Fault::Strip {
        request: &[],
        response: &["x-amz-checksum-"],
    };
    let cases: [(
        &str,
        Box<dyn Fn(&fault_proxy::Request) -> Fault + Send + Sync>,
    ); 2] = [
        ("refuses checksum headers (501)", Box::new(refuses)),
        ("never returns checksum headers", Box::new(never_returns)),
    ];
    for (i, (name, rule)) in cases.into_iter().enumerate() {
        let proxy = FaultProxy::http(addr, rule);
        let e = engine_on(
            s3(&proxy.url()),
            &format!("{ns}-{i}"),
            Duration::from_secs(30),
        );
        let (hs, data) = seeded_prefix(&g, 1, 18 + i as u64);
        let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
        e.save_blocking(&g, &hs, &refs)
            .unwrap_or_else(|err| panic!("{name}: {err}"));
        let load = |e: &Engine| {
            let h = start_load(e, &g, hs.clone(), g.slice_bytes() as usize);
            let _ = h.wait_all_blocking();
            h
        };
        let h = load(&e);
        for l in 0..g.layers as usize {
            assert_eq!(h.layer(l).unwrap(), &data[l][..], "{name}: layer {l}");
        }
        assert!(
            !proxy.requests().iter().any(|r| r.status == 501),
            "{name}: no request carried checksum headers"
        );
        // Our own CRC32C still guards every layer: flip one byte of every GET body.
        proxy.set_rule(Fault::on_gets(Fault::Flip(0.5)));
        let h = load(&e);
        assert!(
            (0..g.layers as usize).any(|l| !matches!(h.poll_layer(l), LayerStatus::Ready)),
            "{name}: a flipped byte must be a miss"
        );
        for l in 0..g.layers as usize {
            if matches!(h.poll_layer(l), LayerStatus::Ready) {
                assert_eq!(h.layer(l).unwrap(), &data[l][..], "{name}: layer {l}");
            }
        }
    }
    report(
        "C18 checksum headers refused (501) / never returned",
        2,
        "8 MiB chunk saved and loaded byte-exact on both; a flipped byte is still a miss",
    );
}

/// Case C17's check when the answer to its first create-only PUT is lost after the write
/// (the proxy forwards it, then resets the connection): the client retries, meets the
/// object its first try made and gets 412. The endpoint does honour `If-None-Match`, so the
/// check must pass (it looks for the object) and saves go ahead; before, such a retry
/// refused every save of the store as "conditional PUTs are broken".
#[test]
fn c17_check_survives_a_lost_answer_to_its_first_put() {
    let Some((addr, ns)) = endpoint() else { return };
    let g = geometry();
    let (hs, data) = seeded_prefix(&g, CHUNKS, 171);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    let probe_puts = Arc::new(Mutex::new(0u32));
    let seen = probe_puts.clone();
    let proxy = FaultProxy::http(addr, move |r| {
        if r.method == "PUT" && r.path().contains("_objectcache/conditional-put-check") {
            let mut n = seen.lock().unwrap();
            *n += 1;
            if *n == 1 {
                return Fault::ResetMidBody(0.0);
            }
        }
        Fault::Pass
    });
    let e = engine_on(
        s3(&proxy.url()),
        &format!("{ns}-lost-probe"),
        Duration::from_secs(20),
    );
    e.save_blocking(&g, &hs, &refs).unwrap();
    let puts = *probe_puts.lock().unwrap();
    assert!(puts >= 2, "the lost PUT was retried ({puts} probe PUTs)");
    assert_eq!(e.lookup_blocking(&g, &hs).unwrap(), CHUNKS);
    let h = load_first(&e, &g, &hs, CHUNKS);
    for l in 0..g.layers as usize {
        assert!(h.layer(l).unwrap() == &data[l][..], "layer {l}");
    }
    // The probe object is removed.
    assert!(
        proxy
            .requests()
            .iter()
            .any(|r| r.method == "DELETE" && r.path().contains("conditional-put-check")),
        "no DELETE of the probe object"
    );
    report(
        "C17 check with its first PUT's answer lost",
        1,
        "the retry's 412 is told from a broken endpoint; saves go ahead",
    );
}

/// Object format version 2 (segment objects) on the stock S3 path: a fault on one ranged GET
/// of a segment is a miss for exactly the layer that read carries, never bytes; a fault on
/// the read that carries the segment's header is a miss for every layer (nothing of the
/// segment is trusted before its header matched); each GET is tried at most `MAX_ATTEMPTS`
/// times, and once the fault is gone the same engine loads the prefix byte for byte.
#[test]
fn segment_faults_are_misses_of_exactly_the_layers_they_touch() {
    let Some((addr, ns)) = endpoint() else { return };
    let g = geometry();
    let (hs, data) = seeded_prefix(&g, CHUNKS, 31);
    let v2 = |url: &str| {
        let mut cfg = EngineConfig {
            namespace: ns.clone(),
            load_timeout: Some(Duration::from_secs(20)),
            // No lookup answers kept: each load reads the markers itself (one GET each).
            lookup_cache_ttl: Duration::ZERO,
            gather: false,
            ..EngineConfig::default()
        };
        cfg.set("save_format", "v2").unwrap();
        Engine::with_store(s3(url), cfg).unwrap()
    };
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    let saved = v2(&format!("http://{addr}"))
        .save_blocking(&g, &hs, &refs)
        .unwrap();
    assert_eq!(saved.written, CHUNKS, "{saved:?}");
    // The one segment and its header length: layer l's read starts at H + l x chunks x
    // (slice + 4) (docs/object-format.md), layer 0's at 0 with the header.
    let direct = s3(&format!("http://{addr}"));
    let seg = rt()
        .block_on(direct.list(&format!("{ns}/"), 1000))
        .unwrap()
        .into_iter()
        .find(|m| m.key.contains("/seg/"))
        .expect("the v2 save wrote no segment");
    let head = rt()
        .block_on(direct.get_range(&seg.key, 0..seg.size.min(4096)))
        .unwrap();
    let h = SegmentHeader::decode(&head).unwrap();
    assert_eq!(h.chunks as usize, CHUNKS);
    let layer_start = |l: u64| match l {
        0 => 0,
        _ => h.header_len as u64 + l * CHUNKS as u64 * (g.slice_bytes() + 4),
    };
    let proxy = FaultProxy::http(addr, |_| Fault::Pass);
    let engine = v2(&proxy.url());
    let all: Vec<usize> = (0..g.layers as usize).collect();
    let cases = [
        ("500 on every try", Fault::e500(), 3, vec![3]),
        ("reset halfway", Fault::ResetMidBody(0.5), 3, vec![3]),
        ("truncated", Fault::Truncate(0.3), 3, vec![3]),
        ("flipped byte", Fault::Flip(0.5), 3, vec![3]),
        ("stalled", Fault::Stall(0.5), 3, vec![3]),
        ("header read 500", Fault::e500(), 0, all.clone()),
        ("header byte flipped", Fault::Flip(0.0), 0, all.clone()),
    ];
    for (what, fault, layer, misses) in cases {
        let case = format!("segment, {what} (layer {layer}'s read)");
        let range = format!("bytes={}-", layer_start(layer));
        let (f, seg_key, r) = (fault.clone(), seg.key.clone(), range.clone());
        proxy.set_rule(move |q| {
            let hit = q.method == "GET"
                && q.path().ends_with(&seg_key)
                && q.range.as_deref().is_some_and(|v| v.starts_with(&r));
            if hit {
                f.clone()
            } else {
                Fault::Pass
            }
        });
        proxy.clear_log();
        let o = load_checked(&engine, &g, &hs, &data, &case);
        assert_eq!(o.failed_layers, misses, "{case}: {o:?}");
        let att = attempts(&proxy, |q| {
            q.path().ends_with(&seg.key)
                && q.range.as_deref().is_some_and(|v| v.starts_with(&range))
        });
        let worst = att.values().copied().max().unwrap_or(0);
        assert!(
            (1..=MAX_ATTEMPTS).contains(&worst),
            "{case}: the faulty read was tried {worst} times: {att:?}"
        );
        proxy.set_rule(|_| Fault::Pass);
        let clean = load_checked(&engine, &g, &hs, &data, &format!("{case}/after"));
        assert_eq!(clean.ready, g.layers as usize, "{case}: {clean:?}");
        report(
            &case,
            1,
            &format!(
                "layers {:?} missed of {}, at most {worst} attempts; clean reload byte-exact",
                o.failed_layers, g.layers
            ),
        );
    }
}
