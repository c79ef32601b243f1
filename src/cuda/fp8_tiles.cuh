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
// A source (Src) gives the values: load<kFull>(k, row, c, nv, e, wr, s, v) fills v[0 .. 3] with the
// values of `row` at columns c .. c + 3 (nv of them exist, the rest 0; k: the row's place among the
// warp's 16; e: the row's expert, E for none, as fp8_tiles.h's TileRows; wr: its routing weight
// where kRowWeights, weight_of_row(row) read once a tile into shared memory), begin_tile() and
// end_tile(t, warp, lane) bracket a tile's columns (the backward's row sums); kRowExperts: each
// row's expert is looked up (rows of several experts in one tile, for a bias), via
// expert_of_row(row); column_tile(i, KB): the i-th column tile a block takes (an order that
// reads the same source columns twice in a row, so the second read comes from the cache);
// kMinBlocks: the blocks an SM must hold (2 where the source's registers allow it, so that one
// block's loads overlap another's reductions and stores). Streaming (Stream<Src>): a source's
// kPacks packs of 4 elements (PackT) a row and lane, at pack_src(j, row, c) where streams(c, nv),
// are copied into shared memory (cp.async) while an earlier column tile is worked, and load gets
// them there (s: pack j at s[j * kThreads]; null: load from global memory). One block fills an
// SM (4 warps a scheduler), too few to cover DRAM's latency with a row's loads at a time, and
// the registers hold no more. stream_next(i, kb1): the column tile whose copies are issued while
// tile i is worked (-1: none); with two buffers before tile i's loads, with one after them.
// The full-tile path (kFull, column_tiles<true>): on a tile of 128 rows in a launch whose column
// tiles are all whole, stores all widest and the source's loads proven (fast_launch, the source's
// fast_ok(): 4-value packs, every one streamed where streams_full(c), no bias), the tile is
// worked without a bound check per row, column or store and the loads read shared memory alone
// (the kernels are bound by instruction issue at one block an SM: docs/notes/fp8-recipes.md's
// Nsight Compute profile); the rest (partial tiles, other layouts, a bias) take the checked path.
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

