// A step's device inputs into the static buffers in one launch (cupy_fa/_staging.py): a graph
// step's lengths, page-table rows, q, sinks and mask are copies of several source arrays, each
// a driver call of its own as memcpys (5-7 us of host time apiece); here they are the copies of
// one kernel's parameter struct (StageParams, params.cuh), read by value at launch. Each copy
// moves in the widest unit (16 down to 1 bytes) that divides its addresses, its row bytes and,
// over several rows, its pitches, so a caller's q at any alignment is copied as it is; the
// threads of the grid stride over each copy in turn (the copies write disjoint buffers).
#include "shared/common.cuh"
#include "shared/params.cuh"

namespace cupy_fa {

constexpr int kStageThreads = 256;

template <typename U>
__device__ __forceinline__ void stage_rows(const StageCopy& c, i64 first, i64 step) {
  const i64 per_row = c.bytes / (i64)sizeof(U);
  const i64 total = per_row * c.rows;
  for (i64 i = first; i < total; i += step) {
    const i64 r = c.rows == 1 ? 0 : i / per_row;
    const i64 k = i - r * per_row;
    const U* from = reinterpret_cast<const U*>(static_cast<const char*>(c.src) + r * c.src_pitch) + k;
    U* to = reinterpret_cast<U*>(static_cast<char*>(c.dst) + r * c.dst_pitch) + k;
    *to = *from;
  }
}

__global__ void __launch_bounds__(kStageThreads) stage_kernel(const __grid_constant__ StageParams p) {
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, step = (i64)gridDim.x * blockDim.x;
  for (int n = 0; n < p.count; ++n) {
    const StageCopy& c = p.copies[n];
    unsigned long long bits = reinterpret_cast<unsigned long long>(c.src) |
                              reinterpret_cast<unsigned long long>(c.dst) | (unsigned long long)c.bytes | 16ull;
    if (c.rows > 1) bits |= (unsigned long long)(unsigned)c.src_pitch | (unsigned long long)(unsigned)c.dst_pitch;
    switch (bits & (~bits + 1ull)) {  // the lowest set bit: the widest unit every address and size allows
      case 16: stage_rows<uint4>(c, first, step); break;
      case 8: stage_rows<uint2>(c, first, step); break;
      case 4: stage_rows<unsigned>(c, first, step); break;
      case 2: stage_rows<unsigned short>(c, first, step); break;
      default: stage_rows<unsigned char>(c, first, step); break;
    }
    const int words = c.fill_bytes / 4;
    for (i64 i = first; i < (i64)words * c.rows; i += step) {  // each row's fill after its copied bytes
      const i64 r = i / words;
      reinterpret_cast<int*>(static_cast<char*>(c.dst) + r * c.dst_pitch + c.bytes)[i - r * words] = c.fill;
    }
  }
}

}  // namespace cupy_fa
