// The bodies of the public entry points, without the exception guard: validation (once,
// with messages naming the argument) and the hand-off to a launcher. The C++ API
// (api.cpp, api_moe.cpp) and the C ABI (c_api.cpp) each call them inside detail::guarded,
// so every call passes one guard, at the boundary it comes in through.
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "expertact/expertact.hpp"

namespace expertact::detail {

Status glu_forward_body(const GluParams& params, Layout layout, const MatrixRef& x,
                        const MatrixRef* up, const VectorRef* weights, const MatrixRef& out,
                        void* stream);
Status glu_backward_body(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                         const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                         const MatrixRef& grad_x, const MatrixRef* grad_up,
                         const VectorRef* grad_weights, void* stream);

// The checks of the activation's inputs (params, layout, x, up, weights; float64 on the CPU
// only) and the problem they describe, without an output (the FP8 form has its own).
Status prepare_inputs(const GluParams& params, Layout layout, const MatrixRef& x,
                      const MatrixRef* up, const VectorRef* weights, GluProblem& p);

// Every check of a forward / backward call, and the problem they describe (the bodies
// above are these plus the launch; the biased forms, src/api_bias.cpp, add their own).
Status prepare_forward(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& out,
                       GluProblem& p, FwdOutput& o);
Status prepare_backward(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                        const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                        const MatrixRef& grad_x, const MatrixRef* grad_up,
                        const VectorRef* grad_weights, GluProblem& p, BwdIO& io);

#if !EXPERTACT_WITH_CUDA
// kUnsupported for a CUDA tensor in a build without the CUDA path, naming x.
Status no_cuda_path(Layout layout);
#endif

// The per-expert biases (src/api_bias.cpp). check_offsets: the offsets' description against the
// tensors' device, and on the CPU their values (non-decreasing, within the rows); name: the
// argument's name in the messages.
Status check_offsets(const OffsetsRef& o, int64_t rows, DeviceType dev, int32_t dev_id,
                     const char* ref_name, const char* name = "offsets");
// The bias's gate and up parts in the problem's layout (as build_problem splits x).
void bias_pointers(Layout layout, const GluProblem& p, const void* base, const void*& g,
                   const void*& u);
Status glu_forward_bias_body(const GluParams& params, Layout layout, const MatrixRef& x,
                             const MatrixRef* up, const VectorRef* weights, const MatrixRef& bias,
                             const OffsetsRef& offsets, const MatrixRef& out, void* stream);
Status glu_backward_bias_body(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                              const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                              const MatrixRef& bias, const OffsetsRef& offsets,
                              const MatrixRef& grad_x, const MatrixRef* grad_up,
                              const VectorRef* grad_weights, const MatrixRef* grad_bias,
                              void* workspace, size_t workspace_bytes, void* stream);
Status expert_bias_forward_body(const MatrixRef& x, const MatrixRef& bias, const OffsetsRef& offsets,
                                const VectorRef* weights, const MatrixRef& out, void* stream);
Status expert_bias_backward_body(const MatrixRef& grad_out, const MatrixRef& bias,
                                 const OffsetsRef& offsets, const VectorRef* weights,
                                 const MatrixRef* grad_bias, const VectorRef* grad_weights,
                                 void* workspace, size_t workspace_bytes, void* stream);

// FP8 rowwise quantisation (src/api_fp8.cpp).
// col_amax_offsets and col_amax: both null or both given; amax: null or given.
Status fp8_quantize_rowwise_body(const MatrixRef& x, const MatrixRef& q, const VectorRef& scale,
                                 const OffsetsRef* col_amax_offsets, const MatrixRef* col_amax,
                                 void* stream);
Status fp8_quantize_colwise_grouped_body(const MatrixRef& x, const OffsetsRef& offsets,
                                        const OffsetsRef* padded_offsets, const MatrixRef& q_t,
                                        const MatrixRef& scale, const MatrixRef* amax, void* stream);
// bias and offsets: both null (no bias) or both given; col_amax_offsets and col_amax: both
// null or both given (with a bias, col_amax_offsets must be offsets).
Status fp8_glu_rowwise_body(const GluParams& params, Layout layout, const MatrixRef& x,
                            const MatrixRef* up, const VectorRef* weights, const MatrixRef* bias,
                            const OffsetsRef* offsets, const MatrixRef& q, const VectorRef& scale,
                            const OffsetsRef* col_amax_offsets, const MatrixRef* col_amax, void* stream);
// The activation quantised per expert and column (expertact.hpp, fp8_glu_colwise_grouped); up,
// weights, bias, padded_offsets: null when not given.
Status fp8_glu_colwise_grouped_body(const GluParams& params, Layout layout, const MatrixRef& x,
                                    const MatrixRef* up, const VectorRef* weights, const MatrixRef* bias,
                                    const OffsetsRef& offsets, const OffsetsRef* padded_offsets,
                                    const MatrixRef& q_t, const MatrixRef& scale, const MatrixRef& amax,
                                    void* stream);
// The fused FP8 activation backward (expertact.hpp, fp8_glu_backward_rowwise); bias, offsets,
// grad_weights, col_amax, grad_gate_up: null when not given.
Status fp8_glu_backward_rowwise_body(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                                     const MatrixRef& gate_up, const VectorRef* weights, const MatrixRef* bias,
                                     const OffsetsRef* offsets, const MatrixRef& q, const VectorRef& scale,
                                     const VectorRef* grad_weights, const MatrixRef* col_amax,
                                     const MatrixRef* grad_gate_up, void* stream);

// FP8 blockwise operands (src/api_fp8_tiles.cpp; expertact.hpp says what each writes). Optional
// operands: null when not given.
Status fp8_quantize_row_tiles_body(const MatrixRef& x, const MatrixRef& q, const MatrixRef& scale, void* stream);
// q and row_scale: both null or both given.
Status fp8_quantize_column_tiles_grouped_body(const MatrixRef& x, const OffsetsRef& offsets,
                                              const OffsetsRef& padded_offsets, const MatrixRef& q_t,
                                              const MatrixRef& scale, const MatrixRef* q, const MatrixRef* row_scale,
                                              void* stream);
Status fp8_quantize_blocks_body(const Tensor3Ref& w, const MatrixRef& q, const MatrixRef& scale, void* stream);
Status fp8_glu_row_tiles_body(const GluParams& params, Layout layout, const MatrixRef& x, const MatrixRef* up,
                              const VectorRef* weights, const MatrixRef* bias, const OffsetsRef* offsets,
                              const MatrixRef& q, const MatrixRef& scale, void* stream);
Status fp8_glu_column_tiles_grouped_body(const GluParams& params, Layout layout, const MatrixRef& x,
                                         const MatrixRef* up, const VectorRef* weights, const MatrixRef* bias,
                                         const OffsetsRef& offsets, const OffsetsRef& padded_offsets,
                                         const MatrixRef& q_t, const MatrixRef& scale, void* stream);
Status fp8_glu_backward_tiles_body(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                                   const MatrixRef& gate_up, const VectorRef* weights, const MatrixRef* bias,
                                   const OffsetsRef* offsets, const OffsetsRef* padded_offsets, const MatrixRef& q,
                                   const MatrixRef& scale, const MatrixRef* q_t, const MatrixRef* col_scale,
                                   const VectorRef* grad_weights, const MatrixRef* grad_gate_up, void* stream);

}  // namespace expertact::detail
