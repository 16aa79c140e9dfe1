"""Mode conventions -> contract lengths (CPU): every mode, both conventions."""

import numpy as np
import pytest

from cupy_fa.modes import ForwardMode as M, contract_lengths, from_sglang

P = np.array([0, 7, 130, 4096])
N = 4


@pytest.mark.parametrize("mode,kwargs,q,kv", [
    (M.EXTEND, dict(new_lens=np.array([5, 1, 9, 2])), [5, 1, 9, 2], P + [5, 1, 9, 2]),
    (M.DECODE, {}, [1, 1, 1, 1], P + 1),
    (M.MIXED, dict(new_lens=np.array([1, 30, 1, 2])), [1, 30, 1, 2], P + [1, 30, 1, 2]),
    (M.TARGET_VERIFY, dict(num_draft_tokens=N), [N] * 4, P + N),
    (M.DRAFT_EXTEND, dict(accepted_lens=np.array([1, 3, 5, 2])), [1, 3, 5, 2], P + [1, 3, 5, 2]),
    (M.DRAFT_EXTEND_V2, dict(num_draft_tokens=N), [N] * 4, P + N),
])
def test_contract_lengths(mode, kwargs, q, kv):
    got_q, got_kv = contract_lengths(mode, prefix_lens=P, **kwargs)
    assert np.array_equal(got_q, q) and np.array_equal(got_kv, kv)
    assert (got_q <= got_kv).all()


def test_sglang_conventions_agree_with_contract():
    """sglang's seq_lens is prefix-only for TARGET_VERIFY but already bumped for
    DRAFT_EXTEND_V2: both must land on the same contract (the seed bug)."""
    for mode, seq_lens in [(M.TARGET_VERIFY, P), (M.DRAFT_EXTEND_V2, P + N)]:
        q, kv = from_sglang(mode, seq_lens, num_draft_tokens=N)
        assert np.array_equal(kv, P + N) and np.array_equal(q, [N] * 4), mode
    q, kv = from_sglang(M.DECODE, P + 1)
    assert np.array_equal(kv, P + 1) and np.array_equal(q, [1] * 4)
    q, kv = from_sglang(M.EXTEND, P + 3, extend_seq_lens=np.array([3] * 4))
    assert np.array_equal(kv, P + 3)
    q, kv = from_sglang(M.DRAFT_EXTEND, P + 2, accept_lens=np.array([2] * 4))
    assert np.array_equal(kv, P + 2)
    # the seed bug: reading DRAFT_EXTEND_V2's seq_lens as prefix-only would double-count N
    q, kv = from_sglang(M.TARGET_VERIFY, P + N, num_draft_tokens=N)
    assert not np.array_equal(kv, P + N)


def test_idle_and_missing_arguments():
    q, kv = contract_lengths(M.IDLE)
    assert q.size == 0 and kv.size == 0
    with pytest.raises(ValueError, match="num_draft_tokens"):
        contract_lengths(M.TARGET_VERIFY, prefix_lens=P)
    with pytest.raises(ValueError, match="accepted_lens"):
        contract_lengths(M.DRAFT_EXTEND, prefix_lens=P)
    with pytest.raises(ValueError, match="prefix_lens"):
        contract_lengths(M.DECODE)
    with pytest.raises(ValueError):
        contract_lengths("not a mode", prefix_lens=P)
