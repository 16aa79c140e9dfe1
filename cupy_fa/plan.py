"""Per-step metadata: the device buffers, the plan kernel, and the validation of a step's inputs.

The schedule itself (offsets, row tiles, KV splits) is computed by exactly one piece of code,
``kernels/shared/plan.cu``, on the device, from ``q_lens`` / ``kv_lens`` in buffers allocated once for
a capacity. Eager ``plan()`` and a CUDA-graph replay run that same kernel, so they cannot drift.
The policy it applies (tile, split size, budgets) comes from :mod:`cupy_fa.schedule`
(``schedule.plan_constants``); this module holds the buffers, fills them (:func:`stage_inputs`)
and checks host inputs against the contract before anything is launched (:func:`check_step`,
used by ``BatchAttention.plan`` and ``GraphRunner.run`` alike).
"""

import dataclasses
import functools
import math

import numpy as np

from . import _arrays, _build, _params, _views, catalog, schedule
from ._staging import MIRRORED_TABLE_BYTES, HostMirrors, stage_inputs  # noqa: F401 - plan's names
from .knobs import knobs


MASK_NONE, MASK_CAUSAL, MASK_CUSTOM = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Sizes the buffers are allocated for; a plan must fit inside them."""
    max_batch_size: int
    max_num_tokens: int          # sum of q_len over a step
    max_pages_per_request: int   # columns of the page table
    max_mask_bytes: int = 0      # sum of q_len^2 over a step with a custom mask

    def grown_to(self, batch, tokens, pages, mask_bytes):
        """A capacity at least this large and large enough for the request."""
        def grow(have, need):
            return have if need <= have else max(need, 2 * have)
        return Capacity(grow(self.max_batch_size, batch), grow(self.max_num_tokens, tokens),
                        grow(self.max_pages_per_request, pages), grow(self.max_mask_bytes, mask_bytes))

    def fits(self, batch, tokens, pages, mask_bytes):
        return (batch <= self.max_batch_size and tokens <= self.max_num_tokens
                and pages <= self.max_pages_per_request and mask_bytes <= self.max_mask_bytes)


class BatchInvarianceWarning(RuntimeWarning):
    """A planned batch whose split partials do not fit the instance's workspace: plan_kernel caps
    every request's splits at an equal share, so the step's results may depend on the rest of its
    batch (decode == verify bits are not kept for it). Said once per instance; a larger
    ``workspace_bytes`` (the number the message names) keeps them."""


class PlanBuffers:
    """Device buffers for one capacity: the step's inputs (lengths, page table,
    mask), the plan kernel's outputs, and the split-KV workspace, on the device current when they
    are made (``device_id``). ``q_lens``, ``kv_lens`` and ``page_table`` are consecutive parts of
    one array (``inputs``), so a host step's lengths and page table go over in one copy from a host
    mirror (``mirrors``; :func:`stage_inputs`)."""

    def __init__(self, capacity, num_qo_heads, head_dim, dtype_name, partial_rows=None, workspace_bytes=None):
        # (partial_rows: the split partials' rows where a caller sizes them itself: cupy_fa.mla;
        # else schedule.partial_rows of the capacity and workspace_bytes)
        _arrays.require_cuda()  # a plain sentence, not CuPy's, where there is no usable device
        import cupy

        self.capacity = capacity
        self.device_id = cupy.cuda.runtime.getDevice()
        b = capacity.max_batch_size
        i32 = np.int32
        width = max(capacity.max_pages_per_request, 1)
        # q_lens, kv_lens and the page table, one after another in one array: a host step's lengths
        # and a small page table go over in one copy (stage_inputs)
        self.inputs = cupy.zeros(2 * b + b * width, i32)
        self.lengths = self.inputs[:2 * b]
        self.q_lens, self.kv_lens = self.inputs[:b], self.inputs[b:2 * b]
        self.page_table = self.inputs[2 * b:].reshape(b, width)
        self.custom_mask = cupy.zeros(max(capacity.max_mask_bytes, 1), np.uint8)
        self.q_indptr = cupy.zeros(b + 1, i32)
        self.work_indptr = cupy.zeros(b + 1, i32)       # the small-q family's work list
        self.long_work_indptr = cupy.zeros(b + 1, i32)  # the long family's (requests of more than SMALL_Q_LEN)
        self.partial_indptr = cupy.zeros(b + 1, i32)
        self.mask_indptr = cupy.zeros(b + 1, i32)
        self.num_splits = cupy.zeros(b, i32)
        self.split_keys = cupy.zeros(b, i32)
        self.key_base = cupy.zeros(b, i32)              # keys before each request's first split (a window's)
        self.status = cupy.empty(1, np.uint64)          # kernels/shared/status.cuh: all ones, no bad request
        self.status.data.memset_async(0xFF, 8)          # (a memset: no CuPy kernel to compile on first use)
        dtype = _arrays.DTYPES[dtype_name]
        rows = schedule.partial_rows(b, num_qo_heads, head_dim, dtype.itemsize, workspace_bytes) \
            if partial_rows is None else partial_rows
        self.partial_out = cupy.empty((rows, num_qo_heads, head_dim), dtype)  # in q's dtype, like FlashInfer's tmp_v
        self.partial_lse = cupy.empty((rows, num_qo_heads), np.float32)
        self.mirrors = HostMirrors(2 * b + b * width)  # what host steps stage (lengths: zeros past the batch)
        self._plan_launch = None
        self._plan_tiles = None  # (tile, long_tile, knobs, their plan constants) of the last plan
        self.stage_launch = None  # the staging kernel's launch (cupy_fa._staging), made at its first use
        self.staged_parts = None  # the parts its parameters hold now (copy_parts repacks only when they change)

    @property
    def last_plan_launch(self):
        """The plan kernel's launch as the last :meth:`plan_launch` packed it."""
        return self._plan_launch

    @property
    def partial_row_bytes(self):
        """Bytes of one split-partial row (its outputs and LSE), as the buffers hold them."""
        return (self.partial_out.nbytes + self.partial_lse.nbytes) // self.partial_out.shape[0]

    def plan_params(self, batch_size, group_size, tile, long_tile=None, max_q_len=2**31 - 1,
                    max_kv_len=2**31 - 1, window=0):
        """PlanParams for a step whose small-q requests run on ``tile`` (work_indptr) and whose
        longer ones on ``long_tile`` (long_work_indptr); without ``long_tile`` every request is
        laid out for ``tile`` in work_indptr (schedule.plan_constants). Device lengths above
        ``max_q_len`` / ``max_kv_len`` (the bounds the grids were sized with) are refused. With a
        sliding ``window`` (> 0) each request's splits cover only its queries' windows, from its
        ``key_base`` (kernels/shared/plan.cu window_key_base)."""
        return plan_params_of(self, batch_size, group_size, schedule.plan_constants(tile, long_tile), max_q_len,
                              max_kv_len, window)

    def plan_launch(self, batch_size, group_size, tile, long_tile=None, max_q_len=2**31 - 1, max_kv_len=2**31 - 1,
                    window=0):
        """The plan kernel's :class:`cupy_fa._build.PackedLaunch` with :meth:`plan_params`' bytes
        (:func:`packed_plan`), the tiles' policy constants kept for the next plan."""
        k, last = knobs(), self._plan_tiles
        if last is None or last[0] is not tile or last[1] is not long_tile or last[2] is not k:
            last = self._plan_tiles = (tile, long_tile, k, _plan_constants(tile, long_tile, k))
        return packed_plan(self, batch_size, group_size, last[3], max_q_len, max_kv_len, window)


