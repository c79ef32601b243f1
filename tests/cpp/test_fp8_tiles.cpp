// The blockwise FP8 operands (expertact_fp8_quantize_row_tiles, _column_tiles_grouped, _blocks,
// expertact_fp8_glu_row_tiles, _glu_column_tiles_grouped, _glu_backward_tiles, and their C++
// forms): bytes and scales against a bit-level reference written here (float64 amax and scale,
// the nearest e4m3fn value found among all 256 codes, not the library's conversion), the padding
// and the tiles past the padded end, the activation forms against the activation's own forward
// and backward followed by the plain tile quantisation; then the refusals, every argument named.
// Outputs are poisoned beforehand, so an unwritten byte shows. Every data test runs on each
// backend (CPU; CUDA when built and a GPU is present).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
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

constexpr int64_t kT = 128;
const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();
int64_t tiles(int64_t n) { return (n + kT - 1) / kT; }

// ---- the reference: float64 amax and scale, the nearest e4m3fn code by search ----

double e4m3_value(int code) {  // code 0 .. 126 (non-negative, finite)
  const int e = code >> 3, m = code & 7;
  return e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
}

uint8_t e4m3_of(double x) {  // nearest, ties to the even code; |x| >= 448 -> 448; NaN -> 0x7f
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::min(std::fabs(x), 448.0);
  int best = 0;
  for (int c = 1; c <= 126; ++c) {
    const double dc = std::fabs(e4m3_value(c) - a), db = std::fabs(e4m3_value(best) - a);
    if (dc < db || (dc == db && (c & 1) == 0)) best = c;
  }
  return static_cast<uint8_t>(sign | best);
}

// The multiplier of a tile with amax a (NaN-free): 2^floor(log2(float32(448 / max(a, 1e-12)))).
double scale_ref(double a) {
  const double m = std::max(a, static_cast<double>(1e-12f));
  const float s = static_cast<float>(448.0 / m);
  if (s == 0.0f) return 0.0;
  int e = 0;
  std::frexp(static_cast<double>(s), &e);
  return std::ldexp(1.0, e - 1);
}

// A tile's bytes from its float values v (NaN ignored by the amax), and its scale 1 / s.
float quantize_ref(const std::vector<float>& v, std::vector<uint8_t>& q) {
  double a = 0.0;
  for (float x : v)
    if (!std::isnan(x)) a = std::max(a, std::fabs(static_cast<double>(x)));
  const double s = scale_ref(a);
  q.resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) q[i] = e4m3_of(static_cast<double>(static_cast<float>(v[i] * s)));
  return static_cast<float>(1.0 / s);
}

// Row tiles of x [T, C] (float values): q [T, C] and scale [KB, T].
void row_tiles_ref(const std::vector<float>& x, int64_t T, int64_t C, std::vector<uint8_t>& q, std::vector<float>& s) {
  q.assign(static_cast<size_t>(T * C), 0);
  s.assign(static_cast<size_t>(tiles(C) * T), 0.0f);
  std::vector<uint8_t> tq;
  for (int64_t r = 0; r < T; ++r)
    for (int64_t k = 0; k < tiles(C); ++k) {
      std::vector<float> v(x.begin() + r * C + k * kT, x.begin() + r * C + std::min(C, (k + 1) * kT));
      s[k * T + r] = quantize_ref(v, tq);
      std::copy(tq.begin(), tq.end(), q.begin() + r * C + k * kT);
    }
}

// Column tiles of x [T, C] over ends (q_t [C, Tp] with Tp >= the padded end; scale [Tp / 128, C]).
void column_tiles_ref(const std::vector<float>& x, int64_t C, const std::vector<int32_t>& ends, int64_t Tp,
                      std::vector<uint8_t>& q, std::vector<float>& s) {
  q.assign(static_cast<size_t>(C * Tp), 0);
  s.assign(static_cast<size_t>(Tp / kT * C), 0.0f);
  std::vector<uint8_t> tq;
  int64_t start = 0, pstart = 0;
  for (int32_t end : ends) {
    for (int64_t t0 = start; t0 < end; t0 += kT, pstart += kT)
      for (int64_t c = 0; c < C; ++c) {
        std::vector<float> v;
        for (int64_t r = t0; r < std::min<int64_t>(end, t0 + kT); ++r) v.push_back(x[r * C + c]);
        s[pstart / kT * C + c] = quantize_ref(v, tq);
        std::copy(tq.begin(), tq.end(), q.begin() + c * Tp + pstart);
      }
    start = end;
  }
  for (int64_t j = pstart / kT; j < Tp / kT; ++j)  // past the padded end: all-zero tiles
    for (int64_t c = 0; c < C; ++c) s[j * C + c] = static_cast<float>(1.0 / scale_ref(0.0));
}

