"""``CupyFaAttnBackend``: SGLang's ``AttentionBackend`` on cupy_fa's kernels (SGLang 0.5.17).

A step (every layer of one forward) is mapped once: :mod:`.metadata` turns the forward batch into
cupy_fa's lengths, page table and tree mask on the device; each attention variant of the model's layers
(scale, sliding window, soft-cap, head counts, dtypes) has a :class:`cupy_fa.BatchAttention` planned
once per step; each layer then writes its K/V through the pool's own ``set_kv_buffer`` and runs. An MLA
model's layers (``MLATokenToKVPool``) take the same step: :mod:`.mla` says what maps where.

The 0.5.17 metadata split:

* ``init_forward_metadata(fb)``: an eager step (auto-sized instances, exact host bounds).
* ``init_forward_metadata_out_graph(fb, in_capture)``: a CUDA-graph step's host part, before capture
  and before each replay: the lengths, page-table columns and tree mask are written into buffers
  made by ``init_cuda_graph_state`` (eager device copies; the page table only as wide as the longest
  request, read from ``seq_lens_cpu`` where SGLang has it).
* ``init_forward_metadata_in_graph(fb)``: recorded into the graph: each known variant's
  ``BatchAttention.plan`` over those buffers (device lengths: no ``.item()``, no host sync, no
  allocation; a variant first seen in a forward is planned there, inside the capture).

Why the pool's ``set_kv_buffer`` writes K/V (not ``PagedKVCache.append``): the pool owns its layout and
its hooks (fp8 quantisation with the layer's scales, alternate streams, HiCache layer transfer, DCP
masks), so the bytes in the cache are exactly those any other SGLang backend writes and switching
backends never changes them; cupy_fa only reads the pages, after the write, as its contract wants.
"""

import dataclasses
from typing import Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from . import kernels as _kernels
from . import mla
from .metadata import ForwardMode, draft_mask_indices, gather_page_table, mode_of, step_lengths


@dataclasses.dataclass
class Step:
    """One step's inputs to ``BatchAttention.plan`` (device tensors) and its host facts."""
    mode: ForwardMode
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    max_q_len: int
    max_kv_len: int
    mask: Optional[torch.Tensor] = None
    graph: bool = False
    serial: int = 0

    @property
    def cache_seqlens_int32(self):  # the name SGLang's kit checks per request (>= 0)
        return self.kv_lens


