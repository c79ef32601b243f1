// quantize_colwise_grouped and glu_colwise_grouped on CUDA: per expert and column scales, and
// the values quantised into q_t, transposed (pass 2's kernels: fp8_colwise.cuh).
//
// Per expert and column (quantize_colwise_grouped), four launches on the stream: the scales
// zeroed; pass 1, each block a chunk of rows x 256 columns, every row read once in 16-byte
// packs along the row, the max |v| of each expert's run of rows and column merged into the
// scale buffer by atomicMax on the float's bits (non-negative floats order as their bits, so
// the result is the same whatever the order); the amax turned into the scale 1 / s in place;
// pass 2 (src/cuda/fp8_colwise.cuh), each block a tile of 128 output rows x 64 columns: its
// rows read in 16-byte packs, quantised with s = 1 / scale, packed four rows to a word into
// shared memory and written out transposed as 16-byte runs of q_t's rows; padding rows are
// written as 0 from the same tile. Where the operands allow 16-byte packs a block takes a run
// of tiles, carrying the expert map and the scales across them and copying the next tile into
// shared memory while it packs the current one (docs/notes/perf-notes-fp8.md, column-wise pass 2).
// glu_colwise_grouped takes the same tiles with the activation recomputed from gate_up as the
// values. With the amax given (quantize_rowwise's col_amax), pass 1 is skipped:
// x is read once.
#include "cuda/fp8_common.cuh"
#include "cuda/fp8_colwise.cuh"

namespace expertact::cuda {
namespace {

constexpr int kAmaxThreads = 256;  // pass 1: 8 warps, each a row at a time
constexpr int kAmaxCols = 256;     // pass 1: columns per block, 8 per lane
// Pass 1: 4 rows (64 bytes) in flight per lane; at 64 registers, 4 blocks an SM: 64 KB of
// loads in flight per SM. 8 rows a lane took 116 registers (2 blocks: the same 64 KB) or
// spilled when bounded to 3 blocks, so pass 1 stays as it is.
constexpr int kAmaxUnroll = 4;

using colwise::load8;

// The scale buffer before pass 1 (kFinal false: 0, the amax's identity) and after it
// (kFinal true: the amax -> 1 / s; the amax read from `amax` (row stride amax_stride) when
// given, e.g. the one quantize_rowwise computed, else from the scale buffer itself).
template <bool kFinal>
__global__ void __launch_bounds__(256) col_scale_kernel(float* scale, int64_t stride, int64_t experts, int64_t cols,
                                                        const float* amax = nullptr, int64_t amax_stride = 0) {
  const int64_t n = experts * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / cols, j = i % cols;
    float* p = scale + e * stride + j;
    if constexpr (kFinal) *p = 1.0f / fp8::scale_of(amax ? amax[e * amax_stride + j] : *p); else *p = 0.0f;
  }
}

// Pass 1: block b covers rows [chunk * (b / col_tiles), + chunk) and columns
// [256 * (b % col_tiles), + 256); warp w reads rows w, w + 8, ... of each expert's run in the
// chunk, lane l columns 8 l .. 8 l + 7. Every access stays inside x whatever the offsets
// hold (runs are clamped to the chunk).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kAmaxThreads) col_amax_kernel(const T* __restrict__ x, int64_t x_stride,
                                                               int64_t rows, int64_t cols,
                                                               const int32_t* __restrict__ offsets, int64_t E,
                                                               int64_t chunk, int64_t col_tiles,
                                                               unsigned* amax, int64_t amax_stride) {
  __shared__ float part[kAmaxThreads / 32][kAmaxCols];
  const int64_t b = blockIdx.x;
  const int64_t r0 = (b / col_tiles) * chunk;
  const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;
  const int64_t tc0 = (b % col_tiles) * kAmaxCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c = tc0 + 8 * lane;
  int64_t e = detail::expert_of(offsets, E, r0);
  int64_t start = e == 0 ? 0 : offsets[e - 1];
  for (; e < E; ++e) {  // the same runs in every thread: the barriers below are uniform
    const int64_t end = offsets[e];
    const int64_t lo = start > r0 ? start : r0, hi = end < r1 ? end : r1;
    start = end;
    if (lo >= r1) break;
    if (hi <= lo) continue;
    float m[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) m[i] = 0.0f;
    if (c < cols) {
      for (int64_t r = lo + warp; r < hi; r += 8 * kAmaxUnroll) {
        Pack<T, 8> in[kAmaxUnroll];
#pragma unroll
        for (int k = 0; k < kAmaxUnroll; ++k)
          if (r + 8 * k < hi) load8<T, kVec>(x + (r + 8 * k) * x_stride, c, cols, in[k]);
#pragma unroll
        for (int k = 0; k < kAmaxUnroll; ++k)
          if (r + 8 * k < hi) {
#pragma unroll
            for (int i = 0; i < 8; ++i) m[i] = fmaxf(m[i], fabsf(pack_f(in[k], i)));  // NaN ignored
          }
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) part[warp][8 * lane + i] = m[i];
    __syncthreads();
    float mm = part[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < kAmaxThreads / 32; ++w) mm = fmaxf(mm, part[w][threadIdx.x]);
    const int64_t cc = tc0 + threadIdx.x;
    if (cc < cols && mm > 0.0f) atomicMax(amax + e * amax_stride + cc, __float_as_uint(mm));
    __syncthreads();
  }
}

// glu_colwise_grouped: the one-tile form with the activation recomputed from gate_up element
// by element (h = act(gate [+ bias], up [+ bias]) * w, rounded to T as the activation's forward
// writes it, so that the bytes are quantize_colwise_grouped's of that h; math::glu_fwd, the
// forward kernels' expression).
template <typename T, Activation A, bool kAligned>
__global__ void __launch_bounds__(colwise::kThreads, 3) glu_col_quant_kernel(
    const T* g, const T* u, int64_t g_stride, int64_t u_stride, int step, const float* __restrict__ w,
    int64_t w_stride, const T* bg, const T* bu, int64_t b_stride, math::Coeffs cf, int64_t rows, int64_t cols,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ pends, int64_t E,
    const float* __restrict__ scale, int64_t scale_stride, uint8_t* __restrict__ q, int64_t q_stride,
    int64_t out_rows, int64_t col_tiles, int q_align) {
  __shared__ __align__(16) uint32_t tile[colwise::kCols * colwise::kWords];
  const colwise::Tile ct = colwise::tile_of(blockIdx.x, col_tiles, rows, out_rows, offsets, pends, E);
  const int64_t c = ct.c0 + 8 * (threadIdx.x & 7);
  colwise::tile_pack(ct, cols, scale, scale_stride, tile, [&](int k, float (&v)[8]) {
    const int64_t r = ct.src[k];
    const float wr = w ? w[r * w_stride] : 1.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = 0.0f;
      if (c + i < cols) {
        const int64_t j = (c + i) * step;
        float gv = to_f(g[r * g_stride + j]), uv = to_f(u[r * u_stride + j]);
        if (bg) gv += to_f(bg[ct.ex[k] * b_stride + j]), uv += to_f(bu[ct.ex[k] * b_stride + j]);
        v[i] = to_f(from_f<T>(math::glu_fwd<A>(gv, uv, wr, cf)));
      }
    }
  });
  __syncthreads();
  colwise::tile_store<kAligned>(ct, tile, cols, out_rows, q, q_stride, q_align);
}

