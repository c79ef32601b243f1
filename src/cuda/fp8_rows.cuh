// The rowwise FP8 kernels' row machinery (fp8_rowwise.cu, fp8_glu_rowwise.cuh): a row's packs
// held across G lanes, its amax, its quantised bytes; the choice of lanes and held packs.
//
// Rows whose input allows 16-byte packs go to 32, 64 or 128 lanes per row (the fewest that
// leave a lane at most 32 values), read in those packs with all of a lane's loads in flight and
// held in registers (for the GLU form, the float32 activation, computed once; with a per-expert
// bias, its packs are loaded alongside) while the row's amax (NaN ignored) is reduced across
// its lanes (shuffles, then shared memory across warps), then quantised from there and written
// as 2, 4 or 8 bytes per pack; rows too long to hold are read twice. Other rows take a scalar
// form: a warp per row, one element at a time, read twice (store_row).
//
// The vector kernels hold the row in registers up to 128 values (plain 16-bit rows: 256) per
// lane, 4,096 (8,192) per row.
#pragma once

#include "cuda/fp8_common.cuh"

namespace expertact::cuda {

constexpr int kRowThreads = 128;  // 128 / G rows per block
constexpr int kStreamUnroll = 4;  // packs in flight per lane for rows too long to hold

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

// A row's source (Src below; PlainSrc in fp8_rowwise.cu, GluSrc and BiasGluSrc in
// fp8_glu_rowwise.cuh) gives the values of one row in packs of V: Raw is what one pack's load
// brings (load(p, raw)), Held what a lane keeps of it between the amax and the quantisation
// (finish(raw, j, held): the raw elements for a plain row, the float32 activation for the GLU
// form, computed once); absmax(held, max) and value(held, i) read it; Max is the running amax;
// init(raw) gives a pack that is not loaded its value where Acc::kDefined (below) asks for one.
//
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
inline int lanes_per_row(int64_t packs, int V) {
  for (int G : {32, 64}) {
    if ((packs + G - 1) / G * V <= kLaneValues) return G;
  }
  return 128;
}

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

}  // namespace expertact::cuda
