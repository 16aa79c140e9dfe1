// A consumer warpgroup of the sm90 prefill family: 64 of the CTA's 128 (192) packed rows, over
// the key tiles the producer (sm90/load.cuh) puts in the K / V rings, last tile first.
//
// Per tile: S = Q K^T (wgmma, Q and K from shared memory), the mask on the tiles that need one,
// the online softmax and P in registers (sm90/softmax.cuh), O += P V (wgmma, P as the register
// A operand, V transposed from shared memory); at the end O / l into `out` or the split's
// partial. With separate qk / vo head dims (Traits::kHeadDimVo < kHeadDim) S's k is the qk head
// dim and O, P V's n and the epilogue the vo head dim's. FlashAttention-3's intra-warpgroup pipelining: step i issues S of tile i and P V of
// tile i - 1 together and runs the softmax of tile i while P V is in the tensor cores. With
// Traits::kPingPong the consumer warpgroups take turns at issuing Q K^T (named barriers 1, 2,
// 3), so one's softmax runs during the others' GEMMs.
//
// An fp8 cache (Traits::kFp8): the rings hold K and V widened to fp16, so both products run in
// fp16 (P too); bf16 queries are first rewritten in place as fp16 times a power of two per row
// (q_rows_to_fp16, each warpgroup its own 64 rows), and the scores' scale into base 2 is per row:
// k_scale of the KV head times the row's 2^-e (RowScale); V's scale joins each row's 1 / l.
#pragma once

namespace cupy_fa {
namespace sm90 {

// Over an fp8 cache with bf16 queries, the products run in fp16 (the K / V stages are fp16): once
// Q's tile has arrived each warpgroup rewrites its 64 rows in place as fp16 times 2^e_r
// (shared/common.cuh bf16_chunk_to_fp16, the mma.sync family's rule), row_scale[r] = 2^-e_r.
// A row's D / 8 chunks are D / 8 consecutive lanes of a warp (D 64, 128, 256).
template <int D, int BM, int SW>
__device__ __forceinline__ void q_rows_to_fp16(unsigned q_addr, unsigned row_scale, int wg, int wtid) {
  constexpr int CH = D / 8, RP = 128 / CH;
  static_assert(128 % CH == 0 && CH <= 32 && 64 % RP == 0, "a row's chunks in one warp, whole passes");
  const int chunk = wtid % CH;
#pragma unroll
  for (int i = 0; i < 64 / RP; ++i) {
    const int r = wg * 64 + wtid / CH + RP * i;
    const unsigned at = q_addr + swizzled_offset<BM, SW>(r, chunk);
    u32 x[4];
    ld_shared_v4(at, x);
    const int e = bf16_chunk_to_fp16<CH>(x);
    st_shared_v4(at, x);
    if (chunk == 0) asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(row_scale + 4 * r), "f"(pow2(-e)) : "memory");
  }
}

// The thread whose timeline a diagnosis build stamps (kernels/shared/trace.cuh): the first
// consumer warpgroup's first (the producer warpgroup is threads 0-127; thread 0 stamps the start).
constexpr unsigned kTraceThread = 128;

template <typename QT, typename OT, typename Tr>
__device__ __forceinline__ void consume(const AttentionParams& p, const PrefillWork& w, const FastDiv& by_group,
                                        PipeBarriers<Tr::kStages, Tr::kConsumerThreads>& bars,
                                        RingPos<Tr::kStages>& pos, unsigned q_addr, unsigned k_addr, unsigned v_addr, int wg, int wtid) {
  constexpr int D = Tr::kHeadDim, BN = Tr::kBlockN, BM = Tr::kBlockM, ST = Tr::kStages, SW = Tr::kSwizzle;
  constexpr int DV = Tr::kHeadDimVo;  // O's columns: V's head dim (D unless separate qk / vo head dims)
  // the products' element type: Q's, or fp16 over an fp8 cache (its stages hold fp16)
  typedef typename TypeIf<Tr::kFp8, __half, QT>::type AT;
  const int lane = wtid % 32, quad = lane % 4;
  const int first_row = wg * 64 + (wtid / 32) * 16 + lane / 4;  // tile row of row half 0
  RowInfo ri;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = w.row0 + first_row + 8 * h;
    ri.real[h] = row < w.rows;
    ri.token[h] = by_group.div(min(row, w.rows - 1));
  }
  const unsigned scratch = smem_addr(&bars.scratch[wg * 128 + wtid]);  // see the overlapped step

  float o[DV / 2];
#pragma unroll
  for (int i = 0; i < DV / 2; ++i) o[i] = 0.f;
  float s[BN / 2];
  unsigned frag[BN / 16][4];
  RowState st;
  st.reset();

