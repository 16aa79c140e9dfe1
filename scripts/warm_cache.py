"""Compiles every kernel variant into CuPy's disk cache, several processes at once
(the parent never touches CUDA, so forked workers each get a clean context)."""
import time
from concurrent.futures import ProcessPoolExecutor

from cupy_fa import _build, schedule

VARIANTS = schedule.all_variants()


def compile_one(i):
    _build.get_function(VARIANTS[i])
    return i


if __name__ == "__main__":
    start = time.perf_counter()
    with ProcessPoolExecutor(8) as pool:
        done = list(pool.map(compile_one, range(len(VARIANTS))))
    print(f"compiled {len(done)} kernel variants in {time.perf_counter() - start:.1f} s")
