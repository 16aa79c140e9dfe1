"""The launches of a planned step: the attention launch of each class of requests, then the
split merge, with their parameter structs filled in one place for both kernel families.

A :class:`StepLauncher` holds what a ``BatchAttention`` fixes at construction (element types,
heads, head dim); :meth:`StepLauncher.launch` takes a plan (``cupy_fa.plan.PlanState``), the
plan's buffers and one layer's arrays. Both families read the same ``AttentionParams``
(``kernels/shared/params.cuh``) but for their own work list (``work_indptr`` of the small-q
class, ``long_work_indptr`` of the long one) and their splits per CTA and fold.

The first run of a plan packs every launch's struct once (:meth:`StepLauncher.params`, the one
place the fields are named) into a :class:`PreparedStep`; each later run of that plan (a step's
layers) writes only what a run changes into those bytes: q, out, lse and sinks when one of them
moved, the cache's fields when the cache is another one, the token count when it moved. The packed bytes are the
full fill's, field for field (``tests/test_launch_cpu.py``).
"""

import numpy as np

from . import _arrays, _build, _params, catalog, plan as _plan, schedule
from .variants import LOG2E, soft_cap_params

_ATTENTION = _params.DTYPES["AttentionParams"]
_MERGE = _params.DTYPES["MergeParams"]
_CACHE_FIELDS = ("k_cache", "v_cache", "page_size", "page_shift", "num_pages", "k_scale", "v_scale")


_set_run = _params.field_setter("AttentionParams", ("q", "out", "lse", "sinks"))
_set_cache = _params.field_setter("AttentionParams", _CACHE_FIELDS)
_set_tokens = _params.field_setter("AttentionParams", ("num_tokens",))
_set_merge_run = _params.field_setter("MergeParams", ("out", "lse", "sinks"))


class PreparedStep:
    """A plan's launches with their structs packed: per attention launch a
    :class:`cupy_fa._build.PackedLaunch` of its plain kernel and one of its kernel with the variant
    hooks, sharing one struct whose bytes a run updates in place; the merge's struct, and its
    launch per token count. Built for one device (``device_id``) and one set of buffers; a later
    plan of the same shape on the same buffers reuses it (``BatchAttention``: :meth:`matches`)."""

    def __init__(self, launcher, state, buffers, device_id):
        self.buffers, self.device_id, self.cache, self.num_tokens = buffers, device_id, None, None
        self.run = None  # the (q, out, lse, sinks) addresses the structs hold
        self.signature = signature(state)
        sched = state.schedule
        self.launches = [x for x in sched.launches if x.work_grid > 0]
        self.empty = state.batch_size == 0 or not self.launches
        self.always_hooked = bool(state.window or state.soft_cap)
        zero = dict(q=0, out=0, lse=0, sinks=0, num_tokens=0, **{f: 0 for f in _CACHE_FIELDS})
        self.attention = []
        for launch in self.launches:
            packed = np.array([launcher.params(state, buffers, launch, **zero)], _ATTENTION)
            # one CTA per (work item, KV head), heads fastest (kernels/mma_sync/work.cuh): schedule.launch_grid
            plain = _build.PackedLaunch(catalog.attention_kernel(launcher.types, launch.tile), (launch.ctas,), packed,
                                        device_id)
            hooked = _build.PackedLaunch(catalog.attention_kernel(launcher.types, launch.tile.with_variants()),
                                         (launch.ctas,), packed, device_id)
            self.attention.append((plain, hooked, packed.data.cast("B")))
        self.merge = None
        if sched.needs_merge:
            packed = np.array([launcher.merge_params(state, buffers, out=0, lse=0, sinks=0)], _MERGE)
            self.merge = (packed, packed.data.cast("B"), {})

    def matches(self, state, buffers, device_id):
        """Whether this prepared step launches what a fresh one for ``state`` would."""
        return self.buffers is buffers and self.device_id == device_id and self.signature == signature(state)


def signature(state):
    """Everything of a plan its packed structs and launches are made of (the plan's buffers and
    device aside): two plans of one signature launch the same kernels with the same bytes."""
    return (state.schedule, state.batch_size, state.mask_mode, state.sm_scale, state.page_table_columns,
            state.page_table_stride, state.mask_entries, state.window, state.soft_cap)


