"""An fp8 (e4m3fn) cache on the wgmma family (sm_90a): the producer widens each K / V tile to fp16
on its way into shared memory and both products run in fp16 (bf16 queries rewritten per row as fp16
times a power of two). Against float64 on the dequantised cache (e4m3 bytes x the scales), request
by request and row by row with the LSE: ragged prefill / extend batches at head dims 64, 128, 256,
page sizes 1, 16, 64 and one that is not a power of two, per-tensor and per-head scales, shuffled and
interleaved pages, odd lengths, NaN in every cache slot no request may read, poisoned outputs; bf16
queries past fp16's range; subnormal e4m3 bytes; a request's bits alone and in a batch. Hopper only
(on another GPU these skip with that reason)."""

import numpy as np
import pytest

from cases import (FP8, POISON, check_attention, fp8_paged_case, new_rng, np_dtype, poisoned, random_lengths,
                   subnormal_fp8_case)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("needs_sm90")]  # tests/conftest.py
TAIL = 3


def planned(dtype, heads, head_dim, q_lens, kv_lens, table, causal=True):
    """An fp8 BatchAttention planned for the step; its long requests on the wgmma family's fp8 tile."""
    import cupy_fa
    from cupy_fa import schedule
    from cupy_fa.families import sm90

    attn = cupy_fa.BatchAttention(*heads, head_dim, dtype, kv_dtype=FP8).plan(q_lens, kv_lens, table, causal=causal)
    if (np.asarray(q_lens) > schedule.SMALL_Q_LEN).any():
        assert attn.planned.long_tile == sm90.FP8_TILES[head_dim], attn.planned.long_tile
    return attn


