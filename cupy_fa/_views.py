"""The hot path's intake: what a launch needs of a device array, read from the array itself, and
the caller's stream, both without a DLPack exchange per call.

``BatchAttention.run`` and ``GraphRunner.run`` need of q, out, lse and sinks only their address,
shape, dtype, device and whether they are C-contiguous; a :class:`View` holds those, read straight
from a CuPy array or a torch tensor (``data_ptr()``, ``shape``, ``dtype``, ``get_device()``,
``is_contiguous()``: no CuPy view, no DLPack capsule, no stream handshake), and from any other
DLPack producer (JAX, ...) through ``cupy.from_dlpack`` on the caller's stream as before. The
caller's stream is torch's current stream for torch tensors (its raw pointer,
``torch._C._cuda_getCurrentRawStream``), else CuPy's current one; a CuPy handle per (pointer,
device) is made once and kept (:func:`stream_handle`).

A View keeps its array (``obj``) alive for as long as the view lives, like the CuPy view of a
DLPack exchange did; the kernels are ordered on the caller's stream either way. torch is never
imported here unless the caller already passed a torch tensor.
"""

import math
import sys

import numpy as np

from . import _arrays

CUPY, TORCH, OTHER = 0, 1, 2


class View:
    """A device array as the launches see it. ``check_device_array`` reads it as it reads a CuPy
    array (``dtype``, ``ndim``, ``shape``, ``flags.c_contiguous``, ``size``, ``data.ptr``,
    ``strides``, ``device.id``)."""

    __slots__ = ("obj", "ptr", "shape", "dtype", "device_id", "contiguous", "kind")

    def __init__(self, obj, ptr, shape, dtype, device_id, contiguous, kind):
        self.obj, self.ptr, self.shape, self.dtype = obj, ptr, shape, dtype
        self.device_id, self.contiguous, self.kind = device_id, contiguous, kind

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def flags(self):
        return _Flags(self.contiguous)

    @property
    def data(self):
        return _Pointer(self.ptr)

    @property
    def device(self):
        return _Device(self.device_id)

    @property
    def strides(self):
        if self.kind == TORCH:
            return tuple(s * self.dtype.itemsize for s in self.obj.stride())
        return tuple(self.obj.strides) if hasattr(self.obj, "strides") else ()

    def fits(self, dtype, shape, device_id, align):
        """Every check ``check_device_array(self, dtype=dtype, shape=shape, device_id=device_id,
        align=align)`` makes, passed (``shape`` without free axes); the caller calls that for
        the message when this is False."""
        return (self.dtype == dtype and self.shape == shape and self.contiguous and self.device_id == device_id
                and not (align and self.ptr % align))


class _Flags:
    __slots__ = ("c_contiguous",)

    def __init__(self, c_contiguous):
        self.c_contiguous = c_contiguous


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class _Device:
    __slots__ = ("id",)

    def __init__(self, device_id):
        self.id = device_id


_TORCH_DTYPES = {}


def _torch_dtypes():
    torch = sys.modules["torch"]
    found = {torch.float16: np.dtype(np.float16), torch.bfloat16: _arrays.BFLOAT16,
             torch.float32: np.dtype(np.float32), torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
             torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8), torch.bool: np.dtype(np.bool_)}
    _TORCH_DTYPES.update(found)
    return _TORCH_DTYPES


def kind_of(x):
    """CUPY, TORCH or OTHER (any other object: a DLPack producer, or something refused later)."""
    kind = _KINDS.get(type(x))
    if kind is None:
        kind = _KINDS[type(x)] = _classify(type(x))
    return kind


_KINDS = {}


def _classify(cls):
    root = cls.__module__.split(".")[0]
    if root == "cupy":
        import cupy

        return CUPY if issubclass(cls, cupy.ndarray) else OTHER
    if root == "torch":
        torch = sys.modules.get("torch")
        return TORCH if torch is not None and issubclass(cls, torch.Tensor) else OTHER
    return OTHER


def view(x, name, stream=None):
    """The :class:`View` of device array ``x`` (CuPy, torch CUDA, any DLPack producer); host arrays
    and CPU tensors are refused as ``_arrays.to_cupy`` refuses them (naming ``name``). ``stream``:
    the stream a DLPack exchange runs on (producers other than CuPy and torch)."""
    kind = kind_of(x)
    if kind == TORCH and x.is_cuda:
        dtype = _TORCH_DTYPES.get(x.dtype) or _torch_dtypes().get(x.dtype)
        if dtype is not None:
            return View(x, x.data_ptr(), x.shape, dtype, x.get_device(), x.is_contiguous(), TORCH)
    elif kind == CUPY:
        data = x.data
        return View(x, data.ptr, x.shape, x.dtype, data.device_id, x.flags.c_contiguous, CUPY)
    # anything else, and torch tensors that are not CUDA ones or of another dtype: as before, through
    # DLPack (its messages for host arrays, CPU tensors and dtypes CuPy cannot take)
    if stream is not None:
        with stream:
            dev = _arrays.to_cupy(x, name)
    else:
        dev = _arrays.to_cupy(x, name)
    data = dev.data
    return View(dev, data.ptr, dev.shape, dev.dtype, data.device_id, dev.flags.c_contiguous, OTHER)


