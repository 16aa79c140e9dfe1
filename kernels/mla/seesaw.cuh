// The two warpgroups of the MLA seesaw kernel (kernels/mla/wgmma.cu): 64 query rows of one request
// over one split of its keys, in 64-key blocks taken in pairs. Warpgroup 0 computes S = Q K^T of the
// even blocks (K buffer 0), warpgroup 1 of the odd ones (buffer 1), so the 576-column products are
// shared evenly; the output is split by columns: warpgroup 0 holds O's left 256 columns, warpgroup 1
// the right 256 (128 fp32 registers a thread each), and each multiplies both blocks' P into its
// half, its own block's P from registers and the other's through shared memory: P of a block is
// left in its K buffer's rope column block (S is done with it), where the other warpgroup reads it.
//
// Per pair (blocks b0 = 2i, b1 = 2i + 1), a row's online softmax runs b0 then b1, as one chain:
//   warpgroup 0: m0 = its offset after S0 (lazy: moved only when a score passes it by kLazyRescale),
//                P0 = 2^(S0 - m0) -> registers and shared memory, m0 -> shared memory   [arrive P0]
//                O_L = O_L f0 + P0 V0_L
//   warpgroup 1: [wait P0]  m1 = its offset after m0 and S1, P1 -> shared memory, m1    [arrive P1]
//                O_R = (O_R f0 + P0 V0_R) f1 + P1 V1_R
//   warpgroup 0: [wait P1]  O_L = O_L f1 + P1 V1_L
// (f0 = 2^(m - m0), f1 = 2^(m0 - m1), 1 unless the offset moved), and each keeps its part of the row's
// sum: warpgroup 0 of the even blocks' P, warpgroup 1 of the odd ones', each rescaled by both
// factors; the two parts add up at the end (0's, then 1's). Thread t of both warpgroups holds the
// same two rows (the m64nN accumulator layout), so the exchanges are per thread: P as 16 packed
// words a thread (the A fragments of P V) and the offsets as a float2, in slots only the two thread
// t's use, ordered by named barriers (each alternates strictly: neither warpgroup can arrive twice
// before the other waited once); a third tells warpgroup 1 that P1 was read before it refills
// buffer 1's high half.
//
// The K buffers are refilled for the next pair as soon as their last reader is done with each half
// (kernels/mla/wgmma_copy.cuh): buffer 0's low half after O_L += P0 V0_L, its high half after
// O_R += P0 V0_R; buffer 1's after the P1 products. S of a block never waits for more than that,
// and takes each 64-column block as soon as it is in (a barrier a column block).
//
// Batch invariance: a row's arithmetic depends on its own queries, its keys and the fixed block
// positions from its split's first key only (rows never mix in wgmma, a masked key adds an exact
// zero, the exchanges are per row), so a token's bits are the same in decode and in verify.
#pragma once

#include "shared/common.cuh"
#include "shared/softmax.cuh"
#include "shared/pipeline_sync.cuh"
#include "sm90/wgmma.cuh"
#include "mla/params.cuh"
#include "mla/work.cuh"
#include "mla/wgmma_copy.cuh"
#include "mla/epilogue.cuh"

