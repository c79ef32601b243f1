// The elementwise math of SPEC section 1, written once as __host__ __device__
// float functions shared by the CPU and CUDA paths. Everything is branch-free
// (selects, not fminf/fmaxf, which would turn NaN into the bound) so that the
// CPU loops vectorize and NaN propagates exactly as in eager PyTorch.
#pragma once

#include <cstdint>

#include "expertact/expertact.hpp"

#if defined(__CUDACC__)
#define EA_HD __host__ __device__ __forceinline__
#else
#define EA_HD inline __attribute__((always_inline))
#endif

namespace expertact::math {

EA_HD float as_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  return __builtin_bit_cast(float, b);
#endif
}
EA_HD uint32_t as_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(uint32_t, f);
#endif
}

// e^x. On the device: ex2.approx (as __expf: relative error ~2 ulp + |x| * 2^-24,
// which only touches results whose magnitude is far below the tolerances). On the host a branch-free
// version the compiler vectorizes (glibc's expf is a scalar call): x = n ln2 + r,
// |r| <= ln2/2, e^r by its Taylor series to degree 7 (truncation < 2^-27
// relative), times 2^n built in the exponent bits. Past ln(FLT_MAX) the product
// overflows to +inf by itself; below about -87.0 (results under 1.7e-38, where
// 1 + e^x, the only use here, is exactly 1) it is 0. NaN in, NaN out.
EA_HD float exp_f(float x) {
#if defined(__CUDA_ARCH__)
  // 2^(x log2 e) with the flush-to-zero form of ex2: one MUFU instruction,
  // where the IEEE-denormal form adds range fix-ups around it. Only results
  // below 2^-126 differ (they become 0), which no sigmoid or tanh here can see.
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
#else
  // Two one-sided selects (each a single min/max on x86; NaN fails both
  // comparisons and passes through). kHi: e^89 > FLT_MAX. kLo: n = -126 there.
  const float kHi = 89.0f, kLo = -87.5f;
  float xc = x < kLo ? kLo : x;
  xc = xc > kHi ? kHi : xc;
  // Adding kShift = 1.5 * 2^23 + 126 rounds x log2(e) to the integer n and leaves
  // n + 126 in the low mantissa bits of t: shifted up 23 bits, those are the
  // float 2^(n - 1) (n + 126 in [0, 254]; 0 gives +0, the flush above).
  const float kShift = 12583038.0f;
  float t = xc * 1.44269504f + kShift;
  float n = t - kShift;
  float scale = as_float(as_bits(t) << 23);
  float r = xc - n * 0.693145752f;  // ln2 split in two: hi has 16 significant bits,
  r = r - n * 1.42860677e-6f;       // so n * hi is exact for |n| <= 256
  // 2 e^r (the Taylor coefficients doubled, exactly), so that 2 e^r 2^(n - 1)
  // reaches 2^128 (inf) at n = 128 without a 2^128 scale.
  float p = 2.0f / 5040.0f;
  p = p * r + 2.0f / 720.0f;
  p = p * r + 2.0f / 120.0f;
  p = p * r + 2.0f / 24.0f;
  p = p * r + 2.0f / 6.0f;
  p = p * r + 1.0f;
  p = p * r + 2.0f;
  p = p * r + 2.0f;
  return p * scale;
#endif
}

// a / b. On the device the fast division (div.approx, as __fdividef:
// reciprocal + multiply, ~2 ulp); it returns 0 for |b| > 2^126, which is what sigmoid and tanh want there (the
// exact quotient is below 1e-37). On the host an IEEE division.
EA_HD float div_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("div.approx.ftz.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
#else
  return a / b;
#endif
}

EA_HD float sigmoid_f(float x) { return div_f(1.0f, 1.0f + exp_f(-x)); }


