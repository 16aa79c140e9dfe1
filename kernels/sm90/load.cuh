// The producer warpgroup of the sm90 prefill family: Q once, then the paged K and V tiles
// through the mbarrier rings (sm90/pipeline.cuh), with cp.async into the 128-byte swizzled
// layout the wgmma descriptors read (sm90/wgmma.cuh swizzled_offset), for any page size.
//
// Thread t of the 128 copies 16-byte chunk t % (D / 8) of rows t / (D / 8), + 128 / (D / 8),
// ... of a tile, so a warp's threads share 32 / (D / 8) rows per pass and a tile's BLOCK_N
// keys fall BLOCK_N / 4 to each warp. Before copying a tile, each lane of a warp looks up
// the cache slot of one (or two) of its warp's keys: the page id from the page table (read
// one tile ahead, so its L2 round trip hides behind the copies of the tile before), then
// page x page_size + offset (a shift for power-of-two pages). The copies take their row's
// slot from that lane by a shuffle. A slot of -1 marks a key past the CTA's range: its
// chunks are zero-filled (so a masked key's V row is 0, never stale NaN) and nothing is read.
// K and V of a tile share the slots (the caches have one layout): V of a tile is copied one
// step after its K, the order the consumers read them (S of tile i with P V of tile i - 1).
#pragma once

namespace cupy_fa {
namespace sm90 {

template <typename KVT, typename Tr>
struct KVProducer {
  static constexpr int D = Tr::kHeadDim, BN = Tr::kBlockN, BM = Tr::kBlockM;
  static constexpr int CH = D / 8;                 // 16-byte chunks per row
  static constexpr int RP = 128 / CH;              // rows per pass of the 128 threads
  static constexpr int WARP_ROWS = 32 / CH;        // rows a warp copies per pass
  static constexpr int KEYS_PER_WARP = BN / 4;     // a tile's keys a warp copies
  static constexpr int LOOKUPS = (KEYS_PER_WARP + 31) / 32;  // slots each lane looks up per tile
  static_assert(BN % RP == 0 && BM % RP == 0, "whole passes per tile");

  const AttentionParams& p;
  const PrefillWork& w;
  const int* page_row;
  const char* k_base;  // this thread's chunk of the KV head in cache slot 0
  const char* v_base;
  int slot_bytes, chunk, row_in_pass, warp, lane;
  int pages_next[LOOKUPS];  // page ids of the next tile to look up, loaded ahead

  __device__ __forceinline__ KVProducer(const AttentionParams& p_, const PrefillWork& w_, int tid)
      : p(p_), w(w_) {
    chunk = tid % CH;
    row_in_pass = tid / CH;
    warp = tid / 32;
    lane = tid % 32;
    page_row = p.page_table + (i64)w.b * p.page_table_stride;
    slot_bytes = p.num_kv_heads * D * (int)sizeof(KVT);
    k_base = reinterpret_cast<const char*>(static_cast<const KVT*>(p.k_cache) + w.kv_head * D + chunk * 8);
    v_base = reinterpret_cast<const char*>(static_cast<const KVT*>(p.v_cache) + w.kv_head * D + chunk * 8);
  }

  // The key of this warp's li-th row of tile `tile` (the rows its threads copy, pass-major).
  __device__ __forceinline__ int key_of(int tile, int li) const {
    const int row = warp * WARP_ROWS + li % WARP_ROWS + RP * (li / WARP_ROWS);
    return w.kv_begin + tile * BN + row;
  }

  // Page ids of the keys this lane looks up in tile `tile` (0 past the range), into pages_next.
  // Device metadata: each id is clamped into the cache (an unsigned min), so nothing is read
  // outside it, and one outside it records the request in the status word (status.cuh) and
  // makes slots_of return true: its caller sets the item's flag (produce), and the consumers
  // then write the item's rows NaN.
  __device__ __forceinline__ void fetch_pages(int tile) {
#pragma unroll
    for (int j = 0; j < LOOKUPS; ++j) {
      const int li = lane + 32 * j;
      const int key = key_of(tile, li);
      const bool valid = tile >= 0 && li < KEYS_PER_WARP && key < w.kv_end;
      int page = 0;
      if (valid) page = p.page_shift >= 0 ? (key >> p.page_shift) : key / p.page_size;
      // as fetched: clamped and checked in slots_of, where they are used, so the load stays in
      // flight until then (a test here would wait for it at once)
      pages_next[j] = valid ? __ldg(page_row + page) : 0;
    }
  }

