"""Host time of plan / run / GraphRunner steps on a machine without a GPU: every device call
stubbed (allocations are fake arrays, copies, memsets, launches and graph launches do nothing), so
what is timed is cupy_fa's own Python between the calls. A probe for predicting the GPU's figures,
not one of them (the driver calls themselves cost a few microseconds each there).

    PYTHONPATH=. python lab/host_cpu.py [--profile]      (repo root, CuPy installed, no GPU needed)
"""

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
import types

import numpy as np


class FakeArray:
    """What cupy_fa reads and writes of a CuPy array, without a device."""
    _next = [1 << 32]

    def __init__(self, shape, dtype, ptr=None):
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, tuple) else (shape,)))
        self.dtype = np.dtype(dtype)
        if ptr is None:
            ptr = FakeArray._next[0]
            FakeArray._next[0] += (int(np.prod(self.shape)) * self.dtype.itemsize + 4095) // 4096 * 4096 + 4096
        self.data = types.SimpleNamespace(ptr=ptr, device_id=0, memset_async=lambda *a, **k: None)
        self.flags = types.SimpleNamespace(c_contiguous=True)
        self.device = types.SimpleNamespace(id=0)

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)
    strides = property(lambda self: ())

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        shape, offset, stride = list(self.shape), 0, self.dtype.itemsize * int(np.prod(self.shape[1:]))
        if isinstance(key[0], slice):
            start, stop, _ = key[0].indices(self.shape[0])
            offset, shape[0] = start * stride, max(stop - start, 0)
        return FakeArray(tuple(shape), self.dtype, self.data.ptr + offset)

    def __setitem__(self, key, value):
        pass

    def reshape(self, *shape):
        return FakeArray(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape, self.dtype,
                         self.data.ptr)

    def set(self, *a, **k):
        pass

    def fill(self, *a):
        pass


class FakeStream:
    def __init__(self, ptr=0):
        self.ptr = ptr

    def is_capturing(self):
        return False

    def record(self, event=None):
        return FakeEvent()

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def begin_capture(self):
        pass

    def end_capture(self):
        return types.SimpleNamespace(launch=counted("cudaGraphLaunch"))


class FakeEvent:
    ptr = 1
    done = True

    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        pass


CALLS = {}  # driver call -> how many, since the last CALLS.clear()


def counted(name, fn=lambda *a: None):
    def call(*args):
        CALLS[name] = CALLS.get(name, 0) + 1
        return fn(*args)
    return call


def install(package="cupy_fa"):
    """Stubs for every device call (each counted in CALLS), for the cupy_fa package imported as
    ``package`` (lab/host_ab.py imports a second tree under another name)."""
    import importlib

    import cupy

    _arrays, _build, _views = (importlib.import_module(f"{package}.{m}") for m in ("_arrays", "_build", "_views"))

    stream = FakeStream()
    cupy.zeros = lambda shape, dtype=float: FakeArray(shape, dtype)
    cupy.empty = lambda shape, dtype=float: FakeArray(shape, dtype)
    cupy.empty_like = lambda a: FakeArray(a.shape, a.dtype)
    cupy.full = lambda shape, value, dtype=float: FakeArray(shape, dtype)
    cupy.cuda.get_current_stream = lambda device_id=None: stream
    cupy.cuda.Stream = lambda *a, **k: FakeStream(1)
    cupy.cuda.Event = FakeEvent
    cupy.cuda.Device = lambda device_id=None: contextlib.nullcontext(types.SimpleNamespace(id=0))
    runtime = cupy.cuda.runtime
    for name in ("memcpyAsync", "memsetAsync", "memcpy2DAsync", "eventRecord"):
        setattr(runtime, name, counted(name))
    cupy.cuda.alloc_pinned_memory = bytearray  # (host memory the test reads back)
    runtime.getDevice = lambda: 0
    _views._KINDS[FakeArray] = _views.CUPY
    _arrays.require_cuda = lambda: None
    _arrays.current_device_id = lambda: 0
    _build._native_arch = lambda device_id: "sm_90a"
    _build._device_attribute = lambda device_id, name: {"MultiProcessorCount": 132,
                                                        "MaxSharedMemoryPerBlockOptin": 227 * 1024}[name]
    function = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=1))
    _build.get_function = lambda kernel, device_id=None: function
    _build.load_all = lambda kernels, device_id: None
    launch, launch_ex = counted("cuLaunchKernel"), counted("cuLaunchKernelEx", lambda *a: 0)
    _build._launch_kernel = lambda: launch
    _build._driver = lambda: launch_ex
    _build.memset_d2d32 = counted("cuMemsetD2D32Async")


def fake_cache(num_pages, page_size, h_kv=8, d=128, package="cupy_fa"):
    import importlib

    PagedKVCache = importlib.import_module(f"{package}.kv_cache").PagedKVCache

    cache = PagedKVCache.__new__(PagedKVCache)
    shape = (num_pages, page_size, h_kv, d)
    cache.k, cache.v = FakeArray(shape, np.float16), FakeArray(shape, np.float16)
    cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim = num_pages, page_size, h_kv, d
    cache.head_dim_v = d
    cache.dtype_name, cache.device_id = "bfloat16", 0
    return cache


