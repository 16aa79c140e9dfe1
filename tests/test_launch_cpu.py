"""The prepared launches of a plan (cupy_fa/launch.py), no GPU: every run of a plan launches the
bytes a full fill of its structs gives for that run's arrays and cache, whichever run came before
(another cache, other pointers, sinks on and off, another token count), with the kernels and
grids of the schedule."""

import types

import numpy as np
import pytest

from cupy_fa import _build, catalog, plan, schedule
from cupy_fa.attention import BatchAttention
from cupy_fa.kv_cache import PagedKVCache

H200 = dict(smem_limit=227 * 1024, sm_count=132, arch="sm_90a")
A100 = dict(smem_limit=163 * 1024, sm_count=108, arch="sm_80")


class _Buf:
    _next = [1 << 40]  # device addresses above 4 GiB, as on a GPU

    def __init__(self, shape=(1,)):
        self.shape = shape
        self.data = types.SimpleNamespace(ptr=_Buf._next[0])
        _Buf._next[0] += 0x1000


def fields(params):
    """Every field of a params struct, by name (its padding bytes are no field)."""
    return tuple((name, params[name].item()) for name in params.dtype.names)


def record(calls, keep=lambda *call: call):
    """A stand-in for _build.launch_packed: the launch's kernel, grid, struct fields (its bytes
    as they are at the launch) and whether it is programmatic, on the stream it was given."""
    def launch_packed(launch, stream_ptr):
        calls.append(keep(launch.kernel, launch.grid, fields(launch.packed[0]), launch.programmatic))
    return launch_packed


def _cache(page_size):
    cache = types.SimpleNamespace(k=_Buf(), v=_Buf(), page_size=page_size, num_pages=1000 + page_size, is_fp8=False)
    cache.attention_params = types.MethodType(PagedKVCache.attention_params, cache)
    return cache


STEPS = [  # (q_lens, kv_lens, target, window, soft_cap)
    ([1] * 64, [4096] * 64, H200, 0, 0.0),          # decode, folding CTAs, no merge
    ([1], [131072], H200, 0, 0.0),                  # one long decode: groups folded, then the merge
    ([1, 2048, 1, 4], [4096, 4096, 700, 3000], H200, 0, 0.0),  # mixed: both families, one merge
    ([4096, 300], [4096, 2000], H200, 0, 0.0),      # prefill on the wgmma family
    ([4, 4, 4], [5000, 9000, 300], A100, 0, 0.0),   # verify on an A100
    ([1] * 8, [20000] * 8, H200, 1024, 0.0),        # a window
    ([17, 1], [4000, 4000], H200, 0, 30.0),         # a soft-cap
]


@pytest.mark.parametrize("q_lens,kv_lens,target,window,soft_cap", STEPS)
def test_every_run_launches_the_full_fill(monkeypatch, q_lens, kv_lens, target, window, soft_cap):
    attn = BatchAttention(32, 8, 128, "bfloat16")
    names = ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr",
             "num_splits", "split_keys", "status", "custom_mask", "partial_out", "partial_lse", "key_base")
    buffers = types.SimpleNamespace(**{n: _Buf() for n in names}, page_table=_Buf((len(q_lens), 300)))
    sched = schedule.schedule_step(128, 4, 8, q_lens=q_lens, kv_lens=kv_lens, window=window, **target)
    state = plan.PlanState(len(q_lens), int(np.sum(q_lens)), sched, plan.MASK_CAUSAL, 0.088, None, None, None, 300,
                           0, None, window=window, soft_cap=soft_cap)
    calls = []
    monkeypatch.setattr(_build, "launch_packed", record(calls))
    caches = [_cache(16), _cache(1), _cache(64)]
    runs = [(caches[0], None, sum(q_lens)), (caches[0], _Buf(), sum(q_lens)), (caches[1], None, sum(q_lens)),
            (caches[2], _Buf(), max(sum(q_lens) - 1, 1)), (caches[2], None, sum(q_lens)), (caches[0], None, sum(q_lens))]
    launches = [x for x in sched.launches if x.work_grid > 0]
    for i, (cache, sinks, tokens) in enumerate(runs):
        if i in (0, 1, 3):  # new arrays; the other runs keep the last run's (only what moved is written)
            q, out, lse = _Buf(), _Buf(), _Buf()
        calls.clear()
        sinks_ptr = sinks.data.ptr if sinks is not None else 0
        attn._launcher.launch(state, buffers, cache, q.data.ptr, out.data.ptr, lse.data.ptr, tokens, 7, sinks_ptr, 0)
        hooked = bool(window or soft_cap or sinks_ptr)
        want = []
        for launch in launches:
            params = attn._launcher.params(state, buffers, launch, q=q.data.ptr, out=out.data.ptr, lse=lse.data.ptr,
                                           sinks=sinks_ptr, num_tokens=tokens, **cache.attention_params())
            tile = launch.tile.with_variants() if hooked else launch.tile
            want.append((catalog.attention_kernel("bfloat16", tile), (launch.ctas,), fields(params), False))
        if sched.needs_merge:
            shape, grid = schedule.merge_grid(tokens, 32)
            merge = attn._launcher.merge_params(state, buffers, out=out.data.ptr, lse=lse.data.ptr, sinks=sinks_ptr)
            want.append((catalog.merge_kernel("bfloat16", 128, shape), tuple(grid), fields(merge), True))
        assert calls == want
    assert len(calls) == len(launches) + int(sched.needs_merge) >= 1


