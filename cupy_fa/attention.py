"""``BatchAttention``: ``plan()`` a step's batch once, ``run()`` it per layer.

Shapes (T = sum of q_lens, B = batch size):
    q, out        [T, num_qo_heads, head_dim]   ragged: request b owns rows q_indptr[b] .. q_indptr[b+1]-1
    lse           [T, num_qo_heads] float32, natural log of the softmax denominator
    q_lens, kv_lens  [B] ints; kv_len counts the keys valid AFTER this step's K/V write
    page_table    [B, max_pages] int32 page ids; row b lists request b's pages in token order
    custom_mask   flat bool, request b's q_len x q_len block row-major at offset sum_{c<b} q_len[c]^2

Semantics (docs/design.md, "The contract"): query i of request b sits at position
kv_len - q_len + i; causal lets it see keys 0 .. kv_len - q_len + i (bottom-right
aligned); a custom mask lets it see every prefix key and draft key
kv_len - q_len + j iff mask[i, j]. A request with q_len = 0 is padding: it
reads and writes nothing. Query head h reads KV head h // (num_qo_heads // num_kv_heads).
"""

import threading

import numpy as np

from . import _arrays, _build, _memo, _views, catalog as _catalog, knobs as _knobs, plan as _plan, schedule as _schedule
from ._instance import PlannedInstance, checked_capacity, checked_workspace
from .families import common as _common
from .kv_cache import PagedKVCache
from .launch import StepLauncher, check_run
from .variants import checked_soft_cap, checked_window


_RUN_ARRAYS = ("q", "out", "lse", "sinks")


