#!/usr/bin/env bash
# Installs the ObjectCache C library: header, shared and static library, pkg-config file.
#
#   ffi/install.sh [PREFIX]          (default PREFIX: /usr/local; DESTDIR is honoured)
#
# Builds the library alone first (`cargo build --release --lib --no-default-features
# --features s3`: no server, no command line) unless OBJECTCACHE_NO_BUILD=1, and takes
# the libraries from $CARGO_TARGET_DIR/release (default target/release). Then:
#   cc app.c $(pkg-config --cflags --libs objectcache)
# (set PKG_CONFIG_PATH=PREFIX/lib/pkgconfig for a prefix pkg-config does not search).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
prefix="${1:-/usr/local}"
libdir="${LIBDIR:-lib}"
target="${CARGO_TARGET_DIR:-$root/target}/release"
if [ "${OBJECTCACHE_NO_BUILD:-0}" != 1 ]; then
    (cd "$root" && cargo build --release --lib --no-default-features --features s3)
fi
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -1)"
abi="$(sed -n 's/^#define OBJECTCACHE_ABI_VERSION \([0-9]*\)$/\1/p' "$root/ffi/objectcache.h")"
dest="${DESTDIR:-}$prefix"
install -d "$dest/include" "$dest/$libdir/pkgconfig"
install -m 0644 "$root/ffi/objectcache.h" "$dest/include/objectcache.h"
# The shared library's SONAME is libobjectcache.so.<ABI version> (set in build.rs).
install -m 0755 "$target/libobjectcache.so" "$dest/$libdir/libobjectcache.so.$abi"
ln -sf "libobjectcache.so.$abi" "$dest/$libdir/libobjectcache.so"
install -m 0644 "$target/libobjectcache.a" "$dest/$libdir/libobjectcache.a"
sed -e "s|@PREFIX@|$prefix|" -e "s|@LIBDIR@|$libdir|" -e "s|@VERSION@|$version|" \
    -e "s|@ABI@|$abi|" "$root/ffi/objectcache.pc.in" > "$dest/$libdir/pkgconfig/objectcache.pc"
echo "installed objectcache $version (C ABI $abi) under $dest"
