"""Loads compiled kernels on a device and launches them.

:func:`get_function` loads a kernel's cubin (:func:`cupy_fa._compile.binary`: from the disk cache,
compiled first if missing) on a device the way ``cupy.RawModule`` loads the one it compiled
(``cupy.cuda.function.Module().load(cubin)``, the kernel by its lowered name), once per device;
:func:`launch` launches it with its params struct on a stream, as a programmatic dependent launch
where asked (``cuLaunchKernelEx``). The device's target arch and limits are read here, once per
device. The ``CUPY_FA_*`` knobs it reads (``arch``, ``pdl``) are :mod:`cupy_fa.knobs`'.
"""

import ctypes
import functools
import re
import threading

from . import _compile
from .knobs import knobs

def device_arch(device):
    """The target a device (a ``cupy.cuda.Device`` or an int id) compiles for: the knob
    CUPY_FA_ARCH, else the device's own (``sm_90a`` on Hopper, where the kernels may use its
    architecture-specific features)."""
    override = knobs().arch
    if override:
        return override
    return _native_arch(device if isinstance(device, int) else device.id)


def loadable_arch(device_id):
    """The target a device's modules are built for: :func:`device_arch`, or where CUPY_FA_ARCH
    names another compute capability than the device's (an sm_80 build on a Hopper GPU) its
    virtual target, ``compute_80``: PTX, which the driver compiles for the device at load (a
    cubin runs only on its own compute capability)."""
    arch = device_arch(device_id)
    digits = re.match(r"(?:sm|compute)_(\d+)", arch).group(1)
    if digits != re.match(r"sm_(\d+)", _native_arch(device_id)).group(1):
        return f"compute_{digits}"
    return arch


def current_arch(device_id=None):
    """:func:`device_arch` of device ``device_id`` (default CuPy's current device), queried once
    per device."""
    override = knobs().arch
    return override if override else _native_arch(_device_id(device_id))


def _device_id(device_id=None):
    """``device_id``, or CuPy's current device's id (the runtime's, without a Device object)."""
    if device_id is not None:
        return device_id
    import cupy

    return cupy.cuda.runtime.getDevice()


@functools.lru_cache(maxsize=None)
def _native_arch(device_id):
    import cupy

    major, minor = divmod(int(cupy.cuda.Device(device_id).compute_capability), 10)
    if major < 8:
        raise RuntimeError(f"cupy_fa needs compute capability 8.0 or newer, device has {major}.{minor}")
    return f"sm_{major}{minor}a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


# ---- the device: its limits, read once per device --------------------------------


def device_attribute(name, device_id=None):
    """A CUDA device attribute of device ``device_id`` (default CuPy's current device), e.g.
    ``MultiProcessorCount``, ``MaxSharedMemoryPerBlockOptin``, queried once per device: plans
    read these every step."""
    return _device_attribute(_device_id(device_id), name)


@functools.lru_cache(maxsize=None)
def _device_attribute(device_id, name):
    import cupy

    return int(cupy.cuda.Device(device_id).attributes[name])


def device_smem_limit(device_id=None):
    """Dynamic shared memory one CTA may opt in to (227 KB on sm_90, 163 KB on sm_80) on device
    ``device_id`` (default CuPy's current device): tiles are chosen to fit it."""
    return device_attribute("MaxSharedMemoryPerBlockOptin", device_id)


# ---- compile on a device, memoised ----------------------------------------------

# Keyed by (device id, kernel): a module loaded on one device cannot launch on another, and
# each device's module is compiled for that device's arch, its shared-memory opt-in set there.
_functions = {}
_modules = {}  # the same keys: the module each function lives in (trace_buffer)
_lock = threading.Lock()


