# SPDX-License-Identifier: Apache-2.0
"""mok.hf_transformers and mok.torchtitan with dtype="fp8" (and bf16) on the cpu engine:
CPU tensors through the binding's numpy path, the models' own Parameters as the masters.

- each runner, forward and backward, bit for bit equal to the same layer run by hand
  through mok.torch.MoE(dtype="fp8") on the same weights (transformers' gate_up_proj
  cut into w_gate and w_up; torchtitan's w1, w3, w2 and shared expert), and its packed
  weights byte for byte equal to the binding's quantize_weight of those weights;
- quantize_weight runs once per weight per optimizer step, none for more forwards or
  backward; an in-place change of gate_up_proj re-quantises w_gate and w_up, one of
  down_proj only w_down; requantize() makes the next call quantise everything;
- after optimizer steps the runner still equals MoE(dtype="fp8") on the new weights;
  torchtitan's weights as DTensors (a 1-rank gloo mesh) are followed as held;
- tests/gpu/fp8_accuracy.py in its smoke mode (a few steps of both runs);
- refusals: dtype names, backend="torch" with fp8, dims off the 128 blocks (the daemon's
  message at the first call).
Skipped without torch or without a build; the transformers part without transformers
(run by tests/python/ci_torch.sh)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, os.environ.get("MOK_BUILD") or "build")
LIBMOK = os.path.join(BUILD, "lib", "libmok.so")
MOKD = os.path.join(BUILD, "bin", "mokd")
_missing = [p for p in (LIBMOK, MOKD) if not os.path.exists(p)]
if _missing:
    pytest.skip("not built: %s" % ", ".join(_missing), allow_module_level=True)

sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("MOK_LIBRARY", LIBMOK)
import mok  # noqa: E402
import mok.hf_transformers as mhf  # noqa: E402
import mok.torch as mt  # noqa: E402
import mok.torchtitan as mtt  # noqa: E402
import titan_ref  # noqa: E402

H, I, E, K = 128, 128, 4, 2


@pytest.fixture(scope="module")
def mokd(tmp_path_factory):
    d = tmp_path_factory.mktemp("mokd-runners")
    sock = str(d / "mokd.sock")
    log = open(str(d / "mokd.log"), "w+")
    proc = subprocess.Popen([MOKD, "--socket", sock, "--engine", "cpu", "--threads", "2"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 15
    while not os.path.exists(sock):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail("mokd did not come up (rc %s):\n%s" % (proc.poll(), log.read()))
        time.sleep(0.02)
    yield sock
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "hung on SIGTERM"
    log.seek(0)
    text = log.read()
    log.close()
    assert rc == 0, "mokd exited with %s on SIGTERM; its log:\n%s" % (rc, text)


@pytest.fixture
def client(mokd):
    c = mok.connect(mokd)
    yield c
    c.close()


class Counter:
    """Layer.quantize_weight calls (monkeypatched in), by layer and weight slot."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = mok.Layer.quantize_weight

        def counting(layer, slot, weight, out=None):
            self.calls.append((layer, slot))
            return real(layer, slot, weight, out=out)
        monkeypatch.setattr(mok.Layer, "quantize_weight", counting)

    def of(self, runners):
        """The weight slots quantised by these runners' layers, in call order."""
        layers = {id(s.layer) for r in runners for s in r.slots.values()}
        return [slot for layer, slot in self.calls if id(layer) in layers]


def bits(t):
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def np16(t):
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def by_hand_module(client, dtype, w_gate, w_up, w_down, s=(None, None, None), topk=K):
    """mok.torch.MoE of `dtype` holding copies of the given weights."""
    I_s = 0 if s[0] is None else s[0].shape[0]
    m = mt.MoE(w_gate.shape[2], w_gate.shape[1], w_gate.shape[0], topk, shared_intermediate=I_s,
               client=client, dtype=dtype)
    with torch.no_grad():
        for name, w in zip(("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"),
                           (w_gate, w_up, w_down) + tuple(s)):
            if w is not None:
                getattr(m, name).copy_(w)
    return m


