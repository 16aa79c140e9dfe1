// The plan kernel's work layout, as an attention CTA reads it (kernels/shared/plan.cu writes it).
//
// For each request b and KV head, the q_len x G query rows that share that KV head (G = H_q /
// H_kv) are packed into rows (row = token * G + head_in_group) and cut into row blocks of the
// tile's BLOCK_M rows; the request's keys are cut into num_splits[b] contiguous splits of
// split_keys[b] keys (a multiple of the tile's BLOCK_N). A work item is one (row block, run of
// splits_per_cta consecutive splits) of one request; work_indptr[b] is request b's first. Any
// kernel family reads the same layout with its own BLOCK_M (PlanParams::block_m): what differs
// between families is only the tile.
//
// One CTA runs one work item for one KV head: blockIdx.x = work item x H_kv + KV head, heads
// fastest, so the H_kv CTAs that read the same key slots (one 16-byte chunk column each of the
// same [page, slot, H_kv, D] rows) run side by side and DRAM sees whole slots. Grids are sized by
// capacity; CTAs past the real work exit after finding so (graph-safe).
#pragma once

#include "shared/common.cuh"
#include "shared/params.cuh"
#include "shared/softmax.cuh"

namespace cupy_fa {

struct WorkItem {
  int request;      // b
  int q_start;      // its first query token (q_indptr[b])
  int q_len, kv_len;  // q_len: its tokens inside q's rows (all of them unless `bad` says otherwise)
  unsigned bad;     // 0, or why the request breaks the contract (status.cuh): the CTA reads no K/V,
                    // writes its rows NaN and records the request at its end
  int splits;       // KV splits of the request
  int groups;       // runs of splits_per_cta splits, so CTAs per row block
  int split_first;  // this CTA runs splits [split_first, split_stop) of its row block
  int split_stop;
  int row0;         // first packed row of its row block
};

// The request of work item `work` (blockIdx.x / H_kv): a warp search over work_indptr. Past the
// real work (work >= work_indptr[batch_size], which the caller tests: its CTA exits) it returns
// some request, harmlessly.
__device__ __forceinline__ int request_of_work(const AttentionParams& p, int work) {
  return upper_segment(p.work_indptr, p.batch_size, work);
}

// Work item `work` of request b. Traits (a family's tile) gives kBlockM, and the host contract
// it checks on the way: whether a CTA may run several splits (kEpilogueInStage) and fold them
// (kFoldInCta). A launch that breaks it traps: the host never sends one (cupy_fa/schedule.py
// builds its tiles from the same rules).
template <typename Traits>
__device__ __forceinline__ WorkItem locate_work(const AttentionParams& p, int work, int b) {
  WorkItem w;
  w.request = b;
  w.q_start = __ldg(p.q_indptr + b);
  w.q_len = __ldg(p.q_indptr + b + 1) - w.q_start;
  w.kv_len = __ldg(p.kv_lens + b);
  const int planned_splits = __ldg(p.num_splits + b);
  // The device metadata's bounds, a few compares per CTA (status.cuh): refused by plan_kernel
  // (num_splits = -reason, one split), a kv_len past the page table's columns, rows past q's,
  // a custom-mask block past the mask.
  w.splits = max(planned_splits, 1);
  w.bad = planned_splits < 0 ? static_cast<unsigned>(-planned_splits) : 0u;
  if (w.bad == 0 && (i64)w.kv_len > (i64)p.page_table_columns * p.page_size) w.bad = kKvLenAboveTable;
  if (w.bad == 0 && w.q_start + w.q_len > p.num_tokens) w.bad = kRowsBeyondQ;
  if (w.bad == 0 && p.mask_mode == 2 && __ldg(p.mask_indptr + b + 1) > p.mask_entries) w.bad = kMaskTooSmall;
  w.q_len = max(min(w.q_len, p.num_tokens - w.q_start), 0);  // only rows of q are read, only rows of out written
  // Each split of the run still ends in its own result (out, a partial for merge_kernel, or a
  // fold of merge_kernel's steps), so how splits are grouped into CTAs never changes a bit.
  const int per_cta = p.splits_per_cta;
  if constexpr (!Traits::kEpilogueInStage) {
    if (per_cta != 1) __trap();  // plan_kernel counted work with it: the host must never send this
  }
  if constexpr (!Traits::kFoldInCta) {
    if (p.fold_splits) __trap();  // no fold state in this tile: the host must never send this
  }
  w.groups = (w.splits + per_cta - 1) / per_cta;
  const int local = work - __ldg(p.work_indptr + b);
  w.split_first = (local % w.groups) * per_cta;
  w.split_stop = min(w.split_first + per_cta, w.splits);
  // A CTA that folds takes merge_kernel's steps: for one group of its splits, or for all of
  // them (then the groups in order too), never for a run of groups that is not the whole row.
  if (p.fold_splits && (per_cta % kMergeGroup != 0 || (w.groups > 1 && per_cta != kMergeGroup))) __trap();
  w.row0 = (local / w.groups) * Traits::kBlockM;
  return w;
}

}  // namespace cupy_fa
