// expertact CPU benchmark: forward and backward time (median after warm-up), GB/s counted
// from the tensors, and the ratio to a multithreaded memcpy of the same bytes measured in the
// same run with the same threads. --check instead runs a float64 oracle of docs/spec.md section 1.
//
//   expertact_cpu_bench [--threads N] [--sizes 4096x1408,16384x3072,65536x1536]
//       [--dtypes bf16] [--f32-size 16384x3072|none] [--presets swiglu_oai,swiglu]
//       [--layouts separate,halves,interleaved] [--iters 11] [--warmup 2] [--weights]
//       [--json PATH]
//   expertact_cpu_bench --check [--threads N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "expertact/expertact.hpp"
#include "expertact/expertact_c.h"

namespace ea = expertact;

// The CPU kernels the library picked ("avx2+fma+f16c" or "baseline"): exported by
// src/cpu/glu_cpu.cpp for benchmark reports, not part of the public API.

namespace {

// ---------------------------------------------------------------- small helpers

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "expertact_cpu_bench: %s\n", msg.c_str());
  std::exit(2);
}

void check_ok(ea::Status s, const char* what) {
  if (s != ea::Status::kOk)
    die(std::string(what) + " failed: " + ea::last_error());
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

struct Size {
  int64_t rows, F;
};

Size parse_size(const std::string& s) {
  size_t x = s.find('x');
  if (x == std::string::npos) die("size '" + s + "' is not ROWSxF");
  Size z{std::atoll(s.substr(0, x).c_str()), std::atoll(s.substr(x + 1).c_str())};
  if (z.rows <= 0 || z.F <= 0) die("size '" + s + "' must have rows > 0 and F > 0");
  return z;
}

int64_t esize(ea::DType d) { return d == ea::DType::kFloat32 ? 4 : 2; }
const char* dname(ea::DType d) {
  return d == ea::DType::kFloat32 ? "f32" : d == ea::DType::kFloat16 ? "f16" : "bf16";
}
ea::DType parse_dtype(const std::string& s) {
  if (s == "f32" || s == "float32") return ea::DType::kFloat32;
  if (s == "f16" || s == "float16") return ea::DType::kFloat16;
  if (s == "bf16" || s == "bfloat16") return ea::DType::kBFloat16;
  die("unknown dtype '" + s + "' (bf16, f16, f32)");
}

ea::Layout parse_layout(const std::string& s) {
  if (s == "separate") return ea::Layout::kSeparate;
  if (s == "halves") return ea::Layout::kHalves;
  if (s == "halves_up_first") return ea::Layout::kHalvesUpFirst;
  if (s == "interleaved") return ea::Layout::kInterleaved;
  die("unknown layout '" + s + "' (separate, halves, halves_up_first, interleaved)");
}
const char* lname(ea::Layout l) {
  switch (l) {
    case ea::Layout::kSeparate: return "separate";
    case ea::Layout::kHalves: return "halves";
    case ea::Layout::kHalvesUpFirst: return "halves_up_first";
    case ea::Layout::kInterleaved: return "interleaved";
  }
  return "?";
}

ea::GluParams parse_preset(const std::string& s) {
  if (s == "swiglu") return ea::preset_swiglu();
  if (s == "swiglu_clamped") return ea::preset_swiglu_clamped(7.0f);
  if (s == "swiglu_oai") return ea::preset_swiglu_oai(1.702f, 7.0f);
  if (s == "geglu_tanh") return ea::preset_geglu_tanh();
  die("unknown preset '" + s + "' (swiglu, swiglu_clamped, swiglu_oai, geglu_tanh)");
}

// Float to bf16 / f16 bits, round to nearest even (written independently of the library's
// own conversions so the check below does not test them against themselves).
uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((b >> 16) | 0x40);
  uint32_t lsb = (b >> 16) & 1u;
  return static_cast<uint16_t>((b + 0x7fffu + lsb) >> 16);
}
float from_bf16(uint16_t h) {
  uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
#if defined(__FLT16_MAX__)
uint16_t to_f16(double v) {
  _Float16 h = static_cast<_Float16>(v);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float from_f16(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}
#else
// Portable fallback for compilers without _Float16 (the check then rounds through float).
float from_f16(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(m + 1024, e - 25);
  return static_cast<float>((h & 0x8000) ? -v : v);
}
uint16_t to_f16(double v) {
  if (std::isnan(v)) return 0x7e00;
  uint16_t s = std::signbit(v) ? 0x8000 : 0;
  double a = std::fabs(v);
  if (a >= 65520.0) return s | 0x7c00;
  int e;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  int q = std::max(e - 11, -24);  // quantum
  double n = std::nearbyint(std::ldexp(a, -q));
  double r = std::ldexp(n, q);
  // Re-encode through the bit layout.
  if (r < std::ldexp(1.0, -14)) return s | static_cast<uint16_t>(std::ldexp(r, 24));
  int re;
  double rm = std::frexp(r, &re);
  return s | static_cast<uint16_t>(((re + 14) << 10) | (static_cast<int>(std::ldexp(rm, 11)) & 0x3ff));
}
#endif

// Storing a double into the dtype (rounded once) and reading it back.
void store_val(void* base, int64_t i, ea::DType d, double v) {
  switch (d) {
    case ea::DType::kFloat32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case ea::DType::kBFloat16: static_cast<uint16_t*>(base)[i] = to_bf16(static_cast<float>(v)); break;
    case ea::DType::kFloat16: static_cast<uint16_t*>(base)[i] = to_f16(v); break;
    default: die("the benchmark covers float32, float16 and bfloat16");
  }
}
double load_val(const void* base, int64_t i, ea::DType d) {
  switch (d) {
    case ea::DType::kFloat32: return static_cast<const float*>(base)[i];
    case ea::DType::kBFloat16: return from_bf16(static_cast<const uint16_t*>(base)[i]);
    case ea::DType::kFloat16: return from_f16(static_cast<const uint16_t*>(base)[i]);
    default: die("the benchmark covers float32, float16 and bfloat16");
  }
}
// Rounds a double to the dtype's value set (bf16 through float: double rounding can differ
// from a direct rounding only at exact float ties, far inside the tolerances below).
double round_to(double v, ea::DType d) {
  uint16_t tmp[2];
  float f[1];
  if (d == ea::DType::kFloat32) {
    store_val(f, 0, d, v);
    return f[0];
  }
  store_val(tmp, 0, d, v);
  return load_val(tmp, 0, d);
}

// A 64-byte aligned, zero-initialised-on-first-touch buffer.
struct Buffer {
  void* p = nullptr;
  size_t bytes = 0;
  Buffer() = default;
  explicit Buffer(size_t n) : bytes(n) {
    p = std::aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) die("out of memory allocating " + std::to_string(n) + " bytes");
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~Buffer() { std::free(p); }
};

// Runs fn(t, begin, end) over rows [0, n) in nt contiguous chunks, thread 0 inline,
// the others on threads started once and parked between calls, as the library's
// own pool does (starting a thread costs 100-200 us on a small VM, which would
// charge the memcpy reference with more than the kernels pay).
class Workers {
 public:
  void run(int nt, const std::function<void(int)>& fn) {
    while (static_cast<int>(threads_.size()) < nt - 1) {
      const int id = static_cast<int>(threads_.size()) + 1;
      threads_.emplace_back([this, id] { loop(id); });
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      active_ = nt - 1;
      pending_ = nt - 1;
      ++gen_;
    }
    cv_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [&] { return pending_ == 0; });
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      ++gen_;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void loop(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return gen_ != seen; });
      seen = gen_;
      if (stop_) return;
      if (id > active_) continue;
      const std::function<void(int)>* job = job_;
      lk.unlock();
      (*job)(id);
      lk.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_;
  const std::function<void(int)>* job_ = nullptr;
  int active_ = 0, pending_ = 0;
  uint64_t gen_ = 0;
  bool stop_ = false;
};

Workers& workers() {
  static Workers w;
  return w;
}

void split_rows(int64_t n, int nt, const std::function<void(int, int64_t, int64_t)>& fn) {
  nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nt, n)));
  workers().run(nt, [&](int t) { fn(t, n * t / nt, n * (t + 1) / nt); });
}

