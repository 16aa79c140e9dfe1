"""Separate qk / vo head dims (192 / 128) without a GPU: the float64 reference against a dense
NumPy computation, the arguments refused before anything is allocated or launched, the tiles the
policy picks for the pair and their host mirrors, and the catalog's kernels of it."""

import math

import numpy as np
import pytest

import cupy_fa
from cupy_fa import catalog, schedule
from cupy_fa._memo import ScheduleMemo
from cupy_fa.families import common, mma_sync, sm90
from cupy_fa.reference import paged_attention

D_QK, D_VO = 192, 128


def _dense(q, k, v, prefix, causal=True, scale=None):
    """One request densely: q [n, H, D_qk], k [kv, H_kv, D_qk], v [kv, H_kv, D_vo]."""
    n, h, d = q.shape
    group = h // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("nhd,khd->hnk", q, kk) * scale
    if causal:
        s = np.where(np.arange(k.shape[0])[None, None, :] <= prefix + np.arange(n)[None, :, None], s, -np.inf)
    m = s.max(axis=2, keepdims=True)
    p = np.exp(s - m)
    out = np.einsum("hnk,khd->nhd", p / p.sum(axis=2, keepdims=True), vv)
    return out, (m[..., 0] + np.log(p.sum(axis=2))).T


@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_reference_two_widths_matches_dense(page_size):
    rng = np.random.default_rng(7)
    h_q, h_kv = 8, 2
    q_lens, kv_lens = np.array([1, 7, 0, 19]), np.array([33, 40, 3, 19])
    pages = [-(-int(kv) // page_size) for kv in kv_lens]
    num_pages = sum(pages) + 2
    order = rng.permutation(num_pages)
    table = np.full((4, max(pages)), -1, np.int64)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[at:at + n]
        at += n
    k_cache = rng.standard_normal((num_pages, page_size, h_kv, D_QK))
    v_cache = rng.standard_normal((num_pages, page_size, h_kv, D_VO))
    q = rng.standard_normal((int(q_lens.sum()), h_q, D_QK))
    out, lse = paged_attention(q, k_cache, v_cache, q_lens, kv_lens, table, return_lse=True)
    assert out.shape == (q.shape[0], h_q, D_VO) and lse.shape == (q.shape[0], h_q)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    for b in range(4):
        n, kv = int(q_lens[b]), int(kv_lens[b])
        if n == 0:
            continue
        slots = np.arange(kv)
        k = k_cache[table[b, slots // page_size], slots % page_size]
        v = v_cache[table[b, slots // page_size], slots % page_size]
        want, want_lse = _dense(q[cu[b]:cu[b + 1]], k, v, kv - n)
        np.testing.assert_allclose(out[cu[b]:cu[b + 1]], want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[cu[b]:cu[b + 1]], want_lse, rtol=1e-12, atol=1e-12)


def test_reference_refuses_mismatched_caches():
    q = np.zeros((1, 2, D_QK))
    k = np.zeros((2, 4, 1, D_QK))
    with pytest.raises(ValueError, match="do not match"):
        paged_attention(q, k, np.zeros((2, 4, 2, D_VO)), [1], [3], [[0]])  # V of other heads
    with pytest.raises(ValueError, match="do not match"):
        paged_attention(np.zeros((1, 2, D_VO)), k, np.zeros((2, 4, 1, D_VO)), [1], [3], [[0]])  # q at V's width


def test_checked_head_dims():
    assert common.checked_head_dims(128, None) == (128, 128)
    assert common.checked_head_dims(192, 192) == (192, 192)
    assert common.checked_head_dims(192, 128) == (192, 128)
    for d, vo in ((192, 64), (128, 192), (256, 128)):
        with pytest.raises(ValueError, match=r"head_dim_vo=.*pairs \(\(192, 128\),\)"):
            common.checked_head_dims(d, vo)
    with pytest.raises(ValueError, match="fp8 KV cache takes one head dim"):
        common.checked_head_dims(192, 128, common.FP8)
    with pytest.raises(ValueError, match="V's and out's as head_dim_vo="):
        common.checked_head_dims((192, 128), None)


@pytest.mark.parametrize("kwargs,match", [
    (dict(head_dim_vo=64), r"head_dim_vo=64 with head_dim=192"),
    (dict(head_dim_vo=96), r"head_dim_vo=96"),
    (dict(head_dim_vo=128, kv_dtype="float8_e4m3fn"), "fp8 KV cache takes one head dim"),
])
def test_batch_attention_refuses_before_anything(kwargs, match):
    """Raised in the constructor, before any buffer or device is touched (this machine has none)."""
    with pytest.raises(ValueError, match=match):
        cupy_fa.BatchAttention(16, 2, D_QK, "bfloat16", **kwargs)
    with pytest.raises(ValueError, match=match):
        cupy_fa.GraphRunner(16, 2, D_QK, "bfloat16", max_batch_size=2, max_q_len=4, max_pages_per_request=4,
                            page_size=16, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="float8_e4m3fn", head_dim_v=128), "fp8 cache takes one head dim"),
    (dict(head_dim_v=100), "head_dim_v must be a multiple of 8"),
    (dict(head_dim_v=0), "cache dimensions must be positive"),
])
def test_cache_allocate_refuses_before_anything(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cupy_fa.PagedKVCache.allocate(4, 16, 2, D_QK, **kwargs)


def test_tiles_of_the_pair():
    """Every class of a step at 192 / 128 takes a tile of the pair: the small-q tiles (both row
    layouts, the fold) of the mma.sync family everywhere; long requests the wgmma family's pair tile
    on sm_90a (where it fits the shared memory), the mma.sync prefill tile elsewhere."""
    for max_q, group in ((1, 8), (4, 8), (16, 1)):
        tile = schedule.tile_for(D_QK, max_q, group, arch="sm_90a", head_dim_vo=D_VO)
        assert isinstance(tile, mma_sync.MmaTile) and tile.warps_n == 4 and tile.head_dim_vo == D_VO, tile
    wgmma = schedule.prefill_tile(D_QK, arch="sm_90a", head_dim_vo=D_VO)
    assert wgmma == sm90.PAIR_TILES[(D_QK, D_VO)] and wgmma.family.name == "sm90_wgmma"
    assert schedule.tile_for(D_QK, 17, 1, arch="sm_90a", head_dim_vo=D_VO) == wgmma  # q_len > 16: long
    for arch in ("sm_80", "sm_89", "sm_90", None):
        long_tile = schedule.prefill_tile(D_QK, arch=arch, head_dim_vo=D_VO)
        assert long_tile == mma_sync.MmaTile(D_QK, 4, 1, head_dim_vo=D_VO)
    # a device whose shared memory the wgmma tile does not fit: the mma.sync prefill tile of the pair
    assert schedule.prefill_tile(D_QK, wgmma.smem_bytes - 1, "sm_90a", head_dim_vo=D_VO) == \
        mma_sync.MmaTile(D_QK, 4, 1, head_dim_vo=D_VO)
    assert schedule.prefill_tile(D_QK, arch="sm_90a") == sm90.DEFAULT_TILES[D_QK]  # one head dim: unchanged
    assert schedule.prefill_tile(D_QK, arch="sm_90a", head_dim_vo=D_QK) == sm90.DEFAULT_TILES[D_QK]
    sched = schedule.schedule_step(D_QK, 8, 2, q_lens=[1, 40], kv_lens=[5000, 300], arch="sm_90a",
                                   head_dim_vo=D_VO)
    assert sched.small.tile.head_dim_vo == D_VO and sched.long.tile == wgmma
    on_a100 = schedule.schedule_step(D_QK, 8, 2, q_lens=[1, 40], kv_lens=[5000, 300], arch="sm_80",
                                     smem_limit=common.SM80_SMEM_LIMIT, head_dim_vo=D_VO)
    assert on_a100.long.tile == mma_sync.MmaTile(D_QK, 4, 1, head_dim_vo=D_VO)
    folded = schedule.schedule_step(D_QK, 8, 2, q_lens=[1] * 64, kv_lens=[8192] * 64, head_dim_vo=D_VO)
    assert folded.small.tile.head_dim_vo == D_VO
    memo = ScheduleMemo(D_QK, 8, 2, 2, D_VO)
    got = memo.step(np.array([1, 40]), np.array([5000, 300]), smem_limit=common.SMEM_LIMIT, sm_count=132,
                    arch="sm_90a")
    assert got == sched


def test_wgmma_pair_tile_mirror_and_traits():
    """The wgmma family's tile of the pair: K's tiles and Q at 192 columns (three 128-byte swizzled
    blocks, 16 rows a producer pass), V's and O at 128; two consumer warpgroups (128 rows a CTA)
    at 128 keys a tile; the hooked kernel at 80 keys (Sm90Tile.with_variants). Its traits name V's
    head dim last, every template argument before it spelled out; a tile of one head dim keeps
    its name."""
    tile = sm90.PAIR_TILES[(D_QK, D_VO)]
    assert (tile.head_dim, tile.head_dim_vo, tile.block_n, tile.block_m, tile.threads) == (192, 128, 128, 128, 384)
    assert (tile.swizzle, tile.copy_rows, tile.consumer_regs) == (128, 16, 224)
    assert tile.traits() == "cupy_fa::Sm90PrefillTraits<192, 128, 2, true, 56, true, true, true, 2, false, 2, 0, 0, 128>"
    # Q 128 x 192, two stages of K 128 x 192 and V 128 x 128 (2 bytes each), then the barriers (4 a
    # stage and Q's), a scratch word a consumer thread and the page flag, padded to 8 bytes
    barriers = (4 * 2 + 1) * 8 + 256 * 4 + 8
    assert tile.smem_bytes == 1024 + 128 * 192 * 2 + 2 * 128 * (192 + 128) * 2 + barriers == 215120
    assert tile.smem_bytes <= common.SMEM_LIMIT
    hooked = tile.with_variants()
    assert (hooked.block_n, hooked.head_dim_vo, hooked.variants, hooked.block_m) == (80, D_VO, True, 128)
    assert hooked.traits().endswith(", 2, true, 2, 0, 1, 128>")
    # one head dim: the traits and shared memory they always had
    assert sm90.Sm90Tile(192, 96, head_dim_vo=192) == sm90.Sm90Tile(192, 96)
    assert sm90.DEFAULT_TILES[192].traits() == \
        "cupy_fa::Sm90PrefillTraits<192, 96, 2, true, 56, true, true, true, 2, false>"
    assert sm90.DEFAULT_TILES[192].smem_bytes == 1024 + 128 * 192 * 2 + 2 * 2 * 96 * 192 * 2 + barriers
    for bad in (dict(kv_bytes=1, staging=2), dict(head_dim_vo=96), dict(head_dim_vo=256)):
        with pytest.raises(ValueError, match="separate qk / vo head dims"):
            sm90.Sm90Tile(192, 96, **{"head_dim_vo": D_VO, **bad})
    assert sm90.prefill_tile(D_QK, head_dim_vo=D_VO) == tile and sm90.prefill_tile(D_QK, 1, D_VO) is None
    assert sm90.prefill_tile(128, head_dim_vo=64) is None  # not a pair of the table


def test_tile_mirror_and_traits():
    tile = mma_sync.MmaTile(D_QK, 1, 4, 4, head_dim_vo=D_VO)
    assert tile.traits() == "cupy_fa::TileTraits<192, 1, 4, 64, 4, false, 2, false, 2, 0, 128>"
    # Q 16 x 192, then 4 stages of K 64 x 192 and V 64 x 128, 2 bytes each
    assert tile.smem_bytes == 2 * (16 * 192 + 4 * 64 * (192 + 128))
    fold = mma_sync.MmaTile(D_QK, 2, 4, 4, fold_capable=True, head_dim_vo=D_VO)
    assert fold.smem_bytes == 2 * (32 * 192 + 4 * 64 * 320) + 32 * (2 * 128 * 4 + 16)
    assert mma_sync.MmaTile(D_QK, 1, 4).traits() == "cupy_fa::TileTraits<192, 1, 4, 64, 2, false>"  # unchanged
    assert mma_sync.MmaTile(D_QK, 1, 4, head_dim_vo=D_QK) == mma_sync.MmaTile(D_QK, 1, 4)
    with pytest.raises(ValueError, match="16-bit cache"):
        mma_sync.MmaTile(D_QK, 1, 4, kv_bytes=1, head_dim_vo=D_VO)


def test_catalog_has_the_pair():
    """The pair's kernels are in what CI compiles (both 16-bit types, plain and hooked: the mma.sync
    family's and, for sm_90a, the wgmma family's prefill tile), after every kernel of one head dim;
    its merge is the vo head dim's."""
    found = [k.expression for k in catalog.all_kernels("sm_90a")]
    pair = [e for e in found if e.endswith(", 0, 128>>") or e.endswith(", 128>>") and "Sm90PrefillTraits<192," in e]
    mma = [e for e in pair if "TileTraits<192," in e]
    wgmma = [e for e in pair if "Sm90PrefillTraits<192," in e]
    assert len(mma) == 40 and len(wgmma) == 4 and len(pair) == 44
    assert found[-len(pair):] == pair
    assert {"__half", "__nv_bfloat16"} == {e.split("<")[1].split(",")[0] for e in pair}
    assert {e.split("Sm90PrefillTraits")[1] for e in wgmma} == {
        "<192, 128, 2, true, 56, true, true, true, 2, false, 2, 0, 0, 128>>",
        "<192, 80, 2, true, 56, true, true, true, 2, true, 2, 0, 1, 128>>"}
    assert catalog.merge_kernel("bfloat16", D_VO, schedule.MERGE_WIDE).expression in found
    sm80 = [k.expression for k in catalog.all_kernels("sm_80")]
    assert not [e for e in sm80 if "Sm90PrefillTraits" in e]  # the wgmma family: sm_90a builds only


@pytest.mark.parametrize("arch,smem", [("sm_90a", common.SMEM_LIMIT), ("sm_80", common.SM80_SMEM_LIMIT)])
def test_warmup_holds_what_steps_at_the_pair_select(arch, smem):
    """warmup_kernels with the pair (192, 128) in head_dims (`python -m cupy_fa warmup --head-dims
    192/128`): every kernel a step at the pair selects (decode, verify, mixed and prefill batches,
    folding or not, with and without the variant hooks) and the merge at 128 columns; a pair that is
    not one of HEAD_DIM_PAIRS is refused; an fp8 cache has no pair."""
    from cupy_fa.launch import StepLauncher

    warm = set(catalog.warmup_kernels(("bfloat16",), ((192, 128),), smem, arch, variants=True))
    launcher = StepLauncher(common.ElementTypes.of("bfloat16"), 16, 2, 192, "bfloat16", 128)
    rng = np.random.default_rng(5)
    for _ in range(60):
        b = int(rng.integers(1, 65))
        q = rng.choice([1, 1, 4, 16, 17, 300], size=b)
        kv = q + rng.integers(0, 20000, size=b)
        sched = schedule.schedule_step(192, 8, 2, q_lens=q, kv_lens=kv, smem_limit=smem, arch=arch, head_dim_vo=128)
        for hooked in (False, True):
            missing = set(launcher.kernels(sched, hooked, int(q.sum()))) - warm
            assert not missing, (arch, q.tolist(), [k.expression for k in missing])
    with pytest.raises(ValueError, match="pairs"):
        catalog.warmup_kernels(("bfloat16",), ((192, 64),), smem, arch)
    fp8 = catalog.warmup_kernels(("bfloat16",), ((192, 128),), smem, arch, kv_dtypes=("float8_e4m3fn",))
    assert not [k for k in fp8 if "fp8_e4m3" in k.expression]  # no fp8 tile (nor its append) at a pair
