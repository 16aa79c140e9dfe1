"""Host time of two cupy_fa trees side by side in one process, device calls stubbed as in
lab/host_cpu.py: the tree under test (``cupy_fa`` from the repository root) and another tree's
package imported as ``cupy_fa_base``. Each cell alternates the two in short blocks and keeps
each side's lowest block median, so a busy or throttled CPU moves both sides alike.

    rm -rf /tmp/ab && mkdir -p /tmp/ab && git archive REV cupy_fa | tar -x -C /tmp/ab
    mv /tmp/ab/cupy_fa /tmp/ab/cupy_fa_base
    PYTHONPATH=.:/tmp/ab python lab/host_ab.py [--rounds 15]
"""

import argparse
import importlib
import statistics
import sys
import time

import numpy as np

import host_cpu
from host_cpu import FakeArray

PACKAGES = ("cupy_fa_base", "cupy_fa")


def block_us(fn, calls=100):
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def cells(pkg):
    """(name, callable) of every timed call, for package ``pkg``."""
    m = importlib.import_module(pkg)
    bf16 = importlib.import_module(f"{pkg}._arrays").DTYPES["bfloat16"]
    found = []
    for name, b, q_len, kv_len in host_cpu.CELLS:
        pages = -(-kv_len // 16)
        table = np.arange(b * pages, dtype=np.int32).reshape(b, pages)
        q_lens, kv_lens = np.full(b, q_len, np.int32), np.full(b, kv_len, np.int32)
        cache = host_cpu.fake_cache(b * pages, 16, package=pkg)
        attn = m.BatchAttention(32, 8, 128, "bfloat16")
        q = FakeArray((b * q_len, 32, 128), bf16)
        out = FakeArray(q.shape, bf16)
        found.append((f"plan {name}", lambda a=attn, x=(q_lens, kv_lens, table): a.plan(*x)))
        found[-1][1]()
        found.append((f"run  {name}", lambda a=attn, x=(q, cache, out): a.run(x[0], x[1], out=x[2])))
    runner = m.GraphRunner(32, 8, 128, "bfloat16", max_batch_size=64, max_q_len=8, max_pages_per_request=256,
                           page_size=16)
    for b in (1, 8, 64):
        cache = host_cpu.fake_cache(b * 256, 16, package=pkg)
        q = FakeArray((b, 32, 128), bf16)
        lens = (FakeArray((b,), np.int32), FakeArray((b,), np.int32), FakeArray((b, 256), np.int32))
        found.append((f"graph replay B={b}", lambda r=runner, x=(q, cache) + lens: r.run("decode", *x)))
        found.append((f"graph eager  B={b}", lambda r=runner, x=(q, cache) + lens: r.run("decode", *x,
                                                                                          use_graph=False)))
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    for pkg in PACKAGES:
        host_cpu.install(pkg)
    both = [cells(pkg) for pkg in PACKAGES]
    for fns in both:
        for _, fn in fns:
            for _ in range(50):
                fn()
    print(f"host us per call, device calls stubbed; lowest of {args.rounds} block medians (100 calls), "
          f"alternating; {sys.version.split()[0]}")
    print(f"{'cell':28s} {'base':>7s} {'tree':>7s} {'tree/base':>9s}")
    for i, (name, _) in enumerate(both[0]):
        best = [float("inf")] * 2
        for _ in range(args.rounds):
            for side in (0, 1):
                best[side] = min(best[side], block_us(both[side][i][1]))
        print(f"{name:28s} {best[0]:7.1f} {best[1]:7.1f} {best[1] / best[0]:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
