"""The sm_90a wgmma family (``kernels/sm90/prefill.cu``; Hopper's architecture-specific target
only): requests of more than ``schedule.SMALL_Q_LEN`` tokens at head dims 64, 96, 128, 192 and
256 over a 16-bit cache, at 64, 128 and 256 over an fp8 (e4m3) cache, and at the separate qk / vo
head dims 192 / 128 (q and K of 192, V and out of 128) over a 16-bit cache.

FlashAttention-3's structure in inline PTX: a producer warpgroup copies Q once and the paged
K / V tiles into a ring of mbarrier-guarded stages (an fp8 cache's bytes through staging slots,
widened to fp16 on the way); two or three consumer warpgroups of 64 rows run S = Q K^T and
O += P V on wgmma around the mask and the online softmax, the next tile's Q K^T issued with this
tile's P V. :class:`Sm90Tile` is the host mirror of ``Sm90PrefillTraits`` (its shared memory,
registers and rows per CTA are compiled into every kernel as checks); :data:`DEFAULT_TILES` and
:data:`FP8_TILES` are the tiles of each head dim, :data:`PAIR_TILES` of each pair of qk / vo
head dims, :meth:`Sm90Tile.with_variants` their kernels with the variant hooks. The work layout is the plan kernel's (``block_m`` packed rows per item,
one split per CTA, no fold).
"""

from __future__ import annotations

import dataclasses


from .. import _compile
from ..knobs import SOFT_CAP_TANH_FORMS, knobs
from .common import KernelFamily

SM90_WGMMA = KernelFamily("sm90_wgmma", "sm90/prefill.cu", "cupy_fa::prefill_sm90_kernel", 90)


