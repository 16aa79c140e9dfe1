// Paged K/V addressing and the cp.async producer: a CTA's K and V tiles from the paged cache
// into shared memory, and Q's row block once.
//
// Cache layout [num_pages, page_size, H_kv, D] (NHD), K and V alike (V's D is D_VO where they differ); key j of request b lives in
// page page_table[b][j / page_size], slot j % page_size (a shift and a mask when page_size is a
// power of two: AttentionParams::page_shift). Each thread copies one 16-byte chunk column
// (`chunk`) of kRows key rows per tile. Page ids are fetched one tile ahead (fetch_pages, into
// registers), so the page-table read (an L2 round trip every tile at page size 1) hides behind
// the previous tile's compute; copies of rows past kv_end zero-fill, so masked keys never carry
// NaN garbage into P V.
//
// Page ids are device metadata the host cannot check: each one fetched is compared with the
// cache's num_pages as it arrives (one unsigned compare and a select per key row, no branch in
// the unrolled loops): one outside the cache is replaced by page 0, so nothing is read outside
// the cache, and the CTA's flag in shared memory is set (one predicated atomic per fetch, at a
// constant address: no register is held across the loop for it); after the barrier that ends a
// split's last tile the CTA writes its rows NaN (split_epilogue.cuh), and it records the request
// when it is done (status.cuh).
//
// Loops run a constant number of times so they unroll: every row's address is ready before the
// first cp.async issues, instead of one dependent page-id load per row in a loop. The page-size
// test is made once per tile, outside the unrolled row loops (the pow2 and general paths are each
// straight-line code): inside them it put a branch between every row's address arithmetic and its
// copies.
#pragma once

#include "shared/common.cuh"
#include "shared/params.cuh"

