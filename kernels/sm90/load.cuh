// The producer warpgroup of the sm90 prefill family: Q once, then the paged K and V tiles
// through the mbarrier rings (sm90/pipeline.cuh), with cp.async into the swizzled layout the
// wgmma descriptors read (sm90/wgmma.cuh swizzled_offset), for any page size.
//
// A pass of the 128 threads copies CPR 16-byte chunks of each of 128 / CPR rows: whole rows
// where they divide the 128 threads (16-bit K/V at D 64, 128, 256: thread t copies chunk t % CH
// of rows t / CH, + 128 / CH, ...), else one column block of them, block after block over the
// same rows (D 96, 192: CH = 12 or 24 chunks a row). A warp's threads share 32 / CPR rows per
// pass and a tile's BLOCK_N keys fall BLOCK_N / 4 to each warp. Before copying a tile, each lane
// of a warp looks up the cache slot of one (or two) of its warp's keys: the page id from the page
// table (read one tile ahead, so its L2 round trip hides behind the copies of the tile before),
// then page x page_size + offset (a shift for power-of-two pages). The copies take their row's
// slot from that lane by a shuffle. A slot of -1 marks a key past the CTA's range: its chunks are
// zero-filled (so a masked key's V row is 0, never stale NaN) and nothing is read. K and V of a
// tile share the slots (the caches have one layout): V of a tile is copied one step after its K,
// the order the consumers read them (S of tile i with P V of tile i - 1). With separate qk / vo
// head dims (Traits::kHeadDimVo < kHeadDim: 192 / 128) V's rows are copied the way K's are, by
// the same threads and passes over the same rows (so the same slots), with fewer column blocks
// (NPB_V: 2 of K's 3) and V's slot stride, into V's narrower ring stages.
//
// An fp8 (e4m3) cache (Traits::kFp8): the producer copies a tile's bytes by cp.async into a
// staging slot of its own (Traits::kStaging slots, raw bytes laid out thread by thread), runs
// kStaging - 1 tiles ahead there, and widens each tile into the 16-bit stage the consumers read
// (fp16: every e4m3 value is exact in it; common.cuh Fp8Widen), with st.shared, then the proxy
// fence and an ordinary arrival on the stage's `full` barrier. Each thread widens the bytes it
// copied itself, so the staging needs no barrier between the producer's threads. Its 16-byte
// chunk of 16 bytes is two 16-bit chunks of a row; the lanes of a warp are laid out so that each
// quarter-warp's stores hit 8 distinct 16-byte bank groups (rows r and r ^ 1, whose swizzle
// phases differ in the last bit: produce_fp8).
#pragma once

namespace cupy_fa {
namespace sm90 {

template <typename KVT, typename Tr>
struct KVProducer {
  static constexpr int D = Tr::kHeadDim, BN = Tr::kBlockN, BM = Tr::kBlockM, SW = Tr::kSwizzle;
  static constexpr bool kFp8 = KVBytes<KVT>::value == 1;
  static constexpr int CH = D * KVBytes<KVT>::value / 16;  // 16-byte chunks per row
  // chunks of a row a pass copies: the whole row where the rows divide the threads, else one
  // column block of it (16-bit D 96, 192; passes over the same rows, block after block)
  static constexpr int CPR = 128 % CH == 0 ? CH : SW / 16;
  static constexpr int NPB = CH / CPR;             // column blocks a row takes in turn (1: whole rows)
  // V's head dim and column blocks: K's unless separate qk / vo head dims, where V's rows take
  // K's passes (CPR chunks of a column block) with fewer blocks
  static constexpr int DV = Tr::kHeadDimVo;
  static constexpr bool kSplitDims = DV != D;
  static constexpr int NPB_V = DV * KVBytes<KVT>::value / 16 / CPR;
  static constexpr int RP = 128 / CPR;             // rows per pass of the 128 threads
  static constexpr int WARP_ROWS = 32 / CPR;       // rows a warp copies per pass
  static constexpr int KEYS_PER_WARP = BN / 4;     // a tile's keys a warp copies
  static constexpr int LOOKUPS = (KEYS_PER_WARP + 31) / 32;  // slots each lane looks up per tile
  static_assert(CH % CPR == 0 && 128 % CPR == 0 && (NPB == 1 || CPR == SW / 16), "passes of whole rows or blocks");
  static_assert(BN % RP == 0, "whole passes per tile");
  static_assert(!kSplitDims || (!kFp8 && NPB > 1 && (DV * 2 / 16) % CPR == 0 && NPB_V < NPB),
                "separate qk / vo head dims: V's rows whole column blocks of K's passes");
  static_assert(!kFp8 || CH % 4 == 0, "fp8: a quarter-warp holds 4 chunks of two rows (produce_fp8's lanes)");

