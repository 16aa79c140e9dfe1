// Prefill / extend attention over a paged KV cache on Hopper tensor cores (sm_90a only):
// FlashAttention-3's structure, in inline PTX (no CUTLASS: NVRTC compiles a variant in about
// 1.3 s, and the package needs no headers beyond the CUDA runtime's).
//
// One CTA = one work item of plan_kernel (kernels/shared/plan.cu with block_m = 128, or 192): 128
// packed (token, head in group) rows of one request and KV head, over one split of its keys
// (sm90/work.cuh). Three warpgroups (four with 192 rows): a producer
// (sm90/load.cuh) that copies Q once and the paged K / V tiles into a ring of kStages
// stages guarded by mbarriers (sm90/pipeline.cuh), and two (three) consumers of 64 rows each
// (sm90/consumer.cuh) that run
// S = Q K^T and O += P V on wgmma (sm90/wgmma.cuh) around the mask and online softmax in
// registers (sm90/softmax.cuh), then write O / l. With separate qk / vo head dims (Traits D_VO <
// HEAD_DIM: 192 / 128) Q and the K ring are of HEAD_DIM columns, the V ring, O and out of D_VO.
// The producer gives registers back
// (setmaxnreg) to the consumers. Key tiles are taken last to first: the tiles that need a mask
// (the causal diagonal, the end of the keys) come first.
//
// Batch invariance: a row's result depends on its query, its request's keys, the split
// boundaries (plan_kernel: q_len and kv_len of its own request) and this tile shape only.
// Rows never mix (each wgmma row is one packed row); a masked key adds an exact zero; tiles
// a row sees no key of leave its state exactly empty (m = -inf, l = 0, o = 0); the key tiles
// are at fixed offsets from the split's first key and run in a fixed order. So a request's
// outputs do not depend on the other requests of its batch, nor on which CTA runs which item.
// (They are not the mma.sync family's bits: decode-like rows stay on that family.)
#include "shared/common.cuh"
#include "shared/params.cuh"
#include "shared/softmax.cuh"
#include "shared/variant.cuh"
#include "shared/trace.cuh"
#include "sm90/wgmma.cuh"
#include "sm90/work.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/load.cuh"
#include "sm90/softmax.cuh"
#include "sm90/consumer.cuh"

