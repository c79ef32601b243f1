// Compact operands of the FP8 tests on a backend: a [rows, cols] matrix of one dtype (float8
// e4m3fn included) and an int32 vector, with their C ABI (expertact_tensor) and C++ (MatrixRef,
// OffsetsRef) descriptions, and seeded normal values to fill them.
#pragma once

#include <dlpack/dlpack.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "expertact/expertact.hpp"
#include "expertact/expertact_c.h"
#include "support/backend.h"
#include "support/numeric.h"

namespace eat {

// The DLPack dtype of a DType (float8_e4m3fn: EXPERTACT_DL_FLOAT8_E4M3FN).
DLDataType dl_of(DType d);
// Bytes per element, float8 included.
int64_t size_of(DType d);
// n values from N(0, scale^2), the same for the same seed.
std::vector<float> randn(size_t n, unsigned seed, float scale);

// A compact [rows, cols] matrix of one dtype on a backend, filled with a byte or with values.
struct Mat {
  std::unique_ptr<DeviceBuffer> d;
  DType dtype;
  int64_t rows, cols;
  Mat(Backend& be, DType t, int64_t r, int64_t c, uint8_t fill) : dtype(t), rows(r), cols(c) {
    d = std::make_unique<DeviceBuffer>(be, std::max<int64_t>(r * c * size_of(t), 1));
    std::memset(d->image.data(), fill, d->size());
    d->upload();
  }
  Mat(Backend& be, DType t, int64_t r, int64_t c, const std::vector<float>& v) : Mat(be, t, r, c, uint8_t{0}) {
    for (int64_t i = 0; i < r * c; ++i) store_elem(t, &d->image[i * size_of(t)], v[i]);
    d->upload();
  }
  expertact_tensor c_ref(Backend& be) const {
    return expertact_tensor{d->data(), rows, cols, cols, dl_of(dtype), be.dl_device()};
  }
  expertact::MatrixRef ref(Backend& be) const {
    return expertact::MatrixRef{d->data(), rows, cols, cols, dtype, be.device(), be.device_id()};
  }
  std::vector<uint8_t> bytes() {
    d->download();
    return d->image;
  }
  std::vector<float> floats() {
    d->download();
    std::vector<float> v(static_cast<size_t>(rows * cols));
    for (int64_t i = 0; i < rows * cols; ++i) v[i] = static_cast<float>(load_elem(dtype, &d->image[i * size_of(dtype)]));
    return v;
  }
};

// An int32 vector (offsets) on a backend.
struct Ints {
  std::unique_ptr<DeviceBuffer> d;
  int64_t n;
  Ints(Backend& be, const std::vector<int32_t>& v) : n(static_cast<int64_t>(v.size())) {
    d = std::make_unique<DeviceBuffer>(be, std::max<size_t>(v.size() * 4, 4));
    std::memcpy(d->image.data(), v.data(), v.size() * 4);
    d->upload();
  }
  expertact_tensor c_ref(Backend& be) const {
    return expertact_tensor{d->data(), n, 1, 1, DLDataType{kDLInt, 32, 1}, be.dl_device()};
  }
  expertact::OffsetsRef ref(Backend& be) const {
    return expertact::OffsetsRef{static_cast<const int32_t*>(static_cast<void*>(d->data())), n, be.device(),
                                 be.device_id()};
  }
};

// A float32 [rows, cols] Mat described as the vector of its rows * cols elements.
inline expertact_tensor vec_ref(Backend& be, const Mat& m) {
  return expertact_tensor{m.d->data(), m.rows * m.cols, 1, 1, DLDataType{kDLFloat, 32, 1}, be.dl_device()};
}

}  // namespace eat
