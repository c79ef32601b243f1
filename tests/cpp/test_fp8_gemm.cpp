// The FP8 blockwise grouped GEMM's host side: every refusal of its entry point (the C++ API and
// the C ABI), each naming its argument and value, checked on operands described in host
// memory (no check reads them but the CPU offsets' values); and the per-expert arithmetic of
// its device-side builder (src/cuda/gemm/fp8_gemm_plan.h), run on the host: spans, the compaction
// of the experts with work into the problem list, each expert's operand offsets and the
// output it zeroes. The kernel's values are tested on a GPU (tests/python/test_fp8_gemm.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/gemm/fp8_gemm_plan.h"
#include "expertact/expertact.hpp"
#include "expertact/expertact_c.h"

namespace {

using expertact::DeviceType;
using expertact::DType;
using expertact::ExpertsRef;
using expertact::GemmGrouping;
using expertact::MatrixRef;
using expertact::OffsetsRef;
using expertact::Status;
namespace fg = expertact::fp8gemm;

// 256-byte aligned host memory that the checks may point into (never read by them).
struct Arena {
  std::vector<uint8_t> bytes;
  size_t used = 0;
  explicit Arena(size_t n) : bytes(n + 256) {}
  void* take(size_t n) {
    uintptr_t base = reinterpret_cast<uintptr_t>(bytes.data());
    uintptr_t p = (base + used + 255) / 256 * 256;
    used = p + n - base;
    EXPECT_LE(used, bytes.size());
    return reinterpret_cast<void*>(p);
  }
};

int64_t esize(DType d) { return d == DType::kFloat8E4M3 ? 1 : d == DType::kFloat32 ? 4 : 2; }

MatrixRef mat(Arena& ar, DType d, int64_t rows, int64_t cols) {
  MatrixRef m;
  m.data = ar.take(static_cast<size_t>(std::max<int64_t>(rows * cols, 1) * esize(d)));
  m.rows = rows;
  m.cols = cols;
  m.row_stride = cols;
  m.dtype = d;
  return m;
}

// A valid M-grouped call on the CPU (which the entry refuses last, as unsupported): T rows, K,
// N, E experts; offsets as given (host ints).
struct MCall {
  Arena ar{1 << 22};
  std::vector<int32_t> offs;
  MatrixRef a, sa;
  ExpertsRef b, sb, d;
  OffsetsRef o;
  std::vector<uint8_t> ws_bytes;
  void* ws = nullptr;
  size_t ws_size = 0;
  MCall(int64_t T, int64_t K, int64_t N, std::vector<int32_t> offsets) : offs(std::move(offsets)) {
    const int64_t E = static_cast<int64_t>(offs.size()), KB = (K + 127) / 128, NB = (N + 127) / 128;
    a = mat(ar, DType::kFloat8E4M3, T, K);
    sa = mat(ar, DType::kFloat32, KB, T);
    b.m = mat(ar, DType::kFloat8E4M3, N, K);
    ar.take(static_cast<size_t>((E - 1) * N * K));  // the other experts' matrices
    b.expert_stride = N * K;
    sb.m = mat(ar, DType::kFloat32, NB, KB);
    ar.take(static_cast<size_t>((E - 1) * NB * KB * 4));
    sb.expert_stride = NB * KB;
    d.m = mat(ar, DType::kBFloat16, T, N);
    o = OffsetsRef{offs.data(), E, DeviceType::kCPU, 0};
    ws_size = expertact::fp8_grouped_gemm_blockwise_workspace_bytes(E);
    ws = ws_size ? ar.take(ws_size) : nullptr;
  }
  Status call(GemmGrouping g = GemmGrouping::kM) {
    return expertact::fp8_grouped_gemm_blockwise(g, a, sa, b, sb, o, d, ws, ws_size);
  }
};

// A valid K-grouped call: a [M, Tp], b [N, Tp], d [E][M, N].
struct KCall {
  Arena ar{1 << 22};
  std::vector<int32_t> offs;
  MatrixRef a, sa;
  ExpertsRef b, sb, d;
  OffsetsRef o;
  void* ws = nullptr;
  size_t ws_size = 0;
  KCall(int64_t M, int64_t N, int64_t Tp, std::vector<int32_t> offsets) : offs(std::move(offsets)) {
    const int64_t E = static_cast<int64_t>(offs.size());
    a = mat(ar, DType::kFloat8E4M3, M, Tp);
    b.m = mat(ar, DType::kFloat8E4M3, N, Tp);
    sa = mat(ar, DType::kFloat32, Tp / 128, M);
    sb.m = mat(ar, DType::kFloat32, Tp / 128, N);
    d.m = mat(ar, DType::kBFloat16, M, N);
    ar.take(static_cast<size_t>((E - 1) * M * N * 2));
    d.expert_stride = M * N;
    o = OffsetsRef{offs.data(), E, DeviceType::kCPU, 0};
    ws_size = expertact::fp8_grouped_gemm_blockwise_workspace_bytes(E);
    ws = ws_size ? ar.take(ws_size) : nullptr;
  }
  Status call() { return expertact::fp8_grouped_gemm_blockwise(GemmGrouping::kK, a, sa, b, sb, o, d, ws, ws_size); }
};

std::string err() { return expertact::last_error(); }

#define EXPECT_REFUSED(expr, status, ...)                                                   \
  do {                                                                                      \
    EXPECT_EQ((expr), (status)) << err();                                                   \
    for (const char* needle : {__VA_ARGS__})                                                \
      EXPECT_NE(err().find(needle), std::string::npos) << "missing '" << needle << "' in: " << err(); \
  } while (0)

TEST(Fp8GemmErrors, ValidCpuOperandsAreUnsupported) {
  MCall m(300, 256, 256, {100, 100, 300});
  EXPECT_REFUSED(m.call(), Status::kUnsupported, "CUDA tensors", "a is on the CPU");
  KCall k(256, 128, 512, {128, 128, 512});
  EXPECT_REFUSED(k.call(), Status::kUnsupported, "CUDA tensors");
}

TEST(Fp8GemmErrors, CudaDescriptorsWithoutTheGemmSayHowToBuildIt) {
  if (expertact::has_fp8_grouped_gemm()) GTEST_SKIP() << "this build has the GEMM";
  MCall m(256, 256, 256, {128, 256});
  for (MatrixRef* x : {&m.a, &m.sa, &m.b.m, &m.sb.m, &m.d.m}) x->device = DeviceType::kCUDA;
  m.o.device = DeviceType::kCUDA;
  EXPECT_REFUSED(m.call(), Status::kUnsupported, "no FP8 grouped GEMM", "nvidia-cutlass", "EXPERTACT_CUTLASS");
  EXPECT_EQ(expertact::fp8_grouped_gemm_blockwise_workspace_bytes(4), 0u);
  EXPECT_EQ(expertact_has_fp8_grouped_gemm(), 0);
}

TEST(Fp8GemmErrors, WorkspaceQuery) {
  EXPECT_EQ(expertact_fp8_grouped_gemm_blockwise_workspace_bytes(7),
            expertact::fp8_grouped_gemm_blockwise_workspace_bytes(7));
  EXPECT_EQ(expertact::fp8_grouped_gemm_blockwise_workspace_bytes(0), 0u);
  if (expertact::has_fp8_grouped_gemm()) {
    EXPECT_GT(expertact::fp8_grouped_gemm_blockwise_workspace_bytes(1), 0u);
    EXPECT_GT(expertact::fp8_grouped_gemm_blockwise_workspace_bytes(512),
              expertact::fp8_grouped_gemm_blockwise_workspace_bytes(1));
  }
}

TEST(Fp8GemmErrors, Grouping) {
  MCall m(256, 256, 256, {256});
  EXPECT_REFUSED(m.call(static_cast<GemmGrouping>(2)), Status::kInvalidArgument, "grouping 2");
}

TEST(Fp8GemmErrors, Dtypes) {
  {
    MCall m(256, 256, 256, {256});
    m.a.dtype = DType::kBFloat16;
    EXPECT_REFUSED(m.call(), Status::kInvalidDtype, "a.dtype is bfloat16", "float8_e4m3fn");
  }
  {
    MCall m(256, 256, 256, {256});
    m.sa.dtype = DType::kFloat16;
    EXPECT_REFUSED(m.call(), Status::kInvalidDtype, "a_scale.dtype is float16", "float32");
  }
  {
    MCall m(256, 256, 256, {256});
    m.b.m.dtype = DType::kFloat32;
    EXPECT_REFUSED(m.call(), Status::kInvalidDtype, "b.dtype is float32");
  }
  {
    MCall m(256, 256, 256, {256});
    m.sb.m.dtype = DType::kBFloat16;
    EXPECT_REFUSED(m.call(), Status::kInvalidDtype, "b_scale.dtype is bfloat16");
  }
  {
    MCall m(256, 256, 256, {256});
    m.d.m.dtype = DType::kFloat32;
    EXPECT_REFUSED(m.call(), Status::kInvalidDtype, "d.dtype is float32", "bfloat16");
  }
}

TEST(Fp8GemmErrors, Devices) {
  MCall m(256, 256, 256, {256});
  m.d.m.device = DeviceType::kCUDA;
  EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "d is on cuda:0 but a is on cpu");
  MCall m2(256, 256, 256, {256});
  m2.o.device = DeviceType::kCUDA;
  EXPECT_REFUSED(m2.call(), Status::kInvalidArgument, "offsets is on cuda:0");
}

