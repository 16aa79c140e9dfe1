"""Soak: a simulated serving engine on GraphRunner for thousands of steps, checked against the
float64 reference every N steps.

Requests arrive (some with a cached prefix, as a prefix-cache hit would leave them), prefill in
chunks (EXTEND), decode, verify speculative drafts (chain or tree) and keep a random number of
them (the rest is rolled back and its slots poisoned), run draft-extend steps (v1, v2), mix
prefill chunks with decode rows (MIXED), idle, and finish; their pages go back to a free list
and are handed to later requests (poisoned with NaN while free, so a read of a page or slot no
request owns shows up). Batches change size every step (graph buckets); lengths and page tables
go in as host arrays or as device arrays (the unchecked graph path) at random.

Every ``--check-every`` steps the step is checked: each request against the float64 reference
(``cupy_fa.reference``), the graph replay against the same step run eagerly (bit for bit), and
the device status word. Every ``--garbage-every`` steps one request of a device-input step gets
a page id outside the cache (the graph path's unchecked input): the step must not fault, the
status must name that request, its rows must be NaN and every other request must still match
the reference; the next steps go on as before. Reported: steps, checks, failures, graphs, steps per mode, and device
memory (CuPy's pool and the driver's count, after the pool gives back its free blocks; the
blocks it had cached are reported beside) at the start, after the warm-up, half way and at the
end; the run fails on any failure, on fewer steps than asked for within ``--max-seconds``, or on
memory that grows after the warm-up or in the second half.

Usage: python3 scripts/soak.py [--steps 10000] [--check-every 100] [--max-seconds 170] [--seed S]
"""

import argparse
import collections
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy_fa  # noqa: E402
from cupy_fa import ForwardMode, reference  # noqa: E402

HEADS, HEAD_DIM = (8, 2), 128
MAX_BATCH, MAX_Q, DRAFTS = 16, 24, 4
# bytes each memory count may move after the warm-up: live arrays must come back to the same
# count; the pool's cached blocks and the driver's count may shift by its block rounding
# (pool_held and device_used counted after the pool's free blocks are given back: memory())
MEMORY_SLACK = {"pool_used": 1 << 20, "pool_held": 16 << 20, "device_used": 16 << 20}


@dataclasses.dataclass
class Request:
    rid: int
    pages: list
    length: int       # tokens in the cache
    prompt_left: int  # prompt tokens not yet prefilled
    target: int       # finishes at this length
    reserved: int = 0  # pages set aside for it at arrival (admission control: no step runs out)


