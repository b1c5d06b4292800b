#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""mok through mokd beside SonicMoE, in one process, taking turns rep by rep.

    python3 tests/bench/peer_sonic.py --out FILE.json [--mok NAME=SOCKET ...]
        [--only SHAPES] [--T 2048,8192] [--routing balanced,skewed]
        [--reps 10] [--warmup 3] [--deadline SECONDS] [--sonic-tune narrow|full]
        [--start idle|queued|idle,queued]
        [--kernels FILE]

SonicMoE (`pip install sonic-moe`; Dao-AILab, QuACK's CuTe DSL GEMMs) is the
fastest public MoE training layer for Hopper. Each configuration (the four
benchmark shapes of docs/design.md as one GPU of EP8 holds them, no shared
expert) runs on the same routing, weights, inputs and output gradient through
every path: mok.torch.MoE on each mokd named by --mok (one mokd per kernel
variant, say; default: $MOK_SOCKET as "mok") and SonicMoE's fixed-top-k path
on that routing (its router metadata, then its up and down projections, as
its moe_TC_softmax_topk_layer does after the top-k). Per rep every path runs
one forward and one backward, timed by CUDA events, the paths' order rotating
from rep to rep; the median of the reps after the warm-up is reported, as
TFLOP/s by 6*T*K*H*I forward and twice that backward. --start queued puts
about 3 ms of GPU work ahead of each forward (as a training step's earlier
layers do), so the forward's time is the GPU time it adds; idle (the default)
starts it on an idle GPU, where the time to submit it counts too. Each
path's out and d_x are checked against the first path's (max|a-b| / max|b| under 2e-2: both
round to bf16 at different points) and must be finite.

SonicMoE autotunes each GEMM at its first use of a shape (minutes; QuACK
keeps the results under QUACK_CACHE_DIR). --sonic-tune narrow (the default)
limits it to the Hopper tiles SonicMoE's own notes name for these products:
128x256 cooperative, 128x192 and 128x128 ping-pong, each in 2x1 and 1x2
clusters; full keeps QuACK's whole list. The JSON says which.

Without SonicMoE importable the mok paths still run, and the table says so.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
if os.path.isdir(os.path.join(ROOT, "client", "python")):
    sys.path.insert(1, os.path.join(ROOT, "client", "python"))

from torch_baseline import EP, SHAPE, SHAPES, make_routing  # noqa: E402

NARROW = {(128, 256, False), (128, 192, True), (128, 128, True)}


def load_sonic(tune):
    """SonicMoE's pieces, or (None, why). QuACK's config list is narrowed before
    its GEMM interface is first imported (its autotuners read it then)."""
    try:
        import quack.gemm_config as gc
        if tune == "narrow":
            full = gc.get_all_configs

            def narrowed(epilogue=None, tune_coop=True):
                return [c for c in full(epilogue, tune_coop)
                        if c.device_capacity == 9 and not c.swap_ab and
                        (c.tile_m, c.tile_n, c.pingpong) in NARROW]
            gc.get_all_configs = narrowed
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import _DownProjection, _UpProjection
        from sonicmoe.functional.triton_kernels import TC_topk_router_metadata_triton
    except Exception as e:  # noqa: BLE001 - any failure means "no peer here"
        return None, "%s: %s" % (type(e).__name__, e)
    return (ActivationType, _UpProjection, _DownProjection, TC_topk_router_metadata_triton), ""


class SonicPath:
    """SonicMoE on given routing: w1 [E, 2I, H] (gate rows, then up rows:
    concat_layout) and w2 [E, H, I] as its (2I, H, E) and (H, I, E) views."""

    def __init__(self, parts, w_gate, w_up, w_down):
        self.act, self.up, self.down, self.meta = parts
        self.w1 = torch.nn.Parameter(torch.cat([w_gate, w_up], dim=1))
        self.w2 = torch.nn.Parameter(w_down.clone())
        self.E = w_gate.shape[0]

    def params(self):
        return [self.w1, self.w2]

    def __call__(self, x, ids, rw):
        T, K = ids.shape
        E, dev = self.E, ids.device
        TK = T * K
        i32 = dict(dtype=torch.int32, device=dev)
        s_scatter, s_rev = torch.empty(TK, **i32), torch.empty(TK, **i32)
        freq, freq_off = torch.empty(E, **i32), torch.empty(E + 1, **i32)
        x_gather = torch.empty(TK, **i32)
        self.meta(ids, E, freq, freq_off, x_gather, s_scatter, s_rev)
        a, h = self.up.apply(x, self.w1.permute(1, 2, 0), None, freq_off, TK, K, x_gather,
                             s_scatter, s_rev, None, False, self.act.SWIGLU, False, True)
        return self.down.apply(a, h, self.w2.permute(1, 2, 0), None, rw, freq_off, T, K,
                               x_gather, s_scatter, s_rev, None, False, self.act.SWIGLU)


class MokPath:
    def __init__(self, client, H, I, E, K, w_gate, w_up, w_down):
        import mok.torch as mt
        self.m = mt.MoE(H, I, E, K, shared_intermediate=0, device="cuda", client=client)
        with torch.no_grad():
            self.m.w_gate.copy_(w_gate)
            self.m.w_up.copy_(w_up)
            self.m.w_down.copy_(w_down)

    def params(self):
        return list(self.m.parameters())

    def __call__(self, x, ids, rw):
        return self.m(x, ids, rw)


def run_once(path, x, ids, rw, d_out, ahead=None):
    """One forward and one backward, each timed by events; (fwd ms, bwd ms, out, d_x).
    ahead: a function that queues GPU work before the forward's first event (the
    "queued" start), else the forward starts on an idle GPU."""
    for p in path.params():
        p.grad = None
    xx = x.detach().requires_grad_(True)
    rr = rw.detach().requires_grad_(True)
    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    if ahead:
        ahead()
    e[0].record()
    out = path(xx, ids, rr)
    e[1].record()
    out.backward(d_out)
    e[2].record()
    torch.cuda.synchronize()
    return e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2]), out.detach(), xx.grad


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def profile_kernels(paths, x, ids, rw, d_out, out_file):
    """One forward and backward of each path under torch.profiler: its GPU kernels in order."""
    from torch.profiler import ProfilerActivity, profile
    rows = []
    for pname, path in paths:
        run_once(path, x, ids, rw, d_out)
        torch.cuda.profiler.start()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_once(path, x, ids, rw, d_out)
        torch.cuda.profiler.stop()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                rows.append({"path": pname, "kernel": ev.name, "us": ev.device_time})
    with open(out_file, "w") as f:
        json.dump(rows, f, indent=0)
    for pname, _ in paths:
        mine = [r for r in rows if r["path"] == pname]
        print("kernels of %s (%d, %.1f us in all):" % (pname, len(mine), sum(r["us"] for r in mine)))
        for r in mine:
            print("  %9.1f us  %s" % (r["us"], r["kernel"][:150]))


