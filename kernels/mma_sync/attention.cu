// Batch attention over a paged KV cache, the mma.sync family (FlashAttention-2 style, sm_80+):
// a composition of the phases in the headers beside it (docs/design.md, "Kernel phases").
//
//   work.cuh            which (request, row block, run of splits) this CTA runs
//   paged_kv.cuh        Q's row block once, K/V tiles through a STAGES-deep cp.async pipeline
//   kv_ring.cuh         or (a producer-warpgroup tile) a ring of mbarriers its producers fill
//   warp_mma.cuh        per warp: S = Q K^T, the variant on S, O += P V
//   variant.cuh         the attention variant: mask and logits hooks
//   softmax.cuh         the online-softmax state of a warp's rows
//   split_epilogue.cuh  the end of each split: direct out, a split partial, or the fold; the
//                       batch-invariance contract
//   merge.cu            merge_kernel, which folds split partials (its own launch)
//
// Inside a CTA, WARPS_M warps own 16 rows each and WARPS_N warps split every KV tile between
// them (decode has few rows but many keys, prefill the reverse); the states of the WARPS_N warps
// are merged in shared memory at the end of each split. A CTA may run several consecutive splits
// (splits_per_cta), each ending in its own result.
//
// A producer-warpgroup tile (TileTraits::kProducerWarps, the fp8 one-row decode tile) has a warpgroup
// more, which issues every K/V copy through the ring (kv_ring.cuh); the consumer warps run the same
// phases on the same stages, waiting on the ring instead of cp.async groups and CTA barriers.
#include "shared/common.cuh"
#include "shared/params.cuh"
#include "mma_sync/kv_ring.cuh"
#include "mma_sync/paged_kv.cuh"
#include "shared/softmax.cuh"
#include "mma_sync/split_epilogue.cuh"
#include "mma_sync/tile_traits.cuh"
#include "shared/trace.cuh"
#include "shared/variant.cuh"
#include "mma_sync/warp_mma.cuh"
#include "mma_sync/work.cuh"

namespace cupy_fa {

template <typename QT, typename KVT, typename OT, typename Traits>
__global__ void __launch_bounds__(Traits::kCtaThreads, Traits::kMinCtasPerSm)
attention_kernel(const __grid_constant__ AttentionParams p) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int CH = Traits::kChunks, STAGES = Traits::kStages;
  constexpr int DV = Traits::kHeadDimVo;  // V's and out's head dim (D unless separate qk / vo head dims)
  typedef WarpMma<Traits, QT, KVT> Mma;
  constexpr bool kRing = Traits::kProducerWarps > 0;
  static_assert(!kRing || Traits::kEpilogueOwnBuffer, "the ring frees a stage before the epilogue");

  extern __shared__ __align__(128) unsigned char smem[];
  QT* sQ = reinterpret_cast<QT*>(smem);
  KVT* sK = reinterpret_cast<KVT*>(sQ + BM * D);
  KVT* sV = sK + STAGES * BN * D;
  __shared__ float s_max[Traits::kWarps][16], s_sum[Traits::kWarps][16];
  // the epilogue's per-row values, computed once per row and split (SplitEpilogue::finish)
  __shared__ float s_factor[BM][Traits::kWarpsN];
  __shared__ float4 s_row[BM];
  __shared__ FoldStep s_step[Traits::kFoldInCta ? BM : 1][2];
  __shared__ int s_request, s_reason;    // for the status word at the CTA's end (no register held to it)
  __shared__ int s_bad;                  // a page id outside the cache was fetched (paged_kv.cuh)
  __shared__ int s_window_to;            // variant hooks: tiles starting before it take the window's mask
  __shared__ float s_row_unscale[Mma::kQToFp16 ? BM : 1];  // bf16 Q over fp8: each row's 2^-e_r (q_rows_to_fp16)
  __shared__ unsigned long long s_ring[kRing ? ProducerWarpRing<Traits>::kBarriers : 1];  // kv_ring.cuh