  // The slots of tile `tile` from the page ids fetched for it (-1 for keys past the range);
  // true when one of them was outside the cache.
  __device__ __forceinline__ bool slots_of(int tile, int (&slots)[LOOKUPS]) const {
    const unsigned last = static_cast<unsigned>(p.num_pages - 1);
    unsigned highest = 0;
#pragma unroll
    for (int j = 0; j < LOOKUPS; ++j) {
      const int li = lane + 32 * j;
      const int key = key_of(tile, li);
      const bool valid = li < KEYS_PER_WARP && key < w.kv_end;
      const int in_page = p.page_shift >= 0 ? (key & (p.page_size - 1)) : key % p.page_size;
      const unsigned fetched = static_cast<unsigned>(pages_next[j]);
      highest = max(highest, fetched);
      slots[j] = valid ? static_cast<int>(min(fetched, last)) * p.page_size + in_page : -1;
    }
    if (highest > last) record_bad(p.status, w.b, kPageOutOfRange);
    return highest > last;
  }

  // cp.async of one K or V tile (cache `base`) into the stage at shared address `dst`.
  __device__ __forceinline__ void copy_tile(const char* base, unsigned dst, const int (&slots)[LOOKUPS]) const {
    // 4 rows at a time: fully unrolled, the compiler keeps every row's address live at once,
    // more than the producer's registers hold
#pragma unroll 4
    for (int i = 0; i < BN / RP; ++i) {
      // this thread's row is its warp's row i WARP_ROWS + lane / CH (key_of's order), whose
      // slot lane (i WARP_ROWS) % 32 + lane / CH looked up, in register (i WARP_ROWS) / 32
      // (selected, not indexed: i is not a constant here)
      const int reg = (i * WARP_ROWS) / 32;
      int mine = slots[0];
#pragma unroll
      for (int j = 1; j < LOOKUPS; ++j) mine = reg == j ? slots[j] : mine;
      const int slot = __shfl_sync(0xffffffffu, mine, (i * WARP_ROWS) % 32 + lane / CH);
      const int row = row_in_pass + RP * i;
      const char* src = base + (i64)max(slot, 0) * slot_bytes;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + swizzled_offset<BN>(row, chunk)),
                   "l"(src), "r"(slot >= 0 ? 16 : 0)
                   : "memory");
    }
  }

  // copy_tile with fewer instructions per 16-byte copy (Traits::kLeanCopy): the row's slot
  // shuffled as before, then its source by one 32 x 32 -> 64-bit multiply-add (slots and slot
  // bytes are non-negative: no sign extension, no 64 x 64 product), the zero fill by the
  // copy's ignore-src predicate (one compare instead of a size register ptxas turns back into
  // a predicate) and the shared address stepped by a constant (the row's swizzle phase
  // row % 8 is the same for every pass when a pass covers a multiple of 8 rows).
  __device__ __forceinline__ void copy_tile_lean(const char* base, unsigned dst, const int (&slots)[LOOKUPS]) const {
    constexpr unsigned PASS_BYTES = RP * 128;  // a pass's rows in one 64-column block
    const unsigned dst0 = dst + swizzled_offset<BN>(row_in_pass, chunk);
#pragma unroll 4
    for (int i = 0; i < BN / RP; ++i) {
      const int reg = (i * WARP_ROWS) / 32;
      int mine = slots[0];
#pragma unroll
      for (int j = 1; j < LOOKUPS; ++j) mine = reg == j ? slots[j] : mine;
      const int slot = __shfl_sync(0xffffffffu, mine, (i * WARP_ROWS) % 32 + lane / CH);
      const char* src = base + (unsigned long long)(unsigned)max(slot, 0) * (unsigned)slot_bytes;
      const unsigned to = RP % 8 == 0 ? dst0 + i * PASS_BYTES : dst + swizzled_offset<BN>(row_in_pass + RP * i, chunk);
      asm volatile(
          "{\n.reg .pred p;\nsetp.lt.s32 p, %2, 0;\n"
          "cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(to),
          "l"(src), "r"(slot)
          : "memory");
    }
  }

  __device__ __forceinline__ void copy(const char* base, unsigned dst, const int (&slots)[LOOKUPS]) const {
    if constexpr (Tr::kLeanCopy) copy_tile_lean(base, dst, slots);
    else copy_tile(base, dst, slots);
  }

