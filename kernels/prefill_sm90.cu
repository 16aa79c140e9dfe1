// Prefill / extend attention over a paged KV cache on Hopper tensor cores (sm_90a only):
// FlashAttention-3's structure in inline PTX.
//
// One CTA = one work item of plan_kernel (kernels/plan.cu with block_m = 128): 128 packed
// (token, head in group) rows of one request and KV head, over one split of its keys. Three
// warpgroups: a producer (sm90_prefill_load.cuh) that copies Q once and the paged K / V
// tiles into a ring of kStages stages guarded by mbarriers (sm90_pipeline.cuh), and two
// consumers of 64 rows each that run S = Q K^T (wgmma, both from shared memory), the mask
// and online softmax in registers (sm90_prefill_softmax.cuh) and O += P V (wgmma, P from
// registers), then write O / l. The producer gives registers back (setmaxnreg) to the
// consumers. Key tiles are taken last to first: the tiles that need a mask (the causal
// diagonal, the end of the keys) come first, the rest run without mask code.
//
// Overlap (Traits::kOverlap, FlashAttention-3's intra-warpgroup pipelining): step i issues
// S of tile i and P V of tile i - 1 together, then the softmax of tile i runs while P V is
// still in the tensor cores (mode 2 keeps ptxas from sinking half of it past P V's wait). Ping-pong (Traits::kPingPong): the two consumer warpgroups take
// turns issuing their GEMMs (named barriers 1 and 2), so one's softmax overlaps the other's
// GEMMs.
//
// Batch invariance: a row's result depends on its query, its request's keys, the split
// boundaries (plan_kernel: q_len and kv_len of its own request) and this tile shape only.
// Rows never mix (each wgmma row is one packed row); a masked key adds an exact zero; tiles
// a row sees no key of leave its state exactly empty (m = -inf, l = 0, o = 0); the key tiles
// are at fixed offsets from the split's first key and run in a fixed order. So a request's
// outputs do not depend on the other requests of its batch, nor on which CTA runs which item.
#include "common.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "sm90_wgmma.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_prefill_work.cuh"
#include "sm90_prefill_load.cuh"
#include "sm90_prefill_softmax.cuh"

namespace cupy_fa {

// One instance per (head dim, keys per tile, pipeline depth, overlap, ping-pong, producer
// registers, Q in registers); the host mirror is cupy_fa/prefill_sm90.py Sm90Tile.
template <int HEAD_DIM, int BLOCK_N, int STAGES, int OVERLAP, bool PINGPONG, int PRODUCER_REGS, bool Q_IN_REGS>
struct Sm90PrefillTraits {
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kBlockM = 128;  // packed rows per CTA: 64 per consumer warpgroup
  static constexpr int kBlockN = BLOCK_N;
  static constexpr int kStages = STAGES;
  // 0: S, softmax, then P V of the previous tile, each waited for; 1: S of tile i issued with
  // P V of tile i - 1 and the softmax between their waits (FlashAttention-3's intra-warpgroup
  // overlap); 2: as 1, with the softmax held before the second wait (see the main loop)
  static constexpr int kOverlap = OVERLAP;
  static constexpr bool kPingPong = PINGPONG;
  // Q's A fragments in registers (loaded once from the Q tile) instead of read from shared
  // memory by every S = Q K^T: a third less shared-memory traffic for 32 registers (D = 128).
  static constexpr bool kQInRegs = Q_IN_REGS;
  static constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
  // setmaxnreg: the CTA starts at 168 registers a thread (64 K / 384 rounded down to 8, the
  // launch bounds), and the producer gives back what the consumers take:
  // 128 x PRODUCER_REGS + 256 x kConsumerRegs <= 384 x 168
  static constexpr int kProducerRegs = PRODUCER_REGS;
  static constexpr int kConsumerRegs = (3 * 168 - PRODUCER_REGS) / 2 / 8 * 8;
  static_assert(PRODUCER_REGS % 8 == 0 && PRODUCER_REGS >= 24 && PRODUCER_REGS <= 168, "setmaxnreg range");
  static constexpr int kQTileBytes = kBlockM * HEAD_DIM * 2;
  static constexpr int kKVTileBytes = BLOCK_N * HEAD_DIM * 2;
  static constexpr int kBarrierBytes = (4 * STAGES + 1) * 8 + 256 * 4;  // sm90_pipeline.cuh PipeBarriers
  // 1024 bytes of slack: the tiles start on a 1024-byte boundary (the swizzle's period)
  static constexpr int kSmemBytes = 1024 + kQTileBytes + 2 * STAGES * kKVTileBytes + kBarrierBytes;
  static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "whole 64-column swizzle blocks, one wgmma N");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "whole k-steps of P V, one wgmma N");
  static_assert(kSmemBytes <= 227 * 1024, "fits the sm_90 shared memory of one CTA");
};

