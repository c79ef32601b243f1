// The CPU forward/backward kernels, compiled once per instruction set: glu_cpu.cpp
// includes this for the portable baseline, glu_cpu_avx2.cpp for AVX2+FMA+F16C.
// Everything here has internal linkage, so the two copies never merge at link time
// (and math.h / convert.h are always_inline for the same reason).
//
// A row is processed in blocks of kBlock columns: the block's gate, up (and
// grad_out) are widened to float32 into stack buffers, de-interleaving on the way;
// one `omp simd` loop applies the shared math of core/math.h; a last loop rounds
// and stores, interleaving packed gradients back. Why blocks and not one fused
// loop: docs/perf-notes.md ("CPU path").
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include "core/convert.h"
#include "core/math.h"
#include "core/problem.h"
#include "cpu/kernel_table.h"

namespace expertact::cpu {
namespace {

using detail::BwdIO;
using detail::FwdOutput;
using detail::GluProblem;
using host::bf16;
using host::f16;
using host::Io;

#if defined(__GNUC__)
#define EA_KERNEL_INLINE inline __attribute__((always_inline))
#else
#define EA_KERNEL_INLINE inline
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
constexpr bool kLittleEndian = true;
#else
constexpr bool kLittleEndian = false;
#endif

template <DType D> struct Storage;
template <> struct Storage<DType::kFloat32> { using type = float; };
template <> struct Storage<DType::kFloat16> { using type = f16; };
template <> struct Storage<DType::kBFloat16> { using type = bf16; };

template <typename T> constexpr bool kIs16 = sizeof(T) == 2;

math::Coeffs coeffs_of(const GluProblem& p) {
  return math::Coeffs{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
}

// ---------------------------------------------------------------- storage <-> float32

// dst[j] = float(src[j * kStep]).
template <typename T, int kStep>
EA_KERNEL_INLINE void widen(const T* __restrict src, float* __restrict dst, int64_t n) {
#if defined(__F16C__) && defined(__AVX__)
  if constexpr (std::is_same_v<T, f16> && kStep == 1) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      _mm256_store_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(src + j))));
    for (; j < n; ++j) dst[j] = Io<T>::load(src[j]);
    return;
  }
#endif
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = Io<T>::load(src[j * kStep]);
}

// A packed [gate, up] pair of 16-bit values as one 32-bit word (gate in the low
// half on a little-endian host), so the de-interleave is a shift and a mask.
template <typename T>
EA_KERNEL_INLINE void widen_pairs(const T* __restrict src, float* __restrict g,
                                  float* __restrict u, int64_t n) {
  static_assert(kIs16<T>, "pairs of 16-bit values");
  const unsigned char* b = reinterpret_cast<const unsigned char*>(src);
#if defined(__F16C__) && defined(__AVX2__)
  if constexpr (std::is_same_v<T, f16>) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 4 * j));
      // Low halves to 16-bit lanes 0..3 of each 128-bit lane, high halves after.
      const __m256i shuf = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
      __m256i s = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, shuf), 0xd8);
      _mm256_store_ps(g + j, _mm256_cvtph_ps(_mm256_castsi256_si128(s)));
      _mm256_store_ps(u + j, _mm256_cvtph_ps(_mm256_extracti128_si256(s, 1)));
    }
    for (; j < n; ++j) {
      g[j] = Io<T>::load(src[2 * j]);
      u[j] = Io<T>::load(src[2 * j + 1]);
    }
    return;
  }
#endif
  if constexpr (kLittleEndian) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      uint32_t w;
      std::memcpy(&w, b + 4 * j, 4);
      g[j] = Io<T>::load(T{static_cast<uint16_t>(w & 0xffffu)});
      u[j] = Io<T>::load(T{static_cast<uint16_t>(w >> 16)});
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      g[j] = Io<T>::load(src[2 * j]);
      u[j] = Io<T>::load(src[2 * j + 1]);
    }
  }
}

