/* EXPERIMENTAL: the expert MLP's grouped GEMMs with the gated activation fused into their
 * epilogues, for C (expertact_moe_fused_*) and C++ (expertact::experimental).
 *
 * Not part of the stable API of expertact.hpp / expertact_c.h: these kernels are correct
 * (tested against float64 references) but slower than the unfused path (grouped GEMM, then
 * expertact's activation), and their design cannot reach its targets (docs/fused-gemm.md).
 * Their names and signatures may change or go in any release. The exported C symbols keep
 * their names so that a binding that looks them up (Python's ctypes) finds them.
 *
 * CUTLASS kernels for Hopper (sm_90) GPUs, bfloat16 operands, float32 accumulation; built
 * when the CUTLASS headers were found at build time (expertact_has_fused_gemm()); in other
 * builds every call returns EXPERTACT_UNSUPPORTED (kUnsupported).
 *
 * Rows are sorted by expert: expert e owns rows [offsets[e-1], offsets[e]) (offsets[-1] =
 * 0). offsets is int32 [num_experts] in device memory of the tensors' GPU; it is read on the
 * device only (no host sync). It must be non-decreasing and at most T; values that are not
 * are clamped into [0, T] (wrong rows, never an access outside the tensors). Rows past the
 * last offset are neither read nor written. gate_up is interleaved (gate, up, gate, up, ...).
 * Every matrix is bfloat16 with its last dimension contiguous; the operands read or written
 * by the tensor memory accelerator (x, w13, gate_up; grad_y, w2) need 16-byte aligned data
 * and row strides that are multiples of 8 elements.
 */
#ifndef EXPERTACT_EXPERIMENTAL_FUSED_GEMM_H_
#define EXPERTACT_EXPERIMENTAL_FUSED_GEMM_H_

#include "expertact/expertact_c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Forward: x [T, D]; w13 [E, 2F, D] (D contiguous, gate and up interleaved along 2F);
 * offsets int32 [E] on the tensors' CUDA device; weights NULL or float32 [T]; gate_up
 * [T, 2F] and h [T, F] are written. */
EXPERTACT_API expertact_status expertact_moe_fused_forward(const expertact_params* params,
                                                           const DLTensor* x, const DLTensor* w13,
                                                           const DLTensor* offsets,
                                                           const DLTensor* weights,
                                                           DLTensor* gate_up, DLTensor* h,
                                                           void* stream);

/* Backward through the down GEMM and the activation: grad_y [T, D]; w2 [E, F, D]
 * (D contiguous); gate_up [T, 2F] from the forward; grad_gate_up [T, 2F] is written (it
 * may be gate_up itself: in place); grad_weights NULL, or float32 [T] when weights is
 * given. */
EXPERTACT_API expertact_status expertact_moe_fused_backward(
    const expertact_params* params, const DLTensor* grad_y, const DLTensor* w2,
    const DLTensor* offsets, const DLTensor* gate_up, const DLTensor* weights,
    DLTensor* grad_gate_up, DLTensor* grad_weights, void* stream);

/* 1 if this build has the fused grouped GEMMs, else 0. */
EXPERTACT_API int32_t expertact_has_fused_gemm(void);

#ifdef __cplusplus
}  // extern "C"

#include "expertact/expertact.hpp"

namespace expertact::experimental {

// Forward: gate_up[rows of e] = x[rows of e] @ w13[e]^T and
//          h = act(gate_up) * weights, computed from gate_up rounded to bfloat16 (as the
//          unfused glu_forward reads it back), rounded once.
//   x: [T, D]; w13: [num_experts * 2F, D], expert e's [2F, D] block at rows e * 2F
//   (w13 as [E, 2F, D] with D contiguous, gate and up interleaved along 2F);
//   weights: optional float32 [T]; gate_up: [T, 2F] and h: [T, F], written.
Status moe_fused_forward(const GluParams& params, const MatrixRef& x, const MatrixRef& w13,
                         int32_t num_experts, const int32_t* offsets, const VectorRef* weights,
                         const MatrixRef& gate_up, const MatrixRef& h, void* stream = nullptr);

// Backward: dh[rows of e] = grad_y[rows of e] @ w2[e]^T is computed and rounded to
// bfloat16 (as the unfused path stores it) but never stored: the epilogue turns it into
// grad_gate_up (glu_backward's gradient, interleaved; may be gate_up itself: in place)
// and, when grad_weights is given, the weights' gradient (float32 row sums over the N
// tiles, added with atomics: not bitwise reproducible run to run).
//   grad_y: [T, D]; w2: [num_experts * F, D], expert e's [F, D] block at rows e * F
//   (w2 as [E, F, D], D contiguous); gate_up: [T, 2F] from the forward;
//   grad_weights: float32 [T] (given only with weights).
Status moe_fused_backward(const GluParams& params, const MatrixRef& grad_y, const MatrixRef& w2,
                          int32_t num_experts, const int32_t* offsets, const MatrixRef& gate_up,
                          const VectorRef* weights, const MatrixRef& grad_gate_up,
                          const VectorRef* grad_weights, void* stream = nullptr);

// Whether this build has the fused grouped GEMMs (CUDA and the CUTLASS headers).
bool has_fused_gemm();

}  // namespace expertact::experimental

#endif  // __cplusplus

#endif /* EXPERTACT_EXPERIMENTAL_FUSED_GEMM_H_ */
