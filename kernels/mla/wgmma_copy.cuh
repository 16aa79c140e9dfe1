// The copies of the MLA seesaw kernel (kernels/mla/wgmma.cu): a 64-row query block once, then the
// paged latent rows of 64-key blocks into two K buffers, by cp.async into the 128-byte swizzled
// layout the wgmma descriptors read (sm90/wgmma.cuh swizzled_offset: 64-column blocks of
// [64 rows][128 bytes], nine a row of 576).
//
// A K buffer is filled in two halves, each by the warpgroup that is the last to read it, as soon as
// it is done with it (kernels/mla/seesaw.cuh): the low half (columns 0 .. 255: V's left half, and
// the first 256 columns of K) by warpgroup 0, the high half (columns 256 .. 575: V's right half
// and the rest of K, the rope part included) by warpgroup 1. Each 64-column block completes its own
// mbarrier (128 arrivals: each thread's cp.async.mbarrier.arrive.noinc), so the warpgroup that
// computes S on the buffer starts on a block as soon as that block is in. Keys past the CTA's range
// are zero-filled (so a masked key's V row is 0, never stale or NaN); a page id outside the cache is
// clamped into it and flags the CTA.
//
// An fp8 (e4m3) cache: the same halves, the same keys a thread, but a half's raw bytes (64 bytes a
// key a column block, half the 16-bit block's size) land in the upper part of the half's own region
// of the K buffer (fill_half_fp8, completing the half's `raw` barrier), and the warpgroup that filled
// it widens them in place into swizzled fp16 blocks (widen_half_fp8), in phases ordered so that
// no raw block is overwritten before all 128 threads have read it; each widened column block then
// completes its `full` barrier as a 16-bit fill does. Shared memory stays that of the 16-bit kernel.
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
constexpr int kLowHalfBlocks = 4;               // a K buffer's low half (fill_half<0>): column blocks 0 .. 3

__device__ __forceinline__ void cp_async_shared(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// The 64 x 576 query block (zero past the request's rows) at q_addr, by the CTA's THREADS = 256
// threads, four a row: thread tid copies chunks tid % 4 + 4 k of row tid / 4 (q_nope's 64 chunks,
// then q_pe's 8), so its row's token, head and source addresses are found once; then each thread's
// copies arrive on q_full.
template <int THREADS, typename QT>
__device__ __forceinline__ void copy_q_block(const MlaParams& p, const Work& w, const FastDiv& by_head,
                                             unsigned q_addr, int tid) {
  static_assert(THREADS == 4 * kBlockRows, "four threads a query row");
  const int r = tid >> 2, c0 = tid & 3, row = w.row0 + r;
  const bool valid = row < w.rows;
  const QT* nope = q_chunk<QT>(p, w, by_head, row, c0, valid);
  const QT* pe = q_chunk<QT>(p, w, by_head, row, kValueDim / 8 + c0, valid);
  // chunk c0 + 4 k sits in column block k / 2 at slot (c0 + 4 (k % 2)) ^ (r % 8) of its row
  const unsigned at[2] = {q_addr + r * 128 + ((c0 ^ (r & 7)) << 4), q_addr + r * 128 + (((c0 + 4) ^ (r & 7)) << 4)};
#pragma unroll
  for (int k = 0; k < kValueDim / 32; ++k) {
    cp_async_shared(at[k & 1] + (k >> 1) * kColumnBlockBytes, nope + 32 * k, valid);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) cp_async_shared(at[k] + (kValueDim / 64) * kColumnBlockBytes, pe + 32 * k, valid);
}

// bf16 queries over an fp8 cache (the products then run in fp16, shared/common.cuh): the query block
// at q_addr, once it has arrived, rewritten in place as fp16 times 2^e_r per row, by the same 256
// threads and chunks as copy_q_block (18 chunks a thread, four threads a row: their largest |q| first,
// agreed by shuffles, then the rewrite); row_scale[r] = 2^-e_r (floats at row_scale + 4 r).
__device__ __forceinline__ void q_block_to_fp16(unsigned q_addr, unsigned row_scale, int tid) {
  constexpr int kChunks = kLatentDim / 32;  // a thread's: 18
  const int r = tid >> 2, c0 = tid & 3;
  const unsigned at[2] = {q_addr + r * 128 + ((c0 ^ (r & 7)) << 4), q_addr + r * 128 + (((c0 + 4) ^ (r & 7)) << 4)};
  u32 x[4];
  float m = 0.f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    ld_shared_v4(at[k & 1] + (k >> 1) * kColumnBlockBytes, x);
    m = fmaxf(m, bf16_chunk_absmax(x));
  }
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  const int e = fp16_row_exponent(m);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const unsigned a = at[k & 1] + (k >> 1) * kColumnBlockBytes;
    ld_shared_v4(a, x);
    bf16_chunk_scaled_fp16(x, e);
    st_shared_v4(a, x);
  }
  if (c0 == 0) asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(row_scale + 4 * r), "f"(pow2(-e)) : "memory");
}

