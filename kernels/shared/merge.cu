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

// Merge shapes: HEADS_PER_CTA heads of one token per CTA, HEAD_DIM / VEC lanes per
// head (VEC elements each: 4 = 8 bytes, 8 = 16 bytes of a 16-bit row), WAYS ways folding
// groups of splits in parallel. "Wide" (many heads, one way) suits many tokens with few
// splits each, "deep" (one head, several ways) one long request with hundreds of splits;
// the host picks. A wider VEC gives each lane more bytes in flight after the CTA's chain of
// metadata loads (MLA's 512-column rows).
template <int HEAD_DIM, int HEADS_PER_CTA, int WAYS, int MAX_SPLITS, int VEC = 4>
struct MergeTraits {
  static_assert(VEC == 4 || VEC == 8, "a lane holds one or two float4 of a row");
  static constexpr int kVec = VEC;
  static constexpr int kParts = VEC / 4;  // float4 parts of a lane's chunk
  static constexpr int kLanes = HEAD_DIM / VEC;
  static constexpr int kHeadsPerCta = HEADS_PER_CTA;
  static constexpr int kWays = WAYS;
  static constexpr int kThreads = kLanes * HEADS_PER_CTA * WAYS;
  // The fold order is fixed by the split index alone, never by the shape above: each
  // group of kGroup consecutive splits is folded in order, then the groups in order.
  // Whichever variant merges a row, its bits are the same (batch invariance): an
  // element's fold is the same arithmetic whatever VEC.
  static constexpr int kGroup = kMergeGroup;
  static constexpr int kMaxGroups = (MAX_SPLITS + kGroup - 1) / kGroup;
  // A group's partials are loaded kLoadRun at a time, each run's loads all issued before its first
  // fold; a run wholly past the row's splits is skipped (it would fold only identities). 16-byte
  // lanes load half a group a run, so their registers (as many as the 8-byte lanes' whole group)
  // leave the same CTAs an SM.
  static constexpr int kLoadRun = VEC == 8 ? kGroup / 2 : kGroup;
  // CTAs an SM the registers must allow (0: no bound): 16-byte lanes are held to 64 registers,
  // so four CTAs of 256 fit, as the 8-byte lanes' 58 allow
  static constexpr int kMinBlocks = VEC == 8 ? 1024 / kThreads : 0;
  static_assert(kThreads <= 1024, "one CTA");
};

// A lane's VEC packed 16-bit elements of a row, as one 8- or 16-byte load.
template <int VEC> struct MergeChunk;
template <> struct MergeChunk<4> {
  typedef uint2 type;
  static __device__ __forceinline__ u32 word(const uint2& c, int i) { return i == 0 ? c.x : c.y; }
};
template <> struct MergeChunk<8> {
  typedef uint4 type;
  static __device__ __forceinline__ u32 word(const uint4& c, int i) { return i == 0 ? c.x : i == 1 ? c.y : i == 2 ? c.z : c.w; }
};

