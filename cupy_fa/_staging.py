"""A checked step's inputs into the plan buffers (``cupy_fa.plan.PlanBuffers``) with copies and
memsets only: no CuPy kernel (nothing to compile on first use) and as few driver calls as the
layout allows (a host step's lengths and page table in one copy). ``cupy_fa.plan`` exports
:func:`stage_inputs`; ``BatchAttention.plan`` and ``GraphRunner.run`` stage through it."""

import numpy as np

from . import _build


MIRRORED_TABLE_BYTES = 128 << 10  # host page tables up to this size go over with the lengths, in one copy


def stage_inputs(buffers, step, pad_to=None, stream=None):
    """Copies a checked step's inputs into the plan buffers on ``stream`` (default: CuPy's current
    one), with copies and memsets only (no CuPy kernel): a host step's lengths and page table in
    one copy from the host mirror (a table over MIRRORED_TABLE_BYTES in a second one, from the
    caller's array), device ones device to device. Returns the page table's row stride in the buffer.

    Without ``pad_to`` (``BatchAttention.plan``) the page table is written densely, its rows
    ``page_columns`` apart (one copy of the caller's table). With ``pad_to`` (``GraphRunner``: a
    graph captured for the buffers' full width) rows sit at the buffer's width, the columns the
    caller's table lacks read as no page (-1: a kv_len past the caller's table is caught,
    status.cuh, never stale), and rows ``step.batch .. pad_to - 1`` become padding (q_len = 0,
    kv_len = 0: they read and write nothing)."""
    cupy = _cupy()
    if stream is None:
        stream = cupy.cuda.get_current_stream()
    runtime, s = cupy.cuda.runtime, stream.ptr
    batch, pages, cap = step.batch, step.page_columns, buffers.capacity.max_batch_size
    width = buffers.page_table.shape[1]
    dense = pad_to is None
    stride = pages if dense else width
    dst = buffers.page_table.data.ptr
    if step.on_host:
        host = buffers.host_inputs
        last = buffers.staged_batch
        if last > batch:  # zeros past this batch (the padding rows a graph step reads)
            host[batch:last] = 0
            host[cap + batch:cap + last] = 0
        host[:batch] = step.q_host
        host[cap:cap + batch] = step.kv_host
        buffers.staged_batch = batch
        table, rows = step.pt_host, 0
        if batch and pages:
            if table.nbytes <= MIRRORED_TABLE_BYTES or not dense:  # into the mirror, copied with the lengths
                mirrored = host[2 * cap:2 * cap + batch * stride].reshape(batch, stride)
                mirrored[:, :pages] = table
                if stride > pages:  # a graph step: its width, -1 past the caller's columns
                    mirrored[:, pages:] = -1
                rows = batch
            elif table.dtype != np.int32 or not table.flags.c_contiguous:
                table = np.ascontiguousarray(table, np.int32)
        # q_lens and kv_lens whole (zeros past the batch), then the mirrored table rows: one copy
        runtime.memcpyAsync(buffers.inputs.data.ptr, buffers.host_inputs_ptr, 4 * (2 * cap + rows * stride),
                            runtime.memcpyHostToDevice, s)
        if batch and pages and not rows:  # a large table straight from the caller's array: a second copy
            runtime.memcpyAsync(dst, table.__array_interface__["data"][0], table.nbytes, runtime.memcpyHostToDevice,
                                s)
    else:
        _copy_ints(buffers.q_lens, step.q_dev, batch, stream)
        _copy_ints(buffers.kv_lens, step.kv_dev, batch, stream)
        if pad_to is not None and pad_to > batch:
            for half in (buffers.q_lens, buffers.kv_lens):
                runtime.memsetAsync(half.data.ptr + 4 * batch, 0, 4 * (pad_to - batch), s)
        if batch and pages:
            table = step.pt_dev
            if table.dtype == np.int32 and table.flags.c_contiguous:
                if stride == pages:
                    runtime.memcpyAsync(dst, table.data.ptr, 4 * batch * pages, runtime.memcpyDeviceToDevice, s)
                else:
                    runtime.memcpy2DAsync(dst, 4 * stride, table.data.ptr, 4 * pages, 4 * pages, batch,
                                          runtime.memcpyDeviceToDevice, s)
            else:  # another integer type, or strided: CuPy converts (its copy kernel)
                with stream:
                    rows = cupy.ndarray((batch, stride), np.int32, buffers.page_table.data)
                    rows[:, :pages] = table
            if not dense and pages < width:
                _build.memset_d2d32(dst + 4 * pages, 4 * width, -1, width - pages, batch, s)
    if step.mask_host is not None and step.mask_host.size:
        buffers.custom_mask[:step.mask_host.size].set(step.mask_host, stream)
    elif step.mask_dev is not None and step.mask_dev.size:
        with stream:
            buffers.custom_mask[:step.mask_dev.size] = step.mask_dev
    return stride


def _cupy():
    import cupy

    return cupy


def _copy_ints(dst, src, count, stream):
    """``dst[:count] = src`` (int32 buffer, device ints): a device copy where ``src`` is int32 and
    contiguous, else CuPy's converting copy."""
    if not count:
        return
    if src.dtype == np.int32 and src.flags.c_contiguous:
        import cupy

        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, 4 * count, cupy.cuda.runtime.memcpyDeviceToDevice,
                                      stream.ptr)
    else:
        with stream:
            dst[:count] = src
