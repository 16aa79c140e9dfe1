"""The sm_90a prefill family (kernels/prefill_sm90.cu) builds without a GPU: every shipped
variant compiles through NVRTC with no spills at the register split setmaxnreg expects, the
generated wgmma header is what its generator writes, a non-sm_90a build is refused, and the
host mirror of the traits agrees with the kernel (the compile's static_asserts) and with the
plan's work layout."""

import importlib.util
import pathlib

import numpy as np
import pytest

from cupy_fa import _build, prefill_sm90 as s9, schedule

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("variant", s9.all_variants(), ids=lambda v: v.expression.replace(" ", ""))
def test_variant_compiles_for_sm90a_without_spills(variant):
    cubin, res = _build.compile_cubin(variant, "sm_90a")  # also checks kSmemBytes / kConsumerRegs mirrors
    assert cubin[:4] == b"\x7fELF"
    # 384 threads at one CTA per SM start at 168 registers; setmaxnreg moves them between roles
    assert res["registers"] == 168, res
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res


def test_wgmma_header_matches_its_generator():
    spec = importlib.util.spec_from_file_location("gen_sm90_wgmma", ROOT / "scripts" / "gen_sm90_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "kernels" / "sm90_wgmma_ops.cuh").read_text() == gen.text(), \
        "kernels/sm90_wgmma_ops.cuh is stale: run python scripts/gen_sm90_wgmma.py"


def test_family_refuses_a_plain_sm90_build():
    variant = s9.variant("bfloat16", s9.DEFAULT_TILES[128])
    with pytest.raises(RuntimeError, match="needs the sm_90a target"):
        _build.compile_cubin(variant, "sm_90")


@pytest.mark.parametrize("head_dim", sorted(s9.DEFAULT_TILES))
def test_default_tiles_fit_and_split_registers(head_dim):
    tile = s9.DEFAULT_TILES[head_dim]
    assert tile.head_dim == head_dim and tile.block_n % 16 == 0
    assert tile.smem_bytes <= schedule.SMEM_LIMIT
    assert 128 * tile.producer_regs + 256 * tile.consumer_regs <= 384 * 168
    assert tile.consumer_regs % 8 == 0 and tile.consumer_regs >= 216


def test_work_layout_is_the_plans_with_128_rows():
    """plan_kernel counts the family's work items with the tile's block_m = 128 and one split per
    CTA: row blocks of 128 packed (token, head) rows, q_len x splits <= 128 for long rows."""
    tile = s9.DEFAULT_TILES[128]
    q = np.array([4096, 17, 1000, 1])
    kv = np.array([4096, 2000, 16384, 40])
    assert list(schedule.row_blocks(q, 4, tile)) == [128, 1, 32, 1]
    assert list(schedule.max_splits(q, kv)) == [1, 4, 1, 1]  # q = 17 over 2000 keys: 4 splits of 512
    assert schedule.work_bound(q, kv, 4, tile) == 128 + 4 + 32 + 1
    assert schedule.needs_merge(tile, q, kv)



# The round-2 traits (warp-uniform warpgroup index, joint two-row softmax, persistent grid)
# that scripts/probe_prefill_sm90.py times against the default: they must build without
# spills and agree with the host mirror (kSmemBytes, kConsumerRegs) too.
ROUND2_TILES = [
    ("bfloat16", s9.Sm90Tile(128, 128, 2, uniform_wg=True)),
    ("bfloat16", s9.Sm90Tile(128, 128, 2, uniform_wg=True, joint_rows=True)),
    ("bfloat16", s9.Sm90Tile(128, 128, 2, persistent=True)),
    ("bfloat16", s9.Sm90Tile(128, 128, 2, uniform_wg=True, joint_rows=True, persistent=True)),
    ("float16", s9.Sm90Tile(128, 128, 2, uniform_wg=True, joint_rows=True, persistent=True)),
    ("bfloat16", s9.Sm90Tile(64, 128, 4, uniform_wg=True, joint_rows=True, persistent=True)),
]


@pytest.mark.parametrize("dtype,tile", ROUND2_TILES, ids=lambda x: x if isinstance(x, str) else x.traits())
def test_round2_variants_compile_without_spills(dtype, tile):
    cubin, res = _build.compile_cubin(s9.variant(dtype, tile), "sm_90a")
    assert res["registers"] == 168 and res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res
    assert tile.smem_bytes <= schedule.SMEM_LIMIT


def test_persistent_tile_holds_two_q_tiles():
    one, two = s9.Sm90Tile(128, 128, 2), s9.Sm90Tile(128, 128, 2, persistent=True)
    assert two.smem_bytes - one.smem_bytes == 128 * 128 * 2 + 3 * 8 + 52


@pytest.mark.parametrize("name", ["v1_af55a79", "v3_37ed792"])
def test_probe_snapshots_of_earlier_versions_compile(name):
    """scripts/sm90_snapshots/*.cu (the probe's A/B of earlier commits) still build against
    today's common headers, without spills, at their own kSmemBytes."""
    spec = importlib.util.spec_from_file_location("probe_prefill_sm90", ROOT / "scripts" / "probe_prefill_sm90.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    cubin, res = _build.compile_cubin(probe.kernel_variant(name), "sm_90a")
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res
