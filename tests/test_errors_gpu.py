"""Every documented error on the GPU path: raised before anything is launched, naming the
argument, and nothing written: the cache's K and V, the output and the LSE buffers (and a
GraphRunner's static output) hold the same bytes after the error as before it."""

import numpy as np
import pytest

from cases import POISON, new_rng, np_dtype, paged_layout, poisoned

pytestmark = pytest.mark.gpu

H_Q, H_KV, D, PAGE = 4, 2, 64, 16


def refused(call, exc, match, *watched):
    """``call()`` raises ``exc`` matching ``match`` and leaves every array of ``watched`` as it was."""
    import cupy

    cupy.cuda.Device().synchronize()
    before = [w.get() for w in watched]
    with pytest.raises(exc, match=match):
        call()
    cupy.cuda.Device().synchronize()
    for i, (w, b) in enumerate(zip(watched, before)):
        assert w.get().tobytes() == b.tobytes(), f"watched array {i} changed after the refused call {match!r}"


@pytest.fixture
def world():
    """A random cache (every slot finite), a planned BatchAttention of fixed capacity, q, and
    poisoned out / lse buffers with a tail."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    q_lens, kv_lens = np.array([2, 3]), np.array([20, 3])
    table, num_pages = paged_layout(rng, kv_lens, PAGE)
    cache = random_cache(rng, num_pages)
    attn = cupy_fa.BatchAttention(H_Q, H_KV, D, "float16", max_batch_size=4, max_num_tokens=16,
                                  max_pages_per_request=8)
    attn.plan(q_lens, kv_lens, table)
    q = cupy.asarray(rng.standard_normal((5, H_Q, D), dtype=np.float32).astype(np.float16))
    out_buf = poisoned((5, H_Q, D), np.float16, 2)
    lse_buf = poisoned((5, H_Q), np.float32, 2)
    return dict(rng=rng, q_lens=q_lens, kv_lens=kv_lens, table=table, num_pages=num_pages, cache=cache, attn=attn,
                q=q, out=out_buf[:5], lse=lse_buf[:5], watched=(cache.k, cache.v, out_buf, lse_buf))


def test_run_rejects_bad_inputs(world):
    import cupy
    import cupy_fa

    w = world
    attn, q, cache, out, lse = w["attn"], w["q"], w["cache"], w["out"], w["lse"]
    misaligned = poisoned((6, H_Q, D), np.float16).ravel()[1:1 + 5 * H_Q * D].reshape(5, H_Q, D)
    cases = [
        (lambda: attn.run(q.astype(np.float32), cache, out=out), TypeError, "q must have dtype float16"),
        (lambda: attn.run(q[:4], cache, out=out), ValueError, "q has shape"),
        (lambda: attn.run(q, cache, out=out[:, :2]), ValueError, "out has shape"),
        (lambda: attn.run(q, cache, out=out.astype(np.float32)), TypeError, "out must have dtype float16"),
        (lambda: attn.run(q, cache, out=misaligned), ValueError, "out must start on a 8-byte boundary"),
        (lambda: attn.run(q, cache, out=out, lse=lse[:, :2]), ValueError, "lse has shape"),
        (lambda: attn.run(q, cache, out=out, lse=lse.astype(np.float16)), TypeError, "lse must have dtype float32, got float16"),
        (lambda: attn.run(q.get(), cache, out=out), TypeError, "q must be a CUDA device array"),
        (lambda: attn.run(cupy.zeros((5, H_Q, 2 * D), np.float16)[:, :, :D], cache, out=out), ValueError,
         "q must be C-contiguous"),
        (lambda: attn.run(q, cupy_fa.PagedKVCache.allocate(4, PAGE, 1, D, "float16"), out=out), ValueError,
         "num_kv_heads"),
        (lambda: attn.run(q, cupy_fa.PagedKVCache.allocate(4, PAGE, H_KV, D, "bfloat16"), out=out), TypeError,
         "cache dtype is bfloat16"),
        (lambda: attn.run(q, (cache.k, cache.v), out=out), TypeError, "must be a cupy_fa.PagedKVCache"),
    ]
    for call, exc, text in cases:
        refused(call, exc, text, *w["watched"])
    # page ids outside the cache / a table too short: caught before the kernel runs
    bad = w["table"].copy()
    bad[0, 0] = w["num_pages"] + 5
    attn.plan(w["q_lens"], w["kv_lens"], bad)
    refused(lambda: attn.run(q, cache, out=out), ValueError, r"page_table\[0, 0\] = .* is not a page", *w["watched"])
    attn.plan(w["q_lens"], w["kv_lens"], w["table"][:, :1])
    refused(lambda: attn.run(q, cache, out=out), ValueError, "page_table has 1 columns but request 0 needs 2 pages",
            *w["watched"])


def test_plan_rejects_bad_steps(world):
    """Capacity exceeded (batch, tokens, page-table columns, mask bytes), max_q_len missing for
    device lengths, host and device lengths mixed, custom_mask misuse; then the plan before the
    refused one still runs right."""
    import cupy

    w = world
    attn, table = w["attn"], w["table"]
    wide = np.zeros((2, 9), np.int32)
    cases = [
        (lambda: attn.plan(np.ones(5, int), np.ones(5, int) * 3, np.zeros((5, 1), np.int32)), ValueError,
         r"batch 5, .*exceeds the capacity"),
        (lambda: attn.plan(np.array([9, 8]), np.array([9, 8]), table), ValueError, r"tokens 17, .*exceeds the capacity"),
        (lambda: attn.plan(np.array([1, 1]), np.array([3, 3]), wide), ValueError,
         r"page-table columns 9, .*exceeds the capacity"),
        (lambda: attn.plan(np.array([2, 1]), np.array([5, 3]), table, custom_mask=np.ones(5, bool)), ValueError,
         r"mask bytes 5\) exceeds the capacity"),
        (lambda: attn.plan(cupy.asarray([2, 3], np.int32), cupy.asarray([20, 3], np.int32), cupy.asarray(table)),
         ValueError, "max_q_len is required"),
        (lambda: attn.plan(np.array([2, 3]), cupy.asarray([20, 3], np.int32), table, max_q_len=3), TypeError,
         "q_lens and kv_lens must both be host arrays or both device arrays"),
        (lambda: attn.plan(np.array([2, 3]), np.array([20, 3]), table, custom_mask=np.ones(3, bool)), ValueError,
         r"custom_mask has 3 entries, expected sum\(q_lens\*\*2\) = 13"),
        (lambda: attn.plan(cupy.asarray([2, 3], np.int32), cupy.asarray([20, 3], np.int32), cupy.asarray(table),
                           custom_mask=cupy.ones(13, np.float32), max_q_len=3), TypeError,
         "custom_mask must be bool or uint8"),
        (lambda: attn.plan(np.array([4, 3]), np.array([3, 3]), table), ValueError, r"q_lens\[0\] = 4 > kv_lens\[0\] = 3"),
        (lambda: attn.plan(np.array([2, 3]), np.array([20, 3]), table[:1]), ValueError, "page_table has 1 rows"),
    ]
    for call, exc, text in cases:
        refused(call, exc, text, *w["watched"])
    # the plan made before the refused ones is intact: it runs, and every row is written
    attn.run(w["q"], w["cache"], out=w["out"], lse=w["lse"])
    cupy.cuda.Device().synchronize()
    assert not (w["out"] == POISON).any().get() and bool(cupy.isfinite(w["out"]).all())


def test_device_planned_run_over_max_num_tokens(world):
    import cupy

    w = world
    attn = w["attn"]
    attn.plan(cupy.asarray([9, 8], np.int32), cupy.asarray([20, 8], np.int32), cupy.asarray(w["table"]), max_q_len=9)
    q = cupy.zeros((17, H_Q, D), np.float16)
    out = poisoned((17, H_Q, D), np.float16)
    refused(lambda: attn.run(q, w["cache"], out=out), ValueError, "q has 17 tokens, more than max_num_tokens 16",
            *w["watched"], out)


def test_capture_needs_out_lse_and_capacity(world):
    """Inside a CUDA-graph capture: out must be given, lse too when it is returned, and an
    auto-sized BatchAttention may not grow its buffers."""
    import cupy
    import cupy_fa

    w = world
    attn, q, cache = w["attn"], w["q"], w["cache"]
    stream = cupy.cuda.Stream(non_blocking=True)
    growing = cupy_fa.BatchAttention(H_Q, H_KV, D, "float16")
    growing.plan(np.array([1]), np.array([3]), w["table"][:1])  # buffers for one request
    lens = [cupy.asarray(x, np.int32) for x in (w["q_lens"], w["kv_lens"], w["table"])]
    for call, exc, text in [
        (lambda: attn.run(q, cache), ValueError, "out must be given when running inside a CUDA-graph capture"),
        (lambda: attn.run(q, cache, out=w["out"], return_lse=True), ValueError,
         "lse must be given to return it inside a CUDA-graph capture"),
        (lambda: growing.plan(*lens, max_q_len=3), ValueError, "exceeds the capacity"),
    ]:
        def captured():
            with stream:
                stream.begin_capture()
                try:
                    call()
                finally:
                    stream.end_capture()  # the partial graph is dropped
        refused(captured, exc, text, *w["watched"])


def random_cache(rng, num_pages, dtype="float16"):
    """A cache of random K/V in every slot (so any write shows)."""
    import cupy
    import cupy_fa

    cache = cupy_fa.PagedKVCache.allocate(num_pages, PAGE, H_KV, D, dtype)
    for arr in (cache.k, cache.v):
        arr[...] = cupy.asarray(rng.standard_normal(arr.shape, dtype=np.float32).astype(np_dtype(dtype)))
    return cache


def runner_world(rng):
    """Three verify requests of 4 drafts, and two runners for them: plain and tree-mask."""
    import cupy
    import cupy_fa

    q_lens, kv_lens = np.array([4, 4, 4]), np.array([30, 4, 50])
    table, num_pages = paged_layout(rng, kv_lens, PAGE)
    cache = random_cache(rng, num_pages)
    runners = []
    for tree in (False, True):
        runner = cupy_fa.GraphRunner(H_Q, H_KV, D, "float16", max_batch_size=4, max_q_len=4,
                                     max_pages_per_request=table.shape[1], page_size=PAGE, tree_mask=tree)
        runner.out.fill(POISON)
        runner.lse.fill(POISON)
        runners.append(runner)
    q = cupy.asarray(rng.standard_normal((12, H_Q, D), dtype=np.float32).astype(np.float16))
    return q_lens, kv_lens, table, cache, runners, q


def test_graph_runner_rejects_bad_steps():
    import cupy
    import cupy_fa
    from cupy_fa import ForwardMode as M

    rng, _ = new_rng()
    q_lens, kv_lens, table, cache, (runner, tree_runner), q = runner_world(rng)
    watched = (cache.k, cache.v, runner.out, runner.lse, tree_runner.out, tree_runner.lse)
    other_page = cupy_fa.PagedKVCache.allocate(8, 3, H_KV, D, "float16")
    mask = np.ones(3 * 16, bool)
    five = (np.full(5, 2), np.full(5, 4), np.zeros((5, table.shape[1]), np.int32))
    cases = [
        (lambda: runner.run(M.TARGET_VERIFY, q, other_page, q_lens, kv_lens, table), ValueError,
         "cache.page_size is 3, the runner was built for 16"),
        (lambda: runner.run(M.TARGET_VERIFY, q, cache, q_lens, kv_lens, table, custom_mask=mask), ValueError,
         "custom_mask is for TARGET_VERIFY on a runner built with tree_mask=True"),
        (lambda: tree_runner.run(M.DRAFT_EXTEND_V2, q, cache, q_lens, kv_lens, table, custom_mask=mask), ValueError,
         "custom_mask is for TARGET_VERIFY on a runner built with tree_mask=True"),
        (lambda: tree_runner.run(M.TARGET_VERIFY, q, cache, q_lens, kv_lens, table, custom_mask=mask[:-1]),
         ValueError, r"custom_mask has 47 entries, expected sum\(q_lens\*\*2\) = 48"),
        (lambda: runner.run(M.EXTEND, cupy.zeros((10, H_Q, D), np.float16), cache, *five), ValueError,
         "batch of 5 requests exceeds max_batch_size 4"),
        (lambda: runner.run(M.DECODE, q[:4], cache, np.array([2, 1, 1]), kv_lens, table), ValueError, "DECODE"),
        (lambda: runner.run(M.EXTEND, q[:11], cache, q_lens, kv_lens, table), ValueError,
         "q has 11 tokens, sum\\(q_lens\\) is 12"),
        (lambda: runner.run(M.EXTEND, q, cache, q_lens, kv_lens, np.zeros((3, table.shape[1] + 1), np.int32)),
         ValueError, r"page_table must be \[B, <= "),
        (lambda: runner.run(M.EXTEND, q, cache, np.array([4, 5, 3]), kv_lens, table), ValueError,
         r"q_lens\[1\] = 5 > kv_lens\[1\] = 4"),
        (lambda: runner.run("not a mode", q, cache, q_lens, kv_lens, table), ValueError, "not a mode"),
    ]
    for call, exc, text in cases:
        refused(call, exc, text, *watched)

    # a GraphRunner captures its own graphs: called inside another capture it refuses (device inputs,
    # so nothing needs the host), and the static output is untouched
    stream = cupy.cuda.Stream(non_blocking=True)
    lens = [cupy.asarray(x, np.int32) for x in (q_lens, kv_lens, table)]

    def nested():
        with stream:
            stream.begin_capture()
            try:
                runner.run(M.TARGET_VERIFY, q, cache, *lens)
            finally:
                stream.end_capture()
    refused(nested, RuntimeError, "captures its own graphs", *watched)


def test_append_rejects_bad_slots():
    """Slot count and dtype, host slots outside the cache, K/V rows of the wrong dtype or shape:
    refused, and the cache untouched (device slots that are negative or past the end are skipped
    rather than refused: tests/test_attention_gpu.py test_append_matches_slots)."""
    import cupy

    rng, _ = new_rng()
    cache = random_cache(rng, 8, "bfloat16")
    k_host = rng.standard_normal((3, H_KV, D), dtype=np.float32)
    k, k16 = cupy.asarray(k_host.astype(np_dtype("bfloat16"))), cupy.asarray(k_host.astype(np.float16))
    slots = np.array([0, 17, 100])
    cases = [
        (lambda: cache.append(k[:2], k[:2], slots), ValueError, "slots has 3 entries, k_new has 2 tokens"),
        (lambda: cache.append(k[:2], k[:2], cupy.asarray(slots)), ValueError, "slots has 3 entries, k_new has 2"),
        (lambda: cache.append(k, k, cupy.asarray(slots, np.float32)), TypeError, "slots must hold integers"),
        (lambda: cache.append(k, k, cupy.asarray(slots, np.int16)), TypeError, "slots must be int32 or int64"),
        (lambda: cache.append(k, k, np.array([0, 8 * PAGE, 1])), ValueError, r"slots\[1\] = 128 is outside the cache"),
        (lambda: cache.append(k, k, np.array([0, -1, 1])), ValueError, r"slots\[1\] = -1 is outside the cache"),
        (lambda: cache.append(k16, k16, slots), TypeError,
         "k_new must have dtype bfloat16"),
        (lambda: cache.append(k[:, :1], k[:, :1], slots), ValueError, "k_new has shape"),
        (lambda: cache.append(k, k[:2], slots), ValueError, "v_new has shape"),
        (lambda: cache.append(k.get(), k.get(), slots), TypeError, "k_new must be a CUDA device array"),
    ]
    for call, exc, text in cases:
        refused(call, exc, text, cache.k, cache.v)
