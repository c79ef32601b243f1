// The FP8 activation quantised per expert and column (expertact_fp8_glu_colwise_grouped and
// expertact::fp8_glu_colwise_grouped): bit for bit the q_t bytes and scales of the activation's
// forward (expertact_glu_forward / _bias) followed by expertact_fp8_quantize_rowwise's
// column amax and expertact_fp8_quantize_colwise_grouped, for each dtype, layout, with and
// without bias and padding (empty experts, rows past the last offset, a NaN row); outputs
// poisoned differently beforehand, so an unwritten byte shows. Then the refusals, each naming
// its argument. Every data test runs on each backend (CPU; CUDA when built and a GPU is present).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "expertact/expertact.hpp"
#include "expertact/expertact_c.h"
#include "support/backend.h"
#include "support/buffers.h"
#include "support/harness.h"
#include "support/numeric.h"

namespace eat {
namespace {

class Fp8GluColwise : public ::testing::TestWithParam<BackendKind> {};

TEST_P(Fp8GluColwise, MatchesForwardThenColwise) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  // Experts 0 and 2 empty, 9 rows past the last offset; padded to 16: blocks of 0, 32, 0, 48.
  const int64_t T = 70, F = 24, E = 4;
  const std::vector<int32_t> ends = {0, 20, 20, 61}, pads16 = {0, 32, 32, 80};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  expertact_params p;
  ASSERT_EQ(expertact_preset("swiglu_oai", 1.5f, 5.0f, &p), EXPERTACT_OK);
  expertact::GluParams gp = expertact::preset_swiglu_oai(1.5f, 5.0f);
  Ints offs(be, ends), pads(be, pads16);
  const auto ov = offs.c_ref(be), pv = pads.c_ref(be);
  std::vector<float> w(T);
  for (int64_t r = 0; r < T; ++r) w[r] = 0.25f + 0.01f * static_cast<float>(r % 50);
  Mat W(be, DType::kFloat32, T, 1, w);
  const expertact_tensor wv{W.d->data(), T, 1, 1, DLDataType{kDLFloat, 32, 1}, be.dl_device()};
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Layout layout : all_layouts()) {
      for (bool biased : {false, true}) {
        for (bool padded : {false, true}) {
          SCOPED_TRACE(std::string(dtype_name(dt)) + " " + layout_name(layout) + (biased ? " bias" : "") +
                       (padded ? " padded" : ""));
          const bool sep = layout == Layout::kSeparate;
          auto z = randn(T * 2 * F, 1 + static_cast<unsigned>(layout), 3.0f);
          z[30 * 2 * F + 5] = nan;  // a NaN in one row of expert 3
          std::vector<float> zg(T * F), zu(T * F);
          for (int64_t r = 0; r < T; ++r)
            for (int64_t j = 0; j < F; ++j) {
              zg[r * F + j] = z[r * 2 * F + j];
              zu[r * F + j] = z[r * 2 * F + F + j];
            }
          Mat X(be, dt, T, sep ? F : 2 * F, sep ? zg : z), U(be, dt, T, F, zu), B(be, dt, E, 2 * F, randn(E * 2 * F, 9, 2.0f));
          const auto xm = X.c_ref(be), um = U.c_ref(be), bm = B.c_ref(be);
          const expertact_tensor* up = sep ? &um : nullptr;
          const int32_t code = static_cast<int32_t>(layout);
          // the reference: forward, rowwise (for the column amax), colwise with that amax
          Mat H(be, dt, T, F, uint8_t{0}), Q(be, DType::kFloat8E4M3, T, F, uint8_t{0}),
              S(be, DType::kFloat32, T, 1, uint8_t{0}), A(be, DType::kFloat32, E, F, uint8_t{0xFF});
          auto hm = H.c_ref(be), qm = Q.c_ref(be), am = A.c_ref(be);
          expertact_tensor sv{S.d->data(), T, 1, 1, DLDataType{kDLFloat, 32, 1}, be.dl_device()};
          ASSERT_EQ(biased ? expertact_glu_forward_bias(&p, code, &xm, up, &wv, &bm, &ov, &hm, be.stream())
                           : expertact_glu_forward(&p, code, &xm, up, &wv, &hm, be.stream()),
                    EXPERTACT_OK) << expertact_last_error();
          ASSERT_EQ(expertact_fp8_quantize_rowwise(&hm, &qm, &sv, &ov, &am, be.stream()), EXPERTACT_OK)
              << expertact_last_error();
          const int64_t cols = padded ? pads16.back() : T;
          Mat RQ(be, DType::kFloat8E4M3, F, cols, uint8_t{0x55}), RS(be, DType::kFloat32, E, F, uint8_t{0xFF});
          auto rqm = RQ.c_ref(be), rsm = RS.c_ref(be);
          ASSERT_EQ(expertact_fp8_quantize_colwise_grouped(&hm, &ov, padded ? &pv : nullptr, &rqm, &rsm, &am,
                                                              be.stream()),
                    EXPERTACT_OK) << expertact_last_error();
          be.finish("reference");
          const auto rq = RQ.bytes(), rs = RS.bytes();
          // the C entry
          Mat CQ(be, DType::kFloat8E4M3, F, cols, uint8_t{0xAA}), CS(be, DType::kFloat32, E, F, uint8_t{0x7B});
          auto cqm = CQ.c_ref(be), csm = CS.c_ref(be);
          ASSERT_EQ(expertact_fp8_glu_colwise_grouped(&p, code, &xm, up, &wv, biased ? &bm : nullptr, &ov,
                                                         padded ? &pv : nullptr, &cqm, &csm, &am, be.stream()),
                    EXPERTACT_OK) << expertact_last_error();
          be.finish("expertact_fp8_glu_colwise_grouped");
          EXPECT_EQ(CQ.bytes(), rq) << "q_t";
          EXPECT_EQ(CS.bytes(), rs) << "scale";
          // the C++ entry
          Mat PQ(be, DType::kFloat8E4M3, F, cols, uint8_t{0x33}), PS(be, DType::kFloat32, E, F, uint8_t{0xFF});
          const auto xr = X.ref(be), ur = U.ref(be), br = B.ref(be), ar = A.ref(be);
          const expertact::VectorRef wr{static_cast<float*>(static_cast<void*>(W.d->data())), T, 1, be.device(),
                                        be.device_id()};
          const auto orf = offs.ref(be), prf = pads.ref(be);
          ASSERT_EQ(expertact::fp8_glu_colwise_grouped(gp, layout, xr, sep ? &ur : nullptr, &wr, biased ? &br : nullptr,
                                                      orf, padded ? &prf : nullptr, PQ.ref(be), PS.ref(be), ar,
                                                      be.stream()),
                    Status::kOk) << expertact::last_error();
          be.finish("expertact::fp8_glu_colwise_grouped");
          EXPECT_EQ(PQ.bytes(), rq) << "q_t";
          EXPECT_EQ(PS.bytes(), rs) << "scale";
          // the padding and the columns past the last offset are zeros
          for (int64_t j = 0; j < F; ++j) {
            const int64_t zero_from = padded ? 32 + 41 : 61;
            for (int64_t k = zero_from; k < cols; ++k) {
              ASSERT_EQ(rq[j * cols + k], 0) << j << " " << k;
            }
            for (int64_t k = 20; padded && k < 32; ++k) {
              ASSERT_EQ(rq[j * cols + k], 0) << j << " " << k;
            }
          }
        }
      }
    }
  }
}

