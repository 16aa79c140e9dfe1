"""The compile cache without a GPU (cupy_fa/_cache.py, cupy_fa._compile.binary / compile_many): the
entry format and its checks, a truncated or corrupt entry rebuilt and never returned, an
unwritable directory falling back to memory with one warning, processes compiling the same
variant into one empty directory at once, the bytes equal to what cupy.RawModule's NVRTC path
compiles, and those bytes handed unchanged to the loader (a fake cupy.cuda.function.Module: the
one step that needs a device). Real NVRTC, small programs only (the plan kernel, merge_states)."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from cupy_fa import _build, _cache, knobs

from cupy_fa import _compile
from cupy_fa import catalog

SMALL = catalog.merge_states_kernel("float16")
SMALL_BF16 = catalog.merge_states_kernel("bfloat16")
PLAN = catalog.PLAN_KERNEL
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory in force (CUPY_FA_CACHE_DIR), this process's memory of unwritable
    directories and in-memory builds cleared, and a count of NVRTC compiles."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("CUPY_FA_CACHE_DIR", str(directory))
    knobs.reload()
    monkeypatch.setattr(_compile, "_in_memory", {})
    monkeypatch.setattr(_compile, "_unwritable", set())
    monkeypatch.setattr(_cache, "_warned", set())
    compiles = []
    real = _compile._nvrtc_compile

    def counting(text, expression, options, name="cupy_fa.cu"):
        compiles.append(expression)
        return real(text, expression, options, name)

    monkeypatch.setattr(_compile, "_nvrtc_compile", counting)
    yield directory, compiles
    monkeypatch.delenv("CUPY_FA_CACHE_DIR")
    knobs.reload()


def entries(directory):
    return sorted(p for p in os.listdir(directory) if p.endswith(".cubin"))


def key_of(variant, arch="sm_90a"):
    return _compile._task(variant, arch, _cache.cache_dir())["key"]


# ---- the entry format --------------------------------------------------------------------


def test_entry_round_trip_and_every_damage_is_refused():
    cubin = b"\x7fELF" + bytes(range(256)) * 4
    data = _cache.encode("k" * 64, "_Z3foov", cubin)
    assert _cache.decode(data, "k" * 64) == ("_Z3foov", cubin)
    assert _cache.decode(data, "j" * 64) is None  # another key's entry
    for cut in (0, 4, len(_cache.MAGIC) + 2, len(_cache.MAGIC) + 10, len(data) - len(cubin), len(data) - 1):
        assert _cache.decode(data[:cut], "k" * 64) is None, cut  # truncated anywhere
    assert _cache.decode(data + b"\0", "k" * 64) is None  # a byte too many
    for at in (0, len(_cache.MAGIC) + 1, len(_cache.MAGIC) + 20, len(data) - 100, len(data) - 1):
        damaged = bytearray(data)
        damaged[at] ^= 0x40
        assert _cache.decode(bytes(damaged), "k" * 64) is None, at  # one bit flipped anywhere
    assert _cache.decode(cubin, "k" * 64) is None  # a bare cubin is not an entry
    with pytest.raises(ValueError, match="cubin"):
        _cache.encode("k" * 64, "_Z3foov", b"")


def test_key_covers_text_expression_options_arch_and_nvrtc():
    base = dict(text="t", expression="e", options=("-a",), arch="sm_90a", nvrtc_version=(12, 9))
    first = _cache.key(**base)
    assert len(first) == 64 and first == _cache.key(**base)
    for field, other in (("text", "t2"), ("expression", "e2"), ("options", ("-b",)), ("arch", "sm_80"),
                         ("nvrtc_version", (12, 8))):
        assert _cache.key(**dict(base, **{field: other})) != first, field
    with pytest.raises(ValueError, match="arch"):
        _cache.key(**dict(base, arch=""))
    # the program text carries the kernels/ hash, the options the knobs that change the build
    assert f"-DCUPY_FA_SOURCE_HASH={_compile.source_hash()}" in _compile.build_options("sm_90a")
    assert key_of(SMALL, "sm_90a") != key_of(SMALL, "sm_80")


def test_cache_dir_is_the_knob_else_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CUPY_FA_CACHE_DIR", raising=False)
    knobs.reload()
    assert _cache.cache_dir() == str(tmp_path / "xdg" / "cupy_fa")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _cache.default_dir() == os.path.join(os.path.expanduser("~"), ".cache", "cupy_fa")
    monkeypatch.setenv("CUPY_FA_CACHE_DIR", str(tmp_path / "mine"))
    knobs.reload()
    assert _cache.cache_dir() == str(tmp_path / "mine")
    monkeypatch.delenv("CUPY_FA_CACHE_DIR")
    knobs.reload()


# ---- build, reuse, rebuild -------------------------------------------------------------------


def test_entry_written_once_then_loaded(cache):
    directory, compiles = cache
    lowered, cubin = _compile.binary(SMALL, "sm_90a")
    assert lowered.startswith("_ZN7cupy_fa19merge_states_kernel") and cubin[:4] == b"\x7fELF"
    assert compiles == [SMALL.expression]
    (name,) = entries(directory)
    assert name == key_of(SMALL) + ".cubin"
    assert not [p for p in os.listdir(directory) if p.endswith(".tmp")]  # no temporary file left
    assert _compile.binary(SMALL, "sm_90a") == (lowered, cubin)
    assert compiles == [SMALL.expression]  # the second call read the entry


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "empty", "foreign"])
def test_damaged_entry_is_rebuilt_not_loaded(cache, damage):
    directory, compiles = cache
    lowered, cubin = _compile.binary(SMALL, "sm_90a")
    path = directory / (key_of(SMALL) + ".cubin")
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) - len(cubin) // 2])
    elif damage == "corrupt":
        broken = bytearray(data)
        broken[len(data) - len(cubin) // 2] ^= 0xFF  # one byte inside the cubin
        path.write_bytes(bytes(broken))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # another variant's whole entry under this key's name
        _compile.binary(PLAN, "sm_90a")
        path.write_bytes((directory / (key_of(PLAN) + ".cubin")).read_bytes())
        compiles.remove(PLAN.expression)
    assert _cache.load(str(directory), key_of(SMALL)) is None
    again_lowered, again = _compile.binary(SMALL, "sm_90a")
    assert compiles == [SMALL.expression, SMALL.expression]  # compiled again
    assert again_lowered == lowered and len(again) == len(cubin) and again[:4] == b"\x7fELF"
    assert _cache.load(str(directory), key_of(SMALL)) == (again_lowered, again)  # and the entry is whole again


# ---- an unwritable directory --------------------------------------------------------------------


def _make_unwritable(directory, how, monkeypatch):
    if how == "under_a_file":  # cannot even be created
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.parent.joinpath("file").write_text("x")
        return directory.parent / "file" / "cache"
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        directory.chmod(0o555)
    else:  # root writes through mode bits: mkstemp fails the way it does in a 0555 directory
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(directory))

        monkeypatch.setattr(_cache.tempfile, "mkstemp", refuse)
    return directory


@pytest.mark.parametrize("how", ["under_a_file", "read_only"])
def test_unwritable_directory_one_warning_still_works(cache, how, monkeypatch):
    directory, compiles = cache
    target = _make_unwritable(directory, how, monkeypatch)
    monkeypatch.setenv("CUPY_FA_CACHE_DIR", str(target))
    knobs.reload()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lowered, cubin = _compile.binary(SMALL, "sm_90a")
            assert _compile.binary(SMALL, "sm_90a") == (lowered, cubin)  # kept in memory: not compiled again
            _compile.binary(PLAN, "sm_90a")
            summary = _compile.compile_many([SMALL, SMALL_BF16], "sm_90a", jobs=1, progress=False)
        ours = [w for w in caught if "cupy_fa" in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        assert str(target) in str(ours[0].message) and ours[0].category is RuntimeWarning
        assert cubin[:4] == b"\x7fELF" and compiles == [SMALL.expression, PLAN.expression, SMALL_BF16.expression]
        assert summary["stored"] is False and summary["compiled"] == 1 and summary["cached"] == 1
        assert _compile.binary(SMALL_BF16, "sm_90a")[1][:4] == b"\x7fELF" and len(compiles) == 3
        assert not os.path.isdir(target) or entries(target) == []
    finally:
        if os.path.isdir(target):
            os.chmod(target, 0o755)


def test_read_only_directory_with_entries_loads_them(cache, monkeypatch):
    directory, compiles = cache
    expected = _compile.binary(SMALL, "sm_90a")
    monkeypatch.setattr(_compile, "_in_memory", {})
    _make_unwritable(directory, "read_only", monkeypatch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a hit writes nothing, so nothing to warn about
            assert _compile.binary(SMALL, "sm_90a") == expected
        assert compiles == [SMALL.expression]
    finally:
        os.chmod(directory, 0o755)


# ---- compile_many ----------------------------------------------------------------------------


def test_compile_many_in_worker_processes(cache, monkeypatch):
    """jobs=2: this process compiles one kernel (its own worker, held here until the other worker,
    a process, has written the other two entries) while the worker process compiles the rest."""
    directory, compiles = cache
    seen = []
    real = _compile._build_entry

    def held(task):  # this process's worker: its first kernel, once the worker process wrote the other two
        others = [key_of(v) + ".cubin" for v in (PLAN, SMALL, SMALL_BF16) if key_of(v) != task["key"]]
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(directory, e)) for e in others) and time.monotonic() < deadline:
            time.sleep(0.01)
        return real(task)

    monkeypatch.setattr(_compile, "_build_entry", held)
    summary = _compile.compile_many([PLAN, SMALL, SMALL_BF16, SMALL], "sm_90a", jobs=2,
                                  progress=lambda done, total, variant, status: seen.append((done, total, status)))
    monkeypatch.setattr(_compile, "_build_entry", real)
    assert summary["kernels"] == 3 and summary["compiled"] == 3 and summary["cached"] == 0
    assert summary["jobs"] == 2 and summary["stored"] is True
    assert len(compiles) == 1  # one here, the other two in the worker process
    assert [s[:2] for s in seen] == [(1, 3), (2, 3), (3, 3)] and {s[2] for s in seen} == {"compiled"}
    assert entries(directory) == sorted(key_of(v) + ".cubin" for v in (PLAN, SMALL, SMALL_BF16))
    for v in (PLAN, SMALL, SMALL_BF16):
        assert _cache.load(str(directory), key_of(v)) is not None
    again = _compile.compile_many([PLAN, SMALL, SMALL_BF16], "sm_90a", jobs=2, progress=False)
    assert again["compiled"] == 0 and again["cached"] == 3
    for v in (PLAN, SMALL, SMALL_BF16):
        _compile.binary(v, "sm_90a")
    assert len(compiles) == 1  # what the worker process wrote is what this process loads


def test_compile_many_in_threads(cache, monkeypatch):
    """processes=False (a first call's load_all): every kernel compiles in a thread of this process,
    at once (two held until both have started), and no worker process is started."""
    directory, compiles = cache
    started, both = [], threading.Barrier(2, timeout=120)
    real = _compile._build_entry

    def held(task):  # each of the two threads waits here until the other one has started too
        started.append(task["key"])
        both.wait()
        return real(task)

    def no_process(*args, **kwargs):
        raise AssertionError("compile_many(processes=False) started a process")

    monkeypatch.setattr(_compile, "_build_entry", held)
    monkeypatch.setattr(_compile.subprocess, "Popen", no_process)
    summary = _compile.compile_many([SMALL, SMALL_BF16], "sm_90a", jobs=2, progress=False, processes=False)
    monkeypatch.setattr(_compile, "_build_entry", real)
    assert summary["compiled"] == 2 and summary["jobs"] == 2 and len(started) == 2
    assert len(compiles) == 2  # both here
    assert entries(directory) == sorted(key_of(v) + ".cubin" for v in (SMALL, SMALL_BF16))


@pytest.mark.parametrize("processes", [True, False])
def test_compile_many_reports_a_failing_variant(cache, processes):
    broken = _compile.Kernel("shared/merge_states.cu", "cupy_fa::no_such_kernel<int>", 64)
    with pytest.raises(RuntimeError, match="no_such_kernel"):
        _compile.compile_many([SMALL, broken], "sm_90a", jobs=2, progress=False, processes=processes)


@pytest.mark.parametrize("kwargs, match", [(dict(jobs=0), "jobs"), (dict(jobs=1.5), "jobs"), (dict(jobs=True), "jobs"),
                                           (dict(arch="hopper"), "arch"), (dict(arch=None), "arch")])
def test_compile_many_refuses_bad_arguments(kwargs, match):
    args = dict(kernels=[SMALL], arch="sm_90a", jobs=1, progress=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        _compile.compile_many(**args)
    with pytest.raises(TypeError, match="kernels must be"):
        _compile.compile_many(["shared/merge_states.cu"], "sm_90a")


def test_progress_line_on_stderr(cache, capsys):
    _compile.compile_many([SMALL], "sm_90a", jobs=1, progress=True)
    _compile.compile_many([SMALL], "sm_90a", jobs=1, progress=True)
    err = capsys.readouterr().err.splitlines()
    assert err == [err[0], err[1]] and "1/1 (1 compiled, 0 from the cache)" in err[0]
    assert "1/1 (0 compiled, 1 from the cache)" in err[1] and "sm_90a" in err[0]


# ---- processes at once -------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import hashlib, json, os, sys, time
    from cupy_fa import _cache, _compile, catalog
    if os.environ.get("NO_LOCK"):  # as on a file system without locks: the atomic rename alone
        import contextlib
        _cache.locked = lambda directory, key: contextlib.nullcontext()
    compiled = []
    real = _compile._nvrtc_compile
    _compile._nvrtc_compile = lambda *a, **k: compiled.append(1) or real(*a, **k)
    variant = catalog.merge_states_kernel("float16")
    open(sys.argv[1] + "." + str(os.getpid()), "w").close()  # ready
    while not os.path.exists(sys.argv[1]):  # start together
        time.sleep(0.005)
    lowered, cubin = _compile.binary(variant, "sm_90a")
    print(json.dumps({"sha": hashlib.sha256(cubin).hexdigest(), "lowered": lowered, "compiled": len(compiled),
                      "key": _compile._task(variant, "sm_90a", _cache.cache_dir())["key"]}))
""")


