#!/usr/bin/env bash
# compress_bench.sh - compressed and top-k allreduce against chorus's dense allreduce on the
# namespace testbed (tests/netns/cluster.sh), one chorus-perf run per method and host count.
#
#   benches/netns/compress_bench.sh [--hosts "4 8"] [--rate 1gbit] [--size 64M] [--iters 3]
#                                   [--methods "int8 ternary sign topk:0.01"] [--reps 1]
#
# chorus-perf runs the compressed call and the dense allreduce on the same data in the same
# job (columns: time, wire bytes per rank, ratio, relative error, dense time, speed-up), so the
# "x of dense" figure of each row is measured side by side. Needs root (ip netns, tc). The
# cluster uses its own namespace prefix (CHORUS_NETNS_PREFIX, default chorusbench<PID>) and is
# removed on exit (a run killed outright is cleaned up by the next); traffic stays inside
# those namespaces (10.78.0.0/24).
set -euo pipefail

HERE=$(dirname "$(readlink -f "$0")")
ROOT=$(cd "$HERE/../.." && pwd)
HOSTS="4 8"
RATE=1gbit
SIZE=64M
ITERS=3
REPS=1
METHODS="int8 ternary sign topk:0.01"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --hosts) HOSTS=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --size) SIZE=$2; shift 2 ;;
        --iters) ITERS=$2; shift 2 ;;
        --reps) REPS=$2; shift 2 ;;
        --methods) METHODS=$2; shift 2 ;;
        -h|--help) sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "$0"; exit 0 ;;
        *) echo "compress_bench.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

# A prefix of this run's own: another run's `up` would replace a cluster of the same prefix.
export CHORUS_NETNS_PREFIX=${CHORUS_NETNS_PREFIX:-chorusbench$$}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
if [[ -z ${CHORUS_PERF:-} || -z ${CHORUS_RUN:-} ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p chorus-benches -p chorus --bins)
fi
PERF=${CHORUS_PERF:-$TARGET/release/chorus-perf}
RUN=${CHORUS_RUN:-$TARGET/release/chorus-run}
CLUSTER="$ROOT/tests/netns/cluster.sh"
# Clusters of earlier runs whose process is gone (killed before their EXIT trap ran).
for mark in /run/chorus-netns/chorusbench*; do
    [[ -f $mark ]] || continue
    pid=${mark##*/chorusbench}
    [[ $pid =~ ^[0-9]+$ && ! -d /proc/$pid ]] || continue
    CHORUS_NETNS_PREFIX=chorusbench$pid "$CLUSTER" down >/dev/null 2>&1 || true
done
trap '"$CLUSTER" down >/dev/null 2>&1 || true' EXIT
# Ctrl-C ends the run (and the EXIT trap takes the cluster down) rather than the one method.
trap 'exit 130' INT
trap 'exit 143' TERM

echo "# compress_bench: $(date -u +%FT%TZ), rate $RATE, size $SIZE, iters $ITERS, reps $REPS"
for hosts in $HOSTS; do
    "$CLUSTER" up "$hosts" "$RATE" >/dev/null
    for ((rep = 1; rep <= REPS; rep++)); do
        for m in $METHODS; do
            echo "## hosts $hosts rep $rep method $m"
            timeout --foreground -k 10 600 "$RUN" -n "$hosts" --netns-prefix "$CHORUS_NETNS_PREFIX-h" --timeout 580 \
                --no-prefix -- "$PERF" allreduce --compress "$m" -b "$SIZE" -e "$SIZE" \
                -n "$ITERS" -w 1 || echo "(run failed)"
        done
    done
    "$CLUSTER" down >/dev/null
done
