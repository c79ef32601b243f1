// The staged kernel for packed halves / up-first rows whose width breaks the
// 16-byte alignment (F * sizeof(T) % 16 != 0, e.g. F = 2881): the pack kernel
// would fall to one-element accesses there (61% of the floor on the H200).
// Rows are contiguous, so a block's R rows are one byte range of each tensor;
// the block copies its ranges into shared memory with 16-byte accesses (the
// partial chunks at the two ends element by element, so nothing outside the
// block's own bytes is read or written), computes from shared memory with any
// element offset, and writes its output range back the same way.
#pragma once

#include <cstdint>

#include "core/math.h"
#include "cuda/common.cuh"

namespace expertact::cuda {

template <typename T>
struct StagedArgs {
  const T* x;   // packed [rows, 2F], rows contiguous
  T* gx;        // backward: packed gradient (may be x), same address mod 16 as x
  const T* dy;  // backward: [rows, F]
  T* out;       // forward: [rows, F]
  const float* w;
  int64_t w_stride;
  float* dw;
  int64_t dw_stride;
  int64_t rows, F;
  int64_t gate_off, up_off;  // 0 and F (halves) or F and 0 (up first)
  int R;                     // rows per block
  uint32_t in_region;        // shared-memory bytes reserved for the packed rows
  math::Coeffs c;
};

// Byte range [lo, hi) of a tensor at `base` <-> shared memory, where global
// address a maps to sm + (a - align16(base + lo)). kToShared picks the direction.
template <typename T, bool kToShared>
__device__ __forceinline__ void stage(uint8_t* sm, const void* base, int64_t lo, int64_t hi) {
  const uintptr_t alo = reinterpret_cast<uintptr_t>(base) + lo;
  const uintptr_t ahi = reinterpret_cast<uintptr_t>(base) + hi;
  const uintptr_t origin = alo & ~uintptr_t(15);
  uintptr_t c0 = (alo + 15) & ~uintptr_t(15);
  uintptr_t c1 = ahi & ~uintptr_t(15);
  if (c0 > c1) c0 = c1 = ahi;  // no whole chunk: all of it goes element-wise below
  const int64_t chunks = static_cast<int64_t>(c1 - c0) / 16;
  uint4* gp = reinterpret_cast<uint4*>(c0);
  uint4* sp = reinterpret_cast<uint4*>(sm + (c0 - origin));
  // Eight chunks per thread in flight: a load followed at once by its store
  // would stall the thread on every load (one access in flight).
  constexpr int kBatch = 8;
  for (int64_t i0 = threadIdx.x; i0 < chunks; i0 += kBatch * blockDim.x) {
    uint4 r[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t i = i0 + static_cast<int64_t>(k) * blockDim.x;
      if (i < chunks) r[k] = kToShared ? gp[i] : sp[i];
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t i = i0 + static_cast<int64_t>(k) * blockDim.x;
      if (i < chunks) {
        if constexpr (kToShared) sp[i] = r[k]; else gp[i] = r[k];
      }
    }
  }
  // Head [alo, c0) and tail [c1, ahi): at most 15 bytes each.
  const int64_t head = static_cast<int64_t>(c0 - alo) / sizeof(T);
  const int64_t tail = static_cast<int64_t>(ahi - c1) / sizeof(T);
  for (int64_t i = threadIdx.x; i < head + tail; i += blockDim.x) {
    const uintptr_t a = i < head ? alo + i * sizeof(T) : c1 + (i - head) * sizeof(T);
    T* gp = reinterpret_cast<T*>(a);
    T* sp = reinterpret_cast<T*>(sm + (a - origin));
    if constexpr (kToShared) *sp = *gp; else *gp = *sp;
  }
}

// Where element e of a range starting at byte lo of `base` sits in shared memory.
template <typename T>
__device__ __forceinline__ T* staged_ptr(uint8_t* sm, const void* base, int64_t lo) {
  const uintptr_t alo = reinterpret_cast<uintptr_t>(base) + lo;
  return reinterpret_cast<T*>(sm + (alo & uintptr_t(15)));
}

// Sum of v over the block; every thread gets the result. red: 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  __syncthreads();  // red may still be read by the previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < nw; ++i) s += red[i];  // same order in every thread
  return s;
}

