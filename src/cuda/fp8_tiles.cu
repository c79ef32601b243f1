// The blockwise FP8 operands of a plain tensor on CUDA: row tiles, column tiles over the experts
// (with the row tiles from the same read), through the tile engine (fp8_tiles.cuh); and the
// weights' 128 x 128 blocks.
#include "cuda/device.h"
#include "cuda/fp8_tiles.cuh"

namespace expertact::cuda {
namespace {

// x's values: 4 at a time in one access where x's rows allow (vec: pointer and row stride
// multiples of 4 elements), else one by one. Two blocks an SM at 64 registers a thread (ptxas -v
// for sm_90: 100-180 bytes spilled with the streaming's addresses): one block alone, at 128
// registers and no spill to speak of, was no faster (docs/notes/fp8-recipes.md).
template <typename T>
struct PlainTileSrc : tiles::NoTileState {
  static constexpr int kMinBlocks = 2;
  const T* x;
  int64_t stride;
  bool vec;
  using PackT = Pack<T, 4>;
  static constexpr int kPacks = 1;
  __device__ __forceinline__ bool streams(int64_t, int nv) const { return vec && nv == 4; }
  __device__ __forceinline__ bool streams_full(int64_t) const { return true; }
  bool fast_ok() const { return vec; }
  __device__ __forceinline__ const PackT* pack_src(int, int64_t row, int64_t c) const {
    return reinterpret_cast<const PackT*>(x + row * stride + c);
  }
  // The full-tile path (fp8_tiles.cuh's column_tiles<true>): a warp's 8 rows from their streamed
  // packs (row k's at s[k kThreads]).
  __device__ __forceinline__ void load_full(int64_t, int64_t, const float*, const PackT* s,
                                            float (&v)[tiles::kRowsPerWarp][4]) const {
#pragma unroll
    for (int k = 0; k < tiles::kRowsPerWarp; ++k) {
      const PackT pk = s[k * tiles::kThreads];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[k][j] = pack_f(pk, j);
    }
  }
  __device__ __forceinline__ void load(int, int64_t row, int64_t c, int nv, int64_t, float, const PackT* s,
                                       float (&v)[4]) const {
    const T* p = x + row * stride + c;
    if (vec && nv == 4) {
      const PackT pk = s ? *s : *pack_src(0, row, c);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = pack_f(pk, j);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j < nv) v[j] = to_f(p[j]);
    }
  }
};

static_assert(tiles::Stream<PlainTileSrc<__nv_bfloat16>>::kSmem == 64 * 1024, "two buffers of x");

// One 128 x 128 block a thread block (expert e, row tile rb, column tile cb from blockIdx.x), the
// tile engine's thread layout: the values in registers, the block's amax (a warp's, then the 8
// warps' through shared memory), the bytes 4 a lane and row.
template <typename T>
__global__ void __launch_bounds__(tiles::kThreads, 1) blocks_kernel(const detail::BlockProblem b, int64_t RB,
                                                                   int64_t CB, bool vec, bool q4) {
  __shared__ float red[tiles::kWarps];
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  const int64_t idx = blockIdx.x, cb = idx % CB, rb = (idx / CB) % RB, e = idx / (CB * RB);
  const int64_t r0 = rb * tiles::kTile, c = cb * tiles::kTile + 4 * l;
  const int nv = c >= b.cols ? 0 : (b.cols - c >= 4 ? 4 : static_cast<int>(b.cols - c));
  const T* src = static_cast<const T*>(b.w) + e * b.w_estride;
  float v[tiles::kRowsPerWarp][4];
  float m = 0.0f;
#pragma unroll
  for (int k = 0; k < tiles::kRowsPerWarp; ++k) {
    const int64_t r = r0 + tiles::kRowsPerWarp * w + k;
#pragma unroll
    for (int j = 0; j < 4; ++j) v[k][j] = 0.0f;
    if (r < b.rows && nv > 0) {
      const T* p = src + r * b.w_rstride + c * b.w_cstride;
      if (vec && nv == 4) {
        const Pack<T, 4> pk = *reinterpret_cast<const Pack<T, 4>*>(p);
#pragma unroll
        for (int j = 0; j < 4; ++j) v[k][j] = pack_f(pk, j);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (j < nv) v[k][j] = to_f(p[j * b.w_cstride]);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) m = fmaxf(m, fabsf(v[k][j]));  // NaN ignored
  }
  m = warp_amax(m);
  if (l == 0) red[w] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int ww = 1; ww < tiles::kWarps; ++ww) m = fmaxf(m, red[ww]);
  const float s = fp8::scale_of(m);
  if (threadIdx.x == 0) b.scale[(e * RB + rb) * b.scale_stride + cb] = 1.0f / s;
  if (nv == 0) return;
#pragma unroll
  for (int k = 0; k < tiles::kRowsPerWarp; ++k) {
    const int64_t r = r0 + tiles::kRowsPerWarp * w + k;
    if (r >= b.rows) break;
    const uint32_t word = fp8::from_scaled4(v[k][0] * s, v[k][1] * s, v[k][2] * s, v[k][3] * s);
    uint8_t* q = static_cast<uint8_t*>(b.q) + (e * b.rows + r) * b.q_stride + c;
    if (nv == 4 && q4) {
      *reinterpret_cast<uint32_t*>(q) = word;
    } else {
      for (int j = 0; j < nv; ++j) q[j] = static_cast<uint8_t>(word >> (8 * j));
    }
  }
}

}  // namespace
}  // namespace expertact::cuda

