// float64 on the CPU (the gradient-checking path): every preset x layout,
// forward / backward / in-place, weights, special values, against the float64
// oracle at float64 tolerances; refused on CUDA tensors; reachable through the C ABI.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "expertact/expertact.hpp"
#include "expertact/expertact_c.h"
#include "support/oracle.h"

namespace eat {
namespace {

using namespace expertact;

const double kNaN = std::numeric_limits<double>::quiet_NaN();

// |got - want| within 64 float64 ulps of the larger magnitude among the
// products involved (the oracle's float32 bound e scaled by 2^-29), NaN/Inf
// positions equal, masked zeros exact.
void expect_close(const char* what, int64_t i, double got, const Ref& r) {
  if (std::isnan(r.v)) {
    EXPECT_TRUE(std::isnan(got)) << what << "[" << i << "] = " << got << ", want NaN";
    return;
  }
  if (std::isinf(r.v) || r.exact) {
    EXPECT_EQ(got, r.v) << what << "[" << i << "]";
    return;
  }
  const double tol = 64 * std::ldexp(r.e, -29) + 1e-300;
  EXPECT_NEAR(got, r.v, tol) << what << "[" << i << "]";
}

struct Case {
  GluParams p;
  Layout layout;
};

class Float64 : public ::testing::TestWithParam<std::tuple<int, int>> {};

GluParams preset(int i) {
  switch (i) {
    case 0: return preset_swiglu();
    case 1: return preset_swiglu_clamped(7.0f);
    case 2: return preset_swiglu_oai();
    case 3: return preset_geglu_tanh();
    default: {
      GluParams g;
      g.alpha = 0.5f;
      g.limit = 3.0f;
      g.beta = -0.25f;
      return g;
    }
  }
}

TEST_P(Float64, ForwardBackwardInPlaceWeights) {
  const GluParams p = preset(std::get<0>(GetParam()));
  const Layout L = static_cast<Layout>(std::get<1>(GetParam()));
  const bool sep = L == Layout::kSeparate;
  const int64_t R = 9, F = 37, xc = sep ? F : 2 * F;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 6.0f);
  // Inputs are float-representable (the oracle takes floats), with special values.
  std::vector<float> g(R * F), u(R * F), dy(R * F), w(R);
  for (auto& x : g) x = nd(rng);
  for (auto& x : u) x = nd(rng);
  for (auto& x : dy) x = nd(rng) / 6;
  for (auto& x : w) x = std::fabs(nd(rng)) / 6 + 0.1f;
  const float lim = std::isinf(p.limit) ? 7.0f : p.limit;
  g[1] = lim, u[2] = -lim, g[3] = NAN, u[4] = NAN, g[5] = INFINITY, u[6] = -INFINITY, dy[7] = NAN;
  auto gi = [&](int64_t r, int64_t c) {
    switch (L) {
      case Layout::kSeparate: return r * F + c;
      case Layout::kHalves: return r * 2 * F + c;
      case Layout::kHalvesUpFirst: return r * 2 * F + F + c;
      case Layout::kInterleaved: return r * 2 * F + 2 * c;
    }
    return int64_t(0);
  };
  auto ui = [&](int64_t r, int64_t c) {
    switch (L) {
      case Layout::kSeparate: return r * F + c;
      case Layout::kHalves: return r * 2 * F + F + c;
      case Layout::kHalvesUpFirst: return r * 2 * F + c;
      case Layout::kInterleaved: return r * 2 * F + 2 * c + 1;
    }
    return int64_t(0);
  };
  std::vector<double> x(R * xc), xu(sep ? R * F : 0), ddy(R * F);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < F; ++c) {
      x[gi(r, c)] = g[r * F + c];
      (sep ? xu : x)[ui(r, c)] = u[r * F + c];
      ddy[r * F + c] = dy[r * F + c];
    }
  auto mref = [&](double* d, int64_t cols) {
    MatrixRef m;
    m.data = d, m.rows = R, m.cols = cols, m.row_stride = cols, m.dtype = DType::kFloat64;
    return m;
  };
  VectorRef vw{w.data(), R, 1};
  std::vector<double> out(R * F, kNaN), dx(R * xc, kNaN), du(sep ? R * F : 0, kNaN);
  std::vector<float> dw(R, NAN);
  MatrixRef mx = mref(x.data(), xc), mu = mref(xu.data(), F), mo = mref(out.data(), F),
            md = mref(ddy.data(), F), mdx = mref(dx.data(), xc), mdu = mref(du.data(), F);
  ASSERT_EQ(glu_forward(p, L, mx, sep ? &mu : nullptr, &vw, mo), Status::kOk) << last_error();
  ASSERT_EQ(glu_backward(p, L, md, mx, sep ? &mu : nullptr, &vw, mdx, sep ? &mdu : nullptr, &vw),
            Status::kInvalidArgument);  // grad_weights may not alias weights
  VectorRef vdw{dw.data(), R, 1};
  ASSERT_EQ(glu_backward(p, L, md, mx, sep ? &mu : nullptr, &vw, mdx, sep ? &mdu : nullptr, &vdw),
            Status::kOk) << last_error();
  const OracleParams op = oracle_params(p);
  std::vector<Ref> ro(F), rg(F), ru(F);
  for (int64_t r = 0; r < R; ++r) {
    Ref rw;
    oracle_forward_row(op, &g[r * F], &u[r * F], w[r], F, ro.data());
    oracle_backward_row(op, &g[r * F], &u[r * F], &dy[r * F], w[r], F, rg.data(), ru.data(), &rw);
    for (int64_t c = 0; c < F; ++c) {
      expect_close("out", r * F + c, out[r * F + c], ro[c]);
      expect_close("grad_gate", r * F + c, dx[gi(r, c)], rg[c]);
      expect_close("grad_up", r * F + c, (sep ? du : dx)[ui(r, c)], ru[c]);
    }
    // The weight gradient is stored as float32: one float32 rounding of the float64 sum.
    if (std::isnan(rw.v)) {
      EXPECT_TRUE(std::isnan(dw[r])) << "grad_weights[" << r << "]";
    } else {
      EXPECT_NEAR(dw[r], rw.v, std::fabs(rw.v) * 1.2e-7 + std::ldexp(rw.e, -29) * 64 + 1e-30)
          << "grad_weights[" << r << "]";
    }
  }
  // In-place: gradients written over the inputs equal the out-of-place ones, bit for bit.
  std::vector<double> x2 = x, xu2 = xu;
  MatrixRef mx2 = mref(x2.data(), xc), mu2 = mref(xu2.data(), F);
  ASSERT_EQ(glu_backward(p, L, md, mx2, sep ? &mu2 : nullptr, &vw, mx2, sep ? &mu2 : nullptr, nullptr),
            Status::kOk) << last_error();
  for (int64_t i = 0; i < R * xc; ++i)
    EXPECT_EQ(std::memcmp(&x2[i], &dx[i], sizeof(double)), 0) << "in-place grad_x[" << i << "]";
  for (size_t i = 0; i < xu2.size(); ++i)
    EXPECT_EQ(std::memcmp(&xu2[i], &du[i], sizeof(double)), 0) << "in-place grad_up[" << i << "]";
}

