"""A checked step's inputs into the plan buffers (``cupy_fa.plan.PlanBuffers``) with as few
driver calls as the layout allows and no CuPy kernel (nothing to compile on first use): a host
step's lengths and page table in one copy from the host mirror; the device-to-device parts of a
step (device lengths and page table, a device mask, and the caller's ``extra`` copies: a graph
step's q and sinks) in one call, a memcpy where there is one plain part and the staging kernel
(``kernels/shared/stage.cu``: every part's addresses and sizes in its parameter struct) where
there are more. ``cupy_fa.plan`` exports :func:`stage_inputs`; ``BatchAttention.plan`` and
``GraphRunner.run`` stage through it."""

import struct
import weakref

import numpy as np

from . import _build, _params, catalog


MIRRORED_TABLE_BYTES = 128 << 10  # host page tables up to this size go over with the lengths, in one copy
PINNED_MIRRORS = 2                 # pinned host mirrors a PlanBuffers takes in turn (HostMirrors)
PINNED_MIRROR_BYTES = 1 << 20      # the largest of them (a copy of more goes from the pageable mirror)
PINNED_FROM_BYTES = 64 << 10       # the smallest copy sent from them (below it the pageable copy costs no more)
STAGE_CTAS = 264                  # the staging kernel's largest grid (2 CTAs of 256 threads an SM on an H100)
_CTA_BYTES = 16 << 10             # bytes of its largest part per CTA below that (4 passes of 16-byte units)
_RETIRED = []  # (memory, event) of dropped pinned mirrors whose last copy may still be queued

_STAGE = _params.DTYPES["StageParams"]
_COPIES_AT = _STAGE.fields["copies"][1]
# a part: src, dst, bytes a row, rows, src pitch, dst pitch, fill bytes after each row, fill word (StageCopy)
_PART = struct.Struct("<QQqiiiii4x")
_COUNT = struct.Struct("<i")
_INT32 = np.dtype(np.int32)
assert _PART.size == _params.DTYPES["StageCopy"].itemsize


