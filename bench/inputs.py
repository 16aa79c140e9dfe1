"""Input sets (paged caches, q, out) on the device, and the fp64 reference check.

Values are normal(0, 1) drawn in float32 by cupy.random and rounded to bf16 (nearest even)
by integer arithmetic on the bits, so nothing here needs CuPy to do bf16 arithmetic; fp16 is
CuPy's own conversion.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .workloads import FP8_SCALE, H_KV, H_Q, Workload

BF16_NAN_BITS = 0x7FC0
FP16_NAN_BITS = 0x7E00
_CHUNK = 1 << 26  # elements per random-fill chunk (256 MB of float32)


def bf16_dtype():
    from cupy_fa import _arrays

    return _arrays.DTYPES["bfloat16"]


def elem_dtype(name):
    """The NumPy dtype of a cupy_fa dtype name ("bfloat16", "float16")."""
    from cupy_fa import _arrays

    return _arrays.DTYPES[name]


def empty_bf16(shape):
    import cupy

    return cupy.empty(shape, bf16_dtype())


def _is_bf16(arr):
    return arr.dtype == bf16_dtype()


def fill_normal(arr):
    """Fill a bf16 or fp16 cupy array with normal(0,1) values, in chunks."""
    import cupy

    if not _is_bf16(arr):
        flat = arr.reshape(-1)
        for lo in range(0, flat.size, _CHUNK):
            hi = min(flat.size, lo + _CHUNK)
            flat[lo:hi] = cupy.random.standard_normal(hi - lo, dtype=cupy.float32).astype(arr.dtype)
        return arr
    bits = arr.view(cupy.uint16).reshape(-1)
    for lo in range(0, bits.size, _CHUNK):
        hi = min(bits.size, lo + _CHUNK)
        u = cupy.random.standard_normal(hi - lo, dtype=cupy.float32).view(cupy.uint32)
        bits[lo:hi] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)
    return arr


def poison(arr):
    """Set every element of a bf16 or fp16 cupy array to NaN."""
    import cupy

    arr.view(cupy.uint16).fill(BF16_NAN_BITS if _is_bf16(arr) else FP16_NAN_BITS)


def count_nan(arr) -> int:
    """NaN elements of a bf16 or fp16 cupy array (an unwritten poisoned element counts)."""
    import cupy

    bits = arr.view(cupy.uint16)
    return int(((bits & 0x7FFF) > (0x7F80 if _is_bf16(arr) else 0x7C00)).sum())


def to_host_f64(x) -> np.ndarray:
    """A device array (cupy bf16 / fp16 or torch) as a float64 host array."""
    import cupy

    if isinstance(x, cupy.ndarray):
        if x.dtype == bf16_dtype():
            return to_host_bf16(x).astype(np.float64)
        return cupy.asnumpy(x).astype(np.float64)
    return x.detach().float().cpu().numpy().astype(np.float64)  # torch


def as_torch(x):
    """Zero-copy torch view of a cupy array (bf16 stays bf16)."""
    import cupy
    import torch

    try:
        t = torch.from_dlpack(x)
        if t.dtype == torch.bfloat16 or x.dtype != bf16_dtype():
            return t
    except Exception:  # noqa: BLE001 - fall back to a bit-level view
        pass
    return torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)


@dataclass
class InputSet:
    cache: object  # cupy_fa.PagedKVCache
    q: object  # cupy [sum(q_lens), H_q, D] of the workload's dtype
    out: object  # the same shape and dtype


@dataclass
class Inputs:
    workload: Workload
    page_size: int
    q_lens: np.ndarray  # int32 [B]
    kv_lens: np.ndarray  # int32 [B]
    page_table: np.ndarray  # int32 [B, pages of the longest request]: a random permutation of the pages, dealt
    sets: list              # to the requests in order (a shorter request's row padded with page 0)
    sinks: object = None    # float32 [H_q] host attention sinks (workload.sinks), and on the device:
    sinks_dev: object = None

    @property
    def cu_q(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int64)


def make_inputs(w: Workload, page_size: int, n_sets: int, seed: int) -> Inputs:
    import cupy
    import cupy_fa

    rng = np.random.default_rng(seed)
    cupy.random.seed(seed)
    n_pages = w.num_pages(page_size)
    perm = rng.permutation(n_pages).astype(np.int32)
    if w.uniform:
        page_table = perm.reshape(w.batch, w.pages_per_request(page_size))
    else:
        page_table = np.zeros((w.batch, w.pages_per_request(page_size)), np.int32)
        start = 0
        for b, n in enumerate(w.pages_of(page_size)):
            page_table[b, :n] = perm[start:start + n]
            start += n
    elem = elem_dtype(w.dtype)
    sets = []
    for _ in range(n_sets):
        cache = cupy_fa.PagedKVCache.allocate(n_pages, page_size, H_KV, w.head_dim, dtype=w.dtype,
                                              head_dim_v=w.head_dim_vo or None)
        fill_normal(cache.k)
        fill_normal(cache.v)
        if w.fp8:  # the 16-bit values quantised on the device (PagedKVCache.append), one scale per tensor
            fp8 = cupy_fa.PagedKVCache.allocate(n_pages, page_size, H_KV, w.head_dim, w.kv_dtype,
                                                k_scale=FP8_SCALE, v_scale=FP8_SCALE)
            slots = cupy.arange(cache.num_slots, dtype=cupy.int64)
            fp8.append(cache.k.reshape(-1, H_KV, w.head_dim), cache.v.reshape(-1, H_KV, w.head_dim), slots)
            del cache
            cache = fp8
        q = fill_normal(cupy.empty((w.num_q_rows, H_Q, w.head_dim), elem))
        out = cupy.empty((w.num_q_rows, H_Q, w.dim_vo), elem)
        poison(out)
        sets.append(InputSet(cache, q, out))
    sinks = rng.normal(1.0, 1.5, H_Q).astype(np.float32) if w.sinks else None  # logits that weigh in
    cupy.cuda.Device().synchronize()
    return Inputs(w, page_size, np.array(w.q_lens, np.int32), np.array(w.kv_lens, np.int32), page_table, sets,
                  sinks, None if sinks is None else cupy.asarray(sinks))


def reference_windows(inp: Inputs, s: InputSet, windows) -> dict:
    """fp64 reference for each (b, r0, r1) window of set s: rows r0..r1-1 of request b.

    A window is its own request: q_len = r1 - r0 and, causal, kv_len = kv_len - q_len + r1 (the
    keys row r1-1 can see; non-causal every key), over b's pages gathered in order (so its page
    table is 0..n-1); its rows keep their positions, so the workload's sliding window, soft-cap and
    sinks apply as they are.
    """
    import cupy
    from cupy_fa import reference

    refs = {}
    cu = inp.cu_q
    for b, r0, r1 in windows:
        ql, kl = int(inp.q_lens[b]), int(inp.kv_lens[b])
        kv_eff = kl - ql + r1 if inp.workload.causal else kl
        n_pages = -(-kv_eff // inp.page_size)
        pages = cupy.asarray(inp.page_table[b, :n_pages].astype(np.int64))
        if s.cache.is_fp8:  # the e4m3 bytes and their scales (the reference dequantises)
            k, v = s.cache.k[pages].get(), s.cache.v[pages].get()
            scales = dict(k_scale=s.cache.k_scale, v_scale=s.cache.v_scale)
        else:
            k, v = to_host_elems(s.cache.k, pages), to_host_elems(s.cache.v, pages)
            scales = {}
        q = to_host_elems(s.q[cu[b] + r0: cu[b] + r1])
        refs[(b, r0, r1)] = reference.paged_attention(
            q, k, v, np.array([r1 - r0], np.int32), np.array([kv_eff], np.int32),
            np.arange(n_pages, dtype=np.int32)[None], causal=inp.workload.causal,
            window=inp.workload.window or None, soft_cap=inp.workload.soft_cap or None, sinks=inp.sinks, **scales)
    return refs


def to_host_elems(x, rows=None) -> np.ndarray:
    """A cupy bf16 / fp16 array (its ``rows`` if given) to the host in its own dtype, gathered
    and copied as 16-bit words."""
    import cupy

    bits = x.view(cupy.uint16)
    if rows is not None:
        bits = bits[rows]
    return cupy.ascontiguousarray(bits).get().view(x.dtype)


def to_host_bf16(x) -> np.ndarray:
    """A cupy bf16 (or uint16 bit-view) array to the host as ml_dtypes bf16, gathering and
    copying on the bits only (CuPy's own kernels need not know bf16)."""
    import cupy

    bits = x if x.dtype == np.uint16 else x.view(cupy.uint16)
    return cupy.ascontiguousarray(bits).get().view(bf16_dtype())


def max_error(inp: Inputs, rows_of, refs: dict) -> float:
    """Largest relative error over the windows; rows_of(lo, hi) gives flat rows lo..hi-1
    of an implementation's output [T, H_q, D] as a float64 host array."""
    from cupy_fa import reference

    cu = inp.cu_q
    errs = [reference.relative_error(rows_of(cu[b] + r0, cu[b] + r1), ref) for (b, r0, r1), ref in refs.items()]
    return float(max(errs))
