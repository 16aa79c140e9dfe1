// The copies of the MLA mma.sync tile (kernels/mla/attention.cu): a row block's queries once, then
// the paged latent rows of each key tile through a STAGES-deep cp.async pipeline, into row-major
// [rows][576] tiles of 16-bit elements with the family's 16-byte chunk swizzle (common.cuh
// swizzled<576>), which ldmatrix reads for S = Q K^T and, the first 512 columns, for O += P V.
//
// A key tile's cache slots are looked up one tile ahead (KeySlots: one thread a key, into a ring
// in shared memory), so the page-table loads hide behind the tile before. A key past the CTA's
// range gets slot -1 and its row is zero-filled (so masked keys carry no NaN into P V). A page id
// outside the cache is clamped into it and flags the CTA (its rows are then written NaN,
// status.cuh). An fp8 cache's tiles land as bytes in a ring of their own and are widened, exactly,
// to the queries' 16-bit type in one shared tile before the products (widen_tile).
#pragma once

#include "shared/common.cuh"
#include "mla/params.cuh"
#include "mla/work.cuh"

namespace cupy_fa {
namespace mla {

constexpr int kChunks16 = kLatentDim / 8;   // 16-byte chunks of a 16-bit latent row: 72
constexpr int kChunks8 = kLatentDim / 16;   // of an e4m3 row: 36

// The queries of packed rows row0 .. row0 + BM - 1 (zero past the request's rows) into sQ.
template <int BM, int THREADS, typename QT>
__device__ __forceinline__ void load_q_rows(const MlaParams& p, const Work& w, const FastDiv& by_head, QT* sQ,
                                            int tid) {
#pragma unroll 1
  for (int idx = tid; idx < BM * kChunks16; idx += THREADS) {
    const int r = idx / kChunks16, c = idx - r * kChunks16, row = w.row0 + r;
    const bool valid = row < w.rows;
    cp_async_16(sQ + swizzled<kLatentDim>(r, c), q_chunk<QT>(p, w, by_head, row, c, valid), valid);
  }
}

// The slots of one key tile, one thread a key: -1 past the CTA's keys; a page id outside the
// cache sets *flag.
template <int BN>
__device__ __forceinline__ void key_slots(const MlaParams& p, const Work& w, int tile_key0, int* slots, int* flag,
                                          int tid) {
  if (tid < BN) {
    const int key = tile_key0 + tid;
    int slot = -1;
    if (key < w.kv_end) {
      bool out = false;
      slot = static_cast<int>(slot_of(p, p.page_table + (i64)w.request * p.page_table_stride, key, out));
      if (out) *flag = 1;
    }
    slots[tid] = slot;
  }
}

// One key tile's latent rows from the cache into `dst`: 16-bit rows straight into the swizzled
// tile, e4m3 rows as bytes, row-major (widen_tile makes them the 16-bit tile).
template <int BN, int THREADS, bool FP8>
__device__ __forceinline__ void copy_tile(const MlaParams& p, const int* slots, void* dst, int tid) {
  constexpr int CH = FP8 ? kChunks8 : kChunks16;
  constexpr int ROW_BYTES = FP8 ? kLatentDim : 2 * kLatentDim;
  const char* cache = static_cast<const char*>(p.cache);
#pragma unroll 4
  for (int idx = tid; idx < BN * CH; idx += THREADS) {
    const int key = idx / CH, c = idx - key * CH;
    const int slot = slots[key];
    const char* src = cache + (i64)max(slot, 0) * ROW_BYTES + c * 16;
    void* to = FP8 ? static_cast<void*>(static_cast<char*>(dst) + key * kLatentDim + c * 16)
                   : static_cast<void*>(static_cast<unsigned short*>(dst) + swizzled<kLatentDim>(key, c));
    cp_async_16(to, src, slot >= 0);
  }
}

// An e4m3 tile (row-major bytes) widened into the swizzled 16-bit tile `dst`.
template <int BN, int THREADS, typename T>
__device__ __forceinline__ void widen_tile(const unsigned char* raw, T* dst, int tid) {
#pragma unroll 2
  for (int idx = tid; idx < BN * kChunks8; idx += THREADS) {
    const int key = idx / kChunks8, c = idx - key * kChunks8;
    const uint4 bytes = *reinterpret_cast<const uint4*>(raw + key * kLatentDim + c * 16);
    const u32 words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
    u32 wide[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      u32 pair[2];
      widen4<T>(words[i], pair);
      wide[2 * i] = pair[0], wide[2 * i + 1] = pair[1];
    }
    *reinterpret_cast<uint4*>(dst + swizzled<kLatentDim>(key, 2 * c)) = make_uint4(wide[0], wide[1], wide[2], wide[3]);
    *reinterpret_cast<uint4*>(dst + swizzled<kLatentDim>(key, 2 * c + 1)) =
        make_uint4(wide[4], wide[5], wide[6], wide[7]);
  }
}

}  // namespace mla
}  // namespace cupy_fa
