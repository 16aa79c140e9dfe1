"""The attention variants: sliding window, logits soft-cap and attention sinks, each
and all together, against the float64 reference in every serving mode, eager and under
CUDA-graph replay, page sizes 1 and 16, fp16 and bf16, requests of both kernel families
(q_len > 16 takes the sm_90a wgmma family on Hopper), windows smaller than a split and windows
over long contexts; decode == verify bit for bit with each variant on; outputs poisoned first and
every live row checked written, the tail untouched.

Reads bounded by the window: the K and V of every key more than one hooked tile (80 keys) before a
request's first window are NaN in the device's cache (the reference gets the clean copy), so a
kernel that read one and multiplied it in (P = 0 times NaN is NaN) fails."""

import numpy as np
import pytest

from cases import POISON, check_attention, new_rng, np_dtype, paged_case, poisoned, tree_masks, holey_masks
from cupy_fa import families

pytestmark = pytest.mark.gpu

VARIANTS = ("window", "softcap", "sinks", "all")
WINDOWS = (1, 37, 200, 511, 1000, 3000)  # 1: only itself; < a split (512); across splits


def draw(rng, variant, h_q, windows=WINDOWS, caps=(5.0, 20.0), scale=0.3):
    """(window, soft-cap, sm_scale, sinks) of one case of ``variant``: the soft-cap with a larger
    scale (``scale``; None: the default), so capping changes scores by far more than the tolerance."""
    on = {"window": ("window",), "softcap": ("softcap",), "sinks": ("sinks",),
          "all": ("window", "softcap", "sinks")}[variant]
    window = int(rng.choice(windows)) if "window" in on else None
    cap = float(rng.choice(caps)) if "softcap" in on else None
    sm_scale = scale if cap else None
    sinks = rng.normal(2.0, 2.0, h_q).astype(np.float32) if "sinks" in on else None
    return window, cap, sm_scale, sinks