  // The merge kernel (launched programmatically after this one) may start its CTAs as
  // slots free up in this grid's last wave: it reads nothing of ours before it waits.
  allow_dependent_launch();
  trace_stamp(kTraceStart);
  // s_bad starts clear before any thread may set it (paged_kv.cuh): ordered here, where the CTA's
  // threads arrive together with nothing in flight, rather than after the work item's dependent
  // loads (where every warp would wait for the slowest one's before issuing its own copies)
  // (the kernels with the variant hooks keep one barrier after the work item: they need it for
  // s_window_to, and the D = 256 prefill tile at its register cap spills with both)
  // (so are the ring's barriers initialised, before either side touches them)
  if constexpr (kRing) {
    if (threadIdx.x == 0) ProducerWarpRing<Traits>(s_ring).init();
  }
  if constexpr (!Traits::kVariants) {
    if (threadIdx.x == 0) s_bad = 0;
    __syncthreads();
  }

  // ---- the work item -------------------------------------------------------------------
  const int work = blockIdx.x / p.num_kv_heads, kv_head = blockIdx.x % p.num_kv_heads;
  const int total_work = __ldg(p.work_indptr + p.batch_size);  // its load overlaps the search's
  const int request = request_of_work(p, work);
  if (work >= total_work) return;  // past the real work
  const WorkItem w = locate_work<Traits>(p, work, request);  // traps on a launch that breaks the tile's contract
  const int group = p.num_qo_heads / p.num_kv_heads;
  const FastDiv by_group{p.group_multiplier, p.group_shift, group};  // packed rows -> (token, head)
  const int rows = w.q_len * group;
  if constexpr (Traits::kRowHalves == 1) {
    // the host picks one row half only for requests whose rows fit it (schedule.tile_for: block_m / 2)
    if (!w.bad && rows > Traits::kBlockM / 2) __trap();
  }
  const DefaultVariant<Traits::kVariants> variant{p, w.request, w.q_len, w.kv_len - w.q_len, by_group};

  // the splits' keys are contiguous: one range, cut into splits every split_keys (a multiple
  // of BN, so no tile straddles two splits)
  const int split_keys = __ldg(p.split_keys + w.request);
  const int tiles_per_split = split_keys / BN;
  int kv_begin = w.split_first * split_keys;
  // a bad request (w.bad: status.cuh) reads no K/V at all: its splits end empty, written NaN
  int kv_end = w.bad ? kv_begin : variant.key_stop(min(w.kv_len, w.split_stop * split_keys), w.row0 + BM, rows);
  // With a sliding window (the variant hooks): the splits start at the request's key_base, and the
  // tiles before the row block's window are skipped (`skipped`, whole tiles from the run's first key,
  // so every tile read sits where it would unskipped; whole splits among them end empty below).
  int skipped = 0;
  if constexpr (Traits::kVariants) {
    const int key_base = variant.key_base();
    kv_begin += key_base;
    kv_end = w.bad ? kv_begin : variant.key_stop(min(w.kv_len, key_base + w.split_stop * split_keys), w.row0 + BM, rows);
    skipped = min((variant.window_first(kv_begin, w.row0) - kv_begin) / BN, (w.split_stop - w.split_first) * tiles_per_split);
    if (w.bad) skipped = 0;
    kv_begin += skipped * BN;
  }
  const int num_tiles = kv_end > kv_begin ? (kv_end - kv_begin + BN - 1) / BN : 0;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / Traits::kWarpsN, wn = warp % Traits::kWarpsN;
  const int chunk = tid % CH, row_in_pass = tid / CH;
  // the K/V copies' chunk column and first row (the Q copies' for fp16 / bf16 K/V; an fp8 row has
  // half the chunks)
  const int kv_chunk = tid % Traits::kKVChunks, kv_row_in_pass = tid / Traits::kKVChunks;
  // a warp whose 16 rows are all padding (decode in a 2-row-warp tile) only loads
  const bool warp_has_rows = w.row0 + wm * 16 < rows;

  // read at the CTA's end, after the loop's barriers; a bad request sets the flag as a fetch would
  if (tid == 0) s_request = w.request, s_reason = w.bad;
  if constexpr (Traits::kVariants) {  // (in shared memory: no register held across the tile loop for it)
    if (tid == 0) s_bad = w.bad != 0, s_window_to = variant.window_mask_to(w.row0 + BM, rows);
    __syncthreads();  // s_bad is set before any thread may set it; s_window_to, which every tile reads
  } else {
    if (tid == 0 && w.bad) atomicOr(&s_bad, 1);
  }

