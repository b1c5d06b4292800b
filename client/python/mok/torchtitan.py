# SPDX-License-Identifier: Apache-2.0
"""mok.torchtitan: torchtitan MoE layers on mokd (needs PyTorch; not torchtitan itself).

Two ways in, both on the weights torchtitan already holds (no copies of bf16 weights):

    import mok.torchtitan as mtt
    moe.experts = mtt.GroupedExperts.from_torchtitan(moe.experts)   # 1. the experts only
    mtt.use_mok(moe)                                                # 2. the whole MoE layer
    mtt.use_mok(moe, dtype="fp8")        # either one with fp8 layers (dtype= on both)

1. ``GroupedExperts`` has torchtitan's interface: ``w1``, ``w3`` [E, hidden_dim, dim],
   ``w2`` [E, dim, hidden_dim] and ``forward(x, num_tokens_per_expert)``, where x
   [N, dim] holds the routed rows already grouped by expert (expert 0's first), the
   first ``num_tokens_per_expert[e]`` rows after expert e-1's belonging to expert e,
   and any rows past their sum padding; it returns [N, dim]: row n is
   ``w2[e] @ (silu(w1[e] @ x[n]) * (w3[e] @ x[n]))`` for its expert, padding rows 0.
   torchtitan's MoE does the routing, permutation, scores and load-balancing counts
   around it exactly as with its own experts. mokd runs it as a layer of top-k 1:
   each row a token routed to its expert with weight 1 (exact: 1.0 * y rounds to y).
2. ``use_mok(moe)`` replaces the MoE module's forward: the router as before (with
   ``expert_bias``), ``moe.tokens_per_expert += num_tokens_per_expert`` as torchtitan
   does for its auxiliary-loss-free load balancing, then one mokd job for the routed
   experts, the router scores and the shared expert together (mokd does the
   permutation itself; ``score_before_experts=False`` only, since mokd weighs expert
   outputs, not inputs).

Layouts: mok's w_gate, w_up [E, I, H] and w_down [E, H, I] are torchtitan's w1, w3 and
w2 (I = hidden_dim, H = dim); the shared expert's ``w1.weight``, ``w3.weight`` [I_s, H]
and ``w2.weight`` [H, I_s] are mok's s_gate, s_up, s_down. Weights are named in place
when they are contiguous bf16 CUDA tensors (FSDP's bf16 compute parameters); float32
weights are cast (one copy per call, the gradient cast back by autograd). DTensor
weights are used through ``to_local()``.

dtype="fp8" runs fp8 layers (block-scaled e4m3 GEMMs, as mok.torch.MoE(dtype="fp8")) on
torchtitan's Parameters as masters: each GroupedExperts (each use_mok'd MoE) keeps the
packed forms of its weights and quantises a weight again at its first call after its
Parameter changed (torch's version counter, identity or data pointer: once per
optimizer step). docs/torch.md, "torchtitan".
"""
import types

import torch
import torch.nn.functional as F
from torch import nn

from ._torch_impl import _Runner

__all__ = ["GroupedExperts", "use_mok", "grouped_ids", "reference_grouped_experts",
           "requantize"]


def _local(w):
    return w.to_local() if hasattr(w, "to_local") else w


def grouped_ids(num_tokens_per_expert, rows):
    """The expert of each of `rows` grouped rows ([rows] int32; -1 past the counted ones),
    on the device, without a host sync."""
    counts = num_tokens_per_expert.to(torch.int64)
    ends = torch.cumsum(counts, 0)
    n = torch.arange(rows, device=counts.device, dtype=torch.int64)
    e = torch.searchsorted(ends, n, right=True)
    return torch.where(e < counts.numel(), e, torch.full_like(e, -1)).to(torch.int32)


