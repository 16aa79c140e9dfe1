// Online softmax in base 2, the one building block every kernel shares.
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

// Natural-log LSE of a finished row; -inf for a row that saw no keys.
__device__ __forceinline__ float natural_lse(float m, float l) {
  return l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

}  // namespace cupy_fa
