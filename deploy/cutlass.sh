#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the pinned CUTLASS headers the CUDA kernels build on (kernels/cutlass/):
# CUTLASS 4.2.0, as the C++ headers inside the nvidia-cutlass 4.2.0.0 wheel from
# PyPI (checked against its sha256), unpacked into DIR (default .deps/cutlass-4.2.0
# in the repository; the Makefile's CUTLASS_DIR). Needs no root; does nothing when
# DIR is complete. Only the headers are used: no Python part of the wheel is installed.
#   deploy/cutlass.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=4.2.0.0
SHA256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
DIR=${1:-.deps/cutlass-4.2.0}
if [ -f "$DIR/include/cutlass/cutlass.h" ] && [ -f "$DIR/include/cute/tensor.hpp" ] &&
   [ "$(cat "$DIR/.wheel-sha256" 2>/dev/null)" = "$SHA256" ]; then
  echo "cutlass: $DIR is ready"
  exit 0
fi
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "nvidia-cutlass==$VERSION" || {
  echo "cutlass: could not download nvidia-cutlass==$VERSION from the package index" >&2
  exit 1
}
whl=$(ls "$tmp"/nvidia_cutlass-"$VERSION"-*.whl)
got=$(sha256sum "$whl" | cut -d' ' -f1)
if [ "$got" != "$SHA256" ]; then
  echo "cutlass: $whl has sha256 $got, expected $SHA256" >&2
  exit 1
fi
# the headers: include/ (cute, cutlass) and tools/util/include (cutlass/util)
"$PYTHON" - "$whl" "$tmp/x" <<'PY'
import sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
keep = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/",
        "cutlass_library/source/LICENSE.txt")
with zipfile.ZipFile(src) as z:
    z.extractall(dst, [n for n in z.namelist() if n.startswith(keep)])
PY
rm -rf "$DIR.part" && mkdir -p "$DIR.part"
s="$tmp/x/cutlass_library/source"
cp -r "$s/include" "$DIR.part/include"
mkdir -p "$DIR.part/tools/util"
cp -r "$s/tools/util/include" "$DIR.part/tools/util/include"
[ -f "$s/LICENSE.txt" ] && cp "$s/LICENSE.txt" "$DIR.part/"
echo "$SHA256" >"$DIR.part/.wheel-sha256"
rm -rf "$DIR" && mv "$DIR.part" "$DIR"
echo "cutlass: CUTLASS $VERSION headers in $DIR"
