#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""mok.torch under CUDA graphs and torch.compile(fullgraph=True), on a GPU with mokd
(docs/cuda.md "Capture and replay"). Run by tests/gpu/run_graph_tests.sh.

  test_graphs.py bitwise [--replays 200]   a training step of the example model
      (client/python/examples/train_tiny_moe.py's TinyMoE) captured with
      torch.cuda.graph and replayed N times: losses and every weight bitwise equal
      to the same steps run eagerly (constant lr, AdamW(capturable=True) both ways)
  test_graphs.py compile [--steps 30]      torch.compile(model, fullgraph=True):
      no graph break, losses within --tol of eager (inductor fuses the other ops)
  test_graphs.py kill                      mokd ($MOKD_BIN, started here) killed
      during replays: the replays and the synchronisation end within the fence
      timeout, mok.torch.check_graphs() raises ECLOSED, this process goes on
  test_graphs.py bench [--steps 100]       step time: eager vs captured, mokd vs the
      pure PyTorch layer (which cannot be captured: it syncs with the host)
  test_graphs.py fp8 [--replays 50]        the example model with fp8 MoE layers
      (docs/torch.md "FP8 layers"): (a) the whole training step captured (optimizer
      inside) and (b) forward + backward captured with the optimizer stepping eagerly
      between replays, each replayed N times: losses, gradients and weights bitwise
      equal to the same steps run eagerly; (c) a captured forward replayed after an
      in-place change of a master (through the autograd-visible op and through .data,
      which no version counter sees) runs on the changed weights; (d) torch.compile
      fullgraph and reduce-overhead follow eager within --tol
Prints "PASS <what>" / "FAIL <what>: ..." lines and a JSON line "RESULT {...}"; exit 1 on
a failure.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "client", "python", "examples"))

import torch  # noqa: E402

import mok  # noqa: E402
import mok.torch as mt  # noqa: E402
import train_tiny_moe as ex  # noqa: E402

failed = []


def report(ok, what, detail=""):
    print("%s %s%s" % ("PASS" if ok else "FAIL", what, (": " + detail) if detail else ""),
          flush=True)
    if not ok:
        failed.append(what)


def cfg_of(a):
    return argparse.Namespace(vocab=16, seq=8, batch=64, hidden=128, intermediate=256,
                              shared=128, experts=8, topk=2, layers=2, heads=4, lr=1e-3,
                              aux_coef=0.01, task="revadd", seed=a.seed)


def make(cfg, backend, client, dtype="bfloat16"):
    torch.manual_seed(cfg.seed)
    model = ex.TinyMoE(cfg, backend, client, dtype).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, capturable=True)
    return model, opt


def batches(cfg, n):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(cfg.seed + 1)
    return [ex.batch(cfg, gen, "cuda") for _ in range(n)]


def step_fn(model, opt, cfg, inp, tgt, mask):
    logits, aux, _ = model(inp)
    loss = ex.lm_loss(logits, tgt, mask, cfg.vocab)
    opt.zero_grad(set_to_none=True)
    (loss + cfg.aux_coef * aux).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    return loss.detach()


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def eager_run(cfg, client, data, backend="mokd", dtype="bfloat16", grads=None):
    """Losses and final weights of the steps on data, run eagerly; grads: a list that
    receives each step's gradients (cloned)."""
    model, opt = make(cfg, backend, client, dtype)
    losses = []
    for b in data:
        losses.append(step_fn(model, opt, cfg, *b).clone())
        if grads is not None:
            grads.append(grads_of(model))
    torch.cuda.synchronize()
    return torch.stack(losses).cpu(), {k: v.detach().clone() for k, v in
                                       model.state_dict().items()}


