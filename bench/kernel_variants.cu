// The CUDA kernel choice's A/B (EXPERTACT_CUDA_KERNEL, src/cuda/entry.h): the library's
// row and flat kernels against DeepSpeed's kernel shape, at the seed size (1,045,081 x
// 3,072 bf16, two rounds) and at smaller and odd sizes (the library's calls, host path
// included). resolve_auto's thresholds rest on its output (docs/notes/perf-notes.md). A tuning
// tool, not part of the library or CI; on a GPU machine:
//   cmake --build <build> --target expertact_kernel_variants
//   <build>/bench/expertact_kernel_variants
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/entry.h"
#include "cuda/glu_launch.cuh"

#include "cuda_check.h"

using namespace expertact;
using namespace expertact::cuda;
using T = __nv_bfloat16;

__global__ void fill(uint16_t* p, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint64_t x = i * 0x9e3779b97f4a7c15ull;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    float v = ((x & 0xffff) / 65536.0f - 0.5f) * 3.46f * scale;
    p[i] = static_cast<uint16_t>(__float_as_uint(v) >> 16);
  }
}

template <typename Fn>
float med(Fn fn, void* flushbuf, int iters = 9) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < iters + 2; ++i) {
    CK(cudaMemsetAsync(flushbuf, i, 256 << 20));
    CK(cudaEventRecord(a));
    fn();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 2) t.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}


// The buffers of one size (n = rows * F elements): gate_up [rows, 2F] (or the
// two separate halves), out and grad_out [rows, F], gradients [rows, 2F];
// inputs filled, then the copy bandwidth that sets the floors.
struct Bufs {
  void *in, *out, *dy, *grad;
  size_t tb;          // bytes of one [rows, F] bf16 tensor
  double bw, ff, bf;  // copy bytes/s; forward (3 passes) and backward (5 passes) floors, ms
};

Bufs make_bufs(int64_t n, void* flush) {
  Bufs b;
  b.tb = n * 2;
  CK(cudaMalloc(&b.in, 2 * b.tb));
  CK(cudaMalloc(&b.out, b.tb));
  CK(cudaMalloc(&b.dy, b.tb));
  CK(cudaMalloc(&b.grad, 2 * b.tb));
  fill<<<4096, 256>>>((uint16_t*)b.in, 2 * n, 6.0f);
  fill<<<4096, 256>>>((uint16_t*)b.dy, n, 1.0f);
  CK(cudaDeviceSynchronize());
  float copy = med([&] { CK(cudaMemcpyAsync(b.grad, b.in, 2 * b.tb, cudaMemcpyDeviceToDevice)); }, flush);
  b.bw = 2.0 * 2 * b.tb / (copy * 1e-3);
  b.ff = 3.0 * b.tb / b.bw * 1e3;
  b.bf = 5.0 * b.tb / b.bw * 1e3;
  return b;
}

void free_bufs(Bufs& b) {
  CK(cudaFree(b.in)); CK(cudaFree(b.out)); CK(cudaFree(b.dy)); CK(cudaFree(b.grad));
}

// DeepSpeed's Triton SwiGLU kernels written in CUDA: 256 threads, one 16-byte
// pack (8 bf16) per operand per thread, one block per 2048 elements, no loop,
// int64 offsets; packed halves: gate offset (i / F) * 2F + i % F with F a
// compile-time constant (Triton's constexpr INTER); kF = 0: separate tensors.
// The math is the library's (math.h), so only the grid and indexing differ.
// This thread's first element i (of out / grad_out) and its gate and up offsets.
template <int kF>
__device__ __forceinline__ bool ds_index(int64_t n, int64_t& i, int64_t& gi, int64_t& ui) {
  i = (static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x) * 8;
  gi = ui = i;
  if constexpr (kF > 0) {
    gi = (i / kF) * (2 * kF) + i % kF;
    ui = gi + kF;
  }
  return i < n;
}

template <bool kNoLimit, int kF>
__global__ void __launch_bounds__(256) ds_fwd(const T* g, const T* u, T* out, int64_t n, math::Coeffs c0) {
  const math::Coeffs c = kNoLimit ? unlimited(c0) : c0;
  int64_t i, gi, ui;
  if (!ds_index<kF>(n, i, gi, ui)) return;
  const Pack<T, 8> gp = *reinterpret_cast<const Pack<T, 8>*>(g + gi);
  const Pack<T, 8> up = *reinterpret_cast<const Pack<T, 8>*>(u + ui);
  Pack<T, 8> o;
#pragma unroll
  for (int k = 0; k < 8; ++k) o.v[k] = from_f<T>(math::glu_fwd<Activation::kSilu>(to_f(gp.v[k]), to_f(up.v[k]), 1.0f, c));
  *reinterpret_cast<Pack<T, 8>*>(out + i) = o;
}

