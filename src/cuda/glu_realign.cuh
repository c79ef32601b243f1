// Kernels for planar rows (step 1) whose operands do not share one offset
// modulo 16 bytes: packed halves / up-first rows with F * sizeof(T) % 16 != 0
// (F = 2881: gate and up start 5762 bytes apart), views that start between
// 16-byte boundaries, odd row strides. The pack kernel would fall to 4-byte or
// one-element accesses there (61% of the floor on the H200 for F = 2881).
//
// Here every access to the body of a row is 16 bytes and aligned:
// - One operand is the anchor (the output in forward, grad_gate in backward):
//   the row's columns [c0, c0 + P * V) are P packs of V = 16 / sizeof(T)
//   elements whose anchor address is 16-byte aligned. The c0 columns before and
//   the fewer than V after (head and tail) are done one element at a time.
// - An input X of the row sits d elements (0 <= d < V) past a 16-byte boundary
//   at every pack: x + c - d is aligned (c: the pack's first column). The lane
//   loads the two aligned chunks x + c - d and x + c + V - d and takes the V
//   elements from element d on (an element shift of the 32 bytes). Bytes of
//   the neighbouring columns come along and are dropped. Near the end of the
//   row the second chunk is read element by element, so nothing past the row
//   is read; the first chunk never starts before the 16-byte boundary at or
//   below the row's first element.
// - A realigned output Y (grad_up in backward) is stored as the aligned chunks
//   y + c - d: the lane of pack p writes the last d elements of pack p - 1
//   (received from that lane by a shuffle) and the first V - d of its own. At
//   the two ends of a tile (G * U packs, see RowSpan) the lane stores its own
//   elements one by one instead, so no store covers another tile's columns.
// - Each lane also asks L2 (prefetch.global.L2) for the chunks of its group's
//   next tile: the loads are limited by the registers that hold them, the
//   prefetch holds none (73% -> 82% of the floor at 65,536 x 2,881).
// In place (grad_up = up), a lane uses loaded values only of its own columns,
// and a chunk store that covers pack p - 1's columns comes after the shuffle
// by which pack p - 1's lane hands over its values (computed from its loads).
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/math.h"
#include "cuda/common.cuh"
#include "cuda/glu_kernels.cuh"

namespace expertact::cuda {

// 16 bytes as four 32-bit words (what the shuffles and funnel shifts move).
struct Words {
  uint32_t w[4];
};

// Element i (a compile-time index) of the 16 bytes w holding 16 / sizeof(T) elements.
template <typename T>
__device__ __forceinline__ uint32_t bits_of(T v);
template <>
__device__ __forceinline__ uint32_t bits_of<float>(float v) { return __float_as_uint(v); }
template <>
__device__ __forceinline__ uint32_t bits_of<__half>(__half v) { return __half_as_ushort(v); }
template <>
__device__ __forceinline__ uint32_t bits_of<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat16_as_ushort(v);
}

template <typename T>
__device__ __forceinline__ float elem(const Words& w, int i) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w.w[i]);
  } else {
    const uint32_t x = w.w[i / 2];
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __uint_as_float((i & 1) ? (x & 0xffff0000u) : (x << 16));
    } else {
      return __half2float(__ushort_as_half(static_cast<unsigned short>((i & 1) ? x >> 16 : x)));
    }
  }
}

template <typename T>
__device__ __forceinline__ void set_elem(Words& w, int i, T v) {
  const uint32_t b = bits_of<T>(v);
  if constexpr (sizeof(T) == 4) {
    w.w[i] = b;
  } else if (i & 1) {
    w.w[i / 2] = (w.w[i / 2] & 0x0000ffffu) | (b << 16);
  } else {
    w.w[i / 2] = (w.w[i / 2] & 0xffff0000u) | b;
  }
}

template <typename T>
__device__ __forceinline__ T get_raw(const Words& w, int i) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w.w[i]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __ushort_as_bfloat16(static_cast<unsigned short>((i & 1) ? w.w[i / 2] >> 16 : w.w[i / 2]));
  } else {
    return __ushort_as_half(static_cast<unsigned short>((i & 1) ? w.w[i / 2] >> 16 : w.w[i / 2]));
  }
}