def median_us(fn, repeats=2000, warmup=50):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


CELLS = [  # (name, B, q_len, kv_len)
    ("decode B=1 L=4096", 1, 1, 4096), ("decode B=64 L=4096", 64, 1, 4096), ("decode B=1 L=131072", 1, 1, 131072),
    ("verify q=4 B=64", 64, 4, 4096), ("prefill B=4 L=4096", 4, 4096, 4096),
    ("decode B=16 L=32768", 16, 1, 32768), ("decode B=64 L=4096 window 1024", 64, 1, 4096, 1024),
]


def attention_cell(b, q_len, kv_len, window=None, package="cupy_fa"):
    """(plan, run) of a BatchAttention step of B requests of q_len tokens over kv_len keys (32 / 8
    heads, D 128, bf16, page 16, ``window`` keys or none) over a fake cache, for the tree imported as
    ``package``; planned once."""
    import importlib

    bf16 = importlib.import_module(f"{package}._arrays").DTYPES["bfloat16"]
    pages = -(-kv_len // 16)
    table = np.arange(b * pages, dtype=np.int32).reshape(b, pages)
    q_lens, kv_lens = np.full(b, q_len, np.int32), np.full(b, kv_len, np.int32)
    cache = fake_cache(b * pages, 16, package=package)
    attn = importlib.import_module(package).BatchAttention(32, 8, 128, "bfloat16")
    q = FakeArray((b * q_len, 32, 128), bf16)
    out = FakeArray(q.shape, bf16)
    plan = lambda: attn.plan(q_lens, kv_lens, table, window=window)
    plan()
    return plan, lambda: attn.run(q, cache, out=out)


def graph_step(runner, b, lengths, package="cupy_fa"):
    """(replay, eager) of GraphRunner decode steps of B requests over 256 pages of 16 keys, ``lengths``
    "device" (CuPy) or "host" (NumPy), for the tree imported as ``package``."""
    import importlib

    bf16 = importlib.import_module(f"{package}._arrays").DTYPES["bfloat16"]
    cache = fake_cache(b * 256, 16, package=package)
    q = FakeArray((b, 32, 128), bf16)
    if lengths == "device":
        lens = (FakeArray((b,), np.int32), FakeArray((b,), np.int32), FakeArray((b, 256), np.int32))
    else:
        lens = (np.ones(b, np.int32), np.full(b, 4096, np.int32), np.arange(b * 256, dtype=np.int32).reshape(b, 256))
    return (lambda: runner.run("decode", q, cache, *lens),
            lambda: runner.run("decode", q, cache, *lens, use_graph=False))


def new_runner(package="cupy_fa"):
    import importlib

    return importlib.import_module(package).GraphRunner(32, 8, 128, "bfloat16", max_batch_size=64, max_q_len=8,
                                                        max_pages_per_request=256, page_size=16)


def print_profiles(name, repeats=3000, **calls):
    """cProfile's top functions (internal time) of each call in ``calls`` (label -> function), run
    ``repeats`` times."""
    for label, fn in calls.items():
        prof = cProfile.Profile()
        prof.runcall(lambda: [fn() for _ in range(repeats)])
        print(f"\n== {name}: {label}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", action="store_true", help="cProfile of each call kind, top functions")
    args = parser.parse_args(argv)
    install()
    rows = []
    for name, *cell in CELLS:
        plan, run = attention_cell(*cell)
        rows.append((name, median_us(plan), median_us(run)))
        if args.profile:
            print_profiles(name, plan=plan, run=run)
    runner = new_runner()
    steps = []
    for lengths in ("device", "host"):
        for b in (1, 8, 64):
            replay, eager = graph_step(runner, b, lengths)
            replay()
            calls = []
            for fn in (replay, eager):
                CALLS.clear()
                fn()
                calls.append(" ".join(f"{k} {v}" for k, v in sorted(CALLS.items())))
            steps.append((f"{lengths} lengths B={b}", median_us(replay), median_us(eager), calls))
            if args.profile and b == 8:
                for label, fn in (("replay", replay), ("eager", eager)):
                    prof = cProfile.Profile()
                    prof.runcall(lambda: [fn() for _ in range(3000)])
                    print(f"\n== GraphRunner decode B={b}, {lengths} lengths: {label}")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    print(f"\nhost us per call, device calls stubbed (median of 2000; {sys.version.split()[0]})")
    print(f"{'cell (bf16, 32/8 heads, D 128, page 16)':42s} {'plan':>7s} {'run':>7s}")
    for name, p, r in rows:
        print(f"{name:42s} {p:7.1f} {r:7.1f}")
    print(f"\n{'GraphRunner decode, CuPy q, page 16':42s} {'replay':>7s} {'eager':>7s}   driver calls (replay | eager)")
    for name, replay, eager, calls in steps:
        print(f"{name:42s} {replay:7.1f} {eager:7.1f}   {calls[0]} | {calls[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
