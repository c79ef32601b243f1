// The C++ API boundary: every argument is checked here, once, with a message
// that names it and its value; then the call is normalised into a GluProblem
// (gate and up pointers, strides, element step) and sent to the CPU or CUDA
// launcher. Nothing thrown below escapes: it becomes kInternal.
#include <cmath>
#include <cstdint>
#include <exception>
#include <new>

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

// The checks below are shared with the fused grouped GEMMs' boundary (src/api_moe.cpp)
// through core/checks.h.
int64_t dtype_size(DType d) { return d == DType::kFloat64 ? 8 : d == DType::kFloat32 ? 4 : 2; }

bool valid_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16 ||
         d == DType::kFloat64;
}

Status check_params(const GluParams& p) {
  if (p.act != Activation::kSilu && p.act != Activation::kGeluTanh)
    return fail(Status::kInvalidArgument, "params.act must be 0 (silu) or 1 (gelu_tanh) (got ",
                static_cast<int>(p.act), ")");
  if (!std::isfinite(p.alpha))
    return fail(Status::kInvalidArgument, "params.alpha must be finite (got ", p.alpha, ")");
  if (std::isnan(p.limit) || !(p.limit > 0.0f))
    return fail(Status::kInvalidArgument, "params.limit must be > 0 or +inf (got ", p.limit, ")");
  if (!std::isfinite(p.beta))
    return fail(Status::kInvalidArgument, "params.beta must be finite (got ", p.beta, ")");
  return Status::kOk;
}

// Shape, dtype, device, stride and alignment of one matrix operand.
Status check_matrix(const char* name, const MatrixRef& m) {
  if (!valid_dtype(m.dtype))
    return fail(Status::kInvalidDtype, name, ".dtype ", static_cast<int>(m.dtype),
                " is not supported (expected float32, float16 or bfloat16; float64 on the CPU)");
  if (m.device != DeviceType::kCPU && m.device != DeviceType::kCUDA)
    return fail(Status::kInvalidArgument, name, ".device ", static_cast<int>(m.device),
                " is not supported (expected cpu or cuda)");
  if (m.rows < 0 || m.cols < 0)
    return fail(Status::kInvalidArgument, name, " has a negative size: [", m.rows, ", ", m.cols,
                "]");
  if (m.rows == 0 || m.cols == 0) return Status::kOk;  // empty: never read or written
  if (m.data == nullptr)
    return fail(Status::kInvalidArgument, name, ".data is null for a non-empty [", m.rows, ", ",
                m.cols, "] tensor");
  if (m.rows > 1 && m.row_stride < m.cols)
    return fail(Status::kInvalidArgument, name, ".row_stride ", m.row_stride,
                " is smaller than its row length ", m.cols,
                " (rows would overlap; expected a row-strided view)");
  const int64_t esize = dtype_size(m.dtype);
  if (reinterpret_cast<uintptr_t>(m.data) % esize != 0)
    return fail(Status::kInvalidArgument, name, ".data ", static_cast<const void*>(m.data),
                " is not aligned to its ", esize, "-byte ", m.dtype, " element");
  // The last element's offset must fit in int64 (it is computed in 64 bits).
  const double last = static_cast<double>(m.rows - 1) * static_cast<double>(m.row_stride) +
                      static_cast<double>(m.cols);
  if (last * esize > 9.0e18)
    return fail(Status::kInvalidArgument, name, " spans more than 2^63 bytes ([", m.rows, ", ",
                m.cols, "], row_stride ", m.row_stride, ")");
  return Status::kOk;
}

Status check_vector(const char* name, const VectorRef& v, int64_t rows) {
  if (v.device != DeviceType::kCPU && v.device != DeviceType::kCUDA)
    return fail(Status::kInvalidArgument, name, ".device ", static_cast<int>(v.device),
                " is not supported (expected cpu or cuda)");
  if (v.size != rows)
    return fail(Status::kInvalidArgument, name, " has ", v.size,
                " elements but there are ", rows, " rows (one float32 weight per row)");
  if (rows == 0) return Status::kOk;
  if (v.data == nullptr) return fail(Status::kInvalidArgument, name, ".data is null");
  if (rows > 1 && v.stride == 0)
    return fail(Status::kInvalidArgument, name, ".stride is 0 (expected one element per row)");
  if (reinterpret_cast<uintptr_t>(v.data) % 4 != 0)
    return fail(Status::kInvalidArgument, name, ".data ", static_cast<const void*>(v.data),
                " is not aligned to its 4-byte float32 element");
  return Status::kOk;
}

