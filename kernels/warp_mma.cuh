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
#pragma once

#include "common.cuh"

namespace cupy_fa {

template <typename Traits, typename QT, typename KVT>
struct WarpMma {
  static constexpr int D = Traits::kHeadDim, KW = Traits::kKeysPerWarp;
  static constexpr int S_BLOCKS = KW / 8, D_BLOCKS = D / 8, K_STEPS = D / 16;
  static_assert(SameType<QT, KVT>::value, "mma.sync takes Q and K (and P and V) in one element type");

  int lane, wm, wn;
  // kQInRegisters: Q's fragments, loaded from shared memory with the first tile and held across
  // the KV tiles (32 registers at D = 128)
  u32 q_frag[Traits::kQInRegisters ? K_STEPS : 1][4];

  __device__ __forceinline__ void load_q(const QT* sQ, int kk, u32 (&a)[4]) const {
    ldmatrix_x4(a, sQ + swizzled<D>(wm * 16 + (lane & 15), kk * 2 + (lane >> 4)));
  }

  // S = Q K^T for this warp's 16 rows x KW keys of the tile in tK.
  __device__ __forceinline__ void scores(float (&s)[S_BLOCKS][4], const QT* sQ, const KVT* tK, bool first_tile) {
#pragma unroll
    for (int i = 0; i < S_BLOCKS; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    if constexpr (Traits::kQInRegisters) {
      if (first_tile) {  // Q arrived with the first tile
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) load_q(sQ, kk, q_frag[kk]);
      }
    }
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
        for (int e = 0; e < 4; ++e) s[nb][e] = variant.capped_logits(s[nb][e]);
      }
    } else {
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nb][e] = variant.logits(s[nb][e]);
      }
    }
    if (need_mask) {
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = tile_key0 + wn * KW + nb * 8 + tq * 2 + (e & 1);
          const int row = row0 + wm * 16 + g + ((e >> 1) << 3);
          bool visible = key < kv_end;
          if (visible && row < rows) variant.visible(row, key, visible);
          if (!visible) s[nb][e] = -INFINITY;
        }
      }
    }
  }

  // O += P V for this warp's rows and keys, P the scores after OnlineSoftmaxRows::update.
  __device__ __forceinline__ void accumulate(float (&acc)[D_BLOCKS][4], const float (&s)[S_BLOCKS][4],
                                             const KVT* tV) const {
    typedef ElemTraits<KVT> E;
#pragma unroll
    for (int kk = 0; kk < KW / 16; ++kk) {
      u32 a[4];
      a[0] = E::pack(s[2 * kk][0], s[2 * kk][1]);
      a[1] = E::pack(s[2 * kk][2], s[2 * kk][3]);
      a[2] = E::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = E::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int db = 0; db < D_BLOCKS / 2; ++db) {
        u32 vb[4];
        ldmatrix_x4_trans(vb, tV + swizzled<D>(wn * KW + kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                               db * 2 + (lane >> 4)));
        Mma<KVT>::run(acc[2 * db], a, vb[0], vb[1]);
        Mma<KVT>::run(acc[2 * db + 1], a, vb[2], vb[3]);
      }
    }
  }
};

}  // namespace cupy_fa
