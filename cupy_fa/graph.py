"""CUDA-graph capture and replay of attention steps, one graph per (mode, batch bucket).

Everything a step changes lives in static device buffers, sized for ``max_batch_size x
max_q_len`` query tokens and ``max_pages_per_request`` pages: the lengths, page-table rows and
tree mask in the runner's ``BatchAttention``'s own plan buffers, q, out and lse here. A step
checks its inputs once (:func:`cupy_fa.plan.check_step`, as ``BatchAttention.plan`` does), stages
them once, straight into those buffers (on the caller's stream, no host sync when the inputs are
device arrays), and launches the graph. A batch smaller than its bucket is padded with
``q_len = 0`` rows that read and write nothing.

The captured step is the same code as the eager step (:meth:`GraphRunner.run` with
``use_graph=False``): the plan kernel on the staged buffers (``BatchAttention``'s plan of staged
inputs), then ``BatchAttention.run``. So eager and replay results are bit-identical and cannot
drift (docs/design.md, "CUDA graphs").

A graph freezes what it read of the K/V cache (``PagedKVCache.attention_params()``: its addresses,
page size and count, an fp8 cache's scale arrays): graphs are kept per cache by all of them (a
cache allocated at a freed one's address with other pages gets its own graph), so an
engine with one cache per layer either gives each layer its own runner key (it
happens automatically) or, better, captures its whole forward with
``torch.cuda.graph`` around ``BatchAttention.plan`` / ``run`` on torch tensors,
which works too (our kernels launch on torch's capture stream).
"""

import sys
import threading

import numpy as np

from . import _arrays, _staging, _views, knobs as _knobs, plan as _plan, schedule as _schedule
from .attention import BatchAttention
from .kv_cache import PagedKVCache
from .modes import ForwardMode
from .variants import checked_soft_cap, checked_window


def default_buckets(max_batch_size):
    buckets, b = [], 1
    while b < max_batch_size:
        buckets.append(b)
        b *= 2
    return tuple(buckets + [max_batch_size])