@pytest.mark.parametrize("lock", [True, False], ids=["flock", "rename-only"])
def test_processes_compiling_one_variant_into_one_empty_directory(tmp_path, lock):
    """Four processes (tensor-parallel ranks) start on one empty directory at the same moment: all
    succeed with a whole entry; with the lock one compiles and the other three load its entry (all
    four hold the same bytes); without it each may compile, and the entry left is whole."""
    directory, go = tmp_path / "cache", tmp_path / "go"
    env = dict(os.environ, CUPY_FA_CACHE_DIR=str(directory), PYTHONPATH=ROOT)
    env.pop("NO_LOCK", None)
    if not lock:
        env["NO_LOCK"] = "1"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.*"))) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.01)  # all four imported and waiting at the start line
    go.write_text("")
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    (key,) = {r["key"] for r in results}
    assert entries(directory) == [key + ".cubin"]
    assert not [p for p in os.listdir(directory) if p.endswith(".tmp")]
    final = _cache.load(str(directory), key)
    assert final is not None and {r["lowered"] for r in results} == {final[0]}
    final_sha = hashlib.sha256(final[1]).hexdigest()
    if lock:
        assert sum(r["compiled"] for r in results) == 1, results
        assert {r["sha"] for r in results} == {final_sha}
    else:
        assert sum(r["compiled"] for r in results) >= 1
        assert final_sha in {r["sha"] for r in results}


