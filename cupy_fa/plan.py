"""Per-step metadata: host validation, the device buffers, the plan kernel.

The schedule itself (offsets, row tiles, KV splits) is computed by exactly one
piece of code, ``kernels/plan.cu``, on the device, from ``q_lens`` / ``kv_lens``
copied into buffers allocated once for a capacity. Eager ``plan()`` and a
CUDA-graph replay run that same kernel, so they cannot drift. The host only
derives upper bounds (grid sizes) and validates host-side inputs.

Split policy (kernels/plan.cu; a function of each request alone unless the
batch overflows the partial buffer):

* Small-q requests (``q_len <= SMALL_Q_LEN``: decode, verify, draft extend) are
  cut at the fixed key positions 0, S, 2S, ... with ``S = split_size()``, up to
  ``MAX_SPLITS`` splits (longer requests get longer, equal splits). A query's
  split boundaries then never depend on q_len, kv_len or the batch, so decode
  and verify of the same token give bit-identical outputs (batch invariance).
* Longer requests split only while ``q_len * splits <= SPLIT_ROW_BUDGET``.
* The split-partial buffers hold ``partial_rows(...)`` rows; a batch that would
  need more caps every request at an equal share (the only batch dependence).
"""

import dataclasses
import os

import numpy as np

from . import _build, _params

MAX_SPLITS = _build.MAX_SPLITS
SPLIT_ROW_BUDGET = 128
SMALL_Q_LEN = _build.SMALL_Q_LEN
PARTIAL_WORKSPACE_BYTES = 128 << 20  # split partials: at least this much, at least B x SPLIT_ROW_BUDGET rows


def split_size():
    """S, the keys per split of small-q requests: 512 unless CUPY_FA_SPLIT_SIZE says
    otherwise (tuning; a multiple of 64, the decode tile's keys per KV tile)."""
    keys = int(os.environ.get("CUPY_FA_SPLIT_SIZE", "512"))
    if keys < 64 or keys % 64:
        raise ValueError(f"CUPY_FA_SPLIT_SIZE must be a positive multiple of 64 keys, got {keys}")
    return keys


def partial_rows(max_batch_size, num_qo_heads, head_dim, elem_bytes=2):
    """Rows of the split-partial buffers for a capacity (see the module docstring): one
    row is H_q x (head_dim outputs in q's dtype + one fp32 LSE)."""
    row_bytes = num_qo_heads * (head_dim * elem_bytes + 4)
    return max(max_batch_size * SPLIT_ROW_BUDGET, PARTIAL_WORKSPACE_BYTES // row_bytes)


MASK_NONE, MASK_CAUSAL, MASK_CUSTOM = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Sizes the buffers are allocated for; a plan must fit inside them."""
    max_batch_size: int
    max_num_tokens: int          # sum of q_len over a step
    max_pages_per_request: int   # columns of the page table
    max_mask_bytes: int = 0      # sum of q_len^2 over a step with a custom mask

    def grown_to(self, batch, tokens, pages, mask_bytes):
        """A capacity at least this large and large enough for the request."""
        def grow(have, need):
            return have if need <= have else max(need, 2 * have)
        return Capacity(grow(self.max_batch_size, batch), grow(self.max_num_tokens, tokens),
                        grow(self.max_pages_per_request, pages), grow(self.max_mask_bytes, mask_bytes))

    def fits(self, batch, tokens, pages, mask_bytes):
        return (batch <= self.max_batch_size and tokens <= self.max_num_tokens
                and pages <= self.max_pages_per_request and mask_bytes <= self.max_mask_bytes)


class PlanBuffers:
    """Device buffers for one capacity: the step's inputs (lengths, page table,
    mask), the plan kernel's outputs, and the split-KV workspace."""

    def __init__(self, capacity, num_qo_heads, head_dim, dtype_name):
        import cupy

        from . import _arrays

        _arrays.require_cuda()  # a plain sentence, not CuPy's, where there is no usable device
        self.capacity = capacity
        b = capacity.max_batch_size
        i32 = np.int32
        self.q_lens = cupy.zeros(b, i32)
        self.kv_lens = cupy.zeros(b, i32)
        self.page_table = cupy.zeros((b, max(capacity.max_pages_per_request, 1)), i32)
        self.custom_mask = cupy.zeros(max(capacity.max_mask_bytes, 1), np.uint8)
        self.q_indptr = cupy.zeros(b + 1, i32)
        self.work_indptr = cupy.zeros(b + 1, i32)
        self.partial_indptr = cupy.zeros(b + 1, i32)
        self.mask_indptr = cupy.zeros(b + 1, i32)
        self.num_splits = cupy.zeros(b, i32)
        self.split_keys = cupy.zeros(b, i32)
        self.status = cupy.zeros(1, i32)
        dtype = _arrays.DTYPES[dtype_name]
        rows = partial_rows(b, num_qo_heads, head_dim, dtype.itemsize)
        self.partial_out = cupy.empty((rows, num_qo_heads, head_dim), dtype)  # in q's dtype, like FlashInfer's tmp_v
        self.partial_lse = cupy.empty((rows, num_qo_heads), np.float32)

    def plan_params(self, batch_size, group_size, tile):
        return _params.make(
            "PlanParams", q_lens=self.q_lens.data.ptr, kv_lens=self.kv_lens.data.ptr,
            q_indptr=self.q_indptr.data.ptr, work_indptr=self.work_indptr.data.ptr,
            num_splits=self.num_splits.data.ptr, split_keys=self.split_keys.data.ptr,
            partial_indptr=self.partial_indptr.data.ptr, mask_indptr=self.mask_indptr.data.ptr,
            status=self.status.data.ptr, batch_size=batch_size, group_size=group_size,
            block_m=tile.block_m, block_n=tile.block_n, split_size=split_size(), max_splits=MAX_SPLITS,
            small_q_len=SMALL_Q_LEN, split_row_budget=SPLIT_ROW_BUDGET, splits_per_cta=tile.splits_per_cta,
            fold_splits=int(tile.fold_splits), partial_capacity=self.partial_out.shape[0])


