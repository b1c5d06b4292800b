# SPDX-License-Identifier: Apache-2.0
"""fp8_table.py: the fp8 layer's speed-ups over the bf16 layer and the baseline, and the
FP8 targets it checks, on files written here (no GPU)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(REPO, "tests", "bench", "fp8_table.py")


def write(tmp_path, rows):
    """rows: (shape, T, bf16 fwd, bf16 bwd, fp8 fwd, fp8 bwd) ms; the baseline at 2x bf16"""
    base, mok = [], []
    for s, t, bf, bb, ff, fb in rows:
        key = dict(shape=s, T=t, routing="balanced")
        base.append(dict(key, fwd_ms=2 * bf, bwd_ms=2 * bb))
        mok.append(dict(key, variant="pingpong", ok=True, fwd_ms=bf, bwd_ms=bb, ws_bytes=2**30))
        mok.append(dict(key, variant="fp8", ok=True, fwd_ms=ff, bwd_ms=fb, ws_bytes=2**31))
    # a later fp8 result of qwen that failed a check: left out, never a speed-up
    mok.append(dict(shape="qwen3.5-397b", T=2048, routing="balanced", variant="fp8", ok=False,
                    fwd_ms=0.1, bwd_ms=0.1))
    pb, pm = tmp_path / "baseline.json", tmp_path / "mok_fp8.json"
    pb.write_text(json.dumps({"results": base}))
    pm.write_text(json.dumps({"results": mok}))
    return pb, pm


def run(pb, pm, out):
    return subprocess.run([sys.executable, TABLE, str(pb), str(pm), "--out", str(out)],
                          capture_output=True, text=True)


def test_speedups_and_the_targets_each_configuration_misses(tmp_path):
    pb, pm = write(tmp_path, [("kimi-k2.7", 8192, 10.0, 20.0, 6.0, 15.0),  # 1.67x, 1.33x
                              ("qwen3.5-397b", 2048, 3.0, 6.0, 2.0, 6.0),  # 1.5x
                              ("deepseek-v4-pro", 2048, 4.0, 8.0, 3.2, 8.0)])  # 1.25x
    got = run(pb, pm, tmp_path / "fp8.json")
    assert got.returncode == 0, got.stderr
    js = json.loads((tmp_path / "fp8.json").read_text())
    rows = {(r["shape"], r["T"]): r for r in js["rows"]}
    assert set(rows) == {("kimi-k2.7", 8192), ("qwen3.5-397b", 2048), ("deepseek-v4-pro", 2048)}
    k = rows[("kimi-k2.7", 8192)]
    assert abs(k["fp8_fwd_speedup"] - 10 / 6) < 1e-9 and abs(k["fp8_vs_base_bwd"] - 40 / 15) < 1e-9
    assert abs(rows[("qwen3.5-397b", 2048)]["fp8_fwd_speedup"] - 1.5) < 1e-9
    assert js["targets_missed"] == ["kimi-k2.7 T=8192 balanced bwd 1.33x < 1.4x",
                                    "deepseek-v4-pro T=2048 balanced fwd 1.25x < 1.4x"]
    assert "targets: kimi-k2.7 T=8192 balanced bwd 1.33x < 1.4x" in got.stdout


def test_all_met_and_no_rows(tmp_path):
    pb, pm = write(tmp_path, [("kimi-k2.7", 8192, 10.0, 20.0, 6.0, 14.0)])
    got = run(pb, pm, tmp_path / "a.json")
    assert got.returncode == 0 and "targets: all met" in got.stdout
    pb.write_text(json.dumps({"results": []}))
    pm.write_text(json.dumps({"results": []}))
    got = run(pb, pm, tmp_path / "b.json")
    assert got.returncode == 1 and "targets: no rows" in got.stdout
