// Division of 31-bit indices by a divisor fixed per call (a multiply-high and a
// shift instead of the ~20-instruction integer division), used by the flat CUDA
// kernels to turn a pack index into (row, column); __host__ __device__ so the
// CPU tests check it against plain division.
#pragma once

#include <cstdint>

#include "core/math.h"

namespace expertact::math {

// For a divisor d in [1, 2^31): with s = ceil(log2 d) - 1 and
// m = ceil(2^(32 + s) / d) (d > 2^s, so m < 2^32), every n < 2^31 has
//   n / d == (n * m) >> (32 + s) == umulhi(n, m) >> s.
// Proof: n m / 2^(32+s) = n / d + n e / (d 2^(32+s)) with e = m d - 2^(32+s)
// in [0, d); as d <= 2^(s+1) and n < 2^31 the second term is below 1 / d, and
// the fraction of n / d is at most (d - 1) / d, so the floor is unchanged.
// d == 1 has no such m: `one` selects n itself.
struct DivMagic {
  uint32_t d = 1;
  uint32_t m = 0;
  uint32_t s = 0;
  bool one = true;
};

// Host side, once per call. Needs 1 <= d < 2^31.
inline DivMagic div_magic(uint32_t d) {
  DivMagic r;
  r.d = d;
  r.one = d == 1;
  if (r.one) return r;
  uint32_t l = 0;
  while ((uint64_t{1} << l) < d) ++l;  // ceil(log2 d), >= 1
  r.s = l - 1;
  r.m = static_cast<uint32_t>(((uint64_t{1} << (32 + r.s)) + d - 1) / d);
  return r;
}

EA_HD uint32_t umulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// n / d for n < 2^31.
EA_HD uint32_t div_fast(uint32_t n, const DivMagic& k) {
  return k.one ? n : umulhi32(n, k.m) >> k.s;
}

}  // namespace expertact::math
