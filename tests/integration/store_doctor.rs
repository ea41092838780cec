//! The store self-check (`objectcache doctor`, `store::doctor`, issue 43 part 3) on real
//! stores: the file store, Ceph RGW and moto pass clean; behind the fault proxy, RGW that
//! ignores `If-None-Match` (answers a refused create-only PUT 200) and RGW whose ranged GETs
//! return a flipped byte are refused, each naming its check; a server that closes idle
//! connections after 0.3 s gets the short-idle mode with an idle timeout below that. The
//! command itself: exit 0 with a JSON report on a clean store, non-zero naming the check on
//! a refused one. The engine's own check (`self_check`): saves refused on a store that
//! misbehaves, never on one it could not reach.

use crate::common::{current_thread_rt as rt, skip};
use crate::fault_proxy::{Fault, FaultProxy, Request};
use crate::s3_faults::{endpoint, s3};
use objectcache::store::doctor::{check_store, DoctorOptions, Mode, Outcome, Report};
use objectcache::store::{Store, StoreExt};
use std::process::Command;
use std::time::Duration;

/// The test bucket (as `s3_faults::s3` uses it).
fn bucket() -> String {
    std::env::var("OBJECTCACHE_TEST_S3_BUCKET")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "objectcache-test".into())
}

fn opts() -> DoctorOptions {
    DoctorOptions {
        idle_wait: Duration::from_millis(1500),
        ..DoctorOptions::default()
    }
}

fn assert_clean(r: &Report, what: &str) {
    assert_eq!(r.mode, Mode::Safe, "{what}: {r:#?}");
    for c in &r.checks {
        assert_eq!(c.outcome, Outcome::Pass, "{what}: {c:?}");
    }
    assert!(r.left_behind.is_empty(), "{what}: {:?}", r.left_behind);
}

/// The store was refused naming `check`, whose detail says `words`.
fn assert_refused(r: &Report, check: &'static str, words: &str) {
    assert_eq!(r.mode, Mode::Refused { check }, "{r:#?}");
    let c = r.failed().unwrap();
    assert!(c.detail.contains(words), "{}", c.detail);
}

/// Nothing is left under the run's prefix (other tests here run the doctor at the same time).
fn assert_removed(store: &dyn Store, r: &Report) {
    assert!(r.prefix.starts_with("_objectcache/doctor/"), "{}", r.prefix);
    let left = rt().block_on(store.list(&r.prefix, 1000)).unwrap();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn the_file_store_passes_clean() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        objectcache::store::FsStore::new(dir.path(), objectcache::store::FsyncPolicy::default())
            .unwrap();
    let r = rt().block_on(check_store(&store, None, &opts()));
    assert_clean(&r, "file store");
    assert_eq!(
        r.checks.iter().map(|c| c.name).collect::<Vec<_>>(),
        ["create_only", "create_race", "ranged_get"]
    );
    assert_removed(&store, &r);
}

#[test]
fn ceph_rgw_and_moto_pass_clean() {
    let Some((addr, _)) = endpoint() else { return };
    let url = format!("http://{addr}");
    let store = s3(&url);
    let r = rt().block_on(check_store(store.as_ref(), Some(&url), &opts()));
    assert_clean(&r, "Ceph RGW");
    assert_eq!(r.checks.len(), 4, "idle_close ran: {r:#?}");
    assert!(
        r.checks[3]
            .detail
            .starts_with("an idle connection stayed open"),
        "RGW's idle connection was measured: {r:#?}"
    );
    assert_removed(store.as_ref(), &r);
    println!("RGW: {:#?}", r.checks);

    let Some((moto, _)) = rt().block_on(crate::store_conformance::moto_store("doctor")) else {
        return skip("moto's S3 server (scripts/moto-start.sh)");
    };
    let moto_url = std::env::var("OBJECTCACHE_TEST_MOTO_ENDPOINT")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "http://127.0.0.1:5000".into());
    let r = rt().block_on(check_store(&moto, Some(&moto_url), &opts()));
    assert_clean(&r, "moto");
    assert_removed(&moto, &r);
}

#[test]
fn a_server_that_ignores_if_none_match_is_refused_naming_create_only() {
    let Some((addr, _)) = endpoint() else { return };
    // A refused create-only PUT (412) reaches the client as 200: If-None-Match ignored.
    let proxy = FaultProxy::http(addr, |_: &Request| Fault::ReplaceStatus(412, 200));
    let store = s3(&proxy.url());
    let r = rt().block_on(check_store(store.as_ref(), None, &opts()));
    assert_refused(&r, "create_only", "If-None-Match");
}

#[test]
fn ranged_gets_with_wrong_bytes_are_refused_naming_ranged_get() {
    let Some((addr, _)) = endpoint() else { return };
    // Every ranged GET gets one byte flipped halfway through its body; whole GETs pass.
    let proxy = FaultProxy::http(addr, |r: &Request| {
        if r.method == "GET" && r.range.is_some() {
            Fault::Flip(0.5)
        } else {
            Fault::Pass
        }
    });
    let store = s3(&proxy.url());
    let r = rt().block_on(check_store(store.as_ref(), None, &opts()));
    assert_refused(&r, "ranged_get", "wrong bytes");
    // The two checks before it passed: the refusal names exactly what is wrong.
    assert_eq!(r.checks[0].outcome, Outcome::Pass, "{r:#?}");
    assert_eq!(r.checks[1].outcome, Outcome::Pass, "{r:#?}");
}

