// The per-expert biases through the C ABI (expertact_*_bias): results against a float64
// oracle written here, outputs poisoned with NaN beforehand (an element left unwritten
// shows), bias gradients bit-identical across two runs, rows past the last offset, and the
// refusals naming their argument. Every data test runs on each backend (CPU; CUDA when
// built and a GPU is present).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "expertact/expertact_c.h"
#include "support/backend.h"

namespace eat {
namespace {

// float32 host data mirrored on a backend.
struct Buf {
  std::unique_ptr<DeviceBuffer> d;
  std::vector<float> h;
  Buf(Backend& be, std::vector<float> v) : h(std::move(v)) {
    d = std::make_unique<DeviceBuffer>(be, std::max<size_t>(h.size(), 1) * 4);
    std::memcpy(d->image.data(), h.data(), h.size() * 4);
    d->upload();
  }
  std::vector<float> get() {
    d->download();
    std::vector<float> out(h.size());
    std::memcpy(out.data(), d->image.data(), h.size() * 4);
    return out;
  }
};

struct IntBuf {
  std::unique_ptr<DeviceBuffer> d;
  int64_t n;
  IntBuf(Backend& be, const std::vector<int32_t>& v) : n(static_cast<int64_t>(v.size())) {
    d = std::make_unique<DeviceBuffer>(be, v.size() * 4);
    std::memcpy(d->image.data(), v.data(), v.size() * 4);
    d->upload();
  }
};

expertact_tensor mat(Backend& be, Buf& b, int64_t rows, int64_t cols) {
  return expertact_tensor{b.d->data(), rows, cols, cols, DLDataType{kDLFloat, 32, 1}, be.dl_device()};
}
expertact_tensor vec(Backend& be, Buf& b, int64_t n) {
  return expertact_tensor{b.d->data(), n, 1, 1, DLDataType{kDLFloat, 32, 1}, be.dl_device()};
}
expertact_tensor offs(Backend& be, IntBuf& b) {
  return expertact_tensor{b.d->data(), b.n, 1, 1, DLDataType{kDLInt, 32, 1}, be.dl_device()};
}

std::vector<float> randn(size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

int expert_of(const std::vector<int32_t>& o, int64_t r) {
  int e = 0;
  while (e < static_cast<int>(o.size()) && o[e] <= r) ++e;
  return e;
}

// swiglu_oai in float64: g * sigmoid(alpha g) * (clamp(u) + 1), g = min(gate, L).
struct Oai {
  double alpha = 1.702, L = 7.0;
  double fwd(double g, double u) const {
    const double gc = std::min(g, L), uc = std::max(-L, std::min(u, L));
    return gc / (1 + std::exp(-alpha * gc)) * (uc + 1);
  }
  void bwd(double g, double u, double dy, double& dg, double& du, double& dw) const {
    const double gc = std::min(g, L), uc = std::max(-L, std::min(u, L));
    const double s = 1 / (1 + std::exp(-alpha * gc)), a = gc * s;
    const double da = s * (1 + alpha * gc * (1 - s));
    dg = g <= L ? dy * (uc + 1) * da : 0.0;
    du = (u >= -L && u <= L) ? dy * a : 0.0;
    dw = dy * a * (uc + 1);
  }
};

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << what << "[" << i << "] is NaN (unwritten?)";
    ASSERT_NEAR(got[i], want[i], tol * (1 + std::fabs(want[i]))) << what << "[" << i << "]";
  }
}

class BiasTest : public ::testing::TestWithParam<BackendKind> {};

TEST_P(BiasTest, GluBiasAgainstFloat64) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  const int64_t T = 900, F = 24, E = 4;
  const std::vector<int32_t> o = {100, 100, 530, 880};  // an empty expert; 20 rows past the end
  for (int32_t layout : {EXPERTACT_LAYOUT_HALVES, EXPERTACT_LAYOUT_INTERLEAVED}) {
    auto gu = randn(T * 2 * F, 1, 3.0f), b = randn(E * 2 * F, 2), dyv = randn(T * F, 3);
    std::vector<float> w(T);
    for (int64_t r = 0; r < T; ++r) w[r] = 0.25f + 0.001f * static_cast<float>(r % 500);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    Buf X(be, gu), B(be, b), W(be, w), DY(be, dyv), OUT(be, std::vector<float>(T * F, nan)),
        GX(be, std::vector<float>(T * 2 * F, nan)), GW(be, std::vector<float>(T, nan)),
        GB(be, std::vector<float>(E * 2 * F, nan));
    IntBuf OF(be, o);
    expertact_params p;
    ASSERT_EQ(expertact_preset("swiglu_oai", NAN, NAN, &p), EXPERTACT_OK);
    auto x = mat(be, X, T, 2 * F), bias = mat(be, B, E, 2 * F), out = mat(be, OUT, T, F),
         dy = mat(be, DY, T, F), gx = mat(be, GX, T, 2 * F), gb = mat(be, GB, E, 2 * F);
    auto wv = vec(be, W, T), gwv = vec(be, GW, T);
    auto ov = offs(be, OF);
    ASSERT_EQ(expertact_glu_forward_bias(&p, layout, &x, nullptr, &wv, &bias, &ov, &out, be.stream()),
              EXPERTACT_OK) << expertact_last_error();
    be.finish("forward");
    const size_t wsb = expertact_glu_bias_workspace_bytes(T, F, E);
    DeviceBuffer ws(be, wsb);
    auto run_bwd = [&] {
      ASSERT_EQ(expertact_glu_backward_bias(&p, layout, &dy, &x, nullptr, &wv, &bias, &ov, &gx, nullptr,
                                               &gwv, &gb, ws.data(), wsb, be.stream()),
                EXPERTACT_OK) << expertact_last_error();
      be.finish("backward");
    };
    run_bwd();
    // the oracle
    std::vector<double> ro(T * F), rgx(T * 2 * F), rgw(T), rgb(E * 2 * F, 0.0);
    const Oai act;
    for (int64_t r = 0; r < T; ++r) {
      const int e = expert_of(o, r);
      for (int64_t j = 0; j < F; ++j) {
        const int64_t gi = layout == EXPERTACT_LAYOUT_INTERLEAVED ? 2 * j : j;
        const int64_t ui = layout == EXPERTACT_LAYOUT_INTERLEAVED ? 2 * j + 1 : F + j;
        const double g = gu[r * 2 * F + gi] + (e < E ? b[e * 2 * F + gi] : 0.0);
        const double u = gu[r * 2 * F + ui] + (e < E ? b[e * 2 * F + ui] : 0.0);
        ro[r * F + j] = act.fwd(g, u) * w[r];
        double dg, du, dwt;
        act.bwd(g, u, dyv[r * F + j], dg, du, dwt);
        rgx[r * 2 * F + gi] = dg * w[r];
        rgx[r * 2 * F + ui] = du * w[r];
        rgw[r] += dwt;
        if (e < E) {
          rgb[e * 2 * F + gi] += dg * w[r];
          rgb[e * 2 * F + ui] += du * w[r];
        }
      }
    }
    expect_close(OUT.get(), ro, 1e-5, "out");
    expect_close(GX.get(), rgx, 1e-5, "grad_x");
    expect_close(GW.get(), rgw, 1e-4, "grad_weights");
    const auto gb1 = GB.get();
    expect_close(gb1, rgb, 1e-4, "grad_bias");
    for (int64_t c = 0; c < 2 * F; ++c) EXPECT_EQ(gb1[1 * 2 * F + c], 0.0f) << "empty expert";
    run_bwd();
    const auto gb2 = GB.get();
    EXPECT_EQ(0, std::memcmp(gb1.data(), gb2.data(), gb1.size() * 4)) << "bias gradient differs between runs";
  }
}

