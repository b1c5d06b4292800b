# SPDX-License-Identifier: Apache-2.0
"""The PyTorch side of the binding (imported by mok.torch once torch is there).

MoEFunction (torch.autograd.Function) runs one layer's forward and backward
as mokd jobs on torch.cuda.current_stream(), every tensor named in place
(zero copy), or CPU tensors through the binding's numpy path on the cpu engine;
MoE is the nn.Module holding the expert weights as bf16 Parameters (the masters of an
fp8 layer, whose packed forms the module keeps beside them). Design notes:
docs/torch.md.
"""
from __future__ import annotations

import ctypes
import itertools
import math
import threading
import weakref
from typing import List, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from . import _lib
from ._client import Client, Context, Grads, Group, connect
from ._errors import Error

__all__ = ["MoE", "MoEFunction", "moe", "moe_reference", "default_client",
           "set_default_client", "registrations", "aligned", "check_graphs"]

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


def _buffer_id(t):
    """The CUDA allocation holding t's data (its CU_POINTER_ATTRIBUTE_BUFFER_ID); 0 when the
    address is allocated no more."""
    bufid = ctypes.c_uint64()
    if _libcuda().cuPointerGetAttribute(ctypes.byref(bufid), _CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                        t if isinstance(t, int) else t.data_ptr()) != 0:
        return 0
    return bufid.value


class _Tracker:
    def __init__(self):
        self.lock = threading.Lock()
        self.regions = []  # [base, size, buffer_id]
        self.count = 0

    def note(self, tensors):
        cu = _libcuda()
        with self.lock:
            for t in tensors:
                if t is None:
                    continue
                p = t.data_ptr()
                bufid = _buffer_id(p)
                if not bufid:
                    continue
                hit = None
                for i, r in enumerate(self.regions):
                    if r[0] <= p < r[0] + r[1]:
                        hit = i
                        break
                if hit is not None and self.regions[hit][2] == bufid:
                    continue
                if hit is not None:
                    del self.regions[hit]  # freed and allocated again: libmok re-registers
                base, size = ctypes.c_uint64(), ctypes.c_size_t()
                if cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), p) != 0:
                    continue
                self.regions.append([base.value, size.value, bufid])
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

