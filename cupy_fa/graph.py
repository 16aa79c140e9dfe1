"""CUDA-graph capture and replay of attention steps, one graph per (mode, batch bucket).

Everything a step changes lives in static device buffers owned here, sized for
``max_batch_size x max_q_len`` query tokens and ``max_pages_per_request`` pages:
lengths, page-table rows, the tree mask, q, out, lse. A replay copies the
step's inputs into them (on the caller's stream, no host sync when the inputs
are device arrays) and launches the graph. A batch smaller than its bucket is
padded with ``q_len = 0`` rows that read and write nothing.

The captured step is the same code as the eager step (:meth:`GraphRunner.run`
with ``use_graph=False``): ``BatchAttention.plan`` on the static device buffers,
which launches the device metadata kernel, then ``BatchAttention.run``. So eager
and replay results are bit-identical and cannot drift.

A graph freezes the K/V cache pointers: graphs are kept per cache, so an
engine with one cache per layer either gives each layer its own runner key (it
happens automatically) or, better, captures its whole forward with
``torch.cuda.graph`` around ``BatchAttention.plan`` / ``run`` on torch tensors,
which works too (our kernels launch on torch's capture stream).
"""

import numpy as np

from . import _arrays, plan as _plan
from .attention import BatchAttention
from .kv_cache import PagedKVCache
from .modes import ForwardMode


def default_buckets(max_batch_size):
    buckets, b = [], 1
    while b < max_batch_size:
        buckets.append(b)
        b *= 2
    return tuple(buckets + [max_batch_size])


