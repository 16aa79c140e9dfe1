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
// Later variants add a hook or a term here, not a branch in a kernel body: a sliding window is
// one more condition in visible() plus a first key (the tiles before it skipped like key_stop's),
// a logits soft-cap is logits(), attention sinks add a term to the softmax state a row starts from
// (softmax.cuh OnlineSoftmaxRows::reset) and to the final sum.
//
// Rows are packed (token, head-in-group) rows of one request, row = token * G + head_in_group
// (kernels/attention.cu); keys are positions in the request's KV, 0 .. kv_len - 1. Query token
// i of the request sits at position prefix + i, prefix = kv_len - q_len (the contract's
// bottom-right alignment).
#pragma once

#include "common.cuh"
#include "params.cuh"

namespace cupy_fa {

// AttentionParams::mask_mode, as the host writes it (cupy_fa/plan.py MASK_*).
enum class MaskKind : int {
  kNone = 0,    // every key of the request
  kCausal = 1,  // query i sees keys 0 .. prefix + i
  kCustom = 2,  // every prefix key, and step key prefix + j iff custom_mask[i][j] (a tree)
};

// The default variant: one of the three masks, scores scaled into base 2. Built once per CTA for
// its request; it reads the params it needs where it uses them (so a launch that never masks
// never loads the custom mask's offsets).
struct DefaultVariant {
  const AttentionParams& p;
  int request, q_len, prefix;
  FastDiv by_group;  // packed rows -> query tokens

  __device__ __forceinline__ MaskKind mask() const { return static_cast<MaskKind>(p.mask_mode); }

  // The score of a (row, key) as the softmax sees it, in base 2.
  __device__ __forceinline__ float logits(float s) const { return s * p.sm_scale_log2; }

  // Whether packed row `row` (< the request's rows) sees key `key` (< kv_end): clears
  // `visible` where the mask hides the key, leaves it as it is elsewhere.
  __device__ __forceinline__ void visible(int row, const int& key, bool& visible) const {
    const int i = by_group.div(row);  // query index within the request
    if (mask() == MaskKind::kCausal) {
      visible = key <= prefix + i;
    } else if (mask() == MaskKind::kCustom && key >= prefix) {
      visible = __ldg(p.custom_mask + __ldg(p.mask_indptr + request) + i * q_len + (key - prefix)) != 0;
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