def get_function(kernel, device_id=None):
    """The launchable kernel (:class:`_Kernel`, ``cupy.RawKernel``'s launch surface) of a kernel
    on device ``device_id`` (default CuPy's current device), its module loaded on that device from
    the disk cache (compiled first if missing: :func:`cupy_fa._compile.binary`). Launch it with that device current:
    the module lives there, and the shared-memory opt-in is set there."""
    import cupy

    device_id = _device_id(device_id)
    key = (device_id, kernel)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock, cupy.cuda.Device(device_id):  # compiled and loaded on that device, whatever is current
        fn = _functions.get(key)
        if fn is None:
            lowered, cubin = _compile.binary(kernel, loadable_arch(device_id))
            module = _load_module(cubin)
            fn = module.get_function(lowered)
            # the opt-in for more than 48 KiB counts static and dynamic shared memory together: a
            # kernel at exactly 48 KiB dynamic (the fp8 prefill tile) with any static bytes needs
            # it too, so it is set for every kernel that takes dynamic shared memory
            if kernel.smem_bytes > 0:
                fn.max_dynamic_shared_size_bytes = kernel.smem_bytes
            _modules[key] = module
            _functions[key] = fn
    return fn


def load_all(kernels, device_id):
    """Every kernel of ``kernels`` loaded on device ``device_id``, those missing from the disk cache
    compiled at once first (``_compile.compile_many`` in threads of this process, one a kernel up
    to the cores: a first call waits for its slowest kernel, not for their sum nor for a worker
    process to start)."""
    missing = [k for k in dict.fromkeys(kernels) if (device_id, k) not in _functions]
    if len(missing) > 1:
        arch = loadable_arch(device_id)
        missing.sort(key=lambda k: k.source.startswith("shared/"))  # the attention kernels (the slowest) first
        _compile.compile_many(missing, arch, jobs=min(len(missing), _compile.default_jobs()), progress=False,
                              processes=False)
    for kernel in missing:
        get_function(kernel, device_id)


# ---- loading a cubin on the current device: what cupy.RawModule does with one ------------
#
# cupy.RawModule(code=..., name_expressions=...) (CuPy 14.2, cupy/cuda/compiler.py
# _compile_with_cache_cuda, cupy/_core/raw.pyx) compiles or reads its cache, then
# ``mod = cupy.cuda.function.Module(); mod.load(cubin)`` on the current device, and its RawKernel is
# ``mod.get_function(mangled name)`` (a cupy.cuda.function.Function) behind a Python surface. The
# two classes below are that surface, for the calls cupy_fa makes and nothing else: launch
# ``fn(grid, block, args, shared_mem=)`` (RawKernel.__call__ -> Function.__call__),
# ``fn.max_dynamic_shared_size_bytes = n`` (RawKernel's setter: driver.funcSetAttribute on
# ``fn.kernel.ptr``), ``fn.kernel.ptr`` (cuLaunchKernelEx), ``fn.name``, and the module's
# ``get_global`` (RawModule.get_global, for trace_buffer).

class _Kernel:
    """One kernel of a loaded module: ``cupy.RawKernel``'s launch surface over a
    ``cupy.cuda.function.Function``."""

    __slots__ = ("kernel", "name")

    def __init__(self, function, name):
        self.kernel = function  # RawKernel.kernel: the Function; .ptr is the CUfunction
        self.name = name        # the lowered name, as RawKernel.name after RawModule.get_function

    def __call__(self, grid, block, args, shared_mem=0):
        self.kernel(grid, block, args, shared_mem=shared_mem)  # on the current stream, as RawKernel

    @property
    def max_dynamic_shared_size_bytes(self):
        from cupy_backends.cuda.api import driver

        return driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.kernel.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        from cupy_backends.cuda.api import driver

        driver.funcSetAttribute(self.kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, value)


class _Module:
    """A cubin loaded on the current device, as ``cupy.RawModule`` loads the one it compiled."""

    __slots__ = ("module",)

    def __init__(self, cubin):
        from cupy.cuda import function

        self.module = function.Module()
        self.module.load(bytes(cubin))

    def get_function(self, lowered):
        return _Kernel(self.module.get_function(lowered), lowered)

    def get_global(self, name):
        """A pointer to a ``__device__`` global (RawModule.get_global)."""
        import cupy
        from cupy.cuda.memory import MemoryPointer, UnownedMemory

        pointer = self.module.get_global_var(name)
        return MemoryPointer(UnownedMemory(pointer, 0, self.module, cupy.cuda.runtime.getDevice()), 0)


def _load_module(cubin):
    """The one place a cubin becomes a CUDA module (on CuPy's current device)."""
    return _Module(cubin)


