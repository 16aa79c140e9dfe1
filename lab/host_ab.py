"""Host time of two cupy_fa trees side by side in one process, device calls stubbed as in
lab/host_cpu.py: the tree under test (``cupy_fa`` from the repository root) and another tree's
package imported as ``cupy_fa_base``. Each cell alternates the two in short blocks and keeps
each side's lowest block median, so a busy or throttled CPU moves both sides alike.

    rm -rf /tmp/ab && mkdir -p /tmp/ab && git archive REV cupy_fa | tar -x -C /tmp/ab
    mv /tmp/ab/cupy_fa /tmp/ab/cupy_fa_base
    PYTHONPATH=.:/tmp/ab python lab/host_ab.py [--rounds 15]
"""

import argparse
import sys

import host_cpu

PACKAGES = ("cupy_fa_base", "cupy_fa")


def cells(pkg):
    """(name, callable) of every timed call, for package ``pkg``."""
    found = []
    for name, *cell in host_cpu.CELLS:
        plan, run = host_cpu.attention_cell(*cell, package=pkg)
        found += [(f"plan {name}", plan), (f"run  {name}", run)]
    runner = host_cpu.new_runner(pkg)
    for b in (1, 8, 64):
        replay, eager = host_cpu.graph_step(runner, b, "device", pkg)
        found += [(f"graph replay B={b}", replay), (f"graph eager  B={b}", eager)]
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
                best[side] = min(best[side], host_cpu.median_us(both[side][i][1], 100, warmup=0))
        print(f"{name:28s} {best[0]:7.1f} {best[1]:7.1f} {best[1] / best[0]:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
