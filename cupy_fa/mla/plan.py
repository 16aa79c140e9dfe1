"""MLA's plan metadata: :class:`cupy_fa.plan.PlanBuffers` (lengths, page table, mask, plan_kernel's
outputs, the status word) with split partials of 512 columns sized for MLA, and the PlanParams of an
MLA schedule (:mod:`cupy_fa.mla.schedule`). The plan kernel itself, the staging of
a step's inputs and every host check are :mod:`cupy_fa.plan`'s."""

import dataclasses

import numpy as np

from .. import _params as _lib_params
from .. import plan as _plan
from ..schedule import partial_row_bytes
from . import schedule as _schedule

VALUE_DIM = 512
SPLITS_PER_TOKEN = 8            # the partials hold at least this many splits of every token of the capacity
WORKSPACE_BYTES = 256 << 20     # and at least this many bytes


def partial_rows(capacity, num_heads, elem_bytes, workspace_bytes=None):
    """Rows of the split partials: at least ``workspace_bytes`` (default WORKSPACE_BYTES) of them and
    at least SPLITS_PER_TOKEN per token of the capacity (so a batch of full-capacity decode or
    verify tokens over 8 x split_size keys (8192 at the default) never overflows them); a row is H x (512
    outputs + one fp32 LSE)."""
    budget = WORKSPACE_BYTES if workspace_bytes is None else int(workspace_bytes)
    rows = budget // partial_row_bytes(num_heads, VALUE_DIM, elem_bytes)
    return max(rows, SPLITS_PER_TOKEN * capacity.max_num_tokens, 1)


def plan_buffers(capacity, num_heads, dtype_name, workspace_bytes=None):
    """cupy_fa.plan.PlanBuffers for one capacity with MLA's split partials: 512 columns a head,
    :func:`partial_rows` of them."""
    from .. import _arrays

    rows = partial_rows(capacity, num_heads, _arrays.DTYPES[dtype_name].itemsize, workspace_bytes)
    return _plan.PlanBuffers(capacity, num_heads, VALUE_DIM, dtype_name, partial_rows=rows)


def plan_params(buffers, batch_size, num_heads, schedule, max_q_len, max_kv_len):
    """PlanParams of an MLA schedule over ``buffers`` (one KV head: group size H; the policy fields
    are cupy_fa.mla.schedule's)."""
    return _lib_params.make(
        "PlanParams", q_lens=buffers.q_lens.data.ptr, kv_lens=buffers.kv_lens.data.ptr,
        q_indptr=buffers.q_indptr.data.ptr, work_indptr=buffers.work_indptr.data.ptr,
        long_work_indptr=buffers.long_work_indptr.data.ptr, num_splits=buffers.num_splits.data.ptr,
        split_keys=buffers.split_keys.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
        mask_indptr=buffers.mask_indptr.data.ptr, status=buffers.status.data.ptr, batch_size=batch_size,
        group_size=num_heads, max_q_len=int(max_q_len), max_kv_len=int(max_kv_len),
        partial_capacity=buffers.partial_out.shape[0], **_schedule.plan_constants(schedule),
        key_base=buffers.key_base.data.ptr, window=0)


_PLAN = _lib_params.DTYPES["PlanParams"]
_set_step = _lib_params.field_setter("PlanParams", ("batch_size", "group_size") + _plan.PLAN_CONSTANTS
                                     + ("max_q_len", "max_kv_len"))


class PlanLaunch:
    """The plan kernel's launch of one MLA instance: a :class:`cupy_fa._build.PackedLaunch` of
    :func:`plan_params`' bytes per set of buffers, each step's fields (batch size, heads, the
    schedule's policy constants, the bounds) rewritten in place, so a plan launches it with one
    driver call."""

    def __init__(self):
        self.buffers = self.launch = None

    def __call__(self, buffers, batch_size, num_heads, schedule, max_q_len, max_kv_len):
        if self.buffers is not buffers:
            packed = np.array([plan_params(buffers, batch_size, num_heads, schedule, max_q_len, max_kv_len)], _PLAN)
            from .. import _build, catalog

            self.launch = _build.PackedLaunch(catalog.PLAN_KERNEL, (1,), packed, buffers.device_id)
            self.buffers = buffers
            return self.launch
        constants = _schedule.plan_constants(schedule)
        _set_step(self.launch.raw, (batch_size, num_heads) + tuple(constants[f] for f in _plan.PLAN_CONSTANTS)
                  + (int(max_q_len), int(max_kv_len)))
        return self.launch


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
    page_table_stride: int = 0  # entries between page-table rows in the buffer (stage_inputs' dense rows)
    checked_geometry: set = dataclasses.field(default_factory=set)
    other_streams: dict = dataclasses.field(default_factory=dict)
    prepared: object = None     # its launches packed (cupy_fa.mla.launch.PreparedStep), made at the first run
