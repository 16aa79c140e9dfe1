// Small device building blocks shared by every kernel: element types, 16-byte
// async copies, ldmatrix / mma.sync wrappers and the shared-memory swizzle.
// Framework-free: kernels see raw pointers and one params struct, nothing else.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if defined(CUPY_FA_REQUIRE_SM90A) && defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "cupy_fa: this build asked for sm_90a but the compiler is not targeting it"
#endif

#ifndef INFINITY  // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace cupy_fa {

typedef unsigned int u32;
typedef long long i64;

// std::is_same without <type_traits> (NVRTC has no standard library headers).
template <typename A, typename B> struct SameType { static constexpr bool value = false; };
template <typename A> struct SameType<A, A> { static constexpr bool value = true; };
// std::conditional likewise
template <bool C, typename A, typename B> struct TypeIf { typedef A type; };
template <typename A, typename B> struct TypeIf<false, A, B> { typedef B type; };

// ---- element types -------------------------------------------------------

template <typename T> struct ElemTraits;
template <> struct ElemTraits<__half> {
  typedef __half2 Pair;
  static __device__ __forceinline__ u32 pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<u32*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(u32 v) { return __half22float2(*reinterpret_cast<__half2*>(&v)); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
};
template <> struct ElemTraits<__nv_bfloat16> {
  typedef __nv_bfloat162 Pair;
  static __device__ __forceinline__ u32 pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<u32*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(u32 v) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};

// o[0..3] * scale rounded to 4 packed elements (8 bytes): every output and split
// partial row is rounded here, once.
template <typename T>
__device__ __forceinline__ uint2 scaled4(const float (&o)[4], float scale) {
  uint2 packed;
  packed.x = ElemTraits<T>::pack(o[0] * scale, o[1] * scale);
  packed.y = ElemTraits<T>::pack(o[2] * scale, o[3] * scale);
  return packed;
}
template <typename T>
__device__ __forceinline__ void store_scaled4(T* dst, const float (&o)[4], float scale) {
  *reinterpret_cast<uint2*>(dst) = scaled4<T>(o, scale);
}

// ---- fp8 (e4m3fn) K/V elements ------------------------------------------------
//
// An fp8 KV cache holds e4m3fn bytes (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinity, S.1111.111 is NaN, largest finite 448) and a scale per KV head: the value of a byte
// is e4m3(byte) * scale. The attention kernels copy the bytes into shared memory as they are and
// widen them to the mma's 16-bit type in registers, exactly (every e4m3 value is an fp16 and a
// bf16 value), four bytes at a time.
struct fp8_e4m3 {
  unsigned char bits;
};

// Bytes per element of a K/V element type (fp8: 1, fp16 / bf16: 2).
template <typename T> struct KVBytes { static constexpr int value = sizeof(T); };

// Four e4m3 bytes (x, byte 0 first) as four exact fp16 values, in mma operand pairs:
// out[0] = (byte 0, byte 1), out[1] = (byte 2, byte 3), the lower byte in the lower half. Both
// fp8 products run in fp16 whatever Q's type (warp_mma.cuh). On sm_89+ the hardware conversion
// (NaN stays NaN); on sm_80 the bytes are placed into fp16's sign, exponent and mantissa fields
// (which reads e4m3 as itself times 2^-8, subnormals included) and multiplied by 2^8 (exact;
// fp16 multiplies keep subnormals). There a NaN byte reads as +-480 (the encoding's value were
// it finite): append never writes one from a finite input (docs/design.md, "fp8 KV cache").
template <typename T> struct Fp8Widen;
template <> struct Fp8Widen<__half> {
  static __device__ __forceinline__ void run(u32 x, u32 (&out)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n"
        " cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(out[0]), "=r"(out[1])
        : "r"(x));
#else
    const __half2 bias = __halves2half2(__ushort_as_half(0x5c00), __ushort_as_half(0x5c00));  // 2^8
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const u32 r = __byte_perm(x, 0u, i ? 0x3424u : 0x1404u);  // bytes 2i, 2i + 1 in the halves' high bytes
      u32 h = ((r & 0x7fff7fffu) >> 1) | (r & 0x80008000u);
      __half2 v = __hmul2(*reinterpret_cast<__half2*>(&h), bias);
      out[i] = *reinterpret_cast<u32*>(&v);
    }
#endif
  }
};
// Four e4m3 bytes as two pairs of T (exact: every e4m3 value is an fp16 and a bf16 value).
template <typename T>
__device__ __forceinline__ void widen4(u32 x, u32 (&out)[2]) {
  Fp8Widen<__half>::run(x, out);
  if constexpr (SameType<T, __nv_bfloat16>::value) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<__half2*>(&out[i]));
      out[i] = ElemTraits<__nv_bfloat16>::pack(f.x, f.y);
    }
  }
}