// Two float results rounded to T and packed into one word (one conversion
// instruction for a pair of halves); element i of a pair goes to the low bits.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return static_cast<uint32_t>(__bfloat16_as_ushort(h.x)) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(h.y)) << 16);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return static_cast<uint32_t>(__half_as_ushort(h.x)) |
           (static_cast<uint32_t>(__half_as_ushort(h.y)) << 16);
  }
}

// V results as the 16 bytes of a pack.
template <typename T>
__device__ __forceinline__ Words pack_words(const float (&r)[16 / sizeof(T)]) {
  Words w;
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) w.w[j] = __float_as_uint(r[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) w.w[j] = pack2<T>(r[2 * j], r[2 * j + 1]);
  }
  return w;
}

__device__ __forceinline__ Words load16(const void* p) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  return Words{{v.x, v.y, v.z, v.w}};
}
__device__ __forceinline__ void store16(void* p, const Words& w) {
  *reinterpret_cast<uint4*>(p) = make_uint4(w.w[0], w.w[1], w.w[2], w.w[3]);
}
__device__ __forceinline__ Words pick(bool c, const Words& x, const Words& y) {
  Words r;
#pragma unroll
  for (int j = 0; j < 4; ++j) r.w[j] = c ? x.w[j] : y.w[j];
  return r;
}

// Bytes [b, b + 16) of the 32 bytes lo ++ hi, for 0 <= b < 16: two rounds of
// word selects (by 2 words, by 1 word), then a funnel shift by the bytes left.
__device__ __forceinline__ Words extract(const Words& lo, const Words& hi, int b) {
  const uint32_t c[8] = {lo.w[0], lo.w[1], lo.w[2], lo.w[3], hi.w[0], hi.w[1], hi.w[2], hi.w[3]};
  const int q = b >> 2;
  const uint32_t sh = static_cast<uint32_t>(b & 3) * 8;
  uint32_t s[6], t[5];
#pragma unroll
  for (int j = 0; j < 6; ++j) s[j] = (q & 2) ? c[j + 2] : c[j];
#pragma unroll
  for (int j = 0; j < 5; ++j) t[j] = (q & 1) ? s[j + 1] : s[j];
  Words r;
#pragma unroll
  for (int j = 0; j < 4; ++j) r.w[j] = __funnelshift_r(t[j], t[j + 1], sh);
  return r;
}

// The value of lane (lane - 1) mod G of the group.
__device__ __forceinline__ Words from_prev_lane(const Words& x, int lane, int G, unsigned mask) {
  Words r;
  const int src = (lane + G - 1) & (G - 1);
#pragma unroll
  for (int j = 0; j < 4; ++j) r.w[j] = __shfl_sync(mask, x.w[j], src, G);
  return r;
}

// Elements from p to the next 16-byte boundary (p is element aligned).
template <typename T>
__device__ __forceinline__ int64_t to_boundary(const T* p) {
  return static_cast<int64_t>((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u) / sizeof(T);
}
// Elements p sits past the previous 16-byte boundary.
template <typename T>
__device__ __forceinline__ int past_boundary(const T* p) {
  return static_cast<int>((reinterpret_cast<uintptr_t>(p) & 15u) / sizeof(T));
}

// Where a pack sits in its row and its tile.
struct PackPos {
  int64_t c;   // first column
  bool live;   // p < P
  bool first;  // the tile's first pack: no predecessor in the tile
  bool last;   // the tile's or the row's last pack: no successor in the tile
};

__device__ __forceinline__ PackPos pack_pos(int64_t t0, int k, int lane, int G, int U, int64_t c0,
                                            int64_t P, int V) {
  PackPos q;
  const int64_t p = t0 + static_cast<int64_t>(k) * G + lane;
  q.c = c0 + p * V;
  q.live = p < P;
  q.first = k == 0 && lane == 0;
  q.last = p + 1 == P || (k == U - 1 && lane == G - 1);
  return q;
}

// One realigned input over one tile. issue() starts the loads (every
// operand's loads of a tile are issued before any value is used) and asks L2
// for the chunks of the group's tile `ahead` packs later; finish() reads
// element by element the second chunks that would pass the row's end; get()
// gives pack k.
template <typename T, int U>
struct InTile {
  static constexpr int V = 16 / sizeof(T);
  Words a[U], b[U];

  __device__ __forceinline__ void issue(const T* x, int d, int64_t t0, int lane, int G, int64_t c0,
                                        int64_t P, int64_t F, int64_t ahead) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const PackPos q = pack_pos(t0, k, lane, G, U, c0, P, V);
      a[k] = Words{};
      b[k] = Words{};
      if (q.live) a[k] = load16(x + q.c - d);
      if (q.live && d != 0 && q.c + 2 * V - d <= F) b[k] = load16(x + q.c + V - d);
      // The prefetch holds no register, so it adds bytes in flight where the
      // loads above are limited by the registers that hold them.
      const PackPos n = pack_pos(t0 + ahead, k, lane, G, U, c0, P, V);
      if (n.live) asm volatile("prefetch.global.L2 [%0];" ::"l"(x + n.c - d));
    }
  }
  __device__ __forceinline__ void finish(const T* x, int d, int64_t t0, int lane, int G, int64_t c0,
                                         int64_t P, int64_t F) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const PackPos q = pack_pos(t0, k, lane, G, U, c0, P, V);
      if (q.live && d != 0 && q.c + 2 * V - d > F) {
#pragma unroll
        for (int i = 0; i < V; ++i)
          if (i < d) set_elem<T>(b[k], i, x[q.c + V - d + i]);
      }
    }
  }
  __device__ __forceinline__ Words get(int k, int d) const {
    if (d == 0) return a[k];
    return extract(a[k], b[k], d * static_cast<int>(sizeof(T)));
  }
};