# ---- the bytes: what CuPy's RawModule path compiles, handed unchanged to the loader -------------------


def test_cubin_equals_what_rawmodule_compiles(monkeypatch):
    """The cached build's cubin is byte for byte the one cupy.RawModule(code=..., options=
    compile_options(arch), name_expressions=[...]) compiles on an H200 (CuPy 14.2's own NVRTC
    function, compiler._compile_using_nvrtc_no_warning, given what RawModule gives it: our options
    plus -ftz=true, and arch '90', which it turns into a plain -arch=sm_90; the arch lookup is
    memoized per device, so it is given its H200 answer). Same process and program name: NVRTC
    writes both into internal symbol names."""
    from cupy.cuda import compiler

    assert cupy_version() == "14.2.0", "re-check RawModule's options against this CuPy's compiler.py"
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin"))
    for variant in (SMALL, PLAN):
        theirs, mapping = compiler._compile_using_nvrtc_no_warning(
            _compile.program_text(variant), _compile.compile_options("sm_90a") + ("-ftz=true",), "90", "kern.cu",
            (variant.expression,), None, True, False, None)  # cache_in_memory: program name ""
        lowered, ours, _ = _compile._nvrtc_compile(_compile.program_text(variant), variant.expression,
                                                 _compile.build_options("sm_90a"), name="")
        assert mapping[variant.expression] == lowered
        assert internal_names_as_one(ours) == internal_names_as_one(theirs), variant.expression


