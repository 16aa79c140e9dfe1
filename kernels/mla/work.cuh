// Which work item a CTA of the MLA family runs, from plan_kernel's metadata (kernels/shared/plan.cu),
// and which keys of it each row may see.
//
// The layout is plan_kernel's with one KV head: request b's query tokens x H heads are packed rows
// (row = token x H + head), cut into row blocks of the tile's BLOCK_M rows; its keys into
// num_splits[b] splits of split_keys[b] keys. A work item is one (row block, split) of one request:
// work_indptr[b] .. work_indptr[b + 1] - 1 (this launch's family's list), split fastest;
// blockIdx.x = item. CTAs past the real work exit (the grids are sized by bounds).
//
// The MLA kernels run one split per CTA (splits_per_cta 1, no fold: the host never plans either
// for them). A request that breaks the contract (refused by plan_kernel, num_splits = -reason, or
// caught here) reads no key and writes its rows NaN (status.cuh).
#pragma once

#include "shared/common.cuh"
#include "mla/params.cuh"

namespace cupy_fa {
namespace mla {

struct Work {
  int request;
  int q_start, q_len, rows;  // the request's first token, its tokens (within q), its packed rows
  int prefix;                // keys before its first query (kv_len - q_len)
  int kv_len;
  int split, splits;
  int row0;                  // the row block's first packed row
  int kv_begin, kv_end;      // keys this CTA reads, [kv_begin, kv_end)
  int mask_from;             // keys from here on may be invisible to some row of the block
  unsigned bad;              // 0, or why the request breaks the contract (status.cuh)
};

// The work item of CTA `cta`; false past the real work. Every thread of the CTA calls it (the
// warp-wide search) and gets the same answer.
template <int BLOCK_M>
__device__ __forceinline__ bool find_work(const MlaParams& p, const FastDiv& by_head, int cta, Work& w) {
  // (the search does not wait for the total: past it, it gives some request and the CTA exits)
  const int total = __ldg(p.work_indptr + p.batch_size);
  w.request = upper_segment(p.work_indptr, p.batch_size, cta);
  if (cta >= total) return false;
  const int b = w.request;
  w.q_start = __ldg(p.q_indptr + b);
  w.q_len = __ldg(p.q_indptr + b + 1) - w.q_start;
  w.kv_len = __ldg(p.kv_lens + b);
  const int planned = __ldg(p.num_splits + b);
  w.bad = planned < 0 ? static_cast<unsigned>(-planned) : 0u;
  if (w.bad == 0 && (i64)w.kv_len > (i64)p.page_table_columns * p.page_size) w.bad = kKvLenAboveTable;
  if (w.bad == 0 && w.q_start + w.q_len > p.num_tokens) w.bad = kRowsBeyondQ;
  if (w.bad == 0 && p.mask_mode == 2 && __ldg(p.mask_indptr + b + 1) > p.mask_entries) w.bad = kMaskTooSmall;
  w.q_len = max(min(w.q_len, p.num_tokens - w.q_start), 0);  // only rows of q are read, of out written
  w.splits = max(planned, 1);
  const int local = cta - __ldg(p.work_indptr + b);
  w.split = local % w.splits;
  w.row0 = (local / w.splits) * BLOCK_M;
  w.rows = w.q_len * p.num_heads;
  w.prefix = w.kv_len - w.q_len;
  const int split_keys = __ldg(p.split_keys + b);
  w.kv_begin = w.split * split_keys;
  w.kv_end = min(w.kv_len, w.kv_begin + split_keys);
  const int first_token = by_head.div(min(w.row0, max(w.rows - 1, 0)));
  const int last_token = by_head.div(max(min(w.row0 + BLOCK_M, w.rows) - 1, 0));
  if (p.mask_mode == 1) w.kv_end = min(w.kv_end, w.prefix + last_token + 1);  // no row sees past its diagonal
  w.mask_from = p.mask_mode == 1 ? min(w.kv_end, w.prefix + first_token + 1)
                : p.mask_mode == 2 ? min(w.kv_end, w.prefix)
                                   : w.kv_end;
  if (w.bad != 0) {
    w.kv_end = w.kv_begin;
    if (threadIdx.x == 0) record_bad(p.status, b, w.bad);
  }
  w.kv_end = max(w.kv_end, w.kv_begin);
  return true;
}

// Whether packed row `row` (of the request, < w.rows) sees key `key` (< w.kv_end), in the plan's
// mask mode: bottom-right causal, or the custom mask among the q_len newest keys (the prefix is
// always visible).
__device__ __forceinline__ bool row_sees(const MlaParams& p, const Work& w, int token, int key) {
  if (p.mask_mode == 1) return key <= w.prefix + token;
  if (p.mask_mode == 2) {
    return key < w.prefix ||
           __ldg(p.custom_mask + __ldg(p.mask_indptr + w.request) + token * w.q_len + (key - w.prefix)) != 0;
  }
  return true;
}

// The source of 16-byte chunk c (0 .. 71: q_nope's 64, then q_pe's 8) of packed row `row` of the
// request's queries; `valid` false (a row past the request's) gives some address, zero-filled by the
// caller's copy.
template <typename QT>
__device__ __forceinline__ const QT* q_chunk(const MlaParams& p, const Work& w, const FastDiv& by_head, int row, int c,
                                             bool valid) {
  const QT* q_nope = static_cast<const QT*>(p.q_nope);
  if (!valid) return q_nope;
  const int token = w.q_start + by_head.div(row), head = by_head.mod(row);
  return c < kValueDim / 8
             ? q_nope + token * p.q_nope_token_stride + head * p.q_nope_head_stride + c * 8
             : static_cast<const QT*>(p.q_pe) + token * p.q_pe_token_stride + head * p.q_pe_head_stride +
                   (c - kValueDim / 8) * 8;
}

// Where key `key` of a request lives: its page table column, the page id there (the request's row
// of the table: page_row), its row in that page. A page id outside the cache is clamped to the last
// page (page_slot) and flagged (page_outside): the caller's rows are then written NaN.
__device__ __forceinline__ int page_index_of(const MlaParams& p, int key) {
  return p.page_shift >= 0 ? (key >> p.page_shift) : key / p.page_size;
}
__device__ __forceinline__ unsigned page_of(const MlaParams& p, const int* page_row, int key) {
  return static_cast<unsigned>(__ldg(page_row + page_index_of(p, key)));
}
__device__ __forceinline__ bool page_outside(const MlaParams& p, unsigned page) {
  return page > static_cast<unsigned>(p.num_pages - 1);
}
__device__ __forceinline__ i64 page_slot(const MlaParams& p, unsigned page, int in_page) {
  return (i64)min(page, static_cast<unsigned>(p.num_pages - 1)) * p.page_size + in_page;
}

// The cache slot of key `key` of the request (the page index found once, for the page id and the row)
__device__ __forceinline__ i64 slot_of(const MlaParams& p, const int* page_row, int key, bool& out_of_range) {
  const int page_index = page_index_of(p, key);
  const int in_page = p.page_shift >= 0 ? (key & (p.page_size - 1)) : key - page_index * p.page_size;
  const unsigned page = static_cast<unsigned>(__ldg(page_row + page_index));
  out_of_range |= page_outside(p, page);
  return page_slot(p, page, in_page);
}

}  // namespace mla
}  // namespace cupy_fa
