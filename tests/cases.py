"""Random engine-like batches for the GPU tests: ragged lengths, shuffled and
interleaved page tables, caches whose unused slots hold NaN (so a read of the
wrong page or past kv_len shows up), fresh random values every run.

Replaying a failure: every test draws all of its inputs (torch ones included) from one
generator made by :func:`new_rng`, which prints its seed; ``CUPY_FA_SEED=<seed>`` makes
every ``new_rng()`` of the run start from that seed, so the failing test gets its inputs back.
"""

import os

import numpy as np

from cupy_fa.reference import TOL, check_attention  # noqa: F401 - the tests' bars are the library's

SEED_ENV = "CUPY_FA_SEED"
# What output and LSE buffers hold before a kernel runs: finite (a kernel that wrongly read the
# NaN slots of the cache and wrote NaN into a row it must not touch still shows up), exact in
# fp16, bf16 and fp32, and no value attention can produce (|out| <= max |v|; an LSE is at least
# the largest scaled score). check_attention(poison=POISON) reads it back.
POISON = -4096.0


def np_dtype(name):
    """The NumPy dtype of a cupy_fa dtype name ("float16" or "bfloat16")."""
    from cupy_fa import _arrays

    return _arrays.DTYPES[name]


def new_rng():
    """``(numpy Generator, seed)``: a fresh seed each call, or ``CUPY_FA_SEED`` when set."""
    given = os.environ.get(SEED_ENV)
    seed = int(given) if given else int.from_bytes(os.urandom(4), "little")
    print(f"rng seed {seed} (replay: {SEED_ENV}={seed})")
    return np.random.default_rng(seed), seed


def torch_randn(rng, shape, dtype, device="cuda"):
    """A torch tensor of standard normals drawn from ``rng`` (so the printed seed replays it)."""
    import torch

    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(device=device, dtype=dtype)


def poisoned(shape, dtype, tail=0):
    """A CuPy buffer of ``shape`` with ``tail`` rows more, all POISON: pass ``buf[:shape[0]]`` to
    the kernel and ``buf`` to check_attention, whose tail rows must come back untouched."""
    import cupy

    return cupy.full((shape[0] + tail,) + tuple(shape[1:]), POISON, dtype)


