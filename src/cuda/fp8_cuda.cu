// CUDA path of the FP8 quantisation (src/core/fp8.h). The arithmetic per element is fp8.h's,
// shared with the CPU path, so the two give the same bytes and scales.
//
// Rowwise: rows whose input allows 16-byte packs go to 32, 64 or 128 lanes per row (the
// fewest that leave a lane at most 32 values), read in those packs with all of a lane's
// loads in flight and held in registers (for the GLU form, the float32 activation, computed
// once; with a per-expert bias, its packs are loaded alongside) while the row's amax (NaN
// ignored) is reduced across its lanes (shuffles, then shared memory across warps), then
// quantised from there and written as 2, 4 or 8 bytes per pack; rows too long to hold are
// read twice. Other rows take a scalar form: a warp per row, one element at a time, read
// twice. The conversions go two at a time through fp8::from_scaled2 (one instruction on
// sm_89+); the software conversion (about 58 instructions a value) bound these kernels.
//
// Per expert and column (quantize_colwise_grouped), four launches on the stream: the scales
// zeroed; pass 1, each block a chunk of rows x 256 columns, every row read once in 16-byte
// packs along the row, the max |v| of each expert's run of rows and column merged into the
// scale buffer by atomicMax on the float's bits (non-negative floats order as their bits, so
// the result is the same whatever the order); the amax turned into the scale 1 / s in place;
// pass 2 (src/cuda/fp8_colwise.cuh), each block a tile of 128 output rows x 64 columns: its
// rows read in 16-byte packs, quantised with s = 1 / scale, packed four rows to a word into
// shared memory and written out transposed as 16-byte runs of q_t's rows; padding rows are
// written as 0 from the same tile. Where the operands allow 16-byte packs a block takes a run
// of tiles, carrying the expert map and the scales across them and copying the next tile into
// shared memory while it packs the current one (docs/notes/perf-notes.md, column-wise pass 2).
// glu_colwise_grouped takes the same tiles with the activation recomputed from gate_up as the
// values. With the amax given (quantize_rowwise's col_amax), pass 1 is skipped:
// x is read once.
//
// quantize_rowwise with col_amax: the vector form's lanes also keep their columns' running
// max |v| per expert (in x's type: exact), merged into the zeroed col_amax by atomicMax on
// the float bits when a lane's expert changes and at its block's end; blocks take contiguous
// runs of rows (as many blocks as are resident). The other forms compute it by colwise pass 1.
//
// glu_rowwise with col_amax: the same fusion in the GLU form's vector kernels (with and
// without the bias: glu_rows_amax_kernel), the held float32 h rounded to the input type (as
// the activation's forward writes it) before the running max; the other forms compute it by
// glu_col_amax_kernel, its own read of gate_up, before their own kernel.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "core/bias.h"
#include "core/dispatch.h"
#include "core/checks.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/math.h"
#include "cpu/fp8_cpu.h"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/fp8_colwise.cuh"
#include "cuda/glu_launch.cuh"

namespace expertact::cuda {
namespace {

__device__ __forceinline__ float warp_amax(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// ---- rowwise, 16-byte packs: G lanes per row (32, 64 or 128) ----

constexpr int kRowThreads = 128;  // 128 / G rows per block
constexpr int kStreamUnroll = 4;  // packs in flight per lane for rows too long to hold

// One pack of V scaled values written as V e4m3fn bytes (V = 2, 4 or 8): one store of V bytes
// when q's rows allow it (vec), else byte by byte.
template <int V>
__device__ __forceinline__ void store_q(uint8_t* q, int p, const float (&x)[V], bool vec) {
  static_assert(V == 2 || V == 4 || V == 8, "a pack of 2, 4 or 8 values");
  // Four bytes a word by from_scaled4 (one NaN fix-up a word, where from_scaled2 took one
  // test and select a byte); a pack of 2 by from_scaled2. The bytes are the same.
  uint32_t w[(V + 3) / 4];
  if constexpr (V == 2) {
    w[0] = fp8::from_scaled2(x[0], x[1]);
  } else {
#pragma unroll
    for (int i = 0; i < V / 4; ++i) w[i] = fp8::from_scaled4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
  }
  if (vec) {
    if constexpr (V == 8) reinterpret_cast<uint2*>(q)[p] = make_uint2(w[0], w[1]);
    else if constexpr (V == 4) reinterpret_cast<uint32_t*>(q)[p] = w[0];
    else reinterpret_cast<uint16_t*>(q)[p] = static_cast<uint16_t>(w[0]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) q[static_cast<int64_t>(p) * V + i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
  }
}

// The running max |v| of a lane (NaN ignored, exact): float32 fmaxf, or for 16-bit packs two
// values at a time in their own type (max.bf16x2 / max.f16x2 return the other input for a NaN,
// as fmaxf does): one instruction per two values.
template <typename T>
struct AbsMax {
  float m = 0.0f;
  __device__ __forceinline__ void add(float v) { m = fmaxf(m, fabsf(v)); }
  template <int V>
  __device__ __forceinline__ void add(const Pack<T, V>& p) {
#pragma unroll
    for (int i = 0; i < V; ++i) add(pack_f(p, i));
  }
  __device__ __forceinline__ float get() const { return m; }
};
template <typename T, typename T2>
struct AbsMax16 {
  T2 m;
  __device__ __forceinline__ AbsMax16() : m(from_f<T>(0.0f), from_f<T>(0.0f)) {}
  template <int V>
  __device__ __forceinline__ void add(const Pack<T, V>& p) {
    static_assert(V % 2 == 0, "pairs");
#pragma unroll
    for (int i = 0; i < V / 2; ++i) m = __hmax2(m, __habs2(reinterpret_cast<const T2*>(p.v)[i]));
  }
  __device__ __forceinline__ float get() const { return fmaxf(to_f(m.x), to_f(m.y)); }
};
template <>
struct AbsMax<__nv_bfloat16> : AbsMax16<__nv_bfloat16, __nv_bfloat162> {};
template <>
struct AbsMax<__half> : AbsMax16<__half, __half2> {};

// Two values of a 16-bit T as one word, x0 in the low half, rounded as from_f (one
// cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32).
template <typename T>
__device__ __forceinline__ uint32_t pack2_of(float x0, float x1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(x0, x1);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The running column amax of two values of a 16-bit T a word: each half the larger magnitude
// of m's and v's (NaN ignored: max returns the other input, as fmaxf does; exact). The result's
// sign bits carry no meaning (max.xorsign.abs, sm_86 and later: one instruction where |v| and
// max take two); half_abs_f reads the magnitudes.
template <typename T>
__device__ __forceinline__ uint32_t absmax2(uint32_t m, uint32_t v) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 860
  if constexpr (std::is_same_v<T, __nv_bfloat16>) asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(v));
  else asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(v));
#else
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  const T2 x = __hmax2(__habs2(*reinterpret_cast<const T2*>(&m)), __habs2(*reinterpret_cast<const T2*>(&v)));
  r = *reinterpret_cast<const uint32_t*>(&x);
#endif
  return r;
}

// The magnitude of half `hi` (0: low, 1: high) of an absmax2 word, as float (exact).
template <typename T>
__device__ __forceinline__ float half_abs_f(uint32_t w, int hi) {
  const uint32_t b = (hi ? w >> 16 : w) & 0x7fffu;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(b << 16);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}

// K words (K = 1, 2, 4 or 8) stored at p, which is aligned to min(4 K, 16) bytes as the packs
// are that hold them.
template <int K, typename T>
__device__ __forceinline__ void store_words(T* p, const uint32_t* w) {
  static_assert(K == 1 || K == 2 || K == 4 || K == 8, "1, 2, 4 or 8 words");
  if constexpr (K == 8) {
    reinterpret_cast<uint4*>(p)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(p)[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else if constexpr (K == 4) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (K == 2) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t*>(p) = w[0];
  }
}

// The values of one row, in packs of V: Raw is what one pack's load brings, Held what a lane
// keeps of it between the amax and the quantisation (the raw elements for a plain row, the
// float32 activation for the GLU form: computed once).
template <typename T, int V>
struct PlainSrc {
  using Raw = Pack<T, V>;
  using Held = Pack<T, V>;
  using Max = AbsMax<T>;
  const T* x;
  __device__ __forceinline__ void load(int p, Raw& r) const { r = reinterpret_cast<const Raw*>(x)[p]; }
  __device__ __forceinline__ void finish(const Raw& r, int, Held& h) const { h = r; }
  __device__ __forceinline__ void absmax(const Held& h, Max& m) const { m.add(h); }
  __device__ __forceinline__ float value(const Held& h, int i) const { return pack_f(h, i); }
};

template <typename T, Activation A, int kStep, int V>
struct GluSrc {
  using Raw = GuPack<T, V, kStep>;
  struct Held {
    float v[V];
  };
  using Max = AbsMax<float>;
  const T* g;
  const T* u;
  float w;
  const math::Coeffs& c;
  __device__ __forceinline__ void init(Raw&) const {}
  __device__ __forceinline__ void load(int p, Raw& r) const { load_raw<T, V, kStep>(g, u, p, r); }
  __device__ __forceinline__ void finish(const Raw& r, int, Held& h) const {
#pragma unroll
    for (int i = 0; i < V; ++i) h.v[i] = math::glu_fwd<A>(gate_of(r, i), up_of(r, i), w, c);
  }
  __device__ __forceinline__ void absmax(const Held& h, Max& m) const {
#pragma unroll
    for (int i = 0; i < V; ++i) m.add(h.v[i]);
  }
  __device__ __forceinline__ float value(const Held& h, int i) const { return h.v[i]; }
};

// The GLU form with a per-expert bias added to gate and up (in float32) before the
// activation: each pack's bias loaded with it from the row's expert's bias row (bg null: no
// bias, rows past the last offset). Rows are sorted by expert, so the blocks on an SM mostly
// read one expert's bias row, from L1. kAlwaysAdd (glu_rows_amax_kernel's form): the bias pack
// is always added, -0 where the row has none, so that finish has no branch (x + -0 is x for
// every float: the same values, the same bytes); a skipped pack's bias is -0 as well (never
// used; that form took 119-122 registers for the bf16 instances of up to 32 values a lane,
// leaving it unset took 127-134).
template <typename T, Activation A, int kStep, int V, bool kAlwaysAdd = false>
struct BiasGluSrc {
  using In = GuPack<T, V, kStep>;
  struct Raw {
    In in, b;
  };
  struct Held {
    float v[V];
  };
  using Max = AbsMax<float>;
  const T* g;
  const T* u;
  const T* bg;
  const T* bu;
  float w;
  const math::Coeffs& c;
  __device__ __forceinline__ static void no_bias(In& b) {
    const T nz = from_f<T>(-0.0f);
    if constexpr (kStep == 1) {
#pragma unroll
      for (int i = 0; i < V; ++i) b.g.v[i] = nz, b.u.v[i] = nz;
    } else {
#pragma unroll
      for (int i = 0; i < 2 * V; ++i) b.gu.v[i] = nz;
    }
  }
  __device__ __forceinline__ void init(Raw& r) const {
    if constexpr (kAlwaysAdd) no_bias(r.b);
  }
  __device__ __forceinline__ void load(int p, Raw& r) const {
    load_raw<T, V, kStep>(g, u, p, r.in);
    if (bg) {
      load_raw<T, V, kStep>(bg, bu, p, r.b);
    } else if constexpr (kAlwaysAdd) {
      no_bias(r.b);
    }
  }
  __device__ __forceinline__ void finish(const Raw& r, int, Held& h) const {
    if (kAlwaysAdd || bg) {
#pragma unroll
      for (int i = 0; i < V; ++i)
        h.v[i] = math::glu_fwd<A>(gate_of(r.in, i) + gate_of(r.b, i), up_of(r.in, i) + up_of(r.b, i), w, c);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) h.v[i] = math::glu_fwd<A>(gate_of(r.in, i), up_of(r.in, i), w, c);
    }
  }
  __device__ __forceinline__ void absmax(const Held& h, Max& m) const {
#pragma unroll
    for (int i = 0; i < V; ++i) m.add(h.v[i]);
  }
  __device__ __forceinline__ float value(const Held& h, int i) const { return h.v[i]; }
};

// The amax of a row across its G lanes: a warp's shuffles, then for G > 32 the row's warps
// through shared memory (a block-wide barrier: every thread of the block calls this). A block
// that takes row after row alternates between two `red` arrays (row parity): a warp that runs
// ahead writes the other array while slower warps still read this one, and cannot come back
// to this one before they have passed the next row's barrier.
__device__ __forceinline__ float row_amax(float a, int G, float* red) {
  a = warp_amax(a);
  if (G > 32) {
    const int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) red[warp] = a;
    __syncthreads();
    const int w0 = warp & ~(G / 32 - 1);
    a = red[w0];
    for (int k = 1; k < G / 32; ++k) a = fmaxf(a, red[w0 + k]);
  }
  return a;
}

// Packs of the row a lane takes: lane, lane + G, ... N > 0: at most N of them, held in
// registers, the loads U at a time (U = N where a pack's raw load is no larger than what is
// held of it, so a lane has all its loads in flight at once), the row read once. N = 0 (rows
// longer than the instances hold): the row is read twice, kStreamUnroll packs in flight per
// lane, the second read mostly from L2. live: whether the lane's row exists (a block's last
// rows may not; they still take part in row_amax's barrier).
// What a lane's held packs are also given to (acc.add(j, held pack j)), for N > 0: nothing,
// or the column amax (ColAmaxAcc). Acc::kDefined: every raw and held pack is given a value
// (0, then src.init, where it is not loaded), for the kernels that loop over rows: without it
// a pack a lane skips keeps the previous row's value for all ptxas can tell, so the packs live
// across the loop's back edge (the GLU form's loop took 150 registers where its body alone
// takes 64; with it, 79).
struct NoAcc {
  static constexpr bool kDefined = false;
  template <typename H>
  __device__ __forceinline__ void add(int, const H&) {}
};

template <typename Src, int V, int N, typename Acc = NoAcc>
__device__ __forceinline__ void quantize_row(const Src& src, bool live, int packs, int lane, int G, uint8_t* q,
                                             bool q_vec, float* scale_out, float* red, Acc* acc = nullptr) {
  typename Src::Max m;
  if constexpr (N > 0) {
    constexpr int U = sizeof(typename Src::Raw) <= sizeof(typename Src::Held) ? N : (N + 1) / 2;
    typename Src::Held h[N];
    if constexpr (Acc::kDefined) {
#pragma unroll
      for (int j = 0; j < N; ++j) h[j] = {};
    }
#pragma unroll
    for (int j0 = 0; j0 < N; j0 += U) {
      typename Src::Raw r[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        if (j0 + k < N && live && lane + G * (j0 + k) < packs) {
          src.load(lane + G * (j0 + k), r[k]);
        } else if constexpr (Acc::kDefined) {
          r[k] = {};  // (its value is never used: the finish below skips the pack too)
          src.init(r[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        if (j0 + k < N && live && lane + G * (j0 + k) < packs) {
          src.finish(r[k], j0 + k, h[j0 + k]);
          src.absmax(h[j0 + k], m);
          if (acc) acc->add(j0 + k, h[j0 + k]);
        }
      }
    }
    const float s = fp8::scale_of(row_amax(m.get(), G, red));
    if (!live) return;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (lane + G * j < packs) {
        float x[V];
#pragma unroll
        for (int i = 0; i < V; ++i) x[i] = src.value(h[j], i) * s;
        store_q<V>(q, lane + G * j, x, q_vec);
      }
    }
    if (lane == 0) *scale_out = 1.0f / s;
  } else {
    constexpr int kU = kStreamUnroll;
    const int end = live ? packs : 0;
    for (int p0 = lane; p0 < end; p0 += G * kU) {
      typename Src::Raw r[kU];
#pragma unroll
      for (int k = 0; k < kU; ++k)
        if (p0 + G * k < end) src.load(p0 + G * k, r[k]);
#pragma unroll
      for (int k = 0; k < kU; ++k) {
        if (p0 + G * k < end) {
          typename Src::Held h;
          src.finish(r[k], 0, h);
          src.absmax(h, m);
        }
      }
    }
    const float s = fp8::scale_of(row_amax(m.get(), G, red));
    for (int p0 = lane; p0 < end; p0 += G * kU) {
      typename Src::Raw r[kU];
#pragma unroll
      for (int k = 0; k < kU; ++k)
        if (p0 + G * k < end) src.load(p0 + G * k, r[k]);
#pragma unroll
      for (int k = 0; k < kU; ++k) {
        if (p0 + G * k < end) {
          typename Src::Held h;
          src.finish(r[k], 0, h);
          float x[V];
#pragma unroll
          for (int i = 0; i < V; ++i) x[i] = src.value(h, i) * s;
          store_q<V>(q, p0 + G * k, x, q_vec);
        }
      }
    }
    if (live && lane == 0) *scale_out = 1.0f / s;
  }
}

template <typename T, int V, int N>
__global__ void __launch_bounds__(kRowThreads, N * V <= 24 ? 10 : 1) quantize_rows_vec_kernel(const T* __restrict__ x, int64_t x_stride,
                                                                       int64_t rows, int packs, int G,
                                                                       uint8_t* __restrict__ q, int64_t q_stride,
                                                                       bool q_vec, float* __restrict__ scale,
                                                                       int64_t scale_stride) {
  __shared__ float red[kRowThreads / 32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / G) + threadIdx.x / G;
  const bool live = row < rows;
  const int64_t r = live ? row : 0;
  const PlainSrc<T, V> src{x + r * x_stride};
  quantize_row<PlainSrc<T, V>, V, N>(src, live, packs, threadIdx.x & (G - 1), G, q + r * q_stride, q_vec,
                                     scale + r * scale_stride, red);
}

// quantize_rowwise's column amax, fused: a lane's running max |v| of each column it holds
// (columns V (lane + G j) .. + V - 1), over the rows of one expert, in x's type (exact: the
// max of values of T is one of them; the 16-bit types two at a time, max.bf16x2 / max.f16x2
// return the other input for a NaN, as fmaxf does), merged into amax (float bits, zeroed
// first) by atomicMax when the lane's expert changes and at its block's end.
template <typename T, int V, int N>
struct ColAmaxAcc {
  static constexpr bool kDefined = false;  // (see NoAcc; quantize_rows_amax_kernel as measured)
  Pack<T, V> m[N];
  bool on = false;  // the lane's current row belongs to an expert
  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int i = 0; i < V; ++i) m[j].v[i] = from_f<T>(0.0f);
  }
  __device__ __forceinline__ void add(int j, const Pack<T, V>& h) {
    if (!on) return;
    if constexpr (std::is_same_v<T, float>) {
#pragma unroll
      for (int i = 0; i < V; ++i) m[j].v[i] = fmaxf(m[j].v[i], fabsf(h.v[i]));
    } else {
      using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        T2& a = reinterpret_cast<T2*>(m[j].v)[i];
        a = __hmax2(a, __habs2(reinterpret_cast<const T2*>(h.v)[i]));
      }
    }
  }
  __device__ __forceinline__ void flush(unsigned* dst, int lane, int G, int packs) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int p = lane + G * j;
      if (p < packs) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float v = pack_f(m[j], i);
          if (v > 0.0f) atomicMax(dst + static_cast<int64_t>(p) * V + i, __float_as_uint(v));
        }
      }
    }
  }
};

