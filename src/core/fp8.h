// float8 e4m3fn and the rowwise power-of-two scales of the FP8 paths (docs/spec.md section
// 10), shared by the CPU and CUDA code: the conversion rounds to nearest even and saturates
// at +-448 (the e4m3fn format has no infinities; 0x7f is NaN).
#pragma once

#include <cstdint>

#include "core/math.h"

namespace expertact::fp8 {

constexpr float kMax = 448.0f;     // the largest finite e4m3fn value
constexpr float kAmaxFloor = 1e-12f;  // amax below this is taken as this (no division by 0)
constexpr int64_t kTile = 128;     // the blockwise recipe's tile edge (1 x 128, 128 x 128, 128 x 1)

// f (any float) -> e4m3fn bits: nearest even, |f| >= 448 -> +-448, NaN -> 0x7f with f's sign.
EA_HD uint8_t from_float(float f) {
  const uint32_t b = math::as_bits(f);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;
  const float af = math::as_float(a);
  if (af >= kMax) return sign | 0x7e;
  if (af < 0.015625f) {  // below 2^-6: subnormals, m x 2^-9 (m = 8 is the smallest normal)
    const float m = af * 512.0f;  // exact
    float r = static_cast<float>(static_cast<int32_t>(m));
    const float frac = m - r;
    if (frac > 0.5f || (frac == 0.5f && (static_cast<int32_t>(r) & 1))) r += 1.0f;
    return sign | static_cast<uint8_t>(static_cast<int32_t>(r));
  }
  const uint32_t e = (a >> 23) - 127 + 7;  // 1..15
  const uint32_t mant = a & 0x7fffffu;
  const uint32_t rounded = mant + 0x7ffffu + ((mant >> 20) & 1u);  // nearest even at 3 bits
  const uint32_t v = (e << 3) + (rounded >> 20);                   // a carry bumps the exponent
  return sign | static_cast<uint8_t>(v);
}

// e4m3fn bits -> float (exact).
EA_HD float to_float(uint8_t q) {
  const uint32_t sign = static_cast<uint32_t>(q & 0x80) << 24;
  const uint32_t e = (q >> 3) & 0xf, m = q & 0x7;
  if (e == 0xf && m == 0x7) return math::as_float(sign | 0x7fc00000u);
  const float mag = e == 0 ? static_cast<float>(m) * 0.001953125f  // m x 2^-9
                           : math::as_float(((e - 7 + 127) << 23) | (m << 20));
  return math::as_float(sign | math::as_bits(mag));
}

// The quantisation multiplier of a row with largest magnitude amax (NaN-free; +inf allowed):
// 2^floor(log2(float32(448 / double(max(amax, 1e-12))))); 0 when amax is +inf.
EA_HD float scale_of_by_division(float amax) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  const float s = static_cast<float>(static_cast<double>(kMax) / static_cast<double>(a));
  return math::as_float(math::as_bits(s) & 0x7f800000u);  // s is normal or 0 here
}

// scale_of_by_division by exponent arithmetic, the same float for every amax (the host tests
// compare the two): with a = max(amax, 1e-12) = m 2^e (a normal, 1 <= m < 2) and 448 = 1.75 2^8,
// the quotient is (1.75 / m) 2^(8 - e), whose power of two is 2^(8 - e) for m <= 1.75 and
// 2^(7 - e) above (1.75 / m, at most 1 - 6.8e-8 for the floats m > 1.75, does not round up to 1
// in float32 or through double); the exponent lies in [-120, 48], a normal one. +inf gives 0.
EA_HD float scale_of(float amax) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  const uint32_t b = math::as_bits(a);
  if (b >= 0x7f800000u) return 0.0f;
  const uint32_t k = 254u + 8u - (b >> 23) - ((b & 0x7fffffu) > 0x600000u ? 1u : 0u);  // 127 + 8 - e - ..
  return math::as_float(k << 23);
}

// An already scaled value x = v * s as quantize writes it: e4m3fn(clamp(x, -448, 448)); a
// NaN is written 0x7f whatever its sign, because the sign of the NaN that 0 x inf makes
// differs between platforms (negative on x86, positive on NVIDIA GPUs) and the CPU and CUDA
// paths must give the same bytes.
EA_HD uint8_t from_scaled(float x) { return x != x ? static_cast<uint8_t>(0x7f) : from_float(x); }

// One value quantised with multiplier s: e4m3fn(clamp(v * s, -448, 448)).
EA_HD uint8_t quantize(float v, float s) { return from_scaled(v * s); }

// from_scaled of two values, x0's byte low: the GPU kernels' form. On sm_89 and later one
// cvt.rn.satfinite.e4m3x2.f32 does both conversions with from_float's rules (nearest even,
// subnormals, |x| >= 448 and infinities to +-448, the sign of zero kept) in about a sixth of
// from_float's instructions, which bound the FP8 kernels otherwise; NaN, which it keeps as
// NaN, is then written 0x7f as from_scaled does. Elsewhere (the CPU, older GPUs) from_scaled
// twice.
EA_HD uint32_t from_scaled2(float x0, float x1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(x1), "f"(x0));  // x1 -> high byte
  uint32_t b = r;
  if (x0 != x0) b = (b & 0xff00u) | 0x7fu;
  if (x1 != x1) b = (b & 0x00ffu) | 0x7f00u;
  return b;
#else
  return static_cast<uint32_t>(from_scaled(x0)) | (static_cast<uint32_t>(from_scaled(x1)) << 8);
#endif
}

// 1 / v by exponent arithmetic, when v is a positive normal power of two whose reciprocal is
// normal (every scale the column-wise scale kernel writes: 1 / q with q in [2^-119, 2^48]): true
// and r set to the exact reciprocal; false for anything else (the caller divides).
EA_HD bool recip_pow2(float v, float& r) {
  const uint32_t b = math::as_bits(v);
  if ((b & 0x807fffffu) != 0 || b - 0x00800000u >= 0x7e800000u) return false;
  r = math::as_float(0x7f000000u - b);
  return true;
}

// 1 / s for a multiplier scale_of gives (a normal power of two, or 0): by exponent arithmetic
// where recip_pow2 allows (every s but 0), else divided; the same float either way.
EA_HD float inv_scale(float s) {
  float r;
  return recip_pow2(s, r) ? r : 1.0f / s;
}

// Four e4m3fn bytes with every NaN (0x7f or 0xff, e4m3fn's only NaN bytes) written 0x7f: the
// sign bit cleared where a byte's low 7 bits are all ones (adding 1 to those bits carries into
// bit 7 of that byte only).
EA_HD uint32_t nan_bytes_7f(uint32_t w) { return w & ~(((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u); }

// from_scaled of four values as one word, x0's byte lowest. On sm_89 and later two conversions
// and one NaN fix-up (nan_bytes_7f) for the four bytes.
EA_HD uint32_t from_scaled4(float x0, float x1, float x2, float x3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
  return nan_bytes_7f(static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16));
#else
  return from_scaled2(x0, x1) | (from_scaled2(x2, x3) << 16);
#endif
}

}  // namespace expertact::fp8