// glu_colwise_grouped's source for colwise::run_kernel: h = act(gate) * (up + beta) * w of 8
// columns from c, rounded to T (the bytes of the bf16 forward, then the column-wise pass, as
// glu_col_quant_kernel's). kStep 1: gate's 8 values at g + c and up's at u + c (16 bytes each);
// kStep 2 (interleaved, u = g + 1): the 8 pairs at g + 2c, 32 contiguous bytes. No bias (that
// form takes glu_col_quant_kernel).
template <typename T, Activation A, int kStep>
struct GluRows {
  static_assert(sizeof(T) == 2, "16-bit rows: 8 values a 16-byte pack");
  struct Raw {
    Pack<T, 8> a, b;  // kStep 1: gate, up; kStep 2: pairs 0-3, 4-7
    float w;
  };
  const T* g;
  const T* u;
  int64_t g_stride, u_stride;
  const float* w;
  int64_t w_stride;
  math::Coeffs cf;
  __device__ __forceinline__ float value(const Raw& p, int i) const {
    float gv, uv;
    if constexpr (kStep == 1) {
      gv = pack_f(p.a, i), uv = pack_f(p.b, i);
    } else {
      const Pack<T, 8>& h = i < 4 ? p.a : p.b;
      gv = pack_f(h, 2 * (i % 4)), uv = pack_f(h, 2 * (i % 4) + 1);
    }
    return to_f(from_f<T>(math::glu_fwd<A>(gv, uv, p.w, cf)));
  }
  // The row's gate and up bytes of columns c .. c + 7 copied into shared memory (cp_async; w's
  // too, or 1 stored there).
  __device__ __forceinline__ void load_async(int32_t r, int32_t c, Raw* dst) const {
    const T* gr = g + static_cast<int64_t>(r) * g_stride;
    if constexpr (kStep == 1) {
      cp_async<16>(&dst->a, gr + c);
      cp_async<16>(&dst->b, u + static_cast<int64_t>(r) * u_stride + c);
    } else {
      cp_async<16>(&dst->a, gr + 2 * c);
      cp_async<16>(&dst->b, gr + 2 * c + 8);
    }
    if (w) cp_async<4>(&dst->w, w + static_cast<int64_t>(r) * w_stride);
    else dst->w = 1.0f;
  }
};

}  // namespace
}  // namespace expertact::cuda

