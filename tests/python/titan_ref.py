# SPDX-License-Identifier: Apache-2.0
"""A stand-in for torchtitan's MoE layer (torchtitan is not installed on the test
machines), written from its documented behaviour for the tests of mok.torchtitan:

- router: scores = softmax or sigmoid of gate(x) in float32; top-k experts (of
  scores + expert_bias when a bias is kept, the scores themselves taken unbiased);
  optional renormalisation; times route_scale; num_tokens_per_expert: a histogram of
  the chosen experts (float32, [E]).
- the MoE adds num_tokens_per_expert to its tokens_per_expert buffer (no grad), sorts
  the (token, k) slots by expert (stable), gathers their rows, runs the experts on the
  grouped rows, scales each output row by its score (score_before_experts=False) or
  the input rows (True), and scatter-adds the rows onto the shared expert's output.
- experts: w1, w3 [E, hidden, dim], w2 [E, dim, hidden]; expert e on its rows:
  w2 (silu(w1 x) * w3 x).
"""
import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """The experts with the grouped-rows interface (a loop; padding rows give 0)."""

    def __init__(self, dim, hidden, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.use_grouped_mm = False

    def forward(self, x, num_tokens_per_expert):
        outs, start = [], 0
        for e, n in enumerate(int(c) for c in num_tokens_per_expert.tolist()):
            xe = x[start:start + n]
            outs.append((F.silu(xe @ self.w1[e].t()) * (xe @ self.w3[e].t())) @ self.w2[e].t())
            start += n
        outs.append(x.new_zeros(x.shape[0] - start, self.w2.shape[1]))
        return torch.cat(outs)


class Router(nn.Module):
    def __init__(self, dim, num_experts, top_k, score_func="softmax", route_norm=False,
                 route_scale=1.0):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale

    def forward(self, x, expert_bias=None):
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else logits.softmax(-1)
        if expert_bias is not None:
            idx = torch.topk(scores + expert_bias, self.top_k, dim=1).indices
            top = scores.gather(1, idx)
        else:
            top, idx = torch.topk(scores, self.top_k, dim=1)
        if self.route_norm:
            top = top / (top.sum(-1, keepdim=True) + 1e-20)
        top = top * self.route_scale
        counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts).float()
        return top, idx, counts


class MoE(nn.Module):
    def __init__(self, dim, hidden, num_experts, top_k, shared=True, score_before_experts=False,
                 load_balance=True, score_func="softmax"):
        super().__init__()
        self.experts = Experts(dim, hidden, num_experts)
        self.router = Router(dim, num_experts, top_k, score_func)
        self.shared_experts = FeedForward(dim, hidden) if shared else None
        self.score_before_experts = score_before_experts
        self.top_k = top_k
        self.register_buffer("expert_bias", torch.zeros(num_experts) if load_balance else None)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.reshape(-1, dim)
        top, idx, counts = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        order = torch.argsort(idx.reshape(-1), stable=True)
        scores = top.reshape(-1)[order]
        tok = order // self.top_k
        rows = x[tok]
        if self.score_before_experts:
            rows = (rows.float() * scores[:, None]).to(x.dtype)
        y = self.experts(rows, counts)
        if not self.score_before_experts:
            y = (y.float() * scores[:, None]).to(x.dtype)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        out = out.index_add(0, tok, y)
        return out.reshape(bs, slen, dim)


def init(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
    return m
