"""``python -m cupy_fa``: the command line.

    python -m cupy_fa                      what is installed, what device there is, and this help
    python -m cupy_fa warmup [options]     compile the kernels into the disk cache

``warmup`` compiles every kernel that plans with the given dtypes and head dims can
select (``cupy_fa.catalog.warmup_kernels``) for the GPU it finds (device 0; the knob
``CUPY_FA_ARCH`` overrides its target), or for ``--arch`` without one, into the cache directory
(``CUPY_FA_CACHE_DIR``, default ``~/.cache/cupy_fa``), one NVRTC process per core. A later
process on a GPU of that arch then loads the kernels without compiling. Nothing here needs a GPU
when ``--arch`` is given.
"""

from __future__ import annotations

import argparse
import sys
from cupy_fa import families
from cupy_fa import catalog

SMEM_LIMITS, smem_limit_of = catalog.SMEM_LIMITS, catalog.smem_limit_of  # (kept here: the CLI's names)
DTYPES = ("float16", "bfloat16")


def _int_list(text):
    """Head dims such as ``64,128``; a qk / vo pair as ``192/128``."""
    def dims(x):
        return tuple(int(d) for d in x.split("/")) if "/" in x else int(x)

    try:
        return tuple(dims(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected head dims such as 64,128 (a qk / vo pair: 192/128), got {text!r}") \
            from None


def _str_list(text):
    return tuple(x for x in text.replace(",", " ").split())


def parser():

    top = argparse.ArgumentParser(prog="python -m cupy_fa", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="store_true", help="print the cupy_fa version and exit")
    sub = top.add_subparsers(dest="command")
    warm = sub.add_parser("warmup", help="compile the kernels into the disk cache",
                          description="Compile the kernels into the disk cache (CUPY_FA_CACHE_DIR).")
    warm.add_argument("--arch", help="target, e.g. sm_90a (H100/H200), sm_80 (A100); default: device 0's")
    warm.add_argument("--jobs", type=int, help="compile processes (default: every core this process may use)")
    warm.add_argument("--dtypes", type=_str_list, default=DTYPES,
                      help=f"query / output dtypes, comma-separated (default {','.join(DTYPES)})")
    warm.add_argument("--head-dims", type=_int_list, default=families.common.HEAD_DIMS,
                      help=f"head dims, comma-separated, a qk / vo pair as 192/128 "
                           f"(default {','.join(map(str, families.common.HEAD_DIMS))})")
    warm.add_argument("--fp8", action="store_true", help="also an fp8 (e4m3fn) K/V cache's kernels")
    warm.add_argument("--variants", action="store_true",
                      help="also the kernels with the variant hooks (sliding window, soft-cap, sinks)")
    warm.add_argument("--list", action="store_true", help="print the kernels and exit without compiling")
    warm.add_argument("--quiet", action="store_true", help="no progress line")
    return top


def _about():
    """Lines saying what is installed and what device there is."""
    from . import __version__

    lines = [f"cupy_fa {__version__}"]
    try:
        import cupy
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        return lines + ["CuPy is not installed: install cupy_fa with the CUDA extra (pip install 'cupy-fa[cuda12]')"]
    lines.append(f"CuPy {cupy.__version__}, NVRTC {'.'.join(map(str, nvrtc.getVersion()))}")
    device = _find_device()
    lines.append(f"device 0: {device[1]} ({device[0]})" if device else "no CUDA device found")
    from . import _cache

    lines.append(f"kernel cache: {_cache.cache_dir()}")
    return lines


def _find_device():
    """(arch, name) of device 0, or None where there is no usable device."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        from . import _build

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        return _build.current_arch(0), name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no driver, no device, a broken install: "none found"
        return None


def warmup(args, out=sys.stdout, err=sys.stderr):
    from .knobs import knobs

    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: F401 - NVRTC is what compiles
    except ImportError:
        err.write("cupy_fa: CuPy is not installed: install cupy_fa with the CUDA extra "
                  "(pip install 'cupy-fa[cuda12]')\n")
        return 1
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        err.write(f"cupy_fa warmup: --dtypes must be among {', '.join(DTYPES)}, got {','.join(args.dtypes)!r}\n")
        return 2
    pairs = families.common.HEAD_DIM_PAIRS
    bad = [d for d in args.head_dims if d not in families.common.HEAD_DIMS and d not in pairs]
    if bad or not args.head_dims:
        spell = lambda d: "/".join(map(str, d)) if isinstance(d, tuple) else str(d)
        err.write(f"cupy_fa warmup: --head-dims must be among {', '.join(map(str, families.common.HEAD_DIMS))} "
                  f"or the qk / vo pairs {', '.join(map(spell, pairs))}, got {','.join(map(spell, args.head_dims))!r}\n")
        return 2
    if args.jobs is not None and args.jobs < 1:
        err.write(f"cupy_fa warmup: --jobs must be a positive number of processes, got {args.jobs}\n")
        return 2
    arch = args.arch or knobs().arch
    if arch:
        try:
            smem_limit = smem_limit_of(arch)
        except ValueError as exc:
            err.write(f"cupy_fa warmup: {exc}\n")
            return 2
        where = f"for {arch}"
    else:
        device = _find_device()
        if device is None:
            err.write("cupy_fa warmup: no CUDA device found; pass --arch (e.g. --arch sm_90a) to compile for one\n")
            return 1
        from . import _build

        arch, smem_limit, where = device[0], _build.device_smem_limit(0), f"for device 0 ({device[1]}, {device[0]})"
    kv_dtypes = (args.dtypes[0], families.common.FP8) if args.fp8 else None
    wanted = catalog.warmup_kernels(args.dtypes, args.head_dims, smem_limit, arch, kv_dtypes, args.variants)
    if args.list:
        for kernel in wanted:
            out.write(f"{kernel.source:22s} {kernel.expression}\n")
        out.write(f"{len(wanted)} kernels {where}\n")
        return 0
    from . import __version__, _compile

    summary = _compile.compile_many(wanted, arch, args.jobs, progress=not args.quiet)
    out.write(f"cupy_fa {__version__}: {summary['kernels']} kernels {where}: {summary['compiled']} compiled, "
              f"{summary['cached']} from the cache, {summary['seconds']:.1f} s on {summary['jobs']} "
              f"process{'es' if summary['jobs'] != 1 else ''}; "
              + (f"cache {summary['directory']}\n" if summary["stored"] else
                 f"NOT cached ({summary['directory']} cannot be written)\n"))
    return 0 if summary["stored"] else 1


def main(argv=None):
    args = parser().parse_args(argv)
    if args.version:
        from . import __version__

        print(f"cupy_fa {__version__}")
        return 0
    if args.command == "warmup":
        return warmup(args)
    print("\n".join(_about()) + "\n")
    parser().print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