# ---- host-side checks and bounds ----------------------------------------------------


def validate_lengths(q_lens, kv_lens):
    """Contract checks on host lengths: raises naming the argument and request."""
    if q_lens.shape != kv_lens.shape:
        raise ValueError(f"q_lens and kv_lens must have the same length, got {q_lens.shape[0]} and {kv_lens.shape[0]}")
    for name, arr in (("q_lens", q_lens), ("kv_lens", kv_lens)):
        bad = np.flatnonzero(arr < 0)
        if bad.size:
            raise ValueError(f"{name}[{bad[0]}] = {arr[bad[0]]} is negative")
        if arr.size and arr.max() >= 2**31:
            raise ValueError(f"{name} entries must fit in int32")
    bad = np.flatnonzero(q_lens > kv_lens)
    if bad.size:
        b = bad[0]
        raise ValueError(f"q_lens[{b}] = {q_lens[b]} > kv_lens[{b}] = {kv_lens[b]}: kv_len counts the valid keys "
                         f"AFTER this step's K/V were written, so it is at least q_len")


def validate_batch_shapes(batch, kv_entries, page_table_rows):
    """One kv_len and one page-table row per request (q_lens has `batch` entries). The lengths
    are compared first: when q_lens and kv_lens disagree, the batch size itself is in doubt,
    and a message about page-table rows would point at the wrong argument."""
    if kv_entries != batch:
        raise ValueError(f"q_lens and kv_lens differ in length ({batch} and {kv_entries}): "
                         f"give one q_len and one kv_len per request")
    if page_table_rows != batch:
        raise ValueError(f"page_table has {page_table_rows} rows, expected one per request ({batch})")


