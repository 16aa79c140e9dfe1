// The attention variant: which keys a query row sees (the mask) and what its scores become
// before the softmax (the logits), as hooks the kernels call, independent of any tile or
// fragment layout. A kernel family maps its fragments to (packed row, key) and calls:
//
//   variant.logits(s)          every score of every tile (today: the softmax scale into base 2)
//   variant.visible(row, key)  a score of a tile that touches a boundary (mask_from), real
//                              rows and keys < kv_end only; false sets it to -inf
//   variant.key_stop(...)      the last key a row block can see, + 1: tiles past it are skipped
//   variant.mask_from(...)     the first key where visible() may be false for the row block
//
// The variant hooks, compiled in only where a kernel's traits ask for them (kVariants: the plain
// kernels compile exactly as without them), each then on at run time by its AttentionParams field:
//
//   sliding window W  (window > 0) query i at position prefix + i sees keys prefix + i - W + 1 ..
//                     (FlashAttention's convention; with the causal mask: .. prefix + i): one more
//                     condition in visible(), and a first key, window_first(), before which a row
//                     block's tiles are skipped as key_stop() skips those past its diagonal; tiles
//                     that start before the window of the block's last row take the mask
//                     (window_mask_to). plan.cu starts a request's splits at key_base.
//   logits soft-cap   (soft_cap_log2 > 0) cap x tanh(score x sm_scale / cap), before the mask:
//                     capped_logits() in place of logits()
//   attention sinks   (sinks != null) one logit per query head in each row's final sum
//                     (softmax.cuh with_sink, where a row's result is final: split_epilogue.cuh,
//                     merge.cu, sm90/softmax.cuh)
//
// A window skips only whole tiles at fixed offsets from the split's first key, and masked keys add
// exact zeros, so the bits of a row do not depend on how many of its tiles were skipped: decode ==
// verify holds with every hook on.
//
// Rows are packed (token, head-in-group) rows of one request, row = token * G + head_in_group
// (kernels/mma_sync/attention.cu); keys are positions in the request's KV, 0 .. kv_len - 1. Query token
// i of the request sits at position prefix + i, prefix = kv_len - q_len (the contract's
// bottom-right alignment).
#pragma once

#include "shared/common.cuh"
#include "shared/params.cuh"

namespace cupy_fa {

// AttentionParams::mask_mode, as the host writes it (cupy_fa/plan.py MASK_*).
enum class MaskKind : int {
  kNone = 0,    // every key of the request
  kCausal = 1,  // query i sees keys 0 .. prefix + i
  kCustom = 2,  // every prefix key, and step key prefix + j iff custom_mask[i][j] (a tree)
};

// tanh(x) as 1 - 2 / (2^y + 1), y = 2 x log2(e) given: within about 2e-7 of tanh (absolute) for
// every x, on the special-function unit's 2^y and reciprocal, flushed to zero (the hardware
// tanh.approx is 5e-4 off: too coarse for a cap of 30-50 x it); saturates to +-1 (2^y = 0 below
// y = -126, and 1 / inf = 0). Six instructions with the scaling multiply and the cap's; exp2f and a
// divide took four more (their subnormal range steps).
__device__ __forceinline__ float tanh_of_exp2_arg(float y) {
  const float e = fast_exp2(y);
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(e + 1.f));
  return fmaf(-2.f, r, 1.f);
}

// The soft-capped score of raw score s (q . k), in base 2: cap x tanh(s x sm_scale / cap) x log2(e)
// (soft_cap_scale holds 2 log2(e) sm_scale / cap).
__device__ __forceinline__ float soft_capped(const AttentionParams& p, float s) {
  return p.soft_cap_log2 * tanh_of_exp2_arg(s * p.soft_cap_scale);
}

// The first key query i (at position prefix + i) sees through the window, clamped at 0.
__device__ __forceinline__ int window_first_key(const AttentionParams& p, int prefix, int i) {
  return max(0, prefix + i - p.window + 1);
}

// The default variant: one of the three masks, scores scaled into base 2, and with VARIANTS the
// hooks above. Built once per CTA for its request; it reads the params it needs where it uses them
// (so a launch that never masks never loads the custom mask's offsets).
template <bool VARIANTS = false>
struct DefaultVariant {
  static constexpr bool kVariants = VARIANTS;
  const AttentionParams& p;
  int request, q_len, prefix;
  FastDiv by_group;  // packed rows -> query tokens

  __device__ __forceinline__ MaskKind mask() const { return static_cast<MaskKind>(p.mask_mode); }
  __device__ __forceinline__ bool windowed() const { return VARIANTS && p.window > 0; }

  // The score of a (row, key) as the softmax sees it, in base 2.
  __device__ __forceinline__ float logits(float s) const { return s * p.sm_scale_log2; }

  // Whether the scores take capped_logits() instead (a test per tile, outside the element loops).
  __device__ __forceinline__ bool soft_capping() const {
    if constexpr (VARIANTS) return p.soft_cap_log2 > 0.f;
    return false;
  }
  __device__ __forceinline__ float capped_logits(float s) const { return soft_capped(p, s); }

  // Keys before a request's first split (plan.cu window_key_base; 0 without the hooks).
  __device__ __forceinline__ int key_base() const {
    if constexpr (VARIANTS) return __ldg(p.key_base + request);
    return 0;
  }

  // The first key a row block from packed row `first_row` can see (its first row's window), at
  // least `from`.
  __device__ __forceinline__ int window_first(int from, int first_row) const {
    return windowed() ? max(from, window_first_key(p, prefix, by_group.div(first_row))) : from;
  }

  // Tiles that start before this need visible() for the window: the first key the block's last row
  // (min(block_end, rows) - 1) sees; the lowest int without a window.
  __device__ __forceinline__ int window_mask_to(int block_end, int rows) const {
    return windowed() ? window_first_key(p, prefix, by_group.div(min(block_end, rows) - 1)) : -0x7fffffff - 1;
  }

  // Whether packed row `row` (< the request's rows) sees key `key` (< kv_end): clears
  // `visible` where the mask hides the key, leaves it as it is elsewhere.
  __device__ __forceinline__ void visible(int row, const int& key, bool& visible) const {
    const int i = by_group.div(row);  // query index within the request
    if (mask() == MaskKind::kCausal) {
      visible = key <= prefix + i;
    } else if (mask() == MaskKind::kCustom && key >= prefix) {
      visible = __ldg(p.custom_mask + __ldg(p.mask_indptr + request) + i * q_len + (key - prefix)) != 0;
    }
    if constexpr (VARIANTS) {
      if (p.window > 0 && key + p.window <= prefix + i) visible = false;  // window <= 2^30 (the host's clamp)
    }
  }

  // The keys a row block can see end at this (at most kv_end): the causal diagonal of its last
  // row, min(block_end, rows) - 1 (block_end: one past the block's last packed row).
  __device__ __forceinline__ int key_stop(int kv_end, int block_end, int rows) const {
    return mask() == MaskKind::kCausal ? min(kv_end, prefix + by_group.div(min(block_end, rows) - 1) + 1) : kv_end;
  }

  // Tiles whose last key reaches this need visible() for the row block from packed row
  // `first_row`: the end of the keys, the causal diagonal of its first row, or the custom
  // mask's columns (this step's keys). One threshold, so the per-tile test is one compare.
  __device__ __forceinline__ int mask_from(int kv_end, int first_row) const {
    return mask() == MaskKind::kCausal   ? min(kv_end, prefix + by_group.div(first_row) + 1)
           : mask() == MaskKind::kCustom ? min(kv_end, prefix)
                                         : kv_end;
  }
};

}  // namespace cupy_fa
