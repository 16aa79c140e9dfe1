// One warp's share of a KV tile in the mma.sync family (m16n8k16, fp32 accumulate): its 16
// query rows (wm) against its KW = BLOCK_N / WARPS_N keys of the tile (wn), from the swizzled
// shared-memory tiles of paged_kv.cuh.
//
//   scores()         S = Q K^T, S_BLOCKS blocks of 8 keys in the accumulator layout
//   apply_variant()  the variant's logits (or soft-capped logits) on every score, its mask on tiles that need one
//   accumulate()     O += P V (the S accumulator layout is exactly P's A-operand layout)
//
// Fragment element (nb, e) of a thread (lane = 4 g + tq) is row wm * 16 + g + 8 (e >> 1) of the
// row block and key wn * KW + 8 nb + 2 tq + (e & 1) of the tile.
//
// An fp8 K/V tile (one-byte elements, KVBytes<KVT> = 1) is widened in registers, four bytes at
// a time (common.cuh Fp8Widen), after an ldmatrix of its bytes as 16-bit pairs:
// * S = Q K^T: a thread's ldmatrix word holds head-dim elements 4 tq .. 4 tq + 3 of its key, not
//   the 2 tq, 2 tq + 1, 2 tq + 8, 2 tq + 9 of the mma's k order. A dot product does not care
//   in which order its k run, as long as Q's fragment takes the same one: Q's rows are stored
//   in shared memory in that order (paged_kv.cuh load_q_block, PAIRS_PERMUTED), so load_q's
//   ldmatrix reads the fragment as it is, and K needs no shuffle. Each ldmatrix word of K feeds
//   one mma (x4 over four 8-key blocks, x2 over a decode warp's two), twice the keys per byte
//   loaded of fp16 / bf16 tiles; the widening is to fp16 (below).
// * O += P V: a thread's transposed ldmatrix word holds two keys x two head-dim columns; a byte
//   permute makes the even and the odd columns of a 16-column chunk two mma B operands, so the
//   accumulator blocks of the chunk hold its even (acc[2c]) and odd (acc[2c + 1]) columns: the
//   thread's four columns of the chunk's row are 16 c + 4 tq .. 4 tq + 3, which the epilogue
//   stages in place (split_epilogue.cuh). P and V are fp16 there whatever Q's type (P <= 2^8 and
//   every e4m3 value is exact in fp16).
// * S = Q K^T runs in fp16 whatever Q's type (AT): bf16 queries are rewritten in shared memory as
//   fp16 times a power of two per row once per CTA (paged_kv.cuh q_rows_to_fp16, exact), so K
//   widens by the hardware conversion (one instruction per two bytes on sm_89+, where a bf16
//   widening takes a permute, shifts, masks and a multiply: ten instructions per four bytes).
// * The scales: k_scale (times the row's 2^-e_r for bf16 queries) multiplies each score
//   (scale_scores), v_scale joins each row's 1 / sum in the epilogue; the mma sees the bytes'
//   own e4m3 values.
#pragma once

#include "shared/common.cuh"

namespace cupy_fa {

template <typename Traits, typename QT, typename KVT>
struct WarpMma {
  static constexpr int D = Traits::kHeadDim, KW = Traits::kKeysPerWarp;
  static constexpr int S_BLOCKS = KW / 8, K_STEPS = D / 16;
  // P V's columns: V's and out's head dim (Traits::kHeadDimVo, D unless separate qk / vo head dims)
  static constexpr int DV = Traits::kHeadDimVo, D_BLOCKS = DV / 8;
  // the fragment elements e of a score block that hold real rows: 0, 1 (row g) and, with both
  // row halves, 2, 3 (row g + 8)
  static constexpr int E_ROWS = 2 * Traits::kRowHalves;
  static constexpr bool kFp8 = KVBytes<KVT>::value == 1;
  static_assert(kFp8 || SameType<QT, KVT>::value, "mma.sync takes Q and K (and P and V) in one element type");
  // bf16 queries over an fp8 cache: sQ rewritten as fp16 (q_rows_to_fp16) before the first tile
  static constexpr bool kQToFp16 = kFp8 && SameType<QT, __nv_bfloat16>::value;
  // the element type of S = Q K^T's operands (and of sQ once the tile loop runs)
  typedef typename TypeIf<kFp8, __half, QT>::type AT;