// dst[j * kStep] = round(src[j]).
template <typename T, int kStep>
EA_KERNEL_INLINE void narrow(const float* __restrict src, T* __restrict dst, int64_t n) {
#if defined(__F16C__) && defined(__AVX__)
  if constexpr (std::is_same_v<T, f16> && kStep == 1) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                       _mm256_cvtps_ph(_mm256_load_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
    for (; j < n; ++j) dst[j] = Io<T>::store(src[j]);
    return;
  }
#endif
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j * kStep] = Io<T>::store(src[j]);
}

template <typename T>
EA_KERNEL_INLINE void narrow_pairs(const float* __restrict g, const float* __restrict u,
                                   T* __restrict dst, int64_t n) {
  static_assert(kIs16<T>, "pairs of 16-bit values");
  unsigned char* b = reinterpret_cast<unsigned char*>(dst);
#if defined(__F16C__) && defined(__AVX2__)
  if constexpr (std::is_same_v<T, f16>) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m128i hg = _mm256_cvtps_ph(_mm256_load_ps(g + j), _MM_FROUND_TO_NEAREST_INT);
      __m128i hu = _mm256_cvtps_ph(_mm256_load_ps(u + j), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(b + 4 * j), _mm_unpacklo_epi16(hg, hu));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(b + 4 * j + 16), _mm_unpackhi_epi16(hg, hu));
    }
    for (; j < n; ++j) {
      dst[2 * j] = Io<T>::store(g[j]);
      dst[2 * j + 1] = Io<T>::store(u[j]);
    }
    return;
  }
#endif
  if constexpr (kLittleEndian) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      uint32_t w = static_cast<uint32_t>(Io<T>::store(g[j]).bits) |
                   (static_cast<uint32_t>(Io<T>::store(u[j]).bits) << 16);
      std::memcpy(b + 4 * j, &w, 4);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      dst[2 * j] = Io<T>::store(g[j]);
      dst[2 * j + 1] = Io<T>::store(u[j]);
    }
  }
}

// Gate and up of one block as float32: widened into the buffers, or (float32,
// step 1) the tensors themselves.
template <typename T, int kStep>
EA_KERNEL_INLINE void load_gate_up(const T* g, const T* u, int64_t n, float* gb, float* ub,
                                   const float*& gf, const float*& uf) {
  if constexpr (std::is_same_v<T, float> && kStep == 1) {
    gf = g;
    uf = u;
  } else {
    if constexpr (kStep == 2 && kIs16<T>) {
      widen_pairs<T>(g, gb, ub, n);  // u == g + 1
    } else {
      widen<T, kStep>(g, gb, n);
      widen<T, kStep>(u, ub, n);
    }
    gf = gb;
    uf = ub;
  }
}

// ---------------------------------------------------------------- forward

template <typename T, Activation A, int kStep, bool kW>
void fwd_kernel(const GluProblem& p, const FwdOutput& o, int64_t r0, int64_t r1, int64_t c0,
                int64_t c1) {
  const math::Coeffs c = coeffs_of(p);
  alignas(64) float gb[kBlock], ub[kBlock], ob[kBlock];
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
    const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
    T* out = static_cast<T*>(o.out) + r * o.out_stride;
    const float w = kW ? p.w[r * p.w_stride] : 1.0f;
    for (int64_t cb = c0; cb < c1; cb += kBlock) {
      const int64_t n = c1 - cb < kBlock ? c1 - cb : kBlock;
      const float *gf, *uf;
      load_gate_up<T, kStep>(g + cb * kStep, u + cb * kStep, n, gb, ub, gf, uf);
      float* of;
      if constexpr (std::is_same_v<T, float>) of = out + cb;
      else of = ob;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) of[j] = math::glu_fwd<A>(gf[j], uf[j], w, c);
      if constexpr (!std::is_same_v<T, float>) narrow<T, 1>(ob, out + cb, n);
    }
  }
}

// ---------------------------------------------------------------- backward

