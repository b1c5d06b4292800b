# SPDX-License-Identifier: Apache-2.0
"""mok.torchtitan and mok.hf_transformers through mokd on the GPU (device only).

One process, one cuda-engine mokd at $MOK_SOCKET (tests/gpu/run_torch_integrations.sh).
Against each model's own experts, in bf16 on the GPU:
  1. torchtitan GroupedExperts (tests/python/titan_ref.py: torchtitan's semantics)
     swapped for mok.torchtitan.GroupedExperts on the same Parameters: out, x.grad and
     weight gradients within bf16 tolerance, padding rows 0;
  2. a torchtitan MoE run whole through mokd (mok.torchtitan.use_mok): out, x.grad,
     every gradient (router included) within bf16 tolerance, tokens_per_expert equal;
  3. a tiny random Qwen3-MoE (and Mixtral) from transformers (config only, no
     download): eager experts vs the "mok" experts implementation: loss and every
     gradient within bf16 tolerance, the loss repeatable bitwise, and mokd vs
     moe_reference on the same weights;
  4. staging: mok.torch.MoE on topk_ids / router_weights views 8 bytes past a 16-byte
     boundary, and the binding's torch path with an out= view at such an offset,
     bitwise equal to aligned copies (before: EINVAL "not 16-byte aligned");
  5. the runners with dtype="fp8" on CUDA tensors: a Qwen3-MoE experts module
     (mok.hf_transformers.apply(dtype="fp8")), torchtitan's GroupedExperts and a
     use_mok'd MoE with a shared expert, each bitwise equal to mok.torch.MoE(dtype="fp8")
     on the same weights (out and every gradient), one quantisation per weight per
     optimizer step, and again equal after the step (the cpu engine's version of these
     checks: tests/python/test_torch_integrations_fp8.py).
Prints one line per check and "torch integrations: PASS" when all passed (exit 0).
"""
import copy
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
import titan_ref  # noqa: E402
import mok  # noqa: E402
import mok.torch as mt  # noqa: E402
import mok.torchtitan as mtt  # noqa: E402
import mok.hf_transformers as mhf  # noqa: E402

DEV = torch.device("cuda")
fails = []


def check(cond, what):
    print("%s: %s" % ("ok  " if cond else "FAIL", what), flush=True)
    if not cond:
        fails.append(what)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads(mod, x, d_out, *args):
    xg = x.detach().clone().requires_grad_(True)
    for p in mod.parameters():
        p.grad = None
    out = mod(xg, *args)
    out.backward(d_out)
    torch.cuda.synchronize()
    return out.detach(), xg.grad, {n: p.grad.clone() for n, p in mod.named_parameters()
                                   if p.grad is not None}


def torchtitan_experts(client):
    dim, hid, E = 256, 128, 8
    ex = titan_ref.init(titan_ref.Experts(dim, hid, E), 1).to(DEV, torch.bfloat16)
    m = mtt.GroupedExperts.from_torchtitan(ex, client=client)
    counts = torch.tensor([37, 0, 64, 5, 120, 1, 0, 33], device=DEV)
    N = int(counts.sum()) + 11
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, dim, generator=g).to(DEV, torch.bfloat16)
    d_out = torch.randn(N, dim, generator=g).to(DEV, torch.bfloat16)
    o_r, dx_r, g_r = grads(ex, x, d_out, counts)
    o_m, dx_m, g_m = grads(m, x, d_out, counts)
    check(m.w1 is ex.w1 and m.w2 is ex.w2 and m.w3 is ex.w3, "torchtitan experts: same Parameters")
    check(bool((o_m[-11:] == 0).all()), "torchtitan experts: padding rows 0")
    e = [rel(o_m, o_r), rel(dx_m, dx_r)] + [rel(g_m[n], g_r[n]) for n in ("w1", "w2", "w3")]
    check(e[0] < 1e-2 and max(e[1:]) < 2e-2,
          "torchtitan experts vs its semantics: out %.2e, d_x %.2e, d_w1/w2/w3 %.2e %.2e %.2e"
          % tuple(e))


