// The argument checks of the API boundary (defined in core/checks.cpp), shared by every
// entry point (src/api.cpp, src/api_moe.cpp): each returns kOk or fails with a message
// naming the argument and its value.
#pragma once

#include <cstdint>

#include "expertact/expertact.hpp"

namespace expertact::detail {

int64_t dtype_size(DType d);
bool valid_dtype(DType d);
Status check_params(const GluParams& p);
// Shape, dtype, device, stride and alignment of one matrix operand.
Status check_matrix(const char* name, const MatrixRef& m);
// The same without the dtype's check (the caller checks it: the FP8 outputs).
Status check_matrix_view(const char* name, const MatrixRef& m);
Status check_vector(const char* name, const VectorRef& v, int64_t rows);
Status check_same_device(const char* name, DeviceType d, int32_t id, DeviceType ref_d,
                         int32_t ref_id, const char* ref_name);
Status check_shape(const char* name, const MatrixRef& m, int64_t rows, int64_t cols,
                   DType dtype, const char* why);

// Byte extent of a row-strided view, for overlap checks.
struct Extent {
  uintptr_t begin = 0, end = 0;  // [begin, end)
  int64_t stride = 0, row_bytes = 0;
  bool empty = true;
};
Extent extent_of(const MatrixRef& m);
Extent extent_of(const VectorRef& v);
// Whether two views may share a byte (exact for views of one row stride, else by range).
bool may_overlap(const Extent& a, const Extent& b);
bool same_view(const MatrixRef& a, const MatrixRef& b);
Status check_no_overlap(const char* out_name, const Extent& out, const char* in_name,
                        const Extent& in);

}  // namespace expertact::detail
