// GPU benchmark: in one run, the device-to-device copy bandwidth, then for each
// size x preset x layout the forward, backward and in-place backward times
// (CUDA events, warm-up, median; L2 flushed before every timed launch) against
// the 8-pass bytes floor of docs/spec.md section 4, plus a check of sampled rows
// against the CPU path. Markdown on stdout, JSON with --json PATH.
//
//   expertact_gpu_bench [--quick] [--iters N] [--json PATH] [--only-seed]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "expertact/expertact.hpp"

#include "cuda_check.h"

using namespace expertact;

#define EA(x)                                                                       \
  do {                                                                              \
    Status s_ = (x);                                                                \
    if (s_ != Status::kOk) {                                                        \
      std::fprintf(stderr, "%s:%d expertact status %d: %s\n", __FILE__, __LINE__,   \
                   static_cast<int>(s_), last_error());                             \
      std::exit(3);                                                                 \
    }                                                                               \
  } while (0)

namespace {

// Standard normal values times `scale`, from a counter hash and Box-Muller.
__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

__device__ void put(float* p, float z) { *p = z; }
__device__ void put(__half* p, float z) { *p = __float2half_rn(z); }
__device__ void put(__nv_bfloat16* p, float z) { *p = __float2bfloat16_rn(z); }

template <typename T>
__global__ void fill_normal(T* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float u1 = (hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i) + 1.0f) * 2.3283064e-10f;
    float u2 = hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1) * 2.3283064e-10f;
    put(p + i, sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2) * scale);
  }
}

int esize(DType d) { return d == DType::kFloat32 ? 4 : 2; }
const char* dname(DType d) {
  return d == DType::kFloat32 ? "float32" : d == DType::kFloat16 ? "float16" : "bfloat16";
}

void fill(void* p, int64_t n, DType d, uint64_t seed, float scale) {
  if (d == DType::kFloat32)
    fill_normal<<<4096, 256>>>(static_cast<float*>(p), n, seed, scale);
  else if (d == DType::kFloat16)
    fill_normal<<<4096, 256>>>(static_cast<__half*>(p), n, seed, scale);
  else
    fill_normal<<<4096, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  CK(cudaGetLastError());
}

// Larger than the 60 MB L2: writing it evicts whatever the last launch left there.
struct L2Flush {
  void* buf = nullptr;
  size_t bytes = 256u << 20;
  L2Flush() { CK(cudaMalloc(&buf, bytes)); }
  ~L2Flush() { cudaFree(buf); }
  void operator()() { CK(cudaMemsetAsync(buf, 0x5a, bytes)); }
};

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0f : v[v.size() / 2];
}

// Median time of fn (one launch), each run after an L2 flush and `before`.
// Warm-up lasts at least `warmup` runs and 50 ms of GPU time, so the clocks
// have left idle (the host-side checks between configurations let them drop).
template <typename Fn, typename Before>
float time_ms(Fn fn, Before before, int warmup, int iters, L2Flush& flush) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  float warm_ms = 0;
  for (int i = 0; (int)t.size() < iters; ++i) {
    before();
    flush();
    CK(cudaEventRecord(a));
    fn();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i >= warmup && warm_ms >= 50.0f) t.push_back(ms);
    else warm_ms += ms;
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return median(t);
}

struct Preset {
  const char* name;
  GluParams p;
};

struct Row {
  std::string size, preset, layout, dtype;
  int64_t rows, F;
  double fwd, bwd, bwd_inplace, floor_ms, copy_tbs;
  double max_err;
};

const char* lname(Layout l) {
  switch (l) {
    case Layout::kSeparate: return "separate";
    case Layout::kHalves: return "halves";
    case Layout::kHalvesUpFirst: return "up_first";
    case Layout::kInterleaved: return "interleaved";
  }
  return "?";
}

