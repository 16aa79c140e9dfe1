"""Multi-head latent attention on the GPU, held to the float64 reference (cupy_fa.reference.mla_attention)
request by request and row by row with its LSE: every serving mode, eager and replayed from a
captured CUDA graph (device lengths, the same bits), 16-bit and fp8 latent caches, page sizes 1, 16
and 64 over shuffled, interleaved page tables whose unread slots hold NaN, outputs poisoned before
the run (a tail past the live rows must stay so); decode == verify bit for bit; the append bit-exact
(fp8: the host quantiser's bytes); a page id outside the cache NaNs its request only."""

import re

import numpy as np
import pytest

from cases import POISON, check_attention, new_rng, np_dtype, paged_layout, poisoned, tree_masks

from cupy_fa.modes import ForwardMode, contract_lengths

pytestmark = pytest.mark.gpu
M = ForwardMode
FP8 = "float8_e4m3fn"
FP8_NAN = 0x7F
TAIL = 3
SCALE = 4.0 / 448  # an fp8 cache's scale: N(0, 1) values' 4 sigma at e4m3's largest


def latent_case(rng, dtype, page_size, kv_lens, kv_dtype=None, fp8_scale=SCALE):
    """(page_table, host latent (what the reference reads), PagedLatentCache, scale): a shuffled
    interleaved paged layout, NaN in every slot no request may read. An fp8 cache holds N(0, 1)
    values quantised at SCALE, read at ``fp8_scale``."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    table, num_pages = paged_layout(rng, kv_lens, page_size)
    values = rng.standard_normal((num_pages, page_size, 576), dtype=np.float32)
    valid = np.zeros((num_pages, page_size), bool)
    for b, kv in enumerate(kv_lens):
        tokens = np.arange(int(kv))
        valid[table[b, tokens // page_size], tokens % page_size] = True
    if kv_dtype == FP8:
        raw = reference.quantize_e4m3(values.reshape(-1, 1, 576), SCALE).reshape(values.shape)
        raw[~valid] = FP8_NAN
        return table, raw, cupy_fa.PagedLatentCache(cupy.asarray(raw), dtype=FP8, scale=fp8_scale), fp8_scale
    host = values.astype(np_dtype(dtype))
    host[~valid] = np.nan
    return table, host, cupy_fa.PagedLatentCache(cupy.asarray(host)), None


def mode_lengths(rng, mode, batch, max_prefix, max_new=90):
    """(q_lens, kv_lens, custom masks or None, causal) of a step of ``mode`` (cupy_fa.modes)."""
    prefix = rng.integers(0, max_prefix, size=batch)
    n = int(rng.integers(2, 7))
    if mode is M.DECODE:
        q, kv = contract_lengths(mode, prefix_lens=prefix)
    elif mode in (M.TARGET_VERIFY, M.DRAFT_EXTEND_V2):
        q, kv = contract_lengths(mode, prefix_lens=prefix, num_draft_tokens=n)
    elif mode is M.DRAFT_EXTEND:
        q, kv = contract_lengths(mode, prefix_lens=prefix, accepted_lens=rng.integers(1, n + 1, size=batch))
    elif mode is M.MIXED:
        new = np.where(rng.random(batch) < 0.5, 1, rng.integers(2, max_new, size=batch))
        q, kv = contract_lengths(mode, prefix_lens=prefix, new_lens=new)
    else:  # EXTEND: chunked prefill over a prefix (some of them 0)
        prefix = np.where(rng.random(batch) < 0.3, 0, prefix)
        q, kv = contract_lengths(mode, prefix_lens=prefix, new_lens=rng.integers(1, max_new, size=batch))
    q, kv = np.asarray(q), np.asarray(kv)
    kv = np.maximum(kv, 1)
    q = np.minimum(q, kv)
    return q, kv


def run_case(rng, heads, dtype, kv_dtype, page_size, q_lens, kv_lens, *, causal=True, masks=None, split_q=False,
             graph=True, label="", q_exponents=None, fp8_scale=SCALE):
    """One step eager (host lengths) against float64, then the graph path's bits (device lengths, plan
    and run captured, replayed) against the eager ones (``q_exponents``: each (token, head) row of
    N(0, 1) queries times 2^e; ``fp8_scale``: an fp8 cache's scale). Returns (out, the plan's schedule)."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    table, host, cache, scale = latent_case(rng, dtype, page_size, kv_lens, kv_dtype, fp8_scale)
    total = int(q_lens.sum())
    q_host = rng.standard_normal((total, heads, 576), dtype=np.float32)
    if q_exponents is not None:
        q_host *= 2.0 ** q_exponents(total, heads)[..., None]
    q_host = q_host.astype(np_dtype(dtype))
    q = cupy.asarray(q_host)
    flat_mask = np.concatenate([m.reshape(-1) for m in masks]) if masks is not None else None
    attn = cupy_fa.MLAAttention(heads, dtype, kv_dtype=kv_dtype)
    attn.plan(q_lens, kv_lens, table, causal=causal, custom_mask=flat_mask)
    out = poisoned((total, heads, 512), np_dtype(dtype), TAIL)
    lse = poisoned((total, heads), np.float32, TAIL)
    if split_q:  # q_nope and q_pe as two arrays of their own
        nope, pe = (cupy.asarray(np.ascontiguousarray(x)) for x in (q_host[..., :512], q_host[..., 512:]))
        attn.run(nope, cache, out=out[:total], q_pe=pe, lse=lse[:total])
    else:
        attn.run(q, cache, out=out[:total], lse=lse[:total])
    assert attn.status() == 0
    ref, ref_lse = reference.mla_attention(q_host, host, q_lens, kv_lens, table, causal=causal, custom_mask=flat_mask,
                                           scale=scale, return_lse=True)
    tiles = " + ".join(type(x.tile).__name__ + (f"(warps_m={x.tile.warps_m})" if hasattr(x.tile, "warps_m") else "")
                       for x in attn.planned.schedule.launches)
    check = check_attention(out.get(), ref, dtype, q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse, poison=POISON,
                            label=f"mla {label} H={heads} {kv_dtype or dtype} page {page_size} B={len(q_lens)} [{tiles}]")
    print(check.summary())
    check.assert_ok()
    if graph:
        replayed = planned_in_graph(heads, dtype, kv_dtype, q_lens, kv_lens, table, q, cache, flat_mask, causal)
        same = (replayed.view(np.uint16) == out[:total].view(np.uint16)).all(axis=(1, 2)).get()
        assert same.all(), f"graph-replayed rows {np.flatnonzero(~same)[:20].tolist()} differ from the eager bits"
    return out[:total], attn.planned.schedule


