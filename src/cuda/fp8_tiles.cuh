// The tile engine of the blockwise FP8 kernels (fp8_tiles.cu, fp8_glu_*tiles.cu,
// fp8_backward_tiles.cu): a block of 512 threads takes a tile of 128 rows (src/core/fp8_tiles.h's
// schedule) and walks its 128-column tiles; in each, warp w holds rows 8 w .. 8 w + 7 and lane l
// columns 4 l .. 4 l + 3 as float32 in registers (32 values, from the source: x, the activation,
// its gradient). Row tiles: a row's 128 values lie in one warp, so its amax is a warp reduction,
// and its bytes one 4-byte store a lane. Column tiles: each thread's running column amax over its
// 8 rows, the 16 warps' combined through shared memory, then each column's 8 bytes a thread
// (from_scaled4 four rows at a time) staged in shared memory and stored as whole 128-byte rows
// of q_t, 16 bytes a thread (a warp's store fills 16 sectors; storing each thread's 8 bytes
// straight to its own row of q_t took 32 sectors a quarter written). The scale and conversion
// are fp8.h's, as on the CPU: the same bytes for the same values. (256 threads of 16 rows held
// 64 values a thread: the activation's sources spilled at 128 registers.)
//
// A source (Src) gives the values: load(k, row, c, nv, e, v) fills v[0 .. 3] with the values of
// `row` at columns c .. c + 3 (nv of them exist, the rest 0; k: the row's place among the warp's
// 16; e: the row's expert, E for none, as fp8_tiles.h's TileRows), begin_tile() and
// end_tile(t, warp, lane) bracket a tile's columns (the backward's row sums); kRowExperts: each
// row's expert is looked up (rows of several experts in one tile, for a bias), via
// expert_of_row(row); column_tile(i, KB): the i-th column tile a block takes (an order that
// reads the same source columns twice in a row, so the second read comes from the cache);
// kMinBlocks: the blocks an SM must hold (2 where the source's registers allow it, so that one
// block's loads overlap another's reductions and stores); prefetch_tile(i, kb1, KB) and
// prefetch(row, c0, n, part): the column tile whose source goes into L2 while tile i is worked
// (-1: none), and that prefetch, a quarter of one row's lines a thread (where one block fills an
// SM, nothing else overlaps its loads).
#pragma once

#include <cstdint>

#include "core/fp8.h"
#include "core/fp8_tiles.h"
#include "cuda/fp8_common.cuh"
#include "cuda/fp8_tiles_plan.h"

namespace expertact::cuda::tiles {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = 8;  // kWarps x kRowsPerWarp = 128 rows
constexpr int kTile = 128;

// Four words (16 bytes, the first byte lowest) at dst, in the widest stores `align` allows
// (Align::qt, proven on the host: fp8_tiles_plan.h).
__device__ __forceinline__ void store16(uint8_t* dst, const uint4& w, int align) {
  if (align == 16) {
    *reinterpret_cast<uint4*>(dst) = w;
  } else if (align == 8) {
    reinterpret_cast<uint2*>(dst)[0] = make_uint2(w.x, w.y);
    reinterpret_cast<uint2*>(dst)[1] = make_uint2(w.z, w.w);
  } else if (align == 4) {
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    d[0] = w.x, d[1] = w.y, d[2] = w.z, d[3] = w.w;
  } else {
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) dst[i] = static_cast<uint8_t>(ws[i / 4] >> (8 * (i % 4)));
  }
}

// The 128-byte lines of [p, p + len) fetched into L2, the work split over 4 threads (part 0 .. 3):
// a hint, so only addresses the source will load are given.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ void prefetch_span(const void* p, int64_t len, int part) {
  const char* b = static_cast<const char*>(p);
  for (int64_t off = 128 * part; off < len; off += 512) prefetch_l2(b + off);
  if (part == 3 && len > 0) prefetch_l2(b + len - 1);  // the last line, when p is not on a line
}

// The column tiles' staging (fp8_tiles_plan.h: the swizzle, stage_slot / stage_pair): column
// c's 128 bytes (one row of q_t's tile) in 16 slots of 8 bytes, read back 16 bytes a thread.
struct Stage {
  uint2 slot[kTile][kTile / 8];
};
static_assert(kWarps == kTile / 8 && kRowsPerWarp == 8, "a warp's 8 rows of a column are one of its 16 slots");

// Logical slots 2 h and 2 h + 1 of column c (rows 16 h .. 16 h + 15), in order.
__device__ __forceinline__ uint4 stage_read16(const Stage& st, int c, int h) {
  const uint4 p = *reinterpret_cast<const uint4*>(&st.slot[c][stage_pair(c, h)]);
  return stage_swapped(c) ? make_uint4(p.z, p.w, p.x, p.y) : p;
}