Status check_same_device(const char* name, DeviceType d, int32_t id, DeviceType ref_d,
                         int32_t ref_id, const char* ref_name) {
  if (d != ref_d || (d == DeviceType::kCUDA && id != ref_id)) {
    return fail(Status::kInvalidArgument, name, " is on ", d,
                d == DeviceType::kCUDA ? ":" + std::to_string(id) : std::string(), " but ",
                ref_name, " is on ", ref_d,
                ref_d == DeviceType::kCUDA ? ":" + std::to_string(ref_id) : std::string(),
                " (all tensors must be on one device)");
  }
  return Status::kOk;
}

Status check_shape(const char* name, const MatrixRef& m, int64_t rows, int64_t cols,
                   DType dtype, const char* why) {
  if (m.rows != rows || m.cols != cols)
    return fail(Status::kInvalidArgument, name, " has shape [", m.rows, ", ", m.cols,
                "] but [", rows, ", ", cols, "] is expected (", why, ")");
  if (m.dtype != dtype)
    return fail(Status::kInvalidDtype, name, ".dtype is ", m.dtype, " but ", dtype,
                " is expected (", why, ")");
  return Status::kOk;
}

Extent extent_of(const MatrixRef& m) {
  Extent e;
  if (m.rows == 0 || m.cols == 0) return e;
  const int64_t es = dtype_size(m.dtype);
  e.begin = reinterpret_cast<uintptr_t>(m.data);
  e.end = e.begin + static_cast<uintptr_t>(((m.rows - 1) * m.row_stride + m.cols) * es);
  e.stride = m.rows > 1 ? m.row_stride * es : 0;
  e.row_bytes = m.cols * es;
  e.empty = false;
  return e;
}

Extent extent_of(const VectorRef& v) {
  Extent e;
  if (v.size == 0) return e;
  e.begin = reinterpret_cast<uintptr_t>(v.data);
  const int64_t s = v.stride < 0 ? -v.stride : v.stride;
  if (v.stride < 0) e.begin -= static_cast<uintptr_t>((v.size - 1) * s * 4);
  e.end = e.begin + static_cast<uintptr_t>(((v.size - 1) * s + 1) * 4);
  e.stride = 0;  // treated as one contiguous block
  e.row_bytes = static_cast<int64_t>(e.end - e.begin);
  e.empty = false;
  return e;
}

// Whether two views may share a byte. Exact for views of one row stride
// (e.g. gate = buf[:, :F] and up = buf[:, F:] do not overlap); otherwise by
// byte range, which may refuse an exotic disjoint pair but never accepts an
// overlapping one.
bool may_overlap(const Extent& a, const Extent& b) {
  if (a.empty || b.empty) return false;
  if (a.end <= b.begin || b.end <= a.begin) return false;
  if (a.stride > 0 && a.stride == b.stride && a.row_bytes <= a.stride &&
      b.row_bytes <= b.stride) {
    const int64_t S = a.stride;
    const int64_t d = static_cast<int64_t>((b.begin - a.begin) % static_cast<uintptr_t>(S));
    const int64_t delta = b.begin >= a.begin ? d : (S - static_cast<int64_t>(
                                                          (a.begin - b.begin) % S)) % S;
    // a covers [0, a.row_bytes) of each stride period, b covers [delta, delta + b.row_bytes).
    if (a.row_bytes <= delta && delta + b.row_bytes <= S) return false;
  }
  return true;
}

bool same_view(const MatrixRef& a, const MatrixRef& b) {
  return a.data == b.data && a.row_stride == b.row_stride && a.rows == b.rows &&
         a.cols == b.cols && a.dtype == b.dtype;
}

Status check_no_overlap(const char* out_name, const Extent& out, const char* in_name,
                        const Extent& in) {
  if (may_overlap(out, in))
    return fail(Status::kInvalidArgument, out_name, " overlaps ", in_name,
                " (outputs may not share memory with other operands; an in-place backward "
                "passes the input itself, same pointer and strides, as its gradient)");
  return Status::kOk;
}