def _capturing(x):
    """CUDA graph capture on x's device's current stream (never for CPU tensors: a CUDA
    build of torch on a machine without a driver raises on the query)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_capture(what):
    # MoE modules (with or without a group) take the custom-op path under capture
    # (standing jobs); this Function (eager jobs through the ring) refuses capture
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "mok.torch: %s through moe() or a weights-holding runner inside CUDA graph "
            "capture is not supported: it submits ring jobs, which a replay does not submit "
            "again. mok.torch.MoE runs under capture (its custom ops use standing jobs)" % what)


def aligned(t):
    """t itself when its data starts at a multiple of 16 bytes (what the cuda engine
    demands of every tensor), else a contiguous copy (torch's allocator gives 512-byte
    aligned blocks) made on the current stream. A view at an offset, like rank 1's
    ids[411:761] of an int32 [T,6] tensor, costs one copy of that view."""
    if t is None or t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# ---- expert-parallel groups from torch.distributed process groups ---------------------------
#
# MoE(group=process_group) joins through mok.distributed.join once per (client, process
# group, sizing): every MoE of a model shares that mok group (a daemon serves a uid 16
# groups at most), and each gets the next group tag in creation order, the same on every
# rank when every rank builds the same modules in the same order.

_pg_groups = weakref.WeakKeyDictionary()  # client -> [[process group, sizing, Group, tags]]


def _shared_group(client, pg, sizing):
    from . import distributed
    entries = _pg_groups.setdefault(client, [])
    for e in entries:
        if e[0] is pg and e[1] == sizing and e[2]._ptr:
            e[3] += 1
            return e[2], e[3] - 1
    g = distributed.join(client, pg, **dict(sizing))
    entries.append([pg, sizing, g, 1])
    return g, 0


_WEIGHTS = ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "fp8": "fp8", "float8_e4m3fn": "fp8"}


def _module_dtype(dtype, who="mok.torch.MoE"):
    """"bfloat16" or "fp8" for MoE(dtype=...) and the runners' dtype=: the names the binding
    takes for those two, or torch.bfloat16 / torch.float8_e4m3fn."""
    if isinstance(dtype, torch.dtype):
        name = {torch.bfloat16: "bfloat16",
                getattr(torch, "float8_e4m3fn", None): "fp8"}.get(dtype)
    else:
        name = _DTYPES.get(dtype.lower()) if isinstance(dtype, str) else None
    if name is None:
        raise ValueError("%s: dtype must be \"bfloat16\" (the default) or \"fp8\" "
                         "(also \"float8_e4m3fn\"; block-scaled e4m3 GEMMs, docs/math.md), "
                         "got %r" % (who, dtype))
    return name


class _Master:
    """An fp8 weight's master as _Slot.pack takes it: `value`, the weight as a bf16 tensor of
    the layer's shape (any strides; what autograd sees), and `of`, the tensor whose identity,
    _version and data pointer say when the weight changed: value itself for MoE's
    Parameters, or the Parameter value was cut or cast from (transformers' gate_up_proj,
    which holds w_gate and w_up; a float32 or DTensor weight)."""
    __slots__ = ("value", "of")

    def __init__(self, value, of=None):
        self.value, self.of = value, value if of is None else of

    def key(self):
        of = self.of
        local = of.to_local() if hasattr(of, "to_local") else of  # a DTensor: its shard
        return (of._version, local.data_ptr())

    def take(self):
        """The weight as quantize_weight takes it: contiguous bf16 at a 16-byte multiple."""
        return aligned(self.value.detach().contiguous())


class _Packed:
    """One weight's packed fp8 form: the u8 buffer (allocated once), the master it was
    quantised from (a weak reference), that master's (_version, data_ptr) then, and how
    many times the buffer was written."""
    __slots__ = ("buf", "src", "key", "generation")

    def __init__(self, buf):
        self.buf, self.src, self.key, self.generation = buf, None, None, 0


def _np(t):
    """A CPU tensor as a numpy array over the same memory (bf16 as uint16 bit patterns)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class _Slot:
    """The mok layer of one MoE module; re-created larger when T grows. An fp8 slot also
    holds the packed weights (pack)."""

    def __init__(self, client, hidden, intermediate, experts, topk, shared_intermediate,
                 swiglu_limit, max_tokens, group=None, group_tag=0, dtype="bfloat16"):
        self.client = client
        self.fp8 = dtype == "fp8"
        self.args = dict(hidden=hidden, intermediate=intermediate, experts=experts, topk=topk,
                         shared_intermediate=shared_intermediate, dtype=dtype,
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
        self.packed = {}  # weight slot -> _Packed (fp8)
        self.quantizations = 0  # quantize_weight jobs run for this slot
        self.pack_lock = threading.Lock()

        self.standing = {}  # (layer, op, T, flags, addresses) -> mok Standing (capture)

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

    # ---- fp8: the packed weights (docs/torch.md "FP8 layers") ----
    def pack(self, layer, masters, force=False):
        """The packed forms of an fp8 layer's weights, masters {slot: bf16 tensor, _Master or
        None}: ({slot: u8 tensor}, {slot: generation}). A weight is quantised
        (layer.quantize_weight, into its buffer, allocated once per weight and device) only
        when the tensor it follows (the master itself, or a _Master's `of`) is another
        tensor, or the same one at another _version or data_ptr, than at its last
        quantisation: once per optimizer step, none while the weights stay as they are."""
        bufs, gens = {}, {}
        with self.pack_lock:
            for name, w in masters.items():
                if w is None:
                    continue
                m = w if isinstance(w, _Master) else _Master(w)
                n = layer.packed_weight_bytes(name)  # the library's size, whatever the layout
                e = self.packed.get(name)
                dev = m.value.device
                if e is None or e.buf.numel() != n or e.buf.device != dev:
                    e = self.packed[name] = _Packed(torch.empty(n, dtype=torch.uint8,
                                                                device=dev))
                key = m.key()
                if force or e.key != key or e.src is None or e.src() is not m.of:
                    _quantize(layer, name, m.take(), e.buf)
                    e.src, e.key = weakref.ref(m.of), key
                    e.generation += 1
                    self.quantizations += 1
                bufs[name], gens[name] = e.buf, e.generation
        return bufs, gens

    def packed_now(self, names, gens=None):
        """The packed buffers as they are (for a backward). gens: the generations a forward
        used; a buffer written since raises (the backward would read other weights)."""
        with self.pack_lock:
            out = {}
            for name in names:
                e = self.packed.get(name)
                if e is None:
                    raise Error("EINVAL", "mok.torch: no packed %s for this fp8 backward (no "
                                "forward quantised it)" % name)
                if gens is not None and gens.get(name) != e.generation:
                    raise RuntimeError(
                        "mok.torch.MoE(dtype='fp8'): %s was quantised again (its master "
                        "changed) between this forward and its backward; the backward would "
                        "run on the new weights. Run backward before the optimizer step and "
                        "before the next forward that follows a change of the weights" % name)
                out[name] = e.buf
            return out


def _quantize(layer, name, w, buf):
    """quantize_weight of master w into buf (u8 of packed_weight_bytes(name)); the binding
    checks w's dtype and shape (ESHAPE)."""
    with torch.no_grad():
        if w.is_cuda:  # the cuda engine: in place, after the current stream's work
            layer.quantize_weight(name, w, out=buf)
        else:
            layer.quantize_weight(name, _np(w), out=_np(buf))


# ---- the jobs, on CUDA tensors (the torch path of the binding) or CPU ones (numpy) -------

def _ctx_tensor(layer, T, region):
    """The saved ctx of a host forward (a region of the client's ctx pool) as a uint8 CPU
    tensor over the same memory; the region goes back to the pool when the tensor is freed."""
    a = region.u8[:layer.ctx_bytes(T)]
    weakref.finalize(a, layer.client._ctx_returned.append, region)
    return torch.from_numpy(a)


def _ctx_region(layer, T, t):
    """(region, temporary) holding the saved ctx t for a host backward: t's own region when
    t is a _ctx_tensor, else a pool region t is copied into (temporary: give it back)."""
    c, n = layer.client, layer.ctx_bytes(T)
    p = t.data_ptr()
    with c._lock:
        c._check_open()
        for r in c._ctx_all:
            if r.ptr == p and r.cap >= n:
                return r, False
        r = c._ctx_acquire(n)
    if t.numel() < n:
        raise Error("ESHAPE", "mok.torch: a saved ctx of %d bytes, the layer needs %d at T=%d"
                    % (t.numel(), n, T))
    np.copyto(r.u8[:n], _np(t)[:n])
    return r, True


def _run_forward(slot, layer, x, topk_ids, router_weights, ws, recompute):
    """One forward job; ws {slot: tensor}: the weight slots (bf16 masters, or the packed u8
    weights of an fp8 layer). Returns (out, the saved ctx as a uint8 tensor or None)."""
    T = x.shape[0]
    w = {k: v for k, v in ws.items() if v is not None}
    out = torch.empty_like(x)
    if x.is_cuda:
        shared = {k: w[k] for k in ("s_gate", "s_up", "s_down") if k in w}
        out, mctx = layer.forward(x, topk_ids, router_weights, w["w_gate"], w["w_up"],
                                  w["w_down"], recompute=recompute, out=out, **shared)
        region = None if recompute else mctx._region
        mctx.release()  # the autograd ctx keeps what backward needs (save_for_backward)
        _tracker(slot.client).note((x, topk_ids, router_weights) + tuple(w.values()) +
                                   (out, region))
        return out, region
    ins = dict(x=_np(x), topk_ids=_np(topk_ids), router_weights=_np(router_weights),
               **{k: _np(v) for k, v in w.items()})
    _, region = layer._job("forward", T, ins, ["out"], {"out": _np(out)},
                           ctx=None if recompute else "save")
    return out, (None if region is None else _ctx_tensor(layer, T, region))


def _run_backward(slot, layer, T, recompute, saved, x, router_weights, ws, d_out, masters):
    """One backward job: saved is topk_ids (recompute) or the forward's ctx tensor; ws the
    weight slots as in forward; the weight gradients take the masters' shapes (bf16 on an
    fp8 layer too). Returns {gradient name: fresh tensor}."""
    w = {k: v for k, v in ws.items() if v is not None}
    names = list(_GRAD_NAMES[:5]) + (list(_GRAD_NAMES[5:]) if "s_gate" in w else [])
    like = dict(masters, x=x, router_weights=router_weights)
    # fresh gradient buffers, written by mokd; autograd's AccumulateGrad then takes
    # them as .grad (when None) or adds them with a torch op
    out = {n: torch.empty_like(like[n[2:]], memory_format=torch.contiguous_format)
           for n in names}
    ins = dict(x=x, router_weights=router_weights, **w)
    if x.is_cuda:
        if recompute:
            ins.update(topk_ids=saved, d_out=d_out)
            scratch = torch.empty(layer.ctx_bytes(T), dtype=torch.uint8, device=x.device)
            layer._job("backward", T, ins, names, out, flags=_lib.JOB_RECOMPUTE, ctx=scratch)
            extra = (saved, scratch)
        else:
            layer.backward(Context(layer, T, False, ins, saved), d_out, out=out)
            extra = (saved,)
        _tracker(slot.client).note((d_out,) + extra + tuple(out.values()))
        return out
    ins = {k: _np(v) for k, v in ins.items()}
    ins["d_out"] = _np(d_out)
    outs = {k: _np(v) for k, v in out.items()}
    if recompute:
        ins["topk_ids"] = _np(saved)
        layer._job("backward", T, ins, names, outs, flags=_lib.JOB_RECOMPUTE, ctx="scratch")
        return out
    region, temporary = _ctx_region(layer, T, saved)
    try:
        layer._job("backward", T, ins, names, outs, ctx=region)
    finally:
        if temporary:
            with layer.client._lock:
                layer.client._ctx_release(region)
    return out


_GRAD_NAMES = ("d_x", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down", "d_s_gate",
               "d_s_up", "d_s_down")


class MoEFunction(torch.autograd.Function):
    """out = MoE(x, topk_ids, router_weights; w_gate, w_up, w_down[, s_gate, s_up, s_down])
    through mokd (docs/design.md#the-layer). Call through moe() or MoE; arguments must already be
    contiguous tensors of the slot dtypes (bf16, int32, float32), all CUDA (the cuda engine,
    in place) or all CPU (the binding's numpy path, the cpu engine). On an fp8 slot the
    weights are the bf16 masters (any strides): the jobs take their packed forms
    (_Slot.pack of `sources` when given, {slot: _Master}, else of the weights), and the
    weight gradients are the masters' (bf16, contiguous)."""

    @staticmethod
    def forward(ctx, slot, recompute, sources, x, topk_ids, router_weights, w_gate, w_up,
                w_down, s_gate, s_up, s_down):
        if x.is_cuda:
            _check_capture("forward")
            # views at offsets that are not 16-byte aligned: an aligned copy (docs/torch.md)
            x, topk_ids, router_weights, w_gate, w_up, w_down, s_gate, s_up, s_down = (
                aligned(t) for t in (x, topk_ids, router_weights, w_gate, w_up, w_down, s_gate,
                                     s_up, s_down))
        T = x.shape[0]
        layer = slot.layer_for(T)
        masters = dict(w_gate=w_gate, w_up=w_up, w_down=w_down, s_gate=s_gate, s_up=s_up,
                       s_down=s_down)
        ws, gens = (slot.pack(layer, masters if sources is None else sources) if slot.fp8
                    else (masters, None))
        out, region = _run_forward(slot, layer, x, topk_ids, router_weights, ws, recompute)
        ctx.slot, ctx.layer, ctx.recompute, ctx.tokens = slot, layer, recompute, T
        ctx.gens = gens
        # saved mode: the uint8 ctx (schedule + activations) replaces topk_ids; the masters
        # are kept on an fp8 layer too (their version counters catch an in-place change)
        ctx.save_for_backward(topk_ids if recompute else region, x, router_weights, w_gate,
                              w_up, w_down, s_gate, s_up, s_down)
        return out

    @staticmethod
    def backward(ctx, d_out):
        saved, x, rw, wg, wu, wd, sg, su, sd = ctx.saved_tensors
        d_out = d_out.to(torch.bfloat16).contiguous()
        if x.is_cuda:
            _check_capture("backward")
            d_out = aligned(d_out)
        masters = dict(w_gate=wg, w_up=wu, w_down=wd, s_gate=sg, s_up=su, s_down=sd)
        ws = masters
        if ctx.gens is not None:  # fp8: the packed weights this forward ran on
            ws = ctx.slot.packed_now(list(ctx.gens), ctx.gens)
        out = _run_backward(ctx.slot, ctx.layer, ctx.tokens, ctx.recompute, saved, x, rw, ws,
                            d_out, masters)
        need = ctx.needs_input_grad
        g = [out["d_x"], None, out["d_router_weights"], out["d_w_gate"], out["d_w_up"],
             out["d_w_down"], out.get("d_s_gate"), out.get("d_s_up"), out.get("d_s_down")]
        g = [v if (v is not None and need[i + 3]) else None for i, v in enumerate(g)]
        return (None, None, None) + tuple(g)

@torch.compiler.disable
def _apply(slot, recompute, sources, x, ids, rw, wg, wu, wd, sg, su, sd):
    # torch.compile: a graph break here (the code around the layer compiles, the mokd jobs
    # run eagerly between the compiled graphs); fullgraph=True refuses the model.
    return MoEFunction.apply(slot, recompute, sources, x, ids, rw, wg, wu, wd, sg, su, sd)


def moe(slot: _Slot, x: torch.Tensor, topk_ids: torch.Tensor, router_weights: torch.Tensor,
        w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
        s_gate: Optional[torch.Tensor] = None, s_up: Optional[torch.Tensor] = None,
        s_down: Optional[torch.Tensor] = None, recompute: bool = False,
        sources: Optional[dict] = None) -> torch.Tensor:
    """The functional form (slot: MoE._slot). x [..., H] (cast to bf16 when it is another
    float dtype), topk_ids [..., K] (int32), router_weights [..., K] (float32); returns
    out [..., H] bf16. CUDA tensors run on the cuda engine (in place, on the current
    stream), CPU tensors through the binding's numpy path (the cpu engine); all on one
    device. On an fp8 slot the weights are the bf16 masters (quantised as _Slot.pack says;
    sources, {slot: _Master}: what each packed weight follows and is quantised from, where
    that is not the weight given, as for the runners' weights cut from another Parameter)."""
    H = x.shape[-1]
    K = topk_ids.shape[-1]
    lead = x.shape[:-1]
    if x.device.type not in ("cuda", "cpu"):
        raise Error("EINVAL", "mok.torch: x must be a CUDA tensor (the cuda engine reads it in "
                    "place) or a CPU tensor (the cpu engine), got %s" % x.device)
    for name, t in (("topk_ids", topk_ids), ("router_weights", router_weights),
                    ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down), ("s_gate", s_gate),
                    ("s_up", s_up), ("s_down", s_down)):
        if t is not None and t.device != x.device:
            raise Error("EINVAL", "mok.torch: %s is on %s, x on %s: every tensor of the layer "
                        "must be on one device" % (name, t.device, x.device))
    if not x.is_floating_point():
        raise Error("ESHAPE", "mok.torch: x must be a float tensor, got %s" % x.dtype)
    if topk_ids.shape[:-1] != lead or router_weights.shape != topk_ids.shape:
        raise Error("ESHAPE", "mok.torch: x %s, topk_ids %s and router_weights %s must share "
                    "their leading dims ([..., H], [..., K], [..., K])" %
                    (tuple(x.shape), tuple(topk_ids.shape), tuple(router_weights.shape)))
    x2 = x.reshape(-1, H).to(torch.bfloat16).contiguous()
    ids2 = topk_ids.reshape(-1, K).to(torch.int32).contiguous()
    rw2 = router_weights.reshape(-1, K).to(torch.float32).contiguous()
    out = _apply(slot, bool(recompute), sources, x2, ids2, rw2, w_gate, w_up, w_down, s_gate,
                 s_up, s_down)
    return out.reshape(*lead, H)


