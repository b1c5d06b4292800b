#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The layer through mokd without and with MPS: mok_bench_daemon against a
# fresh mokd for each (the cost of the daemon boundary; compare with the
# in-process mok.json of the same call, from run_bench.sh or mok_bench).
#   tests/bench/run_daemon_variants.sh OUTDIR [T_LIST] [DEADLINE_S] [REPS] [WARMUP]
# Binaries: $MOK_DEVBUILD/bin/mokd (tests/gpu/build_device.sh) and
# $BUILD_DIR/mok_bench_daemon (run_bench.sh builds it; BENCH_BUILD_ONLY=1
# builds it without a GPU). Files: OUTDIR/daemon_{nomps,mps}.{json,log}.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?outdir}; TS=${2:-2048}; DL=${3:-30}; REPS=${4:-10}; WARM=${5:-3}
B=${MOK_DEVBUILD:-.devbuild}
DBIN=${BUILD_DIR:-.benchbuild}/mok_bench_daemon
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
rc=0
for v in nomps mps; do
  if [ $v = mps ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mok-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mok-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "MPS would not start"; rc=1; continue; }
    sleep 1
  fi
  SOCK=/tmp/mok-variant-$$.sock
  "$B/bin/mokd" --engine cuda --socket "$SOCK" --log-level warn >"$OUTDIR/mokd_$v.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do [ -S "$SOCK" ] && break; sleep 0.1; done
  echo "== $v"
  MOK_SOCKET=$SOCK timeout $((DL + 60)) "$DBIN" --out "$OUTDIR/daemon_$v.json" --T "$TS" \
    --deadline "$DL" --reps "$REPS" --warmup "$WARM" 2>&1 | tee "$OUTDIR/daemon_$v.log" |
    grep -E "through mokd|failure" || rc=1
  kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null
  rm -f "$SOCK"
  if [ $v = mps ]; then
    echo quit | nvidia-cuda-mps-control
    sleep 1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
done
exit $rc
