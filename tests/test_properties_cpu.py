"""Property tests (hypothesis) of the schedule on the CPU: random batches of every serving mode,
page sizes, bucket padding, page tables and custom masks, planned the way BatchAttention plans
them (host lengths: exact; device lengths: bounds), laid out by the NumPy model of plan_kernel
(tests/test_plan.py), then every CTA of the attention kernel and the merge replayed the way
kernels/mma_sync/attention.cu reads its work item. Properties:

* every live (token, head) row is written exactly once (by its CTA or by the merge), padded
  rows never; the merge reads only partials some CTA wrote;
* every CTA reads keys inside its request's kv_len, page-table columns inside
  ceil(kv_len / page_size), custom-mask bytes inside its request's block, split partials inside
  its request's rows of the buffer; the grid the host launches covers the work;
* the keys a row sees (causal, none, or the prefix plus its mask) all lie in its splits;
* the host's page-table check refuses a table exactly when an entry the kernels read is no page.

And properties of the float64 reference the GPU tests are judged by (small shapes): page ids
relabelled, padded rows added, or a lower-triangular mask for causal leave outputs unchanged.
Runs in CI: example counts and deadlines fit a 2-core machine."""

import contextlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from cupy_fa import ForwardMode, contract_lengths, knobs as knob_state, plan, reference, schedule
from cupy_fa import families
from test_plan import model

