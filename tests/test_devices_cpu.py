"""Device binding without a GPU: the compile cache keyed per device id (a fake CuPy device
context and module loader stand in for the driver), device arguments resolved or refused, and the
errors for inputs on another device than the one an instance is bound to. The same binding on
real devices: tests/test_devices_gpu.py (one GPU) and tests/test_multi_gpu.py (two)."""

import contextlib
import types

import numpy as np
import pytest

from cupy_fa import _arrays, _build, _views, plan as _plan

from cupy_fa import _compile
from cupy_fa.attention import BatchAttention
from cupy_fa.graph import GraphRunner
from cupy_fa.launch import check_run


class FakeDevices:
    """CuPy's current device (``cupy.cuda.runtime.getDevice``) and ``cupy.cuda.Device`` contexts,
    without a driver: a thread's current id and the stack the contexts push."""

    def __init__(self, monkeypatch, current=0):
        import cupy

        self.current, self.stack = current, []
        fakes = self

        class Device:
            def __init__(self, device_id=None):
                self.id = fakes.current if device_id is None else device_id

            def __enter__(self):
                fakes.stack.append(fakes.current)
                fakes.current = self.id
                return self

            def __exit__(self, *exc):
                fakes.current = fakes.stack.pop()

        monkeypatch.setattr(cupy.cuda, "Device", Device)
        monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: fakes.current)


class FakeModules:
    """``_compile.binary`` (NVRTC and the disk cache) and ``_build._load_module`` (the driver's module
    load): records the device current at each load and the options of the arch it was built for."""

    def __init__(self, monkeypatch, devices):
        self.made = []
        record = self.made

        class Function:
            max_dynamic_shared_size_bytes = 0

        class Module:
            def __init__(self, cubin):  # the fake cubin: the arch it was built for
                self.device, self.options = devices.current, _compile.compile_options(cubin.decode())
                record.append(self)

            def get_function(self, name):
                fn = Function()
                fn.module = self
                return fn

        monkeypatch.setattr(_compile, "binary", lambda variant, arch: (variant.expression, arch.encode()))
        monkeypatch.setattr(_build, "_load_module", Module)


@pytest.fixture
def fake_cuda(monkeypatch):
    devices = FakeDevices(monkeypatch)
    modules = FakeModules(monkeypatch, devices)
    monkeypatch.setattr(_build, "_functions", {})
    monkeypatch.setattr(_build, "_modules", {})
    # device 0 a Hopper, device 1 an A100: each device's module is compiled for its own arch
    arches = {0: "sm_90a", 1: "sm_80"}
    monkeypatch.setattr(_build, "_native_arch", lambda device_id: arches[device_id])
    monkeypatch.setattr(_compile, "source_hash", lambda: "0" * 16)
    monkeypatch.setattr(_compile, "include_dirs", lambda: ())
    return devices, modules


VARIANT = _compile.Kernel("mma_sync/attention.cu", "cupy_fa::fake_kernel<1>", 128, smem_bytes=100 * 1024)
OTHER = _compile.Kernel("shared/merge.cu", "cupy_fa::fake_merge<2>", 64)


def test_compile_cache_is_per_device(fake_cuda):
    devices, modules = fake_cuda
    devices.current = 0
    on_1 = _build.get_function(VARIANT, 1)   # device 1 while device 0 is current
    on_0 = _build.get_function(VARIANT, 0)
    assert on_0 is not on_1
    assert [m.device for m in modules.made] == [1, 0]  # each compiled and loaded with its device current
    assert devices.current == 0 and not devices.stack  # and the caller's current device is put back
    assert "-arch=sm_80" in modules.made[0].options and "-arch=sm_90a" in modules.made[1].options
    assert on_0.max_dynamic_shared_size_bytes == on_1.max_dynamic_shared_size_bytes == 100 * 1024
    # lookups hit each device's entry; no device falls back to another's module
    assert _build.get_function(VARIANT, 1) is on_1 and _build.get_function(VARIANT, 0) is on_0
    devices.current = 1
    assert _build.get_function(VARIANT) is on_1  # default: the current device
    assert len(modules.made) == 2
    _build.get_function(OTHER)
    assert _build.compiled_kernels(device_id=1) == [VARIANT, OTHER]
    assert _build.compiled_kernels(device_id=0) == [VARIANT]
    assert _build.compiled_kernels("shared/merge.cu", device_id=0) == []
    assert set(_build._modules) == {(0, VARIANT), (1, VARIANT), (1, OTHER)}


