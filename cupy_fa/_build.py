"""Compiles ``kernels/*.cu`` with NVRTC and launches them: the only module that
knows kernels exist as text.

* Every compiled kernel is a :class:`Kernel`: a source file plus one name
  expression naming all its compile-time parameters
  (``cupy_fa::attention_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16,
  cupy_fa::TileTraits<128, 1, 4, 64, 2, false>>``).
* ``cupy.RawModule`` compiles it on first use, once per device, and CuPy's disk
  cache keeps it; the options carry a hash of the whole ``kernels/`` tree, so an
  edited header never hits a stale cache entry.
* Without a GPU, :func:`compile_cubin` drives NVRTC directly (no device needed)
  and reports registers and spills; CI compiles every kernel that way.

What it compiles is decided elsewhere: the kernel list is :mod:`cupy_fa.catalog`'s, every tile
choice :mod:`cupy_fa.schedule`'s, the ``CUPY_FA_*`` knobs in :mod:`cupy_fa.knobs` (this module reads
``arch``, ``cache_dir``, ``pdl`` and ``trace`` from there).
"""

import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import struct
import threading

from . import _params
from .knobs import knobs

# ---- where the sources are ---------------------------------------------------

_PACKAGE_KERNELS = pathlib.Path(__file__).resolve().parent / "kernels"  # inside a wheel
_REPO_KERNELS = pathlib.Path(__file__).resolve().parent.parent / "kernels"  # a source checkout
KERNEL_DIR = _PACKAGE_KERNELS if _PACKAGE_KERNELS.is_dir() else _REPO_KERNELS


@functools.lru_cache(maxsize=None)
def source_hash():
    """Hash of every file under ``kernels/``: part of the compile options."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.rglob("*.cu*")):
        digest.update(path.relative_to(KERNEL_DIR).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ---- kernels ----------------------------------------------------------------------

CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
# K/V element types: Q's and O's, and an fp8 (e4m3fn) cache's bytes (kernels/shared/common.cuh)
KV_CTYPES = {**CTYPES, "float8_e4m3fn": "cupy_fa::fp8_e4m3"}
TRACE_SHAPE = (1 << 15, 6)  # kernels/shared/trace.cuh (kTraceCtas, kTraceStamps): trace_buffer's shape


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One compiled kernel: a source file and one name expression naming every compile-time
    parameter, the launch's threads and dynamic shared memory, and the host mirrors of its traits
    that the compile checks (``cupy_fa.catalog`` lists them)."""
    source: str       # file under kernels/ (e.g. "mma_sync/attention.cu")
    expression: str   # name expression (template instance) or extern "C" name
    threads: int
    smem_bytes: int = 0  # dynamic shared memory per CTA
    checks: tuple = ()   # C++ constant expressions that must hold (host mirrors of the kernel's traits)


# ---- compile options -----------------------------------------------------------


@functools.lru_cache(maxsize=None)
def include_dirs():
    """CUDA headers the way a user's install finds them: the nvidia-cuda-runtime
    wheel through cuda.pathfinder, else a toolkit under CUDA_PATH."""
    dirs = [str(KERNEL_DIR)]
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            dirs.append(str(found))
    except Exception:  # pathfinder missing or nothing found: fall back below
        pass
    if len(dirs) == 1:
        for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
                dirs.append(os.path.join(root, "include"))
                break
    try:  # CuPy ships the CCCL headers (<nv/target>) that cuda_fp16.h includes
        import cupy

        cccl = pathlib.Path(cupy.__file__).parent / "_core" / "include" / "cupy" / "_cccl"
        dirs += [str(p) for p in (cccl / "libcudacxx", cccl / "cub", cccl / "thrust") if p.is_dir()]
    except ImportError:
        pass
    return tuple(dirs)


def compile_options(arch):
    options = ["-std=c++17", f"-DCUPY_FA_SOURCE_HASH={source_hash()}"]
    options += [f"-I{d}" for d in include_dirs()]
    options.append(f"-arch={arch}")
    if arch.endswith("90a"):
        options.append("-DCUPY_FA_REQUIRE_SM90A")
    if knobs().trace:  # kernels/shared/trace.cuh: the timeline stamps, diagnosis builds only
        options.append("-DCUPY_FA_TRACE")
    return tuple(options)


def program_text(kernel):
    """What NVRTC compiles: the kernel file, the params layout asserts and the kernel's
    checks of the host's mirrors of its traits."""
    checks = "".join(f'static_assert({c}, "host mirror: {c}");\n' for c in kernel.checks)
    return f'#include "{kernel.source}"\n' + _params.layout_asserts() + checks


