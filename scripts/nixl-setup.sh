#!/usr/bin/env bash
# Creates a Python virtual environment with NIXL's Python agent (the nixl-cu12 wheel, which
# runs on a CPU-only machine without its CUDA dependencies) and numpy, from PyPI. The modeled
# TTFT benchmark uses it to run NIXL's own OBJ plugin as a peer (`--nixl-venv DIR` or
# OBJECTCACHE_NIXL_VENV); ffi/nixl/check_plugin.py uses it to load our NIXL plugin.
# Usage: scripts/nixl-setup.sh [VENV_DIR]   (default: $OBJECTCACHE_NIXL_VENV or target/nixl-venv)
set -euo pipefail
venv="${1:-${OBJECTCACHE_NIXL_VENV:-target/nixl-venv}}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet --no-deps 'nixl-cu12==1.5.1'
"$venv/bin/pip" install --quiet numpy
"$venv/bin/python" -c 'import nixl_cu12._api; print("nixl ok")'
echo "nixl-cu12 1.5.1 and numpy installed in $venv"
