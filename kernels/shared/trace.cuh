// Timeline stamps for diagnosis (lab/probe_timeline.py), and the one place that knows the
// compile flag CUPY_FA_TRACE.
//
// Shipped builds never define it: every call below is then an empty inline function and
// trace_now() is 0, so the sums kept from it fold away and the kernels' SASS is the same as
// with no stamps in the source at all (scripts/sass_diff.sh checks that). The flag is set by
// the knob CUPY_FA_TRACE=1 (cupy_fa/knobs.py), which adds -DCUPY_FA_TRACE to the compile.
//
// With it, one thread of each of the first kTraceCtas CTAs (thread 0, or the `thread` a kernel
// names: the sm90 prefill kernel's first consumer thread) records into
// cupy_fa_trace[blockIdx.x]: the global timer (ns) at a point (trace_stamp), a value such as
// the ns spent in some region (trace_store; trace_now() gives the timer), and its SM id in
// entry kTraceSm; a region's ns summed over the CTA (trace_add; trace_span around a region: the sm90
// prefill kernel's producer, thread 0). The host reads the buffer with cupy_fa._build.trace_buffer.
#pragma once

namespace cupy_fa {

constexpr int kTraceCtas = 1 << 15, kTraceStamps = 9, kTraceSm = kTraceStamps - 1;

// What the attention kernels stamp (kernels/mma_sync/attention.cu; kernels/sm90/prefill.cu and
// consumer.cuh, where the first tile is its first S and the epilogue its last P V's wait and the
// rows' stores), by entry.
enum TraceEntry : int {
  kTraceStart = 0,       // the CTA starts
  kTraceFirstTile = 1,   // its first K/V tile has arrived
  kTraceDone = 2,        // it is done
  kTraceEpilogueNs = 3,  // ns spent in split epilogues
  kTraceWaitNs = 4,      // ns spent at the loop-top wait
  // the sm90 prefill kernel's producer (thread 0), summed over its tiles (sm90/load.cuh):
  kTraceProducerCopyWaitNs = 5,   // ns waiting for its own copies (an fp8 cache's staging)
  kTraceProducerEmptyWaitNs = 6,  // ns waiting for a free ring stage (`empty`)
  kTraceProducerFillNs = 7,       // ns filling stages: the fp8 widening, fence and arrival; 16-bit: issuing the copies
};

#ifdef CUPY_FA_TRACE
}  // namespace cupy_fa
extern "C" {
__device__ unsigned long long cupy_fa_trace[cupy_fa::kTraceCtas][cupy_fa::kTraceStamps];
}
namespace cupy_fa {
__device__ __forceinline__ unsigned long long trace_now() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}
// The timer's low 32 bits: a difference of two is a span's ns (spans under 4 s).
__device__ __forceinline__ unsigned trace_lap() {
  unsigned now;
  asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(now));
  return now;
}
__device__ __forceinline__ void trace_store(int entry, unsigned long long value, unsigned thread = 0) {
  if (threadIdx.x != thread || blockIdx.x >= kTraceCtas) return;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  cupy_fa_trace[blockIdx.x][entry] = value;
  cupy_fa_trace[blockIdx.x][kTraceSm] = sm;
}
// Adds `value` to an entry (a sum over a CTA's waits: a fire-and-forget atomic, no register held
// across the loop it sums; the probe zeroes the buffer before each launch it reads).
__device__ __forceinline__ void trace_add(int entry, unsigned long long value, unsigned thread = 0) {
  if (threadIdx.x != thread || blockIdx.x >= kTraceCtas) return;
  atomicAdd(&cupy_fa_trace[blockIdx.x][entry], value);
}
#else
__device__ __forceinline__ unsigned long long trace_now() { return 0; }
__device__ __forceinline__ unsigned trace_lap() { return 0; }
__device__ __forceinline__ void trace_add(int, unsigned long long, unsigned = 0) {}
__device__ __forceinline__ void trace_store(int, unsigned long long, unsigned = 0) {}
#endif
__device__ __forceinline__ void trace_stamp(int entry, unsigned thread = 0) { trace_store(entry, trace_now(), thread); }
// Runs f() and adds the ns it took to `entry` (thread `thread`; from trace_lap, one register): a span
// summed over a CTA. Without the flag just f().
template <typename F>
__device__ __forceinline__ void trace_span(int entry, F&& f, unsigned thread = 0) {
  const unsigned from = trace_lap();
  f();
  trace_add(entry, trace_lap() - from, thread);
}

}  // namespace cupy_fa
