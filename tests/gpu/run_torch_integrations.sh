#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# mok's PyTorch integrations on a GPU machine, in one call:
#   group  tests/gpu/test_torch_group.py under torchrun (2 ranks): mok.torch.MoE on a
#          torch.distributed process group (mok.distributed.join), each rank with its own
#          cuda-engine mokd (rank r's on GPU r % GPUs; one GPU: both on it, under MPS,
#          torch's collectives over gloo, a host group; two or more GPUs: NCCL for both),
#          bitwise equal to EP=1; staged views; a sizing mismatch fails both ranks
#   integ  tests/gpu/test_torch_integrations.py: torchtitan's experts and MoE and
#          transformers' Qwen3-MoE and Mixtral (tiny, random, no download) through mokd
#          against their own experts; staging of views that are not 16-byte aligned
#   example  client/python/examples/hf_transformers_moe.py: 20 training steps of a tiny
#          Qwen3-MoE with its own experts and with mokd's, loss curves within 2e-2
#   fp8acc tests/gpu/fp8_accuracy.py: the FP8 accuracy runs (the example model 300 steps,
#          a tiny Qwen3-MoE through mok.hf_transformers 50 steps, each in bf16 and fp8 from
#          the same start and batches; final losses within 1 % and 2 %), JSON in OUTDIR
# Binaries: $MOK_DEVBUILD (default .devbuild, from tests/gpu/build_device.sh; carry it).
#   tests/gpu/run_torch_integrations.sh OUTDIR [STEP...]
#   STEP: group integ example fp8acc (default all)
# Logs go to OUTDIR. Exit status 0 when every step passed; the last lines are a summary.
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 OUTDIR [group] [integ] [example] [fp8acc]" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUTDIR=$1
shift
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT" || exit 1
B=${MOK_DEVBUILD:-.devbuild}
for f in "$B/bin/mokd" "$B/lib/libmok.so"; do
  [ -e "$f" ] || { echo "$f missing: run tests/gpu/build_device.sh and carry $B" >&2; exit 1; }
done
export LD_LIBRARY_PATH="$ROOT/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
export MOK_LIBRARY="$ROOT/$B/lib/libmok.so" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export MOK_GROUP_DIR=${MOK_GROUP_DIR:-$(mktemp -d /tmp/mok-torch-groups-XXXXXX)}
chmod 700 "$MOK_GROUP_DIR"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)
[ "$GPUS" -ge 1 ] || GPUS=1
summary=()
status=0
record() { summary+=("$1: $2"); [ "$2" = PASS ] || status=1; }

export CUDA_MPS_PIPE_DIRECTORY=/tmp/mok-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mok-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  PIDS=()
}
trap 'cleanup; echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
if ! nvidia-cuda-mps-control -d >"$OUTDIR/mps.log" 2>&1; then
  echo "MPS would not start:"; cat "$OUTDIR/mps.log"; exit 1
fi
sleep 1

start_mokd() { # INDEX GPU: starts mokd, sets SOCK to its socket
  local sock=/tmp/mok-torchint-$$-$1.sock
  rm -f "$sock"
  "$B/bin/mokd" --engine cuda --device "$2" --socket "$sock" --log-level info \
    >>"$OUTDIR/mokd$1.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 300); do
    [ -S "$sock" ] && { SOCK=$sock; return 0; }
    kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "mokd $1 exited at start:"; tail -5 "$OUTDIR/mokd$1.log"; return 1; }
    sleep 0.1
  done
  echo "mokd $1 did not come up"; return 1
}

step_group() {
  echo "== group: torchrun, 2 ranks, $GPUS GPU(s)"
  local socks=() r
  for r in 0 1; do
    start_mokd "$r" $((r % GPUS)) || { cleanup; record group "FAIL (mokd)"; return; }
    socks+=("$SOCK")
  done
  MOK_TEST_SOCKETS=$(IFS=,; echo "${socks[*]}") timeout 400 \
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    tests/gpu/test_torch_group.py "$OUTDIR" 2>&1 | tee "$OUTDIR/test_torch_group.log"
  local rc=${PIPESTATUS[0]}
  cleanup
  grep -q "torch group: PASS" "$OUTDIR/test_torch_group.log" || rc=1
  record group "$([ "$rc" = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_integ() {
  echo "== integ: torchtitan and transformers through mokd"
  start_mokd 9 0 || { cleanup; record integ "FAIL (mokd)"; return; }
  MOK_SOCKET=$SOCK timeout 400 python3 tests/gpu/test_torch_integrations.py 2>&1 \
    | tee "$OUTDIR/test_torch_integrations.log"
  local rc=${PIPESTATUS[0]}
  cleanup
  grep -q "torch integrations: PASS" "$OUTDIR/test_torch_integrations.log" || rc=1
  record integ "$([ "$rc" = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_example() {
  echo "== example: client/python/examples/hf_transformers_moe.py"
  start_mokd 8 0 || { cleanup; record example "FAIL (mokd)"; return; }
  MOK_SOCKET=$SOCK timeout 400 python3 client/python/examples/hf_transformers_moe.py 2>&1 \
    | tee "$OUTDIR/hf_transformers_moe.log"
  local rc=${PIPESTATUS[0]}
  cleanup
  record example "$([ "$rc" = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_fp8acc() {
  echo "== fp8acc: tests/gpu/fp8_accuracy.py (bf16 and fp8 training, final losses)"
  start_mokd 7 0 || { cleanup; record fp8acc "FAIL (mokd)"; return; }
  MOK_SOCKET=$SOCK timeout 500 python3 tests/gpu/fp8_accuracy.py --out "$OUTDIR" 2>&1 \
    | tee "$OUTDIR/fp8_accuracy.log"
  local rc=${PIPESTATUS[0]}
  cleanup
  record fp8acc "$([ "$rc" = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

steps=("$@")
[ ${#steps[@]} = 0 ] && steps=(group integ example fp8acc)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
python3 -c 'import torch; print("torch", torch.__version__)'
for s in "${steps[@]}"; do
  case $s in
    group|integ|example|fp8acc) "step_$s" ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
rm -f "$OUTDIR"/group_rank*.pt
echo
echo "== summary"
for l in "${summary[@]}"; do echo "  $l"; done
[ $status = 0 ] && echo "== ALL PASSED" || echo "== SOME STEPS FAILED"
exit $status
