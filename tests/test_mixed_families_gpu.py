"""Steps on two kernel families (GPU): the small-q requests of a step that also holds requests of
more than 16 tokens run on the small-q tiles and keep the bits of a pure decode / verify step of
the same requests, eagerly and through CUDA graphs (page sizes 1, 16, 64; GQA groups 1, 4, 8;
beside a long row of 17 to 2048 tokens); the long rows run on the prefill family of the device's
target (the sm_90a wgmma kernel on Hopper, the mma.sync prefill tile elsewhere) and match the
float64 reference, eagerly and as EXTEND / MIXED steps replayed by GraphRunner.

Outputs are poisoned with NaN before each run (an unwritten element shows up); caches hold NaN in
every slot no request may read; fresh random inputs each run (seed printed by new_rng)."""

import os

import numpy as np
import pytest

from cases import check_attention, new_rng, np_dtype, paged_case, random_lengths
from cupy_fa import families

pytestmark = pytest.mark.gpu


def expected_long_family():
    """The family the long rows must run on here: wgmma on an sm_90 device compiled for itself."""
    import cupy


    native = cupy.cuda.Device().compute_capability == "90" and not os.environ.get("CUPY_FA_ARCH")
    return families.SM90_WGMMA if native else families.mma_sync.MMA_SYNC


def check(out, ref, dtype, q_lens, lse=None, ref_lse=None, label=""):
    """Every live request and row within the dtype's bars against float64 (its worst element too),
    nothing NaN or unwritten, each (row, head)'s LSE: reference.check_attention."""
    check_attention(out, ref, dtype, q_lens=q_lens, lse=lse, ref_lse=ref_lse, poison=float("nan"),
                    label=label).assert_ok()


def reference_rows(q_host, k_host, v_host, q_lens, kv_lens, table, rows_of, causal=True):
    """float64 out and lse of some rows of each request: rows_of(b) -> (r0, r1) windows (the
    window r0..r1 of a causal request is the request of its rows, whose keys end at row r1 - 1's
    diagonal). Returns {(b, r0, r1): (out, lse)}."""
    from cupy_fa import reference

    cu = np.concatenate([[0], np.cumsum(q_lens)])
    refs = {}
    for b in range(len(q_lens)):
        q, kv = int(q_lens[b]), int(kv_lens[b])
        for r0, r1 in rows_of(b):
            kv_eff = kv - q + r1 if causal else kv
            refs[(b, r0, r1)] = reference.paged_attention(
                q_host[cu[b] + r0:cu[b] + r1], k_host, v_host, [r1 - r0], [kv_eff], table[b:b + 1], causal=causal,
                return_lse=True)
    return refs


def long_windows(q_len):
    """Every row of a request up to 320 rows; else its first 32 and last 64 (fp64 stays cheap)."""
    return [(0, q_len)] if q_len <= 320 else [(0, 32), (q_len - 64, q_len)]


def run_eager(dtype, heads, head_dim, q_dev, cache, q_lens, kv_lens, table):
    import cupy
    import cupy_fa

    attn = cupy_fa.BatchAttention(heads[0], heads[1], head_dim, dtype)
    out = cupy.empty(q_dev.shape, np_dtype(dtype))
    lse = cupy.empty(q_dev.shape[:2], np.float32)
    poison(out)
    poison(lse)
    attn.plan(q_lens, kv_lens, table).run(q_dev, cache, out=out, lse=lse)
    return out, lse, attn


def bits(a):
    """The bits of a device array of 16- or 32-bit elements (compared and indexed as integers)."""
    import cupy

    return a.view(cupy.uint16 if a.dtype.itemsize == 2 else cupy.uint32)


def poison(a):
    """NaN in every element of a device array (bf16, fp16 or fp32)."""
    nan_bits = {np_dtype("bfloat16"): 0x7FC0, np_dtype("float16"): 0x7E00}
    if a.dtype.itemsize == 2:
        bits(a).fill(nan_bits[a.dtype])
    else:
        a.fill(np.nan)


def mixed_case(rng, long_q, kv_max=9000):
    """A MIXED step: small-q rows (decode rows over split boundaries, one of a single key, a
    4-token verify row) with one long row (q_len long_q over a prefix) among them; and the
    positions of the small rows in it."""
    S = 512
    small_q = np.array([1, 1, 4, 1, 1])
    small_kv = np.array([S + 7, 1, int(rng.integers(4, kv_max)), 3 * S, int(rng.integers(1, kv_max))])
    long_kv = long_q + int(rng.integers(0, 1500))
    at = int(rng.integers(1, len(small_q)))  # the long row sits between small ones
    q_lens = np.insert(small_q, at, long_q)
    kv_lens = np.insert(small_kv, at, long_kv)
    small = np.array([b for b in range(len(q_lens)) if b != at])
    return q_lens, kv_lens, small, at