def test_a_new_plan_packs_anew(monkeypatch):
    """The packed structs belong to one plan and its buffers: a later plan (or grown buffers) packs its own."""
    attn = BatchAttention(32, 8, 128, "bfloat16")
    calls = []
    monkeypatch.setattr(_build, "launch_packed", record(calls, lambda kernel, grid, params, programmatic: params))
    names = ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr",
             "num_splits", "split_keys", "status", "custom_mask", "partial_out", "partial_lse", "key_base")
    one, two = (types.SimpleNamespace(**{n: _Buf() for n in names}, page_table=_Buf((1, 300))) for _ in range(2))
    sched = schedule.schedule_step(128, 4, 8, q_lens=[1], kv_lens=[4096], **H200)
    state = plan.PlanState(1, 1, sched, plan.MASK_CAUSAL, 0.088, None, None, None, 300, 0, None)
    cache, q, out = _cache(16), _Buf(), _Buf()
    attn._launcher.launch(state, one, cache, q.data.ptr, out.data.ptr, 0, 1, 7, 0, 0)
    attn._launcher.launch(state, two, cache, q.data.ptr, out.data.ptr, 0, 1, 7, 0, 0)
    assert calls[0] != calls[1] and state.prepared.buffers is two


def test_a_plan_of_the_same_shape_shares_the_prepared_step(monkeypatch):
    """A prepared step matches a later plan on the same buffers and device whose schedule, batch,
    mask, scale, page-table columns and stride, mask entries and variants are all the same (what
    BatchAttention.plan_staged reuses), and no other."""
    import dataclasses

    attn = BatchAttention(32, 8, 128, "bfloat16")
    monkeypatch.setattr(_build, "launch_packed", lambda launch, stream_ptr: None)
    names = ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr",
             "num_splits", "split_keys", "status", "custom_mask", "partial_out", "partial_lse", "key_base")
    buffers = types.SimpleNamespace(**{n: _Buf() for n in names}, page_table=_Buf((64, 300)))
    sched = schedule.schedule_step(128, 4, 8, q_lens=[1] * 64, kv_lens=[4096] * 64, **H200)
    state = plan.PlanState(64, 64, sched, plan.MASK_CAUSAL, 0.088, None, None, None, 256, 0, None,
                           page_table_stride=256)
    attn._launcher.launch(state, buffers, _cache(16), 1 << 41, 1 << 42, 0, 64, 7, 0, 0)
    prepared = state.prepared
    same = dataclasses.replace(state, prepared=None, stream_ptr=9, checked_geometry=set())
    assert prepared.matches(same, buffers, 0)
    again = schedule.schedule_step(128, 4, 8, q_lens=[1] * 64, kv_lens=[4001] * 64, **H200)  # an equal schedule
    assert prepared.matches(dataclasses.replace(same, schedule=again), buffers, 0)
    for change in (dict(sm_scale=0.1), dict(batch_size=63), dict(page_table_columns=255), dict(page_table_stride=300),
                   dict(mask_mode=plan.MASK_NONE), dict(window=64), dict(soft_cap=30.0), dict(mask_entries=4),
                   dict(schedule=schedule.schedule_step(128, 4, 8, q_lens=[1] * 64, kv_lens=[40960] * 64, **H200))):
        assert not prepared.matches(dataclasses.replace(same, **change), buffers, 0), change
    assert not prepared.matches(same, types.SimpleNamespace(**vars(buffers)), 0)
    assert not prepared.matches(same, buffers, 1)


