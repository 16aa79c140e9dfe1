"""Head dims 96 and 192 in the tiling policy (no GPU): the tiles the policy picks for them (the
wgmma family's on sm_90a, the mma.sync prefill tile elsewhere), merges of whole warps, and the error
for separate qk / vo head dims. (That every such variant compiles without spills is
tests/test_compile_cpu.py's.)"""

import pytest

from cupy_fa import BatchAttention, schedule
from cupy_fa.families import sm90 as s9
from cupy_fa import families
from cupy_fa import catalog

NEW = (96, 192)


@pytest.mark.parametrize("head_dim", NEW)
def test_long_requests_take_the_wgmma_tile_on_sm90a(head_dim):
    """The long requests of these head dims plan the wgmma family's tile where the target is
    sm_90a, the mma.sync prefill tile on any other target."""
    wgmma = s9.DEFAULT_TILES[head_dim]
    assert schedule.prefill_tile(head_dim, families.common.SMEM_LIMIT, "sm_90a") == wgmma
    # D 96: 64-byte swizzled blocks (three of 32 columns), three consumer warpgroups; D 192: three
    # 128-byte blocks, two consumer warpgroups (O holds 96 registers a thread)
    assert (wgmma.swizzle, wgmma.consumer_wgs) == ({96: 64, 192: 128}[head_dim], {96: 3, 192: 2}[head_dim])
    for arch in ("sm_90", "sm_80", None):
        assert schedule.prefill_tile(head_dim, families.common.SMEM_LIMIT, arch) == families.mma_sync.MmaTile(head_dim, 4, 1)
    sched = schedule.schedule_step(head_dim, 4, 8, q_lens=[300, 1], kv_lens=[300, 5000], arch="sm_90a")
    assert sched.long.tile == wgmma and families.is_small_q_tile(sched.small.tile)
    assert families.family_of(sched.long.tile) is families.sm90.SM90_WGMMA
    sched = schedule.schedule_step(head_dim, 4, 8, q_lens=[300, 1], kv_lens=[300, 5000], arch="sm_80")
    assert families.family_of(sched.long.tile) is families.mma_sync.MMA_SYNC


def test_small_q_tiles_and_folds_at_the_new_head_dims():
    """The two-row tile carries a fold state from D = 128 on (its epilogue's two passes need 64
    columns each): at 192, not at 96; every tile the policy picks fits the device's shared memory."""
    for limit in (families.common.SMEM_LIMIT, families.common.SM80_SMEM_LIMIT):
        assert not families.mma_sync.small_q_tile(96, 2, 2, limit).fold_capable
        assert families.mma_sync.small_q_tile(192, 2, 2, limit).fold_capable
        for head_dim in NEW:
            for stages in (2, 3, 4):
                for warps_m in (1, 2):
                    tile = families.mma_sync.small_q_tile(head_dim, warps_m, stages, limit)
                    assert tile.fits_in(limit) and tile.block_n == 64
                    folded = tile.folding(smem_limit=limit)
                    assert folded is None or folded.fits_in(limit)
            assert schedule.prefill_tile(head_dim, limit).fits_in(limit)


def test_merges_are_whole_warps():
    """The split merge searches its request with a whole warp: every shape at every head dim has a
    multiple of 32 threads (D = 192's deepest shape: 20 ways of 48 lanes, 960 threads)."""
    for head_dim in families.common.HEAD_DIMS:
        for _, shape in schedule.MERGE_SHAPES:
            threads = catalog.merge_kernel("bfloat16", head_dim, shape).threads
            assert threads % 32 == 0 and threads <= 1024, (head_dim, shape, threads)
    assert catalog.merge_kernel("bfloat16", 192, schedule.MERGE_DEEPEST).threads == 960
    assert catalog.merge_kernel("bfloat16", 96, schedule.MERGE_DEEPEST).threads == 768


def test_separate_qk_vo_head_dims_and_fp8_at_the_new_head_dims_are_refused():
    with pytest.raises(ValueError, match=r"separate qk / vo head dims \(192, 128\) are not supported"):
        BatchAttention(16, 1, (192, 128), "bfloat16")
    for head_dim in NEW:
        assert head_dim not in families.common.FP8_HEAD_DIMS
        with pytest.raises(ValueError, match="an fp8 KV cache takes head_dim"):
            BatchAttention(16, 1, head_dim, "bfloat16", kv_dtype="float8_e4m3fn")
    fp8 = catalog.warmup_kernels(head_dims=NEW, kv_dtypes=("bfloat16", "float8_e4m3fn"))
    assert not any("float8" in v.expression or "fp8" in v.expression for v in fp8)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        BatchAttention(16, 1, 160, "bfloat16")
    assert {96, 192} <= set(families.common.HEAD_DIMS)