// float -> e4m3fn byte, round to nearest even, saturating: |x| >= 448 (and +-inf) give +-448,
// NaN gives NaN (0x7f, with x's sign), values below half the smallest subnormal (2^-10) give a
// zero of x's sign. Integer arithmetic only, so every arch rounds alike (the host's
// cupy_fa.reference.quantize_e4m3 is the same function).
__device__ __forceinline__ unsigned char e4m3_from_float(float x) {
  const u32 b = __float_as_uint(x);
  const u32 sign = (b >> 24) & 0x80u, a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<unsigned char>(sign | 0x7fu);  // NaN
  if (a >= 0x43e00000u) return static_cast<unsigned char>(sign | 0x7eu);  // >= 448: saturate
  if (a >= 0x3c800000u) {  // >= 2^-6: a normal e4m3, 23 mantissa bits rounded to 3 (even on ties)
    const u32 r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;  // exponent << 3 | mantissa, rounded
    return static_cast<unsigned char>(sign | (r - (120u << 3)));
  }
  // a subnormal (or zero): m * 2^-9, m = |x| * 2^9 rounded to even (m = 8 is the smallest normal)
  const u32 m = static_cast<u32>(__float2int_rn(__uint_as_float(a) * 512.f));
  return static_cast<unsigned char>(sign | m);
}

// ---- bf16 queries over an fp8 cache ---------------------------------------------
//
// Over an fp8 cache the products run in fp16 (the e4m3 bytes widen to fp16 by one conversion per
// two, where bf16 needs a byte permute, shifts, masks and a multiply), so bf16 queries are first
// rewritten as fp16 times 2^e_r, e_r per row so that the row's largest |q| lands in [2^14, 2^15)
// (clamped to +-64; 0 for a row of zeros): a bf16 value has 8 significant bits, so every scaled
// element down to 2^-17 (2^-31 of the row's largest) is exact in fp16 and the scores come out
// 2^e_r times Q K^T, which the kernels multiply by 2^-e_r again. Per row, so a row's bits depend on its own q only (batch invariance;
// decode == verify). The mma.sync family (mma_sync/paged_kv.cuh) and the wgmma family
// (sm90/consumer.cuh) rewrite their Q tiles with bf16_chunk_to_fp16, the MLA seesaw kernel its
// 576-column query block from the same parts (mla/wgmma_copy.cuh q_block_to_fp16).

// 16 bytes from / to a shared-memory address (one ld / st.shared.v4)
__device__ __forceinline__ void ld_shared_v4(unsigned addr, u32 (&x)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void st_shared_v4(unsigned addr, const u32 (&x)[4]) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3])
               : "memory");
}

// 2^e as a float, for -126 <= e <= 127 (an exponent field, no rounding).
__device__ __forceinline__ float pow2(int e) { return __uint_as_float(static_cast<u32>(127 + e) << 23); }

// A row's value reduced over its quad: the four lanes 4k .. 4k + 3 that hold one row of an mma /
// wgmma accumulator fragment, by shuffles at distance 1, then 2 (the same order in every lane, so
// all four hold the same bits).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// The largest |value| of a 16-byte chunk of bf16 queries (a NaN is ignored by fmaxf and stays NaN
// through the rewrite).
__device__ __forceinline__ float bf16_chunk_absmax(const u32 (&x)[4]) {
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = ElemTraits<__nv_bfloat16>::unpack(x[j]);
    m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return m;
}
// e_r of a row whose largest |q| is m (see above)
__device__ __forceinline__ int fp16_row_exponent(float m) {
  const int exponent = static_cast<int>((__float_as_uint(m) >> 23) & 0xffu) - 127;  // floor(log2 m), m normal
  return m > 0.f ? min(64, max(-64, 14 - exponent)) : 0;
}
// A chunk of bf16 queries rewritten in place as fp16 times 2^e (exact, see above).
__device__ __forceinline__ void bf16_chunk_scaled_fp16(u32 (&x)[4], int e) {
  const float up = pow2(e);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = ElemTraits<__nv_bfloat16>::unpack(x[j]);
    x[j] = ElemTraits<__half>::pack(f.x * up, f.y * up);
  }
}

