// Writes this step's new K/V rows into the paged cache at caller-given slots
// (slot = page * page_size + offset). Pure 16-byte copies: the element type
// does not matter, only the slot index type (int32 or int64, as engines hold
// them). Negative slots are skipped (a CUDA-graph bucket pads its token list with
// slot -1); slots past the cache are skipped too, and the first such token is
// recorded in the cache's status word (status.cuh).
#include "shared/common.cuh"
#include "shared/params.cuh"

namespace cupy_fa {

// Every (token, 16-byte input chunk) of this step's rows, grid-strided, at its token's slot:
// `store(slot, chunk, idx)` writes chunk `chunk` of the token's K and V rows (input chunk `idx`)
// into the cache row of `slot`. A negative slot is skipped (a graph bucket's padding); a slot
// past the cache is skipped and its token recorded in the status word.
template <typename Index, typename Store>
__device__ __forceinline__ void for_each_slot_chunk(const AppendParams& p, Store store) {
  const i64 total = (i64)p.num_tokens * p.row_chunks;
  const Index* slots = static_cast<const Index*>(p.slots);
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const i64 token = idx / p.row_chunks, chunk = idx % p.row_chunks;
    const i64 slot = static_cast<i64>(slots[token]);
    if (slot < 0 || slot >= p.num_slots) {
      if (slot >= p.num_slots && chunk == 0) record_bad(p.status, token, kSlotOutOfRange);
      continue;
    }
    store(slot, chunk, idx);
  }
}

template <typename Index>
__global__ void __launch_bounds__(256) append_kernel(const __grid_constant__ AppendParams p) {
  const uint4* k_src = static_cast<const uint4*>(p.k_new);
  const uint4* v_src = static_cast<const uint4*>(p.v_new);
  uint4* k_dst = static_cast<uint4*>(p.k_cache);
  uint4* v_dst = static_cast<uint4*>(p.v_cache);
  for_each_slot_chunk<Index>(p, [&](i64 slot, i64 chunk, i64 idx) {
    k_dst[slot * p.row_chunks + chunk] = k_src[idx];
    v_dst[slot * p.row_chunks + chunk] = v_src[idx];
  });
}

// The same for an fp8 (e4m3fn) cache: each element of the new fp16 / bf16 rows is stored as
// e4m3(x / scale) with its KV head's scale (common.cuh e4m3_from_float: round to nearest even,
// saturating at +-448, NaN kept), 8 elements (one 16-byte input chunk) per item, 8 bytes out.
template <typename Index, typename InT>
__global__ void __launch_bounds__(256) append_quantize_kernel(const __grid_constant__ AppendParams p) {
  const uint4* k_src = static_cast<const uint4*>(p.k_new);
  const uint4* v_src = static_cast<const uint4*>(p.v_new);
  uint2* k_dst = static_cast<uint2*>(p.k_cache);
  uint2* v_dst = static_cast<uint2*>(p.v_cache);
  for_each_slot_chunk<Index>(p, [&](i64 slot, i64 chunk, i64 idx) {
    const int head = static_cast<int>(chunk) / p.head_chunks;
    const float ks = __ldg(p.k_scale + head), vs = __ldg(p.v_scale + head);
    k_dst[slot * p.row_chunks + chunk] = quantize8<InT>(k_src[idx], ks);
    v_dst[slot * p.row_chunks + chunk] = quantize8<InT>(v_src[idx], vs);
  });
}

}  // namespace cupy_fa