template <bool kNoLimit, int kF>
__global__ void __launch_bounds__(256) ds_bwd(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n,
                                              math::Coeffs c0) {
  const math::Coeffs c = kNoLimit ? unlimited(c0) : c0;
  int64_t i, gi, ui;
  if (!ds_index<kF>(n, i, gi, ui)) return;
  const Pack<T, 8> dp = *reinterpret_cast<const Pack<T, 8>*>(dy + i);
  const Pack<T, 8> gp = *reinterpret_cast<const Pack<T, 8>*>(g + gi);
  const Pack<T, 8> up = *reinterpret_cast<const Pack<T, 8>*>(u + ui);
  Pack<T, 8> a, b;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float x, y, z;
    math::glu_bwd<Activation::kSilu>(to_f(gp.v[k]), to_f(up.v[k]), to_f(dp.v[k]), 1.0f, c, x, y, z);
    a.v[k] = from_f<T>(x);
    b.v[k] = from_f<T>(y);
  }
  *reinterpret_cast<Pack<T, 8>*>(dg + gi) = a;
  *reinterpret_cast<Pack<T, 8>*>(du + ui) = b;
}

// One layout of the harness buffers as the library sees it (api.cpp's
// normalisation): gate_up in `in` ([rows, 2F], or two [rows, F] tensors for
// separate), gradients likewise in `grad` (or over the inputs: in place).
struct Call {
  detail::GluProblem p;
  detail::FwdOutput o;
  detail::BwdIO io;
};

Call make_call(const Bufs& B, int64_t rows, int64_t F, int layout, const GluParams& prm, bool inplace) {
  Call c;
  const int64_t n = rows * F;
  T* in = static_cast<T*>(B.in);
  T* grad = inplace ? in : static_cast<T*>(B.grad);
  c.p.params = prm;
  c.p.has_limit = std::isfinite(prm.limit);
  c.p.dtype = DType::kBFloat16;
  c.p.device = DeviceType::kCUDA;
  c.p.device_id = 0;
  c.p.rows = rows;
  c.p.F = F;
  c.o.out = B.out;
  c.o.out_stride = F;
  c.io.dy = B.dy;
  c.io.dy_stride = F;
  if (layout == 0) {  // separate, contiguous
    c.p.step = 1;
    c.p.g = in; c.p.u = in + n; c.p.g_stride = c.p.u_stride = F;
    c.io.dg = grad; c.io.du = grad + n; c.io.dg_stride = c.io.du_stride = F;
  } else if (layout == 1) {  // halves
    c.p.step = 1;
    c.p.g = in; c.p.u = in + F; c.p.g_stride = c.p.u_stride = 2 * F;
    c.io.dg = grad; c.io.du = grad + F; c.io.dg_stride = c.io.du_stride = 2 * F;
  } else {  // interleaved
    c.p.step = 2;
    c.p.g = in; c.p.u = in + 1; c.p.g_stride = c.p.u_stride = 2 * F;
    c.io.dg = grad; c.io.du = grad + 1; c.io.dg_stride = c.io.du_stride = 2 * F;
  }
  return c;
}

void lib_check(Status s) {
  if (s != Status::kOk) {
    std::printf("library call failed: status %d\n", static_cast<int>(s));
    std::exit(2);
  }
}

const char* kLayoutName[] = {"separate", "halves", "interleaved"};

// Times the library's row and flat kernels for one layout and preset, and DeepSpeed's
// kernel shape (separate and halves only); floors from the same run. Each line:
// forward / backward ms, % of the copy floor, and the change against the row kernels
// measured just before it. kNoLimit: the preset has no limit (the reference kernels
// then take it at compile time, as the library's flat kernels do).
template <bool kNoLimit, int kStep>
void ds_one(const Bufs& B, int64_t rows, int64_t F, int layout, const GluParams& prm, const char* pname,
            void* flush, int iters, bool with_ds) {
  const Call call = make_call(B, rows, F, layout, prm, false);
  const Call ip = make_call(B, rows, F, layout, prm, true);
  const int64_t n = rows * F;
  float rows_f = 0, rows_b = 0;
  auto line = [&](const char* name, float f, float b) {
    if (std::strcmp(name, "rows (library)") == 0) { rows_f = f; rows_b = b; }
    std::printf("  %-9s %-11s %-28s", pname, kLayoutName[layout], name);
    if (f > 0) std::printf(" fwd %.4f ms %6.2f%% (%+5.2f%%)", f, 100 * B.ff / f, 100 * (f / rows_f - 1));
    else std::printf("%37s", "");
    if (b > 0) std::printf("  bwd %.4f ms %6.2f%% (%+5.2f%%)", b, 100 * B.bf / b, 100 * (b / rows_b - 1));
    std::printf("\n");
    std::fflush(stdout);
  };
  auto lib = [&](cuda::KernelChoice k, const Call& c, bool fwd) {
    return med([&] {
      lib_check(fwd ? run_forward<T>(c.p, c.o, k, nullptr) : run_backward<T>(c.p, c.io, k, nullptr));
    }, flush, iters);
  };
  using KC = cuda::KernelChoice;
  line("rows (library)", lib(KC::kRows, call, true), lib(KC::kRows, call, false));
  line("flat (library)", lib(KC::kFlat, call, true), lib(KC::kFlat, call, false));
  if constexpr (kStep == 1) {
    if (with_ds) {
      const unsigned bl = static_cast<unsigned>((n / 8 + 255) / 256);
      const T* in = static_cast<const T*>(B.in);
      T* grad = static_cast<T*>(B.grad);
      const math::Coeffs c{prm.alpha, prm.limit, prm.beta, std::isfinite(prm.limit)};
      const T* dy = static_cast<const T*>(B.dy);
      T* out = static_cast<T*>(B.out);
      float f, b;
      if (layout == 0) {
        f = med([&] { ds_fwd<kNoLimit, 0><<<bl, 256>>>(in, in + n, out, n, c); }, flush, iters);
        b = med([&] { ds_bwd<kNoLimit, 0><<<bl, 256>>>(dy, in, in + n, grad, grad + n, n, c); }, flush, iters);
      } else if (F == 3072) {
        f = med([&] { ds_fwd<kNoLimit, 3072><<<bl, 256>>>(in, in, out, n, c); }, flush, iters);
        b = med([&] { ds_bwd<kNoLimit, 3072><<<bl, 256>>>(dy, in, in, grad, grad, n, c); }, flush, iters);
      } else {
        f = med([&] { ds_fwd<kNoLimit, 1536><<<bl, 256>>>(in, in, out, n, c); }, flush, iters);
        b = med([&] { ds_bwd<kNoLimit, 1536><<<bl, 256>>>(dy, in, in, grad, grad, n, c); }, flush, iters);
      }
      line("DeepSpeed shape (reference)", f, b);
    }
  }
  // In place last: it overwrites the inputs (refilled below; timing only).
  line("rows in place", 0, lib(KC::kRows, ip, false));
  line("flat in place", 0, lib(KC::kFlat, ip, false));
  fill<<<4096, 256>>>(static_cast<uint16_t*>(B.in), 2 * n, 6.0f);
  CK(cudaDeviceSynchronize());
}

