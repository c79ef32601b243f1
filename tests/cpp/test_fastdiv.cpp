// The division by a per-call constant of the flat CUDA kernels
// (src/core/fastdiv.h), checked on the host against plain division: every
// divisor up to 2^12 with dense and edge dividends, then divisors near powers of
// two and random ones up to 2^31 - 1, dividends up to the bound (2^31 - 1).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/fastdiv.h"

namespace {

using expertact::math::div_fast;
using expertact::math::div_magic;

void check_divisor(uint32_t d, const std::vector<uint32_t>& ns) {
  const auto k = div_magic(d);
  for (uint32_t n : ns) ASSERT_EQ(div_fast(n, k), n / d) << n << " / " << d;
  // Around every multiple's edges where the quotient steps, near the top.
  const uint32_t top = 0x7fffffffu;
  for (uint32_t q : {1u, 2u, 3u, top / d - 1, top / d}) {
    const uint64_t m = static_cast<uint64_t>(q) * d;
    for (int64_t e = -1; e <= 1; ++e) {
      const int64_t n = static_cast<int64_t>(m) + e;
      if (n < 0 || n > top) continue;
      ASSERT_EQ(div_fast(static_cast<uint32_t>(n), k), static_cast<uint32_t>(n) / d) << n << " / " << d;
    }
  }
}

TEST(FastDiv, MatchesDivision) {
  std::mt19937 rng(12345);
  std::uniform_int_distribution<uint32_t> any(0, 0x7fffffffu);
  std::vector<uint32_t> ns;
  for (uint32_t n = 0; n < 5000; ++n) ns.push_back(n);
  for (int i = 0; i < 200; ++i) ns.push_back(any(rng));
  ns.push_back(0x7fffffffu);
  ns.push_back(0x7ffff000u);
  for (uint32_t d = 1; d <= 4096; ++d) check_divisor(d, ns);
  std::vector<uint32_t> ds;
  for (int b = 12; b <= 30; ++b)
    for (int e = -3; e <= 3; ++e) ds.push_back((1u << b) + static_cast<uint32_t>(e));
  ds.push_back(0x7fffffffu);
  ds.push_back(0x7ffffffeu);
  ds.push_back(384);     // 3072 bf16 columns in 16-byte packs
  ds.push_back(360);     // 2881 columns merged rows never divide; 2880 / 8
  for (int i = 0; i < 2000; ++i) ds.push_back(std::max<uint32_t>(1, any(rng)));
  for (uint32_t d : ds) check_divisor(d, ns);
}

TEST(FastDiv, MagicFitsAndOneIsIdentity) {
  const auto one = div_magic(1);
  EXPECT_TRUE(one.one);
  EXPECT_EQ(div_fast(0x7fffffffu, one), 0x7fffffffu);
  for (uint32_t d : {2u, 3u, 7u, 384u, 1u << 30, (1u << 30) + 1, 0x7fffffffu}) {
    const auto k = div_magic(d);
    EXPECT_FALSE(k.one);
    EXPECT_LE(k.s, 30u);
    // m > 2^32 / 2: the multiply-high keeps enough bits (m = ceil(2^(32+s) / d), d <= 2^(s+1)).
    EXPECT_GE(k.m, 0x80000000u) << d;
  }
}

}  // namespace
