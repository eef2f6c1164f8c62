#!/usr/bin/env bash
# run_with_chorus.sh - run the peers harness (shared/peers/run_all.sh) with chorus as one more peer.
#
#   run_with_chorus.sh [--workdir DIR] [--no-build] [--prepare-only] [run_all.sh args...]
#   e.g. run_with_chorus.sh --quick --only loopback
#
# The harness directory is read-only, so it is copied (without its results/) to DIR (default:
# a fresh /tmp/peers-chorus.XXXXXX) and the copy's run_all.sh gets two more peers:
#   loopback: "chorus=chorus_lo $np"  launch.sh NP chorus-perf allreduce --format peers LOOP_ARGS
#             (MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT; chorus listens on MASTER_PORT+1)
#   netns:    "chorus=chorus_netns"   launch.sh -N allr-h 4 ... NETNS_ARGS
#             (MASTER_ADDR=10.77.0.1, CHORUS_SOCKET_IFNAME=eth0)
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
PASS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --workdir) WORK=${2:?--workdir needs a directory}; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --prepare-only) PREPARE_ONLY=1; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
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
chorus_lo() { # NP TRANSPORT
    MASTER_ADDR=127.0.0.1 MASTER_PORT=\$PORT CHORUS_SOCKET_IFNAME=lo CHORUS_TOKEN=\$(chorus_token) \\
        CHORUS_TRANSPORT=\$2 ./launch.sh "\$1" "\$CHORUS_PERF" allreduce --format peers "\${LOOP_ARGS[@]}"
}
chorus_netns() {
    MASTER_ADDR=10.77.0.1 MASTER_PORT=\$PORT CHORUS_SOCKET_IFNAME=eth0 CHORUS_TOKEN=\$(chorus_token) \\
        ./launch.sh -N allr-h \$NN "\$CHORUS_PERF" allreduce --format peers "\${NETNS_ARGS[@]}"
}
echo "chorus-perf: \$CHORUS_PERF" >>"\$OUT/machine.txt"
EOF

RUN_ALL=$WORK/run_all.sh
sed -i \
    -e '/^MPIRUN=(/r '"$DEFS" \
    -e 's|^\([[:space:]]*\)"ref-tcp-ring=ring_lo \$np"$|\1"ref-tcp-ring=ring_lo $np" \\\n\1"chorus-tcp=chorus_lo $np tcp" \\\n\1"chorus-shm=chorus_lo $np shm"|' \
    -e 's|^\([[:space:]]*\)"ref-tcp-ring=ring_netns"$|\1"ref-tcp-ring=ring_netns" \\\n\1"chorus=chorus_netns"|' \
    "$RUN_ALL"
for want in '^chorus_lo() {' '^chorus_netns() {' '"chorus-tcp=chorus_lo \$np tcp" \\$' '"chorus-shm=chorus_lo \$np shm"$' '"chorus=chorus_netns"$'; do
    grep -q "$want" "$RUN_ALL" || die "could not patch $RUN_ALL (no match for $want): has run_all.sh changed?"
done
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