// The page ids of one thread's four keys of key block `block` (keys kv_begin + 64 block + wtid / 8
// + 16 j; 0 past the CTA's range), loaded a product ahead of the fill that takes them (fill_half), so
// the loads' latency passes under that product instead of between two.
struct KeyPages {
  unsigned page[kBlockRows / 16];
};

// key j (0 .. 3) of thread wtid in key block `block`: the one lookup_keys and fill_half both mean
__device__ __forceinline__ int block_key(const Work& w, int block, int wtid, int j) {
  return w.kv_begin + block * kBlockRows + (wtid >> 3) + 16 * j;
}

// The page index and the row within its page of a thread's four keys key0 + 16 j (work.cuh
// page_index_of for each), with one test of the page size's kind for the four (what a caller does
// not use, the compiler drops).
__device__ __forceinline__ void key_places(const MlaParams& p, int key0, int (&index)[kBlockRows / 16],
                                           int (&in_page)[kBlockRows / 16]) {
  if (p.page_shift >= 0) {
#pragma unroll
    for (int j = 0; j < kBlockRows / 16; ++j) {
      index[j] = (key0 + 16 * j) >> p.page_shift;
      in_page[j] = (key0 + 16 * j) & (p.page_size - 1);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kBlockRows / 16; ++j) {
      index[j] = (key0 + 16 * j) / p.page_size;
      in_page[j] = (key0 + 16 * j) % p.page_size;
    }
  }
}

__device__ __forceinline__ KeyPages lookup_keys(const MlaParams& p, const Work& w, int block, int wtid) {
  const int* page_row = p.page_table + (i64)w.request * p.page_table_stride;
  const int key0 = block_key(w, block, wtid, 0);
  int index[kBlockRows / 16], in_page[kBlockRows / 16];
  key_places(p, key0, index, in_page);
  KeyPages k;
#pragma unroll
  for (int j = 0; j < kBlockRows / 16; ++j) {
    unsigned page = 0u;
    if (key0 + 16 * j < w.kv_end) page = static_cast<unsigned>(__ldg(page_row + index[j]));
    k.page[j] = page;
  }
  return k;
}

// The source addresses of a thread's four keys of key block `block` (lookup_keys' pages), each at
// byte `offset` of its cache row of ROW_BYTES, and whether each key is in the CTA's range; true when a
// valid key's page id is outside the cache (it is clamped into it). A key past the range has page 0
// (lookup_keys) and copies nothing (src-size 0): no select; the slot (a cache row) fits 32 bits, its
// byte offset is one 32 x 32 -> 64-bit multiply-add.
template <int ROW_BYTES>
__device__ __forceinline__ bool key_sources(const MlaParams& p, const Work& w, const KeyPages& pages, int block, int wtid,
                                            int offset, const char* (&src)[kBlockRows / 16],
                                            bool (&valid)[kBlockRows / 16]) {
  constexpr int KEYS = kBlockRows / 16;
  const int key0 = block_key(w, block, wtid, 0);
  int index[KEYS], in_page[KEYS];
  key_places(p, key0, index, in_page);
  const char* thread_src = static_cast<const char*>(p.cache) + offset;
  const unsigned last_page = static_cast<unsigned>(p.num_pages - 1);
  bool out = false;
#pragma unroll
  for (int j = 0; j < KEYS; ++j) {
    valid[j] = key0 + 16 * j < w.kv_end;
    out |= valid[j] && pages.page[j] > last_page;
    const unsigned slot = min(pages.page[j], last_page) * static_cast<unsigned>(p.page_size) + in_page[j];
    src[j] = thread_src + static_cast<unsigned long long>(slot) * ROW_BYTES;
  }
  return out;
}