class GraphRunner:
    """Replays one captured attention step per (mode, batch bucket, cache).

    Args:
        num_qo_heads, num_kv_heads, head_dim, dtype, kv_dtype, workspace_bytes, head_dim_vo: as for
            :class:`BatchAttention` (``kv_dtype="float8_e4m3fn"``: the caches are fp8;
            ``head_dim_vo``: V's and out's head dim where it differs, the static out
            ``[tokens, H_q, head_dim_vo]``).
        max_batch_size: largest batch (the largest bucket).
        max_q_len: largest q_len of any request in a non-DECODE mode (N for verify /
            draft-extend, the chunk for EXTEND / MIXED).
        max_pages_per_request: page-table columns; with ``page_size`` it bounds kv_len.
        page_size: page size of the caches the runner will be used with.
        buckets: batch sizes to capture (default powers of two up to max_batch_size).
        tree_mask: reserve space for TARGET_VERIFY custom masks (tree speculation).
        window, logits_soft_cap: the sliding window and logits soft-cap of every step it runs (as
            :meth:`BatchAttention.plan` takes them; a runner per kind of layer).
        device: the CUDA device the runner is bound to (as for :class:`BatchAttention`; default
            CuPy's current device when it is made): its buffers, its BatchAttention and its graphs
            live there, each run makes it current, and the inputs and caches must live there.
    Raises:
        ValueError: a size that is not a positive int, buckets that are not positive ints or do
            not reach max_batch_size, a bad ``window`` or ``logits_soft_cap`` (as
            :meth:`BatchAttention.plan`); what :class:`BatchAttention` raises for the heads, head
            dim and dtype, a ``device`` that is no CUDA device of this process, an fp8 ``kv_dtype``
            at head dim 64 / 128 with a ``CUPY_FA_SPLIT_SIZE`` that is not a multiple of 128 keys
            (all before anything is allocated). RuntimeError: no
            usable CUDA device.

    It allocates its static buffers at construction: q, out, lse for ``max_batch_size x max_q_len``
    tokens here, the lengths, page table and mask in its :class:`BatchAttention`'s plan buffers
    (a step is staged straight into them). Call :meth:`run` outside any other capture;
    inside your own ``torch.cuda.graph``, use :class:`BatchAttention` directly.
    """

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, dtype="bfloat16", *, max_batch_size, max_q_len,
                 max_pages_per_request, page_size, buckets=None, tree_mask=False, kv_dtype=None, window=None,
                 logits_soft_cap=None, workspace_bytes=None, device=None, head_dim_vo=None):
        self.window, self.soft_cap = checked_window(window), checked_soft_cap(logits_soft_cap)
        if kv_dtype is not None:  # before anything is allocated
            kv_name = _arrays.resolve_kv_dtype(kv_dtype, "kv_dtype")
            if kv_name == _arrays.FP8 and isinstance(head_dim, (int, np.integer)):
                _schedule.check_split_size(int(head_dim), kv_bytes=1)

        for name, value in (("max_batch_size", max_batch_size), ("max_q_len", max_q_len),
                            ("max_pages_per_request", max_pages_per_request), ("page_size", page_size)):
            _plan.check_count(name, value, 1)
        if buckets is not None and (not len(buckets) or any(isinstance(b, bool) or not isinstance(b, (int, np.integer))
                                                            or b < 1 for b in buckets)):
            raise ValueError(f"buckets must be positive ints, got {buckets!r}")
        self.max_batch_size, self.max_q_len = int(max_batch_size), int(max_q_len)
        self.max_pages_per_request, self.page_size = int(max_pages_per_request), int(page_size)
        self.buckets = tuple(sorted(buckets or default_buckets(self.max_batch_size)))
        if self.buckets[-1] < self.max_batch_size:
            raise ValueError(f"buckets {self.buckets} must reach max_batch_size {self.max_batch_size}")
        tokens = self.max_batch_size * self.max_q_len
        mask_bytes = self.max_batch_size * self.max_q_len ** 2 if tree_mask else 0
        self.attn = BatchAttention(num_qo_heads, num_kv_heads, head_dim, dtype, max_batch_size=self.max_batch_size,
                                   max_num_tokens=tokens, max_pages_per_request=self.max_pages_per_request,
                                   max_mask_bytes=mask_bytes, kv_dtype=kv_dtype, workspace_bytes=workspace_bytes,
                                   device=device, head_dim_vo=head_dim_vo)
        self.device_id = self.attn.device_id
        self.tree_mask = tree_mask
        self._sm_scale = _plan.checked_sm_scale(None, self.attn.head_dim)
        elem = self._elem = _arrays.DTYPES[self.attn.dtype_name]
        self._row_bytes = num_qo_heads * head_dim * elem.itemsize  # bytes of one token of q
        import cupy  # (the BatchAttention's buffers are allocated: CuPy and a device are there)

        with self.attn.device_scope():
            self.q = cupy.zeros((tokens, num_qo_heads, head_dim), elem)
            self.out = cupy.zeros((tokens, num_qo_heads, self.attn.head_dim_vo), elem)
            self.lse = cupy.zeros((tokens, num_qo_heads), np.float32)
            self.sinks = cupy.zeros(num_qo_heads, np.float32)  # run(sinks=...) is copied here: the graphs read it
        self._q_ptr, self._sinks_ptr, self._sinks_bytes = self.q.data.ptr, self.sinks.data.ptr, self.sinks.nbytes
        self._graphs = {}
        self._staged = {}     # (max q_len, bucket, tree) -> the StepInputs of the bucket's rows in the plan buffers
        self._slices = {}     # token count -> (q, out, lse) views of the static buffers
        self._torch = None    # (out, lse) as torch tensors, made at the first torch caller
        self._busy = threading.Lock()  # one run() at a time: the static buffers hold one step
        self._last_stream = None       # the stream of the last step (a step on another waits for it)

    # ---- public --------------------------------------------------------------------

    def bucket_for(self, batch_size):
        for bucket in self.buckets:
            if bucket >= batch_size:
                return bucket
        raise ValueError(f"batch of {batch_size} requests exceeds max_batch_size {self.max_batch_size}")

    def run(self, mode, q, cache, q_lens, kv_lens, page_table, *, custom_mask=None, use_graph=True,
            return_lse=False, sinks=None):
        """One attention step of ``mode`` in contract terms (see :mod:`cupy_fa.modes`): captured
        on first use of each (mode, batch bucket, cache), replayed after.

        Args:
            mode: a :class:`ForwardMode` (or its value).
            q: ``[sum(q_lens), H_q, D]`` device array of the runner's dtype (copied into the
                static buffer: any alignment).
            cache: the :class:`PagedKVCache` this step's K/V were appended to, of the runner's
                ``page_size``.
            q_lens, kv_lens: ``[B]`` contract lengths, ``B <= max_batch_size``; q_len at most 1 for
                DECODE and ``max_q_len`` otherwise. page_table: ``[B, <= max_pages_per_request]``.
                Host or device values; host ones are checked here (lengths, ``sum(q_lens)``, page
                ids against the cache), device ones by the kernels: a request that breaks the
                contract gets NaN rows and :meth:`status` names it (the others are unaffected).
            custom_mask: TARGET_VERIFY tree mask, flat bool of ``sum(q_len**2)`` (a runner built
                with ``tree_mask=True``).
            use_graph: False runs the same step eagerly (bit-identical results).
            return_lse: also return the LSE view.
            sinks: attention sinks, float32 ``[H_q]`` device array (:meth:`BatchAttention.run`),
                copied into a static buffer each step (steps with and without sinks are graphs of
                their own).
        Returns:
            A view ``[sum(q_lens), H_q, D_vo]`` of the runner's static output, valid until the next
            ``run``, in q's framework; with ``return_lse`` also the ``[sum(q_lens), H_q]`` LSE view.
        Raises:
            ValueError: a batch beyond ``max_batch_size``, q_lens above the mode's bound, more
                page-table columns than ``max_pages_per_request``, a cache of another page size,
                a custom mask outside tree TARGET_VERIFY, ``sinks`` not of shape ``[H_q]``, q, cache,
                sinks or device lengths / page table / mask on another device than the runner's
                (``device_id``), and what
                :meth:`BatchAttention.plan` raises for host inputs; with ``CUPY_FA_DEBUG=1``, a request whose device
                metadata broke the contract (after a sync). TypeError: cache not a PagedKVCache.
                RuntimeError: called inside another capture, no usable CUDA device, from a second
                thread while another is inside ``run`` (one runner serves one call at a time).
        """
        mode = ForwardMode(mode)
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a cupy_fa.PagedKVCache, got {type(cache).__name__}")
        if cache.page_size != self.page_size:
            raise ValueError(f"cache.page_size is {cache.page_size}, the runner was built for {self.page_size}")
        tree = custom_mask is not None
        if tree and not (self.tree_mask and mode is ForwardMode.TARGET_VERIFY):
            raise ValueError("custom_mask is for TARGET_VERIFY on a runner built with tree_mask=True")
        with self.attn.device_scope():  # the runner's device, current for the whole step (staging, capture, replay)
            stream = _views.caller_stream((q, q_lens, kv_lens, page_table), self.device_id)
            if stream.is_capturing():  # before anything is staged: none of it may land in the caller's graph
                raise RuntimeError("GraphRunner captures its own graphs; call it outside another capture "
                                   "(or use BatchAttention directly inside torch.cuda.graph)")
            if not self._busy.acquire(blocking=False):
                raise RuntimeError(f"GraphRunner.run() on thread {threading.current_thread().name!r} while another "
                                   f"thread is inside run() of the same runner: its static buffers serve one step "
                                   f"at a time; use one GraphRunner per thread")
            try:
                result = self._run_step(mode, q, cache, q_lens, kv_lens, page_table, custom_mask, tree, use_graph,
                                        return_lse, stream, sinks)
            finally:
                self._busy.release()
        if _knobs.knobs().debug and mode is not ForwardMode.IDLE:
            found = self.status()
            if not found.ok:
                raise ValueError(f"GraphRunner.run (CUPY_FA_DEBUG=1): {found}: the device metadata breaks the "
                                 f"contract (its rows of out are NaN; docs/errors.md)")
        return result

    def status(self):
        """The status word of the last step (syncs): see :meth:`BatchAttention.status`."""
        with self.attn.device_scope():
            if self._last_stream is not None:
                self._last_stream.synchronize()
            return self.attn.status()

    def _run_step(self, mode, q, cache, q_lens, kv_lens, page_table, custom_mask, tree, use_graph, return_lse,
                  stream, sinks=None):
        q_v = _views.view(q, "q", stream)
        sinks_v = _views.view(sinks, "sinks", stream) if sinks is not None else None
        if sinks_v is not None and not sinks_v.fits(np.float32, self.sinks.shape, self.device_id, 0):
            _arrays.check_device_array(sinks_v, "sinks", dtype=np.float32, ndim=1, shape=self.sinks.shape,
                                       device_id=self.device_id, align=0, bound=self._bound_text)  # copied
        step = self._check_step(mode, q_v, q_lens, kv_lens, page_table, cache, custom_mask, stream)
        num_tokens = q_v.shape[0]
        if step is None or step.batch == 0 or num_tokens == 0:  # IDLE, or an all-padding step: nothing to launch
            return self._result(num_tokens, q, return_lse)
        bucket = self.bucket_for(step.batch)
        if self._last_stream is not None and self._last_stream.ptr != stream.ptr:
            stream.wait_event(self._last_stream.record())  # the last step's kernels read what is staged next
        self._last_stream = stream
        # staged once, straight into the plan buffers and the static q and sinks: the device parts in one call
        sunk = sinks_v is not None
        parts = [_staging.part(q_v.ptr, self._q_ptr, num_tokens * self._row_bytes)]
        if sunk:
            parts.append(_staging.part(sinks_v.ptr, self._sinks_ptr, self._sinks_bytes))
        _plan.stage_inputs(self.attn.plan_buffers, step, pad_to=bucket, stream=stream, extra=parts)
        if use_graph:
            key = (mode, bucket, tree, cache.params_key(), sunk)
            graph = self._graphs.get(key)
            if graph is None:
                with stream:
                    graph = self._graphs[key] = self._capture(mode, bucket, cache, tree, stream, sunk)
            graph.launch(stream)
        else:
            with stream:  # (the run's arrays are CuPy's: its current stream is the step's)
                self._step(mode, bucket, cache, tree, stream, sunk)
        return self._result(num_tokens, q, return_lse)

    @property
    def num_graphs(self):
        return len(self._graphs)

    @property
    def _bound_text(self):
        return f"the device this GraphRunner is bound to (device={self.device_id})"

    # ---- internals -----------------------------------------------------------------

    def _max_q(self, mode):
        return 1 if mode is ForwardMode.DECODE else self.max_q_len

    def _check_step(self, mode, q_dev, q_lens, kv_lens, page_table, cache, custom_mask, stream=None):
        """The step's inputs checked (plan.check_step, the same checks as BatchAttention.plan) and
        against this runner's bounds; None for IDLE."""
        attn = self.attn
        want = (q_dev.shape[0], attn.num_qo_heads, attn.head_dim) if q_dev.ndim == 3 else ()
        if not q_dev.fits(self._elem, want, self.device_id, 0):  # copied: any alignment
            _arrays.check_device_array(q_dev, "q", dtype=attn.dtype_name, ndim=3, align=0,
                                       shape=(None, attn.num_qo_heads, attn.head_dim), device_id=self.device_id,
                                       bound=self._bound_text)
        if cache.device_id != self.device_id:
            raise ValueError(f"cache is on device {cache.device_id}, expected device {self.device_id} "
                             f"({self._bound_text})")
        if mode is ForwardMode.IDLE:
            return None
        max_q = self._max_q(mode)
        step = _plan.check_step(q_lens, kv_lens, page_table, custom_mask, max_q_len=max_q, device_id=self.device_id,
                                bound=self._bound_text, stream=stream)
        if q_dev.shape[0] > step.batch * max_q:
            raise ValueError(f"q has {q_dev.shape[0]} tokens, more than {step.batch} requests x max q_len "
                             f"{max_q} of {mode.name}")
        if not 0 <= step.page_columns <= self.max_pages_per_request:
            shape = (step.pt_host if step.pt_host is not None else step.pt_dev).shape
            raise ValueError(f"page_table must be [B, <= {self.max_pages_per_request}], got {tuple(shape)}")
        if step.batch > self.max_batch_size:
            raise ValueError(f"batch of {step.batch} requests exceeds max_batch_size {self.max_batch_size}")
        if step.has_mask and step.mask_bytes > attn.plan_buffers.capacity.max_mask_bytes:
            raise ValueError(f"custom_mask has {step.mask_bytes} entries, more than the {self.max_batch_size} x "
                             f"{self.max_q_len}^2 this runner holds")
        if step.on_host:  # host inputs: the contract checked before any copy
            if step.max_q_len > max_q:
                raise ValueError(f"q_lens max {step.max_q_len} exceeds {mode.name}'s max q_len {max_q}")
            if step.num_tokens != q_dev.shape[0]:
                raise ValueError(f"q has {q_dev.shape[0]} tokens, sum(q_lens) is {step.num_tokens}")
            _plan.check_page_table(step, cache.page_size, cache.num_pages)
        return step

    def _step(self, mode, bucket, cache, tree, stream, sunk=False):
        """The captured work, on inputs already staged: the plan kernel, then attention."""
        max_q = self._max_q(mode)
        tokens = bucket * max_q
        attn = self.attn
        staged = self._staged.get((max_q, bucket, tree))
        if staged is None:  # the bucket's rows as they sit in the plan buffers
            buffers = attn.plan_buffers
            staged = self._staged[(max_q, bucket, tree)] = _plan.StepInputs(
                batch=bucket, q_host=None, q_dev=buffers.q_lens[:bucket], kv_host=None,
                kv_dev=buffers.kv_lens[:bucket], pt_host=None, pt_dev=buffers.page_table[:bucket], mask_host=None,
                mask_dev=buffers.custom_mask[:bucket * max_q * max_q] if tree else None, num_tokens=None,
                max_q_len=max_q, mask_bytes=bucket * max_q * max_q, stream=None)
        attn.plan_staged(staged, _plan.MASK_CUSTOM if tree else _plan.MASK_CAUSAL, self._sm_scale,
                         self.max_pages_per_request * self.page_size, stream, window=self.window,
                         soft_cap=self.soft_cap)
        q, out, lse = self._views_of(tokens)
        attn.run(q, cache, out=out, lse=lse, sinks=self.sinks if sunk else None)

    def _views_of(self, tokens):
        found = self._slices.get(tokens)
        if found is None:
            found = self._slices[tokens] = (self.q[:tokens], self.out[:tokens], self.lse[:tokens])
        return found

    def _capture(self, mode, bucket, cache, tree, stream, sunk=False):
        import cupy

        self._step(mode, bucket, cache, tree, stream, sunk)  # warm-up: compiles kernels and sets smem limits first
        capture = cupy.cuda.Stream(non_blocking=True)
        capture.wait_event(stream.record())
        with capture:
            capture.begin_capture()
            try:
                self._step(mode, bucket, cache, tree, capture, sunk)
            finally:
                graph = capture.end_capture()
        stream.wait_event(capture.record())
        return graph

    def _result(self, num_tokens, like, return_lse):
        if _views.kind_of(like) == _views.TORCH:  # torch views of the static buffers, made once
            if self._torch is None:
                torch = sys.modules["torch"]
                self._torch = (torch.from_dlpack(self.out), torch.from_dlpack(self.lse))
            out_t, lse_t = self._torch
            return (out_t[:num_tokens], lse_t[:num_tokens]) if return_lse else out_t[:num_tokens]
        _, out, lse = self._views_of(num_tokens)
        out = _arrays.to_caller(out, like)
        if return_lse:
            return out, _arrays.to_caller(lse, like)
        return out