def packed_by_binding(client, runner, weights):
    """The binding's quantize_weight of each weight {slot: bf16 tensor} on a layer of the
    runner's sizes (a layer of its own)."""
    (Hh, Ii, Ee, Kk, Is), = runner.slots.keys()
    layer = client.layer(hidden=Hh, intermediate=Ii, experts=Ee, topk=Kk, shared_intermediate=Is,
                         dtype="fp8")
    out = {n: layer.quantize_weight(n, np16(w)) for n, w in weights.items()}
    layer.close()
    return out


# ---- Hugging Face transformers ----------------------------------------------------------

def qwen3_moe(hidden=H, moe_intermediate=I, seed=0):
    tf = pytest.importorskip("transformers")
    cfg = tf.Qwen3MoeConfig(vocab_size=96, hidden_size=hidden, intermediate_size=256,
                            moe_intermediate_size=moe_intermediate, num_experts=E,
                            num_experts_per_tok=K, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                            norm_topk_prob=True)
    torch.manual_seed(seed)
    return tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def experts_of(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


def experts_inputs(seed, T):
    """x, ids (one slot an index >= E: transformers' expert-parallel sentinel), rw, d_out."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]
    ids[3, 1] = E  # the sentinel: no expert (mok's -1)
    rw = torch.rand(T, K, generator=g) * 0.8 + 0.1
    d_out = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x, ids, rw, d_out


def run_experts(ex, x, ids, rw, d_out):
    """out and the gradients of x, rw, gate_up_proj and down_proj of one experts call."""
    ex.zero_grad(set_to_none=True)
    xg, rwg = x.clone().requires_grad_(True), rw.clone().requires_grad_(True)
    out = ex(xg, ids, rwg)
    out.backward(d_out)
    return out.detach(), xg.grad, rwg.grad, ex.gate_up_proj.grad, ex.down_proj.grad


def run_moe(m, x, ids, rw, d_out):
    m.zero_grad(set_to_none=True)
    xg, rwg = x.clone().requires_grad_(True), rw.clone().requires_grad_(True)
    ids = torch.where(ids < E, ids, torch.full_like(ids, -1)).to(torch.int32)
    out = m(xg, ids, rwg)
    out.backward(d_out)
    return (out.detach(), xg.grad, rwg.grad, torch.cat([m.w_gate.grad, m.w_up.grad], 1),
            m.w_down.grad)


@pytest.mark.parametrize("dtype", ["fp8", "bfloat16"])
def test_hf_experts_equal_moe_by_hand(client, monkeypatch, dtype):
    model = qwen3_moe()
    count = Counter(monkeypatch)
    assert mhf.apply(model, client=client, dtype=dtype) == 2
    ex = experts_of(model)[0]
    gu, dp = ex.gate_up_proj.detach(), ex.down_proj.detach()
    x, ids, rw, d_out = experts_inputs(1, 37)
    got = run_experts(ex, x, ids, rw, d_out)
    run = ex.__dict__["_mok_run"]
    assert run.dtype == dtype and list(run.slots) == [(H, I, E, K, 0)]
    m = by_hand_module(client, dtype, gu[:, :I], gu[:, I:], dp)
    want = run_moe(m, x, ids, rw, d_out)
    names = ("out", "d_x", "d_router_weights", "d_gate_up_proj", "d_down_proj")
    for n, a, b in zip(names, got, want):
        assert same(a, b), n
    assert torch.all(got[2][3, 1] == 0)  # the sentinel slot: no router gradient
    if dtype == "bfloat16":
        assert run.quantizations == 0 and run.packed_weights == {} and count.of([run]) == []
        return
    # fp8 really ran: the bf16 layer on the same weights gives other bits
    m16 = by_hand_module(client, "bfloat16", gu[:, :I], gu[:, I:], dp)
    assert not same(run_moe(m16, x, ids, rw, d_out)[0], got[0])
    # the packed weights: the binding's quantisation of the halves of gate_up_proj
    assert sorted(count.of([run])) == ["w_down", "w_gate", "w_up"] and run.quantizations == 3
    hand = packed_by_binding(client, run, dict(w_gate=gu[:, :I], w_up=gu[:, I:], w_down=dp))
    packed = run.packed_weights
    assert sorted(packed) == sorted(hand)
    for n in hand:
        assert bits(packed[n]) == hand[n].tobytes(), n
        assert bits(packed[n]) == bits(m.packed_weights[n]), n
    # a second call on the same weights: the same bits, no quantisation
    again = run_experts(ex, x, ids, rw, d_out)
    assert all(same(a, b) for a, b in zip(again, got)) and run.quantizations == 3


def test_hf_training_quantises_once_per_weight_per_step(client, monkeypatch):
    model = qwen3_moe(seed=1)
    count = Counter(monkeypatch)
    mhf.apply(model, client=client, dtype="float8_e4m3fn")
    exs = experts_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    losses = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        for _ in range(2):  # two micro-batches: one quantisation per weight per step
            loss = model(input_ids=ids, labels=ids).loss
            runs = [ex.__dict__["_mok_run"] for ex in exs]
            assert len(count.of(runs)) == 6 * (step + 1)  # 3 weights x 2 experts modules
            loss.backward()
            assert len(count.of(runs)) == 6 * (step + 1)  # backward quantises nothing
        for ex in exs:  # the masters' gradients, as for any Parameter
            assert ex.gate_up_proj.grad.shape == ex.gate_up_proj.shape
            assert ex.down_proj.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        model(input_ids=ids)
    assert len(count.of(runs)) == 24
    assert all(r.quantizations == 12 for r in runs)
    assert losses[-1] < losses[0]
    # after the steps the runner is the fp8 layer of the new weights, bit for bit
    ex = exs[1]
    gu, dp = ex.gate_up_proj.detach(), ex.down_proj.detach()
    x, tk, rw, d_out = experts_inputs(3, 29)
    got = run_experts(ex, x, tk, rw, d_out)
    want = run_moe(by_hand_module(client, "fp8", gu[:, :I], gu[:, I:], dp), x, tk, rw, d_out)
    assert all(same(a, b) for a, b in zip(got, want))


def test_hf_in_place_changes_requantise_what_they_touch(client, monkeypatch):
    model = qwen3_moe(seed=2)
    count = Counter(monkeypatch)
    mhf.apply(model, client=client, dtype=torch.float8_e4m3fn)
    ex = experts_of(model)[0]
    x, ids, rw, d_out = experts_inputs(4, 21)
    with torch.no_grad():
        before = ex(x, ids, rw)
        run = ex.__dict__["_mok_run"]
        n = len(count.of([run]))
        ex.down_proj[2].mul_(0.5)  # a view of down_proj: only w_down
        ex(x, ids, rw)
        assert count.of([run])[n:] == ["w_down"]
        ex.gate_up_proj[:, I:].mul_(-1)  # the up half only, but one Parameter: both halves
        after = ex(x, ids, rw)
        assert sorted(count.of([run])[n + 1:]) == ["w_gate", "w_up"]
    assert not torch.equal(before, after)
    gu, dp = ex.gate_up_proj.detach(), ex.down_proj.detach()
    want = run_moe(by_hand_module(client, "fp8", gu[:, :I], gu[:, I:], dp), x, ids, rw, d_out)
    assert same(after, want[0])
    # writes through .data are not seen; requantize() makes the next call take them
    ex.down_proj.data.mul_(2)
    with torch.no_grad():
        assert torch.equal(ex(x, ids, rw), after)
        assert mhf.requantize(model) == 1  # the one experts module that ran
        moved = ex(x, ids, rw)
    assert sorted(count.of([run])[n + 3:]) == ["w_down", "w_gate", "w_up"]
    dp = ex.down_proj.detach()
    want = run_moe(by_hand_module(client, "fp8", gu[:, :I], gu[:, I:], dp), x, ids, rw, d_out)
    assert same(moved, want[0])


def test_hf_fp8_refusals(client):
    model = qwen3_moe()
    for d in ("float16", "e5m2", None):
        with pytest.raises(ValueError, match=r'mok.hf_transformers.apply: dtype must be '
                                             r'"bfloat16" \(the default\) or "fp8"'):
            mhf.apply(model, client=client, dtype=d)
    with pytest.raises(ValueError, match="dtype='fp8' needs backend='mokd'"):
        mhf.apply(model, backend="torch", dtype="fp8")
    assert model.config._experts_implementation != "mok"  # refused before any change
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(5))
    for hidden, inter, what in ((96, 128, "hidden = 96"), (128, 64, "intermediate = 64")):
        m = qwen3_moe(hidden=hidden, moe_intermediate=inter)
        mhf.apply(m, client=client, dtype="fp8")
        with pytest.raises(mok.Error) as ei:
            m(input_ids=ids)
        assert ei.value.status == "EINVAL" and what + " is not a multiple of 128" in \
            ei.value.message
        mhf.apply(m, client=client)  # the same model in bf16 runs
        m(input_ids=ids)


# ---- torchtitan -----------------------------------------------------------------------

def test_titan_grouped_experts_equal_moe_by_hand(client, monkeypatch):
    count = Counter(monkeypatch)
    ex = titan_ref.init(titan_ref.Experts(H, I, E), 1).to(torch.bfloat16)
    m = mtt.GroupedExperts.from_torchtitan(ex, client=client, dtype="fp8")
    assert m.w1 is ex.w1 and m.w2 is ex.w2 and m.w3 is ex.w3
    counts = torch.tensor([5, 0, 9, 3])
    N = int(counts.sum()) + 4  # four padding rows
    g = torch.Generator().manual_seed(6)
    x = torch.randn(N, H, generator=g).to(torch.bfloat16)
    d_out = torch.randn(N, H, generator=g).to(torch.bfloat16)

    def grads(fn, mod, params):
        mod.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        out = fn(xg)
        out.backward(d_out)
        return [out.detach(), xg.grad] + [p.grad for p in params]

    got = grads(lambda xg: m(xg, counts), m, (m.w1, m.w3, m.w2))
    hand = by_hand_module(client, "fp8", ex.w1.detach(), ex.w3.detach(), ex.w2.detach(), topk=1)
    ids = mtt.grouped_ids(counts, N).view(N, 1)
    ones = torch.ones(N, 1)
    want = grads(lambda xg: hand(xg, ids, ones), hand, (hand.w_gate, hand.w_up, hand.w_down))
    for n, a, b in zip(("out", "d_x", "d_w1", "d_w3", "d_w2"), got, want):
        assert same(a, b), n
    assert torch.equal(got[0][-4:], torch.zeros(4, H, dtype=torch.bfloat16))
    run = m._run
    assert sorted(count.of([run])) == ["w_down", "w_gate", "w_up"]
    packed = packed_by_binding(client, run, dict(w_gate=ex.w1, w_up=ex.w3, w_down=ex.w2))
    assert all(bits(run.packed_weights[n]) == packed[n].tobytes() for n in packed)
    # an optimizer step: each weight once more, and still the layer of the new weights
    torch.optim.SGD(m.parameters(), lr=0.5).step()
    got = grads(lambda xg: m(xg, counts), m, (m.w1, m.w3, m.w2))
    assert len(count.of([run])) == 6 and run.quantizations == 6
    hand = by_hand_module(client, "fp8", ex.w1.detach(), ex.w3.detach(), ex.w2.detach(), topk=1)
    want = grads(lambda xg: hand(xg, ids, ones), hand, (hand.w_gate, hand.w_up, hand.w_down))
    assert all(same(a, b) for a, b in zip(got, want))


def titan_moe(dim=H, hid=I, seed=2):
    m = titan_ref.init(titan_ref.MoE(dim, hid, E, K), seed).to(torch.bfloat16)
    m.expert_bias.copy_(torch.linspace(-0.01, 0.01, E))
    return m


def test_titan_use_mok_equals_moe_by_hand(client, monkeypatch):
    count = Counter(monkeypatch)
    tm = mtt.use_mok(titan_moe(), client=client, dtype="fp8")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 20, H, generator=g).to(torch.bfloat16)
    d_out = torch.randn(2, 20, H, generator=g).to(torch.bfloat16)
    sh = tm.shared_experts
    held = [tm.experts.w1, tm.experts.w3, tm.experts.w2, sh.w1.weight, sh.w3.weight,
            sh.w2.weight]

    def step():
        tm.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        out = tm(xg)
        out.backward(d_out)
        return [out.detach(), xg.grad, tm.router.gate.weight.grad] + [p.grad for p in held]

    def by_hand():
        """The same forward, its layer by mok.torch.MoE(dtype="fp8"): router as torchtitan's."""
        hand = by_hand_module(client, "fp8", *[p.detach() for p in held[:3]],
                              s=[p.detach() for p in held[3:]])
        tm.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        x2 = xg.reshape(-1, H)
        top, ids, _ = tm.router(x2, tm.expert_bias)
        out = hand(x2, ids.to(torch.int32), top.float()).reshape(x.shape)
        out.backward(d_out)
        return [out.detach(), xg.grad, tm.router.gate.weight.grad] + \
            [getattr(hand, n).grad for n in ("w_gate", "w_up", "w_down", "s_gate", "s_up",
                                               "s_down")]

    names = ("out", "d_x", "d_router", "d_w1", "d_w3", "d_w2", "d_s_w1", "d_s_w3", "d_s_w2")
    got = step()
    run = tm._mok_run
    assert sorted(count.of([run])) == sorted(["w_gate", "w_up", "w_down", "s_gate", "s_up",
                                              "s_down"])
    for n, a, b in zip(names, got, by_hand()):
        assert same(a, b), n
    assert tm.tokens_per_expert.sum().item() == 2 * 20 * K  # one call: torchtitan's counts kept
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-2)
    for s in range(2):
        step()
        opt.step()
    got = step()
    assert len(count.of([run])) == 6 * 3  # one per weight at the first call after a step
    for n, a, b in zip(names, got, by_hand()):
        assert same(a, b), n
    # a .data write and requantize(): the next call quantises the six again
    tm.experts.w2.data.mul_(2)
    assert mtt.requantize(tm) == 1
    step()
    assert len(count.of([run])) == 6 * 4