@dataclasses.dataclass(frozen=True)
class Sm90Tile:
    """One ``Sm90PrefillTraits`` instance (kernels/sm90/prefill.cu)."""
    head_dim: int
    block_n: int
    stages: int = 2
    pingpong: bool = True       # the consumer warpgroups take turns at the tensor cores
    producer_regs: int = 56     # setmaxnreg of the producer; the consumers share what it gives back
    uniform_wg: bool = False    # the warpgroup index warp-uniform (Q descriptors in uniform registers)
    joint_rows: bool = False    # the softmax of both rows of a thread at once, branch-free
    lean_copy: bool = False     # the producer's cp.async loop at ~9 instructions a copy instead of ~18
    consumer_wgs: int = 2       # consumer warpgroups of 64 rows: 2 (block_m 128) or 3 (block_m 192, 512 threads)
    variants: bool = False      # the variant hooks compiled in (window, soft-cap, sinks; Sm90PrefillTraits VARIANTS)
    kv_bytes: int = 2           # 2: fp16 / bf16 K/V; 1: an fp8 (e4m3) cache, widened to fp16 by the producer
    staging: int = 0            # an fp8 cache's staging slots of raw tiles (the producer runs staging - 1 tiles ahead)
    tanh: int = 0               # the soft-cap's tanh with the hooks: 0 exact (2^y, reciprocal), 1 tanh.approx, 2 Newton
    head_dim_vo: int = None     # V's and out's head dim (Sm90PrefillTraits D_VO); None: head_dim

    family = SM90_WGMMA
    splits_per_cta = 1          # what plan_kernel's work layout is counted with
    fold_splits = False

    def __post_init__(self):
        if self.head_dim_vo is None:
            object.__setattr__(self, "head_dim_vo", self.head_dim)
        if self.head_dim_vo != self.head_dim and (self.kv_bytes != 2 or self.head_dim_vo % 64 or self.head_dim % 64
                                                  or self.head_dim_vo > self.head_dim):
            raise ValueError(f"separate qk / vo head dims take a 16-bit cache and whole 64-column blocks of V "
                             f"no wider than K's: {self}")
        if (self.kv_bytes, bool(self.staging)) not in ((2, False), (1, True)) or (self.kv_bytes == 1 and self.staging < 2):
            raise ValueError(f"an fp8 tile (kv_bytes=1) takes 2 or more staging slots, a 16-bit one none: {self}")
        if self.tanh not in (0, 1, 2) or (self.tanh and not self.variants):
            raise ValueError(f"tanh is the soft-cap's form with the variant hooks (0, 1, 2): {self}")
        if self.kv_bytes == 1 and self.head_dim % 64:
            raise ValueError(f"an fp8 tile takes whole 64-byte rows of e4m3 (head dims 64, 128, 256): {self}")
        if self.block_n % 16 or self.block_n % self.copy_rows:
            raise ValueError(f"block_n must be whole k-steps of 16 keys and whole passes of the producer's "
                             f"{self.copy_rows} rows: {self}")

    @property
    def copy_rows(self):
        """Rows of a K / V tile one pass of the producer's 128 threads copies (sm90/load.cuh
        KVProducer::RP): whole rows of 16-byte chunks where they divide the threads, else one
        column block of them (16-bit D 96: 32 rows, D 192: 16)."""
        chunks = self.head_dim * self.kv_bytes // 16
        per_row = chunks if 128 % chunks == 0 else self.swizzle // 16
        return 128 // per_row

    @property
    def swizzle(self):
        """Sm90PrefillTraits::kSwizzle: bytes a row of a column block (128, or 64 where the head dim
        is not whole 64-column blocks: 96)."""
        return 128 if self.head_dim % 64 == 0 else 64

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
        """Sm90PrefillTraits::kSmemBytes: 1024 alignment slack, Q, the K and V rings (K's rows of
        head_dim, V's of head_dim_vo), barriers, scratch."""
        d = self.head_dim
        barriers = ((4 * self.stages + 1) * 8 + 128 * self.consumer_wgs * 4 + 4 + 7) // 8 * 8  # + the page flag
        scratch = 0  # after the barriers, from 16 bytes on (Sm90PrefillTraits kScratchBytes)
        pad = (barriers + 15) // 16 * 16 - barriers
        if self.kv_bytes == 1:  # each row's factor of bf16 queries, then the staging slots
            scratch = pad + self.block_m * 4 + self.staging * self.block_n * d
        elif self.variants:  # the work item of a hooked 16-bit tile
            scratch = pad + 64
        rings = self.stages * self.block_n * (d + self.head_dim_vo) * 2
        return 1024 + self.block_m * d * 2 + rings + barriers + scratch

    def with_variants(self):
        """This tile's kernel with the variant hooks compiled in (window, soft-cap, sinks): the
        same rows per CTA, so the same work layout; at most 80 keys a tile (a window's reads stay
        within one such tile of it: tests/test_variants_gpu.py), 64 where 80 keys are not whole
        passes of the producer (D 96) and for an fp8 tile of three consumer warpgroups (80 spill
        there, NVRTC 12.9). The 16-bit hooks' registers fit 80 keys because the consumers' epilogue
        reads the work item back from shared memory (Sm90PrefillTraits kStashItem) instead of
        holding it through the loop (without that, 20 / 52 bytes spill at D 128). The soft-cap's
        tanh of :func:`soft_cap_tanh`, and without the warp-uniform warpgroup index for an fp8 tile
        (with it the fp16-query build spills) and with the Newton tanh (with it 40 / 96 bytes spill
        at 64 keys). The keys a tile holds never move a split (plan_kernel cuts splits; the kernel
        masks a split's last, partial tile), so the hooked kernel runs the plain tile's plan."""
        most = min(self.block_n, 64 if self.kv_bytes == 1 and self.consumer_wgs == 3 else 80)
        block_n = most if most % self.copy_rows == 0 else 64
        tanh = soft_cap_tanh()
        uniform_wg = self.uniform_wg and self.kv_bytes == 2 and tanh != 2
        return dataclasses.replace(self, variants=True, block_n=block_n, tanh=tanh, uniform_wg=uniform_wg)

    def traits(self):
        b = lambda x: str(bool(x)).lower()
        # the 16-bit kernels with the exact tanh and one head dim keep their names: the last three
        # only where one differs, V's head dim only where it differs from K's
        vo = self.head_dim_vo != self.head_dim
        tail = (self.kv_bytes, self.staging, self.tanh)
        extra = ", " + ", ".join(map(str, tail)) if tail != (2, 0, 0) or vo else ""
        if vo:
            extra += f", {self.head_dim_vo}"
        return (f"cupy_fa::Sm90PrefillTraits<{self.head_dim}, {self.block_n}, {self.stages}, {b(self.pingpong)}, "
                f"{self.producer_regs}, {b(self.uniform_wg)}, {b(self.joint_rows)}, {b(self.lean_copy)}, "
                f"{int(self.consumer_wgs)}, {b(self.variants)}{extra}>")

    def checks(self):
        """The host's mirrors of the traits, compiled in as static_asserts."""
        traits = self.traits()
        return (f"{traits}::kSmemBytes == {self.smem_bytes}",
                f"{traits}::kConsumerRegs == {self.consumer_regs}",
                f"{traits}::kBlockM == {self.block_m} && {traits}::kThreads == {self.threads}")