namespace cupy_fa {

// Copies Q's row block [row0, row0 + BLOCK_M) of packed rows (rows past `rows` zero-filled) into
// sQ (swizzled). It rides in the first cp.async group of the K/V pipeline.
// PAIRS_PERMUTED (over an fp8 cache): each 16-element group of a row is stored in the k order of
// the fp8 K fragments (warp_mma.cuh): chunk 2c + h of the row holds its element pairs 8c + 2t + h,
// t = 0..3 (the even pairs of the group, then the odd ones), copied 4 bytes at a time.
template <typename Traits, typename QT, bool PAIRS_PERMUTED = false>
__device__ __forceinline__ void load_q_block(const AttentionParams& p, QT* sQ, int q_start, int row0, int rows,
                                             int kv_head, int group, FastDiv by_group, int row_in_pass, int chunk) {
  constexpr int D = Traits::kHeadDim, STEP = Traits::kRowStep;
  const QT* q = static_cast<const QT*>(p.q);
#pragma unroll
  for (int i = 0; i < Traits::kPassesM; ++i) {
    const int r = row_in_pass + i * STEP, row = row0 + r;
    if (!Traits::loads_row(row_in_pass, r)) continue;  // past the tile (D = 96, 192 only)
    const bool valid = row < rows;
    const QT* src = q;
    if (valid) {
      const int token = q_start + by_group.div(row), head = kv_head * group + by_group.mod(row);
      src = q + ((i64)token * p.num_qo_heads + head) * D + chunk * 8;
    }
    if constexpr (PAIRS_PERMUTED) {
      // the row's pairs 8c + h, + 2, + 4, + 6 (c = chunk / 2, h = chunk % 2)
      const QT* group_src = valid ? src - chunk * 8 + (chunk >> 1) * 16 + (chunk & 1) * 2 : q;
#pragma unroll
      for (int t = 0; t < 4; ++t) cp_async_4(sQ + swizzled<D>(r, chunk) + 2 * t, group_src + 4 * t, valid);
    } else {
      cp_async_16(sQ + swizzled<D>(r, chunk), src, valid);
    }
  }
}

// Over an fp8 cache with bf16 queries, the S = Q K^T products run in fp16 (warp_mma.cuh): once
// Q's row block has arrived, each row of sQ is rewritten in place as fp16 times 2^e_r
// (shared/common.cuh bf16_chunk_to_fp16); s_row_unscale[r] = 2^-e_r, which the scores are
// multiplied by together with k_scale (a power of two: the product rounds as k_scale alone would).
// Every thread of the CTA calls it, between two barriers; the elements keep their places
// (PAIRS_PERMUTED's order stays).
template <typename Traits>
__device__ __forceinline__ void q_rows_to_fp16(unsigned char* sQ_bytes, float* s_row_unscale, int row_in_pass,
                                               int chunk) {
  constexpr int D = Traits::kHeadDim, CH = Traits::kChunks, STEP = Traits::kRowStep;
  static_assert(Traits::kEvenLoads && CH <= 32 && (CH & (CH - 1)) == 0,
                "a row's chunks are CH consecutive lanes of one warp (fp8 head dims 64, 128, 256)");
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(sQ_bytes);
#pragma unroll
  for (int i = 0; i < Traits::kPassesM; ++i) {
    const int r = row_in_pass + i * STEP;
    uint4* at = reinterpret_cast<uint4*>(sQ + swizzled<D>(r, chunk));
    uint4 v = *at;
    u32 w[4] = {v.x, v.y, v.z, v.w};
    const int e = bf16_chunk_to_fp16<CH>(w);
    *at = make_uint4(w[0], w[1], w[2], w[3]);
    if (chunk == 0) s_row_unscale[r] = pow2(-e);
  }
}

// The K/V producer of one CTA: tiles of BLOCK_N keys from kv_begin, up to kv_end, into the
// pipeline stages of sK and sV.
template <typename Traits, typename KVT>
struct PagedKVProducer {
  static constexpr int D = Traits::kHeadDim, BN = Traits::kBlockN, STEP = Traits::kKVRowStep;
  // V's head dim (Traits::kHeadDimVo): with separate qk / vo head dims V's rows are narrower than
  // K's; a thread copies V's chunk `chunk` of the same rows where V has one (chunk < kVoChunks)
  static constexpr int DV = Traits::kHeadDimVo;
  static constexpr bool kSplitDims = DV != D;
  static constexpr int kRows = Traits::kPassesN;  // key rows this thread copies per tile (at most)
  static constexpr int kPerChunk = 16 / sizeof(KVT);  // elements per 16-byte chunk: 8, or 16 for fp8
  static_assert(sizeof(KVT) == Traits::kKVBytes, "the tile's K/V element size");

  const AttentionParams& p;
  const int* page_row;  // the request's page-table row
  int slot_bytes;       // bytes from one cache slot to the next (of K; of V too where D_VO = D)
  int v_slot_bytes;     // of V (separate qk / vo head dims only)
  // Byte addresses of this thread's 16-byte chunk (of Traits::kKVChunks per row) of the head in
  // cache slot 0; a key's chunk is one 32 x 32 -> 64-bit multiply away (H_kv x D x sizeof(KVT) < 2^31).
  const char* k_chunk;
  const char* v_chunk;
  KVT* sK;
  KVT* sV;
  int kv_begin, kv_end, num_tiles;
  int row_in_pass, chunk;
  int pages[kRows];  // page ids of the next tile to issue (fetch_pages), one tile ahead
  int& bad;          // the CTA's flag (shared): set when a page id fetched was outside the cache

