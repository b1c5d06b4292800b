# SPDX-License-Identifier: Apache-2.0
"""mok.distributed.join over torch.distributed (gloo) with cpu-engine mokd daemons.

Three worker processes (tests/python/torchdist_worker.py), three mokd: a group over
the world (3 ranks) and over a subgroup of global ranks 1 and 2 (whose rank 0 is
global rank 1), each bitwise equal to EP=1 on the ranks' tokens concatenated and
close to the float64 reference; failures (sizing mismatch, a refused join, a rank
that never reports, a closed client, NCCL on the cpu engine) raise mok.Error on every
rank instead of hanging; the world group forms again afterwards; MoE(group=process
group) shares one join. Skipped without torch."""
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, os.environ.get("MOK_BUILD") or "build")
LIBMOK = os.path.join(BUILD, "lib", "libmok.so")
MOKD = os.path.join(BUILD, "bin", "mokd")
if not (os.path.exists(LIBMOK) and os.path.exists(MOKD)):
    pytest.skip("not built", allow_module_level=True)
HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.join(REPO, "client", "python")
sys.path.insert(0, PY)
sys.path.insert(0, HERE)
os.environ.setdefault("MOK_LIBRARY", LIBMOK)
import mok  # noqa: E402
import mok.distributed as md  # noqa: E402
from mok import reference as ref  # noqa: E402
import torchdist_worker as W  # noqa: E402

WORLD = 3


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three mokd (cpu engine) and one run of the three workers; {rank: results}."""
    base = tmp_path_factory.mktemp("torchdist")
    env = dict(os.environ)
    if not env.get("MOK_GROUP_DIR"):
        gd = base / "groups"
        gd.mkdir(mode=0o700)
        env["MOK_GROUP_DIR"] = str(gd)
    procs, socks = [], []
    for r in range(WORLD):
        sock = str(base / ("mokd%d.sock" % r))
        log = open(str(base / ("mokd%d.log" % r)), "w+")
        procs.append(subprocess.Popen([MOKD, "--socket", sock, "--engine", "cpu", "--threads",
                                       "1"], stdout=log, stderr=subprocess.STDOUT, env=env))
        socks.append(sock)
    try:
        deadline = time.time() + 15
        for p, s in zip(procs, socks):
            while not os.path.exists(s):
                assert p.poll() is None and time.time() < deadline, "mokd did not come up"
                time.sleep(0.02)
        out = str(base / "out")
        os.mkdir(out)
        wenv = dict(env, PYTHONPATH=PY + os.pathsep + env.get("PYTHONPATH", ""),
                    MOK_LIBRARY=LIBMOK, OMP_NUM_THREADS="1")
        port = free_port()
        workers = [subprocess.Popen([sys.executable, os.path.join(HERE, "torchdist_worker.py"),
                                     str(r), str(WORLD), str(port), ",".join(socks), out],
                                    env=wenv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                   for r in range(WORLD)]
        logs = []
        for w in workers:
            try:
                logs.append(w.communicate(timeout=240)[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                for v in workers:
                    if v.poll() is None:
                        v.kill()
                raise AssertionError("workers hung")
        for r, w in enumerate(workers):
            assert w.returncode == 0, "worker %d exit %d:\n%s" % (r, w.returncode, logs[r][-3000:])
        res = {}
        for r in range(WORLD):
            with open(os.path.join(out, "rank%d.pkl" % r), "rb") as f:
                res[r] = pickle.load(f)
        yield res, socks
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(timeout=15) == 0


def ok(res, r, name):
    v = res[r][name]
    assert "ok" in v, "rank %d %s: %s" % (r, name, v.get("error"))
    return v["ok"]


def err(res, r, name):
    v = res[r][name]
    assert "error" in v, "rank %d %s: expected an error, got %s" % (r, name, v)
    return v["error"]


def ep1(sock, ranks):
    """EP=1 (one daemon, every expert) on the given global ranks' tokens concatenated."""
    E = W.E3
    wg, wu, wd = W.weights(1, E)
    parts = [W.inputs(20 + r, W.T_OF[r], E) for r in ranks]
    x, ids, rw, d_out = (np.concatenate([p[i] for p in parts]) for i in range(4))
    with mok.connect(sock) as c:
        layer = c.layer(hidden=W.H, intermediate=W.I, experts=E, topk=W.K)
        out, ctx = layer.forward(x, ids, rw, wg, wu, wd)
        g = layer.backward(ctx, d_out)
    return out, g, (x, ids, rw, wg, wu, wd)


