"""Compiles every kernel variant of the cupy_fa on the path into CuPy's disk cache, several
processes at once (the parent never touches CUDA, so forked workers each get a clean context).
`python3 scripts/warm_cache.py [PROCESSES] [--head-dims 96,192] [--hooks-for 96] [--no-fp8]`: only
the variants of those head dims (and those of none: plan, append, merge_states), the kernels with
the variant hooks only at the --hooks-for head dims, none over an fp8 cache.
Works for an older tree too (`PYTHONPATH=exp/base python3 scripts/warm_cache.py`), whose variant
list lived in cupy_fa._build."""
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from cupy_fa import _build

from cupy_fa import _compile
from cupy_fa import catalog

try:

    VARIANTS = catalog.all_kernels()
except ImportError:  # a tree from before cupy_fa/schedule.py
    VARIANTS = _build.all_variants()


def compile_variant(variant):
    """Compiles ``variant`` on this worker's device, unless the device's target cannot run it (the
    sm_90a-only wgmma family elsewhere): True when compiled (lab/warm_fp8.py uses it too)."""
    if variant.source == "sm90/prefill.cu":
        import cupy

        if not _build.device_arch(cupy.cuda.Device()).endswith("90a"):
            return False
    _build.get_function(variant)
    return True


def compile_one(i):
    """Compiles variant i: returns i, or None for a variant left out."""
    return i if compile_variant(VARIANTS[i]) else None


def head_dim_of(variant):
    """The head dim a variant's traits name (TileTraits<96, ...>, MergeTraits<96, ...>), or None."""
    found = re.search(r"Traits<(\d+),", variant.expression)
    return int(found.group(1)) if found else None


def hooked(variant):
    """Whether a variant has the variant hooks compiled in (the last template argument of
    TileTraits' 8 or Sm90PrefillTraits' 14)."""
    found = re.search(r"(TileTraits|Sm90PrefillTraits)<([^<>]*)>", variant.expression)
    if not found:
        return False
    return len(found.group(2).split(",")) == (8 if found.group(1) == "TileTraits" else 14)


def option(args, name):
    """The value of option `name` (removed from args), or None."""
    if name not in args:
        return None
    at = args.index(name)
    value = args[at + 1]
    del args[at:at + 2]
    return value


if __name__ == "__main__":
    start = time.perf_counter()
    args = sys.argv[1:]
    dims, hooks = option(args, "--head-dims"), option(args, "--hooks-for")
    if dims is not None:
        keep = {int(x) for x in dims.split(",")}
        VARIANTS = [v for v in VARIANTS if head_dim_of(v) in keep or head_dim_of(v) is None]
    if hooks is not None:
        with_hooks = {int(x) for x in hooks.split(",")}
        VARIANTS = [v for v in VARIANTS if not hooked(v) or head_dim_of(v) in with_hooks]
    if "--no-fp8" in args:
        args.remove("--no-fp8")
        VARIANTS = [v for v in VARIANTS if "fp8" not in v.expression]
    with ProcessPoolExecutor(int(args[0]) if args else 8) as pool:
        done = [i for i in pool.map(compile_one, range(len(VARIANTS))) if i is not None]
    print(f"compiled {len(done)} kernel variants of {_compile.KERNEL_DIR} in {time.perf_counter() - start:.1f} s")