def check_mixed(dtype, heads, head_dim, page_size, long_q, path):
    """The small-q rows of a MIXED step (eager BatchAttention, or GraphRunner replaying a captured
    MIXED step) have the bits of the same requests as a pure small-q step, its long row those of
    the long request alone; every row is right."""
    import cupy
    import cupy_fa
    from cupy_fa.modes import ForwardMode

    rng, _ = new_rng()
    q_lens, kv_lens, small, at = mixed_case(rng, long_q)
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total)
    q = cupy.asarray(q_host)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    small_rows = np.concatenate([np.arange(cu[b], cu[b + 1]) for b in small])

    # the small-q requests alone: a pure small-q step (it may fold its splits in the CTAs)
    pure, pure_lse, pure_attn = run_eager(dtype, heads, head_dim, cupy.asarray(q_host[small_rows]), cache,
                                          q_lens[small], kv_lens[small], table[small])
    assert pure_attn.planned.long_tile is None
    # the long request alone: a request's bits depend on itself only (either family)
    long_rows = np.arange(cu[at], cu[at + 1])
    alone, alone_lse, _ = run_eager(dtype, heads, head_dim, cupy.asarray(q_host[long_rows]), cache, q_lens[at:at + 1],
                                    kv_lens[at:at + 1], table[at:at + 1])

    if path == "eager":
        out, lse, attn = run_eager(dtype, heads, head_dim, q, cache, q_lens, kv_lens, table)
        planned = attn.planned
    else:
        runner = cupy_fa.GraphRunner(heads[0], heads[1], head_dim, dtype, max_batch_size=8, max_q_len=long_q,
                                     max_pages_per_request=table.shape[1], page_size=page_size)
        for _ in range(2):  # capture (after an eager warm-up), then a replay
            poison(runner.out)
            poison(runner.lse)
            out, lse = runner.run(ForwardMode.MIXED, q, cache, q_lens, kv_lens, table, return_lse=True)
        assert runner.num_graphs == 1
        planned = runner.attn.planned
    label = f"MIXED {path} ps{page_size} {heads[0]}/{heads[1]} D{head_dim} long q {long_q}"
    assert planned.long_tile is not None and families.family_of(planned.long_tile) is expected_long_family(), label
    assert families.is_small_q_tile(planned.tile), planned.tile
    rows = cupy.asarray(small_rows)
    assert (bits(out)[rows] == bits(pure)).all(), f"{label}: small-q rows differ from the pure small-q step"
    assert (bits(lse)[rows] == bits(pure_lse)).all(), f"{label}: small-q LSE differs from the pure small-q step"
    assert (bits(out)[cu[at]:cu[at + 1]] == bits(alone)).all(), f"{label}: the long rows differ from the request alone"
    assert (bits(lse)[cu[at]:cu[at + 1]] == bits(alone_lse)).all(), f"{label}: the long LSE differs from it alone"

    # correct: the small-q rows whole, the long row by windows
    refs = reference_rows(q_host, k_host, v_host, q_lens, kv_lens, table,
                          lambda b: long_windows(int(q_lens[b])) if b == at else [(0, int(q_lens[b]))])
    got, got_lse = out.get(), lse.get()
    for (b, r0, r1), (ref, ref_lse) in refs.items():
        rows = slice(cu[b] + r0, cu[b] + r1)
        check(got[rows], ref, dtype, [r1 - r0], got_lse[rows], ref_lse, label=f"{label} request {b} rows {r0}..{r1}")


