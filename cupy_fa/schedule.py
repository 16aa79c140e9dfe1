"""The tiling policy: which kernels run a step, with which tiles, splits and merge.

For a planned step :func:`schedule_step` answers everything the host decides:

1. **The families and tiles.** A step's requests fall in two classes by their own ``q_len``,
   each with its own attention launch and work list (``kernels/shared/plan.cu``):
   * small-q requests (``q_len <= SMALL_Q_LEN``: decode, verify, draft extend, the decode rows
     of a mixed batch) take :func:`tile_for`'s small-q tile of the mma.sync family
     (:mod:`cupy_fa.families.mma_sync`): 4 warps over the keys of each KV tile, one row of warps
     (16 packed rows) or two (32) by the packed rows of the class's longest request,
     ``CUPY_FA_DECODE_STAGES`` deep (an fp8 cache: ``fp8_small_q_shape``). Their bits are those
     of a pure decode step whatever else the batch holds (docs/design.md, "Batch invariance");
   * longer requests (prefill, extend, chunked prefill, the long rows of a mixed batch) take
     :func:`prefill_tile`: the sm_90a wgmma family (:mod:`cupy_fa.families.sm90`) where the
     target is sm_90a (head dims 64 / 96 / 128 / 192 / 256 over a 16-bit cache, 64 / 128 / 256
     over an fp8 cache), else the mma.sync prefill tile (4 warps over 64 query rows). One split
     per CTA, no fold.
2. **The fold** (:func:`fold_tile`): whether the small-q CTAs fold their splits themselves
   (whole rows, or groups of ``MERGE_GROUP``) instead of leaving partials for the merge kernel;
   only in steps without long requests (one merge launch reads one partial layout).
3. **The splits**: small-q requests split every ``split_size(kv_bytes)`` keys at fixed positions
   (one value per cache element: batch invariance), others only while ``q_len x splits <=
   SPLIT_ROW_BUDGET``; at most ``MAX_SPLITS``. :func:`max_splits` is the rule; the plan kernel
   (``kernels/shared/plan.cu``) applies it on the device, lowering it only where a batch's partials
   would overflow the workspace (``tests/test_plan.py`` checks the kernel against this rule).
4. **The grids and the merge** (:func:`work_bound`, :func:`capacity_work_bound`,
   :func:`launch_grid`, :func:`needs_merge`, :func:`merge_shape`): one merge after both launches
   folds the split rows of either class.

None of these choices changes a bit of the results except the split size (docs/design.md,
"Batch invariance"); the tuning knobs are :mod:`cupy_fa.knobs`. The kernels a choice compiles
to are :mod:`cupy_fa.catalog`'s.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .families import sm90
from .families.common import MERGE_GROUP, SMEM_LIMIT, is_sm90a
from .families.mma_sync import MmaTile, fp8_small_q_shape, small_q_tile
from .knobs import knobs

SMALL_Q_LEN = 16  # requests with q_len <= this are decode-like: the small-q tile and fixed-position splits
MAX_SPLITS = 256  # KV splits of one request at most (sizes the merge's shared memory)
SPLIT_ROW_BUDGET = 128  # larger q_len: splits only while q_len x splits <= this
PARTIAL_WORKSPACE_BYTES = 128 << 20  # split partials: at least this much, at least B x SPLIT_ROW_BUDGET rows
FOLD_MIN_WAVE_FILL = 0.75  # fold only when the folding CTAs fill their waves this well (the last one too)
WHOLE_ROW_GROUPS = 2  # a CTA folds a whole row (no merge at all) of at most this many groups


# ---- which tile for a batch ------------------------------------------------------------------


def tile_for(head_dim, max_q_len, group_size, smem_limit=SMEM_LIMIT, arch=None, kv_bytes=2, head_dim_vo=None):
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
    turns it off). ``head_dim_vo``: V's and out's head dim where it differs (a pair of
    ``HEAD_DIM_PAIRS``: the same layouts, with V's tiles and the accumulators at that width)."""
    k = knobs()
    if max_q_len > SMALL_Q_LEN:
        return prefill_tile(head_dim, smem_limit, arch, kv_bytes, head_dim_vo)
    rows = max(max_q_len, 1) * group_size
    warps_m = k.decode_warps_m or (1 if rows <= 16 else 2)
    stages = fp8_small_q_shape(head_dim)[1] if kv_bytes == 1 else k.decode_stages
    tile = small_q_tile(head_dim, warps_m, stages, smem_limit, kv_bytes, head_dim_vo)
    if kv_bytes == 1 and warps_m == 1 and rows <= tile.block_m // 2 and k.half_rows:  # the kernel traps past it
        tile = dataclasses.replace(tile, row_halves=1)
        if k.producer_warp and tile.producer_warp_layout and is_sm90a(arch):  # setmaxnreg: sm_90a
            tile = dataclasses.replace(tile, producer_capable=True)
    if tile.epilogue_in_stage:
        tile = dataclasses.replace(tile, splits_per_cta=k.splits_per_cta)
    return tile


