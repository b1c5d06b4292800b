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