TEST(Fp8GemmErrors, Offsets) {
  {
    MCall m(256, 256, 256, {256});
    m.o.size = 0;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "offsets has 0 elements");
  }
  {
    MCall m(256, 256, 256, {200, 100});  // decreasing: read and refused on the CPU
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "offsets");
  }
  {
    MCall m(256, 256, 256, {100, 300});  // past T
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "offsets", "300");
  }
}

TEST(Fp8GemmErrors, MGroupedShapes) {
  {
    MCall m(256, 2888, 256, {256});  // K = 2888: not a multiple of 16
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "K = 2888", "multiple of 16");
  }
  {
    MCall m(256, 256, 256, {256});
    m.b.m.cols = 128;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "b has shape [256, 128]", "[256, 256]");
  }
  {
    MCall m(256, 256, 256, {256});
    m.sa.rows = 3;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "a_scale has shape [3, 256]", "[2, 256]");
  }
  {
    MCall m(256, 256, 256, {256});
    m.sa = MatrixRef{m.sa.data, 256, 2, 2, DType::kFloat32};  // [T, KB] instead of [KB, T]
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "a_scale has shape [256, 2]", "ceil(K / 128), T");
  }
  {
    MCall m(256, 256, 384, {256});
    m.sb.m.rows = 2;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "b_scale has shape [2, 2]", "[3, 2]");
  }
  {
    MCall m(256, 256, 256, {256});
    m.d.m.rows = 255;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "d has shape [255, 256]");
  }
  {
    MCall m(256, 256, 256, {256});
    m.d.expert_stride = 256 * 256;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "d expert_stride 65536 must be 0");
  }
  {
    MCall m(256, 256, 256, {128, 256});
    m.b.expert_stride = -16;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "b expert_stride -16 is negative");
    m.b.expert_stride = 8;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "b expert_stride 8", "multiple of 16");
  }
  {
    MCall m(256, 256, 256, {128, 256});
    m.sb.expert_stride = -1;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "b_scale expert_stride -1 is negative");
  }
  {
    MCall m(256, 256, 132, {256});  // N = 132: not a multiple of 8
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "N = 132", "multiple of 8");
  }
}

