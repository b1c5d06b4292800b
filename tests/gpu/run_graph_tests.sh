#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CUDA graphs and torch.compile(fullgraph=True) through mokd, on a GPU machine, in one call
# (docs/cuda.md "Capture and replay"):
#   1. test_standing on the cuda engine (the CI test of standing jobs, host-triggered)
#   2. tests/gpu/test_graphs.py bitwise: a captured training step replayed 200 times,
#      losses and weights bitwise equal to eager (under MPS)
#   3. test_graphs.py compile: fullgraph=True and reduce-overhead follow eager (under MPS)
#   4. test_graphs.py kill: mokd killed during replays -> an error within the timeout
#   5. test_graphs.py bench: step time eager vs captured, mokd vs the PyTorch layer (MPS)
#   6. fp8: test_graphs.py fp8 (under MPS): the example model with fp8 MoE layers, a
#      captured training step replayed 50 times with optimizer steps between replays
#      (and inside the graph), losses, gradients and weights bitwise equal to eager; a
#      captured forward replayed after in-place master changes; compile and
#      reduce-overhead (test_standing, step 1, runs the quantising forward too)
#   7. ep: an expert-parallel group (EP=2) of two mokd on one GPU under MPS:
#      test_standing_ep on the cuda engine (standing jobs of group layers, host-triggered),
#      then tests/gpu/test_graphs_ep.py (a captured training step with two group layers
#      replayed 50 times per rank, losses and weights bitwise equal to eager)
# Binaries: $MOK_DEVBUILD (default .devbuild, tests/gpu/build_device.sh), else `make`.
#   tests/gpu/run_graph_tests.sh OUTDIR [STEP...]   STEP: standing bitwise compile kill bench fp8 ep
# Logs and a summary go to OUTDIR. Exit 0 when every step passed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUTDIR=${1:?usage: run_graph_tests.sh OUTDIR [STEP...]}
shift
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT"
B=${MOK_DEVBUILD:-.devbuild}
export LD_LIBRARY_PATH="$ROOT/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH="$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
export MOK_LIBRARY="$ROOT/$B/lib/libmok.so" MOKD_BIN="$ROOT/$B/bin/mokd" LOGS="$OUTDIR"
SOCK=/tmp/mok-graphs.sock
export MOK_SOCKET=$SOCK
STEP_LOGS=$OUTDIR
# shellcheck source=tests/gpu/steps.sh
. tests/gpu/steps.sh
build_missing "$B/bin/mokd" "$B/lib/libmok.so" "$B/tests/test_standing" "$B/tests/test_standing_ep"

finish() {
  stop_mokd
  stop_mps
  # leftovers of this script only (the kill step's own mokd socket)
  rm -f /tmp/mok-graphs-kill.sock "$SOCK"
  { for l in "${summary[@]}"; do echo "$l"; done; } >"$OUTDIR/summary.txt"
}
trap finish EXIT

step_standing() {
  note "test_standing on the cuda engine"
  MOK_TEST_ENGINE=cuda MOK_BUILD="$B" timeout 300 "$B/tests/test_standing" 2>&1 | tee "$OUTDIR/standing.log"
  local rc=${PIPESTATUS[0]}
  record standing "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_py() { # name args...
  local name=$1
  shift
  note "test_graphs.py $name $*"
  start_mokd || { record "$name" "FAIL (mokd)"; return; }
  timeout 600 python3 tests/gpu/test_graphs.py "$name" "$@" 2>&1 | tee "$OUTDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  stop_mokd || { echo "mokd exit status non-zero"; rc=1; }
  record "$name" "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_kill() {
  note "test_graphs.py kill (its own mokd, killed during replays)"
  timeout 300 python3 tests/gpu/test_graphs.py kill 2>&1 | tee "$OUTDIR/kill.log"
  local rc=${PIPESTATUS[0]}
  record kill "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_ep() {
  note "test_standing_ep on the cuda engine (EP=2, two mokd on one GPU, MPS)"
  MOK_TEST_ENGINE=cuda MOK_BUILD="$B" timeout 300 "$B/tests/test_standing_ep" 2>&1 |
    tee "$OUTDIR/standing_ep.log"
  local rc=${PIPESTATUS[0]}
  record standing_ep "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
  note "test_graphs_ep.py (EP=2 on one GPU: its own two mokd, MPS)"
  timeout 600 python3 tests/gpu/test_graphs_ep.py --mokd "$ROOT/$B/bin/mokd" --world 2 \
    --replays 50 --logs "$OUTDIR" 2>&1 | tee "$OUTDIR/graphs_ep.log"
  rc=${PIPESTATUS[0]}
  record graphs_ep "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

steps=("$@")
[ ${#steps[@]} = 0 ] && steps=(standing bitwise compile kill bench fp8 ep)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1
python3 -c 'import torch; print("torch", torch.__version__)'
for s in "${steps[@]}"; do
  case $s in
    standing) step_standing ;;
    bitwise) start_mps; step_py bitwise --replays 200; stop_mps ;;
    compile) start_mps; step_py compile --steps 30; stop_mps ;;
    kill) step_kill ;;
    bench) start_mps; step_py bench --steps 100; stop_mps ;;
    fp8) start_mps; step_py fp8 --replays 50 --steps 20; stop_mps ;;
    ep) start_mps; step_ep; stop_mps ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
echo
note "summary"
for l in "${summary[@]}"; do echo "  $l"; done
[ $status = 0 ] && note "ALL PASSED" || note "SOME STEPS FAILED"
exit $status