def check_group(res, socks, name, ranks):
    out1, g1, (x, ids, rw, wg, wu, wd) = ep1(socks[0], ranks)
    world = len(ranks)
    El, off = W.E3 // world, 0
    keys = set()
    for gr, r in enumerate(ranks):
        v = ok(res, r, name)
        assert v["rank"] == gr and v["world"] == world and v["transport"] == "host"
        assert v["first_expert"] == gr * El
        keys.add(v["key"])
        T = W.T_OF[r]
        rows = slice(off, off + T)
        assert v["out"].tobytes() == out1[rows].tobytes(), (name, r)
        assert v["d_x"].tobytes() == g1.d_x[rows].tobytes()
        assert v["d_rw"].tobytes() == g1.d_router_weights[rows].tobytes()
        for n in ("d_w_gate", "d_w_up", "d_w_down"):
            assert v[n].tobytes() == getattr(g1, n)[gr * El:(gr + 1) * El].tobytes(), (name, n)
        off += T
    assert len(keys) == 1 and next(iter(keys)).startswith("torch/")  # rank 0's key, everywhere
    got = np.concatenate([ok(res, r, name)["out"] for r in ranks])
    assert ref.rel_err(got, ref.forward(x, ids, rw, wg, wu, wd)) < 1e-5
    return next(iter(keys))


def test_world_group_bitwise_equal_to_ep1(run):
    res, socks = run
    k1 = check_group(res, socks, "world", [0, 1, 2])
    k2 = check_group(res, socks, "again", [0, 1, 2])  # formed again after the failures
    assert k1 != k2  # a fresh key per join


def test_subgroup_uses_its_own_rank0(run):
    res, socks = run
    check_group(res, socks, "sub", [1, 2])
    assert "sub" not in res[0]


def test_sizing_mismatch_fails_every_rank(run):
    res, _ = run
    msgs = [err(res, r, "mismatch") for r in range(WORLD)]
    for st, m, _ in msgs:
        assert st == "EINVAL"
        assert "disagree on the group's hidden" in m and "rank 2 has 24" in m, m
    assert len(set(m for _, m, _ in msgs)) == 1  # the same verdict everywhere


def test_refused_join_fails_every_rank(run):
    res, _ = run
    msgs = [err(res, r, "join_fails") for r in range(WORLD)]
    for st, m, _ in msgs:
        assert "failed to join" in m, m
        # ranks 0 and 1 share mokd 0: exactly one of them was refused
        assert ("rank 0 failed" in m) != ("rank 1 failed" in m), m
        assert "rank 2 failed" not in m
    assert len(set(m for _, m, _ in msgs)) == 1


def test_rank_that_never_reports(run):
    res, _ = run
    for r in (0, 1):
        st, m, dt = err(res, r, "missing")
        assert st == "ETIMEOUT" and "rank 2 did not report its join within 1.5 s" in m, m
        assert 1.4 < dt < 3.5, dt  # the agreement's timeout, not the slow rank's 4 s
    st, m, dt = err(res, 2, "missing")
    assert st == "EENGINE" and "rank 2 failed to join" in m and "hangs" in m, m


def test_closed_client_fails_every_rank_before_joining(run):
    res, _ = run
    for r in range(WORLD):
        st, m, _ = err(res, r, "closed")
        assert st == "ECLOSED" and "rank 0: this rank's mok client is closed" in m, m


def test_nccl_on_cpu_engine_refused(run):
    res, _ = run
    for r in range(WORLD):
        st, m, _ = err(res, r, "nccl_cpu")
        assert st == "EUNSUPPORTED" and "need the cuda engine" in m, m