INSTANTIATE_TEST_SUITE_P(Cpu, Float64,
                         ::testing::Combine(::testing::Range(0, 5), ::testing::Range(0, 4)));

TEST(Float64Refusals, CudaTensorIsUnsupported) {
  double buf[8] = {0}, obuf[4] = {0};
  MatrixRef m;
  m.data = buf, m.rows = 2, m.cols = 4, m.row_stride = 4, m.dtype = DType::kFloat64;
  m.device = DeviceType::kCUDA;
  MatrixRef o = m;
  o.data = obuf, o.cols = 2, o.row_stride = 2;
  // Refused before any pointer is touched, with or without a CUDA path.
  const Status s = glu_forward(preset_swiglu(), Layout::kHalves, m, nullptr, nullptr, o);
  EXPECT_EQ(s, Status::kUnsupported);
  EXPECT_NE(std::string(last_error()).find("float64"), std::string::npos) << last_error();
}

// F == 0 with weights: no element to read, but the per-row weight gradient is still owed
// (a sum over an empty row: +0), written by the float64 launcher at its stride only.
TEST(Float64, ZeroWidthRowsGiveZeroWeightGradients) {
  const int64_t rows = 4;
  float w[rows] = {0.5f, 1.5f, -2.0f, 3.0f};
  float gw[2 * rows];
  std::memset(gw, 0xFF, sizeof(gw));
  MatrixRef x;
  x.data = nullptr, x.rows = rows, x.cols = 0, x.row_stride = 0, x.dtype = DType::kFloat64;
  VectorRef wv, gwv;
  wv.data = w, wv.size = rows, wv.stride = 1;
  gwv.data = gw, gwv.size = rows, gwv.stride = 2;
  ASSERT_EQ(glu_backward(preset_swiglu(), Layout::kHalves, x, x, nullptr, &wv, x, nullptr, &gwv), Status::kOk)
      << last_error();
  for (int64_t i = 0; i < 2 * rows; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &gw[i], 4);
    if (i % 2 == 0) {
      EXPECT_EQ(bits, 0u) << "grad_weights[" << i / 2 << "] must be +0";
    } else {
      EXPECT_EQ(bits, 0xFFFFFFFFu) << "element " << i << " between strided entries was written";
    }
  }
}