def test_device_attributes_and_arch_by_device_id(fake_cuda, monkeypatch):
    devices, _ = fake_cuda
    monkeypatch.setattr(_build, "_device_attribute", lambda device_id, name: {0: 132, 1: 108}[device_id])
    devices.current = 0
    assert _build.device_attribute("MultiProcessorCount", 1) == 108
    assert _build.device_attribute("MultiProcessorCount") == 132
    assert _build.current_arch(1) == "sm_80" and _build.current_arch() == "sm_90a"
    assert _build.device_arch(1) == "sm_80" and _build.device_arch(types.SimpleNamespace(id=0)) == "sm_90a"


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(_arrays, "require_cuda", lambda: None)
    monkeypatch.setattr(_arrays, "_device_count", lambda: 2)
    monkeypatch.setattr(_arrays, "current_device_id", lambda: 1)
    torch_like = types.SimpleNamespace(type="cuda", index=0)   # what torch.device("cuda", 0) answers
    cupy_like = types.SimpleNamespace(id=1)                    # a cupy.cuda.Device
    assert [_arrays.resolve_device(d) for d in (0, 1, np.int64(1), "cuda:0", "cuda", torch_like, cupy_like, None)] \
        == [0, 1, 1, 0, 1, 0, 1, 1]
    assert _arrays.resolve_device(types.SimpleNamespace(type="cuda", index=None)) == 1
    for bad, words in ((2, "sees 2 CUDA device"), (-1, "int id >= 0"), (True, "int id >= 0"), ("cpu", "CUDA device"),
                       ("cuda:x", "CUDA device"), (types.SimpleNamespace(type="cpu", index=None), "CUDA device"),
                       (1.0, "int id >= 0")):
        with pytest.raises(ValueError, match=words) as info:
            _arrays.resolve_device(bad, "device")
        assert str(info.value).startswith("device "), str(info.value)


def test_device_argument_needs_cuda_here(monkeypatch):
    """Without a usable CUDA device (CI; on a GPU machine the probe says so in its place): no device
    id to bind to; asking for one says why in plain words, and a default instance is still made
    (its first plan raises)."""
    if _arrays.cuda_problem() is None:  # a usable device here: the probe answers as on a machine without
        monkeypatch.setattr(_arrays, "cuda_problem", lambda: "no NVIDIA driver was found (libcuda.so.1)")
        monkeypatch.setattr(_arrays, "_cuda_ready", False)
    assert BatchAttention(8, 2, 128).device_id is None
    with pytest.raises(RuntimeError, match="cupy_fa cannot run here"):
        BatchAttention(8, 2, 128, device=0)
    with pytest.raises(RuntimeError, match="cupy_fa cannot run here"):
        BatchAttention(8, 2, 128).plan([1], [5], [[0]])


class FakeView:
    """The attributes check_device_array reads of a CuPy view."""

    def __init__(self, device_id, shape=(4, 8, 128), dtype=np.float16):
        self.device = types.SimpleNamespace(id=device_id)
        self.shape, self.ndim, self.dtype = shape, len(shape), np.dtype(dtype)
        self.size = int(np.prod(shape))
        self.flags = types.SimpleNamespace(c_contiguous=True)
        self.data = types.SimpleNamespace(ptr=1 << 20)
        self.strides = ()


def test_check_device_array_names_the_argument_and_both_devices():
    x = FakeView(1)
    assert _arrays.check_device_array(x, "q", device_id=1) is x
    with pytest.raises(ValueError, match=r"^q is on device 1, expected device 0 \(like the other inputs\)$"):
        _arrays.check_device_array(x, "q", device_id=0)
    with pytest.raises(ValueError, match=r"^out is on device 1, expected device 3 \(the device of this cache\)$"):
        _arrays.check_device_array(x, "out", device_id=3, bound="the device of this cache")
    # the other checks come first: a wrong dtype on the wrong device reports the dtype
    with pytest.raises(TypeError, match="q must have dtype bfloat16"):
        _arrays.check_device_array(x, "q", dtype="bfloat16", device_id=0)


def bound_instance(monkeypatch, device_id):
    monkeypatch.setattr(_arrays, "current_device_id", lambda: device_id)
    return BatchAttention(8, 2, 128, "float16")


def view(device_id, shape=(4, 8, 128), dtype=np.float16):
    """A run's array as BatchAttention.run reads it (cupy_fa._views.View), on ``device_id``."""
    return _views.View(None, 1 << 20, shape, np.dtype(dtype), device_id, True, _views.CUPY)


