"""Whether this machine has a CUDA device for the GPU tests, told apart from a broken one.

Only a clean "there is no GPU here" answer lets the GPU tests skip (reason "no CUDA device"):

* CuPy is not installed at all;
* the CUDA runtime finds no device (``cudaErrorNoDevice``, or a count of 0);
* no driver is installed: ``cudaErrorInsufficientDriver`` while the runtime reports driver
  version 0 (what a machine without ``libcuda.so.1`` answers, e.g. the CPU CI box, whose venv
  has ``cupy-cuda12x``), or the toolkit's stub ``libcuda`` answering ``cudaErrorStubLibrary``.

Anything else (a driver older than the runtime, an initialisation error, devices busy or
unavailable, a CuPy that is installed but fails to import) is a broken setup: the GPU tests
then fail with what CUDA said, never skip.
"""

import dataclasses

NO_DEVICE = "no CUDA device"

CUDA_ERROR_STUB_LIBRARY = 34  # cudaErrorStubLibrary: the toolkit's stub libcuda, no real driver
CUDA_ERROR_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver: driver older than the runtime, or none
CUDA_ERROR_NO_DEVICE = 100  # cudaErrorNoDevice


@dataclasses.dataclass(frozen=True)
class Probe:
    devices: int
    skip_reason: str = ""  # set: no GPU here, skip the GPU tests with this reason
    error: str = ""        # set: CUDA is there but broken, fail the GPU tests with this

    def describe(self):
        if self.error:
            return f"BROKEN: {self.error}"
        return self.skip_reason or f"{self.devices} device(s)"


def classify(count=None, exc=None, driver_version=None, runtime_version=None):
    """The Probe for what ``getDeviceCount()`` gave: ``count``, or the exception ``exc`` (a
    ``CUDARuntimeError`` has ``.status``); ``driver_version`` is ``driverGetVersion()`` (0: no
    driver installed), asked only after an insufficient-driver answer."""
    if exc is None:
        return Probe(count) if count > 0 else Probe(0, f"{NO_DEVICE} (the CUDA runtime counts 0 devices)")
    status = getattr(exc, "status", None)
    if status == CUDA_ERROR_NO_DEVICE:
        return Probe(0, f"{NO_DEVICE} (cudaErrorNoDevice)")
    if status == CUDA_ERROR_STUB_LIBRARY:
        return Probe(0, f"{NO_DEVICE} (only the toolkit's stub libcuda: no driver installed)")
    if status == CUDA_ERROR_INSUFFICIENT_DRIVER and driver_version == 0:
        return Probe(0, f"{NO_DEVICE} (no CUDA driver installed: driver version 0)")
    if status == CUDA_ERROR_INSUFFICIENT_DRIVER:
        return Probe(0, error=f"the CUDA driver (version {driver_version}) is older than the CUDA runtime "
                              f"(version {runtime_version}): {exc!r}")
    return Probe(0, error=f"cupy.cuda.runtime.getDeviceCount() raised {exc!r}")


def probe():
    """Asks CUDA (through CuPy) once; returns a Probe."""
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "cupy":
            return Probe(0, f"{NO_DEVICE} (cupy is not installed)")
        return Probe(0, error=f"import cupy failed: {exc!r}")
    except Exception as exc:  # installed but broken (a missing libcudart, a bad wheel)
        return Probe(0, error=f"import cupy failed: {exc!r}")
    runtime = cupy.cuda.runtime
    try:
        return classify(count=runtime.getDeviceCount())
    except Exception as exc:
        driver = runtime_version = None
        if getattr(exc, "status", None) == CUDA_ERROR_INSUFFICIENT_DRIVER:
            try:
                driver, runtime_version = runtime.driverGetVersion(), runtime.runtimeGetVersion()
            except Exception as inner:
                return Probe(0, error=f"getDeviceCount() raised {exc!r}, driverGetVersion() {inner!r}")
        return classify(exc=exc, driver_version=driver, runtime_version=runtime_version)
