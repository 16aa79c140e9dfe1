"""The attention variants (sliding window, logits soft-cap, attention sinks) without a GPU: the
float64 reference's own semantics (limits that must give the plain result, hand-computed cases),
the API's checks, which kernel binary and which parameters a step with a variant launches, and
the variant kernels' place in what CI compiles."""

import math
import types

import numpy as np
import pytest

from cases import new_rng
from test_families_cpu import _Buf, recorded_launches
from cupy_fa import attention, reference, schedule
from cupy_fa.families import sm90 as s9
from cupy_fa import families
from cupy_fa import catalog

H200 = dict(smem_limit=families.common.SMEM_LIMIT, sm_count=132, arch="sm_90a")


def random_step(rng, q_lens, kv_lens, h_q=4, h_kv=2, d=16, page=4):
    """A small host step: q, a shuffled paged cache and its table."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    pages = [-(-int(kv) // page) for kv in kv_lens]
    order = rng.permutation(sum(pages) + 2)
    table = np.zeros((len(kv_lens), max(pages)), np.int64)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[at:at + n]
        at += n
    k = rng.standard_normal((sum(pages) + 2, page, h_kv, d))
    v = rng.standard_normal((sum(pages) + 2, page, h_kv, d))
    q = rng.standard_normal((int(q_lens.sum()), h_q, d))
    return q, k, v, q_lens, kv_lens, table


STEP = dict(q_lens=[1, 4, 7, 0, 3], kv_lens=[9, 30, 7, 5, 64])


@pytest.mark.parametrize("causal,mask", [(True, False), (False, False), (True, True)])
def test_reference_limits_give_the_plain_result(causal, mask):
    """A window covering every key, a huge soft-cap and sinks of -inf are the plain attention."""
    rng, _ = new_rng()
    q, k, v, q_lens, kv_lens, table = random_step(rng, **STEP)
    custom = np.concatenate([(rng.random((n, n)) < 0.6).ravel() for n in q_lens]) if mask else None
    plain, plain_lse = reference.paged_attention(q, k, v, q_lens, kv_lens, table, causal=causal, custom_mask=custom,
                                                 return_lse=True)
    for kwargs in (dict(window=int(kv_lens.max())), dict(window=10**6), dict(soft_cap=1e7),
                   dict(sinks=np.full(4, -np.inf)), dict(window=None, soft_cap=None, sinks=None), dict(window=-1)):
        out, lse = reference.paged_attention(q, k, v, q_lens, kv_lens, table, causal=causal, custom_mask=custom,
                                             return_lse=True, **kwargs)
        np.testing.assert_allclose(out, plain, rtol=1e-9, atol=1e-12, err_msg=str(kwargs))
        np.testing.assert_allclose(lse, plain_lse, rtol=1e-9, atol=1e-12, err_msg=str(kwargs))
    # and a window that does cut keys changes the result
    cut = reference.paged_attention(q, k, v, q_lens, kv_lens, table, causal=causal, custom_mask=custom, window=3)
    assert not np.allclose(cut[:1], plain[:1])


def one_query(scores, values, **kwargs):
    """One query, one head (D = 1 keys of `scores` against q = 1, sm_scale 1), page size 1."""
    n = len(scores)
    k = np.asarray(scores, np.float64).reshape(n, 1, 1, 1)
    v = np.asarray(values, np.float64).reshape(n, 1, 1, 1)
    out, lse = reference.paged_attention(np.ones((1, 1, 1)), k, v, [1], [n], [list(range(n))], sm_scale=1.0,
                                         return_lse=True, **kwargs)
    return float(out[0, 0, 0]), float(lse[0, 0])


def test_reference_hand_cases():
    s, v = [0.5, -1.0, 2.0, 1.0], [3.0, -2.0, 5.0, 7.0]
    # the window: the last query (position 3) sees keys 3 - W + 1 .. 3
    out, lse = one_query(s, v, window=2)
    w = np.exp([2.0, 1.0])
    assert out == pytest.approx((w[0] * 5 + w[1] * 7) / w.sum()) and lse == pytest.approx(math.log(w.sum()))
    out, lse = one_query(s, v, window=1)
    assert out == pytest.approx(7.0) and lse == pytest.approx(1.0)
    # the soft-cap: cap * tanh(s / cap) before the softmax
    cap = 1.5
    c = cap * np.tanh(np.array(s) / cap)
    out, lse = one_query(s, v, soft_cap=cap)
    assert out == pytest.approx(float(np.exp(c) @ v / np.exp(c).sum()))
    assert lse == pytest.approx(float(np.log(np.exp(c).sum())))
    # a sink: one more term of the denominator, with a zero value
    out, lse = one_query(s, v, sinks=[0.25])
    e = np.exp(s)
    assert out == pytest.approx(float(e @ v / (e.sum() + math.exp(0.25))))
    assert lse == pytest.approx(math.log(e.sum() + math.exp(0.25)))
    # all three: window, then cap, then the sink
    out, lse = one_query(s, v, window=3, soft_cap=cap, sinks=[3.0])
    e = np.exp(c[1:])
    assert out == pytest.approx(float(e @ v[1:] / (e.sum() + math.exp(3.0))))
    assert lse == pytest.approx(math.log(e.sum() + math.exp(3.0)))


def test_reference_sink_of_a_row_that_sees_nothing():
    """A draft that sees no draft key (its mask row empty) and no prefix key (a window of 1 hides
    it): out 0, lse the sink; without a sink lse -inf."""
    k = np.ones((1, 4, 1, 2))
    q = np.ones((2, 1, 2))
    mask = np.array([[True, False], [False, False]])
    for sinks, want in ((None, -np.inf), ([1.25], 1.25)):
        out, lse = reference.paged_attention(q, k, k, [2], [4], [[0]], custom_mask=mask, window=1, sinks=sinks,
                                             return_lse=True)
        assert (out[1] == 0).all() and lse[1, 0] == want
        assert np.isfinite(lse[0, 0])


# ---- the API's checks (before anything touches a device) ------------------------------------------


@pytest.mark.parametrize("window", [0, -2, True, 2.5, "4"])
def test_plan_refuses_a_bad_window(window):
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        attention.BatchAttention(8, 2, 64).plan([1], [4], [[0]], window=window)


@pytest.mark.parametrize("cap", [-1.0, float("nan"), float("inf"), True, "30"])
def test_plan_refuses_a_bad_soft_cap(cap):
    with pytest.raises(ValueError, match="logits_soft_cap must be a positive finite number"):
        attention.BatchAttention(8, 2, 64).plan([1], [4], [[0]], logits_soft_cap=cap)


def test_the_none_values():
    assert attention.checked_window(None) == attention.checked_window(-1) == 0
    assert attention.checked_window(np.int64(4096)) == 4096 and attention.checked_window(2**40) == 2**30
    assert attention.checked_soft_cap(None) == attention.checked_soft_cap(0) == 0.0
    assert attention.checked_soft_cap(np.float32(30)) == 30.0


@pytest.mark.parametrize("variant", ["window", "logits_soft_cap", "sinks"])
def test_an_fp8_cache_takes_each_variant(monkeypatch, variant):
    """An fp8 kv_dtype with each variant is planned and run as a 16-bit cache's: plan and the
    GraphRunner go on to the device (which here raises RuntimeError), run with sinks to its plan
    check, GraphRunner.run with sinks to its cache check; no refusal of its own."""
    from cupy_fa import GraphRunner, _arrays

    monkeypatch.setattr(_arrays, "_cuda_ready", False)
    monkeypatch.setattr(_arrays, "cuda_problem", lambda: "no NVIDIA driver was found (simulated here)")
    fp8 = dict(kv_dtype="float8_e4m3fn")
    sizes = dict(max_batch_size=4, max_q_len=4, max_pages_per_request=2, page_size=16)
    on = {"window": dict(window=8), "logits_soft_cap": dict(logits_soft_cap=30.0), "sinks": {}}[variant]
    if variant == "sinks":
        sinks = np.zeros(8, np.float32)
        with pytest.raises(RuntimeError, match="before plan"):
            attention.BatchAttention(8, 2, 64, **fp8).run(np.zeros((1, 8, 64), np.float16), None, sinks=sinks)
        runner = types.SimpleNamespace(attn=types.SimpleNamespace(kv_dtype_name=_arrays.FP8))
        with pytest.raises(TypeError, match="cache must be a cupy_fa.PagedKVCache"):
            GraphRunner.run(runner, "decode", None, None, [1], [4], [[0]], sinks=sinks)
        return
    with pytest.raises(RuntimeError, match="cannot run here"):
        attention.BatchAttention(8, 2, 64, **fp8).plan([1], [4], [[0]], **on)
    with pytest.raises(RuntimeError, match="cannot run here"):
        GraphRunner(8, 2, 64, "bfloat16", **sizes, **fp8, **on)


def test_fp8_kernels_with_the_variant_hooks_are_listed():
    """CI compiles each fp8 kernel's hooked twin (both families); warm-up with variants lists them
    beside the plain kernels."""
    kw = dict(smem_limit=families.common.SMEM_LIMIT, arch="sm_90a", kv_dtypes=("float8_e4m3fn",))
    warm = catalog.warmup_kernels(("bfloat16",), (128,), variants=True, **kw)
    types8 = families.common.ElementTypes("bfloat16", "float8_e4m3fn", "bfloat16")
    for tile in (schedule.tile_for(128, 1, 4, kv_bytes=1, arch="sm_90a"), s9.FP8_TILES[128]):
        assert catalog.attention_kernel(types8, tile.with_variants()) in warm
    hooked8 = [v for v in warm if "fp8_e4m3" in v.expression and v.source in ("mma_sync/attention.cu", "sm90/prefill.cu")]
    plain8 = catalog.warmup_kernels(("bfloat16",), (128,), **kw)
    assert set(plain8) < set(warm)
    added = set(hooked8) - set(plain8)  # the hooked twins (tiles of one or two row halves share one)
    assert added and all(", true" in v.expression.split("Traits<")[1] for v in added)
    assert len(added) == len({v.expression for v in added})
    assert set(warm) <= set(catalog.all_kernels())


# ---- what a step with a variant launches ---------------------------------------------------------


def launches(monkeypatch, q_lens, kv_lens, window=0, soft_cap=0.0, sinks=False, h_q=32, h_kv=8, d=128):
    """(attn, schedule, [(variant, params)] of the launches, the sinks buffer) of a step on the H200."""
    sinks_buf = _Buf((h_q,)) if sinks else None
    attn, sched, calls = recorded_launches(monkeypatch, d, h_q, h_kv, q_lens, kv_lens, H200, window, soft_cap,
                                           sinks_buf)
    return attn, sched, [(variant, params) for variant, _, params, _ in calls], sinks_buf


@pytest.mark.parametrize("variant", ["none", "window", "softcap", "sinks"])
def test_a_step_with_a_variant_launches_the_hooked_kernels(monkeypatch, variant):
    q, kv = [1, 2048, 1, 4], [4096, 4096, 700, 3000]
    window = 700 if variant == "window" else 0
    cap = 30.0 if variant == "softcap" else 0.0
    attn, sched, calls, sinks = launches(monkeypatch, q, kv, window, cap, variant == "sinks")
    (long_v, long_p), (small_v, small_p), (merge_v, merge_p) = calls
    hooked = variant != "none"
    for v, tile in ((long_v, sched.long.tile), (small_v, sched.small.tile)):
        assert v == catalog.attention_kernel("bfloat16", tile.with_variants() if hooked else tile)
    for p in (long_p, small_p):
        assert p["window"] == window and p["key_base"] == attn._buffers.key_base.data.ptr
        assert p["soft_cap_log2"] == pytest.approx(cap * 1.4426950408889634)
        # 2 log2(e) sm_scale / cap: the kernel's tanh takes 2^(s x it) (variant.cuh tanh_of_exp2_arg)
        assert p["soft_cap_scale"] == pytest.approx(2 * 1.4426950408889634 * 0.088 / cap if cap else 0.0)
        assert p["sinks"] == (sinks.data.ptr if sinks else 0)
    assert merge_v.source == "shared/merge.cu" and merge_p["sinks"] == (sinks.data.ptr if sinks else 0)


def test_a_window_shrinks_the_grid(monkeypatch):
    """Decode B=4 over 131072 keys with a window of 4096: a grid of the window's splits."""
    q, kv = [1] * 4, [131072] * 4
    _, plain, _, _ = launches(monkeypatch, q, kv)
    _, windowed, _, _ = launches(monkeypatch, q, kv, window=4096)
    assert windowed.small.max_splits == 8 < plain.small.max_splits == 256
    assert windowed.small.work_grid == 4 * 8 and windowed.small.ctas * 4 <= plain.small.ctas