namespace expertact::detail {

// Column tiles with row tiles: blocks for the rows past the last offset, at most this many an
// SM (they loop over the rest; usually there are none or few).
constexpr int64_t kTailBlocksPerSm = 4;

Status cuda_fp8_tiles(const TileSrc& s, const TileOut& o, void* stream) {
  cuda::DeviceGuard guard(s.device_id);
  EA_TRY(enter_operands(s.device_id, guard,
                        {{"x", s.x}, {"q", o.q}, {"scale", o.scale}, {"q_t", o.q_t}, {"col_scale", o.col_scale},
                         {"offsets", o.offsets}, {"padded_offsets", o.pends}}));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t grid_x = cuda::tiles::schedule_blocks(o, s.rows, kTailBlocksPerSm * cuda::sm_count(s.device_id));
  return cuda::dispatch_storage(s.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    const bool vec = cuda::tiles::plain_vec4(s, sizeof(T));
    return cuda::tiles::launch_tiles(cuda::PlainTileSrc<T>{{}, static_cast<const T*>(s.x), s.x_stride, vec}, o,
                                     s.rows, s.cols, grid_x, false, s.device_id, st,
                                     "fp8 tiles kernel launch");
  });
}

Status cuda_fp8_blocks(const BlockProblem& b, void* stream) {
  cuda::DeviceGuard guard(b.device_id);
  EA_TRY(enter_operands(b.device_id, guard, {{"w", b.w}, {"q", b.q}, {"scale", b.scale}}));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t RB = (b.rows + cuda::tiles::kTile - 1) / cuda::tiles::kTile;
  const int64_t CB = (b.cols + cuda::tiles::kTile - 1) / cuda::tiles::kTile;
  const int64_t blocks = b.experts * RB * CB;
  if (blocks > 0x7fffffff)
    return fail(Status::kInvalidArgument, "w has too many 128 x 128 blocks (", blocks, ")");
  const bool q4 = reinterpret_cast<uintptr_t>(b.q) % 4 == 0 && b.q_stride % 4 == 0;
  return cuda::dispatch_storage(b.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    const int64_t es = sizeof(T);
    const bool vec = b.w_cstride == 1 && reinterpret_cast<uintptr_t>(b.w) % (4 * es) == 0 &&
                     (b.experts <= 1 || b.w_estride % 4 == 0) && (b.rows <= 1 || b.w_rstride % 4 == 0);
    cuda::blocks_kernel<T><<<static_cast<unsigned>(blocks), cuda::tiles::kThreads, 0, st>>>(b, RB, CB, vec, q4);
    return cuda::cuda_check(cudaGetLastError(), "fp8 blocks kernel launch");
  });
}

}  // namespace expertact::detail
