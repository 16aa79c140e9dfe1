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
# An fp8 KV cache's element type (e4m3fn: no infinity, NaN = S.1111.111, largest finite 448).
FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn) if BFLOAT16 is not None else None
FP8 = "float8_e4m3fn"
KV_DTYPES = {**DTYPES, FP8: FLOAT8_E4M3FN}
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


def resolve_kv_dtype(dtype, name="dtype"):
    """A KV cache dtype: what :func:`resolve_dtype` accepts, or float8_e4m3fn ("float8_e4m3fn",
    "fp8_e4m3", ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn)."""
    text = str(dtype).replace("torch.", "")
    if text in (FP8, "fp8_e4m3", "fp8_e4m3fn", "e4m3") or _is_dtype(dtype, FLOAT8_E4M3FN):
        return FP8
    try:
        return resolve_dtype(dtype, name)
    except TypeError:
        raise TypeError(f"{name} must be float16, bfloat16 or float8_e4m3fn, got {dtype!r}") from None


def _is_dtype(dtype, want):
    try:
        return np.dtype(dtype) == want
    except TypeError:
        return False


def fp8_bytes(x, name):
    """An fp8 (e4m3fn) device array as a zero-copy CuPy uint8 view of its bytes: torch
    float8_e4m3fn tensors go through DLPack as uint8 (CuPy 14's DLPack has no fp8 codes), CuPy
    arrays of ml_dtypes' float8_e4m3fn are viewed as uint8. Returns None for anything else (the
    caller decides whether a uint8 array may be one)."""
    if is_torch(x) and str(x.dtype) == "torch.float8_e4m3fn":
        import torch

        return to_cupy(x.view(torch.uint8), name)
    if hasattr(x, "__dlpack__") or hasattr(x, "dtype"):
        dtype = getattr(x, "dtype", None)
        if dtype is not None and FLOAT8_E4M3FN is not None and _is_dtype(dtype, FLOAT8_E4M3FN):
            return to_cupy(x, name).view(np.uint8)
    return None


def is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def to_cupy(x, name):
    """Zero-copy CuPy view of a device array (CuPy, torch, JAX, any
    ``__dlpack__``); rejects host arrays with a message naming ``name``."""
    refuse_host(x, name)
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    device_type, _ = x.__dlpack_device__()
    if device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise ValueError(f"{name} must live on a CUDA device, got a DLPack device of type {device_type} (CPU?)")
    return cupy.from_dlpack(x)


def refuse_host(x, name):
    """TypeError naming ``name`` for a NumPy array or anything without ``__dlpack__`` (no CuPy needed)."""
    if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name} must be a CUDA device array (CuPy, torch or any DLPack producer), "
                        f"got {type(x).__name__}")


def to_caller(array, like):
    """`array` (CuPy) handed back in the framework of `like`, zero copy through DLPack:
    torch in, torch out; JAX in, JAX out; any other array-API array (one with
    ``__array_namespace__``) through its namespace's ``from_dlpack``; CuPy (or no `like`) as
    CuPy. Call it with the stream the result was written on current (the consumer waits on it)."""
    if like is None:
        return array
    module = type(like).__module__.split(".")[0]
    if module == "cupy":
        return array
    if module == "torch":
        import torch

        return torch.from_dlpack(array)
    if module in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.from_dlpack(array)
    namespace = getattr(like, "__array_namespace__", None)
    if namespace is not None:
        return namespace().from_dlpack(array)
    return array


_cuda_ready = False


