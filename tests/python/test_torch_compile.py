# SPDX-License-Identifier: Apache-2.0
"""mok.torch's custom ops on a CPU machine: torch.compile(fullgraph=True) traces a model
holding mok.torch.MoE into one graph, forward and backward, through the ops' fake kernels.

What this checks is tracing and shapes only. The stub backend below runs nothing of the
traced graphs (no daemon, no GPU here): it hands back zeros of the traced output shapes so
that autograd goes on to trace the backward. Numbers are checked on the GPU
(tests/gpu/test_graphs.py: compiled and captured training bitwise equal to eager)."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "client", "python"))
import mok.torch as mt  # noqa: E402
from mok import _torch_impl  # noqa: E402

from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, H=64, I=32, E=4, K=2, I_s=16, recompute=False):
        super().__init__()
        self.router = torch.nn.Linear(H, E)
        self.moe = mt.MoE(H, I, E, K, shared_intermediate=I_s, recompute=recompute,
                          device="cpu")
        self.K = K

    def forward(self, x):
        probs = self.router(x).float().softmax(-1)
        rw, ids = probs.topk(self.K, dim=-1)
        return x + self.moe(x.bfloat16(), ids.int(), rw).float()


def stub_backend(graphs):
    def compiler(name):
        def compile_fn(gm, example_inputs):
            graphs.setdefault(name, []).append(gm)
            outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]

            def run(*args):  # zeros of the traced shapes: tracing only, no results
                return tuple(torch.zeros(o.meta["val"].shape, dtype=o.meta["val"].dtype)
                             if o is not None and "val" in o.meta else None for o in outs)
            return make_boxed_func(run)
        return compile_fn
    return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))


def ops_of(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "mok." in str(n.target)]


@pytest.mark.parametrize("recompute", [False, True])
def test_fullgraph_traces_forward_and_backward(recompute):
    torch.manual_seed(0)
    T, H = 48, 64
    m = Block(recompute=recompute)
    graphs = {}
    cm = torch.compile(m, fullgraph=True, backend=stub_backend(graphs))
    x = torch.randn(T, H, requires_grad=True)
    y = cm(x)  # fullgraph=True: a graph break would raise here
    assert y.shape == (T, H)
    y.sum().backward()
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1
    fw = ops_of(graphs["fw"][0])
    bw = ops_of(graphs["bw"][0])
    assert [str(n.target) for n in fw] == ["mok.moe_forward.default"]
    assert [str(n.target) for n in bw] == ["mok.moe_backward.default"]
    out_meta = [u for u in fw[0].users]
    vals = fw[0].meta["val"]
    assert tuple(vals[0].shape) == (T, H) and vals[0].dtype == torch.bfloat16
    # CPU tensors: the ctx of the cpu engine, row alignment 1 (CUDA ones: the cuda engine's 128)
    n_ctx = 0 if recompute else _torch_impl._ctx_nbytes(m.moe, T, row_align=1)
    assert tuple(vals[1].shape) == (n_ctx,) and vals[1].dtype == torch.uint8
    grads = bw[0].meta["val"]
    want = [(T, H), (T, 2), tuple(m.moe.w_gate.shape), tuple(m.moe.w_up.shape),
            tuple(m.moe.w_down.shape), tuple(m.moe.s_gate.shape), tuple(m.moe.s_up.shape),
            tuple(m.moe.s_down.shape)]
    assert [tuple(g.shape) for g in grads] == want
    assert out_meta  # the output feeds the rest of the graph


def test_ctx_bytes_formula_matches_the_layout():
    # proto/mok_layout.h by hand for one shape: T=48 K=2 E=4 I=32 I_s=16, row_align 128
    m = mt.MoE(64, 32, 4, 2, shared_intermediate=16, device="cpu")
    rows = 48 * 2 + 4 * 127
    sched = 4 * (8 + 4 + 5 + rows + 96)
    a = lambda v: (v + 255) // 256 * 256  # noqa: E731
    assert _torch_impl._ctx_nbytes(m, 48) == a(sched) + 2 * a(rows * 32 * 2) + \
        2 * a(48 * 16 * 2)


def test_fake_kernels_in_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    m = mt.MoE(64, 32, 4, 2, device="cpu")
    with FakeTensorMode() as mode:
        x = torch.empty(10, 64, dtype=torch.bfloat16)
        ids = torch.empty(10, 2, dtype=torch.int32)
        rw = torch.empty(10, 2)
        wg, wu, wd = (mode.from_tensor(p) for p in (m.w_gate, m.w_up, m.w_down))
        out, ctx = torch.ops.mok.moe_forward(m._mok_op_id, False, x, ids, rw, wg, wu, wd,
                                             None, None, None)
        assert out.shape == (10, 64) and ctx.shape == (_torch_impl._ctx_nbytes(m, 10, 1),)
        g = torch.ops.mok.moe_backward(m._mok_op_id, False, ctx, x, rw, wg, wu, wd, None,
                                       None, None, out)
        assert [tuple(t.shape) for t in g] == [(10, 64), (10, 2), tuple(wg.shape),
                                               tuple(wu.shape), tuple(wd.shape)]
