// The checks and helpers that the FP8 entry points share (src/api_fp8.cpp, rowwise;
// src/api_fp8_tiles.cpp, blockwise; src/api_fp8_gemm.cpp, the grouped GEMM): the quantised
// input's dtype, the float8 and scale outputs, overlap checks over named operands, the bias
// split into its gate and up parts.
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
  const char* base = static_cast<const char*>(bias.data);
  const int64_t half = p.F * dtype_size(p.dtype), one = dtype_size(p.dtype);
  switch (layout) {
    case Layout::kSeparate:
    case Layout::kHalves: b.bg = base; b.bu = base + half; break;
    case Layout::kHalvesUpFirst: b.bg = base + half; b.bu = base; break;
    case Layout::kInterleaved: b.bg = base; b.bu = base + one; break;
  }
  b.b_stride = bias.row_stride;
}

#if !EXPERTACT_WITH_CUDA
inline Status no_fp8_cuda(const char* name) {
  return fail(Status::kUnsupported, name, " is a CUDA tensor but this expertact build has no CUDA path");
}
#endif

}  // namespace expertact::detail