template <typename T, Activation A, bool kW>
__global__ void __launch_bounds__(256) glu_fwd_staged(const StagedArgs<T> a) {
  extern __shared__ __align__(16) uint8_t sm[];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * a.R;
  const int64_t nr = a.rows - r0 < a.R ? a.rows - r0 : a.R;
  const int64_t es = sizeof(T);
  uint8_t* sin = sm;
  uint8_t* sout = sm + a.in_region;
  const int64_t in_lo = r0 * 2 * a.F * es, in_hi = (r0 + nr) * 2 * a.F * es;
  const int64_t out_lo = r0 * a.F * es, out_hi = (r0 + nr) * a.F * es;
  stage<T, true>(sin, a.x, in_lo, in_hi);
  __syncthreads();
  const T* xs = staged_ptr<T>(sin, a.x, in_lo);
  T* os = staged_ptr<T>(sout, a.out, out_lo);
  for (int64_t lr = 0; lr < nr; ++lr) {
    const float w = kW ? a.w[(r0 + lr) * a.w_stride] : 1.0f;
    const T* xr = xs + lr * 2 * a.F;
    T* orow = os + lr * a.F;
    for (int64_t c = threadIdx.x; c < a.F; c += blockDim.x)
      orow[c] = from_f<T>(math::glu_fwd<A>(to_f(xr[a.gate_off + c]), to_f(xr[a.up_off + c]), w, a.c));
  }
  __syncthreads();
  stage<T, false>(sout, a.out, out_lo, out_hi);
}

// The gradients overwrite the staged inputs in shared memory (each element by
// the thread that read it), then go out to gx, whose address is x's mod 16.
template <typename T, Activation A, bool kW, bool kDW>
__global__ void __launch_bounds__(256) glu_bwd_staged(const StagedArgs<T> a) {
  extern __shared__ __align__(16) uint8_t sm[];
  __shared__ float red[32];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * a.R;
  const int64_t nr = a.rows - r0 < a.R ? a.rows - r0 : a.R;
  const int64_t es = sizeof(T);
  uint8_t* sin = sm;
  uint8_t* sdy = sm + a.in_region;
  const int64_t in_lo = r0 * 2 * a.F * es, in_hi = (r0 + nr) * 2 * a.F * es;
  const int64_t dy_lo = r0 * a.F * es, dy_hi = (r0 + nr) * a.F * es;
  stage<T, true>(sin, a.x, in_lo, in_hi);
  stage<T, true>(sdy, a.dy, dy_lo, dy_hi);
  __syncthreads();
  T* xs = staged_ptr<T>(sin, a.x, in_lo);
  const T* ds = staged_ptr<T>(sdy, a.dy, dy_lo);
  for (int64_t lr = 0; lr < nr; ++lr) {
    const float w = kW ? a.w[(r0 + lr) * a.w_stride] : 1.0f;
    T* xr = xs + lr * 2 * a.F;
    const T* dr = ds + lr * a.F;
    float acc = 0.0f;
    for (int64_t c = threadIdx.x; c < a.F; c += blockDim.x) {
      float dg, du, dwt;
      math::glu_bwd<A>(to_f(xr[a.gate_off + c]), to_f(xr[a.up_off + c]), to_f(dr[c]), w, a.c, dg,
                       du, dwt);
      xr[a.gate_off + c] = from_f<T>(dg);
      xr[a.up_off + c] = from_f<T>(du);
      if constexpr (kDW) acc += dwt;
    }
    if constexpr (kDW) {
      const float s = block_sum(acc, red);
      if (threadIdx.x == 0) a.dw[(r0 + lr) * a.dw_stride] = s;
    }
  }
  __syncthreads();
  stage<T, false>(sin, a.gx, in_lo, in_hi);
}

}  // namespace expertact::cuda
