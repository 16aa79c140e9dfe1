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
//
// fold_split_group is the one fold of split partials: merge_kernel's, and that of an MLA CTA that
// ran every split of its rows (kernels/mla/epilogue.cuh fold_own_rows), so both give the same bits.
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

// The state of group `grp` (kMergeGroup consecutive splits, in order) of one (token, head)'s
// `splits` split partials: rows prow0 + s of partial_out ([rows][heads][4 LANES] in T, lane c4's
// 4 elements) and partial_lse; a split past the last is the identity (-inf). All the group's loads
// are issued before its first fold. __ldcg, not __ldg: the partials are written by the grid before
// (programmatic launch: it was still running) or by this CTA itself.
template <typename T, int LANES>
__device__ __forceinline__ MergeState fold_split_group(const void* partial_out, const float* partial_lse, i64 prow0,
                                                       int grp, int splits, int head, int heads, int c4) {
  typedef ElemTraits<T> E;
  const uint2* partial = reinterpret_cast<const uint2*>(partial_out);  // 4 elements of T per lane
  float lse_in[kMergeGroup];
  uint2 packed[kMergeGroup];
#pragma unroll
  for (int u = 0; u < kMergeGroup; ++u) {
    const int s = grp * kMergeGroup + u;
    const i64 prow = (prow0 + min(s, splits - 1)) * heads + head;
    packed[u] = __ldcg(partial + prow * LANES + c4);
    lse_in[u] = s < splits ? __ldcg(partial_lse + prow) : -INFINITY;  // past the end: the identity
  }
  MergeState state = MergeState::empty();
#pragma unroll
  for (int u = 0; u < kMergeGroup; ++u) {
    const float2 lo = E::unpack(packed[u].x), hi = E::unpack(packed[u].y);
    state.fold(lse_in[u], 1.f, make_float4(lo.x, lo.y, hi.x, hi.y));
  }
  return state;
}

}  // namespace cupy_fa
