#!/usr/bin/env bash
# A multi-host test bed on one machine: hosts are network namespaces joined by one bridge.
#
#   mon1             Ceph monitor                         10.99.0.11
#   osd1..osd3       one Ceph OSD each (memstore)         10.99.0.21-23
#   rgw1, rgw2       Ceph RGW (S3) on port 7480           10.99.0.31-32
#   gw1..gw3         ObjectCache gateways on port 9000    10.99.0.41-43
#   client           where clients run                    10.99.0.100
#
# Pools keep 3 replicas, one per OSD host (CRUSH failure domain: host), and stay writable
# with 2 (min_size 2), so losing one OSD loses no data and stops no I/O. Each gateway runs
# `objectcache serve` in gateway mode over both RGWs. The bridge lives in a namespace of its
# own (NAME-sw), so nothing is added to the machine's own network: the addresses exist only
# inside the bed's namespaces.
#
# Usage (as root; needs iproute2, curl and Debian's `radosgw ceph-mon ceph-osd`):
#   bed.sh start             start everything; prints BED_READY and the figures
#   bed.sh stop              stop every daemon and delete the namespaces
#   bed.sh status            daemons, their memory, the cluster's OSD map
#   bed.sh gw-stop N [--term] stop gateway N (SIGKILL, a crash; --term: graceful SIGTERM)
#   bed.sh gw-start N        start gateway N again; returns once it answers its health check
#   bed.sh osd-stop N        kill OSD N (1..3); returns once the monitor marks it down
#   bed.sh osd-start N       start OSD N again; returns once it is up
#   bed.sh heal              start every gateway and OSD that is not running
#   bed.sh exec HOST CMD...  run CMD on a host (e.g. `bed.sh exec client curl ...`)
#
# Settings (environment):
#   BED_DIR         state, logs, pid files and bed.env (default /tmp/objectcache-bed)
#   BED_NAME        namespace name prefix, at most 8 characters (default ocb)
#   OBJECTCACHE_BIN the objectcache binary (default target/release/objectcache of this tree)
#   RGW_AK, RGW_SK  S3 keys of the Ceph user, also accepted by the gateways
#                   (default cephtestak / cephtestsecretkey0123456789)
#   MEMSTORE_BYTES  capacity of each in-memory OSD (default 2 GiB; used only as filled)
#   BED_GW_CAP      each gateway's gather send rate, bytes/s (default 100000000: a 100 MB/s
#                   share, so that a 100 MB load lasts about a second and can be cut)
#   START_TIMEOUT   seconds to wait for each daemon (default 90)
#
# bed.env (in BED_DIR) records what tests need: the namespaces, addresses and the binary.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/scripts/ceph-rgw/ceph-conf.sh"
D=${BED_DIR:-/tmp/objectcache-bed}
NAME=${BED_NAME:-ocb}
BIN=${OBJECTCACHE_BIN:-$repo/target/release/objectcache}
AK=${RGW_AK:-cephtestak}
SK=${RGW_SK:-cephtestsecretkey0123456789}
BYTES=${MEMSTORE_BYTES:-2147483648}
GW_CAP=${BED_GW_CAP:-100000000}
WAIT=${START_TIMEOUT:-90}
NET=10.99.0
BUCKET=objectcache-bed
GW_PORT=9000
RGW_PORT=7480

