"""Separate qk / vo head dims (192 / 128: q and K of 192, V and out of 128) on the GPU: ragged
batches against float64 at page sizes 1 / 16 / 64, every serving mode eager and through a
GraphRunner (eager == replay bits), decode == verify bit for bit, a device-planned run inside a
captured graph, and the append of rows of two widths. The small-q tiles and the mma.sync prefill
tile carry the pair (TileTraits HEAD_DIM_VO); the wgmma family has no tile of it, so the long
requests run on the mma.sync prefill tile on every target (docs/design.md, "Separate qk / vo head
dims")."""

import numpy as np
import pytest

from cases import POISON, check_attention, new_rng, paged_case, poisoned, random_lengths, run_planned_in_graph, \
    tree_masks

import cupy_fa
from cupy_fa import ForwardMode, GraphRunner
from cupy_fa.reference import paged_attention

pytestmark = pytest.mark.gpu

D_QK, D_VO = 192, 128


def _reference(q_host, k_host, v_host, q_lens, kv_lens, table, **kw):
    return paged_attention(q_host.astype(np.float64), k_host, v_host, q_lens, kv_lens, table, return_lse=True, **kw)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_random_ragged_batch(dtype, page_size):
    """Decodes, verifies, prefills and extends in one batch (some over 16 tokens), odd lengths, a
    shuffled page table, NaN in every slot no request may read: out [T, H, 128] and the LSE within
    the bar, the poisoned tail untouched; a device-planned run inside a graph bit-identical."""
    import cupy

    rng, seed = new_rng()
    heads = (16, 2)
    q_lens, kv_lens = random_lengths(rng, max_requests=12, max_kv=3001, work_budget=600_000)
    q_lens[0], kv_lens[0] = 67, max(67, int(kv_lens[0]))  # at least one long request
    num_tokens = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, D_QK, page_size, kv_lens, num_tokens,
                                                      head_dim_vo=D_VO)
    assert cache.head_dim == D_QK and cache.head_dim_v == D_VO
    attn = cupy_fa.BatchAttention(*heads, D_QK, dtype, head_dim_vo=D_VO)
    attn.plan(q_lens, kv_lens, table)
    assert attn.planned.long_tile.head_dim_vo == D_VO
    q = cupy.asarray(q_host)
    out = poisoned((num_tokens, heads[0], D_VO), q_host.dtype, tail=3)
    lse = poisoned((num_tokens, heads[0]), np.float32, tail=3)
    attn.run(q, cache, out=out[:num_tokens], lse=lse[:num_tokens])
    ref, ref_lse = _reference(q_host, k_host, v_host, q_lens, kv_lens, table)
    check_attention(out, ref, dtype, q_lens=q_lens, lse=lse, ref_lse=ref_lse, poison=POISON,
                    label=f"seed={seed} qk/vo 192/128 page {page_size}").assert_ok()
    in_graph = run_planned_in_graph(attn, q_lens, kv_lens, table, q, cache, int(q_lens.max()), int(kv_lens.max()))
    assert cupy.array_equal(in_graph, out[:num_tokens]), "device-planned graph replay differs from the eager run"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_equals_verify_bits(dtype):
    """A token's row decoded alone equals its row as the last draft of a verify (same splits, same
    small-q tile family): bit for bit at 192 / 128."""
    import cupy

    rng, seed = new_rng()
    heads = (16, 2)
    n, kv_lens = 4, np.array([1999, 700, 4097])
    table, k_host, v_host, cache, _ = paged_case(rng, dtype, heads, D_QK, 16, kv_lens, 3 * n, head_dim_vo=D_VO)
    q_verify = cupy.asarray(rng.standard_normal((3 * n, heads[0], D_QK), dtype=np.float32).astype(k_host.dtype))
    attn = cupy_fa.BatchAttention(*heads, D_QK, dtype, head_dim_vo=D_VO)
    attn.plan(np.full(3, n), kv_lens, table)
    verify = attn.run(q_verify, cache)
    last = cupy.asarray(np.arange(1, 4) * n - 1)
    attn.plan(np.ones(3, np.int64), kv_lens, table)
    decode = attn.run(cupy.ascontiguousarray(q_verify[last]), cache)
    assert decode.shape == (3, heads[0], D_VO)
    assert cupy.array_equal(decode, verify[last]), f"seed={seed}: decode != verify bits at qk/vo 192/128"


