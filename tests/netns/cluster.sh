#!/usr/bin/env bash
# cluster.sh - the chorus multi-host testbed: N emulated hosts as network namespaces.
#
#   cluster.sh up N RATE   build hosts PFX-h1..PFX-hN on one switch, links capped at RATE
#   cluster.sh down        remove the namespaces `up` made for this prefix (and every link)
#   cluster.sh status      list those namespaces, their addresses and shapers
#
# PFX is $CHORUS_NETNS_PREFIX, default "chorus" (namespaces chorus-sw, chorus-h1, ...).
# The integration test tests/netns.rs uses a prefix of its own per run, so runs never collide.
# RATE is a tc rate such as 100mbit, 1gbit or 2.5gbit, or "none" for unshaped links.
# Needs root (ip netns, tc). `up` replaces a cluster it made for the same prefix, and refuses
# when a namespace of that name exists that it did not make; `down` removes only what `up`
# made (listed in /run/chorus-netns/PFX) and is a no-op when there is none; both can be
# repeated.
#
# Layout: namespace PFX-sw holds a Linux bridge `br0`, the switch. Host i is namespace PFX-hi
# with one interface `eth0` = 10.78.0.i/24, a veth whose other end `port<i>` is a bridge
# port. Both ends are created directly inside their namespaces: the root namespace gets no
# interface, address or route, so traffic stays inside the emulated cluster.
#
# Links: a tbf shaper on each host's eth0 (what it sends) and on its switch port (what it
# receives), so every host sends and receives at most RATE, like a NIC on a non-blocking
# switch. The bucket holds max(128 KiB, 1 ms at RATE): a tbf bucket smaller than a 64 KiB
# GSO packet makes tbf split every packet and costs about half the throughput of a 4-host
# ring. tbf counts Ethernet + IP + TCP headers, so TCP payload tops out near
# RATE x 1448/1514 (119.6 MB/s at 1gbit).
set -euo pipefail

PFX=${CHORUS_NETNS_PREFIX:-chorus}
SUBNET=10.78.0        # the /24 of the hosts; .i is host i
MIN_BURST=131072      # bytes; see above
QUEUE_LATENCY=20ms    # how long a packet may wait in tbf's queue before it is dropped
MAX_HOSTS=250
MARK_DIR=/run/chorus-netns  # MARK_DIR/PFX lists the namespaces `up` made for PFX

die() {
    echo "cluster.sh: $*" >&2
    exit 1
}

usage() {
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# Namespace names become files under /run/netns; keep the prefix to a safe alphabet.
[[ $PFX =~ ^[A-Za-z0-9_.-]{1,40}$ ]] || die "CHORUS_NETNS_PREFIX=\"$PFX\": use 1-40 characters of A-Z a-z 0-9 _ . -"

# rate in tc's syntax -> bytes per second (for the bucket size)
rate_bytes_per_s() {
    local rate=$1 num unit
    [[ $rate =~ ^([0-9]+(\.[0-9]+)?)(kbit|mbit|gbit)$ ]] ||
        die "RATE \"$rate\": expected a number with kbit, mbit or gbit (e.g. 1gbit), or none"
    num=${BASH_REMATCH[1]}
    unit=${BASH_REMATCH[3]}
    case $unit in
        kbit) awk -v n="$num" 'BEGIN { printf "%d", n * 1e3 / 8 }' ;;
        mbit) awk -v n="$num" 'BEGIN { printf "%d", n * 1e6 / 8 }' ;;
        gbit) awk -v n="$num" 'BEGIN { printf "%d", n * 1e9 / 8 }' ;;
    esac
}

# limit NS DEV RATE: cap what DEV in namespace NS transmits
limit() {
    local ns=$1 dev=$2 rate=$3 bps burst
    bps=$(rate_bytes_per_s "$rate")
    burst=$((bps / 1000))
    ((burst >= MIN_BURST)) || burst=$MIN_BURST
    ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf \
        rate "$rate" burst "$burst" latency "$QUEUE_LATENCY"
}

# the namespaces `up` made for this prefix that still exist, hosts first (deleting a host also
# removes its switch port)
namespaces() {
    local all
    [[ -f $MARK_DIR/$PFX ]] || return 0
    all=$(ip netns list 2>/dev/null | awk '{ print $1 }')
    grep -Fx -f "$MARK_DIR/$PFX" <<<"$all" | grep -v -- '-sw$' | sort -V || true
    grep -Fx -f "$MARK_DIR/$PFX" <<<"$all" | grep -- '-sw$' || true
}

