"""Batch invariance: a token's attention output has the same bits whether it is
computed by decode (q_len = 1), by verify with N drafts (q_len = N, causal), or
in a different batch. Speculative decoding is lossless only if this holds:
the verify pass must reproduce what plain decode would have seen."""

import os
import re

import numpy as np
import pytest

from cases import (POISON, check_attention, fill_cache, new_rng, np_dtype, paged_case, paged_layout, poisoned,
                   run_planned_in_graph)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 3, 16, 48])
@pytest.mark.parametrize("warps_m", ["auto", "1"])
def test_decode_equals_verify_bitwise(dtype, heads, head_dim, page_size, warps_m, monkeypatch):
    check_decode_equals_verify(dtype, heads, head_dim, page_size, warps_m, monkeypatch)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("warps_m", ["auto", "1"])
def test_decode_equals_verify_bitwise_peaked_scores(dtype, warps_m, monkeypatch):
    """Scores spread over tens of log2 units (sm_scale 4): rows move their exponent offset
    past kLazyRescale on later tiles, so the accumulator rescale runs; still correct and
    still the same bits in decode and verify."""
    check_decode_equals_verify(dtype, (32, 8), 128, 16, warps_m, monkeypatch, sm_scale=4.0)


def rescale_fires(q_host, k_host, table, kv_lens, q_lens, page_size, sm_scale, group, split):
    """Whether some decode row's scores, seen as the (1, 4) tile sees them (64-key tiles,
    16 keys per warp, state reset at every split), pass the row's first offset by more
    than kLazyRescale = 8 (log2 units) on a later tile: the kernel's rescale branch."""
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    for b in range(len(kv_lens)):
        keys = np.concatenate([np.arange(table[b, j] * page_size, (table[b, j] + 1) * page_size)
                               for j in range(-(-int(kv_lens[b]) // page_size))])[:kv_lens[b]]
        k = k_host.reshape(-1, k_host.shape[2], k_host.shape[3])[keys].astype(np.float64)  # [kv, H_kv, D]
        q = q_host[starts[b + 1] - 1].astype(np.float64)  # the last row: it sees every key
        s = np.einsum("hd,khd->hk", q, np.repeat(k, group, axis=1)) * sm_scale * np.log2(np.e)
        for split0 in range(0, len(keys), split):
            for warp in range(4):
                offset = -np.inf
                for tile0 in range(split0, min(split0 + split, len(keys)), 64):
                    lo = tile0 + 16 * warp
                    if lo >= len(keys):
                        continue
                    mx = s[:, lo:min(lo + 16, len(keys))].max(axis=1)
                    if np.isfinite(offset).all() and (mx > offset + 8).any():
                        return True
                    offset = np.where(mx > offset + 8, mx, offset)
    return False


def check_decode_equals_verify(dtype, heads, head_dim, page_size, warps_m, monkeypatch, sm_scale=None):
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    monkeypatch.setenv("CUPY_FA_DECODE_WARPS_M", warps_m)  # verify on 16-row CTAs or on 32-row ones
    cupy_fa.knobs.reload()  # knobs are read once: take the new value
    rng, _ = new_rng()
    h_q, h_kv = heads
    S = schedule.split_size()
    # prefixes around split boundaries (the verify window straddles one) and random ones
    prefix = np.array([5, S - 3, 2 * S - 1, 3 * S + 2, int(rng.integers(1, 6000)), int(rng.integers(1, 300))])
    B = len(prefix)
    for num_draft in (4, 8, 16):
        kv = prefix + num_draft
        table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv, B * num_draft)
        q = cupy.asarray(q_host)
        attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)

        verify_buf = poisoned(q.shape, np_dtype(dtype), 2)
        lse_buf = poisoned(q.shape[:2], np.float32, 2)
        verify = verify_buf[:len(q)]
        attn.plan(np.full(B, num_draft), kv, table, sm_scale=sm_scale).run(q, cache, out=verify,
                                                                            lse=lse_buf[:len(q)])
        rows_of_warps = 1 if warps_m == "1" or num_draft * (h_q // h_kv) <= 16 else 2
        assert attn.planned.tile.warps_m == rows_of_warps, attn.planned.tile  # the knob took effect
        ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, np.full(B, num_draft), kv, table,
                                                 sm_scale=sm_scale, return_lse=True)
        check_attention(verify_buf.get(), ref, dtype, q_lens=np.full(B, num_draft), lse=lse_buf.get(),
                        ref_lse=ref_lse, poison=POISON, label=f"verify N={num_draft}").assert_ok()
        if sm_scale is not None:  # the case must reach the kernel's rescale branch, or it tests nothing new
            assert rescale_fires(q_host, k_host, table, kv, np.full(B, num_draft), page_size, sm_scale,
                                 h_q // h_kv, S)

        q_rows = q.reshape(B, num_draft, h_q, head_dim)
        verify_rows = verify.reshape(B, num_draft, h_q, head_dim)
        for i in range(num_draft):
            # plain decode of draft position i, the whole batch at once
            decode = cupy.full((B, h_q, head_dim), np.nan, np_dtype(dtype))
            attn.plan(np.ones(B, int), prefix + i + 1, table, sm_scale=sm_scale).run(
                cupy.ascontiguousarray(q_rows[:, i]), cache, out=decode)
            same = (decode.view(np.uint16) == verify_rows[:, i].view(np.uint16)).all(axis=(1, 2)).get()
            assert same.all(), (f"N={num_draft} draft {i}: decode and verify differ for requests "
                                f"{np.flatnonzero(~same).tolist()} (prefix {prefix[~same].tolist()})")
        # one request alone, mid-window, in a batch of one: same bits again
        b, i = int(rng.integers(0, B)), int(rng.integers(0, num_draft))
        alone = cupy.full((1, h_q, head_dim), np.nan, np_dtype(dtype))
        attn.plan([1], [int(prefix[b]) + i + 1], table[b:b + 1], sm_scale=sm_scale).run(
            cupy.ascontiguousarray(q_rows[b, i:i + 1]), cache, out=alone)
        assert (alone[0].view(np.uint16) == verify_rows[b, i].view(np.uint16)).all().get()


def test_negative_zero_survives_the_merge():
    """fp16 outputs that round to -0 keep their sign through split partials: uniform
    attention (K = 0) over a V column of alternating -+2^-24 (the smallest fp16
    subnormal) averages to -2^-24 / n for an odd number n of keys, which rounds to -0.
    Decode and verify must agree bit for bit, the sign of zero included, where decode
    has one split (written directly) and verify two (merged), and where verify has
    one empty split more than decode."""
    import cupy
    import cupy_fa
    from cupy_fa import schedule

    rng, _ = new_rng()
    h_q, h_kv, head_dim, page_size, num_draft = 8, 2, 64, 16, 4
    S = schedule.split_size()
    prefix = np.array([S - 3, 3 * S - 2])  # verify windows that cross a split boundary
    kv = prefix + num_draft
    table, num_pages = paged_layout(rng, kv, page_size)
    k_host, v_host = fill_cache(rng, (num_pages, page_size, h_kv, head_dim), np.float16, table, kv, page_size)
    for b in range(len(kv)):  # keys all zero (uniform weights), column 0 of V alternates -a, +a, -a, ...
        for j in range(int(kv[b])):
            page, slot = table[b, j // page_size], j % page_size
            k_host[page, slot] = 0
            v_host[page, slot, :, 0] = np.float16(-(2.0 ** -24) if j % 2 == 0 else 2.0 ** -24)
    cache = cupy_fa.PagedKVCache(cupy.asarray(k_host), cupy.asarray(v_host))
    q = cupy.asarray(rng.standard_normal((len(kv) * num_draft, h_q, head_dim), dtype=np.float32).astype(np.float16))
    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, "float16")
    verify = attn.plan(np.full(len(kv), num_draft), kv, table).run(q, cache).reshape(len(kv), num_draft, h_q, head_dim)
    q_rows = q.reshape(len(kv), num_draft, h_q, head_dim)
    saw_negative_zero = False
    for i in range(num_draft):
        decode = attn.plan(np.ones(len(kv), int), prefix + i + 1, table).run(cupy.ascontiguousarray(q_rows[:, i]),
                                                                              cache)
        bits = decode.view(np.uint16)
        assert (bits == verify[:, i].view(np.uint16)).all().get(), f"draft {i}"
        saw_negative_zero |= bool((bits[..., 0] == 0x8000).any().get())
    assert saw_negative_zero, "the case must produce -0 outputs"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_splits_per_cta_never_changes_a_bit(dtype, page_size, monkeypatch):
    """Grouping several splits into one CTA (CUPY_FA_SPLITS_PER_CTA) is scheduling only:
    decode and verify outputs are bit-identical to one split per CTA, and correct."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, _ = new_rng()
    h_q, h_kv, head_dim = 32, 8, 128
    S = schedule.split_size()
    # q_len 8 on one warp row (16-row CTAs): the first row block's causal clip ends just
    # before a split boundary, so its last split in a group is empty (3 * S + 2 keys)
    monkeypatch.setenv("CUPY_FA_DECODE_WARPS_M", "1")
    cupy_fa.knobs.reload()  # knobs are read once: take the new value
    for q_len in (1, 4, 8):
        kv = np.array([3 * S + 7, S, 1 + q_len, 7 * S - 1, 3 * S + 2 - q_len, int(rng.integers(q_len, 9000))]) + q_len
        q_lens = np.full(len(kv), q_len)
        table, k_host, v_host, cache, q_host = paged_case(rng, dtype, (h_q, h_kv), head_dim, page_size, kv,
                                                           int(q_lens.sum()))
        outs = {}
        for per_cta in ("1", "2", "3"):
            monkeypatch.setenv("CUPY_FA_SPLITS_PER_CTA", per_cta)
            cupy_fa.knobs.reload()  # knobs are read once: take the new value
            out = cupy.full(q_host.shape, np.nan, np_dtype(dtype))
            attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
            attn.plan(q_lens, kv, table).run(cupy.asarray(q_host), cache, out=out)
            assert attn.planned.tile.splits_per_cta == int(per_cta)
            outs[per_cta] = out
        ref = reference.paged_attention(q_host, k_host, v_host, q_lens, kv, table)
        check_attention(outs["1"].get(), ref, dtype, q_lens=q_lens).assert_ok()
        for per_cta in ("2", "3"):
            assert (outs[per_cta].view(np.uint16) == outs["1"].view(np.uint16)).all().get(), per_cta


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_merge_shape_never_changes_a_bit(dtype, head_dim, monkeypatch):
    """The wide merge (8 heads per CTA, one way) and the deep ones (1 head, 8 ways, or a
    way per group of 8 splits) fold in the same order: identical bits, for rows of 1 to 9
    groups, with empty splits (causal clip) among them, and correct against float64."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, _ = new_rng()
    h_q, h_kv = 12, 4  # 3 CTAs of the wide shape, the last one half empty (12 heads, 8 per CTA)
    S = schedule.split_size()
    # q_len 8 on 16-row CTAs: the first row block's causal clip leaves the last split of
    # the 3 S + 2 request empty (as in the splits-per-CTA test)
    for q_len, warps_m in ((1, "auto"), (5, "auto"), (8, "1")):
        monkeypatch.setenv("CUPY_FA_DECODE_WARPS_M", warps_m)
        cupy_fa.knobs.reload()  # knobs are read once: take the new value
        kv = np.array([S + 3, 8 * S, 8 * S + 1, 17 * S - 5, 70 * S + 9, 3 * S + 2 - q_len,
                       int(rng.integers(q_len, 40 * S))]) + q_len
        q_lens = np.full(len(kv), q_len)
        table, k_host, v_host, cache, q_host = paged_case(rng, dtype, (h_q, h_kv), head_dim, 16, kv,
                                                           int(q_lens.sum()))
        outs = {}
        for name in ("wide", "deep", "deepest"):
            shape = getattr(schedule, f"MERGE_{name.upper()}")
            monkeypatch.setattr(schedule, "MERGE_SHAPES", ((0, shape),))
            assert schedule.merge_shape(len(q_host), h_q) == shape
            out = cupy.full(q_host.shape, np.nan, np_dtype(dtype))
            lse = cupy.full(q_host.shape[:2], np.nan, np.float32)
            attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
            attn.plan(q_lens, kv, table).run(cupy.asarray(q_host), cache, out=out, lse=lse)
            outs[name] = (out, lse)
        ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv, table, return_lse=True)
        check_attention(outs["wide"][0].get(), ref, dtype, q_lens=q_lens, lse=outs["wide"][1].get(),
                        ref_lse=ref_lse).assert_ok()
        for name in ("deep", "deepest"):
            assert (outs["wide"][0].view(np.uint16) == outs[name][0].view(np.uint16)).all().get(), name
            assert (outs["wide"][1].view(np.uint32) == outs[name][1].view(np.uint32)).all().get(), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_programmatic_merge_launch_never_changes_a_bit(dtype, monkeypatch):
    """The merge kernel launched as a programmatic dependent of the attention kernel
    (CUPY_FA_PDL, default on) gives the bits of an ordinary launch, eagerly and inside a
    captured CUDA graph replayed over fresh inputs, and is correct against float64."""
    import cupy
    import cupy_fa
    from cupy_fa import _build, reference, schedule

    monkeypatch.setenv("CUPY_FA_PDL", "1")
    cupy_fa.knobs.reload()  # knobs are read once: take the new value
    # On an sm_90+ device built for itself (the H200 of device_check.sh) the programmatic
    # path must really run; elsewhere both launches are ordinary and the comparison still holds.
    if int(cupy.cuda.Device().compute_capability) >= 90 and not os.environ.get("CUPY_FA_ARCH"):
        assert _build._programmatic_launch_enabled(), "sm_90+: the merge must be launched programmatically"
    rng, _ = new_rng()
    h_q, h_kv, head_dim, page_size = 32, 8, 128, 16
    S = schedule.split_size()
    kv = np.array([1, S + 7, 8 * S, 3 * S + 1, int(rng.integers(1, 64 * S))])  # unsplit rows among split ones
    q_lens = np.ones(len(kv), dtype=np.int64)
    table, k_host, v_host, cache, _ = paged_case(rng, dtype, (h_q, h_kv), head_dim, page_size, kv, 0)

    def fresh_q():
        return rng.standard_normal((len(kv), h_q, head_dim), dtype=np.float32).astype(np_dtype(dtype))

    def run(q_host, pdl):
        monkeypatch.setenv("CUPY_FA_PDL", "1" if pdl else "0")
        cupy_fa.knobs.reload()  # knobs are read once: take the new value
        out = cupy.full(q_host.shape, np.nan, np_dtype(dtype))
        attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype).plan(q_lens, kv, table)
        attn._buffers.partial_out.fill(np.nan)  # a merge that read too early would see these
        attn._buffers.partial_lse.fill(np.nan)
        attn.run(cupy.asarray(q_host), cache, out=out)
        return out

    q_host = fresh_q()
    eager = {pdl: run(q_host, pdl) for pdl in (False, True)}
    assert (eager[True].view(np.uint16) == eager[False].view(np.uint16)).all().get()
    ref = reference.paged_attention(q_host, k_host, v_host, q_lens, kv, table)
    check_attention(eager[True].get(), ref, dtype, q_lens=q_lens).assert_ok()

    # captured: plan once, then replay the run (attention + programmatic merge) over new q
    monkeypatch.setenv("CUPY_FA_PDL", "1")
    cupy_fa.knobs.reload()  # knobs are read once: take the new value
    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype).plan(q_lens, kv, table)
    q_dev = cupy.empty((len(kv), h_q, head_dim), np_dtype(dtype))
    out = cupy.empty_like(q_dev)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        attn.run(q_dev, cache, out=out)  # compile and warm outside the capture
        stream.begin_capture()
        attn.run(q_dev, cache, out=out)
        graph = stream.end_capture()
    for _ in range(3):
        q_host = fresh_q()
        q_dev.set(q_host, stream=stream)
        with stream:
            out.fill(np.nan)
            graph.launch(stream)
        stream.synchronize()
        expected = run(q_host, False)
        assert (out.view(np.uint16) == expected.view(np.uint16)).all().get()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fold_splits_never_changes_a_bit(dtype, page_size, monkeypatch):
    """CTAs that fold their own splits (CUPY_FA_FOLD_SPLITS=1, kernels/mma_sync/attention.cu) give the
    bits of partials + merge_kernel (=0) and of plain decode of each token: batches of at most
    two groups of 8 splits per row (a CTA folds a whole row, both levels of merge_kernel) and
    of up to 20 splits (a CTA per group, whose states merge_kernel folds; also how a graph plan,
    which sees only bounds, folds); decode and verify q=4 on the one-row tile (its
    fold-capable variant), verify q=8 and 16 on the two-row tile, at head dims 64 to 256. At 16
    drafts the first row block of the S - 10 prefix sees no key of its last split (causal clip:
    an empty split among the folded), and that of the 8 S - 10 prefix none of its second
    group (an empty group)."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    monkeypatch.setenv("CUPY_FA_DECODE_WARPS_M", "auto")
    cupy_fa.knobs.reload()  # knobs are read once: take the new value
    rng, _ = new_rng()
    h_q, h_kv = 32, 8
    S = schedule.split_size()
    # (head dim, drafts): at D = 64 only the one-row tile has a fold-capable variant
    cases = [(d, n, whole) for d, n in ((128, 1), (128, 4), (128, 8), (128, 16), (64, 1), (64, 4), (256, 4),
                                         (256, 8)) for whole in (True, False)]
    for head_dim, num_draft, whole in cases:
        prefix = np.array([3, S - 10, S + 1, 2 * S - 4, 5 * S + 7, 8 * S - num_draft, 8 * S - 10, 8 * S + 2,
                           9 * S - num_draft, 16 * S - num_draft, int(rng.integers(1, 16 * S - num_draft))])
        if not whole:  # three groups in the batch: a CTA per group
            prefix[-2:] = [16 * S + 5, int(rng.integers(1, 20 * S))]
        B = len(prefix)
        kv, q_lens = prefix + num_draft, np.full(B, num_draft)
        table, k_host, v_host, cache, q_host = paged_case(rng, dtype, (h_q, h_kv), head_dim, page_size, kv,
                                                           B * num_draft)
        q = cupy.asarray(q_host)

        outs = {}
        for fold in ("0", "1"):
            monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", fold)
            cupy_fa.knobs.reload()  # knobs are read once: take the new value
            attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype).plan(q_lens, kv, table)
            assert attn.planned.tile.fold_splits == (fold == "1")
            if fold == "1":
                assert attn.planned.tile.splits_per_cta == (16 if whole else 8)
            assert attn.planned.tile.warps_m == (1 if num_draft * h_q // h_kv <= 16 else 2)
            out = cupy.full(q.shape, np.nan, np_dtype(dtype))
            lse = cupy.full(q.shape[:2], np.nan, np.float32)
            attn.run(q, cache, out=out, lse=lse)
            outs[fold] = (out, lse)
        ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv, table, return_lse=True)
        check_attention(outs["1"][0].get(), ref, dtype, q_lens=q_lens, lse=outs["1"][1].get(),
                        ref_lse=ref_lse).assert_ok()
        case = f"D={head_dim} N={num_draft} {'whole rows' if whole else 'groups'}"
        assert (outs["1"][0].view(np.uint16) == outs["0"][0].view(np.uint16)).all().get(), case
        assert (outs["1"][1].view(np.uint32) == outs["0"][1].view(np.uint32)).all().get(), case

        # planned on the device inside a captured graph (the host sees only the bounds), folded too
        graph_attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
        graph_out = run_planned_in_graph(graph_attn, q_lens, kv, table, q, cache, num_draft, int(kv.max()))
        assert graph_attn.planned.tile.fold_splits, case
        assert (graph_out.view(np.uint16) == outs["0"][0].view(np.uint16)).all().get(), case

        folded = outs["1"][0].reshape(B, num_draft, h_q, head_dim)
        q_rows = q.reshape(B, num_draft, h_q, head_dim)
        decoder = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
        monkeypatch.setenv("CUPY_FA_FOLD_SPLITS", "0")  # plain decode: partials + merge_kernel
        cupy_fa.knobs.reload()  # knobs are read once: take the new value
        for i in range(num_draft):
            decode = cupy.full((B, h_q, head_dim), np.nan, np_dtype(dtype))
            decoder.plan(np.ones(B, int), prefix + i + 1, table).run(cupy.ascontiguousarray(q_rows[:, i]), cache,
                                                                     out=decode)
            same = (decode.view(np.uint16) == folded[:, i].view(np.uint16)).all(axis=(1, 2)).get()
            assert same.all(), (f"{case} draft {i}: decode and folded verify differ for prefixes "
                                f"{prefix[~same].tolist()}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_equals_verify_at_131072_keys(dtype):
    """The longest context whose splits still sit at fixed positions: 256 splits of 512 keys
    (MAX_SPLITS x S = 131072). Verify of 4 drafts whose last one sees all 131072 keys, and a
    window across the boundary of the last two splits, give the bits of plain decode of each
    draft; and the verify rows are right against float64, LSE included."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, _ = new_rng()
    h_q, h_kv, head_dim, page_size, num_draft = 8, 1, 128, 16, 4
    S = schedule.split_size()
    longest = S * schedule.MAX_SPLITS
    prefix = np.array([longest - num_draft, longest - S - 2])
    kv = prefix + num_draft
    B = len(kv)
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, (h_q, h_kv), head_dim, page_size, kv, B * num_draft)
    q = cupy.asarray(q_host)
    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
    verify = poisoned(q.shape, np_dtype(dtype), 2)
    lse = poisoned(q.shape[:2], np.float32, 2)
    attn.plan(np.full(B, num_draft), kv, table).run(q, cache, out=verify[:len(q)], lse=lse[:len(q)])
    assert attn._buffers.num_splits[:B].get().tolist() == [schedule.MAX_SPLITS, schedule.MAX_SPLITS]
    assert attn._buffers.split_keys[:B].get().tolist() == [S, S]
    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, np.full(B, num_draft), kv, table, return_lse=True)
    check = check_attention(verify.get(), ref, dtype, q_lens=np.full(B, num_draft), lse=lse.get(), ref_lse=ref_lse,
                            poison=POISON, label="verify at 131072 keys")
    print(check.summary())
    check.assert_ok()
    rows = verify[:len(q)].reshape(B, num_draft, h_q, head_dim)
    q_rows = q.reshape(B, num_draft, h_q, head_dim)
    for i in range(num_draft):
        decode = cupy.full((B, h_q, head_dim), np.nan, np_dtype(dtype))
        attn.plan(np.ones(B, int), prefix + i + 1, table).run(cupy.ascontiguousarray(q_rows[:, i]), cache, out=decode)
        assert attn._buffers.split_keys[:B].get().tolist() == [S, S]
        same = (decode.view(np.uint16) == rows[:, i].view(np.uint16)).all(axis=(1, 2)).get()
        assert same.all(), f"draft {i}: decode and verify differ for prefixes {prefix[~same].tolist()}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_beyond_131072_keys_splits_grow(dtype):
    """Past 131072 keys a request keeps 256 splits at most and its splits grow (keys per split a
    whole KV tiles of the request's family past 512): decode, verify and prefill-tile rows there are right against float64,
    row by row, LSE included, and the tail of the output is untouched."""
    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, _ = new_rng()
    h_q, h_kv, head_dim, page_size = 4, 1, 128, 16
    S = schedule.split_size()
    longest = S * schedule.MAX_SPLITS
    q_lens = np.array([1, 1, 4, 8, 17])
    kv = np.array([longest + 1, 200_000, 150_000, longest + int(rng.integers(2, 5000)), longest + 100])
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, (h_q, h_kv), head_dim, page_size, kv, total)
    out = poisoned(q_host.shape, np_dtype(dtype), 3)
    lse = poisoned(q_host.shape[:2], np.float32, 3)
    attn = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype)
    attn.plan(q_lens, kv, table).run(cupy.asarray(q_host), cache, out=out[:total], lse=lse[:total])
    splits, keys = attn._buffers.num_splits[:5].get(), attn._buffers.split_keys[:5].get()
    small = q_lens <= schedule.SMALL_Q_LEN
    # split lengths are whole KV tiles of the request's family: 64 keys small-q, the prefill tile's otherwise
    from cupy_fa import _build
    long_block_n = schedule.prefill_tile(head_dim, _build.device_smem_limit(), _build.current_arch()).block_n
    block_n = np.where(small, 64, long_block_n)
    assert (splits[small] <= schedule.MAX_SPLITS).all() and (keys[small] > S).all() and (keys % block_n == 0).all()
    assert ((splits - 1) * keys < kv).all() and (kv <= splits * keys).all()
    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv, table, return_lse=True)
    check = check_attention(out.get(), ref, dtype, q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse, poison=POISON,
                            label="beyond 131072 keys")
    print(check.summary(), "splits", splits.tolist(), "keys per split", keys.tolist())
    check.assert_ok()


