#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The PyTorch baseline of the kernel benchmark: the MoE layer as a strong PyTorch user writes it.

    python3 tests/bench/torch_baseline.py [--out FILE.json] [--routing-dir DIR]
                                          [--T 2048,8192] [--reps N] [--deadline S]

Per-GPU slice of EP8: E_loc = E/8 local experts (routing ids drawn over the
local experts only), one shared expert with I_s = I. For each shape, T and
routing it times, with CUDA events (warm-up, then the median of --reps
runs, rotating two input sets):
  - forward: stable sort of the (t,k) slots by expert, gather of the routed
    rows, torch._grouped_mm (bf16, int32 offsets) for gate+up (one [2I,H]
    operand per expert) and for down, SwiGLU, deterministic unpermute
    (index_select by sorted order, no atomics), f32 K-sum in ascending k,
    shared expert by matmul; autograd on (weights, x and router weights
    require grad), as in training;
  - backward: autograd backward of that graph (weight grads set to None
    before each run, as after optimizer.zero_grad());
  - the two forward grouped GEMMs alone (no_grad).
Also, once per run: a dense bf16 GEMM 8192x8192x8192 (at the start and at the
end) and a large device-to-device copy (bytes read + written), the ceilings
the table and kernels/PERF.md divide by.

The data movement is two small autograd.Functions whose backward passes are
gathers too (no index_add / scatter_add atomics, so the backward is as
deterministic as the forward): dispatch (x -> routed rows; d_x = f32 sum
over k of the routed rows' grads) and combine (unpermute + rw-weighted f32
K-sum in ascending k; d_y = rw*d_out, d_rw = <d_out, y>). Everything else is
plain autograd.

Before any timing, the same code runs at a tiny shape and is held against the
float64 reference (client/python/mok/reference.py): every output and
gradient must be within 1e-2 (max |err| / max |ref|).

