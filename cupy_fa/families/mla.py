"""The MLA family (``kernels/mla/``): multi-head latent attention, the absorbed form, over a paged
latent cache of 576 columns a token (c_kv 512, k_pe 64), one KV head shared by all H query heads.

Two kernel templates, each a composition of the named phases beside it:

* ``mla_mma_kernel<T, MmaTileTraits<WARPS_M, BLOCK_N, STAGES, FP8>>`` (``kernels/mla/attention.cu``,
  mma.sync, sm_80+): 16 x WARPS_M packed (token, head) rows a CTA, 4 warps over each key tile's
  keys for S = Q K^T and over the 512 value columns for P V; 16-bit and fp8 caches (an fp8 tile is
  widened to the queries' type in shared memory). :class:`MlaMmaTile`.
* ``mla_wgmma_kernel<T, FP8>`` (``kernels/mla/wgmma.cu``, wgmma, sm_90a only): 64 rows a CTA, two
  warpgroups in a seesaw over 64-key blocks (``kernels/mla/seesaw.cuh``); 16-bit caches, or fp8
  ones whose bytes each warpgroup widens in place in its halves of the K buffers.
  :class:`MlaWgmmaTile`.

Both read plan_kernel's work layout (``block_m`` rows a work item, one split a CTA, no fold) and end
a split in ``kernels/mla/epilogue.cuh``; the split merge is ``kernels/shared/merge.cu`` at 512
columns (:func:`merge_kernel`). Which tile a step runs is :mod:`cupy_fa.mla.schedule`'s choice.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import _compile, _mla_params
from .common import SMEM_LIMIT, KernelFamily, split_merge_kernel  # noqa: F401 - SMEM_LIMIT: what every tile here must fit

LATENT_DIM = 576   # kv_lora_rank 512 + qk_rope_head_dim 64 (kernels/mla/params.cuh kLatentDim)
VALUE_DIM = 512
ROPE_DIM = LATENT_DIM - VALUE_DIM

MLA_MMA = KernelFamily("mla_mma", "mla/attention.cu", "cupy_fa::mla::mla_mma_kernel", 80)
MLA_WGMMA = KernelFamily("mla_wgmma", "mla/wgmma.cu", "cupy_fa::mla::mla_wgmma_kernel", 90)

MMA_BLOCK_N = 64   # keys per tile of every mma.sync MLA tile: one value, so decode and verify agree bit for bit
MMA_STAGES = 2
WGMMA_BLOCK = 64   # rows and keys of a seesaw block
COLUMN_BLOCKS = LATENT_DIM // 64  # 64-column swizzled blocks of a latent row (kernels/mla/wgmma_copy.cuh kLatentBlocks)
WORK_BYTES = 56  # kernels/mla/work.cuh Work (13 four-byte fields), rounded up to 8 bytes


@dataclasses.dataclass(frozen=True)
class MlaMmaTile:
    """One ``MmaTileTraits`` instance (kernels/mla/mma_tile.cuh)."""
    warps_m: int               # rows of warps: 16 packed rows each (1 or 2)
    kv_fp8: bool = False       # an fp8 (e4m3) cache: its tiles widened in shared memory
    block_n: int = MMA_BLOCK_N
    stages: int = MMA_STAGES

    family = MLA_MMA
    splits_per_cta = 1
    fold_splits = False

    def __post_init__(self):
        if self.warps_m not in (1, 2):
            raise ValueError(f"an MLA mma.sync tile has 1 or 2 rows of warps, got {self.warps_m}")

    @property
    def kv_bytes(self):
        return 1 if self.kv_fp8 else 2

    @property
    def block_m(self):
        return 16 * self.warps_m

    @property
    def threads(self):
        return 128 * self.warps_m

    @property
    def smem_bytes(self):
        """MmaTileTraits::kSmemBytes: Q, the 16-bit K tiles (fp8: one) and the byte ring, P, the slot
        ring, the per-warp row maxima and sums, a flag."""
        m, n = self.block_m, self.block_n
        tile = n * LATENT_DIM * 2
        tiles16 = tile if self.kv_fp8 else self.stages * tile
        raw = self.stages * n * LATENT_DIM if self.kv_fp8 else 0
        return m * LATENT_DIM * 2 + tiles16 + raw + m * n * 2 + self.stages * n * 4 + 2 * 4 * m * 4 + 16

    def traits(self):
        return (f"cupy_fa::mla::MmaTileTraits<{self.warps_m}, {self.block_n}, {self.stages}, "
                f"{str(self.kv_fp8).lower()}>")

    def checks(self):
        t = self.traits()
        return (f"{t}::kSmemBytes == {self.smem_bytes}", f"{t}::kThreads == {self.threads}",
                f"{t}::kBlockM == {self.block_m}")


@dataclasses.dataclass(frozen=True)
class MlaWgmmaTile:
    """The seesaw kernel (kernels/mla/wgmma.cu): 64 rows, two warpgroups; a 16-bit cache, or
    (``kv_fp8``) an e4m3 one widened in place in its K buffers."""
    kv_fp8: bool = False

    family = MLA_WGMMA
    block_m = WGMMA_BLOCK
    block_n = WGMMA_BLOCK
    threads = 256
    splits_per_cta = 1
    fold_splits = False

    @property
    def kv_bytes(self):
        return 1 if self.kv_fp8 else 2

    @property
    def smem_bytes(self):
        """SeesawSmem::kAllocBytes: Q and two K buffers of 64 x 576, the exchanges, the query rows'
        scales (bf16 queries over an fp8 cache), the barriers, and 1024 bytes of slack to align the
        tiles (the 128-byte swizzle's period). An fp8 cache's raw bytes land inside the K buffers: the
        same size."""
        tile = WGMMA_BLOCK * LATENT_DIM * 2
        return (3 * tile + 128 * 8 * 2 + 2 * 128 * 8 + WGMMA_BLOCK * 4 + (1 + 2 * COLUMN_BLOCKS + 4) * 8 + 8
                + WORK_BYTES + 1024)  # barriers: q_full, one a column block of each buffer, one a half of
        # each (fp8's raw bytes); the page flag; the work item

    def checks(self):
        return (f"cupy_fa::mla::SeesawSmem::kAllocBytes == {self.smem_bytes}",)


@functools.lru_cache(maxsize=None)
def kernel(dtype_name, tile):
    """The compiled kernel of ``tile`` for queries and outputs of ``dtype_name`` (the cache: the same
    type, or e4m3 bytes for an fp8 tile)."""
    ctype = _compile.CTYPES[dtype_name]
    checks = tuple(_mla_params.size_checks()) + tuple(tile.checks())
    if isinstance(tile, MlaWgmmaTile):
        return _compile.Kernel(MLA_WGMMA.source, f"{MLA_WGMMA.kernel}<{ctype}, {str(tile.kv_fp8).lower()}>",
                               tile.threads, tile.smem_bytes, checks)
    return _compile.Kernel(MLA_MMA.source, f"{MLA_MMA.kernel}<{ctype}, {tile.traits()}>", tile.threads,
                           tile.smem_bytes, checks)


# The split merge of MLA's 512-column partials (kernels/shared/merge.cu): at most MAX_MERGE_SPLITS
# splits a row, so the deep shape's shared memory (a float4 per 4 columns per group) fits: (heads per
# CTA, ways over groups of 8 splits, columns a lane). Each merge CTA starts with a chain of dependent
# metadata loads before its partials. Wide: 8 columns a lane (16-byte loads, 64 lanes a head) give each
# lane twice the bytes after that chain, and 4 heads a CTA keep 256 threads, four CTAs an SM at 64
# registers overlapping their chains (8 heads at 1024 threads, two an SM, left the memory idle between
# them); against 4 columns a lane at 2 heads: the merge 31.3 -> 18.7 us under Nsight Compute at decode
# B=64 L=4096 H=128, the step 7% faster, verify q=4 1.5-4% (H100, 2026-12-07). Deep: 4 columns a lane,
# 512 threads a head, for the few rows of a step whose splits are many (at 8 columns, half the threads,
# decode B=1 L=32768 H=16 ran 2% slower). The same bits whatever the shape: a row's fold order is its own.
MAX_MERGE_SPLITS = 128
MERGE_WIDE = (4, 1, 8)
MERGE_DEEP = (1, 4, 4)


@functools.lru_cache(maxsize=None)
def merge_kernel(dtype_name, shape):
    heads, ways, vec = shape
    return split_merge_kernel(dtype_name, VALUE_DIM, heads, ways, MAX_MERGE_SPLITS, vec)


@functools.lru_cache(maxsize=None)
def append_kernel(index_dtype, in_dtype_name, fp8):
    """PagedLatentCache.append's kernel (kernels/mla/latent_append.cu): slots of ``index_dtype``, new
    rows of ``in_dtype_name``, copied or (``fp8``) quantised."""
    index = {"int32": "int", "int64": "long long"}[np.dtype(index_dtype).name]
    expr = f"cupy_fa::mla::latent_append_kernel<{index}, {_compile.CTYPES[in_dtype_name]}, {str(bool(fp8)).lower()}>"
    return _compile.Kernel("mla/latent_append.cu", expr, 256, 0, tuple(_mla_params.size_checks()))


def all_kernels(arch=None):
    """Every MLA kernel an ``arch`` build can launch (None: all; the seesaw kernel on sm_90a only)."""
    from .common import is_sm90a

    out = []
    for dtype_name in _compile.CTYPES:
        for fp8 in (False, True):
            for warps_m in (1, 2):
                out.append(kernel(dtype_name, MlaMmaTile(warps_m, fp8)))
            for index in (np.int32, np.int64):
                out.append(append_kernel(index, dtype_name, fp8))
        if arch is None or is_sm90a(arch):
            out += [kernel(dtype_name, MlaWgmmaTile(fp8)) for fp8 in (False, True)]
        out += [merge_kernel(dtype_name, shape) for shape in (MERGE_WIDE, MERGE_DEEP)]
    return out
