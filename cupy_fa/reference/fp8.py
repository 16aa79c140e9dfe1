"""fp8 (e4m3fn) K/V in float64: the quantiser the append kernel implements, and the dequantisation."""

from __future__ import annotations

import numpy as np

from ._host import to_numpy

E4M3_MAX = 448.0  # the largest finite e4m3fn value: quantisation saturates here


def _e4m3_dtype():
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e4m3fn)


def quantize_e4m3(x, scale):
    """The bytes (uint8, e4m3fn) ``PagedKVCache.append`` stores for new rows ``x`` (``[..., H_kv,
    D]`` of any float dtype: what the kernel reads as float32) with scales ``scale`` (a float or
    ``[H_kv]``): ``q = e4m3(float32(x) / float32(scale))``, the division in float32 (IEEE,
    correctly rounded, float32 subnormals flushed to zero of their sign as the kernels' -ftz
    build does), then rounded to the nearest e4m3fn value, ties to even; ``|q| >= 448`` (and
    +-inf) saturate to +-448, NaN stays NaN (0x7F, or 0xFF for a negative NaN). A float64
    re-implementation of kernels/shared/common.cuh e4m3_from_float, checked against ml_dtypes' own
    rounding (tests/test_fp8_cpu.py)."""
    x32 = np.asarray(to_numpy(x)).astype(np.float32)
    s32 = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1, 1), x32.shape[-2:]) \
        if np.ndim(scale) else np.float32(scale)
    tiny = np.float32(np.finfo(np.float32).tiny)
    x32 = np.where(np.abs(x32) < tiny, np.copysign(np.float32(0), x32), x32)  # -ftz on the input
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        quotient = (x32 / s32).astype(np.float32)
    quotient = np.where(np.abs(quotient) < tiny, np.copysign(np.float32(0), quotient), quotient)
    bits = quotient.view(np.uint32).astype(np.int64)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    with np.errstate(invalid="ignore"):
        sub = np.rint(np.abs(quotient.astype(np.float64)) * 512.0)  # rint: ties to even
    sub = np.where(np.isfinite(sub), np.minimum(sub, 8), 0).astype(np.int64)
    out = np.where(a >= 0x3C800000, normal, sub)
    out = np.where(a >= 0x43E00000, 0x7E, out)
    out = np.where(a > 0x7F800000, 0x7F, out)
    return (sign | out).astype(np.uint8)


def dequantize_e4m3(fp8, scale):
    """float64 values of an fp8 cache: e4m3fn bytes (uint8, or ml_dtypes' float8_e4m3fn) ``[...,
    H_kv, D]`` times ``scale`` (a float or ``[H_kv]``)."""
    arr = np.asarray(to_numpy(fp8))
    if arr.dtype == np.uint8:
        arr = arr.view(_e4m3_dtype())
    values = arr.astype(np.float64)
    scale = np.asarray(to_numpy(scale), np.float64)
    if scale.ndim and scale.size > 1:
        return values * scale.reshape(-1, 1)
    return values * float(scale.reshape(()))


# The accuracy bar for every kernel result against this reference (relative_error):
# tests, the demo's self-check and the bench all hold outputs to it.