  // Q's BLOCK_M packed rows (zero past the request's rows) into the Q tile at `dst`.
  template <typename QT>
  __device__ __forceinline__ void copy_q(unsigned dst, const FastDiv& by_group) const {
    const QT* q = static_cast<const QT*>(p.q);
    const int group = by_group.divisor;
#pragma unroll 1  // once per CTA: rolled, so its addresses do not all live at once (the producer has few registers)
    for (int i = 0; i < BM / RP; ++i) {
      const int r = row_in_pass + RP * i, row = w.row0 + r;
      const bool valid = row < w.rows;
      const QT* src = q;
      if (valid) {
        const int token = w.q_start + by_group.div(row), head = w.kv_head * group + by_group.mod(row);
        src = q + ((i64)token * p.num_qo_heads + head) * D + chunk * 8;
      }
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + swizzled_offset<BM>(r, chunk)),
                   "l"(src), "r"(valid ? 16 : 0)
                   : "memory");
    }
  }
};

// The producer's whole job for the CTA's work item: Q into the Q tile, then K of tile T-1,
// then per step K of the next tile and V of the one before, each after its stage's `empty`
// barrier, ending with V of tile 0. The caller waits for the last copies (cp.async.wait_all)
// before the thread exits.
template <typename QT, typename KVT, typename Tr>
__device__ __forceinline__ void produce(const AttentionParams& p, const PrefillWork& w, const FastDiv& by_group,
                                        PipeBarriers<Tr::kStages, Tr::kConsumerThreads>& bars,
                                        RingPos<Tr::kStages>& pos, unsigned q_addr, unsigned k_addr,
                                        unsigned v_addr, int tid) {
  constexpr int STAGE_BYTES = Tr::kKVTileBytes;
  KVProducer<KVT, Tr> prod(p, w, tid);
  typedef KVProducer<KVT, Tr> P;
  const int T = w.num_tiles;
  // K or V of a tile into the stage at `dst` by cp.async, completing `full`
  auto load = [&](bool is_k, unsigned dst, const int (&slots)[P::LOOKUPS], unsigned long long* full) {
    prod.copy(is_k ? prod.k_base : prod.v_base, dst, slots);
    cp_async_arrive(full);
  };
  prod.fetch_pages(T - 1);
  // A page id outside the cache among the item's: the flag, set by any producer thread that saw
  // it; the consumers read it after the item's last full barrier, which this thread arrives on
  // later (rare: recomputed here rather than held in the producer's few registers).
  auto slots_of = [&](int tile, int (&slots)[P::LOOKUPS]) {
    if (prod.slots_of(tile, slots)) {
      shared_store(bars.page_flag(smem_addr(bars.k_full)), 1);
      __threadfence_block();
    }
  };
  prod.template copy_q<QT>(q_addr, by_group);
  cp_async_arrive(&bars.q_full);
  PipeState<Tr::kStages>& ks = pos.ks;
  PipeState<Tr::kStages>& vs = pos.vs;
  if (T > 0) {
    int slots_k[P::LOOKUPS], slots_v[P::LOOKUPS];
    slots_of(T - 1, slots_k);
    prod.fetch_pages(T - 2);
    mbar_wait(&bars.k_empty[ks.stage], ks.phase ^ 1);
    load(true, k_addr + ks.stage * STAGE_BYTES, slots_k, &bars.k_full[ks.stage]);
    ks.advance();
    for (int i = 1; i < T; ++i) {
      const int tile = T - 1 - i;
#pragma unroll
      for (int j = 0; j < P::LOOKUPS; ++j) slots_v[j] = slots_k[j];
      slots_of(tile, slots_k);
      prod.fetch_pages(tile - 1);
      mbar_wait(&bars.k_empty[ks.stage], ks.phase ^ 1);
      load(true, k_addr + ks.stage * STAGE_BYTES, slots_k, &bars.k_full[ks.stage]);
      ks.advance();
      mbar_wait(&bars.v_empty[vs.stage], vs.phase ^ 1);
      load(false, v_addr + vs.stage * STAGE_BYTES, slots_v, &bars.v_full[vs.stage]);
      vs.advance();
    }
    mbar_wait(&bars.v_empty[vs.stage], vs.phase ^ 1);
    load(false, v_addr + vs.stage * STAGE_BYTES, slots_k, &bars.v_full[vs.stage]);
    vs.advance();
  }
}

}  // namespace sm90
}  // namespace cupy_fa