// ColAmaxAcc's running maxima in shared memory instead of registers (the GLU form, whose
// lanes already hold the float32 h): word k of a thread at words[k * kRowThreads + thread]
// (each thread its own words: no bank conflicts, no atomics), a word two values of a 16-bit
// T (absmax2 of h rounded to T, exact, NaN ignored) or one float32. Always kDefined (the loop).
template <typename T, int V, int N>
struct SmemColAmaxAcc {
  static constexpr bool kDefined = true;
  static constexpr int kPer = sizeof(T) == 2 ? 2 : 1;  // values a word
  static constexpr int kWords = N * V / kPer;         // words a thread
  uint32_t* words;                                     // this thread's first word
  bool on = false;
  __device__ __forceinline__ uint32_t& at(int k) const { return words[k * kRowThreads]; }
  __device__ __forceinline__ void reset() const {
#pragma unroll
    for (int k = 0; k < kWords; ++k) at(k) = 0u;  // +0 in either form
  }
  template <typename H>
  __device__ __forceinline__ void add(int j, const H& h) const {
    if (!on) return;
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        uint32_t& w = at(j * V + i);
        w = __float_as_uint(fmaxf(__uint_as_float(w), fabsf(h.v[i])));  // NaN ignored
      }
    } else {
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        uint32_t& w = at(j * V / 2 + i);
        w = absmax2<T>(w, pack2_of<T>(h.v[2 * i], h.v[2 * i + 1]));
      }
    }
  }
  __device__ __forceinline__ void flush(unsigned* dst, int lane, int G, int packs) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int p = lane + G * j;
      if (p < packs) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          float v;
          if constexpr (sizeof(T) == 4) v = __uint_as_float(at(j * V + i));
          else v = half_abs_f<T>(at((j * V + i) / 2), i % 2);
          if (v > 0.0f) atomicMax(dst + static_cast<int64_t>(p) * V + i, __float_as_uint(v));
        }
      }
    }
  }
};

// (16-bit, up to 32 values a lane: bounded to 6 blocks an SM, 80 registers, where unbounded
// it took 92-94 (5 blocks); float32 spilled under that bound.)
// quantize_rows_vec_kernel with the column amax: block b takes the steps (of 128 / G rows)
// [b * per_block, + per_block), one after another, so its lanes see few expert changes and
// merge each expert's column maxima once. offs: the experts' cumulative end rows (E of them;
// rows past the last count for none; any values keep every access in bounds). ahead: each
// row's lane 0 asks L2 for the row that many steps on (0: none; the packs are 16 bytes, so the
// row's packs are a 16-byte run).
template <typename T, int V, int N>
__global__ void __launch_bounds__(kRowThreads, sizeof(T) == 2 && N * V <= 32 ? 6 : 1) quantize_rows_amax_kernel(
    const T* __restrict__ x, int64_t x_stride, int64_t rows, int packs, int G, uint8_t* __restrict__ q,
    int64_t q_stride, bool q_vec, float* __restrict__ scale, int64_t scale_stride, const int32_t* __restrict__ offs,
    int64_t E, unsigned* __restrict__ amax, int64_t amax_stride, int64_t per_block, int ahead) {
  static_assert(V * sizeof(T) == 16, "16-byte packs");
  __shared__ float red[2][kRowThreads / 32];  // by row parity (row_amax)
  const int R = kRowThreads / G, lane = threadIdx.x & (G - 1);
  const int64_t steps = (rows + R - 1) / R;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t s1 = s0 + per_block < steps ? s0 + per_block : steps;
  ColAmaxAcc<T, V, N> acc;
  acc.reset();
  int64_t held = -1;
  int64_t e = detail::expert_of(offs, E, s0 * R + threadIdx.x / G);
  for (int64_t st = s0; st < s1; ++st) {  // the same count in every thread: row_amax's barrier
    const int64_t row = st * R + threadIdx.x / G;
    const bool live = row < rows;
    const int64_t r = live ? row : 0;
    if (ahead > 0 && lane == 0 && st + ahead < s1 && row + ahead * R < rows)
      prefetch_l2(x + (row + ahead * R) * x_stride, static_cast<uint32_t>(packs) * 16u);
    if (live) {
      while (e < E && offs[e] <= row) ++e;
      if (e != held) {
        if (held >= 0) acc.flush(amax + held * amax_stride, lane, G, packs);
        acc.reset();
        held = e < E ? e : -1;
      }
    }
    acc.on = live && held >= 0;
    const PlainSrc<T, V> src{x + r * x_stride};
    quantize_row<PlainSrc<T, V>, V, N>(src, live, packs, lane, G, q + r * q_stride, q_vec, scale + r * scale_stride,
                                       red[st & 1], &acc);
  }
  if (held >= 0) acc.flush(amax + held * amax_stride, lane, G, packs);
}

