"""Compiles every kernel variant of the cupy_fa on the path into CuPy's disk cache, several
processes at once (the parent never touches CUDA, so forked workers each get a clean context).
`python3 scripts/warm_cache.py [PROCESSES] [--head-dims 96,192]`: only the variants of those head
dims (and those of none: plan, append, merge_states).
Works for an older tree too (`PYTHONPATH=exp/base python3 scripts/warm_cache.py`), whose variant
list lived in cupy_fa._build."""
import re
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


def head_dim_of(variant):
    """The head dim a variant's traits name (TileTraits<96, ...>, MergeTraits<96, ...>), or None."""
    found = re.search(r"Traits<(\d+),", variant.expression)
    return int(found.group(1)) if found else None


if __name__ == "__main__":
    start = time.perf_counter()
    args = sys.argv[1:]
    if "--head-dims" in args:
        at = args.index("--head-dims")
        keep = {int(x) for x in args[at + 1].split(",")}
        VARIANTS = [v for v in VARIANTS if head_dim_of(v) in keep or head_dim_of(v) is None]
        del args[at:at + 2]
    with ProcessPoolExecutor(int(args[0]) if args else 8) as pool:
        done = [i for i in pool.map(compile_one, range(len(VARIANTS))) if i is not None]
    print(f"compiled {len(done)} kernel variants of {_build.KERNEL_DIR} in {time.perf_counter() - start:.1f} s")