class MoE(torch.nn.Module):
    """A routed MoE FFN (SwiGLU experts, optional shared expert) run by mokd.

    Parameters (bf16): w_gate, w_up [E,I,H], w_down [E,H,I]; with shared_intermediate > 0
    also s_gate, s_up [I_s,H], s_down [H,I_s]. forward(x, topk_ids, router_weights):
    x [..., H] CUDA, or CPU with a client on the cpu engine (bf16; other float dtypes are
    cast), topk_ids [..., K] (-1 drops a
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
    same order. client must be the client that joined the group.

    group may also be a torch.distributed ProcessGroup (dist.group.WORLD, a subgroup):
    the module then joins through mok.distributed.join (collective: every rank of the
    process group builds its MoE modules in the same order), max_tokens is required (it
    sizes the group), group_options passes timeout_ms, capacity, ring_rows, transport or
    agree_timeout_s to the join, and every MoE on the same process group, client and
    sizing shares one mok group; group_tag=None gives each the next tag in creation order
    (0, 1, ...).

    dtype="fp8" (or "float8_e4m3fn", torch.float8_e4m3fn) runs an fp8 layer (block-scaled
    e4m3 GEMMs, docs/math.md "FP8"): the Parameters stay the bf16 masters (the optimizer
    updates them; their gradients are bf16 as before), and the module keeps one packed
    uint8 buffer per weight beside them (packed_weights), written by the layer's
    quantize_weight job at a forward whenever the master changed since its last
    quantisation (torch's version counter or data_ptr: one quantisation per weight per
    optimizer step). The jobs take the packed buffers in the weight slots. Under CUDA graph
    capture and torch.compile the custom ops run instead: each forward quantises the masters
    as they are then in the same job (MOK_JOB_QUANTIZE_WEIGHTS) into its saved output, which
    its backward reads, so a replay after an optimizer step runs on the new weights. On a
    group (a mok.Group of dtype "bfloat16", or a process group) each rank packs its local
    experts' masters the same way, and the results equal the fp8 module without a group on
    the ranks' tokens concatenated, bit for bit (docs/ep.md "FP8 layers on a group"); an fp8
    module on a group runs eagerly (its capture is refused). Refused with backend="torch";
    CUDA tensors on the cuda engine, CPU tensors with a client on the cpu engine; H, I and
    I_s multiples of 128."""

    def __init__(self, hidden: int, intermediate: int, experts: int, topk: int,
                 shared_intermediate: int = 0, swiglu_limit: Optional[float] = None,
                 recompute: bool = False, backend: str = "mokd", client: Optional[Client] = None,
                 max_tokens: Optional[int] = None,
                 device: Optional[Union[str, int, torch.device]] = None,
                 group=None, group_tag: Optional[int] = None,
                 group_options: Optional[dict] = None,
                 dtype: Union[str, torch.dtype] = "bfloat16") -> None:
        super().__init__()
        if backend not in ("mokd", "torch"):
            raise ValueError("backend must be 'mokd' or 'torch', got %r" % (backend,))
        dtype = _module_dtype(dtype)
        if dtype == "fp8" and backend != "mokd":
            raise ValueError("mok.torch.MoE: dtype='fp8' needs backend='mokd' (backend='torch' "
                             "runs moe_reference, the bf16 layer)")
        self.dtype = dtype
        if group is not None and not isinstance(group, Group):
            import torch.distributed as tdist
            if not isinstance(group, tdist.ProcessGroup):
                raise ValueError("group must be a mok.Group or a torch.distributed "
                                 "ProcessGroup, got %s" % type(group).__name__)
            if backend != "mokd":
                raise ValueError("a group needs backend='mokd'")
            if max_tokens is None:
                raise ValueError("max_tokens= is needed with a process group: it sizes the "
                                 "group's buffers on every rank")
            if client is None:
                client = default_client()
            # an fp8 layer runs on a bf16 group too (its activations are bf16): bf16 and
            # fp8 modules of one process group share the join
            sizing = dict(max_tokens=max_tokens, hidden=hidden, topk=topk, experts=experts,
                          dtype="bfloat16")
            sizing.update(group_options or {})
            group, tag = _shared_group(client, group, tuple(sorted(sizing.items())))
            if group_tag is None:
                group_tag = tag
        elif group_options:
            raise ValueError("group_options apply to a torch.distributed process group only")
        if group_tag is None:
            group_tag = 0
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
        _module_id(self)  # the custom ops name the module by this id
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
            (", dtype=fp8" if self.dtype == "fp8" else "") + \
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
                               self._max_tokens, self.group, self.group_tag, self.dtype)
        return self._slot

    def _masters(self):
        return {n: getattr(self, n) for n in _WEIGHTS}

    # ---- fp8: the packed weights beside the bf16 masters ----
    @property
    def quantizations(self) -> int:
        """quantize_weight jobs this module has run (fp8; 0 for bf16): one per weight whose
        master changed, at the next forward (docs/torch.md "FP8 layers")."""
        return self._slot.quantizations if self._slot is not None else 0

    @property
    def packed_weights(self) -> dict:
        """{weight name: its packed uint8 tensor} (fp8: the buffers the layer's jobs take in
        the weight slots, written by quantize_weight; empty before the first forward)."""
        if self._slot is None:
            return {}
        with self._slot.pack_lock:
            return {n: e.buf for n, e in self._slot.packed.items()}

    def quantize_weights(self, force: bool = False) -> int:
        """fp8: quantise now every weight whose master changed since its last quantisation
        (every weight with force=True, e.g. after writes through .data, which torch's version
        counter does not see); returns how many were quantised. A forward does this itself."""
        if self.dtype != "fp8":
            raise ValueError("mok.torch.MoE: quantize_weights() is for dtype='fp8' modules")
        slot = self._get_slot()
        before = slot.quantizations
        slot.pack(slot.layer_for(1), self._masters(), force=force)
        return slot.quantizations - before

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                router_weights: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return moe_reference(x, topk_ids, router_weights, self.w_gate, self.w_up,
                                 self.w_down, self.s_gate, self.s_up, self.s_down,
                                 self.swiglu_limit)
        # capture: the custom ops (standing jobs), group layers included; a group layer's
        # replays take its turns in the group, so every rank replays its graphs in the same
        # order (docs/ep.md "Capture and replay on a group"). Compiling: the ops for layers
        # without a group (their fake kernels size the ctx without a group).
        # (is_compiling first: dynamo must not trace the capture query)
        if torch.compiler.is_compiling():
            if self.group is None:
                return _forward_op(self, x, topk_ids, router_weights)
        elif _capturing(x):
            if self.dtype == "fp8" and self.group is not None:
                raise Error("EUNSUPPORTED", "mok.torch.MoE(dtype='fp8') on a group under CUDA "
                            "graph capture is not supported: the quantising forward that "
                            "captured fp8 modules run is for layers without a group; run it "
                            "eagerly (torch.compile without CUDA graphs runs it eagerly too)")
            return _forward_op(self, x, topk_ids, router_weights)
        return _forward_mokd(self, x, topk_ids, router_weights)


