"""Bad input is refused with a message naming the argument, before any device
work (these run without a GPU: validation happens first)."""

import numpy as np
import pytest

import cupy_fa


@pytest.mark.parametrize("args,kwargs,exc,text", [
    ((6, 4, 64), {}, ValueError, "multiple of num_kv_heads"),
    ((8, 2, 80), {}, ValueError, "head_dim"),
    ((8, 2, (192, 128)), {}, ValueError, "separate qk / vo head dims"),
    ((0, 2, 64), {}, ValueError, "num_qo_heads"),
    ((8, 2, 64), {"dtype": "float32"}, TypeError, "float16 or bfloat16"),
    ((8, 2, 64), {"max_batch_size": 4}, ValueError, "give all"),
    ((8, 2, 64), {"workspace_bytes": 0}, ValueError, "workspace_bytes"),
    ((8, 2, 64), {"workspace_bytes": 1.5}, ValueError, "workspace_bytes"),
])
def test_constructor_rejects(args, kwargs, exc, text):
    with pytest.raises(exc, match=text):
        cupy_fa.BatchAttention(*args, **kwargs)


@pytest.mark.parametrize("q_lens,kv_lens,table,exc,text", [
    ([1, 5], [1, 3], [[0], [1]], ValueError, r"q_lens\[1\] = 5 > kv_lens\[1\] = 3"),
    ([1, 2], [1, 3], [[0], [1], [2]], ValueError, "page_table has 3 rows"),
    ([1], [1.5], [[0]], TypeError, "kv_lens must hold integers"),
    ([-1], [3], [[0]], ValueError, r"q_lens\[0\] = -1 is negative"),
    ([1, 1], [1], [[0], [1]], ValueError, r"q_lens and kv_lens differ in length \(2 and 1\)"),
    # lengths of different sizes are named as such, whatever the page table's rows
    ([1, 2], [1], [[0]], ValueError, r"q_lens and kv_lens differ in length \(2 and 1\)"),
    ([1], [1, 2, 3], [[0], [1], [2]], ValueError, r"q_lens and kv_lens differ in length \(1 and 3\)"),
    ([[1]], [1], [[0]], ValueError, "q_lens must have 1 dimension"),
    ([1], [1], [0], ValueError, "page_table must have 2 dimension"),
])
def test_plan_rejects_bad_lengths(q_lens, kv_lens, table, exc, text):
    attn = cupy_fa.BatchAttention(8, 2, 64)
    with pytest.raises(exc, match=text):
        attn.plan(q_lens, kv_lens, table)


def test_plan_rejects_bad_scale_and_mask():
    attn = cupy_fa.BatchAttention(8, 2, 64)
    with pytest.raises(ValueError, match="sm_scale"):
        attn.plan([1], [4], [[0]], sm_scale=float("nan"))
    with pytest.raises(ValueError, match="custom_mask has 3 entries"):
        attn.plan([2], [4], [[0]], custom_mask=np.ones(3, bool))


def test_run_before_plan_and_host_arrays():
    attn = cupy_fa.BatchAttention(8, 2, 64)
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(np.zeros((1, 8, 64), np.float16), None)
    with pytest.raises(TypeError, match="k must be a CUDA device array"):
        cupy_fa.PagedKVCache(np.zeros((1, 1, 1, 8)), np.zeros((1, 1, 1, 8)))


def test_page_table_validation_logic():
    from cupy_fa import plan

    table = np.array([[1, 0], [0, 2]])
    plan.validate_page_table(table, np.array([20, 17]), np.array([1, 1]), 16, 4)
    with pytest.raises(ValueError, match=r"page_table\[1, 1\] = 2"):
        plan.validate_page_table(table, np.array([20, 17]), np.array([1, 1]), 16, 2)
    with pytest.raises(ValueError, match="needs 3 pages"):
        plan.validate_page_table(table, np.array([40, 17]), np.array([1, 1]), 16, 4)
    # padded rows (q_len = 0) are not checked: their table rows are never read
    plan.validate_page_table(table, np.array([40, 17]), np.array([0, 1]), 16, 4)


def test_page_table_width_and_split_knob(monkeypatch):
    from cupy_fa import plan

    # host lengths with a device page table: only the width can be checked, and it is
    with pytest.raises(ValueError, match="has 2 columns but request 0 needs 7 pages"):
        plan.validate_page_table_width(2, np.array([100]), np.array([1]), 16)
    plan.validate_page_table_width(7, np.array([100]), np.array([1]), 16)
    for bad in ("0", "100"):
        monkeypatch.setenv("CUPY_FA_SPLIT_SIZE", bad)
        with pytest.raises(ValueError, match="CUPY_FA_SPLIT_SIZE"):
            cupy_fa.knobs.reload()


