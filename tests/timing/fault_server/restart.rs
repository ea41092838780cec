//! A real `objectcache serve` process killed (SIGKILL) mid-load, then restarted on the same
//! data.

use super::*;

/// `objectcache serve` as a child process on a file store; killed on drop.
fn spawn_server(dir: &std::path::Path, listen: &str) -> (ServeProcess, SocketAddr) {
    spawn_serve(listen, dir.as_os_str(), &[], Stdio::null())
}

#[test]
fn server_killed_mid_load_then_restarted() {
    let _alone = crate::alone();
    for format in FORMATS {
        killed_mid_load_then_restarted(format);
    }
}

/// The case on a prefix saved in `format` (from a segment object, the server sends each
/// slice with `sendfile(2)` from the segment's file, as from chunk objects).
fn killed_mid_load_then_restarted(format: SaveFormat) {
    let dir = tempfile::tempdir().unwrap();
    let (mut p, addr) = spawn_server(dir.path(), "127.0.0.1:0");
    let deadline = Duration::from_secs(10);
    let r = rig_as(addr, "kill", 8, deadline, 1, format);
    let case = r.name("kill");
    // Warm the engine's gather connection pool: it keeps one idle connection.
    r.recovers(&format!("{case}: before"), true);
    // A second engine, whose fresh gather connection drips (64 KiB per 5 ms, about 3 s for
    // 36 MiB), so that the kill lands mid-load.
    r.proxy.set_raw_rule(|_| RawFault::Drip {
        bytes: 64 << 10,
        every: Duration::from_millis(5),
    });
    r.proxy.clear_log();
    let e2 = r.fresh_engine();
    let per_layer = CHUNKS * r.g.slice_bytes() as usize;
    let h = common::start_load(&e2, &r.g, r.hashes.clone(), per_layer);
    // Kill the server once its gather answer is flowing: 1 MiB through the dripping proxy.
    common::eventually(
        "1 MiB of the gather answer",
        Duration::from_secs(60),
        || r.proxy.raw_connections().iter().any(|c| c.2 >= 1 << 20),
    );
    let pid = p.0.id();
    p.0.kill().unwrap(); // SIGKILL
    p.0.wait().unwrap();
    let t0 = std::time::Instant::now();
    let mut ready = 0;
    for l in 0..r.g.layers as usize {
        match h.wait_layer_blocking(l, Some(Duration::from_secs(120))) {
            Ok(()) => {
                assert!(
                    h.layer(l).unwrap() == &r.data[l][..],
                    "{case}: layer {l} differs"
                );
                ready += 1;
            }
            Err(_) => assert!(h.layer(l).is_none()),
        }
    }
    let waited = t0.elapsed();
    assert!(
        ready < r.g.layers as usize,
        "{case}: the load ended before the kill"
    );
    assert!(
        waited < deadline + Duration::from_secs(5),
        "{case}: waits took {waited:?}"
    );
    drop(h);
    // While the server is down: a load is a miss (connection refused), no hang.
    r.proxy.set_raw_rule(|_| RawFault::Pass);
    let down = load_checked(
        &e2,
        &r.g,
        &r.hashes,
        &r.data,
        &format!("{case}: server down"),
    );
    assert_eq!(down.ready, 0, "{down:?}");
    // Restart on the same directory and port. The first engine's pooled connection went
    // stale with the old process: its next load must still be served, over gather.
    let (_p2, addr2) = spawn_server(dir.path(), &addr.to_string());
    assert_eq!(addr2, addr);
    r.recovers(&format!("{case}: restarted"), true);
    println!(
        "FAULT|server-process|{}|1|\
         {ready} of {} layers ready (byte-exact), the rest missed {waited:?} after the kill; \
         a load while down: {} of {} missed, no hang; after a restart on the same data, an engine \
         with a stale pooled connection: byte-exact over gather",
        r.name(&format!(
            "objectcache serve (pid {pid}) SIGKILLed 1 MiB into a 36 MiB gather load"
        )),
        r.g.layers,
        down.failed,
        r.g.layers
    );
}
