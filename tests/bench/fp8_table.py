#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The fp8 layer beside the bf16 one and the PyTorch baseline, from one run_bench.sh run.

  fp8_table.py BASELINE.json MOK_FP8.json [--out FILE.json]

BASELINE.json: torch_baseline.py's; MOK_FP8.json: mok_bench --variants VARIANT,fp8 (the
bf16 layer on VARIANT and the fp8 layer on the same inputs, taking turns rep by rep).
Prints per configuration the three layers' forward and backward ms, fp8's speed-up over
bf16 (bf16 ms / fp8 ms) and over the baseline, each path's workspace, and the targets of
docs/math.md "FP8": at T=8192 on kimi-k2.7 and deepseek-v4-pro fp8 >= 1.6x bf16 forward
and >= 1.4x backward; at T=2048 >= 1.4x forward on every shape."""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("baseline")
    ap.add_argument("mok")
    ap.add_argument("--out")
    a = ap.parse_args()
    B, M = json.load(open(a.baseline)), json.load(open(a.mok))
    key = lambda r: (r.get("shape"), r.get("T"), r.get("routing"))
    base = {key(r): r for r in B.get("results", []) if "fwd_ms" in r}
    bf16, fp8 = {}, {}
    for r in M.get("results", []):
        if "fwd_ms" not in r or not r.get("ok"):
            continue
        (fp8 if r.get("variant") == "fp8" else bf16)[key(r)] = r
    rows, misses = [], []
    hdr = ("%-16s %5s %-8s | %8s %8s | %8s %8s | %8s %8s | %6s %6s | %6s %6s | %7s %7s" %
           ("shape", "T", "routing", "base fwd", "bwd", "bf16 fwd", "bwd", "fp8 fwd", "bwd",
            "fwd x", "bwd x", "vs base", "", "ws bf16", "ws fp8"))
    print(hdr)
    print("-" * len(hdr))
    for k in [key(r) for r in M.get("results", []) if r.get("variant") == "fp8"]:
        if k not in bf16 or k not in fp8:
            continue
        b, f, t = bf16[k], fp8[k], base.get(k, {})
        fx, bx = b["fwd_ms"] / f["fwd_ms"], b["bwd_ms"] / f["bwd_ms"]
        tf = t.get("fwd_ms", float("nan")) / f["fwd_ms"]
        tb = t.get("bwd_ms", float("nan")) / f["bwd_ms"]
        row = dict(shape=k[0], T=k[1], routing=k[2], base_fwd_ms=t.get("fwd_ms"),
                   base_bwd_ms=t.get("bwd_ms"), bf16_fwd_ms=b["fwd_ms"], bf16_bwd_ms=b["bwd_ms"],
                   fp8_fwd_ms=f["fwd_ms"], fp8_bwd_ms=f["bwd_ms"], fp8_fwd_speedup=fx,
                   fp8_bwd_speedup=bx, fp8_vs_base_fwd=tf, fp8_vs_base_bwd=tb,
                   bf16_ws_bytes=b.get("ws_bytes"), fp8_ws_bytes=f.get("ws_bytes"),
                   fp8_fwd_parts_ms=f.get("fwd_parts_ms"), fp8_bwd_parts_ms=f.get("bwd_parts_ms"))
        rows.append(row)
        gib = lambda v: "%7.2f" % (v / 2**30) if v else "      ?"
        print("%-16s %5d %-8s | %8.3f %8.3f | %8.3f %8.3f | %8.3f %8.3f | %6.2f %6.2f | %6.2f %6.2f "
              "| %s %s" % (k[0], k[1], k[2], t.get("fwd_ms", float("nan")),
                           t.get("bwd_ms", float("nan")), b["fwd_ms"], b["bwd_ms"], f["fwd_ms"],
                           f["bwd_ms"], fx, bx, tf, tb, gib(b.get("ws_bytes")),
                           gib(f.get("ws_bytes"))))
        if k[1] == 8192 and k[0] in ("kimi-k2.7", "deepseek-v4-pro"):
            if fx < 1.6:
                misses.append("%s T=%d %s fwd %.2fx < 1.6x" % (k[0], k[1], k[2], fx))
            if bx < 1.4:
                misses.append("%s T=%d %s bwd %.2fx < 1.4x" % (k[0], k[1], k[2], bx))
        if k[1] == 2048 and fx < 1.4:
            misses.append("%s T=%d %s fwd %.2fx < 1.4x" % (k[0], k[1], k[2], fx))
    print("x = bf16 ms / fp8 ms (the same run, rep by rep); vs base = baseline ms / fp8 ms; "
          "ws = the workspace each layer's launchers take, GiB (fp8: with its quantised rows)")
    print("targets: %s" % ("all met" if not misses and rows else "; ".join(misses) or "no rows"))
    if a.out:
        json.dump(dict(rows=rows, targets_missed=misses), open(a.out, "w"), indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
