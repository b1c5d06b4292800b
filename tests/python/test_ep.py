# SPDX-License-Identifier: Apache-2.0
"""The Python group API (docs/ep.md): two real mokd processes, one client per rank
(threads of this process), results bitwise equal to EP=1 and close to the float64
reference; errors as mok.Error."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, os.environ.get("MOK_BUILD") or "build")
LIBMOK = os.path.join(BUILD, "lib", "libmok.so")
MOKD = os.path.join(BUILD, "bin", "mokd")
if not (os.path.exists(LIBMOK) and os.path.exists(MOKD)):
    pytest.skip("not built", allow_module_level=True)

sys.path.insert(0, os.path.join(REPO, "client", "python"))
os.environ.setdefault("MOK_LIBRARY", LIBMOK)
import mok  # noqa: E402
from mok import reference as ref  # noqa: E402

H, I, E, K, W, TMAX = 16, 8, 4, 2, 2, 16


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    procs, socks = [], []
    for r in range(W):
        d = tmp_path_factory.mktemp("mokd%d" % r)
        sock = str(d / "mokd.sock")
        log = open(str(d / "mokd.log"), "w+")
        procs.append(subprocess.Popen([MOKD, "--socket", sock, "--engine", "cpu",
                                       "--threads", "1"], stdout=log, stderr=subprocess.STDOUT))
        socks.append(sock)
    deadline = time.time() + 15
    for p, s in zip(procs, socks):
        while not os.path.exists(s):
            assert p.poll() is None and time.time() < deadline, "mokd did not come up"
            time.sleep(0.02)
    yield socks
    for p in procs:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0


def inputs(seed, T):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    ids[::5, 1] = -1
    rw = rng.uniform(0.1, 0.9, (T, K)).astype(np.float32)
    d_out = rng.standard_normal((T, H)).astype(np.float32)
    return x, ids, rw, d_out


def weights(seed):
    rng = np.random.default_rng(seed)
    return [(0.3 * rng.standard_normal(s)).astype(np.float32)
            for s in ((E, I, H), (E, I, H), (E, H, I))]


def run_ranks(socks, key, Ts, tags=(0, 0), timeout_ms=10000, **sizing):
    wg, wu, wd = weights(1)
    El = E // W
    results, errors = [None] * W, [None] * W

    def rank(r):
        try:
            with mok.connect(socks[r]) as c:
                g = c.group(key, r, W, max_tokens=TMAX, hidden=H, topk=K, experts=E,
                            timeout_ms=timeout_ms, **sizing)
                assert g.local_experts == El and g.first_expert == r * El
                layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K, group=g,
                                group_tag=tags[r])
                x, ids, rw, d_out = inputs(10 + r, Ts[r])
                sl = slice(r * El, (r + 1) * El)
                out, ctx = layer.forward(x, ids, rw, wg[sl], wu[sl], wd[sl])
                grads = layer.backward(ctx, d_out)
                results[r] = (out, grads, g.rejoined)
        except mok.Error as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


@pytest.mark.parametrize("sizing", [{}, {"capacity": 0.75, "ring_rows": W * TMAX}],
                         ids=["one-pass", "capacity-ring"])
def test_group_layer_matches_ep1_and_reference(daemons, sizing):
    Ts = (TMAX, 11)
    results, errors = run_ranks(daemons, "py-ep-%d-%d" % (os.getpid(), len(sizing)), Ts,
                                **sizing)
    assert errors == [None] * W, errors
    wg, wu, wd = weights(1)
    parts = [inputs(10 + r, Ts[r]) for r in range(W)]
    x, ids, rw, d_out = (np.concatenate([p[i] for p in parts]) for i in range(4))
    with mok.connect(daemons[0]) as c:  # EP=1: every expert local, all tokens
        layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K)
        out1, ctx = layer.forward(x, ids, rw, wg, wu, wd)
        g1 = layer.backward(ctx, d_out)
    El, off = E // W, 0
    for r in range(W):
        out, g, _ = results[r]
        rows = slice(off, off + Ts[r])
        assert out.tobytes() == out1[rows].tobytes()
        assert g.d_x.tobytes() == g1.d_x[rows].tobytes()
        assert g.d_router_weights.tobytes() == g1.d_router_weights[rows].tobytes()
        assert g.d_w_gate.tobytes() == g1.d_w_gate[r * El:(r + 1) * El].tobytes()
        assert g.d_w_down.tobytes() == g1.d_w_down[r * El:(r + 1) * El].tobytes()
        off += Ts[r]
    r_out = ref.forward(x, ids, rw, wg, wu, wd)
    assert ref.rel_err(np.concatenate([res[0] for res in results]), r_out) < 1e-5


def test_group_errors(daemons):
    key = "py-ep-mismatch-%d" % os.getpid()
    results, errors = run_ranks(daemons, key, (TMAX, TMAX), tags=(1, 2))
    assert all(isinstance(e, mok.Error) and "mismatch" in str(e) for e in errors), errors
    # the group still works, and the daemons kept it: a cheap re-join
    results, errors = run_ranks(daemons, key, (TMAX, TMAX))
    assert errors == [None] * W, errors
    assert all(res[2] for res in results)
    with mok.connect(daemons[0]) as c:
        with pytest.raises(mok.Error) as e:
            c.group("py-ep-bad", 0, 2, max_tokens=TMAX, hidden=H, topk=K, experts=3)
        assert "multiple of world" in str(e.value)
        with pytest.raises(mok.Error) as e:
            c.group("py-ep-bad", 0, 2, max_tokens=TMAX, hidden=H, topk=K, experts=E,
                    capacity=1.5)
        assert e.value.status == "EINVAL" and "capacity" in str(e.value)
        # groups through NCCL are the cuda engine's; ids are 128 bytes
        with pytest.raises(mok.Error) as e:
            c.nccl_id()
        assert e.value.status == "EUNSUPPORTED" and "cuda engine" in str(e.value)
        with pytest.raises(mok.Error) as e:
            c.group("py-ep-bad", 0, 2, max_tokens=TMAX, hidden=H, topk=K, experts=E,
                    nccl_id=b"short")
        assert e.value.status == "EINVAL" and "nccl_id" in str(e.value)
        with pytest.raises(mok.Error) as e:
            c.group("py-ep-nccl-%d" % os.getpid(), 0, 2, max_tokens=TMAX, hidden=H, topk=K,
                    experts=E, nccl_id=bytes(128))
        assert e.value.status == "EUNSUPPORTED" and "cuda engine" in str(e.value)
        g = c.group("py-ep-alone-%d" % os.getpid(), 0, 2, max_tokens=TMAX, hidden=H, topk=K,
                    experts=E, timeout_ms=300)
        layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K, group=g)
        x, ids, rw, _ = inputs(3, 4)
        wg, wu, wd = (w[:E // W] for w in weights(1))
        with pytest.raises(mok.Error) as e:
            layer.forward(x, ids, rw, wg, wu, wd)
        assert e.value.status == "ETIMEOUT", e.value
        layer.close()
        g.leave()


def test_group_capacity_overflow(daemons):
    # one row for every rank's experts: the routing needs more
    results, errors = run_ranks(daemons, "py-ep-cap-%d" % os.getpid(), (TMAX, TMAX),
                                capacity=0.5 / (W * TMAX * K))
    assert all(isinstance(e, mok.Error) and e.status == "EOVERFLOW" for e in errors), errors


# ---- fp8 layers on a group (docs/ep.md "FP8 layers on a group") ----

H8, I8, I8_S = 128, 128, 128


def fp8_inputs(seed, T):
    rng = np.random.default_rng(seed)
    x = mok.to_bf16(rng.standard_normal((T, H8)))
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    ids[::5, 1] = -1
    rw = rng.uniform(0.1, 0.9, (T, K)).astype(np.float32)
    d_out = mok.to_bf16(rng.standard_normal((T, H8)))
    return x, ids, rw, d_out


def fp8_masters(seed):
    rng = np.random.default_rng(seed)
    return {n: mok.to_bf16(0.1 * rng.standard_normal(s)) for n, s in
            (("w_gate", (E, I8, H8)), ("w_up", (E, I8, H8)), ("w_down", (E, H8, I8)),
             ("s_gate", (I8_S, H8)), ("s_up", (I8_S, H8)), ("s_down", (H8, I8_S)))}


def fp8_run(layer, masters, x, ids, rw, d_out, recompute):
    """quantize_weight of each master (this layer's experts), forward, backward."""
    p = {n: layer.quantize_weight(n, w) for n, w in masters.items()}
    out, ctx = layer.forward(x, ids, rw, p["w_gate"], p["w_up"], p["w_down"], p["s_gate"],
                             p["s_up"], p["s_down"], recompute=recompute)
    return out, layer.backward(ctx, d_out)


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_fp8_group_layer_matches_ep1(daemons, recompute):
    """An fp8 layer on a bfloat16 group: each rank packs its local experts' masters; out,
    d_x, d_rw and the routed weight gradients equal the fp8 layer at EP=1 bit for bit, the
    shared expert's gradients EP=1 on the rank's own tokens."""
    Ts, key = (TMAX, 9), "py-ep-fp8-%d-%d" % (os.getpid(), recompute)
    m = fp8_masters(5)
    El = E // W
    results, errors = [None] * W, [None] * W

    def rank(r):
        try:
            with mok.connect(daemons[r]) as c:
                g = c.group(key, r, W, max_tokens=TMAX, hidden=H8, topk=K, experts=E,
                            dtype="bfloat16")
                layer = c.layer(hidden=H8, intermediate=I8, experts=E, topk=K,
                                shared_intermediate=I8_S, dtype="fp8", group=g)
                assert layer.packed_weight_bytes("w_gate") == \
                    2 * El * I8 * H8 + 4 * El * (I8 // 128) * (H8 // 128)
                own = dict(m, **{n: m[n][r * El:(r + 1) * El] for n in ("w_gate", "w_up",
                                                                         "w_down")})
                results[r] = fp8_run(layer, own, *fp8_inputs(30 + r, Ts[r]), recompute)
        except mok.Error as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [None] * W, errors
    parts = [fp8_inputs(30 + r, Ts[r]) for r in range(W)]
    with mok.connect(daemons[0]) as c:  # EP=1: every expert, all tokens; and each rank's own
        def ep1(ps):
            layer = c.layer(hidden=H8, intermediate=I8, experts=E, topk=K,
                            shared_intermediate=I8_S, dtype="fp8", max_tokens=W * TMAX)
            args = (np.concatenate([p[i] for p in ps]) for i in range(4))
            return fp8_run(layer, m, *args, recompute)
        out1, g1 = ep1(parts)
        own1 = [ep1([p]) for p in parts]
    off = 0
    for r in range(W):
        out, g = results[r]
        rows = slice(off, off + Ts[r])
        assert out.tobytes() == out1[rows].tobytes(), r
        assert g.d_x.tobytes() == g1.d_x[rows].tobytes(), r
        assert g.d_router_weights.tobytes() == g1.d_router_weights[rows].tobytes(), r
        for n in ("d_w_gate", "d_w_up", "d_w_down"):
            assert getattr(g, n).tobytes() == getattr(g1, n)[r * El:(r + 1) * El].tobytes(), n
        for n in ("d_s_gate", "d_s_up", "d_s_down"):
            assert getattr(g, n).tobytes() == getattr(own1[r][1], n).tobytes(), n
        off += Ts[r]
    # it ran in fp8: the unquantised layer differs by the format's error
    x, ids, rw, _ = (np.concatenate([p[i] for p in parts]) for i in range(4))
    f = {n: mok.from_bf16(w) for n, w in m.items()}
    r_out = ref.forward(mok.from_bf16(x), ids, rw, f["w_gate"], f["w_up"], f["w_down"],
                        f["s_gate"], f["s_up"], f["s_down"])
    err = ref.rel_err(mok.from_bf16(np.concatenate([res[0] for res in results])), r_out)
    assert 0.005 < err < 0.15, err


def test_fp8_group_refusals(daemons):
    with mok.connect(daemons[0]) as c:
        with pytest.raises(mok.Error) as e:  # a group's dtype is its activations'
            c.group("py-ep-fp8-dtype", 0, 2, max_tokens=TMAX, hidden=H8, topk=K, experts=E,
                    dtype="fp8")
        assert e.value.status == "EINVAL" and "bfloat16 group" in e.value.message
        g = c.group("py-ep-fp8-f32-%d" % os.getpid(), 0, 2, max_tokens=TMAX, hidden=H8,
                    topk=K, experts=E, dtype="float32")
        with pytest.raises(mok.Error) as e:
            c.layer(hidden=H8, intermediate=I8, experts=E, topk=K, dtype="fp8", group=g)
        assert e.value.status == "EINVAL" and "is float32" in e.value.message, e.value
        g.leave()
        g = c.group("py-ep-fp8-ring-%d" % os.getpid(), 0, 2, max_tokens=TMAX, hidden=H8,
                    topk=K, experts=E, dtype="bfloat16", ring_rows=8)
        with pytest.raises(mok.Error) as e:
            c.layer(hidden=H8, intermediate=I8, experts=E, topk=K, dtype="fp8", group=g)
        assert e.value.status == "EUNSUPPORTED" and "ring_rows" in e.value.message, e.value
        g.leave()
