// CPU forward and backward: picks the kernels for this CPU once (AVX2+FMA+F16C
// where present, else the portable baseline built here), and splits the work
// between threads in blocks of kBlock columns, so that a few long rows (rows = 1,
// F huge) spread as evenly as many short ones. The per-element math is
// src/core/math.h, shared with CUDA; the kernels are cpu/glu_cpu_kernels.h.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <cpuid.h>
#endif

#include "core/error.h"
#include "core/problem.h"
#include "expertact/expertact_c.h"
#include "cpu/fp8_cpu.h"
#include "cpu/glu_cpu_kernels.h"
#include "cpu/kernel_table.h"
#include "cpu/parallel.h"

namespace expertact::cpu {

const KernelTable& baseline_kernels() {
  static const KernelTable table = make_table("baseline");
  return table;
}

namespace {

// EXPERTACT_CPU_ISA=baseline forces the portable kernels (to test or compare them).
const KernelTable& pick_kernels() {
  const char* env = std::getenv("EXPERTACT_CPU_ISA");
  if (env != nullptr && std::strcmp(env, "baseline") == 0) return baseline_kernels();
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  // avx2 and fma through the compiler (which also checks that the OS saves the
  // ymm registers); F16C from cpuid leaf 1 (ecx bit 29), which older GCCs'
  // __builtin_cpu_supports does not know.
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    if (const KernelTable* t = avx2_kernels()) return *t;
  }
#endif
  return baseline_kernels();
}

const KernelTable& kernels() {
  static const KernelTable& table = pick_kernels();
  return table;
}

// Whether a call that moves `bytes` should write with non-temporal stores: when
// it moves more than the last-level cache holds, its output cannot stay cached
// for the next op anyway, and skipping the read of each output line before it is
// written saves a quarter of forward's traffic and a fifth of backward's.
// EXPERTACT_CPU_STREAM=0 / 1 forces it off / on (to measure either).
bool use_stream(int64_t bytes) {
  static const int64_t threshold = [] {
    if (const char* env = std::getenv("EXPERTACT_CPU_STREAM")) {
      if (env[0] == '0') return INT64_MAX;
      if (env[0] == '1') return int64_t{0};
    }
    int64_t llc = 0;
#if defined(_SC_LEVEL3_CACHE_SIZE)
    llc = static_cast<int64_t>(sysconf(_SC_LEVEL3_CACHE_SIZE));
#endif
    return llc > 0 ? llc : int64_t{32} << 20;
  }();
  return bytes > threshold;
}

int64_t dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

// Element-operations per element, for the threading threshold: backward does
// about twice the arithmetic and moves 5/3 of the bytes of forward.
constexpr int64_t kFwdCost = 1, kBwdCost = 2;

// The work is rows x blocks units (a block: kBlock columns of one row; the last
// one of a row may be shorter), cut into chunks of consecutive units that the
// threads take from a shared counter as they go: a thread slowed down by
// anything else on its core takes fewer chunks instead of holding up the call
// (an equal static split lost up to half the time when other work kept one of
// two cores busy). A chunk covers a partial row at each end and whole rows
// between.
struct Split {
  int64_t F, blocks_per_row, units;
  int64_t chunk;    // units per chunk
  int64_t nchunks;
  int nt;
};

Split make_split(const detail::GluProblem& p, int64_t cost) {
  Split s;
  s.F = p.F;
  s.blocks_per_row = (p.F + kBlock - 1) / kBlock;
  s.units = p.rows * s.blocks_per_row;
  const int64_t nt = threads_for(p.rows * p.F * cost);
  s.nt = static_cast<int>(nt < s.units ? nt : s.units);
  // ~8 chunks per thread for balance, each at least ~32K elements so that
  // taking one (an atomic add) stays far below 1% of its time.
  const int64_t unit_elems = p.F < kBlock ? p.F : kBlock;
  const int64_t min_chunk = (int64_t{1} << 15) / unit_elems + 1;
  const int64_t by_balance = (s.units + 8 * s.nt - 1) / (8 * s.nt);
  s.chunk = s.nt <= 1 ? s.units : (by_balance > min_chunk ? by_balance : min_chunk);
  s.nchunks = (s.units + s.chunk - 1) / s.chunk;
  if (s.nchunks < s.nt) s.nt = static_cast<int>(s.nchunks);
  return s;
}

// Calls seg(r0, r1, c0, c1) for the row segments of units [u0, u1).
template <typename Seg>
void for_each_segment(const Split& s, int64_t u0, int64_t u1, Seg&& seg) {
  if (u0 >= u1) return;
  const int64_t nb = s.blocks_per_row;
  int64_t ra = u0 / nb, ba = u0 % nb;
  const int64_t rb = u1 / nb, bb = u1 % nb;
  if (ra == rb) {  // inside one row
    seg(ra, ra + 1, ba * kBlock, bb * kBlock);
    return;
  }
  if (ba > 0) {
    seg(ra, ra + 1, ba * kBlock, s.F);
    ++ra;
  }
  if (ra < rb) seg(ra, rb, int64_t{0}, s.F);
  if (bb > 0) seg(rb, rb + 1, int64_t{0}, bb * kBlock);
}

// Runs seg over every chunk on s.nt threads, each thread taking the next chunk
// until none is left.
template <typename Seg>
void run_chunks(const Split& s, Seg&& seg) {
  std::atomic<int64_t> next{0};
  parallel_run(s.nt, [&](int) {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= s.nchunks) return;
      const int64_t u0 = c * s.chunk;
      const int64_t u1 = u0 + s.chunk < s.units ? u0 + s.chunk : s.units;
      for_each_segment(s, u0, u1, seg);
    }
  });
}

}  // namespace
}  // namespace expertact::cpu

