// The C ABI: expertact_tensor descriptions -> MatrixRef / VectorRef / OffsetsRef, then the
// bodies behind the C++ API (src/api.h); the DLTensor -> expertact_tensor helpers. Each entry
// point runs inside the exception guard (core/error.h): the status is returned and the
// message kept for expertact_last_error().
#include "expertact/expertact_c.h"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "api.h"
#include "core/error.h"
#include "expertact/expertact.hpp"

// The C codes are the C++ enums' values: the conversions below cast one to the other.
namespace {
using expertact::Activation;
using expertact::Layout;
using expertact::Status;
constexpr int code(Status s) { return static_cast<int>(s); }
constexpr int code(Layout l) { return static_cast<int>(l); }
constexpr int code(Activation a) { return static_cast<int>(a); }
static_assert(EXPERTACT_OK == code(Status::kOk));
static_assert(EXPERTACT_INVALID_ARGUMENT == code(Status::kInvalidArgument));
static_assert(EXPERTACT_UNSUPPORTED == code(Status::kUnsupported));
static_assert(EXPERTACT_CUDA_ERROR == code(Status::kCudaError));
static_assert(EXPERTACT_INTERNAL == code(Status::kInternal));
static_assert(EXPERTACT_INVALID_DTYPE == code(Status::kInvalidDtype));
static_assert(EXPERTACT_LAYOUT_SEPARATE == code(Layout::kSeparate));
static_assert(EXPERTACT_LAYOUT_HALVES == code(Layout::kHalves));
static_assert(EXPERTACT_LAYOUT_HALVES_UP_FIRST == code(Layout::kHalvesUpFirst));
static_assert(EXPERTACT_LAYOUT_INTERLEAVED == code(Layout::kInterleaved));
static_assert(EXPERTACT_ACT_SILU == code(Activation::kSilu));
static_assert(EXPERTACT_ACT_GELU_TANH == code(Activation::kGeluTanh));
// expertact_status and the params' act field carry the enums' underlying type.
static_assert(sizeof(expertact_status) == sizeof(Status));
static_assert(sizeof(expertact_params::act) == sizeof(Activation));
}  // namespace

namespace expertact::detail {
namespace {

Status to_dtype(const char* name, const DLDataType& t, DType& out) {
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 32) {
    out = DType::kFloat32;
  } else if (t.lanes == 1 && t.code == kDLFloat && t.bits == 16) {
    out = DType::kFloat16;
  } else if (t.lanes == 1 && t.code == kDLBfloat && t.bits == 16) {
    out = DType::kBFloat16;
  } else if (t.lanes == 1 && t.code == kDLFloat && t.bits == 64) {
    out = DType::kFloat64;
  } else if (t.lanes == 1 && t.code == EXPERTACT_DL_FLOAT8_E4M3FN && t.bits == 8) {
    out = DType::kFloat8E4M3;  // the FP8 outputs only (the other entry points refuse it)
  } else {
    return fail(Status::kInvalidDtype, name, " has unsupported DLPack dtype (code ",
                static_cast<int>(t.code), ", bits ", static_cast<int>(t.bits), ", lanes ",
                static_cast<int>(t.lanes), "); expected float32, float16 or bfloat16 (float64 on the CPU)");
  }
  return Status::kOk;
}

Status to_device(const char* name, const DLDevice& d, DeviceType& type, int32_t& id) {
  switch (d.device_type) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory: the CPU reads it directly
      type = DeviceType::kCPU;
      id = 0;
      return Status::kOk;
    case kDLCUDA:
      type = DeviceType::kCUDA;
      id = d.device_id;
      return Status::kOk;
    default:
      return fail(Status::kInvalidArgument, name, " is on DLPack device type ",
                  static_cast<int>(d.device_type), " (id ", d.device_id,
                  "); expected cpu (1) or cuda (2)");
  }
}

std::string shape_str(const DLTensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

std::string strides_str(const DLTensor& t) {
  if (t.strides == nullptr) return "compact";
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.strides[i]);
  return s + ")";
}

// What both helpers check and copy: a DLTensor with a shape and no negative dimension; its
// data pointer (byte_offset included), dtype and device.
Status dlpack_common(const char* what, const DLTensor* t, expertact_tensor* out) {
  if (t == nullptr) return fail(Status::kInvalidArgument, what, ": the DLTensor is null");
  if (out == nullptr) return fail(Status::kInvalidArgument, what, ": out is null");
  if (t->ndim < 0 || (t->ndim > 0 && t->shape == nullptr))
    return fail(Status::kInvalidArgument, what, ": the DLTensor has ndim ", t->ndim, " and shape null");
  for (int i = 0; i < t->ndim; ++i)
    if (t->shape[i] < 0)
      return fail(Status::kInvalidArgument, what, ": the DLTensor has a negative dimension: shape ",
                  shape_str(*t));
  out->data = t->data == nullptr ? nullptr : static_cast<char*>(t->data) + t->byte_offset;
  out->dtype = t->dtype;
  out->device = t->device;
  return Status::kOk;
}