def prefill_tile(head_dim, smem_limit=SMEM_LIMIT, arch=None, kv_bytes=2, head_dim_vo=None):
    """The tile of requests of more than SMALL_Q_LEN tokens, one KV split per CTA: on an sm_90a
    target the wgmma family's tile for the head dim and cache (``sm90.DEFAULT_TILES``: 192 packed
    rows per CTA at D 64 / 96 / 128, 128 at D 192 / 256; an fp8 cache's ``sm90.FP8_TILES`` at
    D 64 / 128 / 256, its K / V widened to fp16 by the producer; separate qk / vo head dims,
    ``head_dim_vo`` a pair of ``HEAD_DIM_PAIRS``: ``sm90.PAIR_TILES``, 128 rows at 192 / 128) when
    it fits ``smem_limit``; on any other target (sm_80, sm_89, an ``sm_90`` or ``sm_80`` build
    forced by ``CUPY_FA_ARCH``, or ``arch=None``: no target named), and for a head dim, pair or
    cache the family has no tile of, the mma.sync prefill tile, 4 warps over query rows (64 packed
    rows per CTA; with fp8 K/V stages over an fp8 cache; with V's tiles and the accumulators at
    ``head_dim_vo`` for a pair)."""
    split_dims = head_dim_vo is not None and head_dim_vo != head_dim
    if is_sm90a(arch):
        tile = sm90.prefill_tile(head_dim, kv_bytes, head_dim_vo)
        if tile is not None and tile.smem_bytes <= smem_limit:
            return tile
    if split_dims:
        return MmaTile(head_dim, 4, 1, kv_bytes=kv_bytes, head_dim_vo=head_dim_vo)
    return MmaTile(head_dim, 4, 1, kv_bytes=kv_bytes)


# ---- splits -----------------------------------------------------------------------------------


# Keys per split of small-q requests where CUPY_FA_SPLIT_SIZE is unset: per K/V element size, so a
# split holds the same bytes of K and V (64 KiB a KV head at D 128) over either cache. A CTA that
# folds its splits runs one epilogue per split; over an fp8 cache 512-key splits held decode
# B=64 L=4096 at 138.9 us, 1024 at 135.6 us, 2048 at 133.4 us (`bench.fp8 --ab`, H200,
# 2026-12-02, lab/NOTES.md); bf16 at 1024 the same as at 512 there (243.3 us), but a batch of
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


def partial_row_bytes(num_qo_heads, head_dim, elem_bytes):
    """Bytes of one split-partial row: H_q x (head_dim outputs in the output type + one fp32 LSE)
    (MLA's too, at its 512 value columns)."""
    return num_qo_heads * (head_dim * elem_bytes + 4)


