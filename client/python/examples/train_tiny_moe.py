#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Train a tiny MoE transformer through mokd (mok.torch.MoE) on sequence reversal.

The task (--task revadd): N random tokens s, a separator, then
(s reversed + s) mod (VOCAB-1); the loss is cross-entropy on the second half
only (the first half is unpredictable noise), so the model must attend to two
positions and learn the modular table: the loss starts at ln(VOCAB), sits on
a plateau (~1.37, the positions it can half-guess) and falls to ~0 once the
table is learnt (around step 200-250 at the defaults). --task reverse is the
plain reversal (smooth, learnt in ~30 steps). The model: token and position
embeddings, LAYERS pre-norm blocks (causal self-attention, then a MoE FFN:
softmax router in float32, top-k, router weights renormalised over the k, a
Switch-style load-balance loss E * sum_e f_e P_e, SwiGLU experts plus a shared
expert run by mokd), a final norm and an output projection. AdamW, warm-up,
gradient clipping.

Runs (each from the same seed, hence the same initial weights and batches):
  mokd   the MoE FFN through mokd --engine cuda ($MOK_SOCKET)
  mokd2  the same again: losses and final weights must be bitwise identical
  torch  the MoE FFN as plain PyTorch ops (mok.torch.moe_reference; same
         roundings as the engine, different summation orders): the loss curve
         must follow the mokd run within bf16 tolerance (see --tol-*)
and prints the loss curves, step times and a verdict; exits 1 when a check
fails, 2 without a daemon. PyTorch runs with torch.use_deterministic_algorithms
(True) and every op of the model is chosen deterministic (one-hot products
instead of embedding/gather/scatter backward), so the whole step is.

  MOK_SOCKET=/tmp/mokd.sock PYTHONPATH=client/python \\
      python3 client/python/examples/train_tiny_moe.py [--steps 300] [--json out.json]
