# SPDX-License-Identifier: Apache-2.0
"""One process of tests/python/test_torch_distributed.py (spawned; gloo, cpu-engine mokd).

Runs every scenario in order and pickles {scenario: result} into OUTDIR/rank<r>.pkl:
a result is {"ok": ...data...} or {"error": (status, message, seconds)}.
"""
import os
import pickle
import sys
import time
import traceback

import numpy as np

H, I, K, TMAX = 16, 8, 2, 12
E3 = 6  # experts of the world group (3 ranks) and of the subgroup (2 ranks)
T_OF = {0: 12, 1: 7, 2: 10}  # tokens per global rank


def inputs(seed, T, E):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    ids[::4, 1] = -1
    rw = rng.uniform(0.1, 0.9, (T, K)).astype(np.float32)
    d_out = rng.standard_normal((T, H)).astype(np.float32)
    return x, ids, rw, d_out


def weights(seed, E):
    rng = np.random.default_rng(seed)
    return [(0.3 * rng.standard_normal(s)).astype(np.float32)
            for s in ((E, I, H), (E, I, H), (E, H, I))]


H8 = I8 = 128  # fp8 modules: whole 128-blocks
FP8_ORDER = ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")


def fp8_masters(E):
    """bf16 masters of an fp8 MoE of E experts (with a shared expert), the same everywhere."""
    import torch
    gen = torch.Generator().manual_seed(7)
    shapes = {"w_gate": (E, I8, H8), "w_up": (E, I8, H8), "w_down": (E, H8, I8),
              "s_gate": (I8, H8), "s_up": (I8, H8), "s_down": (H8, I8)}
    return {n: (0.1 * torch.randn(s, generator=gen)).to(torch.bfloat16)
            for n, s in shapes.items()}


def fp8_inputs(seed, T, E):
    import torch
    x, ids, rw, _ = inputs(seed, T, E)
    rng = np.random.default_rng(seed + 1000)
    x = torch.from_numpy(rng.standard_normal((T, H8)).astype(np.float32)).to(torch.bfloat16)
    d_out = torch.from_numpy(rng.standard_normal((T, H8)).astype(np.float32)).to(torch.bfloat16)
    return x, torch.from_numpy(ids), torch.from_numpy(rw), d_out


def fp8_step(m, masters, first, x, ids, rw, d_out):
    """Load the masters (experts first ..) into MoE m, forward and backward: float32 numpy
    arrays of out, the input gradients and the weight gradients."""
    import torch
    El = m.w_gate.shape[0]
    with torch.no_grad():
        for n, w in masters.items():
            getattr(m, n).copy_(w[first:first + El] if n.startswith("w_") else w)
    x = x.clone().requires_grad_()
    rw = rw.clone().requires_grad_()
    out = m(x, ids, rw)
    out.backward(d_out)
    res = {"out": out, "d_x": x.grad, "d_rw": rw.grad}
    res.update({"d_" + n: getattr(m, n).grad for n in masters})
    res = {k: v.detach().float().numpy() for k, v in res.items()}
    res["quantizations"] = m.quantizations
    return res


def run_layer(c, g, r_global, E):
    """forward + backward of this rank's tokens on a group layer (numpy, f32)."""
    layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K, group=g, group_tag=3)
    El = g.local_experts
    wg, wu, wd = weights(1, E)
    sl = slice(g.rank * El, (g.rank + 1) * El)
    x, ids, rw, d_out = inputs(20 + r_global, T_OF[r_global], E)
    out, ctx = layer.forward(x, ids, rw, wg[sl], wu[sl], wd[sl])
    gr = layer.backward(ctx, d_out)
    layer.close()
    return {"out": out, "d_x": gr.d_x, "d_rw": gr.d_router_weights, "d_w_gate": gr.d_w_gate,
            "d_w_up": gr.d_w_up, "d_w_down": gr.d_w_down, "rank": g.rank, "world": g.world,
            "key": g.key, "transport": g.transport, "first_expert": g.first_expert}