// [..., C] with the last dimension contiguous and the leading ones collapsible into one row
// stride -> [rows, C].
Status dlpack_matrix(const DLTensor* t, expertact_tensor* out) {
  constexpr const char* what = "expertact_tensor_from_dlpack";
  EA_TRY(dlpack_common(what, t, out));
  if (t->ndim < 1)
    return fail(Status::kInvalidArgument, what,
                ": the DLTensor is 0-dimensional; expected [..., features] with at least one dimension");
  const int nd = t->ndim;
  int64_t rows = 1;
  for (int i = 0; i < nd - 1; ++i) rows *= t->shape[i];
  const int64_t cols = t->shape[nd - 1];
  out->rows = rows;
  out->cols = cols;
  out->row_stride = cols;
  if (rows == 0 || cols == 0 || t->strides == nullptr) return Status::kOk;
  if (cols > 1 && t->strides[nd - 1] != 1)
    return fail(Status::kInvalidArgument, what, ": the DLTensor has shape ", shape_str(*t), " and strides ",
                strides_str(*t), ": the last dimension must be contiguous (stride 1); copy it first");
  // Collapse leading dims (size-1 dims carry no stride information). A found flag, not a
  // sentinel value: a negative stride (reversed rows) must reach the entry's refusal, not be
  // taken for "none found yet".
  bool found = false;
  int64_t row_stride = 0;  // stride of the innermost leading dim of size > 1
  int64_t expect = 0;      // stride the next outer dim must have to collapse
  for (int i = nd - 2; i >= 0; --i) {
    if (t->shape[i] == 1) continue;
    if (!found) {
      found = true;
      row_stride = t->strides[i];
      expect = row_stride * t->shape[i];
    } else {
      if (t->strides[i] != expect)
        return fail(Status::kInvalidArgument, what, ": the DLTensor has shape ", shape_str(*t), " and strides ",
                    strides_str(*t), ": its leading dimensions do not collapse into one row stride; copy it first");
      expect *= t->shape[i];
    }
  }
  out->row_stride = found ? row_stride : cols;
  return Status::kOk;
}

// Any shape whose elements collapse into one stride -> a column [n, 1].
Status dlpack_vector(const DLTensor* t, expertact_tensor* out) {
  constexpr const char* what = "expertact_vector_from_dlpack";
  EA_TRY(dlpack_common(what, t, out));
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  out->rows = n;
  out->cols = 1;
  out->row_stride = 1;
  if (n <= 1 || t->strides == nullptr) return Status::kOk;
  int64_t stride = 0, expect = 0;
  bool first = true;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (t->shape[i] == 1) continue;
    if (first) {
      stride = t->strides[i];
      expect = stride * t->shape[i];
      first = false;
    } else {
      if (t->strides[i] != expect)
        return fail(Status::kInvalidArgument, what, ": the DLTensor has shape ", shape_str(*t), " and strides ",
                    strides_str(*t), ": its elements do not collapse into one stride; copy it first");
      expect *= t->shape[i];
    }
  }
  out->row_stride = stride;
  return Status::kOk;
}

// The descriptions: only the dtype and device codes need translating; the sizes and
// strides go to the checks of core/checks.cpp as they are. A single row's stride is
// normalised, since nothing reads it.
Status to_matrix(const char* name, const expertact_tensor* t, MatrixRef& m) {
  if (t == nullptr) return fail(Status::kInvalidArgument, name, " is null");
  EA_TRY(to_dtype(name, t->dtype, m.dtype));
  EA_TRY(to_device(name, t->device, m.device, m.device_id));
  m.data = t->data;
  m.rows = t->rows;
  m.cols = t->cols;
  m.row_stride = t->rows > 1 ? t->row_stride : t->cols;
  return Status::kOk;
}

Status check_float32(const char* name, const DLDataType& t) {
  if (!(t.code == kDLFloat && t.bits == 32 && t.lanes == 1))
    return fail(Status::kInvalidDtype, name, " must be float32 (got DLPack dtype code ",
                static_cast<int>(t.code), ", bits ", static_cast<int>(t.bits), ", lanes ",
                static_cast<int>(t.lanes), ")");
  return Status::kOk;
}

// A vector's size and element stride: a column [n, 1] (stride row_stride) or a row [1, n]
// (contiguous); [0, c] and [r, 0] are empty.
Status vector_shape(const char* name, const expertact_tensor* t, int64_t& size, int64_t& stride) {
  if (t->rows < 0 || t->cols < 0)
    return fail(Status::kInvalidArgument, name, " has a negative size: [", t->rows, ", ", t->cols, "]");
  if (t->cols == 1) {
    size = t->rows;
    stride = t->rows > 1 ? t->row_stride : 1;
  } else if (t->rows == 1 || t->rows == 0 || t->cols == 0) {
    size = t->rows * t->cols;
    stride = 1;
  } else {
    return fail(Status::kInvalidArgument, name, " has shape [", t->rows, ", ", t->cols,
                "]; a vector is a column [n, 1] or a row [1, n]");
  }
  return Status::kOk;
}

Status to_vector(const char* name, const expertact_tensor* t, VectorRef& v) {
  if (t == nullptr) return fail(Status::kInvalidArgument, name, " is null");
  EA_TRY(check_float32(name, t->dtype));
  EA_TRY(to_device(name, t->device, v.device, v.device_id));
  EA_TRY(vector_shape(name, t, v.size, v.stride));
  v.data = static_cast<float*>(t->data);
  return Status::kOk;
}