TEST_P(BiasTest, ExpertBiasAgainstFloat64) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  const int64_t T = 1500, C = 40, E = 3;
  const std::vector<int32_t> o = {0, 700, 1490};
  auto xv = randn(T * C, 4), b = randn(E * C, 5), dyv = randn(T * C, 6);
  std::vector<float> w(T);
  for (int64_t r = 0; r < T; ++r) w[r] = 0.5f + 0.0003f * static_cast<float>(r);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Buf X(be, xv), B(be, b), W(be, w), DY(be, dyv), GW(be, std::vector<float>(T, nan)),
      GB(be, std::vector<float>(E * C, nan));
  IntBuf OF(be, o);
  auto x = mat(be, X, T, C), bias = mat(be, B, E, C), dy = mat(be, DY, T, C), gb = mat(be, GB, E, C);
  auto wv = vec(be, W, T), gwv = vec(be, GW, T);
  auto ov = offs(be, OF);
  // in place: out describes x
  ASSERT_EQ(expertact_expert_bias_forward(&x, &bias, &ov, &wv, &x, be.stream()), EXPERTACT_OK)
      << expertact_last_error();
  be.finish("forward");
  const size_t wsb = expertact_expert_bias_workspace_bytes(T, C, E);
  DeviceBuffer ws(be, wsb);
  ASSERT_EQ(expertact_expert_bias_backward(&dy, &bias, &ov, &wv, &gb, &gwv, ws.data(), wsb, be.stream()),
            EXPERTACT_OK) << expertact_last_error();
  be.finish("backward");
  std::vector<double> ry(T * C), rgw(T, 0.0), rgb(E * C, 0.0);
  for (int64_t r = 0; r < T; ++r) {
    const int e = expert_of(o, r);
    for (int64_t c = 0; c < C; ++c) {
      ry[r * C + c] = xv[r * C + c] + (e < E ? double(w[r]) * b[e * C + c] : 0.0);
      if (e < E) {
        rgw[r] += double(dyv[r * C + c]) * b[e * C + c];
        rgb[e * C + c] += double(w[r]) * dyv[r * C + c];
      }
    }
  }
  expect_close(X.get(), ry, 1e-6, "out");
  expect_close(GW.get(), rgw, 1e-5, "grad_weights");
  expect_close(GB.get(), rgb, 1e-4, "grad_bias");
  for (int64_t c = 0; c < C; ++c) EXPECT_EQ(GB.get()[c], 0.0f) << "expert 0 has no rows";
}