// (kRowThreads, 1): without the 1, ptxas capped some instances at 72-96 registers and spilled.
template <typename T, Activation A, int kStep, int V, int N>
__global__ void __launch_bounds__(kRowThreads, N * V <= 24 ? 10 : 1) glu_rows_vec_kernel(const T* g, const T* u, int64_t g_stride,
                                                                  int64_t u_stride, const float* __restrict__ w,
                                                                  int64_t w_stride, int64_t rows, int packs, int G,
                                                                  const math::Coeffs c, uint8_t* __restrict__ q,
                                                                  int64_t q_stride, bool q_vec,
                                                                  float* __restrict__ scale, int64_t scale_stride) {
  __shared__ float red[kRowThreads / 32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / G) + threadIdx.x / G;
  const bool live = row < rows;
  const int64_t r = live ? row : 0;
  const GluSrc<T, A, kStep, V> src{g + r * g_stride, u + r * u_stride, w && live ? w[r * w_stride] : 1.0f, c};
  quantize_row<GluSrc<T, A, kStep, V>, V, N>(src, live, packs, threadIdx.x & (G - 1), G, q + r * q_stride, q_vec,
                                             scale + r * scale_stride, red);
}

// The biased GLU form: the plain form's shape, each row's expert found by a binary search
// of the offsets (the same in the row's lanes).
template <typename T, Activation A, int kStep, int V, int N>
__global__ void __launch_bounds__(kRowThreads, 1) glu_rows_bias_kernel(
    const T* g, const T* u, int64_t g_stride, int64_t u_stride, const float* __restrict__ w, int64_t w_stride,
    const T* bg, const T* bu, int64_t b_stride, const int32_t* __restrict__ offs, int64_t E, int64_t rows,
    int packs, int G, const math::Coeffs c, uint8_t* __restrict__ q, int64_t q_stride, bool q_vec,
    float* __restrict__ scale, int64_t scale_stride) {
  __shared__ float red[kRowThreads / 32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / G) + threadIdx.x / G;
  const bool live = row < rows;
  const int64_t r = live ? row : 0;
  const int64_t e = detail::expert_of(offs, E, r);
  const BiasGluSrc<T, A, kStep, V> src{g + r * g_stride,
                                       u + r * u_stride,
                                       e < E ? bg + e * b_stride : nullptr,
                                       e < E ? bu + e * b_stride : nullptr,
                                       w && live ? w[r * w_stride] : 1.0f,
                                       c};
  quantize_row<BiasGluSrc<T, A, kStep, V>, V, N>(src, live, packs, threadIdx.x & (G - 1), G, q + r * q_stride, q_vec,
                                                 scale + r * scale_stride, red);
}

// glu_rows_vec_kernel (kBias false) or glu_rows_bias_kernel (kBias true) with the column amax
// of h, fused as quantize_rows_amax_kernel fuses quantize_rowwise's: block b takes the steps
// (of 128 / G rows) [b * per_block, + per_block) one after another; each lane keeps its
// columns' running max of |h| per expert, h rounded to T as the activation's forward writes it
// (exact, in T; in shared memory, SmemColAmaxAcc: held in registers it cost 16 more), merged
// into the zeroed amax by atomicMax on the float bits when its expert changes and at its
// block's end. offs (E of them): the column amax's experts, and with kBias the bias's (the
// same offsets); each row's expert is followed along the run, not searched. The biased rows
// take BiasGluSrc<..., true> (no branch in the finish). q and scale: those of the kernels without the
// amax (the same float32 h, the same bytes). (Asking L2 for the rows ahead, as
// quantize_rows_amax_kernel does, made it slower on an H200: 1.02x the time at 1 row ahead,
// 1.05x at 2.)
// (16-bit, unbiased, up to 32 values a lane: bounded to 6 blocks an SM, 71-72 registers
// without spills, where unbounded it took 80-91 (5 blocks); up to 24 values a lane (3,072
// columns at 128 lanes) to 8 blocks, 56-64 registers without spills (10 blocks spilled); the
// biased form and longer rows spill under these bounds and stay unbounded, as the kernels
// without the amax.)
template <typename T, int V, int N, bool kBias>
constexpr int glu_amax_min_blocks() {
  if (sizeof(T) != 2 || kBias) return 1;
  return N * V <= 24 ? 8 : N * V <= 32 ? 6 : 1;
}

template <typename T, Activation A, int kStep, int V, int N, bool kBias>
__global__ void __launch_bounds__(kRowThreads, glu_amax_min_blocks<T, V, N, kBias>()) glu_rows_amax_kernel(
    const T* g, const T* u, int64_t g_stride, int64_t u_stride, const float* __restrict__ w, int64_t w_stride,
    const T* bg, const T* bu, int64_t b_stride, const int32_t* __restrict__ offs, int64_t E, int64_t rows,
    int packs, int G, const math::Coeffs c, uint8_t* __restrict__ q, int64_t q_stride, bool q_vec,
    float* __restrict__ scale, int64_t scale_stride, unsigned* __restrict__ amax, int64_t amax_stride,
    int64_t per_block) {
  __shared__ float red[2][kRowThreads / 32];  // by row parity (row_amax)
  const int R = kRowThreads / G, lane = threadIdx.x & (G - 1);
  const int64_t steps = (rows + R - 1) / R;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t s1 = s0 + per_block < steps ? s0 + per_block : steps;
  using Acc = SmemColAmaxAcc<T, V, N>;
  __shared__ uint32_t cm[Acc::kWords * kRowThreads];
  Acc acc{cm + threadIdx.x};
  acc.reset();
  int64_t held = -1;
  int64_t e = detail::expert_of(offs, E, s0 * R + threadIdx.x / G);
  for (int64_t st = s0; st < s1; ++st) {  // the same count in every thread: row_amax's barrier
    const int64_t row = st * R + threadIdx.x / G;
    const bool live = row < rows;
    const int64_t r = live ? row : 0;
    if (live) {
      while (e < E && offs[e] <= row) ++e;
      if (e != held) {
        if (held >= 0) acc.flush(amax + held * amax_stride, lane, G, packs);
        acc.reset();
        held = e < E ? e : -1;
      }
    }
    acc.on = live && held >= 0;
    const float wr = w && live ? w[r * w_stride] : 1.0f;
    if constexpr (kBias) {
      const bool has_b = live && e < E;
      const BiasGluSrc<T, A, kStep, V, true> src{g + r * g_stride,
                                              u + r * u_stride,
                                              has_b ? bg + e * b_stride : nullptr,
                                              has_b ? bu + e * b_stride : nullptr,
                                              wr,
                                              c};
      quantize_row<BiasGluSrc<T, A, kStep, V, true>, V, N>(src, live, packs, lane, G, q + r * q_stride, q_vec,
                                                        scale + r * scale_stride, red[st & 1], &acc);
    } else {
      const GluSrc<T, A, kStep, V> src{g + r * g_stride, u + r * u_stride, wr, c};
      quantize_row<GluSrc<T, A, kStep, V>, V, N>(src, live, packs, lane, G, q + r * q_stride, q_vec,
                                                 scale + r * scale_stride, red[st & 1], &acc);
    }
  }
  if (held >= 0) acc.flush(amax + held * amax_stride, lane, G, packs);
}

// Calls go(IntTag<N>) with N = Elems / V for the first of Elems (values a lane holds) that
// holds ppl packs, or N = 0 (read the row twice) when none does. (16-bit rows start at 24
// values: 3,072 columns at 128 lanes, with fewer registers than 32 take, so more rows an SM.)
template <int V, typename Go>
Status pick_held(int64_t, Go&& go) {
  return go(detail::IntTag<0>{});
}
template <int V, int E0, int... Es, typename Go>
Status pick_held(int64_t ppl, Go&& go) {
  static_assert(E0 % V == 0, "values held per lane: a multiple of the pack");
  if (ppl * V <= E0) return go(detail::IntTag<E0 / V>{});
  return pick_held<V, Es...>(ppl, go);
}

// Lanes per row: the fewest of 32, 64, 128 that leave a lane at most kLaneValues values
// (registers for more warps, so more loads in flight), else 128 (a lane then holds up to the
// largest instance, or the row is read twice).
constexpr int64_t kLaneValues = 32;
int lanes_per_row(int64_t packs, int V) {
  for (int G : {32, 64}) {
    if ((packs + G - 1) / G * V <= kLaneValues) return G;
  }
  return 128;
}

// ---- rowwise, any alignment: a warp per row, one element at a time ----

constexpr int kScalarThreads = 256;  // 8 rows per block, a warp each

// Writes q[j] for j in [0, n) of one row from values produced by val(j), four per lane and
// 4-byte store where the row's q is 4-byte aligned, else one by one.
template <typename Val>
__device__ __forceinline__ void store_row(uint8_t* q, int64_t n, float s, int lane, Val&& val) {
  const bool vec = (reinterpret_cast<uintptr_t>(q) & 3) == 0;
  if (vec) {
    const int64_t n4 = n / 4;
    for (int64_t i = lane; i < n4; i += 32)
      reinterpret_cast<uint32_t*>(q)[i] = fp8::from_scaled2(val(4 * i) * s, val(4 * i + 1) * s) |
                                          (fp8::from_scaled2(val(4 * i + 2) * s, val(4 * i + 3) * s) << 16);
    for (int64_t j = 4 * n4 + lane; j < n; j += 32) q[j] = fp8::quantize(val(j), s);
  } else {
    for (int64_t j = lane; j < n; j += 32) q[j] = fp8::quantize(val(j), s);
  }
}

template <typename T>
__global__ void __launch_bounds__(kScalarThreads) quantize_rows_kernel(const T* x, int64_t x_stride, int64_t rows,
                                                                    int64_t cols, uint8_t* q, int64_t q_stride,
                                                                    float* scale, int64_t scale_stride) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kScalarThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* xr = x + row * x_stride;
  float amax = 0.0f;
  for (int64_t j = lane; j < cols; j += 32) amax = fmaxf(amax, fabsf(to_f(xr[j])));
  amax = warp_amax(amax);
  const float s = fp8::scale_of(amax);
  store_row(q + row * q_stride, cols, s, lane, [&](int64_t j) { return to_f(xr[j]); });
  if (lane == 0) scale[row * scale_stride] = 1.0f / s;
}

// bg (or null: no bias): the per-expert bias's gate and up parts, row e at e * b_stride.
template <typename T, Activation A>
__global__ void __launch_bounds__(kScalarThreads) glu_rows_kernel(const T* g, const T* u, int64_t g_stride,
                                                               int64_t u_stride, int step, const float* w,
                                                               int64_t w_stride, const T* bg, const T* bu,
                                                               int64_t b_stride, const int32_t* offs, int64_t E,
                                                               int64_t rows, int64_t F, math::Coeffs c, uint8_t* q,
                                                               int64_t q_stride, float* scale, int64_t scale_stride) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kScalarThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* gr = g + row * g_stride;
  const T* ur = u + row * u_stride;
  const float wr = w ? w[row * w_stride] : 1.0f;
  const int64_t e = bg ? detail::expert_of(offs, E, row) : E;
  const T* bgr = e < E ? bg + e * b_stride : nullptr;
  const T* bur = e < E ? bu + e * b_stride : nullptr;
  auto h = [&](int64_t j) {
    float gv = to_f(gr[j * step]), uv = to_f(ur[j * step]);
    if (bgr) gv += to_f(bgr[j * step]), uv += to_f(bur[j * step]);
    return math::glu_fwd<A>(gv, uv, wr, c);
  };
  float amax = 0.0f;
  for (int64_t j = lane; j < F; j += 32) amax = fmaxf(amax, fabsf(h(j)));
  amax = warp_amax(amax);
  const float s = fp8::scale_of(amax);
  store_row(q + row * q_stride, F, s, lane, h);
  if (lane == 0) scale[row * scale_stride] = 1.0f / s;
}

