"""The MLA tiling policy: which kernel, tile, splits and merge a step of multi-head latent attention
runs (the MLA counterpart of :mod:`cupy_fa.schedule`, whose shapes it follows; the kernels are
:mod:`cupy_fa.families.mla`'s).

* **Classes and tiles.** A request is small-q (``q_len <= SMALL_Q_LEN``: decode, verify, draft
  extend, a mixed batch's decode rows) or long (prefill-like extends). Small-q requests take one
  tile per (head count, cache type, target): the seesaw wgmma kernel (16-bit or fp8 caches) at
  ``num_heads >= WGMMA_MIN_HEADS`` on sm_90a (16: a token fills a quarter of a 64-row block), else the
  mma.sync tile (16 rows a row of warps; one row of warps when a request packs at most 16 rows,
  two otherwise, the same arithmetic per row). Long requests take the seesaw kernel on sm_90a,
  else the mma.sync tile with two rows of warps. Where both classes take the
  same tile, the step has one work list.
* **Splits** (``kernels/shared/plan.cu`` applies them on the device): small-q requests split their
  keys at the fixed positions 0, S, 2S, ... (S = split_size(num_heads): 1024 keys at every head count; a
  model constant, so decode and verify of one model cut alike), whatever their q_len or
  batch, so a token's bits are the same in decode and verify; long ones only while q_len x splits <=
  SPLIT_ROW_BUDGET; at most MAX_SPLITS a request (then splits grow past S, and results may depend
  on the batch: a context past MAX_SPLITS x S keys, 131072).
* **The merge**: ``kernels/shared/merge.cu`` at 512 columns, wide (4 heads a CTA at 8 columns a lane: 256
  threads) for many rows, deep (4 ways over a row's groups of splits, 4 columns a lane) for a few.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _memo, schedule as _policy
from ..families.common import is_sm90a
from ..knobs import knobs
from ..families.mla import MAX_MERGE_SPLITS, MERGE_DEEP, MERGE_WIDE, MlaMmaTile, MlaWgmmaTile

SMALL_Q_LEN = 16
SPLIT_SIZE = 1024         # keys a split of a small-q request (split_size(); CUPY_FA_MLA_SPLIT_SIZE sets another)
MAX_SPLITS = MAX_MERGE_SPLITS
SPLIT_ROW_BUDGET = 128
WGMMA_MIN_HEADS = 16      # from 16 heads a decode token fills a quarter of a 64-row block and the
                          # seesaw kernel still beats the mma.sync tile (docs/performance.md);
                          # below, the mma.sync tile (CUPY_FA_MLA_WGMMA_MIN_HEADS: another bound)


def small_q_tile(num_heads, kv_fp8, arch, max_q_len=1):
    """The tile of a step's small-q requests (the longest has ``max_q_len`` tokens)."""
    min_heads = knobs().mla_wgmma_min_heads
    if _wgmma(kv_fp8, arch) and num_heads >= (WGMMA_MIN_HEADS if min_heads is None else min_heads):
        return MlaWgmmaTile(bool(kv_fp8))
    rows = max(int(max_q_len), 1) * num_heads
    return MlaMmaTile(1 if rows <= 16 else 2, kv_fp8)


def long_tile(num_heads, kv_fp8, arch):
    """The tile of requests of more than SMALL_Q_LEN tokens."""
    if _wgmma(kv_fp8, arch):
        return MlaWgmmaTile(bool(kv_fp8))
    return MlaMmaTile(2, kv_fp8)


def _wgmma(kv_fp8, arch):
    """The seesaw kernel applies: sm_90a, a 16-bit cache or an fp8 one (CUPY_FA_MLA_WGMMA=0: never;
    CUPY_FA_MLA_WGMMA_FP8=0: not over fp8)."""
    k = knobs()
    return is_sm90a(arch) and k.mla_wgmma and (not kv_fp8 or k.mla_wgmma_fp8)


def max_splits(q_lens, kv_lens, num_heads):
    """Upper bound on each request's splits under plan.cu's rule (its overflow cap only lowers it):
    cupy_fa.schedule.split_rule with MLA's constants, the ones plan_constants passes the kernel."""
    return _policy.split_rule(q_lens, kv_lens, split_size(num_heads), MAX_SPLITS, SMALL_Q_LEN, SPLIT_ROW_BUDGET)


