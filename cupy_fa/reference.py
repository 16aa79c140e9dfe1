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

import math

import numpy as np

__all__ = ["paged_attention", "relative_error"]

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
):
    """Reference paged attention in float64.

    Args:
        q: ``[sum(q_lens), H_q, D]`` queries.
        k_cache, v_cache: ``[num_pages, page_size, H_kv, D]``.
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

    Returns:
        ``out`` float64 ``[sum(q_lens), H_q, D]``, and with ``return_lse`` also ``lse``
        float64 ``[sum(q_lens), H_q]`` (natural log). A query that sees no key gets
        ``out = 0`` and ``lse = -inf``.
    """
    q = _to_numpy(q)
    k_cache = _to_numpy(k_cache)
    v_cache = _to_numpy(v_cache)
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

            if masks is not None:
                visible = np.ones((nr, hi), bool)
                visible[:, prefix:] = masks[b][r0:r1]
            elif causal:
                visible = np.arange(hi)[None, :] <= (prefix + np.arange(r0, r1))[:, None]
            else:
                visible = None
            if visible is not None:
                np.copyto(s, -np.inf, where=~visible[None])

            m = s.max(axis=-1, keepdims=True)  # [H_q, nr, 1]
            m[~np.isfinite(m)] = 0.0
            p = np.exp(np.subtract(s, m, out=s), out=s)  # in place, like s_buf below
            denom = p.sum(axis=-1, keepdims=True)
            o = (p.reshape(num_kv_heads, group * nr, hi) @ vt).reshape(num_qo_heads, nr, head_dim)
            with np.errstate(divide="ignore", invalid="ignore"):
                o = np.where(denom > 0, o / denom, 0.0)
                l = np.log(denom[..., 0]) + m[..., 0]
            out[cu[b] + r0 : cu[b] + r1] = o.transpose(1, 0, 2)
            lse[cu[b] + r0 : cu[b] + r1] = l.T
    return (out, lse) if return_lse else out


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
