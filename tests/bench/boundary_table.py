#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The daemon boundary's table from run_boundary.sh's files: for each
configuration, the layer in one process (mok_bench) against the same layer
through mokd (mok_bench_daemon), forward and backward, and the cost in %.

    boundary_table.py OUTDIR [--inproc KIND] [--markdown]
"""
import glob
import json
import os
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


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    outdir, kind, md = argv[1], "own", "--markdown" in argv
    if "--inproc" in argv:
        kind = argv[argv.index("--inproc") + 1]
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
