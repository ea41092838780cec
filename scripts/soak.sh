#!/usr/bin/env bash
# Soak: concurrent saves, lookups and loads for a bounded time; checks no errors, byte-exact
# loads, stable RSS and no leaked file descriptors, and prints one SOAK| line of figures.
#
# Usage: scripts/soak.sh [seconds] [workers] [store-url]
#   store-url: a directory (default: a fresh temporary one), s3://bucket?endpoint=..., or the
#   ObjectCache server's URL.
set -euo pipefail
cd "$(dirname "$0")/.."
export OBJECTCACHE_SOAK_SECS="${1:-60}" OBJECTCACHE_SOAK_WORKERS="${2:-8}" OBJECTCACHE_SOAK_STORE="${3:-}"
export CARGO_PROFILE_RELEASE_INCREMENTAL="${CARGO_PROFILE_RELEASE_INCREMENTAL:-true}"
cargo test --release --test fault_soak -- --ignored --nocapture 2>&1 | tee /dev/stderr | grep '^SOAK|' >/dev/null