def internal_names_as_one(cubin):
    """A cubin with the 8 hex digits NVRTC writes into each internal-linkage symbol name
    (``_INTERNAL_00000000_15_default_program_<8 hex>_<pid>``, a hash that changes with the clock:
    two compiles a second apart differ there and nowhere else) set to one value."""
    import re

    return re.sub(rb"(_INTERNAL_[0-9a-f]{8}_\d+_\w*?_)[0-9a-f]{8}_", rb"\g<1>00000000_", cubin)


def cupy_version():
    import cupy

    return cupy.__version__


class FakeLoader:
    """cupy.cuda.function.Module / Function and the driver's attribute calls, recording."""

    def __init__(self, monkeypatch):
        import cupy
        from cupy.cuda import function
        from cupy_backends.cuda.api import driver

        self.loaded, self.attrs, self.launches = [], [], []
        fake = self

        class Function:
            def __init__(self, module, name):
                self.module, self.name, self.ptr = module, name, 0xF00

            def __call__(self, grid, block, args, shared_mem=0, stream=None):
                fake.launches.append((grid, block, args, shared_mem, stream))

        class Module:
            def load(self, cubin):
                assert type(cubin) is bytes  # Module.load(self, bytes cubin)
                fake.loaded.append(cubin)

            def get_function(self, name):
                return Function(self, name)

        monkeypatch.setattr(function, "Module", Module)
        monkeypatch.setattr(driver, "funcSetAttribute", lambda ptr, attr, value: fake.attrs.append((ptr, attr, value)))
        monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)

        class Device:
            def __init__(self, device_id=None):
                self.id = 0 if device_id is None else device_id

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

        monkeypatch.setattr(cupy.cuda, "Device", Device)


