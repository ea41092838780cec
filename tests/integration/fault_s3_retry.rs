//! Fault injection on the stock S3 path, retry budget: a 503 SlowDown storm is absorbed by the
//! S3 client's bounded retries. The SDK's retry budget (a token bucket the storms of
//! `fault_s3` drain on purpose) is kept per endpoint (`S3Store` gives each its own retry
//! partition), so this test's proxy starts with a full one whatever ran before it.
#![cfg(feature = "s3")]

use crate::fault_proxy;
use crate::s3_faults;

use fault_proxy::Fault;
use s3_faults::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[test]
fn slowdown_storm_is_absorbed_by_bounded_retries() {
    let Some((addr, ns)) = endpoint() else { return };
    let f = fixture(addr, &ns, 13, Duration::from_secs(20));
    // The first MAX_ATTEMPTS-1 attempts of every ranged GET get 503 SlowDown.
    let seen: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let s2 = seen.clone();
    f.proxy.set_rule(move |r| {
        if r.method != "GET" {
            return Fault::Pass;
        }
        let mut m = s2.lock().unwrap();
        let n = m.entry(format!("{} {:?}", r.path(), r.range)).or_insert(0);
        *n += 1;
        if *n < MAX_ATTEMPTS {
            Fault::slowdown()
        } else {
            Fault::Pass
        }
    });
    let o = load_and_check(&f, "503 storm then success");
    let att = attempts(&f.proxy, |_| true);
    let worst = att.values().copied().max().unwrap();
    assert!(worst <= MAX_ATTEMPTS, "{att:?}");
    assert_eq!(
        o.ready, f.g.layers as usize,
        "retries did not absorb a bounded storm: {o:?}"
    );
    let n503 = f
        .proxy
        .requests()
        .iter()
        .filter(|r| r.status == 503)
        .count();
    report(
        "503 SlowDown on the first 2 of 3 attempts of every GET",
        1,
        &format!(
            "all {} layers ready byte-exact after {n503} SlowDowns; at most {worst} attempts per GET",
            o.ready
        ),
    );
    // A storm on every attempt: every layer missed, still bounded.
    f.proxy.clear_log();
    f.proxy.set_rule(Fault::on_gets(Fault::slowdown()));
    let o = load_and_check(&f, "503 storm on every try");
    assert_eq!(o.ready, 0);
    let att = attempts(&f.proxy, |_| true);
    let worst = att.values().copied().max().unwrap();
    assert!(worst <= MAX_ATTEMPTS, "{att:?}");
    report(
        "503 SlowDown on every attempt of every GET",
        1,
        &format!(
            "all {} layers missed; {} GETs, at most {worst} attempts each",
            o.failed,
            att.values().sum::<u32>()
        ),
    );
}
