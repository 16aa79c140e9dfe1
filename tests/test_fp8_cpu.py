"""The fp8 (e4m3fn) KV cache without a GPU: the host quantiser (the append kernel's twin) against
ml_dtypes' own rounding, saturation and NaN; dequantisation; the float64 reference over an fp8
cache; the scale and dtype checks; the tiling policy's fp8 tiles and that CI compiles each."""

import dataclasses
import math
import re

import ml_dtypes
import numpy as np
import pytest

import cupy_fa
from cupy_fa import _arrays, reference, schedule
from cupy_fa import _compile
from cupy_fa.kv_cache import checked_scales
from cupy_fa import families
from cupy_fa import catalog
from cupy_fa.families import sm90 as s9

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def ml_dtypes_quantize(x, scale):
    """ml_dtypes' e4m3fn rounding (to nearest, ties to even) of float32(x) / float32(scale),
    clipped at +-448 first (ml_dtypes gives NaN past the largest finite value)."""
    q = (np.asarray(x, np.float32) / np.float32(scale)).astype(np.float32)
    return np.clip(q, -448, 448).astype(E4M3).view(np.uint8)


def test_quantize_matches_ml_dtypes_rounding():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(50_000).astype(np.float32) * s for s in (1e-3, 0.02, 0.3, 1, 7, 60, 500)])
    # every e4m3 value, the midpoints between neighbours (ties), and just off them
    values = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    values = np.sort(values[np.isfinite(values)])
    mids = (values[1:] + values[:-1]) / 2
    x = np.concatenate([x, values, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)]).astype(np.float32)
    got = reference.quantize_e4m3(x.reshape(-1, 1, 1), 1.0).reshape(-1)
    want = ml_dtypes_quantize(x, 1.0)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} values round differently, e.g. {x[bad[:5]]}: {got[bad[:5]]} vs {want[bad[:5]]}"
    # the exact values come back as themselves
    exact = reference.quantize_e4m3(values.reshape(-1, 1, 1), 1.0).reshape(-1)
    assert np.array_equal(exact.view(E4M3).astype(np.float32), values)


def test_quantize_saturates_keeps_nan_and_signed_zero():
    x = np.array([448, 449, 463.9, 464, 1e6, np.inf, -448.5, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e-30, -1e-30,
                  2.0**-10, 2.0**-10 * 1.01, 3 * 2.0**-10, -(2.0**-9)], np.float32)
    q = reference.quantize_e4m3(x.reshape(-1, 1, 1), 1.0).reshape(-1)
    assert q[:6].tolist() == [0x7E] * 6, "+448 and beyond (and +inf) saturate to 448"
    assert q[6:8].tolist() == [0xFE] * 2, "-448 and beyond saturate to -448"
    assert q[8] == 0x7F and q[9] == 0xFF, "NaN stays NaN, with its sign"
    assert q[10] == 0x00 and q[11] == 0x80 and q[12] == 0x00 and q[13] == 0x80, "zeros keep their sign"
    assert q[14] == 0x00, "half the smallest subnormal rounds to even (zero)"
    assert q[15] == 0x01 and q[16] == 0x02 and q[17] == 0x81, "subnormals round to nearest, ties to even"


def test_quantize_per_head_scales_and_division():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((50, 4, 32)).astype(np.float32)
    scales = np.array([0.01, 0.5, 3.0, 1e-3], np.float32)
    got = reference.quantize_e4m3(x, scales)
    for h, s in enumerate(scales):
        assert np.array_equal(got[:, h], ml_dtypes_quantize(x[:, h], s)), f"head {h}"
    # the division is float32 x / scale (not x * (1 / scale)): a case where the two round apart
    y = np.float32(1.4375 * 0.1)  # e4m3 value 1.4375 times a scale of 0.1, off by the division's rounding
    assert reference.quantize_e4m3(np.array([[[y]]]), 0.1)[0, 0, 0] == ml_dtypes_quantize([y], 0.1)[0]


def test_dequantize_every_byte():
    all_bytes = np.arange(256, dtype=np.uint8).reshape(1, 2, 128)
    got = reference.dequantize_e4m3(all_bytes, np.array([0.5, 2.0]))
    want = all_bytes.view(E4M3).astype(np.float64) * np.array([0.5, 2.0])[None, :, None]
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert np.isnan(got).sum() == 2  # 0x7F and 0xFF: e4m3fn's only NaNs, no infinity
    assert np.nanmax(np.abs(reference.dequantize_e4m3(all_bytes, 1.0))) == reference.E4M3_MAX