TFLOP/s by the issue's formula: forward 6*(T + T*K)*H*I, backward twice that.
--routing-dir writes each routing (ids int32 [T,K], rw f32 [T,K]) so that
tests/bench/mok_bench runs the same routings. --deadline: no new
configuration starts after that many seconds (results so far are kept; the
JSON is rewritten after every configuration).
"""
import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

# The four benchmark shapes of docs/design.md (global E; E_loc = E/8 is what one GPU holds):
# tests/harness/model_shapes.h, which tests/python/test_model_shapes.py holds this copy to.
SHAPES = [
    # name,             E,   H,    I,    K
    ("kimi-k2.7",       384, 7168, 2048, 8),
    ("glm-5.2",         256, 6144, 2048, 8),
    ("qwen3.5-397b",    512, 4096, 1024, 10),
    ("deepseek-v4-pro", 384, 7168, 3072, 6),
]
EP = 8
SHAPE = {s[0]: s for s in SHAPES}


def plan(ts):
    """Configurations in priority order (a deadline cuts the tail): T=2048 every
    shape balanced and skewed, then T=8192 balanced (kimi, deepseek first),
    then T=8192 skewed. mok_bench uses the same order."""
    out = []
    if 2048 in ts:
        for s in SHAPES:
            out += [(s[0], 2048, "balanced"), (s[0], 2048, "skewed")]
    for T in sorted(t for t in ts if t != 2048):
        for r in ("balanced", "skewed"):
            for n in ("kimi-k2.7", "deepseek-v4-pro", "glm-5.2", "qwen3.5-397b"):
                out.append((n, T, r))
    return out


def flops_fwd(T, H, I, K, I_s):
    """The benchmark's formula (docs/design.md; I_s = I here): 6*(T + T*K)*H*I; the general form is
    6*T*K*H*I + 6*T*H*I_s."""
    return 6.0 * T * K * H * I + 6.0 * T * H * I_s


DEV = "cuda"
BF16 = torch.bfloat16

# ---- ops whose mixed-dtype forms are probed once (see probe_ops) -------------------
OPS = {"addcmul_mixed": False, "mul_out_bf16": False, "bmm_out_dtype": False}


def probe_ops(dev):
    a = torch.zeros(4, 8, device=dev)
    b = torch.full((4, 8), 1.5, device=dev, dtype=BF16)
    c = torch.full((4, 1), 0.25, device=dev)
    try:
        r = torch.addcmul(a, b, c)
        OPS["addcmul_mixed"] = r.dtype == torch.float32 and bool((r == 0.375).all())
    except (RuntimeError, TypeError):
        pass
    try:
        o = torch.empty(4, 8, device=dev, dtype=BF16)
        torch.mul(b, c, out=o)
        OPS["mul_out_bf16"] = bool((o.float() == 0.375).all())
    except (RuntimeError, TypeError):
        pass
    try:
        m = torch.bmm(b.view(1, 4, 8), b.view(1, 8, 4), out_dtype=torch.float32)
        OPS["bmm_out_dtype"] = m.dtype == torch.float32 and bool((m == 18.0).all())
    except (RuntimeError, TypeError):
        pass


# ---- routing -------------------------------------------------------------------------

def make_routing(T, E_loc, K, kind, gen, dev):
    """Softmax top-k of random logits over the local experts; 'skewed' adds a
    bias to a few experts' logits (+6 on expert 0, +1 on experts 1..3), which
    puts expert 0 in nearly every token's top-k: hottest >= 4x the mean on
    every issue shape (glm: E_loc/K = 4, so exactly 4x)."""
    logits = torch.randn(T, E_loc, generator=gen, device=dev, dtype=torch.float32)
    if kind == "skewed":
        bias = torch.zeros(E_loc, device=dev)
        bias[0] = 6.0
        bias[1:4] = 1.0
        logits = logits + bias
    elif kind != "balanced":
        raise ValueError(kind)
    probs = logits.softmax(dim=-1)
    rw, ids = probs.topk(K, dim=-1)
    rw = rw / rw.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32).contiguous(), rw.float().contiguous()


def load_stats(ids, E_loc):
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E_loc).cpu().tolist()
    mean = sum(counts) / float(E_loc)
    return max(counts) / mean, min(counts), max(counts)


class Plan:
    """Where each (t,k) slot's row goes, built on the device with no host sync:
    stable sort by expert; offs = cumulative row ends per expert (int32).
    align > 1 pads every expert's group to a multiple of align (only used if
    this torch's _grouped_mm refuses unaligned groups)."""

    def __init__(self, ids, E_loc, align):
        T, K = ids.shape
        TK = T * K
        dev = ids.device
        flat = ids.reshape(-1).long()
        sorted_e, order = torch.sort(flat, stable=True)  # order[p] = slot at sorted position p
        ends = torch.searchsorted(sorted_e, torch.arange(E_loc, device=dev), right=True)
        ar = torch.arange(TK, device=dev)
        if align == 1:
            self.R = TK
            self.offs = ends.to(torch.int32)
            row_slot = order                              # row r holds slot order[r]
            self.slot_row = torch.empty_like(order).scatter_(0, order, ar)
            self.row_slot_ext = order                     # for the combine backward gather
            self.padded = False
        else:
            counts = torch.diff(ends, prepend=ends.new_zeros(1))
            padded = (counts + align - 1) // align * align
            pends = torch.cumsum(padded, 0)
            shift = (pends - padded) - (ends - counts)    # padded start - start, per expert
            pos = ar + shift[sorted_e]                    # row of sorted position p
            self.R = TK + E_loc * (align - 1)
            self.offs = pends.to(torch.int32)
            # pad rows name slot TK: a zero row appended in the combine backward
            row_slot = torch.full((self.R,), TK, device=dev, dtype=torch.long).scatter_(0, pos, order)
            self.slot_row = torch.empty_like(order).scatter_(0, order, pos)
            self.row_slot_ext = row_slot
            self.padded = True
        self.row_tok = torch.div(row_slot, K, rounding_mode="floor").clamp_(max=T - 1)
        self.T, self.K = T, K