namespace cupy_fa {
namespace mla {

constexpr int kBarP0 = 1, kBarP1 = 2, kBarP1Read = 3, kBarEnd = 4;  // named barriers (0: __syncthreads)
constexpr int kBarStage = 5;  // + wg: a warpgroup's staged rows (SeesawRole::store_rows)
constexpr int kBarWiden = 7;  // + wg: a warpgroup's phases of widening an fp8 half (wgmma_copy.cuh widen_half_fp8)

// The shared-memory plan: the query block, two K buffers (each one's rope column block carries its P
// once S is done with it), the offset and sum exchanges, the barriers, the page flag, the first
// partial row and the work item.
struct SeesawSmem {
  static constexpr int kQ = 0;                                  // 9 column blocks of 64 x 64
  static constexpr int kPInBuffer = 8 * kColumnBlockBytes;      // P's slots: a K buffer's rope block
  static constexpr int kK0 = kTileBytes64;
  static constexpr int kK1 = 2 * kTileBytes64;
  static constexpr int kM0 = 3 * kTileBytes64;                  // float2 [128]: warpgroup 0's offsets
  static constexpr int kM1 = kM0 + 128 * 8;                     // warpgroup 1's
  static constexpr int kL = kM1 + 128 * 8;                      // float2 [2][128]: the sums at the end
  static constexpr int kRowScale = kL + 2 * 128 * 8;            // float [64]: bf16 queries over fp8, 2^-e a row
  static constexpr int kBars = kRowScale + kBlockRows * 4;      // q_full, full[buffer][column block], raw[buffer][half]
  static constexpr int kRawBars = 1 + 2 * kLatentBlocks;        // (an fp8 cache's halves; unused over 16 bits)
  static constexpr int kNumBars = kRawBars + 4;
  static constexpr int kFlag = kBars + kNumBars * 8;            // int: a page id outside the cache
  static constexpr int kPartialBase = kFlag + 4;                // int: the request's first partial row
  static constexpr int kWork = kFlag + 8;                       // the CTA's Work, for its end
  static constexpr int kStagePitch = 256 * 2 + 16;              // a staged row of O's half (store_rows)
  static constexpr int kBytes = kWork + ((sizeof(Work) + 7) / 8) * 8;
  static constexpr int kAllocBytes = kBytes + 1024;             // the tiles start on a 1024-byte boundary
  static_assert(kAllocBytes <= 227 * 1024, "fits the sm_90 shared memory of one CTA");
};

template <typename T, bool FP8>
struct SeesawRole {
  static constexpr int NB = 32;  // 8-column blocks of a thread's O half (64 x 256 over 128 threads)
  // the products' element type: the queries', or fp16 over an fp8 cache (its blocks widen to fp16 by
  // one conversion a pair of values; bf16 queries are rewritten as fp16 times 2^e a row first:
  // queries_to_fp16, and the scores' scale is then per row)
  typedef typename TypeIf<FP8, __half, T>::type PT;
  static constexpr bool kRowScaled = FP8 && SameType<T, __nv_bfloat16>::value;
  const MlaParams& p;
  const Work& w;
  const FastDiv& by_head;
  unsigned base;  // the aligned shared-memory base
  int wtid, lane, quad;
  int first_row;  // the thread's row half 0 in the block (+ 8: half 1)
  int num_blocks, num_pairs, mask_blocks_from;
  float scale_log2;  // the softmax scale x log2(e) (times an fp8 cache's scale)
  float row_scale_log2[2];  // kRowScaled: scale_log2 x 2^-e of the thread's two rows (queries_to_fp16)
  float v_scale;     // an fp8 cache's scale on the output (1 over 16 bits)
  float o[4 * NB];
  float s[32];
  unsigned own[4][4];
  float m[2], l[2];

  __device__ __forceinline__ SeesawRole(const MlaParams& p_, const Work& w_, const FastDiv& by_head_, unsigned base_,
                                        int wtid_)
      : p(p_), w(w_), by_head(by_head_), base(base_), wtid(wtid_) {
    lane = wtid & 31, quad = lane & 3;
    first_row = (wtid >> 5) * 16 + (lane >> 2);
    num_blocks = (w.kv_end - w.kv_begin + kBlockRows - 1) / kBlockRows;
    num_pairs = (num_blocks + 1) / 2;
    mask_blocks_from = (w.mask_from - w.kv_begin) / kBlockRows;
    v_scale = FP8 ? __ldg(p.kv_scale) : 1.f;
    scale_log2 = p.sm_scale_log2 * v_scale;
#pragma unroll
    for (int i = 0; i < 4 * NB; ++i) o[i] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }

  __device__ __forceinline__ unsigned buffer(int b) const { return base + (b ? SeesawSmem::kK1 : SeesawSmem::kK0); }
  // buffer b's barriers, one a column block (its filling warpgroup's 128 threads arrive on each)
  __device__ __forceinline__ unsigned full_bars(int b) const { return base + SeesawSmem::kBars + 8 * (1 + kLatentBlocks * b); }
  // an fp8 cache: buffer b's half h's raw bytes (its filling warpgroup's 128 threads arrive)
  __device__ __forceinline__ unsigned raw_bar(int b, int h) const { return base + SeesawSmem::kBars + 8 * (SeesawSmem::kRawBars + 2 * b + h); }
  __device__ __forceinline__ int* flag() const {
    return reinterpret_cast<int*>(__cvta_shared_to_generic(base + SeesawSmem::kFlag));
  }

  // the scores' scale into base 2 of the thread's row half h
  __device__ __forceinline__ float score_scale(int h) const {
    if constexpr (kRowScaled) return row_scale_log2[h];
    else return scale_log2;
  }

  // bf16 queries over an fp8 cache, once the query block has arrived (all 256 threads): the block
  // rewritten as fp16 times 2^e a row (wgmma_copy.cuh q_block_to_fp16), fenced for the tensor cores,
  // and each thread's two rows' scales
  __device__ __forceinline__ void queries_to_fp16(int tid) {
    const unsigned row_scale = base + SeesawSmem::kRowScale;
    q_block_to_fp16(base + SeesawSmem::kQ, row_scale, tid);
    sm90::fence_async_shared();
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float f;
      asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(f) : "r"(row_scale + 4 * (first_row + 8 * h)) : "memory");
      row_scale_log2[h] = scale_log2 * f;
    }
  }

  static __device__ __forceinline__ sm90::u64 opaque(sm90::u64 x) {
    asm volatile("mov.b64 %0, %0;\n" : "+l"(x));
    return x;
  }

  // S = Q K^T of the block in buffer b as it comes in (the fill of pair `pair`; issue only): 36 k16
  // steps over the 576 columns, each 64-column block's four as soon as that block is in
  __device__ __forceinline__ void issue_scores(int b, int pair) {
    // (the descriptors through opaque moves: hoisted out of the pair loop, their 36 steps would take 72
    // registers the accumulators need; their high words opaque too, through base >> 24, which is 0 for
    // any shared address: ptxas then keeps them in the descriptors' registers instead of building the
    // constant again at every step, and each step is one 32-bit add, desc_at_lo)
    const unsigned hi_pad = base >> 24;
    const sm90::u64 q_desc = opaque(sm90::kmajor_desc(base + SeesawSmem::kQ) | ((sm90::u64)hi_pad << 32)),
                    k_desc = opaque(sm90::kmajor_desc(buffer(b)) | ((sm90::u64)hi_pad << 32));
#pragma unroll
    for (int kk = 0; kk < kLatentDim / 16; ++kk) {
      if (kk % 4 == 0) mbar::wait(full_bars(b) + 8 * (kk / 4), pair & 1), sm90::wgmma_fence();
      sm90::Wgmma<64, PT>::ss_kk(s, sm90::desc_at_lo(q_desc, sm90::kmajor_step<kBlockRows>(kk)),
                                sm90::desc_at_lo(k_desc, sm90::kmajor_step<kBlockRows>(kk)), kk > 0);
    }
    sm90::wgmma_commit();
  }