@pytest.mark.parametrize("path", ["eager", "graph"])
@pytest.mark.parametrize("long_q", [17, 300, 2048])
@pytest.mark.parametrize("heads", [(32, 8), (16, 16), (64, 8)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_small_q_rows_of_a_mixed_step_keep_their_bits(page_size, heads, long_q, path):
    check_mixed("bfloat16", heads, 128, page_size, long_q, path)


@pytest.mark.parametrize("path", ["eager", "graph"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_small_q_rows_keep_their_bits_at_other_head_dims(head_dim, dtype, path):
    check_mixed(dtype, (32, 8), head_dim, 16, 100, path)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_long_rows_of_a_ragged_step_match_float64(dtype, head_dim, page_size, causal):
    """Random ragged steps of prefills, extends over long prefixes (split ones too), decode,
    verify and padding rows through BatchAttention: every row right, LSE too; the long rows on
    the device's prefill family."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, _ = new_rng()
    heads = (16, 4)
    q_lens, kv_lens = random_lengths(rng, max_requests=9, max_q=700, max_kv=4000, work_budget=1_200_000)
    q_lens = np.append(q_lens, [40, 1])  # at least one long row (q 40 over 3000 keys: several splits) and a decode row
    kv_lens = np.append(kv_lens, [3000, 2500])
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total)
    attn = cupy_fa.BatchAttention(heads[0], heads[1], head_dim, dtype)
    out = cupy.empty((total, heads[0], head_dim), np_dtype(dtype))
    lse = cupy.empty((total, heads[0]), np.float32)
    poison(out)
    poison(lse)
    attn.plan(q_lens, kv_lens, table, causal=causal).run(cupy.asarray(q_host), cache, out=out, lse=lse)
    assert families.family_of(attn.planned.long_tile) is expected_long_family()
    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, table, causal=causal,
                                             return_lse=True)
    check(out.get(), ref, dtype, q_lens, lse.get(), ref_lse, label=f"ragged D{head_dim} ps{page_size}")


def test_custom_mask_on_long_rows():
    """A custom mask over a request of more than 16 tokens (the prefix visible, the step's keys
    as masked) on the prefill family, beside a small-q tree-verify row."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, _ = new_rng()
    dtype, heads, d, ps = "bfloat16", (8, 2), 128, 16
    q_lens, kv_lens = np.array([40, 5]), np.array([700, 900])
    masks = [rng.random((q, q)) < 0.6 for q in q_lens]
    for m in masks:
        np.fill_diagonal(m, True)
    flat = np.concatenate([m.ravel() for m in masks])
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, d, ps, kv_lens, total)
    attn = cupy_fa.BatchAttention(heads[0], heads[1], d, dtype)
    out = cupy.empty((total, heads[0], d), np_dtype(dtype))
    lse = cupy.empty((total, heads[0]), np.float32)
    poison(out)
    poison(lse)
    attn.plan(q_lens, kv_lens, table, custom_mask=flat).run(cupy.asarray(q_host), cache, out=out, lse=lse)
    assert attn.planned.long_tile is not None
    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, table, custom_mask=flat,
                                             return_lse=True)
    check(out.get(), ref, dtype, q_lens, lse.get(), ref_lse, label="custom mask")


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_and_mixed_steps_through_graph_runner(page_size):
    """EXTEND and MIXED steps of more than 16 tokens per request through GraphRunner: each mode's
    captured step (plan kernel, both families' launches, the merge) replayed over new lengths and
    inputs of the same bucket gives the eager step's bits, and is right against float64."""
    import cupy
    import cupy_fa
    from cupy_fa import reference
    from cupy_fa.modes import ForwardMode

    rng, _ = new_rng()
    dtype, heads, d, max_q = "bfloat16", (32, 8), 128, 600
    steps = [(ForwardMode.EXTEND, [600, 17, 250], [600, 4000, 1250]),
             (ForwardMode.EXTEND, [33, 512, 100], [5000, 512, 3100]),   # the same bucket: a replay
             (ForwardMode.MIXED, [1, 300, 1, 4, 17], [4096, 300, 77, 2048, 5999]),
             (ForwardMode.MIXED, [200, 1, 1, 1, 64], [2000, 5000, 1, 513, 64])]
    # one cache holding every step's requests (a graph belongs to one cache): step i reads its rows
    all_kv = np.concatenate([kv for _, _, kv in steps])
    table, k_host, v_host, cache, _ = paged_case(rng, dtype, heads, d, page_size, all_kv, 0)
    runner = cupy_fa.GraphRunner(heads[0], heads[1], d, dtype, max_batch_size=8, max_q_len=max_q,
                                 max_pages_per_request=table.shape[1], page_size=page_size)
    first = 0
    for mode, q_lens, kv_lens in steps:
        q_lens, kv_lens = np.array(q_lens), np.array(kv_lens)
        rows = table[first:first + len(q_lens)]
        first += len(q_lens)
        q_host = rng.standard_normal((int(q_lens.sum()), heads[0], d), dtype=np.float32).astype(np_dtype(dtype))
        q = cupy.asarray(q_host)
        results = {}
        for use_graph in (False, True):
            poison(runner.out)
            poison(runner.lse)
            out, lse = runner.run(mode, q, cache, q_lens, kv_lens, rows, use_graph=use_graph, return_lse=True)
            results[use_graph] = (bits(out).copy(), bits(lse).copy(), out.get(), lse.get())
        assert families.family_of(runner.attn.planned.long_tile) is expected_long_family()
        label = f"{mode.name} ps{page_size} q {q_lens.tolist()}"
        assert (results[True][0] == results[False][0]).all(), f"{label}: graph and eager outputs differ"
        assert (results[True][1] == results[False][1]).all(), f"{label}: graph and eager LSE differ"
        ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, rows, return_lse=True)
        check(results[True][2], ref, dtype, q_lens, results[True][3], ref_lse, label=label)
    assert runner.num_graphs == 2  # one per (mode, bucket, cache): the second step of each mode replayed