Status run_guarded(const char* what, Status (*body)(const void*), const void* ctx) {
  try {
    return body(ctx);
  } catch (const std::bad_alloc&) {
    return fail(Status::kInternal, what, ": out of host memory");
  } catch (const std::exception& e) {
    return fail(Status::kInternal, what, ": ", e.what());
  } catch (...) {
    return fail(Status::kInternal, what, ": unknown exception");
  }
}

namespace {

// float64 exists for gradient checking on the CPU; no kernel computes it on a GPU.
Status check_float64_device(const GluProblem& p, const char* xname) {
  if (p.dtype == DType::kFloat64 && p.device != DeviceType::kCPU)
    return fail(Status::kUnsupported, xname,
                " is a float64 CUDA tensor: float64 is supported on the CPU only "
                "(for gradient checking); use float32, float16 or bfloat16 on the GPU");
  return Status::kOk;
}

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

struct FwdCall {
  const GluParams* params;
  Layout layout;
  const MatrixRef* x;
  const MatrixRef* up;
  const VectorRef* weights;
  const MatrixRef* out;
  void* stream;
};

Status forward_body(const void* ctx) {
  const FwdCall& c = *static_cast<const FwdCall*>(ctx);
  GluProblem p;
  EA_TRY(build_problem(*c.params, c.layout, *c.x, c.up, c.weights, p));
  const MatrixRef& out = *c.out;
  EA_TRY(check_matrix("out", out));
  EA_TRY(check_shape("out", out, p.rows, p.F, p.dtype, "the output is [rows, F] of the input's dtype"));
  const char* xname = c.layout == Layout::kSeparate ? "gate" : "gate_up";
  EA_TRY(check_same_device("out", out.device, out.device_id, p.device, p.device_id, xname));
  const Extent eo = extent_of(out);
  EA_TRY(check_no_overlap("out", eo, xname, extent_of(*c.x)));
  if (c.up) EA_TRY(check_no_overlap("out", eo, "up", extent_of(*c.up)));
  if (c.weights) EA_TRY(check_no_overlap("out", eo, "weights", extent_of(*c.weights)));
  EA_TRY(check_float64_device(p, xname));
  if (p.rows == 0 || p.F == 0) return Status::kOk;
  FwdOutput o{out.data, out.row_stride};
  if (p.dtype == DType::kFloat64) return cpu_forward_f64(p, o);
  if (p.device == DeviceType::kCPU) return cpu_forward(p, o);
#if EXPERTACT_WITH_CUDA
  return cuda_forward(p, o, c.stream);
#else
  return fail(Status::kUnsupported, xname,
              " is a CUDA tensor but this expertact build has no CUDA path");
#endif
}

struct BwdCall {
  const GluParams* params;
  Layout layout;
  const MatrixRef* grad_out;
  const MatrixRef* x;
  const MatrixRef* up;
  const VectorRef* weights;
  const MatrixRef* grad_x;
  const MatrixRef* grad_up;
  const VectorRef* grad_weights;
  void* stream;
};

Status backward_body(const void* ctx) {
  const BwdCall& c = *static_cast<const BwdCall*>(ctx);
  GluProblem p;
  EA_TRY(build_problem(*c.params, c.layout, *c.x, c.up, c.weights, p));
  const bool separate = c.layout == Layout::kSeparate;
  const char* xname = separate ? "gate" : "gate_up";
  const char* gxname = separate ? "grad_gate" : "grad_gate_up";
  const MatrixRef& dy = *c.grad_out;
  EA_TRY(check_matrix("grad_out", dy));
  EA_TRY(check_shape("grad_out", dy, p.rows, p.F, p.dtype, "grad_out is [rows, F] like the output"));
  EA_TRY(check_same_device("grad_out", dy.device, dy.device_id, p.device, p.device_id, xname));
  const MatrixRef& gx = *c.grad_x;
  EA_TRY(check_matrix(gxname, gx));
  EA_TRY(check_shape(gxname, gx, c.x->rows, c.x->cols, p.dtype, "a gradient matches its input"));
  EA_TRY(check_same_device(gxname, gx.device, gx.device_id, p.device, p.device_id, xname));
  if (separate) {
    if (c.grad_up == nullptr)
      return fail(Status::kInvalidArgument, "grad_up is missing: the separate layout returns two gradients");
    EA_TRY(check_matrix("grad_up", *c.grad_up));
    EA_TRY(check_shape("grad_up", *c.grad_up, p.rows, p.F, p.dtype, "a gradient matches its input"));
    EA_TRY(check_same_device("grad_up", c.grad_up->device, c.grad_up->device_id, p.device,
                             p.device_id, xname));
  } else if (c.grad_up != nullptr) {
    return fail(Status::kInvalidArgument,
                "grad_up must be null for a packed layout (grad_gate_up holds both halves)");
  }
  if (c.grad_weights != nullptr) {
    if (c.weights == nullptr)
      return fail(Status::kInvalidArgument, "grad_weights is given but weights is null");
    EA_TRY(check_vector("grad_weights", *c.grad_weights, p.rows));
    EA_TRY(check_same_device("grad_weights", c.grad_weights->device, c.grad_weights->device_id,
                             p.device, p.device_id, xname));
  }

  // Aliasing: a gradient may be its own input (in-place); nothing else may overlap.
  const Extent e_dy = extent_of(dy), e_x = extent_of(*c.x);
  const Extent e_up = c.up ? extent_of(*c.up) : Extent{};
  const Extent e_w = c.weights ? extent_of(*c.weights) : Extent{};
  const Extent e_gx = extent_of(gx);
  const Extent e_gu = c.grad_up ? extent_of(*c.grad_up) : Extent{};
  const Extent e_gw = c.grad_weights ? extent_of(*c.grad_weights) : Extent{};
  const bool gx_inplace = same_view(gx, *c.x);
  const bool gu_inplace = separate && same_view(*c.grad_up, *c.up);
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
  if (p.rows == 0) return Status::kOk;
  BwdIO io;
  io.dy = dy.data;
  io.dy_stride = dy.row_stride;
  gradient_pointers(c.layout, p, gx, c.grad_up, io);
  if (c.grad_weights != nullptr) {
    io.dw = c.grad_weights->data;
    io.dw_stride = c.grad_weights->stride;
  }
  if (p.F == 0) {
    // No elements, but the weight gradient is a sum over an empty row: zero.
    if (io.dw == nullptr) return Status::kOk;
    if (p.device == DeviceType::kCPU) {
      for (int64_t r = 0; r < p.rows; ++r) io.dw[r * io.dw_stride] = 0.0f;
      return Status::kOk;
    }
#if EXPERTACT_WITH_CUDA
    return cuda_fill_zero(p, io.dw, p.rows, io.dw_stride, c.stream);
#endif
  }
  if (p.dtype == DType::kFloat64) return cpu_backward_f64(p, io);
  if (p.device == DeviceType::kCPU) return cpu_backward(p, io);
#if EXPERTACT_WITH_CUDA
  return cuda_backward(p, io, c.stream);
#else
  return fail(Status::kUnsupported, xname,
              " is a CUDA tensor but this expertact build has no CUDA path");
#endif
}

}  // namespace
}  // namespace detail

Status glu_forward(const GluParams& params, Layout layout, const MatrixRef& x,
                   const MatrixRef* up, const VectorRef* weights, const MatrixRef& out,
                   void* stream) {
  detail::clear_error();
  detail::FwdCall c{&params, layout, &x, up, weights, &out, stream};
  return detail::run_guarded("glu_forward", detail::forward_body, &c);
}

Status glu_backward(const GluParams& params, Layout layout, const MatrixRef& grad_out,
                    const MatrixRef& x, const MatrixRef* up, const VectorRef* weights,
                    const MatrixRef& grad_x, const MatrixRef* grad_up,
                    const VectorRef* grad_weights, void* stream) {
  detail::clear_error();
  detail::BwdCall c{&params, layout, &grad_out, &x, up, weights, &grad_x, grad_up, grad_weights,
                    stream};
  return detail::run_guarded("glu_backward", detail::backward_body, &c);
}

}  // namespace expertact
