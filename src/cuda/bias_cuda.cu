// CUDA path of the per-expert biases (src/core/bias.h). The activation's backward and
// expert_bias's backward: one block owns a chunk of rows and a tile of up to kBiasTilePacks
// packs of each row; each thread owns one pack (V elements) of every row of its chunk,
// walking the chunk's runs of one expert's rows four rows at a time. The bias pack of a run
// is read once and kept in registers; the bias gradient of a run is summed in registers
// (float32) and written to the run's partial row (slot chunk + expert), which a second kernel
// adds up per expert in chunk order. Per-row sums (the routing weights' gradient) are reduced
// across the block in a fixed order. No atomics: every sum has a fixed order. The forwards
// (no sums: the activation's and expert_bias's) take the row kernels' shape instead. Measurements and
// the forms tried: docs/notes/perf-notes.md, "Expert biases (GPT-OSS) in the kernels".
#include <algorithm>
#include <cstdlib>
#include <cstdint>

#include "core/bias.h"
#include "core/dispatch.h"
#include "core/error.h"
#include "core/math.h"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/glu_kernels.cuh"
#include "cuda/glu_launch.cuh"

namespace expertact::cuda {
namespace {

constexpr int kRowsPerStep = 4;  // rows whose loads a thread issues before their first use
// Threads of a chunked block: one per pack of the block's column tile (at most kBiasTilePacks).
// The launch bounds ask for 2 (backward with b13) or 3 (the others) blocks per multiprocessor,
// capping the registers at 85 or 56: that took about a quarter off the backward with b13 (against
// 123 registers and one block per multiprocessor) and 13% off expert_bias's backward
// (docs/notes/perf-notes.md, "Expert biases (GPT-OSS) in the kernels").
constexpr int kBiasThreads = static_cast<int>(detail::kBiasTilePacks);
// Blocks per multiprocessor the activation's kernels ask for: 3 forward and 2 backward, except
// with separate 16-byte gate and up packs (halves layouts: twice the registers per row), where
// that cap made the compiler spill 120-400 bytes: 2 and 1 there.
constexpr int min_blocks(size_t pack_bytes, int step, bool forward) {
  return (step == 1 && pack_bytes >= 16) ? (forward ? 2 : 1) : (forward ? 3 : 2);
}

template <typename T>
struct BiasArgs {
  int64_t rows;
  const int32_t* offs;
  int64_t E;
  int64_t R;      // rows per chunk
  int64_t packs;  // packs of V elements per row
  // the activation's operands (glu), or x / out / dy (expert_bias: g = x)
  const T* g;
  const T* u;
  int64_t g_stride, u_stride;
  const float* w;  // nullptr: weight 1
  int64_t w_stride;
  const T* bg;
  const T* bu;
  int64_t b_stride;
  T* out;
  int64_t out_stride;
  const T* dy;
  int64_t dy_stride;
  T* dg;
  T* du;
  int64_t dg_stride, du_stride;
  float* dw;       // per-row sums: nullptr, the gradient itself (one tile), or the tile partials
  int64_t dw_stride;
  float* part;     // partial rows of the bias gradient (nullptr: not wanted)
  int64_t acc_cols;
  int64_t split;   // the first column of the up part in a partial row (F)
  math::Coeffs c;
};

__device__ __forceinline__ int64_t chunk_first_row(int64_t R) { return static_cast<int64_t>(blockIdx.x) * R; }
__device__ __forceinline__ int64_t my_pack() {
  return static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
}

// Per-row sums across the block (the routing weights' gradient): each warp reduces its
// lanes' terms by shuffles and keeps the sum in shared memory, red[warp][row - r0]; after the
// chunk's last row one barrier, then the warps' sums of each row are added in warp order.
// One barrier per chunk rather than one per step.
__device__ __forceinline__ void warp_row_sums(const float (&rs)[kRowsPerStep], float* red, int64_t R,
                                              int64_t q, int64_t r0, int64_t end) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < kRowsPerStep; ++k) {
    float v = rs[k];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0 && q + k < end) red[warp * R + (q + k - r0)] = v;
  }
}
// The same sums with a barrier every step (two buffers: a buffer is written again only
// after every thread has passed the next step's barrier, which its readers reach after
// reading), for expert_bias's backward, whose steps are loads and sums only. At 4 x 261,280 rows
// of 3,072 (bf16) a form that loaded each row's weight after its data took about 0.7x the time of
// this one (weights loaded with the data), and the per-chunk form above took 2-7% less time than
// this one. Not understood yet: docs/notes/perf-notes.md, "Expert biases (GPT-OSS) in the kernels".
__device__ __forceinline__ void step_row_sums(const float (&rs)[kRowsPerStep],
                                              float (&red)[2][32][kRowsPerStep], int& buf,
                                              int64_t q, int64_t end, float* dst, int64_t stride) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < kRowsPerStep; ++k) {
    float v = rs[k];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) red[buf][warp][k] = v;
  }
  __syncthreads();
  if (threadIdx.x < kRowsPerStep && q + threadIdx.x < end) {
    float s = 0.0f;
    const int nw = blockDim.x >> 5;
    for (int i = 0; i < nw; ++i) s += red[buf][i][threadIdx.x];
    dst[(q + threadIdx.x) * stride] = s;
  }
  buf ^= 1;
}

