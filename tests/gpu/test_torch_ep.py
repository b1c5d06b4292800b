# SPDX-License-Identifier: Apache-2.0
"""mok.torch.MoE on an expert-parallel group (device only; docs/ep.md, docs/torch.md).

Starts W mokd (cuda engine; rank r's on GPU r % GPUs) and W worker processes.
Each worker joins the group through its own mokd, builds mok.torch.MoE(group=g)
holding its E/W experts (slices of one seeded set of weights), runs forward and
autograd backward on its own tokens twice, and saves the results. The parent
then runs the same layer as one module with all E experts (EP=1, no group) on
the ranks' tokens concatenated, and checks: out, x.grad, router_weights.grad
and the routed weight gradients bitwise equal to EP=1 and to the first
iteration; the shared expert's gradients summed over ranks within bf16
rounding of EP=1's; everything close to the plain-PyTorch reference. Then the
same with dtype="fp8" modules (on the same bfloat16 group sizing; each rank
packs its local experts' masters): bitwise equal to the fp8 module at EP=1,
and within the format's error of the reference.

    python3 tests/gpu/test_torch_ep.py MOKD [W]     (under MPS when W > GPUs)
"""
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

H, I, E, K = 256, 128, 16, 4
IS_OF = {"bfloat16": 64, "fp8": 128}  # fp8: whole 128-blocks
T_RANK = [96, 61, 128, 7]
T_MAX = 128


def weights(torch, IS):
    g = torch.Generator().manual_seed(5)

    def bf(shape, scale):
        return ((torch.rand(shape, generator=g) * 2 - 1) * scale).to(torch.bfloat16)
    return {"w_gate": bf((E, I, H), 4 / H ** 0.5), "w_up": bf((E, I, H), 4 / H ** 0.5),
            "w_down": bf((E, H, I), 3 / I ** 0.5), "s_gate": bf((IS, H), 4 / H ** 0.5),
            "s_up": bf((IS, H), 4 / H ** 0.5), "s_down": bf((H, IS), 3 / IS ** 0.5)}


def tokens(torch, r):
    g = torch.Generator().manual_seed(100 + r)
    T = T_RANK[r]
    x = ((torch.rand((T, H), generator=g) * 2 - 1)).to(torch.bfloat16)
    d_out = ((torch.rand((T, H), generator=g) * 2 - 1)).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[::5, K - 1] = -1
    rw = torch.rand((T, K), generator=g)
    return x, ids, rw, d_out


def run_module(torch, m, x, ids, rw, d_out):
    """forward + backward on CUDA; returns CPU tensors."""
    dev = m.w_gate.device
    xg = x.to(dev).requires_grad_(True)
    rwg = rw.to(dev).requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    out = m(xg, ids.to(dev), rwg)
    out.backward(d_out.to(dev))
    torch.cuda.synchronize()
    res = {"out": out.detach().cpu(), "d_x": xg.grad.cpu(), "d_rw": rwg.grad.cpu()}
    for n, p in m.named_parameters():
        res["d_" + n] = p.grad.cpu()
    return res


def worker(sock, key, r, W, gpus, path, dtype):
    import torch
    import mok
    import mok.torch as mt
    torch.cuda.set_device(r % gpus)
    c = mok.connect(sock)
    g = c.group(key, r, W, max_tokens=T_MAX, hidden=H, topk=K, experts=E, dtype="bfloat16",
                timeout_ms=20000)
    IS = IS_OF[dtype]
    m = mt.MoE(H, I, E, K, shared_intermediate=IS, group=g, group_tag=7, dtype=dtype).cuda()
    wt, El = weights(torch, IS), E // W
    with torch.no_grad():
        for n in ("w_gate", "w_up", "w_down"):
            getattr(m, n).copy_(wt[n][r * El:(r + 1) * El])
        for n in ("s_gate", "s_up", "s_down"):
            getattr(m, n).copy_(wt[n])
    x, ids, rw, d_out = tokens(torch, r)
    a = run_module(torch, m, x, ids, rw, d_out)
    b = run_module(torch, m, x, ids, rw, d_out)
    torch.save({"a": a, "b": b, "repr": repr(m), "quantizations": m.quantizations}, path)
    c.close()


def start_mokd(mokd, d, i, device):
    sock = os.path.join(d, "mokd%d.sock" % i)
    cfg = os.path.join(d, "mokd%d.conf" % i)
    with open(cfg, "w") as f:
        f.write("device = %d\nlog-level = warn\n" % device)
    p = subprocess.Popen([mokd, "--socket", sock, "--engine", "cuda", "--config", cfg],
                         stderr=open(os.path.join(d, "mokd%d.log" % i), "w"))
    for _ in range(3000):
        if os.path.exists(sock):
            return p, sock
        time.sleep(0.01)
    raise RuntimeError("mokd %d did not start" % i)


