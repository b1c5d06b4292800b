# SPDX-License-Identifier: Apache-2.0
"""bfloat16 results: ml_dtypes.bfloat16 arrays where ml_dtypes is installed,
uint16 bit patterns otherwise (or with MOK_BF16=uint16), the same bits either
way; both accepted as inputs and as out= arrays. Against a real mokd (cpu
engine). The fallback is tested in a python that cannot import ml_dtypes
(hidden through sys.modules) whether or not it is installed; the ml_dtypes
path where it is installed (tests/python/ci_pip_install.sh installs it)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, os.environ.get("MOK_BUILD") or "build")
LIBMOK = os.path.join(BUILD, "lib", "libmok.so")
MOKD = os.path.join(BUILD, "bin", "mokd")
if not (os.path.exists(LIBMOK) and os.path.exists(MOKD)):
    pytest.skip("not built: %s, %s" % (LIBMOK, MOKD), allow_module_level=True)

sys.path.insert(0, os.path.join(REPO, "client", "python"))
os.environ.setdefault("MOK_LIBRARY", LIBMOK)
import mok  # noqa: E402
import mok.bf16  # noqa: E402
from mok import reference as ref  # noqa: E402

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None
needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")

T, H, I, E, K = 16, 32, 16, 4, 2


@pytest.fixture(scope="module")
def sock(tmp_path_factory):
    d = tmp_path_factory.mktemp("mokd-bf16")
    path = str(d / "mokd.sock")
    log = open(str(d / "mokd.log"), "w+")
    p = subprocess.Popen([MOKD, "--socket", path, "--engine", "cpu", "--threads", "1"],
                         stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 15
    while not os.path.exists(path):
        assert p.poll() is None and time.time() < deadline, "mokd did not come up"
        time.sleep(0.02)
    yield path
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=15) == 0
    log.close()


def inputs(seed=1):
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    a = dict(x=mok.to_bf16(rng.standard_normal((T, H))), topk_ids=ids,
             router_weights=rng.random((T, K)).astype(np.float32),
             w_gate=mok.to_bf16(rng.standard_normal((E, I, H)) / np.sqrt(H)),
             w_up=mok.to_bf16(rng.standard_normal((E, I, H)) / np.sqrt(H)),
             w_down=mok.to_bf16(rng.standard_normal((E, H, I)) / np.sqrt(I)))
    return a, mok.to_bf16(rng.standard_normal((T, H)))


def run_layer(c, a, d_out):
    layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K, dtype="bfloat16")
    out, ctx = layer.forward(**a)
    return layer, out, layer.backward(ctx, d_out)


# the same job in a python of its own: prints the dtype and the bits of out and d_w_gate
CHILD = r"""
import json, sys
HIDE
import numpy as np, mok
sys.path.insert(0, TESTS)
from test_bf16_results import inputs, run_layer
with mok.connect(SOCK) as c:
    a, d_out = inputs()
    _, out, g = run_layer(c, a, d_out)
    print(json.dumps({"dtype": str(mok.bf16_dtype()), "out": str(out.dtype),
                      "d_w_gate": str(g.d_w_gate.dtype),
                      "bits": np.ascontiguousarray(out).view(np.uint16).tolist(),
                      "gbits": np.ascontiguousarray(g.d_w_gate).view(np.uint16).tolist()}))
