"""Every serving mode, eager and under CUDA-graph replay, over a simulated engine loop."""

import json
import os

import numpy as np
import pytest

from cases import TOL, new_rng, tree_masks

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

    def write(self, rids, new_lens):
        """Writes K/V of the new tokens (positions length .. length+new-1) of each request."""
        import cupy

        slots = []
        for rid, n in zip(rids, new_lens):
            for pos in range(self.length[rid], self.length[rid] + int(n)):
                if pos // self.page_size >= len(self.pages[rid]):
                    self.pages[rid].append(self.free.pop())
                slots.append(self.pages[rid][pos // self.page_size] * self.page_size + pos % self.page_size)
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
    steps += [(M.DECODE, list(range(7)), None), (M.DRAFT_EXTEND_V2, [0, 1, 2, 3, 4, 5, 6], None)]
    return steps


def step_lengths(rng, engine, mode, rids):
    prefix = np.array([engine.length[r] for r in rids], np.int64)
    if mode is M.EXTEND:
        new = np.array([int(rng.integers(1, MAX_Q + 1)) for _ in rids])
        return contract_lengths(mode, prefix_lens=prefix, new_lens=new)
    if mode is M.MIXED:
        new = np.array([1 if rng.random() < 0.5 else int(rng.integers(2, MAX_Q + 1)) for _ in rids])
        return contract_lengths(mode, prefix_lens=prefix, new_lens=new)
    if mode is M.DRAFT_EXTEND:
        accepted = np.array([int(rng.integers(1, N_DRAFT + 2)) for _ in rids])
        return contract_lengths(mode, prefix_lens=prefix, accepted_lens=accepted)
    return contract_lengths(mode, prefix_lens=prefix, num_draft_tokens=N_DRAFT)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_loop_eager_and_graph(dtype, head_dim, heads, page_size):
    import cupy
    import cupyx
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    engine = Engine(rng, dtype, heads, head_dim, page_size, num_pages=(12000 // page_size) + 64)
    max_pages = -(-2600 // page_size)
    runner = cupy_fa.GraphRunner(heads[0], heads[1], head_dim, dtype, max_batch_size=8, max_q_len=MAX_Q,
                                 max_pages_per_request=max_pages, page_size=page_size, tree_mask=True)
    for rid in range(7):
        engine.add(rid)
    # long prefixes from the start so split-KV and the merge are exercised too
    for rids, lens in ((list(range(5)), [int(rng.integers(0, 1500)) for _ in range(5)]), ([5, 6], [0, 700])):
        engine.write(rids, lens)
        engine.commit(rids, lens)
    assert max(engine.length.values()) > 512
    for mode, rids, extra in schedule(rng):
        q_lens, kv_lens = step_lengths(rng, engine, mode, rids)
        new = q_lens
        engine.write(rids, new)  # K/V of this step's tokens are written before attention
        table = engine.table(rids, max_pages)
        total = int(np.sum(q_lens))
        q = cupy.asarray(engine.queries(total))
        mask = np.concatenate([m.ravel() for m in tree_masks(rng, q_lens)]) if extra == "tree" else None
        eager = runner.run(mode, q, engine.cache, q_lens, kv_lens, table, custom_mask=mask, use_graph=False).copy()
        # replay: device inputs, no host sync allowed (first use of a bucket captures outside this block)
        args = (mode, q, engine.cache, cupy.asarray(q_lens, np.int32), cupy.asarray(kv_lens, np.int32),
                cupy.asarray(table))
        runner.run(*args, custom_mask=None if mask is None else cupy.asarray(mask))
        runner.out.fill(np.nan)  # poison, then the measured replay must rewrite every row
        with cupyx.allow_synchronize(False):
            graph = runner.run(*args, custom_mask=None if mask is None else cupy.asarray(mask))
        cupy.cuda.get_current_stream().synchronize()
        graph = graph.get()
        eager = eager.get()
        if total == 0:
            assert mode is M.IDLE and graph.shape[0] == 0
            report(mode=mode.name, path="eager", err=0.0, dtype=dtype, page=page_size, heads=heads, d=head_dim)
            report(mode=mode.name, path="graph", err=0.0, dtype=dtype, page=page_size, heads=heads, d=head_dim)
            continue
        ref = reference.paged_attention(q.get(), engine.cache.k.get(), engine.cache.v.get(), q_lens, kv_lens, table,
                                        causal=True, custom_mask=mask)
        for path, out in (("eager", eager), ("graph", graph)):
            assert np.isfinite(out.astype(np.float32)).all(), f"{mode.name} {path}: unwritten or NaN output"
            err = reference.relative_error(out.astype(np.float64), ref)
            report(mode=mode.name + ("_TREE" if mask is not None else ""), path=path, err=err, dtype=dtype,
                   page=page_size, heads=heads, d=head_dim)
            assert err < TOL[dtype], f"seed {seed} {mode.name} {path}: error {err:.2e}"
        assert np.array_equal(eager.view(np.uint16), graph.view(np.uint16)), f"{mode.name}: eager != graph bits"
        engine.commit(rids, new)
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
    assert reference.relative_error(good.astype(np.float64), ref) < TOL["bfloat16"]
    wrong_kv = prefix  # the seed bug: sglang's TARGET_VERIFY convention applied to DRAFT_EXTEND_V2
    bad = runner.run(M.DRAFT_EXTEND_V2, q, engine.cache, right_q, wrong_kv, table, use_graph=use_graph).get()
    err = reference.relative_error(bad.astype(np.float64), ref)
    report(mode="DRAFT_EXTEND_V2_prefix_only_negative_control", path="graph" if use_graph else "eager", err=err,
           dtype="bfloat16", page=16, heads=(32, 8), d=128)
    assert err > 10 * TOL["bfloat16"], f"the wrong extent went unnoticed (error {err:.2e})"


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
    runner.out.fill(np.nan)
    for use_graph in (False, True):
        res = runner.run(M.DECODE, cupy.ones((3, 8, 64), np.float16), cache, zeros, zeros,
                         cupy.zeros((3, 4), np.int32), use_graph=use_graph)
        assert bool(cupy.isnan(res).all())


@pytest.mark.gpu
def test_inside_torch_cuda_graph():
    """The engine captures its own graph with torch.cuda.graph around plan + run."""
    import torch

    import cupy_fa
    from cupy_fa import reference

    rng, _ = new_rng()
    page_size, max_batch, max_pages = 16, 4, 40
    k = torch.randn(200, page_size, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(200, page_size, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache = cupy_fa.PagedKVCache(k, v)
    attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16", max_batch_size=max_batch, max_num_tokens=max_batch * 4,
                                  max_pages_per_request=max_pages)
    q_lens = torch.zeros(max_batch, dtype=torch.int32, device="cuda")
    kv_lens = torch.zeros(max_batch, dtype=torch.int32, device="cuda")
    table = torch.zeros(max_batch, max_pages, dtype=torch.int32, device="cuda")
    q = torch.zeros(max_batch * 4, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q)

    def step():
        attn.plan(q_lens, kv_lens, table, max_q_len=4, max_kv_len=max_pages * page_size)
        attn.run(q, cache, out=out)

    def fill(batch):
        ql = np.full(batch, 4)
        kl = rng.integers(4, max_pages * page_size, size=batch)
        pages = rng.permutation(200)[:batch * max_pages].reshape(batch, max_pages)
        q_lens.zero_()
        kv_lens.zero_()
        q_lens[:batch] = torch.from_numpy(ql).to(torch.int32)
        kv_lens[:batch] = torch.from_numpy(kl).to(torch.int32)
        table[:batch] = torch.from_numpy(pages).to(torch.int32)
        q.copy_(torch.randn_like(q))
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
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.paged_attention(q[:4 * batch].float().cpu().numpy(), k.float().cpu().numpy(),
                                        v.float().cpu().numpy(), ql, kl, pages)
        got = out[:4 * batch].float().cpu().numpy()
        assert np.isfinite(got).all()
        assert reference.relative_error(got, ref) < TOL["bfloat16"]