# The tile of each head dim (FlashAttention-3's shapes for causal / paged: 128 x 128 at
# D <= 128, 128 x 80 at D = 256, which the shared memory allows 2 stages of), measured by
# interleaved A/B on the H200 (2026-12-01, docs/performance.md):
# * D 64 / 128 take the warp-uniform warpgroup index and the joint two-row softmax (+4-6% at
#   D = 128; 0 spills for both element types); D = 256 does not (with uniform_wg it spills 64 bytes);
# * D 64 / 128: the producer's lean copies, +13-18% over the same tiles without;
# * D 64 / 128: three consumer warpgroups (192 rows a CTA, 512 threads; each warpgroup's softmax
#   hides behind two others' GEMMs), at D = 128 with 80 keys a tile (S, O and P fit the 160
#   registers a consumer gets only with 64 or 80): +5-9% on prefill, +18% at D = 64; the producer
#   needs 32 registers with lean copies.
# * D 96 (64-byte swizzled blocks of 32 columns; a pass of the producer copies 32 rows of one
#   block, so 32, 64 or 96 keys a tile): D 128's options at 96 keys (128 spill 144 bytes);
#   D 192 (three 64-column blocks, 16 rows a pass): two consumer warpgroups at 96 keys (112 with
#   these options spill 44 bytes; 128 keys do not fit two stages). On an H100 (2026-12-05), prefill
#   B=4 L=4096 bf16: 540 TFLOP/s at D 96, 566 at D 192; not timed against other shapes.
DEFAULT_TILES = {
    64: Sm90Tile(64, 128, stages=4, uniform_wg=True, joint_rows=True, lean_copy=True, consumer_wgs=3,
                 producer_regs=32),
    96: Sm90Tile(96, 96, stages=2, uniform_wg=True, joint_rows=True, lean_copy=True, consumer_wgs=3,
                 producer_regs=32),
    128: Sm90Tile(128, 80, stages=2, uniform_wg=True, joint_rows=True, lean_copy=True, consumer_wgs=3,
                  producer_regs=32),
    192: Sm90Tile(192, 96, stages=2, uniform_wg=True, joint_rows=True, lean_copy=True, consumer_wgs=2,
                  producer_regs=56),
    256: Sm90Tile(256, 80, stages=2, pingpong=False),
}

