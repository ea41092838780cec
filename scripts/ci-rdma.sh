#!/usr/bin/env bash
# CI lane for the RDMA data path (feature `rdma`).
#
# 1. installs the system packages (QEMU, busybox, kmod, cpio, rdma-core and the verbs
#    headers, libclang for bindgen) when missing;
# 2. builds the RDMA tests and tests/cuda_device.rs with `cargo test --release --workspace
#    --features objectcache/rdma,objectcache/cuda --no-run` (the feature `rdma`, and `cuda`,
#    which builds without CUDA): .ci/run's CUDA lane then runs cuda_device from this build instead of
#    building the crate once more. `--workspace` makes cargo unify the dependencies' features
#    over every member, as the test command's build does, so the dependencies built there
#    are reused (built for the root package alone, about a hundred of them, the AWS SDK's
#    among them, get other features and build again: in cold CI dry runs this build took
#    596 s that way, 192-211 s this way);
# 3. boots the soft-RoCE VM once (scripts/rxe-vm/run.sh: Debian's kernel under QEMU, rxe0 on
#    loopback) and runs the RDMA test binaries (tests/rdma_*.rs) inside it, where
#    OBJECTCACHE_REQUIRE_RDMA=1 turns any SKIP into a failure. The library's own unit tests
#    are not built here: the RDMA data path's pure parts (the write immediate, the completion
#    tally) live in objectcache-core, whose tests the ordinary test command runs;
# 4. runs clippy, warnings as errors: the library with `rdma` alone (nothing there may be
#    used only by the tests), and every target with `rdma,cuda` (the tests and the CUDA
#    code, which CI's clippy gate builds without).
# Exits non-zero when anything fails. Guest memory: RXE_VM_MEM (default 2G here: every RDMA
# gather session pins a 64 MiB staging arena, and the tests run several servers at once).
# `scripts/ci-rdma.sh --prepare` does step 1 and the VM's kernel and initrd only (downloads:
# .ci/run runs it while the workspace builds).
set -euo pipefail
export RXE_VM_MEM="${RXE_VM_MEM:-2G}"
cd "$(dirname "$0")/.."
start=$(date +%s)

pkgs=(qemu-system-x86 busybox-static kmod cpio rdma-core ibverbs-utils ibverbs-providers libibverbs-dev
      librdmacm-dev iproute2 libclang-dev pkg-config)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "ci-rdma: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ "${1:-}" = "--prepare" ]; then
  scripts/rxe-vm/assets.sh >/dev/null
  echo "ci-rdma: packages and VM assets ready after $(( $(date +%s) - start )) s"
  exit 0
fi

features=rdma,cuda
# The same features named for the whole workspace (`objectcache/<feature>` each).
ws_features="objectcache/${features//,/,objectcache/}"
echo "ci-rdma: building tests with --workspace --features $ws_features"
json="$(mktemp)"; trap 'rm -f "$json"' EXIT
targets=(--test cuda_device)
for f in tests/rdma_*.rs; do targets+=(--test "$(basename "$f" .rs)"); done
cargo test --release --workspace --features "$ws_features" --no-run "${targets[@]}" --message-format=json-render-diagnostics > "$json"
# test executables: the integration tests named rdma_*
exe() { sed -n 's/.*"executable":"\([^"]*\)".*/\1/p'; }
mapfile -t rdma_tests < <(grep '"kind":\["test"\]' "$json" | grep -E '"name":"rdma_[A-Za-z0-9_]*"' | exe || true)
[ ${#rdma_tests[@]} -gt 0 ] || { echo "ci-rdma: no tests/rdma_*.rs executables were built" >&2; exit 1; }
echo "ci-rdma: ${#rdma_tests[@]} RDMA test binaries built after $(( $(date +%s) - start )) s; booting the soft-RoCE VM"

script="set -e"
for t in "${rdma_tests[@]}"; do script+="; echo '== $(basename "$t")'; $t"; done
rc=0
scripts/rxe-vm/run.sh bash -c "$script" || rc=$?
echo "ci-rdma: VM finished with exit status $rc after $(( $(date +%s) - start )) s"
# Lints of the feature's code (CI's clippy gate builds without it, and the verbs headers are
# only installed here): warnings are errors, as in the gate.
if cargo clippy --version >/dev/null 2>&1; then
  # The library crates by name (the RDMA code is in the client and the server crates, which a
  # root-only clippy would check as dependencies without linting them).
  echo "ci-rdma: cargo clippy (library crates) --features objectcache/rdma --lib; --workspace --features $ws_features --all-targets; -D warnings"
  cargo clippy -p objectcache -p objectcache-client -p objectcache-capi -p objectcache-server --features objectcache/rdma --lib --quiet -- -D warnings || rc=1
  cargo clippy --workspace --features "$ws_features" --all-targets --quiet -- -D warnings || rc=1
fi
echo "ci-rdma: exit $rc after $(( $(date +%s) - start )) s"
exit $rc
