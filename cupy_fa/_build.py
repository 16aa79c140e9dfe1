"""Compiles ``kernels/*.cu`` with NVRTC and launches them: the only module that
knows kernels exist as text.

* Every compiled kernel is a :class:`Variant`: a source file plus one name
  expression naming all its compile-time parameters
  (``cupy_fa::attention_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16,
  cupy_fa::TileTraits<128, 1, 4, 64, 2, false>>``).
* NVRTC compiles it to a cubin (no device needed: :func:`binary`), kept in cupy_fa's own disk
  cache (:mod:`cupy_fa._cache`: ``<key>.cubin`` under ``CUPY_FA_CACHE_DIR``, checked on every
  read, written atomically); the program text carries a hash of the whole ``kernels/`` tree, so an
  edited header never hits a stale entry. :func:`compile_many` fills the cache for many variants
  at once, one NVRTC process per core (``cupy_fa.warmup``, ``python -m cupy_fa warmup``).
* :func:`get_function` loads the cubin on a device the way ``cupy.RawModule`` loads the one it
  compiled (``cupy.cuda.function.Module().load(cubin)``, the kernel by its lowered name).
* Without a GPU, :func:`compile_cubin` drives NVRTC directly (no device needed)
  and reports registers and spills; CI compiles every variant that way.

What it compiles is decided elsewhere: the variant list and every tile choice live in
:mod:`cupy_fa.schedule`, the ``CUPY_FA_*`` knobs in :mod:`cupy_fa.knobs` (this module reads
``arch``, ``cache_dir``, ``pdl`` and ``trace`` from there).
"""

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import struct
import subprocess
import sys
import threading
import time

from . import _cache, _params
from .knobs import knobs

# ---- where the sources are ---------------------------------------------------

_PACKAGE_KERNELS = pathlib.Path(__file__).resolve().parent / "kernels"  # inside a wheel
_REPO_KERNELS = pathlib.Path(__file__).resolve().parent.parent / "kernels"  # a source checkout
KERNEL_DIR = _PACKAGE_KERNELS if _PACKAGE_KERNELS.is_dir() else _REPO_KERNELS


@functools.lru_cache(maxsize=None)
def source_hash():
    """Hash of every file under ``kernels/``: part of the compile options."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ---- variants ---------------------------------------------------------------------

CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
# K/V element types: Q's and O's, and an fp8 (e4m3fn) cache's bytes (kernels/common.cuh)
KV_CTYPES = {**CTYPES, "float8_e4m3fn": "cupy_fa::fp8_e4m3"}
TRACE_SHAPE = (1 << 15, 6)  # kernels/trace.cuh (kTraceCtas, kTraceStamps): trace_buffer's shape


@dataclasses.dataclass(frozen=True)
class Variant:
    source: str       # file under kernels/
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
    if knobs().trace:  # kernels/trace.cuh: the timeline stamps, diagnosis builds only
        options.append("-DCUPY_FA_TRACE")
    return tuple(options)


def program_text(variant):
    """What NVRTC compiles: the kernel file, the params layout asserts and the variant's
    checks of the host's mirrors of its traits."""
    checks = "".join(f'static_assert({c}, "host mirror: {c}");\n' for c in variant.checks)
    return f'#include "{variant.source}"\n' + _params.layout_asserts() + checks


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

# Keyed by (device id, variant): a module loaded on one device cannot launch on another, and
# each device's module is compiled for that device's arch, its shared-memory opt-in set there.
_functions = {}
_modules = {}  # the same keys: the module each function lives in (trace_buffer)
_lock = threading.Lock()


def get_function(variant, device_id=None):
    """The launchable kernel (:class:`_Kernel`, ``cupy.RawKernel``'s launch surface) of a variant
    on device ``device_id`` (default CuPy's current device), its module loaded on that device from
    the disk cache (compiled first if missing: :func:`binary`). Launch it with that device current:
    the module lives there, and the shared-memory opt-in is set there."""
    import cupy

    device_id = _device_id(device_id)
    key = (device_id, variant)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock, cupy.cuda.Device(device_id):  # compiled and loaded on that device, whatever is current
        fn = _functions.get(key)
        if fn is None:
            lowered, cubin = binary(variant, device_arch(device_id))
            module = _load_module(cubin)
            fn = module.get_function(lowered)
            # the opt-in for more than 48 KiB counts static and dynamic shared memory together: a
            # kernel at exactly 48 KiB dynamic (the fp8 prefill tile) with any static bytes needs
            # it too, so it is set for every kernel that takes dynamic shared memory
            if variant.smem_bytes > 0:
                fn.max_dynamic_shared_size_bytes = variant.smem_bytes
            _modules[key] = module
            _functions[key] = fn
    return fn


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


