# SPDX-License-Identifier: Apache-2.0
"""mok: run Mixture-of-Experts layers on mokd from Python (a ctypes binding of libmok).

    import mok
    with mok.connect() as c:              # socket: argument, $MOK_SOCKET, /run/mok/mokd-0.sock
        layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K,
                        shared_intermediate=0, dtype="float32", swiglu_limit=None)
        out, ctx = layer.forward(x, topk_ids, router_weights, w_gate, w_up, w_down)
        grads = layer.backward(ctx, d_out)  # Grads(d_x, d_router_weights, d_w_*, d_s_*)

Arrays are numpy in host memory, or torch CUDA tensors. float32 layers take
float32 arrays; bfloat16 layers take ml_dtypes.bfloat16 arrays or uint16 bit
patterns (mok.to_bf16 / mok.from_bf16) and return bfloat16 results as
ml_dtypes.bfloat16 arrays when ml_dtypes is installed, else as uint16 bit
patterns (mok.bf16_dtype() says which). topk_ids is int32 (-1: a dropped
slot), router_weights float32. Shapes are docs/math.md's. Dtypes are not
converted silently: a wrong dtype or shape raises mok.Error (status
"ESHAPE") before anything is sent; mokd checks everything again.

Memory: arrays from ``c.empty(shape, dtype)`` live in memory shared with
mokd and travel without copies (also as ``out=`` arrays, which mokd then
writes in place). Other inputs are copied into per-client staging regions
that are reused and grown, never re-registered in a steady loop; outputs
are returned as fresh arrays. Details in mok._client.

Torch CUDA tensors (every tensor argument of a call one, on a daemon running
the cuda engine) are used in place: the job is ordered on the current torch
stream with GPU fences and the call returns at once, like a torch op; its
results are new CUDA tensors (or the out= tensors). mok.torch.MoE wraps this
as an nn.Module with autograd (docs/torch.md).

max_tokens: None (the default) starts a layer at 1024 tokens and lets it
re-create itself at the next power of two when a job brings more; an
explicit max_tokens is a hard limit (ELIMIT beyond it).

Expert parallelism (docs/ep.md): each rank joins a group through its own
mokd, ``g = c.group(key, rank, world, max_tokens=..., hidden=H, topk=K,
experts=E)``, then ``c.layer(..., group=g)`` holds its E/world local
experts and forward/backward exchange tokens with the other ranks.

libmok.so is found through $MOK_LIBRARY, else the build tree when this is
client/python/mok of a source tree (<repo>/build/lib/libmok.so), else the
copy a pip install bundled beside this file, else the system (find_library,
libmok.so.1).
"""
from ._errors import Error
from .bf16 import bf16_dtype, from_bf16, is_bf16, round_bf16, to_bf16
from ._client import (DEFAULT_MAX_TOKENS, Client, ComputeGrads, Context, DType, Grads, Group,
                      Layer, Out, Result, Stats, TensorLike, connect)
from ._lib import library_path


def version():
    """The version of mok, as libmok reports it (its one source: proto/mok_version.h)."""
    from ._lib import version as lib_version
    return lib_version()


def __getattr__(name):
    # mok.__version__: read from libmok when first asked, so that importing
    # mok still needs no library and the version is written in one place
    if name == "__version__":
        return version()
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


__all__ = ["Error", "connect", "Client", "Group", "Layer", "Context", "Grads", "ComputeGrads", "Stats",
           "to_bf16", "from_bf16", "round_bf16", "bf16_dtype", "is_bf16", "library_path",
           "version", "DEFAULT_MAX_TOKENS", "TensorLike", "Result", "Out", "DType"]
