"""cupy_fa.merge_states on the GPU: against the float64 merge (cupy_fa.reference.merge_states) on
random states with empty (-inf) sides, against attention over the concatenated keys (a request's
keys split at random points, each part attended on its own, the two merged), in place, inside a
CUDA graph, its errors before any launch, and the cascade example as a test."""

import numpy as np
import pytest

from cases import POISON, check_attention, new_rng, np_dtype, paged_case, poisoned

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16"]


def random_states(rng, dtype, n, h, d):
    """Two states of n x h rows: normalised-looking outputs and LSEs over a wide range, with rows
    where side a, side b or both saw no key (lse -inf, their out garbage that must not be read)."""
    out_a = rng.standard_normal((n, h, d), dtype=np.float32)
    out_b = rng.standard_normal((n, h, d), dtype=np.float32)
    lse_a = (rng.standard_normal((n, h)) * 6).astype(np.float32)
    lse_b = (rng.standard_normal((n, h)) * 6).astype(np.float32)
    kind = rng.integers(0, 6, (n, h))  # 0: a empty, 1: b empty, 2: both, else both real
    lse_a[(kind == 0) | (kind == 2)] = -np.inf
    lse_b[(kind == 1) | (kind == 2)] = -np.inf
    out_a[kind == 0] = np.nan  # an empty side's out is never read
    out_b[kind == 1] = 1e4
    return out_a.astype(np_dtype(dtype)), lse_a, out_b.astype(np_dtype(dtype)), lse_b, kind


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,h,d", [(37, 8, 128), (5, 32, 64), (300, 4, 96), (9, 3, 192), (2, 1, 256), (1, 5, 4),
                                   (0, 8, 128), (3, 2, 1024)])
def test_merge_states_matches_float64(dtype, n, h, d):
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    a, la, b, lb, kind = random_states(rng, dtype, n, h, d)
    out_buf = poisoned((n, h, d), np_dtype(dtype), 2)
    lse_buf = poisoned((n, h), np.float32, 2)
    out, lse = out_buf[:n], lse_buf[:n]
    res = cupy_fa.merge_states(cupy.asarray(a), cupy.asarray(la), cupy.asarray(b), cupy.asarray(lb), out=out,
                               lse_out=lse)
    assert res[0] is out and res[1] is lse
    got, got_lse = out_buf.get(), lse_buf.get()
    assert (got[n:] == POISON).all() and (got_lse[n:] == POISON).all(), "rows past N were written"
    ref, ref_lse = reference.merge_states(a, la, b, lb)
    got, got_lse = got[:n].astype(np.float64), got_lse[:n]
    assert not np.isnan(got).any() and not np.isnan(got_lse).any()
    rel = reference.relative_error(got, ref)
    print(f"seed {seed}: rel {rel:.2e}")
    assert rel < reference.TOL[dtype] / 4, rel  # one rounding of the output type
    assert np.allclose(got_lse, ref_lse, rtol=0, atol=1e-5 * (1 + np.abs(np.where(np.isfinite(ref_lse), ref_lse, 0))))
    # one side empty: the other's bits exactly; both: zeros and -inf
    bits = lambda x: x.view(np.uint16)
    assert (bits(got[kind == 0].astype(np_dtype(dtype))) == bits(b[kind == 0])).all()
    assert (bits(got[kind == 1].astype(np_dtype(dtype))) == bits(a[kind == 1])).all()
    assert (got[kind == 2] == 0).all() and (got_lse[kind == 2] == -np.inf).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_in_place_and_allocating(dtype):
    """out = out_a and lse_out = lse_a merge in place (the same bits as into fresh buffers);
    without out / lse_out it allocates."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    a, la, b, lb, _ = random_states(rng, dtype, 64, 8, 128)
    fresh, fresh_lse = cupy_fa.merge_states(cupy.asarray(a), cupy.asarray(la), cupy.asarray(b), cupy.asarray(lb))
    assert isinstance(fresh, cupy.ndarray) and fresh.shape == a.shape and fresh_lse.shape == la.shape
    a_dev, la_dev = cupy.asarray(a), cupy.asarray(la)
    res = cupy_fa.merge_states(a_dev, la_dev, cupy.asarray(b), cupy.asarray(lb), out=a_dev, lse_out=la_dev)
    assert res[0] is a_dev and res[1] is la_dev
    assert (a_dev.view(np.uint16) == fresh.view(np.uint16)).all()
    assert (la_dev.view(np.uint32) == fresh_lse.view(np.uint32)).all()
    b_dev, lb_dev = cupy.asarray(b), cupy.asarray(lb)  # in place into the second side too
    cupy_fa.merge_states(cupy.asarray(a), cupy.asarray(la), b_dev, lb_dev, out=b_dev, lse_out=lb_dev)
    assert (b_dev.view(np.uint16) == fresh.view(np.uint16)).all()


@pytest.mark.torch
def test_merge_states_torch_in_torch_out():
    """torch tensors in: the allocated results are torch tensors (zero copy), on torch's stream."""
    import cupy
    import torch

    import cupy_fa

    rng, _ = new_rng()
    a, la, b, lb, _ = random_states(rng, "bfloat16", 33, 8, 128)
    fresh, _ = cupy_fa.merge_states(*(cupy.asarray(x) for x in (a, la, b, lb)))
    cupy.cuda.get_current_stream().synchronize()
    t_out, t_lse = cupy_fa.merge_states(*(torch.from_dlpack(cupy.asarray(x)) for x in (a, la, b, lb)))
    torch.cuda.synchronize()
    assert isinstance(t_out, torch.Tensor) and isinstance(t_lse, torch.Tensor) and t_lse.dtype == torch.float32
    assert (cupy.from_dlpack(t_out).view(np.uint16) == fresh.view(np.uint16)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [128, 96])
