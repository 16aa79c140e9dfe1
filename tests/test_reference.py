"""CPU tests of cupy_fa.reference against an independent per-query loop.

Inputs are fresh random draws each run; the seed is printed (shown on failure) and
CUPY_FA_SEED=<seed> replays it (tests/cases.py new_rng).
"""

import math
import time

import ml_dtypes
import numpy as np
import pytest

from cases import new_rng
from cupy_fa import reference
from cupy_fa.reference import paged_attention, relative_error


@pytest.fixture
def rng():
    return new_rng()[0]


def make_batch(rng, lens, page_size, h_q, h_kv, d, dtype=np.float64):
    """Random paged batch for ``lens = [(q_len, kv_len), ...]``.

    Pages are handed out in shuffled order (with spare pages between), the page table is
    padded with -1, and every cache slot no request owns is NaN, so reading outside the
    contract shows up. Returns ``(q, k_cache, v_cache, q_lens, kv_lens, page_table)``.
    """
    q_lens = np.array([a for a, _ in lens], np.int32)
    kv_lens = np.array([b for _, b in lens], np.int32)
    need = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(need) + 3
    free = list(rng.permutation(num_pages))
    page_table = np.full((len(lens), max(need + [1]) + 1), -1, np.int32)
    k = np.full((num_pages, page_size, h_kv, d), np.nan)
    v = np.full_like(k, np.nan)
    for b, kv in enumerate(kv_lens):
        for j in range(need[b]):
            page = free.pop()
            page_table[b, j] = page
            n = min(page_size, kv - j * page_size)
            k[page, :n] = rng.standard_normal((n, h_kv, d))
            v[page, :n] = rng.standard_normal((n, h_kv, d))
    q = rng.standard_normal((int(q_lens.sum()), h_q, d))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), q_lens, kv_lens, page_table


