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