class Captured:
    """A whole training step in one CUDA graph (static inputs, copied in per step)."""

    def __init__(self, cfg, client, data, warmup=3, mode="thread_local", dtype="bfloat16"):
        self.cfg = cfg
        self.model, self.opt = make(cfg, "mokd", client, dtype)
        self.losses = []
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up steps (real training steps, counted)
            for b in data[:warmup]:
                self.losses.append(step_fn(self.model, self.opt, cfg, *b).clone())
        torch.cuda.current_stream().wait_stream(s)
        self.static = [t.clone() for t in data[warmup]]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode=mode):
            self.loss = step_fn(self.model, self.opt, cfg, *self.static)
        self.warmup = warmup

    def replay(self, b):
        for dst, src in zip(self.static, b):
            dst.copy_(src)
        self.graph.replay()
        return self.loss.clone()


def test_bitwise(a, client):
    cfg = cfg_of(a)
    n = a.replays + 3
    data = batches(cfg, n)
    ref_losses, ref_state = eager_run(cfg, client, data)
    t0 = time.perf_counter()
    cap = Captured(cfg, client, data, warmup=3)
    losses = list(cap.losses)
    for b in data[3:]:
        losses.append(cap.replay(b))
    torch.cuda.synchronize()
    mt.check_graphs(client)
    client.synchronize()
    secs = time.perf_counter() - t0
    losses = torch.stack(losses).cpu()
    same_loss = torch.equal(losses, ref_losses)
    report(same_loss, "captured losses bitwise equal to eager over %d steps" % n,
           "" if same_loss else "first differing step %d (%r vs %r)" % (
               int((losses != ref_losses).nonzero()[0]), losses.tolist()[:5],
               ref_losses.tolist()[:5]))
    state = cap.model.state_dict()
    bad = [k for k in ref_state if not torch.equal(state[k], ref_state[k])]
    report(not bad, "captured weights bitwise equal to eager (%d tensors)" % len(ref_state),
           ", ".join(bad[:5]))
    report(float(losses[-20:].mean()) < float(losses[:5].mean()), "loss falls",
           "%.4f -> %.4f" % (float(losses[:5].mean()), float(losses[-20:].mean())))
    return dict(steps=n, seconds=secs, first=losses[:3].tolist(), last=losses[-3:].tolist())