def run_case(torch, mt, procs, d, W, gpus, dtype, check):
    IS = IS_OF[dtype]
    key = "torch-ep-%s-%d" % (dtype, os.getpid())
    ctx = mp.get_context("spawn")
    paths = [os.path.join(d, "rank%d-%s.pt" % (r, dtype)) for r in range(W)]
    ws = [ctx.Process(target=worker, args=(procs[r][1], key, r, W, gpus, paths[r], dtype))
          for r in range(W)]
    for w in ws:
        w.start()
    ok = True
    for w in ws:
        w.join(120)
        ok &= w.exitcode == 0
        check(w.exitcode == 0, "%s: a worker failed (exit %s)" % (dtype, w.exitcode))
    if not ok:
        return
    res = [torch.load(p) for p in paths]
    print(res[0]["repr"])
    # EP=1: one module with every expert, the ranks' tokens concatenated
    import mok
    c = mok.connect(procs[0][1])
    torch.cuda.set_device(0)
    m = mt.MoE(H, I, E, K, shared_intermediate=IS, client=c, max_tokens=W * T_MAX,
               dtype=dtype).cuda()
    wt = weights(torch, IS)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(wt[n])
    parts = [tokens(torch, r) for r in range(W)]
    cat = [torch.cat([p[i] for p in parts]) for i in range(4)]
    one = run_module(torch, m, *cat)
    ref = mt.MoE(H, I, E, K, shared_intermediate=IS, backend="torch").cuda()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(wt[n])
    r64 = run_module(torch, ref, *cat)
    El, off = E // W, 0
    for r in range(W):
        a, b, T = res[r]["a"], res[r]["b"], T_RANK[r]
        for n in ("out", "d_x", "d_rw"):
            check(torch.equal(a[n], one[n][off:off + T]), "%s rank %d %s != EP=1" % (dtype, r, n))
            check(torch.equal(a[n], b[n]), "%s rank %d %s not repeatable" % (dtype, r, n))
        for n in ("d_w_gate", "d_w_up", "d_w_down"):
            check(torch.equal(a[n], one[n][r * El:(r + 1) * El]),
                  "%s rank %d %s != EP=1 (its experts)" % (dtype, r, n))
            check(torch.equal(a[n], b[n]), "%s rank %d %s not repeatable" % (dtype, r, n))
        if dtype == "fp8":  # each master quantised once (the weights did not change)
            check(res[r]["quantizations"] == 6, "%s rank %d quantised %d weights, not 6" %
                  (dtype, r, res[r]["quantizations"]))
        off += T
    for n in ("d_s_gate", "d_s_up", "d_s_down"):
        s = sum(res[r]["a"][n].float() for r in range(W))
        e = (s - one[n].float()).abs().max().item() / one[n].float().abs().max().item()
        check(e < 2e-2, "%s %s summed over ranks vs EP=1: rel err %.3g" % (dtype, n, e))
    out = torch.cat([res[r]["a"]["out"] for r in range(W)]).float()
    diff = out - r64["out"].float()
    if dtype == "bfloat16":  # its roundings: largest error against the largest value
        e = diff.abs().max().item() / r64["out"].float().abs().max().item()
        check(e < 2e-2, "%s out vs the PyTorch reference: rel err %.3g" % (dtype, e))
    else:  # the format's error, norm by norm (docs/math.md "FP8": about 6 %), and not 0
        e = (diff.norm() / r64["out"].float().norm()).item()
        check(1e-3 < e < 0.15, "%s out vs the PyTorch reference: rel err %.3g (expected in "
              "(1e-3, 0.15))" % (dtype, e))
    print("torch EP=%d %s on %d GPU(s): out, d_x, d_rw, routed weight grads bitwise equal to "
          "EP=1 and repeatable; out vs PyTorch reference rel err %.2e" % (W, dtype, gpus, e))
    c.close()


def main():
    mokd = sys.argv[1]
    W = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    import torch
    import mok.torch as mt
    gpus = torch.cuda.device_count()
    d = tempfile.mkdtemp(prefix="mok-torch-ep-")
    procs = [start_mokd(mokd, d, i, i % gpus) for i in range(W)]
    fails = []

    def check(cond, what):
        if not cond:
            fails.append(what)
            print("FAIL:", what)
    try:
        for dtype in ("bfloat16", "fp8"):
            run_case(torch, mt, procs, d, W, gpus, dtype, check)
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait(30)
    print("torch EP: %s" % ("FAIL (%d)" % len(fails) if fails else "PASS"))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
