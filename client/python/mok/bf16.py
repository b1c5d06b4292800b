"""bfloat16 <-> float32 on numpy arrays, with no dependency on libmok.

bfloat16 is the top half of an IEEE float32. mok moves bfloat16 tensors as
uint16 bit patterns (dtype np.uint16), because numpy has no bfloat16 dtype.
"""
import numpy as np

__all__ = ["to_bf16", "from_bf16", "round_bf16"]


def to_bf16(a):
    """float32 array -> uint16 array of bfloat16 bit patterns.

    Rounds to nearest, ties to even (as mokd does); a NaN stays a quiet NaN
    with its sign; finite values too large round to +-Inf.
    """
    a = np.asarray(a)
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


def from_bf16(b):
    """uint16 array of bfloat16 bit patterns -> float32 array (exact)."""
    b = np.asarray(b)
    if b.dtype != np.uint16:
        if b.dtype.name == "bfloat16" and b.dtype.itemsize == 2:  # ml_dtypes
            b = b.view(np.uint16)
        else:
            raise TypeError("from_bf16 takes uint16 bit patterns, got dtype %s" % b.dtype)
    return (np.ascontiguousarray(b).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(b.shape)


def round_bf16(a):
    """Round a float array to the nearest bfloat16 value, kept as float32."""
    return from_bf16(to_bf16(a))
