#!/usr/bin/env bash
# Starts a throw-away single-node Ceph cluster with an S3 gateway on 127.0.0.1, for tests:
# one monitor, one OSD keeping its data in memory (memstore), one radosgw, no manager.
# Installs nothing: it needs Debian's `radosgw ceph-mon ceph-osd` packages and curl.
#
# Settings (environment):
#   CEPH_DIR        state, logs and pid files (default /tmp/objectcache-ceph); wiped at start
#   RGW_PORT        S3 port on 127.0.0.1 (default 7480)
#   RGW_AK, RGW_SK  access key and secret key of the test user
#                   (default cephtestak / cephtestsecretkey0123456789)
#   MON_PORT        monitor's msgr2 port (default 3300); MON_V1_PORT its legacy port (6789)
#   MEMSTORE_BYTES  capacity of the in-memory OSD in bytes (default 4 GiB; used only as filled)
#   START_TIMEOUT   seconds to wait for each daemon (default 90)
# Prints RGW_READY on success (daemons keep running; stop.sh ends them) and exits non-zero,
# with the relevant log tail, on failure.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
source "$here/ceph-conf.sh"
D=${CEPH_DIR:-/tmp/objectcache-ceph}
PORT=${RGW_PORT:-7480}
AK=${RGW_AK:-cephtestak}
SK=${RGW_SK:-cephtestsecretkey0123456789}
MON_PORT=${MON_PORT:-3300}
MON_V1_PORT=${MON_V1_PORT:-6789}
BYTES=${MEMSTORE_BYTES:-4294967296}
WAIT=${START_TIMEOUT:-90}

die() { echo "ceph-rgw/start.sh: $*" >&2; exit 1; }
for tool in ceph ceph-mon ceph-osd ceph-authtool monmaptool radosgw radosgw-admin curl; do
    command -v "$tool" >/dev/null || die "$tool not found; install: apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd curl"
done

# A previous cluster in the same directory is stopped first, so the script can be rerun.
[ -d "$D/run" ] && CEPH_DIR="$D" "$here/stop.sh" >/dev/null 2>&1 || true
if curl -s -o /dev/null -m 2 "http://127.0.0.1:$PORT/"; then
    die "port $PORT on 127.0.0.1 is already in use by another server; set RGW_PORT"
fi

rm -rf "$D"
mkdir -p "$D/mon" "$D/osd" "$D/run" "$D/log"
fsid=$(cat /proc/sys/kernel/random/uuid)
mon_addr="[v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$MON_V1_PORT]"

{
    cat <<CONF
[global]
fsid = $fsid
mon host = $mon_addr
public addr = 127.0.0.1
keyring = $D/keyring
# One OSD: one replica, and no warning for it.
osd pool default size = 1
osd pool default min size = 1
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
CONF
    ceph_conf_global "$D" "$BYTES"
    cat <<CONF

[client.rgw.gw]
rgw frontends = beast endpoint=127.0.0.1:$PORT
rgw dns name = localhost
CONF
    ceph_conf_rgw_gc
} > "$D/ceph.conf"
export CEPH_CONF="$D/ceph.conf"

tail_logs() { for f in "$D"/log/*; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }; done; }
wait_for() { # wait_for WHAT COMMAND...: retries COMMAND every half second for $WAIT seconds
    local what=$1; shift
    local tries=$((WAIT * 2))
    for _ in $(seq 1 "$tries"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
    tail_logs; die "timed out after ${WAIT}s waiting for $what"
}

ceph-authtool --create-keyring "$D/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
monmaptool --create --addv a "$mon_addr" --fsid "$fsid" "$D/monmap" >/dev/null
ceph-mon --mkfs -i a --monmap "$D/monmap" --keyring "$D/keyring"
ceph-mon -i a
wait_for "the monitor" timeout 10 ceph --connect-timeout 5 mon stat

osd_uuid=$(cat /proc/sys/kernel/random/uuid)
osd_id=$(timeout 30 ceph --connect-timeout 10 osd new "$osd_uuid")
mkdir -p "$D/osd/ceph-$osd_id"
ceph-osd -i "$osd_id" --mkfs --osd-uuid "$osd_uuid" 2>"$D/log/osd-mkfs.err"
ceph-osd -i "$osd_id"
osd_up() { timeout 10 ceph --connect-timeout 5 osd stat | grep -q '1 up'; }
wait_for "the OSD" osd_up

radosgw -n client.rgw.gw
wait_for "radosgw on port $PORT" curl -s -o /dev/null -m 1 "http://127.0.0.1:$PORT/"
timeout 60 radosgw-admin user create --uid=objectcache-test --display-name=objectcache-test \
    --access-key="$AK" --secret-key="$SK" >/dev/null
echo "S3 endpoint http://127.0.0.1:$PORT (access key $AK), state in $D"
echo RGW_READY
