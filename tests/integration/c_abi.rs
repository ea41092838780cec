//! The C ABI from C: compiles `tests/c/lifecycle.c` and `ffi/examples/save_load.c` with the
//! system C compiler (`cc`, or `$CC`) against `ffi/objectcache.h`, links them to the cdylib
//! this build produced, and runs them against the embedded (directory) store.
//!
//! Needs a C compiler; without one the test fails under `OBJECTCACHE_REQUIRE_ALL` and prints
//! SKIP otherwise.

#[cfg(feature = "s3")]
use crate::gather_util;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Directory holding `libobjectcache.so` of this build (the test binary lives in `deps/`),
/// or `$OBJECTCACHE_CDYLIB_DIR` when set (a target directory shared by several checkouts
/// holds only the last one's cdylib, since its file name carries no hash).
fn lib_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("OBJECTCACHE_CDYLIB_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps dir").to_path_buf();
    let profile = deps.parent().expect("profile dir").to_path_buf();
    // `deps/` first: it holds the cdylib built for this test run; the profile directory's
    // copy is only refreshed by `cargo build` and may be older.
    for d in [&deps, &profile] {
        if d.join(lib_name()).exists() {
            return d.clone();
        }
    }
    panic!(
        "{} not found next to {} (build the cdylib first: cargo build --release --lib)",
        lib_name(),
        exe.display()
    );
}

fn lib_name() -> &'static str {
    if cfg!(target_os = "macos") {
        "libobjectcache.dylib"
    } else {
        "libobjectcache.so"
    }
}

fn cc() -> Option<String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let ok = Command::new(&cc)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(cc);
    }
    crate::common::skip(&format!("C compiler ({cc})"));
    None
}

/// Copies the cdylib into `out_dir/lib` under its link name and its SONAME
/// (`libobjectcache.so.<ABI version>`), as an installation would.
fn stage_lib(out_dir: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = std::fs::read_to_string(root.join("ffi/objectcache.h")).expect("header");
    let abi = header
        .lines()
        .find_map(|l| l.strip_prefix("#define OBJECTCACHE_ABI_VERSION "))
        .expect("ABI version in the header")
        .trim()
        .to_string();
    let dir = out_dir.join("lib");
    std::fs::create_dir_all(&dir).expect("lib dir");
    let src = lib_dir().join(lib_name());
    for name in [lib_name().to_string(), format!("{}.{abi}", lib_name())] {
        std::fs::copy(&src, dir.join(name)).expect("copy the cdylib");
    }
    dir
}

/// Compiles one C file against the header and the cdylib; returns the executable.
fn compile(cc: &str, src: &str, out_dir: &Path) -> PathBuf {
    compile_with(cc, src, out_dir, &[])
}

/// As [`compile`], with extra compiler flags.
fn compile_with(cc: &str, src: &str, out_dir: &Path, flags: &[&str]) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = stage_lib(out_dir);
    let exe = out_dir.join(Path::new(src).file_stem().expect("file name"));
    let out = Command::new(cc)
        .args([
            "-std=c11",
            "-D_POSIX_C_SOURCE=200809L",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-O1",
        ])
        .args(flags)
        .arg("-I")
        .arg(root.join("ffi"))
        .arg(root.join(src))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lobjectcache", "-lpthread"])
        .output()
        .expect("run the C compiler");
    crate::common::assert_exited_ok(&out, &format!("compiling {src} failed:\n"));
    exe
}

fn run(exe: &Path, arg: &Path) -> String {
    run_c(Command::new(exe).arg(arg), &exe.display().to_string())
}

/// Runs the C program `cmd`, echoes its stdout and stderr, asserts it exited 0 (`what` names
/// it in the failure message) and returns its stdout.
fn run_c(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().expect("run the C program");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    print!("{stdout}");
    eprint!("{stderr}");
    assert!(
        out.status.success(),
        "{what} exited with {:?}:\n{stdout}{stderr}",
        out.status
    );
    stdout
}

#[test]
fn c_lifecycle_against_the_embedded_store() {
    let Some(cc) = cc() else { return };
    let tmp = tempfile::tempdir().expect("temp dir");
    let exe = compile(&cc, "tests/c/lifecycle.c", tmp.path());
    let store = tmp.path().join("store");
    let stdout = run(&exe, &store);
    let (summary, passed) = summary(&stdout, "c_abi");
    assert!(passed > 150, "only {passed} checks ran: {summary}");
    // The store on disk holds what the C program saved: 3 + 64 chunk objects, each with a
    // publish marker.
    let files = walk(&store);
    assert!(files >= 2 * 67, "{files} files in the store");
}

