// Hopper (sm_90a) tensor-core building blocks of the prefill family, in inline PTX (no
// CUTLASS): shared-memory matrix descriptors for the swizzled tiles (128- and 64-byte), the wgmma
// fence / commit / wait protocol, register reallocation between warpgroups and named
// barriers. The wgmma instructions themselves are in sm90/wgmma_ops.cuh (generated).
#pragma once

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "cupy_fa: the sm90 prefill family needs the sm_90a target (wgmma, setmaxnreg)"
#endif

#include "shared/pipeline_sync.cuh"
#include "sm90/wgmma_ops.cuh"

namespace cupy_fa {
namespace sm90 {

typedef unsigned long long u64;

template <typename A, typename B> struct SameType { static constexpr bool value = false; };
template <typename A> struct SameType<A, A> { static constexpr bool value = true; };

// ---- the shared-memory tile layout every wgmma operand of the family uses ---------------
//
// A [rows][cols] tile of 16-bit elements is stored as column blocks of SW bytes a row (SW = 128:
// 64 columns, or SW = 64: 32 columns, for head dims that are not whole 64-column blocks: 96),
// each [rows][SW / 2], block after block; inside a block, row r's 16-byte chunk c sits at chunk
// c ^ (r % 8) (SW 128: the 128-byte swizzle, Swizzle<3,4,3>) or c ^ ((r / 2) % 4) (SW 64: the
// 64-byte swizzle, Swizzle<2,4,3>): the chunk's bits XOR the address bits of 128 bytes and up.
// Tiles and blocks start at a multiple of 8 x SW bytes (the swizzle's period; tiles at 1024), so
// the hardware's swizzle of the absolute address is this one.
template <int ROWS, int SW = 128>
__device__ __forceinline__ unsigned swizzled_offset(int row, int chunk) {  // bytes, chunk of 8 elements
  static_assert(SW == 128 || SW == 64, "128- or 64-byte swizzle");
  if constexpr (SW == 128) return (unsigned)((chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
  return (unsigned)((chunk >> 2) * (ROWS * 64) + row * 64 + (((chunk & 3) ^ ((row >> 1) & 3)) << 4));
}

// Matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading and stride
// byte offsets (each >> 4), the layout type in bits 62-63 (1 = 128-byte swizzle, 2 = 64-byte),
// base offset 0 (tiles start on the swizzle's period).
template <int SW = 128>
__device__ __forceinline__ u64 make_desc(unsigned smem_addr, unsigned lead_bytes, unsigned stride_bytes) {
  constexpr u64 kLayout = SW == 128 ? 1ull : 2ull;
  return (u64)((smem_addr & 0x3FFFF) >> 4) | ((u64)(lead_bytes >> 4) << 16) | ((u64)(stride_bytes >> 4) << 32) |
         (kLayout << 62);
}

// A descriptor `bytes` further on (a multiple of 16): the start address is the low field, and
// shared addresses stay below 2^18, so adding to the whole word never carries out of it. The
// main loops build each tile's descriptor once and step it by constants.
__device__ __forceinline__ u64 desc_at(u64 desc, unsigned bytes) { return desc + (bytes >> 4); }
// The same step on the low word alone (the start address field: shared addresses stay below 2^18, so
// it never carries), the high word passed through: one 32-bit add where ptxas keeps the high word.
__device__ __forceinline__ u64 desc_at_lo(u64 desc, unsigned bytes) {
  u64 r;
  asm("mov.b64 %0, {%1, %2};" : "=l"(r) : "r"((unsigned)desc + (bytes >> 4)), "r"((unsigned)(desc >> 32)));
  return r;
}

// K-major operand (Q as A, K as B of S = Q K^T): rows of the tile are M (or N), columns K.
// Core groups of 8 rows are 8 x SW bytes apart (SBO); the leading offset is unused with the
// swizzle. Step kk (16 columns, 32 bytes) starts (kk % (SW / 32)) x 32 bytes into its column
// block: the swizzle is applied by the hardware to the absolute address, so a start inside the
// row selects the right chunks.
template <int SW = 128>
__device__ __forceinline__ u64 kmajor_desc(unsigned tile_addr) { return make_desc<SW>(tile_addr, 16, 8 * SW); }
template <int ROWS, int SW = 128>
__device__ __forceinline__ constexpr unsigned kmajor_step(int kk) {  // bytes from step 0 to step kk
  constexpr int STEPS = SW / 32;  // k-steps per column block
  return (kk / STEPS) * (ROWS * SW) + (kk % STEPS) * 32;
}

// MN-major operand (V as B of O = P V, transposed): rows of the tile are K (keys), columns N
// (the head dim). N advances SW / 2 elements per column block (LBO = a block's bytes), K 8 rows
// per 8 x SW bytes (SBO); step ks (16 keys) starts 16 rows = 16 x SW bytes further.
template <int ROWS, int SW = 128>
__device__ __forceinline__ u64 mnmajor_desc(unsigned tile_addr) { return make_desc<SW>(tile_addr, ROWS * SW, 8 * SW); }
template <int SW = 128>
__device__ __forceinline__ constexpr unsigned mnmajor_step(int ks) { return ks * 16 * SW; }

// ---- the wgmma protocol -----------------------------------------------------------------

// Before the first wgmma that reads registers (A fragments, accumulators) written by other
// instructions since the last fence.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared memory written by ordinary stores (st.shared) that the tensor cores read next (wgmma
// operands: an fp8 tile widened by the producer, Q rewritten by its consumers) needs this fence in
// each writing thread before the barrier that hands it over (the async proxy's view).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pins an accumulator array in registers across the asynchronous window, so the compiler
// neither reads nor moves it between a wgmma and its wait (CUTLASS's warpgroup_fence_operand).
template <int R>
__device__ __forceinline__ void pin(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void pin(unsigned (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}

// ---- warpgroups -----------------------------------------------------------------------

// setmaxnreg: regs_release / regs_claim (pipeline_sync.cuh)

// Named barriers (0 is __syncthreads): `sync` waits until `threads` threads have arrived or
// synced on barrier `id`; `arrive` counts this warp in without waiting.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace sm90
}  // namespace cupy_fa