namespace expertact::detail {
namespace {

// The column-wise pass's setup, shared by quantize_colwise_grouped and glu_colwise_grouped:
// the scale kernel's grid, the widest store q_t's rows take, and the pass-2 tiles (0 when
// there is nothing to write).
unsigned col_scale_blocks(const Fp8Cols& c) {
  const int64_t n = c.experts * c.cols;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, cuda::sm_count(c.device_id) * 8)));
}

int q_t_align(const Fp8Cols& c) {
  const auto addr = reinterpret_cast<uintptr_t>(c.q_t);
  const bool one_row = c.cols <= 1;
  return addr % 16 == 0 && (one_row || c.q_stride % 16 == 0)  ? 16
         : addr % 4 == 0 && (one_row || c.q_stride % 4 == 0) ? 4
                                                              : 1;
}

// Pass 2 by run_kernel over `src`: the next tile copied into shared memory while the current
// one is packed (colwise::run_kernel).
template <typename Src>
Status launch_runs(const Src& src, const Fp8Cols& c, const int32_t* pends, int64_t col_tiles, int32_t subs,
                   int64_t blocks, cudaStream_t st) {
  namespace cw = cuda::colwise;
  auto kernel = cw::run_kernel<Src>;
  const int dyn = cw::async_stage_bytes<Src>();
  EA_TRY(cuda::cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn),
                          "fp8 colwise shared memory"));
  kernel<<<static_cast<unsigned>(blocks), cw::kThreads, dyn, st>>>(
      src, static_cast<int32_t>(c.rows), static_cast<int32_t>(c.cols), c.offsets, pends,
      static_cast<int32_t>(c.experts), c.scale, c.scale_stride, static_cast<uint8_t*>(c.q_t), c.q_stride,
      static_cast<int32_t>(c.out_rows), static_cast<int32_t>(col_tiles), subs);
  return cuda::cuda_check(cudaGetLastError(), "fp8 colwise quantize kernel launch");
}

// The scales straight from the given amax (no pass 1).
Status col_scales_from_amax(const Fp8Cols& c, cudaStream_t st) {
  if (c.experts * c.cols == 0) return Status::kOk;
  cuda::col_scale_kernel<true><<<col_scale_blocks(c), 256, 0, st>>>(c.scale, c.scale_stride, c.experts, c.cols, c.amax,
                                                                    c.amax_stride);
  return cuda::cuda_check(cudaGetLastError(), "fp8 colwise scale kernel launch");
}

Status col_tiles_of(const Fp8Cols& c, int64_t& col_tiles, int64_t& tiles) {
  namespace cw = cuda::colwise;
  col_tiles = (c.cols + cw::kCols - 1) / cw::kCols;
  tiles = c.out_rows == 0 || c.cols == 0 ? 0 : col_tiles * ((c.out_rows + cw::kRows - 1) / cw::kRows);
  if (tiles > 0x7fffffff) return fail(Status::kInvalidArgument, "q_t is too large (", c.cols, " x ", c.out_rows, ")");
  return Status::kOk;
}

}  // namespace

// fp8_common.cuh: the zeroing form of the scale kernel (col_scale_kernel<false>).
Status fp8_zero_matrix(float* x, int64_t stride, int64_t rows, int64_t cols, unsigned blocks, cudaStream_t st,
                       const char* what) {
  cuda::col_scale_kernel<false><<<blocks, 256, 0, st>>>(x, stride, rows, cols);
  return cuda::cuda_check(cudaGetLastError(), what);
}