// The column tiles' staging (fp8_tiles_plan.h: the swizzle, stage_slot / stage_pair): column
// c's 128 bytes (one row of q_t's tile) in 16 slots of 8 bytes, read back 16 bytes a thread.
struct Stage {
  uint2 slot[kTile][kTile / 8];
  float scale[kTile];  // the tile's column scales, one a column (quantize_tile)
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
template <bool kFull, typename Src, typename AfterLoad>
__device__ __forceinline__ void quantize_tile(Src& src, const detail::TileRows& t, int64_t kb, int64_t cols,
                                              const detail::TileOut& o, const Align& al, float (*red)[kTile],
                                              Stage& stage, const int32_t* row_e, const float* row_w,
                                              const typename Src::PackT* slots, AfterLoad after_load) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  const int64_t c = kb * kTile + 4 * l;
  const int nv = kFull ? 4 : c >= cols ? 0 : (cols - c >= 4 ? 4 : static_cast<int>(cols - c));
  float v[kRowsPerWarp][4];
  if constexpr (kFull) {
    src.load_full(t.r0 + kRowsPerWarp * w, c, row_w + kRowsPerWarp * w, slots, v);
  } else {
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int i = kRowsPerWarp * w + k;
#pragma unroll
      for (int j = 0; j < 4; ++j) v[k][j] = 0.0f;
      if (i < t.n && nv > 0)
        src.load(k, t.r0 + i, c, nv, Src::kRowExperts ? row_e[i] : t.e, Src::kRowWeights ? row_w[i] : 1.0f,
                 slots ? slots + k * Src::kPacks * kThreads : nullptr, v[k]);
    }
  }
  after_load();
  if (o.q != nullptr) {
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int i = kRowsPerWarp * w + k;
      if (!kFull && i >= t.n) continue;  // the same in the whole warp: the shuffles below see every lane
      float m = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) m = fmaxf(m, fabsf(v[k][j]));  // NaN ignored
      const float s = fp8::scale_of(warp_amax_nonneg(m));
      const uint32_t word = fp8::from_scaled4(v[k][0] * s, v[k][1] * s, v[k][2] * s, v[k][3] * s);
      const int64_t r = t.r0 + i;
      uint8_t* q = static_cast<uint8_t*>(o.q) + r * o.q_stride + c;
      if (kFull || (nv == 4 && al.q4)) {
        *reinterpret_cast<uint32_t*>(q) = word;
      } else {
        for (int j = 0; j < nv; ++j) q[j] = static_cast<uint8_t>(word >> (8 * j));
      }
      if (l == 0) o.scale[kb * o.scale_stride + r] = fp8::inv_scale(s);
    }
  }
  if (o.q_t != nullptr && t.ct >= 0) {  // the same in the whole block: the barriers below
    float m[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      m[j] = 0.0f;
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) m[j] = fmaxf(m[j], fabsf(v[k][j]));  // padding rows are 0
    }
    reinterpret_cast<float4*>(red[w])[l] = make_float4(m[0], m[1], m[2], m[3]);
    __syncthreads();
    // Each column's amax over the 16 warps and its scale, once: thread x < 128 takes column x
    // (a warp's 32 reads of one row of red, no bank conflict), and every thread then reads its 4
    // columns' scales in one 16-byte read. (Every thread reducing its own 4 columns took 16
    // 16-byte reads and 60 comparisons a thread, and 4 scales, 16 times over.)
    const int64_t c0 = kb * kTile;
    if (threadIdx.x < kTile) {
      float mx = red[0][threadIdx.x];
#pragma unroll
      for (int ww = 1; ww < kWarps; ++ww) mx = fmaxf(mx, red[ww][threadIdx.x]);
      const float s = fp8::scale_of(mx);
      stage.scale[threadIdx.x] = s;
      if (kFull || c0 + threadIdx.x < cols) o.col_scale[t.ct * o.cs_stride + c0 + threadIdx.x] = fp8::inv_scale(s);
    }
    __syncthreads();
    const float4 s4 = reinterpret_cast<const float4*>(stage.scale)[l];
    const float sc[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float s = sc[j];
      if (kFull || j < nv) {
        static_assert(kRowsPerWarp == 8, "a warp's rows of a column are one 8-byte slot");
        const uint32_t w0 = fp8::from_scaled4(v[0][j] * s, v[1][j] * s, v[2][j] * s, v[3][j] * s);
        const uint32_t w1 = fp8::from_scaled4(v[4][j] * s, v[5][j] * s, v[6][j] * s, v[7][j] * s);
        const int cl = 4 * l + j;  // the column within the tile
        stage.slot[cl][stage_slot(cl, w)] = make_uint2(w0, w1);
      }
    }
    // red and stage.scale are written again by the next column tile, and stage read below: all
    // after this barrier (the next tile's red writes follow it, its scale and stage writes its
    // first barrier, after every read here).
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kTile * 8 / kThreads; ++i) {
      const int x = threadIdx.x + i * kThreads, cl = x >> 3, h = x & 7;
      uint8_t* const dst = static_cast<uint8_t*>(o.q_t) + (c0 + cl) * o.qt_stride + t.ct * kTile + 16 * h;
      if (kFull)
        *reinterpret_cast<uint4*>(dst) = stage_read16(stage, cl, h);
      else if (c0 + cl < cols)  // columns past cols were not staged
        store16(dst, stage_read16(stage, cl, h), al.qt);
    }
  }
}

// The shared memory a source's streaming takes (the header's Streaming): a buffer holds
// one column tile's packs, pack j of a thread's k-th row at slot (k kPacks + j) kThreads +
// threadIdx.x, so that each thread copies and reads its own slots (no barrier) and a warp's 32
// consecutive packs meet no bank conflict. Two buffers where they fit with the source's stash
// (the next tile's copies in flight while this one's are read), one where only one fits (the
// next copies issued after this tile's loads), none beyond (the loads from global memory).
template <typename Src>
struct Stream {
  static constexpr int kBudget = 160 * 1024;  // dynamic shared memory a block, beside ~25 KiB static
  static constexpr int kBuffer = kRowsPerWarp * Src::kPacks * kThreads * static_cast<int>(sizeof(typename Src::PackT));
  static constexpr int kBuffers = Src::kPacks == 0                                       ? 0
                                  : Src::kTwoBuffers && Src::kStashBytes + 2 * kBuffer <= kBudget ? 2
                                  : Src::kStashBytes + kBuffer <= kBudget                ? 1
                                                                                           : 0;
  static constexpr int kSmem = Src::kStashBytes + kBuffers * kBuffer;  // the launch's dynamic bytes
};

// Column tile kb's packs of this thread's rows into `slots` (its slots of one buffer), one group.
template <bool kFull, typename Src>
__device__ __forceinline__ void stream_tile(const Src& src, const detail::TileRows& t, int64_t kb, int64_t cols,
                                            typename Src::PackT* slots) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  const int64_t c = kb * kTile + 4 * l;
  const int nv = kFull ? 4 : c >= cols ? 0 : (cols - c >= 4 ? 4 : static_cast<int>(cols - c));
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int i = kRowsPerWarp * w + k;
    if (kFull ? src.streams_full(c) : i < t.n && nv > 0 && src.streams(c, nv)) {
#pragma unroll
      for (int j = 0; j < Src::kPacks; ++j)
        cp_async<sizeof(typename Src::PackT)>(slots + (k * Src::kPacks + j) * kThreads, src.pack_src(j, t.r0 + i, c));
    }
  }
  cp_async_commit();
}

