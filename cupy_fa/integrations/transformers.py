"""Hugging Face transformers (5.x) on cupy_fa.

::

    import cupy_fa.integrations.transformers as cupy_fa_hf

    cupy_fa_hf.register()   # imports torch and transformers here, not before
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation="paged|cupy_fa")
    outputs = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=256))

``register()`` adds two attention implementations to transformers' ``AttentionInterface``:

``"paged|cupy_fa"``, for continuous batching (``generate_batch``, ``ContinuousBatchingManager``).
    transformers' ``PagedAttentionCache`` keeps one K and one V tensor per layer, shaped
    ``[(num_blocks + 2) * block_size, H_kv, D]``: a zero-copy view
    ``[num_blocks + 2, block_size, H_kv, D]`` of each is our NHD page layout, so each is wrapped
    once as a :class:`cupy_fa.PagedKVCache` (the two extra blocks are transformers' trash
    blocks for padding tokens). Per layer this step's new K/V rows are written at transformers'
    ``write_index`` slots (:meth:`PagedKVCache.append`, the write transformers' own
    ``cache.update`` does before its attention), then the attention reads the pages in place:
    no K/V is gathered or copied. Per forward step, on the first layer, the contract's lengths
    and page table are built on the device from transformers' arguments (no host sync, so a
    CUDA-graph capture works too) and planned once for every layer:

    * ``q_len[b] = cu_seq_lens_q[b + 1] - cu_seq_lens_q[b]``;
    * ``kv_len[b] = cu_seq_lens_k[b + 1] - cu_seq_lens_k[b]``: transformers counts the keys of
      request b after this step's write (past + new), which is our ``kv_len``;
    * ``page_table[b, j] = read_index[cu_seq_lens_k[b] + j * block_size] // block_size``:
      ``read_index`` lists the slots (``block * block_size + offset``) of request b's tokens
      ``0 .. kv_len - 1`` in order, so every ``block_size``-th entry names a block. A batch of
      fresh prefills only has ``write_index`` (no cache to read; then ``cu_seq_lens_k`` equals
      ``cu_seq_lens_q``), whose slots are those same tokens. transformers' own block table
      (``block_table``, padded with -1) is only built for its flash-attention decode path,
      which it turns off for other implementations, so it never reaches this one.

    Padding requests (CUDA-graph padding, where the cumulative lengths plateau) get
    ``q_len = 0`` and read and write nothing; padding query rows past the last request are
    left unwritten, as flash attention's varlen path leaves them.

``"cupy_fa"``, for ``model.generate`` and plain forwards (DynamicCache or StaticCache).
    The attention function gets this layer's whole K/V, ``[B, H_kv, L, D]`` in whatever
    strides the cache keeps (a fresh projection at prefill, a concatenation afterwards). Each
    ``D``-vector of one token and one KV head is made a page of one token and one head (a
    zero-copy view ``[N, 1, 1, D]`` of the K and V storage) and each (batch row, KV head) a
    request whose page table lists its valid keys in order. The padding mask (registered
    through ``AttentionMaskInterface``: the 2D ``[B, L]`` mask, or None when nothing is
    padded) decides which keys are valid and which query rows are live: ``kv_len`` counts a
    row's valid keys, ``q_len`` its valid new tokens, and the live query rows are packed
    first (padding query rows come back as zeros). Query and output rows are copied into
    that order; K and V are read in place.

Attention variants (gpt-oss, Gemma 2 / 3, Mistral-style models): a layer's ``sliding_window``
(transformers' convention, a query sees itself and the ``W - 1`` keys before it: cupy_fa's
``plan(window=W)``), ``softcap`` (``cap * tanh(score * scaling / cap)``: ``logits_soft_cap``) and
``s_aux`` / ``module.sinks`` (one logit per query head in the softmax's denominator: ``run(sinks=)``,
as float32) are passed on; each (window, soft-cap) pair has its own ``BatchAttention``, planned once
per step. ``"cupy_fa"`` (``generate``) takes all three; ``"paged|cupy_fa"`` takes soft-caps and sinks
and refuses sliding-window layers (transformers keeps their keys in a ring of W slots per request,
which the step's writes overwrite, and reads the window before it writes: cupy_fa reads the cache
after the step's append).

Not supported (raises ``NotImplementedError`` before anything is written): sliding-window layers
under ``"paged|cupy_fa"``, dropout, a value head dim other than the query's.
cupy_fa's own limits apply (float16 / bfloat16, head dim 64, 96, 128, 192 or 256, sm_80+).

Versions: written against transformers 5.17 (``tests/test_hf_integration_gpu.py`` checks every
attention call of its ``generate_batch`` and ``generate`` against the float64 reference, and the
tokens against its ``paged|sdpa`` and ``sdpa``); 5.18 does not have the check described next
either (not run). From
5.19 on, transformers' continuous batching accepts only its own implementations (``paged|eager``,
``sdpa``, flash attention) and refuses any other with a ValueError, so ``generate_batch`` cannot
use ``"paged|cupy_fa"`` there; ``"cupy_fa"`` for ``generate`` still works (its mapping test
passes on 5.24). :func:`register` warns on such a version.
"""

