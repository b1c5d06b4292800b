#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""FP8 accuracy runs: a model trained with fp8 MoE layers beside the same model with bf16
ones, from the same initial weights and the same batches, both through mokd on the engine
at $MOK_SOCKET (--socket): the cuda engine on CUDA tensors, the cpu engine on CPU tensors.

  tiny   the example model (client/python/examples/train_tiny_moe.py, TinyMoE(dtype=):
         2 layers, H=128, I=256, I_s=128, E=8, K=2, T=1024 tokens per MoE call), 300
         AdamW steps of its reversal task with a language model's loss over every
         position (the random first half keeps 7/16 ln 15 = 1.185 nats that no model
         removes, as text keeps its own entropy). Passes when fp8's final loss (the mean
         of the last 10 steps) is within 1 % of bf16's.
  qwen3  transformers' Qwen3MoeForCausalLM (5.x) from a tiny random config built here,
         nothing downloaded (hidden 512, moe_intermediate_size 256, 8 experts, top-2, 2
         layers, vocab 1024), its experts through mok.hf_transformers.apply(model,
         dtype=), 50 AdamW steps on a fixed synthetic stream: a random sparse Markov chain
         (each token followed by one of 4 tokens drawn once, so ln 4 = 1.39 nats is the
         floor). Passes when fp8's final loss (the mean of the last 5 steps) is within 2 %
         of bf16's.

Each run also checks that both dtypes learn (final loss below 3/4 of the first steps'),
that fp8 ran (one quantisation per weight per step; losses not bf16's bits) and that the
losses are finite. Why the tiny run's loss is over every position: on the reversed half
alone the task learns through a sharp drop off a plateau whose timing moves with any
rounding (docs/torch.md "The example"), so at step 300 two runs can sit on either side of
it whatever their precision, and its loss tends to 0, where a relative bound means
nothing (docs/torch.md "FP8 accuracy runs" has the measurements).

Writes OUT/fp8_accuracy_<run>.json (configuration, every loss, the checks, the verdict)
and prints a table per run. Exit status 0 when every run passed, 1 when a check failed,
2 when something is missing (no daemon, no transformers, the cuda engine without CUDA).
--smoke: a few steps of smaller models (CI on the cpu engine): the plumbing, not the
bounds' meaning (the learning check is left out).

  MOK_SOCKET=/tmp/mokd.sock PYTHONPATH=client/python \\
      python3 tests/gpu/fp8_accuracy.py --out DIR [tiny] [qwen3]
"""
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (tiny run)

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))

DTYPES = ("bfloat16", "fp8")


def tiny_config(smoke):
    """The example's defaults (train_tiny_moe.py) on its plain reversal task."""
    return types.SimpleNamespace(task="reverse", loss_on="all", seed=1234, vocab=16, seq=8,
                                 batch=16 if smoke else 64, hidden=128, intermediate=256,
                                 shared=128, experts=8, topk=2, layers=2, heads=4, lr=3e-3,
                                 warmup=20, aux_coef=0.01)


def run_tiny(client, dev, steps, smoke, log):
    import torch
    import train_tiny_moe as ex
    cfg = tiny_config(smoke)
    ex.deterministic()
    res = dict(config=vars(cfg), losses={}, quantizations={}, seconds={})
    every = max(1, steps // 6)
    for dtype in DTYPES:
        def log_step(s, v, dtype=dtype):
            if s % every == 0 or s == steps - 1:
                log("  [tiny %s] step %4d  loss %.4f" % (dtype, s, v))
        t0 = time.perf_counter()
        losses, _, q = ex.train_losses(cfg, dtype, client, dev, steps, log=log_step)
        res["losses"][dtype], res["quantizations"][dtype] = losses, q
        res["seconds"][dtype] = time.perf_counter() - t0
    # every weight of both layers once per step (6 each: w_gate..s_down), none in bf16
    res["quantizations_expected"] = {"bfloat16": [0] * cfg.layers,
                                     "fp8": [6 * steps] * cfg.layers}
    torch.use_deterministic_algorithms(False)
    return res


def markov_stream(vocab, branches, batch, seq, steps, seed):
    """`steps` batches [batch, seq] of a random sparse Markov chain: each token is followed
    by one of `branches` successors drawn once from the seed (uniformly), the first token
    uniform. Drawn on the CPU, the same for every run."""
    import torch
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, branches), generator=g)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, vocab, (batch,), generator=g)
        cols = [tok]
        for _ in range(seq - 1):
            tok = succ[tok, torch.randint(0, branches, (batch,), generator=g)]
            cols.append(tok)
        out.append(torch.stack(cols, 1))
    return out


