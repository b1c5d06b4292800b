#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A 61-layer MoE model through mokd, PyTorch and SonicMoE: memory and step time.

    python3 tests/bench/model61.py --backend mokd|torch|sonic [--out FILE.json] [--layers 61]
                                   [--tokens 2048] [--steps 3] [--mokd-pid PID]

61 layers shaped like one EP64 rank of kimi-k2.7: 6 local experts, H=7168,
I=2048, a shared expert I_s=2048, top-6 of the 6 experts per token (about
37 GB of bf16 weights). Each layer: an RMS pre-norm, a router (bf16 [6,H],
softmax, top-k), then x = x + MoE(norm(x)). One training step = forward of all layers, a mean
squared loss, backward (weight gradients set to None before each step).

  --backend mokd   each layer is a mok.torch.MoE (the cuda engine; one
                   session, one workspace for the 61 layers)
  --backend torch  the same weights through the PyTorch reference layer of
                   tests/bench/torch_baseline.py (stable sort, gathers,
                   torch._grouped_mm, deterministic combine), autograd
  --backend sonic  the routed experts through SonicMoE (pip install
                   sonic-moe; tests/bench/peer_sonic.py's fixed-top-k path,
                   its autotuning narrowed as there) and the shared expert
                   through torch.mm, as the torch backend's; the weights
                   drawn alike, held by the process (no mokd)

Reports the client's peak (torch.cuda.max_memory_allocated), mokd's peak
device memory above its value before the run (nvidia-smi, sampled every
0.2 s; --mokd-pid; not under MPS) and the median step time after one
warm-up step. Run the two backends in separate processes (the script
tests/gpu/run_isolation_memory.sh does) so that neither holds the other's
memory.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
if os.path.isdir(os.path.join(ROOT, "client", "python")):
    sys.path.insert(1, os.path.join(ROOT, "client", "python"))

H, I, E, K, I_S = 7168, 2048, 6, 6, 2048


def smi_used_mib(pid):
    """pid's used_memory in MiB (nvidia-smi), None when not listed."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


class Sampler(threading.Thread):
    """The peak of pid's device memory while the run goes."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, None, threading.Event()

    def run(self):
        while not self.stop.is_set():
            v = smi_used_mib(self.pid)
            if v is not None and (self.peak is None or v > self.peak):
                self.peak = v
            time.sleep(0.2)


def shared_expert(x, sg, su, sd):
    return torch.mm(F.silu(torch.mm(x, sg.t())) * torch.mm(x, su.t()), sd.t())


class SonicLayer(torch.nn.Module):
    """A layer's weights as mok.torch.MoE names and shapes them, for the sonic backend."""

    def __init__(self, dev):
        super().__init__()

        def w(*shape):
            return torch.nn.Parameter(torch.empty(*shape, device=dev, dtype=torch.bfloat16))
        self.w_gate, self.w_up, self.w_down = w(E, I, H), w(E, I, H), w(E, H, I)
        self.s_gate, self.s_up, self.s_down = w(I_S, H), w(I_S, H), w(H, I_S)


