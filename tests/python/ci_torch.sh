#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# mok's PyTorch parts on a CPU machine: makes a virtual environment in OUTDIR with
# torch (CPU use of the PyPI build), numpy, pytest and transformers, then runs the
# torch tests of tests/python against the build in $MOK_BUILD (default build/; make it
# first): mok.distributed over gloo with cpu-engine mokd daemons, mok.torchtitan and
# mok.hf_transformers against their references, mok.torch's import rules and staging,
# mok.torch.MoE(dtype="fp8") on CPU tensors with a cpu-engine mokd (test_torch_fp8.py),
# the transformers and torchtitan runners in fp8 and bf16 on it
# (test_torch_integrations_fp8.py), mok.torch's cache of standing jobs and check_graphs
# (test_torch_standing_cache.py).
#   tests/python/ci_torch.sh OUTDIR        (about 65 s to install, 60 s to run)
# Environment: TORCH_VERSION (2.11.0), TRANSFORMERS_VERSION (5.24.0; "none" skips it),
# PIP_ARGS (extra pip arguments). Logs: OUTDIR/pip.log, OUTDIR/pytest.log. Exit status
# 0 when every test passed; the last line is pytest's summary.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUTDIR=$1
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
VENV=$OUTDIR/venv
BUILD=${MOK_BUILD:-build}
for f in "$BUILD/lib/libmok.so" "$BUILD/bin/mokd"; do
  [ -e "$ROOT/$f" ] || [ -e "$f" ] || { echo "$f missing: run make first" >&2; exit 1; }
done
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.24.0}
pkgs=("torch==$TORCH_VERSION" numpy pytest)
[ "$TRANSFORMERS_VERSION" = none ] || pkgs+=("transformers==$TRANSFORMERS_VERSION")
if [ ! -x "$VENV/bin/pip" ]; then # none yet, or one left half made
  python3 -m venv --clear "$VENV"
fi
# shellcheck disable=SC2086
if ! "$VENV/bin/pip" install --disable-pip-version-check ${PIP_ARGS:-} "${pkgs[@]}" \
    >"$OUTDIR/pip.log" 2>&1; then
  tail -20 "$OUTDIR/pip.log"
  echo "pip install failed (log: $OUTDIR/pip.log)" >&2
  exit 1
fi
cd "$ROOT"
# a private group directory for the daemons' segments (as tests/run_tests.sh does)
if [ -z "${MOK_GROUP_DIR:-}" ]; then
  MOK_GROUP_DIR=$(mktemp -d /tmp/mok-ci-torch-groups-XXXXXX)
  export MOK_GROUP_DIR
  trap 'rm -rf "$MOK_GROUP_DIR"' EXIT
fi
export MOK_BUILD="$BUILD" GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
set +e
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs \
  tests/python/test_torch_distributed.py tests/python/test_torch_integrations_cpu.py \
  tests/python/test_torch_import.py tests/python/test_torch_compile.py tests/python/test_torch_fp8.py \
  tests/python/test_torch_integrations_fp8.py tests/python/test_torch_standing_cache.py \
  tests/python/test_binding.py 2>&1 | tee "$OUTDIR/pytest.log"
rc=${PIPESTATUS[0]}
# a skip here means a missing piece, not a passing test
if grep -q "SKIPPED" "$OUTDIR/pytest.log"; then
  echo "ci_torch: tests were skipped (see above); counted as a failure" >&2
  [ "$rc" = 0 ] && rc=1
fi
exit "$rc"