def torchtitan_moe(client):
    dim, hid, E, K = 256, 128, 16, 4
    ref = titan_ref.init(titan_ref.MoE(dim, hid, E, K), 2).to(DEV, torch.bfloat16)
    m = titan_ref.init(titan_ref.MoE(dim, hid, E, K), 2).to(DEV, torch.bfloat16)
    for mod in (ref, m):
        mod.expert_bias = torch.linspace(-0.01, 0.01, E, device=DEV)
        mod.tokens_per_expert = torch.zeros(E, device=DEV)
    mtt.use_mok(m, client=client)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 96, dim, generator=g).to(DEV, torch.bfloat16)
    d_out = torch.randn(4, 96, dim, generator=g).to(DEV, torch.bfloat16)
    o_r, dx_r, g_r = grads(ref, x, d_out)
    o_m, dx_m, g_m = grads(m, x, d_out)
    worst = max((rel(g_m[n], g_r[n]), n) for n in g_r)
    check(set(g_m) == set(g_r) and rel(o_m, o_r) < 1e-2 and rel(dx_m, dx_r) < 2e-2 and
          worst[0] < 3e-2, "torchtitan MoE through mokd: out %.2e, d_x %.2e, worst gradient "
          "%.2e (%s)" % (rel(o_m, o_r), rel(dx_m, dx_r), worst[0], worst[1]))
    check(torch.equal(m.tokens_per_expert, ref.tokens_per_expert),
          "torchtitan MoE: tokens_per_expert as its own forward keeps them (sum %d)" %
          int(m.tokens_per_expert.sum().item()))


def hf_models():
    try:
        import transformers as tf
    except ImportError as e:
        check(False, "transformers is importable (%s)" % e)
        return []
    print("transformers", tf.__version__, flush=True)
    out = []
    common = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=128)
    if hasattr(tf, "Qwen3MoeConfig"):
        out.append(("Qwen3-MoE", tf.Qwen3MoeConfig(moe_intermediate_size=128, num_experts=16,
                                                     num_experts_per_tok=4, norm_topk_prob=True,
                                                     **common), tf.Qwen3MoeForCausalLM))
    if hasattr(tf, "MixtralConfig"):
        c = dict(common)
        c.pop("head_dim")
        out.append(("Mixtral", tf.MixtralConfig(num_local_experts=8, num_experts_per_tok=2,
                                                 **c), tf.MixtralForCausalLM))
    return out


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.cuda.synchronize()
    return out.loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}


