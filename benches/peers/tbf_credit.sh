#!/usr/bin/env bash
# tbf_credit.sh - how much of a timed loop's speed on the tbf-capped testbed comes from idle
# time before it: the reference C ring (whose pre-timing "barrier" is a chain of six 4-byte
# hops) beside chorus-perf's allreduce (auto) without and with --settle (an idle pause after
# its barrier), sizes 8 B .. 128 KiB, the harness's netns arguments (3 warm-up and 100 timed
# calls per size). Prints per-size medians over the rounds and each entry's speed relative
# to the reference ring.
#
#   benches/peers/tbf_credit.sh [--rounds N] [--settle "MS ..."] [--rate RATE]
#
# The testbed is the peers harness's (../shared/peers/netns_cluster.sh: namespaces allr-h1..4,
# 10.77.0.1-4), built here and removed on exit. Needs root and gcc. Builds chorus-perf
# (release) unless CHORUS_PERF names it. Each round launches the entries in a shuffled order.
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-$ROOT/../shared/peers}
ROUNDS=12
SETTLE="0.3 0.6"
RATE=1gbit
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) ROUNDS=${2:?}; shift 2 ;;
        --settle) SETTLE=${2:?}; shift 2 ;;
        --rate) RATE=${2:?}; shift 2 ;;
        -h | --help) sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "$0"; exit 0 ;;
        *) echo "tbf_credit.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ && $ROUNDS -le 100 ]] || { echo "--rounds: 1..100" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "tbf_credit.sh: needs root (network namespaces)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/tbf-credit.XXXXXX)
gcc -O2 -I"$PEERS_DIR/src" "$PEERS_DIR/src/tcp_ring_allreduce.c" -o "$WORK/ring" -lm
if [[ -z ${CHORUS_PERF:-} ]]; then
    (cd "$ROOT" && cargo build --quiet --release -p chorus-benches --bin chorus-perf)
    CHORUS_PERF=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/chorus-perf
fi
ARGS=(-b 8 -e 128K -f 4 -w 3 -n 100 -m 3 -B 128M)
# netns_cluster.sh tears down any cluster of its namespaces before it builds one: refuse to
# pull one from under another benchmark.
if ip netns list | grep -q '^allr-'; then
    echo "tbf_credit.sh: allr-* namespaces exist (another benchmark's testbed?); take them" \
        "down first: $PEERS_DIR/netns_cluster.sh down" >&2
    exit 1
fi
cd "$PEERS_DIR"
trap './netns_cluster.sh down >/dev/null 2>&1 || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
./netns_cluster.sh up 4 "$RATE" >/dev/null
port=31000
entries=(ring plain)
for s in $SETTLE; do entries+=("settle-$s"); done
for r in $(seq 1 "$ROUNDS"); do
    for e in $(printf '%s\n' "${entries[@]}" | shuf); do
        port=$((port + 10))
        case $e in
            # A failed launch leaves its file without rows (or with wrong ones, left out of
            # the table), not the whole run unprinted.
            ring) RING_HOSTS=10.77.0.1,10.77.0.2,10.77.0.3,10.77.0.4 RING_PORT=$port \
                    ./launch.sh -N allr-h 4 "$WORK/ring" "${ARGS[@]}" >"$WORK/$e.$r.txt" ||
                    echo "tbf_credit.sh: launch $e round $r failed" >&2 ;;
            *) extra=()
               [[ $e == settle-* ]] && extra=(--settle "${e#settle-}")
               MASTER_ADDR=10.77.0.1 MASTER_PORT=$port CHORUS_SOCKET_IFNAME=eth0 \
                    CHORUS_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n') \
                    ./launch.sh -N allr-h 4 "$CHORUS_PERF" allreduce --format peers "${extra[@]}" \
                    "${ARGS[@]}" >"$WORK/$e.$r.txt" ||
                    echo "tbf_credit.sh: launch $e round $r failed" >&2 ;;
        esac
    done
done
python3 - "$WORK" "${entries[@]}" <<'PY'
import glob, re, statistics, sys
work, entries = sys.argv[1], sys.argv[2:]
t = {}
for e in entries:
    for f in glob.glob(f"{work}/{e}.*.txt"):
        for line in open(f):
            m = re.match(r"\s+(\d+)\s+\d+\s+float\s+sum\s+\d+\s+([\d.]+)\s+\S+\s+\S+\s+(\d+)\s*$", line)
            if m and m.group(3) == "0":  # rows with wrong elements are left out
                t.setdefault((e, int(m.group(1))), []).append(float(m.group(2)))
sizes = sorted({s for (_, s) in t})
print("| size | " + " | ".join(f"{e} us (median, min-max)" for e in entries) + " | "
      + " | ".join(f"{e} / ring" for e in entries[1:]) + " |")
print("|---:|" + "---:|" * (2 * len(entries) - 1))
for s in sizes:
    if any((e, s) not in t for e in entries):
        print(f"| {s} | (an entry has no row without wrong elements at this size) |")
        continue
    med = {e: statistics.median(t[(e, s)]) for e in entries}
    cells = [f"{med[e]:.1f} ({min(t[(e, s)]):.1f}-{max(t[(e, s)]):.1f})" for e in entries]
    ratios = [f"{100 * med['ring'] / med[e]:.2f} %" for e in entries[1:]]
    print(f"| {s} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
print(f"\n{len(glob.glob(work + '/*.txt'))} launches, raw rows in {work}")
PY
