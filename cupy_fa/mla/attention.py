"""``MLAAttention``: multi-head latent attention (DeepSeek V2 / V3 / R1, Kimi K2), the absorbed form,
over a :class:`~cupy_fa.mla.PagedLatentCache`: ``plan()`` a step's batch once, ``run()`` it per layer.

Shapes (T = sum of q_lens, B requests, H heads on this rank):
    q              [T, H, 576]: each head's absorbed query (q_nope W_UK, 512) then its rotary part (64);
                   or q_nope [T, H, 512] with q_pe=[T, H, 64] (two arrays, or two views of one)
    cache          PagedLatentCache [num_pages, page_size, 576]: c_kv (512) then k_pe (64) a token
    out            [T, H, 512]: softmax(q . [c_kv, k_pe] x sm_scale) c_kv (the engine applies W_UV)
    lse            [T, H] float32, natural log of the softmax denominator
    q_lens, kv_lens, page_table, custom_mask: the contract of cupy_fa.BatchAttention (kv_len counts
                   the keys AFTER this step's latent rows were appended; docs/design.md "The contract")

Every serving mode (cupy_fa.modes gives each one's q_len / kv_len): DECODE, TARGET_VERIFY (chain:
causal; tree: custom_mask), DRAFT_EXTEND (v1 / V2), MIXED and chunked EXTEND over a prefix.
"""

import math

import numpy as np

from .. import _arrays, _build, _views, knobs as _knobs, plan as _plan
from .._instance import PlannedInstance, checked_capacity, checked_workspace
from ..families import mla as family
from . import schedule as _schedule
from .cache import PagedLatentCache, check_rows
from .launch import launch_step, step_kernels
from .plan import MlaPlanState, plan_buffers, plan_launch

DEFAULT_SM_SCALE = 1.0 / math.sqrt(128 + 64)  # DeepSeek's qk head (nope 128 + rope 64) before absorption
_RUN_NAMES = ("q", "q_pe", "out", "lse")


