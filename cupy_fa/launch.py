"""The launches of a planned step: the attention launch of each class of requests, then the
split merge, with their parameter structs filled in one place for both kernel families.

A :class:`StepLauncher` holds what a ``BatchAttention`` fixes at construction (element types,
heads, head dim); :meth:`StepLauncher.launch` takes a plan (``cupy_fa.plan.PlanState``), the
plan's buffers and one layer's arrays. Both families read the same ``AttentionParams``
(``kernels/shared/params.cuh``) but for their own work list (``work_indptr`` of the small-q
class, ``long_work_indptr`` of the long one) and their splits per CTA and fold.

The first run of a plan packs every launch's struct once (:meth:`StepLauncher.params`, the one
place the fields are named) into a :class:`PreparedStep`; each later run of that plan (a step's
layers) writes only what a run changes into those bytes: q, out, lse and sinks, the cache's
fields when the cache is another one, the token count when it moved. The packed bytes are the
full fill's, field for field (``tests/test_launch_cpu.py``).
"""

import struct

import numpy as np

from . import _build, _params, catalog, schedule
from .variants import LOG2E, soft_cap_params

_ATTENTION = _params.DTYPES["AttentionParams"]
_MERGE = _params.DTYPES["MergeParams"]
_CACHE_FIELDS = ("k_cache", "v_cache", "page_size", "page_shift", "num_pages", "k_scale", "v_scale")


# struct's codes of standard size (``"<"``) by NumPy kind and size: NumPy's own ``char`` of a uint64
# field is ``"L"``, which struct packs in 4 bytes under ``"<"``
_STRUCT_CODES = {("u", 8): "Q", ("i", 8): "q", ("u", 4): "I", ("i", 4): "i", ("f", 4): "f", ("f", 8): "d"}


def _setter(dtype, fields):
    """``set(buffer, values)``: writes ``values`` into ``fields`` of a packed ``dtype`` struct."""
    def code(field):
        kind = dtype.fields[field][0]
        return _STRUCT_CODES[kind.kind, kind.itemsize]
    packers = [(struct.Struct("<" + code(f)), dtype.fields[f][1]) for f in fields]

    def write(buffer, values):
        for (packer, offset), value in zip(packers, values):
            packer.pack_into(buffer, offset, value)
    return write


_set_run = _setter(_ATTENTION, ("q", "out", "lse", "sinks"))
_set_cache = _setter(_ATTENTION, _CACHE_FIELDS)
_set_tokens = _setter(_ATTENTION, ("num_tokens",))
_set_merge_run = _setter(_MERGE, ("out", "lse", "sinks"))


class PreparedStep:
    """A plan's launches with their structs packed: per attention launch its kernels (plain, and
    with the variant hooks once a run takes them), tile, grid and a one-element struct array whose bytes a run updates in
    place; the merge's struct, and its kernel and grid per token count."""

    def __init__(self, launcher, state, buffers):
        self.buffers, self.cache, self.num_tokens = buffers, None, None
        sched = state.schedule
        self.launches = [x for x in sched.launches if x.work_grid > 0]
        self.empty = state.batch_size == 0 or not self.launches
        self.always_hooked = bool(state.window or state.soft_cap)
        zero = dict(q=0, out=0, lse=0, sinks=0, num_tokens=0, **{f: 0 for f in _CACHE_FIELDS})
        self.attention = []
        for launch in self.launches:
            packed = np.array([launcher.params(state, buffers, launch, **zero)], _ATTENTION)
            # the kernel with the variant hooks is looked up on the first run that takes it (an
            # fp8 cache's tiles have none: attention.refuse_fp8_variants refuses such steps)
            self.attention.append([catalog.attention_kernel(launcher.types, launch.tile), None, launch.tile,
                                   (launch.ctas,), packed, packed.data.cast("B")])
        self.merge = None
        if sched.needs_merge:
            packed = np.array([launcher.merge_params(state, buffers, out=0, lse=0, sinks=0)], _MERGE)
            self.merge = (packed, packed.data.cast("B"), {})


