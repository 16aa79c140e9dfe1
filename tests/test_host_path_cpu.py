"""The host path of plan / run / GraphRunner without a GPU: what each keeps from one call to the
next is what a fresh computation gives. The packed-field writers against whole-struct fills
(pointers above 4 GiB included); the plan kernel's struct, rewritten in place step after step,
against a full fill; memoised schedules against fresh ones over random batches; the bytes and
layout one staging copies over (a fake runtime records them); a prepared step shared between plans
of one shape only; a View's one-comparison check against check_device_array's."""

import itertools
import types
import warnings

import numpy as np
import pytest

from cupy_fa import _arrays, _build, _memo, _params, _staging, _views, catalog, knobs, plan, schedule
from cupy_fa.families.common import SMEM_LIMIT

H200 = dict(smem_limit=SMEM_LIMIT, sm_count=132, arch="sm_90a")


# ---- the packed-field writers ----------------------------------------------------------------


def fields(record):
    """Every field of a packed struct by name (its padding bytes are no field: NumPy leaves them as
    they come)."""
    record = record[0] if record.shape else record
    return tuple((name, record[name].item()) for name in record.dtype.names)


@pytest.mark.parametrize("name", sorted(n for n in _params.DTYPES if not n.startswith("Stage")))  # (scalar fields)
def test_field_setter_writes_what_a_full_fill_gives(name):
    """Any subset of a struct's fields, in its order, written into a packed struct: the bytes a
    full fill with those values gives (8-byte pointers above 4 GiB, int32s, floats)."""
    dtype = _params.DTYPES[name]
    rng = np.random.default_rng(7)

    def value(field):
        kind = dtype.fields[field][0].kind
        if kind == "f":
            return float(np.float32(rng.normal()))
        if dtype.fields[field][0].itemsize == 8:
            return int(rng.integers(1 << 40, 1 << 48))
        return int(rng.integers(-1000, 1000)) if kind == "i" else int(rng.integers(0, 1 << 31))

    names = list(dtype.names)
    for subset in (names, names[::2], names[1:4], names[-3:]):
        before = {f: value(f) for f in names}
        packed = np.array([_params.make(name, **before)], dtype)
        after = dict(before, **{f: value(f) for f in subset})
        _params.field_setter(name, subset)(packed.data.cast("B"), [after[f] for f in subset])
        assert fields(packed) == fields(np.array([_params.make(name, **after)], dtype)), subset


# ---- the plan kernel's struct ----------------------------------------------------------------


class _Buf:
    _next = [1 << 40]

    def __init__(self, shape=(1,)):
        self.shape = shape
        self.data = types.SimpleNamespace(ptr=_Buf._next[0])
        _Buf._next[0] += 1 << 20


def fake_buffers(batch=64, pages=300, rows=4096):
    buffers = plan.PlanBuffers.__new__(plan.PlanBuffers)
    for name in ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "num_splits", "split_keys",
                 "partial_indptr", "mask_indptr", "status", "key_base", "custom_mask", "partial_lse"):
        setattr(buffers, name, _Buf())
    buffers.partial_out, buffers.page_table = _Buf((rows, 32, 128)), _Buf((batch, pages))
    buffers.capacity, buffers.device_id = plan.Capacity(batch, batch * 16, pages), 0
    buffers._plan_launch = buffers._plan_tiles = None
    return buffers


