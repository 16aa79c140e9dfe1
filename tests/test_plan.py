"""Metadata logic: an independent NumPy model of kernels/shared/plan.cu, the host
bounds that size the grids against it (CPU), and the device kernel against it (GPU)."""

import dataclasses

import numpy as np
import pytest

from cases import new_rng
from cupy_fa import knobs, plan, schedule
from cupy_fa import families


def model(q_lens, kv_lens, group, tile, partial_capacity=10**9, long_tile=None, window=0):
    """What plan_kernel must write, computed the slow obvious way from the policy's split rule
    (``schedule.max_splits``, ``schedule.key_base``). With ``long_tile`` (a step of
    two families) requests of more than SMALL_Q_LEN tokens are laid out for it in
    long_work_indptr (one split per CTA, never folded), the others for ``tile`` in work_indptr;
    without it every request for ``tile`` in work_indptr. With a sliding ``window`` a request's
    splits cut its keys from key_base on: its first query's first key (kv - q - window + 1)
    rounded down to whole groups of MERGE_GROUP splits."""
    S = schedule.split_size()
    # the policy's rules, written once in cupy_fa.schedule: where a window's splits start, and how
    # many splits a request wants (plan_kernel applies them, lowering the count only on overflow)
    bases = [int(schedule.key_base([q], [kv], window)[0]) if q > 0 else 0 for q, kv in zip(q_lens, kv_lens)]
    kv_lens = [kv - base for kv, base in zip(kv_lens, bases)]  # the keys the splits cut

    def is_long(q):
        return long_tile is not None and q > schedule.SMALL_Q_LEN

    def split_of(q, kv, cap):
        block_n = (long_tile if is_long(q) else tile).block_n
        keys = max(S, -(-(-(-kv // cap)) // block_n) * block_n)
        return -(-kv // keys), keys

    def wanted(q, kv):
        return int(schedule.max_splits([q], [kv])[0])

    live = [(q > 0) for q in q_lens]
    want_rows = 0
    for q, kv, ok in zip(q_lens, kv_lens, live):
        if ok:
            splits, _ = split_of(q, kv, wanted(q, kv))
            want_rows += q * splits if splits > 1 else 0
    share = max(partial_capacity // len(q_lens), 1) if want_rows > partial_capacity else None

    out = {k: [0] for k in ("q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr")}
    splits_all, keys_all = [], []
    for q, kv in zip(q_lens, kv_lens):
        splits = keys = work = long_work = partial = 0
        if q > 0:
            cap = wanted(q, kv)
            if share is not None:
                cap = min(cap, max(1, share // q))
            splits, keys = split_of(q, kv, cap)
            assert splits <= cap
            if is_long(q):
                long_work = -(-(q * group) // long_tile.block_m) * splits
            else:
                work = -(-(q * group) // tile.block_m) * -(-splits // tile.splits_per_cta)  # CTAs run split groups
            partial = q * splits if splits > 1 else 0
            if tile.fold_splits and not is_long(q):  # CTAs fold their groups: two rows per group state, if several
                groups = -(-splits // tile.splits_per_cta)
                assert 2 * q * groups <= max(partial, 2 * q)  # never more than the overflow test counted
                partial = 2 * q * groups if groups > 1 else 0
            assert (splits - 1) * keys < kv <= splits * keys  # every split non-empty, all keys covered
            if q <= schedule.SMALL_Q_LEN and share is None and -(-kv // S) <= schedule.MAX_SPLITS:
                assert keys == S  # fixed split positions: the batch-invariant regime
        out["q_indptr"].append(out["q_indptr"][-1] + q)
        out["work_indptr"].append(out["work_indptr"][-1] + work)
        out["long_work_indptr"].append(out["long_work_indptr"][-1] + long_work)
        out["partial_indptr"].append(out["partial_indptr"][-1] + partial)
        out["mask_indptr"].append(out["mask_indptr"][-1] + q * q)
        splits_all.append(splits)
        keys_all.append(keys)
    out["num_splits"], out["split_keys"] = splits_all, keys_all
    out["key_base"] = bases
    assert out["partial_indptr"][-1] <= partial_capacity
    result = {k: np.array(v) for k, v in out.items()}
    result["overflow"] = share is not None
    result["want_rows"] = want_rows
    return result


def random_batch(rng, max_q):
    b = int(rng.integers(1, 65))
    q = rng.integers(0, max_q + 1, size=b)
    kv = q + rng.integers(0, 40000, size=b) * (rng.random(b) < 0.7)
    return q, kv


@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (256, 8)])
def test_host_bounds_cover_the_schedule(head_dim, group):
    rng, _ = new_rng()
    for _ in range(200):
        max_q = int(rng.choice([1, 4, 8, 16, 17, 300, 3000]))
        q, kv = random_batch(rng, max_q)
        tile = schedule.tile_for(head_dim, max(1, q.max()), group)
        tile = dataclasses.replace(tile, splits_per_cta=int(rng.integers(1, 5)) if tile.epilogue_in_stage else 1)
        if tile.folding() is not None and rng.random() < 0.5:
            tile = tile.folding(int(rng.integers(1, schedule.WHOLE_ROW_GROUPS + 1)))
        capacity = int(rng.choice([schedule.partial_rows(len(q), 32, head_dim), len(q) * schedule.SPLIT_ROW_BUDGET, 7]))
        m = model(q, kv, group, tile, capacity)
        assert schedule.work_bound(q, kv, group, tile) >= m["work_indptr"][-1]
        cap = plan.Capacity(len(q), int(q.sum()) + 1, 1)
        assert schedule.capacity_work_bound(cap, group, tile, max_q, int(kv.max())) >= m["work_indptr"][-1]
        assert schedule.capacity_work_bound(cap, group, tile, max_q, 2**31 - 1) >= m["work_indptr"][-1]
        # the split-partial buffers are never overrun
        assert m["partial_indptr"][-1] <= capacity
        # unless the batch overflows the partial buffers, splits depend on the request alone
        if not m["overflow"]:
            b = int(rng.integers(0, len(q)))
            alone = model(q[b:b + 1], kv[b:b + 1], group, tile, capacity)
            assert alone["num_splits"][0] == m["num_splits"][b] and alone["split_keys"][0] == m["split_keys"][b]


@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (256, 8)])
def test_host_schedule_counts_the_rows_plan_kernel_wants(head_dim, group):
    """A host-planned step's ``partial_rows`` (what BatchInvarianceWarning is said on) is plan_kernel's
    first pass: the plan caps splits exactly when they exceed the buffers' rows."""
    rng, seed = new_rng()
    for _ in range(150):
        q, kv = random_batch(rng, int(rng.choice([1, 4, 16, 17, 300, 3000])))
        window = int(rng.choice([0, 0, 700, 5000]))
        arch = str(rng.choice(["sm_80", "sm_90a"]))
        sched = schedule.schedule_step(head_dim, group, 8, q_lens=q, kv_lens=kv, arch=arch, window=window)
        tile, long_tile = sched.plan_tiles()
        rows = int(rng.integers(1, 3000))
        m = model(q, kv, group, tile, rows, long_tile=long_tile, window=window)
        assert sched.partial_rows == m["want_rows"], (seed, q.tolist(), kv.tolist(), window, arch)
        assert m["overflow"] == (sched.partial_rows > rows)
    bound = schedule.schedule_step(head_dim, group, 8, max_q_len=4, max_kv_len=9000, batch_size=8,
                                   capacity=plan.Capacity(8, 32, 600))
    assert bound.partial_rows is None  # device lengths: the host cannot count them


def test_overflow_is_said_once_with_the_workspace_that_holds_it():
    """_check_partials: silent for device lengths (None) and batches that fit; one
    BatchInvarianceWarning per instance naming the rows and the workspace_bytes that hold them."""
    import types
    import warnings

    from cupy_fa._instance import PlannedInstance

    inst = PlannedInstance.__new__(PlannedInstance)
    inst._NAME, inst._overflow_said = "BatchAttention", False
    row = 32 * (128 * 2 + 4)
    inst._buffers = types.SimpleNamespace(partial_out=types.SimpleNamespace(shape=(100, 32, 128)),
                                          partial_row_bytes=row)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inst._check_partials(None)
        inst._check_partials(100)
    with pytest.warns(plan.BatchInvarianceWarning, match=rf"need 101 rows .* holds 100 .* workspace_bytes >= {101 * row}"):
        inst._check_partials(101)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inst._check_partials(5000)  # said once per instance
    assert schedule.partial_rows(4, 32, 128, 2, workspace_bytes=101 * row) == 4 * schedule.SPLIT_ROW_BUDGET
    assert schedule.partial_rows(1, 32, 128, 2, workspace_bytes=1000 * row) == 1000


def test_small_q_splits_sit_at_fixed_positions():
    """Decode (q=1) and verify (q=8) of the same position see the same split
    boundaries whatever kv_len: the schedule half of batch invariance."""
    tile = schedule.tile_for(128, 8, 4)
    S = schedule.split_size()
    for pos in (0, 1, S - 1, S, 3 * S + 5, 100 * S):
        decode = model([1], [pos + 1], 4, tile)
        verify = model([8], [pos + 8], 4, tile)
        assert decode["split_keys"][0] == verify["split_keys"][0] == S
        assert verify["num_splits"][0] - decode["num_splits"][0] in (0, 1)


def test_window_splits_cover_the_window_at_fixed_positions():
    """With a sliding window, decode (q=1) of position pos and verify (q=8) ending at it cut their
    keys at the same absolute positions (key_base + s x S, key_base a multiple of MERGE_GROUP x S:
    the merge's groups sit at fixed positions too), verify's splits start no later than decode's,
    and a window of W over any kv splits about W keys."""
    tile = schedule.tile_for(128, 8, 4)
    S = schedule.split_size()
    U = families.common.MERGE_GROUP * S
    for window in (1, 100, S, 3000, 4096):
        for pos in (0, 5, S - 1, U - 1, U + window - 3, 3 * U + 17, 100 * S, 131071):
            decode = model([1], [pos + 1], 4, tile, window=window)
            verify = model([8], [pos + 8], 4, tile, window=window)
            for m in (decode, verify):
                assert m["key_base"][0] % U == 0 and m["split_keys"][0] == S
            assert verify["key_base"][0] <= decode["key_base"][0]
            assert verify["key_base"][0] + verify["num_splits"][0] * S >= decode["key_base"][0] + decode["num_splits"][0] * S
            assert decode["num_splits"][0] <= -(-window // S) + families.common.MERGE_GROUP  # the window, not kv
            # decode's first key of its window sits in its first group of splits
            assert decode["key_base"][0] <= max(0, pos - window + 1) < decode["key_base"][0] + U


@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4)])
def test_host_bounds_cover_the_schedule_with_a_window(head_dim, group):
    """The host's grids for a windowed step (window_spans for host lengths, window_span_bound for
    device bounds) cover what plan_kernel lays out."""
    rng, _ = new_rng()
    for _ in range(100):
        max_q = int(rng.choice([1, 4, 16, 17, 300]))
        window = int(rng.choice([1, 37, 512, 4096, 20000]))
        q, kv = random_batch(rng, max_q)
        tile = schedule.tile_for(head_dim, max(1, q.max()), group)
        m = model(q, kv, group, tile, window=window)
        spans = schedule.window_spans(q, kv, window)
        assert (np.array(m["key_base"]) == np.where(q > 0, schedule.key_base(q, kv, window), 0)).all()
        assert schedule.work_bound(q, spans, group, tile) >= m["work_indptr"][-1]
        assert (np.asarray(m["num_splits"])[q > 0] <= schedule.max_splits(q[q > 0], spans[q > 0])).all()
        cap = plan.Capacity(len(q), int(q.sum()) + 1, 1)
        bound = schedule.window_span_bound(max_q, int(kv.max()), window)
        assert bound >= spans[q > 0].max(initial=0)
        assert schedule.capacity_work_bound(cap, group, tile, max_q, bound) >= m["work_indptr"][-1]
        sched = schedule.schedule_step(head_dim, group, 8, q_lens=q, kv_lens=kv, window=window)
        plain = schedule.schedule_step(head_dim, group, 8, q_lens=q, kv_lens=kv)
        assert all(x.max_splits <= y.max_splits for x, y in zip(sched.launches, plain.launches))


def test_a_window_over_a_long_context_plans_the_window():
    """Decode B=1 over 131072 keys with a window of 4096: 8 splits (the host's grid too), not 256."""
    sched = schedule.schedule_step(128, 4, 8, q_lens=[1], kv_lens=[131072], window=4096)
    assert sched.small.max_splits == 8 and sched.small.work_grid == 8
    assert schedule.schedule_step(128, 4, 8, q_lens=[1], kv_lens=[131072]).small.max_splits == 256
    device = schedule.schedule_step(128, 4, 8, max_q_len=1, max_kv_len=131072, capacity=plan.Capacity(1, 1, 8192),
                                    batch_size=1, window=4096)
    assert device.small.max_splits <= 16


def test_splits_per_cta_only_where_the_epilogue_fits_a_stage(monkeypatch):
    monkeypatch.setenv("CUPY_FA_SPLITS_PER_CTA", "3")
    knobs.reload()  # knobs are read once: take the new value
    assert schedule.tile_for(128, 1, 4).splits_per_cta == 3          # (1,4): 4 warps, 64-key tiles
    assert schedule.tile_for(128, 8, 4).splits_per_cta == 3          # (2,4), D >= 128: half of D per pass
    assert schedule.tile_for(64, 8, 4).splits_per_cta == 1           # (2,4), D = 64: 8 warps need all stages
    assert schedule.tile_for(128, schedule.SMALL_Q_LEN + 1, 1).splits_per_cta == 1  # prefill: one split per CTA
    tile = schedule.tile_for(128, 1, 4)
    q, kv = np.array([1, 1, 1]), np.array([5000, 512, 1])
    assert schedule.work_bound(q, kv, 4, tile) == 4 + 1 + 1           # ceil(10 / 3), 1, 1
    for bad in ("0", "65"):
        monkeypatch.setenv("CUPY_FA_SPLITS_PER_CTA", bad)
        with pytest.raises(ValueError, match="CUPY_FA_SPLITS_PER_CTA"):
            knobs.reload()  # checked when the knobs are read, whatever tile comes next
    with pytest.raises(ValueError, match="splits_per_cta"):
        families.mma_sync.MmaTile(64, 2, 4, splits_per_cta=2)


def test_fold_tile_choice(monkeypatch):
    """Small-q batches fold their splits in the CTA when those CTAs fill their waves at the
    folding variant's CTAs per SM at least 3/4 full, the last wave counted whole."""
    verify8 = schedule.tile_for(128, 8, 4)
    assert verify8.fold_capable  # the two-row tile always carries the state
    q, kv = np.full(64, 8), np.full(64, 4096)  # verify q=8 at B=64: 64 x 8 heads = 512 CTAs
    folded = schedule.fold_tile(verify8, q, kv, 4, 8, 132)
    assert folded.fold_splits and folded.splits_per_cta == families.common.MERGE_GROUP
    assert folded == dataclasses.replace(verify8, splits_per_cta=8, fold_splits=True)  # same binary
    assert schedule.work_bound(q, kv, 4, folded) == 64  # one work item per row block
    assert not schedule.fold_tile(verify8, q[:16], kv[:16], 4, 8, 132).fold_splits  # 128 CTAs: half a wave
    # 9 splits: two groups. With the exact lengths a CTA folds the whole row (no merge);
    # a graph plan sees only bounds and folds by groups (a state each for merge_kernel)
    longer = schedule.fold_tile(verify8, q, kv + 1, 4, 8, 132)
    assert longer.splits_per_cta == 16 and schedule.work_bound(q, kv + 1, 4, longer) == 64
    assert not schedule.needs_merge(longer, q, kv + 1)
    bounded = schedule.fold_tile(verify8, q, kv + 1, 4, 8, 132, exact=False)
    assert bounded.splits_per_cta == 8 and schedule.work_bound(q, kv + 1, 4, bounded) == 128
    assert schedule.needs_merge(bounded, q, kv + 1)
    with pytest.raises(RuntimeError, match="merge_kernel reads one state per 8"):
        schedule.needs_merge(longer, q, kv * 4)  # a whole-row CTA's row that would need a merge
    longest = schedule.fold_tile(verify8, q, kv * 4, 4, 8, 132)  # 32 splits: by groups
    assert longest.splits_per_cta == 8 and schedule.work_bound(q, kv * 4, 4, longest) == 64 * 4
    assert not schedule.fold_tile(schedule.tile_for(64, 8, 4), q, kv, 4, 8, 132).fold_splits  # D = 64: no fold state

    # the one-row tile (decode, verify q=4) switches to its fold-capable variant, which has
    # a CTA per SM less (2 instead of 3 at D = 128): 264 slots, so 392 CTAs fill 2 waves 0.74
    one_row = schedule.tile_for(128, 4, 4)
    assert not one_row.fold_capable and one_row.min_ctas_per_sm == 3
    for batch, folds in ((64, True), (50, True), (49, False)):  # x 8 KV heads: 512, 400, 392 CTAs
        got = schedule.fold_tile(one_row, np.full(batch, 4), np.full(batch, 4096), 4, 8, 132)
        assert got.fold_splits == folds, batch
        if folds:
            assert got.fold_capable and got.min_ctas_per_sm == 2 and got.stages == one_row.stages
    # one long request: 256 splits are 32 groups x 8 heads = 256 CTAs, 0.97 of a wave
    long_one = schedule.fold_tile(one_row, np.ones(1, int), np.full(1, 131072), 4, 8, 132)
    assert long_one.fold_splits and long_one.splits_per_cta == 8
    assert not schedule.fold_tile(one_row, np.ones(1, int), np.full(1, 4096), 4, 8, 132).fold_splits  # 8 CTAs
    monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", "1")
    knobs.reload()  # knobs are read once: take the new value
    assert schedule.fold_tile(verify8, q[:2], kv[:2], 4, 8, 132).fold_splits
    monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", "0")
    knobs.reload()  # knobs are read once: take the new value
    assert not schedule.fold_tile(verify8, q, kv, 4, 8, 132).fold_splits
    monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", "yes")
    with pytest.raises(ValueError, match="CUPY_FA_FOLD_SPLITS"):
        knobs.reload()
    with pytest.raises(ValueError, match="fold_splits"):
        families.mma_sync.MmaTile(128, 1, 4, splits_per_cta=8, fold_splits=True)


def test_fold_state_only_where_the_layout_allows():
    with pytest.raises(ValueError, match="fold state"):
        families.mma_sync.MmaTile(128, 4, 1, fold_capable=True)  # prefill: splits are rare and short
    with pytest.raises(ValueError, match="fold state"):
        families.mma_sync.MmaTile(64, 2, 4, fold_capable=True)   # two passes of 32 columns: no swizzle for them
    assert families.mma_sync.MmaTile(64, 2, 4).folding() is None
    for head_dim in families.common.HEAD_DIMS:
        for stages in knobs.STAGE_CHOICES:
            folded = families.mma_sync.small_q_tile(head_dim, 1, stages).folding()
            assert folded.fits and folded.fold_capable and folded.stages <= stages


def test_tile_choice():
    assert (schedule.tile_for(128, 1, 4).warps_m, schedule.tile_for(128, 1, 4).warps_n) == (1, 4)
    assert (schedule.tile_for(128, 8, 4).warps_m, schedule.tile_for(128, 8, 4).warps_n) == (2, 4)
    assert schedule.tile_for(128, schedule.SMALL_Q_LEN, 8).block_n == schedule.tile_for(128, 1, 8).block_n
    assert schedule.tile_for(128, schedule.SMALL_Q_LEN + 1, 1).warps_m == 4
    for shape in [families.mma_sync.MmaTile(d, m, n) for d in families.common.HEAD_DIMS for m, n in families.mma_sync.WARP_LAYOUTS]:
        assert shape.smem_bytes <= 227 * 1024
        assert (shape.block_n // shape.warps_n) % 16 == 0


def bufs_rows(attn):
    return attn._buffers.partial_out.shape[0]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 1)])
@pytest.mark.parametrize("fold", ["0", "1"])
def test_device_plan_matches_model(head_dim, group, fold, monkeypatch):
    import cupy_fa

    monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", fold)  # two layouts of the partial rows
    knobs.reload()  # knobs are read once: take the new value
    rng, _ = new_rng()
    attn = cupy_fa.BatchAttention(8 * group, 8, head_dim, "float16")
    for max_q in (1, 8, 16, 300):
        q, kv = random_batch(rng, max_q)
        table = np.zeros((len(q), -(-int(kv.max()) // 16) + 1), np.int32)
        attn.plan(q, kv, table)
        planned = attn.planned  # a step with long requests folds nothing (one merge, one layout)
        can_fold = planned.long_tile is None and planned.tile.folding() is not None and (q > 0).any()
        assert planned.tile.fold_splits == (fold == "1" and can_fold)
        tile, long_tile = planned.schedule.plan_tiles()
        m = model(q, kv, group, tile, bufs_rows(attn), long_tile)
        bufs = attn._buffers
        b = len(q)
        for name in ("q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr"):
            assert np.array_equal(getattr(bufs, name)[:b + 1].get(), m[name]), name
        for name in ("num_splits", "split_keys"):
            assert np.array_equal(getattr(bufs, name)[:b].get(), m[name]), name
        assert attn.status() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 700, 4096])
def test_device_plan_matches_model_with_a_window(window):
    """plan.cu's key_base and the splits of the window against the model, host and device lengths."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    group = 4
    attn = cupy_fa.BatchAttention(8 * group, 8, 128, "float16")
    for max_q in (1, 16, 300):
        q, kv = random_batch(rng, max_q)
        table = np.zeros((len(q), 1), np.int32)  # never read: plan only
        for lens in ((q, kv, table), tuple(cupy.asarray(x, np.int32) for x in (q, kv, table))):
            attn.plan(*lens, max_q_len=max(1, int(q.max())), max_kv_len=int(kv.max()), window=window)
            tile, long_tile = attn.planned.schedule.plan_tiles()
            m = model(q, kv, group, tile, bufs_rows(attn), long_tile, window=window)
            bufs = attn._buffers
            b = len(q)
            for name in ("q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr"):
                assert np.array_equal(getattr(bufs, name)[:b + 1].get(), m[name]), (name, max_q)
            for name in ("num_splits", "split_keys", "key_base"):
                assert np.array_equal(getattr(bufs, name)[:b].get(), m[name]), (name, max_q)
            assert attn.status() == 0


LONG_KV = (131071, 131072, 131073, 131072 + 511, 131072 + 512, 200_000, 1 << 20, (1 << 24) + 7)


def long_batch(rng):
    """Small-q and prefill-tile requests at and past 256 x 512 keys (where splits stop sitting at
    fixed positions and grow), with short ones and padding between them."""
    q = np.array([1, 4, 8, 16, 17, 64, 300, 1, 0, 3] * 2)
    kv = np.array(list(LONG_KV) + [int(x) for x in rng.integers(131000, 1 << 21, size=12)])[:len(q)]
    kv[8], kv[18] = 20, 7  # padded rows: kv is not read
    return q, np.maximum(kv, q)


@pytest.mark.parametrize("head_dim,group", [(128, 4), (256, 8)])
def test_model_split_clamp_at_long_lengths(head_dim, group):
    """At and past MAX_SPLITS x S keys the model (the clamp plan.cu applies) keeps every request at
    most MAX_SPLITS splits of whole 64-key tiles covering its keys, and the host bounds cover it."""
    rng, _ = new_rng()
    S = schedule.split_size()
    q, kv = long_batch(rng)
    for max_q in (1, 16, 300):
        tile = schedule.tile_for(head_dim, max_q, group)
        m = model(q, kv, group, tile)
        live = q > 0
        assert (m["num_splits"][live] <= schedule.MAX_SPLITS).all()
        assert (m["split_keys"][live] % tile.block_n == 0).all()
        small = live & (q <= schedule.SMALL_Q_LEN)
        fixed = small & (kv <= S * schedule.MAX_SPLITS)
        assert (m["split_keys"][fixed] == S).all() and (m["split_keys"][small & ~fixed] > S).all()
        assert (m["num_splits"][small & ~fixed] == -(-kv[small & ~fixed] // m["split_keys"][small & ~fixed])).all()
        assert (m["num_splits"][live] <= schedule.max_splits(q[live], kv[live])).all()
        assert schedule.work_bound(q, kv, group, tile) >= m["work_indptr"][-1]


@pytest.mark.gpu
@pytest.mark.parametrize("fold", ["0", "1"])
def test_device_plan_matches_model_at_long_lengths(fold, monkeypatch):
    """plan.cu's split clamp against the model where it matters: requests at and past 131072 keys
    (256 splits of 512, then longer splits), small-q and prefill-tile ones, host and device lengths."""
    import cupy
    import cupy_fa

    monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", fold)
    knobs.reload()  # knobs are read once: take the new value
    rng, _ = new_rng()
    group = 4
    q, kv = long_batch(rng)
    table = np.zeros((len(q), 1), np.int32)  # never read: plan only
    for max_q in (1, 16, 300):
        sel = q <= max_q
        qs, kvs = np.where(sel, q, 0), kv
        attn = cupy_fa.BatchAttention(8 * group, 8, 128, "float16")
        for lens in ((qs, kvs, table), tuple(cupy.asarray(x, np.int32) for x in (qs, kvs, table))):
            attn.plan(*lens, max_q_len=max(1, int(qs.max())), max_kv_len=int(kvs.max()))
            tile, long_tile = attn.planned.schedule.plan_tiles()  # a list per family where q_len > 16 may come
            m = model(qs, kvs, group, tile, bufs_rows(attn), long_tile)
            bufs = attn._buffers
            b = len(qs)
            for name in ("q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr"):
                assert np.array_equal(getattr(bufs, name)[:b + 1].get(), m[name]), (name, max_q)
            for name in ("num_splits", "split_keys"):
                assert np.array_equal(getattr(bufs, name)[:b].get(), m[name]), (name, max_q)
            assert attn.status() == 0


@pytest.mark.gpu
def test_device_plan_flags_broken_contract():
    """On the device path (no host validation) q_len > kv_len is flagged and the row refused: one
    work item per row block that reads nothing and writes its rows NaN (num_splits = -reason)."""
    import cupy
    import cupy_fa

    attn = cupy_fa.BatchAttention(8, 8, 64, "float16", max_batch_size=4, max_num_tokens=16, max_pages_per_request=4)
    attn.plan(cupy.array([2, 5], np.int32), cupy.array([9, 3], np.int32), cupy.zeros((2, 4), np.int32), max_q_len=8)
    assert attn.status() == 2 and attn.status().reason == 2
    work = attn._buffers.work_indptr[:3].get()
    assert work[2] - work[1] == 1  # 5 rows x group 1 fit one row block of the tile
    assert attn._buffers.num_splits[1].get() == -2 and attn._buffers.partial_indptr[2].get() == 0
    # a refused row keeps its tokens in the offsets: the rows after it still find their q and out
    attn.plan(cupy.array([5, 2, 1, 3], np.int32), cupy.array([3, 9, 0, 3], np.int32), cupy.zeros((4, 4), np.int32),
              max_q_len=8)
    assert attn.status() == 1  # the first bad row, even with two
    assert attn._buffers.q_indptr[:5].get().tolist() == [0, 5, 7, 8, 11]
    work = attn._buffers.work_indptr[:5].get()
    # requests 0 (5 > 3) and 2 (1 > 0) refused: a NaN row block each; 1 and 3 live
    assert work[1] == 1 and work[2] > work[1] and work[3] == work[2] + 1 and work[4] > work[3]
    splits = attn._buffers.num_splits[:4].get().tolist()
    assert splits[0] == splits[2] == -2 and splits[1] > 0 and splits[3] > 0


def test_warp_segment_search_model():
    """A Python model of kernels/shared/common.cuh upper_segment (up to 128 entries: four probes a
    lane, the entries that hold counted over four ballots; past that 32 probes per round, ballot,
    last lane that holds) agrees with bisection on offsets with runs of equal entries, and needs
    one round up to 128 entries, ceil(log32(n)) past them."""
    import bisect

    def warp_search(indptr, n, x):
        if n <= 128:
            held = [[4 * lane + j < n and indptr[4 * lane + j] <= x for lane in range(32)] for j in range(4)]
            flat = [held[j][lane] for lane in range(32) for j in range(4)][:n]
            assert flat == sorted(flat, reverse=True)  # a prefix holds
            return max(sum(map(sum, held)) - 1, 0), 1
        lo, hi, rounds = 0, n, 0
        while hi - lo > 1:
            step = (hi - lo + 31) >> 5
            below = [lo + lane * step < hi and indptr[lo + lane * step] <= x for lane in range(32)]
            assert below[0] and below == sorted(below, reverse=True)  # lane 0 holds; a prefix holds
            lo += max(lane for lane in range(32) if below[lane]) * step
            hi = min(hi, lo + step)
            rounds += 1
        return lo, rounds

    rng = np.random.default_rng(0)
    for n in (1, 2, 31, 32, 33, 64, 100, 127, 128, 129, 1000, 1024, 1025, 5000):
        sizes = rng.integers(0, 4, n) * (rng.random(n) < 0.6)
        indptr = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        for x in range(indptr[-1]):
            got, rounds = warp_search(indptr, n, x)
            assert got == bisect.bisect_right(indptr, x) - 1, (n, x)
            assert indptr[got] <= x < indptr[got + 1]
            assert rounds <= max(1, int(np.ceil(np.log(n) / np.log(32) - 1e-9)))


def test_tiles_fit_the_device_shared_memory():
    """On an A100 (163 KB per CTA) the head-dim-256 tiles with a fold state do not fit: the
    two-row tile runs without one (one split per CTA) and the one-row tile never folds."""
    a100 = families.common.SM80_SMEM_LIMIT
    two_row = schedule.tile_for(256, 8, 4, a100)
    assert two_row.warps_m == 2 and not two_row.fold_capable and two_row.fits_in(a100)
    assert schedule.tile_for(256, 8, 4).fold_capable  # Hopper keeps it
    q, kv = np.full(64, 8), np.full(64, 4096)
    assert not schedule.fold_tile(two_row, q, kv, 4, 8, 108, smem_limit=a100).fold_splits
    one_row = schedule.tile_for(256, 1, 4, a100)
    assert one_row.folding(smem_limit=a100) is None
    assert not schedule.fold_tile(one_row, np.ones(512, int), np.full(512, 4096), 4, 8, 108, smem_limit=a100).fold_splits
    for head_dim in (64, 128):  # there the fold fits an A100 as well
        assert schedule.tile_for(head_dim, 1, 4, a100).folding(smem_limit=a100) is not None
    with pytest.raises(ValueError, match="shared memory"):
        families.mma_sync.small_q_tile(256, 1, 2, 100 * 1024)
