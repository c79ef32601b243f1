// glu_rowwise on CUDA: the activation h = act(gate [+ bias], up [+ bias]) * w of gate_up quantised
// rowwise (never written in gate_up's dtype), optionally with h's per expert and column amax.
//
// glu_rowwise with col_amax: the same fusion in the GLU form's vector kernels (with and
// without the bias: glu_rows_amax_kernel), the held float32 h rounded to the input type (as
// the activation's forward writes it) before the running max; the other forms compute it by
// glu_col_amax_kernel, its own read of gate_up, before their own kernel.
//
// The kernels and their launch for one storage type T (run_glu_rowwise<T>), included by the
// per-type translation units fp8_act_f32.cu, fp8_act_f16.cu, fp8_act_bf16.cu: one
// translation unit would compile every type's instances in series.
#pragma once

#include "cuda/fp8_rows.cuh"

namespace expertact::cuda {
namespace {

// The GLU form's source (fp8_rows.cuh): gate's and up's packs, held as the float32 activation.
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

// ColAmaxAcc (fp8_rowwise.cu) with its running maxima in shared memory instead of registers
// (the GLU form, whose lanes already hold the float32 h): word k of a thread at
// words[k * kRowThreads + thread] (each thread its own words: no bank conflicts, no atomics), a
// word two values of a 16-bit T (absmax2 of h rounded to T, exact, NaN ignored) or one
// float32. Always kDefined (the loop).
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
// of h, fused as quantize_rows_amax_kernel (fp8_rowwise.cu) fuses quantize_rowwise's: block b
// takes the steps (of 128 / G rows) [b * per_block, + per_block) one after another; each lane
// keeps its columns' running max of |h| per expert, h rounded to T as the activation's forward
// writes it (exact, in T; in shared memory, SmemColAmaxAcc: held in registers it cost 16 more),
// merged into the zeroed amax by atomicMax on the float bits when its expert changes and at its
// block's end. offs (E of them): the column amax's experts, and with kBias the bias's (the same
// offsets); each row's expert is followed along the run, not searched. The biased rows take
// BiasGluSrc<..., true> (no branch in the finish). q and scale: those of the kernels without
// the amax (the same float32 h, the same bytes). (Asking L2 for the rows ahead, as
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

}  // namespace
}  // namespace expertact::cuda

namespace expertact::detail {
namespace {

// The kernels for storage type T, once fp8_glu_rowwise.cu has checked the operands, zeroed the
// column amax and returned for no rows; c: the activation's coefficients, am: col_amax's words.
template <typename T>
Status run_glu_rowwise(const GluProblem& p, const Fp8Out& o, const GluBias* bias, const Fp8ColAmax* amax,
                       const math::Coeffs& c, unsigned* am, cudaStream_t st) {
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
}

}  // namespace
}  // namespace expertact::detail
