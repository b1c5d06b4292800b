#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds and runs the GPU kernel tests (needs nvcc and an sm_90 GPU).
#
#   tests/gpu/run_kernel_tests.sh [--out DIR] [STEP...]     STEP: build correct time sanitize all
#                                               (default: all = build correct time sanitize)
# --out DIR: the logs (default BUILD_DIR). Environment: BUILD_DIR (default .gpubuild),
# NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc).
# Exit status: 0 when every step passed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
BUILD_DIR=${BUILD_DIR:-$ROOT/.gpubuild}
OUTDIR=$BUILD_DIR
if [ "${1:-}" = --out ]; then OUTDIR=${2:?--out needs a folder}; shift 2; fi
LOGS=$OUTDIR
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
ARCH="-gencode=arch=compute_90a,code=sm_90a"
NVFLAGS="-std=c++17 -O3 $ARCH -Xcompiler -Wall,-Wextra"
BIN=$BUILD_DIR/test_kernels
mkdir -p "$BUILD_DIR" "$LOGS"

status=0
note() { printf '== %s\n' "$*"; }
fail() { printf '!! %s\n' "$*"; status=1; }

build() {
  note "build ($NVCC)"
  local pids=() f
  local kernels
  kernels=$(cd kernels && ls *.cu | sed 's/\.cu$//')
  for f in $kernels; do
    "$NVCC" $NVFLAGS -Xptxas -v -c kernels/$f.cu -o "$BUILD_DIR/$f.o" \
      >"$LOGS/ptxas_$f.log" 2>&1 &
    pids+=($!)
  done
  "$NVCC" $NVFLAGS -c tests/gpu/test_kernels.cu -o "$BUILD_DIR/test_kernels.o" \
    >"$LOGS/build_test.log" 2>&1 &
  pids+=($!)
  gcc -std=c11 -O2 -Wall -Iproto -Idaemon -c daemon/schedule.c -o "$BUILD_DIR/schedule.o" &&
    gcc -std=c11 -O2 -Wall -Iproto -Idaemon -c tests/gpu/sched_shim.c -o "$BUILD_DIR/sched_shim.o" &&
    gcc -std=c11 -O2 -Wall -c tests/ref/ref64.c -o "$BUILD_DIR/ref64.o" || fail "gcc objects"
  local p ok=1
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  if [ $ok = 0 ]; then
    cat "$LOGS"/ptxas_*.log "$LOGS/build_test.log" | grep -iE "error|warning" | head -40
    fail "nvcc"
    return 1
  fi
  local objs=()
  for f in $kernels test_kernels schedule sched_shim ref64; do objs+=("$BUILD_DIR/$f.o"); done
  "$NVCC" $ARCH -o "$BIN" "${objs[@]}" -lpthread -lm || { fail "link"; return 1; }
  # resource report: registers, shared memory, spills per kernel
  cat "$LOGS"/ptxas_*.log | awk '
    /Compiling entry function/ { match($0, /\x27[^\x27]+\x27/); fn = substr($0, RSTART+1, RLENGTH-2) }
    /spill/ { spill = $0 }
    /Used [0-9]+ registers/ { printf "  %-60s %s |%s\n", fn, $0, spill }' |
    sed 's/ptxas info    : //' | tee "$LOGS/resources.txt"
  if grep -E "[1-9][0-9]* bytes spill" "$LOGS"/ptxas_*.log >/dev/null; then
    note "WARNING: register spills (see resources.txt)"
  fi
  if grep -iE "warning" "$LOGS"/ptxas_*.log "$LOGS/build_test.log" >/dev/null; then
    grep -iE "warning" "$LOGS"/ptxas_*.log "$LOGS/build_test.log" | head -20
    fail "compiler warnings"
  fi
}

run_correct() {
  note "correctness (all shapes vs ref64, determinism, bad inputs)"
  timeout 200 "$BIN" correct 2>&1 | tee "$LOGS/correct.log" || fail "correct"
}

run_time() {
  note "timing"
  timeout 90 "$BIN" time 2>&1 | tee "$LOGS/time.log" || fail "time"
}

run_sanitize() {
  note "compute-sanitizer memcheck (quick)"
  timeout 120 "$SANITIZER" --tool memcheck --error-exitcode 3 "$BIN" quick \
    >"$LOGS/memcheck.log" 2>&1 || fail "memcheck"
  tail -n 3 "$LOGS/memcheck.log"
  note "compute-sanitizer racecheck (quick)"
  timeout 120 "$SANITIZER" --tool racecheck --error-exitcode 3 "$BIN" quick \
    >"$LOGS/racecheck.log" 2>&1 || fail "racecheck"
  tail -n 3 "$LOGS/racecheck.log"
}

steps=("$@")
[ ${#steps[@]} = 0 ] && steps=(all)
for s in "${steps[@]}"; do
  case $s in
    build) build ;;
    correct) run_correct ;;
    time) run_time ;;
    sanitize) run_sanitize ;;
    all) build && { run_correct; run_time; run_sanitize; } ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
[ $status = 0 ] && note "ALL PASSED" || note "SOME STEPS FAILED"
exit $status
