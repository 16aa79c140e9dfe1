"""CUDA-graph replay timing, shared by the demo, the bench (bench/timing.py) and the probes (lab/).

Small kernels are timed as replays of one graph holding many launches: per-launch
time = replay time / launches, with no CPU launch cost in it.
"""

import time

import numpy as np


def capture_graph(launches):
    """``(graph, stream)``: the callables `launches` (each doing CuPy-stream launches) run once
    eagerly, then captured into one graph on a new non-blocking stream."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for f in launches:  # eager pass: compile, set attributes, touch every buffer
            f()
        stream.synchronize()
        stream.begin_capture()
        try:
            for f in launches:
                f()
        finally:
            graph = stream.end_capture()
    return graph, stream


def graph_replays_ms(launches, warmup=10, reps=50):
    """Captures `launches` into one graph (:func:`capture_graph`) and returns the milliseconds of
    `reps` replays (after `warmup` untimed ones), measured with CUDA events."""
    import cupy

    graph, stream = capture_graph(launches)
    times = []
    for i in range(warmup + reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(cupy.cuda.get_elapsed_time(start, end))
    return times


def per_launch_us_for(launches, seconds, reps=20):
    """Median per-launch time (us) of graph replays of `launches` for about `seconds`, in
    slices of `reps` replays (each slice captured anew; the diagnosis scripts' timer)."""
    times, start = [], time.time()
    while time.time() - start < seconds:
        times += graph_replays_ms(launches, warmup=2, reps=reps)
    return 1e3 * float(np.median(times)) / len(launches)