  const AttentionParams& p;
  const PrefillWork& w;
  const int* page_row;
  const char* k_base;  // this thread's chunk of the KV head in cache slot 0
  const char* v_base;
  int head_bytes;      // that chunk's offset in a slot (an fp8 cache's copies add it to the params' pointers)
  int slot_bytes, chunk, row_in_pass, warp, lane;
  int pages_next[LOOKUPS];  // page ids of the next tile to look up, loaded ahead

  __device__ __forceinline__ KVProducer(const AttentionParams& p_, const PrefillWork& w_, int tid)
      : p(p_), w(w_) {
    warp = tid / 32;
    lane = tid % 32;
    if constexpr (kFp8) {
      // a quarter-warp (8 lanes) takes 4 chunks of rows 2m and 2m + 1: their 16-bit chunks land
      // on 8 distinct bank groups (see the file comment)
      constexpr int PB = CH / 4;  // quarter-warps per row pair
      const int quarter = lane / 8;
      chunk = 4 * (quarter % PB) + lane % 4;
      row_in_pass = warp * WARP_ROWS + 2 * (quarter / PB) + (lane / 4) % 2;
    } else {
      chunk = tid % CPR;
      row_in_pass = tid / CPR;
    }
    page_row = p.page_table + (i64)w.b * p.page_table_stride;
    slot_bytes = k_slot_bytes();
    constexpr int ELEMS = 16 / (int)sizeof(KVT);  // elements of a 16-byte chunk
    k_base = reinterpret_cast<const char*>(static_cast<const KVT*>(p.k_cache) + w.kv_head * D + chunk * ELEMS);
    v_base = reinterpret_cast<const char*>(static_cast<const KVT*>(p.v_cache) + w.kv_head * DV + chunk * ELEMS);
    head_bytes = (w.kv_head * D + chunk * ELEMS) * (int)sizeof(KVT);
  }

  // This thread's row among its warp's rows of a pass (the lane that looked its slot up).
  __device__ __forceinline__ int warp_row() const {
    if constexpr (kFp8) return 2 * ((lane / 8) / (CH / 4)) + (lane / 4) % 2;
    return lane / CPR;
  }

  // The key of this warp's li-th row of tile `tile` (the rows its threads copy, pass-major).
  __device__ __forceinline__ int key_of(int tile, int li) const {
    const int row = warp * WARP_ROWS + li % WARP_ROWS + RP * (li / WARP_ROWS);
    return w.kv_begin + tile * BN + row;
  }

  // Page ids of the keys this lane looks up in tile `tile` (0 past the range), into pages_next.
  // Device metadata: each id is clamped into the cache (an unsigned min), so nothing is read
  // outside it, and one outside it records the request in the status word (status.cuh) and
  // makes slots_of return true: slots_flagged sets the item's flag, and the consumers
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

  // slots_of, and where a page id was outside the cache the item's flag, set by any producer thread
  // that saw it; the consumers read it after the item's last full barrier, which this thread
  // arrives on later (rare: recomputed here rather than held in the producer's few registers).
  template <typename Bars>
  __device__ __forceinline__ void slots_flagged(int tile, int (&slots)[LOOKUPS], Bars& bars) const {
    if (slots_of(tile, slots)) {
      shared_store(bars.page_flag(smem_addr(bars.k_full)), 1);
      __threadfence_block();
    }
  }

  // The slot of this thread's row of pass i (key_of's order): lane (i WARP_ROWS) % 32 + its warp
  // row looked it up, in register (i WARP_ROWS) / 32 (selected, not indexed: i need not be a
  // constant).
  __device__ __forceinline__ int slot_of_pass(int i, const int (&slots)[LOOKUPS]) const {
    const int reg = (i * WARP_ROWS) / 32;
    int mine = slots[0];
#pragma unroll
    for (int j = 1; j < LOOKUPS; ++j) mine = reg == j ? slots[j] : mine;
    return __shfl_sync(0xffffffffu, mine, (i * WARP_ROWS) % 32 + warp_row());
  }

