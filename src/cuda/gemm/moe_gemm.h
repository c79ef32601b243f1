// The experimental fused grouped GEMMs' launchers and kernel parameters (src/cuda/gemm/,
// built when CUTLASS is found: EXPERTACT_WITH_CUTLASS), with no CUTLASS type in sight, so
// that the API boundary (src/api_moe.cpp) includes it as plain C++.
#pragma once

#include <cstdint>

#include "core/math.h"
#include "expertact/expertact.hpp"

struct __nv_bfloat16;  // cuda_bf16.h's type; only pointers to it cross this header

namespace expertact::gemm {

// What the forward epilogue needs beyond the GEMM: where h goes and the activation.
struct FwdEpilogueParams {
  __nv_bfloat16* h = nullptr;  // [T, F] row-major, row stride ldh
  int64_t ldh = 0;
  const int32_t* offsets = nullptr;  // device, [E] cumulative end rows
  int64_t T = 0;
  const float* w = nullptr;  // [T] routing weights, or nullptr
  int64_t w_stride = 1;
  math::Coeffs coeffs{};
  // Set by the launcher: h 8-byte aligned with ldh % 4 == 0, so that the four lanes that
  // share a row write it as one 8-byte store each (else one 2-byte store per element).
  bool h_vec8 = false;
};

struct BwdEpilogueParams {
  const __nv_bfloat16* gate_up = nullptr;  // [T, 2F], interleaved
  int64_t ld_gu = 0;
  __nv_bfloat16* dgate_up = nullptr;  // [T, 2F]; may equal gate_up (in place)
  int64_t ld_dgu = 0;
  const int32_t* offsets = nullptr;
  int64_t T = 0;
  const float* w = nullptr;
  int64_t w_stride = 1;
  float* dw = nullptr;  // [T] weight gradient (accumulated: zeroed by the launcher), or nullptr
  int64_t dw_stride = 1;
  math::Coeffs coeffs{};
  // Set by the launcher: gate_up and dgate_up 8-byte aligned with row strides
  // multiples of 4 elements, so that two adjacent elements' (gate, up) pairs move as one
  // 8-byte load and store (else 4 bytes each).
  bool vec8 = false;
};

// One grouped GEMM over E experts: A [T, K] row-major (row stride lda), B [E, N, K]
// with K contiguous (expert stride ldb_e, row stride ldb), D [T, N] row-major (or none).
struct GroupedShape {
  int32_t E = 0;
  int64_t T = 0;
  int64_t N = 0;
  int64_t K = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  int64_t ldb_e = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  int device = 0;
};

// Launchers, over the operands as the API boundary validated them (src/api_moe.cpp;
// the argument meanings of expertact/experimental/fused_gemm.h): T > 0, num_experts >= 1,
// and F > 0 for the forward; a backward with F == 0 has grad_weights and only zeroes it.
// They fill the kernels' parameters below. The forward stores gate_up and h; the backward
// stores grad_gate_up (never dh) and, when grad_weights is given, zeroes and accumulates it.
Status fused_forward(const GluParams& params, const MatrixRef& x, const MatrixRef& w13,
                     int32_t num_experts, const int32_t* offsets, const VectorRef* weights,
                     const MatrixRef& gate_up, const MatrixRef& h, void* stream);
Status fused_backward(const GluParams& params, const MatrixRef& grad_y, const MatrixRef& w2,
                      int32_t num_experts, const int32_t* offsets, const MatrixRef& gate_up,
                      const VectorRef* weights, const MatrixRef& grad_gate_up,
                      const VectorRef* grad_weights, void* stream);

// The kernels' schedules (src/cuda/gemm/moe_gemm_sm90.cuh): which are built is a CMake
// list (EXPERTACT_CUTLASS_SCHEDULES); EXPERTACT_FUSED_SCHEDULE picks one at run time.
enum class Schedule : int { kPingpong = 0, kCooperative = 1, kPingpong64 = 2 };

// One kernel per direction x activation x schedule, each explicitly instantiated in its
// own translation unit (generated from src/cuda/gemm/moe_kernel.cu.in).
namespace detail {
template <Activation A, Schedule S>
Status fwd(const GroupedShape& s, const FwdEpilogueParams& p, void* stream);
template <Activation A, Schedule S>
Status bwd(const GroupedShape& s, const BwdEpilogueParams& p, void* stream);
}  // namespace detail

}  // namespace expertact::gemm