# ---- the variant kernels in what CI compiles and warm-up lists ---------------------------------------------


def test_every_attention_kernel_has_a_hooked_twin_and_the_plain_names_stay():
    """CI compiles each attention kernel twice: plain and with the hooks (the mma.sync traits' one
    more template argument, true; the wgmma traits' VARIANTS argument true)."""
    everything = catalog.all_kernels()
    # the 16-bit kernels (an fp8 cache's hooked twins: test_fp8_kernels_with_the_variant_hooks_are_listed)
    attention_kernels = {v.expression for v in everything if v.source in ("mma_sync/attention.cu", "sm90/prefill.cu")
                         and "fp8_e4m3" not in v.expression}
    # the hooked twin: VARIANTS = true after the traits' last argument (the mma.sync traits' KV_BYTES
    # is then spelled out); a wgmma tile holds at most 80 keys a tile hooked, 64 where 80 are not
    # whole passes of its producer (Sm90Tile.with_variants: the window test's bound), the
    # soft-cap's tanh form (SOFT_CAP_TANH) spelled after it where it is not the exact one (or where
    # V's head dim follows: separate qk / vo head dims), and with the Newton form no warp-uniform
    # warpgroup index
    def hooked_name(e):
        if "TileTraits<" in e and e.endswith(", 2, false, 2, 0, 128>>"):  # separate qk / vo head dims
            return e[:-len(", 2, false, 2, 0, 128>>")] + ", 2, true, 2, 0, 128>>"
        if "TileTraits<" in e and "Sm90PrefillTraits<" not in e:
            return e[:-2] + ", 2, true>>"
        pair = e.endswith(", false, 2, 0, 0, 128>>")  # a wgmma tile of 192 / 128
        if not e.endswith(", false>>") and not pair:
            return None  # a hooked wgmma kernel already
        head, args = e.split("Sm90PrefillTraits<")
        args = args[:-len(">>")].split(", ")  # D, block_n, stages, pingpong, producer regs, uniform_wg, ...
        args, vo = (args[:10], args[13:]) if pair else (args, [])
        keys = min(int(args[1]), 80)
        args[1] = str(keys if keys % s9.DEFAULT_TILES[int(args[0])].copy_rows == 0 else 64)
        if s9.SOFT_CAP_TANH == 2:  # the Newton form's kernel without the warp-uniform warpgroup index
            args[5] = "false"
        tanh = [f"2", "0", f"{s9.SOFT_CAP_TANH}"] if s9.SOFT_CAP_TANH or vo else []
        return head + "Sm90PrefillTraits<" + ", ".join(args[:-1] + ["true"] + tanh + vo) + ">>"
    twin = {e: hooked_name(e) for e in attention_kernels}
    plain = {e for e in twin if twin[e] in attention_kernels}
    hooked = attention_kernels - plain
    assert plain and len(plain) == len(hooked) and hooked == {twin[e] for e in plain}
    assert "TileTraits<128, 1, 4, 64, 2, false>>" in catalog.attention_kernel(
        "bfloat16", families.mma_sync.small_q_tile(128, 1, 2)).expression  # the plain kernels keep their names
    assert catalog.attention_kernel("bfloat16", s9.DEFAULT_TILES[128]).expression.endswith(", 3, false>>")
    hooked_128 = s9.DEFAULT_TILES[128].with_variants()
    assert catalog.attention_kernel("bfloat16", hooked_128).expression == hooked_name(
        catalog.attention_kernel("bfloat16", s9.DEFAULT_TILES[128]).expression)
    assert catalog.attention_kernel("bfloat16", hooked_128).source == "sm90/prefill.cu"