  // K's bytes from one cache slot to the next, from the params (slot_bytes holds it; an fp8 cache's
  // copies read it here instead, where the producer's registers are fewest)
  __device__ __forceinline__ int k_slot_bytes() const { return p.num_kv_heads * D * (int)sizeof(KVT); }

  // V's bytes from one cache slot to the next: K's (slot_bytes) unless separate qk / vo head dims,
  // then from the params (no register more held in the producer)
  __device__ __forceinline__ int v_slot_bytes() const {
    if constexpr (kSplitDims) return p.num_kv_heads * DV * (int)sizeof(KVT);
    return slot_bytes;
  }

  // cp.async of one K or V tile (cache `base`, BLOCKS column blocks a row, `row_bytes` from one
  // cache slot to the next) into the stage at shared address `dst`.
  template <int BLOCKS>
  __device__ __forceinline__ void copy_tile(const char* base, unsigned dst, const int (&slots)[LOOKUPS],
                                            int row_bytes) const {
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
      const int slot = __shfl_sync(0xffffffffu, mine, (i * WARP_ROWS) % 32 + lane / CPR);
      const int row = row_in_pass + RP * i;
      const char* src = base + (i64)max(slot, 0) * row_bytes;
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b) {  // the row's column blocks (one: whole rows)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + swizzled_offset<BN, SW>(row, b * CPR + chunk)),
                     "l"(src + b * CPR * 16), "r"(slot >= 0 ? 16 : 0)
                     : "memory");
      }
    }
  }

  // copy_tile with fewer instructions per 16-byte copy (Traits::kLeanCopy): the row's slot
  // shuffled as before, then its source by one 32 x 32 -> 64-bit multiply-add (slots and slot
  // bytes are non-negative: no sign extension, no 64 x 64 product), the zero fill by the
  // copy's ignore-src predicate (one compare instead of a size register ptxas turns back into
  // a predicate) and the shared address stepped by a constant (the row's swizzle phase is the
  // same for every pass when a pass covers a multiple of 8 rows).
  template <int BLOCKS>
  __device__ __forceinline__ void copy_tile_lean(const char* base, unsigned dst, const int (&slots)[LOOKUPS],
                                                 int row_bytes) const {
    constexpr unsigned PASS_BYTES = RP * SW;  // a pass's rows in one column block
    const unsigned dst0 = dst + swizzled_offset<BN, SW>(row_in_pass, chunk);
#pragma unroll 4
    for (int i = 0; i < BN / RP; ++i) {
      const int reg = (i * WARP_ROWS) / 32;
      int mine = slots[0];
#pragma unroll
      for (int j = 1; j < LOOKUPS; ++j) mine = reg == j ? slots[j] : mine;
      const int slot = __shfl_sync(0xffffffffu, mine, (i * WARP_ROWS) % 32 + lane / CPR);
      const char* src = base + (unsigned long long)(unsigned)max(slot, 0) * (unsigned)row_bytes;
      const unsigned to = RP % 8 == 0 ? dst0 + i * PASS_BYTES : dst + swizzled_offset<BN, SW>(row_in_pass + RP * i, chunk);
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b) {  // the row's column blocks (one: whole rows), a block's bytes apart
        asm volatile(
            "{\n.reg .pred p;\nsetp.lt.s32 p, %2, 0;\n"
            "cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(to + b * (BN * SW)),
            "l"(src + b * CPR * 16), "r"(slot)
            : "memory");
      }
    }
  }

  // K's tile (K's blocks and slot stride) or V's (V's) into the stage at `dst`
  template <bool IS_K>
  __device__ __forceinline__ void copy(unsigned dst, const int (&slots)[LOOKUPS]) const {
    constexpr int BLOCKS = IS_K ? NPB : NPB_V;
    const char* base = IS_K ? k_base : v_base;
    const int row_bytes = IS_K ? slot_bytes : v_slot_bytes();
    if constexpr (Tr::kLeanCopy) copy_tile_lean<BLOCKS>(base, dst, slots, row_bytes);
    else copy_tile<BLOCKS>(base, dst, slots, row_bytes);
  }

  // ---- an fp8 cache (produce_fp8) ----

  // cp.async of one K (is_k) or V tile's e4m3 bytes into a staging slot at `staging`: this
  // thread's chunk of pass i at staging + (128 i + tid) x 16 (the thread's own bytes, read back
  // only by it). The cache's pointer from the params (no 64-bit base held in the producer's few
  // registers).
  __device__ __forceinline__ void stage_fp8(bool is_k, unsigned staging, const int (&slots)[LOOKUPS]) const {
    static_assert(kFp8, "fp8 caches only");
    const char* base = static_cast<const char*>(is_k ? p.k_cache : p.v_cache) + head_bytes;
    const unsigned to0 = staging + (threadIdx.x % 128) * 16;  // (warp * 32 + lane, not held in registers)
#pragma unroll 2
    for (int i = 0; i < BN / RP; ++i) {
      const int slot = slot_of_pass(i, slots);
      const char* src = base + (unsigned long long)(unsigned)max(slot, 0) * (unsigned)k_slot_bytes();
      asm volatile(
          "{\n.reg .pred p;\nsetp.lt.s32 p, %2, 0;\n"
          "cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(to0 + i * 128 * 16),
          "l"(src), "r"(slot)
          : "memory");
    }
  }

  // The staged bytes of this thread (stage_fp8) widened to fp16 into the 16-bit stage at `dst`:
  // its chunk c of row r (16 e4m3 values, columns 16 c ..) is the 16-bit chunks 2 c and 2 c + 1.
  __device__ __forceinline__ void widen_fp8(unsigned staging, unsigned dst) const {
    static_assert(kFp8 && SW == 128 && RP % 8 == 0, "the swizzle phase is the same for every pass");
    const unsigned from0 = staging + (threadIdx.x % 128) * 16;
    const unsigned to0 = dst + swizzled_offset<BN, SW>(row_in_pass, 2 * chunk);
    // Half a chunk (8 bytes: one 16-bit chunk widened) at a time, the next half's load issued before
    // this one is widened and stored, so each load's latency passes under the conversions before it
    // (a whole pass loaded ahead needs four registers more than the producer's 32 hold). Chunk 2 c + 1
    // goes to chunk 2 c's place with address bit 4 flipped (the swizzled chunk's bit 0: the stage, the
    // rows and the passes are multiples of 128 bytes), so one destination register serves both.
    u32 cur[2];
    load_staged_half(from0, cur);
#pragma unroll  // (whole: each load and store an immediate offset from from0 and to0)
    for (int i = 0; i < BN / RP; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bool more = half == 0 || i + 1 < BN / RP;
        u32 next[2], lo[2], hi[2];
        if (more) load_staged_half(from0 + (half == 0 ? i * 128 * 16 + 8 : (i + 1) * 128 * 16), next);
        Fp8Widen<__half>::run(cur[0], lo);
        Fp8Widen<__half>::run(cur[1], hi);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"((to0 + i * RP * 128) ^ (16u * half)), "r"(lo[0]),
                     "r"(lo[1]), "r"(hi[0]), "r"(hi[1])
                     : "memory");
        if (more) cur[0] = next[0], cur[1] = next[1];
      }
    }
  }

  static __device__ __forceinline__ void load_staged_half(unsigned addr, u32 (&x)[2]) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(x[0]), "=r"(x[1]) : "r"(addr) : "memory");
  }

  // The item's start, both producers alike: the page ids of its first tile (the last, T - 1) on
  // their way, then Q's rows into the Q tile at `q_addr` (copy_q), completing `q_full`.
  template <typename QT>
  __device__ __forceinline__ void start(unsigned q_addr, const FastDiv& by_group, int tid,
                                        unsigned long long* q_full) {
    fetch_pages(w.num_tiles - 1);
    copy_q<QT>(q_addr, by_group, tid);
    cp_async_arrive(q_full);
  }

  // Q's BLOCK_M packed rows (zero past the request's rows) into the Q tile at `dst`, in 16-bit
  // chunks: the K / V copies' rows and chunks (an fp8 cache's are bytes: Q's own from `tid`).
  template <typename QT>
  __device__ __forceinline__ void copy_q(unsigned dst, const FastDiv& by_group, int tid) const {
    constexpr int QCH = D / 8, QCPR = 128 % QCH == 0 ? QCH : SW / 16, QNPB = QCH / QCPR, QRP = 128 / QCPR;
    static_assert(BM % QRP == 0, "whole passes over Q's rows");
    const int q_chunk = kFp8 ? tid % QCPR : chunk, q_row = kFp8 ? tid / QCPR : row_in_pass;
    const QT* q = static_cast<const QT*>(p.q);
    const int group = by_group.divisor;
#pragma unroll 1  // once per CTA: rolled, so its addresses do not all live at once (the producer has few registers)
    for (int i = 0; i < BM / QRP; ++i) {
      const int r = q_row + QRP * i, row = w.row0 + r;
      const bool valid = row < w.rows;
      const QT* src = q;
      if (valid) {
        const int token = w.q_start + by_group.div(row), head = w.kv_head * group + by_group.mod(row);
        src = q + ((i64)token * p.num_qo_heads + head) * D + q_chunk * 8;
      }
#pragma unroll
      for (int b = 0; b < QNPB; ++b) {  // the row's column blocks (one: whole rows)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + swizzled_offset<BM, SW>(r, b * QCPR + q_chunk)),
                     "l"(src + b * QCPR * 8), "r"(valid ? 16 : 0)
                     : "memory");
      }
    }
  }
};

