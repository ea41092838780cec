#!/usr/bin/env bash
# Prepares what run.sh boots, once, under $RXE_VM_CACHE (default ~/.cache/objectcache-rxe-vm):
#   kernel/boot/vmlinuz-<ver>, kernel/lib/modules/<ver>   Debian's stock kernel package (has rdma_rxe)
#   initrd-<ver>.gz                                        busybox + the modules that mount the host root
# Prints the kernel path. Rebuilds the initrd when this script or guest-init.sh changes.
# Needs: apt (to download the kernel package), busybox-static, kmod, cpio.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${RXE_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/objectcache-rxe-vm}"
mkdir -p "$cache"

# Kernel package: the one linux-image-amd64 points at, remembered after the first download.
pkg="${RXE_VM_KERNEL_PKG:-}"
if [ -z "$pkg" ] && [ -s "$cache/kernel-pkg" ]; then pkg="$(cat "$cache/kernel-pkg")"; fi
if [ -z "$pkg" ]; then
  pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1)"
fi
[ -n "$pkg" ] || { echo "assets.sh: cannot tell which kernel package to use (apt-get update? or set RXE_VM_KERNEL_PKG)" >&2; exit 1; }
ver="${pkg#linux-image-}"
if [ ! -f "$cache/kernel/boot/vmlinuz-$ver" ]; then
  echo "assets.sh: downloading $pkg" >&2
  work="$(mktemp -d "$cache/dl.XXXXXX")"; chmod 755 "$cache" ; chmod 777 "$work"   # apt downloads as user _apt
  (cd "$work" && apt-get download "$pkg" >&2)
  rm -rf "$cache/kernel"
  dpkg-deb -x "$work"/*.deb "$cache/kernel"
  rm -rf "$work"
  depmod -b "$cache/kernel" "$ver"
fi
printf '%s\n' "$pkg" > "$cache/kernel-pkg"

initrd="$cache/initrd-$ver.gz"
if [ ! -s "$initrd" ] || [ "$here/assets.sh" -nt "$initrd" ] || [ "$here/guest-init.sh" -nt "$initrd" ]; then
  root="$(mktemp -d)"
  trap 'rm -rf "$root"' EXIT
  mkdir -p "$root"/{bin,dev,proc,sys,lower,upper,newroot,modules}
  cp /bin/busybox "$root/bin/busybox"
  cp "$here/guest-init.sh" "$root/guest-init.sh"
  # modules needed before the host root is visible, in dependency order
  for m in virtio_pci 9pnet_virtio 9p overlay; do
    modprobe -d "$cache/kernel" -S "$ver" --show-depends "$m"
  done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' | while read -r ko; do
    cp "$ko" "$root/modules/"
    basename "$ko" >> "$root/modules/load-order"
  done
  cat > "$root/init" <<'INIT'
#!/bin/busybox sh
# stage 1: mount the host's root (9p, read-only) under a tmpfs overlay, then hand over to guest-init.sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
for ko in $(cat /modules/load-order); do insmod "/modules/$ko" || echo "initrd: insmod $ko failed"; done
halt() { echo "initrd: $*"; poweroff -f; }
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /lower || halt "cannot mount the host root"
mount -t tmpfs -o size=50% tmpfs /upper && mkdir -p /upper/data /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot || halt "overlay mount failed"
for d in proc sys dev; do mkdir -p "/newroot/$d"; mount --move "/$d" "/newroot/$d"; done
cp /guest-init.sh /newroot/.objectcache-guest-init || halt "cannot place guest-init.sh"
exec switch_root /newroot /bin/bash /.objectcache-guest-init
INIT
  chmod +x "$root/init"
  (cd "$root" && find . -print | cpio -o -H newc --quiet | gzip -1) > "$initrd.part"
  mv "$initrd.part" "$initrd"
fi
printf '%s\n' "$cache/kernel/boot/vmlinuz-$ver"
