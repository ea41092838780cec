# Sourced by start.sh and ../bed/bed.sh: the ceph.conf lines that their throw-away test
# clusters share. Each caller writes its own fsid, monitors, addresses, replication and RGW
# endpoints around them (the order of lines within a section does not matter to Ceph).

# ceph_conf_global DIR MEMSTORE_BYTES: [global] lines for a cluster whose pid files, admin
# sockets, logs and monitor data are under DIR (run/, log/, mon/, osd/) and whose OSDs keep
# their data in memory (memstore), MEMSTORE_BYTES each.
ceph_conf_global() {
    local d=$1 bytes=$2
    cat <<CONF
# Authentication is off inside the cluster (its network is private to the test: loopback,
# or the bed's namespaces); S3 clients still sign every request with SigV4. Without cephx
# there is no session key, so every messenger mode must be crc rather than the default
# secure mode.
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
ms mon service mode = crc
ms mon cluster mode = crc
ms client mode = crc
ms service mode = crc
ms cluster mode = crc
run dir = $d/run
admin socket = $d/run/\$name.asok
pid file = $d/run/\$name.pid
log file = $d/log/\$name.log
mon data = $d/mon/\$cluster-\$id
osd data = $d/osd/\$cluster-\$id
osd objectstore = memstore
memstore device bytes = $bytes
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool delete = true
mon max pg per osd = 1000
# The monitor refuses to start when its data disk has under 5% free (mon data avail crit),
# as on a nearly full CI disk; its data here is a few MiB and the OSDs keep data in memory.
mon data avail crit = 0
mon data avail warn = 0
mon osd full ratio = .99
mon osd nearfull ratio = .98
mon osd backfillfull ratio = .985
osd max object name len = 460
osd max object namespace len = 64
# A placement group serves reads under a lease of osd heartbeat grace x the read lease ratio
# (0.8 x 20 s): an OSD starved of the CPU past it (vLLM replicas computing beside it on a
# machine of 2 cores) held reads "waiting for readable" for minutes, and RGW timed out. A
# test cluster has no peer to fail over to: a grace of 10 minutes only lengthens the lease.
osd heartbeat grace = 600
CONF
}

# ceph_conf_rgw_gc: an RGW section's garbage-collector lines.
ceph_conf_rgw_gc() {
    cat <<'CONF'
# Deleted objects' data is freed by RGW's garbage collector, by default after two hours; in a
# test cluster that keeps everything in memory, free it within seconds instead.
rgw gc obj min wait = 5
rgw gc processor period = 10
rgw gc processor max time = 10
CONF
}