def test_plan_struct_rewritten_in_place_is_the_full_fill(monkeypatch):
    """Step after step (other tiles, both families, windows, bounds), the plan kernel's packed struct
    holds exactly PlanBuffers.plan_params' fields for that step; knobs in force change its constants."""
    buffers = fake_buffers()
    steps = []
    for q, kv, window in (([1] * 64, [4096] * 64, 0), ([1, 2048, 4], [4096, 4096, 300], 0), ([4096], [4096], 0),
                          ([4] * 8, [9000] * 8, 700), ([1], [131072], 0)):
        sched = schedule.schedule_step(128, 4, 8, q_lens=q, kv_lens=kv, window=window, **H200)
        tile, long_tile = sched.plan_tiles()
        steps.append((len(q), tile, long_tile, max(q), max(kv), window))
    for batch, tile, long_tile, max_q, max_kv, window in steps + steps[::-1]:
        launch = buffers.plan_launch(batch, 4, tile, long_tile, max_q, max_kv, window)
        assert launch.kernel == catalog.PLAN_KERNEL and launch.grid == (1,)
        want = buffers.plan_params(batch, 4, tile, long_tile, max_q, max_kv, window)
        assert fields(launch.packed) == fields(np.array([want]))
    monkeypatch.setenv("CUPY_FA_SPLIT_SIZE", "1024")
    knobs.reload()
    batch, tile, long_tile, max_q, max_kv, window = steps[0]
    launch = buffers.plan_launch(batch, 4, tile, long_tile, max_q, max_kv, window)
    assert launch.packed[0]["split_size"] == 1024
    assert fields(launch.packed) == fields(np.array([buffers.plan_params(batch, 4, tile, long_tile, max_q, max_kv,
                                                                         window)]))


# ---- memoised schedules ----------------------------------------------------------------------


@pytest.mark.parametrize("kv_bytes,window", [(2, 0), (2, 1000), (1, 0)])
def test_memoised_schedules_are_fresh_ones(kv_bytes, window):
    """Over random batches (decode, verify, prefill, mixed; lengths moved within and across split
    boundaries), each memoised schedule equals schedule.schedule_step's, and a batch whose lengths
    moved within their splits hits the memo."""
    rng = np.random.default_rng(11 + kv_bytes + window)
    memo = _memo.ScheduleMemo(128, 4, 8, kv_bytes)
    split = schedule.split_size(kv_bytes)
    for trial in range(60):
        b = int(rng.integers(1, 40))
        q = rng.choice([1, 1, 4, 8, 16, 17, 300, 2048], size=b).astype(np.int64)
        kv = (q + rng.integers(0, 20000, size=b)).astype(np.int64)
        for moved in (kv, kv + (split - 1 - (kv - 1) % split) * (kv % split != 0), kv + 1, kv + split):
            moved = np.maximum(moved, q)
            fresh = schedule.schedule_step(128, 4, 8, q_lens=q, kv_lens=moved, kv_bytes=kv_bytes, window=window,
                                           **H200)
            assert memo.step(q, moved, window=window, **H200) == fresh, (q, moved)
    hits = memo.hits
    q, kv = np.ones(8, np.int64), np.full(8, 3 * split + 5, np.int64)
    memo.step(q, kv, window=window, **H200)
    memo.step(q, kv + 1, window=window, **H200)  # one more token in the same split: the same schedule
    assert memo.hits == hits + 1


def test_memoised_device_length_schedules():
    memo = _memo.ScheduleMemo(128, 4, 8, 2)
    cap = plan.Capacity(64, 512, 256)
    for max_q, max_kv, batch in itertools.product((1, 8, 300), (4096, None), (1, 64)):
        fresh = schedule.schedule_step(128, 4, 8, max_q_len=max_q, max_kv_len=max_kv, capacity=cap, batch_size=batch,
                                       **H200)
        assert memo.step(max_q_len=max_q, max_kv_len=max_kv, capacity=cap, batch_size=batch, **H200) == fresh
        assert memo.step(max_q_len=max_q, max_kv_len=max_kv, capacity=cap, batch_size=batch, **H200) is not None


# ---- staging: what one copy carries -------------------------------------------------------------


class FakeEvent:
    """An event whose completion the test sets (``done``), at its own fake address."""
    _next = [1000]

    def __init__(self, *a, **k):
        self.ptr = FakeEvent._next[0] = FakeEvent._next[0] + 1
        self.done = True