def cuda_problem():
    """None when CuPy sees a usable CUDA device; else one plain sentence saying what is missing
    and what to install (no CuPy, no NVIDIA driver, a driver older than CuPy's CUDA, no device)."""
    try:
        import cupy
    except ImportError:
        return ("CuPy is not installed: install cupy_fa with the CUDA extra that matches the driver, "
                "pip install -e '.[cuda12]' (or '.[cuda13]') from a checkout")
    runtime = cupy.cuda.runtime
    try:
        built_for = runtime.runtimeGetVersion()
    except Exception:  # pragma: no cover - no runtime library at all
        built_for = 0
    try:
        driver = runtime.driverGetVersion()
    except Exception:
        driver = 0
    cuda = f"CUDA {built_for // 1000}.{built_for % 1000 // 10}" if built_for else "CUDA"
    if driver == 0:
        return (f"no NVIDIA driver was found (libcuda.so.1): cupy_fa's kernels need an NVIDIA GPU (sm_80 or newer) "
                f"with its driver; CuPy {cupy.__version__} here is built for {cuda}")
    if built_for and driver // 1000 < built_for // 1000:
        major = driver // 1000
        return (f"the NVIDIA driver supports CUDA {major}.{driver % 1000 // 10}, older than the {cuda} this CuPy "
                f"needs: update the driver, or install cupy_fa's [cuda{major}] extra instead"
                + (f" (CUPY_FA_CUDA={major} make ...)" if major in (12, 13) else ""))
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:
        return f"the CUDA runtime found no usable GPU ({exc})"
    if count == 0:
        return "the NVIDIA driver is installed but no CUDA device is visible (is CUDA_VISIBLE_DEVICES empty?)"
    return None


def require_cuda():
    """Raises RuntimeError with :func:`cuda_problem`'s sentence unless a CUDA device is usable
    (checked until it first is; afterwards free)."""
    global _cuda_ready
    if _cuda_ready:
        return
    problem = cuda_problem()
    if problem is not None:
        raise RuntimeError(f"cupy_fa cannot run here: {problem}")
    _cuda_ready = True


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


def caller_stream(*arrays, device_id=None):
    """The stream to launch on: torch's current stream when any input is a
    torch CUDA tensor, or when torch is in use and no input says otherwise (so
    host-planned steps and torch launches stay ordered, and we are captured
    inside ``torch.cuda.graph`` too); else CuPy's current stream. Without a torch
    input, the current stream of device ``device_id`` (default: CuPy's current
    device): the device an instance is bound to, never silently another one."""
    require_cuda()
    import cupy

    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()

    torch_device = None
    for x in arrays:
        if x is not None and is_torch(x) and x.device.type == "cuda":
            torch_device = x.device
            break
    if torch_device is None and not any(x is not None and not is_host(x) for x in arrays):
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch_device = torch.device("cuda", device_id)
    if torch_device is not None:
        torch = sys.modules["torch"]
        ts = torch.cuda.current_stream(torch_device)
        if hasattr(cupy.cuda.Stream, "from_external"):
            return cupy.cuda.Stream.from_external(ts)
        return cupy.cuda.ExternalStream(ts.cuda_stream, torch_device.index)  # CuPy < 14
    return cupy.cuda.get_current_stream(device_id)


def current_device_id():
    """CuPy's current CUDA device id, or None where there is no usable CUDA device (then
    :func:`require_cuda` says why at the first call that needs one)."""
    global _cuda_ready
    if not _cuda_ready:
        if cuda_problem() is not None:
            return None
        _cuda_ready = True
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def _device_count():
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