def test_reference_over_fp8_cache_is_reference_over_its_values():
    """paged_attention with e4m3 bytes and scales == paged_attention on the float64 dequantised cache."""
    rng = np.random.default_rng(2)
    pages, ps, h_kv, d = 12, 4, 2, 16
    ks, vs = np.array([0.02, 0.05], np.float32), 0.03
    k = reference.quantize_e4m3(rng.standard_normal((pages, ps, h_kv, d)).astype(np.float32), ks)
    v = reference.quantize_e4m3(rng.standard_normal((pages, ps, h_kv, d)).astype(np.float32), vs)
    q = rng.standard_normal((5, 4, d))
    q_lens, kv_lens, table = np.array([1, 4]), np.array([9, 20]), rng.permutation(pages)[:10].reshape(2, 5)
    got, got_lse = reference.paged_attention(q, k, v, q_lens, kv_lens, table, k_scale=ks, v_scale=vs, return_lse=True)
    want, want_lse = reference.paged_attention(q, reference.dequantize_e4m3(k, ks), reference.dequantize_e4m3(v, vs),
                                               q_lens, kv_lens, table, return_lse=True)
    assert np.array_equal(got, want) and np.array_equal(got_lse, want_lse)
    viewed = reference.paged_attention(q, k.view(E4M3), v.view(E4M3), q_lens, kv_lens, table, k_scale=ks, v_scale=vs)
    assert np.array_equal(viewed, want)


@pytest.mark.parametrize("value,expected", [
    (None, [1.0, 1.0, 1.0]), (0.25, [0.25] * 3), (np.float32(2), [2.0] * 3), (np.array(0.5), [0.5] * 3),
    ([0.125], [0.125] * 3), (np.array([1, 2, 4], np.float32), [1.0, 2.0, 4.0]), ([0.5, 1.5, 2.5], [0.5, 1.5, 2.5]),
])
def test_scales_accepted(value, expected):
    got = checked_scales(value, "k_scale", 3)
    assert got.dtype == np.float32 and got.tolist() == expected


@pytest.mark.parametrize("value,error,words", [
    (0.0, ValueError, "positive"), (-1.0, ValueError, "positive"), (math.nan, ValueError, "finite"),
    (math.inf, ValueError, "finite"), (1e-39, ValueError, "normal"), (1e39, ValueError, "finite"),
    ([1.0, 2.0], ValueError, "per KV head"), (np.ones((4, 3)), ValueError, "per token-head"),
    (np.ones((2, 8, 3)), ValueError, "shape"), ("2", TypeError, "float"), (True, TypeError, "float"),
    (np.array([1.0, -1.0, 2.0]), ValueError, r"k_scale\[1\]"),
])
def test_scales_refused(value, error, words):
    with pytest.raises(error, match="k_scale") as info:
        checked_scales(value, "k_scale", 3)
    assert re.search(words, str(info.value)), str(info.value)
    if error is ValueError and words in ("positive", "finite", "normal"):
        assert "scales must be positive, finite, normal float32" in str(info.value)


def test_kv_dtype_spellings():
    for spelling in ("float8_e4m3fn", "fp8_e4m3", "e4m3", ml_dtypes.float8_e4m3fn, E4M3):
        assert _arrays.resolve_kv_dtype(spelling) == "float8_e4m3fn"
    assert _arrays.resolve_kv_dtype("bf16") == "bfloat16"
    for bad in ("float32", np.float32, "float8_e5m2", ml_dtypes.float8_e5m2):
        with pytest.raises(TypeError, match="float8_e4m3fn"):
            _arrays.resolve_kv_dtype(bad, "kv_dtype")


# ---- the tiling policy's fp8 tiles --------------------------------------------------------------

