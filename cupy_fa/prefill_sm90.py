"""Host side of the sm_90a prefill family (``kernels/prefill_sm90.cu``), standalone.

Not yet behind ``BatchAttention``: the library's tiling policy and launch path are being
restructured (issue 17); this module is what that integration will plug in. It holds

* :class:`Sm90Tile`, the host mirror of ``Sm90PrefillTraits`` (shared memory, the work
  layout plan_kernel must be run with: 128 packed rows per item, ``block_n`` keys per tile,
  one split per CTA, no fold), and the default tile per head dim (:data:`DEFAULT_TILES`);
* :func:`variant` / :func:`all_variants`, the kernels to compile (CPU test, warm-up);
* :class:`Sm90Prefill`, a plan-once / run-many launcher over host lengths that fills
  ``AttentionParams`` from plan_kernel's metadata exactly as ``BatchAttention`` does and runs
  merge_kernel after it for requests plan_kernel split.

Shapes are ``BatchAttention``'s (cupy_fa/attention.py): q, out ``[T, H_q, D]``, lse
``[T, H_q]`` float32 (natural log), cache ``[pages, page_size, H_kv, D]``.
"""

import dataclasses
import math

import numpy as np

from . import _arrays, _build, _params, plan as _plan, schedule

_LOG2E = 1.4426950408889634
THREADS = 384  # producer warpgroup + 2 consumer warpgroups (the default tiles; Sm90Tile.threads)
BLOCK_M = 128  # packed rows per CTA of the default tiles (Sm90Tile.block_m)


@dataclasses.dataclass(frozen=True)
class Sm90Tile:
    """One ``Sm90PrefillTraits`` instance (kernels/prefill_sm90.cu)."""
    head_dim: int
    block_n: int
    stages: int = 2
    overlap: bool = True        # issue S of tile i with P V of tile i - 1, softmax while P V runs
    pingpong: bool = True       # the two consumer warpgroups take turns at the tensor cores
    producer_regs: int = 56     # setmaxnreg of the producer; the consumers get (504 - it) / 2
    q_in_regs: bool = False     # Q's wgmma A fragments in registers instead of shared memory
    uniform_wg: bool = False    # the warpgroup index warp-uniform (Q descriptors in uniform registers)
    joint_rows: bool = False    # the softmax of both rows of a thread at once, branch-free
    persistent: bool = False    # at most one CTA per SM, each running work items in turn (two Q tiles)
    lean_copy: bool = False     # the producer's cp.async loop at ~9 instructions a copy instead of ~18
    poly_exp2: int = 0          # of every 4 eight-key blocks of an unmasked tile, this many take 2^x on the FMA pipe
    consumer_wgs: int = 2       # consumer warpgroups of 64 rows: 2 (block_m 128) or 3 (block_m 192, 512 threads)
    variants: bool = False      # the variant hooks compiled in (window, soft-cap, sinks; Sm90PrefillTraits VARIANTS)

    splits_per_cta = 1          # what plan_kernel's work layout is counted with
    fold_splits = False
    kv_bytes = 2                # 16-bit K/V only (an fp8 cache's long rows run on the mma.sync family)

    @property
    def block_m(self):
        """Packed (token, head) rows per CTA: 64 per consumer warpgroup (PlanParams::block_m)."""
        return 64 * self.consumer_wgs

    @property
    def threads(self):
        """Sm90PrefillTraits::kThreads: the producer warpgroup and the consumers."""
        return 128 * (1 + self.consumer_wgs)

    @property
    def entry_regs(self):
        """Registers a thread starts with at one CTA per SM (the launch bounds): 168 at 384 threads."""
        return 65536 // self.threads // 8 * 8

    @property
    def consumer_regs(self):
        return ((1 + self.consumer_wgs) * self.entry_regs - self.producer_regs) // self.consumer_wgs // 8 * 8

    @property
    def smem_bytes(self):
        """Sm90PrefillTraits::kSmemBytes: 1024 alignment slack, Q, K and V rings, barriers, scratch."""
        d, q_bufs = self.head_dim, 2 if self.persistent else 1
        return (1024 + q_bufs * self.block_m * d * 2 + 2 * self.stages * self.block_n * d * 2
                + (4 * self.stages + 3 * q_bufs) * 8 + 128 * self.consumer_wgs * 4 + q_bufs * 56)

    def with_variants(self):
        """This tile's kernel with the variant hooks compiled in (window, soft-cap, sinks): the
        same rows per CTA, so the same work layout; with three consumer warpgroups at most 64 keys
        a tile (the hooks' registers spill at 80 or 128 keys, nvcc 13.0 / NVRTC 12.9). The keys a
        tile holds never move a split (plan_kernel cuts splits; the kernel masks a split's last,
        partial tile), so the hooked kernel runs the plain tile's plan."""
        block_n = min(self.block_n, 64) if self.consumer_wgs == 3 else self.block_n
        return dataclasses.replace(self, variants=True, block_n=block_n)

    def traits(self):
        b = lambda x: str(bool(x)).lower()
        return (f"cupy_fa::Sm90PrefillTraits<{self.head_dim}, {self.block_n}, {self.stages}, {b(self.overlap)}, "
                f"{b(self.pingpong)}, {self.producer_regs}, {b(self.q_in_regs)}, {b(self.uniform_wg)}, "
                f"{b(self.joint_rows)}, {b(self.persistent)}, {b(self.lean_copy)}, {int(self.poly_exp2)}, "
                f"{int(self.consumer_wgs)}{', true' if self.variants else ''}>")


