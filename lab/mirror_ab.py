"""`plan`'s host time with the pinned host mirrors on and off in one process (2026-12-07, issue 41):
for each cell, BatchAttention.plan with host NumPy lengths and page table timed as bench.host times
it (bench.timing.host_us: sync, one call), alternating `_staging.PINNED_MIRRORS` 2 / 0 in blocks,
with the mirror each plan took counted. Needs a tree with `cupy_fa._staging.HostMirrors`.

    PYTHONPATH=. python3 lab/mirror_ab.py [--rounds 4]      (a GPU machine)
"""

import argparse
import collections
import statistics

import numpy as np


def count_mirrors():
    """Counts which mirror each host step takes from now on ("pinned" / "pageable"): the Counter
    returned, filled by a wrapper of `_staging.HostMirrors.take` (lab/mirror_big_ab.py too)."""
    from cupy_fa import _staging

    taken = collections.Counter()
    real = _staging.HostMirrors.take

    def take(self, words, capturing=False):
        mirror = real(self, words, capturing)
        taken["pageable" if mirror is self.pageable else "pinned"] += 1
        return mirror

    _staging.HostMirrors.take = take
    return taken


def main():
    import cupy

    import cupy_fa
    from bench import timing
    from cupy_fa import _staging

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    taken = count_mirrors()
    sync = cupy.cuda.Device().synchronize
    print(f"{'cell':24s} {'pinned us':>18s} {'pageable us':>18s}  (block medians of 200 plans)  mirrors taken")
    for name, b, q, kv in (("decode B=1 L=4096", 1, 1, 4096), ("decode B=64 L=4096", 64, 1, 4096),
                           ("decode B=16 L=32768", 16, 1, 32768), ("verify q=4 B=64", 64, 4, 4096)):
        pages = kv // 16
        table = np.random.default_rng(0).permutation(b * pages).astype(np.int32).reshape(b, pages)
        ql, kl = np.full(b, q, np.int32), np.full(b, kv, np.int32)
        attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16")
        plan = lambda: attn.plan(ql, kl, table)
        plan()
        sync()
        times = {2: [], 0: []}
        taken.clear()
        for r in range(args.rounds):
            for n in ((2, 0) if r % 2 == 0 else (0, 2)):
                _staging.PINNED_MIRRORS = n
                times[n].append(timing.host_us(plan, sync, 200))
        row = [" ".join(f"{t:5.1f}" for t in times[n]) for n in (2, 0)]
        print(f"{name:24s} {row[0]:>18s} {row[1]:>18s}  x{statistics.mean(times[2]) / statistics.mean(times[0]):.3f}"
              f"  {dict(taken)}")
        del attn
    _staging.PINNED_MIRRORS = 2


if __name__ == "__main__":
    main()