// The experts' cumulative end rows: an int32 vector, contiguous.
Status to_offsets(const expertact_tensor* t, OffsetsRef& o, const char* name = "offsets") {
  if (t == nullptr) return fail(Status::kInvalidArgument, name, " is null");
  if (!(t->dtype.code == kDLInt && t->dtype.bits == 32 && t->dtype.lanes == 1))
    return fail(Status::kInvalidDtype, name, " must be int32 (got DLPack dtype code ",
                static_cast<int>(t->dtype.code), ", bits ", static_cast<int>(t->dtype.bits), ")");
  int64_t size = 0, stride = 1;
  EA_TRY(vector_shape(name, t, size, stride));
  if (size > 1 && stride != 1)
    return fail(Status::kInvalidArgument, name, " must be contiguous (stride ", stride, ")");
  EA_TRY(to_device(name, t->device, o.device, o.device_id));
  o.data = static_cast<const int32_t*>(t->data);
  o.size = size;
  return Status::kOk;
}

Status check_layout(int32_t layout) {
  if (layout < 0 || layout > 3)
    return fail(Status::kInvalidArgument, "layout ", layout,
                " is not one of 0 (separate), 1 (halves), 2 (halves_up_first), 3 (interleaved)");
  return Status::kOk;
}

Status to_params(const expertact_params* p, GluParams& out) {
  if (p == nullptr) return fail(Status::kInvalidArgument, "params is null");
  out.act = static_cast<Activation>(p->act);
  out.alpha = p->alpha;
  out.limit = p->limit;
  out.beta = p->beta;
  return Status::kOk;
}

Status forward_entry(const expertact_params* params, int32_t layout, const expertact_tensor* x,
                     const expertact_tensor* up, const expertact_tensor* weights, const expertact_tensor* out,
                     void* stream) {
  GluParams p;
  EA_TRY(to_params(params, p));
  EA_TRY(check_layout(layout));
  const bool separate = layout == EXPERTACT_LAYOUT_SEPARATE;
  MatrixRef mx, mup, mout;
  VectorRef vw;
  EA_TRY(to_matrix(separate ? "gate" : "gate_up", x, mx));
  if (separate) {
    if (up == nullptr)
      return fail(Status::kInvalidArgument, "up is missing: the separate layout takes gate and up");
    EA_TRY(to_matrix("up", up, mup));
  } else if (up != nullptr) {
    return fail(Status::kInvalidArgument, "up must be null for a packed layout (gate_up holds both halves)");
  }
  if (weights) EA_TRY(to_vector("weights", weights, vw));
  EA_TRY(to_matrix("out", out, mout));
  return glu_forward_body(p, static_cast<Layout>(layout), mx, separate ? &mup : nullptr,
                          weights ? &vw : nullptr, mout, stream);
}

Status backward_entry(const expertact_params* params, int32_t layout, const expertact_tensor* grad_out,
                      const expertact_tensor* x, const expertact_tensor* up, const expertact_tensor* weights,
                      const expertact_tensor* grad_x, const expertact_tensor* grad_up,
                      const expertact_tensor* grad_weights, void* stream) {
  GluParams p;
  EA_TRY(to_params(params, p));
  EA_TRY(check_layout(layout));
  const bool separate = layout == EXPERTACT_LAYOUT_SEPARATE;
  MatrixRef mdy, mx, mup, mgx, mgu;
  VectorRef vw, vgw;
  EA_TRY(to_matrix("grad_out", grad_out, mdy));
  EA_TRY(to_matrix(separate ? "gate" : "gate_up", x, mx));
  if (separate) {
    if (up == nullptr)
      return fail(Status::kInvalidArgument, "up is missing: the separate layout takes gate and up");
    if (grad_up == nullptr)
      return fail(Status::kInvalidArgument, "grad_up is missing: the separate layout returns two gradients");
    EA_TRY(to_matrix("up", up, mup));
    EA_TRY(to_matrix("grad_up", grad_up, mgu));
  } else if (up != nullptr || grad_up != nullptr) {
    return fail(Status::kInvalidArgument,
                "up and grad_up must be null for a packed layout (gate_up holds both halves)");
  }
  if (weights) EA_TRY(to_vector("weights", weights, vw));
  if (grad_weights) EA_TRY(to_vector("grad_weights", grad_weights, vgw));
  EA_TRY(to_matrix(separate ? "grad_gate" : "grad_gate_up", grad_x, mgx));
  return glu_backward_body(p, static_cast<Layout>(layout), mdy, mx, separate ? &mup : nullptr,
                           weights ? &vw : nullptr, mgx, separate ? &mgu : nullptr,
                           grad_weights ? &vgw : nullptr, stream);
}

// The activation's operands (shared by the biased and FP8 entry points).
struct GluOperands {
  MatrixRef x, up, out, grad_out, grad_x, grad_up;
  VectorRef w, gw;
  bool separate = false;
};

Status to_glu_operands(int32_t layout, const expertact_tensor* x, const expertact_tensor* up,
                       const expertact_tensor* weights, GluOperands& o) {
  EA_TRY(check_layout(layout));
  o.separate = layout == EXPERTACT_LAYOUT_SEPARATE;
  EA_TRY(to_matrix(o.separate ? "gate" : "gate_up", x, o.x));
  if (o.separate) {
    if (up == nullptr)
      return fail(Status::kInvalidArgument, "up is missing: the separate layout takes gate and up");
    EA_TRY(to_matrix("up", up, o.up));
  } else if (up != nullptr) {
    return fail(Status::kInvalidArgument, "up must be null for a packed layout (gate_up holds both halves)");
  }
  if (weights) EA_TRY(to_vector("weights", weights, o.w));
  return Status::kOk;
}