TEST_P(Fp8GluColwise, Refusals) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  const int64_t T = 10, F = 4, E = 2;
  expertact_params p;
  ASSERT_EQ(expertact_preset("swiglu", NAN, NAN, &p), EXPERTACT_OK);
  Mat X(be, DType::kBFloat16, T, 2 * F, randn(T * 2 * F, 3, 1.0f)), B(be, DType::kBFloat16, E, 2 * F, uint8_t{0}),
      Q(be, DType::kFloat8E4M3, F, T, uint8_t{0}), S(be, DType::kFloat32, E, F, uint8_t{0}),
      A(be, DType::kFloat32, E, F, uint8_t{0});
  Ints offs(be, {4, 10});
  auto x = X.c_ref(be), b = B.c_ref(be), q = Q.c_ref(be), s = S.c_ref(be), a = A.c_ref(be);
  const auto ov = offs.c_ref(be);
  auto expect_refused = [&](expertact_status want, const expertact_tensor* xx, const expertact_tensor* bb,
                            const expertact_tensor* oo, const expertact_tensor* qq, const expertact_tensor* ss,
                            const expertact_tensor* aa, const char* needle) {
    expertact_tensor q2 = *qq, s2 = *ss;
    EXPECT_EQ(expertact_fp8_glu_colwise_grouped(&p, EXPERTACT_LAYOUT_HALVES, xx, nullptr, nullptr, bb, oo, nullptr,
                                                   &q2, &s2, aa, be.stream()),
              want) << needle;
    EXPECT_NE(std::string(expertact_last_error()).find(needle), std::string::npos) << expertact_last_error();
  };
  ASSERT_EQ(expertact_fp8_glu_colwise_grouped(&p, EXPERTACT_LAYOUT_HALVES, &x, nullptr, nullptr, &b, &ov, nullptr,
                                                 &q, &s, &a, be.stream()),
            EXPERTACT_OK) << expertact_last_error();
  be.finish("valid call");
  expect_refused(EXPERTACT_INVALID_ARGUMENT, &x, nullptr, &ov, &q, &s, nullptr, "amax is null: it is required");
  expertact_tensor a_wide = a;
  a_wide.cols = 2 * F;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, &x, nullptr, &ov, &q, &s, &a_wide, "amax");
  expertact_tensor a_half = a;
  a_half.dtype = DLDataType{kDLFloat, 16, 1};
  expect_refused(EXPERTACT_INVALID_DTYPE, &x, nullptr, &ov, &q, &s, &a_half, "amax");
  expect_refused(EXPERTACT_INVALID_ARGUMENT, &x, nullptr, nullptr, &q, &s, &a, "offsets is null");
  expertact_tensor q_bad = q;
  q_bad.cols = T - 1;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, &x, nullptr, &ov, &q_bad, &s, &a, "q_t");
  expertact_tensor q_f32 = q;
  q_f32.dtype = DLDataType{kDLFloat, 32, 1};
  // float32 [F, T]: refused by its dtype before anything is written
  expect_refused(EXPERTACT_INVALID_DTYPE, &x, nullptr, &ov, &q_f32, &s, &a, "q_t.dtype");
  expertact_tensor s_bad = s;
  s_bad.rows = E + 1;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, &x, nullptr, &ov, &q, &s_bad, &a, "scale");
  expertact_tensor b_bad = b;
  b_bad.cols = F;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, &x, &b_bad, &ov, &q, &s, &a, "bias");
  // an output over an input: scale written over amax
  expect_refused(EXPERTACT_INVALID_ARGUMENT, &x, nullptr, &ov, &q, &s, &s, "scale");
  if (be.device() == expertact::DeviceType::kCPU) {
    Ints bad(be, {6, 4});
    const auto bo = bad.c_ref(be);
    expect_refused(EXPERTACT_INVALID_ARGUMENT, &x, nullptr, &bo, &q, &s, &a, "non-decreasing");
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Fp8GluColwise, ::testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace eat
