// Tile traits of the mma.sync attention family (sm_80+): one template, one traits struct per
// (head dim, warp layout, keys per tile, pipeline depth, fold state). The host mirrors the
// numbers it needs (cupy_fa/families/mma_sync.py MmaTile, checked by static_asserts compiled
// into every kernel) to size the launch, the shared memory and the plan's work layout.
//
// Element types are the kernel's own template parameters (attention_kernel<Q, KV, O, Traits>),
// not the tile's; the tile knows the bytes of a K/V element (KV_BYTES: 2 for fp16 / bf16, 1 for
// an fp8 cache), which size the K/V stages and their 16-byte chunks. Q and O are 2-byte.
#pragma once

#include "shared/common.cuh"
#include "shared/softmax.cuh"

namespace cupy_fa {

// Tile constants per (head dim, warp layout, keys per tile, pipeline depth, fold state, variant hooks,
// row halves, producer warps, V's head dim).
// The host picks the instance (cupy_fa/schedule.py; its mirror: cupy_fa/families/mma_sync.py
// MmaTile) and sizes the dynamic shared memory from the same numbers.
template <int HEAD_DIM, int WARPS_M, int WARPS_N, int BLOCK_N, int STAGES, bool FOLD, int KV_BYTES = 2,
          bool VARIANTS = false, int ROW_HALVES = 2, int PRODUCER_WARPS = 0, int HEAD_DIM_VO = HEAD_DIM>
struct TileTraits {
  // HEAD_DIM is Q's and K's (the S = Q K^T GEMM's k); HEAD_DIM_VO is V's and out's (the P V GEMM's
  // n, the accumulators, the epilogue, the partials): separate qk / vo head dims (192 / 128), else
  // equal. Every constant of V, O and the epilogue below is of HEAD_DIM_VO; with the default they
  // are the numbers they always were.
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kHeadDimVo = HEAD_DIM_VO;
  static constexpr int kVoChunks = HEAD_DIM_VO / 8;  // 16-byte chunks of a 16-bit V row
  // The halves of a warp's 16 mma rows the scores, the softmax and P run on: 2 (rows g and
  // g + 8 of each thread), or 1 for a one-row small-q tile whose requests pack at most 8 rows (decode
  // at a GQA group of at most 8): rows 8 .. 15 are then padding, kept an empty state (P = 0), and
  // half of each tile's softmax is not issued. A row's arithmetic is the same either way (its half's
  // code is one loop body), so the bits of rows 0 .. 7 do not depend on ROW_HALVES (decode == verify).
  static constexpr int kRowHalves = ROW_HALVES;
  // the variant hooks compiled in (variant.cuh: sliding window, soft-cap, sinks; each on at run time)
  static constexpr bool kVariants = VARIANTS;
  static constexpr int kWarpsM = WARPS_M;
  static constexpr int kWarpsN = WARPS_N;
  static constexpr int kWarps = WARPS_M * WARPS_N;    // the consumer warps: the mma, softmax and epilogue
  static constexpr int kThreads = 32 * kWarps;         // their threads (Q's loads, the epilogue's loops)
  // PRODUCER_WARPS = 4: a producer warpgroup more per CTA (warps kWarps .. kWarps + 3) issues every
  // K/V copy, their addresses and page ids, into a ring of mbarriers (kv_ring.cuh); the consumer warps
  // only wait for a stage and free it. 0: the consumer threads issue each tile themselves (cp.async
  // groups and CTA barriers). The consumers' arithmetic is the same either way: a row's bits do not
  // depend on it. The producers copy exactly as the consumers would (thread kThreads + t as thread t).
  static constexpr int kProducerWarps = PRODUCER_WARPS;
  static constexpr int kCtaThreads = kThreads + 32 * PRODUCER_WARPS;  // the launch's block size
  static constexpr int kBlockM = 16 * WARPS_M;                                   // query rows per CTA
  static constexpr int kBlockN = BLOCK_N;                                        // keys per KV tile
  static constexpr int kKeysPerWarp = kBlockN / WARPS_N;
  static constexpr int kStages = STAGES;                                         // cp.async pipeline depth
  static constexpr int kChunks = HEAD_DIM / 8;                                   // 16-byte chunks per row
  static constexpr int kRowStep = kThreads / kChunks;                            // rows one pass of the CTA loads
  static constexpr int kSmemQ = kBlockM * HEAD_DIM * 2;
  static constexpr int kSmemKV = kStages * kBlockN * HEAD_DIM * KV_BYTES;        // K (and V where D_VO = D)
  static constexpr int kSmemV = kStages * kBlockN * HEAD_DIM_VO * KV_BYTES;      // V
  static constexpr int kSmemEpilogue = kWarps * 16 * HEAD_DIM_VO * 4;            // fp32 per-warp accumulators
  // FOLD: the CTA carries a fold state and may run a whole row, or one group of kMergeGroup
  // splits of it, and fold them itself (AttentionParams::fold_splits): merge_kernel's steps,
  // so no split partials. The state costs shared memory, so the host picks this variant
  // only for batches whose longer CTAs still fill the GPU.
  static constexpr bool kFoldInCta = FOLD;
  // the fold state: merge_kernel's open group and total, o per element and (m, l) per row
  static constexpr int kSmemFold = kFoldInCta ? kBlockM * (2 * HEAD_DIM_VO * 4 + 16) : 0;
  // K/V rows in 16-byte chunks (16 fp8 or 8 fp16 / bf16 elements each), and the rows one pass
  // of the CTA copies
  static constexpr int kKVBytes = KV_BYTES;
  static constexpr int kKVChunks = HEAD_DIM * KV_BYTES / 16;
  static constexpr int kKVRowStep = kThreads / kKVChunks;
  // Thread t loads chunk t % kChunks of Q's rows t / kChunks, + kRowStep, ... (and chunk
  // t % kKVChunks of a K or V tile's rows t / kKVChunks, + kKVRowStep, ...). Where the chunks do
  // not divide the threads or a pass's rows a tile's (16-bit K/V at D = 96: 12 chunks; 192: 24),
  // the last threads load nothing and the last pass is partial: the loads test each row
  // (loads_row, loads_kv_row); at the other head dims the tests compile away.
  static constexpr bool kEvenLoads = kThreads % kChunks == 0 && kBlockM % kRowStep == 0;
  static constexpr bool kEvenKVLoads = kThreads % kKVChunks == 0 && kBlockN % kKVRowStep == 0;
  static constexpr int kPassesM = (kBlockM + kRowStep - 1) / kRowStep;        // passes over Q's rows
  static constexpr int kPassesN = (kBlockN + kKVRowStep - 1) / kKVRowStep;    // over a K or V tile's
  static __device__ __forceinline__ bool loads_row(int row_in_pass, int r) {
    return kEvenLoads || (row_in_pass < kRowStep && r < kBlockM);
  }
  static __device__ __forceinline__ bool loads_kv_row(int row_in_pass, int r) {
    return kEvenKVLoads || (row_in_pass < kKVRowStep && r < kBlockN);
  }
  static constexpr int kStageBytes = kBlockN * (HEAD_DIM + HEAD_DIM_VO) * KV_BYTES;  // one stage's K and V tiles
  // With a producer warpgroup, the registers each side asks for (setmaxnreg, sm_90a) from the 128 a
  // thread the launch bounds give: a warp of each side per SM sub-partition per CTA, so at 2 CTAs
  // an SM a consumer and a producer thread share 512 / 2 registers.
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 512 / 2 - kProducerRegisters;