// min(g, L) with NaN kept (torch.clamp(max=L) semantics).
EA_HD float clamp_hi(float g, float L) { return g > L ? L : g; }
// clamp(u, -L, L) with NaN kept (L > 0). Two one-sided selects rather than a
// nested one: each is a single max/min instruction on x86, the nested form
// compiled to eight.
EA_HD float clamp_sym(float u, float L) {
  float t = u < -L ? -L : u;
  return t > L ? L : t;
}

// The activations. fwd gives act(x); fwd_bwd gives act(x) and act'(x) together.
template <Activation A>
struct Act;

template <>
struct Act<Activation::kSilu> {
  // silu_alpha(x) = x * sigmoid(alpha x); derivative s (1 + alpha x (1 - s)).
  EA_HD static float fwd(float x, float alpha) { return x * sigmoid_f(alpha * x); }
  EA_HD static void fwd_bwd(float x, float alpha, float& a, float& da) {
    float s = sigmoid_f(alpha * x);
    a = x * s;
    da = s * (1.0f + alpha * x * (1.0f - s));
  }
};

template <>
struct Act<Activation::kGeluTanh> {
  // gelu_tanh(x) = 0.5 x (1 + tanh(y)), y = k0 (x + k1 x^3), as
  // torch.nn.functional.gelu(approximate="tanh"), computed through the identity
  // (1 + tanh(y)) / 2 = sigmoid(2y): one exp and one division, as silu, and no
  // cancellation in 1 + tanh(y) for x << 0. Derivative: with s = sigmoid(2y),
  // 1 - tanh(y)^2 = 4 s (1 - s), so gelu' = s (1 + x (1 - s) 2 k0 (1 + 3 k1 x^2)).
  static constexpr float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float k1 = 0.044715f;
  static constexpr float c1 = 2.0f * k0;            // 2y = x (c1 + c3 x^2)
  static constexpr float c3 = 2.0f * k0 * k1;
  EA_HD static float fwd(float x, float) {
    float s = sigmoid_f(x * (c1 + c3 * (x * x)));
    return x * s;
  }
  EA_HD static void fwd_bwd(float x, float, float& a, float& da) {
    float x2 = x * x;
    float s = sigmoid_f(x * (c1 + c3 * x2));
    a = x * s;
    da = s * (1.0f + x * (1.0f - s) * (c1 + 3.0f * c3 * x2));
  }
};

// Per-call constants, hoisted out of the loops.
struct Coeffs {
  float alpha;
  float limit;  // +inf when unclamped
  float beta;
  bool has_limit;
};

// out = act(min(g, L)) * (clamp(u, -L, L) + beta) * w
template <Activation A>
EA_HD float glu_fwd(float g, float u, float w, const Coeffs& c) {
  float gc = clamp_hi(g, c.limit);
  float uc = clamp_sym(u, c.limit);
  return Act<A>::fwd(gc, c.alpha) * (uc + c.beta) * w;
}

// The gradients of one element: dg, du, and this element's term of grad_w
// (dy * a * (uc + beta), summed over the row in float32 by the caller).
// Masks are inclusive (g == L passes, as torch.clamp's backward) and false at
// NaN when clamped; unclamped (limit = inf) nothing is masked.
template <Activation A>
EA_HD void glu_bwd(float g, float u, float dy, float w, const Coeffs& c, float& dg, float& du,
                   float& dw_term) {
  float gc = clamp_hi(g, c.limit);
  float uc = clamp_sym(u, c.limit);
  float a, da;
  Act<A>::fwd_bwd(gc, c.alpha, a, da);
  float v = uc + c.beta;
  float dyw = dy * w;
  bool gpass = (!c.has_limit) | (g <= c.limit);
  bool upass = (!c.has_limit) | ((u >= -c.limit) & (u <= c.limit));
  float dgv = dyw * v * da;
  float duv = dyw * a;
  dg = gpass ? dgv : 0.0f;
  du = upass ? duv : 0.0f;
  dw_term = dy * a * v;
}

}  // namespace expertact::math