TEST(Fp8GemmErrors, KGroupedShapes) {
  {
    KCall k(256, 128, 500, {128, 500});
    EXPECT_REFUSED(k.call(), Status::kInvalidArgument, "Tp = 500", "multiple of 128");
  }
  {
    KCall k(256, 128, 512, {128, 512});
    k.b.m.cols = 384;
    EXPECT_REFUSED(k.call(), Status::kInvalidArgument, "b has shape [128, 384]", "[128, 512]");
  }
  {
    KCall k(256, 128, 512, {128, 512});
    k.sa.rows = 5;
    EXPECT_REFUSED(k.call(), Status::kInvalidArgument, "a_scale has shape [5, 256]", "[4, 256]");
  }
  {
    KCall k(256, 128, 512, {128, 512});
    k.sb.m = MatrixRef{k.sb.m.data, 128, 4, 4, DType::kFloat32};
    EXPECT_REFUSED(k.call(), Status::kInvalidArgument, "b_scale has shape [128, 4]", "[4, 128]");
  }
  {
    KCall k(256, 128, 512, {128, 512});
    k.d.m.cols = 120;
    EXPECT_REFUSED(k.call(), Status::kInvalidArgument, "d has shape [256, 120]", "[256, 128]");
  }
  {
    KCall k(256, 128, 512, {128, 512});
    k.b.expert_stride = 16;
    EXPECT_REFUSED(k.call(), Status::kInvalidArgument, "b expert_stride 16 must be 0");
    k.b.expert_stride = 0;
    k.sb.expert_stride = 4;
    EXPECT_REFUSED(k.call(), Status::kInvalidArgument, "b_scale expert_stride 4 must be 0");
  }
  {
    KCall k(256, 128, 512, {128, 512});
    k.d.expert_stride = 256 * 128 - 8;  // the experts' outputs would overlap
    EXPECT_REFUSED(k.call(), Status::kInvalidArgument, "d expert_stride 32760", "overlap");
    k.d.expert_stride = 256 * 128 + 4;
    EXPECT_REFUSED(k.call(), Status::kInvalidArgument, "d expert_stride 32772", "multiple of 8");
  }
  {
    KCall k(256, 120, 512, {128, 512});  // N = 120 is a multiple of 8: accepted (then unsupported on the CPU)
    EXPECT_REFUSED(k.call(), Status::kUnsupported, "CUDA");
  }
}

