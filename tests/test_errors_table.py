"""docs/errors.md is a test: every row's case raises the exception the row names with a message
holding the row's words, and (GPU rows) leaves the cache, out and lse as they were. A row without
a case, a case without a row, or a row whose GPU mark disagrees with its case fails here."""

import ast
import pathlib
import re

import numpy as np
import pytest

import cupy_fa
from cupy_fa import ForwardMode, contract_lengths, from_sglang, reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "errors.md"
EXCEPTIONS = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError,
              "NotImplementedError": NotImplementedError}


def table_rows():
    """The rows of the table in docs/errors.md: dicts of entry, bad, raises, message, test."""
    rows, header = [], None
    text = TABLE.read_text()
    section = text[text.index("## The table"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        row = dict(zip(("entry", "bad", "raises", "message", "test"), cells))
        row["raises"], row["message"], row["test"] = (row[k].strip("`") for k in ("raises", "message", "test"))
        rows.append(row)
    assert header == ["entry point", "bad input", "raises", "message contains", "test"], header
    return rows


ROWS = table_rows()
CASES = {}  # name -> (needs a GPU, builder(ctx) -> (call, arrays that must stay as they were))


def case(name, gpu=False):
    def register(fn):
        assert name not in CASES, name
        CASES[name] = (gpu, fn)
        return fn
    return register


class Ctx:
    """What the cases build on: a monkeypatch, and on a GPU a small planned step."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def no_device(self):
        from cupy_fa import _arrays

        self.monkeypatch.setattr(_arrays, "_cuda_ready", False)
        self.monkeypatch.setattr(_arrays, "cuda_problem", lambda: "no NVIDIA driver was found (simulated here)")

    def gpu_step(self, dtype="bfloat16"):
        """A planned step: 2 requests (q 1 and 2, kv 5 and 20) over a 4-page cache of page 16,
        8 / 2 heads of 64; q, out (poisoned), lse (poisoned)."""
        import cupy

        rng = np.random.default_rng(0)
        self.cache = cupy_fa.PagedKVCache.allocate(4, 16, 2, 64, dtype)
        self.cache.k[...] = cupy.asarray(rng.standard_normal(self.cache.k.shape), self.cache.k.dtype)
        self.cache.v[...] = cupy.asarray(rng.standard_normal(self.cache.v.shape), self.cache.v.dtype)
        self.attn = cupy_fa.BatchAttention(8, 2, 64, dtype)
        self.attn.plan([1, 2], [5, 20], [[0, 1], [2, 3]])
        self.q = cupy.asarray(rng.standard_normal((3, 8, 64)), self.cache.k.dtype)
        self.out = cupy.full((3, 8, 64), np.nan, self.cache.k.dtype)
        self.lse = cupy.full((3, 8), np.nan, np.float32)
        cupy.cuda.Device().synchronize()
        return self

    @property
    def written(self):
        return [self.cache.k, self.cache.v, self.out, self.lse]


# ---- BatchAttention(...) ------------------------------------------------------------


@case("attn-heads")
def _(ctx):
    return lambda: cupy_fa.BatchAttention(0, 2, 64), []


@case("attn-group")
def _(ctx):
    return lambda: cupy_fa.BatchAttention(6, 4, 64), []


@case("attn-head-dim")
def _(ctx):
    return lambda: cupy_fa.BatchAttention(8, 2, 80), []


@case("attn-head-dim-pair")
def _(ctx):
    return lambda: cupy_fa.BatchAttention(8, 2, (192, 128)), []


@case("attn-dtype")
def _(ctx):
    return lambda: cupy_fa.BatchAttention(8, 2, 64, "float32"), []


@case("attn-kv-dtype")
def _(ctx):
    return lambda: cupy_fa.BatchAttention(8, 2, 64, "bfloat16", kv_dtype="float16"), []


@case("attn-some-capacities")
def _(ctx):
    return lambda: cupy_fa.BatchAttention(8, 2, 64, max_batch_size=4), []


@case("attn-capacity-value")
def _(ctx):
    return lambda: cupy_fa.BatchAttention(8, 2, 64, max_batch_size=0, max_num_tokens=4, max_pages_per_request=2), []


@case("attn-no-device")
def _(ctx):
    ctx.no_device()
    return lambda: cupy_fa.BatchAttention(8, 2, 64, max_batch_size=2, max_num_tokens=4, max_pages_per_request=2), []


# ---- BatchAttention.plan: host inputs, checked before the device is touched -------------


def _plan(*args, **kwargs):
    return lambda: cupy_fa.BatchAttention(8, 2, 64).plan(*args, **kwargs)


@case("plan-length-mismatch")
def _(ctx):
    return _plan([1, 2], [4], [[0]]), []


@case("plan-table-rows")
def _(ctx):
    return _plan([1, 2], [1, 3], [[0], [1], [2]]), []


@case("plan-negative")
def _(ctx):
    return _plan([-1], [3], [[0]]), []


@case("plan-q-above-kv")
def _(ctx):
    return _plan([1, 5], [1, 3], [[0], [1]]), []


@case("plan-float-lengths")
def _(ctx):
    return _plan([1], [1.5], [[0]]), []


@case("plan-lengths-ndim")
def _(ctx):
    return _plan([[1]], [1], [[0]]), []


@case("plan-table-ndim")
def _(ctx):
    return _plan([1], [1], [0]), []


@case("plan-table-ragged")
def _(ctx):
    return _plan([1, 2], [3, 4], [[0], [1, 2]]), []


@case("plan-causal-type")
def _(ctx):
    return _plan([1], [3], [[0]], causal="yes"), []


@case("plan-int32")
def _(ctx):
    return _plan([1], [2**31], [[0]]), []


@case("plan-sm-scale")
def _(ctx):
    return _plan([1], [4], [[0]], sm_scale=-1.0), []


@case("plan-window")
def _(ctx):
    return _plan([1], [4], [[0]], window=0), []


@case("plan-soft-cap")
def _(ctx):
    return _plan([1], [4], [[0]], logits_soft_cap=float("inf")), []


@case("plan-mask-size")
def _(ctx):
    return _plan([2], [4], [[0]], custom_mask=np.ones(3, bool)), []


@case("plan-no-device")
def _(ctx):
    ctx.no_device()
    return _plan([1, 2], [4, 9], [[0], [1]]), []


# ---- BatchAttention.plan: device inputs ---------------------------------------------------


@case("plan-host-device-mix", gpu=True)
def _(ctx):
    import cupy

    return _plan([1], cupy.array([4], np.int32), [[0]]), []


@case("plan-no-max-q-len", gpu=True)
def _(ctx):
    import cupy

    return _plan(cupy.array([1], np.int32), cupy.array([4], np.int32), cupy.zeros((1, 1), np.int32)), []


@case("plan-capacity", gpu=True)
def _(ctx):
    attn = cupy_fa.BatchAttention(8, 2, 64, max_batch_size=2, max_num_tokens=8, max_pages_per_request=2)
    return lambda: attn.plan([1, 1, 1], [4, 4, 4], [[0], [1], [2]]), []


def _with_split_size(split_size, fn):
    """fn() under CUPY_FA_SPLIT_SIZE = split_size (the knobs restored after)."""
    import dataclasses

    from cupy_fa import knobs

    def call():
        before = knobs.use(dataclasses.replace(knobs.knobs(), split_size=split_size))
        try:
            fn()
        finally:
            knobs.use(before)

    return call


@case("plan-fp8-split-size")
def _(ctx):  # 576 keys: a multiple of the 16-bit tiles' 64, not of the fp8 tiles' 128 (checked before anything is staged)
    attn = cupy_fa.BatchAttention(8, 2, 128, "bfloat16", kv_dtype="float8_e4m3fn")
    return _with_split_size(576, lambda: attn.plan([1, 2], [5, 20], [[0, 1], [2, 3]])), []


@case("plan-mask-dtype", gpu=True)
def _(ctx):
    import cupy

    return _plan([2], [4], [[0]], custom_mask=cupy.ones(4, np.float32)), []


# ---- BatchAttention.run -----------------------------------------------------------------


@case("run-before-plan")
def _(ctx):
    return lambda: cupy_fa.BatchAttention(8, 2, 64).run(np.zeros((1, 8, 64), np.float16), None), []


@case("run-cache-type", gpu=True)
def _(ctx):
    s = ctx.gpu_step()
    return lambda: s.attn.run(s.q, (s.cache.k, s.cache.v), out=s.out), s.written


@case("run-q-host", gpu=True)
def _(ctx):
    s = ctx.gpu_step()
    return lambda: s.attn.run(s.q.get(), s.cache, out=s.out), s.written


@case("run-q-tokens", gpu=True)
def _(ctx):
    s = ctx.gpu_step()
    return lambda: s.attn.run(s.q[:2], s.cache, out=s.out[:2]), s.written


@case("run-q-dtype", gpu=True)
def _(ctx):
    s = ctx.gpu_step()
    return lambda: s.attn.run(s.q.astype(np.float16), s.cache, out=s.out), s.written


@case("run-q-misaligned", gpu=True)
def _(ctx):
    import cupy

    s = ctx.gpu_step()
    flat = cupy.zeros(s.q.size + 1, s.q.dtype)
    flat[1:] = s.q.ravel()
    return lambda: s.attn.run(flat[1:].reshape(s.q.shape), s.cache, out=s.out), s.written


@case("run-cache-heads", gpu=True)
def _(ctx):
    s = ctx.gpu_step()
    other = cupy_fa.PagedKVCache.allocate(4, 16, 4, 64, "bfloat16")
    return lambda: s.attn.run(s.q, other, out=s.out), s.written


@case("run-cache-dtype", gpu=True)
def _(ctx):
    s = ctx.gpu_step()
    other = cupy_fa.PagedKVCache.allocate(4, 16, 2, 64, "float16")
    return lambda: s.attn.run(s.q, other, out=s.out), s.written


@case("run-out-shape", gpu=True)
def _(ctx):
    import cupy

    s = ctx.gpu_step()
    return lambda: s.attn.run(s.q, s.cache, out=cupy.zeros((3, 8, 32), s.q.dtype)), s.written


@case("run-out-strided", gpu=True)
def _(ctx):
    import cupy

    s = ctx.gpu_step()
    wide = cupy.full((3, 8, 128), np.nan, s.q.dtype)
    return lambda: s.attn.run(s.q, s.cache, out=wide[:, :, :64]), s.written + [wide]


@case("run-lse-dtype", gpu=True)
def _(ctx):
    import cupy

    s = ctx.gpu_step()
    return lambda: s.attn.run(s.q, s.cache, out=s.out, lse=cupy.zeros((3, 8), np.float16)), s.written


@case("run-sinks-host", gpu=True)
def _(ctx):
    s = ctx.gpu_step()
    return lambda: s.attn.run(s.q, s.cache, out=s.out, lse=s.lse, sinks=np.zeros(8, np.float32)), s.written


@case("run-sinks-dtype", gpu=True)
def _(ctx):
    import cupy

    s = ctx.gpu_step()
    return lambda: s.attn.run(s.q, s.cache, out=s.out, lse=s.lse, sinks=cupy.zeros(8, np.float16)), s.written


@case("run-sinks-shape", gpu=True)
def _(ctx):
    import cupy

    s = ctx.gpu_step()
    return lambda: s.attn.run(s.q, s.cache, out=s.out, lse=s.lse, sinks=cupy.zeros(7, np.float32)), s.written


@case("run-page-id", gpu=True)
def _(ctx):
    s = ctx.gpu_step()
    s.attn.plan([1, 2], [5, 20], [[0, 1], [2, 4]])  # page 4 of a 4-page cache
    return lambda: s.attn.run(s.q, s.cache, out=s.out), s.written


@case("run-table-width", gpu=True)
def _(ctx):
    s = ctx.gpu_step()
    s.attn.plan([1, 2], [40, 20], [[0, 1], [2, 3]])  # request 0 needs 3 pages of 16
    return lambda: s.attn.run(s.q, s.cache, out=s.out), s.written


@case("run-out-in-capture", gpu=True)
def _(ctx):
    import cupy

    s = ctx.gpu_step()
    s.attn.run(s.q, s.cache, out=cupy.empty_like(s.out))  # compiled, outside the capture
    cupy.cuda.Device().synchronize()

    def call():
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                s.attn.run(s.q, s.cache)
            finally:
                stream.end_capture()
    return call, s.written


@case("run-q-capacity", gpu=True)
def _(ctx):
    import cupy

    s = ctx.gpu_step()
    attn = cupy_fa.BatchAttention(8, 2, 64, max_batch_size=2, max_num_tokens=2, max_pages_per_request=2)
    attn.plan(cupy.array([1, 1], np.int32), cupy.array([5, 20], np.int32), cupy.array([[0, 1], [2, 3]], np.int32),
              max_q_len=1)
    return lambda: attn.run(s.q, s.cache, out=s.out), s.written


# ---- PagedKVCache ---------------------------------------------------------------------------


@case("cache-host")
def _(ctx):
    return lambda: cupy_fa.PagedKVCache(np.zeros((1, 1, 1, 8)), np.zeros((1, 1, 1, 8))), []


def _cache_of(k_shape, k_dtype, v_shape=None, v_dtype=None):
    import cupy

    k = cupy.zeros(k_shape, k_dtype)
    v = cupy.zeros(v_shape or k_shape, v_dtype or k_dtype)
    return lambda: cupy_fa.PagedKVCache(k, v), [k, v]


@case("cache-ndim", gpu=True)
def _(ctx):
    from cupy_fa import _arrays

    return _cache_of((4, 16, 64), _arrays.BFLOAT16)


@case("cache-dtype", gpu=True)
def _(ctx):
    return _cache_of((4, 16, 2, 64), np.float32)


@case("cache-v-shape", gpu=True)
def _(ctx):
    from cupy_fa import _arrays

    return _cache_of((4, 16, 2, 64), _arrays.BFLOAT16, (4, 16, 2, 32))


@case("cache-v-dtype", gpu=True)
def _(ctx):
    from cupy_fa import _arrays

    return _cache_of((4, 16, 2, 64), _arrays.BFLOAT16, v_dtype=np.float16)


@case("cache-head-dim", gpu=True)
def _(ctx):
    from cupy_fa import _arrays

    return _cache_of((4, 16, 2, 12), _arrays.BFLOAT16)


@case("allocate-dims")
def _(ctx):
    return lambda: cupy_fa.PagedKVCache.allocate(0, 16, 2, 64), []


@case("allocate-v-dim")
def _(ctx):
    return lambda: cupy_fa.PagedKVCache.allocate(4, 16, 2, 64, head_dim_v=32), []


@case("allocate-dtype")
def _(ctx):
    return lambda: cupy_fa.PagedKVCache.allocate(4, 16, 2, 64, dtype="float32"), []


@case("allocate-no-device")
def _(ctx):
    ctx.no_device()
    return lambda: cupy_fa.PagedKVCache.allocate(4, 16, 2, 64), []


def _append(ctx, tokens=2, heads=2, dtype=None, slots=None):
    import cupy

    s = ctx.gpu_step()
    kv_dtype = dtype or s.cache.k.dtype
    k_new = cupy.ones((tokens, heads, 64), kv_dtype)
    slots = [3, 64][:tokens] if slots is None else slots
    return lambda: s.cache.append(k_new, k_new.copy(), slots), s.written


@case("append-slot-range", gpu=True)
def _(ctx):
    return _append(ctx)  # 4 pages of 16: slot 64 is past the end


@case("append-slot-count", gpu=True)
def _(ctx):
    return _append(ctx, slots=[1, 2, 3])


@case("append-k-shape", gpu=True)
def _(ctx):
    return _append(ctx, heads=4, slots=[1, 2])


@case("append-k-dtype", gpu=True)
def _(ctx):
    return _append(ctx, dtype=np.float16, slots=[1, 2])


@case("append-slot-float", gpu=True)
def _(ctx):
    import cupy

    return _append(ctx, slots=cupy.array([1.0, 2.0]))


@case("append-slot-int16", gpu=True)
def _(ctx):
    import cupy

    return _append(ctx, slots=cupy.array([1, 2], np.int16))


# ---- GraphRunner ------------------------------------------------------------------------------


def _runner(**kwargs):
    sizes = dict(max_batch_size=4, max_q_len=4, max_pages_per_request=2, page_size=16)
    sizes.update(kwargs)
    return cupy_fa.GraphRunner(8, 2, 64, "bfloat16", **sizes)


@case("runner-sizes")
def _(ctx):
    return lambda: _runner(max_q_len=0), []


@case("runner-buckets")
def _(ctx):
    return lambda: _runner(max_batch_size=8, buckets=(1, 2)), []


@case("runner-heads")
def _(ctx):
    return lambda: cupy_fa.GraphRunner(6, 4, 64, max_batch_size=4, max_q_len=4, max_pages_per_request=2,
                                       page_size=16), []


@case("runner-fp8-split-size")
def _(ctx):
    return _with_split_size(576, lambda: _runner(kv_dtype="float8_e4m3fn")), []


@case("runner-window")
def _(ctx):
    return lambda: _runner(window=-2), []


@case("runner-mode")
def _(ctx):
    runner = object.__new__(cupy_fa.GraphRunner)  # the mode is read first: no buffers needed
    return lambda: runner.run("bogus", None, None, [1], [1], [[0]]), []


@case("runner-no-device")
def _(ctx):
    ctx.no_device()
    return lambda: _runner(), []


@case("modes-misspelled")
def _(ctx):
    return lambda: contract_lengths("decod", prefix_lens=[1]), []


def _runner_step(ctx, mode=ForwardMode.DECODE, q_lens=(1, 1), kv_lens=(5, 20), table=((0, 1), (2, 3)),
                 tokens=None, cache=None, **kwargs):
    import cupy

    s = ctx.gpu_step()
    runner = _runner(tree_mask=kwargs.pop("tree_mask", False))
    q = cupy.ones((sum(q_lens) if tokens is None else tokens, 8, 64), s.q.dtype)
    cache = s.cache if cache is None else cache
    written = s.written + [runner.out, runner.lse]
    return lambda: runner.run(mode, q, cache, list(q_lens), list(kv_lens), np.array(table), **kwargs), written


@case("runner-cache-type", gpu=True)
def _(ctx):
    return _runner_step(ctx, cache="not a cache")


@case("runner-page-size", gpu=True)
def _(ctx):
    return _runner_step(ctx, cache=cupy_fa.PagedKVCache.allocate(64, 1, 2, 64, "bfloat16"))


@case("runner-batch", gpu=True)
def _(ctx):
    return _runner_step(ctx, q_lens=(1,) * 5, kv_lens=(5,) * 5, table=((0, 1),) * 5)


@case("runner-q-bound", gpu=True)
def _(ctx):
    return _runner_step(ctx, q_lens=(2, 0), kv_lens=(5, 0))


@case("runner-q-tokens", gpu=True)
def _(ctx):
    return _runner_step(ctx, mode=ForwardMode.EXTEND, tokens=3)  # 3 <= 2 requests x max_q_len 4


@case("runner-table-width", gpu=True)
def _(ctx):
    return _runner_step(ctx, table=((0, 1, 2), (2, 3, 0)))


@case("runner-page-id", gpu=True)
def _(ctx):
    return _runner_step(ctx, table=((0, 1), (2, 7)))


@case("runner-mask", gpu=True)
def _(ctx):
    return _runner_step(ctx, mode=ForwardMode.EXTEND, q_lens=(1, 2), custom_mask=np.ones(5, bool), tree_mask=True)


@case("runner-sinks-shape", gpu=True)
def _(ctx):
    import cupy

    return _runner_step(ctx, sinks=cupy.zeros(3, np.float32))


@case("runner-in-capture", gpu=True)
def _(ctx):
    import cupy

    s = ctx.gpu_step()
    runner = _runner()
    lens = cupy.array([1, 1], np.int32), cupy.array([5, 20], np.int32), cupy.array([[0, 1], [2, 3]], np.int32)

    def call():
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                runner.run(ForwardMode.DECODE, s.q[:2], s.cache, *lens)
            finally:
                stream.end_capture()
    return call, s.written + [runner.out, runner.lse]


# ---- serving modes ------------------------------------------------------------------------------


@case("modes-missing")
def _(ctx):
    return lambda: contract_lengths("extend", prefix_lens=[1]), []


@case("modes-negative")
def _(ctx):
    return lambda: contract_lengths("decode", prefix_lens=[-1]), []


@case("modes-batch")
def _(ctx):
    return lambda: contract_lengths("extend", prefix_lens=[1, 2], new_lens=[1]), []


@case("modes-drafts")
def _(ctx):
    return lambda: contract_lengths("target_verify", prefix_lens=[1], num_draft_tokens=0), []


@case("modes-float")
def _(ctx):
    return lambda: contract_lengths("decode", prefix_lens=[1.5]), []


@case("modes-kinds", gpu=True)
def _(ctx):
    import cupy

    return lambda: contract_lengths("extend", prefix_lens=[1], new_lens=cupy.array([1])), []


@case("sglang-short")
def _(ctx):
    return lambda: from_sglang("draft_extend_v2", [2], num_draft_tokens=4), []


@case("sglang-mode")
def _(ctx):
    return lambda: from_sglang("bogus", [2]), []


@case("knobs-value")
def _(ctx):
    from cupy_fa import knobs

    return lambda: knobs.reload({"CUPY_FA_SPLIT_SIZE": "100"}), []


@case("knobs-use")
def _(ctx):
    from cupy_fa import knobs

    return lambda: knobs.use({"split_size": 512}), []


@case("warmup-no-device")
def _(ctx):
    ctx.no_device()
    return lambda: cupy_fa.warmup(), []


# ---- the reference ----------------------------------------------------------------------------------


def _ref(q_rows, q_lens, kv_lens, table, **kwargs):
    z = np.zeros((1, 4, 1, 8))
    return lambda: reference.paged_attention(np.zeros((q_rows, 1, 8)), z, z, q_lens, kv_lens, table, **kwargs), []


@case("ref-rows")
def _(ctx):
    return _ref(2, [1], [1], [[0]])


@case("ref-q-above-kv")
def _(ctx):
    return _ref(2, [2], [1], [[0]])


@case("ref-page-id")
def _(ctx):
    return _ref(1, [1], [1], [[3]])


@case("ref-mask")
def _(ctx):
    return _ref(2, [2], [2], [[0]], custom_mask=np.ones(3, bool))


@case("ref-window")
def _(ctx):
    return _ref(1, [1], [1], [[0]], window=0)


@case("ref-soft-cap")
def _(ctx):
    return _ref(1, [1], [1], [[0]], soft_cap=-3.0)


@case("ref-sinks")
def _(ctx):
    return _ref(1, [1], [1], [[0]], sinks=np.zeros(2))


# ---- the tests ------------------------------------------------------------------------------------


def _table_case(row):
    return row["test"][len("table:"):] if row["test"].startswith("table:") else None


def _params():
    out = []
    for row in ROWS:
        name = _table_case(row)
        if name is None:
            continue
        gpu = CASES.get(name, (False,))[0]
        out.append(pytest.param(row, id=name, marks=[pytest.mark.gpu] if gpu else []))
    return out


def _snapshot(arrays):
    from safety_cases import bits

    return [bits(a) for a in arrays]


@pytest.mark.parametrize("row", _params())
def test_row(row, monkeypatch):
    name = _table_case(row)
    assert name in CASES, f"docs/errors.md names case {name!r}; define it in {__file__}"
    gpu, build = CASES[name]
    assert gpu == ("(GPU)" in row["bad"]), f"{name}: the table's GPU mark and the case disagree"
    call, watched = build(Ctx(monkeypatch))
    before = _snapshot(watched)
    with pytest.raises(EXCEPTIONS[row["raises"]], match=re.escape(row["message"])):
        call()
    if watched:
        import cupy

        cupy.cuda.Device().synchronize()
        for i, (was, now) in enumerate(zip(before, _snapshot(watched))):
            assert np.array_equal(was, now), f"{name}: watched array {i} changed although the call raised"


def test_every_case_has_a_row_and_every_row_a_test():
    named = [_table_case(r) for r in ROWS if _table_case(r) is not None]
    assert len(named) == len(set(named)), "a case named by two rows"
    assert set(named) == set(CASES), (f"cases without a row: {sorted(set(CASES) - set(named))}; "
                                       f"rows without a case: {sorted(set(named) - set(CASES))}")
    for row in ROWS:
        assert row["raises"] in EXCEPTIONS, row
        assert row["message"], row
        assert row["test"].startswith("table:") or "::" in row["test"], row


@pytest.mark.parametrize("row", [r for r in ROWS if _table_case(r) is None], ids=lambda r: r["test"])
def test_row_tested_elsewhere(row):
    """A row backed by another test: that test exists, and asserts the row's words."""
    path, func = row["test"].split("::")
    source = (ROOT / path).read_text()
    names = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
    assert func in names, f"{path} has no {func}"
    assert row["message"] in source, f"{path} never checks the words {row['message']!r}"


def test_every_public_entry_point_has_rows():
    entries = {r["entry"].split("`")[1] if "`" in r["entry"] else r["entry"] for r in ROWS}
    for name in ("BatchAttention(...)", "BatchAttention.plan", "BatchAttention.run", "PagedKVCache(k, v)",
                 "PagedKVCache.allocate", "PagedKVCache.append", "GraphRunner(...)", "GraphRunner.run",
                 "contract_lengths", "from_sglang", "warmup", "reference.paged_attention", "knobs.use",
                 "merge_states", "reference.merge_states", "MLAAttention(...)", "MLAAttention.plan",
                 "MLAAttention.run", "PagedLatentCache(latent)", "reference.mla_attention"):
        assert name in entries, f"docs/errors.md has no row for {name}"
    public = set(cupy_fa.__all__)
    assert public <= {"BatchAttention", "ForwardMode", "GraphRunner", "PagedKVCache", "contract_lengths",
                      "from_sglang", "knobs", "merge_states", "reference", "warmup", "MLAAttention",
                      "PagedLatentCache", "BatchInvarianceWarning"}, \
        f"a new public name needs its rows: {public}"  # (the warning: its own section of docs/errors.md)
    assert "`cupy_fa.BatchInvarianceWarning`" in TABLE.read_text()
