// The split merge: folds the KV splits of every (token, head) of split requests into the final
// output and LSE, in the fixed order the batch-invariance contract asks for (softmax.cuh
// kMergeGroup; split_epilogue.cuh). Launched after the attention kernel, programmatically on
// sm_90 (its CTAs start in the attention kernel's last wave and wait there: common.cuh
// wait_for_prior_grid). It reads the split-partial layout of partials.cuh.
#include "shared/common.cuh"
#include "shared/params.cuh"
#include "shared/partials.cuh"
#include "shared/softmax.cuh"

namespace cupy_fa {

// Merge shapes: HEADS_PER_CTA heads of one token per CTA, HEAD_DIM / 4 lanes per
// head (a float4 each), WAYS ways folding groups of splits in parallel. "Wide"
// (many heads, one way) suits many tokens with few splits each, "deep" (one
// head, several ways) one long request with hundreds of splits; the host picks.
template <int HEAD_DIM, int HEADS_PER_CTA, int WAYS, int MAX_SPLITS>
struct MergeTraits {
  static constexpr int kLanes = HEAD_DIM / 4;
  static constexpr int kHeadsPerCta = HEADS_PER_CTA;
  static constexpr int kWays = WAYS;
  static constexpr int kThreads = kLanes * HEADS_PER_CTA * WAYS;
  // The fold order is fixed by the split index alone, never by the shape above: each
  // group of kGroup consecutive splits is folded in order, then the groups in order.
  // Whichever variant merges a row, its bits are the same (batch invariance).
  static constexpr int kGroup = kMergeGroup;
  static constexpr int kMaxGroups = (MAX_SPLITS + kGroup - 1) / kGroup;
  static_assert(kThreads <= 1024, "one CTA");
};

// Combines the splits of each (token, head) of split requests (each split is the
// state m = its lse2, l = 1, o = its normalised partial). Grid: (token capacity,
// ceil(H_q / HEADS_PER_CTA)); tokens of unsplit requests exit after the wait.
template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads) merge_kernel(const __grid_constant__ MergeParams p) {
  typedef ElemTraits<T> E;
  constexpr int LANES = Traits::kLanes, HPC = Traits::kHeadsPerCta, WAYS = Traits::kWays, GROUP = Traits::kGroup;
  const int token = blockIdx.x;
  const int c4 = threadIdx.x % LANES, in_cta = (threadIdx.x / LANES) % HPC, way = threadIdx.x / (LANES * HPC);
  const int head = blockIdx.y * HPC + in_cta;
  // Plan metadata first: plan_kernel finished before the attention kernel began, so this
  // overlaps the attention kernel's last wave when launched programmatically. Every CTA
  // then waits for the attention kernel, so the merge never completes before it.
  const bool real_token = token < __ldg(p.q_indptr + p.batch_size);
  const int b = real_token ? upper_segment(p.q_indptr, p.batch_size, token) : 0;
  const int splits = real_token ? __ldg(p.num_splits + b) : 0;
  const int groups = (splits + GROUP - 1) / GROUP;
  // fold_groups: the attention kernel folded each group itself, so a row with one group is
  // final already, and a row with several left one state per group (group_o_index)
  const int inputs = p.fold_groups ? groups : splits;  // partial rows per (token, head)
  const i64 prow0 = inputs > 1 ? __ldg(p.partial_indptr + b) / (p.fold_groups ? kPartialRowsPerGroupState : 1) +
                                     (i64)(token - __ldg(p.q_indptr + b)) * inputs
                               : 0;  // the first of this token's partial rows, or group-state rows
  wait_for_prior_grid();  // the partials below are the attention kernel's
  if (inputs <= 1) return;
  const bool live = head < p.num_qo_heads;  // the last CTA of a head count HPC does not divide
  const uint2* partial = reinterpret_cast<const uint2*>(p.partial_out);  // 4 elements of T per lane

  // A way folds groups way, way + WAYS, ...; a group's GROUP loads are all issued
  // before its first fold, so a row pays a few memory latencies, not one per split.
  MergeState total = MergeState::empty();
  constexpr int kSlots = WAYS > 1 ? Traits::kMaxGroups : 1;  // group states handed to way 0
  __shared__ float4 s_o[kSlots][HPC][LANES];
  __shared__ float2 s_ml[kSlots][HPC];  // (m, l): the same in every lane of a head
  if (groups > Traits::kMaxGroups) __trap();  // plan_kernel never exceeds MAX_SPLITS
  for (int grp = way; grp < groups && live; grp += WAYS) {
    // __ldcg, not __ldg: launched programmatically, this kernel was already running while
    // the attention kernel wrote the partials, so they are not read-only for its whole lifetime
    MergeState group_state = MergeState::empty();
    if (p.fold_groups) {  // the group's state as the attention kernel left it
      const i64 m_at = group_m_index(prow0 + grp, head, p.num_qo_heads);
      const float4* group_o = reinterpret_cast<const float4*>(p.partial_out);
      group_state = MergeState{__ldcg(p.partial_lse + m_at), __ldcg(p.partial_lse + m_at + p.num_qo_heads),
                               __ldcg(group_o + group_o_index(prow0 + grp, head, p.num_qo_heads, LANES) + c4)};
    } else {
      float lse_in[GROUP];
      uint2 packed[GROUP];
#pragma unroll
      for (int u = 0; u < GROUP; ++u) {
        const int s = grp * GROUP + u;
        const i64 prow = (prow0 + min(s, splits - 1)) * p.num_qo_heads + head;
        packed[u] = __ldcg(partial + prow * LANES + c4);
        lse_in[u] = s < splits ? __ldcg(p.partial_lse + prow) : -INFINITY;  // past the end: the identity
      }
#pragma unroll
      for (int u = 0; u < GROUP; ++u) {
        const float2 lo = E::unpack(packed[u].x), hi = E::unpack(packed[u].y);
        group_state.fold(lse_in[u], 1.f, make_float4(lo.x, lo.y, hi.x, hi.y));
      }
    }
    if constexpr (WAYS == 1) {
      total.fold(group_state);
    } else {
      s_o[grp][in_cta][c4] = group_state.o;
      if (c4 == 0) s_ml[grp][in_cta] = make_float2(group_state.m, group_state.l);
    }
  }
  if constexpr (WAYS > 1) {  // groups in order, from shared memory
    __syncthreads();
    if (way != 0 || !live) return;
    for (int grp = 0; grp < groups; ++grp) {
      const float2 ml = s_ml[grp][in_cta];
      total.fold(ml.x, ml.y, s_o[grp][in_cta][c4]);
    }
  }
  if (!live) return;
  const float merged[4] = {total.o.x, total.o.y, total.o.z, total.o.w};
  const i64 o_off = ((i64)token * p.num_qo_heads + head) * (4 * LANES) + c4 * 4;
  if (p.sinks != nullptr) {  // attention sinks: one more term of the row's final sum (softmax.cuh with_sink)
    const SinkedRow sunk = with_sink(total.m, total.l, __ldg(p.sinks + head) * kLog2e);
    store_scaled4(static_cast<T*>(p.out) + o_off, merged, sunk.inv);
    if (c4 == 0 && p.lse != nullptr) p.lse[(i64)token * p.num_qo_heads + head] = sunk.lse;
    return;
  }
  store_scaled4(static_cast<T*>(p.out) + o_off, merged, inverse_sum(total.l));  // NaN stays NaN
  if (c4 == 0 && p.lse != nullptr) p.lse[(i64)token * p.num_qo_heads + head] = natural_lse(total.m, total.l);
}

}  // namespace cupy_fa
