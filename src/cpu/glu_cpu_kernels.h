// The CPU forward/backward kernels, compiled once per instruction set: glu_cpu.cpp
// includes this for the portable baseline, glu_cpu_avx2.cpp for AVX2+FMA+F16C.
// Everything here has internal linkage, so the two copies never merge at link time
// (and math.h / convert.h are always_inline for the same reason).
//
// A row is processed in blocks of kBlock columns: the block's gate, up (and
// grad_out) are widened to float32 into stack buffers, de-interleaving on the way;
// one `omp simd` loop applies the shared math of core/math.h; a last loop rounds
// and stores, interleaving packed gradients back. Why blocks and not one fused
// loop: docs/notes/perf-notes.md, "CPU path".
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
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

// kClamp false: the problem has limit = +inf, passed as a constant so the
// compiler drops the clamps (x > inf is false for every x, NaN too) and masks.
template <bool kClamp>
math::Coeffs coeffs_of(const GluProblem& p) {
  if constexpr (kClamp) return math::Coeffs{p.params.alpha, p.params.limit, p.params.beta, true};
  else return math::Coeffs{p.params.alpha, __builtin_inff(), p.params.beta, false};
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

#if defined(__AVX2__)
// Io<bf16>::store on 8 lanes, leaving the bf16 in the high half of each 32-bit
// lane (the low half is garbage): round to nearest even, NaN made quiet. Written
// out because GCC narrows the NaN select to 16-bit lanes and packs the mask
// (33 instructions per 16 values instead of 21).
EA_KERNEL_INLINE __m256i bf16_round_hi(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i quiet_nan = _mm256_or_si256(b, _mm256_set1_epi32(0x00400000));
  const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                              _mm256_castsi256_ps(quiet_nan), is_nan));
}
#endif

// dst[j * kStep] = round(src[j]). kNT (AVX2 bf16 only, dst 32-byte aligned):
// non-temporal stores straight from the rounding, no staging copy.
template <typename T, int kStep, bool kNT = false>
EA_KERNEL_INLINE void narrow(const float* __restrict src, T* __restrict dst, int64_t n) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, bf16> && kStep == 1) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m256i a = _mm256_srli_epi32(bf16_round_hi(_mm256_load_ps(src + j)), 16);
      const __m256i b = _mm256_srli_epi32(bf16_round_hi(_mm256_load_ps(src + j + 8)), 16);
      // packus interleaves the 128-bit halves: a0-3 b0-3 a4-7 b4-7; the permute fixes it.
      const __m256i v = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
      if constexpr (kNT) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j), v);
      else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), v);
    }
    for (; j < n; ++j) dst[j] = Io<T>::store(src[j]);
    return;
  }
#endif
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

template <typename T, bool kNT = false>
EA_KERNEL_INLINE void narrow_pairs(const float* __restrict g, const float* __restrict u,
                                   T* __restrict dst, int64_t n) {
  static_assert(kIs16<T>, "pairs of 16-bit values");
  unsigned char* b = reinterpret_cast<unsigned char*>(dst);
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, bf16>) {
    int64_t j = 0;
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (; j + 8 <= n; j += 8) {
      const __m256i rg = _mm256_srli_epi32(bf16_round_hi(_mm256_load_ps(g + j)), 16);
      const __m256i ru = _mm256_and_si256(bf16_round_hi(_mm256_load_ps(u + j)), hi);
      if constexpr (kNT) _mm256_stream_si256(reinterpret_cast<__m256i*>(b + 4 * j), _mm256_or_si256(rg, ru));
      else _mm256_storeu_si256(reinterpret_cast<__m256i*>(b + 4 * j), _mm256_or_si256(rg, ru));
    }
    for (; j < n; ++j) {
      dst[2 * j] = Io<T>::store(g[j]);
      dst[2 * j + 1] = Io<T>::store(u[j]);
    }
    return;
  }
#endif
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

// Copies a block's results to their place with non-temporal stores (the aligned
// middle; head and tail as ordinary stores). The caller ends with stream_fence().
EA_KERNEL_INLINE void stream_copy(void* __restrict dst, const void* __restrict src, int64_t bytes) {
  unsigned char* d = static_cast<unsigned char*>(dst);
  const unsigned char* s = static_cast<const unsigned char*>(src);
#if defined(__AVX__) || defined(__SSE2__)
#if defined(__AVX__)
  constexpr int64_t kV = 32;
#else
  constexpr int64_t kV = 16;
#endif
  int64_t head = static_cast<int64_t>((kV - (reinterpret_cast<uintptr_t>(d) & (kV - 1))) & (kV - 1));
  if (head > bytes) head = bytes;
  std::memcpy(d, s, static_cast<size_t>(head));
  d += head;
  s += head;
  bytes -= head;
  for (; bytes >= kV; bytes -= kV, d += kV, s += kV) {
#if defined(__AVX__)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
#else
    _mm_stream_si128(reinterpret_cast<__m128i*>(d),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
#endif
  }
#endif
  std::memcpy(d, s, static_cast<size_t>(bytes));
}

// Non-temporal stores are weakly ordered: fence them before the thread reports
// its part done, so whoever reads the output next sees it.
EA_KERNEL_INLINE void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}