// dg/du may be g/u themselves (in-place backward): a block's inputs are all read
// (widened, or for float32 step 1 read in the same iteration that writes them)
// before its gradients are stored, and no iteration touches another's elements.
template <typename T, Activation A, int kStep, bool kW, bool kDW>
void bwd_kernel(const GluProblem& p, const BwdIO& io, int64_t r0, int64_t r1, int64_t c0,
                int64_t c1, float* block_sums) {
  const math::Coeffs c = coeffs_of(p);
  alignas(64) float gb[kBlock], ub[kBlock], yb[kBlock], dgb[kBlock], dub[kBlock];
  constexpr bool kDirect = std::is_same_v<T, float> && kStep == 1;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
    const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
    const T* dy = static_cast<const T*>(io.dy) + r * io.dy_stride;
    T* dg = static_cast<T*>(io.dg) + r * io.dg_stride;
    T* du = static_cast<T*>(io.du) + r * io.du_stride;
    const float w = kW ? p.w[r * p.w_stride] : 1.0f;
    float row_sum = 0.0f;
    for (int64_t cb = c0; cb < c1; cb += kBlock) {
      const int64_t n = c1 - cb < kBlock ? c1 - cb : kBlock;
      const float *gf, *uf, *yf;
      load_gate_up<T, kStep>(g + cb * kStep, u + cb * kStep, n, gb, ub, gf, uf);
      if constexpr (std::is_same_v<T, float>) {
        yf = dy + cb;
      } else {
        widen<T, 1>(dy + cb, yb, n);
        yf = yb;
      }
      float *dgf, *duf;
      if constexpr (kDirect) {
        dgf = dg + cb;
        duf = du + cb;
      } else {
        dgf = dgb;
        duf = dub;
      }
      float acc = 0.0f;
      if constexpr (kDW) {
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < n; ++j) {
          float dgv, duv, dwt;
          math::glu_bwd<A>(gf[j], uf[j], yf[j], w, c, dgv, duv, dwt);
          dgf[j] = dgv;
          duf[j] = duv;
          acc += dwt;
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          float dgv, duv, dwt;
          math::glu_bwd<A>(gf[j], uf[j], yf[j], w, c, dgv, duv, dwt);
          dgf[j] = dgv;
          duf[j] = duv;
        }
      }
      if constexpr (!kDirect) {
        if constexpr (kStep == 2 && kIs16<T>) {
          narrow_pairs<T>(dgb, dub, dg + 2 * cb, n);  // du == dg + 1
        } else {
          narrow<T, kStep>(dgb, dg + cb * kStep, n);
          narrow<T, kStep>(dub, du + cb * kStep, n);
        }
      }
      if constexpr (kDW) {
        if (block_sums) block_sums[cb / kBlock] = acc;
        else row_sum += acc;
      }
    }
    if constexpr (kDW) {
      if (!block_sums) io.dw[r * io.dw_stride] = row_sum;
    }
  }
}

// ---------------------------------------------------------------- the table

template <DType D, Activation A, int kStep, bool kW>
void fill_one(KernelTable& t) {
  using T = typename Storage<D>::type;
  const int d = static_cast<int>(D), a = static_cast<int>(A);
  t.fwd[d][a][kStep - 1][kW] = &fwd_kernel<T, A, kStep, kW>;
  t.bwd[d][a][kStep - 1][kW][0] = &bwd_kernel<T, A, kStep, kW, false>;
  // A weight gradient needs weights: without them the "want" slot is never used.
  t.bwd[d][a][kStep - 1][kW][1] = &bwd_kernel<T, A, kStep, kW, kW>;
}

template <DType D, Activation A>
void fill_act(KernelTable& t) {
  fill_one<D, A, 1, false>(t);
  fill_one<D, A, 1, true>(t);
  fill_one<D, A, 2, false>(t);
  fill_one<D, A, 2, true>(t);
}

template <DType D>
void fill_dtype(KernelTable& t) {
  fill_act<D, Activation::kSilu>(t);
  fill_act<D, Activation::kGeluTanh>(t);
}

KernelTable make_table(const char* isa) {
  KernelTable t{};
  t.isa = isa;
  fill_dtype<DType::kFloat32>(t);
  fill_dtype<DType::kFloat16>(t);
  fill_dtype<DType::kBFloat16>(t);
  return t;
}

#undef EA_KERNEL_INLINE

}  // namespace
}  // namespace expertact::cpu
