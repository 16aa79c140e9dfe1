// Per-step metadata on the device: the ONE path that turns (q_lens, kv_lens)
// into offsets and the tile/split schedule. Eager plan() launches it outside
// a graph, a CUDA-graph replay launches the same kernel inside one, so the two
// can never disagree.
//
// Two work lists, one per kernel family of the step (cupy_fa/schedule.py): requests
// of up to small_q_len tokens in work_indptr (the small-q tiles), longer ones in
// long_work_indptr (the prefill family: the sm_90a wgmma kernel on Hopper, the
// mma.sync prefill tile elsewhere). Each request's work is in exactly one list; the
// offsets of tokens, split partials and mask are shared, so one merge covers both.
#include "shared/common.cuh"
#include "shared/params.cuh"
#include "shared/softmax.cuh"

namespace cupy_fa {

constexpr int kPlanThreads = 1024;

// What a request adds to each offset array: its tokens, its work items in either family's list
// (one of the two is 0), its split-partial rows and its custom-mask entries.
struct Counts {
  int q, work, long_work, partial, mask;
};

__device__ __forceinline__ Counts operator+(Counts a, Counts b) {
  return Counts{a.q + b.q, a.work + b.work, a.long_work + b.long_work, a.partial + b.partial, a.mask + b.mask};
}

__device__ __forceinline__ Counts operator-(Counts a, Counts b) {
  return Counts{a.q - b.q, a.work - b.work, a.long_work - b.long_work, a.partial - b.partial, a.mask - b.mask};
}

__device__ __forceinline__ Counts shfl_up(Counts c, int d) {
  return Counts{__shfl_up_sync(0xffffffffu, c.q, d), __shfl_up_sync(0xffffffffu, c.work, d),
                __shfl_up_sync(0xffffffffu, c.long_work, d), __shfl_up_sync(0xffffffffu, c.partial, d),
                __shfl_up_sync(0xffffffffu, c.mask, d)};
}

// Inclusive scan across the block; returns this thread's inclusive sum and
// leaves the block total in `total`.
__device__ Counts block_inclusive_scan(Counts v, Counts& total) {
  __shared__ Counts warp_sums[kPlanThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int d = 1; d < 32; d <<= 1) {
    Counts o = shfl_up(v, d);
    if (lane >= d) v = v + o;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    Counts w = lane < kPlanThreads / 32 ? warp_sums[lane] : Counts{0, 0, 0, 0, 0};
    for (int d = 1; d < 32; d <<= 1) {
      Counts o = shfl_up(w, d);
      if (lane >= d) w = w + o;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v = v + warp_sums[warp - 1];
  total = warp_sums[kPlanThreads / 32 - 1];
  __syncthreads();
  return v;
}

// Splits a request would get with the whole partial buffer to itself.
// Small-q requests (decode, verify, draft extend) cut their keys at the fixed
// positions 0, S, 2S, ...: a query's split boundaries then depend on neither
// q_len, kv_len nor the batch, which (with the kernels' exact handling of
// masked keys and empty splits) makes decode and verify of the same token
// bit-identical. Longer queries split only while q_len x splits stays within
// split_row_budget: their row tiles already fill the GPU.
__device__ __forceinline__ int wanted_splits(const PlanParams& p, int q_len, int kv_len) {
  int splits = (kv_len + p.split_size - 1) / p.split_size;
  if (q_len > p.small_q_len) splits = min(splits, max(1, p.split_row_budget / q_len));
  return max(1, min(splits, p.max_splits));
}

// Which family's work list a request's items go to: the long family's (long_work_indptr, the
// prefill tile) from long_q_len tokens on, else the small-q family's (work_indptr). A request's
// work is in exactly one of the two lists, decided by its own q_len alone.
__device__ __forceinline__ bool is_long(const PlanParams& p, int q_len) { return q_len >= p.long_q_len; }

// Keys per split for at most `cap` splits: S when the cap allows S-sized
// splits, else the smallest multiple of block_n (of the request's family) that
// needs no more than `cap`.
__device__ __forceinline__ void split_schedule(const PlanParams& p, int q_len, int kv_len, int cap, int& splits,
                                               int& keys) {
  const int block_n = is_long(p, q_len) ? p.long_block_n : p.block_n;
  keys = max(p.split_size, ((kv_len + cap - 1) / cap + block_n - 1) / block_n * block_n);
  splits = max(1, (kv_len + keys - 1) / keys);
}

// A request's rows in the partial buffer: q_len per split when it has several.
__device__ __forceinline__ int partial_rows(int q_len, int splits) { return splits > 1 ? q_len * splits : 0; }

// The rows it takes where CTAs fold their groups of splits (fold_splits): those of a
// group state per group when it has several groups, else none. Never more than
// partial_rows, which decides an overflow in either case, so whether CTAs fold never
// changes the schedule. The long family never folds (the host plans a fold beside long
// requests only where nothing is merged; merge_kernel reads one layout per launch).
__device__ __forceinline__ int laid_out_rows(const PlanParams& p, int q_len, int splits) {
  if (!p.fold_splits || is_long(p, q_len)) return partial_rows(q_len, splits);
  const int groups = (splits + p.splits_per_cta - 1) / p.splits_per_cta;
  return groups > 1 ? kPartialRowsPerGroupState * q_len * groups : 0;
}

// With a sliding window (window > 0) a request's splits cover only the keys its queries can see:
// from key_base, its first query's first key (prefix - window + 1) rounded down to a multiple of
// kMergeGroup x S. Rounded so: a small-q request's splits still sit at the fixed positions
// 0, S, 2S, ... and its groups of kMergeGroup splits at fixed positions too (merge_kernel and the
// folding CTAs group splits by their index from key_base), whatever its q_len; splits before
// key_base would be empty for every query (the identity of every merge), so decode and verify of a
// token keep their bits. A window of W over L keys then reads about W keys, in at most
// ceil((W + q_len - 1) / S) + kMergeGroup - 1 splits, not L.
__device__ __forceinline__ int window_key_base(const PlanParams& p, int q_len, int kv_len) {
  if (p.window <= 0) return 0;
  const int first = kv_len - q_len - p.window + 1;
  const int unit = kMergeGroup * p.split_size;
  return first > 0 ? first / unit * unit : 0;
}

enum class Row { kPadding, kLive, kRefused };

// What request b is, read once: padding (q_len = 0), live, or refused because it breaks the
// contract or the bounds the host sized the grid with (possible on the device path, whose lengths
// the host cannot check); `reason` says why (status.cuh). q_len comes back clamped to
// 0 .. max_q_len: a refused request's tokens keep that place in q and out, so the requests after
// it still find theirs, and no request gets more work than the grid holds.
__device__ __forceinline__ Row classify(const PlanParams& p, int b, int& q_len, int& kv_len, unsigned& reason) {
  const int given = p.q_lens[b];
  q_len = min(max(given, 0), p.max_q_len);
  kv_len = p.kv_lens[b];
  reason = given < 0              ? kQLenNegative
           : given > p.max_q_len  ? kQLenAboveBound
           : given > kv_len       ? kQLenAboveKvLen
           : kv_len > p.max_kv_len ? kKvLenAboveBound
                                  : 0u;
  if (reason != 0) return Row::kRefused;
  return q_len > 0 ? Row::kLive : Row::kPadding;
}

__device__ int block_sum(int v) {
  __shared__ int warp_totals[kPlanThreads / 32];
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  if ((threadIdx.x & 31) == 0) warp_totals[threadIdx.x >> 5] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kPlanThreads / 32; ++w) total += warp_totals[w];
  __syncthreads();
  return total;
}

// Request b's class and, for a live request, its splits and keys per split, capped at an
// equal share of the partial buffer when the batch overflows it. Both passes below ask
// this one function, so the rows pass 1 counts are the rows pass 2 lays out.
// `base`: the request's key_base (window_key_base; 0 without a window): its splits cut keys base ..
// kv_len - 1.
__device__ __forceinline__ Row request_schedule(const PlanParams& p, int b, bool overflow, int share, int& q_len,
                                                int& splits, int& keys, unsigned& reason, int& base) {
  int kv_len;
  const Row row = classify(p, b, q_len, kv_len, reason);
  splits = keys = base = 0;
  if (row == Row::kLive) {
    base = window_key_base(p, q_len, kv_len);
    const int span = kv_len - base;
    int cap = wanted_splits(p, q_len, span);
    if (overflow) cap = min(cap, max(1, share / q_len));
    split_schedule(p, q_len, span, cap, splits, keys);
  }
  return row;
}

extern "C" __global__ void __launch_bounds__(kPlanThreads) plan_kernel(const __grid_constant__ PlanParams p) {
  // a new plan: no bad request yet (this plan's runs add theirs, status.cuh); the barriers of
  // pass 1 order this before any record_bad below
  if (threadIdx.x == 0) p.status[0] = kStatusOk;

  // Pass 1: partial rows the batch wants. Only when they overflow the buffer is
  // every request capped at an equal share (results then depend on the batch).
  int wanted_rows = 0;
  for (int b = threadIdx.x; b < p.batch_size; b += kPlanThreads) {
    int q_len, splits, keys, key_base;
    unsigned reason;
    if (request_schedule(p, b, false, 0, q_len, splits, keys, reason, key_base) == Row::kLive) {
      wanted_rows += partial_rows(q_len, splits);
    }
  }
  const bool overflow = block_sum(wanted_rows) > p.partial_capacity;
  const int share = max(p.partial_capacity / max(p.batch_size, 1), 1);

  // Pass 2: the schedule and the offsets, 1024 requests at a time.
  Counts carry{0, 0, 0, 0, 0};
  for (int base = 0; base < p.batch_size; base += kPlanThreads) {
    const int b = base + threadIdx.x;
    Counts mine{0, 0, 0, 0, 0};
    int splits = 0, keys = 0, key_base = 0;
    if (b < p.batch_size) {
      int q_len;
      unsigned reason;
      const Row row = request_schedule(p, b, overflow, share, q_len, splits, keys, reason, key_base);
      // The caller laid out q, out and the mask with these tokens: they keep their
      // place in the offsets even when the row itself is refused below.
      mine.q = q_len;
      mine.mask = q_len * q_len;
      if (row == Row::kRefused) {
        // Contract broken on the device path (host inputs are validated before launch): record
        // it, and give the row one CTA per row block, in its (clamped) q_len's family's list, that
        // reads nothing and writes its rows NaN (num_splits = -reason marks it for the attention
        // kernels, work.cuh and sm90/work.cuh; no partials). Within the family's bound.
        record_bad(p.status, b, reason);
        if (is_long(p, q_len)) {
          mine.long_work = (q_len * p.group_size + p.long_block_m - 1) / p.long_block_m;
        } else {
          mine.work = (q_len * p.group_size + p.block_m - 1) / p.block_m;
        }
        splits = -static_cast<int>(reason);
        keys = 0;
      } else if (row == Row::kLive) {
        if (is_long(p, q_len)) {  // one split per CTA
          mine.long_work = (q_len * p.group_size + p.long_block_m - 1) / p.long_block_m * splits;
        } else {
          const int row_blocks = (q_len * p.group_size + p.block_m - 1) / p.block_m;
          mine.work = row_blocks * ((splits + p.splits_per_cta - 1) / p.splits_per_cta);  // CTAs run split groups
        }
        mine.partial = laid_out_rows(p, q_len, splits);
      }
    }
    Counts total;
    Counts incl = block_inclusive_scan(mine, total);
    Counts excl = carry + (incl - mine);
    if (b < p.batch_size) {
      p.q_indptr[b] = excl.q;
      p.work_indptr[b] = excl.work;
      p.long_work_indptr[b] = excl.long_work;
      p.partial_indptr[b] = excl.partial;
      p.mask_indptr[b] = excl.mask;
      p.num_splits[b] = splits;
      p.split_keys[b] = keys;
      p.key_base[b] = key_base;
    }
    carry = carry + total;
  }
  if (threadIdx.x == 0) {
    p.q_indptr[p.batch_size] = carry.q;
    p.work_indptr[p.batch_size] = carry.work;
    p.long_work_indptr[p.batch_size] = carry.long_work;
    p.partial_indptr[p.batch_size] = carry.partial;
    p.mask_indptr[p.batch_size] = carry.mask;
  }
}

}  // namespace cupy_fa
