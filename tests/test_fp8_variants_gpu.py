"""An fp8 (e4m3fn) cache with the attention variants (sliding window, logits soft-cap, sinks, and
all three) on the GPU: ragged batches of both families (decode-like rows on the mma.sync fp8
tiles, longer ones on the wgmma family's fp8 tile on sm_90a) against float64 on the dequantised
cache, decode == verify bit for bit with the variants on, and every serving mode through a
GraphRunner, eager and replayed. Reads bounded by the window: every key more than one fp8 small-q
tile (128 keys, the largest hooked tile over an fp8 cache) before a request's first window holds an
e4m3 NaN in the device's cache (the reference reads the clean bytes)."""

import numpy as np
import pytest

from cases import FP8, FP8_NAN, POISON, check_attention, fp8_paged_case, new_rng, np_dtype, poisoned
from test_variants_gpu import VARIANTS, draw

pytestmark = pytest.mark.gpu


def nan_before_windows(k, v, table, q_lens, kv_lens, window, page_size, poison_keys):
    """Copies of the fp8 bytes whose keys before each request's first window, less ``poison_keys``
    (one tile of the largest hooked fp8 tile), are an e4m3 NaN."""
    k, v = k.copy(), v.copy()
    if not window:
        return k, v
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        if q == 0:
            continue
        keys = np.arange(max(0, int(kv) - int(q) - window + 1 - poison_keys + 1))
        k[table[b, keys // page_size], keys % page_size] = FP8_NAN
        v[table[b, keys // page_size], keys % page_size] = FP8_NAN
    return k, v


def run_case(attn, dtype, q_host, k, v, scales, q_lens, kv_lens, table, page_size, window, cap, sm_scale, sinks,
             label, poison_keys=128):
    """One plan + run over an fp8 cache with the keys before each window NaN, checked against float64
    (out and LSE, every request and row, the poisoned tail untouched); returns out and lse."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    ks, vs = scales
    kd, vd = nan_before_windows(k, v, table, q_lens, kv_lens, window, page_size, poison_keys)
    cache = cupy_fa.PagedKVCache(cupy.asarray(kd), cupy.asarray(vd), dtype=FP8, k_scale=ks, v_scale=vs)
    total = int(np.sum(q_lens))
    out = poisoned((total,) + q_host.shape[1:], np_dtype(dtype), 3)
    lse = poisoned((total, q_host.shape[1]), np.float32, 3)
    attn.plan(q_lens, kv_lens, table, sm_scale=sm_scale, window=window, logits_soft_cap=cap)
    attn.run(cupy.asarray(q_host), cache, out=out[:total], lse=lse[:total],
             sinks=None if sinks is None else cupy.asarray(sinks))
    assert attn.status() == 0
    ref, ref_lse = reference.paged_attention(q_host, k, v, q_lens, kv_lens, table, causal=True, sm_scale=sm_scale,
                                             window=window, soft_cap=cap, sinks=sinks, return_lse=True,
                                             k_scale=ks, v_scale=vs)
    check = check_attention(out.get(), ref, dtype, q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse, poison=POISON,
                            label=label)
    print(check.summary())
    check.assert_ok()
    return out[:total], lse[:total]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fp8_variant_mixed_batch(variant, dtype, page_size):
    """Decodes, verifies, extends and prefills (up to 300 tokens) over an fp8 cache with the
    variant; then the decode-like rows alone and the long ones alone (each family on its own)."""
    import cupy_fa
    from cupy_fa import _build, families

    rng, seed = new_rng()
    heads, d = ((32, 8), 128) if dtype == "bfloat16" else ((8, 1), 64)
    q_lens = np.array([1, 1, 4, 8, 16, 17, 41, 300, 1, 0, 3, 121])
    kv_lens = q_lens + rng.integers(0, 2500, len(q_lens))
    kv_lens[9] = 7  # padding row
    window, cap, sm_scale, sinks = draw(rng, variant, heads[0])
    scale_kind = "head" if page_size != 16 else "tensor"
    table, k, v, scales, _, q_host = fp8_paged_case(rng, dtype, heads, d, page_size, kv_lens, int(q_lens.sum()),
                                                    scale_kind)
    attn = cupy_fa.BatchAttention(*heads, d, dtype, kv_dtype=FP8)
    label = f"seed {seed} fp8 {variant} window={window} cap={cap} page {page_size}"
    run_case(attn, dtype, q_host, k, v, scales, q_lens, kv_lens, table, page_size, window, cap, sm_scale, sinks,
             label + " mixed")
    if families.common.is_sm90a(_build.current_arch()):
        assert attn.planned.long_tile == families.sm90.FP8_TILES[d]
    for part, rows in (("decode-like", q_lens <= 16), ("prefill", q_lens > 16)):
        q_part = q_host[np.repeat(rows, q_lens)]
        run_case(attn, dtype, q_part, k, v, scales, q_lens[rows], kv_lens[rows], table[rows], page_size, window, cap,
                 sm_scale, sinks, f"{label} {part}")


@pytest.mark.parametrize("dtype,heads,head_dim", [("bfloat16", (32, 8), 128), ("float16", (8, 1), 64),
                                                   ("bfloat16", (16, 2), 256)])
def test_fp8_decode_equals_verify_with_variants(dtype, heads, head_dim):
    """Over an fp8 cache with a window, a soft-cap and sinks at once: a token's bits are the same
    from decode and from verify with 4 and 16 drafts (the hooked small-q tiles share their keys a
    tile and split positions), and verify is held to float64."""
    import cupy
    import cupy_fa
    from cupy_fa import schedule

    rng, seed = new_rng()
    h_q, h_kv = heads
    S = schedule.split_size(kv_bytes=1)
    window, cap, sm_scale, sinks = draw(rng, "all", h_q, windows=(1, 100, 700, 1500))
    prefix = np.array([S - 3, 3 * S + 2, int(rng.integers(1, 9000)), int(rng.integers(1, 300))])
    B = len(prefix)
    sinks_dev = cupy.asarray(sinks)
    for num_draft in (4, 16):
        kv = prefix + num_draft
        table, k, v, scales, _, q_host = fp8_paged_case(rng, dtype, heads, head_dim, 16, kv, B * num_draft, "head")
        attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, kv_dtype=FP8)
        verify, _ = run_case(attn, dtype, q_host, k, v, scales, np.full(B, num_draft), kv, table, 16, window, cap,
                             sm_scale, sinks, f"seed {seed} fp8 all verify N={num_draft} window={window}")
        cache = cupy_fa.PagedKVCache(*(cupy.asarray(x) for x in nan_before_windows(
            k, v, table, np.full(B, num_draft), kv, window, 16, 128)), dtype=FP8, k_scale=scales[0], v_scale=scales[1])
        q_rows = cupy.asarray(q_host).reshape(B, num_draft, h_q, head_dim)
        verify_rows = verify.reshape(B, num_draft, h_q, head_dim)
        for i in range(num_draft):
            decode = cupy.full((B, h_q, head_dim), np.nan, np_dtype(dtype))
            attn.plan(np.ones(B, int), prefix + i + 1, table, sm_scale=sm_scale, window=window, logits_soft_cap=cap)
            attn.run(cupy.ascontiguousarray(q_rows[:, i]), cache, out=decode, sinks=sinks_dev)
            same = (decode.view(np.uint16) == verify_rows[:, i].view(np.uint16)).all(axis=(1, 2)).get()
            assert same.all(), (f"seed {seed} fp8 window={window} N={num_draft} draft {i}: decode and verify differ "
                                f"for requests {np.flatnonzero(~same).tolist()}")


FP8_ENGINE_VARIANT_CONFIGS = [
    # (variant, dtype, head dim, heads, page size, max_q_len: 40 puts EXTEND / MIXED on the prefill family)
    ("all", "bfloat16", 128, (32, 8), 16, 40), ("softcap", "float16", 64, (8, 1), 1, 40),
    ("window", "float16", 128, (16, 2), 16, 16),
]


@pytest.mark.parametrize("variant,dtype,head_dim,heads,page_size,max_q", FP8_ENGINE_VARIANT_CONFIGS,
                         ids=lambda c: str(c).replace(" ", "").replace("(", "").replace(")", "").replace(",", "x")
                         if isinstance(c, tuple) else str(c))
def test_fp8_engine_loop_with_variant(variant, dtype, head_dim, heads, page_size, max_q):
    """Every serving mode through a GraphRunner over an fp8 cache with the variant, eager and
    replayed: float64 checks of both on the dequantised cache, eager == graph bits."""
    import cupy
    import cupy_fa
    from test_fp8_gpu import Fp8Engine
    from test_modes_graph_gpu import check_engine_step, engine_setup, engine_steps

    rng, seed = new_rng()
    window, cap, sm_scale, sinks = draw(rng, variant, heads[0], windows=(1, 60, 400, 900), caps=(1.5, 3.0), scale=None)
    amax = 10.0 * rng.uniform(0.8, 1.25, heads[1]).astype(np.float32)
    engine = Fp8Engine(rng, dtype, heads, head_dim, page_size, (12000 // page_size) + 64, (amax / 448, amax / 448))
    max_pages = -(-2600 // page_size)
    runner = cupy_fa.GraphRunner(heads[0], heads[1], head_dim, dtype, kv_dtype=FP8, max_batch_size=8,
                                 max_q_len=max_q, max_pages_per_request=max_pages, page_size=page_size,
                                 tree_mask=True, window=window, logits_soft_cap=cap)
    sinks_dev = None if sinks is None else cupy.asarray(sinks)
    engine_setup(rng, engine)
    for step in engine_steps(rng, engine, runner, max_q, max_pages, sinks=sinks_dev):
        check_engine_step(step, engine, dtype, f"seed {seed} fp8 {variant} window={window} cap={cap}", causal=True,
                          sm_scale=sm_scale, window=window, soft_cap=cap, sinks=sinks, k_scale=engine.cache.k_scale,
                          v_scale=engine.cache.v_scale)
    assert runner.num_graphs >= 8
