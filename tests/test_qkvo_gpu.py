"""Separate qk / vo head dims (192 / 128: q and K of 192, V and out of 128) on the GPU: ragged
batches against float64 at page sizes 1 / 16 / 64, every serving mode eager and through a
GraphRunner (eager == replay bits), decode == verify bit for bit, a device-planned run inside a
captured graph, and the append of rows of two widths. The small-q tiles and the mma.sync prefill
tile carry the pair (TileTraits HEAD_DIM_VO); on sm_90a the long requests run on the wgmma family's
tile of the pair (Sm90PrefillTraits D_VO: sm90.PAIR_TILES), checked on Hopper alone by the tests
marked so: ragged prefills and split extends, causal and not, the variant hooks (window, soft-cap,
sinks) and a request's bits in any batch (docs/design.md, "Separate qk / vo head dims")."""

import numpy as np
import pytest

from cases import POISON, check_attention, new_rng, np_dtype, paged_case, poisoned, random_lengths, \
    run_planned_in_graph, tree_masks

import cupy_fa
from cupy_fa import ForwardMode, GraphRunner
from cupy_fa.reference import paged_attention

pytestmark = pytest.mark.gpu

D_QK, D_VO = 192, 128


@pytest.fixture
def knob_env(monkeypatch):
    """Sets CUPY_FA_* variables for one test and reloads the knobs (put back after it)."""
    from cupy_fa import knobs

    def set_env(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        knobs.reload()

    yield set_env
    monkeypatch.undo()
    knobs.reload()


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


@pytest.mark.usefixtures("needs_sm90")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_sync_prefill_tile_on_hopper(dtype, knob_env):
    """CUPY_FA_ARCH=sm_90 (no wgmma): the pair's long requests on the mma.sync prefill tile, the tile
    every GPU but Hopper runs them on (its epilogue stages three slices of out in the K tile and the
    fourth in the V tile), against float64 as in test_random_ragged_batch."""
    from cupy_fa.families import mma_sync

    knob_env(CUPY_FA_ARCH="sm_90")
    test_random_ragged_batch(dtype, 16)
    rng, _ = new_rng()
    q_lens, kv_lens = np.array([70, 1]), np.array([900, 300])
    table, *_ = paged_case(rng, dtype, (16, 2), D_QK, 16, kv_lens, 71, head_dim_vo=D_VO)
    long_tile = cupy_fa.BatchAttention(16, 2, D_QK, dtype, head_dim_vo=D_VO).plan(q_lens, kv_lens, table) \
        .planned.long_tile
    assert isinstance(long_tile, mma_sync.MmaTile) and long_tile.head_dim_vo == D_VO, long_tile


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_len", [1500, 9000], ids=["whole-rows", "group-states"])
def test_folding_tiles_at_the_pair(dtype, kv_len, knob_env):
    """CUPY_FA_FOLD_SPLITS=1: CTAs fold their splits (the fold state after the V ring at 128 columns;
    a whole row of up to 2 groups, or fp32 group states merged at 128): decode and verify against
    float64, and decode == verify bit for bit."""
    import cupy

    knob_env(CUPY_FA_FOLD_SPLITS="1")
    rng, seed = new_rng()
    heads, n, batch = (16, 2), 4, 6
    kv_lens = kv_len - rng.integers(0, 300, size=batch)
    table, k_host, v_host, cache, _ = paged_case(rng, dtype, heads, D_QK, 16, kv_lens, batch * n, head_dim_vo=D_VO)
    q_host = rng.standard_normal((batch * n, heads[0], D_QK), dtype=np.float32).astype(k_host.dtype)
    attn = cupy_fa.BatchAttention(*heads, D_QK, dtype, head_dim_vo=D_VO)
    attn.plan(np.full(batch, n), kv_lens, table)
    assert attn.planned.tile.fold_splits, attn.planned.tile
    verify = attn.run(cupy.asarray(q_host), cache)
    ref, _ = _reference(q_host, k_host, v_host, np.full(batch, n), kv_lens, table)
    check_attention(verify.get(), ref, dtype, q_lens=np.full(batch, n),
                    label=f"seed={seed} fold at 192/128 over {kv_len} keys").assert_ok()
    last = np.arange(1, batch + 1) * n - 1
    attn.plan(np.ones(batch, np.int64), kv_lens, table)
    decode = attn.run(cupy.asarray(q_host[last]), cache)
    assert cupy.array_equal(decode, verify[cupy.asarray(last)]), f"seed={seed}: folded decode != verify bits"


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


# ---- the wgmma family's tile of the pair (sm_90a) ----------------------------------------------


def _wgmma_attention(dtype, heads, q_lens, kv_lens, table, **plan):
    """A BatchAttention at 192 / 128 planned for the step, and a check that its long requests run on
    the wgmma family's tile of the pair."""
    from cupy_fa import schedule
    from cupy_fa.families import sm90

    from cupy_fa import _build, families

    assert families.common.is_sm90a(_build.current_arch()), \
        f"the wgmma family needs an sm_90a target on this Hopper, CUPY_FA_ARCH gives {_build.current_arch()}"
    attn = cupy_fa.BatchAttention(*heads, D_QK, dtype, head_dim_vo=D_VO).plan(q_lens, kv_lens, table, **plan)
    if (np.asarray(q_lens) > schedule.SMALL_Q_LEN).any():
        assert attn.planned.long_tile == sm90.PAIR_TILES[(D_QK, D_VO)], attn.planned.long_tile
    return attn


def _run_checked(attn, dtype, heads, q_host, cache, q_lens, ref, ref_lse, label, sinks=None):
    """``attn`` run into a poisoned out and LSE (3 tail rows past the live ones), held to the float64
    reference and its LSE row by row, the tail untouched."""
    import cupy

    total = int(q_lens.sum())
    out = poisoned((total, heads[0], D_VO), np_dtype(dtype), 3)
    lse = poisoned((total, heads[0]), np.float32, 3)
    attn.run(cupy.asarray(q_host), cache, out=out[:total], lse=lse[:total],
             sinks=None if sinks is None else cupy.asarray(sinks))
    check = check_attention(out.get(), ref, dtype, q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse, poison=POISON,
                            label=label)
    print(check.summary())
    check.assert_ok()


@pytest.mark.usefixtures("needs_sm90")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16, 48])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_wgmma_long_requests(dtype, page_size, causal):
    """Prefills (several key tiles of 128, a partial last one) and extends over long prefixes (split
    into partials of 128 columns, merged at 128) beside decode rows, on the wgmma tile of the pair:
    out [T, H, 128] and the LSE within the bar against float64, the poisoned tail untouched."""
    rng, seed = new_rng()
    heads = (16, 4)
    q_lens, kv_lens = random_lengths(rng, max_requests=9, max_q=700, max_kv=4000, work_budget=1_500_000)
    # a prefill of five key tiles and a partial one, an extend over a long prefix (more than one split)
    q_lens, kv_lens = np.concatenate([[517, 33], q_lens]), np.concatenate([[517, 3999], kv_lens])
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, D_QK, page_size, kv_lens, total,
                                                      head_dim_vo=D_VO)
    attn = _wgmma_attention(dtype, heads, q_lens, kv_lens, table, causal=causal)
    ref, ref_lse = _reference(q_host, k_host, v_host, q_lens, kv_lens, table, causal=causal)
    _run_checked(attn, dtype, heads, q_host, cache, q_lens, ref, ref_lse,
                 f"seed={seed} wgmma qk/vo 192/128 page {page_size} causal={causal}")