def test_merge_equals_attention_over_concatenated_keys(dtype, page_size, head_dim):
    """Each request's keys cut at a random point k (0 < k <= kv_len - q_len: every query sees every
    key before it): the keys before k attended without a mask, the rest causally (their own
    bottom-right alignment), the two merged. Equal to the float64 attention over all the keys,
    and close to BatchAttention over all of them."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    heads = (16, 4)
    q_lens = np.array([1, 1, 5, 40, 1, 16, 3, 200])
    kv_lens = q_lens + rng.integers(1, 1500, len(q_lens))
    cut = np.array([int(rng.integers(1, kv - q + 1)) for q, kv in zip(q_lens, kv_lens)])
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total)
    q = cupy.asarray(q_host)
    # the cut as two page tables over the same cache: keys [0, cut) and [cut, kv_len), each in slot order
    slots = [table[b, np.arange(kv) // page_size] * page_size + np.arange(kv) % page_size
             for b, kv in enumerate(kv_lens)]
    flat_k = k_host.reshape(-1, 1, heads[1], head_dim)
    flat_v = v_host.reshape(-1, 1, heads[1], head_dim)
    flat_cache = cupy_fa.PagedKVCache(cache.k.reshape(-1, 1, heads[1], head_dim),
                                      cache.v.reshape(-1, 1, heads[1], head_dim))
    width = int(kv_lens.max())
    head_table = np.zeros((len(q_lens), width), np.int32)
    tail_table = np.zeros((len(q_lens), width), np.int32)
    for b, s in enumerate(slots):
        head_table[b, :cut[b]] = s[:cut[b]]
        tail_table[b, :len(s) - cut[b]] = s[cut[b]:]
    # the first part: every query of request b sees all cut[b] keys, no mask; in entries of at
    # most cut[b] of its rows (the contract wants q_len <= kv_len), all over the same page-table row
    head = cupy_fa.BatchAttention(*heads, head_dim, dtype)
    entry_q, entry_kv, entry_table = [], [], []
    for b in range(len(q_lens)):
        for r in range(0, int(q_lens[b]), int(cut[b])):
            entry_q.append(min(int(cut[b]), int(q_lens[b]) - r))
            entry_kv.append(int(cut[b]))
            entry_table.append(head_table[b])
    head.plan(entry_q, entry_kv, np.array(entry_table), causal=False)
    out_a, lse_a = head.run(q, flat_cache, return_lse=True)
    tail = cupy_fa.BatchAttention(*heads, head_dim, dtype)
    tail.plan(q_lens, kv_lens - cut, tail_table, causal=True)
    out_b, lse_b = tail.run(q, flat_cache, return_lse=True)
    out_buf = poisoned((total, heads[0], head_dim), np_dtype(dtype), 3)
    lse_buf = poisoned((total, heads[0]), np.float32, 3)
    cupy_fa.merge_states(out_a, lse_a, out_b, lse_b, out=out_buf[:total], lse_out=lse_buf[:total])
    whole = cupy_fa.BatchAttention(*heads, head_dim, dtype)
    whole.plan(q_lens, kv_lens, table)
    ours = whole.run(q, cache)
    cupy.cuda.get_current_stream().synchronize()
    full_table = np.zeros((len(q_lens), width), np.int64)
    for b, s in enumerate(slots):
        full_table[b, :len(s)] = s
    ref, ref_lse = reference.paged_attention(q_host, flat_k, flat_v, q_lens, kv_lens, full_table, return_lse=True)
    check = check_attention(out_buf.get(), ref, dtype, q_lens=q_lens, lse=lse_buf.get(), ref_lse=ref_lse,
                            poison=POISON, label=f"seed {seed} merged halves D={head_dim} page {page_size}")
    print(check.summary())
    check.assert_ok()
    # the merged halves and the one-pass result: both within the bar of float64, so of each other
    gap = reference.relative_error(out_buf[:total].get().astype(np.float64), ours.get().astype(np.float64))
    print(f"merged halves vs BatchAttention over all keys: rel {gap:.2e}")
    assert gap < 2 * reference.TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_in_a_cuda_graph(dtype):
    """Captured once, replayed over new states written into the same buffers: the replay merges them."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, _ = new_rng()
    n, h, d = 20, 8, 64
    bufs = [cupy.asarray(x) for x in random_states(rng, dtype, n, h, d)[:4]]
    out = cupy.empty_like(bufs[0])
    lse = cupy.empty((n, h), np.float32)
    cupy_fa.merge_states(*bufs, out=out, lse_out=lse)  # compiled before the capture
    cupy.cuda.get_current_stream().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cupy_fa.merge_states(*bufs, out=out, lse_out=lse)
        graph = stream.end_capture()
        with pytest.raises(ValueError, match="inside a CUDA-graph capture"):
            stream.begin_capture()
            try:
                cupy_fa.merge_states(*bufs)
            finally:
                stream.end_capture()
    fresh = random_states(rng, dtype, n, h, d)
    with stream:  # the new states and the poison ordered before the replay, on its stream
        for buf, x in zip(bufs, fresh[:4]):
            buf.set(x, stream=stream)
        out.fill(POISON)
        graph.launch(stream)
    stream.synchronize()
    ref, _ = reference.merge_states(*fresh[:4])
    assert reference.relative_error(out.get().astype(np.float64), ref) < reference.TOL[dtype] / 4