def test_titan_fp8_refusals(client):
    for make in (lambda **kw: mtt.GroupedExperts(H, I, E, **kw),
                 lambda **kw: mtt.GroupedExperts.from_torchtitan(
                     titan_ref.Experts(H, I, E), **kw),
                 lambda **kw: mtt.use_mok(titan_moe(), **kw)):
        with pytest.raises(ValueError, match=r'dtype must be "bfloat16" \(the default\)'):
            make(client=client, dtype="int8")
        with pytest.raises(ValueError, match="dtype='fp8' needs backend='mokd'"):
            make(backend="torch", dtype="fp8")
    tm = titan_moe()
    fwd = tm.forward
    with pytest.raises(ValueError):
        mtt.use_mok(tm, backend="torch", dtype="fp8")
    assert tm.forward == fwd and "_mok_run" not in tm.__dict__  # unchanged
    # dims off the 128 blocks: the daemon's message at the first call
    x = torch.randn(1, 6, 96).to(torch.bfloat16)
    tm = mtt.use_mok(titan_moe(dim=96, hid=128), client=client, dtype="fp8")
    with pytest.raises(mok.Error) as ei:
        tm(x)
    assert ei.value.status == "EINVAL" and "hidden = 96 is not a multiple of 128" in \
        ei.value.message
    ge = mtt.GroupedExperts.from_torchtitan(
        titan_ref.init(titan_ref.Experts(H, 64, E), 1).to(torch.bfloat16), client=client,
        dtype="fp8")
    with pytest.raises(mok.Error, match="intermediate = 64 is not a multiple of 128"):
        ge(torch.randn(8, H).to(torch.bfloat16), torch.tensor([2, 2, 2, 2]))


