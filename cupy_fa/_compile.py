"""Turns ``kernels/`` into cubins with NVRTC, no device needed: the only module that knows kernels
exist as text.

* Every compiled kernel is a :class:`Kernel`: a source file plus one name expression naming all
  its compile-time parameters (``cupy_fa::attention_kernel<__nv_bfloat16, __nv_bfloat16,
  __nv_bfloat16, cupy_fa::TileTraits<128, 1, 4, 64, 2, false>>``); :func:`program_text` is what
  NVRTC compiles (the kernel file, the params layout asserts and the host mirrors' checks).
* :func:`binary` gives a kernel's cubin for an arch from cupy_fa's own disk cache
  (:mod:`cupy_fa._cache`: ``<key>.cubin`` under ``CUPY_FA_CACHE_DIR``, checked on every read,
  written atomically under a lock), compiling it first if it is missing; the program text carries
  a hash of the whole ``kernels/`` tree, so an edited header never hits a stale entry.
  :func:`compile_many` fills the cache for many kernels at once, one NVRTC process per core
  (``cupy_fa.warmup``, ``python -m cupy_fa warmup``).
* :func:`compile_cubin` compiles one kernel and reports its registers and spills (CI compiles
  every kernel that way: ``cupy_fa.compile_check``).

Loading a cubin on a device and launching it is :mod:`cupy_fa._build`'s; what to compile is
:mod:`cupy_fa.catalog`'s.
"""