class BatchAttention(PlannedInstance):
    """Attention of a ragged batch of queries over a paged KV cache: :meth:`plan` a step,
    then :meth:`run` it for each layer.

    Args:
        num_qo_heads, num_kv_heads: query and KV head counts (GQA/MQA: the first a multiple of the second).
        head_dim: 64, 96, 128, 192 or 256, of q and K (and of V and out unless ``head_dim_vo``). On
            sm_90a, requests of more than 16 tokens take the wgmma family at every one of these
            head dims, and at the pairs of ``head_dim_vo`` (docs/design.md, "Separate qk / vo head
            dims").
        head_dim_vo: V's and out's head dim where it differs from q's and K's: None (``head_dim``),
            or a pair of ``families.common.HEAD_DIM_PAIRS`` (192 / 128: DeepSeek's non-absorbed
            MLA prefill) over a float16 / bfloat16 cache; ``out`` is then ``[T, H_q, head_dim_vo]``
            and the cache's V ``[..., head_dim_vo]`` (``PagedKVCache.allocate(..., head_dim_v=)``).
        dtype: "bfloat16" or "float16" (also NumPy / ml_dtypes / torch dtypes); q, cache and out share it.
        kv_dtype: the cache's dtype: None (``dtype``), or "float8_e4m3fn" for an fp8 cache
            (:class:`PagedKVCache` with its scales) beside ``dtype`` queries and outputs; the
            plan's tiles depend on it (small-q requests on the mma.sync family; the long ones on
            sm_90a's wgmma fp8 tile at head dims 64 / 128 / 256, else on the mma.sync family). An
            fp8 cache takes every attention variant (window, soft-cap, sinks).
        max_batch_size, max_num_tokens, max_pages_per_request, max_mask_bytes: capacity of the
            preallocated metadata buffers (requests, sum of q_len, page-table columns, custom-mask
            bytes). Give the first three (all or none) to allocate everything up front (needed
            before a CUDA-graph capture); otherwise buffers are sized on first use and grown
            by eager plans as needed.
        workspace_bytes: the split partials' size (default 128 MiB, at least 128 rows a request of
            the capacity). A host-planned batch whose splits want more caps every request's
            (results may then depend on the batch) and warns once (:class:`BatchInvarianceWarning`
            naming the size that would hold it); a device-planned one caps silently.
        device: the CUDA device the instance is bound to: an int id, a ``cupy.cuda.Device``, a
            torch cuda device or ``"cuda:N"``; default CuPy's current device when it is made.
            Its buffers live there, and every plan and run makes that device current for its
            allocations, kernel lookups (compiled and loaded per device) and launches, whatever
            device is current in the caller; the inputs must live there too (``device_id``).
    Raises:
        ValueError: head counts that are not positive ints or do not divide, an unsupported
            head dim (or a pair of them: ``head_dim_vo`` not making a supported pair, or with an
            fp8 ``kv_dtype``), some but not all of the capacities, a capacity that is
            not a positive int (``max_mask_bytes``: not negative); an fp8 ``kv_dtype`` at head dim 96
            or 192. TypeError: a dtype other than float16 / bfloat16, a kv_dtype other than
            ``dtype`` or float8_e4m3fn. ValueError: a ``device`` that is no CUDA device of this process.
        RuntimeError: capacities (or a ``device``) given on a machine without a usable CUDA device.

    Threads and streams: one instance owns one set of metadata buffers. Its calls may come from
    any thread and any stream, one call at a time: a plan waits for the work already queued
    with the instance's previous plan and runs on other streams (no host sync), and a run on
    another stream than its plan waits for the plan. Two threads inside ``plan`` / ``run`` of one
    instance at once, or a thread running a plan that another thread's ``plan`` replaced since
    its own, raise ``RuntimeError``: use one instance per thread (instances are independent and
    may share a cache and run on different streams at the same time).

    Device metadata (lengths and page tables in device arrays, which the host cannot read
    without a sync) is checked by the kernels: a request that breaks the contract reads and
    writes nothing outside its buffers, its rows of ``out`` are NaN, the others are computed as
    without it, and :meth:`status` names the first such request (docs/errors.md).
    """

    _NAME = "BatchAttention"

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, dtype="bfloat16", *, max_batch_size=None,
                 max_num_tokens=None, max_pages_per_request=None, max_mask_bytes=0, kv_dtype=None, workspace_bytes=None,
                 device=None, head_dim_vo=None):
        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        head_dim, head_dim_vo = _common.checked_head_dims(head_dim, head_dim_vo)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = int(num_qo_heads), int(num_kv_heads), head_dim
        self.head_dim_vo = head_dim_vo  # V's and out's (= head_dim unless a pair)
        self.group_size = self.num_qo_heads // self.num_kv_heads
        self.dtype_name = _arrays.resolve_dtype(dtype)
        self.kv_dtype_name = self.dtype_name if kv_dtype is None else _arrays.resolve_kv_dtype(kv_dtype, "kv_dtype")
        if self.kv_dtype_name not in (self.dtype_name, _arrays.FP8):
            raise TypeError(f"kv_dtype must be dtype ({self.dtype_name}) or float8_e4m3fn, got {self.kv_dtype_name}")
        _common.checked_head_dims(self.head_dim, self.head_dim_vo, self.kv_dtype_name)  # an fp8 cache: one dim
        if self.kv_dtype_name == _arrays.FP8 and self.head_dim not in _common.FP8_HEAD_DIMS:
            raise ValueError(f"an fp8 KV cache takes head_dim {_common.FP8_HEAD_DIMS}, got {self.head_dim} "
                             f"(docs/design.md, \"Head dims\")")
        self._types = _common.ElementTypes(self.dtype_name, self.kv_dtype_name, self.dtype_name)
        self._launcher = StepLauncher(self._types, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.dtype_name,
                                      self.head_dim_vo)
        self._schedules = _memo.ScheduleMemo(self.head_dim, self.group_size, self.num_kv_heads, self._types.kv_bytes,
                                             self.head_dim_vo)
        self._np_dtype = _arrays.DTYPES[self.dtype_name]
        self._done = None  # the event each plan records after its plan kernel (made by the first)
        self._split_checked = None  # the knobs the split size was checked under
        self._facts = None  # (knobs, device id, what the schedule reads of the device)
        self._loaded = None  # the last schedule whose kernels were loaded (_build.load_all)
        capacity = checked_capacity(max_batch_size, max_num_tokens, max_pages_per_request, max_mask_bytes)
        self._workspace = checked_workspace(workspace_bytes)
        self._mine = threading.local()  # .plan: the last plan this thread made
        self._bind(device, capacity)  # (cupy_fa._instance: the device, the buffers of a fixed capacity)

    def _new_buffers(self, capacity):
        return _plan.PlanBuffers(capacity, self.num_qo_heads, self.head_dim_vo, self.dtype_name,  # partials: out's
                                 workspace_bytes=self._workspace)

    # ---- plan ------------------------------------------------------------------------

    def plan(self, q_lens, kv_lens, page_table, *, causal=True, sm_scale=None, custom_mask=None,
             max_q_len=None, max_kv_len=None, check=None, window=None, logits_soft_cap=None):
        """Plans one step's batch: checks it and computes its metadata on the device.

        Plan once per step, then :meth:`run` once per layer (the layers of a step share its
        lengths and page table). No attention runs here.

        Args:
            q_lens: ``[B]`` ints, query tokens of each request in this step; 0 marks a padded
                row, which reads and writes nothing.
            kv_lens: ``[B]`` ints, keys of each request in the cache AFTER this step's K/V were
                written (they count this step's tokens: ``q_len <= kv_len`` for a live request).
            page_table: ``[B, max_pages]`` ints (int32 on the device): row b lists request b's
                pages in token order. Only its first ``ceil(kv_len / page_size)`` entries are
                read; pad the rest with anything (-1, 0).
            causal: bottom-right causal (query i sees keys ``0 .. kv_len - q_len + i``); False:
                every query sees all ``kv_len`` keys.
            sm_scale: softmax scale, a positive float; default ``1 / sqrt(head_dim)``.
            custom_mask: a tree mask among each request's own ``q_len`` tokens instead of the
                causal one (the prefix stays visible): flat bool / uint8, request b's ``q_len x
                q_len`` block row-major at offset ``sum_{c<b} q_len[c]**2``; or a list of blocks.
            max_q_len, max_kv_len: host upper bounds of device lengths (``max_q_len`` is
                required for them; ``max_kv_len`` keeps the grid tight). Ignored for host lengths.
            check: True: after the plan kernel (and after each :meth:`run` of this plan) sync and
                raise ``ValueError`` naming the first request whose device metadata broke the
                contract. Default: ``CUPY_FA_DEBUG=1``. A debugging aid: it syncs, so not inside
                a CUDA-graph capture (there it is skipped; read :meth:`status` after a replay).
            window: a sliding window of ``W`` keys, FlashAttention's convention: query i of a
                request, at position ``p = kv_len - q_len + i``, sees only keys ``p - W + 1 ..``
                (with the causal mask ``p - W + 1 .. p``: W keys, itself included; FlashInfer's
                ``window_left`` is ``W - 1``). For every mask: with a custom mask a draft's
                position is its row's, ``p``. An int >= 1; None or -1: no window. The splits and
                the paged loads cover only the windows: a window of 4096 over 131072 keys reads
                about 4096 keys per query block. Layers with different windows need a plan each
                (one BatchAttention per kind of layer).
            logits_soft_cap: ``cap``: each score becomes ``cap * tanh(score * sm_scale / cap)``
                before the mask and the softmax (Gemma 2's soft-capping). A positive finite
                float; None or 0: none.

        Every input may be a host value (list, NumPy, CPU torch) or a device array (CuPy, torch
        CUDA, any DLPack producer); ``q_lens`` and ``kv_lens`` must be the same kind. Host
        inputs are checked before anything touches the device. Device inputs are copied
        device-to-device into the preallocated buffers with no host sync (what a CUDA-graph
        capture needs) and checked by the kernels: a request with a negative ``q_len``, ``q_len >
        kv_len``, ``q_len > max_q_len`` or ``kv_len > max_kv_len`` is refused on the device (its
        rows of ``out`` NaN, :meth:`status` names it); its tokens keep their place in q and out
        (at most ``max_q_len`` of them).

        The page ids are not checked here but in :meth:`run`, against the cache the step runs
        on (its ``num_pages`` and ``page_size``), once per cache geometry.

        Returns:
            self.
        Raises:
            ValueError: lengths or page-table rows of different batch sizes, a negative length,
                ``q_len > kv_len`` (host), a custom mask whose size is not ``sum(q_len**2)``, a
                bad ``sm_scale``, a ``window`` that is not an int >= 1 (or None / -1), a
                ``logits_soft_cap`` that is not a positive finite number (or None / 0), device
                lengths without ``max_q_len``, device lengths, page table or mask on another
                device than the bound one (``device_id``), a step beyond the
                capacity given to the constructor (or, inside a CUDA-graph capture, beyond the
                buffers already allocated); an fp8 ``kv_dtype`` at head dim 64 / 128 with a
                ``CUPY_FA_SPLIT_SIZE`` that is not a multiple of 128 keys.
            TypeError: ``causal`` not a bool, non-integer lengths or page table, ``q_lens`` and ``kv_lens`` of different
                kinds, a custom mask that is not bool / uint8.
            RuntimeError: no usable CUDA device (no CuPy, no driver, ...), in plain words; another
                thread inside ``plan`` / ``run`` of this instance at the same time.
            ValueError (``check``): a request whose device metadata broke the contract, after a sync.
        """
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be True or False, got {causal!r}")
        window, soft_cap = checked_window(window), checked_soft_cap(logits_soft_cap)
        if self._split_checked is not _knobs.knobs():  # the split size knob against this head dim, once per knobs
            _schedule.check_split_size(self.head_dim, self._types.kv_bytes)
            self._split_checked = _knobs.knobs()
        with self.device_scope():
            self._enter("plan")
            try:
                self._plan_step(q_lens, kv_lens, page_table, causal, sm_scale, custom_mask, max_q_len, max_kv_len,
                                check, window, soft_cap)
            finally:
                self._leave()
            if self._plan.check and self._plan.done is not None:
                self._raise_on_bad("plan")
        return self

    def _plan_step(self, q_lens, kv_lens, page_table, causal, sm_scale, custom_mask, max_q_len, max_kv_len, check,
                   window=0, soft_cap=0.0):
        step = _plan.check_step(q_lens, kv_lens, page_table, custom_mask, max_q_len=max_q_len,
                                device_id=self.device_id, bound=self._bound_text)
        sm_scale = _plan.checked_sm_scale(sm_scale, self.head_dim)
        stream = step.stream if step.stream is not None else _views.current_stream(self.device_id)
        capturing = stream.is_capturing()
        self._order_after_previous(stream, capturing)
        if step.num_tokens is not None:
            tokens_needed = step.num_tokens
        else:  # device lengths: an auto-sized instance grows to the bound; a fixed one checks q in run()
            tokens_needed = 0 if self._fixed_capacity else step.batch * step.max_q_len
        self._ensure_capacity(step.batch, tokens_needed, step.page_columns, step.mask_bytes if step.has_mask else 0,
                              capturing, stream)
        stride = _plan.stage_inputs(self._buffers, step, stream=stream, capturing=capturing)
        mask_mode = _plan.MASK_CUSTOM if step.has_mask else (_plan.MASK_CAUSAL if causal else _plan.MASK_NONE)
        return self.plan_staged(step, mask_mode, sm_scale, max_kv_len, stream, check, window, soft_cap, stride,
                                capturing)

    # ---- staged steps: the interface GraphRunner builds on ---------------------------
    #
    # device_scope() makes the bound device current; plan_buffers are the buffers a step's inputs
    # are staged into (cupy_fa.plan.stage_inputs); plan_staged() plans a step already staged
    # there. GraphRunner stages outside its graphs and captures plan_staged() and run().

    @property
    def plan_buffers(self):
        """The plan's device buffers (``cupy_fa.plan.PlanBuffers``; None before the first plan of an
        instance sized on first use)."""
        return self._buffers

    def plan_staged(self, step, mask_mode, sm_scale, max_kv_len, stream, check=None, window=0, soft_cap=0.0,
                    stride=0, capturing=None):
        """The plan of a step whose inputs are in :attr:`plan_buffers` already (``step`` the
        ``cupy_fa.plan.StepInputs`` they came from, ``sm_scale`` checked, the page table's rows
        ``stride`` apart; 0: the buffer's width): its schedule (cupy_fa.schedule, memoised per
        shape: cupy_fa._memo) and the plan kernel on ``stream`` (``capturing``: whether it is capturing,
        where the caller knows)."""
        buffers = self._buffers
        device_id = self.device_id
        capturing = stream.is_capturing() if capturing is None else capturing
        repeat = None
        if not step.on_host:  # device lengths: a step staged as the last plan's was (GraphRunner's bucket)
            repeat = (step, buffers, _knobs.knobs(),  # (compared by identity)
                      (mask_mode, sm_scale, max_kv_len, stream.ptr, check, window, soft_cap, stride, device_id))
            state = self._plan
            last = state.repeat if state is not None else None
            if (not capturing and last is not None and last[0] is step and last[1] is buffers and last[2] is repeat[2]
                    and last[3] == repeat[3] and state.done is not None):
                # the same schedule, the same plan-kernel bytes (no other plan launched since: it would be
                # the last plan), the same launches: the plan kernel again over the newly staged lengths
                _build.launch_packed(buffers.last_plan_launch, stream.ptr)
                state.done.record(stream)
                self._mine.plan = state
                return self
        # the bounds the plan kernel holds device lengths to (host lengths were checked already)
        if step.on_host:
            kv_bound = 2**31 - 1
            sched = self._schedules.step(step.q_host, step.kv_host, **self._device_facts(device_id), window=window)
        else:
            kv_bound = int(max_kv_len) if max_kv_len is not None else 2**31 - 1
            sched = self._schedules.step(max_q_len=step.max_q_len, max_kv_len=max_kv_len, capacity=buffers.capacity,
                                         batch_size=step.batch, **self._device_facts(device_id), window=window)
        tile, long_tile = sched.plan_tiles()
        self._check_partials(sched.partial_rows)
        if sched is not self._loaded:  # a new schedule: its kernels missing on this device compile at once
            # (the staging kernel with them: a later device-length step's staging finds it loaded)
            _build.load_all([_catalog.PLAN_KERNEL, _catalog.STAGE_KERNEL]
                            + self._launcher.kernels(sched, bool(window or soft_cap), step.num_tokens), device_id)
            self._loaded = sched
        _plan.launch_plan(buffers, step.batch, self.group_size, tile, stream, long_tile, max_q_len=step.max_q_len,
                          max_kv_len=min(kv_bound, 2**31 - 1), window=window)
        done = None
        if not capturing:
            if self._done is None:
                import cupy

                self._done = cupy.cuda.Event(disable_timing=True)
            done = self._done
            done.record(stream)  # (a later plan records it again: only the current plan's runs wait on it)
        previous = self._plan
        state = self._plan = _plan.PlanState(
            step.batch, step.num_tokens, sched, mask_mode, sm_scale, step.pt_host if step.on_host else None,
            step.q_host, step.kv_host, step.page_columns, stream.ptr, done, stream,
            mask_entries=step.mask_bytes if step.has_mask else 0,
            check=_knobs.knobs().debug if check is None else bool(check), window=window, soft_cap=soft_cap,
            page_table_stride=stride or buffers.page_table.shape[1], repeat=repeat)
        if previous is not None and previous.prepared is not None and previous.prepared.matches(state, buffers,
                                                                                                device_id):
            state.prepared = previous.prepared  # the same launches: their packed structs as they are
        self._mine.plan = state
        return self

    def _device_facts(self, device_id):
        """What the schedule reads of the device (its shared memory, SMs, arch), once per knobs."""
        facts = self._facts
        if facts is None or facts[0] is not _knobs.knobs() or facts[1] != device_id:
            facts = self._facts = (_knobs.knobs(), device_id, dict(
                smem_limit=_build.device_smem_limit(device_id), arch=_build.current_arch(device_id),
                sm_count=_build.device_attribute("MultiProcessorCount", device_id)))
        return facts[2]

    # ---- run --------------------------------------------------------------------------

    def run(self, q, cache, out=None, *, lse=None, return_lse=False, sinks=None):
        """Attention of the planned batch over ``cache``, on the caller's stream (torch's
        current stream for torch tensors, else CuPy's).

        Args:
            q: ``[T, num_qo_heads, head_dim]`` device array (torch, CuPy, any DLPack) of this
                instance's dtype, C-contiguous, 16-byte aligned; request b owns the ``q_len[b]``
                rows from ``sum_{c<b} q_len[c]`` on. ``T = sum(q_lens)`` for a host-planned step;
                a device-planned step takes any ``T`` within the capacity (rows past the last
                request are neither read nor written).
            cache: the :class:`PagedKVCache` this step's K/V were already appended to, of the
                same dtype, ``num_kv_heads`` and ``head_dim``.
            out: optional ``[T, num_qo_heads, head_dim_vo]`` destination of q's dtype (8-byte
                aligned); a new array otherwise. Rows of padded requests are not written.
            lse: optional float32 ``[T, num_qo_heads]`` destination of the natural-log LSE.
            return_lse: also return the LSE (allocated when ``lse`` is not given).
            sinks: attention sinks (gpt-oss): a float32 ``[num_qo_heads]`` device array, one
                logit per query head in the units of the scaled (and soft-capped) scores, added to
                each row's softmax denominator with a zero value: ``out = sum_j e^{s_j} v_j /
                (sum_j e^{s_j} + e^{sinks[h]})``; the LSE then includes it. Per run, so each
                layer passes its own; inside a CUDA-graph capture the array is read at each
                replay (keep it alive, update it in place). None: no sinks.
        Returns:
            ``out``, or ``(out, lse)`` with ``return_lse``. Arrays allocated here come back in
            q's framework, zero copy (torch in, torch out; JAX in, JAX out; else CuPy).
        Raises:
            RuntimeError: ``run`` before ``plan``; no usable CUDA device; another thread inside
                ``plan`` / ``run`` of this instance at the same time, or another thread's ``plan``
                since this thread's own (this thread would run that thread's batch).
            TypeError: ``cache`` not a PagedKVCache; q, out or the cache of another dtype; a NumPy
                array for q, out, lse or sinks; ``sinks`` not float32.
            ValueError: shapes that do not fit the plan or this instance (``T != sum(q_lens)``,
                head count, head dim), arrays that are not C-contiguous, misaligned, on the CPU or
                on another device, ``out`` / ``lse`` not given inside a CUDA-graph capture, ``sinks`` not of
                shape ``[num_qo_heads]``; and the page-table
                checks of a host-planned step, made here against ``cache`` once per cache geometry:
                every page id the step reads must be a page of the cache and every live row wide
                enough for ``ceil(kv_len / page_size)`` pages (a device page table: widths only).
            ValueError (a plan with ``check``): a request whose device metadata broke the
                contract (a page id outside ``cache``, ...), after the launch and a sync.
        Nothing is launched when it raises (but for ``check``'s, raised after the run).

        Device page ids are checked by the kernel against ``cache.num_pages``: a request that
        reads one outside the cache reads page 0 instead, its rows that depend on it are NaN and
        :meth:`status` names it; the others are computed exactly as without it.
        """
        with self.device_scope():
            self._enter("run")
            try:
                result, stream = self._run_step(q, cache, out, lse, return_lse, sinks)
            finally:
                self._leave()
            if self._plan.check and not stream.is_capturing():
                self._raise_on_bad("run")
        return result

    def _run_step(self, q, cache, out, lse, return_lse, sinks=None):
        """One run: the arrays read as views (cupy_fa._views: no DLPack exchange for CuPy and torch),
        checked, then the plan's prepared launches on the caller's stream. Returns (result, stream)."""
        state = self._plan
        if state is None:
            raise RuntimeError("run() before plan(): plan the step's batch first")
        mine = getattr(self._mine, "plan", None)
        if mine is not None and mine is not state:
            raise RuntimeError(
                f"run() on thread {threading.current_thread().name!r}: another thread planned this BatchAttention "
                f"after this thread's own plan, so this run would compute that thread's batch; use one "
                f"BatchAttention per thread")
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a cupy_fa.PagedKVCache, got {type(cache).__name__}")
        stream, (q_v, out_v, lse_v, sinks_v) = _views.intake((q, out, lse, sinks), _RUN_ARRAYS, self.device_id)
        check_run(self, state, q_v, cache, out_v, lse_v)
        if sinks_v is not None and not sinks_v.fits(np.float32, (self.num_qo_heads,), self.device_id, 4):
            _arrays.check_device_array(sinks_v, "sinks", dtype=np.float32, ndim=1, shape=(self.num_qo_heads,),
                                       device_id=self.device_id, align=4, bound=self._bound_text)
        num_tokens = q_v.shape[0]
        capturing = stream.is_capturing()
        if out_v is None:
            if capturing:
                raise ValueError("out must be given when running inside a CUDA-graph capture")
            out_v = _views.allocate(q_v, (num_tokens, self.num_qo_heads, self.head_dim_vo), self._np_dtype, stream)
        if return_lse and lse_v is None:
            if capturing:
                raise ValueError("lse must be given to return it inside a CUDA-graph capture")
            lse_v = _views.allocate(q_v, (num_tokens, self.num_qo_heads), np.float32, stream)
        self._after_plan(state, stream, capturing)
        self._launcher.launch(state, self._buffers, cache, q_v.ptr, out_v.ptr, lse_v.ptr if lse_v is not None else 0,
                              num_tokens, stream.ptr, sinks_v.ptr if sinks_v is not None else 0, self.device_id)
        result = out if out is not None else _views.result(out_v, q, stream)
        if return_lse:
            return (result, lse if lse is not None else _views.result(lse_v, q, stream)), stream
        return result, stream

    @property
    def planned(self):
        """The current plan's host-visible facts (batch size, its ``schedule``: the launches with
        their tiles and grids; ``tile`` / ``work_grid`` of the small-q launch, ``long_tile``), for
        logs and tests."""
        return self._plan