#if defined(__AVX2__)
constexpr bool kDirectNT = true;  // bf16 blocks stream straight from the rounding
#else
constexpr bool kDirectNT = false;
#endif
EA_KERNEL_INLINE bool aligned32(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 31) == 0; }

#if defined(__SSE2__)
constexpr bool kCanStream = true;
#else
constexpr bool kCanStream = false;
#endif

// Rounds a block to T at dst (kStep apart), directly or through a staging
// buffer and non-temporal stores.
template <typename T, int kStep>
EA_KERNEL_INLINE void put(const float* __restrict src, T* __restrict dst, int64_t n, bool stream,
                          T* __restrict stage) {
  if (kCanStream && stream && kStep == 1) {
    if constexpr (std::is_same_v<T, float>) {
      stream_copy(dst, src, n * 4);
    } else {
      if constexpr (kDirectNT && std::is_same_v<T, bf16>) {
        if (aligned32(dst)) {
          narrow<T, 1, true>(src, dst, n);
          return;
        }
      }
      narrow<T, 1>(src, stage, n);
      stream_copy(dst, stage, n * static_cast<int64_t>(sizeof(T)));
    }
  } else if constexpr (std::is_same_v<T, float> && kStep == 1) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else {
    narrow<T, kStep>(src, dst, n);
  }
}

// float32 [gate, up] pairs: de-interleaved and re-interleaved with shuffles (GCC's
// own code for the stride-2 loops took the interleaved layout to 60-70% of the
// separate one's speed).
EA_KERNEL_INLINE void split_pairs(const float* __restrict src, float* __restrict g,
                                  float* __restrict u, int64_t n) {
  int64_t j = 0;
#if defined(__AVX2__)
  for (; j + 8 <= n; j += 8) {
    const __m256 a = _mm256_loadu_ps(src + 2 * j);      // g0 u0 g1 u1 | g2 u2 g3 u3
    const __m256 b = _mm256_loadu_ps(src + 2 * j + 8);  // g4 u4 g5 u5 | g6 u6 g7 u7
    // shuffle_ps works per 128-bit lane: g0 g1 g4 g5 | g2 g3 g6 g7, then the
    // 64-bit permute puts the quarters in order.
    _mm256_store_ps(g + j, _mm256_castpd_ps(_mm256_permute4x64_pd(
                               _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8)));
    _mm256_store_ps(u + j, _mm256_castpd_ps(_mm256_permute4x64_pd(
                               _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8)));
  }
#endif
  for (; j < n; ++j) {
    g[j] = src[2 * j];
    u[j] = src[2 * j + 1];
  }
}

EA_KERNEL_INLINE void join_pairs(const float* __restrict g, const float* __restrict u,
                                 float* __restrict dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX__)
  for (; j + 8 <= n; j += 8) {
    const __m256 a = _mm256_load_ps(g + j), b = _mm256_load_ps(u + j);
    const __m256 lo = _mm256_unpacklo_ps(a, b);  // g0 u0 g1 u1 | g4 u4 g5 u5
    const __m256 hi = _mm256_unpackhi_ps(a, b);  // g2 u2 g3 u3 | g6 u6 g7 u7
    _mm256_storeu_ps(dst + 2 * j, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(dst + 2 * j + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
#endif
  for (; j < n; ++j) {
    dst[2 * j] = g[j];
    dst[2 * j + 1] = u[j];
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
    } else if constexpr (kStep == 2) {
      split_pairs(g, gb, ub, n);
    } else {
      widen<T, kStep>(g, gb, n);
      widen<T, kStep>(u, ub, n);
    }
    gf = gb;
    uf = ub;
  }
}

// ---------------------------------------------------------------- forward

template <typename T, Activation A, int kStep, bool kW, bool kClamp>
void fwd_kernel(const GluProblem& p, const FwdOutput& o, int64_t r0, int64_t r1, int64_t c0,
                int64_t c1, bool stream) {
  const math::Coeffs c = coeffs_of<kClamp>(p);
  stream = stream && kCanStream;
  alignas(64) float gb[kBlock], ub[kBlock], ob[kBlock];
  alignas(64) T stage[kBlock];
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(p.g) + r * p.g_stride;
    const T* u = static_cast<const T*>(p.u) + r * p.u_stride;
    T* out = static_cast<T*>(o.out) + r * o.out_stride;
    const float w = kW ? p.w[r * p.w_stride] : 1.0f;
    for (int64_t cb = c0; cb < c1; cb += kBlock) {
      const int64_t n = c1 - cb < kBlock ? c1 - cb : kBlock;
      const float *gf, *uf;
      load_gate_up<T, kStep>(g + cb * kStep, u + cb * kStep, n, gb, ub, gf, uf);
      // float32 results go straight to the output unless they are streamed.
      float* of = ob;
      if constexpr (std::is_same_v<T, float>) {
        if (!stream) of = out + cb;
      }
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) of[j] = math::glu_fwd<A>(gf[j], uf[j], w, c);
      if (of == ob) put<T, 1>(ob, out + cb, n, stream, stage);
    }
  }
  if (stream) stream_fence();
}

