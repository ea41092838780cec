//! The NIXL backend plugin (`ffi/nixl`), built and checked: compiled with g++ against NIXL
//! 1.5.1's plugin headers (`$OBJECTCACHE_NIXL_SRC`, else `../shared/vendor/nixl` beside the
//! repository, the tree docs/nixl.md names) and this build's `libobjectcache.so`, then loaded
//! into NIXL's own Python agent (the nixl-cu12 wheel of `scripts/nixl-setup.sh`,
//! `$OBJECTCACHE_NIXL_VENV` or `target/nixl-venv`):
//!
//! - `ffi/nixl/check_plugin.py`'s checks (write, existence query, layer-by-layer read with
//!   notifications, whole-chunk read, a missing chunk is an error, never bytes);
//! - a layer-by-layer read through NIXL of a chunk set saved by the Rust API, on the file
//!   store and on our server (gather): every layer's notification arrives, in layer order, and
//!   every byte matches.
//!
//! Without the headers, the venv or g++ it prints SKIP, or fails when
//! `OBJECTCACHE_REQUIRE_ALL` is set (as in CI).

use crate::common::{self, assert_exited_ok, save_prefix, temp_fs_store, unique_ns};
use crate::gather_util;
use crate::py_support;
use std::path::{Path, PathBuf};
use std::process::Command;

/// NIXL's source tree (its headers), the Python of the NIXL venv, or why not.
fn nixl() -> Result<(PathBuf, PathBuf), String> {
    let src = std::env::var_os("OBJECTCACHE_NIXL_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| py_support::root().join("../shared/vendor/nixl"));
    if !src.join("src/api/cpp/backend/backend_plugin.h").is_file() {
        return Err(format!(
            "no NIXL headers at {} (set OBJECTCACHE_NIXL_SRC to NIXL 1.5.1's source tree)",
            src.display()
        ));
    }
    let venv = std::env::var_os("OBJECTCACHE_NIXL_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| py_support::root().join("target/nixl-venv"));
    let py = venv.join("bin/python");
    if !py.is_file() {
        return Err(format!(
            "no NIXL venv at {} (scripts/nixl-setup.sh)",
            venv.display()
        ));
    }
    Ok((src, py))
}

/// Builds the plugin into `out`, linked to this build's library (as `libobjectcache.so.1`,
/// its SONAME, in `out` too).
fn build_plugin(src: &Path, out: &Path) {
    let lib = py_support::cdylib();
    for name in ["libobjectcache.so", "libobjectcache.so.1"] {
        std::os::unix::fs::symlink(&lib, out.join(name)).unwrap();
    }
    let makefile = py_support::root().join("ffi/nixl/Makefile");
    common::run_ok(
        Command::new("make")
            .arg("-C")
            .arg(out)
            .arg("-f")
            .arg(&makefile)
            .arg(format!("NIXL_SRC_DIR={}", src.display()))
            .arg("ABSL_STUB=1")
            .arg(format!("OBJECTCACHE_LIB_DIR={}", out.display())),
    );
    assert!(out.join("libplugin_OBJECTCACHE.so").is_file());
}

/// Runs `check_plugin.py` with `args` under NIXL's agent, the plugin from `plugin_dir`;
/// returns its output (asserting it passed).
fn check(py: &Path, plugin_dir: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(py);
    cmd.arg(py_support::root().join("ffi/nixl/check_plugin.py"))
        .args(args)
        .env("NIXL_PLUGIN_DIR", plugin_dir)
        .env("AWS_EC2_METADATA_DISABLED", "true");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run check_plugin.py");
    assert_exited_ok(&out, "check_plugin.py");
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Saves 5 chunks through the Rust API on `store` and writes the spec `check_plugin.py
/// --saved` reads: `url` (the same store as the plugin names it), the geometry, the hashes
/// and each chunk's layer-major payload.
fn save_spec(
    store: std::sync::Arc<dyn objectcache::store::Store>,
    url: &str,
    dir: &Path,
) -> PathBuf {
    let g = common::small_geometry("test/nixl-saved", 6);
    let ns = unique_ns("nixl-saved");
    let e = common::engine(store, &ns);
    let chunks = 5;
    let (hs, data) = save_prefix(&e, &g, chunks, 41);
    let slice = g.slice_bytes() as usize;
    let mut payload = Vec::with_capacity(chunks * slice * g.layers as usize);
    for c in 0..chunks {
        for layer in &data {
            payload.extend_from_slice(&layer[c * slice..(c + 1) * slice]);
        }
    }
    let payload_path = dir.join("payload.bin");
    std::fs::write(&payload_path, &payload).unwrap();
    let spec = serde_json::json!({
        "store": url, "namespace": ns, "model": g.model, "layers": g.layers,
        "kv_heads": g.kv_heads, "head_dim": g.head_dim, "dtype": "fp16",
        "tokens_per_chunk": g.tokens_per_chunk,
        "hashes": hs.iter().map(|h| h.to_hex()).collect::<Vec<_>>(),
        "payload": payload_path,
    });
    let p = dir.join("spec.json");
    std::fs::write(&p, spec.to_string()).unwrap();
    p
}

#[test]
fn nixl_plugin_builds_passes_its_checks_and_reads_rust_saved_chunks_layer_by_layer() {
    let (src, py) = match nixl() {
        Ok(x) => x,
        Err(why) => return common::skip(&format!("nixl plugin: {why}")),
    };
    let tmp = tempfile::tempdir().unwrap();
    let plugin_dir = tmp.path().join("plugin");
    std::fs::create_dir(&plugin_dir).unwrap();
    build_plugin(&src, &plugin_dir);

    // The plugin's own checks on a file store.
    let store_dir = tempfile::tempdir().unwrap();
    let out = check(&py, &plugin_dir, &[store_dir.path().to_str().unwrap()], &[]);
    println!("{}", out.lines().last().unwrap_or(""));
    assert!(out.contains(" 0 failed"), "{out}");

    // A chunk set saved by the Rust API, read through NIXL: on the file store...
    let (dir, fs) = temp_fs_store();
    let url = format!("file://{}", dir.path().display());
    let spec = save_spec(fs, &url, tmp.path());
    let out = check(&py, &plugin_dir, &["--saved", spec.to_str().unwrap()], &[]);
    println!("file store: {}", out.trim_end().replace('\n', " | "));
    assert!(
        out.contains("saved-read: ") && out.contains(" 0 failed"),
        "{out}"
    );

    // ... and on our server (gather), with its access key.
    let rt = common::shared_rt();
    let (sdir, backend) = temp_fs_store();
    let server = rt.block_on(gather_util::start(backend, gather_util::config()));
    let s3 = rt.block_on(gather_util::s3_store_on(&server.endpoint()));
    let url = format!(
        "s3://{}?endpoint={}&region=us-east-1&addressing=path",
        gather_util::BUCKET,
        server.endpoint()
    );
    let spec_dir = tmp.path().join("server");
    std::fs::create_dir(&spec_dir).unwrap();
    let spec = save_spec(s3, &url, &spec_dir);
    let out = check(
        &py,
        &plugin_dir,
        &["--saved", spec.to_str().unwrap()],
        &[
            ("AWS_ACCESS_KEY_ID", gather_util::ACCESS),
            ("AWS_SECRET_ACCESS_KEY", gather_util::SECRET),
            ("AWS_REGION", "us-east-1"),
        ],
    );
    println!("server: {}", out.trim_end().replace('\n', " | "));
    assert!(
        out.contains("saved-read: ") && out.contains(" 0 failed"),
        "{out}"
    );
    drop(server);
    drop(sdir);
}
