#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The kernel benchmark (docs/design.md, "Benchmark shapes") in one command, on a machine with an sm_90 GPU, nvcc and
# a python3 with PyTorch (>= 2.8, for torch._grouped_mm):
#
#   tests/bench/run_bench.sh [OUTDIR]
#
# 1. builds tests/bench/mok_bench (the kernel library + mok_bench.cu, nvcc, sm_90a),
#    unless a build of the same sources is already in BUILD_DIR;
# 2. runs the PyTorch baseline (tests/bench/torch_baseline.py: correctness at a
#    tiny shape against the float64 reference, dense GEMM and copy ceilings,
#    then every shape x T x routing), which writes the routings it used;
# 3. runs mok_bench on the same routings (kernel library, in-process);
# 4. when a mokd with the cuda engine and tests/bench/mok_bench_daemon are at
#    hand, starts that mokd and runs the same configurations through it (one
#    job per forward / backward, device pointers, the client's stream);
# 5. prints the table (tests/bench/bench_table.py) and writes JSON.
#
# OUTDIR: $1, else BUILD_DIR/results. Files there: baseline.json,
# mok.json, daemon.json, bench.json (the merged table), baseline.log, mok.log
# (with the daemon run's and mokd's logs), table.txt, build.log.
# The daemon step: mokd is $MOKD, else BUILD_DIR/dev/mokd, else
# $MOK_DEVBUILD/bin/mokd (tests/gpu/build_device.sh), else build/bin/mokd;
# mok_bench_daemon is built against $MOK_DEVBUILD/lib/libmok.a (static
# protobuf-c) and step 1's kernel objects (its --inproc-ab runs the layer
# in-process too) when those exist, else a carried BUILD_DIR/mok_bench_daemon
# is used. BENCH_DAEMON=0 skips the step; BENCH_DEADLINE_DAEMON (default 90).
# Environment: BUILD_DIR (default .benchbuild), NVCC, PYTHON (default python3),
# BENCH_BUILD_ONLY=1 builds and stops (on a machine with nvcc and no GPU);
# BENCH_T (default "2048,8192"), BENCH_REPS (10), BENCH_WARMUP (3),
# BENCH_DEADLINE_BASE / BENCH_DEADLINE_MOK (seconds after which each program
# starts no new configuration; default 150 / 120), BENCH_ONLY (shape names),
# BENCH_FP8=1: a second mok_bench run of the bf16 layer (on BENCH_FP8_WITH, default
# pingpong) and the fp8 layer taking turns, tabled by tests/bench/fp8_table.py
# (mok_fp8.json, fp8.json, fp8_table.txt).
# Exit status: 0 when everything ran and every check passed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
BUILD_DIR=${BUILD_DIR:-$ROOT/.benchbuild}
OUTDIR=${1:-$BUILD_DIR/results}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
PYTHON=${PYTHON:-python3}
BENCH_T=${BENCH_T:-2048,8192}
REPS=${BENCH_REPS:-10}
WARMUP=${BENCH_WARMUP:-3}
DL_BASE=${BENCH_DEADLINE_BASE:-150}
DL_MOK=${BENCH_DEADLINE_MOK:-120}
DL_DAEMON=${BENCH_DEADLINE_DAEMON:-90}
MOK_DEVBUILD=${MOK_DEVBUILD:-$ROOT/.devbuild}
DBIN=$BUILD_DIR/mok_bench_daemon
ONLY=${BENCH_ONLY:-}
BIN=$BUILD_DIR/mok_bench
ROUTING=$(mktemp -d /tmp/mok_bench_routing.XXXXXX)
trap 'rm -rf "$ROUTING"' EXIT
mkdir -p "$BUILD_DIR" "$OUTDIR"
status=0
note() { printf '== %s\n' "$*"; }