// Host float view of a stored element.
float host_load(const void* p, int64_t i, DType d) {
  if (d == DType::kFloat32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (d == DType::kBFloat16) {
    uint32_t b = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  // half -> float
  uint32_t sign = (h & 0x8000u) << 16, em = h & 0x7fffu, bits;
  if (em >= 0x7c00u) {
    bits = (em << 13) | 0x7f800000u;
  } else {
    float f;
    uint32_t t = em << 13;
    std::memcpy(&f, &t, 4);
    f *= 0x1p112f;
    std::memcpy(&bits, &f, 4);
  }
  bits |= sign;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Relative max difference (over max(1, |cpu|)) between sampled device rows and
// the CPU path on the same rows; NaN positions must agree (else returns inf).
double compare_rows(const void* dev, const void* host_ref, int64_t nrows, int64_t cols, DType d) {
  std::vector<char> h(static_cast<size_t>(nrows * cols * esize(d)));
  CK(cudaMemcpy(h.data(), dev, h.size(), cudaMemcpyDeviceToHost));
  double m = 0;
  for (int64_t i = 0; i < nrows * cols; ++i) {
    float a = host_load(h.data(), i, d), b = host_load(host_ref, i, d);
    if (std::isnan(a) != std::isnan(b)) return INFINITY;
    if (std::isnan(a)) continue;
    if (std::isinf(a) || std::isinf(b)) {
      if (a != b) return INFINITY;
      continue;
    }
    m = std::max(m, std::fabs(double(a) - double(b)) / std::max(1.0, std::fabs(double(b))));
  }
  return m;
}

struct Options {
  bool quick = false, only_seed = false;
  int iters = 10;
  std::string json_path;
  std::string cmd;  // the command line, for the report
};

// The command line into o; false (after printing the usage) for an unknown argument.
bool parse_args(int argc, char** argv, Options& o) {
  for (int i = 0; i < argc; ++i) o.cmd += (i ? " " : "") + std::string(argv[i]);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") o.quick = true;
    else if (a == "--only-seed") o.only_seed = true;
    else if (a == "--iters" && i + 1 < argc) o.iters = std::atoi(argv[++i]);
    else if (a == "--json" && i + 1 < argc) o.json_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--only-seed] [--iters N] [--json PATH]\n", argv[0]);
      return false;
    }
  }
  return true;
}

// Copy bandwidth, TB/s: bytes read + written over a 4 GiB device-to-device copy.
double copy_bandwidth_tbs(L2Flush& flush) {
  const size_t bytes = size_t(4) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  const float ms = time_ms([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); },
                           [] {}, 3, 20, flush);
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (ms * 1e-3) / 1e12;
}

struct Size {
  const char* name;
  int64_t rows, F;
  DType d;
};

std::vector<Size> sizes_for(const Options& o) {
  if (o.quick)
    return {{"65536x1536", 65536, 1536, DType::kBFloat16}, {"odd F 2881", 65536, 2881, DType::kBFloat16}};
  std::vector<Size> sizes = {{"seed", 1045081, 3072, DType::kBFloat16},
                             {"65536x1536", 65536, 1536, DType::kBFloat16},
                             {"odd F 2881", 65536, 2881, DType::kBFloat16},
                             {"small F 1408", 65536, 1408, DType::kBFloat16},
                             {"65536x1536 f32", 65536, 1536, DType::kFloat32},
                             {"65536x1536 f16", 65536, 1536, DType::kFloat16}};
  if (o.only_seed) sizes.resize(1);
  return sizes;
}