__device__ __forceinline__ void block_row_sums(const float* red, int64_t R, int64_t r0, int64_t r1,
                                               float* dst, int64_t stride) {
  __syncthreads();
  const int nw = blockDim.x >> 5;
  for (int64_t i = threadIdx.x; i < r1 - r0; i += blockDim.x) {
    float s = 0.0f;
    for (int w = 0; w < nw; ++w) s += red[w * R + i];
    dst[(r0 + i) * stride] = s;
  }
}

// The activation's forward with b13, in the row kernels' shape (glu_kernels.cuh): a group of G
// lanes owns a row, blocks follow each other along the rows; a row finds its expert once (a
// binary search of the offsets, cached reads) and its bias packs come from L1/L2 (E rows of
// 2F). At 4 x 261,280 rows of 3,072 (interleaved bf16, weights) it took 11% less time than the
// backward's shape (a block per chunk of rows and tile of packs, a thread's bias pack held for a
// run of one expert's rows), which it replaced.
template <typename T, Activation A, int kStep, int V>
__global__ void __launch_bounds__(256) glu_bias_fwd_rows_kernel(const BiasArgs<T> a, int G, int64_t splits) {
  constexpr int U = fwd_unroll_for(sizeof(T) * V * kStep);
  const RowSpan s = row_span<U>(G, a.packs, splits);
  if (s.row >= a.rows) return;
  const int64_t e = detail::expert_of(a.offs, a.E, s.row);
  const bool has = e < a.E;
  const T* g = a.g + s.row * a.g_stride;
  const T* u = a.u + s.row * a.u_stride;
  T* out = a.out + s.row * a.out_stride;
  const T* bg = a.bg + (has ? e : 0) * a.b_stride;
  const T* bu = a.bu + (has ? e : 0) * a.b_stride;
  const float w = a.w ? a.w[s.row * a.w_stride] : 1.0f;
  for (int64_t p0 = s.first; p0 < s.end; p0 += s.step) {
    GuPack<T, V, kStep> in[U], bp[U];
    load_tile<T, V, kStep, U>(g, u, p0, G, s.end, in);
    if (has) load_tile<T, V, kStep, U>(bg, bu, p0, G, s.end, bp);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t p = p0 + static_cast<int64_t>(k) * G;
      if (p < s.end) {
        float ov[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float gb = has ? gate_of(bp[k], i) : 0.0f, ub = has ? up_of(bp[k], i) : 0.0f;
          ov[i] = math::glu_fwd<A>(gate_of(in[k], i) + gb, up_of(in[k], i) + ub, w, a.c);
        }
        store_v<T, V>(out, p, ov);
      }
    }
  }
}