def qwen3_config(smoke):
    if smoke:
        return dict(vocab_size=256, hidden_size=256, moe_intermediate_size=128, num_experts=4,
                    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, intermediate_size=512,
                    max_position_embeddings=64, norm_topk_prob=True), dict(batch=2, seq=32)
    return dict(vocab_size=1024, hidden_size=512, moe_intermediate_size=256, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, intermediate_size=1024,
                max_position_embeddings=256, norm_topk_prob=True), dict(batch=16, seq=128)


def run_qwen3(client, dev, steps, smoke, log):
    import torch
    import transformers as tf
    import mok.hf_transformers as mhf
    model_cfg, data = qwen3_config(smoke)
    train = dict(lr=3e-3, warmup=5, branches=4, seed=7, clip=1.0, **data)
    torch.manual_seed(train["seed"])
    base = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**model_cfg)).to(torch.bfloat16)
    batches = markov_stream(model_cfg["vocab_size"], train["branches"], train["batch"],
                            train["seq"], steps, train["seed"] + 1)
    res = dict(config=dict(model=model_cfg, train=train,
                           transformers=tf.__version__), losses={}, quantizations={},
               seconds={})
    # the attention and embedding backward of the model are not bitwise repeatable on a
    # GPU; the comparison needs the same start and batches, which it has
    torch.use_deterministic_algorithms(False)
    for dtype in DTYPES:
        model = copy.deepcopy(base).to(dev)
        n = mhf.apply(model, client=client, dtype=dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=train["lr"], betas=(0.9, 0.95),
                                weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / train["warmup"]))
        t0 = time.perf_counter()
        losses = []
        for step, ids in enumerate(batches):
            ids = ids.to(dev)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train["clip"])
            opt.step()
            sched.step()
            losses.append(loss.item())
            if step % max(1, steps // 5) == 0 or step == steps - 1:
                log("  [qwen3 %s] step %3d  loss %.4f" % (dtype, step, losses[-1]))
        res["seconds"][dtype] = time.perf_counter() - t0
        res["losses"][dtype] = losses
        mods = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
        res["quantizations"][dtype] = [m.__dict__["_mok_run"].quantizations for m in mods]
        res["experts_modules"] = n
        del model, opt
    # w_gate, w_up and w_down of each experts module once per step in fp8
    layers = model_cfg["num_hidden_layers"]
    res["quantizations_expected"] = {"bfloat16": [0] * layers, "fp8": [3 * steps] * layers}
    return res


RUNS = {"tiny": dict(fn=run_tiny, steps=300, window=10, bound=0.01),
        "qwen3": dict(fn=run_qwen3, steps=50, window=5, bound=0.02)}


def judge(name, res, steps, window, bound, smoke):
    """The checks of one run (a list of (ok, text)) and its printed table."""
    b, f = res["losses"]["bfloat16"], res["losses"]["fp8"]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    fb, ff = mean(b[-window:]), mean(f[-window:])
    rel = abs(ff - fb) / abs(fb)
    res.update(final_window=window, final={"bfloat16": fb, "fp8": ff}, rel_diff=rel,
               bound=bound)
    checks = [(rel <= bound, "final loss (mean of the last %d steps): fp8 %.4f, bf16 %.4f, "
               "relative difference %.2e (bound %.0e)" % (window, ff, fb, rel, bound)),
              (all(math.isfinite(v) for v in b + f), "every loss finite"),
              (res["quantizations"] == res["quantizations_expected"],
               "quantisations per layer: bf16 %s, fp8 %s (one per weight per step: %s)" % (
                   res["quantizations"]["bfloat16"], res["quantizations"]["fp8"],
                   res["quantizations_expected"]["fp8"])),
              (b != f, "fp8 gives other losses than bf16 (the fp8 layers ran)")]
    first = {d: mean(res["losses"][d][:5]) for d in DTYPES}
    if not smoke:
        checks.append((fb < 0.75 * first["bfloat16"] and ff < 0.75 * first["fp8"],
                       "both learn: first 5 steps bf16 %.4f, fp8 %.4f; final below 3/4 of "
                       "them" % (first["bfloat16"], first["fp8"])))
    w = max(1, steps // 10)
    print("\n%s: %d steps, loss means over %d steps" % (name, steps, w))
    print("  steps        bf16       fp8   rel diff")
    for i in range(0, steps, w):
        mb, mf = mean(b[i:i + w]), mean(f[i:i + w])
        print("  %4d-%-4d %9.4f %9.4f   %8.2e" % (i, min(steps, i + w) - 1, mb, mf,
                                                 abs(mf - mb) / abs(mb)))
    print("  last %-4d %9.4f %9.4f   %8.2e  (bound %.0e)" % (window, fb, ff, rel, bound))
    for ok, text in checks:
        print("%s %s" % ("PASS" if ok else "FAIL", text))
    res["checks"] = [dict(ok=ok, what=text) for ok, text in checks]
    res["passed"] = all(ok for ok, _ in checks)
    return res["passed"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", metavar="RUN", help="tiny, qwen3 (default: both)")
    ap.add_argument("--out", required=True, help="folder for fp8_accuracy_<run>.json")
    ap.add_argument("--socket", default=None, help="mokd's socket (default $MOK_SOCKET)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps of each run (default: tiny 300, qwen3 50)")
    ap.add_argument("--bound", type=float, default=None,
                    help="relative bound on the final losses (default: tiny 0.01, qwen3 0.02)")
    ap.add_argument("--smoke", action="store_true",
                    help="a few steps of smaller models (4 tiny, 3 qwen3 unless --steps)")
    a = ap.parse_args()
    runs = a.runs or list(RUNS)
    bad = [r for r in runs if r not in RUNS]
    if bad:
        ap.error("unknown run %s (runs: %s)" % (", ".join(bad), ", ".join(RUNS)))
    os.makedirs(a.out, exist_ok=True)
    try:
        import torch
        import mok
    except ImportError as e:
        print("fp8_accuracy: needs torch and mok (%s)" % e)
        return 2
    try:
        client = mok.connect(a.socket)
    except mok.Error as e:
        print("fp8_accuracy: no mokd (%s); start mokd and set MOK_SOCKET or --socket" % e)
        return 2
    if client.engine == "cuda" and not torch.cuda.is_available():
        print("fp8_accuracy: mokd runs the cuda engine, but torch sees no CUDA device")
        return 2
    dev = torch.device("cuda" if client.engine == "cuda" else "cpu")
    info = dict(engine=client.engine, device=client.device, torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if dev.type == "cuda" else None)
    print("mokd: %s engine on %s; torch %s%s" % (client.engine, client.device,
                                                torch.__version__,
                                                " on " + info["gpu"] if info["gpu"] else ""))
    failed, missing = [], []
    for name in runs:
        spec = RUNS[name]
        steps = a.steps or ((4 if name == "tiny" else 3) if a.smoke else spec["steps"])
        window = min(spec["window"], steps)
        bound = spec["bound"] if a.bound is None else a.bound
        if name == "qwen3":
            try:
                import transformers  # noqa: F401
            except ImportError as e:
                print("qwen3: needs transformers 5.x (%s)" % e)
                missing.append(name)
                continue
        print("== %s: %d steps, bf16 then fp8, through mokd's %s engine" % (name, steps,
                                                                          client.engine))
        res = spec["fn"](client, dev, steps, a.smoke, lambda s: print(s, flush=True))
        res.update(info, run=name, steps=steps, smoke=a.smoke)
        if not judge(name, res, steps, window, bound, a.smoke):
            failed.append(name)
        path = os.path.join(a.out, "fp8_accuracy_%s.json" % name)
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
        print("wrote %s" % path)
    client.close()
    verdict = ("passed" if not failed and not missing else
               "FAILED: %s" % ", ".join(failed + ["%s (missing)" % m for m in missing]))
    print("fp8_accuracy: %s" % verdict)
    return 1 if failed else 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
