"""The PyTorch side of the binding (imported by mok.torch once torch is there).

MoEFunction (torch.autograd.Function) runs one layer's forward and backward
as mokd jobs on torch.cuda.current_stream(), every tensor named in place
(zero copy); MoE is the nn.Module holding the expert weights as bf16
Parameters. Design notes: docs/torch.md.
"""
from __future__ import annotations

import ctypes
import math
import threading
import weakref
from typing import Optional, Union

import torch
import torch.nn.functional as F

from . import _lib
from ._client import Client, Context, Group, connect
from ._errors import Error

__all__ = ["MoE", "MoEFunction", "moe", "moe_reference", "default_client",
           "set_default_client", "registrations"]

_default = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The process's client for mok.torch (mok.connect(): $MOK_SOCKET, else
    /run/mok/mokd-0.sock), connected at first use. It must run the cuda engine."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            c = connect()
            if c.engine != "cuda":
                c.close()
                raise Error("EUNSUPPORTED", "mok.torch needs mokd --engine cuda (the daemon at "
                            "$MOK_SOCKET runs the %s engine)" % c.engine)
            _default = c
        return _default


def set_default_client(client: Optional[Client]) -> None:
    """Use this client for MoE modules created without client= (None: reconnect at next use)."""
    global _default
    with _default_lock:
        _default = client


# ---- registration counter ----------------------------------------------------------------
#
# libmok registers each CUDA allocation a job names once (docs/cuda.md: legacy IPC for a
# cudaMalloc segment, cached by its CU_POINTER_ATTRIBUTE_BUFFER_ID; a new buffer id at the
# same address is registered anew). PyTorch's caching allocator hands out tensors from a
# few large segments and keeps them, so a steady training step names no new allocation.
# _Tracker repeats libmok's bookkeeping for every tensor mok.torch hands to mokd, so
# registrations() counts exactly the registrations libmok made for them
# (tests/gpu/test_torch_moe.py holds it against mokd's own count of the session's regions).

_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_cu = None


def _libcuda():
    global _cu
    if _cu is None:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        cu.cuPointerGetAttribute.restype = ctypes.c_int
        cu.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                               ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        cu.cuMemGetAddressRange_v2.restype = ctypes.c_int
        _cu = cu
    return _cu


class _Tracker:
    def __init__(self):
        self.lock = threading.Lock()
        self.regions = []  # [base, size, buffer_id]
        self.count = 0

    def note(self, tensors):
        cu = _libcuda()
        bufid = ctypes.c_uint64()
        with self.lock:
            for t in tensors:
                if t is None:
                    continue
                p = t.data_ptr()
                if cu.cuPointerGetAttribute(ctypes.byref(bufid), _CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                            p) != 0:
                    continue
                hit = None
                for i, r in enumerate(self.regions):
                    if r[0] <= p < r[0] + r[1]:
                        hit = i
                        break
                if hit is not None and self.regions[hit][2] == bufid.value:
                    continue
                if hit is not None:
                    del self.regions[hit]  # freed and allocated again: libmok re-registers
                base, size = ctypes.c_uint64(), ctypes.c_size_t()
                if cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), p) != 0:
                    continue
                self.regions.append([base.value, size.value, bufid.value])
                self.count += 1


_trackers: "weakref.WeakKeyDictionary[Client, _Tracker]" = weakref.WeakKeyDictionary()


def _tracker(client):
    t = _trackers.get(client)
    if t is None:
        t = _trackers[client] = _Tracker()
    return t


def registrations(client: Optional[Client] = None) -> int:
    """CUDA allocations registered with mokd for mok.torch's jobs on `client`
    (default: default_client()), counted since the client connected. A steady
    training step adds none."""
    if client is None:
        client = default_client()
    return _tracker(client).count


# ---- the autograd Function -----------------------------------------------------------------

