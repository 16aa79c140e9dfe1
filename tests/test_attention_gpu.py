"""GPU correctness of BatchAttention against the float64 reference."""

import itertools

import numpy as np
import pytest

from cases import TOL, fill_cache, new_rng, np_dtype, paged_case, paged_layout, random_lengths, tree_masks

pytestmark = pytest.mark.gpu

HEADS = [(8, 8), (32, 8), (16, 2), (8, 1)]
HEAD_DIMS = [64, 128, 256]
PAGE_SIZES = [1, 16, 64]
DTYPES = ["float16", "bfloat16"]



def run_case(rng, dtype, heads, head_dim, page_size, causal, lengths, custom_mask=None):
    import cupy
    import cupy_fa
    from cupy_fa import reference

    h_q, h_kv = heads
    q_lens, kv_lens = lengths
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total)
    q = cupy.asarray(q_host)
    out = cupy.full((total, h_q, head_dim), np.nan, np_dtype(dtype))
    lse = cupy.full((total, h_q), np.nan, np.float32)

    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
    attn.plan(q_lens, kv_lens, table, causal=causal, custom_mask=custom_mask)
    result = attn.run(q, cache, out=out, lse=lse, return_lse=True)
    assert result[0] is out and result[1] is lse
    cupy.cuda.get_current_stream().synchronize()

    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, table, causal=causal,
                                             custom_mask=custom_mask, return_lse=True)
    got = out.get().astype(np.float64)
    got_lse = lse.get().astype(np.float64)
    assert np.isfinite(got).all(), f"{np.isnan(got).sum()} output elements not written or NaN"
    assert np.isfinite(got_lse).all(), "LSE not written or NaN"
    err = reference.relative_error(got, ref)
    lse_err = float(np.abs(got_lse - ref_lse).max())
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]}"
    assert lse_err < 1e-2, f"LSE max abs error {lse_err:.2e}"
    return err, lse_err, attn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_random_ragged_batch(dtype, head_dim, heads, page_size, causal):
    rng, seed = new_rng()
    budget = 2_500_000 // heads[0] * 8
    lengths = random_lengths(rng, work_budget=budget)
    err, lse_err, _ = run_case(rng, dtype, heads, head_dim, page_size, causal, lengths)
    print(f"seed={seed} B={len(lengths[0])} err={err:.2e} lse_err={lse_err:.2e}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["decode_long", "prefill_full", "verify", "single_key"])
def test_named_shapes(dtype, shape):
    """Shapes that exercise the split-KV merge and the tile-boundary cases."""
    rng, _ = new_rng()
    q_lens, kv_lens = {
        "decode_long": (np.array([1, 1, 1]), np.array([8192, 5000, 513])),
        "prefill_full": (np.array([300, 77]), np.array([300, 77])),
        "verify": (np.array([4, 8, 6]), np.array([4100, 2048, 7])),
        "single_key": (np.array([1]), np.array([1])),
    }[shape]
    for page_size in PAGE_SIZES:
        run_case(rng, dtype, (32, 8), 128, page_size, True, (q_lens, kv_lens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_padded_batch(dtype):
    """1500 requests, a third of them padding (q_len 0): the attention and merge kernels map
    each CTA to its request with a warp-wide search over the offsets, three rounds of 32
    probes here, through runs of equal offsets; every row lands on its own request."""
    rng, seed = new_rng()
    batch = 1500
    q_lens = rng.integers(0, 4, batch) * (rng.random(batch) < 0.67)
    kv_lens = q_lens + rng.integers(0, 1200, batch)  # up to three splits of 512
    kv_lens[q_lens == 0] = rng.integers(0, 50, int((q_lens == 0).sum()))
    err, _, _ = run_case(rng, dtype, (8, 2), 64, 16, True, (q_lens, kv_lens))
    print(f"seed={seed} err={err:.2e}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_mask_tree(dtype):
    """Tree verify: a custom mask among the drafts, prefix fully visible."""
    rng, _ = new_rng()
    q_lens = np.array([5, 8, 3])
    kv_lens = np.array([700, 9, 3000])
    masks = tree_masks(rng, q_lens)
    flat = np.concatenate([m.ravel() for m in masks])
    for page_size in (1, 16):
        run_case(rng, dtype, (16, 2), 128, page_size, True, (q_lens, kv_lens), custom_mask=flat)


def test_padded_rows_write_nothing():
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    q_lens, kv_lens = np.array([3, 0, 2]), np.array([10, 40, 2])
    table, num_pages = paged_layout(rng, kv_lens, 16)
    k, v = fill_cache(rng, (num_pages, 16, 2, 64), np.float16, table, kv_lens, 16)
    cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v))
    attn = cupy_fa.BatchAttention(4, 2, 64, "float16")
    attn.plan(q_lens, kv_lens, table)
    q = cupy.asarray(rng.standard_normal((5, 4, 64)).astype(np.float16))
    out = attn.run(q, cache)
    assert out.shape == (5, 4, 64) and bool(cupy.isfinite(out).all())


def test_append_matches_slots():
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    for dtype, index in itertools.product(DTYPES, (np.int32, np.int64)):
        cache = cupy_fa.PagedKVCache.allocate(37, 16, 4, 128, dtype)
        slots = rng.permutation(37 * 16)[:100].astype(index)
        k_new = rng.standard_normal((100, 4, 128)).astype(np_dtype(dtype))
        v_new = rng.standard_normal((100, 4, 128)).astype(np_dtype(dtype))
        cache.append(cupy.asarray(k_new), cupy.asarray(v_new), cupy.asarray(slots))
        k_all = cache.k.get().reshape(-1, 4, 128)
        v_all = cache.v.get().reshape(-1, 4, 128)
        np.testing.assert_array_equal(k_all[slots], k_new)
        np.testing.assert_array_equal(v_all[slots], v_new)
        untouched = np.setdiff1d(np.arange(37 * 16), slots)
        assert not k_all[untouched].astype(np.float32).any()
        # host slots are range-checked and nothing is written on error
        before = cache.k.get()
        with pytest.raises(ValueError, match="slots"):
            cache.append(cupy.asarray(k_new[:2]), cupy.asarray(v_new[:2]), np.array([0, 37 * 16]))
        np.testing.assert_array_equal(cache.k.get(), before)


def test_torch_interop_zero_copy():
    import torch

    import cupy_fa
    from cupy_fa import reference

    rng, _ = new_rng()
    q_lens, kv_lens = np.array([1, 7, 200]), np.array([1000, 7, 900])
    table, num_pages = paged_layout(rng, kv_lens, 16)
    k, v = fill_cache(rng, (num_pages, 16, 8, 128), np.float32, table, kv_lens, 16)
    k_t = torch.from_numpy(k).to("cuda", torch.bfloat16)
    v_t = torch.from_numpy(v).to("cuda", torch.bfloat16)
    cache = cupy_fa.PagedKVCache(k_t, v_t)
    assert cache.k.data.ptr == k_t.data_ptr() and cache.v.data.ptr == v_t.data_ptr()
    q_t = torch.randn(208, 32, 128, device="cuda", dtype=torch.bfloat16)
    out_t = torch.full_like(q_t, float("nan"))
    attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16")
    attn.plan(q_lens, kv_lens, table)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # launched on torch's current stream
        got = attn.run(q_t, cache, out=out_t)
        fresh, lse = attn.run(q_t, cache, return_lse=True)
    stream.synchronize()
    assert got is out_t
    assert isinstance(fresh, torch.Tensor) and isinstance(lse, torch.Tensor) and fresh.is_cuda
    ref = reference.paged_attention(q_t.float().cpu().numpy(), k_t.float().cpu().numpy(), v_t.float().cpu().numpy(),
                                    q_lens, kv_lens, table)
    for tensor in (out_t, fresh):
        assert torch.isfinite(tensor).all()
        assert reference.relative_error(tensor.float().cpu().numpy(), ref) < TOL["bfloat16"]
    # torch K/V written through append land in the caller's tensors
    slots = torch.tensor([0, 5], device="cuda")
    new = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache.append(new, new, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_t.view(-1, 8, 128)[slots], new)


def test_bad_inputs_raise_before_launch():
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    q_lens, kv_lens = np.array([2, 3]), np.array([20, 3])
    table, num_pages = paged_layout(rng, kv_lens, 16)
    cache = cupy_fa.PagedKVCache.allocate(num_pages, 16, 2, 64, "float16")
    attn = cupy_fa.BatchAttention(4, 2, 64, "float16")
    attn.plan(q_lens, kv_lens, table)
    q = cupy.asarray(rng.standard_normal((5, 4, 64)).astype(np.float16))
    out = cupy.full((5, 4, 64), np.nan, np.float16)

    def untouched():
        cupy.cuda.get_current_stream().synchronize()
        assert bool(cupy.isnan(out).all())

    cases = [
        (lambda: attn.run(q.astype(np.float32), cache, out=out), TypeError, "q must have dtype float16"),
        (lambda: attn.run(q[:4], cache, out=out), ValueError, "q has shape"),
        (lambda: attn.run(q, cache, out=out[:, :2]), ValueError, "out"),
        (lambda: attn.run(q.get(), cache, out=out), TypeError, "q must be a CUDA device array"),
        (lambda: attn.run(cupy.zeros((5, 4, 128), np.float16)[:, :, :64], cache, out=out), ValueError, "C-contiguous"),
        (lambda: attn.run(q, cupy_fa.PagedKVCache.allocate(4, 16, 1, 64, "float16"), out=out), ValueError, "num_kv_heads"),
        (lambda: attn.run(q, cupy_fa.PagedKVCache.allocate(4, 16, 2, 64, "bfloat16"), out=out), TypeError, "dtype"),
        (lambda: attn.run(q, (cache.k, cache.v), out=out), TypeError, "PagedKVCache"),
    ]
    for call, exc, text in cases:
        with pytest.raises(exc, match=text):
            call()
        untouched()
    # page ids outside the cache / a table too short are caught before the kernel runs
    bad = table.copy(); bad[0, 0] = num_pages + 5
    attn.plan(q_lens, kv_lens, bad)
    with pytest.raises(ValueError, match=r"page_table\[0, 0\]"):
        attn.run(q, cache, out=out)
    untouched()
    attn.plan(q_lens, kv_lens, table[:, :1])
    with pytest.raises(ValueError, match="columns"):
        attn.run(q, cache, out=out)
    untouched()
    with pytest.raises(ValueError, match="q_lens"):
        attn.plan(np.array([4, 3]), np.array([3, 3]), table)
    with pytest.raises(ValueError, match="multiple"):
        cupy_fa.BatchAttention(6, 4, 64)
    with pytest.raises(ValueError, match="head_dim"):
        cupy_fa.BatchAttention(8, 2, 96)


@pytest.mark.parametrize("stages,split_size,warps_m,per_cta", [
    (2, 512, "auto", 1), (3, 512, "auto", 1), (4, 512, "auto", 1), (2, 256, "auto", 1), (2, 1024, "auto", 1),
    (2, 2048, "auto", 1), (2, 512, 1, 1), (2, 512, 2, 1), (3, 1024, 2, 1), (2, 512, "auto", 2), (2, 256, 1, 4),
    (3, 256, "auto", 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_tuning_knobs(stages, split_size, warps_m, per_cta, dtype, monkeypatch):
    """Every pipeline depth, split size and warp layout the tuning knobs (and the
    A/B in scripts/ab_decode.sh) can select is correct (decode-like tiles:
    q_len <= SMALL_Q_LEN), for each head dim."""
    import cupy_fa

    monkeypatch.setenv("CUPY_FA_DECODE_STAGES", str(stages))
    monkeypatch.setenv("CUPY_FA_SPLIT_SIZE", str(split_size))
    monkeypatch.setenv("CUPY_FA_DECODE_WARPS_M", str(warps_m))
    monkeypatch.setenv("CUPY_FA_SPLITS_PER_CTA", str(per_cta))
    cupy_fa.knobs.reload()  # knobs are read once: take the new value
    rng, _ = new_rng()
    lengths = (np.array([1, 1, 8, 4, 2]), np.array([9000, 700, 3000, 4, 257]))
    for head_dim in HEAD_DIMS:
        for page_size in (1, 16):
            _, _, attn = run_case(rng, dtype, (32, 8), head_dim, page_size, True, lengths)
            assert attn.planned.tile.warps_m < 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_workspace_overflow(dtype):
    """A batch whose split partials would overflow the workspace gets every
    request capped at an equal share of it (plan.cu): still correct, every row written."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, _ = new_rng()
    h_q, h_kv, head_dim, page_size, batch = 32, 2, 128, 16, 64  # few KV heads: a small cache for many keys
    q_lens = np.full(batch, schedule.SMALL_Q_LEN)
    S = schedule.split_size()
    rows = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, max_batch_size=batch, max_num_tokens=1,
                                  max_pages_per_request=1)._buffers.partial_out.shape[0]
    splits = rows // (batch * schedule.SMALL_Q_LEN) + 1  # one split more per request than the workspace holds
    kv_lens = rng.integers((splits - 1) * S + 1, splits * S + 1, size=batch)
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, (h_q, h_kv), head_dim, page_size, kv_lens,
                                                       int(q_lens.sum()))
    out = cupy.full(q_host.shape, np.nan, np_dtype(dtype))
    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
    attn.plan(q_lens, kv_lens, table).run(cupy.asarray(q_host), cache, out=out)
    bufs = attn._buffers
    wanted = int((q_lens * -(-kv_lens // schedule.split_size())).sum())
    assert wanted > bufs.partial_out.shape[0], "the case must overflow the workspace"
    assert int(bufs.partial_indptr[batch].get()) <= bufs.partial_out.shape[0]
    assert (bufs.num_splits[:batch].get() > 1).all()  # capped, not unsplit
    got = out.get().astype(np.float64)
    assert np.isfinite(got).all(), f"{np.isnan(got).sum()} output elements not written or NaN"
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    for b in rng.choice(batch, size=4, replace=False):  # the float64 reference on a few requests
        ref = reference.paged_attention(q_host[cu[b]:cu[b + 1]], k_host, v_host, q_lens[b:b + 1], kv_lens[b:b + 1],
                                        table[b:b + 1])
        err = reference.relative_error(got[cu[b]:cu[b + 1]], ref)
        assert err < TOL[dtype], f"request {b}: relative error {err:.2e}"
