#!/usr/bin/env bash
# Stops the cluster that start.sh started in CEPH_DIR (default /tmp/objectcache-ceph), by the
# pids its daemons wrote; other Ceph processes on the machine are left alone.
D=${CEPH_DIR:-/tmp/objectcache-ceph}
pids=()
for f in "$D"/run/*.pid; do
    [ -f "$f" ] || continue
    p=$(cat "$f" 2>/dev/null) || continue
    [ -n "$p" ] && kill -0 "$p" 2>/dev/null && pids+=("$p")
done
[ ${#pids[@]} -eq 0 ] && exit 0
kill "${pids[@]}" 2>/dev/null
for _ in $(seq 1 20); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && exit 0
    sleep 0.25
done
kill -9 "${pids[@]}" 2>/dev/null
exit 0
