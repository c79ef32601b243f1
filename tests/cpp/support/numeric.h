// Test-side numerics, independent of the library: float16 / bfloat16 encoding
// (round to nearest even, from float64 directly), ulp spacing per dtype, and
// loads/stores of one element of a given dtype.
#pragma once

#include <cstdint>
#include <string>

#include "expertact/expertact.hpp"

namespace eat {

using expertact::DType;

int64_t dtype_size(DType d);
const char* dtype_name(DType d);

// x rounded once (nearest, ties to even) to the dtype, returned as a double;
// overflow gives +-inf, NaN stays NaN.
double round_to(DType d, double x);

// The spacing of the dtype's values at |x| (its ulp; the subnormal spacing
// below the smallest normal). inf for non-finite x.
double ulp_of(DType d, double x);

// The largest finite value of the dtype.
double max_finite(DType d);

// The next representable value of the dtype after x, towards +inf or -inf.
double next_up(DType d, double x);
double next_down(DType d, double x);

// Bit-level encodings (round to nearest even from double).
uint16_t to_f16_bits(double x);
uint16_t to_bf16_bits(double x);
double from_f16_bits(uint16_t h);
double from_bf16_bits(uint16_t b);

// One element of dtype d at p: store rounds x to the dtype; load is exact.
void store_elem(DType d, void* p, double x);
double load_elem(DType d, const void* p);

}  // namespace eat
