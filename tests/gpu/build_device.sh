#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds mokd, libmok and the device test for the GPU test machine, which
# lacks libuv, protobuf-c and libsystemd: libuv and protobuf-c are linked
# statically into the programs, libsystemd is replaced by no-op stubs
# (tests/gpu/sd_stub.c), libmok.so keeps protobuf-c as a shared library that
# travels in the build's lib/. Run it here (x86-64, nvcc present), then carry
# the folder (default .devbuild, ignored) to the GPU machine and run
# tests/gpu/run_device_tests.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${MOK_DEVBUILD:-.devbuild}
LIBDIR=${LIBDIR:-/usr/lib/x86_64-linux-gnu}
mkdir -p "$B/lib"
gcc -O2 -fPIC -c tests/gpu/sd_stub.c -o "$B/sd_stub.o"
make -j"$(nproc)" BUILD="$B" PB_LIBS=-lprotobuf-c "$B/lib/libmok.so"
make -j"$(nproc)" BUILD="$B" UV_LIBS="$LIBDIR/libuv_a.a" PB_LIBS="$LIBDIR/libprotobuf-c.a" \
  SD_LIBS="$PWD/$B/sd_stub.o" "$B/bin/mokd" "$B/bin/mokctl" "$B/tests/gpu/test_cuda_engine" \
  "$B/tests/test_ep" "$B/tests/test_standing" "$B/tests/test_standing_ep" "$B/tests/test_scrape" "$B/bench/bench_memory"
cp -L "$LIBDIR/libprotobuf-c.so.1" "$B/lib/"
rm -rf "$B/python" && mkdir -p "$B/python" && cp -r client/python/mok "$B/python/"
find "$B/python" -name __pycache__ -prune -exec rm -rf {} +

# the EP bench (tests/bench/bench_ep_cuda.cu): kernels and libmok, static protobuf-c
"${NVCC:-/usr/local/cuda/bin/nvcc}" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a \
  -Iclient/include -Iproto -Ikernels -o "$B/bench/bench_ep_cuda" \
  tests/bench/bench_ep_cuda.cu "$B/lib/libmok.a" "$B/lib/libmokkernels.a" \
  "$LIBDIR/libprotobuf-c.a" -ldl -lpthread
echo "built $B/bench/bench_ep_cuda"

# the hostile-tenant test (tests/gpu/test_hostile.cu): a CUDA client, libmok, static protobuf-c
mkdir -p "$B/tests/gpu"
"${NVCC:-/usr/local/cuda/bin/nvcc}" -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a \
  -Iclient/include -Iproto -Ikernels -o "$B/tests/gpu/test_hostile" tests/gpu/test_hostile.cu \
  "$B/lib/libmok.a" "$LIBDIR/libprotobuf-c.a" -ldl -lpthread
echo "built $B/tests/gpu/test_hostile"

# the boundary benches: an empty job through mokd (tests/bench/bench_fence.cu)
# and the layer through mokd (tests/bench/mok_bench_daemon.cu)
for b in bench_fence mok_bench_daemon; do
  "${NVCC:-/usr/local/cuda/bin/nvcc}" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a \
    -Iclient/include -Iproto -Itests/gpu -o "$B/bench/$b" "tests/bench/$b.cu" "$B/lib/libmok.a" \
    "$LIBDIR/libprotobuf-c.a" -lcuda -ldl -lpthread
  echo "built $B/bench/$b"
done
