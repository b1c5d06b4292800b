#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The metrics test against the real Prometheus parser, in a venv of its own:
#   tests/python/ci_metrics.sh OUTDIR
# makes OUTDIR/venv (prometheus_client, numpy, pytest from PyPI), then runs
# tests/python/test_metrics.py against the build in $MOK_BUILD (default
# build/; run make first). Writes OUTDIR/test_metrics.log and
# OUTDIR/test_metrics.xml (JUnit); exits non-zero when a test failed or
# was skipped (here prometheus_client is installed, so nothing may skip).
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
out=$1
cd "$(dirname "$0")/../.."
build=${MOK_BUILD:-build}
for f in "$build/bin/mokd" "$build/lib/libmok.so"; do
  [ -e "$f" ] || { echo "ci_metrics: $f is missing: run make first" >&2; exit 1; }
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
python=${PYTHON:-python3}
if [ ! -x "$out/venv/bin/python" ]; then
  "$python" -m venv "$out/venv"
fi
"$out/venv/bin/pip" install --quiet --disable-pip-version-check prometheus_client numpy pytest
"$out/venv/bin/python" -c 'import prometheus_client; print("prometheus_client", prometheus_client.__version__ if hasattr(prometheus_client, "__version__") else "")'
set +e
MOK_BUILD="$build" "$out/venv/bin/python" -m pytest -v -p no:cacheprovider -rs \
  --junitxml="$out/test_metrics.xml" tests/python/test_metrics.py 2>&1 | tee "$out/test_metrics.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -eq 0 ] && grep -q "SKIPPED" "$out/test_metrics.log"; then
  echo "ci_metrics: a test was skipped although prometheus_client is installed" >&2
  rc=1
fi
exit "$rc"
