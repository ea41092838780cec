#!/usr/bin/env bash
# Starts moto's S3 server (from scripts/moto-setup.sh) on 127.0.0.1:PORT in the background,
# waits until it answers, and prints MOTO_READY. Stop it with `kill $(cat PIDFILE)`.
# Usage: scripts/moto-start.sh [VENV_DIR] [PORT] [PIDFILE]
#   (defaults: target/moto-venv, 5000, target/moto.pid; the log goes to PIDFILE.log)
set -euo pipefail
venv="${1:-target/moto-venv}"
port="${2:-5000}"
pidfile="${3:-target/moto.pid}"
"$venv/bin/moto_server" -H 127.0.0.1 -p "$port" >"$pidfile.log" 2>&1 &
echo $! >"$pidfile"
for _ in $(seq 1 100); do
    if curl -s -o /dev/null "http://127.0.0.1:$port/"; then
        echo "MOTO_READY http://127.0.0.1:$port"
        exit 0
    fi
    sleep 0.2
done
echo "moto did not answer on port $port within 20 s" >&2
cat "$pidfile.log" >&2
exit 1
