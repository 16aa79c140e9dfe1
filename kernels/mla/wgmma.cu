// Multi-head latent attention over a paged latent cache on Hopper tensor cores (sm_90a only), the
// seesaw kernel: 64 packed (token, head) rows of one request over a run of splits of its keys (each
// split ends in its own partial; a CTA that ran all of a row's splits folds them into out,
// mla/epilogue.cuh fold_own_rows), two warpgroups that share the 576-column Q K^T products block by
// block and split the 512-column P V products by columns (kernels/mla/seesaw.cuh: the schedule, the
// exchanges and their barriers, and the end, each warpgroup's rows staged through shared memory;
// kernels/mla/wgmma_copy.cuh: the cp.async copies into two 64 x 576 K buffers; mla/epilogue.cuh:
// where a row's out and LSE, or its split partial for merge_kernel, go). 16-bit caches; the
// queries' element type.
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

// One split of the CTA's run (`w`: set_split done), its partial or out written: the first pair's
// fills, the pairs (SeesawRole::run), the row sums of both warpgroups, the store. Returns the pairs
// it filled. `first`: the CTA's first split, which waits for the query block's copies.
template <typename T>
__device__ __forceinline__ int seesaw_split(const MlaParams& p, const Work& w, const FastDiv& by_head, unsigned base,
                                            unsigned char* smem, int wg, int wtid, int pair_base, bool first) {
  SeesawRole<T> role(p, w, by_head, base, wtid, pair_base);
  if (role.num_blocks > 0) {  // the first pair (a missing second block is zero-filled)
#pragma unroll
    for (int b = 0; b < 2; ++b) role.fill(b, b, wg, lookup_keys(p, w, b, wtid));
  }
  if (first) mbar::wait(base + SeesawSmem::kBars, 0);
  if (role.num_blocks > 0) {
    role.issue_scores(wg, 0);
    role.run(wg);
  }

  // the row's sum: warpgroup 0's part of it, then warpgroup 1's (the same order in both)
  float l[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = role.l[h];
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  float2* sums = reinterpret_cast<float2*>(smem + SeesawSmem::kL);
  sums[wg * 128 + wtid] = make_float2(l[0], l[1]);
  sm90::named_sync(kBarEnd, 256);
  const float2 l0 = sums[wtid], l1 = sums[128 + wtid];
  l[0] = l0.x + l1.x;
  l[1] = l0.y + l1.y;
  // the work item from shared memory, rather than registers held across the loop or its loads again
  Work done = *reinterpret_cast<const Work*>(smem + SeesawSmem::kWork);
  done.split = w.split;
  const int flagged = *role.flag();
  const bool bad = done.bad != 0 || flagged != 0;
  if (wg == 0 && wtid == 0 && flagged != 0 && done.bad == 0) record_bad(p.status, done.request, kPageOutOfRange);
  role.store_rows(done, l, bad, wg);  // each warpgroup's half, through its own K buffer
  return role.num_pairs;
}

template <typename T>
__global__ void __launch_bounds__(256, 1) mla_wgmma_kernel(const __grid_constant__ MlaParams p) {
  static_assert(sizeof(T) == 2, "16-bit queries, cache and output");
  allow_dependent_launch();
  const FastDiv by_head{p.head_multiplier, p.head_shift, p.num_heads};
  Work w;
  if (!find_work<kBlockRows>(p, by_head, blockIdx.x, w)) return;  // the whole CTA, before any barrier

  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = mbar::smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  // the warpgroup index from lane 0: ptxas then knows it is warp-uniform (the roles' branches hold wgmma)
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), wtid = tid & 127;

  if (tid == 0) {
    mbar::init(base + SeesawSmem::kBars, 256);  // q_full: every thread's copies of Q
#pragma unroll
    for (int i = 1; i < SeesawSmem::kNumBars; ++i) mbar::init(base + SeesawSmem::kBars + 8 * i, 128);  // full[buffer][block]
    *reinterpret_cast<int*>(smem + SeesawSmem::kFlag) = 0;
    *reinterpret_cast<Work*>(smem + SeesawSmem::kWork) = w;
    mbar::init_fence();
  }
  __syncthreads();

  copy_q_block<256, T>(p, w, by_head, base + SeesawSmem::kQ, tid);
  mbar::cp_async_arrive_noinc(base + SeesawSmem::kBars);
  int pairs = seesaw_split<T>(p, w, by_head, base, smem, wg, wtid, 0, true);
  const Work* run = reinterpret_cast<const Work*>(smem + SeesawSmem::kWork);
  for (int split = run->split_first + 1; split < run->split_stop; ++split) {
    __syncthreads();  // the last split's rows are stored: its K buffers (their staging) are free
    Work next = *run;
    set_split<kBlockRows>(p, by_head, split, next);
    pairs += seesaw_split<T>(p, next, by_head, base, smem, wg, wtid, pairs, false);
  }
  if (whole_row(*run)) {
    __syncthreads();  // every thread's partials written (and visible to the CTA)
    fold_own_rows<T, kBlockRows>(p, *run, by_head, tid, 256);
  }
}

}  // namespace mla
}  // namespace cupy_fa
