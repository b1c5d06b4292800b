#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# mok.torch on a GPU machine, in one call:
#   1. tests/gpu/test_torch_moe.py: MoE vs plain PyTorch, recompute, determinism,
#      .grad accumulation, registration counter vs mokd's count, torch.compile
#      (no graph break, fullgraph, reduce-overhead), CUDA graph capture
#   2. client/python/examples/train_tiny_moe.py: a tiny MoE transformer trained
#      through mokd (loss falls, two runs bitwise equal, pure PyTorch curve), no MPS
#   3. the same example under MPS (step times), unless MPS=0
# Binaries: $MOK_DEVBUILD (default .devbuild, from tests/gpu/build_device.sh),
# else `make`. Logs go to $LOGS (default /tmp/mok-torch-logs) and, with --out DIR,
# are copied to DIR (a few plain files). Exit status 0 when every step passed.
#   tests/gpu/test_torch_train.sh [--out DIR] [STEP...]   STEP: moe train mps (default: all)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
B=${MOK_DEVBUILD:-.devbuild}
LOGS=${LOGS:-/tmp/mok-torch-logs}
OUTDIR=
if [ "${1:-}" = --out ]; then OUTDIR=${2:?--out needs a folder}; shift 2; fi
rm -rf "$LOGS"
mkdir -p "$LOGS"
export LD_LIBRARY_PATH="$ROOT/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
export MOK_LIBRARY="$ROOT/$B/lib/libmok.so" MOKCTL="$ROOT/$B/bin/mokctl"
SOCK=/tmp/mok-torchtest.sock
export MOK_SOCKET=$SOCK
TRAIN_ARGS=${TRAIN_ARGS:-}
STEP_LOGS=$LOGS
# shellcheck source=tests/gpu/steps.sh
. tests/gpu/steps.sh
build_missing "$B/bin/mokd" "$B/bin/mokctl" "$B/lib/libmok.so"

finish() {
  stop_mokd
  stop_mps
  [ -n "$OUTDIR" ] && mkdir -p "$OUTDIR" && cp "$LOGS"/*.log "$LOGS"/*.json "$OUTDIR"/ 2>/dev/null
}
trap finish EXIT

step_moe() {
  note "mok.torch.MoE: correctness, gradients, registrations, torch.compile, CUDA graphs"
  start_mokd || { record moe "FAIL (mokd)"; return; }
  timeout 300 python3 tests/gpu/test_torch_moe.py 2>&1 | tee "$LOGS/torch_moe.log"
  local rc=${PIPESTATUS[0]}
  stop_mokd || { echo "mokd exit status non-zero"; rc=1; }
  record moe "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_train() { # [label]
  local label=${1:-train}
  note "train_tiny_moe.py ($label)"
  start_mokd || { record "$label" "FAIL (mokd)"; return; }
  # shellcheck disable=SC2086
  timeout 300 python3 client/python/examples/train_tiny_moe.py --json "$LOGS/$label.json" \
    $TRAIN_ARGS 2>&1 | tee "$LOGS/$label.log"
  local rc=${PIPESTATUS[0]}
  stop_mokd || { echo "mokd exit status non-zero"; rc=1; }
  record "$label" "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_mps() {
  if start_mps; then
    step_train train_mps
    stop_mps
    sleep 1
  else
    record train_mps "FAIL (MPS)"
  fi
}

steps=("$@")
[ ${#steps[@]} = 0 ] && { steps=(moe train); [ "${MPS:-1}" = 1 ] && steps+=(mps); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1
python3 -c 'import torch; print("torch", torch.__version__)'
for s in "${steps[@]}"; do
  case $s in
    moe|train|mps) "step_$s" ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
echo
note "summary"
for l in "${summary[@]}"; do echo "  $l"; done
[ $status = 0 ] && note "ALL PASSED" || note "SOME STEPS FAILED"
exit $status
