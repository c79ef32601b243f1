// Tuning experiment (not part of the library or CI): times variants of the
// forward and backward kernels at the seed size - register cap (min blocks per
// SM), streaming cache hints, and the number of column splits - for the merged
// (separate, contiguous) and per-row (halves) paths; the realigning kernels at
// an odd F; the geglu backward's packs in flight. Results feed
// docs/perf-notes.md. Build: nvcc -O3 -std=c++17 -arch=sm_90 -Iinclude -Isrc
// -I<dlpack include> bench/kernel_variants.cu -o kv
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/glu_launch.cuh"

using namespace expertact;
using namespace expertact::cuda;
using T = __nv_bfloat16;

#define CK(x)                                                                 \
  do {                                                                        \
    cudaError_t e_ = (x);                                                     \
    if (e_ != cudaSuccess) {                                                  \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(2);                                                           \
    }                                                                         \
  } while (0)

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

// One configuration: threads per block, lanes per row G, packs in flight U,
// and column splits (0 = one tile per block).
template <int U>
void run(const char* name, KernelArgs<T> a, int threads, int G, int64_t splits, void* flush,
         double fwd_floor, double bwd_floor) {
  const int64_t tile = (int64_t)G * U;
  const int64_t tiles = (a.packs + tile - 1) / tile;
  if (splits == 0 || splits > tiles) splits = tiles;
  a.splits = splits;
  const int64_t rpb = threads / G;
  const int64_t blocks = (a.rows + rpb - 1) / rpb * splits;
  if (blocks > 0x7fffffff) return;
  float f = med([&] { glu_fwd_kernel<T, Activation::kSilu, 1, false, 8, U><<<(unsigned)blocks, threads>>>(a, G); }, flush);
  float b = med([&] { glu_bwd_kernel<T, Activation::kSilu, 1, false, false, 8, U><<<(unsigned)blocks, threads>>>(a, G); }, flush);
  std::printf("%-22s thr=%3d G=%3d U=%d splits=%7lld blocks=%8lld | fwd %.3f ms (%.1f%%) bwd %.3f ms (%.1f%%) sum %.3f (%.1f%%)\n",
              name, threads, G, U, (long long)splits, (long long)blocks, f, 100 * fwd_floor / f, b,
              100 * bwd_floor / b, f + b, 100 * (fwd_floor + bwd_floor) / (f + b));
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  // Sections to run: seed (block shape and unroll), odd (realigning kernels), geglu; all by default.
  auto want = [&](const char* w) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; ++i)
      if (std::strcmp(argv[i], w) == 0) return true;
    return false;
  };
  void* flush;
  CK(cudaMalloc(&flush, 256 << 20));
  math::Coeffs c{1.702f, 7.0f, 1.0f, true};
  struct Size { int64_t rows, F; };
  for (Size sz : {Size{1045081, 3072}, Size{65536, 1536}}) {
    if (!want("seed")) break;
    const int64_t rows = sz.rows, F = sz.F, n = rows * F;
    Bufs B = make_bufs(n, flush);
    void *in = B.in, *out = B.out, *dy = B.dy, *grad = B.grad;
    const size_t tb = B.tb;
    const double bw = B.bw, ff = B.ff, bf = B.bf;
    std::printf("\n%lld x %lld bf16: copy %.3f TB/s; fwd floor %.3f ms, bwd floor %.3f ms\n", (long long)rows,
                (long long)F, bw / 1e12, ff, bf);
    for (int layout = 0; layout < 2; ++layout) {
      KernelArgs<T> a{};
      a.c = c;
      if (layout == 0) {
        a.g = (const T*)in; a.u = (const T*)((char*)in + tb);
        a.g_stride = a.u_stride = n; a.rows = 1; a.packs = n / 8;
        a.out = (T*)out; a.out_stride = n; a.dy = (const T*)dy; a.dy_stride = n;
        a.dg = (T*)grad; a.du = (T*)((char*)grad + tb); a.dg_stride = a.du_stride = n;
        for (int thr : {128, 256}) {
          for (int64_t sp : {(int64_t)65472, (int64_t)0}) {
            run<2>("separate(merged)", a, thr, thr, sp, flush, ff, bf);
            run<4>("separate(merged)", a, thr, thr, sp, flush, ff, bf);
          }
        }
      } else {
        a.g = (const T*)in; a.u = (const T*)in + F;
        a.g_stride = a.u_stride = 2 * F; a.rows = rows; a.packs = F / 8;
        a.out = (T*)out; a.out_stride = F; a.dy = (const T*)dy; a.dy_stride = F;
        a.dg = (T*)grad; a.du = (T*)grad + F; a.dg_stride = a.du_stride = 2 * F;
        for (int thr : {128, 256}) {
          for (int G : {16, 32, 64}) {
            run<2>("halves(rows)", a, thr, G, 1, flush, ff, bf);
            run<4>("halves(rows)", a, thr, G, 1, flush, ff, bf);
          }
        }
        // rows with column splits: one tile per block
        run<2>("halves(rows,split)", a, 256, 32, 0, flush, ff, bf);
        run<4>("halves(rows,split)", a, 256, 32, 0, flush, ff, bf);
      }
    }
    free_bufs(B);
  }
  // Odd F in the halves layout (realigning kernels): prefetch distance, register cap, block size.
  if (want("odd")) {
    const int64_t rows = 65536, F = 2881, n = rows * F;
    Bufs B = make_bufs(n, flush);
    void *in = B.in, *out = B.out, *dy = B.dy, *grad = B.grad;
    const double ff = B.ff, bf = B.bf;
    std::printf("\nodd F %lld x %lld bf16 halves, realigning kernels: fwd floor %.3f bwd floor %.3f\n", (long long)rows, (long long)F, ff, bf);
    KernelArgs<T> a{};
    a.c = c;
    a.g = (const T*)in; a.u = (const T*)in + F; a.g_stride = a.u_stride = 2 * F; a.rows = rows;
    a.cols = F; a.packs = (F + 7) / 8;
    a.out = (T*)out; a.out_stride = F; a.dy = (const T*)dy; a.dy_stride = F;
    a.dg = (T*)grad; a.du = (T*)grad + F; a.dg_stride = a.du_stride = 2 * F; a.splits = 1;
    KernelArgs<T> ip = a;  // in place: the gradients overwrite the inputs (values drift; timing only)
    ip.dg = (T*)in; ip.du = (T*)in + F;
    // AH: prefetch distance in tiles; MB: blocks of 256 threads per SM the
    // register budget must allow; thr: threads per block.
    auto one = [&](auto aht, auto mbt, int thr) {
      constexpr int AH = decltype(aht)::value, MB = decltype(mbt)::value;
      const int G = 32;
      const int64_t blocks = (rows + thr / G - 1) / (thr / G);
      float f = med([&] { glu_fwd_realign<T, Activation::kSilu, false, MB, AH><<<(unsigned)blocks, thr>>>(a, G); }, flush);
      float b = med([&] { glu_bwd_realign<T, Activation::kSilu, false, false, MB, AH><<<(unsigned)blocks, thr>>>(a, G); }, flush);
      float bi = med([&] { glu_bwd_realign<T, Activation::kSilu, false, false, MB, AH><<<(unsigned)blocks, thr>>>(ip, G); }, flush);
      float bg = med([&] { glu_bwd_realign<T, Activation::kGeluTanh, false, false, MB, AH><<<(unsigned)blocks, thr>>>(a, G); }, flush);
      std::printf("thr=%d G=%d ahead=%d minB=%d fwd %.3f (%.1f%%) bwd %.3f (%.1f%%) bwd-inplace %.3f bwd-geglu %.3f (%.1f%%) sum %.1f%%\n",
                  thr, G, AH, MB, f, 100 * ff / f, b, 100 * bf / b, bi, bg, 100 * bf / bg, 100 * (ff + bf) / (f + b));
      std::fflush(stdout);
    };
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using I3 = std::integral_constant<int, 3>;
    for (int rep = 0; rep < 2; ++rep) {
      one(I1{}, I1{}, 128);
      one(I2{}, I1{}, 128);
      one(I3{}, I1{}, 128);
      one(I2{}, I3{}, 128);
      one(I2{}, I2{}, 256);
    }
    free_bufs(B);
  }
  // geglu backward at the seed size, halves: packs in flight and block size
  // (its derivative keeps more values live than silu's).
  if (want("geglu")) {
    const int64_t rows = 1045081, F = 3072, n = rows * F;
    Bufs B = make_bufs(n, flush);
    void *in = B.in, *dy = B.dy, *grad = B.grad;
    const double bf = B.bf;
    std::printf("\nseed halves backward: floor %.3f ms\n", bf);
    KernelArgs<T> a{};
    a.c = c;
    a.g = (const T*)in; a.u = (const T*)in + F; a.g_stride = a.u_stride = 2 * F; a.rows = rows;
    a.packs = F / 8; a.cols = F; a.splits = 1;
    a.dy = (const T*)dy; a.dy_stride = F;
    a.dg = (T*)grad; a.du = (T*)grad + F; a.dg_stride = a.du_stride = 2 * F;
    auto one = [&](auto ut, int thr) {
      constexpr int U = decltype(ut)::value;
      const int G = 32;
      const int64_t blocks = (rows + thr / G - 1) / (thr / G);
      float bg = med([&] { glu_bwd_kernel<T, Activation::kGeluTanh, 1, false, false, 8, U><<<(unsigned)blocks, thr>>>(a, G); }, flush);
      float bs = med([&] { glu_bwd_kernel<T, Activation::kSilu, 1, false, false, 8, U><<<(unsigned)blocks, thr>>>(a, G); }, flush);
      std::printf("thr=%d U=%d geglu bwd %.3f (%.1f%%) silu bwd %.3f (%.1f%%)\n", thr, U, bg, 100 * bf / bg, bs, 100 * bf / bs);
      std::fflush(stdout);
    };
    for (int thr : {128, 256}) {
      one(std::integral_constant<int, 2>{}, thr);
      one(std::integral_constant<int, 3>{}, thr);
      one(std::integral_constant<int, 4>{}, thr);
    }
    free_bufs(B);
  }
  return 0;
}
