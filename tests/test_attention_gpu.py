"""GPU correctness of BatchAttention against the float64 reference, request by request and row
by row (cupy_fa.reference.check_attention), every output and LSE buffer poisoned before the
run with a tail past the live rows that must come back untouched."""

import itertools

import numpy as np
import pytest

from cases import (POISON, check_attention, fill_cache, holey_masks, new_rng, np_dtype, paged_case,
                   paged_layout, poisoned, random_lengths, torch_randn, tree_masks)

pytestmark = pytest.mark.gpu

HEADS = [(8, 8), (32, 8), (16, 2), (8, 1)]
HEAD_DIMS = [64, 128, 256]
PAGE_SIZES = [1, 3, 16, 48, 64]  # 3 and 48: the kernels divide by the page size instead of shifting
DTYPES = ["float16", "bfloat16"]
TAIL = 3  # poisoned rows past the live ones in every output buffer


def run_case(rng, dtype, heads, head_dim, page_size, causal, lengths, custom_mask=None, device_plan=True):
    """One batch: planned from host lengths, run into poisoned buffers with a tail, every request
    and row checked against float64 with its LSE; then (``device_plan``) the same batch planned
    from device arrays, as inside a CUDA graph (the host sees only the bounds), which must give
    the same bits and leave the same tail. Returns (check, attn)."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    h_q, h_kv = heads
    q_lens, kv_lens = lengths
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total)
    q = cupy.asarray(q_host)
    out_buf = poisoned((total, h_q, head_dim), np_dtype(dtype), TAIL)
    lse_buf = poisoned((total, h_q), np.float32, TAIL)
    out, lse = out_buf[:total], lse_buf[:total]

    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
    attn.plan(q_lens, kv_lens, table, causal=causal, custom_mask=custom_mask)
    result = attn.run(q, cache, out=out, lse=lse, return_lse=True)
    assert result[0] is out and result[1] is lse
    cupy.cuda.get_current_stream().synchronize()

    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, table, causal=causal,
                                             custom_mask=custom_mask, return_lse=True)
    check = check_attention(out_buf.get(), ref, dtype, q_lens=q_lens, lse=lse_buf.get(), ref_lse=ref_lse,
                            poison=POISON, label=f"B={len(q_lens)} page {page_size} D={head_dim} {heads}")
    print(check.summary())
    check.assert_ok()

    if device_plan:
        dev = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
        mask = None if custom_mask is None else cupy.asarray(np.concatenate(
            [np.asarray(m, bool).ravel() for m in custom_mask]) if isinstance(custom_mask, list) else custom_mask)
        dev.plan(cupy.asarray(q_lens, np.int32), cupy.asarray(kv_lens, np.int32), cupy.asarray(table),
                 causal=causal, custom_mask=mask, max_q_len=int(q_lens.max()), max_kv_len=int(kv_lens.max()))
        dev_out = poisoned((total, h_q, head_dim), np_dtype(dtype), TAIL)
        dev_lse = poisoned((total, h_q), np.float32, TAIL)
        dev.run(q, cache, out=dev_out[:total], lse=dev_lse[:total])
        assert dev.status() == 0
        same = (dev_out.view(np.uint16) == out_buf.view(np.uint16)).all(axis=(1, 2)).get()
        assert same.all(), f"device-planned rows {np.flatnonzero(~same).tolist()[:20]} differ from host-planned bits"
        assert (dev_lse.view(np.uint32) == lse_buf.view(np.uint32)).all().get(), "device-planned LSE differs"
    return check, attn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_random_ragged_batch(dtype, head_dim, heads, page_size, causal):
    rng, seed = new_rng()
    budget = 2_500_000 // heads[0] * 8
    lengths = random_lengths(rng, work_budget=budget)
    check, _ = run_case(rng, dtype, heads, head_dim, page_size, causal, lengths)
    print(f"seed={seed} B={len(lengths[0])} max q_len {lengths[0].max()} max kv_len {lengths[1].max()}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["decode_long", "prefill_full", "verify", "single_key"])
def test_named_shapes(dtype, shape):
    """Shapes that exercise the split-KV merge and the tile-boundary cases."""
    rng, _ = new_rng()
    q_lens, kv_lens = {
        "decode_long": (np.array([1, 1, 1]), np.array([8192, 5000, 513])),
        "prefill_full": (np.array([300, 77]), np.array([300, 77])),
        "verify": (np.array([4, 8, 6]), np.array([4100, 2048, 7])),
        "single_key": (np.array([1]), np.array([1])),
    }[shape]
    for page_size in PAGE_SIZES:
        run_case(rng, dtype, (32, 8), 128, page_size, True, (q_lens, kv_lens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_padded_batch(dtype):
    """1500 requests, a third of them padding (q_len 0): the attention and merge kernels map
    each CTA to its request with a warp-wide search over the offsets, three rounds of 32
    probes here, through runs of equal offsets; every row lands on its own request."""
    rng, seed = new_rng()
    batch = 1500
    q_lens = rng.integers(0, 4, batch) * (rng.random(batch) < 0.67)
    kv_lens = q_lens + rng.integers(0, 1200, batch)  # up to three splits of 512
    kv_lens[q_lens == 0] = rng.integers(0, 50, int((q_lens == 0).sum()))
    check, _ = run_case(rng, dtype, (8, 2), 64, 16, True, (q_lens, kv_lens))
    assert check.counts["requests"] == int((q_lens > 0).sum())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kind", ["tree", "holes"])
def test_custom_mask_tree(dtype, head_dim, kind):
    """Verify with a custom mask among the drafts, prefix fully visible: draft trees (each draft
    sees its ancestors) and masks that are no tree (holes: a draft sees a later one but not an
    earlier one; drafts that see only themselves). The last request has no prefix, so a draft
    that sees only itself sees exactly one key."""
    rng, _ = new_rng()
    q_lens = np.array([5, 8, 3, 6, 1])
    kv_lens = np.array([700, 9, 3000, 6, 40])
    masks = (tree_masks if kind == "tree" else holey_masks)(rng, q_lens)
    if kind == "holes":
        assert not masks[3][0, 1:].any()  # holey_masks: row 0 sees only itself
    flat = np.concatenate([m.ravel() for m in masks])
    for page_size in (1, 3, 16):
        run_case(rng, dtype, (16, 2), head_dim, page_size, True, (q_lens, kv_lens), custom_mask=flat)


@pytest.mark.parametrize("page_size", [16, 3])
def test_padded_rows_write_nothing(page_size):
    """Padded requests (q_len 0) among live ones own no rows and write none: the live rows are
    right, the buffer's tail untouched; a batch of padding only writes nothing at all, whether
    planned from host or from device lengths."""
    import cupy
    import cupy_fa
    from cupy_fa import reference

    rng, _ = new_rng()
    q_lens, kv_lens = np.array([0, 3, 0, 2, 0]), np.array([7, 10, 40, 2, 0])
    table, k_host, v_host, cache, q_host = paged_case(rng, "float16", (4, 2), 64, page_size, kv_lens, 5)
    attn = cupy_fa.BatchAttention(4, 2, 64, "float16")
    out = poisoned((5, 4, 64), np.float16, TAIL)
    lse = poisoned((5, 4), np.float32, TAIL)
    attn.plan(q_lens, kv_lens, table).run(cupy.asarray(q_host), cache, out=out[:5], lse=lse[:5])
    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, table, return_lse=True)
    check_attention(out.get(), ref, "float16", q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse,
                    poison=POISON).assert_ok()

    # padding only: host lengths take a q of no rows (nothing is launched); device lengths take any
    # q (the host cannot count its rows), so the kernels launch over a grid sized from the bounds,
    # find no work and write nothing: the whole buffer is tail
    zeros = np.zeros(3, np.int32)
    for lengths in ((zeros, np.array([0, 5, 9])), (cupy.asarray(zeros), cupy.asarray([0, 5, 9], np.int32))):
        host = isinstance(lengths[0], np.ndarray)
        rows = 0 if host else 4
        out = poisoned((rows, 4, 64), np.float16, TAIL)
        lse = poisoned((rows, 4), np.float32, TAIL)
        attn.plan(*lengths, table[:3] if host else cupy.asarray(table[:3]), max_q_len=None if host else 4,
                  max_kv_len=9)
        attn.run(cupy.asarray(q_host[:rows]), cache, out=out[:rows], lse=lse[:rows])
        check_attention(out.get(), np.zeros((0, 4, 64)), "float16", q_lens=zeros, lse=lse.get(),
                        ref_lse=np.zeros((0, 4)), poison=POISON).assert_ok()


def test_append_matches_slots():
    """Host and device slots, int32 and int64: each row lands at its slot and nothing else of the
    cache changes; device slots that are negative (padding) or past the cache are skipped."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    for dtype, index, where in itertools.product(DTYPES, (np.int32, np.int64), ("host", "device")):
        cache = cupy_fa.PagedKVCache.allocate(37, 16, 4, 128, dtype)
        for arr in (cache.k, cache.v):  # random everywhere: a stray write shows
            arr[...] = cupy.asarray(rng.standard_normal(arr.shape, dtype=np.float32).astype(np_dtype(dtype)))
        k_before, v_before = cache.k.get().reshape(-1, 4, 128), cache.v.get().reshape(-1, 4, 128)
        slots = rng.permutation(37 * 16)[:100].astype(index)
        skip = np.zeros(100, bool)
        if where == "device":  # padding (negative) and past-the-end slots: skipped, not written
            skip[rng.choice(100, 10, replace=False)] = True
            slots[skip] = rng.choice([-1, -7, 37 * 16, 37 * 16 + 5], int(skip.sum()))
        k_new = rng.standard_normal((100, 4, 128), dtype=np.float32).astype(np_dtype(dtype))
        v_new = rng.standard_normal((100, 4, 128), dtype=np.float32).astype(np_dtype(dtype))
        cache.append(cupy.asarray(k_new), cupy.asarray(v_new), slots if where == "host" else cupy.asarray(slots))
        k_all, v_all = cache.k.get().reshape(-1, 4, 128), cache.v.get().reshape(-1, 4, 128)
        written = slots[~skip]
        np.testing.assert_array_equal(k_all[written], k_new[~skip])
        np.testing.assert_array_equal(v_all[written], v_new[~skip])
        untouched = np.setdiff1d(np.arange(37 * 16), written)
        np.testing.assert_array_equal(k_all[untouched], k_before[untouched])
        np.testing.assert_array_equal(v_all[untouched], v_before[untouched])