def hf(client):
    for name, cfg, cls in hf_models():
        torch.manual_seed(0)
        model = cls(cfg).to(DEV, torch.bfloat16)
        ids = torch.randint(0, cfg.vocab_size, (4, 128), device=DEV,
                            generator=torch.Generator(DEV).manual_seed(1))
        model.set_experts_implementation("eager")
        # the truth: the same weights in float32 with the model's own experts
        m32 = copy.deepcopy(model).float()
        l32, g32 = loss_and_grads(m32, ids)
        del m32
        l0, g0 = loss_and_grads(model, ids)  # the model's own experts in bf16
        n = mhf.apply(model, client=client)
        l1, g1 = loss_and_grads(model, ids)
        l2, g2 = loss_and_grads(model, ids)
        mods = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
        ran = all("_mok_run" in m.__dict__ and m.__dict__["_mok_run"].slots for m in mods)
        check(n == len(mods) == cfg.num_hidden_layers and ran,
              "%s: %d experts modules run by mokd" % (name, n))
        # bf16 tolerance: mokd's error against float32 at most twice the model's own bf16
        # experts' error plus 2e-2, for every gradient (1.5x + 1e-3 for the loss). Some
        # gradients are sums of many signed terms (a norm weight's, the router's through
        # the renormalised softmax) and have 10-20 % relative error in bf16 whichever
        # experts run; a wrong mapping gives errors of order 1.
        e_own = {k: rel(g0[k], g32[k]) for k in g32}
        e_mok = {k: rel(g1[k], g32[k]) for k in g32}
        bad = [k for k in g32 if e_mok[k] > 2 * e_own[k] + 2e-2]
        worst = max((e_mok[k] - e_own[k], k) for k in g32)
        dl_own, dl_mok = abs(l0 - l32).item() / l32.item(), abs(l1 - l32).item() / l32.item()
        check(set(g1) == set(g32) and not bad and dl_mok <= 1.5 * dl_own + 1e-3,
              "%s through mokd vs its own bf16 experts, both against float32: loss error %.1e "
              "vs %.1e; gradients: worst excess %.1e (%s: %.2e vs %.2e)%s" % (
                  name, dl_mok, dl_own, worst[0], worst[1], e_mok[worst[1]], e_own[worst[1]],
                  "; over tolerance: %s" % ", ".join(bad[:4]) if bad else ""))
        # the loss only: the rest of the model's backward (embedding, attention) uses atomics
        check(torch.equal(l1, l2), "%s through mokd: two forwards give the same loss bits" % name)
        mhf.apply(model, backend="torch")
        l3, g3 = loss_and_grads(model, ids)
        e_ref = {k: rel(g3[k], g32[k]) for k in g32}
        bad = [k for k in g32 if e_mok[k] > 2 * e_ref[k] + 2e-2]
        worst = max((rel(g1[k], g3[k]), k) for k in g3)
        check(abs(l1 - l3).item() / l3.item() < 1e-3 and not bad,
              "%s: mokd vs moe_reference (same roundings, other summation order): loss %.5f "
              "vs %.5f, largest gradient difference %.2e (%s)%s" % (
                  name, l1.item(), l3.item(), worst[0], worst[1],
                  "; over tolerance: %s" % ", ".join(bad[:4]) if bad else ""))


def staging(client):
    H, I, E, K, T0, T = 256, 128, 12, 6, 411, 350
    m = mt.MoE(H, I, E, K, client=client, max_tokens=1024, device=DEV)
    g = torch.Generator().manual_seed(9)
    ids_all = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T0 + T)]).to(
        DEV, torch.int32)
    rw_all = torch.rand((T0 + T, K), generator=g).to(DEV)
    x = (torch.rand((T, H), generator=g) * 2 - 1).to(DEV, torch.bfloat16)
    d_out = (torch.rand((T, H), generator=g) * 2 - 1).to(DEV, torch.bfloat16)
    v_ids, v_rw = ids_all[T0:], rw_all[T0:]

    def run(ids, rw):
        rwg = rw.detach().requires_grad_(True)  # detach keeps the view's offset
        xg = x.clone().requires_grad_(True)
        for p in m.parameters():
            p.grad = None
        out = m(xg, ids, rwg)
        out.backward(d_out)
        torch.cuda.synchronize()
        return [out.detach(), xg.grad, rwg.grad] + [p.grad for p in m.parameters()]

    check(v_ids.data_ptr() % 16 == 8 and v_rw.data_ptr() % 16 == 8,
          "staging: ids[411:761] and rw[411:761] start 8 bytes past 16")
    try:
        a = run(v_ids, v_rw)
        b = run(v_ids.clone(), v_rw.clone())
        check(all(torch.equal(p, q) for p, q in zip(a, b)),
              "staging: MoE on the views bitwise equal to aligned copies (out, d_x, d_rw, "
              "weight grads)")
    except mok.Error as e:
        check(False, "staging: MoE on the views: %s" % e)
    # the binding's torch path: an out= view 8 bytes past 16 is written through a copy
    layer = client.layer(hidden=H, intermediate=I, experts=E, topk=K, dtype="bfloat16",
                         max_tokens=1024)
    ws = [m.w_gate.detach(), m.w_up.detach(), m.w_down.detach()]
    ref, _ = layer.forward(x, v_ids.clone(), v_rw.clone(), *ws)
    buf = torch.zeros(T * H + 4, dtype=torch.bfloat16, device=DEV)
    view = buf[4:].view(T, H)
    out, _ = layer.forward(x, v_ids, v_rw, *ws, out=view)
    torch.cuda.synchronize()
    check(view.data_ptr() % 16 == 8 and out is view and torch.equal(view, ref) and
          bool((buf[:4] == 0).all()),
          "staging: Layer.forward with views in and an out= view at 8 mod 16: bitwise equal")