def validate_page_table_width(columns, kv_lens, q_lens, page_size):
    """Every live request's kv_len fits in `columns` pages of the table."""
    needed = -(-kv_lens // page_size)  # ceil
    live = q_lens > 0
    if live.any() and needed[live].max() > columns:
        b = int(np.flatnonzero(live & (needed > columns))[0])
        raise ValueError(f"page_table has {columns} columns but request {b} needs {needed[b]} pages "
                         f"for kv_len {kv_lens[b]} at page_size {page_size}")
    return needed, live


def validate_page_table(page_table, kv_lens, q_lens, page_size, num_pages):
    """Every live request's table row covers kv_len and names pages of the cache."""
    needed, live = validate_page_table_width(page_table.shape[1], kv_lens, q_lens, page_size)
    read = live[:, None] & (np.arange(page_table.shape[1]) < needed[:, None])  # the entries the kernel reads
    bad = np.argwhere(read & ((page_table < 0) | (page_table >= num_pages)))  # row-major: the first bad entry
    if bad.size:
        b, j = (int(x) for x in bad[0])
        raise ValueError(f"page_table[{b}, {j}] = {page_table[b, j]} is not a page of the cache "
                         f"(0 <= page < num_pages = {num_pages})")


def validate_mask_size(entries, q_lens):
    """A flat custom mask holds each request's q_len x q_len block: sum(q_lens**2) entries."""
    expected = int((np.asarray(q_lens) ** 2).sum())
    if entries != expected:
        raise ValueError(f"custom_mask has {entries} entries, expected sum(q_lens**2) = {expected}")


def max_splits(q_lens, kv_lens):
    """Upper bound on each request's split count under the policy that
    kernels/plan.cu applies (its overflow cap and rounding only lower it).
    The host uses it for grid sizes and to know whether a merge can be needed;
    the schedule itself is only ever computed on the device."""
    q = np.maximum(np.asarray(q_lens), 1)
    splits = -(-np.maximum(np.asarray(kv_lens), 1) // split_size())
    splits = np.where(q > SMALL_Q_LEN, np.minimum(splits, np.maximum(1, SPLIT_ROW_BUDGET // q)), splits)
    return np.maximum(1, np.minimum(splits, MAX_SPLITS))


def row_blocks(q_lens, group_size, tile):
    """Row tiles of each request: its q_len x group_size packed (token, head) rows cut
    into tiles of tile.block_m (kernels/plan.cu counts them the same way)."""
    return -(-(np.asarray(q_lens) * group_size) // tile.block_m)


def needs_merge(tile, q_lens, kv_lens):
    """Whether a row of these lengths can end in partials for merge_kernel: a row of several
    splits, or where CTAs fold their groups of splits (tile.fold_splits), of several groups."""
    q, kv = np.asarray(q_lens), np.asarray(kv_lens)
    live = q > 0
    per_input = tile.splits_per_cta if tile.fold_splits else 1
    merges = bool(np.any(max_splits(q[live], kv[live]) > per_input))
    # merge_kernel finds a folded row's group states by MERGE_GROUP splits each (kernels/
    # attention.cu), the attention kernel leaves one per CTA of splits_per_cta: only CTAs of one
    # group each may precede a merge (fold_tile gives whole rows only to rows that need none)
    if merges and tile.fold_splits and tile.splits_per_cta != _build.MERGE_GROUP:
        raise RuntimeError(f"internal: a merge after CTAs that fold {tile.splits_per_cta} splits each; "
                           f"merge_kernel reads one state per {_build.MERGE_GROUP}")
    return merges


def work_bound(q_lens, kv_lens, group_size, tile):
    """Upper bound on the attention kernel's work items for these host lengths."""
    live = q_lens > 0
    split_groups = -(-max_splits(q_lens[live], kv_lens[live]) // tile.splits_per_cta)
    return int((row_blocks(q_lens[live], group_size, tile) * split_groups).sum())


def capacity_work_bound(capacity, group_size, tile, max_q_len, max_kv_len):
    """Upper bound on work items for any step that fits the capacity with
    q_len <= max_q_len and kv_len <= max_kv_len: the fixed grid of a captured
    graph. CTAs past the real work exit at once, but each still costs a
    launch slot, so the bound is kept tight for decode-like shapes."""
    b, t = capacity.max_batch_size, capacity.max_num_tokens
    max_q_len = max(1, min(max_q_len, t))
    q = np.arange(1, max_q_len + 1)
    splits = max_splits(q, np.full_like(q, max_kv_len))
    per_request = int((row_blocks(q, group_size, tile) * -(-splits // tile.splits_per_cta)).max())
    # whatever kv_len: small-q requests have few row blocks, longer ones few splits
    # (row_blocks x splits <= SPLIT_ROW_BUDGET x group / block_m + splits); and a
    # batch can't hold more than b requests, nor more tokens than t
    small = int(row_blocks(min(max_q_len, SMALL_Q_LEN), group_size, tile)) * MAX_SPLITS
    large = SPLIT_ROW_BUDGET * group_size // tile.block_m + MAX_SPLITS + 1
    loose = b * max(small, large) + int(row_blocks(min(t, b * max_q_len), group_size, tile)) + b
    return min(b * per_request, loose)


FOLD_MIN_WAVE_FILL = 0.75  # fold only when the folding CTAs fill their waves this well (the last one too)
WHOLE_ROW_GROUPS = 2  # a CTA folds a whole row (no merge at all) of at most this many groups


def fold_tile(tile, q_lens, kv_lens, group_size, num_kv_heads, sm_count, exact=True, smem_limit=_build.SMEM_LIMIT):
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
    knob = os.environ.get("CUPY_FA_FOLD_SPLITS", "auto")
    if knob not in ("auto", "0", "1"):
        raise ValueError(f"CUPY_FA_FOLD_SPLITS must be auto, 0 or 1, got {knob!r}")
    live = np.asarray(q_lens) > 0
    by_group = tile.folding(smem_limit=smem_limit)
    if knob == "0" or by_group is None or not live.any():
        return tile
    q, kv = np.asarray(q_lens)[live], np.asarray(kv_lens)[live]

    def fills(folded):  # its CTAs, work_bound's count, fill their waves
        ctas = work_bound(q, kv, group_size, folded) * num_kv_heads
        slots = folded.min_ctas_per_sm * sm_count
        return knob == "1" or ctas >= FOLD_MIN_WAVE_FILL * slots * -(-ctas // slots)

    groups = -(-int(max_splits(q, kv).max()) // _build.MERGE_GROUP)
    if exact and groups <= WHOLE_ROW_GROUPS:
        whole = tile.folding(groups, smem_limit)
        if whole is not None and fills(whole):
            return whole
    return by_group if fills(by_group) else tile


def launch_plan(buffers, batch_size, group_size, tile, stream):
    _build.launch(_build.PLAN_VARIANT, (1,), buffers.plan_params(batch_size, group_size, tile), stream)