def random_lengths(rng, max_requests=33, max_q=300, max_kv=8192, work_budget=None):
    """(q_lens, kv_lens) mixing decode rows, q_len == kv_len prefills, extends
    over long prefixes, and padded q_len = 0 rows; total q x kv <= work_budget."""
    batch = int(rng.integers(1, max_requests + 1))
    q_lens, kv_lens = [], []
    for _ in range(batch):
        kind = rng.choice(["decode", "prefill", "extend", "verify", "pad"], p=[0.3, 0.15, 0.3, 0.2, 0.05])
        if kind == "decode":
            q, kv = 1, int(rng.integers(1, max_kv + 1))
        elif kind == "prefill":
            q = int(rng.integers(1, max_q + 1)); kv = q
        elif kind == "extend":
            q = int(rng.integers(1, max_q + 1)); kv = q + int(rng.integers(0, max_kv - q + 1))
        elif kind == "verify":
            q = int(rng.integers(2, 9)); kv = q + int(rng.integers(0, max_kv - q + 1))
        else:
            q, kv = 0, int(rng.integers(0, 50))
        q_lens.append(q); kv_lens.append(kv)
    q_lens, kv_lens = np.array(q_lens), np.array(kv_lens)
    if work_budget is not None:  # shrink the largest requests until the reference stays cheap
        while (q_lens * kv_lens).sum() > work_budget:
            b = int(np.argmax(q_lens * kv_lens))  # every pass strictly shrinks q x kv of this request
            if kv_lens[b] > q_lens[b] and (q_lens[b] == 1 or q_lens[b] * kv_lens[b] <= work_budget // 4):
                kv_lens[b] = max(q_lens[b], kv_lens[b] // 2)
            else:  # a prefill (q == kv) or a large extend: halve both
                q_lens[b] = max(1, q_lens[b] // 2); kv_lens[b] = max(q_lens[b], kv_lens[b] // 2)
    if q_lens.sum() == 0:
        q_lens[0], kv_lens[0] = 1, max(1, kv_lens[0])
    return q_lens, kv_lens


def paged_layout(rng, kv_lens, page_size, extra_pages=3):
    """Page table with pages shuffled over the cache and handed out round-robin,
    so the requests' pages interleave. Returns (page_table, num_pages)."""
    needed = [-(-int(kv) // page_size) for kv in kv_lens]
    num_pages = sum(needed) + extra_pages
    free = list(rng.permutation(num_pages))
    pages = [[] for _ in kv_lens]
    remaining = list(needed)
    while any(remaining):
        for b in range(len(kv_lens)):
            if remaining[b]:
                pages[b].append(free.pop()); remaining[b] -= 1
    width = max(1, max(needed) + int(rng.integers(0, 3)))
    table = np.full((len(kv_lens), width), -1, np.int32)
    for b, row in enumerate(pages):
        table[b, :len(row)] = row
    # unused columns point at real pages too (an engine's table is rarely -1 filled)
    table[table < 0] = rng.integers(0, num_pages, size=int((table < 0).sum()))
    return table, num_pages


def fill_cache(rng, cache_shape, dtype, page_table, kv_lens, page_size, head_dim_vo=None):
    """Random K/V (host, float32 values exactly representable in dtype) with NaN
    in every slot that no request may read (V of its own head dim ``head_dim_vo`` where given)."""
    k = rng.standard_normal(cache_shape, dtype=np.float32)
    v_shape = tuple(cache_shape[:3]) + ((head_dim_vo or cache_shape[3]),)
    v = rng.standard_normal(v_shape, dtype=np.float32)
    valid = np.zeros(cache_shape[:2], bool)
    for b, kv in enumerate(kv_lens):
        tokens = np.arange(int(kv))
        valid[page_table[b, tokens // page_size], tokens % page_size] = True
    k[~valid] = np.nan
    v[~valid] = np.nan
    return k.astype(dtype), v.astype(dtype)


def paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, num_tokens, head_dim_vo=None):
    """The setup of a GPU case: a shuffled paged cache holding kv_lens keys per request
    (NaN in every other slot), on the device, and num_tokens fresh host queries (``head_dim_vo``:
    V's own head dim, separate qk / vo head dims).
    Returns (page_table, k_host, v_host, cache, q_host)."""
    import cupy
    import cupy_fa

    h_q, h_kv = heads
    table, num_pages = paged_layout(rng, kv_lens, page_size)
    k_host, v_host = fill_cache(rng, (num_pages, page_size, h_kv, head_dim), np_dtype(dtype), table, kv_lens,
                                page_size, head_dim_vo)
    cache = cupy_fa.PagedKVCache(cupy.asarray(k_host), cupy.asarray(v_host))
    q_host = rng.standard_normal((num_tokens, h_q, head_dim), dtype=np.float32).astype(np_dtype(dtype))
    return table, k_host, v_host, cache, q_host


def after_current(stream):
    """``stream``, made to wait for what the caller's current stream has queued (the copies that made
    a test's inputs): a non-blocking stream is not ordered after the legacy default stream, so
    without this its kernels may read q, the cache or the lengths before their copies land (a
    loaded GPU, e.g. pytest's parallel workers, shows it)."""
    import cupy

    stream.wait_event(cupy.cuda.get_current_stream().record())
    return stream


def run_planned_in_graph(attn, q_lens, kv_lens, page_table, q, cache, max_q_len, max_kv_len):
    """``attn`` planned on the device (lengths and page table as device int32 arrays, the host
    given only ``max_q_len`` / ``max_kv_len``) and run, both inside a captured CUDA graph (a first
    plan and run outside the capture sizes the buffers); returns the output of one replay, which
    starts from NaN."""
    import cupy

    lens = [cupy.asarray(x, np.int32) for x in (q_lens, kv_lens, page_table)]
    out = cupy.empty((q.shape[0], q.shape[1], attn.head_dim_vo), q.dtype)
    stream = after_current(cupy.cuda.Stream(non_blocking=True))
    with stream:
        for capture in (False, True):  # the first plan sizes the buffers outside the capture
            if capture:
                stream.begin_capture()
            attn.plan(*lens, max_q_len=max_q_len, max_kv_len=max_kv_len)
            attn.run(q, cache, out=out)
        graph = stream.end_capture()
        out.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    return out


def tree_masks(rng, q_lens):
    """Random draft trees for tree verify: draft i sees itself and its ancestor chain.
    Returns one bool [q, q] mask per request."""
    masks = []
    for q in q_lens:
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, q)]
        m = np.zeros((q, q), bool)
        for i in range(q):
            j = i
            while j >= 0:
                m[i, j] = True
                j = parent[j]
        masks.append(m)
    return masks


def holey_masks(rng, q_lens):
    """Custom masks that are not trees: each draft sees itself, a random subset of the other
    drafts (later ones too, and with holes: key j seen while some key i < j is not), and
    some drafts see only themselves. One bool [q, q] mask per request."""
    masks = []
    for q in q_lens:
        m = rng.random((q, q)) < 0.5
        np.fill_diagonal(m, True)
        alone = rng.random(q) < 0.3
        m[alone] = False
        m[alone, np.flatnonzero(alone)] = True
        if q >= 3:  # at least one row that sees itself only, and one with a hole before a seen key
            m[0] = False
            m[0, 0] = True
            m[q - 1] = True
            m[q - 1, q - 2] = False
        masks.append(m)
    return masks


# ---- an fp8 (e4m3fn) cache ----------------------------------------------------------------

FP8 = "float8_e4m3fn"
FP8_NAN = 0x7F  # what an fp8 cache's unread slots hold (an e4m3fn NaN)


def fp8_scales(rng, kind, num_kv_heads):
    """(k_scale, v_scale): one Python float each ("tensor") or float32 [num_kv_heads] ("head"),
    drawn so that some of the N(0, 1) x 2 values the cases quantise saturate at 448 x scale."""
    if kind == "tensor":
        return float(rng.uniform(0.004, 0.03)), float(rng.uniform(0.004, 0.03))
    return (rng.uniform(0.002, 0.05, num_kv_heads).astype(np.float32),
            rng.uniform(0.002, 0.05, num_kv_heads).astype(np.float32))


def fp8_bytes(rng, shape, scale, pool=1 << 16):
    """e4m3fn bytes of N(0, 1) x 2 values quantised with ``scale`` (a float or [H_kv], the
    heads being axis -2 of ``shape``): a pool of quantised draws per head, sampled (a large cache
    in seconds)."""
    from cupy_fa import reference

    h_kv = shape[-2]
    table = reference.quantize_e4m3(2 * rng.standard_normal((pool, h_kv, 1), dtype=np.float32), scale)[:, :, 0]
    index = rng.integers(0, pool, size=shape, dtype=np.uint16 if pool <= 1 << 16 else np.int64)
    return table[index, np.arange(h_kv)[:, None]]


def fp8_paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, num_tokens, scale_kind):
    """paged_case for an fp8 cache: K/V of N(0, 1) x 2 quantised on the host
    (cupy_fa.reference.quantize_e4m3) with fresh scales, the bytes of every slot no request may
    read an e4m3fn NaN. Returns (page_table, k_bytes, v_bytes, (k_scale, v_scale), cache, q_host)."""
    import cupy
    import cupy_fa

    h_q, h_kv = heads
    table, num_pages = paged_layout(rng, kv_lens, page_size)
    shape = (num_pages, page_size, h_kv, head_dim)
    k_scale, v_scale = fp8_scales(rng, scale_kind, h_kv)
    k, v = fp8_bytes(rng, shape, k_scale), fp8_bytes(rng, shape, v_scale)
    valid = np.zeros(shape[:2], bool)
    for b, kv in enumerate(kv_lens):
        tokens = np.arange(int(kv))
        valid[table[b, tokens // page_size], tokens % page_size] = True
    k[~valid] = FP8_NAN
    v[~valid] = FP8_NAN
    cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v), dtype=FP8, k_scale=k_scale, v_scale=v_scale)
    q_host = rng.standard_normal((num_tokens, h_q, head_dim), dtype=np.float32).astype(np_dtype(dtype))
    return table, k, v, (k_scale, v_scale), cache, q_host


# e4m3 subnormals (+-2^-9 .. 7 x 2^-9) and the smallest normals: what a flush to zero would lose
SUBNORMAL_E4M3 = np.array([0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x81, 0x83, 0x86], np.uint8)


def subnormal_fp8_case(rng, kv_lens, page_size, head_dim):
    """An fp8 cache of two KV heads whose every byte is drawn from SUBNORMAL_E4M3, with per-head
    scales 1 and 2^-4, over a shuffled paged layout. Returns (page_table, k_bytes, v_bytes, scales,
    cache)."""
    import cupy
    import cupy_fa

    table, pages = paged_layout(rng, kv_lens, page_size)
    shape = (pages, page_size, 2, head_dim)
    k = SUBNORMAL_E4M3[rng.integers(0, SUBNORMAL_E4M3.size, shape)]
    v = SUBNORMAL_E4M3[rng.integers(0, SUBNORMAL_E4M3.size, shape)]
    scales = np.array([1.0, 2.0**-4], np.float32)
    cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v), dtype=FP8, k_scale=scales, v_scale=scales)
    return table, k, v, scales, cache