def compiled_variants(source=None, device_id=None):
    """The variants compiled so far on device ``device_id`` (default the current one; of one
    source file, e.g. ``"attention.cu"``, if given): what a diagnosis tool reads trace buffers of."""
    device = _device_id(device_id)
    return [v for (d, v) in list(_modules) if d == device and (source is None or v.source == source)]


def trace_buffer(variant):
    """The timeline stamps of ``variant`` on the current device (builds with the knob
    ``CUPY_FA_TRACE=1``, attention kernels only): a uint64 cupy array [kTraceCtas, kTraceStamps]
    (kernels/trace.cuh) of (start, first K/V tile, done, ns in epilogues, ns waiting at the loop
    top, SM id) per CTA, written by each launch (zero it in between to tell launches apart)."""
    import cupy

    module = _modules[(_device_id(), variant)]
    pointer = module.get_global("cupy_fa_trace")
    return cupy.ndarray(TRACE_SHAPE, cupy.uint64, pointer)


def launch(variant, grid, params, stream, programmatic=False):
    """Launches one variant with its params struct (one ``__grid_constant__`` parameter:
    kernels/params.cuh) on ``stream`` (a cupy Stream). On CuPy's current device: the callers
    (BatchAttention, GraphRunner, PagedKVCache, merge_states) make the device they are bound to
    current once per call, and ``stream`` must be a stream of that device.

    ``programmatic=True`` launches it as a programmatic dependent of the kernel
    before it in the stream (sm_90+; kernels/common.cuh wait_for_prior_grid): its
    CTAs may start while that kernel's last wave still runs. Only for kernels that
    wait before reading what their predecessor writes; elsewhere (older GPUs, no
    driver entry point, the knob ``CUPY_FA_PDL=0``) it is an ordinary launch."""
    fn = get_function(variant)
    if programmatic and _programmatic_launch_enabled():
        _launch_programmatic(fn, grid, variant.threads, variant.smem_bytes, stream.ptr, params)
        return
    with stream:
        fn(tuple(grid), (variant.threads,), (params,), shared_mem=variant.smem_bytes)


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