// Column tile kb (columns 128 kb ..) of tile t: the values, then the row tiles (o.q) and the
// column tiles (o.q_t, when t has them). red: the column amax's exchange between warps; stage:
// the column tiles' bytes on their way to q_t.
template <typename Src>
__device__ __forceinline__ void quantize_tile(Src& src, const detail::TileRows& t, int64_t kb, int64_t cols,
                                              const detail::TileOut& o, const Align& al, float (*red)[kTile],
                                              Stage& stage, const int32_t* row_e) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  const int64_t c = kb * kTile + 4 * l;
  const int nv = c >= cols ? 0 : (cols - c >= 4 ? 4 : static_cast<int>(cols - c));
  float v[kRowsPerWarp][4];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int i = kRowsPerWarp * w + k;
#pragma unroll
    for (int j = 0; j < 4; ++j) v[k][j] = 0.0f;
    if (i < t.n && nv > 0) src.load(k, t.r0 + i, c, nv, Src::kRowExperts ? row_e[i] : t.e, v[k]);
  }
  if (o.q != nullptr) {
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int i = kRowsPerWarp * w + k;
      if (i >= t.n) continue;  // the same in the whole warp: the shuffles below see every lane
      float m = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) m = fmaxf(m, fabsf(v[k][j]));  // NaN ignored
      const float s = fp8::scale_of(warp_amax(m));
      const uint32_t word = fp8::from_scaled4(v[k][0] * s, v[k][1] * s, v[k][2] * s, v[k][3] * s);
      const int64_t r = t.r0 + i;
      uint8_t* q = static_cast<uint8_t*>(o.q) + r * o.q_stride + c;
      if (nv == 4 && al.q4) {
        *reinterpret_cast<uint32_t*>(q) = word;
      } else {
        for (int j = 0; j < nv; ++j) q[j] = static_cast<uint8_t>(word >> (8 * j));
      }
      if (l == 0) o.scale[kb * o.scale_stride + r] = 1.0f / s;
    }
  }
  if (o.q_t != nullptr && t.ct >= 0) {  // the same in the whole block: the barriers below
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float m = 0.0f;
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) m = fmaxf(m, fabsf(v[k][j]));  // padding rows are 0
      red[w][4 * l + j] = m;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float m = red[0][4 * l + j];
#pragma unroll
      for (int ww = 1; ww < kWarps; ++ww) m = fmaxf(m, red[ww][4 * l + j]);
      const float s = fp8::scale_of(m);
      if (j < nv) {
        static_assert(kRowsPerWarp == 8, "a warp's rows of a column are one 8-byte slot");
        const uint32_t w0 = fp8::from_scaled4(v[0][j] * s, v[1][j] * s, v[2][j] * s, v[3][j] * s);
        const uint32_t w1 = fp8::from_scaled4(v[4][j] * s, v[5][j] * s, v[6][j] * s, v[7][j] * s);
        const int cl = 4 * l + j;  // the column within the tile
        stage.slot[cl][stage_slot(cl, w)] = make_uint2(w0, w1);
        if (w == 0) o.col_scale[t.ct * o.cs_stride + c + j] = 1.0f / s;
      }
    }
    // red is written again by the next column tile, and stage read below: both after this
    // barrier (the next tile's stage writes follow its first barrier, after every read here).
    __syncthreads();
    const int64_t c0 = kb * kTile;
#pragma unroll
    for (int i = 0; i < kTile * 8 / kThreads; ++i) {
      const int x = threadIdx.x + i * kThreads, cl = x >> 3, h = x & 7;
      if (c0 + cl < cols)  // columns past cols were not staged
        store16(static_cast<uint8_t*>(o.q_t) + (c0 + cl) * o.qt_stride + t.ct * kTile + 16 * h,
                stage_read16(stage, cl, h), al.qt);
    }
  }
}