std::vector<int32_t> padded_of(const std::vector<int32_t>& ends) {
  std::vector<int32_t> p;
  int64_t prev = 0, acc = 0;
  for (int32_t e : ends) {
    acc += tiles(e - prev) * kT;
    p.push_back(static_cast<int32_t>(acc));
    prev = e;
  }
  return p;
}

// Values with specials: an all-zero tile, +-448, NaN, +-inf, many binades.
std::vector<float> specials(int64_t T, int64_t C, unsigned seed) {
  std::vector<float> v = randn(static_cast<size_t>(T * C), seed, 1.0f);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t c = 0; c < C; ++c) v[r * C + c] *= std::ldexp(1.0f, static_cast<int>(r % 23) - 12);
  for (int64_t c = 0; c < std::min<int64_t>(C, kT); ++c) v[1 * C + c] = 0.0f;
  v[2 * C] = 448.0f;
  v[2 * C + C - 1] = -448.0f;
  v[3 * C + C / 2] = kNan;
  v[4 * C + C - 1] = kInf;
  v[5 * C] = -kInf;
  return v;
}

// The float values x holds once stored in dtype d (what the kernels read).
std::vector<float> as_stored(DType d, std::vector<float> v) {
  for (auto& x : v) x = static_cast<float>(round_to(d, x));
  return v;
}

std::vector<uint8_t> float_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

class Fp8Tiles : public ::testing::TestWithParam<BackendKind> {};

TEST_P(Fp8Tiles, RowAndColumnTilesAgainstReference) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  // Experts of 0, 1, 127, 128, 0, 129 rows, 9 rows past the last offset; Tp one tile past the
  // padded end (written as an all-zero tile).
  const std::vector<int32_t> ends = {0, 1, 128, 256, 256, 385};
  const std::vector<int32_t> pads = padded_of(ends);
  const int64_t T = 394, Tp = pads.back() + kT;
  Ints offs(be, ends), pad(be, pads);
  const auto ov = offs.c_ref(be), pv = pad.c_ref(be);
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t C : {1, 100, 128, 257}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " C=" + std::to_string(C));
      const std::vector<float> x = as_stored(dt, specials(T, C, static_cast<unsigned>(C)));
      Mat X(be, dt, T, C, x);
      const auto xv = X.c_ref(be);
      std::vector<uint8_t> rq, cq;
      std::vector<float> rs, cs;
      row_tiles_ref(x, T, C, rq, rs);
      column_tiles_ref(x, C, ends, Tp, cq, cs);
      Mat Q(be, DType::kFloat8E4M3, T, C, uint8_t{0xAA}), S(be, DType::kFloat32, tiles(C), T, uint8_t{0x7B});
      auto qv = Q.c_ref(be), sv = S.c_ref(be);
      ASSERT_EQ(expertact_fp8_quantize_row_tiles(&xv, &qv, &sv, be.stream()), EXPERTACT_OK) << expertact_last_error();
      be.finish("expertact_fp8_quantize_row_tiles");
      EXPECT_EQ(Q.bytes(), rq);
      EXPECT_EQ(S.bytes(), float_bytes(rs));
      // column tiles, then with the row tiles from the same read (the C++ form)
      Mat QT(be, DType::kFloat8E4M3, C, Tp, uint8_t{0x55}), CS(be, DType::kFloat32, Tp / kT, C, uint8_t{0xFF});
      auto qtv = QT.c_ref(be), csv = CS.c_ref(be);
      ASSERT_EQ(expertact_fp8_quantize_column_tiles_grouped(&xv, &ov, &pv, &qtv, &csv, nullptr, nullptr, be.stream()),
                EXPERTACT_OK) << expertact_last_error();
      be.finish("expertact_fp8_quantize_column_tiles_grouped");
      EXPECT_EQ(QT.bytes(), cq);
      EXPECT_EQ(CS.bytes(), float_bytes(cs));
      Mat QT2(be, DType::kFloat8E4M3, C, Tp, uint8_t{0x11}), CS2(be, DType::kFloat32, Tp / kT, C, uint8_t{0x22}),
          Q2(be, DType::kFloat8E4M3, T, C, uint8_t{0x33}), S2(be, DType::kFloat32, tiles(C), T, uint8_t{0x44});
      ASSERT_EQ(expertact::fp8_quantize_column_tiles_grouped(X.ref(be), offs.ref(be), pad.ref(be), QT2.ref(be),
                                                            CS2.ref(be), Q2.ref(be), S2.ref(be), be.stream()),
                Status::kOk) << expertact::last_error();
      be.finish("expertact::fp8_quantize_column_tiles_grouped");
      EXPECT_EQ(QT2.bytes(), cq);
      EXPECT_EQ(CS2.bytes(), float_bytes(cs));
      EXPECT_EQ(Q2.bytes(), rq);
      EXPECT_EQ(S2.bytes(), float_bytes(rs));
    }
  }
}

