#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Expert parallelism on the cuda engine (docs/ep.md): the EP integration
# tests (tests/integration/test_ep.c) with every daemon on the cuda engine,
# under MPS so that the members' kernels run at the same time, then
# mok.torch.MoE on a group (tests/gpu/test_torch_ep.py) when torch is there.
#   tests/gpu/run_ep_tests.sh [--out DIR] [GPUS]     GPUS: daemons spread over this many GPUs
# Expects the build of tests/gpu/build_device.sh in $MOK_DEVBUILD (.devbuild).
# Logs go to DIR (default ./ep-logs).
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${MOK_DEVBUILD:-.devbuild}
OUTDIR=ep-logs
if [ "${1:-}" = --out ]; then OUTDIR=${2:?--out needs a folder}; shift 2; fi
LOGS=$OUTDIR
GPUS=${1:-1}
mkdir -p "$LOGS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mok-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mok-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
if ! nvidia-cuda-mps-control -d >"$LOGS/mps.log" 2>&1; then
  echo "MPS would not start:"; cat "$LOGS/mps.log"; exit 1
fi
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rc=0
MOK_BUILD="$B" MOK_TEST_ENGINE=cuda MOK_TEST_GPUS="$GPUS" "$B/tests/test_ep" "${@:2}" \
  2>&1 | tee "$LOGS/test_ep_cuda_gpus$GPUS.txt" || rc=1
grep -q " 0 failed" "$LOGS/test_ep_cuda_gpus$GPUS.txt" || rc=1
# mok.torch.MoE on a group: EP=2 and (several daemons per GPU, MPS) EP=4
if python3 -c "import torch" 2>/dev/null; then
  for W in 2 4; do
    PYTHONPATH="$PWD/$B/python${PYTHONPATH:+:$PYTHONPATH}" MOK_LIBRARY="$PWD/$B/lib/libmok.so" PYTHONUNBUFFERED=1 \
      python3 tests/gpu/test_torch_ep.py "$PWD/$B/bin/mokd" $W 2>&1 | tee "$LOGS/test_torch_ep_$W.txt"
    grep -q "torch EP: PASS" "$LOGS/test_torch_ep_$W.txt" || rc=1
  done
fi
# on failure, the daemons' logs of the tests that left them
if [ $rc != 0 ]; then
  for f in /tmp/mok-test-*/mokd.log; do
    [ -f "$f" ] && cp "$f" "$LOGS/$(basename "$(dirname "$f")").log"
  done
fi
exit $rc