def run_case(rng, dtype, heads, head_dim, page_size, lengths, scale_kind, causal=True, label=""):
    """One random fp8 case through the wgmma family, checked against float64 (out and LSE, every
    request and row, the poisoned tail untouched); returns the check."""
    import cupy
    from cupy_fa import reference

    q_lens, kv_lens = lengths
    total = int(q_lens.sum())
    table, k, v, (ks, vs), cache, q_host = fp8_paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total,
                                                          scale_kind)
    out = poisoned((total, heads[0], head_dim), np_dtype(dtype), TAIL)
    lse = poisoned((total, heads[0]), np.float32, TAIL)
    attn = planned(dtype, heads, head_dim, q_lens, kv_lens, table, causal)
    attn.run(cupy.asarray(q_host), cache, out=out[:total], lse=lse[:total])
    assert attn.status() == 0
    ref, ref_lse = reference.paged_attention(q_host, k, v, q_lens, kv_lens, table, causal=causal, return_lse=True,
                                             k_scale=ks, v_scale=vs)
    check = check_attention(out.get(), ref, dtype, q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse, poison=POISON,
                            label=f"fp8 wgmma {label} D={head_dim} page {page_size} {scale_kind} scales")
    print(check.summary())
    check.assert_ok()
    return check


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16, 64, 5])
def test_fp8_prefill_ragged_batch(dtype, head_dim, page_size):
    """Prefills and extends of odd lengths (17 .. 700 tokens over up to 3000 keys) with a few decode
    rows beside them, causal in bf16 and full in fp16, scales per head at page sizes 1 and 64 and
    per tensor at 16 and 5."""
    rng, seed = new_rng()
    heads = {64: (8, 1), 128: (32, 8), 256: (16, 2)}[head_dim]
    q_lens, kv_lens = random_lengths(rng, max_requests=7, max_q=700, max_kv=3000,
                                     work_budget=1_200_000 // heads[0] * 8)
    q_lens[0] = max(int(q_lens[0]), 17 + int(rng.integers(0, 300)) | 1)  # at least one odd long request
    kv_lens[0] = max(int(kv_lens[0]), int(q_lens[0]) + int(rng.integers(0, 500)))
    scale_kind = "head" if page_size in (1, 64) else "tensor"
    run_case(rng, dtype, heads, head_dim, page_size, (q_lens, kv_lens), scale_kind, causal=dtype == "bfloat16",
             label=f"seed {seed} ragged")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_prefill_bench_shapes(dtype):
    """The bench's prefill and extend shapes, shortened: B=2 prefills of 1031 tokens, an extend of
    257 over 3000 keys (several row blocks of 192 rows, a partial last key tile)."""
    rng, seed = new_rng()
    q_lens, kv_lens = np.array([1031, 1031, 257]), np.array([1031, 1031, 3257])
    run_case(rng, dtype, (32, 8), 128, 16, (q_lens, kv_lens), "head", label=f"seed {seed} bench-like")


def test_fp8_prefill_bf16_queries_beyond_fp16_range():
    """bf16 queries whose rows span 2^4 .. 2^21 in magnitude (k_scale 2^-18 smaller, so the scores
    stay moderate), mixed inside each consumer warpgroup's 64 rows: each row rewritten as fp16 times
    its own power of two (sm90/consumer.cuh q_rows_to_fp16), so rows past 65504 stay finite."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    h_q, h_kv, d = 16, 4, 128
    q_lens, kv_lens = np.array([77, 300]), np.array([500, 300])
    total = int(q_lens.sum())
    table, k, v, (ks, vs), _, _ = fp8_paged_case(rng, "bfloat16", (h_q, h_kv), d, 16, kv_lens, total, "head")
    ks = (ks * 2.0**-18).astype(np.float32)
    cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v), dtype=FP8, k_scale=ks, v_scale=vs)
    exponents = rng.integers(4, 22, size=(total, h_q, 1))
    exponents[0, 0, 0], exponents[0, 1, 0] = 21, 4  # both ends in one row block
    q_host = (rng.standard_normal((total, h_q, d)) * 2.0**exponents).astype(np_dtype("bfloat16"))
    assert np.abs(q_host.astype(np.float32)).max() > 65504
    out = poisoned((total, h_q, d), np_dtype("bfloat16"), TAIL)
    lse = poisoned((total, h_q), np.float32, TAIL)
    planned("bfloat16", (h_q, h_kv), d, q_lens, kv_lens, table).run(cupy.asarray(q_host), cache, out=out[:total],
                                                                     lse=lse[:total])
    ref, ref_lse = reference.paged_attention(q_host, k, v, q_lens, kv_lens, table, causal=True, return_lse=True,
                                             k_scale=ks, v_scale=vs)
    check_attention(out.get(), ref, "bfloat16", q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse, poison=POISON,
                    label=f"seed {seed} fp8 wgmma, bf16 queries 2^4 .. 2^21").assert_ok()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_prefill_subnormal_bytes_read_exactly(dtype):
    """K and V of e4m3 subnormals (m x 2^-9) and the smallest normals only, per-head scales 1 and
    2^-4: widened exactly by the producer (a flush to zero would leave every score 0), prefill rows."""
    import cupy
    from cupy_fa import reference

    rng, seed = new_rng()
    h_q, h_kv, d, page_size = 8, 2, 128, 16
    q_lens, kv_lens = np.array([40, 130]), np.array([64, 200])
    table, k, v, scales, cache = subnormal_fp8_case(rng, kv_lens, page_size, d)
    total = int(q_lens.sum())
    q_host = (64 * rng.standard_normal((total, h_q, d), dtype=np.float32)).astype(np_dtype(dtype))
    out, lse = planned(dtype, (h_q, h_kv), d, q_lens, kv_lens, table).run(cupy.asarray(q_host), cache,
                                                                           return_lse=True)
    ref, ref_lse = reference.paged_attention(q_host, k, v, q_lens, kv_lens, table, return_lse=True,
                                             k_scale=scales, v_scale=scales)
    assert np.abs(ref).max() > 1e-3  # the case depends on the subnormals' values
    check_attention(out.get(), ref, dtype, q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse,
                    label=f"seed {seed} fp8 wgmma subnormals").assert_ok()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_prefill_request_keeps_its_bits_in_any_batch(dtype):
    """Rows never mix: a request's out and lse are bit-identical alone and inside a batch of other
    requests (prefills, an extend, decode rows), at another position."""
    import cupy

    rng, _ = new_rng()
    heads, d, ps = (32, 8), 128, 16
    q_lens, kv_lens = np.array([300, 20, 777, 1]), np.array([300, 3000, 1500, 60])
    total = int(q_lens.sum())
    table, _, _, _, cache, q_host = fp8_paged_case(rng, dtype, heads, d, ps, kv_lens, total, "head")
    q = cupy.asarray(q_host)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    out = cupy.empty((total, heads[0], d), np_dtype(dtype))
    lse = cupy.empty((total, heads[0]), np.float32)
    planned(dtype, heads, d, q_lens, kv_lens, table).run(q, cache, out, lse=lse)
    for b in range(len(q_lens)):
        one = cupy.empty((int(q_lens[b]), heads[0], d), np_dtype(dtype))
        one_lse = cupy.empty((int(q_lens[b]), heads[0]), np.float32)
        planned(dtype, heads, d, q_lens[b:b + 1], kv_lens[b:b + 1], table[b:b + 1]).run(q[cu[b]:cu[b + 1]], cache, one,
                                                                                         lse=one_lse)
        assert (out[cu[b]:cu[b + 1]].view(cupy.uint16) == one.view(cupy.uint16)).all(), f"request {b} out"
        assert (lse[cu[b]:cu[b + 1]].view(cupy.uint32) == one_lse.view(cupy.uint32)).all(), f"request {b} lse"
