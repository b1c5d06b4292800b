# SPDX-License-Identifier: Apache-2.0
"""mok.torch on mokd --engine cuda (device only; $MOK_SOCKET; $MOKCTL names mokctl).

Checks what docs/torch.md claims:
  1. MoE forward and every gradient (d_x, d_router_weights, routed and shared weights)
     against mok.torch.moe_reference (plain PyTorch, same roundings) within bf16 tolerance;
     dropped slots (-1) get no gradient.
  2. recompute=True gives the same bits as the saved ctx; two runs give the same bits.
  3. gradients accumulate into .grad: two backward passes give exactly g1 + g2 (bf16 add).
  4. registrations: a steady step registers nothing new, and the counter equals mokd's own
     count of the session's regions (mokctl status --json).
  5. torch.compile: the MoE call is a custom op, no graph break (explain), the compiled
     model's loss and gradients match eager, fullgraph=True too; mode="reduce-overhead" (CUDA graphs
     around the compiled parts) runs and matches.
  6. CUDA graph capture of the layer: a standing job, replays equal to eager.
"""
import json
import os
import subprocess
import sys

import torch

import mok
import mok.torch as mt

fails = []


def check(ok, what):
    print("%s %s" % ("PASS" if ok else "FAIL", what), flush=True)
    if not ok:
        fails.append(what)


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(T, H, I, E, K, Is, dev, seed=0, **kw):
    torch.manual_seed(seed)
    m = mt.MoE(H, I, E, K, shared_intermediate=Is, device=dev, **kw)
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    logits = torch.randn(T, E, device=dev)
    ids = logits.topk(K, -1).indices.to(torch.int32)
    ids[::7, K - 1] = -1
    rw = logits.softmax(-1).gather(-1, ids.clamp_min(0).long()).contiguous()
    d_out = torch.randn(T, H, device=dev).to(torch.bfloat16)
    return m, x, ids, rw, d_out


def run(m, x, ids, rw, d_out):
    xg = x.clone().requires_grad_()
    rg = rw.clone().requires_grad_()
    for p in m.parameters():
        p.grad = None
    out = m(xg, ids, rg)
    out.backward(d_out)
    torch.cuda.synchronize()
    return [out.detach(), xg.grad, rg.grad] + [p.grad.clone() for p in m.parameters()]


def session_regions(client):
    mokctl = os.environ.get("MOKCTL", "mokctl")
    try:
        js = json.loads(subprocess.run([mokctl, "--socket", os.environ["MOK_SOCKET"], "status",
                                        "--json"], capture_output=True, text=True,
                                       timeout=20).stdout)
    except Exception as e:  # noqa: BLE001
        print("  (mokctl: %s)" % e)
        return None
    for s in js.get("sessions", []):
        if s.get("id") == client.session:
            return s.get("regions")
    return None