// q_t as a view into wider rows (the C++ API's and the C ABI's outputs may be any row-strided
// view): its pointer and row stride allow 16-, 8-, 4-byte or only single-byte stores of each
// 16-byte run; every width writes the reference's bytes there and nothing outside the view.
TEST_P(Fp8Tiles, ColumnTilesIntoStridedViews) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  const std::vector<int32_t> ends = {0, 1, 128, 256, 256, 385};
  const std::vector<int32_t> pads = padded_of(ends);
  const int64_t T = 394, Tp = pads.back() + kT, C = 257;
  Ints offs(be, ends), pad(be, pads);
  auto ov = offs.c_ref(be), pv = pad.c_ref(be);
  const std::vector<float> x = as_stored(DType::kBFloat16, specials(T, C, 5u));
  Mat X(be, DType::kBFloat16, T, C, x);
  auto xv = X.c_ref(be);
  std::vector<uint8_t> cq;
  std::vector<float> cs;
  column_tiles_ref(x, C, ends, Tp, cq, cs);
  // (first byte, row stride): 16-byte stores, 8, 4 (pointer or stride), single bytes
  for (const auto& [off, stride] : std::vector<std::pair<int64_t, int64_t>>{
           {0, Tp + 16}, {8, Tp + 24}, {0, Tp + 8}, {4, Tp + 12}, {0, Tp + 4}, {1, Tp + 3}, {3, Tp + 16}}) {
    SCOPED_TRACE("offset " + std::to_string(off) + " stride " + std::to_string(stride));
    const int64_t width = off + (C - 1) * stride + Tp;
    Mat W(be, DType::kFloat8E4M3, 1, width, uint8_t{0x5A}), CS(be, DType::kFloat32, Tp / kT, C, uint8_t{0xFF});
    expertact_tensor qtv{W.d->data() + off, C, Tp, stride, dl_of(DType::kFloat8E4M3), be.dl_device()};
    auto csv = CS.c_ref(be);
    ASSERT_EQ(expertact_fp8_quantize_column_tiles_grouped(&xv, &ov, &pv, &qtv, &csv, nullptr, nullptr, be.stream()),
              EXPERTACT_OK) << expertact_last_error();
    be.finish("expertact_fp8_quantize_column_tiles_grouped");
    const std::vector<uint8_t> got = W.bytes();
    for (int64_t i = 0; i < width; ++i) {
      const int64_t r = (i - off) / stride, c = (i - off) % stride;
      const bool inside = i >= off && c < Tp;
      ASSERT_EQ(got[i], inside ? cq[r * Tp + c] : uint8_t{0x5A}) << "byte " << i << (inside ? " (q_t)" : " (outside)");
    }
    EXPECT_EQ(CS.bytes(), float_bytes(cs));
  }
}

TEST_P(Fp8Tiles, BlocksAgainstReference) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  const int64_t E = 2, R = 129, C = 300, RB = tiles(R), CB = tiles(C);
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (bool transposed : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (transposed ? " transposed" : ""));
      // w [E, R, C]; transposed: stored as [E, C, R] and read through strides (C R, 1, R)
      const std::vector<float> w = as_stored(dt, specials(E * R, C, 7));
      std::vector<float> stored(w.size());
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < C; ++c)
            stored[transposed ? (e * C + c) * R + r : (e * R + r) * C + c] = w[(e * R + r) * C + c];
      Mat W(be, dt, E * R, C, stored);
      int64_t shape[3] = {E, R, C};
      int64_t strides[3] = {R * C, transposed ? 1 : C, transposed ? R : 1};
      DLTensor dl{W.d->data(), be.dl_device(), 3, dl_of(dt), shape, strides, 0};
      Mat Q(be, DType::kFloat8E4M3, E * R, C, uint8_t{0x66}), S(be, DType::kFloat32, E * RB, CB, uint8_t{0x77});
      auto qv = Q.c_ref(be), sv = S.c_ref(be);
      ASSERT_EQ(expertact_fp8_quantize_blocks(&dl, &qv, &sv, be.stream()), EXPERTACT_OK) << expertact_last_error();
      be.finish("expertact_fp8_quantize_blocks");
      std::vector<uint8_t> rq(static_cast<size_t>(E * R * C)), tq;
      std::vector<float> rs(static_cast<size_t>(E * RB * CB));
      for (int64_t e = 0; e < E; ++e)
        for (int64_t rb = 0; rb < RB; ++rb)
          for (int64_t cb = 0; cb < CB; ++cb) {
            std::vector<float> v;
            for (int64_t r = rb * kT; r < std::min(R, (rb + 1) * kT); ++r)
              for (int64_t c = cb * kT; c < std::min(C, (cb + 1) * kT); ++c) v.push_back(w[(e * R + r) * C + c]);
            rs[(e * RB + rb) * CB + cb] = quantize_ref(v, tq);
            size_t i = 0;
            for (int64_t r = rb * kT; r < std::min(R, (rb + 1) * kT); ++r)
              for (int64_t c = cb * kT; c < std::min(C, (cb + 1) * kT); ++c) rq[(e * R + r) * C + c] = tq[i++];
          }
      EXPECT_EQ(Q.bytes(), rq);
      EXPECT_EQ(S.bytes(), float_bytes(rs));
    }
  }
}