// ---------------------------------------------------------------- backward

// dg/du may be g/u themselves (in-place backward): a block's inputs are all read
// (widened, or for float32 step 1 read in the same iteration that writes them)
// before its gradients are stored, and no iteration touches another's elements.
template <typename T, Activation A, int kStep, bool kW, bool kDW, bool kClamp>
void bwd_kernel(const GluProblem& p, const BwdIO& io, int64_t r0, int64_t r1, int64_t c0,
                int64_t c1, float* block_sums, bool stream) {
  const math::Coeffs c = coeffs_of<kClamp>(p);
  stream = stream && kCanStream;
  alignas(64) float gb[kBlock], ub[kBlock], yb[kBlock], dgb[kBlock], dub[kBlock];
  alignas(64) T stage[2 * kBlock];
  // float32 step 1 writes its gradients in place of the buffers, unless streamed.
  const bool direct = std::is_same_v<T, float> && kStep == 1 && !stream;
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
      float* dgf = dgb;
      float* duf = dub;
      if constexpr (std::is_same_v<T, float> && kStep == 1) {
        if (direct) {
          dgf = dg + cb;
          duf = du + cb;
        }
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
      if (!direct) {
        if constexpr (kStep == 2) {  // du == dg + 1
          bool done = false;
          if constexpr (kDirectNT && std::is_same_v<T, bf16>) {
            if (stream && aligned32(dg + 2 * cb)) {
              narrow_pairs<T, true>(dgb, dub, dg + 2 * cb, n);
              done = true;
            }
          }
          if (!done) {
            T* dst = stream ? stage : dg + 2 * cb;
            if constexpr (kIs16<T>) narrow_pairs<T>(dgb, dub, dst, n);
            else join_pairs(dgb, dub, dst, n);
            if (stream) stream_copy(dg + 2 * cb, stage, 2 * n * static_cast<int64_t>(sizeof(T)));
          }
        } else {
          put<T, kStep>(dgb, dg + cb * kStep, n, stream, stage);
          put<T, kStep>(dub, du + cb * kStep, n, stream, stage);
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
  if (stream) stream_fence();
}

// ---------------------------------------------------------------- the table

template <DType D, Activation A, int kStep, bool kW, bool kClamp>
void fill_one(KernelTable& t) {
  using T = typename Storage<D>::type;
  const int d = static_cast<int>(D), a = static_cast<int>(A);
  t.fwd[d][a][kStep - 1][kW][kClamp] = &fwd_kernel<T, A, kStep, kW, kClamp>;
  t.bwd[d][a][kStep - 1][kW][0][kClamp] = &bwd_kernel<T, A, kStep, kW, false, kClamp>;
  // A weight gradient needs weights: without them the "want" slot is never used.
  t.bwd[d][a][kStep - 1][kW][1][kClamp] = &bwd_kernel<T, A, kStep, kW, kW, kClamp>;
}

template <DType D, Activation A, int kStep, bool kW>
void fill_clamp(KernelTable& t) {
  fill_one<D, A, kStep, kW, false>(t);
  fill_one<D, A, kStep, kW, true>(t);
}

template <DType D, Activation A>
void fill_act(KernelTable& t) {
  fill_clamp<D, A, 1, false>(t);
  fill_clamp<D, A, 1, true>(t);
  fill_clamp<D, A, 2, false>(t);
  fill_clamp<D, A, 2, true>(t);
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