// The block's tiles: tile b = blockIdx.x, then on by gridDim.x (fp8_tiles.h's schedule: the
// padded tiles of q_t when column tiles are wanted, then with row tiles the rows past the last
// offset, whose count is read here from the offsets), and in each its column tiles
// [kb_per_block blockIdx.y, + kb_per_block).
template <typename Src>
__global__ void __launch_bounds__(kThreads, Src::kMinBlocks)
    tiles_kernel(Src src, const detail::TileOut o, const Align al, int64_t rows, int64_t cols, int64_t kb_per_block) {
  __shared__ float red[kWarps][kTile];
  __shared__ __align__(16) Stage stage;
  __shared__ int32_t row_e[Src::kRowExperts ? kTile : 1];
  const int64_t E = o.q_t ? o.experts : 0, out_tiles = o.q_t ? o.out_rows / kTile : 0;
  const int64_t tail0 = detail::tail_start(o.offsets, E, rows);
  const int64_t nt = detail::tile_count(out_tiles, o.q != nullptr, rows, tail0);
  const int64_t KB = (cols + kTile - 1) / kTile;
  const int64_t kb0 = static_cast<int64_t>(blockIdx.y) * kb_per_block;
  const int64_t kb1 = kb0 + kb_per_block < KB ? kb0 + kb_per_block : KB;
  for (int64_t b = blockIdx.x; b < nt; b += gridDim.x) {
    const detail::TileRows t = detail::tile_rows(b, out_tiles, rows, o.offsets, o.pends, E, tail0);
    if constexpr (Src::kRowExperts) {
      if (threadIdx.x < kTile)
        row_e[threadIdx.x] = threadIdx.x < t.n ? (t.e >= 0 ? static_cast<int32_t>(t.e)
                                                           : src.expert_of_row(t.r0 + threadIdx.x))
                                               : 0;
      __syncthreads();
    }
    src.begin_tile();
    for (int64_t i = kb0; i < kb1; ++i) {
      // The source of a later column tile into L2 (4 threads a row), so that HBM streams it while
      // this one is reduced and stored: one block an SM has no other block's loads to overlap.
      const int64_t next = src.prefetch_tile(i, kb1, KB);
      if (next >= 0 && static_cast<int>(threadIdx.x >> 2) < t.n) {
        const int64_t c0 = next * kTile;
        src.prefetch(t.r0 + (threadIdx.x >> 2), c0, cols - c0 < kTile ? cols - c0 : kTile, threadIdx.x & 3);
      }
      quantize_tile(src, t, src.column_tile(i, KB), cols, o, al, red, stage, row_e);
    }
    src.end_tile(t, threadIdx.x >> 5, threadIdx.x & 31);
    if constexpr (Src::kRowExperts) __syncthreads();  // row_e is written again by the next tile
  }
}

// Launches tiles_kernel over grid_x blocks of tiles (the schedule's count or fewer: the blocks
// loop) and the column tiles, tiles_per_block of a tile's a block (sms: the device's SMs).
template <typename Src>
Status launch_tiles(const Src& src, const detail::TileOut& o, int64_t rows, int64_t cols, int64_t grid_x,
                    bool all_columns, int64_t sms, cudaStream_t st, const char* what, int dynamic_smem = 0) {
  const int64_t KB = (cols + kTile - 1) / kTile;
  const int64_t per = tiles_per_block(KB, grid_x, all_columns, sms);
  const int64_t grid_y = all_columns ? 1 : (KB + per - 1) / per;
  if (grid_x > 0x7fffffff) grid_x = 0x7fffffff;
  if (grid_x <= 0 || grid_y <= 0) return Status::kOk;
  if (dynamic_smem > 0) {  // over 48 KiB a block must be allowed first
    const Status s = cuda_check(
        cudaFuncSetAttribute(tiles_kernel<Src>, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_smem), what);
    if (s != Status::kOk) return s;
  }
  tiles_kernel<Src><<<dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)), kThreads, dynamic_smem,
                      st>>>(src, o, align_of(o, rows, cols), rows, cols, per);
  return cuda_check(cudaGetLastError(), what);
}

// The blocks a schedule takes: one per padded tile of q_t, and with row tiles one per 128 rows
// past the last offset, whose number the host does not know (the offsets are not read on the
// host): every row's (no column tiles) or at most `tail_blocks`, looping over the rest.
inline int64_t schedule_blocks(const detail::TileOut& o, int64_t rows, int64_t tail_blocks) {
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  if (o.q_t == nullptr) return row_tiles;
  const int64_t out_tiles = o.out_rows / kTile;
  if (o.q == nullptr) return out_tiles;
  return out_tiles + (row_tiles < tail_blocks ? row_tiles : tail_blocks);
}

// What a source without per-tile state or per-row experts leaves out.
struct NoTileState {
  static constexpr bool kRowExperts = false;
  static constexpr int kMinBlocks = 1;
  __device__ __forceinline__ void begin_tile() {}
  __device__ __forceinline__ void end_tile(const detail::TileRows&, int, int) {}
  __device__ __forceinline__ int64_t expert_of_row(int64_t) const { return 0; }
  __device__ __forceinline__ int64_t column_tile(int64_t i, int64_t) const { return i; }
  // The column tile whose source to prefetch while column tile i of [.., kb1) is quantised (-1:
  // none), and its prefetch: `row`'s source of columns c0 .. c0 + n - 1, part (0 .. 3) of it.
  __device__ __forceinline__ int64_t prefetch_tile(int64_t i, int64_t kb1, int64_t) const {
    return i + 1 < kb1 ? i + 1 : -1;
  }
};

}  // namespace expertact::cuda::tiles
