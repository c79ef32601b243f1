// The one place where run-time enums become compile-time template arguments:
// dtype, activation, interleaved or planar step, and whether weights are used.
// Each backend maps the dtype tag to its own storage type.
#pragma once

#include <type_traits>

#include "core/error.h"
#include "expertact/expertact.hpp"

namespace expertact::detail {

template <DType D> using DTypeTag = std::integral_constant<DType, D>;
template <Activation A> using ActTag = std::integral_constant<Activation, A>;
template <bool B> using BoolTag = std::integral_constant<bool, B>;
template <int N> using IntTag = std::integral_constant<int, N>;

template <typename Fn>
Status dispatch_dtype(DType d, Fn&& fn) {
  switch (d) {
    case DType::kFloat32: return fn(DTypeTag<DType::kFloat32>{});
    case DType::kFloat16: return fn(DTypeTag<DType::kFloat16>{});
    case DType::kBFloat16: return fn(DTypeTag<DType::kBFloat16>{});
    default: break;
  }
  return fail(Status::kInvalidDtype, "unsupported dtype ", static_cast<int>(d),
              " (expected float32, float16 or bfloat16)");
}

template <typename Fn>
Status dispatch_act(Activation a, Fn&& fn) {
  switch (a) {
    case Activation::kSilu: return fn(ActTag<Activation::kSilu>{});
    case Activation::kGeluTanh: return fn(ActTag<Activation::kGeluTanh>{});
  }
  return fail(Status::kInvalidArgument, "unsupported activation ", static_cast<int>(a),
              " (expected 0 = silu or 1 = gelu_tanh)");
}

template <typename Fn>
Status dispatch_step(int step, Fn&& fn) {
  if (step == 1) return fn(IntTag<1>{});
  if (step == 2) return fn(IntTag<2>{});
  return fail(Status::kInternal, "element step ", step, " is neither 1 nor 2");
}

template <typename Fn>
Status dispatch_bool(bool b, Fn&& fn) {
  return b ? fn(BoolTag<true>{}) : fn(BoolTag<false>{});
}

}  // namespace expertact::detail