"""
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mok  # noqa: E402
import mok.torch as mt  # noqa: E402


def deterministic():
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def onehot(ids, n, dtype=torch.float32):
    """Comparison one-hot (no scatter, so nothing nondeterministic in forward or backward)."""
    return (ids.unsqueeze(-1) == torch.arange(n, device=ids.device)).to(dtype)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, h):
        B, L, d = h.shape
        q, k, v = self.qkv(h).view(B, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(L, L, dtype=torch.bool, device=h.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, L, d))


class Block(nn.Module):
    def __init__(self, cfg, backend, client, dtype="bfloat16"):
        super().__init__()
        d = cfg.hidden
        self.E, self.K = cfg.experts, cfg.topk
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, cfg.heads)
        self.router = nn.Linear(d, cfg.experts, bias=False)
        self.moe = mt.MoE(d, cfg.intermediate, cfg.experts, cfg.topk,
                          shared_intermediate=cfg.shared, backend=backend, client=client,
                          dtype=dtype)

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        z = self.ln2(h)
        probs = self.router(z).float().softmax(-1)               # [B,L,E] float32
        ids = probs.detach().topk(self.K, dim=-1).indices        # [B,L,K]
        oh = onehot(ids, self.E)                                 # [B,L,K,E]
        rw = (probs.unsqueeze(-2) * oh).sum(-1)                  # differentiable, no gather
        rw = rw / rw.sum(-1, keepdim=True)
        frac = oh.sum((0, 1, 2)) / oh.sum()                      # f_e, fraction of slots
        aux = self.E * (frac * probs.mean((0, 1))).sum()         # Switch load-balance loss
        h = h + self.moe(z.to(torch.bfloat16), ids.to(torch.int32), rw).float()
        return h, aux, frac


class TinyMoE(nn.Module):
    """dtype: the MoE layers' ("fp8": e4m3 GEMMs on bf16 master weights, on either engine;
    tests/python/test_torch_fp8.py trains it on the CPU both ways, tests/gpu/test_torch_fp8.py
    on the GPU)."""

    def __init__(self, cfg, backend, client=None, dtype="bfloat16"):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Parameter(torch.randn(cfg.vocab, cfg.hidden) * 0.5)
        self.pos = nn.Parameter(torch.randn(2 * cfg.seq, cfg.hidden) * 0.5)
        self.blocks = nn.ModuleList(Block(cfg, backend, client, dtype)
                                    for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, inp):
        h = onehot(inp, self.cfg.vocab) @ self.tok + self.pos[:inp.shape[1]]
        aux, fracs = 0.0, []
        for b in self.blocks:
            h, a, f = b(h)
            aux = aux + a
            fracs.append(f)
        return self.head(self.ln(h)), aux / len(self.blocks), torch.stack(fracs)


def batch(cfg, gen, dev):
    """inp [B, 2N], target [B, 2N], loss mask: the reversed half (cfg.loss_on "second", the
    default), or every position ("all": a language model's loss, whose random first half
    keeps (N-1)/(2N) ln(vocab-1) of entropy that no model removes, as natural text keeps
    its own)."""
    sep = cfg.vocab - 1
    s = torch.randint(0, cfg.vocab - 1, (cfg.batch, cfg.seq), generator=gen, device=dev)
    second = s.flip(1)
    if cfg.task == "revadd":
        second = (second + s) % (cfg.vocab - 1)
    full = torch.cat([s, torch.full((cfg.batch, 1), sep, device=dev), second], 1)
    inp, tgt = full[:, :-1], full[:, 1:]
    mask = torch.zeros_like(tgt, dtype=torch.float32)
    mask[:, 0 if getattr(cfg, "loss_on", "second") == "all" else cfg.seq:] = 1.0
    return inp, tgt, mask


def lm_loss(logits, tgt, mask, vocab):
    logp = logits.float().log_softmax(-1)
    nll = -(logp * onehot(tgt, vocab)).sum(-1)
    return (nll * mask).sum() / mask.sum()


def train_losses(cfg, dtype, client, dev, steps, log=None):
    """The loss of each of `steps` AdamW steps (cfg's lr, warm-up, clipping at 1) of TinyMoE
    with MoE layers of `dtype` through mokd on `client` (CUDA tensors on the cuda engine,
    dev "cuda"; CPU tensors on the cpu engine, dev "cpu"; None: the default client),
    from cfg.seed: the same initial weights and the same batches (drawn on the CPU) for
    every dtype, so that runs differ by their layers alone. log(step, loss), when given,
    is called every step. Returns (losses, the initial state_dict, each layer's
    quantisations)."""
    torch.manual_seed(cfg.seed)
    model = TinyMoE(cfg, "mokd", client, dtype=dtype).to(dev)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    for step in range(steps):
        inp, tgt, mask = (t.to(dev) for t in batch(cfg, gen, "cpu"))
        logits, aux, _ = model(inp)
        loss = lm_loss(logits, tgt, mask, cfg.vocab)
        opt.zero_grad(set_to_none=True)
        (loss + cfg.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log is not None:
            log(step, losses[-1])
    return losses, init, [b.moe.quantizations for b in model.blocks]


def train(cfg, backend, client, dev, log_every=0):
    torch.manual_seed(cfg.seed)
    model = TinyMoE(cfg, backend, client).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    gen = torch.Generator(device=dev)
    gen.manual_seed(cfg.seed + 1)
    losses, auxes = [], []
    regs = {}
    t_start = None
    for step in range(cfg.steps):
        if step == cfg.time_from:
            torch.cuda.synchronize()
            t_start = time.perf_counter()
        inp, tgt, mask = batch(cfg, gen, dev)
        logits, aux, frac = model(inp)
        loss = lm_loss(logits, tgt, mask, cfg.vocab)
        opt.zero_grad(set_to_none=True)
        (loss + cfg.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())
        auxes.append(aux.detach())
        if backend == "mokd":
            n = mt.registrations(client)
            if n != regs.get("last"):
                regs[step] = regs["last"] = n  # the steps that registered new allocations
            if step == 9:
                regs["base"] = (n, segments())
        if log_every and (step % log_every == 0 or step == cfg.steps - 1):
            print("  [%s] step %4d  loss %.4f  aux %.4f" % (backend, step, loss.item(),
                                                            aux.item()), flush=True)
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t_start) * 1e3 / (cfg.steps - cfg.time_from)
    if backend == "mokd":
        client.synchronize()
        regs["end"] = (mt.registrations(client), segments())
    # accuracy on fresh sequences
    with torch.no_grad():
        inp, tgt, mask = batch(cfg, gen, dev)
        logits, _, frac = model(inp)
        acc = ((logits.argmax(-1) == tgt).float() * mask).sum() / mask.sum()
    return dict(losses=torch.stack(losses).cpu(), aux=torch.stack(auxes).cpu(),
                state={k: v.detach().clone() for k, v in model.state_dict().items()},
                step_ms=step_ms, acc=acc.item(), regs=regs, load=frac.cpu())


def segments():
    """cudaMalloc segments PyTorch's caching allocator has made so far."""
    return torch.cuda.memory_stats().get("segment.all.allocated", 0)


def window_means(x, w):
    return torch.stack([x[i:i + w].mean() for i in range(0, len(x), w)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--task", choices=("revadd", "reverse"), default="revadd",
                    help="revadd: the second half is (reversed + original) mod (vocab-1), "
                         "which the experts must learn as a table; reverse: reversal only "
                         "(learnt by attention within ~30 steps)")
    ap.add_argument("--loss-on", choices=("second", "all"), default="second",
                    help="second: the loss on the second half only; all: every position (a "
                         "language model's loss, the random first half's entropy included)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=16, help="data tokens + the separator")
    ap.add_argument("--seq", type=int, default=8, help="N: tokens to reverse")
    ap.add_argument("--batch", type=int, default=64, help="sequences per step (T = 2N*B)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--shared", type=int, default=128, help="shared expert's I_s (0: none)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--time-from", type=int, default=20, help="first timed step")
    ap.add_argument("--loss-threshold", type=float, default=None,
                    help="the mean loss of the last 20 steps must end below this "
                         "(default: 0.3 * ln(vocab-1), the level of a model that attends)")
    ap.add_argument("--tol-step0", type=float, default=5e-3,
                    help="relative difference of the first loss, mokd vs torch (same weights "
                         "and batch: only bf16 rounding inside the MoE layer differs)")
    ap.add_argument("--tol-early", type=float, default=3e-2,
                    help="largest relative difference over the first 20 steps")
    ap.add_argument("--tol-curve", type=float, default=0.2,
                    help="largest difference of 20-step window means, relative to the first loss")
    ap.add_argument("--skip-torch", action="store_true", help="no pure PyTorch run")
    ap.add_argument("--json", help="write the results here")
    cfg = ap.parse_args()
    if cfg.loss_threshold is None:
        cfg.loss_threshold = 0.3 * math.log(cfg.vocab - 1)
    if not torch.cuda.is_available():
        print("train_tiny_moe: no CUDA device")
        return 2
    dev = torch.device("cuda")
    deterministic()
    try:
        client = mok.connect()
    except mok.Error as e:
        print("train_tiny_moe: no mokd (%s); start mokd --engine cuda and set MOK_SOCKET" % e)
        return 2
    print("mokd: %s engine on %s, session %d; torch %s on %s" % (
        client.engine, client.device, client.session, torch.__version__,
        torch.cuda.get_device_name()))
    print("model: %d layers, H=%d, I=%d, E=%d, K=%d, I_s=%d, T=%d tokens per MoE call, %d steps"
          % (cfg.layers, cfg.hidden, cfg.intermediate, cfg.experts, cfg.topk, cfg.shared,
             cfg.batch * 2 * cfg.seq, cfg.steps))
    log_every = max(1, cfg.steps // 6)
    runs = {"mokd": train(cfg, "mokd", client, dev, log_every)}
    runs["mokd2"] = train(cfg, "mokd", client, dev)
    if not cfg.skip_torch:
        runs["torch"] = train(cfg, "torch", None, dev, log_every)
    fails = []

    def check(ok, what):
        print("%s %s" % ("PASS" if ok else "FAIL", what))
        if not ok:
            fails.append(what)

    a, b = runs["mokd"], runs["mokd2"]
    la = a["losses"]
    first, last = la[:5].mean().item(), la[-20:].mean().item()
    print("\nloss every %d steps (20-step means):" % 20)
    names = list(runs)
    wm = {n: window_means(runs[n]["losses"], 20) for n in names}
    print("  steps     " + "".join("%10s" % n for n in names))
    for i in range(len(wm["mokd"])):
        print("  %4d-%-4d " % (20 * i, min(cfg.steps, 20 * i + 20) - 1) +
              "".join("%10.4f" % wm[n][i].item() for n in names))
    check(last < cfg.loss_threshold and last < 0.5 * first,
          "loss falls: first 5 steps %.4f -> last 20 steps %.4f (threshold %.3f); accuracy on "
          "the reversed half %.3f" % (first, last, cfg.loss_threshold, a["acc"]))
    same_loss = torch.equal(a["losses"], b["losses"])
    same_w = all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    check(same_loss and same_w, "two mokd runs from one seed: losses %s, weights %s (%d tensors)"
          % ("bitwise equal" if same_loss else "DIFFER", "bitwise equal" if same_w else "DIFFER",
             len(a["state"])))
    # PyTorch's caching allocator keeps its segments (cudaMalloc'd blocks) and libmok registers
    # each one once, so a step registers something only when the allocator made a new
    # segment, which it still does now and then while the mix of tensor sizes settles (seen:
    # none after step 3 in a first run, one at step ~200 in a second run in the same
    # process). Checked: from step 10 on, new registrations <= new allocator segments.
    def regs_text(g):
        return "%s" % {k: v for k, v in g.items() if isinstance(k, int)}

    growth = [(g["end"][0] - g.get("base", (0, 0))[0], g["end"][1] - g.get("base", (0, 0))[1])
              for g in (a["regs"], b["regs"])]
    check(all(dr <= ds for dr, ds in growth),
          "registrations with mokd (step: count after it, where it grew): run 1 %s, run 2 %s; "
          "from step 10 on, new registrations / new PyTorch allocator segments: run 1 %d/%d, "
          "run 2 %d/%d" % ((regs_text(a["regs"]), regs_text(b["regs"])) + growth[0] +
                           growth[1]))
    r = [regs_text(a["regs"]), regs_text(b["regs"]), growth]
    res = dict(config=vars(cfg), mokd_step_ms=a["step_ms"], mokd2_step_ms=b["step_ms"],
               losses={n: runs[n]["losses"].tolist() for n in names},
               acc={n: runs[n]["acc"] for n in names}, registrations=r,
               expert_load_last_step={n: runs[n]["load"].tolist() for n in names})
    if "torch" in runs:
        t = runs["torch"]
        lt = t["losses"]
        d0 = abs(la[0] - lt[0]).item() / lt[0].item()
        early = ((la[:20] - lt[:20]).abs() / lt[:20]).max().item()
        curve = (wm["mokd"] - wm["torch"]).abs().max().item() / lt[0].item()
        wdiff = max(((a["state"][k].float() - t["state"][k].float()).norm() /
                     t["state"][k].float().norm().clamp_min(1e-30)).item()
                    for k in a["state"])
        check(d0 <= cfg.tol_step0, "first loss: mokd %.6f, torch %.6f, relative difference "
              "%.2e (tolerance %.0e)" % (la[0], lt[0], d0, cfg.tol_step0))
        check(early <= cfg.tol_early, "steps 0-19: largest relative loss difference %.2e "
              "(tolerance %.0e)" % (early, cfg.tol_early))
        # The tolerance: both runs use bf16 weights, activations and Adam states; the engine and
        # moe_reference round the same intermediates but sum in other orders, so the first loss
        # agrees to ~1e-4 and gradients to ~1e-2 (docs/cuda.md: engine vs reference ~3e-3).
        # Training amplifies such differences (Adam normalises tiny gradients; a routing tie can
        # flip), and this task's drop off its plateau is a sharp, sensitive event: a shift of
        # ~10 steps moves a 20-step window mean by ~0.1 of the first loss. Hence a tight check on
        # the first loss and the first 20 steps, and a looser one on the whole curve.
        check(curve <= cfg.tol_curve, "20-step window means: largest difference %.3f of the "
              "first loss (tolerance %.2f); final losses mokd %.4f, torch %.4f; largest "
              "relative weight difference at the end %.3f" %
              (curve, cfg.tol_curve, last, lt[-20:].mean().item(), wdiff))
        print("step time: mokd %.2f ms (again %.2f ms), pure PyTorch MoE %.2f ms (steps %d-%d, "
              "%s MPS)" % (a["step_ms"], b["step_ms"], t["step_ms"], cfg.time_from,
                           cfg.steps - 1,
                           "under" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "no"))
        res.update(torch_step_ms=t["step_ms"], step0_rel=d0, early_rel=early,
                   curve_rel=curve, weight_rel=wdiff)
    else:
        print("step time: mokd %.2f ms (again %.2f ms)" % (a["step_ms"], b["step_ms"]))
    res["fails"] = fails
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(res, f, indent=1)
    client.close()
    print("train_tiny_moe: %s" % ("passed" if not fails else "FAILED: " + "; ".join(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