// dg/du may be g/u (in place): each thread reads its packs of a row before writing them.
template <typename T, Activation A, int kStep, int V>
__global__ void __launch_bounds__(kBiasThreads, min_blocks(sizeof(T) * V * kStep, kStep, false))
    glu_bias_bwd_kernel(const BiasArgs<T> a) {
  extern __shared__ float red[];  // [warps][R] when the row sums are wanted
  const int64_t p = my_pack();
  const bool live = p < a.packs;
  const int64_t r0 = chunk_first_row(a.R), r1 = r0 + a.R < a.rows ? r0 + a.R : a.rows;
  const int64_t chunk = blockIdx.x;
  int64_t e = detail::expert_of(a.offs, a.E, r0);
  for (int64_t r = r0; r < r1; ++e) {
    const int64_t end = detail::run_end(a.offs, a.E, e, r, r1);
    const bool has = e < a.E;
    float bgv[V], buv[V], ag[V], au[V];
#pragma unroll
    for (int i = 0; i < V; ++i) bgv[i] = buv[i] = ag[i] = au[i] = 0.0f;
    if (has && live) {
      GuPack<T, V, kStep> bp;
      load_raw<T, V, kStep>(a.bg + e * a.b_stride, a.bu + e * a.b_stride, p, bp);
#pragma unroll
      for (int i = 0; i < V; ++i) bgv[i] = gate_of(bp, i), buv[i] = up_of(bp, i);
    }
    for (int64_t q = r; q < end; q += kRowsPerStep) {
      GuPack<T, V, kStep> in[kRowsPerStep];
      Pack<T, V> d[kRowsPerStep];
      float rs[kRowsPerStep], wk[kRowsPerStep];
#pragma unroll
      for (int k = 0; k < kRowsPerStep; ++k) {
        rs[k] = 0.0f;
        wk[k] = 1.0f;
        if (live && q + k < end) {
          load_raw<T, V, kStep>(a.g + (q + k) * a.g_stride, a.u + (q + k) * a.u_stride, p, in[k]);
          d[k] = reinterpret_cast<const Pack<T, V>*>(a.dy + (q + k) * a.dy_stride)[p];
          if (a.w) wk[k] = a.w[(q + k) * a.w_stride];
        }
      }
#pragma unroll
      for (int k = 0; k < kRowsPerStep; ++k) {
        if (live && q + k < end) {
          const float w = wk[k];
          float dgv[V], duv[V];
#pragma unroll
          for (int i = 0; i < V; ++i) {
            float dwt;
            math::glu_bwd<A>(gate_of(in[k], i) + bgv[i], up_of(in[k], i) + buv[i], pack_f(d[k], i), w,
                             a.c, dgv[i], duv[i], dwt);
            rs[k] += dwt;
            ag[i] += dgv[i];
            au[i] += duv[i];
          }
          store_gu<T, V, kStep>(a.dg + (q + k) * a.dg_stride, a.du + (q + k) * a.du_stride, p, dgv, duv);
        }
      }
      if (a.dw != nullptr) warp_row_sums(rs, red, a.R, q, r0, end);
    }
    if (a.part != nullptr && has && live) {
      float* row = a.part + (chunk + e) * a.acc_cols + p * V;
#pragma unroll
      for (int i = 0; i < V; ++i) row[i] = ag[i], row[a.split + i] = au[i];
    }
    r = end;
    if (e >= a.E) break;
  }
  if (a.dw != nullptr)  // the same for every thread of the block
    block_row_sums(red, a.R, r0, r1, a.dw + (gridDim.y > 1 ? blockIdx.y * a.rows : 0),
                   gridDim.y > 1 ? 1 : a.dw_stride);
}