def test_get_function_hands_the_entry_to_the_loader(cache, monkeypatch):
    directory, compiles = cache
    from cupy_backends.cuda.api import driver

    fake = FakeLoader(monkeypatch)
    monkeypatch.setattr(_build, "_functions", {})
    monkeypatch.setattr(_build, "_modules", {})
    monkeypatch.setattr(_build, "_native_arch", lambda device_id: "sm_90a")
    variant = _compile.Kernel(SMALL.source, SMALL.expression, SMALL.threads, smem_bytes=64 * 1024)
    fn = _build.get_function(variant, 0)
    lowered, cubin = _cache.load(str(directory), key_of(variant))
    assert fake.loaded == [cubin]  # the entry's cubin, as getCUBIN gave it
    assert fn.kernel.name == lowered and fn.name == lowered and fn.kernel.ptr == 0xF00
    assert fake.attrs == [(0xF00, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 64 * 1024)]
    fn((3, 1), (256,), ("params",), shared_mem=64 * 1024)
    assert fake.launches == [((3, 1), (256,), ("params",), 64 * 1024, None)]
    assert _build.get_function(variant, 0) is fn and fake.loaded == [cubin]  # memoised per device
    # a new process (the in-process memo dropped): loads the entry, compiles nothing
    monkeypatch.setattr(_build, "_functions", {})
    _build.get_function(variant, 0)
    assert fake.loaded == [cubin, cubin] and compiles == [SMALL.expression]


def test_loader_api_is_cupys():
    """The names the loader calls exist in this CuPy with the signatures used (introspection: the
    Cython sources are not installed)."""
    from cupy.cuda import function, memory
    from cupy_backends.cuda.api import driver

    assert "bytes cubin" in function.Module.load.__doc__
    assert "name" in function.Module.get_function.__doc__ and "name" in function.Module.get_global_var.__doc__
    assert {"ptr", "module"} <= set(dir(function.Function))
    assert driver.funcSetAttribute.__doc__.startswith("funcSetAttribute(intptr_t f, int attribute, int value)")
    assert driver.funcGetAttribute.__doc__.startswith("funcGetAttribute(int attribute, intptr_t f)")
    assert driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES == 8  # cuda.h
    assert "UnownedMemory(intptr_t ptr, size_t size, owner, int device_id=-1)" in memory.UnownedMemory.__doc__


def test_a_build_for_another_compute_capability_loads_as_ptx(cache, monkeypatch):
    """CUPY_FA_ARCH=sm_80 on a Hopper device: a cubin runs only on its own compute capability, so
    the module is built for the virtual target compute_80 (NUL-ended PTX the driver compiles at
    load), cached like a cubin and read back; the device's own arch (or sm_90 on sm_90a) stays a cubin."""
    directory, compiles = cache
    fake = FakeLoader(monkeypatch)
    monkeypatch.setattr(_build, "_functions", {})
    monkeypatch.setattr(_build, "_modules", {})
    monkeypatch.setattr(_build, "_native_arch", lambda device_id: "sm_90a")
    monkeypatch.setenv("CUPY_FA_ARCH", "sm_80")
    knobs.reload()
    assert _build.loadable_arch(0) == "compute_80"
    _build.get_function(SMALL, 0)
    (image,) = fake.loaded
    assert image.startswith(b"//") and image.endswith(b"\0") and b".target sm_80" in image
    assert _compile.binary(SMALL, "compute_80")[1] == image and compiles == [SMALL.expression]  # from the cache
    monkeypatch.setenv("CUPY_FA_ARCH", "sm_90")
    knobs.reload()
    assert _build.loadable_arch(0) == "sm_90"
    monkeypatch.delenv("CUPY_FA_ARCH")
    knobs.reload()
    assert _build.loadable_arch(0) == "sm_90a"