// One half of key block `block` (keys kv_begin + 64 block ..) into the K buffer at buf_addr, by the
// 128 threads of one warpgroup (wtid its thread), from the page ids `pages` (lookup_keys of the same
// block): HALF 0 the column blocks 0 .. 3 (V's left half and K's first 256 columns), HALF 1 the
// column blocks 4 .. 8 (V's right half, the rest of K, the rope part). A thread copies the same four
// keys in every column block (keys wtid / 8 + 16 j, chunk wtid % 8 of the block: eight threads a
// 128-byte row segment), column block by column block, each thread's copies of block c arriving on
// the buffer's barrier c (`full` + 8 c) once they are done. A page id outside the cache is clamped
// into it and flags the CTA.
template <int HALF>
__device__ __forceinline__ void fill_half(const MlaParams& p, const Work& w, const KeyPages& pages, unsigned buf_addr,
                                          int block, unsigned full, int wtid, int* flag) {
  constexpr int KEYS = kBlockRows / 16;
  constexpr int FIRST = HALF == 0 ? 0 : kLowHalfBlocks, LAST = HALF == 0 ? kLowHalfBlocks : kLatentBlocks;  // column blocks
  const int key_in0 = wtid >> 3, chunk = wtid & 7;
  const char* src[KEYS];
  bool valid[KEYS];
  const bool out = key_sources<2 * kLatentDim>(p, w, pages, block, wtid, chunk * 16, src, valid);
  const unsigned dst0 = buf_addr + sm90::swizzled_offset<kBlockRows>(key_in0, chunk);
#pragma unroll
  for (int c = FIRST; c < LAST; ++c) {
#pragma unroll
    for (int j = 0; j < KEYS; ++j) {
      // swizzled_offset<kBlockRows>(key_in0 + 16 j, 8 c + chunk) = dst0 + c * kColumnBlockBytes + j * 16 * 128:
      // (key_in0 + 16 j) % 8 == key_in0 % 8 and (8 c + chunk) % 8 == chunk, so the swizzle is the thread's own
      cp_async_shared(dst0 + (c * kColumnBlockBytes + j * 16 * 128), src[j] + c * 128, valid[j]);
    }
    mbar::cp_async_arrive_noinc(full + 8 * c);
  }
  if (out) *flag = 1;
}

// ---- an fp8 cache ----------------------------------------------------------------
//
// A half of n column blocks (n = 4 low, 5 high) spans [0, n) in units of 8 KB from its first column
// block; its raw block j (64 keys x 64 bytes, row-major) sits at n / 2 + j / 2 in those units, the
// upper half of the region, and widens into column block j at [j, j + 1).
template <int HALF>
struct Fp8Half {
  static constexpr int kFirst = HALF == 0 ? 0 : kLowHalfBlocks;
  static constexpr int kLast = HALF == 0 ? kLowHalfBlocks : kLatentBlocks;
  static constexpr int kBlocks = kLast - kFirst;
  static constexpr int kRawBlockBytes = kBlockRows * 64;
  // raw block j of the half whose first column block is at region (a K buffer + kFirst x 8 KB)
  static __device__ __forceinline__ unsigned raw(unsigned region, int j) {
    return region + (kBlocks + j) * kRawBlockBytes;
  }
};

// fill_half for an fp8 cache: the half's raw bytes. A thread copies, for its four keys (the same
// keys as a 16-bit fill: lookup_keys), 16-byte chunks wtid % 8 of pairs of raw blocks (chunk k of a
// pair: block 2 t + k / 4, chunk k % 4 of its 64-byte row segment); each thread's copies arrive on
// the half's raw barrier once they are done. A page id outside the cache is clamped and flags the CTA.
template <int HALF>
__device__ __forceinline__ void fill_half_fp8(const MlaParams& p, const Work& w, const KeyPages& pages, unsigned buf_addr,
                                              int block, unsigned raw_full, int wtid, int* flag) {
  using H = Fp8Half<HALF>;
  constexpr int KEYS = kBlockRows / 16;
  const int key_in0 = wtid >> 3, k = wtid & 7;
  const char* src[KEYS];
  bool valid[KEYS];
  // chunk k of a pair of raw blocks: block j = 2 t + k / 4 (column block kFirst + j), bytes 16 (k % 4)
  const bool out = key_sources<kLatentDim>(p, w, pages, block, wtid, (H::kFirst + (k >> 2)) * 64 + (k & 3) * 16, src, valid);
  const unsigned region = buf_addr + H::kFirst * kColumnBlockBytes;
  const unsigned dst0 = H::raw(region, k >> 2) + key_in0 * 64 + (k & 3) * 16;
#pragma unroll
  for (int t = 0; 2 * t < H::kBlocks; ++t) {
    if (2 * t + (k >> 2) < H::kBlocks) {  // (a high half's fifth block: the first four threads of eight)
#pragma unroll
      for (int j = 0; j < KEYS; ++j) {
        cp_async_shared(dst0 + (2 * t * H::kRawBlockBytes + j * 16 * 64), src[j] + 2 * t * 64, valid[j]);
      }
    }
  }
  mbar::cp_async_arrive_noinc(raw_full);
  if (out) *flag = 1;
}

