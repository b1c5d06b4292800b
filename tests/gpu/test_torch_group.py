# SPDX-License-Identifier: Apache-2.0
"""mok.torch.MoE(group=process_group) on the GPU (device only; docs/torch.md).

Run by torchrun, one process per rank, each with its own cuda-engine mokd
($MOK_TEST_SOCKETS: one socket per rank, comma-separated; see
tests/gpu/run_torch_integrations.sh):

    torchrun --nproc-per-node 2 tests/gpu/test_torch_group.py OUTDIR [--backend B]

B: nccl (ranks on distinct GPUs), gloo, or auto (default: nccl when every rank has a
GPU of its own, else gloo; NCCL refuses two ranks of one communicator on one GPU, so
two ranks sharing one GPU under MPS use gloo for torch's collectives; mok's own group
is then a host group, and through NCCL when the GPUs are distinct).

Each rank builds two MoE modules on dist.group.WORLD (one join, tags 0 and 1), holding
its slice of one seeded set of experts, and runs forward and backward on its tokens:
rank r's rows of one global batch, so rank 1's topk_ids and router_weights are views
ids[411:761] of int32/float32 [761, 6] tensors, 8 bytes past a 16-byte boundary
(staged by mok.torch). Rank 0 then runs the same two layers as EP=1 modules (every
expert, no group) on the whole batch and checks: out, x.grad, router_weights.grad and
the routed weight gradients of both layers bitwise equal to EP=1 and repeatable, out
close to the plain-PyTorch reference, the staged views bitwise equal to aligned
copies; then a sizing mismatch fails on both ranks with mok.Error (no hang).
Prints "torch group: PASS" on rank 0 and exits 0 on every rank when all passed.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import mok
import mok.distributed as md
import mok.torch as mt

H, I, E, K, IS = 256, 128, 12, 6, 64
SPLIT = [0, 411, 761]  # rank r's rows: SPLIT[r]:SPLIT[r+1]
T_MAX = 512


def weights(seed, inter):
    g = torch.Generator().manual_seed(seed)

    def bf(shape, scale):
        return ((torch.rand(shape, generator=g) * 2 - 1) * scale).to(torch.bfloat16)
    return {"w_gate": bf((E, inter, H), 4 / H ** 0.5), "w_up": bf((E, inter, H), 4 / H ** 0.5),
            "w_down": bf((E, H, inter), 3 / inter ** 0.5), "s_gate": bf((IS, H), 4 / H ** 0.5),
            "s_up": bf((IS, H), 4 / H ** 0.5), "s_down": bf((H, IS), 3 / IS ** 0.5)}


def batch():
    g = torch.Generator().manual_seed(77)
    T = SPLIT[-1]
    x = (torch.rand((T, H), generator=g) * 2 - 1).to(torch.bfloat16)
    d_out = (torch.rand((T, H), generator=g) * 2 - 1).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[::7, K - 1] = -1
    rw = torch.rand((T, K), generator=g)
    return x, ids, rw, d_out


def load(m, wt, lo, hi):
    with torch.no_grad():
        for n in ("w_gate", "w_up", "w_down"):
            getattr(m, n).copy_(wt[n][lo:hi])
        for n in ("s_gate", "s_up", "s_down"):
            getattr(m, n).copy_(wt[n])


def step(mods, x, ids, rw, d_out):
    """forward through both layers (the second on the first's output), backward."""
    xg = x.detach().clone().requires_grad_(True)
    rwg = rw.detach().requires_grad_(True)  # detach keeps a view's offset (rank 1's rows)
    for m in mods:
        for p in m.parameters():
            p.grad = None
    h = mods[0](xg, ids, rwg)
    out = mods[1](h, ids, rwg)
    out.backward(d_out)
    torch.cuda.synchronize()
    res = {"out": out.detach().cpu(), "d_x": xg.grad.cpu(), "d_rw": rwg.grad.cpu()}
    for i, m in enumerate(mods):
        for n, p in m.named_parameters():
            res["%d.d_%s" % (i, n)] = p.grad.cpu()
    return res


def main():
    outdir = sys.argv[1]
    backend = "auto"
    if "--backend" in sys.argv:
        backend = sys.argv[sys.argv.index("--backend") + 1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    gpus = torch.cuda.device_count()
    if backend == "auto":
        backend = "nccl" if gpus >= world else "gloo"
    torch.cuda.set_device(local % gpus)
    dev = torch.device("cuda", local % gpus)
    dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    socks = os.environ["MOK_TEST_SOCKETS"].split(",")
    fails = []

    def check(cond, what):
        if not cond:
            fails.append(what)
            print("[rank %d] FAIL: %s" % (rank, what), flush=True)

    c = mok.connect(socks[rank])
    t0 = time.time()
    opts = {"timeout_ms": 20000}
    mods = [mt.MoE(H, inter, E, K, shared_intermediate=IS, client=c, group=dist.group.WORLD,
                   max_tokens=T_MAX, group_options=opts, device=dev) for inter in (I, 2 * I)]
    g = mods[0].group
    print("[rank %d] backend %s, joined %r through %s in %.0f ms; tags %s" % (
        rank, backend, g, g.transport, 1e3 * (time.time() - t0),
        [m.group_tag for m in mods]), flush=True)
    check(mods[1].group is g and [m.group_tag for m in mods] == [0, 1], "one join, tags 0, 1")
    # rank r's mokd runs on GPU r % GPUs: NCCL when every rank has its own GPU
    check(g.transport == ("nccl" if gpus >= world else "host"), "transport %s" % g.transport)
    El = E // world
    for m, inter in zip(mods, (I, 2 * I)):
        load(m, weights(5 + inter, inter), rank * El, (rank + 1) * El)
    x, ids, rw, d_out = batch()
    lo, hi = SPLIT[rank], SPLIT[rank + 1]
    ids_d, rw_d = ids.to(dev), rw.to(dev)
    v_ids, v_rw = ids_d[lo:hi], rw_d[lo:hi]  # views of the whole batch's tensors
    if rank == 1:
        check(v_ids.data_ptr() % 16 == 8 and v_rw.data_ptr() % 16 == 8,
              "rank 1's views are 8 bytes past 16 (%d, %d)" % (v_ids.data_ptr() % 16,
                                                               v_rw.data_ptr() % 16))
    mine = (x[lo:hi].to(dev), v_ids, v_rw, d_out[lo:hi].to(dev))
    a = step(mods, *mine)
    b = step(mods, *mine)
    cl = step(mods, mine[0], v_ids.clone(), v_rw.clone(), mine[3])  # aligned copies
    for n in a:
        check(torch.equal(a[n], b[n]), "%s not repeatable" % n)
        check(torch.equal(a[n], cl[n]), "%s: the staged views differ from aligned copies" % n)
    torch.save(a, os.path.join(outdir, "group_rank%d.pt" % rank))
    dist.barrier()

    if rank == 0:
        ones = [mt.MoE(H, inter, E, K, shared_intermediate=IS, client=c, max_tokens=1024,
                       device=dev) for inter in (I, 2 * I)]
        refs = [mt.MoE(H, inter, E, K, shared_intermediate=IS, backend="torch", device=dev)
                for inter in (I, 2 * I)]
        for m, r, inter in zip(ones, refs, (I, 2 * I)):
            load(m, weights(5 + inter, inter), 0, E)
            load(r, weights(5 + inter, inter), 0, E)
        full = (x.to(dev), ids_d, rw_d, d_out.to(dev))
        one = step(ones, *full)
        r64 = step(refs, *full)
        res = [a] + [torch.load(os.path.join(outdir, "group_rank%d.pt" % r))
                     for r in range(1, world)]
        for r in range(world):
            rows = slice(SPLIT[r], SPLIT[r + 1])
            for n in ("out", "d_x", "d_rw"):
                check(torch.equal(res[r][n], one[n][rows]), "rank %d %s != EP=1" % (r, n))
            for i in range(2):
                for n in ("w_gate", "w_up", "w_down"):
                    k = "%d.d_%s" % (i, n)
                    check(torch.equal(res[r][k], one[k][r * El:(r + 1) * El]),
                          "rank %d %s != EP=1 (its experts)" % (r, k))
        for i in range(2):
            for n in ("s_gate", "s_up", "s_down"):
                k = "%d.d_%s" % (i, n)
                s = sum(res[r][k].float() for r in range(world))
                e = (s - one[k].float()).abs().max().item() / one[k].float().abs().max().item()
                check(e < 2e-2, "%s summed over ranks vs EP=1: rel err %.3g" % (k, e))
        out = torch.cat([res[r]["out"] for r in range(world)]).float()
        e = (out - r64["out"].float()).abs().max().item() / r64["out"].float().abs().max().item()
        check(e < 3e-2, "out vs the PyTorch reference: rel err %.3g" % e)
        print("[rank 0] EP=%d (%s, mok %s group): out, d_x, d_rw, routed weight grads of both "
              "layers bitwise equal to EP=1 and repeatable; staged views bitwise equal to "
              "aligned copies; out vs PyTorch reference rel err %.2e" % (
                  world, backend, g.transport, e), flush=True)

    # ranks that disagree on the sizing: both raise, nobody hangs
    t0 = time.time()
    try:
        md.join(c, None, max_tokens=T_MAX, hidden=H + 8 * rank, topk=K, experts=E,
                dtype="bfloat16", timeout_ms=5000)
        check(False, "a sizing mismatch was accepted")
    except mok.Error as e:
        check(e.status == "EINVAL" and "disagree on the group's hidden" in str(e),
              "mismatch message: %s" % e)
        print("[rank %d] sizing mismatch: %s (%.2f s)" % (rank, e, time.time() - t0),
              flush=True)

    ok = torch.tensor([len(fails)], dtype=torch.int64, device=dev if backend == "nccl"
                      else "cpu")
    dist.all_reduce(ok)
    c.close()
    dist.destroy_process_group()
    if rank == 0:
        print("torch group: %s" % ("PASS" if ok.item() == 0 else "FAIL (%d)" % ok.item()),
              flush=True)
    return 0 if ok.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
