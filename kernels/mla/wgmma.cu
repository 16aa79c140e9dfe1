// Multi-head latent attention over a paged latent cache on Hopper tensor cores (sm_90a only), the
// seesaw kernel: a work item is 64 packed (token, head) rows of one request over one split of its
// keys (a persistent CTA takes items in turn, the next one's first loads under this one's end), two
// warpgroups that share the 576-column Q K^T products block by block and split the 512-column P V
// products by columns (kernels/mla/seesaw.cuh: the schedule, the exchanges and their barriers, and
// the end, each warpgroup's rows staged through shared memory; kernels/mla/wgmma_copy.cuh: the
// cp.async copies into two 64 x 576 K buffers; mla/epilogue.cuh: where a row's out and LSE, or its
// split partial for merge_kernel, go). 16-bit caches; the queries' element type.
//
// Shared memory (kernels/mla/seesaw.cuh SeesawSmem): the query block (73728 bytes), two K buffers
// (73728 each), the exchanges, barriers and two items' Work: one CTA an SM, 256 threads.
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

// Item w's query block (every thread's copies arrive on q_full) and its key block `block` into buffer
// `block` (0 or 1; a block past its keys is zero-filled), each warpgroup its half
template <typename T>
__device__ __forceinline__ void load_query(const MlaParams& p, const Work& w, const FastDiv& by_head, unsigned base, int tid) {
  copy_q_block<256, T>(p, w, by_head, base + SeesawSmem::kQ, tid);
  mbar::cp_async_arrive_noinc(base + SeesawSmem::kBars);
}
__device__ __forceinline__ void load_first(const MlaParams& p, const Work& w, unsigned base, int block, int wg, int wtid,
                                           int* flag) {
  if (w.kv_end > w.kv_begin) fill_block(p, w, lookup_keys(p, w, block, wtid), base, block, block, wg, wtid, flag);
}

// A persistent grid (at most one CTA an SM): CTA c takes the work items c, c + G, c + 2 G, ... (G CTAs),
// so the CTAs running at one time take consecutive items, as a grid of one CTA an item would (a
// request's row blocks side by side, its latent blocks read from L2 by all of them). While an item
// ends (its rows staged through K buffer 1 and stored), the next item's query block and first key
// block are already on their way (Q and buffer 0 are free once both warpgroups passed kBarEnd), and
// its second block follows the stores; the barriers' phases run on across items (pair_base, q_blocks).
// Each item's arithmetic is that of a CTA of its own: its bits do not depend on which CTA ran it.
template <typename T>
__global__ void __launch_bounds__(256, 1) mla_wgmma_kernel(const __grid_constant__ MlaParams p) {
  static_assert(sizeof(T) == 2, "16-bit queries, cache and output");
  allow_dependent_launch();
  const FastDiv by_head{p.head_multiplier, p.head_shift, p.num_heads};
  const int total = __ldg(p.work_indptr + p.batch_size);
  int item = blockIdx.x;
  if (item >= total) return;  // the whole CTA, before any barrier

  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = mbar::smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  // the warpgroup index from lane 0: ptxas then knows it is warp-uniform (the roles' branches hold wgmma)
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), wtid = tid & 127;
  int* flags = reinterpret_cast<int*>(smem_raw + (base - raw) + SeesawSmem::kFlags);
  Work* works = reinterpret_cast<Work*>(smem_raw + (base - raw) + SeesawSmem::kWorks);

  Work w;
  find_work<kBlockRows>(p, by_head, item, w);
  if (tid == 0) {
    mbar::init(base + SeesawSmem::kBars, 256);  // q_full: every thread's copies of Q
#pragma unroll
    for (int i = 1; i < SeesawSmem::kNumBars; ++i) mbar::init(base + SeesawSmem::kBars + 8 * i, 128);  // full[buffer][block]
    flags[0] = 0;
    works[0] = w;
    mbar::init_fence();
  }
  __syncthreads();
  load_query<T>(p, w, by_head, base, tid);
#pragma unroll
  for (int b = 0; b < 2; ++b) load_first(p, w, base, b, wg, wtid, flags);

  int pairs_before = 0;
  for (int k = 0;; ++k) {  // item k of this CTA: its Work and flag in slot k & 1
    const int next = item + gridDim.x;
    const bool more = next < total;
    SeesawRole<T> role(p, w, by_head, base, wtid, pairs_before, flags + (k & 1));
    if (more) {  // the next item's Work into slot k + 1 & 1 (read by item k - 1, done), its loads while
                 // this item's query block and first keys land; read back after kBarEnd, not held in registers
      Work found;
      find_work<kBlockRows>(p, by_head, next, found);
      if (tid == 0) flags[(k + 1) & 1] = 0, works[(k + 1) & 1] = found;
    }
    mbar::wait(base + SeesawSmem::kBars, k & 1);
    if (role.num_blocks > 0) {
      role.issue_scores(wg, 0);
      role.run(wg);
    }
    pairs_before += role.num_pairs;

    // the row's sum: warpgroup 0's part of it, then warpgroup 1's (the same order in both)
    float l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] = role.l[h];
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    float2* sums = reinterpret_cast<float2*>(smem_raw + (base - raw) + SeesawSmem::kL);
    sums[wg * 128 + wtid] = make_float2(l[0], l[1]);
    sm90::named_sync(kBarEnd, 256);  // both warpgroups are past their last products: Q and the K buffers are free
    const float2 l0 = sums[wtid], l1 = sums[128 + wtid];
    l[0] = l0.x + l1.x;
    l[1] = l0.y + l1.y;
    if (more) {  // the next item's query block and first key block, under this item's end
      const Work w_next = works[(k + 1) & 1];
      load_query<T>(p, w_next, by_head, base, tid);
      load_first(p, w_next, base, 0, wg, wtid, flags + ((k + 1) & 1));
    }
    // the work item from shared memory, rather than registers held across the loop or its loads again
    const Work done = works[k & 1];
    const int flagged = flags[k & 1];
    const bool bad = done.bad != 0 || flagged != 0;
    if (tid == 0 && flagged != 0 && done.bad == 0) record_bad(p.status, done.request, kPageOutOfRange);
    role.store_rows(done, l, bad, wg);  // each warpgroup's half, through K buffer 1
    if (!more) break;
    __syncthreads();  // the staged rows are read: buffer 1 takes the next item's second block
    item = next;
    w = works[(k + 1) & 1];
    load_first(p, w, base, 1, wg, wtid, flags + ((k + 1) & 1));
  }
}

}  // namespace mla
}  // namespace cupy_fa