class StepLauncher:
    """Launches planned steps of one attention shape: ``types`` (a ``families.ElementTypes``),
    ``num_qo_heads`` / ``num_kv_heads``, ``head_dim`` and the output's ``dtype_name``."""

    def __init__(self, types, num_qo_heads, num_kv_heads, head_dim, dtype_name):
        self.types, self.dtype_name = types, dtype_name
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group_div = _params.fast_divisor(num_qo_heads // num_kv_heads)  # group_multiplier, group_shift

    def launch(self, state, buffers, cache, q_dev, out_dev, lse_dev, num_tokens, stream, sinks_dev=None):
        """The step's kernels on ``stream`` (CuPy's current device must be the buffers'): each
        attention launch of ``state.schedule`` (the long family's first), then the merge where
        the schedule needs one. Nothing for an IDLE or all-padding step."""
        prepared = state.prepared
        if prepared is None or prepared.buffers is not buffers:
            prepared = state.prepared = PreparedStep(self, state, buffers)
        if prepared.empty or num_tokens == 0:
            return  # IDLE: nothing to read, nothing to write
        lse_ptr = lse_dev.data.ptr if lse_dev is not None else 0
        sinks_ptr = sinks_dev.data.ptr if sinks_dev is not None else 0
        run = (q_dev.data.ptr, out_dev.data.ptr, lse_ptr, sinks_ptr)
        new_cache, new_tokens = prepared.cache is not cache, prepared.num_tokens != num_tokens
        if new_cache:
            fields = cache.attention_params()
            cache_values = tuple(fields[f] for f in _CACHE_FIELDS)
        # a window, a soft-cap or sinks: each tile's kernel with the hooks compiled in (the plain
        # kernels otherwise, unchanged)
        hooked = prepared.always_hooked or bool(sinks_ptr)
        for entry in prepared.attention:  # the long family's first
            plain, with_hooks, tile, grid, packed, raw = entry
            _set_run(raw, run)
            if new_cache:
                _set_cache(raw, cache_values)
            if new_tokens:
                _set_tokens(raw, (num_tokens,))
            if hooked and with_hooks is None:
                with_hooks = entry[1] = catalog.attention_kernel(self.types, tile.with_variants())
            # one CTA per (work item, KV head), heads fastest (kernels/mma_sync/work.cuh): schedule.launch_grid
            _build.launch(with_hooks if hooked else plain, grid, packed[0], stream)
        prepared.cache, prepared.num_tokens = cache, num_tokens
        if prepared.merge is not None:
            packed, raw, shapes = prepared.merge
            _set_merge_run(raw, (run[1], lse_ptr, sinks_ptr))
            found = shapes.get(num_tokens)
            if found is None:
                shape, grid = schedule.merge_grid(num_tokens, self.num_qo_heads)
                found = shapes[num_tokens] = (catalog.merge_kernel(self.dtype_name, self.head_dim, shape), grid)
            # programmatic: its CTAs start in the last attention kernel's last wave and wait there
            # (an earlier launch in the stream finished before that one began)
            _build.launch(found[0], found[1], packed[0], stream, programmatic=True)

    def params(self, state, buffers, launch, *, q, out, lse, sinks, num_tokens, **cache_fields):
        """The ``AttentionParams`` of one attention launch of a plan (an ``np.void``), every field
        named: the plan's buffers and schedule, this run's arrays, the cache's fields
        (``PagedKVCache.attention_params``)."""
        sched = state.schedule
        soft_cap_scale, soft_cap_log2 = soft_cap_params(state.sm_scale, state.soft_cap)
        # each family reads its own work list of plan_kernel's layout; everything else is shared
        work = buffers.long_work_indptr if launch is sched.long else buffers.work_indptr
        return _params.make(
            "AttentionParams", q=q, out=out, lse=lse, partial_out=buffers.partial_out.data.ptr,
            partial_lse=buffers.partial_lse.data.ptr, page_table=buffers.page_table.data.ptr,
            custom_mask=buffers.custom_mask.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
            kv_lens=buffers.kv_lens.data.ptr, work_indptr=work.data.ptr, num_splits=buffers.num_splits.data.ptr,
            split_keys=buffers.split_keys.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
            mask_indptr=buffers.mask_indptr.data.ptr, batch_size=state.batch_size,
            page_table_stride=buffers.page_table.shape[1], num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads, mask_mode=state.mask_mode, sm_scale_log2=state.sm_scale * LOG2E,
            splits_per_cta=launch.tile.splits_per_cta, fold_splits=int(launch.tile.fold_splits),
            group_multiplier=self.group_div[0], group_shift=self.group_div[1],
            # the device metadata's bounds (kernels/shared/status.cuh)
            status=buffers.status.data.ptr, page_table_columns=state.page_table_columns,
            num_tokens=num_tokens, mask_entries=state.mask_entries,
            # the variant hooks (kernels/shared/variant.cuh), read only by the kernels built with them
            key_base=buffers.key_base.data.ptr, sinks=sinks, window=state.window,
            soft_cap_scale=soft_cap_scale, soft_cap_log2=soft_cap_log2, **cache_fields)

    def merge_params(self, state, buffers, *, out, lse, sinks):
        """The ``MergeParams`` of a plan's merge (an ``np.void``): one merge for both classes (the
        long family never folds, and the small-q CTAs fold only in steps without long requests:
        ``schedule.schedule_step``)."""
        sched = state.schedule
        fold_groups = int(sched.small is not None and sched.small.tile.fold_splits)
        return _params.make(
            "MergeParams", out=out, lse=lse, partial_out=buffers.partial_out.data.ptr,
            partial_lse=buffers.partial_lse.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
            num_splits=buffers.num_splits.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
            batch_size=state.batch_size, num_qo_heads=self.num_qo_heads, fold_groups=fold_groups, sinks=sinks)
