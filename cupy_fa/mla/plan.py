"""MLA's plan metadata: the buffers of :class:`cupy_fa.plan.PlanBuffers` (lengths, page table, mask,
plan_kernel's outputs, the status word) with split partials of 512 columns sized for MLA, and the
PlanParams of an MLA schedule (:mod:`cupy_fa.mla.schedule`). The plan kernel itself, the staging of
a step's inputs and every host check are :mod:`cupy_fa.plan`'s."""

import dataclasses

import numpy as np

from .. import _params as _lib_params
from .. import plan as _plan
from . import schedule as _schedule

VALUE_DIM = 512
SPLITS_PER_TOKEN = 8            # the partials hold at least this many splits of every token of the capacity
WORKSPACE_BYTES = 256 << 20     # and at least this many bytes


def partial_rows(capacity, num_heads, elem_bytes, workspace_bytes=None):
    """Rows of the split partials: at least ``workspace_bytes`` (default WORKSPACE_BYTES) of them and
    at least SPLITS_PER_TOKEN per token of the capacity (so a batch of full-capacity decode or
    verify tokens over 4096 keys never overflows them); a row is H x (512 outputs + one fp32 LSE)."""
    row_bytes = num_heads * (VALUE_DIM * elem_bytes + 4)
    budget = WORKSPACE_BYTES if workspace_bytes is None else int(workspace_bytes)
    return max(budget // row_bytes, SPLITS_PER_TOKEN * capacity.max_num_tokens, 1)


class MlaPlanBuffers(_plan.PlanBuffers):
    """The plan buffers of one capacity for MLA: PlanBuffers' metadata, 512-column partials."""

    def __init__(self, capacity, num_heads, dtype_name, workspace_bytes=None):  # noqa: super().__init__ not called
        from .. import _arrays

        _arrays.require_cuda()
        import cupy

        self.capacity = capacity
        b = capacity.max_batch_size
        i32 = np.int32
        self.q_lens, self.kv_lens = cupy.zeros(b, i32), cupy.zeros(b, i32)
        self.page_table = cupy.zeros((b, max(capacity.max_pages_per_request, 1)), i32)
        self.custom_mask = cupy.zeros(max(capacity.max_mask_bytes, 1), np.uint8)
        for name in ("q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr"):
            setattr(self, name, cupy.zeros(b + 1, i32))
        for name in ("num_splits", "split_keys", "key_base"):
            setattr(self, name, cupy.zeros(b, i32))
        self.status = cupy.full(1, (1 << 64) - 1, np.uint64)
        dtype = _arrays.DTYPES[dtype_name]
        rows = partial_rows(capacity, num_heads, dtype.itemsize, workspace_bytes)
        self.partial_out = cupy.empty((rows, num_heads, VALUE_DIM), dtype)
        self.partial_lse = cupy.empty((rows, num_heads), np.float32)

    def mla_plan_params(self, batch_size, num_heads, schedule, max_q_len, max_kv_len):
        """PlanParams for an MLA schedule (one KV head: group size H)."""
        return _lib_params.make(
            "PlanParams", q_lens=self.q_lens.data.ptr, kv_lens=self.kv_lens.data.ptr,
            q_indptr=self.q_indptr.data.ptr, work_indptr=self.work_indptr.data.ptr,
            long_work_indptr=self.long_work_indptr.data.ptr, num_splits=self.num_splits.data.ptr,
            split_keys=self.split_keys.data.ptr, partial_indptr=self.partial_indptr.data.ptr,
            mask_indptr=self.mask_indptr.data.ptr, status=self.status.data.ptr, batch_size=batch_size,
            group_size=num_heads, max_q_len=int(max_q_len), max_kv_len=int(max_kv_len),
            partial_capacity=self.partial_out.shape[0], **_schedule.plan_constants(schedule),
            key_base=self.key_base.data.ptr, window=0)


@dataclasses.dataclass
class MlaPlanState:
    """A planned MLA step as the host knows it (``MLAAttention.planned``)."""
    batch_size: int
    num_tokens: int            # sum(q_lens) for host lengths, else None
    schedule: _schedule.MlaSchedule
    mask_mode: int
    sm_scale: float
    step: object               # the cupy_fa.plan.StepInputs it was checked with
    stream: object
    done: object               # event after the plan kernel (None inside a capture)
    mask_entries: int = 0
    check: bool = False
    checked_geometry: set = dataclasses.field(default_factory=set)
    other_streams: dict = dataclasses.field(default_factory=dict)