// xorshift64* and Box-Muller: fast, deterministic per (seed, thread chunk).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) { next(); }
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1p-53; }
  double normal() {
    double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

// Fills a [rows, cols] compact tensor with scale * N(0, 1) in the dtype, in parallel (this is
// also the first touch of the pages).
void fill_normal(void* data, int64_t rows, int64_t cols, ea::DType d, double scale, uint64_t seed,
                 int nt) {
  split_rows(rows, nt, [&](int, int64_t r0, int64_t r1) {
    Rng rng(seed * 1000003 + static_cast<uint64_t>(r0));
    for (int64_t i = r0 * cols; i < r1 * cols; ++i) store_val(data, i, d, scale * rng.normal());
  });
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median and minimum milliseconds of fn over iters runs after warmup runs.
struct Timing {
  double median_ms, min_ms;
};
Timing time_it(int warmup, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return {median(ms), *std::min_element(ms.begin(), ms.end())};
}

// "model name" of /proc/cpuinfo, with the family and model numbers (a VM may
// report only "AMD EPYC"; family 25 model 1 is then Zen 3, Milan).
std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, name = "unknown", family, model;
  auto value = [&] { size_t c = line.find(':'); return c == std::string::npos ? std::string() : line.substr(c + 2); };
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0 && name == "unknown") name = value();
    else if (line.rfind("cpu family", 0) == 0 && family.empty()) family = value();
    else if (line.rfind("model\t", 0) == 0 && model.empty()) model = value();
    else if (line.empty() && name != "unknown") break;
  }
  if (!family.empty()) name += " (family " + family + ", model " + model + ")";
  return name;
}

std::string compiler() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("g++ ") + __VERSION__;
#else
  return "unknown";
#endif
}

// The 1, 5 and 15 minute load averages: other work on the machine slows a
// CPU benchmark down, so every report carries them.
std::string load_average() {
  std::ifstream f("/proc/loadavg");
  double a = 0, b = 0, c = 0;
  if (!(f >> a >> b >> c)) return "unknown";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %.2f %.2f", a, b, c);
  return buf;
}

std::string today() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

// ---------------------------------------------------------------- the benchmark

struct Options {
  int threads = 0;
  std::vector<Size> sizes = {{4096, 1408}, {16384, 3072}, {65536, 1536}};
  std::vector<ea::DType> dtypes = {ea::DType::kBFloat16};
  bool f32_extra = true;
  Size f32_size = {16384, 3072};
  std::vector<std::string> presets = {"swiglu_oai", "swiglu"};
  std::vector<ea::Layout> layouts = {ea::Layout::kSeparate, ea::Layout::kHalves,
                                     ea::Layout::kInterleaved};
  int iters = 11;
  int warmup = 2;
  bool weights = false;
  std::string json;
  bool check = false;
  std::string command;
  std::string load_start;
};