// Stores pack k's values m of a realigned output (see the top of the file).
// Every lane of the warp calls it, in order of k (it shuffles).
template <typename T>
__device__ __forceinline__ void put_realigned(T* y, int d, const Words& m, const Words& prev_k,
                                              const PackPos& q, int k, int lane, int G) {
  constexpr int V = 16 / sizeof(T);
  // prev_k: this lane's values of pack k - 1 (lane G-1 hands them to lane 0).
  const Words pm = from_prev_lane(pick(lane == G - 1 && k > 0, prev_k, m), lane, G, 0xffffffffu);
  if (!q.live) return;
  if (d == 0) {
    store16(y + q.c, m);
    return;
  }
  if (!q.first) store16(y + q.c - d, extract(pm, m, 16 - d * static_cast<int>(sizeof(T))));
  if (q.first || q.last) {
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (i < V - d ? q.first : q.last) y[q.c + i] = get_raw<T>(m, i);
  }
}

// Head and tail columns of a row: [0, c0) and [c0 + P * V, F), one element a
// lane, by the group of the row's first split.
__device__ __forceinline__ int64_t edge_col(int64_t e, int64_t c0, int64_t P, int V) {
  return e < c0 ? e : c0 + P * V + (e - c0);
}

// Measured on the H200 at 65,536 x 2,881 bf16 halves (bench/kernel_variants.cu,
// docs/perf-notes.md): one pack per lane in flight and an L2 prefetch of the
// group's next tile (U = 2 without prefetch held more registers than it
// gained bytes in flight). kMinB: blocks of 256 threads per SM that the
// register budget must allow.
template <typename T, Activation A, bool kW, int U = 1, int kMinB = 1>
__global__ void __launch_bounds__(256, kMinB) glu_fwd_realign(const KernelArgs<T> a, int G) {
  constexpr int V = 16 / sizeof(T);
  const RowSpan s = row_span<U>(G, a.packs, a.splits);
  if (s.row >= a.rows) return;
  const auto [g, u, out, w] = fwd_row<T, kW>(a, s.row);
  const int64_t F = a.cols;
  const int64_t c0 = to_boundary(out) < F ? to_boundary(out) : F;
  const int64_t P = (F - c0) / V;
  const int dg = past_boundary(g + c0), du = past_boundary(u + c0);
  const int64_t t_first = s.first - s.lane;
  for (int64_t t0 = t_first; t0 < P; t0 += s.step) {
    InTile<T, U> gt, ut;
    gt.issue(g, dg, t0, s.lane, G, c0, P, F, s.step);
    ut.issue(u, du, t0, s.lane, G, c0, P, F, s.step);
    gt.finish(g, dg, t0, s.lane, G, c0, P, F);
    ut.finish(u, du, t0, s.lane, G, c0, P, F);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const PackPos q = pack_pos(t0, k, s.lane, G, U, c0, P, V);
      if (q.live) {
        const Words gv = gt.get(k, dg), uv = ut.get(k, du);
        float r[V];
#pragma unroll
        for (int i = 0; i < V; ++i) r[i] = math::glu_fwd<A>(elem<T>(gv, i), elem<T>(uv, i), w, a.c);
        store16(out + q.c, pack_words<T>(r));
      }
    }
  }
  if (t_first == 0) {
    for (int64_t e = s.lane; e < F - P * V; e += G) {
      const int64_t c = edge_col(e, c0, P, V);
      out[c] = from_f<T>(math::glu_fwd<A>(to_f(g[c]), to_f(u[c]), w, a.c));
    }
  }
}

