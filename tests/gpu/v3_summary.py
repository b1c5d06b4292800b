#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The compact table of one tests/gpu/run_kernels_v3.sh run.

    v3_summary.py OUTDIR [--shape kimi-k2.7 --T 8192]

Reads from OUTDIR: steps.tsv (each step's exit status and seconds), the
test logs, mok.json (mok_bench --variants) and ncu.csv (ncu --page raw
--csv of `test_gemm_sm90 profile`), prints three tables: the tests, the
layer per tile variant (forward / backward ms and TFLOP/s, the GEMM steps,
the speed-up over the rows variant, whether every variant gave the same
bits), and per GEMM kernel the achieved TFLOP/s, SM clock, L2 hit rate
and throughput, DRAM bytes against the unique bytes, and the top stall
reasons. Writes the same to OUTDIR/summary.txt. Exit status 0 when every
step passed and every bitwise check held.
"""
import argparse
import csv
import json
import os
import re
import sys

# the benchmark shapes (docs/design.md) per GPU (E_loc, H, I, K): tests/harness/model_shapes.h
# (tests/python/test_model_shapes.py holds this copy to it)
SHAPES = {
    "kimi-k2.7": (48, 7168, 2048, 8),
    "glm-5.2": (32, 6144, 2048, 8),
    "qwen3.5-397b": (64, 4096, 1024, 10),
    "deepseek-v4-pro": (48, 7168, 3072, 6),
}
# the GEMM launches of one `profile` pass, in order
PRODUCTS = ["gate_up", "down", "down_dgrad", "gu_dgrad", "wgrad_down", "wgrad_gu"]


def product_cost(name, E, H, I, K, T):
    """(FLOPs, unique bytes) of one product at balanced routing (T*K real rows)."""
    r = T * K
    w = E * H * I * 2  # one weight tensor, bf16
    return {
        "gate_up": (2 * r * H * 2 * I, r * H * 2 + 2 * w + 3 * r * I * 2),
        "down": (2 * r * I * H, r * I * 2 + w + r * H * 2),
        "down_dgrad": (2 * r * H * I, r * H * 2 + w + 2 * r * I * 2 + 3 * r * I * 2),
        "gu_dgrad": (2 * r * 2 * I * H, r * 2 * I * 2 + 2 * w + r * H * 2),
        "wgrad_down": (2 * r * H * I, r * H * 2 + r * I * 2 + w),
        "wgrad_gu": (2 * r * 2 * I * H, r * 2 * I * 2 + r * H * 2 + 2 * w),
    }[name]


def num(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return None


def read_steps(out):
    steps = []
    path = os.path.join(out, "steps.tsv")
    if os.path.exists(path):
        for line in open(path):
            f = line.rstrip("\n").split("\t")
            if len(f) >= 3:
                steps.append((f[0], f[1], f[2], f[3] if len(f) > 3 else ""))
    return steps


def last_line(path, pattern):
    if not os.path.exists(path):
        return ""
    hit = ""
    for line in open(path, errors="replace"):
        if re.search(pattern, line):
            hit = line.strip()
    return hit


def bench_table(out, lines):
    path = os.path.join(out, "mok.json")
    if not os.path.exists(path):
        lines.append("bench: no mok.json")
        return False
    try:
        doc = json.load(open(path))
    except ValueError as e:
        lines.append(f"bench: mok.json unreadable ({e})")
        return False
    rows = {}
    variants = []
    for r in doc.get("results", []):
        key = (r["shape"], r["T"], r["routing"])
        rows.setdefault(key, {})[r["variant"]] = r
        if r["variant"] not in variants:
            variants.append(r["variant"])
    ok = True
    lines.append("layer (mok_bench, in-process; ms (TFLOP/s); x = rows ms / variant ms; "
                 "GEMM steps: expert_forward / expert_backward ms)")
    head = f"{'shape':16s} {'T':>5s} {'variant':8s} {'fwd':>16s} {'x':>5s} {'bwd':>16s} {'x':>5s} " \
           f"{'exp_fwd':>8s} {'exp_bwd':>8s}  checks"
    lines.append(head)
    for key in sorted(rows, key=lambda k: (k[1], k[0], k[2])):
        base = rows[key].get("rows")
        for v in variants:
            r = rows[key].get(v)
            if not r:
                continue
            fx = base["fwd_ms"] / r["fwd_ms"] if base and r["fwd_ms"] > 0 else 0
            bx = base["bwd_ms"] / r["bwd_ms"] if base and r["bwd_ms"] > 0 else 0
            checks = "ok" if r["ok"] else (
                f"FAIL status {r['status']} det {r['deterministic']} "
                f"same {r.get('same_as_first_variant')} nonfinite {r['nonfinite']}")
            ok = ok and r["ok"]
            goal = " >=600" if key[1] >= 8192 and r["fwd_tflops"] >= 600 else ""
            lines.append(
                f"{key[0]:16s} {key[1]:5d} {v:8s} {r['fwd_ms']:7.3f} ({r['fwd_tflops']:5.1f}) "
                f"{fx:5.2f} {r['bwd_ms']:7.3f} ({r['bwd_tflops']:5.1f}) {bx:5.2f} "
                f"{r['fwd_parts_ms']['expert_forward']:8.3f} {r['bwd_parts_ms']['expert_backward']:8.3f}"
                f"  {checks}{goal}")
    hashes = {}
    for key, per in rows.items():
        hs = {r.get("hash0") for r in per.values() if r.get("hash0") is not None}
        hashes[key] = len(hs) <= 1
    if not all(hashes.values()):
        ok = False
        lines.append("BITWISE: variants differ at " +
                     ", ".join(f"{k[0]} T={k[1]}" for k, same in hashes.items() if not same))
    else:
        lines.append(f"bitwise: every variant gave the same hashes at all {len(rows)} configurations")
    return ok


def ncu_table(out, shape, T, lines):
    path = os.path.join(out, "ncu.csv")
    if not os.path.exists(path):
        lines.append("ncu: no ncu.csv")
        return
    text = [l for l in open(path, errors="replace") if l.startswith('"')]
    rd = list(csv.reader(text))
    if len(rd) < 3:
        lines.append("ncu: no kernels in ncu.csv")
        return
    head, units, data = rd[0], rd[1], rd[2:]  # second row: units
    col = {h: i for i, h in enumerate(head)}
    # ncu picks a unit per metric (ms, Ghz, Gbyte, ...): back to ns, Hz, bytes
    scale = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6,
             "s": 1e9, "second": 1e9, "hz": 1, "khz": 1e3, "mhz": 1e6, "ghz": 1e9,
             "byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12}
    E, H, I, K = SHAPES.get(shape, SHAPES["kimi-k2.7"])
    variants = []
    vfile = os.path.join(out, "ncu_variants.txt")
    if os.path.exists(vfile):
        variants = open(vfile).read().strip().split(",")
    lines.append(f"ncu, {shape} T={T}, one launch each (--clock-control none): ms, TFLOP/s, SM GHz, "
                 "L2 hit %, L2 / DRAM throughput % of peak, DRAM GB (x unique), top stalls")

    def get(row, *names):
        for n in names:
            if n in col and col[n] < len(row):
                v = num(row[col[n]])
                if v is not None:
                    u = units[col[n]].strip().lower() if col[n] < len(units) else ""
                    return v * scale.get(u, 1)
        return None

    for i, row in enumerate(data):
        kname = row[col["Kernel Name"]] if "Kernel Name" in col else "?"
        prod = PRODUCTS[i % len(PRODUCTS)]
        var = variants[i // len(PRODUCTS)] if i // len(PRODUCTS) < len(variants) else "?"
        kind = "cutls" if "device_kernel" in kname else "pairs" if "pairs" in kname else "ctas"
        ns = get(row, "gpu__time_duration.sum")
        hz = get(row, "sm__cycles_elapsed.avg.per_second")
        hit = get(row, "lts__t_sector_hit_rate.pct")
        l2 = get(row, "lts__throughput.avg.pct_of_peak_sustained_elapsed")
        dr = get(row, "dram__throughput.avg.pct_of_peak_sustained_elapsed")
        rb = get(row, "dram__bytes_read.sum") or 0
        wb = get(row, "dram__bytes_write.sum") or 0
        flops, unique = product_cost(prod, E, H, I, K, T)
        stalls = []
        for h, j in col.items():
            m = re.search(r"issue_stalled_(.+?)(_per_|\.)", h)
            if m and "not_selected" not in h and j < len(row):
                v = num(row[j])
                if v is not None and m.group(1) != "selected":
                    stalls.append((v, m.group(1)))
        stalls.sort(reverse=True)
        seen, top = set(), []
        for v, n in stalls:
            if n not in seen:
                seen.add(n)
                top.append(f"{n} {v:.2f}")
            if len(top) == 3:
                break
        ms = ns * 1e-6 if ns else 0
        tf = flops / (ns * 1e-9) * 1e-12 if ns else 0

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"

        lines.append(
            f"{var:8s} {prod:10s} {kind:5s} {ms:7.3f} ms {tf:6.1f} TF/s {f(hz and hz * 1e-9, '4.2f')} GHz "
            f"hit {f(hit, '5.1f')} L2 {f(l2, '5.1f')} DRAM {f(dr, '5.1f')} "
            f"{(rb + wb) * 1e-9:6.2f} GB (x{(rb + wb) / unique:4.1f})  {'; '.join(top)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="kimi-k2.7")
    ap.add_argument("--T", type=int, default=8192)
    a = ap.parse_args()
    lines = ["== v3 kernels: summary of " + a.out]
    ok = True
    lines.append("steps (exit status, seconds, last result line):")
    for name, rc, secs, note in read_steps(a.out):
        res = last_line(os.path.join(a.out, name + ".log"),
                        r"passed|FAILED|ALL|failed a check|failures|differ")
        lines.append(f"  {name:22s} rc {rc:>4s} {secs:>5s} s  {note}{res[:110]}")
        if rc not in ("0", "skip"):
            ok = False
    lines.append("")
    ok = bench_table(a.out, lines) and ok
    lines.append("")
    ncu_table(a.out, a.shape, a.T, lines)
    lines.append("")
    lines.append("RESULT: " + ("all steps passed, all variants bitwise equal" if ok else "SOME CHECK FAILED"))
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    with open(os.path.join(a.out, "summary.txt"), "w") as fh:
        fh.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