  __device__ __forceinline__ PagedKVProducer(const AttentionParams& p, int request, int kv_head, KVT* sK, KVT* sV,
                                             int kv_begin, int kv_end, int num_tiles, int row_in_pass, int chunk,
                                             int& bad)
      : p(p),
        page_row(p.page_table + (i64)request * p.page_table_stride),
        slot_bytes(p.num_kv_heads * D * (int)sizeof(KVT)),
        v_slot_bytes(p.num_kv_heads * DV * (int)sizeof(KVT)),
        k_chunk(reinterpret_cast<const char*>(static_cast<const KVT*>(p.k_cache) + kv_head * D + chunk * kPerChunk)),
        v_chunk(reinterpret_cast<const char*>(static_cast<const KVT*>(p.v_cache) + kv_head * DV + chunk * kPerChunk)),
        sK(sK),
        sV(sV),
        kv_begin(kv_begin),
        kv_end(kv_end),
        num_tiles(num_tiles),
        row_in_pass(row_in_pass),
        chunk(chunk),
        bad(bad) {}

  template <typename PageOf>
  __device__ __forceinline__ void fetch_rows(int tile, PageOf page_of) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int key = kv_begin + tile * BN + row_in_pass + i * STEP;
      // as fetched: checked where issue_rows uses them, a tile later, so the load stays in flight
      // behind this tile's math (a test here would wait for it at once)
      const bool mine = Traits::loads_kv_row(row_in_pass, row_in_pass + i * STEP);
      pages[i] = (mine && tile < num_tiles && key < kv_end) ? __ldg(page_row + page_of(key)) : 0;
    }
  }

  // Page ids of tile `tile` (0 past the last tile), for the issue() that follows.
  __device__ __forceinline__ void fetch_pages(int tile) {
    if (p.page_shift >= 0) {
      fetch_rows(tile, [&](int key) { return key >> p.page_shift; });
    } else {
      fetch_rows(tile, [&](int key) { return key / p.page_size; });
    }
  }

  template <typename SlotOf>
  __device__ __forceinline__ void issue_rows(int tile, int stage, SlotOf slot_of) {
    KVT* dk = sK + stage * BN * D;
    KVT* dv = sV + stage * BN * DV;
    const unsigned last = static_cast<unsigned>(p.num_pages - 1);
    unsigned highest = 0;  // the largest id fetched, as unsigned (a negative one is huge)
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = row_in_pass + i * STEP, key = kv_begin + tile * BN + r;
      if (!Traits::loads_kv_row(row_in_pass, r)) continue;  // past the tile (D = 96, 192 only)
      const bool valid = key < kv_end;
      const unsigned fetched = static_cast<unsigned>(pages[i]);
      highest = max(highest, fetched);
      const int page = static_cast<int>(min(fetched, last));  // inside the cache, whatever was fetched
      if constexpr (kSplitDims) {
        const int slot = valid ? slot_of(page, key) : 0;  // < 2^31 cache slots
        cp_async_16(dk + swizzled_kv<D, KVT>(r, chunk), k_chunk + (i64)slot * slot_bytes, valid);
        if (chunk < Traits::kVoChunks) cp_async_16(dv + swizzled_kv<DV, KVT>(r, chunk), v_chunk + (i64)slot * v_slot_bytes, valid);
      } else {
        const i64 offset = (i64)(valid ? slot_of(page, key) : 0) * slot_bytes;  // < 2^31 cache slots
        cp_async_16(dk + swizzled_kv<D, KVT>(r, chunk), k_chunk + offset, valid);
        cp_async_16(dv + swizzled_kv<D, KVT>(r, chunk), v_chunk + offset, valid);
      }
    }
    if (highest > last) atomicOr(&bad, 1);  // an atomic: several threads may set it between two barriers
  }

  // The cp.async copies of tile `tile` into stage `stage`, from the page ids fetched for it.
  __device__ __forceinline__ void issue(int tile, int stage) {
    if (p.page_shift >= 0) {
      const int in_page = p.page_size - 1;
      issue_rows(tile, stage, [&](int page, int key) { return (page << p.page_shift) | (key & in_page); });
    } else {
      issue_rows(tile, stage, [&](int page, int key) { return page * p.page_size + key % p.page_size; });
    }
  }
};

}  // namespace cupy_fa