_PLAN = _params.DTYPES["PlanParams"]
# PlanParams' policy fields (schedule.plan_constants; MLA's: cupy_fa.mla.schedule.plan_constants), in the struct's order
PLAN_CONSTANTS = ("block_m", "block_n", "long_q_len", "long_block_m", "long_block_n", "split_size", "max_splits",
                  "small_q_len", "split_row_budget", "splits_per_cta", "fold_splits")


# (in the struct's order: batch_size .. max_kv_len are one run of int32s, packed in one call)
_set_plan = _params.field_setter("PlanParams", ("batch_size", "group_size") + PLAN_CONSTANTS
                                 + ("max_q_len", "max_kv_len", "window"))


def plan_params_of(buffers, batch_size, group_size, constants, max_q_len=2**31 - 1, max_kv_len=2**31 - 1, window=0):
    """PlanParams over ``buffers`` (a PlanBuffers: their addresses and split-partial capacity) with the
    policy fields ``constants`` (a plan_constants dict: cupy_fa.schedule's for a pair of tiles, or
    cupy_fa.mla.schedule's for an MLA schedule), the step's batch, group size and bounds."""
    return _params.make(
        "PlanParams", q_lens=buffers.q_lens.data.ptr, kv_lens=buffers.kv_lens.data.ptr,
        q_indptr=buffers.q_indptr.data.ptr, work_indptr=buffers.work_indptr.data.ptr,
        long_work_indptr=buffers.long_work_indptr.data.ptr,
        num_splits=buffers.num_splits.data.ptr, split_keys=buffers.split_keys.data.ptr,
        partial_indptr=buffers.partial_indptr.data.ptr, mask_indptr=buffers.mask_indptr.data.ptr,
        status=buffers.status.data.ptr, batch_size=batch_size, group_size=group_size,
        max_q_len=int(max_q_len), max_kv_len=int(max_kv_len),
        partial_capacity=buffers.partial_out.shape[0], **constants,
        key_base=buffers.key_base.data.ptr, window=int(window))


