// PagedLatentCache.append: writes a step's new latent rows (c_kv [T, 512] and k_pe [T, 64], each
// with its own token stride) into the cache rows of their slots (slot = page x page_size + offset):
// 16-byte copies into a 16-bit cache, or (an fp8 cache) each element quantised to e4m3(x / scale)
// (common.cuh quantize8: round to nearest even, saturating at +-448, NaN kept), 8 elements
// per item. Negative slots are skipped (a CUDA-graph bucket's padding); slots past the cache are
// skipped too and the first such token recorded in the cache's status word (status.cuh).
#include "shared/common.cuh"
#include "mla/params.cuh"

namespace cupy_fa {
namespace mla {

template <typename Index, typename InT, bool FP8>
__global__ void __launch_bounds__(256) latent_append_kernel(const __grid_constant__ MlaAppendParams p) {
  constexpr int CH = kLatentDim / 8, CKV_CH = kValueDim / 8;  // 16-byte input chunks of a row: 72, 64 of c_kv
  const i64 total = (i64)p.num_tokens * CH;
  const Index* slots = static_cast<const Index*>(p.slots);
  const float scale = FP8 ? __ldg(p.scale) : 1.f;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const i64 token = idx / CH;
    const int chunk = static_cast<int>(idx - token * CH);
    const i64 slot = static_cast<i64>(slots[token]);
    if (slot < 0 || slot >= p.num_slots) {
      if (slot >= p.num_slots && chunk == 0) record_bad(p.status, token, kSlotOutOfRange);
      continue;
    }
    const InT* src = chunk < CKV_CH ? static_cast<const InT*>(p.ckv) + token * p.ckv_stride + chunk * 8
                                    : static_cast<const InT*>(p.kpe) + token * p.kpe_stride + (chunk - CKV_CH) * 8;
    const uint4 in = *reinterpret_cast<const uint4*>(src);
    if constexpr (FP8) {
      reinterpret_cast<uint2*>(p.cache)[slot * CH + chunk] = quantize8<InT>(in, scale);  // common.cuh
    } else {
      reinterpret_cast<uint4*>(p.cache)[slot * CH + chunk] = in;
    }
  }
}

}  // namespace mla
}  // namespace cupy_fa
