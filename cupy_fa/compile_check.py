"""Compiles every kernel variant to an sm_90a cubin (``--arch``: another target's variants) with
NVRTC alone (no GPU needed) and prints registers and spills: ``python -m cupy_fa.compile_check``."""

import argparse
import sys
import time

from . import _build, schedule


def compile_all(arch="sm_90a", only=""):
    """Every variant an ``arch`` build can launch (the wgmma family only for sm_90a), compiled:
    returns [(variant, resources dict, seconds)]; raises on the first failure."""
    rows = []
    for variant in schedule.all_variants(arch):
        if only and only not in variant.expression:
            continue
        start = time.perf_counter()
        _, resources = _build.compile_cubin(variant, arch)
        rows.append((variant, resources, time.perf_counter() - start))
    return rows


def format_table(rows):
    lines = [f"{'kernel variant':84s} {'regs':>5s} {'spill st/ld':>12s} {'smem KB':>8s} {'s':>5s}"]
    for variant, res, seconds in rows:
        spills = f"{res['spill_stores']}/{res['spill_loads']}"
        lines.append(f"{variant.expression:84s} {res['registers']!s:>5s} {spills:>12s} "
                     f"{variant.smem_bytes / 1024:8.1f} {seconds:5.1f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--only", default="", help="substring of the variant name")
    args = parser.parse_args(argv)
    rows = compile_all(args.arch, args.only)
    print(format_table(rows))
    spilled = [v.expression for v, r, _ in rows if r["spill_stores"] or r["spill_loads"]]
    print(f"{len(rows)} variants compiled for {args.arch}, {len(spilled)} with spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
