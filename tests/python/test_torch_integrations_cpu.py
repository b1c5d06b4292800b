# SPDX-License-Identifier: Apache-2.0
"""mok.torchtitan and mok.hf_transformers on the CPU (backend="torch": moe_reference, no
daemon): the weight mappings (the same Parameter objects, no copies where the layouts
agree), the grouped rows' expert ids, torchtitan's load-balancing counts, and results
against torchtitan's semantics (tests/python/titan_ref.py) and the transformers
model's own experts; and mok.torch's staging of views that are not 16-byte aligned.
The same modules run through mokd on the GPU in tests/gpu/test_torch_integrations.py.
Skipped without torch (the transformers part without transformers)."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mok.torch as mt  # noqa: E402
import mok.torchtitan as mtt  # noqa: E402
import mok.hf_transformers as mhf  # noqa: E402
import titan_ref  # noqa: E402

DIM, HID, E, K = 64, 32, 8, 2


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_grouped_ids():
    for counts in (torch.tensor([2, 0, 3, 1]), torch.tensor([2.0, 0.0, 3.0, 1.0])):
        ids = mtt.grouped_ids(counts, 8)
        assert ids.dtype == torch.int32
        assert ids.tolist() == [0, 0, 2, 2, 2, 3, -1, -1]
    assert mtt.grouped_ids(torch.tensor([0, 0, 0]), 2).tolist() == [-1, -1]
    assert mtt.grouped_ids(torch.tensor([1, 1]), 2).tolist() == [0, 1]


def titan_experts(seed=1):
    ex = titan_ref.Experts(DIM, HID, E)
    titan_ref.init(ex, seed)
    return ex.to(torch.bfloat16)


def test_grouped_experts_shares_weights_and_matches_torchtitan():
    ex = titan_experts()
    m = mtt.GroupedExperts.from_torchtitan(ex, backend="torch")
    assert m.w1 is ex.w1 and m.w2 is ex.w2 and m.w3 is ex.w3  # no copies
    assert [n for n, _ in m.named_parameters()] == ["w1", "w2", "w3"]
    counts = torch.tensor([5, 0, 3, 7, 1, 0, 2, 4])
    N = int(counts.sum()) + 3  # three padding rows
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, DIM, generator=g).to(torch.bfloat16)
    d_out = torch.randn(N, DIM, generator=g).to(torch.bfloat16)

    def run(mod):
        xg = x.clone().requires_grad_(True)
        for p in mod.parameters():
            p.grad = None
        out = mod(xg, counts)
        out.backward(d_out)
        return out.detach(), xg.grad, [p.grad.clone() for p in (mod.w1, mod.w2, mod.w3)]

    out_r, dx_r, gw_r = run(ex)  # torchtitan's semantics
    out_m, dx_m, gw_m = run(m)
    assert out_m.shape == (N, DIM) and out_m.dtype == torch.bfloat16
    assert torch.equal(out_m[-3:], torch.zeros(3, DIM, dtype=torch.bfloat16))
    assert torch.equal(dx_m[-3:], torch.zeros(3, DIM, dtype=torch.bfloat16))
    assert rel(out_m, out_r) < 1e-2
    assert rel(dx_m, dx_r) < 2e-2
    for a, b in zip(gw_m, gw_r):
        assert rel(a, b) < 2e-2
    # float64 reference of the same math
    w = [p.detach().double() for p in (ex.w1, ex.w2, ex.w3)]
    ref = mtt.reference_grouped_experts(w[0], w[1], w[2], x.double(), counts)
    assert rel(out_m, ref) < 1e-2
    # a constructed module has torchtitan's shapes and init
    fresh = mtt.GroupedExperts(DIM, HID, E, use_grouped_mm=True, backend="torch")
    assert fresh.w1.shape == (E, HID, DIM) and fresh.w2.shape == (E, DIM, HID)
    fresh.init_weights(0.01)
    assert 0.005 < fresh.w2.std().item() < 0.02
    with pytest.raises(ValueError):
        fresh(x.float(), torch.tensor([1, 2]))


def titan_moe(shared=True, sbe=False, seed=2):
    m = titan_ref.MoE(DIM, HID, E, K, shared=shared, score_before_experts=sbe)
    titan_ref.init(m, seed)
    return m.to(torch.bfloat16).float().to(torch.bfloat16)


@pytest.mark.parametrize("shared", [True, False])
def test_use_mok_matches_torchtitan_moe(shared):
    ref = titan_moe(shared)
    m = titan_moe(shared)
    m.expert_bias.copy_(torch.linspace(-0.01, 0.01, E))
    ref.expert_bias.copy_(m.expert_bias)
    mtt.use_mok(m, backend="torch")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 40, DIM, generator=g).to(torch.bfloat16)
    d_out = torch.randn(3, 40, DIM, generator=g).to(torch.bfloat16)
    res = []
    for mod in (ref, m):
        xg = x.clone().requires_grad_(True)
        out = mod(xg)
        out.backward(d_out)
        res.append((out.detach(), xg.grad, {n: p.grad for n, p in mod.named_parameters()}))
    (o_r, dx_r, g_r), (o_m, dx_m, g_m) = res
    assert o_m.shape == x.shape and o_m.dtype == torch.bfloat16
    assert rel(o_m, o_r) < 1e-2 and rel(dx_m, dx_r) < 2e-2
    assert set(g_m) == set(g_r)
    for n in g_r:
        assert rel(g_m[n], g_r[n]) < 3e-2, n
    # torchtitan's load-balancing counts, the same as its own forward keeps
    assert torch.equal(m.tokens_per_expert, ref.tokens_per_expert)
    assert m.tokens_per_expert.sum().item() == 3 * 40 * K


def test_use_mok_refuses_what_mokd_does_not_compute():
    with pytest.raises(ValueError, match="score_before_experts"):
        mtt.use_mok(titan_moe(sbe=True))
    m = titan_moe()
    m.shared_experts.w1 = torch.nn.Linear(DIM, HID, bias=True)
    with pytest.raises(ValueError, match="shared expert"):
        mtt.use_mok(m)


# ---- Hugging Face transformers ----

def test_split_gate_up_backward_is_one_cat():
    gu = torch.randn(3, 8, 5, requires_grad=True)
    g, u = mhf.split_gate_up(gu)
    assert g.is_contiguous() and u.is_contiguous() and g.shape == (3, 4, 5)
    assert torch.equal(g, gu[:, :4]) and torch.equal(u, gu[:, 4:])
    (g * 2 + u * 3).sum().backward()
    assert torch.equal(gu.grad[:, :4], torch.full((3, 4, 5), 2.0))
    assert torch.equal(gu.grad[:, 4:], torch.full((3, 4, 5), 3.0))
    with pytest.raises(ValueError):
        mhf.split_gate_up(torch.zeros(2, 3, 4))


def tiny_qwen3_moe():
    tf = pytest.importorskip("transformers")
    cfg = tf.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, max_position_embeddings=64, norm_topk_prob=True)
    torch.manual_seed(0)
    return tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}


def test_hf_qwen3_moe_experts_through_mok_reference():
    model = tiny_qwen3_moe()
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    model.set_experts_implementation("eager")
    l0, g0 = loss_and_grads(model, ids)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert len(experts) == 2
    assert mhf.apply(model, backend="torch") == 2
    assert model.config._experts_implementation == "mok"
    l1, g1 = loss_and_grads(model, ids)
    assert all("_mok_run" in m.__dict__ for m in experts)  # the mok function ran
    assert abs(l1 - l0).item() / l0.item() < 5e-3
    assert set(g0) == set(g1)
    for n in g0:
        assert rel(g1[n], g0[n]) < 3e-2, n


def test_hf_refuses_other_layouts():
    model = tiny_qwen3_moe()
    ex = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    ex.is_transposed = True
    with pytest.raises(ValueError, match="is_transposed"):
        mhf.apply(model)


# ---- staging of views that are not 16-byte aligned (docs/torch.md) ----

def test_aligned_stages_only_misaligned_views():
    ids = torch.arange(800 * 6, dtype=torch.int32).view(800, 6)
    v = ids[411:761]  # 411*6*4 bytes into the tensor: 8 mod 16
    assert v.is_contiguous() and v.data_ptr() % 16 == 8
    s = mt.aligned(v)
    assert s is not v and s.data_ptr() % 16 == 0 and torch.equal(s, v)
    w = ids[412:761]  # 412*24 bytes: aligned, named in place
    assert w.data_ptr() % 16 == 0 and mt.aligned(w) is w
    assert mt.aligned(None) is None
