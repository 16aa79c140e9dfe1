// The K/V ring of the mma.sync family's producer-warpgroup tile (TileTraits PRODUCER_WARPS = 4): the
// STAGES pipeline stages handed between a producer warpgroup and the consumer warps by mbarriers,
// with no cp.async group waits and no CTA-wide barrier per tile.
//
// A stage has a `full` barrier (its tile's copies have landed) and an `empty` one (every consumer
// thread is done reading it), in shared memory:
//   producers (kThreads)     wait on empty (the stage's previous use freed), issue the tile's
//                            copies (paged_kv.cuh PagedKVProducer, as the consumers would), then
//                            each arrives on full twice (full expects 2 x kThreads):
//                            cp.async.mbarrier.arrive.noinc (made when its copies are complete)
//                            and an ordinary arrive, whose release orders the CTA's page flag (set
//                            before the copies when a page id lay outside the cache) before any
//                            consumer's wait on full returns;
//   consumers (kThreads)     wait on full, read the stage (ldmatrix), arrive on empty. A split's
//                            epilogue stages its accumulators in a buffer of its own
//                            (TileTraits::kEpilogueOwnBuffer) and syncs the consumers alone
//                            (TileTraits::sync_consumers), so the producers refill the stage
//                            during it.
// Use n of a stage (tile n * STAGES + stage) completes phase n of its barriers, parity n & 1; a fresh
// barrier counts its "phase before" (parity 1) as complete, so the producer's first pass over
// `empty` does not wait.
//
// Each side then asks for its registers (regs_release / regs_claim, setmaxnreg on sm_90a: the
// producers few, the consumers what the launch bounds' 128 could not give them). The barriers are
// pipeline_sync.cuh's, so the ring compiles for sm_80 too, at 128 registers a thread there; the host
// takes the tile on sm_90a only (MmaTile.producer_capable).
#pragma once

#include "shared/common.cuh"
#include "shared/pipeline_sync.cuh"

namespace cupy_fa {

template <typename Traits>
struct ProducerWarpRing {
  static constexpr int STAGES = Traits::kStages;
  static constexpr int kBarriers = 2 * STAGES;  // full[STAGES], then empty[STAGES]
  unsigned base;  // shared address of full[0]; full[s] at base + 8 s, empty[s] at base + 8 (STAGES + s)

  __device__ __forceinline__ explicit ProducerWarpRing(unsigned long long* bars)  // kBarriers of them
      : base(mbar::smem_addr(bars)) {}

  __device__ __forceinline__ unsigned full(int stage) const { return base + 8u * stage; }
  __device__ __forceinline__ unsigned empty(int stage) const { return base + 8u * (STAGES + stage); }
  static __device__ __forceinline__ int parity(int tile) { return (tile / STAGES) & 1; }

  // One thread, before a __syncthreads that every thread of the CTA passes.
  __device__ __forceinline__ void init() const {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar::init(full(s), 2 * 32 * Traits::kProducerWarps);  // each producer's copies, and its ordinary arrive
      mbar::init(empty(s), Traits::kThreads);
    }
    mbar::init_fence();
  }

  // ---- the producers' side (each producer thread)
  __device__ __forceinline__ void wait_free(int tile) const { mbar::wait(empty(tile % STAGES), parity(tile) ^ 1); }
  __device__ __forceinline__ void filled(int tile) const {
    mbar::cp_async_arrive_noinc(full(tile % STAGES));
    mbar::arrive(full(tile % STAGES));
  }

  // ---- the consumers' side (each consumer thread)
  __device__ __forceinline__ void wait_full(int tile) const { mbar::wait(full(tile % STAGES), parity(tile)); }
  __device__ __forceinline__ void release(int tile) const { mbar::arrive(empty(tile % STAGES)); }
};

// The producers' loop: every K/V tile of the CTA's run, in order, into the ring (the page ids of
// tile t + 1 fetched while they wait for tile t + 1's stage to be freed).
template <typename Ring, typename Producer>
__device__ __forceinline__ void produce_tiles(const Ring& ring, Producer& kv, int num_tiles) {
  kv.fetch_pages(0);
  for (int tile = 0; tile < num_tiles; ++tile) {
    ring.wait_free(tile);
    kv.issue(tile, tile % Ring::STAGES);
    kv.fetch_pages(tile + 1);
    ring.filled(tile);
  }
  // a thread's copies complete before it exits (the consumers wait for them on `full` anyway)
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

}  // namespace cupy_fa