def packed_plan(buffers, batch_size, group_size, constants, max_q_len=2**31 - 1, max_kv_len=2**31 - 1, window=0):
    """The plan kernel's :class:`cupy_fa._build.PackedLaunch` over ``buffers``: one struct per set of
    buffers (``buffers._plan_launch``, :func:`plan_params_of`' bytes at its first step), each step's
    fields rewritten in place (``constants``: the policy fields' values in PLAN_CONSTANTS order)."""
    launch = buffers._plan_launch
    if launch is None:
        packed = np.array([plan_params_of(buffers, batch_size, group_size, dict(zip(PLAN_CONSTANTS, constants)),
                                          max_q_len, max_kv_len, window)], _PLAN)
        launch = buffers._plan_launch = _build.PackedLaunch(catalog.PLAN_KERNEL, (1,), packed, buffers.device_id)
    _set_plan(launch.raw, (batch_size, group_size) + tuple(constants) + (int(max_q_len), int(max_kv_len), int(window)))
    return launch


@functools.lru_cache(maxsize=256)
def _plan_constants(tile, long_tile, knobs_in_force):
    """schedule.plan_constants' values in PLAN_CONSTANTS order, once per (tiles, knobs)."""
    found = schedule.plan_constants(tile, long_tile)
    return tuple(int(found[f]) for f in PLAN_CONSTANTS)