def stage_inputs(buffers, step, pad_to=None, stream=None, extra=(), capturing=False):
    """Copies a checked step's inputs into the plan buffers on ``stream`` (default: CuPy's current
    one), with copies, memsets and at most one staging-kernel launch (no CuPy kernel unless a
    device input is of another integer type or strided): a host step's lengths and page table in
    one copy from the host mirror (a table over MIRRORED_TABLE_BYTES in a second one, from the
    caller's array; a pinned mirror where one is free and the stream is not ``capturing``:
    :class:`HostMirrors`); the device-to-device parts, with ``extra`` (parts as :func:`part` makes them,
    e.g. a graph step's q), in one call (:func:`copy_parts`). Returns the page table's row stride
    in the buffer.

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
    parts = list(extra)
    if step.on_host:
        table, rows = step.pt_host, 0
        if batch and pages:
            if table.nbytes <= MIRRORED_TABLE_BYTES or not dense:  # into the mirror, copied with the lengths
                rows = batch
            elif table.dtype != np.int32 or not table.flags.c_contiguous:
                table = np.ascontiguousarray(table, np.int32)
        words = 2 * cap + rows * stride
        mirror = buffers.mirrors.take(words, capturing)
        host = mirror.array
        last = mirror.staged_batch
        if last > batch:  # zeros past this batch (the padding rows a graph step reads)
            host[batch:last] = 0
            host[cap + batch:cap + last] = 0
        host[:batch] = step.q_host
        host[cap:cap + batch] = step.kv_host
        mirror.staged_batch = batch
        if rows:
            if stride == pages:  # dense: the rows one after the other (a flat copy costs less)
                host[2 * cap:2 * cap + batch * pages] = table.ravel()
            else:  # a graph step: its width, -1 past the caller's columns
                mirrored = host[2 * cap:2 * cap + batch * stride].reshape(batch, stride)
                mirrored[:, :pages] = table
                mirrored[:, pages:] = -1
        # q_lens and kv_lens whole (zeros past the batch), then the mirrored table rows: one copy
        runtime.memcpyAsync(buffers.inputs.data.ptr, mirror.ptr, 4 * words, runtime.memcpyHostToDevice, s)
        if mirror.event is not None:  # pinned: the copy engine reads it later; written again once this passed
            runtime.eventRecord(mirror.event.ptr, s)
        if batch and pages and not rows:  # a large table straight from the caller's array: a second copy
            runtime.memcpyAsync(dst, table.__array_interface__["data"][0], table.nbytes, runtime.memcpyHostToDevice,
                                s)
    else:
        pad = 4 * (pad_to - batch) if pad_to is not None and pad_to > batch else 0
        for lengths, src in ((buffers.q_lens, step.q_dev), (buffers.kv_lens, step.kv_dev)):
            if _int32_row_bytes(src) is not None:  # the batch's lengths, then zeros for the padding rows
                if batch or pad:
                    parts.append((src.data.ptr, lengths.data.ptr, 4 * batch, 1, 0, 0, pad, 0))
            else:
                _copy_ints(lengths, src, batch, stream)
                if pad:
                    runtime.memsetAsync(lengths.data.ptr + 4 * batch, 0, pad, s)
        if batch and pages:
            table = step.pt_dev
            fill = 4 * (width - pages) if not dense and pages < width else 0  # -1 past the caller's columns
            pitch = _int32_row_bytes(table)
            if pitch is not None:
                parts.append((table.data.ptr, dst, 4 * pages, batch, pitch, 4 * stride, fill, -1))
            else:  # another integer type, or strided columns: CuPy converts (its copy kernel)
                with stream:
                    rows = cupy.ndarray((batch, stride), np.int32, buffers.page_table.data)
                    rows[:, :pages] = table
                if fill:
                    _build.memset_d2d32(dst + 4 * pages, 4 * width, -1, width - pages, batch, s)
    if step.mask_host is not None and step.mask_host.size:
        buffers.custom_mask[:step.mask_host.size].set(step.mask_host, stream)
    elif step.mask_dev is not None and step.mask_dev.size:
        mask = step.mask_dev
        if mask.dtype.itemsize == 1 and mask.flags.c_contiguous:  # bool / uint8 / int8: the same bytes
            parts.append(part(mask.data.ptr, buffers.custom_mask.data.ptr, mask.size))
        else:
            with stream:
                buffers.custom_mask[:mask.size] = mask
    copy_parts(buffers, parts, s)
    return stride


class HostMirror:
    """One host copy of a PlanBuffers' inputs (q_lens and kv_lens of the whole capacity, then the
    mirrored page-table rows) that a host step writes and one ``cudaMemcpyAsync`` sends. Pinned
    (``event`` set): the call only queues the copy, the copy engine reads the bytes later, so the
    mirror is written again only once ``event``, recorded after its last copy, has passed.
    Pageable (``event`` None): the driver copies the bytes to its own staging memory before the
    call returns, so the mirror is free at once (the call costs the host that copy)."""

    __slots__ = ("array", "ptr", "staged_batch", "event", "_memory", "__weakref__")

    def __init__(self, words, pinned=False):
        if pinned:
            cupy = _cupy()
            self._memory = cupy.cuda.alloc_pinned_memory(4 * words)
            self.array = np.frombuffer(self._memory, np.int32, words)
            self.array[:] = 0
            self.event = cupy.cuda.Event(disable_timing=True)
            # back to CuPy's pinned pool (which may hand it out again at once) only after its last copy
            weakref.finalize(self, _RETIRED.append, (self._memory, self.event))
        else:
            self._memory, self.event = None, None
            self.array = np.zeros(words, np.int32)
        self.ptr = self.array.ctypes.data
        self.staged_batch = 0  # the batch its lengths hold (zeros past it)


class HostMirrors:
    """A PlanBuffers' host mirrors: ``PINNED_MIRRORS`` pinned ones of up to ``PINNED_MIRROR_BYTES``
    (made on the current device at the first step that takes one), taken in turn while the last
    copy from each has passed, for copies of ``PINNED_FROM_BYTES`` or more; and the pageable one of
    the whole size, taken for smaller copies (there the driver's copy into its staging memory
    costs no more than the pinned copy's event and query: docs/performance.md), when both pinned
    ones are busy or too small, when the stream is capturing (a captured copy from a pinned
    mirror would read it at each replay), or where pinned memory cannot be had. Never a wait: a
    busy pinned mirror only costs that step the pageable copy."""

    def __init__(self, words):
        self.words = words
        self.pageable = HostMirror(words)
        self.pinned = None  # made at first use; [] where pinned memory could not be had
        self._next = 0

    def take(self, words, capturing=False):
        """The mirror a step of ``words`` int32 values is written to and copied from."""
        if capturing or PINNED_MIRRORS == 0 or 4 * words < PINNED_FROM_BYTES:
            return self.pageable
        if _RETIRED:
            _release_retired()
        pinned = self.pinned
        if pinned is None:
            pinned = self.pinned = self._make_pinned()
        if pinned and words <= pinned[0].array.size:
            for k in range(len(pinned)):
                mirror = pinned[(self._next + k) % len(pinned)]
                if mirror.event.done:
                    self._next = (self._next + k + 1) % len(pinned)
                    return mirror
        return self.pageable

    def _make_pinned(self):
        words = min(self.words, PINNED_MIRROR_BYTES // 4)
        try:
            return [HostMirror(words, pinned=True) for _ in range(PINNED_MIRRORS)]
        except Exception as e:  # noqa: BLE001 - a host without pinned memory to spare copies from pageable memory
            import warnings

            warnings.warn(f"cupy_fa: no pinned host memory for the plan's host mirrors ({type(e).__name__}: {e}); "
                          f"host steps copy from pageable memory", RuntimeWarning, stacklevel=4)
            return []


def _release_retired():
    """Lets go of the dropped pinned mirrors whose last copy has passed. (A dropped mirror is kept in
    ``_RETIRED`` by its finalizer, which makes no CUDA call: the garbage collector may run it inside
    a graph capture, where a wait or a query would break the capture. Each entry is popped and put
    back whole, so a finalizer appending meanwhile on another thread loses nothing.)"""
    for _ in range(len(_RETIRED)):
        entry = _RETIRED.pop(0)
        if not entry[1].done:
            _RETIRED.append(entry)


def part(src, dst, nbytes):
    """A plain device-to-device part of a step: ``nbytes`` from ``src`` to ``dst`` (any alignment)."""
    return (src, dst, nbytes, 1, 0, 0, 0, 0)


def copy_parts(buffers, parts, stream_ptr):
    """The device-to-device ``parts`` of a step (StageCopy fields, in their order) on stream
    ``stream_ptr``: one memcpy for a lone plain part, else one launch of the staging kernel
    (kernels/shared/stage.cu) with every part in its parameter struct."""
    if not parts:
        return
    if len(parts) == 1 and parts[0][3] == 1 and not parts[0][6]:
        src, dst, nbytes = parts[0][:3]
        runtime = _cupy().cuda.runtime
        runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDeviceToDevice, stream_ptr)
        return
    if len(parts) > _params.STAGE_COPIES:
        raise RuntimeError(f"internal: {len(parts)} staging parts, the kernel takes {_params.STAGE_COPIES}")
    launch = buffers.stage_launch
    if launch is None:
        launch = buffers.stage_launch = _build.PackedLaunch(catalog.STAGE_KERNEL, (1,), np.zeros(1, _STAGE),
                                                            buffers.device_id)
    if parts != buffers.staged_parts:  # (a graph step's parts repeat while its arrays stay where they are)
        raw, most = launch.raw, 0
        _COUNT.pack_into(raw, 0, len(parts))
        for i, fields in enumerate(parts):
            _PART.pack_into(raw, _COPIES_AT + i * _PART.size, *fields)
            most = max(most, fields[2] * fields[3])
        launch.set_grid(min(max(1, -(-most // _CTA_BYTES)), STAGE_CTAS))
        buffers.staged_parts = parts
    _build.launch_packed(launch, stream_ptr)


def _int32_row_bytes(x):
    """Bytes between rows of device ints ``x`` that are int32 with contiguous columns (the staging
    kernel copies them as they are), else None."""
    if x.dtype != _INT32:
        return None
    if x.flags.c_contiguous:
        row = 4 * x.shape[-1] if len(x.shape) > 1 else 0
        return row if row < 2**31 else None  # (the kernel's pitches are int32: past them, the fallback copy)
    strides = x.strides
    if x.ndim == 2 and strides[1] == 4 and 0 < strides[0] < 2**31:
        return strides[0]
    return None


def _cupy():
    import cupy

    return cupy


def _copy_ints(dst, src, count, stream):
    """``dst[:count] = src`` (int32 buffer, device ints of another type, or strided): CuPy's
    converting copy."""
    if count:
        with stream:
            dst[:count] = src
