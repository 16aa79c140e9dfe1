"""Float64 NumPy paged attention: the truth the tests compare the kernels against.

Shapes (B requests, T = sum(q_lens) query rows):

- ``q``: ``[T, H_q, D]``; request b owns rows ``cu[b] .. cu[b] + q_len[b] - 1``
  where ``cu`` is the exclusive cumulative sum of ``q_lens``.
- ``k_cache``, ``v_cache``: ``[num_pages, page_size, H_kv, D]`` (NHD).
- ``q_lens``, ``kv_lens``: ``[B]`` int; ``kv_len`` counts the KV tokens AFTER this
  step's K/V were written, so query i of b sits at position ``kv_len[b] - q_len[b] + i``.
- ``page_table``: ``[B, max_pages]`` int; logical token j of b lives at page
  ``page_table[b, j // page_size]``, offset ``j % page_size``.

Inputs may be NumPy, CuPy or torch arrays of any float dtype (bfloat16 via ml_dtypes
included); everything is computed in float64 on the host. Per request it is a few BLAS
calls (33 requests x kv_len 8192 take about a second); on a small, busy machine set
``OPENBLAS_NUM_THREADS=1`` (``make test`` does) or the BLAS threads' waits dominate.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["paged_attention", "merge_states", "relative_error", "check_attention", "AttentionCheck", "TOL", "MAX_ABS",
           "LSE_TOL", "quantize_e4m3", "dequantize_e4m3", "E4M3_MAX"]

# Upper bound on the elements of one score block [H_q, rows, kv_len] (float64).
_SCORE_BUDGET = 1 << 24


def _to_numpy(x) -> np.ndarray:
    """Return ``x`` as a host NumPy array (CuPy via ``.get()``, torch via ``.cpu().numpy()``)."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch":
        t = x.detach()
        if str(t.dtype) == "torch.bfloat16":  # NumPy has no bf16 for torch to hand over
            t = t.float()
        return t.cpu().numpy()
    if hasattr(x, "get") and callable(x.get) and not isinstance(x, dict):
        return np.asarray(x.get())  # CuPy
    return np.asarray(x)