def test_fp8_long_requests_take_the_wgmma_family_on_sm90a():
    """An fp8 cache runs its small-q requests on the mma.sync family everywhere (fp8 K/V stages)
    and its long ones on the wgmma family's fp8 tile where the target is sm_90a (the producer widens
    K / V to fp16: kv_bytes 1 with two staging slots), on the mma.sync prefill tile elsewhere."""
    for arch in ("sm_90a", "sm_80", None):
        sched = schedule.schedule_step(128, 4, 8, q_lens=[1, 4, 300], kv_lens=[5000, 90, 300], arch=arch, kv_bytes=1)
        assert sched.long is not None and sched.small is not None
        assert isinstance(sched.small.tile, families.mma_sync.MmaTile) and sched.small.tile.kv_bytes == 1
        if arch == "sm_90a":
            assert sched.long.tile == s9.FP8_TILES[128] and sched.long.tile.kv_bytes == 1
        else:
            assert sched.long.tile == families.mma_sync.MmaTile(128, 4, 1, kv_bytes=1)
    for head_dim in families.common.FP8_HEAD_DIMS:
        tile = schedule.prefill_tile(head_dim, arch="sm_90a", kv_bytes=1)
        assert tile.family is s9.SM90_WGMMA and (tile.kv_bytes, tile.staging) == (1, 2), tile
        assert tile.smem_bytes <= families.common.SMEM_LIMIT
        plain = s9.DEFAULT_TILES[head_dim]  # the 16-bit tile's shape (D 256: 64 keys, by shared memory)
        assert (tile.consumer_wgs, tile.stages) == (plain.consumer_wgs, plain.stages)
        assert tile.block_n == (64 if head_dim == 256 else plain.block_n)
        assert schedule.prefill_tile(head_dim, tile.smem_bytes - 1, "sm_90a", kv_bytes=1) == \
            families.mma_sync.MmaTile(head_dim, 4, 1, kv_bytes=1)  # a device with less shared memory
    assert schedule.prefill_tile(128, arch="sm_90a") == s9.DEFAULT_TILES[128]  # 16-bit


def test_fp8_wgmma_tile_mirrors_the_traits():
    """Shared memory of the fp8 tile at D 128: the 16-bit tile's, then (at 16 bytes past the
    barriers) a factor per row for bf16 queries and two staging slots of raw e4m3 tiles (the hooked
    16-bit tile has its work item's 64 bytes there instead); the traits name spells KV_BYTES,
    STAGING and TANH only where one is not the 16-bit default."""
    tile = s9.FP8_TILES[128]
    plain = s9.DEFAULT_TILES[128]
    barriers = ((4 * 2 + 1) * 8 + 384 * 4 + 4 + 7) // 8 * 8
    assert plain.smem_bytes == 1024 + 192 * 128 * 2 + 2 * 2 * 80 * 128 * 2 + barriers
    padded = plain.smem_bytes - barriers + (barriers + 15) // 16 * 16
    assert tile.smem_bytes == padded + 192 * 4 + 2 * 80 * 128
    assert plain.with_variants().smem_bytes == padded + 64  # the hooked 16-bit tile's work item (80 keys: plain's)
    assert tile.traits() == plain.traits()[:-1] + ", 1, 2, 0>" and not plain.traits().endswith(", 2, 0, 0>")
    assert tile.with_variants().traits().endswith(f", true, 1, 2, {s9.SOFT_CAP_TANH}>")
    for bad in (dict(staging=0), dict(staging=1), dict(kv_bytes=2), dict(head_dim=96)):
        with pytest.raises(ValueError):
            dataclasses.replace(tile, **bad)
    types = families.common.ElementTypes("bfloat16", "float8_e4m3fn", "bfloat16")
    assert catalog.attention_kernel(types, tile).expression == (
        f"cupy_fa::prefill_sm90_kernel<__nv_bfloat16, cupy_fa::fp8_e4m3, __nv_bfloat16, {tile.traits()}>")
    with pytest.raises(ValueError, match="1-byte K/V"):  # an fp8 tile over a 16-bit cache
        catalog.attention_kernel("bfloat16", tile)


def test_fp8_tile_numbers():
    decode = schedule.tile_for(128, 1, 4, kv_bytes=1)
    assert (decode.warps_m, decode.warps_n, decode.stages, decode.kv_bytes) == (1, 4, families.mma_sync.FP8_STAGES, 1)
    # Q [16, 128] bf16, 2 stages of fp8 K and V [128, 128]; the epilogue stages in one pass
    assert (families.mma_sync.FP8_BLOCK_N, families.mma_sync.FP8_STAGES) == (128, 2) and decode.block_n == 128
    assert schedule.tile_for(64, 1, 4, kv_bytes=1).block_n == 128
    wide = schedule.tile_for(256, 1, 4, kv_bytes=1)  # D = 256 keeps 64 keys 4 deep (128 keys spill there)
    assert (wide.block_n, wide.stages) == families.mma_sync.FP8_D256 == (64, 4)
    assert decode.smem_bytes == 16 * 128 * 2 + 2 * 2 * 128 * 128 and decode.epilogue_in_stage
    assert decode.min_ctas_per_sm == 3 and decode.fold_layout
    assert decode.traits().endswith(", false, 1>")
    two_rows = schedule.tile_for(128, 16, 4, kv_bytes=1)
    # two rows of warps: 8 warps' fp32 accumulators fill a 32 KiB stage in two halves of D
    assert two_rows.warps_m == 2 and two_rows.epilogue_in_stage and two_rows.fold_layout
    assert two_rows.smem_bytes == 32 * 128 * 2 + 2 * 2 * 128 * 128 + 32 * (2 * 128 * 4 + 16)  # with the fold state
    assert two_rows.folding() is not None
    # the 16-bit tiles are what they were
    bf16 = schedule.tile_for(128, 1, 4)
    assert bf16.kv_bytes == 2 and bf16.traits() == "cupy_fa::TileTraits<128, 1, 4, 64, 2, false>"
    with pytest.raises(ValueError, match="internal"):
        catalog.attention_kernel("bfloat16", decode)  # a 1-byte tile with a 16-bit KV type


