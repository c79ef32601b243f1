// CUDA path of the FP8 rowwise quantisation (src/core/fp8.h): a warp per row. Pass 1 reads
// the row (or computes the activation) and reduces its amax (NaN ignored) across the warp;
// pass 2 reads it again (from L1/L2: the warp has just read it) and writes e4m3fn bytes, four
// per lane and store. The arithmetic per element is fp8.h's, shared with the CPU path, so the
// two give the same bytes and scales.
#include <cstdint>

#include "core/dispatch.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/math.h"
#include "cpu/fp8_cpu.h"
#include "cuda/common.cuh"
#include "cuda/device.h"

namespace expertact::cuda {
namespace {

constexpr int kThreads = 256;  // 8 rows per block, a warp each

__device__ __forceinline__ float warp_amax(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Writes q[j] for j in [0, n) of one row from values produced by val(j), four per lane and
// 4-byte store where the row's q is 4-byte aligned, else one by one.
template <typename Val>
__device__ __forceinline__ void store_row(uint8_t* q, int64_t n, float s, int lane, Val&& val) {
  const bool vec = (reinterpret_cast<uintptr_t>(q) & 3) == 0;
  if (vec) {
    const int64_t n4 = n / 4;
    for (int64_t i = lane; i < n4; i += 32) {
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) word |= static_cast<uint32_t>(fp8::quantize(val(4 * i + k), s)) << (8 * k);
      reinterpret_cast<uint32_t*>(q)[i] = word;
    }
    for (int64_t j = 4 * n4 + lane; j < n; j += 32) q[j] = fp8::quantize(val(j), s);
  } else {
    for (int64_t j = lane; j < n; j += 32) q[j] = fp8::quantize(val(j), s);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const T* x, int64_t x_stride, int64_t rows,
                                                                int64_t cols, uint8_t* q, int64_t q_stride,
                                                                float* scale, int64_t scale_stride) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* xr = x + row * x_stride;
  float amax = 0.0f;
  for (int64_t j = lane; j < cols; j += 32) amax = fmaxf(amax, fabsf(to_f(xr[j])));
  amax = warp_amax(amax);
  const float s = fp8::scale_of(amax);
  store_row(q + row * q_stride, cols, s, lane, [&](int64_t j) { return to_f(xr[j]); });
  if (lane == 0) scale[row * scale_stride] = 1.0f / s;
}

template <typename T, Activation A>
__global__ void __launch_bounds__(kThreads) glu_rows_kernel(const T* g, const T* u, int64_t g_stride,
                                                           int64_t u_stride, int step, const float* w,
                                                           int64_t w_stride, int64_t rows, int64_t F,
                                                           math::Coeffs c, uint8_t* q, int64_t q_stride,
                                                           float* scale, int64_t scale_stride) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* gr = g + row * g_stride;
  const T* ur = u + row * u_stride;
  const float wr = w ? w[row * w_stride] : 1.0f;
  auto h = [&](int64_t j) { return math::glu_fwd<A>(to_f(gr[j * step]), to_f(ur[j * step]), wr, c); };
  float amax = 0.0f;
  for (int64_t j = lane; j < F; j += 32) amax = fmaxf(amax, fabsf(h(j)));
  amax = warp_amax(amax);
  const float s = fp8::scale_of(amax);
  store_row(q + row * q_stride, F, s, lane, h);
  if (lane == 0) scale[row * scale_stride] = 1.0f / s;
}

unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kThreads / 32 - 1) / (kThreads / 32)); }

template <typename Fn>
Status dispatch_storage(DType d, Fn&& fn) {
  return detail::dispatch_dtype(d, [&](auto tag) { return fn(typename Storage<decltype(tag)::value>::type{}); });
}

}  // namespace
}  // namespace expertact::cuda

namespace expertact::detail {

Status cuda_fp8_quantize_rowwise(const Fp8Rows& p, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard, {{"x", p.x}, {"q", p.q}, {"scale", p.scale}}));
  if (p.rows > 0x7fffffffLL * 8) return fail(Status::kInvalidArgument, "too many rows (", p.rows, ")");
  return cuda::dispatch_storage(p.dtype, [&](auto t) {
    using T = decltype(t);
    cuda::quantize_rows_kernel<T><<<cuda::blocks_for(p.rows), cuda::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(p.x), p.x_stride, p.rows, p.cols, static_cast<uint8_t*>(p.q), p.q_stride, p.scale,
        p.scale_stride);
    return cuda::cuda_check(cudaGetLastError(), "fp8 quantize kernel launch");
  });
}

Status cuda_fp8_glu_rowwise(const GluProblem& p, const Fp8Out& o, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{p.packed ? "gate_up" : "gate", p.g}, {"up", p.packed ? nullptr : p.u}, {"weights", p.w},
                         {"q", o.q}, {"scale", o.scale}}));
  if (p.rows > 0x7fffffffLL * 8) return fail(Status::kInvalidArgument, "too many rows (", p.rows, ")");
  const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  return cuda::dispatch_storage(p.dtype, [&](auto t) {
    using T = decltype(t);
    return dispatch_act(p.params.act, [&](auto act) {
      cuda::glu_rows_kernel<T, decltype(act)::value>
          <<<cuda::blocks_for(p.rows), cuda::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
              static_cast<const T*>(p.g), static_cast<const T*>(p.u), p.g_stride, p.u_stride, p.step, p.w,
              p.w_stride, p.rows, p.F, c, static_cast<uint8_t*>(o.q), o.q_stride, o.scale, o.scale_stride);
      return cuda::cuda_check(cudaGetLastError(), "fp8 glu kernel launch");
    });
  });
}

}  // namespace expertact::detail
