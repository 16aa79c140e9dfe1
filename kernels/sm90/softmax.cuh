// The consumer warpgroups' arithmetic in the sm90 prefill family: the mask of a key tile,
// the online softmax of its scores (base 2, softmax.cuh's conventions), P in registers for
// the P V wgmma, and the epilogue. Each consumer warpgroup owns 64 of the tile's packed rows;
// in the m64nN accumulator layout thread (warp w, lane 4 g + q) holds rows 16 w + g and
// 16 w + g + 8 ("row halves" h = 0, 1), columns 8 j + 2 q and 8 j + 2 q + 1 of every 8-column
// block j: element 4 j + 2 h + e. Rows never mix: a row's result depends only on its own
// scores, the key tiles' boundaries and their order (see sm90/prefill.cu).
#pragma once

namespace cupy_fa {
namespace sm90 {

// What the thread knows of its two rows: whether each is a real row, its token in the
// request and (causal) the last key it sees.
struct RowInfo {
  int token[2];
  bool real[2];
};

// Scores of keys a row may not see -> -inf: past the CTA's keys, after the row's causal
// diagonal, or cleared in the custom mask (which covers the q_len newest keys). The mode is
// tested once per tile, outside the element loops.
// With VARIANTS (Traits::kVariants) and a sliding window, also the keys before each row's window
// (variant.cuh window_first_key).
template <int BN, bool VARIANTS = false>
__device__ __forceinline__ void mask_tile(float (&s)[BN / 2], const AttentionParams& p, const PrefillWork& w,
                                          const RowInfo& ri, int key0, int quad) {
  auto apply = [&](auto visible) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 8 * j + 2 * quad + (e & 1);
        if (!(key < w.kv_end && visible(e >> 1, key))) s[4 * j + e] = -INFINITY;
      }
    }
  };
  if (p.mask_mode == 1) {
    const int last[2] = {w.prefix + ri.token[0], w.prefix + ri.token[1]};
    apply([&](int h, int key) { return key <= last[h]; });
  } else if (p.mask_mode == 2) {
    const unsigned char* rows[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) rows[h] = p.custom_mask + __ldg(p.mask_indptr + w.b) + ri.token[h] * w.q_len - w.prefix;
    apply([&](int h, int key) { return key < w.prefix || !ri.real[h] || __ldg(rows[h] + key) != 0; });
  } else {
    apply([](int, int) { return true; });
  }
  if constexpr (VARIANTS) {
    if (p.window > 0) {
      const int first[2] = {window_first_key(p, w.prefix, ri.token[0]), window_first_key(p, w.prefix, ri.token[1])};
      apply([&](int h, int key) { return key >= first[h]; });
    }
  }
}

// The scale a score takes into base 2 (RowState::fold): one for every row (UniformScale), or one per
// row half of the thread (RowScale: an fp8 cache's k_scale times each row's 2^-e, sm90/consumer.cuh).
struct UniformScale {
  float s;
  __device__ __forceinline__ float operator[](int) const { return s; }
};
struct RowScale {
  float s[2];
  __device__ __forceinline__ float operator[](int h) const { return s[h]; }
};

// ---- the soft-cap (the variant hooks): cap x tanh(score x sm_scale / cap), in base 2 ----
//
// Three forms of the tanh (Traits::kTanh), each a score's special-function operations besides the
// softmax's 2^x:
//   0  variant.cuh tanh_of_exp2_arg: 1 - 2 / (2^y + 1), the 2^y and the reciprocal on the
//      special-function unit (two operations; within 2e-7), the capped score scaled by cap log2 e
//      in place, then folded with scale 1 (the mma.sync family's form);
//   1  tanh.approx.f32 (one operation; the hardware's approximation, about 2^-11 relative), the
//      cap's log2 e folded into the softmax's own multiply-add (scale = cap log2 e);
//   2  t = 2^(-2 log2 e |x|) on the special-function unit (one operation), then (1 - t) / (1 + t)
//      with the reciprocal of d = 1 + t in [1, 2] by a quadratic seed (70/33 - 16/11 d + 32/99 d^2,
//      relative error 1/99) and two Newton steps on the FMA pipe (1e-8), tanh as 2 r - 1, the sign
//      copied back: within 2e-7 of tanh (absolute; float32 emulation over [-12, 12]), cap log2 e
//      folded as in 1.
// AttentionParams::soft_cap_scale is 2 log2 e sm_scale / cap (form 0's and 2's argument per raw
// score; form 1's is that times ln 2 / 2).