def test_fp8_decode_of_at_most_8_rows_takes_one_row_half(monkeypatch):
    """fp8 decode whose requests pack at most 8 rows (q_len x group) takes the one-row tile with
    one row half (TileTraits ROW_HALVES = 1: half of the softmax issued); 9 .. 16 rows the one-row
    tile with both, more the two-row tile; 16-bit caches never take it; CUPY_FA_HALF_ROWS=0 turns
    it off. The tile's other numbers (and so its schedule) are the full tile's."""
    for head_dim in families.common.FP8_HEAD_DIMS:
        for max_q_len, group, halves in ((1, 1, 1), (1, 4, 1), (2, 4, 1), (1, 8, 1), (3, 4, 2), (1, 16, 2), (4, 4, 2)):
            tile = schedule.tile_for(head_dim, max_q_len, group, kv_bytes=1)
            assert tile.row_halves == halves and tile.warps_m == 1, (head_dim, max_q_len, group, tile)
            full = dataclasses.replace(tile, row_halves=2)
            assert (tile.smem_bytes, tile.min_ctas_per_sm, tile.block_n, tile.epilogue_in_stage) == \
                (full.smem_bytes, full.min_ctas_per_sm, full.block_n, full.epilogue_in_stage)
            folded = tile.folding()
            assert folded is not None and folded.row_halves == halves
        assert schedule.tile_for(head_dim, 16, 4, kv_bytes=1).row_halves == 2  # the two-row tile
        assert schedule.tile_for(head_dim, 1, 4).row_halves == 2  # a 16-bit cache
    half = schedule.tile_for(128, 1, 4, kv_bytes=1)
    assert half.traits() == "cupy_fa::TileTraits<128, 1, 4, 128, 2, false, 1, false, 1>"
    assert dataclasses.replace(half, row_halves=2).traits() == "cupy_fa::TileTraits<128, 1, 4, 128, 2, false, 1>"
    for bad in (dict(row_halves=1, warps_m=2), dict(row_halves=1, warps_m=4, warps_n=1), dict(row_halves=3)):
        with pytest.raises(ValueError, match="row_halves"):
            dataclasses.replace(half, **bad)
    monkeypatch.setenv("CUPY_FA_HALF_ROWS", "0")
    cupy_fa.knobs.reload()
    try:
        assert schedule.tile_for(128, 1, 4, kv_bytes=1).row_halves == 2
    finally:
        monkeypatch.delenv("CUPY_FA_HALF_ROWS")
        cupy_fa.knobs.reload()


