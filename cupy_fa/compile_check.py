"""Compiles every kernel to an sm_90a cubin (``--arch``: another target's kernels) with
NVRTC alone (no GPU needed) and prints registers, spills and stack frames:
``python -m cupy_fa.compile_check``.

A kernel whose ptxas log has no resource line for it ("Used N registers", and the
"bytes stack frame, ... spill stores, ... spill loads" line) fails the check: the figures
would otherwise read as zero spills that were never measured. Exit status 1 when any
kernel spills or has a stack frame with ``--strict``."""

import argparse
import sys
import time

from . import catalog

from . import _compile

RESOURCE_KEYS = ("registers", "spill_stores", "spill_loads", "stack")


class MissingResources(RuntimeError):
    """ptxas printed no resource figures for a kernel (wrong name, log format changed, -v lost)."""


def check_resources(kernel, resources):
    """The resources of one kernel, every figure present, or MissingResources naming it."""
    missing = [key for key in RESOURCE_KEYS if resources.get(key) is None]
    if missing:
        raise MissingResources(f"ptxas reported no {', '.join(missing)} for {kernel.expression}: its resource "
                               f"line is missing from the NVRTC log (got {resources})")
    return resources


def compile_all(arch="sm_90a", only=""):
    """Every kernel an ``arch`` build can launch (the wgmma family only for sm_90a), compiled:
    returns [(kernel, resources dict, seconds)]; raises on the first failure, a compile error
    or a kernel whose resource line is missing."""
    rows = []
    for kernel in catalog.all_kernels(arch):
        if only and only not in kernel.expression:
            continue
        start = time.perf_counter()
        _, resources = _compile.compile_cubin(kernel, arch)
        rows.append((kernel, check_resources(kernel, resources), time.perf_counter() - start))
    return rows


def format_table(rows):
    lines = [f"{'kernel':84s} {'regs':>5s} {'spill st/ld':>12s} {'stack B':>8s} {'smem KB':>8s} {'s':>5s}"]
    for kernel, res, seconds in rows:
        spills = f"{res['spill_stores']}/{res['spill_loads']}"
        lines.append(f"{kernel.expression:84s} {res['registers']!s:>5s} {spills:>12s} {res['stack']!s:>8s} "
                     f"{kernel.smem_bytes / 1024:8.1f} {seconds:5.1f}")
    return "\n".join(lines)


def summary(rows, arch):
    spilled = [v.expression for v, r, _ in rows if r["spill_stores"] or r["spill_loads"]]
    stacked = [v.expression for v, r, _ in rows if r["stack"]]
    return (f"{len(rows)} kernels compiled for {arch}, {len(spilled)} with spills, "
            f"{len(stacked)} with a stack frame"), spilled, stacked


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--only", default="", help="substring of the kernel name")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any kernel spills or has a stack frame")
    args = parser.parse_args(argv)
    try:
        rows = compile_all(args.arch, args.only)
    except MissingResources as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(rows))
    line, spilled, stacked = summary(rows, args.arch)
    print(line)
    for name in stacked:
        print(f"  stack frame: {name}")
    return 1 if args.strict and (spilled or stacked) else 0


if __name__ == "__main__":
    sys.exit(main())