// The fold's scale of capped scores.
template <int TANH>
__device__ __forceinline__ float soft_cap_fold_scale(const AttentionParams& p) {
  return TANH == 0 ? 1.f : p.soft_cap_log2;
}
// The tanh form's argument per raw score (an fp8 cache's row factor multiplies it).
template <int TANH>
__device__ __forceinline__ float soft_cap_arg(const AttentionParams& p) {
  return TANH == 1 ? p.soft_cap_scale * 0.34657359027997264f : p.soft_cap_scale;  // ln 2 / 2
}

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) from y = 2 log2 e x (form 2 above): (1 - t) / (1 + t) = 2 / d - 1 with d = 1 + t in
// [1, 2] (the rounding of 1 + t is an absolute 2^-24), so the result is one multiply-add of r ~ 1 / d.
__device__ __forceinline__ float tanh_newton_of_exp2_arg(float y) {
  const float d = 1.f + fast_exp2(-fabsf(y));  // 1 + e^(-2 |x|), in [1, 2]
  float r = fmaf(d, fmaf(d, 0.32323232323232326f, -1.4545454545454546f), 2.121212121212121f);
  r = fmaf(r, fmaf(-d, r, 1.f), r);
  r = fmaf(r, fmaf(-d, r, 1.f), r);
  return copysignf(fmaf(2.f, r, -1.f), y);
}

// A tile's raw scores soft-capped in place by tanh form TANH, the argument per row half (arg[h]):
// form 0 leaves them in base 2 (times cap_log2), forms 1 and 2 as tanh (the fold scales them).
template <int BN, int TANH, typename Arg>
__device__ __forceinline__ void soft_cap_tile(float (&s)[BN / 2], const Arg& arg, float cap_log2) {
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) {
    const float a = arg[(i >> 1) & 1];
    if constexpr (TANH == 0) s[i] = cap_log2 * tanh_of_exp2_arg(s[i] * a);
    else if constexpr (TANH == 1) s[i] = tanh_approx(s[i] * a);
    else s[i] = tanh_newton_of_exp2_arg(s[i] * a);
  }
}

// The online-softmax state of the thread's two rows: the offset m (base 2, at most
// kLazyRescale below the row's max, softmax.cuh) and this thread's part of the sum l (its
// quad's four parts add up to the row's at the end).
struct RowState {
  float m[2], l[2];
  __device__ __forceinline__ void reset() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }
  // Keeps the state's arithmetic before what follows (sm90/wgmma.cuh pin).
  __device__ __forceinline__ void pin() {
    asm volatile("" : "+f"(m[0]), "+f"(m[1]), "+f"(l[0]), "+f"(l[1])::"memory");
  }

  // Folds a tile's raw scores s (in place: they become 2^(s scale - m), P in fp32) into the
  // state; returns each row's factor for the accumulators (1 unless its m moved) and whether
  // any row of this thread moved (then O must be rescaled by `factor`).
  template <int BN, typename Scale>
  __device__ __forceinline__ bool fold(float (&s)[BN / 2], const Scale& scale, float (&factor)[2]) {
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // the row's max and sum in four independent chains (the softmax sits between a
      // warpgroup's GEMMs: its latency, not only its throughput, counts)
      float part[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) part[j % 4] = fmaxf(part[j % 4], fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
      mx = quad_max(mx);
      const float scale_log2 = scale[h];
      const float mx2 = mx * scale_log2;  // -inf stays -inf (scale > 0)
      factor[h] = 1.f;
      if (mx2 > m[h] + kLazyRescale) {  // also a row's first keys (m = -inf)
        factor[h] = rescale_factor(m[h], mx2);
        moved = moved || m[h] != -INFINITY;  // from -inf the accumulators are still zero
        m[h] = mx2;
      }
      const float offset = safe_offset(m[h]);
      float sums[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = fast_exp2(fmaf(x, scale_log2, -offset));
          sums[(2 * j + e) % 4] += x;
        }
      }
      l[h] = l[h] * factor[h] + ((sums[0] + sums[1]) + (sums[2] + sums[3]));
    }
    return moved;
  }

  // fold() for both rows at once and without branches (Traits::kJointRows): the same
  // function of the scores (the lazy-rescale test by selects, 2^(m - max) by the same
  // ex2.approx as exp2f here), in one scheduling region, so ptxas interleaves the two rows'
  // max chains, shuffles and exp2s; each row's max chains start from its first pairs (no
  // -inf seeds).
  template <int BN, typename Scale>
  __device__ __forceinline__ bool fold_joint(float (&s)[BN / 2], const Scale& scale, float (&factor)[2]) {
    constexpr int J = BN / 8, C = J < 4 ? J : 4;  // 8-column blocks; max / sum chains per row
    float mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float part[C];
#pragma unroll
      for (int c = 0; c < C; ++c) part[c] = fmaxf(s[4 * c + 2 * h], s[4 * c + 2 * h + 1]);
#pragma unroll
      for (int j = C; j < J; ++j) part[j % C] = fmaxf(part[j % C], fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
#pragma unroll
      for (int w = 1; w < C; w *= 2)
#pragma unroll
        for (int c = 0; c + w < C; c += 2 * w) part[c] = fmaxf(part[c], part[c + w]);
      mx[h] = part[0];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    bool moved = false;
    float offset[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mx2 = mx[h] * scale[h];             // -inf stays -inf (scale > 0)
      const bool take = mx2 > m[h] + kLazyRescale;    // also a row's first keys (m = -inf)
      factor[h] = take ? fast_exp2(m[h] - mx2) : 1.f;  // m = -inf: 2^-inf = 0
      moved = moved || (take && m[h] != -INFINITY);   // from -inf the accumulators are still zero
      m[h] = take ? mx2 : m[h];
      offset[h] = safe_offset(m[h]);
    }
    float sums[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = fast_exp2(fmaf(x, scale[h], -offset[h]));
          sums[h][(2 * j + e) % 4] += x;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * factor[h] + ((sums[h][0] + sums[h][1]) + (sums[h][2] + sums[h][3]));
    return moved;
  }
};

template <int N>
__device__ __forceinline__ void rescale(float (&o)[N], const float (&factor)[2]) {
#pragma unroll
  for (int i = 0; i < N; ++i) o[i] *= factor[(i >> 1) & 1];
}

// P (fp32 in the score accumulators) -> the A fragments of O += P V: k-step ks (keys
// 16 ks .. 16 ks + 15) is the score blocks 2 ks and 2 ks + 1, the mma.sync A layout.
template <typename T, int BN>
__device__ __forceinline__ void to_fragments(const float (&s)[BN / 2], unsigned (&a)[BN / 16][4]) {
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks) {
    a[ks][0] = ElemTraits<T>::pack(s[8 * ks + 0], s[8 * ks + 1]);
    a[ks][1] = ElemTraits<T>::pack(s[8 * ks + 2], s[8 * ks + 3]);
    a[ks][2] = ElemTraits<T>::pack(s[8 * ks + 4], s[8 * ks + 5]);
    a[ks][3] = ElemTraits<T>::pack(s[8 * ks + 6], s[8 * ks + 7]);
  }
}