def _check_capture(what):
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "mok.torch: %s inside CUDA graph capture is not supported: a mokd job is submitted "
            "to the daemon's ring by the host at call time, so a replayed graph would wait on a "
            "stale completion and never run the job. Keep the MoE layer outside the captured "
            "region (torch.compile's mode='reduce-overhead' does so by itself: mok.torch is a "
            "graph break)" % what)


class _Slot:
    """The mok layer of one MoE module; re-created larger when T grows."""

    def __init__(self, client, hidden, intermediate, experts, topk, shared_intermediate,
                 swiglu_limit, max_tokens, group=None, group_tag=0):
        self.client = client
        self.args = dict(hidden=hidden, intermediate=intermediate, experts=experts, topk=topk,
                         shared_intermediate=shared_intermediate, dtype="bfloat16",
                         swiglu_limit=swiglu_limit)
        if group is not None:
            # a layer on a group cannot grow past the group's buffers
            self.args.update(group=group, group_tag=group_tag)
            if max_tokens is None:
                max_tokens = group.max_tokens
        self.fixed = max_tokens is not None
        self.max_tokens = max_tokens
        self.layer = None
        self.lock = threading.Lock()

    def layer_for(self, T):
        with self.lock:
            if self.layer is None or T > self.layer.max_tokens:
                if self.fixed and T > self.max_tokens:
                    raise Error("ELIMIT", "mok.torch.MoE: %d tokens exceed max_tokens %d" %
                                (T, self.max_tokens))
                n = self.max_tokens if self.fixed else max(1024, 1 << (T - 1).bit_length())
                # a layer still referenced by a pending backward stays alive until it ran
                self.layer = self.client.layer(max_tokens=n, **self.args)
            return self.layer