// A 3-dimensional DLTensor of any strides (strides null: compact row-major) as a Tensor3Ref.
Status to_tensor3(const char* name, const DLTensor* t, Tensor3Ref& out) {
  if (t == nullptr) return fail(Status::kInvalidArgument, name, " is null");
  if (t->ndim != 3 || t->shape == nullptr)
    return fail(Status::kInvalidArgument, name, " has ", t->ndim, " dimensions; expected 3: [E, R, C]");
  EA_TRY(to_dtype(name, t->dtype, out.dtype));
  EA_TRY(to_device(name, t->device, out.device, out.device_id));
  out.batch = t->shape[0];
  out.rows = t->shape[1];
  out.cols = t->shape[2];
  if (t->strides) {
    out.batch_stride = t->strides[0];
    out.row_stride = t->strides[1];
    out.col_stride = t->strides[2];
  } else {
    out.col_stride = 1;
    out.row_stride = out.cols;
    out.batch_stride = out.rows * out.cols;
  }
  out.data = t->data == nullptr ? nullptr : static_cast<char*>(t->data) + t->byte_offset;
  return Status::kOk;
}

// One C entry point: fn's Status as the C code, inside the one exception guard.
template <typename Fn>
expertact_status guarded_c(const char* what, Fn&& fn) {
  return static_cast<expertact_status>(guarded(what, std::forward<Fn>(fn)));
}

}  // namespace
}  // namespace expertact::detail

using namespace expertact;
using namespace expertact::detail;