import dataclasses
import threading
import warnings
import weakref

from .hf_steps import ATTENTION, PAGED_ATTENTION, Step, dense_pages, dense_step, padding_mask, paged_cache_views, \
    paged_step

__all__ = ["ATTENTION", "PAGED_ATTENTION", "Step", "attention_forward", "dense_pages", "dense_step",
           "paged_attention_forward", "paged_cache_views", "paged_step", "padding_mask", "register"]


def register():
    """Adds ``"paged|cupy_fa"`` and ``"cupy_fa"`` to transformers' ``AttentionInterface`` (and
    the padding-mask function of ``"cupy_fa"`` to ``AttentionMaskInterface``). Idempotent.

    Returns:
        ``(PAGED_ATTENTION, ATTENTION)``, the two names to pass as ``attn_implementation``.
    Raises:
        ImportError: torch or transformers is not installed.
    """
    import transformers
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    AttentionInterface.register(ATTENTION, attention_forward)
    AttentionMaskInterface.register(ATTENTION, padding_mask)
    if _version(transformers.__version__) >= (5, 19):
        warnings.warn(f"transformers {transformers.__version__}: from 5.19 on its continuous batching accepts only "
                      f"its own attention implementations, so generate_batch refuses {PAGED_ATTENTION!r} (written "
                      f"against 5.17); {ATTENTION!r} for generate works", stacklevel=2)
    return PAGED_ATTENTION, ATTENTION


def _version(text):
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


# ---- what a layer may ask for -----------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
    """A layer's attention variant, as cupy_fa takes it: ``window`` (keys a query sees, itself
    included; 0: none), ``soft_cap`` (0.0: none), ``sinks`` (a float32 ``[H_q]`` tensor on the
    query's device, or None)."""
    window: int = 0
    soft_cap: float = 0.0
    sinks: object = None

    @property
    def is_plain(self):
        return not (self.window or self.soft_cap or self.sinks is not None)

    @property
    def planned(self):
        """What a plan fixes (the sinks are given per run)."""
        return (self.window, self.soft_cap)


PLAIN = Variant()


def layer_variant(module, query, kwargs, name, paged):
    """The :class:`Variant` this call asks for (transformers' ``sliding_window``, ``softcap`` and
    ``s_aux`` keywords, or the module's ``sliding_window`` / ``sinks``).

    Raises:
        NotImplementedError: a sliding-window layer under ``"paged|cupy_fa"``.
        ValueError: a window that is not a positive int, a soft-cap that is not a positive number,
            sinks that are not one value per query head.
    """
    from ..variants import checked_soft_cap, checked_window

    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    window = None if window in (None, 0, False) else window
    if window is not None and paged:
        raise NotImplementedError(f"{name} does not support sliding-window layers (layer "
                                  f"{getattr(module, 'layer_idx', '?')} has a window of {window}): transformers "
                                  f"keeps their keys in a ring of window slots that the step's writes overwrite; "
                                  f"use {ATTENTION!r} (generate), paged|sdpa or paged|flash_attention_2 for this "
                                  f"model")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    if sinks is not None:
        if tuple(sinks.shape) != (query.shape[1],):
            raise ValueError(f"{name}: sinks (s_aux) must be one logit per query head, shape ({query.shape[1]},), "
                             f"got {tuple(sinks.shape)}")
        import torch

        sinks = sinks.detach().to(device=query.device, dtype=torch.float32).contiguous()
    try:
        return Variant(checked_window(window), checked_soft_cap(kwargs.get("softcap")), sinks)
    except ValueError as exc:
        raise ValueError(f"{name}: layer {getattr(module, 'layer_idx', '?')}: {exc}") from None