// The activation forms: glu_column_tiles is the forward's output (glu_forward / _bias) followed by
// the column tiles, bit for bit; glu_row_tiles of float32 inputs is the float64 activation's
// reference within one e4m3 step on a small share; the backward's tiles are the reference's of its
// own float32 gradient (grad_gate_up of a float32 call) and that gradient glu_backward's.
TEST_P(Fp8Tiles, ActivationForms) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  const std::vector<int32_t> ends = {0, 20, 20, 150}, pads = padded_of(ends);
  const int64_t T = 161, F = 100, E = 4, Tp = pads.back();
  Ints offs(be, ends), pad(be, pads);
  const auto ov = offs.c_ref(be), pv = pad.c_ref(be);
  expertact_params p;
  ASSERT_EQ(expertact_preset("swiglu_oai", 1.5f, 5.0f, &p), EXPERTACT_OK);
  std::vector<float> wv(T);
  for (int64_t r = 0; r < T; ++r) wv[r] = 0.25f + 0.01f * static_cast<float>(r % 50);
  Mat W(be, DType::kFloat32, T, 1, wv);
  const expertact_tensor w = vec_ref(be, W);
  for (Layout layout : {Layout::kHalves, Layout::kHalvesUpFirst, Layout::kInterleaved}) {
    for (bool biased : {false, true}) {
      SCOPED_TRACE(std::string(layout_name(layout)) + (biased ? " bias" : ""));
      const int32_t code = static_cast<int32_t>(layout);
      auto zv = randn(T * 2 * F, 3 + static_cast<unsigned>(layout), 3.0f);
      zv[30 * 2 * F + 5] = kNan;
      Mat X(be, DType::kFloat32, T, 2 * F, zv), B(be, DType::kFloat32, E, 2 * F, randn(E * 2 * F, 9, 2.0f)),
          DY(be, DType::kFloat32, T, F, randn(T * F, 11, 1.0f));
      const auto xv = X.c_ref(be), bv = B.c_ref(be), dyv = DY.c_ref(be);
      const expertact_tensor* bp = biased ? &bv : nullptr;
      // forward: h, then its column tiles
      Mat H(be, DType::kFloat32, T, F, uint8_t{0});
      auto hv = H.c_ref(be);
      ASSERT_EQ(biased ? expertact_glu_forward_bias(&p, code, &xv, nullptr, &w, &bv, &ov, &hv, be.stream())
                       : expertact_glu_forward(&p, code, &xv, nullptr, &w, &hv, be.stream()),
                EXPERTACT_OK) << expertact_last_error();
      be.finish("forward");
      const std::vector<float> h = H.floats();
      std::vector<uint8_t> cq, rq;
      std::vector<float> cs, rs;
      column_tiles_ref(h, F, ends, Tp, cq, cs);
      Mat QT(be, DType::kFloat8E4M3, F, Tp, uint8_t{0xAB}), CS(be, DType::kFloat32, Tp / kT, F, uint8_t{0xCD});
      auto qtv = QT.c_ref(be), csv = CS.c_ref(be);
      ASSERT_EQ(expertact_fp8_glu_column_tiles_grouped(&p, code, &xv, nullptr, &w, bp, &ov, &pv, &qtv, &csv,
                                                         be.stream()),
                EXPERTACT_OK) << expertact_last_error();
      be.finish("expertact_fp8_glu_column_tiles_grouped");
      EXPECT_EQ(QT.bytes(), cq);
      EXPECT_EQ(CS.bytes(), float_bytes(cs));
      // forward row tiles: within one step of the reference of the same h on a small share
      Mat Q(be, DType::kFloat8E4M3, T, F, uint8_t{0x12}), S(be, DType::kFloat32, tiles(F), T, uint8_t{0x34});
      auto qv = Q.c_ref(be), sv = S.c_ref(be);
      ASSERT_EQ(expertact_fp8_glu_row_tiles(&p, code, &xv, nullptr, &w, bp, biased ? &ov : nullptr, &qv, &sv,
                                              be.stream()),
                EXPERTACT_OK) << expertact_last_error();
      be.finish("expertact_fp8_glu_row_tiles");
      row_tiles_ref(h, T, F, rq, rs);
      const std::vector<uint8_t> got = Q.bytes();
      int64_t differ = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const int a = got[i] & 0x80 ? -(got[i] & 0x7f) : got[i], b = rq[i] & 0x80 ? -(rq[i] & 0x7f) : rq[i];
        ASSERT_LE(std::abs(a - b), 1) << i;
        differ += a != b;
      }
      EXPECT_LE(differ, static_cast<int64_t>(got.size()) / 200);
      // backward, float32: the tiles of its own gradient; that gradient glu_backward's
      Mat G(be, DType::kFloat32, T, 2 * F, uint8_t{0x5A}), BQ(be, DType::kFloat8E4M3, T, 2 * F, uint8_t{0x21}),
          BS(be, DType::kFloat32, tiles(2 * F), T, uint8_t{0x43}), BQT(be, DType::kFloat8E4M3, 2 * F, Tp, uint8_t{0x65}),
          BCS(be, DType::kFloat32, Tp / kT, 2 * F, uint8_t{0x87}), DW(be, DType::kFloat32, T, 1, uint8_t{0x9});
      auto gv = G.c_ref(be), bqv = BQ.c_ref(be), bsv = BS.c_ref(be), bqtv = BQT.c_ref(be), bcsv = BCS.c_ref(be);
      expertact_tensor dwv = vec_ref(be, DW);
      ASSERT_EQ(expertact_fp8_glu_backward_tiles(&p, code, &dyv, &xv, &w, bp, &ov, &pv, &bqv, &bsv, &bqtv, &bcsv, &dwv,
                                                   &gv, be.stream()),
                EXPERTACT_OK) << expertact_last_error();
      be.finish("expertact_fp8_glu_backward_tiles");
      const std::vector<float> g = G.floats();
      row_tiles_ref(g, T, 2 * F, rq, rs);
      column_tiles_ref(g, 2 * F, ends, Tp, cq, cs);
      EXPECT_EQ(BQ.bytes(), rq);
      EXPECT_EQ(BS.bytes(), float_bytes(rs));
      EXPECT_EQ(BQT.bytes(), cq);
      EXPECT_EQ(BCS.bytes(), float_bytes(cs));
      // against glu_backward (_bias): the same math, its kernels' instructions (one ulp apart at most
      // where they contract differently)
      Mat G2(be, DType::kFloat32, T, 2 * F, uint8_t{0}), DW2(be, DType::kFloat32, T, 1, uint8_t{0});
      auto g2v = G2.c_ref(be);
      expertact_tensor dw2v = vec_ref(be, DW2);
      if (biased) {
        ASSERT_EQ(expertact_glu_backward_bias(&p, code, &dyv, &xv, nullptr, &w, &bv, &ov, &g2v, nullptr, &dw2v, nullptr,
                                              nullptr, 0, be.stream()),
                  EXPERTACT_OK) << expertact_last_error();
      } else {
        ASSERT_EQ(expertact_glu_backward(&p, code, &dyv, &xv, nullptr, &w, &g2v, nullptr, &dw2v, be.stream()),
                  EXPERTACT_OK) << expertact_last_error();
      }
      be.finish("glu_backward");
      const std::vector<float> g2 = G2.floats(), dw = DW.floats(), dw2 = DW2.floats();
      double gmax = 0.0;
      for (float v : g2)
        if (std::isfinite(v)) gmax = std::max(gmax, std::fabs(static_cast<double>(v)));
      for (size_t i = 0; i < g.size(); ++i) {
        if (std::isnan(g2[i])) {
          ASSERT_TRUE(std::isnan(g[i])) << i;
          continue;
        }
        ASSERT_NEAR(g[i], g2[i], 1e-5 * std::fabs(g2[i]) + 1e-6 * gmax) << i;
      }
      for (int64_t r = 0; r < T; ++r) {
        if (std::isnan(dw2[r])) continue;
        ASSERT_NEAR(dw[r], dw2[r], 1e-5 * (std::fabs(dw2[r]) + 1.0)) << r;
      }
    }
  }
}