@torch.compiler.disable
def _forward_mokd(m, x, topk_ids, router_weights):
    # one graph break per MoE call under torch.compile (see _apply)
    for p in m.parameters():
        if p.dtype != torch.bfloat16 or p.device != x.device or not p.is_contiguous():
            raise Error("ESHAPE", "mok.torch.MoE: parameters must stay contiguous bf16 tensors "
                        "on x's device %s (got %s %s on %s)" % (x.device, p.dtype,
                                                               tuple(p.shape), p.device))
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


# ---- a layer for modules that hold their weights in their own layout ------------------------

class _Runner:
    """Runs the layer on weights a caller holds (mok.torchtitan, mok.hf_transformers): one
    mokd layer (a _Slot) per shape, created at first use; backend="torch" runs
    moe_reference instead (no daemon; also on the CPU). Weights of another float dtype are
    cast to bf16 and non-contiguous ones copied (autograd takes the gradients back
    through the cast or copy). CUDA tensors run on the cuda engine, CPU tensors with a
    client on the cpu engine, as for MoE.

    dtype="fp8" (the names MoE takes) runs an fp8 layer on the caller's weights as masters,
    exactly as MoE(dtype="fp8") does on its Parameters (the same _Slot.pack): the packed
    forms are kept per runner (one runner per experts module) and written again at a call
    whenever the tensor a weight follows changed (identity, _version, data_ptr). A weight
    follows itself, or the tensor `follow` names for its slot (the Parameter it was cut
    from: a change of transformers' gate_up_proj re-quantises w_gate and w_up). The
    weights need not be contiguous (nothing reads them but the quantisation)."""

    def __init__(self, backend="mokd", client=None, max_tokens=None, dtype="bfloat16",
                 who="mok"):
        if backend not in ("mokd", "torch"):
            raise ValueError("backend must be 'mokd' or 'torch', got %r" % (backend,))
        self.dtype = _module_dtype(dtype, who)
        if self.dtype == "fp8" and backend != "mokd":
            raise ValueError("%s: dtype='fp8' needs backend='mokd' (backend='torch' runs "
                             "moe_reference, the bf16 layer)" % who)
        self.backend, self._client, self.max_tokens = backend, client, max_tokens
        self.slots = {}

    @property
    def client(self):
        if self._client is None:
            self._client = default_client()
        return self._client

    @property
    def quantizations(self):
        """quantize_weight jobs run for this runner's layers (fp8; 0 for bf16)."""
        return sum(s.quantizations for s in self.slots.values())

    @property
    def packed_weights(self):
        """{weight slot: packed uint8 tensor} of the layer last used (fp8; empty before the
        first call and for bf16)."""
        for s in reversed(list(self.slots.values())):
            with s.pack_lock:
                return {n: e.buf for n, e in s.packed.items()}
        return {}

    def requantize(self):
        """fp8: quantise every weight again at the next call (after writes that torch's
        version counter does not see, such as writes through .data)."""
        for s in self.slots.values():
            with s.pack_lock:
                for e in s.packed.values():
                    e.key = None

    def __call__(self, x, topk_ids, router_weights, w_gate, w_up, w_down, s_gate=None,
                 s_up=None, s_down=None, follow=None):
        if self.backend == "torch":
            return moe_reference(x, topk_ids, router_weights, w_gate, w_up, w_down, s_gate,
                                 s_up, s_down)
        given = dict(w_gate=w_gate, w_up=w_up, w_down=w_down, s_gate=s_gate, s_up=s_up,
                     s_down=s_down)
        sources = None
        if self.dtype == "fp8":
            # mokd reads only the packed forms: the weights stay as they are (a view of a
            # Parameter, any strides), cast to bf16 where they are not
            ws = {k: None if w is None else w.to(torch.bfloat16) for k, w in given.items()}
            follow = follow or {}
            sources = {k: _Master(ws[k], follow.get(k, w)) for k, w in given.items()
                       if w is not None}
        else:
            ws = {k: None if w is None else w.to(torch.bfloat16).contiguous()
                  for k, w in given.items()}
        E, I, H = ws["w_gate"].shape
        K = topk_ids.shape[-1]
        I_s = ws["s_gate"].shape[0] if ws["s_gate"] is not None else 0
        key = (H, I, E, K, I_s)
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = _Slot(self.client, H, I, E, K, I_s, None, self.max_tokens,
                                           dtype=self.dtype)
        return moe(slot, x, topk_ids, router_weights, *ws.values(), sources=sources)


