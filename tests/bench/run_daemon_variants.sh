#!/usr/bin/env bash
# The cost of going through mokd under different settings (issue 4's "<= 2%"
# target): mok_bench_daemon against a fresh mokd for each variant
#   nomps-stage0, mps-stage1, mps-stage0   (stage: MOK_CUDA_STAGE_WEIGHTS)
# (nomps-stage1 is run_bench.sh's own daemon column). Compare each with
# run_bench.sh's in-process mok.json of the same run.
#   tests/bench/run_daemon_variants.sh OUTDIR [T_LIST] [DEADLINE_S]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?outdir}; TS=${2:-2048}; DL=${3:-30}
B=${MOK_DEVBUILD:-.devbuild}
DBIN=${BUILD_DIR:-.benchbuild}/mok_bench_daemon
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mok-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mok-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
rc=0
for v in nomps-stage0 mps-stage1 mps-stage0; do
  mps=0; [ "${v%%-*}" = mps ] && mps=1
  stage=${v##*stage}
  [ $mps = 1 ] && { nvidia-cuda-mps-control -d || { echo "MPS would not start"; rc=1; continue; }; }
  SOCK=/tmp/mok-variant-$$.sock
  MOK_CUDA_STAGE_WEIGHTS=$stage "$B/bin/mokd" --engine cuda --socket "$SOCK" --log-level warn \
    >"$OUTDIR/mokd_$v.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do [ -S "$SOCK" ] && break; sleep 0.1; done
  echo "== $v"
  MOK_SOCKET=$SOCK timeout $((DL + 120)) "$DBIN" --out "$OUTDIR/daemon_$v.json" --T "$TS" \
    --deadline "$DL" 2>&1 | tee "$OUTDIR/daemon_$v.log" | grep -vi "^#" | tail -12 || rc=1
  kill -TERM $pid; wait $pid 2>/dev/null
  rm -f "$SOCK"
  [ $mps = 1 ] && echo quit | nvidia-cuda-mps-control
done
exit $rc
