"""An fp8 (e4m3fn) KV cache on the GPU: append quantises bit for bit as the host's quantiser
(cupy_fa.reference.quantize_e4m3); attention over the cache is held to the float64 reference on
the dequantised cache (e4m3 bytes x the scales), request by request and row by row with its
LSE, in every serving mode, eager and replayed; decode == verify bit for bit; the errors of fp8
attention against attention over the 16-bit cache it was quantised from are printed per mode
(and written to $CUPY_FA_FP8_REPORT for lab/fp8_check.sh's table)."""

import json
import os
import re

import numpy as np
import pytest

from cases import (FP8, FP8_NAN, POISON, check_attention, fp8_paged_case, fp8_scales, new_rng,
                   np_dtype, paged_layout, poisoned, random_lengths, run_planned_in_graph, subnormal_fp8_case,
                   tree_masks)
from test_modes_graph_gpu import Engine, check_engine_step, engine_setup, engine_steps

from cupy_fa.modes import ForwardMode

pytestmark = pytest.mark.gpu
M = ForwardMode
TAIL = 3


def report(**row):
    path = os.environ.get("CUPY_FA_FP8_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


# ---- append: quantised on the device exactly as on the host ---------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("scale_kind", ["tensor", "head"])
@pytest.mark.parametrize("slots_on", ["host-int64", "device-int32"])
def test_append_quantises_bit_exact(dtype, scale_kind, slots_on):
    """New rows of N(0, 1) x 4 (many saturate at +-448 x scale), exact zeros of both signs, tiny
    values (subnormal and below half the smallest e4m3 subnormal), +-inf, NaN: the bytes the
    kernel writes are quantize_e4m3's; slots not written (padding -1 on the device) keep what
    they held."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    h_kv, d, page_size, pages = 4, 128, 16, 40
    k_scale, v_scale = fp8_scales(rng, scale_kind, h_kv)
    cache = cupy_fa.PagedKVCache.allocate(pages, page_size, h_kv, d, FP8, k_scale=k_scale, v_scale=v_scale)
    cache.k.fill(0x5A)  # a pattern the rows not appended must keep
    cache.v.fill(0x5A)
    tokens = 300
    k = (4 * rng.standard_normal((tokens, h_kv, d), dtype=np.float32))
    v = (4 * rng.standard_normal((tokens, h_kv, d), dtype=np.float32))
    flat = k.reshape(-1)
    specials = np.array([0.0, -0.0, 1e-30, -1e-30, 2.0**-12, -(2.0**-11), np.inf, -np.inf, np.nan, 1e5, -1e5],
                        np.float32)
    flat[rng.choice(flat.size, 400, replace=False)] = np.resize(specials, 400)
    k_new, v_new = k.astype(np_dtype(dtype)), v.astype(np_dtype(dtype))
    slots = rng.permutation(pages * page_size)[:tokens].astype(np.int64)
    if slots_on == "host-int64":
        given = slots
    else:
        slots[rng.choice(tokens, 20, replace=False)] = -1  # padding rows: skipped
        given = cupy.asarray(slots, np.int32)
    cache.append(cupy.asarray(k_new), cupy.asarray(v_new), given)
    assert cache.status() == 0
    got_k = cache.k.get().reshape(-1, h_kv, d)
    got_v = cache.v.get().reshape(-1, h_kv, d)
    live = slots >= 0
    want_k = reference.quantize_e4m3(k_new.astype(np.float32), k_scale)
    want_v = reference.quantize_e4m3(v_new.astype(np.float32), v_scale)
    diff = np.flatnonzero((got_k[slots[live]] != want_k[live]).any(axis=(1, 2)))
    assert diff.size == 0, (f"seed {seed}: {diff.size} K rows differ from the host quantiser, e.g. token "
                            f"{np.flatnonzero(live)[diff[0]]}")
    assert (got_v[slots[live]] == want_v[live]).all(), f"seed {seed}: V bytes differ from the host quantiser"
    untouched = np.setdiff1d(np.arange(pages * page_size), slots[live])
    assert (got_k[untouched] == 0x5A).all() and (got_v[untouched] == 0x5A).all(), "a slot not appended was written"
    # saturation and NaN really occurred in the input, so the case checks them
    assert (want_k == 0x7E).any() and (want_k == 0xFE).any() and (want_k == 0x7F).any()


# ---- attention against float64 on the dequantised cache ------------------------------------

def run_fp8_case(rng, dtype, heads, head_dim, page_size, lengths, scale_kind, causal=True, custom_mask=None,
                 device_plan=True, label=""):
    import cupy
    import cupy_fa
    from cupy_fa import reference

    h_q, h_kv = heads
    q_lens, kv_lens = lengths
    total = int(q_lens.sum())
    table, k, v, (ks, vs), cache, q_host = fp8_paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total,
                                                          scale_kind)
    q = cupy.asarray(q_host)
    out_buf = poisoned((total, h_q, head_dim), np_dtype(dtype), TAIL)
    lse_buf = poisoned((total, h_q), np.float32, TAIL)
    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, kv_dtype=FP8)
    attn.plan(q_lens, kv_lens, table, causal=causal, custom_mask=custom_mask)
    attn.run(q, cache, out=out_buf[:total], lse=lse_buf[:total])
    for launch in attn.planned.schedule.launches:  # fp8: every class on an fp8 tile
        assert launch.tile.kv_bytes == 1, launch.tile
    ref, ref_lse = reference.paged_attention(q_host, k, v, q_lens, kv_lens, table, causal=causal,
                                             custom_mask=custom_mask, return_lse=True, k_scale=ks, v_scale=vs)
    check = check_attention(out_buf.get(), ref, dtype, q_lens=q_lens, lse=lse_buf.get(), ref_lse=ref_lse,
                            poison=POISON, label=f"fp8 {label} B={len(q_lens)} page {page_size} D={head_dim} {heads} "
                                                 f"{scale_kind} scales")
    print(check.summary())
    check.assert_ok()
    if device_plan:  # the graph path's plan (device lengths, host bounds): the same bits
        dev = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, kv_dtype=FP8)
        dev.plan(cupy.asarray(q_lens, np.int32), cupy.asarray(kv_lens, np.int32), cupy.asarray(table), causal=causal,
                 custom_mask=custom_mask, max_q_len=int(q_lens.max()), max_kv_len=int(kv_lens.max()))
        dev_out = poisoned((total, h_q, head_dim), np_dtype(dtype), TAIL)
        dev.run(q, cache, out=dev_out[:total])
        assert dev.status() == 0
        same = (dev_out.view(np.uint16) == out_buf.view(np.uint16)).all(axis=(1, 2)).get()
        assert same.all(), f"device-planned rows {np.flatnonzero(~same).tolist()[:20]} differ from host-planned bits"
    return check


# (head dim, heads) rotate over the 8 (dtype, page size, scale kind) cases
SHAPES = [(128, (32, 8)), (64, (8, 1)), (256, (16, 2)), (128, (8, 8))]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scale_kind", ["tensor", "head"])
def test_fp8_random_ragged_batch(dtype, page_size, scale_kind):
    """Decode, prefill, extend and verify rows and padding in one batch (both families' launches)."""
    rng, seed = new_rng()
    head_dim, heads = SHAPES[((dtype == "float16") + 2 * (page_size == 16) + (scale_kind == "head")) % len(SHAPES)]
    lengths = random_lengths(rng, max_q=200, max_kv=4096, work_budget=2_000_000 // heads[0] * 8)
    run_fp8_case(rng, dtype, heads, head_dim, page_size, lengths, scale_kind, label=f"seed {seed} ragged")


@pytest.mark.parametrize("page_size", [4, 5, 8, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_page_sizes(page_size, head_dim):
    """fp8 attention at page sizes beside the suite's 1 and 16, every class of row in one ragged
    batch at each fp8 head dim: 4 and 8 (a pass of the CTA's copies spans several pages), 5 (not
    a power of two: the producer divides), 64 (a 128-key tile in two pages)."""
    rng, seed = new_rng()
    heads = {64: (8, 1), 128: (32, 8), 256: (16, 2)}[head_dim]
    dtype = "bfloat16" if (page_size + head_dim // 64) % 2 else "float16"
    lengths = random_lengths(rng, max_q=100, max_kv=3000, work_budget=1_000_000 // heads[0] * 8)
    run_fp8_case(rng, dtype, heads, head_dim, page_size, lengths, "head", label=f"seed {seed} pages")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", ["decode_b64_l1024", "verify_tree", "prefill_full"])
def test_fp8_named_shapes(dtype, shape):
    """A bench-like decode batch (whose small-q CTAs fold whole rows), tree verify with the custom
    mask, a non-causal prefill with odd lengths."""
    rng, seed = new_rng()
    if shape == "decode_b64_l1024":
        lengths = (np.ones(64, int), np.full(64, 1024))
        run_fp8_case(rng, dtype, (32, 8), 128, 16, lengths, "head", label=shape)
    elif shape == "verify_tree":
        q_lens = np.array([5, 8, 3, 6, 1])
        kv_lens = q_lens + np.array([700, 31, 1500, 0, 9])
        masks = tree_masks(rng, q_lens)
        run_fp8_case(rng, dtype, (32, 8), 128, 16, (q_lens, kv_lens), "tensor",
                     custom_mask=np.concatenate([m.ravel() for m in masks]), label=shape)
    else:
        lengths = (np.array([300, 77, 17]), np.array([300, 77, 1030]))
        run_fp8_case(rng, dtype, (16, 4), 128, 1, lengths, "head", causal=False, label=shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_subnormal_bytes_read_exactly(dtype):
    """K and V of e4m3 subnormals only (m x 2^-9, m = 1..7) and of the smallest normals: widened
    exactly (a flush to zero would leave every score 0 and the output 0), with per-head scales of
    1 and 2^-4, against float64 on the same bytes."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    h_q, h_kv, d, page_size = 8, 2, 128, 16
    kv_lens = np.array([64, 37, 200])
    table, k, v, scales, cache = subnormal_fp8_case(rng, kv_lens, page_size, d)
    q_host = (64 * rng.standard_normal((3, h_q, d), dtype=np.float32)).astype(np_dtype(dtype))
    attn = cupy_fa.BatchAttention(h_q, h_kv, d, dtype, kv_dtype=FP8).plan([1, 1, 1], kv_lens, table)
    out, lse = attn.run(cupy.asarray(q_host), cache, return_lse=True)
    ref, ref_lse = reference.paged_attention(q_host, k, v, [1, 1, 1], kv_lens, table, return_lse=True,
                                             k_scale=scales, v_scale=scales)
    # the case depends on the subnormals' values: the scores are not all 0 (LSE = log kv_len), nor the outputs
    assert np.abs(ref).max() > 1e-3 and np.abs(ref_lse - np.log(kv_lens)[:, None]).max() > 0.05
    check_attention(out.get(), ref, dtype, q_lens=[1, 1, 1], lse=lse.get(), ref_lse=ref_lse,
                    label=f"seed {seed} fp8 subnormals").assert_ok()


def test_fp8_bf16_queries_beyond_fp16_range():
    """bf16 queries whose rows span 2^4 .. 2^21 in magnitude (k_scale 2^-18 smaller, so the scores
    stay moderate), mixed inside each CTA's row block (the 4 heads of a KV head; a verify
    request's tokens): S = Q K^T runs in fp16 with each row scaled by its own power of two
    (paged_kv.cuh q_rows_to_fp16), so rows past fp16's 65504 would read inf (and NaN out) without
    it. Decode and a 4-token verify step against float64, LSE included."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    h_q, h_kv, d = 16, 4, 128
    q_lens, kv_lens = np.array([1, 4, 1]), np.array([300, 1030, 77])
    table, k, v, (ks, vs), _, _ = fp8_paged_case(rng, "bfloat16", (h_q, h_kv), d, 16, kv_lens, int(q_lens.sum()),
                                                 "head")
    ks = (ks * 2.0**-18).astype(np.float32)
    cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v), dtype=FP8, k_scale=ks, v_scale=vs)
    exponents = rng.integers(4, 22, size=(int(q_lens.sum()), h_q, 1))
    exponents[0, 0, 0], exponents[1, 1, 0] = 21, 4  # both ends, each beside other magnitudes in its block
    q_host = (rng.standard_normal((int(q_lens.sum()), h_q, d)) * 2.0**exponents).astype(np_dtype("bfloat16"))
    assert np.abs(q_host.astype(np.float32)).max() > 65504  # past fp16's range
    attn = cupy_fa.BatchAttention(h_q, h_kv, d, "bfloat16", kv_dtype=FP8).plan(q_lens, kv_lens, table)
    out, lse = attn.run(cupy.asarray(q_host), cache, return_lse=True)
    ref, ref_lse = reference.paged_attention(q_host, k, v, q_lens, kv_lens, table, causal=True, return_lse=True,
                                             k_scale=ks, v_scale=vs)
    check_attention(out.get(), ref, "bfloat16", q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse,
                    label=f"seed {seed} fp8, bf16 queries 2^4 .. 2^21").assert_ok()


# ---- every serving mode, eager and graph; fp8 against the 16-bit cache -------------------------

class Fp8Engine(Engine):
    """test_modes_graph_gpu's engine with an fp8 cache beside the 16-bit one: every step's new
    K/V go to both (quantised on the fly into the fp8 one), so the fp8 step's error against the
    16-bit step can be measured."""

    def __init__(self, rng, dtype, heads, head_dim, page_size, num_pages, scales):
        import cupy_fa

        super().__init__(rng, dtype, heads, head_dim, page_size, num_pages)
        self.cache16 = self.cache
        self.cache = cupy_fa.PagedKVCache.allocate(num_pages, page_size, self.h_kv, head_dim, FP8,
                                                   k_scale=scales[0], v_scale=scales[1])
        self.cache.k.fill(FP8_NAN)  # unwritten slots hold NaN: reading past kv_len shows up
        self.cache.v.fill(FP8_NAN)

    def write(self, rids, new_lens):
        import cupy

        slots = self.new_slots(rids, new_lens)
        if not slots:
            return
        shape = (len(slots), self.h_kv, self.d)
        k = cupy.asarray((2 * self.rng.standard_normal(shape, dtype=np.float32)).astype(self.dtype))
        v = cupy.asarray((2 * self.rng.standard_normal(shape, dtype=np.float32)).astype(self.dtype))
        slots = np.array(slots, np.int64)
        self.cache.append(k, v, slots)
        self.cache16.append(k, v, slots)


FP8_ENGINE_CONFIGS = [  # (dtype, head dim, heads, page size, the runner's max_q_len, scale kind)
    ("bfloat16", 128, (32, 8), 16, 16, "tensor"), ("float16", 128, (32, 8), 1, 16, "head"),
    ("bfloat16", 64, (8, 1), 1, 40, "head"), ("float16", 256, (16, 2), 16, 40, "tensor"),
    ("bfloat16", 128, (8, 1), 16, 40, "head"), ("float16", 64, (32, 8), 16, 16, "tensor"),
]


@pytest.mark.parametrize("dtype,head_dim,heads,page_size,max_q,scale_kind", FP8_ENGINE_CONFIGS,
                         ids=lambda c: str(c).replace(" ", "").replace("(", "").replace(")", "").replace(",", "x")
                         if isinstance(c, tuple) else str(c))
def test_fp8_engine_loop_eager_and_graph(dtype, head_dim, heads, page_size, max_q, scale_kind):
    """Every mode (EXTEND, DECODE, MIXED, TARGET_VERIFY chain / tree / holes, DRAFT_EXTEND v1 / v2,
    IDLE) through a GraphRunner over an fp8 cache, eager and replayed: against float64 on the
    dequantised cache, eager == graph bit for bit, the tail untouched; and the fp8 step's error
    against the same step over the 16-bit cache (printed)."""
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    # scales as an engine sets them, amax / 448 (the engine's K / V are N(0, 1) x 2, |x| < 10 but
    # for about 1 in 10^6): the fp8 step's error against the 16-bit one is then the rounding's
    amax = 10.0 * (rng.uniform(0.8, 1.25, heads[1]).astype(np.float32) if scale_kind == "head" else 1.0)
    scales = (amax / 448, amax / 448)
    engine = Fp8Engine(rng, dtype, heads, head_dim, page_size, (12000 // page_size) + 64, scales)
    max_pages = -(-2600 // page_size)
    kw = dict(max_batch_size=8, max_q_len=max_q, max_pages_per_request=max_pages, page_size=page_size,
              tree_mask=True)
    runner = cupy_fa.GraphRunner(heads[0], heads[1], head_dim, dtype, kv_dtype=FP8, **kw)
    runner16 = cupy_fa.GraphRunner(heads[0], heads[1], head_dim, dtype, **kw)
    engine_setup(rng, engine)
    for step in engine_steps(rng, engine, runner, max_q, max_pages):
        mode, name, q_lens, kv_lens, table, total, q, mask, eager, graph = step[:10]
        check = check_engine_step(step, engine, dtype, f"seed {seed} fp8", k_scale=engine.cache.k_scale,
                                  v_scale=engine.cache.v_scale)
        if total:  # fp8 against the 16-bit cache the same K/V went into
            out16 = runner16.run(mode, q, engine.cache16, q_lens, kv_lens, table, custom_mask=mask,
                                 use_graph=False).get()
            err = reference.relative_error(eager[0][:total].astype(np.float64), out16.astype(np.float64))
            err_ref16 = reference.relative_error(out16.astype(np.float64), reference.paged_attention(
                q.get(), engine.cache16.k.get(), engine.cache16.v.get(), q_lens, kv_lens, table, custom_mask=mask))
            print(f"fp8 vs {dtype} cache, {name}: rel err {err:.3e} (the {dtype} step against float64: "
                  f"{err_ref16:.3e}; {scale_kind} scales, D={head_dim}, page {page_size})")
            report(mode=name, dtype=dtype, d=head_dim, page=page_size, scales=scale_kind, fp8_vs_16bit=err,
                   fp8_vs_ref=check.worst.get("request_rel", (0.0,))[0], ref16=err_ref16)
    assert runner.num_graphs >= 8


# ---- batch invariance ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_decode_equals_verify_bitwise(dtype, heads, page_size):
    """Over an fp8 cache, a token's output (and LSE) has the same bits from decode, from verify
    with 4, 8 or 16 drafts, and alone in a batch of one; verify is held to float64 too."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, seed = new_rng()
    h_q, h_kv = heads
    head_dim = 128 if heads == (32, 8) else 64
    S = schedule.split_size(kv_bytes=1)  # an fp8 cache's splits (schedule.FP8_SPLIT_SIZE by default)
    prefix = np.array([5, S - 3, 2 * S - 1, 3 * S + 2, int(rng.integers(1, 5000)), int(rng.integers(1, 300))])
    B = len(prefix)
    for num_draft in (4, 8, 16):
        kv = prefix + num_draft
        table, k, v, (ks, vs), cache, q_host = fp8_paged_case(rng, dtype, heads, head_dim, page_size, kv,
                                                              B * num_draft, "head")
        q = cupy.asarray(q_host)
        attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, kv_dtype=FP8)
        verify = cupy.full(q.shape, np.nan, q.dtype)
        verify_lse = cupy.full(q.shape[:2], np.nan, np.float32)
        attn.plan(np.full(B, num_draft), kv, table).run(q, cache, out=verify, lse=verify_lse)
        ref, ref_lse = reference.paged_attention(q_host, k, v, np.full(B, num_draft), kv, table, return_lse=True,
                                                 k_scale=ks, v_scale=vs)
        check_attention(verify.get(), ref, dtype, q_lens=np.full(B, num_draft), lse=verify_lse.get(), ref_lse=ref_lse,
                        label=f"seed {seed} fp8 verify N={num_draft}").assert_ok()
        q_rows = q.reshape(B, num_draft, h_q, head_dim)
        verify_rows = verify.reshape(B, num_draft, h_q, head_dim)
        lse_rows = verify_lse.reshape(B, num_draft, h_q)
        for i in range(num_draft):
            decode = cupy.full((B, h_q, head_dim), np.nan, np_dtype(dtype))
            decode_lse = cupy.full((B, h_q), np.nan, np.float32)
            attn.plan(np.ones(B, int), prefix + i + 1, table).run(cupy.ascontiguousarray(q_rows[:, i]), cache,
                                                                  out=decode, lse=decode_lse)
            assert attn.planned.tile.row_halves == 1  # decode's one row half, verify's full tiles
            same = (decode.view(np.uint16) == verify_rows[:, i].view(np.uint16)).all(axis=(1, 2)).get()
            assert same.all(), (f"seed {seed} N={num_draft} draft {i}: fp8 decode and verify differ for requests "
                                f"{np.flatnonzero(~same).tolist()}")
            assert (decode_lse.view(np.uint32) == lse_rows[:, i].view(np.uint32)).all().get()
        b, i = int(rng.integers(0, B)), int(rng.integers(0, num_draft))
        alone = cupy.full((1, h_q, head_dim), np.nan, np_dtype(dtype))
        attn.plan([1], [int(prefix[b]) + i + 1], table[b:b + 1]).run(cupy.ascontiguousarray(q_rows[b, i:i + 1]),
                                                                      cache, out=alone)
        assert (alone[0].view(np.uint16) == verify_rows[b, i].view(np.uint16)).all().get()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fp8_one_row_half_never_changes_a_bit(dtype, page_size, monkeypatch):
    """Requests of at most 8 packed rows over an fp8 cache run the one-row tile with one row half
    (the softmax of rows 8 .. 15 not issued) and, on sm_90a at head dims 64 and 128, a producer
    warpgroup issuing the K/V copies: outputs and LSEs have the bits of the one-half tile without the
    producers (CUPY_FA_PRODUCER_WARP=0) and of the full tile (CUPY_FA_HALF_ROWS=0), eager and planned
    inside a captured graph, with and without CTAs folding their splits; decode at groups 4 and 8,
    verify of 2 tokens at group 4, head dims 64, 128, 256; held to float64 too."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, seed = new_rng()
    S = schedule.split_size(kv_bytes=1)
    for head_dim, heads, num_draft in ((128, (32, 8), 1), (128, (32, 8), 2), (64, (16, 2), 1), (256, (8, 2), 1)):
        h_q, h_kv = heads
        prefix = np.array([1, 7, S - 1, S + 3, 2 * S + int(rng.integers(0, S)), 9 * S - 5,
                           int(rng.integers(1, 3 * S))])
        B = len(prefix)
        kv, q_lens = prefix + num_draft, np.full(B, num_draft)
        table, k, v, (ks, vs), cache, q_host = fp8_paged_case(rng, dtype, heads, head_dim, page_size, kv,
                                                              B * num_draft, "head")
        q = cupy.asarray(q_host)
        case = f"seed {seed} D={head_dim} heads {h_q}/{h_kv} q_len {num_draft} page {page_size}"
        # the tile each configuration must run: (row halves, producer warps where the CTAs fold); the
        # producer warpgroup runs where they fold at D = 128 on sm_90a (families.mma_sync.MmaTile.producer_warps)
        sm90a = cupy.cuda.Device().compute_capability == "90" and not os.environ.get("CUPY_FA_ARCH")
        producers = 4 if sm90a and head_dim == 128 else 0
        configs = {"ring": ("1", "1", (1, producers)), "1": ("1", "0", (1, 0)), "0": ("0", "1", (2, 0))}
        outs = {}
        for name, (halves, producer, shape) in configs.items():
            monkeypatch.setenv("CUPY_FA_HALF_ROWS", halves)
            monkeypatch.setenv("CUPY_FA_PRODUCER_WARP", producer)
            for fold in ("0", "1"):
                monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", fold)
                cupy_fa.knobs.reload()
                attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, kv_dtype=FP8).plan(q_lens, kv, table)
                tile = attn.planned.tile
                assert tile.fold_capable == (fold == "1"), (case, name, tile)
                assert (tile.row_halves, tile.producer_warps) == (shape[0], shape[1] if fold == "1" else 0), \
                    (case, name, tile)
                out = cupy.full(q.shape, np.nan, np_dtype(dtype))
                lse = cupy.full(q.shape[:2], np.nan, np.float32)
                attn.run(q, cache, out=out, lse=lse)
                outs[name, fold] = (out, lse)
            graph_attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, kv_dtype=FP8)
            graph_out = run_planned_in_graph(graph_attn, q_lens, kv, table, q, cache, num_draft, int(kv.max()))
            tile = graph_attn.planned.tile
            assert (tile.row_halves, tile.producer_warps) == shape, (case, name, tile)
            outs[name, "graph"] = (graph_out, None)
        monkeypatch.delenv("CUPY_FA_HALF_ROWS")
        monkeypatch.delenv("CUPY_FA_PRODUCER_WARP")
        cupy_fa.knobs.reload()
        ref, ref_lse = reference.paged_attention(q_host, k, v, q_lens, kv, table, return_lse=True,
                                                 k_scale=ks, v_scale=vs)
        first = outs["ring", "1"]
        check_attention(first[0].get(), ref, dtype, q_lens=q_lens, lse=first[1].get(), ref_lse=ref_lse,
                        label=case).assert_ok()
        for key in outs:
            if key[1] == "graph":
                continue
            assert (first[0].view(np.uint16) == outs[key][0].view(np.uint16)).all().get(), (case, key)
            assert (first[1].view(np.uint32) == outs[key][1].view(np.uint32)).all().get(), (case, key)
        for name in ("1", "0"):
            assert (outs["ring", "graph"][0].view(np.uint16) == outs[name, "graph"][0].view(np.uint16)).all().get(), \
                (case, name)
        check_attention(outs["ring", "graph"][0].get(), ref, dtype, q_lens=q_lens, label=case + " graph").assert_ok()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_fold_splits_never_changes_a_bit(dtype, page_size, monkeypatch):
    """Over an fp8 cache (1024-key splits), CTAs that fold their own splits give the bits of
    partials + merge_kernel (CUPY_FA_FOLD_SPLITS=0) and of decode of each token: batches whose
    rows are one group of 8 splits at most or two (a CTA folds a whole row) and up to four (a
    CTA per group, whose states merge_kernel folds), decode and verify q = 4, head dims 64 and
    128, and planned inside a captured graph (a CTA per group)."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, seed = new_rng()
    h_q, h_kv = 32, 8
    S = schedule.split_size(kv_bytes=1)
    for head_dim in (128, 64):
        for num_draft in (1, 4):
            for groups in (1, 2, 4):  # the most groups of 8 splits a row of the batch has
                prefix = np.array([3, S - 10, S + 1, 2 * S - 4, 5 * S + 7, 8 * S - num_draft, 8 * S - 10,
                                   int(rng.integers(1, 8 * S - num_draft))])
                if groups == 2:
                    prefix = np.concatenate([prefix, [8 * S + 2, 16 * S - num_draft]])
                if groups == 4:
                    prefix = np.concatenate([prefix, [16 * S + 5, 24 * S + 3, int(rng.integers(16 * S, 24 * S))]])
                B = len(prefix)
                kv, q_lens = prefix + num_draft, np.full(B, num_draft)
                table, k, v, (ks, vs), cache, q_host = fp8_paged_case(rng, dtype, (h_q, h_kv), head_dim, page_size,
                                                                      kv, B * num_draft, "head")
                q = cupy.asarray(q_host)
                case = f"seed {seed} D={head_dim} N={num_draft} page {page_size}, rows of up to {groups} groups"
                outs = {}
                for fold in ("0", "1"):
                    monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", fold)
                    cupy_fa.knobs.reload()  # knobs are read once: take the new value
                    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, kv_dtype=FP8).plan(q_lens, kv, table)
                    tile = attn.planned.tile
                    assert tile.fold_splits == (fold == "1") and tile.warps_m == 1, case
                    if fold == "1":  # whole rows of one or two groups, else a CTA per group
                        assert tile.splits_per_cta == 8 * (groups if groups <= 2 else 1), case
                    out = cupy.full(q.shape, np.nan, np_dtype(dtype))
                    lse = cupy.full(q.shape[:2], np.nan, np.float32)
                    attn.run(q, cache, out=out, lse=lse)
                    outs[fold] = (out, lse)
                ref, ref_lse = reference.paged_attention(q_host, k, v, q_lens, kv, table, return_lse=True,
                                                         k_scale=ks, v_scale=vs)
                check_attention(outs["1"][0].get(), ref, dtype, q_lens=q_lens, lse=outs["1"][1].get(),
                                ref_lse=ref_lse, label=case).assert_ok()
                assert (outs["1"][0].view(np.uint16) == outs["0"][0].view(np.uint16)).all().get(), case
                assert (outs["1"][1].view(np.uint32) == outs["0"][1].view(np.uint32)).all().get(), case
                if num_draft == 4:  # each verify token against its decode (folded as a decode batch folds)
                    q_rows = q.reshape(B, num_draft, h_q, head_dim)
                    rows = outs["1"][0].reshape(B, num_draft, h_q, head_dim)
                    for i in (0, 3):
                        attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, kv_dtype=FP8).plan(
                            np.ones(B, int), prefix + i + 1, table)
                        decode = cupy.full((B, h_q, head_dim), np.nan, np_dtype(dtype))
                        attn.run(cupy.ascontiguousarray(q_rows[:, i]), cache, out=decode)
                        same = (decode.view(np.uint16) == rows[:, i].view(np.uint16)).all(axis=(1, 2)).get()
                        assert same.all(), f"{case} draft {i}: decode and verify differ for {np.flatnonzero(~same)}"

                # planned on the device inside a captured graph (the host sees only bounds: a CTA per group)
                graph_attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, kv_dtype=FP8)
                graph_out = run_planned_in_graph(graph_attn, q_lens, kv, table, q, cache, num_draft, int(kv.max()))
                assert graph_attn.planned.tile.fold_splits and graph_attn.planned.tile.splits_per_cta == 8, case
                assert (graph_out.view(np.uint16) == outs["0"][0].view(np.uint16)).all().get(), case


@pytest.mark.parametrize("fold", ["0", "1"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_fp8_page_id_outside_the_cache(fold, where, monkeypatch):
    """A page id outside the cache in one request of an fp8 decode step (in its first, a middle or
    its last split; one row half, CTAs folding their splits or not): no fault, that request's rows
    NaN, every other request's bits as in the clean step, the status word naming it."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", fold)
    cupy_fa.knobs.reload()
    rng, seed = new_rng()
    S, page = schedule.split_size(kv_bytes=1), 16
    kv = np.array([5 * S + 37, 3 * S + 1, 4 * S - 9, 700])
    B = len(kv)
    q_lens = np.ones(B, int)
    table, k, v, scales, cache, q_host = fp8_paged_case(rng, "bfloat16", (32, 8), 128, page, kv, B, "head")
    q = cupy.asarray(q_host)
    attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16", kv_dtype=FP8, max_batch_size=8, max_num_tokens=64,
                                  max_pages_per_request=table.shape[1])

    def run(tab):
        attn.plan(cupy.asarray(q_lens, np.int32), cupy.asarray(kv, np.int32), cupy.asarray(tab, np.int32),
                  max_q_len=1, max_kv_len=table.shape[1] * page)
        assert attn.planned.tile.row_halves == 1 and attn.planned.tile.fold_splits == (fold == "1")
        out = cupy.full(q.shape, POISON, np_dtype("bfloat16"))
        attn.run(q, cache, out=out)
        cupy.cuda.Device().synchronize()
        return out.get()

    clean = run(table)
    assert attn.status().ok, f"seed {seed}"
    ref = reference.paged_attention(q_host, k, v, q_lens, kv, table, k_scale=scales[0], v_scale=scales[1])
    check_attention(clean, ref, "bfloat16", q_lens=q_lens, poison=POISON, label=f"seed {seed} clean").assert_ok()
    bad = 0
    column = {"first": 0, "middle": (2 * S + 5) // page, "last": (int(kv[bad]) - 1) // page}[where]
    tab = table.copy()
    tab[bad, column] = 10**8
    got = run(tab)
    status = attn.status()
    assert not status.ok and status.request == bad and status.reason == 6, f"seed {seed}: {status!r}"
    assert np.isnan(got[bad].astype(np.float32)).all(), f"seed {seed}: the bad request's rows are not all NaN"
    assert np.array_equal(got[1:].view(np.uint16), clean[1:].view(np.uint16)), f"seed {seed}: other requests changed"


# ---- refusals: before anything is launched, nothing written ---------------------------------------

def test_fp8_refusals_write_nothing():
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    h_kv, d = 2, 128
    raw = cupy.full((8, 16, h_kv, d), 0x33, np.uint8)
    with pytest.raises(TypeError, match="dtype='float8_e4m3fn'"):
        cupy_fa.PagedKVCache(raw, raw.copy())
    for bad, kind in ((0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                      (1e-40, ValueError), ([1.0, 2.0, 3.0], ValueError),
                      (np.ones((8, 16, h_kv), np.float32), ValueError),
                      ("a", TypeError)):
        with pytest.raises(kind, match="k_scale"):
            cupy_fa.PagedKVCache(raw, raw.copy(), dtype=FP8, k_scale=bad)
    with pytest.raises(ValueError, match="v_scale"):
        cupy_fa.PagedKVCache(raw, raw.copy(), dtype=FP8, v_scale=cupy.asarray([1.0, -2.0], np.float32))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        cupy_fa.PagedKVCache(raw, raw.astype(np.float16), dtype=FP8)
    with pytest.raises(ValueError, match=re.escape("are for an fp8 (float8_e4m3fn) cache")):
        cupy_fa.PagedKVCache.allocate(8, 16, h_kv, d, "bfloat16", k_scale=0.5)
    cache = cupy_fa.PagedKVCache(raw, raw.copy(), dtype=FP8, k_scale=cupy.asarray(0.5, np.float32),
                                 v_scale=np.array([0.25, 0.5], np.float32))
    assert cache.k_scale.tolist() == [0.5, 0.5] and cache.v_scale.tolist() == [0.25, 0.5]
    k32 = cupy.ones((3, h_kv, d), np.float32)
    kb = cupy.ones((3, h_kv, d), np_dtype("bfloat16"))
    kh = cupy.ones((3, h_kv, d), np.float16)
    with pytest.raises(TypeError, match="k_new must be float16 or bfloat16"):
        cache.append(k32, k32, [0, 1, 2])
    with pytest.raises(TypeError, match="v_new"):
        cache.append(kb, kh, [0, 1, 2])
    with pytest.raises(ValueError, match="slots"):
        cache.append(kb, kb, [0, 1, 8 * 16])
    assert bool((cache.k == 0x33).all()) and bool((cache.v == 0x33).all()), "a refused append wrote the cache"
    # the attention side: the cache dtype must be the instance's kv_dtype
    with pytest.raises(TypeError, match=re.escape("kv_dtype must be dtype")):
        cupy_fa.BatchAttention(16, h_kv, d, "bfloat16", kv_dtype="float16")
    q = cupy.ones((1, 16, d), np_dtype("bfloat16"))
    out = cupy.full((1, 16, d), POISON, np_dtype("bfloat16"))
    attn = cupy_fa.BatchAttention(16, h_kv, d, "bfloat16").plan([1], [5], [[0]])
    with pytest.raises(TypeError, match="kv_dtype='float8_e4m3fn'"):
        attn.run(q, cache, out=out)
    cache16 = cupy_fa.PagedKVCache.allocate(8, 16, h_kv, d, "bfloat16")
    attn8 = cupy_fa.BatchAttention(16, h_kv, d, "bfloat16", kv_dtype=FP8).plan([1], [5], [[0]])
    with pytest.raises(TypeError, match="kv_dtype float8_e4m3fn"):
        attn8.run(q, cache16, out=out)
    assert bool((out == POISON).all()), "a refused run wrote out"


@pytest.mark.torch
def test_fp8_torch_tensors():
    """torch float8_e4m3fn K/V (zero copy, as uint8 bytes), bf16 torch rows appended, torch q in and out."""
    import torch

    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    page_size, h_kv, d = 16, 8, 128
    kv_lens = np.array([300, 17, 999])
    table, pages = paged_layout(rng, kv_lens, page_size)
    k = torch.zeros(pages, page_size, h_kv, d, dtype=torch.float8_e4m3fn, device="cuda")
    v = torch.zeros_like(k)
    k_scale = rng.uniform(0.005, 0.02, h_kv).astype(np.float32)
    cache = cupy_fa.PagedKVCache(k, v, k_scale=torch.from_numpy(k_scale).cuda(), v_scale=0.0125)
    assert cache.is_fp8 and cache.k.data.ptr == k.data_ptr()
    slots = np.concatenate([table[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
                            for b, n in enumerate(kv_lens)])
    new = (len(slots), h_kv, d)
    k_new = torch.from_numpy(2 * rng.standard_normal(new, dtype=np.float32)).to("cuda", torch.bfloat16)
    v_new = torch.from_numpy(2 * rng.standard_normal(new, dtype=np.float32)).to("cuda", torch.bfloat16)
    cache.append(k_new, v_new, torch.from_numpy(slots))
    q = torch.from_numpy(rng.standard_normal((3, 32, d), dtype=np.float32)).to("cuda", torch.bfloat16)
    attn = cupy_fa.BatchAttention(32, h_kv, d, "bfloat16", kv_dtype=torch.float8_e4m3fn)
    out = attn.plan([1, 1, 1], kv_lens, table).run(q, cache)
    assert isinstance(out, torch.Tensor)
    k_bytes = k.view(torch.uint8).cpu().numpy()
    assert (k_bytes.reshape(-1, h_kv, d)[slots] == reference.quantize_e4m3(k_new.float().cpu().numpy(),
                                                                          k_scale)).all()
    ref = reference.paged_attention(q.float().cpu().numpy(), k_bytes, v.view(torch.uint8).cpu().numpy(),
                                    np.ones(3, int), kv_lens, table, k_scale=k_scale, v_scale=0.0125)
    check_attention(out.float().cpu().numpy(), ref, "bfloat16", q_lens=np.ones(3, int),
                    label=f"seed {seed} torch fp8").assert_ok()
