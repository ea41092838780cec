#!/usr/bin/env bash
# Creates a Python virtual environment with moto's S3 server (PyPI `moto[server]`): a second
# S3 implementation, beside Ceph RGW, that the conformance suite and the stock-S3 tests run
# against (`scripts/moto-start.sh` starts it).
# Usage: scripts/moto-setup.sh [VENV_DIR]   (default: target/moto-venv)
set -euo pipefail
venv="${1:-target/moto-venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet 'moto[server]==5.2.5'
"$venv/bin/moto_server" --help >/dev/null
echo "moto 5.2.5 installed in $venv"
