#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The multi-GPU EP run (one mokd per GPU), one command on a machine with
# several GPUs:   tests/bench/run_ep_multi.sh [--out DIR] [T_LIST] [SHAPES]
# 1. the EP integration tests with the daemons spread over the GPUs
#    (correctness against EP=1, bitwise; peer failures)
# 2. the data path alone: pull/push across GPUs (bench_ep_cuda kernels)
# 3. the distributed layer through mokd at the benchmark shapes (docs/design.md), per rank, with
#    the EP=1 slice of the same run (bench_ep_cuda daemon)
# 4. the PyTorch baseline: all_to_all_single around the same layer
#    (tests/bench/torch_ep_baseline.py under torchrun)
# 5. a table of mok against the baseline. JSON and logs under DIR (default ./ep-multi).
# NCCL_NVLS_ENABLE=0 throughout (no NVLink multicast).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
B=${MOK_DEVBUILD:-.devbuild}
OUTDIR=ep-multi
if [ "${1:-}" = --out ]; then OUTDIR=${2:?--out needs a folder}; shift 2; fi
TS=${1:-2048,8192}
SHAPES=${2:-kimi-k2.7,glm-5.2,qwen3.5-397b,deepseek-v4-pro}
W=$(nvidia-smi -L | wc -l)
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rc=0
echo "== 1. EP tests, $W GPUs"
tests/gpu/run_ep_tests.sh "$W" >"$OUTDIR/ep_tests.txt" 2>&1 || rc=1
tail -2 "$OUTDIR/ep_tests.txt"
echo "== 2. data path across GPUs"
for T in ${TS//,/ }; do
  "$B/bench/bench_ep_cuda" kernels "$W" "$T" 7168 8 "$W" | tee -a "$OUTDIR/ep_kernels.txt" || rc=1
done
echo "== 3. the distributed layer through mokd (EP=$W)"
declare -A DIMS=([kimi-k2.7]="7168 2048 384 8" [glm-5.2]="6144 2048 256 8"
                 [qwen3.5-397b]="4096 1024 512 10" [deepseek-v4-pro]="7168 3072 384 6")
for T in ${TS//,/ }; do
  for s in ${SHAPES//,/ }; do
    read -r H I E K <<<"${DIMS[$s]}"
    echo "-- $s T=$T"
    "$B/bench/bench_ep_cuda" daemon "$B/bin/mokd" "$W" "$T" "$H" "$I" "$E" "$K" "$W" \
      | sed "s/^JSON {/JSON {\"shape\": \"$s\", /" | tee -a "$OUTDIR/ep_daemon.txt" || rc=1
  done
done
echo "== 4. PyTorch baseline (all_to_all_single), EP=$W"
python3 -m torch.distributed.run --standalone --nproc_per_node="$W" \
  tests/bench/torch_ep_baseline.py --T "$TS" --shapes "$SHAPES" --out "$OUTDIR/torch_ep.json" \
  2>&1 | grep -v "^W[0-9]* \|OMP_NUM_THREADS\|^\*\*\*" | tee "$OUTDIR/torch_ep.txt" || rc=1
echo "== 5. table"
python3 - "$OUTDIR" <<'PY' || rc=1
import json, sys, os
d = sys.argv[1]
mok = [json.loads(l[5:]) for l in open(os.path.join(d, "ep_daemon.txt")) if l.startswith("JSON ")]
tor = json.load(open(os.path.join(d, "torch_ep.json")))["results"]
tb = {}
for r in tor:
    w = max(r["ranks"], key=lambda g: g["fwd_ms"] + g["bwd_ms"])
    tb[(w["shape"], w["T"])] = w
print(f"{'shape':16s} {'T':>5s} | {'mok fwd ms':>10s} {'bwd ms':>8s} | {'torch fwd':>9s} {'bwd':>8s} | "
      f"{'fwd x':>6s} {'bwd x':>6s} | {'torch a2a GB/s disp/comb':>24s}")
for m in mok:
    t = tb.get((m["shape"], m["T"]))
    if not t:
        continue
    print(f"{m['shape']:16s} {m['T']:5d} | {m['ep_fwd_ms']:10.3f} {m['ep_bwd_ms']:8.3f} | "
          f"{t['fwd_ms']:9.3f} {t['bwd_ms']:8.3f} | {t['fwd_ms']/m['ep_fwd_ms']:6.2f} "
          f"{t['bwd_ms']/m['ep_bwd_ms']:6.2f} | {t['dispatch_GBps']:11.1f} {t['combine_GBps']:11.1f}")
PY
exit $rc