# ---- custom ops: torch.compile(fullgraph=True) and CUDA graph capture -----------------------
#
# mok::moe_forward and mok::moe_backward are PyTorch custom ops (torch.library.custom_op):
# dynamo and AOTAutograd trace them with their fake kernels (shapes only; no daemon), so a
# model compiles into one graph. At run time they submit the same mokd jobs as MoEFunction
# (eager, ring + stream fences), or, when the current stream is being captured, they make
# (once per layer, op, T and tensor addresses) a standing job and record its three replay-
# invariant stream operations (docs/cuda.md "Capture and replay"): every replay of the
# graph then runs the job once. Every tensor the job names is allocated during the capture
# (the graph's private memory pool keeps those addresses for its replays, as it does for
# the operands of the graph's kernels) or is a Parameter; the standing job holds none of
# them (torch.compile's CUDA graph trees refuse pool memory kept past a graph unless it
# is an output; the ctx is one). A failure shows at client.check_standing() (mok.torch.check_graphs()).
# An fp8 module's forward op is one quantising forward (MOK_JOB_QUANTIZE_WEIGHTS) from the
# bf16 masters, captured or not: its second output holds the packed weights it wrote, then
# the ctx, and its backward reads both from there (so a backward replay reads what its
# forward replay quantised; no packed buffer outlives the graph). The MoEFunction path
# (eager, no compile) keeps the version-counter cache instead.