# ---- a planned step -------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class PlanState:
    """A planned step as the host knows it: its schedule (``cupy_fa.schedule.StepSchedule``: the
    launches, tiles and grids), the mask and scale, the host lengths and page table it was checked
    with (None where they live on the device), the stream and event of its plan kernel, and the
    attention variant it runs (window, soft-cap). ``BatchAttention.planned`` returns it."""
    batch_size: int
    num_tokens: int            # sum of q_lens if known on the host, else None
    schedule: schedule.StepSchedule  # the launches (family, tile, grid) and the merge (cupy_fa.schedule)
    mask_mode: int
    sm_scale: float
    host_page_table: object    # numpy, for validation against the cache in run(); None if device-planned
    host_q_lens: object
    host_kv_lens: object
    page_table_columns: int
    stream_ptr: int            # stream the metadata was written on
    done: object               # event after the plan kernel (None if planned inside a capture)
    stream: object = None      # that stream (a later plan on another one waits for it)
    mask_entries: int = 0      # custom-mask entries the buffers hold for this plan (the kernels' bound)
    check: bool = False        # plan(check=True) or CUPY_FA_DEBUG=1: sync and raise on a bad request
    checked_geometry: set = dataclasses.field(default_factory=set)
    other_streams: dict = dataclasses.field(default_factory=dict)  # ptr -> stream of runs on other streams
    window: int = 0            # sliding window W (keys a query sees, itself included); 0 = none
    soft_cap: float = 0.0      # logits soft-cap; 0 = none
    prepared: object = None    # its launches with their parameters packed (cupy_fa.launch), made by the first run
    page_table_stride: int = 0  # entries between page-table rows in the buffer (0: the buffer's width)
    repeat: object = None      # a device-length plan's inputs (BatchAttention.plan_staged): a plan of the same repeats it

    # what a decode-like step runs (the small-q launch; a step of long requests only: theirs)
    @property
    def tile(self):
        return self.schedule.tile

    @property
    def work_grid(self):
        return self.schedule.work_grid

    @property
    def needs_merge(self):
        return self.schedule.needs_merge

    @property
    def long_tile(self):
        """The tile of the step's requests of more than SMALL_Q_LEN tokens, None without a long launch."""
        return self.schedule.long.tile if self.schedule.long is not None else None


# ---- host-side checks and bounds ----------------------------------------------------


def check_count(name, value, least):
    """A capacity argument: an int of at least ``least`` (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def checked_sm_scale(sm_scale, head_dim):
    """The softmax scale a plan runs with: ``1 / sqrt(head_dim)`` for None, else a positive finite float."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if not (isinstance(sm_scale, (int, float, np.floating)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
    return float(sm_scale)



def validate_lengths(q_lens, kv_lens):
    """Contract checks on host lengths: raises naming the argument and request."""
    if q_lens.shape == kv_lens.shape and (not q_lens.size or (
            q_lens.min() >= 0 and not (q_lens > kv_lens).any() and kv_lens.max() < 2**31)):
        return  # (q_len >= 0 and q_len <= kv_len bound kv_len below, kv_len < 2^31 bounds q_len above)
    if q_lens.shape != kv_lens.shape:
        raise ValueError(f"q_lens and kv_lens must have the same length, got {q_lens.shape[0]} and {kv_lens.shape[0]}")
    for name, arr in (("q_lens", q_lens), ("kv_lens", kv_lens)):
        bad = np.flatnonzero(arr < 0)
        if bad.size:
            raise ValueError(f"{name}[{bad[0]}] = {arr[bad[0]]} is negative")
        if arr.size and arr.max() >= 2**31:
            raise ValueError(f"{name} entries must fit in int32")
    bad = np.flatnonzero(q_lens > kv_lens)
    if bad.size:
        b = bad[0]
        raise ValueError(f"q_lens[{b}] = {q_lens[b]} > kv_lens[{b}] = {kv_lens[b]}: kv_len counts the valid keys "
                         f"AFTER this step's K/V were written, so it is at least q_len")


def validate_batch_shapes(batch, kv_entries, page_table_rows):
    """One kv_len and one page-table row per request (q_lens has `batch` entries). The lengths
    are compared first: when q_lens and kv_lens disagree, the batch size itself is in doubt,
    and a message about page-table rows would point at the wrong argument."""
    if kv_entries != batch:
        raise ValueError(f"q_lens and kv_lens differ in length ({batch} and {kv_entries}): "
                         f"give one q_len and one kv_len per request")
    if page_table_rows != batch:
        raise ValueError(f"page_table has {page_table_rows} rows, expected one per request ({batch})")