// The device buffers of one size: inputs as one [rows, 2F] allocation (separate uses its
// two halves as distinct contiguous [rows, F] tensors), a pristine copy of them for the
// in-place runs, the output, grad_out and the gradients.
struct Buffers {
  int64_t n;
  size_t tb;  // bytes of one [rows, F] tensor
  void *in, *pristine, *out, *dy, *grad;
  explicit Buffers(const Size& sz) : n(sz.rows * sz.F), tb(size_t(n) * esize(sz.d)) {
    CK(cudaMalloc(&in, 2 * tb));
    CK(cudaMalloc(&pristine, 2 * tb));
    CK(cudaMalloc(&out, tb));
    CK(cudaMalloc(&dy, tb));
    CK(cudaMalloc(&grad, 2 * tb));
    fill(pristine, 2 * n, sz.d, 1, 6.0f);
    fill(dy, n, sz.d, 2, 1.0f);
    CK(cudaMemcpy(in, pristine, 2 * tb, cudaMemcpyDeviceToDevice));
    CK(cudaDeviceSynchronize());
  }
  ~Buffers() {
    CK(cudaFree(in));
    CK(cudaFree(pristine));
    CK(cudaFree(out));
    CK(cudaFree(dy));
    CK(cudaFree(grad));
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
};

// Max relative difference between the device results of one configuration (out, the
// gradients) and the CPU path on 64 sampled rows (the first 32 and the last 32).
double check_against_cpu(const Size& sz, const Preset& pr, Layout L, const Buffers& b) {
  const bool sep = L == Layout::kSeparate;
  const int es = esize(sz.d);
  const int64_t xcols = sep ? sz.F : 2 * sz.F;
  const int64_t k = std::min<int64_t>(32, sz.rows);
  double err = 0;
  for (int64_t r0 : {int64_t{0}, sz.rows - k}) {
    std::vector<char> hx(size_t(k * xcols * es)), hu(size_t(k * sz.F * es)),
        hdy(size_t(k * sz.F * es)), ho(size_t(k * sz.F * es)), hg(size_t(k * xcols * es)),
        hgu(size_t(k * sz.F * es));
    CK(cudaMemcpy(hx.data(), static_cast<char*>(b.in) + r0 * xcols * es, hx.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hu.data(), static_cast<char*>(b.in) + b.tb + r0 * sz.F * es, hu.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hdy.data(), static_cast<char*>(b.dy) + r0 * sz.F * es, hdy.size(), cudaMemcpyDeviceToHost));
    auto mh = [&](void* p, int64_t cols) {
      MatrixRef m;
      m.data = p; m.rows = k; m.cols = cols; m.row_stride = cols; m.dtype = sz.d;
      return m;
    };
    MatrixRef cx = mh(hx.data(), xcols), cu = mh(hu.data(), sz.F), co = mh(ho.data(), sz.F),
              cd = mh(hdy.data(), sz.F), cg = mh(hg.data(), xcols), cgu = mh(hgu.data(), sz.F);
    EA(glu_forward(pr.p, L, cx, sep ? &cu : nullptr, nullptr, co));
    EA(glu_backward(pr.p, L, cd, cx, sep ? &cu : nullptr, nullptr, cg, sep ? &cgu : nullptr, nullptr));
    err = std::max(err, compare_rows(static_cast<char*>(b.out) + r0 * sz.F * es, ho.data(), k, sz.F, sz.d));
    err = std::max(err, compare_rows(static_cast<char*>(b.grad) + r0 * xcols * es, hg.data(), k, xcols, sz.d));
    if (sep)
      err = std::max(err, compare_rows(static_cast<char*>(b.grad) + b.tb + r0 * sz.F * es, hgu.data(), k, sz.F, sz.d));
  }
  return err;
}

// One markdown table row; bytes: what forward and backward move together (8 [rows, F]
// tensors), for the GB/s column.
void print_row(const Row& r, double bytes) {
  const double tot = r.fwd + r.bwd;
  std::printf("| %s | %s | %s | %s | %.3f | %.3f | %.3f | %.3f | %.1f | %.0f | %.3f | %.2e |\n",
              r.size.c_str(), r.dtype.c_str(), r.preset.c_str(), r.layout.c_str(), r.fwd, r.bwd, tot,
              r.floor_ms, 100.0 * r.floor_ms / tot, bytes / (tot * 1e-3) / 1e9, r.bwd_inplace,
              r.max_err);
  std::fflush(stdout);
}

// Times every preset x layout at one size over fresh buffers; appends to rows and prints
// each row.
void bench_size(const Size& sz, const std::vector<Preset>& presets, const std::vector<Layout>& layouts,
                int dev, int iters, double copy_tbs, L2Flush& flush, std::vector<Row>& rows) {
  Buffers b(sz);
  const double floor_ms = 8.0 * b.tb / (copy_tbs * 1e12) * 1e3;
  bool warmed = false;  // the first configuration of a size runs once untimed (see below)
  for (const Preset& pr : presets) {
    for (Layout L : layouts) {
      const bool sep = L == Layout::kSeparate;
      const int64_t xcols = sep ? sz.F : 2 * sz.F;
      auto mk = [&](void* p, int64_t cols) {
        MatrixRef m;
        m.data = p; m.rows = sz.rows; m.cols = cols; m.row_stride = cols;
        m.dtype = sz.d; m.device = DeviceType::kCUDA; m.device_id = dev;
        return m;
      };
      const MatrixRef x = mk(b.in, xcols), up = mk(static_cast<char*>(b.in) + b.tb, sz.F),
                      o = mk(b.out, sz.F), d = mk(b.dy, sz.F), g = mk(b.grad, xcols),
                      gu = mk(static_cast<char*>(b.grad) + b.tb, sz.F);
      const MatrixRef* upp = sep ? &up : nullptr;
      const MatrixRef* gup = sep ? &gu : nullptr;
      auto fwd = [&] { EA(glu_forward(pr.p, L, x, upp, nullptr, o, nullptr)); };
      auto bwd = [&] { EA(glu_backward(pr.p, L, d, x, upp, nullptr, g, gup, nullptr, nullptr)); };
      // In-place: the gradients overwrite the inputs; restore them (untimed) before each run.
      auto bwd_ip = [&] { EA(glu_backward(pr.p, L, d, x, upp, nullptr, x, upp, nullptr, nullptr)); };
      auto restore = [&] { CK(cudaMemcpyAsync(b.in, b.pristine, 2 * b.tb, cudaMemcpyDeviceToDevice)); };
      if (!warmed) {
        // The first configuration timed after new buffers were allocated ran
        // 8-10% slower than the same kernel later in the run (91.8% against
        // 95-96% at 65536 x 1536): one untimed pass of forward and backward
        // over the new buffers first.
        time_ms(fwd, [] {}, 3, iters, flush);
        time_ms(bwd, [] {}, 3, iters, flush);
        warmed = true;
      }
      CK(cudaMemset(b.out, 0xff, b.tb));
      const float tf = time_ms(fwd, [] {}, 3, iters, flush);
      CK(cudaMemset(b.grad, 0xff, 2 * b.tb));
      const float tbk = time_ms(bwd, [] {}, 3, iters, flush);
      const double err = check_against_cpu(sz, pr, L, b);
      const float tip = time_ms(bwd_ip, restore, 2, iters, flush);
      restore();
      CK(cudaDeviceSynchronize());
      rows.push_back(Row{sz.name, pr.name, lname(L), dname(sz.d), sz.rows, sz.F, tf, tbk, tip,
                         floor_ms, copy_tbs, err});
      print_row(rows.back(), 8.0 * b.tb);
    }
  }
}

bool write_json(const std::string& path, const cudaDeviceProp& prop, int drv, int rt,
                const std::string& cmd, double copy_tbs, const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::perror(path.c_str());
    return false;
  }
  std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"sm\": \"%d%d\",\n  \"driver\": %d,\n  \"cuda_runtime\": %d,\n  \"command\": \"%s\",\n  \"copy_tb_per_s\": %.4f,\n  \"rows\": [\n",
               prop.name, prop.major, prop.minor, drv, rt, cmd.c_str(), copy_tbs);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f, "    {\"size\": \"%s\", \"rows\": %lld, \"F\": %lld, \"dtype\": \"%s\", \"preset\": \"%s\", \"layout\": \"%s\", \"fwd_ms\": %.4f, \"bwd_ms\": %.4f, \"fwd_bwd_ms\": %.4f, \"bwd_inplace_ms\": %.4f, \"floor_ms\": %.4f, \"pct_of_floor\": %.2f, \"max_rel_err_vs_cpu\": %.3e}%s\n",
                 r.size.c_str(), (long long)r.rows, (long long)r.F, r.dtype.c_str(), r.preset.c_str(), r.layout.c_str(), r.fwd, r.bwd,
                 r.fwd + r.bwd, r.bwd_inplace, r.floor_ms, 100.0 * r.floor_ms / (r.fwd + r.bwd), r.max_err,
                 i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!parse_args(argc, argv, opt)) return 1;
  const int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  int drv = 0, rt = 0;
  CK(cudaDriverGetVersion(&drv));
  CK(cudaRuntimeGetVersion(&rt));
  L2Flush flush;
  const double copy_tbs = copy_bandwidth_tbs(flush);
  std::printf("# expertact GPU benchmark\n\ndevice: %s (sm_%d%d, %d SMs, L2 %d MB), driver %d, runtime %d\n",
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              drv, rt);
  std::printf("device-to-device copy: %.3f TB/s (bytes read + written)\ncommand: %s\n\n",
              copy_tbs, opt.cmd.c_str());

  const std::vector<Preset> presets = {{"swiglu", preset_swiglu()},
                                       {"swiglu_clamped", preset_swiglu_clamped(7.0f)},
                                       {"swiglu_oai", preset_swiglu_oai(1.702f, 7.0f)},
                                       {"geglu_tanh", preset_geglu_tanh()}};
  const std::vector<Layout> layouts = {Layout::kSeparate, Layout::kHalves, Layout::kHalvesUpFirst,
                                       Layout::kInterleaved};
  std::vector<Row> rows;
  std::printf("| size | dtype | preset | layout | fwd ms | bwd ms | fwd+bwd ms | floor ms | %% of floor | GB/s | bwd in-place ms | max rel err vs CPU |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Size& sz : sizes_for(opt))
    bench_size(sz, presets, layouts, dev, opt.iters, copy_tbs, flush, rows);
  std::printf("\n%% of floor = floor / (fwd + bwd): above 100 means faster than 8 passes at copy bandwidth.\n");
  if (!opt.json_path.empty() && !write_json(opt.json_path, prop, drv, rt, opt.cmd, copy_tbs, rows))
    return 4;
  return 0;
}
