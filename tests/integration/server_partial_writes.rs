//! A PUT interrupted by a killed server (issue 16, issue 19 part 6): the object is never
//! visible, its temporary file is counted by `objectcache stat` while it lies there, and it
//! is reclaimed by `objectcache gc` or at the server's next start.

use crate::common::run_ok;
use crate::gather_util;
use crate::hostile_util;

use gather_util::*;
use hostile_util::*;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

fn server(dir: &std::path::Path) -> (ServeProcess, SocketAddr) {
    spawn_serve(
        "127.0.0.1:0",
        dir.as_os_str(),
        &["--no-fsync"],
        Stdio::null(),
    )
}

fn cli(args: &[&str]) -> serde_json::Value {
    let out = run_ok(std::process::Command::new(env!("CARGO_BIN_EXE_objectcache")).args(args));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Starts a 512 MiB presigned PUT of `key`, sends 1 MiB every 50 ms from a task (the server
/// keeps receiving it), and kills the server once its temporary file holds at least 32 MiB.
async fn kill_mid_put(p: ServeProcess, addr: SocketAddr, dir: &std::path::Path, key: &str) -> u64 {
    let mut s = presigned_head(1, addr, "PUT", key, "Content-Length: 536870912\r\n").await;
    let sender = tokio::spawn(async move {
        let piece = vec![0x42u8; 1 << 20];
        while s.write_all(&piece).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let t0 = Instant::now();
    let held = loop {
        let n: u64 = tmp_files(dir).iter().map(|(_, n)| n).sum();
        if n >= 32 << 20 {
            break n;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the PUT never reached 32 MiB on disk"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    drop(p); // SIGKILL, then reaped
    sender.await.unwrap();
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_cut_by_a_killed_server_is_counted_then_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap().to_string();

    // Killed mid-PUT: the object is absent; its temporary file is counted by stat.
    let (p, addr) = server(dir.path());
    let held = kill_mid_put(p, addr, dir.path(), "big/obj").await;
    let left = tmp_files(dir.path());
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(!dir.path().join(BUCKET).join("big/obj").exists());
    let st = cli(&["stat", "--store", &store, "--json"]);
    assert_eq!(st["total"]["partial_writes"], 1, "{st}");
    let counted = st["total"]["partial_bytes"].as_u64().unwrap();
    assert!(counted >= held, "stat counts {counted} of {held} bytes");
    assert!(st["total"]["bytes"].as_u64().unwrap() >= counted);
    // gc (default grace, one hour) reclaims it at once: its writer is gone.
    let rep = cli(&["gc", "--store", &store, "--json"]);
    let deleted = rep["deleted"].as_array().unwrap();
    assert!(
        deleted.iter().any(|d| d[1] == "PartialWrite"),
        "gc deleted {deleted:?}"
    );
    assert!(tmp_files(dir.path()).is_empty());
    let st = cli(&["stat", "--store", &store, "--json"]);
    assert_eq!(st["total"]["partial_writes"], 0, "{st}");
    println!(
        "PARTIAL|server SIGKILLed mid-PUT (512 MiB declared)|temporary file {} MiB: counted by stat ({counted} bytes), object absent, reclaimed by gc at once (writer gone)",
        held >> 20
    );

    // Killed again: the next start reclaims it before serving.
    let (p, addr) = server(dir.path());
    let held = kill_mid_put(p, addr, dir.path(), "big/obj2").await;
    assert_eq!(tmp_files(dir.path()).len(), 1);
    let (p, addr) = server(dir.path());
    let left = tmp_files(dir.path());
    assert!(left.is_empty(), "left after restart: {left:?}");
    assert!(!dir.path().join(BUCKET).join("big/obj2").exists());
    assert_eq!(http_get(addr, "/_objectcache/health").await.0, 200);
    drop(p);
    println!(
        "PARTIAL|server SIGKILLed mid-PUT, then restarted|temporary file {} MiB reclaimed at start-up; object absent",
        held >> 20
    );
}