# ---- the FP8 accuracy runs' script, in its smoke mode (a few steps) --------------------

ACCURACY = os.path.join(REPO, "tests", "gpu", "fp8_accuracy.py")


def accuracy(mokd, out, *args):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "client", "python"),
               MOK_LIBRARY=LIBMOK)
    return subprocess.run([sys.executable, ACCURACY, "--socket", mokd, "--out", str(out)] +
                          list(args), capture_output=True, text=True, env=env, timeout=600)


def test_accuracy_script_smoke(mokd, tmp_path):
    """Both runs, a few steps each, on the cpu engine: the table, the JSON, the checks."""
    pytest.importorskip("transformers")
    import json
    p = accuracy(mokd, tmp_path, "--smoke")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "fp8_accuracy: passed" in p.stdout
    for run, steps, layers, per_step in (("tiny", 4, 2, 6), ("qwen3", 3, 2, 3)):
        res = json.load(open(str(tmp_path / ("fp8_accuracy_%s.json" % run))))
        assert res["run"] == run and res["engine"] == "cpu" and res["passed"] is True
        assert [len(res["losses"][d]) for d in ("bfloat16", "fp8")] == [steps, steps]
        assert res["quantizations"]["fp8"] == [per_step * steps] * layers
        assert res["losses"]["fp8"] != res["losses"]["bfloat16"]
        assert res["rel_diff"] <= res["bound"] and all(c["ok"] for c in res["checks"])
        assert "%s: %d steps" % (run, steps) in p.stdout
    # the bound can fail: fp8 is not bf16's bits, so a bound of 0 fails with exit 1
    p = accuracy(mokd, tmp_path, "--smoke", "--bound", "0", "tiny")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL final loss" in p.stdout and "fp8_accuracy: FAILED: tiny" in p.stdout
    res = json.load(open(str(tmp_path / "fp8_accuracy_tiny.json")))
    assert res["passed"] is False and res["bound"] == 0