def _masks_per_request(custom_mask, q_lens: np.ndarray) -> list[np.ndarray | None]:
    """Split ``custom_mask`` (list of B masks, or one flat concatenation) into B bool [q, q]."""
    if isinstance(custom_mask, (list, tuple)):
        if len(custom_mask) != len(q_lens):
            raise ValueError(f"custom_mask has {len(custom_mask)} entries for {len(q_lens)} requests")
        parts = [None if m is None else _to_numpy(m) for m in custom_mask]
    else:
        flat = _to_numpy(custom_mask).reshape(-1)
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
            ml_dtypes float8_e4m3fn: an fp8 cache's bytes, see ``k_scale``).
        q_lens, kv_lens: ``[B]`` int; ``0 <= q_len <= kv_len`` (``q_len == 0``: padded row).
        page_table: ``[B, max_pages]`` int physical page ids.
        causal: bottom-right aligned; query i of b sees keys ``0 .. kv_len - q_len + i``.
            Otherwise every query sees all ``kv_len`` keys.
        sm_scale: score scale, default ``1 / sqrt(D)``.
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
        ``out`` float64 ``[sum(q_lens), H_q, D]``, and with ``return_lse`` also ``lse``
        float64 ``[sum(q_lens), H_q]`` (natural log). A query that sees no key gets
        ``out = 0`` and ``lse = -inf`` (with sinks: ``lse = sinks[h]``).
    Raises:
        ValueError: shapes that do not fit, ``q`` rows other than ``sum(q_lens)``, ``q_len >
            kv_len``, a page id outside the cache or a page table too narrow, a flat custom mask
            of another size, a bad ``window`` / ``soft_cap``, ``sinks`` not one per query head
            (docs/errors.md).
    """
    q = _to_numpy(q)
    k_cache = _to_numpy(k_cache)
    v_cache = _to_numpy(v_cache)
    if k_scale is not None or v_scale is not None or k_cache.dtype == np.uint8:
        k_cache = dequantize_e4m3(k_cache, 1.0 if k_scale is None else k_scale)
        v_cache = dequantize_e4m3(v_cache, 1.0 if v_scale is None else v_scale)
    q_lens = _to_numpy(q_lens).astype(np.int64).reshape(-1)
    kv_lens = _to_numpy(kv_lens).astype(np.int64).reshape(-1)
    page_table = _to_numpy(page_table).astype(np.int64)
    if page_table.ndim == 1:
        page_table = page_table.reshape(len(q_lens), -1)

    total_q, num_qo_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    batch = len(q_lens)
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != head_dim:
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
        sinks = _to_numpy(sinks).astype(np.float64).reshape(-1)
        if sinks.shape != (num_qo_heads,):
            raise ValueError(f"sinks must hold one logit per query head ({num_qo_heads}), got shape {sinks.shape}")
        sinks = sinks[:, None, None]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    group = num_qo_heads // num_kv_heads
    masks = None if custom_mask is None else _masks_per_request(custom_mask, q_lens)
    out = np.zeros((total_q, num_qo_heads, head_dim), np.float64)
    lse = np.full((total_q, num_qo_heads), -np.inf, np.float64)
    cu = np.concatenate([[0], np.cumsum(q_lens)])

    # Work buffers reused across requests: paging in fresh large arrays dominates otherwise.
    max_kv = int(kv_lens[live].max()) if live.any() else 0
    k_buf = np.empty((max_kv, num_kv_heads, head_dim), np.float64)
    v_buf = np.empty_like(k_buf)
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
        v[...] = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv]
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
            o = (p.reshape(num_kv_heads, group * nr, hi) @ vt).reshape(num_qo_heads, nr, head_dim)
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
    oa, ob = (np.asarray(_to_numpy(x), np.float64) for x in (out_a, out_b))
    la, lb = (np.asarray(_to_numpy(x), np.float64) for x in (lse_a, lse_b))
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


# ---- fp8 (e4m3fn) KV: the quantiser the append kernel implements, and the dequantisation ----

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
    re-implementation of kernels/common.cuh e4m3_from_float, checked against ml_dtypes' own
    rounding (tests/test_fp8_cpu.py)."""
    x32 = np.asarray(_to_numpy(x)).astype(np.float32)
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
    arr = np.asarray(_to_numpy(fp8))
    if arr.dtype == np.uint8:
        arr = arr.view(_e4m3_dtype())
    values = arr.astype(np.float64)
    scale = np.asarray(_to_numpy(scale), np.float64)
    if scale.ndim and scale.size > 1:
        return values * scale.reshape(-1, 1)
    return values * float(scale.reshape(()))


# The accuracy bar for every kernel result against this reference (relative_error):
# tests, the demo's self-check and the bench all hold outputs to it.
TOL = {"float16": 3e-3, "bfloat16": 1e-2}


def relative_error(out, ref) -> float:
    """``||out - ref||_F / ||ref||_F`` in float64; ``inf`` if either holds a NaN.

    Matching infinities (e.g. ``lse = -inf`` for a query that sees nothing) count as equal;
    a zero ``ref`` gives 0 when ``out`` is zero too, else ``inf``.
    """
    a = np.asarray(_to_numpy(out), np.float64)
    r = np.asarray(_to_numpy(ref), np.float64)
    if a.shape != r.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {r.shape}")
    if np.isnan(a).any() or np.isnan(r).any():
        return math.inf
    with np.errstate(invalid="ignore"):
        d = np.where(a == r, 0.0, a - r)
    if not np.isfinite(d).all():
        return math.inf
    diff = np.linalg.norm(d)
    norm = np.linalg.norm(np.where(np.isfinite(r), r, 0.0))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return float(diff / norm)


# ---- the per-request, per-row checker ---------------------------------------------------
#
# relative_error above is one norm over a whole batch: one long decode request, one row of a
# prefill or one split of a row is a small part of that norm, so a wrong one can hide under the
# bar (tests/test_checker_cpu.py measures how often). check_attention holds every request
# AND every query row to the bar on its own, bounds the largest element error of each, checks
# the LSE of every (row, head), and checks that rows which must not be written (the tail of a
# poisoned buffer past the live rows, the rows of a request refused on the device) were not.

# Largest |out - ref| of a request or a row, over the largest |ref| of it. A correct kernel's
# worst element is its rounding of P (a unit roundoff u of the dtype, relative to the row's
# scale) plus the output's own rounding (u again): 2u, i.e. 7.8e-3 in bf16 and 9.8e-4 in fp16.
MAX_ABS = {"float16": 4e-3, "bfloat16": 2e-2}
# |lse - ref_lse| in natural-log units, per (row, head): the kernels keep the softmax sums and
# every LSE in fp32, so a correct one is off by ~1e-6 times the LSE's size.
LSE_TOL = {"float16": 1e-3, "bfloat16": 1e-3}


