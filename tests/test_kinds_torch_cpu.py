"""Serving-mode lengths from torch tensors come back as torch tensors (marker cpu_torch)."""

import pytest
import torch

from cupy_fa.modes import ForwardMode as M, contract_lengths, from_sglang

pytestmark = pytest.mark.cpu_torch


def test_torch_in_torch_out():
    prefix = torch.tensor([10, 20], dtype=torch.int32)
    q, kv = contract_lengths(M.DECODE, prefix_lens=prefix)
    assert isinstance(q, torch.Tensor) and q.dtype == torch.int32 and q.tolist() == [1, 1] and kv.tolist() == [11, 21]
    q, kv = contract_lengths(M.EXTEND, prefix_lens=prefix, new_lens=[3, 4])  # a list beside a tensor joins it
    assert isinstance(q, torch.Tensor) and kv.tolist() == [13, 24]
    q, kv = from_sglang(M.TARGET_VERIFY, prefix, num_draft_tokens=4)
    assert q.tolist() == [4, 4] and kv.tolist() == [14, 24]


def test_cpu_torch_values_are_checked():
    with pytest.raises(ValueError, match=r"prefix_lens\[1\] = -2 is negative"):
        contract_lengths(M.DECODE, prefix_lens=torch.tensor([1, -2]))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 2 is below extend_seq_lens\[0\] = 3"):
        from_sglang(M.EXTEND, torch.tensor([2]), extend_seq_lens=torch.tensor([3]))
    with pytest.raises(TypeError, match="new_lens must hold integers"):
        contract_lengths(M.EXTEND, prefix_lens=torch.tensor([1]), new_lens=torch.tensor([1.0]))
