import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cuda_probe  # noqa: E402


@functools.lru_cache(maxsize=None)
def cuda_state():
    """What CUDA said, asked once per process (tests/cuda_probe.py)."""
    return cuda_probe.probe()


def cuda_device_count():
    """CUDA devices this process may use (0 when there is no GPU or CUDA is broken)."""
    return cuda_state().devices


def pytest_report_header(config):
    return f"cuda: {cuda_state().describe()}"


MULTI_GPU = 2  # devices the multi_gpu tests need


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords or "multi_gpu" in item.keywords]
    if not gpu_items:
        return
    state = cuda_state()
    if state.skip_reason:  # a clean "no GPU here": skip them (scripts/device_check.sh makes any skip an error)
        skip = pytest.mark.skip(reason=state.skip_reason)
        for item in gpu_items:
            item.add_marker(skip)
    elif not state.error and state.devices < MULTI_GPU:
        # the multi_gpu tests are not selected by device_check.sh's `-m gpu`; lab/tp_check.sh runs
        # them (`-m multi_gpu`) on a machine of 2 GPUs. Here they say plainly what they lack.
        skip = pytest.mark.skip(reason=f"needs {MULTI_GPU} CUDA devices, this machine has {state.devices} "
                                       f"(run with -m multi_gpu on a {MULTI_GPU}-GPU machine)")
        for item in gpu_items:
            if "multi_gpu" in item.keywords:
                item.add_marker(skip)


def pytest_runtest_setup(item):
    """A broken CUDA setup (see tests/cuda_probe.py) fails every GPU test, loudly, with what CUDA said."""
    state = cuda_state()
    if state.error and ("gpu" in item.keywords or "multi_gpu" in item.keywords):
        pytest.fail(f"CUDA is present but not usable, so this GPU test cannot run: {state.error}", pytrace=False)


@pytest.fixture(autouse=True)
def _knobs_put_back():
    """A test that changes a CUPY_FA_* variable takes it in with cupy_fa.knobs.reload() (knobs are
    read once); the knobs in force before the test are put back after it."""
    from cupy_fa import knobs

    before = knobs.knobs()
    yield
    knobs.use(before)


@pytest.fixture
def needs_sm90():
    """Skips a GPU test on anything but compute capability 9.0: the sm_90a wgmma family's kernels."""
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the sm_90a prefill family runs on compute capability 9.0 (Hopper) only")


def pytest_runtest_logreport(report):
    """With CUPY_FA_FAILURE_LOG set, append each failure's reason to that file as it
    happens: a GPU run cut short by its time limit still tells why a test failed."""
    path = os.environ.get("CUPY_FA_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext[-3000:]}\n")


@pytest.fixture
def one_torch_thread():
    """torch on one CPU thread for the test (small matmuls on a 2-core machine run ~20x slower
    with 2 OpenMP threads than with 1); the count put back after."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
