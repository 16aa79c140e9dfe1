"""Only a clean "no GPU here" skips the GPU tests; a broken CUDA fails them (tests/cuda_probe.py,
tests/conftest.py). Runs everywhere: the classification on made-up CUDA answers, and this
machine's own answer, which must be one of the two clean ones."""

import sys

import pytest

import cuda_probe
from cuda_probe import NO_DEVICE, Probe, classify


class FakeCudaError(RuntimeError):
    def __init__(self, status, text):
        super().__init__(text)
        self.status = status


@pytest.mark.parametrize("answer,skips", [
    (dict(count=1), None),
    (dict(count=0), True),
    (dict(exc=FakeCudaError(100, "cudaErrorNoDevice: no CUDA-capable device is detected")), True),
    (dict(exc=FakeCudaError(34, "cudaErrorStubLibrary"), driver_version=None), True),
    # what this repository's CPU CI box answers: cupy-cuda12x installed, no libcuda.so.1
    (dict(exc=FakeCudaError(35, "cudaErrorInsufficientDriver"), driver_version=0, runtime_version=12090), True),
    # a real driver that is older than the runtime is broken, not absent
    (dict(exc=FakeCudaError(35, "cudaErrorInsufficientDriver"), driver_version=12020, runtime_version=12090), False),
    (dict(exc=FakeCudaError(3, "cudaErrorInitializationError")), False),
    (dict(exc=FakeCudaError(46, "cudaErrorDevicesUnavailable")), False),
    (dict(exc=FakeCudaError(999, "cudaErrorUnknown")), False),
    (dict(exc=OSError("libcudart.so.12: cannot open shared object file")), False),
])
def test_classify(answer, skips):
    state = classify(**answer)
    if skips is None:
        assert state == Probe(1)
    elif skips:
        assert state.devices == 0 and state.skip_reason.startswith(NO_DEVICE) and not state.error
    else:
        assert state.devices == 0 and not state.skip_reason and state.error
        assert "older than" in state.error or repr(answer["exc"]) in state.error


def test_this_machine_answers_cleanly():
    state = cuda_probe.probe()
    assert not state.error, state.error  # a broken CUDA here must fail, not skip
    assert state.devices > 0 or state.skip_reason.startswith(NO_DEVICE)


def test_missing_cupy_skips_a_broken_one_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ModuleNotFoundError(name="cupy")
    assert cuda_probe.probe().skip_reason == f"{NO_DEVICE} (cupy is not installed)"


class FakeItem:
    def __init__(self, gpu):
        self.keywords = {"gpu": True} if gpu else {}
        self.markers = []

    def add_marker(self, marker):
        self.markers.append(marker)


def test_conftest_skips_on_no_device_and_fails_on_broken(monkeypatch):
    conftest = sys.modules["conftest"]
    gpu, cpu = FakeItem(True), FakeItem(False)
    monkeypatch.setattr(conftest, "cuda_state", lambda: Probe(0, f"{NO_DEVICE} (cudaErrorNoDevice)"))
    conftest.pytest_collection_modifyitems(None, [gpu, cpu])
    assert [m.kwargs["reason"] for m in gpu.markers] == [f"{NO_DEVICE} (cudaErrorNoDevice)"] and not cpu.markers
    conftest.pytest_runtest_setup(gpu)  # a skipped item's setup does not fail

    gpu, cpu = FakeItem(True), FakeItem(False)
    monkeypatch.setattr(conftest, "cuda_state", lambda: Probe(0, error="cudaErrorUnknown"))
    conftest.pytest_collection_modifyitems(None, [gpu, cpu])
    assert not gpu.markers  # never skipped
    with pytest.raises(pytest.fail.Exception, match="CUDA is present but not usable.*cudaErrorUnknown"):
        conftest.pytest_runtest_setup(gpu)
    conftest.pytest_runtest_setup(cpu)  # CPU tests still run


def test_gpu_tests_live_outside_the_cpu_modules():
    """scripts/device_check.sh collects every test module but the CPU-only ``*_cpu.py`` ones: a GPU
    test in one of those would never run on the GPU machine."""
    import pathlib
    import re

    marked = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bgpu\b)", re.M)
    for path in sorted(pathlib.Path(__file__).parent.glob("*_cpu.py")):
        assert not marked.search(path.read_text()), f"{path.name} holds a GPU test; move it to a *_gpu.py module"
    assert marked.search((pathlib.Path(__file__).parent / "test_errors_gpu.py").read_text())  # the pattern sees one