@pytest.mark.parametrize("want,array,text", [
    (np.float32, np.zeros((2, 3), np.float16), "lse must have dtype float32, got float16$"),
    ("bfloat16", np.zeros((2, 3), np.float32), "lse must have dtype bfloat16, got float32$"),
    (np.dtype(np.float16), np.zeros((2, 3), np.float32), "lse must have dtype float16, got float32$"),
])
def test_dtype_message_names_the_expected_dtype(want, array, text):
    """The expected dtype is written by name (not as a NumPy type's repr); the dtype check comes
    first, so a host array stands in for a device one."""
    from cupy_fa import _arrays

    with pytest.raises(TypeError, match=text):
        _arrays.check_device_array(array, "lse", dtype=want)


@pytest.mark.parametrize("slots,rows,text", [
    ([0, 1], 3, "slots has 2 entries, ckv has 3 tokens"),
    ([0, 12, 1], 3, r"slots\[1\] = 12 is outside the cache \(0 <= slot < num_pages \* page_size = 12\)"),
    ([0, -1], 2, r"slots\[1\] = -1 is outside the cache"),
])
def test_append_slots_are_checked_before_the_device(slots, rows, text):
    """Both caches' appends (PagedKVCache, PagedLatentCache) check host slots in one place,
    kv_cache.staged_slots, naming the caller's rows: bad ones raise before anything is copied."""
    from cupy_fa.kv_cache import staged_slots

    with pytest.raises(ValueError, match=text):
        staged_slots(np.asarray(slots, np.int64), None, rows, "ckv", 12, 0, stream=None)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_host_page_table_is_checked_where_the_kernel_reads(dtype):
    """plan.validate_page_table: entries past a request's kv_len (padding, -1 or anything) and rows of
    empty requests are never read, so never refused; a read entry outside [0, num_pages) is, naming
    the first in row-major order (the one-pass test of an all-valid int32 table and the masked search
    give the same answers)."""
    from cupy_fa.plan import validate_page_table

    q_lens, kv_lens = np.array([1, 0, 3]), np.array([33, 5, 17])  # 3, 1 and 2 pages of 16
    table = np.full((3, 4), -1, dtype)
    table[0, :3], table[2, :2] = [7, 0, 9], [3, 4]
    table[1, 0] = 1000  # request 1 has no queries: its row is not read
    validate_page_table(table, kv_lens, q_lens, 16, 10)
    validate_page_table(np.arange(12, dtype=dtype).reshape(3, 4), kv_lens, q_lens, 16, 12)  # every entry a page
    for where, value in (((0, 2), -1), ((2, 1), 10), ((0, 0), -2 ** 31)):
        bad = table.copy()
        bad[where] = value
        with pytest.raises(ValueError, match=rf"page_table\[{where[0]}, {where[1]}\] = {value} is not a page"):
            validate_page_table(bad, kv_lens, q_lens, 16, 10)


def test_check_step_reuses_q_facts_only_for_the_same_q():
    """check_step keeps the last NumPy q_lens' min / max / sum (decode-like steps repeat them): a
    step whose q_lens differ in any byte, in dtype, or after an in-place change is checked afresh."""
    from cupy_fa import plan

    table = np.zeros((3, 4), np.int32)
    q = np.array([1, 1, 1], np.int32)
    first = plan.check_step(q, np.array([5, 6, 7], np.int32), table)
    assert (first.max_q_len, first.num_tokens, first.max_kv_len) == (1, 3, 7)
    again = plan.check_step(q, np.array([9, 2, 3], np.int32), table)
    assert again.q_host is first.q_host and (again.max_q_len, again.max_kv_len) == (1, 9)
    with pytest.raises(ValueError, match=r"q_lens\[1\] = 1 > kv_lens\[1\] = 0"):  # the same q, a kv_len below it
        plan.check_step(q, np.array([4, 0, 4], np.int32), table)
    q[2] = 3  # in place: other bytes
    step = plan.check_step(q, np.array([5, 6, 7], np.int32), table)
    assert (step.max_q_len, step.num_tokens) == (3, 5) and step.q_host.tolist() == [1, 1, 3]
    step = plan.check_step(q.astype(np.int64), np.array([5, 6, 7], np.int64), table)  # another dtype
    assert (step.max_q_len, step.num_tokens) == (3, 5)
    q[0] = -1
    with pytest.raises(ValueError, match=r"q_lens\[0\]"):
        plan.check_step(q, np.array([5, 6, 7], np.int32), table)
    with pytest.raises(ValueError):  # the shared int64 copy is read-only: no step writes into another's
        step.q_host[0] = 7
