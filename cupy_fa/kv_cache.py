"""The paged KV cache: K and V arrays ``[num_pages, page_size, H_kv, D]`` (NHD; V ``[..., D_v]``
where the qk / vo head dims differ).

Token j of a request lives in page ``page_table[b, j // page_size]`` at offset
``j % page_size``; its *slot* is ``page * page_size + offset``.

An fp8 cache (dtype ``float8_e4m3fn``) holds e4m3fn bytes and a scale per KV head for K and
one for V: a key's value is ``e4m3(byte) * k_scale[head]`` (docs/design.md, "fp8 KV cache").
"""

import threading

import numpy as np

from . import _arrays, _build, _params, _views, catalog
from .families.common import HEAD_DIM_PAIRS

_APPEND = _params.DTYPES["AppendParams"]
_set_append = _params.field_setter("AppendParams", ("k_new", "v_new", "slots", "num_tokens"))


class PagedKVCache:
    """K/V cache pages, allocated here or wrapped zero-copy from any DLPack arrays.

    Args:
        k, v: device arrays ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD: a page
            holds ``page_size`` consecutive tokens of one request, each ``num_kv_heads x
            head_dim``), float16, bfloat16 or float8_e4m3fn, C-contiguous, 16-byte aligned, same
            shape, dtype and device (a 16-bit cache's v may have its own last dim, ``head_dim_v``:
            separate qk / vo head dims); ``head_dim`` a multiple of 8 (of 16 for fp8). Any page size
            (powers of two shift, others divide). The caller's objects are kept alive and
            written in place. fp8: torch ``float8_e4m3fn`` tensors (passed to CuPy as uint8
            bytes, zero copy: CuPy 14's DLPack carries no fp8 type), CuPy arrays of ml_dtypes'
            ``float8_e4m3fn``, or uint8 arrays of e4m3fn bytes with ``dtype="float8_e4m3fn"``
            (how a JAX array or any producer whose fp8 DLPack cannot cross comes in: a uint8
            bitcast of it).
        dtype: None (the arrays' own), or ``"float8_e4m3fn"`` to read uint8 arrays as e4m3fn bytes.
        k_scale, v_scale: an fp8 cache's dequantisation scales (``k = e4m3(byte) * k_scale``):
            a Python float or a 0-d / 1-element array (one per tensor), or a float32 ``[num_kv_heads]``
            array (one per KV head), host or device; positive, finite, normal float32 values.
            Default 1.0. Per token-head scales are not supported.
    The cache is bound to the device its arrays live on (``device_id``): ``append`` and ``status``
    make it current for their allocations and launches, whatever device the caller has current,
    and refuse new rows on another device.

    Attributes:
        k, v: the CuPy views (uint8 bytes for fp8); device_id; num_pages, page_size, num_kv_heads, head_dim,
        head_dim_v (V's: head_dim unless separate);
        dtype_name; k_scale, v_scale: float32 ``[num_kv_heads]`` NumPy copies (fp8; else None),
        k_scale_device, v_scale_device: the same on the device, which the kernels read.
    Raises:
        TypeError: a NumPy array, an unsupported dtype, v of another dtype, a uint8 array without
            ``dtype="float8_e4m3fn"``, ``dtype`` other than the arrays' own.
        ValueError: a CPU tensor, not 4-dimensional, v of another shape or device, not
            C-contiguous or misaligned, a head dim that is not a multiple of 8 (16 for fp8), an
            empty cache; a scale of another shape (e.g. per token-head), not positive, not finite
            or not a normal float32; a scale given for a float16 / bfloat16 cache.
    """

    def __init__(self, k, v, *, dtype=None, k_scale=None, v_scale=None):
        self.k_source, self.v_source = k, v  # the caller's objects, kept alive
        want = None if dtype is None else _arrays.resolve_kv_dtype(dtype)
        _arrays.refuse_host(k, "k")
        _arrays.refuse_host(v, "v")
        _arrays.require_cuda()  # a plain sentence, not CuPy's, where CuPy or the device is missing
        k_fp8, v_fp8 = _arrays.fp8_bytes(k, "k"), _arrays.fp8_bytes(v, "v")
        k_dev = k_fp8 if k_fp8 is not None else _arrays.to_cupy(k, "k")
        v_dev = v_fp8 if v_fp8 is not None else _arrays.to_cupy(v, "v")
        if k_dev.ndim != 4:
            raise ValueError(f"k must be [num_pages, page_size, num_kv_heads, head_dim], "
                             f"got shape {tuple(k_dev.shape)}")
        if k_fp8 is not None or (k_dev.dtype == np.uint8 and want == _arrays.FP8):
            self.dtype_name = _arrays.FP8
        elif k_dev.dtype == np.uint8:
            raise TypeError("k is uint8: a uint8 array is read as an fp8 cache's e4m3fn bytes only with "
                            "dtype='float8_e4m3fn'")
        else:
            self.dtype_name = _arrays.resolve_dtype(k_dev.dtype, "k.dtype")
        if want is not None and want != self.dtype_name:
            raise TypeError(f"dtype={want!r} but k holds {self.dtype_name}")
        fp8 = self.dtype_name == _arrays.FP8
        if fp8 and v_fp8 is None and v_dev.dtype != np.uint8:
            raise TypeError(f"v must have dtype float8_e4m3fn like k, got {_arrays.dtype_name(v_dev.dtype)}")
        _arrays.check_device_array(k_dev, "k")
        # V may be narrower than K at a supported pair (separate qk / vo head dims, a 16-bit cache): its
        # last dim is then its own; any other V must have K's shape
        pair = not fp8 and v_dev.ndim == 4 and (int(k_dev.shape[3]), int(v_dev.shape[3])) in HEAD_DIM_PAIRS
        v_shape = tuple(k_dev.shape[:3]) + ((v_dev.shape[3],) if pair else (k_dev.shape[3],))
        _arrays.check_device_array(v_dev, "v", dtype=np.uint8 if fp8 else self.dtype_name, shape=v_shape,
                                   device_id=k_dev.device.id)
        multiple = 16 if fp8 else 8  # 16-byte chunks of the kernels' copies
        for name, dim in (("head_dim (k.shape[3])", k_dev.shape[3]), ("head_dim_v (v.shape[3])", v_dev.shape[3])):
            if dim % multiple:
                raise ValueError(f"{name} must be a multiple of {multiple} for a {self.dtype_name} cache, got {dim}")
        self.k, self.v = k_dev, v_dev
        self.device_id = int(k_dev.device.id)
        self.num_pages, self.page_size, self.num_kv_heads, self.head_dim = (int(s) for s in k_dev.shape)
        self.head_dim_v = int(v_dev.shape[3])  # V's head dim: head_dim, or V's own (separate qk / vo head dims)
        if self.page_size < 1 or self.num_pages < 1:
            raise ValueError(f"k must have at least one page of at least one token, got shape {tuple(k_dev.shape)}")
        if not fp8 and (k_scale is not None or v_scale is not None):
            raise ValueError(f"k_scale / v_scale are for an fp8 (float8_e4m3fn) cache; this one is {self.dtype_name}")
        self.k_scale = self.v_scale = self.k_scale_device = self.v_scale_device = None
        if fp8:
            self.k_scale = checked_scales(k_scale, "k_scale", self.num_kv_heads)
            self.v_scale = checked_scales(v_scale, "v_scale", self.num_kv_heads)
        import cupy

        self._device = cupy.cuda.Device(self.device_id)  # made current by append and status
        # the append kernel's packed launches (by kernel and K / V array), their per-call fields rewritten
        # under a lock (two threads appending to one cache do not share a half-written struct)
        self._append_launches, self._append_lock = {}, threading.Lock()
        with self._device:  # the append kernel's status word (status.cuh)
            self._status = all_ones_word()
            if fp8:
                self.k_scale_device = cupy.asarray(self.k_scale)
                self.v_scale_device = cupy.asarray(self.v_scale)

    @classmethod
    def allocate(cls, num_pages, page_size, num_kv_heads, head_dim, dtype="bfloat16", *, k_scale=None,
                 v_scale=None, device=None, head_dim_v=None):
        """A zero-filled cache ``[num_pages, page_size, num_kv_heads, head_dim]`` of ``dtype``
        ("bfloat16" / "float16" / "float8_e4m3fn", with its scales) on ``device`` (an int id, a
        ``cupy.cuda.Device``, a torch cuda device or ``"cuda:N"``; default CuPy's current device).
        ``head_dim_v``: V's head dim where it differs from K's (separate qk / vo head dims, e.g.
        192 / 128; a 16-bit cache only): V is then ``[num_pages, page_size, num_kv_heads, head_dim_v]``.

        Raises:
            ValueError: a dimension below 1 (or a head dim that is not a multiple of 8, of 16 for
                fp8); a ``head_dim_v`` other than ``head_dim`` for an fp8 cache; bad scales (see the
                class); a ``device`` that is no CUDA device here.
            TypeError: another dtype.
        """
        name = _arrays.resolve_kv_dtype(dtype)
        np_dtype = np.uint8 if name == _arrays.FP8 else _arrays.DTYPES[name]
        shape = (int(num_pages), int(page_size), int(num_kv_heads), int(head_dim))
        v_shape = shape[:3] + (int(head_dim if head_dim_v is None else head_dim_v),)
        if min(shape + v_shape) < 1:
            raise ValueError(f"cache dimensions must be positive, got {shape}"
                             + (f" (V: {v_shape})" if v_shape != shape else ""))
        multiple = 16 if name == _arrays.FP8 else 8
        for arg, dim in (("head_dim", shape[3]), ("head_dim_v", v_shape[3])):
            if dim % multiple:
                raise ValueError(f"{arg} must be a multiple of {multiple} for a {name} cache, got {dim}")
        if name == _arrays.FP8 and v_shape != shape:
            raise ValueError(f"head_dim_v={head_dim_v} with head_dim={head_dim}: an fp8 cache takes one head dim for "
                             f"K and V (head_dim_v=None)")
        if v_shape != shape and (shape[3], v_shape[3]) not in HEAD_DIM_PAIRS:
            raise ValueError(f"head_dim_v={head_dim_v} with head_dim={head_dim}: separate K / V head dims take the "
                             f"pairs {HEAD_DIM_PAIRS} (head_dim_v=None: V's is K's)")
        _arrays.require_cuda()
        import cupy

        with cupy.cuda.Device(_arrays.resolve_device(device)):
            return cls(cupy.zeros(shape, np_dtype), cupy.zeros(v_shape, np_dtype), dtype=name, k_scale=k_scale,
                       v_scale=v_scale)

    @property
    def dtype(self):
        """The element type as a NumPy dtype (ml_dtypes' float8_e4m3fn for fp8: ``cache.k.get().view(cache.dtype)``)."""
        return _arrays.KV_DTYPES[self.dtype_name]

    @property
    def is_fp8(self):
        return self.dtype_name == _arrays.FP8

    def attention_params(self):
        """The attention kernels' parameters this cache sets (AttentionParams, kernels/shared/params.cuh):
        K and V's addresses, the page size (and its log2 where a power of two, the kernels shift;
        else -1, they divide), the page count (the page-id bound) and an fp8 cache's scale arrays
        (0 for a 16-bit one). A captured step bakes exactly these in, so GraphRunner keys its
        graphs by them."""
        return dict(k_cache=self.k.data.ptr, v_cache=self.v.data.ptr, page_size=self.page_size,
                    page_shift=page_shift(self.page_size), num_pages=self.num_pages,
                    k_scale=self.k_scale_device.data.ptr if self.is_fp8 else 0,
                    v_scale=self.v_scale_device.data.ptr if self.is_fp8 else 0)

    _params_key = None

    def params_key(self):
        """:meth:`attention_params` as a tuple, made once (a cache's arrays and geometry are fixed
        when it is built): what GraphRunner keys its graphs by."""
        key = self._params_key
        if key is None:
            key = self._params_key = tuple(self.attention_params().items())
        return key

    @property
    def num_slots(self):
        return self.num_pages * self.page_size

    def append(self, k_new, v_new, slots):
        """Writes new K/V rows at their slots, on the caller's stream (torch's current stream
        for torch tensors, else CuPy's).

        Args:
            k_new, v_new: device arrays ``[T, num_kv_heads, head_dim]`` (v_new: ``head_dim_v``) of the cache dtype (an
                fp8 cache: float16 or bfloat16, both the same, quantised on the fly to
                ``e4m3(x / scale)`` of their KV head: round to nearest even, saturating at
                +-448, NaN kept as NaN), C-contiguous, 16-byte aligned.
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
        with self._device:  # the cache's device, whatever the caller has current
            self._append(k_new, v_new, slots)

    def _append(self, k_new, v_new, slots):
        stream, (k_view, v_view), host, dev = append_intake((k_new, v_new), ("k_new", "v_new"), slots, self.device_id)
        new_dtype = self.dtype_name
        if self.is_fp8:  # the new rows' own 16-bit type, quantised by the kernel
            try:
                new_dtype = _arrays.resolve_dtype(k_view.dtype, "k_new.dtype")
            except TypeError:
                raise TypeError(f"k_new must be float16 or bfloat16 to append to a float8_e4m3fn cache (quantised "
                                f"on the fly), got {_arrays.dtype_name(k_view.dtype)}") from None
        bound, dtype = "the device of this cache", _arrays.DTYPES[new_dtype]
        row = (k_view.shape[0] if k_view.ndim == 3 else None, self.num_kv_heads, self.head_dim)
        if not k_view.fits(dtype, row, self.device_id, 16):
            _arrays.check_device_array(k_view, "k_new", dtype=new_dtype, ndim=3, shape=row, device_id=self.device_id,
                                       bound=bound)
        v_row = tuple(k_view.shape[:2]) + (self.head_dim_v,)
        if not v_view.fits(dtype, v_row, self.device_id, 16):
            _arrays.check_device_array(v_view, "v_new", dtype=new_dtype, shape=v_row, device_id=self.device_id,
                                       bound=bound)
        num_tokens = int(k_view.shape[0])
        dev = staged_slots(host, dev, num_tokens, "k_new", self.num_slots, self.device_id, stream)
        if num_tokens == 0:
            return
        slots_ptr = dev.data.ptr
        if self.head_dim_v != self.head_dim:  # rows of two widths: the copy kernel once per array (K, then V)
            for new, cache, dim in ((k_view, self.k, self.head_dim), (v_view, self.v, self.head_dim_v)):
                self._launch_append(new.ptr, new.ptr, cache, cache, dim, dev.dtype, slots_ptr, num_tokens, new_dtype,
                                    stream)
            return
        self._launch_append(k_view.ptr, v_view.ptr, self.k, self.v, self.head_dim, dev.dtype, slots_ptr, num_tokens,
                            new_dtype, stream)

    def _launch_append(self, k_ptr, v_ptr, k_cache, v_cache, head_dim, slots_dtype, slots_ptr, num_tokens, new_dtype,
                       stream):
        """The append kernel: rows of ``head_dim`` from k_ptr / v_ptr into k_cache / v_cache at the
        slots at ``slots_ptr`` (with separate K / V widths, one array at a time: both pairs the same
        array), its struct packed once per (kernel, cache array) and its per-call fields rewritten."""
        kernel = catalog.append_kernel(slots_dtype, new_dtype if self.is_fp8 else None)
        key = (kernel, k_cache.data.ptr)
        with self._append_lock:
            launch = self._append_launches.get(key)
            if launch is None:
                packed = np.array([self.append_params(k_cache, v_cache, head_dim, k_new=0, v_new=0, slots=0,
                                                      num_tokens=0)], _APPEND)
                launch = self._append_launches[key] = _build.PackedLaunch(kernel, (1,), packed, self.device_id)
            _set_append(launch.raw, (k_ptr, v_ptr, slots_ptr, num_tokens))
            row_chunks = self.num_kv_heads * head_dim // 8
            launch.set_grid(min((num_tokens * row_chunks + kernel.threads - 1) // kernel.threads, 65535))
            _build.launch_packed(launch, stream.ptr)

    def append_params(self, k_cache, v_cache, head_dim, *, k_new, v_new, slots, num_tokens):
        """The ``AppendParams`` of one append launch (an ``np.void``), every field named: this cache's
        arrays (``k_cache`` / ``v_cache``: the pair the launch writes, rows of ``head_dim``), its
        status word and scales, and the call's rows, slots and token count (addresses)."""
        fp8 = self.is_fp8
        return _params.make(
            "AppendParams", k_new=k_new, v_new=v_new, k_cache=k_cache.data.ptr, v_cache=v_cache.data.ptr,
            slots=slots, num_slots=self.num_slots, num_tokens=num_tokens,
            row_chunks=self.num_kv_heads * head_dim // 8, status=self._status.data.ptr,
            k_scale=self.k_scale_device.data.ptr if fp8 else 0, v_scale=self.v_scale_device.data.ptr if fp8 else 0,
            head_chunks=head_dim // 8)

    def status(self):
        """The first device slot the appends since the last ``status()`` skipped because it lies
        past the cache (negative slots are padding, not errors), then clears it; syncs the
        device. A :class:`cupy_fa.status.Status` (``int``): 0 when none, else 1 + the token's
        index in its ``append`` call, ``str()`` e.g. ``token 2: its slot is outside the cache``."""
        return read_append_status(self._status, self._device)

    def __repr__(self):
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                + (f"head_dim_v={self.head_dim_v}, " if self.head_dim_v != self.head_dim else "")
                + f"dtype={self.dtype_name})")


