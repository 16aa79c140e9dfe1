"""MLA layers (DeepSeek V2 / V3 / R1, Kimi K2) on the SGLang backend: SGLang's ``MLATokenToKVPool`` read
in place by :class:`cupy_fa.mla.MLAAttention` (the absorbed form). Torch and sglang imports stay inside
the functions that need them.

The pool: one buffer per layer ``[slots, 1, kv_lora_rank + qk_rope_head_dim]`` = ``[slots, 1, 576]``,
a token's c_kv (512 columns, also its value) then its k_pe (64); ``req_to_token[r, j]`` is the slot of
token j of request r, as in the MHA pool. The buffer is wrapped as a
:class:`cupy_fa.mla.PagedLatentCache` of one-token pages (zero copy; an fp8 buffer with the layer's
``k_scale``), and the step's lengths and page table are the MHA path's (:mod:`.metadata`).

What SGLang hands ``forward_extend`` / ``forward_decode`` on an absorbed-MLA layer (DeepSeek's
``attn_mqa``: ``tp_q_head_num`` H, ``tp_k_head_num`` 1, ``qk_head_dim`` 576, ``v_head_dim`` 512):

* q ``[T, H * 576]`` or ``[T, H, 576]`` (q_nope W_UK then q_pe), k ``[T, 1, 576]`` (c_kv then k_pe),
  v = c_kv ``[T, 1, 512]``: the step's rows are written with the pool's ``set_kv_buffer(layer, loc,
  k, v)`` (which stores k);
* or q = q_nope ``[T, H, 512]`` with ``q_rope`` ``[T, H, 64]``, k = c_kv with ``k_rope`` ``[T, 1, 64]``:
  written with ``set_mla_kv_buffer(layer, loc, k, k_rope)``, q read as two views (no concatenation);
* k None (the caller wrote the rows itself, ``save_kv_cache=False``): read only.

The output is ``[T, H * 512]`` (the model applies W_UV).

DeepSeek's model code (SGLang 0.5.17) chooses per step between that absorbed path and a non-absorbed
MHA prefill (``attn_mha``: qk head 192, v head 128, H KV heads) by the attention backend's name, and a
name it does not know takes triton's rule: the MHA prefill for a batch without prefix. cupy_fa has no
kernel for that path (two head dims), so :func:`install_dispatch` (run by ``register()``) gives
``"cupy_fa"`` a rule of its own: the absorbed path for every step. A layer of the other shape is
refused (:func:`variant`) with NotImplementedError.
"""

from ...families.mla import ROPE_DIM, VALUE_DIM as KV_LORA_RANK  # the latent sizes MLAAttention takes

KIND = "mla"  # first field of an MLA layer's variant key (the backend's instance table)


def check_pool(pool):
    """Refuses (NotImplementedError) an MLA pool the kernels do not read: another latent size, DSA's
    sparse-attention pool, the fp4 pool."""
    rank, rope = getattr(pool, "kv_lora_rank", None), getattr(pool, "qk_rope_head_dim", None)
    if getattr(pool, "use_dsa", False):
        raise NotImplementedError("cupy_fa does not serve DSA (DeepSeek sparse attention) MLA pools")
    if "FP4" in type(pool).__name__:
        raise NotImplementedError(f"cupy_fa reads 16-bit and fp8 MLA pools, not {type(pool).__name__}")
    if (rank, rope) != (KV_LORA_RANK, ROPE_DIM) or getattr(pool, "kv_cache_dim", KV_LORA_RANK + ROPE_DIM) != (
            KV_LORA_RANK + ROPE_DIM):
        raise NotImplementedError(
            f"cupy_fa's MLA kernels take kv_lora_rank {KV_LORA_RANK} and qk_rope_head_dim {ROPE_DIM} (DeepSeek "
            f"V2 / V3 / R1, Kimi K2); the MLA pool has kv_lora_rank {rank} and qk_rope_head_dim {rope}")


def variant(layer, q, kv_dtype):
    """The instance key of an absorbed-MLA layer: (KIND, scale, heads, q dtype, cache dtype).

    Raises:
        NotImplementedError: a layer of another shape (DeepSeek's non-absorbed MHA prefill, qk head
            192 / v head 128), or one with sinks.
    """
    shape = (layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim)
    if shape != (1, KV_LORA_RANK + ROPE_DIM, KV_LORA_RANK):
        raise NotImplementedError(
            f"cupy_fa serves MLA layers in the absorbed form (1 latent head, qk head {KV_LORA_RANK + ROPE_DIM}, "
            f"v head {KV_LORA_RANK}); layer {layer.layer_id} has {shape[0]} KV heads, qk head {shape[1]}, v head "
            f"{shape[2]} (the non-absorbed MHA prefill): register() routes DeepSeek's layers to the absorbed form")
    return (KIND, float(layer.scaling), int(layer.tp_q_head_num), str(q.dtype), str(kv_dtype))


def write(pool, layer, loc, k, v, k_rope):
    """The step's latent rows, through the pool's own setter (its dtype cast and layout)."""
    if k_rope is not None:
        pool.set_mla_kv_buffer(layer, loc, k, k_rope)
    else:
        pool.set_kv_buffer(layer, loc, k, v)


def queries(q, q_rope, heads):
    """(q ``[T, H, 576]``, None), or (q_nope ``[T, H, 512]``, q_pe ``[T, H, 64]``) with ``q_rope``:
    detached views (DLPack refuses tensors that require grad) with a contiguous last dimension."""
    if q_rope is None:
        return _rows(q, heads, KV_LORA_RANK + ROPE_DIM), None
    return _rows(q, heads, KV_LORA_RANK), _rows(q_rope, heads, ROPE_DIM)


def _rows(x, heads, width):
    x = x.detach()
    x = x.view(-1, heads, width) if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, heads, width)
    return x if x.stride(-1) == 1 else x.contiguous()


def absorbed_mla(attn, forward_batch):
    """DeepSeek's forward-method rule for ``"cupy_fa"``: the absorbed MLA path for every step."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import _dispatch_mla_subtype

    return _dispatch_mla_subtype(attn, forward_batch)


def install_dispatch(name):
    """Registers :func:`absorbed_mla` as DeepSeek's rule for backend ``name`` (idempotent)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    AttentionBackendRegistry.register(name, absorbed_mla)