TEST(Fp8GemmErrors, TmaAlignment) {
  {
    MCall m(256, 256, 256, {256});
    m.a.data = static_cast<char*>(m.a.data) + 1;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "a.data", "16-byte aligned");
  }
  {
    MCall m(256, 256, 256, {256});
    m.a.cols = 240;  // a [256, 240] in rows of 248: K = 240 is fine, the stride is not
    m.a.row_stride = 248;
    m.sa.rows = 2;
    m.b.m.cols = 240;
    m.b.m.row_stride = 256;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "a.row_stride 248", "multiple of 16");
  }
  {
    MCall m(256, 256, 256, {256});
    m.b.m.row_stride = 264;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "b.row_stride 264");
  }
  {
    MCall m(256, 256, 256, {256});
    m.d.m.row_stride = 260;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "d.row_stride 260", "multiple of 8");
  }
  {
    MCall m(256, 256, 256, {256});
    m.d.m.data = static_cast<char*>(m.d.m.data) + 8;
    EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "d.data", "16-byte aligned");
  }
}

TEST(Fp8GemmErrors, ScaleLayoutsIndexIn32Bits) {
  MCall m(256, 256, 256, {256});
  m.sa.row_stride = int64_t{1} << 30;  // 2 rows of 2^30: past int32 (nothing is read)
  EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "a_scale spans 2 rows of stride 1073741824", "32 bits");
}

