"""SGLang's forward-batch conventions -> cupy_fa's contract, in one place (torch only, no sglang import).

cupy_fa's contract (docs/design.md, "The contract"): ``q_len`` = query tokens of this step, ``kv_len`` =
keys valid in the cache AFTER this step's K/V were written. SGLang's ``forward_batch.seq_lens`` means a
different extent per mode; :func:`cupy_fa.modes.from_sglang` converts it, and this module adds what
belongs to SGLang's runners only:

==================  ==========================  ===================  ==================================
SGLang mode         ``seq_lens`` holds          q_len                kv_len
==================  ==========================  ===================  ==================================
DECODE              P + 1                       1                    seq_lens
EXTEND, MIXED       P + C                       extend_seq_lens      seq_lens
DRAFT_EXTEND (v1)   P + A                       extend_seq_lens (A)  seq_lens
TARGET_VERIFY       P (prefix only)             N                    seq_lens + N
DRAFT_EXTEND_V2     P + N (already bumped)      N, 0 where           seq_lens
                                                seq_lens < N
draft decode step i P (branch root)             1 per branch         seq_lens + i + 1
IDLE                nothing                     no rows              no rows
==================  ==========================  ===================  ==================================

N is the step's draft count (``spec_info.draft_token_num`` for verify, else the server's
``speculative_num_draft_tokens``). A DRAFT_EXTEND_V2 row whose ``seq_lens`` is below N is SGLang's
CUDA-graph padding (``seq_len_fill_value`` = 1 with N tokens): it becomes ``q_len = 0`` (reads and
writes nothing); SGLang pads at the end of the batch, so the live rows keep their places in q.

The page table: SGLang's KV pool is token-granular (``req_to_token[r, j]`` is the slot of token j of
request r), so the pool's K/V buffers ``[slots, H_kv, D]`` are read as cupy_fa pages of one token
(``[slots, 1, H_kv, D]``, zero copy) and a step's page table is rows of ``req_to_token``. A paged
pool (page size P > 1) is read the same way: token slots stay exact whatever the allocator did
(SGLang's kit scatters a request's new tokens inside its pages; EAGLE's top-k > 1 branches keep
their drafts in pages of their own).

The verify tree mask: SGLang's ``spec_info.custom_mask`` holds, per request, a row-major
``[N, P + N]`` bool block (the prefix columns all True), blocks concatenated; cupy_fa takes the
``[N, N]`` draft block of each request, concatenated: :func:`draft_mask_indices`.
"""

import dataclasses

import torch

from ...modes import ForwardMode, from_sglang

# SGLang's ForwardMode names -> cupy_fa's (the same names; IDLE, SPLIT_PREFILL, DLLM_EXTEND are refused)
MODES = {m.name: m for m in ForwardMode}


def mode_of(sglang_mode):
    """cupy_fa's :class:`~cupy_fa.modes.ForwardMode` of an SGLang ``ForwardMode`` (by name).

    Raises:
        NotImplementedError: a mode cupy_fa does not serve (SGLang's SPLIT_PREFILL, DLLM_EXTEND, ...).
    """
    name = getattr(sglang_mode, "name", str(sglang_mode))
    if name not in MODES:
        raise NotImplementedError(f"cupy_fa's SGLang backend does not serve forward mode {name} "
                                  f"(it serves {', '.join(MODES)})")
    return MODES[name]


@dataclasses.dataclass
class Lengths:
    """One step in cupy_fa's terms: ``q_lens`` / ``kv_lens`` int32 ``[B]`` on the device, and host
    bounds ``max_q_len`` / ``max_kv_len`` (upper bounds of the device values)."""
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    max_q_len: int
    max_kv_len: int


def step_lengths(mode, seq_lens, *, extend_seq_lens=None, num_draft_tokens=None, seq_lens_cpu=None,
                 extend_seq_lens_cpu=None, max_kv_bound, num_tokens=None):
    """The contract's lengths of an SGLang step (the table above), as device tensors.

    Args:
        mode: cupy_fa ForwardMode (see :func:`mode_of`).
        seq_lens: SGLang's ``forward_batch.seq_lens[:bs]`` (device).
        extend_seq_lens: ``[bs]`` device tokens of each request in EXTEND / MIXED / DRAFT_EXTEND.
        num_draft_tokens: N, for TARGET_VERIFY and DRAFT_EXTEND_V2.
        seq_lens_cpu, extend_seq_lens_cpu: host mirrors, when SGLang has them (tighter bounds only).
        max_kv_bound: keys a request can have at most (``req_to_token``'s width).
        num_tokens: rows of q of the step, when known (bounds q_len where no host mirror is).
    Returns:
        :class:`Lengths`. Nothing is read back from the device.
    """
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND):
        if extend_seq_lens is None:
            raise ValueError(f"{mode.name}: the forward batch has no extend_seq_lens")
        key = "extend_seq_lens" if mode is not ForwardMode.DRAFT_EXTEND else "accept_lens"
        q, kv = from_sglang(mode, seq_lens, **{key: extend_seq_lens})
        if extend_seq_lens_cpu is not None and len(extend_seq_lens_cpu):
            max_q = int(max(extend_seq_lens_cpu))
        else:
            max_q = int(num_tokens) if num_tokens is not None else int(max_kv_bound)
        extra = 0
    elif mode is ForwardMode.DECODE:
        q, kv = from_sglang(mode, seq_lens)
        max_q, extra = 1, 0
    elif mode is ForwardMode.TARGET_VERIFY:
        q, kv = from_sglang(mode, seq_lens, num_draft_tokens=num_draft_tokens)
        max_q = extra = int(num_draft_tokens)
    elif mode is ForwardMode.DRAFT_EXTEND_V2:
        n = int(num_draft_tokens)
        kv = seq_lens
        q = torch.where(seq_lens >= n, n, 0)  # CUDA-graph padding rows (seq_lens below N) read nothing
        max_q, extra = n, 0
    else:
        raise NotImplementedError(f"step_lengths has no rule for {mode.name}")
    if seq_lens_cpu is not None and len(seq_lens_cpu):
        max_kv = min(int(max(seq_lens_cpu)) + extra, int(max_kv_bound))
    else:
        max_kv = int(max_kv_bound)
    return Lengths(q.to(torch.int32), kv.to(torch.int32), max(max_q, 1), max(max_kv, 1))


