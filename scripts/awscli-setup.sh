#!/usr/bin/env bash
# Creates a Python virtual environment with awscli and boto3 from PyPI, for the S3
# compatibility test of the ObjectCache server (tests/server_awscli.rs).
# Usage: scripts/awscli-setup.sh [VENV_DIR]   (default: $OBJECTCACHE_AWS_VENV or target/awscli-venv)
set -euo pipefail
venv="${1:-${OBJECTCACHE_AWS_VENV:-target/awscli-venv}}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet 'awscli>=1.32' 'boto3>=1.34'
"$venv/bin/aws" --version
echo "awscli and boto3 installed in $venv"
