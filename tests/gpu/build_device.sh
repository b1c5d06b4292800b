#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds mokd, libmok and the device test for the GPU test machine, which
# lacks libuv, protobuf-c and libsystemd: libuv and protobuf-c are linked
# statically into the programs, libsystemd is replaced by no-op stubs
# (tests/gpu/sd_stub.c), libmok.so keeps protobuf-c as a shared library that
# travels in the build's lib/. Run it here (x86-64, nvcc present), then carry
# the folder (default .devbuild, ignored) to the GPU machine and run
# tests/gpu/run_device_tests.sh there. MOK_DEVBUILD may be relative (to the
# repository) or absolute.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${MOK_DEVBUILD:-.devbuild}
case $B in /*) B_ABS=$B ;; *) B_ABS=$PWD/$B ;; esac # relative to the repository, or absolute
LIBDIR=${LIBDIR:-/usr/lib/x86_64-linux-gnu}
mkdir -p "$B/lib"
gcc -O2 -fPIC -c tests/gpu/sd_stub.c -o "$B/sd_stub.o"
make -j"$(nproc)" BUILD="$B" PB_LIBS=-lprotobuf-c "$B/lib/libmok.so"
# the programs: the Makefile's rules (the GPU ones with nvcc: make gpu-tests),
# libuv and protobuf-c static, libsystemd stubbed
CUDA_CLIENTS=("$B/bench/bench_ep_cuda" "$B/tests/gpu/test_hostile" "$B/bench/bench_fence"
  "$B/bench/mok_bench_daemon")
make -j"$(nproc)" BUILD="$B" UV_LIBS="$LIBDIR/libuv_a.a" PB_LIBS="$LIBDIR/libprotobuf-c.a" \
  SD_LIBS="$B_ABS/sd_stub.o" "$B/bin/mokd" "$B/bin/mokctl" "$B/tests/gpu/test_cuda_engine" \
  "$B/tests/test_ep" "$B/tests/test_standing" "$B/tests/test_standing_ep" "$B/tests/test_scrape" \
  "$B/bench/bench_memory" "${CUDA_CLIENTS[@]}"
cp -L "$LIBDIR/libprotobuf-c.so.1" "$B/lib/"
rm -rf "$B/python" && mkdir -p "$B/python" && cp -r client/python/mok "$B/python/"
find "$B/python" -name __pycache__ -prune -exec rm -rf {} +
for f in "${CUDA_CLIENTS[@]}"; do echo "built $f"; done
