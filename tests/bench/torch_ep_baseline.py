#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The PyTorch baseline of the multi-GPU EP issue: torch.distributed
all_to_all_single dispatch and combine around the layer of tests/bench/torch_baseline.py.

    torchrun --nproc_per_node=W tests/bench/torch_ep_baseline.py \\
        [--shapes kimi-k2.7,...] [--T 2048,8192] [--reps N] [--out FILE.json]

Each rank holds E/W experts (global ids drawn over all E: softmax top-k of
random logits, balanced) and T tokens. Forward, as such a user writes it:
  stable sort of the rank's (t,k) slots by destination rank; split sizes
  exchanged (all_to_all_single of the counts, then .tolist(): a host sync);
  all_to_all_single of the routed rows (autograd: torch.distributed.nn);
  the received rows' local expert ids likewise; a stable sort by local
  expert, torch._grouped_mm for gate+up and down, SwiGLU, unsort; the rows
  sent back by all_to_all_single; unpermute to (t,k) and the f32 K-sum in
  ascending k; the shared expert (I_s = I) by matmul.
Backward: autograd (the all-to-alls reverse themselves).
Timed with CUDA events after a barrier, median of --reps after 3 warm-ups;
the dispatch and combine all-to-alls alone as well: logical bytes = rows
sent by this rank (to every rank, itself included) x H x 2, per direction.
TFLOP/s by the benchmark's formula (docs/design.md) per rank: forward 6*(T + T*K)*H*I, backward 2x.
NCCL_NVLS_ENABLE=0 is set before NCCL starts (no NVLink multicast).
"""
import argparse
import json
import math
import os
import statistics
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnnf
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_baseline import SHAPE  # noqa: E402  (the four shapes: name, E, H, I, K)

BF16 = torch.bfloat16


def swiglu(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def make_params(E_loc, H, I, gen, dev):
    def w(*shape, fan_in):
        t = torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32)
        return (t / math.sqrt(fan_in)).to(BF16).requires_grad_(True)
    return {"w_gu": w(E_loc, 2 * I, H, fan_in=H), "w_d": w(E_loc, H, I, fan_in=I),
            "s_gu": w(2 * I, H, fan_in=H), "s_d": w(H, I, fan_in=I)}


def make_inputs(T, H, E, K, gen, dev):
    logits = torch.randn(T, E, generator=gen, device=dev)
    rw, ids = logits.softmax(-1).topk(K, dim=-1)
    rw = (rw / rw.sum(-1, keepdim=True)).float().requires_grad_(True)
    x = torch.randn(T, H, generator=gen, device=dev).to(BF16).requires_grad_(True)
    d_out = torch.randn(T, H, generator=gen, device=dev).to(BF16)
    return x, ids.to(torch.int64), rw, d_out


def route(ids, E_loc, W):
    """Send order and split sizes (the host sync every such layer has)."""
    flat = ids.reshape(-1)
    dest = torch.div(flat, E_loc, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    send = torch.bincount(dest, minlength=W)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return order, send.tolist(), recv.tolist(), (flat.index_select(0, order) % E_loc)


def layer(P, x, ids, rw, E_loc, W, K):
    T, H = x.shape
    order, send, recv, eids = route(ids, E_loc, W)
    xs = x.index_select(0, torch.div(order, K, rounding_mode="floor"))
    xr = dnnf.all_to_all_single(xs.new_empty(sum(recv), H), xs, recv, send)
    er = torch.empty(sum(recv), dtype=eids.dtype, device=x.device)
    dist.all_to_all_single(er, eids, recv, send)
    # the local experts: sort the received rows by expert, grouped GEMMs, unsort
    eo = torch.sort(er, stable=True).indices
    offs = torch.cumsum(torch.bincount(er, minlength=E_loc), 0).to(torch.int32)
    xe = xr.index_select(0, eo)
    h = swiglu(torch._grouped_mm(xe, P["w_gu"].transpose(-2, -1), offs=offs))
    ye = torch._grouped_mm(h, P["w_d"].transpose(-2, -1), offs=offs)
    yr = ye.index_select(0, torch.argsort(eo))
    ys = dnnf.all_to_all_single(yr.new_empty(sum(send), H), yr, send, recv)
    y = ys.index_select(0, torch.argsort(order)).view(T, K, H)
    acc = torch.mm(swiglu(torch.mm(x, P["s_gu"].t())), P["s_d"].t()).float()
    for k in range(K):
        acc = acc + y[:, k].float() * rw[:, k:k + 1]
    return acc.to(BF16), xs, send, recv


def timed(fn, reps, warmup=3):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(warmup + reps):
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warmup:
            out.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(out)


def run(name, T, reps, W, rank, dev):
    _, E, H, I, K = SHAPE[name]
    E_loc = E // W
    gen = torch.Generator(device=dev)
    gen.manual_seed(1000 + rank)
    P = make_params(E_loc, H, I, gen, dev)
    x, ids, rw, d_out = make_inputs(T, H, E, K, gen, dev)
    state = {}

    def fwd():
        with torch.no_grad():
            layer(P, x, ids, rw, E_loc, W, K)

    def fwd_bwd_setup():
        for t in list(P.values()) + [x, rw]:
            t.grad = None
        state["out"] = layer(P, x, ids, rw, E_loc, W, K)[0]

    def bwd():
        state["out"].backward(d_out)

    t_fwd = timed(fwd, reps)
    # backward: each timed run after an untimed forward with autograd
    bw = []
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(3 + reps):
        fwd_bwd_setup()
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        bwd()
        b.record()
        b.synchronize()
        if i >= 3:
            bw.append(a.elapsed_time(b) * 1e-3)
    t_bwd = statistics.median(bw)
    # the all-to-alls alone, at this routing's split sizes
    with torch.no_grad():
        order, send, recv, _ = route(ids, E_loc, W)
        xs = x.index_select(0, torch.div(order, K, rounding_mode="floor"))
        xr = xs.new_empty(sum(recv), H)
        t_disp = timed(lambda: dist.all_to_all_single(xr, xs, recv, send), reps)
        t_comb = timed(lambda: dist.all_to_all_single(xs, xr, send, recv), reps)
    fl = 6.0 * (T + T * K) * H * I
    sent_bytes = sum(send) * H * 2.0
    del P, x, state
    torch.cuda.empty_cache()
    return {"shape": name, "T": T, "W": W, "rank": rank, "fwd_ms": t_fwd * 1e3,
            "bwd_ms": t_bwd * 1e3, "fwd_tflops": fl / t_fwd * 1e-12,
            "bwd_tflops": 2 * fl / t_bwd * 1e-12, "dispatch_ms": t_disp * 1e3,
            "combine_ms": t_comb * 1e3, "dispatch_GBps": sent_bytes / t_disp * 1e-9,
            "combine_GBps": sent_bytes / t_comb * 1e-9, "rows_sent": sum(send),
            "rows_remote": sum(send) - send[rank]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2.7,glm-5.2,qwen3.5-397b,deepseek-v4-pro")
    ap.add_argument("--T", default="2048,8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    results = []
    for T in [int(t) for t in args.T.split(",")]:
        for name in args.shapes.split(","):
            r = run(name, T, args.reps, W, rank, dev)
            gathered = [None] * W
            dist.all_gather_object(gathered, r)
            if rank == 0:
                worst = max(gathered, key=lambda g: g["fwd_ms"] + g["bwd_ms"])
                print(f"torch EP={W} {name:16s} T={T:5d}: fwd {worst['fwd_ms']:8.3f} ms "
                      f"({worst['fwd_tflops']:6.1f} TFLOP/s/GPU), bwd {worst['bwd_ms']:8.3f} ms "
                      f"({worst['bwd_tflops']:6.1f}), dispatch {worst['dispatch_GBps']:6.1f} GB/s, "
                      f"combine {worst['combine_GBps']:6.1f} GB/s (slowest rank)", flush=True)
                results.append({"ranks": gathered})
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"tool": "torch_ep_baseline", "world": W, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