template <bool K> struct Ring { static constexpr bool value = K; };  // K's ring (true) or V's

// The producer's wait for a free ring stage (its `empty` barrier, of parity `phase`), both producers
// alike (diagnosis builds: thread 0 sums it, kernels/shared/trace.cuh; folded away otherwise).
__device__ __forceinline__ void wait_free_stage(unsigned long long* empty, int phase) {
  trace_span(kTraceProducerEmptyWaitNs, [&] { mbar_wait(empty, phase); });
}

// The producer's whole job for the CTA's work item: Q into the Q tile, then K of tile T-1,
// then per step K of the next tile and V of the one before, each after its stage's `empty`
// barrier, ending with V of tile 0. The caller waits for the last copies (cp.async.wait_all)
// before the thread exits.
template <typename QT, typename KVT, typename Tr>
__device__ __forceinline__ void produce(const AttentionParams& p, const PrefillWork& w, const FastDiv& by_group,
                                        PipeBarriers<Tr::kStages, Tr::kConsumerThreads>& bars,
                                        RingPos<Tr::kStages>& pos, unsigned q_addr, unsigned k_addr,
                                        unsigned v_addr, int tid) {
  constexpr int STAGE_BYTES = Tr::kKVTileBytes, V_STAGE_BYTES = Tr::kVTileBytes;
  KVProducer<KVT, Tr> prod(p, w, tid);
  typedef KVProducer<KVT, Tr> P;
  const int T = w.num_tiles;
  // K (a Ring<true>) or V (Ring<false>) of a tile into the stage at `dst` by cp.async, completing `full`
  // (diagnosis builds: thread 0 sums its copies' issue, kernels/shared/trace.cuh)
  auto load = [&](auto ring, unsigned dst, const int (&slots)[P::LOOKUPS], unsigned long long* full) {
    trace_span(kTraceProducerFillNs, [&] {
      prod.template copy<decltype(ring)::value>(dst, slots);
      cp_async_arrive(full);
    });
  };
  prod.template start<QT>(q_addr, by_group, tid, &bars.q_full);
  PipeState<Tr::kStages>& ks = pos.ks;
  PipeState<Tr::kStages>& vs = pos.vs;
  if (T > 0) {
    int slots_k[P::LOOKUPS], slots_v[P::LOOKUPS];
    prod.slots_flagged(T - 1, slots_k, bars);
    prod.fetch_pages(T - 2);
    wait_free_stage(&bars.k_empty[ks.stage], ks.phase ^ 1);
    load(Ring<true>(), k_addr + ks.stage * STAGE_BYTES, slots_k, &bars.k_full[ks.stage]);
    ks.advance();
    for (int i = 1; i < T; ++i) {
      const int tile = T - 1 - i;
#pragma unroll
      for (int j = 0; j < P::LOOKUPS; ++j) slots_v[j] = slots_k[j];
      prod.slots_flagged(tile, slots_k, bars);
      prod.fetch_pages(tile - 1);
      wait_free_stage(&bars.k_empty[ks.stage], ks.phase ^ 1);
      load(Ring<true>(), k_addr + ks.stage * STAGE_BYTES, slots_k, &bars.k_full[ks.stage]);
      ks.advance();
      wait_free_stage(&bars.v_empty[vs.stage], vs.phase ^ 1);
      load(Ring<false>(), v_addr + vs.stage * V_STAGE_BYTES, slots_v, &bars.v_full[vs.stage]);
      vs.advance();
    }
    wait_free_stage(&bars.v_empty[vs.stage], vs.phase ^ 1);
    load(Ring<false>(), v_addr + vs.stage * V_STAGE_BYTES, slots_k, &bars.v_full[vs.stage]);
    vs.advance();
  }
}