TEST_P(BiasTest, Refusals) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  const int64_t T = 10, F = 4, E = 2;
  Buf X(be, randn(T * 2 * F, 7)), B(be, randn(E * 2 * F, 8)), OUT(be, std::vector<float>(T * F)),
      DY(be, randn(T * F, 9)), GX(be, std::vector<float>(T * 2 * F));
  IntBuf OF(be, {4, 10});
  expertact_params p;
  ASSERT_EQ(expertact_preset("swiglu", NAN, NAN, &p), EXPERTACT_OK);
  auto x = mat(be, X, T, 2 * F), out = mat(be, OUT, T, F), dy = mat(be, DY, T, F), gx = mat(be, GX, T, 2 * F);
  auto ov = offs(be, OF);
  auto bad_bias = mat(be, B, E, 2 * F - 2);
  EXPECT_EQ(expertact_glu_forward_bias(&p, 1, &x, nullptr, nullptr, &bad_bias, &ov, &out, be.stream()),
            EXPERTACT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(expertact_last_error()).find("bias"), std::string::npos) << expertact_last_error();
  auto bias = mat(be, B, E, 2 * F);
  auto of64 = ov;
  of64.dtype = DLDataType{kDLInt, 64, 1};
  EXPECT_EQ(expertact_glu_forward_bias(&p, 1, &x, nullptr, nullptr, &bias, &of64, &out, be.stream()),
            EXPERTACT_INVALID_DTYPE);
  EXPECT_NE(std::string(expertact_last_error()).find("offsets"), std::string::npos);
  if (be.device() == expertact::DeviceType::kCPU) {
    IntBuf BAD(be, {6, 4});
    auto bo = offs(be, BAD);
    EXPECT_EQ(expertact_glu_forward_bias(&p, 1, &x, nullptr, nullptr, &bias, &bo, &out, nullptr),
              EXPERTACT_INVALID_ARGUMENT);
    EXPECT_NE(std::string(expertact_last_error()).find("non-decreasing"), std::string::npos);
  } else {
    // the CUDA backward needs its workspace, and says how much
    Buf GB(be, std::vector<float>(E * 2 * F));
    auto gb = mat(be, GB, E, 2 * F);
    EXPECT_EQ(expertact_glu_backward_bias(&p, 1, &dy, &x, nullptr, nullptr, &bias, &ov, &gx, nullptr,
                                             nullptr, &gb, nullptr, 0, be.stream()),
              EXPERTACT_INVALID_ARGUMENT);
    EXPECT_NE(std::string(expertact_last_error()).find("workspace"), std::string::npos);
  }
  // grad_weights without weights
  Buf GW(be, std::vector<float>(T));
  auto gwv = vec(be, GW, T);
  auto bias_d = mat(be, B, E, 2 * F);
  auto yb = mat(be, GX, T, 2 * F);
  EXPECT_EQ(expertact_expert_bias_backward(&yb, &bias_d, &ov, nullptr, nullptr, &gwv, nullptr, 0, be.stream()),
            EXPERTACT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(expertact_last_error()).find("weights"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, BiasTest, ::testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace eat
