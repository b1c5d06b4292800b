# SPDX-License-Identifier: Apache-2.0
"""bfloat16 <-> float32 on numpy arrays, with no dependency on libmok.

bfloat16 is the top half of an IEEE float32. numpy has no bfloat16 dtype of
its own: mok takes bfloat16 inputs as uint16 bit patterns (dtype np.uint16)
or as ml_dtypes.bfloat16 arrays, and returns bfloat16 results in
bf16_dtype(): ml_dtypes.bfloat16 when the ml_dtypes package is installed,
else uint16 bit patterns (MOK_BF16=uint16 in the environment keeps uint16
even with ml_dtypes). Both hold the same 16 bits per element.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import numpy.typing as npt

__all__ = ["to_bf16", "from_bf16", "round_bf16", "bf16_dtype", "is_bf16"]

_result_dtype: Optional[np.dtype] = None


def bf16_dtype() -> np.dtype:
    """The numpy dtype of bfloat16 results: ml_dtypes.bfloat16 if ml_dtypes can
    be imported, else np.uint16 (bit patterns). MOK_BF16=uint16 in the
    environment chooses uint16 regardless; it is read at the first call."""
    global _result_dtype
    if _result_dtype is None:
        choice = os.environ.get("MOK_BF16", "").strip().lower()
        if choice not in ("", "auto", "uint16", "ml_dtypes"):
            raise ValueError("MOK_BF16 must be uint16, ml_dtypes or auto, got %r" % choice)
        dt = np.dtype(np.uint16)
        if choice != "uint16":
            try:
                import ml_dtypes
                dt = np.dtype(ml_dtypes.bfloat16)
            except ImportError:
                if choice == "ml_dtypes":
                    raise
        _result_dtype = dt
    return _result_dtype


def is_bf16(dtype: npt.DTypeLike) -> bool:
    """True for ml_dtypes.bfloat16 (not for uint16 bit patterns)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return False
    return dt.name == "bfloat16" and dt.itemsize == 2


def to_bf16(a: npt.ArrayLike) -> np.ndarray:
    """float32 array -> uint16 array of bfloat16 bit patterns.

    Rounds to nearest, ties to even (as mokd does); a NaN stays a quiet NaN
    with its sign; finite values too large round to +-Inf.
    """
    a = np.asarray(a)
    if is_bf16(a.dtype):  # already bfloat16: its bits
        return np.ascontiguousarray(a).view(np.uint16).copy()
    if a.dtype != np.float32:
        if a.dtype.kind not in "fiub":
            raise TypeError("to_bf16 takes a real array, got dtype %s" % a.dtype)
        a = a.astype(np.float32)
    u = np.ascontiguousarray(a).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
               >> np.uint32(16)).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded.reshape(a.shape)


def from_bf16(b: npt.ArrayLike) -> np.ndarray:
    """uint16 array of bfloat16 bit patterns, or an ml_dtypes.bfloat16 array
    -> float32 array (exact)."""
    b = np.asarray(b)
    if b.dtype != np.uint16:
        if is_bf16(b.dtype):
            b = b.view(np.uint16)
        else:
            raise TypeError("from_bf16 takes uint16 bit patterns, got dtype %s" % b.dtype)
    return (np.ascontiguousarray(b).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(b.shape)


def round_bf16(a: npt.ArrayLike) -> np.ndarray:
    """Round a float array to the nearest bfloat16 value, kept as float32."""
    return from_bf16(to_bf16(a))