struct Result {
  ea::DType dtype;
  Size size;
  std::string preset;
  ea::Layout layout;
  double fwd_bytes, bwd_bytes;
  Timing fwd, bwd;
  double memcpy_fwd_ms, memcpy_bwd_ms;  // the memcpy of the same bytes, same run, same threads
};

// Median ms of a memcpy moving `bytes` in total (bytes / 2 read, bytes / 2 written), split over
// `rows` rows across nt threads like the kernels.
double memcpy_ms(Buffer& src, Buffer& dst, double bytes, int64_t rows, int nt, const Options& o) {
  const int64_t half = static_cast<int64_t>(bytes / 2);
  const int64_t row_bytes = half / rows;
  char* s = static_cast<char*>(src.p);
  char* d = static_cast<char*>(dst.p);
  return time_it(o.warmup, o.iters, [&] {
           split_rows(rows, nt, [&](int, int64_t r0, int64_t r1) {
             std::memcpy(d + r0 * row_bytes, s + r0 * row_bytes,
                         static_cast<size_t>((r1 - r0) * row_bytes));
           });
         })
      .median_ms;
}

// One markdown table row per measured case (the header is printed by run_bench).
void print_row(const Result& r) {
  const double fgbs = r.fwd_bytes / r.fwd.median_ms * 1e-6;
  const double bgbs = r.bwd_bytes / r.bwd.median_ms * 1e-6;
  std::printf("| %s | %lld x %lld | %s | %s | %.3f | %.1f | %.0f%% | %.3f | %.1f | %.0f%% |\n",
              dname(r.dtype), static_cast<long long>(r.size.rows), static_cast<long long>(r.size.F),
              r.preset.c_str(), lname(r.layout), r.fwd.median_ms, fgbs,
              100.0 * r.memcpy_fwd_ms / r.fwd.median_ms, r.bwd.median_ms, bgbs,
              100.0 * r.memcpy_bwd_ms / r.bwd.median_ms);
  std::fflush(stdout);
}

// The memcpy reference of one size, as a row of the same table.
void print_memcpy_row(ea::DType dt, Size z, double fwd_bytes, double bwd_bytes, double mf,
                      double mb) {
  std::printf("| %s | %lld x %lld | memcpy | same bytes | %.3f | %.1f | 100%% | %.3f | %.1f | 100%% |\n",
              dname(dt), static_cast<long long>(z.rows), static_cast<long long>(z.F), mf,
              fwd_bytes / mf * 1e-6, mb, bwd_bytes / mb * 1e-6);
  std::fflush(stdout);
}

// Times every preset x layout at one dtype and size, with the memcpy reference of the
// same bytes measured just before them; appends to results and prints each row.
void run_size(ea::DType dt, Size z, const Options& o, int nt, std::vector<Result>& results) {
  const int64_t R = z.rows, F = z.F, es = esize(dt);
  const int64_t tensor = R * F * es;
  // Inputs as one packed [R, 2F] buffer; the separate layout reads its two halves as gate
  // [R, F] and up [R, F] views of a second pair of compact buffers.
  Buffer gu(2 * tensor), g(tensor), u(tensor), dy(tensor), out(tensor), dgu(2 * tensor),
      dg(tensor), du(tensor);
  fill_normal(gu.p, R, 2 * F, dt, 6.0, 1, nt);
  fill_normal(g.p, R, F, dt, 6.0, 2, nt);
  fill_normal(u.p, R, F, dt, 6.0, 3, nt);
  fill_normal(dy.p, R, F, dt, 1.0, 4, nt);
  for (Buffer* b : {&out, &dgu, &dg, &du}) std::memset(b->p, 0, b->bytes);
  std::vector<float> w(R, 1.0f), dw(R, 0.0f);
  {
    Rng rng(7);
    for (auto& x : w) x = static_cast<float>(0.5 + rng.uniform());
  }

  const double wbytes = o.weights ? 4.0 * R : 0.0;
  const double fwd_bytes = 3.0 * tensor + wbytes;        // reads gate, up; writes out
  const double bwd_bytes = 5.0 * tensor + 2.0 * wbytes;  // reads gate, up, dy; writes dgate, dup
  Buffer msrc(static_cast<size_t>(bwd_bytes / 2) + 64), mdst(static_cast<size_t>(bwd_bytes / 2) + 64);
  std::memset(msrc.p, 1, msrc.bytes);
  std::memset(mdst.p, 0, mdst.bytes);
  const double mf = memcpy_ms(msrc, mdst, fwd_bytes, R, nt, o);
  const double mb = memcpy_ms(msrc, mdst, bwd_bytes, R, nt, o);

  ea::VectorRef wv{w.data(), R, 1};
  ea::VectorRef dwv{dw.data(), R, 1};
  auto mat = [&](void* p, int64_t cols) {
    ea::MatrixRef m;
    m.data = p;
    m.rows = R;
    m.cols = cols;
    m.row_stride = cols;
    m.dtype = dt;
    return m;
  };
  for (const std::string& pname : o.presets) {
    const ea::GluParams prm = parse_preset(pname);
    for (ea::Layout L : o.layouts) {
      const bool sep = L == ea::Layout::kSeparate;
      ea::MatrixRef x = sep ? mat(g.p, F) : mat(gu.p, 2 * F);
      ea::MatrixRef up = mat(u.p, F), om = mat(out.p, F), dym = mat(dy.p, F);
      ea::MatrixRef gx = sep ? mat(dg.p, F) : mat(dgu.p, 2 * F), gup = mat(du.p, F);
      const ea::VectorRef* wp = o.weights ? &wv : nullptr;
      const ea::VectorRef* dwp = o.weights ? &dwv : nullptr;
      Result r{dt, z, pname, L, fwd_bytes, bwd_bytes, {}, {}, mf, mb};
      r.fwd = time_it(o.warmup, o.iters, [&] {
        check_ok(ea::glu_forward(prm, L, x, sep ? &up : nullptr, wp, om), "glu_forward");
      });
      r.bwd = time_it(o.warmup, o.iters, [&] {
        check_ok(ea::glu_backward(prm, L, dym, x, sep ? &up : nullptr, wp, gx, sep ? &gup : nullptr,
                                  dwp),
                 "glu_backward");
      });
      results.push_back(r);
      print_row(r);
    }
  }
  print_memcpy_row(dt, z, fwd_bytes, bwd_bytes, mf, mb);
}