class GraphRunner:
    """Replays one captured attention step per (mode, batch bucket, cache).

    Args:
        num_qo_heads, num_kv_heads, head_dim, dtype: as for :class:`BatchAttention`.
        max_batch_size: largest batch (the largest bucket).
        max_q_len: largest q_len of any request in a non-DECODE mode (N for verify /
            draft-extend, the chunk for EXTEND / MIXED).
        max_pages_per_request: page-table columns; with ``page_size`` it bounds kv_len.
        page_size: page size of the caches the runner will be used with.
        buckets: batch sizes to capture (default powers of two up to max_batch_size).
        tree_mask: reserve space for TARGET_VERIFY custom masks (tree speculation).
    Raises:
        ValueError: a size that is not a positive int, buckets that are not positive ints or do
            not reach max_batch_size; what :class:`BatchAttention` raises for the heads, head dim
            and dtype. RuntimeError: no usable CUDA device.

    It allocates its static buffers (q, out, lse for ``max_batch_size x max_q_len`` tokens,
    lengths, page table, mask) at construction. Call :meth:`run` outside any other capture;
    inside your own ``torch.cuda.graph``, use :class:`BatchAttention` directly.
    """

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, dtype="bfloat16", *, max_batch_size, max_q_len,
                 max_pages_per_request, page_size, buckets=None, tree_mask=False):
        import cupy

        from .attention import _check_count

        for name, value in (("max_batch_size", max_batch_size), ("max_q_len", max_q_len),
                            ("max_pages_per_request", max_pages_per_request), ("page_size", page_size)):
            _check_count(name, value, 1)
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
                                   max_mask_bytes=mask_bytes)
        self.tree_mask = tree_mask
        elem = _arrays.DTYPES[self.attn.dtype_name]
        self.q_lens = cupy.zeros(self.max_batch_size, np.int32)
        self.kv_lens = cupy.zeros(self.max_batch_size, np.int32)
        self.page_table = cupy.zeros((self.max_batch_size, self.max_pages_per_request), np.int32)
        self.mask = cupy.zeros(max(mask_bytes, 1), np.uint8)
        self.q = cupy.zeros((tokens, num_qo_heads, head_dim), elem)
        self.out = cupy.zeros((tokens, num_qo_heads, head_dim), elem)
        self.lse = cupy.zeros((tokens, num_qo_heads), np.float32)
        self._graphs = {}

    # ---- public --------------------------------------------------------------------

    def bucket_for(self, batch_size):
        for bucket in self.buckets:
            if bucket >= batch_size:
                return bucket
        raise ValueError(f"batch of {batch_size} requests exceeds max_batch_size {self.max_batch_size}")

    def run(self, mode, q, cache, q_lens, kv_lens, page_table, *, custom_mask=None, use_graph=True,
            return_lse=False):
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
                ids against the cache), device ones are trusted within the bounds.
            custom_mask: TARGET_VERIFY tree mask, flat bool of ``sum(q_len**2)`` (a runner built
                with ``tree_mask=True``).
            use_graph: False runs the same step eagerly (bit-identical results).
            return_lse: also return the LSE view.
        Returns:
            A view ``[sum(q_lens), H_q, D]`` of the runner's static output, valid until the next
            ``run``, in q's framework; with ``return_lse`` also the ``[sum(q_lens), H_q]`` LSE view.
        Raises:
            ValueError: a batch beyond ``max_batch_size``, q_lens above the mode's bound, more
                page-table columns than ``max_pages_per_request``, a cache of another page size,
                a custom mask outside tree TARGET_VERIFY, and what :meth:`BatchAttention.plan`
                raises for host inputs. TypeError: cache not a PagedKVCache. RuntimeError: called
                inside another capture, no usable CUDA device.
        """
        mode = ForwardMode(mode)
        q_lens, kv_lens, page_table = (_arrays.host_to_numpy(x) for x in (q_lens, kv_lens, page_table))
        if custom_mask is not None:
            custom_mask = _arrays.host_to_numpy(custom_mask)
            if isinstance(custom_mask, np.ndarray):
                custom_mask = custom_mask.astype(np.uint8).reshape(-1)
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a cupy_fa.PagedKVCache, got {type(cache).__name__}")
        if cache.page_size != self.page_size:
            raise ValueError(f"cache.page_size is {cache.page_size}, the runner was built for {self.page_size}")
        tree = custom_mask is not None
        if tree and not (self.tree_mask and mode is ForwardMode.TARGET_VERIFY):
            raise ValueError("custom_mask is for TARGET_VERIFY on a runner built with tree_mask=True")
        stream = _arrays.caller_stream(q, q_lens, kv_lens, page_table)
        if stream.is_capturing():  # before anything is staged: none of it may land in the caller's graph
            raise RuntimeError("GraphRunner captures its own graphs; call it outside another capture "
                               "(or use BatchAttention directly inside torch.cuda.graph)")
        with stream:
            q_dev = _arrays.to_cupy(q, "q")
            batch = self._check_step(mode, q_dev, q_lens, kv_lens, page_table, cache, custom_mask)
        num_tokens = int(q_dev.shape[0])
        if batch == 0 or num_tokens == 0:  # IDLE, or an all-padding step: nothing to launch
            return self._result(num_tokens, q, return_lse)
        bucket = self.bucket_for(batch)
        with stream:
            self._stage(bucket, batch, q_dev, q_lens, kv_lens, page_table, custom_mask)
            if use_graph:
                key = (mode, bucket, tree, cache.k.data.ptr, cache.v.data.ptr)
                graph = self._graphs.get(key)
                if graph is None:
                    graph = self._graphs[key] = self._capture(mode, bucket, cache, tree, stream)
                graph.launch(stream)
            else:
                self._step(mode, bucket, cache, tree)
        return self._result(num_tokens, q, return_lse)

    @property
    def num_graphs(self):
        return len(self._graphs)

    # ---- internals -----------------------------------------------------------------

    def _max_q(self, mode):
        return 1 if mode is ForwardMode.DECODE else self.max_q_len

    def _check_step(self, mode, q_dev, q_lens, kv_lens, page_table, cache, custom_mask):
        attn = self.attn
        _arrays.check_device_array(q_dev, "q", dtype=attn.dtype_name, ndim=3, align=0,  # copied, any alignment
                                   shape=(None, attn.num_qo_heads, attn.head_dim))
        if mode is ForwardMode.IDLE:
            return 0
        q_host = _arrays.host_or_device_ints(q_lens, "q_lens", 1)[0] if isinstance(q_lens, np.ndarray) else None
        kv_host = _arrays.host_or_device_ints(kv_lens, "kv_lens", 1)[0] if isinstance(kv_lens, np.ndarray) else None
        batch = len(q_lens)
        _plan.validate_batch_shapes(batch, len(kv_lens), page_table.shape[0] if len(page_table.shape) else -1)
        if q_dev.shape[0] > batch * self._max_q(mode):
            raise ValueError(f"q has {q_dev.shape[0]} tokens, more than {batch} requests x max q_len "
                             f"{self._max_q(mode)} of {mode.name}")
        pages = page_table.shape[1] if len(page_table.shape) == 2 else -1
        if not 0 <= pages <= self.max_pages_per_request:
            raise ValueError(f"page_table must be [B, <= {self.max_pages_per_request}], got {tuple(page_table.shape)}")
        if q_host is not None and kv_host is not None:  # host inputs: check the contract before any copy
            _plan.validate_lengths(q_host, kv_host)
            if q_host.max(initial=0) > self._max_q(mode):
                raise ValueError(f"q_lens max {q_host.max()} exceeds {mode.name}'s max q_len {self._max_q(mode)}")
            if int(q_host.sum()) != q_dev.shape[0]:
                raise ValueError(f"q has {q_dev.shape[0]} tokens, sum(q_lens) is {int(q_host.sum())}")
            if isinstance(page_table, np.ndarray):
                _plan.validate_page_table(page_table, kv_host, q_host, cache.page_size, cache.num_pages)
            else:
                _plan.validate_page_table_width(pages, kv_host, q_host, cache.page_size)
            if custom_mask is not None:
                _plan.validate_mask_size(int(np.prod(custom_mask.shape)), q_host)
        return batch

    def _stage(self, bucket, batch, q_dev, q_lens, kv_lens, page_table, custom_mask):
        """Copies the step's inputs into the static buffers; rows batch..bucket become padding."""
        import cupy

        def put(dst, src):
            if isinstance(src, np.ndarray):  # host -> device; a contiguous target takes it directly
                if dst.flags.c_contiguous:
                    dst.set(np.ascontiguousarray(src, dtype=dst.dtype))
                else:
                    dst[...] = cupy.asarray(src.astype(dst.dtype))
            else:
                dst[...] = _arrays.to_cupy(src, "input").reshape(dst.shape)

        put(self.q_lens[:batch], q_lens)
        put(self.kv_lens[:batch], kv_lens)
        self.q_lens[batch:bucket] = 0
        self.kv_lens[batch:bucket] = 0
        put(self.page_table[:batch, :page_table.shape[1]], page_table)
        self.q[:q_dev.shape[0]] = q_dev
        if custom_mask is not None:
            n = int(np.prod(custom_mask.shape))
            put(self.mask[:n], custom_mask.reshape(-1) if isinstance(custom_mask, np.ndarray) else custom_mask)

    def _step(self, mode, bucket, cache, tree):
        """The captured work: device metadata from the static buffers, then attention."""
        max_q = self._max_q(mode)
        tokens = bucket * max_q
        self.attn.plan(self.q_lens[:bucket], self.kv_lens[:bucket], self.page_table[:bucket], causal=True,
                       custom_mask=self.mask[:bucket * max_q * max_q] if tree else None, max_q_len=max_q,
                       max_kv_len=self.max_pages_per_request * self.page_size)
        self.attn.run(self.q[:tokens], cache, out=self.out[:tokens], lse=self.lse[:tokens])

    def _capture(self, mode, bucket, cache, tree, stream):
        import cupy

        self._step(mode, bucket, cache, tree)  # warm-up: compiles kernels and sets smem limits first
        capture = cupy.cuda.Stream(non_blocking=True)
        capture.wait_event(stream.record())
        with capture:
            capture.begin_capture()
            try:
                self._step(mode, bucket, cache, tree)
            finally:
                graph = capture.end_capture()
        stream.wait_event(capture.record())
        return graph

    def _result(self, num_tokens, like, return_lse):
        out = _arrays.to_caller(self.out[:num_tokens], like)
        if return_lse:
            return out, _arrays.to_caller(self.lse[:num_tokens], like)
        return out
