// The forward and backward kernels: a group of G lanes (a power of two up to a
// warp) owns one row and walks it in packs of V elements; blockIdx.y splits
// long rows into column ranges when there are too few rows to fill the GPU.
// The per-element math is src/core/math.h, shared with the CPU path.
#pragma once

#include <cstdint>

#include "core/fastdiv.h"
#include "core/math.h"
#include "cuda/common.cuh"

namespace expertact::cuda {

// Row-strided operands after layout normalisation (see detail::GluProblem):
// gate element (r, c) at g + r * g_stride + c * kStep, up likewise. Strides in
// elements, 64-bit.
template <typename T>
struct KernelArgs {
  const T* g;
  const T* u;
  int64_t g_stride, u_stride;
  const float* w;
  int64_t w_stride;
  int64_t rows;
  int64_t packs;       // packs of V elements per row (F / V)
  int64_t cols;        // F (the realigning kernels find their packs per row)
  int64_t splits;      // column splits per row (see row_span)
  math::Coeffs c;
  // forward
  T* out;
  int64_t out_stride;
  // backward
  const T* dy;
  int64_t dy_stride;
  T* dg;
  T* du;
  int64_t dg_stride, du_stride;
  float* dw;
  int64_t dw_stride;
  // flat kernels (glu_flat.cuh): rows * packs, and the division by packs
  int64_t total;
  math::DivMagic pdiv;
};

template <typename T, int V>
__device__ __forceinline__ void store_v(T* x, int64_t p, const float (&xv)[V]) {
  Pack<T, V> a;
#pragma unroll
  for (int i = 0; i < V; ++i) a.v[i] = from_f<T>(xv[i]);
  reinterpret_cast<Pack<T, V>*>(x)[p] = a;
}

template <typename T, int V, int kStep>
__device__ __forceinline__ void store_gu(T* dg, T* du, int64_t p, const float (&gv)[V],
                                         const float (&uv)[V]) {
  if constexpr (kStep == 1) {
    store_v<T, V>(dg, p, gv);
    store_v<T, V>(du, p, uv);
  } else if constexpr (V == 1) {
    dg[2 * p] = from_f<T>(gv[0]);
    dg[2 * p + 1] = from_f<T>(uv[0]);
  } else {
    Pack<T, 2 * V> a;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      a.v[2 * i] = from_f<T>(gv[i]);
      a.v[2 * i + 1] = from_f<T>(uv[i]);
    }
    reinterpret_cast<Pack<T, 2 * V>*>(dg)[p] = a;
  }
}

// One row's operands (row offsets are 64-bit).
template <typename T>
struct FwdRow {
  const T* g;
  const T* u;
  T* out;
  float w;  // 1 without weights
};
template <typename T>
struct BwdRow {
  const T* g;
  const T* u;
  const T* dy;
  T* dg;
  T* du;
  float w;  // 1 without weights
};

template <typename T, bool kW>
__device__ __forceinline__ FwdRow<T> fwd_row(const KernelArgs<T>& a, int64_t row) {
  return {a.g + row * a.g_stride, a.u + row * a.u_stride, a.out + row * a.out_stride,
          kW ? a.w[row * a.w_stride] : 1.0f};
}
template <typename T, bool kW>
__device__ __forceinline__ BwdRow<T> bwd_row(const KernelArgs<T>& a, int64_t row) {
  return {a.g + row * a.g_stride,   a.u + row * a.u_stride,   a.dy + row * a.dy_stride,
          a.dg + row * a.dg_stride, a.du + row * a.du_stride, kW ? a.w[row * a.w_stride] : 1.0f};
}

// Which row and column range this group of G lanes owns.
// G (lanes per row) is a power of two from 1 to the block size; G <= 32 when
// the row sum of the weight gradient is wanted (a shuffle reduction).
// The grid is one-dimensional over (row block, column split), split fastest:
// block b owns rows [b / splits * rows_per_block, ...) and, of each of those
// rows, the tiles of G * U packs numbered b % splits, + splits, + 2 splits, ...
// Round-robin tiles keep the blocks running at one time on neighbouring memory.
struct RowSpan {
  int64_t row;
  int lane;
  int64_t first;  // first pack of this lane's first tile
  int64_t step;   // packs between this split's consecutive tiles
  int64_t end;    // packs in the row
};