def test_compile(a, client):
    cfg = cfg_of(a)
    data = batches(cfg, a.steps)
    ref_losses, _ = eager_run(cfg, client, data)
    model, opt = make(cfg, "mokd", client)
    torch._dynamo.reset()
    cmodel = torch.compile(model, fullgraph=True)
    losses = []
    for inp, tgt, mask in data:
        logits, aux, _ = cmodel(inp)
        loss = ex.lm_loss(logits, tgt, mask, cfg.vocab)
        opt.zero_grad(set_to_none=True)
        (loss + cfg.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    client.synchronize()
    losses = torch.stack(losses).cpu()
    report(True, "torch.compile(fullgraph=True) traced the model (no graph break)")
    rel = float(((losses - ref_losses).abs() / ref_losses.abs()).max())
    report(torch.equal(losses[:1], ref_losses[:1]) or rel < a.tol,
           "compiled losses follow eager (max rel %.2e over %d steps, tol %g)" %
           (rel, a.steps, a.tol))
    # reduce-overhead: CUDA graphs of the compiled graphs, mokd inside them
    model2, opt2 = make(cfg, "mokd", client)
    torch._dynamo.reset()
    cm2 = torch.compile(model2, fullgraph=True, mode="reduce-overhead")
    l2 = []
    for inp, tgt, mask in data:
        torch.compiler.cudagraph_mark_step_begin()
        logits, aux, _ = cm2(inp)
        loss = ex.lm_loss(logits, tgt, mask, cfg.vocab)
        opt2.zero_grad(set_to_none=True)
        (loss + cfg.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model2.parameters(), 1.0, foreach=True)
        opt2.step()
        l2.append(loss.detach().clone())
    torch.cuda.synchronize()
    mt.check_graphs(client)
    l2 = torch.stack(l2).cpu()
    rel2 = float(((l2 - ref_losses).abs() / ref_losses.abs()).max())
    report(rel2 < a.tol, "reduce-overhead losses follow eager (max rel %.2e)" % rel2)
    return dict(max_rel=rel, max_rel_reduce_overhead=rel2)


def test_kill(a):
    sock = "/tmp/mok-graphs-kill.sock"
    try:
        os.unlink(sock)
    except FileNotFoundError:
        pass
    env = dict(os.environ, MOK_FENCE_TIMEOUT_MS=str(a.fence_ms))
    log = open(os.path.join(a.logs, "mokd-kill.log"), "w")
    p = subprocess.Popen([a.mokd, "--engine", "cuda", "--socket", sock, "--log-level", "info"],
                         stderr=log, stdout=log, env=env)
    for _ in range(300):
        if os.path.exists(sock):
            break
        time.sleep(0.1)
    c = mok.connect(sock)
    cfg = cfg_of(a)
    data = batches(cfg, 20)
    cap = Captured(cfg, c, data, warmup=3)
    for b in data[3:8]:
        cap.replay(b)
    torch.cuda.synchronize()
    mt.check_graphs(c)
    report(True, "replays before the kill ran")
    p.send_signal(signal.SIGKILL)
    p.wait()
    t0 = time.perf_counter()
    done = threading.Event()

    def watchdog():
        if not done.wait(a.fence_ms / 1000.0 + 30):
            print("FAIL replays after the kill hang (killing the test)", flush=True)
            os._exit(1)
    threading.Thread(target=watchdog, daemon=True).start()
    for b in data[8:]:
        cap.replay(b)
    torch.cuda.synchronize()
    done.set()
    secs = time.perf_counter() - t0
    report(secs < a.fence_ms / 1000.0 + 10, "replays after the kill ended in %.2f s" % secs)
    try:
        mt.check_graphs(c)
        report(False, "check_graphs after the kill raises")
    except mok.Error as e:
        report("ECLOSED" in str(e) or "went away" in str(e), "check_graphs raises after the "
               "kill", str(e)[:160])
    x = torch.ones(4, device="cuda").sum().item()  # the trainer goes on
    report(x == 4.0, "the trainer process survives")
    return dict(seconds_after_kill=secs)


def test_bench(a, client):
    cfg = cfg_of(a)
    data = batches(cfg, a.steps + 10)
    res = {}

    def timed(fn, n):
        for b in data[:5]:
            fn(b)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in data[5:5 + n]:
            fn(b)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / n
    for backend in ("mokd", "torch"):
        model, opt = make(cfg, backend, client)
        res["eager_" + backend] = timed(lambda b: step_fn(model, opt, cfg, *b), a.steps)
    cap = Captured(cfg, client, data, warmup=3)
    res["captured_mokd"] = timed(cap.replay, a.steps)
    mt.check_graphs(client)
    res["captured_torch"] = None  # moe_reference syncs with the host: not capturable
    for k, v in res.items():
        print("  %-16s %s" % (k, "n/a (host sync in the layer)" if v is None else
                              "%.3f ms/step" % v))
    report(True, "bench")
    return res


class CapturedGrads:
    """Forward and backward in one CUDA graph; clipping and the optimizer run eagerly
    after each replay (the masters change between replays, outside the graph)."""

    def __init__(self, cfg, client, data, warmup=3, dtype="fp8"):
        self.cfg = cfg
        self.model, self.opt = make(cfg, "mokd", client, dtype)
        self.losses, self.grads = [], []
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up steps (real training steps, counted)
            for b in data[:warmup]:
                self.losses.append(step_fn(self.model, self.opt, cfg, *b).clone())
                self.grads.append(grads_of(self.model))
        torch.cuda.current_stream().wait_stream(s)
        self.static = [t.clone() for t in data[warmup]]
        self.opt.zero_grad(set_to_none=True)  # the graph's backward makes .grad (its pool)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            logits, aux, _ = self.model(self.static[0])
            self.loss = ex.lm_loss(logits, self.static[1], self.static[2], cfg.vocab)
            (self.loss + cfg.aux_coef * aux).backward()

    def step(self, b):
        for dst, src in zip(self.static, b):
            dst.copy_(src)
        self.graph.replay()
        loss = self.loss.detach().clone()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        grads = grads_of(self.model)  # clipped, as eager_run takes them
        self.opt.step()
        return loss, grads


def same_grads(a, b):
    """Names of the gradients that differ (or are missing on one side)."""
    return [k for k in sorted(set(a) | set(b)) if k not in a or k not in b or
            not torch.equal(a[k], b[k])]


def test_fp8(a, client):
    """fp8 MoE layers under CUDA graphs (module docstring, fp8)."""
    cfg = cfg_of(a)
    n = a.replays + 3
    data = batches(cfg, n)
    ref_grads = []
    ref_losses, ref_state = eager_run(cfg, client, data, dtype="fp8", grads=ref_grads)
    res = {}

    # (a) the whole step in the graph (AdamW(capturable=True) inside)
    cap = Captured(cfg, client, data, warmup=3, dtype="fp8")
    losses = list(cap.losses)
    for b in data[3:]:
        losses.append(cap.replay(b))
    torch.cuda.synchronize()
    mt.check_graphs(client)
    losses = torch.stack(losses).cpu()
    report(torch.equal(losses, ref_losses), "fp8, whole step captured: losses bitwise equal "
           "to eager over %d steps" % n, "" if torch.equal(losses, ref_losses) else
           "first differing step %d" % int((losses != ref_losses).nonzero()[0]))
    bad = same_grads(grads_of(cap.model), ref_grads[-1])
    report(not bad, "fp8, whole step captured: last step's gradients bitwise equal to eager",
           ", ".join(bad[:5]))
    state = cap.model.state_dict()
    bad = [k for k in ref_state if not torch.equal(state[k], ref_state[k])]
    report(not bad, "fp8, whole step captured: weights bitwise equal to eager (%d tensors)" %
           len(ref_state), ", ".join(bad[:5]))
    q = [blk.moe.quantizations for blk in cap.model.blocks]
    res["whole_step_first_last"] = [losses[:2].tolist(), losses[-2:].tolist()]
    del cap

    # (b) forward + backward captured, the optimizer stepping eagerly between replays
    capg = CapturedGrads(cfg, client, data, warmup=3)
    losses, grads = list(capg.losses), list(capg.grads)
    for b in data[3:]:
        l, g = capg.step(b)
        losses.append(l)
        grads.append(g)
    torch.cuda.synchronize()
    mt.check_graphs(client)
    losses = torch.stack(losses).cpu()
    report(torch.equal(losses, ref_losses), "fp8, optimizer between replays: losses bitwise "
           "equal to eager over %d steps" % n)
    bad = [(i, same_grads(g, r)) for i, (g, r) in enumerate(zip(grads, ref_grads))]
    bad = [(i, names) for i, names in bad if names]
    report(not bad and len(grads) == n, "fp8, optimizer between replays: every step's "
           "gradients bitwise equal to eager (%d steps)" % n,
           "" if not bad else "step %d: %s" % (bad[0][0], ", ".join(bad[0][1][:4])))
    state = capg.model.state_dict()
    bad = [k for k in ref_state if not torch.equal(state[k], ref_state[k])]
    report(not bad, "fp8, optimizer between replays: weights bitwise equal to eager",
           ", ".join(bad[:5]))
    report(float(losses[-5:].mean()) < float(losses[:3].mean()), "fp8 loss falls",
           "%.4f -> %.4f" % (float(losses[:3].mean()), float(losses[-5:].mean())))
    del capg

    # (c) a captured forward sees in-place changes of the masters
    torch.manual_seed(cfg.seed)
    m = mt.MoE(cfg.hidden, cfg.intermediate, cfg.experts, cfg.topk,
               shared_intermediate=cfg.shared, client=client, dtype="fp8").cuda()
    T = 256
    g = torch.Generator(device="cuda").manual_seed(cfg.seed + 7)
    x = torch.randn(T, cfg.hidden, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.argsort(torch.rand(T, cfg.experts, device="cuda", generator=g),
                        dim=1)[:, :cfg.topk].to(torch.int32)
    rw = torch.rand(T, cfg.topk, device="cuda", generator=g)
    with torch.no_grad():
        eager0 = m(x, ids, rw).clone()  # warm-up, eager (the module's own cache)
        fg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(fg):
            y = m(x, ids, rw)
        fg.replay()
        torch.cuda.synchronize()
        first = y.clone()
        report(torch.equal(first, eager0), "fp8 captured forward: replay equals eager")
        m.w_gate.mul_(0.5)  # in place, seen by the version counter
        m.s_down.add_(0.01)
        fg.replay()
        eager1 = m(x, ids, rw)
        torch.cuda.synchronize()
        report(torch.equal(y, eager1) and not torch.equal(y, first),
               "fp8 captured forward: a replay after an in-place change runs on the new "
               "weights (equal to eager on them, unlike before)")
        second = y.clone()
        m.w_down.data.mul_(0.25)  # through .data: no version counter sees it
        fg.replay()
        m.quantize_weights(force=True)  # the eager cache needs telling; the graph does not
        eager2 = m(x, ids, rw)
        torch.cuda.synchronize()
        report(torch.equal(y, eager2) and not torch.equal(y, second),
               "fp8 captured forward: a replay after a change through .data runs on it too")
    mt.check_graphs(client)
    # a deleted graph: its pool freed (and its addresses perhaps allocated again, which makes
    # mokd cancel the standing job) is no failure; capturing anew makes the jobs anew
    del fg, y
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    junk = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 4, 16, 64)]
    try:
        mt.check_graphs(client)
        report(True, "fp8: check_graphs after a graph was deleted and its pool freed: no error")
    except mok.Error as e:
        report(False, "fp8: check_graphs after a graph was deleted and its pool freed: no "
               "error", str(e))
    del junk
    with torch.no_grad():
        fg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(fg):
            y = m(x, ids, rw)
        m.w_up.mul_(0.5)
        fg.replay()
        eager3 = m(x, ids, rw)
        torch.cuda.synchronize()
    report(torch.equal(y, eager3), "fp8: a graph captured again after that replays like eager")
    mt.check_graphs(client)
    del fg, y

    # (d) torch.compile: fullgraph, then reduce-overhead (CUDA graph trees)
    for mode in (None, "reduce-overhead"):
        model, opt = make(cfg, "mokd", client, "fp8")
        torch._dynamo.reset()
        cm = torch.compile(model, fullgraph=True, mode=mode)
        ls = []
        for inp, tgt, mask in data[:a.steps]:
            if mode:
                torch.compiler.cudagraph_mark_step_begin()
            logits, aux, _ = cm(inp)
            loss = ex.lm_loss(logits, tgt, mask, cfg.vocab)
            opt.zero_grad(set_to_none=True)
            (loss + cfg.aux_coef * aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            ls.append(loss.detach().clone())
        torch.cuda.synchronize()
        mt.check_graphs(client)
        ls = torch.stack(ls).cpu()
        ref = ref_losses[:len(ls)]
        rel = float(((ls - ref).abs() / ref.abs()).max())
        report(rel < a.tol, "fp8 torch.compile(fullgraph=True%s) losses follow eager (max rel "
               "%.2e over %d steps)" % (", mode=%s" % mode if mode else "", rel, len(ls)))
        res["compile_" + (mode or "default") + "_max_rel"] = rel
        del cm, model, opt
    res.update(steps=n, quantizations_per_layer_whole_step=q)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("bitwise", "compile", "kill", "bench", "fp8"))
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--fence-ms", type=int, default=3000)
    ap.add_argument("--mokd", default=os.environ.get("MOKD_BIN", "mokd"))
    ap.add_argument("--logs", default=os.environ.get("LOGS", "/tmp"))
    a = ap.parse_args()
    ex.deterministic()
    if a.what == "kill":
        r = test_kill(a)
    else:
        client = mok.connect()
        mt.set_default_client(client)
        r = {"bitwise": test_bitwise, "compile": test_compile, "bench": test_bench,
             "fp8": test_fp8}[a.what](a, client)
    print("RESULT " + json.dumps({a.what: r, "failed": failed}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