// The GLU form's column amax by its own read of gate_up, for the forms without a fused one
// (the scalar rows, rows too long to hold, lanes holding over 64 values): block b covers rows
// [chunk * (b / col_tiles), + chunk) and columns [256 (b % col_tiles), + 256), a column a
// thread (a warp reads 32 neighbouring columns of a row); each thread's running max of |h|
// (h rounded to T, as the activation's forward writes it; NaN ignored) over its expert's rows,
// merged into the zeroed amax by atomicMax on the float bits at an expert change and at the
// chunk's end. bg (or null: no bias): the bias, whose experts are offs's.
constexpr int kGluAmaxThreads = 256;
template <typename T, Activation A>
__global__ void __launch_bounds__(kGluAmaxThreads) glu_col_amax_kernel(
    const T* g, const T* u, int64_t g_stride, int64_t u_stride, int step, const float* w, int64_t w_stride,
    const T* bg, const T* bu, int64_t b_stride, const int32_t* __restrict__ offs, int64_t E, int64_t rows, int64_t F,
    math::Coeffs c, int64_t chunk, int64_t col_tiles, unsigned* __restrict__ amax, int64_t amax_stride) {
  const int64_t b = blockIdx.x;
  const int64_t j = (b % col_tiles) * kGluAmaxThreads + threadIdx.x;
  if (j >= F) return;  // no barriers below
  const int64_t r0 = (b / col_tiles) * chunk;
  const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;
  int64_t e = detail::expert_of(offs, E, r0), held = e;
  float m = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    while (e < E && offs[e] <= r) ++e;
    if (e >= E) break;  // rows past the last offset count for none
    if (e != held) {
      if (m > 0.0f) atomicMax(amax + held * amax_stride + j, __float_as_uint(m));
      m = 0.0f;
      held = e;
    }
    float gv = to_f(g[r * g_stride + j * step]), uv = to_f(u[r * u_stride + j * step]);
    if (bg) gv += to_f(bg[e * b_stride + j * step]), uv += to_f(bu[e * b_stride + j * step]);
    const float h = math::glu_fwd<A>(gv, uv, w ? w[r * w_stride] : 1.0f, c);
    m = fmaxf(m, fabsf(to_f(from_f<T>(h))));  // NaN ignored
  }
  if (held < E && m > 0.0f) atomicMax(amax + held * amax_stride + j, __float_as_uint(m));
}

// ---- per expert and column ----

constexpr int kAmaxThreads = 256;  // pass 1: 8 warps, each a row at a time
constexpr int kAmaxCols = 256;     // pass 1: columns per block, 8 per lane
// Pass 1: 4 rows (64 bytes) in flight per lane; at 64 registers, 4 blocks an SM: 64 KB of
// loads in flight per SM. 8 rows a lane took 116 registers (2 blocks: the same 64 KB) or
// spilled when bounded to 3 blocks, so pass 1 stays as it is.
constexpr int kAmaxUnroll = 4;

using colwise::load8;

// The scale buffer before pass 1 (kFinal false: 0, the amax's identity) and after it
// (kFinal true: the amax -> 1 / s; the amax read from `amax` (row stride amax_stride) when
// given, e.g. the one quantize_rowwise computed, else from the scale buffer itself).
template <bool kFinal>
__global__ void __launch_bounds__(256) col_scale_kernel(float* scale, int64_t stride, int64_t experts, int64_t cols,
                                                        const float* amax = nullptr, int64_t amax_stride = 0) {
  const int64_t n = experts * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / cols, j = i % cols;
    float* p = scale + e * stride + j;
    if constexpr (kFinal) *p = 1.0f / fp8::scale_of(amax ? amax[e * amax_stride + j] : *p); else *p = 0.0f;
  }
}

// Pass 1: block b covers rows [chunk * (b / col_tiles), + chunk) and columns
// [256 * (b % col_tiles), + 256); warp w reads rows w, w + 8, ... of each expert's run in the
// chunk, lane l columns 8 l .. 8 l + 7. Every access stays inside x whatever the offsets
// hold (runs are clamped to the chunk).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kAmaxThreads) col_amax_kernel(const T* __restrict__ x, int64_t x_stride,
                                                               int64_t rows, int64_t cols,
                                                               const int32_t* __restrict__ offsets, int64_t E,
                                                               int64_t chunk, int64_t col_tiles,
                                                               unsigned* amax, int64_t amax_stride) {
  __shared__ float part[kAmaxThreads / 32][kAmaxCols];
  const int64_t b = blockIdx.x;
  const int64_t r0 = (b / col_tiles) * chunk;
  const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;
  const int64_t tc0 = (b % col_tiles) * kAmaxCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c = tc0 + 8 * lane;
  int64_t e = detail::expert_of(offsets, E, r0);
  int64_t start = e == 0 ? 0 : offsets[e - 1];
  for (; e < E; ++e) {  // the same runs in every thread: the barriers below are uniform
    const int64_t end = offsets[e];
    const int64_t lo = start > r0 ? start : r0, hi = end < r1 ? end : r1;
    start = end;
    if (lo >= r1) break;
    if (hi <= lo) continue;
    float m[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) m[i] = 0.0f;
    if (c < cols) {
      for (int64_t r = lo + warp; r < hi; r += 8 * kAmaxUnroll) {
        Pack<T, 8> in[kAmaxUnroll];
#pragma unroll
        for (int k = 0; k < kAmaxUnroll; ++k)
          if (r + 8 * k < hi) load8<T, kVec>(x + (r + 8 * k) * x_stride, c, cols, in[k]);
#pragma unroll
        for (int k = 0; k < kAmaxUnroll; ++k)
          if (r + 8 * k < hi) {
#pragma unroll
            for (int i = 0; i < 8; ++i) m[i] = fmaxf(m[i], fabsf(pack_f(in[k], i)));  // NaN ignored
          }
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) part[warp][8 * lane + i] = m[i];
    __syncthreads();
    float mm = part[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < kAmaxThreads / 32; ++w) mm = fmaxf(mm, part[w][threadIdx.x]);
    const int64_t cc = tc0 + threadIdx.x;
    if (cc < cols && mm > 0.0f) atomicMax(amax + e * amax_stride + cc, __float_as_uint(mm));
    __syncthreads();
  }
}

// Pass 2: src/cuda/fp8_colwise.cuh.

// glu_colwise_grouped: the one-tile form with the activation recomputed from gate_up element
// by element (h = act(gate [+ bias], up [+ bias]) * w, rounded to T as the activation's forward
// writes it, so that the bytes are quantize_colwise_grouped's of that h; math::glu_fwd, the
// forward kernels' expression).
template <typename T, Activation A, bool kAligned>
__global__ void __launch_bounds__(colwise::kThreads, 3) glu_col_quant_kernel(
    const T* g, const T* u, int64_t g_stride, int64_t u_stride, int step, const float* __restrict__ w,
    int64_t w_stride, const T* bg, const T* bu, int64_t b_stride, math::Coeffs cf, int64_t rows, int64_t cols,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ pends, int64_t E,
    const float* __restrict__ scale, int64_t scale_stride, uint8_t* __restrict__ q, int64_t q_stride,
    int64_t out_rows, int64_t col_tiles, int q_align) {
  __shared__ __align__(16) uint32_t tile[colwise::kCols * colwise::kWords];
  const colwise::Tile ct = colwise::tile_of(blockIdx.x, col_tiles, rows, out_rows, offsets, pends, E);
  const int64_t c = ct.c0 + 8 * (threadIdx.x & 7);
  colwise::tile_pack(ct, cols, scale, scale_stride, tile, [&](int k, float (&v)[8]) {
    const int64_t r = ct.src[k];
    const float wr = w ? w[r * w_stride] : 1.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = 0.0f;
      if (c + i < cols) {
        const int64_t j = (c + i) * step;
        float gv = to_f(g[r * g_stride + j]), uv = to_f(u[r * u_stride + j]);
        if (bg) gv += to_f(bg[ct.ex[k] * b_stride + j]), uv += to_f(bu[ct.ex[k] * b_stride + j]);
        v[i] = to_f(from_f<T>(math::glu_fwd<A>(gv, uv, wr, cf)));
      }
    }
  });
  __syncthreads();
  colwise::tile_store<kAligned>(ct, tile, cols, out_rows, q, q_stride, q_align);
}

// glu_colwise_grouped's source for colwise::run_kernel: h = act(gate) * (up + beta) * w of 8
// columns from c, rounded to T (the bytes of the bf16 forward, then the column-wise pass, as
// glu_col_quant_kernel's). kStep 1: gate's 8 values at g + c and up's at u + c (16 bytes each);
// kStep 2 (interleaved, u = g + 1): the 8 pairs at g + 2c, 32 contiguous bytes. No bias (that
// form takes glu_col_quant_kernel).
template <typename T, Activation A, int kStep>
struct GluRows {
  static_assert(sizeof(T) == 2, "16-bit rows: 8 values a 16-byte pack");
  struct Raw {
    Pack<T, 8> a, b;  // kStep 1: gate, up; kStep 2: pairs 0-3, 4-7
    float w;
  };
  const T* g;
  const T* u;
  int64_t g_stride, u_stride;
  const float* w;
  int64_t w_stride;
  math::Coeffs cf;
  __device__ __forceinline__ float value(const Raw& p, int i) const {
    float gv, uv;
    if constexpr (kStep == 1) {
      gv = pack_f(p.a, i), uv = pack_f(p.b, i);
    } else {
      const Pack<T, 8>& h = i < 4 ? p.a : p.b;
      gv = pack_f(h, 2 * (i % 4)), uv = pack_f(h, 2 * (i % 4) + 1);
    }
    return to_f(from_f<T>(math::glu_fwd<A>(gv, uv, p.w, cf)));
  }
  // The row's gate and up bytes of columns c .. c + 7 copied into shared memory (cp_async; w's
  // too, or 1 stored there).
  __device__ __forceinline__ void load_async(int32_t r, int32_t c, Raw* dst) const {
    const T* gr = g + static_cast<int64_t>(r) * g_stride;
    if constexpr (kStep == 1) {
      cp_async<16>(&dst->a, gr + c);
      cp_async<16>(&dst->b, u + static_cast<int64_t>(r) * u_stride + c);
    } else {
      cp_async<16>(&dst->a, gr + 2 * c);
      cp_async<16>(&dst->b, gr + 2 * c + 8);
    }
    if (w) cp_async<4>(&dst->w, w + static_cast<int64_t>(r) * w_stride);
    else dst->w = 1.0f;
  }
};

// Blocks of `threads` for `rows` rows of `lanes` lanes each.
unsigned blocks_for(int64_t rows, int threads, int lanes = 32) {
  return static_cast<unsigned>((rows + threads / lanes - 1) / (threads / lanes));
}

// Whether rows at q, q_stride bytes apart, take accesses of V bytes (q's rows: stores of one
// pack of V outputs).
bool q_packs(const void* q, int64_t q_stride, int64_t rows, int V) {
  return reinterpret_cast<uintptr_t>(q) % V == 0 && (rows <= 1 || q_stride % V == 0);
}