# The default tile per head dim (FlashAttention-3's shapes for causal / paged: 128 x 128 at
# D <= 128, 128 x 80 at D = 256, which the shared memory allows 2 stages of). D 64 / 128 take
# the warp-uniform warpgroup index and the joint two-row softmax (+4-6% at D = 128 in the
# 2026-12-01 interleaved A/B; 0 spills for both element types); D = 256 does not (with
# uniform_wg it spills 64 bytes).
# D 64 / 128: the producer's lean copies (lean_copy) measured +13-18% over the same tiles without
# (interleaved A/B on an H200, 2026-12-01, bench/NOTES.md sm90 round 3), correct in every probe case.
# D 64 / 128: three consumer warpgroups (192 rows a CTA, 512 threads; each warpgroup's softmax
# hides behind two others' GEMMs), at D = 128 with 80 keys a tile (S, O and P fit the 160
# registers a consumer gets only with 64 or 80): +5-9% on prefill, +18% at D = 64 standalone
# (sm90 round 3); the producer needs 32 registers with lean copies.
DEFAULT_TILES = {
    64: Sm90Tile(64, 128, stages=4, uniform_wg=True, joint_rows=True, lean_copy=True, consumer_wgs=3,
                 producer_regs=32),
    128: Sm90Tile(128, 80, stages=2, uniform_wg=True, joint_rows=True, lean_copy=True, consumer_wgs=3,
                  producer_regs=32),
    256: Sm90Tile(256, 80, stages=2, pingpong=False),
}


def variant(dtype_name, tile):
    """The compiled kernel of one element type and tile: Q, K, V and O all ``dtype_name``."""
    ctype = _build.CTYPES[dtype_name]
    expr = f"cupy_fa::prefill_sm90_kernel<{ctype}, {ctype}, {ctype}, {tile.traits()}>"
    checks = (f"{tile.traits()}::kSmemBytes == {tile.smem_bytes}",
              f"{tile.traits()}::kConsumerRegs == {tile.consumer_regs}",
              f"{tile.traits()}::kBlockM == {tile.block_m} && {tile.traits()}::kThreads == {tile.threads}")
    return _build.Variant("prefill_sm90.cu", expr, tile.threads, tile.smem_bytes, checks)


def all_variants(tiles=None):
    """Every default variant (both element types, every head dim): what CI compiles."""
    tiles = tiles or list(DEFAULT_TILES.values())
    return [variant(dtype, t) for dtype in _build.CTYPES for t in tiles]


