// TMA (the tensor memory accelerator) for the sm90 prefill family's K / V tiles (Traits::kTmaKV):
// tensor maps of the caches made on the host (cupy_fa/prefill_sm90.py, cuTensorMapEncodeTiled)
// and passed as a second kernel parameter, and the copy of one box into shared memory.
//
// A cache [slots, H_kv, D] (slots = pages x page_size) is a 3-d tensor for the TMA unit: D
// elements innermost, then the KV head (D x 2 bytes apart), then the slot (H_kv x D x 2 bytes
// apart). A box is 64 elements x 1 head x page_size slots: one page's rows of one 64-column block,
// written by the unit in the 128-byte swizzle the wgmma descriptors read (the same layout
// sm90_prefill_load.cuh's cp.async copies write). So a K or V tile of BLOCK_N keys whose pages
// are all whole is BLOCK_N / page_size x D / 64 boxes, issued by a few lanes of one producer
// warp, with no per-row address arithmetic; the stage's `full` barrier counts the tile's bytes
// (expect_tx) besides the producer threads' arrivals, so tiles by TMA and by cp.async share one
// ring and one barrier protocol.
#pragma once

namespace cupy_fa {
namespace sm90 {

// CUtensorMap (cuda.h): 128 opaque bytes, 64-byte aligned.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// The prefill TMA kernel's second parameter (host mirror: cupy_fa/prefill_sm90.py KV_MAPS_DTYPE).
struct KVTensorMaps {
  TensorMap k, v;
  int page_size;         // rows of a box; 0 = no tile goes by TMA (pages that do not tile BLOCK_N: cp.async)
  unsigned issue_lanes;  // the lanes of producer warp 0 that looked up the first key of a page (bit per lane)
};

// Arrive on `bar` and add `bytes` to the transactions its current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// One box of `map` at coordinates (c0, c1, c2), innermost first, into shared address `dst`;
// its bytes complete a transaction of `bar`.
__device__ __forceinline__ void tma_load_3d(const TensorMap* map, unsigned dst, unsigned long long* bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}

}  // namespace sm90
}  // namespace cupy_fa
