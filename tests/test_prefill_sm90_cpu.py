"""The sm_90a prefill family (kernels/sm90/prefill.cu) builds without a GPU: every shipped
kernel compiles through NVRTC with no spills at the register split setmaxnreg expects, the
generated wgmma header is what its generator writes, a non-sm_90a build is refused, and the
host mirror of the traits agrees with the kernel (the compile's static_asserts) and with the
plan's work layout."""

import importlib.util
import pathlib
import struct

import numpy as np
import pytest

from cupy_fa import catalog, families, schedule

from cupy_fa import _compile
from cupy_fa.families import sm90 as s9

ROOT = pathlib.Path(__file__).resolve().parent.parent


DEFAULT_KERNELS = [catalog.attention_kernel(dtype, tile) for dtype in _compile.CTYPES for tile in s9.DEFAULT_TILES.values()]
# an fp8 cache's (bf16 / fp16 queries over e4m3 K / V) and every tile with the variant hooks
FP8_KERNELS = [catalog.attention_kernel(families.common.ElementTypes(dtype, families.common.FP8, dtype), tile)
               for dtype in _compile.CTYPES for tile in s9.FP8_TILES.values()]
HOOKED_KERNELS = [catalog.attention_kernel(k_types, tile.with_variants()) for dtype in _compile.CTYPES
                  for tiles, k_types in ((s9.DEFAULT_TILES, families.common.ElementTypes.of(dtype)),
                                         (s9.FP8_TILES, families.common.ElementTypes(dtype, families.common.FP8, dtype)))
                  for tile in tiles.values()]
# separate qk / vo head dims (192 / 128): plain and hooked
PAIR_KERNELS = [catalog.attention_kernel(dtype, t) for dtype in _compile.CTYPES for tile in s9.PAIR_TILES.values()
                for t in (tile, tile.with_variants())]


@pytest.mark.parametrize("kernel", DEFAULT_KERNELS + FP8_KERNELS + HOOKED_KERNELS + PAIR_KERNELS,
                         ids=lambda k: k.expression.replace(" ", ""))
def test_kernel_compiles_for_sm90a_without_spills(kernel):
    cubin, res = _compile.compile_cubin(kernel, "sm_90a")  # also checks kSmemBytes / kConsumerRegs mirrors
    assert cubin[:4] == b"\x7fELF"
    assert len(cubin) == elf_end(cubin), "compile_cubin returns the whole ELF image (cuobjdump reads it)"
    # at one CTA per SM a thread starts with 65536 / threads registers (168 at 384 threads, 128 at
    # 512); setmaxnreg moves them between roles
    assert res["registers"] == 65536 // kernel.threads // 8 * 8 == (168 if kernel.threads == 384 else 128), res
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res


def elf_end(image):
    phoff, shoff = struct.unpack_from("<QQ", image, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 54)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def test_whole_elf_pads_a_short_image_and_leaves_others():
    cubin, _ = _compile.compile_cubin(catalog.attention_kernel("bfloat16", s9.DEFAULT_TILES[64]), "sm_90a")
    short = cubin[:-1]  # what cupy's getCUBIN hands back
    assert _compile.whole_elf(short) == cubin[:-1] + b"\0" and len(_compile.whole_elf(short)) == elf_end(cubin)
    assert _compile.whole_elf(cubin) == cubin
    assert _compile.whole_elf(b"not an elf") == b"not an elf"


