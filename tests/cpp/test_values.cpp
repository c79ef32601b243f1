// Values at the boundaries: every pair of (limit, just past it, NaN, +-Inf,
// zeros, ...) for gate and up under every preset, with grad_out finite, +inf
// and NaN; hand-written expectations of the mask and NaN rules; the presets;
// and bitwise determinism across CPU thread counts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>

#include "support/harness.h"

namespace eat {
namespace {

using expertact::Activation;

using ValueParam = std::tuple<BackendKind, int, DType>;

std::string value_name(const testing::TestParamInfo<ValueParam>& info) {
  const auto& [be, pi, dtype] = info.param;
  return std::string(backend_name(be)) + "_" + presets()[pi].name + "_" + dtype_name(dtype);
}

class BoundaryValues : public testing::TestWithParam<ValueParam> {};

// Row r holds every (gate, up) pair of the special values (plus 0.5 and
// -3.5); grad_out is 0.75 in row 0, -1.25 in row 1, +inf in row 2, NaN in
// row 3 (masked gradients must stay exactly 0 even there).
TEST_P(BoundaryValues, EveryPairOnEveryLayout) {
  const auto& [kind, pi, dtype] = GetParam();
  EAT_REQUIRE_BACKEND(kind);
  Case c;
  c.params = presets()[pi].params;
  c.dtype = dtype;
  std::vector<double> v = special_values(c);
  v.push_back(0.5);
  v.push_back(-3.5);
  const int64_t n = static_cast<int64_t>(v.size());
  c.rows = 4;
  c.F = n * n;
  Inputs in;
  in.rows = c.rows;
  in.F = c.F;
  const double dys[4] = {0.75, -1.25, std::numeric_limits<double>::infinity(),
                         std::numeric_limits<double>::quiet_NaN()};
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < n; ++k) {
        in.gate.push_back(static_cast<float>(v[i]));
        in.up.push_back(static_cast<float>(v[k]));
        in.dy.push_back(static_cast<float>(dys[r]));
      }
    in.w.push_back(r == 1 ? 0.5f : 1.25f);
  }
  for (Layout layout : all_layouts()) {
    c.layout = layout;
    check_case_all_modes(kind, c, in);
  }
}

INSTANTIATE_TEST_SUITE_P(All, BoundaryValues,
                         testing::Combine(testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                                          testing::Range(0, 7), testing::ValuesIn(all_dtypes())),
                         value_name);

// ---- the mask and NaN rules, written out by hand (independent of the oracle)

class Semantics : public testing::TestWithParam<BackendKind> {};

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

