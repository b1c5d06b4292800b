# SPDX-License-Identifier: Apache-2.0
"""The Python binding proper: Client, Layer, Context, shared staging memory.

Memory (see also the package docstring):

* Every tensor a job names must live in memory registered with mokd. The
  binding keeps, per client, one *staging* region per tensor slot ("x",
  "w_gate", "out", ...), allocated with mok_host_alloc and grown (never
  shrunk) when a larger tensor comes. A steady loop therefore registers
  nothing new after its first iteration; ``Client._registrations`` counts
  every mok_host_alloc the binding made.
* Inputs that already live in this client's ``c.empty()`` memory
  (C-contiguous) are named in place: zero copy. Others are copied into
  their slot's staging region.
* Outputs are written by mokd into staging and returned as fresh numpy
  arrays (copies), so a later call never changes what the caller holds.
  ``out=`` arrays avoid that allocation: if an out array lives in
  ``c.empty()`` memory, mokd writes into it directly (zero copy); any other
  writable numpy array of the right shape and dtype is filled by one copy.
* The saved context of a forward (schedule + activations, ctx_bytes) lives
  in a region of its own from a per-client pool; backward names it in place.
  Backward hands the region back to the pool unless ``retain_ctx=True``
  (like PyTorch's retain_graph); so does dropping the Context.

Jobs of one client run one at a time (a lock guards the staging regions);
use one client per thread for parallelism (mok_wait releases the GIL).
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import weakref
import ctypes
from ctypes import byref, c_uint64, c_void_p
from typing import (TYPE_CHECKING, Any, Dict, List, Mapping, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import numpy as np
import numpy.typing as npt

from . import _lib
from ._errors import Error
from ._lib import OP, SLOT, JOB_QUANTIZE_WEIGHTS, JOB_RECOMPUTE, TensorArray
from ._standing import Standing
from .bf16 import bf16_dtype, is_bf16

__all__ = ["connect", "Client", "Group", "Layer", "Context", "Stats", "Grads", "ComputeGrads",
           "TensorLike", "Result", "Out", "DType"]

if TYPE_CHECKING:
    import torch
    #: a tensor argument: a numpy array (or anything numpy.asarray takes), or a torch CUDA
    #: tensor (then every tensor of the call is one, used in place on the current stream)
    TensorLike = Union[npt.ArrayLike, torch.Tensor]
    #: a result: a numpy array for numpy arguments (bfloat16 ones in mok.bf16_dtype()),
    #: a torch CUDA tensor for torch arguments
    Result = Union[np.ndarray, torch.Tensor]
else:
    TensorLike = npt.ArrayLike
    Result = np.ndarray
#: out=: one array for a job of one output; a dict {name: array}, the result namedtuple
#: or a sequence in the result's order for several
Out = Union[Result, Mapping[str, Optional[Result]], Sequence[Optional[Result]]]
#: a layer's dtype: "float32" or "bfloat16" (or np.float32, ml_dtypes.bfloat16)
DType = Union[str, npt.DTypeLike]


class Stats(NamedTuple):
    """Daemon-wide counters (mok_stats)."""
    uptime_ms: int
    jobs_done: int
    jobs_failed: int
    sessions_now: int
    sessions_total: int
    latency_p50_ns: int
    latency_p99_ns: int


class Grads(NamedTuple):
    """The gradients of backward; the d_s_* are None without a shared expert."""
    d_x: Result
    d_router_weights: Result
    d_w_gate: Result
    d_w_up: Result
    d_w_down: Result
    d_s_gate: Optional[Result]
    d_s_up: Optional[Result]
    d_s_down: Optional[Result]


class ComputeGrads(NamedTuple):
    """The results of compute_backward; the shared ones None without a shared expert."""
    routed_d_x: Result
    d_router_weights: Result
    d_w_gate: Result
    d_w_up: Result
    d_w_down: Result
    shared_d_x: Optional[Result]
    d_s_gate: Optional[Result]
    d_s_up: Optional[Result]
    d_s_down: Optional[Result]


assert Stats._fields == tuple(f[0] for f in _lib.DaemonStats._fields_)

_NP_OF_CODE = {_lib.DTYPE_F32: np.dtype(np.float32), _lib.DTYPE_BF16: np.dtype(np.uint16),
               _lib.DTYPE_I32: np.dtype(np.int32), _lib.DTYPE_U8: np.dtype(np.uint8)}
_LAYER_DTYPE_NAME = {_lib.DTYPE_F32: "float32", _lib.DTYPE_BF16: "bfloat16",
                     _lib.DTYPE_FP8_E4M3: "fp8"}
_CODE_NAME = {_lib.DTYPE_F32: "float32",
              _lib.DTYPE_BF16: "bfloat16 (ml_dtypes.bfloat16 or uint16 bit patterns)",
              _lib.DTYPE_I32: "int32", _lib.DTYPE_U8: "uint8"}
# dims of each slot, for messages
_WEIGHT_SLOTS = ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")
_SLOT_DIMS = {
    "x": "[T,H]", "out": "[T,H]", "d_out": "[T,H]", "d_x": "[T,H]", "shared_y": "[T,H]",
    "shared_d_x": "[T,H]", "topk_ids": "[T,K]", "router_weights": "[T,K]",
    "d_router_weights": "[T,K]", "w_gate": "[E_loc,I,H]", "w_up": "[E_loc,I,H]",
    "d_w_gate": "[E_loc,I,H]", "d_w_up": "[E_loc,I,H]", "w_down": "[E_loc,H,I]",
    "d_w_down": "[E_loc,H,I]", "s_gate": "[I_s,H]", "s_up": "[I_s,H]", "d_s_gate": "[I_s,H]",
    "d_s_up": "[I_s,H]", "s_down": "[H,I_s]", "d_s_down": "[H,I_s]",
    "routed_x": "[R_cap,H]", "routed_y": "[R_cap,H]", "routed_d_out": "[R_cap,H]",
    "routed_d_x": "[R_cap,H]", "schedule": "[schedule_ints]", "acts": "[acts_bytes]",
    "ctx": "[ctx_bytes]",
}
DEFAULT_MAX_TOKENS = 1024  # first size of a layer created with max_tokens=None
_MAX_TOKENS_LIMIT = 1 << 20  # mokd's MOK_LAYER_MAX_TOKENS


def _raise(status):
    raise Error(status, _lib.last_error())


def _is_torch(a):
    mod = type(a).__module__ or ""
    return mod == "torch" or mod.startswith("torch.")


def _is_torch_cuda(a):
    return _is_torch(a) and bool(getattr(a, "is_cuda", False))


def _check_torch(name, a):
    if _is_torch(a) or hasattr(a, "__cuda_array_interface__"):
        raise Error("EUNSUPPORTED",
                    "%s is a %s: pass numpy arrays, or torch CUDA tensors for every tensor "
                    "argument of the call (they are used in place, on the current stream)" %
                    (name, "torch CPU tensor" if _is_torch(a) else "CUDA array of another "
                     "framework"))


def _torch_dtype(code):
    import torch
    return {_lib.DTYPE_F32: torch.float32, _lib.DTYPE_BF16: torch.bfloat16,
            _lib.DTYPE_I32: torch.int32, _lib.DTYPE_U8: torch.uint8}[code]


def _round_region(n):
    """Staging sizes grow in coarse steps so slowly varying shapes settle."""
    n = max(int(n), 4096)
    step = max(4096, 1 << max(0, n.bit_length() - 4))  # <= 1/8 waste
    return (n + step - 1) // step * step


class _Buf:
    """[ptr, ptr+nbytes) as an object numpy can view (np.asarray keeps it alive)."""
    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, ptr, nbytes):
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}


class _Region:
    """One mok_host_alloc region the binding owns (staging or ctx)."""
    __slots__ = ("ptr", "cap", "u8")

    def __init__(self, ptr, cap):
        self.ptr = ptr
        self.cap = cap
        self.u8 = np.asarray(_Buf(ptr, cap))

    def view(self, dtype, shape):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.u8[:n].view(dtype).reshape(shape)


class _Native:
    """The mok_client handle. Closed (mok_close) when the last reference goes:
    the Client, and every c.empty() buffer still alive, hold one."""

    def __init__(self, ptr):
        self.holder = [ptr]
        self._fin = weakref.finalize(self, _Native._close, self.holder)

    @property
    def ptr(self):
        return self.holder[0]

    @staticmethod
    def _close(holder):
        p, holder[0] = holder[0], None
        if p:
            _lib.lib().mok_close(p)


def _free_user(native, ptr, user_regions):
    user_regions.pop(ptr, None)
    if native.ptr:
        _lib.lib().mok_host_free(native.ptr, ptr)


def connect(socket: Optional[Union[str, bytes, os.PathLike]] = None,
            name: Optional[str] = None) -> Client:
    """Connect to mokd: socket path, else $MOK_SOCKET, else /run/mok/mokd-0.sock."""
    return Client(socket, name)


class Client:
    """A session with mokd. Use as a context manager or call close()."""

    engine: str
    device: str
    session: int

    def __init__(self, socket: Optional[Union[str, bytes, os.PathLike]] = None,
                 name: Optional[str] = None) -> None:
        L = _lib.lib()
        if socket is not None:
            socket = os.fsencode(socket)
        if name is None:
            name = "python:%s:%d" % (os.path.basename(sys.argv[0] if sys.argv and sys.argv[0]
                                                      else "python"), os.getpid())
        h = c_void_p()
        st = L.mok_connect(socket, name.encode(), byref(h))
        if st:
            _raise(st)
        self._native = _Native(h.value)
        self._lock = threading.Lock()
        self._closed = False
        self._staging: Dict[str, _Region] = {}  # slot name -> _Region
        self._ctx_all: set = set()              # every ctx-pool _Region
        self._ctx_free: List[_Region] = []      # idle ctx-pool regions
        self._ctx_returned: collections.deque = collections.deque()  # from Context finalizers
        self._dead_layers: collections.deque = collections.deque()   # handles of dropped Layers
        self._abandoned: List[Tuple[int, Any]] = []  # (ticket, ctx region) of interrupted waits
        self._layers: weakref.WeakSet = weakref.WeakSet()
        self._groups: weakref.WeakSet = weakref.WeakSet()
        self._standing_jobs: weakref.WeakSet = weakref.WeakSet()  # Standing (mok/_standing.py)
        self._user: Dict[int, int] = {}         # c.empty() regions: ptr -> bytes
        self._registrations = 0                 # mok_host_alloc calls made by the binding
        self.engine = L.mok_client_engine(h).decode()
        self.device = L.mok_client_device(h).decode()
        self.session = int(L.mok_client_session(h))

    # ---- life cycle ----
    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<mok.Client session=%d engine=%s device=%r%s>" % (
            self.session, self.engine, self.device, " closed" if self._closed else "")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Destroy this client's layers and staging, say Goodbye. Arrays from
        c.empty() stay valid: the session (and their memory) ends when the last
        of them is gone. Contexts of this client become unusable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            L = _lib.lib()
            p = self._native.ptr
            while self._abandoned:  # jobs still using staging: let them finish
                L.mok_wait(p, self._abandoned.pop(0)[0], 5000)
            for sj in list(self._standing_jobs):
                h, sj._h = sj._h, None
                if h:
                    L.mok_standing_destroy(h)
            for layer in list(self._layers):
                layer._destroy_locked()
            for g in list(self._groups):
                g._ptr = None  # mok_close frees it; the daemon keeps the group warm
            while self._dead_layers:
                holder = self._dead_layers.popleft()
                if holder[0]:
                    L.mok_layer_destroy(holder[0])
                    holder[0] = None
            for r in list(self._staging.values()) + list(self._ctx_all):
                L.mok_host_free(p, r.ptr)
            self._staging.clear()
            self._ctx_all.clear()
            self._ctx_free.clear()
            self._ctx_returned.clear()
            native, self._native = self._native, None  # type: ignore[assignment]
        del native  # mok_close now, unless c.empty() buffers still hold it

    def _check_open(self):
        if self._closed:
            raise Error("ECLOSED", "this mok client is closed")

    # ---- daemon info ----
    def stats(self) -> Stats:
        """Daemon-wide counters (mok_stats) as a Stats namedtuple."""
        with self._lock:
            self._check_open()
            s = _lib.DaemonStats()
            st = _lib.lib().mok_stats(self._native.ptr, byref(s))
            if st:
                _raise(st)
            return Stats(*(getattr(s, f) for f in Stats._fields))

    def nop(self) -> float:
        """An empty job through the rings; returns the round trip in seconds."""
        import time
        with self._lock:
            self._check_open()
            L = _lib.lib()
            t0 = time.perf_counter()
            self._service()
            ticket = c_uint64()
            st = L.mok_submit_nop(self._native.ptr, byref(ticket))
            if st:
                _raise(st)
            self._wait(ticket.value)
            return time.perf_counter() - t0

    def synchronize(self, timeout_ms: int = -1) -> None:
        """Wait on the host for every job submitted so far (torch jobs included)
        and raise the first failure of a torch job since the last check."""
        with self._lock:
            self._check_open()
        st = _lib.lib().mok_sync(self._native.ptr, timeout_ms)
        if st:
            _raise(st)

    def check_standing(self) -> None:
        """Raise the first failure of any standing job of this client (a CUDA graph
        replay reports mokd's errors here, after the replay was synchronised)."""
        for sj in list(self._standing_jobs):
            if sj._h:
                sj.check()

    def _check_async(self):
        st = _lib.lib().mok_async_error(self._native.ptr)
        if st:
            _raise(st)

    # ---- memory ----
    def _alloc_region(self, nbytes):
        p = _lib.lib().mok_host_alloc(self._native.ptr, nbytes)
        if not p:
            raise Error("ENOMEM", _lib.last_error() or "mok_host_alloc failed")
        self._registrations += 1
        return p

    def empty(self, shape: Union[int, Sequence[int]], dtype: DType = "float32") -> np.ndarray:
        """A numpy array in memory shared with mokd (a registered memfd): jobs
        read and write it in place. dtype: "float32", "bfloat16" (gives uint16
        bit patterns, which mok.to_bf16 fills), "int32", "uint8" or a numpy
        dtype (ml_dtypes.bfloat16 for a bfloat16-typed array). Contents are
        zero."""
        if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
            dtype = np.uint16
        elif isinstance(dtype, str) and dtype in ("f32",):
            dtype = np.float32
        dt = np.dtype(dtype)
        shape = ((int(shape),) if np.isscalar(shape)  # type: ignore
                 else tuple(int(s) for s in shape))  # type: ignore
        if any(s < 0 for s in shape):
            raise Error("EINVAL", "negative dimension in shape %s" % (shape,))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        size = max(nbytes, 1)
        with self._lock:
            self._check_open()
            self._service()
            ptr = self._alloc_region(size)
            self._user[ptr] = size
            native = self._native
        buf = _Buf(ptr, size)
        weakref.finalize(buf, _free_user, native, ptr, self._user)
        return np.asarray(buf)[:nbytes].view(dt).reshape(shape)

    def _in_mok_memory(self, a, writable=False):
        """Address of a if it lies, C-contiguous, in this client's c.empty() memory, at a
        multiple of 16 bytes (the cuda engine's rule for every tensor; a view at another
        offset is staged like any other array)."""
        if not (a.flags.c_contiguous and a.flags.aligned) or (writable and not a.flags.writeable):
            return None
        ptr = a.__array_interface__["data"][0]
        if ptr % 16:
            return None
        n = a.nbytes
        for base, size in list(self._user.items()):
            if base <= ptr and ptr + n <= base + size:
                return ptr
        return None

    def _stage(self, key, nbytes):
        r = self._staging.get(key)
        if r is None or r.cap < nbytes:
            if r is not None:
                del self._staging[key]
                _lib.lib().mok_host_free(self._native.ptr, r.ptr)
            cap = _round_region(nbytes)
            r = _Region(self._alloc_region(cap), cap)
            self._staging[key] = r
        return r

    def _ctx_acquire(self, nbytes):
        self._service()
        fits = [r for r in self._ctx_free if r.cap >= nbytes]
        if fits:
            r = min(fits, key=lambda q: q.cap)
            self._ctx_free.remove(r)
            return r
        if self._ctx_free:  # too small: replace one rather than pile up
            old = self._ctx_free.pop()
            self._ctx_all.discard(old)
            _lib.lib().mok_host_free(self._native.ptr, old.ptr)
        cap = _round_region(nbytes)
        r = _Region(self._alloc_region(cap), cap)
        self._ctx_all.add(r)
        return r

    def _ctx_release(self, r):
        if r in self._ctx_all:
            self._ctx_free.append(r)

    def _wait(self, ticket, region=None):
        """Wait for a job in slices, so that Ctrl-C (signals) get through. If the
        wait is interrupted, the job stays recorded and the next job of this
        client waits for it first: staging and ctx memory are never reused
        while mokd may still touch them."""
        L = _lib.lib()
        try:
            while True:
                st = L.mok_wait(self._native.ptr, ticket, 200)  # releases the GIL
                if st != _lib.STATUS_CODES["ETIMEOUT"]:
                    break
                if not L.mok_job_pending(self._native.ptr, ticket):
                    break  # the job itself timed out (e.g. a group peer never came)
        except BaseException:
            self._abandoned.append((ticket, region))
            raise
        if st:
            _raise(st)

    def _service(self):
        """Work queued by finalizers (which take no locks), and jobs whose wait
        was interrupted; the lock is held."""
        while self._abandoned:
            ticket, region = self._abandoned[0]
            while _lib.lib().mok_wait(self._native.ptr, ticket, 200) == \
                    _lib.STATUS_CODES["ETIMEOUT"] and \
                    _lib.lib().mok_job_pending(self._native.ptr, ticket):
                pass  # interruptible: on Ctrl-C the job stays first in the list
            self._abandoned.pop(0)
            if region is not None:
                self._ctx_release(region)
        while self._ctx_returned:
            self._ctx_release(self._ctx_returned.popleft())
        while self._dead_layers:
            holder = self._dead_layers.popleft()
            if holder[0]:
                _lib.lib().mok_layer_destroy(holder[0])
                holder[0] = None

    # ---- layers ----
    def layer(self, hidden: int, intermediate: int, experts: int, topk: int,
              shared_intermediate: int = 0, dtype: DType = "float32",
              swiglu_limit: Optional[float] = None, group: Optional[Group] = None,
              max_tokens: Optional[int] = None, group_tag: int = 0) -> Layer:
        """A layer (docs/design.md#the-layer, docs/math.md). max_tokens=None: the layer starts at
        DEFAULT_MAX_TOKENS and re-creates itself larger (next power of two)
        when a job brings more tokens; an explicit max_tokens is a hard limit
        (a larger job raises ELIMIT).

        group: a Group from c.group(...): the layer holds this rank's
        experts/world local experts (weights [E_loc, ...]) and its forward and
        backward exchange tokens with the other ranks (docs/ep.md);
        max_tokens defaults to the group's. group_tag names the layer in the
        group's job signature (give each layer of a model its own)."""
        if group is not None:
            if not isinstance(group, Group) or group.client is not self:
                raise Error("EINVAL", "group must be a mok.Group joined through this client")
            if max_tokens is None:
                max_tokens = group.max_tokens
        return Layer(self, hidden, intermediate, experts, topk, shared_intermediate, dtype,
                     swiglu_limit, max_tokens, group, group_tag)

    def layer_cost(self, hidden: int, intermediate: int, experts: int, topk: int,
                   shared_intermediate: int = 0, dtype: DType = "float32",
                   swiglu_limit: Optional[float] = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                   group: Optional[Group] = None, group_tag: int = 0) -> Dict[str, int]:
        """What a layer of this description would cost at max_tokens, before
        creating it (mokd checks it as it would a layer; nothing is created and
        no quota is used). A dict: layer_bytes (daemon memory the layer keeps),
        workspace_bytes (the session's workspace a job needs, shared by its
        layers), ctx_bytes (the client memory a forward's saved context takes:
        Layer.ctx_bytes(max_tokens)), row_align, local_experts, first_expert.
        An engine that does not account its memory reports 0 bytes there."""
        if group is not None and (not isinstance(group, Group) or group.client is not self):
            raise Error("EINVAL", "group must be a mok.Group joined through this client")
        if group is not None and not group._ptr:
            raise Error("ECLOSED", "the group was left")
        code = _dtype_code(dtype)
        if swiglu_limit is not None:
            try:
                swiglu_limit = float(swiglu_limit)
            except (TypeError, ValueError):
                raise Error("EINVAL", "swiglu_limit must be a number or None, got %r" %
                            (swiglu_limit,))
        d = _lib.LayerDesc(hidden=_dim("hidden", hidden),
                           intermediate=_dim("intermediate", intermediate),
                           experts=_dim("experts", experts), topk=_dim("topk", topk),
                           shared_intermediate=_dim("shared_intermediate", shared_intermediate, 0),
                           max_tokens=_dim("max_tokens", max_tokens), dtype=code,
                           has_swiglu_limit=int(swiglu_limit is not None),
                           swiglu_limit=swiglu_limit or 0.0,
                           group=group._ptr if group is not None else None,
                           group_tag=_dim("group_tag", group_tag, 0))
        info = _lib.LayerCostInfo()
        with self._lock:
            self._check_open()
            st = _lib.lib().mok_layer_cost(self._native.ptr, byref(d), byref(info))
        if st:
            _raise(st)
        return {f[0]: int(getattr(info, f[0])) for f in _lib.LayerCostInfo._fields_}

    # ---- expert-parallel groups ----
    def nccl_id(self) -> bytes:
        """A fresh NCCL unique id (128 bytes) for group(..., nccl_id=): ask rank
        0's mokd (the cuda engine) and hand the bytes to every rank."""
        buf = ctypes.create_string_buffer(_lib.NCCL_ID_BYTES)
        with self._lock:
            self._check_open()
            st = _lib.lib().mok_group_nccl_id(self._native.ptr, buf)
        if st:
            _raise(st)
        return buf.raw

    def group(self, key: str, rank: int, world: int, max_tokens: int, hidden: int, topk: int,
              experts: int, dtype: DType = "float32", timeout_ms: int = 0,
              capacity: float = 0.0, ring_rows: int = 0,
              nccl_id: Optional[bytes] = None) -> Group:
        """Join rank `rank` of the expert-parallel group `key` (docs/ep.md).
        Every rank joins through its own mokd with the same sizing; joining a
        group the daemon still holds (a restarted trainer) is cheap.
        capacity: the share of all routes one rank's experts may receive, in
        (0, 1] (0: all; a job needing more fails with EOVERFLOW); ring_rows:
        rows of the daemon's routed buffers (0: one pass). nccl_id: the bytes of
        nccl_id() on rank 0 to form the group through NCCL (ranks on distinct
        GPUs); None: the ranks' mokds share this host."""
        return Group(self, key, rank, world, max_tokens, hidden, topk, experts, dtype,
                     timeout_ms, capacity, ring_rows, nccl_id)


def _dtype_code(dtype):
    if isinstance(dtype, str):
        d = dtype.lower()
        if d in ("float32", "f32", "fp32"):
            return _lib.DTYPE_F32
        if d in ("bfloat16", "bf16"):
            return _lib.DTYPE_BF16
        if d in ("fp8", "float8_e4m3fn", "e4m3"):
            return _lib.DTYPE_FP8_E4M3
    else:
        try:
            d = np.dtype(dtype)
        except TypeError:
            d = None
        if d == np.float32:
            return _lib.DTYPE_F32
        if d is not None and d.name == "bfloat16":
            return _lib.DTYPE_BF16
        if d is not None and d.name == "float8_e4m3fn":
            return _lib.DTYPE_FP8_E4M3
    raise Error("EINVAL", "dtype must be \"float32\", \"bfloat16\" or \"fp8\" (float8_e4m3fn), "
                "got %r" % (dtype,))


def _dim(name, v, lo=1):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < lo or v >= 1 << 32:
        raise Error("EINVAL", "%s must be an integer >= %d, got %r" % (name, lo, v))
    return int(v)


def _nccl_id(v):
    if v is None:
        return None
    if not isinstance(v, (bytes, bytearray)) or len(v) != _lib.NCCL_ID_BYTES:
        raise Error("EINVAL", "nccl_id must be the %d bytes of Client.nccl_id(), got %r"
                    % (_lib.NCCL_ID_BYTES, type(v).__name__))
    return bytes(v)


def _capacity(v):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(v) <= 1.0:
        raise Error("EINVAL", "capacity must be a number in (0, 1], or 0 for all routes; got %r"
                    % (v,))
    return float(v)


def _out_map(out, names, op):
    """out= as a dict {slot: array}: one array, a dict, or a (named)tuple."""
    if out is None:
        return {}
    if isinstance(out, np.ndarray) or _is_torch_cuda(out):
        if len(names) != 1:
            raise Error("EINVAL", "%s: out= must name its arrays (%s)" % (op, ", ".join(names)))
        return {names[0]: out}
    if isinstance(out, dict):
        d = dict(out)
    elif isinstance(out, tuple) and hasattr(out, "_fields"):
        d = dict(zip(out._fields, out))
    elif isinstance(out, (tuple, list)) and len(out) == len(names):
        d = dict(zip(names, out))
    else:
        raise Error("EINVAL", "%s: out= takes an array, a dict or a tuple of %s" %
                    (op, ", ".join(names)))
    bad = [k for k, v in d.items() if v is not None and k not in names]
    if bad:
        raise Error("EINVAL", "%s: out= names %s, not outputs of this job (%s)" %
                    (op, ", ".join(bad), ", ".join(names)))
    return {k: v for k, v in d.items() if v is not None}


class Context:
    """What forward saved for backward (opaque). Saved mode: the schedule and
    activations (ctx_bytes of them, in a mok-memory region) plus references
    to x, router_weights and the weights. Recompute mode: references to the
    inputs only; backward rebuilds the saved part with MOK_JOB_RECOMPUTE.
    The references are not copies: change those arrays in place between
    forward and backward and backward sees the change."""

    layer: Layer
    tokens: int
    recompute: bool

    def __init__(self, layer: Layer, tokens: int, recompute: bool, inputs: Optional[dict],
                 region: Any) -> None:
        self.layer = layer
        self.tokens = tokens
        self.recompute = recompute
        self._inputs = inputs
        self._region = region
        self._fin = (weakref.finalize(self, layer.client._ctx_returned.append, region)
                     if isinstance(region, _Region) else None)

    @property
    def nbytes(self) -> int:
        """Bytes saved in mok memory (0 in recompute mode)."""
        return 0 if self.recompute else self.layer.ctx_bytes(self.tokens)

    @property
    def released(self) -> bool:
        return self._inputs is None

    def release(self) -> None:
        """Give the saved memory back now (backward does this unless retain_ctx)."""
        self._inputs = None
        if self._fin is not None:
            self._fin()  # hands the region back to the client's pool
        self._region = None

    def saved(self) -> Optional[np.ndarray]:
        """A copy of the saved bytes (uint8 [ctx_bytes]); None in recompute mode."""
        if self.recompute:
            return None
        if _is_torch_cuda(self._region):
            return self._region.cpu().numpy()
        c = self.layer.client
        with c._lock:
            c._check_open()
            if self._region is None:
                raise Error("EINVAL", "this ctx was released")
            return self._region.u8[:self.nbytes].copy()

    def __repr__(self) -> str:
        return "<mok.Context T=%d %s%s>" % (self.tokens, "recompute" if self.recompute else
                                             "saved %d bytes" % self.nbytes,
                                             " released" if self.released else "")


class Group:
    """An expert-parallel group this client joined (see Client.group)."""

    client: Client
    key: str
    rank: int
    world: int
    max_tokens: int
    local_experts: int
    first_expert: int
    generation: int
    rejoined: bool

    def __init__(self, client: Client, key: str, rank: int, world: int, max_tokens: int,
                 hidden: int, topk: int, experts: int, dtype: DType, timeout_ms: int,
                 capacity: float = 0.0, ring_rows: int = 0,
                 nccl_id: Optional[bytes] = None) -> None:
        self.client = client
        self.key = str(key)
        self.rank = _dim("rank", rank, 0)
        self.world = _dim("world", world)
        self.max_tokens = _dim("max_tokens", max_tokens)
        self.dtype = dtype
        sz = _lib.GroupSizing(max_tokens=self.max_tokens, hidden=_dim("hidden", hidden),
                              topk=_dim("topk", topk), experts=_dim("experts", experts),
                              dtype=_dtype_code(dtype), timeout_ms=_dim("timeout_ms",
                                                                        timeout_ms, 0),
                              capacity=_capacity(capacity),
                              ring_rows=_dim("ring_rows", ring_rows, 0),
                              nccl_id=_nccl_id(nccl_id))
        L = _lib.lib()
        h = c_void_p()
        with client._lock:
            client._check_open()
            st = L.mok_group_join(client._native.ptr, self.key.encode(), self.rank, self.world,
                                  byref(sz), byref(h))
            if st:
                _raise(st)
            self._ptr = h.value
            client._groups.add(self)
        self.local_experts = int(L.mok_group_local_experts(self._ptr))
        self.first_expert = int(L.mok_group_first_expert(self._ptr))
        self.generation = int(L.mok_group_generation(self._ptr))
        self.rejoined = bool(L.mok_group_rejoined(self._ptr))

    def leave(self) -> None:
        """Leave the group: the daemon releases it at once when no session
        holds it (closing the client instead keeps it warm for a restart)."""
        with self.client._lock:
            if self._ptr:
                st = _lib.lib().mok_group_leave(self._ptr)
                self._ptr = None
                if st:
                    _raise(st)

    def __repr__(self) -> str:
        return "<mok.Group %r rank %d/%d E_loc=%d generation %d%s>" % (
            self.key, self.rank, self.world, self.local_experts, self.generation,
            "" if self._ptr else " (left)")


class Layer:
    """A MoE layer on mokd (see Client.layer). Arrays are numpy, host memory."""

    client: Client
    group: Optional[Group]
    hidden: int
    intermediate: int
    experts: int
    topk: int
    shared_intermediate: int
    dtype: str
    swiglu_limit: Optional[float]
    max_tokens: int
    row_align: int
    local_experts: int

    def __init__(self, client: Client, hidden: int, intermediate: int, experts: int, topk: int,
                 shared_intermediate: int, dtype: DType, swiglu_limit: Optional[float],
                 max_tokens: Optional[int], group: Optional[Group] = None,
                 group_tag: int = 0) -> None:
        self.client = client
        self.group = group
        self.group_tag = _dim("group_tag", group_tag, 0)
        if group is not None and not group._ptr:
            raise Error("ECLOSED", "the group was left")
        self.hidden = _dim("hidden", hidden)
        self.intermediate = _dim("intermediate", intermediate)
        self.experts = _dim("experts", experts)
        self.topk = _dim("topk", topk)
        self.shared_intermediate = _dim("shared_intermediate", shared_intermediate, 0)
        self._dtype_code = _dtype_code(dtype)
        self.dtype = _LAYER_DTYPE_NAME[self._dtype_code]
        # an fp8 layer's activations and gradients are bfloat16 (docs/math.md, "FP8")
        self.np_dtype = _NP_OF_CODE[_lib.DTYPE_BF16 if self._dtype_code == _lib.DTYPE_FP8_E4M3
                                    else self._dtype_code]
        if swiglu_limit is not None:
            try:
                swiglu_limit = float(swiglu_limit)
            except (TypeError, ValueError):
                raise Error("EINVAL", "swiglu_limit must be a number or None, got %r" %
                            (swiglu_limit,))
        self.swiglu_limit = swiglu_limit
        self._auto_grow = max_tokens is None and group is None
        self.max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else _dim("max_tokens",
                                                                             max_tokens)
        self._holder = [None]
        self._shapes: Dict[Tuple[int, str], Tuple[int, Tuple[int, ...]]] = {}
        with client._lock:
            client._check_open()
            client._service()
            self._holder[0] = self._create(self.max_tokens)
            client._layers.add(self)
        self._fin = weakref.finalize(self, client._dead_layers.append, self._holder)
        L = _lib.lib()
        self.row_align = int(L.mok_layer_row_align(self._holder[0]))
        self.local_experts = int(L.mok_layer_local_experts(self._holder[0]))

    def _create(self, max_tokens):
        d = _lib.LayerDesc(hidden=self.hidden, intermediate=self.intermediate,
                           experts=self.experts, topk=self.topk,
                           shared_intermediate=self.shared_intermediate, max_tokens=max_tokens,
                           dtype=self._dtype_code,
                           has_swiglu_limit=int(self.swiglu_limit is not None),
                           swiglu_limit=self.swiglu_limit or 0.0,
                           group=self.group._ptr if self.group is not None else None,
                           group_tag=self.group_tag)
        h = c_void_p()
        st = _lib.lib().mok_layer_create(self.client._native.ptr, byref(d), byref(h))
        if st:
            _raise(st)
        return h.value

    def _destroy_locked(self):
        if self._holder[0]:
            _lib.lib().mok_layer_destroy(self._holder[0])
            self._holder[0] = None

    def close(self) -> None:
        """Destroy the layer in mokd (also done by the client's close)."""
        with self.client._lock:
            self._destroy_locked()

    def __repr__(self) -> str:
        return ("<mok.Layer H=%d I=%d E=%d K=%d I_s=%d %s%s max_tokens=%d>" % (
            self.hidden, self.intermediate, self.experts, self.topk, self.shared_intermediate,
            self.dtype, "" if self.swiglu_limit is None else " limit=%g" % self.swiglu_limit,
            self.max_tokens))

    @property
    def shared(self) -> bool:
        return self.shared_intermediate > 0

    # ---- sizes (docs/math.md) ----
    def _h(self):
        h = self._holder[0]
        if not h:
            raise Error("ECLOSED", "this layer is destroyed" if not self.client.closed else
                        "this layer's client is closed")
        return h

    def ctx_bytes(self, tokens: int) -> int:
        return int(_lib.lib().mok_layer_ctx_bytes(self._h(), tokens))

    def acts_bytes(self, tokens: int) -> int:
        return int(_lib.lib().mok_layer_acts_bytes(self._h(), tokens))

    def schedule_ints(self, tokens: int) -> int:
        return int(_lib.lib().mok_layer_schedule_ints(self._h(), tokens))

    def rows_capacity(self, tokens: int) -> int:
        return int(_lib.lib().mok_layer_rows_capacity(self._h(), tokens))

    # ---- fp8 layers: packed weights (docs/math.md, "FP8 (e4m3, block-scaled)") ----
    def packed_weight_bytes(self, slot: str) -> int:
        """The bytes of weight slot's packed e4m3 form on an fp8 layer (what its jobs take in
        that slot); 0 on other layers."""
        return int(_lib.lib().mok_layer_packed_weight_bytes(self._h(), SLOT[slot]))

    def packed_weights_bytes(self) -> int:
        """The bytes of the packed-weights tensor of a quantising forward (forward_quantized,
        a standing forward with JOB_QUANTIZE_WEIGHTS) on an fp8 layer: every weight's packed
        form, at packed_weights_offset(slot); 0 on other layers."""
        return int(_lib.lib().mok_layer_packed_weights_bytes(self._h()))

    def packed_weights_offset(self, slot: str) -> int:
        """Where weight slot's packed form starts in that tensor (w_gate, w_up, w_down, then
        the shared expert's, each from a 256-byte boundary)."""
        at = int(_lib.lib().mok_layer_packed_weights_offset(self._h(), SLOT[slot]))
        if at == 2 ** 64 - 1:
            raise Error("EINVAL", "%s is not a weight of this fp8 layer" % slot)
        return at

    def packed_views(self, packed: Any) -> Dict[str, Any]:
        """{weight slot: the packed form inside packed} (views, no copies; numpy or torch):
        what a backward takes in its weight slots after a quantising forward."""
        return {n: packed[self.packed_weights_offset(n):
                          self.packed_weights_offset(n) + self.packed_weight_bytes(n)]
                for n in _WEIGHT_SLOTS if self.shared or not n.startswith("s_")}

    def _master_shape(self, slot):
        H, I, E, Is = self.hidden, self.intermediate, self.local_experts, self.shared_intermediate
        return {"w_gate": (E, I, H), "w_up": (E, I, H), "w_down": (E, H, I),
                "s_gate": (Is, H), "s_up": (Is, H), "s_down": (H, Is)}[slot]

    def quantize_weight(self, slot: str, weight: Any, out: Optional[np.ndarray] = None
                        ) -> np.ndarray:
        """An fp8 layer's quantize_weight job: weight (bfloat16, the shape a bfloat16 layer
        takes in slot) in its packed form, a uint8 array of packed_weight_bytes(slot) bytes
        (written into out when given), for the weight slot of this layer's jobs. Run it again
        whenever the weight changed."""
        n = self.packed_weight_bytes(slot) if slot in _WEIGHT_SLOTS else 0
        if n == 0:
            raise Error("EINVAL", "quantize_weight: %s is not a weight of an fp8 layer (this "
                        "layer is %s%s)" % (slot, self.dtype, "" if self.shared else
                                            ", without a shared expert"))
        if _is_torch_cuda(weight):
            return self._quantize_weight_cuda(slot, weight, out, n)
        _check_torch(slot, weight)
        w = np.asarray(weight)
        if is_bf16(w.dtype):
            w = w.view(np.uint16)
        shape = self._master_shape(slot)
        if w.dtype != np.uint16 or w.shape != shape:
            raise Error("ESHAPE", "quantize_weight: %s must be bfloat16 of shape %s, got %s %s"
                        % (slot, shape, w.dtype, tuple(w.shape)))
        if out is not None and not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and
                                    out.shape == (n,) and out.flags.writeable):
            raise Error("ESHAPE", "quantize_weight: out must be a writable uint8 array of %d "
                        "bytes, got %s" % (n, _describe(out)))
        c, L = self.client, _lib.lib()
        with c._lock:
            c._check_open()
            c._service()
            h = self._h()
            wp = c._in_mok_memory(w)
            if wp is None:
                r = c._stage(slot, max(w.nbytes, 1))
                np.copyto(r.view(np.uint16, shape), w)
                wp = r.ptr
            op = c._in_mok_memory(out, writable=True) if out is not None else None
            view = None
            if op is None:
                r = c._stage("packed_weight", n)
                view, op = r.view(np.uint8, (n,)), r.ptr
            ticket = c_uint64()
            st = L.mok_quantize_weight(h, SLOT[slot], wp, op, byref(ticket))
            if st:
                _raise(st)
            c._wait(ticket.value, None)
            if view is None:
                return out
            if out is not None:
                np.copyto(out, view)
                return out
            return view.copy()

    def _quantize_weight_cuda(self, slot, w, out, n):
        """quantize_weight of a torch CUDA bf16 weight into out (a torch CUDA uint8 tensor of
        n bytes, allocated when None). The job is ordered by its ticket, not by a stream:
        the current stream is synchronised first (the weight's last writes land before
        mokd reads it) and the call returns once the packed bytes are written."""
        import torch
        shape = self._master_shape(slot)
        if w.dtype != torch.bfloat16 or tuple(w.shape) != shape or not w.is_contiguous() or \
                w.data_ptr() % 16:
            raise Error("ESHAPE", "quantize_weight: %s must be a contiguous bfloat16 tensor of "
                        "shape %s at a multiple of 16 bytes, got %s %s" %
                        (slot, shape, w.dtype, tuple(w.shape)))
        if out is None:
            out = torch.empty(n, dtype=torch.uint8, device=w.device)
        elif not (_is_torch_cuda(out) and out.dtype == torch.uint8 and tuple(out.shape) == (n,)
                  and out.is_contiguous() and out.data_ptr() % 16 == 0):
            raise Error("ESHAPE", "quantize_weight: out must be a contiguous CUDA uint8 tensor "
                        "of %d bytes at a multiple of 16 bytes, got %s" % (n, _describe(out)))
        torch.cuda.current_stream(w.device).synchronize()
        c, L = self.client, _lib.lib()
        with c._lock:
            c._check_open()
            c._service()
            h = self._h()
            ticket = c_uint64()
            st = L.mok_quantize_weight(h, SLOT[slot], c_void_p(w.data_ptr()),
                                       c_void_p(out.data_ptr()), byref(ticket))
            if st:
                _raise(st)
            c._wait(ticket.value, None)
        return out

    def standing(self, op: str, T: int, tensors: Mapping[str, Any], flags: int = 0,
                 hold: bool = True) -> "Standing":
        """A standing job (mok/_standing.py): op "forward" or "backward" at T tokens with
        every tensor fixed (a dict slot name -> torch CUDA tensor or shared numpy array)."""
        return Standing(self, op, T, tensors, flags, hold)

    def _expect(self, T, slot, op=None, flags=0):
        """(dtype code, shape) of slot at T; a quantising forward (flags) has its own."""
        flags &= JOB_QUANTIZE_WEIGHTS  # the only flag that changes shapes
        key = (T, slot, op if flags else None, flags)
        e = self._shapes.get(key)
        if e is None:
            if flags:
                t = _lib.lib().mok_tensor_for_job(self._h(), OP[op], flags, T, SLOT[slot], None)
            else:
                t = _lib.lib().mok_tensor_for(self._h(), T, SLOT[slot], None)
            e = (t.dtype, tuple(int(t.shape[i]) for i in range(t.ndim)))
            if len(self._shapes) > 4096:
                self._shapes.clear()
            self._shapes[key] = e
        return e

    def _ensure_tokens(self, T):
        if T <= self.max_tokens:
            return
        if not self._auto_grow or T > _MAX_TOKENS_LIMIT:
            raise Error("ELIMIT", "%d tokens exceed this layer's max_tokens %d (create the "
                        "layer with a larger max_tokens, or max_tokens=None to let it grow)" %
                        (T, self.max_tokens if not self._auto_grow else _MAX_TOKENS_LIMIT))
        new = min(_MAX_TOKENS_LIMIT, 1 << (T - 1).bit_length())
        h = self._create(new)
        self._destroy_locked()
        self._holder[0] = h
        self.max_tokens = new

    # ---- argument checks ----
    def _array(self, op, slot, a, T, check, flags=0):
        """a as a numpy array of the slot's dtype and shape (a view, no copy)."""
        _check_torch(slot, a)
        if not isinstance(a, np.ndarray):
            a = np.asarray(a)
        if is_bf16(a.dtype):
            a = a.view(np.uint16)
        if not check:
            return a
        code, shape = self._expect(T, slot, op, flags)
        want = _NP_OF_CODE[code]
        if a.dtype != want:
            hint = ""
            if code == _lib.DTYPE_BF16 and a.dtype.kind == "f":
                hint = "; convert with mok.to_bf16(%s)" % slot
            elif code == _lib.DTYPE_F32 and a.dtype == np.uint16:
                hint = "; this is a float32 layer (mok.from_bf16 widens bfloat16 bits)"
            elif code in (_lib.DTYPE_F32, _lib.DTYPE_I32) and a.dtype.kind in "fiu":
                hint = "; pass %s.astype(np.%s)" % (slot, want.name)
            raise Error("ESHAPE", "%s: %s has dtype %s, the %s layer expects %s%s" % (
                op, slot, a.dtype, self.dtype, _CODE_NAME[code], hint))
        if a.shape != shape:
            raise Error("ESHAPE", "%s: %s has shape %s, expected %s = %s (%s)" % (
                op, slot, tuple(a.shape), shape, _SLOT_DIMS.get(slot, "?"), self._dims_text(T)))
        return a

    def _dims_text(self, T):
        s = "T=%d H=%d I=%d E_loc=%d K=%d" % (T, self.hidden, self.intermediate,
                                              self.local_experts, self.topk)
        if self.shared:
            s += " I_s=%d" % self.shared_intermediate
        return s

    def _tokens_of(self, op, slot, a):
        if not _is_torch_cuda(a):
            _check_torch(slot, a)
        shape = tuple(a.shape) if _is_torch_cuda(a) else np.shape(a)
        if len(shape) != 2 or shape[0] < 1:
            raise Error("ESHAPE", "%s: %s must be 2-d %s with T >= 1 tokens, got shape %s" % (
                op, slot, _SLOT_DIMS[slot], tuple(shape)))
        return int(shape[0])

    def _tokens_of_schedule(self, op, schedule):
        if not _is_torch_cuda(schedule):
            _check_torch("schedule", schedule)
        shape = tuple(schedule.shape) if _is_torch_cuda(schedule) else np.shape(schedule)
        if len(shape) != 1:
            raise Error("ESHAPE", "%s: schedule must be the 1-d int32 array dispatch returned, "
                        "got shape %s" % (op, tuple(shape)))
        n = int(shape[0])
        base = self.schedule_ints(0)
        per = self.schedule_ints(1) - base
        T = (n - base) // per if per > 0 else 0
        if T < 1 or base + T * per != n:
            raise Error("ESHAPE", "%s: a schedule of %d ints fits no token count of this layer "
                        "(%d + %d per token); pass the schedule dispatch returned" %
                        (op, n, base, per))
        return T

    def _shared_args(self, op, **kw):
        given = {k: v for k, v in kw.items() if v is not None}
        if self.shared:
            missing = [k for k in kw if kw[k] is None]
            if missing:
                raise Error("EINVAL", "%s: this layer has a shared expert (shared_intermediate="
                            "%d): pass %s" % (op, self.shared_intermediate, ", ".join(missing)))
            return given
        if given:
            raise Error("EINVAL", "%s: this layer has no shared expert (shared_intermediate=0) "
                        "but %s was given" % (op, ", ".join(given)))
        return {}

    # ---- the job runner ----
    def _job(self, op, T, ins, outs, out=None, flags=0, ctx=None, check=True):
        """Run one job. ins: {slot: array or None}; outs: output slot names;
        out: {slot: user array}; ctx: None, "save" (a pool region, returned),
        "scratch" (a pool region for the job only) or a _Region to read.
        Returns ({slot: array}, saved ctx region or None)."""
        c = self.client
        L = _lib.lib()
        out = out or {}
        if any(_is_torch_cuda(a) for a in ins.values()) or \
                any(_is_torch_cuda(a) for a in out.values()) or _is_torch_cuda(ctx):
            return self._job_torch(op, T, ins, outs, out, flags, ctx)
        with c._lock:
            c._check_open()
            c._service()
            self._h()
            self._ensure_tokens(T)
            tensors = TensorArray()
            hold = []

            def put(slot, ptr, code, shape):
                t = tensors[SLOT[slot]]
                t.data = ptr
                t.dtype = code
                t.ndim = len(shape)
                for i, s in enumerate(shape):
                    t.shape[i] = s

            for slot, a in ins.items():
                if a is None:
                    continue
                a = self._array(op, slot, a, T, check, flags)
                hold.append(a)
                ptr = c._in_mok_memory(a)
                if ptr is None:
                    r = c._stage(slot, max(a.nbytes, 1))
                    np.copyto(r.view(a.dtype, a.shape), a)
                    ptr = r.ptr
                code = (self._expect(T, slot, op, flags)[0] if check else
                        {np.dtype(v): k for k, v in _NP_OF_CODE.items()}.get(a.dtype, 0))
                put(slot, ptr, code, a.shape)
            results = {}
            for slot in outs:
                code, shape = self._expect(T, slot, op, flags)
                dt = _NP_OF_CODE[code]
                user = out.get(slot)
                bits = None  # user as the slot's dtype (bfloat16: its uint16 view)
                ptr = None
                if user is not None:
                    if isinstance(user, np.ndarray) and code == _lib.DTYPE_BF16 and \
                            is_bf16(user.dtype):
                        bits = user.view(np.uint16)
                    elif isinstance(user, np.ndarray):
                        bits = user
                    if bits is None or bits.dtype != dt or bits.shape != shape or \
                            not bits.flags.writeable:
                        raise Error("ESHAPE", "%s: out %s must be a writable %s array of shape "
                                    "%s, got %s" % (op, slot, _CODE_NAME[code], shape,
                                                    _describe(user)))
                    ptr = c._in_mok_memory(bits, writable=True)
                if ptr is not None:
                    results[slot] = (user, bits, None, code)
                else:
                    r = c._stage(slot, max(int(np.prod(shape, dtype=np.int64)) * dt.itemsize, 1))
                    view = r.view(dt, shape)
                    ptr = r.ptr
                    results[slot] = (user, bits, view, code)
                put(slot, ptr, code, shape)
            region = None
            if ctx is not None:
                if isinstance(ctx, _Region):
                    region = ctx
                else:
                    region = c._ctx_acquire(self.ctx_bytes(T))
                code, shape = self._expect(T, "ctx")
                put("ctx", region.ptr, code, shape)
            ticket = c_uint64()
            st = L.mok_submit(self._h(), OP[op], flags, T, tensors, byref(ticket))
            if st:
                if ctx in ("save", "scratch"):
                    c._ctx_release(region)
                _raise(st)
            try:
                c._wait(ticket.value, region if ctx in ("save", "scratch") else None)
            except Error:
                if ctx in ("save", "scratch"):
                    c._ctx_release(region)
                raise
            if ctx == "scratch":
                c._ctx_release(region)
            ret = {}
            for slot, (user, bits, view, code) in results.items():
                if view is None:
                    ret[slot] = user
                elif user is not None:
                    np.copyto(bits, view)
                    ret[slot] = user
                elif code == _lib.DTYPE_BF16:
                    ret[slot] = view.copy().view(bf16_dtype())  # ml_dtypes, else uint16
                else:
                    ret[slot] = view.copy()
            return ret, (region if ctx == "save" else None)

    def _job_torch(self, op, T, ins, outs, out, flags, ctx):
        """The torch path: every tensor a torch CUDA tensor, named in place (its
        allocation registered once by libmok), the job ordered on the current
        torch stream with GPU fences: returns at once, like a torch op. Outputs
        are new tensors (or out=). A failure shows at the next call (or at
        client.synchronize())."""
        c = self.client
        if c.engine != "cuda":
            raise Error("EUNSUPPORTED", "%s: torch CUDA tensors need the cuda engine (this mokd "
                        "runs the %s engine); pass numpy arrays (t.detach().cpu().numpy())" %
                        (op, c.engine))
        try:
            import torch
        except ImportError as e:
            raise Error("EUNSUPPORTED", "%s: torch CUDA tensors need torch: %s" % (op, e))
        L = _lib.lib()
        with c._lock:
            c._check_open()
            c._service()
            self._h()
            if T > self.max_tokens:
                raise Error("ELIMIT", "%s: %d tokens exceed max_tokens %d; the torch path does "
                            "not re-create layers: create the layer with max_tokens >= %d" %
                            (op, T, self.max_tokens, T))
            c._check_async()
            tensors = TensorArray()
            device = None

            def put(slot, t):
                code, shape = self._expect(T, slot, op, flags)
                want = _torch_dtype(code)
                if not _is_torch_cuda(t):
                    raise Error("EINVAL", "%s: %s must be a torch CUDA tensor like the other "
                                "arguments, got %s" % (op, slot, type(t).__name__))
                if t.dtype != want or tuple(t.shape) != shape or not t.is_contiguous():
                    raise Error("ESHAPE", "%s: %s must be a contiguous %s tensor of shape %s = "
                                "%s, got %s %s" % (op, slot, want, shape,
                                                   _SLOT_DIMS.get(slot, "?"), t.dtype,
                                                   tuple(t.shape)))
                s = tensors[SLOT[slot]]
                s.data = t.data_ptr()
                s.dtype = code
                s.ndim = len(shape)
                for i, d in enumerate(shape):
                    s.shape[i] = d
                return t

            def stage(t):
                # mokd's cuda engine takes tensors at multiples of 16 bytes only: a view at
                # another offset goes through an aligned copy on the current stream
                if _is_torch_cuda(t) and t.data_ptr() % 16:
                    return t.clone(memory_format=torch.contiguous_format)
                return t

            hold = []
            for slot, a in ins.items():
                if a is None:
                    continue
                hold.append(put(slot, stage(a)))
                device = device or a.device
            results = {}
            copy_back = []
            for slot in outs:
                code, shape = self._expect(T, slot, op, flags)
                t = out.get(slot)
                if t is None:
                    t = torch.empty(shape, dtype=_torch_dtype(code), device=device)
                elif _is_torch_cuda(t) and t.data_ptr() % 16:
                    put(slot, t)  # the checks of a user's out tensor, then a staging copy
                    copy_back.append((t, slot))
                    t = torch.empty(shape, dtype=t.dtype, device=t.device)
                results[slot] = put(slot, t)
            saved = None
            if isinstance(ctx, str):  # "save", or "scratch" (recompute rebuilds it there)
                saved = torch.empty(self.ctx_bytes(T), dtype=torch.uint8, device=device)
                put("ctx", saved)
            elif _is_torch_cuda(ctx):
                put("ctx", ctx)
            stream = torch.cuda.current_stream(device).cuda_stream
            st = L.mok_submit_on_stream(self._h(), OP[op], flags, T, tensors,
                                        c_void_p(stream), None)
            if st:
                _raise(st)
            for user, slot in copy_back:  # after the job, on the same stream
                user.copy_(results[slot])
                results[slot] = user
            return results, (saved if isinstance(ctx, str) and ctx == "save" else None)

    # ---- the whole layer ----
    def forward(self, x: TensorLike, topk_ids: TensorLike, router_weights: TensorLike,
                w_gate: TensorLike, w_up: TensorLike, w_down: TensorLike,
                s_gate: Optional[TensorLike] = None, s_up: Optional[TensorLike] = None,
                s_down: Optional[TensorLike] = None, recompute: bool = False,
                out: Optional[Out] = None) -> Tuple[Result, Context]:
        """out [T,H], ctx. recompute=True saves nothing in mok memory: ctx keeps
        references to the inputs and backward rebuilds the activations."""
        op = "forward"
        T = self._tokens_of(op, "x", x)
        shared = self._shared_args(op, s_gate=s_gate, s_up=s_up, s_down=s_down)
        ins = dict(x=x, topk_ids=topk_ids, router_weights=router_weights, w_gate=w_gate,
                   w_up=w_up, w_down=w_down, **shared)
        res, region = self._job(op, T, ins, ["out"], _out_map(out, ["out"], op),
                                ctx=None if recompute else "save")
        keep = dict(ins)
        if not recompute:
            del keep["topk_ids"]  # the schedule in ctx replaces it
        return res["out"], Context(self, T, bool(recompute), keep, region)

    def forward_quantized(self, x: TensorLike, topk_ids: TensorLike, router_weights: TensorLike,
                          w_gate: TensorLike, w_up: TensorLike, w_down: TensorLike,
                          s_gate: Optional[TensorLike] = None, s_up: Optional[TensorLike] = None,
                          s_down: Optional[TensorLike] = None, recompute: bool = False,
                          out: Optional[Out] = None, packed: Optional[Any] = None
                          ) -> Tuple[Result, Context, Any]:
        """An fp8 layer's forward from the bf16 masters (w_gate .. s_down, as quantize_weight
        takes them): one job that writes every weight's packed form into packed (uint8 of
        packed_weights_bytes(); allocated when None), the bytes quantize_weight would, then
        runs the forward on them. Returns (out, ctx, packed); ctx's backward takes the
        packed forms inside packed (packed_views), so keep packed unchanged until then."""
        op = "forward"
        if self.packed_weights_bytes() == 0:
            raise Error("EINVAL", "forward_quantized: this is a %s layer; it quantises fp8 "
                        "layers' weights" % self.dtype)
        T = self._tokens_of(op, "x", x)
        shared = self._shared_args(op, s_gate=s_gate, s_up=s_up, s_down=s_down)
        ins = dict(x=x, topk_ids=topk_ids, router_weights=router_weights, w_gate=w_gate,
                   w_up=w_up, w_down=w_down, **shared)
        outs = _out_map(out, ["out"], op)
        if packed is not None:
            outs["packed_weight"] = packed
        res, region = self._job(op, T, ins, ["out", "packed_weight"], outs,
                                flags=JOB_QUANTIZE_WEIGHTS, ctx=None if recompute else "save")
        packed = res["packed_weight"]
        keep = dict(ins, **self.packed_views(packed))
        if not recompute:
            del keep["topk_ids"]  # the schedule in ctx replaces it
        return res["out"], Context(self, T, bool(recompute), keep, region), packed

    def backward(self, ctx: Context, d_out: TensorLike, out: Optional[Out] = None,
                 retain_ctx: bool = False) -> Grads:
        """Grads(d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, d_s_gate, d_s_up,
        d_s_down); d_s_* None without a shared expert. The ctx is released
        afterwards unless retain_ctx=True."""
        op = "backward"
        if not isinstance(ctx, Context):
            raise Error("EINVAL", "backward: ctx must be the Context forward returned, got %s" %
                        type(ctx).__name__)
        if ctx.layer is not self:
            raise Error("EINVAL", "backward: this ctx belongs to another layer")
        if ctx.released:
            raise Error("EINVAL", "backward: this ctx was released by an earlier backward; pass "
                        "retain_ctx=True to run backward more than once")
        T = ctx.tokens
        names = list(Grads._fields)
        if not self.shared:
            names = names[:5]
        ins = dict(ctx._inputs or {})
        ins["d_out"] = d_out
        if ctx.recompute:
            res, _ = self._job(op, T, ins, names, _out_map(out, names, op),
                               flags=JOB_RECOMPUTE, ctx="scratch")
        else:
            res, _ = self._job(op, T, ins, names, _out_map(out, names, op), ctx=ctx._region)
        if not retain_ctx:
            ctx.release()
        return Grads(*(res.get(n) for n in Grads._fields))

    # ---- single steps (docs/math.md) ----
    def dispatch(self, x: TensorLike, topk_ids: TensorLike,
                 out: Optional[Out] = None) -> Tuple[Result, Result]:
        """(schedule int32 [schedule_ints], routed_x [R_cap,H])."""
        op = "dispatch"
        T = self._tokens_of(op, "x", x)
        names = ["schedule", "routed_x"]
        res, _ = self._job(op, T, dict(x=x, topk_ids=topk_ids), names, _out_map(out, names, op))
        return res["schedule"], res["routed_x"]

    def compute(self, schedule: TensorLike, routed_x: TensorLike, w_gate: TensorLike,
                w_up: TensorLike, w_down: TensorLike, x: Optional[TensorLike] = None,
                s_gate: Optional[TensorLike] = None, s_up: Optional[TensorLike] = None,
                s_down: Optional[TensorLike] = None,
                out: Optional[Out] = None) -> Tuple[Result, Optional[Result], Result]:
        """(routed_y [R_cap,H], shared_y [T,H] or None, acts uint8 [acts_bytes])."""
        op = "compute"
        T = self._tokens_of_schedule(op, schedule)
        ins = dict(schedule=schedule, routed_x=routed_x, w_gate=w_gate, w_up=w_up,
                   w_down=w_down)
        names = ["routed_y", "acts"]
        if self.shared:
            ins.update(self._shared_args(op, x=x, s_gate=s_gate, s_up=s_up, s_down=s_down))
            names.insert(1, "shared_y")
        else:
            self._shared_args(op, s_gate=s_gate, s_up=s_up, s_down=s_down)
        res, _ = self._job(op, T, ins, names, _out_map(out, names, op))
        return res["routed_y"], res.get("shared_y"), res["acts"]

    def combine(self, schedule: TensorLike, routed_y: TensorLike, router_weights: TensorLike,
                shared_y: Optional[TensorLike] = None, out: Optional[Out] = None) -> Result:
        """out [T,H]."""
        op = "combine"
        T = self._tokens_of_schedule(op, schedule)
        ins = dict(schedule=schedule, routed_y=routed_y, router_weights=router_weights)
        ins.update(self._shared_args(op, shared_y=shared_y))
        res, _ = self._job(op, T, ins, ["out"], _out_map(out, ["out"], op))
        return res["out"]

    def combine_backward(self, schedule: TensorLike, d_out: TensorLike,
                         out: Optional[Out] = None) -> Result:
        """routed_d_out [R_cap,H]."""
        op = "combine_backward"
        T = self._tokens_of_schedule(op, schedule)
        res, _ = self._job(op, T, dict(schedule=schedule, d_out=d_out), ["routed_d_out"],
                           _out_map(out, ["routed_d_out"], op))
        return res["routed_d_out"]

    def compute_backward(self, schedule: TensorLike, acts: TensorLike, routed_x: TensorLike,
                         routed_d_out: TensorLike, router_weights: TensorLike,
                         w_gate: TensorLike, w_up: TensorLike, w_down: TensorLike,
                         x: Optional[TensorLike] = None, d_out: Optional[TensorLike] = None,
                         s_gate: Optional[TensorLike] = None, s_up: Optional[TensorLike] = None,
                         s_down: Optional[TensorLike] = None,
                         out: Optional[Out] = None) -> ComputeGrads:
        """ComputeGrads(routed_d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, shared_d_x,
        d_s_gate, d_s_up, d_s_down); the shared ones None without a shared expert."""
        op = "compute_backward"
        T = self._tokens_of_schedule(op, schedule)
        ins = dict(schedule=schedule, acts=acts, routed_x=routed_x, routed_d_out=routed_d_out,
                   router_weights=router_weights, w_gate=w_gate, w_up=w_up, w_down=w_down)
        names = ["routed_d_x", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down"]
        if self.shared:
            ins.update(self._shared_args(op, x=x, d_out=d_out, s_gate=s_gate, s_up=s_up,
                                         s_down=s_down))
            names += ["shared_d_x", "d_s_gate", "d_s_up", "d_s_down"]
        else:
            self._shared_args(op, s_gate=s_gate, s_up=s_up, s_down=s_down)
        res, _ = self._job(op, T, ins, names, _out_map(out, names, op))
        return ComputeGrads(*(res.get(n) for n in ComputeGrads._fields))

    def dispatch_backward(self, schedule: TensorLike, routed_d_x: TensorLike,
                          shared_d_x: Optional[TensorLike] = None,
                          out: Optional[Out] = None) -> Result:
        """d_x [T,H]."""
        op = "dispatch_backward"
        T = self._tokens_of_schedule(op, schedule)
        ins = dict(schedule=schedule, routed_d_x=routed_d_x)
        ins.update(self._shared_args(op, shared_d_x=shared_d_x))
        res, _ = self._job(op, T, ins, ["d_x"], _out_map(out, ["d_x"], op))
        return res["d_x"]


def _describe(a):
    if isinstance(a, np.ndarray):
        return "%s %s%s" % (a.dtype, tuple(a.shape), "" if a.flags.writeable else " read-only")
    return type(a).__name__