// fp8_common.cuh: quantize_rowwise's col_amax by colwise pass 1 (col_amax_kernel) into it
// (non-negative floats order as their bits).
Status fp8_col_amax_separate(const Fp8Rows& p, cudaStream_t st) {
  if (p.rows == 0 || p.cols == 0) return Status::kOk;
  const int64_t sm = cuda::sm_count(p.device_id);
  const int64_t es = detail::dtype_size(p.dtype);
  const bool vec = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && (p.rows <= 1 || (p.x_stride * es) % 16 == 0);
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    return detail::dispatch_bool(vec, [&](auto vt) -> Status {
      constexpr bool kVec = decltype(vt)::value;
      const int64_t col_tiles = (p.cols + cuda::kAmaxCols - 1) / cuda::kAmaxCols;
      const int64_t want = std::max<int64_t>(1, sm * 64 / col_tiles);
      int64_t chunk = (p.rows + want - 1) / want;
      chunk = (chunk + 31) / 32 * 32;
      const int64_t blocks = col_tiles * ((p.rows + chunk - 1) / chunk);
      if (blocks > 0x7fffffff) return fail(Status::kInvalidArgument, "x is too large (", p.rows, " x ", p.cols, ")");
      cuda::col_amax_kernel<T, kVec><<<static_cast<unsigned>(blocks), cuda::kAmaxThreads, 0, st>>>(
          static_cast<const T*>(p.x), p.x_stride, p.rows, p.cols, p.col_amax_offsets, p.col_amax_experts, chunk,
          col_tiles, reinterpret_cast<unsigned*>(p.col_amax), p.col_amax_stride);
      return cuda::cuda_check(cudaGetLastError(), "fp8 col_amax kernel launch");
    });
  });
}

Status cuda_fp8_quantize_colwise_grouped(const Fp8Cols& p, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{"x", p.x}, {"offsets", p.offsets}, {"padded_offsets", p.padded}, {"q_t", p.q_t},
                         {"scale", p.scale}, {"amax", p.amax}}));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t es = detail::dtype_size(p.dtype);
  // 16-byte packs of x when its pointer and row stride allow (any column count: a row's last
  // partial pack is read element by element).
  const bool vec = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && (p.rows <= 1 || (p.x_stride * es) % 16 == 0);
  const int q_align = q_t_align(p);
  const int32_t* pends = p.padded ? p.padded : p.offsets;
  const int64_t sm = cuda::sm_count(p.device_id);
  const unsigned scale_blocks = col_scale_blocks(p);
  if (p.amax) {
    EA_TRY(col_scales_from_amax(p, st));  // the amax given: no pass 1
  } else {
    // The scales: zeroed, then (after pass 1) turned from amax into 1 / s.
    cuda::col_scale_kernel<false><<<scale_blocks, 256, 0, st>>>(p.scale, p.scale_stride, p.experts, p.cols);
    EA_TRY(cuda::cuda_check(cudaGetLastError(), "fp8 colwise scale kernel launch"));
  }
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    return detail::dispatch_bool(vec, [&](auto vt) -> Status {
      constexpr bool kVec = decltype(vt)::value;
      if (!p.amax) {
        if (p.rows > 0) {
          // Chunks of rows (a multiple of the 32 rows a block has in flight) for about 64
          // blocks per SM in all: enough waves to even out the tail; fewer chunks, fewer atomics.
          const int64_t col_tiles = (p.cols + cuda::kAmaxCols - 1) / cuda::kAmaxCols;
          const int64_t want = std::max<int64_t>(1, sm * 64 / col_tiles);
          int64_t chunk = (p.rows + want - 1) / want;
          chunk = (chunk + 31) / 32 * 32;
          const int64_t blocks = col_tiles * ((p.rows + chunk - 1) / chunk);
          if (blocks > 0x7fffffff)
            return fail(Status::kInvalidArgument, "x is too large (", p.rows, " x ", p.cols, ")");
          cuda::col_amax_kernel<T, kVec><<<static_cast<unsigned>(blocks), cuda::kAmaxThreads, 0, st>>>(
              static_cast<const T*>(p.x), p.x_stride, p.rows, p.cols, p.offsets, p.experts, chunk, col_tiles,
              reinterpret_cast<unsigned*>(p.scale), p.scale_stride);
          EA_TRY(cuda::cuda_check(cudaGetLastError(), "fp8 colwise amax kernel launch"));
        }
        cuda::col_scale_kernel<true><<<scale_blocks, 256, 0, st>>>(p.scale, p.scale_stride, p.experts, p.cols);
        EA_TRY(cuda::cuda_check(cudaGetLastError(), "fp8 colwise scale kernel launch"));
      }
      int64_t col_tiles = 0, tiles = 0;
      EA_TRY(col_tiles_of(p, col_tiles, tiles));
      if (tiles == 0) return Status::kOk;
      if constexpr (sizeof(T) == 2) {
        int32_t subs = 0;
        int64_t blocks = 0;
        if (cuda::colwise::runs_apply(es, kVec, q_align, p.rows, p.cols, p.out_rows, p.experts, sm, subs, blocks)) {
          namespace cw = cuda::colwise;
          return launch_runs(cw::PlainRows<T>{static_cast<const T*>(p.x), p.x_stride}, p, pends, col_tiles, subs,
                             blocks, st);
        }
      }
      return detail::dispatch_bool(q_align == 16, [&](auto at) -> Status {
        cuda::colwise::quant_kernel<T, kVec, decltype(at)::value>
            <<<static_cast<unsigned>(tiles), cuda::colwise::kThreads, 0, st>>>(
                static_cast<const T*>(p.x), p.x_stride, p.rows, p.cols, p.offsets, pends, p.experts, p.scale,
                p.scale_stride, static_cast<uint8_t*>(p.q_t), p.q_stride, p.out_rows, col_tiles, q_align);
        return cuda::cuda_check(cudaGetLastError(), "fp8 colwise quantize kernel launch");
      });
    });
  });
}