// The library's choices alone (host path included) for the small and odd sizes.
void ds_small(const Bufs& B, int64_t rows, int64_t F, int layout, const GluParams& prm, const char* pname,
              void* flush, int iters) {
  const Call call = make_call(B, rows, F, layout, prm, false);
  using KC = cuda::KernelChoice;
  const KC ks[] = {KC::kRows, KC::kFlat};
  const char* names[] = {"rows", "flat"};
  std::printf("  %-9s %-11s", pname, kLayoutName[layout]);
  for (int i = 0; i < 2; ++i) {
    float f = med([&] { lib_check(run_forward<T>(call.p, call.o, ks[i], nullptr)); }, flush, iters);
    float b = med([&] { lib_check(run_backward<T>(call.p, call.io, ks[i], nullptr)); }, flush, iters);
    std::printf(" | %-7s fwd %.4f (%5.1f%%) bwd %.4f (%5.1f%%)", names[i], f, 100 * B.ff / f, b, 100 * B.bf / b);
  }
  std::printf("\n");
  std::fflush(stdout);
}

void run_ds(void* flush) {
  GluParams swiglu;  // silu, alpha 1, limit +inf, beta 0
  GluParams oai;
  oai.alpha = 1.702f;
  oai.limit = 7.0f;
  oai.beta = 1.0f;
  {
    const int64_t rows = 1045081, F = 3072;
    Bufs B = make_bufs(rows * F, flush);
    std::printf("\nds: %lld x %lld bf16: copy %.3f TB/s; fwd floor %.4f ms, bwd floor %.4f ms; medians of 11\n",
                (long long)rows, (long long)F, B.bw / 1e12, B.ff, B.bf);
    for (int round = 0; round < 2; ++round) {
      std::printf(" round %d\n", round + 1);
      for (int layout = 0; layout < 3; ++layout) {
        if (layout < 2) {
          ds_one<true, 1>(B, rows, F, layout, swiglu, "swiglu", flush, 11, true);
          ds_one<false, 1>(B, rows, F, layout, oai, "oai", flush, 11, true);
        } else {
          ds_one<true, 2>(B, rows, F, layout, swiglu, "swiglu", flush, 11, false);
          ds_one<false, 2>(B, rows, F, layout, oai, "oai", flush, 11, false);
        }
      }
    }
    free_bufs(B);
  }
  struct Size { int64_t rows, F; };
  for (Size sz : {Size{65536, 1536}, Size{16384, 1536}, Size{65536, 2881}}) {
    Bufs B = make_bufs(sz.rows * sz.F, flush);
    std::printf("\nds: %lld x %lld bf16 (library choices, host path included): copy %.3f TB/s; fwd floor %.4f ms, bwd floor %.4f ms; medians of 31\n",
                (long long)sz.rows, (long long)sz.F, B.bw / 1e12, B.ff, B.bf);
    for (int layout = 0; layout < 3; ++layout) {
      ds_small(B, sz.rows, sz.F, layout, swiglu, "swiglu", flush, 31);
      ds_small(B, sz.rows, sz.F, layout, oai, "oai", flush, 31);
    }
    free_bufs(B);
  }
}

int main() {
  void* flush;
  CK(cudaMalloc(&flush, 256 << 20));
  run_ds(flush);
  return 0;
}