// The largest value of v over the warp.
__device__ __forceinline__ int64_t warp_max(int64_t v) {
  for (int off = 16; off > 0; off /= 2) {
    const int64_t o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

// Anchor: grad_gate. In place (grad_gate = gate, grad_up = up) gate is then
// aligned as well. The grad_up stores shuffle across the whole warp, so every
// lane runs the same number of tiles (groups of a shorter or absent row idle).
template <typename T, Activation A, bool kW, bool kDW, int U = 1, int kMinB = 1>
__global__ void __launch_bounds__(256, kMinB) glu_bwd_realign(const KernelArgs<T> a, int G) {
  constexpr int V = 16 / sizeof(T);
  const RowSpan s = row_span<U>(G, a.packs, a.splits);
  const bool live = s.row < a.rows;
  const int64_t row = live ? s.row : 0;
  const auto [g, u, dy, dg, du, w] = bwd_row<T, kW>(a, row);
  const int64_t F = live ? a.cols : 0;
  const int64_t c0 = to_boundary(dg) < F ? to_boundary(dg) : F;
  const int64_t P = (F - c0) / V;
  const int d_g = past_boundary(g + c0), d_u = past_boundary(u + c0);
  const int d_dy = past_boundary(dy + c0), d_du = past_boundary(du + c0);
  float acc = 0.0f;
  const int64_t t_first = s.first - s.lane;
  const int64_t tiles = warp_max(t_first < P ? (P - t_first + s.step - 1) / s.step : 0);
  for (int64_t it = 0; it < tiles; ++it) {
    const int64_t t0 = t_first + it * s.step;
    InTile<T, U> gt, ut, dt;
    gt.issue(g, d_g, t0, s.lane, G, c0, P, F, s.step);
    ut.issue(u, d_u, t0, s.lane, G, c0, P, F, s.step);
    dt.issue(dy, d_dy, t0, s.lane, G, c0, P, F, s.step);
    gt.finish(g, d_g, t0, s.lane, G, c0, P, F);
    ut.finish(u, d_u, t0, s.lane, G, c0, P, F);
    dt.finish(dy, d_dy, t0, s.lane, G, c0, P, F);
    Words prev{};
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const PackPos q = pack_pos(t0, k, s.lane, G, U, c0, P, V);
      Words ou{};
      if (q.live) {
        const Words gv = gt.get(k, d_g), uv = ut.get(k, d_u), dv = dt.get(k, d_dy);
        float rg[V], ru[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          float dwt;
          math::glu_bwd<A>(elem<T>(gv, i), elem<T>(uv, i), elem<T>(dv, i), w, a.c, rg[i], ru[i],
                           dwt);
          if constexpr (kDW) acc += dwt;
        }
        store16(dg + q.c, pack_words<T>(rg));
        ou = pack_words<T>(ru);
      }
      put_realigned<T>(du, d_du, ou, prev, q, k, s.lane, G);
      prev = ou;
    }
  }
  if (t_first == 0) {
    for (int64_t e = s.lane; e < F - P * V; e += G) {
      const int64_t c = edge_col(e, c0, P, V);
      float fg, fu, dwt;
      math::glu_bwd<A>(to_f(g[c]), to_f(u[c]), to_f(dy[c]), w, a.c, fg, fu, dwt);
      dg[c] = from_f<T>(fg);
      du[c] = from_f<T>(fu);
      if constexpr (kDW) acc += dwt;
    }
  }
  if constexpr (kDW) {
    // A row sum runs without splits: the group's lanes add their shares.
    for (int off = G / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off, G);
    if (live && s.lane == 0) a.dw[row * a.dw_stride] = acc;
  }
}

}  // namespace expertact::cuda
