#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The NCCL group module's test (and bench) on the GPU machine (docs/ep_nccl.md).
# Build first (bash tests/gpu/build_nccl_test.sh, no GPU needed), copy .devbuild to
# the machine with the GPUs, then:
#   tests/gpu/run_nccl_tests.sh [--out DIR] [GPUS] [bench]
# GPUS defaults to every GPU (>= 2 needed). NVLink multicast stays off
# (NCCL_NVLS_ENABLE=0). Logs under DIR (default /tmp). Exit status:
# non-zero when any check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${MOK_NCCL_BUILD:-.devbuild/nccl}
OUTDIR=/tmp
if [ "${1:-}" = --out ]; then OUTDIR=${2:?--out needs a folder}; shift 2; fi
LOGDIR=$OUTDIR
export NCCL_NVLS_ENABLE=0
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
W=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)}
lib=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
echo "GPUs: $W; libnccl.so.2: ${lib:-not found by ldconfig}"
if [ -n "$lib" ]; then
  nm -D "$lib" 2>/dev/null | grep -E ' T (ncclGetVersion|ncclCommWindowRegister|ncclTeamLsa|ncclMemAlloc|ncclCommInitRankConfig)$' | awk '{print "  exports", $3}'
fi
rc=0
timeout 300 "$B/test_nccl_group" all "$W" "$B/fake_old/libnccl.so.2" 2>&1 | tee "$LOGDIR/nccl_test.log"
st=${PIPESTATUS[0]}
[ "$st" = 0 ] || rc=1
if [ "$st" != 0 ] && grep -q "== group.*FAIL" "$LOGDIR/nccl_test.log"; then
  echo "-- group failed: again with NCCL_DEBUG=INFO into $LOGDIR/nccl_info.log"
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG,ALLOC,ENV timeout 120 "$B/test_nccl_group" one group "$W" \
    >"$LOGDIR/nccl_info.log" 2>&1
  grep -E "WARN|rank [0-9]\]|FAIL" "$LOGDIR/nccl_info.log" | head -40
fi
if [ "${2:-}" = bench ]; then
  for T in 2048 8192; do
    timeout 120 "$B/test_nccl_group" bench "$W" "$T" 7168 8 2>&1 | tee -a "$LOGDIR/nccl_bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
fi
echo "run_nccl_tests: $([ $rc = 0 ] && echo PASS || echo FAIL)"
exit $rc
