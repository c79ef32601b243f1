// The flat kernels: one thread per kFlatUnroll packs of 16 bytes, the packs of all rows
// numbered in one sequence (pack q is row q / packs, column q % packs), no loop,
// as DeepSpeed's Triton kernels (one 16-byte access per operand per thread, one
// short-lived block per 2048 elements). For every 16-byte-pack case without a
// weight gradient (a row sum needs the lanes of a row together: glu_kernels.cuh).
#pragma once

#include <cstdint>

#include "core/fastdiv.h"
#include "core/math.h"
#include "cuda/common.cuh"
#include "cuda/glu_kernels.cuh"

namespace expertact::cuda {

// Pack counts up to this allow the 32-bit division of core/fastdiv.h (its
// proof needs every q < 2^31, q counted up to the grid's end). Larger problems
// that are not one row (> 32 GiB per bf16 tensor) take the row kernels.
constexpr int64_t kFlatDiv32Max = (int64_t{1} << 31) - 4096;

// Packs per flat thread: 1, one 16-byte access per operand, as DeepSpeed's (2 won up
// to 2% for swiglu and lost up to 11% for swiglu_oai at the seed size:
// docs/notes/perf-notes.md, "Flat kernels and the `auto` choice").
constexpr int kFlatUnroll = 1;

// Where flat pack q lives: its row and its column (in packs). kOneRow: one row
// (the launcher merges contiguous rows): no division and no row offsets, any q.
// Otherwise q < 2^31: row and column are 32-bit values, so each row offset is
// one 32 x 64-bit multiply.
struct FlatPos {
  int64_t row;
  int64_t col;
};

template <bool kOneRow, typename T>
__device__ __forceinline__ FlatPos flat_pos(const KernelArgs<T>& a, int64_t q) {
  if constexpr (kOneRow) {
    return {0, q};
  } else {
    const uint32_t q32 = static_cast<uint32_t>(q);
    const uint32_t r = math::div_fast(q32, a.pdiv);
    return {static_cast<int64_t>(r), static_cast<int64_t>(q32 - r * a.pdiv.d)};
  }
}

// The U packs of a thread are q0 + k * blockDim.x, so each load instruction of
// a warp reads 512 contiguous bytes (1 KiB for an interleaved gate_up pack);
// all loads are issued before the first use. Weights (w[row]) are read when
// given: a run-time test (uniform), not one more template dimension.
template <bool kOneRow, typename T, Activation A, int kStep, int U>
__device__ __forceinline__ void fwd_flat(const KernelArgs<T>& a, const math::Coeffs& c) {
  constexpr int V = 16 / static_cast<int>(sizeof(T)) / kStep;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * blockDim.x * U + threadIdx.x;
  GuPack<T, V, kStep> in[U];
  T* out[U];
  float w[U];
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t q = q0 + static_cast<int64_t>(k) * blockDim.x;
    if (q < a.total) {
      const FlatPos at = flat_pos<kOneRow>(a, q);
      load_raw<T, V, kStep>(a.g + at.row * a.g_stride, a.u + at.row * a.u_stride, at.col, in[k]);
      w[k] = a.w != nullptr ? a.w[at.row * a.w_stride] : 1.0f;
      out[k] = a.out + at.row * a.out_stride + at.col * V;
    }
  }
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t q = q0 + static_cast<int64_t>(k) * blockDim.x;
    if (q < a.total) {
      float ov[V];
#pragma unroll
      for (int i = 0; i < V; ++i)
        ov[i] = math::glu_fwd<A>(gate_of(in[k], i), up_of(in[k], i), w[k], c);
      store_v<T, V>(out[k], 0, ov);
    }
  }
}

// In place (dg/du = g/u) is safe: a thread loads all its packs before it
// stores any, and no pack belongs to two threads.
template <bool kOneRow, typename T, Activation A, int kStep, int U>
__device__ __forceinline__ void bwd_flat(const KernelArgs<T>& a, const math::Coeffs& c) {
  constexpr int V = 16 / static_cast<int>(sizeof(T)) / kStep;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * blockDim.x * U + threadIdx.x;
  GuPack<T, V, kStep> in[U];
  Pack<T, V> d[U];
  FlatPos at[U];
  float w[U];
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t q = q0 + static_cast<int64_t>(k) * blockDim.x;
    if (q < a.total) {
      at[k] = flat_pos<kOneRow>(a, q);
      load_raw<T, V, kStep>(a.g + at[k].row * a.g_stride, a.u + at[k].row * a.u_stride, at[k].col,
                            in[k]);
      d[k] = reinterpret_cast<const Pack<T, V>*>(a.dy + at[k].row * a.dy_stride)[at[k].col];
      w[k] = a.w != nullptr ? a.w[at[k].row * a.w_stride] : 1.0f;
    }
  }
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t q = q0 + static_cast<int64_t>(k) * blockDim.x;
    if (q < a.total) {
      float dgv[V], duv[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float dwt;  // no weight gradient here: dead
        math::glu_bwd<A>(gate_of(in[k], i), up_of(in[k], i), pack_f(d[k], i), w[k], c, dgv[i],
                         duv[i], dwt);
      }
      store_gu<T, V, kStep>(a.dg + at[k].row * a.dg_stride, a.du + at[k].row * a.du_stride,
                            at[k].col, dgv, duv);
    }
  }
}

// kNoLimit: limit = +inf at compile time (the launcher guarantees it). One row
// (contiguous rows merged: rows == 1) takes a copy of the body without the
// division and the row offsets (a uniform branch).
template <typename T, Activation A, int kStep, bool kNoLimit>
__global__ void __launch_bounds__(256) glu_fwd_flat(const KernelArgs<T> a) {
  const math::Coeffs nl = unlimited(a.c);
  const math::Coeffs& c = kNoLimit ? nl : a.c;
  if (a.rows == 1) fwd_flat<true, T, A, kStep, kFlatUnroll>(a, c);
  else fwd_flat<false, T, A, kStep, kFlatUnroll>(a, c);
}

template <typename T, Activation A, int kStep, bool kNoLimit>
__global__ void __launch_bounds__(256) glu_bwd_flat(const KernelArgs<T> a) {
  const math::Coeffs nl = unlimited(a.c);
  const math::Coeffs& c = kNoLimit ? nl : a.c;
  if (a.rows == 1) bwd_flat<true, T, A, kStep, kFlatUnroll>(a, c);
  else bwd_flat<false, T, A, kStep, kFlatUnroll>(a, c);
}

}  // namespace expertact::cuda
