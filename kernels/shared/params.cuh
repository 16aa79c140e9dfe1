// Parameter structs, one per kernel family, passed by value as a single
// __grid_constant__ argument. cupy_fa/_params.py mirrors each one as a NumPy
// structured dtype (align=True); the build appends static_asserts on every
// field offset, so the two can never drift silently.
//
// Everything that changes from one serving step to the next (lengths, page
// tables, masks) lives in device buffers that these pointers reference; the
// scalars are fixed for the lifetime of a plan, so a captured CUDA graph that
// froze this struct stays valid when the buffers are refilled.
#pragma once

#include "shared/status.cuh"

namespace cupy_fa {

// Where CTAs fold their splits (fold_splits) and a row has several groups of them, each
// group leaves its state (fp32 o, and m, l) in this many rows of the split-partial
// buffers: plan_kernel lays them out, the attention kernel writes and merge_kernel reads
// them (attention.cu group_o_index).
constexpr int kPartialRowsPerGroupState = 2;

// Per-step metadata, written by plan_kernel, read by the attention and merge
// kernels. All arrays have capacity batch_size (+1 for indptrs).
struct PlanParams {
  const int* q_lens;          // [B]   new query tokens per request (0 = padded row)
  const int* kv_lens;         // [B]   valid keys AFTER this step's write
  int* q_indptr;              // [B+1] exclusive scan of q_lens
  int* work_indptr;           // [B+1] exclusive scan of (row blocks x split groups): the small-q family's work
  int* long_work_indptr;      // [B+1] the same for requests with q_len >= long_q_len: the long family's work
  int* num_splits;            // [B]   KV splits of request b (0 for padded rows)
  int* split_keys;            // [B]   keys per split of request b (S, or a multiple of its family's block_n)
  int* partial_indptr;        // [B+1] exclusive scan of q_len x num_splits when num_splits > 1
  int* mask_indptr;           // [B+1] exclusive scan of q_len^2 (custom-mask offsets)
  StatusWord* status;         // [1]   the first bad request (status.cuh); reset here, added to by the runs
  int batch_size;
  int group_size;             // H_q / H_kv
  int block_m;                // packed (token, head) rows per tile (of work_indptr's family)
  int block_n;                // keys per KV tile (of work_indptr's family)
  int long_q_len;             // requests of at least this many tokens are laid out in long_work_indptr (the
                              // long family: one split per CTA, no fold), the others in work_indptr;
                              // INT_MAX: one family, every request in work_indptr
  int long_block_m;           // the long family's packed rows per tile
  int long_block_n;           // and keys per KV tile (its splits are multiples of it when they grow)
  int split_size;             // S: small-q requests split at keys 0, S, 2S, ... (multiple of block_n)
  int max_splits;             // no request gets more splits than this (then splits grow past S)
  int small_q_len;            // q_len <= this: split at fixed positions (decode, verify, draft extend)
  int split_row_budget;       // larger q_len: q_len x num_splits <= this (splitting a prefill buys little)
  int splits_per_cta;         // consecutive splits one CTA runs (1 unless the tile's epilogue fits a stage)
  int fold_splits;            // 1: CTAs fold their splits (AttentionParams): two partial rows per CTA of
                              // a request that several CTAs share (a group state each), none otherwise
  int partial_capacity;       // rows of the split-partial buffers; a batch that would need more
                              // caps every request at partial_capacity / batch_size rows
  int max_q_len;              // the bounds the host sized the grid with: a request above either is
  int max_kv_len;             // refused (its rows NaN, status.cuh), never given more work than them
  // A sliding window (variant.cuh): query i sees keys prefix + i - window + 1 .. on; 0 = none. A request's
  // splits then cover only its queries' windows, from key_base (plan.cu window_key_base).
  int* key_base;              // [B]   keys before a request's first split (0 without a window)
  int window;
};

struct AttentionParams {
  const void* q;              // [total_q, H_q, D]
  const void* k_cache;        // [num_pages, page_size, H_kv, D]
  const void* v_cache;        // [num_pages, page_size, H_kv, D]
  void* out;                  // [total_q, H_q, D]
  float* lse;                 // [total_q, H_q] natural log, may be null
  void* partial_out;          // [partial rows, H_q, D] normalised per split, in q's dtype (as FlashInfer's tmp_v)
  float* partial_lse;         // [partial rows, H_q] base-2 lse of each split, -inf if it saw no key
  const int* page_table;      // [B, page_table_stride]
  const unsigned char* custom_mask;  // flat, request b at mask_indptr[b], row-major q_len x q_len
  const int* q_indptr;
  const int* kv_lens;
  const int* work_indptr;
  const int* num_splits;
  const int* split_keys;
  const int* partial_indptr;
  const int* mask_indptr;
  int batch_size;
  int page_size;
  int page_table_stride;
  int num_qo_heads;
  int num_kv_heads;
  int mask_mode;              // 0 = none, 1 = causal (bottom-right), 2 = custom among the q_len newest keys
  float sm_scale_log2;        // softmax scale x log2(e): scores live in base 2
  int page_shift;             // log2(page_size) when a power of two (shift, not divide), else -1
  int splits_per_cta;         // as in PlanParams: the work items were counted with it
  unsigned group_multiplier;  // H_q / H_kv as a FastDiv (common.cuh): rows divide by it often
  int group_shift;
  int fold_splits;            // 1: every CTA folds its splits_per_cta (a multiple of kMergeGroup) splits as
                              // merge_kernel would: a whole row (its result) or one group of a longer
                              // row (the group's state, fp32, for merge_kernel)
  // The device metadata's bounds (status.cuh): what a request may read and write.
  StatusWord* status;         // [1]   the plan's status word: the first bad request, and how
  int num_pages;              // of the cache: page ids outside 0 .. num_pages - 1 read page 0 and flag
  int page_table_columns;     // of the caller's page table: a kv_len that needs more pages is refused
  int num_tokens;             // rows of q and out: a request's rows past them are refused
  int mask_entries;           // of the custom mask (mask_mode 2): a request's block past them is refused
  // An fp8 cache's dequantisation scales, float32 [H_kv] each (k = e4m3 * k_scale[head]); unused
  // (null) for fp16 / bf16 K/V.
  const float* k_scale;
  const float* v_scale;
  // The variant hooks (variant.cuh), read only by the kernels compiled with them (Traits::kVariants):
  const int* key_base;        // [B]   keys before a request's first split (PlanParams::key_base)
  const float* sinks;         // [H_q] attention sinks, natural-log logits; null = none
  int window;                 // sliding window W (query at p sees keys p - W + 1 .. ); 0 = none
  float soft_cap_scale;       // 2 log2(e) sm_scale / cap: tanh(s sm_scale / cap) from 2^(s x it)
  float soft_cap_log2;        // cap x log2(e); 0 = no soft-cap
};

struct MergeParams {
  void* out;                  // [total_q, H_q, D]
  float* lse;                 // [total_q, H_q], may be null
  const void* partial_out;    // q's dtype
  const float* partial_lse;
  const int* q_indptr;
  const int* num_splits;
  const int* partial_indptr;
  int batch_size;
  int num_qo_heads;
  int fold_groups;            // 1: the partials are group states (AttentionParams::fold_splits)
  const float* sinks;         // [H_q] attention sinks added to each row's final sum (AttentionParams); null = none
};

struct AppendParams {
  const void* k_new;          // [T, H_kv, D]
  const void* v_new;          // [T, H_kv, D]
  void* k_cache;              // [num_pages, page_size, H_kv, D]
  void* v_cache;
  const void* slots;          // [T] int32 or int64; negative = skip (padding)
  long long num_slots;        // num_pages x page_size, slots >= this are skipped
  int num_tokens;
  int row_chunks;             // H_kv x D / 8: 16-byte chunks per token
  StatusWord* status;         // [1]   the cache's status word: the first token whose slot is past the cache
  // append_quantize_kernel (an fp8 cache): each element stored as e4m3(x / scale[its KV head])
  const float* k_scale;       // [H_kv] float32
  const float* v_scale;       // [H_kv] float32
  int head_chunks;            // D / 8: 16-byte input chunks per KV head (row_chunks / H_kv)
};

// cupy_fa.merge_states (kernels/shared/merge_states.cu): two attention states of the same queries over
// disjoint key sets, each a normalised output and its natural-log LSE, into one.
struct MergeStatesParams {
  const void* out_a;          // [rows, D] (rows = tokens x heads), the output type
  const float* lse_a;         // [rows] natural log; -inf: side a saw no key
  const void* out_b;
  const float* lse_b;
  void* out;                  // [rows, D]; may be out_a or out_b itself (in place)
  float* lse;                 // [rows]; may be lse_a or lse_b itself; null: not written
  long long rows;
  int head_dim;               // a multiple of 4, at most 4 x 256
  int rows_per_cta;           // blockDim.x / (head_dim / 4): the rows one pass of a CTA merges
};

// A step's inputs copied into a GraphRunner's / BatchAttention's static buffers by one launch
// (kernels/shared/stage.cu; cupy_fa/_staging.py): up to kStageCopies copies of `rows` rows of
// `bytes` bytes each, rows `src_pitch` / `dst_pitch` bytes apart (one row: no pitch), each
// destination row followed by `fill_bytes` bytes of the 32-bit word `fill` (the padding of a
// page-table row, the zero lengths of a graph bucket's padding requests).
constexpr int kStageCopies = 6;

struct StageCopy {
  const void* src;
  void* dst;
  long long bytes;            // bytes copied per row
  int rows;
  int src_pitch;              // bytes between source rows (rows > 1)
  int dst_pitch;              // bytes between destination rows (rows > 1, or a fill)
  int fill_bytes;             // a multiple of 4, at a 4-byte aligned address after each row
  int fill;
};

struct StageParams {
  int count;                  // copies in use, at most kStageCopies
  StageCopy copies[kStageCopies];
};

}  // namespace cupy_fa
