"""cProfile of `BatchAttention.plan` with host lengths on a GPU machine (2026-12-07, issue 41): the
windowed cell's plan costs the host 5-6 us more than the same step unwindowed there, against 2 us
stubbed on a CPU box (lab/host_cpu.py); this names the calls that differ (driver calls included).

    PYTHONPATH=. python3 lab/plan_profile.py      (a GPU machine)
"""

import cProfile
import pstats

import numpy as np


def main():
    import cupy

    import cupy_fa
    from bench import timing

    sync = cupy.cuda.Device().synchronize
    for window in (None, 1024):
        b, kv = 64, 4096
        table = np.random.default_rng(0).permutation(b * kv // 16).astype(np.int32).reshape(b, kv // 16)
        ql, kl = np.ones(b, np.int32), np.full(b, kv, np.int32)
        attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16")
        plan = lambda: attn.plan(ql, kl, table, window=window)
        print(f"== decode B=64 L=4096 window {window}: plan {timing.host_us(plan, sync, 400):.1f} us (host_us)")
        prof = cProfile.Profile()
        for _ in range(2000):
            sync()
            prof.enable()
            plan()
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()