def test_warmup_adds_the_hooked_kernels_only_when_asked():
    plain = catalog.warmup_kernels(arch="sm_90a")
    both = catalog.warmup_kernels(arch="sm_90a", variants=True)
    attention_kernels = [v for v in plain if v.source in ("mma_sync/attention.cu", "sm90/prefill.cu")]
    assert len(both) == len(plain) + len(attention_kernels)
    assert set(both) <= set(catalog.all_kernels())


def test_no_hooked_tile_holds_more_keys_than_the_window_poison_leaves():
    """tests/test_variants_gpu.py poisons every key more than one tile of `block_n` keys before a
    window; that proves reads bounded by the window only while no hooked kernel's tile holds more."""
    import inspect

    import test_variants_gpu

    bound = inspect.signature(test_variants_gpu.nan_before_windows).parameters["block_n"].default
    hooked = [t.with_variants() for t in s9.DEFAULT_TILES.values()]
    hooked += [schedule.prefill_tile(d).with_variants() for d in families.common.HEAD_DIMS]  # mma.sync prefill
    hooked += [families.mma_sync.small_q_tile(d, w, 2).with_variants() for d in families.common.HEAD_DIMS for w in (1, 2)]
    assert max(t.block_n for t in hooked) == bound == 80
    # an fp8 cache's (tests/test_fp8_variants_gpu.py poisons with its own bound: the small-q tiles' 128)
    import test_fp8_variants_gpu

    bound8 = inspect.signature(test_fp8_variants_gpu.run_case).parameters["poison_keys"].default
    hooked8 = [t.with_variants() for d in families.common.FP8_HEAD_DIMS for t in catalog.fp8_tiles(d, arch="sm_90a")]
    assert max(t.block_n for t in hooked8) == bound8 == families.mma_sync.FP8_BLOCK_N == 128
