// What the FP8 translation units share (fp8_rowwise.cu, fp8_glu_rowwise.cu/.cuh, fp8_colwise.cu,
// fp8_backward.cu/.cuh, fp8_act_*.cu): warp and row reductions, e4m3fn stores, 16-bit pair helpers,
// launch helpers.
//
// The CUDA path of the FP8 quantisation (src/core/fp8.h). The arithmetic per element is fp8.h's,
// shared with the CPU path, so the two give the same bytes and scales. The conversions go two
// at a time through fp8::from_scaled2 (one instruction on sm_89+); the software conversion
// (about 58 instructions a value) bound these kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/bias.h"
#include "core/dispatch.h"
#include "core/checks.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/math.h"
#include "cpu/fp8_cpu.h"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/glu_launch.cuh"

namespace expertact::cuda {

__device__ __forceinline__ float warp_amax(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// warp_amax of values that are never negative or NaN (running fmaxf(0, |x|) maxima): their bits
// order as unsigned integers do, so on sm_80 and later one redux.sync takes the warp's maximum.
__device__ __forceinline__ float warp_amax_nonneg(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(v)));
#else
  return warp_amax(v);
#endif
}

// One pack of V scaled values written as V e4m3fn bytes (V = 2, 4 or 8): one store of V bytes
// when q's rows allow it (vec), else byte by byte.
template <int V>
__device__ __forceinline__ void store_q(uint8_t* q, int p, const float (&x)[V], bool vec) {
  static_assert(V == 2 || V == 4 || V == 8, "a pack of 2, 4 or 8 values");
  // Four bytes a word by from_scaled4 (one NaN fix-up a word, where from_scaled2 took one
  // test and select a byte); a pack of 2 by from_scaled2. The bytes are the same.
  uint32_t w[(V + 3) / 4];
  if constexpr (V == 2) {
    w[0] = fp8::from_scaled2(x[0], x[1]);
  } else {
#pragma unroll
    for (int i = 0; i < V / 4; ++i) w[i] = fp8::from_scaled4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
  }
  if (vec) {
    if constexpr (V == 8) reinterpret_cast<uint2*>(q)[p] = make_uint2(w[0], w[1]);
    else if constexpr (V == 4) reinterpret_cast<uint32_t*>(q)[p] = w[0];
    else reinterpret_cast<uint16_t*>(q)[p] = static_cast<uint16_t>(w[0]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) q[static_cast<int64_t>(p) * V + i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
  }
}

// Two values of a 16-bit T as one word, x0 in the low half, rounded as from_f (one
// cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32).
template <typename T>
__device__ __forceinline__ uint32_t pack2_of(float x0, float x1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(x0, x1);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The running column amax of two values of a 16-bit T a word: each half the larger magnitude
// of m's and v's (NaN ignored: max returns the other input, as fmaxf does; exact). The result's
// sign bits carry no meaning (max.xorsign.abs, sm_86 and later: one instruction where |v| and
// max take two); half_abs_f reads the magnitudes.
template <typename T>
__device__ __forceinline__ uint32_t absmax2(uint32_t m, uint32_t v) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 860
  if constexpr (std::is_same_v<T, __nv_bfloat16>) asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(v));
  else asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(v));
#else
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  const T2 x = __hmax2(__habs2(*reinterpret_cast<const T2*>(&m)), __habs2(*reinterpret_cast<const T2*>(&v)));
  r = *reinterpret_cast<const uint32_t*>(&x);
#endif
  return r;
}

// The magnitude of half `hi` (0: low, 1: high) of an absmax2 word, as float (exact).
template <typename T>
__device__ __forceinline__ float half_abs_f(uint32_t w, int hi) {
  const uint32_t b = (hi ? w >> 16 : w) & 0x7fffu;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(b << 16);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}

// The amax of a row across its G lanes: a warp's shuffles, then for G > 32 the row's warps
// through shared memory (a block-wide barrier: every thread of the block calls this). A block
// that takes row after row alternates between two `red` arrays (row parity): a warp that runs
// ahead writes the other array while slower warps still read this one, and cannot come back
// to this one before they have passed the next row's barrier.
__device__ __forceinline__ float row_amax(float a, int G, float* red) {
  a = warp_amax(a);
  if (G > 32) {
    const int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) red[warp] = a;
    __syncthreads();
    const int w0 = warp & ~(G / 32 - 1);
    a = red[w0];
    for (int k = 1; k < G / 32; ++k) a = fmaxf(a, red[w0 + k]);
  }
  return a;
}

// The scalar forms (rows that allow no 16-byte pack): a warp per row.
constexpr int kScalarThreads = 256;  // 8 rows per block, a warp each

// Blocks of `threads` for `rows` rows of `lanes` lanes each.
inline unsigned blocks_for(int64_t rows, int threads, int lanes = 32) {
  return static_cast<unsigned>((rows + threads / lanes - 1) / (threads / lanes));
}

// Whether rows at q, q_stride bytes apart, take accesses of V bytes (q's rows: stores of one
// pack of V outputs).
inline bool q_packs(const void* q, int64_t q_stride, int64_t rows, int V) {
  return reinterpret_cast<uintptr_t>(q) % V == 0 && (rows <= 1 || q_stride % V == 0);
}

}  // namespace expertact::cuda

namespace expertact::detail {

// Launchers that more than one of the FP8 translation units take, defined once with their
// kernels in fp8_colwise.cu.
//
// The float matrix [rows, cols] at x (row stride `stride`) zeroed by `blocks` blocks of 256
// threads on st (a column amax before its atomicMax merges); `what` names the launch in an
// error.
Status fp8_zero_matrix(float* x, int64_t stride, int64_t rows, int64_t cols, unsigned blocks, cudaStream_t st,
                       const char* what);
// quantize_rowwise's col_amax by its own read of x, for the forms without a fused one (the
// scalar rows, rows too long to hold, lanes holding over 64 values): colwise pass 1 into the
// zeroed p.col_amax.
Status fp8_col_amax_separate(const Fp8Rows& p, cudaStream_t st);

}  // namespace expertact::detail
