"""Builds the `objectcache` package: the Rust library (cdylib) is built with cargo and copied
into the package as `objectcache/libobjectcache.so`, so the wheel carries it.

Environment:
  OBJECTCACHE_CDYLIB=PATH        use this prebuilt libobjectcache.so instead of running cargo
  OBJECTCACHE_CARGO_FEATURES=F   extra cargo features for the library (e.g. `cuda`)
  OBJECTCACHE_NO_STRIP=1         keep the library's debug info (by default the bundled copy
                                 is stripped of it with `strip --strip-debug`, where `strip`
                                 exists: about 18 MB instead of 125 MB)
  CARGO, CARGO_TARGET_DIR        honoured as by cargo itself
"""

import json
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
MANIFEST = os.path.join(ROOT, "Cargo.toml")


def crate_version():
    try:
        with open(MANIFEST) as f:
            text = f.read()
    except OSError:
        return "0.1.0"
    pkg = text.split("[package]", 1)[-1]
    m = re.search(r'^version\s*=\s*"([^"]+)"', pkg, re.M)
    return m.group(1) if m else "0.1.0"


def build_cdylib():
    """Path of libobjectcache.so: $OBJECTCACHE_CDYLIB, or what `cargo build --release --lib
    --no-default-features --features s3[,$OBJECTCACHE_CARGO_FEATURES]` reports as the cdylib
    artifact."""
    pre = os.environ.get("OBJECTCACHE_CDYLIB")
    if pre:
        if not os.path.isfile(pre):
            sys.exit(f"objectcache: OBJECTCACHE_CDYLIB={pre} is not a file")
        return pre
    if not os.path.isfile(MANIFEST):
        sys.exit(
            f"objectcache: no Cargo.toml at {MANIFEST}; build from a checkout of the "
            "repository (pip install ./ffi/python) or set OBJECTCACHE_CDYLIB"
        )
    cargo = os.environ.get("CARGO", "cargo")
    # The library alone: no server, no command line (features `server`, `cli`).
    feats = ",".join(f for f in ["s3", os.environ.get("OBJECTCACHE_CARGO_FEATURES", "")] if f)
    cmd = [cargo, "build", "--release", "--lib", "--no-default-features", "--features", feats,
           "--manifest-path", MANIFEST, "--message-format=json-render-diagnostics"]
    print("objectcache: " + " ".join(cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, check=True)
    except FileNotFoundError:
        sys.exit("objectcache: cargo not found (a Rust toolchain >= 1.95 is needed), "
                 "or set OBJECTCACHE_CDYLIB to a built libobjectcache.so")
    except subprocess.CalledProcessError as e:
        sys.exit(f"objectcache: cargo build failed with exit status {e.returncode}")
    found = None
    for line in proc.stdout.decode().splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") != "compiler-artifact":
            continue
        target = msg.get("target", {})
        if target.get("name") == "objectcache" and "cdylib" in target.get("kind", []):
            for fn in msg.get("filenames", []):
                if fn.endswith((".so", ".dylib")):
                    found = fn
    if not found:
        sys.exit("objectcache: cargo reported no cdylib artifact for the objectcache crate")
    return found


class BuildPyWithLibrary(build_py):
    """build_py that also places the native library inside the package."""

    def run(self):
        super().run()
        lib = build_cdylib()
        dest_dir = os.path.join(self.build_lib, "objectcache")
        os.makedirs(dest_dir, exist_ok=True)
        dest = os.path.join(dest_dir, "libobjectcache.so")
        shutil.copyfile(lib, dest)
        strip = shutil.which("strip")
        if strip and os.environ.get("OBJECTCACHE_NO_STRIP") != "1":
            subprocess.run([strip, "--strip-debug", dest], check=False)


class NativeDistribution(Distribution):
    """The wheel holds a native library: platform-specific, not pure."""

    def has_ext_modules(self):
        return True


cmdclass = {"build_py": BuildPyWithLibrary}
try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    from wheel.bdist_wheel import bdist_wheel


class BdistWheel(bdist_wheel):
    """Tags the wheel py3-none-PLATFORM: the library is loaded with ctypes, so any Python 3
    on the platform can use it."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


cmdclass["bdist_wheel"] = BdistWheel

setup(version=crate_version(), cmdclass=cmdclass, distclass=NativeDistribution)