template <typename QT, typename KVT, typename OT, typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1) prefill_sm90_kernel(const __grid_constant__ AttentionParams p) {
  static_assert(sizeof(QT) == 2 && sizeof(KVT) == 2 && sizeof(OT) == 2, "16-bit elements");
  static_assert(sm90::SameType<QT, KVT>::value, "one wgmma element type for Q, K and V");
  using namespace sm90;
  constexpr int D = Tr::kHeadDim, BN = Tr::kBlockN, BM = Tr::kBlockM, ST = Tr::kStages;

  const FastDiv by_group{p.group_multiplier, p.group_shift, p.num_qo_heads / p.num_kv_heads};
  PrefillWork w;
  if (!find_work<BM, BN>(p, by_group, w)) return;  // the whole CTA, before any barrier

  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const unsigned q_addr = base;
  const unsigned k_addr = q_addr + Tr::kQTileBytes;
  const unsigned v_addr = k_addr + ST * Tr::kKVTileBytes;
  auto& bars = *reinterpret_cast<PipeBarriers<ST>*>(smem + Tr::kQTileBytes + 2 * ST * Tr::kKVTileBytes);
  if (threadIdx.x == 0) bars.init(128, 256);
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    regs_release<Tr::kProducerRegs>();
    produce<QT, KVT, Tr>(p, w, by_group, bars, q_addr, k_addr, v_addr, threadIdx.x);
  } else {
    regs_claim<Tr::kConsumerRegs>();
    const int wg = warpgroup - 1, wtid = threadIdx.x % 128, lane = wtid % 32;
    const int quad = lane % 4;
    const int first_row = wg * 64 + (wtid / 32) * 16 + lane / 4;  // tile row of row half 0
    RowInfo ri;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = w.row0 + first_row + 8 * h;
      ri.real[h] = row < w.rows;
      ri.token[h] = by_group.div(min(row, w.rows - 1));
    }
    const unsigned my_q = q_addr + wg * 64 * 128;  // this warpgroup's 64 rows of every column block
    const unsigned scratch = smem_addr(&bars.scratch[threadIdx.x - 128]);  // see the overlapped step

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float s[BN / 2];
    unsigned frag[BN / 16][4];
    RowState st;
    st.reset();

    unsigned q_frag[Tr::kQInRegs ? D / 16 : 1][4];  // kQInRegs: Q's A fragments, once
    // the descriptors of Q and of stage 0's K and V; a stage and a k-step are constant steps
    const u64 q_desc = kmajor_desc(my_q), k_desc = kmajor_desc(k_addr), v_desc = mnmajor_desc<BN>(v_addr);
    // S = Q K^T of the K tile in `stage` (issue only)
    auto issue_qk = [&](int stage) {
      const u64 k_tile = desc_at(k_desc, stage * Tr::kKVTileBytes);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const u64 kd = desc_at(k_tile, kmajor_step<BN>(kk));
        if constexpr (Tr::kQInRegs) {
          Wgmma<BN, QT>::rs_k(s, q_frag[kk], kd, kk > 0);
        } else {
          Wgmma<BN, QT>::ss_kk(s, desc_at(q_desc, kmajor_step<BM>(kk)), kd, kk > 0);
        }
      }
      wgmma_commit();
    };
    // O += P V of the V tile in `stage` (issue only)
    auto issue_pv = [&](int stage) {
      const u64 v_tile = desc_at(v_desc, stage * Tr::kKVTileBytes);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) Wgmma<D, QT>::rs_mn(o, frag[ks], desc_at(v_tile, mnmajor_step(ks)), 1);
      wgmma_commit();
    };
    // mask (masked tiles only) and fold tile `tile`'s scores; P into the fragments after `wait`
    auto softmax = [&](int tile, bool masked, float (&factor)[2]) {
      if (masked) mask_tile<BN>(s, p, w, ri, w.kv_begin + tile * BN, quad);
      return st.fold<BN>(s, p.sm_scale_log2, factor);
    };

    const int T = w.num_tiles;
    mbar_wait(&bars.q_full, 0);
    if constexpr (Tr::kQInRegs) {  // the mma.sync A layout of rows 16 w .. of this warpgroup's 64
      const int row = wg * 64 + (wtid / 32) * 16 + (lane & 15);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(q_frag[kk], smem + swizzled_offset<BM>(row, 2 * kk + (lane >> 4)));
    }
    if (T > 0) {
      PipeState<ST> ks, vs;  // K runs one tile ahead of V
      // ping-pong: warpgroup 0 takes the first turn; every turn taken is one given (the
      // last turn of warpgroup 1 is given to no one), so no barrier is left half-arrived
      if (Tr::kPingPong && wg == 0 && T > 1) named_arrive(1, 256);

      // the first tile (the last keys): S, softmax, P
      mbar_wait(&bars.k_full[ks.stage], ks.phase);
      issue_qk(ks.stage);
      wgmma_wait<0>();
      pin(s);
      mbar_arrive(&bars.k_empty[ks.stage]);
      {
        float factor[2];
        softmax(T - 1, w.masked_tiles > 0, factor);  // o is still zero: nothing to rescale
      }
      to_fragments<QT, BN>(s, frag);
      ks.advance();

      for (int i = 1; i < T; ++i) {
        const int tile = T - 1 - i;
        const bool masked = i < w.masked_tiles;
        float factor[2];
        bool moved;
        mbar_wait(&bars.k_full[ks.stage], ks.phase);
        if (Tr::kOverlap > 0) {
          if (Tr::kPingPong) named_sync(1 + wg, 256);
          issue_qk(ks.stage);
          mbar_wait(&bars.v_full[vs.stage], vs.phase);
          issue_pv(vs.stage);
          if (Tr::kPingPong && !(wg == 1 && i == T - 1)) named_arrive(2 - wg, 256);
          wgmma_wait<1>();  // S is ready, P V still runs
          pin(s);
          mbar_arrive(&bars.k_empty[ks.stage]);
          moved = softmax(tile, masked, factor);
          // The softmax must be done before the wait, or ptxas sinks half of its exp2s below it
          // (registers the wait does not name), out of the overlap: a shared-memory store of the
          // row sums (which need every exp2) is ordered before the wait.
          if constexpr (Tr::kOverlap == 2)
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(scratch), "f"(st.l[0] + st.l[1]) : "memory");
          wgmma_wait<0>();
          pin(o);
          pin(frag);
          mbar_arrive(&bars.v_empty[vs.stage]);
        } else {
          if (Tr::kPingPong) named_sync(1 + wg, 256);
          issue_qk(ks.stage);
          if (Tr::kPingPong && !(wg == 1 && i == T - 1)) named_arrive(2 - wg, 256);
          wgmma_wait<0>();
          pin(s);
          mbar_arrive(&bars.k_empty[ks.stage]);
          moved = softmax(tile, masked, factor);
          // P V of the previous tile after this tile's softmax: same arithmetic, no overlap
          mbar_wait(&bars.v_full[vs.stage], vs.phase);
          issue_pv(vs.stage);
          wgmma_wait<0>();
          pin(o);
          pin(frag);
          mbar_arrive(&bars.v_empty[vs.stage]);
        }
        if (__any_sync(0xffffffffu, moved)) rescale(o, factor);
        to_fragments<QT, BN>(s, frag);
        ks.advance();
        vs.advance();
      }
      // P V of the last tile processed (keys 0 ..)
      mbar_wait(&bars.v_full[vs.stage], vs.phase);
      issue_pv(vs.stage);
      wgmma_wait<0>();
      pin(o);
      pin(frag);
      mbar_arrive(&bars.v_empty[vs.stage]);
    }
    store_rows<OT, D>(p, w, ri, by_group, o, st, w.row0 + first_row, quad);
  }
}

}  // namespace cupy_fa
