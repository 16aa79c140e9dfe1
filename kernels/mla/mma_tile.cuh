// The arithmetic of the MLA mma.sync tile (kernels/mla/attention.cu): per key tile of BLOCK_N
// keys, S = Q K^T over the 576 latent columns with the keys split between the 4 warps of a row of
// warps, one online-softmax step for the whole tile (the row's max over the 4 warps through shared
// memory), P in shared memory, then O += P V with the 512 value columns split between the same 4
// warps (128 each). So no warp holds more than 16 rows x 128 columns of O (64 registers), and a
// row's O needs no merge across warps at the end: only its sum does.
//
// Fragment element (nb, e) of S is row wm x 16 + g + 8 (e >> 1) of the row block and key
// wn x KW + 8 nb + 2 tq + (e & 1) of the tile (lane = 4 g + tq); element (cb, e) of O is the same
// row and column wn x 128 + 8 cb + 2 tq + (e & 1).
//
// Batch invariance: a row's arithmetic is the same whatever the tile's rows (WARPS_M) and the
// other rows: its scores are its own mma rows over the same key split, its max over the tile is
// exact, P, its sums (per warp in a fixed order, then the 4 warps in order) and P V take the same
// steps, and the lazy rescale moves a row's offset by its own scores only. So a token's bits are
// the same in decode (one row of warps) and verify (up to four), for every tile of one BLOCK_N.
#pragma once

#include "shared/common.cuh"
#include "shared/softmax.cuh"
#include "mla/params.cuh"

namespace cupy_fa {
namespace mla {

template <int WARPS_M, int BLOCK_N, int STAGES, bool KV_FP8>
struct MmaTileTraits {
  static constexpr int kWarpsM = WARPS_M, kWarpsN = 4;
  static constexpr int kWarps = WARPS_M * kWarpsN, kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * WARPS_M, kBlockN = BLOCK_N, kStages = STAGES;
  static constexpr bool kFp8 = KV_FP8;
  static constexpr int kKeysPerWarp = BLOCK_N / kWarpsN;    // of S
  static constexpr int kColsPerWarp = kValueDim / kWarpsN;  // of O: 128
  // dynamic shared memory, in this order: Q, the 16-bit K tiles (an fp8 cache: one, the widened
  // tile), an fp8 cache's byte ring, P, the slot ring, the per-warp row maxima and sums, a flag
  static constexpr int kQBytes = kBlockM * kLatentDim * 2;
  static constexpr int kTileBytes = BLOCK_N * kLatentDim * 2;
  static constexpr int kRawTileBytes = BLOCK_N * kLatentDim;
  static constexpr int kTiles16 = KV_FP8 ? 1 : STAGES;
  static constexpr int kRawBytes = KV_FP8 ? STAGES * kRawTileBytes : 0;
  static constexpr int kPBytes = kBlockM * BLOCK_N * 2;
  static constexpr int kSlotBytes = STAGES * BLOCK_N * 4;
  static constexpr int kRowBytes = 2 * kWarpsN * kBlockM * 4;
  static constexpr int kSmemBytes = kQBytes + kTiles16 * kTileBytes + kRawBytes + kPBytes + kSlotBytes + kRowBytes + 16;
  static_assert(BLOCK_N % 64 == 0, "P's rows are whole groups of 8 chunks (swizzled<BLOCK_N>), 16 keys a warp");
  static_assert(kThreads >= BLOCK_N, "one thread a key for the slot lookups");
  static_assert(STAGES >= 2, "a tile in flight while one is computed");
  static_assert(kSmemBytes <= 227 * 1024, "fits the sm_90 shared memory of one CTA");
};

template <typename Tr, typename T>
struct TileMath {
  static constexpr int KW = Tr::kKeysPerWarp, S_BLOCKS = KW / 8, O_BLOCKS = Tr::kColsPerWarp / 8;
  static constexpr int K_STEPS = kLatentDim / 16;
  int lane, wm, wn, g, tq;
  float acc[O_BLOCKS][4];
  float m[2];       // the rows' offsets (base 2, at most kLazyRescale below their maxima)
  float l[2];       // this thread's part of the rows' sums over this warp's keys

  __device__ __forceinline__ TileMath(int lane_, int warp) : lane(lane_), wm(warp / Tr::kWarpsN), wn(warp % Tr::kWarpsN) {
    g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int i = 0; i < O_BLOCKS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }

  // S = Q K^T for this warp's 16 rows and KW keys of the tile tK.
  __device__ __forceinline__ void scores(float (&s)[S_BLOCKS][4], const T* sQ, const T* tK) const {
#pragma unroll
    for (int i = 0; i < S_BLOCKS; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll 4
    for (int kk = 0; kk < K_STEPS; ++kk) {
      u32 a[4];
      ldmatrix_x4(a, sQ + swizzled<kLatentDim>(wm * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS / 2; ++nb) {
        u32 kb[4];
        ldmatrix_x4(kb, tK + swizzled<kLatentDim>(wn * KW + nb * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                  kk * 2 + ((lane >> 3) & 1)));
        Mma<T>::run(s[2 * nb], a, kb[0], kb[1]);
        Mma<T>::run(s[2 * nb + 1], a, kb[2], kb[3]);
      }
    }
  }

  // -inf for the keys a row may not see (`sees(row, key)`), on the tiles that need a mask
  template <typename Sees>
  __device__ __forceinline__ void mask(float (&s)[S_BLOCKS][4], int tile_key0, int row0, Sees sees) const {
#pragma unroll
    for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = tile_key0 + wn * KW + nb * 8 + 2 * tq + (e & 1);
        const int row = row0 + wm * 16 + g + 8 * (e >> 1);
        if (!sees(row, key)) s[nb][e] = -INFINITY;
      }
    }
  }

  // this warp's raw row maxima over its keys into s_max[wn][row]
  __device__ __forceinline__ void publish_max(const float (&s)[S_BLOCKS][4], float* s_max) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
      mx = quad_max(mx);
      if (tq == 0) s_max[wn * Tr::kBlockM + wm * 16 + g + 8 * h] = mx;
    }
  }

  // The tile's online-softmax step: the rows' maxima over the 4 warps, the lazy offset move (and
  // the accumulators' rescale), P = 2^(s scale - m) into sP, this warp's part of the sums.
  __device__ __forceinline__ void softmax(float (&s)[S_BLOCKS][4], const float* s_max, float scale_log2, T* sP) {
    float factor[2];
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * 16 + g + 8 * h;
      float mx = s_max[r];
#pragma unroll
      for (int w = 1; w < Tr::kWarpsN; ++w) mx = fmaxf(mx, s_max[w * Tr::kBlockM + r]);
      mx *= scale_log2;  // -inf stays -inf (scale > 0)
      factor[h] = 1.f;
      if (mx > m[h] + kLazyRescale) {  // also a row's first keys (m = -inf)
        factor[h] = rescale_factor(m[h], mx);
        moved = moved || m[h] != -INFINITY;  // from -inf the accumulators are still zero
        m[h] = mx;
      }
      const float offset = safe_offset(m[h]);
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[nb][e] = exp2f(fmaf(s[nb][e], scale_log2, -offset));
          sum += s[nb][e];
        }
      }
      l[h] = l[h] * factor[h] + sum;
    }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int cb = 0; cb < O_BLOCKS; ++cb) {
        acc[cb][0] *= factor[0], acc[cb][1] *= factor[0];
        acc[cb][2] *= factor[1], acc[cb][3] *= factor[1];
      }
    }
#pragma unroll
    for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * 16 + g + 8 * h;
        *reinterpret_cast<u32*>(sP + swizzled<Tr::kBlockN>(r, (wn * KW + nb * 8) / 8) + 2 * tq) =
            ElemTraits<T>::pack(s[nb][2 * h], s[nb][2 * h + 1]);
      }
    }
  }

  // O += P V for this warp's rows and its 128 columns, over all BLOCK_N keys of the tile tK.
  __device__ __forceinline__ void accumulate(const T* sP, const T* tK) {
#pragma unroll
    for (int ks = 0; ks < Tr::kBlockN / 16; ++ks) {
      u32 a[4];
      ldmatrix_x4(a, sP + swizzled<Tr::kBlockN>(wm * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
      for (int cb2 = 0; cb2 < O_BLOCKS / 2; ++cb2) {
        u32 vb[4];
        ldmatrix_x4_trans(vb, tK + swizzled<kLatentDim>(ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                        wn * (Tr::kColsPerWarp / 8) + cb2 * 2 + (lane >> 4)));
        Mma<T>::run(acc[2 * cb2], a, vb[0], vb[1]);
        Mma<T>::run(acc[2 * cb2 + 1], a, vb[2], vb[3]);
      }
    }
  }

  // this warp's part of the rows' sums into s_sum[wn][row] (after the split's last tile)
  __device__ __forceinline__ void publish_sum(float* s_sum) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float x = l[h];
      x = quad_sum(x);
      if (tq == 0) s_sum[wn * Tr::kBlockM + wm * 16 + g + 8 * h] = x;
    }
  }
};

}  // namespace mla
}  // namespace cupy_fa
