"""The launches of a planned MLA step: each attention launch of its schedule (the long class's first),
then the split merge, with their params structs filled in one place (:func:`attention_params`).

The first run of a plan packs every launch's struct once into a :class:`PreparedStep` (a later plan
of the same signature on the same buffers keeps it: :func:`signature`); each later run (a step's
layers) writes only what a run changes into those bytes: the queries' addresses and strides, out and
lse when one of them moved, the cache's fields when the cache is another one, the token count when
it moved, then launches them, one driver call each (cupy_fa._build.launch_packed). The packed bytes
are the full fill's, field for field (``tests/test_mla_cpu.py``).
"""

import numpy as np

from .. import _build, _params as _lib_params
from ..families import mla as family
from ..variants import LOG2E
from .. import _mla_params as _params
from . import schedule as _schedule

_MLA = _params.DTYPES["MlaParams"]
_MERGE = _lib_params.DTYPES["MergeParams"]
_RUN_FIELDS = ("q_nope", "q_pe", "out", "lse", "q_nope_token_stride", "q_nope_head_stride", "q_pe_token_stride",
               "q_pe_head_stride")
_CACHE_FIELDS = ("cache", "kv_scale", "page_size", "page_shift", "num_pages")
_set_run = _lib_params.field_setter("MlaParams", _RUN_FIELDS, _params.DTYPES)
_set_cache = _lib_params.field_setter("MlaParams", _CACHE_FIELDS, _params.DTYPES)
_set_tokens = _lib_params.field_setter("MlaParams", ("num_tokens",), _params.DTYPES)
_set_merge_run = _lib_params.field_setter("MergeParams", ("out", "lse"))


def attention_params(state, buffers, launch, num_heads, head_div, cache_fields, q, out, lse, num_tokens):
    """The MlaParams of one attention launch, every field named: the plan's buffers (the launch's work
    list), the cache's fields (``PagedLatentCache.kernel_fields``), this run's queries (``q``: q_nope
    and q_pe pointers and strides), out and lse (addresses)."""
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
        num_tokens=num_tokens, mask_entries=state.mask_entries, **cache_fields)


def step_kernels(sched, dtype_name, num_heads, num_tokens):
    """Every kernel :func:`launch_step` may launch for ``sched``: each launch's, then the merge's at the
    step's shape (both shapes where ``num_tokens`` is None: device lengths, known only at run)."""
    kernels = [family.kernel(dtype_name, launch.tile) for launch in sched.launches]
    if sched.needs_merge:
        shapes = ((_schedule.merge_shape(num_tokens, num_heads),) if num_tokens is not None
                  else (_schedule.MERGE_WIDE, _schedule.MERGE_DEEP))
        kernels += [family.merge_kernel(dtype_name, shape) for shape in shapes]
    return kernels


def merge_params(state, buffers, num_heads, out, lse):
    """The MergeParams of a planned step's split merge (``out`` / ``lse``: this run's addresses)."""
    return _lib_params.make(
        "MergeParams", out=out, lse=lse, partial_out=buffers.partial_out.data.ptr,
        partial_lse=buffers.partial_lse.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
        num_splits=buffers.num_splits.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
        batch_size=state.batch_size, num_qo_heads=num_heads, fold_groups=0, sinks=0)


def signature(state):
    """Everything of a plan its packed structs and launches are made of (the plan's buffers and
    device aside): two plans of one signature launch the same kernels with the same bytes."""
    return (state.schedule, state.batch_size, state.mask_mode, state.sm_scale, state.step.page_columns,
            state.page_table_stride, state.mask_entries)


class PreparedStep:
    """A plan's launches with their structs packed: per attention launch a
    :class:`cupy_fa._build.PackedLaunch` whose struct a run updates in place, and the merge's struct
    with its launch per token count. Built for one device and one set of buffers."""

    def __init__(self, state, buffers, num_heads, dtype_name, device_id):
        self.buffers, self.device_id = buffers, device_id
        self.signature = signature(state)
        self.cache = self.num_tokens = self.run = None  # what the structs hold of the last run
        head_div = _lib_params.fast_divisor(num_heads)
        zero_cache = {f: 0 for f in _CACHE_FIELDS}
        zero_q = ((0, (0, 0)), (0, (0, 0)))
        self.attention = []
        for launch in state.schedule.launches:
            if launch.work_grid <= 0:
                continue
            packed = np.array([attention_params(state, buffers, launch, num_heads, head_div, zero_cache, zero_q, 0, 0,
                                                0)], _MLA)
            self.attention.append(_build.PackedLaunch(family.kernel(dtype_name, launch.tile), (launch.work_grid,),
                                                      packed, device_id))
        self.merge = None
        if state.schedule.needs_merge:
            packed = np.array([merge_params(state, buffers, num_heads, 0, 0)], _MERGE)
            self.merge = (packed, packed.data.cast("B"), {})

    def matches(self, state, buffers, device_id):
        """Whether this prepared step launches what a fresh one for ``state`` would."""
        return self.buffers is buffers and self.device_id == device_id and self.signature == signature(state)


def launch_step(state, buffers, num_heads, dtype_name, cache, q, out_ptr, lse_ptr, num_tokens, stream, device_id):
    """Every kernel of a planned step on ``stream`` (CuPy's current device must be ``device_id``, the
    buffers'): nothing for an empty step. ``q``: (q_nope pointer, strides), (q_pe pointer, strides);
    ``out_ptr`` / ``lse_ptr``: addresses (0: no lse)."""
    if state.batch_size == 0 or num_tokens == 0:
        return
    prepared = state.prepared
    if prepared is None or prepared.buffers is not buffers or prepared.device_id != device_id:
        prepared = state.prepared = PreparedStep(state, buffers, num_heads, dtype_name, device_id)
    (nope_ptr, nope_strides), (pe_ptr, pe_strides) = q
    run = (nope_ptr, pe_ptr, out_ptr, lse_ptr) + tuple(nope_strides) + tuple(pe_strides)
    new_run, new_cache = run != prepared.run, prepared.cache is not cache
    new_tokens = prepared.num_tokens != num_tokens
    if new_cache:
        fields = cache.kernel_fields()
        cache_values = tuple(fields[f] for f in _CACHE_FIELDS)
    stream_ptr = stream.ptr
    for launch in prepared.attention:  # the long class's first
        if new_run:
            _set_run(launch.raw, run)
        if new_cache:
            _set_cache(launch.raw, cache_values)
        if new_tokens:
            _set_tokens(launch.raw, (num_tokens,))
        _build.launch_packed(launch, stream_ptr)
    prepared.cache, prepared.num_tokens, prepared.run = cache, num_tokens, run
    if prepared.merge is not None:
        packed, raw, by_tokens = prepared.merge
        if new_run:
            _set_merge_run(raw, (out_ptr, lse_ptr))
        merge = by_tokens.get(num_tokens)
        if merge is None:
            shape, grid = _schedule.merge_grid(num_tokens, num_heads)
            # programmatic: its CTAs start in the last attention launch's last wave and wait there
            merge = by_tokens[num_tokens] = _build.PackedLaunch(family.merge_kernel(dtype_name, shape), grid, packed,
                                                                device_id, programmatic=True)
        _build.launch_packed(merge, stream_ptr)