  // O_half += P V of the block in buffer b, V's columns 256 half .. (issue, commit and wait)
  __device__ __forceinline__ void pv(int b, int half, const unsigned (&frag)[4][4]) {
    const sm90::u64 v_desc = opaque(sm90::mnmajor_desc<kBlockRows>(buffer(b) + 4 * half * kColumnBlockBytes));
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) sm90::Wgmma<256, PT>::rs_mn(o, frag[ks], sm90::desc_at(v_desc, sm90::mnmajor_step(ks)), 1);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::pin(o);
    pin_frag(frag);  // held in registers until the products have read them
  }

  static __device__ __forceinline__ void pin_frag(const unsigned (&frag)[4][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) asm volatile("" ::"r"(frag[i][j]) : "memory");
  }

  // -inf for keys past the split or that a row may not see (the blocks that need it)
  __device__ __forceinline__ void mask(int block) {
    if (block < mask_blocks_from) return;
    const int key0 = w.kv_begin + block * kBlockRows;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = w.row0 + first_row + 8 * h;
      const bool real = row < w.rows;
      const int token = by_head.div(min(row, max(w.rows - 1, 0)));
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + 8 * j + 2 * quad + e;
          if (!(key < w.kv_end && (!real || row_sees(p, w, token, key)))) s[4 * j + 2 * h + e] = -INFINITY;
        }
      }
    }
  }

  // the rows' raw maxima over the block, times the scale (base 2)
  __device__ __forceinline__ void block_max(float (&mx)[2]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float x = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) x = fmaxf(x, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      x = quad_max(x);
      mx[h] = x * score_scale(h);  // -inf stays -inf (scale > 0)
    }
  }

  // the lazy offset after a block of maxima mx: moved only when a score passes it by kLazyRescale
  static __device__ __forceinline__ float next_offset(float m_now, float mx) { return mx > m_now + kLazyRescale ? mx : m_now; }
  static __device__ __forceinline__ float factor_of(float m_old, float m_new) {
    return m_new != m_old ? rescale_factor(m_old, m_new) : 1.f;
  }

  // P = 2^(S scale - offset) in place, this thread's part of its sums; P's A fragments into `frag`
  __device__ __forceinline__ void exponentials(const float (&offset_of)[2], float (&sum)[2], unsigned (&frag)[4][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float offset = safe_offset(offset_of[h]), scale = score_scale(h);
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = exp2f(fmaf(x, scale, -offset));
          acc += x;
        }
      }
      sum[h] = acc;
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      frag[ks][0] = ElemTraits<PT>::pack(s[8 * ks + 0], s[8 * ks + 1]);
      frag[ks][1] = ElemTraits<PT>::pack(s[8 * ks + 2], s[8 * ks + 3]);
      frag[ks][2] = ElemTraits<PT>::pack(s[8 * ks + 4], s[8 * ks + 5]);
      frag[ks][3] = ElemTraits<PT>::pack(s[8 * ks + 6], s[8 * ks + 7]);
    }
  }

  __device__ __forceinline__ void rescale(const float (&f)[2]) {
    const bool moved = f[0] != 1.f || f[1] != 1.f;
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int i = 0; i < 4 * NB; ++i) o[i] *= f[(i >> 1) & 1];
    }
  }

  // P's fragments (in buffer b's rope block) and the offsets through the exchange slots of thread wtid
  __device__ __forceinline__ void put_p(int b, const unsigned (&frag)[4][4]) const {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const unsigned addr = buffer(b) + SeesawSmem::kPInBuffer + 4 * (i * 128 + wtid);
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(frag[i >> 2][i & 3]) : "memory");
    }
  }
  __device__ __forceinline__ void get_p(int b, unsigned (&frag)[4][4]) const {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const unsigned addr = buffer(b) + SeesawSmem::kPInBuffer + 4 * (i * 128 + wtid);
      asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(frag[i >> 2][i & 3]) : "r"(addr) : "memory");
    }
  }
  __device__ __forceinline__ void put_m(int slot, const float (&mm)[2]) const {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(base + slot + 8 * wtid), "f"(mm[0]), "f"(mm[1]) : "memory");
  }
  __device__ __forceinline__ void get_m(int slot, float (&mm)[2]) const {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(mm[0]), "=f"(mm[1]) : "r"(base + slot + 8 * wtid) : "memory");
  }

  // One body for both warpgroups (wg 0: even blocks, O's left half, the K buffers' low halves;
  // wg 1: odd blocks, the right half, the high halves), so each product is issued from one place
  // (the kernel's code, and its compile time, stay half): `frag` holds the P each product takes, this
  // warpgroup's own (packed from S) or the other's (from the exchange slots).
  __device__ __forceinline__ void run(int wg) {
    unsigned frag[4][4];
    for (int i = 0; i < num_pairs; ++i) {
      const bool more = i + 1 < num_pairs;
      sm90::wgmma_wait<0>();
      sm90::pin(s);
      mask(2 * i + wg);
      float mx[2], m0[2], m_new[2], fa[2], fb[2], sum[2];
      block_max(mx);  // (the mask and maxima need nothing of the other warpgroup's)
      if (wg == 1) {
        sm90::named_sync(kBarP0, 256);  // warpgroup 0's offsets and P0
        get_m(SeesawSmem::kM0, m0);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (wg == 0) {
          m_new[h] = m0[h] = next_offset(m[h], mx[h]);
          fa[h] = factor_of(m[h], m0[h]);
          fb[h] = 1.f;
        } else {
          fa[h] = factor_of(m[h], m0[h]);
          m_new[h] = next_offset(m0[h], mx[h]);
          fb[h] = factor_of(m0[h], m_new[h]);
        }
      }
      exponentials(m_new, sum, own);
#pragma unroll
      for (int h = 0; h < 2; ++h) l[h] = l[h] * fa[h] * fb[h] + sum[h];
      if (wg == 1) {
        get_p(0, frag);  // P0
        put_p(1, own);
        put_m(SeesawSmem::kM1, m_new);
        sm90::named_arrive(kBarP1, 256);
      } else {
        put_p(0, own);
        put_m(SeesawSmem::kM0, m_new);
        sm90::named_arrive(kBarP0, 256);
        copy_frag(frag, own);
      }
      rescale(fa);
      KeyPages next;
      if (more) next = lookup_keys(p, w, 2 * i + 2, wtid);  // (their latency under the product)
      pv(0, wg, frag);  // O_half += P0 V0_half; this half of buffer 0 is free
      if (more) fill(0, 2 * i + 2, wg, next);
      if (wg == 0) {
        sm90::named_sync(kBarP1, 256);  // warpgroup 1's offsets and P1
        float m1[2];
        get_m(SeesawSmem::kM1, m1);
        get_p(1, frag);
        sm90::named_arrive(kBarP1Read, 256);  // buffer 1's rope block may be refilled
#pragma unroll
        for (int h = 0; h < 2; ++h) fb[h] = factor_of(m0[h], m1[h]), l[h] *= fb[h], m_new[h] = m1[h];
      } else {
        copy_frag(frag, own);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) m[h] = m_new[h];
      rescale(fb);
      if (more) next = lookup_keys(p, w, 2 * i + 3, wtid);
      pv(1, wg, frag);  // O_half += P1 V1_half; this half of buffer 1 is free
      if (wg == 1) sm90::named_sync(kBarP1Read, 256);  // (every pair: the barrier alternates strictly)
      if (more) {
        fill(1, 2 * i + 3, wg, next);
        begin_pair(wg, i + 1);
      }
    }
    sm90::wgmma_wait<0>();  // none in flight past the loop (ptxas cannot tell the last pair issued none)
    sm90::pin(s);
  }

  // The end: this warpgroup's 64 x 256 half of O (row sums l, summed over both warpgroups; partial_base:
  // partial_base_of, loaded at the CTA's start) rounded as
  // the mma.sync tile's store_rows rounds it, into its own K buffer (free once both warpgroups passed
  // kBarEnd; rows kStagePitch bytes apart, so the 8 rows of a warp's 4-byte writes fall on 32 banks),
  // then, after a named barrier of its own, a warp stores a row's 512 bytes as 32 whole 16-byte chunks
  // (out must be 16-byte aligned), its rows' targets walked (RowWalk), not each found again. The LSE
  // comes from warpgroup 0.
  __device__ __forceinline__ void store_rows(const Work& done, int partial_base, const float (&l)[2], bool bad,
                                             int wg) const {
    const unsigned stage = buffer(wg);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = first_row + 8 * h, row = done.row0 + r;
      const float inv = row_inverse(l[h], bad, v_scale);
      if (wg == 0 && quad == 0 && row < done.rows) row_lse(p, done, row_slot(p, done, by_head, row, partial_base), m[h], l[h], bad);
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const u32 v = ElemTraits<T>::pack(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(stage + r * SeesawSmem::kStagePitch + 2 * (8 * j + 2 * quad)), "r"(v)
                     : "memory");
      }
    }
    sm90::named_sync(kBarStage + wg, 128);
    const int first = wtid >> 5;  // warp w of the warpgroup stores rows w, w + 4, ...
    if (done.row0 + first >= done.rows) return;
    RowWalk<T, 4> to(p, done, by_head, done.row0 + first, partial_base);
    for (int r = first; r < kBlockRows && done.row0 + r < done.rows; r += 4) {
      u32 v[4];
      ld_shared_v4(stage + r * SeesawSmem::kStagePitch + 16 * lane, v);
      // one 16-byte store (a plain uint4 assignment compiles to four 4-byte ones here)
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(to.dst + 256 * wg + 8 * lane), "r"(v[0]),
                   "r"(v[1]), "r"(v[2]), "r"(v[3])
                   : "memory");
      to.step(p.num_heads);
    }
  }

  static __device__ __forceinline__ void copy_frag(unsigned (&to)[4][4], const unsigned (&from)[4][4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) to[k][e] = from[k][e];
  }

  // this warpgroup's half of buffer b for key block `block`, from its keys' page ids (lookup_keys)
  __device__ __forceinline__ void fill(int b, int block, int wg, const KeyPages& pages) {
    if constexpr (FP8) {
      if (wg == 0) fill_half_fp8<0>(p, w, pages, buffer(b), block, raw_bar(b, 0), wtid, flag());
      else fill_half_fp8<1>(p, w, pages, buffer(b), block, raw_bar(b, 1), wtid, flag());
    } else {
      if (wg == 0) fill_half<0>(p, w, pages, buffer(b), block, full_bars(b), wtid, flag());
      else fill_half<1>(p, w, pages, buffer(b), block, full_bars(b), wtid, flag());
    }
  }

  // an fp8 cache: this warpgroup's half of buffer b (filled for pair `pair`) widened in place
  __device__ __forceinline__ void widen(int b, int wg, int pair) {
    if (wg == 0) widen_half_fp8<0>(buffer(b), raw_bar(b, 0), pair & 1, full_bars(b), wtid, kBarWiden);
    else widen_half_fp8<1>(buffer(b), raw_bar(b, 1), pair & 1, full_bars(b), wtid, kBarWiden + 1);
  }

  // S of pair `pair` once both of its blocks are filled (16 bits: issued at once, each column block
  // taken as it lands). An fp8 cache: each warpgroup widens its halves of both buffers, warpgroup 0
  // its half of buffer 0 before its S and of buffer 1 under it, warpgroup 1 both before its S (which
  // waits for warpgroup 0's half of buffer 1: no cycle, as warpgroup 0's S needs only buffer 0).
  __device__ __forceinline__ void begin_pair(int wg, int pair) {
    if constexpr (FP8) {
      widen(0, wg, pair);
      if (wg == 1) widen(1, 1, pair);
      issue_scores(wg, pair);
      if (wg == 0) widen(1, 0, pair);
    } else {
      issue_scores(wg, pair);
    }
  }
};

}  // namespace mla
}  // namespace cupy_fa