// ---- the fused activation backward, rowwise (fp8_glu_backward_rowwise) ----
//
// Vector form: G lanes per row (32, 64, 128 or 256: the fewest that leave a lane at most 16
// float32 values, else 256; blocks of 256 threads, at most 128 registers), each lane the packs lane, lane + G, ... of the row (a pack: V
// columns of gate and of up, 16 bytes of gate_up; dy's V values alongside, the bias's packs
// too). All of a lane's loads are issued, then its float32 gradients (dg, du: 2V values a
// pack) computed once and held in registers while the row's amax (NaN ignored) and the
// weights' gradient sum are reduced across its lanes (shuffles, then shared memory); then
// quantised from there (from_scaled4) and written as 2V bytes a pack. The copy in T
// (dgate_up_out) is written before the row's reduction, from the same rounded words that the
// column amax takes. Blocks take contiguous runs of rows; with the column amax, each lane
// keeps its columns' running max per expert (16-bit T: in registers, two values a word;
// float32: in shared memory, each thread its own words) and merges them into col_amax (zeroed
// first) by atomicMax on the float bits when its expert changes and at the end, as
// quantize_rows_amax_kernel does.
// Rows longer than a lane holds (over 32 values at 256 lanes: F > 4,096) and operands that allow no 16-byte pack take the scalar form: a warp per row,
// the gradient computed twice (amax and sums, then the bytes), the column amax by one
// atomicMax per positive element.
template <typename T>
struct BwdRowArgs {
  const T* g;
  const T* u;
  int64_t x_stride;  // gate_up's row stride (g and u are parts of one row)
  const T* dy;
  int64_t dy_stride;
  const float* w;
  int64_t w_stride;
  const T* bg;  // null: no bias
  const T* bu;
  int64_t b_stride;
  const int32_t* offs;  // the experts' end rows (bias and column amax)
  int64_t E;
  int64_t rows;
  math::Coeffs c;
  int step;
  int64_t F;
  uint8_t* q;
  int64_t q_stride, q_g, q_u;
  float* scale;
  int64_t scale_stride;
  float* dw;  // null: not wanted
  int64_t dw_stride;
  unsigned* amax;  // null: not wanted
  int64_t amax_stride;
  T* dgu;  // null: not wanted
  int64_t dgu_stride;
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The row's amax and sum across its G lanes (every thread of the block calls this: a
// block-wide barrier for G > 32; red_a / red_s alternate by row parity, as row_amax's red).
__device__ __forceinline__ void row_amax_sum(float& a, float& sum, int G, float* red_a, float* red_s) {
  a = warp_amax(a);
  sum = warp_sum(sum);
  if (G > 32) {
    const int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) red_a[warp] = a, red_s[warp] = sum;
    __syncthreads();
    const int w0 = warp & ~(G / 32 - 1);
    a = red_a[w0];
    sum = red_s[w0];
    for (int k = 1; k < G / 32; ++k) a = fmaxf(a, red_a[w0 + k]), sum += red_s[w0 + k];
  }
}

constexpr int kBwdThreads = 256;  // G = 32 .. 256 lanes a row
constexpr int kBwdHeld = 32;      // float32 values a lane holds at most (2 V N)

// (256, 2): at most 128 registers, two blocks an SM.
//
// ahead: each row's lane 0 asks L2 for the row `ahead` steps on (prefetch_l2; 0: none). A block
// works on one row at a time with a barrier in it (the row's amax), so its loads come in bursts
// that leave DRAM idle between them; fetched ahead, they arrive from L2. kBias: a.bg is set
// (without it the bias's loads and adds are compiled out, not predicated). kW: a.w is set;
// without it the weight is the constant 1, so the multiplies by it fold away, and the
// weights' gradient, which needs a.w, is neither computed nor summed across the row. Both
// because on an H200 the kernel is bound by its instructions (docs/notes/perf-notes.md, the
// fused backward's instruction count).
template <typename T, Activation A, int kStep, int V, int N, bool kAmax, bool kBias, bool kW>
__global__ void __launch_bounds__(kBwdThreads, 2) glu_bwd_rows_vec_kernel(const BwdRowArgs<T> a, int packs, int G,
                                                                      bool q_vec, int64_t per_block, int ahead) {
  static_assert(2 * V * N <= kBwdHeld, "a lane holds at most kBwdHeld values");
  __shared__ float red_a[2][kBwdThreads / 32], red_s[2][kBwdThreads / 32];  // by row parity
  // The column amax of a lane's values, of the gradient as rounded to T (the values
  // dgate_up_out gets, which the column-wise pass quantises). 16-bit T: in registers, two
  // values a word, cw[j][k] holding values 2k and 2k + 1 of pack j, taken from the same
  // rounded words the copy stores (absmax2: one instruction a word; sign bits are dropped at
  // the flush). float32 T: in shared memory, to spare registers, value i of pack j at
  // cm[(j * 2V + i) * kBwdThreads + thread] (each thread its own words: no bank conflicts).
  constexpr bool kHalf = sizeof(T) == 2;
  static_assert(!kHalf || kStep == 2 || V % 2 == 0, "gate's and up's values of a pack fill whole words");
  __shared__ float cm[kAmax && !kHalf ? N * 2 * V * kBwdThreads : 1];
  uint32_t cw[N][kHalf ? V : 1] = {};
  const int R = kBwdThreads / G, lane = threadIdx.x & (G - 1);
  const int64_t steps = (a.rows + R - 1) / R;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t s1 = s0 + per_block < steps ? s0 + per_block : steps;
  const bool need_e = kBias || kAmax;
  int64_t e = need_e ? detail::expert_of(a.offs, a.E, s0 * R + threadIdx.x / G) : 0;
  int64_t held = -1;
  auto at = [&](int j, int i) -> float& { return cm[(j * 2 * V + i) * kBwdThreads + threadIdx.x]; };
  // Value i of pack j, as held (0 where nothing was seen).
  auto value_at = [&](int j, int i) -> float {
    if constexpr (kHalf) return half_abs_f<T>(cw[j][i / 2], i % 2);
    else return at(j, i);
  };
  auto reset = [&] {
    if constexpr (kAmax) {
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if constexpr (kHalf) {
#pragma unroll
          for (int k = 0; k < V; ++k) cw[j][k] = 0u;
        } else {
#pragma unroll
          for (int i = 0; i < 2 * V; ++i) at(j, i) = 0.0f;
        }
      }
    }
  };
  // Pack j's 2V columns: gate's V then up's V (kStep 1: at q_g / q_u + V p), or V pairs
  // (kStep 2: at 2V p).
  auto flush = [&] {
    if constexpr (kAmax) {
      if (held < 0) return;
      unsigned* dst = a.amax + held * a.amax_stride;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int p = lane + G * j;
        if (p < packs) {
#pragma unroll
          for (int i = 0; i < 2 * V; ++i) {
            const int64_t col = kStep == 2 ? 2 * V * static_cast<int64_t>(p) + i
                                           : (i < V ? a.q_g : a.q_u) + static_cast<int64_t>(V) * p + (i % V);
            const float v = value_at(j, i);
            if (v > 0.0f) atomicMax(dst + col, __float_as_uint(v));
          }
        }
      }
    }
  };
  reset();
  const uint32_t pack_bytes = V * sizeof(T);
  for (int64_t st = s0; st < s1; ++st) {  // the same count in every thread: the barriers
    const int64_t row = st * R + threadIdx.x / G;
    const bool live = row < a.rows;
    const int64_t r = live ? row : 0;
    if (ahead > 0 && lane == 0 && st + ahead < s1) {
      const int64_t nr = row + ahead * R;
      if (nr < a.rows) {
        // (A row part whose address or size is not a multiple of 16 bytes, which the 8-byte
        // packs of the interleaved and float32 forms allow, is not fetched.)
        auto fetch = [](const T* ptr, uint32_t bytes) {
          if (((reinterpret_cast<uintptr_t>(ptr) | bytes) & 15) == 0) prefetch_l2(ptr, bytes);
        };
        fetch(a.g + nr * a.x_stride, packs * pack_bytes * kStep);
        if (kStep == 1) fetch(a.u + nr * a.x_stride, packs * pack_bytes);
        fetch(a.dy + nr * a.dy_stride, packs * pack_bytes);
      }
    }
    if (live && need_e) {
      while (e < a.E && a.offs[e] <= row) ++e;
      if constexpr (kAmax) {
        if (e != held) {
          flush();
          reset();
          held = e < a.E ? e : -1;
        }
      }
    }
    const T* g = a.g + r * a.x_stride;
    const T* u = a.u + r * a.x_stride;
    const T* dy = a.dy + r * a.dy_stride;
    const bool has_b = kBias && e < a.E;
    const T* bg = has_b ? a.bg + e * a.b_stride : nullptr;
    const T* bu = has_b ? a.bu + e * a.b_stride : nullptr;
    const float w = kW && live ? a.w[r * a.w_stride] : 1.0f;
    T* dgr = a.dgu && live ? a.dgu + r * a.dgu_stride : nullptr;
    GuPack<T, V, kStep> in[N];
    Pack<T, V> d[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int p = lane + G * j;
      if (live && p < packs) {
        load_raw<T, V, kStep>(g, u, p, in[j]);
        d[j] = reinterpret_cast<const Pack<T, V>*>(dy)[p];
      }
    }
    float h[N][2 * V];
    float m = 0.0f, sum = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int p = lane + G * j;
      if (live && p < packs) {
        GuPack<T, V, kStep> b;
        if (bg) load_raw<T, V, kStep>(bg, bu, p, b);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          float gv = gate_of(in[j], i), uv = up_of(in[j], i);
          if (bg) gv += gate_of(b, i), uv += up_of(b, i);
          float dg, du, term;
          math::glu_bwd<A>(gv, uv, pack_f(d[j], i), w, a.c, dg, du, term);
          // held in output order: kStep 2 pairs (dg, du), kStep 1 gate's V then up's V
          h[j][kStep == 2 ? 2 * i : i] = dg;
          h[j][kStep == 2 ? 2 * i + 1 : V + i] = du;
          if constexpr (kW) sum += term;
          m = fmaxf(m, fmaxf(fabsf(dg), fabsf(du)));
        }
        const bool take_amax = kAmax && held >= 0;
        if constexpr (kHalf) {
          // The gradient rounded to T, two values a word (values 2k and 2k + 1 of the pack:
          // adjacent columns of gate's or up's part, or a pair, whichever the layout): stored
          // as dgate_up_out now (it needs no scale) and maxed into the column amax.
          if (dgr || take_amax) {
            uint32_t wd[V];
#pragma unroll
            for (int k = 0; k < V; ++k) wd[k] = pack2_of<T>(h[j][2 * k], h[j][2 * k + 1]);
            if (dgr) {
              if constexpr (kStep == 2) {
                store_words<V>(dgr + 2 * V * static_cast<int64_t>(p), wd);
              } else {
                store_words<V / 2>(dgr + a.q_g + V * static_cast<int64_t>(p), wd);
                store_words<V / 2>(dgr + a.q_u + V * static_cast<int64_t>(p), wd + V / 2);
              }
            }
            if (take_amax) {
#pragma unroll
              for (int k = 0; k < V; ++k) cw[j][k] = absmax2<T>(cw[j][k], wd[k]);
            }
          }
        } else if (take_amax) {
#pragma unroll
          for (int i = 0; i < 2 * V; ++i) at(j, i) = fmaxf(at(j, i), fabsf(h[j][i]));
        }
      }
    }
    if constexpr (kW) row_amax_sum(m, sum, G, red_a[st & 1], red_s[st & 1]);
    else m = row_amax(m, G, red_a[st & 1]);
    if (!live) continue;
    const float s = fp8::scale_of(m);
    uint8_t* qr = a.q + r * a.q_stride;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int p = lane + G * j;
      if (p < packs) {
        if constexpr (kStep == 2) {
          float x[2 * V];
#pragma unroll
          for (int i = 0; i < 2 * V; ++i) x[i] = h[j][i] * s;
          store_q<2 * V>(qr, p, x, q_vec);
          if (!kHalf && dgr) {  // (16-bit T: stored with the amax above)
            Pack<T, 2 * V> o;
#pragma unroll
            for (int i = 0; i < 2 * V; ++i) o.v[i] = from_f<T>(h[j][i]);
            reinterpret_cast<Pack<T, 2 * V>*>(dgr)[p] = o;
          }
        } else {
          float xg[V], xu[V];
#pragma unroll
          for (int i = 0; i < V; ++i) xg[i] = h[j][i] * s, xu[i] = h[j][V + i] * s;
          store_q<V>(qr + a.q_g, p, xg, q_vec);
          store_q<V>(qr + a.q_u, p, xu, q_vec);
          if (!kHalf && dgr) {
            Pack<T, V> og, ou;
#pragma unroll
            for (int i = 0; i < V; ++i) og.v[i] = from_f<T>(h[j][i]), ou.v[i] = from_f<T>(h[j][V + i]);
            reinterpret_cast<Pack<T, V>*>(dgr + a.q_g)[p] = og;
            reinterpret_cast<Pack<T, V>*>(dgr + a.q_u)[p] = ou;
          }
        }
      }
    }
    if (lane == 0) {
      a.scale[r * a.scale_stride] = 1.0f / s;
      if (kW && a.dw) a.dw[r * a.dw_stride] = sum;
    }
  }
  flush();
}

