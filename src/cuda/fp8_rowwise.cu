// quantize_rowwise on CUDA: each row of x quantised to e4m3fn with its own scale, in the vector
// form (fp8_rows.cuh) or the scalar form, optionally with the per expert and column amax.
//
// quantize_rowwise with col_amax: the vector form's lanes also keep their columns' running
// max |v| per expert (in x's type: exact), merged into the zeroed col_amax by atomicMax on
// the float bits when a lane's expert changes and at its block's end; blocks take contiguous
// runs of rows (as many blocks as are resident). The other forms compute it by colwise pass 1.
#include "cuda/fp8_rows.cuh"

namespace expertact::cuda {
namespace {

// The plain row's source (fp8_rows.cuh): x's elements, held as loaded.
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

}  // namespace
}  // namespace expertact::cuda

namespace expertact::detail {
namespace {

// The steps of rows ahead that quantize_rows_amax_kernel asks L2 for (its `ahead`): one step
// took 0.88x the time of none and 0.90x that of two on an H200 (docs/notes/perf-notes-fp8.md,
// rowwise column amax prefetch).
constexpr int kRowsPrefetchSteps = 1;

// quantize_rowwise's col_amax: zeroed first (the atomics' identity).
Status col_amax_zero(const Fp8Rows& p, cudaStream_t st) {
  const int64_t sm = cuda::sm_count(p.device_id);
  const int64_t n = p.col_amax_experts * p.cols;
  const unsigned zb = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, sm * 8)));
  return fp8_zero_matrix(p.col_amax, p.col_amax_stride, p.col_amax_experts, p.cols, zb, st,
                         "fp8 col_amax zero kernel launch");
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
      if (p.col_amax) EA_TRY(fp8_col_amax_separate(p, st));
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
      if (p.col_amax) EA_TRY(fp8_col_amax_separate(p, st));
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

}  // namespace expertact::detail