def test_torch_interop_zero_copy():
    import torch

    import cupy_fa
    from cupy_fa import reference

    rng, _ = new_rng()
    q_lens, kv_lens = np.array([1, 7, 200]), np.array([1000, 7, 900])
    table, num_pages = paged_layout(rng, kv_lens, 16)
    k, v = fill_cache(rng, (num_pages, 16, 8, 128), np.float32, table, kv_lens, 16)
    k_t = torch.from_numpy(k).to("cuda", torch.bfloat16)
    v_t = torch.from_numpy(v).to("cuda", torch.bfloat16)
    cache = cupy_fa.PagedKVCache(k_t, v_t)
    assert cache.k.data.ptr == k_t.data_ptr() and cache.v.data.ptr == v_t.data_ptr()
    q_t = torch_randn(rng, (208, 32, 128), torch.bfloat16)
    out_buf = torch.full((208 + TAIL, 32, 128), POISON, device="cuda", dtype=torch.bfloat16)
    out_t = out_buf[:208]
    attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16")
    attn.plan(q_lens, kv_lens, table)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # launched on torch's current stream
        got = attn.run(q_t, cache, out=out_t)
        fresh, lse = attn.run(q_t, cache, return_lse=True)
    stream.synchronize()
    assert got is out_t
    assert isinstance(fresh, torch.Tensor) and isinstance(lse, torch.Tensor) and fresh.is_cuda
    ref, ref_lse = reference.paged_attention(q_t.float().cpu().numpy(), k_t.float().cpu().numpy(),
                                             v_t.float().cpu().numpy(), q_lens, kv_lens, table, return_lse=True)
    check_attention(out_buf.float().cpu().numpy(), ref, "bfloat16", q_lens=q_lens, poison=POISON).assert_ok()
    check_attention(fresh.float().cpu().numpy(), ref, "bfloat16", q_lens=q_lens, lse=lse.cpu().numpy(),
                    ref_lse=ref_lse).assert_ok()
    # torch K/V written through append land in the caller's tensors
    slots = torch.tensor([0, 5], device="cuda")
    new = torch_randn(rng, (2, 8, 128), torch.bfloat16)
    cache.append(new, new, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_t.view(-1, 8, 128)[slots], new)


