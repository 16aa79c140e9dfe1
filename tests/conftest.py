import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=None)
def cuda_device_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no device, no cupy
        return 0


def pytest_collection_modifyitems(config, items):
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _knobs_put_back():
    """A test that changes a CUPY_FA_* variable takes it in with cupy_fa.knobs.reload() (knobs are
    read once); the knobs in force before the test are put back after it."""
    from cupy_fa import knobs

    before = knobs.knobs()
    yield
    knobs.use(before)


def pytest_runtest_logreport(report):
    """With CUPY_FA_FAILURE_LOG set, append each failure's reason to that file as it
    happens: a device call cut short by its time limit still tells why a test failed."""
    path = os.environ.get("CUPY_FA_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext[-3000:]}\n")