class Dispatch(torch.autograd.Function):
    """xs[r] = x[token of row r]. Backward: d_x[t] = sum over k (f32) of the
    grads of the rows of (t,k), gathered by slot (no index_add)."""

    @staticmethod
    def forward(ctx, x, row_tok, slot_row, K):
        ctx.slot_row, ctx.K, ctx.T = slot_row, K, x.shape[0]
        return x.index_select(0, row_tok)

    @staticmethod
    def backward(ctx, d_xs):
        d = d_xs.index_select(0, ctx.slot_row).view(ctx.T, ctx.K, -1)
        return d.sum(dim=1, dtype=torch.float32).to(d_xs.dtype), None, None, None


class Combine(torch.autograd.Function):
    """out[t] = bf16(y_shared[t] + sum_{k ascending} rw[t,k] * y[t,k]) in f32,
    y[t,k] = ys[row of (t,k)] (unpermute by index_select). Backward:
    d_y = bf16(rw * d_out), d_rw = <d_out, y> (f32 accumulation), d_ys by a
    gather through the row -> slot map, d_y_shared = d_out."""

    @staticmethod
    def forward(ctx, ys, rw, y_shared, plan):
        T, K = rw.shape
        y = ys.index_select(0, plan.slot_row).view(T, K, -1)
        acc = y_shared.float()
        for k in range(K):
            if OPS["addcmul_mixed"]:
                acc.addcmul_(y[:, k], rw[:, k:k + 1])
            else:
                acc.add_(y[:, k] * rw[:, k:k + 1])
        ctx.y, ctx.plan = y, plan
        ctx.save_for_backward(rw)
        return acc.to(ys.dtype)

    @staticmethod
    def backward(ctx, d_out):
        (rw,) = ctx.saved_tensors
        y, plan = ctx.y, ctx.plan
        T, K, H = y.shape
        if OPS["mul_out_bf16"]:
            d_y = torch.empty_like(y)
            torch.mul(d_out.unsqueeze(1), rw.unsqueeze(-1), out=d_y)
        else:
            d_y = (d_out.unsqueeze(1) * rw.unsqueeze(-1)).to(y.dtype)
        if OPS["bmm_out_dtype"]:
            d_rw = torch.bmm(y, d_out.unsqueeze(-1), out_dtype=torch.float32).view(T, K)
        else:
            d_rw = torch.bmm(y, d_out.unsqueeze(-1)).float().view(T, K)
        flat = d_y.view(T * K, H)
        if plan.padded:
            flat = torch.cat([flat, flat.new_zeros(1, H)])
        d_ys = flat.index_select(0, plan.row_slot_ext)
        return d_ys, d_rw, d_out, None


def swiglu(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def layer_forward(P, x, ids, rw, align):
    """The whole layer from the routing ids: returns out [T,H] bf16 (and the plan)."""
    pl = Plan(ids, P["w_gu"].shape[0], align)
    xs = Dispatch.apply(x, pl.row_tok, pl.slot_row, pl.K)
    gu = torch._grouped_mm(xs, P["w_gu"].transpose(-2, -1), offs=pl.offs)
    ys = torch._grouped_mm(swiglu(gu), P["w_d"].transpose(-2, -1), offs=pl.offs)
    y_shared = torch.mm(swiglu(torch.mm(x, P["s_gu"].t())), P["s_d"].t())
    return Combine.apply(ys, rw, y_shared, pl), pl


def make_params(E_loc, H, I, I_s, gen, dev, scale=1.0):
    """Weights as nn.Linear stores them: gate and up as one [2I,H] operand per
    expert (gate rows first), down [H,I]; normal, var 1/fan_in."""
    def w(*shape, fan_in):
        t = torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32)
        return (t * (scale / math.sqrt(fan_in))).to(BF16).requires_grad_(True)
    return {"w_gu": w(E_loc, 2 * I, H, fan_in=H), "w_d": w(E_loc, H, I, fan_in=I),
            "s_gu": w(2 * I_s, H, fan_in=H), "s_d": w(H, I_s, fan_in=I_s)}


