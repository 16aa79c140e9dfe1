"""The tiling policy: which kernels run a batch, with which tiles, splits and merge (one file).

For a planned step :func:`schedule_step` answers everything the host decides:

1. **The kernel families and tiles.** A step's requests fall in two classes by their own
   ``q_len``, each with its own attention launch and work list (``kernels/plan.cu``):
   * small-q requests (``q_len <= SMALL_Q_LEN``: decode, verify, draft extend, the decode rows
     of a mixed batch) take the small-q tile of the ``MMA_SYNC`` family (``kernels/attention.cu``,
     mma.sync m16n8k16, sm_80+; :func:`tile_for`), 4 warps over the 64 keys of each KV tile (an
     fp8 cache's: :func:`fp8_small_q_shape`), one row of warps (16 packed rows) or two (32) by
     the packed rows of the class's longest request, ``CUPY_FA_DECODE_STAGES`` deep. Their bits are those of a pure decode step whatever else
     the batch holds (docs/design.md, "Batch invariance");
   * longer requests (prefill, extend, chunked prefill, the long rows of a mixed batch) take
     :func:`prefill_tile`: the ``SM90_WGMMA`` family (``kernels/prefill_sm90.cu``, wgmma with a
     producer warpgroup, sm_90a only) where the target is sm_90a and the head dim 64, 128 or
     256, else the mma.sync prefill tile (4 warps over 64 query rows). One split per CTA, no fold.
   Both read the same plan metadata (``kernels/work.cuh``, ``kernels/sm90_prefill_work.cuh``),
   each its own list with its own ``block_m`` / ``block_n``.
2. **The fold** (:func:`fold_tile`): whether the small-q CTAs fold their splits themselves
   (whole rows, or groups of ``MERGE_GROUP``) instead of leaving partials for the merge kernel;
   only in steps without long requests (one merge launch reads one partial layout).
3. **The splits** (computed on the device by ``kernels/plan.cu``; :func:`max_splits` is the
   host's bound): small-q requests split every ``split_size(kv_bytes)`` keys at fixed positions (one
   value per cache element: batch invariance), others only while ``q_len x splits <= SPLIT_ROW_BUDGET``; at most ``MAX_SPLITS``.
4. **The grids and the merge** (:func:`work_bound`, :func:`capacity_work_bound`,
   :func:`launch_grid`, :func:`needs_merge`, :func:`merge_shape`): one merge after both launches
   folds the split rows of either class.

None of these choices changes a bit of the results except the split size (docs/design.md,
"Batch invariance"); the tuning knobs are :mod:`cupy_fa.knobs`. :func:`all_variants` lists every
kernel the policy can select (what CI compiles) and :func:`warmup_variants` those one device
can select.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import _arrays, _build
from .knobs import STAGE_CHOICES, knobs
from ._build import Variant

# ---- the policy's constants ------------------------------------------------------------

HEAD_DIMS = (64, 96, 128, 192, 256)  # 96 and 192: the mma.sync family only (prefill_tile)
WARP_LAYOUTS = ((1, 4), (2, 4), (4, 1))  # mma.sync tiles: (warps over query rows, warps over keys)
SMALL_Q_LEN = 16  # batches with q_len <= this are decode-like: the small-q tile and fixed-position splits
MAX_SPLITS = 256  # KV splits of one request at most (sizes the merge's shared memory)
SPLIT_ROW_BUDGET = 128  # larger q_len: splits only while q_len x splits <= this
PARTIAL_WORKSPACE_BYTES = 128 << 20  # split partials: at least this much, at least B x SPLIT_ROW_BUDGET rows
MERGE_GROUP = 8  # splits folded in order before the groups are (kernels/softmax.cuh kMergeGroup)
FP8 = "float8_e4m3fn"  # the fp8 K/V cache dtype (kernels/common.cuh fp8_e4m3): its tiles have kv_bytes=1
# Head dims an fp8 cache takes: its rows are D / 16 chunks of 16 bytes (6 at D = 96, 12 at 192),
# which its loads and byte swizzle need to tile the CTA evenly (docs/design.md, "Head dims")
FP8_HEAD_DIMS = (64, 128, 256)
# Keys per KV tile and pipeline depth of an fp8 cache's small-q tiles at head dims 64 and 128:
# 128 keys, 2 stages, so a stage holds the bytes of a 16-bit tile's (64 keys), and a warp takes
# 32 keys between two barriers instead of 16. Measured on the H200 (2026-12-02, `python -m
# bench.fp8 --ab`, decode B=64 L=4096 at D 128, folding CTAs): 141.3 us against 168.8 us at
# 64 keys x 4 stages and 143.8 us at 64 x 2 (docs/design.md, "fp8 KV cache"). At D = 256 the
# tiles keep 64 keys 4 deep (FP8_D256): 128 keys take the one-row tile to 255 registers and
# a 4-byte spill (NVRTC 12.9). Every fp8 small-q tile of a head dim shares its keys per tile,
# so decode and verify reduce a split's keys alike (docs/design.md, "Batch invariance"). (A
# program that changes them, as `python -m bench.fp8 --ab` does, clears attention_variant's
# cache: it caches by tile, and block_n is not a field.)
FP8_STAGES = 2
FP8_BLOCK_N = 128
FP8_D256 = (64, 4)  # (keys per KV tile, stages) of the D = 256 fp8 small-q tiles


def fp8_small_q_shape(head_dim):
    """(keys per KV tile, pipeline stages) of an fp8 cache's small-q tiles at ``head_dim``."""
    return FP8_D256 if head_dim == 256 else (FP8_BLOCK_N, FP8_STAGES)


SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90 (the kernels' occupancy math)
SM80_SMEM_LIMIT = 163 * 1024  # and on sm_80: tiles are chosen for the device's own limit
FOLD_MIN_WAVE_FILL = 0.75  # fold only when the folding CTAs fill their waves this well (the last one too)
WHOLE_ROW_GROUPS = 2  # a CTA folds a whole row (no merge at all) of at most this many groups


# ---- element types ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ElementTypes:
    """The element types of a kernel's Q, KV and O (separate template parameters of the
    attention kernel): equal, or an fp8 cache's ``kv = "float8_e4m3fn"`` beside fp16 / bf16
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
        return _build.CTYPES[self.q], _build.KV_CTYPES[self.kv], _build.CTYPES[self.out]


# ---- kernel families and their tiles -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelFamily:
    """One attention kernel template: its source, its name, and the archs it runs on. A tile
    class per family names its traits (``MmaTile.traits``)."""
    name: str
    source: str      # file under kernels/
    kernel: str      # the __global__ template, instantiated as kernel<Q, KV, O, Traits>
    min_sm: int      # compute capability (x10) it needs


MMA_SYNC = KernelFamily("mma_sync", "attention.cu", "cupy_fa::attention_kernel", 80)
# wgmma prefill (sm_90a only: the architecture-specific target; its tile is prefill_sm90.Sm90Tile)
SM90_WGMMA = KernelFamily("sm90_wgmma", "prefill_sm90.cu", "cupy_fa::prefill_sm90_kernel", 90)
FAMILIES = (MMA_SYNC, SM90_WGMMA)


def _sm90():
    """cupy_fa.prefill_sm90 (Sm90Tile, its default tiles and variants), imported on first use:
    it imports this module."""
    from . import prefill_sm90

    return prefill_sm90


def is_sm90a(arch):
    """Whether ``arch`` (e.g. ``sm_90a``, ``compute_90a``) is Hopper's architecture-specific target,
    the only one the wgmma family compiles for."""
    return arch is not None and arch.endswith("90a")


def family_of(tile):
    """The :class:`KernelFamily` whose kernel a tile instantiates."""
    return SM90_WGMMA if isinstance(tile, _sm90().Sm90Tile) else tile.family


def is_small_q_tile(tile):
    """A tile of the small-q class (mma.sync, 4 warps over each KV tile's keys)."""
    return isinstance(tile, MmaTile) and tile.warps_n > 1


@dataclasses.dataclass(frozen=True)
class MmaTile:
    """A tile of the mma.sync family; the C++ ``TileTraits`` (kernels/tile_traits.cuh) derives
    the rest, and the numbers the host uses are compiled into every variant as checks."""
    head_dim: int
    warps_m: int
    warps_n: int
    stages: int = 2
    fold_capable: bool = False  # carries a fold state (TileTraits FOLD): its own kernel binary
    splits_per_cta: int = 1  # consecutive KV splits one CTA runs (schedule only: same kernel binary)
    fold_splits: bool = False  # CTAs fold their splits themselves (AttentionParams::fold_splits)
    kv_bytes: int = 2  # bytes of a K/V element: 2 (fp16 / bf16), 1 (an fp8 cache; TileTraits KV_BYTES)
    variants: bool = False  # the variant hooks compiled in (window, soft-cap, sinks; TileTraits VARIANTS)
    row_halves: int = 2  # 1: a one-row small-q tile for requests of <= 8 packed rows (TileTraits ROW_HALVES)
    producer_capable: bool = False  # may take a producer warpgroup (producer_warps; tile_for: sm_90a only)

    family = MMA_SYNC
    whole_tiles_per_split = True  # a split is tiles_per_split whole KV tiles (kernels/attention.cu)

    def __post_init__(self):
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
        return self.warps_n > 1 and (self.warps_m == 1 or self.head_dim >= 128)

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
        fold = self.block_m * (2 * self.head_dim * 4 + 16) if self.fold_capable else 0  # TileTraits::kSmemFold
        if self.kv_bytes == 1:  # TileTraits::kSmemKVRegion: room for an epilogue staged over every stage
            kv = 2 * self.stages * self.block_n * self.head_dim
            if not self.epilogue_in_stage:
                kv = max(kv, self.warps_m * self.warps_n * 16 * self.head_dim * 4)
            return 2 * self.head_dim * self.block_m + kv + fold + own
        return 2 * self.head_dim * (self.block_m + 2 * self.stages * self.block_n) + fold + own

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
        # TileTraits::kOneCtaForRegisters: a 96-column two-row tile with the variant hooks
        one_for_registers = self.variants and self.warps_m > 1 and self.head_dim % 64 != 0
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
        its row block (:func:`fold_tile`), in the fold-capable variant with the deepest pipeline
        that still fits ``smem_limit``; None where no such variant exists."""
        if not self.fold_layout:
            return None
        return dataclasses.replace(self, fold_capable=True, splits_per_cta=MERGE_GROUP * groups_per_cta,
                                   fold_splits=True).deepest_fit(smem_limit)

    def with_variants(self):
        """This tile's kernel with the variant hooks compiled in: the same schedule, only the
        binary differs (:func:`with_variants`; no producer warpgroup: it has no build with the hooks)."""
        return dataclasses.replace(self, variants=True, producer_capable=False)

    def traits(self):
        """The C++ traits type of this tile's kernel binary."""
        # the plain 16-bit kernels keep their names (and code): KV_BYTES only when not 2 or when
        # VARIANTS (a later template argument) follows
        producer = self.producer_warps != 0
        halves = self.row_halves != 2 or producer
        kv = f", {self.kv_bytes}" if self.kv_bytes != 2 or self.variants or halves else ""
        hooks = f", {str(self.variants).lower()}" if self.variants or halves else ""
        rows = f", {self.row_halves}" if halves else ""
        producers = f", {self.producer_warps}" if producer else ""
        return (f"cupy_fa::TileTraits<{self.head_dim}, {self.warps_m}, {self.warps_n}, {self.block_n}, "
                f"{self.stages}, {str(self.fold_capable).lower()}{kv}{hooks}{rows}{producers}>")

    def checks(self):
        """The host's mirrors of the traits, compiled in as static_asserts."""
        traits = self.traits()
        return (f"{traits}::kSmemBytes == {self.smem_bytes}",
                f"{traits}::kEpilogueInStage == {str(self.epilogue_in_stage).lower()}",
                f"{traits}::kMinCtasPerSm == {self.min_ctas_per_sm}",
                f"cupy_fa::kTraceCtas == {_build.TRACE_SHAPE[0]} && cupy_fa::kTraceStamps == {_build.TRACE_SHAPE[1]}")


# ---- which tile for a batch ------------------------------------------------------------------


def tile_for(head_dim, max_q_len, group_size, smem_limit=SMEM_LIMIT, arch=None, kv_bytes=2):
    """Tile for a batch whose longest request has ``max_q_len`` query tokens, on a device with
    ``smem_limit`` bytes of dynamic shared memory per CTA and target ``arch`` (e.g. ``sm_90a``;
    None: any).

    Decode-like batches (``max_q_len <= SMALL_Q_LEN``) spread 4 warps over the keys of each
    64-key tile (memory-bound: few rows, many keys; may pipeline deeper), with a second row of
    warps when a request packs more than 16 (token x head-in-group) rows; they all share
    (BLOCK_N, WARPS_N), which with the fixed split positions keeps decode and verify of a token
    bit-identical. Prefill-like batches take :func:`prefill_tile`. ``kv_bytes=1`` (an fp8
    cache): the same layouts with fp8_small_q_shape's keys a tile and depth, and where every
    request packs at most 8 rows (decode at a GQA group of at most 8) the one-row tile with one
    row half (``row_halves=1``: half the softmax issued, the same bits a row; CUPY_FA_HALF_ROWS=0
    turns it off)."""
    k = knobs()
    if max_q_len > SMALL_Q_LEN:
        return prefill_tile(head_dim, smem_limit, arch, kv_bytes)
    rows = max(max_q_len, 1) * group_size
    warps_m = k.decode_warps_m or (1 if rows <= 16 else 2)
    stages = fp8_small_q_shape(head_dim)[1] if kv_bytes == 1 else k.decode_stages
    tile = small_q_tile(head_dim, warps_m, stages, smem_limit, kv_bytes)
    if kv_bytes == 1 and warps_m == 1 and rows <= tile.block_m // 2 and k.half_rows:  # the kernel traps past it
        tile = dataclasses.replace(tile, row_halves=1)
        if k.producer_warp and tile.producer_warp_layout and is_sm90a(arch):  # setmaxnreg: sm_90a
            tile = dataclasses.replace(tile, producer_capable=True)
    if tile.epilogue_in_stage:
        tile = dataclasses.replace(tile, splits_per_cta=k.splits_per_cta)
    return tile


def prefill_tile(head_dim, smem_limit=SMEM_LIMIT, arch=None, kv_bytes=2):
    """The tile of requests of more than SMALL_Q_LEN tokens, one KV split per CTA: on an sm_90a
    target the wgmma family's default tile for the head dim (``prefill_sm90.DEFAULT_TILES``,
    192 packed rows per CTA at D 64 / 128, 128 at D 256) when it fits ``smem_limit``; on any other target (sm_80, sm_89, an
    ``sm_90`` or ``sm_80`` build forced by ``CUPY_FA_ARCH``, or ``arch=None``: no target
    named), and at the head dims the wgmma family lacks (96, 192: docs/design.md "Head dims"),
    the mma.sync prefill tile, 4 warps over query rows (64 packed rows per CTA). An fp8
    cache (``kv_bytes=1``) takes the mma.sync prefill tile with fp8 K/V stages on every target,
    sm_90a included (the wgmma family reads 16-bit K/V only)."""
    if kv_bytes == 1:
        return MmaTile(head_dim, 4, 1, kv_bytes=1)
    if is_sm90a(arch) and head_dim in _sm90().DEFAULT_TILES:
        tile = _sm90().DEFAULT_TILES[head_dim]
        if tile.smem_bytes <= smem_limit:
            return tile
    return MmaTile(head_dim, 4, 1)


def small_q_tile(head_dim, warps_m, stages, smem_limit=SMEM_LIMIT, kv_bytes=2):
    """The small-q tile with the deepest pipeline up to ``stages`` that fits this head dim
    and ``smem_limit``. The two-row tile carries a fold state (where its layout can, at
    D >= 128) when it fits: registers already hold it at 2 CTAs per SM, which the state
    keeps (at D = 256 only Hopper's shared memory has room; elsewhere it runs without, one
    split per CTA). The one-row tile gets one per batch (its ``folding()``, chosen by
    :func:`fold_tile`), as it costs it a CTA per SM."""
    base = MmaTile(head_dim, warps_m, 4, stages, kv_bytes=kv_bytes)
    for fold in ((True, False) if warps_m == 2 and base.fold_layout else (False,)):
        tile = dataclasses.replace(base, fold_capable=fold).deepest_fit(smem_limit)
        if tile is not None:
            return tile
    raise ValueError(f"no small-q tile of head dim {head_dim} fits {smem_limit} bytes of shared memory per CTA")


# ---- splits -----------------------------------------------------------------------------------


# Keys per split of small-q requests where CUPY_FA_SPLIT_SIZE is unset: per K/V element size, so a
# split holds the same bytes of K and V (64 KiB a KV head at D 128) over either cache. A CTA that
# folds its splits runs one epilogue per split; over an fp8 cache 512-key splits held decode
# B=64 L=4096 at 138.9 us, 1024 at 135.6 us, 2048 at 133.4 us (`bench.fp8 --ab`, H200,
# 2026-12-02, bench/NOTES.md); bf16 at 1024 the same as at 512 there (243.3 us), but a batch of
# one gets half the CTAs: 16-bit caches keep 512.
SPLIT_SIZE = 512
FP8_SPLIT_SIZE = 1024


def split_size(kv_bytes=2):
    """S, the keys per split of small-q requests over a cache of ``kv_bytes``-byte K/V elements
    (CUPY_FA_SPLIT_SIZE for every cache where set, else SPLIT_SIZE, or FP8_SPLIT_SIZE for fp8; a
    multiple of 64, the small-q tile's keys per KV tile, and of 128 over fp8 at D 64 / 128). One
    value for a cache's every step: decode and verify split at the same keys (their bits agree)."""
    s = knobs().split_size
    if s is not None:
        return s
    return FP8_SPLIT_SIZE if kv_bytes == 1 else SPLIT_SIZE


def partial_rows(max_batch_size, num_qo_heads, head_dim, elem_bytes=2):
    """Rows of the split-partial buffers for a capacity: at least PARTIAL_WORKSPACE_BYTES and
    at least max_batch_size x SPLIT_ROW_BUDGET rows; one row is H_q x (head_dim outputs in the
    output type + one fp32 LSE). A batch that would need more caps every request at an equal
    share (kernels/plan.cu: the only way a batch changes a request's splits)."""
    row_bytes = num_qo_heads * (head_dim * elem_bytes + 4)
    return max(max_batch_size * SPLIT_ROW_BUDGET, PARTIAL_WORKSPACE_BYTES // row_bytes)


def max_splits(q_lens, kv_lens, kv_bytes=2):
    """Upper bound on each request's split count under the policy that kernels/plan.cu
    applies (its overflow cap and rounding only lower it), over a cache of ``kv_bytes``-byte
    K/V elements (:func:`split_size`). The host uses it for grid sizes and to know whether a
    merge can be needed; the schedule itself is only ever computed on the device."""
    q = np.maximum(np.asarray(q_lens), 1)
    splits = -(-np.maximum(np.asarray(kv_lens), 1) // split_size(kv_bytes))
    splits = np.where(q > SMALL_Q_LEN, np.minimum(splits, np.maximum(1, SPLIT_ROW_BUDGET // q)), splits)
    return np.maximum(1, np.minimum(splits, MAX_SPLITS))


def key_base(q_lens, kv_lens, window, kv_bytes=2):
    """kernels/plan.cu window_key_base: with a sliding ``window`` (keys a query sees, itself
    included; 0 / None: none) the keys before each request's first split, its first query's first
    visible key ``kv_len - q_len - window + 1`` rounded down to a multiple of MERGE_GROUP x
    split_size(kv_bytes) (so small-q splits and their merge groups stay at fixed positions); 0 without."""
    q, kv = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    if not window:
        return np.zeros(np.broadcast(q, kv).shape, np.int64)
    unit = MERGE_GROUP * split_size(kv_bytes)
    first = kv - q - int(window) + 1
    return np.where(first > 0, first // unit * unit, 0)


def window_spans(q_lens, kv_lens, window, kv_bytes=2):
    """The keys each request's splits cut (``kv_len - key_base``): what every split count of the
    policy is computed from (all of ``kv_len`` without a window)."""
    return np.asarray(kv_lens, np.int64) - key_base(q_lens, kv_lens, window, kv_bytes)


def window_span_bound(max_q_len, max_kv_len, window, kv_bytes=2):
    """The most keys a request of at most ``max_q_len`` tokens and ``max_kv_len`` keys splits under
    ``window``: its queries' windows, ``max_q_len + window - 1`` keys, plus the rounding of its
    key_base (MERGE_GROUP x split_size(kv_bytes) - 1 keys); ``max_kv_len`` without a window."""
    if not window:
        return max_kv_len
    return min(max_kv_len, max_q_len + int(window) - 1 + MERGE_GROUP * split_size(kv_bytes) - 1)


# ---- the grid ----------------------------------------------------------------------------------


def row_blocks(q_lens, group_size, tile):
    """Row tiles of each request: its q_len x group_size packed (token, head) rows cut into
    tiles of tile.block_m (kernels/plan.cu counts them the same way)."""
    return -(-(np.asarray(q_lens) * group_size) // tile.block_m)


def needs_merge(tile, q_lens, kv_lens):
    """Whether a row of these lengths can end in partials for merge_kernel: a row of several
    splits, or where CTAs fold their groups of splits (tile.fold_splits), of several groups."""
    q, kv = np.asarray(q_lens), np.asarray(kv_lens)
    live = q > 0
    per_input = tile.splits_per_cta if tile.fold_splits else 1
    merges = bool(np.any(max_splits(q[live], kv[live], tile.kv_bytes) > per_input))
    # merge_kernel finds a folded row's group states by MERGE_GROUP splits each (kernels/
    # merge.cu), the attention kernel leaves one per CTA of splits_per_cta: only CTAs of one
    # group each may precede a merge (fold_tile gives whole rows only to rows that need none)
    if merges and tile.fold_splits and tile.splits_per_cta != MERGE_GROUP:
        raise RuntimeError(f"internal: a merge after CTAs that fold {tile.splits_per_cta} splits each; "
                           f"merge_kernel reads one state per {MERGE_GROUP}")
    return merges


def work_bound(q_lens, kv_lens, group_size, tile):
    """Upper bound on the attention kernel's work items for these host lengths."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    live = q_lens > 0
    split_groups = -(-max_splits(q_lens[live], kv_lens[live], tile.kv_bytes) // tile.splits_per_cta)
    return int((row_blocks(q_lens[live], group_size, tile) * split_groups).sum())


def capacity_work_bound(capacity, group_size, tile, max_q_len, max_kv_len, min_q_len=1):
    """Upper bound on work items for any step that fits the capacity with
    q_len <= max_q_len and kv_len <= max_kv_len, counting the requests of
    ``min_q_len`` tokens or more (the long family's list: SMALL_Q_LEN + 1): the fixed
    grid of a captured graph. CTAs past the real work exit at once, but each still
    costs a launch slot, so the bound is kept tight for decode-like shapes."""
    b, t = capacity.max_batch_size, capacity.max_num_tokens
    max_q_len = max(1, min(max_q_len, t))
    if min_q_len > max_q_len:
        return 0
    q = np.arange(max(1, min_q_len), max_q_len + 1)
    splits = max_splits(q, np.full_like(q, max_kv_len), tile.kv_bytes)
    per_request = int((row_blocks(q, group_size, tile) * -(-splits // tile.splits_per_cta)).max())
    # whatever kv_len: small-q requests have few row blocks, longer ones few splits
    # (row_blocks x splits <= SPLIT_ROW_BUDGET x group / block_m + splits); and a
    # batch can't hold more than b requests, nor more tokens than t
    small = int(row_blocks(min(max_q_len, SMALL_Q_LEN), group_size, tile)) * MAX_SPLITS if min_q_len <= SMALL_Q_LEN \
        else 0
    large = SPLIT_ROW_BUDGET * group_size // tile.block_m + MAX_SPLITS + 1
    loose = b * max(small, large) + int(row_blocks(min(t, b * max_q_len), group_size, tile)) + b
    return min(b * per_request, loose)


def launch_grid(tile, work_grid, num_kv_heads, sm_count):
    """CTAs of one attention launch: one per (work item, KV head), KV heads fastest; a tile with a
    persistent grid (``tile.persistent``) at most one per SM, each CTA taking items in turn."""
    ctas = work_grid * num_kv_heads
    return min(ctas, sm_count) if getattr(tile, "persistent", False) else ctas


# ---- the fold ----------------------------------------------------------------------------------


def fold_tile(tile, q_lens, kv_lens, group_size, num_kv_heads, sm_count, exact=True, smem_limit=SMEM_LIMIT):
    """``tile.folding(...)`` when the batch's CTAs should fold their own splits, else ``tile``.

    A CTA of a small-q tile with a fold state takes merge_kernel's steps on the splits it
    runs (same order, same bits), so they need no partial rows:
    * a whole row of at most ``WHOLE_ROW_GROUPS`` groups of ``MERGE_GROUP`` splits (its
      groups, then the groups in order): the result itself, no merge launch;
    * else one group per CTA: one state per group (a quarter of its split partials' bytes
      or less), which merge_kernel folds in order.
    Either way one CTA start-up per group or row instead of per split. It pays only when
    those fewer, longer CTAs fill the GPU without a long tail: their waves at the folding
    variant's CTAs per SM (the one-row tile's fold state costs it one of three) must be
    ``FOLD_MIN_WAVE_FILL`` full on average, the last one counted whole (0.97 waves: 0.97;
    1.14 waves: 0.57; 1.94 waves: 0.97).
    Whole rows need the exact lengths (``exact``; a graph plan sees only bounds and folds by
    groups). The folding variant must fit ``smem_limit`` (the device's shared memory per
    CTA). ``CUPY_FA_FOLD_SPLITS``: ``auto`` (default), ``1`` (whenever the tile can),
    ``0`` (never). The choice depends on the batch; the results do not."""
    knob = knobs().fold_splits
    live = np.asarray(q_lens) > 0
    by_group = tile.folding(smem_limit=smem_limit)
    if knob == "0" or by_group is None or not live.any():
        return tile
    q, kv = np.asarray(q_lens)[live], np.asarray(kv_lens)[live]

    def fills(folded):  # its CTAs, work_bound's count, fill their waves
        ctas = work_bound(q, kv, group_size, folded) * num_kv_heads
        slots = folded.min_ctas_per_sm * sm_count
        return knob == "1" or ctas >= FOLD_MIN_WAVE_FILL * slots * -(-ctas // slots)

    groups = -(-int(max_splits(q, kv, tile.kv_bytes).max()) // MERGE_GROUP)
    if exact and groups <= WHOLE_ROW_GROUPS:
        whole = tile.folding(groups, smem_limit)
        if whole is not None and fills(whole):
            return whole
    return by_group if fills(by_group) else tile


# ---- one step's schedule -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
    """One attention launch of a step: a family's tile (the kernel binary and its schedule:
    splits per CTA, fold), the work items its grid is sized for, its CTAs (:func:`launch_grid`)
    and the most KV splits a request of the class gets (:func:`max_splits`: small-q requests at
    fixed positions every split_size(kv_bytes) keys, longer ones while q_len x splits <= SPLIT_ROW_BUDGET;
    kernels/plan.cu computes each request's own on the device)."""
    tile: object         # MmaTile, or prefill_sm90.Sm90Tile
    work_grid: int
    ctas: int
    max_splits: int


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """What the host decided for a planned step: one launch per class of requests it may hold
    (None where it holds none), then the merge.

    ``small``: requests of up to SMALL_Q_LEN tokens, on the small-q tile (work_indptr);
    ``long``: longer ones, on :func:`prefill_tile` (long_work_indptr). A host-planned step has
    the launches of the classes it holds (an empty or all-padding step: ``small``, of no work);
    a device-planned one those its ``max_q_len`` bound allows."""
    small: Launch | None
    long: Launch | None
    needs_merge: bool    # whether merge_kernel runs after the attention launches

    @property
    def launches(self):
        """The attention launches in order: the long family's first, then the small-q kernel,
        whose CTAs let the merge (a programmatic dependent of it) start in its last wave."""
        return tuple(x for x in (self.long, self.small) if x is not None)

    @property
    def tile(self):
        """The small-q launch's tile, or the long one's in a step without small-q requests (what a
        decode-like step runs; logs and tests read it)."""
        return (self.small or self.long).tile

    @property
    def work_grid(self):
        """Work items of :attr:`tile`'s launch."""
        return (self.small or self.long).work_grid

    def plan_tiles(self):
        """(tile, long_tile) for the plan kernel (:func:`plan_constants`): one work list when the
        step has no long launch, two when it has."""
        if self.long is None:
            return self.small.tile, None
        return (self.small or self.long).tile, self.long.tile


def schedule_step(head_dim, group_size, num_kv_heads, *, q_lens=None, kv_lens=None, max_q_len=None,
                  max_kv_len=None, capacity=None, batch_size=None, smem_limit=SMEM_LIMIT, sm_count=132, arch=None,
                  kv_bytes=2, window=0):
    """The launches, tiles, grids and merge of one step, on a device with ``smem_limit`` bytes of
    shared memory per CTA, ``sm_count`` SMs and target ``arch`` (None: the mma.sync family only).

    With host lengths (``q_lens``, ``kv_lens``) the choice is exact: a launch per class of
    requests present; the small-q CTAs may fold their splits (:func:`fold_tile`) when the step
    has no long request. With device lengths the host sees only bounds: ``max_q_len``
    (required), ``max_kv_len`` (None: any), the ``capacity`` the grids must cover and
    ``batch_size``. Up to SMALL_Q_LEN the step is small-q only and the fold is by groups, where
    even the shortest such batch (every request max_q_len tokens, one split) fills the GPU;
    above it both launches are planned (either may find no work; no fold). The bits never
    depend on any of it. ``kv_bytes=1``: an fp8 cache's tiles (both classes on the mma.sync
    family).

    With a sliding ``window`` (> 0) a request's splits cut only the keys from its key_base on
    (:func:`window_spans`; kernels/plan.cu), and every split count, grid and merge below is that of
    those keys (with device lengths: of :func:`window_span_bound`)."""
    long_tile = prefill_tile(head_dim, smem_limit, arch, kv_bytes)
    if window and q_lens is not None:
        kv_lens = window_spans(q_lens, kv_lens, window, kv_bytes)  # what the splits cut: every count below follows
    elif window:
        max_kv_len = window_span_bound(int(max_q_len), int(max_kv_len) if max_kv_len is not None else 2**31 - 1,
                                       window, kv_bytes)

    def launch(tile, work_grid, q, kv):  # q, kv: the class's lengths, or the bounds it plans for
        live = np.asarray(q) > 0
        splits = int(max_splits(np.asarray(q)[live], np.asarray(kv)[live], tile.kv_bytes).max()) if live.any() else 0
        return Launch(tile, work_grid, launch_grid(tile, work_grid, num_kv_heads, sm_count), splits)

    if q_lens is not None:
        q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
        is_long = q_lens > SMALL_Q_LEN
        is_small = ~is_long  # padding (q_len = 0) too: it has no work in either list
        small = long = None
        merge = False
        if is_long.any():
            q, kv = q_lens[is_long], kv_lens[is_long]
            long = launch(long_tile, work_bound(q, kv, group_size, long_tile), q, kv)
            merge = needs_merge(long_tile, q, kv)
        if not is_long.any() or (q_lens[is_small] > 0).any():
            q, kv = q_lens[is_small], kv_lens[is_small]
            tile = tile_for(head_dim, int(q.max()) if q.size else 0, group_size, smem_limit, arch, kv_bytes)
            if long is None:  # one merge reads one partial layout: no CTA folds beside a long launch
                tile = fold_tile(tile, q, kv, group_size, num_kv_heads, sm_count, smem_limit=smem_limit)
            small = launch(tile, work_bound(q, kv, group_size, tile), q, kv)
            merge = merge or needs_merge(tile, q, kv)
        return StepSchedule(small, long, merge)
    max_q = int(max_q_len)
    kv_bound = int(max_kv_len) if max_kv_len is not None else 2**31 - 1
    tile = tile_for(head_dim, min(max_q, SMALL_Q_LEN), group_size, smem_limit, arch, kv_bytes)
    if max_q <= SMALL_Q_LEN:
        shortest = np.full(batch_size, max_q)
        tile = fold_tile(tile, shortest, shortest, group_size, num_kv_heads, sm_count, exact=False,
                         smem_limit=smem_limit)
        grid = capacity_work_bound(capacity, group_size, tile, max_q, kv_bound)
        return StepSchedule(launch(tile, grid, [1], [kv_bound]), None, needs_merge(tile, [1], [kv_bound]))
    small = launch(tile, capacity_work_bound(capacity, group_size, tile, SMALL_Q_LEN, kv_bound), [1], [kv_bound])
    long = launch(long_tile, capacity_work_bound(capacity, group_size, long_tile, max_q, kv_bound,
                                                 min_q_len=SMALL_Q_LEN + 1), [SMALL_Q_LEN + 1], [kv_bound])
    merge = needs_merge(tile, [1], [kv_bound]) or needs_merge(long_tile, [SMALL_Q_LEN + 1], [kv_bound])
    return StepSchedule(small, long, merge)


def _check_split_fits(s, tile):
    """ValueError unless split size ``s`` is whole KV tiles of ``tile`` (a family whose kernel
    takes any split length is not held to it)."""
    if tile is not None and getattr(tile, "whole_tiles_per_split", False) and s % tile.block_n:
        raise ValueError(f"CUPY_FA_SPLIT_SIZE={s} is not a multiple of the tile's {tile.block_n} keys per KV tile")


def check_split_size(head_dim, kv_bytes=2):
    """What plan_constants checks per launch, asked before a plan stages anything: split_size()
    is whole KV tiles of the small-q tiles at ``head_dim`` for K/V elements of ``kv_bytes`` (4
    warps over the keys, whatever their rows and depth: every one has the same keys per KV tile)."""
    _check_split_fits(split_size(kv_bytes), MmaTile(head_dim, 1, 4, kv_bytes=kv_bytes))


def plan_constants(tile, long_tile=None):
    """PlanParams' policy fields (kernels/plan.cu reads them): the small-q requests laid out for
    ``tile`` in work_indptr and, with ``long_tile``, the longer ones for it in long_work_indptr;
    without it every request is laid out for ``tile`` (one family)."""
    s = split_size(tile.kv_bytes)
    for t in (tile, long_tile):
        _check_split_fits(s, t)
    if long_tile is not None and (long_tile.splits_per_cta != 1 or long_tile.fold_splits):
        raise ValueError(f"internal: the long family runs one split per CTA and never folds, got {long_tile}")
    other = long_tile or tile
    return dict(block_m=tile.block_m, block_n=tile.block_n, long_q_len=SMALL_Q_LEN + 1 if long_tile else 2**31 - 1,
                long_block_m=other.block_m, long_block_n=other.block_n, split_size=s, max_splits=MAX_SPLITS,
                small_q_len=SMALL_Q_LEN, split_row_budget=SPLIT_ROW_BUDGET, splits_per_cta=tile.splits_per_cta,
                fold_splits=int(tile.fold_splits))


# ---- merge shapes -------------------------------------------------------------------------------

# Merge shapes (kernels/merge.cu MergeTraits): (heads per CTA, ways over split groups).
# Both fold in the same order, so the choice never changes a bit.
MERGE_WIDE = (8, 1)  # many tokens: one CTA per 8 heads of a token, one way
MERGE_DEEP = (1, 8)  # fewer tokens with more splits: one head, 8 ways
MERGE_DEEPEST = (1, 0)  # a few rows of long requests: one head, a way per group (up to 1024 threads)
# (from tokens x H_q rows, shape): wide while it still gives every SM a CTA, the deepest
# for a handful of rows (B=1 L=131072: 256 splits folded by 32 ways at once, not 8 x 4)
MERGE_SHAPES = ((1024, MERGE_WIDE), (256, MERGE_DEEP), (0, MERGE_DEEPEST))


def merge_shape(num_tokens, num_qo_heads):
    rows = num_tokens * num_qo_heads
    return next(shape for min_rows, shape in MERGE_SHAPES if rows >= min_rows)


def merge_grid(num_tokens, num_qo_heads):
    """The merge kernel's shape and grid for a step of ``num_tokens`` query tokens."""
    shape = merge_shape(num_tokens, num_qo_heads)
    return shape, (num_tokens, -(-num_qo_heads // shape[0]))


# ---- variants ----------------------------------------------------------------------------------


def with_variants(tile):
    """``tile``'s kernel with the variant hooks compiled in (kernels/variant.cuh: sliding window,
    logits soft-cap, attention sinks; each on at run time by its AttentionParams field). The same
    schedule and work layout as ``tile``: only the binary differs (a wgmma tile may hold fewer
    keys a KV tile with the hooks: ``Sm90Tile.with_variants``). Each tile class says how."""
    return tile.with_variants()


@functools.lru_cache(maxsize=None)
def attention_variant(dtype, tile):
    """The attention kernel binary of a tile (its family's template) for element types
    ``dtype`` (a dtype name, or :class:`ElementTypes`; the wgmma family takes one element
    type for Q, KV and O; a tile's ``kv_bytes`` must be the KV type's)."""
    types = ElementTypes.of(dtype)
    if getattr(tile, "kv_bytes", 2) != types.kv_bytes:
        raise ValueError(f"internal: tile {tile} is for {getattr(tile, 'kv_bytes', 2)}-byte K/V, "
                         f"the KV type is {types.kv}")
    if types.kv_bytes == 1 and tile.variants:
        raise ValueError(f"internal: an fp8 cache's kernels have no build with the variant hooks (tile {tile}; "
                         f"attention.refuse_fp8_variants refuses the step)")
    if family_of(tile) is SM90_WGMMA:
        if not types.q == types.kv == types.out:
            raise ValueError(f"the {SM90_WGMMA.name} family takes one element type for Q, KV and O, got {types}")
        return _sm90().variant(types.q, tile)  # its own mirrors of Sm90PrefillTraits as checks
    q, kv, out = types.ctypes()
    expr = f"{tile.family.kernel}<{q}, {kv}, {out}, {tile.traits()}>"
    return Variant(tile.family.source, expr, tile.threads, tile.smem_bytes, tile.checks())


@functools.lru_cache(maxsize=None)
def merge_variant(dtype_name, head_dim, shape):
    heads_per_cta, ways = shape
    if ways == 0:  # a way per group of splits, up to 1024 threads (32 ways at D=128: one group each)
        lanes = head_dim // 4 * heads_per_cta
        ways = min(1024 // lanes, MAX_SPLITS // MERGE_GROUP)
        while lanes * ways % 32:  # whole warps (D = 192: 20 ways of 48 lanes): its warp-wide search
            ways -= 1
    expr = (f"cupy_fa::merge_kernel<{_build.CTYPES[dtype_name]}, "
            f"cupy_fa::MergeTraits<{head_dim}, {heads_per_cta}, {ways}, {MAX_SPLITS}>>")
    return Variant("merge.cu", expr, head_dim // 4 * heads_per_cta * ways)


MERGE_STATES_THREADS = 256  # kernels/merge_states.cu's launch bounds: head_dim / 4 threads a row


@functools.lru_cache(maxsize=None)
def merge_states_variant(dtype_name):
    """cupy_fa.merge_states' kernel (kernels/merge_states.cu) for one output type; any head dim
    that is a multiple of 4 up to 4 x MERGE_STATES_THREADS."""
    return Variant("merge_states.cu", f"cupy_fa::merge_states_kernel<{_build.CTYPES[dtype_name]}>",
                   MERGE_STATES_THREADS)


def append_variant(index_dtype, quantize_from=None):
    """The append kernel for slots of ``index_dtype``: a copy, or (``quantize_from``: the new
    rows' dtype name) the fp8 cache's quantising one."""
    index = {"int32": "int", "int64": "long long"}[np.dtype(index_dtype).name]
    if quantize_from is not None:
        return Variant("kv_append.cu", f"cupy_fa::append_quantize_kernel<{index}, {_build.CTYPES[quantize_from]}>", 256)
    return Variant("kv_append.cu", f"cupy_fa::append_kernel<{index}>", 256)


PLAN_VARIANT = Variant("plan.cu", "cupy_fa::plan_kernel", 1024)


def _common_variants(dtype_name, head_dim):
    return [merge_variant(dtype_name, head_dim, shape) for _, shape in MERGE_SHAPES]


def all_variants(arch=None):
    """Every kernel the library can launch, on Hopper or on an A100, under any knob values (what
    CI compiles): with ``arch`` those an ``arch`` build can run (the wgmma family only for sm_90a);
    None: every one (they all compile for sm_90a)."""
    out = [PLAN_VARIANT, append_variant(np.int32), append_variant(np.int64)]
    out += [merge_states_variant(dtype_name) for dtype_name in _build.CTYPES]
    out += [append_variant(i, d) for d in _build.CTYPES for i in (np.int32, np.int64)]
    for dtype_name in _build.CTYPES:
        for head_dim in HEAD_DIMS:
            out += _common_variants(dtype_name, head_dim)
            tiles = [MmaTile(head_dim, 4, 1)]  # mma.sync prefill: any target but sm_90a (there: no wgmma fit)
            if arch is None or is_sm90a(arch):
                tiles.append(prefill_tile(head_dim, SMEM_LIMIT, "sm_90a"))
            for warps_m in (1, 2):
                for stages in STAGE_CHOICES:
                    for limit in (SMEM_LIMIT, SM80_SMEM_LIMIT):  # what Hopper and what A100 pick
                        tile = small_q_tile(head_dim, warps_m, stages, limit)
                        tiles += [tile, tile.folding(smem_limit=limit)]
            tiles = [t for t in tiles if t is not None]
            tiles += [with_variants(t) for t in tiles]  # each with the variant hooks (window, soft-cap, sinks)
            variants = (attention_variant(dtype_name, t) for t in tiles)
            out += list({v.expression: v for v in variants}.values())  # one per kernel binary
            if head_dim in FP8_HEAD_DIMS:
                out += fp8_variants(dtype_name, head_dim, fp8_tiles(head_dim, arch=arch))
    return out


def fp8_tiles(head_dim, stage_choices=None, limits=(SMEM_LIMIT, SM80_SMEM_LIMIT), arch=None):
    """The tiles of an fp8 cache the policy can select at a head dim: the mma.sync prefill tile
    and the small-q tiles (both row layouts, each depth, Hopper's and an A100's shared memory)
    with their folding variants, and the one-row-half tiles with a producer warpgroup where ``arch``
    is sm_90a or None (any); ``stage_choices``: the depths (default the policy's)."""
    tiles = [prefill_tile(head_dim, kv_bytes=1)]
    for warps_m in (1, 2):
        for stages in stage_choices or (fp8_small_q_shape(head_dim)[1],):
            for limit in limits:
                tile = small_q_tile(head_dim, warps_m, stages, limit, kv_bytes=1)
                tiles += [tile, tile.folding(smem_limit=limit)]
                if warps_m == 1:  # and with one row half (tile_for: requests of <= 8 rows), and a producer warpgroup
                    half = dataclasses.replace(tile, row_halves=1)
                    tiles += [half, half.folding(smem_limit=limit)]
                    if half.producer_warp_layout and (arch is None or is_sm90a(arch)):
                        ring = dataclasses.replace(half, producer_capable=True)
                        tiles += [ring, ring.folding(smem_limit=limit)]
    return [t for t in tiles if t is not None]


def fp8_variants(dtype_name, head_dim, tiles=None):
    """The attention kernels over an fp8 cache with ``dtype_name`` queries and outputs, one per
    kernel binary (the merge, plan and append kernels are the 16-bit ones')."""
    types = ElementTypes(dtype_name, FP8, dtype_name)
    variants = (attention_variant(types, t) for t in (fp8_tiles(head_dim) if tiles is None else tiles))
    return list({v.expression: v for v in variants}.values())


def warmup_variants(dtypes=("float16", "bfloat16"), head_dims=HEAD_DIMS, smem_limit=SMEM_LIMIT, arch=None,
                    kv_dtypes=None, variants=False):
    """Every variant that plans with these dtypes and head dims can select under the knobs in
    force, on a device with ``smem_limit`` and ``arch`` (the small-q tiles of either class, the
    prefill family of the arch, the merges, plan and append, and merge_states'). ``kv_dtypes``: the
    cache dtypes (default: each query dtype's own; add ``"float8_e4m3fn"`` for an fp8 cache, head
    dims 64, 128 and 256 only: FP8_HEAD_DIMS); with ``variants`` each 16-bit cache's attention
    kernel with the variant hooks too (what steps with a window, a soft-cap or sinks run; an fp8
    cache has none)."""
    wanted = [PLAN_VARIANT, append_variant(np.int32), append_variant(np.int64)]
    wanted += [merge_states_variant(dtype_name) for dtype_name in dtypes]
    for dtype_name in dtypes:
        for head_dim in head_dims:
            wanted += _common_variants(dtype_name, head_dim)
            for kv in (kv_dtypes or (dtype_name,)):
                kv = FP8 if _arrays.resolve_kv_dtype(kv, "kv_dtypes") == FP8 else dtype_name
                if kv == FP8 and head_dim not in FP8_HEAD_DIMS:
                    continue  # no fp8 tile at this head dim (BatchAttention refuses it)
                types = ElementTypes(dtype_name, kv, dtype_name)
                if kv == FP8:
                    wanted += [append_variant(np.int32, dtype_name), append_variant(np.int64, dtype_name)]
                # each layout tile_for picks: one row half, the one-row tile, the two-row tile, prefill
                for max_q_len, group in ((1, 1), (4, 4), (SMALL_Q_LEN, 4), (SMALL_Q_LEN + 1, 1)):
                    tile = tile_for(head_dim, max_q_len, group, smem_limit, arch, types.kv_bytes)
                    folded = tile.folding(smem_limit=smem_limit) if is_small_q_tile(tile) else None  # fold_tile's pick
                    picked = [t for t in (tile, folded) if t is not None]
                    # (an fp8 cache's kernels have no hooked build: BatchAttention refuses the variants there)
                    picked += [with_variants(t) for t in picked] if variants and kv != FP8 else []
                    wanted += [attention_variant(types, t) for t in picked]
    return list({v: None for v in wanted})


def warmup(dtypes=("float16", "bfloat16"), head_dims=HEAD_DIMS, kv_dtypes=None, variants=False, device=None,
           jobs=None, progress=None):
    """Compiles (or loads from the disk cache) every variant that plans with these dtypes and
    head dims can select under the current knobs, on ``device`` (an int id, a ``cupy.cuda.Device``,
    a torch cuda device; default CuPy's current device: each device loads its own), so no compile happens
    inside a step or a graph capture (``kv_dtypes=("bfloat16", "float8_e4m3fn")``: an fp8 cache's
    too); ``variants=True`` adds the kernels with the variant hooks (steps with a sliding window,
    a logits soft-cap or attention sinks). The missing ones compile in ``jobs`` processes at once
    (default every core; ``_build.compile_many``), with a progress line on stderr when it is a
    terminal (``progress=True`` / ``False`` to force it on / off). Returns how many."""
    import cupy

    from . import _arrays

    _arrays.require_cuda()
    device_id = _arrays.resolve_device(device)
    with cupy.cuda.Device(device_id):
        arch = _build.device_arch(device_id)
        wanted = warmup_variants(dtypes, head_dims, _build.device_smem_limit(device_id), arch, kv_dtypes, variants)
        _build.compile_many(wanted, arch, jobs, progress)
        for variant in wanted:
            _build.get_function(variant, device_id)  # now a load from the cache
    return len(wanted)
