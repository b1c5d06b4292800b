# SPDX-License-Identifier: Apache-2.0
"""mok.hf_transformers: Hugging Face transformers v5 MoE experts on mokd (needs PyTorch).

transformers v5 keeps a MoE layer's experts in one module (Qwen3MoeExperts,
MixtralExperts, DeepseekV3NaiveMoe, ...) with 3D Parameters ``gate_up_proj``
[E, 2*I, H] (rows 0..I-1 of each expert the gate projection, I..2I-1 the up
projection) and ``down_proj`` [E, H, I], and a forward
``experts(hidden_states [T,H], top_k_index [T,K], top_k_weights [T,K]) -> [T,H]``:
``out[t] = sum_k top_k_weights[t,k] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t])``
with e = top_k_index[t,k] (an index >= E, the expert-parallel sentinel, adds nothing).
Which function runs it is chosen by ``config._experts_implementation`` through
transformers' ExpertsInterface; ``apply(model)`` registers "mok" there and selects it,
so every experts module of the model runs as one mokd job per call:

    import mok.hf_transformers as mhf
    mhf.apply(model)                      # or: mhf.register(); model.set_experts_implementation("mok")
    mhf.apply(model, dtype="fp8")         # fp8 layers on the model's weights as masters

Layouts: ``down_proj`` is mok's w_down [E, H, I] (named in place). The gate and up
halves of ``gate_up_proj`` are not contiguous [E, I, H] tensors (each expert's rows
alternate between them), so each call makes one copy of gate_up_proj into mok's
w_gate and w_up (2*E*I*H bf16 values) and backward concatenates their gradients in one
pass (no zero-filled buffers). The router weights' gradient is mokd's d_router_weights.
Only the concatenated, non-transposed, bias-free SiLU layout is taken (others raise).

dtype="fp8" runs fp8 layers (block-scaled e4m3 GEMMs, as mok.torch.MoE(dtype="fp8")): the
model's Parameters stay the masters (optimizer, checkpoints and gradients as before), each
experts module keeps the packed forms of its w_gate, w_up and w_down and quantises them
again at its first call after gate_up_proj or down_proj changed (torch's version counter,
identity or data pointer: once per optimizer step); a change of gate_up_proj re-quantises
both of its halves. Nothing but that quantisation reads the masters, so the gate and up
halves go in as views of gate_up_proj (no copy per call). docs/torch.md, "Hugging Face
transformers".
"""
import types

import torch

from ._torch_impl import _Runner

__all__ = ["experts_forward", "register", "apply", "split_gate_up", "gate_up_halves",
           "requantize", "NAME"]

NAME = "mok"


class _SplitGateUp(torch.autograd.Function):
    """gate_up [E, 2I, H] -> (w_gate, w_up) [E, I, H] contiguous; backward cat."""

    @staticmethod
    def forward(ctx, gate_up):
        I = gate_up.shape[1] // 2
        return gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous()

    @staticmethod
    def backward(ctx, d_gate, d_up):
        if d_gate is None:
            d_gate = torch.zeros_like(d_up)
        if d_up is None:
            d_up = torch.zeros_like(d_gate)
        return torch.cat([d_gate, d_up], dim=1)


class _GateUpHalves(torch.autograd.Function):
    """gate_up [E, 2I, H] -> (w_gate, w_up) [E, I, H] as views (no copy); backward cat."""

    @staticmethod
    def forward(ctx, gate_up):
        I = gate_up.shape[1] // 2
        return gate_up[:, :I], gate_up[:, I:]

    backward = staticmethod(_SplitGateUp.backward)


def _check_gate_up(gate_up):
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError("gate_up_proj must be [E, 2*I, H], got %s" % (tuple(gate_up.shape),))


def split_gate_up(gate_up):
    """(w_gate, w_up), each [E, I, H], from transformers' gate_up_proj [E, 2I, H]."""
    _check_gate_up(gate_up)
    return _SplitGateUp.apply(gate_up)


def gate_up_halves(gate_up):
    """(w_gate, w_up), each [E, I, H], as views of gate_up_proj [E, 2I, H] (no copy; not
    contiguous): for an fp8 layer, which reads only their packed forms. The gradient is one
    torch.cat of the two halves' gradients, as for split_gate_up."""
    _check_gate_up(gate_up)
    return _GateUpHalves.apply(gate_up)