die() { echo "bed.sh: $*" >&2; exit 1; }
say() { echo "bed: $*"; }
[ ${#NAME} -le 8 ] || die "BED_NAME must be at most 8 characters"

# Hosts and their addresses.
declare -A ADDR=([mon1]=$NET.11 [osd1]=$NET.21 [osd2]=$NET.22 [osd3]=$NET.23
                 [rgw1]=$NET.31 [rgw2]=$NET.32 [gw1]=$NET.41 [gw2]=$NET.42 [gw3]=$NET.43
                 [client]=$NET.100)
HOSTS=(mon1 osd1 osd2 osd3 rgw1 rgw2 gw1 gw2 gw3 client)
ns() { echo "$NAME-$1"; }
on() { local h=$1; shift; ip netns exec "$(ns "$h")" "$@"; }

export CEPH_CONF="$D/ceph.conf"
ceph_cmd() { on mon1 timeout 20 ceph --connect-timeout 10 "$@"; }

tail_logs() { for f in "$D"/log/*; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }; done; }
wait_for() { # wait_for WHAT COMMAND...: retries COMMAND every 0.2 s for $WAIT seconds
    local what=$1; shift
    local end=$(( $(date +%s) + WAIT ))
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$end" ] || { tail_logs; die "timed out after ${WAIT}s waiting for $what"; }
        sleep 0.2
    done
}
# A process that has exited but not yet been reaped (a zombie) counts as gone: it holds no
# socket, and `kill -0` would still find it.
proc_alive() { kill -0 "$1" 2>/dev/null && [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" != Z ]; }
pid_alive() { [ -f "$1" ] && proc_alive "$(cat "$1")"; }

# --- network -------------------------------------------------------------------------------
net_up() {
    ip netns add "$(ns sw)"
    on sw ip link set lo up
    on sw ip link add br0 type bridge
    on sw ip link set br0 up
    local i=0 h
    for h in "${HOSTS[@]}"; do
        i=$((i + 1))
        ip netns add "$(ns "$h")"
        ip link add "p$i" netns "$(ns sw)" type veth peer name eth0 netns "$(ns "$h")"
        on sw ip link set "p$i" master br0
        on sw ip link set "p$i" up
        on "$h" ip link set lo up
        on "$h" ip addr add "${ADDR[$h]}/24" dev eth0
        on "$h" ip link set eth0 up
    done
    mkdir -p "$(dirname "$(hosts_file)")"
    {
        echo "127.0.0.1 localhost"
        for h in "${HOSTS[@]}"; do echo "${ADDR[$h]} $h.bed"; done
        echo "${ADDR[gw1]} gateways.bed"
        echo "${ADDR[gw2]} gateways.bed"
        echo "${ADDR[gw3]} gateways.bed"
    } > "$(hosts_file)"
}

# Processes started with `ip netns exec NAME-client` see /etc/netns/NAME-client/hosts as
# /etc/hosts: the name `gateways.bed` resolves there to the three gateways.
hosts_file() { echo "/etc/netns/$(ns client)/hosts"; }

net_down() {
    rm -rf "/etc/netns/$(ns client)"
    local h
    for h in "${HOSTS[@]}" sw; do
        ip netns del "$(ns "$h")" 2>/dev/null || true
    done
}

# --- Ceph ----------------------------------------------------------------------------------
write_conf() {
    local fsid=$1
    {
        cat <<CONF
[global]
fsid = $fsid
mon host = [v2:${ADDR[mon1]}:3300,v1:${ADDR[mon1]}:6789]
# Three replicas, one per host; writable with two.
osd pool default size = 3
osd pool default min size = 2
osd crush chooseleaf type = 1
# A lost OSD is marked down within seconds (a killed daemon's peers see connections
# refused at once; a silent one misses heartbeats for 4 s), and never marked out, so its
# data is not moved while the bed runs.
osd heartbeat interval = 1
osd heartbeat grace = 4
mon osd min down reporters = 1
mon osd down out interval = 0
CONF
        ceph_conf_global "$D" "$BYTES"
        cat <<CONF

[mon.a]
public addr = ${ADDR[mon1]}
CONF
    } > "$D/ceph.conf"
    local i
    for i in 1 2 3; do
        cat >> "$D/ceph.conf" <<CONF

[osd.$((i - 1))]
public addr = ${ADDR[osd$i]}
cluster addr = ${ADDR[osd$i]}
crush location = root=default host=osd$i
CONF
    done
    for i in 1 2; do
        cat >> "$D/ceph.conf" <<CONF

[client.rgw.rgw$i]
public addr = ${ADDR[rgw$i]}
rgw frontends = beast endpoint=${ADDR[rgw$i]}:$RGW_PORT
rgw dns name = rgw$i
CONF
        ceph_conf_rgw_gc >> "$D/ceph.conf"
    done
}

osd_count_up() { ceph_cmd osd stat 2>/dev/null | grep -o '[0-9]* up' | grep -o '[0-9]*'; }
osd_is() { # osd_is ID up|down
    ceph_cmd osd dump 2>/dev/null | grep -q "^osd\.$1 $2 "
}

start_osd() { # start_osd N (1..3); OSD id N-1
    local i=$1 id=$(( $1 - 1 ))
    on "osd$i" ceph-osd -i "$id" 2>>"$D/log/osd$i.err"
    wait_for "osd.$id up" osd_is "$id" up
}

start_rgw() {
    on "rgw$1" radosgw -n "client.rgw.rgw$1"
    wait_for "rgw$1 on ${ADDR[rgw$1]}:$RGW_PORT" on "rgw$1" curl -s -o /dev/null -m 1 "http://${ADDR[rgw$1]}:$RGW_PORT/"
}

# --- gateways ------------------------------------------------------------------------------
gw_store() { # gw_store N: gateway N's upstream: both RGWs (either can serve any object)
    echo "s3://$BUCKET/gw?endpoint=http://${ADDR[rgw1]}:$RGW_PORT,http://${ADDR[rgw2]}:$RGW_PORT"
}

start_gw() {
    local i=$1
    pid_alive "$D/run/gw$i.pid" && die "gateway $i is already running"
    local addr=${ADDR[gw$i]}
    # `ip netns exec` execs the server in the namespace: $! is the server's pid.
    AWS_ACCESS_KEY_ID=$AK AWS_SECRET_ACCESS_KEY=$SK AWS_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true \
        ip netns exec "$(ns "gw$i")" "$BIN" serve --listen "$addr:$GW_PORT" --store "$(gw_store "$i")" \
        --access-key "$AK:$SK" --bucket kvcache --shutdown-grace-secs 2 \
        --scheduler equal --bandwidth-cap-bytes-per-s "$GW_CAP" \
        >>"$D/log/gw$i.log" 2>&1 &
    echo $! > "$D/run/gw$i.pid"
    wait_for "gateway $i on $addr:$GW_PORT" on client curl -sf -o /dev/null -m 1 "http://$addr:$GW_PORT/_objectcache/health"
}

stop_gw() { # stop_gw N [--term]
    local f="$D/run/gw$1.pid" sig=KILL
    [ "${2:-}" = "--term" ] && sig=TERM
    pid_alive "$f" || { rm -f "$f"; return 0; }
    local p
    p=$(cat "$f")
    kill "-$sig" "$p"
    local end=$(( $(date +%s) + 20 ))
    while proc_alive "$p"; do
        [ "$(date +%s)" -lt "$end" ] || { kill -KILL "$p" 2>/dev/null || true; }
        sleep 0.05
    done
    rm -f "$f"
}

heal() { # start every gateway and OSD that is not running (after a test that stopped one failed)
    local i
    for i in 1 2 3; do pid_alive "$D/run/gw$i.pid" || start_gw "$i"; done
    for i in 1 2 3; do pid_alive "$D/run/osd.$((i - 1)).pid" || start_osd "$i"; done
}

# --- commands ------------------------------------------------------------------------------
cmd_start() {
    for tool in ceph ceph-mon ceph-osd ceph-authtool monmaptool radosgw radosgw-admin curl ip; do
        command -v "$tool" >/dev/null || die "$tool not found; install: apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd curl iproute2"
    done
    [ -x "$BIN" ] || die "$BIN not found: build it (cargo build --release --bin objectcache) or set OBJECTCACHE_BIN"
    [ "$(id -u)" = 0 ] || die "network namespaces need root"
    local t0
    t0=$(date +%s.%N)
    # A previous bed of this name is stopped first, so the script can be rerun.
    cmd_stop >/dev/null 2>&1 || true
    rm -rf "$D"
    mkdir -p "$D/mon" "$D/osd" "$D/run" "$D/log"
    net_up

    local fsid
    fsid=$(cat /proc/sys/kernel/random/uuid)
    write_conf "$fsid"
    ceph-authtool --create-keyring "$D/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    monmaptool --create --addv a "[v2:${ADDR[mon1]}:3300,v1:${ADDR[mon1]}:6789]" --fsid "$fsid" "$D/monmap" >/dev/null
    on mon1 ceph-mon --mkfs -i a --monmap "$D/monmap" --keyring "$D/keyring"
    on mon1 ceph-mon -i a
    wait_for "the monitor" ceph_cmd mon stat
    say "monitor up ($(elapsed "$t0") s)"

    local i uuid id
    for i in 1 2 3; do
        uuid=$(cat /proc/sys/kernel/random/uuid)
        id=$(ceph_cmd osd new "$uuid")
        [ "$id" = $((i - 1)) ] || die "expected osd id $((i - 1)), the monitor gave $id"
        mkdir -p "$D/osd/ceph-$id"
        on "osd$i" ceph-osd -i "$id" --mkfs --osd-uuid "$uuid" 2>"$D/log/osd$i-mkfs.err"
        on "osd$i" ceph-osd -i "$id" 2>>"$D/log/osd$i.err"
    done
    for i in 1 2 3; do wait_for "osd.$((i - 1)) up" osd_is $((i - 1)) up; done
    say "3 OSDs up ($(elapsed "$t0") s)"

    start_rgw 1
    start_rgw 2
    on mon1 timeout 60 radosgw-admin user create --uid=objectcache-bed --display-name=objectcache-bed \
        --access-key="$AK" --secret-key="$SK" >/dev/null
    # The gateways' upstream bucket (SigV4 by curl; RGW wants the payload hash header).
    wait_for "bucket $BUCKET" on client curl -sf -o /dev/null -m 5 -X PUT \
        --aws-sigv4 "aws:amz:us-east-1:s3" --user "$AK:$SK" \
        -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "http://${ADDR[rgw1]}:$RGW_PORT/$BUCKET"
    say "2 RGWs up ($(elapsed "$t0") s)"

    for i in 1 2 3; do start_gw "$i"; done
    say "3 gateways up ($(elapsed "$t0") s)"

    cat > "$D/bed.env" <<ENV
BED_NAME=$NAME
BED_DIR=$D
BED_SCRIPT=$here/bed.sh
OBJECTCACHE_BIN=$BIN
CLIENT_NS=$(ns client)
CLIENT_ADDR=${ADDR[client]}
GATEWAYS_DNS=http://gateways.bed:$GW_PORT
GATEWAY_CAP=$GW_CAP
GATEWAYS=http://${ADDR[gw1]}:$GW_PORT,http://${ADDR[gw2]}:$GW_PORT,http://${ADDR[gw3]}:$GW_PORT
RGWS=http://${ADDR[rgw1]}:$RGW_PORT,http://${ADDR[rgw2]}:$RGW_PORT
GATEWAY_BUCKET=kvcache
UPSTREAM_BUCKET=$BUCKET
ACCESS_KEY=$AK
SECRET_KEY=$SK
ENV
    local start_s
    start_s=$(elapsed "$t0")
    echo "$start_s" > "$D/start_seconds"
    say "ready in $start_s s; memory (RSS): $(rss_total) MiB"
    echo BED_READY
}

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

bed_pids() {
    local f
    for f in "$D"/run/*.pid; do
        [ -f "$f" ] || continue
        kill -0 "$(cat "$f")" 2>/dev/null && echo "$(basename "$f" .pid) $(cat "$f")"
    done
    return 0
}

rss_total() { # MiB of resident memory of every bed daemon
    local total=0 n p rss
    while read -r n p; do
        rss=$(ps -o rss= -p "$p" 2>/dev/null || echo 0)
        total=$((total + ${rss:-0}))
    done < <(bed_pids)
    echo $((total / 1024))
}

cmd_status() {
    local n p
    while read -r n p; do
        printf '%-18s pid %-8s %6s MiB\n' "$n" "$p" "$(( $(ps -o rss= -p "$p" 2>/dev/null || echo 0) / 1024 ))"
    done < <(bed_pids)
    echo "total $(rss_total) MiB"
    ceph_cmd osd stat 2>/dev/null || echo "monitor not reachable"
}

cmd_stop() {
    local n p pids=()
    while read -r n p; do pids+=("$p"); done < <(bed_pids)
    if [ ${#pids[@]} -gt 0 ]; then
        kill "${pids[@]}" 2>/dev/null || true
        for _ in $(seq 1 40); do
            local alive=0
            for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
            [ $alive = 0 ] && break
            sleep 0.25
        done
        kill -9 "${pids[@]}" 2>/dev/null || true
    fi
    net_down
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    gw-stop) [ -n "${2:-}" ] || die "gw-stop N"; stop_gw "$2" "${3:-}" ;;
    gw-start) [ -n "${2:-}" ] || die "gw-start N"; start_gw "$2" ;;
    osd-stop)
        [ -n "${2:-}" ] || die "osd-stop N"
        id=$(( $2 - 1 ))
        f="$D/run/osd.$id.pid"
        pid_alive "$f" && kill -KILL "$(cat "$f")"
        wait_for "osd.$id marked down" osd_is "$id" down
        ;;
    osd-start) [ -n "${2:-}" ] || die "osd-start N"; start_osd "$2" ;;
    heal) heal ;;
    exec) [ -n "${2:-}" ] || die "exec HOST CMD..."; h=$2; shift 2; on "$h" "$@" ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
