"""A small step of every kernel path, for compute-sanitizer (scripts/sanitize.sh): decode with
splits and the merge, verify chain and tree, folded splits, prefill tiles (causal or not), mixed
batches, head dims 64 / 96 / 128 / 192 / 256, an fp8 cache, page sizes 1 / 3 / 16, graph capture
and replay, the cache's append (host and device slots, padding), and steps whose device metadata
is garbage (page ids outside the cache, kv_len past the page table or the plan's bound, q_len past
its bound or past kv_len, more query rows than q holds, append slots outside the cache): those must
fault nowhere, leave every other request's bits as a clean run gives them, and show in the status
words. Each case is checked against the float64 reference. Exits 1 on any failure; runs in a few
seconds without the sanitizer."""

import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/cases.py: the fp8 cases' bytes and scales

import cupy  # noqa: E402

import cupy_fa  # noqa: E402
from cupy_fa import ForwardMode, reference  # noqa: E402
from cases import FP8_NAN, fp8_bytes, fp8_scales  # noqa: E402

FAILURES = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def step(rng, dtype, heads, head_dim, page_size, q_lens, kv_lens, extra_pages=2, fp8=False):
    """A shuffled paged cache holding the requests' keys (NaN elsewhere), their table, q. fp8: an
    e4m3fn cache (NaN bytes elsewhere) with random per-head scales."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    need = [-(-int(k) // page_size) for k in kv_lens]
    num_pages = sum(need) + extra_pages
    perm = rng.permutation(num_pages)
    table = np.zeros((len(q_lens), max(max(need), 1)), np.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n
    elem = cupy_fa.PagedKVCache.allocate(1, 1, 1, 8, dtype).dtype
    shape = (num_pages, page_size, heads[1], head_dim)
    valid = np.zeros(shape[:2], bool)
    for b, kv in enumerate(kv_lens):
        t = np.arange(int(kv))
        valid[table[b, t // page_size], t % page_size] = True
    scales = {}
    if fp8:  # the fp8 tests' bytes and per-head scales (tests/cases.py); an e4m3fn NaN elsewhere
        k_scale, v_scale = fp8_scales(rng, "head", heads[1])
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        k, v = fp8_bytes(rng, shape, k_scale), fp8_bytes(rng, shape, v_scale)
        k[~valid], v[~valid] = FP8_NAN, FP8_NAN
        cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v), dtype="float8_e4m3fn", **scales)
    else:
        k = rng.standard_normal(shape, dtype=np.float32).astype(elem)
        v = rng.standard_normal(shape, dtype=np.float32).astype(elem)
        k[~valid] = np.nan
        v[~valid] = np.nan
        cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v))
    q = rng.standard_normal((int(q_lens.sum()), heads[0], head_dim), dtype=np.float32).astype(elem)
    return dict(q_lens=q_lens, kv_lens=kv_lens, table=table, k=k, v=v, cache=cache, q_host=q, q=cupy.asarray(q),
                dtype=dtype, scales=scales)


def close(out, s, what, causal=True, masks=None, rows=None):
    ref = reference.paged_attention(s["q_host"], s["k"], s["v"], s["q_lens"], s["kv_lens"], s["table"],
                                    causal=causal, custom_mask=masks, **s.get("scales", {}))
    got = np.asarray(out.get() if hasattr(out, "get") else out, np.float64)
    cu = np.concatenate([[0], np.cumsum(s["q_lens"])])
    worst = 0.0
    for b in range(len(s["q_lens"])) if rows is None else rows:
        if s["q_lens"][b]:
            worst = max(worst, reference.relative_error(got[cu[b]:cu[b + 1]], ref[cu[b]:cu[b + 1]]))
    check(worst < reference.TOL[s["dtype"]], f"{what}: worst request error {worst:.2g}")


def eager(rng, what, dtype, heads, head_dim, page_size, q_lens, kv_lens, causal=True, tree=False, fp8=False):
    s = step(rng, dtype, heads, head_dim, page_size, q_lens, kv_lens, fp8=fp8)
    masks = None
    if tree:
        masks = []
        for n in s["q_lens"]:
            parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
            m = np.zeros((n, n), bool)
            for i in range(n):
                j = i
                while j >= 0:
                    m[i, j], j = True, parent[j]
            masks.append(m)
    attn = cupy_fa.BatchAttention(*heads, head_dim, dtype, kv_dtype="float8_e4m3fn" if fp8 else None)
    attn.plan(s["q_lens"], s["kv_lens"], s["table"], causal=causal, custom_mask=masks)
    out, lse = attn.run(s["q"], s["cache"], return_lse=True)
    cupy.cuda.Device().synchronize()
    close(out, s, what, causal, masks)
    check(int(attn.status()) == 0, f"{what}: status clean")


def good_paths(rng):
    H, D = (8, 2), 128
    eager(rng, "decode, splits and merge", "bfloat16", H, D, 16, [1, 1, 1], [1, 700, 2100])
    eager(rng, "verify chain q=4", "bfloat16", H, D, 16, [4, 4], [600, 1100])
    eager(rng, "verify tree q=8", "float16", H, D, 16, [8, 8, 8], [8, 520, 1500], tree=True)
    eager(rng, "extend, prefill tile", "bfloat16", H, D, 16, [40, 1, 33], [300, 900, 33])
    eager(rng, "extend, not causal", "float16", H, D, 3, [20, 17], [60, 17], causal=False)
    eager(rng, "mixed, page size 1", "bfloat16", H, D, 1, [1, 24, 1, 0], [1030, 100, 5, 0])
    eager(rng, "head dim 64", "bfloat16", (4, 4), 64, 16, [1, 5, 30], [900, 5, 200])
    eager(rng, "head dim 256", "float16", (8, 1), 256, 16, [1, 8, 20], [1200, 600, 40])
    eager(rng, "head dim 96", "bfloat16", (8, 2), 96, 16, [1, 6, 40], [1300, 70, 300])
    eager(rng, "head dim 192", "float16", (4, 1), 192, 1, [1, 3, 24], [700, 3, 150])
    eager(rng, "fp8 cache: decode, verify, extend", "bfloat16", H, D, 16, [1, 8, 40, 1], [2100, 600, 300, 5], fp8=True)
    eager(rng, "fp8 cache: page size 1, D 64", "float16", (4, 1), 64, 1, [1, 4, 20], [900, 4, 100], fp8=True)
    old = os.environ.get("CUPY_FA_FOLD_SPLITS")
    os.environ["CUPY_FA_FOLD_SPLITS"] = "1"
    _reload_knobs()
    try:
        eager(rng, "decode, folded splits", "bfloat16", H, D, 16, [1] * 4, [4100, 2000, 1, 9000])
        eager(rng, "verify, folded splits", "bfloat16", H, D, 16, [8] * 3, [4100, 8000, 9])
        # the fp8 folding tile of one row half (a producer warpgroup on sm_90a: kernels/mma_sync/kv_ring.cuh)
        eager(rng, "fp8 cache: decode, folded splits", "bfloat16", H, D, 16, [1] * 4, [4100, 2000, 1, 9000], fp8=True)
        eager(rng, "fp8 cache: decode, folded, page size 1", "float16", (16, 2), D, 1, [1] * 3, [3000, 17, 1100],
              fp8=True)
    finally:
        if old is None:
            os.environ.pop("CUPY_FA_FOLD_SPLITS")
        else:
            os.environ["CUPY_FA_FOLD_SPLITS"] = old
        _reload_knobs()


def _reload_knobs():
    try:  # the tuning knobs are read once (cupy_fa.knobs); re-read them after a change
        from cupy_fa import knobs

        knobs.reload()
    except (ImportError, AttributeError):
        pass


def graphs_and_append(rng):
    H, D, ps = (8, 2), 128, 16
    s = step(rng, "bfloat16", H, D, ps, [1, 1, 1], [40, 600, 1500], extra_pages=4)
    runner = cupy_fa.GraphRunner(*H, D, "bfloat16", max_batch_size=4, max_q_len=4,
                                 max_pages_per_request=s["table"].shape[1] + 1, page_size=ps)
    for on_device in (False, True):
        lens = (s["q_lens"], s["kv_lens"], s["table"])
        if on_device:
            lens = tuple(cupy.asarray(np.asarray(x, np.int32)) for x in lens)
        for _ in range(2):  # capture, then replay
            out = runner.run(ForwardMode.DECODE, s["q"], s["cache"], *lens)
        cupy.cuda.Device().synchronize()
        close(out, s, f"graph decode, {'device' if on_device else 'host'} inputs")
    # append: host slots, then device slots with padding (-1)
    cache = cupy_fa.PagedKVCache.allocate(4, ps, H[1], D, "bfloat16")
    k_new = cupy.asarray(rng.standard_normal((3, H[1], D)), cache.dtype)
    cache.append(k_new, k_new, [0, 17, 63])
    cache.append(k_new, k_new, cupy.array([5, -1, 6], np.int64))
    cupy.cuda.Device().synchronize()
    flat = cache.k.reshape(-1, H[1], D)
    check(bool((flat[cupy.array([0, 17, 63, 5, 6])] == k_new[cupy.array([0, 1, 2, 0, 2])]).all()), "append host and device slots")


def garbage(rng):
    """Device metadata the host cannot check: every bad request is refused or NaN, nothing faults,
    the good requests keep the bits of a clean run, the status words say who and what."""
    H, D, ps = (8, 2), 128, 16
    q_lens, kv_lens = np.array([1, 4, 1, 8, 1]), np.array([700, 1100, 40, 2000, 1500])
    s = step(rng, "bfloat16", H, D, ps, q_lens, kv_lens)
    width = s["table"].shape[1]
    attn = cupy_fa.BatchAttention(*H, D, "bfloat16", max_batch_size=8, max_num_tokens=64,
                                  max_pages_per_request=width + 2)
    dev = lambda x: cupy.asarray(np.asarray(x, np.int32))  # noqa: E731
    out = cupy.full_like(s["q"], np.nan)
    attn.plan(dev(q_lens), dev(kv_lens), dev(s["table"]), max_q_len=8, max_kv_len=width * ps)
    attn.run(s["q"], s["cache"], out=out)
    clean = out.get()
    cases = []
    t = s["table"].copy()
    t[1, 3] = 10**8
    cases.append(("page id 10^8", q_lens, kv_lens, t, 1))
    t = s["table"].copy()
    t[3, 0] = -5
    cases.append(("page id -5", q_lens, kv_lens, t, 3))
    kv = kv_lens.copy()
    kv[2] = width * ps + 1
    cases.append(("kv_len past the page table and the bound", q_lens, kv, s["table"], 2))
    q = q_lens.copy()
    q[4] = 1000
    cases.append(("q_len past max_q_len", q, kv_lens, s["table"], 4))
    kv = kv_lens.copy()
    kv[0] = 0
    cases.append(("q_len > kv_len", q_lens, kv, s["table"], 0))
    for what, q, kv, t, bad in cases:
        out = cupy.full_like(s["q"], np.nan)
        attn.plan(dev(q), dev(kv), dev(t), max_q_len=8, max_kv_len=width * ps)
        attn.run(s["q"], s["cache"], out=out)
        cupy.cuda.Device().synchronize()
        got = out.get()
        status = attn.status()
        check(int(status) == bad + 1, f"garbage, {what}: status names request {bad} ({status!r})")
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        same = all(np.array_equal(got[cu[b]:cu[b + 1]].view(np.uint16), clean[cu[b]:cu[b + 1]].view(np.uint16))
                   for b in range(len(q_lens)) if b != bad)
        check(same, f"garbage, {what}: the other requests' bits as in a clean run")
        rows = got[cu[bad]:cu[bad + 1]].astype(np.float32)
        check(bool(np.isnan(rows).all()), f"garbage, {what}: the bad request's rows are NaN")
    cache = cupy_fa.PagedKVCache.allocate(4, ps, H[1], D, "bfloat16")
    k_new = cupy.ones((2, H[1], D), cache.dtype)
    cache.append(k_new, k_new, cupy.array([3, 10**9], np.int64))
    cupy.cuda.Device().synchronize()
    status = cache.status() if hasattr(cache, "status") else None
    check(status is not None and int(status) == 2, f"garbage, append slot 10^9: the cache's status names token 1 ({status!r})")


def main():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"sanitize_cases: seed {seed}")
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    good_paths(rng)
    graphs_and_append(rng)
    garbage(rng)
    print(f"sanitize_cases: {len(FAILURES)} failures in {time.perf_counter() - t0:.1f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