// ---- refusals ----

// Runs a call, expecting `want` and a message holding `needle`.
template <typename Call>
void expect_refused(expertact_status want, const char* needle, Call&& call) {
  EXPECT_EQ(call(), want) << needle;
  EXPECT_NE(std::string(expertact_last_error()).find(needle), std::string::npos)
      << "wanted '" << needle << "' in: " << expertact_last_error();
}

TEST_P(Fp8Tiles, PlainRefusals) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  const bool cpu = be.device() == expertact::DeviceType::kCPU;
  const int64_t T = 10, C = 200;
  Mat X(be, DType::kBFloat16, T, C, randn(T * C, 1, 1.0f)), Q(be, DType::kFloat8E4M3, T, C, uint8_t{0}),
      S(be, DType::kFloat32, 2, T, uint8_t{0}), QT(be, DType::kFloat8E4M3, C, 256, uint8_t{0}),
      CS(be, DType::kFloat32, 2, C, uint8_t{0}), X64(be, DType::kFloat64, T, C, uint8_t{0});
  Ints offs(be, {4, 10}), pad(be, {128, 256});
  const auto x = X.c_ref(be), x64 = X64.c_ref(be), ov = offs.c_ref(be), pv = pad.c_ref(be);
  const auto q = Q.c_ref(be), s = S.c_ref(be), qt = QT.c_ref(be), cs = CS.c_ref(be);
  auto row = [&](const expertact_tensor* xx, expertact_tensor qq, expertact_tensor ss) {
    return expertact_fp8_quantize_row_tiles(xx, &qq, &ss, be.stream());
  };
  auto col = [&](const expertact_tensor* xx, const expertact_tensor* oo, const expertact_tensor* pp, expertact_tensor qq,
                 expertact_tensor ss, expertact_tensor* rq, expertact_tensor* rs) {
    return expertact_fp8_quantize_column_tiles_grouped(xx, oo, pp, &qq, &ss, rq, rs, be.stream());
  };
  ASSERT_EQ(row(&x, q, s), EXPERTACT_OK) << expertact_last_error();
  expertact_tensor q2 = q, s2 = s;
  ASSERT_EQ(col(&x, &ov, &pv, qt, cs, &q2, &s2), EXPERTACT_OK) << expertact_last_error();
  be.finish("valid calls");
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "x is null", [&] { return row(nullptr, q, s); });
  if (cpu) expect_refused(EXPERTACT_INVALID_DTYPE, "x is float64", [&] { return row(&x64, q, s); });
  expertact_tensor bad = q;
  bad.cols = C - 1;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q has shape", [&] { return row(&x, bad, s); });
  bad = q;
  bad.dtype = DLDataType{kDLFloat, 32, 1};
  expect_refused(EXPERTACT_INVALID_DTYPE, "q.dtype", [&] { return row(&x, bad, s); });
  bad = s;
  bad.rows = T, bad.cols = 2, bad.row_stride = 2;  // [T, KB]: the scales are [KB, T]
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "scale has shape [10, 2] but [2, 10]", [&] { return row(&x, q, bad); });
  bad = s;
  bad.dtype = DLDataType{kDLBfloat, 16, 1};
  expect_refused(EXPERTACT_INVALID_DTYPE, "scale.dtype", [&] { return row(&x, q, bad); });
  bad = q;
  bad.data = x.data;  // q over x
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q overlaps x", [&] { return row(&x, bad, s); });
  // column tiles
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "offsets is null", [&] { return col(&x, nullptr, &pv, qt, cs, nullptr, nullptr); });
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "padded_offsets is null",
                 [&] { return col(&x, &ov, nullptr, qt, cs, nullptr, nullptr); });
  Ints pad1(be, {128});
  const auto p1 = pad1.c_ref(be);
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "padded_offsets has 1 elements",
                 [&] { return col(&x, &ov, &p1, qt, cs, nullptr, nullptr); });
  bad = qt;
  bad.cols = 200, bad.row_stride = 200;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "not a multiple of 128", [&] { return col(&x, &ov, &pv, bad, cs, nullptr, nullptr); });
  bad = qt;
  bad.rows = C - 1;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q_t has shape", [&] { return col(&x, &ov, &pv, bad, cs, nullptr, nullptr); });
  bad = cs;
  bad.rows = 3;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "scale has shape", [&] { return col(&x, &ov, &pv, qt, bad, nullptr, nullptr); });
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q and row_scale go together",
                 [&] { return col(&x, &ov, &pv, qt, cs, &q2, nullptr); });
  bad = s;
  bad.cols = T - 1, bad.row_stride = T - 1;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "row_scale has shape", [&] { return col(&x, &ov, &pv, qt, cs, &q2, &bad); });
  bad = q;
  bad.data = qt.data;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "overlaps", [&] { return col(&x, &ov, &pv, qt, cs, &bad, &s2); });
  bad = cs;
  bad.data = qt.data;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "scale overlaps q_t", [&] { return col(&x, &ov, &pv, qt, bad, nullptr, nullptr); });
  if (cpu) {
    Ints dec(be, {6, 4}), past(be, {4, 11}), wrong(be, {128, 384});
    const auto dv = dec.c_ref(be), pa = past.c_ref(be), wv = wrong.c_ref(be);
    expect_refused(EXPERTACT_INVALID_ARGUMENT, "non-decreasing", [&] { return col(&x, &dv, &pv, qt, cs, nullptr, nullptr); });
    expect_refused(EXPERTACT_INVALID_ARGUMENT, "past the last row", [&] { return col(&x, &pa, &pv, qt, cs, nullptr, nullptr); });
    expect_refused(EXPERTACT_INVALID_ARGUMENT, "padded_offsets[1] = 384 but expert 1 has 6 rows",
                   [&] { return col(&x, &ov, &wv, qt, cs, nullptr, nullptr); });
    bad = qt;
    bad.cols = 128, bad.row_stride = 128;
    expertact_tensor cs1 = cs;
    cs1.rows = 1;
    expect_refused(EXPERTACT_INVALID_ARGUMENT, "past q_t's last column", [&] { return col(&x, &ov, &pv, bad, cs1, nullptr, nullptr); });
  }
  // blocks
  int64_t shape[3] = {2, 5, C}, strides[3] = {5 * C, C, 1};
  DLTensor w{X.d->data(), be.dl_device(), 3, dl_of(DType::kBFloat16), shape, strides, 0};
  Mat BQ(be, DType::kFloat8E4M3, 10, C, uint8_t{0}), BS(be, DType::kFloat32, 2, 2, uint8_t{0});
  const auto bq = BQ.c_ref(be), bs = BS.c_ref(be);
  auto blk = [&](const DLTensor* ww, expertact_tensor qq, expertact_tensor ss) {
    return expertact_fp8_quantize_blocks(ww, &qq, &ss, be.stream());
  };
  ASSERT_EQ(blk(&w, bq, bs), EXPERTACT_OK) << expertact_last_error();
  be.finish("blocks");
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "w is null", [&] { return blk(nullptr, bq, bs); });
  DLTensor w2 = w;
  w2.ndim = 2;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "w has 2 dimensions", [&] { return blk(&w2, bq, bs); });
  w2 = w;
  w2.dtype = DLDataType{kDLFloat, 64, 1};
  expect_refused(EXPERTACT_INVALID_DTYPE, "w.dtype", [&] { return blk(&w2, bq, bs); });
  bad = bq;
  bad.rows = 5;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q has shape [5, 200] but [10, 200]", [&] { return blk(&w, bad, bs); });
  bad = bs;
  bad.rows = 1;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "scale has shape [1, 2] but [2, 2]", [&] { return blk(&w, bq, bad); });
  bad = bq;
  bad.data = w.data;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q overlaps w", [&] { return blk(&w, bad, bs); });
}

