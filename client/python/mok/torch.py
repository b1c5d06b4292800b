# SPDX-License-Identifier: Apache-2.0
"""mok.torch: MoE layers on mokd as PyTorch modules (autograd, zero copy, current stream).

    import torch, mok.torch
    moe = mok.torch.MoE(hidden=H, intermediate=I, experts=E, topk=K,
                        shared_intermediate=0).cuda()          # bf16 Parameters
    out = moe(x, topk_ids, router_weights)  # x [T,H] bf16 CUDA, ids [T,K] int32, rw [T,K] f32
    out.float().sum().backward()            # .grad of x, router_weights and every weight

Importing this module never imports torch: without PyTorch, ``import mok.torch``
works and the first use of MoE (or any name below) raises ImportError. The
implementation is mok._torch_impl; docs/torch.md describes the design
(saved context, streams, registration cache, gradients, torch.compile, CUDA
graphs).

MoE(..., dtype="fp8") runs an fp8 layer on the cpu engine (CPU tensors) with the bf16
Parameters as master weights, quantised once per change (docs/torch.md, "FP8 layers").

Names: MoE, MoEFunction, moe, moe_reference, default_client, registrations,
set_default_client, aligned, check_graphs. Beside it: mok.distributed (groups from
torch.distributed process groups), mok.torchtitan and mok.hf_transformers (model
integrations).
"""
import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:  # type checkers see the real names and signatures
    from ._torch_impl import (MoE, MoEFunction, default_client, moe, moe_reference,
                              registrations, set_default_client)

__all__ = ["MoE", "MoEFunction", "moe", "moe_reference", "default_client",
           "set_default_client", "registrations", "aligned", "check_graphs"]

_impl = None


def _load() -> Any:
    global _impl
    if _impl is None:
        try:
            import torch  # noqa: F401  (absolute: the real PyTorch, never this module)
        except ImportError as e:
            raise ImportError("mok.torch needs PyTorch (import torch failed: %s); the rest of "
                              "the mok package works without it" % e) from e
        _impl = importlib.import_module("mok._torch_impl")
    return _impl


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(_load(), name)
    raise AttributeError("module 'mok.torch' has no attribute %r" % name)


def __dir__() -> List[str]:
    return sorted(list(globals()) + __all__)