def make_set(T, H, E_loc, K, kind, gen, dev):
    ids, rw = make_routing(T, E_loc, K, kind, gen, dev)
    x = torch.randn(T, H, generator=gen, device=dev).to(BF16).requires_grad_(True)
    d_out = torch.randn(T, H, generator=gen, device=dev).to(BF16)
    return {"ids": ids, "rw": rw.requires_grad_(True), "x": x, "d_out": d_out}


def clear_grads(P, s):
    for t in list(P.values()) + [s["x"], s["rw"]]:
        t.grad = None


# ---- correctness at a tiny shape against the float64 reference ------------------------

def check_tiny(dev, align):
    import numpy as np
    from mok import reference

    T, H, I, E_loc, K = 512, 256, 128, 8, 3
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    P = make_params(E_loc, H, I, I, gen, dev)
    s = make_set(T, H, E_loc, K, "balanced", gen, dev)
    out, _ = layer_forward(P, s["x"], s["ids"], s["rw"], align)
    out.backward(s["d_out"])
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()

    def np64(t):
        return t.detach().float().cpu().numpy().astype(np.float64)

    wg, wu = np64(P["w_gu"][:, :I]), np64(P["w_gu"][:, I:])
    sg, su = np64(P["s_gu"][:I]), np64(P["s_gu"][I:])
    args = (np64(s["x"]), s["ids"].cpu().numpy(), np64(s["rw"]), wg, wu, np64(P["w_d"]),
            sg, su, np64(P["s_d"]))
    ref_out = reference.forward(*args)
    ref = reference.backward(np64(s["d_out"]), *args)
    got = {"out": np64(out), "d_x": np64(s["x"].grad), "d_router_weights": np64(s["rw"].grad),
           "d_w_gate": np64(P["w_gu"].grad[:, :I]), "d_w_up": np64(P["w_gu"].grad[:, I:]),
           "d_w_down": np64(P["w_d"].grad), "d_s_gate": np64(P["s_gu"].grad[:I]),
           "d_s_up": np64(P["s_gu"].grad[I:]), "d_s_down": np64(P["s_d"].grad)}
    ref["out"] = ref_out
    errs = {k: reference.rel_err(v, ref[k]) for k, v in got.items()}
    ok = all(e < 1e-2 for e in errs.values())
    fro = {k: float(np.linalg.norm(v - ref[k]) / np.linalg.norm(ref[k])) for k, v in got.items()}
    return ok, errs, {"T": T, "H": H, "I": I, "I_s": I, "E_loc": E_loc, "K": K,
                      "rel_err_frobenius": fro}


# ---- timing ---------------------------------------------------------------------------

class Timer:
    def __init__(self):
        self.a = torch.cuda.Event(enable_timing=True)
        self.b = torch.cuda.Event(enable_timing=True)

    def start(self):
        self.a.record()

    def stop(self):
        self.b.record()
        self.b.synchronize()
        return self.a.elapsed_time(self.b)


def median(v):
    return statistics.median(v) if v else float("nan")


def time_dense(dev, reps, warmup, n=8192):
    gen = torch.Generator(device=dev)
    gen.manual_seed(7)
    pairs = [(torch.randn(n, n, generator=gen, device=dev).to(BF16),
              torch.randn(n, n, generator=gen, device=dev).to(BF16)) for _ in range(2)]
    c = torch.empty(n, n, device=dev, dtype=BF16)
    tm, ts = Timer(), []
    for i in range(warmup + reps):
        a, b = pairs[i % 2]
        tm.start()
        torch.mm(a, b, out=c)
        ms = tm.stop()
        if i >= warmup:
            ts.append(ms)
    ms = median(ts)
    del pairs, c
    return {"n": n, "ms": ms, "tflops": 2.0 * n ** 3 / ms * 1e-9}


