"""The launches of a planned MLA step: each attention launch of its schedule (the long class's first),
then the split merge, with their params structs filled in one place."""

import numpy as np

from .. import _build, _params as _lib_params
from ..families import mla as family
from ..variants import LOG2E
from .. import _mla_params as _params
from . import schedule as _schedule


def attention_params(state, buffers, launch, num_heads, head_div, cache, q, out, lse, num_tokens):
    """The MlaParams of one attention launch: the plan's buffers (the launch's work list), the
    cache's fields, this run's queries (``q``: q_nope and q_pe pointers and strides), out and lse."""
    sched = state.schedule
    work = buffers.long_work_indptr if (launch is sched.long and sched.small is not None) else buffers.work_indptr
    (nope_ptr, nope_strides), (pe_ptr, pe_strides) = q
    return _params.make(
        "MlaParams", q_nope=nope_ptr, q_pe=pe_ptr, out=out, lse=lse, partial_out=buffers.partial_out.data.ptr,
        partial_lse=buffers.partial_lse.data.ptr, page_table=buffers.page_table.data.ptr,
        custom_mask=buffers.custom_mask.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
        kv_lens=buffers.kv_lens.data.ptr, work_indptr=work.data.ptr, num_splits=buffers.num_splits.data.ptr,
        split_keys=buffers.split_keys.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
        mask_indptr=buffers.mask_indptr.data.ptr, status=buffers.status.data.ptr,
        q_nope_token_stride=nope_strides[0], q_nope_head_stride=nope_strides[1],
        q_pe_token_stride=pe_strides[0], q_pe_head_stride=pe_strides[1],
        batch_size=state.batch_size, num_heads=num_heads, page_table_stride=state.page_table_stride,
        mask_mode=state.mask_mode, sm_scale_log2=np.float32(state.sm_scale * LOG2E),
        head_multiplier=head_div[0], head_shift=head_div[1], page_table_columns=state.step.page_columns,
        num_tokens=num_tokens, mask_entries=state.mask_entries, **cache.kernel_fields())


def step_kernels(sched, dtype_name, num_heads, num_tokens):
    """Every kernel :func:`launch_step` may launch for ``sched``: each launch's, then the merge's at the
    step's shape (both shapes where ``num_tokens`` is None: device lengths, known only at run)."""
    kernels = [family.kernel(dtype_name, launch.tile) for launch in sched.launches]
    if sched.needs_merge:
        shapes = ((_schedule.merge_shape(num_tokens, num_heads),) if num_tokens is not None
                  else (_schedule.MERGE_WIDE, _schedule.MERGE_DEEP))
        kernels += [family.merge_kernel(dtype_name, shape) for shape in shapes]
    return kernels


def launch_step(state, buffers, num_heads, dtype_name, cache, q, out, lse, num_tokens, stream):
    """Every kernel of a planned step on ``stream``: nothing for an empty step."""
    sched = state.schedule
    if state.batch_size == 0 or num_tokens == 0:
        return
    head_div = _lib_params.fast_divisor(num_heads)
    out_ptr, lse_ptr = out.data.ptr, (lse.data.ptr if lse is not None else 0)
    for launch in sched.launches:
        if launch.work_grid <= 0:
            continue
        params = attention_params(state, buffers, launch, num_heads, head_div, cache, q, out_ptr, lse_ptr, num_tokens)
        _build.launch(family.kernel(dtype_name, launch.tile), (launch.work_grid,), params, stream)
    if sched.needs_merge:
        shape, grid = _schedule.merge_grid(num_tokens, num_heads)
        merge = _lib_params.make(
            "MergeParams", out=out_ptr, lse=lse_ptr, partial_out=buffers.partial_out.data.ptr,
            partial_lse=buffers.partial_lse.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
            num_splits=buffers.num_splits.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
            batch_size=state.batch_size, num_qo_heads=num_heads, fold_groups=0, sinks=0)
        # programmatic: its CTAs start in the last attention launch's last wave and wait there
        _build.launch(family.merge_kernel(dtype_name, shape), grid, merge, stream, programmatic=True)
