#!/usr/bin/env bash
# gap_side_by_side.sh - allreduce after idle time on the 4-host testbed, chorus beside Open MPI
# and Gloo in one run: every timed call comes after a sleep of GAP ms and a barrier, as a
# training step's compute separates its collectives (chorus-perf --gap, mpi_gap_bench.c,
# gloo_gap_bench.py; the same sizes, iterations and checks).
#
#   gap_side_by_side.sh [--rounds N] [--gap MS] [--rate RATE] [--out FILE] [--no-install]
#   benches/peers/gap_table.py FILE          # the table: medians over rounds, chorus / best peer
#
# Entries: chorus (auto), chorus-noqa (auto, CHORUS_TCP_QUICKACK=0), chorus-hd and
# chorus-hd-noqa (halving-doubling forced), ompi-tcp (Open MPI's default), ompi-tcp-ring
# (its forced ring), torch-gloo. Each round launches them in its own shuffled order. Sizes
# 8 B .. 2 MiB by 4, 3 warm-up and 20 timed calls per size.
#
# The testbed is the peers harness's (../shared/peers/netns_cluster.sh: namespaces allr-h1..4,
# 10.77.0.1-4 on tbf-capped links), built here and removed on exit. Needs root; installs
# Open MPI and Debian's PyTorch unless --no-install. Builds chorus-perf and chorus-run
# (release) unless CHORUS_PERF and CHORUS_RUN name them.
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-$ROOT/../shared/peers}
ROUNDS=5
GAP=30
RATE=1gbit
OUT=
INSTALL=1
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) ROUNDS=${2:?}; shift 2 ;;
        --gap) GAP=${2:?}; shift 2 ;;
        --rate) RATE=${2:?}; shift 2 ;;
        --out) OUT=${2:?}; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        -h | --help) sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "$0"; exit 0 ;;
        *) echo "gap_side_by_side.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ && $ROUNDS -le 100 ]] || { echo "--rounds: 1..100" >&2; exit 2; }
[[ $GAP =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "--gap: milliseconds" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "gap_side_by_side.sh: needs root (network namespaces)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/gap-side.XXXXXX)
OUT=${OUT:-$WORK/gap.raw}
PY=/usr/bin/python3

if [[ $INSTALL == 1 ]]; then
    need=()
    command -v mpicc >/dev/null || need+=(openmpi-bin libopenmpi-dev)
    "$PY" -c 'import torch' 2>/dev/null || need+=(python3-torch)
    if [[ ${#need[@]} -gt 0 ]]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    fi
fi
mpicc -O2 -o "$WORK/mpi_gap_bench" "$HERE/src/mpi_gap_bench.c"
if [[ -z ${CHORUS_PERF:-} || -z ${CHORUS_RUN:-} ]]; then
    (cd "$ROOT" && cargo build --quiet --release -p chorus-benches --bin chorus-perf -p chorus --bin chorus-run)
    target=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps |
        "$PY" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
fi
PERF=${CHORUS_PERF:-$target/release/chorus-perf}
RUN=${CHORUS_RUN:-$target/release/chorus-run}

# netns_cluster.sh tears down any cluster of its namespaces before it builds one: refuse to
# pull one from under another benchmark.
if ip netns list | grep -q '^allr-'; then
    echo "gap_side_by_side.sh: allr-* namespaces exist (another benchmark's testbed?); take them" \
        "down first: $PEERS_DIR/netns_cluster.sh down" >&2
    exit 1
fi
cluster() { "$PEERS_DIR/netns_cluster.sh" "$@"; }
trap 'cluster down >/dev/null 2>&1 || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
cluster up 4 "$RATE" >/dev/null
for i in 1 2 3 4; do echo "10.77.0.$i slots=1"; done >"$WORK/hostfile"

ARGS=(-b 8 -e 2M -f 4 -w 3 -n 20 --gap "$GAP")
ompi() { # extra mpirun args
    ip netns exec allr-h1 timeout --foreground -k 10 600 mpirun --allow-run-as-root --hostfile "$WORK/hostfile" -np 4 \
        --map-by node --bind-to none --mca plm_rsh_agent "$PEERS_DIR/netns_rsh.sh" \
        --mca mpi_yield_when_idle 1 --mca pml ob1 --mca btl self,tcp \
        --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
        "$@" "$WORK/mpi_gap_bench" "${ARGS[@]}"
}
chorus() { # extra chorus-perf args, after --env settings
    local port=$((30000 + RANDOM % 2000)) env=()
    while [[ $# -gt 0 && $1 == *=* ]]; do env+=(--env "$1"); shift; done
    "$RUN" --no-prefix --timeout 600 "${env[@]}" --netns-prefix allr-h --addr "10.77.0.1:$port" -n 4 -- \
        "$PERF" allreduce --format peers "$@" "${ARGS[@]}"
}
gloo() {
    local port=$((30000 + RANDOM % 2000)) pids=() rc=0
    # Ctrl-C: the background ranks (in timeout's own process groups, which the terminal's
    # signal does not reach) go with this entry (a pipeline's subshell: its own trap).
    trap 'kill -- "${pids[@]}" 2>/dev/null; exit 130' INT
    trap 'kill -- "${pids[@]}" 2>/dev/null; exit 143' TERM
    for r in 0 1 2 3; do
        RANK=$r WORLD_SIZE=4 MASTER_ADDR=10.77.0.1 MASTER_PORT=$port GLOO_SOCKET_IFNAME=eth0 \
            timeout -k 10 600 ip netns exec "allr-h$((r + 1))" "$PY" "$HERE/gloo_gap_bench.py" "${ARGS[@]}" \
            >"$WORK/gloo$r.out" 2>"$WORK/gloo$r.err" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    cat "$WORK/gloo0.out"
    return $rc
}
run_entry() {
    case $1 in
        chorus) chorus ;;
        chorus-noqa) chorus CHORUS_TCP_QUICKACK=0 ;;
        chorus-hd) chorus --algo halving_doubling ;;
        chorus-hd-noqa) chorus CHORUS_TCP_QUICKACK=0 --algo halving_doubling ;;
        ompi-tcp) ompi ;;
        ompi-tcp-ring) ompi --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4 ;;
        torch-gloo) gloo ;;
    esac
}

entries=(chorus chorus-noqa chorus-hd chorus-hd-noqa ompi-tcp ompi-tcp-ring torch-gloo)
: >"$OUT"
echo "# gap_side_by_side: gap ${GAP} ms, rate $RATE, $ROUNDS rounds, $(uname -r), $(date -u +%FT%TZ)" >>"$OUT"
for ((r = 1; r <= ROUNDS; r++)); do
    for e in $(printf '%s\n' "${entries[@]}" | shuf --random-source=<(yes "$r")); do
        # entry round size time_us #wrong, from the peers-format rows
        if ! run_entry "$e" 2>"$WORK/$e.err" |
            awk -v e="$e" -v r="$r" '$1 ~ /^[0-9]+$/ && $3 == "float" { print e, r, $1, $6, $9 }' >>"$OUT"; then
            echo "gap_side_by_side.sh: $e failed in round $r:" >&2
            tail -5 "$WORK/$e.err" >&2
        fi
    done
    echo "round $r of $ROUNDS done" >&2
done
echo "$OUT"
