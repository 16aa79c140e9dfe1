"""Head dims 96 and 192 (the mma.sync family: 12 and 24 16-byte chunks a row, loads that do not
tile a CTA's threads evenly, the swizzles' tails; on sm_90a the long requests on the wgmma family's
64-byte swizzled column blocks) on the GPU: ragged batches against float64,
every serving mode eager and under graph replay, decode == verify bit for bit, and the merge's
shapes never changing a bit, and the variant hooks (window, soft-cap, sinks) at these head dims.
The checks are the suite's own (test_attention_gpu.run_case, test_modes_graph_gpu's engine loop,
test_invariance_gpu's, test_variants_gpu's), run at the new head dims."""

import numpy as np
import pytest

from cases import new_rng, paged_case, random_lengths

import test_attention_gpu as attention_cases
import test_invariance_gpu as invariance
import test_modes_graph_gpu as modes
import test_variants_gpu as variants_cases
from cupy_fa import families

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [96, 192])
@pytest.mark.parametrize("page_size", [1, 16])
def test_random_ragged_batch(dtype, head_dim, page_size):
    """Decodes, verifies, prefills and extends in one batch (some over 16 tokens: the prefill tile),
    causal in bf16 and full in fp16; every request, row and LSE within the bar, the poisoned
    tail untouched, and a device-planned run of the same batch bit-identical (run_case). The
    requests of more than 16 tokens run on the wgmma family where the target is sm_90a, else on
    the mma.sync prefill tile."""
    from cupy_fa import _build

    rng, seed = new_rng()
    heads = (32, 8) if head_dim == 96 else (16, 2)
    lengths = random_lengths(rng, work_budget=2_500_000 // heads[0] * 8)
    lengths[0][0], lengths[1][0] = 70, max(70, int(lengths[1][0]))  # at least one long request
    check, attn = attention_cases.run_case(rng, dtype, heads, head_dim, page_size, dtype == "bfloat16", lengths)
    long_tile = attn.planned.long_tile
    if families.common.is_sm90a(_build.current_arch()):
        assert families.family_of(long_tile) is families.SM90_WGMMA, long_tile
    else:
        assert isinstance(long_tile, families.mma_sync.MmaTile) and long_tile.warps_n == 1, long_tile
    print(f"seed={seed} B={len(lengths[0])} max q_len {lengths[0].max()} max kv_len {lengths[1].max()} "
          f"long tile {long_tile}")


# (dtype, head dim, (H_q, H_kv), page size, the runner's max_q_len): both head dims at page sizes
# 1 and 16; max_q_len 40 puts device-planned EXTEND and MIXED steps on the prefill tile.
ENGINE_CONFIGS = [("float16", 96, (32, 8), 1, modes.MAX_Q), ("bfloat16", 96, (8, 1), 16, 40),
                  ("bfloat16", 192, (32, 8), 16, modes.MAX_Q), ("float16", 192, (16, 2), 1, 40)]


@pytest.mark.parametrize("dtype,head_dim,heads,page_size,max_q", ENGINE_CONFIGS,
                         ids=lambda c: str(c).replace(" ", "").replace("(", "").replace(")", "").replace(",", "x")
                         if isinstance(c, tuple) else str(c))
def test_every_mode_eager_and_graph(dtype, head_dim, heads, page_size, max_q):
    """EXTEND, DECODE, TARGET_VERIFY (chain, tree, holey mask), DRAFT_EXTEND v1 / v2, MIXED and
    IDLE through a GraphRunner over a growing engine cache: eager and replayed each against
    float64 with the LSE, the runner's whole output poisoned before each run, eager == graph bits."""
    modes.test_engine_loop_eager_and_graph(dtype, head_dim, heads, page_size, max_q)


@pytest.mark.parametrize("dtype,heads,head_dim,page_size,warps_m", [
    ("bfloat16", (32, 8), 96, 16, "auto"), ("float16", (8, 1), 96, 1, "1"),
    ("bfloat16", (8, 1), 192, 1, "auto"), ("float16", (32, 8), 192, 16, "1")])
def test_decode_equals_verify_bitwise(dtype, heads, head_dim, page_size, warps_m, monkeypatch):
    """A token's output and LSE bits are the same from decode and from verify with 4, 8 and 16
    drafts, prefixes around the split boundaries (test_invariance_gpu's check)."""
    invariance.check_decode_equals_verify(dtype, heads, head_dim, page_size, warps_m, monkeypatch)


@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 96), ("float16", 192)])
def test_merge_shape_never_changes_a_bit(dtype, head_dim, monkeypatch):
    """The split merge's wide, deep and deepest shapes (at D = 192 its deepest shape has 20 ways,
    whole warps) give the same bits."""
    invariance.test_merge_shape_never_changes_a_bit(dtype, head_dim, monkeypatch)


def test_long_requests_route_to_the_wgmma_family_on_sm90a_only():
    """On the device's own target the long requests of every head dim plan the wgmma family where
    the target is sm_90a, else the mma.sync prefill tile."""
    import cupy_fa
    from cupy_fa import _build

    arch = _build.current_arch()
    for head_dim in families.common.HEAD_DIMS:
        attn = cupy_fa.BatchAttention(8, 1, head_dim, "bfloat16")
        attn.plan([300], [300], np.zeros((1, 300), np.int32))
        tile = attn.planned.long_tile
        assert (families.family_of(tile) is families.SM90_WGMMA) == families.common.is_sm90a(arch), \
            (arch, head_dim, tile)


@pytest.mark.parametrize("dtype,head_dim,heads,page_size", [("bfloat16", 96, (32, 8), 16), ("float16", 192, (8, 1), 1)])
def test_variants_mixed_batch(dtype, head_dim, heads, page_size):
    """A sliding window, a soft-cap and sinks at once over a ragged batch of both families (the
    hooked kernels at these head dims), keys before each window NaN in the device's cache."""
    import cupy_fa

    rng, seed = new_rng()
    q_lens = np.array([1, 1, 4, 8, 16, 17, 40, 200, 0, 3])
    kv_lens = q_lens + rng.integers(0, 2500, len(q_lens))
    kv_lens[8] = 7  # padding row
    window, cap, sm_scale, sinks = variants_cases.draw(rng, "all", heads[0])
    table, k_host, v_host, _, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens,
                                                                  int(q_lens.sum()))
    cache = variants_cases.device_cache(*variants_cases.nan_before_windows(k_host, v_host, table, q_lens, kv_lens,
                                                                           window, page_size))
    attn = cupy_fa.BatchAttention(*heads, head_dim, dtype)
    variants_cases.run_and_check(attn, dtype, q_host, k_host, v_host, cache, q_lens, kv_lens, table, window, cap,
                                 sm_scale, sinks, f"seed {seed} D={head_dim} window={window} cap={cap}")


@pytest.mark.parametrize("dtype,heads,head_dim,page_size", [("bfloat16", (32, 8), 96, 16), ("float16", (8, 1), 192, 1)])
def test_decode_equals_verify_with_variants(dtype, heads, head_dim, page_size, monkeypatch):
    """decode == verify bit for bit with a window, a soft-cap and sinks (at D = 96 the verify of 16
    drafts runs the two-row hooked tile, one CTA per SM: TileTraits::kOneCtaForRegisters)."""
    variants_cases.check_decode_equals_verify_with("all", dtype, heads, head_dim, page_size, monkeypatch)
