//! The server as a separate process (`objectcache serve`): gather round trip, health and
//! metrics endpoints, graceful shutdown on SIGTERM; awscli and boto3 against it.

use crate::gather_util;

use gather_util::*;
use objectcache::layout::KvGeometry;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;

/// Starts `objectcache serve` on a free port over a memory store; returns the process and its
/// address.
fn spawn_server(extra: &[&str]) -> (ServeProcess, std::net::SocketAddr) {
    let mut args = vec!["--shutdown-grace-secs", "2"];
    args.extend_from_slice(extra);
    spawn_serve("127.0.0.1:0", "memory:".as_ref(), &args, Stdio::inherit())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_as_a_process_gathers_and_shuts_down_gracefully() {
    let (mut p, addr) = spawn_server(&["--log-format", "json"]);
    let g = KvGeometry::llama31_8b();
    let tokens = vec![256u32; 16];
    let mut c = gather_client(addr).await;
    save_prefix(&mut c, &g, 31, &tokens).await;
    let sink = VerifySink::new(&g, 31, &tokens);
    c.load(&request(&g, 31, &tokens), &sink).await.unwrap();
    assert_eq!(sink.mismatches.load(Ordering::Relaxed), 0);
    assert_eq!(sink.complete_layers(), 32);
    assert_eq!(
        http_get(addr, "/_objectcache/health").await,
        (200, "ok\n".to_string())
    );
    // The doctor's idle-connection probe (a HEAD) is the health check too, not an S3 request.
    assert_eq!(
        http_head(addr, "/_objectcache/health").await,
        (200, String::new())
    );
    let (st, m) = http_get(addr, "/_objectcache/metrics").await;
    assert_eq!(st, 200);
    assert_eq!(
        metric(&m, "objectcache_server_requests_total{op=\"gather\"}"),
        Some(1.0)
    );
    assert!(m.contains("objectcache_server_ttfl_seconds_bucket"), "{m}");
    drop(c);
    let st = Command::new("kill")
        .args(["-TERM", &p.0.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let code = p.0.wait().unwrap();
    assert!(code.success(), "exit status after SIGTERM: {code:?}");
}

#[test]
fn bad_configuration_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_objectcache"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", "memory:"])
        .env_remove("OBJECTCACHE_ACCESS_KEYS")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no access key is configured"), "{err}");
    // A bucket name the S3 client and the gather protocol refuse is refused at start, not
    // when the first load names it. (Were it taken, the server would run: kill it then.)
    let mut child = Command::new(env!("CARGO_BIN_EXE_objectcache"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", "memory://"])
        .args(["--allow-anonymous", "--bucket", "kv"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("buckets: \"kv\" is not an S3 bucket name"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("c.toml");
    std::fs::write(&f, "listen = \"127.0.0.1:0\"\nmax_chunk = 3\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_objectcache"))
        .args(["serve", "--config"])
        .arg(&f)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("unknown field `max_chunk`"),
        "{err}"
    );
    // A file, then environment, then flags.
    std::fs::write(&f, "max_chunks = 3\nscheduler = \"priority\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_objectcache"))
        .args([
            "serve",
            "--print-config",
            "--max-concurrent-loads",
            "5",
            "--config",
        ])
        .arg(&f)
        .env("OBJECTCACHE_MAX_CHUNKS", "7")
        .output()
        .unwrap();
    let cfg = String::from_utf8_lossy(&out.stdout);
    assert!(
        cfg.contains("max_chunks = 7")
            && cfg.contains("scheduler = \"priority\"")
            && cfg.contains("max_concurrent_loads = 5"),
        "{cfg}"
    );
}

/// awscli and boto3 (from PyPI, see scripts/awscli-setup.sh) against the server process.
#[test]
fn awscli_and_boto3_with_sigv4() {
    let venv = std::env::var("OBJECTCACHE_AWS_VENV")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target/awscli-venv").into());
    if !std::path::Path::new(&venv).join("bin/aws").exists() {
        if std::env::var_os("OBJECTCACHE_REQUIRE_ALL").is_some() {
            panic!("awscli venv missing at {venv}: run scripts/awscli-setup.sh");
        }
        eprintln!(
            "SKIP awscli_and_boto3_with_sigv4: no venv at {venv} (run scripts/awscli-setup.sh)"
        );
        return;
    }
    let (_p, addr) = spawn_server(&[]);
    let out = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/awscli-test.sh"
    ))
    .args([&format!("http://{addr}"), ACCESS, SECRET, &venv])
    .output()
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "{text}");
    assert!(text.contains("bad credentials rejected (403) OK"), "{text}");
}
