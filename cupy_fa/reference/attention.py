"""Float64 paged attention and the merge of two attention states (the package docstring has the
shapes)."""

from __future__ import annotations

import math

import numpy as np

from ._host import to_numpy
from .fp8 import dequantize_e4m3

# Upper bound on the elements of one score block [H_q, rows, kv_len] (float64).
_SCORE_BUDGET = 1 << 24


def _masks_per_request(custom_mask, q_lens: np.ndarray) -> list[np.ndarray | None]:
    """Split ``custom_mask`` (list of B masks, or one flat concatenation) into B bool [q, q]."""
    if isinstance(custom_mask, (list, tuple)):
        if len(custom_mask) != len(q_lens):
            raise ValueError(f"custom_mask has {len(custom_mask)} entries for {len(q_lens)} requests")
        parts = [None if m is None else to_numpy(m) for m in custom_mask]
    else:
        flat = to_numpy(custom_mask).reshape(-1)
        sizes = q_lens.astype(np.int64) ** 2
        if flat.size != int(sizes.sum()):
            raise ValueError(f"flat custom_mask has {flat.size} entries, expected sum(q_len**2) = {int(sizes.sum())}")
        parts = np.split(flat, np.cumsum(sizes)[:-1])
    out: list[np.ndarray | None] = []
    for n, m in zip(q_lens.tolist(), parts):
        if n == 0:
            out.append(None)
            continue
        if m is None or m.size != n * n:
            raise ValueError(f"custom_mask for a request with q_len={n} must hold {n * n} entries")
        out.append(np.asarray(m).reshape(n, n).astype(bool))
    return out


