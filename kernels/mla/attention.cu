// Multi-head latent attention (the absorbed form of DeepSeek V2 / V3 / R1 and Kimi K2) over a paged
// latent cache, the mma.sync tile (sm_80+): every mode, 16-bit and fp8 (e4m3) caches. A composition
// of the phases in the headers beside it:
//
//   work.cuh       which (request, row block, split) this CTA runs; which keys a row sees
//   mma_copy.cuh   the row block's queries once; each key tile's paged latent rows through a
//                  STAGES-deep cp.async pipeline (an fp8 cache: bytes, then widened in shared memory)
//   mma_tile.cuh   per key tile: S = Q K^T (keys split between the 4 warps of a row of warps), one
//                  softmax step for the tile, P V (the 512 value columns split between them)
//   epilogue.cuh   the split's rows: out and LSE, or a partial for merge_kernel (shared/merge.cu)
//
// One CTA = one work item (plan_kernel's layout, one KV head, group size H): 16 x WARPS_M packed
// (token, head) rows of one request over one split of its keys. Per key tile, three CTA barriers:
// the tile has landed (and the stage the next copies refill is free), the warps' row maxima are
// published, P is written.
#include "shared/common.cuh"
#include "shared/softmax.cuh"
#include "mla/params.cuh"
#include "mla/work.cuh"
#include "mla/mma_copy.cuh"
#include "mla/mma_tile.cuh"
#include "mla/epilogue.cuh"

namespace cupy_fa {
namespace mla {

template <typename T, typename Tr>
__global__ void __launch_bounds__(Tr::kThreads) mla_mma_kernel(const __grid_constant__ MlaParams p) {
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, ST = Tr::kStages, THREADS = Tr::kThreads;
  allow_dependent_launch();  // the merge may start in this grid's last wave (it waits before reading)
  const FastDiv by_head{p.head_multiplier, p.head_shift, p.num_heads};
  Work w;
  if (!find_work<BM>(p, by_head, blockIdx.x, w)) return;  // the whole CTA, before any barrier

  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = reinterpret_cast<T*>(smem + Tr::kQBytes);  // the 16-bit tiles
  unsigned char* sRaw = smem + Tr::kQBytes + Tr::kTiles16 * Tr::kTileBytes;  // an fp8 cache's byte ring
  T* sP = reinterpret_cast<T*>(sRaw + Tr::kRawBytes);
  int* s_slots = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(sP) + Tr::kPBytes);
  float* s_max = reinterpret_cast<float*>(s_slots + ST * BN);  // [4][BM]
  float* s_sum = s_max + Tr::kWarpsN * BM;                      // [4][BM]
  int* s_flag = reinterpret_cast<int*>(s_sum + Tr::kWarpsN * BM);  // a page id outside the cache

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int num_tiles = (w.kv_end - w.kv_begin + BN - 1) / BN;
  if (tid == 0) *s_flag = 0;
  // the slots of the first STAGES tiles (one ring entry a stage)
  for (int t = 0; t < ST && t < num_tiles; ++t) key_slots<BN>(p, w, w.kv_begin + t * BN, s_slots + t * BN, s_flag, tid);
  __syncthreads();

  // Q once (with the first tile's group), then tiles 0 .. STAGES-2 in flight
  load_q_rows<BM, THREADS>(p, w, by_head, sQ, tid);
#pragma unroll
  for (int t = 0; t < ST - 1; ++t) {
    if (t < num_tiles) {
      copy_tile<BN, THREADS, Tr::kFp8>(p, s_slots + t * BN,
                                       Tr::kFp8 ? static_cast<void*>(sRaw + t * Tr::kRawTileBytes)
                                                : static_cast<void*>(sK + t * BN * kLatentDim), tid);
    }
    cp_async_commit();
  }

  const float kv_scale = Tr::kFp8 ? __ldg(p.kv_scale) : 1.f;
  const float scale_log2 = p.sm_scale_log2 * kv_scale;  // an fp8 cache's scale on every score
  TileMath<Tr, T> math(lane, warp);
  const int mask_tiles_from = (w.mask_from - w.kv_begin) / BN;  // tiles from here on take the mask
  const int row_block0 = w.row0;

  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t % ST;
    cp_async_wait<ST - 2>();
    __syncthreads();  // tile t has landed everywhere; every warp is done with tile t - 1
    {
      const int ahead = t + ST - 1;  // into the stage tile t - 1 used
      if (ahead < num_tiles) {
        copy_tile<BN, THREADS, Tr::kFp8>(p, s_slots + (ahead % ST) * BN,
                                         Tr::kFp8 ? static_cast<void*>(sRaw + (ahead % ST) * Tr::kRawTileBytes)
                                                  : static_cast<void*>(sK + (ahead % ST) * BN * kLatentDim), tid);
      }
      cp_async_commit();
      if (t + ST < num_tiles) key_slots<BN>(p, w, w.kv_begin + (t + ST) * BN, s_slots + (t % ST) * BN, s_flag, tid);
    }
    const T* tK = sK + (Tr::kFp8 ? 0 : stage * BN * kLatentDim);
    if constexpr (Tr::kFp8) {
      widen_tile<BN, THREADS, T>(sRaw + stage * Tr::kRawTileBytes, sK, tid);
      __syncthreads();
    }
    float s[TileMath<Tr, T>::S_BLOCKS][4];
    math.scores(s, sQ, tK);
    if (t >= mask_tiles_from) {
      const int tile_key0 = w.kv_begin + t * BN;
      math.mask(s, tile_key0, row_block0, [&](int row, int key) {
        return key < w.kv_end && (row >= w.rows || row_sees(p, w, by_head.div(row), key));
      });
    }
    math.publish_max(s, s_max);
    __syncthreads();
    math.softmax(s, s_max, scale_log2, sP);
    __syncthreads();
    math.accumulate(sP, tK);
  }
  cp_async_wait<0>();
  math.publish_sum(s_sum);
  __syncthreads();
  float l[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = math.wm * 16 + math.g + 8 * h;
    l[h] = s_sum[r];
#pragma unroll
    for (int wi = 1; wi < Tr::kWarpsN; ++wi) l[h] += s_sum[wi * BM + r];
  }
  if (num_tiles == 0) l[0] = l[1] = 0.f;  // an empty split (its m is -inf): the identity of the merge
  const bool bad = w.bad != 0 || *s_flag != 0;
  if (tid == 0 && *s_flag != 0 && w.bad == 0) record_bad(p.status, w.request, kPageOutOfRange);
  store_rows<T, TileMath<Tr, T>::O_BLOCKS>(p, w, by_head, math.acc, w.row0 + math.wm * 16 + math.g,
                                          math.wn * Tr::kColsPerWarp, math.tq, math.m, l, bad, kv_scale,
                                          math.wn == 0);
}

}  // namespace mla
}  // namespace cupy_fa
