"""``merge_states``: the public merge of two attention states, for cascade (shared-prefix)
attention and any other split of a query's keys into disjoint parts.

A *state* is what :meth:`cupy_fa.BatchAttention.run` returns with ``return_lse=True``: ``out``
``[N, H, D]`` (float16 / bfloat16, normalised: the softmax-weighted sum of V over the part's keys)
and ``lse`` ``[N, H]`` float32, the **natural-log** log-sum-exp of the part's scaled scores
(``log(sum_j exp(sm_scale * q.k_j))``; -inf for a row that saw no key). Two states of the same
rows over disjoint key sets merge into the state over their union:

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

computed in fp32 by the same fold the library's own split merge runs (kernels/shared/merge_states.cu,
softmax.cuh), rounded to the output type once. ``cupy_fa.reference.merge_states`` is the float64
version. With attention sinks (``run(..., sinks=)``), give the sinks to one part's run only: a sink
is one more key with a zero value in its part's state (its LSE includes it), so two parts that both
carry it would count it twice.
"""

import contextlib

import numpy as np

from . import _arrays, _build, _params, catalog

__all__ = ["merge_states"]

MAX_HEAD_DIM = 4 * catalog.MERGE_STATES_THREADS  # head_dim / 4 threads a row, one CTA at most


def check_shapes(out_a, lse_a, out_b, lse_b, out=None, lse_out=None):
    """The shape and dtype rules of :func:`merge_states`, on anything with ``shape`` and ``dtype``
    (device arrays, or host arrays in a test): returns the output dtype's name. Raises
    ``ValueError`` / ``TypeError`` naming the argument."""
    if len(out_a.shape) != 3:
        raise ValueError(f"out_a must be [N, H, D], got shape {tuple(out_a.shape)}")
    n, h, d = (int(s) for s in out_a.shape)
    name = _arrays.resolve_dtype(out_a.dtype, "out_a.dtype")
    if tuple(out_b.shape) != (n, h, d):
        raise ValueError(f"out_b has shape {tuple(out_b.shape)}, expected out_a's {(n, h, d)}")
    if _arrays.resolve_dtype(out_b.dtype, "out_b.dtype") != name:
        raise TypeError(f"out_b has dtype {_arrays.dtype_name(out_b.dtype)}, out_a {name}: one output type")
    if d % 4 or not 4 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (out_a.shape[2]) must be a multiple of 4 from 4 to {MAX_HEAD_DIM}, got {d}")
    for arg, x in (("lse_a", lse_a), ("lse_b", lse_b)) + ((("lse_out", lse_out),) if lse_out is not None else ()):
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"{arg} must be float32 (BatchAttention.run's LSE), got {_arrays.dtype_name(x.dtype)}")
        if tuple(x.shape) != (n, h):
            raise ValueError(f"{arg} has shape {tuple(x.shape)}, expected [N, H] = {(n, h)} of out_a")
    if out is not None:
        if tuple(out.shape) != (n, h, d):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected out_a's {(n, h, d)}")
        if _arrays.resolve_dtype(out.dtype, "out.dtype") != name:
            raise TypeError(f"out has dtype {_arrays.dtype_name(out.dtype)}, expected out_a's {name}")
    return name


def _check_overlap(pairs):
    """In place is fine (``out`` the very array ``out_a`` or ``out_b``, ``lse_out`` ``lse_a`` or
    ``lse_b``); any other overlap of an output with an input or the other output is refused."""
    def span(x):
        return x.data.ptr, x.data.ptr + x.nbytes

    for (name_x, x), (name_y, y) in pairs:
        if x is None or y is None or not x.size or not y.size:
            continue
        (x0, x1), (y0, y1) = span(x), span(y)
        same = x0 == y0 and x.shape == y.shape and x.dtype == y.dtype
        if x0 < y1 and y0 < x1 and not same:
            raise ValueError(f"{name_x} overlaps {name_y} without being the same array: give separate buffers, "
                             f"or {name_y} itself to merge in place")