template <typename T, Activation A>
__global__ void __launch_bounds__(kScalarThreads) glu_bwd_rows_kernel(const BwdRowArgs<T> a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kScalarThreads / 32) + threadIdx.x / 32;
  if (row >= a.rows) return;
  const int lane = threadIdx.x & 31;
  const int64_t sp = a.step;
  const T* g = a.g + row * a.x_stride;
  const T* u = a.u + row * a.x_stride;
  const T* dy = a.dy + row * a.dy_stride;
  const float w = a.w ? a.w[row * a.w_stride] : 1.0f;
  const int64_t e = a.offs ? detail::expert_of(a.offs, a.E, row) : a.E;
  const T* bg = a.bg && e < a.E ? a.bg + e * a.b_stride : nullptr;
  const T* bu = a.bg && e < a.E ? a.bu + e * a.b_stride : nullptr;
  auto grad = [&](int64_t j, float& dg, float& du, float& term) {
    float gv = to_f(g[j * sp]), uv = to_f(u[j * sp]);
    if (bg) gv += to_f(bg[j * sp]), uv += to_f(bu[j * sp]);
    math::glu_bwd<A>(gv, uv, to_f(dy[j]), w, a.c, dg, du, term);
  };
  float m = 0.0f, sum = 0.0f;
  for (int64_t j = lane; j < a.F; j += 32) {
    float dg, du, term;
    grad(j, dg, du, term);
    m = fmaxf(m, fmaxf(fabsf(dg), fabsf(du)));
    sum += term;
  }
  m = warp_amax(m);
  sum = warp_sum(sum);
  const float s = fp8::scale_of(m);
  uint8_t* qr = a.q + row * a.q_stride;
  T* dgr = a.dgu ? a.dgu + row * a.dgu_stride : nullptr;
  unsigned* am = a.amax && e < a.E ? a.amax + e * a.amax_stride : nullptr;
  for (int64_t j = lane; j < a.F; j += 32) {
    float dg, du, term;
    grad(j, dg, du, term);
    const int64_t cg = a.q_g + j * sp, cu = a.q_u + j * sp;
    qr[cg] = fp8::quantize(dg, s);
    qr[cu] = fp8::quantize(du, s);
    if (dgr) dgr[cg] = from_f<T>(dg), dgr[cu] = from_f<T>(du);
    if (am) {  // of the values as rounded to T (what dgr gets)
      const float ag = fabsf(to_f(from_f<T>(dg))), au = fabsf(to_f(from_f<T>(du)));
      if (ag > 0.0f) atomicMax(am + cg, __float_as_uint(ag));
      if (au > 0.0f) atomicMax(am + cu, __float_as_uint(au));
    }
  }
  if (lane == 0) {
    a.scale[row * a.scale_stride] = 1.0f / s;
    if (a.dw) a.dw[row * a.dw_stride] = sum;
  }
}

}  // namespace
}  // namespace expertact::cuda

namespace expertact::detail {

// Rows whose input allows 16-byte packs (pick_pack: pointer and row stride aligned, the
// columns a multiple of the pack) take the vector kernels, which hold the row in registers up
// to 128 values (plain 16-bit rows: 256) per lane, 4,096 (8,192) per row; others the scalar
// kernels.
namespace {

// The column-wise pass's setup, shared by quantize_colwise_grouped and glu_colwise_grouped:
// the scale kernel's grid, the widest store q_t's rows take, and the pass-2 tiles (0 when
// there is nothing to write).
unsigned col_scale_blocks(const Fp8Cols& c) {
  const int64_t n = c.experts * c.cols;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, cuda::sm_count(c.device_id) * 8)));
}

int q_t_align(const Fp8Cols& c) {
  const auto addr = reinterpret_cast<uintptr_t>(c.q_t);
  const bool one_row = c.cols <= 1;
  return addr % 16 == 0 && (one_row || c.q_stride % 16 == 0)  ? 16
         : addr % 4 == 0 && (one_row || c.q_stride % 4 == 0) ? 4
                                                              : 1;
}

// The steps of rows ahead that quantize_rows_amax_kernel asks L2 for (its `ahead`): one step
// took 0.88x the time of none and 0.90x that of two on an H200 (docs/notes/perf-notes.md,
// rowwise column amax prefetch).
constexpr int kRowsPrefetchSteps = 1;
// The same for glu_bwd_rows_vec_kernel: one step took 0.91x the time of two on an H200, the
// expert MLP's instance (docs/notes/perf-notes.md, fused backward prefetch).
constexpr int kBwdPrefetchSteps = 1;

// Pass 2 by run_kernel over `src`: the next tile copied into shared memory while the current
// one is packed (colwise::run_kernel).
template <typename Src>
Status launch_runs(const Src& src, const Fp8Cols& c, const int32_t* pends, int64_t col_tiles, int32_t subs,
                   int64_t blocks, cudaStream_t st) {
  namespace cw = cuda::colwise;
  auto kernel = cw::run_kernel<Src>;
  const int dyn = cw::async_stage_bytes<Src>();
  EA_TRY(cuda::cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn),
                          "fp8 colwise shared memory"));
  kernel<<<static_cast<unsigned>(blocks), cw::kThreads, dyn, st>>>(
      src, static_cast<int32_t>(c.rows), static_cast<int32_t>(c.cols), c.offsets, pends,
      static_cast<int32_t>(c.experts), c.scale, c.scale_stride, static_cast<uint8_t*>(c.q_t), c.q_stride,
      static_cast<int32_t>(c.out_rows), static_cast<int32_t>(col_tiles), subs);
  return cuda::cuda_check(cudaGetLastError(), "fp8 colwise quantize kernel launch");
}

// The scales straight from the given amax (no pass 1).
Status col_scales_from_amax(const Fp8Cols& c, cudaStream_t st) {
  if (c.experts * c.cols == 0) return Status::kOk;
  cuda::col_scale_kernel<true><<<col_scale_blocks(c), 256, 0, st>>>(c.scale, c.scale_stride, c.experts, c.cols, c.amax,
                                                                    c.amax_stride);
  return cuda::cuda_check(cudaGetLastError(), "fp8 colwise scale kernel launch");
}

Status col_tiles_of(const Fp8Cols& c, int64_t& col_tiles, int64_t& tiles) {
  namespace cw = cuda::colwise;
  col_tiles = (c.cols + cw::kCols - 1) / cw::kCols;
  tiles = c.out_rows == 0 || c.cols == 0 ? 0 : col_tiles * ((c.out_rows + cw::kRows - 1) / cw::kRows);
  if (tiles > 0x7fffffff) return fail(Status::kInvalidArgument, "q_t is too large (", c.cols, " x ", c.out_rows, ")");
  return Status::kOk;
}

// quantize_rowwise's col_amax: zeroed first (the atomics' identity).
Status col_amax_zero(const Fp8Rows& p, cudaStream_t st) {
  const int64_t sm = cuda::sm_count(p.device_id);
  const int64_t n = p.col_amax_experts * p.cols;
  const unsigned zb = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, sm * 8)));
  cuda::col_scale_kernel<false><<<zb, 256, 0, st>>>(p.col_amax, p.col_amax_stride, p.col_amax_experts, p.cols);
  return cuda::cuda_check(cudaGetLastError(), "fp8 col_amax zero kernel launch");
}

// The col_amax by its own read of x, for the forms without a fused one (the scalar rows,
// rows too long to hold, lanes holding over 64 values): colwise pass 1 into it
// (non-negative floats order as their bits).
Status col_amax_separate(const Fp8Rows& p, cudaStream_t st) {
  if (p.rows == 0 || p.cols == 0) return Status::kOk;
  const int64_t sm = cuda::sm_count(p.device_id);
  const int64_t es = detail::dtype_size(p.dtype);
  const bool vec = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && (p.rows <= 1 || (p.x_stride * es) % 16 == 0);
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    return detail::dispatch_bool(vec, [&](auto vt) -> Status {
      constexpr bool kVec = decltype(vt)::value;
      const int64_t col_tiles = (p.cols + cuda::kAmaxCols - 1) / cuda::kAmaxCols;
      const int64_t want = std::max<int64_t>(1, sm * 64 / col_tiles);
      int64_t chunk = (p.rows + want - 1) / want;
      chunk = (chunk + 31) / 32 * 32;
      const int64_t blocks = col_tiles * ((p.rows + chunk - 1) / chunk);
      if (blocks > 0x7fffffff) return fail(Status::kInvalidArgument, "x is too large (", p.rows, " x ", p.cols, ")");
      cuda::col_amax_kernel<T, kVec><<<static_cast<unsigned>(blocks), cuda::kAmaxThreads, 0, st>>>(
          static_cast<const T*>(p.x), p.x_stride, p.rows, p.cols, p.col_amax_offsets, p.col_amax_experts, chunk,
          col_tiles, reinterpret_cast<unsigned*>(p.col_amax), p.col_amax_stride);
      return cuda::cuda_check(cudaGetLastError(), "fp8 col_amax kernel launch");
    });
  });
}

}  // namespace

Status cuda_fp8_quantize_rowwise(const Fp8Rows& p, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{"x", p.x}, {"q", p.q}, {"scale", p.scale}, {"col_amax_offsets", p.col_amax_offsets},
                         {"col_amax", p.col_amax}}));
  if (p.rows > 0x7fffffffLL) return fail(Status::kInvalidArgument, "too many rows (", p.rows, ")");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.col_amax) EA_TRY(col_amax_zero(p, st));
  if (p.rows == 0) return Status::kOk;
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    constexpr int es = sizeof(T), kV = 16 / es;
    const cuda::Operand ops[] = {{p.x, p.x_stride, 1}};
    const int V = cuda::pick_pack(ops, 1, p.cols, p.rows, es, 1);
    if (V != kV || p.cols / kV > 0x7fffffff) {
      if (p.col_amax) EA_TRY(col_amax_separate(p, st));
      cuda::quantize_rows_kernel<T><<<cuda::blocks_for(p.rows, cuda::kScalarThreads), cuda::kScalarThreads, 0, st>>>(
          static_cast<const T*>(p.x), p.x_stride, p.rows, p.cols, static_cast<uint8_t*>(p.q), p.q_stride, p.scale,
          p.scale_stride);
      return cuda::cuda_check(cudaGetLastError(), "fp8 quantize kernel launch");
    }
    const int packs = static_cast<int>(p.cols / kV);
    const bool q_vec = cuda::q_packs(p.q, p.q_stride, p.rows, kV);
    const int G = cuda::lanes_per_row(packs, kV);
    auto go = [&](auto n) -> Status {
      constexpr int N = decltype(n)::value;
      if constexpr (N > 0 && N * kV <= 64) {
        if (p.col_amax) {
          auto kernel = cuda::quantize_rows_amax_kernel<T, kV, N>;
          int per_sm = 0;
          EA_TRY(cuda::cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, cuda::kRowThreads, 0),
                                  "fp8 rowwise occupancy"));
          const int64_t steps = (p.rows + cuda::kRowThreads / G - 1) / (cuda::kRowThreads / G);
          const int64_t want = std::max<int64_t>(1, per_sm) * cuda::sm_count(p.device_id);
          const int64_t per_block = (steps + want - 1) / want;
          const int64_t blocks = (steps + per_block - 1) / per_block;
          kernel<<<static_cast<unsigned>(blocks), cuda::kRowThreads, 0, st>>>(
              static_cast<const T*>(p.x), p.x_stride, p.rows, packs, G, static_cast<uint8_t*>(p.q), p.q_stride, q_vec,
              p.scale, p.scale_stride, p.col_amax_offsets, p.col_amax_experts,
              reinterpret_cast<unsigned*>(p.col_amax), p.col_amax_stride, per_block, kRowsPrefetchSteps);
          return cuda::cuda_check(cudaGetLastError(), "fp8 quantize kernel launch");
        }
      }
      if (p.col_amax) EA_TRY(col_amax_separate(p, st));
      cuda::quantize_rows_vec_kernel<T, kV, N>
          <<<cuda::blocks_for(p.rows, cuda::kRowThreads, G), cuda::kRowThreads, 0, st>>>(
              static_cast<const T*>(p.x), p.x_stride, p.rows, packs, G, static_cast<uint8_t*>(p.q), p.q_stride,
              q_vec, p.scale, p.scale_stride);
      return cuda::cuda_check(cudaGetLastError(), "fp8 quantize kernel launch");
    };
    const int64_t ppl = (packs + G - 1) / G;
    if constexpr (es == 2) return cuda::pick_held<kV, 24, 32, 64, 128>(ppl, go);
    else return cuda::pick_held<kV, 32, 64>(ppl, go);
  });
}

