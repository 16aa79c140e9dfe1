"""cupy_fa's kernels replaced by the float64 reference, for the CPU: what ``Kernels`` hands the
backend (cache views, BatchAttention- and MLAAttention-like objects), computing what the kernels
compute from exactly what they are given, and holding the backend to the contract the kernels assume
(bounds, q_len <= kv_len, page-table width, mask size, MLA's 512 + 64 latent) so a wrong mapping fails
loudly on the CPU."""

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


@dataclasses.dataclass
class LatentCache:
    latent: torch.Tensor  # [slots, 1, 576]: one-token pages
    scale: float = 1.0


class RefAttention:
    def __init__(self, num_qo_heads, num_kv_heads, head_dim, capacity):
        self.heads, self.kv_heads, self.head_dim, self.capacity = num_qo_heads, num_kv_heads, head_dim, capacity
        self.planned = None
        self.plans = 0

    def plan(self, q_lens, kv_lens, page_table, *, causal=True, sm_scale=None, custom_mask=None, max_q_len=None,
             max_kv_len=None, window=None, logits_soft_cap=None):
        """Keeps the device inputs by reference, as the kernels' plan does with device lengths: they are
        read when the step runs (in a CUDA graph: at each replay), so nothing here reads the device."""
        assert max_q_len is not None, "device lengths need max_q_len"
        self.planned = dict(inputs=(q_lens, kv_lens, page_table, custom_mask), causal=causal, sm_scale=sm_scale,
                            window=window, soft_cap=logits_soft_cap, max_q_len=max_q_len, max_kv_len=max_kv_len)
        self.plans += 1
        return self

    def _read(self):
        """The planned step's inputs as the kernels see them, held to the contract they assume."""
        p = dict(self.planned)
        q_lens, kv_lens, page_table, custom_mask = p["inputs"]
        q, kv = q_lens.cpu().numpy().astype(np.int64), kv_lens.cpu().numpy().astype(np.int64)
        assert q.shape == kv.shape and page_table.shape[0] == q.shape[0], (q.shape, kv.shape, page_table.shape)
        assert (q >= 0).all() and ((q == 0) | (q <= kv)).all(), f"q_lens {q} kv_lens {kv}: q_len > kv_len"
        assert (q <= p["max_q_len"]).all(), f"q_lens {q} above max_q_len {p['max_q_len']}"
        assert p["max_kv_len"] is None or (kv <= p["max_kv_len"]).all(), f"kv_lens {kv} above {p['max_kv_len']}"
        assert (kv <= page_table.shape[1]).all(), f"kv_lens {kv} past the page table's {page_table.shape[1]} columns"
        if custom_mask is not None:
            assert custom_mask.numel() == int((q ** 2).sum()), (custom_mask.numel(), q)
        if self.capacity is not None:
            assert q.shape[0] <= self.capacity[0] and page_table.shape[1] <= self.capacity[2], (q.shape, self.capacity)
        p.update(q=q, kv=kv, table=page_table.cpu().numpy(),
                 mask=None if custom_mask is None else custom_mask.cpu().numpy())
        return p

    def _rows(self, q, width):
        """The planned step's inputs, checked against q ``[>= T, H, width]``; T = its query rows."""
        assert self.planned is not None, "run before plan"
        p = self._read()
        assert not q.requires_grad, "q requires grad: the kernels' DLPack import refuses it"
        total = int(p["q"].sum())
        assert q.shape[0] >= total and q.shape[1:] == (self.heads, width), (q.shape, total)
        return p, total, p["q"] > 0

    def run(self, q, cache, out=None, *, sinks=None):
        p, total, live = self._rows(q, self.head_dim)
        if total == 0:
            return out
        fp8 = cache.k.dtype == FP8
        k = cache.k.view(torch.uint8).numpy() if fp8 else cache.k.detach().float().numpy()
        v = cache.v.view(torch.uint8).numpy() if fp8 else cache.v.detach().float().numpy()
        scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale) if fp8 else {}
        ref = reference.paged_attention(
            q[:total].detach().float().numpy(), k, v, p["q"][live], p["kv"][live], p["table"][live],
            causal=p["causal"], sm_scale=p["sm_scale"], window=p["window"], soft_cap=p["soft_cap"],
            sinks=None if sinks is None else sinks.detach().double().numpy(), custom_mask=_live_mask(p, live),
            **scales)
        out[:total] = torch.from_numpy(ref).to(out.dtype)
        return out


class RefMLAAttention(RefAttention):
    """MLAAttention's counterpart: ``cupy_fa.reference.mla_attention`` over the latent pages."""

    def __init__(self, num_heads, capacity):
        super().__init__(num_heads, 1, reference.mla.LATENT_DIM, capacity)

    def plan(self, q_lens, kv_lens, page_table, *, causal=True, sm_scale=None, custom_mask=None, max_q_len=None,
             max_kv_len=None):
        return super().plan(q_lens, kv_lens, page_table, causal=causal, sm_scale=sm_scale, custom_mask=custom_mask,
                            max_q_len=max_q_len, max_kv_len=max_kv_len)

    def run(self, q, cache, out=None, *, q_pe=None):
        rank = reference.mla.KV_LORA_RANK
        p, total, live = self._rows(q, self.head_dim if q_pe is None else rank)
        assert isinstance(cache, LatentCache), type(cache)
        assert out.shape[1:] == (self.heads, rank) and out.is_contiguous(), out.shape
        if q_pe is not None:
            assert q_pe.shape[1:] == (self.heads, self.head_dim - rank) and not q_pe.requires_grad, q_pe.shape
        if total == 0:
            return out
        fp8 = cache.latent.dtype == FP8
        latent = cache.latent.view(torch.uint8).numpy() if fp8 else cache.latent.detach().float().numpy()
        ref = reference.mla_attention(
            q[:total].detach().float().numpy(), latent, p["q"][live], p["kv"][live], p["table"][live],
            q_pe=None if q_pe is None else q_pe[:total].float().numpy(), causal=p["causal"],
            sm_scale=p["sm_scale"], custom_mask=_live_mask(p, live), scale=cache.scale if fp8 else None)
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

        k = k_buffer.detach().view(k_buffer.shape[0], 1, *k_buffer.shape[1:])  # as Kernels.cache does
        v = v_buffer.detach().view(v_buffer.shape[0], 1, *v_buffer.shape[1:])
        assert k.data_ptr() == k_buffer.data_ptr()  # zero copy
        return Cache(k, v, scale_value(k_scale), scale_value(v_scale))

    def latent_cache(self, layer_id, buffer, scale=None):
        from cupy_fa.integrations.sglang.kernels import scale_value

        assert tuple(buffer.shape[1:]) == (1, reference.mla.LATENT_DIM), buffer.shape  # one-token pages
        return LatentCache(buffer.detach(), scale_value(scale))

    def attention(self, num_qo_heads, num_kv_heads, head_dim, dtype, kv_dtype, device, capacity=None):
        return self._made(RefAttention(num_qo_heads, num_kv_heads, head_dim, capacity))

    def mla_attention(self, num_heads, dtype, kv_dtype, device, capacity=None):
        return self._made(RefMLAAttention(num_heads, capacity))

    @staticmethod
    def _made(attn):
        RefKernels.made.append(attn)
        return attn