def test_wgmma_header_matches_its_generator():
    spec = importlib.util.spec_from_file_location("gen_sm90_wgmma", ROOT / "scripts" / "gen_sm90_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "kernels" / "sm90" / "wgmma_ops.cuh").read_text() == gen.text(), \
        "kernels/sm90/wgmma_ops.cuh is stale: run python scripts/gen_sm90_wgmma.py"


def test_family_refuses_a_plain_sm90_build():
    kernel = catalog.attention_kernel("bfloat16", s9.DEFAULT_TILES[128])
    with pytest.raises(RuntimeError, match="needs the sm_90a target"):
        _compile.compile_cubin(kernel, "sm_90")


@pytest.mark.parametrize("head_dim", sorted(s9.DEFAULT_TILES))
def test_default_tiles_fit_and_split_registers(head_dim):
    tile = s9.DEFAULT_TILES[head_dim]
    assert tile.head_dim == head_dim and tile.block_n % 16 == 0
    assert tile.smem_bytes <= families.common.SMEM_LIMIT
    wgs = tile.consumer_wgs  # 3 at D 64 / 96 / 128 (192 rows, 512 threads), 2 at D 192 / 256 (128 rows, 384 threads)
    assert wgs == (2 if head_dim in (192, 256) else 3)
    assert (tile.threads, tile.block_m, tile.entry_regs) == (128 * (1 + wgs), 64 * wgs, {2: 168, 3: 128}[wgs])
    assert 128 * tile.producer_regs + 128 * wgs * tile.consumer_regs <= tile.threads * tile.entry_regs
    assert tile.consumer_regs % 8 == 0 and tile.consumer_regs >= {2: 216, 3: 160}[wgs]


def test_defaults_take_the_uniform_warpgroup_joint_softmax_and_lean_copies_where_they_do_not_spill():
    """D 64 / 128 ship uniform_wg + joint_rows (2026-12-01 A/B: +4-6% at D = 128), the lean
    producer copies (+13-18% on top, same A/B method) and three consumer warpgroups (2026-12-02
    A/B through BatchAttention: +9-10% on prefill at D 128, +17% at D 64, extend unchanged);
    D = 256 takes none of them (uniform_wg costs it 64 bytes of spills; the rest is untimed
    there)."""
    for d, on in ((64, True), (128, True), (256, False)):
        t = s9.DEFAULT_TILES[d]
        assert (t.uniform_wg, t.joint_rows, t.lean_copy) == (on, on, on), d
        assert t.consumer_wgs == (3 if on else 2), d
        hooked = t.with_variants()  # at most 80 keys a tile (the window test's bound)
        assert hooked.variants and hooked.block_m == t.block_m and hooked.block_n == min(t.block_n, 80), d


def test_three_consumer_tile_mirrors_the_traits():
    """consumer_wgs = 3: 192 rows, 512 threads starting at 128 registers; with the producer at 32
    the consumers get (4 x 128 - 32) / 3 rounded down to 8 = 160."""
    t = s9.Sm90Tile(64, 128, 4, uniform_wg=True, joint_rows=True, lean_copy=True, consumer_wgs=3, producer_regs=32)
    assert (t.block_m, t.threads, t.entry_regs, t.consumer_regs) == (192, 512, 128, 160)
    assert 128 * t.producer_regs + 384 * t.consumer_regs <= 512 * 128
    # Q, the K and V rings, then the barriers (4 a stage and Q's), a scratch word a consumer thread and
    # the page flag, padded to 8 bytes
    assert t.smem_bytes == 1024 + 192 * 64 * 2 + 2 * 4 * 128 * 64 * 2 + (4 * 4 + 1) * 8 + 384 * 4 + 8
    assert list(schedule.row_blocks(np.array([4096, 17]), 4, t)) == [86, 1]  # plan_kernel's count, 192 rows a block


def test_work_layout_is_the_plans_with_128_rows():
    """plan_kernel counts the family's work items with the tile's block_m = 128 and one split per
    CTA: row blocks of 128 packed (token, head) rows, q_len x splits <= 128 for long rows (the
    two-consumer tile, D 256's default and an opt-in at D 128)."""
    tile = s9.Sm90Tile(128, 128, 2, uniform_wg=True, joint_rows=True, lean_copy=True)
    q = np.array([4096, 17, 1000, 1])
    kv = np.array([4096, 2000, 16384, 40])
    assert list(schedule.row_blocks(q, 4, tile)) == [128, 1, 32, 1]
    assert list(schedule.max_splits(q, kv)) == [1, 4, 1, 1]  # q = 17 over 2000 keys: 4 splits of 512
    assert schedule.work_bound(q, kv, 4, tile) == 128 + 4 + 32 + 1
    assert schedule.needs_merge(tile, q, kv)


def test_head_dims_96_and_192_tile_by_column_blocks():
    """D 96 has no whole 64-column block: its tiles are 64-byte swizzled blocks of 32 columns, and a
    pass of the producer copies one block of 32 rows (so 32, 64 or 96 keys a tile); D 192 is three
    128-byte blocks, 16 rows a pass. The host refuses a tile the kernel's static_asserts would."""
    d96, d192 = s9.DEFAULT_TILES[96], s9.DEFAULT_TILES[192]
    assert (d96.swizzle, d96.copy_rows, d96.block_n % 32) == (64, 32, 0)
    assert (d192.swizzle, d192.copy_rows) == (128, 16)
    assert (s9.DEFAULT_TILES[128].copy_rows, s9.FP8_TILES[128].copy_rows, s9.FP8_TILES[256].copy_rows) == (8, 16, 8)
    with pytest.raises(ValueError, match="whole passes of the producer's 32 rows"):
        s9.Sm90Tile(96, 80, consumer_wgs=3, producer_regs=32)
    for tile in (d96, d192, d96.with_variants(), d192.with_variants()):
        assert tile.smem_bytes <= families.common.SMEM_LIMIT and tile.block_n % tile.copy_rows == 0
