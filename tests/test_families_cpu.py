"""The two-family dispatch of a step (CPU): which family, tile and splits each class of requests
gets on each target (schedule_step), plan_kernel's two work lists (the NumPy model of
tests/test_plan.py) replayed CTA by CTA over both launches' grids, eager and graph-sized, and the
variant lists that warm-up and CI compile."""

import dataclasses

import numpy as np
import pytest

from cupy_fa import _build, knobs, plan, schedule

from cupy_fa import _compile
from cupy_fa.families import sm90 as s9
from cupy_fa.kv_cache import PagedKVCache
from cupy_fa import families
from cupy_fa import catalog
from test_plan import model

H200 = dict(smem_limit=families.common.SMEM_LIMIT, sm_count=132, arch="sm_90a")
A100 = dict(smem_limit=families.common.SM80_SMEM_LIMIT, sm_count=108, arch="sm_80")
L40 = dict(smem_limit=99 * 1024, sm_count=142, arch="sm_89")


def test_long_requests_take_the_wgmma_family_on_sm90a_only():
    """Every head dim's long requests take the wgmma family on sm_90a, the mma.sync prefill tile
    on any other target."""
    q, kv = [4096, 1024], [4096, 16384]
    for head_dim in families.common.HEAD_DIMS:
        long = schedule.schedule_step(head_dim, 4, 8, q_lens=q, kv_lens=kv, **H200).long
        assert families.family_of(long.tile) is families.SM90_WGMMA
        # 3 consumer warpgroups at D 64 / 96 / 128, 2 at 192 / 256
        rows = {64: 192, 96: 192, 128: 192, 192: 128, 256: 128}[head_dim]
        assert long.tile == s9.DEFAULT_TILES[head_dim] and long.tile.block_m == rows
        assert long.work_grid == schedule.work_bound(q, kv, 4, long.tile) == sum(-(-n * 4 // rows) for n in q)
        for target in (A100, dict(H200, arch="sm_90"), dict(H200, arch=None)):  # sm_80, a plain sm_90 build, none
            long = schedule.schedule_step(head_dim, 4, 8, q_lens=q, kv_lens=kv, **target).long
            assert families.family_of(long.tile) is families.mma_sync.MMA_SYNC
            assert (long.tile.warps_m, long.tile.warps_n) == (4, 1)
    long = schedule.schedule_step(128, 4, 8, q_lens=q, kv_lens=kv, **L40).long
    assert long.tile == families.mma_sync.MmaTile(128, 4, 1)
    # a device too small for the wgmma tile falls back to mma.sync (its shared memory decides)
    assert schedule.prefill_tile(256, s9.DEFAULT_TILES[256].smem_bytes - 1, "sm_90a") == families.mma_sync.MmaTile(256, 4, 1)


def test_cupy_fa_arch_sm80_selects_mma_sync(monkeypatch):
    """CUPY_FA_ARCH=sm_80 on a Hopper: the target BatchAttention plans for (_build.current_arch, read
    from the knob without touching a device) takes the mma.sync prefill tile."""
    monkeypatch.setenv("CUPY_FA_ARCH", "sm_80")
    knobs.reload()
    assert _build.current_arch() == "sm_80"
    step = schedule.schedule_step(128, 4, 8, q_lens=[1, 300], kv_lens=[4096, 300],
                                  **dict(H200, arch=_build.current_arch()))
    assert step.long.tile.family is families.mma_sync.MMA_SYNC and step.long.tile.block_m == 64
    monkeypatch.setenv("CUPY_FA_ARCH", "sm_90a")
    knobs.reload()
    step = schedule.schedule_step(128, 4, 8, q_lens=[1, 300], kv_lens=[4096, 300],
                                  **dict(H200, arch=_build.current_arch()))
    assert families.family_of(step.long.tile) is families.SM90_WGMMA


@pytest.mark.parametrize("target", [H200, A100], ids=["sm_90a", "sm_80"])
def test_a_mixed_step_has_a_launch_per_class(target):
    """One 2048-token chunk and 63 decodes at L = 4096: the decodes on the small-q tile (one row
    of warps, fixed 512-key splits), the chunk on the prefill family in one split, so the decodes
    fold their whole rows as alone (the same bits) and the step needs no merge; the plan lays out
    two lists. A chunk that splits keeps the decodes unfolded (one merge reads one layout)."""
    q = np.array([1] * 31 + [2048] + [1] * 32)
    kv = np.full(64, 4096)
    step = schedule.schedule_step(128, 4, 8, q_lens=q, kv_lens=kv, **target)
    small, long = step.small, step.long
    assert families.is_small_q_tile(small.tile) and small.tile.warps_m == 1
    assert small.tile.fold_splits and small.tile.splits_per_cta == 8  # 8 splits of 512 keys: one whole row a CTA
    assert small.work_grid == 63 and small.ctas == 63 * 8  # x 8 KV heads
    assert long.tile == schedule.prefill_tile(128, target["smem_limit"], target["arch"])
    assert long.work_grid == -(-2048 * 4 // long.tile.block_m)  # q 2048 > SPLIT_ROW_BUDGET: one split
    assert not step.needs_merge and step.launches == (long, small) and step.tile is small.tile
    assert (small.max_splits, long.max_splits) == (8, 1)  # 4096 / 512 fixed splits; q 2048: SPLIT_ROW_BUDGET
    tile, long_tile = step.plan_tiles()
    constants = schedule.plan_constants(tile, long_tile)
    assert constants["long_q_len"] == schedule.SMALL_Q_LEN + 1
    assert (constants["block_m"], constants["block_n"]) == (small.tile.block_m, small.tile.block_n)
    assert (constants["long_block_m"], constants["long_block_n"]) == (long.tile.block_m, long.tile.block_n)
    assert (constants["splits_per_cta"], constants["fold_splits"]) == (8, 1)
    assert step.partial_rows == 63 * 8  # what the splits want, fold or not (the overflow rule's count)
    # the same decodes alone fold the same way: the bits are the same (docs/design.md)
    alone = schedule.schedule_step(128, 4, 8, q_lens=np.ones(63, int), kv_lens=np.full(63, 4096), **target)
    assert alone.long is None and alone.small.tile == small.tile
    layout = lambda t: (t.head_dim, t.warps_m, t.warps_n, t.block_n)  # the key layout the bits depend on
    assert layout(alone.small.tile) == layout(small.tile)
    assert schedule.plan_constants(*alone.plan_tiles())["long_q_len"] == 2**31 - 1  # one list, as before
    # a chunk of 32 tokens over 4096 keys splits (32 x 4 splits <= SPLIT_ROW_BUDGET): merged, so no fold beside it
    q[31] = 32
    split = schedule.schedule_step(128, 4, 8, q_lens=q, kv_lens=kv, **target)
    assert split.long.max_splits == 4 and split.needs_merge
    assert not split.small.tile.fold_splits and split.small.work_grid == 63 * 8


def test_small_q_steps_plan_as_before():
    """A step without a request of more than 16 tokens (host lengths, or device bounds up to 16)
    has no long launch and plans one work list: what every decode-like step ran before."""
    for q in (np.ones(64, int), np.full(64, 8), np.array([1, 16, 0, 3])):
        step = schedule.schedule_step(128, 4, 8, q_lens=q, kv_lens=np.full(len(q), 4096), **H200)
        assert step.long is None and step.plan_tiles()[1] is None
        tile = schedule.fold_tile(schedule.tile_for(128, int(q.max()), 4, arch="sm_90a"), q, np.full(len(q), 4096),
                                  4, 8, 132)
        assert step.small.tile == tile
        assert step.small.work_grid == schedule.work_bound(q, np.full(len(q), 4096), 4, tile)
    cap = plan.Capacity(64, 64 * 16, 512)
    step = schedule.schedule_step(128, 4, 8, max_q_len=16, max_kv_len=8192, capacity=cap, batch_size=64, **H200)
    assert step.long is None
    step = schedule.schedule_step(128, 4, 8, max_q_len=17, max_kv_len=8192, capacity=cap, batch_size=64, **H200)
    assert step.long is not None and not step.small.tile.fold_splits  # either class may come: no fold
    empty = schedule.schedule_step(128, 4, 8, q_lens=[0, 0], kv_lens=[5, 0], **H200)
    assert empty.long is None and empty.small.work_grid == 0


def test_plan_constants_refuse_a_long_tile_that_splits_per_cta():
    with pytest.raises(ValueError, match="one split per CTA"):
        schedule.plan_constants(schedule.tile_for(128, 1, 4), families.mma_sync.MmaTile(128, 1, 4, splits_per_cta=2))
    one = schedule.plan_constants(s9.DEFAULT_TILES[128])  # the standalone launcher: one list, its tile
    assert (one["block_m"], one["long_q_len"]) == (s9.DEFAULT_TILES[128].block_m, 2**31 - 1) == (192, 2**31 - 1)


# ---- both launches replayed over the model of plan_kernel --------------------------------------


def replay(m, q, kv, group, h_kv, step, reverse_long):
    """Every (request, KV head, row block, split) each launch's CTAs run, from the model's lists,
    as kernels/mma_sync/work.cuh (small-q: runs of splits_per_cta) and kernels/sm90/work.cuh (long:
    one split per CTA, items last to first) find them; CTAs past the work exit."""
    runs = []
    for launch, name in ((step.small, "work_indptr"), (step.long, "long_work_indptr")):
        if launch is None:
            continue
        indptr, tile = m[name], launch.tile
        total = int(indptr[-1])
        assert launch.ctas >= total * h_kv or getattr(tile, "persistent", False), (name, launch, total)
        for cta in range(launch.ctas):
            work, head = cta // h_kv, cta % h_kv
            if name == "long_work_indptr" and reverse_long:
                work = total - 1 - work
            if not 0 <= work < total:
                continue
            b = int(np.searchsorted(indptr, work, side="right") - 1)
            assert indptr[b] <= work < indptr[b + 1]
            local, splits = work - indptr[b], int(m["num_splits"][b])
            per_cta = tile.splits_per_cta
            groups = -(-splits // per_cta)
            first = (local % groups) * per_cta
            for s in range(first, min(first + per_cta, splits)):
                runs.append((b, head, (local // groups) * tile.block_m, s, name))
    return runs


def check_coverage(q, kv, group, h_kv, step, reverse_long):
    tile, long_tile = step.plan_tiles()
    m = model(q, kv, group, tile, 10**9, long_tile)
    runs = replay(m, q, kv, group, h_kv, step, reverse_long)
    assert len(runs) == len(set(runs)), "a (request, head, row block, split) ran twice"
    want = set()
    for b in range(len(q)):
        if q[b] == 0:
            continue
        name = "long_work_indptr" if q[b] > schedule.SMALL_Q_LEN else "work_indptr"
        block_m = (step.long if name == "long_work_indptr" else step.small).tile.block_m
        want |= {(b, h, r, s, name) for h in range(h_kv) for r in range(0, q[b] * group, block_m)
                 for s in range(int(m["num_splits"][b]))}
    assert set(runs) == want
    return m


@pytest.mark.parametrize("target", [H200, A100], ids=["sm_90a", "sm_80"])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (256, 8)])
def test_both_launches_run_every_request_once_on_its_family(target, head_dim, group):
    """Random steps of decode, verify, prefill, extend and padding rows, host lengths and device
    bounds: each live request's rows x KV heads x splits are run exactly once, by the launch of
    its own class, inside that launch's grid; a long request's work is never in the small-q list."""
    rng = np.random.default_rng()
    h_kv = 2
    for trial in range(60):
        batch = int(rng.integers(1, 12))
        kinds = rng.choice(["decode", "verify", "prefill", "extend", "pad"], size=batch)
        q = np.array([{"decode": 1, "verify": int(rng.integers(2, 17)), "prefill": int(rng.integers(17, 700)),
                       "extend": int(rng.integers(17, 300)), "pad": 0}[k] for k in kinds])
        kv = q + np.where(kinds == "prefill", 0, rng.integers(0, 9000, size=batch))
        step = schedule.schedule_step(head_dim, group, h_kv, q_lens=q, kv_lens=kv, **target)
        m = check_coverage(q, kv, group, h_kv, step, reverse_long=target is H200)
        assert (np.diff(m["work_indptr"])[q > schedule.SMALL_Q_LEN] == 0).all()
        assert (np.diff(m["long_work_indptr"])[q <= schedule.SMALL_Q_LEN] == 0).all()
        # graph-sized: the same step planned from bounds only (max_q_len, max_kv_len, capacity)
        max_q = int(max(q.max(), 1)) + int(rng.integers(0, 50))
        cap = plan.Capacity(batch + int(rng.integers(0, 4)), int(q.sum()) + int(rng.integers(0, 100)), 1)
        bounded = schedule.schedule_step(head_dim, group, h_kv, max_q_len=max_q, max_kv_len=int(kv.max()),
                                         capacity=cap, batch_size=batch, **target)
        assert (bounded.long is None) == (max_q <= schedule.SMALL_Q_LEN)
        check_coverage(q, kv, group, h_kv, bounded, reverse_long=target is H200)


def test_capacity_bound_of_the_long_list_covers_its_work():
    rng = np.random.default_rng()
    long_tile = s9.DEFAULT_TILES[128]
    small_tile = schedule.tile_for(128, 16, 4)
    for _ in range(300):
        max_q = int(rng.choice([17, 64, 300, 4096]))
        b = int(rng.integers(1, 65))
        q = rng.integers(0, max_q + 1, size=b)
        kv = q + rng.integers(0, 40000, size=b) * (rng.random(b) < 0.7)
        m = model(q, kv, 4, small_tile, 10**9, long_tile)
        cap = plan.Capacity(b, int(q.sum()) + 1, 1)
        for kv_bound in (int(kv.max()), 2**31 - 1):
            assert schedule.capacity_work_bound(cap, 4, long_tile, max_q, kv_bound,
                                                min_q_len=schedule.SMALL_Q_LEN + 1) >= m["long_work_indptr"][-1]
            assert schedule.capacity_work_bound(cap, 4, small_tile, schedule.SMALL_Q_LEN, kv_bound) \
                >= m["work_indptr"][-1]
    assert schedule.capacity_work_bound(plan.Capacity(8, 128, 1), 4, long_tile, 16, 4096, min_q_len=17) == 0


def test_launch_grid_of_a_persistent_tile():
    """A tile with a persistent grid (a trait the wgmma family may carry) gets at most one CTA per SM."""
    @dataclasses.dataclass(frozen=True)
    class Persistent:
        persistent: bool = True

    assert schedule.launch_grid(Persistent(), 1000, 8, 132) == 132
    assert schedule.launch_grid(Persistent(), 10, 8, 132) == 80
    assert schedule.launch_grid(s9.DEFAULT_TILES[128], 1000, 8, 132) == 8000


# ---- variants ------------------------------------------------------------------------------------


def test_variant_lists_hold_the_wgmma_family_where_the_target_is_sm90a():
    everything = set(catalog.all_kernels())
    sm80 = set(catalog.all_kernels("sm_80"))
    wgmma = {catalog.attention_kernel(dt, t) for dt in _compile.CTYPES for t in s9.DEFAULT_TILES.values()}
    hooked = {catalog.attention_kernel(dt, t.with_variants())  # with the variant hooks
              for dt in _compile.CTYPES for t in s9.DEFAULT_TILES.values()}
    # the fp8 tiles with a producer warpgroup (setmaxnreg): sm_90a only as well
    ring = {catalog.attention_kernel(families.common.ElementTypes(dt, families.common.FP8, dt), t) for dt in _compile.CTYPES
            for d in families.common.FP8_HEAD_DIMS for t in catalog.fp8_tiles(d, arch="sm_90a")
            if getattr(t, "producer_warps", 0)}
    # the wgmma family's fp8 tiles, plain and hooked: sm_90a only too
    fp8 = {catalog.attention_kernel(families.common.ElementTypes(dt, families.common.FP8, dt), t) for dt in _compile.CTYPES
           for tile in s9.FP8_TILES.values() for t in (tile, tile.with_variants())}
    mla_wgmma = {families.mla.kernel(dt, families.mla.MlaWgmmaTile(fp8)) for dt in _compile.CTYPES
                 for fp8 in (False, True)}  # cupy_fa.mla
    # separate qk / vo head dims: the wgmma family's tile of each pair, plain and hooked
    pairs = {catalog.attention_kernel(dt, t) for dt in _compile.CTYPES for tile in s9.PAIR_TILES.values()
             for t in (tile, tile.with_variants())}
    assert ring and not ring & sm80 and fp8 and not fp8 & sm80 and mla_wgmma and not mla_wgmma & sm80
    assert pairs and not pairs & sm80
    assert (wgmma | hooked | ring | fp8 | mla_wgmma | pairs) <= everything and not (wgmma | hooked) & sm80
    assert everything - sm80 == wgmma | hooked | ring | fp8 | mla_wgmma | pairs
    # what a Hopper warms: every head dim's wgmma tile, plain and hooked
    hopper = set(catalog.warmup_kernels(smem_limit=families.common.SMEM_LIMIT, arch="sm_90a", variants=True))
    assert wgmma | hooked <= hopper <= everything
    assert set(catalog.all_kernels("sm_90a")) == everything
    ampere = catalog.warmup_kernels(smem_limit=families.common.SM80_SMEM_LIMIT, arch="sm_80", variants=True)
    assert set(ampere) <= sm80
    mma_prefill = {catalog.attention_kernel(dt, families.mma_sync.MmaTile(d, 4, 1)) for dt in _compile.CTYPES
                   for d in families.common.HEAD_DIMS}
    assert set(s9.DEFAULT_TILES) == set(families.common.HEAD_DIMS)  # every head dim has a wgmma tile
    assert mma_prefill <= set(ampere) and not mma_prefill & hopper  # Hopper never selects it
    # an fp8 cache: its wgmma tiles, plain and hooked, on a Hopper
    hopper_fp8 = set(catalog.warmup_kernels(smem_limit=families.common.SMEM_LIMIT, arch="sm_90a",
                                            kv_dtypes=(families.common.FP8,), variants=True))
    assert fp8 <= hopper_fp8 <= everything
    variant = catalog.attention_kernel("bfloat16", s9.DEFAULT_TILES[128])
    assert variant == catalog.attention_kernel("bfloat16", s9.DEFAULT_TILES[128]) and variant.source == "sm90/prefill.cu"
    with pytest.raises(ValueError, match="one element type"):
        catalog.attention_kernel(families.common.ElementTypes("bfloat16", "float16", "bfloat16"), s9.DEFAULT_TILES[128])


def test_compile_check_lists_for_its_arch(monkeypatch):
    from cupy_fa import compile_check

    seen = []
    figures = {"registers": 168, "spill_stores": 0, "spill_loads": 0, "stack": 0}
    monkeypatch.setattr(_compile, "compile_cubin", lambda v, arch: (seen.append((v, arch)), (b"", figures))[1])
    rows = compile_check.compile_all("sm_80", only="prefill_sm90_kernel", jobs=1)
    assert rows == [] and seen == []  # no wgmma variant in an sm_80 build
    rows = compile_check.compile_all("sm_90a", only="prefill_sm90_kernel", jobs=1)
    # each dtype, plain and hooked, over a 16-bit cache and (D 64 / 128 / 256) an fp8 one, and each
    # pair of separate qk / vo head dims
    tiles = len(s9.DEFAULT_TILES) + len(s9.FP8_TILES) + len(s9.PAIR_TILES)
    assert len(rows) == 2 * 2 * tiles and {a for _, a in seen} == {"sm_90a"}


# ---- what BatchAttention launches for a step (no GPU: the launches recorded) ---------------------


class _Buf:
    """A stand-in device buffer: a distinct pointer, and a shape."""
    _next = [1 << 40]  # device addresses above 4 GiB, as on a GPU

    def __init__(self, shape=(1,)):
        self.shape = shape
        self.data = type("Ptr", (), {"ptr": _Buf._next[0]})()
        _Buf._next[0] += 0x1000


def recorded_launches(monkeypatch, head_dim, h_q, h_kv, q_lens, kv_lens, target, window=0, soft_cap=0.0,
                      sinks=None):
    """The (kernel, grid, params, programmatic) of each launch BatchAttention.run makes for a
    step planned with `target`'s schedule (the plan kernel itself not run); with a ``window``, a
    ``soft_cap`` or a ``sinks`` buffer (tests/test_variants_cpu.py)."""
    import types

    from cupy_fa import attention

    attn = attention.BatchAttention(h_q, h_kv, head_dim, "bfloat16")
    names = ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr",
             "num_splits", "split_keys", "status", "custom_mask", "partial_out", "partial_lse", "key_base")
    attn._buffers = types.SimpleNamespace(**{n: _Buf() for n in names}, page_table=_Buf((len(q_lens), 300)))
    sched = schedule.schedule_step(head_dim, h_q // h_kv, h_kv, q_lens=q_lens, kv_lens=kv_lens, window=window,
                                   **target)
    state = plan.PlanState(len(q_lens), int(np.sum(q_lens)), sched, plan.MASK_CAUSAL, 0.088, None, None, None,
                           300, 0, None, window=window, soft_cap=soft_cap)
    calls = []
    monkeypatch.setattr(_build, "launch_packed", lambda launch, stream_ptr: calls.append(
        (launch.kernel, launch.grid, launch.packed[0].copy(), launch.programmatic)))
    cache = types.SimpleNamespace(k=_Buf(), v=_Buf(), page_size=16, num_pages=1000, is_fp8=False)
    cache.attention_params = types.MethodType(PagedKVCache.attention_params, cache)  # the cache's kernel parameters
    attn._launcher.launch(state, attn._buffers, cache, _Buf().data.ptr, _Buf().data.ptr, _Buf().data.ptr,
                          int(np.sum(q_lens)), 7, sinks.data.ptr if sinks is not None else 0, 0)
    return attn, sched, calls


@pytest.mark.parametrize("target", [H200, A100], ids=["sm_90a", "sm_80"])
def test_a_mixed_step_launches_both_families_then_one_merge(monkeypatch, target):
    q, kv = [1, 2048, 1, 4], [4096, 4096, 700, 3000]
    attn, sched, calls = recorded_launches(monkeypatch, 128, 32, 8, q, kv, target)
    bufs = attn._buffers
    (long_v, long_grid, long_p, long_pdl), (small_v, small_grid, small_p, small_pdl), merge = calls
    assert long_v == catalog.attention_kernel("bfloat16", sched.long.tile)
    assert long_grid == (sched.long.ctas,) and long_p["work_indptr"] == bufs.long_work_indptr.data.ptr
    assert (long_p["splits_per_cta"], long_p["fold_splits"]) == (1, 0) and not long_pdl
    assert small_v == catalog.attention_kernel("bfloat16", sched.small.tile) and small_v.source == "mma_sync/attention.cu"
    assert small_grid == (sched.small.ctas,) and small_p["work_indptr"] == bufs.work_indptr.data.ptr and not small_pdl
    assert small_p["fold_splits"] == 0
    merge_v, _, merge_p, merge_pdl = merge
    assert merge_v.source == "shared/merge.cu" and merge_pdl and merge_p["fold_groups"] == 0
    # everything but the work list and the split run is the same in both launches
    same = [f for f in long_p.dtype.names if f not in ("work_indptr", "splits_per_cta", "fold_splits")]
    assert all(long_p[f] == small_p[f] for f in same)


def test_a_decode_step_launches_as_before(monkeypatch):
    """B = 64 decode on an H200: one attention launch of the folding small-q tile (whole rows), no
    merge; the work list is work_indptr."""
    attn, sched, calls = recorded_launches(monkeypatch, 128, 32, 8, [1] * 64, [4096] * 64, H200)
    assert sched.long is None and len(calls) == 1
    variant, grid, params, pdl = calls[0]
    assert variant.source == "mma_sync/attention.cu" and grid == (64 * 8,) and not pdl
    assert params["work_indptr"] == attn._buffers.work_indptr.data.ptr
    assert (params["splits_per_cta"], params["fold_splits"]) == (8, 1)
    # a long one: groups folded in the CTAs, their states merged (fold_groups)
    attn, sched, calls = recorded_launches(monkeypatch, 128, 32, 8, [1], [131072], H200)
    assert [c[0].source for c in calls] == ["mma_sync/attention.cu", "shared/merge.cu"] and calls[1][2]["fold_groups"] == 1


def test_a_prefill_step_launches_the_wgmma_family_alone(monkeypatch):
    attn, sched, calls = recorded_launches(monkeypatch, 128, 32, 8, [4096, 300], [4096, 2000], H200)
    assert sched.small is None
    assert [c[0].source for c in calls] == ["sm90/prefill.cu"]  # q 4096, 300: one split each, no merge
    rows = sched.long.tile.block_m  # 192 at D 128: 3 consumer warpgroups
    assert rows == 192 and calls[0][1] == (sched.long.ctas,) == ((-(-4096 * 4 // rows) - (-300 * 4 // rows)) * 8,)