def _check_module(module, query, value, dropout, kwargs, name, paged=False):
    """Refuses what this integration cannot serve; returns the layer's :class:`Variant`."""
    variant = layer_variant(module, query, kwargs, name, paged)
    if dropout:
        raise NotImplementedError(f"{name} is for inference: dropout must be 0, got {dropout}")
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"{name} needs the value head dim to equal the query's, got {value.shape[-1]} "
                                  f"and {query.shape[-1]}")
    return variant


# ---- the two attention functions ----------------------------------------------------------


class _PerOwner:
    """A dict per owner object, dropped when the owner is collected. Owners need not be
    hashable (a model config is not): they are told apart by identity, checked through a
    weak reference, so no state outlives the model or cache it belongs to."""

    def __init__(self):
        self._tables = {}  # id(owner) -> (weakref to owner, dict)
        self._lock = threading.Lock()

    def __call__(self, owner):
        key = id(owner)
        with self._lock:
            entry = self._tables.get(key)
            if entry is None or entry[0]() is not owner:
                entry = self._tables[key] = (weakref.ref(owner, lambda _, key=key: self._drop(key)), {})
            return entry[1]

    def _drop(self, key):
        with self._lock:
            entry = self._tables.get(key)
            if entry is not None and entry[0]() is None:
                del self._tables[key]


class _StepTracker:
    """The step each owner (a transformers cache, or a model config) is on: a new one when
    a layer index does not increase (the next forward starts again at its first layer)."""

    def __init__(self):
        self._state = _PerOwner()  # owner -> {slot: (last layer, step key, Step)}

    def step(self, owner, slot, layer_idx, key, build):
        states = self._state(owner)
        last = states.get(slot)
        if last is not None and layer_idx > last[0] and last[1] == key:
            states[slot] = (layer_idx, key, last[2])
            return last[2]
        step = build()
        states[slot] = (layer_idx, key, step)
        return step


_steps = _StepTracker()