// out = x + w * bias[e] (g = x); out may be x. The row kernels' shape, as the forward above.
template <typename T, int V>
__global__ void __launch_bounds__(256) row_bias_fwd_kernel(const BiasArgs<T> a, int G, int64_t splits) {
  constexpr int U = fwd_unroll_for(sizeof(T) * V * 2);
  const RowSpan s = row_span<U>(G, a.packs, splits);
  if (s.row >= a.rows) return;
  const int64_t e = detail::expert_of(a.offs, a.E, s.row);
  const T* x = a.g + s.row * a.g_stride;
  T* out = a.out + s.row * a.out_stride;
  if (e >= a.E) {  // no expert: out = x
    if (out == x) return;
    for (int64_t p0 = s.first; p0 < s.end; p0 += s.step)
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int64_t p = p0 + static_cast<int64_t>(k) * G;
        if (p < s.end) reinterpret_cast<Pack<T, V>*>(out)[p] = reinterpret_cast<const Pack<T, V>*>(x)[p];
      }
    return;
  }
  const T* b = a.bg + e * a.b_stride;
  const float w = a.w ? a.w[s.row * a.w_stride] : 1.0f;
  for (int64_t p0 = s.first; p0 < s.end; p0 += s.step) {
    Pack<T, V> in[U], bp[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t p = p0 + static_cast<int64_t>(k) * G;
      if (p < s.end) {
        in[k] = reinterpret_cast<const Pack<T, V>*>(x)[p];
        bp[k] = reinterpret_cast<const Pack<T, V>*>(b)[p];
      }
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t p = p0 + static_cast<int64_t>(k) * G;
      if (p < s.end) {
        float ov[V];
#pragma unroll
        for (int i = 0; i < V; ++i) ov[i] = pack_f(in[k], i) + w * pack_f(bp[k], i);
        store_v<T, V>(out, p, ov);
      }
    }
  }
}

// grad_bias partials: w * dy summed per run; per-row sums dy . bias[e] (routing weights).
template <typename T, int V>
__global__ void __launch_bounds__(kBiasThreads, 3) row_bias_bwd_kernel(const BiasArgs<T> a) {
  __shared__ float red[2][32][kRowsPerStep];
  int buf = 0;
  const int64_t p = my_pack();
  const bool live = p < a.packs;
  const int64_t r0 = chunk_first_row(a.R), r1 = r0 + a.R < a.rows ? r0 + a.R : a.rows;
  const int64_t chunk = blockIdx.x;
  int64_t e = detail::expert_of(a.offs, a.E, r0);
  for (int64_t r = r0; r < r1; ++e) {
    const int64_t end = detail::run_end(a.offs, a.E, e, r, r1);
    const bool has = e < a.E;
    float bv[V], acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) bv[i] = acc[i] = 0.0f;
    if (has && live) {
      const Pack<T, V> bp = reinterpret_cast<const Pack<T, V>*>(a.bg + e * a.b_stride)[p];
#pragma unroll
      for (int i = 0; i < V; ++i) bv[i] = pack_f(bp, i);
    }
    for (int64_t q = r; q < end; q += kRowsPerStep) {
      Pack<T, V> d[kRowsPerStep];
      float rs[kRowsPerStep], wk[kRowsPerStep];
#pragma unroll
      for (int k = 0; k < kRowsPerStep; ++k) {
        rs[k] = 0.0f;
        wk[k] = 1.0f;
        if (live && has && q + k < end) {
          d[k] = reinterpret_cast<const Pack<T, V>*>(a.dy + (q + k) * a.dy_stride)[p];
          if (a.w) wk[k] = a.w[(q + k) * a.w_stride];
        }
      }
#pragma unroll
      for (int k = 0; k < kRowsPerStep; ++k) {
        if (live && has && q + k < end) {
          const float w = wk[k];
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float dv = pack_f(d[k], i);
            rs[k] += dv * bv[i];
            acc[i] += w * dv;
          }
        }
      }
      if (a.dw != nullptr)  // the same for every thread of the block
        step_row_sums(rs, red, buf, q, end, a.dw + (gridDim.y > 1 ? blockIdx.y * a.rows : 0),
                      gridDim.y > 1 ? 1 : a.dw_stride);
    }
    if (a.part != nullptr && has && live) {
      float* row = a.part + (chunk + e) * a.acc_cols + p * V;
#pragma unroll
      for (int i = 0; i < V; ++i) row[i] = acc[i];
    }
    r = end;
    if (e >= a.E) break;
  }
}

