"""cupy_fa benchmark: `python -m bench --help`. docs/performance.md says how each figure is taken."""


def cannot_run(prog, needs=()):
    """Why ``python -m <prog>`` cannot run on this machine, as one line for its exit: a module it
    needs (``needs``: e.g. torch) not installed, or no usable CUDA device (the sentence of
    ``cupy_fa._arrays.cuda_problem``); None where it can. Each bench entry point asks after parsing
    its arguments (``--help`` and ``--list`` need no GPU) and before its first device call."""
    import importlib.util

    for module in needs:
        if importlib.util.find_spec(module) is None:
            return f"python -m {prog} needs {module}, which is not installed here (pip install {module})"
    from cupy_fa import _arrays

    problem = _arrays.cuda_problem()
    return None if problem is None else f"python -m {prog} needs a GPU: {problem}"
