// The parameter structs of the MLA family (multi-head latent attention, the absorbed form), one
// __grid_constant__ argument each. cupy_fa/_mla_params.py mirrors them as NumPy structured dtypes
// (align=True); every MLA kernel's compile checks their sizes (the host's Kernel checks) and a CPU
// test compares names, types and order with this header.
//
// The latent cache is one array [num_pages, page_size, 576] (16-bit, or e4m3 bytes with one
// dequantisation scale): a token's row is its c_kv (the first 512 elements, the values) and its
// k_pe (the last 64). The queries come as q_nope [T, H, 512] and q_pe [T, H, 64], each with its own
// token and head strides (two views of one [T, H, 576] array, or two arrays); the output is
// [T, H, 512]. The plan metadata (q_indptr, work lists, splits, partial rows) is plan_kernel's
// (kernels/shared/plan.cu) with one KV head and group size H.
#pragma once

#include "shared/params.cuh"
#include "shared/status.cuh"

namespace cupy_fa {
namespace mla {

constexpr int kLatentDim = 576;  // kv_lora_rank 512 + rope 64: a cache row, and q . k's length
constexpr int kValueDim = 512;   // c_kv: the values, and the output's columns
constexpr int kRopeDim = kLatentDim - kValueDim;

struct MlaParams {
  const void* q_nope;          // [T, H, 512] at q_nope_token_stride / q_nope_head_stride elements
  const void* q_pe;            // [T, H, 64] at q_pe_token_stride / q_pe_head_stride
  const void* cache;           // [num_pages, page_size, 576]: 16-bit, or e4m3 bytes (kv_scale)
  void* out;                   // [T, H, 512], contiguous
  float* lse;                  // [T, H] natural log, may be null
  void* partial_out;           // [partial rows, H, 512] normalised per split, in out's type
  float* partial_lse;          // [partial rows, H] base-2 LSE of each split, -inf if it saw no key
  const int* page_table;       // [B, page_table_stride]
  const unsigned char* custom_mask;  // flat, request b at mask_indptr[b], row-major q_len x q_len
  const int* q_indptr;         // plan_kernel's metadata (PlanParams)
  const int* kv_lens;
  const int* work_indptr;      // this launch's family's work list (work_indptr or long_work_indptr)
  const int* num_splits;
  const int* split_keys;
  const int* partial_indptr;
  const int* mask_indptr;
  StatusWord* status;          // the plan's status word (status.cuh)
  const float* kv_scale;       // [1] an fp8 cache's dequantisation scale (value = e4m3 x scale); null for 16-bit
  long long q_nope_token_stride;  // elements between tokens of q_nope
  long long q_nope_head_stride;   // and between heads
  long long q_pe_token_stride;
  long long q_pe_head_stride;
  int batch_size;
  int num_heads;               // H: the packed rows of a request are token x H + head
  int page_size;
  int page_shift;              // log2(page_size) for a power of two, else -1
  int page_table_stride;
  int mask_mode;               // 0 none, 1 causal (bottom-right), 2 custom among the q_len newest keys
  float sm_scale_log2;         // softmax scale x log2(e)
  unsigned head_multiplier;    // H as a FastDiv (common.cuh)
  int head_shift;
  // the device metadata's bounds (status.cuh)
  int num_pages;
  int page_table_columns;
  int num_tokens;
  int mask_entries;
};

// PagedLatentCache.append: new tokens' c_kv [T, 512] and k_pe [T, 64] (each with its token stride)
// into their slots' rows, copied (16-bit) or quantised to e4m3 (x / scale, an fp8 cache).
struct MlaAppendParams {
  const void* ckv;             // [T, 512] at ckv_stride elements per token
  const void* kpe;             // [T, 64] at kpe_stride
  void* cache;                 // [num_slots, 576]
  const void* slots;           // [T] int32 or int64; negative = skip (padding)
  StatusWord* status;          // the cache's status word: the first token whose slot is past the cache
  const float* scale;          // [1] fp8: the quantisation scale; null for 16-bit
  long long num_slots;
  long long ckv_stride;        // elements between tokens of ckv
  long long kpe_stride;
  int num_tokens;
};

}  // namespace mla
}  // namespace cupy_fa