def gather_page_table(req_to_token, req_pool_indices, columns, out=None):
    """Rows ``req_to_token[req_pool_indices, :columns]`` (int32 slots = page ids of one-token pages),
    written into ``out[:bs, :columns]`` when given (the CUDA-graph buffer), else a new tensor."""
    rows = req_to_token.index_select(0, req_pool_indices.to(torch.int64))[:, :columns]
    if out is None:
        return rows.to(torch.int32).contiguous()
    out[:rows.shape[0], :columns].copy_(rows)
    return out[:rows.shape[0]]


def draft_mask_indices(seq_lens, num_draft_tokens, mask_numel):
    """Flat indices into SGLang's verify ``custom_mask`` of each request's ``[N, N]`` draft block,
    concatenated (cupy_fa's mask layout), from the prefix lengths ``seq_lens`` (TARGET_VERIFY's
    ``seq_lens``: the prefix P). Request b's block starts at ``sum_{c<b} N * (P_c + N)``; its row i
    at ``+ i * (P_b + N)``, its draft columns at ``+ P_b``. Indices are clamped into the mask
    (CUDA-graph padding rows of a buffer shorter than their fill lengths read its last entry)."""
    n = int(num_draft_tokens)
    seq = seq_lens.to(torch.int64)
    widths = seq + n
    starts = torch.cumsum(widths * n, 0) - widths * n
    i = torch.arange(n, device=seq.device)
    idx = (starts[:, None, None] + i[None, :, None] * widths[:, None, None] + seq[:, None, None]
           + i[None, None, :])
    return idx.reshape(-1).clamp_(0, max(int(mask_numel) - 1, 0))


def draft_decode_page_table(req_to_token, req_pool_indices, seq_lens, *, topk, num_steps, page_size, columns,
                            out=None):
    """The page table of EAGLE's multi-step draft decode: row ``r * topk + t`` (request r, branch t)
    lists request r's prefix slots ``req_to_token[r, :P_r]`` then the slots of branch t's drafts
    1 .. num_steps at columns ``P_r ..``; draft step i reads ``P_r + i + 1`` keys of it.

    Where a branch's drafts live (SGLang's EAGLE allocation): with page size 1 or top-k 1 draft k of
    branch t is token ``P + t * num_steps + k`` of the request's row; otherwise each branch has
    ``ceil((P % page + num_steps) / page)`` pages of its own after the prefix's whole pages, and draft
    k sits at ``P // page * page + t * pages_per_branch * page + P % page + k``.
    """
    bs = req_pool_indices.shape[0]
    rows = req_to_token.index_select(0, req_pool_indices.to(torch.int64))  # [bs, width]
    width = rows.shape[1]
    seq = seq_lens.to(torch.int64)
    k = torch.arange(num_steps, device=seq.device)
    t = torch.arange(topk, device=seq.device)
    if page_size == 1 or topk == 1:
        pos = seq[:, None, None] + t[None, :, None] * num_steps + k[None, None, :]
    else:
        last = seq % page_size
        pages_per_branch = (last + num_steps + page_size - 1) // page_size
        base = seq // page_size * page_size
        pos = (base[:, None, None] + t[None, :, None] * (pages_per_branch[:, None, None] * page_size)
               + last[:, None, None] + k[None, None, :])
    pos = pos.clamp_(0, width - 1)
    drafts = torch.gather(rows, 1, pos.reshape(bs, topk * num_steps)).reshape(bs * topk, num_steps)
    table = rows[:, :columns].repeat_interleave(topk, dim=0)
    cols = (seq.repeat_interleave(topk)[:, None] + k[None, :]).clamp_(0, columns - 1)
    table.scatter_(1, cols, drafts)
    table = table.to(torch.int32)
    if out is None:
        return table.contiguous()
    out[:table.shape[0], :columns].copy_(table)
    return out[:table.shape[0]]
