"""The mma.sync family (``kernels/mma_sync/attention.cu``; sm_80 and newer): its tiles.

One kernel template, ``attention_kernel<Q, KV, O, TileTraits<...>>``, serves two shapes of tile:

* the small-q tiles (decode, verify, draft extend, the decode rows of a mixed batch): 4 warps
  over the keys of each KV tile, one row of warps (16 packed rows) or two (32), a cp.async
  pipeline of 2 to 4 stages, optionally a fold state (the CTA merges its own splits), one row
  half (fp8 decode of at most 8 packed rows) and, on sm_90a, a producer warpgroup (fp8 only);
* the prefill tile: 4 warps over 64 query rows, used where the sm_90a family does not apply
  (any target but sm_90a, or an sm_90a device whose shared memory the wgmma tile does not fit).

:class:`MmaTile` is the host mirror of ``TileTraits`` (``kernels/mma_sync/tile_traits.cuh``): the
numbers the host uses (shared memory, CTAs per SM, whether the epilogue fits a stage) are
compiled into every kernel as ``static_assert`` checks. Which tile a step runs is
:mod:`cupy_fa.schedule`'s choice.
"""

from __future__ import annotations

import dataclasses


from .. import _compile
from ..knobs import STAGE_CHOICES
from .common import MERGE_GROUP, SMEM_LIMIT, KernelFamily

MMA_SYNC = KernelFamily("mma_sync", "mma_sync/attention.cu", "cupy_fa::attention_kernel", 80)
WARP_LAYOUTS = ((1, 4), (2, 4), (4, 1))  # (warps over query rows, warps over keys): small-q 1 / 2 rows, prefill

# Keys per KV tile and pipeline depth of an fp8 cache's small-q tiles at head dims 64 and 128:
# 128 keys, 2 stages, so a stage holds the bytes of a 16-bit tile's (64 keys), and a warp takes
# 32 keys between two barriers instead of 16. Measured on the H200 (2026-12-02, `python -m
# bench.fp8 --ab`, decode B=64 L=4096 at D 128, folding CTAs): 141.3 us against 168.8 us at
# 64 keys x 4 stages and 143.8 us at 64 x 2 (docs/design.md, "fp8 KV cache"). At D = 256 the
# tiles keep 64 keys 4 deep (FP8_D256): 128 keys take the one-row tile to 255 registers and
# a 4-byte spill (NVRTC 12.9). Every fp8 small-q tile of a head dim shares its keys per tile,
# so decode and verify reduce a split's keys alike (docs/design.md, "Batch invariance"). (A
# program that changes them, as `python -m bench.fp8 --ab` does, clears catalog.attention_kernel's
# cache: it caches by tile, and block_n is not a field.)
FP8_STAGES = 2
FP8_BLOCK_N = 128
FP8_D256 = (64, 4)  # (keys per KV tile, stages) of the D = 256 fp8 small-q tiles


def fp8_small_q_shape(head_dim):
    """(keys per KV tile, pipeline stages) of an fp8 cache's small-q tiles at ``head_dim``."""
    return FP8_D256 if head_dim == 256 else (FP8_BLOCK_N, FP8_STAGES)


