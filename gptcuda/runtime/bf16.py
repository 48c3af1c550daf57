"""bfloat16 on the host: a bf16 value is the top 16 bits of an fp32 value, kept (in numpy, in device
views of dtype "bf16") as its uint16 bit pattern. `bits` rounds fp32 to nearest, ties to even, as the
kernels' cvt.rn (kernels/bf16.cuh) does; `values` widens exactly. NaN stays NaN (quiet), infinities
and overflow past the largest bf16 give infinities, as on the device."""
from __future__ import annotations

import numpy as np


def bits(x) -> np.ndarray:
    """The bf16 bit patterns (uint16) of x rounded to nearest even (x converted to fp32 first)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def values(b) -> np.ndarray:
    """fp32 values of bf16 bit patterns (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_f32(x) -> np.ndarray:
    """x rounded to bf16 and back: the fp32 values a bf16 tensor of x holds."""
    return values(bits(x))