# ---- what both paged caches (this one and cupy_fa.mla.PagedLatentCache) share -------------------


def page_shift(page_size):
    """log2 of a power-of-two page size (the kernels shift), else -1 (they divide)."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


def append_intake(rows, names, slots, device_id):
    """An append's arrays in one pass: ``(stream, views, host, dev)``: the caller's stream
    (cupy_fa._views.intake's rule), the new rows as views (no DLPack exchange for CuPy and torch),
    and its slots as ``_arrays.host_or_device_ints`` gives them (host NumPy int64, or a device array:
    a view of a CuPy array or a torch CUDA tensor, else exchanged by DLPack on that stream)."""
    kind = _views.kind_of(slots)
    on_device = kind == _views.CUPY or (kind == _views.TORCH and slots.is_cuda)
    arrays = tuple(rows) + ((slots,) if on_device else ())
    stream, views = _views.intake(arrays, tuple(names) + (("slots",) if on_device else ()), device_id,
                                  stream_from=len(arrays))
    if on_device:
        dev = views[-1]
        if dev.ndim != 1:
            raise ValueError(f"slots must have 1 dimension(s), got shape {tuple(dev.shape)}")
        if dev.dtype.kind not in "iu":
            raise TypeError(f"slots must hold integers, got dtype {dev.dtype}")
        return stream, views[:-1], None, dev
    with stream:  # a DLPack exchange on the caller's stream (a capture must see no foreign stream)
        host, dev = _arrays.host_or_device_ints(slots, "slots", 1)
    return stream, views, host, dev


def staged_slots(host, dev, num_tokens, rows_name, num_slots, device_id, stream):
    """An append's slots (``_arrays.host_or_device_ints``' pair: host NumPy or device CuPy), checked
    against its ``num_tokens`` new rows (of argument ``rows_name``) and a cache of ``num_slots``
    slots, as the device array the append kernel reads: host slots range-checked (ValueError
    naming the first outside the cache) and copied on ``stream`` as int64; device slots int32 or
    int64 on ``device_id`` (TypeError / ValueError), as they are."""
    if host is not None:
        if host.shape[0] != num_tokens:
            raise ValueError(f"slots has {host.shape[0]} entries, {rows_name} has {num_tokens} tokens")
        bad = np.flatnonzero((host < 0) | (host >= num_slots))
        if bad.size:
            raise ValueError(f"slots[{bad[0]}] = {host[bad[0]]} is outside the cache "
                             f"(0 <= slot < num_pages * page_size = {num_slots})")
        import cupy

        with stream:  # on the cache's device (append made it current)
            return cupy.asarray(host.astype(np.int64))
    if dev.shape[0] != num_tokens:
        raise ValueError(f"slots has {dev.shape[0]} entries, {rows_name} has {num_tokens} tokens")
    if dev.dtype not in (np.int32, np.int64):
        raise TypeError(f"slots must be int32 or int64, got {dev.dtype}")
    _arrays.check_device_array(dev, "slots", device_id=device_id, align=dev.dtype.itemsize,
                               bound="the device of this cache")
    return dev


def clear_status(word):
    """Sets an append status word (a device uint64) to all ones, nothing to report (status.cuh), by a
    memset on the current stream: CuPy's ``fill`` would compile a CuPy kernel on a machine's first use."""
    word.data.memset_async(0xFF, 8)
    return word


def all_ones_word():
    """A new append status word on the current device, cleared (:func:`clear_status`)."""
    import cupy

    return clear_status(cupy.empty(1, np.uint64))


def read_append_status(status, device):
    """A cache's append status word (``status``, on ``device``): the first token the appends since
    the last read skipped because its slot lies past the cache (a :class:`cupy_fa.status.Status`,
    0 when none), then cleared; syncs the device."""
    from . import status as _status

    with device:
        device.synchronize()
        found = _status.read(status, "token")
        clear_status(status)
        device.synchronize()
    return found


SMALLEST_SCALE = float(np.finfo(np.float32).tiny)  # the kernels flush float32 subnormals (-ftz)


def checked_scales(value, name, num_kv_heads):
    """An fp8 cache's scales as float32 ``[num_kv_heads]`` (NumPy): None -> 1.0; a Python float
    or a 0-d / 1-element array (host or device) -> one per tensor; a ``[num_kv_heads]`` array
    -> one per KV head. Raises ValueError naming ``name`` for another shape or a value that is
    not a positive, finite, normal float32; TypeError for a non-numeric value. No GPU needed
    for host values."""
    if value is None:
        return np.ones(num_kv_heads, np.float32)
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a float or a float32 array, got {value!r}")
    host = value
    if not _arrays.is_host(value) and hasattr(value, "__dlpack__"):
        host = _arrays.to_cupy(value, name).get()  # a device array: read once, here
    elif _arrays.is_torch(value):
        host = value.numpy()
    arr = np.asarray(host)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be a float or a float32 array, got dtype {arr.dtype}")
    if arr.size == 1 and arr.ndim <= 1:
        arr = np.full(num_kv_heads, arr.reshape(()), np.float64)
    elif arr.shape != (num_kv_heads,):
        raise ValueError(f"{name} must be one scale (a float, 0-d or 1-element array) or one per KV head "
                         f"(shape ({num_kv_heads},)), got shape {arr.shape} (per token-head scales are not "
                         f"supported)")
    with np.errstate(over="ignore", invalid="ignore"):
        scales = arr.astype(np.float32)
    bad = np.flatnonzero(~(np.isfinite(scales) & (scales >= SMALLEST_SCALE)) | ~np.isfinite(arr.astype(np.float64)))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] = {arr.reshape(-1)[bad[0]]!r}: scales must be positive, finite, normal "
                         f"float32 values (>= {SMALLEST_SCALE:.3g})")
    return scales
