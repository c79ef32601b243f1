// The storage types of the CPU path's plain-loop kernels (src/cpu/bias_cpu.cpp,
// src/cpu/fp8_cpu.cpp): each with its arithmetic type (float; double for float64) and
// conversions, and the dispatch from a DType to them.
#pragma once

#include "core/convert.h"
#include "core/error.h"
#include "expertact/expertact.hpp"

namespace expertact::detail {

template <typename T> struct Cv {
  using S = float;
  static float ld(T v) { return host::Io<T>::load(v); }
  static T st(float f) { return host::Io<T>::store(f); }
};
template <> struct Cv<double> {
  using S = double;
  static double ld(double v) { return v; }
  static double st(double v) { return v; }
};

// fn(T{}) for the storage type of d: float32, float16 or bfloat16, and float64 with kF64.
template <bool kF64, typename Fn>
Status dispatch_host_dtype(DType d, const char* what, Fn&& fn) {
  switch (d) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat16: return fn(host::f16{});
    case DType::kBFloat16: return fn(host::bf16{});
    case DType::kFloat64:
      if constexpr (kF64) return fn(double{});
      break;
    default: break;
  }
  return fail(Status::kInternal, what, ": unexpected dtype ", static_cast<int>(d));
}

}  // namespace expertact::detail
