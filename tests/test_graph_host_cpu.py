"""GraphRunner's step on the host without a GPU (every device call stubbed, as lab/host_cpu.py
stubs them, and recorded): what a replay and an eager step hand the driver, and that bad input
raises before anything is handed over. The bytes the staging kernel's parts move are
tests/test_host_path_cpu.py's."""

import contextlib
import types

import numpy as np
import pytest

from cupy_fa import _arrays, _build, _staging, _views, catalog
from lab import host_cpu

FakeArray = host_cpu.FakeArray


@pytest.fixture
def device(monkeypatch):
    """The stubs of lab/host_cpu.install, undone after the test; returns the list every driver call
    is recorded in: (name, args), a staging launch as ("stage", its parts) and a graph launch as
    ("graph", key)."""
    import cupy

    calls = []
    stream = host_cpu.FakeStream(7)

    def record(name):
        return lambda *args: calls.append((name, args))

    def end_capture():
        return types.SimpleNamespace(launch=lambda s=None: calls.append(("graph", None)))

    def launch_packed(launch, stream_ptr):
        if launch.kernel == catalog.STAGE_KERNEL:
            record = launch.packed[0]
            calls.append(("stage", [tuple(c.item()) for c in record["copies"][:record["count"]]], launch._grid3))
        else:
            calls.append(("launch", launch.kernel.source))

    for name, value in (("zeros", lambda shape, dtype=float: FakeArray(shape, dtype)),
                        ("empty", lambda shape, dtype=float: FakeArray(shape, dtype))):
        monkeypatch.setattr(cupy, name, value)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device_id=None: stream)
    monkeypatch.setattr(cupy.cuda, "Stream", _CaptureStream.make(end_capture))
    monkeypatch.setattr(cupy.cuda, "Event", host_cpu.FakeEvent)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device_id=None: contextlib.nullcontext(types.SimpleNamespace(id=0)))
    runtime = cupy.cuda.runtime
    for name in ("memcpyAsync", "memsetAsync", "memcpy2DAsync", "eventRecord"):
        monkeypatch.setattr(runtime, name, record(name))
    monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", bytearray)
    monkeypatch.setattr(runtime, "getDevice", lambda: 0)
    monkeypatch.setitem(_views._KINDS, FakeArray, _views.CUPY)
    monkeypatch.setattr(_arrays, "require_cuda", lambda: None)
    monkeypatch.setattr(_arrays, "current_device_id", lambda: 0)
    monkeypatch.setattr(_build, "_native_arch", lambda device_id: "sm_90a")
    monkeypatch.setattr(_build, "_device_attribute", lambda device_id, name: {
        "MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 227 * 1024}[name])
    monkeypatch.setattr(_build, "load_all", lambda kernels, device_id: None)
    monkeypatch.setattr(_build, "launch_packed", launch_packed)
    monkeypatch.setattr(_build, "memset_d2d32", record("cuMemsetD2D32Async"))
    monkeypatch.setattr(_build, "launch", lambda *a, **k: calls.append(("launch", a[0].source)))
    return calls


class _CaptureStream(host_cpu.FakeStream):
    """The capture stream: its graph's launches are recorded."""

    @classmethod
    def make(cls, end_capture):
        return lambda *a, **k: cls(9, end_capture)

    def __init__(self, ptr, end_capture):
        super().__init__(ptr)
        self.end_capture = end_capture


def runner(**kw):
    import cupy_fa

    return cupy_fa.GraphRunner(32, 8, 128, "bfloat16", max_batch_size=64, max_q_len=8, max_pages_per_request=256,
                               page_size=16, **kw)


def step_inputs(batch, lengths, columns=256):
    bf16 = _arrays.DTYPES["bfloat16"]
    q = FakeArray((batch, 32, 128), bf16)
    if lengths == "device":
        lens = (FakeArray((batch,), np.int32), FakeArray((batch,), np.int32), FakeArray((batch, columns), np.int32))
    else:
        lens = (np.ones(batch, np.int32), np.full(batch, 16 * columns, np.int32),
                np.arange(batch * columns, dtype=np.int32).reshape(batch, columns))
    return q, host_cpu.fake_cache(64 * 256, 16), lens


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_device_step_is_one_staging_launch_and_the_graph(device, batch):
    """A replay with device lengths: one staging launch (q_lens and kv_lens with the bucket's zero
    padding, the page-table rows with -1 past the caller's columns, q) and the graph launch; no
    memcpy. The eager step hands the staging kernel the same parts, then plans and runs."""
    r = runner()
    columns = 200
    q, cache, (q_lens, kv_lens, table) = step_inputs(batch, "device", columns)
    bucket = r.bucket_for(batch)
    buffers = r.attn.plan_buffers
    r.run("decode", q, cache, q_lens, kv_lens, table)  # captures
    device.clear()
    r.run("decode", q, cache, q_lens, kv_lens, table)
    pad = 4 * (bucket - batch)
    parts = [(q.data.ptr, r.q.data.ptr, batch * 32 * 128 * 2, 1, 0, 0, 0, 0),
             (q_lens.data.ptr, buffers.q_lens.data.ptr, 4 * batch, 1, 0, 0, pad, 0),
             (kv_lens.data.ptr, buffers.kv_lens.data.ptr, 4 * batch, 1, 0, 0, pad, 0),
             (table.data.ptr, buffers.page_table.data.ptr, 4 * columns, batch, 4 * columns, 4 * 256, 4 * 56, -1)]
    assert [c[0] for c in device] == ["stage", "graph"]
    assert sorted(device[0][1]) == sorted(parts)
    assert device[0][2] == (max(1, -(-batch * 8192 // (16 << 10))), 1, 1)
    replayed = device[0]
    device.clear()
    r.run("decode", q, cache, q_lens, kv_lens, table, use_graph=False)
    assert device[0] == replayed and device[1] == ("launch", "shared/plan.cu")
    assert not [c for c in device if c[0].startswith("mem") or c[0] == "graph"]


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_host_step_is_one_host_copy_one_device_copy_and_the_graph(device, batch):
    """A replay with host (NumPy) lengths: the lengths and table in one copy from a host mirror
    (pinned, its event recorded after, where the copy is PINNED_FROM_BYTES or more), q in one
    device copy, the graph; with sinks, q and sinks in one staging launch instead."""
    import cupy

    r = runner()
    q, cache, lens = step_inputs(batch, "host")
    r.run("decode", q, cache, *lens)
    device.clear()
    r.run("decode", q, cache, *lens)
    runtime = cupy.cuda.runtime
    buffers = r.attn.plan_buffers
    words = 2 * 64 + batch * 256
    pinned = 4 * words >= _staging.PINNED_FROM_BYTES  # (batch 64: 66 KiB; 1 and 8: under 9 KiB)
    assert pinned == (batch == 64)
    mirror = buffers.mirrors.pinned[1] if pinned else buffers.mirrors.pageable  # (pinned ones in turn)
    assert device == ([("memcpyAsync", (buffers.inputs.data.ptr, mirror.ptr, 4 * words, runtime.memcpyHostToDevice, 7))]
                      + ([("eventRecord", (mirror.event.ptr, 7))] if pinned else [])
                      + [("memcpyAsync", (r.q.data.ptr, q.data.ptr, batch * 8192, runtime.memcpyDeviceToDevice, 7)),
                         ("graph", None)])
    sinks = FakeArray((32,), np.float32)
    r.run("decode", q, cache, *lens, sinks=sinks)
    device.clear()
    r.run("decode", q, cache, *lens, sinks=sinks)
    assert [c[0] for c in device] == ["memcpyAsync"] + ["eventRecord"] * pinned + ["stage", "graph"]
    assert device[1 + pinned][1] == [(q.data.ptr, r.q.data.ptr, batch * 8192, 1, 0, 0, 0, 0),
                            (sinks.data.ptr, r.sinks.data.ptr, 128, 1, 0, 0, 0, 0)]


@pytest.mark.parametrize("lengths", ["device", "host"])
def test_bad_input_raises_before_any_device_call(device, lengths):
    """Each bad argument raises naming it, and nothing reached the driver: no copy, no launch."""
    r = runner()
    q, cache, (q_lens, kv_lens, table) = step_inputs(8, lengths)
    r.run("decode", q, cache, q_lens, kv_lens, table)
    bf16 = _arrays.DTYPES["bfloat16"]
    wide = FakeArray((8, 300), np.int32) if lengths == "device" else np.zeros((8, 300), np.int32)
    cases = [
        (dict(q=FakeArray((8, 32, 128), np.float16)), TypeError, "q"),
        (dict(q=FakeArray((8, 32, 64), bf16)), ValueError, "q"),
        (dict(page_table=wide), ValueError, "page_table"),
        (dict(q=FakeArray((9, 32, 128), bf16)), ValueError, "q has 9 tokens"),
        (dict(sinks=FakeArray((16,), np.float32)), ValueError, "sinks"),
        (dict(kv_lens=kv_lens[:4]), ValueError, "kv_lens"),
    ]
    if lengths == "host":
        cases.append((dict(kv_lens=np.zeros(8, np.int32)), ValueError, r"q_lens\[0\] = 1 > kv_lens\[0\]"))
        bad = table.copy()
        bad[3, 0] = 64 * 256
        cases.append((dict(page_table=bad), ValueError, r"page_table\[3, 0\]"))
    for change, error, match in cases:
        args = dict(q=q, q_lens=q_lens, kv_lens=kv_lens, page_table=table)
        args.update(change)
        device.clear()
        for use_graph in (True, False):
            with pytest.raises(error, match=match):
                r.run("decode", args["q"], cache, args["q_lens"], args["kv_lens"], args["page_table"],
                      use_graph=use_graph, sinks=args.get("sinks"))
        assert device == [], change


def test_stage_params_writer_is_a_full_fill():
    """copy_parts' struct writer: the bytes NumPy's assignment of the same parts gives (pointers above
    4 GiB, 64-bit sizes); a lone plain part is a memcpy, not a launch."""
    buffers = types.SimpleNamespace(stage_launch=None, staged_parts=None, device_id=0)
    seen = []
    parts = [(1 << 44, (1 << 45) + 2, (1 << 33) + 6, 1, 0, 0, 0, 0),
             ((1 << 41) + 4, 1 << 42, 800, 64, 800, 1024, 224, -1),
             ((1 << 40) + 1, (1 << 40) + 3, 3, 1, 0, 0, 0, 0)]
    original = _build.launch_packed
    try:
        _build.launch_packed = lambda launch, stream: seen.append(bytes(launch.raw))  # (a copy skips padding)
        _staging.copy_parts(buffers, parts, 5)
        grid = buffers.stage_launch._grid3
        _staging.copy_parts(buffers, list(parts), 5)  # the same parts again: launched, the bytes as they are
        changed = [parts[0], parts[1][:3] + (32,) + parts[1][4:]]  # fewer parts, another row count
        _staging.copy_parts(buffers, changed, 5)
    finally:
        _build.launch_packed = original

    def struct_of(parts):
        want = np.zeros(1, _staging._STAGE)
        want[0]["count"] = len(parts)
        for i, fields in enumerate(parts):
            want[0]["copies"][i] = fields
        return want

    assert len(seen) == 3
    assert seen[0] == seen[1] == struct_of(parts).tobytes()
    assert grid == (_staging.STAGE_CTAS, 1, 1)  # 8 GiB: the largest grid
    # repacked: the count and the changed part (the third slot keeps its old bytes: the count bounds it)
    got = np.frombuffer(seen[2], _staging._STAGE)[0]
    assert got["count"] == 2 and got["copies"][1].tolist() == struct_of(changed)[0]["copies"][1].tolist()
    assert buffers.stage_launch._grid3 == (_staging.STAGE_CTAS, 1, 1)


def test_eager_steps_keep_their_plan_until_another_plan(device):
    """An eager step staged as the last plan was (the same bucket and mode, stream, knobs) launches
    the plan kernel again and keeps that plan (its PlanState, prepared launches and schedule); a step
    of another bucket, or other knobs, plans afresh. The driver sees the same launches either way."""
    from cupy_fa import knobs

    r = runner()
    q8, cache, lens8 = step_inputs(8, "device")
    q1, _, lens1 = step_inputs(1, "device")
    device.clear()
    r.run("decode", q8, cache, *lens8, use_graph=False)
    first, launches = r.attn.planned, list(device)
    assert ("launch", "shared/plan.cu") in launches
    device.clear()
    r.run("decode", q8, cache, *lens8, use_graph=False)
    assert r.attn.planned is first and device == launches  # kept: the plan kernel again, then the same run
    r.run("decode", q1, cache, *lens1, use_graph=False)  # bucket 1: another staged step, a new plan
    assert r.attn.planned is not first
    device.clear()
    r.run("decode", q8, cache, *lens8, use_graph=False)  # the last plan was bucket 1's: planned afresh
    again = r.attn.planned
    assert again is not first and device == launches
    before = knobs.knobs()
    try:
        knobs.use(knobs.Knobs())  # other knobs (equal values, another object): planned afresh
        r.run("decode", q8, cache, *lens8, use_graph=False)
        assert r.attn.planned is not again
    finally:
        knobs.use(before)
