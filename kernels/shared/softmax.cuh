// Online softmax in base 2, the one building block every kernel shares: the state of a row,
// how two states merge (FoldStep, MergeState: merge_kernel and the CTAs that fold their splits)
// and how a warp's rows take in one KV tile (OnlineSoftmaxRows).
//
// A row's partial result over some keys is the state (m, l, o):
//   m = an offset at most kLazyRescale below the max of its scores s (already
//       multiplied by softmax_scale * log2(e)); a merge takes the larger m,
//   l = sum over those keys of 2^(s - m),
//   o = sum over those keys of 2^(s - m) * v        (un-normalised)
// Any such m describes the same result; two states over disjoint key sets merge
// exactly by rescaling both to the larger m; a state over no keys is m = -inf,
// l = 0, o = 0 and merges as the identity. lse2 = m + log2(l) is the same
// information in one number.
#pragma once

namespace cupy_fa {

constexpr float kLn2 = 0.6931471805599453f;

// How far (log2 units) a score may pass a row's offset m before m moves: the
// exponentials then stay <= 2^8 (no overflow in fp16/bf16 P or fp32 sums), and
// the accumulators are rescaled on the few tiles that move m, not on every tile.
constexpr float kLazyRescale = 8.f;

// Factor that brings a state with max `m` onto the common max `m_common`.
// -inf states contribute nothing (and never produce inf - inf = NaN).
__device__ __forceinline__ float rescale_factor(float m, float m_common) {
  return m == -INFINITY ? 0.f : exp2f(m - m_common);
}

// Max used as the exponent offset: a row that has seen only masked keys keeps
// m = -inf but offsets by 0, so 2^(-inf - 0) = 0 instead of NaN.
__device__ __forceinline__ float safe_offset(float m) { return m == -INFINITY ? 0.f : m; }

// The tests below are written `!(l <= 0)`, not `l > 0`: the same for every real sum, but a NaN
// sum (a bad request's, status.cuh) passes on as NaN instead of reading as "no keys" (-inf, 0).

// Natural-log LSE of a finished row; -inf for a row that saw no keys.
__device__ __forceinline__ float natural_lse(float m, float l) {
  return !(l <= 0.f) ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// Base-2 LSE of a split's state, as its partial carries it; -inf for a split that saw no key.
__device__ __forceinline__ float split_lse2(float m, float l) { return !(l <= 0.f) ? m + log2f(l) : -INFINITY; }

// 1 / l for a row's output; 0 for a row that saw no keys (its o is 0 too).
__device__ __forceinline__ float inverse_sum(float l) { return !(l <= 0.f) ? 1.f / l : 0.f; }

constexpr float kLog2e = 1.4426950408889634f;

// A finished row with an attention sink (variant.cuh): one more logit, sink2 (base 2), whose value
// is zero, in the softmax's denominator. The row's state (m, l) becomes m' = max(m, sink2),
// l' = l 2^(m - m') + 2^(sink2 - m'); its output is o 2^(m - m') / l' (`inv`, the factor of o) and
// its natural-log LSE (m' + log2 l') ln 2, the sink included. A row that saw no key (m = -inf) gets
// out 0 and LSE = the sink; a sink of -inf changes nothing; a NaN sum (a bad row) stays NaN.
// Applied once, where a row's result is final (the direct out, a fold of the whole row, the merge),
// to the state every path computes alike, so it keeps decode == verify.
struct SinkedRow {
  float inv, lse;
};
__device__ __forceinline__ SinkedRow with_sink(float m, float l, float sink2) {
  const float m_new = fmaxf(m, sink2);
  const float f = rescale_factor(m, m_new);
  const float l_new = __fmaf_rn(l, f, sink2 == -INFINITY ? 0.f : exp2f(sink2 - m_new));
  return SinkedRow{!(l_new <= 0.f) ? f / l_new : 0.f, !(l_new <= 0.f) ? (m_new + log2f(l_new)) * kLn2 : -INFINITY};
}

// Splits are merged in groups of this many consecutive splits, in order, then the groups in
// order: merge_kernel (whatever its shape) and an attention CTA that folds its own splits
// (AttentionParams::fold_splits) take the same steps.
constexpr int kMergeGroup = 8;

// One fold of a state (m_in, l_in, o_in) into a state (m, l, o), split into what is the
// same for every column of a row (computed once per row) and the per-column arithmetic.
// Empty states are the identity and the first real state is taken as is, so a row with
// one real split keeps its partial's bits exactly (also the sign of a zero: 0 * 0 +
// (-0) * 1 would give +0 where the unsplit path writes -0). The arithmetic is pinned
// (__fmaf_rn, __fmul_rn): merge_kernel and the attention kernel both fold and must round
// alike, where the compiler might contract each one differently.
struct FoldStep {
  enum Kind : int { kKeep = 0, kTake = 1, kBlend = 2 };  // input empty / state empty / both real
  float m, l;    // the state's offset and sum after the fold
  float f, f_in;  // kBlend: factors of the state's o and of the input's o
  int kind;

  static __device__ __forceinline__ FoldStep of(float m, float l, float m_in, float l_in) {
    if (m_in == -INFINITY) return FoldStep{m, l, 1.f, 0.f, kKeep};
    if (m == -INFINITY) return FoldStep{m_in, l_in, 0.f, 1.f, kTake};
    const float m_new = fmaxf(m, m_in);
    const float f = rescale_factor(m, m_new), f_in = rescale_factor(m_in, m_new);
    return FoldStep{m_new, __fmaf_rn(l, f, __fmul_rn(l_in, f_in)), f, f_in, kBlend};
  }
  __device__ __forceinline__ float blend(float o, float o_in) const { return __fmaf_rn(o, f, __fmul_rn(o_in, f_in)); }
  __device__ __forceinline__ float4 apply(float4 o, float4 o_in) const {
    if (kind == kKeep) return o;
    if (kind == kTake) return o_in;
    return make_float4(blend(o.x, o_in.x), blend(o.y, o_in.y), blend(o.z, o_in.z), blend(o.w, o_in.w));
  }
};

// The online-softmax state of a row slice: offset m (base 2), sum l, unnormalised o.
// (Trivially constructible, so it can live in shared memory: start from empty().)
struct MergeState {
  float m, l;
  float4 o;

  static __device__ __forceinline__ MergeState empty() {
    return MergeState{-INFINITY, 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
  }

  __device__ __forceinline__ void fold(float m_in, float l_in, float4 o_in) {
    const FoldStep step = FoldStep::of(m, l, m_in, l_in);
    o = step.apply(o, o_in);
    m = step.m;
    l = step.l;
  }
  __device__ __forceinline__ void fold(const MergeState& in) { fold(in.m, in.l, in.o); }
};

// A warp's online-softmax state over the rows its threads hold two each: rows g = lane / 4 and
// g + 8 of its 16-row slice, four lanes (tq = lane % 4) per row, the mma.sync m16n8 accumulator
// layout (wgmma's m64nN accumulators hold each warp's 16 rows the same way). Per row half h
// (row g, then g + 8): o as D_BLOCKS blocks of 8 columns, acc[db][2h] and acc[db][2h + 1] the
// thread's two columns of block db; row_max[h] the offset m (at most kLazyRescale below the row's
// max); row_sum[h] the thread's part of l (the four lanes' parts add up in the epilogue).
template <int D_BLOCKS>
struct OnlineSoftmaxRows {
  float acc[D_BLOCKS][4], row_max[2], row_sum[2];

  // The empty state: every split starts from it.
  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int i = 0; i < D_BLOCKS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // One KV tile's scores s (base 2, masked keys -inf; the same fragment layout, S_BLOCKS blocks
  // of 8 keys) into the state; s becomes P = 2^(s - m), ready for P V. A row keeps its offset m
  // until a score passes it by more than kLazyRescale, so the accumulator rescale (a multiply per
  // element) runs only on the rare tiles where some row of the warp moved its m; the rows that
  // did not multiply by exactly 1 then.
  // ROW_HALVES = 1 (TileTraits::kRowHalves): only rows g; rows g + 8 keep their empty state.
  template <int ROW_HALVES, int S_BLOCKS>
  __device__ __forceinline__ void update(float (&s)[S_BLOCKS][4]) {
#pragma unroll
    for (int h = 0; h < ROW_HALVES; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
      mx = quad_max(mx);
      float correction = 1.f;
      bool moved = false;
      if (mx > row_max[h] + kLazyRescale) {  // also a row's first keys (m = -inf)
        correction = rescale_factor(row_max[h], mx);
        moved = row_max[h] != -INFINITY;  // from -inf the accumulators are still zero
        row_max[h] = mx;
      }
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int db = 0; db < D_BLOCKS; ++db) {
          acc[db][2 * h] *= correction;
          acc[db][2 * h + 1] *= correction;
        }
      }
      const float offset = safe_offset(row_max[h]);
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) {
        s[nb][2 * h] = exp2f(s[nb][2 * h] - offset);
        s[nb][2 * h + 1] = exp2f(s[nb][2 * h + 1] - offset);
        sum += s[nb][2 * h] + s[nb][2 * h + 1];
      }
      row_sum[h] = row_sum[h] * correction + sum;
    }
  }
};

}  // namespace cupy_fa
