#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One line per profiled kernel from ncu's CSV details pages (`ncu --csv --page details`
with the SpeedOfLight, ComputeWorkloadAnalysis and WarpStateStats sections and the metric
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed; any other output
of the profiled program mixed in is skipped): time, SM clock, TFLOP/s where the kernel's
FLOPs are known, tensor pipe busy, issue slots busy, warp cycles per issued instruction,
DRAM and L2 throughput, and the stall ncu's rule names first. Kernels shorter than
--min-us are left out.

  ncu_table.py [--rows R --H H --I I] [--min-us 50] FILE.csv...

FILE may be gzipped (.gz). A file named [...]ncu_ex68_<product>.csv holds CUTLASS example
68 at that product's shape (tests/bench/ncu_fp8_gemms.sh); with --rows/--H/--I (the layer's
routed rows a GPU and expert shape) its kernel gets the product's FLOPs.
"""
import argparse
import csv
import gzip
import os
import re
import sys

STALL = re.compile(r"spends ([\d.]+) cycles being stalled (.*?)\. .*?represents about ([\d.]+)%")


def num(s):
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def kernels(path):
    """Yield (kernel name, {metric name: value}, [rule descriptions]) per profiled kernel,
    in launch order, for every process whose page the file holds."""
    header, cur, key = None, None, None
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        for line in f:
            if not line.startswith('"'):
                continue
            row = next(csv.reader([line]))
            if row and row[0] == "ID":
                if cur:
                    yield cur
                header, cur, key = row, None, None
                continue
            if header is None or len(row) < len(header) - 5:
                continue
            rec = dict(zip(header, row))
            if rec["ID"] != key:
                if cur:
                    yield cur
                key, cur = rec["ID"], (rec["Kernel Name"], {}, [])
            if rec.get("Metric Name"):
                cur[1][rec["Metric Name"]] = (rec["Metric Value"], rec.get("Metric Unit", ""))
            if rec.get("Rule Description"):
                cur[2].append(rec["Rule Description"])
    if cur:
        yield cur


def short(name):
    """The function, with CUTLASS's kernel schedule when it has one."""
    base = re.sub(r"^void\s+", "", name.split("(")[0])
    func = re.sub(r"<.*", "", base).split("::")[-1] or base[:40]
    m = re.search(r"Kernel(?:PtrArray)?TmaWarpSpecialized(\w+)", base)
    return func + ("[" + m.group(1)[:36] + "]" if m else "")


def value(m, name, scale=1.0):
    v = num(m.get(name, (None,))[0])
    return None if v is None else v * scale


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--H", type=int)
    ap.add_argument("--I", type=int)
    ap.add_argument("--min-us", type=float, default=50.0)
    a = ap.parse_args()
    flops = {}
    if a.rows and a.H and a.I:
        f = 2.0 * a.rows * a.H * a.I
        flops = {"gate_up": 2 * f, "down": f, "down_dgrad": f, "gate_up_dgrad": 2 * f}
    cols = ("#", "kernel", "ms", "GHz", "TFLOP/s", "tensor%", "issue%", "cyc/iss", "dram%", "l2%")
    print("%-4s %-52s %8s %5s %7s %7s %6s %7s %5s %5s  %s" % (cols + ("first stall (share)",)))
    n = 0
    for path in a.files:
        m = re.search(r"ncu_ex68_(\w+)\.csv$", os.path.basename(path))
        product = m.group(1) if m else None
        for name, met, rules in kernels(path):
            ms = value(met, "Duration", 1e-6)  # ns
            if ms is None or ms * 1e3 < a.min_us:
                continue
            n += 1
            ghz = value(met, "SM Frequency", 1e-9)
            fl = flops.get(product)
            stall = ""
            for t in rules:
                s = STALL.search(t)
                if s:
                    stall = "%s (%s%%)" % (s.group(2)[:60], s.group(3))
                    break
            label = ("ex68 " + product) if product else short(name)
            fmt = lambda v, f: f % v if v is not None else "-"
            print("%-4d %-52s %8.3f %5s %7s %7s %6s %7s %5s %5s  %s" % (
                n, label[:52], ms, fmt(ghz, "%.2f"), "%.0f" % (fl / ms * 1e-9) if fl else "-",
                fmt(value(met, "sm__pipe_tensor_op_hmma_cycles_active.avg."
                               "pct_of_peak_sustained_elapsed"), "%.1f"),
                fmt(value(met, "Issue Slots Busy"), "%.1f"),
                fmt(value(met, "Warp Cycles Per Issued Instruction"), "%.1f"),
                fmt(value(met, "DRAM Throughput"), "%.0f"),
                fmt(value(met, "L2 Cache Throughput"), "%.0f"), stall))
    if not n:
        print("no kernel found in", " ".join(a.files))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