def test_a_workspace_overflow_is_said_and_stays_correct():
    """A batch whose split partials overflow the workspace (a request of 137 splits against an
    instance sized for 128 rows a request): one BatchInvarianceWarning naming the workspace_bytes
    that would hold it, rows still right against float64; an instance built with that workspace
    plans the same batch silently and keeps the fixed 512-key splits."""
    import warnings

    import cupy
    import cupy_fa
    from cupy_fa import reference, schedule

    rng, seed = new_rng()
    h_q, h_kv, head_dim, page_size, dtype = 4, 1, 64, 16, "bfloat16"
    S = schedule.split_size()
    kv = np.array([137 * S - int(rng.integers(0, S))])
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, (h_q, h_kv), head_dim, page_size, kv, 1)
    small = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, workspace_bytes=1)  # 128 rows a request
    with pytest.warns(cupy_fa.BatchInvarianceWarning, match=r"need 137 rows") as said:
        small.plan([1], kv, table)
    wanted = int(re.search(r"workspace_bytes >= (\d+)", str(said[0].message)).group(1))
    out = small.run(cupy.asarray(q_host), cache).get()
    assert small._buffers.split_keys[:1].get()[0] > S  # capped: longer splits
    ref = reference.paged_attention(q_host, k_host, v_host, [1], kv, table)
    check_attention(out, ref, dtype, q_lens=[1], label=f"seed {seed} capped splits").assert_ok()
    with warnings.catch_warnings():
        warnings.simplefilter("error", cupy_fa.BatchInvarianceWarning)
        roomy = cupy_fa.BatchAttention(h_q, h_kv, head_dim, dtype, workspace_bytes=wanted)
        roomy.plan([1], kv, table)
        assert roomy._buffers.split_keys[:1].get()[0] == S
        small.plan([1], kv, table)  # said once per instance