def reference_grouped_experts(w1, w2, w3, x, num_tokens_per_expert):
    """torchtitan's GroupedExperts semantics in plain PyTorch (a loop over experts; one
    host sync), for tests: padding rows give 0."""
    counts = [int(c) for c in num_tokens_per_expert.tolist()]
    out = x.new_zeros(x.shape[0], w2.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            xe = x[start:start + n]
            h = F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())
            out[start:start + n] = h @ w2[e].t()
        start += n
    return out


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts (same Parameters, shapes, forward and init_weights)
    with the experts computed by mokd. backend="torch" computes moe_reference instead
    (no daemon), client: a mok.Client on the cuda engine (default
    mok.torch.default_client(); a cpu-engine client runs CPU tensors). dtype="fp8": an
    fp8 layer on w1, w3, w2 as masters (mokd only; dim and hidden_dim multiples of 128)."""

    def __init__(self, dim, hidden_dim, num_experts, use_grouped_mm=True, backend="mokd",
                 client=None, max_tokens=None, dtype="bfloat16"):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = use_grouped_mm  # kept for torchtitan's code; mokd ignores it
        self._run = _Runner(backend, client, max_tokens, dtype, "mok.torchtitan.GroupedExperts")

    @classmethod
    def from_torchtitan(cls, experts, backend="mokd", client=None, max_tokens=None,
                        dtype="bfloat16"):
        """A GroupedExperts holding `experts`' own Parameter objects (no copy): the
        optimizer, FSDP and checkpoints see the same tensors."""
        E, hidden_dim, dim = experts.w1.shape
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.num_experts = experts.num_experts
        m.w1, m.w2, m.w3 = experts.w1, experts.w2, experts.w3
        m.use_grouped_mm = getattr(experts, "use_grouped_mm", True)
        m._run = _Runner(backend, client, max_tokens, dtype, "mok.torchtitan.GroupedExperts")
        return m

    def forward(self, x, num_tokens_per_expert):
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if num_tokens_per_expert.numel() != w1.shape[0]:
            raise ValueError("num_tokens_per_expert has %d entries for %d experts" %
                             (num_tokens_per_expert.numel(), w1.shape[0]))
        N = x.shape[0]
        ids = grouped_ids(num_tokens_per_expert, N).view(N, 1)
        ones = torch.ones(N, 1, dtype=torch.float32, device=x.device)
        # fp8: the packed forms follow the Parameters as held (a DTensor, not its local view)
        out = self._run(x, ids, ones, w1, w3, w2,
                        follow=dict(w_gate=self.w1, w_up=self.w3, w_down=self.w2))
        return out.to(x.dtype)

    def init_weights(self, init_std):
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)


def _shared_params(moe):
    """The shared expert's w1, w3, w2 weights as held (None each without one)."""
    sh = getattr(moe, "shared_experts", None)
    if sh is None:
        return None, None, None
    lin = [getattr(sh, n, None) for n in ("w1", "w3", "w2")]
    if not all(isinstance(m, nn.Linear) and m.bias is None for m in lin):
        raise ValueError("mok.torchtitan.use_mok: the shared expert is not a FeedForward of "
                         "bias-free w1, w2, w3; swap the experts only (GroupedExperts)")
    return tuple(m.weight for m in lin)


def _moe_forward(self, x):
    bs, slen, dim = x.shape
    x2 = x.reshape(-1, dim)
    top_scores, ids, num_tokens_per_expert = self.router(x2, self.expert_bias)
    with torch.no_grad():  # torchtitan's load-balancing counts, as its own forward keeps them
        self.tokens_per_expert.add_(num_tokens_per_expert)
    ex = self.experts
    held = dict(zip(("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"),
                    (ex.w1, ex.w3, ex.w2) + _shared_params(self)))
    out = self._mok_run(x2, ids, top_scores.to(torch.float32),
                        *(None if w is None else _local(w) for w in held.values()),
                        follow={k: w for k, w in held.items() if w is not None})
    return out.to(x.dtype).reshape(bs, slen, dim)


def use_mok(moe, backend="mokd", client=None, max_tokens=None, dtype="bfloat16"):
    """Run a torchtitan MoE module (torchtitan.models.moe.MoE) as one mokd layer: its
    router and load-balancing counts as before, routed and shared experts in mokd.
    Changes `moe` in place (its forward) and returns it; the Parameters stay torchtitan's.
    dtype="fp8": an fp8 layer on them as masters (mokd only; dim, hidden_dim and the
    shared expert's hidden size multiples of 128)."""
    run = _Runner(backend, client, max_tokens, dtype, "mok.torchtitan.use_mok")
    if getattr(moe, "score_before_experts", False):
        raise ValueError("mok.torchtitan.use_mok: score_before_experts=True scales the experts' "
                         "inputs, mokd scales their outputs; swap the experts only "
                         "(moe.experts = GroupedExperts.from_torchtitan(moe.experts))")
    if getattr(moe, "shared_gate", None) is not None:
        raise ValueError("mok.torchtitan.use_mok: a gated shared expert is not mokd's layer; "
                         "swap the experts only (GroupedExperts)")
    _shared_params(moe)  # refuse an unknown shared expert now, not at the first call
    moe._mok_run = run
    moe.forward = types.MethodType(_moe_forward, moe)
    return moe


def requantize(module):
    """fp8: every GroupedExperts and use_mok'd MoE in `module` (itself included) quantises
    its weights again at its next call (after writes torch's version counter does not
    see, such as writes through .data). Returns how many runners were marked."""
    n = 0
    for m in module.modules():
        for run in (m.__dict__.get("_run"), m.__dict__.get("_mok_run")):
            if isinstance(run, _Runner):
                run.requantize()
                n += 1
    return n
