// The per-expert biases' entry points (src/core/bias.h): the checks of the activation's
// forward / backward (prepare_forward / prepare_backward, src/api.cpp) plus those of the
// bias, its gradient, the offsets and the workspace, each naming its argument; then the
// CPU or CUDA launcher.
#include <cstdint>
#include <string>

#include "api.h"
#include "core/bias.h"
#include "core/checks.h"
#include "core/error.h"
#include "expertact/expertact.hpp"

namespace expertact {

size_t glu_bias_workspace_bytes(int64_t rows, int64_t F, int64_t num_experts) {
  return detail::bias_workspace(rows, F, 2 * F, num_experts);
}
size_t expert_bias_workspace_bytes(int64_t rows, int64_t cols, int64_t num_experts) {
  return detail::bias_workspace(rows, cols, cols, num_experts);
}

namespace detail {

// The offsets' description, and on the CPU their values (read there without cost).
Status check_offsets(const OffsetsRef& o, int64_t rows, DeviceType dev, int32_t dev_id,
                     const char* ref_name, const char* name) {
  if (o.size < 1 || o.size > 2147483647)
    return fail(Status::kInvalidArgument, name, " has ", o.size,
                " elements; expected E >= 1 (one cumulative end row per expert)");
  if (o.data == nullptr) return fail(Status::kInvalidArgument, name, ".data is null");
  if (reinterpret_cast<uintptr_t>(o.data) % 4 != 0)
    return fail(Status::kInvalidArgument, name, ".data is not aligned to its 4-byte int32 element");
  EA_TRY(check_same_device(name, o.device, o.device_id, dev, dev_id, ref_name));
  if (o.device != DeviceType::kCPU) return Status::kOk;
  int64_t prev = 0;
  for (int64_t e = 0; e < o.size; ++e) {
    const int64_t v = o.data[e];
    if (v < prev)
      return e == 0 ? fail(Status::kInvalidArgument, name, "[0] = ", v, " is negative")
                    : fail(Status::kInvalidArgument, name, " must be non-decreasing: ", name, "[", e,
                           "] = ", v, " < ", name, "[", e - 1, "] = ", prev);
    prev = v;
  }
  if (prev > rows)
    return fail(Status::kInvalidArgument, name, "[", o.size - 1, "] = ", prev,
                " is past the last row (", rows, " rows)");
  return Status::kOk;
}

void bias_pointers(Layout layout, const GluProblem& p, const void* base, const void*& g,
                   const void*& u) {
  const char* b = static_cast<const char*>(base);
  const int64_t es = dtype_size(p.dtype);
  switch (layout) {
    case Layout::kSeparate:
    case Layout::kHalves: g = b; u = b + p.F * es; break;
    case Layout::kHalvesUpFirst: g = b + p.F * es; u = b; break;
    case Layout::kInterleaved: g = b; u = b + es; break;
  }
}

namespace {

// A bias (or its gradient): [E, cols] of x's dtype and device.
Status check_bias(const char* name, const MatrixRef& b, int64_t E, int64_t cols, DType dtype,
                  DeviceType dev, int32_t dev_id, const char* ref_name) {
  EA_TRY(check_matrix(name, b));
  EA_TRY(check_shape(name, b, E, cols, dtype, "a bias is [E, columns] of the input's dtype"));
  return check_same_device(name, b.device, b.device_id, dev, dev_id, ref_name);
}

Status check_workspace(void* ws, size_t bytes, size_t need, DeviceType dev) {
  if (dev == DeviceType::kCPU || need == 0) return Status::kOk;
  if (ws == nullptr || bytes < need)
    return fail(Status::kInvalidArgument, "workspace has ", ws == nullptr ? 0 : bytes,
                " bytes; this call needs ", need,
                " (glu_bias_workspace_bytes / expert_bias_workspace_bytes)");
  if (reinterpret_cast<uintptr_t>(ws) % 256 != 0)
    return fail(Status::kInvalidArgument, "workspace is not 256-byte aligned");
  return Status::kOk;
}

ExpertRows expert_rows(const OffsetsRef& o, int64_t rows) {
  ExpertRows er;
  er.offsets = o.data;
  er.experts = o.size;
  er.chunk = bias_chunk_rows(rows);
  return er;
}

const char* x_name(Layout layout) { return layout == Layout::kSeparate ? "gate" : "gate_up"; }

// The overlap checks of an output against the bias and the offsets' int32 extent.
Status check_out_vs(const char* name, const MatrixRef& out, const MatrixRef& bias,
                    const OffsetsRef& o) {
  const Extent e = extent_of(out);
  EA_TRY(check_no_overlap(name, e, "bias", extent_of(bias)));
  Extent eo;
  eo.begin = reinterpret_cast<uintptr_t>(o.data);
  eo.end = eo.begin + static_cast<uintptr_t>(o.size) * 4;
  eo.stride = 4;
  eo.row_bytes = 4;
  eo.empty = o.size == 0;
  return check_no_overlap(name, e, "offsets", eo);
}

}  // namespace

Status glu_forward_bias_body(const GluParams& params, Layout layout, const MatrixRef& x,
                             const MatrixRef* up, const VectorRef* weights, const MatrixRef& bias,
                             const OffsetsRef& offsets, const MatrixRef& out, void* stream) {
  GluProblem p;
  FwdOutput o;
  EA_TRY(prepare_forward(params, layout, x, up, weights, out, p, o));
  const char* xname = x_name(layout);
  EA_TRY(check_offsets(offsets, p.rows, p.device, p.device_id, xname));
  EA_TRY(check_bias("bias", bias, offsets.size, 2 * p.F, p.dtype, p.device, p.device_id, xname));
  EA_TRY(check_out_vs("out", out, bias, offsets));
  if (p.rows == 0 || p.F == 0) return Status::kOk;
  GluBias b;
  b.er = expert_rows(offsets, p.rows);
  bias_pointers(layout, p, bias.data, b.bg, b.bu);
  b.b_stride = bias.row_stride;
  if (p.device == DeviceType::kCPU) return cpu_glu_bias_forward(p, b, o);
#if EXPERTACT_WITH_CUDA
  return cuda_glu_bias_forward(p, b, o, stream);
#else
  (void)stream;
  return no_cuda_path(layout);
#endif
}

Status glu_backward_bias_body(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                              const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                              const MatrixRef& bias, const OffsetsRef& offsets,
                              const MatrixRef& grad_x, const MatrixRef* grad_up,
                              const VectorRef* grad_weights, const MatrixRef* grad_bias,
                              void* workspace, size_t workspace_bytes, void* stream) {
  GluProblem p;
  BwdIO io;
  EA_TRY(prepare_backward(params, layout, grad_out, x, up, weights, grad_x, grad_up, grad_weights,
                          p, io));
  const char* xname = x_name(layout);
  EA_TRY(check_offsets(offsets, p.rows, p.device, p.device_id, xname));
  EA_TRY(check_bias("bias", bias, offsets.size, 2 * p.F, p.dtype, p.device, p.device_id, xname));
  const char* gxname = layout == Layout::kSeparate ? "grad_gate" : "grad_gate_up";
  EA_TRY(check_out_vs(gxname, grad_x, bias, offsets));
  if (grad_up) EA_TRY(check_out_vs("grad_up", *grad_up, bias, offsets));
  if (grad_bias) {
    EA_TRY(check_bias("grad_bias", *grad_bias, offsets.size, 2 * p.F, p.dtype, p.device,
                      p.device_id, xname));
    const Extent eb = extent_of(*grad_bias);
    EA_TRY(check_no_overlap("grad_bias", eb, "bias", extent_of(bias)));
    EA_TRY(check_no_overlap("grad_bias", eb, "grad_out", extent_of(grad_out)));
    EA_TRY(check_no_overlap("grad_bias", eb, xname, extent_of(x)));
    EA_TRY(check_no_overlap("grad_bias", eb, gxname, extent_of(grad_x)));
    if (up) EA_TRY(check_no_overlap("grad_bias", eb, "up", extent_of(*up)));
    if (grad_up) EA_TRY(check_no_overlap("grad_bias", eb, "grad_up", extent_of(*grad_up)));
    if (grad_weights) EA_TRY(check_no_overlap("grad_bias", eb, "grad_weights", extent_of(*grad_weights)));
  }
  if (grad_weights) EA_TRY(check_no_overlap("grad_weights", extent_of(*grad_weights), "bias", extent_of(bias)));
  const bool want_db = grad_bias != nullptr && p.F > 0;
  EA_TRY(check_workspace(workspace, workspace_bytes,
                         want_db || io.dw ? bias_workspace(p.rows, p.F, 2 * p.F, offsets.size) : 0,
                         p.device));
  GluBias b;
  b.er = expert_rows(offsets, p.rows);
  bias_pointers(layout, p, bias.data, b.bg, b.bu);
  b.b_stride = bias.row_stride;
  if (want_db) {
    const void *dg = nullptr, *du = nullptr;
    bias_pointers(layout, p, grad_bias->data, dg, du);
    b.dbg = const_cast<void*>(dg);
    b.dbu = const_cast<void*>(du);
    b.db_stride = grad_bias->row_stride;
  }
  b.ws = workspace;
  if (p.rows == 0 && !want_db) return Status::kOk;
  if (p.F == 0 && io.dw == nullptr) return Status::kOk;
  // No rows: the bias gradient is zero (the launchers then only zero it); F == 0: only the
  // weights' gradient, zero per row, as glu_backward gives it.
  if (p.F == 0) return glu_backward_body(params, layout, grad_out, x, up, weights, grad_x, grad_up,
                                         grad_weights, stream);
  if (p.device == DeviceType::kCPU) return cpu_glu_bias_backward(p, b, io);
#if EXPERTACT_WITH_CUDA
  return cuda_glu_bias_backward(p, b, io, stream);
#else
  (void)stream;
  return no_cuda_path(layout);
#endif
}

namespace {

// The checks shared by expert_bias's forward and backward; fills the problem's common part.
Status build_row_bias(const char* xname, const MatrixRef& x, const MatrixRef& bias,
                      const OffsetsRef& offsets, const VectorRef* weights, RowBias& p) {
  EA_TRY(check_matrix(xname, x));
  if (x.dtype == DType::kFloat64 && x.device != DeviceType::kCPU)
    return fail(Status::kUnsupported, xname, " is a float64 CUDA tensor: float64 is supported on the CPU only");
  p.dtype = x.dtype;
  p.device = x.device;
  p.device_id = x.device_id;
  p.rows = x.rows;
  p.cols = x.cols;
  EA_TRY(check_offsets(offsets, x.rows, x.device, x.device_id, xname));
  EA_TRY(check_bias("bias", bias, offsets.size, x.cols, x.dtype, x.device, x.device_id, xname));
  if (weights) {
    EA_TRY(check_vector("weights", *weights, x.rows));
    EA_TRY(check_same_device("weights", weights->device, weights->device_id, x.device,
                             x.device_id, xname));
    p.w = weights->data;
    p.w_stride = weights->stride;
  }
  p.er = expert_rows(offsets, x.rows);
  p.b = bias.data;
  p.b_stride = bias.row_stride;
  return Status::kOk;
}

}  // namespace

Status expert_bias_forward_body(const MatrixRef& x, const MatrixRef& bias, const OffsetsRef& offsets,
                                const VectorRef* weights, const MatrixRef& out, void* stream) {
  RowBias p;
  EA_TRY(build_row_bias("x", x, bias, offsets, weights, p));
  EA_TRY(check_matrix("out", out));
  EA_TRY(check_shape("out", out, x.rows, x.cols, x.dtype, "the output matches x"));
  EA_TRY(check_same_device("out", out.device, out.device_id, x.device, x.device_id, "x"));
  if (!same_view(out, x)) EA_TRY(check_no_overlap("out", extent_of(out), "x", extent_of(x)));
  EA_TRY(check_out_vs("out", out, bias, offsets));
  if (weights) EA_TRY(check_no_overlap("out", extent_of(out), "weights", extent_of(*weights)));
  if (p.rows == 0 || p.cols == 0) return Status::kOk;
  p.x = x.data;
  p.x_stride = x.row_stride;
  p.out = out.data;
  p.out_stride = out.row_stride;
  if (p.device == DeviceType::kCPU) return cpu_row_bias_forward(p);
#if EXPERTACT_WITH_CUDA
  return cuda_row_bias_forward(p, stream);
#else
  (void)stream;
  return fail(Status::kUnsupported, "x is a CUDA tensor but this expertact build has no CUDA path");
#endif
}

Status expert_bias_backward_body(const MatrixRef& grad_out, const MatrixRef& bias,
                                 const OffsetsRef& offsets, const VectorRef* weights,
                                 const MatrixRef* grad_bias, const VectorRef* grad_weights,
                                 void* workspace, size_t workspace_bytes, void* stream) {
  RowBias p;
  EA_TRY(build_row_bias("grad_out", grad_out, bias, offsets, weights, p));
  if (grad_weights) {
    if (weights == nullptr)
      return fail(Status::kInvalidArgument, "grad_weights is given but weights is null");
    EA_TRY(check_vector("grad_weights", *grad_weights, p.rows));
    EA_TRY(check_same_device("grad_weights", grad_weights->device, grad_weights->device_id,
                             p.device, p.device_id, "grad_out"));
    const Extent ew = extent_of(*grad_weights);
    EA_TRY(check_no_overlap("grad_weights", ew, "grad_out", extent_of(grad_out)));
    EA_TRY(check_no_overlap("grad_weights", ew, "bias", extent_of(bias)));
    EA_TRY(check_no_overlap("grad_weights", ew, "weights", extent_of(*weights)));
  }
  if (grad_bias) {
    EA_TRY(check_bias("grad_bias", *grad_bias, offsets.size, p.cols, p.dtype, p.device,
                      p.device_id, "grad_out"));
    const Extent eb = extent_of(*grad_bias);
    EA_TRY(check_no_overlap("grad_bias", eb, "grad_out", extent_of(grad_out)));
    EA_TRY(check_no_overlap("grad_bias", eb, "bias", extent_of(bias)));
    if (weights) EA_TRY(check_no_overlap("grad_bias", eb, "weights", extent_of(*weights)));
    if (grad_weights) EA_TRY(check_no_overlap("grad_bias", eb, "grad_weights", extent_of(*grad_weights)));
  }
  const bool want_db = grad_bias != nullptr && p.cols > 0;
  p.dw = grad_weights ? grad_weights->data : nullptr;
  p.dw_stride = grad_weights ? grad_weights->stride : 1;
  EA_TRY(check_workspace(workspace, workspace_bytes,
                         want_db || p.dw ? bias_workspace(p.rows, p.cols, p.cols, offsets.size) : 0,
                         p.device));
  if (!want_db && p.dw == nullptr) return Status::kOk;
  if (p.rows == 0 && !want_db) return Status::kOk;
  p.dy = grad_out.data;
  p.dy_stride = grad_out.row_stride;
  p.db = want_db ? grad_bias->data : nullptr;
  p.db_stride = want_db ? grad_bias->row_stride : 0;
  p.ws = workspace;
  if (p.device == DeviceType::kCPU) return cpu_row_bias_backward(p);
#if EXPERTACT_WITH_CUDA
  return cuda_row_bias_backward(p, stream);
#else
  (void)stream;
  return fail(Status::kUnsupported, "grad_out is a CUDA tensor but this expertact build has no CUDA path");
#endif
}

}  // namespace detail

Status glu_forward_bias(const GluParams& params, Layout layout, const MatrixRef& x,
                        const MatrixRef* up, const VectorRef* weights, const MatrixRef& bias,
                        const OffsetsRef& offsets, const MatrixRef& out, void* stream) {
  return detail::guarded("glu_forward_bias", [&] {
    return detail::glu_forward_bias_body(params, layout, x, up, weights, bias, offsets, out, stream);
  });
}

Status glu_backward_bias(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                         const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                         const MatrixRef& bias, const OffsetsRef& offsets,
                         const MatrixRef& grad_x, const MatrixRef* grad_up,
                         const VectorRef* grad_weights, const MatrixRef* grad_bias,
                         void* workspace, size_t workspace_bytes, void* stream) {
  return detail::guarded("glu_backward_bias", [&] {
    return detail::glu_backward_bias_body(params, layout, grad_out, x, up, weights, bias, offsets,
                                          grad_x, grad_up, grad_weights, grad_bias, workspace,
                                          workspace_bytes, stream);
  });
}

Status expert_bias_forward(const MatrixRef& x, const MatrixRef& bias, const OffsetsRef& offsets,
                           const VectorRef* weights, const MatrixRef& out, void* stream) {
  return detail::guarded("expert_bias_forward", [&] {
    return detail::expert_bias_forward_body(x, bias, offsets, weights, out, stream);
  });
}

Status expert_bias_backward(const MatrixRef& grad_out, const MatrixRef& bias,
                            const OffsetsRef& offsets, const VectorRef* weights,
                            const MatrixRef* grad_bias, const VectorRef* grad_weights,
                            void* workspace, size_t workspace_bytes, void* stream) {
  return detail::guarded("expert_bias_backward", [&] {
    return detail::expert_bias_backward_body(grad_out, bias, offsets, weights, grad_bias,
                                             grad_weights, workspace, workspace_bytes, stream);
  });
}

}  // namespace expertact