def ref_layer(tb, align, x, ids, rw, wg, wu, wd, sg, su, sd):
    """torch_baseline's layer with separate gate and up weights (the MoE module's)."""
    pl = tb.Plan(ids, wg.shape[0], align)
    xs = tb.Dispatch.apply(x, pl.row_tok, pl.slot_row, pl.K)
    g = torch._grouped_mm(xs, wg.transpose(-2, -1), offs=pl.offs)
    u = torch._grouped_mm(xs, wu.transpose(-2, -1), offs=pl.offs)
    ys = torch._grouped_mm(F.silu(g) * u, wd.transpose(-2, -1), offs=pl.offs)
    return tb.Combine.apply(ys, rw, shared_expert(x, sg, su, sd), pl)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("mokd", "torch", "sonic"), required=True)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mokd-pid", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sonic = None
    if a.backend == "sonic":
        from peer_sonic import SonicPath, load_sonic
        sonic, why = load_sonic("narrow")
        if sonic is None:
            print("model61 sonic: SonicMoE is not importable here (%s)" % why)
            sys.exit(2)
    else:
        import mok.torch as mt

    layers, routers = [], []
    for _ in range(a.layers):
        if sonic:
            m = SonicLayer(dev)
        else:
            m = mt.MoE(hidden=H, intermediate=I, experts=E, topk=K, shared_intermediate=I_S,
                       device=dev)
        with torch.no_grad():  # down projections scaled so the residual stays bounded
            for name, p in m.named_parameters():
                down = name in ("w_down", "s_down")
                p.normal_(0.0, (0.5 / math.sqrt(a.layers) if down else 1.0) /
                          math.sqrt(p.shape[-1]))
        if sonic:  # SonicMoE's own layout of the routed weights; the originals dropped
            m.path = SonicPath(sonic, m.w_gate, m.w_up, m.w_down)
            del m.w_gate, m.w_up, m.w_down
        layers.append(m)
        routers.append(torch.nn.Parameter(
            (torch.randn(E, H, device=dev) / math.sqrt(H)).to(torch.bfloat16)))
    weights_gb = sum(p.numel() * p.element_size() for m in layers
                     for p in list(m.parameters()) + (m.path.params() if sonic else [])) / 1e9
    x0 = torch.randn(a.tokens, H, device=dev).to(torch.bfloat16)

    tb, align = None, 1
    if a.backend == "torch":
        import torch_baseline as tb
        tb.probe_ops(dev)
        try:  # align 16 only if this torch's grouped GEMM refuses unaligned groups
            w = layers[0]
            ids = torch.arange(K, device=dev, dtype=torch.int32).repeat(8, 1)
            ref_layer(tb, 1, x0[:8], ids, torch.ones(8, K, device=dev), w.w_gate, w.w_up,
                      w.w_down, w.s_gate, w.s_up, w.s_down)
        except RuntimeError:
            align = 16

    def step():
        for m in layers:
            for p in list(m.parameters()) + (m.path.params() if sonic else []):
                p.grad = None
        for r in routers:
            r.grad = None
        h = x0
        for m, r in zip(layers, routers):
            # pre-norm (RMS), as a transformer block feeds its MoE
            hf = h.float()
            hn = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
            probs = torch.mm(hn, r.t()).float().softmax(-1)
            rw, ids = probs.topk(K, dim=-1)
            ids = ids.to(torch.int32)
            if a.backend == "mokd":
                y = m(hn, ids, rw)
            elif sonic:
                y = m.path(hn, ids, rw) + shared_expert(hn, m.s_gate, m.s_up, m.s_down)
            else:
                y = ref_layer(tb, align, hn, ids, rw, m.w_gate, m.w_up, m.w_down, m.s_gate,
                              m.s_up, m.s_down)
            h = h + y
        loss = h.float().pow(2).mean()
        loss.backward()
        return loss

    base = smi_used_mib(a.mokd_pid) if a.mokd_pid else None
    sampler = Sampler(a.mokd_pid) if a.mokd_pid else None
    if sampler:
        sampler.start()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, loss, oom = [], None, None
    try:
        for s in range(a.steps + 1):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            loss = step()
            e1.record()
            e1.synchronize()
            if s > 0:
                times.append(e0.elapsed_time(e1))
        torch.cuda.synchronize()
        if a.backend == "mokd":
            mt.default_client().synchronize()
    except torch.cuda.OutOfMemoryError as e:  # a finding, not a crash: report it
        oom = str(e).splitlines()[0]
    time.sleep(0.5)
    if sampler:
        sampler.stop.set()
        sampler.join()
    res = {
        "backend": a.backend, "layers": a.layers, "tokens": a.tokens, "weights_gb": weights_gb,
        "client_peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        "mokd_peak_gb": (sampler.peak - base) / 1024.0 if sampler and sampler.peak is not None
        and base is not None else None,
        "step_ms": statistics.median(times) if times else None, "steps_ms": times,
        "loss": loss.item() if loss is not None else None, "align": align, "oom": oom,
    }
    print("model61 %s: %d layers, T=%d, weights %.1f GB: client peak %.1f GB, mokd peak %s, "
          "step %s (median of %d)%s" % (
              a.backend, a.layers, a.tokens, weights_gb, res["client_peak_gb"],
              "%.2f GB" % res["mokd_peak_gb"] if res["mokd_peak_gb"] is not None else "n/a",
              "%.1f ms" % res["step_ms"] if times else "-", len(times),
              "; out of memory: " + oom if oom else ", loss %.6g" % res["loss"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
