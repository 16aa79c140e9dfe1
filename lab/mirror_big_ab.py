"""Page-1 host tables (512 KiB - 2 MiB) through a pinned mirror, against today's direct copy from the
caller's array, in one process (2026-12-07, issue 41; a prediction waits in lab/NOTES.md). Today a
dense host table over `_staging.MIRRORED_TABLE_BYTES` (128 KiB) goes in a second `cudaMemcpyAsync`
straight from the caller's pageable array (`plan` 64-179 us at page 1 on an H100 host). The variant
raises MIRRORED_TABLE_BYTES and PINNED_MIRROR_BYTES to 4 MiB, so the table is copied by NumPy into a
pinned mirror and sent with the lengths in one copy the host does not wait on. Two instances per
cell (the pinned mirrors' size is fixed when they are made), the module constants set for each
block, alternating; block medians of `bench.timing.host_us` and the mirror each plan took.

    PYTHONPATH=. python3 lab/mirror_big_ab.py [--rounds 4]      (a GPU machine)
"""

import argparse
import collections
import statistics

import numpy as np
from mirror_ab import count_mirrors  # (lab/ on the path: run as a script from it)

BIG = 4 << 20


def main():
    import cupy

    import cupy_fa
    from bench import timing
    from cupy_fa import _staging

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    base = (_staging.MIRRORED_TABLE_BYTES, _staging.PINNED_MIRROR_BYTES)
    taken = count_mirrors()

    def configure(variant):
        _staging.MIRRORED_TABLE_BYTES, _staging.PINNED_MIRROR_BYTES = (BIG, BIG) if variant else base

    sync = cupy.cuda.Device().synchronize
    print(f"{'cell (page 1)':26s} {'table':>8s} {'direct us':>16s} {'pinned mirror us':>18s}  (block medians of 100)")
    for name, b, kv in (("decode B=1 L=131072", 1, 131072), ("decode B=64 L=4096", 64, 4096),
                        ("decode B=16 L=32768", 16, 32768)):
        table = np.random.default_rng(0).permutation(b * kv).astype(np.int32).reshape(b, kv)
        ql, kl = np.ones(b, np.int32), np.full(b, kv, np.int32)
        plans = []
        for variant in (0, 1):
            configure(variant)
            attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16")
            attn.plan(ql, kl, table)  # sizes the buffers; the variant's pinned mirrors made at its size
            plans.append((attn, lambda a=attn: a.plan(ql, kl, table)))
        sync()
        times, seen = {0: [], 1: []}, {0: collections.Counter(), 1: collections.Counter()}
        for r in range(args.rounds):
            for variant in ((0, 1) if r % 2 == 0 else (1, 0)):
                configure(variant)
                taken.clear()
                times[variant].append(timing.host_us(plans[variant][1], sync, 100))
                seen[variant].update(taken)
        configure(0)
        row = [" ".join(f"{t:6.1f}" for t in times[v]) for v in (0, 1)]
        print(f"{name:26s} {table.nbytes >> 10:6d} K {row[0]:>16s} {row[1]:>18s}  "
              f"x{statistics.mean(times[1]) / statistics.mean(times[0]):.3f}  {dict(seen[0])} {dict(seen[1])}")
        del plans


if __name__ == "__main__":
    main()
