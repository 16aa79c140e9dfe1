"""Property tests (hypothesis) on the GPU against the float64 reference: random batches of every
serving mode, head dims, GQA groups, page sizes (powers of two and not), shuffled interleaved
page tables, tree masks and bucket padding, run eagerly and through CUDA graphs. Around every
run: ``out`` and ``lse`` sit between guard rows holding a sentinel that must come back
untouched, every live element must have been written, and the whole K/V cache (every slot no
request may read holds NaN) must keep its bits. ``CUPY_FA_GPU_PROPERTY_EXAMPLES`` sets the
examples per test (default 25)."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cases import tree_masks
from cupy_fa import ForwardMode, reference
from safety_cases import assert_matches, device_step
from test_properties_cpu import PAGE_SIZES, mode_batch

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("CUPY_FA_GPU_PROPERTY_EXAMPLES", "25"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
GUARD = 3  # rows of sentinel before and after out / lse
OUT_SENTINEL = np.uint16(0x7E5A)      # a pattern no output takes (fp16: a NaN; bf16: about 7e37)
LSE_SENTINEL = np.uint32(0x7FC0DEAD)  # a float32 NaN with a payload


def guarded(rows, heads, head_dim, dtype):
    """out and lse views of rows x ..., inside buffers with GUARD sentinel rows on each side; the
    views hold the sentinel too (an element still holding it was never written)."""
    import cupy

    from cases import np_dtype

    out_all = cupy.empty((rows + 2 * GUARD, heads, head_dim), np_dtype(dtype))
    out_all.view(cupy.uint16).fill(OUT_SENTINEL)
    lse_all = cupy.empty((rows + 2 * GUARD, heads), cupy.float32)
    lse_all.view(cupy.uint32).fill(LSE_SENTINEL)
    return out_all, lse_all, out_all[GUARD:GUARD + rows], lse_all[GUARD:GUARD + rows]


def check_guards(out_all, lse_all, rows, label):
    o = out_all.view(np.uint16).get()
    l16 = lse_all.view(np.uint32).get()
    for name, arr, sentinel in (("out", o, OUT_SENTINEL), ("lse", l16, LSE_SENTINEL)):
        for part, sl in (("before", slice(0, GUARD)), ("after", slice(GUARD + rows, None))):
            assert (arr[sl] == sentinel).all(), f"{label}: {name} guard rows {part} the view were written"
        live = arr[GUARD:GUARD + rows]
        assert not (live == sentinel).any(), f"{label}: {name} has live elements never written"


def lse_close(lse, ref_lse, label):
    got = np.asarray(reference.to_numpy(lse), np.float64)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(got), finite), f"{label}: lse finite where the reference is not (or back)"
    err = np.abs(got[finite] - ref_lse[finite]).max(initial=0.0)
    assert err < 1e-2, f"{label}: lse off by {err:.3g}"


def masks_for(mode, q_lens, seed, use_mask):
    if not (use_mask and mode is ForwardMode.TARGET_VERIFY):
        return None
    return tree_masks(np.random.default_rng(seed), [int(q) for q in q_lens])


def flat(masks):
    return None if masks is None else np.concatenate([m.ravel() for m in masks]) if masks else np.zeros(0, bool)


@SETTINGS
@given(batch=mode_batch(max_batch=8, max_prefix=3000), dtype=st.sampled_from(["bfloat16", "float16"]),
       head_dim=st.sampled_from([64, 128, 256]), group=st.sampled_from([1, 4]),
       page_size=st.sampled_from(PAGE_SIZES), use_mask=st.booleans(), causal=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_eager_step_inside_guards(batch, dtype, head_dim, group, page_size, use_mask, causal, seed):
    import cupy
    import cupy_fa

    mode, q_lens, kv_lens = batch
    rng = np.random.default_rng(seed)
    heads = (2 * group, 2)
    step = device_step(rng, dtype, heads, head_dim, page_size, q_lens, kv_lens)
    masks = masks_for(mode, q_lens, seed, use_mask)
    k0, v0 = step["cache"].k.copy(), step["cache"].v.copy()
    rows = int(q_lens.sum())
    out_all, lse_all, out, lse = guarded(rows, heads[0], head_dim, dtype)
    attn = cupy_fa.BatchAttention(*heads, head_dim, dtype)
    attn.plan(q_lens, kv_lens, step["table"], causal=causal, custom_mask=flat(masks))
    attn.run(step["q"], step["cache"], out=out, lse=lse)
    cupy.cuda.Device().synchronize()
    label = f"{mode.name} q={q_lens.tolist()} kv={kv_lens.tolist()} {dtype} D{head_dim} G{group} page {page_size}"
    check_guards(out_all, lse_all, rows, label)
    for name, was, now in (("k", k0, step["cache"].k), ("v", v0, step["cache"].v)):
        assert cupy.array_equal(was.view(cupy.uint16), now.view(cupy.uint16)), f"{label}: the cache's {name} changed"
    ref, ref_lse = reference.paged_attention(step["q_host"], step["k"], step["v"], q_lens, kv_lens, step["table"],
                                             causal=causal, custom_mask=masks, return_lse=True)
    assert_matches(out, ref, dtype, q_lens, label)
    lse_close(lse, ref_lse, label)
    assert attn.status() == 0


_RUNNERS = {}


def runner_for(dtype, head_dim, page_size, max_pages):
    import cupy_fa

    key = (dtype, head_dim, page_size)
    runner = _RUNNERS.get(key)
    if runner is None or runner.max_pages_per_request < max_pages:
        runner = _RUNNERS[key] = cupy_fa.GraphRunner(8, 2, head_dim, dtype, max_batch_size=8, max_q_len=40,
                                                     max_pages_per_request=max(max_pages, 3000 // page_size + 2),
                                                     page_size=page_size, tree_mask=True)
    return runner


@SETTINGS
@given(batch=mode_batch(max_batch=8, max_prefix=3000), dtype=st.sampled_from(["bfloat16", "float16"]),
       head_dim=st.sampled_from([64, 128]), page_size=st.sampled_from((1, 3, 16)), use_mask=st.booleans(),
       on_device=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_graph_step_inside_guards(batch, dtype, head_dim, page_size, use_mask, on_device, seed):
    """GraphRunner: the bucket pads the batch with q_len = 0 rows; rows of the static out past
    sum(q_lens) keep what they held, the cache keeps its bits, graph == eager bit for bit."""
    import cupy

    mode, q_lens, kv_lens = batch
    if mode is ForwardMode.DECODE:
        q_lens = np.minimum(q_lens, 1)
    rng = np.random.default_rng(seed)
    step = device_step(rng, dtype, (8, 2), head_dim, page_size, q_lens, kv_lens)
    masks = masks_for(mode, q_lens, seed, use_mask)
    runner = runner_for(dtype, head_dim, page_size, step["table"].shape[1])
    k0, v0 = step["cache"].k.copy(), step["cache"].v.copy()
    rows = int(q_lens.sum())
    label = f"graph {mode.name} q={q_lens.tolist()} kv={kv_lens.tolist()} {dtype} D{head_dim} page {page_size}"
    lens = (q_lens, kv_lens, step["table"])
    if on_device:
        lens = tuple(cupy.asarray(np.asarray(x, np.int32)) for x in lens)
    results = {}
    for use_graph in (True, False):
        runner.out.view(cupy.uint16).fill(OUT_SENTINEL)
        runner.lse.view(cupy.uint32).fill(LSE_SENTINEL)
        out, lse = runner.run(mode, step["q"], step["cache"], *lens, custom_mask=flat(masks), use_graph=use_graph,
                              return_lse=True)
        cupy.cuda.Device().synchronize()
        tail_out = runner.out[rows:].view(cupy.uint16)
        tail_lse = runner.lse[rows:].view(cupy.uint32)
        assert bool((tail_out == OUT_SENTINEL).all()) and bool((tail_lse == LSE_SENTINEL).all()), \
            f"{label}: rows past the live ones written (graph {use_graph})"
        assert not bool((out.view(cupy.uint16) == OUT_SENTINEL).any()), f"{label}: live elements never written"
        results[use_graph] = (out.view(cupy.uint16).get(), lse.view(cupy.uint32).get())
    assert np.array_equal(results[True][0], results[False][0]) and np.array_equal(results[True][1], results[False][1]), \
        f"{label}: graph and eager differ"
    for name, was, now in (("k", k0, step["cache"].k), ("v", v0, step["cache"].v)):
        assert cupy.array_equal(was.view(cupy.uint16), now.view(cupy.uint16)), f"{label}: the cache's {name} changed"
    ref, ref_lse = reference.paged_attention(step["q_host"], step["k"], step["v"], q_lens, kv_lens, step["table"],
                                             custom_mask=masks, return_lse=True)
    assert_matches(out, ref, dtype, q_lens, label)
    lse_close(lse, ref_lse, label)
    assert runner.attn.status() == 0