  // ---- a producer warpgroup issues every K/V tile into the ring, and is done
  const ProducerWarpRing<Traits> ring(s_ring);
  if constexpr (kRing) {
    if (warp >= Traits::kWarps) {
      regs_release<Traits::kProducerRegisters>();
      const int t = tid - Traits::kThreads;  // copies as consumer thread t would
      PagedKVProducer<Traits, KVT> producer(p, w.request, kv_head, sK, sV, kv_begin, kv_end, num_tiles,
                                            t / Traits::kKVChunks, t % Traits::kKVChunks, s_bad);
      produce_tiles(ring, producer, num_tiles);
      return;
    }
    regs_claim<Traits::kConsumerRegisters>();
  }

  // ---- loads: Q once, then the prologue: tiles 0 .. STAGES-2 in flight (Q rides in the first group;
  // with a producer warpgroup, Q is the consumers' only group)
  load_q_block<Traits, QT, KVBytes<KVT>::value == 1>(p, sQ, w.q_start, w.row0, rows, kv_head, group, by_group,
                                                    row_in_pass, chunk);
  PagedKVProducer<Traits, KVT> kv(p, w.request, kv_head, sK, sV, kv_begin, kv_end, num_tiles, kv_row_in_pass,
                                  kv_chunk, s_bad);
  if constexpr (!kRing) {
    kv.fetch_pages(0);
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
      if (t < num_tiles) {
        kv.issue(t, t);
        kv.fetch_pages(t + 1);
      }
      cp_async_commit();
    }
  } else {
    cp_async_commit();
    cp_async_wait<0>();
    if constexpr (!Mma::kQToFp16) Traits::sync_consumers();  // Q's block, which every consumer warp reads
  }

  OnlineSoftmaxRows<DV / 8> state;
  state.reset();
  const int mask_from = variant.mask_from(kv_end, w.row0);
  // With a window's skip, whole splits before the first tile left are empty for every row of the
  // block: a fold (the identity on empty splits) starts at the first split with a tile, as if the
  // CTA's run began there (same group: a folding CTA runs one group, or a whole row that writes
  // only its end); without a fold each still writes its empty partial after the loop.
  WorkItem run = w;
  if constexpr (Traits::kVariants) {
    if (num_tiles > 0) run.split_first += skipped / tiles_per_split;
  }
  SplitEpilogue<Traits, KVT, OT> epilogue(p, Traits::kVariants ? run : w, rows, kv_head, group, by_group, tid, warp,
                                          wm, sK, sV, s_max, s_sum, s_factor, s_row, s_step);
  Mma mma{lane, wm, wn};
  const float k_scale = KVBytes<KVT>::value == 1 ? __ldg(p.k_scale + kv_head) : 1.f;  // an fp8 cache's
  // bf16 queries over an fp8 cache: Q's block (which rides in the first group) rewritten as fp16
  // times a power of two per row, so S = Q K^T runs in fp16 (warp_mma.cuh)
  float row_scale[2] = {k_scale, k_scale};
  if constexpr (Mma::kQToFp16) {
    if constexpr (!kRing) cp_async_wait<STAGES - 2>();  // the prologue's first group: Q and tile 0
    Traits::sync_consumers();
    q_rows_to_fp16<Traits>(smem, s_row_unscale, row_in_pass, chunk);
    Traits::sync_consumers();
    mma.row_scales(row_scale, k_scale, s_row_unscale);
  }
  const typename Mma::AT* sQ_mma = reinterpret_cast<const typename Mma::AT*>(sQ);

  // ---- the main loop: one KV tile per iteration, each split's epilogue after its last tile
  int split_now = w.split_first, tiles_left = tiles_per_split;
  if constexpr (Traits::kVariants) {
    // the loop starts in the split of the first tile left after the window's skip (with no tile
    // left, the loop after it writes every split)
    if (num_tiles > 0) {
      split_now += skipped / tiles_per_split;
      tiles_left -= skipped % tiles_per_split;
    }
  }
  unsigned long long traced_wait = 0, traced_epilogue = 0;  // trace.cuh: 0 unless CUPY_FA_TRACE
  // one KV tile's math for this warp: S = Q K^T, the variant, the softmax update, O += P V
  auto tile_math = [&](int tile, int stage) {
    if (warp_has_rows) {
      float s[Mma::S_BLOCKS][4];
      mma.scores(s, sQ_mma, sK + stage * BN * D, tile == 0);
      // an fp8 cache: the scores times KV head kv_head's k_scale (and the row's 2^-e_r for bf16
      // queries; v_scale is the epilogue's)
      if constexpr (KVBytes<KVT>::value == 1) mma.scale_scores(s, row_scale);
      const int tile_key0 = kv_begin + tile * BN;
      mma.apply_variant(s, variant, tile_key0, w.row0, kv_end, rows,
                        tile_key0 + BN - 1 >= mask_from || (Traits::kVariants && tile_key0 < s_window_to));
      state.template update<Traits::kRowHalves>(s);
      mma.accumulate(state.acc, s, sV + stage * BN * DV);
    }
  };
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile % STAGES;
    if constexpr (!kRing) {
      const int ahead = tile + STAGES - 1;  // refills the stage computed last iteration
      if (ahead < num_tiles) {
        kv.issue(ahead, ahead % STAGES);
        kv.fetch_pages(ahead + 1);  // consumed next iteration
      }
      cp_async_commit();
    }
    const unsigned long long wait_from = trace_now();
    if constexpr (kRing) {
      ring.wait_full(tile);
    } else {
      cp_async_wait<STAGES - 1>();
      __syncthreads();
    }
    traced_wait += trace_now() - wait_from;
    if (tile == 0) trace_stamp(kTraceFirstTile);
    tile_math(tile, stage);
    if constexpr (kRing) {
      // this thread is done with the stage (a split's epilogue stages in a buffer of its own): the
      // producers refill it, during the epilogue too
      ring.release(tile);
    } else {
      // (the split's last tile, tested twice: a flag kept across the barrier costs the two-row
      // tile, at its register cap, a spill)
      if (tiles_left == 1 || tile + 1 == num_tiles) epilogue.publish(state);
      __syncthreads();  // the next iteration's loads overwrite this stage
    }
    if (--tiles_left == 0 || tile + 1 == num_tiles) {
      if constexpr (kRing) {
        epilogue.publish(state);
        Traits::sync_consumers();  // every consumer warp's state published
      }
      const bool bad = s_bad != 0;  // a page id outside the cache among the split's (or a bad request)
      const unsigned long long epilogue_from = trace_now();
      epilogue.finish(split_now++, stage, state.acc, bad);
      traced_epilogue += trace_now() - epilogue_from;
      state.reset();
      tiles_left = tiles_per_split;
    }
  }
  if constexpr (!kRing) cp_async_wait<0>();
  // splits the causal clip left without a tile still write their (empty) result; so do, without a
  // fold, those a window's skip passed whole (`run`: split_first .. run.split_first - 1), after them
  // (one call site: a second costs the two-row fold tile, at its register cap, a spill). A tile whose
  // epilogue spans every stage runs one split per CTA: a skip that passes it leaves no tile, so none.
  if constexpr (Traits::kVariants && Traits::kEpilogueInStage) {
    const int passed = p.fold_splits ? 0 : run.split_first - w.split_first;
    for (; split_now < w.split_stop + passed; ++split_now) {
      const int split = split_now < w.split_stop ? split_now : split_now - w.split_stop + w.split_first;
      epilogue.publish(state);
      __syncthreads();
      epilogue.finish(split, 0, state.acc, s_bad != 0);
    }
  } else {
    for (; split_now < w.split_stop; ++split_now) {
      epilogue.publish(state);
      Traits::sync_consumers();
      epilogue.finish(split_now, 0, state.acc, s_bad != 0);
    }
  }
  // a bad request is recorded once the CTA is done (status.cuh), off the loop's registers
  if (tid == 0 && s_bad) record_bad(p.status, s_request, s_reason ? s_reason : kPageOutOfRange);
  trace_stamp(kTraceDone);
  trace_store(kTraceEpilogueNs, traced_epilogue);
  trace_store(kTraceWaitNs, traced_wait);
}

}  // namespace cupy_fa
