// The K/V ring of the mma.sync family's producer-warpgroup tile (TileTraits PRODUCER_WARPS = 4): the
// STAGES pipeline stages handed between a producer warpgroup and the consumer warps by mbarriers,
// with no cp.async group waits and no CTA-wide barrier per tile.
//
// A stage has a `full` barrier (its tile's copies have landed) and an `empty` one (every consumer
// thread is done reading it), in shared memory:
//   producers (kThreads)     wait on empty (the stage's previous use freed), issue the tile's
//                            copies (paged_kv.cuh PagedKVProducer, as the consumers would), then
//                            each arrives on full twice: cp.async.mbarrier.arrive (pending until
//                            its copies are complete) and an ordinary arrive, whose release
//                            orders the CTA's page flag (set before the copies when a page id lay
//                            outside the cache) before any consumer's wait on full returns;
//   consumers (kThreads)     wait on full, read the stage (ldmatrix), arrive on empty. A split's
//                            epilogue stages its accumulators in a buffer of its own
//                            (TileTraits::kEpilogueOwnBuffer) and syncs the consumers alone
//                            (TileTraits::sync_consumers), so the producers refill the stage
//                            during it.
// Use n of a stage (tile n * STAGES + stage) completes phase n of its barriers, parity n & 1; a fresh
// barrier counts its "phase before" (parity 1) as complete, so the producer's first pass over
// `empty` does not wait.
//
// Each side then asks for its registers (setmaxnreg, sm_90a: the producers few, the consumers what
// the launch bounds' 128 could not give them). The ring's code compiles for sm_80 too
// (mbarrier.test_wait there; try_wait, which may suspend the thread instead of spinning, on sm_90)
// at 128 registers a thread; the host takes the tile on sm_90a only (MmaTile.producer_capable).
#pragma once

#include "common.cuh"

namespace cupy_fa {

template <typename Traits>
struct ProducerWarpRing {
  static constexpr int STAGES = Traits::kStages;
  unsigned base;  // shared address of full[0]; full[s] at base + 8 s, empty[s] at base + 8 (STAGES + s)

  __device__ __forceinline__ explicit ProducerWarpRing(unsigned long long* bars)  // 2 * STAGES of them
      : base(static_cast<unsigned>(__cvta_generic_to_shared(bars))) {}

  __device__ __forceinline__ unsigned full(int stage) const { return base + 8u * stage; }
  __device__ __forceinline__ unsigned empty(int stage) const { return base + 8u * (STAGES + stage); }
  static __device__ __forceinline__ int parity(int tile) { return (tile / STAGES) & 1; }

  // One thread, before a __syncthreads that every thread of the CTA passes.
  __device__ __forceinline__ void init() const {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      init_one(full(s), 32 * Traits::kProducerWarps);  // each producer's ordinary arrive
      init_one(empty(s), Traits::kThreads);
    }
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
  }

  // ---- the producer's side (each lane of the producer warp)
  __device__ __forceinline__ void wait_free(int tile) const { wait(empty(tile % STAGES), parity(tile) ^ 1); }
  __device__ __forceinline__ void filled(int tile) const {
    const unsigned bar = full(tile % STAGES);
    asm volatile("cp.async.mbarrier.arrive.shared.b64 [%0];\n" ::"r"(bar) : "memory");
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(bar) : "memory");
  }

  // ---- the consumers' side (each consumer thread)
  __device__ __forceinline__ void wait_full(int tile) const { wait(full(tile % STAGES), parity(tile)); }
  __device__ __forceinline__ void release(int tile) const {
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(empty(tile % STAGES)) : "memory");
  }

 private:
  static __device__ __forceinline__ void init_one(unsigned bar, int arrivals) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
  }
  static __device__ __forceinline__ void wait(unsigned bar, int parity) {
    unsigned done;
    do {
#if __CUDA_ARCH__ >= 900
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done)
                   : "r"(bar), "r"(parity)
                   : "memory");
#else
      asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done)
                   : "r"(bar), "r"(parity)
                   : "memory");
#endif
    } while (!done);
  }
};

// setmaxnreg (sm_90a): this warpgroup's registers a thread, to N (every thread of the warpgroup).
template <int N>
__device__ __forceinline__ void warpgroup_registers_down() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void warpgroup_registers_up() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

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