// produce() over an fp8 cache (Traits::kFp8): the same order of K and V tiles (K of tile T-1,
// then per step K of the next tile and V of the one before, ..., V of tile 0), each first copied
// by cp.async into one of two staging slots, one tile copy ahead of its widening into the ring's
// 16-bit stage (after that stage's `empty` barrier), which ends with the proxy fence and an
// arrival on the stage's `full` barrier. A copy is one cp.async group, so waiting for all but the
// newest group is waiting for this thread's bytes of the copy before (Q's copies ride in the
// first group). The copies alternate between the slots: in the steady steps K in slot 1, V in 0.
template <typename QT, typename KVT, typename Tr>
__device__ __forceinline__ void produce_fp8(const AttentionParams& p, const PrefillWork& w, const FastDiv& by_group,
                                            PipeBarriers<Tr::kStages, Tr::kConsumerThreads>& bars,
                                            RingPos<Tr::kStages>& pos, unsigned q_addr, unsigned k_addr,
                                            unsigned v_addr, unsigned staging, int tid) {
  constexpr int STAGE_BYTES = Tr::kKVTileBytes, SLOT_BYTES = Tr::kStagingSlotBytes;
  static_assert(Tr::kStaging == 2, "two staging slots: one being widened, one being copied");
  static_assert(Tr::kVTileBytes == STAGE_BYTES, "an fp8 cache: one head dim, one stage size for K and V");
  KVProducer<KVT, Tr> prod(p, w, tid);
  typedef KVProducer<KVT, Tr> P;
  const int T = w.num_tiles;
  prod.template start<QT>(q_addr, by_group, tid, &bars.q_full);
  PipeState<Tr::kStages>& ks = pos.ks;
  PipeState<Tr::kStages>& vs = pos.vs;
  // a K (V) tile's bytes into staging slot `slot`, one cp.async group
  auto fetch = [&](bool is_k, int slot, const int (&slots)[P::LOOKUPS]) {
    prod.stage_fp8(is_k, staging + slot * SLOT_BYTES, slots);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  // the copy before the newest one (in staging slot `slot`) widened into the next K stage (a
  // Ring<true>) or V stage (Ring<false>). (Diagnosis builds: thread 0 sums its waits for its copies
  // and for free stages, and its widening with the fence and arrival, kernels/shared/trace.cuh;
  // folded away otherwise.)
  auto widen = [&](auto ring, int slot) {
    constexpr bool K = decltype(ring)::value;
    trace_span(kTraceProducerCopyWaitNs, [] {
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // this thread's bytes of that copy
    });
    PipeState<Tr::kStages>& s = K ? ks : vs;
    wait_free_stage(K ? &bars.k_empty[s.stage] : &bars.v_empty[s.stage], s.phase ^ 1);
    trace_span(kTraceProducerFillNs, [&] {
      prod.widen_fp8(staging + slot * SLOT_BYTES, (K ? k_addr : v_addr) + s.stage * STAGE_BYTES);
      fence_async_shared();
      mbar_arrive(K ? &bars.k_full[s.stage] : &bars.v_full[s.stage]);
    });
    s.advance();
  };
  if (T > 0) {
    int slots_k[P::LOOKUPS], slots_v[P::LOOKUPS];
    prod.slots_flagged(T - 1, slots_k, bars);
    prod.fetch_pages(T - 2);
    fetch(true, 0, slots_k);  // K of tile T-1
    for (int i = 1; i < T; ++i) {
      const int tile = T - 1 - i;
#pragma unroll
      for (int j = 0; j < P::LOOKUPS; ++j) slots_v[j] = slots_k[j];
      prod.slots_flagged(tile, slots_k, bars);
      prod.fetch_pages(tile - 1);
      fetch(true, 1, slots_k);  // K of `tile`
      if (i == 1) widen(Ring<true>(), 0);  // K of tile T-1 (the first step)
      else widen(Ring<false>(), 0);        // V of tile + 2
      fetch(false, 0, slots_v);  // V of tile + 1
      widen(Ring<true>(), 1);    // K of `tile`
    }
    fetch(false, 1, slots_k);  // V of tile 0
    if (T == 1) widen(Ring<true>(), 0);  // K of tile 0 (one tile)
    else widen(Ring<false>(), 0);        // V of tile 1
    asm volatile("cp.async.commit_group;\n" ::: "memory");  // (an empty group: widen waits for all but the newest)
    widen(Ring<false>(), 1);  // V of tile 0
  }
}

}  // namespace sm90
}  // namespace cupy_fa
