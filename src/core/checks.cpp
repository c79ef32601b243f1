// The argument checks of the API boundary (declared in core/checks.h), shared by the
// activation's entry points (src/api.cpp) and the fused grouped GEMMs' (src/api_moe.cpp).
#include "core/checks.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace expertact::detail {

int64_t dtype_size(DType d) {
  return d == DType::kFloat64 ? 8 : d == DType::kFloat32 ? 4 : d == DType::kFloat8E4M3 ? 1 : 2;
}

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
  return check_matrix_view(name, m);
}

Status check_matrix_view(const char* name, const MatrixRef& m) {
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

}  // namespace expertact::detail