template <int U>
__device__ __forceinline__ RowSpan row_span(int G, int64_t packs, int64_t splits) {
  RowSpan s;
  const int rows_per_block = blockDim.x / G;
  // 32-bit division (the grid has < 2^31 blocks): once per thread.
  const uint32_t b = blockIdx.x;
  const uint32_t sp = static_cast<uint32_t>(splits);
  const int64_t split = sp == 1 ? 0 : b % sp;
  const int64_t row_block = sp == 1 ? b : b / sp;
  s.row = row_block * rows_per_block + threadIdx.x / G;
  s.lane = threadIdx.x & (G - 1);
  const int64_t tile = static_cast<int64_t>(G) * U;
  s.first = split * tile + s.lane;
  s.step = splits * tile;
  s.end = packs;
  return s;
}

// Packs in flight per lane, by pack bytes, as tuned at the seed size
// (docs/notes/perf-notes.md, "Row kernels"): forward 2 packs of 16 bytes (4 was
// 5-8% slower), backward 4 (2 was 3-4% slower); narrower packs keep the bytes in
// flight.
// pack_bytes: the widest access of one pack (an interleaved gate_up pack is
// twice the output pack).
constexpr int fwd_unroll_for(int pack_bytes) {
  return pack_bytes >= 16 ? 2 : pack_bytes >= 8 ? 4 : pack_bytes >= 4 ? 8 : 16;
}
constexpr int bwd_unroll_for(int pack_bytes) {
  return pack_bytes >= 32 ? 2 : pack_bytes >= 16 ? 4 : pack_bytes >= 8 ? 8 : 16;
}

// The raw packs of gate and up (one pack of 2V for interleaved rows).
template <typename T, int V, int kStep>
struct GuPack;
template <typename T, int V>
struct GuPack<T, V, 1> {
  Pack<T, V> g, u;
};
template <typename T, int V>
struct GuPack<T, V, 2> {
  Pack<T, 2 * V> gu;
};


template <typename T, int V, int kStep>
__device__ __forceinline__ void load_raw(const T* g, const T* u, int64_t p, GuPack<T, V, kStep>& r) {
  if constexpr (kStep == 1) {
    r.g = reinterpret_cast<const Pack<T, V>*>(g)[p];
    r.u = reinterpret_cast<const Pack<T, V>*>(u)[p];
  } else if constexpr (V == 1) {
    // One pair as two elements: the host proves only element alignment for a
    // 1-element pack, and the pair of an odd row stride or offset is not
    // aligned to twice the element.
    r.gu.v[0] = g[2 * p];
    r.gu.v[1] = g[2 * p + 1];
  } else {
    r.gu = reinterpret_cast<const Pack<T, 2 * V>*>(g)[p];
  }
}

template <typename T, int V, int kStep>
__device__ __forceinline__ float gate_of(const GuPack<T, V, kStep>& r, int i) {
  if constexpr (kStep == 1) return pack_f(r.g, i); else return pack_f(r.gu, 2 * i);
}
template <typename T, int V, int kStep>
__device__ __forceinline__ float up_of(const GuPack<T, V, kStep>& r, int i) {
  if constexpr (kStep == 1) return pack_f(r.u, i); else return pack_f(r.gu, 2 * i + 1);
}

// The per-call constants with limit = +inf and has_limit = false as
// compile-time constants, for the flat kernels' calls without a limit (swiglu,
// geglu_tanh; glu_flat.cuh): the clamps (x > inf is false for every x, NaN
// included) and the gradient masks then fold away, with the same results as the
// run-time test. Kernels take `kNoLimit ? unlimited(a.c) : a.c` by reference (a
// copy of a.c costs instructions in some kernels: its fields leave the constant
// bank). The row kernels take a.c as it is: the same specialisation measured no
// faster there (docs/notes/perf-notes.md, "Flat kernels and the `auto` choice").
__device__ __forceinline__ math::Coeffs unlimited(const math::Coeffs& c) {
  return math::Coeffs{c.alpha, __int_as_float(0x7f800000), c.beta, false};
}

