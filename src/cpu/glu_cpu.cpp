// CPU forward and backward: rows split across threads, each row one loop the
// compiler vectorizes (#pragma omp simd under -fopenmp-simd, no OpenMP
// runtime); the per-element math is src/core/math.h, shared with CUDA.
#include <cstdint>

#include "core/convert.h"
#include "core/dispatch.h"
#include "core/math.h"
#include "core/problem.h"
#include "cpu/parallel.h"

namespace expertact::detail {
namespace {

using host::Io;
using cpu::parallel_for;

template <DType D> struct Storage;
template <> struct Storage<DType::kFloat32> { using type = float; };
template <> struct Storage<DType::kFloat16> { using type = host::f16; };
template <> struct Storage<DType::kBFloat16> { using type = host::bf16; };

math::Coeffs coeffs_of(const GluProblem& p) {
  return math::Coeffs{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
}

template <typename T, Activation A, int kStep, bool kW>
void fwd_rows(const GluProblem& p, const FwdOutput& o, int64_t r0, int64_t r1) {
  const math::Coeffs c = coeffs_of(p);
  const int64_t F = p.F;
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict g = static_cast<const T*>(p.g) + r * p.g_stride;
    const T* __restrict u = static_cast<const T*>(p.u) + r * p.u_stride;
    T* __restrict out = static_cast<T*>(o.out) + r * o.out_stride;
    const float w = kW ? p.w[r * p.w_stride] : 1.0f;
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) {
      float gv = Io<T>::load(g[j * kStep]);
      float uv = Io<T>::load(u[j * kStep]);
      out[j] = Io<T>::store(math::glu_fwd<A>(gv, uv, w, c));
    }
  }
}

// dg/du may be g/u themselves (in-place backward): each iteration reads its
// inputs before it stores, and no iteration touches another's elements, so the
// simd loop is correct for exact aliasing (partial overlap is refused earlier).
template <typename T, Activation A, int kStep, bool kW, bool kDW>
void bwd_rows(const GluProblem& p, const BwdIO& io, int64_t r0, int64_t r1) {
  const math::Coeffs c = coeffs_of(p);
  const int64_t F = p.F;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
    const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
    const T* dy = static_cast<const T*>(io.dy) + r * io.dy_stride;
    T* dg = static_cast<T*>(io.dg) + r * io.dg_stride;
    T* du = static_cast<T*>(io.du) + r * io.du_stride;
    const float w = kW ? p.w[r * p.w_stride] : 1.0f;
    if constexpr (kDW) {
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < F; ++j) {
        float dgv, duv, dwt;
        math::glu_bwd<A>(Io<T>::load(g[j * kStep]), Io<T>::load(u[j * kStep]),
                         Io<T>::load(dy[j]), w, c, dgv, duv, dwt);
        dg[j * kStep] = Io<T>::store(dgv);
        du[j * kStep] = Io<T>::store(duv);
        acc += dwt;
      }
      io.dw[r * io.dw_stride] = acc;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) {
        float dgv, duv, dwt;
        math::glu_bwd<A>(Io<T>::load(g[j * kStep]), Io<T>::load(u[j * kStep]),
                         Io<T>::load(dy[j]), w, c, dgv, duv, dwt);
        dg[j * kStep] = Io<T>::store(dgv);
        du[j * kStep] = Io<T>::store(duv);
      }
    }
  }
}

// Element-operations per row, for the threading threshold: backward does
// about twice the arithmetic of forward.
constexpr int64_t kFwdCost = 1, kBwdCost = 2;

}  // namespace

Status cpu_forward(const GluProblem& p, const FwdOutput& o) {
  return dispatch_dtype(p.dtype, [&](auto dt) {
    using T = typename Storage<decltype(dt)::value>::type;
    return dispatch_act(p.params.act, [&](auto act) {
      return dispatch_step(p.step, [&](auto step) {
        return dispatch_bool(p.w != nullptr, [&](auto weighted) {
          parallel_for(p.rows, p.F * kFwdCost, [&](int64_t r0, int64_t r1) {
            fwd_rows<T, decltype(act)::value, decltype(step)::value, decltype(weighted)::value>(
                p, o, r0, r1);
          });
          return Status::kOk;
        });
      });
    });
  });
}

Status cpu_backward(const GluProblem& p, const BwdIO& io) {
  return dispatch_dtype(p.dtype, [&](auto dt) {
    using T = typename Storage<decltype(dt)::value>::type;
    return dispatch_act(p.params.act, [&](auto act) {
      return dispatch_step(p.step, [&](auto step) {
        return dispatch_bool(p.w != nullptr, [&](auto weighted) {
          return dispatch_bool(io.dw != nullptr, [&](auto want_dw) {
            constexpr bool kW = decltype(weighted)::value;
            constexpr bool kDW = kW && decltype(want_dw)::value;
            parallel_for(p.rows, p.F * kBwdCost, [&](int64_t r0, int64_t r1) {
              bwd_rows<T, decltype(act)::value, decltype(step)::value, kW, kDW>(p, io, r0, r1);
            });
            return Status::kOk;
          });
        });
      });
    });
  });
}

}  // namespace expertact::detail