void write_json(const std::string& path, const Options& o, int nt,
                const std::vector<Result>& rs) {
  std::ofstream f(path);
  if (!f) die("cannot write " + path);
  f << "{\n  \"benchmark\": \"expertact_cpu_bench\",\n";
  f << "  \"command\": \"" << json_escape(o.command) << "\",\n";
  f << "  \"date\": \"" << today() << "\",\n";
  f << "  \"machine\": {\"cpu\": \"" << json_escape(cpu_model())
    << "\", \"hardware_concurrency\": " << std::thread::hardware_concurrency()
    << ", \"compiler\": \"" << json_escape(compiler()) << "\", \"kernels\": \""
    << expertact_cpu_kernel_isa() << "\", \"load_average_at_start\": \"" << o.load_start
    << "\", \"load_average_at_end\": \"" << load_average() << "\"},\n";
  f << "  \"threads\": " << nt << ", \"iters\": " << o.iters << ", \"warmup\": " << o.warmup
    << ", \"weights\": " << (o.weights ? "true" : "false") << ",\n";
  f << "  \"inputs\": \"gate, up ~ 6 N(0,1); grad_out ~ N(0,1)\",\n";
  f << "  \"bytes\": \"forward reads 2 and writes 1 [rows, F] tensor, backward reads 3 and "
       "writes 2; memcpy of the same bytes counts read + written\",\n";
  f << "  \"results\": [\n";
  for (size_t i = 0; i < rs.size(); ++i) {
    const Result& r = rs[i];
    char buf[1024];
    std::snprintf(
        buf, sizeof buf,
        "    {\"dtype\": \"%s\", \"rows\": %lld, \"F\": %lld, \"preset\": \"%s\", \"layout\": \"%s\", "
        "\"fwd_bytes\": %.0f, \"fwd_ms\": %.4f, \"fwd_min_ms\": %.4f, \"fwd_GBps\": %.2f, "
        "\"fwd_memcpy_ms\": %.4f, \"fwd_memcpy_GBps\": %.2f, \"fwd_vs_memcpy\": %.3f, "
        "\"bwd_bytes\": %.0f, \"bwd_ms\": %.4f, \"bwd_min_ms\": %.4f, \"bwd_GBps\": %.2f, "
        "\"bwd_memcpy_ms\": %.4f, \"bwd_memcpy_GBps\": %.2f, \"bwd_vs_memcpy\": %.3f}%s\n",
        dname(r.dtype), static_cast<long long>(r.size.rows), static_cast<long long>(r.size.F),
        r.preset.c_str(), lname(r.layout), r.fwd_bytes, r.fwd.median_ms, r.fwd.min_ms,
        r.fwd_bytes / r.fwd.median_ms * 1e-6, r.memcpy_fwd_ms, r.fwd_bytes / r.memcpy_fwd_ms * 1e-6,
        r.memcpy_fwd_ms / r.fwd.median_ms, r.bwd_bytes, r.bwd.median_ms, r.bwd.min_ms,
        r.bwd_bytes / r.bwd.median_ms * 1e-6, r.memcpy_bwd_ms, r.bwd_bytes / r.memcpy_bwd_ms * 1e-6,
        r.memcpy_bwd_ms / r.bwd.median_ms, i + 1 < rs.size() ? "," : "");
    f << buf;
  }
  f << "  ]\n}\n";
}

// ---------------------------------------------------------------- the float64 check

struct Ref {
  double out, dg, du, dw_term;
  double mag_out, mag_dg, mag_du;  // sums of magnitudes of the terms, for the float32 error
  double mag_dw;
  bool fragile;  // a non-finite value here may also be NaN (see ref_elem)
};