def test_run_inputs_on_another_device_are_refused(monkeypatch):
    attn = bound_instance(monkeypatch, 1)
    assert attn.device_id == 1
    state = types.SimpleNamespace(num_tokens=4)
    cache = types.SimpleNamespace(num_kv_heads=2, head_dim=128, head_dim_v=128, dtype_name="float16", device_id=0)
    with pytest.raises(ValueError, match=r"^q is on device 0, expected device 1 \(the device this BatchAttention is "
                                         r"bound to \(device=1\)\)$"):
        check_run(attn, state, view(0), cache, None, None)
    with pytest.raises(ValueError, match=r"^cache is on device 0, expected device 1 \(the device this BatchAttention"):
        check_run(attn, state, view(1), cache, None, None)
    cache.device_id = 1
    attn._buffers = types.SimpleNamespace(capacity=_plan.Capacity(4, 4, 1))
    with pytest.raises(ValueError, match=r"^out is on device 2, expected device 1"):
        check_run(attn, state, view(1), cache, view(2), None)
    with pytest.raises(ValueError, match=r"^lse is on device 0, expected device 1"):
        check_run(attn, state, view(1), cache, None, view(0, (4, 8), np.float32))


def test_device_metadata_on_another_device_is_refused_before_staging(monkeypatch):
    """plan / GraphRunner.run check device lengths, page tables and masks against the bound device
    in plan.check_step, before a byte is staged."""
    parsed = {"q_lens": FakeView(1, (3,), np.int32), "kv_lens": FakeView(1, (3,), np.int32),
              "page_table": FakeView(1, (3, 4), np.int32)}
    monkeypatch.setattr(_arrays, "require_cuda", lambda: None)
    monkeypatch.setattr(_views, "caller_stream", lambda xs, device_id: contextlib.nullcontext())
    monkeypatch.setattr(_arrays, "host_or_device_ints", lambda x, name, ndim, keep_dtype=False: (None, parsed[name]))
    step = _plan.check_step("q", "kv", "pt", max_q_len=4, device_id=1)
    assert step.batch == 3 and not step.on_host
    for name in parsed:
        moved = dict(parsed, **{name: FakeView(0, parsed[name].shape, np.int32)})
        monkeypatch.setattr(_arrays, "host_or_device_ints",
                            lambda x, n, ndim, keep_dtype=False, moved=moved: (None, moved[n]))
        with pytest.raises(ValueError, match=rf"^{name} is on device 0, expected device 1 \(bound here\)$"):
            _plan.check_step("q", "kv", "pt", max_q_len=4, device_id=1, bound="bound here")
    mask = FakeView(0, (48,), np.uint8)
    mask.ravel = lambda: mask
    monkeypatch.setattr(_arrays, "host_or_device_ints", lambda x, name, ndim, keep_dtype=False: (None, parsed[name]))
    monkeypatch.setattr(_arrays, "to_cupy", lambda x, name: mask)
    monkeypatch.setattr(_arrays, "host_to_numpy", lambda x: x)
    with pytest.raises(ValueError, match=r"^custom_mask is on device 0, expected device 1"):
        _plan.check_step("q", "kv", "pt", custom_mask=object(), max_q_len=4, device_id=1)


def test_messages_name_the_bound_instance(monkeypatch):
    """GraphRunner keeps its BatchAttention's device; its messages say which instance bound it."""
    runner = GraphRunner.__new__(GraphRunner)
    runner.device_id = 1
    assert runner._bound_text == "the device this GraphRunner is bound to (device=1)"
    attn = bound_instance(monkeypatch, 0)
    assert attn._bound_text == "the device this BatchAttention is bound to (device=0)"


def test_multi_gpu_tests_skip_with_what_they_lack(monkeypatch):
    """conftest: on a machine of one GPU the multi_gpu tests skip saying they need 2 devices (the
    gpu tests run); with no CUDA device both skip with the probe's reason."""
    import conftest
    import cuda_probe

    class Item:
        def __init__(self, *keywords):
            self.keywords, self.markers = set(keywords), []

        def add_marker(self, marker):
            self.markers.append(marker)

    def reasons(state):
        monkeypatch.setattr(conftest, "cuda_state", lambda: state)
        items = [Item("gpu"), Item("multi_gpu"), Item("cpu")]
        conftest.pytest_collection_modifyitems(None, items)
        return [[m.kwargs["reason"] for m in item.markers] for item in items]

    one, two = cuda_probe.Probe(1), cuda_probe.Probe(2)
    assert reasons(one) == [[], ["needs 2 CUDA devices, this machine has 1 (run with -m multi_gpu on a 2-GPU "
                                 "machine)"], []]
    assert reasons(two) == [[], [], []]
    none = cuda_probe.classify(count=0)
    assert reasons(none) == [[none.skip_reason], [none.skip_reason], []]
