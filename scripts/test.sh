#!/usr/bin/env bash
# Runs every test of chorus: the Rust workspace (unit, conformance, integration, doc tests),
# plus format and lint checks. Installs what it needs on a fresh Debian machine with Rust.
#
#   ./scripts/test.sh            everything
#   ./scripts/test.sh --quick    skip clippy/fmt (for a fast local loop)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

QUICK=0
case ${1:-} in
    '') ;;
    --quick) QUICK=1 ;;
    *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac

log() { printf '== %s\n' "$*" >&2; }

# System packages the tests use (C compiler and pkg-config for the C tests, iproute2 for
# namespace tests, Open MPI for the MPI example, Debian's Python with numpy, PyTorch and pytest
# for the Python package).
need=()
command -v cc >/dev/null || need+=(gcc libc6-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v ip >/dev/null || need+=(iproute2)
type -P kill >/dev/null || need+=(procps) # the program, not bash's builtin
command -v unshare >/dev/null || need+=(util-linux)
command -v setpriv >/dev/null || need+=(util-linux)
command -v flock >/dev/null || need+=(util-linux)
command -v readelf >/dev/null || need+=(binutils) # the C ABI's exported symbols
command -v mpicc >/dev/null || need+=(libopenmpi-dev)
command -v mpirun >/dev/null || need+=(openmpi-bin)
PY=/usr/bin/python3
"$PY" -c 'import numpy' 2>/dev/null || need+=(python3-numpy)
"$PY" -c 'import torch' 2>/dev/null || need+=(python3-torch)
"$PY" -c 'import pytest' 2>/dev/null || need+=(python3-pytest)
if [[ ${#need[@]} -gt 0 ]]; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        log "installing ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
        # Not fatal: the tests that need them fail, or skip where a switch says so.
        echo "missing packages: ${need[*]} (install them, or run as root on Debian)" >&2
    fi
fi

if [[ $QUICK == 0 ]]; then
    # rustup's minimal profile has neither; Debian's cargo package needs its own packages.
    for component in rustfmt clippy; do
        sub=${component/rustfmt/fmt}
        if ! cargo "$sub" --version >/dev/null 2>&1; then
            command -v rustup >/dev/null || { echo "cargo $sub is missing (install $component)" >&2; exit 1; }
            log "rustup component add $component"
            rustup component add "$component"
        fi
    done
    log "cargo fmt --check"
    cargo fmt --all -- --check
    log "cargo clippy"
    cargo clippy --workspace --all-targets --quiet -- -D warnings
fi

# A test skipped by a switch passes without checking anything: say so where it shows.
skips=$(env | grep -E '^CHORUS_SKIP_[A-Z_]+=' | tr '\n' ' ' || true)
[[ -z $skips ]] || log "WARNING: tests skip what these switches name: $skips"

log "cargo test"
# Integration tests spawn processes and thread groups; one test binary at a time keeps the
# 2-core CI machine from oversubscribing, tests inside a binary still run in parallel.
cargo test --workspace -- --test-threads=2

log "python package (ffi/python) over 4 processes"
# The C library (libchorus_ffi.so) and the launcher, dev profile.
cargo build --quiet -p chorus-ffi
cargo build --quiet -p chorus --bin chorus-run
target=$(cargo metadata --format-version 1 --no-deps | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
CHORUS_LIBRARY="$target/debug/libchorus_ffi.so" CHORUS_RUN="$target/debug/chorus-run" \
    "$PY" -m pytest -q -p no:cacheprovider ffi/python/tests

log "benchmark tooling (benches/peers)"
"$PY" -m pytest -q -p no:cacheprovider benches/peers

log "all tests passed"
