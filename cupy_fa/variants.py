"""The attention variants: a sliding window, a logits soft-cap and attention sinks.

Each is off unless a step asks for it; a step that uses one runs each tile's kernel with the
variant hooks compiled in (``kernels/shared/variant.cuh``; ``tile.with_variants()``), the same
schedule and work layout as the plain kernel. Here: the host-side settings as the kernels take
them, checked before anything is staged or launched, and the kernel parameters they set.
"""

import math

import numpy as np

LOG2E = 1.4426950408889634


def checked_window(window):
    """``plan(window=...)`` as the kernels take it: W >= 1 keys, or 0 for none (None, -1). A window
    above 2^30 keys is 2^30 (the same for every kv_len a cache can hold; the kernels add it to key
    positions in int32)."""
    if not (type(window) is int and window >= 1):  # (a plain int window, the common case, skips the checks)
        if window is None or (isinstance(window, (int, np.integer)) and not isinstance(window, bool) and window == -1):
            return 0
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window must be an int >= 1 (the keys a query sees, itself included; "
                             f"FlashAttention's convention) or None / -1 for no window, got {window!r}")
    return int(min(window, 2**30))


def checked_soft_cap(cap):
    """``plan(logits_soft_cap=...)``: a positive finite float, or 0.0 for none (None, 0)."""
    if cap is None or (isinstance(cap, (int, float, np.integer, np.floating)) and not isinstance(cap, bool)
                       and cap == 0):
        return 0.0
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)) \
            or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"logits_soft_cap must be a positive finite number (cap * tanh(score * sm_scale / cap)) "
                         f"or None / 0 for none, got {cap!r}")
    return float(cap)


def soft_cap_params(sm_scale, soft_cap):
    """AttentionParams' ``soft_cap_scale`` and ``soft_cap_log2`` (variant.cuh soft_capped): the
    scaled score's tanh argument per raw base-2 score, and the cap in base 2; both 0 without a cap."""
    return (2 * LOG2E * sm_scale / soft_cap if soft_cap else 0.0), soft_cap * LOG2E