_modules = {}  # id -> weakref to the MoE module (ops carry the id, an int)
_module_ids = itertools.count(1)
_modules_lock = threading.Lock()


def _module_id(m):
    mid = getattr(m, "_mok_op_id", None)
    if mid is None:
        with _modules_lock:
            mid = next(_module_ids)
            _modules[mid] = weakref.ref(m)
        m._mok_op_id = mid
    return mid


def _module(mid):
    m = _modules.get(mid)
    m = m() if m is not None else None
    if m is None:
        raise Error("ENOENT", "mok.torch: the MoE module of this op is gone")
    return m


def _row_align(m, x):
    """The row alignment of the engine that will run m's layer on x: its layer's when it has
    one, else the cuda engine's 128 for CUDA tensors and the cpu engine's 1 for CPU ones."""
    slot = m._slot
    if slot is not None and slot.layer is not None:
        return slot.layer.row_align
    return 128 if x.device.type == "cuda" else 1


def _ctx_nbytes(m, T, row_align=128):
    """proto/mok_layout.h mok_ctx_bytes with the engine's row alignment (default the cuda
    engine's): the schedule (header, counts, offsets, row_slot, slot_row), then g and u of
    the routed rows and of the shared expert (bf16; an fp8 layer's acts are bf16 too), each
    part 256-aligned. Works on symbolic T too."""
    K, E, I, I_s = m.topk, m.w_gate.shape[0], m.intermediate, m.shared_intermediate

    def a256(v):
        return (v + 255) // 256 * 256
    rows = T * K + E * (row_align - 1)
    sched_ints = 8 + E + E + 1 + rows + T * K
    return a256(4 * sched_ints) + 2 * a256(rows * I * 2) + 2 * a256(T * I_s * 2)