def split_size(num_heads):
    """Keys a split of a small-q request at ``num_heads`` query heads: CUPY_FA_MLA_SPLIT_SIZE where
    set, else :data:`SPLIT_SIZE` (1024) at every head count. Every split costs its CTA a query block, a
    pipeline start and a partial output the merge reads again, so longer splits are faster where a
    batch fills the GPU; shorter ones give one long request more CTAs. At 1024 keys decode and verify
    at B=64 run faster than at 512 while decode B=1 over 32768 keys (32 CTAs a row block) stays within
    FlashInfer's MLA wrapper (docs/performance.md, "Multi-head latent attention")."""
    chosen = knobs().mla_split_size
    if chosen is not None:
        return chosen
    return SPLIT_SIZE



def work_bound(q_lens, kv_lens, num_heads, tile):
    """Work items (CTAs) of a launch over these host lengths."""
    q, kv = np.asarray(q_lens), np.asarray(kv_lens)
    live = q > 0
    return int((_policy.row_blocks(q[live], num_heads, tile) * max_splits(q[live], kv[live], num_heads)).sum())


def capacity_work_bound(capacity, num_heads, tile, max_q_len, max_kv_len, min_q_len=1):
    """Work items of any step within ``capacity`` whose requests have ``min_q_len .. max_q_len``
    tokens and at most ``max_kv_len`` keys (the fixed grid of a graph-captured step)."""
    b, t = capacity.max_batch_size, capacity.max_num_tokens
    max_q_len = max(1, min(int(max_q_len), t))
    if min_q_len > max_q_len:
        return 0
    q = np.arange(max(1, min_q_len), max_q_len + 1)
    splits = int(max_splits(q, np.full_like(q, max(int(max_kv_len), 1)), num_heads).max())
    per_request = int(_policy.row_blocks(max_q_len, num_heads, tile))
    tokens_bound = int(_policy.row_blocks(min(t, b * max_q_len), num_heads, tile)) + b  # rows of the batch, a block each
    return min(b * per_request, tokens_bound) * splits


@dataclasses.dataclass(frozen=True)
class Launch:
    """One attention launch: its tile, work items (its grid) and the most splits a request gets."""
    tile: object
    work_grid: int
    max_splits: int


@dataclasses.dataclass(frozen=True)
class MlaSchedule:
    """A planned MLA step: the launch of each class (None where the step has none) and the merge."""
    small: Launch | None
    long: Launch | None
    needs_merge: bool    # merge_kernel after the launches
    split_size: int      # keys a split of a small-q request (split_size(num_heads))
    partial_rows: int | None = None  # host lengths: the rows its splits want (cupy_fa.schedule.wanted_partial_rows)

    @property
    def launches(self):
        """The long class's launch first (its CTAs take the longest), then the small-q one."""
        return tuple(x for x in (self.long, self.small) if x is not None)

    @property
    def one_list(self):
        """Both classes on one tile: every request in work_indptr."""
        return self.long is None or self.small is None

    def plan_tiles(self):
        """(tile, long_tile) of the plan kernel's lists: every request on the first launch's tile in
        work_indptr (long_tile None), or the small-q ones there and the longer ones on long_tile."""
        first = (self.small or self.long).tile
        return first, (None if self.one_list else self.long.tile)