@dataclasses.dataclass
class AttentionCheck:
    """What :func:`check_attention` found. Truthy when nothing failed.

    ``failures``: one line per failing request, row, LSE row or written-when-it-must-not row,
    each with its numbers. ``worst``: the largest figure of each kind over the whole result
    (``request_rel``, ``row_rel``, ``max_abs``, ``lse_abs``), with where it was, printed by
    :meth:`summary` for a passing result too, so a log shows the margin left."""

    label: str
    failures: list
    worst: dict
    counts: dict

    def __bool__(self):
        return not self.failures

    @property
    def ok(self):
        return not self.failures

    def failing(self, kind):
        """The failure lines of one kind: request, row, lse, unwritten, nan, written."""
        return [f for f in self.failures if f.startswith(kind + " ")]

    def summary(self):
        parts = []
        for key, text in (("request_rel", "worst request rel"), ("row_rel", "worst row rel"),
                          ("max_abs", "worst max-abs/max|ref|"), ("lse_abs", "worst lse abs")):
            if key in self.worst:
                value, where = self.worst[key]
                parts.append(f"{text} {value:.2e} ({where})")
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items())
        head = f"{self.label}: " if self.label else ""
        return f"{head}{'ok' if self.ok else f'{len(self.failures)} FAILING'}; {'; '.join(parts)}; checked {counts}"

    def report(self, limit=40):
        lines = [self.summary()] + self.failures[:limit]
        if len(self.failures) > limit:
            lines.append(f"... and {len(self.failures) - limit} more")
        return "\n".join(lines)

    def assert_ok(self):
        if self.failures:
            raise AssertionError(self.report())
        return self


def _poisoned(x, poison):
    """Elementwise: does x still hold the poison value (NaN poison: is NaN)?"""
    if isinstance(poison, float) and math.isnan(poison):
        return np.isnan(x)
    return x == np.asarray(poison, np.float64)


