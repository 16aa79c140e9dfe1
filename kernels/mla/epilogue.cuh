// The end of an MLA split: where a packed row's values and LSE go (row_slot, row_target, row_lse,
// both families), and the mma.sync tile's store_rows (the seesaw kernel stages its rows first:
// SeesawRole::store_rows): a thread's two rows (row halves h = 0, 1: packed rows
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

// a packed row's slot (row < w.rows): in out and lse for one split, in partial_out and partial_lse for several
__device__ __forceinline__ i64 row_slot(const MlaParams& p, const Work& w, const FastDiv& by_head, int row,
                                        int partial_base) {
  const int token = by_head.div(row), head = by_head.mod(row);
  if (w.splits == 1) return (i64)(w.q_start + token) * p.num_heads + head;
  return ((i64)partial_base + (i64)token * w.splits + w.split) * p.num_heads + head;
}

template <typename OT>
__device__ __forceinline__ OT* row_target(const MlaParams& p, const Work& w, i64 slot) {
  return static_cast<OT*>(w.splits == 1 ? p.out : p.partial_out) + slot * kValueDim;
}

// The targets of packed rows row, row + STEP, row + 2 STEP, ... (one request's rows) without a division
// a row: a packed row is token x heads + head, so its slot (row_slot) moves by STEP with the row, and
// by (splits - 1) x heads more each time the step passes a token's last head (a partial row's token
// is splits x heads rows on; one split's rows are consecutive).
template <typename OT, int STEP>
struct RowWalk {
  OT* dst;    // row_target of the current row
  int head;   // its head
  i64 wrap;   // elements skipped on passing a token's last head
  __device__ __forceinline__ RowWalk(const MlaParams& p, const Work& w, const FastDiv& by_head, int row, int partial_base)
      : dst(row_target<OT>(p, w, row_slot(p, w, by_head, row, partial_base))), head(by_head.mod(row)),
        wrap(w.splits == 1 ? 0 : (i64)(w.splits - 1) * p.num_heads * kValueDim) {}
  __device__ __forceinline__ void step(int num_heads) {
    dst += STEP * kValueDim;
    head += STEP;
    while (head >= num_heads) head -= num_heads, dst += wrap;  // once a step where STEP <= heads
  }
};

// the row's LSE from its offset m and sum l: natural log into lse (when asked) for one split, base 2
// into partial_lse for several
__device__ __forceinline__ void row_lse(const MlaParams& p, const Work& w, i64 slot, float m, float l, bool bad) {
  const float nan = __int_as_float(0x7fc00000);
  if (w.splits == 1) {
    if (p.lse != nullptr) p.lse[slot] = bad ? nan : natural_lse(m, l);
  } else {
    p.partial_lse[slot] = bad ? nan : split_lse2(m, l);
  }
}

__device__ __forceinline__ int partial_base_of(const MlaParams& p, const Work& w) {
  return w.splits > 1 ? __ldg(p.partial_indptr + w.request) : 0;
}

// 1 / l (with an fp8 cache's scale), NaN for a bad CTA's rows
__device__ __forceinline__ float row_inverse(float l, bool bad, float v_scale) {
  return bad ? __int_as_float(0x7fc00000) : inverse_sum(l) * v_scale;
}

// The mma.sync tile's end: each thread stores its values straight from the accumulators.
template <typename OT, int NB>
__device__ __forceinline__ void store_rows(const MlaParams& p, const Work& w, const FastDiv& by_head,
                                           const float (&o)[NB][4], int row_h0, int col_base, int quad,
                                           const float (&m)[2], const float (&l)[2], bool bad, float v_scale,
                                           bool writes_lse) {
  const int partial_base = partial_base_of(p, w);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_h0 + 8 * h;
    if (row >= w.rows) continue;
    const float inv = row_inverse(l[h], bad, v_scale);
    const i64 slot = row_slot(p, w, by_head, row, partial_base);
    if (writes_lse && quad == 0) row_lse(p, w, slot, m[h], l[h], bad);
    OT* dst = row_target<OT>(p, w, slot);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      *reinterpret_cast<u32*>(dst + col_base + 8 * j + 2 * quad) =
          ElemTraits<OT>::pack(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
    }
  }
}

}  // namespace mla
}  // namespace cupy_fa