class StepLauncher:
    """Launches planned steps of one attention shape: ``types`` (a ``families.ElementTypes``),
    ``num_qo_heads`` / ``num_kv_heads``, ``head_dim`` (``head_dim_vo``: out's and the merge's, None
    for ``head_dim``) and the output's ``dtype_name``."""

    def __init__(self, types, num_qo_heads, num_kv_heads, head_dim, dtype_name, head_dim_vo=None):
        self.types, self.dtype_name = types, dtype_name
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.head_dim_vo = head_dim if head_dim_vo is None else head_dim_vo
        self.group_div = _params.fast_divisor(num_qo_heads // num_kv_heads)  # group_multiplier, group_shift

    def kernels(self, sched, hooked=False, num_tokens=None):
        """The kernels a plan of schedule ``sched`` launches (``hooked``: with the variant hooks; the
        merge's for ``num_tokens`` where it is known): what its first run would compile, for
        ``_build.load_all`` to compile at once."""
        found = [catalog.attention_kernel(self.types, x.tile.with_variants() if hooked else x.tile)
                 for x in sched.launches if x.work_grid > 0]
        if sched.needs_merge and num_tokens:
            found.append(catalog.merge_kernel(self.dtype_name, self.head_dim_vo,
                                              schedule.merge_grid(num_tokens, self.num_qo_heads)[0]))
        return found

    def prepare(self, state, buffers, device_id):
        """The plan's :class:`PreparedStep` (made once per plan, on its first run)."""
        prepared = state.prepared
        if prepared is None or prepared.buffers is not buffers or prepared.device_id != device_id:
            prepared = state.prepared = PreparedStep(self, state, buffers, device_id)
        return prepared

    def launch(self, state, buffers, cache, q_ptr, out_ptr, lse_ptr, num_tokens, stream_ptr, sinks_ptr=0,
               device_id=None):
        """The step's kernels on stream ``stream_ptr`` (a raw pointer; CuPy's current device must be
        the buffers', ``device_id``): each attention launch of ``state.schedule`` (the long family's
        first), then the merge where the schedule needs one, with this run's arrays (their
        addresses; 0 for no lse / sinks). Nothing for an IDLE or all-padding step."""
        prepared = state.prepared
        if prepared is None or prepared.buffers is not buffers or prepared.device_id != device_id:
            prepared = self.prepare(state, buffers, device_id)
        if prepared.empty or num_tokens == 0:
            return  # IDLE: nothing to read, nothing to write
        run = (q_ptr, out_ptr, lse_ptr, sinks_ptr)
        new_run = run != prepared.run
        new_cache, new_tokens = prepared.cache is not cache, prepared.num_tokens != num_tokens
        if new_cache:
            fields = cache.attention_params()
            cache_values = tuple(fields[f] for f in _CACHE_FIELDS)
        # a window, a soft-cap or sinks: each tile's kernel with the hooks compiled in (the plain
        # kernels otherwise, unchanged)
        hooked = prepared.always_hooked or bool(sinks_ptr)
        for plain, with_hooks, raw in prepared.attention:  # the long family's first
            if new_run:
                _set_run(raw, run)
            if new_cache:
                _set_cache(raw, cache_values)
            if new_tokens:
                _set_tokens(raw, (num_tokens,))
            _build.launch_packed(with_hooks if hooked else plain, stream_ptr)
        prepared.cache, prepared.num_tokens, prepared.run = cache, num_tokens, run
        if prepared.merge is not None:
            packed, raw, by_tokens = prepared.merge
            if new_run:
                _set_merge_run(raw, (out_ptr, lse_ptr, sinks_ptr))
            merge = by_tokens.get(num_tokens)
            if merge is None:
                shape, grid = schedule.merge_grid(num_tokens, self.num_qo_heads)
                # programmatic: its CTAs start in the last attention kernel's last wave and wait there
                # (an earlier launch in the stream finished before that one began)
                merge = by_tokens[num_tokens] = _build.PackedLaunch(
                    catalog.merge_kernel(self.dtype_name, self.head_dim_vo, shape), grid, packed, device_id,
                    programmatic=True)
            _build.launch_packed(merge, stream_ptr)

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
            page_table_stride=state.page_table_stride, num_qo_heads=self.num_qo_heads,
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
        long family never folds, and beside long requests the small-q CTAs fold only whole rows
        where nothing is merged: ``schedule.schedule_step``)."""
        sched = state.schedule
        fold_groups = int(sched.small is not None and sched.small.tile.fold_splits)
        return _params.make(
            "MergeParams", out=out, lse=lse, partial_out=buffers.partial_out.data.ptr,
            partial_lse=buffers.partial_lse.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
            num_splits=buffers.num_splits.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
            batch_size=state.batch_size, num_qo_heads=self.num_qo_heads, fold_groups=fold_groups, sinks=sinks)


def check_run(attn, state, q, cache, out, lse):
    """A run's arrays (:class:`cupy_fa._views.View` of q, out, lse) and its cache against the plan
    ``state`` of BatchAttention ``attn``, before anything is launched: what ``BatchAttention.run``
    says it raises (the page table against the cache once per cache geometry). Each array's checks
    pass in one comparison (``View.fits``); ``check_device_array`` names what failed."""
    h, d, d_vo = attn.num_qo_heads, attn.head_dim, attn.head_dim_vo
    device, bound = attn.device_id, attn._bound_text
    want = (state.num_tokens, h, d)
    if not (q.fits(attn._np_dtype, want, device, 16) if state.num_tokens is not None else
            q.fits(attn._np_dtype, (q.shape[0], h, d) if q.ndim == 3 else want, device, 16)):
        _arrays.check_device_array(q, "q", dtype=attn.dtype_name, ndim=3, shape=want, device_id=device, bound=bound)
    if cache.num_kv_heads != attn.num_kv_heads or cache.head_dim != d or cache.head_dim_v != d_vo:
        raise ValueError(f"cache has num_kv_heads={cache.num_kv_heads}, head_dim={cache.head_dim}, head_dim_v="
                         f"{cache.head_dim_v}; this BatchAttention expects {attn.num_kv_heads}, {d} and {d_vo}")
    if cache.dtype_name != attn.kv_dtype_name:
        if attn.kv_dtype_name == attn.dtype_name:
            raise TypeError(f"cache dtype is {cache.dtype_name}, q dtype is {attn.dtype_name}"
                            + (" (an fp8 cache needs BatchAttention(..., kv_dtype='float8_e4m3fn'))"
                               if cache.dtype_name == _arrays.FP8 else ""))
        raise TypeError(f"cache dtype is {cache.dtype_name}, this BatchAttention was built for kv_dtype "
                        f"{attn.kv_dtype_name}")
    if cache.device_id != device:
        raise ValueError(f"cache is on device {cache.device_id}, expected device {device} ({bound})")
    if state.num_tokens is None and q.shape[0] > attn._buffers.capacity.max_num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, more than max_num_tokens "
                         f"{attn._buffers.capacity.max_num_tokens}")
    out_shape = q.shape if d_vo == d else (q.shape[0], h, d_vo)  # [T, H_q, head_dim_vo]
    if out is not None and not out.fits(attn._np_dtype, out_shape, device, 8):
        _arrays.check_device_array(out, "out", dtype=attn.dtype_name, shape=out_shape, device_id=device, align=8,
                                   bound=bound)
        if out.ndim != 3:
            raise ValueError(f"out must have shape {tuple(out_shape)}, got {tuple(out.shape)}")
    if lse is not None and not lse.fits(np.float32, (q.shape[0], h), device, 4):
        _arrays.check_device_array(lse, "lse", dtype=np.float32, ndim=2, align=4, shape=(q.shape[0], h),
                                   device_id=device, bound=bound)
    geometry = (cache.page_size, cache.num_pages)
    if state.host_q_lens is not None and geometry not in state.checked_geometry:
        _plan.check_table(state.host_page_table, state.page_table_columns, state.host_kv_lens, state.host_q_lens,
                          *geometry)
        state.checked_geometry.add(geometry)