def test_fp8_one_row_half_takes_a_producer_warpgroup_on_sm90a(monkeypatch):
    """On an sm_90a target the one-row-half fp8 tiles at head dims 64 and 128 may take a producer
    warpgroup (TileTraits PRODUCER_WARPS = 4: 256 threads, setmaxnreg), and do where it keeps their CTAs
    an SM (2: the folding tile at D = 128); the tiles that fit 3 or 4 CTAs keep them and no producers.
    At head dim 256, on any other target, for 16-bit caches, on the full tile and with
    CUPY_FA_PRODUCER_WARP=0: none. Its schedule (shared memory, CTAs an SM, keys a tile) is the
    tile's without it."""
    for head_dim in families.common.FP8_HEAD_DIMS:
        for arch in ("sm_90a", "sm_90", "sm_80", None):
            tile = schedule.tile_for(head_dim, 1, 8, arch=arch, kv_bytes=1)
            capable = arch == "sm_90a" and head_dim in (64, 128)
            assert tile.producer_capable == capable and tile.producer_warps == 0, (head_dim, arch, tile)
            folded = tile.folding()
            ring = capable and head_dim == 128
            assert folded.producer_warps == (4 if ring else 0), (head_dim, arch, folded)
            assert folded.threads == (256 if ring else 128)
            plain = dataclasses.replace(folded, producer_capable=False)
            assert (folded.min_ctas_per_sm, folded.block_n, folded.splits_per_cta) == \
                (plain.min_ctas_per_sm, plain.block_n, plain.splits_per_cta)
            assert folded.smem_bytes == plain.smem_bytes + (16384 if ring else 0)  # the epilogue's own buffer
        assert not schedule.tile_for(head_dim, 3, 4, arch="sm_90a", kv_bytes=1).producer_capable  # both halves
        assert not schedule.tile_for(head_dim, 1, 4, arch="sm_90a").producer_capable  # a 16-bit cache
    ring = schedule.tile_for(128, 1, 4, arch="sm_90a", kv_bytes=1).folding()
    assert ring.traits() == "cupy_fa::TileTraits<128, 1, 4, 128, 2, true, 1, false, 1, 4>"
    assert ring.min_ctas_per_sm == 2
    for bad in (dict(head_dim=256), dict(row_halves=2), dict(kv_bytes=2)):
        with pytest.raises(ValueError, match="producer warpgroup"):
            dataclasses.replace(ring, **bad)
    listed = {t.traits() for t in catalog.fp8_tiles(128, arch="sm_90a") if getattr(t, "producer_warps", 0)}
    assert listed == {ring.traits()}
    assert not any(getattr(t, "producer_capable", False) for t in catalog.fp8_tiles(128, arch="sm_80"))
    monkeypatch.setenv("CUPY_FA_PRODUCER_WARP", "0")
    cupy_fa.knobs.reload()
    try:
        assert not schedule.tile_for(128, 1, 4, arch="sm_90a", kv_bytes=1).producer_capable
    finally:
        monkeypatch.delenv("CUPY_FA_PRODUCER_WARP")
        cupy_fa.knobs.reload()


def test_fp8_variants():
    types = families.common.ElementTypes("bfloat16", "float8_e4m3fn", "bfloat16")
    v = catalog.attention_kernel(types, schedule.tile_for(128, 1, 4, kv_bytes=1))
    assert v.expression.startswith("cupy_fa::attention_kernel<__nv_bfloat16, cupy_fa::fp8_e4m3, __nv_bfloat16, ")
    assert catalog.append_kernel(np.int64, "float16").expression == \
        "cupy_fa::append_quantize_kernel<long long, __half>"
    with pytest.raises(ValueError, match="2-byte K/V"):  # a 16-bit tile over an fp8 cache
        catalog.attention_kernel(types, schedule.prefill_tile(128, arch="sm_90a"))
    warm = catalog.warmup_kernels(("bfloat16",), (128,), kv_dtypes=("bfloat16", "float8_e4m3fn"))
    assert any("fp8_e4m3" in x.expression for x in warm) and any("append_quantize" in x.expression for x in warm)
    assert len(warm) == len(set(warm))


def test_every_selectable_fp8_tile_is_compiled_in_ci():
    """What the policy can pick for an fp8 cache (either class, Hopper or A100 shared memory, any
    group, the fold) is among the variants CI compiles (tests/test_compile_cpu.py compiles them all)."""
    compiled = {v.expression for v in catalog.all_kernels()}
    for dtype in _compile.CTYPES:
        types = families.common.ElementTypes(dtype, "float8_e4m3fn", dtype)
        for head_dim in families.common.FP8_HEAD_DIMS:  # BatchAttention refuses an fp8 cache at the others
            for max_q_len in (1, 4, 16, 17, 4096):
                for group in (1, 4, 8):
                    for limit in (families.common.SMEM_LIMIT, families.common.SM80_SMEM_LIMIT):
                        tile = schedule.tile_for(head_dim, max_q_len, group, limit, "sm_90a", kv_bytes=1)
                        assert tile.smem_bytes <= limit
                        for t in (tile, tile.folding(smem_limit=limit) if families.is_small_q_tile(tile) else None):
                            if t is not None:  # plain, and with the variant hooks
                                assert catalog.attention_kernel(types, t).expression in compiled, t
                                assert catalog.attention_kernel(types, t.with_variants()).expression in compiled, t
        for index in (np.int32, np.int64):
            assert catalog.append_kernel(index, dtype).expression in compiled