def queue_ahead(dev):
    """GPU work to queue before a path's forward (the "queued" start): two 8192^3 bf16
    products, about 3 ms on an H200, longer than any path's host-side submission, as
    when a training step's earlier layers keep the GPU busy. The forward's time is then
    the GPU time it adds; on an idle GPU it also holds the host's time to start it."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def ahead():
        a @ a
        a @ a
    return ahead


def run_config(name, T, routing, paths_spec, sonic_parts, reps, warmup, seed=0, kernels="",
               start="idle"):
    _, E, H, I, K = SHAPE[name]
    E_loc = E // EP
    dev = "cuda"
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    ids, rw = make_routing(T, E_loc, K, routing, gen, dev)
    bf = torch.bfloat16
    x = (torch.randn(T, H, generator=gen, device=dev) * 0.5).to(bf)
    d_out = (torch.randn(T, H, generator=gen, device=dev) * 0.05).to(bf)
    s = 1.0 / H ** 0.5
    w_gate = (torch.randn(E_loc, I, H, generator=gen, device=dev) * s).to(bf)
    w_up = (torch.randn(E_loc, I, H, generator=gen, device=dev) * s).to(bf)
    w_down = (torch.randn(E_loc, H, I, generator=gen, device=dev) * (1.0 / I ** 0.5)).to(bf)
    paths = []
    for pname, client in paths_spec:
        paths.append((pname, MokPath(client, H, I, E_loc, K, w_gate, w_up, w_down)))
    if sonic_parts:
        paths.append(("sonic", SonicPath(sonic_parts, w_gate, w_up, w_down)))
    del w_gate, w_up, w_down
    ahead = queue_ahead(dev) if start == "queued" else None
    times = {p: ([], []) for p, _ in paths}
    outs = {}
    t_first = {}
    for r in range(warmup + reps):
        order = paths[r % len(paths):] + paths[:r % len(paths)]
        for pname, path in order:
            t0 = time.time()
            f, b, out, dx = run_once(path, x, ids, rw, d_out, ahead)
            if pname not in t_first:
                t_first[pname] = time.time() - t0
            if r >= warmup:
                times[pname][0].append(f)
                times[pname][1].append(b)
            if r == warmup + reps - 1:
                outs[pname] = (out, dx)
    if kernels:
        profile_kernels(paths, x, ids, rw, d_out, kernels)
    fl = 6.0 * T * K * H * I
    res = {"shape": name, "T": T, "routing": routing, "start": start, "E_loc": E_loc, "H": H,
           "I": I, "K": K,
           "hottest_over_mean": float(torch.bincount(ids.flatten().long(), minlength=E_loc).max()
                                      * E_loc / (T * K)),
           "paths": {}}
    ref_name = paths[0][0]
    for pname, _ in paths:
        fm, bm = statistics.median(times[pname][0]), statistics.median(times[pname][1])
        out, dx = outs[pname]
        finite = bool(torch.isfinite(out).all() and torch.isfinite(dx).all())
        e_out = rel(out, outs[ref_name][0])
        e_dx = rel(dx, outs[ref_name][1])
        res["paths"][pname] = {
            "fwd_ms": fm, "bwd_ms": bm, "fwd_tflops": fl / fm / 1e9, "bwd_tflops": 2 * fl / bm / 1e9,
            # rep by rep (after the warm-up): a GPU that heats up under the load shows here
            "fwd_ms_reps": times[pname][0], "bwd_ms_reps": times[pname][1],
            "first_call_s": t_first[pname], "finite": finite,
            "rel_out_vs_" + ref_name: e_out, "rel_dx_vs_" + ref_name: e_dx,
            "ok": finite and e_out < 2e-2 and e_dx < 2e-2}
    del paths, outs
    torch.cuda.empty_cache()
    return res


def table(results, sonic_note):
    lines = []
    names = []
    for r in results:
        for p in r["paths"]:
            if p not in names:
                names.append(p)
    hdr = "%-16s %5s %-8s %-6s" % ("shape", "T", "routing", "start")
    for p in names:
        hdr += " | %-10s fwd / bwd TF/s" % p[:10]
    mok_names = [p for p in names if p != "sonic"]
    if "sonic" in names:
        for p in mok_names:
            hdr += " | %s/sonic fwd bwd" % p[:10]
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for r in results:
        row = "%-16s %5d %-8s %-6s" % (r["shape"], r["T"], r["routing"], r["start"])
        for p in names:
            v = r["paths"].get(p)
            row += " | %10s %6.1f / %6.1f%s" % ("", v["fwd_tflops"], v["bwd_tflops"],
                                                 "" if v["ok"] else " !") if v else " | %26s" % "-"
        if "sonic" in r["paths"]:
            s = r["paths"]["sonic"]
            for p in mok_names:
                v = r["paths"].get(p)
                row += " | %10s %5.2f %5.2f" % ("", s["fwd_ms"] / v["fwd_ms"], s["bwd_ms"] / v["bwd_ms"]) \
                    if v else " | %22s" % "-"
        lines.append(row)
    lines.append("ratio = SonicMoE ms / mok ms (above 1: mok faster); '!' = a check failed; "
                 "TFLOP/s by 6*T*K*H*I forward, twice that backward; start idle: each forward on "
                 "an idle GPU (its host-side start counts), queued: behind ~3 ms of GPU work; " +
                 sonic_note)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mok", action="append", default=[],
                    help="NAME=SOCKET: a mokd to run mok.torch.MoE on (repeatable; 'none': "
                         "SonicMoE alone, to tune it ahead)")
    ap.add_argument("--only", default="")
    ap.add_argument("--T", default="2048,8192")
    ap.add_argument("--routing", default="balanced,skewed")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=0, help="seconds; 0: none")
    ap.add_argument("--start", default="idle",
                    help="idle,queued: each forward on an idle GPU, or behind queued GPU work")
    ap.add_argument("--sonic-tune", choices=("narrow", "full"), default="narrow")
    ap.add_argument("--no-sonic", action="store_true")
    ap.add_argument("--kernels", default="",
                    help="FILE: after the first configuration, one more forward and backward of "
                         "each path under torch.profiler (and inside cudaProfilerStart/Stop, for "
                         "ncu --profile-from-start off); each kernel's name and time to FILE")
    a = ap.parse_args()
    if a.reps < 1 or a.warmup < 0:
        ap.error("--reps >= 1 and --warmup >= 0")
    spec = []
    for item in [] if a.mok == ["none"] else a.mok or ["mok=" + os.environ.get("MOK_SOCKET", "")]:
        pname, _, sock = item.partition("=")
        if not pname or not sock:
            ap.error("--mok NAME=SOCKET (or set MOK_SOCKET)")
        import mok
        spec.append((pname, mok.connect(sock, name="peer_sonic")))
    sonic_parts, why = (None, "--no-sonic") if a.no_sonic else load_sonic(a.sonic_tune)
    note = ("SonicMoE %s, autotuned %s" % (_version("sonic-moe"), a.sonic_tune) if sonic_parts
            else "SonicMoE not run (%s)" % why)
    ts = [int(t) for t in a.T.split(",") if t]
    routings = [r for r in a.routing.split(",") if r]
    only = set(s for s in a.only.split(",") if s)
    starts = [v for v in a.start.split(",") if v]
    if not starts or set(starts) - {"idle", "queued"}:
        ap.error("--start idle, queued or idle,queued")
    todo = [(n, T, r, st) for T in ts for r in routings for n, *_ in SHAPES if not only or n in only
            for st in starts]
    t0 = time.time()
    results = []
    for n, T, r, st in todo:
        if a.deadline and time.time() - t0 > a.deadline:
            print("deadline: %s T=%d %s %s and after left out" % (n, T, r, st), flush=True)
            break
        res = run_config(n, T, r, spec, sonic_parts, a.reps, a.warmup,
                         kernels=a.kernels if not results else "", start=st)
        results.append(res)
        print(json.dumps(res), flush=True)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sonic": note,
           "reps": a.reps, "warmup": a.warmup, "results": results}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(results, note))
    bad = [(r["shape"], r["T"], r["routing"], r["start"], p) for r in results
           for p, v in r["paths"].items() if not v["ok"]]
    for b in bad:
        print("check failed: %s T=%d %s (%s start) on %s" % b)
    return 1 if bad or not results else 0


def _version(dist):
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    sys.exit(main())
