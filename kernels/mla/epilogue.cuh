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

}  // namespace mla
}  // namespace cupy_fa
