// The bit arithmetic of the FP8 kernels (src/core/fp8.h), checked on the host: the NaN fix-up
// of four e4m3fn bytes at once against the byte-by-byte rule for every byte value in every
// position, and the reciprocal of a power of two by exponent arithmetic against IEEE division
// for every float exponent, both signs, zero, infinity, NaN and values that are not powers of two,
// inv_scale (the kernels' reciprocal of a scale) against the division for every scale, and
// scale_of's exponent arithmetic against its definition by division.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "core/fp8.h"

namespace {

using expertact::fp8::inv_scale;
using expertact::fp8::nan_bytes_7f;
using expertact::fp8::recip_pow2;
using expertact::fp8::scale_of;
using expertact::fp8::scale_of_by_division;
using expertact::math::as_bits;
using expertact::math::as_float;

uint32_t bytewise(uint32_t w) {
  uint32_t out = 0;
  for (int k = 0; k < 4; ++k) {
    uint32_t b = (w >> (8 * k)) & 0xffu;
    if (b == 0xffu) b = 0x7fu;
    out |= b << (8 * k);
  }
  return out;
}

TEST(Fp8Bits, NanBytesEveryValueEveryPosition) {
  std::mt19937 gen(7);
  for (int pos = 0; pos < 4; ++pos) {
    for (uint32_t v = 0; v < 256; ++v) {
      for (int rep = 0; rep < 64; ++rep) {
        uint32_t w = gen();
        w = (w & ~(0xffu << (8 * pos))) | (v << (8 * pos));
        ASSERT_EQ(nan_bytes_7f(w), bytewise(w)) << std::hex << w;
      }
    }
  }
  for (uint32_t w : {0u, 0xffffffffu, 0x7f7f7f7fu, 0x7e7e7e7eu, 0xfefefefeu, 0x80808080u, 0xff00ff00u})
    EXPECT_EQ(nan_bytes_7f(w), bytewise(w)) << std::hex << w;
}

TEST(Fp8Bits, RecipPow2MatchesDivision) {
  int exact = 0;
  for (uint32_t e = 0; e < 256; ++e) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (uint32_t mant : {0u, 1u, 0x400000u, 0x7fffffu}) {
        const float v = as_float(sign | (e << 23) | mant);
        float r = -1.0f;
        if (!recip_pow2(v, r)) continue;
        ++exact;
        const float want = 1.0f / v;
        ASSERT_EQ(as_bits(r), as_bits(want)) << "v = " << v;
        EXPECT_TRUE(sign == 0 && mant == 0 && e >= 1 && e <= 253) << "taken for v = " << v;
      }
    }
  }
  EXPECT_EQ(exact, 253);  // every positive power of two from 2^-126 to 2^126
  float r = 0.0f;
  EXPECT_FALSE(recip_pow2(0.0f, r));
  EXPECT_FALSE(recip_pow2(std::numeric_limits<float>::infinity(), r));
  EXPECT_FALSE(recip_pow2(std::numeric_limits<float>::quiet_NaN(), r));
  EXPECT_FALSE(recip_pow2(std::ldexp(1.0f, 127), r));    // 2^-127 is subnormal
  EXPECT_FALSE(recip_pow2(std::ldexp(1.0f, -149), r));   // a subnormal power of two
  EXPECT_FALSE(recip_pow2(3.0f, r));
}

// scale_of by exponent arithmetic against its definition by division: every mantissa at the
// amax floor's exponent, around 1, 448 and 2^73 and at the largest; a spread of mantissas (every
// 251st, and the edges around 1.75) at every exponent; zero, subnormals, the floor, +inf.
TEST(Fp8Bits, ScaleOfIsTheDivision) {
  auto same = [](uint32_t bits) {
    const float a = as_float(bits);
    return as_bits(scale_of(a)) == as_bits(scale_of_by_division(a));
  };
  int64_t checked = 0;
  for (uint32_t e : {87u, 126u, 127u, 135u, 200u, 254u}) {
    for (uint32_t mant = 0; mant < (1u << 23); ++mant, ++checked)
      ASSERT_TRUE(same((e << 23) | mant)) << "amax bits " << ((e << 23) | mant);
  }
  for (uint32_t e = 0; e < 255; ++e) {
    for (uint32_t mant = 0; mant < (1u << 23); mant += 251, ++checked) ASSERT_TRUE(same((e << 23) | mant));
    for (uint32_t mant = 0x5ffff0u; mant <= 0x600010u; ++mant, ++checked) ASSERT_TRUE(same((e << 23) | mant));
    ASSERT_TRUE(same((e << 23) | 0x7fffffu));
  }
  EXPECT_GT(checked, 50000000);
  for (const float a : {0.0f, 1e-12f, std::nextafter(1e-12f, 0.0f), std::nextafter(1e-12f, 1.0f), 1.75f, 448.0f,
                        std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
                        std::numeric_limits<float>::infinity()})
    EXPECT_TRUE(same(as_bits(a))) << a;
  EXPECT_EQ(scale_of(std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(scale_of(448.0f), 1.0f);
  EXPECT_EQ(scale_of(1.0f), 256.0f);
  EXPECT_EQ(scale_of(1.75f), 256.0f);
  EXPECT_EQ(scale_of(std::nextafter(1.75f, 2.0f)), 128.0f);
}

// The scales the kernels write, 1 / scale_of(amax), by inv_scale: the division's bits for every
// amax exponent, the floor and below it, and +inf (scale 0, its reciprocal +inf).
TEST(Fp8Bits, InvScaleIsTheDivision) {
  for (uint32_t e = 0; e < 255; ++e) {
    for (uint32_t mant : {0u, 1u, 0x2a5555u, 0x7fffffu}) {
      const float s = scale_of(as_float((e << 23) | mant));
      ASSERT_EQ(as_bits(inv_scale(s)), as_bits(1.0f / s)) << "amax bits " << ((e << 23) | mant);
    }
  }
  const float s_inf = scale_of(std::numeric_limits<float>::infinity());
  EXPECT_EQ(as_bits(s_inf), 0u);
  EXPECT_EQ(inv_scale(s_inf), std::numeric_limits<float>::infinity());
}

}  // namespace