def small_q_stages(head_dim, warps_m, stages, fold_capable, smem_limit):
    """The deepest pipeline up to ``stages`` whose shared memory fits (TileTraits::kSmemBytes,
    written out here: Q, K and V stages of 64 keys, the fold state)."""
    def smem(s):
        fold = 16 * warps_m * (2 * head_dim * 4 + 16) if fold_capable else 0
        return 2 * head_dim * (16 * warps_m + 2 * s * 64) + fold
    return max(s for s in (2, 3, 4) if s <= stages and smem(s) <= smem_limit)


@pytest.mark.parametrize("stages,split_size,warps_m,per_cta", [
    (2, 512, "auto", 1), (3, 512, "auto", 1), (4, 512, "auto", 1), (2, 256, "auto", 1), (2, 1024, "auto", 1),
    (2, 2048, "auto", 1), (2, 512, 1, 1), (2, 512, 2, 1), (3, 1024, 2, 1), (2, 512, "auto", 2), (2, 256, 1, 4),
    (3, 256, "auto", 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_tuning_knobs(stages, split_size, warps_m, per_cta, dtype, monkeypatch):
    """Every pipeline depth, split size and warp layout the tuning knobs (and the
    A/B in scripts/ab_decode.sh) can select is correct (decode-like tiles:
    q_len <= SMALL_Q_LEN), for each head dim, and took effect: the planned tile has the
    stages (as deep as shared memory allows), the warp rows and the splits per CTA asked
    for, and the plan kernel cut every request at the split size asked for."""
    import cupy_fa
    from cupy_fa import _build

    monkeypatch.setenv("CUPY_FA_DECODE_STAGES", str(stages))
    monkeypatch.setenv("CUPY_FA_SPLIT_SIZE", str(split_size))
    monkeypatch.setenv("CUPY_FA_DECODE_WARPS_M", str(warps_m))
    monkeypatch.setenv("CUPY_FA_SPLITS_PER_CTA", str(per_cta))
    cupy_fa.knobs.reload()  # knobs are read once: take the new values
    rng, _ = new_rng()
    lengths = (np.array([1, 1, 8, 4, 2]), np.array([9000, 700, 3000, 4, 257]))
    group = 32 // 8
    for head_dim in HEAD_DIMS:
        for page_size in (1, 16):
            _, attn = run_case(rng, dtype, (32, 8), head_dim, page_size, True, lengths)
            tile = attn.planned.tile
            want_rows = int(warps_m) if warps_m != "auto" else (1 if 8 * group <= 16 else 2)
            assert (tile.warps_m, tile.warps_n) == (want_rows, 4), tile
            assert tile.stages == small_q_stages(head_dim, want_rows, stages, tile.fold_capable,
                                                 _build.device_smem_limit()), tile
            if tile.fold_splits:  # the fold (auto) runs whole groups of 8 splits per CTA, or whole rows
                assert tile.splits_per_cta in (8, 16), tile
            else:
                assert tile.splits_per_cta == (per_cta if tile.epilogue_in_stage else 1), tile
            bufs, b = attn._buffers, len(lengths[0])
            assert (bufs.split_keys[:b].get() == split_size).all(), bufs.split_keys[:b].get()
            assert (bufs.num_splits[:b].get() == -(-lengths[1] // split_size)).all(), bufs.num_splits[:b].get()


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_workspace_overflow(dtype):
    """A batch whose split partials would overflow the workspace gets every
    request capped at an equal share of it (plan.cu): still correct, every row written."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, _ = new_rng()
    h_q, h_kv, head_dim, page_size, batch = 32, 2, 128, 16, 64  # few KV heads: a small cache for many keys
    q_lens = np.full(batch, schedule.SMALL_Q_LEN)
    S = schedule.split_size()
    rows = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, max_batch_size=batch, max_num_tokens=1,
                                  max_pages_per_request=1)._buffers.partial_out.shape[0]
    splits = rows // (batch * schedule.SMALL_Q_LEN) + 1  # one split more per request than the workspace holds
    kv_lens = rng.integers((splits - 1) * S + 1, splits * S + 1, size=batch)
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, (h_q, h_kv), head_dim, page_size, kv_lens,
                                                       int(q_lens.sum()))
    total = int(q_lens.sum())
    out = poisoned(q_host.shape, np_dtype(dtype), TAIL)
    lse = poisoned(q_host.shape[:2], np.float32, TAIL)
    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
    with pytest.warns(cupy_fa.BatchInvarianceWarning, match="split partials need"):  # said, with the size
        attn.plan(q_lens, kv_lens, table)
    attn.run(cupy.asarray(q_host), cache, out=out[:total], lse=lse[:total])
    bufs = attn._buffers
    wanted = int((q_lens * -(-kv_lens // schedule.split_size())).sum())
    assert attn._plan.schedule.partial_rows == wanted
    assert wanted > bufs.partial_out.shape[0], "the case must overflow the workspace"
    assert int(bufs.partial_indptr[batch].get()) <= bufs.partial_out.shape[0]
    assert (bufs.num_splits[:batch].get() > 1).all()  # capped, not unsplit
    got, got_lse = out.get().astype(np.float32), lse.get()
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    # every row written (finite, not the poison) and the tail untouched ...
    assert np.isfinite(got[:total].astype(np.float32)).all() and not (got[:total] == POISON).any()
    assert np.isfinite(got_lse[:total]).all() and not (got_lse[:total] == POISON).any()
    assert (got[total:] == POISON).all() and (got_lse[total:] == POISON).all()
    # ... and a few requests, row by row, against the float64 reference
    for b in rng.choice(batch, size=4, replace=False):
        ref, ref_lse = reference.paged_attention(q_host[cu[b]:cu[b + 1]], k_host, v_host, q_lens[b:b + 1],
                                                 kv_lens[b:b + 1], table[b:b + 1], return_lse=True)
        check = check_attention(got[cu[b]:cu[b + 1]], ref, dtype, q_lens=q_lens[b:b + 1],
                                lse=got_lse[cu[b]:cu[b + 1]], ref_lse=ref_lse, label=f"request {b}")
        print(check.summary())
        check.assert_ok()
