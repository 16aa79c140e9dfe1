"""Garbage device metadata (the lengths and page table of a CUDA-graph step, which the host cannot
read): no fault, the bad request's rows NaN, every other request's bits as in a clean run, the
status word naming the first bad request and what was wrong, plan(check=True) and CUPY_FA_DEBUG=1
raising after a sync, and the context alive for the next step."""

import numpy as np
import pytest

from cases import new_rng
from safety_cases import assert_matches, device_step, reference_of

pytestmark = pytest.mark.gpu

H, D, PAGE = (8, 2), 128, 16
# decode (several splits: the merge), verify (a prefill-free small-q tile), extend (prefill tile)
BATCHES = {
    "decode": ([1, 1, 1, 1, 1], [700, 2100, 40, 1500, 9]),
    "verify": ([8, 8, 8, 8], [600, 4100, 2000, 9]),
    "extend": ([40, 1, 33, 20], [300, 900, 33, 1100]),
}


def dev(x):
    import cupy

    return cupy.asarray(np.asarray(x, np.int32))


class Setup:
    def __init__(self, kind, fold="auto", dtype="bfloat16"):
        import cupy_fa

        self.rng, _ = new_rng()
        q, kv = BATCHES[kind]
        self.dtype = dtype
        self.step = device_step(self.rng, dtype, H, D, PAGE, q, kv)
        self.q_lens, self.kv_lens, self.table = self.step["q_lens"], self.step["kv_lens"], self.step["table"]
        self.width = self.table.shape[1]
        self.max_q = int(self.q_lens.max())
        self.attn = cupy_fa.BatchAttention(*H, D, dtype, max_batch_size=8, max_num_tokens=256,
                                           max_pages_per_request=self.width + 4, max_mask_bytes=4096)
        self.clean = self.run(self.q_lens, self.kv_lens, self.table)
        assert self.attn.status() == 0 and self.attn.status().ok
        assert_matches(self.clean, reference_of(self.step), dtype, self.q_lens, f"clean {kind}")

    def run(self, q_lens, kv_lens, table, max_q=None, max_kv=None, rows=None, **plan_kwargs):
        import cupy

        q = self.step["q"] if rows is None else self.step["q"][:rows]
        out = cupy.full_like(q, np.nan)
        self.attn.plan(dev(q_lens), dev(kv_lens), dev(table), max_q_len=max_q or self.max_q,
                       max_kv_len=self.width * PAGE if max_kv is None else max_kv, **plan_kwargs)
        self.attn.run(q, self.step["cache"], out=out)
        cupy.cuda.Device().synchronize()  # a fault would raise here and kill the context
        return out.get()

    def rows_of(self, b):
        cu = np.concatenate([[0], np.cumsum(self.q_lens)])
        return slice(int(cu[b]), int(cu[b + 1]))

    def expect(self, got, bad, reason, label):
        status = self.attn.status()
        assert not status.ok and status.request == bad and status.reason == reason, f"{label}: {status!r}"
        assert f"request {bad}:" in str(status)
        for b in range(len(self.q_lens)):
            rows = self.rows_of(b)
            if b == bad:
                assert np.isnan(got[rows].astype(np.float32)).all(), f"{label}: request {b}'s rows are not all NaN"
            else:
                assert np.array_equal(got[rows].view(np.uint16), self.clean[rows].view(np.uint16)), \
                    f"{label}: request {b} changed bits"


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("fold", ["0", "1"])
@pytest.mark.parametrize("page", ["huge", "negative", "num_pages"])
def test_page_id_outside_the_cache(kind, fold, page, monkeypatch):
    monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", fold)
    _reload_knobs()
    s = Setup(kind)
    bad = 1
    table = s.table.copy()
    value = {"huge": 10**8, "negative": -1, "num_pages": s.step["cache"].num_pages}[page]
    table[bad, 0] = value  # column 0: every row of the request reads it
    got = s.run(s.q_lens, s.kv_lens, table)
    s.expect(got, bad, 6, f"{kind} page {value}")
    # a page id past the request's kv_len is never read: no error
    table = s.table.copy()
    table[bad, -(-int(s.kv_lens[bad]) // PAGE):] = 10**8
    got = s.run(s.q_lens, s.kv_lens, table)
    assert s.attn.status() == 0 and np.array_equal(got.view(np.uint16), s.clean.view(np.uint16))


def test_page_id_outside_the_cache_long_family():
    """A request of more than 16 tokens (on sm_90a the wgmma family): a page id outside the cache
    is clamped into it (no fault), the status names the request, the rows of every work item that
    read it are NaN (the page is in column 2 of 300 keys at page 16: every causal row of its 40
    reads it, so all of them), the others keep their bits."""
    s = Setup("extend")
    table = s.table.copy()
    table[0, 2] = 10**8  # request 0: 40 tokens over 300 keys
    got = s.run(s.q_lens, s.kv_lens, table)
    status = s.attn.status()
    assert status.request == 0 and status.reason == 6, repr(status)
    assert np.isnan(got[s.rows_of(0)].astype(np.float32)).all(), "request 0's rows are not all NaN"
    for b in range(1, len(s.q_lens)):
        rows = s.rows_of(b)
        assert np.array_equal(got[rows].view(np.uint16), s.clean[rows].view(np.uint16)), f"request {b} changed bits"


def _reload_knobs():
    try:
        from cupy_fa import knobs

        knobs.reload()
    except (ImportError, AttributeError):
        pass


@pytest.mark.parametrize("kind", list(BATCHES))
def test_bad_lengths(kind):
    s = Setup(kind)
    b = 2
    kv = s.kv_lens.copy()
    kv[b] = s.width * PAGE + 5  # past the plan's max_kv_len (and the table)
    s.expect(s.run(s.q_lens, kv, s.table), b, 4, "kv_len past max_kv_len")
    # past the table's columns only (the plan bound is loose): the kernel checks the width
    s.expect(s.run(s.q_lens, kv, s.table, max_kv=2**31 - 1), b, 5, "kv_len past the page table")
    kv[b] = int(s.q_lens[b]) - 1  # q_len > kv_len
    s.expect(s.run(s.q_lens, kv, s.table), b, 2, "q_len > kv_len")
    kv[b] = -7
    s.expect(s.run(s.q_lens, kv, s.table), b, 2, "kv_len negative")
    q = s.q_lens.copy()
    q[b] = -3
    got = s.run(q, s.kv_lens, s.table)  # its tokens count 0: the rows after it move up
    status = s.attn.status()
    assert status.request == b and status.reason == 1, repr(status)
    last = len(s.q_lens) - 1
    q = s.q_lens.copy()
    q[last] = 10**6  # past max_q_len: counted as max_q_len tokens, past the rows of q
    got = s.run(q, s.kv_lens, s.table)
    s.expect(got, last, 3, "q_len past max_q_len")


def test_rows_past_q_and_mask_too_small():
    import cupy

    s = Setup("verify")
    rows = int(s.q_lens.sum()) - 8  # the last request's rows are not in q
    got = s.run(s.q_lens, s.kv_lens, s.table, rows=rows)
    status = s.attn.status()
    assert status.request == 3 and status.reason == 7, repr(status)
    for b in range(3):
        assert np.array_equal(got[s.rows_of(b)].view(np.uint16), s.clean[s.rows_of(b)].view(np.uint16))
    # a tree mask shorter than the device lengths need: the requests past its end are refused
    mask = cupy.ones(2 * 64, cupy.uint8)  # two of four q_len = 8 blocks
    out = cupy.full_like(s.step["q"], np.nan)
    s.attn.plan(dev(s.q_lens), dev(s.kv_lens), dev(s.table), max_q_len=8, max_kv_len=s.width * PAGE,
                custom_mask=mask)
    s.attn.run(s.step["q"], s.step["cache"], out=out)
    cupy.cuda.Device().synchronize()
    status = s.attn.status()
    assert status.request == 2 and status.reason == 8, repr(status)
    got = out.get()
    for b in (2, 3):
        assert np.isnan(got[s.rows_of(b)].astype(np.float32)).all()


def test_check_raises_naming_the_request(monkeypatch):
    s = Setup("decode")
    kv = s.kv_lens.copy()
    kv[3] = 0
    with pytest.raises(ValueError, match=r"request 3: q_len is above kv_len"):
        s.run(s.q_lens, kv, s.table, check=True)
    table = s.table.copy()
    table[2, 0] = 10**8
    with pytest.raises(ValueError, match=r"request 2: a page id it reads is not a page of the cache"):
        s.run(s.q_lens, s.kv_lens, table, check=True)
    got = s.run(s.q_lens, s.kv_lens, s.table, check=True)  # a clean step passes the check
    assert np.array_equal(got.view(np.uint16), s.clean.view(np.uint16))
    monkeypatch.setenv("CUPY_FA_DEBUG", "1")
    _reload_knobs()
    with pytest.raises(ValueError, match=r"request 2: a page id"):
        s.run(s.q_lens, s.kv_lens, table)
    monkeypatch.delenv("CUPY_FA_DEBUG")
    _reload_knobs()
    s.run(s.q_lens, s.kv_lens, table)  # off again: no raise, the status says it
    assert s.attn.status().request == 2


def test_graph_runner_garbage_then_clean(monkeypatch):
    """Through a captured graph: garbage device metadata in one replay, a clean one after; the
    context survives and the status resets with the next plan; with CUPY_FA_DEBUG=1 the replay
    raises naming the request."""
    import cupy
    import cupy_fa
    from cupy_fa import ForwardMode

    rng, _ = new_rng()
    q_lens, kv_lens = np.array([1, 1, 1, 1]), np.array([600, 2100, 40, 1500])
    step = device_step(rng, "bfloat16", H, D, PAGE, q_lens, kv_lens)
    width = step["table"].shape[1]
    runner = cupy_fa.GraphRunner(*H, D, "bfloat16", max_batch_size=4, max_q_len=4, max_pages_per_request=width,
                                 page_size=PAGE)
    clean = runner.run(ForwardMode.DECODE, step["q"], step["cache"], dev(q_lens), dev(kv_lens),
                       dev(step["table"])).get()
    assert runner.attn.status() == 0
    table = step["table"].copy()
    table[0, 1] = 1 << 30
    kv = kv_lens.copy()
    kv[3] = width * PAGE + 100
    got = runner.run(ForwardMode.DECODE, step["q"], step["cache"], dev(q_lens), dev(kv), dev(table)).get()
    cupy.cuda.Device().synchronize()
    status = runner.attn.status()
    assert status.request == 0 and status.reason == 6, repr(status)
    assert np.isnan(got[[0, 3]].astype(np.float32)).all()
    assert np.array_equal(got[1:3].view(np.uint16), clean[1:3].view(np.uint16))
    again = runner.run(ForwardMode.DECODE, step["q"], step["cache"], dev(q_lens), dev(kv_lens),
                       dev(step["table"])).get()
    assert runner.attn.status() == 0 and np.array_equal(again.view(np.uint16), clean.view(np.uint16))
    assert runner.num_graphs == 1
    monkeypatch.setenv("CUPY_FA_DEBUG", "1")
    _reload_knobs()
    try:
        with pytest.raises(ValueError, match=r"request 0: a page id it reads is not a page of the cache"):
            runner.run(ForwardMode.DECODE, step["q"], step["cache"], dev(q_lens), dev(kv_lens), dev(table))
        runner.run(ForwardMode.DECODE, step["q"], step["cache"], dev(q_lens), dev(kv_lens), dev(step["table"]))
        assert runner.status().ok
    finally:
        monkeypatch.delenv("CUPY_FA_DEBUG")
        _reload_knobs()


def test_graph_runner_cache_with_more_pages_at_the_same_address():
    """A cache with more pages at the address of one a graph was captured with (an engine that
    reallocates its cache, or a memory pool handing the address back) gets a graph of its own: its
    page ids are checked against its own page count. Replaying the first cache's graph checked them
    against the old count: every request reading a page past it came out NaN."""
    import cupy_fa
    from cupy_fa import ForwardMode

    rng, _ = new_rng()
    q_lens, kv_lens = np.array([1, 1, 1, 1]), np.array([600, 2100, 40, 1500])
    step = device_step(rng, "bfloat16", H, D, PAGE, q_lens, kv_lens)
    cache, width = step["cache"], step["table"].shape[1]
    runner = cupy_fa.GraphRunner(*H, D, "bfloat16", max_batch_size=4, max_q_len=4, max_pages_per_request=width,
                                 page_size=PAGE)
    first = cupy_fa.PagedKVCache(cache.k[:4], cache.v[:4])  # the first 4 pages, at the same address
    assert first.k.data.ptr == cache.k.data.ptr and first.num_pages == 4 < cache.num_pages
    runner.run(ForwardMode.DECODE, step["q"], first, dev([1, 1, 1, 1]), dev([PAGE] * 4), dev([[0], [1], [2], [3]]))
    assert runner.attn.status() == 0 and runner.num_graphs == 1
    got = runner.run(ForwardMode.DECODE, step["q"], cache, dev(q_lens), dev(kv_lens), dev(step["table"]))
    assert runner.attn.status() == 0 and runner.num_graphs == 2
    assert_matches(got, reference_of(step), "bfloat16", q_lens, "the larger cache at the same address")


def test_append_slots_outside_the_cache():
    import cupy
    import cupy_fa

    cache = cupy_fa.PagedKVCache.allocate(4, PAGE, H[1], D, "bfloat16")
    before = cache.k.copy()
    k_new = cupy.ones((4, H[1], D), cache.dtype)
    cache.append(k_new, k_new, cupy.array([1, -1, 10**9, 64], np.int64))  # padding, then two past the end
    cupy.cuda.Device().synchronize()
    status = cache.status()
    assert status.request == 2 and status.reason == 9 and "token 2: its slot is outside the cache" in str(status)
    assert cache.status().ok  # read and cleared
    flat_before, flat = before.reshape(-1, H[1], D), cache.k.reshape(-1, H[1], D)
    assert bool((flat[1] == 1).all()) and cupy.array_equal(flat[2:], flat_before[2:]) and \
        cupy.array_equal(flat[0], flat_before[0])
    cache.append(k_new[:2], k_new[:2], cupy.array([3, -5], np.int32))  # negative = padding: not an error
    cupy.cuda.Device().synchronize()
    assert cache.status().ok
