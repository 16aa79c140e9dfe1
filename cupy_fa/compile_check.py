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


def _compile_one(task):
    """One kernel in a worker process: (index, resources, seconds)."""
    index, kernel, arch = task
    start = time.perf_counter()
    _, resources = _compile.compile_cubin(kernel, arch)
    return index, resources, time.perf_counter() - start


def compile_all(arch="sm_90a", only="", jobs=None, progress=None, kernels=None):
    """Every kernel an ``arch`` build can launch (the wgmma family only for sm_90a; ``kernels``: these
    instead), compiled in ``jobs`` processes at once (default: every core this process may use):
    returns [(kernel, resources dict, seconds)] in the catalog's order; raises on the first
    failure, a compile error or a kernel whose resource line is missing. ``progress``: a line on
    stderr as they finish (``None``: when stderr is a terminal, else every tenth)."""
    import concurrent.futures

    kernels = [k for k in (catalog.all_kernels(arch) if kernels is None else kernels)
               if not only or only in k.expression]
    jobs = _compile.default_jobs() if jobs is None else jobs
    tty = sys.stderr.isatty()
    show = tty if progress is None else bool(progress)
    rows, start = [None] * len(kernels), time.perf_counter()
    tasks = [(i, k, arch) for i, k in enumerate(kernels)]
    if jobs <= 1 or len(kernels) <= 1:
        results = map(_compile_one, tasks)
        pool = None
    else:
        pool = concurrent.futures.ProcessPoolExecutor(min(jobs, len(kernels)))
        results = (f.result() for f in concurrent.futures.as_completed([pool.submit(_compile_one, t) for t in tasks]))
    try:
        for done, (index, resources, seconds) in enumerate(results, 1):
            rows[index] = (kernels[index], check_resources(kernels[index], resources), seconds)
            if show or (progress is None and done % max(1, len(kernels) // 10) == 0) or done == len(kernels):
                end = "\r" if tty and done < len(kernels) else "\n"
                print(f"compiled {done}/{len(kernels)} kernels for {arch} on {jobs} process{'es' if jobs != 1 else ''}, "
                      f"{time.perf_counter() - start:.0f} s", end=end, file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
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
    parser.add_argument("--jobs", type=int, default=None, help="processes compiling at once (default: every core)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any kernel spills or has a stack frame")
    args = parser.parse_args(argv)
    try:
        rows = compile_all(args.arch, args.only, args.jobs)
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