def planned_in_graph(heads, dtype, kv_dtype, q_lens, kv_lens, table, q, cache, mask, causal):
    """The step planned from device lengths (the host given only bounds) and run, both captured in a
    CUDA graph (a first plan outside the capture sizes the buffers); one replay's output, which starts
    from NaN."""
    import cupy
    import cupy_fa

    attn = cupy_fa.MLAAttention(heads, dtype, kv_dtype=kv_dtype, max_batch_size=len(q_lens) + 2,
                                max_num_tokens=int(q_lens.sum()) + 8, max_pages_per_request=table.shape[1] + 1,
                                max_mask_bytes=int((q_lens ** 2).sum()) + 1)
    dev = [cupy.asarray(x, np.int32) for x in (q_lens, kv_lens, table)]
    dev_mask = cupy.asarray(mask.astype(np.uint8)) if mask is not None else None
    out = cupy.empty((q.shape[0], heads, 512), q.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for capture in (False, True):
            if capture:
                stream.begin_capture()
            attn.plan(*dev, causal=causal, custom_mask=dev_mask, max_q_len=int(q_lens.max()),
                      max_kv_len=int(kv_lens.max()))
            attn.run(q, cache, out=out)
        graph = stream.end_capture()
        out.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    assert attn.status() == 0
    return out


MODES = [M.DECODE, M.TARGET_VERIFY, "tree", M.DRAFT_EXTEND, M.DRAFT_EXTEND_V2, M.MIXED, M.EXTEND]
# (queries, cache): 16-bit caches in the queries' type; fp8 caches under bf16 queries (the seesaw
# kernel rewrites them as fp16 times 2^e a row) and under fp16 queries (taken as they are)
CACHES = [("bfloat16", None), ("float16", None), ("bfloat16", FP8), ("float16", FP8)]
CACHE_IDS = ("bf16", "fp16", "fp8", "fp16-fp8")


def _mode_cases():
    """(mode, cache, heads, page size) for every mode and cache: the head count (8: TP 16, 16: TP 8,
    128: one GPU) and the page size (1, 16, 64) rotate, so each mode meets every head count and page
    size (the ids name them: on sm_90a a 16-bit cache's decode-like steps take the seesaw kernel from
    16 heads, the mma.sync tile at 8)."""
    cases = []
    for m, mode in enumerate(MODES):
        for c in range(len(CACHES)):
            heads, page = (16, 128, 8)[(m + c) % 3], (1, 16, 64)[(m + 2 * c) % 3]
            name = mode if isinstance(mode, str) else mode.name
            cases.append(pytest.param(mode, c, heads, page, id=f"{name}-{CACHE_IDS[c]}-H{heads}-p{page}"))
    return cases


@pytest.mark.parametrize("mode,cache_kind,heads,page_size", _mode_cases())
def test_every_mode_against_float64(mode, cache_kind, heads, page_size):
    """Each serving mode over each cache, eager and graph, the queries as [T, H, 576] or (every other
    mode) two arrays."""
    rng, seed = new_rng()
    dtype, kv_dtype = CACHES[cache_kind]
    # (the float64 reference's work kept to seconds: 128 heads take fewer and shorter prefill rows)
    batch, max_prefix, max_new = (6, 1500, 40) if heads == 128 else (10, 2500, 90)
    masks = None
    if mode == "tree":
        q_lens, kv_lens = mode_lengths(rng, M.TARGET_VERIFY, batch, max_prefix)
        masks = tree_masks(rng, q_lens)
    else:
        q_lens, kv_lens = mode_lengths(rng, mode, batch, max_prefix, max_new)
    run_case(rng, heads, dtype, kv_dtype, page_size, q_lens, kv_lens, masks=masks, split_q=MODES.index(mode) % 2 == 1,
             label=f"seed {seed} {mode if isinstance(mode, str) else mode.name}")


@pytest.mark.parametrize("heads,kv_dtype", [(128, None), (16, FP8)], ids=["H128-bf16", "H16-fp8"])
def test_long_context_and_padding(heads, kv_dtype):
    """One request over 20000 keys (40 splits, the merge), beside padded rows (q_len = 0) and a
    request of one key; and a step without the causal mask."""
    rng, seed = new_rng()
    q_lens, kv_lens = np.array([1, 0, 1, 3]), np.array([20000, 7, 1, 300])
    run_case(rng, heads, "bfloat16", kv_dtype, 64, q_lens, kv_lens, label=f"seed {seed} long")
    run_case(rng, heads, "bfloat16", kv_dtype, 16, np.array([2, 5]), np.array([900, 77]), causal=False, graph=False,
             label=f"seed {seed} non-causal")


@pytest.mark.parametrize("heads,mode", [(128, M.DECODE), (16, M.TARGET_VERIFY)], ids=["H128-decode", "H16-verify"])
def test_fp8_bf16_queries_beyond_fp16_range(heads, mode):
    """bf16 queries whose (token, head) rows span 2^4 .. 2^21 in magnitude, mixed inside each 64-row
    block (one token's 64 heads at 128 heads; four tokens' 16 at 16), over an fp8 cache read at a
    scale 2^-18 smaller (so the scores stay moderate): the seesaw kernel's products run in fp16, each
    row rewritten as fp16 times its own power of two (kernels/mla/wgmma_copy.cuh q_block_to_fp16), so
    rows past 65504 stay finite. Eager and graph, against float64."""
    rng, seed = new_rng()
    q_lens, kv_lens = mode_lengths(rng, mode, 5, 2500)
    largest = []

    def exponents(total, h):
        e = rng.integers(4, 22, size=(total, h))
        e[0, 0], e[0, 1] = 21, 4  # both ends in one row block
        largest.append(int(e.max()))
        return e

    run_case(rng, heads, "bfloat16", FP8, 16, q_lens, kv_lens, q_exponents=exponents, fp8_scale=SCALE * 2.0**-18,
             label=f"seed {seed} bf16 queries 2^4 .. 2^21")
    assert largest == [21]  # (2^21 x N(0, 1) rows: well past fp16's 65504)


@pytest.mark.parametrize("heads", [4, 12], ids=["H4", "H12"])
def test_wide_merge_at_few_heads(heads):
    """The merge's wide shape (4 heads a CTA) at head counts other than the bench's: any multiple of 4
    takes it once a step has 1024 rows, here 4 and 12 heads, a decode batch of just over 1024 rows
    past one split (1024 keys), eager and graph against float64."""
    from cupy_fa.mla import schedule as S

    rng, seed = new_rng()
    batch = -(-1024 // heads) + 3
    q_lens, kv_lens = np.ones(batch, int), rng.integers(1100, 2600, size=batch)
    assert S.merge_shape(int(q_lens.sum()), heads) == S.MERGE_WIDE
    _, sched = run_case(rng, heads, "bfloat16", None, 16, q_lens, kv_lens, label=f"seed {seed} wide merge")
    assert sched.needs_merge


@pytest.mark.parametrize("heads", [8, 16, 128], ids=["H8", "H16", "H128"])
@pytest.mark.parametrize("kv_dtype", [None, FP8], ids=["bf16", "fp8"])
def test_decode_equals_verify_bit_for_bit(heads, kv_dtype):
    """A verify step of N drafts over a prefix, and each draft decoded alone (q_len 1, kv_len = prefix +
    i + 1, the same query row, in a batch of other requests): the same bits, row for row."""
    import cupy
    import cupy_fa

    rng, seed = new_rng()
    n, batch = 4, 5
    page_size = 1 if (heads == 16) == (kv_dtype is None) else 64
    prefix = rng.integers(1, 3000, size=batch)
    kv_lens = prefix + n
    table, _, cache, _ = latent_case(rng, "bfloat16", page_size, kv_lens, kv_dtype)
    q_host = rng.standard_normal((batch * n, heads, 576), dtype=np.float32).astype(np_dtype("bfloat16"))
    verify = cupy_fa.MLAAttention(heads, "bfloat16", kv_dtype=kv_dtype)
    verify.plan(np.full(batch, n), kv_lens, table)
    v_out = verify.run(cupy.asarray(q_host), cache).get()
    # decode: draft i of request b as its own request, shuffled among the others
    order = rng.permutation(batch * n)
    b_of, i_of = order // n, order % n
    decode = cupy_fa.MLAAttention(heads, "bfloat16", kv_dtype=kv_dtype)
    decode.plan(np.ones(batch * n, int), prefix[b_of] + i_of + 1, table[b_of])
    d_out = decode.run(cupy.asarray(q_host[order]), cache).get()
    back = np.empty_like(d_out)
    back[order] = d_out
    same = (back.view(np.uint16) == v_out.view(np.uint16)).all(axis=(1, 2))
    assert same.all(), (f"seed {seed}: decode rows {np.flatnonzero(~same)[:20].tolist()} differ from verify's "
                        f"({[type(x.tile).__name__ for x in decode.planned.schedule.launches]} vs "
                        f"{[type(x.tile).__name__ for x in verify.planned.schedule.launches]})")


def test_decode_equals_verify_past_8_splits_and_the_workspace_warning():
    """At 128 heads (the seesaw kernel on sm_90a), drafts over 8 S + 1 .. 8 S + 1903 keys (S the split
    size, 1024 by default: 8193-10095 keys, 9-10 splits a token): decode == verify bit for bit with
    the default workspace, which holds the batch; an instance whose workspace cannot hold it caps the
    splits and says so once (BatchInvarianceWarning)."""
    import warnings

    import cupy
    import cupy_fa
    from cupy_fa.mla import schedule as mla_schedule

    rng, seed = new_rng()
    n, batch, heads = 4, 4, 128
    split = mla_schedule.split_size(heads)
    prefix = rng.integers(8 * split + 1, 8 * split + 1904, size=batch)
    kv_lens = prefix + n
    table, _, cache, _ = latent_case(rng, "bfloat16", 16, kv_lens)
    q_host = rng.standard_normal((batch * n, heads, 576), dtype=np.float32).astype(np_dtype("bfloat16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", cupy_fa.BatchInvarianceWarning)
        verify = cupy_fa.MLAAttention(heads, "bfloat16")
        verify.plan(np.full(batch, n), kv_lens, table)
        assert verify.planned.schedule.partial_rows == n * int((-(-kv_lens // split)).sum())
        v_out = verify.run(cupy.asarray(q_host), cache).get()
        order = rng.permutation(batch * n)
        b_of, i_of = order // n, order % n
        decode = cupy_fa.MLAAttention(heads, "bfloat16")
        decode.plan(np.ones(batch * n, int), prefix[b_of] + i_of + 1, table[b_of])
        d_out = decode.run(cupy.asarray(q_host[order]), cache).get()
    back = np.empty_like(d_out)
    back[order] = d_out
    same = (back.view(np.uint16) == v_out.view(np.uint16)).all(axis=(1, 2))
    assert same.all(), f"seed {seed}: decode rows {np.flatnonzero(~same)[:20].tolist()} differ from verify's"
    small = cupy_fa.MLAAttention(heads, "bfloat16", workspace_bytes=1)  # 8 splits a token of its capacity
    with pytest.warns(cupy_fa.BatchInvarianceWarning, match="workspace_bytes >="):
        small.plan(np.full(batch, n), kv_lens, table)
    capped = small.run(cupy.asarray(q_host), cache).get().astype(np.float32)
    assert np.isfinite(capped).all() and np.abs(capped - v_out.astype(np.float32)).max() < 0.05, seed


@pytest.mark.parametrize("dtype,fp8,slots_on", [("bfloat16", False, "host"), ("float16", False, "device"),
                                                 ("bfloat16", True, "device"), ("float16", True, "host")])
def test_append_is_exact(dtype, fp8, slots_on):
    """c_kv and k_pe (two column slices of one [T, 576] array) land in their slots' rows: copied, or
    quantised to the bytes the host's quantiser gives; padding slots (-1, device) and the other slots
    keep what they held."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    pages, page_size, tokens = 30, 16, 200
    cache = cupy_fa.PagedLatentCache.allocate(pages, page_size, FP8 if fp8 else dtype, scale=SCALE if fp8 else None)
    pattern = 0x5A if fp8 else 0x3C3C  # what the slots not appended keep (bits)
    (cache.latent if fp8 else cache.latent.view(cupy.uint16)).fill(pattern)
    new = (3 * rng.standard_normal((tokens, 576), dtype=np.float32)).astype(np_dtype(dtype))
    slots = rng.permutation(pages * page_size)[:tokens].astype(np.int64)
    dev_new = cupy.asarray(new)
    if slots_on == "host":
        given = slots
    else:
        slots[rng.choice(tokens, 10, replace=False)] = -1
        given = cupy.asarray(slots, np.int32)
    cache.append(dev_new[:, :512], dev_new[:, 512:], given)
    assert cache.status() == 0
    got = cache.latent.get().reshape(-1, 576)
    got = got if fp8 else got.view(np.uint16)
    live = slots >= 0
    want = reference.quantize_e4m3(new.astype(np.float32)[:, None], SCALE)[:, 0] if fp8 else new.view(np.uint16)
    assert (got[slots[live]] == want[live]).all(), f"seed {seed}: appended rows differ"
    untouched = np.setdiff1d(np.arange(pages * page_size), slots[live])
    assert (got[untouched] == pattern).all(), "a slot not appended was written"


def test_a_page_id_outside_the_cache_nans_its_request_only():
    """Device page table with one request's page id past the cache: its rows NaN, the others exact,
    status names it (graph path: nothing checked on the host)."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, seed = new_rng()
    heads, q_lens, kv_lens = 128, np.array([1, 1, 2]), np.array([700, 300, 900])
    table, host, cache, _ = latent_case(rng, "bfloat16", 16, kv_lens)
    bad = table.copy()
    bad[1, 3] = cache.num_pages + 5
    q_host = rng.standard_normal((4, heads, 576), dtype=np.float32).astype(np_dtype("bfloat16"))
    attn = cupy_fa.MLAAttention(heads)
    attn.plan(cupy.asarray(q_lens, np.int32), cupy.asarray(kv_lens, np.int32), cupy.asarray(bad), max_q_len=2)
    out = attn.run(cupy.asarray(q_host), cache).get().astype(np.float32)
    found = attn.status()
    assert not found.ok and found.request == 1, str(found)
    assert np.isnan(out[1]).all()
    ref = reference.mla_attention(q_host, host, q_lens, kv_lens, table)
    keep = np.array([0, 2, 3])
    err = np.linalg.norm(out[keep] - ref[keep]) / np.linalg.norm(ref[keep])
    assert err < 1e-2, f"seed {seed}: the other requests' rel err {err}"


def test_idle_and_bad_inputs_launch_nothing():
    import cupy
    import cupy_fa

    attn = cupy_fa.MLAAttention(16)
    cache = cupy_fa.PagedLatentCache.allocate(4, 16)
    attn.plan(np.zeros(0, int), np.zeros(0, int), np.zeros((0, 1), np.int32))
    out = attn.run(cupy.zeros((0, 16, 576), np_dtype("bfloat16")), cache)
    assert out.shape == (0, 16, 512)
    attn.plan([1], [20], [[0, 1]])
    out = cupy.full((1, 16, 512), POISON, np_dtype("bfloat16"))
    with pytest.raises(ValueError, match="is not a page of the cache"):
        attn.plan([1], [20], [[0, 9]]).run(cupy.zeros((1, 16, 576), np_dtype("bfloat16")), cache, out=out)
    with pytest.raises(ValueError, match=re.escape("q must be [T, H, 576]")):
        attn.plan([1], [20], [[0, 1]]).run(cupy.zeros((1, 16, 512), np_dtype("bfloat16")), cache, out=out)
    with pytest.raises(TypeError, match="cache must be a cupy_fa.PagedLatentCache"):
        attn.run(cupy.zeros((1, 16, 576), np_dtype("bfloat16")), object(), out=out)
    # the seesaw kernel stores 16-byte chunks: an out 8 bytes off a 16-byte boundary is refused
    shifted = cupy.full(16 * 512 + 4, POISON, np_dtype("bfloat16"))
    misaligned = shifted[4:].reshape(1, 16, 512)  # (CuPy's allocations start on 256-byte boundaries)
    with pytest.raises(ValueError, match="out must start on a 16-byte boundary"):
        attn.run(cupy.zeros((1, 16, 576), np_dtype("bfloat16")), cache, out=misaligned)
    assert (shifted.view(np.uint16) == cupy.full(shifted.shape, POISON, np_dtype("bfloat16")).view(np.uint16)).all()
    assert (out.view(np.uint16) == cupy.full((1, 16, 512), POISON, np_dtype("bfloat16")).view(np.uint16)).all()