// docs/spec.md section 1 in float64 for one element.
Ref ref_elem(const ea::GluParams& p, double g, double u, double dy, double w) {
  const double L = p.limit, alpha = p.alpha, beta = p.beta;
  const bool has_limit = std::isfinite(L);
  const double gc = g > L ? L : g;
  const double uc = u > L ? L : (u < -L ? -L : u);
  double a, da, mag_da;
  bool fragile = false;
  if (p.act == ea::Activation::kSilu) {
    // As float32 evaluates it: where e^{-alpha x} overflows float32 the sigmoid is exactly 0
    // (torch.sigmoid(-90.) == 0 in float32, so silu(-90) * inf is NaN there, not -inf).
    const double s = -alpha * gc > 88.72283905206835 ? 0.0 : 1.0 / (1.0 + std::exp(-alpha * gc));
    a = gc * s;
    da = s * (1.0 + alpha * gc * (1.0 - s));
    mag_da = std::fabs(s) + std::fabs(s * alpha * gc * (1.0 - s));
  } else {
    // 0.5 (1 + tanh(y)) = sigmoid(2y): in that form float64 keeps the tiny values
    // of 1 + tanh(y) for x << 0 instead of rounding them to 0. Where e^{-2y}
    // overflows float32 the sigmoid is 0, as float32 evaluates it (see silu).
    const double k0 = 0.7978845608028654, k1 = 0.044715;
    const double y2 = 2.0 * k0 * (gc + k1 * gc * gc * gc);
    const double s = -y2 > 88.72283905206835 ? 0.0 : 1.0 / (1.0 + std::exp(-y2));
    a = gc * s;
    const double right = gc * s * (1.0 - s) * 2.0 * k0 * (1.0 + 3.0 * k1 * gc * gc);
    da = s + right;
    mag_da = std::fabs(s) + std::fabs(right) + 1.0;  // a tanh-based kernel: abs error ~1e-7
    // Here a float32 kernel may round s (or 1 + tanh) to exactly 0 while float64
    // does not, or the reverse: a product of it with an infinite factor may then
    // be NaN or +-inf, and such positions accept either.
    fragile = s < 0x1p-20;
  }
  const double v = uc + beta;
  const double mag_v = std::fabs(uc) + std::fabs(beta);
  const bool gpass = !has_limit || g <= L;
  const bool upass = !has_limit || (u >= -L && u <= L);
  Ref r;
  r.out = a * v * w;
  r.dg = gpass ? dy * w * v * da : 0.0;
  r.du = upass ? dy * w * a : 0.0;
  r.dw_term = dy * a * v;
  const double mag_a = std::fabs(a) + (p.act == ea::Activation::kGeluTanh ? std::fabs(gc) : 0.0);
  r.mag_out = mag_a * mag_v * std::fabs(w);
  r.mag_dg = gpass ? std::fabs(dy * w) * mag_v * mag_da : 0.0;
  r.mag_du = upass ? std::fabs(dy * w) * mag_a : 0.0;
  r.fragile = fragile;
  r.mag_dw = std::fabs(dy) * mag_a * mag_v;
  return r;
}

int mant_bits(ea::DType d) {
  return d == ea::DType::kFloat32 ? 23 : d == ea::DType::kFloat16 ? 10 : 7;
}

struct Checker {
  int64_t compared = 0, failures = 0;
  double worst = 0;  // largest error / tolerance seen
  std::string worst_at;

  // got: the kernel's stored value; ref: the float64 value; mag: magnitude bound of the terms.
  void cmp(double got, double ref, double mag, bool fragile, ea::DType d, const std::string& tag,
           const char* what, int64_t row, int64_t col) {
    ++compared;
    const double rr = round_to(ref, d);
    bool ok;
    double ratio = 0;
    if (std::isnan(rr) || std::isinf(rr)) {
      ok = fragile ? !std::isfinite(got) : std::isnan(rr) ? std::isnan(got) : got == rr;
    } else if (!std::isfinite(got)) {
      ok = false;
    } else {
      // One unit in the last place of the dtype (the single rounding, which float32 error may
      // flip) plus float32 arithmetic error on the magnitude of the terms.
      const double aref = std::fabs(ref);
      int e = 0;
      if (aref > 0) std::frexp(aref, &e);
      const int min_e = d == ea::DType::kFloat32 ? -125 : d == ea::DType::kFloat16 ? -13 : -125;
      const double ulp = std::ldexp(1.0, std::max(e, min_e) - 1 - mant_bits(d));
      const double tol = ulp + 64.0 * 0x1p-24 * mag + 1e-30;
      const double err = std::fabs(got - ref);
      ratio = err / tol;
      ok = err <= tol;
    }
    if (ratio > worst) {
      worst = ratio;
      char buf[256];
      std::snprintf(buf, sizeof buf, "%s %s (%lld, %lld): got %.9g want %.9g mag %.3g", tag.c_str(),
                    what, static_cast<long long>(row), static_cast<long long>(col), got, ref, mag);
      worst_at = buf;
    }
    if (!ok && failures++ < 10) {
      char buf[256];
      std::snprintf(buf, sizeof buf, " got %.9g want %.9g (rounded %.9g, mag %.3g)", got, ref, rr, mag);
      std::fprintf(stderr, "MISMATCH %s %s (%lld, %lld)%s\n", tag.c_str(), what,
                   static_cast<long long>(row), static_cast<long long>(col), buf);
    }
  }
};

// Values that hunt the boundaries: the limits and their neighbours, NaN, infinities, zeros,
// the exp range edges.
double special_value(Rng& rng, float L) {
  const float inf = std::numeric_limits<float>::infinity();
  const float Lf = std::isfinite(L) ? L : 7.0f;
  const float vals[] = {Lf, -Lf, std::nextafter(Lf, inf), std::nextafter(Lf, -inf),
                        std::nextafter(-Lf, inf), std::nextafter(-Lf, -inf), NAN, -NAN, inf,
                        -inf, 0.0f, -0.0f, 100.0f, -100.0f, 90.0f, -90.0f, 1e-3f, -1e-3f,
                        -1.0f / 1.702f, -1.2785f, 1000.0f, -1000.0f, 30.0f, -30.0f};
  return vals[rng.next() % (sizeof vals / sizeof vals[0])];
}

