// The end of a KV split in the mma.sync family: the WARPS_N warps' states of each row merged
// through shared memory, then the split's rows written one of three ways:
//
//   direct out        the request has one split: out (and lse) of the row, final
//   split partial     several splits: the split's output normalised by its own sum and rounded to
//                     the output type, and its base-2 LSE (partials.cuh), for merge_kernel
//   fold              the CTA folds its splits itself (fold_splits: a tile with a fold state):
//                     merge_kernel's steps on the partial it would have read, then out for a
//                     CTA that ran the whole row, or the group's fp32 state for merge_kernel
//
// ---- Batch invariance: the contract this file keeps ---------------------------------------
// A query row's bits depend only on its own keys, the split boundaries and the tile's (BLOCK_N,
// WARPS_N), never on the other rows of its tile or batch, nor on how splits are grouped into
// CTAs (splits_per_cta) or who merges them:
// * rows never mix in mma, masked keys add exact zeros (2^-inf), an empty split is the exact
//   identity of every merge (FoldStep kKeep / kTake);
// * every split ends in its own result, computed the same way whatever follows it: the
//   cross-warp merge below, then a partial rounded to the output type exactly like a final
//   output, so a row whose only real split goes through merge_kernel (x 1.0) gets the bits it
//   would have got unsplit;
// * splits are merged in one fixed order, by the split index alone: groups of kMergeGroup
//   consecutive splits in order, then the groups in order (softmax.cuh). merge_kernel, whatever
//   its shape, and a CTA that folds (row_phase's FoldSteps, then the per-column apply) take the
//   same steps with the same pinned roundings;
// * plan_kernel cuts small-q requests at fixed key positions (kernels/shared/plan.cu), so decode and
//   verify of the same token see the same splits: identical bits.
// A change here that computes any of this differently for some rows (another order, another
// rounding point, a shortcut for one split) breaks decode == verify.
// --------------------------------------------------------------------------------------------
//
// Shared memory: each warp publishes its rows' max and sum (publish) before the barrier that ends
// the split's last tile; after it every warp is done with `stage`, whose K/V tiles (or, for a
// tile whose epilogue does not fit a stage, all K/V stages; for the producer-warpgroup tile a
// buffer of its own, TileTraits::kEpilogueOwnBuffer) take the fp32 accumulators (finish), which
// syncs again before they are reused.
#pragma once

#include "shared/common.cuh"
#include "shared/params.cuh"
#include "shared/partials.cuh"
#include "shared/softmax.cuh"
#include "mma_sync/work.cuh"

namespace cupy_fa {

template <typename Traits, typename KVT, typename OT>
struct SplitEpilogue {
  // D: the columns of out, the partials and the fold state, V's head dim (Traits::kHeadDimVo);
  // DK: K's, which sizes a stage's K tile (equal unless separate qk / vo head dims)
  static constexpr int D = Traits::kHeadDimVo, DK = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  static constexpr int D_BLOCKS = D / 8;
  static constexpr int W = Traits::kStagedCols;  // columns one epilogue pass stages
  typedef ElemTraits<OT> E;

  const AttentionParams& p;
  const WorkItem& w;
  int rows, kv_head, group;
  FastDiv by_group;
  int partial_base;  // the request's first split-partial row (several splits only)
  int tid, warp, wm, g, tq;
  KVT* sK;
  KVT* sV;
  // The fold state of the tile's rows across the CTA's splits (fold_splits), after the K/V
  // stages: merge_kernel's two levels, the open group's state and the total of the groups
  // before it, o per (row, 4 columns) and (m, l) per row. Only the thread that folds an entry
  // reads or writes it.
  float4* fold_group_o;
  float4* fold_total_o;
  float4* fold_ml;  // (group m, group l, total m, total l)
  // the kernel's static shared memory for the epilogue
  float (&s_max)[Traits::kWarps][16];
  float (&s_sum)[Traits::kWarps][16];
  float (&s_factor)[BM][Traits::kWarpsN];           // each warp's factor onto the row's max
  float4 (&s_row)[BM];                              // the row's max, sum, 1 / sum, 1 / its folded total's sum
  FoldStep (&s_step)[Traits::kFoldInCta ? BM : 1][2];  // fold_splits: into the group, into the total
  // An fp8 cache: the accumulators have the layout of warp_mma.cuh's fp8 P V (a chunk's even and
  // odd columns in two blocks), and the KV head's v_scale joins the row's 1 / sum (row_phase), so
  // every result below, split partials and fold states too, is in V's units.
  static constexpr bool kFp8 = KVBytes<KVT>::value == 1;