def check_attention(out, ref, dtype, *, q_lens=None, q_indptr=None, lse=None, ref_lse=None, poison=None,
                    refused=(), label="", tol=None, max_abs=None, lse_tol=None) -> AttentionCheck:
    """Compares a kernel's result with this module's float64 reference, request by request and
    query row by query row, and reports every one that fails with its numbers.

    Args:
        out: ``[R, H_q, D]`` the kernel's output buffer as it came back (any float dtype, NumPy,
            CuPy or torch). Its first ``T = sum(q_lens)`` rows are the live rows; rows ``T ..
            R - 1`` (a preallocated buffer's tail) must still hold ``poison``.
        ref: ``[T, H_q, D]`` the reference (:func:`paged_attention`).
        dtype: ``"float16"`` or ``"bfloat16"``: picks the bars (:data:`TOL`, :data:`MAX_ABS`,
            :data:`LSE_TOL`); ``tol`` / ``max_abs`` / ``lse_tol`` override them.
        q_lens / q_indptr: ``[B]`` query tokens per request, or ``[B + 1]`` their offsets (one of
            the two): which rows belong to which request.
        lse, ref_lse: optional ``[R, H_q]`` kernel LSE (its tail poisoned like ``out``'s) and
            ``[T, H_q]`` reference LSE: every (row, head) within ``lse_tol``.
        poison: the value ``out`` (and ``lse``) were filled with before the run. Required when
            ``out`` has a tail or ``refused`` is given. A live element still holding it was
            never written.
        refused: requests whose rows must hold ``poison`` untouched (a row the device refused).

    Checked, each failure one line:
        ``nan``       a live row with NaN / inf elements (or ``unwritten``: still the poison);
        ``request``   a request whose relative error ``||out - ref|| / ||ref||`` over its rows is
                      over ``tol``, or whose ``max|out - ref| / max|ref|`` is over ``max_abs``;
        ``row``       the same for one query row (all heads) of a request of several rows;
        ``lse``       a row with some head's ``|lse - ref_lse|`` over ``lse_tol``;
        ``written``   a tail row or a refused request's row that does not hold the poison.

    Returns an :class:`AttentionCheck` (truthy when all passed; ``.assert_ok()`` raises with the
    report).
    """
    tol = TOL[dtype] if tol is None else tol
    max_abs = MAX_ABS[dtype] if max_abs is None else max_abs
    lse_tol = LSE_TOL[dtype] if lse_tol is None else lse_tol
    got = np.asarray(_to_numpy(out), np.float64)
    want = np.asarray(_to_numpy(ref), np.float64)
    if (q_lens is None) == (q_indptr is None):
        raise ValueError("give exactly one of q_lens and q_indptr")
    if q_indptr is None:
        q_indptr = np.concatenate([[0], np.cumsum(np.asarray(_to_numpy(q_lens), np.int64).reshape(-1))])
    indptr = np.asarray(_to_numpy(q_indptr), np.int64).reshape(-1)
    total = int(indptr[-1])
    if want.shape[0] != total or got.ndim != want.ndim or got.shape[1:] != want.shape[1:] or got.shape[0] < total:
        raise ValueError(f"out {got.shape} / ref {want.shape} do not fit {total} live rows")
    refused = sorted({int(b) for b in refused})
    if (got.shape[0] > total or refused) and poison is None:
        raise ValueError("out has rows past the live ones (or refused requests): give the poison they were filled with")
    failures, worst, counts = [], {}, {"requests": 0, "rows": 0}

    def where_of(row):
        b = int(np.searchsorted(indptr, row, side="right") - 1)
        return b, row - int(indptr[b])

    def check_untouched(name, arr, rows, why):
        if arr is None or not len(rows):
            return
        kept = _poisoned(arr[rows], poison).reshape(len(rows), int(np.prod(arr.shape[1:], dtype=np.int64)))
        for r, ok in zip(rows, kept.all(axis=1)):
            if not ok:
                vals = arr[r].reshape(-1)
                bad = ~_poisoned(vals, poison)
                failures.append(f"written {name} row {r} ({why}): {int(bad.sum())} of {bad.size} elements changed "
                                f"(e.g. {vals[bad][0]:.4g}; poison {poison})")

    got_lse = None if lse is None else np.asarray(_to_numpy(lse), np.float64)
    want_lse = None if ref_lse is None else np.asarray(_to_numpy(ref_lse), np.float64)
    if (got_lse is None) != (want_lse is None):
        raise ValueError("give both lse and ref_lse, or neither")
    if got_lse is not None and (got_lse.shape[0] != got.shape[0] or want_lse.shape != want.shape[:2]):
        raise ValueError(f"lse {got_lse.shape} / ref_lse {want_lse.shape} do not fit out {got.shape}")

    tail = np.arange(total, got.shape[0])
    check_untouched("out", got, tail, "past the live rows")
    check_untouched("lse", got_lse, tail, "past the live rows")
    live_row = np.ones(total, bool)
    for b in refused:
        rows = np.arange(indptr[b], indptr[b + 1])
        live_row[rows] = False
        check_untouched("out", got, rows, f"request {b}, refused")
        check_untouched("lse", got_lse, rows, f"request {b}, refused")

    live = got[:total]
    width = int(np.prod(want.shape[1:], dtype=np.int64))  # elements of one row (reshape(0, -1) is ambiguous)
    flat = live.reshape(total, width)
    finite = np.isfinite(flat).all(axis=1)
    for r in np.flatnonzero(live_row & ~finite):
        b, t = where_of(r)
        stale = int(_poisoned(flat[r], poison).sum()) if poison is not None else 0
        kind = "unwritten" if stale == flat.shape[1] else "nan"
        failures.append(f"{kind} row {r} (request {b} token {t}): {int((~np.isfinite(flat[r])).sum())} of "
                        f"{flat.shape[1]} elements not finite")
    if poison is not None and not (isinstance(poison, float) and math.isnan(poison)):
        stale_rows = live_row & finite & _poisoned(flat, poison).any(axis=1)
        for r in np.flatnonzero(stale_rows):
            b, t = where_of(r)
            failures.append(f"unwritten row {r} (request {b} token {t}): {int(_poisoned(flat[r], poison).sum())} "
                            f"elements still hold the poison {poison}")

    d = np.where(np.isfinite(live), live - want, np.inf)
    d = np.where(np.isnan(d), np.inf, d)
    # per row: sum of squares and largest element of the error and of the reference; the rows of
    # refused requests count as nothing (their poison was checked above)
    live_col = live_row[:, None]
    d2 = np.where(live_col, (d * d).reshape(total, width), 0.0).sum(axis=1)
    r2 = np.where(live_col, (want * want).reshape(total, width), 0.0).sum(axis=1)
    dmax = np.where(live_row, np.abs(d).reshape(total, width).max(axis=1, initial=0.0), 0.0)
    rmax = np.where(live_row, np.abs(want).reshape(total, width).max(axis=1, initial=0.0), 0.0)

    def figures(diff2, norm2, dm, rm):  # ||d|| / ||ref|| and max|d| / max|ref| (0 / 0 = 0, x / 0 = inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(norm2 > 0, np.sqrt(diff2 / np.where(norm2 > 0, norm2, 1)), np.where(diff2 > 0, np.inf, 0.0))
            mab = np.where(rm > 0, dm / np.where(rm > 0, rm, 1), np.where(dm > 0, np.inf, 0.0))
        return rel, mab

    row_rel, row_abs = figures(d2, r2, dmax, rmax)
    sizes = np.diff(indptr)
    checked = np.flatnonzero((sizes > 0) & ~np.isin(np.arange(len(sizes)), refused))
    if checked.size:
        starts = indptr[checked]
        # per request: sums and maxima over its rows (segments from each checked request's first row
        # to the next one's; a refused request's rows in between count as nothing)
        req_rel, req_abs = figures(np.add.reduceat(d2, starts), np.add.reduceat(r2, starts),
                                   np.maximum.reduceat(dmax, starts), np.maximum.reduceat(rmax, starts))
        counts["requests"] = int(checked.size)
        i = int(np.argmax(req_rel)); worst["request_rel"] = (float(req_rel[i]), f"request {checked[i]}")
        i = int(np.argmax(req_abs)); worst["max_abs"] = (float(req_abs[i]), f"request {checked[i]}")
        for b, rel, mab in zip(checked, req_rel, req_abs):
            if not (rel <= tol and mab <= max_abs):
                lo, hi = int(indptr[b]), int(indptr[b + 1])
                failures.append(f"request {b} (rows {lo}..{hi - 1}, q_len {hi - lo}): rel {rel:.3e} (bar {tol:g}), "
                                f"max-abs/max|ref| {mab:.3e} (bar {max_abs:g})")
        # rows of requests of several rows (a one-row request was just checked as a request)
        multi = np.zeros(total, bool)
        for b in checked[sizes[checked] > 1]:
            multi[indptr[b]:indptr[b + 1]] = True
        if multi.any():
            counts["rows"] = int(multi.sum())
            rows = np.flatnonzero(multi)
            r = int(rows[np.argmax(row_rel[rows])])
            b, t = where_of(r)
            worst["row_rel"] = (float(row_rel[r]), f"row {r} = request {b} token {t}")
            for r in rows[~((row_rel[rows] <= tol) & (row_abs[rows] <= max_abs))]:
                b, t = where_of(int(r))
                failures.append(f"row {r} (request {b} token {t}): rel {row_rel[r]:.3e} (bar {tol:g}), "
                                f"max-abs/max|ref| {row_abs[r]:.3e} (bar {max_abs:g})")

    if got_lse is not None and live_row.any():
        mine, theirs = got_lse[:total], want_lse
        with np.errstate(invalid="ignore"):
            err = np.where(mine == theirs, 0.0, np.abs(mine - theirs))  # matching infinities agree
        err = np.where(np.isnan(err), np.inf, err)
        per_row = np.where(live_row, err.max(axis=1, initial=0.0), 0.0)
        counts["lse rows"] = int(live_row.sum())
        r = int(np.argmax(per_row))
        b, t = where_of(r)
        worst["lse_abs"] = (float(per_row[r]), f"row {r} = request {b} token {t}")
        for r in np.flatnonzero(live_row & ~(per_row <= lse_tol)):
            b, t = where_of(int(r))
            h = int(np.argmax(err[r]))
            failures.append(f"lse row {r} (request {b} token {t}): max |lse - ref| {per_row[r]:.3e} at head {h} "
                            f"(got {mine[r, h]:.6g}, ref {theirs[r, h]:.6g}; bar {lse_tol:g})")
    if refused:
        counts["refused requests"] = len(refused)
    if len(tail):
        counts["tail rows"] = len(tail)
    return AttentionCheck(label, failures, worst, counts)