def schedule_step(num_heads, kv_fp8, arch, *, q_lens=None, kv_lens=None, max_q_len=None, max_kv_len=None,
                  capacity=None):
    """The launches and merge of a step, from host lengths (exact) or from bounds (device lengths:
    ``max_q_len``, ``max_kv_len`` (None: any), the buffers' ``capacity``)."""
    small_tile_of = lambda longest: small_q_tile(num_heads, kv_fp8, arch, longest)
    big = long_tile(num_heads, kv_fp8, arch)
    if q_lens is not None:
        q, kv = np.asarray(q_lens), np.asarray(kv_lens)
        is_long = q > SMALL_Q_LEN
        small = long = None
        if is_long.any():
            long = Launch(big, work_bound(q[is_long], kv[is_long], num_heads, big),
                          int(max_splits(q[is_long], kv[is_long], num_heads).max()))
        small_q = q[~is_long]
        if not is_long.any() or (small_q > 0).any():
            tile = small_tile_of(int(small_q.max()) if small_q.size else 1)
            live = small_q > 0
            small = Launch(tile, work_bound(small_q, kv[~is_long], num_heads, tile),
                           int(max_splits(small_q[live], kv[~is_long][live], num_heads).max()) if live.any() else 0)
        sched = _merged(small, long, num_heads)
        return dataclasses.replace(sched, partial_rows=_policy.wanted_partial_rows(q, kv, plan_constants(sched)))
    max_q = int(max_q_len)
    kv_bound = int(max_kv_len) if max_kv_len is not None else 2**31 - 1
    tile = small_tile_of(min(max_q, SMALL_Q_LEN))
    small = Launch(tile, capacity_work_bound(capacity, num_heads, tile, min(max_q, SMALL_Q_LEN), kv_bound),
                   int(max_splits([1], [kv_bound], num_heads)[0]))
    long = None
    if max_q > SMALL_Q_LEN:
        long = Launch(big, capacity_work_bound(capacity, num_heads, big, max_q, kv_bound, SMALL_Q_LEN + 1),
                      int(max_splits([SMALL_Q_LEN + 1], [kv_bound], num_heads)[0]))
    return _merged(small, long, num_heads)


def _merged(small, long, num_heads):
    """One launch where both classes take the same tile (one work list), and whether a merge runs."""
    if small is not None and long is not None and small.tile == long.tile:
        small = Launch(small.tile, small.work_grid + long.work_grid, max(small.max_splits, long.max_splits))
        long = None
    merge = any(x is not None and x.max_splits > 1 for x in (small, long))
    return MlaSchedule(small, long, merge, split_size(num_heads))


def plan_constants(schedule):
    """PlanParams' policy fields for plan_kernel: the small-q tile's list in work_indptr and, with a
    long launch, the long tile's in long_work_indptr (else every request in work_indptr)."""
    first, long_tile = schedule.plan_tiles()
    other = long_tile or first
    return dict(block_m=first.block_m, block_n=first.block_n,
                long_q_len=SMALL_Q_LEN + 1 if long_tile is not None else 2**31 - 1,
                long_block_m=other.block_m, long_block_n=other.block_n, split_size=schedule.split_size,
                max_splits=MAX_SPLITS,
                small_q_len=SMALL_Q_LEN, split_row_budget=SPLIT_ROW_BUDGET, splits_per_cta=1, fold_splits=0)


def merge_shape(num_tokens, num_heads):
    """Wide (4 heads a CTA) when the step's rows give every SM work, else deep (4 ways a row)."""
    return MERGE_WIDE if num_tokens * num_heads >= 1024 and num_heads % MERGE_WIDE[0] == 0 else MERGE_DEEP


def merge_grid(num_tokens, num_heads):
    shape = merge_shape(num_tokens, num_heads)
    return shape, (num_tokens, -(-num_heads // shape[0]))


class ScheduleMemo(_memo.Memo):
    """:func:`schedule_step` over host lengths for one instance (``num_heads``, ``kv_fp8``), the last
    schedules kept (cupy_fa._memo.Memo's rule), keyed by exactly what the policy reads of a batch:
    ``q_lens`` and ``ceil(kv_len / split_size)`` per request (every split count derives from that
    quotient and q_len: a long request's row budget keeps its splits at 7 or fewer, where rounding its
    keys up to whole tiles cannot change them; cupy_fa._memo says the same of the MHA policy), with the
    arch. A decode step's lengths change every step while its schedule changes every split_size keys,
    so a step's plan reuses the schedule of the steps before it."""

    def __init__(self, num_heads, kv_fp8):
        super().__init__()
        self.num_heads, self.kv_fp8 = num_heads, kv_fp8
        self._split = None

    def step(self, arch, q_lens, kv_lens):
        if self.knobs_changed():
            self._split = split_size(self.num_heads)  # (a knob)
        split = self._split
        key = (arch, q_lens.dtype.char, q_lens.tobytes(), (-(-kv_lens // split)).tobytes())  # (no overflow)
        found = self.lookup(key)
        if found is not None:
            return found
        return self.keep(key, schedule_step(self.num_heads, self.kv_fp8, arch, q_lens=q_lens, kv_lens=kv_lens))