def _nvrtc_compile(text, expression, options, name="cupy_fa.cu"):
    """``(lowered name, cubin, log)`` of one program: NVRTC alone, no device. The cubin is
    ``getCUBIN``'s bytes as they are, the image ``cupy.RawModule`` hands the driver. (The program
    ``name`` and the compiling process's id end up in the names of internal-linkage symbols, so
    two processes' cubins of one program differ in those bytes only.)"""
    from cupy_backends.cuda.libs import nvrtc  # what cupy.cuda.nvrtc is, without importing cupy

    prog = nvrtc.createProgram(text, name, [], [])
    try:
        nvrtc.addNameExpression(prog, expression)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed on {expression}:\n{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getLoweredName(prog, expression), nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_cubin(variant, arch="sm_90a"):
    """Compiles one variant to a cubin with NVRTC alone, with the options
    ``cupy.RawModule`` uses, and returns
    ``(cubin_bytes, {"registers", "spill_stores", "spill_loads", "stack"})``."""
    options = compile_options(arch) + RAWMODULE_OPTIONS + ("--ptxas-options=-v",)
    lowered, cubin, log = _nvrtc_compile(program_text(variant), variant.expression, options)
    return whole_elf(cubin), _resources_of(log, lowered)


# ---- the disk cache: compile once, load everywhere (cupy_fa/_cache.py) ------------------


def build_options(arch):
    """The NVRTC options of a cached build: ours and the two ``cupy.RawModule`` adds (the target is
    ours: RawModule also appends the device's plain ``-arch=sm_90``, which NVRTC resolves to the
    sm_90a given first, the cubin byte for byte the same: tests/test_compile_cache_cpu.py)."""
    return compile_options(arch) + RAWMODULE_OPTIONS


@functools.lru_cache(maxsize=None)
def nvrtc_version():
    from cupy_backends.cuda.libs import nvrtc

    return tuple(nvrtc.getVersion())


def _task(variant, arch, directory, store=True):
    """What building one variant's entry needs, computed here (with the knobs in force) so a
    worker process computes nothing: plain data that goes through JSON."""
    text, options = program_text(variant), build_options(arch)
    return {"text": text, "expression": variant.expression, "options": list(options), "directory": str(directory),
            "key": _cache.key(text, variant.expression, options, arch, nvrtc_version()), "store": bool(store)}


def _build_entry(task):
    """Builds one entry (in this process or a worker): under the entry's lock, loads it if another
    process wrote it meanwhile, else compiles and stores it. Returns ``(status, lowered, cubin)``,
    status ``"loaded"``, ``"compiled"`` (and stored) or ``"memory"`` (compiled, not stored: the
    directory cannot be written)."""
    directory, key = task["directory"], task["key"]
    if not task["store"]:
        lowered, cubin, _ = _nvrtc_compile(task["text"], task["expression"], task["options"])
        return "memory", lowered, cubin
    with _cache.locked(directory, key):
        hit = _cache.load(directory, key)
        if hit is not None:
            return ("loaded",) + hit
        lowered, cubin, _ = _nvrtc_compile(task["text"], task["expression"], task["options"])
        try:
            _cache.store(directory, key, lowered, cubin)
        except _cache.CacheUnwritable:
            return "memory", lowered, cubin
        return "compiled", lowered, cubin


_in_memory = {}  # key -> (lowered, cubin): built in a process whose cache directory cannot be written
_unwritable = set()  # directories found unwritable in this process (warned once, then not tried again)


def binary(variant, arch):
    """``(lowered name, cubin)`` of ``variant`` for ``arch``: from the disk cache if a whole, intact
    entry is there, else compiled with NVRTC (no device needed) and stored. A cache directory that
    cannot be written: compiled in memory, one warning per process."""
    directory = _cache.cache_dir()
    task = _task(variant, arch, directory, store=directory not in _unwritable)
    key = task["key"]
    found = _in_memory.get(key) or _cache.load(directory, key)
    if found is not None:
        return found
    status, lowered, cubin = _build_entry(task)
    if status == "memory":
        _note_unwritable(directory)
        _in_memory[key] = (lowered, cubin)
    return lowered, cubin


def _note_unwritable(directory, reason=""):
    _unwritable.add(directory)
    _cache.warn_unwritable(directory, reason)


def default_jobs():
    """The cores this process may run on (its CPU affinity), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compile_many(variants, arch, jobs=None, progress=None):
    """Puts every variant's cubin for ``arch`` in the disk cache, compiling the missing ones in
    ``jobs`` worker processes at once (default: every core this process may use; NVRTC needs no
    device, and the workers never touch CUDA). ``progress``: ``True`` for a progress line on
    stderr, ``False`` for none, ``None`` for one when stderr is a terminal, or a callable
    ``progress(done, total, variant, status)``. Returns ``{"variants", "compiled", "cached",
    "seconds", "directory", "stored", "jobs"}``. A directory that cannot be written: the cubins
    are kept in this process's memory (one warning), so a ``get_function`` here still finds them."""
    variants = list(dict.fromkeys(variants))
    if not isinstance(arch, str) or not re.fullmatch(r"(sm|compute)_\d+[a-z]?", arch):
        raise ValueError(f"arch must be a target such as 'sm_90a' or 'sm_80', got {arch!r}")
    if jobs is None:
        jobs = default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int (worker processes), got {jobs!r}")
    if not all(isinstance(v, Variant) for v in variants):
        raise TypeError("variants must be cupy_fa._build.Variant objects (schedule.warmup_variants())")
    start = time.perf_counter()
    directory = _cache.cache_dir()
    store = directory not in _unwritable and _cache.writable(directory)
    if not store:
        _note_unwritable(directory)
    report = _progress_reporter(progress, len(variants), arch)
    counts = {"loaded": 0, "compiled": 0, "memory": 0}
    tasks, done = [], 0
    for variant in variants:
        task = _task(variant, arch, directory, store)
        if task["key"] in _in_memory or (store and _cache.load(directory, task["key"]) is not None):
            done += 1
            counts["loaded"] += 1
            report(done, variant, "loaded")
        else:
            tasks.append((variant, task))
    workers = min(jobs, len(tasks))

    def finished(variant, task, status, lowered, cubin):
        nonlocal done
        done += 1
        counts[status] += 1
        if status == "memory":
            _in_memory[task["key"]] = (lowered, cubin)
        report(done, variant, status)

    if workers <= 1:
        for variant, task in tasks:
            finished(variant, task, *_build_entry(task))
    else:
        _run_workers(tasks, workers, finished)
    report(None, None, None)
    return {"variants": len(variants), "compiled": counts["compiled"] + counts["memory"], "cached": counts["loaded"],
            "seconds": time.perf_counter() - start, "directory": directory, "stored": store, "jobs": max(workers, 1)}


# The workers: plain `python -c` processes running _worker_main (no multiprocessing: its spawn and
# forkserver start methods re-run the caller's __main__ module, which breaks a script that calls
# warmup() without an `if __name__ == "__main__"` guard, and fork copies a process that may hold a
# CUDA context and driver threads). One JSON task a line in, one JSON result a line out.
# The command puts this checkout first on the worker's path unless it is already there (an
# installed package), so the worker runs this very cupy_fa without site-packages shadowing the
# standard library.
_WORKER = "import sys; r = {root!r}; r in sys.path or sys.path.insert(0, r); from cupy_fa import _build; _build._worker_main()"
_REPLY = "cupy_fa-compile-result "  # marks the protocol's lines on the worker's stdout


def _worker_main():
    import base64
    import json

    for line in sys.stdin:
        task = json.loads(line)
        try:
            status, lowered, cubin = _build_entry(task)
            reply = {"status": status, "lowered": lowered,
                     "cubin": base64.b64encode(cubin).decode() if status == "memory" else None}
        except Exception as exc:  # noqa: BLE001 - the parent raises it, naming the variant
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(_REPLY + json.dumps(reply) + "\n")
        sys.stdout.flush()


def _run_workers(tasks, workers, finished):
    """Runs ``tasks`` ((variant, task) pairs) on ``workers`` processes, one thread of this process
    feeding each; ``finished(variant, task, status, lowered, cubin)`` is called under a lock as each
    one ends. The first failure is raised (naming the variant) once every worker has stopped."""
    import base64
    import json

    command = [sys.executable, "-c", _WORKER.format(root=str(pathlib.Path(__file__).resolve().parent.parent))]
    queue, lock, errors = list(reversed(tasks)), threading.Lock(), []

    def feed():
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    variant, task = queue.pop()
                proc.stdin.write(json.dumps(task) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                while line and not line.startswith(_REPLY):  # anything else a library printed
                    line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"a compile worker exited (code {proc.wait()}) while compiling "
                                       f"{variant.expression}")
                reply = json.loads(line[len(_REPLY):])
                if "error" in reply:
                    raise RuntimeError(f"compiling {variant.expression} failed: {reply['error']}")
                cubin = base64.b64decode(reply["cubin"]) if reply["cubin"] is not None else None
                with lock:
                    finished(variant, task, reply["status"], reply["lowered"], cubin)
        except BaseException as exc:  # noqa: BLE001 - collected, raised by the caller's thread
            with lock:
                errors.append(exc)
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.wait()

    threads = [threading.Thread(target=feed, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _progress_reporter(progress, total, arch):
    """``report(done, variant, status)`` for compile_many; ``report(None, ...)`` ends it."""
    if callable(progress):
        return lambda done, variant, status: None if done is None else progress(done, total, variant, status)
    stream = sys.stderr
    if progress is None:
        progress = bool(getattr(stream, "isatty", lambda: False)())
    if not progress:
        return lambda done, variant, status: None
    tty = bool(getattr(stream, "isatty", lambda: False)())
    start, state = time.perf_counter(), {"compiled": 0, "loaded": 0, "last": -1}

    def report(done, variant, status):
        if done is None:
            if state["last"] >= 0 and tty:
                stream.write("\n")
            stream.flush()
            return
        state["loaded" if status == "loaded" else "compiled"] += 1
        line = (f"cupy_fa: kernels for {arch}: {done}/{total} ({state['compiled']} compiled, {state['loaded']} from "
                f"the cache), {time.perf_counter() - start:.1f} s")
        if tty:
            stream.write("\r" + line)
        elif done == total or done * 10 // total > state["last"] * 10 // total:  # about every 10%
            stream.write(line + "\n")
        state["last"] = done
        stream.flush()

    return report


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