TEST(Fp8GemmErrors, OutputOverlapsAnInput) {
  MCall m(256, 256, 256, {256});
  m.d.m.data = m.sa.data;  // d's bytes over a_scale's
  EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "d overlaps a_scale");
}

TEST(Fp8GemmErrors, Workspace) {
  if (!expertact::has_fp8_grouped_gemm()) GTEST_SKIP() << "no GEMM in this build: it takes no workspace";
  // CUDA descriptors of host memory: refused before anything is launched or read.
  auto on_cuda = [](MCall& m) {
    for (MatrixRef* x : {&m.a, &m.sa, &m.b.m, &m.sb.m, &m.d.m}) x->device = DeviceType::kCUDA;
    m.o = OffsetsRef{m.offs.data(), m.o.size, DeviceType::kCUDA, 0};
  };
  MCall m(256, 256, 256, {256});
  on_cuda(m);
  m.ws_size -= 1;
  EXPECT_REFUSED(m.call(), Status::kInvalidArgument, "workspace_bytes", "fp8_grouped_gemm_blockwise_workspace_bytes");
  MCall m2(256, 256, 256, {256});
  on_cuda(m2);
  m2.ws = static_cast<char*>(m2.ws) + 16;
  EXPECT_REFUSED(m2.call(), Status::kInvalidArgument, "not 256-byte aligned");
}

TEST(Fp8GemmErrors, CAbi) {
  MCall m(256, 256, 256, {256});
  auto t = [](const MatrixRef& x, DLDataType dt) {
    return expertact_tensor{x.data, x.rows, x.cols, x.row_stride, dt, DLDevice{kDLCPU, 0}};
  };
  const DLDataType f8{EXPERTACT_DL_FLOAT8_E4M3FN, 8, 1}, f32{kDLFloat, 32, 1}, bf16{kDLBfloat, 16, 1};
  expertact_tensor a = t(m.a, f8), sa = t(m.sa, f32), b = t(m.b.m, f8), sb = t(m.sb.m, f32), d = t(m.d.m, bf16);
  expertact_tensor o{m.offs.data(), 1, 1, 1, DLDataType{kDLInt, 32, 1}, DLDevice{kDLCPU, 0}};
  auto call = [&](int32_t g, const expertact_tensor* pa) {
    return expertact_fp8_grouped_gemm_blockwise(g, pa, &sa, &b, m.b.expert_stride, &sb, m.sb.expert_stride, &o, &d, 0,
                                                m.ws, m.ws_size, nullptr);
  };
  EXPECT_EQ(call(EXPERTACT_GEMM_M_GROUPED, &a), EXPERTACT_UNSUPPORTED) << expertact_last_error();
  EXPECT_EQ(call(EXPERTACT_GEMM_M_GROUPED, nullptr), EXPERTACT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(expertact_last_error()).find("a is null"), std::string::npos) << expertact_last_error();
  EXPECT_EQ(call(7, &a), EXPERTACT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(expertact_last_error()).find("grouping 7"), std::string::npos) << expertact_last_error();
  expertact_tensor a16 = t(m.a, DLDataType{kDLInt, 8, 1});
  EXPECT_EQ(call(EXPERTACT_GEMM_M_GROUPED, &a16), EXPERTACT_INVALID_DTYPE) << expertact_last_error();
  o.dtype = DLDataType{kDLInt, 64, 1};
  EXPECT_EQ(call(EXPERTACT_GEMM_M_GROUPED, &a), EXPERTACT_INVALID_DTYPE);
  EXPECT_NE(std::string(expertact_last_error()).find("offsets must be int32"), std::string::npos);
}

// ---------------------------------------------------------------------------
// The builder's per-expert arithmetic, on the host
// ---------------------------------------------------------------------------

fg::Problem m_problem(int64_t T, int64_t K, int64_t N, int32_t E) {
  fg::Problem p;
  p.grouping = GemmGrouping::kM;
  p.E = E;
  p.T = T;
  p.K = K;
  p.N = N;
  p.lda = K + 16;
  p.ld_sfa = T + 4;
  p.ldb = K;
  p.b_es = N * K + 32;
  p.ld_sfb = 7;
  p.sfb_es = 100;
  p.ldd = N + 8;
  return p;
}

