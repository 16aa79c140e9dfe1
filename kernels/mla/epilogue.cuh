// The end of an MLA split, both families: a thread's two rows (row halves h = 0, 1: packed rows
// row_h0 and row_h0 + 8 of the request) over NB blocks of 8 output columns from col_base, in the
// accumulator layout every mma / wgmma of the family leaves (element [j][2 h + e]: row h, column
// col_base + 8 j + 2 quad + e), divided by the row's sum and rounded to OT:
//
//   one split     the row of `out` (and its natural-log LSE): final
//   several       the split's partial row (normalised the same way, so a row whose only real split
//                 is merged x 1.0 keeps these bits) and its base-2 LSE, for merge_kernel
//                 (kernels/shared/merge.cu, the layout of kernels/shared/partials.cuh)
//
// A bad CTA (a page id outside the cache, or a request that breaks the contract) writes its rows
// NaN (status.cuh). An fp8 cache's scale joins 1 / sum: out = o x scale / l.
#pragma once

#include "shared/common.cuh"
#include "shared/partials.cuh"
#include "shared/softmax.cuh"
#include "mla/params.cuh"
#include "mla/work.cuh"

namespace cupy_fa {
namespace mla {

template <typename OT, int NB>
__device__ __forceinline__ void store_rows(const MlaParams& p, const Work& w, const FastDiv& by_head,
                                           const float (&o)[NB][4], int row_h0, int col_base, int quad,
                                           const float (&m)[2], const float (&l)[2], bool bad, float v_scale,
                                           bool writes_lse) {
  const float nan = __int_as_float(0x7fc00000);
  const int partial_base = w.splits > 1 ? __ldg(p.partial_indptr + w.request) : 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_h0 + 8 * h;
    if (row >= w.rows) continue;
    const int token = by_head.div(row), head = by_head.mod(row);
    const float inv = bad ? nan : inverse_sum(l[h]) * v_scale;
    OT* dst;
    if (w.splits == 1) {
      const i64 slot = (i64)(w.q_start + token) * p.num_heads + head;
      dst = static_cast<OT*>(p.out) + slot * kValueDim;
      if (writes_lse && quad == 0 && p.lse != nullptr) p.lse[slot] = bad ? nan : natural_lse(m[h], l[h]);
    } else {
      const i64 slot = ((i64)partial_base + (i64)token * w.splits + w.split) * p.num_heads + head;
      dst = static_cast<OT*>(p.partial_out) + slot * kValueDim;
      if (writes_lse && quad == 0) p.partial_lse[slot] = bad ? nan : split_lse2(m[h], l[h]);
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      *reinterpret_cast<u32*>(dst + col_base + 8 * j + 2 * quad) =
          ElemTraits<OT>::pack(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
    }
  }
}

// The split merge by the last CTA of a row block (the seesaw kernel's MERGE_IN_CTA, an experiment;
// the host plans it only for a step of one launch whose rows have at most kMergeInCtaSplits splits,
// and passes p.merge_counters, zero between launches). After its partial rows are stored, each CTA of
// the (request, row block) counts itself in; the one that counts last folds the block's rows from the
// partials (L2, __ldcg) with merge_kernel's own loads and folds (shared/partials.cuh PartialGroup:
// groups of kMergeGroup splits in order, then the groups in order), so out and LSE have the bits
// merge_kernel gives them, and resets the counter. Every thread of the CTA calls it.
constexpr int kMergeInCtaSplits = 2 * kMergeGroup;

template <typename OT, int THREADS, int BLOCK_M>
__device__ __forceinline__ void merge_if_last(const MlaParams& p, const Work& w, const FastDiv& by_head, int tid) {
  __shared__ int s_last;
  int* counter = p.merge_counters + __ldg(p.work_indptr + w.request) + (w.row0 / BLOCK_M) * w.splits;
  if (!counted_last(counter, w.splits, tid, s_last)) return;
  constexpr int LANES = kValueDim / 4;  // a row's float4s, as merge_kernel's lanes
  constexpr int UNROLL = 4;             // (row, lane) items a thread folds at once: their loads in flight together
  const uint2* partial = reinterpret_cast<const uint2*>(p.partial_out);
  const int rows = min(BLOCK_M, w.rows - w.row0), splits = w.splits, groups = (splits + kMergeGroup - 1) / kMergeGroup;
  const i64 base = __ldg(p.partial_indptr + w.request);
  for (int first = tid; first < rows * LANES; first += THREADS * UNROLL) {
    MergeState total[UNROLL];
    int token[UNROLL], head[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int item = min(first + k * THREADS, rows * LANES - 1);
      const int row = w.row0 + item / LANES;
      token[k] = by_head.div(row), head[k] = by_head.mod(row);
      total[k] = MergeState::empty();
    }
    for (int grp = 0; grp < groups; ++grp) {
      PartialGroup<LANES> in[UNROLL];  // merge_kernel's loads and folds (shared/partials.cuh), UNROLL items at once
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const int c4 = min(first + k * THREADS, rows * LANES - 1) % LANES;
        in[k].load(partial, p.partial_lse, base + (i64)token[k] * splits, grp, splits, p.num_heads, head[k], c4);
      }
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) total[k].fold(in[k].template fold<OT>());
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int item = first + k * THREADS;
      if (item >= rows * LANES) continue;
      const int c4 = item % LANES;
      const float merged[4] = {total[k].o.x, total[k].o.y, total[k].o.z, total[k].o.w};
      const i64 slot = (i64)(w.q_start + token[k]) * p.num_heads + head[k];
      store_scaled4(static_cast<OT*>(p.out) + slot * kValueDim + c4 * 4, merged, inverse_sum(total[k].l));  // NaN stays
      if (c4 == 0 && p.lse != nullptr) p.lse[slot] = natural_lse(total[k].m, total[k].l);
    }
  }
}

}  // namespace mla
}  // namespace cupy_fa