namespace cupy_fa {

// One instance per (head dim, keys per tile, pipeline depth, ping-pong, producer registers,
// warp-uniform warpgroup index, joint two-row softmax, lean copies, consumer warpgroups, variant
// hooks, K/V element bytes, fp8 staging slots, the soft-cap's tanh, V's head dim); the host mirror is
// cupy_fa/families/sm90.py Sm90Tile.
template <int HEAD_DIM, int BLOCK_N, int STAGES, bool PINGPONG, int PRODUCER_REGS, bool UNIFORM_WG, bool JOINT_ROWS,
          bool LEAN_COPY, int CONSUMER_WGS, bool VARIANTS, int KV_BYTES = 2, int STAGING = 0, int TANH = 0,
          int D_VO = HEAD_DIM>
struct Sm90PrefillTraits {
  // HEAD_DIM is Q's and K's (the k of S = Q K^T); D_VO V's and out's (the n of O += P V, the O
  // accumulators, the epilogue and the partials): separate qk / vo head dims (192 / 128), else equal
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kHeadDimVo = D_VO;
  // the tiles' column blocks (sm90/wgmma.cuh): 128-byte rows of 64 columns, or 64-byte rows of 32
  // for a head dim that is not whole 64-column blocks (96)
  static constexpr int kSwizzle = HEAD_DIM % 64 == 0 ? 128 : 64;
  // the variant hooks compiled in (variant.cuh: sliding window, soft-cap, sinks; each on at run time)
  static constexpr bool kVariants = VARIANTS;
  // the soft-cap's tanh with the hooks (sm90/softmax.cuh SoftCapTanh): 0 variant.cuh's (2^y and a
  // reciprocal), 1 tanh.approx, 2 2^y and a reciprocal by Newton steps on the FMA pipe
  static constexpr int kTanh = TANH;
  static_assert(TANH >= 0 && TANH <= 2 && (VARIANTS || TANH == 0), "a soft-cap tanh with the hooks only");
  // an fp8 (e4m3) cache (KV_BYTES = 1): the producer stages each tile's bytes (STAGING slots of
  // them, sm90/load.cuh produce_fp8) and widens them into 16-bit stages; both products run in fp16
  static constexpr bool kFp8 = KV_BYTES == 1;
  static constexpr int kStaging = STAGING;
  static_assert((KV_BYTES == 2 && STAGING == 0) || (KV_BYTES == 1 && STAGING >= 2), "fp8: two staging slots or more");
  // consumer warpgroups of 64 packed rows each: 2 (128 rows), or 3 (192 rows: each
  // warpgroup's softmax then has two others' GEMMs to hide behind, and the producer's
  // K / V tiles serve 3 x 64 rows; 512 threads start at 128 registers, so only tiles whose
  // consumers fit 160 with the producer at 32: D = 64, 96, or D = 128 with 64 / 80 keys a tile)
  static constexpr int kConsumerWgs = CONSUMER_WGS;
  static_assert(CONSUMER_WGS == 2 || CONSUMER_WGS == 3, "2 or 3 consumer warpgroups");
  static constexpr int kConsumerThreads = 128 * CONSUMER_WGS;
  static constexpr int kBlockM = 64 * CONSUMER_WGS;  // packed rows per CTA: 64 per consumer warpgroup
  static constexpr int kBlockN = BLOCK_N;
  static constexpr int kStages = STAGES;
  // the consumers taking turns at the tensor cores (S of tile i is always issued with P V of
  // tile i - 1, the softmax between their waits: sm90/consumer.cuh)
  static constexpr bool kPingPong = PINGPONG;
  // The warpgroup index taken from lane 0 (a shuffle), which ptxas then knows is the same in
  // every thread of a warp: what depends on it (Q's descriptors, the named-barrier ids) lives
  // in uniform registers, and the Q K^T issue needs no per-wgmma register-to-uniform moves.
  static constexpr bool kUniformWg = UNIFORM_WG;
  // The online softmax of the thread's two rows at once and without branches (the row max
  // update by selects): one scheduling region, the rows' reductions and exp2s interleaved.
  static constexpr bool kJointRows = JOINT_ROWS;
  // The producer's copy loop at about 9 instructions per 16-byte cp.async instead of 18
  // (sm90/load.cuh copy_tile_lean; a D = 128 tile 713 -> 424 instructions a warp): the
  // producer warps share each SM sub-partition's issue slots with the consumers' softmax.
  static constexpr bool kLeanCopy = LEAN_COPY;
  static constexpr int kThreads = 128 + kConsumerThreads;  // producer warpgroup + the consumers
  // setmaxnreg: the CTA starts at 64 K / kThreads registers a thread rounded down to 8 (the
  // launch bounds: 168 at 384 threads, 128 at 512), and the producer gives back what the
  // consumers take: 128 x PRODUCER_REGS + kConsumerThreads x kConsumerRegs <= kThreads x kEntryRegs
  static constexpr int kEntryRegs = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegs = PRODUCER_REGS;
  static constexpr int kConsumerRegs = ((kThreads / 128) * kEntryRegs - PRODUCER_REGS) / CONSUMER_WGS / 8 * 8;
  static_assert(PRODUCER_REGS % 8 == 0 && PRODUCER_REGS >= 24 && PRODUCER_REGS <= kEntryRegs, "setmaxnreg range");
  static_assert(kConsumerRegs <= 256, "setmaxnreg range");
  static constexpr int kQTileBytes = kBlockM * HEAD_DIM * 2;
  static constexpr int kKVTileBytes = BLOCK_N * HEAD_DIM * 2;  // a K ring stage: 16-bit elements (an fp8 tile widened)
  static constexpr int kVTileBytes = BLOCK_N * D_VO * 2;       // a V ring stage (kKVTileBytes unless D_VO differs)
  static constexpr int kRingBytes = STAGES * (kKVTileBytes + kVTileBytes);  // the K ring, then the V ring
  // sm90/pipeline.cuh PipeBarriers: the ring's and Q's barriers, the consumers' scratch words and
  // the page flag, padded to the barriers' 8 bytes
  static constexpr int kBarrierBytes = ((4 * STAGES + 1) * 8 + kConsumerThreads * 4 + 4 + 7) / 8 * 8;
  // after the barriers (at 16 bytes), the tiles that need them:
  // - an fp8 cache: each row's factor of bf16 queries rewritten as fp16 (sm90/consumer.cuh
  //   q_rows_to_fp16), then the staging slots of raw tiles;
  // - the hooked 16-bit tiles: the CTA's work item (64 bytes), written once by thread 0 and read
  //   back by the consumers' epilogue (sm90/consumer.cuh), so that its fields are not held in
  //   registers through the consumers' loop (what lets the hooks' registers fit 80 keys a tile)
  static constexpr int kScratchOffset = (kBarrierBytes + 15) / 16 * 16;  // (from the barriers)
  static constexpr int kStagingSlotBytes = BLOCK_N * HEAD_DIM;
  static constexpr int kRowScaleOffset = kScratchOffset;
  static constexpr int kStagingOffset = kRowScaleOffset + kBlockM * 4;
  static constexpr bool kStashItem = VARIANTS && !kFp8;
  static constexpr int kItemOffset = kScratchOffset;
  static constexpr int kScratchBytes = kFp8 ? kStagingOffset + STAGING * kStagingSlotBytes - kBarrierBytes
                                            : kStashItem ? kItemOffset + 64 - kBarrierBytes : 0;
  // 1024 bytes of slack: the tiles start on a 1024-byte boundary (the swizzle's period)
  static constexpr int kSmemBytes = 1024 + kQTileBytes + kRingBytes + kBarrierBytes + kScratchBytes;
  static_assert(HEAD_DIM % (kSwizzle / 2) == 0 && HEAD_DIM <= 256, "whole column blocks, one wgmma N");
  static_assert(!kFp8 || HEAD_DIM % 64 == 0, "fp8: whole 64-byte rows of e4m3 (D 64, 128, 256)");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "whole k-steps of P V, one wgmma N");
  static_assert((kQTileBytes | kKVTileBytes | kVTileBytes) % 1024 == 0, "every tile and stage on the swizzle's period");
  static_assert(D_VO == HEAD_DIM || (KV_BYTES == 2 && HEAD_DIM % 64 == 0 && D_VO % 64 == 0 && D_VO < HEAD_DIM),
                "separate qk / vo head dims: a 16-bit cache, V's rows whole 64-column blocks narrower than K's");
  static_assert(kSmemBytes <= 227 * 1024, "fits the sm_90 shared memory of one CTA");
};