def validate_page_table_width(columns, kv_lens, q_lens, page_size):
    """Every live request's kv_len fits in `columns` pages of the table."""
    needed = -(-kv_lens // page_size)  # ceil
    live = q_lens > 0
    if live.any() and needed[live].max() > columns:
        b = int(np.flatnonzero(live & (needed > columns))[0])
        raise ValueError(f"page_table has {columns} columns but request {b} needs {needed[b]} pages "
                         f"for kv_len {kv_lens[b]} at page_size {page_size}")
    return needed, live


def validate_page_table(page_table, kv_lens, q_lens, page_size, num_pages):
    """Every live request's table row covers kv_len and names pages of the cache."""
    needed, live = validate_page_table_width(page_table.shape[1], kv_lens, q_lens, page_size)
    usual = page_table.dtype == np.int32
    if usual and (not page_table.size or _MAX(page_table.view(np.uint32), axis=None) < num_pages):
        return  # every entry a page (a negative one is above 2^31 as uint32): one reduction, the usual table
    read = live[:, None] & (np.arange(page_table.shape[1]) < needed[:, None])  # the entries the kernel reads
    bad = read & ((page_table < 0) | (page_table >= num_pages))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])  # row-major: the first bad entry
        raise ValueError(f"page_table[{b}, {j}] = {page_table[b, j]} is not a page of the cache "
                         f"(0 <= page < num_pages = {num_pages})")


def validate_mask_size(entries, q_lens):
    """A flat custom mask holds each request's q_len x q_len block: sum(q_lens**2) entries."""
    expected = int((np.asarray(q_lens) ** 2).sum())
    if entries != expected:
        raise ValueError(f"custom_mask has {entries} entries, expected sum(q_lens**2) = {expected}")


# ---- a step's inputs: checked once, staged once ----------------------------------------


@dataclasses.dataclass(slots=True)
class StepInputs:
    """A step's metadata inputs after :func:`check_step`: each one either a host NumPy array
    (``*_host``) or a device CuPy view (``*_dev``), the other None."""
    batch: int
    q_host: object
    q_dev: object
    kv_host: object
    kv_dev: object
    pt_host: object
    pt_dev: object
    mask_host: object            # flat uint8, or None
    mask_dev: object
    num_tokens: int | None       # sum(q_lens) when the lengths are on the host
    max_q_len: int               # max(q_lens) on the host, else the bound the caller gave
    mask_bytes: int              # entries of the custom mask (or the bound batch x max_q_len^2)
    stream: object               # the stream of the DLPack exchange (device inputs), else None

    @property
    def on_host(self):
        return self.q_host is not None

    @property
    def max_kv_len(self):
        """max(kv_lens) of host lengths (None for device ones); no plan reads it (the host checked them)."""
        if self.kv_host is None:
            return None
        return int(self.kv_host.max()) if self.kv_host.size else 0

    @property
    def page_columns(self):
        return int((self.pt_host if self.pt_host is not None else self.pt_dev).shape[1])

    @property
    def has_mask(self):
        return self.mask_host is not None or self.mask_dev is not None


_MAX, _MIN, _SUM = np.maximum.reduce, np.minimum.reduce, np.add.reduce  # (the ufuncs, not the methods' wrappers)
_BELOW_2_31 = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16))  # every value < 2^31
_last_q = None  # the last NumPy q_lens check_step saw: (bytes, dtype, as int64, min, max, sum)