class Sm90Prefill:
    """Plans a batch once (host lengths) and runs the sm_90a prefill kernel on it.

    Args:
        num_qo_heads, num_kv_heads, head_dim, dtype: as ``BatchAttention``.
        tile: an :class:`Sm90Tile` (default ``DEFAULT_TILES[head_dim]``).
    Raises ValueError on bad heads / head dim, and in ``plan`` on lengths or page tables that
    break the contract (the same checks as ``BatchAttention.plan``), before any launch.
    """

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, dtype="bfloat16", tile=None):
        if num_qo_heads < 1 or num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a positive multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.tile = tile or DEFAULT_TILES.get(head_dim)
        if self.tile is None or self.tile.head_dim != head_dim:
            raise ValueError(f"head_dim must be one of {sorted(DEFAULT_TILES)} (and the tile's), got {head_dim!r}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = int(num_qo_heads), int(num_kv_heads), int(head_dim)
        self.group_size = self.num_qo_heads // self.num_kv_heads
        self.dtype_name = _arrays.resolve_dtype(dtype)
        self.variant = variant(self.dtype_name, self.tile)
        self._plan = None

    def plan(self, q_lens, kv_lens, page_table, *, causal=True, sm_scale=None, custom_mask=None):
        import cupy

        q = np.asarray(q_lens, np.int64).reshape(-1)
        kv = np.asarray(kv_lens, np.int64).reshape(-1)
        pt = np.asarray(page_table, np.int64)
        _plan.validate_batch_shapes(q.shape[0], kv.shape[0], pt.shape[0])
        _plan.validate_lengths(q, kv)
        batch = int(q.shape[0])
        mask = None
        if custom_mask is not None:
            mask = np.ascontiguousarray(np.asarray(custom_mask, bool).ravel()).astype(np.uint8)
            _plan.validate_mask_size(mask.size, q)
        capacity = _plan.Capacity(max(batch, 1), max(int(q.sum()), 1), max(pt.shape[1], 1),
                                  mask.size if mask is not None else 0)
        buffers = _plan.PlanBuffers(capacity, self.num_qo_heads, self.head_dim, self.dtype_name)
        buffers.q_lens[:batch].set(q.astype(np.int32))
        buffers.kv_lens[:batch].set(kv.astype(np.int32))
        buffers.page_table[:batch, :pt.shape[1]] = cupy.asarray(pt.astype(np.int32))
        if mask is not None and mask.size:
            buffers.custom_mask[:mask.size].set(mask)
        stream = cupy.cuda.get_current_stream()
        _plan.launch_plan(buffers, batch, self.group_size, self.tile, stream)
        mode = _plan.MASK_CUSTOM if mask is not None else (_plan.MASK_CAUSAL if causal else _plan.MASK_NONE)
        scale = 1.0 / math.sqrt(self.head_dim) if sm_scale is None else float(sm_scale)
        live = q > 0
        self._plan = dict(batch=batch, buffers=buffers, q=q, kv=kv, pt=pt, mode=mode, scale=scale,
                          work=schedule.work_bound(q, kv, self.group_size, self.tile),
                          merge=schedule.needs_merge(self.tile, q[live], kv[live]) if live.any() else False,
                          tokens=int(q.sum()))
        return self

    def run(self, q, cache, out, lse=None):
        """Writes ``out`` (and ``lse``) for the planned batch; all arrays CuPy on the current stream."""
        import cupy

        st = self._plan
        if st is None:
            raise RuntimeError("run() before plan()")
        _arrays.check_device_array(q, "q", dtype=self.dtype_name, ndim=3,
                                   shape=(st["tokens"], self.num_qo_heads, self.head_dim))
        _arrays.check_device_array(out, "out", dtype=self.dtype_name, shape=q.shape, align=8)
        if lse is not None:
            _arrays.check_device_array(lse, "lse", dtype=np.float32, shape=(q.shape[0], self.num_qo_heads), align=4)
        if (cache.num_kv_heads, cache.head_dim, cache.dtype_name) != (self.num_kv_heads, self.head_dim,
                                                                     self.dtype_name):
            raise ValueError("cache heads, head_dim or dtype do not match this instance")
        _plan.validate_page_table(st["pt"], st["kv"], st["q"], cache.page_size, cache.num_pages)
        if st["work"] == 0:
            return out
        buffers = st["buffers"]
        div = _params.fast_divisor(self.group_size)
        lse_ptr = lse.data.ptr if lse is not None else 0
        params = _params.make(
            "AttentionParams", q=q.data.ptr, out=out.data.ptr, lse=lse_ptr, partial_out=buffers.partial_out.data.ptr,
            partial_lse=buffers.partial_lse.data.ptr, page_table=buffers.page_table.data.ptr,
            custom_mask=buffers.custom_mask.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
            kv_lens=buffers.kv_lens.data.ptr, work_indptr=buffers.work_indptr.data.ptr,
            num_splits=buffers.num_splits.data.ptr, split_keys=buffers.split_keys.data.ptr,
            partial_indptr=buffers.partial_indptr.data.ptr, mask_indptr=buffers.mask_indptr.data.ptr,
            batch_size=st["batch"], page_table_stride=buffers.page_table.shape[1],
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, mask_mode=st["mode"],
            sm_scale_log2=st["scale"] * _LOG2E, splits_per_cta=1, fold_splits=0,
            group_multiplier=div[0], group_shift=div[1], status=buffers.status.data.ptr,
            page_table_columns=st["pt"].shape[1], num_tokens=int(q.shape[0]), mask_entries=int(buffers.custom_mask.size),
            key_base=buffers.key_base.data.ptr, sinks=0, window=0, soft_cap_scale=0.0, soft_cap_log2=0.0,
            **cache.attention_params())  # 16-bit K/V only here (its scales 0: an fp8 cache never takes this family)
        stream = cupy.cuda.get_current_stream()
        ctas = st["work"] * self.num_kv_heads
        if self.tile.persistent:  # one CTA per SM at most (the kernel's launch bounds), each taking items in turn
            ctas = min(ctas, _build.device_attribute("MultiProcessorCount"))
        _build.launch(self.variant, (ctas,), params, stream)
        if st["merge"]:
            merge = _params.make(
                "MergeParams", out=out.data.ptr, lse=lse_ptr, partial_out=buffers.partial_out.data.ptr,
                partial_lse=buffers.partial_lse.data.ptr, q_indptr=buffers.q_indptr.data.ptr,
                num_splits=buffers.num_splits.data.ptr, partial_indptr=buffers.partial_indptr.data.ptr,
                batch_size=st["batch"], num_qo_heads=self.num_qo_heads, fold_groups=0, sinks=0)
            shape = schedule.merge_shape(st["tokens"], self.num_qo_heads)
            _build.launch(schedule.merge_variant(self.dtype_name, self.head_dim, shape),
                          (st["tokens"], -(-self.num_qo_heads // shape[0])), merge, stream, programmatic=True)
        return out