// Row tile t's column tiles [kb0, kb1) of KB, their packs streamed where `streaming` (Stream).
// kFull: t has all 128 rows, every column tile all 128 columns, and the launch's stores and the
// source's loads take their widest form (the launch's `fast`): no bound is checked per row and
// column, and the loads read the streamed packs alone (fast_ok: the source's streams_full).
template <bool kFull, typename Src>
__device__ __forceinline__ void column_tiles(Src& src, const detail::TileRows& t, const detail::TileOut& o,
                                             const Align& al, int64_t kb0, int64_t kb1, int64_t KB, int64_t cols,
                                             bool streaming, float (*red)[kTile], Stage& stage, const int32_t* row_e,
                                             const float* row_w, typename Src::PackT* buf0,
                                             typename Src::PackT* buf1) {
  using St = Stream<Src>;
  using P = typename Src::PackT;
  // held: the tile whose packs buffer 0 holds or will (one buffer); with two, tile i's are
  // always in buffer (i - kb0) % 2, each issued while the tile before it was worked.
  int64_t held = -1;
  if (streaming && kb0 < kb1) stream_tile<kFull>(src, t, src.column_tile(kb0, KB), cols, buf0), held = kb0;
  for (int64_t i = kb0; i < kb1; ++i) {
    const bool odd = ((i - kb0) & 1) != 0;
    P* const mine = St::kBuffers == 2 && odd ? buf1 : buf0;
    const int64_t next = streaming ? src.stream_next(i, kb1) : -1;
    if constexpr (St::kBuffers == 2) {
      if (next >= 0) {
        stream_tile<kFull>(src, t, src.column_tile(next, KB), cols, odd ? buf0 : buf1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
    } else if constexpr (St::kBuffers == 1) {
      cp_async_wait<0>();
    }
    const bool in_smem = streaming && (St::kBuffers == 2 || held == i);
    quantize_tile<kFull>(src, t, src.column_tile(i, KB), cols, o, al, red, stage, row_e, row_w,
                         in_smem ? mine : nullptr,
                         [&] {
                           if constexpr (St::kBuffers == 1) {
                             if (next >= 0)
                               stream_tile<kFull>(src, t, src.column_tile(next, KB), cols, buf0), held = next;
                           }
                         });
  }
}

// The block's tiles: tile b = blockIdx.x, then on by gridDim.x (fp8_tiles.h's schedule: the
// padded tiles of q_t when column tiles are wanted, then with row tiles the rows past the last
// offset, whose count is read here from the offsets), and in each its column tiles
// [kb_per_block blockIdx.y, + kb_per_block), their packs streamed (Stream). fast: the launch
// allows column_tiles<true> on every tile of 128 rows (fast_launch).
template <typename Src>
__global__ void __launch_bounds__(kThreads, Src::kMinBlocks)
    tiles_kernel(Src src, const detail::TileOut o, const Align al, int64_t rows, int64_t cols, int64_t kb_per_block,
                 bool stream, bool fast) {
  using St = Stream<Src>;
  using P = typename Src::PackT;
  __shared__ __align__(16) float red[kWarps][kTile];
  __shared__ __align__(16) Stage stage;
  __shared__ int32_t row_e[Src::kRowExperts ? kTile : 1];
  __shared__ float row_w[Src::kRowWeights ? kTile : 1];
  extern __shared__ __align__(16) unsigned char tiles_smem[];  // the source's stash, then the buffers
  P* const buf0 = reinterpret_cast<P*>(tiles_smem + Src::kStashBytes) + threadIdx.x;
  P* const buf1 = buf0 + St::kBuffer / static_cast<int>(sizeof(P));
  const int64_t E = o.q_t ? o.experts : 0, out_tiles = o.q_t ? o.out_rows / kTile : 0;
  const int64_t tail0 = detail::tail_start(o.offsets, E, rows);
  const int64_t nt = detail::tile_count(out_tiles, o.q != nullptr, rows, tail0);
  const int64_t KB = (cols + kTile - 1) / kTile;
  const int64_t kb0 = static_cast<int64_t>(blockIdx.y) * kb_per_block;
  const int64_t kb1 = kb0 + kb_per_block < KB ? kb0 + kb_per_block : KB;
  const bool streaming = St::kBuffers > 0 && stream;  // (the launch gave the buffers' bytes)
  for (int64_t b = blockIdx.x; b < nt; b += gridDim.x) {
    const detail::TileRows t = detail::tile_rows(b, out_tiles, rows, o.offsets, o.pends, E, tail0);
    if constexpr (Src::kRowExperts || Src::kRowWeights) {
      if (threadIdx.x < kTile) {
        if constexpr (Src::kRowExperts)
          row_e[threadIdx.x] = threadIdx.x < t.n ? (t.e >= 0 ? static_cast<int32_t>(t.e)
                                                             : src.expert_of_row(t.r0 + threadIdx.x))
                                                 : 0;
        if constexpr (Src::kRowWeights)
          row_w[threadIdx.x] = threadIdx.x < t.n ? src.weight_of_row(t.r0 + threadIdx.x) : 0.0f;
      }
      __syncthreads();
    }
    src.begin_tile();
    if (fast && streaming && t.n == kTile)
      column_tiles<true>(src, t, o, al, kb0, kb1, KB, cols, streaming, red, stage, row_e, row_w, buf0, buf1);
    else
      column_tiles<false>(src, t, o, al, kb0, kb1, KB, cols, streaming, red, stage, row_e, row_w, buf0, buf1);
    src.end_tile(t, threadIdx.x >> 5, threadIdx.x & 31);
    if constexpr (Src::kRowExperts || Src::kRowWeights) __syncthreads();  // written again by the next tile
  }
}

// Whether tiles_kernel<Src> streams on `device`: where a block's shared memory holds the
// buffers of Stream<Src> beside the static arrays (Hopper's 227 KiB does; sm_80's 163 and sm_89's
// 99 may not: there the packs come from global memory). Asked of the device once, when the
// kernel's dynamic shared memory is also allowed (over 48 KiB it must be).
template <typename Src>
Status stream_setup(int device, const char* what, bool& stream, int& smem) {
  using St = Stream<Src>;
  static int known[64] = {};  // per device: 0 not asked yet, 1 streams, 2 does not
  if (device < 0 || device >= 64 || known[device] == 0) {
    int optin = 0;
    cudaFuncAttributes fa{};
    EA_TRY(cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), what));
    EA_TRY(cuda_check(cudaFuncGetAttributes(&fa, tiles_kernel<Src>), what));
    const bool fits = St::kBuffers > 0 && static_cast<int64_t>(fa.sharedSizeBytes) + St::kSmem <= optin;
    const int bytes = fits ? St::kSmem : Src::kStashBytes;
    if (bytes > 0) {
      const cudaError_t e = cudaFuncSetAttribute(tiles_kernel<Src>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      EA_TRY(cuda_check(e, what));
    }
    if (device >= 0 && device < 64) known[device] = fits ? 1 : 2;
    stream = fits;
  } else {
    stream = known[device] == 1;
  }
  smem = stream ? St::kSmem : Src::kStashBytes;
  return Status::kOk;
}

// Launches tiles_kernel on `device` over grid_x blocks of tiles (the schedule's count or fewer:
// the blocks loop) and the column tiles, tiles_per_block of a tile's a block, streaming where
// the device allows it (stream_setup).
template <typename Src>
Status launch_tiles(const Src& src, const detail::TileOut& o, int64_t rows, int64_t cols, int64_t grid_x,
                    bool all_columns, int device, cudaStream_t st, const char* what) {
  const int64_t KB = (cols + kTile - 1) / kTile;
  const int64_t per = tiles_per_block(KB, grid_x, all_columns, sm_count(device));
  const int64_t grid_y = all_columns ? 1 : (KB + per - 1) / per;
  if (grid_x > 0x7fffffff) grid_x = 0x7fffffff;
  if (grid_x <= 0 || grid_y <= 0) return Status::kOk;
  bool stream = false;
  int smem = 0;
  EA_TRY(stream_setup<Src>(device, what, stream, smem));
  const Align al = align_of(o, rows, cols);
  tiles_kernel<Src><<<dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)), kThreads, smem, st>>>(
      src, o, al, rows, cols, per, stream, fast_launch(al, o, cols, src.fast_ok()));
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
  static constexpr bool kRowWeights = false;
  static constexpr int kMinBlocks = 1;
  __device__ __forceinline__ void begin_tile() {}
  __device__ __forceinline__ void end_tile(const detail::TileRows&, int, int) {}
  __device__ __forceinline__ int64_t expert_of_row(int64_t) const { return 0; }
  __device__ __forceinline__ int64_t column_tile(int64_t i, int64_t) const { return i; }
  // Streaming (the header's): two buffers where they fit, the next column tile's copies while
  // tile i of [.., kb1) is worked, no stash.
  static constexpr bool kTwoBuffers = true;
  static constexpr int kStashBytes = 0;
  __device__ __forceinline__ int64_t stream_next(int64_t i, int64_t kb1) const { return i + 1 < kb1 ? i + 1 : -1; }
};

}  // namespace expertact::cuda::tiles
