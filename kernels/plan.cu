// Per-step metadata on the device: the ONE path that turns (q_lens, kv_lens)
// into offsets and the tile/split schedule. Eager plan() launches it outside
// a graph, a CUDA-graph replay launches the same kernel inside one, so the two
// can never disagree.
#include "common.cuh"
#include "params.cuh"

namespace cupy_fa {

constexpr int kPlanThreads = 1024;

struct Counts {
  int q, work, partial, mask;
};

__device__ __forceinline__ Counts operator+(Counts a, Counts b) {
  return Counts{a.q + b.q, a.work + b.work, a.partial + b.partial, a.mask + b.mask};
}

__device__ __forceinline__ Counts shfl_up(Counts c, int d) {
  return Counts{__shfl_up_sync(0xffffffffu, c.q, d), __shfl_up_sync(0xffffffffu, c.work, d),
                __shfl_up_sync(0xffffffffu, c.partial, d), __shfl_up_sync(0xffffffffu, c.mask, d)};
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
    Counts w = lane < kPlanThreads / 32 ? warp_sums[lane] : Counts{0, 0, 0, 0};
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

// Split rule, a function of the request alone (never of the batch), so a
// request's result does not depend on what it is batched with.
__device__ __forceinline__ void split_schedule(const PlanParams& p, int q_len, int kv_len,
                                               int& splits, int& keys) {
  int cap = min(p.max_splits, max(1, p.split_row_budget / max(q_len, 1)));
  splits = max(1, min(cap, (kv_len + p.min_split_keys - 1) / p.min_split_keys));
  keys = (kv_len + splits - 1) / splits;
  keys = ((keys + p.block_n - 1) / p.block_n) * p.block_n;
  splits = max(1, (kv_len + keys - 1) / keys);
}

constexpr int kNoError = 0x7fffffff;  // status while no bad row was seen (atomicMin keeps the first)

extern "C" __global__ void __launch_bounds__(kPlanThreads) plan_kernel(const __grid_constant__ PlanParams p) {
  Counts carry{0, 0, 0, 0};
  if (threadIdx.x == 0) p.status[0] = kNoError;
  __syncthreads();
  for (int base = 0; base < p.batch_size; base += kPlanThreads) {
    const int b = base + threadIdx.x;
    Counts mine{0, 0, 0, 0};
    int splits = 0, keys = 0;
    if (b < p.batch_size) {
      const int q_tokens = max(p.q_lens[b], 0), kv_len = p.kv_lens[b];
      // The caller laid out q, out and the mask with these tokens: they keep their
      // place in the offsets even when the row itself is refused below.
      mine.q = q_tokens;
      mine.mask = q_tokens * q_tokens;
      if (p.q_lens[b] < 0 || q_tokens > kv_len) {
        // Contract broken on the device path (host inputs are validated before
        // launch): record it and give the row no work rather than read outside it.
        atomicMin(p.status, b + 1);
      } else if (q_tokens > 0) {
        split_schedule(p, q_tokens, kv_len, splits, keys);
        int row_blocks = (q_tokens * p.group_size + p.block_m - 1) / p.block_m;
        mine.work = row_blocks * splits;
        mine.partial = splits > 1 ? q_tokens * splits : 0;
      }
    }
    Counts total;
    Counts incl = block_inclusive_scan(mine, total);
    Counts excl = carry + Counts{incl.q - mine.q, incl.work - mine.work, incl.partial - mine.partial,
                                 incl.mask - mine.mask};
    if (b < p.batch_size) {
      p.q_indptr[b] = excl.q;
      p.work_indptr[b] = excl.work;
      p.partial_indptr[b] = excl.partial;
      p.mask_indptr[b] = excl.mask;
      p.num_splits[b] = splits;
      p.split_keys[b] = keys;
    }
    carry = carry + total;
  }
  __syncthreads();  // every atomicMin above is done
  if (threadIdx.x == 0) {
    atomicCAS(p.status, kNoError, 0);
    p.q_indptr[p.batch_size] = carry.q;
    p.work_indptr[p.batch_size] = carry.work;
    p.partial_indptr[p.batch_size] = carry.partial;
    p.mask_indptr[p.batch_size] = carry.mask;
  }
}

}  // namespace cupy_fa
