"""Arrays across the boundary: any DLPack producer in, zero copy, on the
caller's stream; results handed back in the caller's framework.

torch is never imported here unless the caller already passed a torch tensor.
"""

import sys

import numpy as np

try:  # bf16 as a NumPy dtype (CuPy >= 14 maps DLPack bf16 to it)
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency
    BFLOAT16 = None

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13


def dtype_name(dtype):
    """'float16' / 'bfloat16' for the attention dtypes, else the NumPy name."""
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == BFLOAT16 else dtype.name


def resolve_dtype(dtype, name="dtype"):
    """Accepts 'bfloat16', 'float16', NumPy/ml_dtypes dtypes or torch dtypes."""
    text = str(dtype).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    text = aliases.get(text, text)
    if text in DTYPES:
        return text
    try:
        text = dtype_name(dtype)
    except TypeError:
        pass
    if text not in DTYPES:
        raise TypeError(f"{name} must be float16 or bfloat16, got {dtype!r}")
    return text


def is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def to_cupy(x, name):
    """Zero-copy CuPy view of a device array (CuPy, torch, JAX, any
    ``__dlpack__``); rejects host arrays with a message naming ``name``."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name} must be a CUDA device array (CuPy, torch or any DLPack producer), "
                        f"got {type(x).__name__}")
    device_type, _ = x.__dlpack_device__()
    if device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise ValueError(f"{name} must live on a CUDA device, got a DLPack device of type {device_type} (CPU?)")
    return cupy.from_dlpack(x)


def to_caller(array, like):
    """`array` (CuPy) in the framework of `like`: torch in, torch out."""
    if like is not None and is_torch(like):
        import torch

        return torch.from_dlpack(array)
    return array


def is_host(x):
    """Lists, tuples, scalars, NumPy arrays and CPU torch tensors."""
    if isinstance(x, (list, tuple, np.ndarray)) or np.isscalar(x):
        return True
    return is_torch(x) and x.device.type == "cpu"


def host_to_numpy(x):
    """Host inputs (lists, NumPy, CPU torch) as NumPy; device arrays unchanged."""
    if not is_host(x):
        return x
    return np.asarray(x.numpy() if is_torch(x) else x)


def caller_stream(*arrays):
    """The stream to launch on: torch's current stream when any input is a
    torch CUDA tensor, or when torch is in use and no input says otherwise (so
    host-planned steps and torch launches stay ordered, and we are captured
    inside ``torch.cuda.graph`` too); else CuPy's current stream."""
    import cupy

    torch_device = None
    for x in arrays:
        if x is not None and is_torch(x) and x.device.type == "cuda":
            torch_device = x.device
            break
    if torch_device is None and not any(x is not None and not is_host(x) for x in arrays):
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch_device = torch.device("cuda", cupy.cuda.Device().id)
    if torch_device is not None:
        torch = sys.modules["torch"]
        ts = torch.cuda.current_stream(torch_device)
        if hasattr(cupy.cuda.Stream, "from_external"):
            return cupy.cuda.Stream.from_external(ts)
        return cupy.cuda.ExternalStream(ts.cuda_stream, torch_device.index)  # CuPy < 14
    return cupy.cuda.get_current_stream()


def check_device_array(x, name, *, dtype=None, ndim=None, shape=None, device_id=None, align=16):
    """Validates a CuPy view: dtype, rank, shape (None entries are free),
    C-contiguity, device and base-pointer alignment (the kernels move 16-byte
    vectors; a misaligned view would fault and kill the CUDA context). Raises
    naming the argument."""
    if dtype is not None and x.dtype != DTYPES.get(dtype, dtype):
        raise TypeError(f"{name} must have dtype {dtype}, got {dtype_name(x.dtype)}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, x.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {_shape_text(shape)} "
                                 f"(axis {axis} must be {want})")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {x.strides})")
    if align and x.size and x.data.ptr % align:
        raise ValueError(f"{name} must start on a {align}-byte boundary (got address {x.data.ptr:#x}: "
                         f"a view at an odd offset into a larger array?)")
    if device_id is not None and x.device.id != device_id:
        raise ValueError(f"{name} is on device {x.device.id}, expected device {device_id} like the other inputs")
    return x


def _shape_text(shape):
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def host_or_device_ints(x, name, ndim):
    """Integer metadata input: returns (numpy array, None) for host input
    (list, tuple, NumPy) or (None, cupy array) for a device array."""
    if is_host(x) and not is_torch(x):
        arr = np.asarray(x)
        if arr.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        return arr.astype(np.int64), None
    if is_torch(x) and x.device.type == "cpu":
        return host_or_device_ints(x.numpy(), name, ndim)
    dev = to_cupy(x, name)
    if dev.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(dev.shape)}")
    if dev.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {dev.dtype}")
    return None, dev