// grad[e][c] = the sum of expert e's partial rows, in chunk order; column c < split goes
// to g + c * step, the others to u + (c - split) * step.
template <typename T>
__global__ void bias_grad_reduce_kernel(const float* part, const int32_t* offs, int64_t E,
                                        int64_t rows, int64_t R, int64_t cols, int64_t split,
                                        int step, T* g, T* u, int64_t stride) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  for (int64_t e = blockIdx.y; e < E; e += gridDim.y) {
    int64_t c0, c1;
    detail::expert_chunks(offs, e, rows, R, c0, c1);
    float s = 0.0f;
    for (int64_t k = c0; k < c1; ++k) s += part[(k + e) * cols + c];
    T* dst = c < split ? g + e * stride + c * step : u + e * stride + (c - split) * step;
    *dst = from_f<T>(s);
  }
}

// dw[r] = the sum of the tiles' partial row sums, in tile order.
__global__ void row_sums_reduce_kernel(const float* part, int64_t tiles, int64_t rows, float* dw,
                                       int64_t stride) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float s = 0.0f;
  for (int64_t t = 0; t < tiles; ++t) s += part[t * rows + r];
  dw[r * stride] = s;
}

__global__ void zero_rows_kernel(float* x, int64_t n, int64_t stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i * stride] = 0.0f;
}

template <typename Fn>
Status dispatch_v(int V, Fn&& fn) {
  switch (V) {
    case 1: return fn(detail::IntTag<1>{});
    case 2: return fn(detail::IntTag<2>{});
    case 4: return fn(detail::IntTag<4>{});
    case 8: return fn(detail::IntTag<8>{});
  }
  return detail::fail(Status::kInternal, "bias: pack width ", V);
}

struct Grid {
  dim3 grid, block;
  int64_t tiles;
};

Grid grid_for(int64_t rows, int64_t R, int64_t packs) {
  Grid g;
  g.tiles = std::max<int64_t>(1, detail::bias_tiles(packs));
  const int64_t per = (packs + g.tiles - 1) / g.tiles;
  const int64_t threads = std::max<int64_t>(32, (per + 31) / 32 * 32);
  g.block = dim3(static_cast<unsigned>(threads));
  g.grid = dim3(static_cast<unsigned>((rows + R - 1) / R), static_cast<unsigned>(g.tiles));
  return g;
}

// Shared memory of a backward block: one float per warp and row of its chunk when the
// per-row sums are wanted (at most 16 warps x 512 rows: 32 KiB).
template <typename T>
size_t row_sums_smem(const BiasArgs<T>& a, const Grid& g) {
  return a.dw == nullptr ? 0 : static_cast<size_t>(g.block.x / 32) * a.R * sizeof(float);
}

// The reduce kernels behind a backward: the bias gradient (when wanted) and the tiles'
// row sums (when a row spans several tiles).
template <typename T>
Status finish_backward(const BiasArgs<T>& a, const Grid& g, float* dw, int64_t dw_stride,
                       int64_t cols, int64_t split, int step, T* dbg, T* dbu, int64_t db_stride,
                       cudaStream_t st) {
  if (a.part != nullptr && cols > 0) {
    const dim3 grid(static_cast<unsigned>((cols + 255) / 256),
                    static_cast<unsigned>(std::min<int64_t>(a.E, 65535)));
    bias_grad_reduce_kernel<T><<<grid, 256, 0, st>>>(a.part, a.offs, a.E, a.rows, a.R, cols, split,
                                                     step, dbg, dbu, db_stride);
    EA_TRY(cuda_check(cudaGetLastError(), "bias gradient reduce kernel launch"));
  }
  if (dw != nullptr && g.tiles > 1 && a.rows > 0) {
    row_sums_reduce_kernel<<<static_cast<unsigned>((a.rows + 255) / 256), 256, 0, st>>>(
        a.dw, g.tiles, a.rows, dw, dw_stride);
    EA_TRY(cuda_check(cudaGetLastError(), "row sums reduce kernel launch"));
  }
  return Status::kOk;
}

