#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Merge torch_baseline.py's and mok_bench's JSON into the benchmark table (docs/design.md, "Benchmark shapes").

    python3 tests/bench/bench_table.py BASELINE.json MOK.json [--daemon DAEMON.json]
                                       [--out SUMMARY.json]

Plain python3 (no numpy, no torch). Per configuration: ms and TFLOP/s of the
baseline forward/backward and of mok forward/backward, the ratios
mok/baseline (speed-up: baseline ms / mok ms), each rate as % of the dense
bf16 GEMM rate measured in the same run, and the floor: max(FLOPs / dense
rate, bytes / copy bandwidth), with the fewest bytes the layer must move
(each weight read once, each input read once, each output written once,
the saved activations g and u written forward and read backward).
With --daemon (mok_bench_daemon's JSON): the same kernels through mokd, and
the cost of the daemon over the in-process chain in %.
"""
import argparse
import json
import sys

TARGET_FWD_X, TARGET_BWD_X, TARGET_FWD_TF = 1.9, 1.6, 600.0


def load(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        print("bench_table: %s: %s" % (path, e), file=sys.stderr)
        return {}


def min_bytes(r):
    """Fewest bytes one forward / one backward must move (bf16 = 2 B)."""
    T, H, I, K, E_loc, I_s = r["T"], r["H"], r["I"], r["K"], r["E_loc"], r["I_s"]
    TK = T * K
    w = 2.0 * (3 * E_loc * I * H + 3 * I_s * H)       # all weights, once
    tok = 2.0 * T * H                                 # one [T,H] bf16 tensor
    acts = 2.0 * 2 * (TK * I + T * I_s)               # g and u saved (routed + shared)
    small = 4.0 * TK * 2 + 4.0 * TK                   # ids, rw (+ d_rw)
    fwd = w + tok + tok + acts + small                # x in, out
    bwd = w + w + tok * 3 + acts + small              # w in, dw out, x + d_out in, d_x out
    return fwd, bwd


def fmt(v, spec):
    return (spec % v) if isinstance(v, (int, float)) and v == v else "-"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("baseline")
    ap.add_argument("mok")
    ap.add_argument("--daemon", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    B, M = load(a.baseline), load(a.mok)
    DM = load(a.daemon) if a.daemon else {}
    dense = B.get("dense_tflops") or (B.get("dense_start") or {}).get("tflops")
    bw = (B.get("copy") or {}).get("gbps")
    key = lambda r: (r.get("shape"), r.get("T"), r.get("routing"))
    base = {key(r): r for r in B.get("results", []) if "fwd_ms" in r}
    mok = {key(r): r for r in M.get("results", []) if "fwd_ms" in r}
    dmn = {key(r): r for r in DM.get("results", []) if "fwd_ms" in r}
    order = [key(r) for r in B.get("results", [])] + \
        [key(r) for r in M.get("results", []) if key(r) not in base]
    seen, rows = set(), []
    for k in order:
        if k in seen:
            continue
        seen.add(k)
        b, m = base.get(k), mok.get(k)
        r = b or m
        if r is None:
            continue
        f = r["flops_fwd"]
        row = {"shape": k[0], "T": k[1], "routing": k[2],
               "max_over_mean": (b or m).get("max_over_mean")}
        for tag, src in (("base", b), ("mok", m)):
            if src:
                row[tag + "_fwd_ms"], row[tag + "_bwd_ms"] = src["fwd_ms"], src["bwd_ms"]
                row[tag + "_fwd_tflops"] = f / src["fwd_ms"] * 1e-9
                row[tag + "_bwd_tflops"] = 2 * f / src["bwd_ms"] * 1e-9
                if dense:
                    row[tag + "_fwd_pct_dense"] = 100.0 * row[tag + "_fwd_tflops"] / dense
                    row[tag + "_bwd_pct_dense"] = 100.0 * row[tag + "_bwd_tflops"] / dense
        if b:
            row["base_gemm_tflops"] = b.get("gemm_tflops")
        if m:
            row["mok_ok"] = m.get("ok")
            row["mok_fwd_parts_ms"] = m.get("fwd_parts_ms")
            row["mok_bwd_parts_ms"] = m.get("bwd_parts_ms")
        dm = dmn.get(k)
        if dm:
            row["daemon_fwd_ms"], row["daemon_bwd_ms"] = dm["fwd_ms"], dm["bwd_ms"]
            if m:
                row["daemon_fwd_overhead_pct"] = 100.0 * (dm["fwd_ms"] / m["fwd_ms"] - 1.0)
                row["daemon_bwd_overhead_pct"] = 100.0 * (dm["bwd_ms"] / m["bwd_ms"] - 1.0)
        if b and m:
            row["fwd_speedup"] = b["fwd_ms"] / m["fwd_ms"]
            row["bwd_speedup"] = b["bwd_ms"] / m["bwd_ms"]
        if dense and bw:
            bf, bb = min_bytes(r)
            row["floor_fwd_ms"] = max(f / dense * 1e-9, bf / bw * 1e-6)
            row["floor_bwd_ms"] = max(2 * f / dense * 1e-9, bb / bw * 1e-6)
            row["floor_fwd_flop_ms"], row["floor_fwd_byte_ms"] = f / dense * 1e-9, bf / bw * 1e-6
            row["floor_bwd_flop_ms"], row["floor_bwd_byte_ms"] = 2 * f / dense * 1e-9, bb / bw * 1e-6
        rows.append(row)

    print("dense bf16 GEMM 8192^3: %s TFLOP/s (start %s, end %s); d2d copy %s GB/s; torch %s; "
          "baseline check %s" % (
              fmt(dense, "%.1f"), fmt((B.get("dense_start") or {}).get("tflops"), "%.1f"),
              fmt((B.get("dense_end") or {}).get("tflops"), "%.1f"), fmt(bw, "%.0f"),
              B.get("torch", "-"), "passed" if (B.get("check") or {}).get("passed") else "FAILED"))
    hdr = ("%-15s %5s %-8s %5s | %-21s | %-21s | %-21s | %-21s | %5s %5s | %6s | %6s %6s" %
           ("shape", "T", "routing", "max/m", "base fwd ms TF/s %dn", "base bwd ms TF/s %dn",
            "mok fwd ms TF/s %dn", "mok bwd ms TF/s %dn", "fwd x", "bwd x", "gemm", "floorF",
            "floorB"))
    print(hdr)
    print("-" * len(hdr))

    def cell(row, tag, d):
        if tag + "_" + d + "_ms" not in row:
            return "%-21s" % "-"
        return "%7.2f %6.1f %5.1f%%" % (row[tag + "_" + d + "_ms"], row[tag + "_" + d + "_tflops"],
                                        row.get(tag + "_" + d + "_pct_dense", float("nan")))
    for row in rows:
        mm = row.get("max_over_mean") or [float("nan")]
        print("%-15s %5d %-8s %5.2f | %s | %s | %s | %s | %5s %5s | %6s | %6s %6s%s" % (
            row["shape"][:15], row["T"], row["routing"], max(mm),
            cell(row, "base", "fwd"), cell(row, "base", "bwd"), cell(row, "mok", "fwd"),
            cell(row, "mok", "bwd"), fmt(row.get("fwd_speedup"), "%.2f"),
            fmt(row.get("bwd_speedup"), "%.2f"), fmt(row.get("base_gemm_tflops"), "%.0f"),
            fmt(row.get("floor_fwd_ms"), "%.2f"), fmt(row.get("floor_bwd_ms"), "%.2f"),
            "" if row.get("mok_ok", True) else "  (mok check FAILED)"))
    print("x = baseline ms / mok ms (targets: fwd >= %.1f, bwd >= %.1f at T=2048; mok fwd >= %.0f "
          "TF/s at T=8192 on kimi and deepseek); %%dn = %% of the dense bf16 rate; gemm = the "
          "baseline's two forward grouped GEMMs alone, TF/s; floor = max(FLOPs/dense, min bytes/"
          "copy bandwidth), ms" % (TARGET_FWD_X, TARGET_BWD_X, TARGET_FWD_TF))
    parts = [r for r in rows if r.get("mok_fwd_parts_ms")]
    if parts:
        print()
        print("mok steps, ms (TF/s of the expert and shared GEMM steps: routed 6*T*K*H*I, "
              "shared 6*T*H*I_s forward; backward twice)")
        h2 = ("%-15s %5s %-8s | %6s %6s %14s %14s %6s | %6s %14s %14s %6s" % (
            "shape", "T", "routing", "sched", "gather", "expert_fwd", "shared_fwd", "combine",
            "gath_d", "expert_bwd", "shared_bwd", "disp_b"))
        print(h2)
        print("-" * len(h2))
        for row in parts:
            src = mok[(row["shape"], row["T"], row["routing"])]
            f_r = 6.0 * src["T"] * src["K"] * src["H"] * src["I"]
            f_s = 6.0 * src["T"] * src["H"] * src["I_s"]
            fp, bp = row["mok_fwd_parts_ms"], row["mok_bwd_parts_ms"]

            def g(dct, k, fl=None):
                v = dct.get(k)
                if v is None:
                    return "-"
                if fl is None:
                    return "%.3f" % v
                return "%.3f %5.0f" % (v, fl / v * 1e-9 if v > 0 else float("nan"))
            print("%-15s %5d %-8s | %6s %6s %14s %14s %6s | %6s %14s %14s %6s" % (
                row["shape"][:15], row["T"], row["routing"], g(fp, "schedule_build"),
                g(fp, "gather"), g(fp, "expert_forward", f_r), g(fp, "shared_forward", f_s),
                g(fp, "combine"), g(bp, "gather_d_out"), g(bp, "expert_backward", 2 * f_r),
                g(bp, "shared_backward", 2 * f_s), g(bp, "dispatch_backward")))
        print()
    drows = [r for r in rows if "daemon_fwd_ms" in r]
    if drows:
        print("through mokd (%s engine%s): same kernels as one job each, on the client's stream" % (
            DM.get("engine", "?"), ", MPS" if DM.get("mps") else ", no MPS"))
        h3 = "%-15s %5s %-8s | %9s %9s %8s | %9s %9s %8s" % (
            "shape", "T", "routing", "fwd ms", "in-proc", "cost %", "bwd ms", "in-proc", "cost %")
        print(h3)
        print("-" * len(h3))
        for row in drows:
            print("%-15s %5d %-8s | %9.3f %9s %8s | %9.3f %9s %8s" % (
                row["shape"][:15], row["T"], row["routing"], row["daemon_fwd_ms"],
                fmt(row.get("mok_fwd_ms"), "%.3f"), fmt(row.get("daemon_fwd_overhead_pct"), "%+.2f"),
                row["daemon_bwd_ms"], fmt(row.get("mok_bwd_ms"), "%.3f"),
                fmt(row.get("daemon_bwd_overhead_pct"), "%+.2f")))
        print("(target: a job through the daemon costs <= 2% more than in-process)")
        print()
    elif a.daemon:
        print("through mokd: no result (%s)" % (DM.get("note") or "daemon run failed or absent"))
        errs = [r.get("error") for r in DM.get("results", []) if r.get("error")]
        if errs:
            print("  first error: %s" % errs[0])
        print()
    met = []
    for row in rows:
        if row["T"] == 2048 and "fwd_speedup" in row:
            met.append(("fwd x %s %s" % (row["shape"], row["routing"]),
                        row["fwd_speedup"] >= TARGET_FWD_X))
            met.append(("bwd x %s %s" % (row["shape"], row["routing"]),
                        row["bwd_speedup"] >= TARGET_BWD_X))
        if row["T"] == 8192 and row["shape"] in ("kimi-k2.7", "deepseek-v4-pro") \
                and row["routing"] == "balanced" and "mok_fwd_tflops" in row:
            met.append(("fwd TF/s %s T=8192" % row["shape"], row["mok_fwd_tflops"] >= TARGET_FWD_TF))
    print("targets met: %d of %d" % (sum(1 for _, ok in met if ok), len(met)))
    if not a.daemon:
        print("through the daemon: not run (no mokd with the cuda engine, or BENCH_DAEMON=0)")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"dense_tflops": dense, "copy_gbps": bw, "torch": B.get("torch"),
                       "device": B.get("device") or M.get("device"),
                       "baseline_check": B.get("check"), "rows": rows,
                       "targets": [{"what": w, "met": ok} for w, ok in met],
                       "daemon": {"engine": DM.get("engine"), "mps": DM.get("mps"),
                                  "note": DM.get("note")} if DM else None},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