def test_merge_states_errors_before_any_launch():
    """Bad shapes, dtypes, overlaps and host arrays raise, naming the argument; the outputs are untouched."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    a, la, b, lb, _ = random_states(rng, "bfloat16", 6, 4, 64)
    A, LA, B, LB = (cupy.asarray(x) for x in (a, la, b, lb))
    out = cupy.full(A.shape, POISON, A.dtype)
    lse = cupy.full(LA.shape, POISON, np.float32)
    strided = cupy.empty((6, 64, 4), A.dtype).transpose(0, 2, 1)  # [6, 4, 64], not C-contiguous
    strided[...] = A
    cases = [
        ((a, LA, B, LB), TypeError, "out_a must be a CUDA device array"),
        ((A, LA, B[:5], LB), ValueError, "out_b has shape"),
        ((A, LA, B.astype(np.float16), LB), TypeError, "out_b has dtype"),
        ((A, LA.astype(np.float64), B, LB), TypeError, "lse_a must be float32"),
        ((A, LA, B, LB[:, :3]), ValueError, r"lse_b has shape"),
        ((A.astype(np.float32), LA, B.astype(np.float32), LB), TypeError, "float16 or bfloat16"),
        ((A[:, :, :62], LA, B[:, :, :62], LB), ValueError, "multiple of 4"),
        ((strided, LA, B, LB), ValueError, "out_a must be C-contiguous"),  # the right shape, strided
        ((cupy.empty(A.size + 2, A.dtype)[2:].reshape(A.shape), LA, B, LB), ValueError,
         "out_a must start on a 8-byte"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            cupy_fa.merge_states(*args, out=out, lse_out=lse)
    with pytest.raises(ValueError, match="out has shape"):
        cupy_fa.merge_states(A, LA, B, LB, out=out[:3], lse_out=lse)
    with pytest.raises(ValueError, match="lse_out has shape"):
        cupy_fa.merge_states(A, LA, B, LB, out=out, lse_out=lse[:, :2])
    big = cupy.full((12, 4, 64), POISON, A.dtype)
    with pytest.raises(ValueError, match="out overlaps out_a"):
        cupy_fa.merge_states(big[:6], LA, B, LB, out=big[3:9], lse_out=lse)
    assert bool((out == POISON).all()) and bool((lse == POISON).all()) and bool((big == POISON).all())


def test_cascade_example():
    """examples/cascade_shared_prefix.py: a prefix not on a page boundary, decodes and extend
    chunks, at page sizes 1 and 16, both dtypes, D 128 and 192; every request, row and LSE within
    the bar of the float64 attention over the whole."""
    from examples import cascade_shared_prefix as example

    rng, seed = new_rng()
    for i, argv in enumerate((["--dtype", "bf16", "--page-size", "16", "--prefix", "1000", "--requests", "8"],
                              ["--dtype", "fp16", "--page-size", "1", "--prefix", "77", "--requests", "12",
                               "--max-suffix", "120"],
                              ["--dtype", "bf16", "--page-size", "16", "--prefix", "600", "--requests", "5",
                               "--head-dim", "192", "--heads", "8", "1"])):
        result = example.run(example.parse(argv + ["--seed", str(seed + i)]))
        result["check"].assert_ok()
        assert result["ok"], result