def fp8_module(client, w_gate, w_up, w_down, shared=(None, None, None), topk=2):
    """mok.torch.MoE(dtype="fp8") holding copies of the given weights."""
    I_s = 0 if shared[0] is None else shared[0].shape[0]
    m = mt.MoE(w_gate.shape[2], w_gate.shape[1], w_gate.shape[0], topk, shared_intermediate=I_s,
               client=client, device=DEV, dtype="fp8")
    with torch.no_grad():
        for n, w in zip(("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"),
                        (w_gate, w_up, w_down) + tuple(shared)):
            if w is not None:
                getattr(m, n).copy_(w)
    return m


def fp8_runners(client):
    """The runners in fp8 against mok.torch.MoE(dtype="fp8") on the same weights, bitwise."""
    H, I, E, K = 256, 128, 8, 2
    g = torch.Generator().manual_seed(11)

    def call(fn, params, x, d_out):
        for p in params:
            p.grad = None
        xg = x.clone().requires_grad_(True)
        out = fn(xg)
        out.backward(d_out)
        torch.cuda.synchronize()
        return [out.detach(), xg.grad] + [p.grad.clone() for p in params]

    def same(a, b):
        return all(torch.equal(p, q) for p, q in zip(a, b)) and len(a) == len(b)

    # transformers: one Qwen3-MoE experts module
    try:
        import transformers as tf
        cfg = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=H, intermediate_size=512,
                                moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, norm_topk_prob=True)
        torch.manual_seed(0)
        model = tf.Qwen3MoeForCausalLM(cfg).to(DEV, torch.bfloat16)
        mhf.apply(model, client=client, dtype="fp8")
        ex = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
        T = 333
        x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
        ids = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :K].to(DEV)
        ids[5, 1] = E  # transformers' sentinel: no expert
        rw = torch.rand(T, K, generator=g).to(DEV)
        d_out = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
        rws = []

        def hf_call(xg):
            r = rw.clone().requires_grad_(True)
            rws.append(r)
            return ex(xg, ids, r)

        def hand_call(m):
            def f(xg):
                r = rw.clone().requires_grad_(True)
                rws.append(r)
                return m(xg, torch.where(ids < E, ids, -1).to(torch.int32), r)
            return f

        for step in range(2):
            got = call(hf_call, [ex.gate_up_proj, ex.down_proj], x, d_out) + [rws[-1].grad]
            gu = ex.gate_up_proj.detach()
            m = fp8_module(client, gu[:, :I], gu[:, I:], ex.down_proj.detach())
            want = call(hand_call(m), [m.w_gate, m.w_up, m.w_down], x, d_out) + [rws[-1].grad]
            want = want[:2] + [torch.cat([want[2], want[3]], 1), want[4], want[5]]
            run = ex.__dict__["_mok_run"]
            check(same(got, want) and run.quantizations == 3 * (step + 1),
                  "fp8 Qwen3-MoE experts (step %d): bitwise equal to MoE(dtype='fp8') on "
                  "gate_up_proj's halves (out, d_x, d_gate_up_proj, d_down_proj, d_rw); "
                  "quantisations %d" % (step, run.quantizations))
            torch.optim.SGD([ex.gate_up_proj, ex.down_proj], lr=0.5).step()
    except ImportError as e:
        check(False, "transformers is importable (%s)" % e)

    # torchtitan: GroupedExperts, then a whole MoE with a shared expert
    ex = titan_ref.init(titan_ref.Experts(H, I, E), 1).to(DEV, torch.bfloat16)
    ge = mtt.GroupedExperts.from_torchtitan(ex, client=client, dtype="fp8")
    counts = torch.tensor([37, 0, 64, 5, 120, 1, 0, 33], device=DEV)
    N = int(counts.sum()) + 11
    x = torch.randn(N, H, generator=g).to(DEV, torch.bfloat16)
    d_out = torch.randn(N, H, generator=g).to(DEV, torch.bfloat16)
    gids = mtt.grouped_ids(counts, N).view(N, 1)
    ones = torch.ones(N, 1, device=DEV)
    for step in range(2):
        got = call(lambda xg: ge(xg, counts), [ge.w1, ge.w3, ge.w2], x, d_out)
        m = fp8_module(client, ex.w1.detach(), ex.w3.detach(), ex.w2.detach(), topk=1)
        want = call(lambda xg: m(xg, gids, ones), [m.w_gate, m.w_up, m.w_down], x, d_out)
        check(same(got, want) and ge._run.quantizations == 3 * (step + 1),
              "fp8 torchtitan GroupedExperts (step %d): bitwise equal to MoE(dtype='fp8'); "
              "quantisations %d" % (step, ge._run.quantizations))
        torch.optim.SGD(ge.parameters(), lr=0.5).step()
    tm = titan_ref.init(titan_ref.MoE(H, I, E, K), 2).to(DEV, torch.bfloat16)
    tm.expert_bias = torch.linspace(-0.01, 0.01, E, device=DEV)
    tm.tokens_per_expert = torch.zeros(E, device=DEV)
    mtt.use_mok(tm, client=client, dtype="fp8")
    sh = tm.shared_experts
    held = [tm.experts.w1, tm.experts.w3, tm.experts.w2, sh.w1.weight, sh.w3.weight,
            sh.w2.weight]
    x3 = torch.randn(2, 150, H, generator=g).to(DEV, torch.bfloat16)
    d3 = torch.randn(2, 150, H, generator=g).to(DEV, torch.bfloat16)
    for step in range(2):
        got = call(tm, held, x3, d3)
        m = fp8_module(client, *[p.detach() for p in held[:3]],
                       shared=[p.detach() for p in held[3:]])

        def hand(xg):
            x2 = xg.reshape(-1, H)
            top, ids, _ = tm.router(x2, tm.expert_bias)
            return m(x2, ids.to(torch.int32), top.float()).reshape(xg.shape)
        want = call(hand, [getattr(m, n) for n in ("w_gate", "w_up", "w_down", "s_gate",
                                                   "s_up", "s_down")], x3, d3)
        check(same(got, want) and tm._mok_run.quantizations == 6 * (step + 1),
              "fp8 torchtitan use_mok with a shared expert (step %d): bitwise equal to "
              "MoE(dtype='fp8'); quantisations %d" % (step, tm._mok_run.quantizations))
        torch.optim.SGD(held, lr=0.5).step()


def main():
    c = mok.connect()
    if c.engine != "cuda":
        print("needs mokd --engine cuda at $MOK_SOCKET")
        return 2
    for f in (torchtitan_experts, torchtitan_moe, hf, staging, fp8_runners):
        try:
            f(c)
        except Exception as e:  # a crash of one part still lets the others report
            import traceback
            traceback.print_exc()
            check(False, "%s raised %s: %s" % (f.__name__, type(e).__name__, e))
    c.close()
    print("torch integrations: %s" % ("PASS" if not fails else "FAIL (%d)" % len(fails)))
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
