"""cupy_fa benchmark: `python -m bench --help`. docs/performance.md says how each figure is taken."""

import sys


def refuse_here(prog, needs=()):
    """True, after one line on stderr saying why, where ``python -m <prog>`` cannot run on this
    machine: a module it needs (``needs``: e.g. torch) is not installed, or there is no usable CUDA
    device (the sentence of ``cupy_fa._arrays.cuda_problem``); False where it can. Each bench entry
    point asks after parsing its arguments (``--help`` and ``--list`` need no GPU) and before its
    first device call, and exits 1 on True: one line, not a traceback."""
    import importlib.util

    why = None
    for module in needs:
        if importlib.util.find_spec(module) is None:
            why = f"python -m {prog} needs {module}, which is not installed here (pip install {module})"
            break
    else:
        from cupy_fa import _arrays

        problem = _arrays.cuda_problem()
        why = None if problem is None else f"python -m {prog} needs a GPU: {problem}"
    if why is not None:
        print(why, file=sys.stderr)
    return why is not None
