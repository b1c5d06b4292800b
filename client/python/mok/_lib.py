# SPDX-License-Identifier: Apache-2.0
"""ctypes declarations of libmok (client/include/mok.h) and its constants.

libmok is found through $MOK_LIBRARY, else the build tree when this package
is client/python/mok of a source tree (build/lib/libmok.so), else the copy a
pip install put beside this file (mok/libmok.so), else the system
(find_library("mok"), libmok.so.1).

The constants mirror proto/mok_enums.h and proto/mok_status.h (values travel
on the wire and are append-only; tests/python checks that they still match).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Iterator, Optional

# ---- constants (proto/mok_status.h, proto/mok_enums.h) ------------------------

STATUS_NAMES = (
    "OK", "EINVAL", "EPROTO", "EVERSION", "ENOMEM", "ELIMIT", "ENOENT", "EBOUNDS", "ESHAPE",
    "EROUTE", "EOVERFLOW", "ETIMEOUT", "EENGINE", "EUNSUPPORTED", "ESHUTDOWN", "EIO", "ECLOSED",
    "EBUSY", "EACCES",
)
STATUS_CODES = {n: i for i, n in enumerate(STATUS_NAMES)}

DTYPE_F32, DTYPE_BF16, DTYPE_I32, DTYPE_U8, DTYPE_FP8_E4M3 = 1, 2, 3, 4, 5

OPS = ("nop", "forward", "backward", "dispatch", "compute", "combine", "combine_backward",
       "compute_backward", "dispatch_backward", "quantize_weight")
OP = {n: i for i, n in enumerate(OPS)}

SLOTS = (
    "x", "topk_ids", "router_weights", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down",
    "out", "ctx", "d_out", "d_x", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down",
    "d_s_gate", "d_s_up", "d_s_down", "schedule", "acts", "routed_x", "routed_y", "shared_y",
    "routed_d_out", "routed_d_x", "shared_d_x", "packed_weight",
)
SLOT = {n: i for i, n in enumerate(SLOTS)}
SLOT_COUNT = len(SLOTS)

JOB_RECOMPUTE = 0x1
JOB_QUANTIZE_WEIGHTS = 0x2  # forward of an fp8 layer: quantise the masters first (mok.h)
NCCL_ID_BYTES = 128  # proto/mok_enums.h MOK_NCCL_ID_BYTES
MAX_DIMS = 4
DEFAULT_SOCKET = "/run/mok/mokd-0.sock"  # proto/mok_enums.h MOK_DEFAULT_SOCKET
BUNDLED_NAME = "libmok.so"  # beside this file in a pip-installed package


# ---- structures -----------------------------------------------------------------

class DaemonStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "uptime_ms", "jobs_done", "jobs_failed", "sessions_now", "sessions_total",
        "latency_p50_ns", "latency_p99_ns")]


class LayerDesc(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_uint32), ("intermediate", ctypes.c_uint32),
        ("experts", ctypes.c_uint32), ("topk", ctypes.c_uint32),
        ("shared_intermediate", ctypes.c_uint32), ("max_tokens", ctypes.c_uint32),
        ("dtype", ctypes.c_uint32), ("has_swiglu_limit", ctypes.c_int),
        ("swiglu_limit", ctypes.c_float),
        ("group", ctypes.c_void_p), ("group_tag", ctypes.c_uint32),  # mok.h: EP group
    ]


class LayerCostInfo(ctypes.Structure):  # mok.h mok_layer_cost_info
    _fields_ = [(n, ctypes.c_uint64) for n in ("layer_bytes", "workspace_bytes", "ctx_bytes")] + [
        (n, ctypes.c_uint32) for n in ("row_align", "local_experts", "first_expert")]


class GroupSizing(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in (  # type: ignore[assignment]
        "max_tokens", "hidden", "topk", "experts", "dtype", "timeout_ms")] + [
        ("capacity", ctypes.c_float), ("ring_rows", ctypes.c_uint32),
        ("nccl_id", ctypes.c_char_p)]


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("dtype", ctypes.c_uint32), ("ndim", ctypes.c_uint32),
        ("shape", ctypes.c_uint64 * MAX_DIMS),
    ]


TensorArray = Tensor * SLOT_COUNT

# ---- loading ----------------------------------------------------------------------

_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None
_load_lock = threading.Lock()


def _candidates() -> Iterator[str]:
    env = os.environ.get("MOK_LIBRARY")
    if env:
        yield env
        return  # an explicit choice is not second-guessed
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.normpath(os.path.join(here, "..", "..", ".."))
    if os.path.isfile(os.path.join(repo, "client", "include", "mok.h")):
        # this package is client/python/mok of a source tree: that tree's build
        yield os.path.join(repo, "build", "lib", "libmok.so")
    # the copy a pip install bundled (pyproject.toml, setup.py)
    yield os.path.join(here, BUNDLED_NAME)
    found = ctypes.util.find_library("mok")
    if found:
        yield found
    yield "libmok.so.1"
    yield "libmok.so"


def _declare(lib):
    c = ctypes
    P = c.c_void_p
    sig = {
        "mok_last_error": (c.c_char_p, []),
        "mok_status_name": (c.c_char_p, [c.c_int]),
        "mok_version": (c.c_char_p, []),
        "mok_connect": (c.c_int, [c.c_char_p, c.c_char_p, c.POINTER(P)]),
        "mok_close": (None, [P]),
        "mok_client_engine": (c.c_char_p, [P]),
        "mok_client_device": (c.c_char_p, [P]),
        "mok_client_session": (c.c_uint64, [P]),
        "mok_stats": (c.c_int, [P, c.POINTER(DaemonStats)]),
        "mok_host_alloc": (P, [P, c.c_size_t]),
        "mok_host_free": (c.c_int, [P, P]),
        "mok_layer_create": (c.c_int, [P, c.POINTER(LayerDesc), c.POINTER(P)]),
        "mok_layer_destroy": (None, [P]),
        "mok_layer_cost": (c.c_int, [P, c.POINTER(LayerDesc), c.POINTER(LayerCostInfo)]),
        "mok_layer_row_align": (c.c_uint32, [P]),
        "mok_layer_local_experts": (c.c_uint32, [P]),
        "mok_layer_ctx_bytes": (c.c_uint64, [P, c.c_uint32]),
        "mok_layer_acts_bytes": (c.c_uint64, [P, c.c_uint32]),
        "mok_layer_schedule_ints": (c.c_uint64, [P, c.c_uint32]),
        "mok_layer_rows_capacity": (c.c_uint64, [P, c.c_uint32]),
        "mok_tensor_for": (Tensor, [P, c.c_uint32, c.c_uint32, P]),
        "mok_layer_packed_weight_bytes": (c.c_uint64, [P, c.c_uint32]),
        "mok_layer_packed_weights_bytes": (c.c_uint64, [P]),
        "mok_layer_packed_weights_offset": (c.c_uint64, [P, c.c_uint32]),
        "mok_tensor_for_job": (Tensor, [P, c.c_uint32, c.c_uint32, c.c_uint32, c.c_uint32, P]),
        "mok_quantize_weight": (c.c_int, [P, c.c_uint32, P, P, c.POINTER(c.c_uint64)]),
        "mok_submit": (c.c_int, [P, c.c_uint32, c.c_uint32, c.c_uint32, c.POINTER(Tensor),
                                 c.POINTER(c.c_uint64)]),
        "mok_submit_nop": (c.c_int, [P, c.POINTER(c.c_uint64)]),
        "mok_wait": (c.c_int, [P, c.c_uint64, c.c_int]),
        "mok_job_pending": (c.c_int, [P, c.c_uint64]),
        "mok_group_nccl_id": (c.c_int, [P, c.c_char_p]),
        "mok_group_join": (c.c_int, [P, c.c_char_p, c.c_uint32, c.c_uint32,
                                     c.POINTER(GroupSizing), c.POINTER(P)]),
        "mok_group_leave": (c.c_int, [P]),
        "mok_group_local_experts": (c.c_uint32, [P]),
        "mok_group_first_expert": (c.c_uint32, [P]),
        "mok_group_generation": (c.c_uint64, [P]),
        "mok_group_rejoined": (c.c_int, [P]),
        "mok_submit_on_stream": (c.c_int, [P, c.c_uint32, c.c_uint32, c.c_uint32,
                                           c.POINTER(Tensor), P, c.POINTER(c.c_uint64)]),
        "mok_async_error": (c.c_int, [P]),
        "mok_standing_create": (c.c_int, [P, c.c_uint32, c.c_uint32, c.c_uint32,
                                          c.POINTER(Tensor), c.POINTER(P)]),
        "mok_standing_enqueue": (c.c_int, [P, P]),
        "mok_standing_trigger": (c.c_int, [P]),
        "mok_standing_wait": (c.c_int, [P, c.c_int]),
        "mok_standing_status": (c.c_int, [P]),
        "mok_standing_done": (c.c_uint64, [P]),
        "mok_standing_destroy": (None, [P]),
        "mok_sync": (c.c_int, [P, c.c_int]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


def lib() -> ctypes.CDLL:
    """The loaded libmok (ctypes.CDLL: calls release the GIL)."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _load_lock:
        if _lib is not None:
            return _lib
        tried = []
        for cand in _candidates():
            if os.sep in cand and not os.path.exists(cand):
                tried.append("%s (missing)" % cand)
                continue
            try:
                handle = ctypes.CDLL(cand)
            except OSError as e:
                tried.append("%s (%s)" % (cand, e))
                continue
            _declare(handle)
            _lib_path = cand
            _lib = handle
            return _lib
        from ._errors import Error
        raise Error("ENOENT", "libmok.so not found; build it (make build/lib/libmok.so), install "
                    "it (make install, or pip install of the repository), or set MOK_LIBRARY. "
                    "Tried: " + "; ".join(tried))


def library_path() -> str:
    """The path (or name) libmok was loaded from; loads it if need be."""
    lib()
    assert _lib_path is not None
    return _lib_path


def version() -> str:
    return lib().mok_version().decode("ascii")


def last_error() -> str:
    m = lib().mok_last_error()
    return m.decode("utf-8", "replace") if m else ""
