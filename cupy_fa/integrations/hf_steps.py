"""The contract of one transformers step, built on the device from transformers' arguments: the
lengths and page table of a continuous-batching step (``paged_step`` over ``PagedAttentionCache``'s
views), and of a plain forward over a dense K/V (``dense_step``, its pages ``dense_pages``, and the
padding mask ``padding_mask`` registers). ``cupy_fa.integrations.transformers`` (whose docstring has
the whole mapping) runs attention on them."""

import dataclasses

ATTENTION = "cupy_fa"
PAGED_ATTENTION = "paged|cupy_fa"


@dataclasses.dataclass(eq=False)
class Step:
    """One forward step in cupy_fa's terms (every tensor int32 on the model's device).

    Attributes:
        q_lens, kv_lens: ``[R]`` the contract's lengths of each request (``kv_len`` counts
            this step's keys too).
        page_table: ``[R, P]`` page ids; only the first ``ceil(kv_len / page_size)`` of a row
            are read.
        max_q_len, max_kv_len: host bounds of the lengths (transformers' ``max_seqlen_*``).
        rows: dense path only: the query row order, live rows first (None: rows in order).
    """
    q_lens: object
    kv_lens: object
    page_table: object
    max_q_len: int
    max_kv_len: int
    rows: object = None


def paged_cache_views(cache, layer_idx):
    """This layer's K and V tensors of a transformers ``PagedAttentionCache`` as zero-copy
    views ``[num_blocks + 2, block_size, H_kv, D]`` (NHD pages), and the layer's group index.

    Raises:
        NotImplementedError: a sliding-window layer.
    """
    window = getattr(cache, "sliding_windows", {}).get(layer_idx, 1)
    if window not in (1, None):
        raise NotImplementedError(f"paged|cupy_fa does not support sliding-window layers (layer {layer_idx} has a "
                                  f"window of {window}): transformers keeps their keys in a ring of window slots "
                                  f"that the step's writes overwrite; use {ATTENTION!r} (generate), paged|sdpa or "
                                  f"paged|flash_attention_2 for this model")
    group, index = cache.layer_index_to_group_indices[layer_idx]
    shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
    return cache.key_cache[index].view(shape), cache.value_cache[index].view(shape), group