  // the descriptors of this warpgroup's 64 Q rows (of every column block) and of stage 0's K
  // and V; a stage and a k-step are constant steps from them
  // (kUniformWg: the Q tile's address from lane 0 too, so ptxas keeps it in uniform registers)
  const unsigned q_wg = q_addr + wg * 64 * SW;
  const u64 q_desc = kmajor_desc<SW>(Tr::kUniformWg ? __shfl_sync(0xffffffffu, q_wg, 0) : q_wg),
            k_desc = kmajor_desc<SW>(k_addr);
  const u64 v_desc = mnmajor_desc<BN, SW>(v_addr);
  // S = Q K^T of the K tile in `stage` (issue only)
  auto issue_qk = [&](int stage) {
    const u64 k_tile = desc_at(k_desc, stage * Tr::kKVTileBytes);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const u64 kd = desc_at(k_tile, kmajor_step<BN, SW>(kk));
      Wgmma<BN, AT>::ss_kk(s, desc_at(q_desc, kmajor_step<BM, SW>(kk)), kd, kk > 0);
    }
    wgmma_commit();
  };
  // O += P V of the V tile in `stage` (issue only; DV columns: V's 64-column blocks)
  auto issue_pv = [&](int stage) {
    const u64 v_tile = desc_at(v_desc, stage * Tr::kVTileBytes);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) Wgmma<DV, AT>::rs_mn(o, frag[ks], desc_at(v_tile, mnmajor_step<SW>(ks)), 1);
    wgmma_commit();
  };
  // The scores' scale into base 2 (an fp8 cache: per row, RowScale, set once Q has arrived) and
  // the soft-cap's argument (the variant hooks: scores capped before the mask, sm90/softmax.cuh
  // soft_cap_tile, then taken with scale 1, or cap log2 e where the tanh comes unscaled)
  const bool capped = Tr::kVariants && p.soft_cap_log2 > 0.f;
  // (per row only where bf16 queries are rewritten as fp16, each row by its own power of two)
  constexpr bool kRowScaled = Tr::kFp8 && SameType<QT, __nv_bfloat16>::value;
  typedef typename TypeIf<kRowScaled, RowScale, UniformScale>::type Scale;
  Scale scale_log2, cap_arg;
  if constexpr (!Tr::kFp8) {
    scale_log2.s = capped ? soft_cap_fold_scale<Tr::kTanh>(p) : p.sm_scale_log2;
    cap_arg.s = soft_cap_arg<Tr::kTanh>(p);
  }
  // mask (the tiles that need it) and fold tile `tile`'s scores into the state
  auto softmax = [&](int tile, bool masked, float (&factor)[2]) {
    if constexpr (Tr::kVariants) {
      if (capped) soft_cap_tile<BN, Tr::kTanh>(s, cap_arg, p.soft_cap_log2);
    }
    if (masked) mask_tile<BN, Tr::kVariants>(s, p, w, ri, w.kv_begin + tile * BN, quad);
    if constexpr (Tr::kJointRows) return st.template fold_joint<BN>(s, scale_log2, factor);
    else return st.template fold<BN>(s, scale_log2, factor);
  };

  const int T = w.num_tiles;
  // with a sliding window (the variant hooks), tiles (by key order) that start before the window of
  // the item's last row need the mask too: the first `low_masked`, the last processed
  int low_masked = 0;
  if constexpr (Tr::kVariants) {
    if (p.window > 0 && T > 0) {
      const int to = window_first_key(p, w.prefix, by_group.div(min(w.row0 + BM, w.rows) - 1));
      low_masked = max(0, to - w.kv_begin + BN - 1) / BN;
    }
  }
  mbar_wait(&bars.q_full, 0);
  if constexpr (Tr::kFp8 && !kRowScaled) {  // fp16 queries: k_scale of the KV head
    // (capped: k_scale joins the tanh's argument only; the capped scores' own scale stays)
    const float k_scale = __ldg(p.k_scale + w.kv_head);
    scale_log2.s = capped ? soft_cap_fold_scale<Tr::kTanh>(p) : k_scale * p.sm_scale_log2;
    cap_arg.s = k_scale * soft_cap_arg<Tr::kTanh>(p);
  }
  if constexpr (kRowScaled) {
    // k_scale of the KV head, times each row's 2^-e of bf16 queries rewritten as fp16
    const float k_scale = __ldg(p.k_scale + w.kv_head);
    float row[2] = {k_scale, k_scale};
    {
      const unsigned row_scale = smem_addr(&bars) + Tr::kRowScaleOffset;
      q_rows_to_fp16<D, BM, SW>(q_addr, row_scale, wg, wtid);
      fence_async_shared();  // its stores, before this warpgroup's wgmmas read them
      named_sync(4 + wg, 128);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float f;
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(f) : "r"(row_scale + 4 * (first_row + 8 * h)) : "memory");
        row[h] *= f;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      scale_log2.s[h] = capped ? soft_cap_fold_scale<Tr::kTanh>(p) : row[h] * p.sm_scale_log2;
      cap_arg.s[h] = row[h] * soft_cap_arg<Tr::kTanh>(p);
    }
  }
  // (diagnosis builds, kernels/shared/trace.cuh: the ns this thread waits for K / V tiles, summed
  // in the trace buffer, and from its last P V's wait to its rows stored; folded away otherwise)
  unsigned long long epilogue_from = 0;
  auto wait_tile = [&](unsigned long long* full, int phase) {
    const unsigned long long from = trace_now();
    mbar_wait(full, phase);
    trace_add(kTraceWaitNs, trace_now() - from, kTraceThread);
  };
  if (T > 0) {
    PipeState<ST>& ks = pos.ks;  // K runs one tile ahead of V
    PipeState<ST>& vs = pos.vs;
    // ping-pong: the consumer warpgroups take turns in order (warpgroup wg syncs on named
    // barrier 1 + wg, then gives the turn to the next one's); warpgroup 0 takes the first
    // turn; every turn taken is one given (the last turn of the last warpgroup is given to no
    // one), so no barrier is left half-arrived
    constexpr int NWG = Tr::kConsumerWgs;
    const int next_wg = NWG == 2 ? 1 - wg : (wg + 1 == NWG ? 0 : wg + 1);
    if (Tr::kPingPong && wg == 0 && T > 1) named_arrive(1, 256);

    // the first tile (the last keys): S, softmax, P
    wait_tile(&bars.k_full[ks.stage], ks.phase);
    issue_qk(ks.stage);
    wgmma_wait<0>();
    pin(s);
    trace_stamp(kTraceFirstTile, kTraceThread);
    mbar_arrive(&bars.k_empty[ks.stage]);
    {
      float factor[2];
      softmax(T - 1, w.masked_tiles > 0 || (Tr::kVariants && T - 1 < low_masked), factor);  // o is still zero
    }
    to_fragments<AT, BN>(s, frag);
    ks.advance();
    // O += P V of the tile in frag from the V stage in turn, waited for, that stage freed (the
    // last tile's)
    auto pv_waited = [&]() {
      wait_tile(&bars.v_full[vs.stage], vs.phase);
      issue_pv(vs.stage);
      wgmma_wait<0>();
      pin(o);
      pin(frag);
      mbar_arrive(&bars.v_empty[vs.stage]);
      vs.advance();
    };

    for (int i = 1; i < T; ++i) {
      const int tile = T - 1 - i;
      const bool masked = i < w.masked_tiles || (Tr::kVariants && tile < low_masked);
      float factor[2];
      bool moved;
      wait_tile(&bars.k_full[ks.stage], ks.phase);
      if (Tr::kPingPong) named_sync(1 + wg, 256);
      issue_qk(ks.stage);
      wait_tile(&bars.v_full[vs.stage], vs.phase);
      issue_pv(vs.stage);
      if (Tr::kPingPong && !(wg == NWG - 1 && i == T - 1)) named_arrive(1 + next_wg, 256);
      wgmma_wait<1>();  // S is ready, P V still runs
      pin(s);
      mbar_arrive(&bars.k_empty[ks.stage]);
      moved = softmax(tile, masked, factor);
      // The softmax must be done before the wait, or ptxas sinks half of its exp2s below it
      // (they write registers the wait does not name), out of the overlap: a shared-memory
      // store of the row sums (which need every exp2) is kept before the wait.
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(scratch), "f"(st.l[0] + st.l[1]) : "memory");
      wgmma_wait<0>();
      pin(o);
      pin(frag);
      mbar_arrive(&bars.v_empty[vs.stage]);
      if (__any_sync(0xffffffffu, moved)) rescale(o, factor);
      to_fragments<AT, BN>(s, frag);
      ks.advance();
      vs.advance();
    }
    epilogue_from = trace_now();
    pv_waited();  // P V of the last tile processed (keys from kv_begin on)
  }
  // A page id outside the cache in this item: the producer set the flag before its last
  // arrival, which the waits above saw.
  const unsigned page_flag = bars.page_flag(smem_addr(bars.k_full));
  PrefillWork e = w;
  if constexpr (Tr::kStashItem) {  // the item from shared memory (prefill.cu): not held through the loop
    int* f = reinterpret_cast<int*>(&e);
    const unsigned at = smem_addr(&bars) + Tr::kItemOffset;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(PrefillWork) / 4); ++i) f[i] = shared_load(at + 4 * i);
  }
  const float v_scale = Tr::kFp8 ? __ldg(p.v_scale + e.kv_head) : 1.f;  // an fp8 cache: out = o v_scale / l
  store_rows<OT, DV, Tr::kVariants, Tr::kFp8>(p, e, ri, by_group, o, st, w.row0 + first_row, quad,
                                             shared_load(page_flag) != 0, v_scale);
  trace_store(kTraceEpilogueNs, T > 0 ? trace_now() - epilogue_from : 0ull, kTraceThread);
  trace_stamp(kTraceDone, kTraceThread);
}

}  // namespace sm90
}  // namespace cupy_fa