class FakeDevice:
    """Device memory at fake addresses, and a runtime whose copies and memsets move real bytes in
    it (host sources read at their NumPy address), so a test reads back what staging wrote."""

    def __init__(self, monkeypatch):
        import cupy

        self.memory, self.calls, self.sources = {}, [], []
        runtime = cupy.cuda.runtime
        monkeypatch.setattr(runtime, "memcpyAsync", self.memcpy)
        monkeypatch.setattr(runtime, "eventRecord", lambda event, stream: self.calls.append(("record", event)))
        monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", bytearray)
        monkeypatch.setattr(cupy.cuda, "Event", FakeEvent)
        monkeypatch.setattr(runtime, "memsetAsync", self.memset)
        monkeypatch.setattr(runtime, "memcpy2DAsync", self.memcpy2d)
        monkeypatch.setattr(_build, "memset_d2d32", self.memset_d2d32)
        monkeypatch.setattr(_build, "launch_packed", self.stage)

    def array(self, shape, dtype=np.int32):
        host = np.zeros(shape, dtype)
        ptr = host.__array_interface__["data"][0]
        self.memory[ptr] = host
        view = types.SimpleNamespace(shape=host.shape, dtype=host.dtype, host=host, nbytes=host.nbytes,
                                     data=types.SimpleNamespace(ptr=ptr, device_id=0),
                                     flags=types.SimpleNamespace(c_contiguous=True))
        return view

    def _bytes(self, ptr, size):
        import ctypes

        return (ctypes.c_char * size).from_address(ptr)

    def memcpy(self, dst, src, size, kind, stream):
        self.calls.append(("memcpy", kind, size))
        self.sources.append(src)
        self._bytes(dst, size)[:] = bytes(self._bytes(src, size))

    def memset(self, ptr, value, size, stream):
        self.calls.append(("memset", size))
        self._bytes(ptr, size)[:] = bytes([value]) * size

    def memcpy2d(self, dst, dpitch, src, spitch, width, height, kind, stream):
        self.calls.append(("memcpy2d", width, height))
        for row in range(height):
            self._bytes(dst + row * dpitch, width)[:] = bytes(self._bytes(src + row * spitch, width))

    def stage(self, launch, stream_ptr):
        """kernels/shared/stage.cu on the host: each part's rows, then its fill words after each row."""
        assert launch.kernel == catalog.STAGE_KERNEL
        record = launch.packed[0]
        parts = [c.item() for c in record["copies"][:record["count"]]]
        self.calls.append(("stage", len(parts)))
        for src, dst, nbytes, rows, src_pitch, dst_pitch, fill_bytes, fill in parts:
            for row in range(rows):
                self._bytes(dst + row * dst_pitch, nbytes)[:] = bytes(self._bytes(src + row * src_pitch, nbytes))
                if fill_bytes:
                    np.frombuffer(self._bytes(dst + row * dst_pitch + nbytes, fill_bytes), np.int32)[:] = fill

    def memset_d2d32(self, ptr, pitch, value, width, height, stream_ptr):
        self.calls.append(("memset2d", width, height))
        for row in range(height):
            np.frombuffer(self._bytes(ptr + row * pitch, 4 * width), np.int32)[:] = value


def staged_buffers(device, batch, pages):
    """PlanBuffers' staging parts over fake device memory: q_lens, kv_lens and the page table in one
    array, as PlanBuffers lays them out, and the host mirror."""
    buffers = plan.PlanBuffers.__new__(plan.PlanBuffers)
    inputs = device.array(2 * batch + batch * pages)
    base = inputs.data.ptr

    def part(offset, shape):
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=base + 4 * offset), shape=shape)

    buffers.inputs, buffers.lengths = inputs, part(0, (2 * batch,))
    buffers.q_lens, buffers.kv_lens = part(0, (batch,)), part(batch, (batch,))
    buffers.page_table = part(2 * batch, (batch, pages))
    buffers.capacity = plan.Capacity(batch, 16 * batch, pages)
    buffers.mirrors = plan.HostMirrors(2 * batch + batch * pages)
    buffers.custom_mask = None
    buffers.stage_launch, buffers.staged_parts, buffers.device_id = None, None, 0
    return buffers


def lengths_of(buffers):
    b = buffers.capacity.max_batch_size
    return buffers.inputs.host[:2 * b]


