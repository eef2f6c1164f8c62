#!/usr/bin/env bash
# run_with_chorus.sh - run the peers harness (shared/peers/run_all.sh) with chorus as one more peer.
#
#   run_with_chorus.sh [--workdir DIR] [--no-build] [--prepare-only] [--algorithms]
#                      [--null] [--tune-file] [--fixed-order] [--np LIST] [--hosts N]
#                      [--loop-args ARGS] [--netns-args ARGS] [run_all.sh args...]
#   e.g. run_with_chorus.sh --quick --only loopback
#   the allreduce table of issue #4 (every schedule, auto and the peers, p=4, 8 B .. 64 MiB):
#     run_with_chorus.sh --workdir W --algorithms --np 4 --only loopback,netns --reps 3 \
#         --loop-args "-b 8 -e 64M -f 4 -w 2 -n 20 -m 3 -B 256M" \
#         --netns-args "-b 8 -e 64M -f 4 -w 2 -n 20 -m 3 -B 256M"
#     benches/peers/allreduce_table.py W/results/full/raw
#
# The harness directory is read-only, so it is copied (without its results/) to DIR (default:
# a fresh /tmp/peers-chorus.XXXXXX) and the copy's run_all.sh gets two more peers:
#   loopback: "chorus=chorus_lo $np"  launch.sh NP chorus-perf allreduce --format peers LOOP_ARGS
#             (MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT; chorus listens on MASTER_PORT+1)
#   netns:    "chorus=chorus_netns"   launch.sh -N allr-h 4 ... NETNS_ARGS
#             (MASTER_ADDR=10.77.0.1, CHORUS_SOCKET_IFNAME=eth0)
# --algorithms adds one chorus peer per allreduce schedule (chorus-tcp-ring, ... on loopback,
# chorus-ring, ... on the testbed; chorus-tcp and chorus, with no schedule forced, are `auto`)
# and Open MPI's forced ring on loopback (ompi-tcp-ring, as the netns section has).  --null
# adds a second `auto` peer (chorus-tcp-again, chorus-again): launches of the same thing, whose
# spread against the first shows how far launch-to-launch noise moves the columns.  --tune-file
# adds an `auto` peer that keeps its tuning decisions in a file across launches
# (CHORUS_TUNE_FILE; chorus-tcp-cached, chorus-cached): the first time a file is used, one
# unrecorded launch writes it, so every recorded launch starts with the decisions of earlier
# ones, as a job relaunched with a tuning file does.  --np
# replaces the loopback rank counts (default "2 4"); --hosts N the testbed's host count (one rank
# per host; default 4, as the harness; its scenario is then netnsN-RATE); --loop-args / --netns-args replace the
# benchmark arguments of every peer of that section.  Each round launches the peers in its own
# order, drawn from the round's number (run_all.sh launches them in one fixed order, so a peer
# follows the same neighbour in every round: the two identical `auto` peers of the testbed read
# 136 and 118 us at 8 KiB, pooled over 26 launches each); --fixed-order keeps run_all.sh's order.
# Every launch gets a fresh CHORUS_TOKEN.  chorus-perf is built first
# (cargo build --release -p chorus-benches; a no-op when up to date) unless --no-build or
# CHORUS_PERF=/path/to/chorus-perf is given.  Everything after the wrapper's own options goes
# to run_all.sh (--quick, --reps N, --only LIST, --rate R, --no-install); like run_all.sh it
# needs root for the netns section.  Prints where summary.md is at the end.
#
# Environment: PEERS_DIR (default: <workspace>/../shared/peers), CHORUS_PERF, CARGO_TARGET_DIR.
set -euo pipefail

HERE=$(dirname "$(readlink -f "$0")")
ROOT=$(cd "$HERE/../.." && pwd)            # the cargo workspace
PEERS_DIR=${PEERS_DIR:-$(cd "$ROOT/.." && pwd)/shared/peers}