TEST_P(Fp8Tiles, ActivationRefusals) {
  EAT_REQUIRE_BACKEND(GetParam());
  Backend& be = backend(GetParam());
  const int64_t T = 10, F = 4, E = 2;
  expertact_params p;
  ASSERT_EQ(expertact_preset("swiglu", NAN, NAN, &p), EXPERTACT_OK);
  Mat X(be, DType::kBFloat16, T, 2 * F, randn(T * 2 * F, 3, 1.0f)), B(be, DType::kBFloat16, E, 2 * F, uint8_t{0}),
      DY(be, DType::kBFloat16, T, F, randn(T * F, 4, 1.0f)), Q(be, DType::kFloat8E4M3, T, F, uint8_t{0}),
      S(be, DType::kFloat32, 1, T, uint8_t{0}), QT(be, DType::kFloat8E4M3, F, 256, uint8_t{0}),
      CS(be, DType::kFloat32, 2, F, uint8_t{0}), BQ(be, DType::kFloat8E4M3, T, 2 * F, uint8_t{0}),
      BQT(be, DType::kFloat8E4M3, 2 * F, 256, uint8_t{0}), BCS(be, DType::kFloat32, 2, 2 * F, uint8_t{0}),
      W(be, DType::kFloat32, T, 1, uint8_t{0}), DW(be, DType::kFloat32, T, 1, uint8_t{0});
  Ints offs(be, {4, 10}), pad(be, {128, 256});
  const auto x = X.c_ref(be), b = B.c_ref(be), dy = DY.c_ref(be), ov = offs.c_ref(be), pv = pad.c_ref(be);
  const auto q = Q.c_ref(be), s = S.c_ref(be), qt = QT.c_ref(be), cs = CS.c_ref(be), bq = BQ.c_ref(be),
             bqt = BQT.c_ref(be), bcs = BCS.c_ref(be), w = vec_ref(be, W), dw = vec_ref(be, DW);
  const int32_t H = EXPERTACT_LAYOUT_HALVES;
  auto fwd = [&](int32_t layout, const expertact_tensor* bb, const expertact_tensor* oo, expertact_tensor qq,
                 expertact_tensor ss) {
    return expertact_fp8_glu_row_tiles(&p, layout, &x, nullptr, nullptr, bb, oo, &qq, &ss, be.stream());
  };
  auto colf = [&](const expertact_tensor* bb, const expertact_tensor* oo, const expertact_tensor* pp,
                  expertact_tensor qq, expertact_tensor ss) {
    return expertact_fp8_glu_column_tiles_grouped(&p, H, &x, nullptr, nullptr, bb, oo, pp, &qq, &ss, be.stream());
  };
  auto bwd = [&](int32_t layout, const expertact_tensor* dd, const expertact_tensor* ww, const expertact_tensor* bb,
                 const expertact_tensor* oo, const expertact_tensor* pp, expertact_tensor qq, expertact_tensor* qtt,
                 expertact_tensor* css, expertact_tensor* dww, expertact_tensor* gg) {
    expertact_tensor ss = s;
    ss.cols = T, ss.rows = 1;
    return expertact_fp8_glu_backward_tiles(&p, layout, dd, &x, ww, bb, oo, pp, &qq, &ss, qtt, css, dww, gg,
                                            be.stream());
  };
  expertact_tensor qt2 = bqt, cs2 = bcs, dw2 = dw;
  ASSERT_EQ(fwd(H, &b, &ov, q, s), EXPERTACT_OK) << expertact_last_error();
  ASSERT_EQ(colf(&b, &ov, &pv, qt, cs), EXPERTACT_OK) << expertact_last_error();
  ASSERT_EQ(bwd(H, &dy, &w, &b, &ov, &pv, bq, &qt2, &cs2, &dw2, nullptr), EXPERTACT_OK) << expertact_last_error();
  be.finish("valid calls");
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "layout 7", [&] { return fwd(7, nullptr, nullptr, q, s); });
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "bias and offsets go together", [&] { return fwd(H, &b, nullptr, q, s); });
  expertact_tensor bad = b;
  bad.cols = F, bad.row_stride = F;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "bias has shape", [&] { return fwd(H, &bad, &ov, q, s); });
  bad = q;
  bad.cols = 2 * F, bad.row_stride = 2 * F;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q has shape", [&] { return fwd(H, nullptr, nullptr, bad, s); });
  bad = s;
  bad.rows = 2;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "scale has shape", [&] { return fwd(H, nullptr, nullptr, q, bad); });
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "offsets is null", [&] { return colf(nullptr, nullptr, &pv, qt, cs); });
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "padded_offsets is null", [&] { return colf(nullptr, &ov, nullptr, qt, cs); });
  bad = qt;
  bad.rows = 2 * F;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q_t has shape", [&] { return colf(nullptr, &ov, &pv, bad, cs); });
  bad = b;
  bad.rows = 3;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "bias has shape", [&] { return colf(&bad, &ov, &pv, qt, cs); });
  bad = cs;
  bad.data = x.data;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "scale overlaps gate_up", [&] { return colf(nullptr, &ov, &pv, qt, bad); });
  // backward
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "layout 0 (separate)",
                 [&] { return bwd(EXPERTACT_LAYOUT_SEPARATE, &dy, nullptr, nullptr, nullptr, nullptr, bq, nullptr, nullptr, nullptr, nullptr); });
  expertact_tensor dbad = dy;
  dbad.cols = 2 * F, dbad.row_stride = 2 * F;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "grad_out has shape",
                 [&] { return bwd(H, &dbad, nullptr, nullptr, nullptr, nullptr, bq, nullptr, nullptr, nullptr, nullptr); });
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q_t and col_scale go together",
                 [&] { return bwd(H, &dy, nullptr, nullptr, &ov, &pv, bq, &qt2, nullptr, nullptr, nullptr); });
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "offsets is missing",
                 [&] { return bwd(H, &dy, nullptr, nullptr, nullptr, &pv, bq, &qt2, &cs2, nullptr, nullptr); });
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "padded_offsets is missing",
                 [&] { return bwd(H, &dy, nullptr, nullptr, &ov, nullptr, bq, &qt2, &cs2, nullptr, nullptr); });
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "grad_weights is given but weights is null",
                 [&] { return bwd(H, &dy, nullptr, nullptr, nullptr, nullptr, bq, nullptr, nullptr, &dw2, nullptr); });
  expertact_tensor gin = x;  // the gradient over gate_up: refused (an up column reads its gate after)
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "grad_gate_up overlaps gate_up",
                 [&] { return bwd(H, &dy, nullptr, nullptr, nullptr, nullptr, bq, nullptr, nullptr, nullptr, &gin); });
  bad = bcs;
  bad.cols = F, bad.row_stride = F;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "col_scale has shape",
                 [&] { return bwd(H, &dy, nullptr, nullptr, &ov, &pv, bq, &qt2, &bad, nullptr, nullptr); });
  bad = bq;
  bad.cols = F, bad.row_stride = F;
  expect_refused(EXPERTACT_INVALID_ARGUMENT, "q has shape",
                 [&] { return bwd(H, &dy, nullptr, nullptr, nullptr, nullptr, bad, nullptr, nullptr, nullptr, nullptr); });
}

INSTANTIATE_TEST_SUITE_P(Backends, Fp8Tiles, ::testing::Values(BackendKind::kCpu, BackendKind::kCuda),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace eat