def main(r, world, port, socks, outdir):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist
    import mok
    import mok.distributed as md
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=r,
                            world_size=world)
    sub = dist.new_group([1, 2])  # collective over WORLD: every rank makes it
    res = {}
    c = mok.connect(socks[r])
    sz = dict(max_tokens=TMAX, hidden=H, topk=K, experts=E3, timeout_ms=5000)

    def attempt(name, fn):
        t0 = time.time()
        try:
            res[name] = {"ok": fn()}
        except mok.Error as e:
            res[name] = {"error": (e.status, e.message, time.time() - t0)}
        except Exception:
            res[name] = {"error": ("PYTHON", traceback.format_exc(), time.time() - t0)}

    # the world group: 3 ranks, 3 daemons
    def world_ok():
        g = md.join(c, None, **sz)
        out = run_layer(c, g, r, E3)
        g.leave()
        return out
    attempt("world", world_ok)

    # a subgroup of global ranks 1 and 2: its rank 0 is global rank 1
    if r in (1, 2):
        def sub_ok():
            g = md.join(c, sub, **sz)
            out = run_layer(c, g, r, E3)
            g.leave()
            return out
        attempt("sub", sub_ok)

    # ranks disagree on the sizing: every rank raises, nobody joins
    bad = dict(sz, hidden=H + 8 if r == 2 else H)
    attempt("mismatch", lambda: md.join(c, None, **bad))

    # one rank's join fails at its daemon (rank 1 joins through rank 0's mokd: one rank
    # per daemon per group, so one of the two is refused): every rank raises
    c2 = mok.connect(socks[0]) if r == 1 else c
    attempt("join_fails", lambda: md.join(c2, None, **sz))
    if c2 is not c:
        c2.close()

    # a rank that never reports in time (its join takes 4 s, the others wait 1.5 s)
    real_group = md.Group
    if r == 2:
        def slow(*a, **kw):
            time.sleep(4)
            raise mok.Error("EENGINE", "test: this rank's join hangs")
        md.Group = slow
    attempt("missing", lambda: md.join(c, None, agree_timeout_s=1.5, **sz))
    md.Group = real_group
    dist.barrier()  # rank 2 finishes its slow join before the next scenario

    # a closed client on one rank: every rank raises before any join
    c3 = mok.connect(socks[r])
    if r == 0:
        c3.close()
    attempt("closed", lambda: md.join(c3, None, **sz))
    c3.close()

    # the cpu engine has no NCCL groups: refused on every rank, before any join
    attempt("nccl_cpu", lambda: md.join(c, None, transport="nccl", **sz))

    # after all that, the world group forms again and computes the same bits
    attempt("again", world_ok)

    # mok.torch.MoE(group=process_group): one join shared by the modules of a group,
    # group tags in creation order (the modules need CUDA to run; here only built)
    def moe_build():
        import mok.torch as mt
        m1 = mt.MoE(H, I, E3, K, client=c, group=dist.group.WORLD, max_tokens=TMAX,
                    group_options={"timeout_ms": 5000})
        m2 = mt.MoE(H, 2 * I, E3, K, client=c, group=dist.group.WORLD, max_tokens=TMAX,
                    group_options={"timeout_ms": 5000})
        out = {"same_group": m1.group is m2.group, "tags": (m1.group_tag, m2.group_tag),
               "w_gate": tuple(m1.w_gate.shape), "w_down2": tuple(m2.w_down.shape),
               "rank": m1.group.rank, "world": m1.group.world, "repr": repr(m1)}
        try:
            mt.MoE(H, I, E3, K, client=c, group=dist.group.WORLD)
        except (mok.Error, ValueError) as e:
            out["no_max_tokens"] = str(e)
        return out
    attempt("moe", moe_build)

    # mok.torch.MoE(dtype="fp8") on the process group, CPU tensors on the cpu engine: each
    # rank packs its local experts' masters (the test holds the results against the fp8
    # module without a group)
    def moe_fp8():
        import mok.torch as mt
        m = mt.MoE(H8, I8, E3, K, shared_intermediate=I8, client=c, group=dist.group.WORLD,
                   max_tokens=TMAX, dtype="fp8", group_options={"timeout_ms": 5000})
        out = fp8_step(m, fp8_masters(E3), r * (E3 // world), *fp8_inputs(40 + r, T_OF[r], E3))
        out.update(rank=m.group.rank, world=m.group.world, repr=repr(m),
                   packed=m.packed_weights["w_gate"].numel())
        return out
    attempt("moe_fp8", moe_fp8)

    c.close()
    with open(os.path.join(outdir, "rank%d.pkl" % r), "wb") as f:
        pickle.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","),
         sys.argv[5])