// Combines the splits of each (token, head) of split requests (each split is the
// state m = its lse2, l = 1, o = its normalised partial). Grid: (token capacity,
// ceil(H_q / HEADS_PER_CTA)); tokens of unsplit requests exit after the wait.
template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks) merge_kernel(const __grid_constant__ MergeParams p) {
  typedef ElemTraits<T> E;
  typedef MergeChunk<Traits::kVec> C;
  constexpr int LANES = Traits::kLanes, HPC = Traits::kHeadsPerCta, WAYS = Traits::kWays, GROUP = Traits::kGroup;
  constexpr int PARTS = Traits::kParts, D4 = LANES * PARTS;  // float4s of a row
  const int token = blockIdx.x;
  const int c = threadIdx.x % LANES, in_cta = (threadIdx.x / LANES) % HPC, way = threadIdx.x / (LANES * HPC);
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
  const typename C::type* partial = reinterpret_cast<const typename C::type*>(p.partial_out);  // VEC elements a lane

  // A way folds groups way, way + WAYS, ...; a group's GROUP loads are all issued
  // before its first fold, so a row pays a few memory latencies, not one per split.
  // A lane's VEC columns are PARTS float4 states, each folded as a 4-lane row's would be.
  MergeState total[PARTS];
#pragma unroll
  for (int i = 0; i < PARTS; ++i) total[i] = MergeState::empty();
  constexpr int kSlots = WAYS > 1 ? Traits::kMaxGroups : 1;  // group states handed to way 0
  __shared__ float4 s_o[kSlots][HPC][D4];
  __shared__ float2 s_ml[kSlots][HPC];  // (m, l): the same in every lane of a head
  if (groups > Traits::kMaxGroups) __trap();  // plan_kernel never exceeds MAX_SPLITS
  for (int grp = way; grp < groups && live; grp += WAYS) {
    // __ldcg, not __ldg: launched programmatically, this kernel was already running while
    // the attention kernel wrote the partials, so they are not read-only for its whole lifetime
    MergeState group_state[PARTS];
#pragma unroll
    for (int i = 0; i < PARTS; ++i) group_state[i] = MergeState::empty();
    if (p.fold_groups) {  // the group's state as the attention kernel left it
      const i64 m_at = group_m_index(prow0 + grp, head, p.num_qo_heads);
      const float4* group_o = reinterpret_cast<const float4*>(p.partial_out);
      const float gm = __ldcg(p.partial_lse + m_at), gl = __ldcg(p.partial_lse + m_at + p.num_qo_heads);
#pragma unroll
      for (int i = 0; i < PARTS; ++i)
        group_state[i] = MergeState{gm, gl, __ldcg(group_o + group_o_index(prow0 + grp, head, p.num_qo_heads, D4) +
                                                  PARTS * c + i)};
    } else {
      constexpr int RUN = Traits::kLoadRun;
#pragma unroll
      for (int r0 = 0; r0 < GROUP; r0 += RUN) {
        if (r0 > 0 && grp * GROUP + r0 >= splits) break;  // (the same for the whole CTA: one token)
        float lse_in[RUN];
        typename C::type packed[RUN];
#pragma unroll
        for (int u = 0; u < RUN; ++u) {
          const int s = grp * GROUP + r0 + u;
          const i64 prow = (prow0 + min(s, splits - 1)) * p.num_qo_heads + head;
          packed[u] = __ldcg(partial + prow * LANES + c);
          lse_in[u] = s < splits ? __ldcg(p.partial_lse + prow) : -INFINITY;  // past the end: the identity
        }
#pragma unroll
        for (int u = 0; u < RUN; ++u) {
#pragma unroll
          for (int i = 0; i < PARTS; ++i) {
            const float2 lo = E::unpack(C::word(packed[u], 2 * i)), hi = E::unpack(C::word(packed[u], 2 * i + 1));
            group_state[i].fold(lse_in[u], 1.f, make_float4(lo.x, lo.y, hi.x, hi.y));
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < PARTS; ++i) {
      if constexpr (WAYS == 1) {
        total[i].fold(group_state[i]);
      } else {
        s_o[grp][in_cta][PARTS * c + i] = group_state[i].o;
        if (c == 0 && i == 0) s_ml[grp][in_cta] = make_float2(group_state[i].m, group_state[i].l);
      }
    }
  }
  if constexpr (WAYS > 1) {  // groups in order, from shared memory
    __syncthreads();
    if (way != 0 || !live) return;
    for (int grp = 0; grp < groups; ++grp) {
      const float2 ml = s_ml[grp][in_cta];
#pragma unroll
      for (int i = 0; i < PARTS; ++i) total[i].fold(ml.x, ml.y, s_o[grp][in_cta][PARTS * c + i]);
    }
  }
  if (!live) return;
  const i64 o_off = ((i64)token * p.num_qo_heads + head) * (4 * D4) + c * (4 * PARTS);
  const MergeState& row = total[0];  // m and l are the same in every part
  if (p.sinks != nullptr) {  // attention sinks: one more term of the row's final sum (softmax.cuh with_sink)
    const SinkedRow sunk = with_sink(row.m, row.l, __ldg(p.sinks + head) * kLog2e);
#pragma unroll
    for (int i = 0; i < PARTS; ++i) {
      const float merged[4] = {total[i].o.x, total[i].o.y, total[i].o.z, total[i].o.w};
      store_scaled4(static_cast<T*>(p.out) + o_off + 4 * i, merged, sunk.inv);
    }
    if (c == 0 && p.lse != nullptr) p.lse[(i64)token * p.num_qo_heads + head] = sunk.lse;
    return;
  }
  const float inv = inverse_sum(row.l);  // NaN stays NaN
#pragma unroll
  for (int i = 0; i < PARTS; ++i) {
    const float merged[4] = {total[i].o.x, total[i].o.y, total[i].o.z, total[i].o.w};
    store_scaled4(static_cast<T*>(p.out) + o_off + 4 * i, merged, inv);
  }
  if (c == 0 && p.lse != nullptr) p.lse[(i64)token * p.num_qo_heads + head] = natural_lse(row.m, row.l);
}

}  // namespace cupy_fa
