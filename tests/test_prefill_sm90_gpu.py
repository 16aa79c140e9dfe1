"""GPU correctness of the sm_90a prefill family (cupy_fa/prefill_sm90.py) against the float64
reference, and its batch invariance. Hopper only: on another GPU these skip with that reason."""

import numpy as np
import pytest

from cases import POISON, check_attention, new_rng, np_dtype, paged_case, poisoned, random_lengths

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_sm90():
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the sm_90a prefill family runs on compute capability 9.0 (Hopper) only")


def run(dtype, heads, head_dim, page_size, causal, q_lens, kv_lens, rng, tile=None, tail=3):
    """(out, lse, reference out, reference lse) of one random paged case (NaN in every cache
    slot no request may read); out and lse are the whole poisoned buffers, ``tail`` rows past
    the live ones included."""
    import cupy

    from cupy_fa import prefill_sm90 as s9, reference

    h_q, h_kv = heads
    total = int(q_lens.sum())
    table, k_host, v_host, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, total)
    out = poisoned((total, h_q, head_dim), np_dtype(dtype), tail)
    lse = poisoned((total, h_q), np.float32, tail)
    s9.Sm90Prefill(h_q, h_kv, head_dim, dtype, tile).plan(q_lens, kv_lens, table, causal=causal).run(
        cupy.asarray(q_host), cache, out[:total], lse[:total])
    ref, ref_lse = reference.paged_attention(q_host, k_host, v_host, q_lens, kv_lens, table, causal=causal,
                                             return_lse=True)
    return out.get(), lse.get(), ref, ref_lse


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16, 48])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_random_ragged_batch(dtype, head_dim, page_size, causal):
    rng, seed = new_rng()
    q_lens, kv_lens = random_lengths(rng, max_requests=9, max_q=700, max_kv=4000, work_budget=1_500_000)
    got, got_lse, ref, ref_lse = run(dtype, (16, 4), head_dim, page_size, causal, q_lens, kv_lens, rng)
    check = check_attention(got, ref, dtype, q_lens=q_lens, lse=got_lse, ref_lse=ref_lse, poison=POISON,
                            label=f"seed {seed} sm90 prefill")
    print(check.summary())
    check.assert_ok()


def check_bits_in_any_batch(dtype, tile=None, with_lse=True):
    """A request's out (and lse) bit-identical alone and inside a batch of other requests (prefill,
    a split extend, a decode row), at another position, on ``tile`` (default: the head dim's)."""
    import cupy

    from cupy_fa import prefill_sm90 as s9

    rng, _ = new_rng()
    (h_q, h_kv), d, ps = (32, 8), 128, 16
    q_lens, kv_lens = np.array([300, 20, 777, 1]), np.array([300, 3000, 1500, 60])
    total = int(q_lens.sum())
    table, _, _, cache, q_host = paged_case(rng, dtype, (h_q, h_kv), d, ps, kv_lens, total)
    q = cupy.asarray(q_host)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    out = cupy.empty((total, h_q, d), np_dtype(dtype))
    lse = cupy.empty((total, h_q), np.float32) if with_lse else None
    s9.Sm90Prefill(h_q, h_kv, d, dtype, tile).plan(q_lens, kv_lens, table).run(q, cache, out, lse)
    for b in range(len(q_lens)):
        one = cupy.empty((int(q_lens[b]), h_q, d), np_dtype(dtype))
        one_lse = cupy.empty((int(q_lens[b]), h_q), np.float32) if with_lse else None
        s9.Sm90Prefill(h_q, h_kv, d, dtype, tile).plan(q_lens[b:b + 1], kv_lens[b:b + 1], table[b:b + 1]).run(
            q[cu[b]:cu[b + 1]], cache, one, one_lse)
        assert (out[cu[b]:cu[b + 1]].view(cupy.uint16) == one.view(cupy.uint16)).all(), f"request {b} out"
        if with_lse:
            assert (lse[cu[b]:cu[b + 1]].view(cupy.uint32) == one_lse.view(cupy.uint32)).all(), f"request {b} lse"