# namespaces of this prefix's names that `up` did not make (someone else's; one `up` made
# that `down` could not remove is not)
strangers() {
    local all re=${PFX//./\\.} ours=/dev/null
    [[ -f $MARK_DIR/$PFX ]] && ours=$MARK_DIR/$PFX
    all=$(ip netns list 2>/dev/null | awk '{ print $1 }')
    grep -E "^$re-(h[0-9]+|sw)$" <<<"$all" | grep -Fxv -f "$ours" || true
}

new_namespace() {
    # Marked first: interrupted between the two, `down` still finds it (a name marked but
    # never made is skipped: only existing namespaces are listed).
    echo "$1" >>"$MARK_DIR/$PFX"
    ip netns add "$1"
    ip -n "$1" link set lo up
}

cmd_down() {
    local ns pids failed=0
    for ns in $(namespaces); do
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
        if [[ -n ${pids// /} ]]; then
            echo "cluster.sh: warning: processes $pids still run in $ns; it lives on until they exit" >&2
        fi
        # One that cannot be removed must not stop the removal of the others (set -e); its
        # mark stays, so that a later `down` tries again.
        ip netns del "$ns" || { echo "cluster.sh: warning: could not remove $ns" >&2; failed=1; }
    done
    ((failed)) || rm -f "$MARK_DIR/$PFX"
    return "$failed"
}

cmd_up() {
    (($# == 2)) || usage
    local n=$1 rate=$2 i host port
    [[ $n =~ ^[0-9]+$ ]] || die "N \"$n\": expected 1..$MAX_HOSTS"
    n=$((10#$n)) # 010 is ten hosts, not octal eight
    ((n >= 1 && n <= MAX_HOSTS)) || die "N \"$n\": expected 1..$MAX_HOSTS"
    [[ $rate == none ]] || rate_bytes_per_s "$rate" >/dev/null
    command -v ip >/dev/null || die "ip (iproute2) not found"
    command -v bridge >/dev/null || die "bridge (iproute2) not found"
    [[ $rate == none ]] || command -v tc >/dev/null || die "tc (iproute2) not found"

    cmd_down || die "namespaces an earlier up made for $PFX could not be removed (listed in $MARK_DIR/$PFX); remove them, or choose another CHORUS_NETNS_PREFIX"
    local others
    others=$(strangers | tr '\n' ' ')
    [[ -z ${others// /} ]] || die "namespaces $others exist and were not made by cluster.sh up for prefix $PFX; remove them, or choose another CHORUS_NETNS_PREFIX"
    mkdir -p "$MARK_DIR"
    # From here on, a failing step (set -e) removes what was built before exiting.
    building=1
    trap 'if ((building)); then echo "cluster.sh: up failed; removing the partial cluster" >&2; cmd_down; fi' EXIT

    new_namespace "$PFX-sw"
    ip -n "$PFX-sw" link add br0 type bridge stp_state 0 forward_delay 0
    ip -n "$PFX-sw" link set br0 up
    for i in $(seq 1 "$n"); do
        host=$PFX-h$i
        port=port$i
        new_namespace "$host"
        ip -n "$PFX-sw" link add "$port" type veth peer name eth0 netns "$host"
        ip -n "$PFX-sw" link set "$port" master br0
        ip -n "$PFX-sw" link set "$port" up
        ip -n "$host" addr add "$SUBNET.$i/24" dev eth0
        ip -n "$host" link set eth0 up
        if [[ $rate != none ]]; then
            limit "$host" eth0 "$rate"
            limit "$PFX-sw" "$port" "$rate"
        fi
    done

    # Ready when every switch port forwards and every eth0 has its carrier (at most ~5 s).
    local ready=0
    for _ in $(seq 1 50); do
        if (($(bridge -n "$PFX-sw" link show | grep -c 'state forwarding' || true) == n)); then
            ready=1
            for i in $(seq 1 "$n"); do
                ip -n "$PFX-h$i" link show eth0 | grep -q 'state UP' || ready=0
            done
            ((ready)) && break
        fi
        sleep 0.1
    done
    ((ready)) || die "the switch ports or host links did not come up within 5 s"
    building=0
    echo "cluster up: $n hosts $PFX-h1..$PFX-h$n, eth0 = $SUBNET.1..$SUBNET.$n/24, links $rate"
}

cmd_status() {
    local ns found=0
    for ns in $(namespaces); do
        found=1
        echo "== $ns"
        ip -n "$ns" -br addr show | grep -v '^lo ' || true
        ip netns exec "$ns" tc qdisc show | grep tbf || true
    done
    ((found)) || echo "no namespaces with prefix $PFX"
}

# up and down take turns, whatever their prefix, on this machine: two ups of one prefix (or an
# up and a down) interleaved would remove each other's namespaces. A lock of the host's, held
# until this script exits.
take_turn() {
    mkdir -p "$MARK_DIR"
    exec 9>"$MARK_DIR/.lock"
    flock -w 100 9 || die "another cluster.sh up or down has held $MARK_DIR/.lock for 100 s"
}

case ${1:-} in
    up) shift; take_turn; cmd_up "$@" ;;
    down) (($# == 1)) || usage; take_turn; cmd_down ;;
    status) (($# == 1)) || usage; cmd_status ;;
    *) usage ;;
esac
