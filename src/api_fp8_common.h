// The checks and helpers that the FP8 entry points share (src/api_fp8.cpp, rowwise;
// src/api_fp8_tiles.cpp, blockwise; src/api_fp8_gemm.cpp, the grouped GEMM): the quantised
// input's dtype, the float8 and scale outputs, the argument checks more than one entry makes
// (arguments given together, operands, padded_offsets, the bias, the activation backwards'
// gradients), overlap checks over named operands, the bias split into its gate and up parts
// and the backwards' operands.
#pragma once

#include <cstdint>

#include "api.h"
#include "core/bias.h"
#include "core/checks.h"
#include "core/error.h"
#include "expertact/expertact.hpp"

namespace expertact::detail {

// The input's dtype: the kernels quantise float32, float16 or bfloat16 (float64 is the CPU's
// gradient-checking type, with nothing to quantise for).
inline Status check_fp8_input(const char* name, DType d) {
  if (d == DType::kFloat64)
    return fail(Status::kInvalidDtype, name, " is float64: FP8 quantisation takes float32, float16 or bfloat16");
  return Status::kOk;
}

// One output: [rows, cols] of `dtype` (float8 for the quantised values, float32 for matrix
// scales), on the input's device, not overlapping it.
inline Status check_fp8_output(const char* name, const MatrixRef& m, int64_t rows, int64_t cols, DType dtype,
                               const char* why, DeviceType dev, int32_t dev_id, const char* in_name,
                               const Extent& in) {
  EA_TRY(check_matrix_view(name, m));  // its dtype by check_shape: float8 is no input dtype
  EA_TRY(check_shape(name, m, rows, cols, dtype, why));
  EA_TRY(check_same_device(name, m.device, m.device_id, dev, dev_id, in_name));
  return check_no_overlap(name, extent_of(m), in_name, in);
}

// q [rows, cols] of kFloat8E4M3 and scale float32 [rows], on `dev`, not overlapping `in`.
inline Status check_fp8_outputs(const MatrixRef& q, const VectorRef& scale, int64_t rows, int64_t cols,
                                DeviceType dev, int32_t dev_id, const char* in_name, const Extent& in) {
  EA_TRY(check_fp8_output("q", q, rows, cols, DType::kFloat8E4M3, "the quantised input", dev, dev_id,
                          in_name, in));
  EA_TRY(check_vector("scale", scale, rows));
  EA_TRY(check_same_device("scale", scale.device, scale.device_id, dev, dev_id, in_name));
  const Extent es = extent_of(scale);
  EA_TRY(check_no_overlap("scale", es, in_name, in));
  return check_no_overlap("scale", es, "q", extent_of(q));
}

// Two optional arguments that are given together or not at all.
inline Status check_together(const void* a, const char* a_name, const void* b, const char* b_name) {
  if ((a == nullptr) != (b == nullptr))
    return fail(Status::kInvalidArgument, a_name, " and ", b_name, " go together (got only ", a ? a_name : b_name,
                ")");
  return Status::kOk;
}

// An operand [rows, cols] of `dtype` (an input, or an output of the input's dtype) on the
// input's device.
inline Status check_operand(const char* name, const MatrixRef& m, int64_t rows, int64_t cols, DType dtype,
                            const char* why, DeviceType dev, int32_t dev_id, const char* in_name) {
  EA_TRY(check_matrix(name, m));
  EA_TRY(check_shape(name, m, rows, cols, dtype, why));
  return check_same_device(name, m.device, m.device_id, dev, dev_id, in_name);
}

// padded_offsets' description: one int32 per expert (as offsets), non-null and aligned, on the
// device (the callers check its values against their padding on the CPU).
inline Status check_padded_described(const OffsetsRef& pad, const OffsetsRef& offsets, DeviceType dev,
                                     int32_t dev_id, const char* ref_name) {
  if (pad.size != offsets.size)
    return fail(Status::kInvalidArgument, "padded_offsets has ", pad.size, " elements; offsets has ",
                offsets.size, " (one padded end row per expert)");
  if (pad.data == nullptr) return fail(Status::kInvalidArgument, "padded_offsets.data is null");
  if (reinterpret_cast<uintptr_t>(pad.data) % 4 != 0)
    return fail(Status::kInvalidArgument, "padded_offsets.data is not aligned to its 4-byte int32 element");
  return check_same_device("padded_offsets", pad.device, pad.device_id, dev, dev_id, ref_name);
}

// The GLU forms' bias: [E, 2F] of the input's dtype (as glu_forward_bias checks it).
inline Status check_glu_bias(const MatrixRef& bias, int64_t E, const GluProblem& p, const char* xname) {
  return check_operand("bias", bias, E, 2 * p.F, p.dtype, "a bias is [E, 2F] of the input's dtype", p.device,
                       p.device_id, xname);
}

// The fused activation backwards (fp8_glu_backward_rowwise, fp8_glu_backward_tiles) take a
// packed gate_up [rows, 2F] only.
inline Status check_packed_layout(Layout layout, const char* fn) {
  if (layout == Layout::kSeparate)
    return fail(Status::kInvalidArgument, "layout 0 (separate) is not taken by ", fn,
                ": gate_up is one packed [rows, 2F] tensor (halves, halves_up_first or interleaved)");
  return Status::kOk;
}

// A backward's grad_out: [rows, F] of gate_up's dtype, on its device.
inline Status check_grad_out(const MatrixRef& grad_out, const GluProblem& p) {
  return check_operand("grad_out", grad_out, p.rows, p.F, p.dtype, "grad_out is [rows, F] of gate_up's dtype",
                       p.device, p.device_id, "gate_up");
}

// A backward's optional outputs: the routing weights' gradient (float32 [rows], only with
// weights) and gate_up's gradient rounded to its dtype ([rows, 2F]), on gate_up's device.
inline Status check_grad_weights(const VectorRef* grad_weights, const VectorRef* weights, const GluProblem& p) {
  if (grad_weights == nullptr) return Status::kOk;
  if (weights == nullptr) return fail(Status::kInvalidArgument, "grad_weights is given but weights is null");
  EA_TRY(check_vector("grad_weights", *grad_weights, p.rows));
  return check_same_device("grad_weights", grad_weights->device, grad_weights->device_id, p.device, p.device_id,
                           "gate_up");
}

inline Status check_grad_gate_up(const MatrixRef* grad_gate_up, const GluProblem& p) {
  if (grad_gate_up == nullptr) return Status::kOk;
  return check_operand("grad_gate_up", *grad_gate_up, p.rows, 2 * p.F, p.dtype, "a gradient matches its input",
                       p.device, p.device_id, "gate_up");
}

// offsets, where an operand per expert (`per_expert`, or null: none) needs them.
inline Status check_offsets_given(const OffsetsRef* offsets, const char* per_expert) {
  if (per_expert != nullptr && offsets == nullptr)
    return fail(Status::kInvalidArgument, "offsets is missing: ", per_expert,
                " is per expert (offsets: the experts' cumulative end rows)");
  return Status::kOk;
}

// An operand's name and the bytes it spans, for the overlap checks.
struct Named {
  const char* name;
  Extent e;
};

// No operand of `a` shares a byte with one of `b`.
template <size_t N, size_t M>
Status check_apart(const Named (&a)[N], const Named (&b)[M]) {
  for (const Named& x : a)
    for (const Named& y : b) EA_TRY(check_no_overlap(x.name, x.e, y.name, y.e));
  return Status::kOk;
}

// The bytes an int32 offsets vector spans, for the overlap checks.
inline Extent offsets_extent(const OffsetsRef& o) {
  Extent e;
  if (o.size == 0 || o.data == nullptr) return e;
  e.begin = reinterpret_cast<uintptr_t>(o.data);
  e.end = e.begin + static_cast<uintptr_t>(o.size * 4);
  e.row_bytes = o.size * 4;
  e.empty = false;
  return e;
}

// The bias [E, 2F] split into its gate and up parts in the layout (as glu_forward_bias,
// src/api_bias.cpp, splits it), with its offsets.
inline void split_bias(Layout layout, const GluProblem& p, const MatrixRef& bias, const OffsetsRef& offsets,
                       GluBias& b) {
  b.er.offsets = offsets.data;
  b.er.experts = offsets.size;
  bias_pointers(layout, p, bias.data, b.bg, b.bu);
  b.b_stride = bias.row_stride;
}

// A backward's operands beyond the problem (PackedBwdIO): dy, the packed columns of gate's
// and up's column 0 in the layout, and the optional outputs.
inline void set_packed_bwd(Layout layout, const GluProblem& p, const MatrixRef& grad_out,
                           const VectorRef* grad_weights, const MatrixRef* grad_gate_up, PackedBwdIO& d) {
  d.dy = grad_out.data;
  d.dy_stride = grad_out.row_stride;
  switch (layout) {
    case Layout::kHalvesUpFirst: d.q_g = p.F; d.q_u = 0; break;
    case Layout::kInterleaved: d.q_g = 0; d.q_u = 1; break;
    default: d.q_g = 0; d.q_u = p.F; break;
  }
  if (grad_weights) {
    d.dw = grad_weights->data;
    d.dw_stride = grad_weights->stride;
  }
  if (grad_gate_up) {
    d.dgu = grad_gate_up->data;
    d.dgu_stride = grad_gate_up->row_stride;
  }
}

#if !EXPERTACT_WITH_CUDA
inline Status no_fp8_cuda(const char* name) {
  return fail(Status::kUnsupported, name, " is a CUDA tensor but this expertact build has no CUDA path");
}
#endif

}  // namespace expertact::detail
