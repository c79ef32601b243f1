// Compact operands of the FP8 tests (support/buffers.h).
#include "support/buffers.h"

#include <random>

namespace eat {

DLDataType dl_of(DType d) {
  switch (d) {
    case DType::kFloat16: return DLDataType{kDLFloat, 16, 1};
    case DType::kBFloat16: return DLDataType{kDLBfloat, 16, 1};
    case DType::kFloat64: return DLDataType{kDLFloat, 64, 1};
    case DType::kFloat8E4M3: return DLDataType{EXPERTACT_DL_FLOAT8_E4M3FN, 8, 1};
    default: return DLDataType{kDLFloat, 32, 1};
  }
}

int64_t size_of(DType d) { return d == DType::kFloat8E4M3 ? 1 : dtype_size(d); }

std::vector<float> randn(size_t n, unsigned seed, float scale) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

}  // namespace eat
