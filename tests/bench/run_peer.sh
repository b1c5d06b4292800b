#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# mok through mokd beside SonicMoE, on one GPU, in one process (tests/bench/peer_sonic.py):
# under MPS, one mokd per GEMM variant named in VARIANTS (each started with
# MOK_GEMM_VARIANT=that variant), every configuration's paths taking turns rep by rep.
#
#   tests/bench/run_peer.sh OUTDIR [peer_sonic.py options...]
#
# OUTDIR gets peer.json, peer.txt (the table) and the daemons' logs. SonicMoE must be
# importable (pip install sonic-moe); without it the mok paths run alone.
# Environment: MOK_DEVBUILD (the build with bin/mokd and lib/libmok.so; default .devbuild,
# see tests/gpu/build_device.sh), VARIANTS (default "pingpong cutlass"), PYTHON,
# MOKD_LOG_LEVEL (default warn; info with MOK_CUDA_PROFILE=1 logs each job's phases).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?usage: run_peer.sh OUTDIR [peer_sonic.py options...]}
shift
B=${MOK_DEVBUILD:-.devbuild}
VARIANTS=${VARIANTS:-pingpong cutlass}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
[ -x "$B/bin/mokd" ] || { echo "run_peer.sh: no $B/bin/mokd (tests/gpu/build_device.sh builds it)"; exit 2; }
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$PWD/$B/python${PYTHONPATH:+:$PYTHONPATH}"
export MOK_LIBRARY="$PWD/$B/lib/libmok.so"
export NCCL_NVLS_ENABLE=0
STEP_LOGS=$OUTDIR
# shellcheck source=tests/gpu/steps.sh
. tests/gpu/steps.sh # start_mps, stop_mps
pids=()
socks=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -f "${socks[@]}"
  stop_mps
}
trap cleanup EXIT
start_mps || exit 1
args=()
for v in $VARIANTS; do
  sock=$(mktemp -u /tmp/mok-peer-$v.XXXXXX.sock)
  MOK_GEMM_VARIANT=$v "$B/bin/mokd" --engine cuda --socket "$sock" --log-level "${MOKD_LOG_LEVEL:-warn}" \
    >"$OUTDIR/mokd_$v.log" 2>&1 &
  pids+=($!)
  socks+=("$sock")
  for _ in $(seq 1 600); do
    [ -S "$sock" ] && break
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "mokd ($v) exited:"; tail -5 "$OUTDIR/mokd_$v.log"; exit 1; }
    sleep 0.1
  done
  [ -S "$sock" ] || { echo "mokd ($v) did not come up"; exit 1; }
  args+=(--mok "$v=$sock")
done
PYTHONUNBUFFERED=1 "$PYTHON" tests/bench/peer_sonic.py --out "$OUTDIR/peer.json" "${args[@]}" "$@" \
  >"$OUTDIR/peer.log" 2>&1
rc=$?
sed -n '/^shape /,$p' "$OUTDIR/peer.log" | tee "$OUTDIR/peer.txt"
[ $rc = 0 ] || tail -20 "$OUTDIR/peer.log"
exit $rc
