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

}  // namespace cupy_fa
