#!/bin/bash
# Runs as PID 1 in the guest (copied in by the initrd). Root = host root (read-only) + tmpfs.
# Mounts the exchange directory, loads rdma_rxe, creates rxe0 and runs the command from the host.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
x=/run/objectcache-vm
finish() { echo "$1" > "$x/status"; sync; echo o > /proc/sysrq-trigger; sleep 30; }
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p "$x" /dev/pts /dev/shm
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 exchange "$x" || { echo "guest: exchange mount failed" > /dev/ttyS0; echo o > /proc/sysrq-trigger; sleep 30; }
exec >>"$x/output" 2>&1
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
. "$x/settings"   # VM_NETDEV, VM_CWD
# A fresh /tmp, unless the checkout (and so the test binaries) lives under the host's /tmp:
# the overlay root already makes /tmp writable, and a tmpfs would hide the host's files.
case "$VM_CWD" in
  /tmp|/tmp/*) ;;
  *) mount -t tmpfs tmpfs /tmp ;;
esac
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
kver="$(uname -r)"
mkdir -p "/lib/modules/$kver"
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose modules "/lib/modules/$kver" || { echo "guest: modules mount failed"; finish 125; }
ip link set lo up
modprobe -a rdma_rxe ib_uverbs rdma_ucm || { echo "guest: cannot load rdma_rxe"; finish 125; }
if [ "$VM_NETDEV" != lo ]; then
  modprobe dummy numdummies=0
  ip link add "$VM_NETDEV" type dummy && ip addr add 198.18.0.1/24 dev "$VM_NETDEV" && ip link set "$VM_NETDEV" up
fi
rdma link add rxe0 type rxe netdev "$VM_NETDEV" || { echo "guest: rdma link add rxe0 failed"; finish 125; }
ulimit -l unlimited
cd "$VM_CWD" 2>/dev/null || cd /
. "$x/environment"
bash "$x/command" </dev/null
finish $?
