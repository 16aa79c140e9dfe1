// The device status word: which request first broke the contract, and how. Device metadata (the
// lengths and page table of a CUDA-graph step) cannot be read by the host without a sync, so the
// kernels check it themselves, with a few integer compares per CTA or per page-id fetch (a select,
// never a branch in the copy loops): a bad request never reads or writes outside its buffers, its
// rows of out are written NaN, the other requests are computed exactly as without it, and the
// first (lowest) bad request is recorded here. cupy_fa/status.py decodes it (the reason codes are
// mirrored there; tests/test_status_cpu.py compares the two lists).
//
// One 64-bit word, (request << 8) | reason, kept by atomicMin: the lowest request wins, then the
// lowest reason of that request. kStatusOk (all ones) means no bad request. plan_kernel resets it
// for each plan; the attention kernels of every run of that plan add what they find. The cache's
// append kernel keeps its own word ((token << 8) | reason) for the slots it skipped.
#pragma once

namespace cupy_fa {

typedef unsigned long long StatusWord;
constexpr StatusWord kStatusOk = ~0ull;

enum BadRequest : unsigned {
  kQLenNegative = 1,     // q_len < 0
  kQLenAboveKvLen = 2,   // q_len > kv_len (kv_len < 0 included)
  kQLenAboveBound = 3,   // q_len above the max_q_len the plan was given
  kKvLenAboveBound = 4,  // kv_len above the max_kv_len the plan was given (the grid is sized from it)
  kKvLenAboveTable = 5,  // kv_len needs more pages than the page table has columns
  kPageOutOfRange = 6,   // a page id the request reads is not a page of the cache
  kRowsBeyondQ = 7,      // its query rows run past the rows of q and out
  kMaskTooSmall = 8,     // its custom-mask block runs past the mask the plan was given
  kSlotOutOfRange = 9,   // append: a slot past the cache (negative slots are padding, not errors)
};

__device__ __forceinline__ void record_bad(StatusWord* status, long long index, unsigned reason) {
  atomicMin(status, (static_cast<StatusWord>(index) << 8) | reason);
}

}  // namespace cupy_fa