SETTINGS = settings(max_examples=int(os.environ.get("CUPY_FA_PROPERTY_EXAMPLES", "150")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SM_COUNT = 132  # an H200's: the fold choice depends on it, never the bits
PAGE_SIZES = (1, 3, 16, 48, 64)


@contextlib.contextmanager
def knobs(**env):
    """CUPY_FA_* settings for one example (hypothesis examples cannot use monkeypatch)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    knob_state.reload()  # the knobs are read once (cupy_fa.knobs)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        knob_state.reload()


# ---- strategies -----------------------------------------------------------------------


MODES = [m for m in ForwardMode if m is not ForwardMode.IDLE]


@st.composite
def mode_batch(draw, max_batch=12, max_prefix=20000):
    """(mode, q_lens, kv_lens) from the mode's own quantities through contract_lengths, with
    padded rows (q_len = 0) sprinkled in as a bucket would add them."""
    mode = draw(st.sampled_from(MODES))
    batch = draw(st.integers(1, max_batch))
    prefix = draw(st.lists(st.integers(0, max_prefix), min_size=batch, max_size=batch))
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        high = 40 if mode is ForwardMode.EXTEND else 24
        new = draw(st.lists(st.integers(1, high), min_size=batch, max_size=batch))
        if mode is ForwardMode.MIXED:  # decode rows among the chunks
            new = [1 if draw(st.booleans()) else n for n in new]
        q, kv = contract_lengths(mode, prefix_lens=prefix, new_lens=new)
    elif mode is ForwardMode.DECODE:
        q, kv = contract_lengths(mode, prefix_lens=prefix)
    elif mode is ForwardMode.DRAFT_EXTEND:
        accepted = draw(st.lists(st.integers(1, 9), min_size=batch, max_size=batch))
        q, kv = contract_lengths(mode, prefix_lens=prefix, accepted_lens=accepted)
    else:
        n = draw(st.integers(1, 16))
        q, kv = contract_lengths(mode, prefix_lens=prefix, num_draft_tokens=n)
    q, kv = np.array(q), np.array(kv)
    pad = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    q = np.where(pad, 0, q) if not all(pad) else q  # at least one live row
    return mode, q, kv


H200 = dict(sm_count=SM_COUNT, arch="sm_90a")  # two families: the wgmma one for requests over 16 tokens


def plan_on_host(q, kv, head_dim, group, num_kv_heads):
    """What BatchAttention.plan chooses for host lengths (cupy_fa.schedule): launches, fold, grids, merge."""
    return schedule.schedule_step(head_dim, group, num_kv_heads, q_lens=q, kv_lens=kv, **H200)


def plan_on_device(q, kv, head_dim, group, num_kv_heads, bucket, max_q, max_pages, page_size):
    """What a graph step (GraphRunner: device lengths, bounds only) chooses for a bucket."""
    return schedule.schedule_step(head_dim, group, num_kv_heads, max_q_len=max_q, max_kv_len=max_pages * page_size,
                                  capacity=plan.Capacity(bucket, bucket * max_q, max_pages), batch_size=bucket, **H200)


# ---- the kernels' reads and writes, replayed --------------------------------------------


def replay(m, q, kv, group, sched, causal, masked, page_size, width, capacity_rows):
    """Every CTA of each attention launch of ``sched`` (one KV head: the others are alike; the
    long family's CTAs take the same items, in reverse) and merge_kernel over the model's
    metadata ``m``. Returns the page-table entries read, and asserts every read and write lies
    where the request's buffers are and every live row is written once."""
    writes = {}      # (token, head in group) -> times written to out
    partials = set()  # (partial row, packed row in head group) written
    keys_of = {}     # (b, packed row) -> set of keys in the splits its CTAs ran
    table_reads = set()
    for launch in sched.launches:
        work_indptr = m["long_work_indptr"] if launch is sched.long else m["work_indptr"]
        replay_launch(launch.tile, launch.work_grid, work_indptr, m, q, kv, group, causal, masked, page_size,
                      width, capacity_rows, writes, partials, keys_of, table_reads)
    # the merge reads group states where the small-q CTAs folded (only in steps without long requests)
    folded = sched.small is not None and bool(sched.small.tile.fold_splits)
    merge_and_check(m, q, kv, group, folded, sched.needs_merge, causal, masked, writes, partials, keys_of)
    return table_reads


def replay_launch(tile, grid, work_indptr, m, q, kv, group, causal, masked, page_size, width, capacity_rows,
                  writes, partials, keys_of, table_reads):
    batch = len(q)
    bm, per_cta = tile.block_m, tile.splits_per_cta
    total = int(work_indptr[-1])
    assert grid >= total, f"the grid ({grid}) does not cover the work ({total})"
    q_indptr, partial_indptr = m["q_indptr"], m["partial_indptr"]
    for work in range(grid):
        if work >= total:
            continue  # exits at once
        b = int(np.searchsorted(work_indptr[:batch + 1], work, side="right") - 1)  # upper_segment
        assert work_indptr[b] <= work < work_indptr[b + 1]
        q_start, q_len = int(q_indptr[b]), int(q_indptr[b + 1] - q_indptr[b])
        assert q_len == q[b] > 0, "work for a padded row"
        splits, split_keys = int(m["num_splits"][b]), int(m["split_keys"][b])
        groups = -(-splits // per_cta)
        local = work - int(work_indptr[b])
        split_first = (local % groups) * per_cta
        split_stop = min(split_first + per_cta, splits)
        if tile.fold_splits:
            assert per_cta % families.common.MERGE_GROUP == 0 and (groups == 1 or per_cta == families.common.MERGE_GROUP), "a trap"
        row0 = (local // groups) * bm
        rows = q_len * group
        assert row0 < rows, "a CTA past its request's rows"
        last_row = min(row0 + bm, rows) - 1
        prefix = int(kv[b]) - q_len
        for split in range(split_first, split_stop):
            begin = split * split_keys
            end = min(int(kv[b]), (split + 1) * split_keys)
            if causal and not masked:
                end = min(end, prefix + last_row // group + 1)
            assert 0 <= begin and (end <= begin or end <= kv[b]), "keys past kv_len"
            if end > begin:
                cols = range(begin // page_size, (end - 1) // page_size + 1)
                assert cols[-1] < -(-int(kv[b]) // page_size) <= width, "a page-table column past the request's pages"
                table_reads.update((b, c) for c in cols)
            if masked:  # the bytes of the mask the tile's rows read: its own block
                for row in range(row0, last_row + 1):
                    i = row // group
                    for key in range(max(begin, prefix), max(begin, end)):
                        at = int(m["mask_indptr"][b]) + i * q_len + (key - prefix)
                        assert m["mask_indptr"][b] <= at < m["mask_indptr"][b + 1], "a mask byte of another request"
            for row in range(row0, last_row + 1):
                keys_of.setdefault((b, row), []).append((begin, end))
                token = row // group
                final = splits == 1 or (tile.fold_splits and groups == 1 and split + 1 == split_stop)
                if final:  # the row's result, from its only split or from the CTA's fold of them all
                    writes[(q_start + token, row % group)] = writes.get((q_start + token, row % group), 0) + 1
                elif tile.fold_splits and groups == 1:
                    pass  # folded in shared memory until the row's last split
                elif tile.fold_splits:  # one group of several: its state for the merge, at its group's close
                    if split % families.common.MERGE_GROUP == families.common.MERGE_GROUP - 1 or split + 1 == split_stop:
                        group_row = int(partial_indptr[b]) // 2 + token * groups + split_first // families.common.MERGE_GROUP
                        for r in (2 * group_row, 2 * group_row + 1):
                            assert partial_indptr[b] <= r < partial_indptr[b + 1] <= capacity_rows
                        partials.add((group_row, row % group))
                else:
                    slot = int(partial_indptr[b]) + token * splits + split
                    assert partial_indptr[b] <= slot < partial_indptr[b + 1] <= capacity_rows, "a partial row elsewhere"
                    partials.add((slot, row % group))


def merge_and_check(m, q, kv, group, folded, merge_launched, causal, masked, writes, partials, keys_of):
    batch = len(q)
    q_indptr, partial_indptr = m["q_indptr"], m["partial_indptr"]
    if merge_launched:  # merge_kernel: one CTA per token; rows with several inputs fold them
        for b in range(batch):
            if q[b] == 0:
                continue
            splits = int(m["num_splits"][b])
            inputs = -(-splits // families.common.MERGE_GROUP) if folded else splits
            if inputs <= 1:
                continue
            for token in range(q[b]):
                for g in range(group):
                    for i in range(inputs):
                        if folded:
                            row = int(partial_indptr[b]) // 2 + token * inputs + i
                        else:
                            row = int(partial_indptr[b]) + token * splits + i
                        assert (row, g) in partials, f"the merge reads a partial no CTA wrote (request {b})"
                    key = (int(q_indptr[b]) + token, g)
                    writes[key] = writes.get(key, 0) + 1
    for b in range(batch):
        for token in range(q[b]):
            for g in range(group):
                assert writes.get((int(q_indptr[b]) + token, g), 0) == 1, \
                    f"request {b} token {token} head {g} written {writes.get((int(q_indptr[b]) + token, g), 0)} times"
            for g in range(group):  # the keys the row sees all lie in its splits
                visible = int(kv[b]) - int(q[b]) + token + 1 if (causal and not masked) else int(kv[b])
                covered = 0  # the splits' ranges, in order, must cover 0 .. visible - 1 with no gap
                for begin, end in sorted(keys_of.get((b, token * group + g), [])):
                    if covered >= visible:
                        break
                    if end <= begin:
                        continue  # a split the causal clip left empty for this row block
                    assert begin <= covered, f"request {b} token {token}: keys {covered} .. {begin - 1} in no split"
                    covered = max(covered, end)
                assert covered >= visible, f"request {b} token {token}: keys from {covered} on in no split"
    assert sum(writes.values()) == int(q.sum()) * group, "a write outside the live rows"


def run_schedule(q, kv, head_dim, group, device_bounds, causal, masked, page_size, knob_fold, knob_per_cta,
                 capacity_rows=None):
    num_kv_heads = 8
    with knobs(CUPY_FA_FOLD_SPLITS=knob_fold, CUPY_FA_SPLITS_PER_CTA=knob_per_cta):
        if device_bounds is None:
            rows = capacity_rows or schedule.partial_rows(len(q), num_kv_heads * group, head_dim)
            sched = plan_on_host(q, kv, head_dim, group, num_kv_heads)
        else:
            bucket, max_q, max_pages = device_bounds
            rows = schedule.partial_rows(bucket, num_kv_heads * group, head_dim)
            sched = plan_on_device(q, kv, head_dim, group, num_kv_heads, bucket, max_q, max_pages, page_size)
        tile, long_tile = sched.plan_tiles()
        m = model(q, kv, group, tile, rows, long_tile)
        width = max(1, -(-int(kv[q > 0].max()) // page_size)) if (q > 0).any() else 1
        return replay(m, q, kv, group, sched, causal, masked, page_size, width, rows)


# ---- the properties ---------------------------------------------------------------------------


@SETTINGS
@given(batch=mode_batch(), head_dim=st.sampled_from(families.common.HEAD_DIMS), group=st.sampled_from([1, 4, 8]),
       page_size=st.sampled_from(PAGE_SIZES), causal=st.booleans(), masked=st.booleans(),
       fold=st.sampled_from(["auto", "0", "1"]), per_cta=st.sampled_from([1, 2, 3]))
def test_host_plan_writes_every_row_once_and_reads_inside(batch, head_dim, group, page_size, causal, masked, fold,
                                                        per_cta):
    mode, q, kv = batch
    masked = masked and mode is ForwardMode.TARGET_VERIFY  # tree masks are for verify
    run_schedule(q, kv, head_dim, group, None, causal, masked, page_size, fold, per_cta)


@SETTINGS
@given(batch=mode_batch(max_batch=9), head_dim=st.sampled_from(families.common.HEAD_DIMS), group=st.sampled_from([1, 4]),
       page_size=st.sampled_from(PAGE_SIZES), extra_bucket=st.integers(0, 7), fold=st.sampled_from(["auto", "1"]))
def test_graph_plan_bounds_cover_any_step_of_the_bucket(batch, head_dim, group, page_size, extra_bucket, fold):
    """A graph step: lengths padded with q_len = 0 rows to the bucket, the grid and the merge
    decided from bounds alone (max_q_len of the mode, the page table's width)."""
    mode, q, kv = batch
    max_q = 1 if mode is ForwardMode.DECODE else int(max(16, q.max()))
    bucket = len(q) + extra_bucket
    q = np.concatenate([q, np.zeros(extra_bucket, int)])
    kv = np.concatenate([kv, np.zeros(extra_bucket, int)])
    max_pages = -(-int(kv.max()) // page_size) + 1
    run_schedule(q, kv, head_dim, group, (bucket, max_q, max_pages), True, False, page_size, fold, 1)


@SETTINGS
@given(batch=mode_batch(max_batch=16), group=st.sampled_from([1, 8]), rows=st.sampled_from([7, 40, 300]))
def test_overflowing_partial_buffer_stays_inside(batch, group, rows):
    """A batch whose split partials overflow the buffer gets equal shares: still every row once,
    every partial inside the buffer."""
    _, q, kv = batch
    run_schedule(q, kv, 128, group, None, True, False, 16, "0", 1, capacity_rows=rows)


@st.composite
def paged_batch(draw):
    batch = draw(st.integers(1, 6))
    q = np.array(draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch)))
    kv = q + np.array(draw(st.lists(st.integers(0, 300), min_size=batch, max_size=batch)))
    page_size = draw(st.sampled_from(PAGE_SIZES))
    num_pages = draw(st.integers(1, 40))
    width = draw(st.integers(max(1, -(-int(kv.max()) // page_size)), -(-int(kv.max()) // page_size) + 3))
    table = np.array(draw(st.lists(st.lists(st.integers(-3, num_pages + 3), min_size=width, max_size=width),
                                   min_size=batch, max_size=batch)))
    return q, kv, page_size, num_pages, table


@SETTINGS
@given(paged_batch())
def test_page_table_check_refuses_exactly_what_the_kernels_would_misread(case):
    q, kv, page_size, num_pages, table = case
    assume((q > 0).any())
    reads = run_schedule(q, kv, 128, 4, None, True, False, page_size, "auto", 1)
    bad = [(b, c) for b, c in sorted(reads) if not 0 <= table[b, c] < num_pages]
    try:
        plan.validate_page_table(table, kv, q, page_size, num_pages)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    assert (refused is None) == (not bad), (bad, refused)
    if bad:
        b, c = bad[0]
        assert f"page_table[{b}, {c}] = {table[b, c]}" in refused  # the first entry read, row-major


# ---- the reference ---------------------------------------------------------------------------


@st.composite
def tiny_step(draw):
    """A small paged step for the float64 reference: H_q 4, H_kv 2, D 8."""
    batch = draw(st.integers(1, 4))
    q = np.array(draw(st.lists(st.integers(1, 5), min_size=batch, max_size=batch)))
    kv = q + np.array(draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch)))
    page_size = draw(st.sampled_from((1, 3, 16)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    need = [-(-int(k) // page_size) for k in kv]
    num_pages = sum(need) + 2
    perm = rng.permutation(num_pages)
    table = np.zeros((batch, max(need)), np.int64)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n
    k = rng.standard_normal((num_pages, page_size, 2, 8))
    v = rng.standard_normal((num_pages, page_size, 2, 8))
    qs = rng.standard_normal((int(q.sum()), 4, 8))
    return qs, k, v, q, kv, table, rng


@SETTINGS
@given(tiny_step())
def test_reference_ignores_page_labels_and_padding(step):
    qs, k, v, q, kv, table, rng = step
    out = reference.paged_attention(qs, k, v, q, kv, table)
    # relabel the physical pages: move each page and rename it in the table
    perm = rng.permutation(k.shape[0])
    inverse = np.argsort(perm)
    relabelled = reference.paged_attention(qs, k[perm], v[perm], q, kv, inverse[table])
    assert np.allclose(out, relabelled, rtol=1e-12, atol=1e-12)
    # padded rows (q_len = 0, any kv_len, any table row) change no other row
    pad_at = int(rng.integers(0, len(q) + 1))
    q_pad = np.insert(q, pad_at, 0)
    kv_pad = np.insert(kv, pad_at, int(rng.integers(0, 50)))
    table_pad = np.insert(table, pad_at, -7, axis=0)
    padded = reference.paged_attention(qs, k, v, q_pad, kv_pad, table_pad)
    assert np.array_equal(out, padded)


@SETTINGS
@given(tiny_step())
def test_reference_tril_mask_is_causal(step):
    qs, k, v, q, kv, table, _ = step
    causal = reference.paged_attention(qs, k, v, q, kv, table, return_lse=True)
    masks = [np.tril(np.ones((n, n), bool)) for n in q]
    masked = reference.paged_attention(qs, k, v, q, kv, table, custom_mask=masks, return_lse=True)
    full = reference.paged_attention(qs, k, v, q, kv, table, causal=False, return_lse=True)
    ones = reference.paged_attention(qs, k, v, q, kv, table, custom_mask=[np.ones((n, n), bool) for n in q],
                                     return_lse=True)
    for a, b in ((causal, masked), (full, ones)):
        assert np.allclose(a[0], b[0], rtol=1e-12, atol=1e-12) and np.allclose(a[1], b[1], rtol=1e-12, atol=1e-12)


# ---- host validation comes before the device --------------------------------------------------


@SETTINGS
@given(q=st.lists(st.integers(-3, 40), min_size=0, max_size=6), kv=st.lists(st.integers(-3, 40), min_size=0,
                                                                          max_size=6),
       rows=st.integers(0, 7), cols=st.integers(1, 4))
def test_plan_refuses_bad_host_lengths_before_the_device(q, kv, rows, cols, monkeypatch_module):
    """Any host batch: plan either refuses it naming an argument (ValueError / TypeError), or
    reaches the device, which here answers 'cannot run here': validation never touches it."""
    import cupy_fa

    attn = cupy_fa.BatchAttention(8, 2, 64)
    valid = (len(q) == len(kv) == rows and all(x >= 0 for x in q + kv) and all(a <= b for a, b in zip(q, kv)))
    try:
        attn.plan(q, kv, np.zeros((rows, cols), np.int32))
    except (ValueError, TypeError) as exc:
        assert not valid, f"a valid batch refused: {exc}"
        assert any(name in str(exc) for name in ("q_lens", "kv_lens", "page_table")), str(exc)
    except RuntimeError as exc:
        assert valid and "cannot run here" in str(exc), str(exc)
    else:
        pytest.fail("plan ran without a device")


@pytest.fixture(scope="module")
def monkeypatch_module():
    """No usable device for this module's plan test, whatever the machine has."""
    from cupy_fa import _arrays

    mp = pytest.MonkeyPatch()
    mp.setattr(_arrays, "_cuda_ready", False)
    mp.setattr(_arrays, "cuda_problem", lambda: "no NVIDIA driver was found (simulated here)")
    yield mp
    mp.undo()