class MLAAttention(PlannedInstance):
    """Absorbed multi-head latent attention of a ragged batch over a paged latent cache.

    Args:
        num_heads: query heads on this rank (128 for DeepSeek V3 on one GPU, 16 under TP 8), >= 1.
        dtype: "bfloat16" or "float16": q, out (and a 16-bit cache).
        kv_dtype: the cache's dtype: None (``dtype``) or "float8_e4m3fn" (an fp8 cache with its scale).
        kv_lora_rank, qk_rope_head_dim: 512 and 64 (DeepSeek V2 / V3 / R1, Kimi K2): the only sizes.
        max_batch_size, max_num_tokens, max_pages_per_request, max_mask_bytes: the capacity of the
            preallocated metadata buffers (all of the first three, or none: then sized on first use and
            grown by eager plans). Needed before a CUDA-graph capture.
        workspace_bytes: the split partials' size (default 256 MiB, at least 8 splits per token of the
            capacity); a batch that would need more caps every request's splits (results may then
            depend on the batch): a host-planned one warns once (``cupy_fa.BatchInvarianceWarning``,
            naming the size that would hold it).
        device: the CUDA device it is bound to (as for ``BatchAttention``).
    Raises:
        ValueError: ``num_heads`` not a positive int, another ``kv_lora_rank`` / ``qk_rope_head_dim``,
            some but not all capacities, a capacity that is not a positive int, a ``device`` that is no
            CUDA device here. TypeError: a dtype other than float16 / bfloat16, a kv_dtype other than
            ``dtype`` or float8_e4m3fn. RuntimeError: capacities given where there is no usable device.

    Which kernel runs (cupy_fa.mla.schedule): the sm_90a seesaw kernel (wgmma, a 16-bit or fp8 cache) at
    16 heads or more and for long requests, else the mma.sync tile; a token's bits are the same in
    decode and in verify / draft extend of up to 16 tokens by construction (docs/design.md,
    "Multi-head latent attention"; tests/test_mla_gpu.py checks it).
    One call at a time per instance (another thread inside plan / run raises RuntimeError).
    """

    _NAME = "MLAAttention"

    def __init__(self, num_heads, dtype="bfloat16", *, kv_dtype=None, kv_lora_rank=512, qk_rope_head_dim=64,
                 max_batch_size=None, max_num_tokens=None, max_pages_per_request=None, max_mask_bytes=0,
                 workspace_bytes=None, device=None):
        if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if (kv_lora_rank, qk_rope_head_dim) != (family.VALUE_DIM, family.ROPE_DIM):
            raise ValueError(f"kv_lora_rank and qk_rope_head_dim must be {family.VALUE_DIM} and {family.ROPE_DIM} "
                             f"(DeepSeek V2 / V3 / R1, Kimi K2), got {kv_lora_rank!r} and {qk_rope_head_dim!r}")
        self.num_heads = int(num_heads)
        self.dtype_name = _arrays.resolve_dtype(dtype)
        self._np_dtype = _arrays.DTYPES[self.dtype_name]
        self.kv_dtype_name = self.dtype_name if kv_dtype is None else _arrays.resolve_kv_dtype(kv_dtype, "kv_dtype")
        if self.kv_dtype_name not in (self.dtype_name, _arrays.FP8):
            raise TypeError(f"kv_dtype must be dtype ({self.dtype_name}) or float8_e4m3fn, got {self.kv_dtype_name}")
        capacity = checked_capacity(max_batch_size, max_num_tokens, max_pages_per_request, max_mask_bytes)
        self._workspace = checked_workspace(workspace_bytes)
        self._loaded = None  # the kernels of the last step planned, loaded on this device (_load)
        self._memo = _schedule.ScheduleMemo(self.num_heads, self.kv_dtype_name == _arrays.FP8)  # host-length plans
        self._bind(device, capacity)  # (cupy_fa._instance: the device, the buffers of a fixed capacity)

    def _new_buffers(self, capacity):
        return plan_buffers(capacity, self.num_heads, self.dtype_name, self._workspace)

    @property
    def kv_fp8(self):
        return self.kv_dtype_name == _arrays.FP8

    # ---- plan ------------------------------------------------------------------------

    def plan(self, q_lens, kv_lens, page_table, *, causal=True, sm_scale=None, custom_mask=None, max_q_len=None,
             max_kv_len=None, check=None):
        """Plans one step's batch (its metadata on the device); then :meth:`run` once per layer.

        Args:
            q_lens, kv_lens, page_table, custom_mask, causal, max_q_len, max_kv_len, check: as for
                :meth:`cupy_fa.BatchAttention.plan` (host or device values; device lengths need
                ``max_q_len``; ``custom_mask``: tree verify, ``sum(q_len**2)`` entries).
            sm_scale: the softmax scale, a positive float: DeepSeek's ``1 / sqrt(192)`` times the YaRN
                mscale squared where the model has one (V3: the engine's ``layer.scaling``). Default
                ``1 / sqrt(192)``.
        Returns:
            self.
        Raises:
            ValueError / TypeError: what ``BatchAttention.plan`` raises for the lengths, page table and
                mask; a bad ``sm_scale``; a step beyond the capacity. RuntimeError: no usable CUDA
                device; another thread inside this instance. ValueError (``check``): a request whose
                device metadata broke the contract, after a sync.
        """
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be True or False, got {causal!r}")
        with self.device_scope():
            self._enter("plan")
            try:
                self._plan_step(q_lens, kv_lens, page_table, causal, sm_scale, custom_mask, max_q_len, max_kv_len,
                                check)
            finally:
                self._leave()
        state = self._plan
        if state.check and state.done is not None:
            self._raise_on_bad("plan")
        return self

    def _plan_step(self, q_lens, kv_lens, page_table, causal, sm_scale, custom_mask, max_q_len, max_kv_len, check):
        step = _plan.check_step(q_lens, kv_lens, page_table, custom_mask, max_q_len=max_q_len,
                                device_id=self.device_id, bound=self._bound_text)
        sm_scale = _plan.checked_sm_scale(DEFAULT_SM_SCALE if sm_scale is None else sm_scale, 576)
        stream = step.stream if step.stream is not None else _arrays.caller_stream(device_id=self.device_id)
        capturing = stream.is_capturing()
        self._order_after_previous(stream, capturing)
        tokens = step.num_tokens if step.num_tokens is not None else (
            0 if self._fixed_capacity else step.batch * step.max_q_len)
        self._ensure_capacity(step.batch, tokens, step.page_columns, step.mask_bytes if step.has_mask else 0,
                              capturing, stream)
        stride = _plan.stage_inputs(self._buffers, step, stream=stream, capturing=capturing)  # dense rows
        mask_mode = _plan.MASK_CUSTOM if step.has_mask else (_plan.MASK_CAUSAL if causal else _plan.MASK_NONE)
        self._plan_staged(step, mask_mode, sm_scale, max_kv_len, stream, check, stride)

    def _plan_staged(self, step, mask_mode, sm_scale, max_kv_len, stream, check, page_table_stride):
        buffers = self._buffers
        arch = _build.current_arch(self.device_id)
        if step.on_host:
            sched = self._memo.step(arch, step.q_host, step.kv_host)
            kv_bound = int(step.kv_host.max()) if step.batch else 0
            self._check_partials(sched.partial_rows)
        else:
            sched = _schedule.schedule_step(self.num_heads, self.kv_fp8, arch, max_q_len=step.max_q_len,
                                            max_kv_len=max_kv_len, capacity=buffers.capacity)
            kv_bound = int(max_kv_len) if max_kv_len is not None else 2**31 - 1
        from .. import catalog

        self._load(catalog.PLAN_KERNEL, sched, step.num_tokens)
        _build.launch_packed(plan_launch(buffers, step.batch, self.num_heads, sched, step.max_q_len,
                                         min(kv_bound, 2**31 - 1)), stream.ptr)
        done = None if stream.is_capturing() else stream.record()
        previous = self._plan
        self._plan = state = MlaPlanState(step.batch, step.num_tokens, sched, mask_mode, sm_scale, step, stream, done,
                                          mask_entries=step.mask_bytes if step.has_mask else 0,
                                          check=_knobs.knobs().debug if check is None else bool(check),
                                          page_table_stride=page_table_stride)
        if previous is not None and previous.prepared is not None and previous.prepared.matches(state, buffers,
                                                                                               self.device_id):
            state.prepared = previous.prepared  # (a step of the same shape: its packed launches)

    def _load(self, plan_kernel, sched, num_tokens):
        """The plan kernel and every kernel ``sched`` may launch (``launch.step_kernels``), those missing
        on this device compiled at once (``_build.load_all``: a first call waits for its slowest kernel,
        not for their sum)."""
        kernels = [plan_kernel] + step_kernels(sched, self.dtype_name, self.num_heads, num_tokens)
        if kernels != self._loaded:
            _build.load_all(kernels, self.device_id)
            self._loaded = kernels

    # ---- run --------------------------------------------------------------------------

    def run(self, q, cache, out=None, *, q_pe=None, lse=None, return_lse=False):
        """Attention of the planned batch over ``cache``, on the caller's stream.

        Args:
            q: ``[T, H, 576]`` (q_nope then q_pe), or q_nope ``[T, H, 512]`` with ``q_pe`` ``[T, H, 64]``;
                device arrays of this instance's dtype with a contiguous last dimension and 16-byte
                aligned rows (any token and head strides). ``T = sum(q_lens)`` for host lengths.
            cache: the :class:`PagedLatentCache` this step's rows were appended to, of ``kv_dtype``.
            out: optional ``[T, H, 512]`` destination, C-contiguous and 16-byte aligned, of q's dtype;
                a new array otherwise (in q's framework). Rows of padded requests are not written.
            lse: optional float32 ``[T, H]`` destination of the natural-log LSE; return_lse: return it.
        Returns:
            ``out``, or ``(out, lse)`` with ``return_lse``.
        Raises:
            RuntimeError: ``run`` before ``plan``; another thread inside this instance.
            TypeError: ``cache`` not a PagedLatentCache; q, q_pe, out or the cache of another dtype.
            ValueError: shapes that do not fit (T, H, 576 / 512 + 64), a strided last dimension or
                misaligned rows, ``out`` / ``lse`` missing inside a CUDA-graph capture, arrays on the
                CPU or another device; a page id the step reads outside ``cache`` or a page table too
                narrow for a kv_len (host-planned steps, checked once per cache geometry).
        Nothing is launched when it raises. Device page ids outside the cache make the request's rows
        NaN and :meth:`status` names it.
        """
        with self.device_scope():
            self._enter("run")
            try:
                result = self._run(q, cache, out, q_pe, lse, return_lse)
            finally:
                self._leave()
        state = self._plan
        if state.check and not state.stream.is_capturing():
            self._raise_on_bad("run")
        return result

    def _run(self, q, cache, out, q_pe, lse, return_lse):
        import cupy

        state = self._plan
        if state is None:
            raise RuntimeError("run() before plan(): plan the step's batch first")
        if not isinstance(cache, PagedLatentCache):
            raise TypeError(f"cache must be a cupy_fa.PagedLatentCache, got {type(cache).__name__}")
        if cache.dtype_name != self.kv_dtype_name:
            raise TypeError(f"cache dtype is {cache.dtype_name}, this MLAAttention was built for kv_dtype "
                            f"{self.kv_dtype_name}")
        # the arrays as views (cupy_fa._views: no DLPack exchange for CuPy and torch) and the caller's stream
        stream, (q_view, pe_view, out_view, lse_view) = _views.intake((q, q_pe, out, lse), _RUN_NAMES, self.device_id,
                                                                      stream_from=4)
        queries, num_tokens = self._queries(q_view, pe_view, state)
        if cache.device_id != self.device_id:
            raise ValueError(f"cache is on device {cache.device_id}, expected device {self.device_id} ({self._bound_text})")
        h, device = self.num_heads, self.device_id
        if out_view is not None and not out_view.fits(self._np_dtype, (num_tokens, h, 512), device, 16):
            _arrays.check_device_array(out_view, "out", dtype=self.dtype_name, ndim=3, shape=(num_tokens, h, 512),
                                       device_id=device, align=16, bound=self._bound_text)
        if lse_view is not None and not lse_view.fits(np.float32, (num_tokens, h), device, 4):
            _arrays.check_device_array(lse_view, "lse", dtype=np.float32, ndim=2, shape=(num_tokens, h),
                                       device_id=device, align=4, bound=self._bound_text)
        self._check_pages(state, cache)
        capturing = stream.is_capturing()
        out_dev = lse_dev = None
        with stream:
            if out_view is None:
                if capturing:
                    raise ValueError("out must be given when running inside a CUDA-graph capture")
                out_dev = cupy.empty((num_tokens, h, 512), self._np_dtype)
            if return_lse and lse_view is None:
                if capturing:
                    raise ValueError("lse must be given to return it inside a CUDA-graph capture")
                lse_dev = cupy.empty((num_tokens, h), np.float32)
            self._after_plan(state, stream, capturing)
            out_ptr = out_view.ptr if out_view is not None else out_dev.data.ptr
            lse_ptr = lse_view.ptr if lse_view is not None else (lse_dev.data.ptr if lse_dev is not None else 0)
            launch_step(state, self._buffers, h, self.dtype_name, cache, queries, out_ptr, lse_ptr, num_tokens, stream,
                        device)
        result = out if out is not None else _arrays.to_caller(out_dev, q)
        if return_lse:
            return result, (lse if lse is not None else _arrays.to_caller(lse_dev, q))
        return result

    def _queries(self, q_dev, pe_dev, state):
        """((q_nope pointer, (token, head) strides), (q_pe pointer, strides)) in elements, checked
        (``q_dev`` / ``pe_dev``: views, cupy_fa._views.View)."""
        h, bound = self.num_heads, self._bound_text
        width = 576 if pe_dev is None else 512
        if q_dev.ndim != 3 or q_dev.shape[1:] != (h, width):
            what = "[T, H, 576] (or q_nope [T, H, 512] with q_pe)" if pe_dev is None else "q_nope [T, H, 512]"
            raise ValueError(f"q must be {what} with H = {h}, got shape {tuple(q_dev.shape)}")
        parts = [("q", q_dev)] + ([("q_pe", pe_dev)] if pe_dev is not None else [])
        strides = []  # each array's in bytes, read once
        for name, x in parts:
            if x.dtype != self._np_dtype:
                raise TypeError(f"{name} must have dtype {self.dtype_name}, got {_arrays.dtype_name(x.dtype)}")
            strides.append(x.strides)
            check_rows(x, name, self.device_id, bound, strides[-1])
        num_tokens = int(q_dev.shape[0])
        if pe_dev is not None and pe_dev.shape != (num_tokens, h, 64):
            raise ValueError(f"q_pe must be [T, H, 64] = {(num_tokens, h, 64)}, got {tuple(pe_dev.shape)}")
        if state.num_tokens is not None and num_tokens != state.num_tokens:
            raise ValueError(f"q has {num_tokens} tokens, the plan's sum(q_lens) is {state.num_tokens}")
        if state.num_tokens is None and num_tokens > self._buffers.capacity.max_num_tokens:
            raise ValueError(f"q has {num_tokens} tokens, more than max_num_tokens {self._buffers.capacity.max_num_tokens}")
        item = q_dev.dtype.itemsize
        in_elements = [(st[0] // item, st[1] // item) for st in strides]
        nope = (q_dev.ptr, in_elements[0])
        pe = (pe_dev.ptr, in_elements[1]) if pe_dev is not None else (q_dev.ptr + 512 * item, in_elements[0])
        return (nope, pe), num_tokens

    def _check_pages(self, state, cache):
        step, geometry = state.step, (cache.page_size, cache.num_pages)
        if step.on_host and geometry not in state.checked_geometry:
            _plan.check_page_table(step, *geometry)
            state.checked_geometry.add(geometry)

    # ---- state ------------------------------------------------------------------------

    @property
    def planned(self):
        """The current plan (its ``schedule``: the launches, tiles, grids and merge), for logs and tests."""
        return self._plan