def paged_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` entry of ``"paged|cupy_fa"`` (continuous batching).

    Args (as transformers' paged path passes them):
        query: ``[1, H_q, T, D]``, key / value: ``[1, H_kv, T, D]``, the step's packed tokens.
        cache: the ``PagedAttentionCache``; cu_seq_lens_q / cu_seq_lens_k: ``[B + 1]``;
        max_seqlen_q / max_seqlen_k: ints; read_index / write_index: one slot tensor per
        layer group.
    Returns:
        ``(out [1, T, H_q, D], None)``.
    Raises:
        ValueError: called without a paged cache (a standard forward); NotImplementedError:
        see the module docstring; what :class:`cupy_fa.BatchAttention` raises.
    """
    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError(f"{PAGED_ATTENTION} was called without a paged attention cache: it serves continuous "
                         f"batching (generate_batch); use {ATTENTION!r} for generate or a standard forward")
    variant = _check_module(module, query, value, dropout, kwargs, PAGED_ATTENTION, paged=True)
    layer = module.layer_idx
    k_pages, v_pages, group = paged_cache_views(cache, layer)
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):  # hybrid models: this layer's type (sliding layers were refused above)
        cu_k, max_k = cu_k["full_attention"], max_k["full_attention"]
    read_index, write_index = kwargs["read_index"][group], kwargs["write_index"][group]
    q = query[0].transpose(0, 1).contiguous()  # [T, H_q, D]
    k_new = key[0].transpose(0, 1).contiguous()  # [T, H_kv, D]
    v_new = value[0].transpose(0, 1).contiguous()
    backend.check((cache, group), q, k_pages, variant)
    step_key = (tuple(q.shape), int(kwargs["max_seqlen_q"]), int(max_k), tuple(read_index.shape),
                tuple(cu_k.shape))
    step = _steps.step(cache, group, layer, step_key, lambda: paged_step(
        cache.block_size, kwargs["cu_seq_lens_q"], cu_k, read_index, write_index, kwargs["max_seqlen_q"], max_k))
    backend.append((cache, layer), k_pages, v_pages, k_new, v_new, write_index)
    out = backend.attention((cache, group), step, q, k_pages, v_pages, _scale(module, scaling, q), True,
                            pages_key=(cache, layer), variant=variant)
    return out.unsqueeze(0), None


def attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` entry of ``"cupy_fa"`` (``generate``, plain forwards).

    Args:
        query: ``[B, H_q, T, D]``; key / value: ``[B, H_kv, L, D]``, the layer's whole K/V
            (the cache has already appended this step's); attention_mask: what
            :func:`padding_mask` returned (None or a bool ``[B, M]``).
    Returns:
        ``(out [B, T, H_q, D], None)``.
    Raises:
        NotImplementedError: see the module docstring; ValueError: shapes that do not fit.

    Called with transformers' paged cache (``cache=``, continuous batching), it is
    :func:`paged_attention_forward`.
    """
    if kwargs.get("cache") is not None:
        return paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                       **kwargs)
    variant = _check_module(module, query, value, dropout, kwargs, ATTENTION)
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(f"{ATTENTION} takes the 2D padding mask its AttentionMaskInterface entry makes, got a "
                         f"{attention_mask.ndim}D attention_mask; call cupy_fa.integrations.transformers.register() "
                         f"before building the model's masks")
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    k_pages, v_pages = dense_pages(key), dense_pages(value)
    if k_pages is None or v_pages is None or key.stride() != value.stride():
        # one page table serves K and V: layouts that differ (or have no page view) are made
        # contiguous; transformers' caches never need it (K and V share their strides)
        key, value = key.contiguous(), value.contiguous()
        k_pages, v_pages = dense_pages(key), dense_pages(value)
    b, h_q, t, d = query.shape
    h_kv = key.shape[1]
    group = h_q // h_kv
    # rows (b, h_kv, t) with the group's heads: [B*H_kv*T, H_q / H_kv, D]
    q = query.reshape(b, h_kv, group, t, d).permute(0, 1, 3, 2, 4).reshape(b * h_kv * t, group, d)
    backend.check((module.config, "dense"), q, k_pages, variant)
    mask_key = None if attention_mask is None else (attention_mask.data_ptr(), tuple(attention_mask.shape))
    step_key = (tuple(query.shape), tuple(key.shape), key.stride(), mask_key, causal)
    # a Step per forward for each (window, soft-cap): a hybrid model's sliding and full layers see
    # other keys (a sliding cache keeps W - 1) and other masks, so each kind shares its own
    step = _steps.step(module.config, ("dense", variant.planned), module.layer_idx, step_key,
                       lambda: dense_step(query, key, attention_mask, causal))
    if step.rows is not None:
        q = q[step.rows]
    q = q.contiguous()
    # each request here is one (batch row, KV head) with that head's group of query heads, so the
    # sinks (one per query head) are applied to the outputs by the LSE: out / (1 + e^(sink - lse))
    sinks = variant.sinks
    out = backend.attention((module.config, "dense"), step, q, k_pages, v_pages, _scale(module, scaling, q), causal,
                            zero_fill=step.rows is not None, variant=dataclasses.replace(variant, sinks=None),
                            return_lse=sinks is not None)
    out, lse = out if sinks is not None else (out, None)
    if step.rows is not None:
        ordered = out.new_empty(out.shape)
        ordered[step.rows] = out
        out = ordered
        if lse is not None:
            ordered = lse.new_zeros(lse.shape)
            ordered[step.rows] = lse
            lse = ordered
    if sinks is not None:
        out = with_sinks(out, lse, sinks, b, h_kv, t)
    out = out.reshape(b, h_kv, t, group, d).permute(0, 2, 1, 3, 4).reshape(b, t, h_q, d)
    return out, None


def with_sinks(out, lse, sinks, b, h_kv, t):
    """Rows ``[B * H_kv * T, G, D]`` of attention without sinks, with their natural-log LSE
    ``[B * H_kv * T, G]``, as attention with ``sinks`` (``[H_q]``, head ``h_kv * G + g``) would give
    them: each row scaled by ``1 / (1 + e^(sink - lse))``. Rows with no output (padding: zeros) stay
    zeros."""
    import torch

    group = out.shape[1]
    per_row = sinks.view(1, h_kv, 1, group).expand(b, h_kv, t, group).reshape(-1, group)
    factor = torch.nan_to_num(torch.sigmoid(lse - per_row), nan=0.0)  # 1 / (1 + e^(sink - lse))
    return (out.float() * factor.unsqueeze(-1)).to(out.dtype)


def _scale(module, scaling, q):
    if scaling is not None:
        return float(scaling)
    scale = getattr(module, "scaling", None)
    return float(scale) if scale is not None else q.shape[-1] ** -0.5


# ---- the backend: cupy_fa's kernels ---------------------------------------------------------


class CupyFABackend:
    """Runs the mapped steps on cupy_fa: ``PagedKVCache`` views of the caller's tensors (kept
    per owner while the owner lives), one ``BatchAttention`` per owner and shape, planned once
    per :class:`Step`, launched on torch's current stream."""

    def __init__(self):
        self._caches = _PerOwner()  # owner -> {slot: PagedKVCache}
        self._attention = _PerOwner()  # owner -> {(slot, shape): [BatchAttention, the Step it planned]}

    def check(self, key, q, k_pages, variant=PLAIN):
        """Raises before anything is written when cupy_fa cannot run this layer (its
        ``BatchAttention`` is made here: the constructor checks heads and head dim)."""
        import torch

        if q.device.type != "cuda":
            raise ValueError(f"cupy_fa runs on CUDA devices; this model's attention is on {q.device}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"cupy_fa runs float16 or bfloat16 attention, this model's is {q.dtype} "
                            f"(load it with dtype=torch.bfloat16)")
        self._instance(key, q, k_pages, variant)

    def _instance(self, key, q, k_pages, variant=PLAIN):
        import cupy_fa

        owned, slot = self._owned(self._attention, key)
        # one per device, and per (window, soft-cap): layers of one variant share a plan per step
        shape = (slot, q.shape[1], k_pages.shape[2], q.shape[2], q.dtype, q.device.index, variant.planned)
        entry = owned.get(shape)
        if entry is None:
            entry = owned[shape] = [cupy_fa.BatchAttention(q.shape[1], k_pages.shape[2], q.shape[2], str(q.dtype),
                                                           device=q.device.index), None]
        return entry

    @staticmethod
    def _owned(table, key):
        owner, slot = key
        return table(owner), slot

    def _cache(self, key, k_pages, v_pages):
        import cupy_fa
        from .. import _arrays

        if key is None:
            with _arrays.caller_stream(k_pages):
                return cupy_fa.PagedKVCache(k_pages, v_pages)
        owned, slot = self._owned(self._caches, key)
        cache = owned.get(slot)
        if cache is None or cache.k_source.data_ptr() != k_pages.data_ptr() or \
                cache.k_source.shape != k_pages.shape or cache.v_source.data_ptr() != v_pages.data_ptr():
            with _arrays.caller_stream(k_pages):  # the DLPack exchange on torch's stream
                cache = owned[slot] = cupy_fa.PagedKVCache(k_pages, v_pages)
        return cache

    def append(self, key, k_pages, v_pages, k_new, v_new, slots):
        """Writes this step's K/V rows ``[T, H_kv, D]`` at ``slots`` of the pages."""
        import cupy

        with cupy.cuda.Device(k_pages.device.index):
            self._cache(key, k_pages, v_pages).append(k_new, v_new, slots)

    def attention(self, key, step, q, k_pages, v_pages, scale, causal, pages_key=None, zero_fill=False,
                  variant=PLAIN, return_lse=False):
        """``out [T, H_q, D]`` of ``q [T, H_q, D]`` over the pages, planning ``step`` on first use
        (with the :class:`Variant`'s window and soft-cap; its sinks go to the run); with
        ``return_lse``, ``(out, lse [T, H_q] float32)``."""
        import cupy
        import torch

        with cupy.cuda.Device(q.device.index):
            entry = self._instance(key, q, k_pages, variant)
            attn = entry[0]
            if entry[1] is not step:
                attn.plan(step.q_lens, step.kv_lens, step.page_table, causal=causal, sm_scale=scale,
                          max_q_len=step.max_q_len, max_kv_len=step.max_kv_len, window=variant.window or None,
                          logits_soft_cap=variant.soft_cap or None)
                entry[1] = step  # held: a later Step can't reuse its id
            cache = self._cache(pages_key, k_pages, v_pages)
            out = torch.zeros_like(q) if zero_fill else torch.empty_like(q)
            lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
            attn.run(q, cache, out=out, lse=lse, sinks=variant.sinks)
        return (out, lse) if return_lse else out


backend = CupyFABackend()