def table_of(buffers):
    b = buffers.capacity.max_batch_size
    return buffers.inputs.host[2 * b:]


def test_host_step_staged_in_one_copy(monkeypatch):
    """A host step: q_lens (zeros past the batch, also after a larger batch), kv_lens and the page
    table in one copy; the table dense (rows page_columns apart) for an eager plan, at the buffers'
    width with -1 past the caller's columns for a graph step (padding rows q_len = kv_len = 0); a
    table over MIRRORED_TABLE_BYTES in a second copy, straight from the caller's array."""
    device = FakeDevice(monkeypatch)
    monkeypatch.setattr(_staging, "PINNED_FROM_BYTES", 0)  # every copy from the pinned mirrors
    buffers = staged_buffers(device, 8, 6)
    stream = types.SimpleNamespace(ptr=5)
    for i, (q, kv, table) in enumerate((([1, 3, 2, 1, 1], [10, 30, 20, 5, 7], np.arange(20).reshape(5, 4)),
                                        ([2, 1], [9, 40], np.arange(6, dtype=np.int32).reshape(2, 3)))):
        device.calls.clear()
        device.sources.clear()
        step = plan.check_step(np.array(q), np.array(kv), table)
        stride = plan.stage_inputs(buffers, step, stream=stream)
        lengths = lengths_of(buffers)
        assert lengths[:8].tolist() == q + [0] * (8 - len(q)) and lengths[8:8 + len(kv)].tolist() == kv
        assert stride == table.shape[1] and table_of(buffers)[:table.size].tolist() == table.ravel().tolist()
        mirror = buffers.mirrors.pinned[i]  # (the pinned mirrors in turn, each copy followed by its event)
        assert device.calls == [("memcpy", 1, 4 * (16 + table.size)), ("record", mirror.event.ptr)]  # (1: to device)
        assert device.sources == [mirror.ptr]
    table_of(buffers)[:] = 99
    step = plan.check_step(np.array([1, 1]), np.array([3, 4]), np.array([[5, 6], [7, 8]]))
    device.calls.clear()
    stride = plan.stage_inputs(buffers, step, pad_to=4, stream=stream)
    lengths = lengths_of(buffers)
    assert stride == 6 and lengths[:8].tolist() == [1, 1, 0, 0, 0, 0, 0, 0] and lengths[8:12].tolist() == [3, 4, 0, 0]
    assert table_of(buffers)[:12].reshape(2, 6).tolist() == [[5, 6, -1, -1, -1, -1], [7, 8, -1, -1, -1, -1]]
    assert [c[0] for c in device.calls] == ["memcpy", "record"]
    monkeypatch.setattr(_staging, "MIRRORED_TABLE_BYTES", 16)
    device.calls.clear()
    table = np.arange(12, dtype=np.int64).reshape(3, 4) + 40
    stride = plan.stage_inputs(buffers, plan.check_step(np.array([1, 1, 1]), np.array([5, 5, 5]), table), stream=stream)
    assert stride == 4 and table_of(buffers)[:12].tolist() == list(range(40, 52))
    assert [c[:3:2] if c[0] == "memcpy" else c[0] for c in device.calls] == [("memcpy", 4 * 16), "record",
                                                                             ("memcpy", 4 * 12)]


