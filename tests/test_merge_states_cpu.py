"""cupy_fa.reference.merge_states (float64) and merge_states' argument rules, no GPU: the merge of
two parts' states is the attention over all their keys, empty sides are the identity, and bad
shapes or dtypes are refused naming the argument."""

import re

import numpy as np
import pytest

from cases import new_rng, np_dtype

import cupy_fa
from cupy_fa import merge, reference


def dense_case(rng, q_len, kv_len, h_q=8, h_kv=2, d=64):
    q = rng.standard_normal((q_len, h_q, d))
    k = rng.standard_normal((kv_len, 1, h_kv, d))  # page size 1: key j in page j
    v = rng.standard_normal((kv_len, 1, h_kv, d))
    return q, k, v


def part(q, k, v, keys, causal):
    """The float64 state of all q rows over the keys `keys` (a page-size-1 page table row); without
    a mask each row is a request of its own (the contract wants q_len <= kv_len)."""
    n = 1 if not causal else len(q)
    table = np.tile(np.asarray(keys, np.int64)[None], (len(q) // n, 1))
    return reference.paged_attention(q, k, v, [n] * (len(q) // n), [len(keys)] * (len(q) // n), table, causal=causal,
                                     return_lse=True)


@pytest.mark.parametrize("q_len", [1, 7])
def test_merge_of_two_parts_is_attention_over_all_keys(q_len):
    """Keys [0, c) without a mask (every query sees them all) and [c, kv) causally, merged: the
    attention over all kv keys with the contract's causal mask, to float64 rounding."""
    rng, _ = new_rng()
    kv = 300
    q, k, v = dense_case(rng, q_len, kv)
    whole, whole_lse = part(q, k, v, np.arange(kv), causal=True)
    for c in (1, 150, kv - q_len):
        out_a, lse_a = part(q, k, v, np.arange(c), causal=False)
        out_b, lse_b = part(q, k, v, np.arange(c, kv), causal=True)
        out, lse = reference.merge_states(out_a, lse_a, out_b, lse_b)
        assert np.abs(out - whole).max() < 1e-12 and np.abs(lse - whole_lse).max() < 1e-12
        swapped, swapped_lse = reference.merge_states(out_b, lse_b, out_a, lse_a)  # symmetric
        assert np.abs(swapped - whole).max() < 1e-12 and np.abs(swapped_lse - whole_lse).max() < 1e-12


def test_empty_sides_and_nan():
    """lse -inf: that side is ignored (its out may hold anything); both: out 0, lse -inf; NaN: NaN."""
    rng, _ = new_rng()
    a = rng.standard_normal((4, 3, 8))
    b = rng.standard_normal((4, 3, 8))
    la = rng.standard_normal((4, 3))
    lb = rng.standard_normal((4, 3))
    la[0], lb[1], la[2], lb[2] = -np.inf, -np.inf, -np.inf, -np.inf
    a[0], b[1], a[2], b[2] = np.nan, np.inf, np.nan, np.nan
    la[3, 0] = np.nan
    out, lse = reference.merge_states(a, la, b, lb)
    assert np.array_equal(out[0], b[0]) and np.array_equal(lse[0], lb[0])
    assert np.array_equal(out[1], a[1]) and np.array_equal(lse[1], la[1])
    assert (out[2] == 0).all() and (lse[2] == -np.inf).all()
    assert np.isnan(out[3, 0]).all() and np.isnan(lse[3, 0])
    assert np.isfinite(out[3, 1:]).all() and np.isfinite(lse[3, 1:]).all()


def test_reference_merge_rejects_bad_shapes():
    a = np.zeros((2, 3, 8))
    with pytest.raises(ValueError, match=re.escape("must both be [N, H, D]")):
        reference.merge_states(a, np.zeros((2, 3)), np.zeros((2, 3, 4)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"lse_a .* \[N, H\]"):
        reference.merge_states(a, np.zeros((2,)), a, np.zeros((2, 3)))


def test_merge_states_shape_and_dtype_rules():
    """merge.check_shapes, the rules merge_states applies before anything reaches the device."""
    bf16 = np_dtype("bfloat16")
    a = np.zeros((5, 4, 96), bf16)
    lse = np.zeros((5, 4), np.float32)
    assert merge.check_shapes(a, lse, a, lse) == "bfloat16"
    assert merge.check_shapes(a.astype(np.float16), lse, a.astype(np.float16), lse, a.astype(np.float16), lse) \
        == "float16"
    bad = [
        ((a[0], lse, a, lse), ValueError, r"out_a must be \[N, H, D\]"),
        ((a, lse, a[:4], lse), ValueError, "out_b has shape"),
        ((a, lse, a.astype(np.float16), lse), TypeError, "out_b has dtype"),
        ((a.astype(np.float32), lse, a.astype(np.float32), lse), TypeError, "out_a.dtype must be float16 or bfloat16"),
        ((a, lse.astype(np.float64), a, lse), TypeError, "lse_a must be float32"),
        ((a, lse, a, lse[:, :3]), ValueError, r"lse_b has shape \(5, 3\), expected \[N, H\] = \(5, 4\)"),
        ((a[:, :, :94], lse, a[:, :, :94], lse), ValueError, "multiple of 4"),
        ((np.zeros((1, 1, 1028), bf16), lse[:1, :1], np.zeros((1, 1, 1028), bf16), lse[:1, :1]), ValueError,
         "from 4 to 1024"),
        ((a, lse, a, lse, a[:, :2]), ValueError, "out has shape"),
        ((a, lse, a, lse, a.astype(np.float16)), TypeError, "out has dtype"),
        ((a, lse, a, lse, a, lse.T), ValueError, "lse_out has shape"),
    ]
    for args, exc, match in bad:
        with pytest.raises(exc, match=match):
            merge.check_shapes(*args)


def test_public_names():
    assert cupy_fa.merge_states is merge.merge_states and "merge_states" in cupy_fa.__all__
    assert "merge_states" in reference.__all__