WORK=""
BUILD=1
PREPARE_ONLY=0
ALGORITHMS=0
NULL=0
TUNE_FILE=0
SHUFFLE=1
NPS=""
HOSTS=""
LOOP_OVERRIDE=""
NETNS_OVERRIDE=""
SCHEDULES=(ring tree halving_doubling recursive_doubling)
PASS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --workdir) WORK=${2:?--workdir needs a directory}; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --prepare-only) PREPARE_ONLY=1; shift ;;
        --algorithms) ALGORITHMS=1; shift ;;
        --null) NULL=1; shift ;;
        --tune-file) TUNE_FILE=1; shift ;;
        --fixed-order) SHUFFLE=0; shift ;;
        --np) NPS=${2:?--np needs a list such as "4"}; shift 2 ;;
        --hosts) HOSTS=${2:?--hosts needs a host count such as 3}; shift 2 ;;
        --loop-args) LOOP_OVERRIDE=${2:?--loop-args needs arguments}; shift 2 ;;
        --netns-args) NETNS_OVERRIDE=${2:?--netns-args needs arguments}; shift 2 ;;
        -h|--help) sed -n '2,41p' "$0"; exit 0 ;;
        *) PASS+=("$1"); shift ;;
    esac
done

die() { echo "run_with_chorus.sh: $*" >&2; exit 1; }
[[ -f $PEERS_DIR/run_all.sh ]] || die "no peers harness at $PEERS_DIR (set PEERS_DIR)"

# ---------------------------------------------------------------- chorus-perf
if [[ -n ${CHORUS_PERF:-} ]]; then
    PERF=$(readlink -f "$CHORUS_PERF")