def merge_states(out_a, lse_a, out_b, lse_b, *, out=None, lse_out=None):
    """Merges two attention states of the same rows over disjoint key sets.

    Args:
        out_a, out_b: ``[N, H, D]`` device arrays (torch, CuPy, any DLPack), float16 or bfloat16
            (both the same), C-contiguous, 8-byte aligned: normalised attention outputs, as
            :meth:`BatchAttention.run` writes them. ``D`` a multiple of 4, at most 1024.
        lse_a, lse_b: ``[N, H]`` float32 device arrays: their natural-log LSEs, as ``run(...,
            return_lse=True)`` returns them (not base 2). -inf marks a row whose side saw no key.
        out: optional ``[N, H, D]`` destination of the same dtype; ``out_a`` or ``out_b`` itself
            merges in place. A new array otherwise.
        lse_out: optional ``[N, H]`` float32 destination of the merged LSE (``lse_a`` or
            ``lse_b`` itself: in place); a new array otherwise.

    Returns:
        ``(out, lse_out)``: arrays allocated here come back in ``out_a``'s framework, zero copy
        (torch in, torch out; else CuPy). Launched on the caller's stream (torch's current stream
        for torch tensors, else CuPy's current stream of ``out_a``'s device), on ``out_a``'s device
        whatever device is current; no host sync, so it may be captured in a CUDA graph (give
        ``out`` and ``lse_out`` there).

    Rows with one side empty (lse -inf) get the other side's output bits exactly and its LSE (to
    an ulp); rows with both sides empty get ``out = 0`` and ``lse = -inf``, the library's result
    for a row that sees no key; a NaN on either side gives NaN. A +inf LSE is no state (NaN out).

    Raises:
        TypeError: NumPy (host) arrays, an output dtype other than float16 / bfloat16 or differing
            between the arrays, an LSE that is not float32.
        ValueError: shapes that do not match (``[N, H, D]`` and ``[N, H]``), a head dim that is not
            a multiple of 4 (or above 1024), arrays that are not C-contiguous, misaligned or on
            different devices, an output that overlaps an input without being it, ``out`` /
            ``lse_out`` not given inside a CUDA-graph capture.
        RuntimeError: no usable CUDA device.
    Nothing is launched or written when it raises.
    """
    given = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b, "out": out, "lse_out": lse_out}
    _arrays.require_cuda()
    import cupy

    device = _arrays.device_of(out_a)  # out_a's device: current for the whole call, whatever the caller's is
    # a host out_a: no device to enter (to_cupy refuses it below with its own message)
    with cupy.cuda.Device(device) if device is not None else contextlib.nullcontext():
        return _merge(given, out, lse_out, out_a)


def _merge(given, out, lse_out, out_a):
    import cupy

    stream = _arrays.caller_stream(*given.values(), device_id=cupy.cuda.runtime.getDevice())
    with stream:  # DLPack exchange on the caller's stream (a capture must see no foreign stream)
        dev = {k: (_arrays.to_cupy(v, k) if v is not None else None) for k, v in given.items()}
    name = check_shapes(dev["out_a"], dev["lse_a"], dev["out_b"], dev["lse_b"], dev["out"], dev["lse_out"])
    device = dev["out_a"].device.id
    for key in given:
        x = dev[key]
        if x is not None:
            _arrays.check_device_array(x, key, device_id=device, align=4 if key.startswith("lse") else 8)
    capturing = stream.is_capturing()
    if capturing and (out is None or lse_out is None):
        raise ValueError("out and lse_out must be given when merge_states runs inside a CUDA-graph capture")
    _check_overlap([(("out", dev["out"]), ("out_a", dev["out_a"])), (("out", dev["out"]), ("out_b", dev["out_b"])),
                    (("lse_out", dev["lse_out"]), ("lse_a", dev["lse_a"])),
                    (("lse_out", dev["lse_out"]), ("lse_b", dev["lse_b"])),
                    (("out", dev["out"]), ("lse_a", dev["lse_a"])), (("out", dev["out"]), ("lse_b", dev["lse_b"])),
                    (("lse_out", dev["lse_out"]), ("out_a", dev["out_a"])),
                    (("lse_out", dev["lse_out"]), ("out_b", dev["out_b"])),
                    (("out", dev["out"]), ("lse_out", dev["lse_out"]))])
    n, h, d = (int(s) for s in dev["out_a"].shape)
    with stream:
        out_dev = dev["out"] if dev["out"] is not None else cupy.empty_like(dev["out_a"])
        lse_dev = dev["lse_out"] if dev["lse_out"] is not None else cupy.empty((n, h), np.float32)
        rows = n * h
        if rows:
            kernel = catalog.merge_states_kernel(name)
            rows_per_cta = kernel.threads // (d // 4)
            params = _params.make(
                "MergeStatesParams", out_a=dev["out_a"].data.ptr, lse_a=dev["lse_a"].data.ptr,
                out_b=dev["out_b"].data.ptr, lse_b=dev["lse_b"].data.ptr, out=out_dev.data.ptr,
                lse=lse_dev.data.ptr, rows=rows, head_dim=d, rows_per_cta=rows_per_cta)
            ctas = min(-(-rows // rows_per_cta), 32 * _build.device_attribute("MultiProcessorCount", device))
            _build.launch(kernel, (ctas,), params, stream)
        result_out = out if out is not None else _arrays.to_caller(out_dev, out_a)
        result_lse = lse_out if lse_out is not None else _arrays.to_caller(lse_dev, out_a)
    return result_out, result_lse