def test_host_mirrors_taken_in_turn_never_waited_on(monkeypatch):
    """A pinned mirror is written again only once the event after its last copy has passed: with
    both busy a step goes from the pageable mirror (no event, no wait); a step inside a capture,
    larger than PINNED_MIRROR_BYTES or smaller than PINNED_FROM_BYTES always does. Each mirror
    zeroes the lengths past the batch it last held, so every copy carries the whole capacity's
    lengths right."""
    device = FakeDevice(monkeypatch)
    monkeypatch.setattr(_staging, "PINNED_MIRROR_BYTES", 4 * (16 + 8))  # the lengths and 8 table entries
    monkeypatch.setattr(_staging, "PINNED_FROM_BYTES", 4 * (16 + 2))    # the lengths and 2 table entries
    buffers = staged_buffers(device, 8, 6)
    stream = types.SimpleNamespace(ptr=5)
    mirrors = buffers.mirrors

    def stage(batch, columns=1, capturing=False):
        device.calls.clear()
        device.sources.clear()
        q, kv = np.arange(1, batch + 1), np.arange(1, batch + 1) * 16
        table = np.arange(batch * columns).reshape(batch, columns)
        plan.stage_inputs(buffers, plan.check_step(q, kv, table), stream=stream, capturing=capturing)
        lengths = lengths_of(buffers)
        assert lengths[:8].tolist() == q.tolist() + [0] * (8 - batch)
        assert lengths[8:].tolist() == kv.tolist() + [0] * (8 - batch)
        assert table_of(buffers)[:table.size].tolist() == table.ravel().tolist()
        return device.sources[0], [c[0] for c in device.calls]

    assert stage(1) == (mirrors.pageable.ptr, ["memcpy"])  # 1 table entry: below the pinned floor
    assert stage(6) == (mirrors.pinned[0].ptr, ["memcpy", "record"])
    mirrors.pinned[0].event.done = False  # its copy still queued
    assert stage(5) == (mirrors.pinned[1].ptr, ["memcpy", "record"])
    mirrors.pinned[1].event.done = False
    assert stage(3) == (mirrors.pageable.ptr, ["memcpy"])  # both busy: the pageable copy, no wait
    mirrors.pinned[0].event.done = True
    assert stage(2) == (mirrors.pinned[0].ptr, ["memcpy", "record"])  # (its lengths past 2 zeroed: it held 6)
    mirrors.pinned[1].event.done = True
    assert stage(4) == (mirrors.pinned[1].ptr, ["memcpy", "record"])
    assert stage(1, capturing=True) == (mirrors.pageable.ptr, ["memcpy"])  # a capture reads no pinned mirror
    assert stage(3, columns=3) == (mirrors.pageable.ptr, ["memcpy"])  # 9 table entries: past the pinned size
    assert stage(7) == (mirrors.pinned[0].ptr, ["memcpy", "record"])


def test_pinned_mirror_released_only_after_its_last_copy(monkeypatch):
    """A pinned mirror whose owner is dropped (an instance gone right after a plan) is kept, with no
    CUDA call from the finalizer, until the copy last queued from it has passed: only then does its
    memory go back to CuPy's pinned pool (which may hand it to a new mirror at once)."""
    import gc

    device = FakeDevice(monkeypatch)
    monkeypatch.setattr(_staging, "PINNED_FROM_BYTES", 0)
    monkeypatch.setattr(_staging, "_RETIRED", [])
    buffers = staged_buffers(device, 8, 6)
    step = plan.check_step(np.array([1, 2]), np.array([5, 9]), np.arange(4).reshape(2, 2))
    plan.stage_inputs(buffers, step, stream=types.SimpleNamespace(ptr=5))
    used, spare = buffers.mirrors.pinned
    assert device.sources == [used.ptr]
    used.event.done = False  # its copy still queued
    memory, event = used._memory, used.event
    del used, spare, buffers
    gc.collect()
    assert len(_staging._RETIRED) == 2 and any(m is memory for m, _ in _staging._RETIRED)  # both kept
    other = staged_buffers(device, 8, 6)
    plan.stage_inputs(other, step, stream=types.SimpleNamespace(ptr=5))  # any later step lets go of passed ones
    assert [e for _, e in _staging._RETIRED] == [event]
    event.done = True
    plan.stage_inputs(other, step, stream=types.SimpleNamespace(ptr=5))
    assert _staging._RETIRED == []


