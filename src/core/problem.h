// The validated, layout-normalised description of one forward or backward call,
// handed from the API boundary (src/api.cpp) to the CPU or CUDA launchers.
#pragma once

#include <cstdint>

#include "expertact/expertact.hpp"

namespace expertact::detail {

// Gate element (r, c) is at g + r * g_stride + c * step, up element at
// u + r * u_stride + c * step (strides and step in elements). step is 1 for the
// separate and halves layouts (halves: u = g + F, up-first: g = u + F) and 2
// for the interleaved layout (u = g + 1, same stride).
struct GluProblem {
  GluParams params;
  bool has_limit = false;  // limit is finite: clamps and their gradient masks apply
  DType dtype = DType::kFloat32;
  DeviceType device = DeviceType::kCPU;
  int32_t device_id = 0;
  int64_t rows = 0;
  int64_t F = 0;
  int step = 1;
  bool packed = false;  // one gate_up tensor: u lies inside g's view (halves, up-first, interleaved)
  const void* g = nullptr;
  const void* u = nullptr;
  int64_t g_stride = 0;
  int64_t u_stride = 0;
  const float* w = nullptr;  // nullptr: no weights
  int64_t w_stride = 1;
};

struct FwdOutput {
  void* out = nullptr;
  int64_t out_stride = 0;
};

// Gradient outputs share the inputs' step; dg/du may equal g/u (in-place).
struct BwdIO {
  const void* dy = nullptr;
  int64_t dy_stride = 0;
  void* dg = nullptr;
  void* du = nullptr;
  int64_t dg_stride = 0;
  int64_t du_stride = 0;
  float* dw = nullptr;  // nullptr: weight gradient not wanted
  int64_t dw_stride = 1;
};

// The fused FP8 activation backwards' operands beyond the problem (rowwise: Fp8BwdOut,
// src/cpu/fp8_cpu.h; blockwise: src/core/fp8_tiles.h), packed layouts only: dy [rows, F] (the
// problem's dtype, row stride dy_stride); the packed layout (gate's column j of gate_up at q_g +
// j * step, up's at q_u + j * step: the columns of the quantised outputs and of dgu); optional
// dw (float32 [rows], the routing weights' gradient: the row's float32 sum of dy * act * (up +
// beta)) and dgu ([rows, 2F] of the problem's dtype: the gradient rounded to that dtype, as
// glu_backward writes it).
struct PackedBwdIO {
  const void* dy = nullptr;
  int64_t dy_stride = 0;
  int64_t q_g = 0, q_u = 0;
  float* dw = nullptr;  // nullptr: weight gradient not wanted
  int64_t dw_stride = 1;
  void* dgu = nullptr;  // nullptr: not wanted
  int64_t dgu_stride = 0;
};

// Launchers: called only with validated problems with rows > 0. The forward's have
// F > 0; a backward's may have F == 0 with a weight gradient wanted (io.dw): it then only
// zeroes that gradient (each row's sum is over no columns).
Status cpu_forward(const GluProblem& p, const FwdOutput& o);
Status cpu_backward(const GluProblem& p, const BwdIO& io);
// float64 on the CPU (gradient checking): plain loops, float64 arithmetic.
Status cpu_forward_f64(const GluProblem& p, const FwdOutput& o);
Status cpu_backward_f64(const GluProblem& p, const BwdIO& io);
#if EXPERTACT_WITH_CUDA
Status cuda_forward(const GluProblem& p, const FwdOutput& o, void* stream);
Status cuda_backward(const GluProblem& p, const BwdIO& io, void* stream);
#endif

// The weight gradient of an F == 0 backward in host memory: zero per row.
inline void zero_weight_gradient_host(const GluProblem& p, const BwdIO& io) {
  for (int64_t r = 0; r < p.rows; ++r) io.dw[r * io.dw_stride] = 0.0f;
}

}  // namespace expertact::detail