// Thread wtid's two 16-byte chunks of a raw block (chunks wtid and wtid + 128 of its 256: key c / 4,
// bytes 16 (c % 4)): raw e4m3 bytes in 8 registers.
__device__ __forceinline__ void raw_load(unsigned raw_block, int wtid, u32 (&x)[2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = wtid + 128 * h;
    ld_shared_v4(raw_block + (c >> 2) * 64 + (c & 3) * 16, x[h]);
  }
}
// ... widened to fp16 (exact) into the swizzled 16-bit column block at `column_block`: chunk c's 16
// values are 16-byte chunks 2 (c % 4) and 2 (c % 4) + 1 of row c / 4.
__device__ __forceinline__ void widen_store(unsigned column_block, int wtid, const u32 (&x)[2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = wtid + 128 * h, key = c >> 2, chunk = 2 * (c & 3);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      u32 wide[4];
      widen4<__half>(x[h][2 * e], *reinterpret_cast<u32(*)[2]>(&wide[0]));
      widen4<__half>(x[h][2 * e + 1], *reinterpret_cast<u32(*)[2]>(&wide[2]));
      st_shared_v4(column_block + sm90::swizzled_offset<kBlockRows>(key, chunk + e), wide);
    }
  }
}

// The fp8 half HALF of the K buffer at buf_addr widened in place (its raw barrier waited at
// `parity` first), by the 128 threads of the warpgroup that filled it (named barrier `bar`); each
// column block's barrier (`full` + 8 c) completes once all 128 threads have written it and fenced
// their writes for the tensor cores. In units of 8 KB from the half's start (n column blocks), raw
// block j is [n/2 + j/2, n/2 + (j + 1)/2) and column block j is [j, j + 1), so a column block is
// written only after every raw block under it has been read by all 128 threads:
//   blocks 0 and 1 (no raw block below 2)                                     | sync
//   raw 2 and 3 into registers; block 2 (over raw 0 and 1)                    | sync
//   block 3 (over raw 1 .. 3); n = 5: raw 4 into registers                    | sync; block 4 (over raw 3, 4)
template <int HALF>
__device__ __forceinline__ void widen_half_fp8(unsigned buf_addr, unsigned raw_full, int parity, unsigned full, int wtid,
                                               int bar) {
  using H = Fp8Half<HALF>;
  static_assert(H::kBlocks == 4 || H::kBlocks == 5, "a half of 4 or 5 column blocks");
  const unsigned region = buf_addr + H::kFirst * kColumnBlockBytes;
  mbar::wait(raw_full, parity);
  u32 x[2][4], y[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    raw_load(H::raw(region, j), wtid, x);
    widen_store(region + j * kColumnBlockBytes, wtid, x);
  }
  sm90::fence_async_shared();
  mbar::arrive(full + 8 * H::kFirst);
  mbar::arrive(full + 8 * (H::kFirst + 1));
  sm90::named_sync(bar, 128);
  raw_load(H::raw(region, 2), wtid, x);
  raw_load(H::raw(region, 3), wtid, y);
  widen_store(region + 2 * kColumnBlockBytes, wtid, x);
  sm90::fence_async_shared();
  mbar::arrive(full + 8 * (H::kFirst + 2));
  sm90::named_sync(bar, 128);
  widen_store(region + 3 * kColumnBlockBytes, wtid, y);
  if constexpr (H::kBlocks == 5) raw_load(H::raw(region, 4), wtid, x);
  sm90::fence_async_shared();
  mbar::arrive(full + 8 * (H::kFirst + 3));
  if constexpr (H::kBlocks == 5) {
    sm90::named_sync(bar, 128);
    widen_store(region + 4 * kColumnBlockBytes, wtid, x);
    sm90::fence_async_shared();
    mbar::arrive(full + 8 * (H::kFirst + 4));
  }
}

}  // namespace mla
}  // namespace cupy_fa
