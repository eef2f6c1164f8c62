#!/usr/bin/env bash
# wire_bytes.sh - bytes that each peer's allreduce puts on the links of the 4-host testbed, per
# call, as the tbf shapers count them.
#
#   wire_bytes.sh [--workdir DIR] [--sizes "8K 32K 128K 512K"] [--calls N1,N2] [--rate 1gbit]
#                 [--peers "ref-tcp-ring ompi-tcp ompi-tcp-ring chorus-halving_doubling ..."]
#
# Why: on a link shaped by tbf a transfer that keeps the link busy takes the bytes tbf charges
# (payload, frame, every packet's Ethernet/IP/TCP headers and the ACKs) divided by the rate, so
# at sizes where every schedule moves the minimum payload the per-call time follows those
# bytes. Counters do not drift with the host's speed, so this shows a difference of 0.1 % that
# timed runs on a shared 2-core host cannot resolve.
#
# How: the peers harness (shared/peers) is copied to DIR (default: a fresh /tmp directory), its
# reference C ring and Open MPI benchmark are built there (the Open MPI peers are skipped when
# mpicc is missing: run_all.sh installs it), the cluster comes up with netns_cluster.sh, and
# for every size and peer two launches run N1 and N2 timed calls (5 warm-up calls each). The
# tbf counters (bytes, packets) of each host's eth0 (what it sends) and of its switch port (what
# it receives) are read around each launch; (second - first) / (N2 - N1) is per call, without
# the start-up, warm-up and check traffic. The table gives the median over the 4 hosts, the
# time per call that the rate implies, and the time chorus-perf or the peer measured in its
# N2-call launch. The cluster is taken down on exit. Needs root (namespaces).
#
# Peers: ref-tcp-ring, ompi-tcp, ompi-tcp-ring, chorus-<schedule> (ring, tree,
# halving_doubling, recursive_doubling) and chorus (auto). Environment: PEERS_DIR,
# CHORUS_PERF (default: the workspace's target/release/chorus-perf, built when missing).
set -euo pipefail

HERE=$(dirname "$(readlink -f "$0")")
ROOT=$(cd "$HERE/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-$(cd "$ROOT/.." && pwd)/shared/peers}
WORK=""
SIZES="8K 32K 128K 512K"
CALLS="200,1200"
RATE=1gbit
PEERS="ref-tcp-ring ompi-tcp ompi-tcp-ring chorus-ring chorus-halving_doubling"
PORT=${PORT:-30500}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --workdir) WORK=${2:?}; shift 2 ;;
        --sizes) SIZES=${2:?}; shift 2 ;;
        --calls) CALLS=${2:?}; shift 2 ;;
        --rate) RATE=${2:?}; shift 2 ;;
        --peers) PEERS=${2:?}; shift 2 ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "wire_bytes.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