fg::Problem k_problem(int64_t M, int64_t N, int64_t Tp, int32_t E) {
  fg::Problem p;
  p.grouping = GemmGrouping::kK;
  p.E = E;
  p.T = Tp;
  p.M = M;
  p.N = N;
  p.lda = Tp + 32;
  p.ldb = Tp + 64;
  p.ld_sfa = M + 1;
  p.ld_sfb = N + 3;
  p.ldd = N + 8;
  p.d_es = M * (N + 8) + 64;
  return p;
}

TEST(Fp8GemmPlan, SpansClampTheOffsets) {
  const fg::Problem p = m_problem(1000, 256, 256, 6);
  // Uneven, empty, decreasing, negative and past-T offsets: spans stay inside [0, T].
  const std::vector<int32_t> o = {100, 100, 50, -7, 2000, 1000};
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 100}, {100, 100}, {100, 100}, {50, 50}, {0, 1000},
                                                         {1000, 1000}};
  for (int64_t e = 0; e < 6; ++e) {
    const fg::Span s = fg::span_of(p, o.data(), e);
    EXPECT_EQ(s.begin, want[e].first) << "expert " << e;
    EXPECT_EQ(s.end, want[e].second) << "expert " << e;
    EXPECT_GE(s.begin, 0);
    EXPECT_LE(s.end, p.T);
  }
}

TEST(Fp8GemmPlan, KGroupedSpansAreWholeTiles) {
  const fg::Problem p = k_problem(256, 128, 1024, 4);
  const std::vector<int32_t> o = {128, 300, 900, 5000};  // 300, 900 not multiples of 128; past Tp
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 128}, {128, 256}, {256, 896}, {896, 1024}};
  for (int64_t e = 0; e < 4; ++e) {
    const fg::Span s = fg::span_of(p, o.data(), e);
    EXPECT_EQ(s.begin, want[e].first) << "expert " << e;
    EXPECT_EQ(s.end, want[e].second) << "expert " << e;
    EXPECT_EQ(s.begin % 128, 0);
    EXPECT_EQ(s.end % 128, 0);
  }
}

TEST(Fp8GemmPlan, ExpertsWithWorkFillTheFirstSlotsInOrder) {
  const fg::Problem p = m_problem(700, 256, 256, 7);
  const std::vector<int32_t> o = {0, 100, 100, 350, 350, 700, 700};  // experts 1, 3, 5 have rows
  std::vector<int32_t> slots;
  for (int64_t e = 0; e < 7; ++e)
    if (fg::has_work(p, fg::span_of(p, o.data(), e))) slots.push_back(fg::slot_of(p, o.data(), e));
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(fg::slot_of(p, o.data(), 7), 3);  // W: the experts with work
  // K == 0 (an empty sum) or N == 0: no expert has work.
  fg::Problem z = p;
  z.K = 0;
  EXPECT_EQ(fg::slot_of(z, o.data(), 7), 0);
  z = p;
  z.N = 0;
  EXPECT_EQ(fg::slot_of(z, o.data(), 7), 0);
  // K-grouped: an expert without tokens has no work; M == 0 leaves none.
  fg::Problem k = k_problem(64, 128, 512, 3);
  const std::vector<int32_t> ko = {128, 128, 512};
  EXPECT_EQ(fg::slot_of(k, ko.data(), 3), 2);
  k.M = 0;
  EXPECT_EQ(fg::slot_of(k, ko.data(), 3), 0);
}

