"""What every kernel family shares: the head dims, the element types, the family record, the
device limits the tiles are sized for, and the constants the kernels hold in common.

Nothing here chooses anything: the families' own modules (:mod:`.mma_sync`, :mod:`.sm90`) say
what tiles they have, :mod:`cupy_fa.schedule` which one a step runs.
"""

from __future__ import annotations

import dataclasses


from .. import _compile

HEAD_DIMS = (64, 96, 128, 192, 256)  # of q, K, V and out alike; each has tiles in both families
MERGE_GROUP = 8  # splits folded in order before the groups are (kernels/shared/softmax.cuh kMergeGroup)
FP8 = "float8_e4m3fn"  # the fp8 K/V cache dtype (kernels/shared/common.cuh fp8_e4m3): its tiles have kv_bytes=1
# Head dims an fp8 cache takes: its rows are D / 16 chunks of 16 bytes (6 at D = 96, 12 at 192),
# which its loads and byte swizzle need to tile the CTA evenly (docs/design.md, "Head dims")
FP8_HEAD_DIMS = (64, 128, 256)
# Separate qk / vo head dims (q and K of the first, V and out of the second): DeepSeek's non-absorbed
# MLA prefill (128 nope + 64 rope / 128). Every tile of the mma.sync family (TileTraits HEAD_DIM_VO)
# and, on sm_90a, the wgmma family's prefill tile of the pair (Sm90PrefillTraits D_VO: sm90.PAIR_TILES),
# over a 16-bit cache (docs/design.md, "Separate qk / vo head dims")
HEAD_DIM_PAIRS = ((192, 128),)


def split_merge_kernel(dtype_name, head_dim, heads_per_cta, ways, max_splits, vec=4):
    """The split merge (kernels/shared/merge.cu ``MergeTraits``) of one output type at ``head_dim``
    columns: ``heads_per_cta`` heads of a token a CTA, ``ways`` ways over groups of MERGE_GROUP splits,
    at most ``max_splits`` splits a row, ``vec`` columns a lane (4: 8-byte loads, 8: 16-byte)."""
    expr = (f"cupy_fa::merge_kernel<{_compile.CTYPES[dtype_name]}, "
            f"cupy_fa::MergeTraits<{head_dim}, {heads_per_cta}, {ways}, {max_splits}, {vec}>>")
    return _compile.Kernel("shared/merge.cu", expr, head_dim // vec * heads_per_cta * ways)


def checked_head_dims(head_dim, head_dim_vo, kv_dtype_name=None, name="head_dim_vo"):
    """(head_dim, head_dim_vo) as ints, ``head_dim_vo=None`` meaning ``head_dim``; ValueError naming
    the argument unless ``head_dim`` is one of HEAD_DIMS and a separate ``head_dim_vo`` makes one of
    HEAD_DIM_PAIRS over a 16-bit cache (``kv_dtype_name``: an fp8 cache is refused at a pair)."""
    if isinstance(head_dim, (tuple, list)):
        raise ValueError(f"separate qk / vo head dims {tuple(head_dim)} are not supported as head_dim: give q's and "
                         f"K's as head_dim and V's and out's as {name}= (pairs {HEAD_DIM_PAIRS})")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim!r}")
    if head_dim_vo is None or head_dim_vo == head_dim:
        return int(head_dim), int(head_dim)
    if (head_dim, head_dim_vo) not in HEAD_DIM_PAIRS or isinstance(head_dim_vo, bool):
        raise ValueError(f"{name}={head_dim_vo!r} with head_dim={head_dim!r}: separate qk / vo head dims take the "
                         f"(head_dim, {name}) pairs {HEAD_DIM_PAIRS}, or {name}=None (= head_dim)")
    if kv_dtype_name == FP8:
        raise ValueError(f"an fp8 KV cache takes one head dim for K and V ({name}=None), got head_dim={head_dim}, "
                         f"{name}={head_dim_vo} (separate qk / vo head dims take a float16 / bfloat16 cache)")
    return int(head_dim), int(head_dim_vo)
SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90 (the kernels' occupancy math)
SM80_SMEM_LIMIT = 163 * 1024  # and on sm_80: tiles are chosen for the device's own limit


@dataclasses.dataclass(frozen=True)
class ElementTypes:
    """The element types of a kernel's Q, KV and O (separate template parameters of the
    attention kernels): equal, or an fp8 cache's ``kv = "float8_e4m3fn"`` beside fp16 / bf16
    Q and O (the mma.sync family only)."""
    q: str
    kv: str
    out: str

    @classmethod
    def of(cls, dtype):
        return dtype if isinstance(dtype, cls) else cls(dtype, dtype, dtype)

    @property
    def kv_bytes(self):
        """Bytes of a K/V element: 1 for an fp8 cache, else 2."""
        return 1 if self.kv == FP8 else 2

    def ctypes(self):
        return _compile.CTYPES[self.q], _compile.KV_CTYPES[self.kv], _compile.CTYPES[self.out]


@dataclasses.dataclass(frozen=True)
class KernelFamily:
    """One attention kernel template: its source, its name, and the archs it runs on. Each
    family's tile class names its traits (``tile.traits()``) and points back here (``tile.family``)."""
    name: str
    source: str      # file under kernels/
    kernel: str      # the __global__ template, instantiated as kernel<Q, KV, O, Traits>
    min_sm: int      # compute capability (x10) it needs


def is_sm90a(arch):
    """Whether ``arch`` (e.g. ``sm_90a``, ``compute_90a``) is Hopper's architecture-specific target,
    the only one the wgmma family compiles for."""
    return arch is not None and arch.endswith("90a")