Status cuda_fp8_glu_rowwise(const GluProblem& p, const Fp8Out& o, const GluBias* bias, const Fp8ColAmax* amax,
                            void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{p.packed ? "gate_up" : "gate", p.g}, {"up", p.packed ? nullptr : p.u}, {"weights", p.w},
                         {"bias", bias ? bias->bg : nullptr}, {"offsets", bias ? bias->er.offsets : nullptr},
                         {"q", o.q}, {"scale", o.scale}, {"col_amax_offsets", amax ? amax->offsets : nullptr},
                         {"col_amax", amax ? amax->col_amax : nullptr}}));
  if (p.rows > 0x7fffffffLL) return fail(Status::kInvalidArgument, "too many rows (", p.rows, ")");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (amax) {
    // Zeroed first (the atomics' identity).
    const int64_t n = amax->experts * p.F;
    if (n > 0) {
      const unsigned zb =
          static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, cuda::sm_count(p.device_id) * 8));
      cuda::col_scale_kernel<false><<<zb, 256, 0, st>>>(amax->col_amax, amax->stride, amax->experts, p.F);
      EA_TRY(cuda::cuda_check(cudaGetLastError(), "fp8 glu col_amax zero kernel launch"));
    }
  }
  if (p.rows == 0) return Status::kOk;
  const math::Coeffs c{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  unsigned* am = amax ? reinterpret_cast<unsigned*>(amax->col_amax) : nullptr;
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    constexpr int es = sizeof(T);
    // gate/up, and the bias's rows as one more pair of the same layout (E rows).
    cuda::Operand ops[4];
    int n = cuda::gu_operands(ops, p.g, p.g_stride, p.u, p.u_stride, p.step);
    if (bias)
      n += cuda::gu_operands(ops + n, bias->bg, bias->b_stride, bias->bu, bias->b_stride, p.step,
                             bias->er.experts);
    const int V = cuda::pick_pack(ops, n, p.F, p.rows, es, p.step);
    const T* bg = bias ? static_cast<const T*>(bias->bg) : nullptr;
    const T* bu = bias ? static_cast<const T*>(bias->bu) : nullptr;
    const int64_t b_stride = bias ? bias->b_stride : 0, E = bias ? bias->er.experts : 0;
    const int32_t* offs = bias ? bias->er.offsets : nullptr;
    return dispatch_act(p.params.act, [&](auto act) -> Status {
      constexpr Activation A = decltype(act)::value;
      // The column amax by its own pass (the forms without a fused one).
      auto amax_separate = [&]() -> Status {
        if (p.F == 0) return Status::kOk;
        const int64_t col_tiles = (p.F + cuda::kGluAmaxThreads - 1) / cuda::kGluAmaxThreads;
        const int64_t want = std::max<int64_t>(1, cuda::sm_count(p.device_id) * 16 / col_tiles);
        int64_t chunk = (p.rows + want - 1) / want;
        chunk = (chunk + 31) / 32 * 32;
        const int64_t blocks = col_tiles * ((p.rows + chunk - 1) / chunk);
        if (blocks > 0x7fffffff) return fail(Status::kInvalidArgument, "h is too large (", p.rows, " x ", p.F, ")");
        cuda::glu_col_amax_kernel<T, A><<<static_cast<unsigned>(blocks), cuda::kGluAmaxThreads, 0, st>>>(
            static_cast<const T*>(p.g), static_cast<const T*>(p.u), p.g_stride, p.u_stride, p.step, p.w,
            p.w_stride, bg, bu, b_stride, amax->offsets, amax->experts, p.rows, p.F, c, chunk, col_tiles, am,
            amax->stride);
        return cuda::cuda_check(cudaGetLastError(), "fp8 glu col_amax kernel launch");
      };
      if (V != 16 / es / p.step || p.F / V > 0x7fffffff) {
        if (amax) EA_TRY(amax_separate());
        cuda::glu_rows_kernel<T, A><<<cuda::blocks_for(p.rows, cuda::kScalarThreads), cuda::kScalarThreads, 0, st>>>(
            static_cast<const T*>(p.g), static_cast<const T*>(p.u), p.g_stride, p.u_stride, p.step, p.w, p.w_stride,
            bg, bu, b_stride, offs, E, p.rows, p.F, c, static_cast<uint8_t*>(o.q), o.q_stride, o.scale,
            o.scale_stride);
        return cuda::cuda_check(cudaGetLastError(), "fp8 glu kernel launch");
      }
      return dispatch_step(p.step, [&](auto step) -> Status {
        constexpr int kStep = decltype(step)::value, kV = 16 / es / kStep;
        const int packs = static_cast<int>(p.F / kV);
        const bool q_vec = cuda::q_packs(o.q, o.q_stride, p.rows, kV);
        const int G = cuda::lanes_per_row(packs, kV);
        auto go = [&](auto n) -> Status {
          constexpr int N = decltype(n)::value;
          if constexpr (N > 0 && N * kV <= 64) {
            if (amax) {
              // The fused column amax: as many blocks as are resident, each a contiguous run of
              // rows (few merges).
              auto fused = [&](auto kernel) -> Status {
                int per_sm = 0;
                EA_TRY(cuda::cuda_check(
                    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, cuda::kRowThreads, 0),
                    "fp8 glu occupancy"));
                const int64_t steps = (p.rows + cuda::kRowThreads / G - 1) / (cuda::kRowThreads / G);
                const int64_t want = std::max<int64_t>(1, per_sm) * cuda::sm_count(p.device_id);
                const int64_t per_block = (steps + want - 1) / want;
                const int64_t blocks = (steps + per_block - 1) / per_block;
                kernel<<<static_cast<unsigned>(blocks), cuda::kRowThreads, 0, st>>>(
                    static_cast<const T*>(p.g), static_cast<const T*>(p.u), p.g_stride, p.u_stride, p.w, p.w_stride,
                    bg, bu, b_stride, amax->offsets, amax->experts, p.rows, packs, G, c,
                    static_cast<uint8_t*>(o.q), o.q_stride, q_vec, o.scale, o.scale_stride, am, amax->stride,
                    per_block);
                return cuda::cuda_check(cudaGetLastError(), "fp8 glu kernel launch");
              };
              if (bias) return fused(cuda::glu_rows_amax_kernel<T, A, kStep, kV, N, true>);
              return fused(cuda::glu_rows_amax_kernel<T, A, kStep, kV, N, false>);
            }
          }
          if (amax) EA_TRY(amax_separate());
          if (bias) {
            if constexpr (N * kV > 64) {
              return fail(Status::kInternal, "no biased kernel holds ", N * kV, " values a lane");
            } else {
              cuda::glu_rows_bias_kernel<T, A, kStep, kV, N>
                  <<<cuda::blocks_for(p.rows, cuda::kRowThreads, G), cuda::kRowThreads, 0, st>>>(
                      static_cast<const T*>(p.g), static_cast<const T*>(p.u), p.g_stride, p.u_stride, p.w,
                      p.w_stride, bg, bu, b_stride, offs, E, p.rows, packs, G, c, static_cast<uint8_t*>(o.q),
                      o.q_stride, q_vec, o.scale, o.scale_stride);
            }
          } else {
            cuda::glu_rows_vec_kernel<T, A, kStep, kV, N>
                <<<cuda::blocks_for(p.rows, cuda::kRowThreads, G), cuda::kRowThreads, 0, st>>>(
                    static_cast<const T*>(p.g), static_cast<const T*>(p.u), p.g_stride, p.u_stride, p.w, p.w_stride,
                    p.rows, packs, G, c, static_cast<uint8_t*>(o.q), o.q_stride, q_vec, o.scale, o.scale_stride);
          }
          return cuda::cuda_check(cudaGetLastError(), "fp8 glu kernel launch");
        };
        // The biased form holds at most 64 values a lane: 128 spilled (its loads carry the
        // bias packs too).
        const int64_t ppl = (packs + G - 1) / G;
        if constexpr (es == 2) {
          if (!bias) return cuda::pick_held<kV, 24, 32, 64, 128>(ppl, go);
        }
        return cuda::pick_held<kV, 32, 64>(ppl, go);
      });
    });
  });
}

Status cuda_fp8_quantize_colwise_grouped(const Fp8Cols& p, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{"x", p.x}, {"offsets", p.offsets}, {"padded_offsets", p.padded}, {"q_t", p.q_t},
                         {"scale", p.scale}, {"amax", p.amax}}));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t es = detail::dtype_size(p.dtype);
  // 16-byte packs of x when its pointer and row stride allow (any column count: a row's last
  // partial pack is read element by element).
  const bool vec = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && (p.rows <= 1 || (p.x_stride * es) % 16 == 0);
  const int q_align = q_t_align(p);
  const int32_t* pends = p.padded ? p.padded : p.offsets;
  const int64_t sm = cuda::sm_count(p.device_id);
  const unsigned scale_blocks = col_scale_blocks(p);
  if (p.amax) {
    EA_TRY(col_scales_from_amax(p, st));  // the amax given: no pass 1
  } else {
    // The scales: zeroed, then (after pass 1) turned from amax into 1 / s.
    cuda::col_scale_kernel<false><<<scale_blocks, 256, 0, st>>>(p.scale, p.scale_stride, p.experts, p.cols);
    EA_TRY(cuda::cuda_check(cudaGetLastError(), "fp8 colwise scale kernel launch"));
  }
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    return detail::dispatch_bool(vec, [&](auto vt) -> Status {
      constexpr bool kVec = decltype(vt)::value;
      if (!p.amax) {
        if (p.rows > 0) {
          // Chunks of rows (a multiple of the 32 rows a block has in flight) for about 64
          // blocks per SM in all: enough waves to even out the tail; fewer chunks, fewer atomics.
          const int64_t col_tiles = (p.cols + cuda::kAmaxCols - 1) / cuda::kAmaxCols;
          const int64_t want = std::max<int64_t>(1, sm * 64 / col_tiles);
          int64_t chunk = (p.rows + want - 1) / want;
          chunk = (chunk + 31) / 32 * 32;
          const int64_t blocks = col_tiles * ((p.rows + chunk - 1) / chunk);
          if (blocks > 0x7fffffff)
            return fail(Status::kInvalidArgument, "x is too large (", p.rows, " x ", p.cols, ")");
          cuda::col_amax_kernel<T, kVec><<<static_cast<unsigned>(blocks), cuda::kAmaxThreads, 0, st>>>(
              static_cast<const T*>(p.x), p.x_stride, p.rows, p.cols, p.offsets, p.experts, chunk, col_tiles,
              reinterpret_cast<unsigned*>(p.scale), p.scale_stride);
          EA_TRY(cuda::cuda_check(cudaGetLastError(), "fp8 colwise amax kernel launch"));
        }
        cuda::col_scale_kernel<true><<<scale_blocks, 256, 0, st>>>(p.scale, p.scale_stride, p.experts, p.cols);
        EA_TRY(cuda::cuda_check(cudaGetLastError(), "fp8 colwise scale kernel launch"));
      }
      int64_t col_tiles = 0, tiles = 0;
      EA_TRY(col_tiles_of(p, col_tiles, tiles));
      if (tiles == 0) return Status::kOk;
      if constexpr (sizeof(T) == 2) {
        int32_t subs = 0;
        int64_t blocks = 0;
        if (cuda::colwise::runs_apply(es, kVec, q_align, p.rows, p.cols, p.out_rows, p.experts, sm, subs, blocks)) {
          namespace cw = cuda::colwise;
          return launch_runs(cw::PlainRows<T>{static_cast<const T*>(p.x), p.x_stride}, p, pends, col_tiles, subs,
                             blocks, st);
        }
      }
      return detail::dispatch_bool(q_align == 16, [&](auto at) -> Status {
        cuda::colwise::quant_kernel<T, kVec, decltype(at)::value>
            <<<static_cast<unsigned>(tiles), cuda::colwise::kThreads, 0, st>>>(
                static_cast<const T*>(p.x), p.x_stride, p.rows, p.cols, p.offsets, pends, p.experts, p.scale,
                p.scale_stride, static_cast<uint8_t*>(p.q_t), p.q_stride, p.out_rows, col_tiles, q_align);
        return cuda::cuda_check(cudaGetLastError(), "fp8 colwise quantize kernel launch");
      });
    });
  });
}