class CupyFaAttnBackend(AttentionBackend):
    """SGLang attention backend ``"cupy_fa"`` (``cupy_fa.integrations.sglang.register()``).

    Args:
        model_runner: SGLang's ModelRunner (its ``req_to_token_pool``, ``token_to_kv_pool``,
            ``server_args``, ``device``).
        skip_prefill: accepted for SGLang's draft-backend factories (no effect).
    Raises:
        NotImplementedError: an MLA pool of another latent size (or DSA's, fp4), a hybrid sliding-window
            KV pool (separate SWA slots), cross / encoder attention, a forward mode cupy_fa does not
            serve, an MLA layer in the non-absorbed form.
    """

    def __init__(self, model_runner, skip_prefill=False):
        super().__init__()
        self.device = torch.device(model_runner.device)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.use_mla = bool(getattr(model_runner, "use_mla_backend", False))
        if self.use_mla:
            mla.check_pool(self.token_to_kv_pool)
        if hasattr(self.token_to_kv_pool, "translate_loc_from_full_to_swa"):
            raise NotImplementedError("cupy_fa does not read SGLang's hybrid sliding-window KV pool (its SWA "
                                      "layers keep their own slot ids); serve the model without it")
        args = model_runner.server_args
        self.num_draft_tokens = getattr(args, "speculative_num_draft_tokens", None) or 0
        self.page_size = model_runner.page_size
        self.skip_prefill = skip_prefill
        self.kernels = _kernels.Kernels()
        self.forward_metadata = None  # the current Step
        self._serial = 0
        self._plans = {}  # (graph, variant) -> [BatchAttention, serial of the step it planned]
        self._graph_state = None  # set by init_cuda_graph_state

    # ---- the step -----------------------------------------------------------------------

    def _draft_count(self, spec_info):
        n = getattr(spec_info, "draft_token_num", None) if spec_info is not None else None
        return int(n) if n is not None else int(self.num_draft_tokens)

    def _lengths(self, fb, bs, graph):
        mode = mode_of(fb.forward_mode)
        width = self.req_to_token.shape[1]
        spec = getattr(fb, "spec_info", None)
        extend = getattr(fb, "extend_seq_lens", None)
        n = self._draft_count(spec) if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2) else None
        seq_cpu = getattr(fb, "seq_lens_cpu", None)
        lengths = step_lengths(
            mode, fb.seq_lens[:bs], extend_seq_lens=None if extend is None else extend[:bs], num_draft_tokens=n,
            seq_lens_cpu=None if seq_cpu is None else seq_cpu[:bs].tolist(),
            extend_seq_lens_cpu=None if graph else getattr(fb, "extend_seq_lens_cpu", None),
            max_kv_bound=width, num_tokens=getattr(fb.input_ids, "shape", [None])[0])
        return mode, n, lengths

    def _tree_mask(self, mode, spec, seq_lens, n, out=None):
        """cupy_fa's flat [bs * N * N] mask of a TARGET_VERIFY step, or None (causal): EAGLE / DFlash
        chains (``spec_info.topk == 1``: SGLang's mask is then the causal one) and steps without one."""
        if mode is not ForwardMode.TARGET_VERIFY or spec is None:
            return None
        mask = getattr(spec, "custom_mask", None)
        if mask is None or getattr(spec, "topk", None) == 1:
            return None
        picked = mask.reshape(-1)[draft_mask_indices(seq_lens, n, mask.numel())]
        if out is None:
            return picked.to(torch.bool)
        out[:picked.numel()].copy_(picked)
        return out[:picked.numel()]

    def _build_step(self, fb, graph):
        bs = int(fb.batch_size)
        mode, n, lengths = self._lengths(fb, bs, graph)
        spec = getattr(fb, "spec_info", None)
        rpi = fb.req_pool_indices[:bs]
        self._serial += 1
        if not graph:
            table = gather_page_table(self.req_to_token, rpi, lengths.max_kv_len)
            mask = self._tree_mask(mode, spec, fb.seq_lens[:bs], n)
            return Step(mode, lengths.q_lens, lengths.kv_lens, table, lengths.max_q_len, lengths.max_kv_len, mask,
                        False, self._serial)
        g = self._graph_state
        if g is None:
            raise RuntimeError("init_forward_metadata_out_graph before init_cuda_graph_state")
        if bs > g["q_lens"].shape[0]:
            raise ValueError(f"batch of {bs} requests exceeds the CUDA-graph state's {g['q_lens'].shape[0]}")
        g["q_lens"][:bs].copy_(lengths.q_lens)
        g["kv_lens"][:bs].copy_(lengths.kv_lens)
        table = gather_page_table(self.req_to_token, rpi, lengths.max_kv_len, out=g["page_table"])
        mask = self._tree_mask(mode, spec, fb.seq_lens[:bs], n, out=g["mask"])
        # bounds valid for every replay of the graph: the mode's q_len, req_to_token's width
        max_q = 1 if mode is ForwardMode.DECODE else (n if n else lengths.max_q_len)
        return Step(mode, g["q_lens"][:bs], g["kv_lens"][:bs], table, max_q, self.req_to_token.shape[1], mask,
                    True, self._serial)

    def set_step(self, step):
        """Installs a step built elsewhere (the multi-step draft backend's per-step lengths)."""
        self._serial += 1
        step.serial = self._serial
        self.forward_metadata = step

    def init_forward_metadata(self, forward_batch):
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        self.forward_metadata = self._build_step(forward_batch, graph=False)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        self.forward_metadata = self._build_step(forward_batch, graph=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        step = self.forward_metadata
        if step is None:
            return
        for (graph, variant), entry in self._plans.items():
            if graph == step.graph:
                self._plan(entry, variant, step)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        rows = int(max_bs)  # requests (the multi-step draft backend passes its bs * topk rows)
        width = self.req_to_token.shape[1]
        n = max(int(self.num_draft_tokens), 1)
        dev = self.device
        self._graph_state = dict(
            q_lens=torch.zeros(rows, dtype=torch.int32, device=dev),
            kv_lens=torch.zeros(rows, dtype=torch.int32, device=dev),
            page_table=torch.zeros(rows, width, dtype=torch.int32, device=dev),
            mask=torch.zeros(int(max_num_tokens) * n, dtype=torch.bool, device=dev),
            capacity=(rows, int(max_num_tokens), width, int(max_num_tokens) * n))
        for key in [k for k in self._plans if k[0]]:  # instances of an older capacity
            del self._plans[key]

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def on_after_cuda_graph_warmup(self):
        """Nothing to undo: warm-up steps only rewrite buffers the next out_graph rewrites."""

    def draft_extend_metadata_captured_in_graph(self):
        return False  # init_forward_metadata_out_graph must run before each replay

    # ---- a layer -----------------------------------------------------------------------

    def _variant(self, layer, q, kv_dtype):
        if getattr(layer, "is_cross_attention", False):
            raise NotImplementedError("cupy_fa's SGLang backend does not serve cross attention")
        if getattr(getattr(layer, "attn_type", None), "name", "DECODER") != "DECODER":
            raise NotImplementedError(f"cupy_fa's SGLang backend serves causal decoder attention, not "
                                      f"{layer.attn_type.name}")
        if layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError(f"cupy_fa needs one head dim for q, K, V and out, layer {layer.layer_id} has "
                                      f"{layer.qk_head_dim} / {layer.v_head_dim}")
        window = getattr(layer, "sliding_window_size", -1)
        # SGLang's window W: a query at p sees keys p - W .. p (W + 1 keys); cupy_fa counts them all
        window = int(window) + 1 if window is not None and window > 0 else 0
        cap = float(getattr(layer, "logit_cap", 0.0) or 0.0)
        return (float(layer.scaling), window, cap if cap > 0 else 0.0, layer.tp_q_head_num, layer.tp_k_head_num,
                layer.qk_head_dim, str(q.dtype), str(kv_dtype))

    def _plan(self, entry, variant, step):
        if variant[0] == mla.KIND:
            kw = dict(sm_scale=variant[1])
        else:
            scale, window, cap = variant[:3]
            kw = dict(sm_scale=scale, window=window or None, logits_soft_cap=cap or None)
        entry[0].plan(step.q_lens, step.kv_lens, step.page_table, causal=True, custom_mask=step.mask,
                      max_q_len=step.max_q_len, max_kv_len=step.max_kv_len, **kw)
        entry[1] = step.serial

    def _attention(self, variant, step):
        key = (step.graph, variant)
        entry = self._plans.get(key)
        if entry is None:
            capacity = self._graph_state["capacity"] if step.graph else None
            if variant[0] == mla.KIND:
                instance = self.kernels.mla_attention(*variant[2:5], self.device, capacity)
            else:
                instance = self.kernels.attention(*variant[3:8], self.device, capacity)
            entry = self._plans[key] = [instance, -1]
        if entry[1] != step.serial:
            self._plan(entry, variant, step)
        return entry[0]

    def _step(self):
        if self.forward_metadata is None:
            raise RuntimeError("cupy_fa: forward before init_forward_metadata (or on an IDLE step)")
        return self.forward_metadata

    def _forward_mla(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, q_rope, k_rope):
        """An MLA layer (:mod:`.mla`): out ``[T, H * 512]``."""
        if sinks is not None:
            raise NotImplementedError(f"cupy_fa's MLA layers take no attention sinks (layer {layer.layer_id})")
        pool = self.token_to_kv_pool
        if k is not None and save_kv_cache:
            mla.write(pool, layer, forward_batch.out_cache_loc, k, v, k_rope)
        step = self._step()
        heads = layer.tp_q_head_num
        q3, q_pe = mla.queries(q, q_rope, heads)
        buffer = pool.get_key_buffer(layer.layer_id)
        attn = self._attention(mla.variant(layer, q3, buffer.dtype), step)
        cache = self.kernels.latent_cache(layer.layer_id, buffer, getattr(layer, "k_scale", None))
        out = q3.new_empty(q3.shape[0], heads, mla.KV_LORA_RANK)
        attn.run(q3, cache, out=out, q_pe=q_pe)
        return out.view(-1, heads * mla.KV_LORA_RANK)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, sinks=None, q_rope=None, k_rope=None):
        if self.use_mla:
            return self._forward_mla(q, k, v, layer, forward_batch, save_kv_cache, sinks, q_rope, k_rope)
        pool = self.token_to_kv_pool
        if k is not None and save_kv_cache:
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        step = self._step()
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.detach().reshape(-1, heads, dim)  # inference: DLPack refuses tensors that require grad
        if not q3.is_contiguous():
            q3 = q3.contiguous()
        k_buffer = pool.get_key_buffer(layer.layer_id)
        attn = self._attention(self._variant(layer, q3, k_buffer.dtype), step)
        cache = self.kernels.cache(layer.layer_id, k_buffer, pool.get_value_buffer(layer.layer_id),
                                   getattr(layer, "k_scale", None), getattr(layer, "v_scale", None))
        out = torch.empty_like(q3)
        if sinks is not None:
            sinks = sinks.detach()
            if sinks.dtype != torch.float32 or not sinks.is_contiguous():
                sinks = sinks.to(torch.float32).contiguous()
        attn.run(q3, cache, out=out, sinks=sinks)
        return out.view(-1, heads * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, q_rope=None,
                       k_rope=None, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, sinks, q_rope, k_rope)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, q_rope=None,
                       k_rope=None, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, sinks, q_rope, k_rope)