def test_moe_with_process_group_shares_one_join(run):
    res, _ = run
    for r in range(WORLD):
        v = ok(res, r, "moe")
        assert v["same_group"] and v["tags"] == (0, 1)
        assert v["rank"] == r and v["world"] == WORLD
        assert v["w_gate"] == (W.E3 // WORLD, W.I, W.H)
        assert v["w_down2"] == (W.E3 // WORLD, W.H, 2 * W.I)
        assert "group rank %d of 3, tag 0" % r in v["repr"]
        assert "max_tokens= is needed" in v["no_max_tokens"]


def test_fp8_moe_on_a_process_group_equals_the_module_without_one(run):
    """mok.torch.MoE(dtype="fp8", group=process group): every rank's out, d_x, d_rw and
    routed weight gradients bitwise equal to the fp8 module without a group on the ranks'
    tokens concatenated; its shared expert's gradients to that module on its own tokens."""
    import mok.torch as mt
    res, socks = run
    E, El = W.E3, W.E3 // WORLD
    masters = W.fp8_masters(E)
    parts = [W.fp8_inputs(40 + r, W.T_OF[r], E) for r in range(WORLD)]
    with mok.connect(socks[0]) as c:
        def ep1(ps):
            m = mt.MoE(W.H8, W.I8, E, W.K, shared_intermediate=W.I8, client=c, dtype="fp8")
            return W.fp8_step(m, masters, 0, *(torch.cat([p[i] for p in ps]) for i in range(4)))
        all1 = ep1(parts)
        own1 = [ep1([p]) for p in parts]
    off = 0
    for r in range(WORLD):
        v = ok(res, r, "moe_fp8")
        assert v["rank"] == r and v["world"] == WORLD and "dtype=fp8" in v["repr"]
        assert v["quantizations"] == 6  # each master once
        assert v["packed"] == 2 * El * W.I8 * W.H8 + 4 * El  # the rank's experts only
        rows = slice(off, off + W.T_OF[r])
        for n in ("out", "d_x", "d_rw"):
            assert v[n].tobytes() == all1[n][rows].tobytes(), (r, n)
        for n in ("d_w_gate", "d_w_up", "d_w_down"):
            assert v[n].tobytes() == all1[n][r * El:(r + 1) * El].tobytes(), (r, n)
        for n in ("d_s_gate", "d_s_up", "d_s_down"):
            assert v[n].tobytes() == own1[r][n].tobytes(), (r, n)
        off += W.T_OF[r]
    # it ran in fp8: the bf16 reference differs by the format's error
    x, ids, rw, _ = (torch.cat([p[i] for p in parts]) for i in range(4))
    r_out = ref.forward(x.float().numpy(), ids.numpy(), rw.numpy(),
                        *(masters[n].float().numpy() for n in W.FP8_ORDER))
    got = np.concatenate([ok(res, r, "moe_fp8")["out"] for r in range(WORLD)])
    assert 0.005 < ref.rel_err(got, r_out) < 0.15


# ---- the verdict alone (no processes) ----

def info(engine="cuda", host="h", gpu="0000:19:00.0", sizing=None, transport="auto",
         error=None):
    return {"sizing": sizing or {"hidden": 8}, "engine": engine, "host": host, "gpu": gpu,
            "transport": transport, "error": error}


def test_plan_transports():
    assert md.plan([info(gpu="a"), info(gpu="b")]) == ("nccl", None)
    assert md.plan([info(gpu="a"), info(gpu="a")]) == ("host", None)  # one GPU, MPS
    assert md.plan([info("cpu", gpu="x"), info("cpu", gpu="x")]) == ("host", None)
    assert md.plan([info(gpu="a", host="h1"), info(gpu="a", host="h2")]) == ("nccl", None)
    t, e = md.plan([info(gpu="a"), info(gpu="a")], "nccl")
    assert t is None and e[0] == "EUNSUPPORTED" and "ranks 0 and 1 are served by one GPU" in e[1]
    t, e = md.plan([info("cpu", host="h1"), info("cpu", host="h2")])
    assert e[0] == "EUNSUPPORTED" and "rank 1 runs on another host" in e[1]
    t, e = md.plan([info(host="h1"), info(host="h2")], "host")
    assert e[0] == "EUNSUPPORTED" and "transport='nccl'" in e[1]
    t, e = md.plan([info("cpu"), info("cuda")])
    assert e[0] == "EINVAL" and "different engines" in e[1]
    t, e = md.plan([info(sizing={"hidden": 8}), info(sizing={"hidden": 16})])
    assert e == ("EINVAL", "ranks disagree on the group's hidden: rank 0 has 8, rank 1 has 16")
    t, e = md.plan([info(transport="host"), info(transport="nccl")])
    assert e[0] == "EINVAL" and "transport" in e[1]
    t, e = md.plan([info(), info(error=("ECLOSED", "closed"))])
    assert e == ("ECLOSED", "rank 1: closed")


def test_gpu_id_from_the_cuda_engine_description():
    class C:
        device = "NVIDIA H200 (sm_90, 132 SMs, 140 GiB) GPU 3 00000000:5D:00.0"
    assert md._gpu_id(C) == "00000000:5d:00.0"
    C.device = "cpu: 2 threads"
    assert md._gpu_id(C) == "cpu: 2 threads"


def test_join_needs_an_initialised_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(mok.Error) as e:
        md.join(None, max_tokens=8, hidden=8, topk=1, experts=2)
    assert e.value.status == "EINVAL" and "init_process_group" in str(e.value)
