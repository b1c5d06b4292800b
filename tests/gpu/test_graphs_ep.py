#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A captured training step of a model with mok.torch.MoE layers on an expert-parallel
group, on one GPU under MPS (docs/ep.md "Capture and replay on a group"). Run by
tests/gpu/run_graph_tests.sh (step `ep`).

Starts W mokd (cuda engine, all on GPU 0 unless --gpus says more) and W worker
processes. Each worker joins the group through its own mokd and builds, twice from the
same seed, a small model: a bf16 linear, then two MoE layers on the group (tags 1 and 2),
each behind its own float32 router (top-K of a softmax, so the routing changes every
step and nothing syncs with the host). The rank's own batches (uneven T per rank) train
  1. the first copy eagerly for N steps (ring jobs), and
  2. the second copy: 3 eager warm-up steps on a side stream, then the step captured
     with torch.cuda.graph and replayed N-3 times (standing jobs: each replay takes the
     rank's turns in the group),
with AdamW(capturable=True) and a constant lr both ways. Checked per rank: the losses of
every step and every weight at the end bitwise equal between the two, the loss falls,
mok.torch.check_graphs() clean. Every rank runs the same jobs in the same order (its
graph's replays included), as the group requires.

    python3 tests/gpu/test_graphs_ep.py --mokd MOKD [--world 2] [--replays 50] [--logs DIR]

Prints "PASS <what>" / "FAIL <what>: ..." lines and a JSON line "RESULT {...}"; exit 1 on
a failure.
"""
import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ["NCCL_NVLS_ENABLE"] = "0"  # never a multicast object (docs/ep_nccl.md)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

H, I, E, K, IS = 256, 128, 16, 4, 64
T_RANK = [96, 61, 128, 7]
T_MAX = 128
WARMUP = 3


def build(torch, mt, g, rank):
    """The model of one rank (same seed -> same weights)."""
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(H, H, bias=False, dtype=torch.bfloat16)
            self.r1 = nn.Linear(H, E, bias=False)
            self.r2 = nn.Linear(H, E, bias=False)
            self.m1 = mt.MoE(H, I, E, K, shared_intermediate=IS, group=g, group_tag=1)
            self.m2 = mt.MoE(H, I, E, K, shared_intermediate=IS, group=g, group_tag=2)

        def route(self, r, h):
            rw, ids = r(h.float()).softmax(-1).topk(K, dim=-1)
            return ids.to(torch.int32), rw

        def forward(self, x):
            h = self.inp(x)
            ids, rw = self.route(self.r1, h)
            h = h + self.m1(h, ids, rw)
            ids, rw = self.route(self.r2, h)
            return h + self.m2(h, ids, rw)

    torch.manual_seed(1234 + rank)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, capturable=True)
    return model, opt


def step_fn(torch, model, opt, x, tgt):
    out = model(x)
    loss = (out.float() - tgt.float()).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def batches(torch, rank, n):
    g = torch.Generator(device="cuda")
    g.manual_seed(77 + rank)
    T = T_RANK[rank]
    return [((torch.rand((T, H), generator=g, device="cuda") * 2 - 1).to(torch.bfloat16),
             (torch.rand((T, H), generator=g, device="cuda") * 0.5).to(torch.bfloat16))
            for _ in range(n)]


def worker(sock, key, rank, world, gpu, n, path):
    import torch
    import mok
    import mok.torch as mt
    res = {"rank": rank, "ok": False}
    try:
        torch.cuda.set_device(gpu)
        torch.backends.cuda.matmul.allow_tf32 = False
        c = mok.connect(sock)
        g = c.group(key, rank, world, max_tokens=T_MAX, hidden=H, topk=K, experts=E,
                    dtype="bfloat16", timeout_ms=20000)
        data = batches(torch, rank, n)
        # 1. eager: ring jobs
        model, opt = build(torch, mt, g, rank)
        t0 = time.perf_counter()
        ref = [step_fn(torch, model, opt, *b).clone() for b in data]
        torch.cuda.synchronize()
        eager_s = time.perf_counter() - t0
        ref = torch.stack(ref).cpu()
        ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # 2. captured: warm-up steps on a side stream, then one graph of the whole step
        cmodel, copt = build(torch, mt, g, rank)
        losses = []
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for b in data[:WARMUP]:
                losses.append(step_fn(torch, cmodel, copt, *b).clone())
        torch.cuda.current_stream().wait_stream(s)
        static = [t.clone() for t in data[WARMUP]]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # as test_graphs.py
            loss = step_fn(torch, cmodel, copt, *static)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in data[WARMUP:]:
            for dst, src in zip(static, b):
                dst.copy_(src)
            graph.replay()
            losses.append(loss.clone())
        torch.cuda.synchronize()
        replay_s = time.perf_counter() - t0
        mt.check_graphs(c)
        c.synchronize()
        losses = torch.stack(losses).cpu()
        state = cmodel.state_dict()
        res.update(
            ok=True, steps=n, losses_equal=bool(torch.equal(losses, ref)),
            first_diff=(None if torch.equal(losses, ref) else
                        int((losses != ref).nonzero()[0])),
            bad=[k for k in ref_state if not torch.equal(state[k], ref_state[k])],
            n_state=len(ref_state), falls=float(losses[-5:].mean()) < float(losses[:3].mean()),
            first=losses[:3].tolist(), last=losses[-3:].tolist(),
            eager_ms=1e3 * eager_s / n, replay_ms=1e3 * replay_s / (n - WARMUP),
            regions=mt.registrations(c))
        del graph
        c.close()
    except Exception as e:  # the parent reports it
        res["error"] = "%s: %s" % (type(e).__name__, e)
    with open(path, "w") as f:
        json.dump(res, f)


def start_mokd(mokd, d, i, device, logs):
    sock = os.path.join(d, "mokd%d.sock" % i)
    cfg = os.path.join(d, "mokd%d.conf" % i)
    with open(cfg, "w") as f:
        f.write("device = %d\nlog-level = warn\n" % device)
    log = open(os.path.join(logs, "mokd-ep%d.log" % i), "w")
    p = subprocess.Popen([mokd, "--socket", sock, "--engine", "cuda", "--config", cfg],
                         stdout=log, stderr=log)
    for _ in range(3000):
        if os.path.exists(sock):
            return p, sock
        if p.poll() is not None:
            raise RuntimeError("mokd %d exited at start (see %s)" % (i, log.name))
        time.sleep(0.01)
    raise RuntimeError("mokd %d did not start" % i)


failed = []


def report(ok, what, detail=""):
    print("%s %s%s" % ("PASS" if ok else "FAIL", what, (": " + detail) if detail else ""),
          flush=True)
    if not ok:
        failed.append(what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mokd", default=os.environ.get("MOKD_BIN", "build/bin/mokd"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=1, help="spread the ranks over this many GPUs")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--logs", default=os.environ.get("LOGS", "."))
    a = ap.parse_args()
    W, n = a.world, a.replays + WARMUP
    if not 2 <= W <= len(T_RANK):
        ap.error("--world must be in [2, %d]" % len(T_RANK))
    os.makedirs(a.logs, exist_ok=True)
    d = tempfile.mkdtemp(prefix="mok-graphs-ep-")
    procs = []
    summary = {"world": W, "gpus": a.gpus, "steps": n}
    try:
        procs = [start_mokd(a.mokd, d, r, r % a.gpus, a.logs) for r in range(W)]
        key = "graphs-ep-%d" % os.getpid()
        ctx = mp.get_context("spawn")
        paths = [os.path.join(d, "rank%d.json" % r) for r in range(W)]
        ws = [ctx.Process(target=worker,
                          args=(procs[r][1], key, r, W, r % a.gpus, n, paths[r]))
              for r in range(W)]
        for w in ws:
            w.start()
        for w in ws:
            w.join(540)
            if w.is_alive():
                w.kill()
        for r in range(W):
            if not os.path.exists(paths[r]):
                report(False, "rank %d finished" % r, "no result (exit %s)" % ws[r].exitcode)
                continue
            res = json.load(open(paths[r]))
            summary["rank%d" % r] = res
            if not res.get("ok"):
                report(False, "rank %d ran" % r, res.get("error", "?"))
                continue
            report(res["losses_equal"],
                   "rank %d: captured losses bitwise equal to eager over %d steps (%d replays)"
                   % (r, n, n - WARMUP),
                   "" if res["losses_equal"] else "first differing step %s" % res["first_diff"])
            report(not res["bad"], "rank %d: captured weights bitwise equal to eager (%d tensors)"
                   % (r, res["n_state"]), ", ".join(res["bad"][:5]))
            report(res["falls"], "rank %d: loss falls" % r,
                   "%s -> %s" % (res["first"], res["last"]))
            print("  rank %d: eager %.2f ms/step, replay %.2f ms/step" %
                  (r, res["eager_ms"], res["replay_ms"]))
    finally:
        for p, _ in procs:
            p.terminate()
        for i, (p, _) in enumerate(procs):
            try:
                rc = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = "killed"
            if rc != 0:
                report(False, "mokd %d exited cleanly" % i, "exit status %s" % rc)
    print("RESULT " + json.dumps(summary))
    print("graphs EP=%d: %s" % (W, "FAIL (%d)" % len(failed) if failed else "PASS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