N1=${CALLS%,*}
N2=${CALLS#*,}
[[ $N1 =~ ^[0-9]+$ && $N2 =~ ^[0-9]+$ && $N2 -gt $N1 ]] || {
    echo "wire_bytes.sh: --calls N1,N2 needs N2 > N1" >&2
    exit 2
}
[[ $RATE =~ ^[0-9.]+(kbit|mbit|gbit)$ ]] || {
    echo "wire_bytes.sh: --rate $RATE: expected a number and kbit, mbit or gbit" >&2
    exit 2
}
[[ $(id -u) == 0 ]] || { echo "wire_bytes.sh: needs root (network namespaces)" >&2; exit 1; }
# netns_cluster.sh tears down any cluster of its namespaces before it builds one: refuse to
# pull one from under another benchmark.
if ip netns list | grep -q '^allr-'; then
    echo "wire_bytes.sh: allr-* namespaces exist (another benchmark's testbed?); take them" \
        "down first: $PEERS_DIR/netns_cluster.sh down" >&2
    exit 1
fi
[[ -f $PEERS_DIR/netns_cluster.sh ]] || { echo "no peers harness at $PEERS_DIR" >&2; exit 1; }

PERF=${CHORUS_PERF:-$ROOT/target/release/chorus-perf}
if [[ ! -x $PERF ]]; then
    (cd "$ROOT" && cargo build --release -p chorus-benches --bin chorus-perf >&2)
fi
PERF=$(readlink -f "$PERF")

[[ -n $WORK ]] || WORK=$(mktemp -d /tmp/wire-bytes.XXXXXX)
mkdir -p "$WORK/build"
WORK=$(readlink -f "$WORK")
rm -rf "$WORK/raw" && mkdir "$WORK/raw"     # rows of an earlier run must not mix in
(cd "$PEERS_DIR" && find . -mindepth 1 -maxdepth 1 ! -name results ! -name build -print0 |
    xargs -0 cp -r --no-preserve=mode -t "$WORK")
chmod +x "$WORK"/*.sh
cd "$WORK"
gcc -O3 -march=native -Wall src/tcp_ring_allreduce.c -o build/tcp_ring_allreduce
HAVE_MPI=0
if command -v mpicc >/dev/null; then
    mpicc -O2 -Wall src/mpi_allreduce_bench.c -o build/mpi_allreduce_bench && HAVE_MPI=1
fi
for i in 1 2 3 4; do echo "10.77.0.$i slots=1"; done >hostfile

trap './netns_cluster.sh down >/dev/null 2>&1 || true' EXIT
./netns_cluster.sh up 4 "$RATE" >/dev/null

# One line per host: egress bytes packets, ingress bytes packets (tbf's own counters).
counters() {
    local h
    for h in 1 2 3 4; do
        {
            ip netns exec "allr-h$h" tc -s -j qdisc show dev eth0
            ip netns exec allr-sw tc -s -j qdisc show dev "allr-p$h"
        } | python3 -c 'import json,sys
d=json.JSONDecoder(); s=sys.stdin.read().strip(); out=[]
while s:
    q, i = d.raw_decode(s); s = s[i:].strip(); out += [q[0]["bytes"], q[0]["packets"]]
print(*out)'
    done
}

launch() { # PEER SIZE CALLS -> rank 0's table on stdout
    local peer=$1 size=$2 n=$3 args
    args=(-b "$size" -e "$size" -w 5 -n "$n" -m 1)
    PORT=$((PORT + 3))
    case $peer in
        ref-tcp-ring)
            RING_HOSTS=10.77.0.1,10.77.0.2,10.77.0.3,10.77.0.4 RING_PORT=$PORT \
                ./launch.sh -N allr-h 4 build/tcp_ring_allreduce "${args[@]}" ;;
        ompi-tcp|ompi-tcp-ring)
            local extra=()
            [[ $peer == ompi-tcp-ring ]] &&
                extra=(--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4)
            ip netns exec allr-h1 timeout --foreground -k 10 600 mpirun --allow-run-as-root --hostfile hostfile -np 4 \
                --map-by node --bind-to none --mca plm_rsh_agent "$WORK/netns_rsh.sh" \
                --mca mpi_yield_when_idle 1 --mca pml ob1 --mca btl self,tcp \
                --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 "${extra[@]}" \
                "$WORK/build/mpi_allreduce_bench" "${args[@]}" ;;
        chorus|chorus-*)
            local algo=()
            [[ $peer == chorus-* ]] && algo=(--algo "${peer#chorus-}")
            MASTER_ADDR=10.77.0.1 MASTER_PORT=$PORT CHORUS_SOCKET_IFNAME=eth0 \
                CHORUS_TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n') \
                ./launch.sh -N allr-h 4 "$PERF" allreduce --format peers "${algo[@]}" "${args[@]}" ;;
        *) echo "wire_bytes.sh: unknown peer $peer" >&2; return 2 ;;
    esac
}

for size in $SIZES; do
    for peer in $PEERS; do
        [[ $peer == ompi-* && $HAVE_MPI == 0 ]] && continue
        f="raw/$peer-$size"
        counters >"$f.c0"
        launch "$peer" "$size" "$N1" >"$f.out1"
        counters >"$f.c1"
        launch "$peer" "$size" "$N2" >"$f.out2"
        counters >"$f.c2"
        echo "$peer $size done" >&2
    done
done
python3 "$HERE/wire_table.py" --rate "$RATE" --calls "$N1,$N2" raw | tee wire_bytes.md
echo "wire_bytes.sh: $WORK/wire_bytes.md" >&2