def _check_layout(m):
    gu, dp = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dp, torch.Tensor) or \
            gu.dim() != 3 or dp.dim() != 3:
        raise ValueError("mok.hf_transformers: %s has no 3D gate_up_proj and down_proj"
                         % type(m).__name__)
    bad = [n for n, v in (("is_transposed", getattr(m, "is_transposed", False)),
                          ("has_bias", getattr(m, "has_bias", False)),
                          ("interleaved gate/up", not getattr(m, "is_concatenated", True)),
                          ("no gate", not getattr(m, "has_gate", True)),
                          ("post-expert norm", getattr(m, "has_post_expert_norm", False))) if v]
    act = getattr(getattr(m, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        bad.append("activation %r" % act)
    E, I2, H = gu.shape
    if tuple(dp.shape) != (E, H, I2 // 2):
        bad.append("down_proj %s for gate_up_proj %s" % (tuple(dp.shape), tuple(gu.shape)))
    if bad:
        raise ValueError("mok.hf_transformers: %s's experts are not mokd's layer (%s); keep "
                         "another experts implementation for it" % (type(m).__name__,
                                                                   ", ".join(bad)))


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "mok" experts implementation (self: the experts module)."""
    run = self.__dict__.get("_mok_run")
    if run is None:
        _check_layout(self)
        run = self.__dict__["_mok_run"] = _Runner(getattr(self, "_mok_backend", "mokd"),
                                                  getattr(self, "_mok_client", None),
                                                  dtype=getattr(self, "_mok_dtype", "bfloat16"),
                                                  who="mok.hf_transformers")
    gate_up = self.gate_up_proj
    E = gate_up.shape[0]
    ids = top_k_index.to(torch.int32)
    ids = torch.where((ids >= 0) & (ids < E), ids, torch.full_like(ids, -1))
    rw = top_k_weights.to(torch.float32)
    if run.dtype == "fp8":
        # the packed w_gate and w_up both follow gate_up_proj: a change of it quantises both
        w_gate, w_up = gate_up_halves(gate_up)
        out = run(hidden_states, ids, rw, w_gate, w_up, self.down_proj,
                  follow={"w_gate": gate_up, "w_up": gate_up})
    else:
        w_gate, w_up = split_gate_up(gate_up)
        out = run(hidden_states, ids, rw, w_gate, w_up, self.down_proj)
    return out.to(hidden_states.dtype)


def register():
    """Add "mok" to transformers' ExpertsInterface (transformers v5). Returns False when
    this transformers has no such interface (apply() then patches the modules)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(NAME, experts_forward)
    return True


def _experts_modules(model):
    for m in model.modules():
        gu, dp = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(dp, torch.Tensor) and gu.dim() == 3:
            yield m


def apply(model, backend="mokd", client=None, dtype="bfloat16"):
    """Run every experts module of `model` through mokd: checks each one's layout, then
    selects the "mok" experts implementation (or, without ExpertsInterface, replaces
    the modules' forward). backend="torch" runs moe_reference instead (no daemon).
    dtype="fp8" (or "float8_e4m3fn", torch.float8_e4m3fn) runs fp8 layers on the model's
    weights as masters (mokd only; H and I multiples of 128, which the daemon checks at
    the first call). Returns the number of experts modules."""
    _Runner(backend, client, dtype=dtype, who="mok.hf_transformers.apply")  # refuse early
    mods = list(_experts_modules(model))
    for m in mods:
        _check_layout(m)
        m.__dict__.pop("_mok_run", None)
        m._mok_backend, m._mok_client, m._mok_dtype = backend, client, dtype
    if register() and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(NAME)
    else:
        for m in mods:
            m.forward = types.MethodType(experts_forward, m)
    return len(mods)


def requantize(model):
    """fp8: every experts module of `model` quantises its weights again at its next call
    (after writes torch's version counter does not see, such as writes through .data).
    Returns the number of experts modules that had run."""
    n = 0
    for m in _experts_modules(model):
        run = m.__dict__.get("_mok_run")
        if run is not None:
            run.requantize()
            n += 1
    return n