import contextlib
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
    for path in sorted(KERNEL_DIR.rglob("*.cu*")):
        digest.update(path.relative_to(KERNEL_DIR).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ---- kernels ----------------------------------------------------------------------

CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
# K/V element types: Q's and O's, and an fp8 (e4m3fn) cache's bytes (kernels/shared/common.cuh)
KV_CTYPES = {**CTYPES, "float8_e4m3fn": "cupy_fa::fp8_e4m3"}
TRACE_SHAPE = (1 << 15, 9)  # kernels/shared/trace.cuh (kTraceCtas, kTraceStamps): trace_buffer's shape


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


# ---- compile without a device (CI, `python -m cupy_fa.compile_check`) ------------

_RESOURCE = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


# What cupy.RawModule adds to our options on its NVRTC path (cupy/cuda/compiler.py), so
# the CPU build below compiles the binary the GPU runs, registers and all. (The default
# device execution space is also what lets the kernels' generic lambdas compile.)
RAWMODULE_OPTIONS = ("--device-as-default-execution-space", "-ftz=true")


def _nvrtc_compile(text, expression, options, name="cupy_fa.cu"):
    """``(lowered name, image, log)`` of one program: NVRTC alone, no device. The image is NUL-ended
    PTX for a virtual target (``-arch=compute_NN``), else a cubin: 
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
        # a virtual target (compute_NN: a build forced for another arch than the device's) gives
        # PTX, which the driver compiles for the device at load; a real one (sm_NN) a cubin
        virtual = any(o.startswith("-arch=compute_") for o in options)
        image = nvrtc.getPTX(prog).rstrip(b"\0") + b"\0" if virtual else nvrtc.getCUBIN(prog)
        return nvrtc.getLoweredName(prog, expression), image, nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_cubin(kernel, arch="sm_90a"):
    """Compiles one kernel to a cubin with NVRTC alone, with the options
    ``cupy.RawModule`` uses, and returns
    ``(cubin_bytes, {"registers", "spill_stores", "spill_loads", "stack"})``."""
    options = compile_options(arch) + RAWMODULE_OPTIONS + ("--ptxas-options=-v",)
    lowered, cubin, log = _nvrtc_compile(program_text(kernel), kernel.expression, options)
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


def _task(kernel, arch, directory, store=True):
    """What building one kernel's entry needs, computed here (with the knobs in force) so a
    worker process computes nothing: plain data that goes through JSON."""
    text, options = program_text(kernel), build_options(arch)
    return {"text": text, "expression": kernel.expression, "options": list(options), "directory": str(directory),
            "key": _cache.key(text, kernel.expression, options, arch, nvrtc_version()), "store": bool(store)}


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


def binary(kernel, arch):
    """``(lowered name, cubin)`` of ``kernel`` for ``arch``: from the disk cache if a whole, intact
    entry is there, else compiled with NVRTC (no device needed) and stored. A cache directory that
    cannot be written: compiled in memory, one warning per process."""
    directory = _cache.cache_dir()
    task = _task(kernel, arch, directory, store=directory not in _unwritable)
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


def compile_many(kernels, arch, jobs=None, progress=None, processes=True):
    """Puts every kernel's cubin for ``arch`` in the disk cache, compiling the missing ones in
    ``jobs`` workers at once (default: every core this process may use; NVRTC needs no device, and
    the workers never touch CUDA): this process and ``jobs - 1`` worker processes, or with
    ``processes=False`` ``jobs`` threads of this process (NVRTC compiles separate programs in
    threads at once: no worker process to start, which a first call's few kernels would wait
    for). ``progress``: ``True`` for a progress line on
    stderr, ``False`` for none, ``None`` for one when stderr is a terminal, or a callable
    ``progress(done, total, kernel, status)``. Returns ``{"kernels", "compiled", "cached",
    "seconds", "directory", "stored", "jobs"}``. A directory that cannot be written: the cubins
    are kept in this process's memory (one warning), so a ``get_function`` here still finds them."""
    kernels = list(dict.fromkeys(kernels))
    if not isinstance(arch, str) or not re.fullmatch(r"(sm|compute)_\d+[a-z]?", arch):
        raise ValueError(f"arch must be a target such as 'sm_90a' or 'sm_80', got {arch!r}")
    if jobs is None:
        jobs = default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int (worker processes), got {jobs!r}")
    if not all(isinstance(v, Kernel) for v in kernels):
        raise TypeError("kernels must be cupy_fa._compile.Kernel objects (catalog.warmup_kernels())")
    start = time.perf_counter()
    directory = _cache.cache_dir()
    store = directory not in _unwritable and _cache.writable(directory)
    if not store:
        _note_unwritable(directory)
    report = _progress_reporter(progress, len(kernels), arch)
    counts = {"loaded": 0, "compiled": 0, "memory": 0}
    tasks, done = [], 0
    for kernel in kernels:
        task = _task(kernel, arch, directory, store)
        if task["key"] in _in_memory or (store and _cache.load(directory, task["key"]) is not None):
            done += 1
            counts["loaded"] += 1
            report(done, kernel, "loaded")
        else:
            tasks.append((kernel, task))
    workers = min(jobs, len(tasks))

    def finished(kernel, task, status, lowered, cubin):
        nonlocal done
        done += 1
        counts[status] += 1
        if status == "memory":
            _in_memory[task["key"]] = (lowered, cubin)
        report(done, kernel, status)

    if workers <= 1:
        for kernel, task in tasks:
            finished(kernel, task, *_build_entry(task))
    else:
        _run_workers(tasks, workers, finished, processes)
    report(None, None, None)
    return {"kernels": len(kernels), "compiled": counts["compiled"] + counts["memory"], "cached": counts["loaded"],
            "seconds": time.perf_counter() - start, "directory": directory, "stored": store, "jobs": max(workers, 1)}


# The workers: plain `python -c` processes running _worker_main (no multiprocessing: its spawn and
# forkserver start methods re-run the caller's __main__ module, which breaks a script that calls
# warmup() without an `if __name__ == "__main__"` guard, and fork copies a process that may hold a
# CUDA context and driver threads). One JSON task a line in, one JSON result a line out.
# The command puts this checkout first on the worker's path unless it is already there (an
# installed package), so the worker runs this very cupy_fa without site-packages shadowing the
# standard library.
_WORKER = "import sys; r = {root!r}; r in sys.path or sys.path.insert(0, r); from cupy_fa import _compile; _compile._worker_main()"
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
        except Exception as exc:  # noqa: BLE001 - the parent raises it, naming the kernel
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(_REPLY + json.dumps(reply) + "\n")
        sys.stdout.flush()


def _run_workers(tasks, workers, finished, processes=True):
    """Runs ``tasks`` ((kernel, task) pairs) on ``workers`` workers: this process (a thread
    compiling in it) and ``workers - 1`` processes, one thread of this process feeding each (or,
    ``processes=False``, ``workers`` threads compiling in this process);
    ``finished(kernel, task, status, lowered, cubin)`` is called under a lock as each one ends. The
    first failure is raised (naming the kernel) once every worker has stopped."""
    import base64
    import json

    command = [sys.executable, "-c", _WORKER.format(root=str(pathlib.Path(__file__).resolve().parent.parent))]
    queue, lock, errors = list(reversed(tasks)), threading.Lock(), []

    def work(build):  # take tasks until none is left (or one failed): ``build(kernel, task)`` each
        try:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    kernel, task = queue.pop()
                result = build(kernel, task)
                with lock:
                    finished(kernel, task, *result)
        except BaseException as exc:  # noqa: BLE001 - collected, raised by the caller's thread
            with lock:
                errors.append(exc)

    def local():  # one worker is this process (NVRTC releases the GIL): no process to start for it
        work(lambda kernel, task: _build_entry(task))

    def feed():
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def ask(kernel, task):  # the task to the worker process, its reply back
            proc.stdin.write(json.dumps(task) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            while line and not line.startswith(_REPLY):  # anything else a library printed
                line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a compile worker exited (code {proc.wait()}) while compiling "
                                   f"{kernel.expression}")
            reply = json.loads(line[len(_REPLY):])
            if "error" in reply:
                raise RuntimeError(f"compiling {kernel.expression} failed: {reply['error']}")
            cubin = base64.b64decode(reply["cubin"]) if reply["cubin"] is not None else None
            return reply["status"], reply["lowered"], cubin

        try:
            work(ask)
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.wait()

    # the feeding threads first (their processes take a moment to start), then this process's own worker
    threads = [threading.Thread(target=feed if processes else local, daemon=True) for _ in range(workers - 1)]
    threads.append(threading.Thread(target=local, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _progress_reporter(progress, total, arch):
    """``report(done, kernel, status)`` for compile_many; ``report(None, ...)`` ends it."""
    if callable(progress):
        return lambda done, kernel, status: None if done is None else progress(done, total, kernel, status)
    stream = sys.stderr
    if progress is None:
        progress = bool(getattr(stream, "isatty", lambda: False)())
    if not progress:
        return lambda done, kernel, status: None
    tty = bool(getattr(stream, "isatty", lambda: False)())
    start, state = time.perf_counter(), {"compiled": 0, "loaded": 0, "last": -1}

    def report(done, kernel, status):
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
