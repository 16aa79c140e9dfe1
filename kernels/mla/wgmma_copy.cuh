// The copies of the MLA seesaw kernel (kernels/mla/wgmma.cu): a 64-row query block once, then the
// paged latent rows of 64-key blocks into two K buffers, by cp.async into the 128-byte swizzled
// layout the wgmma descriptors read (sm90/wgmma.cuh swizzled_offset: 64-column blocks of
// [64 rows][128 bytes], nine a row of 576).
//
// A K buffer is filled in two halves, each by the warpgroup that is the last to read it, as soon as
// it is done with it (kernels/mla/seesaw.cuh): the low half (columns 0 .. 255: V's left half, and
// the first 256 columns of K) by warpgroup 0, the high half (columns 256 .. 575: V's right half
// and the rest of K, the rope part included) by warpgroup 1. Each half completes its own mbarrier
// (128 arrivals: each thread's cp.async.mbarrier.arrive.noinc); the warpgroup that computes S on
// the buffer waits for both. Keys past the CTA's range are zero-filled (so a masked key's V row is
// 0, never stale or NaN); a page id outside the cache is clamped into it and flags the CTA.
#pragma once

#include "shared/common.cuh"
#include "shared/pipeline_sync.cuh"
#include "sm90/wgmma.cuh"
#include "mla/params.cuh"
#include "mla/work.cuh"

namespace cupy_fa {
namespace mla {

constexpr int kBlockRows = 64;                  // query rows and keys of a wgmma block
constexpr int kColumnBlockBytes = kBlockRows * 128;  // one 64-column swizzled block
constexpr int kLatentBlocks = kLatentDim / 64;  // 9 column blocks a 576-column tile
constexpr int kTileBytes64 = kLatentBlocks * kColumnBlockBytes;  // a 64 x 576 tile: 73728 bytes

__device__ __forceinline__ void cp_async_shared(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// The 64 x 576 query block (zero past the request's rows) at q_addr, by every thread of the CTA
// (THREADS of them), then each thread's copies arrive on q_full.
template <int THREADS, typename QT>
__device__ __forceinline__ void copy_q_block(const MlaParams& p, const Work& w, const FastDiv& by_head,
                                             unsigned q_addr, int tid) {
  constexpr int CH = kLatentDim / 8;
#pragma unroll 2
  for (int idx = tid; idx < kBlockRows * CH; idx += THREADS) {
    const int r = idx / CH, c = idx - r * CH, row = w.row0 + r;
    const bool valid = row < w.rows;
    cp_async_shared(q_addr + sm90::swizzled_offset<kBlockRows>(r, c), q_chunk<QT>(p, w, by_head, row, c, valid), valid);
  }
}

// One half of key block `block` (keys kv_begin + 64 block ..) into the K buffer at buf_addr, by the
// 128 threads of one warpgroup (wtid its thread): HALF 0 the chunks 0 .. 31 of each row (one key a
// warp per step: 512 contiguous bytes), HALF 1 the chunks 32 .. 71 (chunks 32 .. 63 likewise, then
// the 8 rope chunks, four keys a warp per step). Then each thread's copies arrive on `full`.
template <int HALF>
__device__ __forceinline__ void fill_half(const MlaParams& p, const Work& w, unsigned buf_addr, int block,
                                          unsigned full, int wtid, int* flag) {
  const char* cache = static_cast<const char*>(p.cache);
  const int* page_row = p.page_table + (i64)w.request * p.page_table_stride;
  const int key0 = w.kv_begin + block * kBlockRows;
  constexpr int ROW_BYTES = 2 * kLatentDim;
  bool out = false;
  auto copy = [&](int key_in, int chunk) {
    const int key = key0 + key_in;
    const bool valid = key < w.kv_end;
    const i64 slot = valid ? slot_of(p, page_row, key, out) : 0;
    cp_async_shared(buf_addr + sm90::swizzled_offset<kBlockRows>(key_in, chunk), cache + slot * ROW_BYTES + chunk * 16,
                    valid);
  };
  const int warp = wtid >> 5, lane = wtid & 31;
#pragma unroll 4
  for (int i = 0; i < kBlockRows / 4; ++i) copy(warp + 4 * i, 32 * HALF + lane);
  if constexpr (HALF == 1) {
#pragma unroll
    for (int i = 0; i < kBlockRows * 8 / 128; ++i) copy(16 * i + (wtid >> 3), 64 + (wtid & 7));
  }
  if (out) *flag = 1;
  mbar::cp_async_arrive_noinc(full);
}

}  // namespace mla
}  // namespace cupy_fa