def paged_step(block_size, cu_seq_lens_q, cu_seq_lens_k, read_index, write_index, max_seqlen_q, max_seqlen_k):
    """The contract of a continuous-batching step from one layer group's arguments
    (``read_index`` / ``write_index`` are that group's ``[N]`` int64 slot tensors).

    Raises:
        ValueError: the arguments do not describe a batch (mismatched request counts).
    """
    import torch

    if cu_seq_lens_q.shape != cu_seq_lens_k.shape or cu_seq_lens_q.ndim != 1:
        raise ValueError(f"cu_seq_lens_q {tuple(cu_seq_lens_q.shape)} and cu_seq_lens_k "
                         f"{tuple(cu_seq_lens_k.shape)} must both be [batch + 1]")
    cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
    q_lens, kv_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    # full-attention read indices: request b's tokens 0 .. kv_len-1 from cu_k[b] on; a batch of
    # fresh prefills has none and writes those same tokens at write_index (cu_k == cu_q there)
    slots = read_index if read_index.numel() else write_index
    columns = max(1, -(-int(max_seqlen_k) // block_size))
    offsets = torch.arange(columns, device=cu_k.device, dtype=torch.int64) * block_size
    first = cu_k[:-1].to(torch.int64)[:, None] + offsets[None, :]
    live = offsets[None, :] < kv_lens[:, None]
    pages = slots[first.clamp(0, max(slots.numel() - 1, 0))] // block_size if slots.numel() else first * 0
    page_table = torch.where(live, pages, torch.zeros_like(pages)).to(torch.int32)
    return Step(q_lens, kv_lens, page_table, int(max_seqlen_q), int(max_seqlen_k))


def dense_pages(x):
    """A zero-copy ``[N, 1, 1, D]`` view of the storage of ``x`` (``[B, H, L, D]``, any strides
    with a unit last stride and the others multiples of D): one page per D-vector. None when
    the strides do not allow it."""
    import torch

    d = x.shape[-1]
    strides = x.stride()
    if strides[-1] != 1 or any(s % d for s in strides[:-1]):
        return None
    span = 1 + sum((n - 1) * s for n, s in zip(x.shape, strides))
    return torch.as_strided(x, (-(-span // d), 1, 1, d), (d, d, d, 1))


def dense_step(query, key, attention_mask, causal=True):
    """The contract of a dense (``generate``) step: request ``b * H_kv + h`` is batch row b
    over KV head h, one page per key vector (see :func:`dense_pages`).

    Args:
        query: ``[B, H_q, T, D]``; key: ``[B, H_kv, L, D]`` (``key.stride()`` sets the page ids).
        attention_mask: None, or the bool ``[B, M]`` padding mask (``M <= L``; keys at
            ``M`` and after are not valid; the T query tokens are the last T of the M).
    Raises:
        ValueError: shapes that do not fit, or a key layout that has no page view.
        NotImplementedError: non-causal attention with more queries than keys.
    """
    import torch

    b, h_q, t, d = query.shape
    h_kv, length = key.shape[1], key.shape[2]
    if key.shape[0] != b or key.shape[3] != d or h_q % h_kv:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} do not fit "
                         f"([B, H_q, T, D] and [B, H_kv, L, D], H_q a multiple of H_kv)")
    device = key.device
    sb, sh, sl, _ = (s // d for s in key.stride())
    if any(s % d for s in key.stride()[:3]) or key.stride(3) != 1:
        raise ValueError(f"key strides {key.stride()} have no page view (the last must be 1, the others multiples of D)")
    if attention_mask is None:
        m = length
        if t > m and causal:
            raise ValueError(f"{t} query tokens but only {m} keys")
        positions = torch.arange(m, device=device, dtype=torch.int64).expand(b, m)
        kv_rows = torch.full((b,), m, dtype=torch.int32, device=device)
        q_rows = torch.full((b,), min(t, m), dtype=torch.int32, device=device)
        rows = None
    else:
        mask = attention_mask.to(device=device, dtype=torch.bool)
        if mask.ndim != 2 or mask.shape[0] != b or mask.shape[1] > length or mask.shape[1] < t:
            raise ValueError(f"attention_mask must be a [batch, keys] padding mask with {t} <= keys <= {length} "
                             f"for query {tuple(query.shape)} and key {tuple(key.shape)}, got {tuple(mask.shape)}")
        m = mask.shape[1]
        # valid keys first, in order (a stable sort of "is padding"): row b's page list
        positions = torch.argsort((~mask).to(torch.int8), dim=1, stable=True).to(torch.int64)
        kv_rows = mask.sum(1, dtype=torch.int32)
        q_mask = mask[:, m - t:]
        q_rows = q_mask.sum(1, dtype=torch.int32)
        live = q_mask[:, None, :].expand(b, h_kv, t).reshape(-1)
        rows = torch.argsort((~live).to(torch.int8), stable=True)
    if not causal and t > m:
        raise NotImplementedError("cupy_fa needs at least as many keys as queries (q_len <= kv_len)")
    batch = torch.arange(b, device=device, dtype=torch.int64)[:, None, None]
    head = torch.arange(h_kv, device=device, dtype=torch.int64)[None, :, None]
    pages = batch * sb + head * sh + positions[:, None, :] * sl
    page_table = pages.reshape(b * h_kv, m).to(torch.int32)
    q_lens = q_rows.repeat_interleave(h_kv)
    kv_lens = kv_rows.repeat_interleave(h_kv)
    return Step(q_lens, kv_lens, page_table, t, m, rows)


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 **kwargs):
    """``AttentionMaskInterface`` entry of ``"cupy_fa"``: the bool 2D padding mask ``[B, kv]``
    when some key is padding, else None (causality is the kernel's)."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask
