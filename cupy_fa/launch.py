"""The launches of a planned step: the attention launch of each class of requests, then the
split merge, with their parameter structs filled in one place for both kernel families.

A :class:`StepLauncher` holds what a ``BatchAttention`` fixes at construction (element types,
heads, head dim); :meth:`StepLauncher.launch` takes a plan (``cupy_fa.plan.PlanState``), the
plan's buffers and one layer's arrays. Both families read the same ``AttentionParams``
(``kernels/shared/params.cuh``) but for their own work list (``work_indptr`` of the small-q
class, ``long_work_indptr`` of the long one) and their splits per CTA and fold.
"""

from . import _build, _params, catalog, schedule
from .variants import LOG2E, soft_cap_params


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
        sched = state.schedule
        launches = [x for x in sched.launches if x.work_grid > 0]
        if state.batch_size == 0 or num_tokens == 0 or not launches:
            return  # IDLE: nothing to read, nothing to write
        lse_ptr = lse_dev.data.ptr if lse_dev is not None else 0
        sinks_ptr = sinks_dev.data.ptr if sinks_dev is not None else 0
        soft_cap_scale, soft_cap_log2 = soft_cap_params(state.sm_scale, state.soft_cap)
        common = dict(
            q=q_dev.data.ptr, out=out_dev.data.ptr, lse=lse_ptr, partial_out=buffers.partial_out.data.ptr,
            partial_lse=buffers.partial_lse.data.ptr, page_table=buffers.page_table.data.ptr,
            custom_mask=buffers.custom_mask.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
            kv_lens=buffers.kv_lens.data.ptr, num_splits=buffers.num_splits.data.ptr,
            split_keys=buffers.split_keys.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
            mask_indptr=buffers.mask_indptr.data.ptr, batch_size=state.batch_size,
            page_table_stride=buffers.page_table.shape[1], num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads, mask_mode=state.mask_mode,
            sm_scale_log2=state.sm_scale * LOG2E,
            group_multiplier=self.group_div[0], group_shift=self.group_div[1],
            # the device metadata's bounds (kernels/shared/status.cuh)
            status=buffers.status.data.ptr, page_table_columns=state.page_table_columns,
            num_tokens=num_tokens, mask_entries=state.mask_entries,
            # K, V, the page size and count, an fp8 cache's scales (run checked it is of kv_dtype)
            **cache.attention_params(),
            # the variant hooks (kernels/shared/variant.cuh), read only by the kernels built with them
            key_base=buffers.key_base.data.ptr, sinks=sinks_ptr, window=state.window,
            soft_cap_scale=soft_cap_scale, soft_cap_log2=soft_cap_log2)
        # a window, a soft-cap or sinks: each tile's kernel with the hooks compiled in (the plain
        # kernels otherwise, unchanged)
        hooks = bool(state.window or state.soft_cap or sinks_ptr)
        for launch in launches:  # the long family's first (schedule.StepSchedule.launches)
            # each family reads its own work list of plan_kernel's layout; everything else is shared
            work = buffers.long_work_indptr if launch is sched.long else buffers.work_indptr
            params = _params.make("AttentionParams", work_indptr=work.data.ptr,
                                  splits_per_cta=launch.tile.splits_per_cta,
                                  fold_splits=int(launch.tile.fold_splits), **common)
            # one CTA per (work item, KV head), heads fastest (kernels/mma_sync/work.cuh): schedule.launch_grid
            tile = launch.tile.with_variants() if hooks else launch.tile
            _build.launch(catalog.attention_kernel(self.types, tile), (launch.ctas,), params, stream)
        if sched.needs_merge:
            # one merge for both classes: the long family never folds, and the small-q CTAs fold
            # only in steps without long requests (schedule.schedule_step)
            fold_groups = int(sched.small is not None and sched.small.tile.fold_splits)
            merge = _params.make(
                "MergeParams", out=out_dev.data.ptr, lse=lse_ptr, partial_out=buffers.partial_out.data.ptr,
                partial_lse=buffers.partial_lse.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
                num_splits=buffers.num_splits.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
                batch_size=state.batch_size, num_qo_heads=self.num_qo_heads, fold_groups=fold_groups,
                sinks=sinks_ptr)
            shape, grid = schedule.merge_grid(num_tokens, self.num_qo_heads)
            # programmatic: its CTAs start in the last attention kernel's last wave and wait there
            # (an earlier launch in the stream finished before that one began)
            _build.launch(catalog.merge_kernel(self.dtype_name, self.head_dim, shape), grid, merge, stream,
                          programmatic=True)