def test_titan_dtensor_weights_are_followed_as_held(client, monkeypatch, tmp_path):
    """DTensor Parameters (FSDP2's, here on a 1-rank gloo mesh): an optimizer step moves
    the DTensor's version counter, not that of its to_local() view, so the runner
    follows the Parameter as held: one quantisation per weight per step, and the layer
    of the new weights after it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "pg"), rank=0,
                            world_size=1)
    try:
        count = Counter(monkeypatch)
        mesh = init_device_mesh("cpu", (1,))
        ex = titan_ref.init(titan_ref.Experts(H, I, E), 3).to(torch.bfloat16)
        for n in ("w1", "w2", "w3"):
            setattr(ex, n, torch.nn.Parameter(distribute_tensor(getattr(ex, n).detach(), mesh,
                                                                [Shard(0)])))
        m = mtt.GroupedExperts.from_torchtitan(ex, client=client, dtype="fp8")
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        counts = torch.tensor([4, 6, 0, 5])
        x = torch.randn(16, H, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
        for step in range(2):
            m.zero_grad(set_to_none=True)
            out = m(x, counts)
            out.float().square().sum().backward()
            assert len(count.of([m._run])) == 3 * (step + 1)
            assert m(x, counts) is not None and len(count.of([m._run])) == 3 * (step + 1)
            local = [w.to_local().detach() for w in (m.w1, m.w3, m.w2)]
            hand = by_hand_module(client, "fp8", *local, topk=1)
            want = hand(x, mtt.grouped_ids(counts, 16).view(16, 1), torch.ones(16, 1))
            assert same(out.detach(), want), step
            assert type(m.w1.grad).__name__ == "DTensor"  # gradients reach the DTensors
            opt.step()
    finally:
        dist.destroy_process_group()
