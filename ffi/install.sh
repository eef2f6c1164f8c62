#!/usr/bin/env bash
# Builds the C library and installs it under a prefix:
#   PREFIX/lib/libchorus.so, PREFIX/lib/libchorus.a, PREFIX/include/chorus.h,
#   PREFIX/lib/pkgconfig/chorus.pc
#
#   ffi/install.sh --prefix /usr/local            cargo build --release, then install
#   ffi/install.sh --prefix DIR --from LIBDIR     install libraries already built in LIBDIR
#
# Then: cc app.c $(PKG_CONFIG_PATH=DIR/lib/pkgconfig pkg-config --cflags --libs chorus)
# (add --static to link libchorus.a).
set -euo pipefail
here="$(cd "$(dirname "$(readlink -f "$0")")" && pwd)"
prefix="" from=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
        --from) from=${2:?--from needs a directory}; shift 2 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[[ -n $prefix ]] || { echo "install.sh: --prefix DIR is required" >&2; exit 2; }
if [[ -z $from ]]; then
    (cd "$here/.." && cargo build --release -p chorus-ffi)
    target=$(cd "$here/.." && cargo metadata --format-version 1 --no-deps |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    from="$target/release"
fi
# cargo names them after the crate (libchorus_ffi); C programs link with -lchorus.
for f in libchorus_ffi.so libchorus_ffi.a; do
    [[ -f $from/$f ]] || { echo "install.sh: $from/$f not found (build chorus-ffi first)" >&2; exit 1; }
done
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$here/../Cargo.toml" | head -1)
mkdir -p "$prefix/lib/pkgconfig" "$prefix/include"
prefix=$(cd "$prefix" && pwd)
install -m 755 "$from/libchorus_ffi.so" "$prefix/lib/libchorus.so"
install -m 644 "$from/libchorus_ffi.a" "$prefix/lib/libchorus.a"
install -m 644 "$here/include/chorus.h" "$prefix/include/chorus.h"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" "$here/chorus.pc.in" \
    > "$prefix/lib/pkgconfig/chorus.pc"
echo "installed chorus $version under $prefix" >&2