  int lane, wm, wn;
  // kQInRegisters: Q's fragments, loaded from shared memory with the first tile and held across
  // the KV tiles (32 registers at D = 128)
  u32 q_frag[Traits::kQInRegisters ? K_STEPS : 1][4];

  // (fp8: sQ holds each row's 16-element groups in the k order of the fp8 K words, load_q_block's
  // PAIRS_PERMUTED, so the same ldmatrix gives the fragment in that order)
  __device__ __forceinline__ void load_q(const AT* sQ, int kk, u32 (&a)[4]) const {
    ldmatrix_x4(a, sQ + swizzled<D>(wm * 16 + (lane & 15), kk * 2 + (lane >> 4)));
  }

  // an fp8 cache: the scores times the KV head's k_scale, times each row's 2^-e_r for bf16
  // queries (row_scale[0]: the thread's row g, [1]: row g + 8; see row_scales)
  __device__ __forceinline__ void scale_scores(float (&s)[S_BLOCKS][4], const float (&row_scale)[2]) const {
#pragma unroll
    for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
      for (int e = 0; e < E_ROWS; ++e) s[nb][e] *= row_scale[e >> 1];
    }
  }
  // the factors scale_scores takes: k_scale, times s_row_unscale of the thread's two rows
  // (q_rows_to_fp16) for bf16 queries
  __device__ __forceinline__ void row_scales(float (&row_scale)[2], float k_scale, const float* s_row_unscale) const {
    const int g = lane >> 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) row_scale[h] = kQToFp16 ? k_scale * s_row_unscale[wm * 16 + g + 8 * h] : k_scale;
  }

  // S = Q K^T for this warp's 16 rows x KW keys of the tile in tK.
  __device__ __forceinline__ void scores(float (&s)[S_BLOCKS][4], const AT* sQ, const KVT* tK, bool first_tile) {
#pragma unroll
    for (int i = 0; i < S_BLOCKS; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    if constexpr (Traits::kQInRegisters) {
      if (first_tile) {  // Q arrived with the first tile
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) load_q(sQ, kk, q_frag[kk]);
      }
    }
    if constexpr (kFp8) {
#pragma unroll
      for (int kk = 0; kk < K_STEPS; ++kk) {
        u32 a[4];
        if constexpr (Traits::kQInRegisters) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = q_frag[kk][e];
        } else {
          load_q(sQ, kk, a);
        }
        const int i = lane >> 3;  // the matrix this lane's row address is for: 8-key block nb + i
#pragma unroll
        for (int nb = 0; nb < S_BLOCKS; nb += 4) {
          if constexpr (S_BLOCKS % 4 == 0) {
            u32 kb[4];
            ldmatrix_x4(kb, tK + swizzled_bytes<D>(wn * KW + (nb + i) * 8 + (lane & 7), kk));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              u32 b[2];
              Fp8Widen<AT>::run(kb[j], b);
              Mma<AT>::run(s[nb + j], a, b[0], b[1]);
            }
          } else {
            u32 kb[2];
            ldmatrix_x2(kb, tK + swizzled_bytes<D>(wn * KW + (nb + (i & 1)) * 8 + (lane & 7), kk));
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              u32 b[2];
              Fp8Widen<AT>::run(kb[j], b);
              Mma<AT>::run(s[nb + j], a, b[0], b[1]);
            }
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < K_STEPS; ++kk) {
        u32 a[4];
        if constexpr (Traits::kQInRegisters) {
          a[0] = q_frag[kk][0], a[1] = q_frag[kk][1], a[2] = q_frag[kk][2], a[3] = q_frag[kk][3];
        } else {
          load_q(sQ, kk, a);
        }
#pragma unroll
        for (int nb = 0; nb < S_BLOCKS / 2; ++nb) {
          u32 kb[4];
          ldmatrix_x4(kb, tK + swizzled<D>(wn * KW + nb * 16 + (lane & 7) + ((lane >> 4) << 3),
                                           kk * 2 + ((lane >> 3) & 1)));
          Mma<QT>::run(s[2 * nb], a, kb[0], kb[1]);
          Mma<QT>::run(s[2 * nb + 1], a, kb[2], kb[3]);
        }
      }
    }
  }

  // The variant's logits on every score; where the tile touches a boundary (need_mask: one test
  // per tile, so the common path stays straight-line), its mask on real rows (< rows) and keys
  // (< kv_end), -inf elsewhere. tile_key0: the tile's first key; row0: the row block's first row.
  template <typename Variant>
  __device__ __forceinline__ void apply_variant(float (&s)[S_BLOCKS][4], const Variant& variant, int tile_key0,
                                                int row0, int kv_end, int rows, bool need_mask) const {
    const int g = lane >> 2, tq = lane & 3;
    if (variant.soft_capping()) {  // constant false in a kernel without the variant hooks
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
        for (int e = 0; e < E_ROWS; ++e) s[nb][e] = variant.capped_logits(s[nb][e]);
      }
    } else {
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
        for (int e = 0; e < E_ROWS; ++e) s[nb][e] = variant.logits(s[nb][e]);
      }
    }
    if (need_mask) {
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
        for (int e = 0; e < E_ROWS; ++e) {
          const int key = tile_key0 + wn * KW + nb * 8 + tq * 2 + (e & 1);
          const int row = row0 + wm * 16 + g + ((e >> 1) << 3);
          bool visible = key < kv_end;
          if (visible && row < rows) variant.visible(row, key, visible);
          if (!visible) s[nb][e] = -INFINITY;
        }
      }
    }
  }

  // The A fragment of P for k16 step kk of P V: the scores of key blocks 2 kk and 2 kk + 1, in
  // element type T (the V tile's, or fp16 for an fp8 tile). With one row half, rows g + 8 are
  // padding and pack their raw scores: zeros (Q's padding rows are zero-filled) or, where K holds a
  // NaN, NaN, in rows that are never written. (Packing a constant zero instead makes ptxas copy
  // the fragment into several register quads: 30 moves a tile.)
  template <typename T>
  __device__ __forceinline__ static void p_fragment(const float (&s)[S_BLOCKS][4], int kk, u32 (&a)[4]) {
    typedef ElemTraits<T> E;
    a[0] = E::pack(s[2 * kk][0], s[2 * kk][1]);
    a[1] = E::pack(s[2 * kk][2], s[2 * kk][3]);
    a[2] = E::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = E::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }

  // O += P V for this warp's rows and keys, P the scores after OnlineSoftmaxRows::update.
  __device__ __forceinline__ void accumulate(float (&acc)[D_BLOCKS][4], const float (&s)[S_BLOCKS][4],
                                             const KVT* tV) const {
    if constexpr (kFp8) {
      accumulate_fp8(acc, s, tV);
    } else {
#pragma unroll
      for (int kk = 0; kk < KW / 16; ++kk) {
        u32 a[4];
        p_fragment<KVT>(s, kk, a);
#pragma unroll
        for (int db = 0; db < D_BLOCKS / 2; ++db) {
          u32 vb[4];
          ldmatrix_x4_trans(vb, tV + swizzled<DV>(wn * KW + kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                 db * 2 + (lane >> 4)));
          Mma<KVT>::run(acc[2 * db], a, vb[0], vb[1]);
          Mma<KVT>::run(acc[2 * db + 1], a, vb[2], vb[3]);
        }
      }
    }
  }

  // O += P V from an fp8 V tile: P and V in fp16; chunk c's even columns into acc[2c], its odd
  // ones into acc[2c + 1] (see the top)
  __device__ __forceinline__ void accumulate_fp8(float (&acc)[D_BLOCKS][4], const float (&s)[S_BLOCKS][4],
                                                 const KVT* tV) const {
    const int i = lane >> 3;  // the matrix this lane's row address is for
#pragma unroll
    for (int kk = 0; kk < KW / 16; ++kk) {
      u32 a[4];
      p_fragment<__half>(s, kk, a);
#pragma unroll
      for (int c = 0; c < D / 16; c += 2) {  // two 16-byte chunks of 16 columns per x4
        u32 vb[4];
        // matrices: keys 0-7 then 8-15 of the k16 step, of chunk c, then of chunk c + 1
        const int key = wn * KW + kk * 16 + (i & 1) * 8 + (lane & 7);
        ldmatrix_x4_trans(vb, tV + swizzled_bytes<D>(key, c + (i >> 1)));
#pragma unroll
        for (int h = 0; h < 4; ++h) {  // chunk c + h / 2, its even (h even) or odd columns
          u32 b[2];
          Fp8Widen<__half>::run(__byte_perm(vb[h & 2], vb[(h & 2) + 1], (h & 1) ? 0x7531u : 0x6420u), b);
          Mma<__half>::run(acc[2 * c + h], a, b[0], b[1]);
        }
      }
    }
  }
};

}  // namespace cupy_fa
