// Batch attention over a paged KV cache (FlashAttention-2 style on mma.sync).
//
// Work decomposition: for each request b and KV head, the q_len x group_size
// query rows that share that KV head are packed into rows (row = token * G +
// head_in_group), cut into tiles of kBlockM rows; the request's keys are cut
// into num_splits[b] contiguous splits. One CTA = one (row tile, run of
// splits_per_cta consecutive splits) of one (request, KV head). blockIdx.x =
// work item x H_kv + KV head, heads fastest: the H_kv CTAs that read the same
// key slots (one 16-byte chunk column each of the same [page, slot, H_kv, D]
// rows) run side by side, so DRAM sees whole slots rather than one head's
// slice of each. work_indptr (plan_kernel) gives each request's first work
// item. Grids are sized by capacity; CTAs past the real work exit after
// finding so (graph-safe).
//
// Inside a CTA, WARPS_M warps own 16 rows each and WARPS_N warps split every
// KV tile between them (decode has few rows but many keys, prefill the
// reverse); the states of the WARPS_N warps are merged in shared memory at the
// end. A request with one split writes `out` directly; with several, each
// split writes a normalised partial (in T, LSE in fp32) and merge_kernel
// combines them, unless the CTAs fold their splits themselves (fold_splits:
// merge_kernel's steps, in a tile variant with a fold state), a whole row or
// one group of 8 splits per CTA.
//
// Batch invariance: a query row's result depends only on the keys it sees,
// the split boundaries and (BLOCK_N, WARPS_N), never on the other rows of its
// tile (rows never mix in mma, masked keys add exact zeros, empty splits merge
// as the exact identity). plan_kernel cuts small-q requests at fixed key
// positions, so decode and verify of the same token give identical bits.
#include "common.cuh"
#include "params.cuh"
#include "softmax.cuh"

namespace cupy_fa {

// Tile constants per (head dim, warp layout, keys per tile, pipeline depth, fold state).
// The host picks the instance (cupy_fa/_build.py TileShape) and sizes the
// dynamic shared memory from the same numbers.
template <int HEAD_DIM, int WARPS_M, int WARPS_N, int BLOCK_N, int STAGES, bool FOLD>
struct TileTraits {
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kWarpsM = WARPS_M;
  static constexpr int kWarpsN = WARPS_N;
  static constexpr int kWarps = WARPS_M * WARPS_N;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * WARPS_M;                                   // query rows per CTA
  static constexpr int kBlockN = BLOCK_N;                                        // keys per KV tile
  static constexpr int kKeysPerWarp = kBlockN / WARPS_N;
  static constexpr int kStages = STAGES;                                         // cp.async pipeline depth
  static constexpr int kChunks = HEAD_DIM / 8;                                   // 16-byte chunks per row
  static constexpr int kRowStep = kThreads / kChunks;                            // rows one pass of the CTA loads
  static constexpr int kSmemQ = kBlockM * HEAD_DIM * 2;
  static constexpr int kSmemKV = kStages * kBlockN * HEAD_DIM * 2;               // K, and again V
  static constexpr int kSmemEpilogue = kWarps * 16 * HEAD_DIM * 4;               // fp32 per-warp accumulators
  // FOLD: the CTA carries a fold state and may run a whole row, or one group of kMergeGroup
  // splits of it, and fold them itself (AttentionParams::fold_splits): merge_kernel's steps,
  // so no split partials. The state costs shared memory, so the host picks this variant
  // only for batches whose longer CTAs still fill the GPU.
  static constexpr bool kFoldInCta = FOLD;
  // the fold state: merge_kernel's open group and total, o per element and (m, l) per row
  static constexpr int kSmemFold = kFoldInCta ? kBlockM * (2 * HEAD_DIM * 4 + 16) : 0;
  static constexpr int kSmemBytes = kSmemQ + 2 * kSmemKV + kSmemFold;
  // Decode-like tiles (warps over keys) are memory-bound: they live on warps in
  // flight, so hold the compiler to the CTAs per SM that shared memory allows,
  // as far as 128 registers per thread can feed them. Prefill tiles keep their
  // registers (compute-bound, 2 CTAs per SM by shared memory anyway).
  static constexpr int kCtasBySmem = (227 * 1024) / (kSmemBytes + 1024);
  static constexpr int kCtasBy128Regs = 65536 / (kThreads * 128);
  static constexpr int kMinCtasPerSm =
      (WARPS_N == 1 || kCtasBySmem < 1) ? 1 : (kCtasBySmem < kCtasBy128Regs ? kCtasBySmem : kCtasBy128Regs);
  // Q's mma fragments (32 registers at D = 128) held across the KV tiles, loaded from shared
  // memory once, where the register file gives every thread 255 (decode-like tiles at 256
  // threads per SM: the one-row folding tile): a third of a tile's ldmatrix reads fewer.
  static constexpr bool kQInRegisters = WARPS_N > 1 && HEAD_DIM <= 128 && kThreads * kMinCtasPerSm <= 256;