def test_a_request_keeps_its_bits_in_any_batch():
    """Rows never mix: a request's out and lse are bit-identical alone and inside a batch of
    other requests (prefill, a split extend, a decode row), at another position."""
    check_bits_in_any_batch("bfloat16")


@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 128), ("float16", 128), ("bfloat16", 64)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_round2_persistent_variant_matches_the_reference(dtype, head_dim, page_size, causal):
    """The persistent-grid variant with the joint softmax (each CTA runs several work items,
    the items handed over through shared memory) on random ragged batches."""
    from cupy_fa import prefill_sm90 as s9

    tile = s9.Sm90Tile(head_dim, 128, 2 if head_dim == 128 else 4, uniform_wg=True, joint_rows=True, persistent=True)
    rng, seed = new_rng()
    q_lens, kv_lens = random_lengths(rng, max_requests=9, max_q=700, max_kv=4000, work_budget=1_500_000)
    got, got_lse, ref, ref_lse = run(dtype, (16, 4), head_dim, page_size, causal, q_lens, kv_lens, rng, tile)
    check = check_attention(got, ref, dtype, q_lens=q_lens, lse=got_lse, ref_lse=ref_lse, poison=POISON,
                            label=f"seed {seed} sm90 prefill, persistent")
    print(check.summary())
    check.assert_ok()


# The opt-in traits lab/probe_prefill_sm90.py times against the default: the lean producer
# copies (zero fill by the copy's ignore-src predicate), a polynomial share of the exp2s on the
# unmasked tiles, 3 consumer warpgroups (192 rows, ping-pong in turn over three).
def _opt_in_tiles():
    from cupy_fa import prefill_sm90 as s9

    uj = dict(uniform_wg=True, joint_rows=True)
    return [
        ("bfloat16", s9.Sm90Tile(128, 128, 2, lean_copy=True, **uj)),
        ("float16", s9.Sm90Tile(256, 80, 2, pingpong=False, lean_copy=True)),
        ("float16", s9.Sm90Tile(128, 128, 2, lean_copy=True, poly_exp2=2, **uj)),
        ("bfloat16", s9.Sm90Tile(64, 128, 4, lean_copy=True, poly_exp2=1, **uj)),
        ("bfloat16", s9.Sm90Tile(64, 128, 4, lean_copy=True, consumer_wgs=3, producer_regs=32, **uj)),
        ("float16", s9.Sm90Tile(128, 80, 2, lean_copy=True, consumer_wgs=3, producer_regs=32, **uj)),
    ]


@pytest.mark.parametrize("which", range(6), ids=["lean", "lean_d256_f16", "poly2_f16", "poly1_d64", "w3_d64",
                                                  "w3_bn80_f16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_opt_in_variant_matches_the_reference(which, page_size, causal):
    dtype, tile = _opt_in_tiles()[which]
    rng, seed = new_rng()
    q_lens, kv_lens = random_lengths(rng, max_requests=9, max_q=700, max_kv=4000, work_budget=1_500_000)
    got, got_lse, ref, ref_lse = run(dtype, (16, 4), tile.head_dim, page_size, causal, q_lens, kv_lens, rng, tile)
    check = check_attention(got, ref, dtype, q_lens=q_lens, lse=got_lse, ref_lse=ref_lse, poison=POISON,
                            label=f"seed {seed} sm90 prefill, {tile.traits()}")
    print(check.summary())
    check.assert_ok()


def test_three_consumer_variant_keeps_a_requests_bits_in_any_batch():
    """Batch invariance holds with 192-row tiles too (a request alone and in a batch)."""
    _, tile = _opt_in_tiles()[5]
    check_bits_in_any_batch("float16", tile, with_lse=False)