def _packed_nbytes(m):
    """proto/mok_slots.c mok_packed_weights_bytes for an fp8 module: every weight's packed form
    (mok_fp8_weight_bytes: its e4m3 bytes in both orientations, 256-aligned, then its 128x128
    block scales), each from a 256-byte boundary; 0 for a bf16 module."""
    if m.dtype != "fp8":
        return 0

    def a256(v):
        return (v + 255) // 256 * 256
    E, I, H, I_s = m.w_gate.shape[0], m.intermediate, m.hidden, m.shared_intermediate
    dims = [(E, I, H), (E, I, H), (E, H, I)]
    if I_s:
        dims += [(1, I_s, H), (1, I_s, H), (1, H, I_s)]
    return sum(a256(2 * a256(e * n * k) + 4 * e * (n // 128) * (k // 128)) for e, n, k in dims)


def _saved_nbytes(m, T, recompute, row_align=128):
    """The forward op's second output, what its backward reads: on an fp8 module the packed
    weights its job wrote (_packed_nbytes) first, then the ctx (none with recompute)."""
    return _packed_nbytes(m) + (0 if recompute else _ctx_nbytes(m, T, row_align))


def _packed_of(layer, saved, P):
    """{weight slot: its packed form} inside the first P bytes of an fp8 op's saved tensor."""
    if layer.packed_weights_bytes() != P:
        raise Error("EINVAL", "mok.torch: the module's packed weights take %d bytes, its layer "
                    "says %d" % (P, layer.packed_weights_bytes()))
    return layer.packed_views(saved[:P])


def _standing_run(slot, layer, op, T, tensors, flags, owned):
    """Enqueue the standing job of these tensors on the current stream (under capture),
    made once per (layer, op, T, flags, addresses). owned: the names of the tensors this op
    allocated inside the capture (the graph's pool holds them while the graph lives)."""
    named = {k: v for k, v in tensors.items() if v is not None}
    key = (id(layer), op, T, flags, tuple(sorted((k, v.data_ptr()) for k, v in named.items())))
    sj = slot.standing.get(key)
    if sj is not None:
        try:  # a cancelled one (a region re-registered, say) is made anew, and so is one
            # whose addresses now hold other allocations than those it was made on (a dead
            # graph's pool freed and allocated again): mokd would still map the old ones
            sj.check()
            if any(_buffer_id(p) != b for p, b in sj._buffers.values()):
                raise Error("ENOENT", "reallocated")
        except Error:
            sj.close()
            sj = None
    if sj is None:
        # the tensors are Parameters (the module holds them) or the capture's own
        # allocations (the graph's pool keeps them): not held, see mok/_standing.py
        sj = slot.standing[key] = layer.standing(op, T, tensors, flags, hold=False)
        sj._buffers = {k: (v.data_ptr(), _buffer_id(v)) for k, v in named.items()}
        sj._owned = [k for k in owned if k in named]
        sj._cache = (slot.standing, key)
    sj.enqueue(torch.cuda.current_stream(tensors["x"].device).cuda_stream)


def _close_orphans(client):
    """Close mok.torch's standing jobs whose graphs are gone. A job's own allocations (its
    op's outputs, made inside the capture) stay in the graph's pool while the graph lives;
    once one of them is freed (a deleted graph's pool released, its addresses perhaps
    allocated again, which makes mokd cancel the job), no replay can run the job, so its
    cancellation is no failure of a replay. A job whose Parameter was reallocated under a
    live graph keeps its error: that graph's replays did not run."""
    for sj in list(client._standing_jobs):
        owned = getattr(sj, "_owned", None)
        if sj._h and owned and any(_buffer_id(sj._buffers[k][0]) != sj._buffers[k][1]
                                   for k in owned):
            cache, key = sj._cache
            if cache.get(key) is sj:
                del cache[key]
            sj.close()


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def _op_forward(mid: int, recompute: bool, x: torch.Tensor, topk_ids: torch.Tensor,
                router_weights: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor, s_gate: Optional[torch.Tensor],
                s_up: Optional[torch.Tensor],
                s_down: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    m = _module(mid)
    slot = m._get_slot()
    T = x.shape[0]
    layer = slot.layer_for(T)
    if slot.fp8:
        return _op_forward_fp8(m, slot, layer, recompute, x, topk_ids, router_weights,
                               dict(w_gate=w_gate, w_up=w_up, w_down=w_down, s_gate=s_gate,
                                    s_up=s_up, s_down=s_down))
    if _capturing(x):
        shared = dict(s_gate=s_gate, s_up=s_up, s_down=s_down) if s_gate is not None else {}
        out = torch.empty_like(x)
        ctx = torch.empty(0 if recompute else layer.ctx_bytes(T), dtype=torch.uint8,
                          device=x.device)
        t = dict(x=x, topk_ids=topk_ids, router_weights=router_weights, w_gate=w_gate,
                 w_up=w_up, w_down=w_down, out=out, ctx=None if recompute else ctx, **shared)
        _standing_run(slot, layer, "forward", T, t, 0, ("out", "ctx"))
        return out, ctx
    ws = dict(w_gate=w_gate, w_up=w_up, w_down=w_down, s_gate=s_gate, s_up=s_up, s_down=s_down)
    out, region = _run_forward(slot, layer, x, topk_ids, router_weights, ws, recompute)
    if region is None:
        region = torch.empty(0, dtype=torch.uint8, device=x.device)
    return out, region


def _op_forward_fp8(m, slot, layer, recompute, x, topk_ids, router_weights, masters):
    """An fp8 module's forward op: one quantising forward (MOK_JOB_QUANTIZE_WEIGHTS) from the
    bf16 masters as they are now, writing every weight's packed form into the op's second
    output (then the ctx), which its backward reads: captured, each replay quantises the
    masters of its moment, and the backward replay reads the forms its forward replay wrote
    (docs/torch.md "FP8 layers"). Returns (out, saved)."""
    T = x.shape[0]
    P = _packed_nbytes(m)
    masters = {k: v for k, v in masters.items() if v is not None}
    n_ctx = 0 if recompute else layer.ctx_bytes(T)
    saved = torch.empty(P + n_ctx, dtype=torch.uint8, device=x.device)
    packed = saved[:P]
    _packed_of(layer, saved, P)  # the module's sizes are the layer's
    out = torch.empty_like(x)
    ins = dict(x=x, topk_ids=topk_ids, router_weights=router_weights, **masters)
    flags = _lib.JOB_QUANTIZE_WEIGHTS
    if _capturing(x):
        t = dict(ins, out=out, packed_weight=packed, ctx=None if recompute else saved[P:])
        _standing_run(slot, layer, "forward", T, t, flags, ("out", "packed_weight", "ctx"))
    elif x.is_cuda:
        layer._job("forward", T, ins, ["out", "packed_weight"],
                   {"out": out, "packed_weight": packed}, flags=flags,
                   ctx=None if recompute else saved[P:])
        _tracker(slot.client).note(tuple(ins.values()) + (out, saved))
    else:
        outs = {"out": _np(out), "packed_weight": _np(packed)}
        _, region = layer._job("forward", T, {k: _np(v) for k, v in ins.items()},
                               ["out", "packed_weight"], outs, flags=flags,
                               ctx=None if recompute else "save")
        if region is not None:
            try:
                np.copyto(_np(saved)[P:], region.u8[:n_ctx])
            finally:
                with layer.client._lock:
                    layer.client._ctx_release(region)
    with slot.pack_lock:
        slot.quantizations += len(masters)
    return out, saved


@_op_forward.register_fake
def _op_forward_fake(mid, recompute, x, topk_ids, router_weights, w_gate, w_up, w_down,
                     s_gate, s_up, s_down):
    m = _module(mid)
    n = _saved_nbytes(m, x.shape[0], recompute, _row_align(m, x))
    return torch.empty_like(x), x.new_empty((n,), dtype=torch.uint8)


@torch.library.custom_op("mok::moe_backward", mutates_args=())
def _op_backward(mid: int, recompute: bool, saved: torch.Tensor, x: torch.Tensor,
                 router_weights: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, s_gate: Optional[torch.Tensor],
                 s_up: Optional[torch.Tensor], s_down: Optional[torch.Tensor],
                 d_out: torch.Tensor,
                 fp8_saved: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    # fp8_saved: an fp8 module's forward output (its packed weights, then its ctx); saved is
    # topk_ids with recompute, else that output too
    m = _module(mid)
    slot = m._get_slot()
    T = x.shape[0]
    layer = slot.layer_for(T)
    d_out = d_out.contiguous()
    masters = dict(w_gate=w_gate, w_up=w_up, w_down=w_down, s_gate=s_gate, s_up=s_up,
                   s_down=s_down)
    ws = masters
    if slot.fp8:
        if fp8_saved is None:
            raise Error("EINVAL", "mok.torch: an fp8 backward needs its forward's packed weights")
        P = _packed_nbytes(m)
        ws = _packed_of(layer, fp8_saved, P)  # the forms the forward (replay) wrote
        if not recompute:
            saved = fp8_saved[P:]
    if _capturing(x):
        like = dict(masters, x=x, router_weights=router_weights)
        ins = {k: v for k, v in dict(ws, x=x, router_weights=router_weights).items()
               if v is not None}
        names = list(_GRAD_NAMES[:5]) + (list(_GRAD_NAMES[5:]) if s_gate is not None else [])
        out = {n: torch.empty_like(like[n[2:]]) for n in names}
        t = dict(ins, d_out=d_out, **out)
        if recompute:
            t.update(topk_ids=saved, ctx=torch.empty(layer.ctx_bytes(T), dtype=torch.uint8,
                                                     device=x.device))
            _standing_run(slot, layer, "backward", T, t, _lib.JOB_RECOMPUTE,
                          tuple(names) + ("ctx",))
        else:
            t.update(ctx=saved)
            _standing_run(slot, layer, "backward", T, t, 0, tuple(names))
        return [out[n] for n in names]
    out = _run_backward(slot, layer, T, recompute, saved, x, router_weights, ws, d_out,
                        masters)
    return list(out.values())


@_op_backward.register_fake
def _op_backward_fake(mid, recompute, saved, x, router_weights, w_gate, w_up, w_down, s_gate,
                      s_up, s_down, d_out, fp8_saved=None):
    outs = [torch.empty_like(x), torch.empty_like(router_weights), torch.empty_like(w_gate),
            torch.empty_like(w_up), torch.empty_like(w_down)]
    if s_gate is not None:
        outs += [torch.empty_like(s_gate), torch.empty_like(s_up), torch.empty_like(s_down)]
    return outs


def _op_setup_context(ctx, inputs, output):
    mid, recompute, x, ids, rw, wg, wu, wd, sg, su, sd = inputs
    ctx.mid, ctx.recompute, ctx.shared = mid, recompute, sg is not None
    # an fp8 module's backward reads the packed weights in the forward's output (recompute
    # too); a bf16 one's saves what it did before
    fp8 = _module(mid).dtype == "fp8"
    ctx.save_for_backward(ids if recompute else output[1], x, rw, wg, wu, wd, sg, su, sd,
                          output[1] if fp8 else None)


def _op_autograd(ctx, d_out, d_ctx):
    saved, x, rw, wg, wu, wd, sg, su, sd, fp8_saved = ctx.saved_tensors
    g = torch.ops.mok.moe_backward(ctx.mid, ctx.recompute, saved, x, rw, wg, wu, wd, sg, su,
                                   sd, d_out.to(torch.bfloat16), fp8_saved)
    shared = tuple(g[5:8]) if ctx.shared else (None, None, None)
    return (None, None, g[0], None, g[1], g[2], g[3], g[4]) + shared


_op_forward.register_autograd(_op_autograd, setup_context=_op_setup_context)


def _forward_op(m, x, topk_ids, router_weights):
    """MoE.forward through the custom op (compiling, or capturing a CUDA graph)."""
    for p in m.parameters():
        if p.dtype != torch.bfloat16 or not p.is_contiguous():
            raise Error("ESHAPE", "mok.torch.MoE: parameters must stay contiguous bf16 "
                        "tensors (got %s %s)" % (p.dtype, tuple(p.shape)))
    H, K = x.shape[-1], topk_ids.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, H).to(torch.bfloat16).contiguous()
    ids2 = topk_ids.reshape(-1, K).to(torch.int32).contiguous()
    rw2 = router_weights.reshape(-1, K).to(torch.float32).contiguous()
    out, _ = torch.ops.mok.moe_forward(_module_id(m), bool(m.recompute), x2, ids2, rw2,
                                       m.w_gate, m.w_up, m.w_down, m.s_gate, m.s_up, m.s_down)
    return out.reshape(*lead, H)


def check_graphs(client=None):
    """Raise the first failure of a standing job (what captured graphs replay) of client
    (default: default_client()); call it after synchronising the replays."""
    c = client or default_client()
    _close_orphans(c)
    c.check_standing()