def check_step(q_lens, kv_lens, page_table, custom_mask=None, *, max_q_len=None, device_id=None, bound=None,
               stream=None):
    """Parses a step's inputs (lists, NumPy, CPU torch, or device arrays of any DLPack framework)
    and checks everything of the contract the host can see, before anything touches the device:
    one kv_len and one page-table row per request, lengths on the host valid (non-negative,
    ``q_len <= kv_len``, int32), a host custom mask of ``sum(q_lens**2)`` entries, and for device
    lengths a ``max_q_len`` bound, and with ``device_id`` that every device input lives on that
    device (``bound`` says why, for the message). Raises ``ValueError`` / ``TypeError`` naming
    the argument. ``stream``: the caller's stream where it is known (else found here).
    ``BatchAttention.plan`` and ``GraphRunner.run`` both check with it; the page table against
    the cache is :func:`check_page_table`."""
    if (type(q_lens) is np.ndarray and type(kv_lens) is np.ndarray and type(page_table) is np.ndarray
            and custom_mask is None and q_lens.ndim == 1 and page_table.ndim == 2 and q_lens.shape == kv_lens.shape
            and q_lens.size and page_table.shape[0] == q_lens.shape[0] and q_lens.dtype.kind in "iu"
            and kv_lens.dtype.kind in "iu" and page_table.dtype.kind in "iu"):  # NumPy lengths: what an engine gives
        global _last_q
        key, facts = q_lens.tobytes(), _last_q  # (decode-like steps repeat their q_lens step after step)
        if facts is None or facts[0] != key or facts[1] != q_lens.dtype:
            q = q_lens.astype(np.int64)
            q.flags.writeable = False  # (shared by the steps with these q_lens)
            facts = _last_q = (key, q_lens.dtype, q, int(_MIN(q)), int(_MAX(q)), int(_SUM(q)))
        q, min_q, max_q, num_tokens = facts[2:]
        kv = kv_lens.astype(np.int64)
        below = kv_lens.dtype in _BELOW_2_31 or _MAX(kv) < 2**31  # (int32 lengths: below 2^31 by type)
        if min_q >= 0 and below and _MIN(kv - q) >= 0:  # else the general path names the request
            return StepInputs(q.shape[0], q, None, kv, None, page_table, None, None, None, num_tokens, max_q, 0,
                              None)
    kinds = (_views.kind_of(q_lens), _views.kind_of(kv_lens), _views.kind_of(page_table))
    if (kinds == (_views.CUPY,) * 3 and custom_mask is None and max_q_len is not None and q_lens.ndim == 1
            and kv_lens.ndim == 1 and page_table.ndim == 2 and q_lens.dtype.kind in "iu" and kv_lens.dtype.kind in "iu"
            and page_table.dtype.kind in "iu"):  # CuPy lengths and table: a graph step's
        if device_id is not None:
            for name, x in (("q_lens", q_lens), ("kv_lens", kv_lens), ("page_table", page_table)):
                if x.data.device_id != device_id:
                    _arrays.check_device(x, name, device_id, bound)
        batch = q_lens.shape[0]
        validate_batch_shapes(batch, kv_lens.shape[0], page_table.shape[0])
        max_q = int(max_q_len)
        if stream is None:  # the general path's rule (CuPy's current stream here): a capture on it must be seen
            stream = _views.caller_stream((q_lens, kv_lens, page_table),
                                          device_id if device_id is not None else q_lens.data.device_id)
        return StepInputs(batch, None, q_lens, None, kv_lens, None, page_table, None, None, None, max_q,
                          batch * max_q * max_q, stream)
    inputs = (q_lens, kv_lens, page_table, custom_mask)
    if stream is None and not all(x is None or _arrays.is_host(x) for x in inputs):
        _arrays.require_cuda()
        stream = _views.caller_stream(inputs, device_id if device_id is not None else _arrays.current_device_id())

    def ints(x, name, ndim, keep_dtype=False):  # a CuPy array as it is; the rest through host_or_device_ints
        if _views.kind_of(x) == _views.CUPY and x.ndim == ndim and x.dtype.kind in "iu":
            return None, x
        return _arrays.host_or_device_ints(x, name, ndim, keep_dtype)

    def parse():  # (a host page table keeps its integer type: it is staged as int32, checked in run())
        return (ints(q_lens, "q_lens", 1), ints(kv_lens, "kv_lens", 1), ints(page_table, "page_table", 2, True))

    if stream is None:  # host inputs: validated before the device is touched at all
        (q_host, q_dev), (kv_host, kv_dev), (pt_host, pt_dev) = parse()
    else:
        with stream:  # DLPack exchange on the caller's stream: no cross-stream sync
            (q_host, q_dev), (kv_host, kv_dev), (pt_host, pt_dev) = parse()
    if device_id is not None:  # before anything is staged: a copy across devices is no step's input
        for name, x in (("q_lens", q_dev), ("kv_lens", kv_dev), ("page_table", pt_dev)):
            if x is not None:
                _arrays.check_device(x, name, device_id, bound)
    if (q_host is None) != (kv_host is None):
        raise TypeError("q_lens and kv_lens must both be host arrays or both device arrays")
    on_host = q_host is not None
    batch = int((q_host if on_host else q_dev).shape[0])
    pt_shape = (pt_host if pt_host is not None else pt_dev).shape
    validate_batch_shapes(batch, (kv_host if on_host else kv_dev).shape[0], pt_shape[0])
    if on_host:
        validate_lengths(q_host, kv_host)
        num_tokens = int(q_host.sum())
        max_q = int(q_host.max()) if batch else 0
        mask_bytes = 0  # (no mask: not needed; with one, its own size below)
    else:
        if max_q_len is None:
            raise ValueError("max_q_len is required when q_lens / kv_lens are device arrays "
                             "(the host cannot read them without a sync)")
        num_tokens, max_q = None, int(max_q_len)
        mask_bytes = batch * max_q * max_q
    mask_host = mask_dev = None
    if custom_mask is not None:
        mask_host, mask_dev = _mask_input(custom_mask, stream)
        if mask_dev is not None and device_id is not None:
            _arrays.check_device(mask_dev, "custom_mask", device_id, bound)
        n = (mask_host if mask_host is not None else mask_dev).size
        if on_host:
            validate_mask_size(n, q_host)
        mask_bytes = n
    return StepInputs(batch, q_host, q_dev, kv_host, kv_dev, pt_host, pt_dev, mask_host, mask_dev, num_tokens, max_q,
                      mask_bytes, stream)