#[test]
fn a_short_keep_alive_limit_gets_a_shorter_idle_timeout() {
    let Some((addr, _)) = endpoint() else { return };
    let proxy = FaultProxy::http(addr, |_: &Request| Fault::Pass);
    proxy.set_idle_close(Some(Duration::from_millis(300)));
    let store = s3(&proxy.url());
    // A long wait: on a loaded machine the close may be seen late, never early.
    let wait = DoctorOptions {
        idle_wait: Duration::from_secs(10),
        ..opts()
    };
    let r = rt().block_on(check_store(store.as_ref(), Some(&proxy.url()), &wait));
    let Mode::ShortIdle {
        idle_timeout_s,
        closed_after_s,
    } = r.mode
    else {
        panic!("not short idle: {r:#?}");
    };
    assert!(
        (0.25..10.0).contains(&closed_after_s),
        "closed after {closed_after_s} s"
    );
    assert!(idle_timeout_s < closed_after_s, "{idle_timeout_s}");
    let idle = r.checks.iter().find(|c| c.name == "idle_close").unwrap();
    assert_eq!(idle.outcome, Outcome::Adjust);
    // The mode's setting is one a store URL takes, and the store then works through the
    // proxy with pauses longer than the server's limit between requests.
    let url = format!(
        "s3://{}/doctor?endpoint={}&region=us-east-1&idle_timeout_s={idle_timeout_s}",
        bucket(),
        proxy.url()
    );
    let store = rt().block_on(objectcache::store::open_store(&url)).unwrap();
    rt().block_on(async {
        store
            .put("idle/a", bytes::Bytes::from_static(b"x"))
            .await
            .unwrap();
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(400)).await;
            assert_eq!(&store.get_bytes("idle/a").await.unwrap()[..], b"x");
        }
        store.delete("idle/a").await.unwrap();
    });
}

#[test]
fn the_command_exits_zero_on_a_clean_store_and_names_the_check_it_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("doctor.json");
    let out = Command::new(env!("CARGO_BIN_EXE_objectcache"))
        .args([
            "doctor",
            &format!("file://{}", dir.path().display()),
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("mode: safe"), "{text}");
    assert_eq!(
        text.lines().filter(|l| l.contains(" ok ")).count(),
        3,
        "{text}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["mode"]["mode"], "safe", "{v}");
    assert_eq!(v["checks"].as_array().unwrap().len(), 3);

    let Some((addr, _)) = endpoint() else { return };
    let proxy = FaultProxy::http(addr, |_: &Request| Fault::ReplaceStatus(412, 200));
    let url = format!(
        "s3://{}/doctor?endpoint={}&region=us-east-1",
        bucket(),
        proxy.url()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_objectcache"))
        .args(["doctor", &url])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("create_only  FAIL"), "{stdout}");
    assert!(
        stdout.contains("mode: refused: create_only failed"),
        "{stdout}"
    );
    assert!(stderr.contains("fails the create_only check"), "{stderr}");
}

/// The engine's own self-check (`self_check`, on by default; issue 43 part 3): an engine
/// opened on RGW's URL checks the store in the background, finds it safe and saves (the
/// first save waits for the verdict); one opened on RGW that ignores `If-None-Match` refuses
/// every save, naming `create_only`, while its lookups still answer; with `self_check=off`
/// nothing is checked.
#[test]
fn an_engine_checks_its_store_and_refuses_saves_to_one_that_fails() {
    use objectcache::connector::{Engine, EngineConfig};
    use objectcache::layout::KvGeometry;
    let Some((addr, _)) = endpoint() else { return };
    let ns = crate::common::unique_ns("engine-self-check");
    let engine = |ep: &str, check: &str| {
        let url = format!("s3://{}?endpoint={ep}&region=us-east-1", bucket());
        Engine::new(
            EngineConfig::from_pairs([
                ("store", url.as_str()),
                ("namespace", ns.as_str()),
                ("self_check", check),
            ])
            .unwrap(),
        )
        .unwrap()
    };
    let mut g = KvGeometry::smollm2_135m();
    g.tokens_per_chunk = 16;
    let (hs, data) = crate::common::seeded_prefix(&g, 2, 41);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();

    let clean = engine(&format!("http://{addr}"), "on");
    clean.save_blocking(&g, &hs, &refs).unwrap();
    assert_eq!(clean.metrics().store_mode, 1, "RGW is safe");
    assert_eq!(clean.lookup_blocking(&g, &hs).unwrap(), 2);

    let proxy = FaultProxy::http(addr, |_: &Request| Fault::ReplaceStatus(412, 200));
    let bad = engine(&proxy.url(), "on");
    let err = bad.save_blocking(&g, &hs, &refs).unwrap_err();
    assert!(
        matches!(&err, objectcache::Error::Unsupported(m) if m.contains("create_only") && m.contains("self-check")),
        "{err:?}"
    );
    assert_eq!(bad.metrics().store_mode, 3, "refused");
    // Loads and lookups go on (every slice is verified): the first engine's entry is found.
    assert_eq!(bad.lookup_blocking(&g, &hs).unwrap(), 2);

    let off = engine(&proxy.url(), "off");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(off.metrics().store_mode, 0, "self_check=off checks nothing");

    // A store nobody answers: the check cannot finish, which refuses nothing (the save fails
    // on its own, with the store's error), and the next engine checks again.
    let gone = engine("http://127.0.0.1:9", "on");
    let err = gone.save_blocking(&g, &hs, &refs).unwrap_err();
    assert!(
        !matches!(err, objectcache::Error::Unsupported(_)),
        "{err:?}"
    );
    assert_eq!(gone.metrics().store_mode, 0, "unfinished: not checked");
}