extern "C" {

expertact_status expertact_preset(const char* name, float alpha, float limit,
                                  expertact_params* out) {
  return guarded_c("expertact_preset", [&]() -> Status {
    if (name == nullptr) return fail(Status::kInvalidArgument, "preset name is null");
    if (out == nullptr) return fail(Status::kInvalidArgument, "out (params) is null");
    GluParams p;
    const std::string n(name);
    if (n == "swiglu") {
      p = preset_swiglu();
    } else if (n == "swiglu_clamped") {
      p = preset_swiglu_clamped(std::isnan(limit) ? 7.0f : limit);
    } else if (n == "swiglu_oai") {
      p = preset_swiglu_oai(std::isnan(alpha) ? 1.702f : alpha, std::isnan(limit) ? 7.0f : limit);
    } else if (n == "geglu_tanh") {
      p = preset_geglu_tanh();
    } else {
      return fail(Status::kInvalidArgument, "unknown preset '", n,
                  "' (expected swiglu, swiglu_clamped, swiglu_oai or geglu_tanh)");
    }
    out->act = static_cast<int32_t>(p.act);
    out->alpha = p.alpha;
    out->limit = p.limit;
    out->beta = p.beta;
    return Status::kOk;
  });
}

expertact_status expertact_tensor_from_dlpack(const DLTensor* t, expertact_tensor* out) {
  return guarded_c("expertact_tensor_from_dlpack", [&] { return dlpack_matrix(t, out); });
}

expertact_status expertact_vector_from_dlpack(const DLTensor* t, expertact_tensor* out) {
  return guarded_c("expertact_vector_from_dlpack", [&] { return dlpack_vector(t, out); });
}

expertact_status expertact_glu_forward(const expertact_params* params, int32_t layout,
                                       const expertact_tensor* x, const expertact_tensor* up,
                                       const expertact_tensor* weights, expertact_tensor* out,
                                       void* stream) {
  return guarded_c("expertact_glu_forward",
                   [&] { return forward_entry(params, layout, x, up, weights, out, stream); });
}

expertact_status expertact_glu_backward(const expertact_params* params, int32_t layout,
                                        const expertact_tensor* grad_out,
                                        const expertact_tensor* x, const expertact_tensor* up,
                                        const expertact_tensor* weights,
                                        expertact_tensor* grad_x, expertact_tensor* grad_up,
                                        expertact_tensor* grad_weights, void* stream) {
  return guarded_c("expertact_glu_backward", [&] {
    return backward_entry(params, layout, grad_out, x, up, weights, grad_x, grad_up, grad_weights,
                          stream);
  });
}

size_t expertact_glu_bias_workspace_bytes(int64_t rows, int64_t F, int64_t num_experts) {
  return expertact::glu_bias_workspace_bytes(rows, F, num_experts);
}
size_t expertact_expert_bias_workspace_bytes(int64_t rows, int64_t cols, int64_t num_experts) {
  return expertact::expert_bias_workspace_bytes(rows, cols, num_experts);
}

expertact_status expertact_glu_forward_bias(const expertact_params* params, int32_t layout,
                                            const expertact_tensor* x,
                                            const expertact_tensor* up,
                                            const expertact_tensor* weights,
                                            const expertact_tensor* bias,
                                            const expertact_tensor* offsets,
                                            expertact_tensor* out, void* stream) {
  return guarded_c("expertact_glu_forward_bias", [&]() -> Status {
    GluParams p;
    EA_TRY(to_params(params, p));
    GluOperands o;
    EA_TRY(to_glu_operands(layout, x, up, weights, o));
    MatrixRef mb;
    OffsetsRef offs;
    EA_TRY(to_matrix("bias", bias, mb));
    EA_TRY(to_offsets(offsets, offs));
    EA_TRY(to_matrix("out", out, o.out));
    return glu_forward_bias_body(p, static_cast<Layout>(layout), o.x, o.separate ? &o.up : nullptr,
                                 weights ? &o.w : nullptr, mb, offs, o.out, stream);
  });
}

expertact_status expertact_glu_backward_bias(
    const expertact_params* params, int32_t layout, const expertact_tensor* grad_out,
    const expertact_tensor* x, const expertact_tensor* up, const expertact_tensor* weights,
    const expertact_tensor* bias, const expertact_tensor* offsets, expertact_tensor* grad_x,
    expertact_tensor* grad_up, expertact_tensor* grad_weights, expertact_tensor* grad_bias,
    void* workspace, size_t workspace_bytes, void* stream) {
  return guarded_c("expertact_glu_backward_bias", [&]() -> Status {
    GluParams p;
    EA_TRY(to_params(params, p));
    GluOperands o;
    EA_TRY(to_glu_operands(layout, x, up, weights, o));
    if (o.separate && grad_up == nullptr)
      return fail(Status::kInvalidArgument, "grad_up is missing: the separate layout returns two gradients");
    if (!o.separate && grad_up != nullptr)
      return fail(Status::kInvalidArgument, "grad_up must be null for a packed layout");
    MatrixRef mb, mgb;
    OffsetsRef offs;
    EA_TRY(to_matrix("grad_out", grad_out, o.grad_out));
    EA_TRY(to_matrix("bias", bias, mb));
    EA_TRY(to_offsets(offsets, offs));
    EA_TRY(to_matrix(o.separate ? "grad_gate" : "grad_gate_up", grad_x, o.grad_x));
    if (grad_up) EA_TRY(to_matrix("grad_up", grad_up, o.grad_up));
    if (grad_weights) EA_TRY(to_vector("grad_weights", grad_weights, o.gw));
    if (grad_bias) EA_TRY(to_matrix("grad_bias", grad_bias, mgb));
    return glu_backward_bias_body(p, static_cast<Layout>(layout), o.grad_out, o.x,
                                  o.separate ? &o.up : nullptr, weights ? &o.w : nullptr, mb, offs,
                                  o.grad_x, o.separate ? &o.grad_up : nullptr,
                                  grad_weights ? &o.gw : nullptr, grad_bias ? &mgb : nullptr,
                                  workspace, workspace_bytes, stream);
  });
}

expertact_status expertact_expert_bias_forward(const expertact_tensor* x,
                                               const expertact_tensor* bias,
                                               const expertact_tensor* offsets,
                                               const expertact_tensor* weights,
                                               expertact_tensor* out, void* stream) {
  return guarded_c("expertact_expert_bias_forward", [&]() -> Status {
    MatrixRef mx, mb, mo;
    VectorRef vw;
    OffsetsRef offs;
    EA_TRY(to_matrix("x", x, mx));
    EA_TRY(to_matrix("bias", bias, mb));
    EA_TRY(to_offsets(offsets, offs));
    if (weights) EA_TRY(to_vector("weights", weights, vw));
    EA_TRY(to_matrix("out", out, mo));
    return expert_bias_forward_body(mx, mb, offs, weights ? &vw : nullptr, mo, stream);
  });
}

expertact_status expertact_expert_bias_backward(
    const expertact_tensor* grad_out, const expertact_tensor* bias,
    const expertact_tensor* offsets, const expertact_tensor* weights,
    expertact_tensor* grad_bias, expertact_tensor* grad_weights, void* workspace,
    size_t workspace_bytes, void* stream) {
  return guarded_c("expertact_expert_bias_backward", [&]() -> Status {
    MatrixRef mdy, mb, mgb;
    VectorRef vw, vgw;
    OffsetsRef offs;
    EA_TRY(to_matrix("grad_out", grad_out, mdy));
    EA_TRY(to_matrix("bias", bias, mb));
    EA_TRY(to_offsets(offsets, offs));
    if (weights) EA_TRY(to_vector("weights", weights, vw));
    if (grad_bias) EA_TRY(to_matrix("grad_bias", grad_bias, mgb));
    if (grad_weights) EA_TRY(to_vector("grad_weights", grad_weights, vgw));
    return expert_bias_backward_body(mdy, mb, offs, weights ? &vw : nullptr,
                                     grad_bias ? &mgb : nullptr, grad_weights ? &vgw : nullptr,
                                     workspace, workspace_bytes, stream);
  });
}

expertact_status expertact_fp8_quantize_rowwise(const expertact_tensor* x, expertact_tensor* q,
                                                expertact_tensor* scale,
                                                const expertact_tensor* col_amax_offsets,
                                                expertact_tensor* col_amax, void* stream) {
  return guarded_c("expertact_fp8_quantize_rowwise", [&]() -> Status {
    MatrixRef mx, mq, ma;
    VectorRef vs;
    OffsetsRef offs;
    EA_TRY(to_matrix("x", x, mx));
    EA_TRY(to_matrix("q", q, mq));
    EA_TRY(to_vector("scale", scale, vs));
    if (col_amax_offsets) EA_TRY(to_offsets(col_amax_offsets, offs, "col_amax_offsets"));
    if (col_amax) EA_TRY(to_matrix("col_amax", col_amax, ma));
    return fp8_quantize_rowwise_body(mx, mq, vs, col_amax_offsets ? &offs : nullptr, col_amax ? &ma : nullptr,
                                     stream);
  });
}

expertact_status expertact_fp8_quantize_colwise_grouped(const expertact_tensor* x,
                                                        const expertact_tensor* offsets,
                                                        const expertact_tensor* padded_offsets,
                                                        expertact_tensor* q_t, expertact_tensor* scale,
                                                        const expertact_tensor* amax, void* stream) {
  return guarded_c("expertact_fp8_quantize_colwise_grouped", [&]() -> Status {
    MatrixRef mx, mq, ms;
    OffsetsRef offs, pads;
    EA_TRY(to_matrix("x", x, mx));
    EA_TRY(to_offsets(offsets, offs));
    if (padded_offsets) EA_TRY(to_offsets(padded_offsets, pads, "padded_offsets"));
    EA_TRY(to_matrix("q_t", q_t, mq));
    EA_TRY(to_matrix("scale", scale, ms));
    MatrixRef ma;
    if (amax) EA_TRY(to_matrix("amax", amax, ma));
    return fp8_quantize_colwise_grouped_body(mx, offs, padded_offsets ? &pads : nullptr, mq, ms,
                                             amax ? &ma : nullptr, stream);
  });
}

expertact_status expertact_fp8_glu_rowwise(const expertact_params* params, int32_t layout,
                                           const expertact_tensor* x, const expertact_tensor* up,
                                           const expertact_tensor* weights, expertact_tensor* q,
                                           expertact_tensor* scale, const expertact_tensor* col_amax_offsets,
                                           expertact_tensor* col_amax, void* stream) {
  return guarded_c("expertact_fp8_glu_rowwise", [&]() -> Status {
    GluParams p;
    EA_TRY(to_params(params, p));
    GluOperands o;
    EA_TRY(to_glu_operands(layout, x, up, weights, o));
    MatrixRef mq, ma;
    VectorRef vs;
    OffsetsRef offs;
    EA_TRY(to_matrix("q", q, mq));
    EA_TRY(to_vector("scale", scale, vs));
    if (col_amax_offsets) EA_TRY(to_offsets(col_amax_offsets, offs, "col_amax_offsets"));
    if (col_amax) EA_TRY(to_matrix("col_amax", col_amax, ma));
    return fp8_glu_rowwise_body(p, static_cast<Layout>(layout), o.x, o.separate ? &o.up : nullptr,
                                weights ? &o.w : nullptr, nullptr, nullptr, mq, vs,
                                col_amax_offsets ? &offs : nullptr, col_amax ? &ma : nullptr, stream);
  });
}

expertact_status expertact_fp8_glu_rowwise_bias(const expertact_params* params, int32_t layout,
                                                const expertact_tensor* x, const expertact_tensor* up,
                                                const expertact_tensor* weights, const expertact_tensor* bias,
                                                const expertact_tensor* offsets, expertact_tensor* q,
                                                expertact_tensor* scale, expertact_tensor* col_amax,
                                                void* stream) {
  return guarded_c("expertact_fp8_glu_rowwise_bias", [&]() -> Status {
    GluParams p;
    EA_TRY(to_params(params, p));
    GluOperands o;
    EA_TRY(to_glu_operands(layout, x, up, weights, o));
    MatrixRef mb, mq, ma;
    OffsetsRef offs;
    VectorRef vs;
    EA_TRY(to_matrix("bias", bias, mb));
    EA_TRY(to_offsets(offsets, offs));
    EA_TRY(to_matrix("q", q, mq));
    EA_TRY(to_vector("scale", scale, vs));
    if (col_amax) EA_TRY(to_matrix("col_amax", col_amax, ma));
    return fp8_glu_rowwise_body(p, static_cast<Layout>(layout), o.x, o.separate ? &o.up : nullptr,
                                weights ? &o.w : nullptr, &mb, &offs, mq, vs, col_amax ? &offs : nullptr,
                                col_amax ? &ma : nullptr, stream);
  });
}

expertact_status expertact_fp8_glu_colwise_grouped(const expertact_params* params, int32_t layout,
                                                     const expertact_tensor* x, const expertact_tensor* up,
                                                     const expertact_tensor* weights, const expertact_tensor* bias,
                                                     const expertact_tensor* offsets,
                                                     const expertact_tensor* padded_offsets, expertact_tensor* q_t,
                                                     expertact_tensor* scale, const expertact_tensor* amax,
                                                     void* stream) {
  return guarded_c("expertact_fp8_glu_colwise_grouped", [&]() -> Status {
    GluParams p;
    EA_TRY(to_params(params, p));
    GluOperands o;
    EA_TRY(to_glu_operands(layout, x, up, weights, o));
    MatrixRef mb, mq, ms, ma;
    OffsetsRef offs, pads;
    if (bias) EA_TRY(to_matrix("bias", bias, mb));
    EA_TRY(to_offsets(offsets, offs));
    if (padded_offsets) EA_TRY(to_offsets(padded_offsets, pads, "padded_offsets"));
    EA_TRY(to_matrix("q_t", q_t, mq));
    EA_TRY(to_matrix("scale", scale, ms));
    if (amax == nullptr)
      return fail(Status::kInvalidArgument,
                  "amax is null: it is required (float32 [E, F], the per expert and column max |h|, e.g. "
                  "expertact_fp8_quantize_rowwise's col_amax of the activation)");
    EA_TRY(to_matrix("amax", amax, ma));
    return fp8_glu_colwise_grouped_body(p, static_cast<Layout>(layout), o.x, o.separate ? &o.up : nullptr,
                                        weights ? &o.w : nullptr, bias ? &mb : nullptr, offs,
                                        padded_offsets ? &pads : nullptr, mq, ms, ma, stream);
  });
}

expertact_status expertact_fp8_glu_backward_rowwise(
    const expertact_params* params, int32_t layout, const expertact_tensor* grad_out,
    const expertact_tensor* gate_up, const expertact_tensor* weights, const expertact_tensor* bias,
    const expertact_tensor* offsets, expertact_tensor* q, expertact_tensor* scale,
    expertact_tensor* grad_weights, expertact_tensor* col_amax, expertact_tensor* grad_gate_up,
    void* stream) {
  return guarded_c("expertact_fp8_glu_backward_rowwise", [&]() -> Status {
    GluParams p;
    EA_TRY(to_params(params, p));
    GluOperands o;
    EA_TRY(to_glu_operands(layout, gate_up, nullptr, weights, o));
    MatrixRef mb, mq, ma, mg;
    OffsetsRef offs;
    VectorRef vs, vgw;
    EA_TRY(to_matrix("grad_out", grad_out, o.grad_out));
    if (bias) EA_TRY(to_matrix("bias", bias, mb));
    if (offsets) EA_TRY(to_offsets(offsets, offs));
    EA_TRY(to_matrix("q", q, mq));
    EA_TRY(to_vector("scale", scale, vs));
    if (grad_weights) EA_TRY(to_vector("grad_weights", grad_weights, vgw));
    if (col_amax) EA_TRY(to_matrix("col_amax", col_amax, ma));
    if (grad_gate_up) EA_TRY(to_matrix("grad_gate_up", grad_gate_up, mg));
    return fp8_glu_backward_rowwise_body(p, static_cast<Layout>(layout), o.grad_out, o.x, weights ? &o.w : nullptr,
                                         bias ? &mb : nullptr, offsets ? &offs : nullptr, mq, vs,
                                         grad_weights ? &vgw : nullptr, col_amax ? &ma : nullptr,
                                         grad_gate_up ? &mg : nullptr, stream);
  });
}

// ---- FP8 blockwise operands (src/api_fp8_tiles.cpp) ----

expertact_status expertact_fp8_quantize_row_tiles(const expertact_tensor* x, expertact_tensor* q,
                                                  expertact_tensor* scale, void* stream) {
  return guarded_c("expertact_fp8_quantize_row_tiles", [&]() -> Status {
    MatrixRef mx, mq, ms;
    EA_TRY(to_matrix("x", x, mx));
    EA_TRY(to_matrix("q", q, mq));
    EA_TRY(to_matrix("scale", scale, ms));
    return fp8_quantize_row_tiles_body(mx, mq, ms, stream);
  });
}

expertact_status expertact_fp8_quantize_column_tiles_grouped(const expertact_tensor* x,
                                                             const expertact_tensor* offsets,
                                                             const expertact_tensor* padded_offsets,
                                                             expertact_tensor* q_t, expertact_tensor* scale,
                                                             expertact_tensor* q, expertact_tensor* row_scale,
                                                             void* stream) {
  return guarded_c("expertact_fp8_quantize_column_tiles_grouped", [&]() -> Status {
    MatrixRef mx, mqt, ms, mq, mrs;
    OffsetsRef offs, pads;
    EA_TRY(to_matrix("x", x, mx));
    EA_TRY(to_offsets(offsets, offs));
    EA_TRY(to_offsets(padded_offsets, pads, "padded_offsets"));
    EA_TRY(to_matrix("q_t", q_t, mqt));
    EA_TRY(to_matrix("scale", scale, ms));
    if (q) EA_TRY(to_matrix("q", q, mq));
    if (row_scale) EA_TRY(to_matrix("row_scale", row_scale, mrs));
    return fp8_quantize_column_tiles_grouped_body(mx, offs, pads, mqt, ms, q ? &mq : nullptr,
                                                  row_scale ? &mrs : nullptr, stream);
  });
}

expertact_status expertact_fp8_quantize_blocks(const DLTensor* w, expertact_tensor* q, expertact_tensor* scale,
                                               void* stream) {
  return guarded_c("expertact_fp8_quantize_blocks", [&]() -> Status {
    Tensor3Ref tw;
    MatrixRef mq, ms;
    EA_TRY(to_tensor3("w", w, tw));
    EA_TRY(to_matrix("q", q, mq));
    EA_TRY(to_matrix("scale", scale, ms));
    return fp8_quantize_blocks_body(tw, mq, ms, stream);
  });
}

expertact_status expertact_fp8_glu_row_tiles(const expertact_params* params, int32_t layout,
                                             const expertact_tensor* x, const expertact_tensor* up,
                                             const expertact_tensor* weights, const expertact_tensor* bias,
                                             const expertact_tensor* offsets, expertact_tensor* q,
                                             expertact_tensor* scale, void* stream) {
  return guarded_c("expertact_fp8_glu_row_tiles", [&]() -> Status {
    GluParams p;
    EA_TRY(to_params(params, p));
    GluOperands o;
    EA_TRY(to_glu_operands(layout, x, up, weights, o));
    MatrixRef mb, mq, ms;
    OffsetsRef offs;
    if (bias) EA_TRY(to_matrix("bias", bias, mb));
    if (offsets) EA_TRY(to_offsets(offsets, offs));
    EA_TRY(to_matrix("q", q, mq));
    EA_TRY(to_matrix("scale", scale, ms));
    return fp8_glu_row_tiles_body(p, static_cast<Layout>(layout), o.x, o.separate ? &o.up : nullptr,
                                  weights ? &o.w : nullptr, bias ? &mb : nullptr, offsets ? &offs : nullptr, mq, ms,
                                  stream);
  });
}

expertact_status expertact_fp8_glu_column_tiles_grouped(const expertact_params* params, int32_t layout,
                                                        const expertact_tensor* x, const expertact_tensor* up,
                                                        const expertact_tensor* weights,
                                                        const expertact_tensor* bias,
                                                        const expertact_tensor* offsets,
                                                        const expertact_tensor* padded_offsets,
                                                        expertact_tensor* q_t, expertact_tensor* scale,
                                                        void* stream) {
  return guarded_c("expertact_fp8_glu_column_tiles_grouped", [&]() -> Status {
    GluParams p;
    EA_TRY(to_params(params, p));
    GluOperands o;
    EA_TRY(to_glu_operands(layout, x, up, weights, o));
    MatrixRef mb, mqt, ms;
    OffsetsRef offs, pads;
    if (bias) EA_TRY(to_matrix("bias", bias, mb));
    EA_TRY(to_offsets(offsets, offs));
    EA_TRY(to_offsets(padded_offsets, pads, "padded_offsets"));
    EA_TRY(to_matrix("q_t", q_t, mqt));
    EA_TRY(to_matrix("scale", scale, ms));
    return fp8_glu_column_tiles_grouped_body(p, static_cast<Layout>(layout), o.x, o.separate ? &o.up : nullptr,
                                             weights ? &o.w : nullptr, bias ? &mb : nullptr, offs, pads, mqt, ms,
                                             stream);
  });
}

expertact_status expertact_fp8_glu_backward_tiles(
    const expertact_params* params, int32_t layout, const expertact_tensor* grad_out,
    const expertact_tensor* gate_up, const expertact_tensor* weights, const expertact_tensor* bias,
    const expertact_tensor* offsets, const expertact_tensor* padded_offsets, expertact_tensor* q,
    expertact_tensor* scale, expertact_tensor* q_t, expertact_tensor* col_scale, expertact_tensor* grad_weights,
    expertact_tensor* grad_gate_up, void* stream) {
  return guarded_c("expertact_fp8_glu_backward_tiles", [&]() -> Status {
    GluParams p;
    EA_TRY(to_params(params, p));
    // gate_up alone, whatever the layout: the body refuses the separate one, naming it.
    EA_TRY(check_layout(layout));
    GluOperands o;
    EA_TRY(to_matrix("gate_up", gate_up, o.x));
    if (weights) EA_TRY(to_vector("weights", weights, o.w));
    MatrixRef mb, mq, ms, mqt, mcs, mg;
    OffsetsRef offs, pads;
    VectorRef vgw;
    EA_TRY(to_matrix("grad_out", grad_out, o.grad_out));
    if (bias) EA_TRY(to_matrix("bias", bias, mb));
    if (offsets) EA_TRY(to_offsets(offsets, offs));
    if (padded_offsets) EA_TRY(to_offsets(padded_offsets, pads, "padded_offsets"));
    EA_TRY(to_matrix("q", q, mq));
    EA_TRY(to_matrix("scale", scale, ms));
    if (q_t) EA_TRY(to_matrix("q_t", q_t, mqt));
    if (col_scale) EA_TRY(to_matrix("col_scale", col_scale, mcs));
    if (grad_weights) EA_TRY(to_vector("grad_weights", grad_weights, vgw));
    if (grad_gate_up) EA_TRY(to_matrix("grad_gate_up", grad_gate_up, mg));
    return fp8_glu_backward_tiles_body(p, static_cast<Layout>(layout), o.grad_out, o.x, weights ? &o.w : nullptr,
                                       bias ? &mb : nullptr, offsets ? &offs : nullptr,
                                       padded_offsets ? &pads : nullptr, mq, ms, q_t ? &mqt : nullptr,
                                       col_scale ? &mcs : nullptr, grad_weights ? &vgw : nullptr,
                                       grad_gate_up ? &mg : nullptr, stream);
  });
}

// ---- end of the FP8 blockwise operands ----

const char* expertact_last_error(void) { return expertact::last_error(); }
int32_t expertact_has_cuda(void) { return expertact::has_cuda() ? 1 : 0; }
int32_t expertact_abi_version(void) { return EXPERTACT_ABI_VERSION; }
int32_t expertact_cpu_threads(void) { return expertact::cpu_threads(); }
void expertact_set_cpu_threads(int32_t n) { expertact::set_cpu_threads(n); }

}  // extern "C"