// The epilogue of the thread's two rows: O / l rounded to OT, into `out` (and the natural-log
// lse) for a request of one split, else into the split's partial row (normalised the same
// way, so a row whose only real split is merged x 1.0 keeps these bits) with its base-2 lse,
// for merge_kernel: the mma.sync family's contract (kernels/mma_sync/attention.cu).
template <typename OT, int D, bool VARIANTS = false, bool V_SCALED = false>
__device__ __forceinline__ void store_rows(const AttentionParams& p, const PrefillWork& w, const RowInfo& ri,
                                           const FastDiv& by_group, const float (&o)[D / 2], RowState& st,
                                           int first_row, int quad, bool page_bad, float v_scale = 1.f) {
  const int partial_base = w.splits > 1 ? __ldg(p.partial_indptr + w.b) : 0;
  // a request that breaks the contract, or an item that fetched a page id outside the cache:
  // its rows NaN (status.cuh)
  const bool bad = w.masked_tiles < 0 || page_bad;
  const float nan = __int_as_float(0x7fc00000);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = st.l[h];
    l = quad_sum(l);
    if (!ri.real[h]) continue;
    const int row = first_row + 8 * h;
    const int head = w.kv_head * by_group.divisor + by_group.mod(row);
    float inv = bad ? nan : inverse_sum(l);
    bool sunk = false;  // a row of one split is final here: with attention sinks its sum takes the sink
    float sunk_lse = 0.f;
    if constexpr (VARIANTS) {
      if (p.sinks != nullptr && w.splits == 1 && !bad) {
        const SinkedRow r = with_sink(st.m[h], l, __ldg(p.sinks + head) * kLog2e);
        inv = r.inv, sunk_lse = r.lse, sunk = true;
      }
    }
    if constexpr (V_SCALED) inv *= v_scale;  // an fp8 cache: out = o v_scale / l (NaN stays NaN)
    OT* dst;
    if (w.splits == 1) {
      const i64 slot = (i64)(w.q_start + ri.token[h]) * p.num_qo_heads + head;
      dst = static_cast<OT*>(p.out) + slot * D;
      if (quad == 0 && p.lse != nullptr) p.lse[slot] = bad ? nan : (sunk ? sunk_lse : natural_lse(st.m[h], l));
    } else {
      const i64 slot = ((i64)partial_base + (i64)ri.token[h] * w.splits + w.split) * p.num_qo_heads + head;
      dst = static_cast<OT*>(p.partial_out) + slot * D;
      if (quad == 0) p.partial_lse[slot] = bad ? nan : split_lse2(st.m[h], l);
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<unsigned*>(dst + 8 * j + 2 * quad) =
          ElemTraits<OT>::pack(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
    }
  }
}

}  // namespace sm90
}  // namespace cupy_fa