def intake(arrays, names, device_id, stream_from=3):
    """Views of ``arrays`` (None where an array is None) and the stream to launch on, in one pass:
    the stream is torch's current stream of the first torch CUDA tensor among the first
    ``stream_from`` arrays, else CuPy's current stream of ``device_id`` (:func:`caller_stream`'s
    rule); arrays of other DLPack producers are exchanged on that stream (:func:`view`)."""
    views, torch_device, rest = [None] * len(arrays), None, False
    for i, x in enumerate(arrays):
        if x is None:
            continue
        kind = kind_of(x)
        if kind == TORCH and x.is_cuda:
            dtype = _TORCH_DTYPES.get(x.dtype) or _torch_dtypes().get(x.dtype)
            device = x.get_device()
            if torch_device is None and i < stream_from:
                torch_device = device
            if dtype is not None:
                views[i] = View(x, x.data_ptr(), x.shape, dtype, device, x.is_contiguous(), TORCH)
                continue
        elif kind == CUPY:
            data = x.data
            views[i] = View(x, data.ptr, x.shape, x.dtype, data.device_id, x.flags.c_contiguous, CUPY)
            continue
        rest = True
    if torch_device is not None:
        stream = torch_stream(torch_device)
    else:
        import cupy

        stream = cupy.cuda.get_current_stream(device_id)
    if rest:  # other producers, CPU tensors and host arrays: view() exchanges them or says why not
        for i, x in enumerate(arrays):
            if x is not None and views[i] is None:
                views[i] = view(x, names[i], stream)
    return stream, views


# ---- the caller's stream ---------------------------------------------------------------------

_handles = {}
_MAX_HANDLES = 256  # distinct (stream, device) pairs kept; past it the table starts over


def stream_handle(ptr, device_id):
    """A ``cupy.cuda.ExternalStream`` of stream ``ptr`` on device ``device_id``, made once and kept
    (it holds the pointer only: a stream destroyed and another made at its address is the same
    handle, rightly)."""
    key = (ptr, device_id)
    handle = _handles.get(key)
    if handle is None:
        import cupy

        if len(_handles) >= _MAX_HANDLES:
            _handles.clear()
        handle = _handles[key] = cupy.cuda.ExternalStream(ptr, device_id)
    return handle


_raw_stream = None


def torch_stream(device_index):
    """torch's current stream of CUDA device ``device_index``, as a CuPy handle."""
    global _raw_stream
    if _raw_stream is None:
        torch = sys.modules["torch"]
        getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = getter if getter is not None else (
            lambda index: torch.cuda.current_stream(index).cuda_stream)
    return stream_handle(_raw_stream(device_index), device_index)


def caller_stream(xs, device_id):
    """The stream to launch on for arrays ``xs`` (Nones skipped): torch's current stream of the
    first torch CUDA tensor's device, else CuPy's current stream of ``device_id``; the rule of
    ``_arrays.caller_stream`` for calls with a device array among their inputs."""
    for x in xs:
        if x is not None and kind_of(x) == TORCH and x.is_cuda:
            return torch_stream(x.get_device())
    import cupy

    return cupy.cuda.get_current_stream(device_id)


def current_stream(device_id):
    """The stream of a call without device arrays (a host-planned step): torch's current stream of
    ``device_id`` when torch is in use (CUDA initialised), else CuPy's current one. Where there is
    no usable CUDA device: RuntimeError saying why (``_arrays.require_cuda``)."""
    _arrays.require_cuda()
    if device_id is None:
        device_id = _arrays.current_device_id()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch_stream(device_id)
    import cupy

    return cupy.cuda.get_current_stream(device_id)


# ---- what a call allocates -------------------------------------------------------------------


def allocate(like, shape, dtype, stream):
    """A new C-contiguous device array of ``shape`` and ``dtype`` (NumPy; float32, or ``like``'s) in
    the framework of ``like`` (a :class:`View` of q), as a View: torch's allocator for a torch q
    (on its current stream, the call's), CuPy's on ``stream`` for the rest."""
    if like.kind == TORCH:
        torch = sys.modules["torch"]
        made = torch.empty(shape, dtype=torch.float32 if dtype == np.float32 else like.obj.dtype,
                           device=like.obj.device)
        return view(made, "out")
    import cupy

    with stream:
        made = cupy.empty(shape, dtype)
    return View(made, made.data.ptr, made.shape, made.dtype, made.data.device_id, True, CUPY)


def result(made, like, stream):
    """An array a call allocated (:func:`allocate`) handed back in the framework of ``like`` (q):
    torch's and CuPy's as they are, any other through DLPack on ``stream``
    (``_arrays.to_caller``)."""
    if kind_of(like) != OTHER:
        return made.obj
    with stream:
        return _arrays.to_caller(made.obj, like)