class Engine:
    def __init__(self, args, rng):
        import cupy

        self.args, self.rng = args, rng
        self.page_size = args.page_size
        self.num_pages = args.num_pages
        self.max_pages = args.max_context // self.page_size + 2
        self.cache = cupy_fa.PagedKVCache.allocate(self.num_pages, self.page_size, HEADS[1], HEAD_DIM, args.dtype)
        self.cache.k.fill(np.nan)
        self.cache.v.fill(np.nan)
        self.free = list(rng.permutation(self.num_pages))
        self.requests, self.next_id, self.reserved = [], 0, 0
        self.runner = cupy_fa.GraphRunner(*HEADS, HEAD_DIM, args.dtype, max_batch_size=MAX_BATCH, max_q_len=MAX_Q,
                                          max_pages_per_request=self.max_pages, page_size=self.page_size,
                                          tree_mask=True)
        self.dtype = self.cache.dtype
        self.k_flat = self.cache.k.reshape(-1, HEADS[1], HEAD_DIM)
        self.v_flat = self.cache.v.reshape(-1, HEADS[1], HEAD_DIM)
        self.cupy = cupy
        self.scratch_pages = -(-MAX_Q // self.page_size) + 1  # capture_all's request

    # ---- the cache ------------------------------------------------------------------

    def slots(self, req, start, count):
        """Slots of tokens start .. start + count - 1 of req, allocating pages as needed."""
        need = -(-(start + count) // self.page_size)
        while len(req.pages) < need:
            if not self.free:
                return None
            req.pages.append(int(self.free.pop()))
        pos = np.arange(start, start + count)
        return np.asarray(req.pages, np.int64)[pos // self.page_size] * self.page_size + pos % self.page_size

    def write(self, slots):
        cupy = self.cupy
        k = cupy.random.standard_normal((len(slots), HEADS[1], HEAD_DIM), np.float32).astype(self.dtype)
        v = cupy.random.standard_normal((len(slots), HEADS[1], HEAD_DIM), np.float32).astype(self.dtype)
        self.cache.append(k, v, slots)

    def poison(self, slots):
        if len(slots):
            idx = self.cupy.asarray(slots)
            self.k_flat[idx] = np.nan
            self.v_flat[idx] = np.nan

    def truncate(self, req, length):
        """Roll req back to length tokens: the slots past it are poisoned, whole pages freed."""
        if length >= req.length:
            return
        keep = -(-length // self.page_size)
        dropped = np.arange(length, req.length)
        self.poison(np.asarray(req.pages, np.int64)[dropped // self.page_size] * self.page_size
                    + dropped % self.page_size)
        self.free.extend(req.pages[keep:])
        del req.pages[keep:]
        req.length = length

    def finish(self, req):
        self.truncate(req, 0)
        self.requests.remove(req)
        self.reserved -= req.reserved

    def arrive(self):
        if len(self.requests) >= 3 * MAX_BATCH:
            return
        req = Request(self.next_id, [], 0, int(self.rng.integers(1, 200)), 0)
        self.next_id += 1
        cached = int(self.rng.choice([0, 0, int(self.rng.integers(1, self.args.max_context // 2))]))
        req.target = min(self.args.max_context - 2 * MAX_Q,
                         cached + req.prompt_left + int(self.rng.integers(1, 300)))
        # at most target + one step's tokens in the cache: reserve those pages or wait
        req.reserved = -(-(max(req.target, cached + req.prompt_left) + MAX_Q) // self.page_size) + 1
        if self.reserved + req.reserved > self.num_pages - self.scratch_pages:
            self.next_id -= 1
            return
        self.reserved += req.reserved
        if cached:  # a prefix-cache hit: the prefix is in the cache before the first step
            self.write(self.slots(req, 0, cached))
            req.length = cached
        self.requests.append(req)

    # ---- a step -----------------------------------------------------------------------

    def pick(self, candidates):
        if not candidates:
            return []
        n = int(self.rng.integers(1, min(MAX_BATCH, len(candidates)) + 1))
        return [candidates[i] for i in self.rng.choice(len(candidates), n, replace=False)]

    def plan_step(self):
        """(mode, requests, q_lens, tree) of the next step, its K/V not yet written."""
        prefilling = [r for r in self.requests if r.prompt_left > 0]
        decoding = [r for r in self.requests if r.prompt_left == 0]
        choices = ["idle"]
        if prefilling:
            choices += ["extend"] * 2 + (["mixed"] * 2 if decoding else [])
        if decoding:
            choices += ["decode"] * 3 + ["verify", "verify_tree", "draft_extend", "draft_extend_v2"]
        kind = str(self.rng.choice(choices))
        if kind == "idle":
            return ForwardMode.IDLE, [], [], False
        if kind == "extend":
            reqs = self.pick(prefilling)
            return ForwardMode.EXTEND, reqs, [min(r.prompt_left, int(self.rng.integers(1, MAX_Q + 1))) for r in reqs], False
        if kind == "mixed":
            reqs = self.pick(prefilling + decoding)
            q = [min(r.prompt_left, int(self.rng.integers(1, MAX_Q + 1))) if r.prompt_left else 1 for r in reqs]
            return ForwardMode.MIXED, reqs, q, False
        reqs = self.pick(decoding)
        if kind == "decode":
            return ForwardMode.DECODE, reqs, [1] * len(reqs), False
        if kind in ("verify", "verify_tree"):
            return ForwardMode.TARGET_VERIFY, reqs, [DRAFTS] * len(reqs), kind == "verify_tree"
        if kind == "draft_extend":
            return ForwardMode.DRAFT_EXTEND, reqs, [int(self.rng.integers(1, DRAFTS + 1)) for _ in reqs], False
        return ForwardMode.DRAFT_EXTEND_V2, reqs, [DRAFTS] * len(reqs), False

    def tree_mask(self, q_lens):
        masks = []
        for n in q_lens:
            parent = [-1] + [int(self.rng.integers(0, i)) for i in range(1, n)]
            m = np.zeros((n, n), bool)
            for i in range(n):
                j = i
                while j >= 0:
                    m[i, j] = True
                    j = parent[j]
            masks.append(m)
        return masks

    def step(self, check, garbage=False):
        """One engine step; returns (mode, failure text or None, checked). ``garbage``: a device-input
        step with one request's first page id outside the cache (checked too)."""
        cupy = self.cupy
        if self.rng.random() < 0.3:
            self.arrive()
        mode, reqs, q_lens, tree = self.plan_step()
        if mode is ForwardMode.IDLE:
            out = self.runner.run(mode, cupy.empty((0,) + HEADS[:1] + (HEAD_DIM,), self.dtype), self.cache,
                                  [], [], np.zeros((0, 1), np.int32))
            return mode, None if out.shape[0] == 0 else "IDLE returned rows", False
        for r, n in zip(reqs, q_lens):  # this step's K/V first, then attention over kv_len = length + n
            slots = self.slots(r, r.length, n)
            if slots is None:
                raise RuntimeError("soak: out of pages despite the reservations")
            self.write(slots)
            r.length += n
        q_lens = np.array(q_lens)
        kv_lens = np.array([r.length for r in reqs])
        table = np.zeros((len(reqs), max(-(-int(kv_lens.max()) // self.page_size), 1)), np.int32)
        for b, r in enumerate(reqs):
            pages = r.pages[:table.shape[1]]
            table[b, :len(pages)] = pages
        masks = self.tree_mask(q_lens) if tree else None
        flat = np.concatenate([m.ravel() for m in masks]) if tree else None
        q = cupy.random.standard_normal((int(q_lens.sum()),) + (HEADS[0], HEAD_DIM), np.float32).astype(self.dtype)
        lens = (q_lens.astype(np.int32), kv_lens.astype(np.int32), table)
        bad = None
        if garbage:  # one request's first page id outside the cache, on the unchecked device path
            # a request of the small-q family (q_len <= 16): its rows that read the bad page are NaN
            # (the sm_90a wgmma family, for longer ones, records the request but does not NaN its rows)
            small = [b for b, n in enumerate(q_lens) if n <= 16] or [0]
            bad = int(self.rng.choice(small))
            poisoned = table.copy()
            poisoned[bad, 0] = self.num_pages + int(self.rng.integers(0, 10**8))
            lens = tuple(cupy.asarray(x) for x in (lens[0], lens[1], poisoned))
        elif self.rng.random() < 0.5:  # the graph path's device inputs, unchecked by the host
            lens = tuple(cupy.asarray(x) for x in lens)
        out = self.runner.run(mode, q, self.cache, *lens, custom_mask=flat)
        failure = None
        if garbage:
            failure = self.check_garbage(mode, q, out, reqs, q_lens, kv_lens, table, masks, bad)
            check = True
        elif check:
            failure = self.check(mode, q, lens, flat, masks, out, reqs, q_lens, kv_lens, table)
        self.advance(mode, reqs, q_lens)
        return mode, failure, check

    def check(self, mode, q, lens, flat, masks, out, reqs, q_lens, kv_lens, table):
        cupy = self.cupy
        graph_bits = out.view(cupy.uint16).copy()
        eager = self.runner.run(mode, q, self.cache, *lens, custom_mask=flat, use_graph=False)
        if not bool(cupy.array_equal(graph_bits, eager.view(cupy.uint16))):
            return f"{mode.name}: graph replay and eager step differ"
        status = self.runner.status()
        if status != 0:
            return f"{mode.name}: device status {status!r}"
        ref = self.reference(q, reqs, q_lens, kv_lens, table, masks)
        got = np.asarray(eager.get(), np.float64)
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        tol = reference.TOL[self.args.dtype]
        for b in range(len(q_lens)):
            rows = slice(cu[b], cu[b + 1])
            err = reference.relative_error(got[rows], ref[rows])
            if not err < tol:
                return (f"{mode.name}: request {b} (q_len {q_lens[b]}, kv_len {kv_lens[b]}) relative error "
                        f"{err:.3g} > {tol}")
        return None

    def check_garbage(self, mode, q, out, reqs, q_lens, kv_lens, table, masks, bad):
        status = self.runner.status()
        if status.request != bad or status.reason != 6:
            return f"{mode.name}: a page id outside the cache in request {bad}, status says {status!r}"
        got = np.asarray(out.get(), np.float64)
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        if q_lens[bad] <= 16 and not np.isnan(got[cu[bad]:cu[bad + 1]]).all():
            return f"{mode.name}: request {bad} read a page outside the cache but its rows are not all NaN"
        ref = self.reference(q, reqs, q_lens, kv_lens, table, masks)
        tol = reference.TOL[self.args.dtype]
        for b in range(len(q_lens)):
            if b != bad:
                err = reference.relative_error(got[cu[b]:cu[b + 1]], ref[cu[b]:cu[b + 1]])
                if not err < tol:
                    return f"{mode.name}: request {b} beside the bad request {bad}: relative error {err:.3g}"
        return None

    def reference(self, q, reqs, q_lens, kv_lens, table, masks):
        cupy = self.cupy
        used = sorted({p for r in reqs for p in r.pages})  # the pages of this step, renumbered 0..n-1
        renumber = {p: i for i, p in enumerate(used)}
        index = cupy.asarray(np.array(used, np.int64))
        k, v = self.cache.k[index].get(), self.cache.v[index].get()
        small = np.vectorize(lambda p: renumber.get(int(p), 0))(table)
        return reference.paged_attention(q.get(), k, v, q_lens, kv_lens, small, custom_mask=masks)

    def advance(self, mode, reqs, q_lens):
        """What the engine does with the step's tokens: prompts move on, drafts are accepted or
        rolled back, requests that reach their length finish."""
        for r, n in zip(reqs, q_lens):
            if mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and r.prompt_left:
                r.prompt_left -= int(n)
            elif mode is ForwardMode.TARGET_VERIFY:
                self.truncate(r, r.length - int(n) + int(self.rng.integers(1, n + 1)))  # 1 .. N drafts kept
            elif mode is ForwardMode.DRAFT_EXTEND_V2:
                self.truncate(r, r.length - int(self.rng.integers(0, n)))  # the draft model's cache rolls back
            if r.length >= r.target and r.prompt_left == 0:
                self.finish(r)

    def capture_all(self):
        """One step of every (mode, bucket) on one scratch request per row, so every graph exists
        before the memory baseline (the loop then only replays)."""
        cupy = self.cupy
        scratch = Request(-1, [], 0, 0, 0)
        self.write(self.slots(scratch, 0, MAX_Q))
        scratch.length = MAX_Q
        for bucket in self.runner.buckets:
            table = np.tile(np.array(scratch.pages, np.int32), (bucket, 1))
            for mode, n, tree in ((ForwardMode.EXTEND, MAX_Q, False), (ForwardMode.DECODE, 1, False),
                                  (ForwardMode.MIXED, MAX_Q, False), (ForwardMode.TARGET_VERIFY, DRAFTS, False),
                                  (ForwardMode.TARGET_VERIFY, DRAFTS, True), (ForwardMode.DRAFT_EXTEND, DRAFTS, False),
                                  (ForwardMode.DRAFT_EXTEND_V2, DRAFTS, False)):
                q_lens = np.full(bucket, n)
                kv_lens = np.full(bucket, MAX_Q)
                flat = np.concatenate([m.ravel() for m in self.tree_mask(q_lens)]) if tree else None
                q = cupy.zeros((int(q_lens.sum()), HEADS[0], HEAD_DIM), self.dtype)
                self.runner.run(mode, q, self.cache, q_lens, kv_lens, table, custom_mask=flat)
        self.truncate(scratch, 0)


def memory():
    """Device memory now: live pool bytes, the pool's cached blocks as the loop left them
    (``pool_cached``, reported only: every step allocates arrays of its own sizes, and CuPy
    keeps a freed block of each size), then, after the pool gives its free blocks back, what
    the pool and the driver still hold: the counts the run's memory criterion compares."""
    import cupy

    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    cached = int(pool.total_bytes())
    pool.free_all_blocks()
    free, total = cupy.cuda.runtime.memGetInfo()
    return {"pool_used": int(pool.used_bytes()), "pool_held": int(pool.total_bytes()),
            "device_used": int(total - free), "pool_cached": cached}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--garbage-every", type=int, default=1000,
                        help="a step with a page id outside the cache every this many steps (0: never)")
    parser.add_argument("--max-seconds", type=float, default=170.0, help="stop (and fail) past this wall time")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=1536)
    parser.add_argument("--max-context", type=int, default=2048, help="tokens a request reaches at most")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"soak: seed {seed}, {args.steps} steps, a check every {args.check_every}, {args.dtype}, "
          f"page {args.page_size}, heads {HEADS}, head dim {HEAD_DIM}", flush=True)
    import cupy

    cupy.random.seed(seed)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    engine = Engine(args, rng)
    mem_start = memory()
    engine.capture_all()
    for _ in range(200):  # warm-up: every path once, pool blocks of every size in use once
        engine.step(check=False)
    mem_warm, graphs_warm = memory(), engine.runner.num_graphs
    modes, failures, checks, steps, garbage = collections.Counter(), [], 0, 0, 0
    mem_mid = mem_warm
    check_due = False  # a check falls due every check_every steps and waits for a step with rows (not IDLE)
    while (steps < args.steps or check_due) and time.perf_counter() - t0 < args.max_seconds:
        steps += 1
        bad = bool(args.garbage_every) and steps % args.garbage_every == args.garbage_every // 2
        check_due = check_due or steps % args.check_every == 0
        mode, failure, checked = engine.step(check=check_due, garbage=bad)
        check_due = check_due and not checked
        garbage += bad and checked
        modes[mode.name] += 1
        checks += checked
        if failure:
            failures.append(f"step {steps}: {failure}")
            print(f"FAIL step {steps}: {failure}", flush=True)
        if steps == args.steps // 2:
            mem_mid = memory()  # growth in the second half too: a leak keeps growing, a cache settles
        if steps % 2000 == 0:
            print(f"  step {steps}: {len(engine.requests)} requests, {len(engine.free)} free pages, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    mem_end = memory()
    seconds = time.perf_counter() - t0
    growth = {k: mem_end[k] - mem_warm[k] for k in mem_end}
    growth_late = {k: mem_end[k] - mem_mid[k] for k in mem_end}
    grew = any(max(growth[k], growth_late[k]) > MEMORY_SLACK[k] for k in MEMORY_SLACK)
    ok = not failures and steps >= args.steps and not grew and checks >= args.steps // args.check_every
    report = dict(seed=seed, steps=steps, checks=checks, garbage_steps=garbage, failures=len(failures),
                  graphs=engine.runner.num_graphs,
                  graphs_after_warmup=graphs_warm, modes=dict(modes), seconds=round(seconds, 1),
                  memory_start=mem_start, memory_after_warmup=mem_warm, memory_mid=mem_mid, memory_end=mem_end,
                  memory_growth_after_warmup=growth, memory_growth_second_half=growth_late, ok=ok)
    mib = lambda m: ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in m.items())  # noqa: E731
    print(f"soak: {steps} steps in {seconds:.0f} s, {checks} checks ({garbage} of them with a bad page id), "
          f"{len(failures)} failures, {engine.runner.num_graphs} graphs ({graphs_warm} after the warm-up)")
    print(f"soak: steps per mode {dict(modes)}")
    print(f"soak: memory at start: {mib(mem_start)}")
    print(f"soak: after warm-up:   {mib(mem_warm)}")
    print(f"soak: half way:        {mib(mem_mid)}")
    print(f"soak: at the end:      {mib(mem_end)}")
    print(f"soak: growth after warm-up: {mib(growth)}; in the second half: {mib(growth_late)} "
          f"(limits: {mib(MEMORY_SLACK)}; pool_cached reported only)")
    for f in failures[:10]:
        print(f"soak: {f}")
    print(f"soak: {'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