// The kernel's body.
template <typename QT, typename KVT, typename OT, typename Tr>
__device__ __forceinline__ void prefill_sm90_body(const AttentionParams& p) {
  static_assert(sizeof(QT) == 2 && sizeof(OT) == 2, "16-bit queries and outputs");
  static_assert(Tr::kFp8 ? SameType<KVT, fp8_e4m3>::value : SameType<QT, KVT>::value,
                "one wgmma element type for Q, K and V, or an fp8 cache (KV_BYTES 1) widened to fp16");
  using namespace sm90;
  constexpr int BN = Tr::kBlockN, BM = Tr::kBlockM, ST = Tr::kStages;

  trace_stamp(kTraceStart);  // (diagnosis builds only: kernels/shared/trace.cuh)
  const FastDiv by_group{p.group_multiplier, p.group_shift, p.num_qo_heads / p.num_kv_heads};
  PrefillWork first;
  if (!find_work<BM, BN, Tr::kVariants>(p, by_group, first, blockIdx.x)) return;  // the whole CTA, before any barrier

  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const unsigned q_addr = base;  // the Q tile, then the K ring, then the V ring
  const unsigned k_addr = q_addr + Tr::kQTileBytes;
  const unsigned v_addr = k_addr + ST * Tr::kKVTileBytes;  // (stages of Tr::kVTileBytes)
  typedef PipeBarriers<ST, Tr::kConsumerThreads> Barriers;
  static_assert(sizeof(Barriers) == Tr::kBarrierBytes, "kBarrierBytes (and the host's smem_bytes) count every barrier byte");
  static_assert(sizeof(Barriers) == (Barriers::kPageBadOffset + 4 + 7) / 8 * 8, "page_bad: the last member, at kPageBadOffset");
  auto& bars = *reinterpret_cast<Barriers*>(smem + Tr::kQTileBytes + Tr::kRingBytes);
  if (threadIdx.x == 0) {
    bars.init(128, Tr::kConsumerThreads);
    if constexpr (Tr::kStashItem) {  // the item, for the consumers' epilogue
      static_assert(sizeof(PrefillWork) <= 64, "the item's 64 bytes");
      *reinterpret_cast<PrefillWork*>(reinterpret_cast<unsigned char*>(&bars) + Tr::kItemOffset) = first;
    }
  }
  __syncthreads();

  // The producer warpgroup copies the item's tiles, the consumers compute on them.
  RingPos<ST> pos;
  const int warpgroup = Tr::kUniformWg ? __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0) : (int)(threadIdx.x / 128);
  if (warpgroup == 0) {
    regs_release<Tr::kProducerRegs>();
    if constexpr (Tr::kFp8) {
      const unsigned staging = smem_addr(&bars) + Tr::kStagingOffset;
      produce_fp8<QT, KVT, Tr>(p, first, by_group, bars, pos, q_addr, k_addr, v_addr, staging, threadIdx.x);
    } else {
      produce<QT, KVT, Tr>(p, first, by_group, bars, pos, q_addr, k_addr, v_addr, threadIdx.x);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // an exited thread's copies are not relied on
  } else {
    regs_claim<Tr::kConsumerRegs>();
    consume<QT, OT, Tr>(p, first, by_group, bars, pos, q_addr, k_addr, v_addr, warpgroup - 1, threadIdx.x % 128);
  }
}

template <typename QT, typename KVT, typename OT, typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1) prefill_sm90_kernel(const __grid_constant__ AttentionParams p) {
  prefill_sm90_body<QT, KVT, OT, Tr>(p);
}

}  // namespace cupy_fa
