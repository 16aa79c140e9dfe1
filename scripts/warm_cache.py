"""Compiles every kernel variant of the cupy_fa on the path into CuPy's disk cache, several
processes at once (the parent never touches CUDA, so forked workers each get a clean context).
Works for an older tree too (`PYTHONPATH=exp/base python3 scripts/warm_cache.py`), whose variant
list lived in cupy_fa._build."""
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from cupy_fa import _build

try:
    from cupy_fa import schedule

    VARIANTS = schedule.all_variants()
except ImportError:  # a tree from before cupy_fa/schedule.py
    VARIANTS = _build.all_variants()


def compile_one(i):
    """Compiles variant i on this worker's device, unless the device's target cannot run it (the
    sm_90a-only wgmma family elsewhere): returns i, or None for a variant left out."""
    variant = VARIANTS[i]
    if variant.source == "prefill_sm90.cu":
        import cupy

        if not _build.device_arch(cupy.cuda.Device()).endswith("90a"):
            return None
    _build.get_function(variant)
    return i


if __name__ == "__main__":
    start = time.perf_counter()
    with ProcessPoolExecutor(int(sys.argv[1]) if len(sys.argv) > 1 else 8) as pool:
        done = [i for i in pool.map(compile_one, range(len(VARIANTS))) if i is not None]
    print(f"compiled {len(done)} kernel variants of {_build.KERNEL_DIR} in {time.perf_counter() - start:.1f} s")