// The U packs of one tile (p0 + k * G) of a lane.
template <typename T, int V, int kStep, int U>
__device__ __forceinline__ void load_tile(const T* g, const T* u, int64_t p0, int G, int64_t end,
                                          GuPack<T, V, kStep> (&in)[U]) {
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t p = p0 + static_cast<int64_t>(k) * G;
    if (p < end) load_raw<T, V, kStep>(g, u, p, in[k]);
  }
}
template <typename T, Activation A, int kStep, int V, int U>
__device__ __forceinline__ void fwd_tile(const GuPack<T, V, kStep> (&in)[U], T* out, int64_t p0,
                                         int G, int64_t end, float w, const math::Coeffs& c) {
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t p = p0 + static_cast<int64_t>(k) * G;
    if (p < end) {
      float ov[V];
#pragma unroll
      for (int i = 0; i < V; ++i) ov[i] = math::glu_fwd<A>(gate_of(in[k], i), up_of(in[k], i), w, c);
      store_v<T, V>(out, p, ov);
    }
  }
}

template <typename T, Activation A, int kStep, bool kDW, int V, int U>
__device__ __forceinline__ void bwd_tile(const GuPack<T, V, kStep> (&in)[U],
                                         const Pack<T, V> (&d)[U], T* dg, T* du, int64_t p0,
                                         int G, int64_t end, float w, const math::Coeffs& c,
                                         float& acc) {
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t p = p0 + static_cast<int64_t>(k) * G;
    if (p < end) {
      float dgv[V], duv[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float dwt;
        math::glu_bwd<A>(gate_of(in[k], i), up_of(in[k], i), pack_f(d[k], i), w, c, dgv[i],
                         duv[i], dwt);
        if constexpr (kDW) acc += dwt;
      }
      store_gu<T, V, kStep>(dg, du, p, dgv, duv);
    }
  }
}

// U packs per lane per step (fwd_unroll_for / bwd_unroll_for): their loads are
// all issued before the first use, so each lane keeps U * (2 or 3) accesses in
// flight.
template <typename T, Activation A, int kStep, bool kW, int V>
__global__ void __launch_bounds__(256) glu_fwd_kernel(const KernelArgs<T> a, int G) {
  constexpr int U = fwd_unroll_for(sizeof(T) * V * kStep);
  const RowSpan s = row_span<U>(G, a.packs, a.splits);
  if (s.row >= a.rows) return;
  const auto [g, u, out, w] = fwd_row<T, kW>(a, s.row);
  for (int64_t p0 = s.first; p0 < s.end; p0 += s.step) {
    GuPack<T, V, kStep> in[U];
    load_tile<T, V, kStep, U>(g, u, p0, G, s.end, in);
    fwd_tile<T, A, kStep, V, U>(in, out, p0, G, s.end, w, a.c);
  }
}

// dg/du may be g/u themselves (in-place): every lane loads its packs before it
// stores them and no pack is touched by two lanes, so plain loads (not the
// read-only path) are used and nothing is marked __restrict__.
template <typename T, Activation A, int kStep, bool kW, bool kDW, int V>
__global__ void __launch_bounds__(256) glu_bwd_kernel(const KernelArgs<T> a, int G) {
  constexpr int U = bwd_unroll_for(sizeof(T) * V * kStep);
  const RowSpan s = row_span<U>(G, a.packs, a.splits);
  // Rows past the end still take part in the group reduction below (groups of
  // G < 32 lanes share a warp), so they only skip the loads and stores.
  const bool live = s.row < a.rows;
  if (!kDW && !live) return;
  const int64_t row = live ? s.row : 0;
  const auto [g, u, dy, dg, du, w] = bwd_row<T, kW>(a, row);
  float acc = 0.0f;
  const int64_t end = live ? s.end : 0;
  for (int64_t p0 = s.first; p0 < end; p0 += s.step) {
    GuPack<T, V, kStep> in[U];
    Pack<T, V> d[U];
    // Written out rather than a helper like load_tile: through one, nvcc 13.0 laid
    // out the interleaved one-element kernel differently (+72 instructions).
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t p = p0 + static_cast<int64_t>(k) * G;
      if (p < end) {
        load_raw<T, V, kStep>(g, u, p, in[k]);
        d[k] = reinterpret_cast<const Pack<T, V>*>(dy)[p];
      }
    }
    bwd_tile<T, A, kStep, kDW, V, U>(in, d, dg, du, p0, G, end, w, a.c, acc);
  }
  if constexpr (kDW) {
    // Sum over the G lanes of the group (xor shuffles stay inside aligned groups).
    for (int off = G / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (live && s.lane == 0) a.dw[row * a.dw_stride] = acc;
  }
}

}  // namespace expertact::cuda
