// Which work item a CTA of the sm90 prefill family runs, from plan_kernel's metadata
// (kernels/shared/plan.cu), and which of its key tiles need a mask.
//
// The work layout is the mma.sync family's (kernels/mma_sync/attention.cu): request b owns work items
// work_indptr[b] .. work_indptr[b + 1] - 1, one per (row block of BLOCK_M packed rows,
// split), packed row = token x G + head in group (G = H_q / H_kv); blockIdx.x = item x H_kv +
// KV head. This family runs one split per CTA (plan splits_per_cta = 1, no fold) and takes
// the items in reverse order: under causal masking a request's last row blocks see the most
// keys, so the longest CTAs start first and the short ones fill the tail.
#pragma once

namespace cupy_fa {
namespace sm90 {

struct PrefillWork {
  int b, kv_head;
  int q_start, q_len, rows, row0;  // the request's first token, its query tokens, packed rows; the tile's first row
  int prefix;                      // keys before this step's queries (kv_len - q_len)
  int split, splits;
  int kv_begin, kv_end;            // keys this CTA reads: [kv_begin, kv_end)
  int num_tiles;                   // key tiles of BLOCK_N from kv_begin, processed last to first
  int masked_tiles;                // the first this many tiles processed (the last ones by key) need a mask;
                                   // -1: the request breaks the contract (status.cuh), no tiles, rows NaN
};

// The work item of CTA index `cta` (blockIdx.x). Returns false past the real work (grids are
// sized by a bound). Every thread of the CTA calls it (upper_segment is warp-collective) and gets the
// same answer.
template <int BLOCK_M, int BLOCK_N, bool VARIANTS = false>
__device__ __forceinline__ bool find_work(const AttentionParams& p, const FastDiv& by_group, PrefillWork& w,
                                          int cta) {
  const int total_work = __ldg(p.work_indptr + p.batch_size);
  const int work = total_work - 1 - cta / p.num_kv_heads;  // reverse: see the file comment
  w.kv_head = cta % p.num_kv_heads;
  w.b = upper_segment(p.work_indptr, p.batch_size, max(work, 0));
  if (work < 0) return false;
  if (p.splits_per_cta != 1 || p.fold_splits) __trap();  // the host never plans this family so
  w.q_start = __ldg(p.q_indptr + w.b);
  w.q_len = __ldg(p.q_indptr + w.b + 1) - w.q_start;
  const int kv_len = __ldg(p.kv_lens + w.b);
  // The device metadata's bounds (status.cuh), a few compares per CTA: refused by plan_kernel
  // (num_splits = -reason, one split), a kv_len past the page table's columns, rows past q's, a
  // custom-mask block past the mask. A bad item reads no K/V and writes its rows NaN.
  const int planned_splits = __ldg(p.num_splits + w.b);
  unsigned bad = planned_splits < 0 ? static_cast<unsigned>(-planned_splits) : 0u;
  if (bad == 0 && (i64)kv_len > (i64)p.page_table_columns * p.page_size) bad = kKvLenAboveTable;
  if (bad == 0 && w.q_start + w.q_len > p.num_tokens) bad = kRowsBeyondQ;
  if (bad == 0 && p.mask_mode == 2 && __ldg(p.mask_indptr + w.b + 1) > p.mask_entries) bad = kMaskTooSmall;
  w.q_len = max(min(w.q_len, p.num_tokens - w.q_start), 0);  // only rows of q are read, only rows of out written
  w.splits = max(planned_splits, 1);
  const int local = work - __ldg(p.work_indptr + w.b);
  w.split = local % w.splits;
  w.row0 = (local / w.splits) * BLOCK_M;
  w.rows = w.q_len * by_group.divisor;
  w.prefix = kv_len - w.q_len;
  const int split_keys = __ldg(p.split_keys + w.b);
  w.kv_begin = w.split * split_keys;
  w.kv_end = min(kv_len, (w.split + 1) * split_keys);
  if constexpr (VARIANTS) {  // a window's splits start at the request's key_base (plan.cu)
    const int key_base = __ldg(p.key_base + w.b);
    w.kv_begin += key_base;
    w.kv_end = min(kv_len, key_base + (w.split + 1) * split_keys);
  }
  const int first_token = by_group.div(w.row0);
  if (p.mask_mode == 1) w.kv_end = min(w.kv_end, w.prefix + by_group.div(min(w.row0 + BLOCK_M, w.rows) - 1) + 1);
  if constexpr (VARIANTS) {
    // the tiles before the window of the tile's first row are skipped: whole tiles, so the rest
    // keep their offsets from the split's first key; a split wholly before it reads nothing
    // (its keys need not be whole tiles of this kernel: the hooked tile may hold fewer keys than
    // the plain tile whose multiples the plan cut, prefill_sm90.Sm90Tile.with_variants)
    if (p.window > 0 && w.kv_end > w.kv_begin) {
      const int first = window_first_key(p, w.prefix, first_token);
      if (first >= w.kv_end) w.kv_begin = w.kv_end;
      else if (first > w.kv_begin) w.kv_begin += (first - w.kv_begin) / BLOCK_N * BLOCK_N;
    }
  }
  w.num_tiles = w.kv_end > w.kv_begin ? (w.kv_end - w.kv_begin + BLOCK_N - 1) / BLOCK_N : 0;
  // Keys from mask_from on may be invisible to some row of the tile: the end of the keys, the
  // causal diagonal of the tile's first row, or the custom mask's columns (this step's keys).
  const int mask_from = p.mask_mode == 1   ? min(w.kv_end, w.prefix + first_token + 1)
                        : p.mask_mode == 2 ? min(w.kv_end, w.prefix)
                                           : w.kv_end;
  // tile t (keys kv_begin + t BLOCK_N ..) needs the mask iff its last key reaches mask_from
  const int unmasked = max(0, mask_from - w.kv_begin) / BLOCK_N;
  w.masked_tiles = max(0, w.num_tiles - unmasked);
  if (bad != 0) {
    w.kv_end = w.kv_begin;
    w.num_tiles = 0;
    w.masked_tiles = -1;
    if (threadIdx.x == 0) record_bad(p.status, w.b, bad);
  }
  return true;
}

}  // namespace sm90
}  // namespace cupy_fa