def compiled_kernels(source=None, device_id=None):
    """The kernels compiled so far on device ``device_id`` (default the current one; of one
    source file, e.g. ``"mma_sync/attention.cu"``, if given): what a diagnosis tool reads trace buffers of."""
    device = _device_id(device_id)
    return [v for (d, v) in list(_modules) if d == device and (source is None or v.source == source)]


def trace_buffer(kernel):
    """The timeline stamps of ``kernel`` on the current device (builds with the knob
    ``CUPY_FA_TRACE=1``: the mma.sync attention kernels and the sm90 prefill kernels): a uint64
    cupy array [kTraceCtas, kTraceStamps] (kernels/shared/trace.cuh) of (start, first K/V tile,
    done, ns in epilogues, ns waiting at the loop top, the sm90 producer's ns waiting for its copies,
    for free stages and filling them, SM id) per CTA, written by each launch (zero it in between to
    tell launches apart)."""
    import cupy

    module = _modules[(_device_id(), kernel)]
    pointer = module.get_global("cupy_fa_trace")
    return cupy.ndarray(_compile.TRACE_SHAPE, cupy.uint64, pointer)


class PackedLaunch:
    """One kernel's launch whose parameter struct lives in ``packed`` (a one-element NumPy record
    array of the struct's dtype, ``cupy_fa._params``), owned here and updated in place between
    launches (the driver copies the bytes at each launch): the kernel, its grid, the device it is
    bound to, and, resolved at the first launch, its function, block and shared memory, so a launch
    is one driver call (:func:`launch_packed`). ``programmatic``: a programmatic dependent launch
    where the arch, the driver and the knob allow it (:func:`launch`)."""

    __slots__ = ("kernel", "grid", "packed", "raw", "device_id", "programmatic", "_grid3", "_args", "_fn", "_config",
                 "_config_ptr", "_ex")

    def __init__(self, kernel, grid, packed, device_id, programmatic=False):
        self.kernel, self.packed, self.device_id, self.programmatic = kernel, packed, device_id, programmatic
        self.raw = packed.data.cast("B")  # its bytes, for _params.field_setter
        self.grid = tuple(grid)
        self._grid3 = self.grid + (1,) * (3 - len(self.grid))
        self._args = (ctypes.c_void_p * 1)(packed.ctypes.data)  # the one kernel parameter: the struct
        self._fn = None
        self._config = self._config_ptr = self._ex = None

    @property
    def args(self):
        return ctypes.addressof(self._args)

    def set_grid(self, ctas):
        """A one-dimensional grid of ``ctas`` for the next ordinary launches (a launch whose work
        varies per step: kernels/shared/stage.cu; a programmatic launch's grid is fixed)."""
        self._grid3 = (ctas, 1, 1)

    def resolve(self):
        """The kernel's CUfunction on its device (compiled or loaded on first use: get_function)."""
        fn = get_function(self.kernel, self.device_id)
        if self.programmatic and _programmatic_launch_supported(device_arch(self.device_id)):
            attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            attr.value[0] = 1  # programmaticStreamSerializationAllowed
            self._config = _LaunchConfig((ctypes.c_uint * 3)(*self._grid3),
                                         (ctypes.c_uint * 3)(self.kernel.threads, 1, 1), self.kernel.smem_bytes,
                                         None, ctypes.pointer(attr), 1)
            self._config._attr = attr  # kept alive with the config
            self._config_ptr = ctypes.pointer(self._config)  # (made once: each launch passes it as it is)
            self._ex = _driver()
        self._fn = fn.kernel.ptr
        return self._fn


def launch_packed(launch, stream_ptr):
    """Launches a :class:`PackedLaunch` on stream ``stream_ptr`` (a raw pointer of a stream of its
    device, the device current): ``cuLaunchKernel`` with its struct's current bytes, or
    ``cuLaunchKernelEx`` for a programmatic one while ``CUPY_FA_PDL`` allows."""
    fn = launch._fn or launch.resolve()
    if launch._config is not None and knobs().pdl:
        config = launch._config
        config.stream = stream_ptr
        status = launch._ex(launch._config_ptr, fn, launch._args, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status} for {launch.kernel.expression} (a "
                               "programmatic launch; CUPY_FA_PDL=0 launches it the ordinary way)")
        return
    grid = launch._grid3
    _launch_kernel()(fn, grid[0], grid[1], grid[2], launch.kernel.threads, 1, 1, launch.kernel.smem_bytes,
                        stream_ptr, ctypes.addressof(launch._args), 0)


