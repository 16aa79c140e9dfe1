"""Concurrency: two instances on two streams at once work; one instance used from two threads
works one call at a time (each plan waits for the work queued with the previous one, on any
stream) and raises a clear RuntimeError where the threads would race on its buffers."""

import threading

import numpy as np
import pytest

from cases import after_current, new_rng
from safety_cases import assert_matches, device_step, reference_of

pytestmark = pytest.mark.gpu

DTYPE, HEADS, D, PAGE = "bfloat16", (8, 2), 128, 16


def batch(rng, size, long_kv=False):
    """A decode/verify/extend mix; long_kv makes the kernel run long enough for a race to show."""
    q = rng.choice([1, 1, 4, 8, 20], size=size)
    hi = 16384 if long_kv else 3000
    kv = q + rng.integers(0, hi, size=size)
    return q, kv


def run_step(attn, step, stream):
    import cupy

    with after_current(stream):  # the step's q and cache were made on the default stream
        attn.plan(step["q_lens"], step["kv_lens"], step["table"])
        out = cupy.full(step["q"].shape, np.nan, step["q"].dtype)
        attn.run(step["q"], step["cache"], out=out)
    return out


def test_two_instances_two_streams_at_once():
    """Interleaved on one thread, then from two threads at once, each instance on its own stream."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    attns = [cupy_fa.BatchAttention(*HEADS, D, DTYPE) for _ in range(2)]
    steps = [device_step(rng, DTYPE, HEADS, D, PAGE, *batch(rng, 24, long_kv=True)) for _ in range(2)]
    streams = [after_current(cupy.cuda.Stream(non_blocking=True)) for _ in range(2)]  # after the steps' copies
    # one thread: both plans, then both runs, nothing synchronised in between
    with streams[0]:
        attns[0].plan(steps[0]["q_lens"], steps[0]["kv_lens"], steps[0]["table"])
    with streams[1]:
        attns[1].plan(steps[1]["q_lens"], steps[1]["kv_lens"], steps[1]["table"])
    outs = []
    for attn, step, stream in zip(attns, steps, streams):
        with stream:
            outs.append(attn.run(step["q"], step["cache"]))
    cupy.cuda.Device().synchronize()
    for i, (out, step) in enumerate(zip(outs, steps)):
        assert_matches(out, reference_of(step), DTYPE, step["q_lens"], f"interleaved instance {i}")

    # two threads, each its own instance and stream, plan + run in a loop at the same time
    results, errors = {}, []
    start = threading.Barrier(2)

    def worker(i):
        try:
            start.wait()
            results[i] = [run_step(attns[i], steps[i], streams[i]) for _ in range(5)]
            streams[i].synchronize()
        except Exception as exc:  # reported below, with the thread
            errors.append((i, exc))

    threads = [threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, step in enumerate(steps):
        ref = reference_of(step)
        first = results[i][0].get()
        for j, out in enumerate(results[i]):
            assert_matches(out, ref, DTYPE, step["q_lens"], f"thread {i} iteration {j}")
            assert np.array_equal(out.get().view(np.uint16), first.view(np.uint16))  # same bits every time


def test_one_instance_two_threads_one_call_at_a_time():
    """Threads take turns (a lock around plan + run): each gets its own batch right, although
    each plans on its own stream while the other's long run may still be in flight."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE)
    steps = [device_step(rng, DTYPE, HEADS, D, PAGE, *batch(rng, 32 - 8 * i, long_kv=True)) for i in range(2)]
    turn = threading.Lock()
    outs, errors = {0: [], 1: []}, []

    def worker(i):
        stream = cupy.cuda.Stream(non_blocking=True)
        try:
            for _ in range(6):
                with turn:  # no sync: the next plan (other thread, other stream) must wait on the device
                    outs[i].append(run_step(attn, steps[i], stream))
            stream.synchronize()
        except Exception as exc:
            errors.append((i, exc))

    threads = [threading.Thread(target=worker, args=(i,), name=f"turns-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cupy.cuda.Device().synchronize()
    assert not errors, errors
    for i, step in enumerate(steps):
        ref = reference_of(step)
        for j, out in enumerate(outs[i]):
            assert_matches(out, ref, DTYPE, step["q_lens"], f"thread {i} turn {j}")


def test_one_instance_run_of_a_plan_another_thread_replaced():
    """A plans, B plans, A runs: A would compute B's batch, so A's run raises; B's run is right."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE)
    steps = [device_step(rng, DTYPE, HEADS, D, PAGE, [1, 1, 4], [40, 700, 90]) for _ in range(2)]
    planned, replanned = threading.Event(), threading.Event()
    caught, outs = {}, {}

    def thread_a():
        attn.plan(steps[0]["q_lens"], steps[0]["kv_lens"], steps[0]["table"])
        planned.set()
        replanned.wait(30)
        try:
            attn.run(steps[0]["q"], steps[0]["cache"])
        except RuntimeError as exc:
            caught["a"] = exc

    def thread_b():
        planned.wait(30)
        attn.plan(steps[1]["q_lens"], steps[1]["kv_lens"], steps[1]["table"])
        replanned.set()

    a = threading.Thread(target=thread_a, name="thread-a")
    b = threading.Thread(target=thread_b, name="thread-b")
    a.start(), b.start()
    a.join(), b.join()
    assert "another thread planned this BatchAttention" in str(caught.get("a")), caught
    assert "thread-a" in str(caught["a"])
    # the main thread never planned: it may run the current plan (B's), and gets B's batch
    outs["b"] = attn.run(steps[1]["q"], steps[1]["cache"])
    cupy.cuda.Device().synchronize()
    assert_matches(outs["b"], reference_of(steps[1]), DTYPE, steps[1]["q_lens"], "B's plan")


def test_one_instance_two_threads_inside_at_once(monkeypatch):
    """While thread A is inside plan(), thread B's plan() and run() raise, naming both; A's step
    then completes and is right."""
    import cupy
    import cupy_fa
    from cupy_fa import plan as plan_module

    rng, _ = new_rng()
    attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE)
    step = device_step(rng, DTYPE, HEADS, D, PAGE, [1, 8, 3], [513, 1030, 3])
    attn.plan(step["q_lens"], step["kv_lens"], step["table"])  # compiles, and gives B a plan to try
    inside, release = threading.Event(), threading.Event()
    real = plan_module.launch_plan

    def slow_launch(*args, **kwargs):
        if threading.current_thread().name == "thread-a":
            inside.set()
            release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_module, "launch_plan", slow_launch)
    outs, errors = {}, []

    def thread_a():
        try:
            attn.plan(step["q_lens"], step["kv_lens"], step["table"])
            outs["a"] = attn.run(step["q"], step["cache"])
            cupy.cuda.get_current_stream().synchronize()
        except Exception as exc:
            errors.append(exc)

    a = threading.Thread(target=thread_a, name="thread-a")
    a.start()
    assert inside.wait(30)
    seen = []

    def thread_b():
        for call in (lambda: attn.plan(step["q_lens"], step["kv_lens"], step["table"]),
                     lambda: attn.run(step["q"], step["cache"])):
            try:
                call()
                seen.append(None)
            except RuntimeError as exc:
                seen.append(str(exc))

    b = threading.Thread(target=thread_b, name="thread-b")
    b.start()
    b.join()
    release.set()
    a.join()
    assert not errors, errors
    assert len(seen) == 2 and all(s is not None for s in seen), seen
    for text, call in zip(seen, ("plan", "run")):
        assert f"BatchAttention.{call}() on thread 'thread-b' while thread 'thread-a' is inside plan()" in text
        assert "one BatchAttention per thread" in text
    assert_matches(outs["a"], reference_of(step), DTYPE, step["q_lens"], "thread A")


def test_one_thread_plans_on_two_streams():
    """Plan + run on stream 1 and a second run of that plan on stream 3, then at once plan + run
    another batch on stream 2: the second plan waits for both runs, whose metadata it rewrites;
    every result is right."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE)
    s1, s2, s3 = (cupy.cuda.Stream(non_blocking=True) for _ in range(3))
    first = device_step(rng, DTYPE, HEADS, D, PAGE, *batch(rng, 48, long_kv=True))
    second = device_step(rng, DTYPE, HEADS, D, PAGE, *batch(rng, 5))
    for _ in range(3):
        out1 = run_step(attn, first, s1)
        with s3:  # a run on another stream than its plan's is ordered after it, and the next plan after it
            out1b = attn.run(first["q"], first["cache"])
        out2 = run_step(attn, second, s2)
        cupy.cuda.Device().synchronize()
        ref1 = reference_of(first)
        assert_matches(out1, ref1, DTYPE, first["q_lens"], "stream 1")
        assert_matches(out1b, ref1, DTYPE, first["q_lens"], "stream 1 again")
        assert_matches(out2, reference_of(second), DTYPE, second["q_lens"], "stream 2")


def test_graph_runner_from_two_threads_at_once(monkeypatch):
    """A GraphRunner's static buffers hold one step: while thread A is inside run(), thread B's
    run() raises, naming the fix; A's step completes and is right."""
    import cupy
    import cupy_fa
    from cupy_fa import ForwardMode, plan as plan_module

    rng, _ = new_rng()
    step = device_step(rng, DTYPE, HEADS, D, PAGE, [1, 1, 1], [40, 700, 1500])
    runner = cupy_fa.GraphRunner(*HEADS, D, DTYPE, max_batch_size=4, max_q_len=4,
                                 max_pages_per_request=step["table"].shape[1], page_size=PAGE)
    args = (ForwardMode.DECODE, step["q"], step["cache"], step["q_lens"], step["kv_lens"], step["table"])
    runner.run(*args)  # captured once, outside the race
    inside, release = threading.Event(), threading.Event()
    real = plan_module.stage_inputs

    def slow_stage(*a, **k):
        if threading.current_thread().name == "runner-a":
            inside.set()
            release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(plan_module, "stage_inputs", slow_stage)
    outs, errors, seen = {}, [], []

    def thread_a():
        try:
            outs["a"] = runner.run(*args).get()
        except Exception as exc:
            errors.append(exc)

    a = threading.Thread(target=thread_a, name="runner-a")
    a.start()
    assert inside.wait(30)

    def thread_b():
        try:
            runner.run(*args)
        except RuntimeError as exc:
            seen.append(str(exc))

    b = threading.Thread(target=thread_b, name="runner-b")
    b.start()
    b.join()
    release.set()
    a.join()
    cupy.cuda.Device().synchronize()
    assert not errors, errors
    assert seen and "use one GraphRunner per thread" in seen[0] and "'runner-b'" in seen[0], seen
    assert_matches(outs["a"], reference_of(step), DTYPE, step["q_lens"], "runner thread A")


def test_host_steps_planned_while_the_device_is_busy(monkeypatch):
    """Host steps planned and run back to back while the stream is still held by earlier work (a
    spin kernel), so no copy from a host mirror has run when the next step is written: the two
    pinned mirrors take the first steps, then (both copies pending) the pageable one; no step's
    lengths or page table are overwritten before their copy, and every run matches float64."""
    import cupy
    import cupy_fa
    from cupy_fa import _staging

    taken = []
    real_take = _staging.HostMirrors.take

    def take(self, words, capturing=False):
        mirror = real_take(self, words, capturing)
        taken.append("pageable" if mirror is self.pageable else f"pinned {self.pinned.index(mirror)}")
        return mirror

    monkeypatch.setattr(_staging.HostMirrors, "take", take)
    monkeypatch.setattr(_staging, "PINNED_FROM_BYTES", 0)  # these small steps from the pinned mirrors too
    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        long long start = clock64(); while (clock64() - start < cycles) { } }''', "spin")
    rng, _ = new_rng()
    steps = [device_step(rng, DTYPE, HEADS, D, PAGE, *batch(rng, size)) for size in (5, 9, 3, 7, 4)]
    attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE)
    stream = after_current(cupy.cuda.Stream(non_blocking=True))
    for step in steps:  # sizes the buffers, compiles and loads every step's kernels
        run_step(attn, step, stream)
    stream.synchronize()
    taken.clear()
    with stream:
        spin((1,), (1,), (np.int64(2_000_000_000),))  # about 1 s at 2 GHz: every copy below waits behind it
    outs = [run_step(attn, step, stream) for step in steps]
    assert sorted(taken[:2]) == ["pinned 0", "pinned 1"] and taken[2:] == ["pageable"] * 3
    stream.synchronize()
    for i, (out, step) in enumerate(zip(outs, steps)):
        assert_matches(out, reference_of(step), DTYPE, step["q_lens"], f"step {i} ({taken[i]})")
