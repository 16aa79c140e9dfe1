"""cupy_fa's kernels replaced by the float64 reference, for the CPU: what ``Kernels`` hands the
backend (a cache view and BatchAttention-like objects), computing what the kernels compute from
exactly what they are given, and holding the backend to the contract the kernels assume (bounds,
q_len <= kv_len, page-table width, mask size) so a wrong mapping fails loudly on the CPU."""

import dataclasses

import numpy as np
import torch

from cupy_fa import reference

FP8 = torch.float8_e4m3fn


@dataclasses.dataclass
class Cache:
    k: torch.Tensor  # [slots, 1, H_kv, D]
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


class RefAttention:
    def __init__(self, num_qo_heads, num_kv_heads, head_dim, capacity):
        self.heads, self.kv_heads, self.head_dim, self.capacity = num_qo_heads, num_kv_heads, head_dim, capacity
        self.planned = None
        self.plans = 0

    def plan(self, q_lens, kv_lens, page_table, *, causal=True, sm_scale=None, custom_mask=None, max_q_len=None,
             max_kv_len=None, window=None, logits_soft_cap=None):
        q, kv = q_lens.cpu().numpy().astype(np.int64), kv_lens.cpu().numpy().astype(np.int64)
        assert q.shape == kv.shape and page_table.shape[0] == q.shape[0], (q.shape, kv.shape, page_table.shape)
        assert (q >= 0).all() and ((q == 0) | (q <= kv)).all(), f"q_lens {q} kv_lens {kv}: q_len > kv_len"
        assert max_q_len is not None and (q <= max_q_len).all(), f"q_lens {q} above max_q_len {max_q_len}"
        assert max_kv_len is None or (kv <= max_kv_len).all(), f"kv_lens {kv} above max_kv_len {max_kv_len}"
        assert (kv <= page_table.shape[1]).all(), f"kv_lens {kv} past the page table's {page_table.shape[1]} columns"
        if custom_mask is not None:
            assert custom_mask.numel() == int((q ** 2).sum()), (custom_mask.numel(), q)
        if self.capacity is not None:
            assert q.shape[0] <= self.capacity[0] and page_table.shape[1] <= self.capacity[2], (q.shape, self.capacity)
        self.planned = dict(q=q, kv=kv, table=page_table.cpu().numpy().copy(), causal=causal, sm_scale=sm_scale,
                            mask=None if custom_mask is None else custom_mask.cpu().numpy().copy(),
                            window=window, soft_cap=logits_soft_cap)
        self.plans += 1
        return self

    def run(self, q, cache, out=None, *, sinks=None):
        p = self.planned
        assert p is not None, "run before plan"
        total = int(p["q"].sum())
        assert q.shape[0] >= total and q.shape[1:] == (self.heads, self.head_dim), (q.shape, total)
        if total == 0:
            return out
        fp8 = cache.k.dtype == FP8
        k = cache.k.view(torch.uint8).numpy() if fp8 else cache.k.detach().float().numpy()
        v = cache.v.view(torch.uint8).numpy() if fp8 else cache.v.detach().float().numpy()
        scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale) if fp8 else {}
        live = p["q"] > 0
        ref = reference.paged_attention(
            q[:total].detach().float().numpy(), k, v, p["q"][live], p["kv"][live], p["table"][live],
            causal=p["causal"], sm_scale=p["sm_scale"], window=p["window"], soft_cap=p["soft_cap"],
            sinks=None if sinks is None else sinks.detach().double().numpy(), custom_mask=_live_mask(p, live),
            **scales)
        out[:total] = torch.from_numpy(ref).to(out.dtype)
        return out


def _live_mask(p, live):
    if p["mask"] is None:
        return None
    sizes = p["q"] ** 2
    parts = np.split(p["mask"], np.cumsum(sizes)[:-1])
    return np.concatenate([m for m, keep in zip(parts, live) if keep]) if live.any() else p["mask"][:0]


class RefKernels:
    """Drop-in for ``cupy_fa.integrations.sglang.kernels.Kernels``; ``made`` lists every RefAttention."""

    made = []

    def cache(self, layer_id, k_buffer, v_buffer, k_scale=None, v_scale=None):
        from cupy_fa.integrations.sglang.kernels import scale_value

        k = k_buffer.view(k_buffer.shape[0], 1, *k_buffer.shape[1:])
        v = v_buffer.view(v_buffer.shape[0], 1, *v_buffer.shape[1:])
        assert k.data_ptr() == k_buffer.data_ptr()  # zero copy
        return Cache(k, v, scale_value(k_scale), scale_value(v_scale))

    def attention(self, num_qo_heads, num_kv_heads, head_dim, dtype, kv_dtype, device, capacity=None):
        attn = RefAttention(num_qo_heads, num_kv_heads, head_dim, capacity)
        RefKernels.made.append(attn)
        return attn
