#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds, on a machine with nvcc (no GPU needed), every binary that
# tests/gpu/run_kernels_v3.sh runs on the GPU machine, so that no device
# time goes into compiling:
#   test_gemm_sm90, test_kernels, test_ring (tests/gpu), mok_bench (tests/bench)
# all linked against the kernel objects and the static CUDA runtime only
# (no libuv, protobuf-c or libcuda), plus the ptxas resource report and the
# SASS census (when cuobjdump is found).
#
#   tests/gpu/build_kernels_v3.sh [DIR]     DIR: $1, else $MOK_V3BUILD, else build-v3
# Environment: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc),
# CUOBJDUMP (default: cuobjdump on PATH). Carry DIR to the GPU machine.
# Exit status: 0 when everything built without compiler warnings.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
B=${1:-${MOK_V3BUILD:-build-v3}}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || true)}
ARCH="-gencode=arch=compute_90a,code=sm_90a"
FLAGS="-std=c++17 -O3 $ARCH -Xcompiler -Wall,-Wextra"
mkdir -p "$B/obj" "$B/log"
status=0
fail() { printf '!! %s\n' "$*"; status=1; }

# the kernel library through the Makefile (its CUTLASS units with their
# flags), then the test programs in parallel
KLIB=$B/k/lib/libmokkernels.a
make -s -j"$(nproc)" NVCC="$NVCC" KBUILD="$B/k" KERNEL_NVCC_EXTRA="-Xptxas -v -Xcompiler -Wall,-Wextra" \
  "$KLIB" >"$B/log/ptxas_kernels.log" 2>&1 || status=1
pids=()
for t in tests/gpu/test_gemm_sm90 tests/gpu/test_kernels tests/gpu/test_ring tests/bench/mok_bench; do
  "$NVCC" $FLAGS -Ikernels -Iproto -c "$t.cu" -o "$B/obj/$(basename "$t").o" >"$B/log/build_$(basename "$t").log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
gcc -std=c11 -O2 -Wall -Iproto -Idaemon -c daemon/schedule.c -o "$B/obj/schedule.o" &&
  gcc -std=c11 -O2 -Wall -Iproto -Idaemon -c tests/gpu/sched_shim.c -o "$B/obj/sched_shim.o" &&
  gcc -std=c11 -O2 -Wall -c tests/ref/ref64.c -o "$B/obj/ref64.o" || fail "gcc objects"
if [ $status != 0 ]; then
  grep -hiE "error" "$B"/log/*.log | head -20
  fail "nvcc"
  exit 1
fi
kobjs=("$KLIB")
"$NVCC" $ARCH -o "$B/test_gemm_sm90" "$B/obj/test_gemm_sm90.o" "${kobjs[@]}" -lpthread -lm || fail "link test_gemm_sm90"
"$NVCC" $ARCH -o "$B/test_ring" "$B/obj/test_ring.o" "${kobjs[@]}" -lpthread -lm || fail "link test_ring"
"$NVCC" $ARCH -o "$B/mok_bench" "$B/obj/mok_bench.o" "${kobjs[@]}" -lcuda -lpthread -lm || fail "link mok_bench"
"$NVCC" $ARCH -o "$B/test_kernels" "$B/obj/test_kernels.o" "${kobjs[@]}" "$B/obj/schedule.o" \
  "$B/obj/sched_shim.o" "$B/obj/ref64.o" -lpthread -lm || fail "link test_kernels"

# resources per kernel: registers, spills (the GEMM kernels must have none
# beyond the 4 bytes the down dgrad has had since v2)
cat "$B"/log/ptxas_*.log | awk '
  /Compiling entry function/ { match($0, /\x27[^\x27]+\x27/); fn = substr($0, RSTART+1, RLENGTH-2) }
  /spill/ { spill = $0 }
  /Used [0-9]+ registers/ { printf "  %-70s %s |%s\n", fn, $0, spill }' |
  sed 's/ptxas info    : //' >"$B/resources.txt"
grep -E "s9_|gemm_kernel" "$B/resources.txt" | sed -E 's/ +/ /g' | cut -c1-200
# warnings in this repository's files (system headers' own are not ours)
if grep -hE "^(kernels|tests|proto)/.*warning" "$B"/log/*.log >/dev/null; then
  grep -hE "^(kernels|tests|proto)/.*warning" "$B"/log/*.log | head -20
  fail "compiler warnings"
fi
if [ -n "$CUOBJDUMP" ]; then
  # matrix and TMA instructions, spills in SASS: HGMMA present, no LDL/STL
  # outside the down dgrad
  "$CUOBJDUMP" -sass "$B/k/obj/kernels/mok_gemm_sm90.o" | awk '
    /Function :/ { fn = $3 }
    /HGMMA/ { h[fn]++ } /UTMALDG/ { t[fn]++ } /UTMASTG/ { s[fn]++ }
    /[^A-Z](LDL|STL)[ .]/ { l[fn]++ } /Function :/ { f[fn] = 1 }
    END { for (k in f) printf "  %-72s HGMMA %3d UTMALDG %3d UTMASTG %2d LDL/STL %d\n", k, h[k], t[k], s[k], l[k] }' |
    sort | tee "$B/sass.txt"
else
  echo "(no cuobjdump: no SASS census)" | tee "$B/sass.txt"
fi
git rev-parse HEAD >"$B/commit" 2>/dev/null
git status --porcelain kernels tests/gpu tests/bench proto >>"$B/commit" 2>/dev/null
[ $status = 0 ] && echo "built in $B: test_gemm_sm90 test_kernels test_ring mok_bench" || echo "build FAILED"
exit $status
