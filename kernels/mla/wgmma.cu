// Multi-head latent attention over a paged latent cache on Hopper tensor cores (sm_90a only), the
// seesaw kernel: 64 packed (token, head) rows of one request over one split of its keys, two
// warpgroups that share the 576-column Q K^T products block by block and split the 512-column P V
// products by columns (kernels/mla/seesaw.cuh: the schedule, the exchanges and their barriers, and
// the end, each warpgroup's rows staged through shared memory; kernels/mla/wgmma_copy.cuh: the
// cp.async copies into two 64 x 576 K buffers; mla/epilogue.cuh: where a row's out and LSE, or its
// split partial for merge_kernel, go). 16-bit caches in the queries' element type, or (FP8) e4m3
// caches with one scale, each K buffer half's bytes widened to fp16 in place before S reads it
// (kernels/mla/wgmma_copy.cuh widen_half_fp8), the products in fp16 (bf16 queries rewritten as fp16
// times 2^e a row first: q_block_to_fp16); the scale joins the softmax's and the output's.
//
// Shared memory (kernels/mla/seesaw.cuh SeesawSmem): the query block (73728 bytes), two K buffers
// (73728 each), the exchanges and barriers: one CTA an SM, 256 threads.
#include "shared/common.cuh"
#include "shared/softmax.cuh"
#include "shared/pipeline_sync.cuh"
#include "sm90/wgmma.cuh"
#include "mla/params.cuh"
#include "mla/work.cuh"
#include "mla/wgmma_copy.cuh"
#include "mla/seesaw.cuh"
#include "mla/epilogue.cuh"

namespace cupy_fa {
namespace mla {

template <typename T, bool FP8>
__global__ void __launch_bounds__(256, 1) mla_wgmma_kernel(const __grid_constant__ MlaParams p) {
  static_assert(sizeof(T) == 2, "16-bit queries and output (and cache, or e4m3 bytes widened to T: FP8)");
  allow_dependent_launch();
  const FastDiv by_head{p.head_multiplier, p.head_shift, p.num_heads};
  Work w;
  if (!find_work<kBlockRows>(p, by_head, blockIdx.x, w)) return;  // the whole CTA, before any barrier
  const int partial_base = partial_base_of(p, w);  // (loaded now, kept in shared memory for the end)

  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = mbar::smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  // the warpgroup index from lane 0: ptxas then knows it is warp-uniform (the roles' branches hold wgmma)
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), wtid = tid & 127;

  copy_q_block<256, T>(p, w, by_head, base + SeesawSmem::kQ, tid);  // (q_full takes them after the setup)
  if (tid == 0) {
    mbar::init(base + SeesawSmem::kBars, 256);  // q_full: every thread's copies of Q
#pragma unroll
    for (int i = 1; i < SeesawSmem::kNumBars; ++i) mbar::init(base + SeesawSmem::kBars + 8 * i, 128);  // full, raw
    *reinterpret_cast<int*>(smem_raw + (base - raw) + SeesawSmem::kFlag) = 0;
    *reinterpret_cast<int*>(smem_raw + (base - raw) + SeesawSmem::kPartialBase) = partial_base;
    *reinterpret_cast<Work*>(smem_raw + (base - raw) + SeesawSmem::kWork) = w;
    mbar::init_fence();
  }
  __syncthreads();

  SeesawRole<T, FP8> role(p, w, by_head, base, wtid);
  mbar::cp_async_arrive_noinc(base + SeesawSmem::kBars);
  if (role.num_blocks > 0) {  // the first pair (a missing second block is zero-filled)
#pragma unroll
    for (int b = 0; b < 2; ++b) role.fill(b, b, wg, lookup_keys(p, w, b, wtid));
  }
  mbar::wait(base + SeesawSmem::kBars, 0);
  if (role.num_blocks > 0) {
    if constexpr (SeesawRole<T, FP8>::kRowScaled) role.queries_to_fp16(tid);
    role.begin_pair(wg, 0);
    role.run(wg);
  }

  // the row's sum: warpgroup 0's part of it, then warpgroup 1's (the same order in both)
  float l[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = role.l[h];
    l[h] = quad_sum(l[h]);
  }
  float2* sums = reinterpret_cast<float2*>(smem_raw + (base - raw) + SeesawSmem::kL);
  sums[wg * 128 + wtid] = make_float2(l[0], l[1]);
  sm90::named_sync(kBarEnd, 256);
  const float2 l0 = sums[wtid], l1 = sums[128 + wtid];
  l[0] = l0.x + l1.x;
  l[1] = l0.y + l1.y;
  // the work item and the first partial row from shared memory, rather than registers held across the
  // loop or their loads again
  const Work done = *reinterpret_cast<const Work*>(smem_raw + (base - raw) + SeesawSmem::kWork);
  const int partial_base_done = *reinterpret_cast<const int*>(smem_raw + (base - raw) + SeesawSmem::kPartialBase);
  const int flagged = *role.flag();
  const bool bad = done.bad != 0 || flagged != 0;
  if (tid == 0 && flagged != 0 && done.bad == 0) record_bad(p.status, done.request, kPageOutOfRange);
  role.store_rows(done, partial_base_done, l, bad, wg);  // each warpgroup's half, through its own K buffer
}

}  // namespace mla
}  // namespace cupy_fa