// The workspace's parts: the partial rows, then the tiles' row sums.
template <typename T>
void carve(BiasArgs<T>& a, void* ws, bool want_db, bool want_dw, float* dw, int64_t dw_stride,
           const Grid& g) {
  a.part = want_db ? static_cast<float*>(ws) : nullptr;
  a.dw = nullptr;
  a.dw_stride = 1;
  if (!want_dw) return;
  if (g.tiles > 1) {
    a.dw = reinterpret_cast<float*>(static_cast<char*>(ws) +
                                    detail::bias_partials_bytes(a.rows, a.acc_cols, a.E));
  } else {
    a.dw = dw;
    a.dw_stride = dw_stride;
  }
}

template <typename T>
BiasArgs<T> glu_args(const detail::GluProblem& p, const detail::GluBias& b) {
  BiasArgs<T> a{};
  a.rows = p.rows;
  a.offs = b.er.offsets;
  a.E = b.er.experts;
  a.R = b.er.chunk;
  a.g = static_cast<const T*>(p.g);
  a.u = static_cast<const T*>(p.u);
  a.g_stride = p.g_stride;
  a.u_stride = p.u_stride;
  a.w = p.w;
  a.w_stride = p.w_stride;
  a.bg = static_cast<const T*>(b.bg);
  a.bu = static_cast<const T*>(b.bu);
  a.b_stride = b.b_stride;
  a.acc_cols = 2 * p.F;
  a.split = p.F;
  a.c = math::Coeffs{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  return a;
}

// The activation's kernels at compile time: the pack width every operand allows (the
// inputs, the bias and `more`), the element step and the activation; go(V, step, act tags).
template <typename T, typename Go>
Status dispatch_glu(const detail::GluProblem& p, const detail::GluBias& b, const Operand* more, int n_more,
                    Go&& go) {
  // gu_operands: an interleaved pair's alignment is gate's (checking up's pointer too gave
  // one-element packs: docs/notes/perf-notes.md, "Expert biases (GPT-OSS) in the kernels").
  Operand ops[8];
  int n = gu_operands(ops, p.g, p.g_stride, p.u, p.u_stride, p.step);
  n += gu_operands(ops + n, b.bg, b.b_stride, b.bu, b.b_stride, p.step, b.er.experts);
  for (int i = 0; i < n_more; ++i) ops[n++] = more[i];
  const int V = pick_pack(ops, n, p.F, p.rows, sizeof(T), p.step);
  return dispatch_v(V, [&](auto v) {
    constexpr int kV = decltype(v)::value;
    return detail::dispatch_step(p.step, [&](auto s) {
      constexpr int kStep = decltype(s)::value;
      if constexpr (kV * kStep * sizeof(T) > 16) {
        return detail::fail(Status::kInternal, "bias: pack of ", kV, " x ", kStep);
      } else {
        return detail::dispatch_act(p.params.act, [&](auto act) { return go(v, s, act); });
      }
    });
  });
}

template <typename T>
Status glu_forward_t(const detail::GluProblem& p, const detail::GluBias& b,
                     const detail::FwdOutput& o, cudaStream_t st) {
  BiasArgs<T> a = glu_args<T>(p, b);
  a.out = static_cast<T*>(o.out);
  a.out_stride = o.out_stride;
  const Operand out{o.out, o.out_stride, 1};
  return dispatch_glu<T>(p, b, &out, 1, [&](auto v, auto s, auto act) {
    constexpr int kV = decltype(v)::value;
    a.packs = p.F / kV;
    constexpr int kS = decltype(s)::value;
    const LaunchShape sh = shape_for(p.rows, a.packs, fwd_unroll_for(sizeof(T) * kV * kS), false, p.device_id,
                                     kThreads);
    if (p.rows > 0)
      glu_bias_fwd_rows_kernel<T, decltype(act)::value, kS, kV>
          <<<static_cast<unsigned>(sh.blocks), sh.threads, 0, st>>>(a, sh.G, sh.splits);
    return cuda_check(cudaGetLastError(), "glu bias forward kernel launch");
  });
}

template <typename T>
Status glu_backward_t(const detail::GluProblem& p, const detail::GluBias& b,
                      const detail::BwdIO& io, cudaStream_t st) {
  BiasArgs<T> a = glu_args<T>(p, b);
  a.dy = static_cast<const T*>(io.dy);
  a.dy_stride = io.dy_stride;
  a.dg = static_cast<T*>(io.dg);
  a.du = static_cast<T*>(io.du);
  a.dg_stride = io.dg_stride;
  a.du_stride = io.du_stride;
  Operand outs[3] = {{io.dy, io.dy_stride, 1}};
  const int n_outs = 1 + gu_operands(outs + 1, io.dg, io.dg_stride, io.du, io.du_stride, p.step);
  return dispatch_glu<T>(p, b, outs, n_outs, [&](auto v, auto s, auto act) {
    constexpr int kV = decltype(v)::value;
    a.packs = p.F / kV;
    const Grid g = grid_for(p.rows, a.R, a.packs);
    carve(a, b.ws, b.dbg != nullptr, io.dw != nullptr, io.dw, io.dw_stride, g);
    if (p.rows > 0) {
      glu_bias_bwd_kernel<T, decltype(act)::value, decltype(s)::value, kV>
          <<<g.grid, g.block, row_sums_smem(a, g), st>>>(a);
      EA_TRY(cuda_check(cudaGetLastError(), "glu bias backward kernel launch"));
    }
    return finish_backward<T>(a, g, io.dw, io.dw_stride, 2 * p.F, p.F, p.step, static_cast<T*>(b.dbg),
                              static_cast<T*>(b.dbu), b.db_stride, st);
  });
}

template <typename T>
BiasArgs<T> row_args(const detail::RowBias& p) {
  BiasArgs<T> a{};
  a.rows = p.rows;
  a.offs = p.er.offsets;
  a.E = p.er.experts;
  a.R = p.er.chunk;
  a.w = p.w;
  a.w_stride = p.w_stride;
  a.bg = static_cast<const T*>(p.b);
  a.b_stride = p.b_stride;
  a.acc_cols = p.cols;
  a.split = p.cols;
  return a;
}

template <typename T>
Status row_forward_t(const detail::RowBias& p, cudaStream_t st) {
  BiasArgs<T> a = row_args<T>(p);
  a.g = static_cast<const T*>(p.x);
  a.g_stride = p.x_stride;
  a.out = static_cast<T*>(p.out);
  a.out_stride = p.out_stride;
  const Operand ops[] = {{p.x, p.x_stride, 1}, {p.out, p.out_stride, 1}, {p.b, p.b_stride, 1, p.er.experts}};
  const int V = pick_pack(ops, 3, p.cols, p.rows, sizeof(T), 1);
  return dispatch_v(V, [&](auto v) {
    constexpr int kV = decltype(v)::value;
    if constexpr (kV * sizeof(T) > 16) {
      return detail::fail(Status::kInternal, "bias: pack of ", kV);
    } else {
      a.packs = p.cols / kV;
      const LaunchShape sh = shape_for(p.rows, a.packs, fwd_unroll_for(sizeof(T) * kV * 2), false, p.device_id,
                                       kThreads);
      row_bias_fwd_kernel<T, kV><<<static_cast<unsigned>(sh.blocks), sh.threads, 0, st>>>(a, sh.G, sh.splits);
      return cuda_check(cudaGetLastError(), "expert bias forward kernel launch");
    }
  });
}

template <typename T>
Status row_backward_t(const detail::RowBias& p, cudaStream_t st) {
  BiasArgs<T> a = row_args<T>(p);
  a.dy = static_cast<const T*>(p.dy);
  a.dy_stride = p.dy_stride;
  if (p.cols == 0) {  // only the weights' gradient, zero per row
    zero_rows_kernel<<<static_cast<unsigned>((p.rows + 255) / 256), 256, 0, st>>>(p.dw, p.rows, p.dw_stride);
    return cuda_check(cudaGetLastError(), "zero kernel launch");
  }
  const Operand ops[] = {{p.dy, p.dy_stride, 1}, {p.b, p.b_stride, 1, p.er.experts}};
  const int V = pick_pack(ops, 2, p.cols, p.rows, sizeof(T), 1);
  return dispatch_v(V, [&](auto v) {
    constexpr int kV = decltype(v)::value;
    if constexpr (kV * sizeof(T) > 16) {
      return detail::fail(Status::kInternal, "bias: pack of ", kV);
    } else {
      a.packs = p.cols / kV;
      const Grid g = grid_for(p.rows, a.R, a.packs);
      carve(a, p.ws, p.db != nullptr, p.dw != nullptr, p.dw, p.dw_stride, g);
      if (p.rows > 0) {
        row_bias_bwd_kernel<T, kV><<<g.grid, g.block, 0, st>>>(a);
        EA_TRY(cuda_check(cudaGetLastError(), "expert bias backward kernel launch"));
      }
      return finish_backward<T>(a, g, p.dw, p.dw_stride, p.cols, p.cols, 1, static_cast<T*>(p.db),
                                nullptr, p.db_stride, st);
    }
  });
}

}  // namespace
}  // namespace expertact::cuda