/// The same program under AddressSanitizer, UndefinedBehaviorSanitizer and LeakSanitizer:
/// the library's copies into caller memory go through `memcpy`, which ASan checks, so a write
/// past a destination, or a leak of what the C side owns, fails the run.
#[test]
fn c_lifecycle_under_sanitizers() {
    let Some(cc) = cc() else { return };
    let tmp = tempfile::tempdir().expect("temp dir");
    let probe = tmp.path().join("probe.c");
    std::fs::write(&probe, "int main(void) { return 0; }\n").expect("write probe");
    let ok = Command::new(&cc)
        .args(["-fsanitize=address,undefined"])
        .arg(&probe)
        .arg("-o")
        .arg(tmp.path().join("probe"))
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        crate::common::skip(&format!(
            "AddressSanitizer runtime for {cc} (-fsanitize=address,undefined; install libasan)"
        ));
        return;
    }
    for src in ["tests/c/lifecycle.c", "tests/c/paged.c"] {
        let exe = compile_with(
            &cc,
            src,
            tmp.path(),
            &[
                "-g",
                "-fno-omit-frame-pointer",
                "-fsanitize=address,undefined",
            ],
        );
        let out = Command::new(&exe)
            .arg(tmp.path().join("store"))
            .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
            .env("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
            .output()
            .expect("run the C program");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stdout.contains(" 0 failed") && !stderr.contains("Sanitizer"),
            "sanitized run of {src} failed ({:?}):\n{stdout}{stderr}",
            out.status
        );
    }
}

/// Paged KV from C (`tests/c/paged.c`): save from one request's scattered engine blocks,
/// load into another's inside one registered KV buffer, byte for byte, with nothing else
/// touched; layouts in the key; refused arguments named. Embedded store (ranged GETs).
#[test]
fn c_paged_against_the_embedded_store() {
    let Some(cc) = cc() else { return };
    let tmp = tempfile::tempdir().expect("temp dir");
    let exe = compile(&cc, "tests/c/paged.c", tmp.path());
    let stdout = run(&exe, &tmp.path().join("store"));
    let (summary, passed) = summary(&stdout, "c_paged");
    assert!(passed > 60, "only {passed} checks ran: {summary}");
}

#[test]
fn c_example_in_the_docs_runs() {
    let Some(cc) = cc() else { return };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The example in docs/c-abi.md is this file, verbatim.
    let example = std::fs::read_to_string(root.join("ffi/examples/save_load.c")).expect("example");
    let doc = std::fs::read_to_string(root.join("docs/c-abi.md")).expect("docs/c-abi.md");
    assert!(
        doc.contains(example.trim_end()),
        "docs/c-abi.md does not contain ffi/examples/save_load.c verbatim"
    );
    let tmp = tempfile::tempdir().expect("temp dir");
    let exe = compile(&cc, "ffi/examples/save_load.c", tmp.path());
    let stdout = run(&exe, &tmp.path().join("store"));
    assert!(
        stdout.contains("cached prefix: 2 chunks = 64 tokens"),
        "{stdout}"
    );
    assert_eq!(stdout.matches("bytes match").count(), 2, "{stdout}");
}

/// A C test program's summary line (`<program>: <passed> passed, 0 failed`) in its `stdout`,
/// asserted to count no failure.
fn summary_line<'a>(stdout: &'a str, program: &str) -> &'a str {
    let summary = stdout
        .lines()
        .find(|l| l.starts_with(&format!("{program}: ")))
        .expect("summary line");
    assert!(summary.ends_with(" 0 failed"), "{summary}");
    summary
}

/// [`summary_line`] and the number of checks it says passed.
fn summary<'a>(stdout: &'a str, program: &str) -> (&'a str, usize) {
    let summary = summary_line(stdout, program);
    let passed: usize = summary
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("passed count");
    (summary, passed)
}

fn walk(p: &Path) -> usize {
    let mut n = 0;
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let path = e.path();
            if path.is_dir() {
                n += walk(&path);
            } else {
                n += 1;
            }
        }
    }
    n
}

/// The same C programs against the ObjectCache server (in-process, on loopback): the engine
/// opens an `s3://` store URL on the server's endpoint, probes it, and loads through gather
/// (paged loads: every unit lands in two engine blocks, striped over two connections).
#[cfg(feature = "s3")]
#[test]
fn c_lifecycle_against_the_server() {
    c_program_against_the_server("tests/c/lifecycle.c", "c_abi");
}

/// See [`c_lifecycle_against_the_server`].
#[cfg(feature = "s3")]
#[test]
fn c_paged_against_the_server() {
    c_program_against_the_server("tests/c/paged.c", "c_paged");
}

#[cfg(feature = "s3")]
fn c_program_against_the_server(src: &str, program: &str) {
    let Some(cc) = cc() else { return };
    let tmp = tempfile::tempdir().expect("temp dir");
    let exe = compile(&cc, src, tmp.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let backend: std::sync::Arc<dyn objectcache::store::Store> = std::sync::Arc::new(
        objectcache::store::FsStore::new(
            tmp.path().join("srv"),
            objectcache::store::FsyncPolicy::Never,
        )
        .unwrap(),
    );
    let server = rt.block_on(gather_util::start(backend, gather_util::config()));
    let url = format!(
        "s3://{}?endpoint={}&region=us-east-1&addressing=path",
        gather_util::BUCKET,
        server.endpoint()
    );
    let stdout = run_c(
        Command::new(&exe)
            .arg(&url)
            .env("AWS_ACCESS_KEY_ID", gather_util::ACCESS)
            .env("AWS_SECRET_ACCESS_KEY", gather_util::SECRET)
            .env("AWS_EC2_METADATA_DISABLED", "true"),
        "C program against the server",
    );
    summary_line(&stdout, program);
    rt.block_on(server.shutdown());
}
