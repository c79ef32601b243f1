// The elementwise math of docs/spec.md section 1, written once as __host__ __device__
// float functions shared by the CPU and CUDA paths. Everything is branch-free
// (selects, not fminf/fmaxf, which would turn NaN into the bound) so that the
// CPU loops vectorize and NaN propagates exactly as in eager PyTorch.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

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

constexpr float kLog2e = 1.4426950408889634f;

#if defined(__CUDA_ARCH__)
// 2^t with the flush-to-zero form of ex2: one MUFU instruction, where the
// IEEE-denormal form adds range fix-ups around it. Only results below 2^-126
// differ (they become 0), which no sigmoid or tanh here can see.
__device__ __forceinline__ float exp2_f(float t) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(t));
  return y;
}
#endif

// e^x. On the device: ex2.approx (as __expf: relative error ~2 ulp + |x| * 2^-24,
// which only touches results whose magnitude is far below the tolerances). On the host a branch-free
// version the compiler vectorizes (glibc's expf is a scalar call): x = n ln2 + r,
// |r| <= ln2/2, e^r by a degree-6 polynomial (minimax for relative error on
// that interval, 3.1e-9 before float32 rounding), times 2^n built in the
// exponent bits. Past ln(FLT_MAX) the product
// overflows to +inf by itself; below about -87.0 (results under 1.7e-38, where
// 1 + e^x, the only use here, is exactly 1) it is 0. NaN in, NaN out.
EA_HD float exp_f(float x) {
#if defined(__CUDA_ARCH__)
  return exp2_f(x * kLog2e);
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
  // 2 e^r (the coefficients doubled, exactly), so that 2 e^r 2^(n - 1) reaches
  // 2^128 (inf) at n = 128 without a 2^128 scale. One multiply-add fewer than
  // the degree-7 Taylor series it replaced (whose truncation was 7.5e-9).
  float p = 2.0f * 1.381461100e-3f;
  p = p * r + 2.0f * 8.368710035e-3f;
  p = p * r + 2.0f * 4.166838741e-2f;
  p = p * r + 2.0f * 1.666652069e-1f;
  p = p * r + 2.0f * 4.999999345e-1f;
  p = p * r + 2.0f;
  p = p * r + 2.0f;
  return p * scale;
#endif
}

// 1 / b. On the device rcp.approx.ftz: one MUFU instruction (div.approx.ftz's 1 / b is the
// same reciprocal followed by a flush of its result, the same values); it returns 0 for
// |b| > 2^126, which is what sigmoid and tanh want there (the exact value is below 1e-37). On
// the host an IEEE division.
EA_HD float recip_f(float b) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(b));
  return y;
#else
  return 1.0f / b;
#endif
}

// float64 (the CPU gradient-checking path only): the C library's exp and an
// IEEE division; nothing in float64 runs on the device.
EA_HD double exp_f(double x) { return ::exp(x); }
EA_HD double recip_f(double b) { return 1.0 / b; }

// Everything below is written once for the compute type S: float for every
// storage dtype of the kernels, double for the float64 path.
// 1 / (1 + e^m), the sigmoid of -m. The activations pass their argument already
// negated, (-alpha) * x with the negation on the constant (the same float as
// -(alpha * x)), which saves a negation per element in the CPU loops.
template <typename S>
EA_HD S sigmoid_neg_f(S m) { return recip_f(S(1) + exp_f(m)); }
template <typename S>
EA_HD S sigmoid_f(S x) { return sigmoid_neg_f(-x); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// min / max that return NaN when either operand is NaN (min.NaN, max.NaN: sm_80 and later;
// earlier GPUs take the selects below): torch.clamp's semantics in one instruction where the
// select takes a compare and a select.
__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
#endif

// min(g, L) with NaN kept (torch.clamp(max=L) semantics).
template <typename S>
EA_HD S clamp_hi(S g, S L) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<S, float>) return min_nan(g, L);
#endif
  return g > L ? L : g;
}
// clamp(u, -L, L) with NaN kept (L > 0). Two one-sided selects rather than a
// nested one: each is a single max/min instruction on x86, the nested form
// compiled to eight.
template <typename S>
EA_HD S clamp_sym(S u, S L) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<S, float>) return min_nan(max_nan(u, -L), L);
#endif
  S t = u < -L ? -L : u;
  return t > L ? L : t;
}

// The activations. fwd gives act(x); fwd_bwd gives act(x) and act'(x) together.
template <Activation A>
struct Act;

