#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A Hugging Face transformers v5 MoE model with its experts run by mokd.

Builds a tiny Qwen3-MoE causal LM from a config with random weights (nothing is
downloaded), runs a few training steps with the model's own experts and then with
mok's ("mok" in transformers' ExpertsInterface, mok.hf_transformers.apply), from the
same weights and batches, and prints both loss curves. transformers v5 keeps each
layer's experts as gate_up_proj [E, 2*I, H] and down_proj [E, H, I]; down_proj is
mok's w_down as it is, gate_up_proj is split into mok's w_gate and w_up by one copy
per call (docs/torch.md, "Hugging Face transformers").

  MOK_SOCKET=/tmp/mokd.sock PYTHONPATH=client/python \\
      python3 client/python/examples/hf_transformers_moe.py [--steps 20] [--model mixtral]

Needs mokd --engine cuda at $MOK_SOCKET, a GPU, torch and transformers >= 5.
--backend torch runs mok's plain-PyTorch reference instead of mokd (no daemon; also on
the CPU with --device cpu). Exits 1 when the two curves part by more than bf16
rounding can explain (--tol, relative, default 2e-2), 2 when something is missing.
"""
import argparse
import copy
import sys
import time


def build(name, device):
    import torch
    import transformers as tf
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if name == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(head_dim=64, moe_intermediate_size=128, num_experts=16,
                                num_experts_per_tok=4, norm_topk_prob=True, **common)
        cls = tf.Qwen3MoeForCausalLM
    elif name == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
    else:
        raise SystemExit("unknown --model %s" % name)
    torch.manual_seed(0)
    model = cls(cfg).to(device, torch.bfloat16)
    model.set_experts_implementation("eager")  # the model's own experts, for the comparison
    return model, cfg


def train(model, batches, lr):
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for ids in batches:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return losses, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--backend", default="mokd", choices=["mokd", "torch"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tol", type=float, default=2e-2)
    a = ap.parse_args()
    try:
        import torch
        import transformers
        import mok.hf_transformers as mhf
    except ImportError as e:
        print("needs torch and transformers: %s" % e)
        return 2
    print("torch %s, transformers %s" % (torch.__version__, transformers.__version__))
    model, cfg = build(a.model, a.device)
    g = torch.Generator(a.device).manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size // 4, (a.batch, a.seq), device=a.device,
                             generator=g) for _ in range(a.steps)]  # a skewed vocabulary
    twin = copy.deepcopy(model)
    own, t_own = train(model, batches, a.lr)
    try:
        n = mhf.apply(twin, backend=a.backend)
    except Exception as e:  # no daemon, not the cuda engine
        print("mok: %s" % e)
        return 2
    print("%s: %d experts modules through %s (experts implementation %r)" % (
        a.model, n, a.backend, twin.config._experts_implementation))
    ours, t_ours = train(twin, batches, a.lr)
    print("step  own experts   mok        rel diff")
    worst = 0.0
    for i, (p, q) in enumerate(zip(own, ours)):
        d = abs(p - q) / abs(p)
        worst = max(worst, d)
        print("%4d  %.5f    %.5f    %.1e" % (i, p, q, d))
    mid = len(t_own) // 2
    print("step time (second half, median): own %.1f ms, mok %.1f ms" % (
        1e3 * sorted(t_own[mid:])[len(t_own[mid:]) // 2],
        1e3 * sorted(t_ours[mid:])[len(t_ours[mid:]) // 2]))
    fell = ours[-1] < ours[0]
    print("loss %s (%.4f -> %.4f); largest relative difference from the model's own "
          "experts %.1e (tolerance %.0e)" % ("falls" if fell else "DOES NOT FALL", ours[0],
                                            ours[-1], worst, a.tol))
    return 0 if fell and worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
