// fp8_glu_backward_rowwise on CUDA: the activation's backward quantised rowwise from its float32
// gradient, with the weights' gradient, the gradient's column amax and its rounded copy.
//
// Vector form: G lanes per row (32, 64, 128 or 256: the fewest that leave a lane at most 16
// float32 values, else 256; blocks of 256 threads, at most 128 registers), each lane the packs
// lane, lane + G, ... of the row (a pack: V columns of gate and of up, 16 bytes of gate_up;
// dy's V values alongside, the bias's packs too). All of a lane's loads are issued, then its
// float32 gradients (dg, du: 2V values a pack) computed once and held in registers while the
// row's amax (NaN ignored) and the weights' gradient sum are reduced across its lanes
// (shuffles, then shared memory); then quantised from there (from_scaled4) and written as 2V
// bytes a pack. The copy in T (dgate_up_out) is written before the row's reduction, from the
// same rounded words that the column amax takes. Blocks take contiguous runs of rows; with the
// column amax, each lane keeps its columns' running max per expert (16-bit T: in registers, two
// values a word; float32: in shared memory, each thread its own words) and merges them into
// col_amax (zeroed first) by atomicMax on the float bits when its expert changes and at the
// end, as quantize_rows_amax_kernel (fp8_rowwise.cu) does.
// Rows longer than a lane holds (over 32 values at 256 lanes: F > 4,096) and operands that
// allow no 16-byte pack take the scalar form: a warp per row, the gradient computed twice (amax
// and sums, then the bytes), the column amax by one atomicMax per positive element.
//
// The kernels and their launch for one storage type T (run_glu_backward_rowwise<T>), included by
// the per-type translation units fp8_act_f32.cu, fp8_act_f16.cu, fp8_act_bf16.cu: one
// translation unit would compile every type's instances in series.
#pragma once

#include "cuda/fp8_common.cuh"

namespace expertact::cuda {
namespace {

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
// because on an H200 the kernel is bound by its instructions (docs/notes/perf-notes-fp8.md, the
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
namespace {

// The steps of rows ahead that glu_bwd_rows_vec_kernel asks L2 for (its `ahead`): one step took
// 0.91x the time of two on an H200, the expert MLP's instance (docs/notes/perf-notes-fp8.md, fused
// backward prefetch).
constexpr int kBwdPrefetchSteps = 1;

// The kernels for storage type T, once fp8_backward.cu has checked the operands, zeroed the
// column amax and returned for no rows.
template <typename T>
Status run_glu_backward_rowwise(const GluProblem& p, const Fp8BwdOut& o, const GluBias* bias, cudaStream_t st) {
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
}

}  // namespace
}  // namespace expertact::detail
