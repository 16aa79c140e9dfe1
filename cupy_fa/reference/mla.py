"""Float64 multi-head latent attention (the absorbed form) over a paged latent cache: the truth the
MLA kernels are held to.

Shapes (B requests, T = sum(q_lens) query rows, H heads):

- ``q``: ``[T, H, 576]``, each head's absorbed no-rope part (512) then its rope part (64); or give
  ``q_pe`` ``[T, H, 64]`` beside ``q`` = q_nope ``[T, H, 512]``.
- ``latent``: ``[num_pages, page_size, 576]`` (or ``[num_pages, page_size, 1, 576]``): each token's
  c_kv (512, also its value) then its k_pe (64); float, or e4m3fn bytes (uint8 / ml_dtypes) with
  ``scale`` (value = e4m3 x scale).
- ``q_lens``, ``kv_lens``, ``page_table``, ``causal``, ``custom_mask``: the contract of
  :func:`cupy_fa.reference.paged_attention` (kv_len counts the keys AFTER this step's write).

Scores ``q . [c_kv, k_pe] x sm_scale`` (sm_scale default ``1 / sqrt(192)``, DeepSeek's qk head
before absorption), values c_kv, output ``[T, H, 512]``. It is paged attention with one KV head of
576 columns whose values are its first 512 (the rope columns' values set to zero, then dropped),
so every mask of the contract carries over.
"""

from __future__ import annotations

import math

import numpy as np

from ._host import to_numpy
from .attention import paged_attention
from .fp8 import dequantize_e4m3

KV_LORA_RANK = 512
ROPE_DIM = 64
LATENT_DIM = KV_LORA_RANK + ROPE_DIM
DEFAULT_SM_SCALE = 1.0 / math.sqrt(128 + 64)  # DeepSeek V2 / V3: qk_nope_head_dim + qk_rope_head_dim


def latent_values(latent, scale=None):
    """float64 ``[num_pages, page_size, 576]`` of a latent cache (16-bit, float, or e4m3 bytes times
    ``scale``)."""
    arr = to_numpy(latent)
    if arr.ndim == 4:
        if arr.shape[2] != 1:
            raise ValueError(f"a 4-dimensional latent cache is [num_pages, page_size, 1, {LATENT_DIM}], got {arr.shape}")
        arr = arr[:, :, 0]
    if arr.ndim != 3 or arr.shape[-1] != LATENT_DIM:
        raise ValueError(f"latent must be [num_pages, page_size, {LATENT_DIM}], got shape {arr.shape}")
    if scale is not None or arr.dtype == np.uint8 or arr.dtype.name == "float8_e4m3fn":
        return dequantize_e4m3(arr, 1.0 if scale is None else float(np.asarray(scale, np.float64).reshape(-1)[0]))
    return arr.astype(np.float64)


def mla_attention(q, latent, q_lens, kv_lens, page_table, *, q_pe=None, causal=True, sm_scale=None,
                  custom_mask=None, scale=None, return_lse=False):
    """Reference MLA in float64.

    Returns:
        ``out`` float64 ``[T, H, 512]``, and with ``return_lse`` the natural-log LSE ``[T, H]`` of the
        scaled scores (a query that sees no key: out 0, LSE -inf).
    Raises:
        ValueError: shapes that do not fit (q's last dim, q_pe's, the latent's), and what
            :func:`cupy_fa.reference.paged_attention` raises for the lengths, page table and mask.
    """
    q = np.asarray(to_numpy(q), np.float64)
    if q_pe is not None:
        q_pe = np.asarray(to_numpy(q_pe), np.float64)
        if q.ndim != 3 or q.shape[-1] != KV_LORA_RANK or q_pe.shape != q.shape[:2] + (ROPE_DIM,):
            raise ValueError(f"q_nope must be [T, H, {KV_LORA_RANK}] and q_pe [T, H, {ROPE_DIM}], got {q.shape} and "
                             f"{q_pe.shape}")
        q = np.concatenate([q, q_pe], axis=-1)
    if q.ndim != 3 or q.shape[-1] != LATENT_DIM:
        raise ValueError(f"q must be [T, H, {LATENT_DIM}] (q_nope and q_pe concatenated), got shape {q.shape}")
    keys = latent_values(latent, scale)
    values = keys.copy()
    values[..., KV_LORA_RANK:] = 0.0  # the rope columns carry no value
    out = paged_attention(q, keys[:, :, None], values[:, :, None], q_lens, kv_lens, page_table, causal=causal,
                          sm_scale=DEFAULT_SM_SCALE if sm_scale is None else sm_scale, custom_mask=custom_mask,
                          return_lse=return_lse)
    if return_lse:
        return out[0][..., :KV_LORA_RANK], out[1]
    return out[..., :KV_LORA_RANK]