def _mode_steps(rng, batch, prefix):
    """(mode, q_lens, kv_lens, custom mask) of each serving mode over per-request prefixes."""
    n = 4
    tree = tree_masks(rng, np.full(batch, n))
    mixed = np.where(np.arange(batch) % 2 == 0, 1, 29)
    return [(ForwardMode.EXTEND, np.full(batch, 37), prefix + 37, None),
            (ForwardMode.DECODE, np.ones(batch, np.int64), prefix + 1, None),
            (ForwardMode.TARGET_VERIFY, np.full(batch, n), prefix + n, None),
            (ForwardMode.TARGET_VERIFY, np.full(batch, n), prefix + n, tree),
            (ForwardMode.MIXED, mixed, prefix + mixed, None),
            (ForwardMode.DRAFT_EXTEND, np.full(batch, 3), prefix + 3, None),
            (ForwardMode.DRAFT_EXTEND_V2, np.full(batch, n), prefix + n, None)]


@pytest.mark.parametrize("dtype,page_size", [("float16", 1), ("bfloat16", 16), ("bfloat16", 64)])
def test_every_mode_eager_and_graph(dtype, page_size):
    """EXTEND, DECODE, TARGET_VERIFY (chain, tree), MIXED, DRAFT_EXTEND v1 / v2 through a GraphRunner
    at 192 / 128: eager and replayed each against float64 with the LSE, eager == replay bits."""
    import cupy

    rng, seed = new_rng()
    heads, batch = (16, 2), 5
    prefix = rng.integers(1, 900, batch) * 2 + 1  # odd prefixes
    longest = int(prefix.max()) + 40
    pages = -(-longest // page_size)
    runner = GraphRunner(*heads, D_QK, dtype, max_batch_size=batch, max_q_len=40, max_pages_per_request=pages,
                         page_size=page_size, tree_mask=True, head_dim_vo=D_VO)
    assert runner.out.shape[2] == D_VO
    for mode, q_lens, kv_lens, mask in _mode_steps(rng, batch, prefix):
        num_tokens = int(q_lens.sum())
        table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, D_QK, page_size, kv_lens, num_tokens,
                                                          head_dim_vo=D_VO)
        table = np.pad(table, ((0, 0), (0, max(0, pages - table.shape[1]))), constant_values=-1)[:, :pages]
        q = cupy.asarray(q_host)
        ref, ref_lse = _reference(q_host, k_host, v_host, q_lens, kv_lens, table, custom_mask=mask)
        results = []
        for use_graph in (False, True):
            runner.out.fill(POISON)
            out, lse = runner.run(mode, q, cache, q_lens, kv_lens, table, custom_mask=mask, use_graph=use_graph,
                                  return_lse=True)
            assert out.shape == (num_tokens, heads[0], D_VO)
            check_attention(out, ref, dtype, q_lens=q_lens, lse=lse, ref_lse=ref_lse,
                            label=f"seed={seed} {mode.name} tree={mask is not None} graph={use_graph}"
                            ).assert_ok()
            results.append((out.copy(), lse.copy()))
        assert all(cupy.array_equal(a, b) for a, b in zip(*results)), f"seed={seed} {mode.name}: eager != replay"


def test_append_two_widths():
    """PagedKVCache.allocate(head_dim_v=128) and append of k [T, H, 192] / v [T, H, 128] rows: each
    lands at its slot, in its own array, nothing else written."""
    import cupy

    rng, _ = new_rng()
    cache = cupy_fa.PagedKVCache.allocate(6, 16, 2, D_QK, "bfloat16", head_dim_v=D_VO)
    assert cache.k.shape == (6, 16, 2, D_QK) and cache.v.shape == (6, 16, 2, D_VO)
    slots = rng.permutation(96)[:21]
    k_new = cupy.asarray(rng.standard_normal((21, 2, D_QK), dtype=np.float32)).astype(cache.k.dtype)
    v_new = cupy.asarray(rng.standard_normal((21, 2, D_VO), dtype=np.float32)).astype(cache.v.dtype)
    cache.append(k_new, v_new, slots)
    k_flat, v_flat = cache.k.reshape(96, 2, D_QK), cache.v.reshape(96, 2, D_VO)
    assert cupy.array_equal(k_flat[cupy.asarray(slots)], k_new)
    assert cupy.array_equal(v_flat[cupy.asarray(slots)], v_new)
    others = np.setdiff1d(np.arange(96), slots)
    assert not cupy.any(k_flat[cupy.asarray(others)]) and not cupy.any(v_flat[cupy.asarray(others)])
    assert int(cache.status()) == 0