@functools.lru_cache(maxsize=None)
def _launch_kernel():
    from cupy_backends.cuda.api import driver  # cuLaunchKernel, as CuPy's own launches call it

    return driver.launchKernel


def launch(kernel, grid, params, stream, programmatic=False):
    """Launches one kernel with its params struct (one ``__grid_constant__`` parameter:
    kernels/shared/params.cuh) on ``stream`` (a cupy Stream). On CuPy's current device: the callers
    (BatchAttention, GraphRunner, PagedKVCache, merge_states) make the device they are bound to
    current once per call, and ``stream`` must be a stream of that device.

    ``programmatic=True`` launches it as a programmatic dependent of the kernel
    before it in the stream (sm_90+; kernels/shared/common.cuh wait_for_prior_grid): its
    CTAs may start while that kernel's last wave still runs. Only for kernels that
    wait before reading what their predecessor writes; elsewhere (older GPUs, no
    driver entry point, the knob ``CUPY_FA_PDL=0``) it is an ordinary launch."""
    fn = get_function(kernel)
    if programmatic and _programmatic_launch_enabled():
        _launch_programmatic(fn, grid, kernel.threads, kernel.smem_bytes, stream.ptr, params)
        return
    with stream:
        fn(tuple(grid), (kernel.threads,), (params,), shared_mem=kernel.smem_bytes)


# ---- programmatic dependent launch through the driver (CuPy has no launch attributes) ----

_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):  # cuda.h CUlaunchAttribute: id, pad to 8, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # cuda.h CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def memset_d2d32(ptr, pitch, value, width, height, stream_ptr):
    """``height`` rows of ``width`` 32-bit words set to ``value`` (an int, e.g. -1), the rows
    ``pitch`` bytes apart from device address ``ptr``, on stream ``stream_ptr``
    (``cuMemsetD2D32Async``: a memset, no kernel)."""
    status = _memset_d2d32()(ptr, pitch, value & 0xFFFFFFFF, width, height, stream_ptr)
    if status != 0:
        raise RuntimeError(f"cuMemsetD2D32Async failed with CUresult {status}")


@functools.lru_cache(maxsize=None)
def _memset_d2d32():
    """libcuda's cuMemsetD2D32Async with its argument types set (once: a graph step's staging calls it)."""
    fn = _libcuda().cuMemsetD2D32Async
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
    return fn


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda's cuLaunchKernelEx (CUDA 12.0+ drivers), or None."""
    try:
        fn = _libcuda().cuLaunchKernelEx
    except AttributeError:  # no libcuda (None has no attribute), or a driver older than CUDA 12.0
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


def _programmatic_launch_enabled():
    """True where programmatic launches happen: kernels compiled for sm_90+ (the
    arch CUPY_FA_ARCH may override), a driver with cuLaunchKernelEx, and
    ``CUPY_FA_PDL`` not ``0``."""
    if not knobs().pdl:
        return False
    return _programmatic_launch_supported(current_arch())


@functools.lru_cache(maxsize=None)
def _programmatic_launch_supported(arch):
    """Kernels built for an older arch compile griddepcontrol out (common.cuh): a merge
    launched early would then read partials still being written, so they never are."""
    found = re.match(r"(?:sm|compute)_(\d+)", arch)
    return found is not None and int(found.group(1)) >= 90 and _driver() is not None


def _launch_programmatic(fn, grid, threads, smem_bytes, stream_ptr, params):
    grid = tuple(grid) + (1,) * (3 - len(grid))
    attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(threads, 1, 1), smem_bytes,
                           stream_ptr, ctypes.pointer(attr), 1)
    raw = ctypes.create_string_buffer(params.tobytes())  # the driver copies it at launch
    args = (ctypes.c_void_p * 1)(ctypes.cast(raw, ctypes.c_void_p))
    status = _driver()(ctypes.byref(config), fn.kernel.ptr, args, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status} for {fn.name} (a programmatic launch; "
                           "CUPY_FA_PDL=0 launches it the ordinary way)")
