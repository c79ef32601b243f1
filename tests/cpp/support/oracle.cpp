// The float64 oracle and its float32 error bound (see oracle.h).
//
// Model of one float32 implementation of the formula (the library's CPU and
// CUDA paths both evaluate it in this shape):
//   silu:  z = alpha*gc, s = 1/(1+exp(-z)), a = gc*s, a' = s*(1 + z*(1-s))
//   gelu:  y = k0*(gc + k1*gc^3), t = tanh(y), a = 0.5*gc*(1+t),
//          a' = 0.5*(1+t) + 0.5*gc*(1-t^2)*k0*(1+3*k1*gc^2)
//   out = (a*v)*w, v = uc + beta;   grad_g = ((dy*w)*v)*a';  grad_u = (dy*w)*a;
//   grad_w term = (dy*a)*v.
// exp is assumed within 3 ulp (CUDA's expf: 2; the library's host polynomial:
// ~2), a rounding of its argument becomes a relative error of the result.
// The rule for tanh holds for 1 - 2/(1+exp(2y)) and for a tanhf within 2 ulp.
#include "support/oracle.h"

#include <cmath>
#include <limits>

namespace eat {
namespace {

constexpr double kU = 0x1p-24;  // float32 unit roundoff

// A value, the bound on its float32 evaluation's error, and whether that
// evaluation may be NaN where v is infinite (see Ref::nan_ok).
struct Ev {
  double v;
  double e;
  bool nan_ok = false;
};

// Whether a float32 evaluation of a (nonzero) value may come out as 0: its
// bound, times the checks' factor 4, reaches it.
bool may_be_zero(const Ev& a) { return a.v != 0 && 4 * a.e >= std::fabs(a.v); }

// 0 * anything = 0 here (an exact zero factor kills an infinite bound).
double mul0(double a, double b) { return (a == 0 || b == 0) ? 0 : a * b; }

Ev exact(double v) { return {v, 0}; }
// A float32 constant standing for an irrational one (k0 = sqrt(2/pi), k1 = 0.044715).
Ev rounded_const(double v) { return {v, kU * std::fabs(v)}; }

Ev operator+(Ev a, Ev b) {
  const double v = a.v + b.v;
  return {v, a.e + b.e + kU * std::fabs(v), a.nan_ok || b.nan_ok};
}
Ev operator*(Ev a, Ev b) {
  const double v = a.v * b.v;
  const bool nan_ok = a.nan_ok || b.nan_ok || (std::isinf(a.v) && may_be_zero(b)) ||
                      (std::isinf(b.v) && may_be_zero(a));
  return {v, mul0(std::fabs(a.v), b.e) + mul0(std::fabs(b.v), a.e) + a.e * b.e + kU * std::fabs(v),
          nan_ok};
}

// sigmoid and 1 - sigmoid, both accurate in float64 (no cancellation).
double sig(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// s = 1/(1+E), E = exp(-z): rel err(E) = err(z) + 3u; 1+E and the division
// add 2u; d ln s / d ln E = -(1-s).
Ev sigmoid_ev(Ev z, double* one_minus_s) {
  const double s = sig(z.v), oms = sig(-z.v);
  *one_minus_s = oms;
  const double rel = mul0(oms, z.e + 3 * kU) + 2 * kU;
  return {s, mul0(s, rel)};
}

// t = 1 - 2/(1+exp(2y)): err(t) = (1-t^2)(err(y) + 1.5u) + 2(1-t)u + u|t|.
// Also gives 1+t = 2 sigmoid(2y) and 1-t^2 = sech^2(y) accurately.
Ev tanh_ev(Ev y, double* one_plus_t, double* sech2) {
  const double t = std::tanh(y.v);
  const double c = std::cosh(y.v);
  *sech2 = std::isinf(c) ? 0.0 : 1.0 / (c * c);
  *one_plus_t = 2.0 * sig(2.0 * y.v);
  const double e = mul0(*sech2, y.e + 1.5 * kU) + 2 * (1 - t) * kU + kU * std::fabs(t);
  return {t, e};
}

// a = act(gc) and a' = act'(gc).
void act_ev(const OracleParams& p, Ev gc, Ev& a, Ev& da) {
  if (!p.gelu) {
    const Ev z = exact(p.alpha) * gc;
    double oms = 0;
    const Ev s = sigmoid_ev(z, &oms);
    a = gc * s;
    const Ev one_minus_s{oms, s.e + kU * oms};
    da = s * (exact(1) + z * one_minus_s);
  } else {
    const double k0 = std::sqrt(2.0 / M_PI), k1 = 0.044715;
    const Ev x2 = gc * gc;
    const Ev y = rounded_const(k0) * (gc + rounded_const(k1) * x2 * gc);
    double opt = 0, sech2 = 0;
    const Ev t = tanh_ev(y, &opt, &sech2);
    const Ev one_plus_t{opt, t.e + kU * opt};
    // 1 - t*t: t*t rounds (u t^2), the subtraction rounds (u (1-t^2)).
    const Ev one_minus_t2{sech2, 2 * std::fabs(t.v) * t.e + kU * t.v * t.v + kU * sech2};
    const Ev half_x = exact(0.5) * gc;
    a = half_x * one_plus_t;
    da = exact(0.5) * one_plus_t +
         half_x * one_minus_t2 * rounded_const(k0) *
             (exact(1) + exact(3) * rounded_const(k1) * x2);
  }
}

// min(g, L) and clamp(u, -L, L), NaN kept; exact inputs.
double clamp_hi(const OracleParams& p, double g) { return p.has_limit && g > p.limit ? p.limit : g; }
double clamp_sym(const OracleParams& p, double u) {
  if (!p.has_limit) return u;
  return u > p.limit ? p.limit : (u < -p.limit ? -p.limit : u);
}

}  // namespace

OracleParams oracle_params(const expertact::GluParams& gp) {
  OracleParams p;
  p.gelu = gp.act == expertact::Activation::kGeluTanh;
  p.alpha = gp.alpha;
  p.limit = gp.limit;
  p.has_limit = std::isfinite(gp.limit);
  p.beta = gp.beta;
  p.beta_f = gp.beta;
  return p;
}

double oracle_silu(double x, double alpha) { return x * sig(alpha * x); }
// 0.5 x (1 + tanh(y)) with 1 + tanh(y) = 2 sigmoid(2y): no cancellation for x < 0.
double oracle_gelu_tanh(double x) {
  return x * sig(2.0 * std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x));
}

void oracle_forward_row(const OracleParams& p, const float* g, const float* u, double w,
                        int64_t F, Ref* out) {
  for (int64_t j = 0; j < F; ++j) {
    Ev a, da;
    act_ev(p, exact(clamp_hi(p, g[j])), a, da);
    const Ev v = exact(clamp_sym(p, u[j])) + exact(p.beta);
    const Ev o = a * v * exact(w);
    out[j] = Ref{o.v, o.e, false, o.nan_ok};
  }
}

void oracle_backward_row(const OracleParams& p, const float* g, const float* u, const float* dy,
                         double w, int64_t F, Ref* dg, Ref* du, Ref* dw) {
  double sum = 0, sum_e = 0, sum_abs = 0;
  bool sum_nan_ok = false;
  for (int64_t j = 0; j < F; ++j) {
    Ev a, da;
    act_ev(p, exact(clamp_hi(p, g[j])), a, da);
    const Ev v = exact(clamp_sym(p, u[j])) + exact(p.beta);
    const Ev dyw = exact(dy[j]) * exact(w);
    // Masks: inclusive, false at NaN; with no limit nothing is masked.
    const bool gpass = !p.has_limit || g[j] <= p.limit;
    const bool upass = !p.has_limit || (u[j] >= -p.limit && u[j] <= p.limit);
    if (gpass) {
      const Ev r = dyw * v * da;
      dg[j] = Ref{r.v, r.e, false, r.nan_ok};
    } else {
      dg[j] = Ref{0.0, 0.0, true};
    }
    if (upass) {
      const Ev r = dyw * a;
      du[j] = Ref{r.v, r.e, false, r.nan_ok};
    } else {
      du[j] = Ref{0.0, 0.0, true};
    }
    const Ev term = exact(dy[j]) * a * v;
    sum += term.v;
    sum_e += term.e;
    sum_abs += std::fabs(term.v);
    sum_nan_ok = sum_nan_ok || term.nan_ok;
  }
  // Accumulating F float32 terms: the worst case of a sequential sum is
  // (F-1) u sum|t|, but any reasonable order (lanes, a tree) with terms of
  // random sign stays near sqrt(F) u sum|t|; (sqrt(F) + 4) u sum|t| times the
  // caller's factor (4) is tight enough that dropping one average term of a
  // 14336-wide row (sum|t| / 14336) fails.
  if (dw)
    *dw = Ref{sum, sum_e + (std::sqrt(static_cast<double>(F)) + 4) * kU * sum_abs, false, sum_nan_ok};
}

}  // namespace eat