# ---- build -------------------------------------------------------------------------
# the kernel library through the Makefile (its CUTLASS units with their flags),
# then mok_bench against it
KLIBDIR=$BUILD_DIR/k
KLIB=$KLIBDIR/lib/libmokkernels.a
SOURCES="$(ls kernels/*.cu kernels/*.h kernels/*.cuh kernels/common/*.cuh kernels/cutlass_gemm/*) proto/mok_status.h proto/mok_layout.h tests/bench/mok_bench.cu tests/bench/bench_common.h tests/bench/bench_layer.h tests/bench/bench_pool.h tests/harness/cuda_check.cuh tests/harness/expect.h tests/harness/model_shapes.h"
srchash=$( (cat $SOURCES; ls .deps/cutlass-*/.wheel-sha256 2>/dev/null) | sha256sum | cut -d' ' -f1)
{
  if [ -x "$BIN" ] && [ "$(cat "$BIN.srchash" 2>/dev/null)" = "$srchash" ] && "$BIN" --version >/dev/null 2>&1; then
    note "mok_bench: reusing $BIN (same sources)"
  else
    note "mok_bench: building with $NVCC"
    ARCH="-gencode=arch=compute_90a,code=sm_90a"
    if make -s -j"$(nproc)" NVCC="$NVCC" KBUILD="$KLIBDIR" KERNEL_NVCC_EXTRA="-Xptxas -v" "$KLIB" \
         >"$BUILD_DIR/ptxas_kernels.log" 2>&1 &&
       "$NVCC" -std=c++17 -O3 $ARCH -Xcompiler -Wall,-Wextra -Ikernels -Iproto -o "$BIN" \
         tests/bench/mok_bench.cu "$KLIB" -lcuda -lpthread -lm; then
      echo "$srchash" >"$BIN.srchash"
      grep -hE "spill|Used [0-9]+ registers" "$BUILD_DIR"/ptxas_kernels.log | sed 's/ptxas info    : //' | sort | uniq -c | sort -rn | head -12
    else
      grep -iE "error" "$BUILD_DIR"/ptxas_kernels.log | head -20
      echo "mok_bench: build FAILED"
    fi
  fi
  if [ "${BENCH_DAEMON:-1}" != 0 ]; then
    # the kernel objects too (--inproc-ab runs the layer in-process beside mokd's):
    # those mok_bench was just linked from, of these sources
    dsrc=$( (cat tests/bench/mok_bench_daemon.cu tests/bench/bench_common.h tests/bench/bench_layer.h tests/bench/bench_pool.h tests/harness/cuda_check.cuh tests/harness/expect.h tests/harness/model_shapes.h client/include/mok.h proto/mok_enums.h; echo "$srchash") | sha256sum | cut -d' ' -f1)
    PBA=${PROTOBUF_C_A:-/usr/lib/x86_64-linux-gnu/libprotobuf-c.a}
    kobjs=("$KLIB")
    kobjs_ok=1
    [ "$(cat "$BIN.srchash" 2>/dev/null)" = "$srchash" ] && [ -f "$KLIB" ] || kobjs_ok=0
    if [ -x "$DBIN" ] && [ "$(cat "$DBIN.srchash" 2>/dev/null)" = "$dsrc" ]; then
      note "mok_bench_daemon: reusing $DBIN"
    elif [ -f "$MOK_DEVBUILD/lib/libmok.a" ] && [ -f "$PBA" ] && [ $kobjs_ok = 1 ]; then
      note "mok_bench_daemon: building against $MOK_DEVBUILD/lib/libmok.a and the kernel objects"
      "$NVCC" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -Wall,-Wextra \
        -Iclient/include -Iproto -Ikernels -o "$DBIN" tests/bench/mok_bench_daemon.cu \
        "$MOK_DEVBUILD/lib/libmok.a" "${kobjs[@]}" "$PBA" -lcuda -ldl -lpthread &&
        echo "$dsrc" >"$DBIN.srchash"
    elif [ -x "$DBIN" ]; then
      note "mok_bench_daemon: using the carried $DBIN (sources differ; no libmok.a to rebuild)"
    elif [ $kobjs_ok = 0 ]; then
      note "mok_bench_daemon: no kernel objects in $BUILD_DIR (mok_bench's build failed?): no daemon column"
    else
      note "mok_bench_daemon: no libmok.a at $MOK_DEVBUILD/lib: no daemon column"
    fi
  fi
  if command -v cuobjdump >/dev/null 2>&1 && [ -x "$BIN" ]; then
    echo "SASS matrix instructions in mok_bench (HMMA: mma.sync; HGMMA: wgmma):"
    cuobjdump -sass "$BIN" | grep -oE '\b(HGMMA|HMMA)\.[A-Z0-9.]+' | sort | uniq -c
  fi
  command -v nvidia-smi >/dev/null 2>&1 &&
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv
} 2>&1 | tee "$OUTDIR/build.log"
[ -x "$BIN" ] || status=1
# BENCH_BUILD_ONLY=1: build (here, without a GPU) and stop; carry $BUILD_DIR
[ "${BENCH_BUILD_ONLY:-0}" = 1 ] && exit $status

# ---- baseline ----------------------------------------------------------------------
note "PyTorch baseline"
only_arg=()
[ -n "$ONLY" ] && only_arg=(--only "$ONLY")
PYTHONUNBUFFERED=1 "$PYTHON" tests/bench/torch_baseline.py --out "$OUTDIR/baseline.json" \
  --routing-dir "$ROUTING" --T "$BENCH_T" --reps "$REPS" --warmup "$WARMUP" \
  --deadline "$DL_BASE" "${only_arg[@]}" 2>&1 | tee "$OUTDIR/baseline.log" || status=1

