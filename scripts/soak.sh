#!/usr/bin/env bash
# Soak: concurrent saves, lookups and loads for a bounded time; checks no errors, byte-exact
# loads, stable RSS and no leaked file descriptors, and prints one SOAK| line of figures.
#
# Usage: scripts/soak.sh [seconds] [workers] [store-url | server]
#   store-url: a directory (default: a fresh temporary one), s3://bucket?endpoint=... (Ceph
#   RGW: credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), or an ObjectCache
#   server's s3:// URL.
#   server: starts `objectcache serve` (file store in a temporary directory, fsync off) on a
#   free port, soaks it through its S3 endpoint (loads take the gather path), and prints a
#   SOAK-SERVER| line with the server process's RSS and open file descriptors (start, peak,
#   end) next to the client's SOAK| line.
set -euo pipefail
cd "$(dirname "$0")/.."
export OBJECTCACHE_SOAK_SECS="${1:-60}" OBJECTCACHE_SOAK_WORKERS="${2:-8}" OBJECTCACHE_SOAK_STORE="${3:-}"
export CARGO_PROFILE_RELEASE_INCREMENTAL="${CARGO_PROFILE_RELEASE_INCREMENTAL:-true}"

run_soak() {
    cargo test --release --test integration fault_soak:: -- --ignored --nocapture 2>&1 | tee /dev/stderr | grep '^SOAK|' >/dev/null
}

if [ "$OBJECTCACHE_SOAK_STORE" != "server" ]; then
    run_soak
    exit
fi

cargo build --release --bin objectcache
bin="${CARGO_TARGET_DIR:-target}/release/objectcache"
data="$(mktemp -d)"
out="$(mktemp)"
ak=soak-access sk=soak-secret-key
"$bin" serve --listen 127.0.0.1:0 --store "$data" --bucket soak --access-key "$ak:$sk" \
    --no-fsync >"$out" 2>/dev/null &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$data" "$out"; }
trap cleanup EXIT
for _ in $(seq 100); do grep -q listening "$out" && break; sleep 0.1; done
addr="$(awk '/listening/ {print $NF; exit}' "$out")"
[ -n "$addr" ] || { echo "objectcache serve did not start" >&2; exit 1; }

rss() { awk '/^VmRSS:/ {printf "%.1f", $2 / 1024}' "/proc/$pid/status"; }
fds() { ls "/proc/$pid/fd" | wc -l; }
rss0="$(rss)" fd0="$(fds)"
samples="$(mktemp)"
( while kill -0 "$pid" 2>/dev/null; do echo "$(rss) $(fds)" >>"$samples"; sleep 0.5; done ) &
sampler=$!

export OBJECTCACHE_SOAK_STORE="s3://soak?endpoint=http://$addr&addressing=path&region=us-east-1"
export AWS_ACCESS_KEY_ID="$ak" AWS_SECRET_ACCESS_KEY="$sk" AWS_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true
run_soak
sleep 1
kill "$sampler" 2>/dev/null || true
rss_peak="$(sort -g -k1 "$samples" | tail -1 | cut -d' ' -f1)"
fd_peak="$(sort -g -k2 "$samples" | tail -1 | cut -d' ' -f2)"
rm -f "$samples"
metrics="$(curl -s "http://$addr/_objectcache/metrics" 2>/dev/null | grep -E '^objectcache_server_requests_total' | tr '\n' ' ' || true)"
echo "SOAK-SERVER|objectcache serve pid $pid|RSS MiB start $rss0, peak $rss_peak, end $(rss)|fds start $fd0, peak $fd_peak, end $(fds)|$metrics"