namespace expertact::detail {

Status cuda_glu_bias_forward(const GluProblem& p, const GluBias& b, const FwdOutput& o, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{p.packed ? "gate_up" : "gate", p.g}, {"up", p.packed ? nullptr : p.u},
                         {"weights", p.w}, {"bias", b.bg}, {"offsets", b.er.offsets}, {"out", o.out}}));
  return cuda::dispatch_storage(p.dtype, [&](auto t) {
    return cuda::glu_forward_t<decltype(t)>(p, b, o, static_cast<cudaStream_t>(stream));
  });
}

Status cuda_glu_bias_backward(const GluProblem& p, const GluBias& b, const BwdIO& io, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{p.packed ? "gate_up" : "gate", p.g}, {"up", p.packed ? nullptr : p.u},
                         {"weights", p.w}, {"bias", b.bg}, {"offsets", b.er.offsets},
                         {"grad_out", io.dy}, {p.packed ? "grad_gate_up" : "grad_gate", io.dg},
                         {"grad_up", p.packed ? nullptr : io.du}, {"grad_weights", io.dw},
                         {"grad_bias", b.dbg}, {"workspace", b.ws}}));
  return cuda::dispatch_storage(p.dtype, [&](auto t) {
    return cuda::glu_backward_t<decltype(t)>(p, b, io, static_cast<cudaStream_t>(stream));
  });
}

Status cuda_row_bias_forward(const RowBias& p, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{"x", p.x}, {"bias", p.b}, {"offsets", p.er.offsets}, {"weights", p.w},
                         {"out", p.out}}));
  return cuda::dispatch_storage(p.dtype, [&](auto t) {
    return cuda::row_forward_t<decltype(t)>(p, static_cast<cudaStream_t>(stream));
  });
}

Status cuda_row_bias_backward(const RowBias& p, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{"grad_out", p.dy}, {"bias", p.b}, {"offsets", p.er.offsets},
                         {"weights", p.w}, {"grad_bias", p.db}, {"grad_weights", p.dw},
                         {"workspace", p.ws}}));
  return cuda::dispatch_storage(p.dtype, [&](auto t) {
    return cuda::row_backward_t<decltype(t)>(p, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace expertact::detail
