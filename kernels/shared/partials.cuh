// Where split results wait for the merge: the layout of the split-partial buffers
// (AttentionParams::partial_out / partial_lse, MergeParams), shared by the attention kernel's
// split epilogue (split_epilogue.cuh), which writes them, and merge_kernel (merge.cu), which
// reads them. plan_kernel lays out each request's rows (partial_indptr).
//
// * A split partial (row per (request, token, split), [H_q][D] in the output type, and its
//   base-2 LSE per head): request b's rows start at partial_indptr[b]; token t's split s is row
//   partial_indptr[b] + t * splits + s.
// * A group state, where CTAs fold their splits (fold_splits) and a row has several groups of
//   kMergeGroup: fp32 o, m and l, kPartialRowsPerGroupState partial rows each (params.cuh).
#pragma once

#include "shared/common.cuh"
#include "shared/params.cuh"
#include "shared/softmax.cuh"

namespace cupy_fa {

// The state of one group of a row's splits, fp32 as merge_kernel holds it. Group row gr takes
// split-partial rows kPartialRowsPerGroupState gr and the next: o as [H_q][D] fp32 over
// partial_out's two rows of the output type, m and l as partial_lse's two rows. A request's first
// group row is its partial_indptr entry over kPartialRowsPerGroupState.
__device__ __forceinline__ i64 group_o_index(i64 group_row, int head, int heads, int d4) {  // in float4s
  return (group_row * heads + head) * d4;
}
__device__ __forceinline__ i64 group_m_index(i64 group_row, int head, int heads) {  // l: heads further
  return kPartialRowsPerGroupState * group_row * heads + head;
}

// The count that elects a row block's merger, where CTAs merge their splits themselves: every thread
// of the CTA calls it after storing its partials; it returns true in the CTA that counted last of
// `count` (with every other CTA's partials visible to it) and zeroes the counter there for the plan's
// next run. `s_flag` is a shared int the CTA is done with.
__device__ __forceinline__ bool counted_last(int* counter, int count, int tid, int& s_flag) {
  __threadfence();  // each thread's partials, device-wide before the CTA counts
  __syncthreads();
  if (tid == 0) {
    __threadfence();  // (and the counting thread's fence after the barrier, before its atomic)
    const int before = atomicAdd(counter, 1);
    __threadfence();
    s_flag = before == count - 1;
    if (s_flag) *counter = 0;  // every CTA of the block has counted: zero for the next run of this plan
  }
  __syncthreads();
  if (!s_flag) return false;
  __threadfence();  // the other CTAs' partials (each fenced before its count)
  return true;
}

// One group of a row's split partials, as every merger reads and folds it (merge_kernel, and a CTA that
// merges its row block's splits itself): group `grp`'s kMergeGroup splits of the row whose first
// partial row is prow0 (head `head` of `heads`, 4-element lane c4 of the row's LANES), loaded
// first (a split past `splits` reads the last real one's address and counts as empty), then folded in
// split order into a fresh state: the same loads and the same FoldSteps wherever it runs.
template <int LANES>
struct PartialGroup {
  uint2 packed[kMergeGroup];
  float lse[kMergeGroup];

  __device__ __forceinline__ void load(const uint2* partial, const float* partial_lse, i64 prow0, int grp, int splits,
                                       int heads, int head, int c4) {
#pragma unroll
    for (int u = 0; u < kMergeGroup; ++u) {
      const int s = grp * kMergeGroup + u;
      const i64 prow = (prow0 + min(s, splits - 1)) * heads + head;
      // __ldcg, not __ldg: the partials were written by other CTAs of this launch or of the one before
      // (a programmatic merge_kernel runs beside it), so they are not read-only for a kernel's lifetime
      packed[u] = __ldcg(partial + prow * LANES + c4);
      lse[u] = s < splits ? __ldcg(partial_lse + prow) : -INFINITY;  // past the end: the identity
    }
  }

  template <typename T>
  __device__ __forceinline__ MergeState fold() const {
    typedef ElemTraits<T> E;
    MergeState group_state = MergeState::empty();
#pragma unroll
    for (int u = 0; u < kMergeGroup; ++u) {
      const float2 lo = E::unpack(packed[u].x), hi = E::unpack(packed[u].y);
      group_state.fold(lse[u], 1.f, make_float4(lo.x, lo.y, hi.x, hi.y));
    }
    return group_state;
  }
};

}  // namespace cupy_fa