  // The end-of-split epilogue stages each warp's 16 x D fp32 accumulators in shared
  // memory. When they fit in one stage's K and V tiles (at once, or half of D at a time
  // for a two-row fold tile), it uses only the stage just consumed, so the pipeline keeps
  // running: a CTA may then run several consecutive splits (splits_per_cta) without a
  // new start-up per split.
  static constexpr int kEpiloguePasses = kWarps <= BLOCK_N / 16 ? 1 : (kFoldInCta ? 2 : 0);
  static constexpr bool kEpilogueInStage = kEpiloguePasses > 0;
  static constexpr int kStagedCols = kEpilogueInStage ? HEAD_DIM / kEpiloguePasses : HEAD_DIM;  // per pass

  static_assert(kKeysPerWarp % 16 == 0, "each warp needs whole k16 steps of keys");
  static_assert(kStages >= 2, "the pipeline refills one stage while another is consumed");
  static_assert(!kEpilogueInStage || kWarps * 16 * kStagedCols * 4 <= 4 * BLOCK_N * HEAD_DIM,
                "a pass's fp32 slices fit one stage's K and V tiles");
  static_assert(!kEpilogueInStage || (BLOCK_N * HEAD_DIM) % (32 * kStagedCols) == 0,
                "whole slices per K (or V) tile");
  static_assert(kStagedCols >= 64 || kEpiloguePasses <= 1, "staged_pair's swizzle needs 64 columns");
  static_assert(!FOLD || WARPS_N > 1, "a fold is for small-q tiles, whose requests split");
  static_assert(kThreads % kChunks == 0 && kBlockM % kRowStep == 0 && kBlockN % kRowStep == 0,
                "loads must tile the CTA evenly");
  static_assert(kSmemEpilogue <= 2 * kSmemKV, "epilogue reuses the K/V buffers");
};

// The state of one group of a row's splits, fp32 as merge_kernel holds it, where CTAs fold
// their groups (fold_splits) and a row has several. Group row gr takes split-partial rows
// kPartialRowsPerGroupState gr and the next (params.cuh): o as [H_q][D] fp32 over
// partial_out's two rows of T, m and l as partial_lse's two rows. A request's first group
// row is its partial_indptr entry over kPartialRowsPerGroupState.
__device__ __forceinline__ i64 group_o_index(i64 group_row, int head, int heads, int d4) {  // in float4s
  return (group_row * heads + head) * d4;
}
__device__ __forceinline__ i64 group_m_index(i64 group_row, int head, int heads) {  // l: heads further
  return kPartialRowsPerGroupState * group_row * heads + head;
}

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinCtasPerSm)
attention_kernel(const __grid_constant__ AttentionParams p) {
  constexpr int D = Traits::kHeadDim;
  constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN, KW = Traits::kKeysPerWarp;
  constexpr int CH = Traits::kChunks, STEP = Traits::kRowStep;
  constexpr int S_BLOCKS = KW / 8, D_BLOCKS = D / 8, K_STEPS = D / 16;
  typedef ElemTraits<T> E;

  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + BM * D;
  T* sV = sK + Traits::kStages * BN * D;
  __shared__ float s_max[Traits::kWarps][16], s_sum[Traits::kWarps][16];
  // the epilogue's per-row values, computed once per row and split (finish_split)
  __shared__ float s_factor[BM][Traits::kWarpsN];  // each warp's factor onto the row's max
  __shared__ float4 s_row[BM];                     // the row's max, sum, 1 / sum, 1 / its folded total's sum
  __shared__ FoldStep s_step[Traits::kFoldInCta ? BM : 1][2];  // fold_splits: into the group, into the total

  // The merge kernel (launched programmatically after this one) may start its CTAs as
  // slots free up in this grid's last wave: it reads nothing of ours before it waits.
  allow_dependent_launch();
  trace_stamp(0);  // the CTA starts

  // ---- which work item is this CTA --------------------------------------------
  const int work = blockIdx.x / p.num_kv_heads, kv_head = blockIdx.x % p.num_kv_heads;
  // the total's load overlaps the search's (past the real work the search returns
  // some request, harmlessly, and the CTA exits)
  const int total_work = __ldg(p.work_indptr + p.batch_size);
  const int b = upper_segment(p.work_indptr, p.batch_size, work);
  if (work >= total_work) return;
  const int q_start = __ldg(p.q_indptr + b);
  const int q_len = __ldg(p.q_indptr + b + 1) - q_start;
  const int kv_len = __ldg(p.kv_lens + b);
  const int splits = __ldg(p.num_splits + b);
  // This CTA runs splits [split_first, split_stop) of one row block, one after the
  // other; each still ends in its own result (out, a partial for merge_kernel, or a
  // fold of merge_kernel's steps), so how splits are grouped into CTAs never changes a
  // bit of the output.
  const int per_cta = p.splits_per_cta;
  if constexpr (!Traits::kEpilogueInStage) {
    if (per_cta != 1) __trap();  // plan_kernel counted work with it: the host must never send this
  }
  if constexpr (!Traits::kFoldInCta) {
    if (p.fold_splits) __trap();  // no fold state in this tile: the host must never send this
  }
  const int groups = (splits + per_cta - 1) / per_cta;
  const int local = work - __ldg(p.work_indptr + b);
  const int split_first = (local % groups) * per_cta;
  const int split_stop = min(split_first + per_cta, splits);
  // A CTA that folds takes merge_kernel's steps: for one group of its splits, or for all of
  // them (then the groups in order too), never for a run of groups that is not the whole row.
  if (p.fold_splits && (per_cta % kMergeGroup != 0 || (groups > 1 && per_cta != kMergeGroup))) __trap();
  const int row0 = (local / groups) * BM;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const FastDiv by_group{p.group_multiplier, p.group_shift, group};  // packed rows -> (token, head)
  const int rows = q_len * group;
  const int prefix = kv_len - q_len;  // keys that precede this step's queries

  // the splits' keys are contiguous: one range, cut into splits every split_keys
  // (a multiple of BN, so no tile straddles two splits)
  const int split_keys = __ldg(p.split_keys + b);
  const int tiles_per_split = split_keys / BN;
  const int kv_begin = split_first * split_keys;
  int kv_end = min(kv_len, split_stop * split_keys);
  if (p.mask_mode == 1) kv_end = min(kv_end, prefix + by_group.div(min(row0 + BM, rows) - 1) + 1);
  const int num_tiles = kv_end > kv_begin ? (kv_end - kv_begin + BN - 1) / BN : 0;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / Traits::kWarpsN, wn = warp % Traits::kWarpsN;
  const int chunk = tid % CH, row_in_pass = tid / CH;
  // a warp whose 16 rows are all padding (decode in a 2-row-warp tile) only loads
  const bool warp_has_rows = row0 + wm * 16 < rows;

  // ---- loads: Q once, K/V tiles through a STAGES-deep cp.async pipeline ----------
  // Loops run a constant number of times so they unroll: every row's address is
  // ready before the first cp.async issues, instead of one dependent page-id load
  // per row in a loop.
  {
    const T* q = static_cast<const T*>(p.q);
#pragma unroll
    for (int i = 0; i < BM / STEP; ++i) {
      const int r = row_in_pass + i * STEP, row = row0 + r;
      const bool valid = row < rows;
      const T* src = q;
      if (valid) {
        const int token = q_start + by_group.div(row), head = kv_head * group + by_group.mod(row);
        src = q + ((i64)token * p.num_qo_heads + head) * D + chunk * 8;
      }
      cp_async_16(sQ + swizzled<D>(r, chunk), src, valid);
    }
  }
  const int* page_row = p.page_table + (i64)b * p.page_table_stride;
  // Byte addresses of this thread's 16-byte chunk of the head in cache slot 0; a key's
  // chunk is one 32 x 32 -> 64-bit multiply away (H_kv x D x sizeof(T) < 2^31).
  const int slot_bytes = p.num_kv_heads * D * (int)sizeof(T);
  const char* k_chunk = reinterpret_cast<const char*>(static_cast<const T*>(p.k_cache) + kv_head * D + chunk * 8);
  const char* v_chunk = reinterpret_cast<const char*>(static_cast<const T*>(p.v_cache) + kv_head * D + chunk * 8);
  constexpr int KV_ROWS = BN / STEP;  // key rows this thread copies per tile
  // Page ids of the next tile to issue, fetched one tile ahead so the page-table
  // read (an L2 round trip every tile at page size 1) hides behind compute.
  int pages[KV_ROWS];
  // The page-size test is made once per tile, outside the unrolled row loops (the
  // pow2 and general paths are each straight-line code): inside them it put a branch
  // between every row's address arithmetic and its copies.
  auto fetch_rows = [&](int tile, auto page_of) {
#pragma unroll
    for (int i = 0; i < KV_ROWS; ++i) {
      const int key = kv_begin + tile * BN + row_in_pass + i * STEP;
      pages[i] = (tile < num_tiles && key < kv_end) ? __ldg(page_row + page_of(key)) : 0;
    }
  };
  auto fetch_pages = [&](int tile) {
    if (p.page_shift >= 0) {
      fetch_rows(tile, [&](int key) { return key >> p.page_shift; });
    } else {
      fetch_rows(tile, [&](int key) { return key / p.page_size; });
    }
  };
  auto issue_rows = [&](int tile, int stage, auto slot_of) {
    T* dk = sK + stage * BN * D;
    T* dv = sV + stage * BN * D;
#pragma unroll
    for (int i = 0; i < KV_ROWS; ++i) {
      const int r = row_in_pass + i * STEP, key = kv_begin + tile * BN + r;
      const bool valid = key < kv_end;
      const i64 offset = (i64)(valid ? slot_of(pages[i], key) : 0) * slot_bytes;  // < 2^31 cache slots
      cp_async_16(dk + swizzled<D>(r, chunk), k_chunk + offset, valid);
      cp_async_16(dv + swizzled<D>(r, chunk), v_chunk + offset, valid);
    }
  };
  auto issue_kv_tile = [&](int tile, int stage) {
    if (p.page_shift >= 0) {
      const int in_page = p.page_size - 1;
      issue_rows(tile, stage, [&](int page, int key) { return (page << p.page_shift) | (key & in_page); });
    } else {
      issue_rows(tile, stage, [&](int page, int key) { return page * p.page_size + key % p.page_size; });
    }
  };

  // prologue: tiles 0 .. STAGES-2 in flight (Q rides in the first group)
  fetch_pages(0);
#pragma unroll
  for (int t = 0; t < Traits::kStages - 1; ++t) {
    if (t < num_tiles) {
      issue_kv_tile(t, t);
      fetch_pages(t + 1);
    }
    cp_async_commit();
  }

  // ---- per-warp online softmax state: rows (lane/4) and (lane/4 + 8) -----------
  // row_max: the row's exponent offset, at most kLazyRescale below its max (softmax.cuh)
  float acc[D_BLOCKS][4], row_max[2], row_sum[2];
  auto reset_state = [&]() {  // the empty state: every split starts from it
#pragma unroll
    for (int i = 0; i < D_BLOCKS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  };
  reset_state();
  const int g = lane >> 2, tq = lane & 3;
  // Tiles whose last key reaches this need the mask: the end of the keys, the causal diagonal of
  // the tile's first query, or the custom mask's columns (this step's keys). One threshold, so
  // the per-tile test is one compare.
  const int mask_from = p.mask_mode == 1   ? min(kv_end, prefix + by_group.div(row0) + 1)
                        : p.mask_mode == 2 ? min(kv_end, prefix)
                                           : kv_end;

  // ---- end of a split: merge the WARPS_N states of each row through shared memory,
  // then write the split's rows (out, a partial, or the fold). Each warp publishes its
  // rows' max and sum (publish_row_state) before the barrier that ends the split's last
  // tile; after it every warp is done with `stage`, whose K/V tiles (or, for a tile whose
  // epilogue does not fit a stage, all K/V stages) take the fp32 accumulators
  // (finish_split), which syncs again before they are reused.
  const int partial_base = splits > 1 ? __ldg(p.partial_indptr + b) : 0;
  constexpr int W = Traits::kStagedCols;  // columns one epilogue pass stages
  // The fold state of the tile's rows across the CTA's splits (fold_splits), after the K/V
  // stages: merge_kernel's two levels, the open group's state and the total of the groups
  // before it, o per (row, 4 columns) and (m, l) per row. Only the thread that folds an
  // entry reads or writes it.
  float4* fold_group_o = reinterpret_cast<float4*>(sV + Traits::kStages * BN * D);
  float4* fold_total_o = fold_group_o + BM * (D / 4);
  float4* fold_ml = fold_total_o + BM * (D / 4);  // (group m, group l, total m, total l)
  auto staged = [&](int w, int stage) -> float* {  // warp w's [16][W] fp32 slice
    if constexpr (Traits::kEpilogueInStage) {
      constexpr int kPerTile = BN * D / (32 * W);  // 16 x W fp32 slices in one stage's K (or V) tile
      T* tile_base = (w < kPerTile ? sK : sV) + stage * BN * D;
      return reinterpret_cast<float*>(tile_base) + (w % kPerTile) * 16 * W;
    } else {
      return reinterpret_cast<float*>(sK) + w * 16 * D;
    }
  };
  auto publish_row_state = [&]() {
    float l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] = row_sum[h];
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    if (tq == 0) {
      s_max[warp][g] = row_max[0];
      s_max[warp][g + 8] = row_max[1];
      s_sum[warp][g] = l[0];
      s_sum[warp][g + 8] = l[1];
    }
  };
  // with fold_splits: whether a split is the last of its group of kMergeGroup (or of the CTA's
  // run), whose fold then moves the group into the total
  auto group_closes = [&](int split) { return split % kMergeGroup == kMergeGroup - 1 || split + 1 == split_stop; };
  // A row's values for its column items, once per row (thread r for row r): the max and sum
  // over the warps, each warp's factor onto that max, and with fold_splits the split's steps
  // in merge_kernel's order: into the open group (empty at a group's first split), and at a
  // group's last split the group into the total (empty at the CTA's first group).
  auto row_phase = [&](int split) {
    const int row = row0 + tid;
    if (tid >= BM || row >= rows) return;
    const int rwm = tid >> 4, rl = tid & 15;
    float m_all = -INFINITY, l_all = 0.f;
#pragma unroll
    for (int w = 0; w < Traits::kWarpsN; ++w) m_all = fmaxf(m_all, s_max[rwm * Traits::kWarpsN + w][rl]);
#pragma unroll
    for (int w = 0; w < Traits::kWarpsN; ++w) {
      const float f = rescale_factor(s_max[rwm * Traits::kWarpsN + w][rl], m_all);
      s_factor[tid][w] = f;
      l_all += s_sum[rwm * Traits::kWarpsN + w][rl] * f;
    }
    float total_inv = 0.f;
    if (Traits::kFoldInCta && p.fold_splits && splits > 1) {
      float4 ml = split != split_first ? fold_ml[tid] : make_float4(-INFINITY, 0.f, -INFINITY, 0.f);
      if (split % kMergeGroup == 0) ml.x = -INFINITY, ml.y = 0.f;
      const FoldStep into_group = FoldStep::of(ml.x, ml.y, split_lse2(m_all, l_all), 1.f);
      FoldStep into_total = FoldStep::of(ml.z, ml.w, -INFINITY, 0.f);  // keep: the group is still open
      if (group_closes(split))
        into_total = FoldStep::of(ml.z, ml.w, into_group.m, into_group.l);
      fold_ml[tid] = make_float4(into_group.m, into_group.l, into_total.m, into_total.l);
      s_step[tid][0] = into_group;
      s_step[tid][1] = into_total;
      total_inv = into_total.l > 0.f ? 1.f / into_total.l : 0.f;
    }
    s_row[tid] = make_float4(m_all, l_all, l_all > 0.f ? 1.f / l_all : 0.f, total_inv);
  };
  auto finish_split = [&](int split, int stage) {
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
      // staged_pair<W>(g, 4 j + tq) = g W + 2 tq + 8 (j ^ g % 8), and row g + 8 has the same swizzle.
      float2* mine = reinterpret_cast<float2*>(staged(warp, stage) + g * W) + tq;
      const int first_real = row0 + wm * 16 + g;
#pragma unroll
      for (int j = 0; j < kPassBlocks; ++j) {
        const int db = pass * kPassBlocks + j;
        float2* o = mine + 4 * (j ^ (g & 7));
        if (first_real < rows) o[0] = {acc[db][0], acc[db][1]};
        if (first_real + 8 < rows) o[4 * W] = {acc[db][2], acc[db][3]};
      }
      // after the staging (this pass's accumulators are dead), published by the barrier below
      if (pass == 0) row_phase(split);
      __syncthreads();

      for (int idx = tid; idx < BM * (W / 4); idx += Traits::kThreads) {
        const int r = idx / (W / 4), c4_in_pass = idx % (W / 4), c4 = pass * (W / 4) + c4_in_pass;
        const int row = row0 + r;
        if (row >= rows) continue;
        const int rwm = r >> 4, rl = r & 15;
        const float4 rv = s_row[r];  // max, sum, 1 / sum, 1 / folded sum
        float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < Traits::kWarpsN; ++w) {
          const float f = s_factor[r][w];
          const float4 part = *reinterpret_cast<const float4*>(staged(rwm * Traits::kWarpsN + w, stage) +
                                                               staged_pair<W>(rl, 2 * c4_in_pass));
          o[0] += part.x * f;
          o[1] += part.y * f;
          o[2] += part.z * f;
          o[3] += part.w * f;
        }
        // the row's token (in the request), head and slot in `out`: only the writes that leave the
        // CTA compute them (a fold whose group goes on, most splits, needs none)
        auto token_of = [&]() { return by_group.div(row); };
        auto head_of = [&]() { return kv_head * group + by_group.mod(row); };
        auto out_slot_of = [&]() { return (i64)(q_start + token_of()) * p.num_qo_heads + head_of(); };
        // A split's partial is rounded to T exactly like a final output, so a row whose
        // only real split goes through merge_kernel (x 1.0) gets the bits it would have
        // got unsplit: decode and verify stay identical.
        if (splits == 1) {
          const i64 out_slot = out_slot_of();
          store_scaled4(static_cast<T*>(p.out) + out_slot * D + c4 * 4, o, rv.z);
          if (c4 == 0 && p.lse != nullptr) p.lse[out_slot] = natural_lse(rv.x, rv.y);
        } else if (Traits::kFoldInCta && p.fold_splits) {
          // merge_kernel's steps (row_phase) on the partial it would have read, rounded to T
          const int item = r * (D / 4) + c4;
          const uint2 packed = scaled4<T>(o, rv.z);
          const float2 lo = E::unpack(packed.x), hi = E::unpack(packed.y);
          const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
          const float4 group_o = s_step[r][0].apply(split % kMergeGroup != 0 ? fold_group_o[item] : zero,
                                                    make_float4(lo.x, lo.y, hi.x, hi.y));
          if (!group_closes(split)) {  // the group goes on
            fold_group_o[item] = group_o;
          } else {
            const FoldStep& into_total = s_step[r][1];
            const float4 total_o =
                into_total.apply(split >= split_first + kMergeGroup ? fold_total_o[item] : zero, group_o);
            if (split + 1 < split_stop) {
              fold_total_o[item] = total_o;
            } else if (groups == 1) {  // the CTA ran the whole row: the final result
              const float merged[4] = {total_o.x, total_o.y, total_o.z, total_o.w};
              const i64 out_slot = out_slot_of();
              store_scaled4(static_cast<T*>(p.out) + out_slot * D + c4 * 4, merged, rv.w);
              if (c4 == 0 && p.lse != nullptr) p.lse[out_slot] = natural_lse(into_total.m, into_total.l);
            } else {  // one group of several: its state (fp32) for merge_kernel to fold in order
              const int head = head_of();
              const i64 group_row =
                  partial_base / kPartialRowsPerGroupState + (i64)token_of() * groups + split_first / kMergeGroup;
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
          const i64 slot = ((i64)partial_base + (i64)token_of() * splits + split) * p.num_qo_heads + head_of();
          store_scaled4(static_cast<T*>(p.partial_out) + slot * D + c4 * 4, o, rv.z);
          if (c4 == 0) p.partial_lse[slot] = split_lse2(rv.x, rv.y);
        }
      }
      __syncthreads();
    }
  };

  u32 q_frag[Traits::kQInRegisters ? K_STEPS : 1][4];  // kQInRegisters: Q's fragments, from the first tile on
  int split_now = split_first, tiles_left = tiles_per_split;
  unsigned long long traced_wait = 0, traced_epilogue = 0;  // ns at the loop-top wait, in epilogues (CUPY_FA_TRACE)
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile % Traits::kStages;
    const int ahead = tile + Traits::kStages - 1;  // refills the stage computed last iteration
    if (ahead < num_tiles) {
      issue_kv_tile(ahead, ahead % Traits::kStages);
      fetch_pages(ahead + 1);  // consumed next iteration
    }
    cp_async_commit();
    const unsigned long long wait_from = trace_now();
    cp_async_wait<Traits::kStages - 1>();
    __syncthreads();
    traced_wait += trace_now() - wait_from;
    if (tile == 0) trace_stamp(1);  // its first K/V tile has arrived

    if (warp_has_rows) {
      const T* tK = sK + stage * BN * D;
      const T* tV = sV + stage * BN * D;

      // S = Q K^T for this warp's 16 rows x KW keys
      float s[S_BLOCKS][4];
#pragma unroll
      for (int i = 0; i < S_BLOCKS; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      auto load_q = [&](int kk, u32(&a)[4]) {
        ldmatrix_x4(a, sQ + swizzled<D>(wm * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      };
      if constexpr (Traits::kQInRegisters) {
        if (tile == 0) {  // Q arrived with the first tile
#pragma unroll
          for (int kk = 0; kk < K_STEPS; ++kk) load_q(kk, q_frag[kk]);
        }
      }
#pragma unroll
      for (int kk = 0; kk < K_STEPS; ++kk) {
        u32 a[4];
        if constexpr (Traits::kQInRegisters) {
          a[0] = q_frag[kk][0], a[1] = q_frag[kk][1], a[2] = q_frag[kk][2], a[3] = q_frag[kk][3];
        } else {
          load_q(kk, a);
        }
#pragma unroll
        for (int nb = 0; nb < S_BLOCKS / 2; ++nb) {
          u32 kb[4];
          ldmatrix_x4(kb, tK + swizzled<D>(wn * KW + nb * 16 + (lane & 7) + ((lane >> 4) << 3),
                                           kk * 2 + ((lane >> 3) & 1)));
          Mma<T>::run(s[2 * nb], a, kb[0], kb[1]);
          Mma<T>::run(s[2 * nb + 1], a, kb[2], kb[3]);
        }
      }

      // scale into base 2 and mask (only tiles that touch a boundary pay for it)
      const int tile_key0 = kv_begin + tile * BN;
      const int tile_last = tile_key0 + BN - 1;
      const bool need_mask = tile_last >= mask_from;
#pragma unroll
      for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nb][e] *= p.sm_scale_log2;
      }
      if (need_mask) {  // one test per tile: the common path stays straight-line
#pragma unroll
        for (int nb = 0; nb < S_BLOCKS; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = tile_key0 + wn * KW + nb * 8 + tq * 2 + (e & 1);
            const int row = row0 + wm * 16 + g + ((e >> 1) << 3);
            bool visible = key < kv_end;
            if (visible && row < rows) {
              const int i = by_group.div(row);  // query index within the request
              if (p.mask_mode == 1) {
                visible = key <= prefix + i;
              } else if (p.mask_mode == 2 && key >= prefix) {
                visible = __ldg(p.custom_mask + __ldg(p.mask_indptr + b) + i * q_len + (key - prefix)) != 0;
              }
            }
            if (!visible) s[nb][e] = -INFINITY;
          }
        }
      }

      // online softmax update, per row half h (rows g and g + 8). A row keeps its offset m
      // until a score passes it by more than kLazyRescale (softmax.cuh), so the accumulator
      // rescale (a multiply per element) runs only on the rare tiles where some row of the
      // warp moved its m; the rows that did not multiply by exactly 1 then.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < S_BLOCKS; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float correction = 1.f;
        bool moved = false;
        if (mx > row_max[h] + kLazyRescale) {  // also a row's first keys (m = -inf)
          correction = rescale_factor(row_max[h], mx);
          moved = row_max[h] != -INFINITY;  // from -inf the accumulators are still zero
          row_max[h] = mx;
        }
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
          for (int db = 0; db < D_BLOCKS; ++db) {
            acc[db][2 * h] *= correction;
            acc[db][2 * h + 1] *= correction;
          }
        }
        const float offset = safe_offset(row_max[h]);
        float sum = 0.f;
#pragma unroll
        for (int nb = 0; nb < S_BLOCKS; ++nb) {
          s[nb][2 * h] = exp2f(s[nb][2 * h] - offset);
          s[nb][2 * h + 1] = exp2f(s[nb][2 * h + 1] - offset);
          sum += s[nb][2 * h] + s[nb][2 * h + 1];
        }
        row_sum[h] = row_sum[h] * correction + sum;
      }

      // O += P V: the S accumulator layout is exactly the A-operand layout
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
          Mma<T>::run(acc[2 * db], a, vb[0], vb[1]);
          Mma<T>::run(acc[2 * db + 1], a, vb[2], vb[3]);
        }
      }
    }
    // (the split's last tile, tested twice: a flag kept across the barrier costs the two-row
    // tile, at its register cap, a spill)
    if (tiles_left == 1 || tile + 1 == num_tiles) publish_row_state();
    __syncthreads();  // the next iteration's loads overwrite this stage
    if (--tiles_left == 0 || tile + 1 == num_tiles) {
      const unsigned long long epilogue_from = trace_now();
      finish_split(split_now++, stage);
      traced_epilogue += trace_now() - epilogue_from;
      reset_state();
      tiles_left = tiles_per_split;
    }
  }
  cp_async_wait<0>();
  // splits the causal clip left without a tile still write their (empty) result
  for (; split_now < split_stop; ++split_now) {
    publish_row_state();
    __syncthreads();
    finish_split(split_now, 0);
  }
  trace_stamp(2);  // it is done
  trace_store(3, traced_epilogue);
  trace_store(4, traced_wait);
}