@pytest.mark.usefixtures("needs_sm90")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_wgmma_variant_hooks(dtype):
    """The hooked wgmma kernel of the pair (80 keys a tile): a sliding window, a logits soft-cap
    where tanh saturates, and attention sinks, each against float64 with the LSE."""
    rng, seed = new_rng()
    heads, page_size = (16, 4), 16
    q_lens, kv_lens = np.array([257, 40, 500, 1]), np.array([257, 900, 1100, 300])
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, D_QK, page_size, kv_lens, total,
                                                      head_dim_vo=D_VO)
    scale = 1.0 / np.sqrt(D_QK)
    for cap, sm_scale, window, sinks in ((None, scale, 200, None), (50.0, 20 * scale, None, None),
                                         (30.0, 4 * scale, 300, rng.normal(3.0, 2.0, heads[0]).astype(np.float32))):
        attn = _wgmma_attention(dtype, heads, q_lens, kv_lens, table, sm_scale=float(sm_scale), logits_soft_cap=cap,
                                window=window)
        ref, ref_lse = _reference(q_host, k_host, v_host, q_lens, kv_lens, table, sm_scale=sm_scale, soft_cap=cap,
                                  window=window, sinks=sinks)
        _run_checked(attn, dtype, heads, q_host, cache, q_lens, ref, ref_lse,
                     f"seed={seed} wgmma qk/vo cap {cap} window {window} sinks {sinks is not None}", sinks=sinks)


@pytest.mark.usefixtures("needs_sm90")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_wgmma_request_keeps_its_bits_in_any_batch(dtype):
    """Rows never mix on the wgmma tile of the pair: a request's out and LSE are bit-identical alone
    and inside a batch (a prefill, a split extend, a decode row), at another position."""
    import cupy

    rng, _ = new_rng()
    heads, page_size = (32, 8), 16
    q_lens, kv_lens = np.array([300, 20, 777, 1]), np.array([300, 3000, 1500, 60])
    total = int(q_lens.sum())
    table, _, _, cache, q_host = paged_case(rng, dtype, heads, D_QK, page_size, kv_lens, total, head_dim_vo=D_VO)
    q = cupy.asarray(q_host)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    out = cupy.empty((total, heads[0], D_VO), np_dtype(dtype))
    lse = cupy.empty((total, heads[0]), np.float32)
    _wgmma_attention(dtype, heads, q_lens, kv_lens, table).run(q, cache, out, lse=lse)
    for b in range(len(q_lens)):
        one = cupy.empty((int(q_lens[b]), heads[0], D_VO), np_dtype(dtype))
        one_lse = cupy.empty((int(q_lens[b]), heads[0]), np.float32)
        _wgmma_attention(dtype, heads, q_lens[b:b + 1], kv_lens[b:b + 1], table[b:b + 1]).run(
            q[cu[b]:cu[b + 1]], cache, one, lse=one_lse)
        assert (out[cu[b]:cu[b + 1]].view(cupy.uint16) == one.view(cupy.uint16)).all(), f"request {b} out"
        assert (lse[cu[b]:cu[b + 1]].view(cupy.uint32) == one_lse.view(cupy.uint32)).all(), f"request {b} lse"
