"""cupy_fa's kernels behind the SGLang backend: the pool's K/V buffers as :class:`cupy_fa.PagedKVCache`
views (an MLA pool's latent buffer as a :class:`cupy_fa.mla.PagedLatentCache`), and the
:class:`cupy_fa.BatchAttention` / :class:`cupy_fa.mla.MLAAttention` instances a step plans. The backend
calls only :class:`Kernels`; the CPU tests put the float64 reference in its place (tests/sglang_harness)."""

FP8_NAMES = ("torch.float8_e4m3fn",)


def scale_value(scale):
    """A layer's k_scale / v_scale (None, a float, or a one-element tensor) as a host float."""
    if scale is None:
        return 1.0
    if hasattr(scale, "numel"):
        if scale.numel() != 1:
            raise NotImplementedError(f"cupy_fa takes one fp8 scale per tensor here, got {scale.numel()} values")
        return float(scale.reshape(()).item())
    return float(scale)


class Kernels:
    """Wraps a pool buffer once per (layer, address) and builds BatchAttention instances."""

    def __init__(self):
        self._caches = {}  # (layer_id, K/V addresses, shape, dtype) -> PagedKVCache / PagedLatentCache

    def cache(self, layer_id, k_buffer, v_buffer, k_scale=None, v_scale=None):
        """The pool's ``[slots, H_kv, D]`` K/V buffers of a layer as one-token pages
        ``[slots, 1, H_kv, D]`` (zero copy); fp8 buffers with the layer's scales."""
        import cupy

        import cupy_fa

        key = (layer_id, k_buffer.data_ptr(), v_buffer.data_ptr(), tuple(k_buffer.shape), str(k_buffer.dtype))
        cache = self._caches.get(key)
        if cache is not None:  # the pool hands out a new view object per call (fp8: .view(dtype))
            return cache
        # detached views (the same memory): a pool written from tensors that require grad (outside
        # torch.no_grad) requires grad itself, and DLPack refuses to export those
        k = k_buffer.detach().view(k_buffer.shape[0], 1, k_buffer.shape[1], k_buffer.shape[2])
        v = v_buffer.detach().view(v_buffer.shape[0], 1, v_buffer.shape[1], v_buffer.shape[2])
        fp8 = str(k_buffer.dtype) in FP8_NAMES
        scales = dict(k_scale=scale_value(k_scale), v_scale=scale_value(v_scale)) if fp8 else {}
        with cupy.cuda.Device(k_buffer.device.index):
            cache = cupy_fa.PagedKVCache(k, v, **scales)
        self._caches[key] = cache
        return cache

    def latent_cache(self, layer_id, buffer, scale=None):
        """An MLA pool's ``[slots, 1, 576]`` latent buffer of a layer as one-token pages (zero copy); an
        fp8 buffer with the layer's k_scale."""
        import cupy

        from cupy_fa.mla import PagedLatentCache

        key = (layer_id, buffer.data_ptr(), tuple(buffer.shape), str(buffer.dtype))
        cache = self._caches.get(key)
        if cache is None:
            fp8 = str(buffer.dtype) in FP8_NAMES
            with cupy.cuda.Device(buffer.device.index):
                cache = PagedLatentCache(buffer.detach(), scale=scale_value(scale) if fp8 else None)
            self._caches[key] = cache
        return cache

    def mla_attention(self, num_heads, dtype, kv_dtype, device, capacity=None):
        """An MLAAttention (DeepSeek's 512 + 64 latent); ``capacity`` as for :meth:`attention`."""
        from cupy_fa.mla import MLAAttention

        return MLAAttention(num_heads, str(dtype),
                            kv_dtype="float8_e4m3fn" if str(kv_dtype) in FP8_NAMES else None,
                            device=device.index, **_capacity(capacity))

    def attention(self, num_qo_heads, num_kv_heads, head_dim, dtype, kv_dtype, device, capacity=None):
        """A BatchAttention; ``capacity`` = (max_batch_size, max_num_tokens, max_pages, max_mask_bytes)
        allocates every buffer now (a CUDA-graph instance), else it is sized on first use."""
        import cupy_fa

        return cupy_fa.BatchAttention(num_qo_heads, num_kv_heads, head_dim, str(dtype),
                                      kv_dtype="float8_e4m3fn" if str(kv_dtype) in FP8_NAMES else None,
                                      device=device.index, **_capacity(capacity))


def _capacity(capacity):
    """(max_batch_size, max_num_tokens, max_pages, max_mask_bytes) as the instances' keywords."""
    if capacity is None:
        return {}
    return dict(max_batch_size=capacity[0], max_num_tokens=capacity[1], max_pages_per_request=capacity[2],
                max_mask_bytes=capacity[3])
