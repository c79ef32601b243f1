// The activation's entry points: every argument is checked here, once, with a message
// that names it and its value; then the call is normalised into a GluProblem (gate and
// up pointers, strides, element step) and sent to the CPU or CUDA launcher. The public
// C++ functions wrap these bodies in the exception guard (core/error.h).
#include <cmath>
#include <cstdint>

#include "api.h"
#include "core/checks.h"
#include "core/error.h"
#include "core/problem.h"
#include "cpu/parallel.h"
#include "expertact/expertact.hpp"

namespace expertact {

GluParams preset_swiglu() { return GluParams{}; }
GluParams preset_swiglu_clamped(float limit) {
  GluParams p;
  p.limit = limit;
  return p;
}
GluParams preset_swiglu_oai(float alpha, float limit) {
  GluParams p;
  p.alpha = alpha;
  p.limit = limit;
  p.beta = 1.0f;
  return p;
}
GluParams preset_geglu_tanh() {
  GluParams p;
  p.act = Activation::kGeluTanh;
  return p;
}

bool has_cuda() { return EXPERTACT_WITH_CUDA != 0; }
int cpu_threads() { return cpu::threads(); }
void set_cpu_threads(int n) { cpu::set_threads(n); }

namespace detail {

namespace {

// float64 exists for gradient checking on the CPU; no kernel computes it on a GPU.
Status check_float64_device(const GluProblem& p, const char* xname) {
  if (p.dtype == DType::kFloat64 && p.device != DeviceType::kCPU)
    return fail(Status::kUnsupported, xname,
                " is a float64 CUDA tensor: float64 is supported on the CPU only "
                "(for gradient checking); use float32, float16 or bfloat16 on the GPU");
  return Status::kOk;
}

}  // namespace

#if !EXPERTACT_WITH_CUDA
Status no_cuda_path(Layout layout) {
  return fail(Status::kUnsupported, layout == Layout::kSeparate ? "gate" : "gate_up",
              " is a CUDA tensor but this expertact build has no CUDA path");
}
#endif

namespace {

// Validates the inputs shared by forward and backward and fills the problem.
Status build_problem(const GluParams& params, Layout layout, const MatrixRef& x,
                     const MatrixRef* up, const VectorRef* weights, GluProblem& p) {
  EA_TRY(check_params(params));
  if (layout != Layout::kSeparate && layout != Layout::kHalves &&
      layout != Layout::kHalvesUpFirst && layout != Layout::kInterleaved)
    return fail(Status::kInvalidArgument, "layout ", static_cast<int>(layout),
                " is not one of 0 (separate), 1 (halves), 2 (halves_up_first), 3 (interleaved)");
  const bool separate = layout == Layout::kSeparate;
  const char* xname = separate ? "gate" : "gate_up";
  EA_TRY(check_matrix(xname, x));
  p.params = params;
  p.has_limit = std::isfinite(params.limit);
  p.dtype = x.dtype;
  p.device = x.device;
  p.device_id = x.device_id;
  p.rows = x.rows;
  const int64_t es = dtype_size(x.dtype);
  if (separate) {
    if (up == nullptr)
      return fail(Status::kInvalidArgument, "up is missing: the separate layout takes gate and up");
    EA_TRY(check_matrix("up", *up));
    EA_TRY(check_shape("up", *up, x.rows, x.cols, x.dtype, "up must match gate"));
    EA_TRY(check_same_device("up", up->device, up->device_id, x.device, x.device_id, "gate"));
    p.F = x.cols;
    p.step = 1;
    p.g = x.data;
    p.g_stride = x.row_stride;
    p.u = up->data;
    p.u_stride = up->row_stride;
  } else {
    if (up != nullptr)
      return fail(Status::kInvalidArgument, "up must be null for the packed layout ", layout,
                  " (gate_up holds both halves)");
    if (x.cols % 2 != 0)
      return fail(Status::kInvalidArgument, "gate_up's last dimension is ", x.cols,
                  ", which is odd: a packed ", layout, " tensor holds 2 * F columns");
    p.F = x.cols / 2;
    p.packed = true;
    p.g_stride = p.u_stride = x.row_stride;
    const char* base = static_cast<const char*>(x.data);
    if (layout == Layout::kInterleaved) {
      p.step = 2;
      p.g = base;
      p.u = base ? base + es : nullptr;
    } else {
      p.step = 1;
      const char* second = base ? base + p.F * es : nullptr;
      p.g = layout == Layout::kHalves ? base : second;
      p.u = layout == Layout::kHalves ? second : base;
    }
  }
  if (weights != nullptr) {
    EA_TRY(check_vector("weights", *weights, x.rows));
    EA_TRY(check_same_device("weights", weights->device, weights->device_id, x.device,
                             x.device_id, xname));
    p.w = weights->data;
    p.w_stride = weights->stride;
  }
  return Status::kOk;
}

// Points the gradient views at their gate and up parts, mirroring build_problem.
void gradient_pointers(Layout layout, const GluProblem& p, const MatrixRef& grad_x,
                       const MatrixRef* grad_up, BwdIO& io) {
  const int64_t es = dtype_size(p.dtype);
  char* base = static_cast<char*>(grad_x.data);
  io.dg_stride = io.du_stride = grad_x.row_stride;
  switch (layout) {
    case Layout::kSeparate:
      io.dg = base;
      io.du = grad_up->data;
      io.du_stride = grad_up->row_stride;
      break;
    case Layout::kHalves:
      io.dg = base;
      io.du = base + p.F * es;
      break;
    case Layout::kHalvesUpFirst:
      io.dg = base + p.F * es;
      io.du = base;
      break;
    case Layout::kInterleaved:
      io.dg = base;
      io.du = base + es;
      break;
  }
}

}  // namespace

Status prepare_inputs(const GluParams& params, Layout layout, const MatrixRef& x,
                      const MatrixRef* up, const VectorRef* weights, GluProblem& p) {
  EA_TRY(build_problem(params, layout, x, up, weights, p));
  return check_float64_device(p, layout == Layout::kSeparate ? "gate" : "gate_up");
}

Status prepare_forward(const GluParams& params, Layout layout, const MatrixRef& x,
                       const MatrixRef* up, const VectorRef* weights, const MatrixRef& out,
                       GluProblem& p, FwdOutput& o) {
  EA_TRY(build_problem(params, layout, x, up, weights, p));
  EA_TRY(check_matrix("out", out));
  EA_TRY(check_shape("out", out, p.rows, p.F, p.dtype, "the output is [rows, F] of the input's dtype"));
  const char* xname = layout == Layout::kSeparate ? "gate" : "gate_up";
  EA_TRY(check_same_device("out", out.device, out.device_id, p.device, p.device_id, xname));
  const Extent eo = extent_of(out);
  EA_TRY(check_no_overlap("out", eo, xname, extent_of(x)));
  if (up) EA_TRY(check_no_overlap("out", eo, "up", extent_of(*up)));
  if (weights) EA_TRY(check_no_overlap("out", eo, "weights", extent_of(*weights)));
  EA_TRY(check_float64_device(p, xname));
  o = FwdOutput{out.data, out.row_stride};
  return Status::kOk;
}

Status glu_forward_body(const GluParams& params, Layout layout, const MatrixRef& x,
                        const MatrixRef* up, const VectorRef* weights, const MatrixRef& out,
                        void* stream) {
  GluProblem p;
  FwdOutput o;
  EA_TRY(prepare_forward(params, layout, x, up, weights, out, p, o));
  if (p.rows == 0 || p.F == 0) return Status::kOk;
  if (p.dtype == DType::kFloat64) return cpu_forward_f64(p, o);
  if (p.device == DeviceType::kCPU) return cpu_forward(p, o);
#if EXPERTACT_WITH_CUDA
  return cuda_forward(p, o, stream);
#else
  (void)stream;
  return no_cuda_path(layout);
#endif
}

Status prepare_backward(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                        const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                        const MatrixRef& grad_x, const MatrixRef* grad_up,
                        const VectorRef* grad_weights, GluProblem& p, BwdIO& io) {
  EA_TRY(build_problem(params, layout, x, up, weights, p));
  const bool separate = layout == Layout::kSeparate;
  const char* xname = separate ? "gate" : "gate_up";
  const char* gxname = separate ? "grad_gate" : "grad_gate_up";
  const MatrixRef& dy = grad_out;
  EA_TRY(check_matrix("grad_out", dy));
  EA_TRY(check_shape("grad_out", dy, p.rows, p.F, p.dtype, "grad_out is [rows, F] like the output"));
  EA_TRY(check_same_device("grad_out", dy.device, dy.device_id, p.device, p.device_id, xname));
  const MatrixRef& gx = grad_x;
  EA_TRY(check_matrix(gxname, gx));
  EA_TRY(check_shape(gxname, gx, x.rows, x.cols, p.dtype, "a gradient matches its input"));
  EA_TRY(check_same_device(gxname, gx.device, gx.device_id, p.device, p.device_id, xname));
  if (separate) {
    if (grad_up == nullptr)
      return fail(Status::kInvalidArgument, "grad_up is missing: the separate layout returns two gradients");
    EA_TRY(check_matrix("grad_up", *grad_up));
    EA_TRY(check_shape("grad_up", *grad_up, p.rows, p.F, p.dtype, "a gradient matches its input"));
    EA_TRY(check_same_device("grad_up", grad_up->device, grad_up->device_id, p.device,
                             p.device_id, xname));
  } else if (grad_up != nullptr) {
    return fail(Status::kInvalidArgument,
                "grad_up must be null for a packed layout (grad_gate_up holds both halves)");
  }
  if (grad_weights != nullptr) {
    if (weights == nullptr)
      return fail(Status::kInvalidArgument, "grad_weights is given but weights is null");
    EA_TRY(check_vector("grad_weights", *grad_weights, p.rows));
    EA_TRY(check_same_device("grad_weights", grad_weights->device, grad_weights->device_id,
                             p.device, p.device_id, xname));
  }

  // Aliasing: a gradient may be its own input (in-place); nothing else may overlap.
  const Extent e_dy = extent_of(dy), e_x = extent_of(x);
  const Extent e_up = up ? extent_of(*up) : Extent{};
  const Extent e_w = weights ? extent_of(*weights) : Extent{};
  const Extent e_gx = extent_of(gx);
  const Extent e_gu = grad_up ? extent_of(*grad_up) : Extent{};
  const Extent e_gw = grad_weights ? extent_of(*grad_weights) : Extent{};
  const bool gx_inplace = same_view(gx, x);
  const bool gu_inplace = separate && same_view(*grad_up, *up);
  EA_TRY(check_no_overlap(gxname, e_gx, "grad_out", e_dy));
  if (!gx_inplace) EA_TRY(check_no_overlap(gxname, e_gx, xname, e_x));
  EA_TRY(check_no_overlap(gxname, e_gx, "weights", e_w));
  EA_TRY(check_no_overlap(gxname, e_gx, "grad_weights", e_gw));
  if (separate) {
    // Also covers both in place (grad_gate = gate): gate and up, both
    // overwritten then, may not overlap each other.
    EA_TRY(check_no_overlap(gxname, e_gx, "up", e_up));
    EA_TRY(check_no_overlap("grad_up", e_gu, "grad_out", e_dy));
    EA_TRY(check_no_overlap("grad_up", e_gu, "gate", e_x));
    if (!gu_inplace) EA_TRY(check_no_overlap("grad_up", e_gu, "up", e_up));
    EA_TRY(check_no_overlap("grad_up", e_gu, gxname, e_gx));
    EA_TRY(check_no_overlap("grad_up", e_gu, "weights", e_w));
    EA_TRY(check_no_overlap("grad_up", e_gu, "grad_weights", e_gw));
  }
  EA_TRY(check_no_overlap("grad_weights", e_gw, "grad_out", e_dy));
  EA_TRY(check_no_overlap("grad_weights", e_gw, xname, e_x));
  EA_TRY(check_no_overlap("grad_weights", e_gw, "up", e_up));
  EA_TRY(check_no_overlap("grad_weights", e_gw, "weights", e_w));

  EA_TRY(check_float64_device(p, xname));
  io.dy = dy.data;
  io.dy_stride = dy.row_stride;
  gradient_pointers(layout, p, gx, grad_up, io);
  if (grad_weights != nullptr) {
    io.dw = grad_weights->data;
    io.dw_stride = grad_weights->stride;
  }
  return Status::kOk;
}

Status glu_backward_body(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                         const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                         const MatrixRef& grad_x, const MatrixRef* grad_up,
                         const VectorRef* grad_weights, void* stream) {
  GluProblem p;
  BwdIO io;
  EA_TRY(prepare_backward(params, layout, grad_out, x, up, weights, grad_x, grad_up, grad_weights,
                          p, io));
  if (p.rows == 0) return Status::kOk;
  // No columns and no weight gradient: nothing to compute. (With a weight gradient the
  // launcher zeroes it: a sum over an empty row.)
  if (p.F == 0 && io.dw == nullptr) return Status::kOk;
  if (p.dtype == DType::kFloat64) return cpu_backward_f64(p, io);
  if (p.device == DeviceType::kCPU) return cpu_backward(p, io);
#if EXPERTACT_WITH_CUDA
  return cuda_backward(p, io, stream);
#else
  (void)stream;
  return no_cuda_path(layout);
#endif
}

}  // namespace detail

Status glu_forward(const GluParams& params, Layout layout, const MatrixRef& x,
                   const MatrixRef* up, const VectorRef* weights, const MatrixRef& out,
                   void* stream) {
  return detail::guarded("glu_forward", [&] {
    return detail::glu_forward_body(params, layout, x, up, weights, out, stream);
  });
}

Status glu_backward(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                    const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                    const MatrixRef& grad_x, const MatrixRef* grad_up,
                    const VectorRef* grad_weights, void* stream) {
  return detail::guarded("glu_backward", [&] {
    return detail::glu_backward_body(params, layout, grad_out, x, up, weights, grad_x, grad_up,
                                     grad_weights, stream);
  });
}

}  // namespace expertact
