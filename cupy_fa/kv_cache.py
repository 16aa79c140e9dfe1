"""The paged KV cache: K and V arrays ``[num_pages, page_size, H_kv, D]`` (NHD).

Token j of a request lives in page ``page_table[b, j // page_size]`` at offset
``j % page_size``; its *slot* is ``page * page_size + offset``.
"""

import numpy as np

from . import _arrays, _build, _params, schedule


class PagedKVCache:
    """K/V cache pages, allocated here or wrapped zero-copy from any DLPack arrays.

    Args:
        k, v: device arrays ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD: a page
            holds ``page_size`` consecutive tokens of one request, each ``num_kv_heads x
            head_dim``), float16 or bfloat16, C-contiguous, 16-byte aligned, same shape, dtype
            and device; ``head_dim`` a multiple of 8. Any page size (powers of two shift, others
            divide). The caller's objects are kept alive and written in place.
    Attributes:
        k, v: the CuPy views; num_pages, page_size, num_kv_heads, head_dim; dtype_name.
    Raises:
        TypeError: a NumPy array, an unsupported dtype, v of another dtype.
        ValueError: a CPU tensor, not 4-dimensional, v of another shape or device, not
            C-contiguous or misaligned, a head dim that is not a multiple of 8, an empty cache.
    """

    def __init__(self, k, v):
        self.k_source, self.v_source = k, v  # the caller's objects, kept alive
        k_dev = _arrays.to_cupy(k, "k")
        v_dev = _arrays.to_cupy(v, "v")
        if k_dev.ndim != 4:
            raise ValueError(f"k must be [num_pages, page_size, num_kv_heads, head_dim], "
                             f"got shape {tuple(k_dev.shape)}")
        self.dtype_name = _arrays.resolve_dtype(k_dev.dtype, "k.dtype")
        _arrays.check_device_array(k_dev, "k")
        _arrays.check_device_array(v_dev, "v", dtype=self.dtype_name, shape=k_dev.shape, device_id=k_dev.device.id)
        if k_dev.shape[3] % 8:
            raise ValueError(f"head_dim (k.shape[3]) must be a multiple of 8, got {k_dev.shape[3]}")
        self.k, self.v = k_dev, v_dev
        self.num_pages, self.page_size, self.num_kv_heads, self.head_dim = (int(s) for s in k_dev.shape)
        if self.page_size < 1 or self.num_pages < 1:
            raise ValueError(f"k must have at least one page of at least one token, got shape {tuple(k_dev.shape)}")
        import cupy

        with cupy.cuda.Device(k_dev.device.id):  # the append kernel's status word (status.cuh)
            self._status = cupy.full(1, (1 << 64) - 1, np.uint64)

    @classmethod
    def allocate(cls, num_pages, page_size, num_kv_heads, head_dim, dtype="bfloat16"):
        """A zero-filled cache ``[num_pages, page_size, num_kv_heads, head_dim]`` of ``dtype``
        ("bfloat16" / "float16") on the current CuPy device.

        Raises:
            ValueError: a dimension below 1 (or a head dim that is not a multiple of 8).
            TypeError: another dtype.
        """
        import cupy

        np_dtype = _arrays.DTYPES[_arrays.resolve_dtype(dtype)]
        shape = (int(num_pages), int(page_size), int(num_kv_heads), int(head_dim))
        if min(shape) < 1:
            raise ValueError(f"cache dimensions must be positive, got {shape}")
        _arrays.require_cuda()
        return cls(cupy.zeros(shape, np_dtype), cupy.zeros(shape, np_dtype))

    @property
    def dtype(self):
        return _arrays.DTYPES[self.dtype_name]

    @property
    def num_slots(self):
        return self.num_pages * self.page_size

    def append(self, k_new, v_new, slots):
        """Writes new K/V rows at their slots, on the caller's stream (torch's current stream
        for torch tensors, else CuPy's).

        Args:
            k_new, v_new: device arrays ``[T, num_kv_heads, head_dim]`` of the cache dtype,
                C-contiguous, 16-byte aligned.
            slots: ``[T]`` ints, ``page * page_size + offset``; host (list, NumPy, CPU torch) or
                device (int32 or int64). Host slots are range-checked before anything is
                written; on a device array (graph replay) negative slots mean "skip" (padding),
                and slots past the cache are skipped too and reported by :meth:`status`.
        Raises:
            TypeError: NumPy K/V, another dtype, non-integer slots (device: not int32 / int64).
            ValueError: shapes that do not match the cache or each other, a host slot outside
                ``0 .. num_pages * page_size - 1``, K/V on the CPU or another device, misaligned
                or non-contiguous arrays.
            RuntimeError: no usable CUDA device.
        Nothing is written when it raises.
        """
        stream = _arrays.caller_stream(k_new, v_new, slots)
        with stream:  # DLPack exchange on the caller's stream (a capture must see no foreign stream)
            k_dev = _arrays.to_cupy(k_new, "k_new")
            v_dev = _arrays.to_cupy(v_new, "v_new")
            host, dev = _arrays.host_or_device_ints(slots, "slots", 1)
        row = (None, self.num_kv_heads, self.head_dim)
        _arrays.check_device_array(k_dev, "k_new", dtype=self.dtype_name, ndim=3, shape=row, device_id=self.k.device.id)
        _arrays.check_device_array(v_dev, "v_new", dtype=self.dtype_name, shape=k_dev.shape, device_id=self.k.device.id)
        num_tokens = int(k_dev.shape[0])
        if host is not None:
            if host.shape[0] != num_tokens:
                raise ValueError(f"slots has {host.shape[0]} entries, k_new has {num_tokens} tokens")
            bad = np.flatnonzero((host < 0) | (host >= self.num_slots))
            if bad.size:
                raise ValueError(f"slots[{bad[0]}] = {host[bad[0]]} is outside the cache "
                                 f"(0 <= slot < num_pages * page_size = {self.num_slots})")
            import cupy

            with stream:
                dev = cupy.asarray(host.astype(np.int64))
        else:
            if dev.shape[0] != num_tokens:
                raise ValueError(f"slots has {dev.shape[0]} entries, k_new has {num_tokens} tokens")
            if dev.dtype not in (np.int32, np.int64):
                raise TypeError(f"slots must be int32 or int64, got {dev.dtype}")
            _arrays.check_device_array(dev, "slots", device_id=self.k.device.id, align=dev.itemsize)
        if num_tokens == 0:
            return
        row_chunks = self.num_kv_heads * self.head_dim // 8
        params = _params.make(
            "AppendParams", k_new=k_dev.data.ptr, v_new=v_dev.data.ptr, k_cache=self.k.data.ptr,
            v_cache=self.v.data.ptr, slots=dev.data.ptr, num_slots=self.num_slots,
            num_tokens=num_tokens, row_chunks=row_chunks, status=self._status.data.ptr)
        variant = schedule.append_variant(dev.dtype)
        blocks = min((num_tokens * row_chunks + variant.threads - 1) // variant.threads, 65535)
        _build.launch(variant, (blocks,), params, stream)

    def status(self):
        """The first device slot the appends since the last ``status()`` skipped because it lies
        past the cache (negative slots are padding, not errors), then clears it; syncs the
        device. A :class:`cupy_fa.status.Status` (``int``): 0 when none, else 1 + the token's
        index in its ``append`` call, ``str()`` e.g. ``token 2: its slot is outside the cache``."""
        import cupy

        from . import status as _status

        cupy.cuda.Device().synchronize()
        found = _status.read(self._status, "token")
        self._status.fill((1 << 64) - 1)
        cupy.cuda.Device().synchronize()
        return found

    def __repr__(self):
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype_name})")
