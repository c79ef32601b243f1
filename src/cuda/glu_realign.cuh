// Kernels for planar rows (step 1) whose operands do not share one offset
// modulo 16 bytes: packed halves / up-first rows with F * sizeof(T) % 16 != 0
// (F = 2881: gate and up start 5762 bytes apart), views that start between
// 16-byte boundaries, odd row strides. The pack kernel would fall to 4-byte or
// one-element accesses there (61% of the floor for F = 2881).
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
//   the two ends of a tile (the G packs a group moves at once, see RowSpan)
//   the lane stores its own elements one by one instead, so no store covers
//   another tile's columns.
// - Each lane walks its packs (first, first + step, ...) with pointers that
//   advance by one tile's stride; which pack is the row's last, and whether its
//   second chunks must be read element by element, is found once per row. (The
//   64-bit column arithmetic of every tile had been a fifth of the loop; the
//   loop is bound by instruction issue as much as by bytes in flight.)
// - Each lane also asks L2 (prefetch.global.L2) for its chunk kAhead tiles
//   ahead: the loads are limited by the registers that hold them, the
//   prefetch holds none (73% -> 82% of the floor at 65,536 x 2,881). A
//   cp.async pipeline through shared memory instead was slower (67%).
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
__device__ __forceinline__ Words from_prev_lane(const Words& x, int lane, int G) {
  Words r;
  const int src = (lane + G - 1) & (G - 1);
#pragma unroll
  for (int j = 0; j < 4; ++j) r.w[j] = __shfl_sync(0xffffffffu, x.w[j], src, G);
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

// Head and tail columns of a row: [0, c0) and [c0 + P * V, F), one element a
// lane, by the group of the row's first split.
__device__ __forceinline__ int64_t edge_col(int64_t e, int64_t c0, int64_t P, int V) {
  return e < c0 ? e : c0 + P * V + (e - c0);
}

// This lane's packs of its row.
struct LaneWalk {
  int n;               // packs of this lane (P / step: far below 2^31)
  int64_t c_first;     // first column of the first
  int64_t stride;      // elements between consecutive ones
  bool owns_last;      // the last of them is the row's last pack
  int64_t c_last;      // first column of the last
};

__device__ __forceinline__ LaneWalk lane_walk(const RowSpan& s, int64_t c0, int64_t P, int V) {
  LaneWalk w;
  w.n = s.first < P ? static_cast<int>((P - s.first + s.step - 1) / s.step) : 0;
  w.c_first = c0 + s.first * V;
  w.stride = s.step * V;
  const int64_t p_last = s.first + static_cast<int64_t>(w.n - 1) * s.step;
  w.owns_last = w.n > 0 && p_last == P - 1;
  w.c_last = c0 + p_last * V;
  return w;
}

// The largest value of v over the warp.
__device__ __forceinline__ int warp_max(int v) {
  for (int off = 16; off > 0; off /= 2) {
    const int o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

// One realigned input along the lane's walk. (Taking the second chunk from
// the next lane by a shuffle instead of loading it was slower: 75% against
// 81%, the shuffle waits for the load.)
template <typename T>
struct InWalk {
  static constexpr int V = 16 / sizeof(T);
  const T* p;  // the aligned chunk x + c - d of the current pack
  int d;       // elements x + c sits past a 16-byte boundary (the same for every pack)
  bool tail;   // the row's last pack: its second chunk would pass the row's end
  Words a, b;

  __device__ __forceinline__ InWalk(const T* x, const LaneWalk& w, int64_t F) {
    d = past_boundary(x + w.c_first);
    p = x + w.c_first - d;
    tail = w.owns_last && d != 0 && w.c_last + 2 * V - d > F;
  }
  // Starts the loads of the current pack (end: it is the lane's last) and
  // asks L2 for the one `ahead` elements later (more: there is one).
  __device__ __forceinline__ void issue(bool on, bool end, bool more, int64_t ahead) {
    if (on) {
      a = load16(p);
      if (d != 0 && !(end && tail)) b = load16(p + V);
    }
    if (more) prefetch(ahead);
  }
  // Asks L2 for the chunk `ahead` elements later (no register held).
  __device__ __forceinline__ void prefetch(int64_t ahead) const {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + ahead));
  }
  __device__ __forceinline__ void finish(bool on, bool end) {
    if (on && end && tail) {
      b = Words{};
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (i < d) set_elem<T>(b, i, p[V + i]);
    }
  }
  __device__ __forceinline__ Words get() const {
    return d == 0 ? a : extract(a, b, d * static_cast<int>(sizeof(T)));
  }
  __device__ __forceinline__ void advance(int64_t stride) { p += stride; }
};

// Stores the lane's pack m of a realigned output at y (y = out + c); every
// lane of the warp calls it (it shuffles). The chunk y - d holds the last d
// elements of the previous pack and the first V - d of this one; the lane
// that stores it gets the previous pack's values from lane (lane - 1) mod G.
// first / last: no chunk store covers this pack's first V - d / last d
// elements (the tile's first / last lane, the row's last pack), so the lane
// stores them one by one. (Carrying the edge between a warp's consecutive
// tiles, so that lane 0 stores that chunk whole, was not faster.)
template <typename T>
__device__ __forceinline__ void put_walk(T* y, int d, const Words& m, bool on, bool first,
                                         bool last, int lane, int G) {
  constexpr int V = 16 / sizeof(T);
  const Words pm = from_prev_lane(m, lane, G);
  if (!on) return;
  if (d == 0) {
    store16(y, m);
    return;
  }
  if (!first) store16(y - d, extract(pm, m, 16 - d * static_cast<int>(sizeof(T))));
  if (first || last) {
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (i < V - d ? first : last) y[i] = get_raw<T>(m, i);
  }
}

// Tuned at 65,536 x 2,881 bf16 halves (docs/notes/perf-notes.md,
// "Realigning kernels (odd F, packed halves)"): blocks of 128 threads, one pack
// per lane in flight, and an L2 prefetch kAhead tiles ahead: 1 in forward, 2 in
// backward (2 was 0.7% slower in forward, 1 was 2% slower in backward; 3 slower
// in both). A tighter register cap (3 blocks of 256 threads per SM) spilled and
// was 20% slower in backward.
template <typename T, Activation A, bool kW>
__global__ void __launch_bounds__(256) glu_fwd_realign(const KernelArgs<T> a, int G) {
  constexpr int V = 16 / sizeof(T);
  constexpr int kAhead = 1;
  const RowSpan s = row_span<1>(G, a.packs, a.splits);
  const bool live = s.row < a.rows;
  const auto [g, u, out, w] = fwd_row<T, kW>(a, live ? s.row : 0);
  const int64_t F = live ? a.cols : 0;
  const int64_t c0 = to_boundary(out) < F ? to_boundary(out) : F;
  const int64_t P = (F - c0) / V;
  const LaneWalk lw = lane_walk(s, c0, P, V);
  InWalk<T> gi(g, lw, F), ui(u, lw, F);
  T* o = out + lw.c_first;
  // The packs the loop's prefetches (kAhead tiles ahead) do not reach.
  for (int k = 1; k < kAhead && k < lw.n; ++k) {
    gi.prefetch(k * lw.stride);
    ui.prefetch(k * lw.stride);
  }
  for (int it = 0; it < lw.n; ++it) {
    const bool end = it == lw.n - 1, more = it + kAhead < lw.n;
    gi.issue(true, end, more, kAhead * lw.stride);
    ui.issue(true, end, more, kAhead * lw.stride);
    gi.finish(true, end);
    ui.finish(true, end);
    const Words gv = gi.get(), uv = ui.get();
    float r[V];
#pragma unroll
    for (int i = 0; i < V; ++i) r[i] = math::glu_fwd<A>(elem<T>(gv, i), elem<T>(uv, i), w, a.c);
    store16(o, pack_words<T>(r));
    gi.advance(lw.stride);
    ui.advance(lw.stride);
    o += lw.stride;
  }
  if (s.first == s.lane) {
    for (int64_t e = s.lane; e < F - P * V; e += G) {
      const int64_t c = edge_col(e, c0, P, V);
      out[c] = from_f<T>(math::glu_fwd<A>(to_f(g[c]), to_f(u[c]), w, a.c));
    }
  }
}

// Anchor: grad_gate. In place (grad_gate = gate, grad_up = up) gate is then
// aligned as well.
template <typename T, Activation A, bool kW, bool kDW>
__global__ void __launch_bounds__(256) glu_bwd_realign(const KernelArgs<T> a, int G) {
  constexpr int V = 16 / sizeof(T);
  constexpr int kAhead = 2;
  const RowSpan s = row_span<1>(G, a.packs, a.splits);
  const bool live = s.row < a.rows;
  const int64_t row = live ? s.row : 0;
  const auto [g, u, dy, dg, du, w] = bwd_row<T, kW>(a, row);
  const int64_t F = live ? a.cols : 0;
  const int64_t c0 = to_boundary(dg) < F ? to_boundary(dg) : F;
  const int64_t P = (F - c0) / V;
  const LaneWalk lw = lane_walk(s, c0, P, V);
  InWalk<T> gi(g, lw, F), ui(u, lw, F), di(dy, lw, F);
  T* og = dg + lw.c_first;
  T* ou = du + lw.c_first;
  const int d_du = past_boundary(ou);
  float acc = 0.0f;
  // The grad_up stores shuffle across the warp: every lane runs its warp's
  // largest count of tiles.
  const int n = warp_max(lw.n);
  for (int k = 1; k < kAhead && k < lw.n; ++k) {
    gi.prefetch(k * lw.stride);
    ui.prefetch(k * lw.stride);
    di.prefetch(k * lw.stride);
  }
  for (int it = 0; it < n; ++it) {
    const bool on = it < lw.n, end = it == lw.n - 1, more = it + kAhead < lw.n;
    gi.issue(on, end, more, kAhead * lw.stride);
    ui.issue(on, end, more, kAhead * lw.stride);
    di.issue(on, end, more, kAhead * lw.stride);
    gi.finish(on, end);
    ui.finish(on, end);
    di.finish(on, end);
    Words mu;
    if (on) {
      const Words gv = gi.get(), uv = ui.get(), dv = di.get();
      float rg[V], ru[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float dwt;
        math::glu_bwd<A>(elem<T>(gv, i), elem<T>(uv, i), elem<T>(dv, i), w, a.c, rg[i], ru[i], dwt);
        if constexpr (kDW) acc += dwt;
      }
      store16(og, pack_words<T>(rg));
      mu = pack_words<T>(ru);
    }
    put_walk<T>(ou, d_du, mu, on, s.lane == 0, s.lane == G - 1 || (end && lw.owns_last), s.lane,
                G);
    gi.advance(lw.stride);
    ui.advance(lw.stride);
    di.advance(lw.stride);
    og += lw.stride;
    ou += lw.stride;
  }
  if (s.first == s.lane) {
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
    for (int off = G / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off, G);
    if (live && s.lane == 0) a.dw[row * a.dw_stride] = acc;
  }
}

}  // namespace expertact::cuda