// One 16-byte chunk of a row of bf16 queries (8 values, x), rewritten in place as fp16 times 2^e_r
// (see above); the row's CH chunks are CH consecutive lanes of one warp (CH a power of two, at
// most 32), which agree on e_r by shuffles. Returns e_r.
template <int CH>
__device__ __forceinline__ int bf16_chunk_to_fp16(u32 (&x)[4]) {
  float m = bf16_chunk_absmax(x);
#pragma unroll
  for (int o = 1; o < CH; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int e = fp16_row_exponent(m);
  bf16_chunk_scaled_fp16(x, e);
  return e;
}

// 8 fp16 / bf16 values (16 bytes) as 8 e4m3 bytes of x / scale (IEEE division, as the host's
// quantiser computes it): the fp8 caches' appends (shared/kv_append.cu, mla/latent_append.cu).
template <typename InT>
__device__ __forceinline__ uint2 quantize8(uint4 in, float scale) {
  const u32 words[4] = {in.x, in.y, in.z, in.w};
  u32 out[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = ElemTraits<InT>::unpack(words[i]);
    const u32 lo = e4m3_from_float(__fdiv_rn(f.x, scale)), hi = e4m3_from_float(__fdiv_rn(f.y, scale));
    out[i / 2] |= (lo | (hi << 8)) << (16 * (i % 2));
  }
  return make_uint2(out[0], out[1]);
}

// ---- the special-function unit ------------------------------------------------

// 2^x on the special-function unit (ex2.approx, flush to zero): 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- division by a divisor fixed per launch ------------------------------------

// n / d and n % d for 0 <= n < 2^31 by a multiply-high and a shift (Granlund and
// Montgomery, as CUTLASS's FastDivmod): the host computes (multiplier, shift) once
// (cupy_fa/_params.py fast_divisor); multiplier 0 means d = 1. An int division by a
// runtime value is a ~20-instruction sequence, and the kernels divide packed rows by the
// group size in every epilogue column item.
struct FastDiv {
  unsigned multiplier;
  int shift, divisor;
  __device__ __forceinline__ int div(int n) const {
    return multiplier ? static_cast<int>(__umulhi(static_cast<unsigned>(n), multiplier) >> shift) : n;
  }
  __device__ __forceinline__ int mod(int n) const { return n - div(n) * divisor; }
};

// ---- async copies (cp.async, sm_80+) -----------------------------------------

// Copies 16 bytes global -> shared; when `valid` is false the destination is
// zero-filled instead, so masked rows never carry NaN garbage into P @ V.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  u32 dst = static_cast<u32>(__cvta_generic_to_shared(smem));
  int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
// 4 bytes global -> shared (zero-filled when `valid` is false), through L1.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  u32 dst = static_cast<u32>(__cvta_generic_to_shared(smem));
  int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- tensor-core fragments (mma.sync m16n8k16, fp32 accumulate) ---------------

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) {
  u32 a = static_cast<u32>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const void* smem) {  // lanes 0-15 give the addresses
  u32 a = static_cast<u32>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
  u32 a = static_cast<u32>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

template <typename T> struct Mma;
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// ---- shared-memory layout ---------------------------------------------------

// Row-major [rows][D] tile of 16-byte chunks, chunk index XOR-ed with (row % 8):
// the 8 rows one ldmatrix reads then hit 8 different bank groups.
// D / 8 = 8k + 4 chunks (D = 96: 12): the chunks of whole groups of 8 as above (a row is 4 bank
// groups off the one before it, and (4 row + (c ^ row)) % 8 still differs for the 8 rows), the
// last 4 XOR-ed with (row / 2) % 4 (they cover 4 bank groups, the even rows one half, the odd
// rows the other), so the XOR never leaves the row.
template <int D>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  if constexpr ((D / 8) % 8 == 0) {
    return row * D + ((chunk ^ (row & 7)) << 3);
  } else {
    static_assert((D / 8) % 8 == 4, "head dims of 8k or 8k + 4 16-byte chunks");
    return row * D + ((chunk ^ (chunk < D / 8 - 4 ? (row & 7) : ((row >> 1) & 3))) << 3);
  }
}

