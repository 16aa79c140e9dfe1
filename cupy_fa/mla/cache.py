"""The paged latent cache of multi-head latent attention: one array ``[num_pages, page_size, 576]``.

A token's row is its c_kv (``kv_lora_rank`` = 512 columns: the compressed key-value, which is also
the value the absorbed form multiplies P by) then its k_pe (``qk_rope_head_dim`` = 64: the rotary
key). One array, not c_kv and k_pe apart, because that is what engines hold and what the fastest
kernels read: SGLang's ``MLATokenToKVPool`` keeps one ``[slots, 1, 576]`` buffer per layer
(FlashInfer's MLA wrapper is handed its two column slices as views of it), vLLM and FlashMLA one
``[blocks, block_size, 576]`` array; a key tile of 576 contiguous columns is one gather per token,
and the values are its first 512 columns in place. Token j of a request lives in page
``page_table[b, j // page_size]`` at offset ``j % page_size``, its slot ``page x page_size + offset``.

An fp8 cache holds e4m3fn bytes and one dequantisation scale for the whole cache (value = e4m3 x
scale), as SGLang's fp8 MLA pool does with its layer's k_scale.
"""

import threading

import numpy as np

from .. import _arrays, _build, _params as _lib_params
from ..families import mla as family
from ..kv_cache import all_ones_word, append_intake, checked_scales, page_shift, read_append_status, staged_slots
from .. import _mla_params as _params

_APPEND = _params.DTYPES["MlaAppendParams"]
_set_append = _lib_params.field_setter("MlaAppendParams", ("ckv", "kpe", "slots", "ckv_stride", "kpe_stride",
                                                           "num_tokens"), _params.DTYPES)

LATENT_DIM, KV_LORA_RANK, ROPE_DIM = family.LATENT_DIM, family.VALUE_DIM, family.ROPE_DIM