@dataclasses.dataclass(frozen=True)
class MmaTile:
    """A tile of the mma.sync family; the C++ ``TileTraits`` (kernels/mma_sync/tile_traits.cuh)
    derives the rest, and the numbers the host uses are compiled into every kernel as checks."""
    head_dim: int
    warps_m: int
    warps_n: int
    stages: int = 2
    fold_capable: bool = False  # carries a fold state (TileTraits FOLD): its own kernel
    splits_per_cta: int = 1  # consecutive KV splits one CTA runs (schedule only: the same kernel)
    fold_splits: bool = False  # CTAs fold their splits themselves (AttentionParams::fold_splits)
    kv_bytes: int = 2  # bytes of a K/V element: 2 (fp16 / bf16), 1 (an fp8 cache; TileTraits KV_BYTES)
    variants: bool = False  # the variant hooks compiled in (window, soft-cap, sinks; TileTraits VARIANTS)
    row_halves: int = 2  # 1: a one-row small-q tile for requests of <= 8 packed rows (TileTraits ROW_HALVES)
    producer_capable: bool = False  # may take a producer warpgroup (producer_warps; schedule.tile_for: sm_90a only)
    head_dim_vo: int = None  # V's and out's head dim (TileTraits HEAD_DIM_VO); None: head_dim

    family = MMA_SYNC
    whole_tiles_per_split = True  # a split is tiles_per_split whole KV tiles (kernels/mma_sync/attention.cu)

    def __post_init__(self):
        if self.head_dim_vo is None:
            object.__setattr__(self, "head_dim_vo", self.head_dim)
        if self.head_dim_vo != self.head_dim and (self.kv_bytes != 2 or self.producer_capable):
            raise ValueError(f"separate qk / vo head dims take a 16-bit cache and no producer warpgroup, got {self}")
        if self.fold_capable and not self.fold_layout:
            raise ValueError(f"a fold state needs a small-q tile whose epilogue fits one stage (one row of "
                             f"warps, or two at D >= 128), got {self}")
        if self.splits_per_cta != 1 and not self.epilogue_in_stage:
            raise ValueError(f"splits_per_cta={self.splits_per_cta} needs a tile whose epilogue fits one stage; "
                             f"{self} does not")
        if self.row_halves not in (1, 2) or (self.row_halves == 1 and not (self.warps_m == 1 and self.warps_n > 1)):
            raise ValueError(f"row_halves=1 is for the one-row small-q tile only, got {self}")
        if self.producer_capable and not self.producer_warp_layout:
            raise ValueError(f"a producer warpgroup is for the fp8 one-row-half small-q tile at head dims 64 and "
                             f"128, got {self}")
        if self.fold_splits and not (self.fold_capable and self.splits_per_cta % MERGE_GROUP == 0):
            raise ValueError(f"fold_splits needs a fold-capable tile running whole groups of {MERGE_GROUP} "
                             f"splits per CTA, got {self}")

    @property
    def block_m(self):
        """Packed (token, head) rows per CTA (PlanParams::block_m)."""
        return 16 * self.warps_m

    @property
    def block_n(self):
        """Keys per KV tile (PlanParams::block_n: split sizes are multiples of it); an fp8 cache's
        small-q tiles take fp8_small_q_shape's (all of a head dim alike: decode and verify share it)."""
        if self.kv_bytes == 1 and self.warps_n > 1:
            return fp8_small_q_shape(self.head_dim)[0]
        return 32 if (self.head_dim == 256 and self.warps_n == 1) else 64

    @property
    def threads(self):
        """Threads per CTA (TileTraits::kCtaThreads): the consumer warps', and a producer warpgroup's."""
        return 32 * (self.warps_m * self.warps_n + self.producer_warps)

    @property
    def producer_warp_layout(self):
        """Whether this tile can take a producer warpgroup (TileTraits PRODUCER_WARPS): an fp8 one-row
        small-q tile of 4 warps with one row half, without the variant hooks, at head dims 64 and 128
        (at 256 its 64-key tiles keep their copies on the consumers)."""
        return (self.kv_bytes == 1 and self.warps_m == 1 and self.warps_n == 4 and self.row_halves == 1
                and not self.variants and self.head_dim in (64, 128))

    @property
    def producer_warps(self):
        """Warps of the producer warpgroup (TileTraits PRODUCER_WARPS): 4 for a ``producer_capable``
        folding tile of that layout whose 256 threads and epilogue buffer (``_smem_own``) keep the CTAs
        an SM it has without them (2: the folding tile at D = 128, by shared memory), else 0: a tile
        that fits 3 or 4 CTAs an SM keeps them, and its copies on the consumers (a producer
        warpgroup's registers allow 2)."""
        if not (self.producer_capable and self.producer_warp_layout and self.fold_capable):
            return 0
        consumers = 32 * self.warps_m * self.warps_n
        plain = self._ctas_per_sm(consumers, self._smem_bytes(0))
        return 4 if self._ctas_per_sm(consumers + 128, self._smem_bytes(self._smem_own)) == plain == 2 else 0

    @property
    def fold_layout(self):
        """Whether this warp layout can carry a fold state: a small-q tile whose epilogue fits
        one stage (one row of warps, or two at D >= 128, half of D per pass; an fp8 tile's
        stage holds half the bytes: one row of warps at D >= 128)."""
        if self.kv_bytes == 1:
            return self.warps_n > 1 and self._fp8_epilogue_passes() > 0
        return self.warps_n > 1 and (self.warps_m == 1 or self.head_dim_vo >= 128)

    def _fp8_epilogue_passes(self):
        """TileTraits::kEpiloguePasses of an fp8 tile: the warps' fp32 accumulators in one stage
        (2 x block_n x D bytes) at once, else in two halves of D (D >= 128), else 0 (not in a stage)."""
        stage = 2 * self.block_n * self.head_dim
        staged = self.warps_m * self.warps_n * 16 * self.head_dim * 4
        return 1 if staged <= stage else (2 if self.head_dim >= 128 and staged // 2 <= stage else 0)

    @property
    def smem_bytes(self):
        return self._smem_bytes(self._smem_own if self.producer_warps else 0)

    @property
    def _smem_own(self):
        """TileTraits::kSmemEpilogueOwn of a producer-warpgroup tile: its epilogue's buffer, 8 rows a
        warp of one pass's columns in fp32."""
        return self.warps_m * self.warps_n * 8 * (self.head_dim // max(self._fp8_epilogue_passes(), 1)) * 4

    def _smem_bytes(self, own):
        fold = self.block_m * (2 * self.head_dim_vo * 4 + 16) if self.fold_capable else 0  # TileTraits::kSmemFold
        if self.kv_bytes == 1:  # TileTraits::kSmemKVRegion: room for an epilogue staged over every stage
            kv = 2 * self.stages * self.block_n * self.head_dim
            if not self.epilogue_in_stage:
                kv = max(kv, self.warps_m * self.warps_n * 16 * self.head_dim * 4)
            return 2 * self.head_dim * self.block_m + kv + fold + own
        # Q's rows, then the stages' K (head_dim) and V (head_dim_vo) tiles
        return 2 * (self.head_dim * self.block_m + self.stages * self.block_n * (self.head_dim + self.head_dim_vo)) \
            + fold + own

    @property
    def epilogue_in_stage(self):
        """The end-of-split epilogue fits in one pipeline stage, at once or in two passes
        (TileTraits::kEpilogueInStage): only then may a CTA run several splits."""
        if self.kv_bytes == 1:
            return self._fp8_epilogue_passes() > 0
        return self.warps_m * self.warps_n <= self.block_n // 16 or self.fold_capable

    @property
    def min_ctas_per_sm(self):
        """TileTraits::kMinCtasPerSm: CTAs per SM the launch bounds hold small-q tiles to
        (as many as shared memory allows, up to what 128 registers a thread can feed)."""
        return self._ctas_per_sm(self.threads, self.smem_bytes)

    def _ctas_per_sm(self, threads, smem_bytes):
        by_smem = SMEM_LIMIT // (smem_bytes + 1024)
        by_registers = 65536 // (threads * 128)
        # TileTraits::kOneCtaForRegisters: a 96-column or fp8 two-row tile with the variant hooks
        one_for_registers = self.variants and self.warps_m > 1 and (self.head_dim % 64 != 0 or self.kv_bytes == 1)
        return 1 if self.warps_n == 1 or by_smem < 1 or one_for_registers else min(by_smem, by_registers)

    @property
    def fits(self):
        return self.fits_in(SMEM_LIMIT)

    def fits_in(self, smem_limit):
        """Whether its dynamic shared memory fits a device's per-CTA limit (opt-in)."""
        return self.smem_bytes <= smem_limit

    def deepest_fit(self, smem_limit):
        """This tile with the deepest pipeline up to its own that fits ``smem_limit``, or None."""
        tile = self
        while not tile.fits_in(smem_limit) and tile.stages > min(STAGE_CHOICES):
            tile = dataclasses.replace(tile, stages=tile.stages - 1)
        return tile if tile.fits_in(smem_limit) else None

    def folding(self, groups_per_cta=1, smem_limit=SMEM_LIMIT):
        """This tile with each CTA folding ``groups_per_cta`` groups of MERGE_GROUP splits of
        its row block (``schedule.fold_tile``), in the fold-capable tile with the deepest pipeline
        that still fits ``smem_limit``; None where no such tile exists."""
        if not self.fold_layout:
            return None
        return dataclasses.replace(self, fold_capable=True, splits_per_cta=MERGE_GROUP * groups_per_cta,
                                   fold_splits=True).deepest_fit(smem_limit)

    def with_variants(self):
        """This tile's kernel with the variant hooks compiled in (kernels/shared/variant.cuh: sliding
        window, logits soft-cap, attention sinks; each on at run time by its AttentionParams field): the
        same schedule and work layout, only the kernel differs (no producer warpgroup: it has no build
        with the hooks; an fp8 tile of one row half takes both, which the hooks' registers fit, with
        the same bits a row)."""
        return dataclasses.replace(self, variants=True, producer_capable=False,
                                   row_halves=2 if self.kv_bytes == 1 else self.row_halves)

    def traits(self):
        """The C++ traits type of this tile's kernel."""
        # the plain 16-bit kernels keep their names (and code): KV_BYTES only when not 2 or when
        # VARIANTS (a later template argument) follows
        producer = self.producer_warps != 0
        halves = self.row_halves != 2 or producer
        kv = f", {self.kv_bytes}" if self.kv_bytes != 2 or self.variants or halves else ""
        hooks = f", {str(self.variants).lower()}" if self.variants or halves else ""
        rows = f", {self.row_halves}" if halves else ""
        producers = f", {self.producer_warps}" if producer else ""
        vo = ""
        if self.head_dim_vo != self.head_dim:  # the last template argument: every one before it spelled out
            vo = (f", {self.kv_bytes}, {str(self.variants).lower()}, {self.row_halves}, {self.producer_warps}, "
                  f"{self.head_dim_vo}")
            kv = hooks = rows = producers = ""
        return (f"cupy_fa::TileTraits<{self.head_dim}, {self.warps_m}, {self.warps_n}, {self.block_n}, "
                f"{self.stages}, {str(self.fold_capable).lower()}{kv}{hooks}{rows}{producers}{vo}>")

    def checks(self):
        """The host's mirrors of the traits, compiled in as static_asserts."""
        traits = self.traits()
        return (f"{traits}::kSmemBytes == {self.smem_bytes}",
                f"{traits}::kEpilogueInStage == {str(self.epilogue_in_stage).lower()}",
                f"{traits}::kMinCtasPerSm == {self.min_ctas_per_sm}",
                f"cupy_fa::kTraceCtas == {_compile.TRACE_SHAPE[0]} && cupy_fa::kTraceStamps == {_compile.TRACE_SHAPE[1]}")



def small_q_tile(head_dim, warps_m, stages, smem_limit=SMEM_LIMIT, kv_bytes=2, head_dim_vo=None):
    """The small-q tile with the deepest pipeline up to ``stages`` that fits this head dim
    and ``smem_limit``. The two-row tile carries a fold state (where its layout can, at
    D >= 128) when it fits: registers already hold it at 2 CTAs per SM, which the state
    keeps (at D = 256 only Hopper's shared memory has room; elsewhere it runs without, one
    split per CTA). The one-row tile gets one per batch (its ``folding()``, chosen by
    ``schedule.fold_tile``), as it costs it a CTA per SM."""
    base = MmaTile(head_dim, warps_m, 4, stages, kv_bytes=kv_bytes, head_dim_vo=head_dim_vo)
    for fold in ((True, False) if warps_m == 2 and base.fold_layout else (False,)):
        tile = dataclasses.replace(base, fold_capable=fold).deepest_fit(smem_limit)
        if tile is not None:
            return tile
    raise ValueError(f"no small-q tile of head dim {head_dim} (vo {base.head_dim_vo}) fits {smem_limit} bytes of "
                     f"shared memory per CTA")


def kernel(types, tile):
    """The compiled kernel of ``tile`` for element types ``types`` (a ``common.ElementTypes``)."""
    q, kv, out = types.ctypes()
    return _compile.Kernel(MMA_SYNC.source, f"{MMA_SYNC.kernel}<{q}, {kv}, {out}, {tile.traits()}>", tile.threads,
                           tile.smem_bytes, tile.checks())