// The XOR staged_pair applies to pair `pair` of row `row` of a W-column fp32 staging tile:
// 4 x (row % 8), which stays inside the pair's aligned block of 32; where W = 64k + 32 (96),
// the last 16 pairs have no such block, and take 4 x (row % 4) inside their own 16.
template <int W>
__device__ __forceinline__ int staged_pair_xor(int row, int pair) {
  static_assert(W % 64 == 0 || W % 64 == 32, "whole blocks of 16 pairs");
  if constexpr (W % 64 == 0) {
    return (row & 7) << 2;
  } else {
    return pair < W / 2 - 16 ? (row & 7) << 2 : (row & 3) << 2;
  }
}

// The same swizzle for a [rows][D] tile of one-byte elements (an fp8 K/V tile): 16-byte chunks
// of 16 elements; with fewer than 8 chunks a row (D = 64: two rows per 128 bytes) the XOR takes
// the row pair, so the 8 rows one ldmatrix reads still hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swizzled_bytes(int row, int chunk) {
  constexpr int kChunks = D / 16;
  const int x = kChunks >= 8 ? (row & 7) : ((row >> 1) & (kChunks - 1));
  return row * D + ((chunk ^ x) << 4);
}

// Element index of 16-byte chunk `chunk` of row `row` in a K/V tile of T (fp16 / bf16 or fp8).
template <int D, typename T>
__device__ __forceinline__ int swizzled_kv(int row, int chunk) {
  if constexpr (sizeof(T) == 1) {
    return swizzled_bytes<D>(row, chunk);
  } else {
    return swizzled<D>(row, chunk);
  }
}

// Float index of column pair `pair` (columns 2 pair, 2 pair + 1) of row `row` in a
// row-major [rows][D] fp32 staging tile, the pair index XOR-ed with 4 x (row % 8):
// the 8 rows of an mma accumulator fragment (same columns) land in 8 different
// bank groups, and pairs 2c, 2c + 1 stay adjacent, so a float4 read still works.
template <int D>
__device__ __forceinline__ int staged_pair(int row, int pair) {
  static_assert(D >= 64, "the XOR reaches pair 31");
  return row * D + ((pair ^ staged_pair_xor<D>(row, pair)) << 1);
}

// Index of the last entry of a non-decreasing `indptr[0..n]` that is <= x, i.e.
// which segment x falls in (0 <= x < indptr[n]; a larger x gets some index below
// n, and the caller exits); maps a flat work or token index to its request without
// a host-built lookup table. The whole warp searches together: 32 probes issued at
// once per round narrow the range 32-fold, so n <= 1024 takes two dependent loads
// instead of a binary search's log2(n) (each an L2 round trip on a CTA's critical
// path); up to 128 entries, one round of four probes a lane (the entries <= x are a prefix: their
// count, less one, is the index). Every lane of the warp must call it, with the same x.
__device__ __forceinline__ int upper_segment(const int* indptr, int n, int x) {
  const int lane = threadIdx.x & 31;
  if (n <= 128) {
    int count = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int probe = 4 * lane + j;
      count += __popc(__ballot_sync(0xffffffffu, probe < n && __ldg(indptr + probe) <= x));
    }
    return max(count - 1, 0);
  }
  int lo = 0, hi = n;  // invariant: indptr[lo] <= x < indptr[hi]
  while (hi - lo > 1) {
    const int step = (hi - lo + 31) >> 5;
    const int probe = lo + lane * step;  // lane 0 probes lo, which holds
    const unsigned below = __ballot_sync(0xffffffffu, probe < hi && __ldg(indptr + probe) <= x);
    lo += (31 - __clz(below)) * step;  // non-decreasing: the lanes that hold are a prefix
    hi = min(hi, lo + step);           // the next probe failed (or was hi)
  }
  return lo;
}

// Programmatic dependent launch (sm_90+). A kernel launched with the attribute
// (cupy_fa/_build.py launch(programmatic=True)) may start once every CTA of the
// kernel before it in the stream has run allow_dependent_launch() or exited, and
// it must run wait_for_prior_grid() before it touches what that kernel writes:
// it returns when that kernel has finished and its writes are visible. Both are
// no-ops for an ordinary launch.
__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prior_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace cupy_fa
