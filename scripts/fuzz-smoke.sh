#!/usr/bin/env bash
# Runs every fuzz target in tests/fuzz briefly (default 30 s each) and prints one line per
# target: `FUZZ|target|seconds|executions|crashes`. Exit status 1 if any target crashed; the
# crashing input is left in tests/fuzz/artifacts/<target>/. Turn it into a regression test by
# storing it as hex text: `xxd -p artifacts/T/crash-X > regressions/T/NAME.hex`; every file
# there is replayed by `cargo test --release --test integration security_fuzz_regressions::`.
#
# Works on a stable toolchain: libFuzzer comes from the libfuzzer-sys crate (needs a C++
# compiler), and the coverage instrumentation flags that cargo-fuzz would pass need
# RUSTC_BOOTSTRAP=1 (they are nightly-only flags of stable rustc). No cargo-fuzz install.
#
# Usage: scripts/fuzz-smoke.sh [seconds-per-target] [target...]
set -euo pipefail
cd "$(dirname "$0")/../tests/fuzz"
secs="${1:-30}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=($(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v objectcache-fuzz))
fi
export RUSTC_BOOTSTRAP=1
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
# Its own target directory: these flags would invalidate the shared build cache.
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$PWD/target}"
# An explicit --target keeps RUSTFLAGS off build scripts and proc macros (as cargo-fuzz does).
host=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --bins --target "$host"
fail=0
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  log=$(mktemp)
  set +e
  "$CARGO_TARGET_DIR/$host/release/$t" "corpus/$t" -max_total_time="$secs" -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="artifacts/$t/" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  crashes=$(ls "artifacts/$t" | wc -l)
  echo "FUZZ|$t|$secs|${execs:-0}|$crashes"
  if [ $rc -ne 0 ] || [ "$crashes" -ne 0 ]; then
    fail=1
    tail -30 "$log" >&2
  fi
  rm -f "$log"
done
exit $fail
