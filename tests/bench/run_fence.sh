#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The cost of the daemon boundary on a job that does nothing (bench_fence),
# without and with MPS, for two settings of idle-spin-us (how long mokd
# polls its rings before it sleeps).
#   tests/bench/run_fence.sh OUTDIR [N] [SPINS]     SPINS default "50 1000"
# Binaries from tests/gpu/build_device.sh ($MOK_DEVBUILD, default .devbuild).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?outdir}; N=${2:-2000}; SPINS=${3:-50 1000}
B=${MOK_DEVBUILD:-.devbuild}
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
rc=0
for mps in 0 1; do
  if [ $mps = 1 ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mok-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mok-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "MPS would not start"; rc=1; break; }
    sleep 1
  fi
  for spin in $SPINS; do
    SOCK=/tmp/mok-fence-$$.sock
    printf 'idle-spin-us = %s\n' "$spin" >"$OUTDIR/spin.conf"
    "$B/bin/mokd" --engine cuda --socket "$SOCK" --config "$OUTDIR/spin.conf" --log-level warn \
      >"$OUTDIR/mokd_${mps}_$spin.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do [ -S "$SOCK" ] && break; sleep 0.1; done
    echo "== idle-spin-us $spin, MPS $mps"
    MOK_SOCKET=$SOCK timeout 120 "$B/bench/bench_fence" --n "$N" || rc=1
    kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null
    rm -f "$SOCK"
  done
  if [ $mps = 1 ]; then
    echo quit | nvidia-cuda-mps-control
    sleep 1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
done
exit $rc