Status cuda_fp8_glu_colwise_grouped(const GluProblem& p, const GluBias* bias, const Fp8Cols& c, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{p.packed ? "gate_up" : "gate", p.g}, {"up", p.packed ? nullptr : p.u}, {"weights", p.w},
                         {"bias", bias ? bias->bg : nullptr}, {"offsets", c.offsets},
                         {"padded_offsets", c.padded}, {"q_t", c.q_t}, {"scale", c.scale}, {"amax", c.amax}}));
  if (!c.amax) return fail(Status::kInvalidArgument, "glu_colwise_grouped needs the column amax");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  EA_TRY(col_scales_from_amax(c, st));
  int64_t col_tiles = 0, tiles = 0;
  EA_TRY(col_tiles_of(c, col_tiles, tiles));
  if (tiles == 0) return Status::kOk;
  const int q_align = q_t_align(c);
  const int32_t* pends = c.padded ? c.padded : c.offsets;
  const math::Coeffs cf{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  // The runs form (colwise::run_kernel over GluRows): no bias, 16-bit gate_up in 16-byte packs
  // (halves and up-first: gate and up each; interleaved: with up right after gate).
  const int64_t es = detail::dtype_size(p.dtype);
  auto a16 = [&](const void* ptr, int64_t stride) { return cuda::q_packs(ptr, stride * es, c.rows, 16); };
  const bool glu_vec = !bias && a16(p.g, p.g_stride) &&
                       (p.step == 1 ? a16(p.u, p.u_stride)
                                    : p.step == 2 && static_cast<const char*>(p.u) == static_cast<const char*>(p.g) + es &&
                                          p.u_stride == p.g_stride);
  int32_t subs = 0;
  int64_t blocks = 0;
  const bool runs = cuda::colwise::runs_apply(es, glu_vec, q_align, c.rows, c.cols, c.out_rows, c.experts,
                                              cuda::sm_count(p.device_id), subs, blocks);
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    const T* g = static_cast<const T*>(p.g);
    const T* u = static_cast<const T*>(p.u);
    const T* bg = bias ? static_cast<const T*>(bias->bg) : nullptr;
    const T* bu = bias ? static_cast<const T*>(bias->bu) : nullptr;
    const int64_t b_stride = bias ? bias->b_stride : 0;
    return dispatch_act(p.params.act, [&](auto act) -> Status {
      constexpr Activation A = decltype(act)::value;
      if constexpr (sizeof(T) == 2) {
        if (runs) {
          return dispatch_step(p.step, [&](auto step) -> Status {
            constexpr int kStep = decltype(step)::value;
            return launch_runs(cuda::GluRows<T, A, kStep>{g, u, p.g_stride, p.u_stride, p.w, p.w_stride, cf}, c,
                               pends, col_tiles, subs, blocks, st);
          });
        }
      }
      return detail::dispatch_bool(q_align == 16, [&](auto at) -> Status {
        cuda::glu_col_quant_kernel<T, A, decltype(at)::value>
            <<<static_cast<unsigned>(tiles), cuda::colwise::kThreads, 0, st>>>(
                g, u, p.g_stride, p.u_stride, p.step, p.w, p.w_stride, bg, bu, b_stride, cf, c.rows, c.cols,
                c.offsets, pends, c.experts, c.scale, c.scale_stride, static_cast<uint8_t*>(c.q_t), c.q_stride,
                c.out_rows, col_tiles, q_align);
        return cuda::cuda_check(cudaGetLastError(), "fp8 glu colwise kernel launch");
      });
    });
  });
}

}  // namespace expertact::detail
