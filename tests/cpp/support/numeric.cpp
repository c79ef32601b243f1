// Test-side dtype encodings: written from the IEEE definitions (exponent and
// mantissa fields, nearbyint's round half to even), sharing nothing with the library.
#include "support/numeric.h"

#include <cfenv>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace eat {
namespace {

struct Format {
  int p;       // significand bits, the implicit one included
  int emin;    // exponent of the smallest normal
  double max;  // largest finite value
};

Format format_of(DType d) {
  switch (d) {
    case DType::kFloat32: return {24, -126, 3.4028234663852886e38};  // FLT_MAX
    case DType::kFloat16: return {11, -14, 65504.0};
    case DType::kBFloat16: return {8, -126, 3.3895313892515355e38};  // (2 - 2^-7) * 2^127
    case DType::kFloat64: return {53, -1022, std::numeric_limits<double>::max()};
    default: break;
  }
  return {0, 0, 0};
}

// 2^k as a double (k within the normal double range).
double pow2(int k) {
  const uint64_t b = static_cast<uint64_t>(k + 1023) << 52;
  double d;
  std::memcpy(&d, &b, 8);
  return d;
}

// Exponent of the leading bit of |x| (x finite, nonzero, a normal double),
// floored at emin.
int lead_exponent(double x, int emin) {
  uint64_t b;
  std::memcpy(&b, &x, 8);
  const int e = static_cast<int>((b >> 52) & 0x7ff) - 1023;
  return e < emin ? emin : e;
}

}  // namespace

int64_t dtype_size(DType d) { return d == DType::kFloat64 ? 8 : d == DType::kFloat32 ? 4 : 2; }

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat64: return "f64";
    default: break;
  }
  return "dtype?";
}

double round_to(DType d, double x) {
  if (!std::isfinite(x) || x == 0.0) return x;
  const Format f = format_of(d);
  const double q = pow2(lead_exponent(x, f.emin) - (f.p - 1));
  // x / q is exact (q is a power of two); nearbyint rounds half to even in the
  // default rounding mode, which the tests never change.
  const double r = std::nearbyint(x / q) * q;
  if (std::fabs(r) > f.max) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

double ulp_of(DType d, double x) {
  if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
  const Format f = format_of(d);
  if (x == 0.0) return pow2(f.emin - (f.p - 1));
  return pow2(lead_exponent(x, f.emin) - (f.p - 1));
}

double max_finite(DType d) { return format_of(d).max; }

double next_up(DType d, double x) {
  if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) return x;
  if (x == -std::numeric_limits<double>::infinity()) return -max_finite(d);
  // Going up from a negative power of two the spacing halves: use the spacing
  // of the value just above x.
  double step = ulp_of(d, x);
  if (x < 0 && ulp_of(d, x + step / 2) < step) step /= 2;
  double r = x + step;
  if (r > max_finite(d)) return std::numeric_limits<double>::infinity();
  return r;
}

double next_down(DType d, double x) { return -next_up(d, -x); }

uint16_t to_f16_bits(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return static_cast<uint16_t>(sign | 0x7e00);
  const double r = std::fabs(round_to(DType::kFloat16, x));
  if (std::isinf(r)) return static_cast<uint16_t>(sign | 0x7c00);
  if (r < pow2(-14))  // subnormal (or zero): a multiple of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r * pow2(24)));
  // r is a float exactly: its exponent re-biased, its top 10 mantissa bits.
  const float f = static_cast<float>(r);
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t e = ((b >> 23) & 0xff) - 127 + 15;
  return static_cast<uint16_t>(sign | (e << 10) | ((b >> 13) & 0x3ff));
}

namespace {
// The decoding from the bit fields, tabulated once for load_elem.
double decode_f16(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  double v;
  if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -24);
  } else if (e == 31) {
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(1.0 + m / 1024.0, e - 15);
  }
  return (h & 0x8000) ? -v : v;
}
}  // namespace

double from_f16_bits(uint16_t h) {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = static_cast<float>(decode_f16(static_cast<uint16_t>(i)));
    return t;
  }();
  return table[h];
}

uint16_t to_bf16_bits(double x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xffc0 : 0x7fc0;
  // The rounded value is a float exactly (bfloat16 is a subset of float32).
  const float f = static_cast<float>(round_to(DType::kBFloat16, x));
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}

double from_bf16_bits(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

void store_elem(DType d, void* p, double x) {
  switch (d) {
    case DType::kFloat32: {
      const float f = static_cast<float>(x);  // round to nearest even
      std::memcpy(p, &f, 4);
      return;
    }
    case DType::kFloat16: {
      const uint16_t h = to_f16_bits(x);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kBFloat16: {
      const uint16_t h = to_bf16_bits(x);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kFloat64:
      std::memcpy(p, &x, 8);
      return;
    default:
      return;  // the tests store only the four input dtypes
  }
}

double load_elem(DType d, const void* p) {
  switch (d) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return from_f16_bits(h);
    }
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return from_bf16_bits(h);
    }
    case DType::kFloat64: {
      double x;
      std::memcpy(&x, p, 8);
      return x;
    }
    default:
      break;
  }
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace eat