def test_an_fp8_plan_prepares_its_hooked_kernels_too(monkeypatch):
    """An fp8 cache's tiles have builds with the variant hooks: its prepared step holds the plain and
    the hooked launch of each tile, runs the plain ones without a variant and the hooked ones with
    sinks."""
    attn = BatchAttention(32, 8, 128, "bfloat16", kv_dtype="float8_e4m3fn")
    calls = []
    monkeypatch.setattr(_build, "launch_packed", record(calls, lambda kernel, grid, params, programmatic: kernel))
    names = ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr",
             "num_splits", "split_keys", "status", "custom_mask", "partial_out", "partial_lse", "key_base")
    buffers = types.SimpleNamespace(**{n: _Buf() for n in names}, page_table=_Buf((8, 300)))
    sched = schedule.schedule_step(128, 4, 8, q_lens=[1] * 4 + [300] * 4, kv_lens=[8192] * 8, kv_bytes=1, **H200)
    state = plan.PlanState(8, 1204, sched, plan.MASK_CAUSAL, 0.088, None, None, None, 300, 0, None)
    cache = _cache(16)
    cache.is_fp8 = False  # (its scale fields read as 0 here: only the launches are checked)
    attn._launcher.launch(state, buffers, cache, 1 << 41, 1 << 42, 0, 1204, 7, 0, 0)
    launches = [x for x in sched.launches if x.work_grid > 0]
    assert len(launches) == 2  # the wgmma family's fp8 tile and the mma.sync small-q one
    hooked = [catalog.attention_kernel(attn._types, x.tile.with_variants()) for x in launches]
    assert [h.kernel for _, h, _ in state.prepared.attention] == hooked
    assert calls[:2] == [catalog.attention_kernel(attn._types, x.tile) for x in launches]  # (then the merge)
    calls.clear()
    attn._launcher.launch(state, buffers, cache, 1 << 41, 1 << 42, 0, 1204, 7, 1 << 44, 0)  # with sinks
    assert calls[:2] == hooked


@pytest.mark.parametrize("q_lens,kv_lens", [([1] * 64, [4096] * 64), ([4096, 1], [4096, 3000]), ([4, 4], [900, 5000])])
def test_an_fp8_cache_packs_and_launches_its_plain_kernels(monkeypatch, q_lens, kv_lens):
    """An fp8 cache's plan without a variant packs and launches its plain kernels (the wgmma family's
    fp8 tile for its long requests on sm_90a, the mma.sync fp8 tiles for the others)."""
    attn = BatchAttention(32, 8, 128, "bfloat16", kv_dtype="float8_e4m3fn")
    names = ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr",
             "num_splits", "split_keys", "status", "custom_mask", "partial_out", "partial_lse", "key_base")
    buffers = types.SimpleNamespace(**{n: _Buf() for n in names}, page_table=_Buf((len(q_lens), 300)))
    sched = schedule.schedule_step(128, 4, 8, q_lens=q_lens, kv_lens=kv_lens, kv_bytes=1, **H200)
    state = plan.PlanState(len(q_lens), int(np.sum(q_lens)), sched, plan.MASK_CAUSAL, 0.088, None, None, None, 300, 0,
                           None)
    calls = []
    monkeypatch.setattr(_build, "launch_packed", record(calls, lambda kernel, grid, params, programmatic: kernel))
    cache = _cache(16)
    cache.is_fp8, cache.k_scale_device, cache.v_scale_device = True, _Buf(), _Buf()
    attn._launcher.launch(state, buffers, cache, 1 << 41, 1 << 42, 1 << 43, int(np.sum(q_lens)), 7, 0, 0)
    types_ = attn._types
    launches = [x for x in sched.launches if x.work_grid > 0]
    assert calls[:len(launches)] == [catalog.attention_kernel(types_, x.tile) for x in launches]
    assert all(x.tile.kv_bytes == 1 for x in launches)
