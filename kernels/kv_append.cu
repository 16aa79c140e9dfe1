// Writes this step's new K/V rows into the paged cache at caller-given slots
// (slot = page * page_size + offset). Pure 16-byte copies: the element type
// does not matter, only the slot index type (int32 or int64, as engines hold
// them). Negative slots are skipped (a CUDA-graph bucket pads its token list with
// slot -1); slots past the cache are skipped too, and the first such token is
// recorded in the cache's status word (status.cuh).
#include "common.cuh"
#include "params.cuh"

namespace cupy_fa {

template <typename Index>
__global__ void __launch_bounds__(256) append_kernel(const __grid_constant__ AppendParams p) {
  const i64 total = (i64)p.num_tokens * p.row_chunks;
  const uint4* k_src = static_cast<const uint4*>(p.k_new);
  const uint4* v_src = static_cast<const uint4*>(p.v_new);
  uint4* k_dst = static_cast<uint4*>(p.k_cache);
  uint4* v_dst = static_cast<uint4*>(p.v_cache);
  const Index* slots = static_cast<const Index*>(p.slots);
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const i64 token = idx / p.row_chunks, chunk = idx % p.row_chunks;
    const i64 slot = static_cast<i64>(slots[token]);
    if (slot < 0 || slot >= p.num_slots) {
      if (slot >= p.num_slots && chunk == 0) record_bad(p.status, token, kSlotOutOfRange);
      continue;
    }
    k_dst[slot * p.row_chunks + chunk] = k_src[idx];
    v_dst[slot * p.row_chunks + chunk] = v_src[idx];
  }
}

}  // namespace cupy_fa
