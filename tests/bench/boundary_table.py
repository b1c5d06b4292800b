#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The daemon boundary's table from run_boundary.sh's files: for each
configuration, the layer in one process (mok_bench) against the same layer
through mokd (mok_bench_daemon), forward and backward, and the cost in %.

    boundary_table.py OUTDIR [--inproc KIND] [--markdown]
    boundary_table.py OUTDIR --ab [--markdown]
    boundary_table.py --ab-runs DIR [DIR ...]

--ab: the interleaved files (AB=1 run_boundary.sh: OUTDIR/ab_MODE_KIND.json
from mok_bench_daemon --inproc-ab 1), where both columns come from one
process taking turns rep by rep; the cost there is the ratio of the medians,
and in brackets the median of the per-rep ratios.

--ab-runs: several interleaved runs of the same code (AB=1 RUNS=N
run_boundary.sh, or folders from separate calls): per configuration the
median of the runs' costs, with their range. One run's row scatters by
about +/-1.5 % on an H200 under its power cap; the median over runs is the
figure to hold against a target.
"""
import argparse
import glob
import json
import os
import statistics
import sys


def load(path):
    with open(path) as f:
        doc = json.load(f)
    out = {}
    for r in doc.get("results", []):
        if r.get("ok") and r.get("fwd_ms"):
            out[(r["shape"], r["T"], r["routing"])] = (r["fwd_ms"], r["bwd_ms"],
                                                       r.get("fwd_piped_ms"), r.get("bwd_piped_ms"))
    return out


def ab_table(outdir, md):
    """The interleaved table: one file per mode and client memory."""
    files = sorted(glob.glob(os.path.join(outdir, "ab_*_*.json")),
                   key=lambda p: (os.path.basename(p).startswith("ab_nomps_"), p))
    if not files:
        print("boundary_table: no %s/ab_MODE_KIND.json (AB=1 run_boundary.sh)" % outdir,
              file=sys.stderr)
        return 1
    rc = 0
    for path in files:
        name = os.path.basename(path)[len("ab_"):-len(".json")]
        mode, mem = name.split("_", 1)
        with open(path) as f:
            doc = json.load(f)
        rows = [r for r in doc.get("results", []) if r.get("ok") and "inproc_fwd_ms" in r]
        print("\n%s, interleaved in one process (client memory %s, kernels %s): in-process "
              "against through mokd" % ("under MPS" if mode == "mps" else "without MPS", mem,
                                        doc.get("inproc_kernels", "?")))
        if md:
            print("| shape | T | routing | in-process fwd | mokd fwd | cost (paired) "
                  "| in-process bwd | mokd bwd | cost (paired) | same output |")
            print("|---|---|---|---|---|---|---|---|---|---|")
        for r in sorted(rows, key=lambda r: (r["T"], r["shape"], r["routing"])):
            same = "yes" if r.get("same_output") else "NO"
            cells = (r["shape"], r["T"], r["routing"], r["inproc_fwd_ms"], r["fwd_ms"],
                     r["overhead_fwd_pct"], r["paired_fwd_pct"], r["inproc_bwd_ms"], r["bwd_ms"],
                     r["overhead_bwd_pct"], r["paired_bwd_pct"], same)
            if md:
                print("| %s | %d | %s | %.3f | %.3f | %+.1f %% (%+.1f %%) | %.3f | %.3f "
                      "| %+.1f %% (%+.1f %%) | %s |" % cells)
            else:
                print("  %-16s T=%-5d %-8s fwd %8.3f -> %8.3f ms %+6.1f %% (%+6.1f %%)   "
                      "bwd %8.3f -> %8.3f ms %+6.1f %% (%+6.1f %%)   same output %s" % cells)
            if not r.get("same_output"):
                rc = 1
        bad = [r for r in doc.get("results", []) if not r.get("ok")]
        for r in bad:
            print("  %s T=%d %s FAILED: %s" % (r["shape"], r["T"], r["routing"], r.get("error", "")))
            rc = 1
        if not rows:
            print("  (no configuration)")
            rc = 1
            continue
        for what in ("fwd", "bwd"):
            c = [r["overhead_%s_pct" % what] for r in rows]
            p = [r["paired_%s_pct" % what] for r in rows]
            print("  %s: cost median %+.1f %%, worst %+.1f %%; paired median %+.1f %%, worst %+.1f %%"
                  "; %d of %d rows at or under +2 %%"
                  % ("forward" if what == "fwd" else "backward", statistics.median(c), max(c),
                     statistics.median(p), max(p), sum(1 for x in c if x <= 2.0), len(c)))
    return rc


def ab_runs_table(dirs):
    """Per mode, client memory and configuration: the median over the runs
    of each run's cost, forward and backward."""
    runs = {}  # (mode, mem) -> [{config: (fwd %, bwd %)}] one dict a run
    for d in dirs:
        files = glob.glob(os.path.join(d, "ab_*_*.json"))
        if not files:
            print("boundary_table: no %s/ab_MODE_KIND.json" % d, file=sys.stderr)
            return 1
        for path in files:
            mode, mem = os.path.basename(path)[len("ab_"):-len(".json")].split("_", 1)
            with open(path) as f:
                doc = json.load(f)
            costs = {(r["shape"], r["T"], r["routing"]): (r["overhead_fwd_pct"],
                                                          r["overhead_bwd_pct"])
                     for r in doc.get("results", [])
                     if r.get("ok") and "inproc_fwd_ms" in r and r.get("same_output")}
            runs.setdefault((mode, mem), []).append(costs)
    rc = 0
    for (mode, mem), per_run in sorted(runs.items(), key=lambda kv: (kv[0][0] != "mps", kv[0])):
        configs = sorted(set().union(*per_run), key=lambda k: (k[1], k[0], k[2]))
        print("\n%s, client memory %s: through mokd against in-process, %d interleaved runs "
              "(median of the runs' costs, their range)"
              % ("under MPS" if mode == "mps" else "without MPS", mem, len(per_run)))
        med = {"fwd": [], "bwd": []}
        for key in configs:
            got = [r[key] for r in per_run if key in r]
            if len(got) < len(per_run):
                rc = 1  # a run without this configuration (failed, or outputs differed)
            cells = []
            for i, what in enumerate(("fwd", "bwd")):
                v = [g[i] for g in got]
                m = statistics.median(v)
                med[what].append(m)
                cells.append("%s %+5.1f %% (%+.1f .. %+.1f)" % (what, m, min(v), max(v)))
            print("  %-16s T=%-5d %-8s %s   %s%s" % (key[0], key[1], key[2], cells[0], cells[1],
                  "" if len(got) == len(per_run) else "   (%d of %d runs)" % (len(got),
                                                                         len(per_run))))
        for what in ("fwd", "bwd"):
            m = med[what]
            if m:
                print("  %s: median %+.1f %%, worst row %+.1f %%; %d of %d rows at or under +2 %%"
                      % ("forward" if what == "fwd" else "backward", statistics.median(m), max(m),
                         sum(1 for x in m if x <= 2.0), len(m)))
    return rc


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--inproc", default="own")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--ab", action="store_true")
    ap.add_argument("--ab-runs", nargs="+", metavar="DIR")
    args = ap.parse_args(argv[1:])
    if args.ab_runs:
        return ab_runs_table(args.ab_runs)
    if not args.outdir:
        ap.error("OUTDIR, or --ab-runs DIR...")
    if args.ab:
        return ab_table(args.outdir, args.markdown)
    outdir, kind, md = args.outdir, args.inproc, args.markdown
    rc, found = 0, False
    for mode in ("mps", "nomps"):
        ip = os.path.join(outdir, "inproc_%s_%s.json" % (mode, kind))
        if not os.path.exists(ip):
            continue
        base, found = load(ip), True
        for dp in sorted(glob.glob(os.path.join(outdir, "daemon_%s_*.json" % mode))):
            mem = os.path.basename(dp)[len("daemon_%s_" % mode):-len(".json")]
            thru = load(dp)
            print("\n%s: in-process (--memory %s) against through mokd (client memory %s)"
                  % ("under MPS" if mode == "mps" else "without MPS", kind, mem))
            if md:
                print("| shape | T | routing | in-process fwd | mokd fwd | cost | in-process bwd | mokd bwd | cost |")
                print("|---|---|---|---|---|---|---|---|---|")
            worst = [None, None]
            for key in sorted(base, key=lambda k: (k[1], k[0], k[2])):
                if key not in thru:
                    continue
                (f0, b0, _, _), (f1, b1, fp, bp) = base[key], thru[key]
                cf, cb = 100 * (f1 / f0 - 1), 100 * (b1 / b0 - 1)
                piped = ("   piped: fwd %+5.1f %% bwd %+5.1f %%" % (100 * (fp / f0 - 1), 100 * (bp / b0 - 1))
                         if fp and bp else "")
                worst = [max(w, c) if w is not None else c for w, c in zip(worst, (cf, cb))]
                if md:
                    print("| %s | %d | %s | %.3f | %.3f | %+.1f %% | %.3f | %.3f | %+.1f %% |"
                          % (key[0], key[1], key[2], f0, f1, cf, b0, b1, cb))
                else:
                    print("  %-16s T=%-5d %-8s fwd %8.3f -> %8.3f ms %+6.1f %%   bwd %8.3f -> %8.3f ms %+6.1f %%%s"
                          % (key[0], key[1], key[2], f0, f1, cf, b0, b1, cb, piped))
            if worst[0] is None:
                print("  (no configuration in both files)")
                rc = 1
            else:
                print("  worst: forward %+.1f %%, backward %+.1f %%" % tuple(worst))
    if not found:
        print("boundary_table: no %s/inproc_{mps,nomps}_%s.json" % (outdir, kind), file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv))
