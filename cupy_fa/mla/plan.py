"""MLA's plan metadata: :class:`cupy_fa.plan.PlanBuffers` (lengths, page table, mask, plan_kernel's
outputs, the status word) with split partials of 512 columns sized for MLA, and the PlanParams of an
MLA schedule (:mod:`cupy_fa.mla.schedule`). The plan kernel itself, the staging of
a step's inputs and every host check are :mod:`cupy_fa.plan`'s."""

import dataclasses

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
    return _plan.plan_params_of(buffers, batch_size, num_heads, _schedule.plan_constants(schedule), max_q_len,
                                max_kv_len)


def plan_launch(buffers, batch_size, num_heads, schedule, max_q_len, max_kv_len):
    """The plan kernel's packed launch over ``buffers`` for an MLA schedule (cupy_fa.plan.packed_plan:
    one struct per set of buffers, each step's fields rewritten in place)."""
    constants = _schedule.plan_constants(schedule)
    return _plan.packed_plan(buffers, batch_size, num_heads, tuple(constants[f] for f in _plan.PLAN_CONSTANTS),
                             max_q_len, max_kv_len)


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