def naive(q, k_cache, v_cache, q_lens, kv_lens, page_table, causal=True, sm_scale=None, masks=None):
    """Per query and head: list the visible keys, look each up through the page table,
    dense softmax. ``masks``: None or a list of B bool [q_len, q_len]."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    total, h_q, d = q.shape
    page_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((total, h_q, d))
    lse = np.full((total, h_q), -np.inf)
    row = 0
    for b in range(len(q_lens)):
        n, kv = int(q_lens[b]), int(kv_lens[b])
        for i in range(n):
            prefix = kv - n
            if masks is not None:
                keys = [j for j in range(kv) if j < prefix or masks[b][i][j - prefix]]
            elif causal:
                keys = list(range(prefix + i + 1))
            else:
                keys = list(range(kv))
            if not keys:
                continue
            slots = [(page_table[b][j // page_size], j % page_size) for j in keys]
            k_vis = np.stack([k_cache[p, o] for p, o in slots])  # [keys, H_kv, D]
            v_vis = np.stack([v_cache[p, o] for p, o in slots])
            for h in range(h_q):
                hk = h // (h_q // h_kv)
                ks, vs = k_vis[:, hk], v_vis[:, hk]
                s = ks @ q[row + i, h] * scale
                mx = s.max()
                w = np.exp(s - mx)
                out[row + i, h] = w @ vs / w.sum()
                lse[row + i, h] = mx + math.log(w.sum())
        row += n
    return out, lse


MIXED = [(1, 1), (1, 17), (5, 5), (0, 0), (4, 23), (0, 9), (7, 40), (3, 3)]


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (3, 1)])
def test_matches_naive(rng, page_size, causal, heads):
    h_q, h_kv = heads
    batch = make_batch(rng, MIXED, page_size, h_q, h_kv, 16)
    out, lse = paged_attention(*batch, causal=causal, return_lse=True)
    ref_out, ref_lse = naive(*batch, causal=causal)
    assert out.dtype == np.float64 and out.shape == batch[0].shape
    assert lse.dtype == np.float64 and lse.shape == batch[0].shape[:2]
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_sm_scale(rng):
    batch = make_batch(rng, [(3, 10), (1, 6)], 4, 4, 2, 8)
    out, lse = paged_attention(*batch, sm_scale=0.3, return_lse=True)
    ref_out, ref_lse = naive(*batch, sm_scale=0.3)
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)
    default = paged_attention(*batch)
    explicit = paged_attention(*batch, sm_scale=1 / math.sqrt(8))
    np.testing.assert_array_equal(default, explicit)


def test_causal_q_len_equals_kv_len_first_row_is_v(rng):
    """Prefill from empty: query 0 sees only key 0, so its output is exactly V[0], lse = s00."""
    q, k, v, q_lens, kv_lens, pt = make_batch(rng, [(6, 6)], 4, 2, 2, 8)
    out, lse = paged_attention(q, k, v, q_lens, kv_lens, pt, return_lse=True)
    np.testing.assert_allclose(out[0], v[pt[0, 0], 0], rtol=1e-12)
    np.testing.assert_allclose(lse[0], np.einsum("hd,hd->h", q[0], k[pt[0, 0], 0]) / math.sqrt(8), rtol=1e-12,
                               atol=1e-14)  # (a score near 0: float64 rounding of another summation order)


@pytest.mark.parametrize("flat", [False, True])
def test_lower_triangular_mask_equals_causal(rng, flat):
    lens = [(4, 9), (1, 1), (0, 0), (5, 5), (3, 30)]
    batch = make_batch(rng, lens, 3, 8, 2, 16)
    masks = [np.tril(np.ones((n, n), bool)) for n, _ in lens]
    mask = np.concatenate([m.reshape(-1) for m in masks]) if flat else masks
    out, lse = paged_attention(*batch, custom_mask=mask, causal=False, return_lse=True)
    ref_out, ref_lse = paged_attention(*batch, causal=True, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-14)


def test_random_tree_mask_matches_naive(rng):
    lens = [(5, 12), (4, 4), (0, 3), (6, 20)]
    batch = make_batch(rng, lens, 3, 8, 2, 16)
    masks = []
    for n, _ in lens:
        m = rng.random((n, n)) < 0.5
        np.fill_diagonal(m, True)  # a draft sees itself, as in a real tree
        masks.append(m)
    out, lse = paged_attention(*batch, custom_mask=masks, return_lse=True)
    ref_out, ref_lse = naive(*batch, masks=masks)
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)
    # The mask must matter: differs from causal for some row.
    assert relative_error(out, paged_attention(*batch)) > 1e-6


def test_query_that_sees_nothing(rng):
    """No prefix and an all-False mask row: out 0, lse -inf, no NaN."""
    batch = make_batch(rng, [(2, 2)], 2, 2, 1, 4)
    mask = [np.array([[True, False], [False, False]])]
    out, lse = paged_attention(*batch, custom_mask=mask, return_lse=True)
    assert np.isfinite(out).all()
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf) and np.isfinite(lse[0]).all()


def test_padded_rows_write_nothing(rng):
    """q_len = 0 rows add no output rows and do not change the live requests' results."""
    lens = [(0, 0), (2, 7), (0, 5), (1, 4), (0, 0)]
    q, k, v, q_lens, kv_lens, pt = make_batch(rng, lens, 4, 4, 2, 8)
    out, lse = paged_attention(q, k, v, q_lens, kv_lens, pt, return_lse=True)
    assert out.shape == (3, 4, 8) and lse.shape == (3, 4)
    live = q_lens > 0
    out2, lse2 = paged_attention(q, k, v, q_lens[live], kv_lens[live], pt[live], return_lse=True)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)


def test_all_padded_batch(rng):
    q, k, v, q_lens, kv_lens, pt = make_batch(rng, [(0, 0), (0, 3)], 4, 4, 2, 8)
    out, lse = paged_attention(q, k, v, q_lens, kv_lens, pt, return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)


def test_page_table_is_read(rng):
    """Swapping a page between two requests changes both, and only them."""
    lens = [(2, 10), (3, 12), (1, 6)]
    q, k, v, q_lens, kv_lens, pt = make_batch(rng, lens, 4, 4, 2, 8)
    out = paged_attention(q, k, v, q_lens, kv_lens, pt)
    bad = pt.copy()
    bad[0, 1], bad[1, 0] = pt[1, 0], pt[0, 1]
    out_bad = paged_attention(q, k, v, q_lens, kv_lens, bad)
    rows = np.repeat(np.arange(3), q_lens)
    for b in (0, 1):
        assert relative_error(out_bad[rows == b], out[rows == b]) > 1e-3
    np.testing.assert_array_equal(out_bad[rows == 2], out[rows == 2])


def test_kv_len_is_the_extent_after_the_write(rng):
    """Dropping the last written token (kv_len - 1, the seed bug's mistake) changes the answer."""
    q, k, v, q_lens, kv_lens, pt = make_batch(rng, [(3, 11)], 4, 4, 2, 8)
    right = paged_attention(q, k, v, q_lens, kv_lens, pt)
    wrong = paged_attention(q, k, v, q_lens, kv_lens - 1, pt)
    assert relative_error(wrong, right) > 1e-3


