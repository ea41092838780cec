#!/usr/bin/env bash
# scripts/rxe-vm/run.sh CMD [ARGS...]
#
# Runs CMD inside a throw-away QEMU guest that has a soft-RoCE device rxe0 (rdma_rxe on the
# loopback interface; GID index 1 = ::ffff:127.0.0.1, RoCE v2). The guest boots Debian's
# stock kernel and uses this host's root filesystem read-only (writes go to a tmpfs), so
# binaries built here run there unchanged. CMD's output is copied to our stdout and its exit
# status becomes ours; 125 = the VM or rxe0 could not be set up, 124 = timeout.
# Usable as a cargo runner: CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=scripts/rxe-vm/run.sh
#
#   RXE_VM_MEM      guest memory (default 1G)     RXE_VM_CPUS     vCPUs (default: nproc, max 4)
#   RXE_VM_TIMEOUT  seconds (default 600)         RXE_VM_NETDEV   lo (default) or dummy0
#   RXE_VM_CACHE    kernel + initrd cache         RXE_VM_DEBUG=1  print the guest console
# Inside the guest OBJECTCACHE_REQUIRE_RDMA=1 is set, so RDMA tests fail (not skip) without rxe0.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# -ge 1 ] || { sed -n '2,16p' "$0" >&2; exit 2; }
kernel="$("$here/assets.sh")" || { echo "rxe-vm: preparing the kernel/initrd failed" >&2; exit 125; }
cache="${RXE_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/objectcache-rxe-vm}"
kver="${kernel##*/vmlinuz-}"
command -v qemu-system-x86_64 >/dev/null || { echo "rxe-vm: qemu-system-x86_64 missing (apt-get install qemu-system-x86)" >&2; exit 125; }

x="$(mktemp -d "${TMPDIR:-/tmp}/objectcache-vm.XXXXXX")"
trap 'rm -rf "$x"' EXIT
: > "$x/output"
{ printf 'exec'; printf ' %q' "$@"; printf '\n'; } > "$x/command"
export OBJECTCACHE_REQUIRE_RDMA=1
export -p | grep -vE '^declare -x (PWD|OLDPWD|SHLVL|HOSTNAME|TERM|TMPDIR|DISPLAY|SSH_[A-Z_]*)=' > "$x/environment"
printf 'VM_NETDEV=%q\nVM_CWD=%q\n' "${RXE_VM_NETDEV:-lo}" "$PWD" > "$x/settings"

cpus="${RXE_VM_CPUS:-$(nproc)}"; [ "$cpus" -gt 4 ] && cpus=4
start=$(date +%s.%N)
# KVM is not used: on these CI machines /dev/kvm (where present) cannot run a stock kernel.
timeout -k 5 "${RXE_VM_TIMEOUT:-600}" qemu-system-x86_64 \
  -accel tcg,thread=multi -machine q35 -cpu max -m "${RXE_VM_MEM:-1G}" -smp "$cpus" \
  -display none -monitor none -no-reboot -nic none -serial "file:$x/console" \
  -kernel "$kernel" -initrd "$cache/initrd-$kver.gz" -append "console=ttyS0 quiet loglevel=3 panic=-1" \
  -fsdev "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap" \
  -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot \
  -fsdev "local,id=exchange,path=$x,security_model=none" \
  -device virtio-9p-pci,fsdev=exchange,mount_tag=exchange \
  -fsdev "local,id=modules,path=$cache/kernel/lib/modules/$kver,security_model=none,readonly=on" \
  -device virtio-9p-pci,fsdev=modules,mount_tag=modules &
qemu=$!
tail -n +1 -f --pid=$qemu "$x/output" &
tailer=$!
wait $qemu; qrc=$?
wait $tailer 2>/dev/null
end=$(date +%s.%N)
[ -n "${RXE_VM_DEBUG:-}" ] && { cat "$x/console" >&2; awk -v a="$start" -v b="$end" 'BEGIN { printf "rxe-vm: %.1f s wall\n", b - a }' >&2; }
if [ -s "$x/status" ]; then exit "$(cat "$x/status")"; fi
if [ $qrc -eq 124 ] || [ $qrc -eq 137 ]; then
  echo "rxe-vm: timed out after ${RXE_VM_TIMEOUT:-600} s" >&2; tail -n 20 "$x/console" >&2; exit 124
fi
echo "rxe-vm: the guest stopped without a status (qemu exit $qrc); console:" >&2
tail -n 40 "$x/console" >&2
exit 125