class MoEFunction(torch.autograd.Function):
    """out = MoE(x, topk_ids, router_weights; w_gate, w_up, w_down[, s_gate, s_up, s_down])
    through mokd (docs/design.md#the-layer). Call through moe() or MoE; arguments must already be
    contiguous CUDA tensors of the slot dtypes (bf16, int32, float32)."""

    @staticmethod
    def forward(ctx, slot, recompute, x, topk_ids, router_weights, w_gate, w_up, w_down,
                s_gate, s_up, s_down):
        _check_capture("forward")
        T = x.shape[0]
        layer = slot.layer_for(T)
        out = torch.empty_like(x)
        shared = dict(s_gate=s_gate, s_up=s_up, s_down=s_down) if s_gate is not None else {}
        out, mctx = layer.forward(x, topk_ids, router_weights, w_gate, w_up, w_down,
                                  recompute=recompute, out=out, **shared)
        region = None if recompute else mctx._region
        mctx.release()  # the autograd ctx keeps what backward needs (save_for_backward)
        _tracker(slot.client).note((x, topk_ids, router_weights, w_gate, w_up, w_down, s_gate,
                                    s_up, s_down, out, region))
        ctx.slot, ctx.layer, ctx.recompute, ctx.tokens = slot, layer, recompute, T
        # saved mode: the uint8 CUDA ctx (schedule + activations) replaces topk_ids
        ctx.save_for_backward(topk_ids if recompute else region, x, router_weights, w_gate,
                              w_up, w_down, s_gate, s_up, s_down)
        return out

    @staticmethod
    def backward(ctx, d_out):
        _check_capture("backward")
        saved, x, rw, wg, wu, wd, sg, su, sd = ctx.saved_tensors
        layer, T = ctx.layer, ctx.tokens
        d_out = d_out.to(torch.bfloat16).contiguous()
        ins = dict(x=x, router_weights=rw, w_gate=wg, w_up=wu, w_down=wd)
        names = ["d_x", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down"]
        if sg is not None:
            ins.update(s_gate=sg, s_up=su, s_down=sd)
            names += ["d_s_gate", "d_s_up", "d_s_down"]
        # fresh gradient buffers, written by mokd; autograd's AccumulateGrad then takes
        # them as .grad (when None) or adds them with a torch op
        out = {n: torch.empty_like(ins[n[2:]]) for n in names}
        if ctx.recompute:
            ins["topk_ids"] = saved
            ins["d_out"] = d_out
            scratch = torch.empty(layer.ctx_bytes(T), dtype=torch.uint8, device=x.device)
            layer._job("backward", T, ins, names, out, flags=_lib.JOB_RECOMPUTE, ctx=scratch)
            extra = (saved, scratch)
        else:
            layer.backward(Context(layer, T, False, ins, saved), d_out, out=out)
            extra = (saved,)
        _tracker(ctx.slot.client).note((d_out,) + extra + tuple(out.values()))
        need = ctx.needs_input_grad
        g = [out["d_x"], None, out["d_router_weights"], out["d_w_gate"], out["d_w_up"],
             out["d_w_down"], out.get("d_s_gate"), out.get("d_s_up"), out.get("d_s_down")]
        g = [v if (v is not None and need[i + 2]) else None for i, v in enumerate(g)]
        return (None, None) + tuple(g)


@torch.compiler.disable
def _apply(slot, recompute, x, ids, rw, wg, wu, wd, sg, su, sd):
    # torch.compile: a graph break here (the code around the layer compiles, the mokd jobs
    # run eagerly between the compiled graphs); fullgraph=True refuses the model.
    return MoEFunction.apply(slot, recompute, x, ids, rw, wg, wu, wd, sg, su, sd)


def moe(slot: _Slot, x: torch.Tensor, topk_ids: torch.Tensor, router_weights: torch.Tensor,
        w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
        s_gate: Optional[torch.Tensor] = None, s_up: Optional[torch.Tensor] = None,
        s_down: Optional[torch.Tensor] = None, recompute: bool = False) -> torch.Tensor:
    """The functional form (slot: MoE._slot). x [..., H] (cast to bf16 when it is another
    float dtype), topk_ids [..., K] (int32), router_weights [..., K] (float32); returns
    out [..., H] bf16."""
    H = x.shape[-1]
    K = topk_ids.shape[-1]
    lead = x.shape[:-1]
    if not x.is_cuda:
        raise Error("EINVAL", "mok.torch: x must be a CUDA tensor (mokd reads it in place)")
    if not x.is_floating_point():
        raise Error("ESHAPE", "mok.torch: x must be a float tensor, got %s" % x.dtype)
    if topk_ids.shape[:-1] != lead or router_weights.shape != topk_ids.shape:
        raise Error("ESHAPE", "mok.torch: x %s, topk_ids %s and router_weights %s must share "
                    "their leading dims ([..., H], [..., K], [..., K])" %
                    (tuple(x.shape), tuple(topk_ids.shape), tuple(router_weights.shape)))
    x2 = x.reshape(-1, H).to(torch.bfloat16).contiguous()
    ids2 = topk_ids.reshape(-1, K).to(torch.int32).contiguous()
    rw2 = router_weights.reshape(-1, K).to(torch.float32).contiguous()
    out = _apply(slot, bool(recompute), x2, ids2, rw2, w_gate, w_up, w_down, s_gate, s_up,
                 s_down)
    return out.reshape(*lead, H)


class MoE(torch.nn.Module):
    """A routed MoE FFN (SwiGLU experts, optional shared expert) run by mokd.

    Parameters (bf16): w_gate, w_up [E,I,H], w_down [E,H,I]; with shared_intermediate > 0
    also s_gate, s_up [I_s,H], s_down [H,I_s]. forward(x, topk_ids, router_weights):
    x [..., H] CUDA (bf16; other float dtypes are cast), topk_ids [..., K] (-1 drops a
    slot), router_weights [..., K] float32 (differentiable: d_router_weights flows back to
    the router) -> out [..., H] bf16 = shared(x) + sum_k rw[k] * expert_{ids[k]}(x).

    backend="mokd" (default) runs the layer on the daemon (client: a mok.Client on a cuda
    engine, default mok.torch.default_client()); backend="torch" runs moe_reference, the
    same math in plain PyTorch ops (for comparisons; no daemon). recompute=True saves no
    activations between forward and backward: mokd rebuilds them, bitwise, in backward.
    max_tokens: None lets the daemon layer grow (powers of two from 1024) with T.

    Expert parallelism (docs/ep.md): group=client.group(key, rank, world, ...,
    dtype="bfloat16") makes this module rank `rank`'s part of the layer: it holds the
    experts/world local experts (w_gate, w_up [E/world,I,H], w_down [E/world,H,I], global
    experts rank*E/world ...), takes its own tokens with global routing ids, and its
    forward and backward exchange tokens with the other ranks' modules; the shared expert
    (if any) runs on the own tokens and its gradients are the rank's (all-reduce them as in
    data parallelism). group_tag names the layer in the group's job order: give each MoE
    of a model its own, the same on every rank; every rank runs the same layers in the
    same order. client must be the client that joined the group."""

    def __init__(self, hidden: int, intermediate: int, experts: int, topk: int,
                 shared_intermediate: int = 0, swiglu_limit: Optional[float] = None,
                 recompute: bool = False, backend: str = "mokd", client: Optional[Client] = None,
                 max_tokens: Optional[int] = None,
                 device: Optional[Union[str, int, torch.device]] = None,
                 group: Optional[Group] = None, group_tag: int = 0) -> None:
        super().__init__()
        if backend not in ("mokd", "torch"):
            raise ValueError("backend must be 'mokd' or 'torch', got %r" % (backend,))
        if group is not None:
            if backend != "mokd":
                raise ValueError("a group needs backend='mokd'")
            if client is None:
                client = group.client
            elif client is not group.client:
                raise ValueError("client must be the client that joined the group")
            if experts % group.world:
                raise ValueError("experts (%d) must be a multiple of the group's world (%d)" %
                                 (experts, group.world))
        self.group, self.group_tag = group, group_tag
        local = experts // group.world if group is not None else experts
        self.hidden, self.intermediate, self.experts, self.topk = hidden, intermediate, \
            experts, topk
        self.shared_intermediate = shared_intermediate
        self.swiglu_limit = swiglu_limit
        self.recompute = recompute
        self.backend = backend
        self._client = client
        self._max_tokens = max_tokens
        self._slot = None
        kw = dict(dtype=torch.bfloat16, device=device)
        P = torch.nn.Parameter
        self.w_gate = P(torch.empty(local, intermediate, hidden, **kw))
        self.w_up = P(torch.empty(local, intermediate, hidden, **kw))
        self.w_down = P(torch.empty(local, hidden, intermediate, **kw))
        if shared_intermediate:
            self.s_gate = P(torch.empty(shared_intermediate, hidden, **kw))
            self.s_up = P(torch.empty(shared_intermediate, hidden, **kw))
            self.s_down = P(torch.empty(hidden, shared_intermediate, **kw))
        else:
            self.s_gate = self.s_up = self.s_down = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for every projection."""
        with torch.no_grad():
            for w in (self.w_gate, self.w_up, self.s_gate, self.s_up):
                if w is not None:
                    b = 1.0 / math.sqrt(self.hidden)
                    w.copy_(torch.empty(w.shape, dtype=torch.float32, device=w.device)
                            .uniform_(-b, b))
            for w, fan in ((self.w_down, self.intermediate), (self.s_down,
                                                              self.shared_intermediate)):
                if w is not None:
                    b = 1.0 / math.sqrt(fan)
                    w.copy_(torch.empty(w.shape, dtype=torch.float32, device=w.device)
                            .uniform_(-b, b))

    def extra_repr(self) -> str:
        return "hidden=%d, intermediate=%d, experts=%d, topk=%d, shared_intermediate=%d%s, " \
               "backend=%s%s" % (self.hidden, self.intermediate, self.experts, self.topk,
                                 self.shared_intermediate,
                                 "" if self.swiglu_limit is None else ", swiglu_limit=%g" %
                                 self.swiglu_limit, self.backend,
                                 ", recompute" if self.recompute else "") + \
            ("" if self.group is None else ", group rank %d of %d, tag %d" %
             (self.group.rank, self.group.world, self.group_tag))

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = default_client()
        return self._client

    @property
    def registrations(self) -> int:
        """registrations() of this module's client."""
        return registrations(self.client)

    def _get_slot(self):
        if self._slot is None:
            self._slot = _Slot(self.client, self.hidden, self.intermediate, self.experts,
                               self.topk, self.shared_intermediate, self.swiglu_limit,
                               self._max_tokens, self.group, self.group_tag)
        return self._slot

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                router_weights: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return moe_reference(x, topk_ids, router_weights, self.w_gate, self.w_up,
                                 self.w_down, self.s_gate, self.s_up, self.s_down,
                                 self.swiglu_limit)
        return _forward_mokd(self, x, topk_ids, router_weights)


@torch.compiler.disable
def _forward_mokd(m, x, topk_ids, router_weights):
    # one graph break per MoE call under torch.compile (see _apply)
    for p in m.parameters():
        if p.dtype != torch.bfloat16 or not p.is_cuda or not p.is_contiguous():
            raise Error("ESHAPE", "mok.torch.MoE: parameters must stay contiguous bf16 CUDA "
                        "tensors (got %s %s on %s)" % (p.dtype, tuple(p.shape), p.device))
    return moe(m._get_slot(), x, topk_ids, router_weights, m.w_gate, m.w_up, m.w_down,
               m.s_gate, m.s_up, m.s_down, recompute=m.recompute)


# ---- the same layer in plain PyTorch ---------------------------------------------------------

def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, router_weights: torch.Tensor,
                  w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  s_gate: Optional[torch.Tensor] = None, s_up: Optional[torch.Tensor] = None,
                  s_down: Optional[torch.Tensor] = None,
                  swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """The layer (docs/design.md#the-layer) in PyTorch ops with the engine's roundings (docs/math.md): g, u, h and y
    rounded to bf16, the K-sum in f32 in ascending k, out rounded to bf16. Autograd gives
    the backward. One host sync per call (the experts' row counts). Deterministic under
    torch.use_deterministic_algorithms(True)."""
    H = x.shape[-1]
    K = topk_ids.shape[-1]
    lead = x.shape[:-1]
    x = x.reshape(-1, H).to(torch.bfloat16)
    ids = topk_ids.reshape(-1, K).long()
    rw = router_weights.reshape(-1, K).float()
    T, E = x.shape[0], w_gate.shape[0]
    L = swiglu_limit

    def ffn(xe, wg, wu, wd):
        g = xe @ wg.t()
        u = xe @ wu.t()
        if L is not None:
            g = g.clamp(max=L)
            u = u.clamp(-L, L)
        h = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
        return h @ wd.t()

    flat = ids.reshape(-1)
    key = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))
    order = torch.argsort(key, stable=True)
    counts = (key[:, None] == torch.arange(E + 1, device=x.device)).sum(0).tolist()
    used = sum(counts[:E])
    xs = x[order[:used] // K]  # the routed rows, expert-contiguous (gather; no scatter)
    ys, start = [], 0
    for e in range(E):
        n = counts[e]
        if n:
            ys.append(ffn(xs[start:start + n], w_gate[e], w_up[e], w_down[e]))
        start += n
    ys.append(x.new_zeros(T * K - used, H))  # dropped slots
    y = torch.cat(ys)[torch.argsort(order)]  # back to slot order: the inverse permutation
    y = y.view(T, K, H).float()
    acc = ffn(x, s_gate, s_up, s_down).float() if s_gate is not None else None
    for k in range(K):
        term = rw[:, k, None] * y[:, k]
        acc = term if acc is None else acc + term
    assert acc is not None  # K >= 1
    return acc.to(torch.bfloat16).reshape(*lead, H)
