"""Every serving mode, eager and under CUDA-graph replay, over a simulated engine loop: every
request and row against float64 with its LSE, the runner's whole static output poisoned before
each run and its tail past the live rows checked untouched, eager == graph bit for bit."""

import json
import os
from typing import NamedTuple

import numpy as np
import pytest

from cases import POISON, TOL, check_attention, holey_masks, new_rng, paged_case, torch_randn, tree_masks

from cupy_fa.modes import ForwardMode, contract_lengths, from_sglang

M = ForwardMode


def report(**row):
    """Appends a result row for the device run's table (scripts/device_check.sh)."""
    path = os.environ.get("CUPY_FA_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


class Engine:
    """A toy engine: requests with growing prefixes over a paged cache whose
    pages are handed out from a shuffled free list (so requests interleave)."""

    def __init__(self, rng, dtype, heads, head_dim, page_size, num_pages=600):
        import cupy_fa
        from cupy_fa import _arrays

        self.rng, self.dtype, self.page_size = rng, _arrays.DTYPES[dtype], page_size
        self.h_q, self.h_kv, self.d = heads[0], heads[1], head_dim
        self.cache = cupy_fa.PagedKVCache.allocate(num_pages, page_size, self.h_kv, head_dim, dtype)
        # unwritten slots hold NaN: reading past kv_len or a wrong page shows up
        self.cache.k.fill(np.nan)
        self.cache.v.fill(np.nan)
        self.free = list(rng.permutation(num_pages))
        self.pages = {}    # request id -> page list
        self.length = {}   # request id -> tokens cached

    def add(self, rid):
        self.pages[rid], self.length[rid] = [], 0

    def commit(self, rids, new_lens):
        """The step is done: its tokens are now part of each request's prefix."""
        for rid, n in zip(rids, new_lens):
            self.length[rid] += int(n)

    def new_slots(self, rids, new_lens):
        """The slots of the new tokens (positions length .. length+new-1) of each request, pages
        taken from the free list as they are needed."""
        slots = []
        for rid, n in zip(rids, new_lens):
            for pos in range(self.length[rid], self.length[rid] + int(n)):
                if pos // self.page_size >= len(self.pages[rid]):
                    self.pages[rid].append(self.free.pop())
                slots.append(self.pages[rid][pos // self.page_size] * self.page_size + pos % self.page_size)
        return slots

    def write(self, rids, new_lens):
        """Writes K/V of the new tokens (positions length .. length+new-1) of each request."""
        import cupy

        slots = self.new_slots(rids, new_lens)
        if not slots:
            return
        shape = (len(slots), self.h_kv, self.d)
        k = self.rng.standard_normal(shape, dtype=np.float32).astype(self.dtype)
        v = self.rng.standard_normal(shape, dtype=np.float32).astype(self.dtype)
        self.cache.append(cupy.asarray(k), cupy.asarray(v), np.array(slots, np.int64))

    def table(self, rids, width):
        t = np.zeros((len(rids), width), np.int32)
        for i, rid in enumerate(rids):
            t[i, :len(self.pages[rid])] = self.pages[rid]
        return t

    def queries(self, total):
        return self.rng.standard_normal((total, self.h_q, self.d), dtype=np.float32).astype(self.dtype)


N_DRAFT = 4
MAX_Q = 16


def schedule(rng):
    """(mode, active request ids, extra) per step: prefixes grow, accepted counts
    vary, batches shrink and grow across buckets (1, 2, 4, 8)."""
    steps = [(M.EXTEND, list(range(5)), None)]
    steps += [(M.DECODE, list(range(5)), None), (M.DECODE, [0, 2, 4], None)]
    steps += [(M.TARGET_VERIFY, [0, 1, 2, 3, 4], None), (M.DRAFT_EXTEND, [0, 1, 2, 3, 4], None)]
    steps += [(M.DRAFT_EXTEND_V2, [0, 1, 2, 3, 4], None), (M.IDLE, [], None)]
    steps += [(M.EXTEND, [5, 6], None), (M.MIXED, [0, 1, 2, 5, 6], None)]
    steps += [(M.TARGET_VERIFY, [0, 1, 2, 3, 4, 5, 6], "tree"), (M.DRAFT_EXTEND_V2, [6], None)]
    steps += [(M.TARGET_VERIFY, [0, 2, 4, 6], "holes")]
    steps += [(M.DECODE, list(range(7)), None), (M.DRAFT_EXTEND_V2, [0, 1, 2, 3, 4, 5, 6], None)]
    return steps


def step_lengths(rng, engine, mode, rids, max_q=MAX_Q):
    prefix = np.array([engine.length[r] for r in rids], np.int64)
    if mode is M.EXTEND:
        new = np.array([int(rng.integers(1, max_q + 1)) for _ in rids])
        return contract_lengths(mode, prefix_lens=prefix, new_lens=new)
    if mode is M.MIXED:
        new = np.array([1 if rng.random() < 0.5 else int(rng.integers(2, max_q + 1)) for _ in rids])
        return contract_lengths(mode, prefix_lens=prefix, new_lens=new)
    if mode is M.DRAFT_EXTEND:
        accepted = np.array([int(rng.integers(1, N_DRAFT + 2)) for _ in rids])
        return contract_lengths(mode, prefix_lens=prefix, accepted_lens=accepted)
    return contract_lengths(mode, prefix_lens=prefix, num_draft_tokens=N_DRAFT)


# (dtype, head dim, (H_q, H_kv), page size, the runner's max_q_len). The first 16: every dtype, head
# dim 64 / 128, both head layouts, page sizes 1 and 16, small-q tiles only (max_q_len 16). Then
# page sizes 3 and 48 (the kernels divide rather than shift), page 64, head dim 256, and runners
# of max_q_len 40: device-planned EXTEND and MIXED steps of more than 16 tokens (the prefill tile,
# which the verify steps of those runners run on too).
ENGINE_CONFIGS = [(dtype, d, heads, page, MAX_Q) for dtype in ("float16", "bfloat16") for d in (64, 128)
                  for heads in ((32, 8), (8, 1)) for page in (1, 16)] + [
    ("bfloat16", 128, (32, 8), 3, MAX_Q), ("float16", 64, (8, 1), 3, 40),
    ("float16", 128, (32, 8), 48, MAX_Q), ("bfloat16", 64, (8, 1), 48, 40),
    ("bfloat16", 128, (32, 8), 64, MAX_Q), ("float16", 256, (8, 1), 64, 40),
    ("bfloat16", 256, (32, 8), 16, 40), ("float16", 256, (16, 2), 3, MAX_Q),
    ("float16", 128, (32, 8), 1, 40), ("bfloat16", 128, (8, 1), 48, 40),
]


def poison(runner):
    runner.out.fill(POISON)
    runner.lse.fill(POISON)


def engine_setup(rng, engine):
    """Seven requests, five and then two of them prefilled with long prefixes (split-KV and the
    merge from the first steps on)."""
    for rid in range(7):
        engine.add(rid)
    for rids, lens in ((list(range(5)), [int(rng.integers(0, 1500)) for _ in range(5)]), ([5, 6], [0, 700])):
        engine.write(rids, lens)
        engine.commit(rids, lens)


class EngineStep(NamedTuple):
    mode: ForwardMode
    name: str          # the mode, with _TREE / _TREE_HOLES for the custom-mask verify steps
    q_lens: np.ndarray
    kv_lens: np.ndarray
    table: np.ndarray
    total: int         # query rows of the step
    q: object          # the step's queries (CuPy)
    mask: object       # the flat custom mask (host) or None
    eager: tuple       # (out, lse) of the eager run, host copies of the whole static buffers
    graph: tuple       # the same of the measured replay
    view: object       # the replay's returned out and lse views
    lse_view: object


def engine_steps(rng, engine, runner, max_q, max_pages, **run_kw):
    """`schedule`'s steps over `engine` (after engine_setup) through `runner`, each run eagerly from
    host inputs, then replayed from device inputs (a first use of a bucket captures first) with no
    host sync allowed, the static outputs poisoned before each run that is kept. Yields an
    EngineStep per step for the caller to check; the step's tokens are committed when the caller
    asks for the next one. ``run_kw`` goes to every run (e.g. sinks=)."""
    import cupy
    import cupyx

    for mode, rids, extra in schedule(rng):
        q_lens, kv_lens = step_lengths(rng, engine, mode, rids, max_q)
        engine.write(rids, q_lens)  # K/V of this step's tokens are written before attention
        table = engine.table(rids, max_pages)
        total = int(np.sum(q_lens))
        q = cupy.asarray(engine.queries(total))
        masks = {"tree": tree_masks, "holes": holey_masks}.get(extra)
        mask = np.concatenate([m.ravel() for m in masks(rng, q_lens)]) if masks else None
        poison(runner)  # the whole static output: the live rows must be rewritten, the tail left alone
        runner.run(mode, q, engine.cache, q_lens, kv_lens, table, custom_mask=mask, use_graph=False, return_lse=True,
                   **run_kw)
        cupy.cuda.get_current_stream().synchronize()
        eager = runner.out.get(), runner.lse.get()
        # replay: device inputs, no host sync allowed (first use of a bucket captures outside this block)
        args = (mode, q, engine.cache, cupy.asarray(q_lens, np.int32), cupy.asarray(kv_lens, np.int32),
                cupy.asarray(table))
        dev_mask = None if mask is None else cupy.asarray(mask)
        runner.run(*args, custom_mask=dev_mask, return_lse=True, **run_kw)
        poison(runner)  # then the measured replay must rewrite every live row and leave the tail
        with cupyx.allow_synchronize(False):
            view, lse_view = runner.run(*args, custom_mask=dev_mask, return_lse=True, **run_kw)
        cupy.cuda.get_current_stream().synchronize()
        graph = runner.out.get(), runner.lse.get()
        name = mode.name + ({"tree": "_TREE", "holes": "_TREE_HOLES"}.get(extra, ""))
        yield EngineStep(mode, name, q_lens, kv_lens, table, total, q, mask, eager, graph, view, lse_view)
        engine.commit(rids, q_lens)


def check_engine_step(step, engine, dtype, label, on_check=None, **ref_kw):
    """One EngineStep checked: its eager run and its measured replay each against float64
    (cupy_fa.reference.paged_attention over the engine's cache with ``ref_kw``; an IDLE step has
    no rows and nothing may be written), every check printed and asserted, then the two runs bit
    for bit. ``on_check(path, check)`` runs after a check's summary, before its assertion.
    Returns the replay's check."""
    from cupy_fa import reference

    if step.total:
        ref, ref_lse = reference.paged_attention(step.q.get(), engine.cache.k.get(), engine.cache.v.get(),
                                                 step.q_lens, step.kv_lens, step.table, custom_mask=step.mask,
                                                 return_lse=True, **ref_kw)
    else:  # IDLE: no rows, nothing may be written
        assert step.mode is M.IDLE
        heads, head_dim = step.eager[0].shape[1:]
        ref, ref_lse = np.zeros((0, heads, head_dim)), np.zeros((0, heads))
    for path, (out, lse) in (("eager", step.eager), ("graph", step.graph)):
        check = check_attention(out, ref, dtype, q_lens=step.q_lens, lse=lse, ref_lse=ref_lse, poison=POISON,
                                label=f"{label} {step.name} {path}")
        print(check.summary())
        if on_check is not None:
            on_check(path, check)
        check.assert_ok()
    eager, graph = step.eager, step.graph
    assert np.array_equal(eager[0].view(np.uint16), graph[0].view(np.uint16)), f"{step.name}: eager != graph bits"
    assert np.array_equal(eager[1].view(np.uint32), graph[1].view(np.uint32)), f"{step.name}: eager != graph LSE"
    return check


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,heads,page_size,max_q", ENGINE_CONFIGS,
                         ids=lambda c: str(c).replace(" ", "").replace("(", "").replace(")", "").replace(",", "x")
                         if isinstance(c, tuple) else str(c))
def test_engine_loop_eager_and_graph(dtype, head_dim, heads, page_size, max_q):
    import cupy_fa

    rng, seed = new_rng()
    engine = Engine(rng, dtype, heads, head_dim, page_size, num_pages=(12000 // page_size) + 64)
    max_pages = -(-2600 // page_size)
    runner = cupy_fa.GraphRunner(heads[0], heads[1], head_dim, dtype, max_batch_size=8, max_q_len=max_q,
                                 max_pages_per_request=max_pages, page_size=page_size, tree_mask=True)
    engine_setup(rng, engine)  # long prefixes from the start so split-KV and the merge are exercised too
    assert max(engine.length.values()) > 512
    for step in engine_steps(rng, engine, runner, max_q, max_pages):
        assert step.view.shape == (step.total, heads[0], head_dim) and step.lse_view.shape == (step.total, heads[0])
        check_engine_step(step, engine, dtype, f"seed {seed}", causal=True,
                          on_check=lambda path, check, name=step.name: report(
                              mode=name, path=path, err=check.worst.get("request_rel", (0.0,))[0], dtype=dtype,
                              page=page_size, heads=heads, d=head_dim))
    # buckets 1, 2, 4 and 8 were all captured, once per mode
    assert runner.num_graphs >= 8


@pytest.mark.gpu
@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
def test_draft_extend_v2_prefix_only_extent_is_caught(use_graph):
    """Negative control for the seed bug: kv_len = prefix only (the draft keys
    already written but not visible) must fail the comparison, in both paths."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, _ = new_rng()
    engine = Engine(rng, "bfloat16", (32, 8), 128, 16)
    runner = cupy_fa.GraphRunner(32, 8, 128, "bfloat16", max_batch_size=4, max_q_len=N_DRAFT,
                                 max_pages_per_request=64, page_size=16)
    rids = [0, 1, 2]
    for rid in rids:
        engine.add(rid)
    engine.write(rids, [300, 57, 900])
    engine.commit(rids, [300, 57, 900])
    prefix = np.array([engine.length[r] for r in rids])
    right_q, right_kv = contract_lengths(M.DRAFT_EXTEND_V2, prefix_lens=prefix, num_draft_tokens=N_DRAFT)
    sg_q, sg_kv = from_sglang(M.DRAFT_EXTEND_V2, prefix + N_DRAFT, num_draft_tokens=N_DRAFT)
    assert np.array_equal(sg_kv, right_kv) and np.array_equal(sg_q, right_q)
    engine.write(rids, right_q)
    table = engine.table(rids, 64)
    q = cupy.asarray(engine.queries(int(right_q.sum())))
    ref = reference.paged_attention(q.get(), engine.cache.k.get(), engine.cache.v.get(), right_q, right_kv, table)
    good = runner.run(M.DRAFT_EXTEND_V2, q, engine.cache, right_q, right_kv, table, use_graph=use_graph).get()
    check_attention(good, ref, "bfloat16", q_lens=right_q).assert_ok()
    wrong_kv = prefix  # the seed bug: sglang's TARGET_VERIFY convention applied to DRAFT_EXTEND_V2
    bad = runner.run(M.DRAFT_EXTEND_V2, q, engine.cache, right_q, wrong_kv, table, use_graph=use_graph).get()
    err = reference.relative_error(bad.astype(np.float64), ref)
    report(mode="DRAFT_EXTEND_V2_prefix_only_negative_control", path="graph" if use_graph else "eager", err=err,
           dtype="bfloat16", page=16, heads=(32, 8), d=128)
    assert err > 10 * TOL["bfloat16"], f"the wrong extent went unnoticed (error {err:.2e})"
    check = check_attention(bad, ref, "bfloat16", q_lens=right_q)
    caught = {int(line.split()[1]) for line in check.failing("request")}
    assert caught == set(range(len(rids))), f"every request is wrong, the checker named {sorted(caught)}"


@pytest.mark.gpu
def test_idle_and_fully_padded_bucket():
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    cache = cupy_fa.PagedKVCache.allocate(16, 16, 2, 64, "float16")
    runner = cupy_fa.GraphRunner(8, 2, 64, "float16", max_batch_size=4, max_q_len=4, max_pages_per_request=4,
                                 page_size=16)
    out = runner.run(M.IDLE, cupy.zeros((0, 8, 64), np.float16), cache, [], [], np.zeros((0, 4), np.int32))
    assert out.shape == (0, 8, 64)
    # a bucket of padded rows only: the graph launches, reads nothing, writes nothing
    zeros = cupy.zeros(3, np.int32)
    for use_graph in (False, True):
        runner.out.fill(POISON)
        runner.lse.fill(POISON)
        res, lse = runner.run(M.DECODE, cupy.ones((3, 8, 64), np.float16), cache, zeros, zeros,
                              cupy.zeros((3, 4), np.int32), use_graph=use_graph, return_lse=True)
        assert res.shape == (3, 8, 64) and lse.shape == (3, 8)
        assert bool((runner.out == POISON).all()) and bool((runner.lse == POISON).all())


@pytest.mark.gpu
def test_inside_torch_cuda_graph():
    """The engine captures its own graph with torch.cuda.graph around plan + run."""
    import torch

    import cupy_fa
    from cupy_fa import reference

    rng, _ = new_rng()
    page_size, max_batch, max_pages = 16, 4, 40
    k = torch_randn(rng, (200, page_size, 8, 128), torch.bfloat16)
    v = torch_randn(rng, (200, page_size, 8, 128), torch.bfloat16)
    cache = cupy_fa.PagedKVCache(k, v)
    attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16", max_batch_size=max_batch, max_num_tokens=max_batch * 4,
                                  max_pages_per_request=max_pages)
    q_lens = torch.zeros(max_batch, dtype=torch.int32, device="cuda")
    kv_lens = torch.zeros(max_batch, dtype=torch.int32, device="cuda")
    table = torch.zeros(max_batch, max_pages, dtype=torch.int32, device="cuda")
    q = torch.zeros(max_batch * 4, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    lse = torch.zeros(max_batch * 4, 32, device="cuda", dtype=torch.float32)

    def step():
        attn.plan(q_lens, kv_lens, table, max_q_len=4, max_kv_len=max_pages * page_size)
        attn.run(q, cache, out=out, lse=lse)

    def fill(batch):
        ql = np.full(batch, 4)
        kl = rng.integers(4, max_pages * page_size, size=batch)
        pages = rng.permutation(200)[:batch * max_pages].reshape(batch, max_pages)
        q_lens.zero_()
        kv_lens.zero_()
        q_lens[:batch] = torch.from_numpy(ql).to(torch.int32)
        kv_lens[:batch] = torch.from_numpy(kl).to(torch.int32)
        table[:batch] = torch.from_numpy(pages).to(torch.int32)
        q.copy_(torch_randn(rng, tuple(q.shape), torch.bfloat16))
        return ql, kl, pages

    fill(max_batch)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for batch in (4, 2, 3):  # the engine changes every length and page row between replays
        ql, kl, pages = fill(batch)
        out.fill_(POISON)  # the rows of the padded requests (past 4 x batch) must stay so
        lse.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = reference.paged_attention(q[:4 * batch].float().cpu().numpy(), k.float().cpu().numpy(),
                                                 v.float().cpu().numpy(), ql, kl, pages, return_lse=True)
        check = check_attention(out.float().cpu().numpy(), ref, "bfloat16", q_lens=ql, lse=lse.cpu().numpy(),
                                ref_lse=ref_lse, poison=POISON, label=f"torch graph, batch {batch}")
        print(check.summary())
        check.assert_ok()


def reference_without(refused, q_host, k_host, v_host, q_lens, kv_lens, table):
    """The float64 reference of every request but the refused ones (their rows: zeros, never compared)."""
    from cupy_fa import reference

    keep = np.ones(len(q_lens), bool)
    keep[list(refused)] = False
    rows = np.repeat(keep, q_lens)
    out, lse = reference.paged_attention(q_host[rows], k_host, v_host, np.where(keep, q_lens, 0), kv_lens, table,
                                         return_lse=True)
    full, full_lse = np.zeros(q_host.shape), np.zeros(q_host.shape[:2])
    full[rows], full_lse[rows] = out, lse
    return full, full_lse


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["device-plan", "runner-eager", "runner-graph"])
def test_refused_row_writes_nan(path):
    """A request with q_len > kv_len reaches the device only through device lengths (the graph path,
    which the host cannot check): plan.cu refuses it (status 1 + its index, reason q_len > kv_len),
    its rows of out and of the LSE are written NaN (never left stale; docs/errors.md) and every
    other request is right; the tail past the live rows is untouched. Through BatchAttention
    planned from device arrays and through a GraphRunner, eager and replayed."""
    import cupy
    import cupy_fa

    rng, seed = new_rng()
    q_lens, kv_lens = np.array([3, 5, 2, 1]), np.array([20, 3, 700, 1500])  # request 1: 5 > 3
    total, heads, d = int(q_lens.sum()), (8, 2), 128
    table, k_host, v_host, cache, q_host = paged_case(rng, "bfloat16", heads, d, 16, kv_lens, total)
    lens = [cupy.asarray(x, np.int32) for x in (q_lens, kv_lens, table)]
    q = cupy.asarray(q_host)
    if path == "device-plan":
        attn = cupy_fa.BatchAttention(*heads, d, "bfloat16")
        out = cupy.full((total + 3, heads[0], d), POISON, q.dtype)
        lse = cupy.full((total + 3, heads[0]), POISON, np.float32)
        attn.plan(*lens, max_q_len=int(q_lens.max()), max_kv_len=int(kv_lens.max()))
        attn.run(q, cache, out=out[:total], lse=lse[:total])
    else:
        runner = cupy_fa.GraphRunner(*heads, d, "bfloat16", max_batch_size=4, max_q_len=int(q_lens.max()),
                                     max_pages_per_request=table.shape[1], page_size=16)
        attn, out, lse = runner.attn, runner.out, runner.lse
        if path == "runner-graph":
            runner.run(M.EXTEND, q, cache, *lens)  # captures (and runs once)
        out.fill(POISON)
        lse.fill(POISON)
        runner.run(M.EXTEND, q, cache, *lens, use_graph=path == "runner-graph", return_lse=True)
    status = attn.status()
    assert status == 2 and status.reason == 2, f"status {status!r}: plan.cu must flag request 1 (1 + its index)"
    ref, ref_lse = reference_without([1], q_host, k_host, v_host, q_lens, kv_lens, table)
    got_out, got_lse = out.get(), lse.get()
    rows = slice(int(q_lens[0]), int(q_lens[:2].sum()))  # request 1's rows
    assert np.isnan(got_out[rows].astype(np.float32)).all() and np.isnan(got_lse[rows]).all(), \
        "the refused request's rows (out and lse) must be NaN"
    got_out[rows], got_lse[rows] = POISON, POISON  # then the checker holds everything else as before
    check = check_attention(got_out, ref, "bfloat16", q_lens=q_lens, lse=got_lse, ref_lse=ref_lse,
                            poison=POISON, refused=[1], label=f"seed {seed} {path}")
    print(check.summary())
    check.assert_ok()