// The name of the kernels in use (expertact_c.h).
extern "C" const char* expertact_cpu_kernel_isa(void) {
  return expertact::cpu::kernels().isa;
}

namespace expertact::detail {

Status cpu_forward(const GluProblem& p, const FwdOutput& o) {
  using namespace cpu;
  const int d = static_cast<int>(p.dtype), a = static_cast<int>(p.params.act);
  if (d < 0 || d > 2 || a < 0 || a > 1 || (p.step != 1 && p.step != 2))
    return fail(Status::kInternal, "cpu_forward: dtype ", d, ", act ", a, ", step ", p.step);
  const FwdKernel fn = kernels().fwd[d][a][p.step - 1][p.w != nullptr][p.has_limit];
  const bool stream = use_stream(3 * p.rows * p.F * dtype_bytes(p.dtype));
  const Split s = make_split(p, kFwdCost);
  if (s.nt <= 1) {
    fn(p, o, 0, p.rows, 0, p.F, stream);
    return Status::kOk;
  }
  run_chunks(s, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    fn(p, o, r0, r1, c0, c1, stream);
  });
  return Status::kOk;
}

Status cpu_forward_rows(const GluProblem& p, const FwdOutput& o, int64_t r0, int64_t r1) {
  using namespace cpu;
  const int d = static_cast<int>(p.dtype), a = static_cast<int>(p.params.act);
  if (d < 0 || d > 2 || a < 0 || a > 1 || (p.step != 1 && p.step != 2))
    return fail(Status::kInternal, "cpu_forward_rows: dtype ", d, ", act ", a, ", step ", p.step);
  if (r0 < r1 && p.F > 0) kernels().fwd[d][a][p.step - 1][p.w != nullptr][p.has_limit](p, o, r0, r1, 0, p.F, false);
  return Status::kOk;
}

Status cpu_backward(const GluProblem& p, const BwdIO& io) {
  using namespace cpu;
  if (p.F == 0) {
    zero_weight_gradient_host(p, io);
    return Status::kOk;
  }
  const int d = static_cast<int>(p.dtype), a = static_cast<int>(p.params.act);
  if (d < 0 || d > 2 || a < 0 || a > 1 || (p.step != 1 && p.step != 2))
    return fail(Status::kInternal, "cpu_backward: dtype ", d, ", act ", a, ", step ", p.step);
  const bool want_dw = p.w != nullptr && io.dw != nullptr;
  const BwdKernel fn = kernels().bwd[d][a][p.step - 1][p.w != nullptr][want_dw][p.has_limit];
  const bool stream = use_stream(5 * p.rows * p.F * dtype_bytes(p.dtype));
  const Split s = make_split(p, kBwdCost);
  if (s.nt <= 1) {
    fn(p, io, 0, p.rows, 0, p.F, nullptr, stream);
    return Status::kOk;
  }
  // Rows that a chunk boundary cuts keep their block sums here, one slot per
  // block, added up in block order afterwards: exactly the sum a whole row gets
  // (0 + block 0 + block 1 + ...), whatever the split and the thread count.
  std::vector<int64_t> split_rows;
  std::vector<float> block_sums;
  if (want_dw) {
    for (int64_t c = 1; c < s.nchunks; ++c) {
      const int64_t u = c * s.chunk;
      if (u % s.blocks_per_row == 0) continue;
      const int64_t r = u / s.blocks_per_row;
      if (split_rows.empty() || split_rows.back() != r) split_rows.push_back(r);
    }
    block_sums.assign(split_rows.size() * s.blocks_per_row, 0.0f);
  }
  run_chunks(s, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    float* sums = nullptr;
    if (want_dw && (c0 != 0 || c1 != p.F)) {
      const size_t i = static_cast<size_t>(
          std::lower_bound(split_rows.begin(), split_rows.end(), r0) - split_rows.begin());
      sums = block_sums.data() + i * s.blocks_per_row;
    }
    fn(p, io, r0, r1, c0, c1, sums, stream);
  });
  for (size_t i = 0; i < split_rows.size(); ++i) {
    float acc = 0.0f;
    for (int64_t b = 0; b < s.blocks_per_row; ++b) acc += block_sums[i * s.blocks_per_row + b];
    io.dw[split_rows[i] * io.dw_stride] = acc;
  }
  return Status::kOk;
}

}  // namespace expertact::detail