def test_chunked_rows_match_naive(rng, monkeypatch):
    """A tiny score budget forces many row chunks (and causal key cut-offs) per request."""
    monkeypatch.setattr(reference.attention, "_SCORE_BUDGET", 64)
    batch = make_batch(rng, [(9, 9), (6, 14), (1, 5)], 3, 4, 2, 8)
    for causal in (True, False):
        out, lse = paged_attention(*batch, causal=causal, return_lse=True)
        ref_out, ref_lse = naive(*batch, causal=causal)
        np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_low_precision_inputs_are_widened(rng, dtype):
    q, k, v, q_lens, kv_lens, pt = make_batch(rng, [(2, 9), (1, 3)], 4, 4, 2, 8, dtype=dtype)
    out, lse = paged_attention(q, k, v, q_lens, kv_lens, pt, return_lse=True)
    ref_out, ref_lse = naive(q, k, v, q_lens, kv_lens, pt)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)


def test_device_like_inputs_are_fetched(rng):
    """Objects with .get() (the CuPy protocol) are copied to the host."""

    class FakeDeviceArray:
        def __init__(self, a):
            self._a = a

        def get(self):
            return self._a

    batch = make_batch(rng, [(2, 6)], 2, 2, 1, 4)
    out = paged_attention(*(FakeDeviceArray(x) for x in batch))
    np.testing.assert_array_equal(out, paged_attention(*batch))


@pytest.mark.cpu_torch
def test_torch_inputs(rng):
    import torch

    batch = make_batch(rng, [(2, 6), (1, 3)], 2, 2, 1, 4, dtype=ml_dtypes.bfloat16)
    q, k, v = (torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16) for x in batch[:3])
    out = paged_attention(q, k, v, *(torch.from_numpy(x) for x in batch[3:]))
    np.testing.assert_array_equal(out, paged_attention(*batch))


def test_invalid_inputs_raise(rng):
    q, k, v, q_lens, kv_lens, pt = make_batch(rng, [(2, 6), (1, 3)], 2, 2, 1, 4)
    with pytest.raises(ValueError):
        paged_attention(q, k, v, q_lens, np.array([1, 3]), pt)  # q_len > kv_len
    with pytest.raises(ValueError):
        paged_attention(q[:2], k, v, q_lens, kv_lens, pt)  # rows != sum(q_lens)
    with pytest.raises(ValueError):
        paged_attention(q, k, v, q_lens, kv_lens, pt[:, :1])  # table too narrow
    with pytest.raises(ValueError):
        paged_attention(q, k, v, q_lens, np.array([6, 8]), pt)  # reaches a -1 page
    with pytest.raises(ValueError):
        paged_attention(q, k, v, q_lens, kv_lens, pt, custom_mask=[np.ones((2, 2), bool)])


def test_relative_error():
    a = np.arange(6.0).reshape(2, 3)
    assert relative_error(a, a) == 0.0
    assert relative_error(a * 1.01, a) == pytest.approx(0.01)
    b = a.copy()
    b[0, 1] = np.nan
    assert relative_error(b, a) == math.inf
    assert relative_error(a, b) == math.inf
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_error(np.ones(3), np.zeros(3)) == math.inf
    lse = np.array([1.0, -np.inf])
    assert relative_error(lse, lse) == 0.0
    assert relative_error(np.array([1.0, 0.0]), lse) == math.inf
    assert relative_error(a.astype(ml_dtypes.bfloat16), a) == 0.0
    with pytest.raises(ValueError):
        relative_error(a, a[0])


def test_large_batch_is_fast(rng):
    """33 requests with kv_len up to 8192 (decode and verify): spot-checked, and quick."""
    lens = [(int(rng.integers(1, 9)), int(rng.integers(4096, 8193))) for _ in range(33)]
    lens[0] = (1, 8192)
    q, k, v, q_lens, kv_lens, pt = make_batch(rng, lens, 16, 8, 2, 64, dtype=ml_dtypes.bfloat16)
    t = time.perf_counter()
    out = paged_attention(q, k, v, q_lens, kv_lens, pt)
    elapsed = time.perf_counter() - t
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    for b in (0, 32):
        sel = slice(cu[b], cu[b + 1])
        ref, _ = naive(q[sel], k, v, q_lens[b : b + 1], kv_lens[b : b + 1], pt[b : b + 1])
        np.testing.assert_allclose(out[sel], ref, rtol=1e-9, atol=1e-12)
    assert elapsed < 20, f"reference took {elapsed:.1f} s"
