// Host-side storage types and their float32 conversions, written with integer
// and float operations only (no lookup, no library call) so the CPU loops
// vectorize. Both round to nearest even and keep NaN, like the CUDA intrinsics.
// Always inlined: the CPU kernels are compiled twice (baseline and AVX2), and an
// out-of-line copy of an inline function could be merged across the two at link
// time, running AVX2 code on a CPU without it.
#pragma once

#include <cstdint>

#include "core/math.h"

#if defined(__GNUC__)
#define EA_HOST_INLINE inline __attribute__((always_inline))
#else
#define EA_HOST_INLINE inline
#endif

namespace expertact::host {

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

template <typename T> struct Io;

template <> struct Io<float> {
  static EA_HOST_INLINE float load(float v) { return v; }
  static EA_HOST_INLINE float store(float v) { return v; }
};

template <> struct Io<bf16> {
  static EA_HOST_INLINE float load(bf16 v) { return math::as_float(static_cast<uint32_t>(v.bits) << 16); }
  static EA_HOST_INLINE bf16 store(float f) {
    uint32_t b = math::as_bits(f);
    uint32_t rounded = b + 0x7fffu + ((b >> 16) & 1u);
    uint32_t quiet_nan = b | 0x00400000u;  // keep sign and payload top, force quiet
    // One select on 32-bit lanes and one shift: the NaN test as a float compare
    // (one instruction) and the select before the narrowing, which vectorize to
    // half the instructions of selecting between two 16-bit results.
    bool is_nan = f != f;
    return bf16{static_cast<uint16_t>((is_nan ? quiet_nan : rounded) >> 16)};
  }
};

template <> struct Io<f16> {
  static EA_HOST_INLINE float load(f16 v) {
    uint32_t h = v.bits;
    uint32_t sign = (h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    // Exponent and mantissa moved into float position, then scaled by 2^112 to
    // re-bias (exact, also for half subnormals, which become float normals).
    float scaled = math::as_float(em << 13) * 0x1p112f;
    uint32_t inf_nan = (em << 13) | 0x7f800000u;
    uint32_t bits = em >= 0x7c00u ? inf_nan : math::as_bits(scaled);
    return math::as_float(bits | sign);
  }
  static EA_HOST_INLINE f16 store(float f) {
    uint32_t b = math::as_bits(f);
    uint32_t sign = (b >> 16) & 0x8000u;
    uint32_t a = b & 0x7fffffffu;
    // Normal range: re-bias the exponent by 112 and round the 13 dropped bits
    // to nearest even; values from 65520 up round to 0x7c00 (inf) here too.
    uint32_t normal = (a - (112u << 23) + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    // Below 2^-14: adding 0.5 puts the half subnormal's unit (2^-24) in the
    // float's last mantissa place, so the float adder does the rounding.
    float sub_f = math::as_float(a) + 0.5f;
    uint32_t sub = math::as_bits(sub_f) - 0x3f000000u;
    uint32_t r = a < 0x38800000u ? sub : normal;
    r = a >= 0x47800000u ? 0x7c00u : r;                  // >= 65536: inf
    r = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x1ffu)) : r;  // NaN stays NaN
    return f16{static_cast<uint16_t>(r | sign)};
  }
};

}  // namespace expertact::host
