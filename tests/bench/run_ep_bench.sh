#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The EP bench on a machine with a GPU, one command:
#   tests/bench/run_ep_bench.sh [--out DIR] [GPUS] [W] [T] [H] [I] [E] [K]
# 1. the data path in one process (bench_ep_cuda kernels: pull, push, barrier)
# 2. W mokd + W clients, forward/backward per rank against the EP=1 slice in
#    the same run, and a restarted client's first job (bench_ep_cuda daemon).
# With one GPU the ranks share it under MPS. Output: stdout and DIR/ep_bench.json
# (DIR default ./ep-bench).
# Expects tests/gpu/build_device.sh's build in $MOK_DEVBUILD (.devbuild).
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${MOK_DEVBUILD:-.devbuild}
OUTDIR=ep-bench
if [ "${1:-}" = --out ]; then OUTDIR=${2:?--out needs a folder}; shift 2; fi
GPUS=${1:-1}; W=${2:-4}; T=${3:-2048}; H=${4:-4096}; I=${5:-1024}; E=${6:-64}; K=${7:-8}
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ "$GPUS" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mok-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mok-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
  nvidia-cuda-mps-control -d || { echo "MPS would not start"; exit 1; }
fi
rc=0
"$B/bench/bench_ep_cuda" kernels "$W" "$T" 7168 "$K" | tee "$OUTDIR/ep_kernels.txt" || rc=1
"$B/bench/bench_ep_cuda" daemon "$B/bin/mokd" "$W" "$T" "$H" "$I" "$E" "$K" "$GPUS" \
  | tee "$OUTDIR/ep_daemon.txt" || rc=1
grep -h '^JSON ' "$OUTDIR"/ep_kernels.txt "$OUTDIR"/ep_daemon.txt | sed 's/^JSON //' \
  | python3 -c 'import json,sys; print(json.dumps([json.loads(l) for l in sys.stdin], indent=1))' \
  >"$OUTDIR/ep_bench.json" || rc=1
exit $rc