Status cuda_fp8_glu_backward_rowwise(const GluProblem& p, const Fp8BwdOut& o, const GluBias* bias, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{"gate_up", p.g}, {"grad_out", o.dy}, {"weights", p.w},
                         {"bias", bias ? bias->bg : nullptr}, {"offsets", bias ? bias->er.offsets : o.offsets},
                         {"q", o.q}, {"scale", o.scale}, {"grad_weights", o.dw}, {"col_amax", o.col_amax},
                         {"grad_gate_up", o.dgu}}));
  if (p.rows > 0x7fffffffLL) return fail(Status::kInvalidArgument, "too many rows (", p.rows, ")");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (o.col_amax && o.experts > 0) {
    EA_TRY(cuda::cuda_check(cudaMemset2DAsync(o.col_amax, static_cast<size_t>(o.col_amax_stride) * sizeof(float), 0,
                                              static_cast<size_t>(2 * p.F) * sizeof(float),
                                              static_cast<size_t>(o.experts), st),
                            "fp8 col_amax zero"));
  }
  if (p.rows == 0) return Status::kOk;
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    constexpr int es = sizeof(T);
    cuda::BwdRowArgs<T> a;
    a.g = static_cast<const T*>(p.g);
    a.u = static_cast<const T*>(p.u);
    a.x_stride = p.g_stride;
    a.dy = static_cast<const T*>(o.dy);
    a.dy_stride = o.dy_stride;
    a.w = p.w;
    a.w_stride = p.w_stride;
    a.bg = bias ? static_cast<const T*>(bias->bg) : nullptr;
    a.bu = bias ? static_cast<const T*>(bias->bu) : nullptr;
    a.b_stride = bias ? bias->b_stride : 0;
    a.offs = bias ? bias->er.offsets : o.offsets;
    a.E = bias ? bias->er.experts : o.experts;
    a.rows = p.rows;
    a.c = math::Coeffs{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
    a.step = p.step;
    a.F = p.F;
    a.q = static_cast<uint8_t*>(o.q);
    a.q_stride = o.q_stride;
    a.q_g = o.q_g;
    a.q_u = o.q_u;
    a.scale = o.scale;
    a.scale_stride = o.scale_stride;
    a.dw = o.dw;
    a.dw_stride = o.dw_stride;
    a.amax = reinterpret_cast<unsigned*>(o.col_amax);
    a.amax_stride = o.col_amax_stride;
    a.dgu = static_cast<T*>(o.dgu);
    a.dgu_stride = o.dgu_stride;
    // Operands of the 16-byte packs: gate_up (an interleaved pair is one operand of double
    // width), its up half, dy, the bias's rows (E of them) and the rounded copy.
    cuda::Operand ops[6];
    int n = 0;
    ops[n++] = {p.g, p.g_stride, p.step};
    if (p.step == 1) ops[n++] = {p.u, p.u_stride, 1};
    ops[n++] = {o.dy, o.dy_stride, 1};
    if (bias) {
      ops[n++] = {bias->bg, bias->b_stride, p.step, bias->er.experts};
      if (p.step == 1) ops[n++] = {bias->bu, bias->b_stride, 1, bias->er.experts};
    }
    if (o.dgu) ops[n++] = {o.dgu, o.dgu_stride, p.step};
    const int V = cuda::pick_pack(ops, n, p.F, p.rows, es, p.step);
    return dispatch_act(p.params.act, [&](auto act) -> Status {
      constexpr Activation A = decltype(act)::value;
      const int64_t packs64 = V > 0 ? p.F / V : 0;
      auto scalar = [&]() -> Status {
        cuda::glu_bwd_rows_kernel<T, A><<<cuda::blocks_for(p.rows, cuda::kScalarThreads), cuda::kScalarThreads, 0, st>>>(a);
        return cuda::cuda_check(cudaGetLastError(), "fp8 glu backward kernel launch");
      };
      if (V != 16 / es / p.step || packs64 > 0x7fffffff) return scalar();
      return dispatch_step(p.step, [&](auto step) -> Status {
        constexpr int kStep = decltype(step)::value, kV = 16 / es / kStep;
        const int packs = static_cast<int>(packs64);
        // A pack holds 2 kV float32 values; lanes: the fewest of 32 .. 256 that leave a lane
        // at most 16 values, else 256; instances hold 16 or 32 values a lane.
        int G = cuda::kBwdThreads;
        for (int g : {32, 64, 128}) {
          if ((packs + g - 1) / g * 2 * kV <= 16) {
            G = g;
            break;
          }
        }
        const int64_t ppl = (packs + G - 1) / G;
        const bool q_vec = cuda::q_packs(o.q, o.q_stride, p.rows, kStep == 2 ? 2 * kV : kV) &&
                           (kStep == 2 || o.q_u % kV == 0);
        auto launch = [&](auto n_tag, auto amax_tag) -> Status {
          constexpr int N = decltype(n_tag)::value;
          constexpr bool kAmax = decltype(amax_tag)::value;
          return detail::dispatch_bool(a.bg != nullptr, [&](auto bias_tag) -> Status {
            constexpr bool kBias = decltype(bias_tag)::value;
            return detail::dispatch_bool(a.w != nullptr, [&](auto w_tag) -> Status {
              auto kernel = cuda::glu_bwd_rows_vec_kernel<T, A, kStep, kV, N, kAmax, kBias, decltype(w_tag)::value>;
              const int64_t R = cuda::kBwdThreads / G;
              const int64_t steps = (p.rows + R - 1) / R;
              int64_t per_block = 1;
              if (kAmax) {
                // As many blocks as are resident, each a contiguous run of rows: few merges.
                int per_sm = 0;
                EA_TRY(cuda::cuda_check(
                    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, cuda::kBwdThreads, 0),
                    "fp8 backward occupancy"));
                const int64_t want = std::max<int64_t>(1, per_sm) * cuda::sm_count(p.device_id);
                per_block = (steps + want - 1) / want;
              }
              const int64_t blocks = (steps + per_block - 1) / per_block;
              kernel<<<static_cast<unsigned>(blocks), cuda::kBwdThreads, 0, st>>>(a, packs, G, q_vec, per_block,
                                                                                  kBwdPrefetchSteps);
              return cuda::cuda_check(cudaGetLastError(), "fp8 glu backward kernel launch");
            });
          });
        };
        return detail::dispatch_bool(a.amax != nullptr, [&](auto amax_tag) -> Status {
          constexpr int kN16 = 16 / (2 * kV), kN32 = 32 / (2 * kV);
          if (ppl <= kN16) return launch(detail::IntTag<kN16>{}, amax_tag);
          if (ppl <= kN32) return launch(detail::IntTag<kN32>{}, amax_tag);
          return scalar();
        });
      });
    });
  });
}

Status cuda_fp8_glu_colwise_grouped(const GluProblem& p, const GluBias* bias, const Fp8Cols& c, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_operands(p.device_id, guard,
                        {{p.packed ? "gate_up" : "gate", p.g}, {"up", p.packed ? nullptr : p.u}, {"weights", p.w},
                         {"bias", bias ? bias->bg : nullptr}, {"offsets", c.offsets},
                         {"padded_offsets", c.padded}, {"q_t", c.q_t}, {"scale", c.scale}, {"amax", c.amax}}));
  if (!c.amax) return fail(Status::kInvalidArgument, "glu_colwise_grouped needs the column amax");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  EA_TRY(col_scales_from_amax(c, st));
  int64_t col_tiles = 0, tiles = 0;
  EA_TRY(col_tiles_of(c, col_tiles, tiles));
  if (tiles == 0) return Status::kOk;
  const int q_align = q_t_align(c);
  const int32_t* pends = c.padded ? c.padded : c.offsets;
  const math::Coeffs cf{p.params.alpha, p.params.limit, p.params.beta, p.has_limit};
  // The runs form (colwise::run_kernel over GluRows): no bias, 16-bit gate_up in 16-byte packs
  // (halves and up-first: gate and up each; interleaved: with up right after gate).
  const int64_t es = detail::dtype_size(p.dtype);
  auto a16 = [&](const void* ptr, int64_t stride) { return cuda::q_packs(ptr, stride * es, c.rows, 16); };
  const bool glu_vec = !bias && a16(p.g, p.g_stride) &&
                       (p.step == 1 ? a16(p.u, p.u_stride)
                                    : p.step == 2 && static_cast<const char*>(p.u) == static_cast<const char*>(p.g) + es &&
                                          p.u_stride == p.g_stride);
  int32_t subs = 0;
  int64_t blocks = 0;
  const bool runs = cuda::colwise::runs_apply(es, glu_vec, q_align, c.rows, c.cols, c.out_rows, c.experts,
                                              cuda::sm_count(p.device_id), subs, blocks);
  return cuda::dispatch_storage(p.dtype, [&](auto t) -> Status {
    using T = decltype(t);
    const T* g = static_cast<const T*>(p.g);
    const T* u = static_cast<const T*>(p.u);
    const T* bg = bias ? static_cast<const T*>(bias->bg) : nullptr;
    const T* bu = bias ? static_cast<const T*>(bias->bu) : nullptr;
    const int64_t b_stride = bias ? bias->b_stride : 0;
    return dispatch_act(p.params.act, [&](auto act) -> Status {
      constexpr Activation A = decltype(act)::value;
      if constexpr (sizeof(T) == 2) {
        if (runs) {
          return dispatch_step(p.step, [&](auto step) -> Status {
            constexpr int kStep = decltype(step)::value;
            return launch_runs(cuda::GluRows<T, A, kStep>{g, u, p.g_stride, p.u_stride, p.w, p.w_stride, cf}, c,
                               pends, col_tiles, subs, blocks, st);
          });
        }
      }
      return detail::dispatch_bool(q_align == 16, [&](auto at) -> Status {
        cuda::glu_col_quant_kernel<T, A, decltype(at)::value>
            <<<static_cast<unsigned>(tiles), cuda::colwise::kThreads, 0, st>>>(
                g, u, p.g_stride, p.u_stride, p.step, p.w, p.w_stride, bg, bu, b_stride, cf, c.rows, c.cols,
                c.offsets, pends, c.experts, c.scale, c.scale_stride, static_cast<uint8_t*>(c.q_t), c.q_stride,
                c.out_rows, col_tiles, q_align);
        return cuda::cuda_check(cudaGetLastError(), "fp8 glu colwise kernel launch");
      });
    });
  });
}

}  // namespace expertact::detail