// Merge shapes: HEADS_PER_CTA heads of one token per CTA, HEAD_DIM / 4 lanes per
// head (a float4 each), WAYS ways folding groups of splits in parallel. "Wide"
// (many heads, one way) suits many tokens with few splits each, "deep" (one
// head, several ways) one long request with hundreds of splits; the host picks.
template <int HEAD_DIM, int HEADS_PER_CTA, int WAYS, int MAX_SPLITS>
struct MergeTraits {
  static constexpr int kLanes = HEAD_DIM / 4;
  static constexpr int kHeadsPerCta = HEADS_PER_CTA;
  static constexpr int kWays = WAYS;
  static constexpr int kThreads = kLanes * HEADS_PER_CTA * WAYS;
  // The fold order is fixed by the split index alone, never by the shape above: each
  // group of kGroup consecutive splits is folded in order, then the groups in order.
  // Whichever variant merges a row, its bits are the same (batch invariance).
  static constexpr int kGroup = kMergeGroup;
  static constexpr int kMaxGroups = (MAX_SPLITS + kGroup - 1) / kGroup;
  static_assert(kThreads <= 1024, "one CTA");
};

// Combines the splits of each (token, head) of split requests (each split is the
// state m = its lse2, l = 1, o = its normalised partial). Grid: (token capacity,
// ceil(H_q / HEADS_PER_CTA)); tokens of unsplit requests exit after the wait.
template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads) merge_kernel(const __grid_constant__ MergeParams p) {
  typedef ElemTraits<T> E;
  constexpr int LANES = Traits::kLanes, HPC = Traits::kHeadsPerCta, WAYS = Traits::kWays, GROUP = Traits::kGroup;
  const int token = blockIdx.x;
  const int c4 = threadIdx.x % LANES, in_cta = (threadIdx.x / LANES) % HPC, way = threadIdx.x / (LANES * HPC);
  const int head = blockIdx.y * HPC + in_cta;
  // Plan metadata first: plan_kernel finished before the attention kernel began, so this
  // overlaps the attention kernel's last wave when launched programmatically. Every CTA
  // then waits for the attention kernel, so the merge never completes before it.
  const bool real_token = token < __ldg(p.q_indptr + p.batch_size);
  const int b = real_token ? upper_segment(p.q_indptr, p.batch_size, token) : 0;
  const int splits = real_token ? __ldg(p.num_splits + b) : 0;
  const int groups = (splits + GROUP - 1) / GROUP;
  // fold_groups: the attention kernel folded each group itself, so a row with one group is
  // final already, and a row with several left one state per group (group_o_index)
  const int inputs = p.fold_groups ? groups : splits;  // partial rows per (token, head)
  const i64 prow0 = inputs > 1 ? __ldg(p.partial_indptr + b) / (p.fold_groups ? kPartialRowsPerGroupState : 1) +
                                     (i64)(token - __ldg(p.q_indptr + b)) * inputs
                               : 0;  // the first of this token's partial rows, or group-state rows
  wait_for_prior_grid();  // the partials below are the attention kernel's
  if (inputs <= 1) return;
  const bool live = head < p.num_qo_heads;  // the last CTA of a head count HPC does not divide
  const uint2* partial = reinterpret_cast<const uint2*>(p.partial_out);  // 4 elements of T per lane

  // A way folds groups way, way + WAYS, ...; a group's GROUP loads are all issued
  // before its first fold, so a row pays a few memory latencies, not one per split.
  MergeState total = MergeState::empty();
  constexpr int kSlots = WAYS > 1 ? Traits::kMaxGroups : 1;  // group states handed to way 0
  __shared__ float4 s_o[kSlots][HPC][LANES];
  __shared__ float2 s_ml[kSlots][HPC];  // (m, l): the same in every lane of a head
  if (groups > Traits::kMaxGroups) __trap();  // plan_kernel never exceeds MAX_SPLITS
  for (int grp = way; grp < groups && live; grp += WAYS) {
    // __ldcg, not __ldg: launched programmatically, this kernel was already running while
    // the attention kernel wrote the partials, so they are not read-only for its whole lifetime
    MergeState group_state = MergeState::empty();
    if (p.fold_groups) {  // the group's state as the attention kernel left it
      const i64 m_at = group_m_index(prow0 + grp, head, p.num_qo_heads);
      const float4* group_o = reinterpret_cast<const float4*>(p.partial_out);
      group_state = MergeState{__ldcg(p.partial_lse + m_at), __ldcg(p.partial_lse + m_at + p.num_qo_heads),
                               __ldcg(group_o + group_o_index(prow0 + grp, head, p.num_qo_heads, LANES) + c4)};
    } else {
      float lse_in[GROUP];
      uint2 packed[GROUP];
#pragma unroll
      for (int u = 0; u < GROUP; ++u) {
        const int s = grp * GROUP + u;
        const i64 prow = (prow0 + min(s, splits - 1)) * p.num_qo_heads + head;
        packed[u] = __ldcg(partial + prow * LANES + c4);
        lse_in[u] = s < splits ? __ldcg(p.partial_lse + prow) : -INFINITY;  // past the end: the identity
      }
#pragma unroll
      for (int u = 0; u < GROUP; ++u) {
        const float2 lo = E::unpack(packed[u].x), hi = E::unpack(packed[u].y);
        group_state.fold(lse_in[u], 1.f, make_float4(lo.x, lo.y, hi.x, hi.y));
      }
    }
    if constexpr (WAYS == 1) {
      total.fold(group_state);
    } else {
      s_o[grp][in_cta][c4] = group_state.o;
      if (c4 == 0) s_ml[grp][in_cta] = make_float2(group_state.m, group_state.l);
    }
  }
  if constexpr (WAYS > 1) {  // groups in order, from shared memory
    __syncthreads();
    if (way != 0 || !live) return;
    for (int grp = 0; grp < groups; ++grp) {
      const float2 ml = s_ml[grp][in_cta];
      total.fold(ml.x, ml.y, s_o[grp][in_cta][c4]);
    }
  }
  if (!live) return;
  const float merged[4] = {total.o.x, total.o.y, total.o.z, total.o.w};
  const i64 o_off = ((i64)token * p.num_qo_heads + head) * (4 * LANES) + c4 * 4;
  store_scaled4(static_cast<T*>(p.out) + o_off, merged, total.l > 0.f ? 1.f / total.l : 0.f);
  if (c4 == 0 && p.lse != nullptr) p.lse[(i64)token * p.num_qo_heads + head] = natural_lse(total.m, total.l);
}

}  // namespace cupy_fa