TEST(Float64Refusals, MixedWithFloat32) {
  double g[4] = {1, 2, 3, 4};
  float u[4] = {1, 2, 3, 4};
  double o[4];
  MatrixRef mg, mu, mo;
  mg.data = g, mg.rows = 1, mg.cols = 4, mg.row_stride = 4, mg.dtype = DType::kFloat64;
  mu = mg, mu.data = u, mu.dtype = DType::kFloat32;
  mo = mg, mo.data = o;
  EXPECT_EQ(glu_forward(preset_swiglu(), Layout::kSeparate, mg, &mu, nullptr, mo),
            Status::kInvalidDtype);
  EXPECT_NE(std::string(last_error()).find("float64"), std::string::npos) << last_error();
}

TEST(Float64CAbi, ForwardThroughDLTensor) {
  double gu[2][6] = {{-1, 0.5, 2, 3, -4, 0.25}, {7, 8, -9, 1, 1, 1}};
  double out[2][3];
  int64_t xs[2] = {2, 6}, os[2] = {2, 3};
  DLTensor xd{gu, {kDLCPU, 0}, 2, {kDLFloat, 64, 1}, xs, nullptr, 0};
  DLTensor od{out, {kDLCPU, 0}, 2, {kDLFloat, 64, 1}, os, nullptr, 0};
  expertact_tensor x, o;
  ASSERT_EQ(expertact_tensor_from_dlpack(&xd, &x), EXPERTACT_OK) << expertact_last_error();
  ASSERT_EQ(expertact_tensor_from_dlpack(&od, &o), EXPERTACT_OK) << expertact_last_error();
  expertact_params prm;
  ASSERT_EQ(expertact_preset("swiglu", NAN, NAN, &prm), EXPERTACT_OK);
  ASSERT_EQ(expertact_glu_forward(&prm, EXPERTACT_LAYOUT_HALVES, &x, nullptr, nullptr, &o, nullptr),
            EXPERTACT_OK)
      << expertact_last_error();
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 3; ++c) {
      const double g = gu[r][c], u = gu[r][3 + c];
      EXPECT_NEAR(out[r][c], g / (1 + std::exp(-g)) * u, 1e-14 * (1 + std::fabs(g * u)));
    }
}

}  // namespace
}  // namespace eat