// One case of the check: a problem of size z in dtype dt and layout L, checked forward
// and backward (into separate gradients, then in place over the inputs) against the
// float64 references. variant: bit 0 per-row weights, bit 1 a misaligned base and a
// padded row stride.
void check_case(ea::DType dt, const std::string& pname, const ea::GluParams& prm, ea::Layout L,
                Size z, int variant, uint64_t seed, Checker& ck) {
  const int64_t es = esize(dt);
  const bool weighted = variant & 1;
  const int64_t off = (variant & 2) ? 1 : 0;   // misaligned by one element
  const int64_t pad = (variant & 2) ? 3 : 0;   // row stride longer than the row
  const bool sep = L == ea::Layout::kSeparate;
  const int64_t R = z.rows, F = z.F, xc = sep ? F : 2 * F;
  const int64_t xs = xc + pad, fs = F + pad;
  auto alloc = [&](int64_t stride) {
    return std::vector<unsigned char>(static_cast<size_t>(((R - 1) * stride + stride + off) * es + 64));
  };
  auto mref = [&](std::vector<unsigned char>& b, int64_t cols, int64_t stride) {
    ea::MatrixRef m;
    m.data = b.data() + off * es;
    m.rows = R;
    m.cols = cols;
    m.row_stride = stride;
    m.dtype = dt;
    return m;
  };
  std::vector<unsigned char> xb = alloc(xs), ub = alloc(fs), dyb = alloc(fs), ob = alloc(fs),
                             gxb = alloc(xs), gub = alloc(fs);
  Rng rng(seed * 7919);
  ea::MatrixRef x = mref(xb, xc, xs), up = mref(ub, F, fs), dy = mref(dyb, F, fs),
                out = mref(ob, F, fs), gx = mref(gxb, xc, xs), gu = mref(gub, F, fs);
  auto fill = [&](ea::MatrixRef& m, bool specials, double scale) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < m.cols; ++c) {
        double v = specials && rng.next() % 5 == 0 ? special_value(rng, prm.limit)
                                                   : scale * rng.normal();
        store_val(m.data, r * m.row_stride + c, dt, v);
      }
  };
  fill(x, true, 6.0);
  if (sep) fill(up, true, 6.0);
  fill(dy, false, 1.0);
  std::vector<float> w(R), dw(R, -1.0f);
  for (auto& v : w) v = rng.next() % 10 == 0 ? 0.0f : static_cast<float>(0.25 + 2 * rng.uniform());
  ea::VectorRef wv{w.data(), R, 1}, dwv{dw.data(), R, 1};
  const ea::VectorRef* wp = weighted ? &wv : nullptr;
  const ea::VectorRef* dwp = weighted ? &dwv : nullptr;

  // Where gate and up element (r, c) live inside x (or up).
  auto gidx = [&](int64_t r, int64_t c) -> std::pair<const ea::MatrixRef*, int64_t> {
    switch (L) {
      case ea::Layout::kSeparate: return {&x, r * xs + c};
      case ea::Layout::kHalves: return {&x, r * xs + c};
      case ea::Layout::kHalvesUpFirst: return {&x, r * xs + F + c};
      case ea::Layout::kInterleaved: return {&x, r * xs + 2 * c};
    }
    return {nullptr, 0};
  };
  auto uidx = [&](int64_t r, int64_t c) -> std::pair<const ea::MatrixRef*, int64_t> {
    switch (L) {
      case ea::Layout::kSeparate: return {&up, r * fs + c};
      case ea::Layout::kHalves: return {&x, r * xs + F + c};
      case ea::Layout::kHalvesUpFirst: return {&x, r * xs + c};
      case ea::Layout::kInterleaved: return {&x, r * xs + 2 * c + 1};
    }
    return {nullptr, 0};
  };
  // The float64 references, before any in-place run overwrites the inputs.
  std::vector<Ref> ref(static_cast<size_t>(R * F));
  std::vector<double> dw_ref(R, 0.0), dw_mag(R, 0.0);
  std::vector<char> dw_fragile(R, 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < F; ++c) {
      auto [gm, gi] = gidx(r, c);
      auto [um, ui] = uidx(r, c);
      Ref e = ref_elem(prm, load_val(gm->data, gi, dt), load_val(um->data, ui, dt),
                       load_val(dy.data, r * fs + c, dt), weighted ? w[r] : 1.0);
      ref[r * F + c] = e;
      dw_ref[r] += e.dw_term;
      dw_mag[r] += e.mag_dw;
      if (e.fragile) dw_fragile[r] = 1;
    }
  const std::string tag = std::string(dname(dt)) + " " + pname + " " + lname(L) + " " +
                          std::to_string(R) + "x" + std::to_string(F) + " variant " +
                          std::to_string(variant);
  check_ok(ea::glu_forward(prm, L, x, sep ? &up : nullptr, wp, out), tag.c_str());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < F; ++c)
      ck.cmp(load_val(out.data, r * fs + c, dt), ref[r * F + c].out, ref[r * F + c].mag_out,
             ref[r * F + c].fragile, dt, tag, "fwd", r, c);
  // Backward twice: into separate gradients, then in place over the inputs.
  for (int inplace = 0; inplace < 2; ++inplace) {
    ea::MatrixRef gxm = inplace ? x : gx, gum = inplace ? up : gu;
    std::fill(dw.begin(), dw.end(), -1.0f);
    check_ok(ea::glu_backward(prm, L, dy, x, sep ? &up : nullptr, wp, gxm,
                              sep ? &gum : nullptr, dwp),
             tag.c_str());
    const std::string bt = tag + (inplace ? " bwd in-place" : " bwd");
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < F; ++c) {
        const Ref& e = ref[r * F + c];
        int64_t gi, ui;
        const void* gbase = gxm.data;
        const void* ubase = gxm.data;
        switch (L) {
          case ea::Layout::kSeparate: gi = r * xs + c; ui = r * fs + c; ubase = gum.data; break;
          case ea::Layout::kHalves: gi = r * xs + c; ui = r * xs + F + c; break;
          case ea::Layout::kHalvesUpFirst: gi = r * xs + F + c; ui = r * xs + c; break;
          default: gi = r * xs + 2 * c; ui = gi + 1; break;
        }
        ck.cmp(load_val(gbase, gi, dt), e.dg, e.mag_dg, e.fragile, dt, bt, "dgate", r, c);
        ck.cmp(load_val(ubase, ui, dt), e.du, e.mag_du, e.fragile, dt, bt, "dup", r, c);
      }
      if (weighted) {
        ++ck.compared;
        const double got = dw[r], want = dw_ref[r];
        bool ok;
        if (!std::isfinite(want)) {
          ok = dw_fragile[r] ? !std::isfinite(got)
                             : std::isnan(want) ? std::isnan(got) : got == want;
        } else {
          const double tol = (8.0 * std::sqrt(static_cast<double>(F)) + 64.0) * 0x1p-24 * dw_mag[r] + 1e-30;
          ok = std::isfinite(got) && std::fabs(got - want) <= tol;
          ck.worst = std::max(ck.worst, std::fabs(got - want) / tol);
        }
        if (!ok && ck.failures++ < 10)
          std::fprintf(stderr, "MISMATCH %s dw row %lld: got %.9g want %.9g\n", bt.c_str(),
                       static_cast<long long>(r), got, want);
      }
    }
  }
}