class PagedLatentCache:
    """MLA latent pages, allocated here or wrapped zero-copy from any DLPack array.

    Args:
        latent: a device array ``[num_pages, page_size, 576]`` (or ``[num_pages, page_size, 1, 576]``,
            SGLang's ``[slots, 1, 576]`` buffer being page size 1), float16, bfloat16 or
            float8_e4m3fn (a torch ``float8_e4m3fn`` tensor, a CuPy array of ml_dtypes'
            ``float8_e4m3fn``, or uint8 bytes with ``dtype="float8_e4m3fn"``), C-contiguous,
            16-byte aligned. Written in place; the caller's object is kept alive.
        dtype: None (the array's own) or ``"float8_e4m3fn"`` to read a uint8 array as e4m3 bytes.
        scale: an fp8 cache's dequantisation scale (value = e4m3 x scale): a positive, finite,
            normal float32 (a float, or a 0-d / 1-element array, host or device). Default 1.0.
    Attributes:
        latent: the CuPy view (uint8 for fp8) ``[num_pages, page_size, 576]``; ckv / kpe: its
        column slices ``[..., :512]`` / ``[..., 512:]`` (views, e.g. for FlashInfer's MLA wrapper);
        num_pages, page_size, dtype_name, scale (float, fp8) and scale_device, device_id.
    Raises:
        TypeError: a NumPy array, an unsupported dtype, a uint8 array without
            ``dtype="float8_e4m3fn"``, a ``dtype`` other than the array's own.
        ValueError: a CPU tensor, a shape other than the above (the last dimension must be 576: a
            ``kv_lora_rank`` of 512 and a rope part of 64), not C-contiguous, misaligned, empty, more
            than 2**32 - 1 token rows (num_pages x page_size: the kernels find a row in 32 bits); a
            scale that is not one positive finite normal float32, or a scale for a 16-bit cache.
    """

    def __init__(self, latent, *, dtype=None, scale=None):
        self.source = latent
        want = None if dtype is None else _arrays.resolve_kv_dtype(dtype)
        _arrays.refuse_host(latent, "latent")
        _arrays.require_cuda()
        raw = _arrays.fp8_bytes(latent, "latent")
        dev = raw if raw is not None else _arrays.to_cupy(latent, "latent")
        if dev.ndim == 4 and dev.shape[2] == 1:
            dev = dev.reshape(dev.shape[0], dev.shape[1], dev.shape[3])
        if dev.ndim != 3 or dev.shape[-1] != LATENT_DIM:
            raise ValueError(f"latent must be [num_pages, page_size, {LATENT_DIM}] (kv_lora_rank {KV_LORA_RANK} + "
                             f"rope {ROPE_DIM}) or [num_pages, page_size, 1, {LATENT_DIM}], got shape "
                             f"{tuple(getattr(latent, 'shape', dev.shape))}")
        if raw is not None or (dev.dtype == np.uint8 and want == _arrays.FP8):
            self.dtype_name = _arrays.FP8
        elif dev.dtype == np.uint8:
            raise TypeError("latent is uint8: a uint8 array is read as e4m3fn bytes only with dtype='float8_e4m3fn'")
        else:
            self.dtype_name = _arrays.resolve_dtype(dev.dtype, "latent.dtype")
        if want is not None and want != self.dtype_name:
            raise TypeError(f"dtype={want!r} but latent holds {self.dtype_name}")
        _arrays.check_device_array(dev, "latent")
        self.latent = dev
        self.device_id = int(dev.device.id)
        self.num_pages, self.page_size = int(dev.shape[0]), int(dev.shape[1])
        if self.num_pages < 1 or self.page_size < 1:
            raise ValueError(f"latent must have at least one page of at least one token, got shape {tuple(dev.shape)}")
        if self.num_pages * self.page_size >= 2**32:  # the kernels find a token's row in 32 bits
            raise ValueError(f"latent holds {self.num_pages * self.page_size} token rows; at most 2**32 - 1")
        if not self.is_fp8 and scale is not None:
            raise ValueError(f"scale is for an fp8 (float8_e4m3fn) cache; this one is {self.dtype_name}")
        self.scale = self.scale_device = None
        import cupy

        self._device = cupy.cuda.Device(self.device_id)
        # the append kernel's packed launches (by kernel), their per-call fields rewritten under a lock
        self._append_launches, self._append_lock = {}, threading.Lock()
        with self._device:
            self._status = all_ones_word()
            if self.is_fp8:
                self.scale = float(checked_scales(scale, "scale", 1)[0])
                self.scale_device = cupy.asarray(np.array([self.scale], np.float32))

    @classmethod
    def allocate(cls, num_pages, page_size, dtype="bfloat16", *, scale=None, device=None):
        """A zero-filled cache ``[num_pages, page_size, 576]`` of ``dtype`` ("bfloat16", "float16",
        "float8_e4m3fn" with its ``scale``) on ``device`` (default CuPy's current device).

        Raises:
            ValueError: a dimension below 1; a bad scale; a ``device`` that is no CUDA device here.
            TypeError: another dtype.
        """
        name = _arrays.resolve_kv_dtype(dtype)
        if int(num_pages) < 1 or int(page_size) < 1:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        _arrays.require_cuda()
        import cupy

        with cupy.cuda.Device(_arrays.resolve_device(device)):
            arr = cupy.zeros((int(num_pages), int(page_size), LATENT_DIM),
                             np.uint8 if name == _arrays.FP8 else _arrays.DTYPES[name])
        return cls(arr, dtype=name, scale=scale)

    @property
    def is_fp8(self):
        return self.dtype_name == _arrays.FP8

    @property
    def num_slots(self):
        return self.num_pages * self.page_size

    @property
    def ckv(self):
        """The c_kv columns ``[num_pages, page_size, 512]`` (a strided view)."""
        return self.latent[..., :KV_LORA_RANK]

    @property
    def kpe(self):
        """The k_pe columns ``[num_pages, page_size, 64]`` (a strided view)."""
        return self.latent[..., KV_LORA_RANK:]

    def kernel_fields(self):
        """The MLA kernels' parameters this cache sets (MlaParams): a captured step bakes these in."""
        return dict(cache=self.latent.data.ptr, page_size=self.page_size, page_shift=page_shift(self.page_size),
                    num_pages=self.num_pages,
                    kv_scale=self.scale_device.data.ptr if self.is_fp8 else 0)

    def append(self, ckv, kpe, slots):
        """Writes new tokens' latent rows at their slots, on the caller's stream.

        Args:
            ckv: ``[T, 512]`` (or ``[T, 1, 512]``) device array, each token's c_kv; kpe: ``[T, 64]`` (or
                ``[T, 1, 64]``), its rotary key (after RoPE). The cache's dtype for a 16-bit cache;
                float16 or bfloat16 (both the same) for an fp8 one, quantised on the fly to
                ``e4m3(x / scale)`` (round to nearest even, saturating at +-448, NaN kept). Last
                dimension contiguous, rows on 16-byte boundaries (any token stride: two column
                slices of one ``[T, 576]`` array work).
            slots: ``[T]`` ints ``page x page_size + offset``: host (checked against the cache before
                anything is written) or device int32 / int64 (negative: skipped, as a graph bucket's
                padding; past the cache: skipped and reported by :meth:`status`).
        Raises:
            TypeError: NumPy arrays, another dtype, non-integer slots.
            ValueError: shapes that do not fit the cache or each other, a host slot outside the cache,
                arrays on the CPU or another device, a strided last dimension, misaligned rows.
        Nothing is written when it raises.
        """
        with self._device:
            self._append(ckv, kpe, slots)

    def _append(self, ckv, kpe, slots):
        stream, (c, k), host, dev = append_intake((ckv, kpe), ("ckv", "kpe"), slots, self.device_id)
        want = None if self.is_fp8 else self.dtype_name
        c_ptr, c_stride, tokens = _rows(c, "ckv", KV_LORA_RANK, want, self.device_id)
        k_ptr, k_stride, k_tokens = _rows(k, "kpe", ROPE_DIM, want, self.device_id)
        if c.dtype != k.dtype:
            raise TypeError(f"ckv and kpe must have one dtype, got {_arrays.dtype_name(c.dtype)} and "
                            f"{_arrays.dtype_name(k.dtype)}")
        if tokens != k_tokens:
            raise ValueError(f"ckv has {tokens} tokens, kpe has {k_tokens}")
        dev = staged_slots(host, dev, tokens, "ckv", self.num_slots, self.device_id, stream)
        if tokens == 0:
            return
        kernel = family.append_kernel(dev.dtype, _arrays.dtype_name(c.dtype), self.is_fp8)
        with self._append_lock:  # the kernel's struct packed once, this call's fields rewritten
            launch = self._append_launches.get(kernel)
            if launch is None:
                packed = np.array([self.append_params(ckv=0, kpe=0, slots=0, ckv_stride=0, kpe_stride=0, num_tokens=0)],
                                  _APPEND)
                launch = self._append_launches[kernel] = _build.PackedLaunch(kernel, (1,), packed, self.device_id)
            _set_append(launch.raw, (c_ptr, k_ptr, dev.data.ptr, c_stride, k_stride, tokens))
            launch.set_grid(min(-(-tokens * (LATENT_DIM // 8) // kernel.threads), 65535))
            _build.launch_packed(launch, stream.ptr)

    def append_params(self, *, ckv, kpe, slots, ckv_stride, kpe_stride, num_tokens):
        """The ``MlaAppendParams`` of one append (an ``np.void``), every field named: this cache's
        rows, status word and scale, and the call's rows (addresses, token strides in elements),
        slots and token count."""
        return _params.make(
            "MlaAppendParams", ckv=ckv, kpe=kpe, cache=self.latent.data.ptr, slots=slots,
            status=self._status.data.ptr, scale=self.scale_device.data.ptr if self.is_fp8 else 0,
            num_slots=self.num_slots, ckv_stride=ckv_stride, kpe_stride=kpe_stride, num_tokens=num_tokens)

    def status(self):
        """The first token the appends since the last ``status()`` skipped because its slot lies past
        the cache (a :class:`cupy_fa.status.Status`, 0 when none), then clears it; syncs the device."""
        return read_append_status(self._status, self._device)

    def __repr__(self):
        return f"PagedLatentCache(num_pages={self.num_pages}, page_size={self.page_size}, dtype={self.dtype_name})"


def _rows(x, name, width, dtype_name, device_id):
    """(address, token stride in elements, tokens) of a ``[T, width]`` (or ``[T, 1, width]``) view
    (cupy_fa._views.View, or a CuPy array) with a contiguous last dimension and 16-byte aligned rows,
    of ``dtype_name`` (None: float16 or bfloat16)."""
    shape, strides = tuple(x.shape), x.strides
    if len(shape) == 3 and shape[1] == 1:
        shape, strides = (shape[0], shape[2]), (strides[0], strides[2])
    if len(shape) != 2 or shape[1] != width:
        raise ValueError(f"{name} must be [T, {width}] (or [T, 1, {width}]), got shape {tuple(x.shape)}")
    try:
        got = _arrays.resolve_dtype(x.dtype, f"{name}.dtype")
    except TypeError:
        got = None
    if got is None or (dtype_name is not None and got != dtype_name):
        want = dtype_name or "float16 or bfloat16 (quantised into the fp8 cache)"
        raise TypeError(f"{name} must have dtype {want}, got {_arrays.dtype_name(x.dtype)}")
    check_rows(x, name, device_id, strides=strides, shape=shape)
    return x.data.ptr, strides[0] // x.dtype.itemsize, int(shape[0])


def check_rows(x, name, device_id, bound="the device of this cache", strides=None, shape=None):
    """A strided device view (a CuPy array or a cupy_fa._views.View; ``strides`` / ``shape``: its
    strides in bytes and shape where the caller has read or squeezed them) whose rows the kernels move
    in 16-byte pieces: its last dimension contiguous, every row start on a 16-byte boundary (base
    pointer and strides), on ``device_id``."""
    shape = x.shape if shape is None else shape
    if 0 in shape:  # (empty)
        return
    strides = x.strides if strides is None else strides
    if strides[-1] != x.dtype.itemsize:
        raise ValueError(f"{name} must have a contiguous last dimension (got strides {strides})")
    if x.data.ptr % 16 or any(s % 16 for s, n in zip(strides[:-1], shape[:-1]) if n > 1):
        raise ValueError(f"{name}'s rows must start on 16-byte boundaries (address {x.data.ptr:#x}, strides "
                         f"{strides})")
    _arrays.check_device(x, name, device_id, bound)