def resolve_device(device, name="device"):
    """The CUDA device id an object names: an int, a ``cupy.cuda.Device``, a ``torch.device`` of
    type cuda (``torch.device("cuda", 1)``) or a string ``"cuda:1"`` / ``"cuda"``; None, or a
    cuda device without an index: CuPy's current device. Raises ``ValueError`` naming ``name``
    for anything else or an id this process has no device of, RuntimeError (require_cuda)
    where there is no usable CUDA device."""
    text = device if isinstance(device, str) else None
    if text is None and device is not None and not isinstance(device, (int, np.integer)) \
            and getattr(device, "type", None) is not None:  # torch.device
        text = f"{device.type}:{device.index}" if device.index is not None else str(device.type)
    if text is not None:
        kind, _, index = text.partition(":")
        if kind != "cuda" or (index and not index.isdigit()):
            raise ValueError(f"{name} must be a CUDA device (an int id, a cupy.cuda.Device, 'cuda:N' or a torch "
                             f"cuda device), got {device!r}")
        device = int(index) if index else None
    elif device is not None and not isinstance(device, (int, np.integer)) and hasattr(device, "id"):
        device = device.id  # cupy.cuda.Device
    if device is None:
        require_cuda()
        return current_device_id()
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or device < 0:
        raise ValueError(f"{name} must be a CUDA device (an int id >= 0, a cupy.cuda.Device, 'cuda:N' or a torch "
                         f"cuda device), got {device!r}")
    require_cuda()
    count = _device_count()
    if device >= count:
        raise ValueError(f"{name} is {int(device)}, but this process sees {count} CUDA device(s) "
                         f"(ids 0 .. {count - 1}; CUDA_VISIBLE_DEVICES renumbers them)")
    return int(device)


def device_of(x):
    """The CUDA device id of a device array (CuPy, torch, any DLPack producer), None for host
    values; read from the object, nothing is exchanged."""
    if x is None or is_host(x):
        return None
    import cupy

    if isinstance(x, cupy.ndarray):
        return int(x.device.id)
    if is_torch(x):
        return int(x.device.index)
    if hasattr(x, "__dlpack_device__"):
        return int(x.__dlpack_device__()[1])
    return None


def check_device_array(x, name, *, dtype=None, ndim=None, shape=None, device_id=None, align=16, bound=None):
    """Validates a CuPy view: dtype, rank, shape (None entries are free),
    C-contiguity, device and base-pointer alignment (the kernels move 16-byte
    vectors; a misaligned view would fault and kill the CUDA context). Raises
    naming the argument."""
    if dtype is not None and x.dtype != DTYPES.get(dtype, dtype):
        raise TypeError(f"{name} must have dtype {dtype_name(DTYPES.get(dtype, dtype))}, got {dtype_name(x.dtype)}")
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
    if device_id is not None:
        check_device(x, name, device_id, bound)
    return x


def check_device(x, name, device_id, bound=None):
    """``x`` (a CuPy view) lives on CUDA device ``device_id``, else ``ValueError`` naming ``name``
    and what fixed that device (``bound``, e.g. "the device this BatchAttention is bound to")."""
    got = x.device.id
    if got != device_id:
        why = bound or "like the other inputs"
        raise ValueError(f"{name} is on device {got}, expected device {device_id} ({why})")
    return x


def _shape_text(shape):
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def host_or_device_ints(x, name, ndim, keep_dtype=False):
    """Integer metadata input: returns (numpy array, None) for host input
    (list, tuple, NumPy) or (None, cupy array) for a device array. A host array comes back as
    int64 (``keep_dtype``: a NumPy array of an integer type as it is, not copied)."""
    if isinstance(x, np.ndarray) and x.ndim == ndim and x.dtype.kind in "iu" and x.size:
        return (x if keep_dtype else x.astype(np.int64)), None
    if is_host(x) and not is_torch(x):
        try:
            arr = np.asarray(x)
        except ValueError:  # NumPy's "inhomogeneous shape": rows of different lengths
            lengths = sorted({len(row) for row in x if hasattr(row, "__len__")})
            raise ValueError(f"{name} must be a rectangular array of ints with {ndim} dimension(s), got rows of "
                             f"{' and '.join(map(str, lengths))} entries: pad every row to the same width "
                             f"(a page table's unread entries may be anything, e.g. -1)") from None
        if arr.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        return arr.astype(np.int64), None
    if is_torch(x) and x.device.type == "cpu":
        return host_or_device_ints(x.numpy(), name, ndim, keep_dtype)
    dev = to_cupy(x, name)
    if dev.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(dev.shape)}")
    if dev.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {dev.dtype}")
    return None, dev
