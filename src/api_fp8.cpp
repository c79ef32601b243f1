// The FP8 entry points (src/core/fp8.h): the input checks of the activation's forward
// (prepare_forward, src/api.cpp) or of one matrix, those of the e4m3fn output and the scales,
// then the CPU or CUDA path.
#include <cstdint>

#include "api.h"
#include "core/checks.h"
#include "core/error.h"
#include "cpu/fp8_cpu.h"
#include "expertact/expertact.hpp"

namespace expertact {
namespace detail {
namespace {

// q [rows, cols] of kFloat8E4M3 and scale float32 [rows], on `dev`, not overlapping `in`.
Status check_fp8_outputs(const MatrixRef& q, const VectorRef& scale, int64_t rows, int64_t cols,
                         DeviceType dev, int32_t dev_id, const char* in_name, const Extent& in) {
  if (q.dtype != DType::kFloat8E4M3)
    return fail(Status::kInvalidDtype, "q has dtype ", q.dtype, "; the FP8 output is float8_e4m3fn");
  EA_TRY(check_matrix_view("q", q));
  if (q.rows != rows || q.cols != cols)
    return fail(Status::kInvalidArgument, "q is [", q.rows, ", ", q.cols, "]; expected [", rows, ", ",
                cols, "]");
  EA_TRY(check_same_device("q", q.device, q.device_id, dev, dev_id, in_name));
  EA_TRY(check_vector("scale", scale, rows));
  EA_TRY(check_same_device("scale", scale.device, scale.device_id, dev, dev_id, in_name));
  const Extent eq = extent_of(q), es = extent_of(scale);
  EA_TRY(check_no_overlap("q", eq, in_name, in));
  EA_TRY(check_no_overlap("scale", es, in_name, in));
  EA_TRY(check_no_overlap("scale", es, "q", eq));
  return Status::kOk;
}

#if !EXPERTACT_WITH_CUDA
Status no_fp8_cuda(const char* name) {
  return fail(Status::kUnsupported, name, " is a CUDA tensor but this expertact build has no CUDA path");
}
#endif

}  // namespace

Status fp8_quantize_rowwise_body(const MatrixRef& x, const MatrixRef& q, const VectorRef& scale,
                                 void* stream) {
  EA_TRY(check_matrix("x", x));
  if (x.dtype == DType::kFloat64)
    return fail(Status::kInvalidDtype, "x is float64: FP8 quantisation takes float32, float16 or bfloat16");
  EA_TRY(check_fp8_outputs(q, scale, x.rows, x.cols, x.device, x.device_id, "x", extent_of(x)));
  if (x.rows == 0) return Status::kOk;
  Fp8Rows p;
  p.device_id = x.device_id;
  p.dtype = x.dtype;
  p.rows = x.rows;
  p.cols = x.cols;
  p.x = x.data;
  p.x_stride = x.row_stride;
  p.q = q.data;
  p.q_stride = q.row_stride;
  p.scale = scale.data;
  p.scale_stride = scale.stride;
  if (x.device == DeviceType::kCPU) return cpu_fp8_quantize_rowwise(p);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_quantize_rowwise(p, stream);
#else
  (void)stream;
  return no_fp8_cuda("x");
#endif
}

Status fp8_quantize_colwise_grouped_body(const MatrixRef& x, const OffsetsRef& offsets,
                                        const MatrixRef& q_t, const MatrixRef& scale, void* stream) {
  (void)stream;
  EA_TRY(check_matrix("x", x));
  if (x.dtype == DType::kFloat64)
    return fail(Status::kInvalidDtype, "x is float64: FP8 quantisation takes float32, float16 or bfloat16");
  EA_TRY(check_offsets(offsets, x.rows, x.device, x.device_id, "x"));
  if (q_t.dtype != DType::kFloat8E4M3)
    return fail(Status::kInvalidDtype, "q_t has dtype ", q_t.dtype, "; the FP8 output is float8_e4m3fn");
  EA_TRY(check_matrix_view("q_t", q_t));
  if (q_t.rows != x.cols || q_t.cols != x.rows)
    return fail(Status::kInvalidArgument, "q_t is [", q_t.rows, ", ", q_t.cols, "]; expected x transposed, [",
                x.cols, ", ", x.rows, "]");
  EA_TRY(check_same_device("q_t", q_t.device, q_t.device_id, x.device, x.device_id, "x"));
  EA_TRY(check_matrix("scale", scale));
  if (scale.dtype != DType::kFloat32 || scale.rows != offsets.size || scale.cols != x.cols)
    return fail(Status::kInvalidArgument, "scale must be float32 [E, C] = [", offsets.size, ", ", x.cols,
                "] (got ", scale.dtype, " [", scale.rows, ", ", scale.cols, "])");
  EA_TRY(check_same_device("scale", scale.device, scale.device_id, x.device, x.device_id, "x"));
  const Extent ex = extent_of(x), eq = extent_of(q_t), es = extent_of(scale);
  EA_TRY(check_no_overlap("q_t", eq, "x", ex));
  EA_TRY(check_no_overlap("scale", es, "x", ex));
  EA_TRY(check_no_overlap("scale", es, "q_t", eq));
  if (x.device != DeviceType::kCPU)
    return fail(Status::kUnsupported, "x is a CUDA tensor: quantize_colwise_grouped has no CUDA path yet");
  if (x.cols == 0) return Status::kOk;
  Fp8Cols p;
  p.dtype = x.dtype;
  p.rows = x.rows;
  p.cols = x.cols;
  p.x = x.data;
  p.x_stride = x.row_stride;
  p.offsets = offsets.data;
  p.experts = offsets.size;
  p.q_t = q_t.data;
  p.q_stride = q_t.row_stride;
  p.scale = static_cast<float*>(scale.data);
  p.scale_stride = scale.row_stride;
  return cpu_fp8_quantize_colwise_grouped(p);
}

Status fp8_glu_rowwise_body(const GluParams& params, Layout layout, const MatrixRef& x,
                            const MatrixRef* up, const VectorRef* weights, const MatrixRef& q,
                            const VectorRef& scale, void* stream) {
  const char* xname = layout == Layout::kSeparate ? "gate" : "gate_up";
  GluProblem p;
  EA_TRY(prepare_inputs(params, layout, x, up, weights, p));
  if (p.dtype == DType::kFloat64)
    return fail(Status::kInvalidDtype, xname, " is float64: FP8 quantisation takes float32, float16 or bfloat16");
  EA_TRY(check_fp8_outputs(q, scale, p.rows, p.F, p.device, p.device_id, xname, extent_of(x)));
  if (up) {
    EA_TRY(check_no_overlap("q", extent_of(q), "up", extent_of(*up)));
    EA_TRY(check_no_overlap("scale", extent_of(scale), "up", extent_of(*up)));
  }
  if (weights) {
    EA_TRY(check_no_overlap("q", extent_of(q), "weights", extent_of(*weights)));
    EA_TRY(check_no_overlap("scale", extent_of(scale), "weights", extent_of(*weights)));
  }
  if (p.rows == 0) return Status::kOk;
  Fp8Out o;
  o.q = q.data;
  o.q_stride = q.row_stride;
  o.scale = scale.data;
  o.scale_stride = scale.stride;
  if (p.device == DeviceType::kCPU) return cpu_fp8_glu_rowwise(p, o);
#if EXPERTACT_WITH_CUDA
  return cuda_fp8_glu_rowwise(p, o, stream);
#else
  (void)stream;
  return no_fp8_cuda(xname);
#endif
}

}  // namespace detail

Status fp8_quantize_rowwise(const MatrixRef& x, const MatrixRef& q, const VectorRef& scale,
                            void* stream) {
  return detail::guarded("fp8_quantize_rowwise",
                         [&] { return detail::fp8_quantize_rowwise_body(x, q, scale, stream); });
}

Status fp8_quantize_colwise_grouped(const MatrixRef& x, const OffsetsRef& offsets,
                                    const MatrixRef& q_t, const MatrixRef& scale, void* stream) {
  return detail::guarded("fp8_quantize_colwise_grouped", [&] {
    return detail::fp8_quantize_colwise_grouped_body(x, offsets, q_t, scale, stream);
  });
}

Status fp8_glu_rowwise(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& q,
                       const VectorRef& scale, void* stream) {
  return detail::guarded("fp8_glu_rowwise", [&] {
    return detail::fp8_glu_rowwise_body(params, layout, x, up, weights, q, scale, stream);
  });
}

}  // namespace expertact