  // A barrier of the consumer warps: the CTA's (__syncthreads) without a producer warp; with one,
  // named barrier 1 over the consumers alone (the producer never waits on them but by the ring).
  static __device__ __forceinline__ void sync_consumers() {
    if constexpr (PRODUCER_WARPS > 0) {
      asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
    } else {
      __syncthreads();
    }
  }

  // The end-of-split epilogue stages each warp's 16 x D fp32 accumulators in shared
  // memory. When they fit in one stage's K and V tiles (at once, or half of D at a time
  // for a two-row fold tile), it uses only the stage just consumed, so the pipeline keeps
  // running: a CTA may then run several consecutive splits (splits_per_cta) without a
  // new start-up per split.
  // (An fp8 stage holds half the bytes: one pass where it fits, else two where D >= 128. With
  // D_VO < D a 16-bit stage holds more than the warps' D_VO-column slices need: the same test.)
  static constexpr int kEpiloguePasses =
      KV_BYTES == 2 ? (kWarps <= BLOCK_N / 16 ? 1 : (kFoldInCta ? 2 : 0))
                    : (kWarps * 16 * HEAD_DIM * 4 <= kStageBytes
                           ? 1
                           : (HEAD_DIM >= 128 && kWarps * 16 * (HEAD_DIM / 2) * 4 <= kStageBytes ? 2 : 0));
  static constexpr bool kEpilogueInStage = kEpiloguePasses > 0;
  static constexpr int kStagedCols = kEpilogueInStage ? HEAD_DIM_VO / kEpiloguePasses : HEAD_DIM_VO;  // per pass
  // The producer-warpgroup tile (one row half, folding) stages its epilogue in a buffer of its own,
  // its warps' real rows only (8 a warp), after the fold state: the consumers free the stage they
  // read at a split's end before the epilogue, and the producers refill it meanwhile (attention.cu).
  // The same arithmetic in the same order: no bit changes.
  static constexpr bool kEpilogueOwnBuffer = PRODUCER_WARPS > 0;
  static constexpr int kSmemEpilogueOwn = kEpilogueOwnBuffer ? kWarps * 8 * kStagedCols * 4 : 0;
  // The K/V stages, and where the epilogue stages over all of them and they are too small (an
  // fp8 tile), the room it needs; then the fold state.
  static constexpr int kSmemKVRegion =
      (kEpilogueInStage || kSmemEpilogue <= kSmemKV + kSmemV) ? kSmemKV + kSmemV : kSmemEpilogue;
  static constexpr int kSmemBytes = kSmemQ + kSmemKVRegion + kSmemFold + kSmemEpilogueOwn;
  // Decode-like tiles (warps over keys) are memory-bound: they live on warps in
  // flight, so hold the compiler to the CTAs per SM that shared memory allows,
  // as far as 128 registers per thread can feed them. Prefill tiles keep their
  // registers (compute-bound, 2 CTAs per SM by shared memory anyway).
  static constexpr int kCtasBySmem = (227 * 1024) / (kSmemBytes + 1024);
  static constexpr int kCtasBy128Regs = 65536 / (kCtaThreads * 128);
  // (The two-row tile of a 96-column head dim, or over an fp8 cache, with the variant hooks needs
  // registers past 128: it is held to one CTA per SM, as a prefill tile is.)
  static constexpr bool kOneCtaForRegisters = VARIANTS && WARPS_M > 1 && (HEAD_DIM % 64 != 0 || KV_BYTES == 1);
  static constexpr int kMinCtasPerSm =
      (WARPS_N == 1 || kCtasBySmem < 1 || kOneCtaForRegisters)
          ? 1
          : (kCtasBySmem < kCtasBy128Regs ? kCtasBySmem : kCtasBy128Regs);
  // Q's mma fragments (32 registers at D = 128) held across the KV tiles, loaded from shared
  // memory once, where the register file gives every thread 255 (decode-like tiles at 256
  // threads per SM: the one-row folding tile): a third of a tile's ldmatrix reads fewer.
  static constexpr bool kQInRegisters = WARPS_N > 1 && HEAD_DIM <= 128 && kThreads * kMinCtasPerSm <= 256;