def device_arch(device):
    """The target a device (a ``cupy.cuda.Device`` or an int id) compiles for: the knob
    CUPY_FA_ARCH, else the device's own (``sm_90a`` on Hopper, where the kernels may use its
    architecture-specific features)."""
    override = knobs().arch
    if override:
        return override
    return _native_arch(device if isinstance(device, int) else device.id)


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
    """The launchable ``cupy.RawKernel`` of a kernel on device ``device_id`` (default CuPy's
    current device). Launch it with that device current: CuPy's RawKernel loads its module for
    whichever device is current at the call, and the shared-memory opt-in is set on this one."""
    import cupy

    device_id = _device_id(device_id)
    key = (device_id, kernel)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock, cupy.cuda.Device(device_id):  # compiled and loaded on that device, whatever is current
        fn = _functions.get(key)
        if fn is None:
            if knobs().cache_dir:
                os.environ.setdefault("CUPY_CACHE_DIR", knobs().cache_dir)
            module = cupy.RawModule(
                code=program_text(kernel),
                options=compile_options(device_arch(device_id)),
                name_expressions=[kernel.expression],
            )
            fn = module.get_function(kernel.expression)
            # the opt-in for more than 48 KiB counts static and dynamic shared memory together: a
            # kernel at exactly 48 KiB dynamic (the fp8 prefill tile) with any static bytes needs
            # it too, so it is set for every kernel that takes dynamic shared memory
            if kernel.smem_bytes > 0:
                fn.max_dynamic_shared_size_bytes = kernel.smem_bytes
            _modules[key] = module
            _functions[key] = fn
    return fn


def compiled_kernels(source=None, device_id=None):
    """The kernels compiled so far on device ``device_id`` (default the current one; of one
    source file, e.g. ``"mma_sync/attention.cu"``, if given): what a diagnosis tool reads trace buffers of."""
    device = _device_id(device_id)
    return [v for (d, v) in list(_modules) if d == device and (source is None or v.source == source)]


def trace_buffer(kernel):
    """The timeline stamps of ``kernel`` on the current device (builds with the knob
    ``CUPY_FA_TRACE=1``, attention kernels only): a uint64 cupy array [kTraceCtas, kTraceStamps]
    (kernels/shared/trace.cuh) of (start, first K/V tile, done, ns in epilogues, ns waiting at the loop
    top, SM id) per CTA, written by each launch (zero it in between to tell launches apart)."""
    import cupy

    module = _modules[(_device_id(), kernel)]
    pointer = module.get_global("cupy_fa_trace")
    return cupy.ndarray(TRACE_SHAPE, cupy.uint64, pointer)


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
def _driver():
    """libcuda's cuLaunchKernelEx (CUDA 12.0+ drivers), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
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


# ---- compile without a device (CI, `python -m cupy_fa.compile_check`) ------------

_RESOURCE = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


# What cupy.RawModule adds to our options on its NVRTC path (cupy/cuda/compiler.py), so
# the CPU build below compiles the binary the GPU runs, registers and all. (The default
# device execution space is also what lets the kernels' generic lambdas compile.)
RAWMODULE_OPTIONS = ("--device-as-default-execution-space", "-ftz=true")


def compile_cubin(kernel, arch="sm_90a"):
    """Compiles one kernel to a cubin with NVRTC alone, with the options
    ``cupy.RawModule`` uses, and returns
    ``(cubin_bytes, {"registers", "spill_stores", "spill_loads", "stack"})``."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(program_text(kernel), "cupy_fa.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, kernel.expression)
        options = compile_options(arch) + RAWMODULE_OPTIONS + ("--ptxas-options=-v",)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed on {kernel.expression}:\n{nvrtc.getProgramLog(prog)}") from exc
        lowered = nvrtc.getLoweredName(prog, kernel.expression)
        log = nvrtc.getProgramLog(prog)
        cubin = whole_elf(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    return cubin, _resources_of(log, lowered)


def whole_elf(image):
    """An ELF image padded with zeros to the end its own headers give. CuPy's ``nvrtc.getCUBIN``
    strips a trailing NUL byte, as for PTX text, so the cubin it returns is one byte short of its
    program-header table, and cuobjdump / nvdisasm refuse it ("does not contain device code")."""
    if len(image) < 64 or image[:4] != b"\x7fELF" or image[4] != 2:  # not a 64-bit ELF: as it is
        return image
    phoff, shoff = struct.unpack_from("<QQ", image, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 54)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return image + bytes(max(0, end - len(image)))


def _resources_of(log, lowered):
    """Registers / spills of function `lowered` from a ptxas -v log."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if "Compiling entry function" in line and lowered in line:
            block = "\n".join(lines[i:i + 6])
            regs = _RESOURCE.search(block)
            spill = _SPILL.search(block)
            stack = _STACK.search(block)
            return {
                "registers": int(regs.group(1)) if regs else None,
                "spill_stores": int(spill.group(1)) if spill else None,
                "spill_loads": int(spill.group(2)) if spill else None,
                "stack": int(stack.group(1)) if stack else None,
            }
    return {"registers": None, "spill_stores": None, "spill_loads": None, "stack": None}