# An fp8 cache's tile of each head dim: the 16-bit tile's shape with two staging slots of raw
# e4m3 tiles (the producer copies one tile ahead of the one it widens); at D 256, 64 keys a tile
# (80 with the staging slots would pass the shared memory). 0 spills (NVRTC 12.9) with the
# producer's widening one 16-byte chunk at a time. On an H100 (2026-12-05), D 128 bf16 queries:
# prefill B=4 L=4096 471 TFLOP/s, B=2 L=8192 507 (the mma.sync family's fp8 prefill tile ran ~224).
FP8_TILES = {
    64: dataclasses.replace(DEFAULT_TILES[64], kv_bytes=1, staging=2),
    128: dataclasses.replace(DEFAULT_TILES[128], kv_bytes=1, staging=2),
    256: dataclasses.replace(DEFAULT_TILES[256], kv_bytes=1, staging=2, block_n=64),
}

# The tile of each pair of separate qk / vo head dims (common.HEAD_DIM_PAIRS; a 16-bit cache): K's
# tiles and Q at the qk head dim, V's tiles, the O accumulators and the epilogue at the vo head dim.
# At 192 / 128 the D 192 tile's options (two consumer warpgroups, K's three 64-column blocks) with
# O at 128 columns (64 registers a thread instead of 96), which leaves room for 128 keys a tile:
# two stages of K (128 x 192) and V (128 x 128) beside Q take 215 KB of shared memory.
PAIR_TILES = {
    (192, 128): Sm90Tile(192, 128, stages=2, uniform_wg=True, joint_rows=True, lean_copy=True, consumer_wgs=2,
                         producer_regs=56, head_dim_vo=128),
}

# The soft-cap's tanh in the hooked kernels (Sm90Tile.tanh; kernels/sm90/softmax.cuh soft_cap_tile):
# 0 the exact form, 1 tanh.approx, 2 the Newton form. tanh.approx is one special-function operation
# a score besides the softmax's 2^x, the exact form two (2^y and a reciprocal), the Newton form one
# and eight more on the FMA pipe; the hooked D 128 kernel on an H100 (B=4 x 4096 causal, cap 50,
# interleaved A/B, 2026-12-05): 453 / 367 / 342 TFLOP/s. tanh.approx's relative error (about 2^-11)
# moves a capped score by at most cap x 2^-11 (0.024 at cap 50) where tanh saturates: the same
# hardware tanh FlashAttention-3 and FlashInfer take; tests/test_prefill_sm90_gpu.py holds every form
# to float64 where the scores reach several times the cap.
SOFT_CAP_TANH = 1


def soft_cap_tanh():
    """The hooked kernels' tanh form: CUPY_FA_SOFT_CAP_TANH's (exact, approx, newton) where set,
    else :data:`SOFT_CAP_TANH`."""
    chosen = knobs().soft_cap_tanh
    return SOFT_CAP_TANH if chosen is None else SOFT_CAP_TANH_FORMS.index(chosen)


def prefill_tile(head_dim, kv_bytes=2, head_dim_vo=None):
    """The family's tile of a head dim (or of the pair ``head_dim`` / ``head_dim_vo``: PAIR_TILES)
    for K / V elements of ``kv_bytes``, or None where it has none."""
    if head_dim_vo is not None and head_dim_vo != head_dim:
        return PAIR_TILES.get((head_dim, head_dim_vo)) if kv_bytes == 2 else None
    return (FP8_TILES if kv_bytes == 1 else DEFAULT_TILES).get(head_dim)


def kernel(types, tile):
    """The compiled kernel of ``tile`` for element types ``types`` (a ``common.ElementTypes``):
    this family takes one element type for Q and O, and that one or an fp8 cache's for K / V."""
    if types.q != types.out or types.kv_bytes != tile.kv_bytes or (tile.kv_bytes == 2 and types.kv != types.q):
        raise ValueError(f"the {SM90_WGMMA.name} family takes one element type for Q and O and that one for KV "
                         f"(or an fp8 cache on a kv_bytes=1 tile), got {types} for {tile}")
    q, kv, out = types.ctypes()
    return _compile.Kernel(SM90_WGMMA.source, f"{SM90_WGMMA.kernel}<{q}, {kv}, {out}, {tile.traits()}>",
                         tile.threads, tile.smem_bytes, tile.checks())