  __device__ __forceinline__ SplitEpilogue(const AttentionParams& p, const WorkItem& w, int rows, int kv_head,
                                           int group, FastDiv by_group, int tid, int warp, int wm, KVT* sK, KVT* sV,
                                           float (&s_max)[Traits::kWarps][16], float (&s_sum)[Traits::kWarps][16],
                                           float (&s_factor)[BM][Traits::kWarpsN], float4 (&s_row)[BM],
                                           FoldStep (&s_step)[Traits::kFoldInCta ? BM : 1][2])
      : p(p),
        w(w),
        rows(rows),
        kv_head(kv_head),
        group(group),
        by_group(by_group),
        partial_base(w.splits > 1 ? __ldg(p.partial_indptr + w.request) : 0),
        tid(tid),
        warp(warp),
        wm(wm),
        g((tid & 31) >> 2),
        tq(tid & 3),
        sK(sK),
        sV(sV),
        fold_group_o(reinterpret_cast<float4*>(sV + Traits::kStages * BN * D)),
        fold_total_o(fold_group_o + BM * (D / 4)),
        fold_ml(fold_total_o + BM * (D / 4)),
        s_max(s_max),
        s_sum(s_sum),
        s_factor(s_factor),
        s_row(s_row),
        s_step(s_step) {}

