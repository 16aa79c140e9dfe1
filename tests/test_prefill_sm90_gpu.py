"""GPU correctness of the sm_90a prefill family (kernels/sm90/prefill.cu) through BatchAttention,
against the float64 reference, and its batch invariance, at every head dim and with the soft-cap's
tanh forms. Hopper only: on another GPU these skip with that reason."""

import dataclasses
import numpy as np
import pytest

from cases import POISON, check_attention, new_rng, np_dtype, paged_case, poisoned, random_lengths

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("needs_sm90")]  # tests/conftest.py


def attention(dtype, heads, head_dim, q_lens, kv_lens, table, causal=True):
    """A BatchAttention planned for the step, and a check that its long requests run on the family."""
    from cupy_fa import BatchAttention, schedule
    from cupy_fa.families import SM90_WGMMA

    attn = BatchAttention(*heads, head_dim, dtype).plan(q_lens, kv_lens, table, causal=causal)
    if (np.asarray(q_lens) > schedule.SMALL_Q_LEN).any():
        assert attn.planned.long_tile.family is SM90_WGMMA, attn.planned.long_tile
    return attn


def run(dtype, heads, head_dim, page_size, causal, q_lens, kv_lens, rng, tail=3):
    """(out, lse, reference out, reference lse) of one random paged case (NaN in every cache
    slot no request may read); out and lse are the whole poisoned buffers, ``tail`` rows past
    the live ones included."""
    import cupy

    from cupy_fa import reference

    h_q, _ = heads
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total)
    out = poisoned((total, h_q, head_dim), np_dtype(dtype), tail)
    lse = poisoned((total, h_q), np.float32, tail)
    attention(dtype, heads, head_dim, q_lens, kv_lens, table, causal).run(cupy.asarray(q_host), cache, out[:total],
                                                                          lse=lse[:total])
    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, table, causal=causal,
                                             return_lse=True)
    return out.get(), lse.get(), ref, ref_lse


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("page_size", [1, 16, 48, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_random_ragged_batch(dtype, head_dim, page_size, causal):
    rng, seed = new_rng()
    q_lens, kv_lens = random_lengths(rng, max_requests=9, max_q=700, max_kv=4000, work_budget=1_500_000)
    q_lens[0] = max(q_lens[0], 17)  # at least one request on the family
    kv_lens[0] = max(kv_lens[0], q_lens[0])
    got, got_lse, ref, ref_lse = run(dtype, (16, 4), head_dim, page_size, causal, q_lens, kv_lens, rng)
    check = check_attention(got, ref, dtype, q_lens=q_lens, lse=got_lse, ref_lse=ref_lse, poison=POISON,
                            label=f"seed {seed} sm90 prefill")
    print(check.summary())
    check.assert_ok()


@pytest.mark.parametrize("dtype,head_dim,with_lse", [("bfloat16", 128, True), ("float16", 128, False),
                                                     ("bfloat16", 64, True), ("float16", 256, True),
                                                     ("bfloat16", 96, True), ("float16", 192, True)])
def test_a_request_keeps_its_bits_in_any_batch(dtype, head_dim, with_lse):
    """Rows never mix: a request's out and lse are bit-identical alone and inside a batch of
    other requests (prefill, a split extend, a decode row), at another position."""
    import cupy

    rng, _ = new_rng()
    heads, ps = (32, 8), 16
    q_lens, kv_lens = np.array([300, 20, 777, 1]), np.array([300, 3000, 1500, 60])
    total = int(q_lens.sum())
    table, _, _, cache, q_host = paged_case(rng, dtype, heads, head_dim, ps, kv_lens, total)
    q = cupy.asarray(q_host)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    out = cupy.empty((total, heads[0], head_dim), np_dtype(dtype))
    lse = cupy.empty((total, heads[0]), np.float32) if with_lse else None
    attention(dtype, heads, head_dim, q_lens, kv_lens, table).run(q, cache, out, lse=lse)
    for b in range(len(q_lens)):
        one = cupy.empty((int(q_lens[b]), heads[0], head_dim), np_dtype(dtype))
        one_lse = cupy.empty((int(q_lens[b]), heads[0]), np.float32) if with_lse else None
        attention(dtype, heads, head_dim, q_lens[b:b + 1], kv_lens[b:b + 1], table[b:b + 1]).run(
            q[cu[b]:cu[b + 1]], cache, one, lse=one_lse)
        assert (out[cu[b]:cu[b + 1]].view(cupy.uint16) == one.view(cupy.uint16)).all(), f"request {b} out"
        if with_lse:
            assert (lse[cu[b]:cu[b + 1]].view(cupy.uint32) == one_lse.view(cupy.uint32)).all(), f"request {b} lse"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("tanh", [0, 1, 2], ids=["tanh-exact", "tanh-approx", "tanh-newton"])
def test_soft_cap_near_saturation(dtype, head_dim, tanh):
    """The hooked tile's soft-cap where tanh saturates: caps of 5 and 50 with scores that reach
    several times the cap (sm_scale up to 40 / sqrt(D)), so many keys of a row sit on the cap and the
    softmax weighs them by the tanh's last bits; with a window and sinks too. Each form of the tanh
    (Sm90Tile.tanh: 0 the exact, 1 tanh.approx, 2 the Newton), against float64 with the LSE."""
    import cupy
    import cupy_fa
    from cupy_fa import knobs, reference
    from cupy_fa.families import sm90

    before = knobs.use(dataclasses.replace(knobs.knobs(), soft_cap_tanh=knobs.SOFT_CAP_TANH_FORMS[tanh]))
    try:
        rng, seed = new_rng()
        heads, page_size = (16, 4), 16
        q_lens, kv_lens = np.array([257, 40, 500]), np.array([257, 900, 1100])
        total = int(q_lens.sum())
        table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total)
        for cap, scale, window, sinks in ((5.0, 1.0 / np.sqrt(head_dim) * 4, None, None),
                                          (50.0, 40.0 / np.sqrt(head_dim), None, None),
                                          (50.0, 20.0 / np.sqrt(head_dim), 300, rng.normal(30.0, 10.0, heads[0]))):
            sinks = None if sinks is None else sinks.astype(np.float32)
            out = poisoned((total, heads[0], head_dim), np_dtype(dtype), 3)
            lse = poisoned((total, heads[0]), np.float32, 3)
            attn = cupy_fa.BatchAttention(*heads, head_dim, dtype)
            attn.plan(q_lens, kv_lens, table, sm_scale=float(scale), logits_soft_cap=cap, window=window)
            assert attn.planned.long_tile.family is sm90.SM90_WGMMA
            attn.run(cupy.asarray(q_host), cache, out=out[:total], lse=lse[:total],
                     sinks=None if sinks is None else cupy.asarray(sinks))
            ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, table, sm_scale=scale,
                                                     soft_cap=cap, window=window, sinks=sinks, return_lse=True)
            check = check_attention(out.get(), ref, dtype, q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse,
                                    poison=POISON, label=f"seed {seed} tanh {tanh} cap {cap} scale {scale:.3g} "
                                                         f"window {window} sinks {sinks is not None}")
            print(check.summary())
            check.assert_ok()
    finally:
        knobs.use(before)
