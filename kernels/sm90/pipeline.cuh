// The producer -> consumer pipeline of the sm90 prefill family: mbarriers in shared memory.
//
// A stage has a `full` barrier (the producer's copies into it have landed) and an `empty`
// one (every consumer thread is done reading it). The producer's 128 threads copy with
// cp.async and each ends its copies of a stage with cp.async.mbarrier.arrive.noinc, which
// arrives on `full` once that thread's earlier copies are complete: `full` expects 128
// arrivals and completes its phase when the last copy lands, with no thread waiting.
// Consumers wait on `full`, read (wgmma), and every consumer thread arrives on `empty`.
// A stage is reused every kStages tiles; the phase bit (parity) flips each time round.
#pragma once

#include "shared/pipeline_sync.cuh"

namespace cupy_fa {
namespace sm90 {

// pipeline_sync.cuh's mbarriers, by pointer
using mbar::smem_addr;
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int arrivals) { mbar::init(smem_addr(bar), arrivals); }
__device__ __forceinline__ void mbar_init_fence() { mbar::init_fence(); }
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, int parity) { mbar::wait(smem_addr(bar), parity); }
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) { mbar::arrive(smem_addr(bar)); }
// This thread's cp.async copies issued so far arrive on `bar` when they complete (counted
// as one of the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_arrive(unsigned long long* bar) { mbar::cp_async_arrive_noinc(smem_addr(bar)); }

// A word of shared memory by its 32-bit shared address (st / ld.shared: no 64-bit generic
// pointer for the compiler to keep live where registers are few), ordered as volatile.
__device__ __forceinline__ void shared_store(unsigned addr, int value) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}
__device__ __forceinline__ int shared_load(unsigned addr) {
  int value;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
  return value;
}

// Position in a ring of STAGES stages: the stage index and the parity of its current use.
template <int STAGES>
struct PipeState {
  int stage = 0, phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The barriers of the K and V rings and of the Q tile, in shared memory, with a word of scratch
// per consumer thread and the item's page flag. CONSUMERS: consumer threads.
template <int STAGES, int CONSUMERS>
struct PipeBarriers {
  unsigned long long k_full[STAGES], k_empty[STAGES], v_full[STAGES], v_empty[STAGES];
  unsigned long long q_full;
  float scratch[CONSUMERS];  // a word per consumer thread (sm90/consumer.cuh: the softmax before a wait)
  // set by any producer thread that found a page id of the item outside the cache
  // (sm90/load.cuh slots_of), read by the consumers after their last wait, so the item's rows
  // are written NaN (status.cuh)
  int page_bad;

  // The shared address of page_bad from that of k_full (the struct's first member), whose
  // address the loops hold anyway: no register more where the producer has few.
  static constexpr unsigned kPageBadOffset = (4 * STAGES + 1) * 8 + CONSUMERS * 4;
  __device__ __forceinline__ static unsigned page_flag(unsigned k_full_addr) { return k_full_addr + kPageBadOffset; }

  // One thread, before the CTA's first __syncthreads.
  __device__ __forceinline__ void init(int producer_threads, int consumer_threads) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&k_full[s], producer_threads);
      mbar_init(&v_full[s], producer_threads);
      mbar_init(&k_empty[s], consumer_threads);
      mbar_init(&v_empty[s], consumer_threads);
    }
    mbar_init(&q_full, producer_threads);
    page_bad = 0;
    mbar_init_fence();
  }
};

// Where the producer and the consumers stand in the K / V rings: both sides walk the item's
// tiles in the same order, each with its own copy.
template <int STAGES>
struct RingPos {
  PipeState<STAGES> ks, vs;
};

}  // namespace sm90
}  // namespace cupy_fa