  static_assert(kKeysPerWarp % 16 == 0, "each warp needs whole k16 steps of keys");
  static_assert(ROW_HALVES == 2 || (ROW_HALVES == 1 && WARPS_M == 1 && WARPS_N > 1),
                "one row half only on the one-row small-q tile");
  static_assert(PRODUCER_WARPS == 0 || (PRODUCER_WARPS == kWarps && kWarps == 4 && KV_BYTES == 1 && WARPS_M == 1 &&
                                         ROW_HALVES == 1 && FOLD && !VARIANTS && kMinCtasPerSm == 2),
                "a producer warpgroup only on the fp8 one-row-half folding tile without the variant hooks, 2 "
                "CTAs an SM (kConsumerRegisters)");
  static_assert(kStages >= 2, "the pipeline refills one stage while another is consumed");
  static_assert(!kEpilogueInStage || kWarps * 16 * kStagedCols * 4 <= kStageBytes,
                "a pass's fp32 slices fit one stage's K and V tiles");
  static_assert(!kEpilogueInStage || ((BLOCK_N * HEAD_DIM * KV_BYTES / 4) % (16 * kStagedCols) == 0 &&
                                      (BLOCK_N * HEAD_DIM_VO * KV_BYTES / 4) % (16 * kStagedCols) == 0),
                "whole slices per K (or V) tile");
  // the slices a stage's K tile does not hold go to its V tile (split_epilogue.cuh staged)
  static_assert(!kEpilogueInStage || kEpilogueOwnBuffer ||
                    kWarps <= (BLOCK_N * (HEAD_DIM + HEAD_DIM_VO) * KV_BYTES / 4) / (16 * kStagedCols),
                "the warps' slices fit one stage's K and V tiles");
  static_assert(HEAD_DIM_VO == HEAD_DIM || (KV_BYTES == 2 && PRODUCER_WARPS == 0 && HEAD_DIM_VO < HEAD_DIM &&
                                            HEAD_DIM_VO % 64 == 0),
                "separate qk / vo head dims: 16-bit K/V, no producer warpgroup, V's rows whole 64-column "
                "blocks narrower than K's");
  static_assert(kStagedCols >= 64 || kEpiloguePasses <= 1, "staged_pair's swizzle needs 64 columns");
  static_assert(!FOLD || WARPS_N > 1, "a fold is for small-q tiles, whose requests split");
  static_assert(kRowStep >= 1 && HEAD_DIM % 16 == 0, "a pass loads whole rows of whole k16 steps");
  static_assert(KV_BYTES == 1 || kSmemEpilogue <= kSmemKV + kSmemV, "epilogue reuses the K/V buffers");
  static_assert(KV_BYTES == 1 || KV_BYTES == 2, "fp8, or fp16 / bf16 K/V elements");
  static_assert(KV_BYTES == 2 || (kThreads % kKVChunks == 0 && kBlockN % kKVRowStep == 0),
                "fp8 K/V loads must tile the CTA evenly (head dims 64, 128, 256)");
  static_assert(KV_BYTES == 2 || (kKeysPerWarp % 16 == 0 && HEAD_DIM % 32 == 0),
                "fp8 fragments: pairs of 8-key blocks and of 16-byte chunks (warp_mma.cuh)");
};

}  // namespace cupy_fa