  // warp w's [16][W] fp32 slice of the staging area ([8][W] in a buffer of its own: rows g only)
  __device__ __forceinline__ float* staged(int wi, int stage) const {
    if constexpr (Traits::kEpilogueOwnBuffer) {
      return reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sK) + Traits::kSmemKVRegion +
                                      Traits::kSmemFold) + wi * 8 * W;
    } else if constexpr (Traits::kEpilogueInStage) {
      constexpr int kPerTile = BN * DK * (int)sizeof(KVT) / (64 * W);  // 16 x W fp32 slices in one stage's K (or V) tile
      if constexpr (DK != D) {  // K's tile holds the first kPerTile slices, V's (narrower) the rest
        if (wi < kPerTile) return reinterpret_cast<float*>(sK + stage * BN * DK) + wi * 16 * W;
        return reinterpret_cast<float*>(sV + stage * BN * D) + (wi - kPerTile) * 16 * W;
      }
      KVT* tile_base = (wi < kPerTile ? sK : sV) + stage * BN * D;
      return reinterpret_cast<float*>(tile_base) + (wi % kPerTile) * 16 * W;
    } else {
      return reinterpret_cast<float*>(sK) + wi * 16 * D;
    }
  }

  // This warp's rows' max and sum into shared memory, before the barrier that ends the split's
  // last tile.
  __device__ __forceinline__ void publish(const OnlineSoftmaxRows<D_BLOCKS>& state) {
    float l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] = state.row_sum[h];
      l[h] = quad_sum(l[h]);
    }
    if (tq == 0) {
      s_max[warp][g] = state.row_max[0];
      s_max[warp][g + 8] = state.row_max[1];
      s_sum[warp][g] = l[0];
      s_sum[warp][g + 8] = l[1];
    }
  }

  // with fold_splits: whether a split is the last of its group of kMergeGroup (or of the CTA's
  // run), whose fold then moves the group into the total
  __device__ __forceinline__ bool group_closes(int split) const {
    return split % kMergeGroup == kMergeGroup - 1 || split + 1 == w.split_stop;
  }

  // A row's values for its column items, once per row (thread r for row r): the max and sum
  // over the warps, each warp's factor onto that max, and with fold_splits the split's steps
  // in merge_kernel's order: into the open group (empty at a group's first split), and at a
  // group's last split the group into the total (empty at the CTA's first group).
  // A bad CTA (a page id outside the cache, or a request refused: status.cuh) gives every row
  // a NaN sum: its out, partials, fold states and LSE all come out NaN (the 1 / sum below and
  // natural_lse / split_lse2 pass NaN on), and merge_kernel folds a NaN partial into NaN.
  __device__ __forceinline__ void row_phase(int split, bool bad) {
    const int row = w.row0 + tid;
    if (tid >= BM || row >= rows) return;
    const int rwm = tid >> 4, rl = tid & 15;
    float m_all = -INFINITY, l_all = 0.f;
#pragma unroll
    for (int wi = 0; wi < Traits::kWarpsN; ++wi) m_all = fmaxf(m_all, s_max[rwm * Traits::kWarpsN + wi][rl]);
#pragma unroll
    for (int wi = 0; wi < Traits::kWarpsN; ++wi) {
      const float f = rescale_factor(s_max[rwm * Traits::kWarpsN + wi][rl], m_all);
      s_factor[tid][wi] = f;
      l_all += s_sum[rwm * Traits::kWarpsN + wi][rl] * f;
    }
    if (bad) l_all = __int_as_float(0x7fc00000);  // NaN
    float total_inv = 0.f;
    if (Traits::kFoldInCta && p.fold_splits && w.splits > 1) {
      float4 ml = split != w.split_first ? fold_ml[tid] : make_float4(-INFINITY, 0.f, -INFINITY, 0.f);
      if (split % kMergeGroup == 0) ml.x = -INFINITY, ml.y = 0.f;
      const FoldStep into_group = FoldStep::of(ml.x, ml.y, split_lse2(m_all, l_all), 1.f);
      FoldStep into_total = FoldStep::of(ml.z, ml.w, -INFINITY, 0.f);  // keep: the group is still open
      if (group_closes(split)) into_total = FoldStep::of(ml.z, ml.w, into_group.m, into_group.l);
      fold_ml[tid] = make_float4(into_group.m, into_group.l, into_total.m, into_total.l);
      s_step[tid][0] = into_group;
      s_step[tid][1] = into_total;
      total_inv = inverse_sum(into_total.l);
      if constexpr (Traits::kVariants) {  // only the row's last fold uses it: its final sum takes the sink
        if (p.sinks != nullptr) total_inv = with_sink(into_total.m, into_total.l, sink_of(row)).inv;
      }
    }
    if constexpr (Traits::kVariants) {
      // A row of one split is final here; with a sink it ends as merge_kernel ends a row whose only
      // real split is this one (the partial, rounded to OT, then the sink: with_sink of its
      // (lse2, 1)), so a row keeps its bits whether verify splits it in two and decode does not
      // (write_item; .w is free for it: the fold's total is for rows of several splits).
      if (p.sinks != nullptr && w.splits == 1) total_inv = with_sink(split_lse2(m_all, l_all), 1.f, sink_of(row)).inv;
    }
    float inv = inverse_sum(l_all);
    if constexpr (kFp8) inv *= __ldg(p.v_scale + kv_head);  // out = o * v_scale / l
    s_row[tid] = make_float4(m_all, l_all, inv, total_inv);
  }

  // The attention sink of packed row `row`'s query head, in base 2 (AttentionParams::sinks).
  __device__ __forceinline__ float sink_of(int row) const {
    return __ldg(p.sinks + kv_head * group + by_group.mod(row)) * kLog2e;
  }

  // A final row's natural-log LSE from its state (m, l) as merge_kernel holds it, the sink included
  // where there is one.
  __device__ __forceinline__ float final_lse(float m, float l, int row) const {
    if constexpr (Traits::kVariants) {
      if (p.sinks != nullptr) return with_sink(m, l, sink_of(row)).lse;
    }
    return natural_lse(m, l);
  }

  // Split `split` ends: its rows' results from the warps' accumulators (staged in `stage`); a bad
  // CTA (`bad`: a page id outside the cache, or a refused request) writes its rows NaN (row_phase).
  __device__ __forceinline__ void finish(int split, int stage, const float (&acc)[D_BLOCKS][4], bool bad) {
    if constexpr (!Traits::kEpilogueInStage) cp_async_wait<0>();  // it stages over every K/V stage
    // One pass, or (fold tile) two passes of half of D each: a pass's accumulators are dead
    // once staged, which keeps the second pass's live registers down.
    constexpr int kPasses = Traits::kEpilogueInStage ? Traits::kEpiloguePasses : 1;
    constexpr int kPassBlocks = D_BLOCKS / kPasses;  // 8-column blocks per pass
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      // Only real rows are staged (a decode tile has group_size of its 16), each (row, column
      // pair) as one float2 at a swizzled pair: lanes with the same tq would otherwise hit the
      // same bank 8 ways.
      // staged_pair<W>(g, 4 j + tq) = g W + 2 tq + 8 (j ^ g % 8), and row g + 8 has the same swizzle
      // (W = 96: j ^ g % 4 for the last 4 blocks, common.cuh staged_pair_xor).
      float2* mine = reinterpret_cast<float2*>(staged(warp, stage) + g * W) + tq;
      const int first_real = w.row0 + wm * 16 + g;
      if constexpr (kFp8) {
        // chunk j / 2 of the pass: acc[db] its even columns, acc[db + 1] its odd ones; the thread's
        // columns 4 tq .. 4 tq + 3 of it are the column pairs 4 j + 2 tq and + 1, which
        // staged_pair<W>(g, .) puts at g W + 8 ((j + tq / 2) ^ g) + 4 (tq % 2) (+ 2): one float4
        float* mine4 = staged(warp, stage) + g * W + 4 * (tq & 1);
#pragma unroll
        for (int j = 0; j < kPassBlocks; j += 2) {
          const int db = pass * kPassBlocks + j;
          float4* o = reinterpret_cast<float4*>(mine4 + 8 * ((j + (tq >> 1)) ^ (g & 7)));
          if (first_real < rows) o[0] = make_float4(acc[db][0], acc[db + 1][0], acc[db][1], acc[db + 1][1]);
          if (!Traits::kEpilogueOwnBuffer && first_real + 8 < rows) {
            o[2 * W] = make_float4(acc[db][2], acc[db + 1][2], acc[db][3], acc[db + 1][3]);  // row g + 8
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kPassBlocks; ++j) {
          const int db = pass * kPassBlocks + j;
          float2* o = mine + (W % 64 == 0 ? 4 * (j ^ (g & 7)) : (4 * j) ^ staged_pair_xor<W>(g, 4 * j));
          if (first_real < rows) o[0] = {acc[db][0], acc[db][1]};
          if (first_real + 8 < rows) o[4 * W] = {acc[db][2], acc[db][3]};
        }
      }
      // after the staging (this pass's accumulators are dead), published by the barrier below
      if (pass == 0) row_phase(split, bad);
      Traits::sync_consumers();

      for (int idx = tid; idx < BM * (W / 4); idx += Traits::kThreads) {
        const int r = idx / (W / 4), c4_in_pass = idx % (W / 4), c4 = pass * (W / 4) + c4_in_pass;
        const int row = w.row0 + r;
        if (row >= rows) continue;
        const int rwm = r >> 4, rl = r & 15;
        // (a buffer of its own holds rows 0 .. 7: a row past them comes only from a bad request
        // (the kernel traps on any other), written NaN whatever it reads, so it reads in bounds)
        const int staged_row = Traits::kEpilogueOwnBuffer ? (rl & 7) : rl;
        const float4 rv = s_row[r];  // max, sum, 1 / sum, 1 / folded sum
        float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int wi = 0; wi < Traits::kWarpsN; ++wi) {
          const float f = s_factor[r][wi];
          const float4 part = *reinterpret_cast<const float4*>(staged(rwm * Traits::kWarpsN + wi, stage) +
                                                               staged_pair<W>(staged_row, 2 * c4_in_pass));
          o[0] += part.x * f;
          o[1] += part.y * f;
          o[2] += part.z * f;
          o[3] += part.w * f;
        }
        write_item(split, r, row, c4, rv, o);
      }
      Traits::sync_consumers();
    }
  }

  // Column item c4 (4 columns) of row r (packed row `row`) of split `split`, merged over the
  // warps (o, unnormalised): direct out, a split partial, or the fold.
  __device__ __forceinline__ void write_item(int split, int r, int row, int c4, float4 rv, const float (&o)[4]) {
    // the row's token (in the request), head and slot in `out`: only the writes that leave the
    // CTA compute them (a fold whose group goes on, most splits, needs none)
    auto token_of = [&]() { return by_group.div(row); };
    auto head_of = [&]() { return kv_head * group + by_group.mod(row); };
    auto out_slot_of = [&]() { return (i64)(w.q_start + token_of()) * p.num_qo_heads + head_of(); };
    // A split's partial is rounded to the output type exactly like a final output (see the
    // contract above).
    if (w.splits == 1) {
      const i64 out_slot = out_slot_of();
      if constexpr (Traits::kVariants) {
        if (p.sinks != nullptr) {  // merge_kernel's end of a row of one real split (row_phase)
          const uint2 packed = scaled4<OT>(o, rv.z);
          const float2 lo = E::unpack(packed.x), hi = E::unpack(packed.y);
          const float partial[4] = {lo.x, lo.y, hi.x, hi.y};
          store_scaled4(static_cast<OT*>(p.out) + out_slot * D + c4 * 4, partial, rv.w);
          if (c4 == 0 && p.lse != nullptr) p.lse[out_slot] = final_lse(split_lse2(rv.x, rv.y), 1.f, row);
          return;
        }
      }
      store_scaled4(static_cast<OT*>(p.out) + out_slot * D + c4 * 4, o, rv.z);
      if (c4 == 0 && p.lse != nullptr) p.lse[out_slot] = natural_lse(rv.x, rv.y);
    } else if (Traits::kFoldInCta && p.fold_splits) {
      // merge_kernel's steps (row_phase) on the partial it would have read, rounded to OT
      const int item = r * (D / 4) + c4;
      const uint2 packed = scaled4<OT>(o, rv.z);
      const float2 lo = E::unpack(packed.x), hi = E::unpack(packed.y);
      const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
      // The open group and the total exist once the CTA has folded a split into them. A folding
      // CTA's run starts at a group boundary (locate_work), except where a window's skip moved its
      // start into a group (attention.cu `run`, the variant hooks): then the group is open from
      // that split on, and the total from the CTA's first group on (its first split's group).
      const bool group_open = Traits::kVariants ? split % kMergeGroup != 0 && split != w.split_first
                                                : split % kMergeGroup != 0;
      const bool total_open = Traits::kVariants ? split / kMergeGroup != w.split_first / kMergeGroup
                                                : split >= w.split_first + kMergeGroup;
      const float4 group_o = s_step[r][0].apply(group_open ? fold_group_o[item] : zero,
                                                make_float4(lo.x, lo.y, hi.x, hi.y));
      if (!group_closes(split)) {  // the group goes on
        fold_group_o[item] = group_o;
      } else {
        const FoldStep& into_total = s_step[r][1];
        const float4 total_o =
            into_total.apply(total_open ? fold_total_o[item] : zero, group_o);
        if (split + 1 < w.split_stop) {
          fold_total_o[item] = total_o;
        } else if (w.groups == 1) {  // the CTA ran the whole row: the final result
          const float merged[4] = {total_o.x, total_o.y, total_o.z, total_o.w};
          const i64 out_slot = out_slot_of();
          store_scaled4(static_cast<OT*>(p.out) + out_slot * D + c4 * 4, merged, rv.w);
          if (c4 == 0 && p.lse != nullptr) {
            if constexpr (Traits::kVariants) {
              p.lse[out_slot] = final_lse(into_total.m, into_total.l, row);
            } else {
              p.lse[out_slot] = natural_lse(into_total.m, into_total.l);
            }
          }
        } else {  // one group of several: its state (fp32) for merge_kernel to fold in order
          const int head = head_of();
          const i64 group_row =
              partial_base / kPartialRowsPerGroupState + (i64)token_of() * w.groups + w.split_first / kMergeGroup;
          reinterpret_cast<float4*>(p.partial_out)[group_o_index(group_row, head, p.num_qo_heads, D / 4) + c4] =
              total_o;
          if (c4 == 0) {
            const i64 m_at = group_m_index(group_row, head, p.num_qo_heads);
            p.partial_lse[m_at] = into_total.m;
            p.partial_lse[m_at + p.num_qo_heads] = into_total.l;
          }
        }
      }
    } else {
      const i64 slot = ((i64)partial_base + (i64)token_of() * w.splits + split) * p.num_qo_heads + head_of();
      store_scaled4(static_cast<OT*>(p.partial_out) + slot * D + c4 * 4, o, rv.z);
      if (c4 == 0) p.partial_lse[slot] = split_lse2(rv.x, rv.y);
    }
  }
};

}  // namespace cupy_fa
