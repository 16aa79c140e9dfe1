// The synchronisation of the warp-specialised kernels, one set for both families: mbarriers in
// shared memory (by their 32-bit shared address) and setmaxnreg. Used by the sm90 prefill family's
// pipeline (sm90/pipeline.cuh, sm90/wgmma.cuh) and the mma.sync family's K/V ring (kv_ring.cuh).
//
// A barrier's phase completes when its expected arrivals have happened; a waiter names the phase by
// its parity. A fresh barrier is in phase 0, so waiting on parity 1 ("the phase before") returns at
// once: a producer's first pass over its empty barriers. sm_80+: try_wait (which may suspend the
// thread instead of spinning) and the init fence on sm_90+, test_wait before; setmaxnreg on sm_90a
// only (a no-op elsewhere: the kernel keeps its launch registers).
#pragma once

namespace cupy_fa {
namespace mbar {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void init(unsigned bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// After the inits, before any other thread touches the barriers (then a __syncthreads).
__device__ __forceinline__ void init_fence() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void wait(unsigned bar, int parity) {
  unsigned done;
  do {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
#else
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
#endif
  } while (!done);
}

// An arrival of this thread (release: its earlier writes are seen by a thread whose wait returns).
__device__ __forceinline__ void arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// This thread's cp.async copies issued so far arrive on `bar` when they complete, counted as one of
// the barrier's expected arrivals (.noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

}  // namespace mbar

// setmaxnreg (sm_90a): this warpgroup's registers a thread, to REGS (every thread of the warpgroup).
// It takes effect only under a register cap at kernel entry (__launch_bounds__), each warpgroup's
// role one branch of an if / else.
template <int REGS>
__device__ __forceinline__ void regs_release() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}
template <int REGS>
__device__ __forceinline__ void regs_claim() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}

}  // namespace cupy_fa