// Thread-count determinism: rows split between threads (few long rows) must give
// bitwise the results of one thread, the weight gradient included. Returns the
// number of mismatching runs.
int64_t check_thread_determinism() {
  int64_t det_fail = 0;
  for (ea::DType dt : {ea::DType::kBFloat16, ea::DType::kFloat32}) {
    for (Size z : {Size{1, 300001}, Size{3, 100000}, Size{7, 40000}, Size{4097, 400}}) {
      const int64_t R = z.rows, F = z.F, es = esize(dt), n = R * F;
      std::vector<unsigned char> x(2 * n * es), dyb(n * es), ref_out, ref_gx;
      std::vector<float> w(R, 0.75f), ref_dw;
      Rng rng(99);
      for (int64_t i = 0; i < 2 * n; ++i) store_val(x.data(), i, dt, 6.0 * rng.normal());
      for (int64_t i = 0; i < n; ++i) store_val(dyb.data(), i, dt, rng.normal());
      auto m = [&](void* ptr, int64_t cols) {
        ea::MatrixRef r;
        r.data = ptr;
        r.rows = R;
        r.cols = cols;
        r.row_stride = cols;
        r.dtype = dt;
        return r;
      };
      for (int threads : {1, 2, 3, 7}) {
        ea::set_cpu_threads(threads);
        std::vector<unsigned char> out(n * es), gx(2 * n * es);
        std::vector<float> dw(R);
        ea::VectorRef wv{w.data(), R, 1}, dwv{dw.data(), R, 1};
        const ea::GluParams prm = ea::preset_swiglu_oai();
        check_ok(ea::glu_forward(prm, ea::Layout::kInterleaved, m(x.data(), 2 * F), nullptr, &wv,
                                 m(out.data(), F)),
                 "determinism forward");
        check_ok(ea::glu_backward(prm, ea::Layout::kInterleaved, m(dyb.data(), F), m(x.data(), 2 * F),
                                  nullptr, &wv, m(gx.data(), 2 * F), nullptr, &dwv),
                 "determinism backward");
        if (threads == 1) {
          ref_out = out;
          ref_gx = gx;
          ref_dw = dw;
        } else if (out != ref_out || gx != ref_gx ||
                   std::memcmp(dw.data(), ref_dw.data(), R * sizeof(float)) != 0) {
          ++det_fail;
          std::fprintf(stderr, "MISMATCH %s %lldx%lld: %d threads differ from 1 thread\n", dname(dt),
                       static_cast<long long>(R), static_cast<long long>(F), threads);
        }
      }
    }
  }
  return det_fail;
}