def paged_attention(
    q,
    k_cache,
    v_cache,
    q_lens,
    kv_lens,
    page_table,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    custom_mask=None,
    return_lse: bool = False,
    p_dtype=None,
    k_scale=None,
    v_scale=None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks=None,
):
    """Reference paged attention in float64.

    Args:
        q: ``[sum(q_lens), H_q, D]`` queries.
        k_cache, v_cache: ``[num_pages, page_size, H_kv, D]`` (any float dtype; uint8 or
            ml_dtypes float8_e4m3fn: an fp8 cache's bytes, see ``k_scale``); v_cache may have
            its own head dim ``D_vo`` (separate qk / vo head dims: ``[..., H_kv, D_vo]``).
        q_lens, kv_lens: ``[B]`` int; ``0 <= q_len <= kv_len`` (``q_len == 0``: padded row).
        page_table: ``[B, max_pages]`` int physical page ids.
        causal: bottom-right aligned; query i of b sees keys ``0 .. kv_len - q_len + i``.
            Otherwise every query sees all ``kv_len`` keys.
        sm_scale: score scale, default ``1 / sqrt(D)`` (q's and K's head dim).
        custom_mask: ``None``, a list of B bool ``[q_len, q_len]`` masks, or one flat bool
            array (each request's mask row-major, concatenated). Query i then sees the whole
            prefix ``0 .. kv_len - q_len - 1`` and draft key ``kv_len - q_len + j`` iff
            ``mask[i, j]``. Overrides ``causal``.
        return_lse: also return the log-sum-exp of the scaled scores.
        k_scale, v_scale: an fp8 cache's scales (a float or ``[H_kv]``): the keys are
            ``k_cache * k_scale[head]`` in float64, the values likewise (k_cache / v_cache of
            ml_dtypes' float8_e4m3fn, or uint8 e4m3fn bytes). None: 1.
        p_dtype: ``None`` (exact), or a dtype (``np.float16``, ``ml_dtypes.bfloat16``) to round
            the softmax weights to before they multiply V, as the kernels' P.V product does
            (the denominator and the LSE stay exact). Models a kernel's rounding, for CPU tests
            of the checker; never the truth.
        window: a sliding window of W keys (FlashAttention's convention): query i of b, at
            position ``p = kv_len - q_len + i``, sees only keys ``p - W + 1 ..`` (on top of the
            causal or custom mask, or of none). None or -1: no window.
        soft_cap: ``cap``: each scaled score s becomes ``cap * tanh(s / cap)`` before the mask
            (Gemma 2). None or 0: none.
        sinks: ``[H_q]`` attention sinks (gpt-oss): one logit per query head, in the units of the
            scaled (and capped) scores, added to each row's softmax denominator with a zero
            value; the LSE includes it, and a row that sees no key gets ``out = 0``, ``lse =
            sinks[h]``. None: none.

    Returns:
        ``out`` float64 ``[sum(q_lens), H_q, D_vo]`` (``D_vo`` = v_cache's head dim), and with ``return_lse`` also ``lse``
        float64 ``[sum(q_lens), H_q]`` (natural log). A query that sees no key gets
        ``out = 0`` and ``lse = -inf`` (with sinks: ``lse = sinks[h]``).
    Raises:
        ValueError: shapes that do not fit, ``q`` rows other than ``sum(q_lens)``, ``q_len >
            kv_len``, a page id outside the cache or a page table too narrow, a flat custom mask
            of another size, a bad ``window`` / ``soft_cap``, ``sinks`` not one per query head
            (docs/errors.md).
    """
    q = to_numpy(q)
    k_cache = to_numpy(k_cache)
    v_cache = to_numpy(v_cache)
    if k_scale is not None or v_scale is not None or k_cache.dtype == np.uint8:
        k_cache = dequantize_e4m3(k_cache, 1.0 if k_scale is None else k_scale)
        v_cache = dequantize_e4m3(v_cache, 1.0 if v_scale is None else v_scale)
    q_lens = to_numpy(q_lens).astype(np.int64).reshape(-1)
    kv_lens = to_numpy(kv_lens).astype(np.int64).reshape(-1)
    page_table = to_numpy(page_table).astype(np.int64)
    if page_table.ndim == 1:
        page_table = page_table.reshape(len(q_lens), -1)

    total_q, num_qo_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    batch = len(q_lens)
    head_dim_vo = v_cache.shape[-1] if v_cache.ndim == 4 else head_dim
    if k_cache.shape[:-1] != v_cache.shape[:-1] or v_cache.ndim != 4 or k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape} do not match q {q.shape}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"H_q={num_qo_heads} is not a multiple of H_kv={num_kv_heads}")
    if kv_lens.shape != (batch,) or page_table.shape[0] != batch:
        raise ValueError("q_lens, kv_lens and page_table disagree on the batch size")
    if int(q_lens.sum()) != total_q:
        raise ValueError(f"q has {total_q} rows but sum(q_lens) = {int(q_lens.sum())}")
    if np.any(q_lens < 0) or np.any(q_lens > kv_lens):
        raise ValueError("need 0 <= q_len <= kv_len for every request")
    live = q_lens > 0
    if np.any(-(-kv_lens[live] // page_size) > page_table.shape[1]):
        raise ValueError("page_table has fewer columns than a request's kv_len needs")

    if window is None or (isinstance(window, (int, np.integer)) and not isinstance(window, bool) and window == -1):
        window = None
    elif isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be an int >= 1 (or None / -1 for none), got {window!r}")
    if soft_cap in (None, 0):
        soft_cap = None
    elif not (math.isfinite(float(soft_cap)) and float(soft_cap) > 0):
        raise ValueError(f"soft_cap must be a positive finite number (or None / 0 for none), got {soft_cap!r}")
    if sinks is not None:
        sinks = to_numpy(sinks).astype(np.float64).reshape(-1)
        if sinks.shape != (num_qo_heads,):
            raise ValueError(f"sinks must hold one logit per query head ({num_qo_heads}), got shape {sinks.shape}")
        sinks = sinks[:, None, None]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    group = num_qo_heads // num_kv_heads
    masks = None if custom_mask is None else _masks_per_request(custom_mask, q_lens)
    out = np.zeros((total_q, num_qo_heads, head_dim_vo), np.float64)
    lse = np.full((total_q, num_qo_heads), -np.inf, np.float64)
    cu = np.concatenate([[0], np.cumsum(q_lens)])

    # Work buffers reused across requests: paging in fresh large arrays dominates otherwise.
    max_kv = int(kv_lens[live].max()) if live.any() else 0
    k_buf = np.empty((max_kv, num_kv_heads, head_dim), np.float64)
    v_buf = np.empty((max_kv, num_kv_heads, head_dim_vo), np.float64)
    max_q = int(q_lens.max(initial=0))
    s_buf = np.empty(min(num_qo_heads * max_q * max_kv, max(_SCORE_BUDGET, num_qo_heads * max_kv)), np.float64)
    for b in range(batch):
        n, kv = int(q_lens[b]), int(kv_lens[b])
        if n == 0:
            continue
        pages = page_table[b, : -(-kv // page_size)]
        if np.any(pages < 0) or np.any(pages >= num_pages):
            raise ValueError(f"request {b}: page id out of range [0, {num_pages})")
        # Gather whole pages in the cache dtype, then widen: [kv, H_kv, D] float64.
        k, v = k_buf[:kv], v_buf[:kv]
        k[...] = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv]
        v[...] = v_cache[pages].reshape(-1, num_kv_heads, head_dim_vo)[:kv]
        prefix = kv - n
        rows_per_chunk = max(1, _SCORE_BUDGET // (num_qo_heads * kv))
        for r0 in range(0, n, rows_per_chunk):
            r1 = min(n, r0 + rows_per_chunk)
            nr = r1 - r0
            # Keys any row of the chunk can see: causal rows stop at prefix + r1.
            hi = prefix + r1 if (causal and masks is None) else kv
            kt = k[:hi].transpose(1, 2, 0)  # [H_kv, D, hi], BLAS-able strided view
            vt = v[:hi].transpose(1, 0, 2)  # [H_kv, hi, D]
            # [H_kv, group * nr, D] with query head h = kv_head * group + g.
            qb = np.asarray(q[cu[b] + r0 : cu[b] + r1], np.float64)
            qb = qb.reshape(nr, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
            qb = qb.reshape(num_kv_heads, group * nr, head_dim)
            s = np.matmul(qb, kt, out=s_buf[: num_qo_heads * nr * hi].reshape(num_kv_heads, group * nr, hi))
            s *= scale
            s = s.reshape(num_qo_heads, nr, hi)
            if soft_cap is not None:
                np.tanh(np.divide(s, soft_cap, out=s), out=s)
                s *= soft_cap

            if masks is not None:
                visible = np.ones((nr, hi), bool)
                visible[:, prefix:] = masks[b][r0:r1]
            elif causal:
                visible = np.arange(hi)[None, :] <= (prefix + np.arange(r0, r1))[:, None]
            else:
                visible = None
            if window is not None:  # key >= p - W + 1 for query position p = prefix + row
                seen = np.arange(hi)[None, :] >= (prefix + np.arange(r0, r1) - window + 1)[:, None]
                visible = seen if visible is None else visible & seen
            if visible is not None:
                np.copyto(s, -np.inf, where=~visible[None])

            m = s.max(axis=-1, keepdims=True)  # [H_q, nr, 1]
            if sinks is not None:
                m = np.maximum(m, sinks)
            m[~np.isfinite(m)] = 0.0
            p = np.exp(np.subtract(s, m, out=s), out=s)  # in place, like s_buf below
            denom = p.sum(axis=-1, keepdims=True)
            if sinks is not None:  # the sink's term (its value is zero)
                denom = denom + np.exp(sinks - m)
            if p_dtype is not None:  # the kernels multiply V by P rounded to q's dtype
                p = p.astype(p_dtype).astype(np.float64)
            o = (p.reshape(num_kv_heads, group * nr, hi) @ vt).reshape(num_qo_heads, nr, head_dim_vo)
            with np.errstate(divide="ignore", invalid="ignore"):
                o = np.where(denom > 0, o / denom, 0.0)
                l = np.log(denom[..., 0]) + m[..., 0]
            out[cu[b] + r0 : cu[b] + r1] = o.transpose(1, 0, 2)
            lse[cu[b] + r0 : cu[b] + r1] = l.T
    return (out, lse) if return_lse else out


def merge_states(out_a, lse_a, out_b, lse_b):
    """Float64 merge of two attention states over disjoint key sets (what
    :func:`cupy_fa.merge_states` computes on the device).

    Args:
        out_a, out_b: ``[N, H, D]`` normalised outputs (any float dtype, NumPy / CuPy / torch).
        lse_a, lse_b: ``[N, H]`` their natural-log LSEs (-inf: that side saw no key).

    Returns:
        ``(out, lse)`` float64 ``[N, H, D]`` and ``[N, H]``: ``lse = log(e^lse_a + e^lse_b)``,
        ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b``; a row with both sides empty gets
        ``out = 0``, ``lse = -inf`` (as :func:`paged_attention` gives a query that sees no key);
        NaN in either side gives NaN.
    Raises:
        ValueError: shapes that do not match.
    """
    oa, ob = (np.asarray(to_numpy(x), np.float64) for x in (out_a, out_b))
    la, lb = (np.asarray(to_numpy(x), np.float64) for x in (lse_a, lse_b))
    if oa.ndim != 3 or ob.shape != oa.shape:
        raise ValueError(f"out_a {oa.shape} / out_b {ob.shape} must both be [N, H, D]")
    if la.shape != oa.shape[:2] or lb.shape != oa.shape[:2]:
        raise ValueError(f"lse_a {la.shape} / lse_b {lb.shape} must be [N, H] = {oa.shape[:2]}")
    m = np.maximum(la, lb)
    empty = m == -np.inf
    m_safe = np.where(empty, 0.0, m)
    with np.errstate(invalid="ignore"):
        wa, wb = np.exp(la - m_safe), np.exp(lb - m_safe)  # exp(-inf) = 0: an empty side weighs nothing
        total = wa + wb
        lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, total)))
        scale = np.where(empty, 0.0, 1.0 / np.where(empty, 1.0, total))
        # an empty side's out is never read (it may hold anything), as in the kernel's fold
        out = (wa * scale)[..., None] * np.where(la[..., None] == -np.inf, 0.0, oa) + \
            (wb * scale)[..., None] * np.where(lb[..., None] == -np.inf, 0.0, ob)
    nan = np.isnan(la) | np.isnan(lb)
    out[nan] = np.nan
    lse[nan] = np.nan
    return out, lse
