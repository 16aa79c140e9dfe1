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

#include "pipeline_sync.cuh"

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

// The barriers of the K and V rings and of the Q tiles, in shared memory. A persistent CTA
// (several work items one after another) has QBUFS = 2 Q tiles, so the producer copies the
// next item's Q while the consumers finish this one; q_empty[b] (every consumer thread) frees
// Q tile b, and the producer hands each item's decoded work to the consumers in work[b]
// (w_full[b]: one arrival, after the producer's thread 0 wrote it). One Q tile (QBUFS = 1) is
// written once; q_empty, w_full and work are then not used. CONSUMERS: consumer threads.
template <int STAGES, int QBUFS = 1, int CONSUMERS = 256>
struct PipeBarriers {
  unsigned long long k_full[STAGES], k_empty[STAGES], v_full[STAGES], v_empty[STAGES];
  unsigned long long q_full[QBUFS], q_empty[QBUFS], w_full[QBUFS];
  float scratch[CONSUMERS];  // a word per consumer thread (sm90_prefill_consumer.cuh: the softmax before a wait)
  PrefillWork work[QBUFS];
  // per Q tile: set by the producer when a page id of the item it is loading was outside the
  // cache (sm90_prefill_load.cuh slots_of), read by the consumers before they free the Q tile,
  // so the item's rows are written NaN (status.cuh); cleared by the producer per item
  int page_bad[QBUFS];

  // The shared address of page_bad[qbuf] from that of k_full (the struct's first member), whose
  // address the loops hold anyway: no register more where the producer has few.
  static constexpr unsigned kPageBadOffset = (4 * STAGES + 3 * QBUFS) * 8 + CONSUMERS * 4 + QBUFS * sizeof(PrefillWork);
  __device__ __forceinline__ static unsigned page_flag(unsigned k_full_addr, int qbuf) {
    return k_full_addr + kPageBadOffset + 4u * qbuf;
  }

  // One thread, before the CTA's first __syncthreads.
  __device__ __forceinline__ void init(int producer_threads, int consumer_threads) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&k_full[s], producer_threads);
      mbar_init(&v_full[s], producer_threads);
      mbar_init(&k_empty[s], consumer_threads);
      mbar_init(&v_empty[s], consumer_threads);
    }
#pragma unroll
    for (int b = 0; b < QBUFS; ++b) {
      mbar_init(&q_full[b], producer_threads);
      mbar_init(&q_empty[b], consumer_threads);
      mbar_init(&w_full[b], 1);
      page_bad[b] = 0;
    }
    mbar_init_fence();
  }
};

// Where the producer and the consumers stand in the K / V rings and the Q tiles. Both sides
// walk the same work items and tiles in the same order, each with its own copy; in a
// persistent CTA the positions carry over from one item to the next.
template <int STAGES, int QBUFS>
struct RingPos {
  PipeState<STAGES> ks, vs;
  PipeState<QBUFS> qs;
};

}  // namespace sm90
}  // namespace cupy_fa
