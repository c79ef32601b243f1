// Tests of the test support itself: the dtype encodings against known bit
// patterns, the oracle against hand-computed values, and the checker against
// deliberately wrong results (so the suite cannot pass vacuously).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "support/harness.h"

namespace eat {
namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

TEST(Numeric, Float16Encoding) {
  EXPECT_EQ(to_f16_bits(1.0), 0x3c00);
  EXPECT_EQ(to_f16_bits(-2.0), 0xc000);
  EXPECT_EQ(to_f16_bits(65504.0), 0x7bff);
  EXPECT_EQ(to_f16_bits(65519.99), 0x7bff);
  EXPECT_EQ(to_f16_bits(65520.0), 0x7c00);  // the tie rounds to even: past the top, inf
  EXPECT_EQ(to_f16_bits(std::ldexp(1.0, -24)), 0x0001);
  EXPECT_EQ(to_f16_bits(std::ldexp(1.0, -25)), 0x0000);      // tie to even: 0
  EXPECT_EQ(to_f16_bits(3 * std::ldexp(1.0, -25)), 0x0002);  // tie to even: 2
  EXPECT_EQ(to_f16_bits(std::ldexp(1.0, -14)), 0x0400);
  EXPECT_EQ(to_f16_bits(1.0 + std::ldexp(1.0, -11)), 0x3c00);      // tie to even
  EXPECT_EQ(to_f16_bits(1.0 + 3 * std::ldexp(1.0, -11)), 0x3c02);  // tie to even
  EXPECT_EQ(to_f16_bits(-0.0), 0x8000);
  EXPECT_EQ(to_f16_bits(-kInf), 0xfc00);
  EXPECT_EQ(to_f16_bits(kNaN) & 0x7c00, 0x7c00);
  EXPECT_NE(to_f16_bits(kNaN) & 0x03ff, 0);
  EXPECT_EQ(from_f16_bits(0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(from_f16_bits(0x7bff), 65504.0);
  EXPECT_EQ(from_f16_bits(0xfc00), -kInf);
  EXPECT_TRUE(std::isnan(from_f16_bits(0x7e00)));
  for (uint32_t h = 0; h < 65536; ++h) {
    const double v = from_f16_bits(static_cast<uint16_t>(h));
    if (!std::isnan(v)) {
      ASSERT_EQ(to_f16_bits(v), h) << h;
    }
  }
}

TEST(Numeric, BFloat16Encoding) {
  EXPECT_EQ(to_bf16_bits(1.0), 0x3f80);
  EXPECT_EQ(to_bf16_bits(1.0 + std::ldexp(1.0, -8)), 0x3f80);      // tie to even
  EXPECT_EQ(to_bf16_bits(1.0 + 3 * std::ldexp(1.0, -8)), 0x3f82);  // tie to even
  EXPECT_EQ(to_bf16_bits(1.0 + std::ldexp(1.0, -8) + 1e-12), 0x3f81);
  EXPECT_EQ(to_bf16_bits(7.0), 0x40e0);
  EXPECT_EQ(to_bf16_bits(-kInf), 0xff80);
  EXPECT_EQ(to_bf16_bits(3.4e38), 0x7f80);  // past (2 - 2^-8) 2^127: inf
  EXPECT_TRUE(std::isnan(from_bf16_bits(to_bf16_bits(kNaN))));
  for (uint32_t h = 0; h < 65536; ++h) {
    const double v = from_bf16_bits(static_cast<uint16_t>(h));
    if (!std::isnan(v)) {
      ASSERT_EQ(to_bf16_bits(v), h) << h;
    }
  }
}

TEST(Numeric, UlpAndNeighbours) {
  EXPECT_EQ(ulp_of(DType::kFloat32, 1.0), std::ldexp(1.0, -23));
  EXPECT_EQ(ulp_of(DType::kBFloat16, 1.0), std::ldexp(1.0, -7));
  EXPECT_EQ(ulp_of(DType::kFloat16, 1.0), std::ldexp(1.0, -10));
  EXPECT_EQ(ulp_of(DType::kFloat16, 1e-6), std::ldexp(1.0, -24));
  EXPECT_EQ(next_up(DType::kBFloat16, 7.0), 7.03125);
  EXPECT_EQ(next_down(DType::kBFloat16, 7.0), 6.96875);
  EXPECT_EQ(next_down(DType::kFloat16, -7.0), -7.00390625);
  EXPECT_EQ(next_up(DType::kFloat16, -8.0), -7.99609375);  // the spacing halves below a power of 2
  EXPECT_EQ(next_up(DType::kFloat32, 7.0), static_cast<double>(std::nextafter(7.0f, 8.0f)));
  EXPECT_EQ(round_to(DType::kFloat32, 1.0 + 1e-9), 1.0);
  EXPECT_EQ(round_to(DType::kFloat16, 70000.0), kInf);
}

// ---- the oracle against values worked out by hand

// Reference values from a 30-digit evaluation (mpmath) of the formulas of docs/spec.md section 1.
TEST(Oracle, ScalarActivations) {
  EXPECT_NEAR(oracle_silu(1.0, 1.0), 0.731058578630004879251159, 1e-15);
  EXPECT_NEAR(oracle_silu(-2.0, 1.702), -2.0 / (1.0 + std::exp(3.404)), 1e-15);
  EXPECT_NEAR(oracle_gelu_tanh(1.0), 0.841191990608276704781996, 1e-15);
  EXPECT_NEAR(oracle_gelu_tanh(-3.0), -0.00363739208177301883781647, 1e-18);
}

TEST(Oracle, ClampsMasksAndOffset) {
  // swiglu_oai: g = 8 clamps to 7, u = -9 to -7, beta 1; at exactly the
  // limits the gradient passes, past them it is exactly 0.
  const OracleParams p = oracle_params(preset("swiglu_oai").params);
  const float g[4] = {8.0f, 7.0f, -30.0f, 1.0f};
  const float u[4] = {-9.0f, -7.0f, 7.0f, std::nextafter(7.0f, 8.0f)};
  const float dy[4] = {1.0f, 1.0f, 2.0f, 0.5f};
  Ref out[4], dg[4], du[4], dw;
  oracle_forward_row(p, g, u, 0.5, 4, out);
  oracle_backward_row(p, g, u, dy, 0.5, 4, dg, du, &dw);
  const double alpha = 1.702f;  // the float32 parameter, exactly
  const double a7 = 7.0 / (1.0 + std::exp(-alpha * 7.0));
  EXPECT_NEAR(out[0].v, a7 * (-7.0 + 1.0) * 0.5, 1e-13);
  EXPECT_TRUE(dg[0].exact && dg[0].v == 0.0);  // g = 8 > 7
  EXPECT_TRUE(du[0].exact && du[0].v == 0.0);  // u = -9 < -7
  EXPECT_FALSE(dg[1].exact);                   // g == 7 passes
  EXPECT_FALSE(du[1].exact);                   // u == -7 passes
  const double s = 1.0 / (1.0 + std::exp(-alpha * 7.0));
  EXPECT_NEAR(dg[1].v, 1.0 * 0.5 * (-6.0) * s * (1 + alpha * 7.0 * (1 - s)), 1e-12);
  EXPECT_NEAR(du[1].v, 1.0 * 0.5 * a7, 1e-12);
  EXPECT_FALSE(dg[2].exact);  // the gate is not clamped from below
  EXPECT_TRUE(du[3].exact);   // u just past 7
  EXPECT_NEAR(out[3].v, 0.5 * (1.0 / (1.0 + std::exp(-alpha))) * 8.0, 1e-13);
  double sum = 0;
  for (int j = 0; j < 4; ++j) sum += dy[j] * out[j].v / 0.5;  // grad_w = sum dy a (uc + beta)
  EXPECT_NEAR(dw.v, sum, 1e-12);
}

TEST(Oracle, NanSemantics) {
  const float g[2] = {std::numeric_limits<float>::quiet_NaN(), 1.0f};
  const float u[2] = {1.0f, std::numeric_limits<float>::quiet_NaN()};
  const float dy[2] = {1.0f, 1.0f};
  Ref dg[2], du[2], dw;
  // Clamped: a NaN input's own gradient is exactly 0, its partner's NaN.
  oracle_backward_row(oracle_params(preset("swiglu_clamped7").params), g, u, dy, 1.0, 2, dg, du, &dw);
  EXPECT_TRUE(dg[0].exact && dg[0].v == 0.0);
  EXPECT_TRUE(std::isnan(du[0].v));
  EXPECT_TRUE(du[1].exact && du[1].v == 0.0);
  EXPECT_TRUE(std::isnan(dg[1].v));
  // Unclamped: nothing is masked; a NaN gate reaches its own gradient
  // (act'(NaN)), a NaN up only its partner's (grad_up = dy w act(g) is finite).
  oracle_backward_row(oracle_params(preset("swiglu").params), g, u, dy, 1.0, 2, dg, du, &dw);
  EXPECT_TRUE(std::isnan(dg[0].v) && !dg[0].exact);
  EXPECT_TRUE(std::isnan(du[0].v));
  EXPECT_TRUE(std::isnan(dg[1].v));
  EXPECT_NEAR(du[1].v, 0.731058578630004879, 1e-15);
}

// ---- the checker catches wrong results

class CheckerCatches : public testing::Test {
 protected:
  // A correct library run to perturb.
  void run(const char* preset_name, DType dtype, int64_t rows, int64_t F, WMode wm) {
    c_.params = preset(preset_name).params;
    c_.layout = Layout::kHalves;
    c_.dtype = dtype;
    c_.rows = rows;
    c_.F = F;
    c_.seed = 99;
    wm_ = wm;
    in_ = make_inputs(c_);
    fwd_ = run_forward(backend(BackendKind::kCpu), c_, in_, wm, kPoisonA);
    bwd_ = run_backward(backend(BackendKind::kCpu), c_, in_, wm, InPlace::kNo, kPoisonA);
    ASSERT_EQ(fwd_.status, Status::kOk);
    ASSERT_EQ(bwd_.status, Status::kOk);
    const Verdict v = verify(c_, in_, wm_, &fwd_, &bwd_, oracle_params(c_.params));
    ASSERT_TRUE(v.out.ok() && v.dg.ok() && v.du.ok() && v.dw.ok()) << "the unperturbed run must pass";
  }
  Verdict check(const OracleParams& op) { return verify(c_, in_, wm_, &fwd_, &bwd_, op); }
  Case c_;
  WMode wm_ = WMode::kNone;
  Inputs in_;
  RunResult fwd_, bwd_;
};

TEST_F(CheckerCatches, BetaOffByOneHundredth) {
  for (DType d : all_dtypes()) {
    SCOPED_TRACE(dtype_name(d));
    run("swiglu_oai", d, 17, 100, WMode::kWeights);
    OracleParams op = oracle_params(c_.params);
    op.beta += 0.01;
    const Verdict v = check(op);
    // float32: every element of the rows with a nonzero weight (3 of 17 rows
    // have w = 0); the 2-byte dtypes (ulp 2^-8..2^-11 relative) still catch
    // it where uc + beta is small.
    const double frac = d == DType::kFloat32 ? 0.8 : 0.01;
    EXPECT_GT(v.out.bad, frac * v.out.n) << v.out.report();
    EXPECT_GT(v.dg.bad, frac * 0.5 * v.dg.n) << v.dg.report();
    EXPECT_GT(v.dw.bad, 0) << v.dw.report();
  }
}

TEST_F(CheckerCatches, AlphaOffByOnePercent) {
  run("swiglu_oai", DType::kFloat32, 17, 100, WMode::kNone);
  OracleParams op = oracle_params(c_.params);
  op.alpha *= 1.01;
  const Verdict v = check(op);
  EXPECT_GT(v.out.bad, 0.5 * v.out.n) << v.out.report();
  EXPECT_GT(v.dg.bad, 0.5 * v.dg.n) << v.dg.report();
}

TEST_F(CheckerCatches, WrongActivationOrMissingClamp) {
  run("swiglu_clamped7", DType::kBFloat16, 17, 100, WMode::kNone);
  OracleParams gelu = oracle_params(c_.params);
  gelu.gelu = true;
  EXPECT_GT(check(gelu).out.bad, 0.3 * c_.rows * c_.F);
  OracleParams unclamped = oracle_params(c_.params);
  unclamped.has_limit = false;
  unclamped.limit = std::numeric_limits<double>::infinity();
  const Verdict v = check(unclamped);
  EXPECT_GT(v.out.bad, 0.3 * c_.rows * c_.F) << v.out.report();
  EXPECT_GT(v.dg.bad, 0.1 * c_.rows * c_.F) << v.dg.report();
}

TEST_F(CheckerCatches, SmallPerturbationOfOneElement) {
  run("geglu_tanh", DType::kFloat32, 17, 100, WMode::kNone);
  // float32: 8e-6 relative (~67 ulp) on one element; 2-byte: two ulps.
  const Ref good = {3.0, 3.0 * 8 * 0x1p-24, false, false};  // a bound like the oracle's
  double ratio = 0;
  std::string why;
  EXPECT_TRUE(within(DType::kFloat32, kOracleK, 3.0 * (1 + 1e-6), good, &ratio, &why));
  EXPECT_FALSE(within(DType::kFloat32, kOracleK, 3.0 * (1 + 8e-6), good, &ratio, &why));
  EXPECT_FALSE(within(DType::kBFloat16, kOracleK, 3.0 + 2 * ulp_of(DType::kBFloat16, 3.0), good,
                      &ratio, &why));
  EXPECT_FALSE(within(DType::kFloat16, kOracleK, 3.0 + 2 * ulp_of(DType::kFloat16, 3.0), good,
                      &ratio, &why));
  // And in a real result: one element moved by 1e-5 relative is the only failure.
  size_t i = 0;
  while (!(std::fabs(fwd_.out[i]) > 0.1)) ++i;
  fwd_.out[i] *= 1.0f + 1e-5f;
  const Verdict v = check(oracle_params(c_.params));
  EXPECT_EQ(v.out.bad, 1) << v.out.report();
}

TEST_F(CheckerCatches, NanInfAndMaskedZeros) {
  run("swiglu_clamped7", DType::kFloat16, 17, 100, WMode::kNone);
  double ratio = 0;
  std::string why;
  const Ref nan_ref{kNaN, 0, false, false}, inf_ref{kInf, 0, false, false};
  const Ref masked{0.0, 0.0, true, false};
  const Ref finite{2.0, 1e-7, false, false};
  EXPECT_FALSE(within(DType::kFloat32, kOracleK, 0.0, nan_ref, &ratio, &why));
  EXPECT_FALSE(within(DType::kFloat32, kOracleK, kInf, nan_ref, &ratio, &why));
  EXPECT_FALSE(within(DType::kFloat32, kOracleK, kNaN, inf_ref, &ratio, &why));
  EXPECT_FALSE(within(DType::kFloat32, kOracleK, -kInf, inf_ref, &ratio, &why));
  EXPECT_FALSE(within(DType::kFloat32, kOracleK, kNaN, finite, &ratio, &why));
  EXPECT_FALSE(within(DType::kFloat32, kOracleK, 1e-30, masked, &ratio, &why));
  EXPECT_TRUE(within(DType::kFloat32, kOracleK, 0.0, masked, &ratio, &why));
  // An element left with the poison (0xFFFF: NaN) fails; so does a masked
  // gradient that is not exactly 0.
  size_t k = 0;
  while (std::isnan(fwd_.out[k])) ++k;
  fwd_.out[k] = static_cast<float>(from_f16_bits(0xffff));
  size_t m = 0;
  while (!(in_.gate[m] > 7.0f)) ++m;  // a gate past the limit: its gradient is masked
  bwd_.dgate[m] = 1e-7f;
  const Verdict v = check(oracle_params(c_.params));
  EXPECT_EQ(v.out.bad, 1) << v.out.report();
  EXPECT_EQ(v.dg.bad, 1) << v.dg.report();
  // Two runs with different poisons: an unwritten element differs.
  std::vector<float> a = fwd_.out, b = fwd_.out;
  b[5] = static_cast<float>(from_f16_bits(0x7b7b));
  EXPECT_NE(bitwise_diff(a, b, "out", c_.F), "");
}

// A kernel that rounds the activation to the 2-byte dtype before the product
// (two roundings instead of one) is caught on some elements.
TEST_F(CheckerCatches, RoundingTwice) {
  for (DType d : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype_name(d));
    run("swiglu_oai", d, 17, 100, WMode::kNone);
    const OracleParams op = oracle_params(c_.params);
    const std::vector<double> ones(c_.F, 1.0);
    for (int64_t r = 0; r < c_.rows; ++r)
      for (int64_t j = 0; j < c_.F; ++j) {
        const size_t i = static_cast<size_t>(r * c_.F + j);
        // a alone: the forward with up = 1 - beta (so uc + beta = 1) and w = 1.
        const float g = in_.gate[i], one_minus_beta = static_cast<float>(1.0 - op.beta);
        Ref a;
        oracle_forward_row(op, &g, &one_minus_beta, 1.0, 1, &a);
        const double uc = std::max(-op.limit, std::min<double>(op.limit, in_.up[i]));
        fwd_.out[i] = static_cast<float>(round_to(d, round_to(d, a.v) * (uc + op.beta)));
      }
    const Verdict v = check(op);
    EXPECT_GT(v.out.bad, 0) << "double rounding went unnoticed";
  }
}

// The GPU-vs-CPU comparison (verify_pair): identical runs pass, a run that
// differs by a few ulp of float32 somewhere, or in NaN-ness, fails.
TEST_F(CheckerCatches, PeerComparison) {
  run("swiglu_oai", DType::kFloat32, 17, 100, WMode::kWeights);
  RunResult f2 = fwd_, b2 = bwd_;
  Verdict same = verify_pair(c_, in_, wm_, &fwd_, &f2, &bwd_, &b2);
  EXPECT_TRUE(same.out.ok() && same.dg.ok() && same.du.ok() && same.dw.ok());
  size_t i = 0;
  while (!(std::fabs(f2.out[i]) > 1.0f)) ++i;
  f2.out[i] *= 1.0f + 2e-5f;
  b2.dw[0] *= 1.001f;
  size_t k = 0;
  while (std::isnan(b2.dgate[k])) ++k;
  b2.dgate[k] = std::numeric_limits<float>::quiet_NaN();
  Verdict v = verify_pair(c_, in_, wm_, &fwd_, &f2, &bwd_, &b2);
  EXPECT_EQ(v.out.bad, 1) << v.out.report();
  EXPECT_EQ(v.dw.bad, 1) << v.dw.report();
  EXPECT_EQ(v.dg.bad, 1) << v.dg.report();
}

// The weight-gradient bound of a 14336-wide row is below the terms that carry
// the sum (silu of a negative gate is near 0, so many terms are tiny): a sum
// that dropped any of those (a tail bug) fails.
TEST_F(CheckerCatches, DroppedTermOfTheWeightGradient) {
  run("swiglu_oai", DType::kBFloat16, 3, 14336, WMode::kWeights);
  const OracleParams op = oracle_params(c_.params);
  const int64_t F = c_.F;
  for (int64_t r = 0; r < c_.rows; ++r) {
    if (in_.w[r] == 0) continue;
    std::vector<Ref> dg(F), du(F);
    Ref full;
    const float* g = &in_.gate[r * F];
    const float* u = &in_.up[r * F];
    const float* dy = &in_.dy[r * F];
    oracle_backward_row(op, g, u, dy, in_.w[r], F, dg.data(), du.data(), &full);
    // The terms larger than the tolerance carry most of sum |term|.
    std::vector<Ref> out(F);
    oracle_forward_row(op, g, u, 1.0, F, out.data());
    const double tol = kOracleK * full.e;
    double mass = 0, above = 0;
    for (int64_t j = 0; j < F; ++j) {
      const double t = std::fabs(dy[j] * out[j].v);
      mass += t;
      if (t > 1.5 * tol) above += t;
    }
    EXPECT_GT(above, 0.9 * mass) << "row " << r << ": tolerance " << tol;
    // Drop the last term whose size is above the tolerance.
    int64_t last = F - 1;
    while (std::fabs(dy[last] * out[last].v) <= 1.5 * tol) --last;
    double ratio = 0;
    std::string why;
    Ref dropped = full;
    dropped.v -= dy[last] * out[last].v;
    EXPECT_TRUE(within(DType::kFloat32, kOracleK, bwd_.dw[r], full, &ratio, &why)) << why;
    EXPECT_FALSE(within(DType::kFloat32, kOracleK, bwd_.dw[r], dropped, &ratio, &why))
        << "row " << r;
  }
}

}  // namespace
}  // namespace eat