def _mask_input(custom_mask, stream):
    if isinstance(custom_mask, (list, tuple)):
        custom_mask = np.concatenate([np.asarray(m, dtype=bool).ravel() for m in custom_mask]) \
            if len(custom_mask) else np.zeros(0, bool)
    custom_mask = _arrays.host_to_numpy(custom_mask)
    if isinstance(custom_mask, np.ndarray):
        return np.ascontiguousarray(custom_mask.ravel()).astype(np.uint8), None
    with stream or _arrays.caller_stream(custom_mask):
        dev = _arrays.to_cupy(custom_mask, "custom_mask")
    if dev.dtype not in (np.bool_, np.uint8, np.int8):
        raise TypeError(f"custom_mask must be bool or uint8, got {dev.dtype}")
    return None, dev.ravel()


def check_page_table(step, page_size, num_pages):
    """A host page table names pages of a cache of ``num_pages`` pages and covers every live
    request's kv_len; of a device page table only its width can be checked. Needs host lengths
    (a device-planned step is the caller's contract)."""
    if step.on_host:
        check_table(step.pt_host, step.page_columns, step.kv_host, step.q_host, page_size, num_pages)


def check_table(page_table, columns, kv_lens, q_lens, page_size, num_pages):
    """:func:`check_page_table` of a host step kept as its parts (``cupy_fa.launch.check_run``
    reads them from the plan state): a host ``page_table`` (NumPy) in full, else (None: a device
    table) its ``columns`` against the lengths."""
    if page_table is not None:
        validate_page_table(page_table, kv_lens, q_lens, page_size, num_pages)
    else:  # device page table: its ids can't be read without a sync, its width can
        validate_page_table_width(columns, kv_lens, q_lens, page_size)


def launch_plan(buffers, batch_size, group_size, tile, stream, long_tile=None, max_q_len=2**31 - 1,
                max_kv_len=2**31 - 1, window=0):
    """The plan kernel on ``stream``: ``tile``'s work list for the small-q requests and, with
    ``long_tile``, the long family's list for the others (else every request on ``tile``).
    Requests whose lengths break the contract or the bounds (``max_q_len``, ``max_kv_len``) are
    refused and recorded in the buffers' status word (kernels/shared/status.cuh)."""
    _build.launch_packed(buffers.plan_launch(batch_size, group_size, tile, long_tile, max_q_len, max_kv_len, window),
                         stream.ptr)