def main():
    dev = torch.device("cuda")
    client = mok.connect()
    assert client.engine == "cuda", client.engine
    mt.set_default_client(client)
    names = ["out", "d_x", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down", "d_s_gate",
             "d_s_up", "d_s_down"]

    # 1. against plain PyTorch
    T, H, I, E, K, Is = 300, 256, 128, 8, 2, 96
    m, x, ids, rw, d_out = make(T, H, I, E, K, Is, dev)
    got = run(m, x, ids, rw, d_out)
    m.backend = "torch"
    want = run(m, x, ids, rw, d_out)
    m.backend = "mokd"
    errs = {n: rel(g, w) for n, g, w in zip(names, got, want)}
    check(all(e < 2e-2 for e in errs.values()),
          "MoE vs moe_reference (T=%d H=%d I=%d E=%d K=%d I_s=%d, 1/7 slots dropped): %s" %
          (T, H, I, E, K, Is, ", ".join("%s %.1e" % kv for kv in errs.items())))
    check(bool((got[2][::7, K - 1] == 0).all()), "dropped slots get d_router_weights = 0")
    check(all(torch.isfinite(g.float()).all().item() for g in got), "every output finite")

    # 2. recompute and repeatability
    again = run(m, x, ids, rw, d_out)
    check(all(torch.equal(a, b) for a, b in zip(got, again)), "a second run: bitwise equal")
    m.recompute = True
    rec = run(m, x, ids, rw, d_out)
    m.recompute = False
    check(all(torch.equal(a, b) for a, b in zip(got, rec)),
          "recompute=True: bitwise equal to the saved ctx")

    # 3. accumulation into .grad
    xg = x.clone().requires_grad_()
    rg = rw.clone().requires_grad_()
    for p in m.parameters():
        p.grad = None
    m(xg, ids, rg).backward(d_out)
    m(xg, ids, rg).backward(d_out)
    torch.cuda.synchronize()
    acc = [xg.grad, rg.grad] + [p.grad for p in m.parameters()]
    check(all(torch.equal(a, g + g) for a, g in zip(acc, got[1:])),
          "two backward passes accumulate: .grad == g + g bitwise (x, router weights, weights)")

    # 4. registrations
    m2, x2, ids2, rw2, d2 = make(1024, 256, 256, 16, 4, 0, dev, seed=1)
    opt = torch.optim.SGD(m2.parameters(), lr=1e-3)
    counts = []
    for step in range(12):
        xg = x2.clone().requires_grad_()
        rg = rw2.clone().requires_grad_()
        opt.zero_grad(set_to_none=True)
        (m2(xg, ids2, rg).float().square().mean() + rg.sum()).backward()
        opt.step()
        torch.cuda.synchronize()
        counts.append(mt.registrations(client))
    regions = session_regions(client)
    check(counts[2] == counts[-1],
          "registrations after steps 1..12: %s (steady from step 3)" % counts)
    check(regions is not None and regions == counts[-1],
          "mok.torch.registrations() = %d, mokd's count of the session's regions = %s" %
          (counts[-1], regions))

    # 5. torch.compile
    import torch._dynamo as dynamo
    torch.manual_seed(3)
    router = torch.nn.Linear(256, 8, bias=False, device=dev)
    mc = mt.MoE(256, 128, 8, 2, shared_intermediate=64, device=dev)
    xin = torch.randn(512, 256, device=dev)

    def model(xx):
        h = torch.nn.functional.layer_norm(xx, (256,))
        p = router(h).softmax(-1)
        rw_, ids_ = p.topk(2, -1)
        y = mc(h.to(torch.bfloat16), ids_.to(torch.int32), rw_)
        return (y.float() * 2 + h).square().mean()

    def grads_of(fn):
        for p in list(router.parameters()) + list(mc.parameters()):
            p.grad = None
        loss = fn(xin)
        loss.backward()
        torch.cuda.synchronize()
        return [loss.detach()] + [p.grad.clone() for p in list(router.parameters()) +
                                  list(mc.parameters())]

    eager = grads_of(model)
    dynamo.reset()
    ex = dynamo.explain(model)(xin)
    reasons = [str(getattr(b, "reason", b)) for b in ex.break_reasons]
    print("  explain: %d graphs, %d graph breaks: %s" % (ex.graph_count, ex.graph_break_count,
                                                         [r.split("\n")[0] for r in reasons]))
    check(ex.graph_break_count == 0,
          "torch.compile: the MoE call is a custom op, no graph break")
    dynamo.reset()
    comp = grads_of(torch.compile(model))
    errs = [rel(a, b) for a, b in zip(comp, eager)]
    check(max(errs) < 2e-2, "torch.compile (inductor): loss and gradients match eager "
          "(largest relative difference %.1e)" % max(errs))
    dynamo.reset()
    full = grads_of(torch.compile(model, fullgraph=True))
    errs = [rel(a, b) for a, b in zip(full, eager)]
    check(max(errs) < 2e-2, "torch.compile(fullgraph=True): loss and gradients match eager "
          "(largest relative difference %.1e)" % max(errs))
    dynamo.reset()
    try:
        ro = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):
            red = grads_of(ro)
        errs = [rel(a, b) for a, b in zip(red, eager)]
        check(max(errs) < 2e-2, "torch.compile(mode='reduce-overhead'): runs, matches eager "
              "(largest relative difference %.1e)" % max(errs))
    except Exception as e:  # noqa: BLE001
        check(False, "torch.compile(mode='reduce-overhead') failed: %s: %s" %
              (type(e).__name__, str(e)[:300]))
    dynamo.reset()

    # 6. CUDA graph capture
    xg = x.clone()
    m(xg, ids, rw)  # warm (the layer exists, the allocations are registered)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        yg = m(xg, ids, rw)  # a standing job (docs/cuda.md "Capture and replay")
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    mt.check_graphs(client)
    check(torch.equal(yg, got[0]), "a captured forward replayed gives the eager output, bitwise")
    after = run(m, x, ids, rw, d_out)
    check(all(torch.equal(a, b) for a, b in zip(got, after)),
          "after the capture the layer still runs eagerly, same bits")

    client.synchronize()
    client.close()
    print("test_torch_moe: %s (%d failures)" % ("passed" if not fails else "FAILED",
                                                len(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