int run_check(int nt) {
  std::printf("float64 oracle check (docs/spec.md section 1), %d threads\n", nt);
  const std::vector<std::pair<std::string, ea::GluParams>> presets = {
      {"swiglu", ea::preset_swiglu()},
      {"swiglu_clamped", ea::preset_swiglu_clamped(7.0f)},
      {"swiglu_oai", ea::preset_swiglu_oai(1.702f, 7.0f)},
      {"geglu_tanh", ea::preset_geglu_tanh()},
      {"gelu_clamped_3_beta_0.5", ea::GluParams{ea::Activation::kGeluTanh, 1.0f, 3.0f, 0.5f}},
      {"silu_alpha_-0.75_limit_1e-3", ea::GluParams{ea::Activation::kSilu, -0.75f, 1e-3f, -2.0f}},
  };
  const std::vector<Size> sizes = {{1, 1},  {1, 7},   {3, 8},    {2, 9},     {17, 12},
                                   {5, 15}, {4, 16},  {5, 17},   {7, 31},    {3, 100},
                                   {4, 1408}, {2, 3072}, {1, 11008}, {3, 14337}, {300, 1408},
                                   {4097, 100}, {1, 300001}, {7, 40000}};
  const ea::DType dtypes[] = {ea::DType::kBFloat16, ea::DType::kFloat16, ea::DType::kFloat32};
  const ea::Layout layouts[] = {ea::Layout::kSeparate, ea::Layout::kHalves,
                                ea::Layout::kHalvesUpFirst, ea::Layout::kInterleaved};
  Checker ck;
  int64_t cases = 0;
  uint64_t seed = 1;
  for (ea::DType dt : dtypes)
    for (const auto& [pname, prm] : presets)
      for (ea::Layout L : layouts)
        for (Size z : sizes) {
          const int variant = static_cast<int>(seed % 4);
          ++seed;
          check_case(dt, pname, prm, L, z, variant, seed, ck);
          ++cases;
        }
  const int64_t det_fail = check_thread_determinism();
  ea::set_cpu_threads(nt);
  ck.failures += det_fail;
  std::printf("thread-count determinism (1, 2, 3, 7 threads; rows split between threads): %s\n",
              det_fail ? "FAILED" : "bitwise identical");
  std::printf("%lld cases, %lld values compared, %lld mismatches, worst error / tolerance %.3f\n",
              static_cast<long long>(cases), static_cast<long long>(ck.compared),
              static_cast<long long>(ck.failures), ck.worst);
  std::printf("worst at %s\n", ck.worst_at.c_str());
  return ck.failures == 0 ? 0 : 1;
}

void usage() {
  std::printf(
      "usage: expertact_cpu_bench [--threads N] [--sizes RxF,...] [--dtypes bf16,f16,f32]\n"
      "         [--f32-size RxF|none] [--presets swiglu_oai,swiglu,swiglu_clamped,geglu_tanh]\n"
      "         [--layouts separate,halves,halves_up_first,interleaved] [--iters N]\n"
      "         [--warmup N] [--weights] [--json PATH]\n"
      "       expertact_cpu_bench --check [--threads N]\n");
}

// The command line into Options; --help prints the usage and exits.
Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 0; i < argc; ++i) o.command += (i ? " " : "") + std::string(argv[i]);
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) die(std::string("missing value after ") + argv[i]);
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--threads") o.threads = std::atoi(need(i).c_str());
    else if (a == "--sizes") {
      o.sizes.clear();
      for (auto& s : split(need(i), ',')) o.sizes.push_back(parse_size(s));
    } else if (a == "--dtypes") {
      o.dtypes.clear();
      for (auto& s : split(need(i), ',')) o.dtypes.push_back(parse_dtype(s));
    } else if (a == "--f32-size") {
      std::string s = need(i);
      o.f32_extra = s != "none";
      if (o.f32_extra) o.f32_size = parse_size(s);
    } else if (a == "--presets") {
      o.presets = split(need(i), ',');
      for (auto& p : o.presets) parse_preset(p);
    } else if (a == "--layouts") {
      o.layouts.clear();
      for (auto& s : split(need(i), ',')) o.layouts.push_back(parse_layout(s));
    } else if (a == "--iters") o.iters = std::max(1, std::atoi(need(i).c_str()));
    else if (a == "--warmup") o.warmup = std::max(0, std::atoi(need(i).c_str()));
    else if (a == "--weights") o.weights = true;
    else if (a == "--json") o.json = need(i);
    else if (a == "--check") o.check = true;
    else if (a == "-h" || a == "--help") {
      usage();
      std::exit(0);
    } else {
      usage();
      die("unknown option " + a);
    }
  }
  return o;
}

// The timing tables (every dtype x size, then the float32 size unless asked for), then
// the JSON file when asked for.
int run_bench(const Options& o, int nt) {
  std::printf("iters %d (median) after %d warm-up; inputs 6 N(0,1)%s; GB/s counts forward 3, "
              "backward 5 [rows, F] tensors; %% memcpy = memcpy time of the same bytes / kernel "
              "time\n\n",
              o.iters, o.warmup, o.weights ? ", per-row weights and their gradient" : "");
  std::printf("| dtype | rows x F | preset | layout | fwd ms | fwd GB/s | fwd %% memcpy | bwd ms | "
              "bwd GB/s | bwd %% memcpy |\n");
  std::printf("|---|---|---|---|---:|---:|---:|---:|---:|---:|\n");
  std::vector<Result> results;
  for (ea::DType dt : o.dtypes)
    for (Size z : o.sizes) run_size(dt, z, o, nt, results);
  if (o.f32_extra &&
      std::find(o.dtypes.begin(), o.dtypes.end(), ea::DType::kFloat32) == o.dtypes.end())
    run_size(ea::DType::kFloat32, o.f32_size, o, nt, results);
  std::printf("\nload average at the end: %s\n", load_average().c_str());
  if (!o.json.empty()) {
    write_json(o.json, o, nt, results);
    std::printf("\nwrote %s\n", o.json.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse_args(argc, argv);
  const unsigned hc = std::thread::hardware_concurrency();
  const int nt = o.threads > 0 ? o.threads : (hc > 0 ? static_cast<int>(hc) : 2);
  ea::set_cpu_threads(nt);
  if (ea::cpu_threads() != nt) die("set_cpu_threads did not take");

  std::printf("expertact CPU benchmark, %s\n", today().c_str());
  o.load_start = load_average();
  std::printf("cpu: %s (hardware concurrency %u)\ncompiler: %s\nkernels: %s\nthreads: %d\n"
              "load average: %s\n",
              cpu_model().c_str(), hc, compiler().c_str(), expertact_cpu_kernel_isa(), nt,
              o.load_start.c_str());
  return o.check ? run_check(nt) : run_bench(o, nt);
}