def partial_rows(max_batch_size, num_qo_heads, head_dim, elem_bytes=2, workspace_bytes=None):
    """Rows of the split-partial buffers for a capacity: at least ``workspace_bytes`` (default
    PARTIAL_WORKSPACE_BYTES) of them and at least max_batch_size x SPLIT_ROW_BUDGET rows
    (:func:`partial_row_bytes` each). A batch that would need more caps every request at an equal
    share (kernels/shared/plan.cu: the only way a batch changes a request's splits;
    :func:`wanted_partial_rows`)."""
    budget = PARTIAL_WORKSPACE_BYTES if workspace_bytes is None else int(workspace_bytes)
    return max(max_batch_size * SPLIT_ROW_BUDGET, budget // partial_row_bytes(num_qo_heads, head_dim, elem_bytes), 1)


def wanted_partial_rows(q_lens, kv_lens, constants):
    """The split-partial rows a host-planned batch asks for before any cap, counted as plan_kernel's
    first pass counts them, from the PlanParams policy fields it is given (``constants``: a
    plan_constants dict; kernels/shared/plan.cu wanted_splits, then split_schedule at that cap on
    each request's class tile): q_len x splits of every live request of several splits (``kv_lens``:
    the keys the splits cut). More than the buffers hold, and plan_kernel caps every request's splits
    at an equal share, so a request's bits then depend on its batch."""
    c = constants
    q = np.asarray(q_lens, np.int64)
    kv = np.maximum(np.asarray(kv_lens, np.int64), 1)
    cap = split_rule(q, kv, c["split_size"], c["max_splits"], c["small_q_len"], c["split_row_budget"])
    block_n = np.where(q >= c["long_q_len"], c["long_block_n"], c["block_n"])
    keys = np.maximum(c["split_size"], -(-(-(-kv // cap)) // block_n) * block_n)
    splits = np.maximum(1, -(-kv // keys))
    return int((q * splits)[(q > 0) & (splits > 1)].sum())


def max_splits(q_lens, kv_lens, kv_bytes=2):
    """Upper bound on each request's split count under the policy that kernels/shared/plan.cu
    applies (its overflow cap and rounding only lower it), over a cache of ``kv_bytes``-byte
    K/V elements (:func:`split_size`). The host uses it for grid sizes and to know whether a
    merge can be needed; the schedule itself is only ever computed on the device."""
    return split_rule(q_lens, kv_lens, split_size(kv_bytes), MAX_SPLITS, SMALL_Q_LEN, SPLIT_ROW_BUDGET)


def split_rule(q_lens, kv_lens, split, most, small_q_len, row_budget):
    """plan.cu's split rule for the constants a plan passes it (PlanParams split_size, max_splits,
    small_q_len, split_row_budget): a request of at most ``small_q_len`` tokens splits every
    ``split`` keys, a longer one only while ``q_len x splits <= row_budget``; 1 to ``most`` splits.
    :func:`max_splits` is this policy's, ``cupy_fa.mla.schedule.max_splits`` MLA's."""
    q = np.maximum(np.asarray(q_lens), 1)
    splits = -(-np.maximum(np.asarray(kv_lens), 1) // split)
    splits = np.where(q > small_q_len, np.minimum(splits, np.maximum(1, row_budget // q)), splits)
    return np.maximum(1, np.minimum(splits, most))


def window_quotient(q_lens, kv_lens, window, group):
    """``floor((kv_len - q_len - window + 1) / group)`` per request, unclamped, on one new int64 array
    (its positive part is :func:`key_base_units`; cupy_fa._memo's windowed key, every step)."""
    units = np.asarray(kv_lens, np.int64) - np.asarray(q_lens, np.int64)
    units -= int(window) - 1
    units //= group
    return units


def key_base_units(q_lens, kv_lens, window, kv_bytes=2):
    """:func:`key_base` in its units of MERGE_GROUP x split_size(kv_bytes) keys (a sliding ``window``
    > 0), on one new array: with ``ceil(kv_len / split_size)`` it fixes every split count of a
    windowed request."""
    units = window_quotient(q_lens, kv_lens, window, MERGE_GROUP * split_size(kv_bytes))
    np.maximum(units, 0, out=units)  # (floor(max(x, 0) / g) = max(floor(x / g), 0) for g > 0)
    return units


def key_base(q_lens, kv_lens, window, kv_bytes=2):
    """kernels/shared/plan.cu window_key_base: with a sliding ``window`` (keys a query sees, itself
    included; 0 / None: none) the keys before each request's first split, its first query's first
    visible key ``kv_len - q_len - window + 1`` rounded down to a multiple of MERGE_GROUP x
    split_size(kv_bytes) (so small-q splits and their merge groups stay at fixed positions); 0 without.
    In place on one new array (a windowed plan computes it every step: :func:`window_spans`)."""
    if not window:
        return np.zeros(np.broadcast(np.asarray(q_lens), np.asarray(kv_lens)).shape, np.int64)
    base = key_base_units(q_lens, kv_lens, window, kv_bytes)
    base *= MERGE_GROUP * split_size(kv_bytes)
    return base


def window_spans(q_lens, kv_lens, window, kv_bytes=2):
    """The keys each request's splits cut (``kv_len - key_base``): what every split count of the
    policy is computed from (all of ``kv_len`` without a window)."""
    kv = np.asarray(kv_lens, np.int64)
    if not window:
        return kv.copy()
    base = key_base(q_lens, kv, window, kv_bytes)
    np.subtract(kv, base, out=base)
    return base


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
    tiles of tile.block_m (kernels/shared/plan.cu counts them the same way)."""
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


def fold_tile(tile, q_lens, kv_lens, group_size, num_kv_heads, sm_count, exact=True, smem_limit=SMEM_LIMIT,
              whole_rows_only=False):
    """``tile.folding(...)`` when the batch's CTAs should fold their own splits, else ``tile``.

    A CTA of a small-q tile with a fold state takes merge_kernel's steps on the splits it
    runs (same order, same bits), so they need no partial rows:
    * a whole row of at most ``WHOLE_ROW_GROUPS`` groups of ``MERGE_GROUP`` splits (its
      groups, then the groups in order): the result itself, no merge launch;
    * else one group per CTA: one state per group (a quarter of its split partials' bytes
      or less), which merge_kernel folds in order.
    Either way one CTA start-up per group or row instead of per split. It pays only when
    those fewer, longer CTAs fill the GPU without a long tail: their waves at the folding
    tile's CTAs per SM (the one-row tile's fold state costs it one of three) must be
    ``FOLD_MIN_WAVE_FILL`` full on average, the last one counted whole (0.97 waves: 0.97;
    1.14 waves: 0.57; 1.94 waves: 0.97).
    Whole rows need the exact lengths (``exact``; a graph plan sees only bounds and folds by
    groups); ``whole_rows_only``: the whole-row fold or none (beside a long launch that writes
    its rows itself, so the step needs no merge at all). The folding tile must fit ``smem_limit``
    (the device's shared memory per CTA). ``CUPY_FA_FOLD_SPLITS``: ``auto`` (default), ``1``
    (whenever the tile can), ``0`` (never). The choice depends on the batch; the results do not."""
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
    return by_group if not whole_rows_only and fills(by_group) else tile


# ---- one step's schedule -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
    """One attention launch of a step: a family's tile (the kernel and its schedule:
    splits per CTA, fold), the work items its grid is sized for, its CTAs (:func:`launch_grid`)
    and the most KV splits a request of the class gets (:func:`max_splits`: small-q requests at
    fixed positions every split_size(kv_bytes) keys, longer ones while q_len x splits <= SPLIT_ROW_BUDGET;
    kernels/shared/plan.cu computes each request's own on the device)."""
    tile: object         # an MmaTile, or an Sm90Tile
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
    partial_rows: int | None = None  # host lengths: wanted_partial_rows of the batch (None: device lengths)

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
                  kv_bytes=2, window=0, head_dim_vo=None):
    """The launches, tiles, grids and merge of one step, on a device with ``smem_limit`` bytes of
    shared memory per CTA, ``sm_count`` SMs and target ``arch`` (None: the mma.sync family only).

    With host lengths (``q_lens``, ``kv_lens``) the choice is exact: a launch per class of
    requests present; the small-q CTAs may fold their splits (:func:`fold_tile`) when the step
    has no long request, or fold whole rows beside long requests that run unsplit (no merge).
    With device lengths the host sees only bounds: ``max_q_len`` (required), ``max_kv_len``
    (None: any), the ``capacity`` the grids must cover and ``batch_size``. Up to SMALL_Q_LEN the
    step is small-q only and the fold is by groups, where even the shortest such batch (every
    request max_q_len tokens, one split) fills the GPU; above it both launches are planned
    (either may find no work; no fold). The bits never
    depend on any of it. ``kv_bytes=1``: an fp8 cache's tiles (the small-q class on the mma.sync
    family, the long one on :func:`prefill_tile`'s).

    With a sliding ``window`` (> 0) a request's splits cut only the keys from its key_base on
    (:func:`window_spans`; kernels/shared/plan.cu), and every split count, grid and merge below is that of
    those keys (with device lengths: of :func:`window_span_bound`). ``head_dim_vo``: V's and out's
    head dim where it differs from ``head_dim`` (every tile at that pair)."""
    long_tile = prefill_tile(head_dim, smem_limit, arch, kv_bytes, head_dim_vo)
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
            tile = tile_for(head_dim, int(q.max()) if q.size else 0, group_size, smem_limit, arch, kv_bytes,
                            head_dim_vo)
            if long is None or not merge:  # (one merge reads one partial layout: beside a long launch only a
                # fold that leaves nothing to merge, where the long rows run unsplit: no merge launch at all)
                tile = fold_tile(tile, q, kv, group_size, num_kv_heads, sm_count, smem_limit=smem_limit,
                                 whole_rows_only=long is not None)
            small = launch(tile, work_bound(q, kv, group_size, tile), q, kv)
            merge = merge or needs_merge(tile, q, kv)
        sched = StepSchedule(small, long, merge)
        return dataclasses.replace(sched, partial_rows=wanted_partial_rows(q_lens, kv_lens,
                                                                           plan_constants(*sched.plan_tiles())))
    max_q = int(max_q_len)
    kv_bound = int(max_kv_len) if max_kv_len is not None else 2**31 - 1
    tile = tile_for(head_dim, min(max_q, SMALL_Q_LEN), group_size, smem_limit, arch, kv_bytes, head_dim_vo)
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
    """PlanParams' policy fields (kernels/shared/plan.cu reads them): the small-q requests laid out for
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

# Merge shapes (kernels/shared/merge.cu MergeTraits): (heads per CTA, ways over split groups).
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