TEST(Fp8GemmPlan, MGroupedOperands) {
  const fg::Problem p = m_problem(1000, 2880, 512, 3);
  const std::vector<int32_t> o = {300, 300, 1000};
  const fg::Span s = fg::span_of(p, o.data(), 2);
  const fg::GroupOperands g = fg::operands_of(p, 2, s);
  EXPECT_EQ(g.M, 700);
  EXPECT_EQ(g.N, 512);
  EXPECT_EQ(g.K, 2880);
  EXPECT_EQ(g.a, 300 * p.lda);          // row 300 of a
  EXPECT_EQ(g.sfa, 300);                // column 300 of the [KB, T] scales
  EXPECT_EQ(g.sfa_k, p.ld_sfa);         // K blocks a row of them apart
  EXPECT_EQ(g.b, 2 * p.b_es);           // expert 2's weight
  EXPECT_EQ(g.sfb, 2 * p.sfb_es);
  EXPECT_EQ(g.sfb_n, p.ld_sfb);
  EXPECT_EQ(g.d, 300 * p.ldd);
  EXPECT_EQ(g.lda, p.lda);
  EXPECT_EQ(g.ldd, p.ldd);
}

TEST(Fp8GemmPlan, KGroupedOperands) {
  const fg::Problem p = k_problem(256, 384, 1024, 3);
  const std::vector<int32_t> o = {256, 256, 1024};
  const fg::GroupOperands g = fg::operands_of(p, 2, fg::span_of(p, o.data(), 2));
  EXPECT_EQ(g.M, 256);
  EXPECT_EQ(g.N, 384);
  EXPECT_EQ(g.K, 768);
  EXPECT_EQ(g.a, 256);                  // column 256 of A^T
  EXPECT_EQ(g.b, 256);
  EXPECT_EQ(g.sfa, 2 * p.ld_sfa);       // row 256 / 128 of [Tp / 128, M]
  EXPECT_EQ(g.sfa_k, p.ld_sfa);
  EXPECT_EQ(g.sfb, 2 * p.ld_sfb);
  EXPECT_EQ(g.sfb_k, p.ld_sfb);
  EXPECT_EQ(g.d, 2 * p.d_es);           // d[2]
}

TEST(Fp8GemmPlan, MGroupedZeroesTheRowsPastTheLastOffset) {
  fg::Problem p = m_problem(1000, 256, 256, 3);
  const std::vector<int32_t> o = {100, 600, 900};
  ASSERT_EQ(fg::zero_region_count(p), 1);
  fg::ZeroRegion z = fg::zero_region(p, o.data(), 0);
  EXPECT_EQ(z.d_offset, 0);
  EXPECT_EQ(z.row_begin, 900);
  EXPECT_EQ(z.row_end, 1000);
  const std::vector<int32_t> full = {100, 600, 1000};
  z = fg::zero_region(p, full.data(), 0);
  EXPECT_EQ(z.row_end - z.row_begin, 0);
  p.K = 0;  // an empty sum: every row is 0
  z = fg::zero_region(p, o.data(), 0);
  EXPECT_EQ(z.row_begin, 0);
  EXPECT_EQ(z.row_end, 1000);
  // Decreasing offsets: only the rows past every expert's end.
  p.K = 256;
  const std::vector<int32_t> bad = {800, 300, 500};
  z = fg::zero_region(p, bad.data(), 0);
  EXPECT_EQ(z.row_begin, 800);
}

TEST(Fp8GemmPlan, KGroupedZeroesTheExpertsWithoutTokens) {
  const fg::Problem p = k_problem(256, 128, 512, 4);
  const std::vector<int32_t> o = {0, 256, 256, 512};  // experts 0 and 2 have no tokens
  ASSERT_EQ(fg::zero_region_count(p), 4);
  for (int64_t e = 0; e < 4; ++e) {
    const fg::ZeroRegion z = fg::zero_region(p, o.data(), e);
    EXPECT_EQ(z.d_offset, e * p.d_es);
    EXPECT_EQ(z.row_begin, 0);
    EXPECT_EQ(z.row_end, e % 2 == 0 ? p.M : 0) << "expert " << e;
  }
}

}  // namespace