def nan_before_windows(k_host, v_host, table, q_lens, kv_lens, window, page_size, block_n=80):
    """Copies of the cache whose keys before each request's first window, less one KV tile of
    ``block_n`` keys (the most a hooked kernel's tile holds: 80, the wgmma tiles at D 64 / 128 / 192
    / 256; 64 in the mma.sync family and the wgmma tile at D 96), are NaN: no kernel may read them. A KV
    tile that holds a visible key starts less than ``block_n`` keys before the first one; tiles
    start wherever a split's keys do (splits are whole tiles from the request's key_base: plan.cu),
    so that bound is the one that holds for every family and tile. The reference takes the
    originals."""
    k, v = k_host.copy(), v_host.copy()
    if not window:
        return k, v
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        if q == 0:
            continue
        first = int(kv) - int(q) - window + 1  # the first query's first key
        keys = np.arange(max(0, first - block_n + 1))
        k[table[b, keys // page_size], keys % page_size] = np.nan
        v[table[b, keys // page_size], keys % page_size] = np.nan
    return k, v


def run_and_check(attn, dtype, q_host, k_host, v_host, cache_dev, q_lens, kv_lens, table, window, cap, sm_scale, sinks,
                  label, causal=True, custom_mask=None):
    """One plan + run of the variant, poisoned buffers, checked against float64."""
    import cupy
    from cupy_fa import reference

    total = int(np.sum(q_lens))
    out = poisoned((total,) + q_host.shape[1:], np_dtype(dtype), 3)
    lse = poisoned((total, q_host.shape[1]), np.float32, 3)
    attn.plan(q_lens, kv_lens, table, causal=causal, custom_mask=custom_mask, sm_scale=sm_scale, window=window,
              logits_soft_cap=cap)
    attn.run(cupy.asarray(q_host), cache_dev, out=out[:total], lse=lse[:total],
             sinks=None if sinks is None else cupy.asarray(sinks))
    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, table, causal=causal,
                                             custom_mask=custom_mask, sm_scale=sm_scale, window=window, soft_cap=cap,
                                             sinks=sinks, return_lse=True)
    check = check_attention(out.get(), ref, dtype, q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse, poison=POISON,
                            label=label)
    print(check.summary())
    check.assert_ok()
    return out[:total], lse[:total]


def device_cache(k, v):
    import cupy
    import cupy_fa

    return cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_variant_mixed_batch(variant, dtype, page_size):
    """A ragged batch of decodes, verifies, extends and prefills (q_len up to 300: the prefill
    family), causal, with the variant; then the same cache as a decode-only and a prefill-only step
    (each family alone, and the fold the decode-only step may choose)."""
    import cupy_fa

    rng, seed = new_rng()
    heads, d = ((32, 8), 128) if dtype == "bfloat16" else ((8, 1), 64)
    q_lens = np.array([1, 1, 4, 8, 16, 17, 40, 300, 1, 0, 3, 120])
    kv_lens = q_lens + rng.integers(0, 2500, len(q_lens))
    kv_lens[9] = 7  # padding row
    window, cap, sm_scale, sinks = draw(rng, variant, heads[0])
    table, k_host, v_host, _, q_host = paged_case(rng, dtype, heads, d, page_size, kv_lens, int(q_lens.sum()))
    cache = device_cache(*nan_before_windows(k_host, v_host, table, q_lens, kv_lens, window, page_size))
    attn = cupy_fa.BatchAttention(*heads, d, dtype)
    label = f"seed {seed} {variant} window={window} cap={cap}"
    run_and_check(attn, dtype, q_host, k_host, v_host, cache, q_lens, kv_lens, table, window, cap, sm_scale, sinks,
                  label + " mixed")
    assert attn.planned.long_tile is not None  # both families ran
    for part, rows in (("decode-like", q_lens <= 16), ("prefill", q_lens > 16)):
        q_part = q_host[np.repeat(rows, q_lens)]
        run_and_check(attn, dtype, q_part, k_host, v_host, cache, q_lens[rows], kv_lens[rows], table[rows], window,
                      cap, sm_scale, sinks, f"{label} {part}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_variant_on_the_mma_sync_prefill_tile(dtype, monkeypatch):
    """The A100 build (CUPY_FA_ARCH=sm_80, run on this GPU): requests of more than 16 tokens on the
    mma.sync prefill tile, with every hook on, beside decode-like ones."""
    import cupy_fa

    monkeypatch.setenv("CUPY_FA_ARCH", "sm_80")
    cupy_fa.knobs.reload()
    rng, seed = new_rng()
    heads, d, page_size = (16, 4), 128, 16
    q_lens = np.array([1, 8, 17, 200, 64])
    kv_lens = q_lens + rng.integers(0, 2000, len(q_lens))
    window, cap, sm_scale, sinks = draw(rng, "all", heads[0], windows=(5, 300, 900))
    table, k_host, v_host, _, q_host = paged_case(rng, dtype, heads, d, page_size, kv_lens, int(q_lens.sum()))
    cache = device_cache(*nan_before_windows(k_host, v_host, table, q_lens, kv_lens, window, page_size))
    attn = cupy_fa.BatchAttention(*heads, d, dtype)
    run_and_check(attn, dtype, q_host, k_host, v_host, cache, q_lens, kv_lens, table, window, cap, sm_scale, sinks,
                  f"seed {seed} sm_80 build window={window} cap={cap}")
    assert isinstance(attn.planned.long_tile, families.mma_sync.MmaTile) and attn.planned.long_tile.warps_n == 1


@pytest.mark.parametrize("mask", ["none", "tree", "holes"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_window_with_every_mask(mask, dtype):
    """A window on a non-causal step (query sees keys p - W + 1 .. kv_len - 1) and on tree verify
    (a draft's position is its row's), every hook on, decode-like and prefill requests."""
    import cupy_fa

    rng, seed = new_rng()
    heads, d, page_size = (16, 4), 128, 16
    q_lens = np.array([4, 8, 2, 16, 1]) if mask != "none" else np.array([4, 1, 60, 200])
    kv_lens = q_lens + rng.integers(0, 1800, len(q_lens))
    window, cap, sm_scale, sinks = draw(rng, "all", heads[0], windows=(3, 100, 700))
    table, k_host, v_host, _, q_host = paged_case(rng, dtype, heads, d, page_size, kv_lens, int(q_lens.sum()))
    cache = device_cache(*nan_before_windows(k_host, v_host, table, q_lens, kv_lens, window, page_size))
    custom = None
    if mask != "none":
        custom = np.concatenate([m.ravel() for m in {"tree": tree_masks, "holes": holey_masks}[mask](rng, q_lens)])
    run_and_check(cupy_fa.BatchAttention(*heads, d, dtype), dtype, q_host, k_host, v_host, cache, q_lens, kv_lens,
                  table, window, cap, sm_scale, sinks, f"seed {seed} {mask} window={window}",
                  causal=mask != "none", custom_mask=custom)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_window_over_a_long_context_reads_the_window(dtype):
    """A window of 4096 over 131072 keys: decode and verify rows of two requests, checked against
    float64 with every key before the windows NaN in the cache; the plan covers the window only
    (key_base, at most ceil((4096 + q - 1) / S) + 7 splits, not 256)."""
    import cupy_fa
    from cupy_fa import schedule

    rng, seed = new_rng()
    heads, d, page_size, window = (32, 8), 128, 16, 4096
    q_lens = np.array([1, 4, 1])
    kv_lens = np.array([131072, 20000 - 999, 9001])
    table, k_host, v_host, _, q_host = paged_case(rng, dtype, heads, d, page_size, kv_lens, int(q_lens.sum()))
    cache = device_cache(*nan_before_windows(k_host, v_host, table, q_lens, kv_lens, window, page_size))
    attn = cupy_fa.BatchAttention(*heads, d, dtype)
    sinks = rng.normal(1.0, 1.0, heads[0]).astype(np.float32)
    for sink in (None, sinks):
        run_and_check(attn, dtype, q_host, k_host, v_host, cache, q_lens, kv_lens, table, window, None, None, sink,
                      f"seed {seed} long window sinks={sink is not None}")
    S = schedule.split_size()
    splits = attn._buffers.num_splits[:3].get()
    base = attn._buffers.key_base[:3].get()
    assert (base == schedule.key_base(q_lens, kv_lens, window)).all(), base
    assert (splits <= -(-(window + q_lens - 1) // S) + families.common.MERGE_GROUP - 1).all(), splits
    assert (splits == schedule.max_splits(q_lens, schedule.window_spans(q_lens, kv_lens, window))).all(), splits
    assert attn.planned.schedule.small.max_splits <= 16


def check_decode_equals_verify_with(variant, dtype, heads, d, page_size, monkeypatch, fold="auto", per_cta="1"):
    import cupy
    import cupy_fa
    from cupy_fa import schedule

    monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", fold)
    monkeypatch.setenv("CUPY_FA_SPLITS_PER_CTA", per_cta)
    cupy_fa.knobs.reload()
    rng, seed = new_rng()
    h_q, h_kv = heads
    S = schedule.split_size()
    U = families.common.MERGE_GROUP * S
    window, cap, sm_scale, sinks = draw(rng, variant, h_q, windows=(1, 100, 700, 1500))
    w = window or 1
    # prefixes where the verify's first window starts just before a group of 8 splits and its
    # later drafts' just after (their key_base differ), at split boundaries, and random ones
    prefix = np.array([U + w - 3, 2 * U + w - 2, S - 3, 3 * S + 2, int(rng.integers(1, 9000)), int(rng.integers(1, 300))])
    B = len(prefix)
    sinks_dev = None if sinks is None else cupy.asarray(sinks)
    for num_draft in (4, 16):
        kv = prefix + num_draft
        table, k_host, v_host, _, q_host = paged_case(rng, dtype, heads, d, page_size, kv, B * num_draft)
        cache = device_cache(*nan_before_windows(k_host, v_host, table, np.full(B, num_draft), kv, window, page_size))
        attn = cupy_fa.BatchAttention(h_q, h_kv, d, dtype)
        verify, _ = run_and_check(attn, dtype, q_host, k_host, v_host, cache, np.full(B, num_draft), kv, table, window,
                                  cap, sm_scale, sinks, f"seed {seed} {variant} verify N={num_draft} window={window}")
        q = cupy.asarray(q_host)
        q_rows = q.reshape(B, num_draft, h_q, d)
        verify_rows = verify.reshape(B, num_draft, h_q, d)
        for i in range(num_draft):
            decode = cupy.full((B, h_q, d), np.nan, np_dtype(dtype))
            attn.plan(np.ones(B, int), prefix + i + 1, table, sm_scale=sm_scale, window=window, logits_soft_cap=cap)
            attn.run(cupy.ascontiguousarray(q_rows[:, i]), cache, out=decode, sinks=sinks_dev)
            same = (decode.view(np.uint16) == verify_rows[:, i].view(np.uint16)).all(axis=(1, 2)).get()
            assert same.all(), (f"seed {seed} {variant} window={window} N={num_draft} draft {i}: decode and verify "
                                f"differ for requests {np.flatnonzero(~same).tolist()} (prefix {prefix[~same].tolist()})")
        b, i = int(rng.integers(0, B)), int(rng.integers(0, num_draft))  # alone, in a batch of one
        alone = cupy.full((1, h_q, d), np.nan, np_dtype(dtype))
        attn.plan([1], [int(prefix[b]) + i + 1], table[b:b + 1], sm_scale=sm_scale, window=window, logits_soft_cap=cap)
        attn.run(cupy.ascontiguousarray(q_rows[b, i:i + 1]), cache, out=alone, sinks=sinks_dev)
        assert (alone[0].view(np.uint16) == verify_rows[b, i].view(np.uint16)).all().get()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fold", ["0", "1"])
def test_decode_equals_verify_with_variant(variant, fold, monkeypatch):
    """decode == verify bit for bit with each variant, CTAs folding their splits or not (a fold
    that starts past the splits a window skipped), two head layouts (one- and two-row tiles)."""
    dtype = "bfloat16" if fold == "1" else "float16"
    heads, d, page = ((32, 8), 128, 16) if variant in ("window", "all") else ((8, 1), 64, 1)
    check_decode_equals_verify_with(variant, dtype, heads, d, page, monkeypatch, fold=fold)


@pytest.mark.parametrize("variant", ["window", "all"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_equals_verify_window_splits_per_cta(variant, page_size, monkeypatch):
    """The same with CTAs that run 4 splits each (CUPY_FA_SPLITS_PER_CTA=4): a window's skip passes
    whole splits inside a CTA's run, which still write their empty partials."""
    check_decode_equals_verify_with(variant, "float16", (8, 2), 128, page_size, monkeypatch, fold="0", per_cta="4")


ENGINE_VARIANT_CONFIGS = [
    # (variant, dtype, head dim, heads, page size, max_q_len: 40 puts EXTEND / MIXED on the prefill family)
    ("window", "float16", 128, (32, 8), 16, 16), ("window", "bfloat16", 64, (8, 1), 1, 40),
    ("softcap", "bfloat16", 128, (32, 8), 1, 16), ("softcap", "float16", 64, (8, 1), 16, 40),
    ("sinks", "float16", 128, (32, 8), 1, 40), ("sinks", "bfloat16", 64, (8, 1), 16, 16),
    ("all", "bfloat16", 128, (32, 8), 16, 40), ("all", "float16", 128, (16, 2), 1, 16),
]


@pytest.mark.parametrize("variant,dtype,head_dim,heads,page_size,max_q", ENGINE_VARIANT_CONFIGS,
                         ids=lambda c: str(c).replace(" ", "").replace("(", "").replace(")", "").replace(",", "x")
                         if isinstance(c, tuple) else str(c))
def test_engine_loop_with_variant(variant, dtype, head_dim, heads, page_size, max_q):
    """Every serving mode (EXTEND, DECODE, TARGET_VERIFY chain and tree, DRAFT_EXTEND v1 / v2,
    MIXED, IDLE) through a GraphRunner with the variant, eager and replayed: float64 checks of
    both, eager == graph bits, the runner's whole static output poisoned before each run."""
    import cupy
    import cupy_fa
    from test_modes_graph_gpu import Engine, check_engine_step, engine_setup, engine_steps

    rng, seed = new_rng()
    # (the runner plans with the default scale: caps that bend its scores)
    window, cap, sm_scale, sinks = draw(rng, variant, heads[0], windows=(1, 60, 400, 900), caps=(1.5, 3.0), scale=None)
    engine = Engine(rng, dtype, heads, head_dim, page_size, num_pages=(12000 // page_size) + 64)
    max_pages = -(-2600 // page_size)
    runner = cupy_fa.GraphRunner(heads[0], heads[1], head_dim, dtype, max_batch_size=8, max_q_len=max_q,
                                 max_pages_per_request=max_pages, page_size=page_size, tree_mask=True,
                                 window=window, logits_soft_cap=cap)
    sinks_dev = None if sinks is None else cupy.asarray(sinks)
    engine_setup(rng, engine)
    for step in engine_steps(rng, engine, runner, max_q, max_pages, sinks=sinks_dev):
        check_engine_step(step, engine, dtype, f"seed {seed} {variant} window={window} cap={cap}", causal=True,
                          sm_scale=sm_scale, window=window, soft_cap=cap, sinks=sinks)
    assert runner.num_graphs >= 8
