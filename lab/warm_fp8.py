"""Compiles into CuPy's disk cache, several processes at once, the kernels the fp8 check needs
(lab/fp8_check.sh): every variant a step over an fp8 cache or a 16-bit one can select on
this device under the knobs in force (cupy_fa.catalog.warmup_kernels with both cache dtypes),
for fp16 and bf16 queries and every head dim. The parent never touches CUDA, so forked workers
each get a clean context (as scripts/warm_cache.py, which compiles every variant of every target)."""
import pathlib
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))  # scripts/warm_cache.py

from cupy_fa import catalog, families

from cupy_fa import _compile
from warm_cache import compile_variant  # noqa: E402

VARIANTS = catalog.warmup_kernels(("float16", "bfloat16"), families.common.HEAD_DIMS, families.common.SMEM_LIMIT, "sm_90a",
                                    kv_dtypes=("float16", families.common.FP8))


def compile_one(i):
    return i if compile_variant(VARIANTS[i]) else None


if __name__ == "__main__":
    start = time.perf_counter()
    with ProcessPoolExecutor(int(sys.argv[1]) if len(sys.argv) > 1 else 8) as pool:
        done = [i for i in pool.map(compile_one, range(len(VARIANTS))) if i is not None]
    print(f"compiled {len(done)} kernel variants (16-bit and fp8 caches) of {_compile.KERNEL_DIR} in "
          f"{time.perf_counter() - start:.1f} s")