"""


def child(sock, hide_ml_dtypes=False, env_bf16=None):
    code = CHILD.replace("HIDE", "sys.modules['ml_dtypes'] = None" if hide_ml_dtypes else "")
    code = "SOCK = %r\nTESTS = %r\n" % (sock, os.path.dirname(os.path.abspath(__file__))) + code
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "client", "python"), MOK_LIBRARY=LIBMOK)
    env.pop("MOK_BF16", None)
    if env_bf16 is not None:
        env["MOK_BF16"] = env_bf16
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_results_come_in_bf16_dtype(sock):
    with mok.connect(sock) as c:
        a, d_out = inputs()
        layer, out, g = run_layer(c, a, d_out)
        want = mok.bf16_dtype()
        assert want == (np.dtype(ml_dtypes.bfloat16) if ml_dtypes and
                        os.environ.get("MOK_BF16", "") != "uint16" else np.dtype(np.uint16))
        assert out.dtype == want and out.shape == (T, H)
        for n in ("d_x", "d_w_gate", "d_w_up", "d_w_down"):
            assert getattr(g, n).dtype == want, n
        assert g.d_router_weights.dtype == np.float32  # float32 slots stay float32
        sched, routed_x = layer.dispatch(a["x"], a["topk_ids"])
        assert sched.dtype == np.int32 and routed_x.dtype == want
        # the results go back in as inputs, and against the float64 reference
        r_out = ref.forward(**a)
        assert 0 < ref.rel_err(out, r_out) < 1e-2
        assert ref.rel_err(mok.from_bf16(out), r_out) == ref.rel_err(out, r_out)
        out2 = layer.combine(sched, layer.compute(sched, routed_x, a["w_gate"], a["w_up"],
                                                  a["w_down"])[0], a["router_weights"])
        assert out2.dtype == want and out2.view(np.uint16).tobytes() == out.view(np.uint16).tobytes()
        # float32 layers are untouched
        lf = c.layer(hidden=H, intermediate=I, experts=E, topk=K, dtype="float32")
        af = {k: (mok.from_bf16(v) if v.dtype == np.uint16 else v) for k, v in a.items()}
        assert lf.forward(**af)[0].dtype == np.float32


def test_without_ml_dtypes_results_are_uint16(sock):
    got = child(sock, hide_ml_dtypes=True)
    assert got["dtype"] == got["out"] == got["d_w_gate"] == "uint16", got


def test_mok_bf16_uint16_keeps_bit_patterns(sock):
    got = child(sock, env_bf16="uint16")
    assert got["dtype"] == got["out"] == "uint16", got


def test_bad_mok_bf16_is_refused(sock):
    with pytest.raises(AssertionError, match="MOK_BF16 must be"):
        child(sock, env_bf16="float16")


@needs_ml_dtypes
def test_ml_dtypes_and_uint16_results_hold_the_same_bits(sock):
    with_ml = child(sock)
    without = child(sock, hide_ml_dtypes=True)
    assert with_ml["out"] == with_ml["d_w_gate"] == "bfloat16", with_ml
    assert without["out"] == "uint16"
    assert with_ml["bits"] == without["bits"] and with_ml["gbits"] == without["gbits"]
    # MOK_BF16=ml_dtypes insists on it; with it hidden, that is an error
    assert child(sock, env_bf16="ml_dtypes")["out"] == "bfloat16"
    with pytest.raises(AssertionError, match="ml_dtypes"):
        child(sock, hide_ml_dtypes=True, env_bf16="ml_dtypes")


@needs_ml_dtypes
def test_ml_dtypes_inputs_and_out_arrays(sock):
    bf = np.dtype(ml_dtypes.bfloat16)
    with mok.connect(sock) as c:
        a, d_out = inputs(2)
        layer, out_bits, g_bits = run_layer(c, a, d_out)
        # the same inputs as ml_dtypes arrays: the same bits out
        a_ml = {k: (v.view(bf) if v.dtype == np.uint16 else v) for k, v in a.items()}
        out, ctx = layer.forward(**a_ml)
        assert out.view(np.uint16).tobytes() == np.asarray(out_bits).view(np.uint16).tobytes()
        assert np.array_equal(mok.to_bf16(out), np.asarray(out_bits).view(np.uint16))
        # out= of either dtype, in daemon-shared memory or not; the caller's array comes back
        for make in (lambda: np.zeros((T, H), bf), lambda: np.zeros((T, H), np.uint16),
                     lambda: c.empty((T, H), bf), lambda: c.empty((T, H), "bfloat16")):
            mine = make()
            got, _ = layer.forward(**a_ml, out=mine)
            assert got is mine
            assert mine.view(np.uint16).tobytes() == out.view(np.uint16).tobytes()
        # a bf16 out= in a float32 slot, or a float16 one in a bf16 slot: refused
        with pytest.raises(mok.Error) as ei:
            layer.forward(**a_ml, out=np.zeros((T, H), np.float16))
        assert ei.value.status == "ESHAPE" and "bfloat16" in ei.value.message
        grads_out = {"d_router_weights": np.zeros((T, K), bf)}
        with pytest.raises(mok.Error) as ei:
            layer.backward(ctx, d_out, out=grads_out, retain_ctx=True)
        assert ei.value.status == "ESHAPE" and "float32" in ei.value.message
        g = layer.backward(ctx, d_out.view(bf))
        assert g.d_w_down.dtype == bf
        assert g.d_w_down.view(np.uint16).tobytes() == \
            np.asarray(g_bits.d_w_down).view(np.uint16).tobytes()


def test_bf16_helpers_take_either_form():
    f = np.array([1.0, -2.5, 3.140625, 0.0, np.inf], np.float32)
    b = mok.to_bf16(f)
    assert b.dtype == np.uint16
    if ml_dtypes is not None:
        m = b.view(ml_dtypes.bfloat16)
        assert mok.is_bf16(m.dtype) and not mok.is_bf16(np.uint16)
        assert np.array_equal(mok.to_bf16(m), b)  # bfloat16 in: its bits
        assert np.array_equal(mok.from_bf16(m), f)
        assert np.array_equal(m.astype(np.float32), f)
    assert not mok.is_bf16("not a dtype")
