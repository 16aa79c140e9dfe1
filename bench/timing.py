"""Timing: CUDA-graph replays of many launches over rotated inputs, CUDA events, medians.

Each launch function does one launch on one input set; a graph holds `len(launches)` of
them in order, so per-launch time = replay time / len(launches).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass
class Timing:
    time_us: float  # median per-launch time
    min_us: float
    max_us: float
    replays: int
    launches: int  # launches per graph (or per eager timed region)
    method: str

    def as_dict(self):
        return asdict(self)


def _summary(samples_ms, launches, method) -> Timing:
    per = [1e3 * t / launches for t in samples_ms]
    return Timing(statistics.median(per), min(per), max(per), len(per), launches, method)


def cupy_graph(launches, warmup=10, reps=50) -> Timing:
    """Capture `launches` (callables doing CuPy-stream launches) into one cupy graph on a
    non-blocking stream and time its replays with cupy events (cupy_fa._timing)."""
    from cupy_fa._timing import graph_replays_ms

    return _summary(graph_replays_ms(launches, warmup, reps), len(launches), "cupy graph")


def capture_torch_graph(launches):
    """A torch.cuda.CUDAGraph of the callables `launches` (each doing torch launches), after two
    eager passes on a side stream as torch's graph docs ask; raises what the capture raises."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch's graph docs ask
        for _ in range(2):
            for f in launches:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in launches:
            f()
    return g


def torch_graph(launches, warmup=10, reps=50) -> Timing:
    """The same with torch.cuda.CUDAGraph; falls back to `torch_eager` (and says so in
    `method`) if the launches cannot be captured."""
    import torch

    try:
        g = capture_torch_graph(launches)
    except Exception as e:  # noqa: BLE001 - any capture failure: time eagerly instead
        torch.cuda.synchronize()
        t = torch_eager(launches, warmup, reps)
        t.method = f"torch eager back-to-back (graph capture failed: {type(e).__name__}: {str(e)[:160]})"
        return t
    times = []
    for i in range(warmup + reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
    del g
    return _summary(times, len(launches), "torch graph")


def torch_eager(launches, warmup=10, reps=50) -> Timing:
    """Events around the launches run back to back on torch's current stream."""
    import torch

    times = []
    for i in range(warmup + reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for f in launches:
            f()
        b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
    return _summary(times, len(launches), "torch eager back-to-back")


def cupy_events(fn, warmup=5, reps=20) -> float:
    """Median milliseconds of fn() (one op on cupy's current stream) between cupy events."""
    import cupy

    s = cupy.cuda.get_current_stream()
    times = []
    for i in range(warmup + reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(s)
        fn()
        b.record(s)
        b.synchronize()
        if i >= warmup:
            times.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def host_us(fn, sync, repeats=200, warmup=5) -> float:
    """Host time of one call of ``fn`` in microseconds: ``sync()`` (the device idle, nothing
    queued), then ``fn()`` timed alone on the host clock; the median of ``repeats`` such calls.
    The same for every implementation (ours, FlashInfer), so the figures compare."""
    import time

    for _ in range(warmup):
        sync()
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    sync()
    return 1e6 * statistics.median(times)