def time_copy(dev, reps, warmup, gib=2):
    n = gib << 30
    src = [torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255) for _ in range(2)]
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    tm, ts = Timer(), []
    for i in range(warmup + reps):
        tm.start()
        dst.copy_(src[i % 2])
        ms = tm.stop()
        if i >= warmup:
            ts.append(ms)
    ms = median(ts)
    del src, dst
    return {"bytes_each_way": n, "ms": ms, "gbps": 2.0 * n / ms * 1e-6}


def run_config(name, T, kind, reps, warmup, align, routing_dir, dev):
    _, E, H, I, K = SHAPE[name]
    E_loc, I_s = E // EP, I
    gen = torch.Generator(device=dev)
    gen.manual_seed(sum(map(ord, name)) * 1000003 + T * 7 + (kind == "skewed"))
    P = make_params(E_loc, H, I, I_s, gen, dev)
    sets = [make_set(T, H, E_loc, K, kind, gen, dev) for _ in range(2)]
    loads = [load_stats(s["ids"], E_loc) for s in sets]
    if routing_dir:
        os.makedirs(routing_dir, exist_ok=True)
        for j, s in enumerate(sets):
            base = os.path.join(routing_dir, "%s_T%d_%s_s%d" % (name, T, kind, j))
            s["ids"].cpu().numpy().tofile(base + ".ids")
            s["rw"].detach().cpu().numpy().tofile(base + ".rw")
    tm = Timer()

    fwd = []
    for i in range(warmup + reps):
        s = sets[i % 2]
        tm.start()
        out, _ = layer_forward(P, s["x"], s["ids"], s["rw"], align)
        ms = tm.stop()
        del out
        if i >= warmup:
            fwd.append(ms)

    bwd = []
    for i in range(warmup + reps):
        s = sets[i % 2]
        clear_grads(P, s)
        out, _ = layer_forward(P, s["x"], s["ids"], s["rw"], align)
        tm.start()
        out.backward(s["d_out"])
        ms = tm.stop()
        del out
        if i >= warmup:
            bwd.append(ms)
    finite = all(bool(torch.isfinite(t.grad.float()).all())
                 for t in (P["w_gu"], P["w_d"], sets[1]["x"]))
    clear_grads(P, sets[0])
    clear_grads(P, sets[1])

    # the two forward grouped GEMMs alone, on each set's routed rows
    with torch.no_grad():
        pre = []
        for s in sets:
            pl = Plan(s["ids"], E_loc, align)
            xs = s["x"].index_select(0, pl.row_tok)
            h = swiglu(torch._grouped_mm(xs, P["w_gu"].transpose(-2, -1), offs=pl.offs))
            pre.append((xs, h, pl.offs))
        gem = []
        for i in range(warmup + reps):
            xs, h, offs = pre[i % 2]
            tm.start()
            torch._grouped_mm(xs, P["w_gu"].transpose(-2, -1), offs=offs)
            torch._grouped_mm(h, P["w_d"].transpose(-2, -1), offs=offs)
            ms = tm.stop()
            if i >= warmup:
                gem.append(ms)
        del pre
    f = flops_fwd(T, H, I, K, I_s)
    fr = 6.0 * T * K * H * I
    res = {
        "shape": name, "T": T, "routing": kind, "E": E, "E_loc": E_loc, "H": H, "I": I, "K": K,
        "I_s": I_s, "max_over_mean": [round(l[0], 3) for l in loads],
        "min_max_rows": [[l[1], l[2]] for l in loads],
        "flops_fwd": f, "flops_bwd": 2 * f,
        "fwd_ms": median(fwd), "bwd_ms": median(bwd), "gemm_ms": median(gem),
        "fwd_ms_all": fwd, "bwd_ms_all": bwd,
        "fwd_tflops": f / median(fwd) * 1e-9, "bwd_tflops": 2 * f / median(bwd) * 1e-9,
        "gemm_tflops": fr / median(gem) * 1e-9, "grads_finite": finite,
    }
    del P, sets
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON file (rewritten after each configuration)")
    ap.add_argument("--routing-dir", default=None, help="write each routing there for mok_bench")
    ap.add_argument("--T", default="2048,8192", help="token counts, comma-separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=1e9,
                    help="start no configuration after this many seconds")
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    args = ap.parse_args()
    t0 = time.time()
    if not torch.cuda.is_available():
        print("torch_baseline: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device(DEV)
    torch.backends.cuda.matmul.allow_tf32 = False
    probe_ops(dev)
    doc = {"tool": "torch_baseline", "torch": torch.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(dev),
           "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
           "ops": dict(OPS), "reps": args.reps, "warmup": args.warmup, "results": [],
           "skipped": []}

    def save():
        if args.out:
            tmp = args.out + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(doc, fh, indent=1)
            os.replace(tmp, args.out)

    # correctness first; align 16 only if unaligned groups fail here
    align, check = 1, None
    for al in (1, 16):
        try:
            ok, errs, dims = check_tiny(dev, al)
        except RuntimeError as e:  # e.g. a grouped-GEMM alignment refusal
            print("check (align %d): %s" % (al, str(e).splitlines()[0]))
            ok, errs, dims = False, {"error": str(e).splitlines()[0]}, {}
        check = {"align": al, "passed": ok, "rel_err": errs, "dims": dims, "limit": 1e-2}
        print("check vs float64 reference (align %d): %s  %s" % (
            al, "PASSED" if ok else "FAILED",
            " ".join("%s=%.2e" % (k, v) for k, v in errs.items() if isinstance(v, float))))
        if ok:
            align = al
            break
    doc["check"] = check
    doc["align"] = align
    print("ops: %s" % OPS)

    doc["dense_start"] = time_dense(dev, args.reps, args.warmup)
    doc["copy"] = time_copy(dev, args.reps, args.warmup)
    print("dense bf16 GEMM 8192^3: %.3f ms  %.1f TFLOP/s;  d2d copy %.0f GB/s (read+write)" % (
        doc["dense_start"]["ms"], doc["dense_start"]["tflops"], doc["copy"]["gbps"]))
    save()

    ts = [int(v) for v in args.T.split(",") if v]
    only = set(args.only.split(",")) if args.only else None
    for name, T, kind in plan(ts):
        if only and name not in only:
            continue
        if time.time() - t0 > args.deadline:
            doc["skipped"].append([name, T, kind])
            print("skip %s T=%d %s (deadline)" % (name, T, kind))
            continue
        try:
            r = run_config(name, T, kind, args.reps, args.warmup, align, args.routing_dir, dev)
        except RuntimeError as e:  # OOM or a refusal: record and go on
            r = {"shape": name, "T": T, "routing": kind, "error": str(e).splitlines()[0]}
            print("%s T=%d %s: ERROR %s" % (name, T, kind, r["error"]))
        else:
            print("%-16s T=%-5d %-8s max/mean %s  fwd %8.3f ms %6.1f TF/s  bwd %8.3f ms %6.1f TF/s"
                  "  grouped GEMMs %7.3f ms %6.1f TF/s" % (
                      name, T, kind, "/".join("%.2f" % v for v in r["max_over_mean"]),
                      r["fwd_ms"], r["fwd_tflops"], r["bwd_ms"], r["bwd_tflops"], r["gemm_ms"],
                      r["gemm_tflops"]))
        doc["results"].append(r)
        gc.collect()
        torch.cuda.empty_cache()
        save()
    doc["dense_end"] = time_dense(dev, args.reps, args.warmup)
    doc["dense_tflops"] = max(doc["dense_start"]["tflops"], doc["dense_end"]["tflops"])
    print("dense bf16 GEMM again: %.1f TFLOP/s" % doc["dense_end"]["tflops"])
    doc["seconds"] = time.time() - t0
    save()
    return 0 if check["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