def test_host_mirrors_without_pinned_memory(monkeypatch):
    """Where pinned memory cannot be had, one warning and every step from the pageable mirror."""
    import cupy

    device = FakeDevice(monkeypatch)
    monkeypatch.setattr(_staging, "PINNED_FROM_BYTES", 0)

    def refuse(nbytes):
        raise cupy.cuda.memory.OutOfMemoryError(nbytes, 0, 0)

    monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", refuse)
    buffers = staged_buffers(device, 8, 6)
    step = plan.check_step(np.array([1, 2]), np.array([5, 9]), np.arange(4).reshape(2, 2))
    with pytest.warns(RuntimeWarning, match="no pinned host memory"):
        plan.stage_inputs(buffers, step, stream=types.SimpleNamespace(ptr=5))
    assert buffers.mirrors.pinned == [] and device.sources == [buffers.mirrors.pageable.ptr]
    device.sources.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan.stage_inputs(buffers, step, stream=types.SimpleNamespace(ptr=5))
    assert not caught  # one warning, at the first step
    assert device.sources == [buffers.mirrors.pageable.ptr] and lengths_of(buffers)[:2].tolist() == [1, 2]


def test_device_step_staged_device_to_device(monkeypatch):
    """A device step: its lengths (zeros for a graph bucket's padding rows), its page-table rows (-1
    past the caller's columns, a row-strided table as it is) and the caller's extra parts (q at an
    odd address) in one staging launch, the bytes the memcpys and memsets they replace wrote; a
    lone plain part is one memcpy."""
    device = FakeDevice(monkeypatch)
    buffers = staged_buffers(device, 8, 6)
    stream = types.SimpleNamespace(ptr=5)
    q, kv, table = device.array(3), device.array(3), device.array((3, 4))
    q.host[:], kv.host[:], table.host[:] = [1, 2, 1], [7, 8, 9], np.arange(12).reshape(3, 4)
    source, target = device.array(40, np.uint8), device.array(40, np.uint8)
    source.host[:] = np.arange(40)
    extra = [_staging.part(source.data.ptr + 3, target.data.ptr + 1, 29)]
    lengths_of(buffers)[:] = 77
    step = plan.StepInputs(3, None, q, None, kv, None, table, None, None, None, 2, 12, stream)
    stride = plan.stage_inputs(buffers, step, pad_to=4, stream=stream, extra=extra)  # a graph step: width 6
    lengths = lengths_of(buffers)
    assert stride == 6 and lengths[:4].tolist() == [1, 2, 1, 0] and lengths[8:12].tolist() == [7, 8, 9, 0]
    assert table_of(buffers)[:18].reshape(3, 6).tolist() == [[4 * r + c for c in range(4)] + [-1, -1]
                                                               for r in range(3)]
    assert target.host.tolist() == [0] + list(range(3, 32)) + [0] * 10
    assert device.calls == [("stage", 4)]
    device.calls.clear()
    stride = plan.stage_inputs(buffers, step, stream=stream)  # an eager plan: dense
    assert stride == 4 and table_of(buffers)[:12].tolist() == list(range(12))
    assert device.calls == [("stage", 3)]
    wide = device.array((3, 8))
    wide.host[:] = np.arange(24).reshape(3, 8) + 100
    rows = types.SimpleNamespace(shape=(3, 4), dtype=wide.dtype, strides=(32, 4), ndim=2, data=wide.data,
                                 flags=types.SimpleNamespace(c_contiguous=False))
    step = plan.StepInputs(3, None, q, None, kv, None, rows, None, None, None, 2, 12, stream)
    device.calls.clear()
    plan.stage_inputs(buffers, step, pad_to=3, stream=stream)
    assert table_of(buffers)[:18].reshape(3, 6).tolist() == [[100 + 8 * r + c for c in range(4)] + [-1, -1]
                                                               for r in range(3)]
    assert device.calls == [("stage", 3)]
    device.calls.clear()
    _staging.copy_parts(buffers, extra, 5)
    assert device.calls == [("memcpy", 3, 29)]


# ---- views ---------------------------------------------------------------------------------------