else
    if [[ $BUILD == 1 ]]; then
        echo "building chorus-perf (release)" >&2
        (cd "$ROOT" && cargo build --release -p chorus-benches >&2)
    fi
    TARGET=${CARGO_TARGET_DIR:-$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')}
    PERF=$(readlink -f "$TARGET/release/chorus-perf")
fi
[[ -x $PERF ]] || die "chorus-perf not found at $PERF (build it or set CHORUS_PERF)"

# ---------------------------------------------------------------- copy and patch
if [[ -z $WORK ]]; then
    WORK=$(mktemp -d /tmp/peers-chorus.XXXXXX)
fi
mkdir -p "$WORK"
WORK=$(readlink -f "$WORK")
[[ $WORK != "$(readlink -f "$PEERS_DIR")" ]] || die "--workdir must not be the harness itself"
# Everything but the shared results (figures of another run must not be mixed in).
(cd "$PEERS_DIR" && find . -mindepth 1 -maxdepth 1 ! -name results ! -name build -print0 |
    xargs -0 cp -r --no-preserve=mode -t "$WORK")
chmod +x "$WORK"/*.sh

DEFS=$(mktemp)
trap 'rm -f "$DEFS"' EXIT
cat >"$DEFS" <<EOF

# ---- chorus (added by run_with_chorus.sh) ----
CHORUS_PERF=$(printf '%q' "$PERF")
chorus_token() { od -An -tx1 -N16 /dev/urandom | tr -d ' \\n'; }
chorus_lo() { # NP TRANSPORT [SCHEDULE]
    local algo=(); [[ -n \${3:-} ]] && algo=(--algo "\$3")
    MASTER_ADDR=127.0.0.1 MASTER_PORT=\$PORT CHORUS_SOCKET_IFNAME=lo CHORUS_TOKEN=\$(chorus_token) \\
        CHORUS_TRANSPORT=\$2 ./launch.sh "\$1" "\$CHORUS_PERF" allreduce --format peers "\${algo[@]}" "\${LOOP_ARGS[@]}"
}
chorus_netns() { # [SCHEDULE]
    local algo=(); [[ -n \${1:-} ]] && algo=(--algo "\$1")
    MASTER_ADDR=10.77.0.1 MASTER_PORT=\$PORT CHORUS_SOCKET_IFNAME=eth0 CHORUS_TOKEN=\$(chorus_token) \\
        ./launch.sh -N allr-h \$NN "\$CHORUS_PERF" allreduce --format peers "\${algo[@]}" "\${NETNS_ARGS[@]}"
}
CHORUS_TUNE_DIR=$(printf '%q' "$WORK/tune")
chorus_cached() { # NAME COMMAND... : COMMAND with CHORUS_TUNE_FILE=\$CHORUS_TUNE_DIR/NAME.txt, after
    # one unrecorded launch (on ports of its own) that writes the file when it does not exist
    local f=\$CHORUS_TUNE_DIR/\$1.txt; shift
    mkdir -p "\$CHORUS_TUNE_DIR"
    if [[ ! -s \$f ]]; then
        (export CHORUS_TUNE_FILE=\$f PORT=\$((PORT + 8)); "\$@" >/dev/null 2>&1) || true
        [[ -s \$f ]] || echo "chorus_cached: the priming launch wrote no \$f" >&2
    fi
    (export CHORUS_TUNE_FILE=\$f; "\$@")
}
ompi_tcp_ring() { # NP: Open MPI over TCP with its ring allreduce forced
    "\${MPIRUN[@]}" -np "\$1" --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo \\
        --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4 \\
        build/mpi_allreduce_bench "\${LOOP_ARGS[@]}"
}
echo "chorus-perf: \$CHORUS_PERF" >>"\$OUT/machine.txt"
EOF
if [[ $SHUFFLE == 1 ]]; then
    cat >>"$DEFS" <<'EOF'
# Rounds in shuffled orders (run_with_chorus.sh): each round launches every peer once, in an
# order drawn from the round's number (Fisher-Yates on bash's RANDOM, seeded: a rerun launches
# in the same orders), so no peer always follows the same neighbour.
chorus_shuffled() { # SEED ITEM... : prints the items, one per line, in an order drawn from SEED
    local -a a=("${@:2}")
    local i j t
    RANDOM=$1
    for ((i = ${#a[@]} - 1; i > 0; i--)); do
        j=$((RANDOM % (i + 1)))
        t=${a[i]}; a[i]=${a[j]}; a[j]=$t
    done
    printf '%s\n' "${a[@]}"
}
run_rounds() {
    local scen=$1 k spec
    local -a order
    shift
    for ((k = 1; k <= REPS; k++)); do
        mapfile -t order < <(chorus_shuffled "$k" "$@")
        for spec in "${order[@]}"; do
            # shellcheck disable=SC2086
            run_one "$scen" "${spec%%=*}" "$k" ${spec#*=}
        done
    done
}
echo "peer order: shuffled per round (run_with_chorus.sh)" >>"$OUT/machine.txt"
EOF
fi
# run_all.sh has written its default arguments to machine.txt before this block runs: the
# overrides say so there too, so that the record names the arguments the run used.
if [[ -n $LOOP_OVERRIDE ]]; then
    echo "LOOP_ARGS=($LOOP_OVERRIDE)" >>"$DEFS"
    echo 'echo "loop args (run_with_chorus.sh --loop-args, replacing the above): ${LOOP_ARGS[*]}" >>"$OUT/machine.txt"' >>"$DEFS"
fi
if [[ -n $NETNS_OVERRIDE ]]; then
    echo "NETNS_ARGS=($NETNS_OVERRIDE)" >>"$DEFS"
    echo 'echo "netns args (run_with_chorus.sh --netns-args, replacing the above): ${NETNS_ARGS[*]}" >>"$OUT/machine.txt"' >>"$DEFS"
fi

# The peers added to the run_rounds lists, as lines of the list (INDENT is the list's indent).
lo_peers=('"chorus-tcp=chorus_lo $np tcp"' '"chorus-shm=chorus_lo $np shm"')
netns_peers=('"chorus=chorus_netns"')
if [[ $ALGORITHMS == 1 ]]; then
    lo_peers+=('"ompi-tcp-ring=ompi_tcp_ring $np"')
    for a in "${SCHEDULES[@]}"; do
        lo_peers+=("\"chorus-tcp-$a=chorus_lo \$np tcp $a\"")
        netns_peers+=("\"chorus-$a=chorus_netns $a\"")
    done
fi

if [[ $NULL == 1 ]]; then
    lo_peers+=('"chorus-tcp-again=chorus_lo $np tcp"')
    netns_peers+=('"chorus-again=chorus_netns"')
fi
if [[ $TUNE_FILE == 1 ]]; then
    lo_peers+=('"chorus-tcp-cached=chorus_cached lo-np$np chorus_lo $np tcp"')
    netns_peers+=('"chorus-cached=chorus_cached netns chorus_netns"')
fi

RUN_ALL=$WORK/run_all.sh
# add_peers ANCHOR PEER... : after the run_rounds entry ANCHOR (a line of its own, ending the
# list), append one entry per PEER with the same indent.
add_peers() {
    local anchor=$1 tmp
    shift
    tmp=$(mktemp)
    ANCHOR=$anchor python3 -c '
import os, sys
anchor, peers = os.environ["ANCHOR"], sys.argv[1:]
lines, hits = [], 0
for line in sys.stdin.read().split("\n"):
    if line.strip() == anchor:
        hits += 1
        indent = line[: len(line) - len(line.lstrip())]
        lines.append(line + " \\")
        lines += [indent + p + " \\" for p in peers[:-1]] + [indent + peers[-1]]
    else:
        lines.append(line)
if hits != 1:
    sys.exit("anchor %r found %d times" % (anchor, hits))
sys.stdout.write("\n".join(lines))
' "$@" <"$RUN_ALL" >"$tmp" || { rm -f "$tmp"; die "could not patch $RUN_ALL: has run_all.sh changed?"; }
    cat "$tmp" >"$RUN_ALL"
    rm -f "$tmp"
}
sed -i -e '/^MPIRUN=(/r '"$DEFS" "$RUN_ALL"
add_peers '"ref-tcp-ring=ring_lo $np"' "${lo_peers[@]}"
add_peers '"ref-tcp-ring=ring_netns"' "${netns_peers[@]}"
[[ $SHUFFLE == 0 ]] || grep -q '^chorus_shuffled() {' "$RUN_ALL" || die "could not patch the round order of $RUN_ALL"
for want in '^chorus_lo() {' '^chorus_netns() {' '"chorus-tcp=chorus_lo \$np tcp" \\$' '"chorus-shm=chorus_lo \$np shm"' '"chorus=chorus_netns"'; do
    grep -q "$want" "$RUN_ALL" || die "could not patch $RUN_ALL (no match for $want): has run_all.sh changed?"
done
if [[ -n $NPS ]]; then
    [[ $NPS =~ ^[0-9\ ]+$ ]] || die "--np takes rank counts such as \"2 4\", not $NPS"
    sed -i "s|^\([[:space:]]*\)for np in 2 4; do$|\1for np in $NPS; do|" "$RUN_ALL"
    grep -q "for np in $NPS; do" "$RUN_ALL" || die "could not patch the rank counts of $RUN_ALL"
fi
if [[ -n $HOSTS ]]; then
    [[ $HOSTS =~ ^[0-9]+$ ]] && ((HOSTS >= 1 && HOSTS <= 250)) || die "--hosts takes a count 1..250, not $HOSTS"
    sed -i "s|^NN=4$|NN=$HOSTS|" "$RUN_ALL"
    grep -q "^NN=$HOSTS$" "$RUN_ALL" || die "could not patch the host count of $RUN_ALL"
fi
bash -n "$RUN_ALL" || die "patched $RUN_ALL does not parse"

echo "harness copy: $WORK (chorus-perf: $PERF)" >&2
if [[ $PREPARE_ONLY == 1 ]]; then
    echo "$WORK"
    exit 0
fi

# ---------------------------------------------------------------- run
rc=0
"$RUN_ALL" "${PASS[@]}" || rc=$?
mode=full
for a in "${PASS[@]}"; do [[ $a == --quick ]] && mode=quick; done
summary=$WORK/results/$mode/summary.md
if [[ -f $summary ]]; then
    echo "summary: $summary"
else
    echo "run_with_chorus.sh: no summary at $summary (run_all.sh exit status $rc)" >&2
fi
exit $rc
