"""What BatchAttention and MLAAttention share as instances (cupy_fa/_instance.py), no GPU: the
capacity arguments, buffers grown by eager plans and refused past a fixed capacity or inside a
capture, a plan ordered after the streams of the plan before it, a run after its own plan (events,
no sync), one call at a time, and the status read after syncing every stream a plan ran on."""

import threading
import types

import pytest

from cupy_fa import _instance, plan, status
from cupy_fa.attention import BatchAttention
from cupy_fa.mla.attention import MLAAttention


class Stream:
    """A stream as the instances use one: its pointer, events, waits, syncs, a capture flag."""

    def __init__(self, ptr, log, capturing=False):
        self.ptr, self.log, self.capturing = ptr, log, capturing

    def is_capturing(self):
        return self.capturing

    def record(self):
        self.log.append(("record", self.ptr))
        return ("event", self.ptr)

    def wait_event(self, event):
        self.log.append(("wait", self.ptr, event))

    def synchronize(self):
        self.log.append(("sync", self.ptr))

    def __enter__(self):
        self.log.append(("enter", self.ptr))
        return self

    def __exit__(self, *exc):
        self.log.append(("exit", self.ptr))


class Instance(_instance.PlannedInstance):
    _NAME = "Probe"

    def __init__(self, capacity=None):
        self.made = []
        self._bind_without_device(capacity)

    def _bind_without_device(self, capacity):  # _bind's state, the device left out (none here)
        self.device_id = 0
        self._fixed_capacity = capacity is not None
        self._buffers = self._new_buffers(capacity) if capacity is not None else None
        self._retired, self._plan = [], None
        self._busy, self._busy_with = threading.Lock(), None

    def _new_buffers(self, capacity):
        self.made.append(capacity)
        return types.SimpleNamespace(capacity=capacity, status="status word")


def test_both_apis_are_planned_instances_named_in_their_messages():
    assert issubclass(BatchAttention, _instance.PlannedInstance) and BatchAttention._NAME == "BatchAttention"
    assert issubclass(MLAAttention, _instance.PlannedInstance) and MLAAttention._NAME == "MLAAttention"


def test_capacity_arguments():
    assert _instance.checked_capacity(None, None, None, 0) is None
    assert _instance.checked_capacity(4, 64, 8, 16) == plan.Capacity(4, 64, 8, 16)
    with pytest.raises(ValueError, match="give all of max_batch_size"):
        _instance.checked_capacity(4, None, 8, 0)
    with pytest.raises(ValueError, match="max_num_tokens must be an int >= 1"):
        _instance.checked_capacity(4, 0, 8, 0)
    with pytest.raises(ValueError, match="max_mask_bytes must be an int >= 0"):
        _instance.checked_capacity(None, None, None, -1)


def test_buffers_grow_on_the_plan_stream_and_the_old_ones_stay_alive():
    log = []
    inst, stream = Instance(), Stream(7, log)
    inst._ensure_capacity(2, 10, 3, 0, False, stream)
    first = inst._buffers
    assert first.capacity == plan.Capacity(1, 1, 1, 0).grown_to(2, 10, 3, 0) and log == [("enter", 7), ("exit", 7)]
    inst._ensure_capacity(2, 10, 3, 0, False, stream)  # fits: nothing made
    assert inst._buffers is first and len(inst.made) == 1
    inst._ensure_capacity(2, 30, 3, 0, False, stream)
    assert inst._buffers.capacity == first.capacity.grown_to(2, 30, 3, 0) and inst._retired == [first]
    with pytest.raises(ValueError, match=r"step \(batch 9, tokens 1, page-table columns 1, mask bytes 0\) exceeds "
                                         r"the capacity .* this Probe was built with"):
        inst._ensure_capacity(9, 1, 1, 0, True, stream)  # inside a capture: never allocates
    fixed = Instance(plan.Capacity(2, 8, 2, 0))
    with pytest.raises(ValueError, match="tokens 9, .*exceeds the capacity"):
        fixed._ensure_capacity(1, 9, 1, 0, False, stream)
    assert fixed.made == [plan.Capacity(2, 8, 2, 0)]


def _state(stream, done=("event", "plan")):
    return types.SimpleNamespace(stream=stream, done=done, other_streams={})


def test_a_plan_waits_for_the_streams_of_the_plan_before_it():
    log = []
    inst = Instance()
    s1, s2, s3 = Stream(1, log), Stream(2, log), Stream(3, log)
    inst._order_after_previous(s1, False)  # no plan before: nothing
    inst._plan = _state(s1)
    inst._plan.other_streams[2] = s2  # a run of that plan on stream 2
    inst._order_after_previous(s1, False)
    assert log == [("record", 2), ("wait", 1, ("event", 2))]
    log.clear()
    inst._order_after_previous(s3, False)
    assert log == [("record", 1), ("wait", 3, ("event", 1)), ("record", 2), ("wait", 3, ("event", 2))]
    log.clear()
    inst._order_after_previous(s3, True)  # inside a capture the capturing code orders it
    assert log == []


def test_a_run_on_another_stream_waits_for_its_plan():
    log = []
    inst = Instance()
    s1, s2 = Stream(1, log), Stream(2, log)
    state = _state(s1)
    inst._after_plan(state, s1, False)
    assert log == [] and state.other_streams == {}
    inst._after_plan(state, s2, False)
    assert log == [("wait", 2, ("event", "plan"))] and state.other_streams == {2: s2}
    log.clear()
    inst._after_plan(_state(s1, done=None), s2, False)  # planned inside a capture: no event to wait on
    inst._after_plan(state, Stream(3, log), True)
    assert log == []


def test_one_call_at_a_time_names_both_threads():
    inst = Instance()
    inst._enter("plan")
    caught = []
    worker = threading.Thread(target=lambda: caught.append(pytest.raises(RuntimeError, inst._enter, "run")),
                              name="thread-b")
    worker.start()
    worker.join()
    text = str(caught[0].value)
    assert f"Probe.run() on thread 'thread-b' while thread '{threading.current_thread().name}' is inside plan()" in text
    assert "use one Probe per thread" in text
    inst._leave()
    inst._enter("run")  # free again
    inst._leave()


def test_status_syncs_every_stream_of_the_plan(monkeypatch):
    log = []
    inst = Instance()
    assert inst.status().ok and log == []  # nothing planned: nothing read
    device = types.SimpleNamespace(synchronize=lambda: log.append(("device",)))
    monkeypatch.setattr(Instance, "device_scope", lambda self: _Scope(device))
    monkeypatch.setattr(status, "read", lambda word: (log.append(("read", word)), 0)[1])
    inst._buffers = types.SimpleNamespace(status="status word")
    inst._plan = _state(Stream(1, log))
    inst._plan.other_streams[2] = Stream(2, log)
    inst._plan.other_streams[3] = Stream(3, log, capturing=True)
    inst.status()
    assert log == [("sync", 1), ("sync", 2), ("read", "status word")]
    log.clear()
    inst._plan.done = None  # planned inside a capture: its replays' streams are unknown here
    inst.status()
    assert log[0] == ("device",)


class _Scope:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        return self.device

    def __exit__(self, *exc):
        return False