def test_view_fits_exactly_when_check_device_array_passes():
    """View.fits is the conjunction of check_device_array's checks (dtype, shape, contiguity,
    alignment, device): over every combination, fits is True iff the full check raises nothing."""
    bf16 = _arrays.DTYPES["bfloat16"]
    want = (4, 8, 128)
    cases = itertools.product((bf16, np.dtype(np.float16)), (want, (5, 8, 128), (4, 8)), (True, False),
                              (1 << 20, (1 << 20) + 8, (1 << 20) + 2), (0, 1))
    for dtype, shape, contiguous, ptr, device in cases:
        view = _views.View(None, ptr, shape, dtype, device, contiguous, _views.CUPY)
        try:
            _arrays.check_device_array(view, "q", dtype="bfloat16", ndim=3, shape=want, device_id=0, align=16)
            passed = True
        except (TypeError, ValueError):
            passed = False
        assert view.fits(bf16, want, 0, 16) == passed, (dtype, shape, contiguous, ptr, device)


def test_views_refuse_host_arrays_as_before():
    with pytest.raises(TypeError, match="q must be a CUDA device array"):
        _views.view(np.zeros((2, 8, 64), np.float16), "q")
    with pytest.raises(TypeError, match="out must be a CUDA device array"):
        _views.view([1, 2], "out")


# ---- the launch itself: what the driver is handed ----------------------------------------------


def test_packed_launch_hands_the_driver_the_struct_in_place(monkeypatch):
    """cuLaunchKernel gets the kernel's function, grid, block, shared memory, the stream and a
    one-entry parameter array pointing at the packed struct's current bytes (so a field written
    between launches is what the next launch passes); a programmatic launch passes the same
    through cuLaunchKernelEx with its stream in the prebuilt config, and an ordinary one where
    CUPY_FA_PDL=0."""
    import ctypes

    kernel = catalog.merge_kernel("bfloat16", 128, (8, 1))
    monkeypatch.setattr(_build, "get_function", lambda k, device_id=None: types.SimpleNamespace(
        kernel=types.SimpleNamespace(ptr=0xF00D)))
    monkeypatch.setattr(_build, "_programmatic_launch_supported", lambda arch: True)
    monkeypatch.setattr(_build, "_native_arch", lambda device_id: "sm_90a")
    seen = []

    def struct_at(params_address):  # what the driver reads: params[0] points at the struct's bytes
        pointer = ctypes.cast(params_address, ctypes.POINTER(ctypes.c_void_p))[0]
        return ctypes.string_at(pointer, _params.DTYPES["MergeParams"].itemsize)

    monkeypatch.setattr(_build, "_launch_kernel", lambda: lambda fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra:
                        seen.append(("plain", fn, (gx, gy, gz), (bx, by, bz), smem, stream, struct_at(params))))

    def launch_ex(config_ptr, fn, params, extra):
        config = config_ptr.contents
        seen.append(("ex", fn, tuple(config.grid), tuple(config.block), config.shared_mem_bytes, config.stream,
                     struct_at(ctypes.addressof(params)), config.attrs[0].id, config.attrs[0].value[0]))
        return 0

    monkeypatch.setattr(_build, "_driver", lambda: launch_ex)
    packed = np.array([_params.make("MergeParams", **{f: 0 for f in _params.DTYPES["MergeParams"].names})],
                      _params.DTYPES["MergeParams"])
    plain = _build.PackedLaunch(kernel, (5, 2), packed, 0)
    pdl = _build.PackedLaunch(kernel, (7,), packed, 0, programmatic=True)
    write = _params.field_setter("MergeParams", ("out",))
    for out, stream in ((1 << 41, 11), (1 << 42, 12)):
        write(plain.raw, (out,))
        _build.launch_packed(plain, stream)
        _build.launch_packed(pdl, stream)
        assert packed[0]["out"] == out
        assert seen[-2] == ("plain", 0xF00D, (5, 2, 1), (kernel.threads, 1, 1), kernel.smem_bytes, stream,
                            packed.tobytes())
        assert seen[-1] == ("ex", 0xF00D, (7, 1, 1), (kernel.threads, 1, 1), kernel.smem_bytes, stream,
                            packed.tobytes(), _build._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    monkeypatch.setenv("CUPY_FA_PDL", "0")
    knobs.reload()
    _build.launch_packed(pdl, 13)
    assert seen[-1][0] == "plain" and seen[-1][5] == 13