# ---- mok ---------------------------------------------------------------------------
if [ -x "$BIN" ]; then
  note "mok kernels (in-process)"
  "$BIN" --out "$OUTDIR/mok.json" --routing-dir "$ROUTING" --T "$BENCH_T" --reps "$REPS" \
    --warmup "$WARMUP" --deadline "$DL_MOK" "${only_arg[@]}" 2>&1 | tee "$OUTDIR/mok.log" || status=1
fi

# ---- the fp8 layer beside the bf16 one (BENCH_FP8=1) -------------------------------
if [ -x "$BIN" ] && [ "${BENCH_FP8:-0}" = 1 ]; then
  note "mok kernels, bf16 and fp8 layers taking turns (in-process)"
  "$BIN" --out "$OUTDIR/mok_fp8.json" --routing-dir "$ROUTING" --T "$BENCH_T" --reps "$REPS" \
    --warmup "$WARMUP" --deadline "$DL_MOK" --variants "${BENCH_FP8_WITH:-pingpong},fp8" \
    "${only_arg[@]}" 2>&1 | tee "$OUTDIR/mok_fp8.log" || status=1
fi

# ---- through the daemon ------------------------------------------------------------
daemon_arg=()
if [ "${BENCH_DAEMON:-1}" != 0 ]; then
  MOKD=${MOKD:-}
  for m in "$BUILD_DIR/dev/mokd" "$MOK_DEVBUILD/bin/mokd" "$ROOT/build/bin/mokd"; do
    [ -z "$MOKD" ] && [ -x "$m" ] && MOKD=$m
  done
  if [ -n "$MOKD" ] && [ -x "$DBIN" ]; then
    note "through mokd ($MOKD --engine cuda)" | tee -a "$OUTDIR/mok.log"
    daemon_arg=(--daemon "$OUTDIR/daemon.json")
    SOCK=/tmp/mok-bench-$$.sock
    rm -f "$SOCK"
    "$MOKD" --engine cuda --socket "$SOCK" --log-level warn >"$ROUTING/mokd.log" 2>&1 &
    MOKD_PID=$!
    for _ in $(seq 1 300); do
      [ -S "$SOCK" ] && break
      kill -0 "$MOKD_PID" 2>/dev/null || break
      sleep 0.1
    done
    if [ -S "$SOCK" ]; then
      MOK_SOCKET=$SOCK timeout $((${DL_DAEMON%.*} + 120)) "$DBIN" --out "$OUTDIR/daemon.json" \
        --routing-dir "$ROUTING" --T "$BENCH_T" --reps "$REPS" --warmup "$WARMUP" \
        --deadline "$DL_DAEMON" "${only_arg[@]}" 2>&1 | tee -a "$OUTDIR/mok.log" || status=1
    else
      echo "mokd did not come up" | tee -a "$OUTDIR/mok.log"
      echo '{"tool": "mok_bench_daemon", "note": "mokd did not come up", "results": []}' >"$OUTDIR/daemon.json"
      status=1
    fi
    if kill -0 "$MOKD_PID" 2>/dev/null; then
      kill -TERM "$MOKD_PID"
      for _ in $(seq 1 100); do kill -0 "$MOKD_PID" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$MOKD_PID" 2>/dev/null && kill -KILL "$MOKD_PID"
    fi
    wait "$MOKD_PID" 2>/dev/null
    echo "mokd exit status $? (log below)" >>"$OUTDIR/mok.log"
    tail -40 "$ROUTING/mokd.log" >>"$OUTDIR/mok.log"
    rm -f "$SOCK"
  else
    note "through mokd: skipped (mokd ${MOKD:-not found}; $DBIN $([ -x "$DBIN" ] && echo present || echo absent))"
  fi
fi

# ---- table -------------------------------------------------------------------------
note "table"
"$PYTHON" tests/bench/bench_table.py "$OUTDIR/baseline.json" "$OUTDIR/mok.json" \
  "${daemon_arg[@]}" --out "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/table.txt" || status=1
if [ -f "$OUTDIR/mok_fp8.json" ] && [ "${BENCH_FP8:-0}" = 1 ]; then
  "$PYTHON" tests/bench/fp8_table.py "$OUTDIR/baseline.json" "$OUTDIR/mok_fp8.json" \
    --out "$OUTDIR/fp8.json" 2>&1 | tee "$OUTDIR/fp8_table.txt" || status=1
fi
note "JSON and logs in $OUTDIR"
exit $status