template <>
struct Act<Activation::kSilu> {
  // silu_alpha(x) = x * sigmoid(alpha x); derivative s (1 + alpha x (1 - s)).
  // The derivative as s + (alpha a) (1 - s) with a = x s: one multiply fewer than the
  // factored form. On the device the sigmoid's argument is x (-alpha log2 e), the constant
  // taken out of the loops: one multiply an element where (-alpha) x, then exp_f's x log2 e,
  // take two (the GPU kernels of the FP8 paths are bound by their instructions:
  // docs/notes/perf-notes-fp8.md, "Fewer instructions an element: the device math and the fused
  // backward's amax").
  template <typename S>
  EA_HD static S sig(S x, S alpha) {
#if defined(__CUDA_ARCH__)
    if constexpr (std::is_same_v<S, float>) return recip_f(1.0f + exp2_f(x * ((-alpha) * kLog2e)));
#endif
    return sigmoid_neg_f((-alpha) * x);
  }
  template <typename S>
  EA_HD static S fwd(S x, S alpha) { return x * sig(x, alpha); }
  template <typename S>
  EA_HD static void fwd_bwd(S x, S alpha, S& a, S& da) {
    S s = sig(x, alpha);
    a = x * s;
    da = (alpha * a) * (S(1) - s) + s;
  }
};

// gelu_tanh's constants in each compute type.
template <typename S> struct GeluK;
template <> struct GeluK<float> {
  static constexpr float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float k1 = 0.044715f;
};
template <> struct GeluK<double> {
  static constexpr double k0 = 0.7978845608028654;
  static constexpr double k1 = 0.044715;
};

template <>
struct Act<Activation::kGeluTanh> {
  // gelu_tanh(x) = 0.5 x (1 + tanh(y)), y = k0 (x + k1 x^3), as
  // torch.nn.functional.gelu(approximate="tanh"), computed through the identity
  // (1 + tanh(y)) / 2 = sigmoid(2y): one exp and one division, as silu, and no
  // cancellation in 1 + tanh(y) for x << 0. Derivative: with s = sigmoid(2y),
  // 1 - tanh(y)^2 = 4 s (1 - s), so gelu' = s (1 + x (1 - s) 2 k0 (1 + 3 k1 x^2)).
  // 2y = x (c1 + c3 x^2) with c1 = 2 k0, c3 = 2 k0 k1; -2y = x ((-c1) + (-c3) x^2)
  // exactly, which sigmoid_neg_f takes.
  // sig(x, x2): s. log2 e is not folded into c1 and c3 on the device, as silu's is into its
  // constant: that rounds the argument differently, by up to 1.06x the CUDA-against-CPU
  // tolerance of the float32 gradient at |2y| near 20.
  template <typename S>
  EA_HD static S sig(S x, S x2) {
    const S c1 = S(2) * GeluK<S>::k0, c3 = S(2) * GeluK<S>::k0 * GeluK<S>::k1;
    return sigmoid_neg_f(x * ((-c1) + (-c3) * x2));
  }
  template <typename S>
  EA_HD static S fwd(S x, S) { return x * sig(x, x * x); }
  template <typename S>
  EA_HD static void fwd_bwd(S x, S, S& a, S& da) {
    const S c1 = S(2) * GeluK<S>::k0, c3 = S(2) * GeluK<S>::k0 * GeluK<S>::k1;
    S x2 = x * x;
    S s = sig(x, x2);
    a = x * s;
    da = s * (S(1) + x * (S(1) - s) * (c1 + S(3) * c3 * x2));
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
template <Activation A, typename S>
EA_HD S glu_fwd(S g, S u, S w, const Coeffs& c) {
  S gc = clamp_hi(g, S(c.limit));
  S uc = clamp_sym(u, S(c.limit));
  return Act<A>::fwd(gc, S(c.alpha)) * (uc + S(c.beta)) * w;
}

// The gradients of one element: dg, du, and this element's term of grad_w
// (dy * a * (uc + beta), summed over the row in float32 by the caller); and h, the forward's
// value act(gc) (uc + beta) w, bit for bit glu_fwd's.
// Masks are inclusive (g == L passes, as torch.clamp's backward) and false at
// NaN when clamped; unclamped (limit = inf) nothing is masked.
template <Activation A, typename S>
EA_HD void glu_bwd_h(S g, S u, S dy, S w, const Coeffs& c, S& dg, S& du, S& dw_term, S& h) {
  const S L = S(c.limit);
  S gc = clamp_hi(g, L);
  S uc = clamp_sym(u, L);
  S a, da;
  Act<A>::fwd_bwd(gc, S(c.alpha), a, da);
  S v = uc + S(c.beta);
  S dyw = dy * w;
  bool gpass = (!c.has_limit) | (g <= L);
  bool upass = (!c.has_limit) | (std::fabs(u) <= L);  // -L <= u <= L as one compare of |u|
  S dgv = dyw * v * da;
  S duv = dyw * a;
  dg = gpass ? dgv : S(0);
  du = upass ? duv : S(0);
  dw_term = dy * a * v;
  h = a * v * w;  // glu_fwd's value: the same operations in the same order
}

// glu_bwd_h without h, the forward's value (the compiler drops its arithmetic where unused).
template <Activation A, typename S>
EA_HD void glu_bwd(S g, S u, S dy, S w, const Coeffs& c, S& dg, S& du, S& dw_term) {
  S h;
  glu_bwd_h<A>(g, u, dy, w, c, dg, du, dw_term, h);
}

}  // namespace expertact::math
