// cupy_fa.merge_states: two attention states of the same (token, head) rows over disjoint key
// sets (a shared prefix and a request's own suffix, in cascade attention), each given as
// BatchAttention.run returns it, a normalised output and its natural-log LSE, merged into the
// state over the union of the keys:
//
//   lse = log(e^lse_a + e^lse_b),   out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b
//
// by the same fold the split merge runs (softmax.cuh MergeState / FoldStep, merge.cu): a state
// (out, lse) is the base-2 state m = lse x log2(e), l = 1, o = out. So an empty side (lse = -inf)
// is the identity (the other side comes back with its own bits), both empty give out = 0 and
// lse = -inf (a row that saw no key), a NaN on either side gives NaN. Rounded to the output type
// once, as every output is (common.cuh store_scaled4).
//
// A CTA of blockDim.x threads merges rows_per_cta rows per pass, head_dim / 4 threads a row (4
// columns, 8 bytes, each), passes strided over the grid (a row is in one pass only). A pass reads
// all it needs before a barrier and writes after it (a row's lanes may span two warps, and all of
// them read the LSE its lane 0 writes), so out and lse may be out_a / lse_a (or b) themselves:
// in place.
#include "shared/common.cuh"
#include "shared/params.cuh"
#include "shared/softmax.cuh"

namespace cupy_fa {

template <typename T>
__device__ __forceinline__ float4 unpack4(const void* base, i64 at) {
  const uint2 packed = *(reinterpret_cast<const uint2*>(static_cast<const T*>(base) + at));
  const float2 lo = ElemTraits<T>::unpack(packed.x), hi = ElemTraits<T>::unpack(packed.y);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

template <typename T>
__global__ void __launch_bounds__(256) merge_states_kernel(const __grid_constant__ MergeStatesParams p) {
  const int lanes = p.head_dim / 4;
  const int r = threadIdx.x / lanes, c4 = threadIdx.x % lanes;
  const bool mine = r < p.rows_per_cta;  // the threads past the CTA's whole rows idle
  for (i64 first = (i64)blockIdx.x * p.rows_per_cta; first < p.rows; first += (i64)gridDim.x * p.rows_per_cta) {
    const i64 row = first + r;
    const bool live = mine && row < p.rows;
    float lse_a = -INFINITY, lse_b = -INFINITY;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
    const i64 at = row * p.head_dim + c4 * 4;
    if (live) {
      lse_a = p.lse_a[row];
      lse_b = p.lse_b[row];
      a = unpack4<T>(p.out_a, at);
      b = unpack4<T>(p.out_b, at);
    }
    __syncthreads();  // every read of this pass before any write (in place: out is out_a, ...)
    if (live) {
      MergeState state = MergeState::empty();
      state.fold(__fmul_rn(lse_a, kLog2e), 1.f, a);  // the natural-log LSE into the base-2 state
      state.fold(__fmul_rn(lse_b, kLog2e), 1.f, b);
      const float merged[4] = {state.o.x, state.o.y, state.o.z, state.o.w};
      store_scaled4(static_cast<T*>(p.out) + at, merged, inverse_sum(state.l));  // NaN stays NaN
      if (c4 == 0 && p.lse != nullptr) p.lse[row] = natural_lse(state.m, state.l);
    }
  }
}

}  // namespace cupy_fa
