# SPDX-License-Identifier: Apache-2.0
"""boundary_table.py --ab-runs: per configuration, the median of several
interleaved runs' costs, on files written here (no GPU)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(REPO, "tests", "bench", "boundary_table.py")


def write_run(folder, rows):
    """rows: (shape, T, fwd %, bwd %, same output) as mok_bench_daemon
    --inproc-ab writes them"""
    os.makedirs(folder)
    results = [{"shape": s, "T": t, "routing": "balanced", "ok": True, "inproc_fwd_ms": 1.0,
                "inproc_bwd_ms": 2.0, "fwd_ms": 1.0 + f / 100, "bwd_ms": 2.0 * (1 + b / 100),
                "overhead_fwd_pct": f, "overhead_bwd_pct": b, "paired_fwd_pct": f,
                "paired_bwd_pct": b, "same_output": same} for s, t, f, b, same in rows]
    with open(os.path.join(folder, "ab_mps_cudamalloc.json"), "w") as f:
        json.dump({"inproc_ab": True, "results": results}, f)


def run_table(*folders):
    return subprocess.run([sys.executable, TABLE, "--ab-runs", *folders], capture_output=True,
                          text=True)


def test_the_median_of_the_runs_per_row(tmp_path):
    # one row over +2 % in one run out of three: its median is under
    write_run(tmp_path / "r1", [("a", 2048, 2.6, 0.5, True), ("b", 8192, 1.1, 3.0, True)])
    write_run(tmp_path / "r2", [("a", 2048, 1.2, 0.7, True), ("b", 8192, 1.5, 2.5, True)])
    write_run(tmp_path / "r3", [("a", 2048, 1.9, 0.6, True), ("b", 8192, 1.0, 2.2, True)])
    got = run_table(tmp_path / "r1", tmp_path / "r2", tmp_path / "r3")
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    row_a = next(l for l in lines if l.strip().startswith("a "))
    assert "fwd  +1.9 % (+1.2 .. +2.6)" in row_a and "bwd  +0.6 % (+0.5 .. +0.7)" in row_a
    row_b = next(l for l in lines if l.strip().startswith("b "))
    assert "bwd  +2.5 % (+2.2 .. +3.0)" in row_b
    assert "forward: median +1.5 %, worst row +1.9 %; 2 of 2 rows at or under +2 %" in got.stdout
    assert "backward: median +1.6 %, worst row +2.5 %; 1 of 2 rows at or under +2 %" in got.stdout
    assert "3 interleaved runs" in got.stdout


def test_a_run_whose_outputs_differed_fails_the_table(tmp_path):
    write_run(tmp_path / "r1", [("a", 2048, 1.0, 1.0, True)])
    write_run(tmp_path / "r2", [("a", 2048, 1.0, 1.0, False)])
    got = run_table(tmp_path / "r1", tmp_path / "r2")
    assert got.returncode == 1
    assert "(1 of 2 runs)" in got.stdout


def test_a_folder_without_runs_is_an_error(tmp_path):
    write_run(tmp_path / "r1", [("a", 2048, 1.0, 1.0, True)])
    os.makedirs(tmp_path / "empty")
    got = run_table(tmp_path / "r1", tmp_path / "empty")
    assert got.returncode == 1
    assert "no " in got.stderr and "ab_MODE_KIND.json" in got.stderr