TEST_P(Semantics, MasksAreInclusiveAndNaNFollowsPyTorch) {
  const BackendKind kind = GetParam();
  EAT_REQUIRE_BACKEND(kind);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dtype : all_dtypes()) {
    for (Layout layout : all_layouts()) {
      for (const char* name : {"swiglu_clamped7", "swiglu"}) {
        SCOPED_TRACE(std::string(name) + " " + layout_name(layout) + " " + dtype_name(dtype));
        Case c;
        c.params = preset(name).params;
        c.layout = layout;
        c.dtype = dtype;
        c.rows = 1;
        c.F = 6;
        const float past7 = static_cast<float>(next_up(dtype, 7.0));
        const float below_m7 = static_cast<float>(next_down(dtype, -7.0));
        Inputs in;
        in.rows = 1;
        in.F = 6;
        in.gate = {7.0f, past7, nan, 1.0f, 1.0f, 1.0f};
        in.up = {1.0f, 1.0f, 1.0f, -7.0f, below_m7, nan};
        in.dy = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
        in.w = {1.0f};
        Backend& be = backend(kind);
        const RunResult f = run_forward(be, c, in, WMode::kNone, kPoisonA);
        const RunResult b = run_backward(be, c, in, WMode::kNone, InPlace::kNo, kPoisonA);
        ASSERT_EQ(f.status, Status::kOk) << f.error;
        ASSERT_EQ(b.status, Status::kOk) << b.error;
        const bool clamped = std::string(name) != "swiglu";
        // g == L passes: a nonzero gradient.
        EXPECT_NE(b.dgate[0], 0.0f);
        EXPECT_TRUE(std::isfinite(b.dgate[0]));
        // u == -L passes.
        EXPECT_NE(b.dup[3], 0.0f);
        if (clamped) {
          // Just past L: exactly 0, and the value is the clamped one.
          EXPECT_EQ(b.dgate[1], 0.0f);
          EXPECT_EQ(b.dup[4], 0.0f);
          EXPECT_TRUE(same_bits(f.out[1], f.out[0])) << f.out[1] << " vs " << f.out[0];
          EXPECT_TRUE(same_bits(f.out[4], f.out[3])) << f.out[4] << " vs " << f.out[3];
          // NaN gate: NaN out, its own gradient 0, the partner's NaN.
          EXPECT_TRUE(std::isnan(f.out[2]));
          EXPECT_EQ(b.dgate[2], 0.0f);
          EXPECT_TRUE(std::isnan(b.dup[2]));
          // NaN up: likewise.
          EXPECT_TRUE(std::isnan(f.out[5]));
          EXPECT_EQ(b.dup[5], 0.0f);
          EXPECT_TRUE(std::isnan(b.dgate[5]));
        } else {
          // No clamp at all: nothing masked, nothing clamped.
          EXPECT_NE(b.dgate[1], 0.0f);
          EXPECT_NE(b.dup[4], 0.0f);
          if (dtype == DType::kFloat32) {  // one ulp past 7 can round back in 2-byte outputs
            EXPECT_NE(f.out[1], f.out[0]);
            EXPECT_NE(f.out[4], f.out[3]);
          }
          // NaN gate: NaN out and both gradients NaN (F.silu(g) * u).
          EXPECT_TRUE(std::isnan(f.out[2]));
          EXPECT_TRUE(std::isnan(b.dgate[2]));
          EXPECT_TRUE(std::isnan(b.dup[2]));
          // NaN up: NaN out, NaN grad_gate, finite grad_up = silu(1).
          EXPECT_TRUE(std::isnan(f.out[5]));
          EXPECT_TRUE(std::isnan(b.dgate[5]));
          EXPECT_NEAR(b.dup[5], 0.7310585786, dtype == DType::kFloat32 ? 1e-6 : 4e-3);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, Semantics, testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                         [](const testing::TestParamInfo<BackendKind>& i) {
                           return std::string(backend_name(i.param));
                         });

// ---- presets

void expect_params(const GluParams& got, const GluParams& want) {
  EXPECT_EQ(got.act, want.act);
  EXPECT_EQ(got.alpha, want.alpha);
  EXPECT_EQ(got.limit, want.limit);
  EXPECT_EQ(got.beta, want.beta);
}

TEST(Presets, MatchTheSpecTable) {
  const float inf = std::numeric_limits<float>::infinity();
  expect_params(expertact::preset_swiglu(), make_params(Activation::kSilu, 1.0f, inf, 0.0f));
  expect_params(expertact::preset_swiglu_clamped(), make_params(Activation::kSilu, 1.0f, 7.0f, 0.0f));
  expect_params(expertact::preset_swiglu_clamped(10.0f),
                make_params(Activation::kSilu, 1.0f, 10.0f, 0.0f));
  expect_params(expertact::preset_swiglu_oai(), make_params(Activation::kSilu, 1.702f, 7.0f, 1.0f));
  expect_params(expertact::preset_swiglu_oai(1.5f, 8.0f),
                make_params(Activation::kSilu, 1.5f, 8.0f, 1.0f));
  const GluParams g = expertact::preset_geglu_tanh();
  EXPECT_EQ(g.act, Activation::kGeluTanh);
  EXPECT_EQ(g.limit, inf);
  EXPECT_EQ(g.beta, 0.0f);
  // The default-constructed params are plain swiglu.
  expect_params(GluParams{}, make_params(Activation::kSilu, 1.0f, inf, 0.0f));
}

// ---- CPU threads

class ThreadGuard {
 public:
  ThreadGuard() = default;
  ~ThreadGuard() { expertact::set_cpu_threads(0); }
};

TEST(CpuThreads, SetAndRestore) {
  ThreadGuard guard;
  expertact::set_cpu_threads(3);
  EXPECT_EQ(expertact::cpu_threads(), 3);
  expertact::set_cpu_threads(0);
  EXPECT_GE(expertact::cpu_threads(), 1);
  expertact::set_cpu_threads(-4);  // treated as "default"
  EXPECT_GE(expertact::cpu_threads(), 1);
}

// 4097 x 400: 1.6M elements, enough work that the CPU path splits rows over
// 5 threads in forward and backward; results must not depend on the split.
TEST(CpuThreads, BitwiseIdenticalAcrossThreadCounts) {
  ThreadGuard guard;
  Backend& be = backend(BackendKind::kCpu);
  for (auto [layout, dtype] : {std::pair<Layout, DType>{Layout::kInterleaved, DType::kBFloat16},
                               {Layout::kSeparate, DType::kFloat32}}) {
    {
      Case c;
      c.params = preset("swiglu_oai").params;
      c.layout = layout;
      c.dtype = dtype;
      c.rows = 4097;
      c.F = 400;
      c.specials = true;
      c.seed = 5;
      SCOPED_TRACE(c.describe());
      const Inputs in = make_inputs(c);
      RunResult f1, b1;
      for (int threads : {1, 2, 5}) {
        expertact::set_cpu_threads(threads);
        const RunResult f = run_forward(be, c, in, WMode::kWeights, kPoisonA);
        const RunResult b = run_backward(be, c, in, WMode::kWeights, InPlace::kNo, kPoisonB);
        ASSERT_EQ(f.status, Status::kOk) << f.error;
        ASSERT_EQ(b.status, Status::kOk) << b.error;
        if (threads == 1) {
          f1 = f;
          b1 = b;
          continue;
        }
        SCOPED_TRACE(std::to_string(threads) + " threads vs 1");
        EXPECT_EQ(bitwise_diff(f.out, f1.out, "out", c.F), "");
        EXPECT_EQ(bitwise_diff(b.dgate, b1.dgate, "grad_gate", c.F), "");
        EXPECT_EQ(bitwise_diff(b.dup, b1.dup, "grad_up", c.F), "");
        EXPECT_EQ(bitwise_diff(b.dw, b1.dw, "grad_weights", 1), "");
        if (threads == 5 && layout == Layout::kInterleaved && dtype == DType::kBFloat16) {
          // The threaded result is also the right one.
          expect_verdict(verify(c, in, WMode::kWeights, &f, &b, oracle_params(c.params)),
                         "5 threads vs oracle");
        }
      }
    }
  }
}

}  // namespace
}  // namespace eat
