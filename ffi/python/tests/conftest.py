"""Fixtures of the `objectcache` package tests: an embedded store directory and a real
ObjectCache server (`objectcache serve`) started as a process.

The server binary is $OBJECTCACHE_BIN, else target/release/objectcache of this checkout
($CARGO_TARGET_DIR honoured). Without it the server tests are skipped, or fail when
OBJECTCACHE_REQUIRE_ALL is set (as in CI).
"""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
# The server takes the test S3 credentials when they are set, so one AWS environment serves
# both it and the test S3 endpoint (Ceph RGW) in a process that uses the two.
ACCESS = os.environ.get("OBJECTCACHE_TEST_S3_ACCESS_KEY") or "pytest-access"
SECRET = os.environ.get("OBJECTCACHE_TEST_S3_SECRET_KEY") or "pytest-secret-key-0123456789"
BUCKET = "kv-pytest"


def _server_binary():
    env = os.environ.get("OBJECTCACHE_BIN")
    if env:
        return pathlib.Path(env)
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "objectcache"


def missing(what):
    """Skips a test whose external component is absent, or fails it under
    OBJECTCACHE_REQUIRE_ALL."""
    if os.environ.get("OBJECTCACHE_REQUIRE_ALL"):
        pytest.fail(f"{what} (required: OBJECTCACHE_REQUIRE_ALL is set)")
    pytest.skip(what)


class Server:
    """A running `objectcache serve` over a directory store."""

    def __init__(self, proc, addr, store_dir):
        self.proc = proc
        self.addr = addr
        self.store_dir = store_dir

    def url(self, prefix, **params):
        """An s3:// store URL on this server (path addressing) with extra query parameters."""
        q = "&".join([f"endpoint=http://{self.addr}", "region=us-east-1", "addressing=path"]
                     + [f"{k}={v}" for k, v in params.items()])
        return f"s3://{BUCKET}/{prefix}?{q}"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    binary = _server_binary()
    if not binary.is_file():
        missing(f"no server binary at {binary} (cargo build --release)")
    store_dir = tmp_path_factory.mktemp("server-store")
    proc = subprocess.Popen(
        [str(binary), "serve", "--listen", "127.0.0.1:0", "--bucket", BUCKET,
         "--store", str(store_dir), "--access-key", f"{ACCESS}:{SECRET}",
         "--shutdown-grace-secs", "1"],
        stdout=subprocess.PIPE,
    )
    line = proc.stdout.readline().decode().strip()
    if proc.poll() is not None or not line:
        pytest.fail(f"objectcache serve did not start (readiness line {line!r})")
    addr = line.rsplit(" ", 1)[-1]
    # The engine's S3 client takes credentials from the AWS environment.
    saved = {k: os.environ.get(k) for k in
             ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    yield Server(proc, addr, store_dir)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=30)
