// One row of the CPU FP8 activation forms in float32, shared by the rowwise (src/cpu/fp8_cpu.cpp)
// and blockwise (src/cpu/fp8_tiles_cpu.cpp) paths, so that both quantise the same values: the
// activation h of a row (the bias added in float32, as the biased activation adds it) and the
// gradient of its packed gate_up with its optional outputs. Plain loops over math.h's scalar math.
#pragma once

#include <cstdint>

#include "core/bias.h"
#include "core/math.h"
#include "core/problem.h"
#include "cpu/host_dtype.h"

namespace expertact::detail {

// Gate's and up's bias rows of expert e (null when the row has none: no bias, or e outside
// [0, E), a row past the last offset).
template <typename T>
void bias_rows(const GluBias* bias, int64_t e, const T*& bg, const T*& bu) {
  bg = bu = nullptr;
  if (bias && e >= 0 && e < bias->er.experts) {
    bg = static_cast<const T*>(bias->bg) + e * bias->b_stride;
    bu = static_cast<const T*>(bias->bu) + e * bias->b_stride;
  }
}

// h[j] (j < F) of row r: act(gate [+ bg], up [+ bu]) * w in float32 (bg null: no bias).
template <Activation A, typename T>
void glu_row(const GluProblem& p, const math::Coeffs& c, int64_t r, const T* bg, const T* bu, float* h) {
  const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
  const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
  const float w = p.w ? p.w[r * p.w_stride] : 1.0f;
  if (bg) {
    for (int64_t j = 0; j < p.F; ++j)
      h[j] = math::glu_fwd<A>(Cv<T>::ld(g[j * p.step]) + Cv<T>::ld(bg[j * p.step]),
                              Cv<T>::ld(u[j * p.step]) + Cv<T>::ld(bu[j * p.step]), w, c);
  } else {
    for (int64_t j = 0; j < p.F; ++j)
      h[j] = math::glu_fwd<A>(Cv<T>::ld(g[j * p.step]), Cv<T>::ld(u[j * p.step]), w, c);
  }
}

// The float32 gradient of row r's packed gate_up into grad[0, 2F) in gate_up's column layout
// (d.q_g, d.q_u), then d's optional outputs: dw (the row's float32 sum of its terms, in column
// order) and dgu (grad rounded to T).
template <Activation A, typename T>
void glu_grad_row(const GluProblem& p, const math::Coeffs& c, const PackedBwdIO& d, int64_t r, const T* bg,
                  const T* bu, float* grad) {
  const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
  const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
  const T* dy = static_cast<const T*>(d.dy) + r * d.dy_stride;
  const float w = p.w ? p.w[r * p.w_stride] : 1.0f;
  float dw = 0.0f;
  for (int64_t j = 0; j < p.F; ++j) {
    float gv = Cv<T>::ld(g[j * p.step]), uv = Cv<T>::ld(u[j * p.step]);
    if (bg) {
      gv += Cv<T>::ld(bg[j * p.step]);
      uv += Cv<T>::ld(bu[j * p.step]);
    }
    float dg, du, term;
    math::glu_bwd<A>(gv, uv, Cv<T>::ld(dy[j]), w, c, dg, du, term);
    grad[d.q_g + j * p.step] = dg;
    grad[d.q_u + j * p.step] = du;
    dw += term;
  }
  if (d.dw) d.dw[r * d.dw_stride] = dw;
  if (d.dgu) {
    T* dst = static_cast<T*>(d.dgu) + r * d.dgu_stride;
    for (int64_t j = 0; j < 2 * p.F; ++j) dst[j] = Cv<T>::st(grad[j]);
  }
}

}  // namespace expertact::detail
