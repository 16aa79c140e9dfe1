"""The tiling policy in cupy_fa/schedule.py: one step's kernel, tile, grid and merge, and the
seams a second kernel family plugs into (CPU)."""

import dataclasses

import numpy as np
import pytest

from cupy_fa import plan, schedule
from cupy_fa import families
from cupy_fa import catalog


def test_schedule_step_decode_and_verify_on_hopper():
    """The choices the bench's decode-like shapes get on an H200 (132 SMs, 227 KB), as the kernel
    tests and NOTES figures assume: B=64 decode and verify q=8 fold whole rows (no merge); one long
    request folds by groups (merge of group states); a short batch-1 decode splits and merges."""
    h200 = dict(smem_limit=families.common.SMEM_LIMIT, sm_count=132, arch="sm_90a")
    decode = schedule.schedule_step(128, 4, 8, q_lens=np.ones(64, int), kv_lens=np.full(64, 4096), **h200)
    assert (decode.tile.warps_m, decode.tile.fold_splits, decode.tile.splits_per_cta) == (1, True, 8)
    assert decode.work_grid == 64 and not decode.needs_merge
    verify = schedule.schedule_step(128, 4, 8, q_lens=np.full(64, 8), kv_lens=np.full(64, 4096), **h200)
    assert (verify.tile.warps_m, verify.tile.fold_capable, verify.tile.fold_splits) == (2, True, True)
    long_one = schedule.schedule_step(128, 4, 8, q_lens=[1], kv_lens=[131072], **h200)
    assert long_one.tile.splits_per_cta == families.common.MERGE_GROUP and long_one.needs_merge
    assert long_one.work_grid == 256 // families.common.MERGE_GROUP
    short = schedule.schedule_step(128, 4, 8, q_lens=[1], kv_lens=[4096], **h200)
    assert not short.tile.fold_splits and short.work_grid == 8 and short.needs_merge
    prefill = schedule.schedule_step(128, 4, 8, q_lens=[4096], kv_lens=[4096], **h200)
    assert prefill.small is None and families.family_of(prefill.tile) is families.SM90_WGMMA
    assert prefill.tile.block_m == 192 and prefill.work_grid == -(-4096 * 4 // 192)  # 3 consumer warpgroups
    a100 = dict(smem_limit=families.common.SM80_SMEM_LIMIT, sm_count=108, arch="sm_80")
    prefill = schedule.schedule_step(128, 4, 8, q_lens=[4096], kv_lens=[4096], **a100)
    assert (prefill.tile.warps_m, prefill.tile.warps_n) == (4, 1) and prefill.tile.family is families.mma_sync.MMA_SYNC


def test_schedule_step_with_device_lengths_folds_by_groups_only():
    cap = plan.Capacity(64, 64 * 8, 512)
    step = schedule.schedule_step(128, 4, 8, max_q_len=8, max_kv_len=8192, capacity=cap, batch_size=64,
                                  smem_limit=families.common.SMEM_LIMIT, sm_count=132)
    assert step.tile.fold_splits and step.tile.splits_per_cta == families.common.MERGE_GROUP  # never a whole row
    assert step.needs_merge  # a row of 8192 keys has two groups: their states are merged
    assert step.work_grid >= schedule.work_bound(np.full(64, 8), np.full(64, 8192), 4, step.tile)


def test_variant_names_the_family_the_element_types_and_the_traits():
    tile = schedule.tile_for(128, 1, 4)
    variant = catalog.attention_kernel("bfloat16", tile)
    assert variant.source == families.mma_sync.MMA_SYNC.source == "mma_sync/attention.cu"
    assert variant.expression == ("cupy_fa::attention_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, "
                                  "cupy_fa::TileTraits<128, 1, 4, 64, 2, false>>")
    assert catalog.attention_kernel(families.common.ElementTypes.of("bfloat16"), tile) == variant
    assert (variant.threads, variant.smem_bytes) == (tile.threads, tile.smem_bytes)
    merge = catalog.merge_kernel("float16", 128, schedule.MERGE_DEEPEST)
    assert merge.source == "shared/merge.cu" and merge.threads == 1024


def test_warmup_lists_only_what_ci_compiles():
    compiled = set(catalog.all_kernels())
    for limit in (families.common.SMEM_LIMIT, families.common.SM80_SMEM_LIMIT):
        wanted = catalog.warmup_kernels(smem_limit=limit)
        assert wanted and set(wanted) <= compiled
    assert len(compiled) == len(catalog.all_kernels())


@dataclasses.dataclass(frozen=True)
class OtherFamilyTile:
    """A stand-in for a second family's tile (e.g. wgmma prefill): its own block_m and block_n,
    one split per CTA, no fold state."""
    block_m: int = 128
    block_n: int = 128
    splits_per_cta: int = 1
    fold_splits: bool = False
    whole_tiles_per_split: bool = True  # its kernel runs whole KV tiles per split, as mma.sync's does
    kv_bytes: int = 2  # its K/V element size, which sets the step's split size (schedule.split_size)

    def folding(self, groups_per_cta=1, smem_limit=None):
        return None


def test_the_grid_and_plan_take_the_tile_sizes_of_any_family():
    """Nothing in the host's grid bounds or the plan's constants assumes the mma.sync tile sizes:
    a tile of 128 rows and 128 keys gets its own row blocks, work bound and plan constants."""
    tile = OtherFamilyTile()
    q, kv = np.array([300, 17, 0]), np.array([300, 5000, 9])
    assert list(schedule.row_blocks(q, 4, tile)) == [10, 1, 0]  # 1200 / 128, 68 / 128 packed rows
    splits = schedule.max_splits(q[:2], kv[:2])
    assert schedule.work_bound(q, kv, 4, tile) == int((np.array([10, 1]) * splits).sum())
    assert schedule.fold_tile(tile, q, kv, 4, 8, 132) is tile  # no fold state: never folds
    constants = schedule.plan_constants(tile)
    assert (constants["block_m"], constants["block_n"], constants["splits_per_cta"]) == (128, 128, 1)
    assert constants["split_size"] % tile.block_n == 0


def test_split_size_must_be_a_multiple_of_the_tile_keys():
    from cupy_fa import knobs

    before = knobs.use(dataclasses.replace(knobs.knobs(), split_size=576))
    try:
        assert schedule.plan_constants(schedule.tile_for(128, 1, 4))["split_size"] == 576  # 9 x 64
        with pytest.raises(ValueError, match="CUPY_FA_SPLIT_SIZE=576 is not a multiple of the tile's 128"):
            schedule.plan_constants(OtherFamilyTile())
        # a family whose kernel takes any split length (it masks by the split's key range) is not held to it
        assert schedule.plan_constants(OtherFamilyTile(block_n=80, whole_tiles_per_split=False))["split_size"] == 576
        # an fp8 cache's small-q tiles take 128 keys a tile at D 64 / 128 (64 at D 256)
        with pytest.raises(ValueError, match="CUPY_FA_SPLIT_SIZE=576 is not a multiple of the tile's 128"):
            schedule.plan_constants(schedule.tile_for(128, 1, 4, kv_bytes=1))
        assert schedule.plan_constants(schedule.tile_for(256, 1, 4, kv_bytes=1))["split_size"] == 576
    finally:
        knobs.use(before)


def test_check_step_host_inputs():
    """The one validation both BatchAttention.plan and GraphRunner.run use."""
    step = plan.check_step([1, 3, 0], [5, 3, 2], [[0, 1], [2, 3], [4, 5]], custom_mask=np.ones(10, bool))
    assert step.on_host and step.batch == 3 and step.num_tokens == 4 and step.max_q_len == 3
    assert step.page_columns == 2 and step.has_mask and step.mask_bytes == 10 and step.stream is None
    with pytest.raises(ValueError, match="custom_mask has 9 entries"):
        plan.check_step([1, 3, 0], [5, 3, 2], [[0], [1], [2]], custom_mask=np.ones(9, bool))
    with pytest.raises(ValueError, match=r"q_lens\[0\] = 2 > kv_lens\[0\] = 1"):
        plan.check_step([2], [1], [[0]])
    with pytest.raises(ValueError, match="page_table has 2 rows"):
        plan.check_step([1], [1], [[0], [1]])
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 9"):
        plan.check_page_table(plan.check_step([1], [20], [[0, 9]]), 16, 4)


def test_split_size_per_cache_element():
    """Unset, CUPY_FA_SPLIT_SIZE leaves 512 keys a split over fp16 / bf16 caches and 1024 over fp8
    (the same bytes of K and V a split); every count of an fp8 step follows the fp8 one (the plan's
    constants, the grid bounds, the window's key base). Set, it holds for both."""
    from cupy_fa import knobs

    assert knobs.Knobs().split_size is None
    knobs.use(knobs.Knobs())  # the defaults (conftest restores the knobs after the test)
    assert (schedule.split_size(), schedule.split_size(kv_bytes=2), schedule.split_size(kv_bytes=1)) == (512, 512, 1024)
    for kv_bytes, splits in ((2, 8), (1, 4)):
        step = schedule.schedule_step(128, 4, 8, q_lens=np.ones(64, int), kv_lens=np.full(64, 4096),
                                      kv_bytes=kv_bytes)
        assert step.small.max_splits == splits and step.small.tile.kv_bytes == kv_bytes
        assert schedule.plan_constants(step.small.tile)["split_size"] == 4096 // splits
        assert int(schedule.max_splits([1], [4096], kv_bytes)[0]) == splits
        unit = families.common.MERGE_GROUP * 4096 // splits  # a window's key base: whole merge groups of splits
        assert int(schedule.key_base([1], [13100], 100, kv_bytes)[0]) == 13000 // unit * unit == {2: 12288, 1: 8192}[kv_bytes]
    bound = schedule.schedule_step(128, 4, 8, max_q_len=1, max_kv_len=4096, capacity=plan.Capacity(64, 64, 256),
                                   batch_size=64, kv_bytes=1)
    assert bound.small.max_splits == 4
    knobs.use(dataclasses.replace(knobs.Knobs(), split_size=2048))
    assert (schedule.split_size(kv_bytes=2), schedule.split_size(kv_bytes=1)) == (2048, 2048)
